//! Application assembly: connects the clients ([`AppState`]), binds the
//! listener first (so tests can ask for port 0 and read the port back),
//! starts the workers, then serves until a signal arrives and stops the
//! workers after the server. The one place that knows both the HTTP edge
//! and the domain.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::Server;
use actix_web::{App, HttpServer, web};
use anyhow::Context;

use crate::admission::ThreadGate;
use crate::bus::{self, progress};
use crate::clock::{SharedClock, SystemClock};
use crate::config::Settings;
use crate::http;
use crate::http::auth::JwtKeys;
use crate::orders::{closer, consumer, releaser};
use crate::outbox::relay;
use crate::reconcile;
use crate::state::{AppState, loopback};
use crate::worker::WorkerHandle;

/// A background worker of the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Worker {
    OrderConsumer,
    Closer,
    PaymentSweeper,
    Relay,
    Reconciler,
    LagSampler,
    SoldOutListener,
    OrderEventsListener,
    Fallback,
    Releaser,
    Claimer,
    ProducerWatch,
    RoomAdmitter,
    ReplicaWatch,
    InstanceLease,
}

impl Worker {
    /// Every worker, in the order they start and stop: the consumers of
    /// work first, each after the batch in hand; the producer's watch and
    /// the instance lease last, since the others publish and number.
    const ALL: [Worker; 15] = [
        Worker::OrderConsumer,
        Worker::Closer,
        Worker::PaymentSweeper,
        Worker::Relay,
        Worker::Reconciler,
        Worker::LagSampler,
        Worker::SoldOutListener,
        Worker::OrderEventsListener,
        Worker::Fallback,
        Worker::Releaser,
        Worker::Claimer,
        Worker::ProducerWatch,
        Worker::RoomAdmitter,
        Worker::ReplicaWatch,
        Worker::InstanceLease,
    ];

    /// Starts this worker if the settings enable it.
    fn start(self, state: &AppState) -> anyhow::Result<Option<WorkerHandle>> {
        let s = &state.settings;
        let w = &s.workers;
        let handle = match self {
            Worker::OrderConsumer => s
                .orders
                .consumer_enabled
                .then(|| consumer::spawn(state.consumer_deps()))
                .transpose()?,
            Worker::Releaser => w
                .releaser_enabled
                .then(|| releaser::spawn(state.consumer_deps()))
                .transpose()?,
            Worker::Claimer => w
                .claimer_enabled
                .then(|| crate::coupons::consumer::spawn(state.consumer_deps()))
                .transpose()?,
            Worker::Closer => w.closer_enabled.then(|| {
                closer::spawn(
                    state.pg.db.clone(),
                    w.closer_interval_ms,
                    w.closer_batch.max(1),
                    state.metrics.clone(),
                    state.redis.order_events.clone(),
                )
            }),
            Worker::PaymentSweeper => s.payment.sweeper_enabled.then(|| {
                crate::payments::sweeper::spawn(crate::payments::sweeper::Sweeper {
                    db: state.pg.db.clone(),
                    providers: state.payments.providers.clone(),
                    settings: s.payment.clone(),
                    metrics: state.metrics.clone(),
                    events: state.redis.order_events.clone(),
                    statement_tried: Default::default(),
                })
            }),
            Worker::Relay => w.relay_enabled.then(|| relay::spawn(state.relay())),
            Worker::Reconciler => s
                .reconcile
                .enabled
                .then(|| reconcile::spawn(state.reconciler(), state.sale.restore_wanted.clone())),
            Worker::LagSampler => (s.admission.max_consumer_lag > 0
                || !s.kafka.consumer_stall_secs.is_zero())
            .then(|| {
                progress::spawn_sampler(
                    state.kafka.order_progress.clone(),
                    s.admission.lag_sample_ms,
                    state.metrics.order_consumer_lag.clone(),
                    state.metrics.order_consumer_stalled_seconds.clone(),
                    state.supervision(),
                    s.kafka.consumer_stall_secs,
                )
            }),
            Worker::SoldOutListener => (!s.admission.sold_out_ttl_ms.is_zero()).then(|| {
                let channel = crate::admission::gate::returned_channel(&s.redis.key_prefix);
                let flags = state.sale.sold_out.clone();
                let seeds = seed_nodes(s);
                WorkerHandle::spawn(move |shutdown| {
                    crate::admission::soldout::listen(seeds, channel, flags, shutdown)
                })
            }),
            Worker::OrderEventsListener => {
                let events = state.redis.order_events.clone();
                let seeds = seed_nodes(s);
                Some(WorkerHandle::spawn(move |shutdown| {
                    crate::orders::events::listen(seeds, events, shutdown)
                }))
            }
            Worker::Fallback => Some(
                state
                    .sale
                    .admission
                    .fallback
                    .spawn(state.redis.gate.clone(), state.kafka.order_progress.clone()),
            ),
            Worker::ProducerWatch => Some(state.kafka.producer.supervise(state.supervision())),
            Worker::RoomAdmitter => s.waiting_room.admitter_enabled.then(|| {
                let pace = if s.waiting_room.adaptive {
                    crate::room::admitter::Pace {
                        lag: state.metrics.order_consumer_lag.clone(),
                        bound: s.admission.max_consumer_lag,
                        breaker: Some(state.sale.publisher.clone()),
                        progress: Some(state.kafka.order_progress.clone()),
                        fresh: s.waiting_room.fresh_pass_ms,
                    }
                } else {
                    crate::room::admitter::Pace::fixed()
                };
                crate::room::admitter::spawn(
                    state.sale.rooms.clone(),
                    state.redis.gate.clone(),
                    state.clock.clone(),
                    s.waiting_room.admit_interval_ms,
                    pace,
                )
            }),
            Worker::ReplicaWatch => state.pg.replica.clone().map(|r| r.watch()),
            Worker::InstanceLease => Some(state.sale.lease.clone().spawn()),
        };
        Ok(handle)
    }
}

