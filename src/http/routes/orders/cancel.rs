//! `POST /orders/{no}/cancel`: the buyer's cancel of an unpaid order.

use actix_web::{HttpResponse, web};

use super::read::{OrderView, order_view};
use crate::http::auth::AuthUser;
use crate::http::error::{ApiError, ErrorCode, Problem};
use crate::ids::OrderNo;
use crate::orders::OrderStatus;
use crate::orders::events::StatusChange;
use crate::state::AppState;
use crate::store;

/// `POST /api/v1/orders/{order_no}/cancel` (SPEC step 6): WAITING_PAY →
/// CANCELLED with its release, once; cancelling a CANCELLED order again is
/// 200 with no effect; any other state is 409 INVALID_STATE.
#[utoipa::path(post, path = "/api/v1/orders/{order_no}/cancel", tag = "orders",
    params(("order_no" = String, Path, description = "order number (decimal)")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "the order, CANCELLED", body = OrderView),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "INVALID_STATE", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn cancel(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let order_no = crate::http::id_in_path(&path, OrderNo::parse, "no such order")?;
    let user_id = user.user_id;
    let note = state.pg.replica.is_some();
    let (outcome, position) = store::run(&state.pg.db, move |conn| {
        let outcome = crate::orders::transitions::cancel_for_user(conn, order_no, user_id)?;
        let position = match note {
            true => Some(crate::replica::insert_position(conn)?),
            false => None,
        };
        Ok((outcome, position))
    })
    .await
    .map_err(ApiError::unavailable)?;
    let order = outcome.ok_or_else(|| ApiError::not_found("no such order"))?;
    if let (Some(replica), Some(position)) = (&state.pg.replica, position) {
        replica.note(user_id, position).await;
    }
    if order.status != OrderStatus::Cancelled {
        return Err(ApiError::new(
            ErrorCode::InvalidState,
            "only a WAITING_PAY order can be cancelled",
        ));
    }
    let change = StatusChange {
        order_no: order.order_no,
        status: OrderStatus::Cancelled,
    };
    state.redis.order_events.publish(&[change]).await;
    Ok(HttpResponse::Ok().json(order_view(&order)))
}
