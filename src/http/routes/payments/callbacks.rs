//! The providers' callbacks: the mock's and `external`'s signed
//! `POST /payments/notify`, and WeChat Pay's and Stripe's own routes.

use actix_web::{HttpRequest, HttpResponse, web};
use secrecy::ExposeSecret;
use serde::Serialize;
use utoipa::ToSchema;

use crate::config::ProviderKind;
use crate::http::error::{ApiError, ErrorCode, Problem};
use crate::ids::{OrderNo, PaymentNo};
use crate::orders::OrderStatus;
use crate::orders::events::StatusChange;
use crate::payments::PaymentStatus;
use crate::payments::provider::{Callback, CallbackError, Event};
use crate::payments::refunds::RefundOutcome;
use crate::payments::repo::{self, CallbackOutcome};
use crate::payments::signature;
use crate::payments::sweeper;
use crate::state::AppState;
use crate::store;

/// `POST /api/v1/payments/notify`: the provider's signed callback. The raw
/// body is what was signed, so it is read as bytes and verified before it is
/// parsed.
#[utoipa::path(post, path = "/api/v1/payments/notify", tag = "payments",
    params(("X-Pay-Signature" = String, Header, description = "t=<unix seconds>,v1=<hex HMAC-SHA256 of t.body>")),
    request_body = crate::payments::provider::Callback,
    responses(
        (status = 200, description = "the callback is applied (or was before)", body = NotifyAnswer),
        (status = 400, description = "BAD_REQUEST or AMOUNT_MISMATCH", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "BAD_SIGNATURE", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn notify(
    state: web::Data<AppState>,
    req: HttpRequest,
    body: web::Bytes,
) -> Result<HttpResponse, ApiError> {
    let settings = &state.settings.payment;
    // Only the providers that sign with X-Pay-Signature take this route:
    // under any other, whoever holds `payment.notify_secret` could mark
    // an order paid with nothing charged.
    let provider = state.payments.providers.current().name();
    if !matches!(settings.kind(), ProviderKind::Mock | ProviderKind::External) {
        return Err(ApiError::not_found(format!(
            "no such route under the {provider} provider"
        )));
    }
    let header = req
        .headers()
        .get("x-pay-signature")
        .and_then(|v| v.to_str().ok());
    if let Err(e) = signature::verify(
        settings.notify_secret.expose_secret().as_bytes(),
        header,
        &body,
        state.clock.now().timestamp(),
        crate::clock::millis(settings.signature_tolerance_secs) / 1000,
    ) {
        state
            .metrics
            .callbacks
            .with_label_values(&["bad_signature"])
            .inc();
        return Err(ApiError::new(ErrorCode::BadSignature, e.to_string()));
    }
    let cb: Callback = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid callback body: {e}")))?;
    if !PaymentStatus::is_callback_status(&cb.status) {
        return Err(ApiError::bad_request("status must be SUCCESS or FAILED"));
    }
    let (Some(payment_no), Some(order_no)) = (
        PaymentNo::parse(&cb.payment_no),
        OrderNo::parse(&cb.order_no),
    ) else {
        return Err(ApiError::bad_request(
            "payment_no and order_no must be decimal ids",
        ));
    };
    if cb
        .provider_txn_id
        .as_ref()
        .is_some_and(|t| t.is_empty() || t.len() > 128)
    {
        return Err(ApiError::bad_request(
            "provider_txn_id must be 1..=128 characters",
        ));
    }
    let Some(charge) = cb.charge() else {
        return Err(ApiError::bad_request(
            "payment_no and order_no must be decimal ids",
        ));
    };
    debug_assert_eq!(
        (charge.payment_no, charge.order_no),
        (payment_no.get(), Some(order_no.get()))
    );
    let outcome = store::run(&state.pg.db, move |conn| {
        Ok(repo::apply_charge(conn, &charge, provider)?)
    })
    .await
    .map_err(ApiError::unavailable)?;
    state
        .metrics
        .callbacks
        .with_label_values(&[outcome.label()])
        .inc();
    if outcome == CallbackOutcome::Applied {
        let change = StatusChange {
            order_no: order_no.get(),
            status: OrderStatus::Paid,
        };
        state.redis.order_events.publish(&[change]).await;
    }
    match outcome {
        CallbackOutcome::Applied
        | CallbackOutcome::Duplicate
        | CallbackOutcome::RefundRequired
        | CallbackOutcome::MarkedFailed
        | CallbackOutcome::Unchanged => Ok(HttpResponse::Ok().json(NotifyAnswer {
            code: PaymentStatus::Success.as_str(),
        })),
        CallbackOutcome::UnknownPayment | CallbackOutcome::WrongProvider => {
            Err(ApiError::not_found("no such payment"))
        }
        CallbackOutcome::RefMismatch => Err(ApiError::bad_request(
            "the provider's payment is not this payment's",
        )),
        CallbackOutcome::OrderMismatch => Err(ApiError::bad_request(
            "order_no is not this payment's order",
        )),
        CallbackOutcome::AmountMismatch => Err(ApiError::new(
            ErrorCode::AmountMismatch,
            "amount_cents differs from the payment's amount",
        )),
        CallbackOutcome::TxnReused => Err(ApiError::bad_request(
            "provider_txn_id is already recorded for another payment",
        )),
    }
}

/// The answer a provider expects to a callback it sent.
#[derive(Debug, Serialize, ToSchema)]
pub struct NotifyAnswer {
    /// Always SUCCESS: the callback is applied, whatever it said.
    code: &'static str,
}

/// The request's headers, as the payment adapters read them.
struct RequestHeaders<'a>(&'a actix_web::http::header::HeaderMap);

impl crate::payments::provider::Headers for RequestHeaders<'_> {
    fn header(&self, name: &str) -> Option<&str> {
        self.0.get(name).and_then(|v| v.to_str().ok())
    }
}

