//! Reading orders: one order (`GET /orders/{no}`), the buyer's list, and
//! the lookup the event streams share (the row, else Redis's reservation).

use actix_web::{HttpResponse, web};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::admission::Layout;
use crate::admission::gate::Reservation;
use crate::domain::{ActivityId, CouponId, UserId};
use crate::http::auth::AuthUser;
use crate::http::error::{ApiError, Problem};
use crate::ids::OrderNo;
use crate::orders::OrderStatus;
use crate::orders::repo::{self, Order};
use crate::state::AppState;
use crate::store;

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

pub(super) fn order_view(o: &Order) -> OrderView {
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
pub(in crate::http::routes) enum Found {
    Row(Order),
    Reserved {
        activity_id: ActivityId,
        layout: Layout,
        r: Reservation,
    },
}

impl Found {
    /// The order's status.
    pub(in crate::http::routes) fn status(&self) -> OrderStatus {
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
pub(in crate::http::routes) async fn find_read(
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
pub(in crate::http::routes) async fn find(
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
