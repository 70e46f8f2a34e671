//! A Stripe-style provider (`payment.provider = "stripe"`): PaymentIntents
//! created under an `Idempotency-Key` made of our payment number, webhooks
//! verified by `Stripe-Signature: t=…,v1=…` within a tolerance, cancel,
//! retrieve, and refunds under a key made of our refund number.
//!
//! The buyer's client pays with the intent's `client_secret` (Stripe.js).
//! The intent carries our payment number in its metadata, which is how a
//! webhook finds the payment.

use std::time::Duration;

use chrono::{TimeZone, Utc};
use futures_util::future::{BoxFuture, FutureExt};
use hmac::{Hmac, KeyInit, Mac};
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use serde_json::Value;
use sha2::Sha256;

use super::provider::exchange::{exchange, parse};
use super::provider::{
    CallbackError, Charge, ChargeOutcome, Checkout, CloseOutcome, Event, Headers, NewPayment,
    PaymentProvider, PaymentRef, ProviderError, RefundRef, RefundReport, RefundRequest,
    RefundState,
};
use crate::config::StripeSettings;

/// The adapter: one Stripe account.
pub struct Stripe {
    api_base: String,
    secret_key: SecretString,
    /// Every webhook signing secret accepted (the current one, and the one
    /// before it while a rotation lasts).
    webhook_secrets: Vec<SecretString>,
    currency: String,
    http: reqwest::Client,
    tolerance_secs: i64,
}

#[derive(Deserialize)]
struct ErrorBody {
    error: StripeError,
}

#[derive(Deserialize)]
struct StripeError {
    #[serde(default)]
    code: Option<String>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    message: Option<String>,
}

#[derive(Deserialize)]
struct Intent {
    id: String,
    status: String,
    amount: i64,
    #[serde(default)]
    amount_received: Option<i64>,
    #[serde(default)]
    client_secret: Option<String>,
    #[serde(default)]
    metadata: std::collections::HashMap<String, Value>,
    #[serde(default)]
    currency: Option<String>,
}

#[derive(Deserialize)]
struct Refund {
    id: String,
    status: String,
    #[serde(default)]
    metadata: std::collections::HashMap<String, Value>,
    #[serde(default)]
    failure_reason: Option<String>,
}

#[derive(Deserialize)]
struct List<T> {
    data: Vec<T>,
}

#[derive(Deserialize)]
struct WebhookEvent {
    #[serde(rename = "type")]
    kind: String,
    /// When the event happened (for a `payment_intent.succeeded`: when
    /// the money was taken), unix seconds.
    #[serde(default)]
    created: Option<i64>,
    data: EventData,
}

#[derive(Deserialize)]
struct EventData {
    object: Value,
}

fn number(metadata: &std::collections::HashMap<String, Value>, key: &str) -> Option<i64> {
    match metadata.get(key)? {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

/// `v1` signatures of `Stripe-Signature` that match `payload` under one of
/// `secrets`, within `tolerance` of `now`.
pub fn verify_signature(
    secrets: &[SecretString],
    header: Option<&str>,
    payload: &[u8],
    now: i64,
    tolerance: i64,
) -> Result<(), CallbackError> {
    let header = header.ok_or_else(|| CallbackError::Malformed("no Stripe-Signature".into()))?;
    let mut t = None;
    let mut signatures = Vec::new();
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", v)) => t = v.parse::<i64>().ok(),
            Some(("v1", v)) => {
                if let Ok(bytes) = hex::decode(v) {
                    signatures.push(bytes);
                }
            }
            _ => {}
        }
    }
    let t = t.ok_or_else(|| CallbackError::Malformed("Stripe-Signature without t".into()))?;
    if signatures.is_empty() {
        return Err(CallbackError::Malformed(
            "Stripe-Signature without v1".into(),
        ));
    }
    if now.abs_diff(t) > tolerance.unsigned_abs() {
        return Err(CallbackError::Stale);
    }
    for secret in secrets {
        for signature in &signatures {
            let mut mac = Hmac::<Sha256>::new_from_slice(secret.expose_secret().as_bytes())
                .unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
            mac.update(t.to_string().as_bytes());
            mac.update(b".");
            mac.update(payload);
            if mac.verify_slice(signature).is_ok() {
                return Ok(());
            }
        }
    }
    Err(CallbackError::BadSignature)
}

