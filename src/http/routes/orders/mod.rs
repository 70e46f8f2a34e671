//! The order routes: placing a purchase, reading orders, and cancelling.

mod cancel;
mod place;
mod read;

pub use cancel::*;
pub use place::*;
pub use read::*;
