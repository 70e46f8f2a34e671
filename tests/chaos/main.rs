//! Fault tests: a real fault applied to a real process in the middle of a
//! sale, then the SPEC invariants checked. They stop, kill and restart the
//! broker, PostgreSQL, Redis and the server itself, so they run on services
//! of their own (other ports, another state folder), one at a time:
//! `scripts/chaos.sh` starts those services and runs them, and
//! `scripts/test.sh` runs `scripts/chaos.sh`. Run alone, they refuse to
//! start (they would stop the services the other tests use).

#[path = "../common/db.rs"]
mod db;
#[path = "../common/gdb.rs"]
mod gdb;
mod harness;
mod money;
mod nemesis;
mod replicated;
mod room;

use std::time::{Duration, Instant};

use harness::{Chaos, Fault, OnDrop, Outcome, Sale, signal};

/// 20 s of a stopped broker (SIGSTOP) in the middle of the burst, buyers
/// retrying 503s with the same request_id throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn the_broker_paused_for_twenty_seconds_mid_burst_loses_and_duplicates_nothing() {
    let chaos = Chaos::start("broker_paused").await;
    let sale = Sale::new(&chaos, 3000, 2000).await;
    let outcome = sale
        .run_with_fault(Fault::At(0.3), || async {
            let broker = chaos.services.pid("kafka");
            harness::signal(broker, "STOP");
            let _resume = harness::OnDrop(move || harness::signal(broker, "CONT"));
            tokio::time::sleep(Duration::from_secs(20)).await;
        })
        .await;
    chaos.settle_and_check(&sale, &outcome).await;
}

/// How long an instance may take to serve again after the broker comes
/// back from a pause: the stall window (10 s here), the broker's fencing
/// and unfencing, a rebuild and a group rejoin, sized for a loaded 2-core
/// host three times slower than the one this was written on.
const SERVE_AGAIN_WITHIN: Duration = Duration::from_secs(150);

