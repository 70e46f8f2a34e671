//! `[admission]`, `[orders]`, `[workers]` and `[reconcile]`: the order path's
//! settings.

use std::time::Duration;

use serde::Deserialize;

use super::duration;

/// Reconciliation (SPEC step 4 and "Reconciliation and degradation").
#[derive(Debug, Clone, Deserialize)]
pub struct ReconcileSettings {
    /// Run the reconciler periodically inside `serve`.
    pub enabled: bool,
    /// Pause between runs, in seconds.
    #[serde(deserialize_with = "duration::secs")]
    pub interval_secs: Duration,
    /// A reservation still open this long after it was made has no order
    /// event behind it (a crash between reserve and publish): it is voided.
    /// Must be well above `2 × kafka.timeout_ms` plus the consumer's lag.
    #[serde(deserialize_with = "duration::secs")]
    pub reservation_grace_secs: Duration,
    /// Sooner than the grace, an unacknowledged reservation is voided once
    /// this long has passed since it was made or last sent and the order
    /// consumers have committed every partition to its end (its event, had
    /// it reached the broker, would have been applied). Also how long a
    /// Redis that lost an activity waits before it is restored from the
    /// database. Must cover a message's whole life in the producer: at
    /// least `2 × kafka.message_timeout_ms + admission.publish_budget_ms`.
    #[serde(deserialize_with = "duration::secs")]
    pub publish_window_secs: Duration,
    /// How long after an activity's end its Redis keys are removed (once
    /// every order is settled and the figures agree), in seconds.
    #[serde(deserialize_with = "duration::secs")]
    pub cleanup_after_secs: Duration,
    /// Lifetime of the lease one reconciler holds at a time, in seconds;
    /// renewed every third of it while a run lasts. Unset: 30 s.
    #[serde(default, deserialize_with = "duration::optional_secs")]
    pub lease_secs: Option<Duration>,
}

/// Background workers run by `serve` (each can be switched off).
#[derive(Debug, Clone, Deserialize)]
pub struct WorkerSettings {
    /// Close overdue WAITING_PAY orders.
    pub closer_enabled: bool,
    /// Pause between closer scans, in milliseconds.
    #[serde(deserialize_with = "duration::millis")]
    pub closer_interval_ms: Duration,
    /// Orders closed per transaction.
    pub closer_batch: i64,
    /// Publish the transactional outbox.
    pub relay_enabled: bool,
    /// Pause between outbox polls when idle, in milliseconds.
    #[serde(deserialize_with = "duration::millis")]
    pub relay_poll_ms: Duration,
    /// Outbox rows published per transaction.
    pub relay_batch: i64,
    /// Attempts before an outbox row is marked DEAD.
    pub relay_max_attempts: i32,
    /// Consume `stock.released` and give the units back to Redis.
    pub releaser_enabled: bool,
    /// Consume `coupon.claimed` and write the claims.
    pub claimer_enabled: bool,
}

