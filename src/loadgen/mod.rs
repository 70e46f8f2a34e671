//! `seckill loadgen`: a flash-sale burst against a running server, then an
//! invariant check. Creates and warms an activity (or uses a given one),
//! mints JWTs locally with the configured secret, fetches one purchase token
//! per user, fires the purchases at a fixed concurrency over keep-alive
//! connections, waits for the consumer to drain, and checks I1, I3, I4 and
//! I7 against the stats route. Exits non-zero when an invariant fails.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures_util::{StreamExt, stream};
use serde_json::{Value, json};

use crate::auth::{JwtKeys, Role};
use crate::config::Settings;
use crate::domain::ActivityId;
use crate::orders::OrderStatus;

mod sale;
mod verify;

pub use self::sale::SaleFigures;
use self::verify::{print_report, summarize, verify};

/// What to run.
#[derive(Debug, Clone, clap::Args)]
pub struct LoadgenArgs {
    /// Base URL of the server; repeat it to spread the buyers over several
    /// instances (buyer N goes to URL N mod count; admin calls to the first).
    #[arg(long = "url", default_values_t = [String::from("http://127.0.0.1:8080")])]
    pub urls: Vec<String>,
    /// Distinct buyers (one purchase each).
    #[arg(long, default_value_t = 20_000)]
    pub users: i64,
    /// Units on sale (ignored with --activity).
    #[arg(long, default_value_t = 1_000)]
    pub stock: i32,
    /// Requests in flight at once (closed loop: a new purchase starts when
    /// one ends; also the token phase).
    #[arg(long, default_value_t = 256)]
    pub concurrency: usize,
    /// Open loop: start purchases at this fixed rate per second, whatever
    /// the answers take, and measure each latency from its intended start
    /// (as wrk2 does: no coordinated omission).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Stock buckets of the created activity.
    #[arg(long, default_value_t = 1)]
    pub buckets: i32,
    /// Redis shards of the created activity (a hot activity spread over
    /// a cluster's masters).
    #[arg(long, default_value_t = 1)]
    pub shards: i32,
    /// Use this existing, warmed activity instead of creating one.
    #[arg(long)]
    pub activity: Option<ActivityId>,
    /// First user id (ids are first..first+users).
    #[arg(long, default_value_t = 1)]
    pub first_user: i64,
    /// How long to wait for the consumer to drain, in seconds.
    #[arg(long, default_value_t = 120)]
    pub drain_timeout: u64,
    /// Skip the drain wait and invariant check (pure admission throughput).
    #[arg(long)]
    pub no_check: bool,
    /// The design under test keeps no stock in Redis (the naive baseline):
    /// leave Redis out of the I7 comparison.
    #[arg(long)]
    pub db_only: bool,
    /// Instead of a sale, POST `--users` purchase-shaped requests to this URL
    /// (an HTTP ceiling: `examples/plain.rs`).
    #[arg(long)]
    pub ceiling_url: Option<String>,
    /// A whole sale, bought by people and by this many bot accounts (the
    /// first user ids), reporting the units each side took (see
    /// `loadgen/sale.rs` for how each behaves).
    #[arg(long, default_value_t = 0)]
    pub bots: i64,
    /// Run the sale through a waiting room: everyone joins the pre-queue,
    /// then buys with the pass of their turn.
    #[arg(long)]
    pub room: bool,
    /// With --room: tickets admitted per second.
    #[arg(long, default_value_t = 2_000)]
    pub admit_per_sec: i32,
    /// With --room: at most this many passes outstanding at once.
    #[arg(long)]
    pub max_active: Option<i32>,
    /// With --room: seconds from the activity's creation to its start, in
    /// which every buyer joins the pre-queue.
    #[arg(long, default_value_t = 60)]
    pub prequeue_secs: u64,
}

/// One purchase: HTTP status (0 when the transport failed), error code,
/// order number, latency.
type Outcome = (u16, String, Option<String>, Duration);

/// The figures of one run, for scripts (`--json` prints them).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// The activity bought from (0 for the ceiling, which buys nothing).
    pub activity_id: ActivityId,
    pub requests: u64,
    pub accepted: u64,
    pub sold_out: u64,
    pub limited: u64,
    pub errors: u64,
    pub seconds: f64,
    pub per_sec: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    /// p99 of the accepted purchases alone (202), and of all the others:
    /// where a tail comes from.
    pub p99_accepted_ms: f64,
    pub p99_refused_ms: f64,
    /// The arrival rate asked for (open loop), purchases per second.
    pub rate: Option<f64>,
    /// Purchase tokens fetched per second before the burst (the token
    /// route, at `--concurrency`).
    pub tokens_per_sec: Option<f64>,
    pub drain_seconds: Option<f64>,
    pub invariants_ok: Option<bool>,
    /// A whole sale (`--bots`, `--room`): who took the units, and the room's
    /// admission.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sale: Option<SaleFigures>,
}

