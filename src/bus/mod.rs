//! Kafka through rdkafka. Every blocking rdkafka call (metadata, admin,
//! consumer close) runs on the blocking pool, never on an async worker;
//! offsets are stored locally after the database commits and committed by
//! librdkafka's own background thread.

pub mod events;
pub mod progress;
pub mod runner;

use std::time::Duration;

use anyhow::Context;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;

use crate::config::KafkaSettings;

/// Topic names under this instance's prefix.
#[derive(Debug, Clone)]
pub struct Topics {
    /// `order.requested`: admitted purchases.
    pub order_requested: String,
    /// Dead letters of `order.requested`.
    pub order_requested_dlq: String,
    /// `stock.released`: cancelled / closed orders (from the outbox).
    pub stock_released: String,
    /// `order.paid` (from the outbox).
    pub order_paid: String,
    /// `coupon.claimed`: admitted coupon claims.
    pub coupon_claimed: String,
    /// Dead letters of `coupon.claimed`.
    pub coupon_claimed_dlq: String,
    prefix: String,
}

impl Topics {
    /// Names under `kafka.topic_prefix`.
    pub fn new(prefix: &str) -> Self {
        Self {
            order_requested: format!("{prefix}order.requested"),
            order_requested_dlq: format!("{prefix}order.requested.dlq"),
            stock_released: format!("{prefix}stock.released"),
            order_paid: format!("{prefix}order.paid"),
            coupon_claimed: format!("{prefix}coupon.claimed"),
            coupon_claimed_dlq: format!("{prefix}coupon.claimed.dlq"),
            prefix: prefix.to_owned(),
        }
    }

    /// The full name of a logical topic (as stored in the outbox).
    pub fn resolve(&self, logical: &str) -> String {
        format!("{}{logical}", self.prefix)
    }

    /// Every topic this service produces to or consumes from.
    pub fn all(&self) -> [&str; 6] {
        [
            &self.order_requested,
            &self.order_requested_dlq,
            &self.stock_released,
            &self.order_paid,
            &self.coupon_claimed,
            &self.coupon_claimed_dlq,
        ]
    }
}

/// The consumer group id of subscriber `name` under this instance's prefix.
pub fn group_id(settings: &KafkaSettings, name: &str) -> String {
    format!("{}{name}", settings.topic_prefix)
}

/// Base client configuration shared by producers, consumers and admin clients.
pub fn client_config(settings: &KafkaSettings) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &settings.brokers)
        .set("socket.timeout.ms", settings.timeout_ms.max(10).to_string())
        .set(
            "socket.connection.setup.timeout.ms",
            settings.timeout_ms.max(1000).to_string(),
        )
        .set("log_level", "4");
    config
}

/// The idempotent producer: `acks=all`, retries without duplicates or
/// reordering within a partition. A message not delivered within twice
/// `kafka.timeout_ms` fails, and the purchase behind it is released.
pub fn producer(settings: &KafkaSettings) -> anyhow::Result<FutureProducer> {
    client_config(settings)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "2")
        .set("queue.buffering.max.messages", "200000")
        .set(
            "message.timeout.ms",
            (settings.timeout_ms * 2).max(1000).to_string(),
        )
        .create()
        .context("creating the Kafka producer")
}

/// Creates the topics this service uses, if missing.
pub async fn ensure_topics(settings: &KafkaSettings, topics: &Topics) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> = client_config(settings)
        .create()
        .context("creating the Kafka admin client")?;
    let new: Vec<NewTopic<'_>> = topics
        .all()
        .into_iter()
        .map(|name| {
            NewTopic::new(
                name,
                settings.partitions,
                TopicReplication::Fixed(settings.replication_factor),
            )
        })
        .collect();
    let timeout = Duration::from_millis(settings.timeout_ms);
    let options = AdminOptions::new()
        .operation_timeout(Some(timeout))
        .request_timeout(Some(timeout));
    let results = admin
        .create_topics(&new, &options)
        .await
        .context("creating topics")?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => anyhow::bail!("creating topic {name}: {code}"),
        }
    }
    // The admin client's destructor joins librdkafka threads: off the runtime.
    tokio::task::spawn_blocking(move || drop(admin));
    Ok(())
}

/// Creates the topics now, or — when the broker cannot be reached or does
/// not answer in time — keeps trying in the background with backoff until
/// it does: brokers that do not create topics on first use (the usual
/// production setting) would otherwise leave the service without them.
pub async fn ensure_topics_or_retry(settings: &KafkaSettings, topics: &Topics) {
    let Err(e) = ensure_topics(settings, topics).await else {
        return;
    };
    tracing::warn!(
        error = format!("{e:#}"),
        "could not create Kafka topics; retrying in the background"
    );
    let (settings, topics) = (settings.clone(), topics.clone());
    tokio::spawn(async move {
        let forever = tokio_util::sync::CancellationToken::new();
        runner::retry("creating Kafka topics", &forever, || {
            ensure_topics(&settings, &topics)
        })
        .await;
        tracing::info!("Kafka topics created");
    });
}

/// Why a publish did not happen.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The local producer queue is full: backpressure, try later.
    #[error("the producer queue is full")]
    QueueFull,
    /// The broker did not acknowledge the message in time, or refused it.
    #[error("delivery failed: {0}")]
    Failed(KafkaError),
}

/// Produces one message and waits for its delivery report. Never waits for
/// queue space: a full queue is reported at once as [`PublishError::QueueFull`].
pub async fn publish(
    producer: &FutureProducer,
    topic: &str,
    key: &str,
    payload: &[u8],
    headers: Option<OwnedHeaders>,
) -> Result<(), PublishError> {
    let mut record = FutureRecord::to(topic).key(key).payload(payload);
    if let Some(h) = headers {
        record = record.headers(h);
    }
    match producer.send(record, Timeout::After(Duration::ZERO)).await {
        Ok(_) => Ok(()),
        Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
            Err(PublishError::QueueFull)
        }
        Err((e, _)) => Err(PublishError::Failed(e)),
    }
}

/// Asks the cluster for its metadata: the readiness probe. Runs on the
/// blocking pool because `fetch_metadata` blocks.
pub async fn ping(producer: &FutureProducer, timeout: Duration) -> anyhow::Result<()> {
    let producer = producer.clone();
    tokio::task::spawn_blocking(move || {
        use rdkafka::producer::Producer;
        let metadata = producer
            .client()
            .fetch_metadata(None, timeout)
            .context("fetching cluster metadata")?;
        anyhow::ensure!(
            !metadata.brokers().is_empty(),
            "the cluster reports no broker"
        );
        Ok(())
    })
    .await
    .context("Kafka probe task failed")?
}