/// Admission (SPEC step 1) settings.
#[derive(Debug, Clone, Deserialize)]
pub struct AdmissionSettings {
    /// Lifetime of a one-time purchase token, in seconds.
    #[serde(deserialize_with = "duration::secs")]
    pub token_ttl_secs: Duration,
    /// Per-activity token bucket refill rate (requests/s); 0 = off.
    pub activity_rate_per_sec: u32,
    /// Per-activity token bucket capacity.
    pub activity_burst: u32,
    /// Per-client-IP token bucket refill rate (requests/s); 0 = off.
    pub ip_rate_per_sec: u32,
    /// Per-client-IP token bucket capacity.
    pub ip_burst: u32,
    /// Proxies in front of the service that append to `X-Forwarded-For`:
    /// the client address is the entry this many hops from the right (the
    /// entries further left are whatever the client sent). 0: the peer
    /// address, the header ignored.
    pub trusted_proxies: usize,
    /// Older form of `trusted_proxies = 1`; used only while that is 0.
    pub trust_forwarded_for: bool,
    /// Purchases awaiting a Kafka delivery report before new ones are
    /// refused with 503 BUSY (backpressure before Redis is touched).
    pub max_in_flight: usize,
    /// Acknowledgements waiting to be recorded in Redis before new purchases
    /// get 503 BUSY (Redis falling behind).
    pub max_pending_acks: usize,
    /// Purchases get 503 BUSY while the order consumers are this many
    /// messages behind (SPEC step 2); 0 turns it off.
    pub max_consumer_lag: i64,
    /// How often `serve` samples that lag, in milliseconds.
    #[serde(deserialize_with = "duration::millis")]
    pub lag_sample_ms: Duration,
    /// How long reservation records live in Redis, in seconds.
    #[serde(deserialize_with = "duration::secs")]
    pub reservation_ttl_secs: Duration,
    /// How long a purchase waits for its delivery report before it answers
    /// 503 RETRY_LATER (the delivery goes on in the background), in ms.
    #[serde(deserialize_with = "duration::millis")]
    pub publish_budget_ms: Duration,
    /// How long this instance answers SOLD_OUT from memory after Redis
    /// said so for an activity, unless a release clears it first, in ms;
    /// 0 turns the sold-out fast path off.
    #[serde(
        default = "default_sold_out_ttl_ms",
        deserialize_with = "duration::millis"
    )]
    pub sold_out_ttl_ms: Duration,
    /// Sell through the database while Redis is down (docs/FALLBACK.md).
    #[serde(default = "default_true")]
    pub fallback_enabled: bool,
    /// How long Redis must have failed every probe before this instance
    /// takes purchases to the database, in ms.
    #[serde(
        default = "default_fallback_after_ms",
        deserialize_with = "duration::millis"
    )]
    pub fallback_after_ms: Duration,
    /// Purchases per second per activity (on each instance) the fallback
    /// admits; 0 refuses them all (429).
    #[serde(default = "default_fallback_rate_per_sec")]
    pub fallback_rate_per_sec: u32,
    /// How long an instance sells from Redis on the admission modes it
    /// read last while PostgreSQL does not answer it (a failover), in ms.
    /// The fallback sells only once its switch to the database is this
    /// old, so no instance sells from Redis beside it.
    #[serde(
        default = "default_modes_trusted_for_ms",
        deserialize_with = "duration::millis"
    )]
    pub modes_trusted_for_ms: Duration,
}

fn default_modes_trusted_for_ms() -> Duration {
    Duration::from_millis(30_000)
}

fn default_true() -> bool {
    true
}

fn default_fallback_after_ms() -> Duration {
    Duration::from_millis(2000)
}

fn default_fallback_rate_per_sec() -> u32 {
    1000
}

fn default_sold_out_ttl_ms() -> Duration {
    Duration::from_millis(200)
}

/// Order-creating consumer settings (SPEC step 3).
#[derive(Debug, Clone, Deserialize)]
pub struct OrderSettings {
    /// Run the order consumer inside `serve`.
    pub consumer_enabled: bool,
    /// Largest number of messages in one database transaction.
    pub batch_size: usize,
    /// Longest wait for a batch to fill, in milliseconds.
    #[serde(deserialize_with = "duration::millis")]
    pub batch_wait_ms: Duration,
    /// Batches applied at once, each in its own transaction.
    #[serde(default = "default_batches_in_flight")]
    pub batches_in_flight: usize,
    /// Orders per second this instance's order consumer writes at most
    /// (a token bucket; 0 = unlimited). Set it to about 80 % of the write
    /// rate the database sustained in a drain test: the backlog it leaves
    /// in the topic turns purchases to 503 `BUSY` past
    /// `admission.max_consumer_lag`.
    #[serde(default)]
    pub max_write_rate: u32,
    /// More purchases in flight on this instance than this is a rush, in
    /// which an order batch waits up to `rush_batch_wait_ms` to fill
    /// (0 = never).
    #[serde(default = "default_rush_in_flight")]
    pub rush_in_flight: usize,
    /// How long an order batch waits to fill during a rush, in ms (at
    /// least `batch_wait_ms`).
    #[serde(
        default = "default_rush_batch_wait_ms",
        deserialize_with = "duration::millis"
    )]
    pub rush_batch_wait_ms: Duration,
    /// How long an order's event stream stays open without reaching a
    /// final status, in seconds.
    #[serde(
        default = "default_events_timeout_secs",
        deserialize_with = "duration::secs"
    )]
    pub events_timeout_secs: Duration,
    /// Order event streams one user may hold open at once on this
    /// instance; one more answers 429.
    #[serde(default = "default_streams_per_user")]
    pub streams_per_user: usize,
}

fn default_streams_per_user() -> usize {
    8
}

fn default_batches_in_flight() -> usize {
    4
}

fn default_rush_in_flight() -> usize {
    64
}

fn default_rush_batch_wait_ms() -> Duration {
    Duration::from_millis(300)
}

fn default_events_timeout_secs() -> Duration {
    Duration::from_secs(1800)
}
