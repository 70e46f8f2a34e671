//! The shared state of every request handler and worker: each client
//! created once, and what the workers and consumers take from it.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::Context;
use deadpool_redis::{PoolConfig, Runtime, Timeouts};
use tokio::sync::{Notify, Semaphore};

use crate::activities::cache::ActivityCache;
use crate::admission::RedisGate;
use crate::admission::acks::Acks;
use crate::admission::admit::Admitter;
use crate::admission::fallback::Fallback;
use crate::admission::gate::room::RoomGate;
use crate::admission::limits::{KeyedLimiter, Limits};
use crate::admission::publish::{Breaker, Publisher};
use crate::admission::soldout::SoldOut;
use crate::bus::probe::BrokerProbe;
use crate::bus::progress::GroupProgress;
use crate::bus::runner::Supervision;
use crate::bus::watchdog::Registry;
use crate::bus::{self, Producer, Topics};
use crate::clock::{SharedClock, SystemClock};
use crate::config::{GateConnection, KafkaSettings, RedisSettings, Settings};
use crate::coupons::claim::Claims;
use crate::coupons::gate::CouponGate;
use crate::ids::{IdGenerator, InstanceLease, LeasedIds};
use crate::liveness::Liveness;
use crate::metrics::Metrics;
use crate::orders::consumer::ConsumerDeps;
use crate::orders::events::{OrderEvents, StreamCounts};
use crate::outbox::relay::Relay;
use crate::payments::provider::SignedProvider;
use crate::reconcile::Reconciler;
use crate::replica::Replica;
use crate::room::Rooms;
use crate::store::notes::Notes;
use crate::store::redis_conn::{RedisClient, RedisConn};
use crate::store::{self, PgPool};

/// Shared state of every request handler and worker, in parts: the
/// clients of each dependency, the sale built on them, and payments.
pub struct AppState {
    /// The settings this process was started with.
    pub settings: Arc<Settings>,
    /// Redis: the admission gate and the scripts beside it.
    pub redis: RedisClients,
    /// Kafka: the producer, the topics, and what watches the clients.
    pub kafka: KafkaClients,
    /// PostgreSQL: the main pool and the public one.
    pub pg: Databases,
    /// The sale on those clients: admission, claims, order numbers.
    pub sale: Sale,
    /// Where pay intents go, and the mock provider's callbacks.
    pub payments: Payments,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// The sale clock (the system clock, but in tests).
    pub clock: SharedClock,
    /// The runtime the state was made on (the process's main one). Work a
    /// request starts that must finish even if the request is dropped runs
    /// here: the HTTP workers' own runtimes end with them, taking their
    /// tasks along, when a graceful shutdown runs out of time.
    pub background: tokio::runtime::Handle,
    /// Whether this process can still heal itself (`/health/live`).
    pub liveness: Arc<Liveness>,
}

/// The Redis side: the admission gate on its own connection, and the
/// scripts with keys of their own on a shared one.
pub struct RedisClients {
    /// The admission scripts over one multiplexed connection (hot path).
    pub gate: Arc<RedisGate>,
    /// Coupon scripts.
    pub coupons: Arc<CouponGate>,
    /// Leases and notes in Redis (the reconcile lease, its last report).
    pub notes: Notes,
    /// Order status changes: announced after each commit, heard by the
    /// order streams (`orders::events`).
    pub order_events: Arc<OrderEvents>,
    /// The connection the instance lease, the coupons and the order events
    /// share, apart from admission's.
    shared: RedisConn,
}

impl RedisClients {
    /// Creates the clients; nothing connects yet. Inside a Tokio runtime.
    pub fn connect(settings: &Settings) -> anyhow::Result<Self> {
        let redis = &settings.redis;
        let gate_pool = match redis.gate_connection {
            GateConnection::Pool => Some(redis_pool(redis)?),
            GateConnection::Multiplexed => None,
        };
        let gate = RedisGate::new(redis, &settings.admission, gate_pool)
            .context("creating the Redis gate")?;
        let shared = RedisClient::new(redis)
            .and_then(|client| client.connect_lazy())
            .context("creating the Redis connection")?;
        Ok(Self {
            gate: Arc::new(gate),
            coupons: Arc::new(CouponGate::new(shared.clone(), &redis.key_prefix)),
            notes: Notes::new(redis).context("creating the Redis notes")?,
            order_events: Arc::new(OrderEvents::new(shared.clone(), &redis.key_prefix)),
            shared,
        })
    }
}

