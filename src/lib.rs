//! seckill: a flash-sale order service. See `docs/ARCHITECTURE.md` for the
//! map from modules to the order path and SPEC invariants.

pub mod activities;
pub mod admission;
pub mod app;
pub mod auth;
pub mod bus;
pub mod clock;
pub mod config;
pub mod coupons;
pub mod domain;
pub mod http;
pub mod ids;
pub mod liveness;
pub mod loadgen;
pub mod metrics;
pub mod orders;
pub mod outbox;
pub mod payments;
pub mod reconcile;
pub mod replica;
pub mod room;
pub mod state;
pub mod stock;
pub mod store;
pub mod telemetry;
pub mod timeline;
pub mod worker;
