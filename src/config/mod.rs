//! Typed settings, layered: `config/default.toml`, then `config/<env>.toml`
//! (env from `SECKILL_ENV`, default `development`), then `SECKILL__SECTION__KEY`
//! environment variables. Secrets are [`SecretString`]s so that printing a
//! `Settings` (logs, panics, `Debug`) never shows them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

mod payment;
mod waiting_room;

pub use payment::{PaymentSettings, ProviderKind, StripeSettings, TradeType, WechatPaySettings};
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

/// Everything the binary reads from configuration.
/// The largest `app.instance_id`: 10 bits of the snowflake id, less 1023,
/// which is the database's (orders admitted while Redis is down).
/// `ids::MAX_LEASED_INSTANCE` is this bound.
pub const MAX_CONFIGURED_INSTANCE: u16 = 1022;

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

/// Process-level settings.
#[derive(Debug, Clone, Deserialize)]
pub struct AppSettings {
    /// The environment's name, from `SECKILL_ENV` (default `development`).
    /// Only `development` and `test` allow the development secrets and the
    /// mock payment provider; every other name must set real ones.
    pub env: Environment,
    /// Address the HTTP server binds.
    pub host: String,
    /// Port the HTTP server binds; 0 picks a free one (tests).
    pub port: u16,
    /// This instance's id in the snowflake generator (0..=1022; 1023 is the database fallback's). Unset (the
    /// default): a free one is leased in Redis at start-up. Set: exactly
    /// this one is leased, and `serve` refuses to start while another
    /// running instance holds it. Either way two running instances never
    /// share an id.
    pub instance_id: Option<u16>,
    /// Lifetime of the instance-id lease in Redis, in seconds; renewed five
    /// times per lifetime. A process that cannot renew stops making order
    /// numbers when it runs out; a crashed one's id is free again after it.
    #[serde(deserialize_with = "duration::secs")]
    pub instance_lease_secs: Duration,
    /// How long a graceful shutdown waits for in-flight requests, in seconds.
    #[serde(deserialize_with = "duration::secs")]
    pub shutdown_timeout_secs: Duration,
    /// Whether the environment was named (`SECKILL_ENV` set, or a test's
    /// own); false when `development` was assumed for want of a name.
    /// An assumed development never serves beyond loopback.
    #[serde(default)]
    pub env_named: bool,
}

/// The environment a process runs in (`app.env`, named by `SECKILL_ENV`).
/// Two names are known; every other is a deployment's own (`production`,
/// `staging`, a typo) and held to production's rules.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(from = "String")]
pub enum Environment {
    /// A developer's machine: the development secrets, the mock provider
    /// and `POST /api/v1/dev/token`.
    Development,
    /// The test suites: the development secrets and the mock provider.
    Test,
    /// Any other name.
    Named(String),
}

impl Environment {
    /// The name, as `SECKILL_ENV` gave it.
    pub fn as_str(&self) -> &str {
        match self {
            Environment::Development => "development",
            Environment::Test => "test",
            Environment::Named(name) => name,
        }
    }
}

impl From<String> for Environment {
    fn from(name: String) -> Self {
        match name.as_str() {
            "development" => Environment::Development,
            "test" => Environment::Test,
            _ => Environment::Named(name),
        }
    }
}

impl From<&str> for Environment {
    fn from(name: &str) -> Self {
        Environment::from(name.to_owned())
    }
}

