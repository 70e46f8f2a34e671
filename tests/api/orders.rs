//! The order path against the real services: SPEC steps 1–4 and 8 and the
//! invariants I1, I2, I3, I4, I5, I7 afterwards.

use std::collections::HashSet;

use futures_util::{StreamExt, stream};
use serde_json::json;

use crate::helpers::{OPEN, Window, json, spawn_app, spawn_app_with};

#[tokio::test]
async fn a_thousand_users_at_concurrency_200_buy_exactly_the_100_units_in_stock() {
    let app = spawn_app().await;
    let activity = app.live_activity(100, 1, 1).await;

    let results: Vec<(u16, serde_json::Value)> = stream::iter(1..=1000)
        .map(|user| app.buy(user, activity))
        .buffer_unordered(200)
        .collect()
        .await;

    let accepted: Vec<_> = results.iter().filter(|(s, _)| *s == 202).collect();
    assert_eq!(accepted.len(), 100, "exactly the stock is accepted");
    for (status, body) in &results {
        assert!(
            *status == 202 || (*status == 409 && body["code"] == "SOLD_OUT"),
            "{status} {body}"
        );
    }
    let order_nos: HashSet<_> = accepted
        .iter()
        .map(|(_, b)| b["order_no"].as_str().unwrap())
        .collect();
    assert_eq!(order_nos.len(), 100, "distinct order numbers");

    let stats = app.drained(activity, 100).await;
    assert_eq!(stats["redis_available"], 0);
    assert_eq!(stats["db_available"], 0);
    assert_eq!(stats["db_locked"], 100);
    assert_eq!(stats["orders"]["FAILED"], 0);
    assert_eq!(
        app.count("SELECT count(*) AS n FROM stock_flow WHERE biz_type = 'LOCK'")
            .await,
        100
    );
}

#[tokio::test]
async fn the_same_request_id_fifty_times_at_once_makes_one_order() {
    let app = spawn_app().await;
    let activity = app.live_activity(10, 1, 1).await;
    let token = app.purchase_token(7, activity).await;
    let body = json!({"request_id": "same-request", "token": token});

    let results: Vec<(u16, serde_json::Value)> = stream::iter(0..50)
        .map(|_| app.order_retrying(7, activity, &body))
        .buffer_unordered(50)
        .collect()
        .await;

    // One attempt is accepted; every other one is a replay of it. A
    // replay that met the first attempt's delivery still unconfirmed (503
    // naming the order_no) and was confirmed on its retry is reported as
    // 202 by the helper: the same order, seen as a buyer sees it. On a
    // broker slower than the publish budget that is every one of them, so
    // the count of 202s says nothing; the one order_no and the one row do.
    let accepted = results.iter().filter(|(s, _)| *s == 202).count();
    assert!(accepted >= 1, "{results:?}");
    assert!(
        results.iter().all(|(s, _)| *s == 200 || *s == 202),
        "{results:?}"
    );
    let numbers: HashSet<_> = results.iter().map(|(_, b)| b["order_no"].clone()).collect();
    assert_eq!(numbers.len(), 1, "one order_no in every answer");

    let stats = app.drained(activity, 1).await;
    assert_eq!(stats["db_locked"], 1);
    assert_eq!(stats["redis_available"], 9);
    assert_eq!(app.count("SELECT count(*) AS n FROM orders").await, 1);

    // Resubmitting later answers 200 with the order's current status.
    let res = app.order(7, activity, &body).await;
    assert_eq!(res.status(), 200);
    let again = json(res).await;
    assert_eq!(again["order_no"], results[0].1["order_no"]);
    assert_eq!(again["status"], "WAITING_PAY");
}

