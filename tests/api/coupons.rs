//! Coupons: atomic claims without over-issue, one per user, used and
//! released with the order (I8, and I1 alongside).

use std::time::Duration;

use futures_util::{StreamExt, stream};
use serde_json::json;

use crate::helpers::{TestApp, eventually, json, spawn_app, spawn_app_with};

pub(crate) async fn create_coupon(
    app: &TestApp,
    total: i32,
    discount: i64,
    min: i64,
    valid_secs: i64,
) -> i64 {
    let body = json!({"name": "Spring", "total": total, "discount_cents": discount,
        "min_amount_cents": min, "per_user_limit": 1,
        "valid_until": chrono::Utc::now() + chrono::Duration::seconds(valid_secs)});
    let res = app
        .post_json("/api/v1/admin/coupons", &body, Some(&app.admin_token()))
        .await;
    assert_eq!(res.status(), 201);
    json(res).await["coupon_id"].as_i64().unwrap()
}

/// One claim, no retry.
async fn claim_once(
    app: &TestApp,
    user: i64,
    coupon: i64,
    request_id: &str,
) -> (u16, serde_json::Value) {
    let res = app
        .post_json(
            &format!("/api/v1/coupons/{coupon}/claim"),
            &json!({"request_id": request_id}),
            Some(&app.user_token(user)),
        )
        .await;
    (res.status().as_u16(), json(res).await)
}

/// A claim as a client makes it: a 503 is retried with the same
/// request_id for up to a minute; a 200 after such a retry is the claim
/// accepted (reported as 202).
pub(crate) async fn claim(
    app: &TestApp,
    user: i64,
    coupon: i64,
    request_id: &str,
) -> (u16, serde_json::Value) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut retried = false;
    loop {
        let (status, body) = claim_once(app, user, coupon, request_id).await;
        if status == 503 && std::time::Instant::now() < deadline {
            retried = true;
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            continue;
        }
        return (
            if retried && status == 200 {
                202
            } else {
                status
            },
            body,
        );
    }
}

async fn coupon_stats(app: &TestApp, coupon: i64) -> serde_json::Value {
    json(
        app.get(
            &format!("/api/v1/admin/coupons/{coupon}/stats"),
            Some(&app.admin_token()),
        )
        .await,
    )
    .await
}

async fn mine(app: &TestApp, user: i64) -> Vec<serde_json::Value> {
    let body = json(
        app.get("/api/v1/coupons/mine", Some(&app.user_token(user)))
            .await,
    )
    .await;
    body["coupons"].as_array().unwrap().clone()
}

/// Waits until the claims consumer has written `n` rows for the batch.
pub(crate) async fn claims_written(app: &TestApp, coupon: i64, n: i64) -> serde_json::Value {
    let what = format!("{n} claims written");
    crate::helpers::eventually(&what, Duration::from_secs(30), || async {
        let s = coupon_stats(app, coupon).await;
        (s["db_claimed"] == n).then_some(s)
    })
    .await
}

#[tokio::test]
async fn four_hundred_claims_from_three_hundred_users_for_fifty_coupons_issue_exactly_fifty() {
    let app = spawn_app().await;
    let coupon = create_coupon(&app, 50, 500, 0, 3600).await;
    // Users 1..=300 claim once; users 1..=100 claim a second time with a new request_id.
    let attempts: Vec<(i64, String)> = (1..=300)
        .map(|u| (u, format!("a-{u}")))
        .chain((1..=100).map(|u| (u, format!("b-{u}"))))
        .collect();
    let results: Vec<(u16, serde_json::Value)> = stream::iter(attempts)
        .map(|(user, req)| {
            let app = &app;
            async move { claim(app, user, coupon, &req).await }
        })
        .buffer_unordered(100)
        .collect()
        .await;
    assert_eq!(results.iter().filter(|(s, _)| *s == 202).count(), 50);
    for (status, body) in &results {
        assert!(
            *status == 202
                || (*status == 409
                    && (body["code"] == "COUPON_EXHAUSTED" || body["code"] == "ALREADY_CLAIMED")),
            "{status} {body}"
        );
    }
    let stats = claims_written(&app, coupon, 50).await;
    assert_eq!(stats["redis_remaining"], 0);
    assert_eq!(stats["user_coupons"]["UNUSED"], 50);
    assert_eq!(
        app.count("SELECT count(*) AS n FROM user_coupons").await,
        50
    );
    assert_eq!(
        app.count("SELECT count(DISTINCT user_id) AS n FROM user_coupons")
            .await,
        50
    );
}

