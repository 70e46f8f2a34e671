//! `POST /activities/{id}/orders`: a purchase, its answer, and the
//! client address its rate bucket is charged to.

use std::net::IpAddr;

use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse, web};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::admission::admit::{Admitted, Purchase, Refusal};
use crate::admission::{Layout, ThreadGate};
use crate::domain::{ActivityId, CouponId, RequestId, UserId};
use crate::http::auth::AuthUser;
use crate::http::error::{ApiError, ErrorCode, Problem};
use crate::ids::OrderNo;
use crate::orders::OrderStatus;
use crate::orders::repo::{self};
use crate::state::AppState;
use crate::store;

/// The purchase body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PlaceOrder {
    /// The client's key for this purchase: a retry with the same one gets
    /// the same order (1..=64 printable ASCII).
    #[schema(min_length = 1, max_length = 64)]
    request_id: String,
    /// The one-time purchase token (`GET …/token`), when the activity asks for one.
    token: Option<String>,
    /// Units, 1 by default, at most the activity's per-user limit.
    #[schema(minimum = 1)]
    quantity: Option<i32>,
    /// A claimed coupon to pay with.
    #[schema(value_type = Option<i64>)]
    coupon_id: Option<CouponId>,
}

impl PlaceOrder {
    /// The purchase this body asks for (400 if its request_id is not one).
    fn purchase(
        self,
        activity_id: ActivityId,
        user_id: UserId,
        client_ip: Option<IpAddr>,
    ) -> Result<Purchase, ApiError> {
        let request_id = RequestId::parse_owned(self.request_id).ok_or_else(|| {
            ApiError::bad_request("request_id must be 1..=64 printable ASCII characters")
        })?;
        Ok(Purchase {
            activity_id,
            user_id,
            client_ip,
            request_id,
            quantity: self.quantity.unwrap_or(1),
            token: self.token,
            coupon_id: self.coupon_id,
        })
    }
}

/// The client address: the `X-Forwarded-For` entry `hops` from the right
/// (each trusted proxy appended the address it was connected from, so the
/// entries left of that are whatever the client wrote), or the peer address
/// with no trusted proxy or no usable header.
fn client_ip(req: &HttpRequest, hops: usize) -> Option<IpAddr> {
    let peer = req.peer_addr().map(|a| a.ip());
    if hops == 0 {
        return peer;
    }
    let headers = req.headers().get_all("x-forwarded-for");
    let values: Vec<&str> = headers.filter_map(|v| v.to_str().ok()).collect();
    forwarded_client(&values, hops).or(peer)
}

/// The entry `hops` from the right of the `X-Forwarded-For` values (in
/// header order); fewer entries than hops: the leftmost, which a trusted
/// proxy wrote. `None` if there are none or it is not an address.
fn forwarded_client(values: &[&str], hops: usize) -> Option<IpAddr> {
    let entries: Vec<&str> = values
        .iter()
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .collect();
    let entry = entries.get(entries.len().saturating_sub(hops))?;
    entry
        .parse::<IpAddr>()
        .ok()
        .or_else(|| entry.parse::<std::net::SocketAddr>().ok().map(|a| a.ip()))
}