#[tokio::test]
async fn one_user_with_limit_one_and_twenty_requests_gets_exactly_one() {
    let app = spawn_app().await;
    let activity = app.live_activity(50, 1, 1).await;
    let mut tokens = Vec::new();
    for _ in 0..20 {
        tokens.push(app.purchase_token(3, activity).await);
    }
    let results: Vec<(u16, serde_json::Value)> = stream::iter(tokens)
        .map(|token| {
            let app = &app;
            async move {
                let body = json!({"request_id": uuid::Uuid::new_v4().to_string(), "token": token});
                app.order_retrying(3, activity, &body).await
            }
        })
        .buffer_unordered(20)
        .collect()
        .await;
    assert_eq!(
        results.iter().filter(|(s, _)| *s == 202).count(),
        1,
        "{results:?}"
    );
    assert!(
        results
            .iter()
            .filter(|(s, _)| *s != 202)
            .all(|(s, b)| *s == 409 && b["code"] == "LIMIT_EXCEEDED"),
        "{results:?}"
    );
    let stats = app.drained(activity, 1).await;
    assert_eq!(stats["redis_available"], 49);
}

#[tokio::test]
async fn with_four_buckets_every_unit_sells_before_anyone_hears_sold_out() {
    let app = spawn_app().await;
    let activity = app.live_activity(10, 1, 4).await;
    // One at a time: each buyer starts at a random bucket, and empty buckets
    // must be skipped, not reported as sold out.
    for user in 1..=10 {
        let (status, body) = app.buy(user, activity).await;
        assert_eq!(status, 202, "buyer {user} while stock remains: {body}");
    }
    let results: Vec<(u16, serde_json::Value)> = stream::iter(11..=100)
        .map(|u| app.buy(u, activity))
        .buffer_unordered(30)
        .collect()
        .await;
    assert!(
        results
            .iter()
            .all(|(s, b)| *s == 409 && b["code"] == "SOLD_OUT")
    );
    let stats = app.drained(activity, 10).await;
    assert_eq!(stats["redis_available"], 0);
    assert_eq!(stats["db_available"], 0);
}