#[tokio::test]
async fn one_user_gets_one_coupon_and_a_replayed_request_id_answers_the_same() {
    let app = spawn_app().await;
    let coupon = create_coupon(&app, 10, 500, 0, 3600).await;
    let different: Vec<(u16, serde_json::Value)> = stream::iter(0..20)
        .map(|i| {
            let app = &app;
            async move { claim(app, 7, coupon, &format!("r-{i}")).await }
        })
        .buffer_unordered(20)
        .collect()
        .await;
    assert_eq!(different.iter().filter(|(s, _)| *s == 202).count(), 1);
    assert!(
        different
            .iter()
            .filter(|(s, _)| *s != 202)
            .all(|(s, b)| *s == 409 && b["code"] == "ALREADY_CLAIMED")
    );

    let same: Vec<(u16, serde_json::Value)> = stream::iter(0..20)
        .map(|_| {
            let app = &app;
            async move { claim_once(app, 8, coupon, "only-once").await }
        })
        .buffer_unordered(20)
        .collect()
        .await;
    // One claim, the rest replays of it. A broker too slow for the publish
    // budget may leave an answer unconfirmed (503, to be retried).
    let unconfirmed = same.iter().filter(|(s, _)| *s == 503).count();
    let fresh = same.iter().filter(|(s, _)| *s == 202).count();
    assert!(fresh <= 1, "{same:?}");
    if unconfirmed == 0 {
        assert_eq!(fresh, 1, "{same:?}");
    }
    assert_eq!(
        same.iter().filter(|(s, _)| *s == 200).count(),
        20 - fresh - unconfirmed
    );
    assert!(
        same.iter()
            .filter(|(s, _)| *s != 503)
            .all(|(_, b)| b["status"] == "CLAIMED" && b["coupon_id"] == coupon)
    );
    assert!(
        same.iter()
            .filter(|(s, _)| *s == 503)
            .all(|(_, b)| b["code"] == "RETRY_LATER")
    );
    let (status, again) = claim(&app, 8, coupon, "only-once").await;
    assert!(matches!(status, 200 | 202), "a replay: {status} {again}");

    let stats = claims_written(&app, coupon, 2).await;
    assert_eq!(stats["redis_remaining"], 8);
    assert_eq!(
        mine(&app, 8).await,
        vec![json!({"coupon_id": coupon, "status": "UNUSED", "order_no": null})]
    );
}

/// Buys with a coupon as `user`: (status, body).
async fn buy_with_coupon(
    app: &TestApp,
    user: i64,
    activity: i64,
    coupon: i64,
    request_id: &str,
) -> (u16, serde_json::Value) {
    // A 503 that kept nothing (no `order_no`: the broker refused the event
    // on a starved host, say) used its token up: start over with a new
    // one, for up to a minute, as `TestApp::order_as_r_user` does.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let token = app.purchase_token(user, activity).await;
        let body = json!({"request_id": request_id, "token": token, "coupon_id": coupon});
        let (status, answer) = app.order_retrying(user, activity, &body).await;
        let nothing_kept = status == 503 && answer["order_no"].is_null();
        if nothing_kept && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        return (status, answer);
    }
}

