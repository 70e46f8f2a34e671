//! The randomized fault test, after Jepsen's nemesis: a seeded schedule of
//! faults, several of them overlapping, over a sale whose clients buy,
//! pay through real providers (sometimes declined first and paying again,
//! sometimes racing the pay deadline, sometimes paying the old payment
//! after the new one), cancel, let orders time out and claim coupons,
//! while an admin refunds paid orders; then a checker over everything the
//! clients were told, and one that balances every capture the providers
//! hold against our money (`money.rs`).
//!
//! The seed decides the schedule and every client's choices (timing is
//! the machine's). It is printed first; `scripts/chaos.sh nemesis --seed N`
//! replays it (`SECKILL_NEMESIS_SEED`), and a run without one takes a new
//! seed from the clock.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use futures_util::future::join_all;
use futures_util::stream::FuturesUnordered;
use serde_json::{Value, json};

use crate::harness::{Chaos, OnDrop, Sale, signal};
use crate::money::{AtProvider, Providers};

/// How long the schedule lays faults over the sale.
const SPAN: Duration = Duration::from_secs(190);
/// Buyers and coupon claimers arrive at these rates for the whole span.
const BUYERS_PER_SEC: f64 = 8.0;
const CLAIMERS_PER_SEC: f64 = 2.0;
/// Units on sale: fewer than the buyers, so units come back (cancels,
/// timeouts) and are sold again while faults go on.
const STOCK: i32 = 700;
const COUPONS: i32 = 150;
/// Unpaid orders close this long after they are made.
const PAY_TIMEOUT_SECS: u32 = 30;
/// A client retries a 503 or a dropped connection this long, then gives
/// up (sized, like the other fault tests, for a slow 2-core host).
const PATIENCE: Duration = Duration::from_secs(300);
/// The service must be ready again this long after the last fault healed,
/// and settled this long after the last client finished.
const READY_WITHIN: Duration = Duration::from_secs(180);
const SETTLE_WITHIN: Duration = Duration::from_secs(300);

/// What breaks, and which process it hits.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// SIGKILL to the server; started again `down` later.
    ServerKilled { down: Duration },
    /// SIGSTOP to the broker for longer than its session timeout (9 s):
    /// the controller fences it when it continues.
    BrokerPaused { pause: Duration },
    /// SIGKILL to the broker; started again `down` later.
    BrokerKilled { down: Duration },
    /// SIGSTOP to one Redis server.
    RedisPaused { node: usize, pause: Duration },
    /// SIGKILL to one Redis server; started again, empty, `down` later.
    RedisKilled { node: usize, down: Duration },
    /// FLUSHALL on one Redis server.
    RedisFlushed { node: usize },
    /// PostgreSQL stopped (fast shutdown) and started `down` later.
    PostgresRestarted { down: Duration },
    /// The replicated lane: SIGKILL to the broker leading the order
    /// topic's partition 0; started again `down` later.
    LeaderKilled { down: Duration },
    /// The replicated lane: SIGSTOP to that leader.
    LeaderPaused { pause: Duration },
    /// The replicated lane: SIGKILL to the two brokers that do not lead
    /// it (writes refused: too few in-sync replicas); both started again
    /// `down` later.
    TwoBrokersDown { down: Duration },
    /// The replicated lane: SIGKILL to the PostgreSQL primary's node (its
    /// keeper and PostgreSQL); the standby takes over; the node is started
    /// again `down` later and rejoins as the standby.
    PrimaryKilled { down: Duration },
    /// The replicated lane: SIGKILL to the standby's node; started again
    /// `down` later.
    StandbyKilled { down: Duration },
    /// WeChat Pay answers a share of the server's calls 429, 403
    /// `NOT_ENOUGH` or 500, and holds some answers past the server's
    /// patience after doing the work, for `lasts`.
    ProviderErrors { lasts: Duration },
    /// SIGSTOP to the WeChat Pay simulator.
    ProviderPaused { pause: Duration },
    /// SIGSTOP to localstripe.
    StripePaused { pause: Duration },
}

/// The process a fault hits: faults on one target take turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Target {
    Server,
    Broker,
    Redis,
    Postgres,
    /// The payment providers.
    Provider,
}

impl Fault {
    fn target(self) -> Target {
        match self {
            Self::ServerKilled { .. } => Target::Server,
            Self::BrokerPaused { .. }
            | Self::BrokerKilled { .. }
            | Self::LeaderKilled { .. }
            | Self::LeaderPaused { .. }
            | Self::TwoBrokersDown { .. } => Target::Broker,
            Self::RedisPaused { .. } | Self::RedisKilled { .. } | Self::RedisFlushed { .. } => {
                Target::Redis
            }
            Self::PostgresRestarted { .. }
            | Self::PrimaryKilled { .. }
            | Self::StandbyKilled { .. } => Target::Postgres,
            Self::ProviderErrors { .. }
            | Self::ProviderPaused { .. }
            | Self::StripePaused { .. } => Target::Provider,
        }
    }

    /// How long the fault lasts, as planned (a restart takes longer).
    fn lasts(self) -> Duration {
        match self {
            Self::ServerKilled { down }
            | Self::BrokerKilled { down }
            | Self::RedisKilled { down, .. }
            | Self::PostgresRestarted { down }
            | Self::LeaderKilled { down }
            | Self::TwoBrokersDown { down }
            | Self::PrimaryKilled { down }
            | Self::StandbyKilled { down } => down + Duration::from_secs(3),
            Self::BrokerPaused { pause }
            | Self::RedisPaused { pause, .. }
            | Self::LeaderPaused { pause }
            | Self::ProviderPaused { pause }
            | Self::StripePaused { pause } => pause,
            Self::ProviderErrors { lasts } => lasts,
            Self::RedisFlushed { .. } => Duration::from_secs(1),
        }
    }

