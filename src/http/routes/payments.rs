//! `POST /orders/{no}/pay`, `POST /payments/notify` and the mock provider's
//! `POST /dev/payments/{no}/simulate`.

use actix_web::{HttpRequest, HttpResponse, web};
use secrecy::ExposeSecret;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::http::auth::AuthUser;
use crate::http::error::{ApiError, ErrorCode, Problem};
use crate::ids::{OrderNo, PaymentNo};
use crate::orders::OrderStatus;
use crate::orders::events::StatusChange;
use crate::payments::PaymentStatus;
use crate::payments::provider::Callback;
use crate::payments::repo::{self, CallbackOutcome, PayIntent};
use crate::payments::signature;
use crate::state::AppState;
use crate::store;

/// `POST /api/v1/orders/{order_no}/pay`: the pending payment of a
/// WAITING_PAY order (created on the first call, returned on later ones).
#[utoipa::path(post, path = "/api/v1/orders/{order_no}/pay", tag = "payments",
    params(("order_no" = String, Path, description = "order number (decimal)")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "payment_no, order_no, amount_cents, status PENDING"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "INVALID_STATE", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn pay(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let order_no = crate::http::id_in_path(&path, OrderNo::parse, "no such order")?;
    let user_id = user.user_id;
    // Under the leased instance id; without one (Redis down, the lease
    // run out) the database makes the number, so an order sold through
    // the fallback can still be paid before its deadline.
    let leased = state.sale.ids.next_id();
    let provider = state.payments.provider.name();
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
            provider,
        )?)
    })
    .await
    .map_err(ApiError::unavailable)?;
    match intent {
        PayIntent::NotFound => Err(ApiError::not_found("no such order")),
        PayIntent::InvalidState => Err(ApiError::new(
            ErrorCode::InvalidState,
            "only a WAITING_PAY order can be paid",
        )),
        PayIntent::Pending(p) => Ok(HttpResponse::Ok().json(p)),
    }
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
    let outcome = store::run(&state.pg.db, move |conn| {
        Ok(repo::apply_callback(conn, payment_no, order_no, &cb)?)
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
        | CallbackOutcome::MarkedFailed => Ok(HttpResponse::Ok().json(NotifyAnswer {
            code: PaymentStatus::Success.as_str(),
        })),
        CallbackOutcome::UnknownPayment => Err(ApiError::not_found("no such payment")),
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