#[tokio::test]
async fn an_order_with_a_coupon_is_discounted_locks_it_uses_it_on_pay_and_a_second_order_cannot_share_it()
 {
    let app = spawn_app().await;
    let coupon = create_coupon(&app, 5, 1500, 5000, 3600).await;
    assert_eq!(claim(&app, 1, coupon, "c").await.0, 202);
    claims_written(&app, coupon, 1).await;
    // Limit 2, so one user can race two orders that both name the coupon.
    let activity = app.live_activity(10, 2, 1).await;
    let (t1, t2) = (
        app.purchase_token(1, activity).await,
        app.purchase_token(1, activity).await,
    );
    let first = json!({"request_id": "o1", "token": t1, "coupon_id": coupon});
    let second = json!({"request_id": "o2", "token": t2, "coupon_id": coupon});
    let ((sa, a), (sb, b)) = tokio::join!(
        app.order_retrying(1, activity, &first),
        app.order_retrying(1, activity, &second)
    );
    // Decided at admission: one is taken, the other refused before any
    // 202, never FAILED after one (I4).
    let mut answers = [(sa, a), (sb, b)];
    answers.sort_by_key(|(status, _)| *status);
    let [(taken, holder), (refused, why)] = answers;
    assert_eq!((taken, refused), (202, 400), "{holder} {why}");
    assert_eq!(why["code"], "COUPON_INVALID", "{why}");
    let stats = app
        .wait_for_stats(activity, |s| {
            s["reservations_open"] == 0 && s["orders"]["WAITING_PAY"] == 1
        })
        .await;
    assert_eq!(stats["orders"]["FAILED"], 0, "{stats}");
    let no = holder["order_no"].as_str().unwrap();
    let holder = json(
        app.get(&format!("/api/v1/orders/{no}"), Some(&app.user_token(1)))
            .await,
    )
    .await;
    assert_eq!(holder["amount_cents"], 9900 - 1500);
    assert_eq!(holder["coupon_id"], coupon);
    // I1: the refused purchase's unit is back in Redis; the DB never moved it.
    assert_eq!(stats["redis_available"], 9);
    assert_eq!(stats["db_available"], 9);
    assert_eq!(stats["db_locked"], 1);
    // I8: the coupon backs exactly the live order.
    let held = mine(&app, 1).await;
    assert_eq!(
        held,
        vec![json!({"coupon_id": coupon, "status": "LOCKED", "order_no": holder["order_no"]})]
    );

    let holder_no = holder["order_no"].as_str().unwrap();
    let payment = json(app.pay(1, holder_no).await).await;
    assert_eq!(payment["amount_cents"], 8400);
    let (body, sig) = app.signed_callback(&payment, "SUCCESS", 8400, None, 0);
    assert_eq!(app.notify(body, Some(&sig)).await.status(), 200);
    assert_eq!(mine(&app, 1).await[0]["status"], "USED");
    assert_eq!(coupon_stats(&app, coupon).await["user_coupons"]["USED"], 1);

    // Used: another order with it is refused at admission too.
    let other = app.live_activity(10, 1, 1).await;
    let (status, body) = buy_with_coupon(&app, 1, other, coupon, "o3").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("COUPON_INVALID")),
        "{body}"
    );
    assert_eq!(app.stats(other).await["redis_available"], 10);
}

#[tokio::test]
async fn below_the_minimum_amount_a_purchase_is_refused_at_admission_and_keeps_its_coupon_free() {
    let app = spawn_app().await;
    let coupon = create_coupon(&app, 5, 500, 100_000, 3600).await;
    assert_eq!(claim(&app, 1, coupon, "c").await.0, 202);
    let activity = app.live_activity(10, 1, 1).await;
    // 9,900 cents is below the coupon's 100,000: refused before any 202,
    // never accepted and then FAILED (I4).
    let (status, body) = buy_with_coupon(&app, 1, activity, coupon, "o").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("COUPON_INVALID")),
        "{body}"
    );
    assert!(
        body["message"]
            .as_str()
            .unwrap_or_default()
            .contains("minimum")
            || body.to_string().contains("minimum"),
        "{body}"
    );
    let stats = app.stats(activity).await;
    assert_eq!(stats["redis_available"], 10, "nothing reserved: {stats}");
    assert_eq!(stats["reservations_open"], 0);
    assert_eq!(stats["orders"]["FAILED"], 0);
    claims_written(&app, coupon, 1).await;
    assert_eq!(mine(&app, 1).await[0]["status"], "UNUSED");
    // The request id was not kept: the same one buys without the coupon.
    let token = app.purchase_token(1, activity).await;
    let (status, body) = app
        .order_retrying(1, activity, &json!({"request_id": "o", "token": token}))
        .await;
    assert_eq!(status, 202, "{body}");
}

