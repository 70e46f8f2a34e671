//! Degradation: Redis down, rate limits, backpressure, and a consumer
//! process killed with SIGKILL (SPEC "Reconciliation and degradation", I4).

use std::process::Stdio;
use std::time::Duration;

use futures_util::{StreamExt, stream};
use serde_json::json;

use crate::helpers::{KillOnDrop, TestApp, eventually, json, spawn_app, spawn_app_with};

#[tokio::test]
async fn with_redis_down_and_no_fallback_a_purchase_is_503_retry_later() {
    let app = spawn_app_with(|s| {
        s.redis.url = "redis://127.0.0.1:1".into();
        s.admission.fallback_enabled = false;
    })
    .await;
    let res = app
        .order(1, 1, &json!({"request_id": "r", "token": "t"}))
        .await;
    assert_eq!(res.status(), 503);
    assert_eq!(res.headers()["retry-after"], "1", "every 503 says when");
    assert_eq!(json(res).await["code"], "RETRY_LATER");
    let res = app
        .get("/api/v1/activities/1/token", Some(&app.user_token(1)))
        .await;
    assert_eq!(res.status(), 503);
    assert!(res.headers().contains_key("retry-after"));
    let res = app.get("/health/ready", None).await;
    assert_eq!(res.status(), 503);
    assert_eq!(res.headers()["retry-after"], "5");
}

#[tokio::test]
async fn a_client_over_its_rate_gets_429_rate_limited() {
    let app = spawn_app_with(|s| {
        s.admission.ip_rate_per_sec = 1;
        s.admission.ip_burst = 2;
    })
    .await;
    let activity = app.live_activity(10, 5, 1).await;
    // Four purchases sent at once, so that the bucket (2, refilled at 1 a
    // second) cannot refill between them however slow the host: one that
    // waits out the publish budget (5 s) before the next is sent gave the
    // next a whole bucket again.
    let mut bodies = Vec::new();
    for i in 0..4 {
        let token = app.purchase_token(1, activity).await;
        bodies.push(json!({"request_id": format!("r{i}"), "token": token}));
    }
    let answers =
        futures_util::future::join_all(bodies.iter().map(|body| app.order(1, activity, body)))
            .await;
    let mut statuses = Vec::new();
    for res in answers {
        let status = res.status().as_u16();
        if status == 429 {
            // At 1 a second the next token is at most a second away.
            assert_eq!(res.headers()["retry-after"], "1");
            assert_eq!(json(res).await["code"], "RATE_LIMITED");
        }
        statuses.push(status);
    }
    // Two pass the limiter: each is taken (202), or on a slow host told to
    // come back by a later stage (503: the broker had not confirmed its
    // event within the publish budget). The rate limit is the claim, not
    // what comes after it. Sent at once, at least one of the other two is
    // refused, and both unless a second passed between their arrivals.
    let limited = statuses.iter().filter(|s| **s == 429).count();
    assert!((1..=2).contains(&limited), "{statuses:?}");
    assert!(
        statuses.iter().all(|s| [202, 503, 429].contains(s)),
        "{statuses:?}"
    );
}

/// A purchase attempt as seen through one proxy that appended `forwarded`.
/// Its token is no good: an attempt that passes the limits ends 403
/// `INVALID_TOKEN`, one that does not is 429; nothing is reserved.
async fn attempt_via_proxy(app: &TestApp, activity: i64, user: i64, forwarded: String) -> u16 {
    app.client
        .post(format!(
            "{}/api/v1/activities/{activity}/orders",
            app.address
        ))
        .bearer_auth(app.user_token(user))
        .header("x-forwarded-for", forwarded)
        .json(&json!({"request_id": uuid::Uuid::new_v4().to_string(), "token": "none"}))
        .send()
        .await
        .expect("request sent")
        .status()
        .as_u16()
}

/// `n` attempts at once (so no refill comes between them, however slow
/// the machine), the i-th through `forwarded(i)`.
async fn burst_via_proxy(
    app: &TestApp,
    activity: i64,
    n: usize,
    forwarded: impl Fn(usize) -> String,
) -> Vec<u16> {
    futures_util::future::join_all(
        (0..n).map(|i| attempt_via_proxy(app, activity, 1, forwarded(i))),
    )
    .await
}

