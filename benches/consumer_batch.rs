//! One order-consumer batch into the real PostgreSQL of
//! `scripts/services.sh` (the whole SPEC step 3 transaction: consume_log,
//! orders, aggregate stock update, stock_flow), at batch sizes 1, 10, 100,
//! 500. Uses a scratch database `seckill_criterion`, recreated each run.
//! Skips (with a message) when PostgreSQL does not answer.

use std::collections::HashMap;
use std::time::Duration;

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use diesel::{Connection, PgConnection, RunQueryDsl};
use seckill::bus::events::OrderRequested;
use seckill::config::Settings;
use seckill::domain::ActivityId;
use seckill::ids::{OrderNo, Snowflake};
use seckill::orders::repo::{self, ActivityTerms};
use seckill::store::PgConn;
use secrecy::ExposeSecret;

const DB: &str = "seckill_criterion";

fn connect() -> Option<seckill::store::PgPool> {
    let settings = Settings::load_env("development").ok()?;
    let base = settings.postgres.url.expose_secret().to_owned();
    let (server, _) = base.rsplit_once('/')?;
    let Ok(mut admin) = PgConnection::establish(&format!("{server}/postgres")) else {
        eprintln!(
            "skipping consumer_batch benches: PostgreSQL does not answer (run scripts/services.sh up)"
        );
        return None;
    };
    diesel::sql_query(format!("DROP DATABASE IF EXISTS {DB} WITH (FORCE)"))
        .execute(&mut admin)
        .ok()?;
    diesel::sql_query(format!("CREATE DATABASE {DB}"))
        .execute(&mut admin)
        .ok()?;
    let mut pg = settings.postgres.clone();
    pg.url = format!("{server}/{DB}").into();
    let pool = seckill::store::pool(&pg);
    let mut pooled = pool.get().ok()?;
    let conn: &mut diesel::PgConnection = &mut pooled;
    seckill::store::migrate_up(conn).ok()?;
    diesel::sql_query(
        "INSERT INTO activities (id, sku_id, name, price_cents, start_at, end_at, per_user_limit, pay_timeout_secs, buckets) \
         VALUES (1, 1, 'bench', 100, now(), now() + interval '1 day', 1, 900, 1)",
    )
    .execute(conn)
    .ok()?;
    diesel::sql_query(
        "INSERT INTO stock (activity_id, total, available) VALUES (1, 2000000000, 2000000000)",
    )
    .execute(conn)
    .ok()?;
    Some(pool)
}

fn events(ids: &Snowflake, n: usize) -> Vec<OrderRequested> {
    (0..n)
        .map(|_| {
            // A buyer of its own, and a number carrying the buyer's gene,
            // as admission mints it (the order table's partition).
            let user = ids.next_at(seckill::ids::epoch_ms_now());
            let no =
                ids.next_with_gene_at(seckill::ids::epoch_ms_now(), seckill::ids::user_gene(user));
            OrderRequested {
                event_id: no.to_string(),
                order_no: OrderNo::new(no),
                activity_id: ActivityId::new(1),
                user_id: user,
                request_id: format!("r{no}"),
                quantity: 1,
                coupon_id: None,
                reserved_at_ms: 0,
            }
        })
        .collect()
}

fn batch(c: &mut Criterion) {
    let Some(pool) = connect() else { return };
    let mut conn: seckill::store::PooledConn = pool.get().expect("connection");
    let terms = HashMap::from([(
        ActivityId::new(1),
        ActivityTerms {
            price_cents: 100,
            pay_timeout_secs: 900,
            layout: seckill::admission::Layout::single(1),
        },
    )]);
    let ids = Snowflake::new(9);
    let none = repo::Marks::default();
    let mut group = c.benchmark_group("order batch transaction");
    for size in [1usize, 10, 100, 500] {
        group.throughput(Throughput::Elements(size as u64));
        group.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &size| {
            b.iter_batched(
                || events(&ids, size),
                |evs| apply(&mut conn, &evs, &terms, &none),
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

fn apply(
    conn: &mut PgConn,
    evs: &[OrderRequested],
    terms: &HashMap<ActivityId, ActivityTerms>,
    none: &repo::Marks,
) {
    let out =
        repo::apply_batch(conn, "bench", evs, terms, none, chrono::Utc::now()).expect("batch");
    assert_eq!(out.created, evs.len());
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    targets = batch
}
criterion_main!(benches);