/// The Kafka side: the producer, the topics, and the watch over them.
pub struct KafkaClients {
    /// The idempotent Kafka producer; cheap to clone.
    pub producer: Producer,
    /// Topic names under this instance's prefix.
    pub topics: Topics,
    /// Whether the topics this service uses exist (readiness waits for it).
    pub topics_created: Arc<AtomicBool>,
    /// Every supervised consumer of this process (readiness reads it).
    pub consumers: Arc<Registry>,
    /// How far the order consumers have got (reconciler, lag sampler).
    pub order_progress: Arc<GroupProgress>,
    /// How far the coupon claimer has got (the restore of a lost batch).
    pub coupon_progress: Arc<GroupProgress>,
    /// Whether the broker answers a fresh client: the judge of every
    /// long-lived Kafka client, and readiness's view of Kafka.
    pub probe: Arc<BrokerProbe>,
}

impl KafkaClients {
    /// Creates the clients and starts the probe; nothing else connects yet.
    pub fn connect(kafka: &KafkaSettings) -> anyhow::Result<Self> {
        let topics = Topics::new(&kafka.topic_prefix);
        let progress = |consumer: &str, topic: &str| {
            GroupProgress::new(kafka, &bus::group_id(kafka, consumer), topic).map(Arc::new)
        };
        let probe = BrokerProbe::new(kafka, &topics.order_requested);
        probe.start();
        Ok(Self {
            producer: Producer::new(kafka)?,
            order_progress: progress(crate::orders::consumer::CONSUMER, &topics.order_requested)?,
            coupon_progress: progress(crate::coupons::consumer::CONSUMER, &topics.coupon_claimed)?,
            topics,
            topics_created: Arc::default(),
            consumers: Arc::default(),
            probe,
        })
    }
}

/// PostgreSQL connections (use through [`store::run`]).
pub struct Databases {
    /// The main pool: writes, and the reads of the order path.
    pub db: PgPool,
    /// The small pool of public reads, apart from `db`.
    pub public: PgPool,
    /// The streaming replica buyers' order reads may go to
    /// (`postgres.replica_url`; none: every read on the primary).
    pub replica: Option<Arc<Replica>>,
}

impl Databases {
    /// The pools; nothing connects yet.
    pub fn connect(settings: &Settings, notes: RedisConn, metrics: &Metrics) -> Self {
        let db = store::pool(&settings.postgres);
        Self {
            replica: Replica::new(
                &settings.postgres,
                db.clone(),
                notes,
                &settings.redis.key_prefix,
                metrics.clone(),
            ),
            public: store::public_pool(&settings.postgres),
            db,
        }
    }
}

/// The sale on the clients: the purchase pipeline and what it shares.
pub struct Sale {
    /// Publishes purchases (SPEC step 2) with three-valued delivery.
    pub publisher: Arc<Publisher>,
    /// Wakes the local reconciler when admission finds an activity Redis
    /// lost, so its restore starts without waiting for the next interval.
    pub restore_wanted: Arc<Notify>,
    /// Warmed activities' windows and limits, cached in process.
    pub activities: Arc<ActivityCache>,
    /// Activities Redis said are sold out, answered from memory.
    pub sold_out: Arc<SoldOut>,
    /// Coupon claims (Redis, then the event), sharing these clients.
    pub claims: Arc<Claims>,
    /// The purchase pipeline (SPEC steps 1–2), sharing these clients.
    pub admission: Admitter,
    /// Snowflake order numbers, made only under a leased instance id.
    pub ids: Arc<dyn IdGenerator>,
    /// The lease behind `ids`; renewed by its worker.
    pub lease: InstanceLease,
    /// Open order event streams per user.
    pub order_streams: Arc<StreamCounts>,
    /// Waiting rooms: queues, passes, the admitter's state.
    pub rooms: Arc<Rooms>,
}

