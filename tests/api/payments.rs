//! After the order: pay intents, signed callbacks, cancel, timeout, outbox
//! (SPEC steps 5–7; I5, I6, I7).

use std::time::Duration;

use futures_util::{StreamExt, stream};
use serde_json::json;

use crate::helpers::{eventually, json, spawn_app, spawn_app_with};

#[tokio::test]
async fn thirty_orders_with_each_callback_delivered_five_times_shuffled_are_paid_once() {
    let app = spawn_app().await;
    let activity = app.live_activity(30, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 30).await;
    let mut callbacks = Vec::new();
    for (user, order_no) in &orders {
        let p = app.payment(*user, order_no).await;
        assert_eq!(p["status"], "PENDING");
        assert_eq!(p["amount_cents"], 9900);
        for _ in 0..5 {
            callbacks.push(app.signed_callback(&p, "SUCCESS", 9900, None, 0));
        }
    }
    fastrand::shuffle(&mut callbacks);
    let statuses: Vec<u16> = stream::iter(callbacks)
        .map(|(body, sig)| {
            let app = &app;
            async move { app.notify(body, Some(&sig)).await.status().as_u16() }
        })
        .buffer_unordered(50)
        .collect()
        .await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");

    let stats = app.stats(activity).await;
    assert_eq!(stats["orders"]["PAID"], 30);
    assert_eq!(stats["db_sold"], 30);
    assert_eq!(stats["db_locked"], 0);
    assert_eq!(
        app.count("SELECT count(*) AS n FROM stock_flow WHERE biz_type = 'CONFIRM'")
            .await,
        30
    );
    assert_eq!(
        app.count("SELECT count(*) AS n FROM payments WHERE status = 'SUCCESS'")
            .await,
        30
    );
    assert_eq!(
        app.count("SELECT count(*) AS n FROM outbox WHERE topic = 'order.paid'")
            .await,
        30
    );
    for (user, order_no) in orders.iter().take(3) {
        assert_eq!(app.order_status(*user, order_no).await, "PAID");
    }
}

