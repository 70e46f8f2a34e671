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

mod check;
mod coupons;
mod cutoff;
mod fallback;
pub mod lease;
pub mod repairs;
mod restore;
mod void;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::Notify;

use crate::admission::mode::Mode;
use crate::admission::{Layout, RedisGate};
use crate::bus::progress::GroupProgress;
use crate::bus::{Producer, Topics};
use crate::clock::SharedClock;
use crate::config::Settings;
use crate::domain::ActivityId;
use crate::metrics::Metrics;
use crate::orders::events::OrderEvents;
use crate::store::notes::Notes;
use crate::store::{self, PgPool};
use crate::worker::WorkerHandle;
use check::{figures, released_orders, unsent_releases};
use cutoff::Cutoff;
use repairs::Room;

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

    fn count(&self, what: &str, kind: &str) {
        self.metrics
            .reconcile
            .with_label_values(&[what, kind])
            .inc();
    }
}
