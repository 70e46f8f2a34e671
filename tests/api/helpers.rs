//! `spawn_app()`: the server on port 0 in an isolated namespace.

use std::sync::Arc;
use std::time::Duration;

use diesel::{Connection, PgConnection, RunQueryDsl};
use seckill::app::Application;
use seckill::auth::{JwtKeys, Role};
use seckill::clock::{Clock, ShiftedClock};
use seckill::config::Settings;
use secrecy::{ExposeSecret, SecretString};

/// A running server and what a test needs to talk to it.
pub struct TestApp {
    /// `http://127.0.0.1:<port>`.
    pub address: String,
    /// The settings the server runs with (its own database, prefixes).
    pub settings: Settings,
    /// A keep-alive HTTP client.
    pub client: reqwest::Client,
    /// This test's database, dropped with the `TestApp`.
    pub db_name: String,
    /// Stops the server (a graceful shutdown, as on SIGTERM).
    pub server: actix_web::dev::ServerHandle,
    /// The server's sale clock: move it forward instead of sleeping
    /// through a sale window.
    pub clock: Arc<ShiftedClock>,
    keys: JwtKeys,
    /// The database and prefixes are this app's own, removed when it
    /// drops (not a [`TestApp::sibling`]'s).
    owns_namespace: bool,
}

/// The server with the test settings and a fresh namespace.
pub async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

