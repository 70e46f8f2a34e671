//! The nemesis's payments lane. Buyers pay through real provider
//! processes, never through the mock: the WeChat Pay platform simulator
//! (`examples/wechatpay_sim`) and localstripe. Both are configured in the
//! server, and new payments go to each in turn, one per server start, so a
//! restart switches provider with payments of the other still open.
//!
//! The simulator misbehaves on its own throughout: callbacks dropped,
//! repeated up to 15 times, delayed, some held past the order's pay
//! deadline, refunds settled with their callback before the refund's
//! answer. The schedule adds provider faults: answers of 429, 403
//! `NOT_ENOUGH` and 500 `SYSTEM_ERROR`, answers that never come after the
//! work was done, and each provider stopped with SIGSTOP. An admin refunds
//! paid orders during all of it.
//!
//! The checker takes the providers' own records as the truth and balances
//! every capture against our payments, refunds and orders ([`check`]).

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rsa::Generate;
use rsa::pkcs8::{EncodePrivateKey, EncodePublicKey, LineEnding};
use serde_json::{Value, json};

use crate::harness::{Chaos, signal};

const MCHID: &str = "1900000001";
const APPID: &str = "wxd678efh567hg6787";
const MERCHANT_SERIAL: &str = "5157F09EFDC096DE15EBE81A47057A7232F1B8E1";
const STRIPE_KEY: &str = "sk_test_nemesis";
/// The server's patience with a provider: a hung answer outlasts it.
const PROVIDER_TIMEOUT_MS: u64 = 2000;

/// The two provider processes (killed when dropped).
pub struct Providers {
    sim: Mutex<Child>,
    sim_url: String,
    stripe: Mutex<Child>,
    stripe_url: String,
    webhook_secret: String,
    apiv3_key: String,
    dir: PathBuf,
    http: reqwest::Client,
}

impl Drop for Providers {
    fn drop(&mut self) {
        for child in [&self.sim, &self.stripe] {
            let mut child = child.lock().unwrap();
            signal(child.id(), "CONT");
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The simulator the chaos build copied (`SECKILL_CHAOS_SIM`), else
/// cargo's.
fn simulator() -> PathBuf {
    std::env::var_os("SECKILL_CHAOS_SIM")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/debug/examples/wechatpay_sim")
        })
}

fn localstripe() -> String {
    std::env::var("SECKILL_LOCALSTRIPE").unwrap_or_else(|_| {
        format!(
            "{}/.cache/seckill/localstripe-1.15.10/bin/localstripe",
            std::env::var("HOME").unwrap_or_default()
        )
    })
}

/// What a buyer's payment at a provider came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtProvider {
    /// The provider took the money (or declined, when asked to).
    Done,
    /// The provider refused: the payment is closed, expired or paid.
    Refused,
    /// No answer in the buyer's patience.
    Unanswered,
}

