//! What the load generator makes of a burst: the report, and, after the
//! consumers drain, the invariant check against the stats route.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::Value;

use super::args::LoadgenArgs;
use super::client::Client;
use super::report::{Outcome, Report};
use crate::domain::ActivityId;
use crate::orders::OrderStatus;

/// Waits for the consumers to drain the burst, then checks I1, I3, I4 and
/// I7 against the stats route, and records the outcome in `report`.
pub(super) async fn verify(
    client: &Client,
    admin: &str,
    outcomes: &[Outcome],
    report: &mut Report,
    args: &LoadgenArgs,
) -> anyhow::Result<()> {
    let order_nos: Vec<&String> = outcomes.iter().filter_map(|o| o.2.as_ref()).collect();
    let distinct = order_nos.iter().collect::<HashSet<_>>().len() as u64;
    let drain_started = Instant::now();
    let stats = drain(
        client,
        admin,
        report.activity_id,
        report.accepted,
        args.drain_timeout,
    )
    .await?;
    report.drain_seconds = Some(drain_started.elapsed().as_secs_f64());
    println!(
        "drained in {:.2}s after the burst ({} orders)",
        report.drain_seconds.unwrap_or(0.0),
        report.accepted
    );
    let failures = check(&stats, report.accepted, distinct, args.db_only);
    report.invariants_ok = Some(failures.is_empty());
    println!("stats: {stats}");
    if failures.is_empty() {
        println!("invariants I1 I3 I4 I7: OK");
    } else {
        for f in &failures {
            println!("INVARIANT FAILED: {f}");
        }
    }
    Ok(())
}

pub(super) fn summarize(activity_id: ActivityId, outcomes: &[Outcome], seconds: f64) -> Report {
    let count =
        |f: &dyn Fn(u16, &str) -> bool| outcomes.iter().filter(|o| f(o.0, &o.1)).count() as u64;
    // Microseconds, 3 significant digits, up to ten minutes.
    let histogram = || {
        hdrhistogram::Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)
            .expect("valid histogram bounds")
    };
    let (mut latencies, mut accepted_ms, mut refused_ms) = (histogram(), histogram(), histogram());
    for o in outcomes {
        let us = u64::try_from(o.3.as_micros()).unwrap_or(u64::MAX).max(1);
        latencies.saturating_record(us);
        if o.0 == 202 {
            accepted_ms.saturating_record(us);
        } else {
            refused_ms.saturating_record(us);
        }
    }
    let at = |h: &hdrhistogram::Histogram<u64>, q: f64| -> f64 {
        if h.is_empty() {
            return 0.0;
        }
        h.value_at_quantile(q) as f64 / 1000.0
    };
    let pct = |q: f64| at(&latencies, q);
    let accepted = count(&|s, _| s == 202);
    let sold_out = count(&|s, c| s == 409 && c == "SOLD_OUT");
    let limited = count(&|s, c| (s == 409 && c == "LIMIT_EXCEEDED") || s == 429);
    Report {
        activity_id,
        requests: outcomes.len() as u64,
        accepted,
        sold_out,
        limited,
        errors: outcomes.len() as u64 - accepted - sold_out - limited,
        seconds,
        per_sec: outcomes.len() as f64 / seconds.max(1e-9),
        p50_ms: pct(0.50),
        p90_ms: pct(0.90),
        p99_ms: pct(0.99),
        p999_ms: pct(0.999),
        max_ms: latencies.max() as f64 / 1000.0,
        p99_accepted_ms: at(&accepted_ms, 0.99),
        p99_refused_ms: at(&refused_ms, 0.99),
        rate: None,
        tokens_per_sec: None,
        drain_seconds: None,
        invariants_ok: None,
        server_cpu_us_per_request: None,
        host_busy: None,
        loadgen_cpu_us_per_request: None,
        sale: None,
    }
}

pub(super) fn print_report(r: &Report, codes: &BTreeMap<String, u64>) {
    println!("activity        {}", r.activity_id);
    println!("requests        {}", r.requests);
    println!("accepted (202)  {}", r.accepted);
    println!("sold out        {}", r.sold_out);
    println!("limited         {}", r.limited);
    println!("errors          {}", r.errors);
    println!("by status/code  {codes:?}");
    println!("elapsed         {:.3} s", r.seconds);
    println!("throughput      {:.0} purchases/s", r.per_sec);
    if let Some(t) = r.tokens_per_sec {
        println!("tokens          {t:.0}/s before the burst");
    }
    println!(
        "latency ms      p50 {:.2}  p90 {:.2}  p99 {:.2}  p99.9 {:.2}  max {:.2}",
        r.p50_ms, r.p90_ms, r.p99_ms, r.p999_ms, r.max_ms
    );
    println!(
        "p99 ms          accepted {:.2}  refused {:.2}",
        r.p99_accepted_ms, r.p99_refused_ms
    );
}

async fn stats(client: &Client, admin: &str, activity_id: ActivityId) -> anyhow::Result<Value> {
    let path = format!("/api/v1/admin/activities/{activity_id}/stats");
    let (status, body) = client
        .send(reqwest::Method::GET, &path, admin, None)
        .await?;
    if status != 200 {
        bail!("stats: {status} {body}");
    }
    Ok(body)
}