    fn random(rng: &mut fastrand::Rng, redis_nodes: usize, replicated: bool) -> Self {
        let secs =
            |rng: &mut fastrand::Rng, lo: u64, hi: u64| Duration::from_secs(rng.u64(lo..=hi));
        let node = rng.usize(..redis_nodes);
        // One fault in four is a provider's, on either lane.
        if rng.u32(..4) == 0 {
            return match rng.u32(..4) {
                0 | 1 => Self::ProviderErrors {
                    lasts: secs(rng, 15, 40),
                },
                2 => Self::ProviderPaused {
                    pause: secs(rng, 5, 15),
                },
                _ => Self::StripePaused {
                    pause: secs(rng, 5, 15),
                },
            };
        }
        if replicated {
            // The engines of a real deployment: one broker or one
            // PostgreSQL node at a time, besides the server and Redis.
            return match rng.u32(..11) {
                0 | 1 => Self::ServerKilled {
                    down: secs(rng, 1, 3),
                },
                2 => Self::LeaderPaused {
                    pause: secs(rng, 12, 30),
                },
                3 => Self::LeaderKilled {
                    down: secs(rng, 2, 8),
                },
                4 => Self::TwoBrokersDown {
                    down: secs(rng, 10, 25),
                },
                5 => Self::RedisPaused {
                    node,
                    pause: secs(rng, 4, 12),
                },
                6 => Self::RedisKilled {
                    node,
                    down: secs(rng, 2, 8),
                },
                7 => Self::RedisFlushed { node },
                8 | 9 => Self::PrimaryKilled {
                    down: secs(rng, 3, 10),
                },
                _ => Self::StandbyKilled {
                    down: secs(rng, 3, 10),
                },
            };
        }
        match rng.u32(..9) {
            0 | 1 => Self::ServerKilled {
                down: secs(rng, 1, 3),
            },
            2 | 3 => Self::BrokerPaused {
                pause: secs(rng, 12, 25),
            },
            4 => Self::BrokerKilled {
                down: secs(rng, 2, 5),
            },
            5 => Self::RedisPaused {
                node,
                pause: secs(rng, 4, 12),
            },
            6 => Self::RedisKilled {
                node,
                down: secs(rng, 2, 8),
            },
            7 => Self::RedisFlushed { node },
            _ => Self::PostgresRestarted {
                down: secs(rng, 1, 4),
            },
        }
    }
}

/// One fault of the schedule: what, and when after the sale started.
#[derive(Debug, Clone, Copy)]
pub struct Planned {
    pub at: Duration,
    pub fault: Fault,
}

/// The faults of one seed: one every 10–18 s over [`SPAN`], never two at
/// once on one process, every target hit at least once, the providers
/// both with errors and stopped, a server restart in the first half, and
/// at least two faults overlapping (a seed whose draw misses any of that
/// draws again, from the same generator, so the seed still decides
/// everything).
pub fn schedule(seed: u64, redis_nodes: usize, replicated: bool) -> Vec<Planned> {
    let mut rng = fastrand::Rng::with_seed(seed);
    loop {
        let mut planned = Vec::new();
        let mut busy_until: HashMap<Target, Duration> = HashMap::new();
        let mut at = Duration::from_secs(rng.u64(5..=10));
        while at < SPAN {
            for _ in 0..6 {
                let fault = Fault::random(&mut rng, redis_nodes, replicated);
                let free = busy_until.get(&fault.target()).is_none_or(|&t| t <= at);
                if free {
                    busy_until.insert(fault.target(), at + fault.lasts() + Duration::from_secs(2));
                    planned.push(Planned { at, fault });
                    break;
                }
            }
            at += Duration::from_secs(rng.u64(10..=18));
        }
        let targets: HashSet<Target> = planned.iter().map(|p| p.fault.target()).collect();
        let has = |f: fn(&Fault) -> bool| planned.iter().any(|p| f(&p.fault));
        let fenced = has(|f| matches!(f, Fault::BrokerPaused { .. } | Fault::LeaderPaused { .. }));
        // The providers fail both ways: answers, and the process stopped.
        let providers = has(|f| matches!(f, Fault::ProviderErrors { .. }))
            && has(|f| matches!(f, Fault::ProviderPaused { .. } | Fault::StripePaused { .. }));
        // A restart in the first half switches provider (money.rs) with
        // time left to pay through the second one.
        let switched = planned
            .iter()
            .any(|p| p.fault.target() == Target::Server && p.at < SPAN / 2);
        // The replicated lane hits the leader and the primary each time.
        let replicated_faults = !replicated
            || (has(|f| matches!(f, Fault::LeaderKilled { .. } | Fault::TwoBrokersDown { .. }))
                && has(|f| matches!(f, Fault::PrimaryKilled { .. })));
        if targets.len() == 5
            && fenced
            && providers
            && switched
            && replicated_faults
            && overlaps(&planned) > 0
        {
            return planned;
        }
    }
}

/// How many pairs of planned faults overlap in time.
fn overlaps(planned: &[Planned]) -> usize {
    let mut n = 0;
    for (i, a) in planned.iter().enumerate() {
        for b in &planned[i + 1..] {
            if b.at < a.at + a.fault.lasts() && a.at < b.at + b.fault.lasts() {
                n += 1;
            }
        }
    }
    n
}

/// Something a client was told that the contract forbids (a 500, an
/// unexpected code), or the checker found: collected, reported together.
#[derive(Default)]
struct Anomalies(Mutex<Vec<String>>);

impl Anomalies {
    fn add(&self, what: String) {
        eprintln!("nemesis: ANOMALY {what}");
        self.0.lock().unwrap().push(what);
    }
}

/// An answer: status and body, or `None` when no answer came.
struct Reply {
    status: u16,
    body: Value,
}

impl Reply {
    fn code(&self) -> &str {
        self.body["code"].as_str().unwrap_or("")
    }
}

