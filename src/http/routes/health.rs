//! Liveness, readiness and metrics endpoints.

use std::time::Duration;

use actix_web::{HttpResponse, web};
use serde::Serialize;
use serde_json::json;
use utoipa::ToSchema;

use crate::domain::ActivityId;
use crate::http::error::{ApiError, ErrorCode, Problem, problem_with};
use crate::state::AppState;

/// How long one dependency may take to answer the readiness probe.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// `GET /health/live`: the process runs, serves HTTP and can still heal
/// itself. 503 once a part of it gave up (a Kafka client rebuilt again and
/// again without progress): the process exits a moment later, to be
/// restarted by its supervisor.
#[utoipa::path(get, path = "/health/live", tag = "health",
    responses(
        (status = 200, description = "the process runs", body = Live),
        (status = 503, description = "NOT_READY: the process gave up healing itself and is exiting", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn live(state: web::Data<AppState>) -> HttpResponse {
    match state.liveness.gave_up() {
        None => HttpResponse::Ok().json(Live { status: "live" }),
        Some(why) => problem_with(
            ErrorCode::NotReady,
            &format!("not live: {why}; exiting to be restarted"),
            None,
            serde_json::Map::new(),
        ),
    }
}

/// `GET /health/ready`: 200 while this instance can take purchases: Redis
/// answers (or this instance sells through the database fallback), Kafka
/// takes writes (a fresh client's view), the producer delivers, the
/// service's topics exist and the admission modes were read once. 503
/// naming each of those that fails.
/// PostgreSQL and the order consumers are reported, never a reason to be
/// unready: purchases need neither, and a database failover or a stalled
/// worker group would otherwise take every instance out of its load
/// balancer at once. A route that needs what is missing answers 503
/// RETRY_LATER with `Retry-After` itself; the answer is then 200
/// `"status": "degraded"` with `degraded` naming each.
/// `admission` says where purchases go: `redis`, or `database` while this
/// instance sells through the fallback. `fallback` lists the activities in
/// the database fallback and those being loaded back into Redis.
#[utoipa::path(get, path = "/health/ready", tag = "health",
    responses(
        (status = 200, description = "purchases can be taken (`degraded` names what else is down: PostgreSQL, the order consumers, Redis while selling through the database)", body = Ready),
        (status = 503, description = "NOT_READY, naming the failing checks; `checks` has each one's state", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn ready(state: web::Data<AppState>) -> HttpResponse {
    let (redis, postgres, kafka) = tokio::join!(
        probe("redis", redis_ping(&state)),
        probe("postgres", postgres_ping(&state)),
        probe("kafka", kafka_ping(&state))
    );
    let checks = [
        ("redis", redis),
        ("postgres", postgres),
        ("kafka", kafka),
        ("consumers", consumers(&state)),
    ];
    let (selling_from_db, database, restoring) = state.sale.admission.fallback.status();
    // What purchases need: Redis (unless the database sells), Kafka, and
    // the admission modes read once since start.
    let needed = |name: &str| match name {
        "redis" => !selling_from_db,
        "kafka" => true,
        _ => false,
    };
    let mut failed: Vec<String> = Vec::new();
    let mut degraded: Vec<String> = Vec::new();
    for (name, result) in &checks {
        if let Err(e) = result {
            let line = format!("{name}: {e}");
            if needed(name) {
                failed.push(line);
            } else {
                degraded.push(line);
            }
        }
    }
    if state.sale.admission.fallback.modes_unread() {
        failed.push("admission: the admission modes are not read yet".to_owned());
    }
    let state_of = |i: usize| if checks[i].1.is_ok() { "up" } else { "down" };
    let detail = Checks {
        redis: state_of(0),
        postgres: state_of(1),
        kafka: state_of(2),
        consumers: state_of(3),
    };
    let admission = if selling_from_db { "database" } else { "redis" };
    let fallback = FallbackState {
        database,
        restoring,
    };
    // A replica down or behind is not "not ready": reads go to the primary.
    let replica = state.pg.replica.as_ref().map(|r| r.status());
    if failed.is_empty() {
        let status = if degraded.is_empty() {
            "ready"
        } else {
            "degraded"
        };
        HttpResponse::Ok().json(Ready {
            status,
            checks: detail,
            degraded,
            admission,
            fallback,
            replica,
        })
    } else {
        let mut extra = serde_json::Map::new();
        extra.insert("checks".into(), json!(detail));
        extra.insert("degraded".into(), json!(degraded));
        extra.insert("admission".into(), admission.into());
        extra.insert("fallback".into(), json!(fallback));
        if let Some(replica) = replica {
            extra.insert("replica".into(), json!(replica));
        }
        // A dependency that went away is retried by the pool about every
        // few seconds; asking sooner finds the same answer.
        problem_with(
            ErrorCode::NotReady,
            &format!("not ready: {}", failed.join("; ")),
            Some(5),
            extra,
        )
    }
}

/// `GET /health/live`'s answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct Live {
    /// Always live.
    status: &'static str,
}

/// `GET /health/ready`'s answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct Ready {
    /// ready, or degraded (something purchases do not need is down:
    /// PostgreSQL, the order consumers, or Redis while this instance sells
    /// through the database).
    status: &'static str,
    checks: Checks,
    /// What is down without making the instance unready, one line each.
    degraded: Vec<String>,
    /// Where this instance sends purchases: redis or database.
    admission: &'static str,
    fallback: FallbackState,
    /// The streaming replica, when `postgres.replica_url` is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    replica: Option<crate::replica::ReplicaStatus>,
}

/// Each dependency's check: up or down.
#[derive(Debug, Serialize, ToSchema)]
pub struct Checks {
    redis: &'static str,
    postgres: &'static str,
    kafka: &'static str,
    consumers: &'static str,
}

/// The activities in the database fallback, and those being loaded back
/// into Redis.
#[derive(Debug, Serialize, ToSchema)]
pub struct FallbackState {
    #[schema(value_type = Vec<i64>)]
    database: Vec<ActivityId>,
    #[schema(value_type = Vec<i64>)]
    restoring: Vec<ActivityId>,
}

/// `GET /metrics`: Prometheus text format.
#[utoipa::path(get, path = "/metrics", tag = "health",
    responses(
        (status = 200, description = "Prometheus text format"),
    ))]
