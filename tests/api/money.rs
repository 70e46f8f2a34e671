//! Money under faults: each way the payments review found to lose money or
//! give goods away, shown on real processes (the WeChat Pay platform
//! simulator, localstripe, the mock's signed callbacks), with what the
//! provider holds checked against what we hold.

use std::time::Duration;

use diesel::{Connection, PgConnection, QueryableByName, RunQueryDsl};
use seckill::config::ProviderKind;
use secrecy::ExposeSecret;
use serde_json::{Value, json};

use crate::helpers::{TestApp, eventually, json, spawn_app};
use crate::stripe::{LocalStripe, stripe_settings};
use crate::wechatpay::Platform;

/// How long anything the sweeper does may take here (a slow host's
/// rounds, backoffs of 1-2 s).
const SETTLE: Duration = Duration::from_secs(90);

/// `payments.status` of `payment_no`.
async fn payment_status(app: &TestApp, payment_no: &str) -> String {
    let rows = crate::db::strings(
        &app.settings.postgres.url,
        &format!("SELECT status AS s FROM payments WHERE payment_no = {payment_no}"),
    )
    .await;
    rows.into_iter().next().unwrap_or_default()
}

/// Waits until `payment_no` is `status`.
async fn payment_becomes(app: &TestApp, payment_no: &str, status: &str) {
    let what = format!("payment {payment_no} {status}");
    eventually(&what, SETTLE, || async {
        (payment_status(app, payment_no).await == status).then_some(())
    })
    .await;
}

/// The after-sale refund of `order_no`, as an admin asks it.
async fn refund(app: &TestApp, order_no: &str) -> reqwest::Response {
    app.post_json(
        &format!("/api/v1/admin/orders/{order_no}/refund"),
        &json!({"reason": "returned"}),
        Some(&app.admin_token()),
    )
    .await
}

fn no(payment: &Value) -> String {
    payment["payment_no"].as_str().unwrap().to_owned()
}

/// The mock's signed callback for `payment`, `status`, answered 200.
async fn callback(app: &TestApp, payment: &Value, status: &str) {
    let amount = payment["amount_cents"].as_i64().unwrap();
    let (body, signature) = app.signed_callback(payment, status, amount, None, 0);
    let res = app.notify(body, Some(&signature)).await;
    assert_eq!(res.status(), 200, "{status} callback for {payment}");
}

