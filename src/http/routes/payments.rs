//! `POST /orders/{no}/pay`, `POST /payments/notify` and the mock provider's
//! `POST /dev/payments/{no}/simulate`.

use actix_web::{HttpRequest, HttpResponse, web};
use secrecy::ExposeSecret;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::config::ProviderKind;
use crate::http::auth::AdminUser;
use crate::http::auth::AuthUser;
use crate::http::error::{ApiError, ErrorCode, Problem};
use crate::ids::{OrderNo, PaymentNo};
use crate::orders::OrderStatus;
use crate::orders::events::StatusChange;
use crate::payments::PaymentStatus;
use crate::payments::provider::{
    Callback, CallbackError, Checkout, Event, NewPayment, PaymentRef, ProviderError,
};
use crate::payments::refunds::RefundOutcome;
use crate::payments::repo::AfterSale;
use crate::payments::repo::{self, CallbackOutcome, PayIntent};
use crate::payments::signature;
use crate::payments::{statement, sweeper};
use crate::state::AppState;
use crate::store;

/// `POST /api/v1/orders/{order_no}/pay` body (optional).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PayBody {
    /// WeChat Pay JSAPI: the buyer's `openid`, when their token does not
    /// carry it (1..=128 letters, digits, `_` or `-`).
    openid: Option<String>,
}

/// How many times a pay call closes an earlier payment at its provider
/// and looks again before it asks the buyer to come back.
const PAY_ROUNDS: usize = 3;

