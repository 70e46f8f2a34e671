//! One warm activity checked (I7): the database's figures against Redis's,
//! the releases Redis has not applied yet, drift repaired by
//! compare-and-set, and the reservations no event will back voided.

use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer};

use super::cutoff::Cutoff;
use super::{Reconciler, Report};
use crate::admission::gate::Status;
use crate::admission::{Layout, ReleaseReason};
use crate::domain::ActivityId;
use crate::orders::OrderStatus;
use crate::store::{self, PgConn};

/// How old a transfer between shards must be before reconciliation
/// completes it: a lending call takes milliseconds; a minute means it died.
const TRANSFER_GRACE_MS: i64 = 60_000;

#[derive(QueryableByName)]
pub(super) struct Figures {
    #[diesel(sql_type = Integer)]
    total: i32,
    #[diesel(sql_type = Integer)]
    available: i32,
    #[diesel(sql_type = Integer)]
    locked: i32,
    #[diesel(sql_type = Integer)]
    sold: i32,
    #[diesel(sql_type = BigInt)]
    pub(super) waiting_units: i64,
    #[diesel(sql_type = BigInt)]
    paid_units: i64,
}

/// A cancelled or closed order, whose units Redis must have got back.
#[derive(QueryableByName)]
pub(super) struct Released {
    #[diesel(sql_type = BigInt)]
    order_no: i64,
    #[diesel(sql_type = BigInt)]
    user_id: i64,
    #[diesel(sql_type = Integer)]
    quantity: i32,
    /// Made recently enough that its reservation record cannot have
    /// expired (records live `admission.reservation_ttl_secs` from the
    /// reservation; a day of slack).
    #[diesel(sql_type = diesel::sql_types::Bool)]
    record_alive: bool,
}

impl Reconciler {
    /// Reconciles one warm activity; reservations before `cutoff` are voided.
    pub(super) async fn activity(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        cutoff: &Cutoff,
        fence: i64,
    ) -> anyhow::Result<Report> {
        let mut report = Report::new(activity_id);
        self.void_stale(activity_id, layout, cutoff, fence, &mut report)
            .await?;
        // Units one shard lent another whose lending call never finished
        // (its process died, or Redis failed part way).
        let stale_before = self.clock.now_ms() - TRANSFER_GRACE_MS;
        let settled = self
            .gate
            .settle_transfers(activity_id, layout, stale_before)
            .await?;
        if settled > 0 {
            self.count("repair", "transfer_settled");
            report.repaired.push(format!(
                "completed {settled} unsettled transfers between shards"
            ));
        }

        // Redis first, then the database: a stock move in between shows up
        // as a purchase counted (the acceptance count) or a changed sum,
        // and the compare-and-set below refuses to act on it. The sum alone
        // missed a purchase and a release that cancel out in it.
        let mark = self.repairs(fence).mark(activity_id, layout).await?;
        // The figures and the releases to apply from ONE snapshot: a cancel
        // committing between two separate reads would have its units added
        // to Redis below but missing from the figures, and the repair would
        // take them away again (Redis one unit short until the next run).
        let ttl = self.settings.admission.reservation_ttl_secs;
        let (f, released) = store::snapshot(&self.db, move |conn| {
            Ok((
                figures(conn, activity_id)?,
                released_orders(conn, activity_id, ttl)?,
            ))
        })
        .await?;
        self.show_stock(activity_id, mark.available, mark.open, &f);
        // Every release of that snapshot is applied to Redis before the
        // comparison, by the same idempotent script the stock releaser
        // runs: the releaser's copy, later, is a no-op. A release committed
        // after the snapshot is in neither figure; if the releaser applies
        // it before the repair, the compare-and-set sees the moved sum.
        let added = self.apply_releases(activity_id, layout, &released).await?;
        if added > 0 {
            report.repaired.push(format!(
                "gave {added} units of cancelled or closed orders back to Redis (their release had not been applied)"
            ));
            self.count("repair", "release_applied");
        }

        let mut differ = |kind: &str, text: String| {
            self.metrics
                .reconcile
                .with_label_values(&["difference", kind])
                .inc();
            report.differences.push(text);
        };
        if i64::from(f.total) != i64::from(f.available) + i64::from(f.locked) + i64::from(f.sold) {
            differ(
                "db_total",
                format!(
                    "db total {} ≠ available {} + locked {} + sold {}",
                    f.total, f.available, f.locked, f.sold
                ),
            );
        }
        if i64::from(f.locked) != f.waiting_units {
            differ(
                "db_locked",
                format!(
                    "db locked {} ≠ Σ WAITING_PAY quantity {}",
                    f.locked, f.waiting_units
                ),
            );
        }
        if i64::from(f.sold) != f.paid_units {
            differ(
                "db_sold",
                format!("db sold {} ≠ Σ PAID quantity {}", f.sold, f.paid_units),
            );
        }
        let expected = mark.available + added;
        let db_available = i64::from(f.available);
        // Only while nothing is open, and only if nothing moved since
        // Redis was read: otherwise the figures describe different moments.
        let repaired = if mark.open == 0 && expected != db_available {
            self.repairs(fence)
                .repair(activity_id, layout, &mark, added, db_available)
                .await?
        } else {
            None
        };
        if let Some(applied) = repaired {
            differ(
                "redis_available",
                format!("redis available {expected} ≠ db available {db_available}"),
            );
            self.count("repair", "redis_available");
            report.repaired.push(format!(
                "redis available moved by {applied} to match the database"
            ));
        }
        report.consistent = report.differences.is_empty();
        Ok(report)
    }

