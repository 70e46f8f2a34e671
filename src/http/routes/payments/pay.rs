//! `POST /orders/{no}/pay` and its QR code: the pending payment of an
//! order, made at its provider under our payment number.

use actix_web::{HttpRequest, HttpResponse, web};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::http::auth::AuthUser;
use crate::http::error::{ApiError, ErrorCode, Problem};
use crate::ids::{OrderNo, PaymentNo};
use crate::payments::provider::{Checkout, NewPayment, PaymentRef, ProviderError};
use crate::payments::repo::{self, PayIntent};
use crate::payments::sweeper;
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
