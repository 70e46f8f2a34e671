//! `POST /api/v1/activities/{id}/orders` (admission + publish) and the
//! order status routes.

use std::net::IpAddr;

use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse, web};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::admission::admit::{Admitted, Purchase, Refusal};
use crate::admission::gate::Reservation;
use crate::admission::{Layout, ThreadGate};
use crate::domain::{ActivityId, CouponId, RequestId, UserId};
use crate::http::auth::AuthUser;
use crate::http::error::{ApiError, ErrorCode, Problem};
use crate::ids::OrderNo;
use crate::orders::OrderStatus;
use crate::orders::events::StatusChange;
use crate::orders::repo::{self, Order};
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
    let row = store::run(&state.pg.db, move |conn| {
        Ok(repo::find_for_user(conn, order_no, user_id)?)
    })
    .await
    .map_err(ApiError::unavailable)?;
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

/// An order as its owner sees it. Before its row exists (PROCESSING, or
/// FAILED when its reservation was released) the figures the row would
/// hold are null.
#[derive(Debug, Serialize, ToSchema)]
pub struct OrderView {
    order_no: String,
    request_id: String,
    #[schema(value_type = i64)]
    activity_id: ActivityId,
    user_id: i64,
    quantity: i32,
    amount_cents: Option<i64>,
    #[schema(value_type = Option<i64>)]
    coupon_id: Option<CouponId>,
    /// PROCESSING, WAITING_PAY, PAID, CANCELLED, CLOSED or FAILED.
    #[schema(value_type = String)]
    status: OrderStatus,
    pay_deadline: Option<DateTime<Utc>>,
    created_at: Option<DateTime<Utc>>,
    paid_at: Option<DateTime<Utc>>,
    failure_reason: Option<String>,
    /// The order's payment (`GET /orders/{order_no}` only): null before
    /// pay.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::payments::repo::PaymentView>)]
    payment: Option<Option<crate::payments::repo::PaymentView>>,
}

/// A page of the caller's orders.
#[derive(Debug, Serialize, ToSchema)]
pub struct OrderList {
    orders: Vec<OrderView>,
    /// The `cursor` of the next page, while there may be more.
    next_cursor: Option<String>,
}

fn order_view(o: &Order) -> OrderView {
    OrderView {
        order_no: o.order_no.to_string(),
        request_id: o.request_id.clone(),
        activity_id: o.activity_id,
        user_id: o.user_id,
        quantity: o.quantity,
        amount_cents: Some(o.amount_cents),
        coupon_id: o.coupon_id,
        status: o.status,
        pay_deadline: o.pay_deadline,
        created_at: Some(o.created_at),
        paid_at: o.paid_at,
        failure_reason: o.failure_reason.clone(),
        payment: None,
    }
}

/// `GET /api/v1/orders/{order_no}` (SPEC step 8): the row, else the Redis
/// reservation (PROCESSING, or FAILED when released), else 404. Another
/// user's order is 404 too.
#[utoipa::path(get, path = "/api/v1/orders/{order_no}", tag = "orders",
    params(("order_no" = String, Path, description = "order number (decimal)")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "the order", body = OrderView),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn show(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let order_no = crate::http::id_in_path(&path, OrderNo::parse, "no such order")?;
    let user_id = user.user_id;
    let (found, db) = find_read(&state, &state.pg.db, order_no, user_id).await?;
    let found = found.ok_or_else(|| ApiError::not_found("no such order"))?;
    Ok(HttpResponse::Ok().json(match found {
        Found::Row(order) => {
            let no = order.order_no;
            let payment = store::run(&db, move |conn| {
                Ok(crate::payments::repo::view_for_order(conn, no)?)
            })
            .await
            .map_err(ApiError::unavailable)?;
            OrderView {
                payment: Some(payment),
                ..order_view(&order)
            }
        }
        Found::Reserved { activity_id, r, .. } => OrderView {
            order_no: order_no.to_string(),
            status: found_status(&r),
            failure_reason: r.released().then(|| "RESERVATION_RELEASED".to_owned()),
            request_id: r.request_id,
            activity_id,
            user_id: user_id.get(),
            quantity: r.quantity,
            amount_cents: None,
            coupon_id: None,
            pay_deadline: None,
            created_at: None,
            paid_at: None,
            payment: Some(None),
        },
    }))
}