fn charge_of(intent: Intent, payment_no: i64) -> Charge {
    let outcome = match intent.status.as_str() {
        "succeeded" => ChargeOutcome::Paid,
        "canceled" => ChargeOutcome::Closed,
        _ => ChargeOutcome::NotPaid,
    };
    Charge {
        payment_no,
        order_no: None,
        amount_cents: intent
            .amount_received
            .filter(|a| *a > 0)
            .unwrap_or(intent.amount),
        outcome,
        txn_id: Some(intent.id.clone()),
        paid_at: None,
        provider_ref: Some(intent.id),
    }
}

/// What an error answer means (Stripe's API reference, "Errors": HTTP
/// status codes and error codes):
///
/// - 409 (an idempotent request still in flight), 429 (`rate_limit`,
///   `lock_timeout`), 401 and 403 (a key to mend here), and
///   `balance_insufficient` (a refund waiting for the balance): retry,
///   under the same idempotency key;
/// - other 4xx (400 `invalid_request_error`, 402 `card_error`, 404
///   `resource_missing`): final;
/// - 5xx and anything else: unknown, it may have been done.
fn error_of(status: u16, error: Option<StripeError>) -> ProviderError {
    let code = error
        .as_ref()
        .and_then(|e| e.code.clone().or_else(|| e.kind.clone()))
        .unwrap_or_else(|| status.to_string());
    let message = error.and_then(|e| e.message).unwrap_or_default();
    match status {
        401 | 403 | 409 | 429 => ProviderError::Retry { code, message },
        400..=499
            if matches!(
                code.as_str(),
                "balance_insufficient" | "lock_timeout" | "rate_limit"
            ) =>
        {
            ProviderError::Retry { code, message }
        }
        400..=499 => ProviderError::Refused { code, message },
        _ => ProviderError::Unknown(format!("{status} {code}: {message}")),
    }
}

fn report_of(refund: Refund, refund_no: i64) -> RefundReport {
    let state = match refund.status.as_str() {
        "succeeded" => RefundState::Succeeded,
        "failed" | "canceled" => {
            RefundState::Failed(refund.failure_reason.unwrap_or(refund.status))
        }
        _ => RefundState::Processing,
    };
    RefundReport {
        refund_no,
        provider_refund_id: Some(refund.id),
        state,
    }
}

impl Stripe {
    pub fn from_settings(
        s: &StripeSettings,
        timeout: Duration,
        tolerance_secs: i64,
    ) -> anyhow::Result<Self> {
        let mut webhook_secrets = vec![s.webhook_secret.clone()];
        webhook_secrets.extend(s.previous_webhook_secret.clone());
        Ok(Self {
            api_base: s.api_base.trim_end_matches('/').to_owned(),
            secret_key: s.secret_key.clone(),
            webhook_secrets,
            currency: s.currency.clone(),
            http: reqwest::Client::builder().timeout(timeout).build()?,
            tolerance_secs,
        })
    }

