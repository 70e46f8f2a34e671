//! Application assembly: connects the clients, binds the listener first (so
//! tests can ask for port 0 and read the port back), starts the workers, then
//! serves until a signal arrives and stops the workers after the server.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::Server;
use actix_web::{App, HttpServer, web};
use anyhow::Context;
use deadpool_redis::{PoolConfig, Runtime, Timeouts};
use tokio::sync::{Notify, Semaphore};

use crate::activities::cache::ActivityCache;
use crate::admission::acks::Acks;
use crate::admission::limits::{KeyedLimiter, Limits};
use crate::admission::soldout::SoldOut;
use crate::admission::{RedisGate, WorkerGate};
use crate::bus::progress::{self, GroupProgress};
use crate::bus::runner::Supervision;
use crate::bus::watchdog::Registry;
use crate::bus::{self, Producer, Topics};
use crate::config::{RedisSettings, Settings};
use crate::coupons::gate::CouponGate;
use crate::http;
use crate::http::auth::JwtKeys;
use crate::ids::{IdGenerator, InstanceLease, LeasedIds};
use crate::metrics::Metrics;
use crate::orders::closer;
use crate::orders::consumer::{self, ConsumerDeps};
use crate::orders::publish::{Breaker, Publisher};
use crate::orders::releaser;
use crate::outbox::relay::{self, Relay};
use crate::payments::provider::{ExternalProvider, MockProvider, PaymentProvider};
use crate::reconcile::{self, Reconciler};
use crate::store::{self, PgPool};
use crate::worker::WorkerHandle;

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
    pub activities: ActivityCache,
    /// Activities Redis said are sold out, answered from memory.
    pub sold_out: Arc<SoldOut>,
    /// Coupon scripts (same multiplexed connection as the gate).
    pub coupons: Arc<CouponGate>,
    /// In-process token buckets (per activity, per client IP).
    pub limits: Limits,
    /// Purchases awaiting their delivery report; empty → 503 BUSY.
    pub in_flight: Arc<Semaphore>,
    /// Snowflake order numbers, made only under a leased instance id.
    pub ids: Arc<dyn IdGenerator>,
    /// The lease behind `ids`; taken by [`Application::build`].
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
}

