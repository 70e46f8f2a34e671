//! The shared state of every request handler and worker: each client
//! created once, and what the workers and consumers take from it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use deadpool_redis::{PoolConfig, Runtime, Timeouts};
use tokio::sync::{Notify, Semaphore};

use crate::activities::cache::ActivityCache;
use crate::admission::RedisGate;
use crate::admission::acks::Acks;
use crate::admission::admit::Admitter;
use crate::admission::fallback::Fallback;
use crate::admission::limits::{KeyedLimiter, Limits};
use crate::admission::publish::{Breaker, Publisher};
use crate::admission::soldout::SoldOut;
use crate::bus::probe::BrokerProbe;
use crate::bus::progress::GroupProgress;
use crate::bus::runner::Supervision;
use crate::bus::watchdog::Registry;
use crate::bus::{self, Producer, Topics};
use crate::clock::{SharedClock, SystemClock};
use crate::config::{GateConnection, RedisSettings, Settings};
use crate::coupons::claim::Claims;
use crate::coupons::gate::CouponGate;
use crate::ids::{IdGenerator, InstanceLease, LeasedIds};
use crate::liveness::Liveness;
use crate::metrics::Metrics;
use crate::orders::consumer::ConsumerDeps;
use crate::orders::events::OrderEvents;
use crate::outbox::relay::Relay;
use crate::payments::provider::{ExternalProvider, MockProvider, PaymentProvider};
use crate::reconcile::Reconciler;
use crate::store::notes::Notes;
use crate::store::redis_conn::RedisClient;
use crate::store::{self, PgPool};

/// Shared state of every request handler and worker.
pub struct AppState {
    /// The settings this process was started with.
    pub settings: Arc<Settings>,
    /// The admission scripts over one multiplexed connection (hot path).
    pub gate: Arc<RedisGate>,
    /// Publishes purchases (SPEC step 2) with three-valued delivery.
    pub publisher: Arc<Publisher>,
    /// Wakes the local reconciler when admission finds an activity Redis
    /// lost, so its restore starts without waiting for the next interval.
    pub restore_wanted: Arc<Notify>,
    /// Every supervised consumer of this process (readiness reads it).
    pub consumers: Arc<Registry>,
    /// Whether the topics this service uses exist (readiness waits for it).
    pub topics_created: Arc<std::sync::atomic::AtomicBool>,
    /// Warmed activities' windows and limits, cached in process.
    pub activities: Arc<ActivityCache>,
    /// Activities Redis said are sold out, answered from memory.
    pub sold_out: Arc<SoldOut>,
    /// Coupon scripts (same multiplexed connection as the gate).
    pub coupons: Arc<CouponGate>,
    /// Coupon claims (Redis, then the event), sharing these clients.
    pub claims: Arc<Claims>,
    /// Leases and notes in Redis (the reconcile lease, its last report).
    pub notes: Notes,
    /// The purchase pipeline (SPEC steps 1–2), sharing these clients.
    pub admission: Admitter,
    /// Snowflake order numbers, made only under a leased instance id.
    pub ids: Arc<dyn IdGenerator>,
    /// The lease behind `ids`; taken by `Application::build`.
    pub lease: InstanceLease,
    /// PostgreSQL connections (use through [`store::run`]).
    pub db: PgPool,
    /// The small pool of public reads, apart from `db`.
    pub public_db: PgPool,
    /// The idempotent Kafka producer; cheap to clone.
    pub producer: Producer,
    /// Topic names under this instance's prefix.
    pub topics: Topics,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// How far the order consumers have got (reconciler, lag sampler).
    pub order_progress: Arc<GroupProgress>,
    /// How far the coupon claimer has got (the restore of a lost batch).
    pub coupon_progress: Arc<GroupProgress>,
    /// Where pay intents are registered.
    pub provider: Box<dyn PaymentProvider>,
    /// The mock provider, when `payment.mock = true`.
    pub mock: Option<MockProvider>,
    /// Outgoing HTTP (the mock provider's callbacks).
    pub http: reqwest::Client,
    /// This server's own base URL (the mock provider calls it back).
    pub self_url: String,
    /// The runtime the state was made on (the process's main one). Work a
    /// request starts that must finish even if the request is dropped runs
    /// here: the HTTP workers' own runtimes end with them, taking their
    /// tasks along, when a graceful shutdown runs out of time.
    pub background: tokio::runtime::Handle,
    /// The sale clock (the system clock, but in tests).
    pub clock: SharedClock,
    /// Order status changes: announced after each commit, heard by the
    /// order streams (`orders::events`).
    pub order_events: Arc<OrderEvents>,
    /// Whether the broker answers a fresh client: the judge of every
    /// long-lived Kafka client, and readiness's view of Kafka.
    pub kafka_probe: Arc<BrokerProbe>,
    /// Whether this process can still heal itself (`/health/live`).
    pub liveness: Arc<Liveness>,
    /// Open order event streams per user.
    pub order_streams: Arc<crate::orders::events::StreamCounts>,
}