impl std::fmt::Display for Environment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for Environment {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// JWT verification settings.
#[derive(Debug, Clone, Deserialize)]
pub struct AuthSettings {
    /// HS256 secret shared with whoever issues tokens.
    pub jwt_secret: SecretString,
    /// The key root of what the server signs for itself and checks
    /// itself: queue passes, proof-of-work challenges, entrants' salts,
    /// the fallback's purchase tokens. Never the JWT secret: whoever can
    /// mint user tokens must not be able to mint passes.
    pub server_secret: SecretString,
    /// When set, a token's `iss` must be exactly this.
    #[serde(default)]
    pub issuer: Option<String>,
    /// When set, a token's `aud` must name this.
    #[serde(default)]
    pub audience: Option<String>,
    /// User tokens come from an identity provider that publishes its keys
    /// here (a JWKS): RS256 or ES256, never HS256. Needs `issuer` and
    /// `audience`.
    #[serde(default)]
    pub jwks_url: Option<String>,
    /// Find the JWKS through OIDC discovery, at
    /// `{issuer}/.well-known/openid-configuration`, instead of `jwks_url`.
    #[serde(default)]
    pub discovery: bool,
    /// How long a fetched JWKS is used before it is fetched again, in
    /// seconds.
    #[serde(default = "jwks_ttl_by_default", deserialize_with = "duration::secs")]
    pub jwks_ttl_secs: Duration,
    /// The least time between two fetches of the JWKS for a token whose
    /// `kid` it does not have, in seconds: made-up `kid`s cost one fetch
    /// per cooldown.
    #[serde(
        default = "jwks_cooldown_by_default",
        deserialize_with = "duration::secs"
    )]
    pub jwks_cooldown_secs: Duration,
}

fn jwks_ttl_by_default() -> Duration {
    Duration::from_secs(300)
}

fn jwks_cooldown_by_default() -> Duration {
    Duration::from_secs(30)
}

/// Where the keys are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JwksSource {
    /// A JWKS URL.
    Jwks(String),
    /// An issuer whose `/.well-known/openid-configuration` names it.
    Discovery(String),
}

/// What the identity provider's key set (`auth::jwks::Jwks`) is
/// configured with.
#[derive(Debug, Clone)]
pub struct JwksConfig {
    pub source: JwksSource,
    /// The exact `iss` a token must carry.
    pub issuer: String,
    /// The audience a token's `aud` must name.
    pub audience: String,
    pub ttl: Duration,
    pub cooldown: Duration,
}

impl AuthSettings {
    /// The identity provider's settings, `None` without one; an error
    /// names what is missing or contradicts.
    pub fn provider(&self) -> anyhow::Result<Option<JwksConfig>> {
        let source = match (&self.jwks_url, self.discovery) {
            (None, false) => return Ok(None),
            (Some(_), true) => {
                bail!("auth.jwks_url and auth.discovery: set one (discovery finds the JWKS itself)")
            }
            (Some(url), false) => JwksSource::Jwks(url.clone()),
            (None, true) => JwksSource::Discovery(self.issuer.clone().ok_or_else(|| {
                anyhow::anyhow!("auth.discovery needs auth.issuer (the provider to ask)")
            })?),
        };
        let url = match &source {
            JwksSource::Jwks(url) | JwksSource::Discovery(url) => url,
        };
        if !(url.starts_with("https://") || url.starts_with("http://")) {
            bail!("auth.jwks_url / auth.issuer must be an http(s) URL, not {url:?}");
        }
        let (Some(issuer), Some(audience)) = (self.issuer.clone(), self.audience.clone()) else {
            bail!(
                "tokens from an identity provider need auth.issuer and auth.audience (a token's \
                 exact iss, and the aud it must name)"
            );
        };
        if self.jwks_cooldown_secs < Duration::from_secs(1) {
            bail!("auth.jwks_cooldown_secs must be at least 1 s");
        }
        if self.jwks_ttl_secs < self.jwks_cooldown_secs {
            bail!("auth.jwks_ttl_secs must be at least auth.jwks_cooldown_secs");
        }
        Ok(Some(JwksConfig {
            source,
            issuer,
            audience,
            ttl: self.jwks_ttl_secs,
            cooldown: self.jwks_cooldown_secs,
        }))
    }
}

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
    /// only). See BENCHMARKS.md.
    Pool,
}

/// The log's format (`log.format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Pretty,
    /// One JSON object per line.
    Json,
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
    /// call, which PINGs on recycle). See BENCHMARKS.md.
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

fn request_timeout() -> Duration {
    Duration::from_secs(10)
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
    /// How long the producer waits to fill a batch (`linger.ms`), in
    /// milliseconds.
    #[serde(default = "default_linger_ms", deserialize_with = "duration::millis")]
    pub linger_ms: Duration,
}

fn default_min_insync_replicas() -> i32 {
    1
}

