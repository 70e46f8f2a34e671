//! The order-creating consumer (SPEC step 3): batches of `order.requested`
//! into one PostgreSQL transaction each, then the Redis reservations are
//! marked, then the offsets stored — never the other way round, so a crash
//! anywhere replays the batch and `consume_log` makes the replay a no-op.
//!
//! Offsets are stored locally (`enable.auto.offset.store=false`) and
//! committed by librdkafka's background thread (`enable.auto.commit`), so no
//! blocking commit call ever runs on the async runtime.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use rdkafka::Message;
use rdkafka::message::OwnedMessage;
use tokio_util::sync::CancellationToken;

use super::OrderStatus;
use super::events::StatusChange;
use super::pacing::Pacer;
use super::repo::{self, BatchOutcome};
use crate::admission::Layout;
use crate::admission::gate::Status;
use crate::admission::{RedisGate, ReleaseReason};
use crate::bus::batch::Rush;
use crate::bus::events::OrderRequested;
pub use crate::bus::runner::ConsumerHandle;
use crate::bus::runner::{self, Handler, Subscription, Supervision};
use crate::bus::{Producer, Topics};
use crate::config::Settings;
use crate::domain::ActivityId;
use crate::metrics::Metrics;
use crate::store::redis_conn::unreachable;
use crate::store::{self, PgPool};

/// Name of this consumer in `consume_log` and in its group id.
pub const CONSUMER: &str = "order-creator";

/// A permanent error is retried this often before the batch is split (and a
/// single event dead-lettered).
const PERMANENT_ATTEMPTS: u32 = 3;

/// What the consumer works with.
#[derive(Clone)]
pub struct ConsumerDeps {
    /// Source of truth.
    pub db: PgPool,
    /// Reservations to mark.
    pub gate: Arc<RedisGate>,
    /// Coupons held for orders (freed when an order is released).
    pub coupons: Arc<crate::coupons::gate::CouponGate>,
    /// For dead letters.
    pub producer: Producer,
    /// Topic names.
    pub topics: Topics,
    /// Settings (batch size, Kafka addresses).
    pub settings: Arc<Settings>,
    /// Batch metrics.
    pub metrics: Metrics,
    /// Announces the orders each batch made (and voids) to order streams.
    pub order_events: Arc<super::events::OrderEvents>,
    /// The watchdog every consumer runs under.
    pub supervision: Supervision,
    /// This instance's purchases in flight, which make the order consumer
    /// hold its batches while they rush (`orders.rush_in_flight`); None
    /// when that is off.
    pub rush: Option<Rush>,
}

impl ConsumerDeps {
    /// Starts `handler` on `topic` in consumer group `group`, on the current
    /// runtime: what every subscriber of this service does the same way.
    pub fn subscribe<H: Handler>(
        &self,
        group: &'static str,
        topic: &str,
        batch_size: usize,
        batch_wait: Duration,
        handler: H,
    ) -> anyhow::Result<ConsumerHandle> {
        let sub = Subscription {
            group,
            topic: topic.to_owned(),
            batch_size,
            batch_wait,
            in_flight: 1,
            rush: None,
        };
        self.subscribe_as(sub, handler)
    }

    /// As [`Self::subscribe`], with every setting of `sub`.
    pub fn subscribe_as<H: Handler>(
        &self,
        sub: Subscription,
        handler: H,
    ) -> anyhow::Result<ConsumerHandle> {
        runner::spawn(&self.settings.kafka, sub, handler, self.supervision.clone())
    }
}

/// Subscribes and starts the consumer on the current runtime.
pub fn spawn(deps: ConsumerDeps) -> anyhow::Result<ConsumerHandle> {
    let orders = &deps.settings.orders;
    let wait = orders.batch_wait_ms;
    deps.metrics
        .order_consumer_max_rate
        .set(i64::from(orders.max_write_rate));
    let pacer = Pacer::new(
        orders.max_write_rate,
        deps.metrics.order_consumer_paced.clone(),
    )
    .map(Arc::new);
    let batch_size = pacer
        .as_ref()
        .map_or(orders.batch_size, |p| p.batch_size(orders.batch_size));
    let sub = Subscription {
        group: CONSUMER,
        topic: deps.topics.order_requested.clone(),
        batch_size,
        batch_wait: wait,
        in_flight: orders.batches_in_flight,
        rush: deps.rush.clone(),
    };
    deps.subscribe_as(
        sub,
        OrderCreator {
            deps: deps.clone(),
            pacer,
            schema: SchemaGuard::default(),
        },
    )
}

struct OrderCreator {
    deps: ConsumerDeps,
    /// `orders.max_write_rate`, when set.
    pacer: Option<Arc<Pacer>>,
    schema: SchemaGuard,
}

