//! Kafka through rdkafka. Every blocking rdkafka call (metadata, admin)
//! runs on the blocking pool, never on an async worker; a client's
//! destructor (a consumer's close can wait for ever) runs on a thread of
//! its own ([`closing`]); offsets are stored locally after the database
//! commits and committed by librdkafka's own background thread.

pub mod batch;
pub mod closing;
pub mod events;
pub mod partitioner;
pub mod probe;
pub mod producer;
pub mod progress;
pub mod runner;
pub mod supervision;
pub mod watchdog;

pub use producer::{Delivery, Producer, PublishError};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::RDKafkaErrorCode;

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
///
/// librdkafka's socket timeout (60 s) is left alone on purpose: a short one
/// tears every connection down whenever the broker pauses (a GC, a burst of
/// topic creation, a slow fsync on a loaded 2-core box), and the requests in
/// flight then fail or time out instead of simply completing late.
pub fn client_config(settings: &KafkaSettings) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &settings.brokers)
        // A broker that comes back is found again within 2 s, not 10.
        .set("reconnect.backoff.max.ms", "2000")
        .set("log_level", "4");
    config
}

/// Creates the topics this service uses, if missing.
pub async fn ensure_topics(settings: &KafkaSettings, topics: &Topics) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> = client_config(settings)
        .create()
        .context("creating the Kafka admin client")?;
    let min_insync = settings.min_insync_replicas.to_string();
    let new: Vec<NewTopic<'_>> = topics
        .all()
        .into_iter()
        .map(|name| {
            NewTopic::new(
                name,
                settings.partitions,
                TopicReplication::Fixed(settings.replication_factor),
            )
            .set("min.insync.replicas", &min_insync)
            // An out-of-sync replica never becomes leader: what it lacks
            // would be lost with acknowledged orders in it.
            .set("unclean.leader.election.enable", "false")
        })
        .collect();
    let timeout = settings.timeout_ms;
    let options = AdminOptions::new()
        .operation_timeout(Some(timeout))
        .request_timeout(Some(timeout));
    let results = admin.create_topics(&new, &options).await;
    let created: anyhow::Result<()> = (|| {
        for result in results.context("creating topics")? {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((name, code)) => anyhow::bail!("creating topic {name}: {code}"),
            }
        }
        Ok(())
    })();
    let grown = match created {
        Ok(()) => grow_partitions(&admin, settings, topics, &options).await,
        Err(e) => Err(e),
    };
    // The admin client's destructor joins librdkafka threads: off the runtime.
    tokio::task::spawn_blocking(move || drop(admin));
    grown
}

/// Gives every topic that exists with fewer partitions than
/// `kafka.partitions` (made by an earlier configuration) the missing ones:
/// more order consumers can work at once. A topic is never shrunk; more
/// partitions than configured are left as they are.
async fn grow_partitions(
    admin: &AdminClient<DefaultClientContext>,
    settings: &KafkaSettings,
    topics: &Topics,
    options: &AdminOptions,
) -> anyhow::Result<()> {
    let wanted = usize::try_from(settings.partitions).unwrap_or(1);
    let config = client_config(settings);
    let timeout = settings.timeout_ms;
    let listed: Vec<String> = topics.all().iter().map(|n| n.to_string()).collect();
    // A metadata request is a blocking call: off the runtime.
    let counts: Vec<(String, usize)> = tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::Consumer;
        let client: rdkafka::consumer::BaseConsumer = config.create()?;
        let metadata = client.fetch_metadata(None, timeout)?;
        anyhow::Ok(
            metadata
                .topics()
                .iter()
                .filter(|t| listed.iter().any(|n| n.as_str() == t.name()))
                .map(|t| (t.name().to_owned(), t.partitions().len()))
                .collect(),
        )
    })
    .await
    .context("reading the topics' partitions")??;
    let short: Vec<rdkafka::admin::NewPartitions<'_>> = counts
        .iter()
        .filter(|(_, n)| *n > 0 && *n < wanted)
        .map(|(name, _)| rdkafka::admin::NewPartitions::new(name, wanted))
        .collect();
    if short.is_empty() {
        return Ok(());
    }
    for result in admin
        .create_partitions(&short, options)
        .await
        .context("adding partitions")?
    {
        match result {
            Ok(name) => {
                tracing::warn!(
                    topic = name,
                    partitions = wanted,
                    "topic grown to kafka.partitions"
                )
            }
            Err((name, code)) => anyhow::bail!("adding partitions to {name}: {code}"),
        }
    }
    Ok(())
}

/// Creates the topics now, or — when the broker cannot be reached or does
/// not answer in time — keeps trying in the background with backoff until
/// it does: brokers that do not create topics on first use (the usual
/// production setting) would otherwise leave the service without them.
/// `created` turns true once they exist (readiness waits for it).
pub async fn ensure_topics_or_retry(
    settings: &KafkaSettings,
    topics: &Topics,
    created: Arc<AtomicBool>,
) {
    let Err(e) = ensure_topics(settings, topics).await else {
        created.store(true, Ordering::Relaxed);
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
        created.store(true, Ordering::Relaxed);
        tracing::info!("Kafka topics created");
    });
}
