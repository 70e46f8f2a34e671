//! Admission (SPEC step 1): the hot path from a purchase request to a Redis
//! reservation, with no database access. In-process limits
//! ([`limits`]) first, then one `EVALSHA` ([`gate`]) that does the replay
//! check, token consumption, per-user limit, stock and reservation at once.

pub mod acks;
pub mod gate;
pub mod keys;
pub mod limits;
pub mod soldout;

pub use gate::{Admission, RedisGate, ReleaseReason, ReserveRequest, WarmSpec, WorkerGate};
pub use keys::Layout;