/// `POST /api/v1/orders/{order_no}/pay`: the pending payment of a
/// WAITING_PAY order (created on the first call, returned on later ones).
/// An earlier payment that failed but is still open at its provider is
/// closed there first, so that an old QR code or client secret can no
/// longer take the money once the new one exists.
#[utoipa::path(post, path = "/api/v1/orders/{order_no}/pay", tag = "payments",
    params(("order_no" = String, Path, description = "order number (decimal)")),
    request_body(content = Option<PayBody>, description = "WeChat Pay JSAPI: the buyer's openid"),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "payment_no, order_no, amount_cents, status PENDING, provider, and code_url, client_secret or jsapi"),
        (status = 400, description = "BAD_REQUEST: a malformed body or openid; OPENID_REQUIRED: a WeChat Pay JSAPI payment without the buyer's openid", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "INVALID_STATE", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: the database or the payment provider is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn pay(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<String>,
    req: HttpRequest,
    body: web::Bytes,
) -> Result<HttpResponse, ApiError> {
    let order_no = crate::http::id_in_path(&path, OrderNo::parse, "no such order")?;
    let user_id = user.user_id;
    let body: PayBody = if body.iter().all(u8::is_ascii_whitespace) {
        PayBody::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad_request(format!("invalid body: {e}")))?
    };
    let openid = payer_openid(&state, &req, body.openid)?;
    let payments = &state.payments;
    let mut rounds = 0;
    let payment = loop {
        rounds += 1;
        // Under the leased instance id; without one (Redis down, the lease
        // run out) the database makes the number, so an order sold through
        // the fallback can still be paid before its deadline.
        let leased = state.sale.ids.next_id();
        let name = payments.providers.current().name();
        let intent = store::run(&state.pg.db, move |conn| {
            let payment_no = match leased {
                Some(n) => n,
                None => crate::ids::database_number(conn, None)?,
            };
            Ok(repo::create_or_get(
                conn,
                order_no,
                user_id,
                PaymentNo::new(payment_no),
                name,
            )?)
        })
        .await
        .map_err(ApiError::unavailable)?;
        match intent {
            PayIntent::NotFound => return Err(ApiError::not_found("no such order")),
            PayIntent::InvalidState => {
                return Err(ApiError::new(
                    ErrorCode::InvalidState,
                    "only a WAITING_PAY order can be paid",
                ));
            }
            PayIntent::Pending(p) => break p,
            PayIntent::CloseFirst(_) if rounds > PAY_ROUNDS => {
                return Err(provider_unavailable(
                    "an earlier payment is still open at its provider; pay again",
                ));
            }
            PayIntent::CloseFirst(unclosed) => {
                for old in unclosed {
                    close_earlier(&state, old).await?;
                }
            }
        }
    };
    // The payment's own provider: the one it was made through, whatever
    // is current now.
    let provider = payments
        .providers
        .get(&payment.provider)
        .cloned()
        .ok_or_else(|| unconfigured(&payment.provider))?;
    // Created at the provider under the payment number: a repeated call
    // (this one's answer lost, or the buyer's second click) gets the same
    // payment there, never a second one.
    let checkout = match payment
        .checkout
        .as_ref()
        .and_then(|c| serde_json::from_value::<Checkout>(c.clone()).ok())
    {
        Some(checkout) => checkout,
        None => {
            let (order, number) = (OrderNo::new(payment.order_no), payment.order_no);
            let deadline = store::run(&state.pg.db, move |conn| {
                Ok(crate::orders::repo::pay_deadline(conn, order)?)
            })
            .await
            .map_err(ApiError::unavailable)?;
            let new = NewPayment {
                payment_no: payment.payment_no,
                order_no: number,
                amount_cents: payment.amount_cents,
                description: format!("seckill order {number}"),
                expires_at: deadline,
                payer_openid: openid,
            };
            let created = provider.create(&new).await;
            sweeper::count_call(&state.metrics, "create", created.as_ref().map(|_| ()));
            let checkout = created.map_err(|e| match e {
                ProviderError::Refused { code, message } if code == "OPENID_REQUIRED" => {
                    ApiError::new(ErrorCode::OpenidRequired, message)
                }
                ProviderError::Refused { code, message } => ApiError::new(
                    ErrorCode::InvalidState,
                    format!("the payment provider refused the payment ({code}): {message}"),
                ),
                e => {
                    tracing::info!(error = %e, payment_no = payment.payment_no, "pay: the provider gave no answer to act on");
                    provider_unavailable("the payment provider did not answer; pay again")
                }
            })?;
            let (no, kept) = (payment.payment_no, checkout.clone());
            store::run(&state.pg.db, move |conn| {
                Ok(repo::set_checkout(conn, no, &kept)?)
            })
            .await
            .map_err(ApiError::unavailable)?;
            checkout
        }
    };
    // The buyer's next read shows this payment: not from a replica that
    // has not replayed it.
    if let Some(replica) = &state.pg.replica {
        replica.shown_from_primary(user_id).await;
    }
    Ok(HttpResponse::Ok().json(PayAnswer {
        payment_no: payment.payment_no.to_string(),
        order_no: payment.order_no.to_string(),
        amount_cents: payment.amount_cents,
        status: payment.status,
        provider: provider.name(),
        checkout,
    }))
}

/// The payer's `openid` for a provider that pays as a known payer
/// (WeChat Pay JSAPI): the claim `payment.wechatpay.openid_claim` of the
/// buyer's token when it has one, else the body's. `None` for every other
/// provider.
fn payer_openid(
    state: &AppState,
    req: &HttpRequest,
    given: Option<String>,
) -> Result<Option<String>, ApiError> {
    let well_formed = |id: &str| {
        (1..=128).contains(&id.len())
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    };
    if given.as_deref().is_some_and(|id| !well_formed(id)) {
        return Err(ApiError::bad_request(
            "openid must be 1..=128 letters, digits, _ or -",
        ));
    }
    if !state.payments.providers.current().needs_payer() {
        return Ok(None);
    }
    let claim = state
        .settings
        .payment
        .wechatpay
        .as_ref()
        .and_then(|w| w.openid_claim.as_deref())
        .and_then(|name| crate::http::auth::verified_claim(req, name))
        .filter(|id| well_formed(id));
    match (claim, given) {
        (Some(claim), Some(given)) if claim != given => Err(ApiError::bad_request(
            "openid is not the one the buyer's token carries",
        )),
        (Some(id), _) | (None, Some(id)) => Ok(Some(id)),
        (None, None) => Err(ApiError::new(
            ErrorCode::OpenidRequired,
            "a WeChat Pay JSAPI payment needs the buyer's openid: in the token or the body",
        )),
    }
}

