//! The outbox relay: publishes NEW / due RETRY rows in id order, marks them
//! SENT, or RETRY with exponential backoff, or DEAD after
//! `workers.relay_max_attempts` real refusals. Rows are claimed with `FOR
//! UPDATE SKIP LOCKED` inside the transaction that marks them, so several
//! relays (in one process or many) share the work without publishing a row
//! twice at once.
//!
//! Only a refusal of the message itself counts as an attempt. A broker that
//! cannot be reached, is slow, or leaves the outcome unknown says nothing
//! about the event: the row waits (RETRY, same attempt count) and goes out
//! again once the broker is back, so an outage never turns a row DEAD. A
//! copy that did reach the broker is a duplicate its idempotent consumer
//! ignores. DEAD rows are counted in `seckill_outbox_rows{status="DEAD"}`,
//! listed by `seckill outbox dead` and put back by `seckill outbox requeue`.

use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{Array, BigInt, Integer, Text};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::bus::{Producer, PublishError, Topics};
use crate::config::WorkerSettings;
use crate::metrics::Metrics;
use crate::store::{self, PgConn, PgPool, StatusCount};
use crate::worker::WorkerHandle;

/// What the relay works with.
#[derive(Clone)]
pub struct Relay {
    /// Where the outbox lives.
    pub db: PgPool,
    /// Where it goes.
    pub producer: Producer,
    /// Logical → full topic names.
    pub topics: Topics,
    /// Poll interval, batch size, attempts.
    pub settings: WorkerSettings,
    /// Outbox gauges.
    pub metrics: Metrics,
}

/// Starts the relay loop on the current runtime.
pub fn spawn(relay: Relay) -> WorkerHandle {
    WorkerHandle::spawn(|shutdown| run(relay, shutdown))
}

async fn run(relay: Relay, shutdown: CancellationToken) {
    let idle = relay.settings.relay_poll_ms;
    let mut last_gauges = std::time::Instant::now() - Duration::from_secs(60);
    while !shutdown.is_cancelled() {
        let handled = match tick(&relay).await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "outbox relay pass failed");
                0
            }
        };
        if last_gauges.elapsed() > Duration::from_secs(2) {
            last_gauges = std::time::Instant::now();
            if let Err(e) = update_gauges(&relay).await {
                tracing::debug!(error = format!("{e:#}"), "outbox gauges not updated");
            }
        }
        if handled == 0 {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(idle) => {}
            }
        }
    }
}

#[derive(QueryableByName)]
struct Row {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Text)]
    topic: String,
    #[diesel(sql_type = Text)]
    event_key: String,
    #[diesel(sql_type = Text)]
    payload: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
}

/// One pass: claim due rows, publish them, record the results; returns how
/// many rows it handled.
pub async fn tick(relay: &Relay) -> anyhow::Result<usize> {
    let rt = tokio::runtime::Handle::current();
    let relay = relay.clone();
    let db = relay.db.clone();
    store::run(&db, move |conn| {
        let handled = conn.transaction(|conn| pass(conn, &relay, &rt))?;
        Ok(handled)
    })
    .await
}