#[tokio::test]
async fn a_quantity_spread_over_several_buckets_is_still_sold() {
    let app = spawn_app().await;
    // Four buckets of one unit each; one buyer wants all four.
    let activity = app.live_activity(4, 4, 4).await;
    let token = app.purchase_token(1, activity).await;
    let (status, body) = app
        .order_retrying(
            1,
            activity,
            &json!({"request_id": "r", "token": token, "quantity": 4}),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let stats = app.drained(activity, 1).await;
    assert_eq!(stats["db_locked"], 4);
    assert_eq!(stats["redis_available"], 0);
}

#[tokio::test]
async fn tokens_are_one_time_personal_and_required() {
    let app = spawn_app().await;
    let activity = app.live_activity(10, 5, 1).await;
    let token = app.purchase_token(1, activity).await;
    let (ok, _) = app
        .order_retrying(1, activity, &json!({"request_id": "a", "token": token}))
        .await;
    assert_eq!(ok, 202);

    let reused = app
        .order(1, activity, &json!({"request_id": "b", "token": token}))
        .await;
    assert_invalid_token(reused).await;

    let other = app.purchase_token(2, activity).await;
    let stolen = app
        .order(1, activity, &json!({"request_id": "c", "token": other}))
        .await;
    assert_invalid_token(stolen).await;
    // The rightful owner can still use it: a failed theft does not burn it.
    assert_eq!(
        app.order_retrying(2, activity, &json!({"request_id": "d", "token": other}))
            .await
            .0,
        202
    );

    let missing = app.order(1, activity, &json!({"request_id": "e"})).await;
    assert_invalid_token(missing).await;
    let bogus = app
        .order(1, activity, &json!({"request_id": "f", "token": "made-up"}))
        .await;
    assert_invalid_token(bogus).await;

    let stats = app.drained(activity, 2).await;
    assert_eq!(stats["redis_available"], 8);
}

async fn assert_invalid_token(res: reqwest::Response) {
    assert_eq!(res.status(), 403);
    assert_eq!(json(res).await["code"], "INVALID_TOKEN");
}

async fn assert_not_active(res: reqwest::Response) {
    assert_eq!(res.status(), 409);
    assert_eq!(json(res).await["code"], "NOT_ACTIVE");
}

/// Purchases and token requests for made-up activity ids are NOT_ACTIVE
/// from the index of live activities: no database read per id (issue #41:
/// the per-activity bucket is keyed by the id, so made-up ids pass it).
#[tokio::test]
async fn made_up_activity_ids_are_not_active_without_a_query_each() {
    let app = spawn_app().await;
    let live = app.live_activity(10, 1, 1).await;
    let rows = "seckill_activity_lookups_total{source=\"row\"}";
    let indexes = "seckill_activity_lookups_total{source=\"index\"}";
    let rows_before = app.metric(rows).await.unwrap();
    for i in 0..300 {
        let id = 2_000_000 + i;
        let body = json!({"request_id": format!("made-up-{i}")});
        // Past a passing 503, as a client retries it (a fresh run on a
        // starved host met one): the answer the test is about comes after.
        assert_not_active(app.order_past_503(1, id, &body).await).await;
        if i % 10 == 0 {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            let res = loop {
                let res = app
                    .get(
                        &format!("/api/v1/activities/{id}/token"),
                        Some(&app.user_token(1)),
                    )
                    .await;
                if res.status() != 503 || std::time::Instant::now() >= deadline {
                    break res;
                }
                eprintln!("token for made-up id {id}: {}", json(res).await);
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            };
            assert_not_active(res).await;
        }
    }
    assert_eq!(
        app.metric(rows).await,
        Some(rows_before),
        "a row read per id"
    );
    let index_reads = app.metric(indexes).await.unwrap();
    assert!(index_reads < 60, "{index_reads} reads of the index");
    // The live activity still sells.
    assert_eq!(app.buy(1, live).await.0, 202);
}

#[tokio::test]
async fn outside_the_sale_window_or_before_warm_up_is_not_active() {
    let app = spawn_app().await;
    let user = app.user_token(1);
    let token_path = |id: i64| format!("/api/v1/activities/{id}/token");

    let cold = app.create_activity(10, 1, 1, OPEN).await;
    assert_not_active(app.get(&token_path(cold), Some(&user)).await).await;
    assert_not_active(
        app.order_past_503(1, cold, &json!({"request_id": "a", "token": "x"}))
            .await,
    )
    .await;
    let view = json(app.get(&format!("/api/v1/activities/{cold}"), None).await).await;
    assert_eq!(view["status"], "PENDING");
    assert_eq!(view["remaining"], 0);

    let future = app
        .warmed_activity(
            10,
            1,
            1,
            Window {
                start: 3600,
                end: 7200,
            },
        )
        .await;
    assert_not_active(app.get(&token_path(future), Some(&user)).await).await;
    assert_not_active(
        app.order_past_503(1, future, &json!({"request_id": "a", "token": "x"}))
            .await,
    )
    .await;
    let view = json(app.get(&format!("/api/v1/activities/{future}"), None).await).await;
    assert_eq!(view["status"], "READY");
    assert_eq!(view["remaining"], 10);

    let ending = app
        .warmed_activity(10, 1, 1, Window { start: -60, end: 2 })
        .await;
    let token = app.purchase_token(1, ending).await;
    app.clock.advance(std::time::Duration::from_millis(2500));
    assert_not_active(
        app.order_past_503(1, ending, &json!({"request_id": "a", "token": token}))
            .await,
    )
    .await;
    assert_eq!(
        json(app.get(&format!("/api/v1/activities/{ending}"), None).await).await["status"],
        "ENDED"
    );

    for id in [cold, future, ending] {
        let stats = app.stats(id).await;
        assert_eq!(stats["db_available"], 10, "no stock moved for {id}");
    }
}

#[tokio::test]
async fn malformed_purchase_bodies_are_400_with_a_code_and_move_no_stock() {
    let app = spawn_app().await;
    let activity = app.live_activity(10, 2, 1).await;
    let token = app.purchase_token(1, activity).await;
    let bodies = [
        json!({"request_id": "a", "token": token, "quantity": 0}),
        json!({"request_id": "a", "token": token, "quantity": -3}),
        json!({"request_id": "a", "token": token, "quantity": 3}),
        json!({"request_id": "", "token": token}),
        json!({"request_id": "x".repeat(65), "token": token}),
        json!({"request_id": "has space", "token": token}),
        json!({"request_id": "a", "token": token, "surprise": true}),
        json!({"request_id": 5, "token": token}),
        json!({"token": token}),
        json!({"request_id": "a", "token": token, "quantity": "one"}),
    ];
    for body in &bodies {
        let res = app.order(1, activity, body).await;
        let status = res.status();
        let answer = json(res).await;
        assert_eq!(status, 400, "{body}: {answer}");
        assert_eq!(answer["code"], "BAD_REQUEST", "{body}: {answer}");
    }
    let raw = app
        .client
        .post(format!(
            "{}/api/v1/activities/{activity}/orders",
            app.address
        ))
        .bearer_auth(app.user_token(1))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status(), 400);
    assert_eq!(json(raw).await["code"], "BAD_REQUEST");
    let coupon = app
        .order(
            1,
            activity,
            &json!({"request_id": "a", "token": token, "coupon_id": 3}),
        )
        .await;
    assert_eq!(coupon.status(), 400);
    assert_eq!(json(coupon).await["code"], "COUPON_INVALID");

    let stats = app.stats(activity).await;
    assert_eq!(stats["redis_available"], 10);
    assert_eq!(stats["reservations_open"], 0);
    // The token was never consumed by a refused request.
    assert_eq!(
        app.order_retrying(1, activity, &json!({"request_id": "ok", "token": token}))
            .await
            .0,
        202
    );
}