/// Whether the database's schema is one this binary knows, asked at most
/// every [`SCHEMA_RECHECK`]. During a rolling upgrade a newer binary
/// migrates while older ones still run; an older one must not write
/// orders on a schema it was not built for, so it holds its batches (its
/// offsets stay where they are) until it is replaced.
#[derive(Default)]
struct SchemaGuard {
    /// When it was last asked, and whether it was known then.
    last: std::sync::Mutex<Option<(std::time::Instant, bool)>>,
}

const SCHEMA_RECHECK: std::time::Duration = std::time::Duration::from_secs(5);

impl SchemaGuard {
    async fn known(&self, db: &crate::store::PgPool) -> bool {
        if let Some((at, known)) = *self.last.lock().unwrap_or_else(|e| e.into_inner())
            && at.elapsed() < SCHEMA_RECHECK
        {
            return known;
        }
        let schema = crate::store::run(db, crate::store::schema).await;
        let known = match schema {
            Ok(crate::store::Schema::Ahead(unknown)) => {
                tracing::error!(
                    unknown = unknown.join(","),
                    "the schema has migrations this binary does not know: order batches held \
                     until a newer binary replaces this one"
                );
                false
            }
            // Behind, current, or not answering (the batch's own write
            // will tell).
            _ => true,
        };
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((std::time::Instant::now(), known));
        known
    }
}

impl Handler for OrderCreator {
    async fn handle(&self, batch: &[OwnedMessage], shutdown: &CancellationToken) -> bool {
        while !self.schema.known(&self.deps.db).await {
            self.deps.metrics.schema_holds.inc();
            tokio::select! {
                _ = shutdown.cancelled() => return false,
                _ = tokio::time::sleep(SCHEMA_RECHECK) => {}
            }
        }
        if let Some(pacer) = &self.pacer
            && !pacer.admit(batch.len(), shutdown).await
        {
            return false;
        }
        self.deps
            .metrics
            .consumer_batch_size
            .observe(batch.len() as f64);
        process(&self.deps, batch, shutdown).await
    }
}

/// Applies one batch; false when shutdown interrupted a retry.
async fn process(
    deps: &ConsumerDeps,
    batch: &[OwnedMessage],
    shutdown: &CancellationToken,
) -> bool {
    let mut events = Vec::with_capacity(batch.len());
    // The message each event came in, by the event's index.
    let mut origin = Vec::with_capacity(batch.len());
    for m in batch {
        match OrderRequested::decode(m.payload().unwrap_or_default()) {
            Ok(e) => {
                origin.push(m);
                events.push(e);
            }
            Err(reason) => {
                if !dead_letter(deps, m, &reason, shutdown).await {
                    return false;
                }
            }
        }
    }
    if events.is_empty() {
        return true;
    }
    let mut attempt = 0u32;
    loop {
        match apply(deps, &events).await {
            Ok(outcome) => {
                record(deps, &outcome);
                for &i in &outcome.conflicts {
                    if !dead_letter_conflict(deps, origin[i], &events[i], shutdown).await {
                        return false;
                    }
                }
                return true;
            }
            Err(e) if is_permanent(&e) && attempt + 1 >= PERMANENT_ATTEMPTS => {
                if events.len() == 1 {
                    let reason = format!("database refused the event: {e:#}");
                    if !dead_letter(deps, origin[0], &reason, shutdown).await {
                        return false;
                    }
                    return void_dead_lettered(deps, &events[0], shutdown).await;
                }
                // Isolate the poison event: apply one by one.
                for m in &origin {
                    if !Box::pin(process(deps, std::slice::from_ref(*m), shutdown)).await {
                        return false;
                    }
                }
                return true;
            }
            Err(e) => {
                attempt += 1;
                tracing::warn!(
                    error = format!("{e:#}"),
                    attempt,
                    "order batch failed; retrying"
                );
                if !runner::pause(attempt, shutdown).await {
                    return false;
                }
            }
        }
    }
}

/// An event reusing an applied event_id with another payload is another
/// purchase under a number already taken (two instances minted it). It is
/// never dropped as a duplicate: it goes to the dead-letter topic, and an
/// error log and `seckill_event_conflicts_total` raise the alarm. Its
/// reservation, if any, is the first order's, and stays as it is.
async fn dead_letter_conflict(
    deps: &ConsumerDeps,
    m: &OwnedMessage,
    e: &OrderRequested,
    shutdown: &CancellationToken,
) -> bool {
    tracing::error!(
        event_id = %e.event_id,
        activity_id = %e.activity_id,
        user_id = e.user_id,
        request_id = %e.request_id,
        "order event conflicts with one applied under the same event_id; dead-lettered"
    );
    deps.metrics.event_conflicts.inc();
    let reason = format!(
        "conflict: event_id {} was applied before with a different payload",
        e.event_id
    );
    dead_letter(deps, m, &reason, shutdown).await
}