/// What a buyer chose to do with an accepted order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Intent {
    /// Pay at the provider the pay call names. `declined_first`: the
    /// bank declines the first payment; the buyer pays again (a new
    /// payment), then tries the old one too. `racing`: pay around the
    /// deadline.
    Pay {
        declined_first: bool,
        racing: bool,
    },
    Cancel,
    /// Let it time out.
    Abandon,
}

/// One buyer's history.
#[derive(Debug)]
struct Buyer {
    user: i64,
    request_id: String,
    order_no: Option<String>,
    /// The purchase ended without an order: its last answer.
    refused: Option<String>,
    intent: Option<Intent>,
    pay_deadline: Option<DateTime<Utc>>,
    /// The payments `pay` answered with, in order.
    payments: Vec<String>,
    /// What paying at the provider came to, last.
    at_provider: Option<AtProvider>,
    /// The old payment, tried after the new one: what the provider said.
    old_tried: Option<AtProvider>,
    /// The cancel's last answer.
    cancel: Option<u16>,
    /// The order's status when the buyer last looked.
    seen: Option<String>,
}

/// One coupon claimer's history.
#[derive(Debug)]
struct Claimer {
    user: i64,
    /// 202 or 200.
    acked: bool,
    last: String,
}

/// The clients of one run.
struct Clients<'a> {
    chaos: &'a Chaos,
    providers: &'a Providers,
    activity: i64,
    coupon: i64,
    seed: u64,
    anomalies: Anomalies,
    accepted: AtomicUsize,
}

