//! `GET /api/v1/orders/{order_no}/events`: an order's status pushed as it
//! changes, from the service's own commits (fanned out through Redis, so
//! a change made by another process reaches this one's streams).

use std::time::Duration;

use serde_json::json;

use crate::helpers::{TestApp, eventually, json, spawn_app, spawn_app_with};

/// An open event stream, read event by event.
pub(crate) struct Stream {
    res: reqwest::Response,
    buffer: String,
}

impl Stream {
    async fn open(app: &TestApp, user_id: i64, order_no: &str) -> reqwest::Response {
        app.client
            .get(format!("{}/api/v1/orders/{order_no}/events", app.address))
            .bearer_auth(app.user_token(user_id))
            .send()
            .await
            .unwrap()
    }

    pub(crate) async fn of(app: &TestApp, user_id: i64, order_no: &str) -> Self {
        let res = Self::open(app, user_id, order_no).await;
        assert_eq!(res.status(), 200);
        assert_eq!(res.headers()["content-type"], "text/event-stream");
        Self {
            res,
            buffer: String::new(),
        }
    }

    /// The next event as (name, data); `None` when the stream ended.
    /// Keep-alive comments are skipped.
    async fn next(&mut self) -> Option<(String, serde_json::Value)> {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                let (mut name, mut data) = (String::new(), String::new());
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("event: ") {
                        name = v.to_owned();
                    } else if let Some(v) = line.strip_prefix("data: ") {
                        data.push_str(v);
                    }
                }
                if name.is_empty() {
                    continue; // a comment
                }
                return Some((name, serde_json::from_str(&data).unwrap()));
            }
            let chunk = self.res.chunk().await.unwrap()?;
            self.buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    }

    /// The next status event's status, within a minute.
    pub(crate) async fn status(&mut self) -> String {
        let (name, data) = tokio::time::timeout(Duration::from_secs(60), self.next())
            .await
            .expect("an event within a minute")
            .expect("the stream goes on");
        assert_eq!(name, "status", "{data}");
        data["status"].as_str().unwrap().to_owned()
    }

    /// The stream ends (within a minute).
    async fn ends(&mut self) {
        let next = tokio::time::timeout(Duration::from_secs(60), self.next())
            .await
            .expect("the end within a minute");
        assert!(next.is_none(), "no more events: {next:?}");
    }
}

/// Creates the pending payment of `order_no` and has the mock provider
/// deliver its signed success callback.
async fn pay_through_the_mock(app: &TestApp, user_id: i64, order_no: &str) {
    let res = app.pay(user_id, order_no).await;
    assert_eq!(res.status(), 200);
    let payment_no = json(res).await["payment_no"].as_str().unwrap().to_owned();
    let res = app
        .post_json(
            &format!("/api/v1/dev/payments/{payment_no}/simulate"),
            &json!({}),
            Some(&app.user_token(user_id)),
        )
        .await;
    assert_eq!(res.status(), 200);
    assert_eq!(json(res).await["responses"][0], 200);
}

#[tokio::test]
async fn a_stream_opened_before_the_order_is_made_sees_processing_waiting_pay_then_paid() {
    // No consumer in the server: the order stays PROCESSING until one runs,
    // in a process of its own (clients of its own: its news reaches this
    // server through Redis).
    let app = spawn_app_with(crate::helpers::without_order_consumer).await;
    let activity = app.live_activity(5, 1, 1).await;
    let (status, body) = app.buy(1, activity).await;
    assert_eq!(status, 202, "{body}");
    let order_no = body["order_no"].as_str().unwrap().to_owned();

    let mut stream = Stream::of(&app, 1, &order_no).await;
    assert_eq!(stream.status().await, "PROCESSING");

    let deps = seckill::orders::consumer::ConsumerDeps::connect(app.settings.clone()).unwrap();
    let consumer = seckill::orders::consumer::spawn(deps).unwrap();
    assert_eq!(stream.status().await, "WAITING_PAY");

    pay_through_the_mock(&app, 1, &order_no).await;
    assert_eq!(stream.status().await, "PAID");
    stream.ends().await;
    consumer.stop().await;

    // A stream of a final order: its status, then the end.
    let mut again = Stream::of(&app, 1, &order_no).await;
    assert_eq!(again.status().await, "PAID");
    again.ends().await;
}

