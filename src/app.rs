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

/// The background workers of one process.
#[derive(Default)]
pub struct Workers {
    lease: Option<WorkerHandle>,
    producer_watch: Option<WorkerHandle>,
    consumer: Option<WorkerHandle>,
    releaser: Option<WorkerHandle>,
    claimer: Option<WorkerHandle>,
    closer: Option<WorkerHandle>,
    relay: Option<WorkerHandle>,
    reconciler: Option<WorkerHandle>,
    lag_sampler: Option<WorkerHandle>,
    sold_out_listener: Option<WorkerHandle>,
    order_events_listener: Option<WorkerHandle>,
    fallback: Option<WorkerHandle>,
}

impl Workers {
    /// Starts the workers the settings enable.
    pub fn start(state: &AppState) -> anyhow::Result<Self> {
        let s = &state.settings;
        let w = &s.workers;
        Ok(Self {
            lease: None,
            producer_watch: Some(state.producer.supervise(state.supervision())),
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
                    state.order_events.clone(),
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
                        state.supervision(),
                        Duration::from_secs(s.kafka.consumer_stall_secs),
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
            fallback: Some(
                state
                    .admission
                    .fallback
                    .spawn(state.gate.clone(), state.order_progress.clone()),
            ),
            order_events_listener: Some({
                let seeds: Vec<String> = crate::store::redis_conn::seed_nodes(&s.redis.url)
                    .into_iter()
                    .map(str::to_owned)
                    .collect();
                let events = state.order_events.clone();
                WorkerHandle::spawn(move |shutdown| {
                    crate::orders::events::listen(seeds, events, shutdown)
                })
            }),
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
            self.order_events_listener,
            self.fallback,
            self.releaser,
            self.claimer,
            self.producer_watch,
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
        let shutdown = (settings.app.shutdown_timeout_secs * 2 / 3).max(1);
        let deadline = Duration::from_secs(settings.app.shutdown_timeout_secs);
        let keys = web::Data::new(JwtKeys::from_settings(&settings.auth)?);
        let mut state = AppState::connect_with_clock(settings, clock)?;
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
                .app_data(web::Data::new(ThreadGate(gate)))
                .app_data(state.clone())
                .app_data(keys.clone())
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
