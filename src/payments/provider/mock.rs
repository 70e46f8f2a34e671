//! The built-in mock provider, which behaves like a real one where it
//! matters: it signs its callbacks with the shared secret, can deliver the
//! same callback several times, and refunds at once. And `external`: a
//! provider that signs callbacks the same way and has no API to call.

use chrono::{DateTime, Utc};
use futures_util::future::{BoxFuture, FutureExt};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};

use super::{
    CallbackError, Charge, ChargeOutcome, Checkout, CloseOutcome, Event, Headers, NewPayment,
    PaymentProvider, PaymentRef, ProviderError, RefundRef, RefundReport, RefundRequest,
    RefundState,
};
use crate::payments::signature::{self, SignatureError};

/// The providers that sign callbacks with `X-Pay-Signature` under
/// `payment.notify_secret`: the built-in mock (`payment.provider =
/// "mock"`), which refunds at once, and `external`, a provider with no API
/// here: closes are taken as done, queries as not paid, and refunds fail at
/// once (REFUND_FAILED, alerted: an operator gives the money back).
pub struct SignedProvider {
    secret: SecretString,
    tolerance_secs: i64,
    /// `external`: no refund API.
    external: bool,
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

impl Callback {
    /// The charge it reports; `None` when its numbers are not ids.
    pub fn charge(&self) -> Option<Charge> {
        Some(Charge {
            payment_no: self.payment_no.parse().ok().filter(|n| *n > 0)?,
            order_no: Some(self.order_no.parse().ok().filter(|n| *n > 0)?),
            amount_cents: self.amount_cents,
            outcome: if self.status == "SUCCESS" {
                ChargeOutcome::Paid
            } else {
                ChargeOutcome::Failed
            },
            txn_id: self.provider_txn_id.clone(),
            paid_at: self.paid_at,
            provider_ref: None,
        })
    }
}

/// Verifies an `X-Pay-Signature` callback and parses it into an event.
fn parse_signed(
    secret: &SecretString,
    tolerance_secs: i64,
    headers: &dyn Headers,
    body: &[u8],
    now: i64,
) -> Result<Event, CallbackError> {
    let header = headers.header("x-pay-signature");
    signature::verify(
        secret.expose_secret().as_bytes(),
        header,
        body,
        now,
        tolerance_secs,
    )
    .map_err(|e| match e {
        SignatureError::Missing | SignatureError::Malformed => {
            CallbackError::Malformed(e.to_string())
        }
        SignatureError::Stale => CallbackError::Stale,
        SignatureError::Mismatch => CallbackError::BadSignature,
    })?;
    let cb: Callback =
        serde_json::from_slice(body).map_err(|e| CallbackError::Malformed(e.to_string()))?;
    cb.charge()
        .map(Event::Charge)
        .ok_or_else(|| CallbackError::Malformed("payment_no and order_no must be ids".into()))
}

impl SignedProvider {
    /// The mock, signing with `secret` (the same `payment.notify_secret`
    /// the callback route verifies with).
    pub fn mock(secret: SecretString, tolerance_secs: i64) -> Self {
        Self {
            secret,
            tolerance_secs,
            external: false,
        }
    }

    /// `external`: its callbacks signed with `secret`.
    pub fn external(secret: SecretString, tolerance_secs: i64) -> Self {
        Self {
            external: true,
            ..Self::mock(secret, tolerance_secs)
        }
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

/// What a provider with nothing to ask answers about a payment: not paid
/// (its callback will tell).
fn not_paid(payment_no: i64) -> Charge {
    Charge::bare(payment_no, ChargeOutcome::NotPaid)
}

impl PaymentProvider for SignedProvider {
    fn name(&self) -> &'static str {
        if self.external { "external" } else { "mock" }
    }

    fn create<'a>(
        &'a self,
        _payment: &'a NewPayment,
    ) -> BoxFuture<'a, Result<Checkout, ProviderError>> {
        futures_util::future::ready(Ok(Checkout::default())).boxed()
    }

    fn parse_callback(
        &self,
        headers: &dyn Headers,
        body: &[u8],
        now: i64,
    ) -> Result<Event, CallbackError> {
        parse_signed(&self.secret, self.tolerance_secs, headers, body, now)
    }

    fn close<'a>(
        &'a self,
        _payment: &'a PaymentRef,
    ) -> BoxFuture<'a, Result<CloseOutcome, ProviderError>> {
        futures_util::future::ready(Ok(CloseOutcome::Closed)).boxed()
    }

    fn query<'a>(
        &'a self,
        payment: &'a PaymentRef,
    ) -> BoxFuture<'a, Result<Charge, ProviderError>> {
        futures_util::future::ready(Ok(not_paid(payment.payment_no))).boxed()
    }

    /// The mock gives the money back at once; `external` cannot.
    fn refund<'a>(
        &'a self,
        refund: &'a RefundRequest,
    ) -> BoxFuture<'a, Result<RefundReport, ProviderError>> {
        futures_util::future::ready(self.refunded(refund.refund_no)).boxed()
    }

    fn query_refund<'a>(
        &'a self,
        refund: &'a RefundRef,
    ) -> BoxFuture<'a, Result<RefundReport, ProviderError>> {
        futures_util::future::ready(self.refunded(refund.refund_no)).boxed()
    }
}

impl SignedProvider {
    fn refunded(&self, refund_no: i64) -> Result<RefundReport, ProviderError> {
        if self.external {
            return Err(ProviderError::Refused {
                code: "NO_REFUND_API".into(),
                message: "the external provider has no refund API: refund by hand".into(),
            });
        }
        Ok(RefundReport {
            refund_no,
            provider_refund_id: Some(format!("mock-refund-{refund_no}")),
            state: RefundState::Succeeded,
        })
    }
}