/// Closes an earlier failed payment at its provider and applies what the
/// provider then says (a capture that came first pays the order, or is
/// refunded).
async fn close_earlier(state: &AppState, old: repo::Unclosed) -> Result<(), ApiError> {
    let provider = state
        .payments
        .providers
        .get(&old.provider)
        .cloned()
        .ok_or_else(|| unconfigured(&old.provider))?;
    let payment = PaymentRef {
        payment_no: old.payment_no,
        provider_ref: old.provider_ref,
    };
    let charge = sweeper::close(provider.as_ref(), &state.metrics, &payment)
        .await
        .map_err(|e| {
            tracing::info!(error = %e, payment_no = old.payment_no, "pay: an earlier payment could not be closed yet");
            provider_unavailable("the payment provider did not close the earlier payment; pay again")
        })?;
    sweeper::apply_charge(
        &state.pg.db,
        &state.metrics,
        &state.redis.order_events,
        provider.name(),
        charge,
    )
    .await
    .map_err(ApiError::unavailable)?;
    Ok(())
}

/// 503 `RETRY_LATER` with `Retry-After`: the provider did not give an
/// answer to act on.
fn provider_unavailable(message: &'static str) -> ApiError {
    ApiError::new(ErrorCode::RetryLater, message).with_retry_after(2)
}

/// 503: a payment of a provider this server is not configured for (an
/// operator must configure every provider with open payments).
fn unconfigured(provider: &str) -> ApiError {
    tracing::error!(
        provider,
        "a payment of a provider not configured here: configure it (docs/OPERATIONS.md)"
    );
    ApiError::new(
        ErrorCode::RetryLater,
        format!("the payment's provider {provider} is not configured here"),
    )
    .with_retry_after(30)
}

/// The answer to a pay call.
#[derive(Debug, Serialize, ToSchema)]
pub struct PayAnswer {
    /// Decimal string.
    payment_no: String,
    /// Decimal string.
    order_no: String,
    amount_cents: i64,
    /// PENDING
    status: String,
    /// mock | external | wechatpay | stripe: the payment's provider
    provider: &'static str,
    /// `code_url` (WeChat Pay Native), `jsapi` (WeChat Pay JSAPI) or
    /// `client_secret` (Stripe), when the provider gave one.
    #[serde(flatten)]
    #[schema(value_type = Object)]
    checkout: Checkout,
}

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

/// `POST /api/v1/dev/payments/{payment_no}/simulate` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Simulate {
    /// `SUCCESS` or `FAILED`.
    #[serde(default = "success")]
    #[schema(default = "SUCCESS", pattern = "^(SUCCESS|FAILED)$")]
    status: String,
    /// How many copies of the callback to deliver (1..=20).
    #[serde(default = "one")]
    #[schema(default = 1, minimum = 1, maximum = 20)]
    times: u32,
}

fn success() -> String {
    PaymentStatus::Success.as_str().into()
}

fn one() -> u32 {
    1
}