/// Like [`spawn_app`], with `tweak` applied to the settings last (e.g. to point
/// a client at a closed port).
pub async fn spawn_app_with(tweak: impl FnOnce(&mut Settings)) -> TestApp {
    // A test still running by far past any test's time (a hang anywhere,
    // from here to the drop of its runtime) ends the process, naming it.
    let hang = crate::hang::HangWatch::start();
    let mut settings = Settings::load_env("test").expect("test settings load");
    // Once per run: earlier runs' leftovers go before this run adds its own.
    static STALE_REMOVED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    let base = settings.clone();
    STALE_REMOVED
        .get_or_init(|| async move {
            let _ = tokio::task::spawn_blocking(move || crate::cleanup::remove_stale_topics(&base))
                .await;
        })
        .await;
    // t<run: 4 hex><test: 12 hex>: unique, and tells this run's names apart.
    let id = format!(
        "{}{}",
        crate::cleanup::run_id(),
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    settings.app.port = 0;
    settings.redis.key_prefix = format!("t{id}:");
    settings.kafka.topic_prefix = format!("t{id}.");
    let db_name = format!("seckill_test_{id}");
    settings.postgres.url = create_database(&settings.postgres.url, &db_name).await;
    let addresses = |s: &Settings| {
        (
            s.kafka.brokers.clone(),
            s.redis.url.clone(),
            s.postgres.url.expose_secret().to_owned(),
        )
    };
    // A replica is read from only where a test asks for it
    // ([`reads_from_the_replica`]), for its own database.
    settings.postgres.replica_url = SecretString::from("");
    let untouched = addresses(&settings);
    tweak(&mut settings);
    let on_the_real_services = addresses(&settings) == untouched;
    if std::env::var_os("SECKILL_TEST_LOG").is_some() {
        // Debugging aid: `SECKILL_TEST_LOG=1 cargo test ... -- --nocapture`.
        settings.log.level = "info".into();
        seckill::telemetry::init(&settings.log);
    }

    let clock = Arc::new(ShiftedClock::default());
    let app = Application::build_with_clock(settings.clone(), clock.clone())
        .await
        .expect("application builds");
    let address = format!("http://127.0.0.1:{}", app.port());
    hang.serving(&address);
    let server = app.server_handle();
    tokio::spawn(app.run_until_stopped());
    let app = TestApp {
        address,
        server,
        clock,
        keys: JwtKeys::new(&settings.auth.jwt_secret).expect("jwt keys"),
        settings,
        // Idle connections are dropped before the server's keep-alive (5 s)
        // closes them: a request sent on one just as the server closes it
        // fails with IncompleteMessage, which is the client's race, not an
        // answer (the load generator does the same).
        // No answer within two minutes fails the request (and the test)
        // instead of waiting for ever; streams send a keep-alive every 15 s.
        client: reqwest::Client::builder()
            .pool_idle_timeout(Duration::from_secs(2))
            .read_timeout(Duration::from_secs(120))
            .build()
            .expect("HTTP client"),
        db_name,
        owns_namespace: true,
    };
    // A server on the real services is handed over once it is ready (its
    // topics exist: on a slow broker their creation can outlast startup).
    // Tests that point a client at a dead address get theirs at once.
    if on_the_real_services {
        app.wait_until_ready().await;
    }
    app
}

impl TestApp {
    /// Another instance of this test's world (its database, Redis prefix
    /// and topics), in process, with `tweak` on top of its settings: as an
    /// instance started with other settings during a rolling change. It
    /// stops when dropped and leaves the namespace to this app.
    pub async fn sibling(&self, tweak: impl FnOnce(&mut Settings)) -> TestApp {
        let mut settings = self.settings.clone();
        settings.app.port = 0;
        tweak(&mut settings);
        let clock = Arc::new(ShiftedClock::default());
        let app = Application::build_with_clock(settings.clone(), clock.clone())
            .await
            .expect("the sibling builds");
        let address = format!("http://127.0.0.1:{}", app.port());
        let server = app.server_handle();
        tokio::spawn(app.run_until_stopped());
        let sibling = TestApp {
            address,
            server,
            clock,
            keys: JwtKeys::new(&settings.auth.jwt_secret).expect("jwt keys"),
            settings,
            client: reqwest::Client::builder()
                .pool_idle_timeout(Duration::from_secs(2))
                .read_timeout(Duration::from_secs(120))
                .build()
                .expect("HTTP client"),
            db_name: self.db_name.clone(),
            owns_namespace: false,
        };
        sibling.wait_until_ready().await;
        sibling
    }

    /// Polls `/health/ready` until it answers 200 (one minute at most).
    pub async fn wait_until_ready(&self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let res = self.get("/health/ready", None).await;
            if res.status() == 200 {
                return;
            }
            let body = res.text().await.unwrap_or_default();
            assert!(
                std::time::Instant::now() < deadline,
                "the server never became ready: {body}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
}

/// No order consumer in the server: the test runs its own, or none. With
/// nothing consuming on purpose, the stall check (which would rightly
/// answer 503 BUSY once messages wait for `kafka.consumer_stall_secs`) is
/// off too.
pub fn without_order_consumer(settings: &mut Settings) {
    settings.orders.consumer_enabled = false;
    settings.kafka.consumer_stall_secs = std::time::Duration::from_secs(0);
}

/// No broker at all (a closed port): every message times out in
/// librdkafka's queue after `message_timeout_ms`, never sent.
pub fn kafka_unreachable(settings: &mut Settings, message_timeout_ms: u64) {
    settings.kafka.brokers = "127.0.0.1:1".into();
    settings.kafka.timeout_ms = std::time::Duration::from_millis(1000);
    settings.kafka.message_timeout_ms = std::time::Duration::from_millis(message_timeout_ms);
}

/// The product's whole promise for the crash tests (I4): reconciliation
/// runs often enough, with a short enough publish window, that an accepted
/// purchase whose acknowledged event the broker lost is published again
/// well inside [`TestApp::drained`]'s 60 s.
pub fn heal_within_the_drain(settings: &mut Settings) {
    settings.reconcile.interval_secs = std::time::Duration::from_secs(2);
    settings.kafka.message_timeout_ms = std::time::Duration::from_millis(5_000);
    settings.reconcile.publish_window_secs = std::time::Duration::from_secs(
        settings.in_flight_bound().as_millis().div_ceil(1000) as u64,
    );
}

pub use crate::db::{create_database, database_url};

impl TestApp {
    /// A user token for `user_id`.
    pub fn user_token(&self, user_id: i64) -> String {
        self.keys.mint(user_id, Role::User, 3600).expect("mint")
    }

    /// An admin token.
    pub fn admin_token(&self) -> String {
        self.keys.mint(1, Role::Admin, 3600).expect("mint")
    }

    /// `GET path` with an optional bearer token, sent again if its
    /// connection closed before the answer ([`TestApp::send_idempotent`]).
    pub async fn get(&self, path: &str, token: Option<&str>) -> reqwest::Response {
        self.send_idempotent(path, || {
            let req = self.client.get(format!("{}{path}", self.address));
            match token {
                Some(t) => req.bearer_auth(t),
                None => req,
            }
        })
        .await
    }

    /// Sends the request `build` makes; a connection closed before the
    /// answer, or a 408 (the server gave up reading the request: nothing
    /// was done), is tried again, twice at most, as HTTP clients do with
    /// an idempotent request. On a starved host the server can close a
    /// kept-alive connection the client has just written to, or not read
    /// a new one's request within its 5 s.
    async fn send_idempotent(
        &self,
        what: &str,
        build: impl Fn() -> reqwest::RequestBuilder,
    ) -> reqwest::Response {
        let mut attempt = 1;
        loop {
            match build().send().await {
                Ok(res) if res.status() == 408 && attempt < 3 => {
                    eprintln!("{what}: 408; trying again");
                    attempt += 1;
                }
                Ok(res) => return res,
                Err(e) if attempt < 3 && (e.is_request() || e.is_connect()) => {
                    eprintln!("{what}: {e:?}; trying again");
                    attempt += 1;
                }
                Err(e) => panic!("request sent: {e:?}"),
            }
        }
    }

    /// `POST path` with a JSON body and an optional bearer token.
    pub async fn post_json(
        &self,
        path: &str,
        body: &serde_json::Value,
        token: Option<&str>,
    ) -> reqwest::Response {
        let mut req = self
            .client
            .post(format!("{}{path}", self.address))
            .json(body);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send().await.expect("request sent")
    }
}

/// A process a test started, killed (SIGKILL) and reaped when dropped: a
/// test that fails half-way leaves nothing running behind it.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if !self.owns_namespace {
            // The command is sent as the call is made; nothing to await.
            drop(self.server.stop(false));
            return;
        }
        if std::env::var_os("SECKILL_TEST_KEEP").is_some() {
            eprintln!(
                "kept: database {} , Redis prefix {}",
                self.db_name, self.settings.redis.key_prefix
            );
            return;
        }
        // Best effort, on a plain thread (Drop may run inside the runtime).
        let base = self.settings.postgres.url.expose_secret().to_owned();
        let name = self.db_name.clone();
        let settings = self.settings.clone();
        let _ = std::thread::spawn(move || {
            crate::cleanup::remove_namespace(&settings);
            crate::db::drop_database(&base, &name);
        })
        .join();
    }
}