/// The incident of 2026-12-01: the broker stopped (SIGSTOP) for 25 s while
/// buyers keep coming, long enough for the controller to fence it, then
/// continued; round after round (`SECKILL_WEDGE_ROUNDS`, 4 by default).
/// After each round the instance must serve again within
/// [`SERVE_AGAIN_WITHIN`]: ready, and a new purchase answered 202, with no
/// restart by hand (a server that exits by itself is started again, as a
/// supervisor would). Then the invariants, over every buyer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn the_broker_paused_round_after_round_the_instance_serves_again_after_each() {
    use futures_util::StreamExt;
    use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};

    let rounds: u32 = std::env::var("SECKILL_WEDGE_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(4);
    // The producer's messages time out after 5 s (the fault tests'
    // setting), so its connection is torn down and remade while the broker
    // is stopped; the other timings are the defaults. With the broker a
    // process apart from its controller (scripts/services.sh), which
    // fences it while it is stopped, the code before the probe (93f2f27)
    // wedged here in round 3 of one run and round 7 of another (not in a
    // third of 4 rounds): an order consumer whose group coordinator stayed
    // unreachable ("GroupCoordinator: Timed out 0 in-flight, 0
    // retry-queued, 20 out-queue", as in the incident), or a readiness
    // client that saw no broker, while a fresh client reached it at once.
    // With a 15 s message timeout it served again in all of 32 rounds, and
    // with one combined broker and controller in all of 10.
    let chaos = Chaos::start_with("broker_paused_rounds", |env| {
        env.extend([
            ("SECKILL__ADMISSION__PUBLISH_BUDGET_MS", "5000".to_owned()),
            ("SECKILL__RECONCILE__PUBLISH_WINDOW_SECS", "60".to_owned()),
            ("SECKILL__KAFKA__CONSUMER_STALL_SECS", "20".to_owned()),
        ]);
    })
    .await;
    // Never sells out: every round has stock to sell.
    let sale = Sale::new(&chaos, 0, 1_000_000).await;
    let done = AtomicBool::new(false);
    let in_flight = AtomicUsize::new(0);
    let next_user = AtomicI64::new(1);
    // New buyers every second (`SECKILL_WEDGE_BUYERS`, 20 as in the
    // incident), each retrying with its own request_id.
    let per_sec: u32 = std::env::var("SECKILL_WEDGE_BUYERS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(20);
    let trickle = async {
        let mut buying = futures_util::stream::FuturesUnordered::new();
        let mut bought = Vec::new();
        let mut tick = tokio::time::interval(Duration::from_secs(1) / per_sec.max(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick(), if !done.load(Ordering::Relaxed) => {
                    buying.push(sale.buyer(next_user.fetch_add(1, Ordering::Relaxed)));
                }
                Some(b) = buying.next() => bought.push(b),
                else => break,
            }
            in_flight.store(buying.len(), Ordering::Relaxed);
        }
        bought
    };
    let faults = async {
        let started = Instant::now();
        let mut probe_user = 50_000_000;
        let mut took = Vec::new();
        for round in 1..=rounds {
            tokio::time::sleep(Duration::from_secs(5)).await;
            let broker = chaos.services.pid("kafka");
            eprintln!(
                "broker_paused_rounds: round {round}: broker stopped at {:.1}s, {} buyers in flight",
                started.elapsed().as_secs_f64(),
                in_flight.load(Ordering::Relaxed)
            );
            signal(broker, "STOP");
            let resume = OnDrop(move || signal(broker, "CONT"));
            tokio::time::sleep(Duration::from_secs(25)).await;
            drop(resume);
            let continued = Instant::now();
            loop {
                chaos.restart_if_exited().await;
                if chaos.ready().await {
                    probe_user += 1;
                    if chaos.purchase_once(sale.activity, probe_user).await == 202 {
                        break;
                    }
                }
                assert!(
                    continued.elapsed() < SERVE_AGAIN_WITHIN,
                    "round {round}: not serving {}s after the broker continued; server logs: {}",
                    SERVE_AGAIN_WITHIN.as_secs(),
                    chaos.logs()
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            eprintln!(
                "broker_paused_rounds: round {round}: serving again {:.1}s after the broker continued",
                continued.elapsed().as_secs_f64()
            );
            took.push(continued.elapsed().as_secs_f64());
        }
        done.store(true, Ordering::Relaxed);
        took
    };
    let (bought, took) = tokio::join!(trickle, faults);
    eprintln!("broker_paused_rounds: serving again after each round (s): {took:.1?}");
    chaos.settle_and_check(&sale, &Outcome { bought }).await;
}

/// A wedged instance still stops on SIGTERM within
/// `app.shutdown_timeout_secs` (10 s): the broker is stopped mid-sale, so
/// every Kafka client of the server waits on a coordinator that never
/// answers, and closing them would wait with it. Before the deadline
/// existed, such an instance closed its listener and ran on for minutes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn a_wedged_instance_stops_on_sigterm_within_its_shutdown_deadline() {
    let chaos = Chaos::start("wedged_sigterm").await;
    let sale = Sale::new(&chaos, 0, 1000).await;
    for user in 1..=20 {
        assert_eq!(chaos.purchase_once(sale.activity, user).await, 202);
    }
    let broker = chaos.services.pid("kafka");
    signal(broker, "STOP");
    let _resume = OnDrop(move || signal(broker, "CONT"));
    // Purchases in the producer's queue, consumers losing their coordinator.
    let buying = async {
        for user in 21..=40 {
            chaos.purchase_once(sale.activity, user).await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(15), buying).await;
    // The 10 s deadline, and 5 s of slack for a slow host's process exit.
    // Before the deadline, such an instance stopped 18 s after SIGTERM
    // here, and ran on for minutes in the incident of 2026-12-01.
    let stopped = chaos.terminate_server(Duration::from_secs(15)).await;
    eprintln!("wedged_sigterm: stopped after {stopped:?}");
    assert!(
        stopped.is_some(),
        "still running 15 s after SIGTERM (app.shutdown_timeout_secs = 10); see {}",
        chaos.logs()
    );
}

/// The broker killed (SIGKILL) mid-burst and started again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn the_broker_killed_and_restarted_mid_burst_loses_and_duplicates_nothing() {
    let chaos = Chaos::start("broker_killed").await;
    let sale = Sale::new(&chaos, 3000, 2000).await;
    let outcome = sale
        .run_with_fault(Fault::At(0.3), || async {
            harness::signal(chaos.services.pid("kafka"), "KILL");
            tokio::time::sleep(Duration::from_secs(3)).await;
            chaos.services.up().await;
        })
        .await;
    chaos.settle_and_check(&sale, &outcome).await;
}

/// PostgreSQL restarted while the consumers write the orders of a burst.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn postgres_restarted_mid_drain_loses_and_duplicates_nothing() {
    let chaos = Chaos::start_with("postgres_restarted", |env| {
        // Small batches: the drain takes long enough to be interrupted.
        env.push(("SECKILL__ORDERS__BATCH_SIZE", "5".into()));
        // A checkout gives up after 1 s, well inside the outage below: a
        // batch a consumer begins while PostgreSQL is down fails, however
        // quickly it comes back.
        env.push(("SECKILL__POSTGRES__TIMEOUT_MS", "1000".into()));
    })
    .await;
    let sale = Sale::new(&chaos, 3000, 2000).await;
    let outcome = sale
        .run_with_fault(Fault::At(0.3), || async {
            // Stopped while a consumer is provably mid-batch: its writes
            // wait on a lock of the test's, then the stop ends them. On a
            // starved host the consumers otherwise keep up, and after 5 s
            // without the database the sale pauses (its admission modes
            // are no longer trusted), so nothing waited to be written
            // (fresh runs 19 and 21).
            let (held, waited) = chaos.hold_order_writes().await;
            eprintln!("postgres_restarted: a consumer mid-batch: {waited}");
            chaos.services.stop("postgres").await;
            drop(held);
            tokio::time::sleep(Duration::from_secs(3)).await;
            chaos.services.up().await;
        })
        .await;
    chaos.settle_and_check(&sale, &outcome).await;
    assert!(
        chaos.log_lines_with(BATCH_FAILED) > 0,
        "the restart interrupted the consumers' batches"
    );
}

/// What the order consumer logs when a batch fails and is tried again.
const BATCH_FAILED: &str = "order batch failed; retrying";

/// Redis flushed (FLUSHALL) mid-sale: reservations, tokens, stock, all of
/// it. The reconciler restores the activity from the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn redis_flushed_mid_sale_is_restored_and_loses_and_duplicates_nothing() {
    let chaos = Chaos::start("redis_flushed").await;
    let sale = Sale::new(&chaos, 3000, 2000).await;
    let outcome = sale
        .run_with_fault(Fault::At(0.3), || async {
            chaos.services.flush_redis().await;
        })
        .await;
    chaos.settle_and_check(&sale, &outcome).await;
    assert!(
        chaos.log_lines_with("activity restored into Redis from the database") > 0,
        "the reconciler restored the activity"
    );
}