/// SPEC steps 1–2 (`admission::admit`): 202 once the broker has the
/// order; a replayed request_id answers with its order's status.
#[utoipa::path(post, path = "/api/v1/activities/{id}/orders", tag = "orders",
    params(("id" = i64, Path, description = "activity id")),
    request_body = PlaceOrder,
    security(("bearer" = [])),
    responses(
        (status = 202, description = "order_no, request_id, status PROCESSING; or, written by the database fallback while Redis is down, status WAITING_PAY with the header X-Seckill-Admission: database", body = Placed,
            headers(("X-Seckill-Admission" = String, description = "`database` when the database fallback wrote the order"))),
        (status = 200, description = "a replayed request_id: its order and status", body = Placed),
        (status = 400, description = "BAD_REQUEST: a malformed body, path or query", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "INVALID_TOKEN", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "NOT_ACTIVE, SOLD_OUT or LIMIT_EXCEEDED", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "RATE_LIMITED", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "BUSY, NOT_READY or RETRY_LATER (with order_no when the order is kept)", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn place(
    user: AuthUser,
    state: web::Data<AppState>,
    gate: web::Data<ThreadGate>,
    path: web::Path<ActivityId>,
    req: HttpRequest,
    body: web::Json<PlaceOrder>,
) -> Result<HttpResponse, ApiError> {
    let activity_id = path.into_inner();
    let ip = client_ip(&req, state.settings.forwarded_hops());
    let purchase = body.into_inner().purchase(activity_id, user.user_id, ip)?;
    let mut through_database = false;
    let (code, order_no, status) = match state.sale.admission.admit(&gate.0, &purchase).await {
        Ok(Admitted::Accepted(no)) => (StatusCode::ACCEPTED, no, OrderStatus::Processing),
        Ok(Admitted::Fallback(no)) => {
            through_database = true;
            (StatusCode::ACCEPTED, no, OrderStatus::WaitingPay)
        }
        Ok(Admitted::Replayed {
            order_no,
            confirmed_now: true,
            ..
        }) => (StatusCode::ACCEPTED, order_no, OrderStatus::Processing),
        Ok(Admitted::Replayed {
            order_no, layout, ..
        }) => {
            let status = current_status(&state, (activity_id, layout), order_no, user.user_id);
            (StatusCode::OK, order_no, status.await?)
        }
        Err(refusal) => return Err(refused(refusal)),
    };
    if !through_database {
        // A ticket of the activity's waiting room that bought leaves its
        // waitlist before the buyer hears so (one script call, for rooms
        // only). A mark that fails leaves a ticket that may be offered a
        // unit again, nothing more: the purchase stands.
        if let Err(e) = state.sale.rooms.bought(activity_id, user.user_id).await {
            tracing::warn!(error = %e, %activity_id, "marking a waiting-room ticket bought failed");
        }
    }
    let mut answer = HttpResponse::build(code);
    if through_database {
        // Redis was down: the order was written by the database fallback.
        answer.insert_header((ADMISSION_HEADER, "database"));
    }
    Ok(answer.json(Placed {
        order_no: order_no.to_string(),
        request_id: purchase.request_id.as_str(),
        status,
    }))
}

/// Marks a 202 whose order the database fallback wrote (Redis was down).
pub const ADMISSION_HEADER: &str = "X-Seckill-Admission";

/// The one mapping from a refused purchase to its answer; a 429 or 503
/// says when to retry (`Retry-After`).
fn refused(refusal: Refusal) -> ApiError {
    let retry_after = refusal.retry_after();
    let error = answer(refusal);
    match retry_after {
        Some(secs) => error.with_retry_after(secs),
        None => error,
    }
}

fn answer(refusal: Refusal) -> ApiError {
    use ErrorCode::{Busy, RetryLater};
    match refusal {
        Refusal::Invalid(why) => ApiError::bad_request(why),
        Refusal::RateLimited(why, _) => ApiError::new(ErrorCode::RateLimited, why),
        Refusal::FallbackRateLimited(_) => ApiError::new(
            ErrorCode::RateLimited,
            "too many purchases for this activity while Redis is down",
        ),
        Refusal::NotActive => ApiError::new(ErrorCode::NotActive, "the sale is not open"),
        Refusal::Restoring => {
            ApiError::new(RetryLater, "the sale is being restored; retry shortly")
        }
        Refusal::Degraded(why, _) => ApiError::new(RetryLater, why),
        Refusal::SoldOut { .. } => ApiError::new(ErrorCode::SoldOut, "sold out"),
        Refusal::CouponInvalid(why) => ApiError::new(ErrorCode::CouponInvalid, why),
        Refusal::Busy(why, _) => ApiError::new(Busy, why),
        Refusal::WritesRefused(_) => ApiError::new(
            RetryLater,
            "the brokers refuse writes (too few in-sync replicas); retry shortly",
        ),
        Refusal::NoOrderNumber => ApiError::new(
            RetryLater,
            "no order number can be made right now; retry shortly",
        ),
        Refusal::LimitExceeded => ApiError::new(
            ErrorCode::LimitExceeded,
            "you already hold the per-user limit",
        ),
        Refusal::InvalidToken => ApiError::new(
            ErrorCode::InvalidToken,
            "purchase token missing, used, expired or not yours",
        ),
        Refusal::NumberTaken => ApiError::new(RetryLater, "the order number was taken; retry"),
        Refusal::NotQueued => ApiError::new(
            RetryLater,
            "the order could not be queued; nothing was kept",
        ),
        Refusal::Pending(order_no) => ApiError::new(
            RetryLater,
            "the order is not confirmed yet; retry with the same request_id",
        )
        .with_order_no(order_no.get()),
        Refusal::ReserveFailed(e) | Refusal::Unavailable(e) => ApiError::unavailable(e),
    }
}

/// The status of an order the caller owns: its row, else its reservation.
/// With neither, its fate is unknown (Redis lost the reservation before the
/// row was written: the event may be in the broker yet, or never): 503
/// RETRY_LATER naming it, never a 200 for an order that may not exist.
/// After the restore the request_id is not bound any more, and a retry
/// makes the purchase afresh.
async fn current_status(
    state: &AppState,
    (activity_id, layout): (ActivityId, Layout),
    order_no: OrderNo,
    user_id: UserId,
) -> Result<OrderStatus, ApiError> {
    let note = state.pg.replica.is_some();
    let (row, position) = store::run(&state.pg.db, move |conn| {
        let row = repo::find_for_user(conn, order_no, user_id)?;
        // The buyer is shown this: their next read must not be older.
        let position = match note {
            true => Some(crate::replica::insert_position(conn)?),
            false => None,
        };
        Ok((row, position))
    })
    .await
    .map_err(ApiError::unavailable)?;
    if let (Some(replica), Some(position)) = (&state.pg.replica, position) {
        replica.note(user_id, position).await;
    }
    if let Some(order) = row {
        return Ok(order.status);
    }
    let reservation = state
        .redis
        .gate
        .reservation(activity_id, layout, order_no.get())
        .await
        .map_err(|e| ApiError::unavailable(e.into()))?;
    match reservation {
        Some(r) if r.released() => Ok(OrderStatus::Failed),
        Some(_) => Ok(OrderStatus::Processing),
        None => Err(refused(Refusal::Pending(order_no))),
    }
}

/// A purchase's answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct Placed<'a> {
    order_no: String,
    #[schema(value_type = String)]
    request_id: &'a str,
    /// PROCESSING when accepted; a replay's order as it stands now.
    #[schema(value_type = String)]
    status: OrderStatus,
}

#[cfg(test)]
mod tests {
    use super::forwarded_client;

    fn ip(s: &str) -> Option<std::net::IpAddr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn the_client_is_counted_from_the_right_so_a_spoofed_leftmost_entry_is_ignored() {
        // One proxy: it appended the address it saw; the rest is the client's.
        assert_eq!(
            forwarded_client(&["6.6.6.6, 1.2.3.4, 10.0.0.9"], 1),
            ip("10.0.0.9")
        );
        assert_eq!(
            forwarded_client(&["6.6.6.6, 1.2.3.4, 10.0.0.9"], 2),
            ip("1.2.3.4")
        );
        // Several headers are one list, in order.
        assert_eq!(
            forwarded_client(&["6.6.6.6", "1.2.3.4, 10.0.0.9"], 2),
            ip("1.2.3.4")
        );
        // Fewer entries than proxies: the leftmost, which a proxy wrote.
        assert_eq!(forwarded_client(&["10.0.0.9"], 2), ip("10.0.0.9"));
        assert_eq!(forwarded_client(&["[::1]:443"], 1), ip("::1"));
        assert_eq!(forwarded_client(&["1.2.3.4:80"], 1), ip("1.2.3.4"));
        assert_eq!(forwarded_client(&[], 1), None);
        assert_eq!(forwarded_client(&["garbage"], 1), None);
        assert_eq!(forwarded_client(&[" , "], 1), None);
    }
}