#[tokio::test]
async fn forged_stale_or_unsigned_callbacks_are_401_and_a_wrong_amount_400_changing_nothing() {
    let app = spawn_app().await;
    let activity = app.live_activity(5, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (user, order_no) = &orders[0];
    let p = app.payment(*user, order_no).await;

    let (body, sig) = app.signed_callback(&p, "SUCCESS", 9900, Some("not-the-secret"), 0);
    let res = app.notify(body, Some(&sig)).await;
    assert_eq!(res.status(), 401);
    assert_eq!(json(res).await["code"], "BAD_SIGNATURE");

    let (body, sig) = app.signed_callback(&p, "SUCCESS", 9900, None, -301);
    let res = app.notify(body, Some(&sig)).await;
    assert_eq!(res.status(), 401);
    assert_eq!(json(res).await["code"], "BAD_SIGNATURE");

    let (body, _) = app.signed_callback(&p, "SUCCESS", 9900, None, 0);
    let res = app.notify(body, None).await;
    assert_eq!(res.status(), 401);
    assert_eq!(json(res).await["code"], "BAD_SIGNATURE");

    let (body, sig) = app.signed_callback(&p, "SUCCESS", 9899, None, 0);
    let res = app.notify(body, Some(&sig)).await;
    assert_eq!(res.status(), 400);
    assert_eq!(json(res).await["code"], "AMOUNT_MISMATCH");

    // A valid signature over a different body does not carry over.
    let (_, sig) = app.signed_callback(&p, "SUCCESS", 9900, None, 0);
    let (tampered, _) = app.signed_callback(&p, "SUCCESS", 1, None, 0);
    assert_eq!(app.notify(tampered, Some(&sig)).await.status(), 401);

    assert_eq!(app.order_status(*user, order_no).await, "WAITING_PAY");
    let stats = app.stats(activity).await;
    assert_eq!(stats["db_locked"], 1);
    assert_eq!(stats["db_sold"], 0);
    assert_eq!(
        app.count("SELECT count(*) AS n FROM payments WHERE status <> 'PENDING'")
            .await,
        0
    );

    // And the genuine callback still works afterwards.
    let (body, sig) = app.signed_callback(&p, "SUCCESS", 9900, None, 0);
    assert_eq!(app.notify(body, Some(&sig)).await.status(), 200);
    assert_eq!(app.order_status(*user, order_no).await, "PAID");
}

#[tokio::test]
async fn a_failed_callback_fails_the_payment_and_the_order_stays_payable() {
    let app = spawn_app().await;
    let activity = app.live_activity(5, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (user, order_no) = &orders[0];
    let p = app.payment(*user, order_no).await;
    let (body, sig) = app.signed_callback(&p, "FAILED", 9900, None, 0);
    assert_eq!(app.notify(body, Some(&sig)).await.status(), 200);
    assert_eq!(app.order_status(*user, order_no).await, "WAITING_PAY");
    assert_eq!(
        app.count("SELECT count(*) AS n FROM payments WHERE status = 'FAILED'")
            .await,
        1
    );
    // A new attempt gets a new pending payment.
    let again = app.payment(*user, order_no).await;
    assert_ne!(again["payment_no"], p["payment_no"]);
}

#[tokio::test]
async fn pay_intents_are_reused_while_pending_and_the_mock_provider_pays_through_signed_callbacks()
{
    let app = spawn_app().await;
    let activity = app.live_activity(5, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (user, order_no) = &orders[0];
    let first = app.payment(*user, order_no).await;
    let second = app.payment(*user, order_no).await;
    assert_eq!(first["payment_no"], second["payment_no"]);

    let res = app
        .post_json(
            &format!(
                "/api/v1/dev/payments/{}/simulate",
                first["payment_no"].as_str().unwrap()
            ),
            &json!({"status": "SUCCESS", "times": 3}),
            Some(&app.user_token(*user)),
        )
        .await;
    assert_eq!(res.status(), 200);
    assert_eq!(json(res).await["responses"], json!([200, 200, 200]));
    assert_eq!(app.order_status(*user, order_no).await, "PAID");
    assert_eq!(app.stats(activity).await["db_sold"], 1);

    let res = app.pay(*user, order_no).await;
    assert_eq!(res.status(), 409);
    assert_eq!(json(res).await["code"], "INVALID_STATE");
    let res = app.cancel(*user, order_no).await;
    assert_eq!(res.status(), 409);
    assert_eq!(json(res).await["code"], "INVALID_STATE");
}

#[tokio::test]
async fn ten_concurrent_cancels_release_the_unit_once_and_someone_else_can_buy_it() {
    let app = spawn_app().await;
    let activity = app.live_activity(1, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (user, order_no) = &orders[0];
    assert_eq!(
        app.buy(2, activity).await.0,
        409,
        "sold out while the order holds the unit"
    );

    let results: Vec<(u16, serde_json::Value)> = stream::iter(0..10)
        .map(|_| async {
            let res = app.cancel(*user, order_no).await;
            (res.status().as_u16(), json(res).await)
        })
        .buffer_unordered(10)
        .collect()
        .await;
    assert!(
        results
            .iter()
            .all(|(s, b)| *s == 200 && b["status"] == "CANCELLED"),
        "{results:?}"
    );
    assert_eq!(
        app.count("SELECT count(*) AS n FROM stock_flow WHERE biz_type = 'RELEASE'")
            .await,
        1
    );
    assert_eq!(
        app.count("SELECT count(*) AS n FROM outbox WHERE topic = 'stock.released'")
            .await,
        1
    );

    let stats = app
        .wait_for_stats(activity, |s| s["redis_available"] == 1)
        .await;
    assert_eq!(stats["db_available"], 1);
    assert_eq!(stats["db_locked"], 0);
    app.caught_up("stock-releaser", "stock.released").await;
    assert_eq!(
        app.stats(activity).await["redis_available"],
        1,
        "released exactly once"
    );

    let (status, body) = app.buy(2, activity).await;
    assert_eq!(status, 202, "{body}");
    // The canceller's own limit was given back too.
    let stats = app.drained(activity, 1).await;
    assert_eq!(stats["orders"]["CANCELLED"], 1);
}

#[tokio::test]
async fn another_users_order_is_404_for_pay_cancel_and_get() {
    let app = spawn_app().await;
    let activity = app.live_activity(5, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (_, order_no) = &orders[0];
    for res in [
        app.pay(99, order_no).await,
        app.cancel(99, order_no).await,
        app.get(
            &format!("/api/v1/orders/{order_no}"),
            Some(&app.user_token(99)),
        )
        .await,
    ] {
        assert_eq!(res.status(), 404);
        assert_eq!(json(res).await["code"], "NOT_FOUND");
    }
    let p = app.payment(1, order_no).await;
    let res = app
        .post_json(
            &format!(
                "/api/v1/dev/payments/{}/simulate",
                p["payment_no"].as_str().unwrap()
            ),
            &json!({"status": "SUCCESS"}),
            Some(&app.user_token(99)),
        )
        .await;
    assert_eq!(res.status(), 404);
    assert_eq!(app.order_status(1, order_no).await, "WAITING_PAY");
}

#[tokio::test]
async fn pay_racing_the_timeout_ends_each_order_paid_or_closed_and_conserves_stock() {
    let app =
        spawn_app_with(|s| s.workers.closer_interval_ms = std::time::Duration::from_millis(200))
            .await;
    let activity = app.live_activity_paying_within(40, 3).await;
    let orders = app.waiting_orders(activity, 1, 40).await;
    let mut payments = Vec::new();
    // On a slow machine an order may close before it is even paid for: it
    // then has no payment to refund.
    let mut closed_unpaid = 0;
    for (user, order_no) in &orders {
        let res = app.pay(*user, order_no).await;
        match res.status().as_u16() {
            200 => payments.push(json(res).await),
            409 => {
                assert_eq!(app.order_status(*user, order_no).await, "CLOSED");
                closed_unpaid += 1;
            }
            other => panic!("pay answered {other}"),
        }
    }
    // Callbacks at random moments from well before to well after the deadline.
    let results: Vec<u16> = stream::iter(payments)
        .map(|p| {
            let app = &app;
            async move {
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..6000))).await;
                let (body, sig) = app.signed_callback(&p, "SUCCESS", 9900, None, 0);
                app.notify(body, Some(&sig)).await.status().as_u16()
            }
        })
        .buffer_unordered(40)
        .collect()
        .await;
    assert!(results.iter().all(|s| *s == 200), "{results:?}");

    let stats = app
        .wait_for_stats(activity, |s| {
            s["db_locked"] == 0 && s["redis_available"] == s["db_available"]
        })
        .await;
    let (paid, closed) = (
        stats["orders"]["PAID"].as_i64().unwrap(),
        stats["orders"]["CLOSED"].as_i64().unwrap(),
    );
    assert_eq!(paid + closed, 40, "every order PAID or CLOSED: {stats}");
    assert_eq!(stats["orders"]["WAITING_PAY"], 0);
    assert_eq!(stats["db_sold"], paid, "sold = Σ PAID");
    assert_eq!(stats["db_available"], closed);
    assert_eq!(
        stats["stock_total"],
        json!(stats["db_available"].as_i64().unwrap() + paid)
    );
    // The mock provider refunds at once; the sweeper sends each refund
    // within a round. Counted once none is under way: two counts taken
    // apart while the sweeper works saw 16 of 19 (3 went REFUNDED between).
    eventually(
        "every late payment refunded",
        Duration::from_secs(60),
        || async {
            let pending = app
                .count(
                    "SELECT count(*) AS n FROM payments \
                     WHERE status IN ('REFUND_REQUIRED', 'REFUNDING')",
                )
                .await;
            (pending == 0).then_some(())
        },
    )
    .await;
    let refunded = app
        .count("SELECT count(*) AS n FROM payments WHERE status = 'REFUNDED'")
        .await;
    assert_eq!(
        refunded,
        closed - closed_unpaid,
        "every order closed after its payment was made refunds it"
    );
    assert_eq!(
        app.count(
            "SELECT count(*) AS n FROM refunds WHERE status = 'REFUNDED' AND kind = 'LATE_PAYMENT'"
        )
        .await,
        refunded,
        "one refund each"
    );
    assert_eq!(
        app.count("SELECT count(*) AS n FROM payments WHERE status = 'SUCCESS'")
            .await,
        paid
    );
    assert_eq!(
        app.count(
            "SELECT count(*) AS n FROM orders o JOIN payments p USING (order_no) \
             WHERE o.status = 'CLOSED' AND p.status = 'SUCCESS'"
        )
        .await,
        0,
        "a closed order never keeps a successful charge"
    );
    assert_eq!(
        app.count("SELECT count(*) AS n FROM stock_flow WHERE biz_type = 'RELEASE'")
            .await,
        closed
    );
    assert_eq!(
        app.count("SELECT count(*) AS n FROM stock_flow WHERE biz_type = 'CONFIRM'")
            .await,
        paid
    );
}

#[tokio::test]
async fn a_cancel_restores_redis_stock_once_even_when_redis_lost_the_reservation_record() {
    let app = spawn_app().await;
    let activity = app.live_activity(3, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (user, order_no) = &orders[0];
    // Redis forgets the reservation (its TTL passed, or a failover lost it).
    let mut conn = app.redis();
    let key = format!(
        "{}{{a:{activity}}}:res:{order_no}",
        app.settings.redis.key_prefix
    );
    let removed: i64 = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(removed, 1);
    assert_eq!(app.stats(activity).await["redis_available"], 2);

    assert_eq!(app.cancel(*user, order_no).await.status(), 200);
    app.wait_for_stats(activity, |s| s["redis_available"] == 3)
        .await;
    app.caught_up("stock-releaser", "stock.released").await;
    let stats = app.stats(activity).await;
    assert_eq!(stats["redis_available"], 3, "restored exactly once");
    assert_eq!(stats["db_available"], 3);
    // The buyer's limit came back with it.
    assert_eq!(app.buy(*user, activity).await.0, 202);
}