/// Redis killed (SIGKILL; every master of a cluster) mid-sale and started
/// again 40 s later, empty:
/// the sale goes on through the database fallback, then returns to Redis,
/// which reconciliation loads from the database (the fallback's orders'
/// request ids and holdings with it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn redis_killed_mid_sale_falls_back_to_the_database_and_returns() {
    let chaos = Chaos::start_with("redis_killed", fallback_env).await;
    let sale = Sale::new(&chaos, 4000, 3000).await;
    let outcome = sale
        .run_with_fault(Fault::At(0.2), || async {
            for pid in chaos.services.redis_pids() {
                signal(pid, "KILL");
            }
            tokio::time::sleep(Duration::from_secs(40)).await;
            chaos.services.up().await;
        })
        .await;
    chaos.settle_and_check(&sale, &outcome).await;
    fallback_then_redis(&chaos, &sale, &outcome).await;
}

/// Redis stopped (SIGSTOP; every master of a cluster) mid-sale for 40 s:
/// it comes back holding the activity as it was before the fallback sold
/// from the database, so its keys are dropped and loaded again from the
/// database.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn redis_paused_mid_sale_falls_back_to_the_database_and_returns() {
    let chaos = Chaos::start_with("redis_paused", fallback_env).await;
    let sale = Sale::new(&chaos, 4000, 3000).await;
    let pids = chaos.services.redis_pids();
    let resume = pids.clone();
    let _resume = OnDrop(move || resume.iter().for_each(|&pid| signal(pid, "CONT")));
    let outcome = sale
        .run_with_fault(Fault::At(0.2), || async {
            pids.iter().for_each(|&pid| signal(pid, "STOP"));
            tokio::time::sleep(Duration::from_secs(40)).await;
            pids.iter().for_each(|&pid| signal(pid, "CONT"));
        })
        .await;
    chaos.settle_and_check(&sale, &outcome).await;
    fallback_then_redis(&chaos, &sale, &outcome).await;
    assert!(
        chaos.log_lines_with("are dropped, to be restored from the database") > 0,
        "the stale keys were dropped"
    );
}