impl Providers {
    /// Both providers, started with a merchant key made now; the
    /// simulator's callbacks misbehave as drawn from `seed`.
    pub async fn start(seed: u64) -> Self {
        let dir = std::env::temp_dir().join(format!("seckill-nemesis-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(dir.join("platform")).unwrap();
        let key = rsa::PrivateKey::generate();
        std::fs::write(
            dir.join("merchant.pem"),
            key.to_pkcs8_pem(LineEnding::LF).unwrap().as_bytes(),
        )
        .unwrap();
        std::fs::write(
            dir.join("merchant.pub.pem"),
            key.to_public_key()
                .to_public_key_pem(LineEnding::LF)
                .unwrap(),
        )
        .unwrap();
        let apiv3_key: String = (0..32).map(|_| fastrand::alphanumeric()).collect();
        let mut sim = Command::new(simulator())
            .args(["--mchid", MCHID, "--merchant-serial", MERCHANT_SERIAL])
            .arg("--merchant-public-key")
            .arg(dir.join("merchant.pub.pem"))
            .arg("--platform-key-dir")
            .arg(dir.join("platform"))
            .args(["--apiv3-key", &apiv3_key])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the WeChat Pay simulator runs (scripts/chaos.sh builds it)");
        let mut line = String::new();
        BufReader::new(sim.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let ready: Value = serde_json::from_str(&line).expect("the simulator's first line");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let stripe = Command::new(localstripe())
            .args(["--port", &port.to_string(), "--from-scratch"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("localstripe runs (scripts/localstripe.sh installs it)");
        let providers = Self {
            sim: Mutex::new(sim),
            sim_url: ready["url"].as_str().unwrap().to_owned(),
            stripe: Mutex::new(stripe),
            stripe_url: format!("http://127.0.0.1:{port}"),
            webhook_secret: format!("whsec_{}", uuid::Uuid::new_v4().simple()),
            apiv3_key,
            dir,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .pool_max_idle_per_host(0)
                .build()
                .unwrap(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while providers.stripe_get("/v1/payment_intents").await.is_none() {
            assert!(Instant::now() < deadline, "localstripe never listened");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        providers
            .sim(
                "/sim/callbacks",
                json!({
                    "drop_rate": 0.2, "max_copies": 15, "delay_ms": 1500,
                    "late_rate": 0.05, "late_ms": 35_000,
                    "early_refund_rate": 0.3, "refund_ms": [200, 4000],
                    "retries": 3, "seed": seed,
                }),
            )
            .await;
        providers
    }

    /// The server's payment settings: WeChat Pay and Stripe both
    /// configured; new payments go to each in turn, one per server start
    /// (`SECKILL__PAYMENT__PROVIDER` with a comma: the harness rotates it).
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let dir = |p: &str| self.dir.join(p).display().to_string();
        vec![
            ("SECKILL__PAYMENT__PROVIDER", "wechatpay,stripe".into()),
            (
                "SECKILL__PAYMENT__WECHATPAY__BASE_URL",
                self.sim_url.clone(),
            ),
            ("SECKILL__PAYMENT__WECHATPAY__MCHID", MCHID.into()),
            ("SECKILL__PAYMENT__WECHATPAY__APPID", APPID.into()),
            (
                "SECKILL__PAYMENT__WECHATPAY__MERCHANT_SERIAL",
                MERCHANT_SERIAL.into(),
            ),
            (
                "SECKILL__PAYMENT__WECHATPAY__MERCHANT_KEY_FILE",
                dir("merchant.pem"),
            ),
            (
                "SECKILL__PAYMENT__WECHATPAY__APIV3_KEY",
                self.apiv3_key.clone(),
            ),
            (
                "SECKILL__PAYMENT__WECHATPAY__PLATFORM_KEY_DIR",
                dir("platform"),
            ),
            (
                "SECKILL__PAYMENT__WECHATPAY__NOTIFY_URL",
                "https://shop.example/api/v1/payments/notify/wechatpay".into(),
            ),
            (
                "SECKILL__PAYMENT__STRIPE__API_BASE",
                self.stripe_url.clone(),
            ),
            ("SECKILL__PAYMENT__STRIPE__SECRET_KEY", STRIPE_KEY.into()),
            (
                "SECKILL__PAYMENT__STRIPE__WEBHOOK_SECRET",
                self.webhook_secret.clone(),
            ),
            ("SECKILL__PAYMENT__QUERY_AFTER_SECS", "3".into()),
            ("SECKILL__PAYMENT__SWEEP_INTERVAL_MS", "300".into()),
            (
                "SECKILL__PAYMENT__PROVIDER_TIMEOUT_MS",
                PROVIDER_TIMEOUT_MS.to_string(),
            ),
            ("SECKILL__PAYMENT__RETRY_MAX_SECS", "4".into()),
        ]
    }

    /// Callbacks and webhooks go to the server at `base`.
    pub async fn point_at(&self, base: &str) {
        let url = format!("{base}/api/v1/payments/notify/wechatpay");
        self.sim("/sim/notify-to", json!({"url": url})).await;
        let url = format!("{base}/api/v1/payments/notify/stripe");
        let res = self
            .http
            .post(format!("{}/_config/webhooks/seckill", self.stripe_url))
            .basic_auth(STRIPE_KEY, Some(""))
            .form(&[("url", url.as_str()), ("secret", &self.webhook_secret)])
            .send()
            .await
            .expect("localstripe answers");
        assert!(res.status().is_success());
    }

    pub fn sim_pid(&self) -> u32 {
        self.sim.lock().unwrap().id()
    }

    pub fn stripe_pid(&self) -> u32 {
        self.stripe.lock().unwrap().id()
    }

    async fn sim(&self, path: &str, body: Value) -> Value {
        let res = self
            .http
            .post(format!("{}{path}", self.sim_url))
            .json(&body)
            .send()
            .await
            .expect("the simulator answers");
        assert!(res.status().is_success(), "{path}: {}", res.status());
        res.json().await.expect("JSON")
    }

    /// Faults at a rate on every call the server makes to WeChat Pay
    /// (none: `on` false): 429, 403 `NOT_ENOUGH` (refunds), 500 before
    /// or after the work, and answers held past the server's patience.
    pub async fn errors(&self, on: bool, seed: u64) {
        let (error_rate, hang_rate) = if on { (0.3, 0.1) } else { (0.0, 0.0) };
        self.sim(
            "/sim/faults",
            json!({
                "error_rate": error_rate, "hang_rate": hang_rate,
                "hang_ms": PROVIDER_TIMEOUT_MS * 2, "seed": seed,
            }),
        )
        .await;
    }

    /// The buyer pays `payment_no` at the simulator (`decline`: the
    /// charge fails, PAYERROR); retried while it does not answer.
    pub async fn pay_wechat(
        &self,
        payment_no: &str,
        decline: bool,
        patience: Duration,
    ) -> AtProvider {
        let outcome = if decline { "PAYERROR" } else { "SUCCESS" };
        let give_up = Instant::now() + patience;
        let mut tried = false;
        while Instant::now() < give_up {
            let sent = self
                .http
                .post(format!("{}/sim/pay/{payment_no}", self.sim_url))
                .json(&json!({"outcome": outcome}))
                .send()
                .await;
            match sent.map(|r| r.status().as_u16()) {
                Ok(200) => return AtProvider::Done,
                // A retry of a payment that went through finds it paid.
                Ok(409) if tried && !decline => return AtProvider::Done,
                Ok(409 | 404) => return AtProvider::Refused,
                _ => tried = true,
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        AtProvider::Unanswered
    }

    async fn stripe_call(
        &self,
        method: reqwest::Method,
        path: &str,
        form: &[(&str, &str)],
    ) -> Option<(u16, Value)> {
        let res = self
            .http
            .request(method, format!("{}{path}", self.stripe_url))
            .basic_auth(STRIPE_KEY, Some(""))
            .form(form)
            .send()
            .await
            .ok()?;
        let status = res.status().as_u16();
        Some((status, res.json().await.unwrap_or(Value::Null)))
    }

    async fn stripe_get(&self, path: &str) -> Option<Value> {
        match self.stripe_call(reqwest::Method::GET, path, &[]).await {
            Some((200, body)) => Some(body),
            _ => None,
        }
    }

    /// The buyer pays the intent behind `client_secret` with a card
    /// (`decline`: one the bank declines), as Stripe.js would: the card,
    /// then the confirm. Retried while localstripe does not answer.
    pub async fn pay_stripe(
        &self,
        client_secret: &str,
        decline: bool,
        patience: Duration,
    ) -> AtProvider {
        let intent = client_secret.split("_secret_").next().unwrap_or_default();
        let card = if decline {
            "4000000000000002"
        } else {
            "4242424242424242"
        };
        let give_up = Instant::now() + patience;
        while Instant::now() < give_up {
            let Some(now) = self
                .stripe_get(&format!("/v1/payment_intents/{intent}"))
                .await
            else {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            };
            match now["status"].as_str() {
                Some("succeeded") => return AtProvider::Done,
                Some("requires_payment_method" | "requires_confirmation") => {}
                _ => return AtProvider::Refused,
            }
            let pm = self
                .stripe_call(
                    reqwest::Method::POST,
                    "/v1/payment_methods",
                    &[
                        ("type", "card"),
                        ("card[number]", card),
                        ("card[exp_month]", "12"),
                        ("card[exp_year]", "2030"),
                        ("card[cvc]", "123"),
                    ],
                )
                .await;
            let Some((200, pm)) = pm else { continue };
            let pm = pm["id"].as_str().unwrap_or_default().to_owned();
            let path = format!("/v1/payment_intents/{intent}");
            match self
                .stripe_call(reqwest::Method::POST, &path, &[("payment_method", &pm)])
                .await
            {
                Some((200, _)) => {}
                Some(_) => return AtProvider::Refused,
                None => continue,
            }
            match self
                .stripe_call(reqwest::Method::POST, &format!("{path}/confirm"), &[])
                .await
            {
                Some((200, _)) => return AtProvider::Done,
                Some((402, _)) if decline => return AtProvider::Done,
                Some(_) => return AtProvider::Refused,
                None => {}
            }
        }
        AtProvider::Unanswered
    }

    /// The providers' own records: every capture and every refund they
    /// made, and the faults the simulator gave.
    pub async fn records(&self) -> Records {
        let state = loop {
            let res = self
                .http
                .get(format!("{}/sim/state?requests=false", self.sim_url))
                .send()
                .await;
            if let Ok(res) = res
                && let Ok(state) = res.json::<Value>().await
            {
                break state;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        let mut records = Records {
            faults: state["faults"].clone(),
            deliveries: state["deliveries"].clone(),
            ..Records::default()
        };
        for t in state["trades"].as_array().unwrap() {
            if matches!(t["state"].as_str(), Some("SUCCESS" | "REFUND")) {
                records.captures.insert(
                    t["out_trade_no"].as_str().unwrap().to_owned(),
                    Capture {
                        provider: "wechatpay",
                        amount: t["amount"].as_i64().unwrap(),
                    },
                );
            }
        }
        for r in state["refunds"].as_array().unwrap() {
            records.refunds.push(ProviderRefund {
                payment_no: r["out_trade_no"].as_str().unwrap().to_owned(),
                refund_no: r["out_refund_no"].as_str().unwrap().to_owned(),
                amount: r["amount"].as_i64().unwrap(),
                done: r["status"] == "SUCCESS",
                settled: r["status"] != "PROCESSING",
            });
        }
        let mut intents: HashMap<String, String> = HashMap::new();
        for intent in self.stripe_list("/v1/payment_intents").await {
            let Some(no) = intent["metadata"]["payment_no"].as_str() else {
                continue;
            };
            let id = intent["id"].as_str().unwrap().to_owned();
            intents.insert(id, no.to_owned());
            if intent["status"] == "succeeded" {
                records.stripe_captures += 1;
                records.captures.insert(
                    no.to_owned(),
                    Capture {
                        provider: "stripe",
                        amount: intent["amount"].as_i64().unwrap(),
                    },
                );
            }
        }
        for refund in self.stripe_list("/v1/refunds").await {
            let payment_no = refund["payment_intent"]
                .as_str()
                .and_then(|id| intents.get(id))
                .cloned()
                .unwrap_or_default();
            records.refunds.push(ProviderRefund {
                payment_no,
                refund_no: refund["metadata"]["refund_no"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                amount: refund["amount"].as_i64().unwrap(),
                done: refund["status"] == "succeeded",
                settled: refund["status"] != "pending",
            });
        }
        records
    }

    /// Every object of a localstripe list, page by page.
    async fn stripe_list(&self, path: &str) -> Vec<Value> {
        let mut all = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let page = match &after {
                None => format!("{path}?limit=100"),
                Some(id) => format!("{path}?limit=100&starting_after={id}"),
            };
            let Some(list) = self.stripe_get(&page).await else {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            };
            let data = list["data"].as_array().cloned().unwrap_or_default();
            after = data
                .last()
                .and_then(|o| o["id"].as_str())
                .map(str::to_owned);
            all.extend(data);
            if list["has_more"] != true || after.is_none() {
                return all;
            }
        }
    }
}

/// A capture a provider holds: the money it took for one of our payment
/// numbers.
#[derive(Debug, Clone)]
pub struct Capture {
    pub provider: &'static str,
    pub amount: i64,
}

/// A refund a provider holds.
#[derive(Debug, Clone)]
pub struct ProviderRefund {
    pub payment_no: String,
    pub refund_no: String,
    pub amount: i64,
    /// The money is back with the buyer.
    pub done: bool,
    /// No longer under way.
    pub settled: bool,
}

/// What the providers hold, after the run.
#[derive(Debug, Default)]
pub struct Records {
    /// By our payment number.
    pub captures: HashMap<String, Capture>,
    pub stripe_captures: usize,
    pub refunds: Vec<ProviderRefund>,
    pub faults: Value,
    pub deliveries: Value,
}

/// One of our payments, as the database holds it.
#[derive(Debug, Clone)]
struct Ours {
    order_no: String,
    provider: String,
    status: String,
    pays_order: bool,
    amount: i64,
}

/// Waits until nothing about money is under way, here or at the
/// providers: no payment pending or being refunded, no failed payment
/// still open at its provider, every refund settled at its provider.
pub async fn settle(chaos: &Chaos, providers: &Providers, within: Duration, replay: &str) {
    let started = Instant::now();
    loop {
        let open = chaos
            .count(
                "SELECT count(*) AS n FROM payments \
                 WHERE status IN ('PENDING', 'REFUND_REQUIRED', 'REFUNDING') \
                    OR (status = 'FAILED' AND closed_at IS NULL)",
            )
            .await;
        let refunding = chaos
            .count("SELECT count(*) AS n FROM refunds WHERE status = 'REFUNDING'")
            .await;
        let at_providers = providers
            .records()
            .await
            .refunds
            .iter()
            .filter(|r| !r.settled)
            .count();
        if open == 0 && refunding == 0 && at_providers == 0 {
            eprintln!(
                "nemesis: money settled {:.1}s after the orders",
                started.elapsed().as_secs_f64()
            );
            return;
        }
        assert!(
            started.elapsed() < within,
            "{replay}: money not settled {}s after the orders: {open} payments open, \
             {refunding} refunds under way here, {at_providers} at the providers; logs: {}",
            within.as_secs(),
            chaos.logs()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Balances the providers' records against ours, once quiet. Each
/// capture a provider holds either backs the one PAID order it was for,
/// or was refunded exactly once, in full; no refund is without a capture;
/// no order is PAID without one; no refund is REFUND_FAILED while the
/// provider says it is refunded; WeChat Pay's statement of each day shows
/// no difference. Returns the anomalies and the figures.
pub async fn check(chaos: &Chaos, providers: &Providers, activity: i64) -> (Vec<String>, String) {
    let records = providers.records().await;
    let mut anomalies = Vec::new();
    let rows = chaos
        .strings(&format!(
            "SELECT p.payment_no::text || ' ' || p.order_no::text || ' ' || p.provider || ' ' \
               || p.status || ' ' || p.pays_order::text || ' ' || p.amount_cents::text AS s \
             FROM payments p JOIN orders o ON o.order_no = p.order_no AND o.user_slot = p.order_slot \
             WHERE o.activity_id = {activity}"
        ))
        .await;
    let mut ours: HashMap<String, Ours> = HashMap::new();
    for row in rows {
        let f: Vec<&str> = row.split(' ').collect();
        ours.insert(
            f[0].to_owned(),
            Ours {
                order_no: f[1].to_owned(),
                provider: f[2].to_owned(),
                status: f[3].to_owned(),
                pays_order: f[4] == "true",
                amount: f[5].parse().unwrap(),
            },
        );
    }
    let paid_orders = chaos
        .strings(&format!(
            "SELECT order_no::text AS s FROM orders WHERE activity_id = {activity} AND status = 'PAID'"
        ))
        .await;
    let mut refunds_of: HashMap<&str, Vec<&ProviderRefund>> = HashMap::new();
    for r in records.refunds.iter().filter(|r| r.done) {
        refunds_of.entry(r.payment_no.as_str()).or_default().push(r);
    }
    // Every capture: backs its PAID order, or was refunded once, in full.
    let (mut backing, mut refunded, mut late, mut after_sale) = (0, 0, 0, 0);
    let mut backed: HashMap<&str, usize> = HashMap::new();
    for (payment_no, capture) in &records.captures {
        let Some(ours) = ours.get(payment_no) else {
            // Another test's payment at the same provider: not this run's.
            continue;
        };
        if ours.provider != capture.provider {
            anomalies.push(format!(
                "capture {payment_no} at {}, ours says {}",
                capture.provider, ours.provider
            ));
        }
        let refunds = refunds_of
            .get(payment_no.as_str())
            .cloned()
            .unwrap_or_default();
        match refunds.as_slice() {
            [] if ours.pays_order
                && ours.status == "SUCCESS"
                && paid_orders.contains(&ours.order_no) =>
            {
                backing += 1;
                *backed.entry(ours.order_no.as_str()).or_default() += 1;
            }
            [one]
                if one.amount == capture.amount
                    && one.amount == ours.amount
                    && ours.status == "REFUNDED" =>
            {
                refunded += 1;
                if ours.pays_order {
                    after_sale += 1;
                    *backed.entry(ours.order_no.as_str()).or_default() += 1;
                } else {
                    late += 1;
                }
            }
            _ => anomalies.push(format!(
                "capture {payment_no} ({capture:?}) neither backs a PAID order nor was refunded \
                 once in full: ours {ours:?}, refunds at the provider {refunds:?}"
            )),
        }
    }
    // No refund without a capture.
    for r in &records.refunds {
        if ours.contains_key(&r.payment_no) && !records.captures.contains_key(&r.payment_no) {
            anomalies.push(format!("refund {} without a capture: {r:?}", r.refund_no));
        }
    }
    // No order PAID without a capture (the one that paid it).
    for order_no in &paid_orders {
        if backed.get(order_no.as_str()) != Some(&1) {
            let payments: Vec<(&String, &Ours)> = ours
                .iter()
                .filter(|(_, o)| &o.order_no == order_no)
                .collect();
            anomalies.push(format!(
                "order {order_no} PAID, backed by {} captures: {payments:?}",
                backed.get(order_no.as_str()).unwrap_or(&0)
            ));
        }
    }
    // No REFUND_FAILED (no fault here is final), least of all one the
    // provider refunded.
    for payment_no in ours
        .iter()
        .filter(|(_, o)| o.status == "REFUND_FAILED")
        .map(|(n, _)| n)
    {
        let at_provider = refunds_of.contains_key(payment_no.as_str());
        anomalies.push(format!(
            "payment {payment_no} REFUND_FAILED (refunded at the provider: {at_provider})"
        ));
    }
    // Our money never moved through the mock.
    if let Some((no, o)) = ours.iter().find(|(_, o)| o.provider == "mock") {
        anomalies.push(format!("payment {no} through the mock: {o:?}"));
    }
    // WeChat Pay's statement of each day with a capture.
    let days = chaos
        .strings(
            "SELECT DISTINCT to_char(paid_at AT TIME ZONE 'Asia/Shanghai', 'YYYY-MM-DD') AS s \
             FROM payments WHERE provider = 'wechatpay' AND paid_at IS NOT NULL",
        )
        .await;
    let mut statement_rows = 0;
    for day in &days {
        let report = chaos.statement(day).await;
        statement_rows += report["provider_rows"].as_i64().unwrap_or(0);
        let differences = report["missing_here"].as_array().map_or(1, Vec::len)
            + report["missing_there"].as_array().map_or(1, Vec::len)
            + report["mismatched"].as_array().map_or(1, Vec::len);
        if differences != 0 {
            anomalies.push(format!("the statement of {day} differs: {report}"));
        }
    }
    let wechat_captures = records.captures.len() - records.stripe_captures;
    let payers: HashSet<&str> = ours.values().map(|o| o.order_no.as_str()).collect();
    let figures = format!(
        "money: {} payments for {} orders; captures {} (WeChat Pay {wechat_captures}, Stripe {}); \
         {backing} back their PAID order, {refunded} refunded once in full ({late} late payments, \
         {after_sale} after-sale); {} orders PAID; WeChat Pay statement: {} rows over {} days, \
         0 differences; provider faults given {}; callbacks {}",
        ours.len(),
        payers.len(),
        records.captures.len(),
        records.stripe_captures,
        paid_orders.len(),
        statement_rows,
        days.len(),
        records.faults,
        records.deliveries,
    );
    (anomalies, figures)
}