/// The Redis nodes a pub/sub listener starts from.
fn seed_nodes(s: &Settings) -> Vec<String> {
    crate::store::redis_conn::seed_nodes(&s.redis.url)
        .into_iter()
        .map(str::to_owned)
        .collect()
}

/// The background workers of one process, in [`Worker::ALL`]'s order.
#[derive(Default)]
pub struct Workers {
    running: Vec<(Worker, WorkerHandle)>,
}

impl Workers {
    /// Starts the workers the settings enable.
    pub fn start(state: &AppState) -> anyhow::Result<Self> {
        let mut running = Vec::with_capacity(Worker::ALL.len());
        for worker in Worker::ALL {
            if let Some(handle) = worker.start(state)? {
                running.push((worker, handle));
            }
        }
        Ok(Self { running })
    }

    /// Stops every worker, one after another in the order they started,
    /// each after the batch in hand.
    pub async fn stop(self) {
        for (worker, handle) in self.running {
            tracing::debug!(?worker, "stopping");
            handle.stop().await;
        }
    }
}

/// A bound, not yet running, HTTP server and its workers.
pub struct Application {
    port: u16,
    state: web::Data<AppState>,
    server: Server,
    workers: Workers,
    deadline: Duration,
}

impl Application {
    /// Connects clients, creates the topics, starts the consumer (unless
    /// `orders.consumer_enabled = false`) and binds `app.host:app.port`.
    pub async fn build(settings: Settings) -> anyhow::Result<Self> {
        Self::build_with_clock(settings, Arc::new(SystemClock)).await
    }

