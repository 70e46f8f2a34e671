//! Kafka delivery faults: duplicates, garbage, an unreachable broker and a
//! consumer killed mid-stream (SPEC steps 2–3, I4, I5).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{StreamExt, stream};
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use seckill::admission::gate::Unsent;
use seckill::admission::{Admission, RedisGate, ReserveRequest};
use seckill::bus::events::OrderRequested;
use seckill::bus::runner::{Handler, Subscription};
use seckill::bus::{Producer, PublishError, Topics, client_config};
use seckill::config::Settings;
use seckill::domain::ActivityId;
use seckill::ids::OrderNo;
use seckill::orders::consumer::{self, ConsumerDeps};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::helpers::{TestApp, eventually, heal_within_the_drain, json, spawn_app, spawn_app_with};
use crate::wire::FaultProxy;

fn producer(app: &TestApp) -> FutureProducer {
    client_config(&app.settings.kafka)
        .create()
        .expect("test producer")
}

pub(crate) async fn produce(app: &TestApp, partition: Option<i32>, key: &str, payload: &[u8]) {
    let topic = Topics::new(&app.settings.kafka.topic_prefix).order_requested;
    let mut record = FutureRecord::to(&topic).key(key).payload(payload);
    if let Some(p) = partition {
        record = record.partition(p);
    }
    producer(app)
        .send(record, Timeout::After(Duration::from_secs(10)))
        .await
        .expect("produced");
}

/// The `n`-th made-up order number of `user`: like every real one, it
/// carries its buyer's slot in its low bits (the order table's partition,
/// `orders::partition`), which the database holds it to.
pub(crate) fn no_for(user: i64, n: i64) -> i64 {
    n * 64 + i64::from(seckill::ids::user_gene(user))
}

pub(crate) fn event(activity_id: i64, user_id: i64, order_no: i64) -> OrderRequested {
    OrderRequested {
        event_id: order_no.to_string(),
        order_no: OrderNo::new(order_no),
        activity_id: ActivityId::new(activity_id),
        user_id,
        request_id: format!("by-hand-{order_no}"),
        quantity: 1,
        coupon_id: None,
        reserved_at_ms: chrono::Utc::now().timestamp_millis(),
    }
}

#[tokio::test]
async fn an_event_delivered_twice_makes_one_order_and_new_events_beside_a_duplicate_are_all_created()
 {
    let app = spawn_app().await;
    let activity = app.live_activity(10, 1, 1).await;
    let (status, body) = app.buy(1, activity).await;
    assert_eq!(status, 202);
    app.drained(activity, 1).await;

    // Rebuild the very event admission published, and deliver it again.
    let order_no: i64 = body["order_no"].as_str().unwrap().parse().unwrap();
    let order = json(
        app.get(
            &format!("/api/v1/orders/{order_no}"),
            Some(&app.user_token(1)),
        )
        .await,
    )
    .await;
    let mut original = event(activity, 1, order_no);
    original.request_id = order["request_id"].as_str().unwrap().to_owned();
    produce(&app, None, &original.event_id, &original.encode()).await;
    // Then a duplicate and three new events together.
    produce(&app, Some(0), &original.event_id, &original.encode()).await;
    for (user, no) in [(2, 9_000_001), (3, 9_000_002), (4, 9_000_003)] {
        let e = event(activity, user, no_for(user, no));
        produce(&app, Some(0), &e.event_id, &e.encode()).await;
    }

    app.wait_for_stats(activity, |s| s["orders"]["WAITING_PAY"] == 4)
        .await;
    // Every copy has been through the consumer: a duplicate would show now.
    app.caught_up("order-creator", "order.requested").await;
    assert_eq!(app.count("SELECT count(*) AS n FROM orders").await, 4);
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) AS n FROM orders WHERE order_no = {order_no}"
        ))
        .await,
        1
    );
    assert_eq!(app.count("SELECT count(*) AS n FROM stock_flow").await, 4);
    let stats = app.stats(activity).await;
    assert_eq!(stats["db_locked"], 4, "the duplicate moved no stock");
    assert_eq!(stats["db_available"], 6);
}

