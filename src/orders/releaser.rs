//! Consumer of `stock.released` (from the outbox): gives a cancelled or
//! closed order's units back to Redis so they can be bought again. The
//! release script is idempotent per order_no, so redeliveries — and two
//! relays publishing the same row — apply once.

use std::time::Duration;

use anyhow::Context;
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use tokio_util::sync::CancellationToken;

use super::consumer::{ConsumerDeps, ConsumerHandle};
use crate::admission::ReleaseReason;
use crate::bus::{self, events::StockReleased};

/// Name of this consumer (its group id suffix).
pub const CONSUMER: &str = "stock-releaser";

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
        .context("creating the stock.released consumer")?;
    consumer
        .subscribe(&[&deps.topics.stock_released])
        .context("subscribing to stock.released")?;
    let shutdown = CancellationToken::new();
    let join = tokio::spawn(run(consumer, deps, shutdown.clone()));
    Ok(ConsumerHandle::new(shutdown, join))
}

async fn run(consumer: StreamConsumer, deps: ConsumerDeps, shutdown: CancellationToken) {
    'messages: loop {
        let message = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = consumer.recv() => m,
        };
        let m = match message {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "stock.released receive failed");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        match StockReleased::decode(m.payload().unwrap_or_default()) {
            Err(reason) => {
                // Written by our own outbox: unreadable means a bug, not data.
                tracing::error!(
                    reason,
                    offset = m.offset(),
                    "unreadable stock.released skipped"
                );
                deps.metrics
                    .stock_released
                    .with_label_values(&["unreadable"])
                    .inc();
            }
            Ok(e) => {
                let reason = ReleaseReason::OrderReleased {
                    user_id: e.user_id,
                    quantity: e.quantity,
                };
                let buckets = usize::try_from(e.buckets).unwrap_or(1).max(1);
                let mut attempt = 0u32;
                loop {
                    match deps
                        .gate
                        .release(e.activity_id, e.order_no.get(), buckets, reason)
                        .await
                    {
                        Ok(released) => {
                            let result = if released { "released" } else { "already" };
                            deps.metrics
                                .stock_released
                                .with_label_values(&[result])
                                .inc();
                            break;
                        }
                        Err(err) => {
                            attempt += 1;
                            tracing::warn!(error = %err, attempt, "Redis release failed; retrying");
                            let backoff = Duration::from_millis(100 * 2u64.pow(attempt.min(6)));
                            tokio::select! {
                                _ = shutdown.cancelled() => break 'messages,
                                _ = tokio::time::sleep(backoff) => {}
                            }
                        }
                    }
                }
            }
        }
        if let Err(e) = consumer.store_offset_from_message(&m) {
            tracing::debug!(error = %e, "offset not stored");
        }
    }
    let _ = tokio::task::spawn_blocking(move || drop(consumer)).await;
}