/// The fallback rate is low enough that stock is left for Redis after it,
/// even on a slow host where the switch back takes long: a minute of the
/// fallback sells 1,500 of the 3,000 units.
fn fallback_env(env: &mut Vec<(&'static str, String)>) {
    env.push(("SECKILL__ADMISSION__FALLBACK_RATE_PER_SEC", "25".to_owned()));
}

/// After [`Chaos::settle_and_check`]: the database sold during the outage
/// and Redis after it.
async fn fallback_then_redis(chaos: &Chaos, sale: &Sale<'_>, outcome: &Outcome) {
    let by_database = chaos
        .count(&format!(
            "SELECT count(*) AS n FROM orders WHERE activity_id = {} \
             AND (order_no >> 12) & 1023 = 1023",
            sale.activity
        ))
        .await;
    assert!(by_database > 0, "the database fallback sold");
    assert!(
        outcome.through_database() > 0,
        "202s marked X-Seckill-Admission: database"
    );
    assert!(
        i64::try_from(outcome.through_database()).unwrap() <= by_database,
        "each marked 202 is a database order"
    );
    let after = chaos
        .count(&format!(
            "SELECT count(*) AS n FROM orders WHERE activity_id = {0} \
             AND (order_no >> 12) & 1023 <> 1023 AND created_at > \
             (SELECT max(created_at) FROM orders WHERE activity_id = {0} \
              AND (order_no >> 12) & 1023 = 1023)",
            sale.activity
        ))
        .await;
    assert!(after > 0, "Redis sold again after the fallback");
    assert_eq!(
        chaos
            .count(&format!(
                "SELECT count(*) AS n FROM activities WHERE id = {} AND admission = 'REDIS'",
                sale.activity
            ))
            .await,
        1,
        "admission is back on Redis"
    );
    assert!(chaos.log_lines_with("activity moved to the database fallback") > 0);
    assert!(chaos.log_lines_with("activity admitted through Redis again") > 0);
}

/// The server killed (SIGKILL) mid-burst and started again; buyers retry
/// through the outage with the same request_id.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn the_server_killed_mid_burst_and_restarted_loses_and_duplicates_nothing() {
    let chaos = Chaos::start("server_killed").await;
    let sale = Sale::new(&chaos, 3000, 2000).await;
    let outcome = sale
        .run_with_fault(Fault::At(0.3), || async {
            chaos.kill_server();
            tokio::time::sleep(Duration::from_secs(2)).await;
            chaos.restart_server().await;
        })
        .await;
    chaos.settle_and_check(&sale, &outcome).await;
}

