//! `seckill loadgen`: a flash-sale burst against a running server, then an
//! invariant check. Creates and warms an activity (or uses a given one),
//! mints JWTs locally with the configured secret, fetches one purchase token
//! per user, fires the purchases at a fixed concurrency over keep-alive
//! connections, waits for the consumer to drain, and checks I1, I3, I4 and
//! I7 against the stats route. Exits non-zero when an invariant fails.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures_util::{StreamExt, stream};
use serde_json::json;

use crate::auth::{JwtKeys, Role};
use crate::config::Settings;
use crate::domain::ActivityId;

mod args;
mod buy;
mod client;
mod cpu;
mod progress;
mod report;
mod sale;
mod setup;
pub mod timeline;
mod verify;
mod wire;

pub use self::args::LoadgenArgs;
use self::buy::{ANSWER_TIMEOUT, Prepared, Reply, purchase_as, purchase_with};
use self::client::Client;
use self::progress::Progress;
use self::report::Outcome;
pub use self::report::{Report, SaleFigures};
use self::setup::{Ready, create_activity, fetch_tokens};
use self::verify::{print_report, summarize, verify};

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
