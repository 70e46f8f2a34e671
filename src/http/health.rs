//! Liveness, readiness and metrics endpoints.

use std::time::Duration;

use actix_web::{HttpResponse, web};
use deadpool_redis::redis;
use diesel::RunQueryDsl;
use serde_json::json;

use crate::app::AppState;
use crate::http::error::ApiError;

/// How long one dependency may take to answer the readiness probe.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// `GET /health/live`: the process runs and serves HTTP.
pub async fn live() -> HttpResponse {
    HttpResponse::Ok().json(json!({"status": "live"}))
}

/// `GET /health/ready`: 200 when Redis, Kafka and PostgreSQL all answer and
/// the order path moves; 503 naming each check that fails: a dependency
/// down, the service's topics not created yet, or consumers stalled (the
/// watchdog's verdict for this process's consumers, and the order
/// consumers' progress as seen from the broker, wherever they run).
pub async fn ready(state: web::Data<AppState>) -> HttpResponse {
    let (redis, postgres, kafka) = tokio::join!(
        probe(redis_ping(&state)),
        probe(postgres_ping(&state)),
        probe(kafka_ping(&state))
    );
    let checks = [
        ("redis", redis),
        ("postgres", postgres),
        ("kafka", kafka),
        ("consumers", consumers(&state)),
    ];
    let failed: Vec<String> = checks
        .iter()
        .filter_map(|(name, result)| result.as_ref().err().map(|e| format!("{name}: {e}")))
        .collect();
    let detail: serde_json::Map<String, serde_json::Value> = checks
        .iter()
        .map(|(name, result)| {
            let status = if result.is_ok() { "up" } else { "down" };
            (name.to_string(), json!(status))
        })
        .collect();
    if failed.is_empty() {
        HttpResponse::Ok().json(json!({"status": "ready", "checks": detail}))
    } else {
        HttpResponse::ServiceUnavailable().json(json!({
            "code": "NOT_READY",
            "message": format!("not ready: {}", failed.join("; ")),
            "checks": detail,
        }))
    }
}

/// `GET /metrics`: Prometheus text format.
pub async fn metrics(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let body = state.metrics.render().map_err(ApiError::unexpected)?;
    Ok(HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(body))
}

async fn probe(check: impl Future<Output = anyhow::Result<()>>) -> Result<(), String> {
    match tokio::time::timeout(PROBE_TIMEOUT, check).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("{e:#}")),
        Err(_) => Err(format!("no answer within {} ms", PROBE_TIMEOUT.as_millis())),
    }
}

async fn redis_ping(state: &AppState) -> anyhow::Result<()> {
    let mut conn = state.redis.get().await?;
    let pong: String = redis::cmd("PING").query_async(&mut conn).await?;
    anyhow::ensure!(pong == "PONG", "unexpected PING answer {pong:?}");
    Ok(())
}

async fn postgres_ping(state: &AppState) -> anyhow::Result<()> {
    crate::store::run(&state.db, |conn| {
        diesel::sql_query("SELECT 1").execute(conn)?;
        Ok(())
    })
    .await
}

async fn kafka_ping(state: &AppState) -> anyhow::Result<()> {
    state.producer.ping(PROBE_TIMEOUT).await?;
    anyhow::ensure!(
        state
            .topics_created
            .load(std::sync::atomic::Ordering::Relaxed),
        "the service's topics are not created yet"
    );
    Ok(())
}

fn consumers(state: &AppState) -> Result<(), String> {
    let mut stalled: Vec<String> = state
        .consumers
        .stalled()
        .into_iter()
        .map(|(group, why)| format!("{group}: {why}"))
        .collect();
    if let Some(secs) = state.order_consumers_stalled() {
        stalled.push(format!(
            "order consumers: {} messages waiting, nothing committed for {secs}s",
            state.metrics.order_consumer_lag.get()
        ));
    }
    if stalled.is_empty() {
        Ok(())
    } else {
        Err(stalled.join("; "))
    }
}
