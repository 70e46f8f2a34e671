//! Reconciliation (SPEC step 4 and "Reconciliation and degradation"):
//! voids reservations that no order event will ever back, applies releases
//! Redis has not seen, checks I7 per activity, repairs Redis from the
//! database, restores an activity Redis lost, and reports every difference
//! it found and every repair it made. One instance repairs at a time: a run
//! holds a lease in Redis.
//!
//! Voiding is arbitrated by the order row. The reservation is first claimed
//! in Redis (`void.lua`: open, never acknowledged, neither made nor sent
//! within the publish window), so no purchase retry can confirm it from
//! then on; then the order is inserted FAILED (`RESERVATION_EXPIRED`) with
//! `ON CONFLICT DO NOTHING`. If the consumer inserted it first, its row
//! stands and the reservation is committed instead; otherwise its stock is
//! released. A late event then finds the FAILED row and only releases what
//! is already released.

mod coupons;
mod cutoff;
pub mod lease;
pub mod repairs;
mod restore;
mod void;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer};
use serde::Serialize;
use tokio::sync::Notify;

use crate::admission::gate::Status;
use crate::admission::mode::Mode;
use crate::admission::{Layout, RedisGate, ReleaseReason};
use crate::bus::progress::GroupProgress;
use crate::bus::{Producer, Topics};
use crate::clock::SharedClock;
use crate::config::Settings;
use crate::domain::ActivityId;
use crate::metrics::Metrics;
use crate::orders::OrderStatus;
use crate::orders::events::OrderEvents;
use crate::store::notes::Notes;
use crate::store::{self, PgConn, PgPool};
use crate::worker::WorkerHandle;
use cutoff::Cutoff;
use repairs::Room;

/// How old a transfer between shards must be before reconciliation
/// completes it: a lending call takes milliseconds; a minute means it died.
const TRANSFER_GRACE_MS: i64 = 60_000;

/// Why a voided order failed.
pub const RESERVATION_EXPIRED: &str = "RESERVATION_EXPIRED";

/// The lease only one reconciler holds at a time.
const LEASE: &str = "reconcile";

/// Where the last run's reports are kept.
const LAST_RUN: &str = "reconcile:last";

/// One run's reports, as the operator sees them.
#[derive(Serialize)]
struct LastRun<'a> {
    /// When the run ended.
    at: chrono::DateTime<chrono::Utc>,
    /// Which instance ran it.
    by: &'a str,
    /// One report per activity.
    activities: &'a [Report],
}

/// What one activity's reconciliation found and did.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Report {
    /// The activity.
    #[schema(value_type = i64)]
    pub activity_id: ActivityId,
    /// No difference found.
    pub consistent: bool,
    /// Each difference, in words.
    pub differences: Vec<String>,
    /// Each repair made, in words.
    pub repaired: Vec<String>,
    /// Whether Redis lost the activity and it is not restored yet.
    #[serde(skip)]
    pub restoring: bool,
}

impl Report {
    fn new(activity_id: ActivityId) -> Self {
        Self {
            activity_id,
            consistent: true,
            differences: Vec::new(),
            repaired: Vec::new(),
            restoring: false,
        }
    }
}

/// What reconciliation works with.
#[derive(Clone)]
pub struct Reconciler {
    /// Source of truth.
    pub db: PgPool,
    /// Redis stock and reservations.
    pub gate: Arc<RedisGate>,
    /// The reconcile lease and the last run's report.
    pub notes: Notes,
    /// Windows and intervals.
    pub settings: Arc<Settings>,
    /// Difference and repair counters.
    pub metrics: Metrics,
    /// How far the order consumers have provably got.
    pub progress: Arc<GroupProgress>,
    /// Publishes an acknowledged event again when the broker lost it.
    pub producer: Producer,
    /// Topic names.
    pub topics: Topics,
    /// Who this reconciler is when it holds the lease.
    pub owner: String,
    /// The sale clock (ends of activities, ages of reservations).
    pub clock: SharedClock,
    /// Announces the orders a void fails to whoever follows them.
    pub order_events: Arc<OrderEvents>,
    /// Coupon batches in Redis (restored when lost).
    pub coupons: Arc<crate::coupons::gate::CouponGate>,
    /// How far the coupon claimer has provably got.
    pub coupon_progress: Arc<GroupProgress>,
}

