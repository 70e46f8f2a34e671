//! Typed settings, layered: `config/default.toml`, then `config/<env>.toml`
//! (env from `SECKILL_ENV`, default `development`), then `SECKILL__SECTION__KEY`
//! environment variables. Secrets are [`SecretString`]s so that printing a
//! `Settings` (logs, panics, `Debug`) never shows them.

use std::time::Duration;

use secrecy::SecretString;
use serde::Deserialize;

mod app;
mod auth;
mod kafka;
mod load;
mod payment;
mod sale;
mod stores;
mod validate;
mod waiting_room;

pub use app::{AppSettings, Environment, LogFormat, LogSettings};
pub use auth::{AuthSettings, JwksConfig, JwksSource};
pub use kafka::KafkaSettings;
pub use payment::{PaymentSettings, ProviderKind, StripeSettings, TradeType, WechatPaySettings};
pub use sale::{AdmissionSettings, OrderSettings, ReconcileSettings, WorkerSettings};
pub use stores::{GateConnection, PostgresSettings, RedisMode, RedisSettings};
pub use waiting_room::WaitingRoomSettings;

/// Durations as the files write them: whole milliseconds or seconds, the
/// key's suffix (`_ms`, `_secs`) naming the unit. Their lower bounds are
/// checked once, in [`Settings::validate`].
mod duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    pub fn millis<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }

    pub fn secs<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_secs)
    }

    pub fn optional_secs<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_secs))
    }
}

/// The JWT secret shipped in `config/default.toml`. Known to everyone who
/// reads the repository, so production refuses to start with it.
pub const DEV_JWT_SECRET: &str = "dev-only-secret-do-not-use-in-production";

/// The server's own key root shipped in `config/default.toml`.
pub const DEV_SERVER_SECRET: &str = "dev-only-server-secret-do-not-use-in-production";

/// The payment callback secret shipped in `config/default.toml`.
pub const DEV_NOTIFY_SECRET: &str = "dev-only-notify-secret-do-not-use-in-production";

/// The largest `app.instance_id`: 10 bits of the snowflake id, less 1023,
/// which is the database's (orders admitted while Redis is down).
/// `ids::MAX_LEASED_INSTANCE` is this bound.
pub const MAX_CONFIGURED_INSTANCE: u16 = 1022;

/// Everything the binary reads from configuration.
#[derive(Debug, Clone, Deserialize)]
pub struct Settings {
    /// Process-level settings: environment, listen address, instance id.
    pub app: AppSettings,
    /// JWT verification.
    pub auth: AuthSettings,
    /// Redis: admission gate, reservations, purchase tokens.
    pub redis: RedisSettings,
    /// PostgreSQL: the source of truth.
    pub postgres: PostgresSettings,
    /// Kafka: order events, outbox relay, dead letters.
    pub kafka: KafkaSettings,
    /// The hot path: purchase tokens, limits, backpressure.
    pub admission: AdmissionSettings,
    /// The order-creating consumer.
    pub orders: OrderSettings,
    /// Payment provider and callbacks.
    pub payment: PaymentSettings,
    /// Background workers: timeout closer, outbox relay, stock releaser.
    pub workers: WorkerSettings,
    /// Reconciliation of Redis, PostgreSQL and stale reservations.
    pub reconcile: ReconcileSettings,
    /// Log output.
    pub log: LogSettings,
    /// Waiting rooms: the admitter and the proof of work.
    pub waiting_room: WaitingRoomSettings,
}

impl Settings {
    /// How long after a send the event it carried may still reach the broker:
    /// a delivery that began within the publish budget and was retried by
    /// librdkafka for a message timeout, once more. Reservations are voided,
    /// and a lost Redis restored, only after this has passed.
    pub fn in_flight_bound(&self) -> Duration {
        self.kafka.message_timeout_ms * 2 + self.admission.publish_budget_ms
    }

    /// How long after Redis was seen to have lost an activity an event sent
    /// before the loss can still become visible on the broker: every send
    /// after the loss first checks a reservation record the loss took, so
    /// only messages already handed to librdkafka (within a publish budget
    /// of their reservation) are left, and librdkafka reports each within
    /// its message timeout. On a replicated topic a write the leader
    /// appended by then commits once the in-sync set has it or has shrunk:
    /// up to the brokers' `replica.lag.time.max.ms` later. The restore
    /// waits this long.
    pub fn restore_wait(&self) -> Duration {
        let commit = match self.kafka.replication_factor {
            ..=1 => Duration::ZERO,
            _ => self.kafka.replica_lag_max_ms,
        };
        self.kafka.message_timeout_ms + self.admission.publish_budget_ms + commit
    }

    /// How many `X-Forwarded-For` hops from the right name the client.
    pub fn forwarded_hops(&self) -> usize {
        match self.admission.trusted_proxies {
            0 => usize::from(self.admission.trust_forwarded_for),
            n => n,
        }
    }

    /// Whether development conveniences may run: the development secrets,
    /// the mock payment provider. Only in an environment named exactly
    /// `development` or `test`; any other name (`production`, `staging`,
    /// `prod`, a typo) is held to production's rules.
    pub fn allows_development_conveniences(&self) -> bool {
        matches!(self.app.env, Environment::Development | Environment::Test)
    }
}

#[cfg(test)]
mod tests;
