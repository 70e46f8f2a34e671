//! Application assembly: connects the pools, binds the listener first (so
//! tests can ask for port 0 and read the port back), then serves until a
//! signal arrives.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::Server;
use actix_web::{App, HttpServer, web};
use anyhow::Context;
use deadpool_redis::{PoolConfig, Runtime, Timeouts};
use rdkafka::producer::FutureProducer;

use crate::config::{RedisSettings, Settings};
use crate::http;
use crate::http::auth::JwtKeys;
use crate::metrics::Metrics;
use crate::store::{self, PgPool};

/// Shared state of every request handler and worker.
pub struct AppState {
    /// The settings this process was started with.
    pub settings: Arc<Settings>,
    /// Redis connections: admission gate, reservations, tokens.
    pub redis: deadpool_redis::Pool,
    /// PostgreSQL connections (use through [`store::run`]).
    pub db: PgPool,
    /// The idempotent Kafka producer; cheap to clone.
    pub producer: FutureProducer,
    /// Prometheus metrics.
    pub metrics: Metrics,
}

impl AppState {
    /// Creates every client. Nothing connects yet: a dependency that is down
    /// shows up in `/health/ready`, it does not stop the process.
    pub fn connect(settings: Settings) -> anyhow::Result<Self> {
        Ok(Self {
            redis: redis_pool(&settings.redis)?,
            db: store::pool(&settings.postgres),
            producer: crate::bus::producer(&settings.kafka)?,
            metrics: Metrics::new()?,
            settings: Arc::new(settings),
        })
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

/// A bound, not yet running, HTTP server.
pub struct Application {
    port: u16,
    server: Server,
}

impl Application {
    /// Connects clients and binds `app.host:app.port`.
    pub async fn build(settings: Settings) -> anyhow::Result<Self> {
        let address = format!("{}:{}", settings.app.host, settings.app.port);
        let listener = TcpListener::bind(&address).with_context(|| format!("binding {address}"))?;
        let port = listener.local_addr()?.port();
        let shutdown = settings.app.shutdown_timeout_secs;
        let keys = web::Data::new(JwtKeys::new(&settings.auth.jwt_secret)?);
        let state = web::Data::new(AppState::connect(settings)?);

        let server = HttpServer::new(move || {
            let metrics = state.metrics.clone();
            App::new()
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
        Ok(Self { port, server })
    }

    /// The port actually bound (useful with port 0).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Serves until SIGINT / SIGTERM, then drains in-flight requests.
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        self.server.await
    }
}