/// The sum of every sample of the counter family `name` in the
/// `/metrics` of the instance at `base` (all label sets).
pub async fn metric_sum_at(base: &str, name: &str) -> i64 {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let family = format!("{name}{{");
    text.lines()
        .filter(|l| l.starts_with(&family))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as i64
}

/// Waits until `check` yields a value, polling every 100 ms; panics after
/// `within` naming `what`. The one way tests wait for a condition: a
/// deadline sized for a slow host, never a fixed sleep.
pub async fn eventually<T, F, Fut>(what: &str, within: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not within {}s: {what}",
            within.as_secs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Reads a JSON body, failing the test with the raw text when it is not JSON.
pub async fn json(res: reqwest::Response) -> serde_json::Value {
    let text = res.text().await.expect("body");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// Sale window relative to now, in seconds.
pub struct Window {
    pub start: i64,
    pub end: i64,
}

/// How long the stats are given to settle. The order consumers need it:
/// on a loaded host one can sit in a group join that never completes, and
/// the service rebuilds it only after `kafka.consumer_stall_secs` (20 s)
/// without progress, then it joins again. A test waiting 30 s failed once
/// on a loaded CI host, its message not kept; here these waits take 1–2 s.
pub const SETTLE_SECS: u64 = 60;

/// Open now, for an hour.
pub const OPEN: Window = Window {
    start: -60,
    end: 3600,
};

impl TestApp {
    /// Creates an activity and returns its id.
    pub async fn create_activity(
        &self,
        stock: i32,
        per_user_limit: i32,
        buckets: i32,
        w: Window,
    ) -> i64 {
        let now = chrono::Utc::now();
        let body = serde_json::json!({
            "sku_id": 1001, "name": "Phone", "price_cents": 9900, "stock": stock,
            "start_at": now + chrono::Duration::seconds(w.start),
            "end_at": now + chrono::Duration::seconds(w.end),
            "per_user_limit": per_user_limit, "pay_timeout_secs": 900, "buckets": buckets,
        });
        let res = self
            .post_json("/api/v1/admin/activities", &body, Some(&self.admin_token()))
            .await;
        assert_eq!(res.status(), 201);
        json(res).await["activity_id"]
            .as_i64()
            .expect("activity_id")
    }

    /// Warms an activity up (asserting 200).
    pub async fn warmup(&self, activity_id: i64) -> serde_json::Value {
        let res = self
            .post_json(
                &format!("/api/v1/admin/activities/{activity_id}/warmup"),
                &serde_json::json!({}),
                Some(&self.admin_token()),
            )
            .await;
        assert_eq!(res.status(), 200);
        json(res).await
    }

    /// An open, warmed activity.
    pub async fn live_activity(&self, stock: i32, per_user_limit: i32, buckets: i32) -> i64 {
        self.warmed_activity(stock, per_user_limit, buckets, OPEN)
            .await
    }

    /// A warmed activity whose sale runs over `w`.
    pub async fn warmed_activity(
        &self,
        stock: i32,
        per_user_limit: i32,
        buckets: i32,
        w: Window,
    ) -> i64 {
        let id = self
            .create_activity(stock, per_user_limit, buckets, w)
            .await;
        self.warmup(id).await;
        id
    }

    /// A purchase token for `user_id` (asserting 200 in the end; a 503,
    /// such as while a lost activity is restored, is retried for a minute).
    pub async fn purchase_token(&self, user_id: i64, activity_id: i64) -> String {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let res = self
                .get(
                    &format!("/api/v1/activities/{activity_id}/token"),
                    Some(&self.user_token(user_id)),
                )
                .await;
            if res.status() == 503 && std::time::Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                continue;
            }
            assert_eq!(res.status(), 200);
            return json(res).await["token"].as_str().expect("token").to_owned();
        }
    }

    /// `POST /activities/{id}/orders` as `user_id` with `body`.
    pub async fn order(
        &self,
        user_id: i64,
        activity_id: i64,
        body: &serde_json::Value,
    ) -> reqwest::Response {
        // Idempotent by its request_id: sent again if its connection closed.
        let path = format!("/api/v1/activities/{activity_id}/orders");
        let token = self.user_token(user_id);
        self.send_idempotent(&path, || {
            self.client
                .post(format!("{}{path}", self.address))
                .json(body)
                .bearer_auth(&token)
        })
        .await
    }

    /// [`TestApp::order`], sent again while it answers 503 (for a minute),
    /// as any client does: a purchase that meets a passing 503 (Redis
    /// answered one probe late, the modes are re-read) gets the answer
    /// the test is about on its retry.
    pub async fn order_past_503(
        &self,
        user_id: i64,
        activity_id: i64,
        body: &serde_json::Value,
    ) -> reqwest::Response {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let res = self.order(user_id, activity_id, body).await;
            if res.status() != 503 || std::time::Instant::now() >= deadline {
                return res;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    }

    /// `POST /activities/{id}/orders` as a client that retries what the
    /// API says to retry with the same request: every 503 (BUSY, refused
    /// before anything was reserved; RETRY_LATER naming an order_no, its
    /// delivery not confirmed yet; RETRY_LATER naming none), for up to a
    /// minute; a retry of one that named none and finds its token used
    /// answers that 503. A 2xx after a retry is reported as 202, the
    /// buyer's view: accepted.
    pub async fn order_retrying(
        &self,
        user_id: i64,
        activity_id: i64,
        body: &serde_json::Value,
    ) -> (u16, serde_json::Value) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let mut retried = false;
        // The last 503 that named no order_no: its retry may find the
        // token used (the attempt got as far as Redis and kept nothing),
        // and then that 503 is the answer, for the caller to start over.
        let mut kept_nothing: Option<serde_json::Value> = None;
        loop {
            let res = self.order(user_id, activity_id, body).await;
            let status = res.status().as_u16();
            let answer = json(res).await;
            if status == 403
                && answer["code"] == "INVALID_TOKEN"
                && let Some(refused) = kept_nothing.take()
            {
                return (503, refused);
            }
            // Every 503 says when to come back (`Retry-After`), and the same
            // request_id is the way back: BUSY, RETRY_LATER naming an
            // order_no, or RETRY_LATER before Redis was asked ("Redis is
            // back", seen on a loaded cluster).
            if status == 503 && std::time::Instant::now() < deadline {
                retried = true;
                kept_nothing = (answer["code"] != "BUSY" && answer["order_no"].is_null())
                    .then(|| answer.clone());
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                continue;
            }
            let accepted_on_retry = retried && status == 200 && answer["status"] != "FAILED";
            return (if accepted_on_retry { 202 } else { status }, answer);
        }
    }

    /// One purchase attempt, no retry: token, then the order with a fresh
    /// request_id: (status, body).
    pub async fn buy_once(&self, user_id: i64, activity_id: i64) -> (u16, serde_json::Value) {
        let request_id = uuid::Uuid::new_v4().to_string();
        self.attempt(user_id, activity_id, &request_id).await
    }

    /// A fresh token, then the order with `request_id`: (status, body).
    pub async fn attempt(
        &self,
        user_id: i64,
        activity_id: i64,
        request_id: &str,
    ) -> (u16, serde_json::Value) {
        let token = self.purchase_token(user_id, activity_id).await;
        let res = self
            .order(
                user_id,
                activity_id,
                &serde_json::json!({"request_id": request_id, "token": token}),
            )
            .await;
        let status = res.status().as_u16();
        (status, json(res).await)
    }

    /// Buys as a well-behaved client does: a token, then the order with a
    /// fresh request_id; on 503 (BUSY, or RETRY_LATER while a delivery is
    /// unconfirmed) the same request_id again, with a new token, for up to
    /// a minute. Returns the final (status, body); a purchase accepted on a
    /// retry (a 2xx after a 503) is reported as 202, the buyer's view.
    pub async fn buy(&self, user_id: i64, activity_id: i64) -> (u16, serde_json::Value) {
        let request_id = uuid::Uuid::new_v4().to_string();
        self.buy_as(user_id, activity_id, &request_id).await
    }

    /// [`TestApp::buy`] under a request_id of the caller's.
    pub async fn buy_as(
        &self,
        user_id: i64,
        activity_id: i64,
        request_id: &str,
    ) -> (u16, serde_json::Value) {
        self.buy_as_after(user_id, activity_id, request_id, false)
            .await
    }

    /// [`TestApp::buy_as`] after the caller's own attempt was answered 503:
    /// a 2xx now is the purchase accepted on a retry (202), although this
    /// call's first answer is already it.
    pub async fn retry_as(
        &self,
        user_id: i64,
        activity_id: i64,
        request_id: &str,
    ) -> (u16, serde_json::Value) {
        self.buy_as_after(user_id, activity_id, request_id, true)
            .await
    }

    async fn buy_as_after(
        &self,
        user_id: i64,
        activity_id: i64,
        request_id: &str,
        mut retried: bool,
    ) -> (u16, serde_json::Value) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let (status, body) = self.attempt(user_id, activity_id, request_id).await;
            if status == 503 && std::time::Instant::now() < deadline {
                retried = true;
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                continue;
            }
            let accepted_on_retry = retried && status == 200 && body["status"] != "FAILED";
            return (if accepted_on_retry { 202 } else { status }, body);
        }
    }

    /// The admin stats of an activity.
    pub async fn stats(&self, activity_id: i64) -> serde_json::Value {
        let res = self
            .get(
                &format!("/api/v1/admin/activities/{activity_id}/stats"),
                Some(&self.admin_token()),
            )
            .await;
        let status = res.status();
        let body = json(res).await;
        assert_eq!(status, 200, "stats answered {body}");
        body
    }

    /// Polls the stats until `done` holds (or panics after
    /// [`SETTLE_SECS`]).
    pub async fn wait_for_stats(
        &self,
        activity_id: i64,
        done: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        self.poll_stats(activity_id, SETTLE_SECS, done)
            .await
            .unwrap_or_else(|stats| panic!("stats did not settle in {SETTLE_SECS}s: {stats}"))
    }

    /// The stats once `done` holds, or the last ones after `secs`.
    async fn poll_stats(
        &self,
        activity_id: i64,
        secs: u64,
        done: impl Fn(&serde_json::Value) -> bool,
    ) -> Result<serde_json::Value, serde_json::Value> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
        loop {
            let stats = self.stats(activity_id).await;
            if done(&stats) {
                return Ok(stats);
            }
            if std::time::Instant::now() > deadline {
                return Err(stats);
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// Waits until no reservation is open and `n` orders are WAITING_PAY.
    /// On timeout the panic explains every reservation still open (see
    /// `forensics`).
    pub async fn drained(&self, activity_id: i64, waiting: i64) -> serde_json::Value {
        let done = |s: &serde_json::Value| {
            s["reservations_open"] == 0 && s["orders"]["WAITING_PAY"] == waiting
        };
        match self.poll_stats(activity_id, SETTLE_SECS, done).await {
            Ok(stats) => stats,
            Err(stats) => {
                let settings = self.settings.clone();
                let report = tokio::task::spawn_blocking(move || {
                    crate::forensics::explain_open_reservations(&settings, activity_id)
                })
                .await
                .unwrap_or_else(|e| format!("forensics failed: {e}"));
                let metrics = self
                    .get("/metrics", None)
                    .await
                    .text()
                    .await
                    .unwrap_or_default();
                let publishing: Vec<&str> = metrics
                    .lines()
                    .filter(|l| {
                        !l.starts_with('#')
                            && (l.contains("admission_total")
                                || l.contains("produce_errors")
                                || l.contains("deliveries_pending")
                                || l.contains("reconcile_total"))
                    })
                    .collect();
                panic!(
                    "orders did not drain in 60s: {stats}\n{report}metrics: {}",
                    publishing.join("; ")
                );
            }
        }
    }

    /// After a drain (`stats`), every one of `n` sold-out orders exists
    /// exactly once with its stock locked: `n` rows, `n` LOCK flows, DB
    /// locked `n`, Redis stock 0.
    pub async fn assert_each_order_once(&self, stats: &serde_json::Value, n: i64) {
        assert_eq!(self.count("SELECT count(*) AS n FROM orders").await, n);
        assert_eq!(
            self.count("SELECT count(*) AS n FROM stock_flow WHERE biz_type = 'LOCK'")
                .await,
            n
        );
        assert_eq!(stats["db_locked"], n);
        assert_eq!(stats["redis_available"], 0);
    }

    /// Waits until consumer group `group` (its suffix, e.g.
    /// `stock-releaser`) has committed every message of `topic` (the
    /// logical name): whatever was published has been applied.
    pub async fn caught_up(&self, group: &str, topic: &str) {
        let kafka = &self.settings.kafka;
        let progress = std::sync::Arc::new(
            seckill::bus::progress::GroupProgress::new(
                kafka,
                &seckill::bus::group_id(kafka, group),
                &format!("{}{topic}", kafka.topic_prefix),
            )
            .expect("progress client"),
        );
        eventually(
            &format!("{group} caught up on {topic}"),
            Duration::from_secs(60),
            || {
                let progress = progress.clone();
                async move { progress.caught_up().await.ok().filter(|done| *done) }
            },
        )
        .await;
        let _ = tokio::task::spawn_blocking(move || drop(progress)).await;
    }

    /// A connection to this test's Redis: the server, or the cluster when
    /// `redis.mode = "cluster"` (`scripts/test.sh` runs a pass on one).
    pub fn redis(&self) -> seckill::store::redis_conn::RedisConn {
        seckill::store::redis_conn::RedisClient::new(&self.settings.redis)
            .and_then(|client| client.connect_lazy())
            .expect("a Redis connection")
    }

    /// Runs one SQL statement on this test's database.
    pub async fn execute(&self, sql: &str) {
        let url = self.settings.postgres.url.expose_secret().to_owned();
        let sql = sql.to_owned();
        tokio::task::spawn_blocking(move || {
            let mut conn = PgConnection::establish(&url).expect("connect");
            diesel::sql_query(sql)
                .execute(&mut conn)
                .expect("statement");
        })
        .await
        .unwrap()
    }

    /// The `seckill` binary with `args`, set to this test's database, Redis
    /// prefix and topic prefix.
    pub fn seckill_command(&self, args: &[&str]) -> std::process::Command {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_seckill"));
        cmd.args(args)
            .env("SECKILL_ENV", "test")
            .env(
                "SECKILL__POSTGRES__URL",
                self.settings.postgres.url.expose_secret(),
            )
            .env(
                "SECKILL__REDIS__KEY_PREFIX",
                &self.settings.redis.key_prefix,
            )
            .env(
                "SECKILL__KAFKA__TOPIC_PREFIX",
                &self.settings.kafka.topic_prefix,
            );
        cmd
    }

    /// Runs the `seckill` binary with `args` against this test's database,
    /// Redis prefix and topic prefix; its output (blocking, short commands).
    pub fn seckill(&self, args: &[&str]) -> std::process::Output {
        self.seckill_command(args)
            .output()
            .expect("the seckill binary runs")
    }

    /// A second `seckill serve --no-consumer` on this test's database and
    /// prefixes, ready: the process (killed when dropped) and its URL.
    pub async fn second_instance(&self) -> (KillOnDrop, String) {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let url = format!("http://127.0.0.1:{port}");
        let process = KillOnDrop(
            self.seckill_command(&["serve", "--no-consumer"])
                .env("SECKILL__APP__PORT", port.to_string())
                .stdout(std::process::Stdio::null())
                .spawn()
                .expect("a second seckill serve starts"),
        );
        eventually(
            "the second instance ready",
            Duration::from_secs(120),
            || {
                let ready = format!("{url}/health/ready");
                async move { (reqwest::get(ready).await.ok()?.status() == 200).then_some(()) }
            },
        )
        .await;
        (process, url)
    }

    /// One SQL count on this test's database.
    pub async fn count(&self, sql: &str) -> i64 {
        crate::db::count(&self.settings.postgres.url, sql).await
    }
}

impl TestApp {
    /// An open, warmed activity whose orders must be paid within `secs`.
    pub async fn live_activity_paying_within(&self, stock: i32, secs: i32) -> i64 {
        let now = chrono::Utc::now();
        let body = serde_json::json!({
            "sku_id": 1001, "name": "Phone", "price_cents": 9900, "stock": stock,
            "start_at": now - chrono::Duration::seconds(60),
            "end_at": now + chrono::Duration::seconds(3600),
            "per_user_limit": 1, "pay_timeout_secs": secs, "buckets": 1,
        });
        let res = self
            .post_json("/api/v1/admin/activities", &body, Some(&self.admin_token()))
            .await;
        assert_eq!(res.status(), 201);
        let id = json(res).await["activity_id"]
            .as_i64()
            .expect("activity_id");
        self.warmup(id).await;
        id
    }

    /// Users `first..first+n` each buy one unit; waits until none is still
    /// PROCESSING. Returns `(user_id, order_no)` pairs.
    pub async fn waiting_orders(&self, activity_id: i64, first: i64, n: i64) -> Vec<(i64, String)> {
        let mut out = Vec::new();
        for user in first..first + n {
            let (status, body) = self.buy(user, activity_id).await;
            assert_eq!(status, 202, "{body}");
            out.push((user, body["order_no"].as_str().unwrap().to_owned()));
        }
        // Created, whatever came next: with a pay window of seconds, on a
        // slow host the first orders may close before the last are created.
        self.wait_for_stats(activity_id, |s| {
            let created: i64 = ["WAITING_PAY", "PAID", "CLOSED", "CANCELLED"]
                .iter()
                .filter_map(|k| s["orders"][k].as_i64())
                .sum();
            s["reservations_open"] == 0 && created >= n
        })
        .await;
        out
    }

    /// `POST /orders/{no}/pay` as `user_id`.
    pub async fn pay(&self, user_id: i64, order_no: &str) -> reqwest::Response {
        let path = format!("/api/v1/orders/{order_no}/pay");
        self.post_json(
            &path,
            &serde_json::json!({}),
            Some(&self.user_token(user_id)),
        )
        .await
    }

    /// The pending payment of `order_no`, asserting 200.
    pub async fn payment(&self, user_id: i64, order_no: &str) -> serde_json::Value {
        let res = self.pay(user_id, order_no).await;
        assert_eq!(res.status(), 200, "pay {order_no}");
        json(res).await
    }

    /// The order as `GET /orders/{no}` shows it once its payment is
    /// `status` (a minute and a half at most).
    pub async fn order_once_payment_is(
        &self,
        user_id: i64,
        order_no: &str,
        status: &str,
    ) -> serde_json::Value {
        let what = format!("the payment of {order_no} {status}");
        eventually(&what, std::time::Duration::from_secs(90), || async {
            let path = format!("/api/v1/orders/{order_no}");
            let res = self.get(&path, Some(&self.user_token(user_id))).await;
            let shown = json(res).await;
            (shown["payment"]["status"] == status).then_some(shown)
        })
        .await
    }

    /// Payment callbacks counted with `outcome` (applied, duplicate,
    /// bad_signature, refund_settled, …).
    pub async fn callbacks(&self, outcome: &str) -> i64 {
        self.metric(&format!(
            "seckill_payment_callbacks_total{{outcome=\"{outcome}\"}}"
        ))
        .await
        .unwrap_or(0)
    }

    /// `POST /orders/{no}/cancel` as `user_id`.
    pub async fn cancel(&self, user_id: i64, order_no: &str) -> reqwest::Response {
        let path = format!("/api/v1/orders/{order_no}/cancel");
        self.post_json(
            &path,
            &serde_json::json!({}),
            Some(&self.user_token(user_id)),
        )
        .await
    }

    /// The order's status as its owner sees it.
    pub async fn order_status(&self, user_id: i64, order_no: &str) -> String {
        let res = self
            .get(
                &format!("/api/v1/orders/{order_no}"),
                Some(&self.user_token(user_id)),
            )
            .await;
        json(res).await["status"].as_str().unwrap_or("?").to_owned()
    }

    /// A callback body for `payment` (the JSON of `pay`), signed `t_offset`
    /// seconds from now with `secret` (the app's own when `None`).
    pub fn signed_callback(
        &self,
        payment: &serde_json::Value,
        status: &str,
        amount_cents: i64,
        secret: Option<&str>,
        t_offset: i64,
    ) -> (Vec<u8>, String) {
        let body = serde_json::to_vec(&serde_json::json!({
            "payment_no": payment["payment_no"], "order_no": payment["order_no"],
            "amount_cents": amount_cents, "status": status,
            "provider_txn_id": format!("txn-{}", payment["payment_no"].as_str().unwrap()),
            "paid_at": chrono::Utc::now(),
        }))
        .unwrap();
        let own = self
            .settings
            .payment
            .notify_secret
            .expose_secret()
            .to_owned();
        let secret = secret.unwrap_or(&own);
        // Signed on the sale clock, which the server checks it against.
        let t = self.clock.now().timestamp() + t_offset;
        let header = seckill::payments::signature::sign(secret.as_bytes(), t, &body);
        (body, header)
    }

    /// `POST /payments/notify` with a raw body and an optional signature.
    pub async fn notify(&self, body: Vec<u8>, signature: Option<&str>) -> reqwest::Response {
        let mut req = self
            .client
            .post(format!("{}/api/v1/payments/notify", self.address))
            .header("content-type", "application/json")
            .body(body);
        if let Some(sig) = signature {
            req = req.header("X-Pay-Signature", sig);
        }
        req.send().await.expect("request sent")
    }
}

/// Short Kafka timeouts and a fast reconciler, so the wait for events sent
/// before Redis lost an activity, and its restore, take seconds.
/// Buyers' order reads and the public activity view from the streaming
/// replica `scripts/services.sh up --pg-replica` runs (3 s behind), for
/// this test's database.
pub fn reads_from_the_replica(s: &mut Settings) {
    let configured = std::env::var("SECKILL__POSTGRES__REPLICA_URL")
        .ok()
        .filter(|u| !u.trim().is_empty());
    s.postgres.replica_url = SecretString::from(crate::db::replica_url(
        s.postgres.url.expose_secret(),
        configured.as_deref(),
    ));
}

pub fn restores_quickly(s: &mut Settings) {
    s.kafka.message_timeout_ms = std::time::Duration::from_millis(1000);
    s.admission.publish_budget_ms = std::time::Duration::from_millis(1000);
    s.reconcile.publish_window_secs = std::time::Duration::from_secs(3);
    s.reconcile.interval_secs = std::time::Duration::from_secs(1);
}

impl TestApp {
    /// Users `users` each buy one unit with request_id `r<user>` (asserting
    /// 202 in the end); their order numbers, in order.
    pub async fn buy_as_r_user(
        &self,
        activity_id: i64,
        users: std::ops::RangeInclusive<i64>,
    ) -> Vec<String> {
        let mut order_nos = Vec::new();
        for user in users {
            let (status, body) = self.order_as_r_user(activity_id, user).await;
            assert_eq!(status, 202, "{body}");
            order_nos.push(body["order_no"].as_str().unwrap().to_owned());
        }
        order_nos
    }

    /// One purchase by `user` with request_id `r<user>` and a fresh token,
    /// retried as the API says (`order_retrying`): a first purchase, or
    /// the replay of one `buy_as_r_user` made.
    ///
    /// A 503 that kept nothing (no `order_no`: say, the broker refused the
    /// event on a starved host) is retried too, for up to a minute, with a
    /// new token: the refused attempt used its token up.
    pub async fn order_as_r_user(&self, activity_id: i64, user: i64) -> (u16, serde_json::Value) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let token = self.purchase_token(user, activity_id).await;
            let body = serde_json::json!({"request_id": format!("r{user}"), "token": token});
            let (status, answer) = self.order_retrying(user, activity_id, &body).await;
            let nothing_kept = status == 503 && answer["order_no"].is_null();
            if nothing_kept && std::time::Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                continue;
            }
            return (status, answer);
        }
    }

    /// The replay of `order_as_r_user`'s purchase (request_id `r<user>`),
    /// each attempt with a fresh token, a 503 retried for up to a minute:
    /// the status the replay itself was answered with (a replay after a
    /// 503 is still a replay: 200, never reported as 202).
    pub async fn replay_as_r_user(&self, activity_id: i64, user: i64) -> (u16, serde_json::Value) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let (status, answer) = self.attempt(user, activity_id, &format!("r{user}")).await;
            if status != 503 || std::time::Instant::now() >= deadline {
                return (status, answer);
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    }

    /// Takes the reconcile lease as "another" instance, so that the server's
    /// periodic run (every second under `restores_quickly`) neither repairs
    /// nor restores until `end_lease("reconcile", "another")`.
    pub async fn hold_the_reconcile_lease(&self) -> seckill::store::notes::Notes {
        let notes = seckill::store::notes::Notes::new(&self.settings.redis).unwrap();
        // The server's own periodic run may hold it a moment.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !notes
            .try_lease("reconcile", "another", 60_000)
            .await
            .unwrap()
        {
            assert!(std::time::Instant::now() < deadline, "lease never free");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        notes
    }

    /// Deletes every Redis key of an activity, as a Redis restarted empty
    /// would: its base keys and, sharded, every shard's.
    pub async fn forget_in_redis(&self, activity_id: i64) {
        let prefix = &self.settings.redis.key_prefix;
        for pattern in [
            format!("{prefix}{{a:{activity_id}}}:*"),
            format!("{prefix}{{a:{activity_id}:*"),
        ] {
            self.forget_keys(&pattern).await;
        }
    }

    /// Deletes every key of this test's Redis matching `pattern` (KEYS
    /// syntax); how many there were.
    pub async fn forget_keys(&self, pattern: &str) -> usize {
        let mut conn = self.redis();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(pattern)
            .query_async(&mut conn)
            .await
            .unwrap();
        // One at a time: on a cluster the keys sit in several slots.
        for key in &keys {
            let _: () = redis::cmd("DEL")
                .arg(key)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
        keys.len()
    }
}

impl TestApp {
    /// A gauge or counter of `/metrics`, by its full name (labels
    /// included, as exported: `seckill_x_total{kind="y"}`).
    pub async fn metric(&self, name: &str) -> Option<i64> {
        let text = self.get("/metrics", None).await.text().await.unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map(|v| v as i64)
    }
}