/// Runs reconciliation every `reconcile.interval_secs`, soon when `wake`
/// is notified (admission met an activity Redis lost), and every second
/// while a restore waits for its moment — never more than once a second,
/// however often it is woken.
pub fn spawn(r: Reconciler, wake: Arc<Notify>) -> WorkerHandle {
    let interval = r.settings.reconcile.interval_secs;
    let at_most_every = Duration::from_secs(1).min(interval);
    WorkerHandle::spawn(|stop| async move {
        let mut next = interval;
        let mut last_run: Option<tokio::time::Instant> = None;
        // Activities already reported as waiting for a restore: reported
        // once, not on every run until it happens.
        let mut waiting: HashSet<ActivityId> = HashSet::new();
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(next) => {}
                _ = wake.notified() => {}
            }
            if let Some(last) = last_run {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep_until(last + at_most_every) => {}
                }
            }
            last_run = Some(tokio::time::Instant::now());
            next = interval;
            match r.run().await {
                Ok(Some(reports)) => {
                    for report in &reports {
                        if report.restoring {
                            next = at_most_every;
                            if !waiting.insert(report.activity_id) {
                                continue;
                            }
                        } else {
                            waiting.remove(&report.activity_id);
                        }
                        if !report.consistent || !report.repaired.is_empty() {
                            tracing::warn!(
                                activity_id = %report.activity_id,
                                differences = ?report.differences,
                                repaired = ?report.repaired,
                                "reconciliation found differences"
                            );
                        }
                    }
                }
                Ok(None) => tracing::debug!("another instance holds the reconcile lease"),
                Err(e) => tracing::warn!(error = format!("{e:#}"), "reconciliation failed"),
            }
        }
    })
}

#[derive(QueryableByName)]
struct Figures {
    #[diesel(sql_type = Integer)]
    total: i32,
    #[diesel(sql_type = Integer)]
    available: i32,
    #[diesel(sql_type = Integer)]
    locked: i32,
    #[diesel(sql_type = Integer)]
    sold: i32,
    #[diesel(sql_type = BigInt)]
    waiting_units: i64,
    #[diesel(sql_type = BigInt)]
    paid_units: i64,
}

/// A cancelled or closed order, whose units Redis must have got back.
#[derive(QueryableByName)]
struct Released {
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

/// The reconcile lease's lifetime when `reconcile.lease_secs` is unset.
const DEFAULT_LEASE: Duration = Duration::from_secs(30);

impl Reconciler {
    /// What this run changes in Redis, through the gate's connection,
    /// each write fenced with the run's lease token `fence`.
    fn repairs(&self, fence: i64) -> repairs::Repairs<'_> {
        repairs::Repairs::new(&self.gate, fence)
    }

    /// Reconciles every recent, warmed activity; `None` when another
    /// instance holds the lease.
    ///
    /// The lease is renewed every third of its lifetime while the run
    /// lasts, and checked before each activity: a run that lost it (Redis
    /// restarted, or a renewal failed for a whole lifetime and another
    /// instance took it) stops there instead of repairing or restoring
    /// beside the new holder.
    pub async fn run(&self) -> anyhow::Result<Option<Vec<Report>>> {
        // Short: an instance killed while it held the lease holds up
        // every repair (a restore of a Redis lost meanwhile among them)
        // until it expires. The renewal keeps a long run holding it.
        let ttl = self.settings.reconcile.lease_secs.unwrap_or(DEFAULT_LEASE);
        let Some(lease) = lease::Held::take(&self.notes, LEASE, &self.owner, ttl).await? else {
            return Ok(None);
        };
        let reports = self.run_holding_the_lease(&lease).await;
        if let Ok(reports) = &reports {
            self.keep_the_report(reports).await;
        }
        lease.end().await;
        reports.map(Some)
    }