/// Where the caller's order was found: its row, or (before the row exists)
/// its reservation in Redis.
pub(super) enum Found {
    Row(Order),
    Reserved {
        activity_id: ActivityId,
        layout: Layout,
        r: Reservation,
    },
}

impl Found {
    /// The order's status.
    pub(super) fn status(&self) -> OrderStatus {
        match self {
            Self::Row(order) => order.status,
            Self::Reserved { r, .. } => found_status(r),
        }
    }
}

/// A reservation without its row: PROCESSING, or FAILED once released.
fn found_status(r: &Reservation) -> OrderStatus {
    if r.released() {
        OrderStatus::Failed
    } else {
        OrderStatus::Processing
    }
}

/// [`find`], read from the replica when `postgres.replica_url` is set and
/// it has replayed all the caller was shown (`replica`), else from
/// `primary`; with the pool it was read from. On the replica, an order
/// without its row is PROCESSING when Redis holds its live reservation
/// (what the 202 said), and is asked of the primary otherwise: lag never
/// answers "no such order", nor FAILED for a row not replayed yet.
pub(super) async fn find_read(
    state: &AppState,
    primary: &store::PgPool,
    order_no: OrderNo,
    user_id: UserId,
) -> Result<(Option<Found>, store::PgPool), ApiError> {
    let Some(replica) = &state.pg.replica else {
        return Ok((
            find(state, primary, order_no, user_id, None).await?,
            primary.clone(),
        ));
    };
    if let Some(pool) = replica.pool_for(user_id).await {
        match find(state, pool, order_no, user_id, None).await {
            Ok(Some(found @ Found::Row(_))) => {
                replica.count("replica");
                return Ok((Some(found), pool.clone()));
            }
            Ok(Some(found @ Found::Reserved { .. }))
                if found.status() == OrderStatus::Processing =>
            {
                replica.count("redis");
                return Ok((Some(found), pool.clone()));
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(error = ?e, "an order read on the replica failed; reading the primary")
            }
        }
    }
    let (found, position) = find_noting(state, primary, order_no, user_id, None, true).await?;
    replica.count("primary");
    if let Some(position) = position {
        replica.note(user_id, position).await;
    }
    Ok((found, primary.clone()))
}

/// The caller's order (SPEC step 8): the row, else the reservation in one
/// of the recent activities (or in `activity`, when it is known); `None`
/// when there is neither, or it is another user's.
pub(super) async fn find(
    state: &AppState,
    db: &store::PgPool,
    order_no: OrderNo,
    user_id: UserId,
    activity: Option<(ActivityId, Layout)>,
) -> Result<Option<Found>, ApiError> {
    Ok(find_noting(state, db, order_no, user_id, activity, false)
        .await?
        .0)
}

/// [`find`]; with `note`, also the primary's WAL position after the read,
/// on the same connection (`replica::insert_position`).
async fn find_noting(
    state: &AppState,
    db: &store::PgPool,
    order_no: OrderNo,
    user_id: UserId,
    activity: Option<(ActivityId, Layout)>,
    note: bool,
) -> Result<(Option<Found>, Option<i64>), ApiError> {
    let now = state.clock.now();
    let (row, recent, position) = store::run(db, move |conn| {
        let row = repo::find_for_user(conn, order_no, user_id)?;
        let recent = match (&row, activity) {
            (Some(_), _) => Vec::new(),
            (None, Some(known)) => vec![known],
            (None, None) => {
                crate::activities::repo::recent_ids(conn, now - chrono::Duration::days(7))?
            }
        };
        let position = match note {
            true => Some(crate::replica::insert_position(conn)?),
            false => None,
        };
        Ok((row, recent, position))
    })
    .await
    .map_err(ApiError::unavailable)?;
    if let Some(order) = row {
        return Ok((Some(Found::Row(order)), position));
    }
    for (activity_id, layout) in recent {
        let reservation = state
            .redis
            .gate
            .reservation(activity_id, layout, order_no.get())
            .await
            .map_err(|e| ApiError::unavailable(e.into()))?;
        let Some(r) = reservation else { continue };
        if r.user_id != user_id.get() {
            return Ok((None, position));
        }
        return Ok((
            Some(Found::Reserved {
                activity_id,
                layout,
                r,
            }),
            position,
        ));
    }
    Ok((None, position))
}

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

