//! The waiting room's routes (docs/WAITING_ROOM.md): the proof-of-work
//! challenge, joining, the caller's ticket (read, left, streamed), the
//! published draw, and the operator's rate.

use std::time::Duration;

use actix_web::http::header;
use actix_web::web::Bytes;
use actix_web::{HttpResponse, web};
use serde::Deserialize;
use tokio::sync::mpsc;

use crate::domain::ActivityId;
use crate::http::auth::{AdminUser, AuthUser};
use crate::http::error::{ApiError, ErrorCode, Problem};
use crate::room::pow::{Answer, Challenge};
use crate::room::{DrawView, Method, RoomError, RoomSettingsView, TicketState, TicketView};
use crate::state::AppState;

/// The answer of every room failure.
pub(super) fn room_error(e: RoomError) -> ApiError {
    match e {
        RoomError::NoRoom => ApiError::not_found("this activity has no waiting room"),
        RoomError::NotOpen => ApiError::new(
            ErrorCode::NotActive,
            "the queue is not open: before the pre-queue, or after the end",
        ),
        RoomError::Closed => ApiError::new(
            ErrorCode::NotActive,
            "the operator closed this queue (method reject): no joins and no purchases for now",
        ),
        RoomError::PowInvalid(why) => ApiError::new(ErrorCode::PowInvalid, why),
        RoomError::NotInQueue { restarted: false } => {
            ApiError::new(ErrorCode::NotInQueue, "you hold no ticket in this queue")
        }
        RoomError::NotInQueue { restarted: true } => ApiError::new(
            ErrorCode::NotInQueue,
            "the queue was restarted after a failure and your ticket is gone; join again",
        ),
        RoomError::Restoring => ApiError::new(
            ErrorCode::RetryLater,
            "the queue is being restored after a failure; retry shortly",
        )
        .with_retry_after(2),
        RoomError::PassRequired => ApiError::new(
            ErrorCode::QueuePassRequired,
            "this sale has a waiting room: send the pass of your admitted ticket as X-Queue-Pass",
        ),
        RoomError::PassInvalid(why) => ApiError::new(ErrorCode::QueuePassInvalid, why),
        RoomError::SoldOut => ApiError::new(
            ErrorCode::SoldOut,
            "sold out; your ticket is on the waitlist for units that come back",
        ),
        RoomError::Unavailable(e) => ApiError::unavailable(e),
    }
}

