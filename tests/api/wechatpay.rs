//! WeChat Pay API v3 against the platform simulator
//! (`examples/wechatpay_sim.rs`, a process; checked against the official
//! wechatpay-java SDK by `tests/wechatpay-sdk`): prepay, callbacks applied
//! once, spoiled callbacks refused with the answer that makes WeChat Pay
//! send them again, the timeout close at the provider, late payments
//! refunded, a dropped callback found by the query, and the provider
//! stopped with SIGSTOP during pay and refund.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rsa::Generate;
use rsa::pkcs8::{EncodePrivateKey, EncodePublicKey, LineEnding};
use seckill::config::{ProviderKind, Settings, WechatPaySettings};
use serde_json::{Value, json};

use crate::helpers::{TestApp, eventually, json, spawn_app_with};

const MCHID: &str = "1900000001";
const MERCHANT_SERIAL: &str = "5157F09EFDC096DE15EBE81A47057A7232F1B8E1";
pub(crate) const APPID: &str = "wxd678efh567hg6787";

/// The simulator process (killed when dropped) and the merchant's keys.
pub(crate) struct Platform {
    child: Child,
    pub(crate) url: String,
    pub(crate) serials: Vec<String>,
    pub(crate) dir: PathBuf,
    apiv3_key: String,
    http: reqwest::Client,
}

