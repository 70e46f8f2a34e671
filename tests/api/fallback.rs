//! The database fallback (docs/FALLBACK.md) on a server whose Redis never
//! answers (a closed port), against the real PostgreSQL and Kafka: the
//! contract of a purchase written by the database, and readiness and
//! metrics showing the mode. The way in mid-sale and the way back to Redis
//! are the fault tests' (`tests/chaos`: Redis killed, Redis paused).

use std::time::Duration;

use serde_json::{Value, json};

use crate::helpers::{OPEN, TestApp, eventually, json, spawn_app_with};

/// The server, and an activity of `stock` units (limit 1) it would have
/// warmed before Redis went away (the warm-up itself needs Redis).
async fn without_redis(stock: i32, rate: u32) -> (TestApp, i64) {
    let app = spawn_app_with(|s| {
        s.redis.url = "redis://127.0.0.1:1".into();
        s.admission.fallback_after_ms = std::time::Duration::from_millis(200);
        s.admission.fallback_rate_per_sec = rate;
    })
    .await;
    let activity = app.create_activity(stock, 1, 1, OPEN).await;
    app.execute(&format!(
        "UPDATE activities SET warmed_at = now(), status = 'READY' WHERE id = {activity}"
    ))
    .await;
    fallback_takes_purchases(&app).await;
    (app, activity)
}

/// Waits until `app` sends purchases to the database: Redis down past
/// fallback_after_ms, then the order events sent before the outage
/// provably written (the publish window, then the consumers at the end of
/// their topic).
async fn fallback_takes_purchases(app: &TestApp) {
    eventually(
        "the fallback takes purchases",
        Duration::from_secs(120),
        || async {
            let body = json(app.get("/health/ready", None).await).await;
            (body["admission"] == "database").then_some(())
        },
    )
    .await;
}

/// The purchase token `user` is given for `activity` (a signed one while
/// the fallback sells).
async fn signed_token(app: &TestApp, activity: i64, user: i64) -> String {
    let res = app
        .get(
            &format!("/api/v1/activities/{activity}/token"),
            Some(&app.user_token(user)),
        )
        .await;
    json(res).await["token"].as_str().unwrap().to_owned()
}

/// A signed token, then the purchase; a 429 is retried after its
/// `Retry-After`: (status, admission header, body).
async fn buy(app: &TestApp, user: i64, activity: i64, request_id: &str) -> (u16, String, Value) {
    loop {
        let res = app
            .get(
                &format!("/api/v1/activities/{activity}/token"),
                Some(&app.user_token(user)),
            )
            .await;
        assert_eq!(res.status(), 200, "a token without Redis");
        let token = json(res).await["token"].as_str().unwrap().to_owned();
        assert!(token.starts_with("fb."), "a signed token: {token}");
        let res = app
            .order(
                user,
                activity,
                &json!({"request_id": request_id, "token": token}),
            )
            .await;
        let status = res.status().as_u16();
        if status == 429 || status == 503 {
            let secs: u64 = res.headers()["retry-after"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            if status == 503 {
                // Only the move's hold is waited out (the fallback sells
                // once its move is modes_trusted_for_ms old).
                let body = json(res).await;
                let detail = body["detail"].as_str().unwrap_or_default();
                if !detail.contains("moving to the database") {
                    return (status, String::new(), body);
                }
            }
            tokio::time::sleep(Duration::from_secs(secs)).await;
            continue;
        }
        let header = res
            .headers()
            .get("x-seckill-admission")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        return (status, header, json(res).await);
    }
}

/// Issue #59, defect 4: an instance PostgreSQL does not answer (a
/// failover) sells from Redis on the modes it read last for
/// `admission.modes_trusted_for_ms`. So the fallback's first purchase
/// only moves the sale, and it sells once the move is that old.
#[tokio::test]
async fn the_fallback_sells_only_once_its_move_is_as_old_as_the_modes_are_trusted() {
    let (app, activity) = without_redis(5, 1000).await;
    let hold = app.settings.admission.modes_trusted_for_ms;
    let token = signed_token(&app, activity, 1).await;
    let res = app
        .order(1, activity, &json!({"request_id": "first", "token": token}))
        .await;
    let moved = std::time::Instant::now();
    assert_eq!(res.status(), 503);
    let retry_after: u64 = res.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(
        retry_after,
        hold.as_secs().max(1),
        "told to come back once the move is old enough"
    );
    let body = json(res).await;
    assert_eq!(body["code"], "RETRY_LATER", "{body}");
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) AS n FROM activities WHERE id = {activity} AND admission = 'DATABASE'"
        ))
        .await,
        1,
        "the move is committed"
    );
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) AS n FROM orders WHERE activity_id = {activity}"
        ))
        .await,
        0,
        "nothing sold with the move"
    );
    let (status, _, body) = buy(&app, 1, activity, "first").await;
    assert_eq!(status, 202, "{body}");
    assert!(
        moved.elapsed() + Duration::from_millis(200) >= hold,
        "sold {:?} after the move",
        moved.elapsed()
    );
}

