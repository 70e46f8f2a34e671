//! The outbox relay: nothing lost while the broker is down, several relays
//! at once, and the Redis release applied once (SPEC step 7, I5).

use std::collections::HashSet;
use std::time::Duration;

use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use seckill::bus::{Topics, client_config};
use seckill::outbox::relay;
use seckill::state::AppState;

use crate::helpers::{TestApp, eventually, spawn_app_with};

/// The outbox path alone: no relay in the server (the test starts its
/// own), and no periodic reconciliation, which would give released units
/// back itself.
fn relay_by_hand(settings: &mut seckill::config::Settings) {
    settings.workers.relay_enabled = false;
    settings.reconcile.enabled = false;
}

async fn cancel_all(app: &TestApp, orders: &[(i64, String)]) {
    for (user, order_no) in orders {
        assert_eq!(app.cancel(*user, order_no).await.status(), 200);
    }
}

async fn outbox_count(app: &TestApp, status: &str) -> i64 {
    app.count(&format!(
        "SELECT count(*) AS n FROM outbox WHERE topic = 'stock.released' AND status = '{status}'"
    ))
    .await
}

#[tokio::test]
async fn with_the_broker_down_released_stock_waits_in_the_outbox_and_is_applied_once_when_it_is_back()
 {
    let app = spawn_app_with(relay_by_hand).await;
    let activity = app.live_activity(10, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 5).await;
    cancel_all(&app, &orders).await;
    assert_eq!(outbox_count(&app, "NEW").await, 5);

    // A relay whose broker is unreachable, and which would give a row up
    // after a single real refusal.
    let mut down = app.settings.clone();
    down.kafka.brokers = "127.0.0.1:1".into();
    down.kafka.timeout_ms = std::time::Duration::from_millis(500);
    down.kafka.message_timeout_ms = std::time::Duration::from_millis(1000);
    down.workers.relay_max_attempts = 1;
    let dead_relay = relay::spawn(AppState::connect(down).unwrap().relay());
    eventually("rows moved to RETRY", Duration::from_secs(30), || async {
        (outbox_count(&app, "RETRY").await == 5).then_some(())
    })
    .await;
    // Every row goes through another pass against the unreachable broker.
    let first_pass = app
        .count("SELECT (extract(epoch FROM max(next_attempt_at)) * 1000)::bigint AS n FROM outbox")
        .await;
    let again = format!(
        "SELECT count(*) AS n FROM outbox \
         WHERE extract(epoch FROM next_attempt_at) * 1000 > {first_pass}"
    );
    eventually(
        "every row retried again",
        Duration::from_secs(30),
        || async { (app.count(&again).await == 5).then_some(()) },
    )
    .await;
    dead_relay.stop().await;
    let errors_seen = "SELECT count(*) AS n FROM outbox WHERE last_error IS NOT NULL";
    assert_eq!(app.count(errors_seen).await, 5);
    assert_eq!(outbox_count(&app, "SENT").await, 0);
    assert_eq!(
        outbox_count(&app, "DEAD").await,
        0,
        "an outage is not a refusal"
    );
    assert_eq!(
        app.count("SELECT max(attempts)::bigint AS n FROM outbox")
            .await,
        0,
        "an unreachable broker counts no attempt"
    );
    assert_eq!(
        app.count("SELECT count(*) AS n FROM outbox").await,
        5,
        "nothing lost"
    );
    let stats = app.stats(activity).await;
    assert_eq!(stats["db_available"], 10);
    assert_eq!(stats["redis_available"], 5, "Redis waits for the events");

    // The broker is reachable again.
    let live_relay = relay::spawn(AppState::connect(app.settings.clone()).unwrap().relay());
    let stats = app
        .wait_for_stats(activity, |s| s["redis_available"] == 10)
        .await;
    live_relay.stop().await;
    assert_eq!(outbox_count(&app, "SENT").await, 5);
    assert_eq!(stats["db_available"], 10);
    app.caught_up("stock-releaser", "stock.released").await;
    assert_eq!(
        app.stats(activity).await["redis_available"],
        10,
        "released exactly once"
    );
}

