//! Reconciliation (SPEC step 4 and "Reconciliation and degradation"):
//! voids reservations that no order event will ever back, checks I7 per
//! activity, repairs Redis from the database when nothing is in flight, and
//! reports every difference it found and every repair it made.
//!
//! Voiding is arbitrated by the order row: the reconciler inserts the order
//! as FAILED (`RESERVATION_EXPIRED`) with `ON CONFLICT DO NOTHING`; if the
//! consumer inserted it first, the consumer's row stands and the reservation
//! is committed instead. Whoever inserts first wins; a late event then finds
//! the FAILED row and only releases what is already released.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use chrono::Utc;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Text};
use serde::Serialize;

use crate::admission::{RedisGate, ReleaseReason};
use crate::bus::Topics;
use crate::bus::progress::GroupProgress;
use crate::config::Settings;
use crate::metrics::Metrics;
use crate::store::{self, PgConn, PgPool};
use crate::worker::WorkerHandle;
use rdkafka::producer::FutureProducer;

/// `POST /api/v1/admin/reconcile`: reconciles every recent activity now.
pub async fn route(
    _admin: crate::http::auth::AdminUser,
    state: actix_web::web::Data<crate::app::AppState>,
) -> Result<actix_web::HttpResponse, crate::http::error::ApiError> {
    let reports = state
        .reconciler()
        .run()
        .await
        .map_err(crate::http::error::ApiError::unavailable)?;
    Ok(actix_web::HttpResponse::Ok().json(serde_json::json!({"activities": reports})))
}

/// Why a voided order failed.
pub const RESERVATION_EXPIRED: &str = "RESERVATION_EXPIRED";

/// What one activity's reconciliation found and did.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The activity.
    pub activity_id: i64,
    /// No difference found.
    pub consistent: bool,
    /// Each difference, in words.
    pub differences: Vec<String>,
    /// Each repair made, in words.
    pub repaired: Vec<String>,
}

/// What reconciliation works with.
#[derive(Clone)]
pub struct Reconciler {
    /// Source of truth.
    pub db: PgPool,
    /// Redis stock and reservations.
    pub gate: Arc<RedisGate>,
    /// Grace and settle times.
    pub settings: Arc<Settings>,
    /// Difference and repair counters.
    pub metrics: Metrics,
    /// How far the order consumers have provably got.
    pub progress: Arc<GroupProgress>,
    /// Publishes an acknowledged event again when the broker lost it.
    pub producer: FutureProducer,
    /// Topic names.
    pub topics: Topics,
}

