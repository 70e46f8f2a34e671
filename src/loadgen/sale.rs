//! A whole sale, bought by people and by a bot army, with or without a
//! waiting room (`seckill loadgen --bots N [--room]`, docs/BENCHMARKS-HISTORY.md,
//! "The waiting room").
//!
//! The model of a buyer, the same on both sides:
//!
//! - A person clicks [`PERSON_REACTION_MS`] after the moment they could
//!   (the start without a room; their turn showing with one), polls their
//!   ticket when the server says (`refresh_after_ms`), and tries a busy
//!   answer again after a second, at most [`PERSON_TRIES`] times.
//! - A bot sends at that very moment, polls four times as often as it is
//!   told (at least every [`BOT_POLL_MS`]), and tries a busy answer again at
//!   once until [`GIVE_UP`]. Each of its accounts buys at most once, as
//!   the activity's `per_user_limit` of 1 allows.
//!
//! Without a room the first users are the bots, and everyone buys with a
//! token fetched before the start. With one, everyone joins the pre-queue
//! (the bots first), the draw orders them at the start, and each buyer buys
//! with the pass of their turn. Ticket reads in flight are capped at
//! `--concurrency`, and purchases in flight apart from them at as many. A
//! purchase's latency runs from its click, so time spent waiting for a
//! connection counts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};
use tokio::sync::Semaphore;

use super::args::LoadgenArgs;
use super::buy::purchase;
use super::client::Client;
use super::progress::Progress;
use super::report::{Outcome, SaleFigures};
use super::setup::{create_and_warm, fetch_tokens, for_each_user};
use crate::auth::Role;
use crate::domain::ActivityId;

/// A person's reaction, uniform in this range of milliseconds.
const PERSON_REACTION_MS: (u64, u64) = (200, 2_000);
/// How often a person tries a busy answer.
const PERSON_TRIES: u32 = 3;
/// A bot polls its ticket at least this often.
const BOT_POLL_MS: u64 = 250;
/// A buyer who has neither bought nor been told "sold out" by then stops.
const GIVE_UP: Duration = Duration::from_secs(180);

/// The requests in flight at once: ticket reads, and purchases apart, so
/// that a buyer's purchase waits on the server, not behind other buyers'
/// reads in this process.
struct Slots {
    reads: Semaphore,
    buys: Semaphore,
}

/// One buyer's purchase, if they made one, and whether they are a bot.
type Bought = (bool, Option<Outcome>);

/// Runs the sale; returns the activity, each purchase made, the seconds
/// from the start to the last answer, and the figures.
pub(super) async fn run(
    client: &Arc<Client>,
    admin: &str,
    args: &LoadgenArgs,
) -> anyhow::Result<(ActivityId, Vec<Outcome>, f64, SaleFigures)> {
    anyhow::ensure!(
        (0..=args.users).contains(&args.bots),
        "--bots must be 0..=--users"
    );
    // Without a room the sale is open before the tokens are fetched.
    let start_in = if args.room {
        args.prequeue_secs as i64
    } else {
        -5
    };
    let start = chrono::Utc::now() + chrono::Duration::seconds(start_in);
    let activity = create(client, admin, args, start).await?;
    let mut figures = SaleFigures {
        waiting_room: args.room,
        bots: args.bots,
        people: args.users - args.bots,
        admit_per_sec: args.admit_per_sec,
        max_active: args.max_active,
        ..SaleFigures::default()
    };
    let gate = Arc::new(Slots {
        reads: Semaphore::new(args.concurrency.max(1)),
        buys: Semaphore::new(args.concurrency.max(1)),
    });
    let users: Vec<i64> = (args.first_user..args.first_user + args.users).collect();
    let tokens = if args.room {
        join_all(client, activity, &users, args, &mut figures).await?;
        Vec::new()
    } else {
        let tokens = fetch_tokens(client, activity, args).await?;
        tokens
            .into_iter()
            .map(|(_, jwt, token)| (jwt, token))
            .collect()
    };
    let wait = (start - chrono::Utc::now()).to_std().unwrap_or_default();
    eprintln!("the sale starts in {:.1} s", wait.as_secs_f64());
    tokio::time::sleep(wait).await;

    let started = Instant::now();
    let samples = Samples::default();
    let sampler = args.room.then(|| {
        let (client, admin) = (client.clone(), admin.to_owned());
        tokio::spawn(sample_admitted(client, admin, activity, samples.clone()))
    });
    let progress = Progress::start("buyers done", users.len() as u64);
    let mut running = Vec::with_capacity(users.len());
    for (i, user) in users.iter().copied().enumerate() {
        let bot = user < args.first_user + args.bots;
        let (client, gate, progress) = (client.clone(), gate.clone(), progress.clone());
        let token = tokens.get(i).cloned();
        running.push(tokio::spawn(async move {
            let outcome = match token {
                Some(token) => race(&client, &gate, activity, user, bot, token).await,
                None => queue_and_buy(&client, &gate, activity, user, bot).await,
            };
            progress.tick();
            (bot, outcome)
        }));
    }
    let mut bought: Vec<Bought> = Vec::with_capacity(running.len());
    for task in running {
        bought.push(task.await?);
    }
    let seconds = started.elapsed().as_secs_f64();
    progress.finish();
    if let Some(sampler) = sampler {
        sampler.abort();
        rate_figures(
            &samples.lock().map(|s| s.clone()).unwrap_or_default(),
            &mut figures,
        );
    }
    unit_figures(&bought, &mut figures);
    let outcomes = bought.into_iter().filter_map(|(_, o)| o).collect();
    Ok((activity, outcomes, seconds, figures))
}