fn default_linger_ms() -> Duration {
    Duration::from_millis(2)
}

/// Log output settings.
#[derive(Debug, Clone, Deserialize)]
pub struct LogSettings {
    /// `pretty` (human-readable) or `json` (one object per line).
    pub format: LogFormat,
    /// Default filter (`RUST_LOG` wins when set), e.g. `info` or `seckill=debug`.
    pub level: String,
}

impl Settings {
    /// Loads the layers for the environment named by `SECKILL_ENV`.
    pub fn load() -> anyhow::Result<Self> {
        match std::env::var("SECKILL_ENV") {
            Ok(env) => Self::load_env(&env),
            // Unnamed: development, for the README's two commands on a
            // developer's machine, and never beyond loopback (validate).
            Err(_) => Self::load_layers("development", false),
        }
    }

    /// Loads `default.toml`, then `<env>.toml`, then `SECKILL__*` variables,
    /// from the folder in `SECKILL_CONFIG_DIR` (default `config`).
    pub fn load_env(env: &str) -> anyhow::Result<Self> {
        Self::load_layers(env, true)
    }

    fn load_layers(env: &str, named: bool) -> anyhow::Result<Self> {
        let dir = config_dir();
        // The environment is the one named, whether or not a file of its
        // own exists: `staging` without config/staging.toml is staging, not
        // the development that default.toml describes.
        let named = format!("[app]\nenv = {env:?}\nenv_named = {named}\n");
        let settings: Settings = config::Config::builder()
            .add_source(config::File::from(dir.join("default.toml")))
            .add_source(config::File::from(dir.join(format!("{env}.toml"))).required(false))
            .add_source(config::File::from_str(&named, config::FileFormat::Toml))
            .add_source(
                config::Environment::with_prefix("SECKILL")
                    .prefix_separator("__")
                    .separator("__")
                    .try_parsing(true),
            )
            .build()
            .with_context(|| format!("reading configuration from {}", dir.display()))?
            .try_deserialize()
            .context("configuration does not match the expected shape")?;
        settings.validate()?;
        Ok(settings)
    }

    /// How long after a send the event it carried may still reach the broker:
    /// a delivery that began within the publish budget and was retried by
    /// librdkafka for a message timeout, once more. Reservations are voided,
    /// and a lost Redis restored, only after this has passed.
    pub fn in_flight_bound(&self) -> Duration {
        self.kafka.message_timeout_ms * 2 + self.admission.publish_budget_ms
    }

    /// How long after Redis was seen to have lost an activity an event sent
    /// before the loss can still reach the broker: every send after the
    /// loss first checks a reservation record the loss took, so only
    /// messages already handed to librdkafka (within a publish budget of
    /// their reservation) are left, and librdkafka reports each within its
    /// message timeout. The restore waits this long.
    pub fn restore_wait(&self) -> Duration {
        self.kafka.message_timeout_ms + self.admission.publish_budget_ms
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

    /// What a production deployment must set and has not, each named by
    /// its variable, so one start-up message lists them all.
    pub fn production_problems(&self) -> Vec<&'static str> {
        let weak = |secret: &SecretString, dev: &str| {
            let secret = secret.expose_secret();
            secret == dev || secret.len() < 32
        };
        let mut problems = Vec::new();
        if weak(&self.auth.jwt_secret, DEV_JWT_SECRET) {
            problems.push(
                "SECKILL__AUTH__JWT_SECRET (auth.jwt_secret: at least 32 bytes, \
                 not the development secret)",
            );
        }
        if weak(&self.auth.server_secret, DEV_SERVER_SECRET) {
            problems.push(
                "SECKILL__AUTH__SERVER_SECRET (auth.server_secret: at least 32 bytes, \
                 not the development secret)",
            );
        }
        // Only `external` and the mock (refused below) verify callbacks
        // with it: under another provider its route is not there.
        if matches!(
            self.payment.kind(),
            ProviderKind::External | ProviderKind::Mock
        ) && weak(&self.payment.notify_secret, DEV_NOTIFY_SECRET)
        {
            problems.push(
                "SECKILL__PAYMENT__NOTIFY_SECRET (payment.notify_secret: at least 32 bytes, \
                 not the development secret)",
            );
        }
        if self.payment.kind() == ProviderKind::Mock {
            problems.push(
                "SECKILL__PAYMENT__MOCK=false (payment.mock: the mock provider's \
                 /api/v1/dev routes let any buyer mark an order paid)",
            );
        }
        problems
    }