#[tokio::test]
async fn bad_activity_bodies_are_400_and_unknown_ids_404() {
    let app = spawn_app().await;
    let admin = app.admin_token();
    let now = chrono::Utc::now();
    let good = json!({"sku_id": 1, "name": "Phone", "price_cents": 100, "stock": 10,
        "start_at": now, "end_at": now + chrono::Duration::hours(1),
        "per_user_limit": 1, "pay_timeout_secs": 60, "buckets": 1});
    let with = |key: &str, value: serde_json::Value| {
        let mut b = good.clone();
        b[key] = value;
        b
    };
    for body in [
        with("stock", json!(0)),
        with("price_cents", json!(-1)),
        with("end_at", json!(now - chrono::Duration::hours(1))),
        with("per_user_limit", json!(0)),
        with("buckets", json!(0)),
        with("buckets", json!(11)),
        with("pay_timeout_secs", json!(0)),
        with("name", json!("")),
        with("start_at", json!("yesterday")),
        with("extra", json!(1)),
    ] {
        let res = app
            .post_json("/api/v1/admin/activities", &body, Some(&admin))
            .await;
        assert_eq!(res.status(), 400, "{body}");
        assert_eq!(json(res).await["code"], "BAD_REQUEST");
    }
    assert_eq!(
        app.post_json("/api/v1/admin/activities", &good, Some(&admin))
            .await
            .status(),
        201
    );
    assert_eq!(
        app.count("SELECT count(*) AS n FROM activities").await,
        1,
        "nothing half-written"
    );

    let user = app.user_token(1);
    let res = app
        .post_json("/api/v1/admin/activities", &good, Some(&user))
        .await;
    assert_eq!(res.status(), 403);
    let res = app
        .post_json(
            "/api/v1/admin/activities/999999/warmup",
            &json!({}),
            Some(&admin),
        )
        .await;
    assert_eq!(res.status(), 404);
    assert_eq!(json(res).await["code"], "NOT_FOUND");
    assert_eq!(
        app.get("/api/v1/activities/999999", None).await.status(),
        404
    );
    let res = app.get("/api/v1/activities/not-a-number", None).await;
    assert_eq!(res.status(), 400);
}

#[tokio::test]
async fn warm_up_is_idempotent_and_never_resets_live_stock() {
    let app = spawn_app().await;
    let activity = app.live_activity(5, 1, 2).await;
    assert_eq!(app.buy(1, activity).await.0, 202);
    let again = app.warmup(activity).await;
    assert_eq!(again["status"], "READY");
    assert_eq!(
        again["warmed_stock"], 4,
        "the live figure, not a reset to 5"
    );
    let stats = app.drained(activity, 1).await;
    assert_eq!(stats["redis_available"], 4);
}

