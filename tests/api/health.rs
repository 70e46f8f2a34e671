use futures_util::StreamExt;

use crate::helpers::{json, spawn_app, spawn_app_with};

#[tokio::test]
async fn ready_is_200_when_redis_kafka_and_postgres_answer() {
    let app = spawn_app().await;
    let res = app.get("/health/ready", None).await;
    assert_eq!(res.status(), 200);
    let body = json(res).await;
    assert_eq!(body["status"], "ready");
    assert_eq!(body["checks"]["redis"], "up");
    assert_eq!(body["checks"]["postgres"], "up");
    assert_eq!(body["checks"]["kafka"], "up");
    assert_eq!(body["admission"], "redis");
    assert_eq!(body["fallback"]["database"], serde_json::json!([]));
}

#[tokio::test]
async fn ready_is_503_naming_redis_when_redis_is_down_while_live_stays_200() {
    // Without the database fallback, which would leave it ready (degraded)
    // once it sells (tests/api/fallback.rs).
    let app = spawn_app_with(|s| {
        s.redis.url = "redis://127.0.0.1:1".into();
        s.admission.fallback_enabled = false;
    })
    .await;
    let res = app.get("/health/ready", None).await;
    assert_eq!(res.status(), 503);
    assert_eq!(
        res.headers()["content-type"].to_str().unwrap(),
        "application/problem+json"
    );
    let body = json(res).await;
    assert_eq!(body["code"], "NOT_READY");
    assert_eq!(body["type"], "urn:seckill:problem:NOT_READY");
    assert_eq!(body["status"], 503);
    assert!(
        body["message"].as_str().unwrap().contains("redis"),
        "{body}"
    );
    assert_eq!(body["checks"]["redis"], "down");
    assert_eq!(body["checks"]["postgres"], "up");
    assert_eq!(body["checks"]["kafka"], "up");
    assert_eq!(app.get("/health/live", None).await.status(), 200);
}

/// A database unreachable from the start: the admission modes were never
/// read, so purchases wait and the instance is not ready; PostgreSQL is
/// named among what is down. (Once the modes were read, a database that
/// goes away leaves the instance ready: `degradation::a_database_away_…`.)
#[tokio::test]
async fn ready_is_503_until_the_admission_modes_are_read_from_postgres() {
    let app = spawn_app_with(|s| {
        s.postgres.url = "postgres://seckill:seckill@127.0.0.1:1/seckill"
            .to_owned()
            .into()
    })
    .await;
    let body = json(app.get("/health/ready", None).await).await;
    assert_eq!(body["code"], "NOT_READY");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("admission modes are not read"),
        "{body}"
    );
    assert_eq!(body["checks"]["postgres"], "down");
    assert!(
        body["degraded"].to_string().contains("postgres: "),
        "{body}"
    );
    assert_eq!(body["checks"]["redis"], "up");
}

#[tokio::test]
async fn ready_is_503_naming_kafka_when_no_broker_answers() {
    let app = spawn_app_with(|s| s.kafka.brokers = "127.0.0.1:1".into()).await;
    let res = app.get("/health/ready", None).await;
    assert_eq!(res.status(), 503);
    let body = json(res).await;
    assert!(
        body["message"].as_str().unwrap().contains("kafka"),
        "{body}"
    );
    assert_eq!(body["checks"]["kafka"], "down");
    assert_eq!(body["checks"]["redis"], "up");
}

#[tokio::test]
async fn readiness_names_the_failing_dependencies_without_host_names_or_driver_errors() {
    let app = spawn_app_with(|s| {
        s.redis.url = "redis://redis-secret-host.invalid:6379".into();
        s.postgres.url = "postgres://seckill:hunter2@pg-secret-host.invalid:5432/seckill"
            .to_owned()
            .into();
        s.kafka.brokers = "kafka-secret-host.invalid:9092".into();
    })
    .await;
    let res = app.get("/health/ready", None).await;
    assert_eq!(res.status(), 503);
    let text = res.text().await.unwrap();
    for name in ["redis", "postgres", "kafka"] {
        assert!(text.contains(&format!("{name}: ")), "{text}");
    }
    for leak in [
        "secret-host",
        "invalid",
        "hunter2",
        "9092",
        "5432",
        "lookup",
        "error",
    ] {
        assert!(!text.contains(leak), "{leak:?} in {text}");
    }
}

#[tokio::test]
async fn public_reads_use_a_small_pool_of_their_own() {
    let app = spawn_app_with(|s| s.postgres.public_pool_size = 2).await;
    let activity = app.live_activity(10, 1, 1).await;
    let path = format!("/api/v1/activities/{activity}");
    let answers: Vec<u16> = futures_util::stream::iter(0..100)
        .map(|_| async { app.get(&path, None).await.status().as_u16() })
        .buffer_unordered(50)
        .collect()
        .await;
    assert!(answers.iter().all(|s| *s == 200), "{answers:?}");
    assert_eq!(app.get("/health/ready", None).await.status(), 200);
    // Every connection they took is the public pool's, and there are at
    // most its two.
    let public = app
        .count(&format!(
            "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() \
             AND application_name = '{}'",
            seckill::store::PUBLIC_READS
        ))
        .await;
    assert!(
        (1..=2).contains(&public),
        "{public} public-read connections"
    );
}

#[tokio::test]
async fn metrics_are_prometheus_text_and_count_requests() {
    let app = spawn_app().await;
    app.get("/health/live", None).await;
    let res = app.get("/metrics", None).await;
    assert_eq!(res.status(), 200);
    let text = res.text().await.unwrap();
    assert!(
        text.lines()
            .any(|l| l.starts_with("seckill_http_requests_total")
                && l.contains("route=\"/health/live\"")
                && l.contains("status=\"200\"")),
        "{text}"
    );
}

/// Made-up method tokens, on routes and off them, add no series: each
/// label value would be kept for the life of the process.
#[tokio::test]
async fn made_up_methods_are_counted_under_one_label() {
    let app = spawn_app().await;
    for i in 0..50 {
        let method = reqwest::Method::from_bytes(format!("BREW{i}").as_bytes()).unwrap();
        for path in ["/health/live", "/no/such/route"] {
            let res = app
                .client
                .request(method.clone(), format!("{}{path}", app.address))
                .send()
                .await
                .unwrap();
            assert!(res.status().is_client_error(), "{method} {path}");
        }
    }
    let text = app.get("/metrics", None).await.text().await.unwrap();
    assert!(!text.contains("method=\"BREW"), "{text}");
    let counted: f64 = text
        .lines()
        .filter(|l| l.starts_with("seckill_http_requests_total{") && l.contains("method=\"other\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(counted, 100.0, "{text}");
}

#[tokio::test]
async fn every_response_carries_a_request_id_echoed_when_given() {
    let app = spawn_app().await;
    let res = app.get("/health/live", None).await;
    let generated = res.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert!(!generated.is_empty());

    let res = app
        .client
        .get(format!("{}/no/such/route", app.address))
        .header("X-Request-Id", "my-req-42")
        .send()
        .await
        .unwrap();
    assert_eq!(res.headers()["x-request-id"], "my-req-42");
}
