//! The admission script on the real Redis of `scripts/services.sh`:
//! one call at a time, and 64 at once over the one multiplexed connection.
//! Skips (with a message) when Redis does not answer.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use seckill::admission::{Admission, RedisGate, ReserveRequest, WarmSpec};
use seckill::config::Settings;
use seckill::domain::ActivityId;

fn setup(rt: &tokio::runtime::Runtime) -> Option<(Arc<RedisGate>, i64, i64)> {
    let mut settings = Settings::load_env("development").ok()?;
    settings.redis.key_prefix = format!("cbench{}:", chrono::Utc::now().timestamp_millis());
    rt.block_on(async {
        let gate = RedisGate::new(&settings.redis, &settings.admission, None).ok()?;
        if gate.ping().await.is_err() {
            eprintln!("skipping redis_gate benches: Redis does not answer at {} (run scripts/services.sh up)", settings.redis.url);
            return None;
        }
        let spec = |activity_id, units| WarmSpec {
            activity_id,
            start_ms: 0,
            end_ms: i64::MAX / 2,
            per_user_limit: 1,
            units,
            price_cents: 100,
            layout: seckill::admission::Layout::single(1),
        };
        // Activity 1: sold out (the common answer in a flash sale).
        gate.warmup(&spec(ActivityId::new(1), 0)).await.ok()?;
        // Activity 2: effectively unlimited stock (the accept path).
        gate.warmup(&spec(ActivityId::new(2), i32::MAX)).await.ok()?;
        gate.issue_token(ActivityId::new(1), seckill::admission::Layout::single(1), 42, "bench", 3600, None).await.ok()?;
        Some((Arc::new(gate), 1, 2))
    })
}

fn request<'a>(
    activity_id: i64,
    user_id: i64,
    request_id: &'a str,
    token: &'a str,
    order_no: i64,
) -> ReserveRequest<'a> {
    ReserveRequest {
        coupon_id: None,
        activity_id: ActivityId::new(activity_id),
        user_id,
        request_id,
        token,
        quantity: 1,
        order_no,
        layout: seckill::admission::Layout::single(1),
        now_ms: chrono::Utc::now().timestamp_millis(),
    }
}

fn gate(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let Some((gate, sold_out, open)) = setup(&rt) else {
        return;
    };
    let counter = Arc::new(AtomicI64::new(1));

    c.bench_function("reserve.lua sold-out path, one at a time", |b| {
        b.to_async(&rt).iter(|| async {
            let n = counter.fetch_add(1, Ordering::Relaxed);
            let id = n.to_string();
            let r = gate
                .reserve(&request(sold_out, 42, &id, "bench", n))
                .await
                .unwrap();
            assert_eq!(r, Admission::SoldOut);
        })
    });

    c.bench_function(
        "reserve.lua accept path (token SET + EVALSHA), one at a time",
        |b| {
            b.to_async(&rt).iter(|| async {
                let n = counter.fetch_add(1, Ordering::Relaxed);
                let token = format!("t{n}");
                gate.issue_token(
                    ActivityId::new(open),
                    seckill::admission::Layout::single(1),
                    n,
                    &token,
                    60,
                    None,
                )
                .await
                .unwrap();
                let r = gate
                    .reserve(&request(open, n, &token, &token, n))
                    .await
                    .unwrap();
                assert_eq!(r, Admission::Accepted(n));
            })
        },
    );

    let mut group = c.benchmark_group("reserve.lua sold-out path, 64 in flight");
    group.throughput(criterion::Throughput::Elements(1));
    group.bench_function("one multiplexed connection", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let (gate, counter) = (gate.clone(), counter.clone());
            async move {
                let started = Instant::now();
                let per_task = iters.div_ceil(64);
                let tasks: Vec<_> = (0..64)
                    .map(|_| {
                        let (gate, counter) = (gate.clone(), counter.clone());
                        tokio::spawn(async move {
                            for _ in 0..per_task {
                                let n = counter.fetch_add(1, Ordering::Relaxed);
                                let id = n.to_string();
                                gate.reserve(&request(sold_out, 42, &id, "bench", n))
                                    .await
                                    .unwrap();
                            }
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await.unwrap();
                }
                // Time per call, as if the iters had run at this concurrency.
                started
                    .elapsed()
                    .mul_f64(iters as f64 / (per_task * 64) as f64)
            }
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = gate
}
criterion_main!(benches);