/// What the sale is built from.
struct Parts<'a> {
    settings: &'a Arc<Settings>,
    redis: &'a RedisClients,
    kafka: &'a KafkaClients,
    pg: &'a Databases,
    metrics: &'a Metrics,
    clock: &'a SharedClock,
}

impl Sale {
    fn new(p: Parts<'_>) -> Self {
        let (settings, clock, metrics) = (p.settings, p.clock, p.metrics);
        let a = &settings.admission;
        let leased = Arc::new(LeasedIds::default());
        let lease = InstanceLease::new(
            p.redis.shared.clone(),
            p.pg.db.clone(),
            &settings.redis.key_prefix,
            settings.app.instance_id,
            settings.app.instance_lease_secs,
            leased.clone(),
            metrics.instance_id.clone(),
        );
        let gate = &p.redis.gate;
        let publisher = Arc::new(Publisher {
            producer: p.kafka.producer.clone(),
            topic: p.kafka.topics.order_requested.clone(),
            gate: gate.clone(),
            acks: Acks::start(gate.clone(), a.max_pending_acks, clock.clone()),
            metrics: metrics.clone(),
            budget: a.publish_budget_ms,
            breaker: Breaker::default(),
            clock: clock.clone(),
            probe: p.kafka.probe.clone(),
        });
        let activities = Arc::new(ActivityCache::new(metrics.clone()));
        let sold_out = Arc::new(SoldOut::new(
            a.sold_out_ttl_ms,
            metrics.sold_out_activities.clone(),
            metrics.sold_out_recounts.clone(),
        ));
        let restore_wanted = Arc::new(Notify::new());
        let fallback = Arc::new(Fallback::new(
            settings.clone(),
            p.pg.db.clone(),
            metrics.clone(),
            clock.clone(),
            p.redis.order_events.clone(),
        ));
        let admission = Admitter {
            settings: settings.clone(),
            limits: Limits {
                activity: KeyedLimiter::new(a.activity_rate_per_sec, a.activity_burst),
                ip: KeyedLimiter::new(a.ip_rate_per_sec, a.ip_burst),
            },
            activities: activities.clone(),
            sold_out: sold_out.clone(),
            coupons: p.redis.coupons.clone(),
            in_flight: Arc::new(Semaphore::new(a.max_in_flight.max(1))),
            ids: leased.clone(),
            publisher: publisher.clone(),
            gate: gate.clone(),
            db: p.pg.db.clone(),
            restore_wanted: restore_wanted.clone(),
            metrics: metrics.clone(),
            clock: clock.clone(),
            fallback,
        };
        let claims = Arc::new(Claims {
            gate: p.redis.coupons.clone(),
            db: p.pg.db.clone(),
            producer: p.kafka.producer.clone(),
            topic: p.kafka.topics.coupon_claimed.clone(),
            budget: publisher.budget,
            clock: clock.clone(),
            restore_wanted: restore_wanted.clone(),
        });
        let rooms = Arc::new(Rooms::new(
            RoomGate::new(gate),
            p.pg.db.clone(),
            p.pg.public.clone(),
            &settings.auth.server_secret,
            settings.waiting_room.challenge_ttl_secs,
            metrics.clone(),
        ));
        Self {
            publisher,
            restore_wanted,
            activities,
            sold_out,
            claims,
            admission,
            ids: leased,
            lease,
            order_streams: Arc::default(),
            rooms,
        }
    }
}

/// Payments: the providers pay intents are registered with.
pub struct Payments {
    /// Every configured provider: new payments go to the current one, and
    /// every call about a payment to its own.
    pub providers: Arc<crate::payments::Providers>,
    /// The mock provider, when `payment.provider` is `mock`.
    pub mock: Option<SignedProvider>,
    /// Outgoing HTTP (the mock provider's callbacks).
    pub http: reqwest::Client,
    /// This server's own base URL (the mock provider calls it back).
    pub self_url: String,
}

