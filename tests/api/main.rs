//! Integration tests against the real Redis, Kafka and PostgreSQL started by
//! `scripts/services.sh up`. Every test gets its own database, Redis key
//! prefix and Kafka topic prefix, so they run in parallel.

mod blackhole;
mod caching;
mod cleanup;
mod console;
mod coupons;
#[path = "../common/db.rs"]
mod db;
mod degradation;
mod delivery;
mod deploy;
mod errors_and_auth;
mod fallback;
mod forensics;
#[path = "../common/gdb.rs"]
mod gdb;
mod hang;
mod health;
mod helpers;
mod identity;
mod instances;
mod migrations;
mod money;
mod ops;
mod orders;
mod outbox;
mod pacing;
mod partitions;
mod payments;
mod production;
mod reconcile;
mod redis_loading;
mod replica;
mod shards;
mod sold_out;
mod streams;
mod stripe;
mod waiting_room;
mod wechatpay;
#[path = "../common/wire.rs"]
mod wire;