struct Client {
    http: reqwest::Client,
    urls: Vec<String>,
    keys: JwtKeys,
}

impl Client {
    fn token(&self, user: i64, role: Role) -> anyhow::Result<String> {
        self.keys.mint(user, role, 3600)
    }

    /// The instance buyer `user` talks to.
    fn url_of(&self, user: i64) -> &str {
        let n = self.urls.len().max(1) as i64;
        &self.urls[user.rem_euclid(n) as usize]
    }

    /// An admin call, to the first instance.
    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        bearer: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<(u16, Value)> {
        self.send_to(&self.urls[0], method, path, bearer, body)
            .await
    }

    async fn send_to(
        &self,
        url: &str,
        method: reqwest::Method,
        path: &str,
        bearer: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<(u16, Value)> {
        let mut req = self
            .http
            .request(method, format!("{url}{path}"))
            .bearer_auth(bearer);
        if let Some(b) = body {
            req = req.json(b);
        }
        let res = req.send().await?;
        let status = res.status().as_u16();
        let bytes = res.bytes().await?;
        Ok((
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ))
    }
}

/// Runs the load and prints the report; errors when an invariant fails.
pub async fn run(settings: &Settings, args: LoadgenArgs) -> anyhow::Result<Report> {
    anyhow::ensure!(!args.urls.is_empty(), "at least one --url");
    let client = Arc::new(Client {
        http: reqwest::Client::builder()
            .pool_max_idle_per_host(args.concurrency)
            // Below the server's keep-alive (actix's 5 s): a connection the
            // server is closing is not picked for the next request.
            .pool_idle_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(30))
            .build()?,
        urls: args
            .urls
            .iter()
            .map(|u| u.trim_end_matches('/').to_owned())
            .collect(),
        keys: JwtKeys::from_settings(&settings.auth)?,
    });
    if let Some(url) = &args.ceiling_url {
        return ceiling(&client, url, &args).await;
    }
    let admin = client.token(1, Role::Admin)?;
    let mut tokens_per_sec = None;
    let (activity_id, outcomes, seconds, sale) = if args.room || args.bots > 0 {
        let (id, outcomes, seconds, sale) = sale::run(&client, &admin, &args).await?;
        (id, outcomes, seconds, Some(sale))
    } else {
        let activity_id = match args.activity {
            Some(id) => id,
            None => create_activity(&client, &admin, &args).await?,
        };
        let fetching = Instant::now();
        let tokens = fetch_tokens(&client, activity_id, &args).await?;
        tokens_per_sec = Some(tokens.len() as f64 / fetching.elapsed().as_secs_f64().max(1e-9));
        let (outcomes, seconds) = fire(&client, activity_id, tokens, &args).await?;
        (activity_id, outcomes, seconds, None)
    };

    let mut report = summarize(activity_id, &outcomes, seconds);
    report.rate = args.rate;
    report.tokens_per_sec = tokens_per_sec;
    let mut codes: BTreeMap<String, u64> = BTreeMap::new();
    for (status, code, _, _) in &outcomes {
        *codes.entry(format!("{status} {code}")).or_default() += 1;
    }
    print_report(&report, &codes);
    if let Some(sale) = &sale {
        sale::print(sale);
    }
    report.sale = sale;
    if !args.no_check {
        verify(&client, &admin, &outcomes, &mut report, &args).await?;
    }
    Ok(report)
}

/// A buyer ready to buy: their id, JWT and purchase token.
type Ready = (i64, String, String);

/// One purchase token per user.
async fn fetch_tokens(
    client: &Arc<Client>,
    activity_id: ActivityId,
    args: &LoadgenArgs,
) -> anyhow::Result<Vec<Ready>> {
    eprintln!(
        "activity {activity_id}: fetching {} purchase tokens…",
        args.users
    );
    let users: Vec<i64> = (args.first_user..args.first_user + args.users).collect();
    for_each_user("tokens", &users, args.concurrency, |user| {
        purchase_token(client, activity_id, user)
    })
    .await
}

