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

mod args;
mod client;
mod cpu;
mod report;
mod sale;
pub mod timeline;
mod verify;
mod wire;

pub use self::args::LoadgenArgs;
use self::client::Client;
use self::report::Outcome;
pub use self::report::{Report, SaleFigures};
use self::verify::{print_report, summarize, verify};

/// How long a request waits for its answer before it counts as lost (and
/// is sent again, as a client does).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs the load and prints the report; errors when an invariant fails.
pub async fn run(settings: &Settings, args: LoadgenArgs) -> anyhow::Result<Report> {
    anyhow::ensure!(!args.urls.is_empty(), "at least one --url");
    // Refused before the token phase, not after it.
    anyhow::ensure!(
        args.max_in_flight != Some(0),
        "--max-in-flight must be at least 1"
    );
    let client = Arc::new(Client {
        http: reqwest::Client::builder()
            // Every connection opened is kept for the next request: the
            // open loop opens more than --concurrency when answers lag, and
            // closing the extra ones as they come back made it open them
            // again and again, each time the host was busiest (a collapse
            // to 2,700/s at an offered 12,500/s).
            .pool_max_idle_per_host(usize::MAX)
            // Below the server's keep-alive (actix's 5 s): a connection the
            // server is closing is not picked for the next request.
            .pool_idle_timeout(Duration::from_secs(2))
            .timeout(ANSWER_TIMEOUT)
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
    let mut cost = None;
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
        let (outcomes, seconds, burst_cost) = fire(&client, activity_id, tokens, &args).await?;
        cost = burst_cost;
        (activity_id, outcomes, seconds, None)
    };

    let mut report = summarize(activity_id, &outcomes, seconds);
    report.rate = args.rate;
    report.tokens_per_sec = tokens_per_sec;
    report.with_cost(cost);
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

/// The server's CPU per request since `before` (with --cpu-pid), and this
/// process's.
fn cpu_cost(
    before: Option<(cpu::Reading, cpu::Reading)>,
    args: &LoadgenArgs,
    requests: usize,
) -> Option<(cpu::Cost, cpu::Cost)> {
    let (server, me) = before?;
    let n = requests as u64;
    let server = server.cost(&cpu::Reading::now(args.cpu_pid?)?, n);
    let me = me.cost(&cpu::Reading::now(std::process::id())?, n);
    Some((server, me))
}

/// The CPU counters of the server (with --cpu-pid) and of this process.
fn cpu_readings(args: &LoadgenArgs) -> Option<(cpu::Reading, cpu::Reading)> {
    let server = cpu::Reading::now(args.cpu_pid?)?;
    Some((server, cpu::Reading::now(std::process::id())?))
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
) -> anyhow::Result<(Vec<Outcome>, f64, Option<(cpu::Cost, cpu::Cost)>)> {
    // Each request is made before the clock starts: what the burst times
    // is the server, and this process does as little per request as the
    // HTTP ceiling's run does (`ceiling`).
    let prepared: Vec<(usize, Prepared)> = tokens
        .into_iter()
        .map(|(user, jwt, token)| {
            let body = json!({"request_id": format!("lg-{user}-{}", uuid::Uuid::new_v4().simple()), "token": token});
            Ok((client.server_of(user), Prepared::new(client.url_of(user), activity_id, &jwt, &body)?))
        })
        .collect::<anyhow::Result<_>>()?;
    // The open loop sends over its own connections (`wire`), the closed
    // loop through reqwest's pool.
    let wire = match args.rate {
        Some(_) => {
            let n = args.connections.max(args.concurrency);
            eprintln!("opening {n} connections per server…");
            Some(Arc::new(wire::Wire::open(&client.urls, n).await?))
        }
        None if args.connections > args.concurrency => {
            open_connections(client, args.connections).await;
            None
        }
        None => None,
    };
    // The open loop's requests as bytes, made before the clock starts too.
    let prepared: Vec<(usize, Prepared, Option<bytes::Bytes>)> = prepared
        .into_iter()
        .map(|(server, p)| {
            let raw = wire.as_ref().map(|w| p.raw(w.addr(server)));
            (server, p, raw)
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(args.settle_ms)).await;
    // A mark for whoever watches from outside (bench.sh --profile starts
    // its sampling here, after the token phase).
    eprintln!("buying: {} purchases", prepared.len());
    let progress = Progress::start("purchases", prepared.len() as u64);
    let before = cpu_readings(args);
    let started = Instant::now();
    let started_unix_ms = chrono::Utc::now().timestamp_millis();
    let buy = |(server, request, raw): (usize, Prepared, Option<bytes::Bytes>), t0: Instant| {
        let client = client.clone();
        let progress = progress.clone();
        let wire = wire.clone();
        async move {
            let result = match (&wire, raw) {
                (Some(wire), Some(raw)) => {
                    purchase_with(|| async {
                        // As reqwest's timeout does for the closed loop:
                        // a server that never answers is retried, not
                        // waited on for ever.
                        let (status, body) =
                            tokio::time::timeout(ANSWER_TIMEOUT, wire.send(server, &raw))
                                .await
                                .context("no answer")??;
                        Ok((status, Reply::parse(&body)))
                    })
                    .await
                }
                _ => purchase_as::<Reply>(&client, &request).await,
            };
            let elapsed = t0.elapsed();
            progress.tick();
            match result {
                Ok((status, reply)) => (status, reply.code, reply.order_no, elapsed),
                Err(e) => (0, format!("transport: {e}"), None, elapsed),
            }
        }
    };
    let outcomes: Vec<Outcome> = match args.rate {
        Some(rate) => {
            anyhow::ensure!(rate > 0.0, "--rate must be positive");
            eprintln!("firing {} purchases at {rate} per second…", prepared.len());
            // Each purchase is spawned at its intended start and timed from
            // it: a slow answer delays no other purchase, and time spent
            // waiting to be sent counts.
            let cap = args
                .max_in_flight
                .map(|n| Arc::new(tokio::sync::Semaphore::new(n)));
            let mut running = Vec::with_capacity(prepared.len());
            for (i, t) in prepared.into_iter().enumerate() {
                let intended = started + Duration::from_secs_f64(i as f64 / rate);
                tokio::time::sleep_until(intended.into()).await;
                let bought = buy(t, intended);
                let cap = cap.clone();
                running.push(tokio::spawn(async move {
                    // Sent once a place is free: the lag is to the send.
                    let _place = match cap {
                        Some(cap) => Some(cap.acquire_owned().await),
                        None => None,
                    };
                    let lag = intended.elapsed();
                    (bought.await, lag)
                }));
            }
            let mut outcomes = Vec::with_capacity(running.len());
            let mut sent = Vec::with_capacity(running.len());
            for (i, task) in running.into_iter().enumerate() {
                let (outcome, lag) = task.await?;
                sent.push(timeline::Sent {
                    intended: Duration::from_secs_f64(i as f64 / rate),
                    lag,
                    latency: outcome.3,
                    accepted: outcome.0 == 202,
                });
                outcomes.push(outcome);
            }
            if let Some(path) = &args.timeline {
                timeline::write(path, started_unix_ms, &sent)?;
            }
            outcomes
        }
        None => {
            eprintln!(
                "firing {} purchases at concurrency {}…",
                prepared.len(),
                args.concurrency
            );
            stream::iter(prepared)
                .map(|t| buy(t, Instant::now()))
                .buffer_unordered(args.concurrency)
                .collect()
                .await
        }
    };
    let seconds = started.elapsed().as_secs_f64();
    let cost = cpu_cost(before, args, outcomes.len());
    progress.finish();
    Ok((outcomes, seconds, cost))
}

/// Leaves `n` connections to every server in the pool: `n` reads of its
/// liveness route at once, per URL, each on a connection of its own.
async fn open_connections(client: &Client, n: usize) {
    eprintln!("opening {n} connections per server…");
    for url in &client.urls {
        let live = format!("{url}/health/live");
        let _ = stream::iter(0..n)
            .map(|_| {
                let live = live.clone();
                async move {
                    if let Ok(res) = client.http.get(&live).send().await {
                        let _ = res.bytes().await;
                    }
                }
            })
            .buffer_unordered(n)
            .collect::<Vec<()>>()
            .await;
    }
}

/// One purchase request, built before the burst: its URL, its
/// `Authorization` header and its body.
#[derive(Clone)]
struct Prepared {
    url: reqwest::Url,
    auth: reqwest::header::HeaderValue,
    body: bytes::Bytes,
}

impl Prepared {
    fn new(base: &str, activity_id: ActivityId, jwt: &str, body: &Value) -> anyhow::Result<Self> {
        Self::to(
            &format!("{base}/api/v1/activities/{activity_id}/orders"),
            jwt,
            body,
        )
    }

    fn to(url: &str, jwt: &str, body: &Value) -> anyhow::Result<Self> {
        Ok(Self {
            url: reqwest::Url::parse(url)?,
            auth: reqwest::header::HeaderValue::from_str(&format!("Bearer {jwt}"))?,
            body: serde_json::to_vec(body)?.into(),
        })
    }

    /// The whole HTTP/1.1 request, for [`wire::Wire::send`] to `host`.
    fn raw(&self, host: &str) -> bytes::Bytes {
        let mut raw = format!(
            "POST {} HTTP/1.1\r\nhost: {host}\r\nauthorization: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            self.url.path(),
            self.auth.to_str().unwrap_or_default(),
            self.body.len()
        )
        .into_bytes();
        raw.extend_from_slice(&self.body);
        raw.into()
    }

    async fn send<A: Answer>(&self, client: &Client) -> anyhow::Result<(u16, A)> {
        let res = client
            .http
            .post(self.url.clone())
            .header(reqwest::header::AUTHORIZATION, self.auth.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(self.body.clone())
            .send()
            .await?;
        let status = res.status().as_u16();
        let bytes = res.bytes().await?;
        Ok((status, A::parse(&bytes)))
    }
}

/// An answer as a caller reads it: whole ([`Value`]), or only what the
/// burst needs ([`Reply`]).
trait Answer: Sized {
    fn parse(bytes: &[u8]) -> Self;
    /// It names an order (a 503 with one is retried).
    fn names_order(&self) -> bool;
    /// Its `status` is FAILED.
    fn failed(&self) -> bool;
}

impl Answer for Value {
    fn parse(bytes: &[u8]) -> Self {
        serde_json::from_slice(bytes).unwrap_or(Value::Null)
    }

    fn names_order(&self) -> bool {
        self["order_no"].is_string()
    }

    fn failed(&self) -> bool {
        self["status"] == OrderStatus::Failed.as_str()
    }
}

impl Answer for Reply {
    fn parse(bytes: &[u8]) -> Self {
        Reply::parse(bytes)
    }

    fn names_order(&self) -> bool {
        self.order_no.is_some()
    }

    fn failed(&self) -> bool {
        self.failed
    }
}

/// What the load generator reads of an answer (the rest is skipped, not
/// parsed into a tree).
#[derive(Debug, Default)]
struct Reply {
    code: String,
    order_no: Option<String>,
    /// Its `status` is FAILED.
    failed: bool,
}

impl Reply {
    fn parse(bytes: &[u8]) -> Self {
        #[derive(serde::Deserialize)]
        struct Fields<'a> {
            #[serde(borrow)]
            code: Option<std::borrow::Cow<'a, str>>,
            #[serde(borrow)]
            order_no: Option<std::borrow::Cow<'a, str>>,
            #[serde(borrow)]
            status: Option<Status<'a>>,
        }
        /// An order's `status` is text; a problem's is its HTTP status.
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Status<'a> {
            Text(#[serde(borrow)] std::borrow::Cow<'a, str>),
            Other(serde::de::IgnoredAny),
        }
        match serde_json::from_slice::<Fields>(bytes) {
            Ok(f) => Self {
                code: f.code.map(|c| c.into_owned()).unwrap_or_default(),
                order_no: f.order_no.map(|o| o.into_owned()),
                failed: matches!(f.status, Some(Status::Text(s)) if s == OrderStatus::Failed.as_str()),
            },
            Err(_) => Self::default(),
        }
    }
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
    purchase_as(client, &Prepared::to(&format!("{url}{path}"), jwt, body)?).await
}

/// [`purchase`] of a request built beforehand, its answer read as `A`.
async fn purchase_as<A: Answer>(client: &Client, request: &Prepared) -> anyhow::Result<(u16, A)> {
    purchase_with(|| request.send::<A>(client)).await
}

/// [`purchase`], each attempt made by `send`.
async fn purchase_with<A, F, Fut>(send: F) -> anyhow::Result<(u16, A)>
where
    A: Answer,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<(u16, A)>>,
{
    let give_up = Instant::now() + Duration::from_secs(60);
    let mut pending = false;
    loop {
        let (status, answer) = match send().await {
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
        if status == 503 && answer.names_order() && Instant::now() < give_up {
            pending = true;
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let accepted_late = pending && status == 200 && !answer.failed();
        return Ok((if accepted_late { 202 } else { status }, answer));
    }
}

/// The HTTP ceiling: the same request shape and concurrency against `url`.
async fn ceiling(client: &Arc<Client>, url: &str, args: &LoadgenArgs) -> anyhow::Result<Report> {
    let jwt = client.token(1, Role::User)?;
    let body = json!({"request_id": "ceiling", "token": "t"});
    let progress = Progress::start("requests", args.users as u64);
    let before = cpu_readings(args);
    let started = Instant::now();
    let request = Prepared::to(url, &jwt, &body)?;
    let outcomes: Vec<Outcome> = stream::iter(0..args.users)
        .map(|_| {
            let (client, progress, request) = (client.clone(), progress.clone(), &request);
            async move {
                let t0 = Instant::now();
                // As a purchase is sent and read (`Prepared::send`).
                let status = match request.send::<Reply>(&client).await {
                    Ok((status, _)) => status,
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
    let cost = cpu_cost(before, args, outcomes.len());
    let mut report = summarize(ActivityId::new(0), &outcomes, seconds);
    report.with_cost(cost);
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

#[cfg(test)]
mod tests {
    use super::{OrderStatus, Reply};

    #[test]
    fn a_problem_is_read_for_its_code_although_its_status_is_a_number() {
        let body = br#"{"type":"urn:seckill:problem:SOLD_OUT","title":"Sold out","status":409,"detail":"d","code":"SOLD_OUT","message":"m"}"#;
        let reply = Reply::parse(body);
        assert_eq!(reply.code, "SOLD_OUT");
        assert!(!reply.failed);
    }

    #[test]
    fn an_order_is_read_for_its_number_and_a_failed_status() {
        let order = |status: OrderStatus| {
            serde_json::json!({"order_no": "1234", "status": status.as_str()}).to_string()
        };
        let accepted = Reply::parse(order(OrderStatus::Processing).as_bytes());
        assert_eq!(accepted.order_no.as_deref(), Some("1234"));
        assert!(!accepted.failed);
        assert!(Reply::parse(order(OrderStatus::Failed).as_bytes()).failed);
    }
}