/// Prints what the sale came to.
pub(super) fn print(f: &SaleFigures) {
    let side = if f.waiting_room {
        "through the waiting room"
    } else {
        "a race (no waiting room)"
    };
    println!(
        "sale            {side}: {} people, {} bots",
        f.people, f.bots
    );
    if f.waiting_room {
        println!(
            "pre-queue       {} tickets in {:.1} s",
            f.prequeue_joined, f.join_seconds
        );
        println!(
            "admitted        {} passes by the sell-out, {:.2} s after the start: {:.0}/s, at most {:.0}/s over a second (configured {}/s, max_active {})",
            f.admitted_at_sell_out,
            f.sell_out_secs,
            f.admitted_per_sec,
            f.admitted_max_per_sec,
            f.admit_per_sec,
            f.max_active.map_or("none".to_owned(), |m| m.to_string()),
        );
    }
    println!(
        "units taken     bots {}, people {}: the bots' share {:.1} %",
        f.bot_units,
        f.people_units,
        f.bot_share * 100.0
    );
    println!(
        "purchases       p99 {:.1} ms, max {:.1} ms, from the click (token and order)",
        f.purchase_p99_ms, f.purchase_max_ms
    );
}

async fn create(
    client: &Client,
    admin: &str,
    args: &LoadgenArgs,
    start: chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<ActivityId> {
    let mut body = json!({
        "sku_id": 1, "name": "loadgen sale", "price_cents": 100, "stock": args.stock,
        "start_at": start, "end_at": start + chrono::Duration::hours(1),
        "per_user_limit": 1, "pay_timeout_secs": 3600,
    });
    if args.room {
        // The pre-queue is open from now. The proof of work is the
        // lightest: its cost is the client's, measured on its own
        // (BENCHMARKS.md, the criterion table).
        body["waiting_room"] = json!({
            "prequeue_secs": args.prequeue_secs + 60, "admit_per_sec": args.admit_per_sec,
            "pass_ttl_secs": 120, "offer_secs": 60, "pow_difficulty": 1,
        });
        if let Some(cap) = args.max_active {
            body["waiting_room"]["max_active"] = json!(cap);
        }
    }
    create_and_warm(client, admin, &body).await
}

/// Every user joins the pre-queue, the bots first.
async fn join_all(
    client: &Arc<Client>,
    activity: ActivityId,
    users: &[i64],
    args: &LoadgenArgs,
    figures: &mut SaleFigures,
) -> anyhow::Result<()> {
    eprintln!("activity {activity}: {} joins…", users.len());
    let started = Instant::now();
    let states = for_each_user("joins", users, args.concurrency, |user| {
        join(client, activity, user)
    })
    .await?;
    figures.join_seconds = started.elapsed().as_secs_f64();
    figures.prequeue_joined = states.iter().filter(|s| *s == "PREQUEUE").count() as u64;
    Ok(())
}

/// One join: the challenge, its answer, the ticket's state.
async fn join(client: &Client, activity: ActivityId, user: i64) -> anyhow::Result<String> {
    let jwt = client.token(user, Role::User)?;
    let url = client.url_of(user);
    let base = format!("/api/v1/activities/{activity}/queue");
    let challenge = format!("{base}/challenge");
    // A challenge fetched as the rush builds may be too easy by the time it
    // is answered (400 POW_INVALID): a buyer fetches a new one, as the
    // buyer page does, a few times at most.
    let mut attempt = 0;
    loop {
        attempt += 1;
        let c =
            retried(|| client.send_to(url, reqwest::Method::GET, &challenge, &jwt, None)).await?;
        let number = crate::room::pow::solve_parts(
            c["salt"].as_str().unwrap_or(""),
            c["challenge"].as_str().unwrap_or(""),
            c["maxnumber"].as_u64().unwrap_or(0),
        )
        .context("no answer to the challenge")?;
        let pow = json!({"algorithm": c["algorithm"], "challenge": c["challenge"],
                         "salt": c["salt"], "number": number, "signature": c["signature"]});
        let body = json!({ "pow": pow });
        let answer = retried_or_refused(|| {
            client.send_to(url, reqwest::Method::POST, &base, &jwt, Some(&body))
        })
        .await?;
        match answer {
            Ok(ticket) => return Ok(ticket["state"].as_str().unwrap_or("").to_owned()),
            Err((400, problem)) if problem["code"] == "POW_INVALID" && attempt < 3 => continue,
            Err((status, problem)) => bail!("{status} {problem}"),
        }
    }
}

/// A call tried again when the connection is lost; a non-2xx answer is
/// given back to the caller.
async fn retried_or_refused<F, Fut>(call: F) -> anyhow::Result<Result<Value, (u16, Value)>>
where
    F: Fn() -> Fut,
    Fut: Future<Output = anyhow::Result<(u16, Value)>>,
{
    let mut attempt = 0;
    loop {
        attempt += 1;
        match call().await {
            Ok((status, body)) if (200..300).contains(&status) => return Ok(Ok(body)),
            Ok((status, body)) => return Ok(Err((status, body))),
            Err(_) if attempt < 5 => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => return Err(e),
        }
    }
}

/// A call that must answer 2xx, tried again when the connection is lost
/// (joins and challenges are idempotent per user).
async fn retried<F, Fut>(call: F) -> anyhow::Result<Value>
where
    F: Fn() -> Fut,
    Fut: Future<Output = anyhow::Result<(u16, Value)>>,
{
    match retried_or_refused(call).await? {
        Ok(body) => Ok(body),
        Err((status, body)) => bail!("{status} {body}"),
    }
}

/// No room: the buyer clicks with the token fetched before the start.
async fn race(
    client: &Client,
    gate: &Slots,
    activity: ActivityId,
    user: i64,
    bot: bool,
    (jwt, token): (String, String),
) -> Option<Outcome> {
    let body = json!({"request_id": format!("sale-{user}"), "token": token});
    let path = format!("/api/v1/activities/{activity}/orders");
    let (path, body, jwt) = (&path, &body, &jwt);
    click(bot, move || async move {
        let _slot = gate.buys.acquire().await.ok()?;
        Some(purchase(client, client.url_of(user), path, jwt, body).await)
    })
    .await
}

/// The buyer's reaction, then their click: `attempt` (`None` to stop),
/// tried again on a busy answer as the buyer would; timed from the click.
async fn click<F, Fut>(bot: bool, attempt: F) -> Option<Outcome>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Option<anyhow::Result<(u16, Value)>>>,
{
    tokio::time::sleep(reaction(bot)).await;
    let clicked = Instant::now();
    let mut tries = 0;
    loop {
        tries += 1;
        let (status, body) = match attempt().await? {
            Ok(answer) => answer,
            Err(e) => return Some((0, format!("transport: {e}"), None, clicked.elapsed())),
        };
        if busy(status) && again(bot, tries, clicked).await {
            continue;
        }
        return Some(outcome(status, &body, clicked));
    }
}

/// With a room: poll the ticket until the turn comes, then buy with the
/// pass; `None` when the buyer never got to buy (sold out first).
async fn queue_and_buy(
    client: &Client,
    gate: &Slots,
    activity: ActivityId,
    user: i64,
    bot: bool,
) -> Option<Outcome> {
    let jwt = client.token(user, Role::User).ok()?;
    let url = client.url_of(user);
    let me = format!("/api/v1/activities/{activity}/queue/me");
    let give_up = Instant::now() + GIVE_UP;
    let pass = loop {
        if Instant::now() >= give_up {
            return None;
        }
        let read = {
            let _slot = gate.reads.acquire().await.ok()?;
            client
                .send_to(url, reqwest::Method::GET, &me, &jwt, None)
                .await
        };
        let Ok((200, ticket)) = read else {
            tokio::time::sleep(Duration::from_millis(1_000)).await;
            continue;
        };
        match ticket["state"].as_str() {
            Some("ADMITTED" | "OFFERED") => {
                break ticket["pass"].as_str().unwrap_or("").to_owned();
            }
            Some("PREQUEUE" | "QUEUED") => {
                let told = ticket["refresh_after_ms"].as_u64().unwrap_or(1_000);
                let ms = if bot {
                    (told / 4).max(BOT_POLL_MS)
                } else {
                    told
                };
                // Spread out, as many pages polling are.
                tokio::time::sleep(Duration::from_millis(ms / 2 + fastrand::u64(0..=ms))).await;
            }
            _ => return None,
        }
    };
    let (url, jwt, pass) = (url, &jwt, &pass);
    let token = std::sync::Mutex::new(None);
    let token = &token;
    click(bot, move || async move {
        let _slot = gate.buys.acquire().await.ok()?;
        Some(buy_with_pass(client, url, activity, user, jwt, pass, token).await)
    })
    .await
}

/// The token for the pass (once: the pass is spent by it), then the order
/// with it. A busy order is tried again with the same token.
async fn buy_with_pass(
    client: &Client,
    url: &str,
    activity: ActivityId,
    user: i64,
    jwt: &str,
    pass: &str,
    token: &std::sync::Mutex<Option<String>>,
) -> anyhow::Result<(u16, Value)> {
    let held = token.lock().ok().and_then(|t| t.clone());
    let token = match held {
        Some(t) => t,
        None => {
            let res = client
                .http
                .get(format!("{url}/api/v1/activities/{activity}/token"))
                .bearer_auth(jwt)
                .header("X-Queue-Pass", pass)
                .send()
                .await?;
            let status = res.status().as_u16();
            let body: Value = res.json().await.unwrap_or(Value::Null);
            if status != 200 {
                return Ok((status, body));
            }
            let t = body["token"].as_str().context("token missing")?.to_owned();
            if let Ok(mut held) = token.lock() {
                *held = Some(t.clone());
            }
            t
        }
    };
    let order = json!({"request_id": format!("sale-{user}"), "token": token});
    let path = format!("/api/v1/activities/{activity}/orders");
    purchase(client, url, &path, jwt, &order).await
}

fn reaction(bot: bool) -> Duration {
    if bot {
        return Duration::ZERO;
    }
    Duration::from_millis(fastrand::u64(PERSON_REACTION_MS.0..=PERSON_REACTION_MS.1))
}

/// A refusal that says "not now" rather than "no".
fn busy(status: u16) -> bool {
    status == 429 || status == 503
}

/// Whether to try a busy answer again, after the buyer's pause.
async fn again(bot: bool, tries: u32, clicked: Instant) -> bool {
    if bot {
        tokio::time::sleep(Duration::from_millis(10)).await;
        return clicked.elapsed() < GIVE_UP;
    }
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    tries < PERSON_TRIES
}

fn outcome(status: u16, body: &Value, clicked: Instant) -> Outcome {
    (
        status,
        body["code"].as_str().unwrap_or("").to_owned(),
        body["order_no"].as_str().map(str::to_owned),
        clicked.elapsed(),
    )
}

/// (seconds since the start, passes given out, sold out).
type Sample = (f64, u64, bool);
type Samples = Arc<std::sync::Mutex<Vec<Sample>>>;

/// Reads the room's figures every 100 ms until it is sold out.
async fn sample_admitted(client: Arc<Client>, admin: String, activity: ActivityId, out: Samples) {
    let started = Instant::now();
    let path = format!("/api/v1/admin/activities/{activity}/stats");
    loop {
        if let Ok((200, stats)) = client.send(reqwest::Method::GET, &path, &admin, None).await {
            let room = &stats["waiting_room"];
            let sold = room["sold_out"].as_bool().unwrap_or(false);
            let admitted = room["admitted"].as_u64().unwrap_or(0);
            if let Ok(mut s) = out.lock() {
                s.push((started.elapsed().as_secs_f64(), admitted, sold));
            }
            if sold {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn rate_figures(samples: &[Sample], f: &mut SaleFigures) {
    let Some(&(secs, admitted, _)) = samples.iter().find(|s| s.2) else {
        return;
    };
    f.admitted_at_sell_out = admitted;
    f.sell_out_secs = secs;
    f.admitted_per_sec = admitted as f64 / secs.max(1e-9);
    // The fastest admission over any window of at least a second: each
    // sample against the last one a second or more before it.
    f.admitted_max_per_sec = samples
        .iter()
        .filter_map(|&(t, a, _)| {
            let before = samples.iter().rev().find(|s| s.0 <= t - 1.0)?;
            Some((a - before.1) as f64 / (t - before.0))
        })
        .fold(0.0, f64::max);
}

fn unit_figures(bought: &[Bought], f: &mut SaleFigures) {
    let taken = |bot: bool| {
        bought
            .iter()
            .filter(|(b, o)| *b == bot && o.as_ref().is_some_and(|o| o.0 == 202))
            .count() as u64
    };
    f.bot_units = taken(true);
    f.people_units = taken(false);
    f.bot_share = f.bot_units as f64 / (f.bot_units + f.people_units).max(1) as f64;
    let mut h = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)
        .expect("valid histogram bounds");
    for (_, o) in bought {
        if let Some(o) = o {
            h.saturating_record(u64::try_from(o.3.as_micros()).unwrap_or(u64::MAX).max(1));
        }
    }
    if !h.is_empty() {
        f.purchase_p99_ms = h.value_at_quantile(0.99) as f64 / 1000.0;
        f.purchase_max_ms = h.max() as f64 / 1000.0;
    }
}
