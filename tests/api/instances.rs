//! Many instances: leased instance ids, order numbers that cannot collide
//! in Redis, and conflicting events that are never dropped silently.

use std::time::Duration;

use seckill::admission::{Admission, RedisGate, ReserveRequest};
use seckill::app::Application;
use seckill::bus::Topics;
use seckill::domain::ActivityId;
use seckill::ids::instance_of;

use crate::helpers::{TestApp, eventually, spawn_app, spawn_app_with};

fn order_no(body: &serde_json::Value) -> i64 {
    body["order_no"]
        .as_str()
        .expect("order_no")
        .parse()
        .unwrap()
}

#[tokio::test]
async fn two_instances_with_the_default_config_lease_distinct_ids_and_mint_distinct_numbers() {
    let a = spawn_app().await;
    assert_eq!(a.settings.app.instance_id, None, "the default config");
    let prefix = a.settings.redis.key_prefix.clone();
    let b = spawn_app_with(|s| s.redis.key_prefix = prefix).await;

    let (ia, ib) = (
        a.metric("seckill_instance_id").await.unwrap(),
        b.metric("seckill_instance_id").await.unwrap(),
    );
    assert!(ia >= 0 && ib >= 0, "both hold a lease: {ia} {ib}");
    assert_ne!(ia, ib, "one Redis, two instances, two ids");
    // (One Redis prefix over two databases: their activity ids coincide,
    // so the buyers differ.)
    for (app, instance, user) in [(&a, ia, 1), (&b, ib, 2)] {
        let activity = app.live_activity(5, 1, 1).await;
        let (status, body) = app.buy(user, activity).await;
        assert_eq!(status, 202, "{body}");
        assert_eq!(i64::from(instance_of(order_no(&body))), instance);
    }
}

#[tokio::test]
async fn a_pinned_instance_id_held_by_a_running_instance_refuses_to_start() {
    let pin = |s: &mut seckill::config::Settings| {
        s.app.instance_id = Some(7);
        s.app.instance_lease_secs = std::time::Duration::from_secs(2);
    };
    let a = spawn_app_with(pin).await;
    assert_eq!(a.metric("seckill_instance_id").await, Some(7));
    let mut settings = a.settings.clone();
    pin(&mut settings);
    let err = Application::build(settings)
        .await
        .err()
        .expect("the second instance with id 7 must not start");
    assert!(
        format!("{err:#}").contains("app.instance_id 7 is leased"),
        "{err:#}"
    );
    // The first is unharmed: it still holds 7 (its heartbeat renewed it
    // all along) and sells under it.
    let activity = a.live_activity(5, 1, 1).await;
    let (status, body) = a.buy(1, activity).await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(instance_of(order_no(&body)), 7);
}

#[tokio::test]
async fn an_instance_whose_lease_is_taken_stops_minting_then_leases_another_id() {
    let a = spawn_app_with(|s| s.app.instance_lease_secs = std::time::Duration::from_secs(2)).await;
    let activity = a.live_activity(5, 1, 1).await;
    let held = a.metric("seckill_instance_id").await.unwrap();
    assert!(held >= 0);
    // Another process takes the id over (as if our lease had run out).
    let mut redis = a.redis();
    let key = format!("{}{{instance:{held}}}", a.settings.redis.key_prefix);
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("someone-else")
        .arg("PX")
        .arg(60_000)
        .query_async(&mut redis)
        .await
        .unwrap();
    // Its heartbeat notices within a fifth of the lifetime, and it holds
    // another id soon after; never two numbers under the taken one.
    let next = eventually("a new id leased", Duration::from_secs(30), || async {
        a.metric("seckill_instance_id")
            .await
            .filter(|id| *id >= 0 && *id != held)
    })
    .await;
    let (status, body) = a.buy(1, activity).await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(i64::from(instance_of(order_no(&body))), next);
    let owner: String = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(owner, "someone-else", "the taken id was left alone");
}

