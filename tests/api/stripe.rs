//! The Stripe-style provider against `localstripe` (PyPI), a stateful fake
//! Stripe that sends signed webhooks, run as a process (installed by
//! `scripts/localstripe.sh`): a sale paid once under five deliveries of its
//! webhook, spoiled webhooks refused, the timeout cancelling the intent and
//! a payment made before refunded, and a dropped webhook found by the
//! retrieve. localstripe ignores `Idempotency-Key`; the adapter's keys are
//! checked by its unit test (`payments::stripe`).

use std::net::TcpListener as StdListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use seckill::config::{ProviderKind, Settings, StripeSettings};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::helpers::{TestApp, eventually, json, spawn_app_with};

const SECRET_KEY: &str = "sk_test_seckill";

/// The localstripe process, killed when dropped.
pub(crate) struct LocalStripe {
    child: Child,
    pub(crate) url: String,
    http: reqwest::Client,
}

impl Drop for LocalStripe {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// localstripe listens on the port it is given: one free a moment ago.
fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl LocalStripe {
    pub(crate) async fn start() -> Self {
        let command = std::env::var("SECKILL_LOCALSTRIPE").unwrap_or_else(|_| {
            format!(
                "{}/.cache/seckill/localstripe-1.15.10/bin/localstripe",
                std::env::var("HOME").unwrap_or_default()
            )
        });
        assert!(
            std::path::Path::new(&command).exists(),
            "{command} is missing: scripts/localstripe.sh installs it (scripts/test.sh runs it)"
        );
        let port = free_port();
        let child = Command::new(&command)
            .args(["--port", &port.to_string(), "--from-scratch"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("localstripe runs");
        let server = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            // A connection per call: a pooled one left idle past the
            // server's keep-alive (the SDK check takes seconds between
            // calls) can be closed as a request goes out on it, which
            // reqwest reports as an incomplete message (seen in a fresh run).
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .pool_max_idle_per_host(0)
                .build()
                .unwrap(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while server
            .http
            .get(format!("{}/v1/payment_intents", server.url))
            .basic_auth(SECRET_KEY, Some(""))
            .send()
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "localstripe never listened");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        server
    }

    pub(crate) async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        form: &[(&str, &str)],
    ) -> Value {
        let res = self
            .http
            .request(method, format!("{}{path}", self.url))
            .basic_auth(SECRET_KEY, Some(""))
            .form(form)
            .send()
            .await
            .expect("localstripe answers");
        let status = res.status();
        let text = res.text().await.expect("a body");
        let body: Value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).expect("JSON")
        };
        assert!(status.is_success(), "{path}: {status} {body}");
        body
    }

    /// Webhooks go to `url`, signed with `secret`.
    pub(crate) async fn webhook(&self, url: &str, secret: &str) {
        self.call(
            reqwest::Method::POST,
            "/_config/webhooks/seckill",
            &[("url", url), ("secret", secret)],
        )
        .await;
    }

    /// The buyer pays the intent with a card.
    pub(crate) async fn pay(&self, intent: &str) {
        let pm = self
            .call(
                reqwest::Method::POST,
                "/v1/payment_methods",
                &[
                    ("type", "card"),
                    ("card[number]", "4242424242424242"),
                    ("card[exp_month]", "12"),
                    ("card[exp_year]", "2030"),
                    ("card[cvc]", "123"),
                ],
            )
            .await;
        let pm = pm["id"].as_str().unwrap();
        let path = format!("/v1/payment_intents/{intent}");
        self.call(reqwest::Method::POST, &path, &[("payment_method", pm)])
            .await;
        let confirmed = self
            .call(reqwest::Method::POST, &format!("{path}/confirm"), &[])
            .await;
        assert_eq!(confirmed["status"], "succeeded", "{confirmed}");
    }

    pub(crate) async fn intent(&self, id: &str) -> Value {
        self.call(
            reqwest::Method::GET,
            &format!("/v1/payment_intents/{id}"),
            &[],
        )
        .await
    }

    pub(crate) async fn intents(&self) -> Vec<Value> {
        let list = self
            .call(reqwest::Method::GET, "/v1/payment_intents?limit=100", &[])
            .await;
        list["data"].as_array().unwrap().clone()
    }
}

/// This account's `[payment.stripe]`, its webhook secret `secret`.
pub(crate) fn stripe_settings(stripe: &LocalStripe, secret: &str) -> StripeSettings {
    StripeSettings {
        api_base: stripe.url.clone(),
        secret_key: SECRET_KEY.to_owned().into(),
        webhook_secret: secret.to_owned().into(),
        previous_webhook_secret: None,
        currency: "cny".into(),
    }
}

