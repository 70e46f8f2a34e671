//! The sold-out fast path (admission/soldout.rs): after Redis said
//! SOLD_OUT, an instance answers from memory without a Redis call, buyers
//! who have an order still reach Redis, and a release clears the flag on
//! every instance so the next buyer gets the unit. Flags here live ten
//! minutes, so only the release's message can clear them.

use std::time::Duration;

use seckill::admission::{Admission, RedisGate, ReserveRequest};
use seckill::domain::ActivityId;

use crate::helpers::{TestApp, eventually, spawn_app_with};

const FROM_MEMORY: &str = "seckill_admission_total{outcome=\"sold_out_memory\"}";
const SCRIPT_CALLS: &str = "seckill_admission_script_seconds_count";
const RECOUNTS: &str = "seckill_sold_out_recounts_total";

async fn app_with_long_flags() -> TestApp {
    spawn_app_with(|s| s.admission.sold_out_ttl_ms = std::time::Duration::from_millis(600_000))
        .await
}

/// Buys until Redis has said SOLD_OUT and this instance flagged the
/// activity; buyers from `first` on, one each.
async fn flagged(app: &TestApp, activity: i64, first: i64) {
    let mut buyer = first;
    eventually(
        "the activity flagged sold out",
        Duration::from_secs(30),
        || {
            buyer += 1;
            let buyer = buyer;
            async move {
                let (status, body) = app.buy(buyer, activity).await;
                assert_eq!((status, body["code"].as_str()), (409, Some("SOLD_OUT")));
                (app.metric("seckill_sold_out_activities").await == Some(1)).then_some(())
            }
        },
    )
    .await;
}

#[tokio::test]
async fn sold_out_answers_come_from_memory_without_a_redis_call_and_buyers_with_orders_still_reach_redis()
 {
    let app = app_with_long_flags().await;
    let activity = app.live_activity(2, 1, 1).await;
    let orders = app.buy_as_r_user(activity, 1..=2).await;
    flagged(&app, activity, 100).await;

    let calls = app.metric(SCRIPT_CALLS).await.unwrap();
    let answered = app.metric(FROM_MEMORY).await.unwrap_or(0);
    let reads = app.metric(RECOUNTS).await.unwrap_or(0);
    for buyer in 200..210 {
        let (status, body) = app.buy(buyer, activity).await;
        assert_eq!((status, body["code"].as_str()), (409, Some("SOLD_OUT")));
    }
    assert_eq!(
        app.metric(SCRIPT_CALLS).await.unwrap(),
        calls,
        "no Redis call"
    );
    assert_eq!(app.metric(FROM_MEMORY).await.unwrap(), answered + 10);
    // Each refusal waited for a read of the acceptance count (one at a
    // time here: at most one each).
    let reads = app.metric(RECOUNTS).await.unwrap() - reads;
    assert!((1..=10).contains(&reads), "{reads} reads for 10 refusals");

    // A buyer with an order: the replay gets it, a new purchase hears
    // LIMIT_EXCEEDED; both from Redis.
    let (status, replay) = app.replay_as_r_user(activity, 1).await;
    assert_eq!(status, 200, "{replay}");
    assert_eq!(replay["order_no"], orders[0].as_str());
    let (status, body) = app.buy(2, activity).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("LIMIT_EXCEEDED"))
    );
    assert_eq!(app.metric(SCRIPT_CALLS).await.unwrap(), calls + 2);
}

#[tokio::test]
async fn a_unit_released_after_the_sell_out_goes_to_the_next_buyer() {
    let app = app_with_long_flags().await;
    let activity = app.live_activity(1, 1, 1).await;
    let orders = app.buy_as_r_user(activity, 1..=1).await;
    flagged(&app, activity, 100).await;
    app.drained(activity, 1).await;

    // The cancel's release announces the unit; every instance's flag goes.
    assert_eq!(app.cancel(1, &orders[0]).await.status(), 200);
    eventually("the flag cleared", Duration::from_secs(60), || async {
        (app.metric("seckill_sold_out_activities").await == Some(0)).then_some(())
    })
    .await;
    let (status, body) = app.buy(300, activity).await;
    assert_eq!(status, 202, "{body}");
    let stats = app.drained(activity, 1).await;
    assert_eq!(stats["redis_available"], 0);
    assert_eq!(stats["orders"]["CANCELLED"], 1);
}