/// `GET /api/v1/orders` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only orders in this state.
    status: Option<String>,
    /// Page size, 1..=100 (20 by default).
    #[param(minimum = 1, maximum = 100)]
    limit: Option<i64>,
    /// `next_cursor` of the previous page.
    cursor: Option<String>,
}

/// `GET /api/v1/orders?status=&limit=&cursor=`: the caller's orders, newest first.
#[utoipa::path(get, path = "/api/v1/orders", tag = "orders",
    params(ListQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "orders, next_cursor", body = OrderList),
        (status = 400, description = "BAD_REQUEST: a malformed body, path or query", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn list(
    user: AuthUser,
    state: web::Data<AppState>,
    query: web::Query<ListQuery>,
) -> Result<HttpResponse, ApiError> {
    let q = query.into_inner();
    let limit = q.limit.unwrap_or(20);
    if !(1..=100).contains(&limit) {
        return Err(ApiError::bad_request("limit must be 1..=100"));
    }
    let status = match q.status.as_deref().filter(|s| !s.is_empty()) {
        None => None,
        Some(s) => match OrderStatus::parse(s) {
            Some(OrderStatus::Processing) => {
                // PROCESSING orders live in Redis only; none is listed here.
                return Ok(HttpResponse::Ok().json(OrderList {
                    orders: Vec::new(),
                    next_cursor: None,
                }));
            }
            Some(status) => Some(status),
            None => return Err(ApiError::bad_request("unknown status")),
        },
    };
    let cursor = match q.cursor.as_deref().filter(|c| !c.is_empty()) {
        None => None,
        Some(c) => Some(OrderNo::parse(c).ok_or_else(|| ApiError::bad_request("bad cursor"))?),
    };
    let user_id = user.user_id;
    let replica = state.pg.replica.as_deref();
    let note = replica.is_some();
    let read = move |conn: &mut store::PgConn| {
        let orders = repo::list_for_user(conn, user_id, status, cursor, limit)?;
        // On the primary, the position after the read (replica notes).
        let position = match note {
            true => Some(crate::replica::insert_position(conn)?),
            false => None,
        };
        Ok((orders, position))
    };
    let mut listed = None;
    if let Some(pool) = match replica {
        Some(r) => r.pool_for(user_id).await,
        None => None,
    } {
        let on_replica = move |conn: &mut store::PgConn| {
            Ok(repo::list_for_user(conn, user_id, status, cursor, limit)?)
        };
        match store::run(pool, on_replica).await {
            Ok(orders) => listed = Some(orders),
            Err(e) => {
                tracing::debug!(error = ?e, "a list on the replica failed; reading the primary")
            }
        }
    }
    let orders = match listed {
        Some(orders) => {
            replica.inspect(|r| r.count("replica"));
            orders
        }
        None => {
            let (orders, position) = store::run(&state.pg.db, read)
                .await
                .map_err(ApiError::unavailable)?;
            if let Some(r) = replica {
                r.count("primary");
                if let Some(position) = position {
                    r.note(user_id, position).await;
                }
            }
            orders
        }
    };
    let next_cursor = match orders.last() {
        Some(last) if orders.len() as i64 == limit => Some(last.order_no.to_string()),
        _ => None,
    };
    Ok(HttpResponse::Ok().json(OrderList {
        orders: orders.iter().map(order_view).collect(),
        next_cursor,
    }))
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
