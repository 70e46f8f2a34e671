//! Payments (SPEC step 5): pay intents through a [`provider::PaymentProvider`],
//! signed provider callbacks applied once, and the built-in mock provider.

pub mod provider;
pub mod repo;
pub mod signature;
pub mod status;

pub use status::PaymentStatus;