#[tokio::test]
async fn with_redis_down_the_database_sells_each_unit_once_within_the_limit() {
    let (app, activity) = without_redis(2, 1000).await;

    let res = app.get("/health/ready", None).await;
    assert_eq!(res.status(), 200, "ready: the fallback sells");
    let body = json(res).await;
    assert_eq!(body["status"], "degraded");
    assert_eq!(body["checks"]["redis"], "down");

    let (status, header, first) = buy(&app, 1, activity, "r1").await;
    assert_eq!(status, 202, "{first}");
    assert_eq!(header, "database");
    assert_eq!(first["status"], "WAITING_PAY");
    let order_no = first["order_no"].as_str().unwrap().to_owned();
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) AS n FROM orders WHERE order_no = {order_no} \
             AND status = 'WAITING_PAY' AND user_id = 1 AND request_id = 'r1' \
             AND (order_no >> 12) & 1023 = 1023"
        ))
        .await,
        1,
        "the order row, under the database's instance id"
    );
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) AS n FROM stock_flow WHERE biz_type = 'LOCK' AND biz_no = {order_no}"
        ))
        .await,
        1,
        "its LOCK flow row"
    );
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) AS n FROM activities WHERE id = {activity} AND admission = 'DATABASE'"
        ))
        .await,
        1,
        "the activity is in the fallback"
    );

    // The same request again: the same order, nothing new.
    let (status, _, again) = buy(&app, 1, activity, "r1").await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["order_no"], order_no.as_str());
    // Another request of the same buyer: over the limit of 1.
    let (status, _, over) = buy(&app, 1, activity, "r2").await;
    assert_eq!(status, 409, "{over}");
    assert_eq!(over["code"], "LIMIT_EXCEEDED");
    // The second unit, then none.
    let (status, _, second) = buy(&app, 2, activity, "r1").await;
    assert_eq!(status, 202, "{second}");
    let (status, _, none) = buy(&app, 3, activity, "r1").await;
    assert_eq!(status, 409, "{none}");
    assert_eq!(none["code"], "SOLD_OUT");

    // A token Redis would have issued is not one the database can check.
    let res = app
        .order(
            4,
            activity,
            &json!({"request_id": "r1", "token": "0123abcd"}),
        )
        .await;
    assert_eq!(res.status(), 403);
    assert_eq!(json(res).await["code"], "INVALID_TOKEN");

    // I1 / I7: two units locked by the two orders, nothing else.
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) AS n FROM stock WHERE activity_id = {activity} \
             AND available = 0 AND locked = 2 AND sold = 0 AND total = 2"
        ))
        .await,
        1
    );
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) AS n FROM orders WHERE activity_id = {activity}"
        ))
        .await,
        2,
        "no order twice"
    );

    let metrics = app
        .get("/metrics", None)
        .await
        .text()
        .await
        .unwrap_or_default();
    assert!(metrics.contains("seckill_redis_up 0"), "{metrics}");
    assert!(
        metrics.contains("seckill_admission_total{outcome=\"accepted_fallback\"} 2"),
        "{metrics}"
    );
    eventually("the mode gauge", Duration::from_secs(30), || async {
        let metrics = app.get("/metrics", None).await.text().await.ok()?;
        metrics
            .contains("seckill_admission_fallback_activities{mode=\"database\"} 1")
            .then_some(())
    })
    .await;
    let body = json(app.get("/health/ready", None).await).await;
    assert_eq!(body["fallback"]["database"], json!([activity]));
}