#[tokio::test]
async fn garbage_goes_to_the_dead_letter_topic_and_orders_behind_it_are_created() {
    let app = spawn_app().await;
    let activity = app.live_activity(20, 1, 1).await;
    let partitions = app.settings.kafka.partitions;
    // Poison every partition, so whichever one an order lands in has garbage first.
    for p in 0..partitions {
        produce(&app, Some(p), "junk", b"\x00 this is not an order").await;
    }
    produce(&app, Some(0), "bad-qty", br#"{"event_id":"1","order_no":"1","activity_id":1,"user_id":1,"request_id":"r","quantity":0,"coupon_id":null,"reserved_at_ms":0}"#).await;
    let results: Vec<(u16, serde_json::Value)> = stream::iter(1..=12)
        .map(|u| app.buy(u, activity))
        .buffer_unordered(12)
        .collect()
        .await;
    assert!(results.iter().all(|(s, _)| *s == 202));
    app.drained(activity, 12).await;

    let topics = Topics::new(&app.settings.kafka.topic_prefix);
    let dlq: StreamConsumer = client_config(&app.settings.kafka)
        .set(
            "group.id",
            format!("{}dlq-reader", app.settings.kafka.topic_prefix),
        )
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    dlq.subscribe(&[&topics.order_requested_dlq]).unwrap();
    let mut errors = Vec::new();
    while errors.len() < partitions as usize + 1 {
        let m = tokio::time::timeout(Duration::from_secs(20), dlq.recv())
            .await
            .expect("dead letters arrive")
            .expect("dead letter");
        let headers = m.headers().expect("dead letters carry headers");
        let error = headers
            .iter()
            .find(|h| h.key == "error")
            .and_then(|h| h.value)
            .unwrap();
        assert!(headers.iter().any(|h| h.key == "source.offset"));
        errors.push(String::from_utf8_lossy(error).into_owned());
    }
    assert_eq!(
        errors.iter().filter(|e| e.contains("invalid JSON")).count(),
        partitions as usize
    );
    assert_eq!(errors.iter().filter(|e| e.contains("quantity")).count(), 1);
    let _ = tokio::task::spawn_blocking(move || drop(dlq)).await;
}

#[tokio::test]
async fn with_kafka_unreachable_a_purchase_is_503_retry_later_and_keeps_nothing() {
    // Never reachable: every message times out in the queue, never sent,
    // within the budget. Definitely not delivered, so nothing is kept.
    let app = spawn_app_with(|s| crate::helpers::kafka_unreachable(s, 1000)).await;
    let activity = app.live_activity(10, 1, 1).await;
    let token = app.purchase_token(1, activity).await;
    let res = app
        .order(1, activity, &json!({"request_id": "r1", "token": token}))
        .await;
    assert_eq!(res.status(), 503);
    assert_eq!(json(res).await["code"], "RETRY_LATER");

    let stats = app.stats(activity).await;
    assert_eq!(stats["redis_available"], 10, "the unit went back");
    assert_eq!(stats["reservations_open"], 0);
    // Nothing was kept: the same request_id with a new token is a fresh attempt
    // (not a replay of a phantom order), and the limit was given back.
    let token = app.purchase_token(1, activity).await;
    let res = app
        .order(1, activity, &json!({"request_id": "r1", "token": token}))
        .await;
    assert_eq!(res.status(), 503);
    assert_eq!(json(res).await["code"], "RETRY_LATER");
    assert_eq!(app.stats(activity).await["redis_available"], 10);
}

#[tokio::test]
async fn a_consumer_killed_mid_stream_and_restarted_creates_every_order_exactly_once() {
    let app = spawn_app_with(|s| {
        crate::helpers::without_order_consumer(s);
        s.orders.batch_size = 5;
        heal_within_the_drain(s);
    })
    .await;
    let activity = app.live_activity(500, 1, 2).await;
    let results: Vec<(u16, serde_json::Value)> = stream::iter(1..=500)
        .map(|u| app.buy(u, activity))
        .buffer_unordered(50)
        .collect()
        .await;
    assert!(results.iter().all(|(s, _)| *s == 202));

    let first = consumer::spawn(ConsumerDeps::connect(app.settings.clone()).unwrap()).unwrap();
    app.wait_for_stats(activity, |s| {
        s["orders"]["WAITING_PAY"].as_i64().unwrap() >= 30
    })
    .await;
    first.abort().await; // mid-stream: batches in flight, offsets partly committed

    let waiting = app.stats(activity).await["orders"]["WAITING_PAY"]
        .as_i64()
        .unwrap();
    assert!(waiting < 500, "killed before the end ({waiting} created)");
    let second = consumer::spawn(ConsumerDeps::connect(app.settings.clone()).unwrap()).unwrap();
    let stats = app.drained(activity, 500).await;
    second.stop().await;

    app.assert_each_order_once(&stats, 500).await;
    assert_eq!(
        app.count("SELECT count(DISTINCT request_id) AS n FROM orders")
            .await,
        500
    );
    assert_eq!(stats["db_available"], 0);
}

#[tokio::test]
async fn every_topic_the_service_uses_exists_with_its_partitions_once_it_has_started() {
    // The local broker does not create topics on first use (neither should
    // a production one): a topic the service forgot to create fails here.
    let app = spawn_app().await;
    let topics = Topics::new(&app.settings.kafka.topic_prefix);
    let names: Vec<String> = topics.all().iter().map(|t| (*t).to_owned()).collect();
    let kafka = app.settings.kafka.clone();
    let found = tokio::task::spawn_blocking(move || {
        let client: rdkafka::consumer::BaseConsumer = client_config(&kafka).create().unwrap();
        let look = || {
            names
                .iter()
                .map(|name| {
                    let metadata = client
                        .fetch_metadata(Some(name), Duration::from_secs(10))
                        .expect("metadata");
                    let t = &metadata.topics()[0];
                    (name.clone(), t.error().is_none(), t.partitions().len())
                })
                .collect::<Vec<_>>()
        };
        // A new topic takes a moment to show in the broker's metadata.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let found = look();
            if found.iter().all(|(_, exists, _)| *exists) || std::time::Instant::now() > deadline {
                return found;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    })
    .await
    .unwrap();
    assert_eq!(found.len(), 6);
    for (name, exists, partitions) in found {
        assert!(exists, "{name} was not created");
        assert_eq!(partitions, app.settings.kafka.partitions as usize, "{name}");
    }
}

#[tokio::test]
async fn consumers_joining_and_leaving_while_orders_flow_create_every_order_exactly_once() {
    // A rolling deploy during the sale: members come and go (cleanly or
    // killed) beside a steady one while purchases keep arriving, so
    // partitions move between members with batches in flight on both sides.
    let app = spawn_app_with(|s| {
        s.orders.consumer_enabled = false;
        s.orders.batch_size = 5;
        heal_within_the_drain(s);
    })
    .await;
    let activity = app.live_activity(1000, 1, 2).await;
    let deps = ConsumerDeps::connect(app.settings.clone()).unwrap();
    let steady = consumer::spawn(deps.clone()).unwrap();

    let buying = stream::iter(1..=1000)
        .map(|u| app.buy(u, activity))
        .buffer_unordered(10)
        .collect::<Vec<(u16, serde_json::Value)>>();
    let churning = async {
        for round in 0..6 {
            let extra = consumer::spawn(deps.clone()).unwrap();
            tokio::time::sleep(Duration::from_millis(fastrand::u64(300..2000))).await;
            if round % 2 == 0 {
                extra.abort().await;
            } else {
                extra.stop().await;
            }
        }
        app.stats(activity).await["orders"]["WAITING_PAY"]
            .as_i64()
            .unwrap()
    };
    let (results, created_while_churning) = tokio::join!(buying, churning);
    assert!(results.iter().all(|(s, _)| *s == 202));
    let stats = app.drained(activity, 1000).await;
    steady.stop().await;

    assert!(
        created_while_churning > 0,
        "orders were created while members came and went"
    );
    app.assert_each_order_once(&stats, 1000).await;
}

#[tokio::test]
async fn the_database_holds_the_per_user_limit_even_when_redis_lets_orders_through() {
    let app = spawn_app().await;
    let activity = app.live_activity(10, 1, 1).await;
    // Three orders of one buyer that never met Redis (as if it lost its
    // holdings): two in one batch, one later.
    for no in [8_000_001, 8_000_002] {
        let e = event(activity, 5, no_for(5, no));
        produce(&app, Some(0), &e.event_id, &e.encode()).await;
    }
    app.wait_for_stats(activity, |s| {
        s["orders"]["WAITING_PAY"].as_i64().unwrap() + s["orders"]["FAILED"].as_i64().unwrap() == 2
    })
    .await;
    let e = event(activity, 5, no_for(5, 8_000_003));
    produce(&app, Some(1), &e.event_id, &e.encode()).await;
    let stats = app
        .wait_for_stats(activity, |s| s["orders"]["FAILED"] == 2)
        .await;
    assert_eq!(stats["orders"]["WAITING_PAY"], 1);
    assert_eq!(stats["db_locked"], 1, "only the first order holds stock");
    assert_eq!(stats["db_available"], 9);
    assert_eq!(
        app.count("SELECT count(*) AS n FROM orders WHERE failure_reason = 'LIMIT_EXCEEDED'")
            .await,
        2
    );
    assert_eq!(app.count("SELECT count(*) AS n FROM stock_flow").await, 1);
    // The holder is one of the two written before the third was sent. Which
    // of the two is not I2's business: a fresh-clone run on a loaded host
    // once saw the second hold, a reordering not explained yet.
    let holder = app
        .count("SELECT order_no AS n FROM orders WHERE status = 'WAITING_PAY'")
        .await;
    assert!(
        [no_for(5, 8_000_001), no_for(5, 8_000_002)].contains(&holder),
        "{holder}"
    );
}

/// A retry of a purchase whose delivery is unknown, after Redis lost its
/// reservation (flushed, say) before the order's row was written: nothing
/// can vouch for the order any more, so the answer is 503 RETRY_LATER
/// naming it, never a 200 PROCESSING for an order that may not exist. (A
/// randomized fault run found a buyer told 200 for an order that was
/// never written: Redis flushed while the broker was paused.)
#[tokio::test]
async fn a_retry_after_redis_lost_an_unconfirmed_reservation_is_never_answered_200() {
    let app = spawn_app_with(|s| crate::helpers::kafka_unreachable(s, 60_000)).await;
    let activity = app.live_activity(10, 1, 1).await;
    let (body, first) = eventually("a purchase kept", Duration::from_secs(60), || async {
        let token = app.purchase_token(1, activity).await;
        let body = json!({"request_id": "lost", "token": token});
        let res = app.order(1, activity, &body).await;
        let status = res.status().as_u16();
        let answer = json(res).await;
        assert_eq!(status, 503, "{answer}");
        (!answer["order_no"].is_null()).then_some((body, answer))
    })
    .await;
    let order_no = first["order_no"].as_str().unwrap().to_owned();
    // Redis loses the reservation record; the request's binding stays.
    let key = format!(
        "{}{{a:{activity}}}:res:{order_no}",
        app.settings.redis.key_prefix
    );
    let removed: i64 = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut app.redis())
        .await
        .unwrap();
    assert_eq!(removed, 1, "{key}");
    for _ in 0..3 {
        let res = app.order(1, activity, &body).await;
        let status = res.status().as_u16();
        let answer = json(res).await;
        assert_eq!(
            (status, answer["code"].as_str(), answer["order_no"].as_str()),
            (503, Some("RETRY_LATER"), Some(order_no.as_str())),
            "{answer}"
        );
    }
}

#[tokio::test]
async fn a_purchase_not_confirmed_within_its_budget_keeps_its_order_no_and_a_retry_gets_that_order_once()
 {
    // A budget far shorter than the producer's linger: no delivery report
    // can come back in time, so the outcome is unknown when the buyer hears
    // (with the default 5 ms linger, a loaded host could see both at once).
    let app = spawn_app_with(|s| {
        s.admission.publish_budget_ms = std::time::Duration::from_millis(1);
        s.kafka.linger_ms = std::time::Duration::from_millis(1000);
    })
    .await;
    let activity = app.live_activity(10, 1, 1).await;
    // A 503 that kept nothing (no order_no: on a busy host, say, the
    // instance's order-number lease not yet taken) is retried with a new
    // token, as a client does; the first that kept something names it.
    let (body, first) = eventually("a purchase kept", Duration::from_secs(60), || async {
        let token = app.purchase_token(1, activity).await;
        let body = json!({"request_id": "slow", "token": token});
        let res = app.order(1, activity, &body).await;
        let status = res.status().as_u16();
        let answer = json(res).await;
        assert_eq!(
            (status, answer["code"].as_str()),
            (503, Some("RETRY_LATER")),
            "{answer}"
        );
        (!answer["order_no"].is_null()).then_some((body, answer))
    })
    .await;
    let order_no = first["order_no"].as_str().expect("a string").to_owned();
    // Nothing was released and nothing forgotten.
    let stats = app.stats(activity).await;
    assert_eq!(stats["redis_available"], 9);

    // The buyer retries with the same request_id (its token is spent: the
    // replay check comes first) until the purchase is confirmed; until then
    // every answer names the same order.
    let confirmed = eventually(
        "the purchase confirmed",
        Duration::from_secs(30),
        || async {
            let res = app.order(1, activity, &body).await;
            let status = res.status().as_u16();
            let answer = json(res).await;
            if status == 200 || status == 202 {
                return Some(answer);
            }
            assert_eq!(status, 503, "{answer}");
            if answer["code"] == "RETRY_LATER" {
                assert_eq!(answer["order_no"], order_no.as_str(), "the same order");
            }
            None
        },
    )
    .await;
    assert_eq!(confirmed["order_no"], order_no.as_str());
    let stats = app.drained(activity, 1).await;
    assert_eq!(app.count("SELECT count(*) AS n FROM orders").await, 1);
    assert_eq!(stats["db_locked"], 1);
    assert_eq!(stats["redis_available"], 9);
    assert_eq!(app.order_status(1, &order_no).await, "WAITING_PAY");
    let again = json(app.order(1, activity, &body).await).await;
    assert_eq!(
        (again["order_no"].as_str(), again["status"].as_str()),
        (Some(order_no.as_str()), Some("WAITING_PAY"))
    );
}

#[tokio::test]
async fn an_order_event_the_database_refuses_is_dead_lettered_and_voids_its_reservation_once() {
    // Its own reconciliation report is read below: no periodic one.
    let app = spawn_app_with(|s| s.reconcile.enabled = false).await;
    let activity = app.live_activity(5, 1, 1).await;
    let gate = RedisGate::new(&app.settings.redis, &app.settings.admission, None).unwrap();
    // A purchase admitted and acknowledged, whose event the database will
    // refuse for good: a LOCK flow row with its number already exists.
    let order_no = no_for(2, 777_000_009);
    let token = app.purchase_token(2, activity).await;
    let now = chrono::Utc::now().timestamp_millis();
    let reserved = gate
        .reserve(&ReserveRequest {
            activity_id: ActivityId::new(activity),
            user_id: 2,
            request_id: "poison",
            token: &token,
            quantity: 1,
            order_no,
            layout: seckill::admission::Layout::single(1),
            now_ms: now,
            coupon_id: None,
        })
        .await
        .unwrap();
    assert_eq!(reserved, Admission::Accepted(order_no));
    gate.ack(
        ActivityId::new(activity),
        seckill::admission::Layout::single(1),
        &[order_no],
        now,
    )
    .await
    .unwrap();
    app.execute(&format!(
        "INSERT INTO stock_flow (activity_id, biz_type, biz_no, quantity) \
         VALUES ({activity}, 'LOCK', {order_no}, 1)"
    ))
    .await;
    let r = gate
        .reservation(
            ActivityId::new(activity),
            seckill::admission::Layout::single(1),
            order_no,
        )
        .await
        .unwrap()
        .unwrap();
    let payload = r.event(ActivityId::new(activity), order_no).encode();
    produce(&app, None, &order_no.to_string(), &payload).await;

    // The consumer records FAILED in the database, then releases in Redis:
    // wait for both before looking at the unit.
    let stats = app
        .wait_for_stats(activity, |s| {
            s["orders"]["FAILED"] == 1 && s["reservations_open"] == 0
        })
        .await;
    assert_eq!(stats["redis_available"], 5, "the unit is back, once");
    assert_eq!(stats["db_available"], 5);
    let order = json(
        app.get(
            &format!("/api/v1/orders/{order_no}"),
            Some(&app.user_token(2)),
        )
        .await,
    )
    .await;
    assert_eq!(
        (order["status"].as_str(), order["failure_reason"].as_str()),
        (Some("FAILED"), Some("DEAD_LETTERED"))
    );
    // Nothing is left for reconciliation to publish again, and the unit is
    // not given back twice.
    let report = json(
        app.post_json(
            "/api/v1/admin/reconcile",
            &json!({}),
            Some(&app.admin_token()),
        )
        .await,
    )
    .await;
    assert!(!report.to_string().contains("published again"), "{report}");
    assert_eq!(app.stats(activity).await["redis_available"], 5);
    assert_eq!(app.count("SELECT count(*) AS n FROM orders").await, 1);
}

/// A TCP proxy to `target` that drops every connection while `open` is
/// false (Redis unreachable) and forwards while it is true.
async fn gated_proxy(target: String, open: Arc<std::sync::atomic::AtomicBool>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            if !open.load(std::sync::atomic::Ordering::Relaxed) {
                drop(inbound);
                continue;
            }
            let target = target.clone();
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    format!("redis://{address}")
}

#[tokio::test]
async fn an_acknowledgement_redis_refused_at_first_is_written_once_it_answers() {
    let app = spawn_app_with(|s| s.reconcile.enabled = false).await;
    let activity = app.live_activity(5, 1, 1).await;
    let (id, layout) = (
        ActivityId::new(activity),
        seckill::admission::Layout::single(1),
    );
    let direct = RedisGate::new(&app.settings.redis, &app.settings.admission, None).unwrap();
    let order_no = 777_000_111;
    let token = app.purchase_token(2, activity).await;
    let reserved = direct
        .reserve(&ReserveRequest {
            activity_id: id,
            user_id: 2,
            request_id: "acked-late",
            token: &token,
            quantity: 1,
            order_no,
            layout,
            now_ms: chrono::Utc::now().timestamp_millis(),
            coupon_id: None,
        })
        .await
        .unwrap();
    assert_eq!(reserved, Admission::Accepted(order_no));

    // The writer's Redis drops every connection for a while.
    let open = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let target = app
        .settings
        .redis
        .url
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .to_owned();
    let mut settings = app.settings.redis.clone();
    settings.url = gated_proxy(target, open.clone()).await;
    let gate = Arc::new(RedisGate::new(&settings, &app.settings.admission, None).unwrap());
    let acks =
        seckill::admission::acks::Acks::start(gate, 16, Arc::new(seckill::clock::SystemClock));
    acks.ack(id, layout, order_no).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let r = direct
        .reservation(id, layout, order_no)
        .await
        .unwrap()
        .unwrap();
    assert!(!r.acked, "Redis was unreachable");
    open.store(true, std::sync::atomic::Ordering::Relaxed);
    eventually(
        "the acknowledgement recorded",
        Duration::from_secs(60),
        || {
            let direct = &direct;
            async move {
                let r = direct
                    .reservation(id, layout, order_no)
                    .await
                    .unwrap()
                    .unwrap();
                r.acked.then_some(())
            }
        },
    )
    .await;
}

#[tokio::test]
async fn an_undelivered_first_send_never_releases_a_purchase_a_retry_got_acknowledged() {
    // The race of a retry and its first attempt: the retry's send of the
    // same event was acknowledged (202 to the buyer), then the first
    // attempt's own send is reported never delivered (a producer rebuilt
    // with it in its queue). Its release must keep the reservation, and
    // the request_id with it; a reservation nobody acknowledged goes.
    let app = spawn_app_with(|s| s.reconcile.enabled = false).await;
    let activity = app.live_activity(5, 1, 1).await;
    let gate = RedisGate::new(&app.settings.redis, &app.settings.admission, None).unwrap();
    let layout = seckill::admission::Layout::single(1);
    let id = ActivityId::new(activity);
    let reserve = |user: i64, token: String, order_no: i64| {
        let gate = &gate;
        async move {
            let now = chrono::Utc::now().timestamp_millis();
            gate.reserve(&ReserveRequest {
                activity_id: id,
                user_id: user,
                request_id: "first-attempt",
                token: &token,
                quantity: 1,
                order_no,
                layout,
                now_ms: now,
                coupon_id: None,
            })
            .await
            .unwrap()
        }
    };
    let (acked, committed, unacked) = (777_000_101, 777_000_102, 777_000_103);
    for (user, order_no) in [(2, acked), (3, committed), (4, unacked)] {
        let token = app.purchase_token(user, activity).await;
        assert_eq!(
            reserve(user, token, order_no).await,
            Admission::Accepted(order_no)
        );
    }
    let now = chrono::Utc::now().timestamp_millis();
    gate.ack(id, layout, &[acked], now).await.unwrap();
    gate.commit(id, layout, &[committed]).await.unwrap();
    assert_eq!(app.stats(activity).await["redis_available"], 2);

    for order_no in [acked, committed] {
        assert_eq!(
            gate.release_unsent(id, order_no, layout).await.unwrap(),
            Unsent::Kept,
            "{order_no}: its order exists"
        );
    }
    assert_eq!(
        gate.release_unsent(id, unacked, layout).await.unwrap(),
        Unsent::Released
    );
    let stats = app.stats(activity).await;
    assert_eq!(
        stats["redis_available"], 3,
        "only the unacknowledged unit came back: {stats}"
    );
    // The kept purchases' request ids still name their orders; the
    // released one's is forgotten, so its retry is a new attempt.
    let again = |user: i64| {
        let app = &app;
        async move {
            reserve(
                user,
                app.purchase_token(user, activity).await,
                777_000_199 + user,
            )
            .await
        }
    };
    assert_eq!(again(2).await, Admission::Duplicate(acked));
    assert_eq!(again(3).await, Admission::Duplicate(committed));
    assert_eq!(again(4).await, Admission::Accepted(777_000_203));
}

#[tokio::test]
async fn a_consumer_group_wedged_with_messages_waiting_is_rebuilt_reported_and_backpressured() {
    // The group is stuck in a rebalance: a member that joined and then
    // stopped polling holds it (until max.poll.interval.ms, five minutes),
    // so the order consumer gets no partition while messages wait.
    //
    // The stall window is 10 s, not 3 s: after three rebuilds with no
    // progress the process gives up and exits (70), and every other test
    // of this process with it. A fresh run on a busy host exited 70 while
    // this test, the only one with so short a window, was running. Here
    // the group recovers 0.4-1.7 s after the rebuild; with 3 s, any
    // recovery slower than that window on a busy host is rebuilt again,
    // which starts it over. The give-up is now 30 s past the first
    // rebuild.
    let app = spawn_app_with(|s| {
        crate::helpers::without_order_consumer(s);
        s.kafka.consumer_stall_secs = std::time::Duration::from_secs(10);
        s.admission.lag_sample_ms = std::time::Duration::from_millis(200);
    })
    .await;
    let activity = app.live_activity(20, 1, 1).await;
    let kafka = app.settings.kafka.clone();
    let topic = Topics::new(&kafka.topic_prefix).order_requested;
    let group = seckill::bus::group_id(&kafka, consumer::CONSUMER);
    let rogue = tokio::task::spawn_blocking(move || {
        let rogue: rdkafka::consumer::BaseConsumer = client_config(&kafka)
            .set("group.id", &group)
            .create()
            .unwrap();
        rogue.subscribe(&[&topic]).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while rogue.assignment().unwrap().count() == 0 {
            assert!(std::time::Instant::now() < deadline, "rogue never assigned");
            let _ = rogue.poll(Duration::from_millis(100));
        }
        rogue // and it never polls again
    })
    .await
    .unwrap();
    let deps = ConsumerDeps::connect(app.settings.clone()).unwrap();
    let restarts = deps.metrics.consumer_restarts.clone();
    let consumer = consumer::spawn(deps).unwrap();
    // Purchases until the stall is noticed (503 BUSY) or five are in.
    for user in 1..=5 {
        let (status, body) = app.buy_once(user, activity).await;
        assert!(status == 202 || status == 503, "{status} {body}");
    }
    let waiting = app.stats(activity).await["reservations_open"]
        .as_i64()
        .unwrap();
    assert!(waiting >= 1, "the first purchase met no stall");

    // Noticed, reported, backpressured, rebuilt.
    let group = seckill::bus::group_id(&app.settings.kafka, consumer::CONSUMER);
    eventually("the consumer rebuilt", Duration::from_secs(60), || async {
        (restarts.with_label_values(&[&group]).get() > 0).then_some(())
    })
    .await;
    let rebuilt_at = std::time::Instant::now();
    // Reported, without taking the instance out of its load balancer:
    // purchases answer BUSY themselves.
    let ready = app.get("/health/ready", None).await;
    assert_eq!(ready.status(), 200);
    let why = json(ready).await;
    assert_eq!(why["status"], "degraded", "{why}");
    assert!(
        why["degraded"].to_string().contains("nothing committed"),
        "{why}"
    );
    let (status, body) = app.buy_once(6, activity).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("BUSY")),
        "{body}"
    );

    // The wedged member leaves: the orders flow, and everything recovers.
    let _ = tokio::task::spawn_blocking(move || drop(rogue)).await;
    println!(
        "the rogue left {:?} after the rebuild",
        rebuilt_at.elapsed()
    );
    app.drained(activity, waiting).await;
    println!("drained {:?} after the rebuild", rebuilt_at.elapsed());
    app.wait_until_ready().await;
    assert_eq!(app.buy(6, activity).await.0, 202);
    app.drained(activity, waiting + 1).await;
    consumer.stop().await;
}