#[tokio::test]
async fn cancelling_ends_the_stream_and_only_the_owner_may_open_one() {
    let app = spawn_app().await;
    let activity = app.live_activity(5, 1, 1).await;
    let (_, body) = app.buy(1, activity).await;
    let order_no = body["order_no"].as_str().unwrap().to_owned();
    assert_eq!(
        Stream::open(&app, 2, &order_no).await.status(),
        404,
        "another user's order"
    );
    assert_eq!(Stream::open(&app, 1, "123456789").await.status(), 404);
    assert_eq!(Stream::open(&app, 1, "not-a-number").await.status(), 404);
    let res = app
        .client
        .get(format!("{}/api/v1/orders/{order_no}/events", app.address))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 401);

    eventually("WAITING_PAY", Duration::from_secs(60), || async {
        (app.order_status(1, &order_no).await == "WAITING_PAY").then_some(())
    })
    .await;
    let mut stream = Stream::of(&app, 1, &order_no).await;
    assert_eq!(stream.status().await, "WAITING_PAY");
    assert_eq!(app.cancel(1, &order_no).await.status(), 200);
    assert_eq!(stream.status().await, "CANCELLED");
    stream.ends().await;
}

#[tokio::test]
async fn a_stream_ends_with_a_timeout_event_when_nothing_final_happens() {
    let app =
        spawn_app_with(|s| s.orders.events_timeout_secs = std::time::Duration::from_secs(1)).await;
    let activity = app.live_activity(5, 1, 1).await;
    let (_, body) = app.buy(1, activity).await;
    let order_no = body["order_no"].as_str().unwrap().to_owned();
    let mut stream = Stream::of(&app, 1, &order_no).await;
    let first = stream.status().await;
    assert!(first == "PROCESSING" || first == "WAITING_PAY", "{first}");
    // WAITING_PAY may come first; then the timeout.
    loop {
        let (name, data) = tokio::time::timeout(Duration::from_secs(60), stream.next())
            .await
            .unwrap()
            .expect("the timeout event before the end");
        if name == "timeout" {
            break;
        }
        assert_eq!(data["status"], "WAITING_PAY");
    }
    stream.ends().await;
}

/// A server whose users may hold `streams` streams each, and user 1's
/// order there, WAITING_PAY.
async fn one_waiting_order(streams: usize) -> (TestApp, String) {
    let app = spawn_app_with(|s| s.orders.streams_per_user = streams).await;
    let activity = app.live_activity(5, 1, 1).await;
    let (_, body) = app.buy(1, activity).await;
    let order_no = body["order_no"].as_str().unwrap().to_owned();
    eventually("WAITING_PAY", Duration::from_secs(60), || async {
        (app.order_status(1, &order_no).await == "WAITING_PAY").then_some(())
    })
    .await;
    (app, order_no)
}

/// `n` streams of user 1's `order_no`, opened 50 at a time, each reading
/// WAITING_PAY first (each reads the order once, as it opens).
async fn open_waiting(app: &TestApp, order_no: &str, n: usize) -> Vec<Stream> {
    let mut streams = Vec::with_capacity(n);
    for _ in 0..n.div_ceil(50) {
        let opened =
            futures_util::future::join_all((0..50).map(|_| Stream::of(app, 1, order_no))).await;
        for mut s in opened {
            assert_eq!(s.status().await, "WAITING_PAY");
            streams.push(s);
        }
    }
    streams
}

/// Transactions the test database has run (every statement outside a
/// transaction is one), as PostgreSQL's statistics count them.
async fn transactions(app: &TestApp) -> i64 {
    app.count("SELECT (xact_commit + xact_rollback)::bigint AS n FROM pg_stat_database WHERE datname = current_database()")
        .await
}