/// The mock provider delivers `times` signed callbacks for one of the
/// caller's payments, over HTTP to this server, like a real provider would.
#[utoipa::path(post, path = "/api/v1/dev/payments/{payment_no}/simulate", tag = "dev",
    params(("payment_no" = String, Path, description = "payment number (decimal)")),
    request_body = Simulate,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "the callbacks sent and each one's status", body = Delivered),
        (status = 400, description = "BAD_REQUEST: a malformed body, path or query", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn simulate(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<String>,
    body: web::Json<Simulate>,
) -> Result<HttpResponse, ApiError> {
    let Some(mock) = state.payments.mock.as_ref() else {
        return Err(ApiError::not_found("no such route"));
    };
    let body = body.into_inner();
    if !PaymentStatus::is_callback_status(&body.status) {
        return Err(ApiError::bad_request("status must be SUCCESS or FAILED"));
    }
    if !(1..=20).contains(&body.times) {
        return Err(ApiError::bad_request("times must be 1..=20"));
    }
    let payment_no = crate::http::id_in_path(&path, PaymentNo::parse, "no such payment")?;
    let user_id = user.user_id;
    let payment = store::run(&state.pg.db, move |conn| {
        Ok(repo::find_for_user(conn, payment_no, user_id)?)
    })
    .await
    .map_err(ApiError::unavailable)?
    .ok_or_else(|| ApiError::not_found("no such payment"))?;
    let callback = Callback {
        payment_no: payment.payment_no.to_string(),
        order_no: payment.order_no.to_string(),
        amount_cents: payment.amount_cents,
        status: body.status,
        provider_txn_id: Some(format!("mock-{}", payment.payment_no)),
        paid_at: Some(state.clock.now()),
    };
    let url = format!("{}/api/v1/payments/notify", state.payments.self_url);
    let mut statuses = Vec::with_capacity(body.times as usize);
    for _ in 0..body.times {
        let (bytes, header) = mock.signed_callback(&callback, state.clock.now());
        let sent = state
            .payments
            .http
            .post(&url)
            .header("content-type", "application/json")
            .header("x-pay-signature", header)
            .body(bytes)
            .send()
            .await;
        statuses.push(sent.map(|r| r.status().as_u16()).unwrap_or(0));
    }
    Ok(HttpResponse::Ok().json(Delivered {
        delivered: statuses.len(),
        responses: statuses,
    }))
}

/// The answer a provider expects to a callback it sent.
#[derive(Debug, Serialize, ToSchema)]
pub struct NotifyAnswer {
    /// Always SUCCESS: the callback is applied, whatever it said.
    code: &'static str,
}

/// What the mock provider delivered.
#[derive(Debug, Serialize, ToSchema)]
pub struct Delivered {
    /// Callbacks sent.
    delivered: usize,
    /// Each callback's HTTP status (0: not answered).
    responses: Vec<u16>,
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

/// `POST /api/v1/payments/notify/wechatpay`: WeChat Pay API v3 payment and
/// refund callbacks. Verified (`Wechatpay-Timestamp`, `-Nonce`,
/// `-Signature`, `-Serial`) and decrypted before anything is read; applied
/// once (a repeat is a duplicate). 204 when applied or a duplicate; 4xx/5xx
/// with `{"code": "FAIL", "message"}` when WeChat Pay must send it again.
#[utoipa::path(post, path = "/api/v1/payments/notify/wechatpay", tag = "payments",
    responses(
        (status = 204, description = "applied, or applied before"),
        (status = 401, description = "FAIL: the signature, its key serial or its timestamp is not accepted; nothing changed", body = ProviderFail),
        (status = 400, description = "FAIL: the body or its resource cannot be read, or the amount differs; nothing changed", body = ProviderFail),
        (status = 404, description = "FAIL: no such payment or refund here; NOT_FOUND (a problem) when WeChat Pay is not this server's provider", content(
            (ProviderFail = "application/json"),
            (Problem = "application/problem+json"),
        )),
        (status = 503, description = "FAIL: the database is unavailable; send it again", body = ProviderFail),
    ))]
