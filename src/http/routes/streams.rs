//! `GET /api/v1/orders/{order_no}/events`: the order's status as
//! Server-Sent Events, pushed as it changes (`orders::events`) instead of
//! polled.

use std::time::Duration;

use actix_web::http::header;
use actix_web::web::Bytes;
use actix_web::{HttpResponse, web};
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::mpsc;

use crate::http::auth::AuthUser;
use crate::http::error::{ApiError, ErrorCode, Problem};
use crate::ids::OrderNo;
use crate::orders::OrderStatus;
use crate::orders::events::Note;
use crate::state::AppState;

use super::orders::{Found, find, find_read};

/// A comment line this often keeps proxies from closing an idle stream.
const KEEPALIVE: Duration = Duration::from_secs(15);

/// Over how long the streams spread their reads after missing changes (a
/// pub/sub reconnect tells every open stream at once).
const RESYNC_SPREAD: Duration = Duration::from_secs(2);

/// How far along an order is: a change is news only if it is later.
fn stage(status: OrderStatus) -> u8 {
    match status {
        OrderStatus::Processing => 0,
        OrderStatus::WaitingPay => 1,
        _ => 2,
    }
}

fn event(order_no: OrderNo, status: OrderStatus) -> Bytes {
    Bytes::from(format!(
        "event: status\ndata: {{\"order_no\":\"{order_no}\",\"status\":\"{}\"}}\n\n",
        status.as_str()
    ))
}

/// `GET /api/v1/orders/{order_no}/events`: the order's status first, then
/// each change as it happens; the stream ends at a final status (PAID,
/// CANCELLED, CLOSED, FAILED) or after `orders.events_timeout_secs`
/// (`event: timeout`). Owner only. While it waits it costs no database
/// query: changes come from the service's own commits (`orders::events`).
/// Its reads use the public-reads pool, never the one payments and cancels
/// need; a user holds at most `orders.streams_per_user` streams at once.
#[utoipa::path(get, path = "/api/v1/orders/{order_no}/events", tag = "orders",
    params(("order_no" = String, Path, description = "order number (decimal)")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "text/event-stream: `event: status` with data {order_no, status}, the current status first; `event: timeout` at the end of the time allowed", content_type = "text/event-stream"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND (or not the caller's)", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "RATE_LIMITED: this user already holds orders.streams_per_user open streams", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn order_events(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let order_no = crate::http::id_in_path(&path, OrderNo::parse, "no such order")?;
    let user_id = user.user_id;
    let slot = stream_slot(&state, user_id)?;
    // Listening before the first read: a change committed in between is
    // heard, not lost.
    let mut notes = state.redis.order_events.follow(order_no.get());
    let found = find_read(&state, &state.pg.public, order_no, user_id)
        .await?
        .0
        .ok_or_else(|| ApiError::not_found("no such order"))?;
    let mut status = found.status();
    // Where to read it again: its row once it has one, else its activity.
    let activity = match found {
        Found::Row(_) => None,
        Found::Reserved {
            activity_id,
            layout,
            ..
        } => Some((activity_id, layout)),
    };
    let timeout = state.settings.orders.events_timeout_secs;
    let (tx, rx) = mpsc::channel::<Bytes>(8);
    let state = state.into_inner();
    tokio::spawn(async move {
        let _slot = slot;
        if tx.send(event(order_no, status)).await.is_err() || status.is_final() {
            return;
        }
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        let mut keepalive =
            tokio::time::interval_at(tokio::time::Instant::now() + KEEPALIVE, KEEPALIVE);
        loop {
            let next = tokio::select! {
                _ = &mut deadline => {
                    let _ = tx.send(Bytes::from_static(b"event: timeout\ndata: {}\n\n")).await;
                    return;
                }
                _ = tx.closed() => return,
                _ = keepalive.tick() => {
                    if tx.send(Bytes::from_static(b": keepalive\n\n")).await.is_err() {
                        return;
                    }
                    continue;
                }
                note = notes.recv() => match note {
                    Ok(Note::Change(c)) => Some(c.status),
                    // Changes may have been missed: read the order again.
                    Ok(Note::Resync) | Err(RecvError::Lagged(_)) => {
                        state.metrics.order_stream_resyncs.inc();
                        // Every stream hears this at once: spread the reads.
                        tokio::time::sleep(RESYNC_SPREAD.mul_f64(fastrand::f64())).await;
                        match find(&state, &state.pg.public, order_no, user_id, activity).await {
                            Ok(Some(now)) => Some(now.status()),
                            _ => None,
                        }
                    }
                    Err(RecvError::Closed) => return,
                },
            };
            if let Some(next) = next
                && stage(next) > stage(status)
            {
                status = next;
                // The change was committed on the primary: the buyer's
                // next read must not come from a replica behind it.
                if let Some(replica) = &state.pg.replica {
                    replica.shown_from_primary(user_id).await;
                }
                if tx.send(event(order_no, status)).await.is_err() || status.is_final() {
                    return;
                }
            }
        }
    });
    Ok(event_stream(rx))
}

/// One of the user's `orders.streams_per_user` open streams (order and
/// queue streams alike), given back when dropped; 429 when all are open.
pub(super) fn stream_slot(
    state: &AppState,
    user_id: crate::domain::UserId,
) -> Result<crate::orders::events::StreamSlot, ApiError> {
    state
        .sale
        .order_streams
        .take(user_id.get(), state.settings.orders.streams_per_user.max(1))
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::RateLimited,
                "too many open streams for this user; close one first",
            )
            .with_retry_after(5)
        })
}

/// A Server-Sent Events answer of what `rx` is sent, neither stored nor
/// buffered by proxies.
pub(super) fn event_stream(mut rx: mpsc::Receiver<Bytes>) -> HttpResponse {
    let body = futures_util::stream::poll_fn(move |cx| {
        rx.poll_recv(cx)
            .map(|chunk| chunk.map(Ok::<_, actix_web::Error>))
    });
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header((header::CACHE_CONTROL, crate::http::cache::DEFAULT))
        .insert_header(("X-Accel-Buffering", "no"))
        .streaming(body)
}