    /// Sets the activity's stock gauges to what this run read.
    pub(super) fn show_stock(
        &self,
        activity_id: ActivityId,
        redis_available: i64,
        open: i64,
        f: &Figures,
    ) {
        let id = activity_id.to_string();
        let units = &self.metrics.stock_units;
        units
            .with_label_values(&[&id, "redis", "available"])
            .set(redis_available);
        for (state, n) in [
            ("available", f.available),
            ("locked", f.locked),
            ("sold", f.sold),
        ] {
            units.with_label_values(&[&id, "db", state]).set(n.into());
        }
        self.metrics
            .open_reservations
            .with_label_values(&[&id])
            .set(open);
    }

    /// Removes the gauges of an activity whose keys are gone.
    pub(super) fn forget_stock(&self, activity_id: ActivityId) {
        let id = activity_id.to_string();
        let units = &self.metrics.stock_units;
        let _ = units.remove_label_values(&[&id, "redis", "available"]);
        for state in ["available", "locked", "sold"] {
            let _ = units.remove_label_values(&[&id, "db", state]);
        }
        let _ = self.metrics.open_reservations.remove_label_values(&[&id]);
    }

    /// Applies, for every order of `released` whose release Redis
    /// has not seen, the release the stock releaser would apply (the same
    /// idempotent script, so the releaser's copy, later, is a no-op): when
    /// its reservation is still held (open or committed), and when its
    /// record is gone although it cannot have expired yet (Redis lost it;
    /// the script then records the release as it gives the units back).
    /// Returns the units given back now.
    pub(super) async fn apply_releases(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        released: &[Released],
    ) -> anyhow::Result<i64> {
        let mut added = 0;
        for chunk in released.chunks(500) {
            let nos: Vec<i64> = chunk.iter().map(|o| o.order_no).collect();
            let statuses = self.gate.statuses(activity_id, layout, &nos).await?;
            for (o, status) in chunk.iter().zip(statuses) {
                match status {
                    Some(Status::Released) => continue,
                    // Expired on its own TTL, maybe after its release was
                    // applied: adding the units again could oversell.
                    None if !o.record_alive => continue,
                    _ => {}
                }
                let reason = ReleaseReason::OrderReleased {
                    user_id: o.user_id,
                    quantity: o.quantity,
                };
                if self
                    .gate
                    .release(activity_id, o.order_no, layout, reason)
                    .await?
                {
                    added += i64::from(o.quantity);
                }
            }
        }
        Ok(added)
    }
}

/// The activity's cancelled and closed orders whose release Redis may not
/// have seen yet: closed within a reservation's lifetime (`ttl`).
pub(super) fn released_orders(
    conn: &mut PgConn,
    activity_id: ActivityId,
    ttl: Duration,
) -> QueryResult<Vec<Released>> {
    diesel::sql_query(format!(
        "SELECT order_no, user_id, quantity, \
           created_at > now() - make_interval(secs => $2) + interval '1 day' AS record_alive \
         FROM orders \
         WHERE activity_id = $1 AND status IN ({}) \
           AND closed_at > now() - make_interval(secs => $2)",
        OrderStatus::sql_list(&[OrderStatus::Cancelled, OrderStatus::Closed])
    ))
    .bind::<BigInt, _>(activity_id)
    .bind::<diesel::sql_types::Double, _>((crate::clock::millis(ttl) / 1000) as f64)
    .load(conn)
}

/// `stock.released` events of the activity the outbox has not sent yet.
pub(super) fn unsent_releases(conn: &mut PgConn, activity_id: ActivityId) -> QueryResult<i64> {
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let n: N = diesel::sql_query(
        "SELECT count(*) AS n FROM outbox WHERE topic = 'stock.released' \
           AND status IN ('NEW', 'RETRY') AND (payload->>'activity_id')::bigint = $1",
    )
    .bind::<BigInt, _>(activity_id)
    .get_result(conn)?;
    Ok(n.n)
}

pub(super) fn figures(conn: &mut PgConn, activity_id: ActivityId) -> QueryResult<Figures> {
    diesel::sql_query(format!(
        "SELECT s.total, s.available, s.locked, s.sold, \
           (SELECT COALESCE(sum(quantity), 0)::bigint FROM orders WHERE activity_id = $1 AND status = {}) AS waiting_units, \
           (SELECT COALESCE(sum(quantity), 0)::bigint FROM orders WHERE activity_id = $1 AND status = {}) AS paid_units \
         FROM stock s WHERE s.activity_id = $1",
        OrderStatus::WaitingPay.sql(),
        OrderStatus::Paid.sql()
    ))
    .bind::<BigInt, _>(activity_id)
    .get_result(conn)
}