#[tokio::test]
async fn cancel_and_timeout_each_return_the_coupon_exactly_once() {
    let app =
        spawn_app_with(|s| s.workers.closer_interval_ms = std::time::Duration::from_millis(200))
            .await;
    let coupon = create_coupon(&app, 5, 500, 0, 3600).await;
    for user in [1, 2] {
        assert_eq!(claim(&app, user, coupon, "c").await.0, 202);
    }
    claims_written(&app, coupon, 2).await;

    // Cancel, ten times at once.
    let activity = app.live_activity(10, 1, 1).await;
    let (status, body) = buy_with_coupon(&app, 1, activity, coupon, "o").await;
    assert_eq!(status, 202, "{body}");
    app.drained(activity, 1).await;
    assert_eq!(mine(&app, 1).await[0]["status"], "LOCKED");
    let no = body["order_no"].as_str().unwrap().to_owned();
    let cancels: Vec<u16> = stream::iter(0..10)
        .map(|_| {
            let (app, no) = (&app, no.clone());
            async move {
                // A 503 (no database connection within its timeout on a
                // starved host) says to come back: a client does.
                let deadline = std::time::Instant::now() + Duration::from_secs(60);
                loop {
                    let status = app.cancel(1, &no).await.status().as_u16();
                    if status != 503 || std::time::Instant::now() >= deadline {
                        return status;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        })
        .buffer_unordered(10)
        .collect()
        .await;
    assert!(cancels.iter().all(|s| *s == 200), "{cancels:?}");
    assert_eq!(
        mine(&app, 1).await,
        vec![json!({"coupon_id": coupon, "status": "UNUSED", "order_no": null})]
    );
    assert_eq!(
        app.count("SELECT count(*) AS n FROM stock_flow WHERE biz_type = 'RELEASE'")
            .await,
        1
    );

    // The returned coupon works again (once Redis has the unit and the
    // user's limit back, through stock.released).
    app.wait_for_stats(activity, |s| s["redis_available"] == 10)
        .await;
    let (status, body) = buy_with_coupon(&app, 1, activity, coupon, "again").await;
    assert_eq!(status, 202, "{body}");

    // Timeout.
    let slow = app.live_activity_paying_within(10, 1).await;
    let (status, body) = buy_with_coupon(&app, 2, slow, coupon, "t").await;
    assert_eq!(status, 202, "{body}");
    let stats = app
        .wait_for_stats(slow, |s| s["orders"]["CLOSED"] == 1)
        .await;
    assert_eq!(stats["db_locked"], 0);
    assert_eq!(
        mine(&app, 2).await,
        vec![json!({"coupon_id": coupon, "status": "UNUSED", "order_no": null})]
    );
}

#[tokio::test]
async fn an_expired_batch_is_409_and_someone_elses_coupon_on_an_order_is_400() {
    let app = spawn_app().await;
    let short = create_coupon(&app, 5, 500, 0, 2).await;
    app.clock.advance(Duration::from_millis(2500));
    let (status, body) = claim(&app, 1, short, "x").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("COUPON_EXPIRED"))
    );

    let coupon = create_coupon(&app, 5, 500, 0, 3600).await;
    assert_eq!(claim(&app, 1, coupon, "c").await.0, 202);
    let activity = app.live_activity(10, 1, 1).await;
    let (status, body) = buy_with_coupon(&app, 2, activity, coupon, "o").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("COUPON_INVALID"))
    );
    assert_eq!(
        app.stats(activity).await["redis_available"],
        10,
        "nothing reserved"
    );

    let (status, _) = claim(&app, 1, 999_999, "x").await;
    assert_eq!(status, 404);
    let res = app
        .post_json(
            "/api/v1/admin/coupons",
            &json!({"name": "x", "total": 0, "discount_cents": 1, "valid_until": chrono::Utc::now() + chrono::Duration::hours(1)}),
            Some(&app.admin_token()),
        )
        .await;
    assert_eq!(res.status(), 400);
    let res = app
        .post_json(
            &format!("/api/v1/coupons/{coupon}/claim"),
            &json!({"request_id": ""}),
            Some(&app.user_token(3)),
        )
        .await;
    assert_eq!(res.status(), 400);
}