/// `call` for every user, `concurrency` at once, with a progress line;
/// the first error ends it.
async fn for_each_user<T, F, Fut>(
    label: &'static str,
    users: &[i64],
    concurrency: usize,
    call: F,
) -> anyhow::Result<Vec<T>>
where
    F: Fn(i64) -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let progress = Progress::start(label, users.len() as u64);
    let done = stream::iter(users.iter().copied())
        .map(|user| {
            let progress = progress.clone();
            let answer = call(user);
            async move {
                let answer = answer.await;
                progress.tick();
                answer
            }
        })
        .buffer_unordered(concurrency)
        .collect::<Vec<anyhow::Result<T>>>()
        .await
        .into_iter()
        .collect::<anyhow::Result<_>>();
    progress.finish();
    done
}

/// One user's purchase token. A token is harmless to ask for twice: a
/// connection lost on the way is retried, as a client would.
async fn purchase_token(
    client: &Client,
    activity_id: ActivityId,
    user: i64,
) -> anyhow::Result<Ready> {
    let jwt = client.token(user, Role::User)?;
    let path = format!("/api/v1/activities/{activity_id}/token");
    let url = client.url_of(user);
    let mut attempt = 0;
    let (status, body) = loop {
        attempt += 1;
        match client
            .send_to(url, reqwest::Method::GET, &path, &jwt, None)
            .await
        {
            Err(_) if attempt < 5 => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            answer => break answer?,
        }
    };
    if status != 200 {
        bail!("token for user {user}: {status} {body}");
    }
    let token = body["token"].as_str().context("token missing")?.to_owned();
    Ok((user, jwt, token))
}

/// Fires every purchase, at `--rate` (open loop) or at `--concurrency`;
/// returns each outcome and the seconds the burst took.
async fn fire(
    client: &Arc<Client>,
    activity_id: ActivityId,
    tokens: Vec<Ready>,
    args: &LoadgenArgs,
) -> anyhow::Result<(Vec<Outcome>, f64)> {
    // A mark for whoever watches from outside (bench.sh --profile starts
    // its sampling here, after the token phase).
    eprintln!("buying: {} purchases", tokens.len());
    let progress = Progress::start("purchases", tokens.len() as u64);
    let started = Instant::now();
    let buy = |(user, jwt, token): Ready, t0: Instant| {
        let client = client.clone();
        let progress = progress.clone();
        async move {
            let path = format!("/api/v1/activities/{activity_id}/orders");
            let body = json!({"request_id": format!("lg-{user}-{}", uuid::Uuid::new_v4().simple()), "token": token});
            let result = purchase(&client, client.url_of(user), &path, &jwt, &body).await;
            let elapsed = t0.elapsed();
            progress.tick();
            match result {
                Ok((status, body)) => (
                    status,
                    body["code"].as_str().unwrap_or("").to_owned(),
                    body["order_no"].as_str().map(str::to_owned),
                    elapsed,
                ),
                Err(e) => (0, format!("transport: {e}"), None, elapsed),
            }
        }
    };
    let outcomes: Vec<Outcome> = match args.rate {
        Some(rate) => {
            anyhow::ensure!(rate > 0.0, "--rate must be positive");
            eprintln!("firing {} purchases at {rate} per second…", tokens.len());
            // Each purchase is spawned at its intended start and timed from
            // it: a slow answer delays no other purchase, and time spent
            // waiting to be sent counts.
            let mut running = Vec::with_capacity(tokens.len());
            for (i, t) in tokens.into_iter().enumerate() {
                let intended = started + Duration::from_secs_f64(i as f64 / rate);
                tokio::time::sleep_until(intended.into()).await;
                running.push(tokio::spawn(buy(t, intended)));
            }
            let mut outcomes = Vec::with_capacity(running.len());
            for task in running {
                outcomes.push(task.await?);
            }
            outcomes
        }
        None => {
            eprintln!(
                "firing {} purchases at concurrency {}…",
                tokens.len(),
                args.concurrency
            );
            stream::iter(tokens)
                .map(|t| buy(t, Instant::now()))
                .buffer_unordered(args.concurrency)
                .collect()
                .await
        }
    };
    let seconds = started.elapsed().as_secs_f64();
    progress.finish();
    Ok((outcomes, seconds))
}

