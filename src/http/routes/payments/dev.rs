//! The mock provider's `POST /dev/payments/{no}/simulate`, development only.

use actix_web::{HttpResponse, web};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::http::auth::AuthUser;
use crate::http::error::{ApiError, Problem};
use crate::ids::PaymentNo;
use crate::payments::PaymentStatus;
use crate::payments::provider::Callback;
use crate::payments::repo::{self};
use crate::state::AppState;
use crate::store;

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

/// What the mock provider delivered.
#[derive(Debug, Serialize, ToSchema)]
pub struct Delivered {
    /// Callbacks sent.
    delivered: usize,
    /// Each callback's HTTP status (0: not answered).
    responses: Vec<u16>,
}