pub async fn notify_wechatpay(
    state: web::Data<AppState>,
    req: HttpRequest,
    body: web::Bytes,
) -> HttpResponse {
    provider_notify(&state, &req, &body, ProviderKind::Wechatpay).await
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

/// `POST /api/v1/payments/notify/stripe`: Stripe-style webhooks, verified
/// by `Stripe-Signature: t=…,v1=…` within `payment.signature_tolerance_secs`
/// before anything is read, applied once. 204 when applied, a duplicate,
/// or an event this server does not act on; 4xx/5xx (Stripe sends it
/// again) otherwise.
#[utoipa::path(post, path = "/api/v1/payments/notify/stripe", tag = "payments",
    params(("Stripe-Signature" = String, Header, description = "t=<unix seconds>,v1=<hex HMAC-SHA256 of t.body>")),
    responses(
        (status = 204, description = "applied, a duplicate, or not acted on"),
        (status = 401, description = "FAIL: the signature or its timestamp is not accepted; nothing changed", body = ProviderFail),
        (status = 400, description = "FAIL: the body cannot be read, or the amount differs; nothing changed", body = ProviderFail),
        (status = 404, description = "FAIL: no such payment or refund here; NOT_FOUND (a problem) when Stripe is not this server's provider", content(
            (ProviderFail = "application/json"),
            (Problem = "application/problem+json"),
        )),
        (status = 503, description = "FAIL: the database is unavailable; send it again", body = ProviderFail),
    ))]
pub async fn notify_stripe(
    state: web::Data<AppState>,
    req: HttpRequest,
    body: web::Bytes,
) -> HttpResponse {
    provider_notify(&state, &req, &body, ProviderKind::Stripe).await
}

/// `POST /api/v1/admin/orders/{order_no}/refund` body.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RefundBody {
    /// Why (kept with the refund, sent to the provider): 1..=80 characters.
    reason: String,
}

/// The answer to an after-sale refund.
#[derive(Debug, Serialize, ToSchema)]
pub struct RefundAnswer {
    /// Decimal string.
    refund_no: String,
    /// Decimal string.
    payment_no: String,
    /// REFUNDING, REFUNDED or REFUND_FAILED
    status: String,
}

/// `POST /api/v1/admin/orders/{order_no}/refund` (admin): an after-sale
/// refund of a PAID order, sent through the provider by the sweeper. The
/// same call again returns the same refund. The order stays PAID and its
/// units sold (docs/SPEC.md, "Refunds").
#[utoipa::path(post, path = "/api/v1/admin/orders/{order_no}/refund", tag = "payments",
    params(("order_no" = String, Path, description = "order number (decimal)")),
    request_body = RefundBody,
    security(("bearer" = [])),
    responses(
        (status = 202, description = "the refund, under way (or as it stands)", body = RefundAnswer),
        (status = 400, description = "BAD_REQUEST: a malformed body or reason", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "FORBIDDEN: not an admin", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "INVALID_STATE: the order is not PAID", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn refund(
    _admin: AdminUser,
    state: web::Data<AppState>,
    path: web::Path<String>,
    body: web::Json<RefundBody>,
) -> Result<HttpResponse, ApiError> {
    let order_no = crate::http::id_in_path(&path, OrderNo::parse, "no such order")?;
    let reason = body.into_inner().reason;
    let chars = reason.trim().chars().count();
    if chars == 0 || chars > 80 {
        return Err(ApiError::bad_request("reason must be 1..=80 characters"));
    }
    let after_sale = store::run(&state.pg.db, move |conn| {
        Ok(repo::refund_paid_order(
            conn,
            order_no.get(),
            reason.trim(),
        )?)
    })
    .await
    .map_err(ApiError::unavailable)?;
    match after_sale {
        AfterSale::NotFound => Err(ApiError::not_found("no such order")),
        AfterSale::InvalidState => Err(ApiError::new(
            ErrorCode::InvalidState,
            "only a PAID order can be refunded",
        )),
        AfterSale::Refund(r) => Ok(HttpResponse::Accepted().json(RefundAnswer {
            refund_no: r.refund_no.to_string(),
            payment_no: r.payment_no.to_string(),
            status: r.status,
        })),
    }
}

/// `POST /api/v1/admin/payments/statement` body.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StatementBody {
    /// The day (the provider's; China's for WeChat Pay), `YYYY-MM-DD`;
    /// yesterday when absent.
    #[schema(value_type = Option<String>, format = Date)]
    date: Option<chrono::NaiveDate>,
}

/// `POST /api/v1/admin/payments/statement` (admin): reconciles the
/// provider's statement of a day with our payments now, and keeps the
/// report (the sweeper does it daily for yesterday).
#[utoipa::path(post, path = "/api/v1/admin/payments/statement", tag = "payments",
    request_body = StatementBody,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "the report: missing_here, missing_there, mismatched"),
        (status = 400, description = "BAD_REQUEST: a malformed body, or a day not over yet", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "FORBIDDEN: not an admin", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "INVALID_STATE: the provider has no statement of that day", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: the provider or the database did not answer", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn statement(
    _admin: AdminUser,
    state: web::Data<AppState>,
    body: web::Json<StatementBody>,
) -> Result<HttpResponse, ApiError> {
    let now = state.clock.now();
    let date = body
        .into_inner()
        .date
        .unwrap_or_else(|| statement::yesterday(now));
    if date
        > now
            .with_timezone(
                &chrono::FixedOffset::east_opt(8 * 3600).unwrap_or_else(|| unreachable!()),
            )
            .date_naive()
    {
        return Err(ApiError::bad_request("that day has not come yet"));
    }
    let Some(provider) = state.payments.providers.get("wechatpay").cloned() else {
        return Err(ApiError::new(
            ErrorCode::InvalidState,
            "no provider configured here publishes a statement",
        ));
    };
    match statement::run(&state.pg.db, provider.as_ref(), date).await {
        Ok(report) => Ok(HttpResponse::Ok().json(report)),
        Err(e) => match e.downcast_ref::<ProviderError>() {
            Some(ProviderError::Refused { code, message }) => Err(ApiError::new(
                ErrorCode::InvalidState,
                format!("no statement of {date} ({code}): {message}"),
            )),
            _ => Err(ApiError::unavailable(e)),
        },
    }
}