/// Runs reconciliation every `reconcile.interval_secs`.
pub fn spawn(r: Reconciler) -> WorkerHandle {
    let interval = Duration::from_secs(r.settings.reconcile.interval_secs.max(1));
    WorkerHandle::spawn(|stop| async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(interval) => {}
            }
            match r.run().await {
                Ok(reports) => {
                    for report in reports
                        .iter()
                        .filter(|r| !r.consistent || !r.repaired.is_empty())
                    {
                        tracing::warn!(
                            activity_id = report.activity_id,
                            differences = ?report.differences,
                            repaired = ?report.repaired,
                            "reconciliation found differences"
                        );
                    }
                }
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
    #[diesel(sql_type = BigInt)]
    releases_in_flight: i64,
}

impl Reconciler {
    /// Reconciles every recent, warmed activity.
    pub async fn run(&self) -> anyhow::Result<Vec<Report>> {
        let ids = store::run(&self.db, |conn| {
            Ok(crate::activities::repo::to_reconcile(conn)?)
        })
        .await?;
        let cleanup_after = chrono::Duration::seconds(
            i64::try_from(self.settings.reconcile.cleanup_after_secs).unwrap_or(i64::MAX / 4),
        );
        // Asked of Kafka once per run, for every activity.
        let cutoff = self.void_cutoff().await;
        let mut reports = Vec::with_capacity(ids.len());
        for (id, buckets, end_at) in ids {
            let buckets = usize::try_from(buckets).unwrap_or(1).max(1);
            let mut report = self.activity(id, buckets, &cutoff).await?;
            if Utc::now() > end_at + cleanup_after && report.consistent {
                self.clean_up(id, buckets, &mut report).await?;
            }
            reports.push(report);
        }
        Ok(reports)
    }

    /// After the end plus a grace, once every order is settled (none
    /// WAITING_PAY, so no release can still come) and nothing is open or in
    /// flight, removes the activity's Redis keys and marks it ENDED
    /// (reservation records expire on their own TTL).
    async fn clean_up(
        &self,
        activity_id: i64,
        buckets: usize,
        report: &mut Report,
    ) -> anyhow::Result<()> {
        let settle = self.settings.reconcile.settle_secs as f64;
        let f: Figures = store::run(&self.db, move |conn| {
            Ok(figures(conn, activity_id, settle)?)
        })
        .await?;
        let open = self.gate.open_reservations(activity_id).await?;
        if f.waiting_units > 0 || f.releases_in_flight > 0 || open > 0 {
            return Ok(());
        }
        self.gate.remove_activity(activity_id, buckets).await?;
        store::run(&self.db, move |conn| {
            Ok(crate::activities::repo::mark_ended(conn, activity_id)?)
        })
        .await?;
        self.metrics
            .reconcile
            .with_label_values(&["repair", "cleanup"])
            .inc();
        report.repaired.push("ended: Redis keys removed".to_owned());
        Ok(())
    }

    /// Reconciles one activity; reservations before `cutoff` are voided.
    async fn activity(
        &self,
        activity_id: i64,
        buckets: usize,
        cutoff: &Cutoff,
    ) -> anyhow::Result<Report> {
        let mut report = Report {
            activity_id,
            consistent: true,
            differences: Vec::new(),
            repaired: Vec::new(),
        };
        self.void_stale(activity_id, buckets, cutoff, &mut report)
            .await?;

        let settle = self.settings.reconcile.settle_secs as f64;
        let f: Figures = store::run(&self.db, move |conn| {
            Ok(figures(conn, activity_id, settle)?)
        })
        .await?;
        let redis = self.gate.available(activity_id, buckets).await?;
        let open = self.gate.open_reservations(activity_id).await?;

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
        let quiet = open == 0 && f.releases_in_flight == 0;
        if quiet && redis != i64::from(f.available) {
            differ(
                "redis_available",
                format!("redis available {redis} ≠ db available {}", f.available),
            );
            let applied = self
                .gate
                .repair(activity_id, buckets, i64::from(f.available) - redis)
                .await?;
            self.metrics
                .reconcile
                .with_label_values(&["repair", "redis_available"])
                .inc();
            report.repaired.push(format!(
                "redis available moved by {applied} to match the database"
            ));
        }
        report.consistent = report.differences.is_empty();
        Ok(report)
    }

    /// Voids open reservations no order event will back (SPEC step 4):
    /// those older than the publish window once the order consumers have
    /// provably applied every published event, else those older than the
    /// grace. A reservation whose event the broker acknowledged is never
    /// voided: when the consumers have provably applied everything and it is
    /// still open, the broker lost its event, which is published again.
    async fn void_stale(
        &self,
        activity_id: i64,
        buckets: usize,
        cutoff: &Cutoff,
        report: &mut Report,
    ) -> anyhow::Result<()> {
        for order_no in self.gate.open_before(activity_id, cutoff.before_ms).await? {
            let Some(r) = self.gate.reservation(activity_id, order_no).await? else {
                self.gate.forget_open(activity_id, order_no).await?;
                report.repaired.push(format!(
                    "dropped index entry {order_no} without a reservation"
                ));
                continue;
            };
            if let Some(event) = &r.event {
                if cutoff.proven {
                    self.republish(order_no, event).await?;
                    report.repaired.push(format!(
                        "published again the event of reservation {order_no} \
                         (acknowledged, but the consumers never got it)"
                    ));
                }
                continue;
            }
            let request_id = r.request_id.clone();
            let status = store::run(&self.db, move |conn| {
                Ok(void_order(
                    conn,
                    activity_id,
                    order_no,
                    r.user_id,
                    &request_id,
                    r.quantity,
                )?)
            })
            .await?;
            if status == "FAILED" {
                self.gate
                    .release(activity_id, order_no, buckets, ReleaseReason::OrderFailed)
                    .await?;
                self.metrics
                    .reconcile
                    .with_label_values(&["repair", "voided"])
                    .inc();
                report.repaired.push(format!(
                    "voided reservation {order_no} (no order event arrived; {})",
                    cutoff.because
                ));
            } else {
                self.gate.commit(activity_id, &[order_no]).await?;
                report.repaired.push(format!(
                    "committed reservation {order_no} (its order is {status})"
                ));
            }
        }
        Ok(())
    }

    /// The grace, or the much shorter publish window when the order
    /// consumers have committed every partition to its end. `now` is read
    /// before the offsets, so every event acknowledged before it is among
    /// those proven applied.
    async fn void_cutoff(&self) -> Cutoff {
        let r = &self.settings.reconcile;
        let now = Utc::now().timestamp_millis();
        let secs = |s: u64| {
            i64::try_from(s)
                .unwrap_or(i64::MAX / 2_000)
                .saturating_mul(1000)
        };
        let grace = Cutoff {
            before_ms: now - secs(r.reservation_grace_secs),
            because: "older than the grace",
            proven: false,
        };
        match self.progress.caught_up().await {
            Ok(true) => Cutoff {
                before_ms: now - secs(r.publish_window_secs.min(r.reservation_grace_secs)),
                because: "the order consumers have applied every published event",
                proven: true,
            },
            Ok(_) => grace,
            Err(e) => {
                tracing::debug!(
                    error = format!("{e:#}"),
                    "consumer progress unknown; using the grace"
                );
                grace
            }
        }
    }

    /// Publishes a lost, acknowledged `order.requested` again (the order
    /// consumer is idempotent: should the first copy turn up, it is a
    /// duplicate).
    async fn republish(&self, order_no: i64, event: &[u8]) -> anyhow::Result<()> {
        crate::bus::publish(
            &self.producer,
            &self.topics.order_requested,
            &order_no.to_string(),
            event,
            None,
        )
        .await
        .with_context(|| format!("publishing the event of {order_no} again"))?;
        self.metrics
            .reconcile
            .with_label_values(&["repair", "republished"])
            .inc();
        Ok(())
    }
}

/// Reservations made before `before_ms` are voided, `because` of what.
struct Cutoff {
    before_ms: i64,
    because: &'static str,
    /// The order consumers have applied every event published before it.
    proven: bool,
}

/// Inserts the order as FAILED unless a row exists; returns the row's status.
fn void_order(
    conn: &mut PgConn,
    activity_id: i64,
    order_no: i64,
    user_id: i64,
    request_id: &str,
    quantity: i32,
) -> QueryResult<String> {
    #[derive(QueryableByName)]
    struct Status {
        #[diesel(sql_type = Text)]
        status: String,
    }
    diesel::sql_query(
        "INSERT INTO orders (order_no, request_id, activity_id, user_id, quantity, amount_cents, status, failure_reason) \
         SELECT $1, $2, $3, $4, $5, a.price_cents * $5, 'FAILED', $6 FROM activities a WHERE a.id = $3 \
         ON CONFLICT DO NOTHING",
    )
    .bind::<BigInt, _>(order_no)
    .bind::<Text, _>(request_id)
    .bind::<BigInt, _>(activity_id)
    .bind::<BigInt, _>(user_id)
    .bind::<Integer, _>(quantity)
    .bind::<Text, _>(RESERVATION_EXPIRED)
    .execute(conn)?;
    let row: Option<Status> = diesel::sql_query("SELECT status FROM orders WHERE order_no = $1")
        .bind::<BigInt, _>(order_no)
        .get_result(conn)
        .optional()?;
    // No row at all: the same (user, request_id) already has another order;
    // this reservation backs nothing.
    Ok(row.map_or_else(|| "FAILED".to_owned(), |r| r.status))
}

fn figures(conn: &mut PgConn, activity_id: i64, settle_secs: f64) -> QueryResult<Figures> {
    diesel::sql_query(
        "SELECT s.total, s.available, s.locked, s.sold, \
           (SELECT COALESCE(sum(quantity), 0)::bigint FROM orders WHERE activity_id = $1 AND status = 'WAITING_PAY') AS waiting_units, \
           (SELECT COALESCE(sum(quantity), 0)::bigint FROM orders WHERE activity_id = $1 AND status = 'PAID') AS paid_units, \
           (SELECT count(*) FROM outbox WHERE topic = 'stock.released' \
              AND (payload->>'activity_id')::bigint = $1 \
              AND (status IN ('NEW', 'RETRY') OR sent_at > now() - make_interval(secs => $2))) AS releases_in_flight \
         FROM stock s WHERE s.activity_id = $1",
    )
    .bind::<BigInt, _>(activity_id)
    .bind::<diesel::sql_types::Double, _>(settle_secs)
    .get_result(conn)
}