    /// [`Application::build`] on the given sale clock (tests move it).
    pub async fn build_with_clock(settings: Settings, clock: SharedClock) -> anyhow::Result<Self> {
        let address = format!("{}:{}", settings.app.host, settings.app.port);
        let listener = TcpListener::bind(&address).with_context(|| format!("binding {address}"))?;
        let port = listener.local_addr()?.port();
        // Connections get two thirds of the shutdown deadline to finish,
        // the workers the rest; at the deadline the process exits anyway
        // (`run_until_stopped`).
        let deadline = settings.app.shutdown_timeout_secs;
        // actix counts whole seconds: at least one.
        let shutdown = (deadline * 2 / 3).as_secs().max(1);
        let keys = web::Data::new(JwtKeys::from_settings(&settings.auth)?);
        let mut state = AppState::connect_with_clock(settings, clock)?;
        if let Some(provider) = keys.provider() {
            state
                .metrics
                .registry
                .register(Box::new(provider.fetch_counter()))
                .context("registering the JWKS fetch counter")?;
        }
        state.payments.self_url = format!("http://{}:{port}", loopback(&state.settings.app.host));
        let state = web::Data::new(state);

        // A broker that is down must not stop the server from starting
        // (readiness reports it); the topics are created once it is back.
        bus::ensure_topics_or_retry(
            &state.settings.kafka,
            &state.kafka.topics,
            state.kafka.topics_created.clone(),
        )
        .await;
        // Order numbers need a leased instance id: a configured one that a
        // running instance holds stops the start here.
        if let Some(instance) = state.sale.lease.acquire_at_start().await? {
            tracing::info!(instance, "instance id leased");
        }
        let workers = Workers::start(&state)?;

        let served = state.clone();
        let server = HttpServer::new(move || {
            // Shared, not cloned per request: a Metrics is a few dozen handles.
            let metrics = std::sync::Arc::new(state.metrics.clone());
            // Runs on each worker's thread: the worker's own Redis connection.
            let gate = state.redis.gate.on_own_connection().unwrap_or_else(|e| {
                tracing::warn!(error = %e, "worker Redis connection; sharing the main one");
                (*state.redis.gate).clone()
            });
            App::new()
                .app_data(web::Data::new(ThreadGate(gate)))
                .app_data(state.clone())
                .app_data(keys.clone())
                .app_data(web::Data::new(http::routes::OpenApiJson(
                    http::openapi::json(),
                )))
                .configure(http::extractor_configs)
                .configure(http::routes::configure)
                .default_service(web::to(http::routes::not_found))
                .wrap(http::error_handlers())
                .wrap_fn(move |req, srv| http::observe(req, srv, metrics.clone()))
        })
        .shutdown_timeout(shutdown)
        .listen(listener)?
        .run();
        Ok(Self {
            port,
            state: served,
            server,
            workers,
            deadline,
        })
    }

    /// Stops the server (tests: a graceful shutdown that may run out of
    /// time).
    pub fn server_handle(&self) -> actix_web::dev::ServerHandle {
        self.server.handle()
    }

    /// Samples the order path every 10 ms into `path` ([`crate::timeline`]).
    pub fn sample_timeline(&self, path: &std::path::Path) -> anyhow::Result<()> {
        let state = &self.state;
        let sources = crate::timeline::Sources {
            metrics: state.metrics.clone(),
            in_flight: state.sale.admission.in_flight.clone(),
            max_in_flight: state.settings.admission.max_in_flight.max(1),
            acks: state.sale.publisher.acks.clone(),
            producer: state.sale.publisher.producer.clone(),
            db: state.pg.db.clone(),
        };
        crate::timeline::start(sources, path)
    }

    /// The port actually bound (useful with port 0).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Serves until SIGINT / SIGTERM, drains in-flight requests, then lets
    /// each worker finish its batch. `app.shutdown_timeout_secs` after the
    /// signal the process exits, whatever a worker is stuck on (a Kafka
    /// client closing against a coordinator that never answers).
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        let deadline = self.deadline;
        let armed = tokio::spawn(async move {
            shutdown_signal().await;
            exit_at(deadline);
        });
        let result = self.server.await;
        self.workers.stop().await;
        armed.abort();
        result
    }
}

/// Ends the process `deadline` from now, with an ERROR and exit status 1,
/// unless it has ended by then.
pub fn exit_at(deadline: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(deadline);
        tracing::error!(
            deadline_secs = deadline.as_secs(),
            "shutdown did not finish within app.shutdown_timeout_secs; exiting now"
        );
        std::process::exit(1);
    });
}

/// SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