impl AppState {
    /// Creates every client. Nothing connects yet: a dependency that is down
    /// shows up in `/health/ready`, it does not stop the process. Must be
    /// called inside a Tokio runtime.
    pub fn connect(settings: Settings) -> anyhow::Result<Self> {
        Self::connect_with_clock(settings, Arc::new(SystemClock))
    }

    /// [`AppState::connect`] on the given sale clock.
    pub fn connect_with_clock(settings: Settings, clock: SharedClock) -> anyhow::Result<Self> {
        let a = &settings.admission;
        let gate_pool = match settings.redis.gate_connection {
            GateConnection::Pool => Some(redis_pool(&settings.redis)?),
            GateConnection::Multiplexed => None,
        };
        let gate = Arc::new(
            RedisGate::new(&settings.redis, a, gate_pool).context("creating the Redis gate")?,
        );
        let topics = Topics::new(&settings.kafka.topic_prefix);
        let producer = Producer::new(&settings.kafka)?;
        let metrics = Metrics::new()?;
        let leased = Arc::new(LeasedIds::default());
        // The instance lease and the coupon scripts have keys of their own:
        // they share one connection, apart from admission's.
        let shared = RedisClient::new(&settings.redis)
            .and_then(|client| client.connect_lazy())
            .context("creating the Redis connection")?;
        let db = store::pool(&settings.postgres);
        let lease = InstanceLease::new(
            shared.clone(),
            db.clone(),
            &settings.redis.key_prefix,
            settings.app.instance_id,
            Duration::from_secs(settings.app.instance_lease_secs),
            leased.clone(),
            metrics.instance_id.clone(),
        );
        let publisher = Arc::new(Publisher {
            producer: producer.clone(),
            topic: topics.order_requested.clone(),
            gate: gate.clone(),
            acks: Acks::start(gate.clone(), a.max_pending_acks, clock.clone()),
            metrics: metrics.clone(),
            budget: Duration::from_millis(a.publish_budget_ms.max(1)),
            breaker: Breaker::default(),
            clock: clock.clone(),
        });
        let order_events = Arc::new(OrderEvents::new(shared.clone(), &settings.redis.key_prefix));
        let coupons = Arc::new(CouponGate::new(shared, &settings.redis.key_prefix));
        let activities = Arc::new(ActivityCache::default());
        let sold_out = Arc::new(SoldOut::new(
            Duration::from_millis(a.sold_out_ttl_ms),
            metrics.sold_out_activities.clone(),
        ));
        let restore_wanted = Arc::new(Notify::new());
        let limits = Limits {
            activity: KeyedLimiter::new(a.activity_rate_per_sec, a.activity_burst),
            ip: KeyedLimiter::new(a.ip_rate_per_sec, a.ip_burst),
        };
        let in_flight = Arc::new(Semaphore::new(a.max_in_flight.max(1)));
        let settings = Arc::new(settings);
        let fallback = Arc::new(Fallback::new(
            settings.clone(),
            db.clone(),
            metrics.clone(),
            clock.clone(),
            order_events.clone(),
        ));
        let admission = Admitter {
            settings: settings.clone(),
            limits,
            activities: activities.clone(),
            sold_out: sold_out.clone(),
            coupons: coupons.clone(),
            in_flight,
            ids: leased.clone(),
            publisher: publisher.clone(),
            gate: gate.clone(),
            db: db.clone(),
            restore_wanted: restore_wanted.clone(),
            metrics: metrics.clone(),
            clock: clock.clone(),
            fallback,
        };
        let claims = Arc::new(Claims {
            gate: coupons.clone(),
            db: db.clone(),
            producer: producer.clone(),
            topic: topics.coupon_claimed.clone(),
            budget: publisher.budget,
            clock: clock.clone(),
            restore_wanted: restore_wanted.clone(),
        });
        let kafka_probe = BrokerProbe::new(&settings.kafka, &topics.order_requested);
        kafka_probe.start();
        Ok(Self {
            notes: Notes::new(&settings.redis).context("creating the Redis notes")?,
            coupons,
            claims,
            publisher,
            restore_wanted,
            consumers: Arc::new(Registry::default()),
            topics_created: Arc::default(),
            gate,
            activities,
            sold_out,
            admission,
            ids: leased,
            lease,
            db,
            public_db: store::public_pool(&settings.postgres),
            producer,
            metrics,
            order_progress: Arc::new(GroupProgress::new(
                &settings.kafka,
                &bus::group_id(&settings.kafka, crate::orders::consumer::CONSUMER),
                &topics.order_requested,
            )?),
            coupon_progress: Arc::new(GroupProgress::new(
                &settings.kafka,
                &bus::group_id(&settings.kafka, crate::coupons::consumer::CONSUMER),
                &topics.coupon_claimed,
            )?),
            topics,
            provider: if settings.payment.mock {
                Box::new(MockProvider::new(settings.payment.notify_secret.clone()))
            } else {
                Box::new(ExternalProvider)
            },
            mock: settings
                .payment
                .mock
                .then(|| MockProvider::new(settings.payment.notify_secret.clone())),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
            self_url: format!(
                "http://{}:{}",
                loopback(&settings.app.host),
                settings.app.port
            ),
            kafka_probe,
            liveness: Arc::default(),
            order_streams: Arc::default(),
            settings,
            background: tokio::runtime::Handle::current(),
            clock,
            order_events,
        })
    }