/// Defect 12 of issue #25, second half: a coupon claim taken in Redis
/// whose delivery was still unknown when its server was killed (the
/// broker stopped, then killed too, so the event was lost) was never
/// written, and its client, told 503, never came back: the coupon stayed
/// taken in Redis with nothing behind it. The reconciler sends such a
/// claim again once the publish window has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn a_coupon_claim_unconfirmed_when_its_server_died_is_written_in_the_end() {
    let chaos = Chaos::start("claim_unconfirmed").await;
    let coupon = chaos.create_coupons(5).await;
    // A first claim on a healthy broker; a slow host may answer 503 (the
    // delivery outlasted the budget), which a client retries as it is.
    let started = Instant::now();
    loop {
        match chaos.claim_once(coupon, 1, "first").await {
            200 | 202 => break,
            503 | 0 if started.elapsed() < Duration::from_secs(120) => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            other => panic!("the first claim answered {other}"),
        }
    }
    let broker = chaos.services.pid("kafka");
    signal(broker, "STOP");
    let resume = OnDrop(move || signal(broker, "CONT"));
    // Taken in Redis; the delivery outlasts the publish budget (3 s).
    assert_eq!(chaos.claim_once(coupon, 2, "unconfirmed").await, 503);
    let stats = chaos.coupon_stats(coupon).await.expect("stats");
    assert_eq!(stats["redis_remaining"], 3, "the claim is kept: {stats}");
    chaos.kill_server();
    // What the dead server had written to its socket may still sit unread
    // in the stopped broker's: the broker is killed too, so the event is
    // lost for certain, and started again.
    signal(broker, "KILL");
    std::mem::forget(resume);
    chaos.services.start("kafka").await;
    chaos.restart_server().await;
    // No retry by the client: the claim is written all the same, and Redis
    // and the database agree on what is left.
    let started = Instant::now();
    loop {
        let stats = chaos.coupon_stats(coupon).await;
        if let Some(s) = &stats
            && s["db_claimed"] == 2
            && s["redis_remaining"] == 3
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the unconfirmed claim was never written: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(
        chaos
            .count(&format!(
                "SELECT count(*) AS n FROM user_coupons WHERE coupon_id = {coupon} AND user_id = 2 \
                 AND request_id = 'unconfirmed'"
            ))
            .await,
        1
    );
    // The reconciler logs the claim it sent again once its delivery is
    // reported: the consumer can write the row first, so the line may come
    // a little after the row (a fresh run read the log 9 ms too early).
    let started = Instant::now();
    while chaos.log_lines_with("was sent again") == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the claim was written, but not by the reconciler sending it again"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The randomized fault test (`nemesis.rs`): a seeded schedule of
/// overlapping faults on every process over three minutes of a sale that
/// buys, pays, cancels, times out and claims coupons, then a checker over
/// every answer the clients got.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn nemesis_overlapping_faults_over_buying_paying_cancelling_and_claiming() {
    let (seed, providers) = nemesis::providers().await;
    let chaos = Chaos::start_with("nemesis", |env| env.extend(providers.env())).await;
    nemesis::run(&chaos, seed, &providers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "fault test: run by scripts/chaos.sh on services of its own"]
async fn two_api_instances_and_a_worker_sell_a_thousand_units_to_twenty_thousand_buyers() {
    // API-only nodes (no consumer of any kind) with the default instance-id
    // configuration, and one `seckill consume` worker.
    let api_only = [
        ("SECKILL__ORDERS__CONSUMER_ENABLED", "false".to_owned()),
        ("SECKILL__WORKERS__RELEASER_ENABLED", "false".to_owned()),
        ("SECKILL__WORKERS__CLAIMER_ENABLED", "false".to_owned()),
    ];
    let chaos = Chaos::start_with("two_instances", |env| env.extend(api_only.clone())).await;
    let (_second, second_url) = chaos.spawn_server("api2", &["--no-consumer"]).await;
    let _worker = chaos.spawn("worker", &["consume"], &[]);
    let first_url = chaos.base_url();
    let out = chaos
        .run(
            "loadgen",
            &[
                "loadgen",
                "--url",
                &first_url,
                "--url",
                &second_url,
                "--users",
                "20000",
                "--stock",
                "1000",
                "--concurrency",
                "64",
                "--drain-timeout",
                "300",
                "--json",
            ],
        )
        .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("two_instances: {stdout}");
    assert!(out.status.success(), "loadgen: invariants failed\n{stdout}");
    let report: serde_json::Value =
        serde_json::from_str(stdout.lines().last().unwrap_or_default()).expect("the JSON report");
    assert_eq!(report["invariants_ok"], true);
    assert_eq!(report["accepted"], 1000, "every unit sold, none twice");
    // Both instances made order numbers, each under its own leased id.
    let instances = chaos
        .count("SELECT count(DISTINCT (order_no >> 12) & 1023) AS n FROM orders")
        .await;
    assert_eq!(instances, 2);
    assert_eq!(chaos.count("SELECT count(*) AS n FROM orders").await, 1000);
}
