//! The fault-test harness: the services of `scripts/chaos.sh`, a real
//! `seckill serve` process, a crowd of buyers that retry like real clients,
//! and the invariant check that follows every fault.

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use seckill::auth::{JwtKeys, Role};
use seckill::config::Settings;
use secrecy::ExposeSecret;
use serde_json::{Value, json};

/// How long buyers keep retrying, and how long the system may take to
/// settle after the fault: sized for a loaded 2-core machine three times
/// slower than the one the tests were written on.
const BUYER_PATIENCE: Duration = Duration::from_secs(300);
const SETTLE_WITHIN: Duration = Duration::from_secs(300);

/// Buyers start at this rate, so the fault lands in the middle of the
/// burst and the burst goes on through it.
const BUYERS_PER_SEC: f64 = 150.0;

/// Runs `f` when dropped (a stopped broker is resumed even if the test
/// panics).
/// Where the servers under test write their logs: `SECKILL_CHAOS_LOGS`
/// (scripts/test.sh gives the cluster's pass a folder of its own, as it
/// runs beside the other), or `target/chaos`.
pub fn log_dir() -> PathBuf {
    std::env::var_os("SECKILL_CHAOS_LOGS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/chaos"))
}

/// `line` without its ANSI colour sequences.
fn strip_colours(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

pub struct OnDrop<F: FnMut()>(pub F);

impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)();
    }
}

/// The `seckill` binary under test: the copy `scripts/chaos.sh` made
/// (`SECKILL_CHAOS_BIN`), so a build while the fault tests run does not
/// swap the binary a restart starts; else cargo's.
fn seckill_bin() -> PathBuf {
    std::env::var_os("SECKILL_CHAOS_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_seckill")))
}

/// The value a server start numbered `generation` (from 1) takes: a
/// `SECKILL__PAYMENT__PROVIDER` with commas names the providers starts
/// take in turn (a restart switches provider); any other value as it is.
fn rotated<'a>(key: &str, value: &'a str, generation: usize) -> &'a str {
    if key != "SECKILL__PAYMENT__PROVIDER" {
        return value;
    }
    let turns: Vec<&str> = value.split(',').collect();
    turns[(generation.max(1) - 1) % turns.len()]
}

/// Sends `sig` to every process of group `pgid` (a node's keeper and
/// its PostgreSQL).
pub fn signal_group(pgid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([format!("-{sig}"), "--".to_owned(), format!("-{pgid}")])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill -{sig} -- -{pgid}");
}

/// Sends `sig` (STOP, CONT, KILL) to `pid`.
pub fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill -{sig} {pid}");
}

/// The services `scripts/chaos.sh` started.
pub struct Services {
    root: PathBuf,
    state: PathBuf,
    /// The Redis servers: one, or the cluster's masters (`scripts/chaos.sh
    /// --redis-cluster`).
    redis_ports: Vec<u16>,
    /// Redis is a cluster.
    pub cluster: bool,
    /// The brokers' addresses: one, or the three of the replicated
    /// cluster (`scripts/chaos.sh --replicated`).
    brokers: String,
    /// PostgreSQL's ports: one, or the highly available pair's.
    pg_ports: Vec<u16>,
}

impl Services {
    fn from_env(settings: &Settings) -> Self {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let state = std::env::var_os("SECKILL_SERVICES_DIR")
            .map(PathBuf::from)
            .expect("SECKILL_SERVICES_DIR (set by scripts/chaos.sh)");
        let redis_ports = settings
            .redis
            .url
            .split(',')
            .map(|u| {
                u.trim()
                    .rsplit(':')
                    .next()
                    .and_then(|p| p.trim_end_matches('/').parse().ok())
                    .expect("redis.url names its ports")
            })
            .collect();
        let cluster = settings.redis.mode == seckill::config::RedisMode::Cluster;
        let url = settings.postgres.url.expose_secret();
        let hosts = url
            .split_once('@')
            .and_then(|(_, rest)| rest.split_once('/'))
            .map_or("", |(hosts, _)| hosts);
        let pg_ports = hosts
            .split(',')
            .filter_map(|h| h.rsplit_once(':')?.1.parse().ok())
            .collect();
        Self {
            root,
            state,
            redis_ports,
            cluster,
            brokers: settings.kafka.brokers.clone(),
            pg_ports,
        }
    }

    /// Whether these are the replicated services: three brokers and a
    /// PostgreSQL pair that fails over (`scripts/chaos.sh --replicated`).
    pub fn replicated(&self) -> bool {
        self.brokers.split(',').count() == 3 && self.pg_ports.len() == 2
    }

