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

use anyhow::Context;
use chrono::Utc;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use rdkafka::producer::FutureProducer;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::repo::{self, BatchOutcome};
use crate::admission::{RedisGate, ReleaseReason};
use crate::bus::events::OrderRequested;
use crate::bus::{self, Topics};
use crate::config::Settings;
use crate::metrics::Metrics;
use crate::store::{self, PgPool};

/// Name of this consumer in `consume_log` and in its group id.
pub const CONSUMER: &str = "order-creator";

/// Longest pause between retries of a failing batch.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

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
    /// For dead letters.
    pub producer: FutureProducer,
    /// Topic names.
    pub topics: Topics,
    /// Settings (batch size, Kafka addresses).
    pub settings: Arc<Settings>,
    /// Batch metrics.
    pub metrics: Metrics,
}

impl ConsumerDeps {
    /// Deps with clients of their own (a worker-only process, or a test that
    /// runs consumers beside an API-only server).
    pub fn connect(settings: Settings) -> anyhow::Result<Self> {
        Ok(crate::app::AppState::connect(settings)?.consumer_deps())
    }
}

/// A running consumer.
pub struct ConsumerHandle {
    shutdown: CancellationToken,
    join: JoinHandle<()>,
}

impl ConsumerHandle {
    /// Wraps a spawned consumer loop.
    pub fn new(shutdown: CancellationToken, join: JoinHandle<()>) -> Self {
        Self { shutdown, join }
    }

    /// Finishes the batch in hand, then leaves the group.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.join.await;
    }

    /// Stops at once, wherever it is (tests simulate a crash with this).
    pub fn abort(self) {
        self.join.abort();
    }
}

/// Subscribes and starts the loop on the current runtime.
pub fn spawn(deps: ConsumerDeps) -> anyhow::Result<ConsumerHandle> {
    let kafka = &deps.settings.kafka;
    let consumer: StreamConsumer = bus::client_config(kafka)
        .set("group.id", format!("{}{CONSUMER}", kafka.topic_prefix))
        .set("enable.auto.commit", "true")
        .set("auto.commit.interval.ms", "500")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "10000")
        .set("fetch.wait.max.ms", "50")
        .create()
        .context("creating the order consumer")?;
    consumer
        .subscribe(&[&deps.topics.order_requested])
        .context("subscribing to order.requested")?;
    let shutdown = CancellationToken::new();
    let join = tokio::spawn(run(consumer, deps, shutdown.clone()));
    Ok(ConsumerHandle { shutdown, join })
}

async fn run(consumer: StreamConsumer, deps: ConsumerDeps, shutdown: CancellationToken) {
    let max = deps.settings.orders.batch_size.max(1);
    let wait = Duration::from_millis(deps.settings.orders.batch_wait_ms);
    loop {
        let first = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = consumer.recv() => m,
        };
        let first = match first {
            Ok(m) => m.detach(),
            Err(e) => {
                tracing::warn!(error = %e, "order consumer receive failed");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + wait;
        while batch.len() < max {
            match tokio::time::timeout_at(deadline, consumer.recv()).await {
                Ok(Ok(m)) => batch.push(m.detach()),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "order consumer receive failed");
                    break;
                }
                Err(_) => break,
            }
        }
        deps.metrics.consumer_batch_size.observe(batch.len() as f64);
        if !process(&deps, &batch, &shutdown).await {
            break; // shutting down mid-retry: these offsets stay uncommitted
        }
        for m in &batch {
            if let Err(e) = consumer.store_offset(m.topic(), m.partition(), m.offset()) {
                // Partition revoked meanwhile: its new owner replays, harmlessly.
                tracing::debug!(error = %e, "offset not stored");
            }
        }
    }
    // Closing commits the stored offsets and leaves the group: blocking.
    let _ = tokio::task::spawn_blocking(move || drop(consumer)).await;
}

/// Applies one batch; false when shutdown interrupted a retry.
async fn process(
    deps: &ConsumerDeps,
    batch: &[OwnedMessage],
    shutdown: &CancellationToken,
) -> bool {
    let mut events = Vec::with_capacity(batch.len());
    let mut origin = HashMap::new();
    for m in batch {
        match OrderRequested::decode(m.payload().unwrap_or_default()) {
            Ok(e) => {
                origin.insert(e.event_id.clone(), m);
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
                return true;
            }
            Err(e) if is_permanent(&e) && attempt + 1 >= PERMANENT_ATTEMPTS => {
                if events.len() == 1 {
                    let reason = format!("database refused the event: {e:#}");
                    return dead_letter(deps, origin[&events[0].event_id], &reason, shutdown).await;
                }
                // Isolate the poison event: apply one by one.
                for e in &events {
                    let single = std::slice::from_ref(origin[&e.event_id]);
                    if !Box::pin(process(deps, single, shutdown)).await {
                        return false;
                    }
                }
                return true;
            }
            Err(e) => {
                attempt += 1;
                let backoff = backoff(attempt);
                tracing::warn!(
                    error = format!("{e:#}"),
                    attempt,
                    "order batch failed; retrying"
                );
                tokio::select! {
                    _ = shutdown.cancelled() => return false,
                    _ = tokio::time::sleep(backoff) => {}
                }
            }
        }
    }
}