#[tokio::test]
async fn with_kafka_unreachable_a_claim_is_503_and_undone() {
    let app = spawn_app_with(|s| crate::helpers::kafka_unreachable(s, 1000)).await;
    let coupon = create_coupon(&app, 5, 500, 0, 3600).await;
    let (status, body) = claim_once(&app, 1, coupon, "c").await;
    assert_eq!((status, body["code"].as_str()), (503, Some("RETRY_LATER")));
    let stats = coupon_stats(&app, coupon).await;
    assert_eq!(stats["redis_remaining"], 5, "the claim was undone");
    // Not "already claimed": the same user may try again.
    let (status, body) = claim_once(&app, 1, coupon, "c").await;
    assert_eq!((status, body["code"].as_str()), (503, Some("RETRY_LATER")));
}

#[tokio::test]
async fn a_claim_cut_off_by_a_shutdown_out_of_time_is_still_undone() {
    // The delivery fails for certain after three seconds; the server is
    // stopped first and gives in-flight requests one second, then drops
    // them. The claim must not stay taken with no event behind it.
    let app = spawn_app_with(|s| {
        crate::helpers::kafka_unreachable(s, 3000);
        s.app.shutdown_timeout_secs = std::time::Duration::from_secs(1);
    })
    .await;
    let coupon = create_coupon(&app, 5, 500, 0, 3600).await;
    let cut_off = {
        let (client, address, token) = (app.client.clone(), app.address.clone(), app.user_token(1));
        tokio::spawn(async move {
            client
                .post(format!("{address}/api/v1/coupons/{coupon}/claim"))
                .bearer_auth(token)
                .json(&json!({"request_id": "cut-off"}))
                .send()
                .await
        })
    };
    // The claim is taken in Redis; its delivery is under way.
    let redis = app.redis();
    let meta = format!("{}{{c:{coupon}}}:meta", app.settings.redis.key_prefix);
    let remaining = |n: i64| {
        let (mut redis, meta) = (redis.clone(), meta.clone());
        async move {
            let left: Option<i64> = redis::cmd("HGET")
                .arg(meta)
                .arg("remaining")
                .query_async(&mut redis)
                .await
                .ok()
                .flatten();
            (left == Some(n)).then_some(())
        }
    };
    crate::helpers::eventually("the claim taken", Duration::from_secs(10), || remaining(4)).await;
    app.server.stop(true).await;
    let answer = cut_off.await.unwrap();
    assert!(
        answer.as_ref().map_or(true, |r| r.status() != 202),
        "{answer:?}"
    );
    crate::helpers::eventually("the claim undone", Duration::from_secs(30), || remaining(5)).await;
}

/// Defect 12 of issue #25: a coupon batch Redis lost (restarted empty,
/// flushed) was never restored, and its claims stopped for good. It is
/// restored from the database like an activity, once what was in flight
/// is written: claims go on, a replay answers as before, a holder cannot
/// claim twice, and no more are issued than the batch has.
#[tokio::test]
async fn a_coupon_batch_redis_lost_is_restored_and_issues_exactly_what_is_left() {
    let app = spawn_app_with(crate::helpers::restores_quickly).await;
    let coupon = create_coupon(&app, 10, 500, 0, 3600).await;
    // Retried with the same request_id while a delivery is unconfirmed,
    // as a client does (a loaded host confirms late).
    for user in 1..=3 {
        let (status, body) = claim(&app, user, coupon, &format!("c{user}")).await;
        assert_eq!(status, 202, "{body}");
    }
    claims_written(&app, coupon, 3).await;

    // Redis loses the batch: every key under its hash tag.
    let pattern = format!("{}{{c:{coupon}}}:*", app.settings.redis.key_prefix);
    assert!(app.forget_keys(&pattern).await > 0);
    // Meanwhile a claim is told to retry (not 404: the batch exists).
    let (status, body) = claim_once(&app, 4, coupon, "c4").await;
    assert!(status == 503 || status == 202, "{status} {body}");

    // Restored by itself: the replay answers as before, a holder is
    // refused, and exactly the 7 left are issued.
    let replay = eventually("the batch restored", Duration::from_secs(60), || async {
        let (status, body) = claim_once(&app, 1, coupon, "c1").await;
        (status != 503).then_some((status, body))
    })
    .await;
    assert_eq!(replay.0, 200, "{}", replay.1);
    let (status, body) = claim(&app, 2, coupon, "another").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("ALREADY_CLAIMED"))
    );
    let mut issued = 0;
    for user in 4..=20 {
        let (status, body) = claim(&app, user, coupon, &format!("c{user}")).await;
        match status {
            202 | 200 => issued += 1,
            409 => assert_eq!(body["code"], "COUPON_EXHAUSTED", "{body}"),
            _ => panic!("user {user}: {status} {body}"),
        }
    }
    assert_eq!(issued, 7, "the 7 left, no more");
    claims_written(&app, coupon, 10).await;
}