    /// `scripts/services.sh pid WHAT N`.
    async fn pid_of(&self, what: &str, n: usize) -> u32 {
        let script = self.root.join("scripts/services.sh");
        let (what, n) = (what.to_owned(), n.to_string());
        let out = tokio::task::spawn_blocking(move || {
            Command::new(script).args(["pid", &what, &n]).output()
        })
        .await
        .unwrap()
        .expect("services.sh runs");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("no pid: {}", String::from_utf8_lossy(&out.stderr)))
    }

    /// The process id of broker `n` (1..=3) of the replicated cluster.
    pub async fn broker_pid(&self, n: usize) -> u32 {
        self.pid_of("kafka-broker", n).await
    }

    /// Starts broker `n` again (with its data) and waits until it serves.
    pub async fn start_broker(&self, n: usize) {
        self.script(&["start", "kafka-broker", &n.to_string()])
            .await;
    }

    /// The broker (1..=3) that leads partition `partition` of `topic`, as
    /// a fresh client sees it; `None` while it has no leader.
    pub async fn leader_of(&self, topic: &str, partition: i32) -> Option<usize> {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let (brokers, topic) = (self.brokers.clone(), topic.to_owned());
        tokio::task::spawn_blocking(move || {
            let client: BaseConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .set("log_level", "2")
                .create()
                .ok()?;
            let metadata = client
                .fetch_metadata(Some(&topic), Duration::from_secs(10))
                .ok()?;
            let leader = metadata
                .topics()
                .first()?
                .partitions()
                .iter()
                .find(|p| p.id() == partition)?
                .leader();
            usize::try_from(leader).ok().filter(|n| (1..=3).contains(n))
        })
        .await
        .ok()
        .flatten()
    }

    /// The process group of PostgreSQL node `n` (1 or 2): its keeper and
    /// its PostgreSQL; SIGKILL to it is the node dying.
    pub async fn pg_node_group(&self, n: usize) -> u32 {
        self.pid_of("pg-node", n).await
    }

    /// Starts PostgreSQL node `n` again; it rejoins the pair (a demoted
    /// primary comes back as the standby).
    pub async fn start_pg_node(&self, n: usize) {
        self.script(&["start", "pg-node", &n.to_string()]).await;
    }

    /// Node `n`'s port.
    pub fn pg_port(&self, n: usize) -> u16 {
        self.pg_ports[n - 1]
    }

    /// Node `n`'s data directory.
    pub fn pg_data(&self, n: usize) -> PathBuf {
        self.state.join(format!("pg-ha/node{n}/data"))
    }

    /// Node `n`'s keeper log (pg_auto_failover's `pg_autoctl run`).
    pub fn pg_keeper_log(&self, n: usize) -> PathBuf {
        self.state.join(format!("pg-ha/node{n}/keeper.log"))
    }

    /// The node (1 or 2) that takes writes now, if one does.
    pub async fn pg_primary(&self) -> Option<usize> {
        for (i, port) in self.pg_ports.iter().enumerate() {
            let url = format!("postgres://postgres@127.0.0.1:{port}/postgres?connect_timeout=3");
            let primary = tokio::task::spawn_blocking(move || {
                use diesel::{Connection, RunQueryDsl};
                #[derive(diesel::QueryableByName)]
                struct R {
                    #[diesel(sql_type = diesel::sql_types::Bool)]
                    standby: bool,
                }
                let mut conn = diesel::PgConnection::establish(&url).ok()?;
                let r: R = diesel::sql_query("SELECT pg_is_in_recovery() AS standby")
                    .get_result(&mut conn)
                    .ok()?;
                Some(!r.standby)
            })
            .await
            .ok()
            .flatten();
            if primary == Some(true) {
                return Some(i + 1);
            }
        }
        None
    }

    /// How many Redis servers there are (the cluster's masters).
    pub fn redis_nodes(&self) -> usize {
        self.redis_ports.len()
    }

    /// The process id of Redis server `node` (0 for the single server).
    pub fn redis_pid(&self, node: usize) -> u32 {
        if !self.cluster {
            return self.pid("redis");
        }
        let file = self
            .state
            .join("redis-cluster")
            .join(self.redis_ports[node].to_string())
            .join("redis.pid");
        std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
            .trim()
            .parse()
            .expect("a pid")
    }

    /// Every Redis server's process id.
    pub fn redis_pids(&self) -> Vec<u32> {
        (0..self.redis_nodes()).map(|n| self.redis_pid(n)).collect()
    }

    /// `scripts/services.sh start redis` (or `redis-cluster`): starts the
    /// Redis servers that are not running (empty), and nothing else.
    pub async fn start_redis(&self) {
        let name = if self.cluster {
            "redis-cluster"
        } else {
            "redis"
        };
        self.script(&["start", name]).await;
    }

    /// `scripts/services.sh start NAME` (postgres, kafka): that one alone.
    pub async fn start(&self, name: &str) {
        self.script(&["start", name]).await;
    }

    /// The process id of `name` (kafka or redis), from its pid file.
    pub fn pid(&self, name: &str) -> u32 {
        let file = self.state.join(name).join(format!("{name}.pid"));
        std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
            .trim()
            .parse()
            .expect("a pid")
    }

    /// `scripts/services.sh up`: starts whatever is not running, waits
    /// until each answers.
    pub async fn up(&self) {
        self.script(&["up"]).await;
    }

    /// `scripts/services.sh stop NAME`.
    pub async fn stop(&self, name: &str) {
        self.script(&["stop", name]).await;
    }

    async fn script(&self, args: &[&str]) {
        let script = self.root.join("scripts/services.sh");
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        let status = tokio::task::spawn_blocking(move || {
            Command::new(script)
                .args(&args)
                .stdout(Stdio::null())
                .status()
        })
        .await
        .unwrap()
        .expect("services.sh runs");
        assert!(status.success(), "services.sh failed");
    }

    /// FLUSHALL on every chaos Redis server (each master of a cluster).
    pub async fn flush_redis(&self) {
        for node in 0..self.redis_nodes() {
            self.flush_redis_node(node).await;
        }
    }

    /// FLUSHALL on Redis server `node` alone: a cluster loses the keys of
    /// that master's slots.
    pub async fn flush_redis_node(&self, node: usize) {
        let url = format!("redis://127.0.0.1:{}", self.redis_ports[node]);
        let client = redis::Client::open(url.as_str()).unwrap();
        // Not the client's defaults (1 s to connect, 0.5 s to answer): a
        // fresh-clone run's host was busy enough that a FLUSHALL amid a
        // burst took longer, and the fault, not the sale, failed the test.
        let patient = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(std::time::Duration::from_secs(30)))
            .set_response_timeout(Some(std::time::Duration::from_secs(60)));
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&patient)
            .await
            .unwrap_or_else(|e| panic!("connecting to Redis node {node} to flush it: {e}"));
        let _: () = redis::cmd("FLUSHALL")
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("FLUSHALL on Redis node {node}: {e}"));
    }
}

/// One fault test's world: its own database, key and topic prefixes, and
/// a `seckill serve` process on a port of its own.
pub struct Chaos {
    /// The services under fault.
    pub services: Services,
    name: String,
    settings: Settings,
    env: Vec<(&'static str, String)>,
    port: u16,
    server: Mutex<Option<Child>>,
    generation: Mutex<u32>,
    keys: JwtKeys,
    client: reqwest::Client,
    db_name: String,
    /// A shared hold on `SECKILL_ALONE_LOCK` for the test's whole life
    /// ([`hold_while_nothing_runs_alone`]); released last, once the server
    /// is gone.
    _alone: Option<std::fs::File>,
}

/// `scripts/test.sh` runs the 20,000-buyer test of the other lane alone:
/// it holds `SECKILL_ALONE_LOCK` exclusively while it runs, and each fault
/// test holds it shared, so neither starts while the other runs. Beside
/// it, a fault test's server, its broker and its buyers were starved (a
/// consumer's session timed out after 10 s without an answer, buyers
/// heard nothing for 9 s with the server idle) and the fallback of the
/// Redis-killed test sold nothing.
fn hold_while_nothing_runs_alone() -> Option<std::fs::File> {
    let path = std::env::var_os("SECKILL_ALONE_LOCK")?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .expect("the lock file opens");
    let asked = Instant::now();
    file.lock_shared().expect("the shared lock");
    if asked.elapsed() > Duration::from_secs(1) {
        eprintln!(
            "waited {:.0}s for a test that runs alone",
            asked.elapsed().as_secs_f64()
        );
    }
    Some(file)
}

impl Chaos {
    /// A fresh world with the server running.
    pub async fn start(name: &str) -> Self {
        Self::start_with(name, |_| {}).await
    }