    /// Keeps this run's reports in Redis for the operator (whichever
    /// instance ran it), and the stock figures in the gauges. Best effort:
    /// the run's work is done either way.
    async fn keep_the_report(&self, reports: &[Report]) {
        let last = LastRun {
            at: self.clock.now(),
            by: &self.owner,
            activities: reports,
        };
        let ttl = (self.settings.reconcile.interval_secs.as_secs())
            .saturating_mul(10)
            .max(3600);
        match serde_json::to_string(&last) {
            Ok(json) => {
                if let Err(e) = self.notes.put_note(LAST_RUN, &json, ttl).await {
                    tracing::debug!(error = %e, "last reconciliation report not kept");
                }
            }
            Err(e) => tracing::debug!(error = %e, "last reconciliation report not written"),
        }
        let differing = reports.iter().filter(|r| !r.consistent).count();
        self.metrics
            .reconcile_inconsistent
            .set(i64::try_from(differing).unwrap_or(i64::MAX));
        self.metrics
            .reconcile_last_run
            .set(self.clock.now().timestamp());
    }

    /// The last run's report, as [`Reconciler::run`] kept it (JSON), if one
    /// ran within its keeping time.
    pub async fn last_report(&self) -> anyhow::Result<Option<serde_json::Value>> {
        let Some(json) = self.notes.note(LAST_RUN).await? else {
            return Ok(None);
        };
        Ok(Some(serde_json::from_str(&json)?))
    }

    async fn run_holding_the_lease(&self, lease: &lease::Held) -> anyhow::Result<Vec<Report>> {
        let ids = store::run(&self.db, |conn| {
            Ok(crate::activities::repo::to_reconcile(conn)?)
        })
        .await?;
        let cleanup_after = chrono::Duration::milliseconds(crate::clock::millis(
            self.settings.reconcile.cleanup_after_secs,
        ));
        // Asked of Kafka once per run, for every activity.
        let cutoff = self.void_cutoff().await;
        let mut reports = Vec::with_capacity(ids.len());
        for a in ids {
            anyhow::ensure!(
                lease.holds(),
                "the reconcile lease was lost mid-run; stopping before activity {}",
                a.id
            );
            // One activity that fails (a shard's master away, a poisoned
            // row) is reported and left to the next run; the others, and
            // the coupons after them, are reconciled all the same.
            let id = a.id;
            match self
                .one_activity(a, &cutoff, cleanup_after, lease.token())
                .await
            {
                Ok(report) => reports.push(report),
                Err(e) => {
                    tracing::warn!(activity_id = %id, error = format!("{e:#}"), "reconciling an activity failed; the others go on");
                    self.count("difference", "activity_failed");
                    let mut report = Report::new(id);
                    report.consistent = false;
                    report
                        .differences
                        .push(format!("not reconciled this run: {e:#}"));
                    reports.push(report);
                }
            }
        }
        anyhow::ensure!(
            lease.holds(),
            "the reconcile lease was lost mid-run; stopping before the coupons"
        );
        let waiting = self.restore_coupons(lease.token(), &cutoff).await?;
        if !waiting.is_empty() {
            tracing::debug!(coupons = ?waiting, "lost coupon batches wait for their restore");
        }
        Ok(reports)
    }

    /// One activity's reconciliation: its restore when Redis lost it, else
    /// its check, repairs and (once ended and settled) its clean-up.
    ///
    /// The activity is first claimed with the run's fence: from then on a
    /// run holding an older lease (a process paused past the lease's
    /// lifetime) has every write to its keys refused, so it can never
    /// restore or repair over what this run read and wrote.
    async fn one_activity(
        &self,
        a: crate::activities::repo::ToReconcile,
        cutoff: &Cutoff,
        cleanup_after: chrono::Duration,
        fence: i64,
    ) -> anyhow::Result<Report> {
        let (id, layout, end_at) = (a.id, a.layout, a.end_at);
        self.repairs(fence).claim(id, layout).await?;
        let mut warm = self.gate.is_warm(id).await?;
        if warm && !self.repairs(fence).shards_warm(id, layout).await? {
            // A shard lost alone: what the other shards hold cannot be
            // trusted beside it, so the activity is restored whole.
            self.repairs(fence)
                .remove_activity(id, layout, Room::Keep)
                .await?;
            self.count("repair", "lost_shard_keys_dropped");
            tracing::warn!(
                activity_id = %id,
                "a shard of the activity is gone from Redis: its other keys are dropped, \
                 to be restored from the database"
            );
            warm = false;
        }
        if warm && a.mode != Mode::Redis {
            warm = self.back_from_fallback(id, layout, a.mode, fence).await?;
        }
        if !warm {
            return self.restore(id, cutoff, fence).await;
        }
        let mut report = self.activity(id, layout, cutoff, fence).await?;
        if self.clock.now() > end_at + cleanup_after && report.consistent {
            self.clean_up(id, layout, &mut report, fence).await?;
        }
        Ok(report)
    }