impl Drop for Platform {
    fn drop(&mut self) {
        self.signal("CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `target/<profile>/examples/wechatpay_sim`, built by `scripts/test.sh`
/// (`cargo build --example wechatpay_sim`).
fn simulator() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps");
    profile.join("examples").join("wechatpay_sim")
}

impl Platform {
    pub(crate) fn start() -> Self {
        let dir = std::env::temp_dir().join(format!("seckill-wechatpay-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(dir.join("platform")).expect("a temporary directory");
        // The merchant's key, made now (no key is committed).
        let key = rsa::PrivateKey::generate();
        std::fs::write(
            dir.join("merchant.pem"),
            key.to_pkcs8_pem(LineEnding::LF).expect("PKCS#8").as_bytes(),
        )
        .unwrap();
        std::fs::write(
            dir.join("merchant.pub.pem"),
            key.to_public_key()
                .to_public_key_pem(LineEnding::LF)
                .expect("SPKI"),
        )
        .unwrap();
        let apiv3_key: String = (0..32).map(|_| fastrand::alphanumeric()).collect();
        let path = simulator();
        assert!(
            path.exists(),
            "{} is missing: `cargo build --example wechatpay_sim` (scripts/test.sh does)",
            path.display()
        );
        let mut child = Command::new(&path)
            .args(["--mchid", MCHID, "--merchant-serial", MERCHANT_SERIAL])
            .arg("--merchant-public-key")
            .arg(dir.join("merchant.pub.pem"))
            .arg("--platform-key-dir")
            .arg(dir.join("platform"))
            .args(["--apiv3-key", &apiv3_key])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the simulator runs");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the simulator's first line");
        let ready: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("the simulator did not start: {e}: {line:?}"));
        Self {
            child,
            url: ready["url"].as_str().unwrap().to_owned(),
            serials: serde_json::from_value(ready["serials"].clone()).unwrap(),
            dir,
            apiv3_key,
            // A connection per call: a pooled one left idle past the
            // server's keep-alive (the SDK check takes seconds between
            // calls) can be closed as a request goes out on it, which
            // reqwest reports as an incomplete message (seen in a fresh run).
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .pool_max_idle_per_host(0)
                .build()
                .unwrap(),
        }
    }

    /// This merchant account's `[payment.wechatpay]`, with `extra` fields
    /// (`trade_type`, `openid_claim`) on top.
    pub(crate) fn wechatpay_settings(&self, extra: Value) -> WechatPaySettings {
        let mut fields = json!({
            "base_url": self.url,
            "mchid": MCHID,
            "appid": APPID,
            "merchant_serial": MERCHANT_SERIAL,
            "merchant_key_file": self.dir.join("merchant.pem").display().to_string(),
            "apiv3_key": self.apiv3_key,
            "platform_key_dir": self.dir.join("platform").display().to_string(),
            "notify_url": "https://shop.example/api/v1/payments/notify/wechatpay",
        });
        for (k, v) in extra.as_object().into_iter().flatten() {
            fields[k] = v.clone();
        }
        serde_json::from_value(fields).expect("[payment.wechatpay]")
    }

    /// Settings paying through this platform.
    pub(crate) fn settings(&self, s: &mut Settings) {
        s.payment.provider = Some(ProviderKind::Wechatpay);
        s.payment.wechatpay = Some(self.wechatpay_settings(json!({})));
        s.payment.sweep_interval_ms = Duration::from_millis(200);
    }

    /// Callbacks go to `app` from now on.
    pub(crate) async fn notify(&self, app: &TestApp) {
        let url = format!("{}/api/v1/payments/notify/wechatpay", app.address);
        self.sim("/sim/notify-to", json!({"url": url})).await;
    }

    /// A server paying through this platform; the platform's callbacks go
    /// to it.
    pub(crate) async fn app(&self, tweak: impl FnOnce(&mut Settings)) -> TestApp {
        let app = spawn_app_with(|s| {
            self.settings(s);
            tweak(s);
        })
        .await;
        self.notify(&app).await;
        app
    }

    pub(crate) async fn sim(&self, path: &str, body: Value) -> Value {
        let res = self
            .http
            .post(format!("{}{path}", self.url))
            .json(&body)
            .send()
            .await
            .expect("the simulator answers");
        assert!(res.status().is_success(), "{path}: {}", res.status());
        res.json().await.expect("JSON")
    }

    /// A `/sim` call that may be refused: its status.
    pub(crate) async fn sim_status(&self, path: &str, body: Value) -> u16 {
        self.http
            .post(format!("{}{path}", self.url))
            .json(&body)
            .send()
            .await
            .expect("the simulator answers")
            .status()
            .as_u16()
    }

    pub(crate) async fn state(&self) -> Value {
        self.http
            .get(format!("{}/sim/state", self.url))
            .send()
            .await
            .expect("the simulator answers")
            .json()
            .await
            .expect("JSON")
    }

    pub(crate) async fn trade(&self, payment_no: &str) -> Value {
        let state = self.state().await;
        let trades = state["trades"].as_array().unwrap();
        let found: Vec<&Value> = trades
            .iter()
            .filter(|t| t["out_trade_no"] == payment_no)
            .collect();
        assert_eq!(found.len(), 1, "one trade for {payment_no}: {state}");
        found[0].clone()
    }

    pub(crate) fn signal(&self, signal: &str) {
        let _ = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status();
    }
}

async fn order(app: &TestApp, user: i64, order_no: &str) -> Value {
    let res = app
        .get(
            &format!("/api/v1/orders/{order_no}"),
            Some(&app.user_token(user)),
        )
        .await;
    assert_eq!(res.status(), 200);
    json(res).await
}

/// Purchase → prepay (Native: a `code_url`) → callback → PAID. The same
/// callback five times changes nothing after the first, under the second
/// platform key too (both loaded: a rotation). A tampered body, an unknown
/// serial and an old timestamp are each answered 4xx `FAIL` and change
/// nothing.
#[tokio::test]
async fn a_wechat_pay_sale_pays_once_and_refuses_spoiled_callbacks() {
    let platform = Platform::start();
    let app = platform.app(|_| {}).await;
    let activity = app.live_activity(5, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (user, order_no) = (orders[0].0, orders[0].1.as_str());

    let first = app.payment(user, order_no).await;
    assert_eq!(first["provider"], "wechatpay");
    let code_url = first["code_url"].as_str().unwrap().to_owned();
    assert!(
        code_url.starts_with("weixin://wxpay/bizpayurl?pr="),
        "{first}"
    );
    let again = app.payment(user, order_no).await;
    assert_eq!(
        (&again["payment_no"], &again["code_url"]),
        (&first["payment_no"], &first["code_url"])
    );
    let payment_no = first["payment_no"].as_str().unwrap();
    // The buyer page shows the code_url as a QR code; nobody else gets it.
    let qr = format!("/api/v1/orders/{order_no}/pay/qr");
    let res = app.get(&qr, Some(&app.user_token(user))).await;
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-type"], "image/svg+xml");
    let svg = res.text().await.unwrap();
    assert!(svg.contains("<svg") && svg.contains("<path"), "{svg}");
    assert_eq!(
        app.get(&qr, Some(&app.user_token(user + 1000)))
            .await
            .status(),
        404
    );
    let trade = platform.trade(payment_no).await;
    assert_eq!(trade["amount"], 9900);
    assert_eq!(
        trade["notify_url"],
        "https://shop.example/api/v1/payments/notify/wechatpay"
    );
    let state = platform.state().await;
    let requests = state["requests"].as_array().unwrap();
    assert!(
        !requests.is_empty() && requests.iter().all(|r| r["verified"] == true),
        "every request our adapter made verified at the platform: {requests:?}"
    );

    // The buyer pays; the platform's callback is held back for now.
    platform
        .sim(&format!("/sim/pay/{payment_no}"), json!({"deliver": false}))
        .await;
    for (tamper, status) in [("body", 401), ("serial", 401), ("timestamp", 401)] {
        let answer = platform
            .sim(
                &format!("/sim/deliver/{payment_no}"),
                json!({"tamper": tamper}),
            )
            .await;
        assert_eq!(answer["status"], status, "{tamper}: {answer}");
        let body: Value = serde_json::from_str(answer["body"].as_str().unwrap()).unwrap();
        assert_eq!(body["code"], "FAIL", "{tamper}: {body}");
        assert!(body["message"].as_str().is_some_and(|m| !m.is_empty()));
        assert_eq!(
            app.order_status(user, order_no).await,
            "WAITING_PAY",
            "{tamper}"
        );
    }

    platform
        .sim("/sim/sign-with", json!({"serial": platform.serials[1]}))
        .await;
    for i in 0..5 {
        let answer = platform
            .sim(
                &format!("/sim/deliver/{payment_no}"),
                json!({"tamper": null}),
            )
            .await;
        assert_eq!(answer["status"], 204, "delivery {i}: {answer}");
    }
    assert_eq!(app.order_status(user, order_no).await, "PAID");
    assert_eq!(
        app.get(&qr, Some(&app.user_token(user))).await.status(),
        404,
        "nothing left to pay"
    );
    let stats = app.stats(activity).await;
    assert_eq!(
        (stats["orders"]["PAID"].as_i64(), stats["db_sold"].as_i64()),
        (Some(1), Some(1))
    );
    assert_eq!(
        app.count("SELECT count(*) AS n FROM outbox WHERE topic = 'order.paid'")
            .await,
        1,
        "paid once"
    );
    let shown = order(&app, user, order_no).await;
    assert_eq!(shown["payment"]["status"], "SUCCESS", "{shown}");
    assert_eq!(shown["payment"]["provider"], "wechatpay");
    let outcomes = [
        app.callbacks("applied").await,
        app.callbacks("duplicate").await,
        app.callbacks("bad_signature").await,
    ];
    assert_eq!(outcomes, [1, 4, 3], "applied, duplicates, refused");
}

/// The unpaid-timeout close closes the platform's trade; a buyer who paid
/// there first (the callback not delivered) makes the order go the
/// late-payment way: REFUND_REQUIRED, the refund sent under one refund
/// number, REFUNDED by the refund callback.
#[tokio::test]
async fn the_timeout_closes_the_trade_and_a_payment_made_before_is_refunded_by_callback() {
    let platform = Platform::start();
    let app = platform
        .app(|s| {
            s.workers.closer_interval_ms = Duration::from_millis(200);
            s.payment.query_after_secs = Duration::from_secs(3600);
        })
        .await;
    // Paid at the platform within the window: 3 s was too short for a
    // host 3x slower (the trade closed before the buyer paid, 409).
    let activity = app.live_activity_paying_within(2, 15).await;
    let orders = app.waiting_orders(activity, 1, 2).await;
    let (paid_user, paid_order) = (orders[0].0, orders[0].1.as_str());
    let (idle_user, idle_order) = (orders[1].0, orders[1].1.as_str());
    let paid = app.payment(paid_user, paid_order).await;
    let idle = app.payment(idle_user, idle_order).await;
    let paid_no = paid["payment_no"].as_str().unwrap();
    let idle_no = idle["payment_no"].as_str().unwrap();
    platform
        .sim(&format!("/sim/pay/{paid_no}"), json!({"deliver": false}))
        .await;

    eventually("both orders closed", Duration::from_secs(60), || async {
        let a = app.order_status(paid_user, paid_order).await;
        let b = app.order_status(idle_user, idle_order).await;
        (a == "CLOSED" && b == "CLOSED").then_some(())
    })
    .await;
    eventually(
        "the idle trade closed at the platform",
        Duration::from_secs(60),
        || async { (platform.trade(idle_no).await["state"] == "CLOSED").then_some(()) },
    )
    .await;
    let refunded = app
        .order_once_payment_is(paid_user, paid_order, "REFUNDED")
        .await;
    assert_eq!(
        refunded["status"], "CLOSED",
        "the order is not revived: {refunded}"
    );
    let refund_no = refunded["payment"]["refund_no"]
        .as_str()
        .unwrap()
        .to_owned();
    let state = platform.state().await;
    let refunds = state["refunds"].as_array().unwrap();
    assert_eq!(refunds.len(), 1, "{state}");
    assert_eq!(refunds[0]["out_refund_no"], refund_no.as_str());
    assert_eq!(refunds[0]["out_trade_no"], paid_no);
    assert_eq!(refunds[0]["amount"], 9900);
    assert_eq!(app.order_status(idle_user, idle_order).await, "CLOSED");
    assert_eq!(
        app.count(
            "SELECT count(*) AS n FROM payments WHERE status = 'FAILED' AND closed_at IS NOT NULL"
        )
        .await,
        1,
        "the idle payment is closed"
    );
    assert_eq!(
        app.callbacks("refund_settled").await,
        1,
        "settled by the refund callback"
    );
    assert_eq!(
        app.metric("seckill_payment_refunds_total{status=\"REFUNDED\"}")
            .await
            .unwrap_or(0),
        1
    );
    let stats = app.stats(activity).await;
    assert_eq!(
        (stats["db_sold"].as_i64(), stats["db_available"].as_i64()),
        (Some(0), Some(2))
    );
}

/// The platform never sends the callback: the payment is queried once
/// `payment.query_after_secs` has passed, and the order is PAID through
/// the same transition.
#[tokio::test]
async fn a_dropped_callback_is_found_by_the_query() {
    let platform = Platform::start();
    let app = platform
        .app(|s| s.payment.query_after_secs = Duration::from_secs(2))
        .await;
    let activity = app.live_activity(1, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (user, order_no) = (orders[0].0, orders[0].1.as_str());
    let payment_no = app.payment(user, order_no).await["payment_no"]
        .as_str()
        .unwrap()
        .to_owned();
    platform
        .sim(&format!("/sim/pay/{payment_no}"), json!({"deliver": false}))
        .await;
    let paid_after = Instant::now();
    eventually(
        "paid through the query",
        Duration::from_secs(60),
        || async { (app.order_status(user, order_no).await == "PAID").then_some(()) },
    )
    .await;
    println!(
        "PAID {:.1}s after the buyer paid",
        paid_after.elapsed().as_secs_f64()
    );
    assert_eq!(app.callbacks("applied").await, 1);
    assert!(
        app.metric("seckill_payment_provider_calls_total{call=\"query\",outcome=\"ok\"}")
            .await
            .unwrap_or(0)
            >= 1
    );
    // The callback arriving now is a duplicate.
    let answer = platform
        .sim(
            &format!("/sim/deliver/{payment_no}"),
            json!({"tamper": null}),
        )
        .await;
    assert_eq!(answer["status"], 204);
    assert_eq!(app.stats(activity).await["db_sold"], 1);
}

/// The platform stopped (SIGSTOP) while the buyer pays: 503 RETRY_LATER,
/// and once it is back the same payment is created there, once. An
/// after-sale refund asked while it is stopped completes once it is back.
#[tokio::test]
async fn pay_and_refund_while_the_platform_is_stopped() {
    let platform = Platform::start();
    let app = platform
        .app(|s| s.payment.provider_timeout_ms = Duration::from_millis(1000))
        .await;
    let activity = app.live_activity(1, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (user, order_no) = (orders[0].0, orders[0].1.as_str());

    platform.signal("STOP");
    let res = app.pay(user, order_no).await;
    assert_eq!(res.status(), 503);
    assert!(
        res.headers().contains_key("retry-after"),
        "the buyer is told when to come back"
    );
    assert_eq!(json(res).await["code"], "RETRY_LATER");
    platform.signal("CONT");
    // The platform answers again, but a host busy enough may still take
    // longer than the 1 s this server gives a provider call: that answer
    // is 503 RETRY_LATER "pay again", and the buyer's app pays again.
    let paid = eventually(
        "the payment once the platform is back",
        Duration::from_secs(60),
        || async {
            let res = app.pay(user, order_no).await;
            let status = res.status().as_u16();
            let body = json(res).await;
            match status {
                200 => Some(body),
                503 if body["code"] == "RETRY_LATER" => None,
                _ => panic!("pay answered {status}: {body}"),
            }
        },
    )
    .await;
    let payment_no = paid["payment_no"].as_str().unwrap();
    let trade = platform.trade(payment_no).await;
    assert!(trade["creates"].as_i64().unwrap() >= 1, "{trade}");
    assert_eq!(paid["code_url"], trade["code_url"], "the same payment");
    // The call that timed out reached the platform once it was resumed,
    // under the same payment number: one payment there, whatever came first.
    let state = platform.state().await;
    assert_eq!(state["trades"].as_array().unwrap().len(), 1, "{state}");

    platform
        .sim(&format!("/sim/pay/{payment_no}"), json!({"times": 1}))
        .await;
    assert_eq!(app.order_status(user, order_no).await, "PAID");

    platform.signal("STOP");
    let res = app
        .post_json(
            &format!("/api/v1/admin/orders/{order_no}/refund"),
            &json!({"reason": "returned"}),
            Some(&app.admin_token()),
        )
        .await;
    assert_eq!(res.status(), 202);
    let refund = json(res).await;
    assert_eq!(refund["status"], "REFUNDING");
    assert_eq!(refund["payment_no"], payment_no);
    // Attempts time out while it is stopped.
    eventually(
        "an attempt without an answer",
        Duration::from_secs(60),
        || async {
            (app.metric(
                "seckill_payment_provider_calls_total{call=\"refund\",outcome=\"unknown\"}",
            )
            .await
            .unwrap_or(0)
                >= 1)
                .then_some(())
        },
    )
    .await;
    platform.signal("CONT");
    let shown = app.order_once_payment_is(user, order_no, "REFUNDED").await;
    assert_eq!(
        shown["status"], "PAID",
        "an after-sale refund leaves the order PAID"
    );
    assert_eq!(shown["payment"]["refund_no"], refund["refund_no"]);
    let state = platform.state().await;
    assert_eq!(
        state["refunds"].as_array().unwrap().len(),
        1,
        "one refund: {state}"
    );

    // The same call again: the same refund.
    let res = app
        .post_json(
            &format!("/api/v1/admin/orders/{order_no}/refund"),
            &json!({"reason": "returned"}),
            Some(&app.admin_token()),
        )
        .await;
    assert_eq!(res.status(), 202);
    let again = json(res).await;
    assert_eq!(
        (&again["refund_no"], &again["status"]),
        (&refund["refund_no"], &json!("REFUNDED"))
    );
}

/// What an after-sale refund refuses.
#[tokio::test]
async fn an_after_sale_refund_needs_a_paid_order_an_admin_and_a_reason() {
    let platform = Platform::start();
    let app = platform.app(|_| {}).await;
    let activity = app.live_activity(1, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (user, order_no) = (orders[0].0, orders[0].1.as_str());
    let path = format!("/api/v1/admin/orders/{order_no}/refund");
    let res = app
        .post_json(&path, &json!({"reason": "x"}), Some(&app.admin_token()))
        .await;
    assert_eq!(res.status(), 409);
    assert_eq!(json(res).await["code"], "INVALID_STATE");
    let res = app
        .post_json(&path, &json!({"reason": "x"}), Some(&app.user_token(user)))
        .await;
    assert_eq!(res.status(), 403);
    for body in [
        json!({"reason": ""}),
        json!({"reason": "r".repeat(81)}),
        json!({}),
    ] {
        let res = app.post_json(&path, &body, Some(&app.admin_token())).await;
        assert_eq!(res.status(), 400, "{body}");
    }
    let res = app
        .post_json(
            "/api/v1/admin/orders/123/refund",
            &json!({"reason": "x"}),
            Some(&app.admin_token()),
        )
        .await;
    assert_eq!(res.status(), 404);
    assert_eq!(app.count("SELECT count(*) AS n FROM refunds").await, 0);
    // Another provider's callback route is not there: a problem, like any
    // unknown route.
    let res = app
        .post_json("/api/v1/payments/notify/stripe", &json!({}), None)
        .await;
    assert_eq!(res.status(), 404);
    assert_eq!(json(res).await["code"], "NOT_FOUND");
}

/// The official wechatpay-java SDK (`tests/wechatpay-sdk`, built by
/// `scripts/wechatpay-sdk.sh`), run as `java SdkCheck <mode> …`.
struct Sdk {
    classpath: String,
}

impl Sdk {
    fn find() -> Self {
        let dir = PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/wechatpay-sdk/target"
        ));
        let deps = std::fs::read_to_string(dir.join("classpath.txt")).unwrap_or_else(|e| {
            panic!(
                "{}: {e}: scripts/wechatpay-sdk.sh builds the SDK check",
                dir.display()
            )
        });
        Self {
            classpath: format!("{}:{}", dir.join("classes").display(), deps.trim()),
        }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new("java");
        c.args(["-cp", &self.classpath, "SdkCheck"]).args(args);
        c
    }

    /// Runs a mode to its end; its last line of output, parsed.
    async fn run(&self, args: &[&str]) -> Value {
        let mut command = self.command(args);
        let output = tokio::task::spawn_blocking(move || command.output())
            .await
            .unwrap()
            .expect("java runs");
        let stdout = String::from_utf8_lossy(&output.stdout).to_string();
        assert!(
            output.status.success(),
            "SdkCheck {args:?}: {}\n{stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        serde_json::from_str(stdout.lines().last().unwrap_or_default())
            .unwrap_or_else(|e| panic!("SdkCheck {args:?} printed {stdout:?}: {e}"))
    }
}

/// The official SDK agrees with us, so that our adapter is not tested
/// against our own misunderstanding: it verifies the signatures our
/// adapter makes, its client pays, queries, refunds and closes against our
/// simulator (taking our simulator's signed answers), its
/// `NotificationParser` parses our simulator's callbacks (and refuses a
/// tampered one), and a callback it seals and signs is accepted by our
/// server.
#[tokio::test]
async fn the_official_sdk_agrees_with_our_adapter_and_our_simulator() {
    let sdk = Sdk::find();
    let platform = Platform::start();
    // A platform key the SDK signs with, loaded by our server beside the
    // simulator's two.
    let sdk_serial = "PUB_KEY_ID_SDK_SIGNED";
    let key = rsa::PrivateKey::generate();
    let sdk_key = platform.dir.join("sdk-platform.pem");
    std::fs::write(
        &sdk_key,
        key.to_pkcs8_pem(LineEnding::LF).unwrap().as_bytes(),
    )
    .unwrap();
    std::fs::write(
        platform.dir.join(format!("platform/{sdk_serial}.pem")),
        key.to_public_key()
            .to_public_key_pem(LineEnding::LF)
            .unwrap(),
    )
    .unwrap();
    let app = platform.app(|_| {}).await;
    let activity = app.live_activity(1, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (user, order_no) = (orders[0].0, orders[0].1.as_str());
    let payment_no = app.payment(user, order_no).await["payment_no"]
        .as_str()
        .unwrap()
        .to_owned();
    let dir = platform.dir.display().to_string();

    // 1. Our adapter's request signatures, verified by the SDK.
    let requests = platform.state().await["requests"].clone();
    let file = platform.dir.join("requests.json");
    std::fs::write(&file, requests.to_string()).unwrap();
    let verified = sdk
        .run(&[
            "verify-requests",
            &format!("{dir}/merchant.pub.pem"),
            &file.display().to_string(),
        ])
        .await;
    assert!(verified["verified"].as_i64() >= Some(1), "{verified}");

    // 2. The SDK's client against our simulator.
    let serial = &platform.serials[0];
    let client = sdk
        .run(&[
            "client",
            &platform.url,
            MCHID,
            MERCHANT_SERIAL,
            &format!("{dir}/merchant.pem"),
            serial,
            &format!("{dir}/platform/{serial}.pem"),
            &platform.apiv3_key,
            "880000001",
        ])
        .await;
    assert_eq!(client["closed"], true, "{client}");

    // 3. Our simulator's callbacks, parsed by the SDK.
    let mut listener = sdk
        .command(&[
            "listen",
            serial,
            &format!("{dir}/platform/{serial}.pem"),
            &platform.apiv3_key,
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("java runs");
    let mut lines = BufReader::new(listener.stdout.take().unwrap()).lines();
    let ready: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    platform
        .sim("/sim/notify-to", json!({"url": ready["url"]}))
        .await;
    let paid = platform
        .sim(&format!("/sim/pay/{payment_no}"), json!({"times": 2}))
        .await;
    assert_eq!(paid["statuses"], json!([204, 204]), "the SDK parsed both");
    let spoiled = platform
        .sim(
            &format!("/sim/deliver/{payment_no}"),
            json!({"tamper": "body"}),
        )
        .await;
    assert_eq!(spoiled["status"], 401, "the SDK refused the tampered one");
    let _ = listener.kill();
    let _ = listener.wait();
    let parsed: Vec<Value> = lines
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str(&l).ok())
        .collect();
    assert_eq!(parsed.len(), 3, "{parsed:?}");
    for p in &parsed[..2] {
        assert_eq!(
            (
                &p["parsed"],
                &p["out_trade_no"],
                &p["trade_state"],
                &p["total"]
            ),
            (
                &json!(true),
                &json!(payment_no),
                &json!("SUCCESS"),
                &json!(9900)
            ),
            "{p}"
        );
    }
    assert_eq!(parsed[2]["parsed"], false);
    assert_eq!(
        app.order_status(user, order_no).await,
        "WAITING_PAY",
        "the callbacks went to the SDK"
    );

    // 4. A callback the SDK sealed and signed, accepted by our server.
    let answer = sdk
        .run(&[
            "sign-callback",
            &format!("{}/api/v1/payments/notify/wechatpay", app.address),
            sdk_serial,
            &sdk_key.display().to_string(),
            &platform.apiv3_key,
            &payment_no,
            "9900",
        ])
        .await;
    assert_eq!(answer["status"], 204, "{answer}");
    assert_eq!(app.order_status(user, order_no).await, "PAID");
}

/// The daily statement reconciliation against the simulator's trade bill
/// finds a payment the platform has and we don't (planted), an amount that
/// differs (planted), and a payment we have and the platform doesn't; the
/// report is kept and listed for the operator page.
#[tokio::test]
async fn the_statement_reconciliation_finds_planted_differences() {
    let platform = Platform::start();
    let app = platform.app(|_| {}).await;
    let activity = app.live_activity(3, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 3).await;
    let mut numbers = Vec::new();
    for (user, order_no) in &orders {
        let no = app.payment(*user, order_no).await["payment_no"]
            .as_str()
            .unwrap()
            .to_owned();
        platform
            .sim(&format!("/sim/pay/{no}"), json!({"times": 1}))
            .await;
        assert_eq!(app.order_status(*user, order_no).await, "PAID");
        numbers.push(no);
    }
    let planted = "990000000000000001";
    platform
        .sim(
            "/sim/plant",
            json!({"out_trade_no": planted, "amount": 5000}),
        )
        .await;
    platform
        .sim(
            "/sim/plant",
            json!({"out_trade_no": numbers[1], "amount": 9800}),
        )
        .await;
    platform
        .sim(&format!("/sim/forget/{}", numbers[2]), json!({}))
        .await;
    // The bill's day: China's, when the trades were paid (one day for all,
    // unless this ran across midnight there).
    let state = platform.state().await;
    let days: std::collections::BTreeSet<String> = state["trades"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["success_time"].as_str())
        .map(|s| s[..10].to_owned())
        .collect();
    let day = paid_day(&platform, &numbers[0]).await;
    assert!(
        days.len() <= 1,
        "trades paid across midnight in China: {days:?}"
    );

    let res = app
        .post_json(
            "/api/v1/admin/payments/statement",
            &json!({"date": day}),
            Some(&app.admin_token()),
        )
        .await;
    assert_eq!(res.status(), 200);
    let report = json(res).await;
    assert_eq!(report["provider_rows"], 3, "{report}");
    assert_eq!(report["our_rows"], 3, "{report}");
    assert_eq!(
        report["missing_here"],
        json!([{"reference": planted, "txn_id": report["missing_here"][0]["txn_id"], "amount_cents": 5000}]),
        "{report}"
    );
    assert_eq!(
        report["mismatched"],
        json!([{"payment_no": numbers[1], "ours_cents": 9900, "theirs_cents": 9800}])
    );
    assert_eq!(
        report["missing_there"].as_array().unwrap().len(),
        1,
        "{report}"
    );
    assert_eq!(
        report["missing_there"][0]["payment_no"],
        numbers[2].as_str()
    );

    let res = app
        .get(
            "/api/v1/admin/payments/statements",
            Some(&app.admin_token()),
        )
        .await;
    assert_eq!(res.status(), 200);
    let kept = json(res).await;
    assert_eq!(kept["reports"][0]["mismatched"], report["mismatched"]);
    assert!(kept["reports"][0]["checked_at"].is_string());

    let res = app
        .post_json(
            "/api/v1/admin/payments/statement",
            &json!({"date": "2999-01-01"}),
            Some(&app.admin_token()),
        )
        .await;
    assert_eq!(res.status(), 400);
    for body in [json!({"date": "yesterday"}), json!({"day": day})] {
        let res = app
            .post_json(
                "/api/v1/admin/payments/statement",
                &body,
                Some(&app.admin_token()),
            )
            .await;
        assert_eq!(res.status(), 400, "{body}");
    }
}

/// The China day a trade was paid on, as the simulator recorded it.
async fn paid_day(platform: &Platform, payment_no: &str) -> String {
    let state = platform.state().await;
    state["trades"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["out_trade_no"] == payment_no)
        .and_then(|t| t["success_time"].as_str())
        .map(|s| s[..10].to_owned())
        .expect("a paid trade has a success time")
}

/// A buyer's token as an identity provider in front of a mini-program
/// issues it: the test secret's HS256, with the buyer's WeChat `openid`.
fn token_with_openid(app: &TestApp, user: i64, openid: &str) -> String {
    use secrecy::ExposeSecret;
    let claims = json!({
        "sub": user.to_string(), "role": "user", "openid": openid,
        "exp": chrono::Utc::now().timestamp() + 3600,
    });
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(
            app.settings.auth.jwt_secret.expose_secret().as_bytes(),
        )
        .unwrap(),
    )
    .unwrap()
}

/// `paySign` verifies with the merchant's public key over the four lines
/// of WeChat Pay's JSAPI documentation.
fn pay_sign_holds(platform: &Platform, jsapi: &Value) -> bool {
    let mut merchant = seckill::payments::wechatpay::crypto::PlatformKeys::default();
    let pem = std::fs::read_to_string(platform.dir.join("merchant.pub.pem")).unwrap();
    merchant.add_pem("merchant", &pem).unwrap();
    let message = format!(
        "{}\n{}\n{}\n{}\n",
        jsapi["appId"].as_str().unwrap(),
        jsapi["timeStamp"].as_str().unwrap(),
        jsapi["nonceStr"].as_str().unwrap(),
        jsapi["package"].as_str().unwrap()
    );
    merchant
        .verify(
            "merchant",
            message.as_bytes(),
            jsapi["paySign"].as_str().unwrap(),
        )
        .is_ok()
}

/// WeChat Pay JSAPI, the mini-program's payment: the pay answer carries
/// exactly `wx.requestPayment`'s parameters, signed with the merchant key,
/// as the buyer whose openid the token carries (else the body gives it;
/// neither is 400 `OPENID_REQUIRED`); repeated calls give the same
/// prepay id; paid at the platform, the order is PAID.
#[tokio::test]
async fn a_mini_program_pays_through_jsapi() {
    let platform = Platform::start();
    let app = platform
        .app(|s| {
            s.payment.wechatpay = Some(
                platform
                    .wechatpay_settings(json!({"trade_type": "jsapi", "openid_claim": "openid"})),
            );
        })
        .await;
    let activity = app.live_activity(2, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 2).await;
    let (user, order_no) = (orders[0].0, orders[0].1.as_str());
    let path = format!("/api/v1/orders/{order_no}/pay");
    let token = app.user_token(user);

    let res = app.post_json(&path, &json!({}), Some(&token)).await;
    assert_eq!(res.status(), 400);
    assert_eq!(json(res).await["code"], "OPENID_REQUIRED");
    let res = app
        .post_json(&path, &json!({"openid": "not an openid!"}), Some(&token))
        .await;
    assert_eq!(res.status(), 400);
    assert_eq!(json(res).await["code"], "BAD_REQUEST");
    assert_eq!(platform.state().await["trades"], json!([]), "nothing made");

    let body = json!({"openid": "o-body-buyer"});
    let res = app.post_json(&path, &body, Some(&token)).await;
    assert_eq!(res.status(), 200);
    let paid = json(res).await;
    let jsapi = &paid["jsapi"];
    let fields: Vec<&String> = jsapi.as_object().unwrap().keys().collect();
    assert_eq!(
        fields,
        [
            "appId",
            "nonceStr",
            "package",
            "paySign",
            "signType",
            "timeStamp"
        ],
        "{paid}"
    );
    assert!(paid.get("code_url").is_none(), "{paid}");
    assert_eq!(jsapi["appId"], APPID);
    assert_eq!(jsapi["signType"], "RSA");
    let payment_no = paid["payment_no"].as_str().unwrap();
    let trade = platform.trade(payment_no).await;
    assert_eq!(trade["trade_type"], "JSAPI");
    assert_eq!(trade["openid"], "o-body-buyer");
    assert_eq!(
        jsapi["package"],
        format!("prepay_id={}", trade["prepay_id"].as_str().unwrap())
    );
    assert!(pay_sign_holds(&platform, jsapi), "{jsapi}");
    let again = json(app.post_json(&path, &body, Some(&token)).await).await;
    assert_eq!(
        again["jsapi"], paid["jsapi"],
        "the same payment, the same prepay id"
    );

    // The token's openid, when it carries one; a body naming another is refused.
    let (other, other_order) = (orders[1].0, orders[1].1.as_str());
    let with_claim = token_with_openid(&app, other, "o-token-buyer");
    let other_path = format!("/api/v1/orders/{other_order}/pay");
    let res = app
        .post_json(
            &other_path,
            &json!({"openid": "o-someone-else"}),
            Some(&with_claim),
        )
        .await;
    assert_eq!(res.status(), 400);
    let res = app
        .post_json(&other_path, &json!({}), Some(&with_claim))
        .await;
    assert_eq!(res.status(), 200);
    let other_no = json(res).await["payment_no"].as_str().unwrap().to_owned();
    assert_eq!(platform.trade(&other_no).await["openid"], "o-token-buyer");

    platform
        .sim(&format!("/sim/pay/{payment_no}"), json!({"times": 1}))
        .await;
    assert_eq!(app.order_status(user, order_no).await, "PAID");
}

/// The official SDK's `JsapiServiceExtension` prepays against our
/// simulator and builds `wx.requestPayment`'s parameters with the same
/// merchant key; our adapter, given its timeStamp, nonceStr and prepay
/// id, makes the very same `paySign`.
#[tokio::test]
async fn the_official_sdk_signs_jsapi_parameters_as_we_do() {
    let sdk = Sdk::find();
    let platform = Platform::start();
    let dir = platform.dir.display().to_string();
    let serial = &platform.serials[0];
    let params = sdk
        .run(&[
            "jsapi",
            &platform.url,
            MCHID,
            MERCHANT_SERIAL,
            &format!("{dir}/merchant.pem"),
            serial,
            &format!("{dir}/platform/{serial}.pem"),
            &platform.apiv3_key,
            "9000000001",
            APPID,
            "o-sdk-buyer",
        ])
        .await;
    let ours = seckill::payments::wechatpay::WechatPay::from_settings(
        &platform.wechatpay_settings(json!({"trade_type": "jsapi"})),
        Duration::from_secs(10),
        300,
    )
    .unwrap();
    let prepay_id = params["package"]
        .as_str()
        .unwrap()
        .strip_prefix("prepay_id=")
        .expect("package is prepay_id=…");
    assert_eq!(
        prepay_id,
        platform.trade("9000000001").await["prepay_id"],
        "the SDK prepaid at our simulator"
    );
    let signed = ours.request_payment(
        prepay_id,
        params["timeStamp"].as_str().unwrap().parse().unwrap(),
        params["nonceStr"].as_str().unwrap(),
    );
    assert_eq!(
        serde_json::to_value(&signed).unwrap(),
        params,
        "the same parameters, the same paySign"
    );
}