/// A server paying through `stripe`, its webhook secret `secret`.
async fn app_for(stripe: &LocalStripe, secret: &str, tweak: impl FnOnce(&mut Settings)) -> TestApp {
    let (url, secret) = (stripe.url.clone(), secret.to_owned());
    spawn_app_with(move |s| {
        s.payment.provider = Some(ProviderKind::Stripe);
        s.payment.stripe = Some(StripeSettings {
            api_base: url,
            secret_key: SECRET_KEY.to_owned().into(),
            webhook_secret: secret.into(),
            previous_webhook_secret: None,
            currency: "cny".into(),
        });
        s.payment.sweep_interval_ms = Duration::from_millis(200);
        tweak(s);
    })
    .await
}

pub(crate) fn intent_of(client_secret: &str) -> &str {
    client_secret.split("_secret_").next().unwrap()
}

/// One webhook as it was delivered.
#[derive(Clone)]
struct Delivery {
    signature: String,
    body: Vec<u8>,
    status: u16,
}

/// A relay between localstripe and the server that keeps every webhook it
/// passes on (its raw body and signature), so that a test can deliver the
/// very same one again.
struct Relay {
    url: String,
    seen: Arc<Mutex<Vec<Delivery>>>,
}

impl Relay {
    async fn start(target: String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let kept = seen.clone();
        tokio::spawn(async move {
            let http = reqwest::Client::new();
            loop {
                let Ok((mut socket, _)) = listener.accept().await else {
                    return;
                };
                let (http, kept, target) = (http.clone(), kept.clone(), target.clone());
                tokio::spawn(async move {
                    let Some((signature, body)) = read_request(&mut socket).await else {
                        return;
                    };
                    let status = deliver(&http, &target, &signature, body.clone()).await;
                    kept.lock().unwrap().push(Delivery {
                        signature,
                        body,
                        status,
                    });
                    let answer = format!(
                        "HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                    );
                    let _ = socket.write_all(answer.as_bytes()).await;
                });
            }
        });
        Self { url, seen }
    }

    fn of_type(&self, kind: &str) -> Vec<Delivery> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|d| serde_json::from_slice::<Value>(&d.body).is_ok_and(|v| v["type"] == kind))
            .cloned()
            .collect()
    }
}

/// One HTTP/1.1 request: its `Stripe-Signature` and body.
async fn read_request(socket: &mut tokio::net::TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let header = |name: &str| {
        head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_owned())
        })
    };
    let length: usize = header("content-length")?.parse().ok()?;
    while buf.len() < head_end + length {
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Some((
        header("stripe-signature")?,
        buf[head_end..head_end + length].to_vec(),
    ))
}