#[tokio::test]
async fn a_reservation_is_never_overwritten_by_another_purchase_under_the_same_number() {
    let app = spawn_app().await;
    let activity = app.live_activity(10, 1, 1).await;
    let gate = RedisGate::new(&app.settings.redis, &app.settings.admission, None).unwrap();
    let order_no = 880_000_001;
    let mut reserved = Vec::new();
    for (user, request_id) in [(1, "first"), (2, "second")] {
        let token = app.purchase_token(user, activity).await;
        reserved.push(
            gate.reserve(&ReserveRequest {
                activity_id: ActivityId::new(activity),
                user_id: user,
                request_id,
                token: &token,
                quantity: 1,
                order_no,
                layout: seckill::admission::Layout::single(1),
                now_ms: chrono::Utc::now().timestamp_millis(),
                coupon_id: None,
            })
            .await
            .unwrap(),
        );
    }
    assert_eq!(
        reserved,
        [Admission::Accepted(order_no), Admission::NumberTaken]
    );
    let kept = gate
        .reservation(
            ActivityId::new(activity),
            seckill::admission::Layout::single(1),
            order_no,
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!((kept.user_id, kept.request_id.as_str()), (1, "first"));
    let stats = app.stats(activity).await;
    assert_eq!(stats["redis_available"], 9, "one unit reserved, not two");
    assert_eq!(stats["reservations_open"], 1);
}

#[tokio::test]
async fn an_event_reusing_an_applied_event_id_with_another_payload_is_dead_lettered_not_dropped() {
    let app = spawn_app().await;
    let activity = app.live_activity(10, 1, 1).await;
    let (status, body) = app.buy(1, activity).await;
    assert_eq!(status, 202);
    app.drained(activity, 1).await;
    let number = order_no(&body);

    // Another purchase that was minted the same number.
    let mut other = crate::delivery::event(activity, 2, number);
    other.request_id = "another-buyer".into();
    crate::delivery::produce(&app, None, &other.event_id, &other.encode()).await;
    let topics = Topics::new(&app.settings.kafka.topic_prefix);

    let settings = app.settings.clone();
    let errors = eventually(
        "the conflicting event dead-lettered",
        Duration::from_secs(60),
        || {
            let (settings, dlq) = (settings.clone(), topics.order_requested_dlq.clone());
            async move {
                tokio::task::spawn_blocking(move || {
                    crate::forensics::errors_on(&settings, &dlq).ok()
                })
                .await
                .unwrap()
                .filter(|errors| !errors.is_empty())
            }
        },
    )
    .await;
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains("conflict") && errors[0].contains(&other.event_id),
        "{errors:?}"
    );
    assert_eq!(app.metric("seckill_event_conflicts_total").await, Some(1));
    // The first order stands untouched.
    assert_eq!(app.count("SELECT count(*) AS n FROM orders").await, 1);
    assert_eq!(
        app.order_status(1, &number.to_string()).await,
        "WAITING_PAY"
    );
    let stats = app.stats(activity).await;
    assert_eq!(stats["db_locked"], 1);
    assert_eq!(stats["redis_available"], 9);
}

/// A `seckill consume` process over this test's database and prefixes,
/// killed when dropped.
struct Worker(std::process::Child);