/// DB transaction, then Redis marks. Either failing fails the whole call;
/// a retry is safe because both steps are idempotent — except Redis being
/// unreachable: then the orders are still written (the database is the
/// truth, and the fallback waits for these very orders before it sells) and
/// the marks are left to reconciliation, which settles every open
/// reservation by its row once Redis answers.
async fn apply(deps: &ConsumerDeps, events: &[OrderRequested]) -> anyhow::Result<BatchOutcome> {
    let activity_ids: Vec<ActivityId> = events
        .iter()
        .map(|e| e.activity_id)
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    let started = std::time::Instant::now();
    // The layouts first: where each reservation lives in Redis.
    let terms = store::run(&deps.db, move |conn| {
        Ok(repo::activity_terms(conn, &activity_ids)?)
    })
    .await?;
    let marks = match reservation_marks(&deps.gate, &terms, events).await {
        Ok(marks) => marks,
        Err(e) if unreachable(&e) => {
            // A reservation is released before its event is applied only
            // when its FAILED row is written first (voids) or librdkafka
            // said the event was never sent: the rows decide without it.
            tracing::warn!(error = %e, "Redis unreachable: order batch written without its reservation marks");
            repo::Marks::default()
        }
        Err(e) => return Err(e.into()),
    };
    let db_started = std::time::Instant::now();
    let owned = events.to_vec();
    let (mut outcome, terms) = store::run(&deps.db, move |conn| {
        let outcome = repo::apply_batch(conn, CONSUMER, &owned, &terms, &marks, Utc::now())?;
        Ok((outcome, terms))
    })
    .await?;
    if !outcome.lost.is_empty() {
        deps.metrics
            .consumer_events
            .with_label_values(&["lost_with_redis"])
            .inc_by(outcome.lost.len() as u64);
        tracing::warn!(
            order_nos = ?outcome.lost,
            "order events of reservations Redis lost before the restore: no orders made \
             (their purchases were never accepted, and the restore did not count them)"
        );
    }
    let statuses = std::mem::take(&mut outcome.statuses);
    let db = db_started.elapsed();

    // Reservations follow the rows: kept for live orders, released for
    // FAILED ones and for events that produced no row.
    let mut commit: HashMap<ActivityId, Vec<i64>> = HashMap::new();
    // Nothing of a lost reservation is left in Redis to mark, unless a
    // release would hand out a unit the restore never counted.
    for (_, e) in events.iter().enumerate().filter(|(i, e)| {
        !outcome.conflicts.contains(i) && !outcome.lost.contains(&e.order_no.get())
    }) {
        let order_no = e.order_no.get();
        let layout = layout_of(&terms, e.activity_id);
        match statuses.get(&order_no) {
            Some(OrderStatus::Failed) | None => {
                let released = deps
                    .gate
                    .release(e.activity_id, order_no, layout, ReleaseReason::OrderFailed)
                    .await;
                left_to_reconciliation(released)?;
            }
            Some(_) => commit.entry(e.activity_id).or_default().push(order_no),
        }
    }
    for (activity_id, order_nos) in commit {
        let layout = layout_of(&terms, activity_id);
        let conflicts =
            left_to_reconciliation(deps.gate.commit(activity_id, layout, &order_nos).await)?
                .unwrap_or_default();
        for order_no in conflicts {
            if statuses.get(&order_no) == Some(&OrderStatus::WaitingPay) {
                tracing::error!(
                    order_no,
                    activity_id = %activity_id,
                    "order created for a released reservation; reconciliation needed"
                );
            }
        }
    }
    // Every order of the batch as it stands, for whoever follows one (a
    // redelivered event announces its order again: streams skip a status
    // they already sent).
    let changes: Vec<StatusChange> = statuses
        .iter()
        .map(|(&order_no, &status)| StatusChange { order_no, status })
        .collect();
    deps.order_events.publish(&changes).await;
    tracing::debug!(events = events.len(), total = ?started.elapsed(), db = ?db, "order batch applied");
    Ok(outcome)
}

