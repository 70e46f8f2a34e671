//! Orders: the purchase route (admission + publish, SPEC steps 1–2), the
//! consumer that writes them (step 3) and the status routes (step 8).

pub mod closer;
pub mod consumer;
pub mod events;
pub mod pacing;
pub mod partition;
pub mod releaser;
pub mod repo;
pub mod status;
pub mod transitions;

pub use status::OrderStatus;
