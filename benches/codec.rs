//! Pure CPU pieces of the hot path: snowflake ids and the order event codec.
//! (Benches that need Redis, Kafka or PostgreSQL come with issue #6.)

use criterion::{Criterion, criterion_group, criterion_main};
use seckill::bus::events::OrderRequested;
use seckill::domain::ActivityId;
use seckill::ids::{IdGenerator, OrderNo, Snowflake};
use std::hint::black_box;

fn snowflake(c: &mut Criterion) {
    let generator = Snowflake::new(1);
    c.bench_function("snowflake next_id", |b| {
        b.iter(|| black_box(generator.next_id()))
    });
}

fn codec(c: &mut Criterion) {
    let event = OrderRequested {
        event_id: "385614060701356032".into(),
        order_no: OrderNo::new(385_614_060_701_356_032),
        activity_id: ActivityId::new(7),
        user_id: 123_456,
        request_id: "c0a80001-7f3e-4c1e-9d7a-1b2c3d4e5f60".into(),
        quantity: 1,
        coupon_id: None,
        reserved_at_ms: 1_764_460_800_000,
    };
    let bytes = event.encode();
    c.bench_function("order.requested encode", |b| {
        b.iter(|| black_box(event.encode()))
    });
    c.bench_function("order.requested decode", |b| {
        b.iter(|| black_box(OrderRequested::decode(black_box(&bytes))))
    });
}

criterion_group!(benches, snowflake, codec);
criterion_main!(benches);