#[tokio::test]
async fn the_fallback_is_rate_limited_per_activity_with_a_retry_after() {
    let (app, activity) = without_redis(100, 1).await;

    // A first purchase moves the sale and waits out the move's hold; the
    // bucket then fills again.
    assert_eq!(buy(&app, 99, activity, "mover").await.0, 202);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut tokens = Vec::new();
    for user in 1..=20 {
        tokens.push((user, signed_token(&app, activity, user).await));
    }
    // Twenty purchases at once against one a second: however slow the
    // host, most of them find the bucket empty.
    let answers = futures_util::future::join_all(tokens.into_iter().map(|(user, token)| {
        let app = &app;
        async move {
            let res = app
                .order(user, activity, &json!({"request_id": "r", "token": token}))
                .await;
            let status = res.status().as_u16();
            let retry_after = res
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_owned());
            (status, retry_after, json(res).await)
        }
    }))
    .await;
    let limited: Vec<&(u16, Option<String>, Value)> =
        answers.iter().filter(|(s, _, _)| *s == 429).collect();
    let accepted = answers.iter().filter(|(s, _, _)| *s == 202).count();
    assert!(accepted >= 1, "{answers:?}");
    assert!(limited.len() >= 10, "{answers:?}");
    for (_, retry_after, body) in limited {
        assert_eq!(body["code"], "RATE_LIMITED");
        assert_eq!(retry_after.as_deref(), Some("1"));
    }
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) AS n FROM orders WHERE activity_id = {activity}"
        ))
        .await,
        i64::try_from(accepted).unwrap() + 1,
        "a 429 writes nothing (beside the mover's order)"
    );
}

/// A TCP proxy in front of a real service (Redis, PostgreSQL) that the test
/// switches off (every connection closed, new ones refused) and on again:
/// the service going away and coming back for one server only.
struct Switch {
    /// Where the proxy listens (`host:port`).
    addr: String,
    on: tokio::sync::watch::Sender<bool>,
}

impl Switch {
    /// A proxy to `upstream` (`host:port`).
    async fn start(upstream: &str) -> Self {
        let upstream = upstream.to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (on, watch) = tokio::sync::watch::channel(true);
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let mut watch = watch.clone();
                if !*watch.borrow() {
                    continue; // dropped: refused
                }
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = watch.wait_for(|on| !*on) => {}
                    }
                });
            }
        });
        Self { addr, on }
    }

    fn set(&self, on: bool) {
        self.on.send_replace(on);
    }
}

/// A server whose Redis is behind a [`Switch`], its settings changed by
/// `tweak`; `None` on a Redis Cluster (one server fits behind the
/// proxy, not a cluster's seeds).
async fn behind_a_switch(
    tweak: impl FnOnce(&mut seckill::config::Settings),
) -> Option<(Switch, TestApp)> {
    let real = seckill::config::Settings::load_env("test")
        .unwrap()
        .redis
        .url;
    if real.contains(',') {
        return None;
    }
    let redis = Switch::start(real.trim_start_matches("redis://").trim_end_matches('/')).await;
    let app = spawn_app_with(|s| {
        s.redis.url = format!("redis://{}", redis.addr);
        tweak(s);
    })
    .await;
    app.wait_until_ready().await;
    Some((redis, app))
}

/// Waits until `app`'s probes see Redis answering (`up`) or not.
async fn sees_redis(app: &TestApp, up: bool) {
    let want = Some(i64::from(up));
    eventually(
        if up {
            "this server sees Redis back"
        } else {
            "this server sees Redis down"
        },
        Duration::from_secs(60),
        || async { (app.metric("seckill_redis_up").await == want).then_some(()) },
    )
    .await;
}

