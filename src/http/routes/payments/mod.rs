//! The payment routes: paying an order, the providers' callbacks, an
//! admin's refunds and statements, and the mock's simulator.

mod admin;
mod callbacks;
mod dev;
mod pay;

pub use admin::*;
pub use callbacks::*;
pub use dev::*;
pub use pay::*;