impl Clients<'_> {
    /// One request, answered or not; a 5xx other than 503 is an anomaly.
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        jwt: Option<&str>,
        body: Option<&Value>,
    ) -> Option<Reply> {
        let mut req = self
            .chaos
            .client()
            .request(method.clone(), self.chaos.url(path));
        if let Some(jwt) = jwt {
            req = req.bearer_auth(jwt);
        }
        if let Some(body) = body {
            req = req.json(body);
        }
        let res = req.send().await.ok()?;
        let status = res.status().as_u16();
        let body = res.json().await.unwrap_or(Value::Null);
        if status >= 500 && status != 503 {
            self.anomalies
                .add(format!("{method} {path}: {status} {body}"));
        }
        Some(Reply { status, body })
    }

    /// Retries `call` on no answer, 503, 408 and 429 until another answer
    /// or [`PATIENCE`] is out.
    async fn until_answered(
        &self,
        method: reqwest::Method,
        path: &str,
        jwt: Option<&str>,
        body: Option<&Value>,
    ) -> Option<Reply> {
        let give_up = Instant::now() + PATIENCE;
        while Instant::now() < give_up {
            match self.call(method.clone(), path, jwt, body).await {
                Some(r) if !matches!(r.status, 503 | 408 | 429) => return Some(r),
                _ => pause().await,
            }
        }
        None
    }

    async fn buyer(&self, user: i64) -> Buyer {
        let mut rng = fastrand::Rng::with_seed(self.seed ^ (user as u64).wrapping_mul(0x9e37_79b9));
        let jwt = self.chaos.user(user);
        let mut b = Buyer {
            user,
            request_id: format!("n{user}-{:08x}", rng.u32(..)),
            order_no: None,
            refused: None,
            intent: None,
            pay_deadline: None,
            payments: Vec::new(),
            at_provider: None,
            old_tried: None,
            cancel: None,
            seen: None,
        };
        if !self.purchase(&mut b, &jwt).await {
            return b;
        }
        self.accepted.fetch_add(1, Ordering::Relaxed);
        let order_no = b.order_no.clone().unwrap();
        // Wait for the order to be written.
        let give_up = Instant::now() + PATIENCE;
        loop {
            let path = format!("/api/v1/orders/{order_no}");
            if let Some(r) = self
                .call(reqwest::Method::GET, &path, Some(&jwt), None)
                .await
                && r.status == 200
            {
                let status = r.body["status"].as_str().unwrap_or("").to_owned();
                b.pay_deadline = r.body["pay_deadline"].as_str().and_then(|d| d.parse().ok());
                b.seen = Some(status.clone());
                if status != "PROCESSING" {
                    break;
                }
            }
            if Instant::now() > give_up {
                return b;
            }
            tokio::time::sleep(Duration::from_millis(300 + rng.u64(..400))).await;
        }
        if b.seen.as_deref() != Some("WAITING_PAY") {
            return b;
        }
        let intent = match rng.u32(..100) {
            0..45 => Intent::Pay {
                declined_first: rng.u32(..6) == 0,
                racing: rng.u32(..5) == 0,
            },
            45..70 => Intent::Cancel,
            _ => Intent::Abandon,
        };
        b.intent = Some(intent);
        match intent {
            Intent::Pay {
                declined_first,
                racing,
            } => {
                let delay = if racing {
                    // From 3 s before the deadline to 2 s after it.
                    let deadline = b.pay_deadline.expect("a WAITING_PAY order has a deadline");
                    let offset = chrono::Duration::milliseconds(rng.i64(-3000..2000));
                    (deadline + offset - Utc::now())
                        .to_std()
                        .unwrap_or_default()
                } else {
                    Duration::from_millis(rng.u64(..8000))
                };
                tokio::time::sleep(delay).await;
                self.pay(&mut b, &jwt, declined_first).await;
            }
            Intent::Cancel => {
                tokio::time::sleep(Duration::from_millis(rng.u64(..8000))).await;
                let path = format!("/api/v1/orders/{order_no}/cancel");
                let r = self
                    .until_answered(reqwest::Method::POST, &path, Some(&jwt), None)
                    .await;
                b.cancel = r.map(|r| r.status);
            }
            Intent::Abandon => {}
        }
        b
    }

    /// A token, then the purchase, retried under one request_id until an
    /// answer that ends it: whether an order was accepted.
    async fn purchase(&self, b: &mut Buyer, jwt: &str) -> bool {
        let give_up = Instant::now() + PATIENCE;
        let token_path = format!("/api/v1/activities/{}/token", self.activity);
        let order_path = format!("/api/v1/activities/{}/orders", self.activity);
        while Instant::now() < give_up {
            let token = match self
                .call(reqwest::Method::GET, &token_path, Some(jwt), None)
                .await
            {
                Some(r) if r.status == 200 => r.body["token"].as_str().unwrap_or("").to_owned(),
                Some(r) if r.status == 409 => {
                    b.refused = Some(format!("token {} {}", r.status, r.code()));
                    return false;
                }
                _ => {
                    pause().await;
                    continue;
                }
            };
            let body = json!({"request_id": b.request_id, "token": token});
            let Some(r) = self
                .call(reqwest::Method::POST, &order_path, Some(jwt), Some(&body))
                .await
            else {
                pause().await;
                continue;
            };
            match (r.status, r.code()) {
                (202 | 200, _) if r.body["status"] != "FAILED" => {
                    b.order_no = r.body["order_no"].as_str().map(str::to_owned);
                    return true;
                }
                (200, _) | (409, _) => {
                    b.refused = Some(format!("{} {}", r.status, r.code()));
                    return false;
                }
                (403, "INVALID_TOKEN") | (503 | 408 | 429, _) => pause().await,
                (status, code) => {
                    self.anomalies.add(format!(
                        "buyer {}: purchase answered {status} {code} {}",
                        b.user, r.body
                    ));
                    pause().await;
                }
            }
        }
        b.refused = Some("gave up".into());
        false
    }

    /// `POST /orders/{no}/pay`, retried until answered: the payment, or
    /// `None` (the order is no longer payable, or no answer).
    async fn new_payment(&self, b: &mut Buyer, jwt: &str) -> Option<Value> {
        let order_no = b.order_no.clone().unwrap();
        let path = format!("/api/v1/orders/{order_no}/pay");
        let r = self
            .until_answered(reqwest::Method::POST, &path, Some(jwt), Some(&json!({})))
            .await?;
        if r.status != 200 {
            if r.status != 409 {
                self.anomalies.add(format!(
                    "buyer {}: pay answered {} {}",
                    b.user, r.status, r.body
                ));
            }
            return None;
        }
        if let Some(no) = r.body["payment_no"].as_str() {
            b.payments.push(no.to_owned());
        }
        Some(r.body)
    }

    /// The buyer pays `payment` at its provider (`decline`: with a card
    /// the bank declines).
    async fn at_provider(&self, payment: &Value, decline: bool) -> AtProvider {
        match payment["provider"].as_str() {
            Some("wechatpay") => {
                let no = payment["payment_no"].as_str().unwrap_or_default();
                self.providers.pay_wechat(no, decline, PATIENCE).await
            }
            Some("stripe") => {
                let secret = payment["client_secret"].as_str().unwrap_or_default();
                self.providers.pay_stripe(secret, decline, PATIENCE).await
            }
            other => {
                self.anomalies
                    .add(format!("a payment through {other:?}: {payment}"));
                AtProvider::Refused
            }
        }
    }

    /// Pays the order at the provider `pay` names. `declined_first`: the
    /// first payment is declined; once the server has it FAILED the buyer
    /// pays again (a new payment, for which the server closes the old one
    /// at its provider), pays the new one, then tries the old one too.
    async fn pay(&self, b: &mut Buyer, jwt: &str, declined_first: bool) {
        let Some(first) = self.new_payment(b, jwt).await else {
            return;
        };
        if !declined_first {
            b.at_provider = Some(self.at_provider(&first, false).await);
            return;
        }
        b.at_provider = Some(self.at_provider(&first, true).await);
        // Until the server has the decline: its callback, or its query.
        let order_no = b.order_no.clone().unwrap();
        let path = format!("/api/v1/orders/{order_no}");
        let give_up = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(r) = self
                .call(reqwest::Method::GET, &path, Some(jwt), None)
                .await
                && r.status == 200
            {
                if r.body["status"] != "WAITING_PAY" {
                    return;
                }
                if r.body["payment"]["status"] == "FAILED" {
                    break;
                }
            }
            if Instant::now() > give_up {
                return;
            }
            pause().await;
        }
        let Some(second) = self.new_payment(b, jwt).await else {
            return;
        };
        b.at_provider = Some(self.at_provider(&second, false).await);
        // The old QR code or client secret, after the new one paid.
        b.old_tried = Some(self.at_provider(&first, false).await);
    }

    /// The admin's after-sale refunds, every few seconds while buyers
    /// arrive: a PAID order of the sale, refunded (one in three asked
    /// twice). How many were asked and answered 202.
    async fn refunder(&self, arriving: &AtomicBool) -> usize {
        let mut rng = fastrand::Rng::with_seed(self.seed ^ 0x5eed_f00d);
        let admin = self.chaos.admin();
        let mut refunded = 0;
        while arriving.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(2000 + rng.u64(..3000))).await;
            let paid: Vec<String> = self
                .chaos
                .try_strings(&format!(
                    "SELECT order_no::text AS s FROM orders \
                     WHERE activity_id = {} AND status = 'PAID'",
                    self.activity
                ))
                .await
                .into_iter()
                .collect();
            if paid.is_empty() {
                continue;
            }
            let order_no = &paid[rng.usize(..paid.len())];
            let path = format!("/api/v1/admin/orders/{order_no}/refund");
            let body = json!({"reason": "nemesis after-sale"});
            for _ in 0..if rng.u32(..3) == 0 { 2 } else { 1 } {
                match self
                    .until_answered(reqwest::Method::POST, &path, Some(&admin), Some(&body))
                    .await
                {
                    Some(r) if r.status == 202 => refunded += 1,
                    Some(r) => self.anomalies.add(format!(
                        "refund of {order_no} answered {} {}",
                        r.status, r.body
                    )),
                    None => {}
                }
            }
        }
        refunded
    }

    async fn claimer(&self, user: i64) -> Claimer {
        let jwt = self.chaos.user(user);
        let path = format!("/api/v1/coupons/{}/claim", self.coupon);
        let body = json!({"request_id": format!("k{user}")});
        let mut c = Claimer {
            user,
            acked: false,
            last: "gave up".into(),
        };
        if let Some(r) = self
            .until_answered(reqwest::Method::POST, &path, Some(&jwt), Some(&body))
            .await
        {
            c.last = format!("{} {}", r.status, r.code());
            match (r.status, r.code()) {
                (202 | 200, _) => c.acked = true,
                (409, "COUPON_EXHAUSTED") => {}
                _ => self
                    .anomalies
                    .add(format!("claimer {user}: {} {}", r.status, r.body)),
            }
        }
        c
    }
}

