//! The one owner of the Kafka clients' supervision: the consumers, the
//! producer and the progress sampler report their health here, and are
//! judged against the broker probe's word.

use std::sync::Arc;

use super::probe::BrokerProbe;
use super::watchdog::{Health, Registry};

/// Who watches the Kafka clients of this process.
#[derive(Clone)]
pub struct Supervision {
    /// Where readiness finds each consumer's health.
    pub registry: Arc<Registry>,
    /// `seckill_consumer_restarts_total{group}`.
    pub restarts: prometheus::IntCounterVec,
    /// `seckill_kafka_client_rebuilds_total{client}`.
    pub rebuilds: prometheus::IntCounterVec,
    /// Whether the broker answers a fresh client: the judge of every client.
    pub probe: Arc<BrokerProbe>,
    /// Where a client beyond healing gives up.
    pub liveness: Arc<crate::liveness::Liveness>,
}

impl Supervision {
    /// Registers `group`'s health for readiness, and its counters' series
    /// from the start (at 0), so a dashboard or an alert on their increase
    /// sees them before the first rebuild.
    pub(super) fn register(&self, group: &str, client: &str) -> Arc<Health> {
        self.restarts.with_label_values(&[group]);
        self.rebuilds.with_label_values(&[client]);
        self.registry.register(group)
    }

    /// A WARN and the counters for one rebuild of `group`'s client.
    pub(super) fn count_rebuild(&self, group: &str, client: &str, why: &str) {
        tracing::warn!(
            group,
            client,
            reason = why,
            "consumer stalled; rebuilding its Kafka client"
        );
        self.restarts.with_label_values(&[group]).inc();
        self.rebuilds.with_label_values(&[client]).inc();
    }
}
