//! `POST /api/v1/activities/{id}/orders` (admission + publish) and the
//! order status routes.

use std::net::IpAddr;
use std::time::Instant;

use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse, web};
use chrono::Utc;
use serde::Deserialize;
use serde_json::json;

use crate::activities::cache::Lookup;
use crate::admission::{Admission, Layout, ReserveRequest, WorkerGate};
use crate::bus::PublishError;
use crate::bus::events::OrderRequested;
use crate::http::auth::AuthUser;
use crate::http::error::{ApiError, ErrorCode};
use crate::ids::OrderNo;
use crate::orders::OrderStatus;
use crate::orders::publish::{Confirmation, Published};
use crate::orders::repo::{self, Order};
use crate::state::AppState;
use crate::store;

/// Longest accepted `request_id` (and purchase token).
const MAX_ID_LEN: usize = 64;

/// The purchase body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlaceOrder {
    request_id: String,
    token: Option<String>,
    quantity: Option<i32>,
    coupon_id: Option<i64>,
}

fn is_valid_key(v: &str) -> bool {
    !v.is_empty() && v.len() <= MAX_ID_LEN && v.bytes().all(|b| b.is_ascii_graphic())
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

fn outcome(state: &AppState, name: &str) {
    state.metrics.admission.with_label_values(&[name]).inc();
}

fn reject(state: &AppState, name: &str, code: ErrorCode, message: &'static str) -> ApiError {
    outcome(state, name);
    ApiError::new(code, message)
}

/// SPEC steps 1–2: limits, one `EVALSHA`, publish, answer. No database.
pub async fn place(
    user: AuthUser,
    state: web::Data<AppState>,
    gate: web::Data<WorkerGate>,
    path: web::Path<i64>,
    req: HttpRequest,
    body: web::Json<PlaceOrder>,
) -> Result<HttpResponse, ApiError> {
    let activity_id = path.into_inner();
    let body = body.into_inner();
    if !is_valid_key(&body.request_id) {
        return Err(ApiError::bad_request(
            "request_id must be 1..=64 printable ASCII characters",
        ));
    }
    let quantity = body.quantity.unwrap_or(1);
    if quantity < 1 {
        return Err(ApiError::bad_request("quantity must be at least 1"));
    }
    // The client's own bucket first: one address flooding requests must
    // not drain the activity's bucket for everyone else.
    if let Some(ip) = client_ip(&req, state.settings.forwarded_hops())
        && !state.limits.ip.try_acquire(ip)
    {
        return Err(reject(
            &state,
            "rate_limited",
            ErrorCode::RateLimited,
            "too many requests from this address",
        ));
    }
    if !state.limits.activity.try_acquire(activity_id) {
        return Err(reject(
            &state,
            "rate_limited",
            ErrorCode::RateLimited,
            "too many requests for this activity",
        ));
    }
    let meta = match state
        .activities
        .lookup(&gate.0, &state.db, activity_id)
        .await
        .map_err(ApiError::unavailable)?
    {
        Lookup::Warm(meta) => meta,
        Lookup::Restoring => return Err(restoring(&state)),
        Lookup::NotActive => {
            return Err(reject(
                &state,
                "not_active",
                ErrorCode::NotActive,
                "the sale is not open",
            ));
        }
    };
    if quantity > meta.per_user_limit {
        return Err(ApiError::bad_request("quantity exceeds the per-user limit"));
    }
    let now_ms = Utc::now().timestamp_millis();
    // Sold out a moment ago, and this buyer has no order to be told about:
    // answered from memory (admission/soldout.rs).
    if meta.is_open(now_ms) && state.sold_out.refuses(activity_id, user.user_id.get()) {
        return Err(reject(
            &state,
            "sold_out_memory",
            ErrorCode::SoldOut,
            "sold out",
        ));
    }
    if let Some(coupon_id) = body.coupon_id {
        // A cheap membership check; the coupon is locked (or the order
        // fails) in the order-creating transaction.
        let holds = coupon_id >= 1
            && state
                .coupons
                .holds(coupon_id, user.user_id.get())
                .await
                .map_err(|e| ApiError::unavailable(e.into()))?;
        if !holds {
            return Err(ApiError::new(
                ErrorCode::CouponInvalid,
                "you hold no such coupon",
            ));
        }
    }
    let token = body
        .token
        .as_deref()
        .filter(|t| is_valid_key(t))
        .unwrap_or("");

    // Backpressure before Redis is touched: the order consumers are too far
    // behind or stalled (a 202 now would stay PROCESSING for long), the
    // broker acknowledges nothing, or too many purchases await their
    // delivery report.
    if let Some(why) = state.consumer_backpressure() {
        return Err(reject(&state, "busy", ErrorCode::Busy, why));
    }
    if !state.publisher.breaker.admits(now_ms) {
        return Err(reject(
            &state,
            "busy",
            ErrorCode::Busy,
            "the broker is not acknowledging orders; retry shortly",
        ));
    }
    if !state.publisher.acks.has_room() {
        return Err(reject(
            &state,
            "busy",
            ErrorCode::Busy,
            "acknowledgements are waiting on Redis; retry shortly",
        ));
    }
    let Ok(permit) = state.in_flight.clone().try_acquire_owned() else {
        return Err(reject(
            &state,
            "busy",
            ErrorCode::Busy,
            "too many purchases in flight; retry shortly",
        ));
    };
    // A sharded activity's order carries its buyer's shard in its number.
    let layout = meta.layout;
    let minted = if layout.is_sharded() {
        let shard = layout.shard_of_user(user.user_id.get());
        state.ids.next_id_with_gene(shard as u8)
    } else {
        state.ids.next_id()
    };
    let Some(order_no) = minted else {
        return Err(reject(
            &state,
            "retry_later",
            ErrorCode::RetryLater,
            "no order number can be made right now; retry shortly",
        ));
    };
    let reserve = ReserveRequest {
        activity_id,
        user_id: user.user_id.get(),
        request_id: &body.request_id,
        token,
        quantity,
        order_no,
        layout,
        now_ms,
        coupon_id: body.coupon_id,
    };
    let started = Instant::now();
    let admission = gate.0.reserve(&reserve).await.map_err(|e| {
        outcome(&state, "retry_later");
        ApiError::unavailable(e.into())
    })?;
    state
        .metrics
        .lua_duration
        .observe(started.elapsed().as_secs_f64());

    let order_no = match admission {
        Admission::Accepted(order_no) => order_no,
        Admission::Duplicate(order_no) => {
            drop(permit);
            outcome(&state, "duplicate");
            return replay(
                &state,
                (activity_id, layout),
                order_no,
                &user,
                &body.request_id,
            )
            .await;
        }
        Admission::SoldOut => {
            let (flags, gate) = (state.sold_out.clone(), state.gate.clone());
            tokio::spawn(async move { flags.mark(&gate, activity_id, layout).await });
            return Err(reject(&state, "sold_out", ErrorCode::SoldOut, "sold out"));
        }
        Admission::LimitExceeded => {
            return Err(reject(
                &state,
                "limit_exceeded",
                ErrorCode::LimitExceeded,
                "you already hold the per-user limit",
            ));
        }
        Admission::InvalidToken => {
            return Err(reject(
                &state,
                "invalid_token",
                ErrorCode::InvalidToken,
                "purchase token missing, used, expired or not yours",
            ));
        }
        Admission::NotActive => {
            return Err(reject(
                &state,
                "not_active",
                ErrorCode::NotActive,
                "the sale is not open",
            ));
        }
        Admission::NumberTaken => {
            tracing::error!(
                order_no,
                activity_id,
                "order number already reserved: two instances share an instance id"
            );
            return Err(reject(
                &state,
                "number_taken",
                ErrorCode::RetryLater,
                "the order number was taken; retry",
            ));
        }
        Admission::NotWarm => {
            // Warm a moment ago (the cache said so): Redis lost it.
            state.activities.forget(activity_id);
            return Err(restoring(&state));
        }
    };

    let event = OrderRequested {
        event_id: order_no.to_string(),
        order_no: OrderNo::new(order_no),
        activity_id,
        user_id: user.user_id.get(),
        request_id: body.request_id.clone(),
        quantity,
        coupon_id: body.coupon_id,
        reserved_at_ms: now_ms,
    };
    match state.publisher.publish(event, layout, permit).await {
        Published::Delivered => {
            outcome(&state, "accepted");
            Ok(HttpResponse::Accepted().json(json!({
                "order_no": order_no.to_string(),
                "request_id": body.request_id,
                "status": OrderStatus::Processing,
            })))
        }
        Published::NotDelivered(PublishError::QueueFull) => Err(reject(
            &state,
            "busy",
            ErrorCode::Busy,
            "the order queue is full; retry shortly",
        )),
        Published::NotDelivered(_) => Err(reject(
            &state,
            "retry_later",
            ErrorCode::RetryLater,
            "the order could not be queued; nothing was kept",
        )),
        Published::Pending => Err(pending(&state, order_no)),
    }
}

/// 503 RETRY_LATER while Redis lost an activity and reconciliation restores
/// it from the database; wakes the local reconciler.
fn restoring(state: &AppState) -> ApiError {
    state.restore_wanted.notify_one();
    reject(
        state,
        "retry_later",
        ErrorCode::RetryLater,
        "the sale is being restored; retry shortly",
    )
}

/// 503 RETRY_LATER for a purchase whose delivery is not confirmed yet: its
/// reservation and order_no are kept, and a retry with the same request_id
/// gets that order_no.
fn pending(state: &AppState, order_no: i64) -> ApiError {
    reject(
        state,
        "pending",
        ErrorCode::RetryLater,
        "the order is not confirmed yet; retry with the same request_id",
    )
    .with_order_no(order_no)
}

/// A purchase retried with a request_id already bound to `order_no`: 202
/// when this retry confirmed its delivery, 200 with the order's status once
/// it was confirmed before (or settled otherwise), 503 while still unknown.
async fn replay(
    state: &web::Data<AppState>,
    (activity_id, layout): (i64, Layout),
    order_no: i64,
    user: &AuthUser,
    request_id: &str,
) -> Result<HttpResponse, ApiError> {
    let confirmation = state
        .publisher
        .confirm(activity_id, layout, order_no)
        .await
        .map_err(|e| ApiError::unavailable(e.into()))?;
    let (code, status) = match confirmation {
        Confirmation::Pending => return Err(pending(state, order_no)),
        Confirmation::ConfirmedNow => (StatusCode::ACCEPTED, OrderStatus::Processing),
        Confirmation::Settled => (
            StatusCode::OK,
            current_status(state, (activity_id, layout), order_no, user.user_id.get()).await?,
        ),
    };
    Ok(HttpResponse::build(code).json(json!({
        "order_no": order_no.to_string(),
        "request_id": request_id,
        "status": status,
    })))
}

/// The status of an order the caller owns: its row, else its reservation.
async fn current_status(
    state: &AppState,
    (activity_id, layout): (i64, Layout),
    order_no: i64,
    user_id: i64,
) -> Result<OrderStatus, ApiError> {
    let row = store::run(&state.db, move |conn| {
        Ok(repo::find_for_user(conn, order_no, user_id)?)
    })
    .await
    .map_err(ApiError::unavailable)?;
    if let Some(order) = row {
        return Ok(order.status);
    }
    let reservation = state
        .gate
        .reservation(activity_id, layout, order_no)
        .await
        .map_err(|e| ApiError::unavailable(e.into()))?;
    Ok(match reservation {
        Some(r) if r.released() => OrderStatus::Failed,
        _ => OrderStatus::Processing,
    })
}

fn order_view(o: &Order) -> serde_json::Value {
    serde_json::to_value(o).unwrap_or_default()
}

/// `GET /api/v1/orders/{order_no}` (SPEC step 8): the row, else the Redis
/// reservation (PROCESSING, or FAILED when released), else 404. Another
/// user's order is 404 too.
pub async fn show(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let not_found = || ApiError::not_found("no such order");
    let order_no = crate::http::id_in_path(&path, "no such order")?;
    let user_id = user.user_id.get();
    let (row, recent) = store::run(&state.db, move |conn| {
        let row = repo::find_for_user(conn, order_no, user_id)?;
        let recent = match row {
            Some(_) => Vec::new(),
            None => {
                crate::activities::repo::recent_ids(conn, Utc::now() - chrono::Duration::days(7))?
            }
        };
        Ok((row, recent))
    })
    .await
    .map_err(ApiError::unavailable)?;
    if let Some(order) = row {
        return Ok(HttpResponse::Ok().json(order_view(&order)));
    }
    for (activity_id, layout) in recent {
        let reservation = state
            .gate
            .reservation(activity_id, layout, order_no)
            .await
            .map_err(|e| ApiError::unavailable(e.into()))?;
        let Some(r) = reservation else { continue };
        if r.user_id != user_id {
            return Err(not_found());
        }
        return Ok(HttpResponse::Ok().json(json!({
            "order_no": order_no.to_string(),
            "request_id": r.request_id,
            "activity_id": activity_id,
            "user_id": user_id,
            "quantity": r.quantity,
            "amount_cents": null,
            "coupon_id": null,
            "status": if r.released() { OrderStatus::Failed } else { OrderStatus::Processing },
            "pay_deadline": null,
            "created_at": null,
            "paid_at": null,
            "failure_reason": if r.released() { json!("RESERVATION_RELEASED") } else { json!(null) },
        })));
    }
    Err(not_found())
}

/// `POST /api/v1/orders/{order_no}/cancel` (SPEC step 6): WAITING_PAY →
/// CANCELLED with its release, once; cancelling a CANCELLED order again is
/// 200 with no effect; any other state is 409 INVALID_STATE.
pub async fn cancel(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    use crate::orders::transitions::{self, ReleaseTo};
    let order_no = crate::http::id_in_path(&path, "no such order")?;
    let user_id = user.user_id.get();
    let outcome = store::run(&state.db, move |conn| {
        use diesel::Connection;
        Ok(conn.transaction(|conn| {
            let Some((order, status)) = transitions::lock_for_user(conn, order_no, user_id)? else {
                return Ok::<_, diesel::result::Error>(None);
            };
            if status == OrderStatus::WaitingPay {
                transitions::release(conn, &[order], ReleaseTo::Cancelled)?;
            }
            repo::find_for_user(conn, order_no, user_id)
        })?)
    })
    .await
    .map_err(ApiError::unavailable)?;
    let order = outcome.ok_or_else(|| ApiError::not_found("no such order"))?;
    if order.status != OrderStatus::Cancelled {
        return Err(ApiError::new(
            ErrorCode::InvalidState,
            "only a WAITING_PAY order can be cancelled",
        ));
    }
    Ok(HttpResponse::Ok().json(order_view(&order)))
}

/// `GET /api/v1/orders` query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    status: Option<String>,
    limit: Option<i64>,
    cursor: Option<String>,
}

/// `GET /api/v1/orders?status=&limit=&cursor=`: the caller's orders, newest first.
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
                return Ok(HttpResponse::Ok().json(json!({"orders": [], "next_cursor": null})));
            }
            Some(status) => Some(status),
            None => return Err(ApiError::bad_request("unknown status")),
        },
    };
    let cursor = match q.cursor.as_deref().filter(|c| !c.is_empty()) {
        None => None,
        Some(c) => Some(
            OrderNo::parse(c)
                .ok_or_else(|| ApiError::bad_request("bad cursor"))?
                .get(),
        ),
    };
    let user_id = user.user_id.get();
    let orders = store::run(&state.db, move |conn| {
        Ok(repo::list_for_user(conn, user_id, status, cursor, limit)?)
    })
    .await
    .map_err(ApiError::unavailable)?;
    let next_cursor = match orders.last() {
        Some(last) if orders.len() as i64 == limit => json!(last.order_no.to_string()),
        _ => json!(null),
    };
    let views: Vec<_> = orders.iter().map(order_view).collect();
    Ok(HttpResponse::Ok().json(json!({"orders": views, "next_cursor": next_cursor})))
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