async fn deliver(http: &reqwest::Client, url: &str, signature: &str, body: Vec<u8>) -> u16 {
    http.post(url)
        .header("content-type", "application/json")
        .header("stripe-signature", signature)
        .body(body)
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

/// Purchase → PaymentIntent (its client secret for the buyer) → webhook →
/// PAID. The same webhook five times changes nothing after the first; a
/// tampered body, a foreign secret's signature and an old timestamp are
/// each refused and change nothing.
#[tokio::test]
async fn a_stripe_sale_pays_once_and_refuses_spoiled_webhooks() {
    let stripe = LocalStripe::start().await;
    let secret = format!("whsec_{}", uuid::Uuid::new_v4().simple());
    // Old means past the tolerance: 15 s here.
    let app = app_for(&stripe, &secret, |s| {
        s.payment.signature_tolerance_secs = Duration::from_secs(15);
    })
    .await;
    let notify = format!("{}/api/v1/payments/notify/stripe", app.address);
    let relay = Relay::start(notify.clone()).await;
    stripe.webhook(&relay.url, &secret).await;
    let activity = app.live_activity(5, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (user, order_no) = (orders[0].0, orders[0].1.as_str());

    let first = app.payment(user, order_no).await;
    assert_eq!(first["provider"], "stripe");
    let client_secret = first["client_secret"].as_str().unwrap().to_owned();
    assert!(client_secret.starts_with("pi_"), "{first}");
    let again = app.payment(user, order_no).await;
    assert_eq!(again["client_secret"], first["client_secret"]);
    assert_eq!(
        stripe.intents().await.len(),
        1,
        "one intent for two pay calls"
    );
    let intent = intent_of(&client_secret);
    let at_stripe = stripe.intent(intent).await;
    assert_eq!(at_stripe["amount"], 9900);
    assert_eq!(at_stripe["metadata"]["payment_no"], first["payment_no"]);

    stripe.pay(intent).await;
    let delivered = eventually("the succeeded webhook", Duration::from_secs(60), || async {
        relay.of_type("payment_intent.succeeded").pop()
    })
    .await;
    assert_eq!(delivered.status, 204);
    assert_eq!(app.order_status(user, order_no).await, "PAID");
    let http = reqwest::Client::new();
    for i in 0..4 {
        let status = deliver(&http, &notify, &delivered.signature, delivered.body.clone()).await;
        assert_eq!(status, 204, "duplicate {i}");
    }

    // Spoiled: one byte of the body, a signature under another secret.
    let mut tampered = delivered.body.clone();
    let at = tampered.iter().position(|b| *b == b'9').unwrap();
    tampered[at] = b'1';
    assert_eq!(
        deliver(&http, &notify, &delivered.signature, tampered).await,
        401
    );
    let t: i64 = delivered.signature.split(',').next().unwrap()[2..]
        .parse()
        .unwrap();
    let foreign = seckill_sign("whsec_not_ours", t, &delivered.body);
    assert_eq!(
        deliver(&http, &notify, &foreign, delivered.body.clone()).await,
        401
    );
    // Old: the very same webhook once its timestamp is past the tolerance.
    let wait = (t + 16 - chrono::Utc::now().timestamp()).max(0);
    tokio::time::sleep(Duration::from_secs(wait.unsigned_abs())).await;
    assert_eq!(
        deliver(&http, &notify, &delivered.signature, delivered.body.clone()).await,
        401
    );

    let stats = app.stats(activity).await;
    assert_eq!(
        (stats["orders"]["PAID"].as_i64(), stats["db_sold"].as_i64()),
        (Some(1), Some(1))
    );
    assert_eq!(
        app.count("SELECT count(*) AS n FROM outbox WHERE topic = 'order.paid'")
            .await,
        1
    );
    let outcomes = [
        app.callbacks("applied").await,
        app.callbacks("duplicate").await,
        app.callbacks("bad_signature").await,
    ];
    assert_eq!(outcomes, [1, 4, 3], "applied, duplicates, refused");
}

/// `Stripe-Signature` of `body` at `t` under `secret` (for a signature by
/// a secret that is not the server's).
fn seckill_sign(secret: &str, t: i64, body: &[u8]) -> String {
    use hmac::{Hmac, KeyInit, Mac};
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(format!("{t}.").as_bytes());
    mac.update(body);
    format!("t={t},v1={}", hex::encode(mac.finalize().into_bytes()))
}

/// The unpaid-timeout close cancels the intent; a buyer who paid first
/// (no webhook reaches the server here) makes the order go the
/// late-payment way: refunded at localstripe under our refund number.
#[tokio::test]
async fn the_timeout_cancels_the_intent_and_a_payment_made_before_is_refunded() {
    let stripe = LocalStripe::start().await;
    let app = app_for(&stripe, "whsec_unused", |s| {
        s.workers.closer_interval_ms = Duration::from_millis(200);
        s.payment.query_after_secs = Duration::from_secs(3600);
    })
    .await;
    // Paid within the window even on a host 3x slower (3 s was not).
    let activity = app.live_activity_paying_within(2, 15).await;
    let orders = app.waiting_orders(activity, 1, 2).await;
    let (paid_user, paid_order) = (orders[0].0, orders[0].1.as_str());
    let (idle_user, idle_order) = (orders[1].0, orders[1].1.as_str());
    let paid = app.payment(paid_user, paid_order).await;
    let idle = app.payment(idle_user, idle_order).await;
    let paid_intent = intent_of(paid["client_secret"].as_str().unwrap()).to_owned();
    let idle_intent = intent_of(idle["client_secret"].as_str().unwrap()).to_owned();
    stripe.pay(&paid_intent).await;

    eventually(
        "the idle intent cancelled",
        Duration::from_secs(60),
        || async { (stripe.intent(&idle_intent).await["status"] == "canceled").then_some(()) },
    )
    .await;
    let shown = app
        .order_once_payment_is(paid_user, paid_order, "REFUNDED")
        .await;
    assert_eq!(shown["status"], "CLOSED");
    let refunds = stripe
        .call(
            reqwest::Method::GET,
            &format!("/v1/refunds?payment_intent={paid_intent}"),
            &[],
        )
        .await;
    let refunds = refunds["data"].as_array().unwrap();
    assert_eq!(refunds.len(), 1, "{refunds:?}");
    assert_eq!(
        refunds[0]["metadata"]["refund_no"],
        shown["payment"]["refund_no"]
    );
    assert_eq!(refunds[0]["amount"], 9900);
    assert_eq!(app.order_status(idle_user, idle_order).await, "CLOSED");
    assert_eq!(
        app.count(
            "SELECT count(*) AS n FROM payments WHERE status = 'FAILED' AND closed_at IS NOT NULL"
        )
        .await,
        1
    );
}

/// No webhook ever reaches the server: the payment is retrieved once
/// `payment.query_after_secs` has passed, and the order is PAID.
#[tokio::test]
async fn a_dropped_webhook_is_found_by_the_retrieve() {
    let stripe = LocalStripe::start().await;
    let app = app_for(&stripe, "whsec_unused", |s| {
        s.payment.query_after_secs = Duration::from_secs(2);
    })
    .await;
    let activity = app.live_activity(1, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (user, order_no) = (orders[0].0, orders[0].1.as_str());
    let paid = app.payment(user, order_no).await;
    stripe
        .pay(intent_of(paid["client_secret"].as_str().unwrap()))
        .await;
    eventually(
        "paid through the retrieve",
        Duration::from_secs(60),
        || async { (app.order_status(user, order_no).await == "PAID").then_some(()) },
    )
    .await;
    assert!(
        app.metric("seckill_payment_provider_calls_total{call=\"query\",outcome=\"ok\"}")
            .await
            .unwrap_or(0)
            >= 1
    );
    assert_eq!(app.stats(activity).await["db_sold"], json!(1));
}

/// A webhook signed with the endpoint's secret, but naming another
/// PaymentIntent than the payment's own, or another currency, changes
/// nothing. The genuine one pays, and the order is paid when the event
/// happened, not when the intent was made.
#[tokio::test]
async fn a_webhook_of_another_intent_or_currency_changes_nothing() {
    let stripe = LocalStripe::start().await;
    let secret = format!("whsec_{}", uuid::Uuid::new_v4().simple());
    let app = app_for(&stripe, &secret, |_| {}).await;
    let notify = format!("{}/api/v1/payments/notify/stripe", app.address);
    let activity = app.live_activity(1, 1, 1).await;
    let orders = app.waiting_orders(activity, 1, 1).await;
    let (user, order_no) = (orders[0].0, orders[0].1.as_str());
    let payment = app.payment(user, order_no).await;
    let intent = intent_of(payment["client_secret"].as_str().unwrap()).to_owned();
    let now = chrono::Utc::now().timestamp();
    let event = |id: &str, currency: &str| {
        serde_json::to_vec(&json!({
            "id": format!("evt_{}", uuid::Uuid::new_v4().simple()),
            "type": "payment_intent.succeeded",
            "created": now - 600,
            "data": {"object": {
                "id": id, "object": "payment_intent", "status": "succeeded",
                "amount": payment["amount_cents"], "amount_received": payment["amount_cents"],
                "currency": currency, "created": now - 86_400,
                "metadata": {"payment_no": payment["payment_no"], "order_no": order_no},
            }},
        }))
        .unwrap()
    };
    let http = reqwest::Client::new();
    for (id, currency) in [("pi_someone_elses", "cny"), (intent.as_str(), "usd")] {
        let body = event(id, currency);
        let status = deliver(
            &http,
            &notify,
            &seckill_sign(&secret, chrono::Utc::now().timestamp(), &body),
            body,
        )
        .await;
        assert_eq!(status, 400, "{id} {currency}");
        assert_eq!(app.order_status(user, order_no).await, "WAITING_PAY");
    }
    let body = event(&intent, "cny");
    let status = deliver(
        &http,
        &notify,
        &seckill_sign(&secret, chrono::Utc::now().timestamp(), &body),
        body,
    )
    .await;
    assert_eq!(status, 204);
    let shown = json(
        app.get(
            &format!("/api/v1/orders/{order_no}"),
            Some(&app.user_token(user)),
        )
        .await,
    )
    .await;
    assert_eq!(shown["status"], "PAID");
    let paid_at: chrono::DateTime<chrono::Utc> =
        shown["paid_at"].as_str().unwrap().parse().unwrap();
    assert_eq!(paid_at.timestamp(), now - 600, "{shown}");
}
