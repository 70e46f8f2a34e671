//! The consumer loop every subscriber of this service shares: receive a
//! batch (≤ N messages / T ms), hand it to a [`Handler`], and only when the
//! handler says the batch's effects are durable, store its offsets. Offsets
//! are stored locally (`enable.auto.offset.store=false`) and committed by
//! librdkafka's own thread (`enable.auto.commit`), so no blocking commit
//! runs on the async runtime; the consumer is closed on the blocking pool.

use std::time::Duration;

use anyhow::Context;
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use rdkafka::producer::FutureProducer;
use tokio_util::sync::CancellationToken;

use crate::config::KafkaSettings;
use crate::worker::WorkerHandle;

/// What to consume.
#[derive(Debug, Clone)]
pub struct Subscription {
    /// Consumer group suffix (the topic prefix goes in front).
    pub group: &'static str,
    /// Full topic name.
    pub topic: String,
    /// Largest batch.
    pub batch_size: usize,
    /// Longest wait to fill a batch.
    pub batch_wait: Duration,
}

/// Applies batches of messages.
pub trait Handler: Send + Sync + 'static {
    /// Applies `batch`; returns false when `shutdown` interrupted it, in
    /// which case its offsets are not stored and it will be redelivered.
    fn handle<'a>(
        &'a self,
        batch: &'a [OwnedMessage],
        shutdown: &'a CancellationToken,
    ) -> impl Future<Output = bool> + Send + 'a;
}

/// A running consumer.
pub type ConsumerHandle = WorkerHandle;

/// Subscribes and starts the loop on the current runtime.
pub fn spawn<H: Handler>(
    kafka: &KafkaSettings,
    sub: Subscription,
    handler: H,
) -> anyhow::Result<ConsumerHandle> {
    let consumer: StreamConsumer = super::client_config(kafka)
        .set("group.id", super::group_id(kafka, sub.group))
        .set("enable.auto.commit", "true")
        .set("auto.commit.interval.ms", "500")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "10000")
        .set("fetch.wait.max.ms", "50")
        .create()
        .with_context(|| format!("creating the {} consumer", sub.group))?;
    consumer
        .subscribe(&[&sub.topic])
        .with_context(|| format!("subscribing to {}", sub.topic))?;
    Ok(WorkerHandle::spawn(|shutdown| {
        run(consumer, sub, handler, shutdown)
    }))
}

async fn run<H: Handler>(
    consumer: StreamConsumer,
    sub: Subscription,
    handler: H,
    shutdown: CancellationToken,
) {
    let max = sub.batch_size.max(1);
    loop {
        let first = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = consumer.recv() => m,
        };
        let first = match first {
            Ok(m) => m.detach(),
            Err(e) => {
                tracing::warn!(error = %e, group = sub.group, "receive failed");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + sub.batch_wait;
        while batch.len() < max {
            match tokio::time::timeout_at(deadline, consumer.recv()).await {
                Ok(Ok(m)) => batch.push(m.detach()),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, group = sub.group, "receive failed");
                    break;
                }
                Err(_) => break,
            }
        }
        if !handler.handle(&batch, &shutdown).await {
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

/// Exponential backoff: 200 ms, 400 ms, … capped at 5 s.
pub fn backoff(attempt: u32) -> Duration {
    (Duration::from_millis(100) * 2u32.saturating_pow(attempt.min(10))).min(Duration::from_secs(5))
}

/// Runs `op` until it succeeds, logging each failure as `what` and backing
/// off between attempts. `None` if shutdown came first.
pub async fn retry<T, F, Fut>(what: &str, shutdown: &CancellationToken, mut op: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let mut attempt = 0;
    loop {
        match op().await {
            Ok(value) => return Some(value),
            Err(e) => {
                attempt += 1;
                tracing::warn!(error = format!("{e:#}"), attempt, "{what} failed; retrying");
                if !pause(attempt, shutdown).await {
                    return None;
                }
            }
        }
    }
}

/// Sleeps for `backoff(attempt)`; false if shutdown came first.
pub async fn pause(attempt: u32, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = tokio::time::sleep(backoff(attempt)) => true,
    }
}

/// Publishes `m` to `dlq` with the reason and its origin in headers,
/// retrying until the broker takes it (a dead letter must not be lost).
/// False if shutdown came first.
pub async fn dead_letter(
    producer: &FutureProducer,
    dlq: &str,
    m: &OwnedMessage,
    reason: &str,
    shutdown: &CancellationToken,
) -> bool {
    tracing::warn!(
        reason,
        topic = m.topic(),
        partition = m.partition(),
        offset = m.offset(),
        "dead-lettered"
    );
    let partition = m.partition().to_string();
    let offset = m.offset().to_string();
    let key = m.key().map(String::from_utf8_lossy).unwrap_or_default();
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
        match super::publish(
            producer,
            dlq,
            &key,
            m.payload().unwrap_or_default(),
            Some(headers),
        )
        .await
        {
            Ok(()) => return true,
            Err(e) => {
                attempt += 1;
                tracing::warn!(error = %e, attempt, "dead-letter publish failed; retrying");
                if !pause(attempt, shutdown).await {
                    return false;
                }
            }
        }
    }
}