/// A payment declined, a second one paying the order, then the buyer
/// paying the first one too (its old QR code): the late capture is
/// refunded on its own, and the admin's after-sale refund gives back the
/// capture that paid the order, whatever order the rows lie in.
#[tokio::test]
async fn an_after_sale_refund_gives_back_the_capture_that_paid_the_order() {
    let app = spawn_app().await;
    let activity = app.live_activity(1, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (user, order_no) = (orders[0].0, orders[0].1.as_str());
    let first = app.payment(user, order_no).await;
    callback(&app, &first, "FAILED").await;
    let second = app.payment(user, order_no).await;
    assert_ne!(no(&first), no(&second), "a new payment after a decline");
    callback(&app, &second, "SUCCESS").await;
    callback(&app, &first, "SUCCESS").await;
    payment_becomes(&app, &no(&first), "REFUNDED").await;
    // The paying payment's row is the newest: a query that takes the first
    // charged row it meets finds the late payment.
    app.execute(&format!(
        "UPDATE payments SET updated_at = now() WHERE payment_no = {}",
        no(&second)
    ))
    .await;
    let res = refund(&app, order_no).await;
    assert_eq!(res.status(), 202);
    let answer = json(res).await;
    assert_eq!(answer["payment_no"], second["payment_no"], "{answer}");
    payment_becomes(&app, &no(&second), "REFUNDED").await;
    assert_eq!(
        app.count("SELECT count(*) AS n FROM refunds").await,
        2,
        "one refund per capture"
    );
    assert_eq!(app.order_status(user, order_no).await, "PAID");
}

/// A paid order at the platform: (user, order_no, payment_no).
async fn paid_at_the_platform(
    app: &TestApp,
    platform: &Platform,
    activity: i64,
    user: i64,
) -> (i64, String, String) {
    let orders = app.waiting_orders(activity, user, 1).await;
    let (user, order_no) = (orders[0].0, orders[0].1.clone());
    let payment = no(&app.payment(user, &order_no).await);
    platform
        .sim(&format!("/sim/pay/{payment}"), json!({"times": 1}))
        .await;
    assert_eq!(app.order_status(user, &order_no).await, "PAID");
    (user, order_no, payment)
}

/// The refund requests the platform received for `refund_no`.
async fn refund_posts(platform: &Platform, refund_no: &str) -> usize {
    let state = platform.state().await;
    state["requests"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| {
            r["method"] == "POST"
                && r["path"] == "/v3/refund/domestic/refunds"
                && r["body"]
                    .as_str()
                    .is_some_and(|b| b.contains(&format!("\"out_refund_no\":\"{refund_no}\"")))
        })
        .count()
}

/// WeChat Pay answers a refund 429 `FREQUENCY_LIMITED` (not taken: lower
/// the rate and send it again), or 403 `NOT_ENOUGH` (the merchant's
/// balance is short: send it again under the same refund number): the
/// refund is sent again, once more, and is given back once.
#[tokio::test]
async fn a_refund_answered_429_or_not_enough_is_sent_again_under_its_number() {
    let platform = Platform::start();
    let app = platform
        .app(|s| s.payment.retry_max_secs = Duration::from_secs(2))
        .await;
    let activity = app.live_activity(2, 1, 1).await;
    for (i, (status, code)) in [(429, "FREQUENCY_LIMITED"), (403, "NOT_ENOUGH")]
        .into_iter()
        .enumerate()
    {
        let (_, order_no, payment) =
            paid_at_the_platform(&app, &platform, activity, 1 + i as i64).await;
        platform
            .sim(
                "/sim/script",
                json!({"path": "/v3/refund/domestic/refunds", "status": status, "code": code}),
            )
            .await;
        let answer = json(refund(&app, &order_no).await).await;
        let refund_no = answer["refund_no"].as_str().unwrap().to_owned();
        payment_becomes(&app, &payment, "REFUNDED").await;
        assert_eq!(
            refund_posts(&platform, &refund_no).await,
            2,
            "{code}: sent again once, under its number"
        );
        let state = platform.state().await;
        let refunds: Vec<&Value> = state["refunds"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["out_trade_no"] == payment.as_str())
            .collect();
        assert_eq!(refunds.len(), 1, "{code}: {state}");
        assert_eq!(refunds[0]["status"], "SUCCESS");
        assert_eq!(refunds[0]["creates"], 1, "{code}: taken once");
    }
}

/// A refund the platform took (PROCESSING: a bank card's refund takes
/// days) meets 429s on its queries: it stays REFUNDING, and the
/// platform's REFUND.SUCCESS settles it. One the platform reported
/// ABNORMAL (REFUND_FAILED) and later refunded after all is REFUNDED: the
/// provider's later word wins over our earlier failure.
#[tokio::test]
async fn a_query_error_never_fails_a_refund_and_the_providers_later_word_wins() {
    let platform = Platform::start();
    let app = platform
        .app(|s| s.payment.query_after_secs = Duration::from_secs(1))
        .await;
    platform.sim("/sim/callbacks", json!({"hold": true})).await;
    let activity = app.live_activity(2, 1, 1).await;

    let (_, order_no, payment) = paid_at_the_platform(&app, &platform, activity, 1).await;
    let refund_no = json(refund(&app, &order_no).await).await["refund_no"]
        .as_str()
        .unwrap()
        .to_owned();
    let query = format!("/v3/refund/domestic/refunds/{refund_no}");
    platform
        .sim(
            "/sim/script",
            json!({"path": query, "status": 429, "code": "FREQUENCY_LIMITED", "times": 2}),
        )
        .await;
    // Two queries answered 429, then one answered PROCESSING.
    eventually("three queries of the refund", SETTLE, || async {
        let state = platform.state().await;
        let asked = state["requests"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["method"] == "GET" && r["path"] == query.as_str())
            .count();
        (asked >= 3).then_some(())
    })
    .await;
    assert_eq!(payment_status(&app, &payment).await, "REFUNDING");
    platform
        .sim(
            &format!("/sim/refund-settle/{refund_no}"),
            json!({"status": "SUCCESS"}),
        )
        .await;
    payment_becomes(&app, &payment, "REFUNDED").await;

    let (_, order_no, payment) = paid_at_the_platform(&app, &platform, activity, 2).await;
    let refund_no = json(refund(&app, &order_no).await).await["refund_no"]
        .as_str()
        .unwrap()
        .to_owned();
    eventually("the platform took the refund", SETTLE, || async {
        (refund_posts(&platform, &refund_no).await >= 1).then_some(())
    })
    .await;
    let settle = format!("/sim/refund-settle/{refund_no}");
    platform.sim(&settle, json!({"status": "ABNORMAL"})).await;
    payment_becomes(&app, &payment, "REFUND_FAILED").await;
    platform
        .sim(&settle, json!({"status": "SUCCESS", "force": true}))
        .await;
    payment_becomes(&app, &payment, "REFUNDED").await;
}

/// Under a real provider the mock's signed route is not there: whoever
/// holds `payment.notify_secret` cannot mark an order paid with nothing
/// charged.
#[tokio::test]
async fn the_mocks_signed_route_is_not_there_under_a_real_provider() {
    let platform = Platform::start();
    let app = platform.app(|_| {}).await;
    let activity = app.live_activity(1, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (user, order_no) = (orders[0].0, orders[0].1.as_str());
    let payment = app.payment(user, order_no).await;
    let amount = payment["amount_cents"].as_i64().unwrap();
    let (body, signature) = app.signed_callback(&payment, "SUCCESS", amount, None, 0);
    let res = app.notify(body, Some(&signature)).await;
    assert_eq!(res.status(), 404);
    assert_eq!(json(res).await["code"], "NOT_FOUND");
    assert_eq!(app.order_status(user, order_no).await, "WAITING_PAY");
    assert_eq!(platform.trade(&no(&payment)).await["state"], "NOTPAY");
}

/// A payment made through the mock, then the instance started with
/// WeChat Pay: a genuine WeChat Pay callback naming that payment's number
/// is not applied to it.
#[tokio::test]
async fn a_callback_is_applied_only_to_a_payment_of_its_own_provider() {
    let platform = Platform::start();
    let app = spawn_app().await;
    let activity = app.live_activity(1, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (user, order_no) = (orders[0].0, orders[0].1.as_str());
    let payment = app.payment(user, order_no).await;
    assert_eq!(payment["provider"], "mock");
    let wechat = app.sibling(|s| platform.settings(s)).await;
    platform.notify(&wechat).await;
    platform
        .sim(
            "/sim/plant",
            json!({
                "out_trade_no": no(&payment),
                "amount": payment["amount_cents"],
                "appid": crate::wechatpay::APPID,
            }),
        )
        .await;
    let answer = platform
        .sim(&format!("/sim/deliver/{}", no(&payment)), json!({}))
        .await;
    assert_eq!(answer["status"], 404, "{answer}");
    assert_eq!(app.order_status(user, order_no).await, "WAITING_PAY");
    assert_eq!(payment_status(&app, &no(&payment)).await, "PENDING");
}

/// The platform sends a genuine, signed callback whose resource names
/// another merchant, another app, or another currency: refused, nothing
/// changes; the genuine one then pays.
#[tokio::test]
async fn a_callback_of_another_merchant_app_or_currency_changes_nothing() {
    let platform = Platform::start();
    let app = platform.app(|_| {}).await;
    let activity = app.live_activity(1, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (user, order_no) = (orders[0].0, orders[0].1.as_str());
    let payment = no(&app.payment(user, order_no).await);
    platform
        .sim(&format!("/sim/pay/{payment}"), json!({"deliver": false}))
        .await;
    for tamper in ["mchid", "appid", "currency"] {
        let answer = platform
            .sim(
                &format!("/sim/deliver/{payment}"),
                json!({"tamper": tamper}),
            )
            .await;
        assert_eq!(answer["status"], 400, "{tamper}: {answer}");
        assert_eq!(app.order_status(user, order_no).await, "WAITING_PAY");
    }
    let answer = platform
        .sim(&format!("/sim/deliver/{payment}"), json!({}))
        .await;
    assert_eq!(answer["status"], 204, "{answer}");
    assert_eq!(app.order_status(user, order_no).await, "PAID");
}

/// The platform's requests, in order: (method, path).
async fn requests(platform: &Platform) -> Vec<(String, String)> {
    let state = platform.state().await;
    state["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["method"].as_str().unwrap().to_owned(),
                r["path"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// A charge declined at WeChat Pay (PAYERROR): its QR code still works
/// there. The next pay call closes it at the platform before the new
/// payment is made, so the old code can no longer take money; until then
/// the failed payment is queried (a buyer who pays it, unheard of, pays
/// the order); and it is closed when its order closes.
#[tokio::test]
async fn a_failed_payment_is_closed_before_a_new_one_and_followed_until_closed() {
    let platform = Platform::start();
    let app = platform
        .app(|s| {
            s.payment.query_after_secs = Duration::from_secs(1);
            s.payment.retry_max_secs = Duration::from_secs(2);
        })
        .await;
    let activity = app.live_activity(3, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 3).await;
    let declined = |user: i64, order_no: String| {
        let (app, platform) = (&app, &platform);
        async move {
            let payment = no(&app.payment(user, &order_no).await);
            platform
                .sim(
                    &format!("/sim/pay/{payment}"),
                    json!({"outcome": "PAYERROR"}),
                )
                .await;
            payment_becomes(app, &payment, "FAILED").await;
            payment
        }
    };

    // A new payment after a decline: the old one closed first.
    let (user, order_no) = (orders[0].0, orders[0].1.clone());
    let old = declined(user, order_no.clone()).await;
    let new = no(&app.payment(user, &order_no).await);
    assert_ne!(old, new);
    assert_eq!(platform.trade(&old).await["state"], "CLOSED");
    let seen = requests(&platform).await;
    let closed_at = seen
        .iter()
        .position(|(m, p)| m == "POST" && p.contains(&format!("/out-trade-no/{old}/close")))
        .expect("the old trade closed");
    let created_at = seen
        .iter()
        .rposition(|(m, p)| m == "POST" && p == "/v3/pay/transactions/native")
        .expect("the new payment made");
    assert!(
        closed_at < created_at,
        "closed before the new one: {seen:?}"
    );
    let res = platform
        .sim_status(&format!("/sim/pay/{old}"), json!({"times": 1}))
        .await;
    assert_eq!(res, 409, "the old QR code no longer takes money");
    platform
        .sim(&format!("/sim/pay/{new}"), json!({"times": 1}))
        .await;
    assert_eq!(app.order_status(user, &order_no).await, "PAID");

    // The buyer pays the declined payment after all; its callback is lost.
    let (user, order_no) = (orders[1].0, orders[1].1.clone());
    let failed = declined(user, order_no.clone()).await;
    platform
        .sim(&format!("/sim/pay/{failed}"), json!({"deliver": false}))
        .await;
    eventually("paid through the failed payment", SETTLE, || async {
        (app.order_status(user, &order_no).await == "PAID").then_some(())
    })
    .await;
    assert_eq!(payment_status(&app, &failed).await, "SUCCESS");

    // The order is cancelled: its failed payment is closed at the platform.
    let (user, order_no) = (orders[2].0, orders[2].1.clone());
    let failed = declined(user, order_no.clone()).await;
    assert_eq!(app.cancel(user, &order_no).await.status(), 200);
    eventually("the failed trade closed", SETTLE, || async {
        (platform.trade(&failed).await["state"] == "CLOSED").then_some(())
    })
    .await;
}

/// Pay intents went to WeChat Pay; the shop then moves to Stripe (a
/// restart with `payment.provider = "stripe"`, WeChat Pay still
/// configured). The payments made through WeChat Pay finish there: a
/// callback to its route is applied, a lost one is found by WeChat Pay's
/// query, and new payments go to Stripe.
#[tokio::test]
async fn a_switch_of_provider_finishes_the_payments_made_through_the_old_one() {
    let platform = Platform::start();
    let stripe = LocalStripe::start().await;
    let secret = format!("whsec_{}", uuid::Uuid::new_v4().simple());
    let before = platform
        .app(|s| {
            s.payment.stripe = Some(stripe_settings(&stripe, &secret));
            s.payment.sweeper_enabled = false;
        })
        .await;
    let activity = before.live_activity(3, 1, 1).await;
    let orders = before.waiting_orders(activity, 1, 3).await;
    let called_back = no(&before.payment(orders[0].0, &orders[0].1).await);
    let queried = no(&before.payment(orders[1].0, &orders[1].1).await);
    let after = before
        .sibling(|s| {
            s.payment.provider = Some(ProviderKind::Stripe);
            s.payment.sweeper_enabled = true;
            s.payment.query_after_secs = Duration::from_secs(1);
        })
        .await;
    platform.notify(&after).await;

    let delivered = platform
        .sim(&format!("/sim/pay/{called_back}"), json!({"times": 1}))
        .await;
    assert_eq!(delivered["statuses"], json!([204]), "{delivered}");
    assert_eq!(after.order_status(orders[0].0, &orders[0].1).await, "PAID");

    platform
        .sim(&format!("/sim/pay/{queried}"), json!({"deliver": false}))
        .await;
    eventually("found by WeChat Pay's query", SETTLE, || async {
        (after.order_status(orders[1].0, &orders[1].1).await == "PAID").then_some(())
    })
    .await;

    let new = after.payment(orders[2].0, &orders[2].1).await;
    assert_eq!(new["provider"], "stripe", "{new}");
    assert!(new["client_secret"].as_str().is_some(), "{new}");
}

#[derive(QueryableByName)]
struct PlanLine {
    #[diesel(sql_type = diesel::sql_types::Text)]
    #[diesel(column_name = "QUERY PLAN")]
    line: String,
}

/// `GET /orders/{no}` and the pay call find an order's payments through
/// an index, not by reading every payment.
#[tokio::test]
async fn an_orders_payments_are_found_through_an_index() {
    let app = spawn_app().await;
    let url = app.settings.postgres.url.expose_secret().to_owned();
    let plan = tokio::task::spawn_blocking(move || {
        let mut conn = PgConnection::establish(&url).expect("connect");
        diesel::sql_query("SET enable_seqscan = off")
            .execute(&mut conn)
            .unwrap();
        diesel::sql_query(
            "EXPLAIN SELECT payment_no FROM payments WHERE order_no = 42 \
             ORDER BY created_at DESC LIMIT 1",
        )
        .load::<PlanLine>(&mut conn)
        .unwrap()
        .into_iter()
        .map(|l| l.line)
        .collect::<Vec<_>>()
        .join("\n")
    })
    .await
    .unwrap();
    assert!(!plan.contains("Seq Scan on payments"), "{plan}");
}