    /// One call: the answer's JSON for a 2xx, else the error as
    /// [`error_of`] reads it.
    async fn call<T: serde::de::DeserializeOwned>(
        &self,
        method: reqwest::Method,
        path: &str,
        form: &[(&str, String)],
        idempotency_key: Option<String>,
    ) -> Result<T, ProviderError> {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.api_base))
            .bearer_auth(self.secret_key.expose_secret());
        if !form.is_empty() {
            request = request.form(form);
        }
        if let Some(key) = idempotency_key {
            request = request.header("Idempotency-Key", key);
        }
        let answer = exchange(request).await?;
        if answer.is_success() {
            return parse(&answer.body);
        }
        let error = serde_json::from_slice::<ErrorBody>(&answer.body)
            .map(|b| b.error)
            .ok();
        Err(error_of(answer.status, error))
    }

    async fn create_intent(&self, p: &NewPayment) -> Result<Checkout, ProviderError> {
        let form = [
            ("amount", p.amount_cents.to_string()),
            ("currency", self.currency.clone()),
            ("metadata[payment_no]", p.payment_no.to_string()),
            ("metadata[order_no]", p.order_no.to_string()),
        ];
        let intent: Intent = self
            .call(
                reqwest::Method::POST,
                "/v1/payment_intents",
                &form,
                Some(format!("seckill-payment-{}", p.payment_no)),
            )
            .await?;
        Ok(Checkout {
            client_secret: intent.client_secret,
            provider_ref: Some(intent.id),
            ..Checkout::default()
        })
    }

    async fn retrieve(&self, payment: &PaymentRef) -> Result<Charge, ProviderError> {
        let Some(id) = payment.provider_ref.as_deref() else {
            // Never created there (its answer would have named it).
            return Ok(Charge::bare(payment.payment_no, ChargeOutcome::NotPaid));
        };
        let intent: Intent = self
            .call(
                reqwest::Method::GET,
                &format!("/v1/payment_intents/{id}"),
                &[],
                None,
            )
            .await?;
        Ok(charge_of(intent, payment.payment_no))
    }

    async fn cancel(&self, payment: &PaymentRef) -> Result<CloseOutcome, ProviderError> {
        let Some(id) = payment.provider_ref.as_deref() else {
            // No intent was ever shown to a buyer: nothing can be paid.
            return Ok(CloseOutcome::Closed);
        };
        let cancelled: Result<Intent, ProviderError> = self
            .call(
                reqwest::Method::POST,
                &format!("/v1/payment_intents/{id}/cancel"),
                &[],
                Some(format!("seckill-cancel-{}", payment.payment_no)),
            )
            .await;
        match cancelled {
            Ok(_) => Ok(CloseOutcome::Closed),
            // Refused: paid first, or cancelled before; retrieve tells.
            Err(ProviderError::Refused { code, message }) => {
                match self.retrieve(payment).await?.outcome {
                    ChargeOutcome::Paid => Ok(CloseOutcome::AlreadyPaid),
                    ChargeOutcome::Closed => Ok(CloseOutcome::Closed),
                    _ => Err(ProviderError::Refused { code, message }),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// The refund under our number: the one made before, when the
    /// provider has it, else made now. A provider that has forgotten an
    /// `Idempotency-Key` (Stripe keeps them 24 hours) must not refund twice
    /// when an attempt whose answer was lost is made again.
    async fn create_refund(&self, r: &RefundRequest) -> Result<RefundReport, ProviderError> {
        let Some(intent) = r.payment.provider_ref.clone() else {
            return Err(ProviderError::Refused {
                code: "no_payment_intent".into(),
                message: "the payment has no PaymentIntent to refund".into(),
            });
        };
        if let Some(made) = self.refund_of(&intent, r.refund_no).await? {
            return Ok(made);
        }
        let form = [
            ("payment_intent", intent),
            ("amount", r.amount_cents.to_string()),
            ("metadata[refund_no]", r.refund_no.to_string()),
            ("metadata[payment_no]", r.payment.payment_no.to_string()),
        ];
        let refund: Refund = self
            .call(
                reqwest::Method::POST,
                "/v1/refunds",
                &form,
                Some(format!("seckill-refund-{}", r.refund_no)),
            )
            .await?;
        Ok(report_of(refund, r.refund_no))
    }

    /// The refund of `intent` made under `refund_no`, if there is one.
    async fn refund_of(
        &self,
        intent: &str,
        refund_no: i64,
    ) -> Result<Option<RefundReport>, ProviderError> {
        let list: List<Refund> = self
            .call(
                reqwest::Method::GET,
                &format!("/v1/refunds?payment_intent={intent}"),
                &[],
                None,
            )
            .await?;
        Ok(list
            .data
            .into_iter()
            .find(|refund| number(&refund.metadata, "refund_no") == Some(refund_no))
            .map(|refund| report_of(refund, refund_no)))
    }

    async fn find_refund(&self, r: &RefundRef) -> Result<RefundReport, ProviderError> {
        if let Some(id) = r.provider_refund_id.as_deref() {
            let refund: Refund = self
                .call(
                    reqwest::Method::GET,
                    &format!("/v1/refunds/{id}"),
                    &[],
                    None,
                )
                .await?;
            return Ok(report_of(refund, r.refund_no));
        }
        let Some(intent) = r.payment.provider_ref.as_deref() else {
            return Err(ProviderError::Refused {
                code: "no_payment_intent".into(),
                message: "the payment has no PaymentIntent".into(),
            });
        };
        self.refund_of(intent, r.refund_no)
            .await?
            .ok_or_else(|| ProviderError::Refused {
                code: "resource_missing".into(),
                message: format!("no refund {} at the provider", r.refund_no),
            })
    }
}

impl PaymentProvider for Stripe {
    fn name(&self) -> &'static str {
        "stripe"
    }

    fn create<'a>(
        &'a self,
        payment: &'a NewPayment,
    ) -> BoxFuture<'a, Result<Checkout, ProviderError>> {
        self.create_intent(payment).boxed()
    }

    fn parse_callback(
        &self,
        headers: &dyn Headers,
        body: &[u8],
        now: i64,
    ) -> Result<Event, CallbackError> {
        let header = headers.header("stripe-signature");
        verify_signature(
            &self.webhook_secrets,
            header,
            body,
            now,
            self.tolerance_secs,
        )?;
        let event: WebhookEvent =
            serde_json::from_slice(body).map_err(|e| CallbackError::Malformed(e.to_string()))?;
        let malformed = |e: serde_json::Error| CallbackError::Malformed(e.to_string());
        match event.kind.as_str() {
            "payment_intent.succeeded"
            | "payment_intent.payment_failed"
            | "payment_intent.canceled" => {
                let intent: Intent =
                    serde_json::from_value(event.data.object).map_err(malformed)?;
                let Some(payment_no) = number(&intent.metadata, "payment_no") else {
                    return Ok(Event::Ignored(format!(
                        "{} without a payment_no",
                        event.kind
                    )));
                };
                if !intent
                    .currency
                    .as_deref()
                    .is_some_and(|c| c.eq_ignore_ascii_case(&self.currency))
                {
                    return Err(CallbackError::Foreign(format!(
                        "an intent in {:?}, not {}",
                        intent.currency, self.currency
                    )));
                }
                let mut charge = charge_of(intent, payment_no);
                if event.kind == "payment_intent.payment_failed" {
                    charge.outcome = ChargeOutcome::Failed;
                }
                if charge.outcome == ChargeOutcome::Paid {
                    charge.paid_at = event.created.and_then(|t| Utc.timestamp_opt(t, 0).single());
                }
                Ok(Event::Charge(charge))
            }
            "refund.created" | "refund.updated" | "refund.failed" | "charge.refund.updated" => {
                let refund: Refund =
                    serde_json::from_value(event.data.object).map_err(malformed)?;
                let Some(refund_no) = number(&refund.metadata, "refund_no") else {
                    return Ok(Event::Ignored(format!(
                        "{} without a refund_no",
                        event.kind
                    )));
                };
                Ok(Event::Refund(report_of(refund, refund_no)))
            }
            other => Ok(Event::Ignored(other.to_owned())),
        }
    }

    fn close<'a>(
        &'a self,
        payment: &'a PaymentRef,
    ) -> BoxFuture<'a, Result<CloseOutcome, ProviderError>> {
        self.cancel(payment).boxed()
    }

    fn query<'a>(
        &'a self,
        payment: &'a PaymentRef,
    ) -> BoxFuture<'a, Result<Charge, ProviderError>> {
        self.retrieve(payment).boxed()
    }

    fn refund<'a>(
        &'a self,
        refund: &'a RefundRequest,
    ) -> BoxFuture<'a, Result<RefundReport, ProviderError>> {
        self.create_refund(refund).boxed()
    }

    fn query_refund<'a>(
        &'a self,
        refund: &'a RefundRef,
    ) -> BoxFuture<'a, Result<RefundReport, ProviderError>> {
        self.find_refund(refund).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sign(secret: &str, t: i64, payload: &[u8]) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
        mac.update(format!("{t}.").as_bytes());
        mac.update(payload);
        hex::encode(mac.finalize().into_bytes())
    }

    #[test]
    fn a_webhook_verifies_under_any_current_secret_within_the_tolerance() {
        let secrets = [
            SecretString::from("whsec_new"),
            SecretString::from("whsec_old"),
        ];
        let body = br#"{"type":"payment_intent.succeeded"}"#;
        let now = 1_764_460_800;
        let good = format!("t={now},v1={}", sign("whsec_old", now, body));
        assert_eq!(
            verify_signature(&secrets, Some(&good), body, now, 300),
            Ok(())
        );
        // One good v1 among others (Stripe sends one per secret).
        let two = format!(
            "t={now},v1={},v1={}",
            "00".repeat(32),
            sign("whsec_new", now, body)
        );
        assert_eq!(
            verify_signature(&secrets, Some(&two), body, now + 300, 300),
            Ok(())
        );
        assert_eq!(
            verify_signature(&secrets, Some(&good), b"{}", now, 300),
            Err(CallbackError::BadSignature)
        );
        assert_eq!(
            verify_signature(&secrets, Some(&good), body, now + 301, 300),
            Err(CallbackError::Stale)
        );
        let foreign = format!("t={now},v1={}", sign("whsec_other", now, body));
        assert_eq!(
            verify_signature(&secrets, Some(&foreign), body, now, 300),
            Err(CallbackError::BadSignature)
        );
        for bad in [None, Some("v1=00"), Some("t=1"), Some("t=x,v1=00")] {
            assert!(matches!(
                verify_signature(&secrets, bad, body, now, 300),
                Err(CallbackError::Malformed(_))
            ));
        }
        let extreme = format!("t={},v1={}", i64::MIN, sign("whsec_new", i64::MIN, body));
        assert_eq!(
            verify_signature(&secrets, Some(&extreme), body, now, 300),
            Err(CallbackError::Stale)
        );
    }

    /// A server that answers every request with `answer` and keeps each
    /// request's head.
    fn canned(answer: &'static str) -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let heads = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = heads.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut buf = [0u8; 16384];
                let n = stream.read(&mut buf).unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).to_lowercase();
                // A list of refunds (looked up before one is made): none.
                let answer = if head.starts_with("get /v1/refunds?") {
                    r#"{"data":[]}"#
                } else {
                    answer
                };
                kept.lock().unwrap().push(head);
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                    answer.len()
                );
            }
        });
        (url, heads)
    }

    /// localstripe ignores `Idempotency-Key`, so the keys are checked here:
    /// the same payment (refund, cancel) is always asked for under the same
    /// key, another one under another key.
    #[tokio::test]
    async fn creates_and_refunds_go_under_keys_made_of_our_numbers() {
        let (url, heads) = canned(
            r#"{"id":"pi_1","status":"requires_payment_method","amount":100,"client_secret":"pi_1_secret_x"}"#,
        );
        let stripe = Stripe::from_settings(
            &StripeSettings {
                api_base: url,
                secret_key: SecretString::from("sk_test_x"),
                webhook_secret: SecretString::from("whsec_x"),
                previous_webhook_secret: None,
                currency: "cny".into(),
            },
            Duration::from_secs(5),
            300,
        )
        .unwrap();
        let payment = |payment_no| NewPayment {
            payment_no,
            order_no: 7,
            amount_cents: 100,
            description: "d".into(),
            expires_at: None,
            payer_openid: None,
        };
        for no in [11, 11, 12] {
            let checkout = stripe.create(&payment(no)).await.unwrap();
            assert_eq!(checkout.provider_ref.as_deref(), Some("pi_1"));
        }
        let refund = RefundRequest {
            refund_no: 5,
            payment: PaymentRef {
                payment_no: 11,
                provider_ref: Some("pi_1".into()),
            },
            amount_cents: 100,
            total_cents: 100,
            reason: "r".into(),
        };
        for _ in 0..2 {
            stripe.refund(&refund).await.unwrap();
        }
        // A cancel repeated after a lost answer is the same cancel.
        for _ in 0..2 {
            stripe.close(&refund.payment).await.unwrap();
        }
        let heads = heads.lock().unwrap().clone();
        let keys: Vec<&str> = heads
            .iter()
            .filter(|h| h.starts_with("post "))
            .map(|h| {
                h.lines()
                    .find_map(|l| l.strip_prefix("idempotency-key: "))
                    .unwrap_or_default()
                    .trim()
            })
            .collect();
        assert_eq!(
            keys,
            [
                "seckill-payment-11",
                "seckill-payment-11",
                "seckill-payment-12",
                "seckill-refund-5",
                "seckill-refund-5",
                "seckill-cancel-11",
                "seckill-cancel-11"
            ]
        );
        assert!(
            heads
                .iter()
                .all(|h| h.contains("authorization: bearer sk_test_x"))
        );
        assert!(
            heads[0].contains("metadata%5bpayment_no%5d=11"),
            "{}",
            heads[0]
        );
    }
}