/// `GET …/queue/challenge`: a proof-of-work challenge to join with.
#[utoipa::path(get, path = "/api/v1/activities/{id}/queue/challenge", tag = "waiting room",
    params(("id" = i64, Path, description = "activity id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "an ALTCHA (v1) challenge, signed, stateless until answered; its maxnumber rises with the join rate", body = Challenge),
        (status = 400, description = "BAD_REQUEST: a malformed path", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND: no such activity, or it has no waiting room", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "NOT_ACTIVE: the sale is over", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn challenge(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<ActivityId>,
) -> Result<HttpResponse, ApiError> {
    let c = state
        .sale
        .rooms
        .challenge(path.into_inner(), user.user_id, state.clock.now())
        .await
        .map_err(room_error)?;
    Ok(HttpResponse::Ok().json(c))
}

/// `POST …/queue` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct JoinBody {
    /// The solved challenge.
    pow: Answer,
}

/// `POST …/queue`: takes the caller's ticket.
#[utoipa::path(post, path = "/api/v1/activities/{id}/queue", tag = "waiting room",
    params(("id" = i64, Path, description = "activity id")),
    request_body = JoinBody,
    security(("bearer" = [])),
    responses(
        (status = 201, description = "the caller's new ticket", body = TicketView),
        (status = 200, description = "the caller's ticket, taken before", body = TicketView),
        (status = 400, description = "POW_INVALID: a wrong, expired or reused answer; BAD_REQUEST: a malformed body", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND: no such activity, or it has no waiting room", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "NOT_ACTIVE: before the pre-queue opens or after the end", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: the queue is being restored, or a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn join(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<ActivityId>,
    body: web::Json<JoinBody>,
) -> Result<HttpResponse, ApiError> {
    let (new, ticket) = state
        .sale
        .rooms
        .join(
            path.into_inner(),
            user.user_id,
            &body.pow,
            state.clock.now(),
        )
        .await
        .map_err(room_error)?;
    let mut answer = if new {
        HttpResponse::Created()
    } else {
        HttpResponse::Ok()
    };
    Ok(answer.json(ticket))
}

fn with_retry_after(ticket: TicketView) -> HttpResponse {
    let secs = ticket.refresh_after_ms.div_ceil(1000).max(1);
    HttpResponse::Ok()
        .insert_header((header::RETRY_AFTER, secs.to_string()))
        .json(ticket)
}

/// `GET …/queue/me` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct MeQuery {
    /// `true`: once the sale started, a ticket taken in the pre-queue
    /// carries `inclusion`, its proof that it was among the entrants.
    proof: Option<bool>,
}

/// `GET …/queue/me?proof=`: the caller's ticket.
#[utoipa::path(get, path = "/api/v1/activities/{id}/queue/me", tag = "waiting room",
    params(("id" = i64, Path, description = "activity id"), MeQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "the caller's ticket; Retry-After says when to ask again", body = TicketView),
        (status = 400, description = "BAD_REQUEST: a malformed path or query", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_IN_QUEUE: the caller holds no ticket (its message says when the queue was restarted); NOT_FOUND: no waiting room", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "NOT_ACTIVE: the queue is not open yet", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: the queue is being restored, or a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn me(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<ActivityId>,
    query: web::Query<MeQuery>,
) -> Result<HttpResponse, ApiError> {
    let proof = query.proof.unwrap_or(false);
    let ticket = state
        .sale
        .rooms
        .ticket(path.into_inner(), user.user_id, state.clock.now(), proof)
        .await
        .map_err(room_error)?;
    Ok(with_retry_after(ticket))
}

/// `DELETE …/queue/me`: the caller leaves the queue.
#[utoipa::path(delete, path = "/api/v1/activities/{id}/queue/me", tag = "waiting room",
    params(("id" = i64, Path, description = "activity id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "the ticket, state LEFT; its pass or offer is void", body = TicketView),
        (status = 400, description = "BAD_REQUEST: a malformed path", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_IN_QUEUE, or NOT_FOUND: no waiting room", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "NOT_ACTIVE: the queue is not open yet", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn leave(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<ActivityId>,
) -> Result<HttpResponse, ApiError> {
    let ticket = state
        .sale
        .rooms
        .leave(path.into_inner(), user.user_id, state.clock.now())
        .await
        .map_err(room_error)?;
    Ok(HttpResponse::Ok().json(ticket))
}

/// `GET …/queue/draw`: what anyone needs to recompute the pre-queue order.
#[utoipa::path(get, path = "/api/v1/activities/{id}/queue/draw", tag = "waiting room",
    params(("id" = i64, Path, description = "activity id")),
    responses(
        (status = 200, description = "the seed, the commitment to the entrants and their count; scripts/verify_draw.py recomputes the order", body = DrawView),
        (status = 400, description = "BAD_REQUEST: a malformed path", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND: no such activity, or it has no waiting room", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "NOT_ACTIVE: the sale has not started (the draw is not fixed)", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn draw(
    state: web::Data<AppState>,
    path: web::Path<ActivityId>,
) -> Result<HttpResponse, ApiError> {
    let draw = state
        .sale
        .rooms
        .published_draw(path.into_inner())
        .await
        .map_err(room_error)?;
    Ok(HttpResponse::Ok().json(draw))
}

/// `PATCH …/waiting-room` body: the rate (with its cap), the method, or
/// both.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RateBody {
    /// Tickets admitted per second, across all instances. Absent: the
    /// rate and the cap stay as they are.
    #[schema(minimum = 1)]
    admit_per_sec: Option<i32>,
    /// With `admit_per_sec`: at most this many passes outstanding at once
    /// (null or absent: no cap).
    #[serde(default)]
    #[schema(minimum = 1)]
    max_active: Option<i32>,
    /// How the room lets buyers through from now on: `fifo`,
    /// `passthrough` (no pass needed) or `reject` (closed). Absent: as it
    /// is.
    #[serde(default)]
    method: Option<Method>,
}

/// `PATCH /api/v1/admin/activities/{id}/waiting-room`: changes the
/// admission rate during the sale (every instance's admitter follows from
/// its next round), or the queueing method (every instance within 2 s).
#[utoipa::path(patch, path = "/api/v1/admin/activities/{id}/waiting-room", tag = "waiting room",
    params(("id" = i64, Path, description = "activity id")),
    request_body = RateBody,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "the room's settings after the change", body = RoomSettingsView),
        (status = 400, description = "BAD_REQUEST: admit_per_sec or max_active out of range, max_active without admit_per_sec, an unknown method, nothing to change, or a malformed body", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "FORBIDDEN: not an admin", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND: no such activity, or it has no waiting room", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable (the change may be half made: send it again)", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn set_rate(
    _admin: AdminUser,
    state: web::Data<AppState>,
    path: web::Path<ActivityId>,
    body: web::Json<RateBody>,
) -> Result<HttpResponse, ApiError> {
    let id = path.into_inner();
    if body
        .admit_per_sec
        .is_some_and(|r| !(1..=100_000).contains(&r))
    {
        return Err(ApiError::bad_request("admit_per_sec must be 1..=100000"));
    }
    if body.max_active.is_some_and(|m| m < 1) {
        return Err(ApiError::bad_request("max_active must be at least 1"));
    }
    if body.admit_per_sec.is_none() && body.max_active.is_some() {
        return Err(ApiError::bad_request(
            "max_active is set with admit_per_sec (send both)",
        ));
    }
    if body.admit_per_sec.is_none() && body.method.is_none() {
        return Err(ApiError::bad_request(
            "nothing to change: send admit_per_sec, method, or both",
        ));
    }
    let rooms = &state.sale.rooms;
    let live = rooms
        .room(id)
        .await
        .map_err(ApiError::unavailable)?
        .ok_or_else(|| room_error(RoomError::NoRoom))?;
    let row = rooms
        .set_rate(
            id,
            body.admit_per_sec.map(|r| (r, body.max_active)),
            body.method,
        )
        .await
        .map_err(room_error)?;
    Ok(HttpResponse::Ok().json(RoomSettingsView::of(&row, live.start_at)))
}

/// How often a ticket stream reads the ticket again, at most and at least.
const STREAM_READ: (Duration, Duration) = (Duration::from_millis(500), Duration::from_secs(5));

/// A comment line this often keeps proxies from closing an idle stream.
const KEEPALIVE: Duration = Duration::from_secs(15);

fn ticket_event(t: &TicketView) -> Bytes {
    let data = serde_json::to_string(t).unwrap_or_else(|_| "{}".into());
    Bytes::from(format!("event: ticket\ndata: {data}\n\n"))
}

/// `GET …/queue/events`: the caller's ticket as Server-Sent Events.
#[utoipa::path(get, path = "/api/v1/activities/{id}/queue/events", tag = "waiting room",
    params(("id" = i64, Path, description = "activity id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "text/event-stream: `event: ticket` with the ticket as data, the current one first, then each change (state, position, ahead); `event: gone` when the ticket is no more (the queue was restarted); `event: timeout` at the end of the time allowed", content_type = "text/event-stream"),
        (status = 400, description = "BAD_REQUEST: a malformed path", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_IN_QUEUE, or NOT_FOUND: no waiting room", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "RATE_LIMITED: this user already holds orders.streams_per_user open streams", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn events(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<ActivityId>,
) -> Result<HttpResponse, ApiError> {
    let id = path.into_inner();
    let user_id = user.user_id;
    let slot = super::streams::stream_slot(&state, user_id)?;
    let first = state
        .sale
        .rooms
        .ticket(id, user_id, state.clock.now(), false)
        .await
        .map_err(room_error)?;
    let timeout = state.settings.orders.events_timeout_secs;
    let (tx, rx) = mpsc::channel::<Bytes>(8);
    let state = state.into_inner();
    tokio::spawn(async move {
        let _slot = slot;
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last = first;
        if tx.send(ticket_event(&last)).await.is_err() {
            return;
        }
        let mut quiet = Duration::ZERO;
        loop {
            let pause =
                Duration::from_millis(last.refresh_after_ms).clamp(STREAM_READ.0, STREAM_READ.1);
            tokio::select! {
                _ = tx.closed() => return,
                _ = tokio::time::sleep(pause) => {}
            }
            if tokio::time::Instant::now() >= deadline {
                let _ = tx
                    .send(Bytes::from_static(b"event: timeout\ndata: {}\n\n"))
                    .await;
                return;
            }
            let chunk = match state
                .sale
                .rooms
                .ticket(id, user_id, state.clock.now(), false)
                .await
            {
                Ok(now) if changed(&last, &now) => {
                    last = now;
                    Some(ticket_event(&last))
                }
                Ok(_) | Err(RoomError::Unavailable(_) | RoomError::Restoring) => None,
                Err(_) => {
                    let _ = tx
                        .send(Bytes::from_static(b"event: gone\ndata: {}\n\n"))
                        .await;
                    return;
                }
            };
            quiet = if chunk.is_some() {
                Duration::ZERO
            } else {
                quiet + pause
            };
            let chunk = chunk
                .or_else(|| (quiet >= KEEPALIVE).then(|| Bytes::from_static(b": keepalive\n\n")));
            if let Some(chunk) = chunk {
                if quiet >= KEEPALIVE {
                    quiet = Duration::ZERO;
                }
                if tx.send(chunk).await.is_err() {
                    return;
                }
            }
            if matches!(last.state, TicketState::Left) {
                return;
            }
        }
    });
    Ok(super::streams::event_stream(rx))
}

/// Whether the holder would see a difference.
fn changed(before: &TicketView, after: &TicketView) -> bool {
    (
        before.state,
        before.position,
        before.ahead,
        before.epoch,
        &before.pass,
    ) != (
        after.state,
        after.position,
        after.ahead,
        after.epoch,
        &after.pass,
    )
}
