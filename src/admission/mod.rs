//! Admission (SPEC steps 1–2): the hot path from a purchase to an order the
//! broker has, with no database access. [`admit`] is the pipeline:
//! in-process limits ([`limits`]), the sold-out flag ([`soldout`]),
//! back-pressure, then one `EVALSHA` ([`gate`]) that does the replay check,
//! token consumption, per-user limit, stock and reservation at once, then
//! the publish with its three-valued outcome ([`publish`]) and the queued
//! acknowledgement ([`acks`]). While Redis is down, [`fallback`] takes
//! purchases to the database instead.

pub mod acks;
pub mod admit;
mod backpressure;
pub mod fallback;
pub mod gate;
pub mod keys;
pub mod limits;
pub mod mode;
pub mod publish;
pub mod purchase;
pub mod refusal;
pub mod soldout;

pub use gate::{Admission, RedisGate, ReleaseReason, ReserveRequest, ThreadGate, WarmSpec};
pub use keys::Layout;
