//! Reads of orders over HTTP against a running `seckill serve`: "my
//! orders" (`GET /api/v1/orders`) and an order by number
//! (`GET /api/v1/orders/{no}`), each for random buyers, at a fixed
//! concurrency; prints one JSON line of rates and percentiles per kind.
//! Used by `scripts/bench-orders-scale.sh` (10 million orders over a
//! million buyers, against the same reads on a small table).
//!
//!   order_reads URL USERS ORDERS_PER_USER REQUESTS CONCURRENCY
//!
//! The orders must be numbered as that script numbers them: order `i`
//! (1-based) belongs to user `(i - 1) % USERS + 1` and is numbered
//! `i * 16 + slot(user)`.

use std::time::{Duration, Instant};

use futures_util::{StreamExt, stream};
use seckill::auth::{JwtKeys, Role};
use seckill::config::Settings;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, users, per_user, requests, concurrency] = args.as_slice() else {
        anyhow::bail!("usage: order_reads URL USERS ORDERS_PER_USER REQUESTS CONCURRENCY");
    };
    let (users, per_user): (i64, i64) = (users.parse()?, per_user.parse()?);
    let (requests, concurrency): (usize, usize) = (requests.parse()?, concurrency.parse()?);
    let settings = Settings::load()?;
    let keys = JwtKeys::from_settings(&settings.auth)?;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()?;
    for kind in ["my_orders", "by_number"] {
        let started = Instant::now();
        let mut rng = fastrand_seed(kind.len() as u64);
        let jobs: Vec<(String, String)> = (0..requests)
            .map(|_| {
                let user = (rng.next() % users as u64) as i64 + 1;
                let token = keys.mint(user, Role::User, 3600).expect("a token");
                let path = if kind == "my_orders" {
                    "/api/v1/orders".to_owned()
                } else {
                    let k = (rng.next() % per_user as u64) as i64;
                    let i = k * users + user;
                    let no = i * 16 + i64::from(seckill::ids::user_slot(user));
                    format!("/api/v1/orders/{no}")
                };
                (path, token)
            })
            .collect();
        let mut latencies: Vec<Duration> = stream::iter(jobs)
            .map(|(path, token)| {
                let (client, url) = (&client, url.as_str());
                async move {
                    let t = Instant::now();
                    let res = client
                        .get(format!("{url}{path}"))
                        .bearer_auth(token)
                        .send()
                        .await
                        .expect("an answer");
                    assert_eq!(res.status(), 200, "{path}");
                    let body: serde_json::Value = res.json().await.expect("JSON");
                    assert!(
                        body.get("orders")
                            .is_some_and(|o| o.as_array().is_some_and(|a| !a.is_empty()))
                            || body.get("status").is_some(),
                        "{path}: {body}"
                    );
                    t.elapsed()
                }
            })
            .buffer_unordered(concurrency)
            .collect()
            .await;
        let wall = started.elapsed().as_secs_f64();
        latencies.sort();
        let pct = |p: f64| {
            let i = ((latencies.len() as f64 * p).ceil() as usize).clamp(1, latencies.len()) - 1;
            latencies[i].as_secs_f64() * 1000.0
        };
        println!(
            "{}",
            serde_json::json!({
                "kind": kind,
                "requests": latencies.len(),
                "per_sec": (latencies.len() as f64 / wall).round(),
                "p50_ms": pct(0.50),
                "p99_ms": pct(0.99),
                "p999_ms": pct(0.999),
            })
        );
    }
    Ok(())
}

/// A small deterministic generator (xorshift64*), so both runs ask for
/// the same buyers.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

fn fastrand_seed(seed: u64) -> Rng {
    Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
}
