//! `[redis]` and `[postgres]`: the stores and their timeouts.

use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use super::duration;

/// How Redis is deployed (`redis.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RedisMode {
    /// One server: `redis.url` names it.
    Standalone,
    /// A Redis Cluster: `redis.url` lists seed nodes, comma-separated.
    Cluster,
}

/// The admission script's connection (`redis.gate_connection`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GateConnection {
    /// One long-lived pipelined connection (the default).
    Multiplexed,
    /// A deadpool checkout per call, which PINGs on recycle (one server
    /// only). See docs/BENCHMARKS-HISTORY.md.
    Pool,
}

/// Redis connection settings.
#[derive(Debug, Clone, Deserialize)]
pub struct RedisSettings {
    /// `standalone` (one server) or `cluster` (a Redis Cluster).
    pub mode: RedisMode,
    /// `redis://host:port[/db]`; in cluster mode, seed nodes separated by
    /// commas (`redis://h1:7000,redis://h2:7001`).
    pub url: String,
    /// Prefix of every key this instance writes; tests use one per test.
    pub key_prefix: String,
    /// Largest number of pooled connections (`gate_connection = "pool"`).
    pub pool_size: usize,
    /// Connect / checkout timeout, in milliseconds.
    #[serde(deserialize_with = "duration::millis")]
    pub timeout_ms: Duration,
    /// Connection of the admission script: `multiplexed` (one long-lived
    /// pipelined connection, the default) or `pool` (a deadpool checkout per
    /// call, which PINGs on recycle). See
    /// docs/BENCHMARKS-HISTORY.md, "The admission path".
    pub gate_connection: GateConnection,
}

/// PostgreSQL connection settings.
#[derive(Debug, Clone, Deserialize)]
pub struct PostgresSettings {
    /// `postgres://user:password@host:port/db`; holds the password, so secret.
    pub url: SecretString,
    /// Largest number of pooled connections.
    pub pool_size: u32,
    /// Connections of the separate pool of public reads (the activity
    /// view, readiness), which therefore never take the consumers' ones.
    pub public_pool_size: u32,
    /// Connection checkout timeout, in milliseconds.
    #[serde(deserialize_with = "duration::millis")]
    pub timeout_ms: Duration,
    /// A streaming replica of the primary (one standby, not a balanced
    /// set) for the buyers' order reads and the public activity view; ""
    /// (the default): every read on the primary. Holds a password, so
    /// secret. See docs/OPERATIONS.md, "Reads from a replica".
    #[serde(default = "no_replica")]
    pub replica_url: SecretString,
    /// A replica further behind than this is not read from (its reads go
    /// to the primary, and readiness says so), in milliseconds.
    #[serde(default = "replica_max_lag", deserialize_with = "duration::millis")]
    pub replica_max_lag_ms: Duration,
    /// Longest wait for a new connection, per host tried.
    #[serde(default = "pg_connect_timeout", deserialize_with = "duration::millis")]
    pub connect_timeout_ms: Duration,
    /// The server cancels a statement running longer (statement_timeout
    /// of every pooled connection). `seckill migrate` runs without it.
    #[serde(
        default = "pg_statement_timeout",
        deserialize_with = "duration::millis"
    )]
    pub statement_timeout_ms: Duration,
    /// The server ends a session left idle inside a transaction this long:
    /// a client that vanished mid-transaction releases its row locks.
    #[serde(
        default = "pg_idle_in_transaction",
        deserialize_with = "duration::millis"
    )]
    pub idle_in_transaction_timeout_ms: Duration,
    /// A host that stops answering (it vanished, the network cut it off
    /// without a reset) is given up after this long without an answer to
    /// the kernel's keepalives or to sent data (TCP keepalives and
    /// tcp_user_timeout), instead of the ~15 minutes of TCP's own.
    #[serde(default = "pg_dead_host", deserialize_with = "duration::millis")]
    pub dead_host_ms: Duration,
    /// The longest one database call may take, by this process's own
    /// clock: past it the caller is told the database did not answer and
    /// retries on another connection, whatever the network does with the
    /// first. Longer than `statement_timeout_ms`.
    #[serde(default = "pg_call_timeout", deserialize_with = "duration::millis")]
    pub call_timeout_ms: Duration,
}

fn pg_connect_timeout() -> Duration {
    Duration::from_secs(5)
}

fn pg_statement_timeout() -> Duration {
    Duration::from_secs(15)
}

fn pg_idle_in_transaction() -> Duration {
    Duration::from_secs(10)
}

fn pg_dead_host() -> Duration {
    Duration::from_secs(15)
}

fn pg_call_timeout() -> Duration {
    Duration::from_secs(20)
}

fn no_replica() -> SecretString {
    SecretString::from("")
}

fn replica_max_lag() -> Duration {
    Duration::from_secs(10)
}

impl PostgresSettings {
    /// The replica's URL, when one is set.
    pub fn replica(&self) -> Option<&str> {
        Some(self.replica_url.expose_secret().trim()).filter(|u| !u.is_empty())
    }
}