    /// Redis answers again for an activity admitted through the database
    /// (or being loaded back): true when it is warm in Redis and back on
    /// the Redis path. In DATABASE mode Redis holds the activity as it was
    /// before the fallback sold from the database, without those orders'
    /// units, request ids and holdings: its keys are dropped, and the
    /// restore loads it from the database once that is safe. In RESTORING
    /// mode the restore ran and only the switch back is left.
    async fn back_from_fallback(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        mode: Mode,
        fence: i64,
    ) -> anyhow::Result<bool> {
        if mode == Mode::Restoring {
            self.switch_admission(activity_id, &[Mode::Restoring], Mode::Redis)
                .await?;
            return Ok(true);
        }
        self.repairs(fence)
            .remove_activity(activity_id, layout, Room::Keep)
            .await?;
        self.count("repair", "fallback_keys_dropped");
        tracing::warn!(
            activity_id = %activity_id,
            "Redis answers again: its keys of an activity sold through the database \
             are dropped, to be restored from the database"
        );
        Ok(false)
    }

    /// Moves the activity's admission from `from` to `to`.
    async fn switch_admission(
        &self,
        activity_id: ActivityId,
        from: &'static [Mode],
        to: Mode,
    ) -> anyhow::Result<()> {
        let switched = store::run(&self.db, move |conn| {
            Ok(crate::activities::repo::switch_admission(
                conn,
                activity_id,
                from,
                to,
            )?)
        })
        .await?;
        if switched && to == Mode::Redis {
            tracing::warn!(activity_id = %activity_id, "activity admitted through Redis again");
        }
        Ok(())
    }

    /// After the end plus a grace, once every order is settled (none
    /// WAITING_PAY, so no release can still come; every release applied,
    /// none waiting in the outbox) and nothing is open, removes the
    /// activity's Redis keys and marks it ENDED (reservation records expire
    /// on their own TTL).
    async fn clean_up(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        report: &mut Report,
        fence: i64,
    ) -> anyhow::Result<()> {
        let ttl = self.settings.admission.reservation_ttl_secs;
        let (f, released, unsent) = store::snapshot(&self.db, move |conn| {
            Ok((
                figures(conn, activity_id)?,
                released_orders(conn, activity_id, ttl)?,
                unsent_releases(conn, activity_id)?,
            ))
        })
        .await?;
        let open = self.gate.open_reservations(activity_id, layout).await?;
        self.apply_releases(activity_id, layout, &released).await?;
        if f.waiting_units > 0 || open > 0 || unsent > 0 {
            return Ok(());
        }
        self.repairs(fence)
            .remove_activity(activity_id, layout, Room::Drop)
            .await?;
        self.forget_stock(activity_id);
        store::run(&self.db, move |conn| {
            Ok(crate::activities::repo::mark_ended(conn, activity_id)?)
        })
        .await?;
        self.count("repair", "cleanup");
        report.repaired.push("ended: Redis keys removed".to_owned());
        Ok(())
    }

    /// Reconciles one warm activity; reservations before `cutoff` are voided.
    async fn activity(
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
    fn show_stock(&self, activity_id: ActivityId, redis_available: i64, open: i64, f: &Figures) {
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
    fn forget_stock(&self, activity_id: ActivityId) {
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
    async fn apply_releases(
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

    fn count(&self, what: &str, kind: &str) {
        self.metrics
            .reconcile
            .with_label_values(&[what, kind])
            .inc();
    }
}

/// The activity's cancelled and closed orders whose release Redis may not
/// have seen yet: closed within a reservation's lifetime (`ttl`).
fn released_orders(
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
fn unsent_releases(conn: &mut PgConn, activity_id: ActivityId) -> QueryResult<i64> {
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

fn figures(conn: &mut PgConn, activity_id: ActivityId) -> QueryResult<Figures> {
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