fn pass(conn: &mut PgConn, relay: &Relay, rt: &tokio::runtime::Handle) -> QueryResult<usize> {
    let rows: Vec<Row> = diesel::sql_query(
        "SELECT id, topic, event_key, payload::text AS payload, attempts FROM outbox \
         WHERE status IN ('NEW', 'RETRY') AND next_attempt_at <= now() \
         ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
    )
    .bind::<BigInt, _>(relay.settings.relay_batch.max(1))
    .load(conn)?;
    if rows.is_empty() {
        return Ok(0);
    }
    // Enqueue in id order (librdkafka keeps that order per partition), then
    // await every delivery report. This is a blocking-pool thread, where
    // `block_on` is allowed.
    let results: Vec<Result<(), PublishError>> = rt.block_on(async {
        let sends: Vec<_> = rows
            .iter()
            .map(|r| {
                let topic = relay.topics.resolve(&r.topic);
                relay
                    .producer
                    .enqueue(&topic, &r.event_key, r.payload.as_bytes(), None)
            })
            .collect();
        let waits = sends.into_iter().map(|enqueued| async move {
            match enqueued {
                Ok(delivery) => delivery.await,
                Err(e) => Err(e),
            }
        });
        futures_util::future::join_all(waits).await
    });

    let mut sent = Vec::new();
    let mut waiting = Vec::new();
    for (row, result) in rows.iter().zip(results) {
        match result {
            Ok(()) => sent.push(row.id),
            // The broker was away or slow: not an attempt. The row waits
            // and goes out again; a copy that got through is a duplicate
            // the consumer ignores.
            Err(e) if e.is_transient() => waiting.push((row.id, e.to_string())),
            Err(e) => {
                let error = e.to_string();
                let attempts = row.attempts + 1;
                let dead = attempts >= relay.settings.relay_max_attempts;
                let backoff_secs = 2i64.saturating_pow(attempts.clamp(0, 6) as u32).min(60);
                diesel::sql_query(
                    "UPDATE outbox SET attempts = $2, last_error = $3, \
                     status = CASE WHEN $4 THEN 'DEAD' ELSE 'RETRY' END, \
                     next_attempt_at = now() + make_interval(secs => $5) WHERE id = $1",
                )
                .bind::<BigInt, _>(row.id)
                .bind::<Integer, _>(attempts)
                .bind::<Text, _>(&error)
                .bind::<diesel::sql_types::Bool, _>(dead)
                .bind::<diesel::sql_types::Double, _>(backoff_secs as f64)
                .execute(conn)?;
                if dead {
                    tracing::error!(outbox_id = row.id, attempts, error, "outbox event is DEAD");
                }
            }
        }
    }
    if !sent.is_empty() {
        diesel::sql_query(
            "UPDATE outbox SET status = 'SENT', sent_at = now(), attempts = attempts + 1 \
             WHERE id = ANY($1)",
        )
        .bind::<Array<BigInt>, _>(&sent)
        .execute(conn)?;
    }
    if let Some((_, error)) = waiting.first() {
        let ids: Vec<i64> = waiting.iter().map(|(id, _)| *id).collect();
        diesel::sql_query(
            "UPDATE outbox SET status = 'RETRY', last_error = $2, \
             next_attempt_at = now() + interval '1 second' WHERE id = ANY($1)",
        )
        .bind::<Array<BigInt>, _>(&ids)
        .bind::<Text, _>(error)
        .execute(conn)?;
        tracing::warn!(count = ids.len(), error, "outbox rows wait for the broker");
    }
    // Rows that only waited are not work done: the relay idles, it does
    // not spin, while the broker is away.
    Ok(rows.len() - waiting.len())
}

/// A DEAD outbox row, for operators.
#[derive(Debug, Serialize, QueryableByName)]
pub struct DeadRow {
    /// Row id.
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    /// Logical topic.
    #[diesel(sql_type = Text)]
    pub topic: String,
    /// Message key.
    #[diesel(sql_type = Text)]
    pub event_key: String,
    /// Refusals so far.
    #[diesel(sql_type = Integer)]
    pub attempts: i32,
    /// The broker's last refusal.
    #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
    pub last_error: Option<String>,
}

/// Every DEAD row, oldest first.
pub fn dead_rows(conn: &mut PgConn) -> QueryResult<Vec<DeadRow>> {
    diesel::sql_query(
        "SELECT id, topic, event_key, attempts, last_error FROM outbox \
         WHERE status = 'DEAD' ORDER BY id",
    )
    .load(conn)
}

/// Puts DEAD rows back (all of them, or those in `ids`): NEW, no attempts,
/// due now. Returns how many went back.
pub fn requeue(conn: &mut PgConn, ids: Option<&[i64]>) -> QueryResult<usize> {
    match ids {
        None => diesel::sql_query(
            "UPDATE outbox SET status = 'NEW', attempts = 0, next_attempt_at = now() \
             WHERE status = 'DEAD'",
        )
        .execute(conn),
        Some(ids) => diesel::sql_query(
            "UPDATE outbox SET status = 'NEW', attempts = 0, next_attempt_at = now() \
             WHERE status = 'DEAD' AND id = ANY($1)",
        )
        .bind::<Array<BigInt>, _>(ids)
        .execute(conn),
    }
}

async fn update_gauges(relay: &Relay) -> anyhow::Result<()> {
    let counts: Vec<StatusCount> = store::run(&relay.db, |conn| {
        Ok(diesel::sql_query(
            "SELECT status, count(*) AS n FROM outbox WHERE status IN ('NEW', 'RETRY', 'DEAD') \
             GROUP BY status",
        )
        .load(conn)?)
    })
    .await?;
    for status in ["NEW", "RETRY", "DEAD"] {
        let n = counts
            .iter()
            .find(|c| c.status == status)
            .map_or(0, |c| c.n);
        relay
            .metrics
            .outbox_rows
            .with_label_values(&[status])
            .set(n);
    }
    Ok(())
}