impl Payments {
    /// The configured provider (the mock one calls `app.host:app.port`).
    pub fn connect(settings: &Settings) -> anyhow::Result<Self> {
        let payment = &settings.payment;
        let is_mock = payment.kind() == crate::config::ProviderKind::Mock;
        let tolerance = crate::clock::millis(payment.signature_tolerance_secs) / 1000;
        Ok(Self {
            providers: Arc::new(crate::payments::Providers::from_settings(settings)?),
            mock: is_mock.then(|| SignedProvider::mock(payment.notify_secret.clone(), tolerance)),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
            self_url: format!(
                "http://{}:{}",
                loopback(&settings.app.host),
                settings.app.port
            ),
        })
    }
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
        let settings = Arc::new(settings);
        let redis = RedisClients::connect(&settings)?;
        let kafka = KafkaClients::connect(&settings.kafka)?;
        let metrics = Metrics::new()?;
        let pg = Databases::connect(&settings, redis.shared.clone(), &metrics);
        let sale = Sale::new(Parts {
            settings: &settings,
            redis: &redis,
            kafka: &kafka,
            pg: &pg,
            metrics: &metrics,
            clock: &clock,
        });
        Ok(Self {
            payments: Payments::connect(&settings)?,
            settings,
            redis,
            kafka,
            pg,
            sale,
            metrics,
            clock,
            background: tokio::runtime::Handle::current(),
            liveness: Arc::default(),
        })
    }

    /// Who watches this process's Kafka clients.
    pub fn supervision(&self) -> Supervision {
        Supervision {
            registry: self.kafka.consumers.clone(),
            restarts: self.metrics.consumer_restarts.clone(),
            rebuilds: self.metrics.kafka_client_rebuilds.clone(),
            probe: self.kafka.probe.clone(),
            liveness: self.liveness.clone(),
        }
    }

    /// What reconciliation needs, sharing this state's clients.
    pub fn reconciler(&self) -> Reconciler {
        Reconciler {
            db: self.pg.db.clone(),
            gate: self.redis.gate.clone(),
            notes: self.redis.notes.clone(),
            settings: self.settings.clone(),
            metrics: self.metrics.clone(),
            progress: self.kafka.order_progress.clone(),
            producer: self.kafka.producer.clone(),
            topics: self.kafka.topics.clone(),
            owner: self.lease_owner(),
            clock: self.clock.clone(),
            order_events: self.redis.order_events.clone(),
            coupons: self.redis.coupons.clone(),
            coupon_progress: self.kafka.coupon_progress.clone(),
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
        self.sale.admission.order_consumers_stalled()
    }

    /// What the outbox relay needs, sharing this state's clients.
    pub fn relay(&self) -> Relay {
        Relay {
            db: self.pg.db.clone(),
            producer: self.kafka.producer.clone(),
            topics: self.kafka.topics.clone(),
            settings: self.settings.workers.clone(),
            metrics: self.metrics.clone(),
        }
    }

    /// What the order consumer needs, sharing this state's clients.
    pub fn consumer_deps(&self) -> ConsumerDeps {
        ConsumerDeps {
            db: self.pg.db.clone(),
            gate: self.redis.gate.clone(),
            coupons: self.redis.coupons.clone(),
            producer: self.kafka.producer.clone(),
            topics: self.kafka.topics.clone(),
            settings: self.settings.clone(),
            metrics: self.metrics.clone(),
            order_events: self.redis.order_events.clone(),
            supervision: self.supervision(),
            rush: (self.settings.orders.rush_in_flight > 0).then(|| crate::bus::batch::Rush {
                in_flight: self.sale.admission.in_flight.clone(),
                max: self.settings.admission.max_in_flight.max(1),
                threshold: self.settings.orders.rush_in_flight,
                wait: self.settings.orders.rush_batch_wait_ms,
            }),
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
    let timeout = Some(settings.timeout_ms);
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