    /// Who watches this process's Kafka clients.
    pub fn supervision(&self) -> Supervision {
        Supervision {
            registry: self.consumers.clone(),
            restarts: self.metrics.consumer_restarts.clone(),
            rebuilds: self.metrics.kafka_client_rebuilds.clone(),
            probe: self.kafka_probe.clone(),
            liveness: self.liveness.clone(),
        }
    }

    /// What reconciliation needs, sharing this state's clients.
    pub fn reconciler(&self) -> Reconciler {
        Reconciler {
            db: self.db.clone(),
            gate: self.gate.clone(),
            notes: self.notes.clone(),
            settings: self.settings.clone(),
            metrics: self.metrics.clone(),
            progress: self.order_progress.clone(),
            producer: self.producer.clone(),
            topics: self.topics.clone(),
            owner: self.lease_owner(),
            clock: self.clock.clone(),
            order_events: self.order_events.clone(),
            coupons: self.coupons.clone(),
            coupon_progress: self.coupon_progress.clone(),
        }
    }

    /// Who this process is when it holds the reconcile lease.
    fn lease_owner(&self) -> String {
        format!(
            "{}:{}",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        )
    }

    /// How long the order consumers have been stalled, once that reaches
    /// `kafka.consumer_stall_secs` (readiness reads it).
    pub fn order_consumers_stalled(&self) -> Option<i64> {
        self.admission.order_consumers_stalled()
    }

    /// What the outbox relay needs, sharing this state's clients.
    pub fn relay(&self) -> Relay {
        Relay {
            db: self.db.clone(),
            producer: self.producer.clone(),
            topics: self.topics.clone(),
            settings: self.settings.workers.clone(),
            metrics: self.metrics.clone(),
        }
    }

    /// What the order consumer needs, sharing this state's clients.
    pub fn consumer_deps(&self) -> ConsumerDeps {
        ConsumerDeps {
            db: self.db.clone(),
            gate: self.gate.clone(),
            producer: self.producer.clone(),
            topics: self.topics.clone(),
            settings: self.settings.clone(),
            metrics: self.metrics.clone(),
            order_events: self.order_events.clone(),
            supervision: self.supervision(),
        }
    }
}

/// The address to call ourselves on: a wildcard bind is reachable on loopback.
pub(crate) fn loopback(host: &str) -> &str {
    match host {
        "0.0.0.0" | "::" | "[::]" => "127.0.0.1",
        other => other,
    }
}

/// Builds the Redis pool with bounded waits, so a dead Redis fails a request
/// quickly instead of hanging it.
pub fn redis_pool(settings: &RedisSettings) -> anyhow::Result<deadpool_redis::Pool> {
    let timeout = Some(Duration::from_millis(settings.timeout_ms));
    let mut config = deadpool_redis::Config::from_url(settings.url.clone());
    let mut pool = PoolConfig::new(settings.pool_size);
    pool.timeouts = Timeouts {
        wait: timeout,
        create: timeout,
        recycle: timeout,
    };
    config.pool = Some(pool);
    config
        .create_pool(Some(Runtime::Tokio1))
        .context("creating the Redis pool")
}

impl ConsumerDeps {
    /// Deps with clients of their own (a worker-only process, or a test that
    /// runs consumers beside an API-only server).
    pub fn connect(settings: Settings) -> anyhow::Result<Self> {
        Ok(AppState::connect(settings)?.consumer_deps())
    }
}