/// A reservation mark's result: an error unless Redis is unreachable, when
/// the mark is left to reconciliation (`None`).
fn left_to_reconciliation<T>(result: redis::RedisResult<T>) -> redis::RedisResult<Option<T>> {
    match result {
        Ok(done) => Ok(Some(done)),
        Err(e) if unreachable(&e) => {
            tracing::debug!(error = %e, "Redis unreachable: reservation mark left to reconciliation");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// An activity's layout among `terms`; the unsharded one for an activity
/// the database does not know (its events produce no row).
fn layout_of(terms: &HashMap<ActivityId, repo::ActivityTerms>, activity_id: ActivityId) -> Layout {
    terms
        .get(&activity_id)
        .map_or(Layout::single(1), |t| t.layout)
}

/// What Redis says of `events`' reservations: the ones it already
/// released, and the ones it has no record of.
async fn reservation_marks(
    gate: &RedisGate,
    terms: &HashMap<ActivityId, repo::ActivityTerms>,
    events: &[OrderRequested],
) -> redis::RedisResult<repo::Marks> {
    let mut by_activity: HashMap<ActivityId, Vec<i64>> = HashMap::new();
    for e in events {
        by_activity
            .entry(e.activity_id)
            .or_default()
            .push(e.order_no.get());
    }
    let mut marks = repo::Marks::default();
    for (activity_id, order_nos) in by_activity {
        let layout = layout_of(terms, activity_id);
        let statuses = gate.statuses(activity_id, layout, &order_nos).await?;
        for (order_no, status) in order_nos.into_iter().zip(statuses) {
            match status {
                Some(Status::Released) => {
                    marks.released.insert(order_no);
                }
                None => {
                    marks.unknown.insert(order_no);
                }
                Some(_) => {}
            }
        }
    }
    Ok(marks)
}

/// A dead-lettered order event voids its reservation: the order is
/// recorded FAILED (`DEAD_LETTERED`) unless a row already stands, and the
/// stock goes back once. Without this the reservation would stay open and,
/// acknowledged as it is, be published again on every reconciliation.
/// False if shutdown came first.
async fn void_dead_lettered(
    deps: &ConsumerDeps,
    e: &OrderRequested,
    shutdown: &CancellationToken,
) -> bool {
    let (activity_id, order_no) = (e.activity_id, e.order_no.get());
    let voided = runner::retry("voiding a dead-lettered order", shutdown, || async {
        let owned = e.clone();
        let (status, terms) = store::run(&deps.db, move |conn| {
            let status = match repo::insert_failed(conn, &owned, repo::DEAD_LETTERED) {
                Ok(status) => status,
                Err(err) => {
                    let err = anyhow::Error::from(err);
                    if !is_permanent(&err) {
                        return Err(err);
                    }
                    // Refused even as FAILED (as it refused the event): the
                    // released reservation alone says FAILED.
                    None
                }
            };
            Ok((status, repo::activity_terms(conn, &[owned.activity_id])?))
        })
        .await?;
        let Some(layout) = terms.get(&activity_id).map(|t| t.layout) else {
            return Ok(()); // no such activity: no reservation either
        };
        match status {
            Some(OrderStatus::Failed) | None => {
                deps.gate
                    .release(activity_id, order_no, layout, ReleaseReason::OrderFailed)
                    .await?;
                let status = OrderStatus::Failed;
                deps.order_events
                    .publish(&[StatusChange { order_no, status }])
                    .await;
            }
            Some(_) => {
                deps.gate.commit(activity_id, layout, &[order_no]).await?;
            }
        }
        Ok(())
    })
    .await;
    voided.is_some()
}

fn record(deps: &ConsumerDeps, outcome: &BatchOutcome) {
    let m = &deps.metrics.consumer_events;
    m.with_label_values(&["created"])
        .inc_by(outcome.created as u64);
    m.with_label_values(&["failed"])
        .inc_by(outcome.failed as u64);
    m.with_label_values(&["duplicate"])
        .inc_by(outcome.duplicates as u64);
    m.with_label_values(&["unknown_activity"])
        .inc_by(outcome.unknown_activity as u64);
    if outcome.unknown_activity > 0 {
        tracing::warn!(
            count = outcome.unknown_activity,
            "order events for unknown activities skipped"
        );
    }
}

/// Constraint violations will not heal by retrying.
fn is_permanent(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<DieselError>(),
        Some(DieselError::DatabaseError(
            DatabaseErrorKind::UniqueViolation
                | DatabaseErrorKind::CheckViolation
                | DatabaseErrorKind::ForeignKeyViolation
                | DatabaseErrorKind::NotNullViolation,
            _
        ))
    )
}

async fn dead_letter(
    deps: &ConsumerDeps,
    m: &OwnedMessage,
    reason: &str,
    shutdown: &CancellationToken,
) -> bool {
    let sent = runner::dead_letter(
        &deps.producer,
        &deps.topics.order_requested_dlq,
        m,
        reason,
        shutdown,
    )
    .await;
    if sent {
        deps.metrics.dead_letters.inc();
    }
    sent
}
