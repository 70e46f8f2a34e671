//! Load on a waiting room through the HTTP API, for `scripts/bench-room.sh`:
//!
//!   room_load join   URL ACTIVITY FIRST_USER USERS CONCURRENCY
//!   room_load status URL ACTIVITY FIRST_USER USERS CONCURRENCY SECONDS
//!
//! Tokens are minted with the secret of the configuration it runs with
//! (`config/`, `SECKILL__*`), as the server's.
//!
//! `join`: each user asks for a challenge, solves it, joins (the PoW is the
//! client's cost; the bench sets a difficulty of 1). `status`: `GET
//! …/queue/me` for random users of FIRST_USER.. for SECONDS. Prints one JSON
//! line: requests, seconds, per second, p50 / p99 / max in ms, non-2xx.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use seckill::auth::{JwtKeys, Role};
use serde_json::{Value, json};
use tokio::sync::Mutex;

struct Load {
    client: reqwest::Client,
    url: String,
    activity: i64,
    keys: JwtKeys,
    latencies: Mutex<Histogram<u64>>,
    failed: AtomicU64,
}

impl Load {
    fn token(&self, user: i64) -> String {
        self.keys.mint(user, Role::User, 3600).expect("mint")
    }

    async fn timed(&self, req: reqwest::RequestBuilder) -> Option<Value> {
        let started = Instant::now();
        let res = req.send().await.ok();
        let micros = started.elapsed().as_micros() as u64;
        self.latencies.lock().await.saturating_record(micros.max(1));
        match res {
            Some(r) if r.status().is_success() => r.json().await.ok(),
            _ => {
                self.failed.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    async fn join(&self, user: i64) {
        let token = self.token(user);
        let base = format!("{}/api/v1/activities/{}/queue", self.url, self.activity);
        let Some(c) = self
            .timed(
                self.client
                    .get(format!("{base}/challenge"))
                    .bearer_auth(&token),
            )
            .await
        else {
            return;
        };
        let number = seckill::room::pow::solve_parts(
            c["salt"].as_str().unwrap_or(""),
            c["challenge"].as_str().unwrap_or(""),
            c["maxnumber"].as_u64().unwrap_or(0),
        )
        .unwrap_or(0);
        let pow = json!({"algorithm": c["algorithm"], "challenge": c["challenge"],
                         "salt": c["salt"], "number": number, "signature": c["signature"]});
        self.timed(
            self.client
                .post(&base)
                .bearer_auth(&token)
                .json(&json!({ "pow": pow })),
        )
        .await;
    }

    async fn status(&self, user: i64) {
        let url = format!("{}/api/v1/activities/{}/queue/me", self.url, self.activity);
        self.timed(self.client.get(url).bearer_auth(self.token(user)))
            .await;
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    let num = |i: usize| arg(i).parse::<i64>().expect("a number");
    let (mode, first, users, conc) = (arg(1), num(4), num(5), num(6) as usize);
    let seconds = if mode == "status" { num(7) as u64 } else { 0 };
    let settings = seckill::config::Settings::load().expect("settings");
    let load = Arc::new(Load {
        client: reqwest::Client::builder()
            .pool_max_idle_per_host(conc)
            .pool_idle_timeout(Duration::from_secs(2))
            .build()
            .expect("client"),
        url: arg(2),
        activity: num(3),
        keys: JwtKeys::from_settings(&settings.auth).expect("keys"),
        latencies: Mutex::new(Histogram::new(3).expect("histogram")),
        failed: AtomicU64::new(0),
    });
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + Duration::from_secs(seconds);
    let workers: Vec<_> = (0..conc)
        .map(|_| {
            let (load, next, mode) = (load.clone(), next.clone(), mode.clone());
            tokio::spawn(async move {
                loop {
                    if mode == "join" {
                        let i = next.fetch_add(1, Ordering::Relaxed) as i64;
                        if i >= users {
                            return;
                        }
                        load.join(first + i).await;
                    } else {
                        if Instant::now() >= deadline {
                            return;
                        }
                        load.status(first + fastrand::i64(0..users)).await;
                    }
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.await;
    }
    let secs = started.elapsed().as_secs_f64();
    let h = load.latencies.lock().await;
    let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "{}",
        json!({
            "mode": mode, "requests": h.len(), "seconds": secs,
            "per_sec": h.len() as f64 / secs, "p50_ms": ms(0.5), "p99_ms": ms(0.99),
            "max_ms": h.max() as f64 / 1000.0,
            "failed": load.failed.load(Ordering::Relaxed),
        })
    );
}