#[tokio::test]
async fn reconciliation_frees_a_hold_whose_order_failed_and_holds_what_the_database_locked() {
    let app = spawn_app_with(|s| s.reconcile.enabled = false).await;
    let coupon = create_coupon(&app, 5, 500, 0, 3600).await;
    for user in [1, 2] {
        let (status, body) = claim(&app, user, coupon, "c").await;
        assert_eq!(status, 202, "{body}");
    }
    claims_written(&app, coupon, 2).await;
    let activity = app.live_activity(10, 1, 1).await;
    let gate = seckill::coupons::gate::CouponGate::new(
        seckill::store::redis_conn::RedisClient::new(&app.settings.redis)
            .unwrap()
            .connect_lazy()
            .unwrap(),
        &app.settings.redis.key_prefix,
    );
    let id = seckill::domain::CouponId::new(coupon);
    // User 1's coupon is held for an order that ended FAILED (its process
    // died between the hold and the publish, say): the row says so.
    let (status, bought) = buy_with_coupon(&app, 1, activity, coupon, "o").await;
    assert_eq!(status, 202, "{bought}");
    app.drained(activity, 1).await;
    let order_no: i64 = bought["order_no"].as_str().unwrap().parse().unwrap();
    app.execute(&format!(
        "UPDATE orders SET status = 'FAILED', failure_reason = 'TEST' WHERE order_no = {order_no}"
    ))
    .await;
    app.execute(&format!(
        "UPDATE user_coupons SET status = 'UNUSED', order_no = NULL WHERE order_no = {order_no}"
    ))
    .await;
    // User 2's coupon the database locked (an order of the fallback),
    // unknown to Redis.
    app.execute(&format!(
        "UPDATE user_coupons SET status = 'LOCKED', order_no = 4242 WHERE user_id = 2 AND coupon_id = {coupon}"
    ))
    .await;
    let mut holds = gate.holds_of(id).await.unwrap();
    holds.sort();
    assert_eq!(holds, vec![(1, order_no)]);

    crate::reconcile::reconcile(&app).await;
    assert_eq!(gate.holds_of(id).await.unwrap(), vec![(2, 4242)]);
    // User 1 buys with the coupon again (elsewhere: the FAILED order's
    // unit and limit were changed behind Redis's back); user 2 cannot.
    let activity = app.live_activity(10, 1, 1).await;
    let (status, body) = buy_with_coupon(&app, 1, activity, coupon, "again").await;
    assert_eq!(status, 202, "{body}");
    let (status, body) = buy_with_coupon(&app, 2, activity, coupon, "two").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("COUPON_INVALID")),
        "{body}"
    );
}

/// No reservation open, and the one order written (WAITING_PAY or FAILED).
fn settled_with_one_order(s: &serde_json::Value) -> bool {
    let written = s["orders"]["WAITING_PAY"].as_i64().unwrap_or(0)
        + s["orders"]["FAILED"].as_i64().unwrap_or(0);
    s["reservations_open"] == 0 && s["orders"]["PROCESSING"] == 0 && written == 1
}

/// The claims consumer's writes, counted from its consume log.
async fn claims_consumed(app: &TestApp) -> i64 {
    app.count("SELECT count(*) AS n FROM consume_log WHERE consumer LIKE '%claim%'")
        .await
}