#[tokio::test]
async fn a_flag_in_use_does_not_lapse_while_the_activity_stays_sold_out() {
    // Flags live 2 s. Without a refresh, the first purchase after each
    // lapse went to Redis (and, under load, every purchase until one was
    // answered SOLD_OUT); refreshed every second while in use, none does.
    let app =
        spawn_app_with(|s| s.admission.sold_out_ttl_ms = std::time::Duration::from_secs(2)).await;
    let activity = app.live_activity(1, 1, 1).await;
    app.buy_as_r_user(activity, 1..=1).await;
    flagged(&app, activity, 100).await;

    let calls = app.metric(SCRIPT_CALLS).await.unwrap();
    let started = std::time::Instant::now();
    let mut buyer = 1_000;
    // Three and a half lifetimes of purchases, one every 100 ms.
    while started.elapsed() < Duration::from_millis(7_000) {
        buyer += 1;
        let (status, body) = app.buy(buyer, activity).await;
        assert_eq!((status, body["code"].as_str()), (409, Some("SOLD_OUT")));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        app.metric(SCRIPT_CALLS).await.unwrap(),
        calls,
        "no purchase reached Redis: the flag never lapsed ({} purchases)",
        buyer - 1_000
    );
}

#[tokio::test]
async fn a_buyer_accepted_elsewhere_before_the_release_is_heard_here_gets_their_order_on_a_retry() {
    // A unit comes back and another instance sells it before this one has
    // heard the release: this flag's list of buyers is late by one. The
    // buyer's retry here must be told the order, never SOLD_OUT.
    let app = app_with_long_flags().await;
    let activity = app.live_activity(1, 1, 1).await;
    app.buy_as_r_user(activity, 1..=1).await;
    flagged(&app, activity, 100).await;

    // The unit a release put back, its message not heard here: straight
    // into the stock bucket, nothing published. A real release frees the
    // unit in the database first, so the database gets it too; without it
    // buyer 500's order would fail for want of stock and hand the unit
    // back to Redis, where buyer 501 could take it.
    app.execute(&format!(
        "UPDATE stock SET total = total + 1, available = available + 1 \
         WHERE activity_id = {activity}"
    ))
    .await;
    let prefix = &app.settings.redis.key_prefix;
    let _: i64 = redis::cmd("INCRBY")
        .arg(format!("{prefix}{{a:{activity}}}:stock:0"))
        .arg(1)
        .query_async(&mut app.redis())
        .await
        .unwrap();
    assert_eq!(
        app.metric("seckill_sold_out_activities").await,
        Some(1),
        "still flagged here"
    );
    // Another instance's script accepts buyer 500 for it.
    let gate = RedisGate::new(&app.settings.redis, &app.settings.admission, None).unwrap();
    let token = app.purchase_token(500, activity).await;
    let order_no = 880_000_500;
    let accepted = gate
        .reserve(&ReserveRequest {
            activity_id: ActivityId::new(activity),
            user_id: 500,
            request_id: "r500",
            token: &token,
            quantity: 1,
            order_no,
            layout: seckill::admission::Layout::single(1),
            now_ms: chrono::Utc::now().timestamp_millis(),
            coupon_id: None,
        })
        .await
        .unwrap();
    assert_eq!(accepted, Admission::Accepted(order_no));

    // Buyer 500's retry here gets that order (202: this replay is what
    // delivers its event, which the script alone did not send); a new
    // buyer still hears SOLD_OUT (from Redis now: the count moved).
    let (status, replay) = app.replay_as_r_user(activity, 500).await;
    assert_eq!(status, 202, "{replay}");
    assert_eq!(replay["order_no"], order_no.to_string());
    let (status, body) = app.buy(501, activity).await;
    assert_eq!((status, body["code"].as_str()), (409, Some("SOLD_OUT")));
    // Buyer 500's order stands on the unit; nothing went back.
    app.wait_for_stats(activity, |s| s["orders"]["WAITING_PAY"] == 2)
        .await;
    let (status, body) = app.buy(502, activity).await;
    assert_eq!((status, body["code"].as_str()), (409, Some("SOLD_OUT")));
}