    /// Like [`Chaos::start`], with extra server environment.
    pub async fn start_with(
        name: &str,
        extra: impl FnOnce(&mut Vec<(&'static str, String)>),
    ) -> Self {
        assert_eq!(
            std::env::var("SECKILL_CHAOS").as_deref(),
            Ok("1"),
            "fault tests stop and kill services: run them with scripts/chaos.sh"
        );
        let alone = tokio::task::spawn_blocking(hold_while_nothing_runs_alone)
            .await
            .expect("the lock task");
        let mut settings = Settings::load_env("test").expect("test settings load");
        let services = Services::from_env(&settings);
        services.up().await;
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let db_name = format!("seckill_chaos_{id}");
        settings.postgres.url = crate::db::create_database(&settings.postgres.url, &db_name).await;
        settings.redis.key_prefix = format!("c{id}:");
        settings.kafka.topic_prefix = format!("c{id}.");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut env = vec![
            ("SECKILL_ENV", "test".to_owned()),
            ("SECKILL__APP__PORT", port.to_string()),
            (
                "SECKILL__POSTGRES__URL",
                settings.postgres.url.expose_secret().to_owned(),
            ),
            (
                "SECKILL__REDIS__KEY_PREFIX",
                settings.redis.key_prefix.clone(),
            ),
            (
                "SECKILL__KAFKA__TOPIC_PREFIX",
                settings.kafka.topic_prefix.clone(),
            ),
            // Every delivery report with its partition and offset: an
            // acknowledged event later missing from the topic can be
            // looked up where the broker said it put it.
            (
                "SECKILL__LOG__LEVEL",
                "info,seckill::bus::delivery=debug".to_owned(),
            ),
            // Short enough that what a fault leaves over is decided within
            // the test: librdkafka retries a message 5 s, a purchase waits
            // 3 s for its report, reservations are voided (and a lost Redis
            // restored) 13 s after their last send, reconciliation runs
            // every 2 s, a consumer stalled for 10 s is rebuilt.
            ("SECKILL__KAFKA__MESSAGE_TIMEOUT_MS", "5000".to_owned()),
            ("SECKILL__ADMISSION__PUBLISH_BUDGET_MS", "3000".to_owned()),
            ("SECKILL__RECONCILE__PUBLISH_WINDOW_SECS", "13".to_owned()),
            ("SECKILL__RECONCILE__INTERVAL_SECS", "2".to_owned()),
            ("SECKILL__KAFKA__CONSUMER_STALL_SECS", "10".to_owned()),
        ];
        extra(&mut env);
        let chaos = Self {
            services,
            name: name.to_owned(),
            keys: JwtKeys::new(&settings.auth.jwt_secret).expect("jwt keys"),
            settings,
            env,
            port,
            server: Mutex::new(None),
            generation: Mutex::new(0),
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(20))
                .build()
                .unwrap(),
            db_name,
            _alone: alone,
        };
        chaos.restart_server().await;
        chaos
    }

    /// This test's topic prefix.
    pub(crate) fn topic_prefix(&self) -> &str {
        &self.settings.kafka.topic_prefix
    }

    /// An order of `user` in `activity`, accepted and written, with its
    /// payment created: the payment as `POST .../pay` answered it.
    pub(crate) async fn paid_order_intent(&self, activity: i64, user: i64) -> Value {
        let sale = Sale::of(self, activity, 1, 0);
        let bought = sale.buyer(user).await;
        let order_no = bought.order_no.expect("the order accepted");
        let jwt = self.user(user);
        let deadline = Instant::now() + SETTLE_WITHIN;
        loop {
            let res = self
                .client
                .post(self.url(&format!("/api/v1/orders/{order_no}/pay")))
                .bearer_auth(&jwt)
                .send()
                .await;
            if let Ok(res) = res
                && res.status() == 200
            {
                return res.json().await.expect("a payment");
            }
            assert!(Instant::now() < deadline, "order {order_no} never payable");
            pause().await;
        }
    }

    /// One signed SUCCESS callback for `payment`, as the provider sends
    /// it: its status (0 when no answer came).
    pub(crate) async fn notify_success(&self, payment: &Value) -> u16 {
        let body = serde_json::to_vec(&json!({
            "payment_no": payment["payment_no"], "order_no": payment["order_no"],
            "amount_cents": payment["amount_cents"], "status": "SUCCESS",
            "provider_txn_id": format!("txn-{}", payment["payment_no"].as_str().unwrap_or("")),
            "paid_at": chrono::Utc::now(),
        }))
        .expect("json");
        let t = chrono::Utc::now().timestamp();
        let signature =
            seckill::payments::signature::sign(self.notify_secret().as_bytes(), t, &body);
        match self
            .client
            .post(self.url("/api/v1/payments/notify"))
            .header("content-type", "application/json")
            .header("X-Pay-Signature", signature)
            .body(body)
            .send()
            .await
        {
            Ok(res) => res.status().as_u16(),
            Err(_) => 0,
        }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// The HTTP client of the test (20 s per request).
    pub(crate) fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// The payment provider's secret: callbacks are signed with it.
    pub(crate) fn notify_secret(&self) -> &str {
        self.settings.payment.notify_secret.expose_secret()
    }

    /// Where this world's server logs are, for a failure's message.
    pub(crate) fn logs(&self) -> String {
        format!("{}/{}.*.log", log_dir().display(), self.name)
    }

    /// The lines of this world's server logs (every launch so far) that
    /// contain `needle`, colours stripped.
    pub(crate) fn log_lines(&self, needle: &str) -> Vec<String> {
        let launches = *self.generation.lock().unwrap();
        let mut found = Vec::new();
        for n in 1..=launches {
            let path = log_dir().join(format!("{}.{n}.log", self.name));
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            for line in text.lines() {
                let plain = strip_colours(line);
                if plain.contains(needle) {
                    found.push(format!("{}.{n}.log: {plain}", self.name));
                }
            }
        }
        found
    }

    /// Starts the server (again) and waits until it is ready.
    pub async fn restart_server(&self) {
        let log = self.launch_server();
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(res) = self.client.get(self.url("/health/ready")).send().await
                && res.status() == 200
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "server never ready; see {}",
                log.display()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Starts the server (again) without waiting for it: its log file.
    pub fn launch_server(&self) -> PathBuf {
        let log = {
            let mut generation = self.generation.lock().unwrap();
            *generation += 1;
            let dir = log_dir();
            std::fs::create_dir_all(&dir).unwrap();
            dir.join(format!("{}.{}.log", self.name, *generation))
        };
        let file = std::fs::File::create(&log).unwrap();
        let generation = *self.generation.lock().unwrap() as usize;
        let child = Command::new(seckill_bin())
            .arg("serve")
            .envs(
                self.env
                    .iter()
                    .map(|(k, v)| (*k, rotated(k, v, generation))),
            )
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .expect("seckill serve starts");
        *self.server.lock().unwrap() = Some(child);
        log
    }

    /// `POST /api/v1/admin/payments/statement` for `date` (YYYY-MM-DD),
    /// asked until answered: the report.
    pub async fn statement(&self, date: &str) -> Value {
        loop {
            let res = self
                .client
                .post(self.url("/api/v1/admin/payments/statement"))
                .bearer_auth(self.admin())
                .json(&json!({"date": date}))
                .send()
                .await;
            if let Ok(res) = res
                && res.status() == 200
            {
                return res.json().await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// How many lines of the server's logs (every start of it) contain
    /// `needle`: proof that a fault hit what it was aimed at.
    pub fn log_lines_with(&self, needle: &str) -> usize {
        let generations = *self.generation.lock().unwrap();
        let dir = log_dir();
        (1..=generations)
            .filter_map(|g| {
                std::fs::read_to_string(dir.join(format!("{}.{g}.log", self.name))).ok()
            })
            .map(|log| log.lines().filter(|l| l.contains(needle)).count())
            .sum()
    }

    /// The server's base URL.
    pub fn base_url(&self) -> String {
        self.url("")
    }

    /// `seckill ARGS` as another process of this world (its environment,
    /// with `env` on top), logging to `target/chaos/<name>.<label>.log`;
    /// killed when the returned guard drops.
    pub fn spawn(&self, label: &str, args: &[&str], env: &[(&str, String)]) -> Process {
        let dir = log_dir();
        std::fs::create_dir_all(&dir).unwrap();
        let file = std::fs::File::create(dir.join(format!("{}.{label}.log", self.name))).unwrap();
        let child = Command::new(seckill_bin())
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (*k, v.as_str())))
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .expect("seckill starts");
        Process(child)
    }

    /// Another `seckill serve` of this world on a port of its own, once it
    /// is ready: (guard, base URL).
    pub async fn spawn_server(&self, label: &str, args: &[&str]) -> (Process, String) {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let process = self.spawn(
            label,
            &[&["serve"], args].concat(),
            &[("SECKILL__APP__PORT", port.to_string())],
        );
        let base = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(res) = self.client.get(format!("{base}/health/ready")).send().await
                && res.status() == 200
            {
                return (process, base);
            }
            assert!(Instant::now() < deadline, "{label} never ready");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// `seckill ARGS` in this world's environment, to its end: its output
    /// (stderr goes to `target/chaos/<name>.<label>.log`).
    pub async fn run(&self, label: &str, args: &[&str]) -> std::process::Output {
        let dir = log_dir();
        std::fs::create_dir_all(&dir).unwrap();
        let file = std::fs::File::create(dir.join(format!("{}.{label}.log", self.name))).unwrap();
        let mut cmd = Command::new(seckill_bin());
        cmd.args(args)
            .envs(self.env.iter().map(|(k, v)| (*k, v.as_str())))
            .stderr(file);
        tokio::task::spawn_blocking(move || cmd.output().expect("seckill runs"))
            .await
            .unwrap()
    }

    /// Whether the server process has ended by itself (its exit status).
    pub fn server_exited(&self) -> Option<std::process::ExitStatus> {
        let mut server = self.server.lock().unwrap();
        let status = server.as_mut()?.try_wait().expect("try_wait")?;
        server.take();
        Some(status)
    }

    /// What a supervisor does: a server that ended by itself is started
    /// again. True if it had to be.
    pub async fn restart_if_exited(&self) -> bool {
        let Some(status) = self.server_exited() else {
            return false;
        };
        eprintln!("{}: the server exited ({status}); restarting it", self.name);
        self.restart_server().await;
        true
    }

    /// SIGTERM to the server, then waits for it to end, at most `within`:
    /// how long it took, or `None` if it was still running then (it is
    /// killed, so the test goes on).
    pub async fn terminate_server(
        &self,
        within: Duration,
    ) -> Option<(Duration, std::process::ExitStatus)> {
        let pid = self.server.lock().unwrap().as_ref().expect("a server").id();
        let sent = Instant::now();
        signal(pid, "TERM");
        loop {
            if let Some(status) = self.server_exited() {
                return Some((sent.elapsed(), status));
            }
            if sent.elapsed() > within {
                self.kill_server();
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether `/health/ready` answers 200 now.
    pub async fn ready(&self) -> bool {
        matches!(
            self.client.get(self.url("/health/ready")).send().await,
            Ok(res) if res.status() == 200
        )
    }

    /// One purchase by `user` with a request id of its own, not retried:
    /// the purchase's status (0 when no answer came).
    pub async fn purchase_once(&self, activity: i64, user: i64) -> u16 {
        let jwt = self.user(user);
        let token = match self
            .client
            .get(self.url(&format!("/api/v1/activities/{activity}/token")))
            .bearer_auth(&jwt)
            .send()
            .await
        {
            Ok(res) if res.status() == 200 => match res.json::<Value>().await {
                Ok(body) => body["token"].as_str().unwrap_or_default().to_owned(),
                Err(_) => return 0,
            },
            Ok(res) => return res.status().as_u16(),
            Err(_) => return 0,
        };
        let request_id = format!(
            "p{user}-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        match self
            .client
            .post(self.url(&format!("/api/v1/activities/{activity}/orders")))
            .bearer_auth(&jwt)
            .json(&json!({"request_id": request_id, "token": token}))
            .send()
            .await
        {
            Ok(res) => res.status().as_u16(),
            Err(_) => 0,
        }
    }

    /// SIGKILL to the server: no shutdown path runs.
    pub fn kill_server(&self) {
        if let Some(mut child) = self.server.lock().unwrap().take() {
            child.kill().expect("SIGKILL");
            child.wait().expect("reaped");
        }
    }

    pub(crate) fn admin(&self) -> String {
        self.keys.mint(1, Role::Admin, 3600).unwrap()
    }

    pub(crate) fn user(&self, id: i64) -> String {
        self.keys.mint(id, Role::User, 3600).unwrap()
    }

    pub(crate) async fn stats(&self, activity: i64) -> Option<Value> {
        self.admin_get(&format!("/api/v1/admin/activities/{activity}/stats"))
            .await
    }

    /// An admin GET's body, if answered 200.
    async fn admin_get(&self, path: &str) -> Option<Value> {
        let res = self
            .client
            .get(self.url(path))
            .bearer_auth(self.admin())
            .send()
            .await
            .ok()?;
        if res.status() != 200 {
            return None;
        }
        res.json().await.ok()
    }

    /// A coupon batch of `total`, valid for two hours: its id.
    pub async fn create_coupons(&self, total: i32) -> i64 {
        let res = self
            .client
            .post(self.url("/api/v1/admin/coupons"))
            .bearer_auth(self.admin())
            .json(&json!({
                "name": "chaos", "total": total, "discount_cents": 100,
                "min_amount_cents": 0, "per_user_limit": 1,
                "valid_until": chrono::Utc::now() + chrono::Duration::hours(2),
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201);
        res.json::<Value>().await.unwrap()["coupon_id"]
            .as_i64()
            .unwrap()
    }

    /// The batch's figures (`GET /admin/coupons/{id}/stats`), if answered.
    pub async fn coupon_stats(&self, coupon: i64) -> Option<Value> {
        self.admin_get(&format!("/api/v1/admin/coupons/{coupon}/stats"))
            .await
    }

    /// One claim of `coupon` by `user` under `request_id`, not retried:
    /// its status (0 when no answer came).
    pub async fn claim_once(&self, coupon: i64, user: i64, request_id: &str) -> u16 {
        match self
            .client
            .post(self.url(&format!("/api/v1/coupons/{coupon}/claim")))
            .bearer_auth(self.user(user))
            .json(&json!({"request_id": request_id}))
            .send()
            .await
        {
            Ok(res) => res.status().as_u16(),
            Err(_) => 0,
        }
    }

    /// Waits until the sale has settled after the fault (nothing open or
    /// processing, Redis = database), then checks the invariants.
    pub async fn settle_and_check(&self, sale: &Sale<'_>, outcome: &Outcome) {
        let accepted: Vec<&Bought> = outcome.bought.iter().filter(|b| b.accepted).collect();
        eprintln!("{}: {}", self.name, outcome.summary());
        assert!(
            !accepted.is_empty(),
            "nothing was accepted: {}",
            outcome.summary()
        );
        let orders: Vec<String> = accepted.iter().filter_map(|b| b.order_no.clone()).collect();
        let distinct: HashSet<&String> = orders.iter().collect();
        assert_eq!(
            orders.len(),
            accepted.len(),
            "every acceptance names its order"
        );
        assert_eq!(distinct.len(), orders.len(), "no order_no accepted twice");

        let started = Instant::now();
        let stats = loop {
            let stats = self.stats(sale.activity).await;
            let waiting = self.count_waiting(&orders).await;
            if let Some(s) = &stats
                && s["reservations_open"] == 0
                && s["orders"]["PROCESSING"] == 0
                && s["redis_available"] == s["db_available"]
                && waiting == orders.len() as i64
            {
                break s.clone();
            }
            if started.elapsed() > SETTLE_WITHIN {
                let lost = self.not_waiting(&orders).await;
                panic!(
                    "{}: not settled in {}s: {stats:?}; accepted but not WAITING_PAY: {lost:?}; server logs: {}",
                    self.name,
                    SETTLE_WITHIN.as_secs(),
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        eprintln!(
            "{}: settled {:.1}s after the burst: {stats}",
            self.name,
            started.elapsed().as_secs_f64()
        );

        // I4: every accepted purchase is an order waiting for payment,
        // under the buyer's own request_id.
        assert_eq!(self.not_waiting(&orders).await, Vec::<String>::new());
        // One query, not one per buyer: each query here opens a connection
        // of its own, and thousands of them took half a minute on a loaded
        // host. `order_no` is the key, so a row is the one order.
        let rows = self
            .strings(&format!(
                "SELECT order_no::text || ' ' || user_id || ' ' || request_id AS s FROM orders \
                 WHERE activity_id = {}",
                sale.activity
            ))
            .await;
        for b in &accepted {
            let row = format!(
                "{} {} {}",
                b.order_no.as_deref().unwrap(),
                b.user,
                b.request_id
            );
            assert!(rows.contains(&row), "order of buyer {}: {row}", b.user);
        }
        // I3: one order per request.
        assert_eq!(
            self.count(
                "SELECT count(*) AS n FROM (SELECT 1 FROM orders \
                 GROUP BY activity_id, user_id, request_id HAVING count(*) > 1) d"
            )
            .await,
            0
        );
        // I2: no buyer over the limit (1).
        assert_eq!(
            self.count(&format!(
                "SELECT count(*) AS n FROM (SELECT user_id FROM orders \
                 WHERE status IN ('WAITING_PAY', 'PAID') AND activity_id = {} GROUP BY user_id \
                 HAVING sum(quantity) > 1) o",
                sale.activity
            ))
            .await,
            0
        );
        // I1 / I7: conservation, locked = Σ WAITING_PAY, Redis = database.
        let total = stats["stock_total"].as_i64().unwrap();
        let available = stats["db_available"].as_i64().unwrap();
        let locked = stats["db_locked"].as_i64().unwrap();
        let sold = stats["db_sold"].as_i64().unwrap();
        assert_eq!(total, available + locked + sold, "{stats}");
        assert!(
            available >= 0 && locked + sold <= i64::from(sale.stock),
            "{stats}"
        );
        assert_eq!(
            locked,
            self.count(&format!(
                "SELECT COALESCE(sum(quantity), 0)::bigint AS n FROM orders \
                 WHERE status = 'WAITING_PAY' AND activity_id = {}",
                sale.activity
            ))
            .await,
            "locked = Σ WAITING_PAY"
        );
        assert_eq!(stats["redis_available"], stats["db_available"], "{stats}");
        assert!(
            locked >= accepted.len() as i64,
            "every acceptance holds a unit: {stats}"
        );
    }

    async fn count_waiting(&self, orders: &[String]) -> i64 {
        if orders.is_empty() {
            return 0;
        }
        self.count(&format!(
            "SELECT count(*) AS n FROM orders WHERE status = 'WAITING_PAY' AND order_no IN ({})",
            orders.join(",")
        ))
        .await
    }

    async fn not_waiting(&self, orders: &[String]) -> Vec<String> {
        let mut lost = Vec::new();
        for chunk in orders.chunks(500) {
            let waiting = self
                .strings(&format!(
                    "SELECT order_no::text AS s FROM orders WHERE status = 'WAITING_PAY' AND order_no IN ({})",
                    chunk.join(",")
                ))
                .await;
            lost.extend(chunk.iter().filter(|o| !waiting.contains(*o)).cloned());
        }
        lost
    }

    /// One SQL count on this world's database.
    pub async fn count(&self, sql: &str) -> i64 {
        crate::db::count(&self.settings.postgres.url, sql).await
    }

    /// Locks the `orders` table from a connection of the test's own and
    /// holds it until one of the server's writers waits on it (a minute at
    /// most): the order consumers are then mid-batch, whatever the host's
    /// speed. Returns the connection (the lock lives as long as it does)
    /// and whether a writer waited.
    pub async fn hold_order_writes(&self) -> (diesel::PgConnection, bool) {
        use diesel::{Connection, RunQueryDsl};
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let url = self.settings.postgres.url.expose_secret().to_owned();
        tokio::task::spawn_blocking(move || {
            let mut conn =
                diesel::PgConnection::establish(&url).expect("a connection of the test's");
            diesel::sql_query("BEGIN")
                .execute(&mut conn)
                .expect("BEGIN");
            diesel::sql_query("LOCK TABLE orders IN SHARE ROW EXCLUSIVE MODE")
                .execute(&mut conn)
                .expect("the orders table locked");
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let waiting = diesel::sql_query(
                    "SELECT count(*) AS n FROM pg_stat_activity \
                     WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .get_result::<N>(&mut conn)
                .expect("pg_stat_activity read")
                .n;
                if waiting > 0 || Instant::now() > deadline {
                    return (conn, waiting > 0);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
        .await
        .expect("the lock task")
    }

    pub(crate) async fn strings(&self, sql: &str) -> HashSet<String> {
        crate::db::strings(&self.settings.postgres.url, sql).await
    }

    /// [`Chaos::strings`], or nothing while the database does not answer.
    pub(crate) async fn try_strings(&self, sql: &str) -> HashSet<String> {
        crate::db::try_strings(&self.settings.postgres.url, sql).await
    }
}

/// A `seckill` process started by a test; killed when dropped.
pub struct Process(pub Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Chaos {
    fn drop(&mut self) {
        if let Some(mut child) = self.server.lock().unwrap().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::env::var_os("SECKILL_TEST_KEEP").is_some() {
            eprintln!("kept: database {}", self.db_name);
            return;
        }
        let url = self.settings.postgres.url.expose_secret().to_owned();
        let name = self.db_name.clone();
        let _ = std::thread::spawn(move || crate::db::drop_database(&url, &name)).join();
    }
}

/// When the fault strikes.
pub enum Fault {
    /// This far into the burst (a fraction of the buyers' start times).
    At(f64),
}

/// A sale of `stock` units (limit 1 each) to `buyers` buyers.
pub struct Sale<'a> {
    chaos: &'a Chaos,
    /// The activity.
    pub activity: i64,
    buyers: i64,
    /// Units on sale.
    pub stock: i32,
    /// Every answer the buyers got, as it came ([`Answers`]).
    answers: Answers,
}

/// The answers of a sale's buyers over time: printed per 5 s after the
/// burst, so a failure shows what buyers heard before and after the
/// fault; a stretch of [`STALL`] without an answer is told of with how
/// the CPUs were shared, and a server that answers nobody for [`HUNG`]
/// while the buyers are not starved is caught in the act (its threads and
/// the database's sessions, written beside its log).
#[derive(Default)]
struct Answers {
    started: std::sync::OnceLock<Instant>,
    /// (ms since the burst started, what was answered, how long it took).
    heard: Mutex<Vec<(u64, String, u64)>>,
    /// When the last answer came (ms since the start).
    last_ms: std::sync::atomic::AtomicU64,
}

/// No answer to any buyer for this long, with buyers waiting: a stall.
const STALL: Duration = Duration::from_secs(8);

/// A stall this long, longer than a buyer waits for one answer: the server
/// is hung, and what it was doing is worth stopping it for.
const HUNG: Duration = Duration::from_secs(24);

impl Answers {
    fn now_ms(&self) -> u64 {
        self.started.get().map_or(0, |t| {
            u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX)
        })
    }

    /// An answer of the server's.
    fn note(&self, what: String, asked: Instant) {
        let at = self.record(what, asked);
        self.last_ms
            .fetch_max(at, std::sync::atomic::Ordering::Relaxed);
    }

    /// A request the server did not answer (a connection refused, lost or
    /// timed out): not an answer, for [`STALL`].
    fn not_answered(&self, what: String, asked: Instant) {
        self.record(what, asked);
    }

    fn record(&self, what: String, asked: Instant) -> u64 {
        let at = self.now_ms();
        let took = u64::try_from(asked.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.heard.lock().unwrap().push((at, what, took));
        at
    }

    /// Per 5 s: how many answers of each kind, and the slowest.
    fn table(&self) -> String {
        let heard = self.heard.lock().unwrap();
        let mut buckets =
            std::collections::BTreeMap::<u64, (std::collections::BTreeMap<&str, usize>, u64)>::new(
            );
        for (at, what, took) in heard.iter() {
            let b = buckets.entry(at / 5000 * 5).or_default();
            *b.0.entry(what.as_str()).or_default() += 1;
            b.1 = b.1.max(*took);
        }
        buckets
            .iter()
            .map(|(s, (kinds, slowest))| format!("  {s:>4}s: {kinds:?}, slowest {slowest} ms"))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// What one buyer ended with.
#[derive(Debug, Clone)]
pub struct Bought {
    user: i64,
    request_id: String,
    /// Accepted (202, or a 2xx replay after a retry that was not FAILED).
    pub accepted: bool,
    order_no: Option<String>,
    /// The last answer: status and code.
    last: String,
    attempts: u32,
    /// Accepted by the database fallback (`X-Seckill-Admission: database`).
    pub through_database: bool,
}

/// Every buyer's end.
pub struct Outcome {
    /// Each buyer's end, in no particular order.
    pub bought: Vec<Bought>,
}

impl Outcome {
    /// Buyers accepted by the database fallback.
    pub fn through_database(&self) -> usize {
        self.bought
            .iter()
            .filter(|b| b.accepted && b.through_database)
            .count()
    }

    fn summary(&self) -> String {
        let mut by_end = std::collections::BTreeMap::<String, usize>::new();
        for b in &self.bought {
            *by_end.entry(b.last.clone()).or_default() += 1;
        }
        let retried = self.bought.iter().filter(|b| b.attempts > 1).count();
        let most = self.bought.iter().map(|b| b.attempts).max().unwrap_or(0);
        format!(
            "{} buyers, {} accepted; ends {by_end:?}; {retried} retried (at most {most} attempts)",
            self.bought.len(),
            self.bought.iter().filter(|b| b.accepted).count()
        )
    }
}

impl Bought {
    /// The end of a buyer a test drove itself: accepted under `order_no`,
    /// or not (`last` says how it ended).
    pub fn ended(user: i64, request_id: String, order_no: Option<String>, last: String) -> Self {
        Self {
            user,
            request_id,
            accepted: order_no.is_some(),
            order_no,
            last,
            attempts: 1,
            through_database: false,
        }
    }
}

impl<'a> Sale<'a> {
    /// A sale of an activity the test created itself.
    pub fn of(chaos: &'a Chaos, activity: i64, buyers: i64, stock: i32) -> Self {
        Self {
            chaos,
            activity,
            buyers,
            stock,
            answers: Answers::default(),
        }
    }

    /// Creates and warms the activity.
    pub async fn new(chaos: &'a Chaos, buyers: i64, stock: i32) -> Self {
        Self::with_pay_timeout(chaos, buyers, stock, 3600).await
    }

    /// Like [`Sale::new`], with orders closed `pay_timeout_secs` after
    /// they are created when unpaid.
    pub async fn with_pay_timeout(
        chaos: &'a Chaos,
        buyers: i64,
        stock: i32,
        pay_timeout_secs: u32,
    ) -> Self {
        let now = chrono::Utc::now();
        let body = json!({
            "sku_id": 1001, "name": "Phone", "price_cents": 9900, "stock": stock,
            "start_at": now - chrono::Duration::seconds(60),
            "end_at": now + chrono::Duration::seconds(3600),
            "per_user_limit": 1, "pay_timeout_secs": pay_timeout_secs, "buckets": 2,
        });
        let res = chaos
            .client
            .post(chaos.url("/api/v1/admin/activities"))
            .bearer_auth(chaos.admin())
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201);
        let activity = res.json::<Value>().await.unwrap()["activity_id"]
            .as_i64()
            .unwrap();
        let res = chaos
            .client
            .post(chaos.url(&format!("/api/v1/admin/activities/{activity}/warmup")))
            .bearer_auth(chaos.admin())
            .json(&json!({}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        Self {
            chaos,
            activity,
            buyers,
            stock,
            answers: Answers::default(),
        }
    }

    /// Starts the buyers at [`BUYERS_PER_SEC`], runs `fault` when the
    /// burst is `fault`'s way in, and returns once every buyer is done.
    pub async fn run_with_fault<F, Fut>(&self, when: Fault, fault: F) -> Outcome
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = ()>,
    {
        let Fault::At(fraction) = when;
        let burst = Duration::from_secs_f64(self.buyers as f64 / BUYERS_PER_SEC);
        let started = Instant::now();
        let _ = self.answers.started.set(started);
        let done = std::sync::atomic::AtomicBool::new(false);
        let buyers = async {
            let bought = join_all((1..=self.buyers).map(|user| {
                let start_at = started + burst.mul_f64((user - 1) as f64 / self.buyers as f64);
                async move {
                    tokio::time::sleep_until(start_at.into()).await;
                    self.buyer(user).await
                }
            }))
            .await;
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            bought
        };
        let watching = self.watch_for_stalls(&done);
        let faulting = async {
            tokio::time::sleep(burst.mul_f64(fraction)).await;
            eprintln!(
                "{}: fault at {:.1}s",
                self.chaos.name,
                started.elapsed().as_secs_f64()
            );
            fault().await;
            eprintln!(
                "{}: fault over at {:.1}s",
                self.chaos.name,
                started.elapsed().as_secs_f64()
            );
        };
        let (bought, (), ()) = tokio::join!(buyers, faulting, watching);
        eprintln!(
            "{}: burst over at {:.1}s; answers per 5 s:\n{}",
            self.chaos.name,
            started.elapsed().as_secs_f64(),
            self.answers.table()
        );
        Outcome { bought }
    }

    /// Until `done`: whenever no buyer has heard anything for [`STALL`],
    /// says how the CPUs were shared over that time: the server's threads
    /// and this process's, time run and time waited for a CPU. A stall
    /// that lasts [`HUNG`] while the buyers' own process was not starved
    /// (it waited less for a CPU than it ran) is the server's: its threads
    /// (gdb) and the database's sessions go to
    /// `<log dir>/<name>.stall.<n>.txt`, twice at most. gdb stops the
    /// server while it writes (7 s on a loaded host), so never for a
    /// passing slowdown of the host.
    async fn watch_for_stalls(&self, done: &std::sync::atomic::AtomicBool) {
        let mut dumps = 0;
        // The last answer (ms) whose stall was told of, and dumped.
        let (mut told, mut dumped) = (None, None);
        // One sample per second, the last STALL's worth kept.
        let mut samples = std::collections::VecDeque::new();
        let window = usize::try_from(STALL.as_secs()).unwrap();
        while !done.load(std::sync::atomic::Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_secs(1)).await;
            // Read each time: a fault test may have started it again.
            let server = self.chaos.server.lock().unwrap().as_ref().map(Child::id);
            samples.push_back((sched(server), sched(Some(std::process::id()))));
            if samples.len() > window + 1 {
                samples.pop_front();
            }
            let now = self.answers.now_ms();
            let last = self
                .answers
                .last_ms
                .load(std::sync::atomic::Ordering::Relaxed);
            let stalled = Duration::from_millis(now.saturating_sub(last));
            if last == 0 || stalled < STALL {
                continue;
            }
            let (first, latest) = (samples.front().unwrap(), samples.back().unwrap());
            let spent = |a: Option<Sched>, b: Option<Sched>| a.zip(b).map(|(a, b)| b.since(a));
            let buyers = spent(first.1, latest.1);
            if told != Some(last) {
                told = Some(last);
                eprintln!(
                    "{}: no buyer answered for {:.1}s at {:.1}s; over the last {}s the server {} and the buyers' process {}",
                    self.chaos.name,
                    stalled.as_secs_f64(),
                    now as f64 / 1000.0,
                    samples.len() - 1,
                    Sched::describe(spent(first.0, latest.0)),
                    Sched::describe(buyers),
                );
            }
            let starved = buyers.is_some_and(|s| s.waited_ns > s.ran_ns);
            if stalled < HUNG || starved || dumps >= 2 || dumped == Some(last) {
                continue;
            }
            dumps += 1;
            dumped = Some(last);
            let path = log_dir().join(format!("{}.stall.{dumps}.txt", self.chaos.name));
            eprintln!(
                "{}: still no answer after {:.1}s; threads and sessions in {}",
                self.chaos.name,
                stalled.as_secs_f64(),
                path.display()
            );
            let url = self.chaos.settings.postgres.url.expose_secret().to_owned();
            let _ = tokio::task::spawn_blocking(move || stall_report(server, &url, &path)).await;
        }
    }

    /// One buyer: a token, then the purchase; a 503 or a dropped
    /// connection is retried with the same request_id (a new token each
    /// time, as the old one may be spent or lost) until a final answer.
    pub async fn buyer(&self, user: i64) -> Bought {
        let c = self.chaos;
        // A connection of this buyer's own, as a shop's buyer has: a
        // shared pool hands a buyer a connection another opened and left
        // idle, which a starved client may not see closed (actix answers
        // 408 to a first request later than 5 s, and closes).
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap();
        let jwt = c.user(user);
        let request_id = format!(
            "b{user}-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let give_up = Instant::now() + BUYER_PATIENCE;
        let mut bought = Bought {
            user,
            request_id: request_id.clone(),
            accepted: false,
            order_no: None,
            last: "never answered".into(),
            attempts: 0,
            through_database: false,
        };
        while Instant::now() < give_up {
            bought.attempts += 1;
            let asked = Instant::now();
            let token = match client
                .get(c.url(&format!("/api/v1/activities/{}/token", self.activity)))
                .bearer_auth(&jwt)
                .send()
                .await
            {
                Ok(res) if res.status() == 200 => {
                    let token = res.json::<Value>().await.unwrap()["token"]
                        .as_str()
                        .unwrap()
                        .to_owned();
                    let kind = if token.starts_with("fb.") {
                        "fallback"
                    } else {
                        "redis"
                    };
                    self.answers.note(format!("token 200 {kind}"), asked);
                    token
                }
                Ok(res) => {
                    let status = res.status().as_u16();
                    let retry_after = retry_after(&res);
                    let body: Value = res.json().await.unwrap_or(Value::Null);
                    let code = body["code"].as_str().unwrap_or("").to_owned();
                    self.answers.note(format!("token {status} {code}"), asked);
                    if matches!(status, 429 | 503) {
                        pause_for(retry_after).await;
                    } else {
                        pause().await;
                    }
                    continue;
                }
                Err(e) => {
                    self.answers
                        .not_answered(format!("token {}", failure(&e)), asked);
                    pause().await;
                    continue;
                }
            };
            let asked = Instant::now();
            let res = client
                .post(c.url(&format!("/api/v1/activities/{}/orders", self.activity)))
                .bearer_auth(&jwt)
                .json(&json!({"request_id": request_id, "token": token}))
                .send()
                .await;
            let res = match res {
                Ok(res) => res,
                Err(e) => {
                    self.answers
                        .not_answered(format!("buy {}", failure(&e)), asked);
                    bought.last = "transport error".into();
                    pause().await;
                    continue;
                }
            };
            let status = res.status().as_u16();
            let through_database = res
                .headers()
                .get("x-seckill-admission")
                .is_some_and(|v| v == "database");
            let retry_after = retry_after(&res);
            let body: Value = res.json().await.unwrap_or(Value::Null);
            let code = body["code"].as_str().unwrap_or("").to_owned();
            let via = if through_database { " database" } else { "" };
            self.answers
                .note(format!("buy {status} {code}{via}"), asked);
            bought.last = format!("{status} {code}");
            match status {
                202 | 200 if body["status"] != "FAILED" => {
                    bought.accepted = true;
                    bought.through_database = status == 202 && through_database;
                    bought.order_no = body["order_no"].as_str().map(str::to_owned);
                    bought.last = format!("{status} {}", body["status"].as_str().unwrap_or(""));
                    return bought;
                }
                200 => {
                    bought.last = "200 FAILED".into();
                    return bought;
                }
                409 => return bought,
                // A token lost with Redis: a new one next time.
                403 if code == "INVALID_TOKEN" => pause().await,
                // 408: a server too starved to read the request in time
                // (actix's request timeout) never processed it.
                408 => pause().await,
                // 429 (the database fallback's rate while Redis is down) and
                // 503 say when to come back, and a shop's client does; it
                // does not wait more than 2 s (the sale goes on).
                503 | 429 => pause_for(retry_after).await,
                _ => panic!("buyer {user}: unexpected {status} {body}"),
            }
        }
        bought
    }
}

/// What a stalled server was doing: its threads (gdb, if installed) and
/// the sessions of its database.
fn stall_report(pid: Option<u32>, url: &str, path: &std::path::Path) {
    use diesel::{Connection, RunQueryDsl};
    #[derive(diesel::QueryableByName)]
    struct Session {
        #[diesel(sql_type = diesel::sql_types::Text)]
        line: String,
    }
    let mut report = String::new();
    if let Some(pid) = pid {
        report.push_str(&crate::gdb::all_threads(pid, Duration::from_secs(60)));
    }
    report.push_str("\n== pg_stat_activity ==\n");
    match diesel::PgConnection::establish(url) {
        Ok(mut conn) => match diesel::sql_query(
            "SELECT concat_ws(' | ', pid, state, wait_event_type, wait_event, \
               now() - xact_start, now() - state_change, left(query, 160)) AS line \
             FROM pg_stat_activity WHERE datname = current_database() \
             ORDER BY xact_start NULLS LAST",
        )
        .load::<Session>(&mut conn)
        {
            Ok(rows) => rows.iter().for_each(|r| {
                report.push_str(&r.line);
                report.push('\n');
            }),
            Err(e) => report.push_str(&format!("{e}\n")),
        },
        Err(e) => report.push_str(&format!("{e}\n")),
    }
    let _ = std::fs::write(path, report);
}

/// What kind of failure a request without an answer met.
fn failure(e: &reqwest::Error) -> &'static str {
    if e.is_timeout() {
        return "timeout";
    }
    if e.is_connect() {
        return "connect failed";
    }
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            match io.kind() {
                std::io::ErrorKind::ConnectionReset => return "connection reset",
                std::io::ErrorKind::BrokenPipe => return "connection lost (broken pipe)",
                _ => {}
            }
        }
        let text = cause.to_string();
        if text.contains("closed before message completed") {
            return "connection closed by the server";
        }
        // The 408 actix sends when a connection's first request is late
        // (5 s), read by a client that held the connection idle meanwhile.
        if text.contains("unexpected message") {
            return "connection closed by the server (408 unasked)";
        }
        source = cause.source();
    }
    "connection lost"
}

/// CPU time of a process's threads so far (`/proc/<pid>/task/*/schedstat`).
#[derive(Clone, Copy)]
struct Sched {
    ran_ns: u64,
    waited_ns: u64,
}

/// `pid`'s [`Sched`], if it still runs (and the kernel keeps schedstats).
fn sched(pid: Option<u32>) -> Option<Sched> {
    let tasks = std::fs::read_dir(format!("/proc/{}/task", pid?)).ok()?;
    let mut total = Sched {
        ran_ns: 0,
        waited_ns: 0,
    };
    for task in tasks.flatten() {
        let Ok(line) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        let mut fields = line
            .split_whitespace()
            .map(|f| f.parse::<u64>().unwrap_or(0));
        total.ran_ns += fields.next().unwrap_or(0);
        total.waited_ns += fields.next().unwrap_or(0);
    }
    Some(total)
}

impl Sched {
    /// What ran and waited between `before` and `self` (threads that ended
    /// meanwhile are not counted).
    fn since(self, before: Sched) -> Sched {
        Sched {
            ran_ns: self.ran_ns.saturating_sub(before.ran_ns),
            waited_ns: self.waited_ns.saturating_sub(before.waited_ns),
        }
    }

    fn describe(spent: Option<Sched>) -> String {
        spent.map_or_else(
            || "(unknown)".to_owned(),
            |s| {
                format!(
                    "ran {:.1}s and waited {:.1}s for a CPU",
                    s.ran_ns as f64 / 1e9,
                    s.waited_ns as f64 / 1e9
                )
            },
        )
    }
}

/// The `Retry-After` of an answer, in seconds.
fn retry_after(res: &reqwest::Response) -> Option<u64> {
    res.headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// Waits as `Retry-After` asks, at most 2 s, with a little jitter; without
/// it, as [`pause`].
async fn pause_for(retry_after: Option<u64>) {
    match retry_after {
        Some(secs) => {
            let wait =
                Duration::from_secs(secs.min(2)) + Duration::from_millis(fastrand::u64(..300));
            tokio::time::sleep(wait).await;
        }
        None => pause().await,
    }
}

async fn pause() {
    tokio::time::sleep(Duration::from_millis(200 + fastrand::u64(..300))).await;
}
