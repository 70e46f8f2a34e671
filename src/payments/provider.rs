//! The payment provider boundary, and the built-in mock that behaves like a
//! real one: it signs its callbacks with the shared secret and can deliver
//! the same callback several times.

use chrono::{DateTime, Utc};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};

use super::signature;

/// A payment provider: where pay intents are registered.
pub trait PaymentProvider: Send + Sync {
    /// Stored in `payments.provider`.
    fn name(&self) -> &'static str;
}

/// The mock provider (`payment.mock = true`).
pub struct MockProvider {
    secret: SecretString,
}

/// The callback body (docs/HTTP.md, "Payment callbacks").
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Callback {
    /// Our payment number (string).
    pub payment_no: String,
    /// The order it pays (string).
    pub order_no: String,
    /// Amount the provider charged, cents.
    pub amount_cents: i64,
    /// `SUCCESS` or `FAILED`.
    #[schema(pattern = "^(SUCCESS|FAILED)$")]
    pub status: String,
    /// The provider's transaction id (unique per charge).
    pub provider_txn_id: Option<String>,
    /// When the provider charged.
    pub paid_at: Option<DateTime<Utc>>,
}

impl MockProvider {
    /// A mock that signs with `secret` (the same `payment.notify_secret` the
    /// callback route verifies with).
    pub fn new(secret: SecretString) -> Self {
        Self { secret }
    }

    /// A signed callback: `(body, X-Pay-Signature)`.
    pub fn signed_callback(&self, callback: &Callback, now: DateTime<Utc>) -> (Vec<u8>, String) {
        let body = serde_json::to_vec(callback).unwrap_or_default();
        let header = signature::sign(
            self.secret.expose_secret().as_bytes(),
            now.timestamp(),
            &body,
        );
        (body, header)
    }
}

impl PaymentProvider for MockProvider {
    fn name(&self) -> &'static str {
        "mock"
    }
}

/// Used when `payment.mock = false`: an external provider that registers
/// intents on its side and calls back, signed with `payment.notify_secret`.
pub struct ExternalProvider;

impl PaymentProvider for ExternalProvider {
    fn name(&self) -> &'static str {
        "external"
    }
}