/// Runs `sql` in a transaction of its own connection and holds it open
/// (its locks with it) until the sender is used; returns once it holds.
async fn held_open(
    app: &TestApp,
    sql: String,
) -> (std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>) {
    use diesel::{Connection, PgConnection, RunQueryDsl};
    use secrecy::ExposeSecret;

    let url = app.settings.postgres.url.expose_secret().to_owned();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let (locked, holding) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        let mut conn = PgConnection::establish(&url).unwrap();
        conn.transaction::<_, diesel::result::Error, _>(|c| {
            diesel::sql_query(sql).execute(c)?;
            locked.send(()).unwrap();
            let _ = released.recv();
            Ok(())
        })
        .unwrap();
    });
    tokio::task::spawn_blocking(move || holding.recv().unwrap())
        .await
        .unwrap();
    (release, holder)
}

/// Defect 1 of issue #25: a fallback purchase that waited for the stock
/// row's lock while Redis came back must not take the sale over. Its
/// "may the database take over?" is asked again under the lock: the
/// purchase is told to retry, nothing is written, the activity stays on
/// Redis.
#[tokio::test]
async fn a_fallback_purchase_that_waited_for_the_lock_while_redis_came_back_does_not_take_the_sale_over()
 {
    let Some((redis, app)) =
        behind_a_switch(|s| s.admission.fallback_after_ms = Duration::from_millis(200)).await
    else {
        return;
    };
    let activity = app.live_activity(10, 1, 1).await;
    redis.set(false);
    fallback_takes_purchases(&app).await;
    let res = app
        .get(
            &format!("/api/v1/activities/{activity}/token"),
            Some(&app.user_token(1)),
        )
        .await;
    let token = json(res).await["token"].as_str().unwrap().to_owned();

    // The test holds the stock row's lock, so the purchase queues behind it.
    let (release, holder) = held_open(
        &app,
        format!("SELECT activity_id FROM stock WHERE activity_id = {activity} FOR UPDATE"),
    )
    .await;
    let body = json!({"request_id": "queued", "token": token});
    let purchase = app.order(1, activity, &body);
    let meanwhile = async {
        eventually(
            "the purchase waits for the lock",
            Duration::from_secs(60),
            || async {
                (app.count(
                    "SELECT count(*) AS n FROM pg_stat_activity \
                     WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .await
                    > 0)
                .then_some(())
            },
        )
        .await;
        redis.set(true);
        sees_redis(&app, true).await;
        release.send(()).unwrap();
    };
    let (res, ()) = tokio::join!(purchase, meanwhile);
    holder.join().unwrap();
    let status = res.status().as_u16();
    let body = json(res).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("RETRY_LATER")),
        "{body}"
    );
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) AS n FROM activities WHERE id = {activity} AND admission = 'REDIS'"
        ))
        .await,
        1,
        "the activity stays on Redis"
    );
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) AS n FROM orders WHERE activity_id = {activity}"
        ))
        .await,
        0,
        "nothing written by the database"
    );
}