#[tokio::test]
async fn two_relays_at_once_publish_every_event_and_redis_releases_each_once() {
    let app = spawn_app_with(relay_by_hand).await;
    let activity = app.live_activity(20, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 20).await;
    cancel_all(&app, &orders).await;
    assert_eq!(outbox_count(&app, "NEW").await, 20);
    assert_eq!(app.stats(activity).await["redis_available"], 0);

    let a = relay::spawn(AppState::connect(app.settings.clone()).unwrap().relay());
    let b = relay::spawn(AppState::connect(app.settings.clone()).unwrap().relay());
    let stats = app
        .wait_for_stats(activity, |s| s["redis_available"] == 20)
        .await;
    a.stop().await;
    b.stop().await;
    assert_eq!(outbox_count(&app, "SENT").await, 20);
    assert_eq!(stats["db_available"], 20);
    app.caught_up("stock-releaser", "stock.released").await;
    assert_eq!(
        app.stats(activity).await["redis_available"],
        20,
        "never more than was released"
    );

    // Every event is on the topic (at least once).
    let topics = Topics::new(&app.settings.kafka.topic_prefix);
    let reader: StreamConsumer = client_config(&app.settings.kafka)
        .set(
            "group.id",
            format!("{}reader", app.settings.kafka.topic_prefix),
        )
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    reader.subscribe(&[&topics.stock_released]).unwrap();
    let mut seen = HashSet::new();
    while seen.len() < 20 {
        let m = tokio::time::timeout(Duration::from_secs(20), reader.recv())
            .await
            .expect("events")
            .unwrap();
        let event: serde_json::Value = serde_json::from_slice(m.payload().unwrap()).unwrap();
        seen.insert(event["event_id"].as_str().unwrap().to_owned());
    }
    let expected: HashSet<String> = orders.iter().map(|(_, o)| format!("release-{o}")).collect();
    assert_eq!(seen, expected);
    let _ = tokio::task::spawn_blocking(move || drop(reader)).await;
}

#[tokio::test]
async fn dead_rows_are_listed_and_an_operator_command_puts_them_back_to_be_published() {
    let app = spawn_app_with(relay_by_hand).await;
    let activity = app.live_activity(10, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 3).await;
    cancel_all(&app, &orders).await;
    // As if the broker had refused them relay_max_attempts times.
    app.execute(
        "UPDATE outbox SET status = 'DEAD', attempts = 20, last_error = 'refused' \
         WHERE topic = 'stock.released'",
    )
    .await;
    assert_eq!(outbox_count(&app, "DEAD").await, 3);

    let listed = app.seckill(&["outbox", "dead"]);
    assert!(listed.status.success(), "{listed:?}");
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(rows.len(), 3);
    assert!(rows.iter().all(|r| r["last_error"] == "refused"));

    let first = rows[0]["id"].as_i64().unwrap().to_string();
    let one = app.seckill(&["outbox", "requeue", "--id", &first]);
    assert!(one.status.success(), "{one:?}");
    assert_eq!(outbox_count(&app, "DEAD").await, 2);
    let rest = app.seckill(&["outbox", "requeue", "--all"]);
    assert!(rest.status.success(), "{rest:?}");
    assert_eq!(outbox_count(&app, "NEW").await, 3);
    assert_eq!(
        app.count("SELECT max(attempts)::bigint AS n FROM outbox")
            .await,
        0
    );

    // A relay publishes them, and Redis gets the units back once.
    let relay = relay::spawn(AppState::connect(app.settings.clone()).unwrap().relay());
    let stats = app
        .wait_for_stats(activity, |s| s["redis_available"] == 10)
        .await;
    relay.stop().await;
    assert_eq!(outbox_count(&app, "SENT").await, 3);
    assert_eq!(stats["db_available"], 10);
}