    /// Refuses settings that would run but be unsafe or wrong.
    pub fn validate(&self) -> anyhow::Result<()> {
        if !self.app.env_named && !is_loopback(&self.app.host) {
            bail!(
                "app.host is {:?}, beyond loopback, and SECKILL_ENV is not set: an unnamed \
                 environment is development (its published JWT secret, the mock payment \
                 provider and the admin-minting /api/v1/dev/token), which must never face a \
                 network. Set SECKILL_ENV=production with its secrets, or \
                 SECKILL_ENV=development to say that this is what you want",
                self.app.host
            );
        }
        if !self.allows_development_conveniences() {
            let problems = self.production_problems();
            if !problems.is_empty() {
                let env = &self.app.env;
                bail!(
                    "{env} (SECKILL_ENV={env}) needs: {} (only development and test run without them)",
                    problems.join("; ")
                );
            }
        }
        let identity_provider = self.auth.provider()?.is_some();
        if identity_provider && !self.allows_development_conveniences() {
            // Keys fetched in clear text can be swapped on the way: anyone
            // on the path could then mint every buyer's and admin's token.
            for (name, url) in [
                ("auth.jwks_url", &self.auth.jwks_url),
                ("auth.issuer", &self.auth.issuer),
            ] {
                if let Some(url) = url.as_deref().filter(|u| u.starts_with("http://")) {
                    bail!(
                        "{name} is {url:?}: outside development the identity provider is \
                         reached over https only"
                    );
                }
            }
        }
        match self.payment.kind() {
            ProviderKind::Wechatpay if self.payment.wechatpay.is_none() => bail!(
                "payment.provider = \"wechatpay\" needs [payment.wechatpay]: mchid, appid, \
                 merchant_serial, merchant_key_file, apiv3_key, platform_key_dir, notify_url \
                 (docs/PAYMENTS.md)"
            ),
            ProviderKind::Stripe if self.payment.stripe.is_none() => bail!(
                "payment.provider = \"stripe\" needs [payment.stripe]: secret_key, \
                 webhook_secret (docs/PAYMENTS.md)"
            ),
            _ => {}
        }
        if self.auth.server_secret.expose_secret() == self.auth.jwt_secret.expose_secret() {
            bail!(
                "auth.server_secret is auth.jwt_secret: whoever can mint user tokens could \
                 mint queue passes and purchase tokens; give the server a secret of its own \
                 (SECKILL__AUTH__SERVER_SECRET)"
            );
        }
        self.check_durations()?;
        let rush = self.orders.rush_batch_wait_ms;
        if self.orders.rush_in_flight > 0
            && (rush < self.orders.batch_wait_ms || rush > Duration::from_secs(5))
        {
            bail!(
                "orders.rush_batch_wait_ms must be within orders.batch_wait_ms ({} ms) and \
                 5000 ms: a batch held longer would look to the watchdog like a stalled \
                 consumer (or set orders.rush_in_flight = 0 to turn rushes off)",
                self.orders.batch_wait_ms.as_millis()
            );
        }
        if self.redis.mode == RedisMode::Cluster
            && self.redis.gate_connection == GateConnection::Pool
        {
            bail!(
                "redis.gate_connection = \"pool\" is for one server only, not redis.mode = \"cluster\""
            );
        }
        if self.reconcile.publish_window_secs < self.in_flight_bound() {
            bail!(
                "reconcile.publish_window_secs must be at least \
                 2 × kafka.message_timeout_ms + admission.publish_budget_ms \
                 (how long an event can still reach the broker after it was sent)"
            );
        }
        if self
            .app
            .instance_id
            .is_some_and(|id| id > MAX_CONFIGURED_INSTANCE)
        {
            bail!(
                "app.instance_id must be within 0..=1022 (10 bits of the snowflake id; \
                 1023 is the database's, for orders admitted while Redis is down)"
            );
        }
        Ok(())
    }
}