/// A blip (Redis refused for a moment, far shorter than
/// `fallback_after_ms`) moved no activity to the database, so once Redis
/// answers again a purchase goes to Redis at once, without waiting for the
/// next read of the admission modes. Here that read is held (the test
/// locks the activities table), so a guard armed by the blip would answer
/// 503 "Redis is back" for as long: a probe past its timeout on a starved
/// host made such a blip, and purchases, a malformed one included, got 503
/// until the read came back.
#[tokio::test]
async fn after_a_blip_shorter_than_the_fallback_delay_purchases_go_to_redis_at_once() {
    // The fallback waits far longer than the blip takes, even on a slow
    // host. The modes are trusted for longer than the test holds their read
    // (the lock below spans the wait for Redis and the purchases): a read
    // held past that trust is a 503 of its own, not the answer under test.
    let Some((redis, app)) = behind_a_switch(|s| {
        s.admission.fallback_after_ms = Duration::from_secs(60);
        s.admission.modes_trusted_for_ms = Duration::from_secs(300);
    })
    .await
    else {
        return;
    };
    let activity = app.live_activity(10, 2, 1).await;
    assert_eq!(app.buy(1, activity).await.0, 202);

    redis.set(false);
    sees_redis(&app, false).await;
    // The admission modes' next read waits behind the test's lock.
    let (release, holder) = held_open(
        &app,
        "LOCK TABLE activities IN ACCESS EXCLUSIVE MODE".into(),
    )
    .await;
    redis.set(true);
    sees_redis(&app, true).await;
    // The blip broke the server's Redis connections, and a purchase that
    // meets one is answered 503 "a backing service is unavailable" (and
    // connects again): sent again on that answer only. The guard's 503
    // ("Redis is back") is the answer under test, not a moment to wait out.
    let purchase = |user: i64, quantity: u32| {
        let app = &app;
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            loop {
                let token = app.purchase_token(user, activity).await;
                let body =
                    json!({"request_id": format!("r{user}"), "token": token, "quantity": quantity});
                let res = app.order(user, activity, &body).await;
                let answer = (res.status().as_u16(), json(res).await);
                let broken = answer.0 == 503
                    && answer.1["detail"]
                        .as_str()
                        .is_some_and(|d| d.contains("backing service is unavailable"));
                if !broken || std::time::Instant::now() > deadline {
                    return answer;
                }
            }
        }
    };
    let bought = purchase(2, 1).await;
    let too_many = purchase(3, 3).await;
    release.send(()).unwrap();
    tokio::task::spawn_blocking(move || holder.join().unwrap())
        .await
        .unwrap();
    assert_eq!(bought.0, 202, "{}", bought.1);
    assert_eq!(
        (too_many.0, too_many.1["code"].as_str()),
        (400, Some("BAD_REQUEST")),
        "{}",
        too_many.1
    );
}

/// Defect 5 of issue #25: with Redis down no instance id is leased, and a
/// payment's number used to come only from that lease, so every fallback
/// order closed unpaid once the outage outlasted its pay window. The
/// database makes the number then, and the order is paid.
#[tokio::test]
async fn an_order_sold_through_the_database_is_paid_while_redis_is_still_down() {
    let (app, activity) = without_redis(2, 1000).await;
    let (status, header, order) = buy(&app, 1, activity, "r1").await;
    assert_eq!((status, header.as_str()), (202, "database"), "{order}");
    let order_no = order["order_no"].as_str().unwrap().to_owned();

    let res = app.pay(1, &order_no).await;
    assert_eq!(res.status(), 200, "a payment without Redis");
    let intent = json(res).await;
    let payment_no = intent["payment_no"].as_str().unwrap().to_owned();
    assert_eq!(
        seckill::ids::instance_of(payment_no.parse().unwrap()),
        seckill::ids::DATABASE_INSTANCE,
        "numbered by the database: {intent}"
    );
    let res = app
        .post_json(
            &format!("/api/v1/dev/payments/{payment_no}/simulate"),
            &json!({"status": "SUCCESS", "times": 2}),
            Some(&app.user_token(1)),
        )
        .await;
    assert_eq!(res.status(), 200);
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) AS n FROM orders WHERE order_no = {order_no} AND status = 'PAID'"
        ))
        .await,
        1,
        "paid once"
    );
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) AS n FROM stock WHERE activity_id = {activity} AND sold = 1 AND locked = 0"
        ))
        .await,
        1,
        "its unit sold"
    );
}

/// Defect 2 of issue #25, second half: an instance whose polls of the
/// admission modes fail went on selling from Redis with the modes it read
/// last. Another instance, which Redis did not answer, may have moved the
/// activity to the database meanwhile; this instance saw no outage, so its
/// "Redis is back" guard never armed. Past a few seconds without a read,
/// purchases wait.
/// A server whose PostgreSQL is behind a [`Switch`], set up by `tune`;
/// the test's own statements go straight to PostgreSQL.
async fn behind_a_postgres_switch(
    tune: impl FnOnce(&mut seckill::config::Settings),
) -> (Switch, TestApp) {
    use secrecy::ExposeSecret;

    let real = seckill::config::Settings::load_env("test")
        .unwrap()
        .postgres
        .url
        .expose_secret()
        .to_owned();
    // postgres://user:password@host:port/database
    let host_port = real
        .rsplit_once('@')
        .and_then(|(_, rest)| rest.split('/').next())
        .expect("postgres.url has host:port")
        .to_owned();
    let postgres = Switch::start(&host_port).await;
    let direct = std::sync::Mutex::new(String::new());
    let app = spawn_app_with(|s| {
        let url = s.postgres.url.expose_secret().to_owned();
        *direct.lock().unwrap() = url.clone();
        s.postgres.url = url.replace(&host_port, &postgres.addr).into();
        tune(s);
    })
    .await;
    let direct = direct.into_inner().unwrap();
    // The test's own statements, and dropping its database at the end, go
    // straight to PostgreSQL (the proxy runs on this test's runtime).
    let mut app = app;
    app.settings.postgres.url = direct.into();
    app.wait_until_ready().await;
    (postgres, app)
}