/// Waits until no reservation is open and every accepted order has a row.
async fn drain(
    client: &Client,
    admin: &str,
    activity_id: ActivityId,
    accepted: u64,
    timeout: u64,
) -> anyhow::Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(timeout);
    loop {
        let s = stats(client, admin, activity_id).await?;
        let rows = OrderStatus::STORED
            .iter()
            .map(|k| s["orders"][k.as_str()].as_u64().unwrap_or(0))
            .sum::<u64>();
        if s["reservations_open"] == 0 && rows >= accepted {
            return Ok(s);
        }
        if Instant::now() > deadline {
            println!("drain timed out after {timeout}s");
            return Ok(s);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The invariants checkable from outside; each failure described.
/// `db_only` leaves Redis out (a design that keeps no stock there).
fn check(s: &Value, accepted: u64, distinct_order_nos: u64, db_only: bool) -> Vec<String> {
    let n = |v: &Value| v.as_i64().unwrap_or(i64::MIN);
    let (total, avail, locked, sold) = (
        n(&s["stock_total"]),
        n(&s["db_available"]),
        n(&s["db_locked"]),
        n(&s["db_sold"]),
    );
    let redis = n(&s["redis_available"]);
    let o = &s["orders"];
    let count = |status: OrderStatus| n(&o[status.as_str()]);
    let (waiting, paid, failed) = (
        count(OrderStatus::WaitingPay),
        count(OrderStatus::Paid),
        count(OrderStatus::Failed),
    );
    let processing = count(OrderStatus::Processing);
    let mut failures = Vec::new();
    let mut expect = |ok: bool, what: String| {
        if !ok {
            failures.push(what);
        }
    };
    expect(
        accepted as i64 <= total,
        format!("I1: accepted {accepted} > stock {total}"),
    );
    expect(
        avail >= 0 && (db_only || redis >= 0),
        format!("I1: negative stock (db {avail}, redis {redis})"),
    );
    expect(
        waiting + paid <= total,
        format!("I1: live orders {} > stock {total}", waiting + paid),
    );
    expect(
        distinct_order_nos == accepted,
        format!("I3: {distinct_order_nos} distinct order_nos for {accepted} accepted"),
    );
    expect(
        waiting + paid + failed == accepted as i64,
        format!(
            "I4: {accepted} accepted but {} order rows",
            waiting + paid + failed
        ),
    );
    expect(
        processing == 0,
        format!("I4: {processing} still PROCESSING"),
    );
    expect(
        total == avail + locked + sold,
        format!("I7: total {total} ≠ {avail} + {locked} + {sold}"),
    );
    expect(
        db_only || redis == avail,
        format!("I7: redis available {redis} ≠ db available {avail}"),
    );
    expect(
        locked == waiting,
        format!("I7: locked {locked} ≠ WAITING_PAY {waiting} (quantity 1 each)"),
    );
    expect(sold == paid, format!("I7: sold {sold} ≠ PAID {paid}"));
    failures
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn stats(total: i64, avail: i64, locked: i64, redis: i64, waiting: i64) -> Value {
        json!({"stock_total": total, "db_available": avail, "db_locked": locked, "db_sold": 0,
        "redis_available": redis,
        "orders": {
            OrderStatus::Processing.as_str(): 0,
            OrderStatus::WaitingPay.as_str(): waiting,
            OrderStatus::Paid.as_str(): 0,
            OrderStatus::Failed.as_str(): 0,
        }})
    }

    #[test]
    fn the_check_passes_a_consistent_sale_and_names_each_broken_invariant() {
        assert!(check(&stats(100, 0, 100, 0, 100), 100, 100, false).is_empty());
        assert!(
            check(&stats(100, 0, 100, 100, 100), 100, 100, true).is_empty(),
            "db_only ignores Redis"
        );
        let oversold = check(&stats(100, 0, 100, 0, 100), 101, 101, false);
        assert!(oversold.iter().any(|f| f.starts_with("I1")), "{oversold:?}");
        let dup = check(&stats(100, 0, 100, 0, 100), 100, 99, false);
        assert!(dup.iter().any(|f| f.starts_with("I3")));
        let drift = check(&stats(100, 1, 99, 0, 99), 99, 99, false);
        assert!(
            drift.iter().any(|f| f.contains("redis available")),
            "{drift:?}"
        );
        let lost = check(&stats(100, 1, 99, 1, 99), 100, 100, false);
        assert!(lost.iter().any(|f| f.starts_with("I4")), "{lost:?}");
    }

    #[test]
    fn percentiles_come_from_the_histogram_of_every_purchase() {
        // 1 ms … 1000 ms, one purchase each, in shuffled order.
        let mut outcomes: Vec<Outcome> = (1..=1000u64)
            .map(|ms| (202, String::new(), None, Duration::from_millis(ms)))
            .collect();
        fastrand::shuffle(&mut outcomes);
        let r = summarize(ActivityId::new(1), &outcomes, 2.0);
        let near = |got: f64, want: f64| (got - want).abs() <= want * 0.002;
        assert!(near(r.p50_ms, 500.0), "{}", r.p50_ms);
        assert!(near(r.p99_ms, 990.0), "{}", r.p99_ms);
        assert!(near(r.p999_ms, 999.0), "{}", r.p999_ms);
        assert!(near(r.max_ms, 1000.0), "{}", r.max_ms);
        assert_eq!((r.requests, r.accepted, r.errors), (1000, 1000, 0));
        assert!(near(r.per_sec, 500.0));
    }
}
