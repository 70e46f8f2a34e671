//! Kafka through rdkafka. Every blocking rdkafka call (metadata, admin,
//! offset commits) runs on the blocking pool or a dedicated thread, never on
//! an async worker.

use std::time::Duration;

use anyhow::Context;
use rdkafka::ClientConfig;
use rdkafka::producer::FutureProducer;

use crate::config::KafkaSettings;

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
/// reordering within a partition.
pub fn producer(settings: &KafkaSettings) -> anyhow::Result<FutureProducer> {
    client_config(settings)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "1")
        .set(
            "message.timeout.ms",
            (settings.timeout_ms * 2).max(1000).to_string(),
        )
        .create()
        .context("creating the Kafka producer")
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