async fn pause() {
    tokio::time::sleep(Duration::from_millis(200 + fastrand::u64(..300))).await;
}

/// The seed of this run: `SECKILL_NEMESIS_SEED`, or a new one.
fn seed() -> u64 {
    std::env::var("SECKILL_NEMESIS_SEED")
        .ok()
        .map(|s| s.parse().expect("SECKILL_NEMESIS_SEED is a number"))
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                % 1_000_000_007
        })
}

/// Applies one fault, holding its target's turn.
async fn apply(chaos: &Chaos, providers: &Providers, seed: u64, fault: Fault) {
    let services = &chaos.services;
    match fault {
        Fault::ProviderErrors { lasts } => {
            providers.errors(true, seed).await;
            tokio::time::sleep(lasts).await;
            providers.errors(false, seed).await;
        }
        Fault::ProviderPaused { pause } | Fault::StripePaused { pause } => {
            let pid = if matches!(fault, Fault::ProviderPaused { .. }) {
                providers.sim_pid()
            } else {
                providers.stripe_pid()
            };
            signal(pid, "STOP");
            let _resume = OnDrop(move || signal(pid, "CONT"));
            tokio::time::sleep(pause).await;
        }
        Fault::ServerKilled { down } => {
            chaos.kill_server();
            tokio::time::sleep(down).await;
            chaos.launch_server();
        }
        Fault::BrokerPaused { pause } => {
            let pid = services.pid("kafka");
            signal(pid, "STOP");
            let _resume = OnDrop(move || signal(pid, "CONT"));
            tokio::time::sleep(pause).await;
        }
        Fault::BrokerKilled { down } => {
            signal(services.pid("kafka"), "KILL");
            tokio::time::sleep(down).await;
            services.start("kafka").await;
        }
        Fault::RedisPaused { node, pause } => {
            let pid = services.redis_pid(node);
            signal(pid, "STOP");
            let _resume = OnDrop(move || signal(pid, "CONT"));
            tokio::time::sleep(pause).await;
        }
        Fault::RedisKilled { node, down } => {
            signal(services.redis_pid(node), "KILL");
            tokio::time::sleep(down).await;
            services.start_redis().await;
        }
        Fault::RedisFlushed { node } => services.flush_redis_node(node).await,
        Fault::PostgresRestarted { down } => {
            services.stop("postgres").await;
            tokio::time::sleep(down).await;
            services.start("postgres").await;
        }
        Fault::LeaderKilled { down } => {
            let n = leader(chaos).await;
            eprintln!("nemesis: broker {n} leads; SIGKILL");
            signal(services.broker_pid(n).await, "KILL");
            tokio::time::sleep(down).await;
            services.start_broker(n).await;
        }
        Fault::LeaderPaused { pause } => {
            let n = leader(chaos).await;
            eprintln!("nemesis: broker {n} leads; SIGSTOP");
            let pid = services.broker_pid(n).await;
            signal(pid, "STOP");
            let _resume = OnDrop(move || signal(pid, "CONT"));
            tokio::time::sleep(pause).await;
        }
        Fault::TwoBrokersDown { down } => {
            let keep = leader(chaos).await;
            let others: Vec<usize> = (1..=3).filter(|n| *n != keep).collect();
            eprintln!("nemesis: brokers {others:?} SIGKILL; broker {keep} left alone");
            for &n in &others {
                signal(services.broker_pid(n).await, "KILL");
            }
            tokio::time::sleep(down).await;
            for &n in &others {
                services.start_broker(n).await;
            }
        }
        Fault::PrimaryKilled { down } | Fault::StandbyKilled { down } => {
            let Some(primary) = services.pg_primary().await else {
                eprintln!("nemesis: no PostgreSQL primary to hit now; fault skipped");
                return;
            };
            let node = if matches!(fault, Fault::PrimaryKilled { .. }) {
                primary
            } else {
                3 - primary
            };
            eprintln!("nemesis: PostgreSQL node {node} (primary: {primary}) SIGKILL");
            crate::harness::signal_group(services.pg_node_group(node).await, "KILL");
            tokio::time::sleep(down).await;
            services.start_pg_node(node).await;
        }
    }
}

/// The broker leading partition 0 of the run's order topic (broker 1 when
/// none is known: a fault still hits a broker).
async fn leader(chaos: &Chaos) -> usize {
    let topic = format!("{}order.requested", chaos.topic_prefix());
    chaos.services.leader_of(&topic, 0).await.unwrap_or(1)
}

/// The seed of this run, and the payment providers it pays through
/// (started before the server, which is configured for both).
pub async fn providers() -> (u64, Providers) {
    let seed = seed();
    (seed, Providers::start(seed).await)
}