#[tokio::test]
async fn only_the_owner_sees_an_order_and_lists_show_only_their_own() {
    let app = spawn_app().await;
    let activity = app.live_activity(10, 3, 1).await;
    let mut mine = Vec::new();
    for _ in 0..3 {
        let (status, body) = app.buy(1, activity).await;
        assert_eq!(status, 202);
        mine.push(body["order_no"].as_str().unwrap().to_owned());
    }
    assert_eq!(app.buy(2, activity).await.0, 202);
    app.drained(activity, 4).await;

    let path = format!("/api/v1/orders/{}", mine[0]);
    let res = app.get(&path, Some(&app.user_token(1))).await;
    assert_eq!(res.status(), 200);
    let order = json(res).await;
    assert_eq!(order["status"], "WAITING_PAY");
    assert_eq!(order["amount_cents"], 9900);
    assert_eq!(order["order_no"], mine[0]);
    assert!(order["pay_deadline"].is_string());
    assert!(order["paid_at"].is_null());

    let res = app.get(&path, Some(&app.user_token(2))).await;
    assert_eq!(res.status(), 404);
    assert_eq!(json(res).await["code"], "NOT_FOUND");
    assert_eq!(
        app.get("/api/v1/orders/12345", Some(&app.user_token(1)))
            .await
            .status(),
        404
    );
    assert_eq!(
        app.get("/api/v1/orders/garbage", Some(&app.user_token(1)))
            .await
            .status(),
        404
    );

    let page1 = json(
        app.get("/api/v1/orders?limit=2", Some(&app.user_token(1)))
            .await,
    )
    .await;
    let page1_nos: Vec<_> = page1["orders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["order_no"].clone())
        .collect();
    assert_eq!(page1_nos.len(), 2);
    let cursor = page1["next_cursor"].as_str().unwrap();
    let page2 = json(
        app.get(
            &format!("/api/v1/orders?limit=2&cursor={cursor}"),
            Some(&app.user_token(1)),
        )
        .await,
    )
    .await;
    assert_eq!(page2["orders"].as_array().unwrap().len(), 1);
    assert!(page2["next_cursor"].is_null());
    let mut all: Vec<String> = page1_nos
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    all.push(page2["orders"][0]["order_no"].as_str().unwrap().to_owned());
    let mut expected = mine.clone();
    expected.sort_by_key(|a| std::cmp::Reverse(a.parse::<i64>().unwrap()));
    assert_eq!(all, expected, "newest first, the caller's only");

    let res = app
        .get("/api/v1/orders?status=NOPE", Some(&app.user_token(1)))
        .await;
    assert_eq!(res.status(), 400);
    let res = app
        .get("/api/v1/orders?limit=0", Some(&app.user_token(1)))
        .await;
    assert_eq!(res.status(), 400);
}

#[tokio::test]
async fn an_order_not_yet_consumed_reads_as_processing_from_redis() {
    let app = spawn_app_with(crate::helpers::without_order_consumer).await;
    let activity = app.live_activity(10, 1, 1).await;
    let (status, body) = app.buy(4, activity).await;
    assert_eq!(status, 202);
    let path = format!("/api/v1/orders/{}", body["order_no"].as_str().unwrap());
    let order = json(app.get(&path, Some(&app.user_token(4))).await).await;
    assert_eq!(order["status"], "PROCESSING");
    assert_eq!(order["quantity"], 1);
    assert_eq!(app.get(&path, Some(&app.user_token(5))).await.status(), 404);
    let stats = app.stats(activity).await;
    assert_eq!(stats["reservations_open"], 1);
    assert_eq!(stats["orders"]["PROCESSING"], 1);
}

#[tokio::test]
async fn admission_survives_redis_forgetting_its_scripts() {
    let app = spawn_app().await;
    let activity = app.live_activity(10, 1, 1).await;
    assert_eq!(app.buy(1, activity).await.0, 202);
    let mut conn = app.redis();
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        app.buy(2, activity).await.0,
        202,
        "NOSCRIPT is reloaded and retried"
    );
    app.drained(activity, 2).await;
}