/// A claim answered 202, and a purchase with the coupon at once, before
/// the claims consumer has written the claim's row: the order's own
/// transaction writes it (counted once against the batch), so the 202 is
/// never followed by FAILED. The claim's write, later, adds nothing.
#[tokio::test]
async fn a_coupon_used_before_its_claim_is_written_backs_the_order() {
    let app = spawn_app_with(|s| s.workers.claimer_enabled = false).await;
    let coupon = create_coupon(&app, 5, 1500, 5000, 3600).await;
    assert_eq!(claim(&app, 1, coupon, "c").await.0, 202);
    let activity = app.live_activity(10, 1, 1).await;
    let (status, order) = buy_with_coupon(&app, 1, activity, coupon, "o1").await;
    assert_eq!(status, 202, "{order}");
    let stats = app
        .wait_for_stats(activity, |s| {
            // The order counted too: the figures are read one after
            // another, the database's before Redis's, so a batch committed
            // between the two shows neither its reservation nor its row.
            settled_with_one_order(s)
        })
        .await;
    assert_eq!(
        (&stats["orders"]["WAITING_PAY"], &stats["orders"]["FAILED"]),
        (&json!(1), &json!(0)),
        "{stats}"
    );
    let held = json!([{"coupon_id": coupon, "status": "LOCKED", "order_no": order["order_no"]}]);
    assert_eq!(json!(mine(&app, 1).await), held);
    assert_eq!(coupon_stats(&app, coupon).await["db_claimed"], 1);

    let before = claims_consumed(&app).await;
    let _writer = app.sibling(|s| s.workers.claimer_enabled = true).await;
    eventually("the claim's own write", Duration::from_secs(60), || async {
        (claims_consumed(&app).await > before).then_some(())
    })
    .await;
    assert_eq!(
        coupon_stats(&app, coupon).await["db_claimed"],
        1,
        "counted once"
    );
    assert_eq!(json!(mine(&app, 1).await), held);
}

/// A purchase admitted while its coupon was valid, whose order is written
/// after the batch expired (the order consumer behind): the coupon is
/// judged at the purchase's time, as admission judged it.
#[tokio::test]
async fn a_coupon_valid_at_the_purchase_backs_an_order_written_after_it_expired() {
    let app = spawn_app_with(|s| s.orders.consumer_enabled = false).await;
    let coupon = create_coupon(&app, 5, 1500, 5000, 3600).await;
    assert_eq!(claim(&app, 1, coupon, "c").await.0, 202);
    claims_written(&app, coupon, 1).await;
    let activity = app.live_activity(10, 1, 1).await;
    let (status, order) = buy_with_coupon(&app, 1, activity, coupon, "o1").await;
    assert_eq!(status, 202, "{order}");
    // The batch expires now, after the purchase, while the order waits: a
    // validity sized to outlast the claim and the purchase was too short on
    // a host busy with the rest of the suite (the purchase came after it).
    app.execute(&format!(
        "UPDATE coupons SET valid_until = now() WHERE id = {coupon}"
    ))
    .await;
    // Until the batch has expired, by the database's clock.
    eventually("the batch expired", Duration::from_secs(60), || async {
        let expired = app
            .count(&format!(
                "SELECT count(*) AS n FROM coupons WHERE id = {coupon} AND valid_until < now()"
            ))
            .await;
        (expired == 1).then_some(())
    })
    .await;
    let _consumer = app.sibling(|s| s.orders.consumer_enabled = true).await;
    let stats = app
        .wait_for_stats(activity, |s| {
            // The order counted too: the figures are read one after
            // another, the database's before Redis's, so a batch committed
            // between the two shows neither its reservation nor its row.
            settled_with_one_order(s)
        })
        .await;
    assert_eq!(
        (&stats["orders"]["WAITING_PAY"], &stats["orders"]["FAILED"]),
        (&json!(1), &json!(0)),
        "{stats}"
    );
    assert_eq!(mine(&app, 1).await[0]["status"], "LOCKED");
}