/// `GET /api/v1/admin/payments/statements` (admin): the latest reports kept.
#[utoipa::path(get, path = "/api/v1/admin/payments/statements", tag = "payments",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "{reports: [...]}, newest day first"),
        (status = 401, description = "UNAUTHORIZED", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "FORBIDDEN: not an admin", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: the database is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn statements(
    _admin: AdminUser,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let reports = store::run(&state.pg.db, |conn| Ok(statement::latest(conn, 14)?))
        .await
        .map_err(ApiError::unavailable)?;
    Ok(HttpResponse::Ok().json(serde_json::json!({ "reports": reports })))
}

/// `GET /api/v1/orders/{order_no}/pay/qr` (the order's owner): the WeChat
/// Pay Native `code_url` of the order's pending payment as an SVG QR code,
/// for the buyer's phone to scan.
#[utoipa::path(get, path = "/api/v1/orders/{order_no}/pay/qr", tag = "payments",
    params(("order_no" = String, Path, description = "order number (decimal)")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "image/svg+xml: the QR code of the payment's code_url"),
        (status = 401, description = "UNAUTHORIZED", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND: no such order of the caller, or no pending payment with a code_url", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: the database is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn pay_qr(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let order_no = crate::http::id_in_path(&path, OrderNo::parse, "no such order")?;
    let user_id = user.user_id;
    let code_url = store::run(&state.pg.db, move |conn| {
        Ok(repo::pending_code_url(conn, order_no, user_id)?)
    })
    .await
    .map_err(ApiError::unavailable)?
    .ok_or_else(|| ApiError::not_found("no pending payment with a code_url"))?;
    let code = qrcode::QrCode::new(code_url.as_bytes())
        .map_err(|e| ApiError::not_found(format!("no QR code for it: {e}")))?;
    let svg = code
        .render::<qrcode::render::svg::Color>()
        .min_dimensions(200, 200)
        .build();
    Ok(HttpResponse::Ok()
        .content_type("image/svg+xml")
        .insert_header(("cache-control", "no-store"))
        .body(svg))
}