/// The keys of every message on `topic` now, read from the broker itself.
async fn keys_on(settings: &Settings, topic: &str) -> Vec<String> {
    let (settings, topic) = (settings.clone(), topic.to_owned());
    tokio::task::spawn_blocking(move || crate::forensics::keys_on(&settings, &topic))
        .await
        .expect("the scan ran")
        .expect("the topic was read")
}

#[tokio::test]
async fn a_write_the_broker_refused_is_never_reported_delivered_because_the_write_behind_it_was_accepted()
 {
    // A topic of one partition, and a producer new to it: the broker has no
    // state for this producer there, so it takes any first sequence number.
    let mut settings = Settings::load_env("test").expect("test settings");
    settings.kafka.topic_prefix = format!(
        "t{}{}.",
        crate::cleanup::run_id(),
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    settings.kafka.partitions = 1;
    let topics = Topics::new(&settings.kafka.topic_prefix);
    seckill::bus::ensure_topics(&settings.kafka, &topics)
        .await
        .expect("topics");
    let topic = &topics.order_requested;
    let proxy = FaultProxy::start(&settings.kafka.brokers, b"refused-first").await;
    let mut through_the_proxy = settings.kafka.clone();
    through_the_proxy.brokers = proxy.brokers.clone();
    // The first write must reach the wire. A producer new to a new topic
    // learns its leader and its producer id first, and on a loaded host that
    // took longer than the suite's 5 s message timeout: the write expired
    // in librdkafka's queue and the fault never happened.
    through_the_proxy.message_timeout_ms = Duration::from_secs(60);
    let producer = Producer::new(&through_the_proxy).expect("producer");

    // The first write is held on the wire until the second is sent behind
    // it; then the broker refuses the first (retriably) and takes the second.
    let first = producer
        .enqueue(topic, "first", b"refused-first", None)
        .expect("enqueued");
    if !proxy.holding(Duration::from_secs(90)).await {
        panic!(
            "the first write never reached the broker's listener: {:?}",
            first.await
        );
    }
    let second = producer
        .enqueue(topic, "second", b"accepted-second", None)
        .expect("enqueued");
    let (first, second) = (first.await, second.await);
    assert!(
        proxy.refused_before_the_next(),
        "the fault did not happen as meant"
    );
    let on_topic = keys_on(&settings, topic).await;
    assert!(second.is_ok(), "{second:?}");
    assert!(on_topic.contains(&"second".to_owned()), "{on_topic:?}");

    // Whatever librdkafka concludes, "delivered" must mean on the topic; a
    // write that may or may not be there is unknown (sent again by the
    // publisher), never "not delivered" (which would release its purchase).
    match first {
        Ok(()) => assert!(
            on_topic.contains(&"first".to_owned()),
            "reported delivered, but not on the topic: {on_topic:?}"
        ),
        Err(e) => assert!(
            matches!(e, PublishError::Unconfirmed | PublishError::Unknown(_)),
            "{e:?}"
        ),
    }
    tokio::task::spawn_blocking(move || drop(producer));
}

#[tokio::test]
async fn a_purchase_whose_event_the_broker_refused_is_accepted_only_once_its_event_is_on_the_topic()
{
    // The server talks to the broker through the proxy, on one partition:
    // buyer 1's event is held on the wire until buyer 2's is sent behind
    // it, then refused while buyer 2's is taken.
    let direct = Settings::load_env("test").expect("test settings");
    let proxy = FaultProxy::start(&direct.kafka.brokers, b"refused-first").await;
    let brokers = proxy.brokers.clone();
    let app = spawn_app_with(|s| {
        s.kafka.brokers = brokers;
        s.kafka.partitions = 1;
    })
    .await;
    app.wait_until_ready().await;
    let mut direct = Settings {
        kafka: direct.kafka,
        ..app.settings.clone()
    };
    direct.kafka.topic_prefix = app.settings.kafka.topic_prefix.clone();
    let topic = Topics::new(&app.settings.kafka.topic_prefix).order_requested;
    let activity = app.live_activity(2, 1, 1).await;
    let first =
        json!({"request_id": "refused-first", "token": app.purchase_token(1, activity).await});
    let second =
        json!({"request_id": "accepted-second", "token": app.purchase_token(2, activity).await});

    let accepted_first = async {
        let (status, answer) = app.order_retrying(1, activity, &first).await;
        // Read at once, before anything (reconciliation) could repair it.
        (status, answer, keys_on(&direct, &topic).await)
    };
    let accepted_second = async {
        assert!(
            proxy.holding(Duration::from_secs(30)).await,
            "buyer 1's event never reached the broker's listener"
        );
        app.order_retrying(2, activity, &second).await
    };
    let ((status, answer, on_topic), (second_status, _)) =
        tokio::join!(accepted_first, accepted_second);
    assert!(
        proxy.refused_before_the_next(),
        "the fault did not happen as meant"
    );
    assert_eq!((status, second_status), (202, 202), "{answer}");
    let order_no = answer["order_no"].as_str().expect("order_no").to_owned();
    assert!(
        on_topic.contains(&order_no),
        "buyer 1 was told accepted while its event was not on the topic: {on_topic:?}"
    );

    let stats = app.drained(activity, 2).await;
    app.assert_each_order_once(&stats, 2).await;
    assert_eq!(app.order_status(1, &order_no).await, "WAITING_PAY");
}

/// Holds (until shutdown) any batch with the topic's first message in it,
/// as a handler stuck retrying a database would; records every message of
/// the batches it applies.
struct HoldTheFirst {
    hold: bool,
    applied: Arc<Mutex<Vec<i64>>>,
}

impl Handler for HoldTheFirst {
    async fn handle(&self, batch: &[OwnedMessage], shutdown: &CancellationToken) -> bool {
        if self.hold && batch.iter().any(|m| m.offset() == 0) {
            shutdown.cancelled().await;
            return false; // interrupted: its offsets must not be stored
        }
        self.applied
            .lock()
            .unwrap()
            .extend(batch.iter().map(|m| m.offset()));
        true
    }
}

#[tokio::test]
async fn batches_applied_at_once_store_offsets_in_order_so_a_batch_behind_a_stuck_one_is_replayed()
{
    let app = spawn_app_with(crate::helpers::without_order_consumer).await;
    // A topic no consumer of the service reads, one partition of it.
    let topic = Topics::new(&app.settings.kafka.topic_prefix).order_requested_dlq;
    let producer = producer(&app);
    for i in 0..10 {
        let payload = format!("message {i}");
        producer
            .send(
                FutureRecord::to(&topic)
                    .key("k")
                    .payload(&payload)
                    .partition(0),
                Timeout::After(Duration::from_secs(10)),
            )
            .await
            .expect("produced");
    }
    let deps = ConsumerDeps::connect(app.settings.clone()).unwrap();
    let group = "in-flight-order";
    let subscribe = |hold: bool, applied: Arc<Mutex<Vec<i64>>>| {
        let sub = Subscription {
            group,
            topic: topic.clone(),
            batch_size: 5,
            batch_wait: Duration::from_millis(200),
            in_flight: 3,
            rush: None,
        };
        deps.subscribe_as(sub, HoldTheFirst { hold, applied })
            .unwrap()
    };

    // The first batch is stuck; the ones behind it are applied.
    let applied = Arc::new(Mutex::new(Vec::new()));
    let first = subscribe(true, applied.clone());
    eventually(
        "a batch behind the stuck one applied",
        Duration::from_secs(60),
        || async { (!applied.lock().unwrap().is_empty()).then_some(()) },
    )
    .await;
    first.stop().await; // closing commits whatever offsets were stored
    let behind = applied.lock().unwrap().clone();
    assert!(behind.iter().all(|&o| o > 0), "{behind:?}");
    let kafka = &app.settings.kafka;
    let progress = Arc::new(
        seckill::bus::progress::GroupProgress::new(
            kafka,
            &seckill::bus::group_id(kafka, group),
            &topic,
        )
        .unwrap(),
    );
    // A loaded broker may still be electing a new topic's leaders: asked
    // again until it answers.
    let lag = crate::helpers::eventually("the group's lag", Duration::from_secs(60), || async {
        progress.lag().await.ok()
    })
    .await;
    assert_eq!(
        lag, 10,
        "nothing committed past the stuck batch, though {behind:?} were applied"
    );

    // The next client replays them all, those applied before included.
    let replayed = Arc::new(Mutex::new(Vec::new()));
    let second = subscribe(false, replayed.clone());
    let all = eventually("all ten applied again", Duration::from_secs(60), || async {
        let mut seen = replayed.lock().unwrap().clone();
        seen.sort_unstable();
        (seen.len() >= 10).then_some(seen)
    })
    .await;
    assert_eq!(all, (0..10).collect::<Vec<i64>>());
    app.caught_up(group, "order.requested.dlq").await;
    second.stop().await;
    let _ = tokio::task::spawn_blocking(move || drop(progress)).await;
}

/// The order topic's partitions, as the broker has them.
async fn order_partitions(app: &crate::helpers::TestApp) -> Option<usize> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let topic = seckill::bus::Topics::new(&app.settings.kafka.topic_prefix).order_requested;
    let config = seckill::bus::client_config(&app.settings.kafka);
    tokio::task::spawn_blocking(move || {
        let client: BaseConsumer = config.create().ok()?;
        let metadata = client
            .fetch_metadata(Some(&topic), std::time::Duration::from_secs(10))
            .ok()?;
        Some(metadata.topics().first()?.partitions().len())
    })
    .await
    .unwrap()
}

/// Waits until a fresh client sees `count` partitions of the order topic.
/// The controller has committed them when the instance is ready; a broker
/// applies that to the metadata it answers a moment later, and a loaded
/// host stretches the moment.
async fn until_partitions(app: &crate::helpers::TestApp, count: i32) {
    let count = usize::try_from(count).expect("a partition count");
    let mut seen = None;
    let found = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            seen = order_partitions(app).await;
            if seen == Some(count) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    assert!(
        found.is_ok(),
        "{count} partitions wanted, last seen {seen:?}"
    );
}

/// Topics made by an earlier configuration with fewer partitions than
/// `kafka.partitions` get the missing ones when an instance starts with
/// more (as the production overlay's 12): more order consumers can work
/// at once.
#[tokio::test]
async fn a_topic_grows_to_the_partitions_configured() {
    let app = crate::helpers::spawn_app().await;
    until_partitions(&app, app.settings.kafka.partitions).await;
    let more = app.settings.kafka.partitions + 2;
    let _grown = app.sibling(|s| s.kafka.partitions = more).await;
    until_partitions(&app, more).await;
}