#[tokio::test]
async fn a_thousand_open_streams_cost_no_database_query_while_they_wait() {
    const STREAMS: usize = 1000;
    // One user holds them all here: past the per-user cap of a real sale.
    let (app, order_no) = one_waiting_order(STREAMS).await;

    // The same 10 s with no stream open: what the workers query anyway.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let start = transactions(&app).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let baseline = transactions(&app).await - start;

    // Open them 50 at a time; each reads the order once, as it opens.
    let mut streams = open_waiting(&app, &order_no, STREAMS).await;
    // PostgreSQL counts a backend's transactions when it next reports
    // (up to 10 s later for an idle one): let the opening settle first.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let before = transactions(&app).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let during = transactions(&app).await - before;
    // The workers (outbox relay, closer, reconciler) query on their own
    // all the while; streams that polled once a second would add 10 000,
    // once every 20 s still 500.
    assert!(
        during < baseline + 500,
        "{during} transactions in 10 s with {STREAMS} streams open, {baseline} with none"
    );
    eprintln!(
        "database transactions in 10 s: {baseline} with no stream open, {during} with {STREAMS}"
    );

    // One payment reaches every stream, and each ends.
    pay_through_the_mock(&app, 1, &order_no).await;
    for s in &mut streams {
        assert_eq!(s.status().await, "PAID");
        s.ends().await;
    }
}

/// Defect 9 of issue #41: streams used to hear every order's changes and
/// fall behind under load, then each re-read its order. 200 streams wait
/// while 200,000 changes of other orders go by: none reads its order again,
/// and the next change of their own still reaches each.
#[tokio::test]
async fn changes_of_other_orders_cost_the_streams_nothing() {
    const STREAMS: usize = 200;
    let (app, order_no) = one_waiting_order(STREAMS).await;
    let mut streams = open_waiting(&app, &order_no, STREAMS).await;
    let resyncs = "seckill_order_stream_resyncs_total";
    let before = app.metric(resyncs).await.unwrap_or(0);

    // 100 messages of 2,000 changes each, of orders no stream follows,
    // as another instance's consumer would publish them.
    let channel = seckill::orders::events::channel(&app.settings.redis.key_prefix);
    let mut conn = app.redis();
    for m in 0..100 {
        let payload = (0..2_000)
            .map(|i| format!("{}:WAITING_PAY", 1_000_000 + m * 2_000 + i))
            .collect::<Vec<_>>()
            .join(",");
        let _: i64 = redis::cmd("PUBLISH")
            .arg(&channel)
            .arg(payload)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    // Published after them on the same channel, so heard after them.
    pay_through_the_mock(&app, 1, &order_no).await;
    for s in &mut streams {
        assert_eq!(s.status().await, "PAID");
        s.ends().await;
    }
    assert_eq!(
        app.metric(resyncs).await.unwrap_or(0),
        before,
        "streams read their order again"
    );
}

/// Defect 9 of issue #25: one user cannot hold more than
/// `orders.streams_per_user` streams at once (each one re-reads its order
/// on a pub/sub reconnect); one more answers 429 with Retry-After, and a
/// closed stream gives its place back.
#[tokio::test]
async fn a_user_holds_at_most_streams_per_user_streams_at_once() {
    let app = spawn_app_with(|s| s.orders.streams_per_user = 2).await;
    let activity = app.live_activity(5, 1, 1).await;
    let (_, body) = app.buy(1, activity).await;
    let order_no = body["order_no"].as_str().unwrap().to_owned();
    let mut first = Stream::of(&app, 1, &order_no).await;
    first.status().await;
    let mut second = Stream::of(&app, 1, &order_no).await;
    second.status().await;
    let third = Stream::open(&app, 1, &order_no).await;
    assert_eq!(third.status(), 429);
    assert!(third.headers().contains_key("retry-after"));
    assert_eq!(json(third).await["code"], "RATE_LIMITED");
    // Closing one (the client goes away) gives its place back.
    drop(first);
    eventually("a place again", Duration::from_secs(30), || async {
        let res = Stream::open(&app, 1, &order_no).await;
        (res.status() == 200).then_some(())
    })
    .await;
}