impl Worker {
    fn start(app: &TestApp, args: &[&str]) -> Self {
        let child = app
            .seckill_command(&[&["consume"], args].concat())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("seckill consume starts");
        Self(child)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn an_api_only_server_and_a_consume_worker_cover_orders_stock_releases_and_coupon_claims() {
    // `serve --no-consumer`: none of the three consumers runs in the server.
    let app = spawn_app_with(|s| {
        crate::helpers::without_order_consumer(s);
        s.workers.releaser_enabled = false;
        s.workers.claimer_enabled = false;
    })
    .await;
    let _worker = Worker::start(&app, &[]);

    // Coupon claims are written by the worker.
    let coupon = crate::coupons::create_coupon(&app, 5, 100, 0, 3600).await;
    assert_eq!(crate::coupons::claim(&app, 1, coupon, "c1").await.0, 202);
    crate::coupons::claims_written(&app, coupon, 1).await;

    // Orders are created by the worker.
    let activity = app.live_activity(5, 1, 1).await;
    let (status, body) = app.buy(1, activity).await;
    assert_eq!(status, 202, "{body}");
    app.drained(activity, 1).await;

    // A cancelled order's unit goes back to Redis through the worker's
    // stock releaser.
    let number = body["order_no"].as_str().unwrap();
    assert_eq!(app.cancel(1, number).await.status(), 200);
    let stats = app
        .wait_for_stats(activity, |s| {
            s["redis_available"] == 5 && s["reservations_open"] == 0
        })
        .await;
    assert_eq!(stats["db_available"], 5);
    assert_eq!(stats["orders"]["CANCELLED"], 1);
}

/// Admissions an instance at `base` answered, of every outcome (its
/// `/metrics`).
async fn admissions_at(base: &str) -> i64 {
    crate::helpers::metric_sum_at(base, "seckill_admission_total").await
}

/// The multi-instance deployment of docs/OPERATIONS.md on loopback: two
/// `serve --no-consumer` instances (this test's server and a second
/// process) and one `seckill consume`, sharing Kafka, PostgreSQL and Redis
/// (the 3-master cluster when `scripts/test.sh` runs it). `seckill
/// loadgen` spreads 20,000 buyers over both for 1,000 units and checks the
/// invariants from outside; the test checks them again from inside.
#[tokio::test]
#[ignore = "20,000 buyers: scripts/test.sh runs it alone, on the Redis Cluster"]
async fn two_api_instances_and_a_worker_sell_a_thousand_units_to_twenty_thousand_buyers_exactly() {
    let app = spawn_app_with(|s| {
        crate::helpers::without_order_consumer(s);
        s.workers.releaser_enabled = false;
        s.workers.claimer_enabled = false;
    })
    .await;
    let (_second, second) = app.second_instance().await;
    let _worker = Worker::start(&app, &[]);

    let loadgen = app.seckill_command(&[
        "loadgen",
        "--json",
        "--url",
        &app.address,
        "--url",
        &second,
        "--users",
        "20000",
        "--stock",
        "1000",
        "--concurrency",
        "64",
        "--drain-timeout",
        "300",
    ]);
    let output = tokio::task::spawn_blocking(move || {
        let mut loadgen = loadgen;
        loadgen.output()
    })
    .await
    .unwrap()
    .expect("seckill loadgen runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let report: serde_json::Value = stdout
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| {
            panic!(
                "no report: {stdout}\n{}",
                String::from_utf8_lossy(&output.stderr)
            )
        });
    assert!(output.status.success(), "{report}");
    assert_eq!(report["invariants_ok"], true, "{report}");
    assert_eq!(report["accepted"], 1000, "{report}");
    assert_eq!(report["requests"], 20000, "{report}");

    // From inside: each order once, the stock all locked, Redis = DB.
    let activity = report["activity_id"].as_i64().unwrap();
    let stats = app.drained(activity, 1000).await;
    app.assert_each_order_once(&stats, 1000).await;
    assert_eq!(stats["db_available"], 0);
    assert_eq!(
        app.count(&format!(
            "SELECT count(DISTINCT (user_id)) AS n FROM orders WHERE activity_id = {activity}"
        ))
        .await,
        1000
    );
    // Both instances took buyers.
    let (first, other) = (
        admissions_at(&app.address).await,
        admissions_at(&second).await,
    );
    assert!(first >= 5_000 && other >= 5_000, "{first} / {other}");
}

/// Redis restarted empty while an instance holds id 7 (here: this test's
/// lease keys deleted): another process asking for 7 must not get it
/// while the holder may still be minting under it, and the holder keeps
/// its id and goes on selling under it.
#[tokio::test]
async fn an_id_redis_forgot_is_not_leased_again_while_its_holder_may_still_mint() {
    use std::sync::Arc;

    use seckill::ids::{InstanceLease, LeaseError, LeasedIds};

    let a = spawn_app_with(|s| {
        s.app.instance_id = Some(7);
        s.app.instance_lease_secs = std::time::Duration::from_secs(2);
    })
    .await;
    assert_eq!(a.metric("seckill_instance_id").await, Some(7));
    let prefix = a.settings.redis.key_prefix.clone();
    let key = format!("{prefix}{{instance:7}}");
    let mut redis = a.redis();
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .arg(format!("{key}:floor"))
        .query_async(&mut redis)
        .await
        .unwrap();
    // Another process wants 7 at once, finding it free in Redis.
    let other_ids = Arc::new(LeasedIds::default());
    let other = InstanceLease::new(
        a.redis(),
        seckill::store::pool(&a.settings.postgres),
        &prefix,
        Some(7),
        Duration::from_secs(2),
        other_ids.clone(),
        prometheus::IntGauge::new("other_instance_id", "the other lease").unwrap(),
    );
    match other.acquire().await {
        Err(LeaseError::Taken(_)) => {}
        Ok(id) => panic!("id {id} leased twice: both may mint the same numbers"),
        Err(e) => panic!("unexpected: {e:?}"),
    }
    assert_eq!(other_ids.instance(), None);
    // The holder renews into an empty Redis, takes its own id back (its
    // fence is still its own) and sells under it.
    eventually(
        "the holder holds 7 again",
        Duration::from_secs(30),
        || async { (a.metric("seckill_instance_id").await == Some(7)).then_some(()) },
    )
    .await;
    let activity = a.live_activity(5, 1, 1).await;
    let (status, body) = eventually("a purchase under 7", Duration::from_secs(30), || async {
        let (status, body) = a.buy(1, activity).await;
        (status == 202 || status == 200).then_some((status, body))
    })
    .await;
    assert_eq!(instance_of(order_no(&body)), 7, "{status} {body}");
}

/// An instance holding no order-number lease (every id taken by others)
/// mints nothing: a new purchase is 503. A retry of a purchase it already
/// admitted needs no number, and gets its order (200, the same number),
/// not the 503.
#[tokio::test]
async fn a_retry_of_an_admitted_purchase_is_answered_without_an_order_number() {
    let a = spawn_app_with(|s| s.app.instance_lease_secs = std::time::Duration::from_secs(2)).await;
    let activity = a.live_activity(5, 1, 1).await;
    let (status, first) = a.buy_as(1, activity, "kept").await;
    assert_eq!(status, 202, "{first}");
    // Every id is someone else's: the lease is lost and none is free.
    // One command per key: each id's key has a slot of its own on a
    // cluster, where a pipeline across slots is refused.
    let mut redis = a.redis();
    for id in 0..=seckill::ids::MAX_LEASED_INSTANCE {
        let key = format!("{}{{instance:{id}}}", a.settings.redis.key_prefix);
        let _: () = redis::cmd("SET")
            .arg(key)
            .arg("someone-else")
            .arg("PX")
            .arg(120_000)
            .query_async(&mut redis)
            .await
            .unwrap();
    }
    eventually("the lease lost", Duration::from_secs(30), || async {
        (a.metric("seckill_instance_id").await == Some(-1)).then_some(())
    })
    .await;
    let (status, body) = a.attempt(2, activity, "new").await;
    assert_eq!(status, 503, "no number for a new purchase: {body}");
    let (status, replay) = a.attempt(1, activity, "kept").await;
    assert_eq!(status, 200, "{replay}");
    assert_eq!(replay["order_no"], first["order_no"]);
}