/// A coupon batch Redis lost while an order admitted with one of its
/// coupons is still on its way to the database (the order consumers
/// behind): its hold went with the batch. The batch is restored only once
/// that order is written, with its hold, so the coupon never backs a
/// second order that would be FAILED after its 202.
#[tokio::test]
async fn a_lost_batch_waits_for_the_orders_that_hold_its_coupons() {
    let app = spawn_app_with(|s| {
        crate::helpers::restores_quickly(s);
        s.orders.consumer_enabled = false;
    })
    .await;
    let coupon = create_coupon(&app, 5, 500, 0, 3600).await;
    assert_eq!(claim(&app, 1, coupon, "c1").await.0, 202);
    claims_written(&app, coupon, 1).await;
    let first = app.live_activity(10, 1, 1).await;
    let (status, body) = buy_with_coupon(&app, 1, first, coupon, "o1").await;
    assert_eq!(status, 202, "{body}");
    let pattern = format!("{}{{c:{coupon}}}:*", app.settings.redis.key_prefix);
    assert!(app.forget_keys(&pattern).await > 0);

    // Past the moment a restore may come: the coupon backs no second
    // order meanwhile.
    let second = app.live_activity(10, 1, 1).await;
    let until = std::time::Instant::now() + app.settings.restore_wait() + Duration::from_secs(5);
    while std::time::Instant::now() < until {
        let token = app.purchase_token(1, second).await;
        let body = json!({"request_id": "o2", "token": token, "coupon_id": coupon});
        let res = app.order(1, second, &body).await;
        let (status, answer) = (res.status().as_u16(), json(res).await);
        assert!(
            status == 503 || status == 400,
            "a second order with the coupon: {status} {answer}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // The order written, the batch comes back with its hold.
    let _consumer = app.sibling(|s| s.orders.consumer_enabled = true).await;
    let (status, answer) = eventually("the batch restored", Duration::from_secs(60), || async {
        let token = app.purchase_token(1, second).await;
        let body = json!({"request_id": "o2", "token": token, "coupon_id": coupon});
        let res = app.order(1, second, &body).await;
        let (status, answer) = (res.status().as_u16(), json(res).await);
        (status != 503).then_some((status, answer))
    })
    .await;
    assert_eq!(
        (status, answer["code"].as_str()),
        (400, Some("COUPON_INVALID")),
        "{answer}"
    );
    let stats = app
        .wait_for_stats(first, |s| s["orders"]["WAITING_PAY"] == 1)
        .await;
    assert_eq!(stats["orders"]["FAILED"], 0, "{stats}");
}

/// A coupon hold whose reply was lost: the hold was made, but the
/// purchase was refused and never published, so no order will ever back
/// it. Reconciliation frees it once the order consumers have provably gone
/// past its number's time (two minutes ago here), and the coupon backs
/// the buyer's next order.
#[tokio::test]
async fn a_hold_for_an_order_that_never_was_is_freed() {
    let app = spawn_app_with(crate::helpers::restores_quickly).await;
    let coupon = create_coupon(&app, 5, 500, 0, 3600).await;
    assert_eq!(claim(&app, 1, coupon, "c1").await.0, 202);
    claims_written(&app, coupon, 1).await;
    let minted = chrono::Utc::now().timestamp_millis() - 120_000;
    let ms = u64::try_from(minted).unwrap() - seckill::ids::EPOCH_UNIX_MS;
    let never = seckill::ids::database_id(ms, 1, Some(seckill::ids::user_gene(1)));
    let uses = format!("{}{{c:{coupon}}}:uses", app.settings.redis.key_prefix);
    let _: () = redis::cmd("HSET")
        .arg(&uses)
        .arg("1")
        .arg(never)
        .query_async(&mut app.redis())
        .await
        .unwrap();
    let activity = app.live_activity(10, 1, 1).await;
    let mut attempt = 0;
    let order = eventually("the hold freed", Duration::from_secs(90), || {
        attempt += 1;
        let request_id = format!("o{attempt}");
        let app = &app;
        async move {
            let (status, body) = buy_with_coupon(app, 1, activity, coupon, &request_id).await;
            (status == 202).then_some(body)
        }
    })
    .await;
    app.wait_for_stats(activity, |s| s["orders"]["WAITING_PAY"] == 1)
        .await;
    let held: Vec<serde_json::Value> = mine(&app, 1).await;
    assert_eq!(held[0]["order_no"], order["order_no"], "{held:?}");
    assert_eq!(held[0]["status"], "LOCKED");
}
