//! An admin's after-sale refund, and the daily statements.

use actix_web::{HttpResponse, web};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::http::auth::AdminUser;
use crate::http::error::{ApiError, ErrorCode, Problem};
use crate::ids::OrderNo;
use crate::payments::provider::ProviderError;
use crate::payments::repo::AfterSale;
use crate::payments::repo::{self};
use crate::payments::statement;
use crate::state::AppState;
use crate::store;

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