/// WeChat Pay's error answer to a callback: it sends the callback again.
#[derive(Debug, Serialize, ToSchema)]
pub struct ProviderFail {
    /// Always FAIL.
    code: String,
    message: String,
}

/// The answer that makes WeChat Pay send a callback again.
fn wechat_fail(status: actix_web::http::StatusCode, message: impl Into<String>) -> HttpResponse {
    let mut answer = HttpResponse::build(status).json(serde_json::json!({
        "code": "FAIL",
        "message": message.into(),
    }));
    answer
        .extensions_mut()
        .insert(crate::http::error::ProviderAnswer);
    answer
}

/// A provider's own callback route, and its OpenAPI answers: the same for
/// every provider but for the path, the provider, its signature's headers
/// and the words for a 204.
macro_rules! provider_callback_route {
    (
        $(#[$doc:meta])*
        $name:ident, $kind:ident, path = $path:literal, applied = $applied:literal,
        missing = $missing:literal, params($($params:tt)*)
    ) => {
        $(#[$doc])*
        #[utoipa::path(post, path = $path, tag = "payments",
            params($($params)*),
            responses(
                (status = 204, description = $applied),
                (status = 401, description = "FAIL: the signature, its key or its timestamp is not accepted; nothing changed", body = ProviderFail),
                (status = 400, description = "FAIL: the body cannot be read or opened, or the amount differs; nothing changed", body = ProviderFail),
                (status = 404, description = $missing, content(
                    (ProviderFail = "application/json"),
                    (Problem = "application/problem+json"),
                )),
                (status = 503, description = "FAIL: the database is unavailable; send it again", body = ProviderFail),
            ))]
        pub async fn $name(
            state: web::Data<AppState>,
            req: HttpRequest,
            body: web::Bytes,
        ) -> HttpResponse {
            provider_notify(&state, &req, &body, ProviderKind::$kind).await
        }
    };
}

provider_callback_route! {
    /// `POST /api/v1/payments/notify/wechatpay`: WeChat Pay API v3 payment
    /// and refund callbacks. Verified (`Wechatpay-Timestamp`, `-Nonce`,
    /// `-Signature`, `-Serial`) and decrypted before anything is read;
    /// applied once (a repeat is a duplicate). 204 when applied or a
    /// duplicate; 4xx/5xx with `{"code": "FAIL", "message"}` when WeChat Pay
    /// must send it again.
    notify_wechatpay, Wechatpay,
    path = "/api/v1/payments/notify/wechatpay",
    applied = "applied, or applied before",
    missing = "FAIL: no such payment or refund here; NOT_FOUND (a problem) when WeChat Pay is not this server's provider",
    params()
}