#[tokio::test]
async fn a_client_cannot_escape_its_ip_limit_by_writing_x_forwarded_for() {
    let app = spawn_app_with(|s| {
        // One proxy, through the older switch (`trusted_proxies = 1`).
        s.admission.trust_forwarded_for = true;
        s.admission.ip_rate_per_sec = 1;
        s.admission.ip_burst = 2;
    })
    .await;
    let activity = app.live_activity(10, 10, 1).await;
    // The client claims a new address each time; the proxy appends the one
    // it really saw.
    let statuses = burst_via_proxy(&app, activity, 6, |i| {
        format!("203.0.113.{i}, 198.51.100.7")
    })
    .await;
    let limited = statuses.iter().filter(|s| **s == 429).count();
    assert!(limited >= 3, "{statuses:?}");
    assert!(
        statuses.iter().all(|s| *s == 429 || *s == 403),
        "{statuses:?}"
    );
}

#[tokio::test]
async fn one_address_flooding_does_not_drain_the_activity_bucket_for_everyone_else() {
    let app = spawn_app_with(|s| {
        s.admission.trusted_proxies = 1;
        s.admission.ip_rate_per_sec = 1;
        s.admission.ip_burst = 1;
        s.admission.activity_rate_per_sec = 1;
        s.admission.activity_burst = 3;
    })
    .await;
    let activity = app.live_activity(10, 10, 1).await;
    let flood = burst_via_proxy(&app, activity, 8, |_| "198.51.100.66".into()).await;
    assert!(
        flood.iter().filter(|s| **s == 429).count() >= 6,
        "{flood:?}"
    );
    // Another buyer behind another address still gets past both limits:
    // 403 for its bad token, a drained activity bucket 429. A 503 is a
    // later stage's answer on a loaded host (the token's or the activity's
    // Redis read over its budget, seen in a fresh run): the attempt had
    // already passed both limits, so the claim holds, and it retries as a
    // client does, after its Retry-After, from a fresh address so that its
    // own bucket does not refuse the retry.
    let mut answers = Vec::new();
    for retry in 0..10 {
        let other =
            attempt_via_proxy(&app, activity, 2, format!("198.51.100.{}", 77 + retry)).await;
        answers.push(other);
        if other != 503 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
    assert_eq!(
        answers.last(),
        Some(&403),
        "flood {flood:?}, then {answers:?}"
    );
}

#[tokio::test]
async fn past_the_in_flight_limit_purchases_get_503_busy_and_keep_nothing() {
    let app = spawn_app_with(|s| s.admission.max_in_flight = 1).await;
    let activity = app.live_activity(100, 1, 1).await;
    let results: Vec<(u16, serde_json::Value)> = stream::iter(1..=60)
        .map(|u| {
            let app = &app;
            async move {
                let request_id = uuid::Uuid::new_v4().to_string();
                let first = app.attempt(u, activity, &request_id).await;
                // On a slow host, 503 RETRY_LATER: the outcome is not known yet
                // (an event unconfirmed, or a Redis call that timed out). The
                // client asks again under the same request_id to learn it (a
                // 200 with its order then is a 202 to the buyer).
                if first.0 == 503 && first.1["code"] == "RETRY_LATER" {
                    app.retry_as(u, activity, &request_id).await
                } else {
                    first
                }
            }
        })
        .buffer_unordered(60)
        .collect()
        .await;
    let accepted = results.iter().filter(|(s, _)| *s == 202).count() as i64;
    let busy = results
        .iter()
        .filter(|(s, b)| *s == 503 && b["code"] == "BUSY")
        .count() as i64;
    assert_eq!(accepted + busy, 60, "{results:?}");
    assert!(busy > 0 && accepted > 0, "accepted {accepted}, busy {busy}");
    let stats = app.drained(activity, accepted).await;
    assert_eq!(
        stats["redis_available"],
        json!(100 - accepted),
        "BUSY reserved nothing"
    );
}

/// The order-consumer lag `/metrics` reports now (-1: no figure yet).
pub(crate) async fn sampled_lag(app: &TestApp) -> i64 {
    let text = app.get("/metrics", None).await.text().await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("seckill_order_consumer_lag "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(-1)
}

/// Polls `/metrics` until the sampled order-consumer lag satisfies `ok`;
/// the figure. A timeout names the last figure sampled (-1: none) and what
/// readiness said of Kafka then.
pub(crate) async fn wait_for_lag(app: &TestApp, what: &str, ok: impl Fn(i64) -> bool) -> i64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let lag = sampled_lag(app).await;
        if ok(lag) {
            return lag;
        }
        if std::time::Instant::now() > deadline {
            let ready = app.get("/health/ready", None).await.text().await.unwrap();
            panic!("not within 120s: a lag {what}; last sampled {lag}; /health/ready: {ready}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn while_the_order_consumers_lag_past_the_limit_purchases_get_503_busy_and_keep_nothing() {
    let app = spawn_app_with(|s| {
        crate::helpers::without_order_consumer(s);
        s.admission.max_consumer_lag = 3;
        s.admission.lag_sample_ms = std::time::Duration::from_millis(100);
    })
    .await;
    let activity = app.live_activity(10, 1, 1).await;
    // Purchases until four are taken or one is refused. A purchase whose
    // delivery was unconfirmed on a slow host is sent again (at least
    // once; the consumer dedupes), so the lag can pass the bound of 3
    // before the fourth: that one is then refused, as it should be.
    let mut taken = 0;
    for user in 1..=4 {
        match buy_unless_busy(&app, user, activity).await {
            Ok(()) => taken += 1,
            Err(busy) => {
                assert!(taken >= 1, "the first purchase refused: {busy}");
                break;
            }
        }
    }
    let before = wait_for_lag(&app, "of 4 or more", |lag| lag >= 4).await;

    let token = app.purchase_token(5, activity).await;
    let res = app
        .order(5, activity, &json!({"request_id": "busy", "token": token}))
        .await;
    assert_eq!(res.status(), 503);
    // The lag is over the bound of 3 by lag - 3, drained at one a second.
    let retry_after: i64 = res.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let after = sampled_lag(&app).await;
    assert!(
        (before - 3..=after - 3).contains(&retry_after),
        "Retry-After {retry_after} for a lag of {before}..{after}"
    );
    let body = json(res).await;
    assert_eq!(body["code"], "BUSY", "{body}");
    let stats = app.stats(activity).await;
    assert_eq!(
        stats["redis_available"],
        10 - taken,
        "BUSY reserved nothing"
    );
    assert_eq!(stats["reservations_open"], taken);

    // The consumers catch up: purchases are taken again.
    let deps = seckill::orders::consumer::ConsumerDeps::connect(app.settings.clone()).unwrap();
    let consumer = seckill::orders::consumer::spawn(deps).unwrap();
    app.drained(activity, taken).await;
    wait_for_lag(&app, "of 0", |lag| lag == 0).await;
    assert_eq!(app.buy(5, activity).await.0, 202);
    app.drained(activity, taken + 1).await;
    consumer.stop().await;
}

#[tokio::test]
async fn a_retry_that_back_pressure_would_refuse_is_answered_with_its_order() {
    // The consumers are away, so the lag only grows: once past the bound,
    // every new purchase is 503 BUSY. A retry of a purchase already taken
    // must still hear its order, not a BUSY without its order_no.
    let app = spawn_app_with(|s| {
        crate::helpers::without_order_consumer(s);
        s.admission.max_consumer_lag = 1;
        s.admission.lag_sample_ms = std::time::Duration::from_millis(100);
    })
    .await;
    let activity = app.live_activity(10, 1, 1).await;
    let (status, first) = app.buy_as(1, activity, "taken-before").await;
    assert_eq!(status, 202, "{first}");
    // A second purchase takes the lag past 1 (or finds it past already: a
    // delivery confirmed late on a slow host is sent twice).
    let _ = buy_unless_busy_over(&app, 2, activity, 1).await;
    wait_for_lag(&app, "of 2 or more", |lag| lag >= 2).await;
    let (status, body) = app.attempt(3, activity, "new-purchase").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("BUSY")),
        "{body}"
    );

    let (status, replay) = app.attempt(1, activity, "taken-before").await;
    assert_eq!(
        status, 200,
        "the retry is answered with its order: {replay}"
    );
    assert_eq!(replay["order_no"], first["order_no"]);
    assert_eq!(replay["status"], "PROCESSING");
}

/// [`buy_unless_busy`] with the lag bound `bound`.
async fn buy_unless_busy_over(
    app: &TestApp,
    user: i64,
    activity: i64,
    bound: i64,
) -> Result<(), String> {
    let request_id = uuid::Uuid::new_v4().to_string();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut taken = false;
    loop {
        let (status, body) = app.attempt(user, activity, &request_id).await;
        taken |= status == 503 && body["code"] == "RETRY_LATER";
        let lag_over = status == 503 && body["code"] == "BUSY" && sampled_lag(app).await > bound;
        match status {
            202 | 200 if body["status"] != "FAILED" => return Ok(()),
            503 if lag_over && taken => return Ok(()),
            503 if lag_over => return Err(format!("user {user}: {body}")),
            503 if std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            _ => panic!("user {user}: {status} {body}"),
        }
    }
}

/// One purchase as [`TestApp::buy`] makes it, except that a 503 BUSY
/// while the sampled lag is past the bound of 3 ends it: `Err` naming the
/// user and the answer, or `Ok` if an earlier answer was RETRY_LATER (the
/// purchase was taken; only its event was unconfirmed). Every other 503
/// is retried under the same request_id, as a client does.
async fn buy_unless_busy(app: &TestApp, user: i64, activity: i64) -> Result<(), String> {
    buy_unless_busy_over(app, user, activity, 3).await
}

/// `seckill consume` as a separate process on this test's namespace.
fn consumer_process(app: &TestApp) -> KillOnDrop {
    KillOnDrop(
        app.seckill_command(&["consume"])
            .env("SECKILL__ORDERS__BATCH_SIZE", "5")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("seckill consume starts"),
    )
}

#[tokio::test]
async fn a_consumer_process_killed_with_sigkill_mid_stream_loses_and_duplicates_nothing() {
    let app = spawn_app_with(|s| {
        crate::helpers::without_order_consumer(s);
        crate::helpers::heal_within_the_drain(s);
    })
    .await;
    let activity = app.live_activity(400, 1, 2).await;
    let results: Vec<(u16, serde_json::Value)> = stream::iter(1..=400)
        .map(|u| app.buy(u, activity))
        .buffer_unordered(50)
        .collect()
        .await;
    assert!(results.iter().all(|(s, _)| *s == 202));

    let mut first = consumer_process(&app);
    app.wait_for_stats(activity, |s| {
        s["orders"]["WAITING_PAY"].as_i64().unwrap() >= 20
    })
    .await;
    first.0.kill().expect("SIGKILL"); // no shutdown path runs: a crash
    first.0.wait().expect("reaped");
    let created = app.stats(activity).await["orders"]["WAITING_PAY"]
        .as_i64()
        .unwrap();
    assert!(created < 400, "killed mid-stream ({created} created)");

    let second = consumer_process(&app);
    let stats = app.drained(activity, 400).await;
    drop(second);
    app.assert_each_order_once(&stats, 400).await;
    assert_eq!(stats["db_available"], 0);
}

#[tokio::test]
async fn metrics_count_admission_outcomes() {
    let app = spawn_app().await;
    let activity = app.live_activity(1, 1, 1).await;
    // One buyer's attempts under one request id until an answer that is
    // not a 503. On a loaded host the first may be a 503: with the
    // order_no, pending (its event not confirmed within the publish
    // budget); without, a dependency slow to answer (a Redis call that
    // timed out may still have reserved). Either way the buyer is counted
    // accepted at most once, and a first 202 exactly once.
    let mut answers = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let (status, body) = app.attempt(1, activity, "counted").await;
        answers.push(format!("{status} {}", body["code"].as_str().unwrap_or("")));
        match status {
            202 => break,
            200 => {
                assert_ne!(body["status"], "FAILED", "{body}");
                break;
            }
            503 if std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            _ => panic!("the first buyer's purchase answered {answers:?}: {body}"),
        }
    }
    assert_eq!(app.buy(2, activity).await.0, 409);
    let text = app.get("/metrics", None).await.text().await.unwrap();
    let count = |outcome: &str| {
        let name = format!("seckill_admission_total{{outcome=\"{outcome}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(name.as_str()))
            .map_or(0, |n| n.parse::<u64>().expect("a count"))
    };
    assert_eq!(count("sold_out"), 1, "{answers:?} {text}");
    if answers.len() == 1 {
        assert_eq!(count("accepted"), 1, "{answers:?} {text}");
    } else {
        assert!(
            count("accepted") <= 1,
            "a replay is not accepted twice: {answers:?} {text}"
        );
        assert!(
            count("accepted") + count("pending") + count("duplicate") >= 1,
            "the buyer's order was counted somewhere: {answers:?} {text}"
        );
    }
    assert!(text.contains("seckill_admission_script_seconds_count"));
}

/// Writers of the server waiting on a lock of `orders`.
async fn writers_waiting(app: &TestApp) -> i64 {
    app.count(
        "SELECT count(*) AS n FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
         WHERE NOT l.granted AND c.relname LIKE 'orders%'",
    )
    .await
}

/// The network drops the server's connections to PostgreSQL without a
/// reset while an order batch is in flight on one (every connection open
/// then goes silent for good, as with a primary that vanished; new ones
/// reach the database, as the promoted primary). The batch gives up the
/// silent connection and is written on a new one, instead of waiting for
/// TCP's ~15 minutes.
#[tokio::test]
async fn a_batch_on_a_connection_the_network_silenced_is_written_on_a_new_one() {
    use diesel::{Connection, RunQueryDsl};
    use secrecy::ExposeSecret;
    let base = seckill::config::Settings::load_env("test").unwrap();
    let proxy = crate::blackhole::Blackhole::start(&crate::blackhole::Blackhole::target_of(
        base.postgres.url.expose_secret(),
    ))
    .await;
    let mut app = spawn_app_with(|s| {
        s.postgres.url = proxy.url(s.postgres.url.expose_secret()).into();
        s.postgres.call_timeout_ms = Duration::from_secs(8);
        s.postgres.statement_timeout_ms = Duration::from_secs(6);
        s.postgres.idle_in_transaction_timeout_ms = Duration::from_secs(5);
        s.postgres.dead_host_ms = Duration::from_secs(6);
    })
    .await;
    app.wait_until_ready().await;
    let activity = app.live_activity(10, 1, 1).await;

    // Mid-batch: the order consumer waits on a lock of `orders` held by a
    // connection of the test's own, straight to PostgreSQL.
    let direct = app.settings.postgres.url.expose_secret().replace(
        &proxy.addr,
        &crate::blackhole::Blackhole::target_of(base.postgres.url.expose_secret()),
    );
    let holder_url = direct.clone();
    let (held, release) = std::sync::mpsc::channel::<()>();
    let (locked_tx, locked_rx) = tokio::sync::oneshot::channel();
    let holder = std::thread::spawn(move || {
        let mut conn = diesel::PgConnection::establish(&holder_url).unwrap();
        conn.transaction::<_, diesel::result::Error, _>(|conn| {
            diesel::sql_query("LOCK TABLE orders IN EXCLUSIVE MODE").execute(conn)?;
            let _ = locked_tx.send(());
            let _ = release.recv();
            Ok(())
        })
        .unwrap();
    });
    locked_rx.await.unwrap();
    let mut bought = Vec::new();
    for user in 1..=5 {
        let (status, body) = app.buy(user, activity).await;
        assert_eq!(status, 202, "{body}");
        bought.push((user, body["order_no"].as_str().unwrap().to_owned()));
    }
    eventually(
        "the batch waits on the lock",
        Duration::from_secs(60),
        || async { (writers_waiting(&app).await > 0).then_some(()) },
    )
    .await;
    proxy.cut();
    let cut_at = std::time::Instant::now();
    held.send(()).unwrap();
    holder.join().unwrap();

    eventually("every order written", Duration::from_secs(120), || async {
        for (user, order_no) in &bought {
            if app.order_status(*user, order_no).await != "WAITING_PAY" {
                return None;
            }
        }
        Some(())
    })
    .await;
    println!(
        "written {:.1}s after the cut",
        cut_at.elapsed().as_secs_f64()
    );
    let stats = app.stats(activity).await;
    assert_eq!(stats["orders"]["WAITING_PAY"], 5, "{stats}");
    assert_eq!(stats["db_locked"], 5, "{stats}");
    // The test's database is dropped straight, not through the proxy
    // (which runs on this test's runtime).
    proxy.close_silenced();
    app.settings.postgres.url = direct.into();
}

/// The database away for 15 s, as during a failover (every connection
/// silent, new ones closed at once): the instance stays ready, 200
/// `"status": "degraded"` naming PostgreSQL, so a load balancer keeps
/// sending it buyers. Each purchase is answered by the instance itself:
/// 202, or 503 `RETRY_LATER` with `Retry-After` once it cannot vouch for
/// the admission modes or its order numbers. Selling resumes once the
/// database is back, and every order taken is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_away_leaves_the_instance_ready_answering_purchases_itself() {
    use secrecy::ExposeSecret;
    let base = seckill::config::Settings::load_env("test").unwrap();
    let target = crate::blackhole::Blackhole::target_of(base.postgres.url.expose_secret());
    let proxy = crate::blackhole::Blackhole::start(&target).await;
    let mut app = spawn_app_with(|s| {
        s.postgres.url = proxy.url(s.postgres.url.expose_secret()).into();
        s.postgres.call_timeout_ms = Duration::from_secs(4);
        s.postgres.statement_timeout_ms = Duration::from_secs(3);
        s.postgres.dead_host_ms = Duration::from_secs(3);
    })
    .await;
    app.wait_until_ready().await;
    let activity = app.live_activity(100, 1, 1).await;
    let (status, body) = app.buy(1, activity).await;
    assert_eq!(status, 202, "{body}");

    proxy.away();
    let away = std::time::Instant::now();
    let mut bought = vec![(1, body["order_no"].as_str().unwrap().to_owned())];
    let mut degraded = None;
    let mut answers = std::collections::BTreeMap::<String, u32>::new();
    let mut user = 2;
    while away.elapsed() < Duration::from_secs(15) {
        let res = app.get("/health/ready", None).await;
        let status = res.status();
        let body = json(res).await;
        assert_eq!(
            status,
            200,
            "unready {:.1}s into the outage: {body}",
            away.elapsed().as_secs_f64()
        );
        if degraded.is_none() && body["checks"]["postgres"] == "down" {
            assert_eq!(body["status"], "degraded", "{body}");
            assert!(
                body["degraded"].to_string().contains("postgres: "),
                "{body}"
            );
            degraded = Some(away.elapsed().as_secs_f64());
        }
        let (status, retry_after, body) = purchase(&app, user, activity).await;
        let code = body["code"].as_str().unwrap_or("").to_owned();
        match (status, code.as_str()) {
            (202, _) => bought.push((user, body["order_no"].as_str().unwrap().to_owned())),
            (503, "RETRY_LATER") => assert!(retry_after.is_some(), "no Retry-After: {body}"),
            _ => panic!(
                "a purchase {:.1}s into the outage: {status} {body}",
                away.elapsed().as_secs_f64()
            ),
        }
        *answers.entry(format!("{status} {code}")).or_default() += 1;
        user += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let degraded = degraded.expect("readiness never saw the database away");
    println!("degraded {degraded:.1}s into the outage; purchases while away: {answers:?}");
    proxy.back();
    eventually("selling again", Duration::from_secs(60), || async {
        let (status, body) = app.buy_once(user, activity).await;
        (status == 202).then(|| body["order_no"].as_str().unwrap().to_owned())
    })
    .await;
    eventually("every order written", Duration::from_secs(120), || async {
        for (user, order_no) in &bought {
            if app.order_status(*user, order_no).await != "WAITING_PAY" {
                return None;
            }
        }
        Some(())
    })
    .await;
    proxy.close_silenced();
    let direct = app
        .settings
        .postgres
        .url
        .expose_secret()
        .replace(&proxy.addr, &target);
    app.settings.postgres.url = direct.into();
}

/// A token, then one purchase: (status, `Retry-After`, body).
async fn purchase(
    app: &TestApp,
    user: i64,
    activity: i64,
) -> (u16, Option<u64>, serde_json::Value) {
    let token = app
        .get(
            &format!("/api/v1/activities/{activity}/token"),
            Some(&app.user_token(user)),
        )
        .await;
    let (status, retry_after) = (token.status().as_u16(), retry_after_of(&token));
    let body = json(token).await;
    if status != 200 {
        return (status, retry_after, body);
    }
    let res = app
        .order(
            user,
            activity,
            &json!({"request_id": format!("away-{user}"), "token": body["token"]}),
        )
        .await;
    let retry_after = retry_after_of(&res);
    (res.status().as_u16(), retry_after, json(res).await)
}

fn retry_after_of(res: &reqwest::Response) -> Option<u64> {
    res.headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok()?.parse().ok())
}