/// DB transaction, then Redis marks. Either failing fails the whole call;
/// a retry is safe because both steps are idempotent.
async fn apply(deps: &ConsumerDeps, events: &[OrderRequested]) -> anyhow::Result<BatchOutcome> {
    let activity_ids: Vec<i64> = events
        .iter()
        .map(|e| e.activity_id)
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    let released = released_reservations(&deps.gate, events).await?;
    let owned = events.to_vec();
    let (outcome, terms, statuses) = store::run(&deps.db, move |conn| {
        let terms = repo::activity_terms(conn, &activity_ids)?;
        let outcome = repo::apply_batch(conn, CONSUMER, &owned, &terms, &released, Utc::now())?;
        let order_nos: Vec<i64> = owned.iter().map(|e| e.order_no.get()).collect();
        Ok((outcome, terms, repo::statuses(conn, &order_nos)?))
    })
    .await?;

    // Reservations follow the rows: kept for live orders, released for
    // FAILED ones and for events that produced no row.
    let mut commit: HashMap<i64, Vec<i64>> = HashMap::new();
    for e in events {
        let order_no = e.order_no.get();
        let buckets = terms
            .get(&e.activity_id)
            .map_or(1, |t| t.buckets.max(1) as usize);
        match statuses.get(&order_no).map(String::as_str) {
            Some("FAILED") | None => {
                deps.gate
                    .release(e.activity_id, order_no, buckets, ReleaseReason::OrderFailed)
                    .await?;
            }
            Some(_) => commit.entry(e.activity_id).or_default().push(order_no),
        }
    }
    for (activity_id, order_nos) in commit {
        let conflicts = deps.gate.commit(activity_id, &order_nos).await?;
        for order_no in conflicts {
            if statuses.get(&order_no).map(String::as_str) == Some("WAITING_PAY") {
                tracing::error!(
                    order_no,
                    activity_id,
                    "order created for a released reservation; reconciliation needed"
                );
            }
        }
    }
    Ok(outcome)
}

/// Order_nos among `events` whose reservation Redis already released.
async fn released_reservations(
    gate: &RedisGate,
    events: &[OrderRequested],
) -> redis::RedisResult<HashSet<i64>> {
    let mut pipe = redis::pipe();
    for e in events {
        pipe.hget(
            gate.keys(e.activity_id).reservation(e.order_no.get()),
            "status",
        );
    }
    let statuses: Vec<Option<String>> = pipe.query_async(&mut gate.conn()).await?;
    Ok(events
        .iter()
        .zip(statuses)
        .filter(|(_, s)| s.as_deref() == Some("released"))
        .map(|(e, _)| e.order_no.get())
        .collect())
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

fn backoff(attempt: u32) -> Duration {
    (Duration::from_millis(100) * 2u32.saturating_pow(attempt.min(10))).min(MAX_BACKOFF)
}

/// Publishes `m` to the dead-letter topic with the reason in headers,
/// retrying until the broker takes it (a dead letter must not be lost).
async fn dead_letter(
    deps: &ConsumerDeps,
    m: &OwnedMessage,
    reason: &str,
    shutdown: &CancellationToken,
) -> bool {
    tracing::warn!(
        reason,
        partition = m.partition(),
        offset = m.offset(),
        "order event dead-lettered"
    );
    let partition = m.partition().to_string();
    let offset = m.offset().to_string();
    let mut attempt = 0;
    loop {
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "error",
                value: Some(reason),
            })
            .insert(Header {
                key: "source.topic",
                value: Some(m.topic()),
            })
            .insert(Header {
                key: "source.partition",
                value: Some(partition.as_str()),
            })
            .insert(Header {
                key: "source.offset",
                value: Some(offset.as_str()),
            });
        let key = m.key().map(String::from_utf8_lossy).unwrap_or_default();
        let payload = m.payload().unwrap_or_default();
        match bus::publish(
            &deps.producer,
            &deps.topics.order_requested_dlq,
            &key,
            payload,
            Some(headers),
        )
        .await
        {
            Ok(()) => {
                deps.metrics.dead_letters.inc();
                return true;
            }
            Err(e) => {
                attempt += 1;
                tracing::warn!(error = %e, attempt, "dead-letter publish failed; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return false,
                    _ = tokio::time::sleep(backoff(attempt)) => {}
                }
            }
        }
    }
}