provider_callback_route! {
    /// `POST /api/v1/payments/notify/stripe`: Stripe-style webhooks, verified
    /// by `Stripe-Signature: t=…,v1=…` within
    /// `payment.signature_tolerance_secs` before anything is read, applied
    /// once. 204 when applied, a duplicate, or an event this server does not
    /// act on; 4xx/5xx (Stripe sends it again) otherwise.
    notify_stripe, Stripe,
    path = "/api/v1/payments/notify/stripe",
    applied = "applied, a duplicate, or not acted on",
    missing = "FAIL: no such payment or refund here; NOT_FOUND (a problem) when Stripe is not this server's provider",
    params(("Stripe-Signature" = String, Header, description = "t=<unix seconds>,v1=<hex HMAC-SHA256 of t.body>"))
}

/// A provider's callback to `notify/<provider>`: verified and parsed by
/// that provider's adapter, then applied to that provider's payments only.
/// The route is there while the provider is configured, current or not:
/// payments made through it still finish.
async fn provider_notify(
    state: &AppState,
    req: &HttpRequest,
    body: &[u8],
    kind: ProviderKind,
) -> HttpResponse {
    use actix_web::http::StatusCode;
    let Some(provider) = state.payments.providers.get(kind.as_str()).cloned() else {
        // Not configured here: the route is not there (a problem, like
        // any unknown route), not a callback to send again.
        return actix_web::ResponseError::error_response(&ApiError::not_found(format!(
            "{} is not configured here",
            kind.as_str()
        )));
    };
    let event = match provider.parse_callback(
        &RequestHeaders(req.headers()),
        body,
        state.clock.now().timestamp(),
    ) {
        Ok(event) => event,
        Err(e) => {
            state
                .metrics
                .callbacks
                .with_label_values(&["bad_signature"])
                .inc();
            tracing::warn!(error = %e, provider = kind.as_str(), "a provider callback was refused");
            let status = match e {
                CallbackError::Undecryptable
                | CallbackError::Malformed(_)
                | CallbackError::Foreign(_) => StatusCode::BAD_REQUEST,
                _ => StatusCode::UNAUTHORIZED,
            };
            return wechat_fail(status, e.to_string());
        }
    };
    apply_event(state, provider.name(), event).await
}

/// Applies a verified event of `provider`; the answer a provider expects.
async fn apply_event(state: &AppState, provider: &'static str, event: Event) -> HttpResponse {
    use actix_web::http::StatusCode;
    match event {
        Event::Charge(charge) => {
            let outcome = match sweeper::apply_charge(
                &state.pg.db,
                &state.metrics,
                &state.redis.order_events,
                provider,
                charge,
            )
            .await
            {
                Ok(outcome) => outcome,
                Err(e) => {
                    tracing::warn!(error = format!("{e:#}"), "a payment callback not applied");
                    return wechat_fail(StatusCode::SERVICE_UNAVAILABLE, "try again");
                }
            };
            match outcome {
                CallbackOutcome::UnknownPayment | CallbackOutcome::WrongProvider => {
                    wechat_fail(StatusCode::NOT_FOUND, "no such payment")
                }
                CallbackOutcome::AmountMismatch => wechat_fail(
                    StatusCode::BAD_REQUEST,
                    "the amount differs from the payment's",
                ),
                CallbackOutcome::TxnReused
                | CallbackOutcome::OrderMismatch
                | CallbackOutcome::RefMismatch => wechat_fail(
                    StatusCode::BAD_REQUEST,
                    "the transaction is recorded for another payment",
                ),
                _ => HttpResponse::NoContent().finish(),
            }
        }
        Event::Ignored(kind) => {
            tracing::debug!(kind, "a provider event not acted on");
            HttpResponse::NoContent().finish()
        }
        Event::Refund(report) => {
            let after = state.settings.payment.query_after_secs;
            match sweeper::apply_refund(&state.pg.db, &state.metrics, provider, report, after).await
            {
                Ok(RefundOutcome::Unknown) => wechat_fail(StatusCode::NOT_FOUND, "no such refund"),
                Ok(outcome) => {
                    state
                        .metrics
                        .callbacks
                        .with_label_values(&[outcome.label()])
                        .inc();
                    HttpResponse::NoContent().finish()
                }
                Err(e) => {
                    tracing::warn!(error = format!("{e:#}"), "a refund callback not applied");
                    wechat_fail(StatusCode::SERVICE_UNAVAILABLE, "try again")
                }
            }
        }
    }
}