/// The run: the schedule over the sale, then the checkers.
pub async fn run(chaos: &Chaos, seed: u64, providers: &Providers) {
    providers.point_at(&chaos.base_url()).await;
    let replicated = chaos.services.replicated();
    let plan = schedule(seed, chaos.services.redis_nodes(), replicated);
    let replay = format!(
        "seed {seed}: replay with scripts/chaos.sh{} nemesis --seed {seed}",
        if chaos.services.cluster {
            " --redis-cluster"
        } else if replicated {
            " --replicated"
        } else {
            ""
        }
    );
    eprintln!("nemesis: {replay}");
    let default_hook = std::panic::take_hook();
    let on_panic = replay.clone();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        eprintln!("nemesis: FAILED, {on_panic}");
    }));
    for p in &plan {
        eprintln!(
            "nemesis: planned at {:>5.1}s {:?}",
            p.at.as_secs_f64(),
            p.fault
        );
    }
    eprintln!(
        "nemesis: {} faults planned, {} overlapping pairs",
        plan.len(),
        overlaps(&plan)
    );

    let sale = Sale::with_pay_timeout(chaos, 0, STOCK, PAY_TIMEOUT_SECS).await;
    let coupon = chaos.create_coupons(COUPONS).await;
    let clients = Clients {
        chaos,
        providers,
        activity: sale.activity,
        coupon,
        seed,
        anomalies: Anomalies::default(),
        accepted: AtomicUsize::new(0),
    };
    let started = Instant::now();
    let arriving = AtomicBool::new(true);
    let in_flight = AtomicUsize::new(0);
    let self_exits = AtomicUsize::new(0);

    let buyers = async {
        let mut running = FuturesUnordered::new();
        let mut done = Vec::new();
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / BUYERS_PER_SEC));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let next = AtomicI64::new(1);
        loop {
            tokio::select! {
                _ = tick.tick(), if arriving.load(Ordering::Relaxed) => {
                    running.push(clients.buyer(next.fetch_add(1, Ordering::Relaxed)));
                }
                Some(b) = running.next() => done.push(b),
                else => break,
            }
            in_flight.store(running.len(), Ordering::Relaxed);
        }
        done
    };
    let claimers = async {
        let mut running = FuturesUnordered::new();
        let mut done = Vec::new();
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / CLAIMERS_PER_SEC));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut next = 20_000_000;
        loop {
            tokio::select! {
                _ = tick.tick(), if arriving.load(Ordering::Relaxed) => {
                    next += 1;
                    running.push(clients.claimer(next));
                }
                Some(c) = running.next() => done.push(c),
                else => break,
            }
        }
        done
    };
    // Faults on one process take turns; faults on different ones overlap.
    let turns: BTreeMap<Target, tokio::sync::Mutex<()>> = [
        Target::Server,
        Target::Broker,
        Target::Redis,
        Target::Postgres,
        Target::Provider,
    ]
    .into_iter()
    .map(|t| (t, tokio::sync::Mutex::new(())))
    .collect();
    let applied: Mutex<Vec<(Duration, Duration, Fault)>> = Mutex::new(Vec::new());
    let faults = join_all(plan.iter().enumerate().map(|(i, p)| {
        let turns = &turns;
        let applied = &applied;
        let clients = &clients;
        let in_flight = &in_flight;
        async move {
            tokio::time::sleep_until((started + p.at).into()).await;
            let _turn = turns[&p.fault.target()].lock().await;
            let from = started.elapsed();
            eprintln!(
                "nemesis: fault {} at {:.1}s: {:?}; {} buyers in flight, {} accepted so far",
                i + 1,
                from.as_secs_f64(),
                p.fault,
                in_flight.load(Ordering::Relaxed),
                clients.accepted.load(Ordering::Relaxed)
            );
            apply(chaos, providers, seed ^ i as u64, p.fault).await;
            let to = started.elapsed();
            eprintln!(
                "nemesis: fault {} healed at {:.1}s",
                i + 1,
                to.as_secs_f64()
            );
            applied.lock().unwrap().push((from, to, p.fault));
        }
    }));
    // The supervisor: a server that ended by itself (its liveness gave up)
    // is started again, until every client is done.
    let clients_done = AtomicBool::new(false);
    let supervisor = async {
        while !clients_done.load(Ordering::Relaxed) {
            if let Some(status) = chaos.server_exited() {
                self_exits.fetch_add(1, Ordering::Relaxed);
                eprintln!(
                    "nemesis: the server exited by itself ({status}) at {:.1}s; starting it again",
                    started.elapsed().as_secs_f64()
                );
                chaos.launch_server();
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    let schedule_then_ready = async {
        faults.await;
        let healed = started.elapsed();
        let since = Instant::now();
        loop {
            if chaos.ready().await {
                break;
            }
            assert!(
                since.elapsed() < READY_WITHIN,
                "{replay}: not ready {}s after the last fault healed; logs: {}",
                READY_WITHIN.as_secs(),
                chaos.logs()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let ready_after = since.elapsed();
        eprintln!(
            "nemesis: every fault healed at {:.1}s; ready {:.1}s later",
            healed.as_secs_f64(),
            ready_after.as_secs_f64()
        );
        // Arrivals go on to the end of the span and past the last fault.
        tokio::time::sleep_until((started + SPAN.max(healed)).into()).await;
        arriving.store(false, Ordering::Relaxed);
        ready_after
    };
    let clients_end = async {
        let ended = tokio::join!(buyers, claimers, clients.refunder(&arriving));
        clients_done.store(true, Ordering::Relaxed);
        ended
    };
    let ((bought, claimed, refunds_asked), ready_after, ()) =
        tokio::join!(clients_end, schedule_then_ready, supervisor);
    let applied = applied.into_inner().unwrap();
    eprintln!(
        "nemesis: clients done at {:.1}s",
        started.elapsed().as_secs_f64()
    );

    let figures = check(chaos, &clients, &sale, &bought, &claimed, &replay).await;
    let money = money(chaos, &clients, &bought, refunds_asked, &replay).await;
    eprintln!(
        "nemesis: {replay}; redis {}; {} faults applied ({} overlapping), the server exited by itself {} times; {figures}; {money}; ready {:.1}s after the last fault healed",
        if chaos.services.cluster {
            "cluster"
        } else {
            "single"
        },
        applied.len(),
        overlapping(&applied),
        self_exits.load(Ordering::Relaxed),
        ready_after.as_secs_f64()
    );
    // The default hook again, for the tests after this one.
    let _ = std::panic::take_hook();
}

/// Money, once the orders have settled: waits until nothing is under way
/// here or at the providers, then balances the providers' records against
/// ours (`money.rs`). The run's money figures.
async fn money(
    chaos: &Chaos,
    clients: &Clients<'_>,
    bought: &[Buyer],
    refunds_asked: usize,
    replay: &str,
) -> String {
    crate::money::settle(chaos, clients.providers, SETTLE_WITHIN, replay).await;
    let (anomalies, figures) =
        crate::money::check(chaos, clients.providers, clients.activity).await;
    let declined = bought
        .iter()
        .filter(|b| {
            matches!(
                b.intent,
                Some(Intent::Pay {
                    declined_first: true,
                    ..
                })
            )
        })
        .count();
    let old = |what: AtProvider| bought.iter().filter(|b| b.old_tried == Some(what)).count();
    let paid_at_provider = bought
        .iter()
        .filter(|b| b.at_provider == Some(AtProvider::Done))
        .count();
    assert!(
        anomalies.is_empty(),
        "{replay}: {} money anomalies:\n{}\nlogs: {}",
        anomalies.len(),
        anomalies.join("\n"),
        chaos.logs()
    );
    assert!(paid_at_provider > 0, "{replay}: nobody paid at a provider");
    format!(
        "{figures}; {paid_at_provider} buyers paid at a provider, {declined} declined first; \
         an old payment tried after the new one: {} refused, {} taken; {refunds_asked} \
         after-sale refunds asked",
        old(AtProvider::Refused),
        old(AtProvider::Done)
    )
}

/// Pairs of applied faults that were on at the same time.
fn overlapping(applied: &[(Duration, Duration, Fault)]) -> usize {
    let mut n = 0;
    for (i, a) in applied.iter().enumerate() {
        for b in &applied[i + 1..] {
            if b.0 < a.1 && a.0 < b.1 {
                n += 1;
            }
        }
    }
    n
}

/// Waits until everything settled, then checks the history against the
/// database: the run's figures.
async fn check(
    chaos: &Chaos,
    clients: &Clients<'_>,
    sale: &Sale<'_>,
    bought: &[Buyer],
    claimed: &[Claimer],
    replay: &str,
) -> String {
    let activity = sale.activity;
    let started = Instant::now();
    let (stats, coupons) = loop {
        let stats = chaos.stats(activity).await;
        let coupons = chaos.coupon_stats(clients.coupon).await;
        if let (Some(s), Some(c)) = (&stats, &coupons)
            && s["reservations_open"] == 0
            && s["orders"]["PROCESSING"] == 0
            && s["orders"]["WAITING_PAY"] == 0
            && s["redis_available"] == s["db_available"]
            && c["redis_remaining"].as_i64()
                == Some(c["total"].as_i64().unwrap_or(0) - c["db_claimed"].as_i64().unwrap_or(0))
        {
            break (s.clone(), c.clone());
        }
        assert!(
            started.elapsed() < SETTLE_WITHIN,
            "{replay}: not settled {}s after the clients finished: {stats:?} {coupons:?}; logs: {}",
            SETTLE_WITHIN.as_secs(),
            chaos.logs()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!(
        "nemesis: settled {:.1}s after the clients: {stats} {coupons}",
        started.elapsed().as_secs_f64()
    );
    let fail = |what: String| clients.anomalies.add(what);

    // Every order as the database has it.
    let rows = chaos
        .strings(&format!(
            "SELECT order_no::text || ' ' || user_id::text || ' ' || request_id || ' ' || status \
               || ' ' || COALESCE(failure_reason, '-') AS s \
             FROM orders WHERE activity_id = {activity}"
        ))
        .await;
    let mut orders: HashMap<String, (i64, String, String)> = HashMap::new();
    let mut reasons: HashMap<String, String> = HashMap::new();
    for row in rows {
        let parts: Vec<&str> = row.split(' ').collect();
        orders.insert(
            parts[0].to_owned(),
            (
                parts[1].parse().unwrap(),
                parts[2].to_owned(),
                parts[3].to_owned(),
            ),
        );
        reasons.insert(parts[0].to_owned(), parts[4].to_owned());
    }
    // The orders a capture paid (refunded after-sale or not).
    let successful = chaos
        .strings("SELECT order_no::text AS s FROM payments WHERE pays_order")
        .await;

    let mut acked: HashSet<&str> = HashSet::new();
    let (mut paid, mut cancelled, mut closed) = (0, 0, 0);
    for b in bought {
        let Some(order_no) = b.order_no.as_deref() else {
            continue;
        };
        acked.insert(order_no);
        let Some((user, request_id, status)) = orders.get(order_no) else {
            fail(format!(
                "buyer {}: accepted order {order_no} does not exist",
                b.user
            ));
            continue;
        };
        if *user != b.user || *request_id != b.request_id {
            fail(format!(
                "buyer {}: order {order_no} is user {user}'s request {request_id}",
                b.user
            ));
        }
        match status.as_str() {
            "PAID" => paid += 1,
            "CANCELLED" => cancelled += 1,
            "CLOSED" => closed += 1,
            other => fail(format!(
                "buyer {}: accepted order {order_no} ended {other}, reason {} ({b:?})",
                b.user, reasons[order_no]
            )),
        }
        if status == "PAID" && (b.payments.is_empty() || !successful.contains(order_no)) {
            fail(format!(
                "order {order_no} PAID without a successful payment of its buyer: {b:?}"
            ));
        }
        if status != "PAID" && successful.contains(order_no) {
            fail(format!("order {order_no} {status} with a SUCCESS payment"));
        }
        if b.cancel == Some(200) && status != "CANCELLED" {
            fail(format!(
                "order {order_no}: cancel answered 200, ended {status}"
            ));
        }
        match b.intent {
            Some(Intent::Abandon) if status != "CLOSED" => {
                fail(format!("order {order_no}: abandoned, ended {status}"))
            }
            Some(Intent::Cancel) if status == "PAID" => {
                fail(format!("order {order_no}: cancelled, ended PAID"))
            }
            _ => {}
        }
    }
    // Orders nobody was told about (an answer lost to a fault) were never
    // paid, and ended.
    for (order_no, (user, _, status)) in &orders {
        if !acked.contains(order_no.as_str())
            && !matches!(status.as_str(), "CLOSED" | "FAILED" | "CANCELLED")
        {
            fail(format!(
                "order {order_no} of user {user}, never acknowledged, ended {status}"
            ));
        }
    }
    // No double charge: one successful payment per order at most.
    let charged_twice = chaos
        .count(
            "SELECT count(*) AS n FROM (SELECT order_no FROM payments WHERE status = 'SUCCESS' \
             GROUP BY order_no HAVING count(*) > 1) d",
        )
        .await;
    if charged_twice != 0 {
        fail(format!("{charged_twice} orders charged twice"));
    }
    // I3: one order per request; I2: one unit per buyer.
    let duplicated = chaos
        .count(&format!(
            "SELECT count(*) AS n FROM (SELECT 1 FROM orders WHERE activity_id = {activity} \
             GROUP BY user_id, request_id HAVING count(*) > 1) d"
        ))
        .await;
    if duplicated != 0 {
        fail(format!("{duplicated} requests with two orders"));
    }
    let over_limit = chaos
        .count(&format!(
            "SELECT count(*) AS n FROM (SELECT user_id FROM orders WHERE activity_id = {activity} \
             AND status IN ('WAITING_PAY', 'PAID') GROUP BY user_id HAVING sum(quantity) > 1) o"
        ))
        .await;
    if over_limit != 0 {
        fail(format!("{over_limit} buyers over their limit"));
    }
    // I1 / I7: sold = Σ PAID ≤ stock, conservation, Redis = database.
    let total = stats["stock_total"].as_i64().unwrap();
    let available = stats["db_available"].as_i64().unwrap();
    let locked = stats["db_locked"].as_i64().unwrap();
    let sold = stats["db_sold"].as_i64().unwrap();
    let paid_units = chaos
        .count(&format!(
            "SELECT COALESCE(sum(quantity), 0)::bigint AS n FROM orders \
             WHERE activity_id = {activity} AND status = 'PAID'"
        ))
        .await;
    if sold != paid_units || sold > i64::from(STOCK) {
        fail(format!(
            "sold {sold}, paid units {paid_units}, stock {STOCK}"
        ));
    }
    if total != available + locked + sold || locked != 0 {
        fail(format!("stock does not add up: {stats}"));
    }
    // Coupons: none over-issued, no acknowledged claim lost, one each.
    let db_claimed = coupons["db_claimed"].as_i64().unwrap();
    let rows = chaos
        .count(&format!(
            "SELECT count(*) AS n FROM user_coupons WHERE coupon_id = {}",
            clients.coupon
        ))
        .await;
    if rows != db_claimed || db_claimed > i64::from(COUPONS) {
        fail(format!(
            "coupons: {rows} held, {db_claimed} counted, {COUPONS} issued"
        ));
    }
    let holders = chaos
        .strings(&format!(
            "SELECT user_id::text AS s FROM user_coupons WHERE coupon_id = {}",
            clients.coupon
        ))
        .await;
    let mut claims_acked = 0;
    for c in claimed.iter().filter(|c| c.acked) {
        claims_acked += 1;
        if !holders.contains(&c.user.to_string()) {
            fail(format!(
                "claimer {}: claim acknowledged, no coupon held",
                c.user
            ));
        }
    }
    // Redis and the database agree on the units whenever nothing is open
    // and every release is applied: a repair of Redis's count means they
    // drifted apart during the run, and a drift up sells units the
    // database does not have (accepted orders ending FAILED once the stock
    // runs out, whether or not it did in this run).
    for line in chaos.log_lines("to match the database") {
        fail(format!("reconciliation repaired Redis's count: {line}"));
    }
    let anomalies = clients.anomalies.0.lock().unwrap().clone();
    if !anomalies.is_empty() {
        // What reconciliation found and did, in the failure's own output:
        // CI keeps the test's output, not the server's log files.
        let found = chaos.log_lines("reconciliation found differences");
        eprintln!(
            "nemesis: reconciliation's findings ({} lines, the last {} here):",
            found.len(),
            found.len().min(40)
        );
        for line in &found[found.len().saturating_sub(40)..] {
            eprintln!("  {}", line.chars().take(400).collect::<String>());
        }
    }
    assert!(
        anomalies.is_empty(),
        "{replay}: {} anomalies:\n{}\nlogs: {}",
        anomalies.len(),
        anomalies.join("\n"),
        chaos.logs()
    );
    let accepted = bought.iter().filter(|b| b.order_no.is_some()).count();
    assert!(accepted > 0, "{replay}: nothing was accepted");
    format!(
        "{} buyers, {accepted} accepted: {paid} paid, {cancelled} cancelled, {closed} closed; {} claims acknowledged of {} claimers, {db_claimed} of {COUPONS} coupons held",
        bought.len(),
        claims_acked,
        claimed.len()
    )
}