/// Issue #59, defect 4: through a PostgreSQL failover an instance kept
/// selling for 5 s (the modes it read last), and its order numbers for one
/// lease lifetime; the failover took 17 s. Now it sells on the modes for
/// `admission.modes_trusted_for_ms`, and on its instance id while Redis
/// renews the lease and the fence in PostgreSQL (four lifetimes) lasts.
/// Here the database is away for three lease lifetimes, and a purchase
/// then is still accepted, under the same instance id.
#[tokio::test]
async fn an_instance_sells_from_redis_through_a_database_failover() {
    let (postgres, app) = behind_a_postgres_switch(|s| {
        s.app.instance_lease_secs = Duration::from_secs(2);
        s.admission.modes_trusted_for_ms = Duration::from_secs(10);
    })
    .await;
    let activity = app.live_activity(10, 1, 1).await;
    let (status, body) = app.buy(1, activity).await;
    assert_eq!(status, 202, "{body}");
    let instance = app.metric("seckill_instance_id").await;

    postgres.set(false);
    let away = std::time::Instant::now();
    tokio::time::sleep(Duration::from_secs(6)).await;
    // One attempt (token and purchase), no retry of a 503.
    let (status, body) = app.attempt(2, activity, "through-the-failover").await;
    assert_eq!(
        status,
        202,
        "refused {:?} into the database's absence: {body}",
        away.elapsed()
    );
    assert_eq!(app.metric("seckill_instance_id").await, instance);
    let ready = app.get("/health/ready", None).await;
    assert_eq!(ready.status(), 200, "ready through the failover");
    postgres.set(true);
    app.drained(activity, 2).await;
}

#[tokio::test]
async fn an_instance_that_cannot_read_the_admission_modes_stops_selling_from_redis() {
    let (postgres, app) =
        behind_a_postgres_switch(|s| s.admission.modes_trusted_for_ms = Duration::from_secs(4))
            .await;
    let activity = app.live_activity(10, 1, 1).await;
    let (status, body) = app.buy(1, activity).await;
    assert_eq!(status, 202, "{body}");

    // The database goes away for this instance only; another instance
    // (here: the test, on a connection of its own) moves the sale to the
    // database fallback.
    let token = app.purchase_token(2, activity).await;
    postgres.set(false);
    let blind = std::time::Instant::now();
    // Blind, but within modes_trusted_for_ms: it sells from Redis, as
    // through a failover (a fallback elsewhere sells only after that long).
    let (status, body) = app.buy(3, activity).await;
    assert!(
        blind.elapsed() < std::time::Duration::from_secs(3),
        "the purchase took {:?}",
        blind.elapsed()
    );
    assert_eq!(
        status, 202,
        "refused while the modes read last are trusted: {body}"
    );
    app.execute(&format!(
        "UPDATE activities SET admission = 'DATABASE' WHERE id = {activity}"
    ))
    .await;
    tokio::time::sleep(std::time::Duration::from_secs(7)).await;
    let res = app
        .order(
            2,
            activity,
            &serde_json::json!({"request_id": "while-blind", "token": token}),
        )
        .await;
    let status = res.status().as_u16();
    let body = json(res).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("RETRY_LATER")),
        "sold from Redis on modes read before the database went away: {body}"
    );
    drop(postgres);
}