/// One purchase as a client must make it: an answer that names an order
/// whose delivery is not confirmed yet (503 RETRY_LATER with `order_no`) is
/// retried with the same request for up to a minute; a 2xx after that is
/// the purchase accepted (reported as 202), since that order exists.
async fn purchase(
    client: &Client,
    url: &str,
    path: &str,
    jwt: &str,
    body: &Value,
) -> anyhow::Result<(u16, Value)> {
    let give_up = Instant::now() + Duration::from_secs(60);
    let mut pending = false;
    loop {
        let sent = client
            .send_to(url, reqwest::Method::POST, path, jwt, Some(body))
            .await;
        let (status, answer) = match sent {
            Ok(answer) => answer,
            // Lost on the way, in either direction: the same request_id
            // again is safe (the server answers a replay with the order it
            // made, if it made one), as a well-behaved client does.
            Err(_) if Instant::now() < give_up => {
                pending = true;
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        if status == 503 && answer["order_no"].is_string() && Instant::now() < give_up {
            pending = true;
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let accepted_late =
            pending && status == 200 && answer["status"] != OrderStatus::Failed.as_str();
        return Ok((if accepted_late { 202 } else { status }, answer));
    }
}

/// The HTTP ceiling: the same request shape and concurrency against `url`.
async fn ceiling(client: &Arc<Client>, url: &str, args: &LoadgenArgs) -> anyhow::Result<Report> {
    let jwt = client.token(1, Role::User)?;
    let body = json!({"request_id": "ceiling", "token": "t"});
    let progress = Progress::start("requests", args.users as u64);
    let started = Instant::now();
    let outcomes: Vec<Outcome> = stream::iter(0..args.users)
        .map(|_| {
            let (client, progress, jwt, body) = (client.clone(), progress.clone(), &jwt, &body);
            async move {
                let t0 = Instant::now();
                let sent = client
                    .http
                    .post(url)
                    .bearer_auth(jwt)
                    .json(body)
                    .send()
                    .await;
                let status = match sent {
                    Ok(res) => {
                        let status = res.status().as_u16();
                        let _ = res.bytes().await;
                        status
                    }
                    Err(_) => 0,
                };
                progress.tick();
                (status, String::new(), None, t0.elapsed())
            }
        })
        .buffer_unordered(args.concurrency)
        .collect()
        .await;
    let seconds = started.elapsed().as_secs_f64();
    progress.finish();
    let report = summarize(ActivityId::new(0), &outcomes, seconds);
    print_report(&report, &BTreeMap::new());
    Ok(report)
}

async fn create_activity(
    client: &Client,
    admin: &str,
    args: &LoadgenArgs,
) -> anyhow::Result<ActivityId> {
    let now = chrono::Utc::now();
    let body = json!({
        "sku_id": 1, "name": "loadgen", "price_cents": 100, "stock": args.stock,
        "start_at": now - chrono::Duration::seconds(5),
        "end_at": now + chrono::Duration::hours(1),
        "per_user_limit": 1, "pay_timeout_secs": 3600, "buckets": args.buckets,
        "shards": args.shards,
    });
    create_and_warm(client, admin, &body).await
}

/// Creates the activity `body` describes, and warms it up.
async fn create_and_warm(client: &Client, admin: &str, body: &Value) -> anyhow::Result<ActivityId> {
    let (status, created) = client
        .send(
            reqwest::Method::POST,
            "/api/v1/admin/activities",
            admin,
            Some(body),
        )
        .await?;
    if status != 201 {
        bail!("creating the activity: {status} {created}");
    }
    let id = created["activity_id"]
        .as_i64()
        .context("activity_id missing")?;
    let path = format!("/api/v1/admin/activities/{id}/warmup");
    let (status, warmed) = client
        .send(reqwest::Method::POST, &path, admin, Some(&json!({})))
        .await?;
    if status != 200 {
        bail!("warming up: {status} {warmed}");
    }
    Ok(ActivityId::new(id))
}

/// A once-a-second progress line on stderr.
#[derive(Clone)]
struct Progress {
    done: Arc<AtomicU64>,
    stop: tokio_util::sync::CancellationToken,
}

impl Progress {
    fn start(label: &'static str, total: u64) -> Self {
        let done = Arc::new(AtomicU64::new(0));
        let stop = tokio_util::sync::CancellationToken::new();
        let (d, s) = (done.clone(), stop.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            let mut last = 0;
            loop {
                tokio::select! {
                    _ = s.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                let now = d.load(Ordering::Relaxed);
                eprintln!(
                    "  {label}: {now}/{total} ({:.0}/s now, {:.1}s elapsed)",
                    (now - last) as f64,
                    started.elapsed().as_secs_f64()
                );
                last = now;
            }
        });
        Self { done, stop }
    }

    fn tick(&self) {
        self.done.fetch_add(1, Ordering::Relaxed);
    }

    fn finish(&self) {
        self.stop.cancel();
    }
}