impl AppState {
    /// Creates every client. Nothing connects yet: a dependency that is down
    /// shows up in `/health/ready`, it does not stop the process. Must be
    /// called inside a Tokio runtime.
    pub fn connect(settings: Settings) -> anyhow::Result<Self> {
        let a = &settings.admission;
        let gate_pool = match settings.redis.gate_connection.as_str() {
            "pool" => Some(redis_pool(&settings.redis)?),
            _ => None,
        };
        let gate = Arc::new(
            RedisGate::new(&settings.redis, a, gate_pool).context("creating the Redis gate")?,
        );
        let topics = Topics::new(&settings.kafka.topic_prefix);
        let producer = Producer::new(&settings.kafka)?;
        let metrics = Metrics::new()?;
        let leased = Arc::new(LeasedIds::default());
        let lease = InstanceLease::new(
            gate.conn(),
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
            acks: Acks::start(gate.clone(), a.max_pending_acks),
            metrics: metrics.clone(),
            budget: Duration::from_millis(a.publish_budget_ms.max(1)),
            breaker: Breaker::default(),
        });
        Ok(Self {
            coupons: Arc::new(CouponGate::new(gate.conn(), &settings.redis.key_prefix)),
            publisher,
            restore_wanted: Arc::new(Notify::new()),
            consumers: Arc::new(Registry::default()),
            topics_created: Arc::default(),
            gate,
            activities: ActivityCache::default(),
            sold_out: Arc::new(SoldOut::new(
                Duration::from_millis(a.sold_out_ttl_ms),
                metrics.sold_out_activities.clone(),
            )),
            limits: Limits {
                activity: KeyedLimiter::new(a.activity_rate_per_sec, a.activity_burst),
                ip: KeyedLimiter::new(a.ip_rate_per_sec, a.ip_burst),
            },
            in_flight: Arc::new(Semaphore::new(a.max_in_flight.max(1))),
            ids: leased,
            lease,
            db: store::pool(&settings.postgres),
            public_db: store::public_pool(&settings.postgres),
            producer,
            metrics,
            order_progress: Arc::new(GroupProgress::new(
                &settings.kafka,
                &bus::group_id(&settings.kafka, crate::orders::consumer::CONSUMER),
                &topics.order_requested,
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
            settings: Arc::new(settings),
            background: tokio::runtime::Handle::current(),
        })
    }

    /// What reconciliation needs, sharing this state's clients.
    pub fn reconciler(&self) -> Reconciler {
        Reconciler {
            db: self.db.clone(),
            gate: self.gate.clone(),
            settings: self.settings.clone(),
            metrics: self.metrics.clone(),
            progress: self.order_progress.clone(),
            producer: self.producer.clone(),
            topics: self.topics.clone(),
            owner: self.lease_owner(),
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

    /// Why purchases should get 503 BUSY because of the order consumers
    /// (SPEC step 2), if they should: too many messages behind, or stalled
    /// (messages waiting, nothing committed) for `kafka.consumer_stall_secs`.
    /// Both are sampled every second by the lag sampler.
    pub fn consumer_backpressure(&self) -> Option<&'static str> {
        let lag = self.metrics.order_consumer_lag.get();
        if progress::lag_over(lag, self.settings.admission.max_consumer_lag) {
            return Some("orders are being written; retry shortly");
        }
        if self.order_consumers_stalled().is_some() {
            return Some("the order consumers are stalled; retry shortly");
        }
        None
    }

    /// How long the order consumers (wherever they run) have had messages
    /// waiting and committed nothing, once that reaches
    /// `kafka.consumer_stall_secs`.
    pub fn order_consumers_stalled(&self) -> Option<i64> {
        let stall = i64::try_from(self.settings.kafka.consumer_stall_secs).unwrap_or(i64::MAX);
        let stalled = self.metrics.order_consumer_stalled_seconds.get();
        (stall > 0 && stalled >= stall).then_some(stalled)
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
            supervision: Supervision {
                registry: self.consumers.clone(),
                restarts: self.metrics.consumer_restarts.clone(),
            },
        }
    }
}

/// The address to call ourselves on: a wildcard bind is reachable on loopback.
fn loopback(host: &str) -> &str {
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

/// The background workers of one process.
#[derive(Default)]
pub struct Workers {
    lease: Option<WorkerHandle>,
    consumer: Option<WorkerHandle>,
    releaser: Option<WorkerHandle>,
    claimer: Option<WorkerHandle>,
    closer: Option<WorkerHandle>,
    relay: Option<WorkerHandle>,
    reconciler: Option<WorkerHandle>,
    lag_sampler: Option<WorkerHandle>,
    sold_out_listener: Option<WorkerHandle>,
}

impl Workers {
    /// Starts the workers the settings enable.
    pub fn start(state: &AppState) -> anyhow::Result<Self> {
        let s = &state.settings;
        let w = &s.workers;
        Ok(Self {
            lease: None,
            consumer: s
                .orders
                .consumer_enabled
                .then(|| consumer::spawn(state.consumer_deps()))
                .transpose()?,
            releaser: w
                .releaser_enabled
                .then(|| releaser::spawn(state.consumer_deps()))
                .transpose()?,
            claimer: w
                .claimer_enabled
                .then(|| crate::coupons::consumer::spawn(state.consumer_deps()))
                .transpose()?,
            closer: w.closer_enabled.then(|| {
                closer::spawn(
                    state.db.clone(),
                    Duration::from_millis(w.closer_interval_ms),
                    w.closer_batch.max(1),
                    state.metrics.clone(),
                )
            }),
            relay: w.relay_enabled.then(|| relay::spawn(state.relay())),
            reconciler: s
                .reconcile
                .enabled
                .then(|| reconcile::spawn(state.reconciler(), state.restore_wanted.clone())),
            lag_sampler: (s.admission.max_consumer_lag > 0 || s.kafka.consumer_stall_secs > 0)
                .then(|| {
                    progress::spawn_sampler(
                        state.order_progress.clone(),
                        Duration::from_millis(s.admission.lag_sample_ms.max(50)),
                        state.metrics.order_consumer_lag.clone(),
                        state.metrics.order_consumer_stalled_seconds.clone(),
                    )
                }),
            sold_out_listener: (s.admission.sold_out_ttl_ms > 0)
                .then(|| {
                    let seeds: Vec<String> = crate::store::redis_conn::seed_nodes(&s.redis.url)
                        .into_iter()
                        .map(str::to_owned)
                        .collect();
                    let channel = crate::admission::soldout::channel(&s.redis.key_prefix);
                    let flags = state.sold_out.clone();
                    anyhow::Ok(WorkerHandle::spawn(move |shutdown| {
                        crate::admission::soldout::listen(seeds, channel, flags, shutdown)
                    }))
                })
                .transpose()?,
        })
    }

    /// Stops every worker, one after another in this order, each after the
    /// batch in hand.
    pub async fn stop(self) {
        let workers = [
            self.consumer,
            self.closer,
            self.relay,
            self.reconciler,
            self.lag_sampler,
            self.sold_out_listener,
            self.releaser,
            self.claimer,
            self.lease,
        ];
        for worker in workers.into_iter().flatten() {
            worker.stop().await;
        }
    }
}

/// A bound, not yet running, HTTP server and its workers.
pub struct Application {
    port: u16,
    server: Server,
    workers: Workers,
}

impl Application {
    /// Connects clients, creates the topics, starts the consumer (unless
    /// `orders.consumer_enabled = false`) and binds `app.host:app.port`.
    pub async fn build(settings: Settings) -> anyhow::Result<Self> {
        let address = format!("{}:{}", settings.app.host, settings.app.port);
        let listener = TcpListener::bind(&address).with_context(|| format!("binding {address}"))?;
        let port = listener.local_addr()?.port();
        let shutdown = settings.app.shutdown_timeout_secs;
        let keys = web::Data::new(JwtKeys::new(&settings.auth.jwt_secret)?);
        let mut state = AppState::connect(settings)?;
        state.self_url = format!("http://{}:{port}", loopback(&state.settings.app.host));
        let state = web::Data::new(state);

        // A broker that is down must not stop the server from starting
        // (readiness reports it); the topics are created once it is back.
        bus::ensure_topics_or_retry(
            &state.settings.kafka,
            &state.topics,
            state.topics_created.clone(),
        )
        .await;
        // Order numbers need a leased instance id: a configured one that a
        // running instance holds stops the start here.
        if let Some(instance) = state.lease.acquire_at_start().await? {
            tracing::info!(instance, "instance id leased");
        }
        let mut workers = Workers::start(&state)?;
        workers.lease = Some(state.lease.clone().spawn());

        let server = HttpServer::new(move || {
            // Shared, not cloned per request: a Metrics is a few dozen handles.
            let metrics = std::sync::Arc::new(state.metrics.clone());
            // Runs on each worker's thread: the worker's own Redis connection.
            let gate = state.gate.on_own_connection().unwrap_or_else(|e| {
                tracing::warn!(error = %e, "worker Redis connection; sharing the main one");
                (*state.gate).clone()
            });
            App::new()
                .app_data(web::Data::new(WorkerGate(gate)))
                .app_data(state.clone())
                .app_data(keys.clone())
                .configure(http::extractor_configs)
                .configure(http::routes)
                .default_service(web::to(http::not_found))
                .wrap(http::error_handlers())
                .wrap_fn(move |req, srv| http::observe(req, srv, metrics.clone()))
        })
        .shutdown_timeout(shutdown)
        .listen(listener)?
        .run();
        Ok(Self {
            port,
            server,
            workers,
        })
    }

    /// Stops the server (tests: a graceful shutdown that may run out of
    /// time).
    pub fn server_handle(&self) -> actix_web::dev::ServerHandle {
        self.server.handle()
    }

    /// The port actually bound (useful with port 0).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Serves until SIGINT / SIGTERM, drains in-flight requests, then lets
    /// each worker finish its batch.
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        let result = self.server.await;
        self.workers.stop().await;
        result
    }
}