impl Settings {
    /// Every duration's lower bound, each named by its key: the ones the
    /// code divides by, waits on in a loop, or needs at least one tick of.
    fn check_durations(&self) -> anyhow::Result<()> {
        let ms = Duration::from_millis;
        let s = Duration::from_secs;
        let bounds = [
            (
                "app.instance_lease_secs",
                self.app.instance_lease_secs,
                s(2),
            ),
            (
                "app.shutdown_timeout_secs",
                self.app.shutdown_timeout_secs,
                s(1),
            ),
            (
                "admission.publish_budget_ms",
                self.admission.publish_budget_ms,
                ms(1),
            ),
            (
                "admission.lag_sample_ms",
                self.admission.lag_sample_ms,
                ms(50),
            ),
            (
                "admission.token_ttl_secs",
                self.admission.token_ttl_secs,
                s(1),
            ),
            (
                "admission.reservation_ttl_secs",
                self.admission.reservation_ttl_secs,
                s(1),
            ),
            ("orders.batch_wait_ms", self.orders.batch_wait_ms, ms(1)),
            (
                "orders.events_timeout_secs",
                self.orders.events_timeout_secs,
                s(1),
            ),
            (
                "workers.closer_interval_ms",
                self.workers.closer_interval_ms,
                ms(1),
            ),
            ("workers.relay_poll_ms", self.workers.relay_poll_ms, ms(10)),
            (
                "reconcile.interval_secs",
                self.reconcile.interval_secs,
                s(1),
            ),
            ("redis.timeout_ms", self.redis.timeout_ms, ms(1)),
            ("postgres.timeout_ms", self.postgres.timeout_ms, ms(1)),
            (
                "postgres.replica_max_lag_ms",
                self.postgres.replica_max_lag_ms,
                ms(1),
            ),
            (
                "postgres.connect_timeout_ms",
                self.postgres.connect_timeout_ms,
                s(1),
            ),
            (
                "postgres.statement_timeout_ms",
                self.postgres.statement_timeout_ms,
                s(1),
            ),
            (
                "postgres.idle_in_transaction_timeout_ms",
                self.postgres.idle_in_transaction_timeout_ms,
                s(1),
            ),
            ("postgres.dead_host_ms", self.postgres.dead_host_ms, s(3)),
            ("kafka.timeout_ms", self.kafka.timeout_ms, ms(1)),
            (
                "kafka.message_timeout_ms",
                self.kafka.message_timeout_ms,
                ms(1),
            ),
        ];
        for (key, value, least) in bounds {
            if value < least {
                bail!("{key} must be at least {least:?} (it is {value:?})");
            }
        }
        if self.kafka.min_insync_replicas < 1
            || self.kafka.min_insync_replicas > self.kafka.replication_factor
        {
            bail!(
                "kafka.min_insync_replicas must be within 1..=kafka.replication_factor (it is {})",
                self.kafka.min_insync_replicas
            );
        }
        if self.postgres.call_timeout_ms <= self.postgres.statement_timeout_ms {
            bail!(
                "postgres.call_timeout_ms must be longer than postgres.statement_timeout_ms: a \
                 slow statement is cancelled by the server first, and the call's own deadline \
                 is for a connection that no longer answers"
            );
        }
        if self.reconcile.lease_secs.is_some_and(|l| l < s(1)) {
            bail!("reconcile.lease_secs must be at least 1 s when set");
        }
        self.waiting_room.check()
    }
}

/// Whether `host` names this machine only: a loopback address, or
/// `localhost`.
fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn config_dir() -> PathBuf {
    match std::env::var_os("SECKILL_CONFIG_DIR") {
        Some(dir) => PathBuf::from(dir),
        None if Path::new("config/default.toml").exists() => PathBuf::from("config"),
        // Tests and benches run from the crate root, but be kind to `cargo run`
        // from elsewhere in the tree.
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("config"),
    }
}

#[cfg(test)]
mod tests;