pub async fn metrics(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let body = state.metrics.render().map_err(ApiError::unexpected)?;
    Ok(HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(body))
}

/// Why a dependency is not ready: what the answer says (no host names, no
/// driver errors: the probe is public), and the whole error for the log.
struct Unready {
    public: &'static str,
    detail: anyhow::Error,
}

impl Unready {
    fn because(public: &'static str) -> impl FnOnce(anyhow::Error) -> Self {
        move |detail| Self { public, detail }
    }
}

/// Runs one dependency's check within the probe timeout. A failure is
/// logged in full and answered in general words.
async fn probe(name: &str, check: impl Future<Output = Result<(), Unready>>) -> Result<(), String> {
    match tokio::time::timeout(PROBE_TIMEOUT, check).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => {
            tracing::warn!(
                dependency = name,
                error = format!("{:#}", e.detail),
                "readiness check failed"
            );
            Err(e.public.to_owned())
        }
        Err(_) => Err(format!("no answer within {} ms", PROBE_TIMEOUT.as_millis())),
    }
}

async fn redis_ping(state: &AppState) -> Result<(), Unready> {
    let pong: String = async {
        // Through the gate's connection: a cluster answers from every master.
        anyhow::Ok(state.redis.gate.ping().await?)
    }
    .await
    .map_err(Unready::because("unreachable"))?;
    if pong != "PONG" {
        return Err(Unready::because("unexpected answer")(anyhow::anyhow!(
            "PING answered {pong:?}"
        )));
    }
    Ok(())
}

async fn postgres_ping(state: &AppState) -> Result<(), Unready> {
    crate::store::ping(&state.pg.public)
        .await
        .map_err(Unready::because("unreachable"))
}

/// Kafka as a fresh client sees it ([`crate::bus::probe`]): never through
/// the producer, which may be the very client that wedged.
async fn kafka_ping(state: &AppState) -> Result<(), Unready> {
    if !state.kafka.probe.answers() {
        return Err(Unready::because("no broker answers")(anyhow::anyhow!(
            "the broker has not answered a fresh client for {}s",
            state.kafka.probe.answering_for().as_secs()
        )));
    }
    if let Some(why) = state.kafka.probe.refuses_writes() {
        return Err(Unready::because(
            "the brokers refuse writes: too few in-sync replicas",
        )(anyhow::anyhow!(why)));
    }
    let stall = state.settings.kafka.consumer_stall_secs;
    if !stall.is_zero() && state.kafka.producer.stalled_for() >= stall {
        return Err(Unready::because(
            "the producer delivers nothing while the broker answers",
        )(anyhow::anyhow!(
            "no delivery for {}s",
            state.kafka.producer.stalled_for().as_secs()
        )));
    }
    if !state
        .kafka
        .topics_created
        .load(std::sync::atomic::Ordering::Relaxed)
    {
        return Err(
            Unready::because("the service's topics are not created yet")(anyhow::anyhow!(
                "topics not created"
            )),
        );
    }
    Ok(())
}

fn consumers(state: &AppState) -> Result<(), String> {
    let mut stalled: Vec<String> = state
        .kafka
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
