//! `[kafka]`: the brokers, topics and the clients' timeouts.

use std::time::Duration;

use serde::Deserialize;

use super::duration;

/// Kafka settings.
#[derive(Debug, Clone, Deserialize)]
pub struct KafkaSettings {
    /// Bootstrap servers, comma-separated `host:port`.
    pub brokers: String,
    /// Prefix of every topic and consumer group name; tests use one per test.
    pub topic_prefix: String,
    /// Timeout of metadata and admin calls, in milliseconds.
    #[serde(deserialize_with = "duration::millis")]
    pub timeout_ms: Duration,
    /// How long librdkafka retries one message before reporting a timeout
    /// (`message.timeout.ms`), in milliseconds.
    #[serde(deserialize_with = "duration::millis")]
    pub message_timeout_ms: Duration,
    /// How long the producer waits for a broker's answer to one produce
    /// request (`request.timeout.ms`) before it gives the connection up,
    /// refreshes the leaders and sends the messages again (idempotently),
    /// in milliseconds. Longer than the brokers' session timeout (9 s
    /// here), so that a leader that stopped answering (paused, a frozen
    /// host) has been fenced and replaced by then: a paused leader then
    /// costs what a killed one does. At most `message_timeout_ms` (a
    /// shorter message timeout bounds it).
    #[serde(default = "request_timeout", deserialize_with = "duration::millis")]
    pub request_timeout_ms: Duration,
    /// A consumer with messages waiting that commits nothing, or that
    /// cannot reach its group coordinator, this long is rebuilt; purchases
    /// get 503 BUSY while the order consumers are stalled this long. 0 = off.
    #[serde(deserialize_with = "duration::secs")]
    pub consumer_stall_secs: Duration,
    /// Partitions of the topics this service creates.
    pub partitions: i32,
    /// Replication factor of the topics this service creates (1 for the
    /// single local broker; 3 on a real cluster, with `min.insync.replicas`
    /// 2 there so `acks=all` means something).
    pub replication_factor: i32,
    /// `min.insync.replicas` of the topics this service creates: how many
    /// replicas must have an `acks=all` write before it is acknowledged
    /// (1 on the single local broker; 2 with a replication factor of 3).
    /// Readiness and admission read it too: a partition with fewer in-sync
    /// replicas refuses writes, and purchases then wait.
    #[serde(default = "default_min_insync_replicas")]
    pub min_insync_replicas: i32,
    /// The brokers' `replica.lag.time.max.ms`, in milliseconds: how long a
    /// follower that stopped fetching stays in the in-sync set. With a
    /// replication factor above 1, a write the leader appended commits (and
    /// becomes visible) only once every in-sync follower has it, or once
    /// the set has shrunk, so an event whose delivery timed out can still
    /// appear this long after. The restore of a lost Redis waits it out.
    /// Kafka's default is 30 s; set what the brokers use.
    #[serde(
        default = "default_replica_lag_max",
        deserialize_with = "duration::millis"
    )]
    pub replica_lag_max_ms: Duration,
    /// How long the producer waits to fill a batch (`linger.ms`), in
    /// milliseconds.
    #[serde(default = "default_linger_ms", deserialize_with = "duration::millis")]
    pub linger_ms: Duration,
    /// How many bytes a consumer's fetch waits for (`fetch.min.bytes`), at
    /// most `fetch_wait_max_ms`: a fetch that returns a handful of events
    /// costs librdkafka and the broker as much as a full one.
    #[serde(default = "default_fetch_min_bytes")]
    pub fetch_min_bytes: u32,
    /// The longest a consumer's fetch waits for them (`fetch.wait.max.ms`),
    /// in milliseconds: added to an order's way to its row, not to the 202.
    #[serde(
        default = "default_fetch_wait_max_ms",
        deserialize_with = "duration::millis"
    )]
    pub fetch_wait_max_ms: Duration,
}

fn default_fetch_min_bytes() -> u32 {
    65_536
}

fn default_fetch_wait_max_ms() -> Duration {
    Duration::from_millis(50)
}

fn default_min_insync_replicas() -> i32 {
    1
}

fn default_replica_lag_max() -> Duration {
    Duration::from_secs(30)
}

fn default_linger_ms() -> Duration {
    Duration::from_millis(5)
}

fn request_timeout() -> Duration {
    Duration::from_secs(10)
}
