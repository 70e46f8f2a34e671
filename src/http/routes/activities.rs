//! Activity routes: create, warm up, stats (admin); public view; purchase token.

use actix_web::{HttpRequest, HttpResponse, web};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::activities::cache::Lookup;
use crate::activities::repo::{self, NewActivity};
use crate::activities::{Activity, Lifecycle};
use crate::admission::Layout;
use crate::domain::ActivityId;
use crate::http::auth::{AdminUser, AuthUser};
use crate::http::cache;
use crate::http::error::{ApiError, ErrorCode, Problem};
use crate::room::{RoomOptions, RoomSettingsView};
use crate::state::AppState;
use crate::store;

/// The header a waiting room's pass comes in.
const QUEUE_PASS: &str = "X-Queue-Pass";

/// More buckets than this only adds keys to every admission call.
const MAX_BUCKETS: i32 = 64;

/// An order's shard is the 4-bit gene in its number.
const MAX_SHARDS: i32 = Layout::MAX_SHARDS as i32;

/// `POST /api/v1/admin/activities` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateActivity {
    /// The product sold.
    #[schema(minimum = 1)]
    sku_id: i64,
    /// 1..=200 characters.
    name: String,
    /// Price of one unit.
    #[schema(minimum = 0)]
    price_cents: i64,
    /// Units for sale.
    #[schema(minimum = 1)]
    stock: i32,
    /// When the sale opens.
    start_at: DateTime<Utc>,
    /// When it closes (after `start_at`).
    end_at: DateTime<Utc>,
    /// Units one user may buy in all.
    #[serde(default = "one")]
    #[schema(minimum = 1, default = 1)]
    per_user_limit: i32,
    /// How long an order waits for its payment before it is closed.
    #[serde(default = "default_pay_timeout")]
    #[schema(minimum = 1, default = 900)]
    pay_timeout_secs: i32,
    /// Stock buckets per shard in Redis (spreads one key's load).
    #[serde(default = "one")]
    #[schema(minimum = 1, default = 1)]
    buckets: i32,
    /// Redis shards of the activity's keys, at most the stock: more than one
    /// spreads one hot activity over a Redis Cluster's masters. Fixed at creation.
    #[serde(default = "one")]
    #[schema(minimum = 1, maximum = 16, default = 1)]
    shards: i32,
    /// A waiting room in front of the sale (docs/WAITING_ROOM.md): fixed
    /// at creation; its rate can change during the sale.
    #[serde(default)]
    waiting_room: Option<RoomOptions>,
}

fn one() -> i32 {
    1
}

fn default_pay_timeout() -> i32 {
    900
}

impl CreateActivity {
    fn validate(self) -> Result<(NewActivity, i32, Option<RoomOptions>), ApiError> {
        let bad = |m: &'static str| Err(ApiError::bad_request(m));
        let name = self.name.trim().to_owned();
        if name.is_empty() || name.chars().count() > 200 {
            return bad("name must be 1..=200 characters");
        }
        if self.sku_id < 1 {
            return bad("sku_id must be positive");
        }
        if self.stock < 1 {
            return bad("stock must be at least 1");
        }
        if self.price_cents < 0 {
            return bad("price_cents must not be negative");
        }
        if self.end_at <= self.start_at {
            return bad("end_at must be after start_at");
        }
        if self.per_user_limit < 1 {
            return bad("per_user_limit must be at least 1");
        }
        if self.pay_timeout_secs < 1 {
            return bad("pay_timeout_secs must be at least 1");
        }
        if self.buckets < 1 || self.buckets > self.stock || self.buckets > MAX_BUCKETS {
            return bad("buckets must be between 1 and min(stock, 64)");
        }
        if self.shards < 1 || self.shards > self.stock || self.shards > MAX_SHARDS {
            return bad("shards must be between 1 and min(stock, 16)");
        }
        if self
            .price_cents
            .checked_mul(i64::from(self.per_user_limit))
            .is_none()
        {
            return bad("price_cents × per_user_limit overflows");
        }
        if let Some(room) = &self.waiting_room {
            room.validate().map_err(ApiError::bad_request)?;
        }
        let new = NewActivity {
            sku_id: self.sku_id,
            name,
            price_cents: self.price_cents,
            start_at: self.start_at,
            end_at: self.end_at,
            per_user_limit: self.per_user_limit,
            pay_timeout_secs: self.pay_timeout_secs,
            buckets: self.buckets,
            shards: self.shards,
        };
        Ok((new, self.stock, self.waiting_room))
    }
}

/// An activity as clients see it.
#[derive(Debug, Serialize, ToSchema)]
pub struct ActivityView {
    #[schema(value_type = i64)]
    activity_id: ActivityId,
    sku_id: i64,
    name: String,
    price_cents: i64,
    /// Units put on sale.
    stock: i32,
    start_at: DateTime<Utc>,
    end_at: DateTime<Utc>,
    per_user_limit: i32,
    pay_timeout_secs: i32,
    buckets: i32,
    shards: i32,
    /// At the server's time.
    status: Lifecycle,
    /// Units Redis can still sell (0 before the warm-up); in the public
    /// views only.
    #[serde(skip_serializing_if = "Option::is_none")]
    remaining: Option<i64>,
    /// Its waiting room, when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    waiting_room: Option<RoomSettingsView>,
}

fn view(a: &Activity, stock_total: i32, now: DateTime<Utc>) -> ActivityView {
    ActivityView {
        activity_id: a.id,
        sku_id: a.sku_id,
        name: a.name.clone(),
        price_cents: a.price_cents,
        stock: stock_total,
        start_at: a.start_at,
        end_at: a.end_at,
        per_user_limit: a.per_user_limit,
        pay_timeout_secs: a.pay_timeout_secs,
        buckets: a.buckets,
        shards: a.shards,
        status: a.lifecycle(now),
        remaining: None,
        waiting_room: None,
    }
}

/// The activity's view with its waiting room's settings, if it has one.
async fn with_room(
    state: &AppState,
    a: &Activity,
    mut body: ActivityView,
) -> Result<ActivityView, ApiError> {
    let room = state
        .sale
        .rooms
        .room(a.id)
        .await
        .map_err(ApiError::unavailable)?;
    body.waiting_room = room.map(|r| RoomSettingsView::of(&r.room, a.start_at));
    Ok(body)
}

/// Units Redis can still sell of `activity` (0 before its warm-up).
async fn remaining(state: &AppState, activity: &Activity) -> Result<i64, ApiError> {
    if activity.warmed_at.is_none() {
        return Ok(0);
    }
    state
        .redis
        .gate
        .available(activity.id, activity.layout())
        .await
        .map_err(|e| ApiError::unavailable(e.into()))
}

/// `GET /api/v1/activities`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ActivityList {
    /// The sale clock now (RFC 3339, milliseconds): countdowns follow it.
    server_time: String,
    activities: Vec<ActivityView>,
}

/// A one-time purchase token.
#[derive(Debug, Serialize, ToSchema)]
pub struct PurchaseToken {
    token: String,
    /// Seconds it stays valid.
    expires_in: u64,
}

/// `POST /api/v1/admin/activities` → 201.
#[utoipa::path(post, path = "/api/v1/admin/activities", tag = "activities",
    request_body = CreateActivity,
    security(("bearer" = [])),
    responses(
        (status = 201, description = "the activity, status PENDING", body = ActivityView),
        (status = 400, description = "BAD_REQUEST: a malformed body, path or query", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "FORBIDDEN: not an admin", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn create(
    _admin: AdminUser,
    state: web::Data<AppState>,
    body: web::Json<CreateActivity>,
) -> Result<HttpResponse, ApiError> {
    let (new, units, room) = body.into_inner().validate()?;
    let room = room
        .map(|r| r.into_row(ActivityId::new(0)))
        .transpose()
        .map_err(ApiError::unexpected)?;
    let activity = store::run(&state.pg.db, move |conn| {
        Ok(repo::create(conn, &new, units, room)?)
    })
    .await
    .map_err(ApiError::unavailable)?;
    let rooms = &state.sale.rooms;
    rooms.forget(activity.id);
    if let Err(e) = rooms.open_first(activity.id).await {
        // The admitter opens it on its next round.
        tracing::warn!(activity_id = %activity.id, error = %e, "opening the waiting room");
    }
    let body = view(&activity, units, state.clock.now());
    Ok(HttpResponse::Created().json(with_room(&state, &activity, body).await?))
}

async fn load(state: &AppState, id: ActivityId) -> Result<(Activity, repo::StockRow), ApiError> {
    store::run(&state.pg.db, move |conn| {
        Ok(repo::find_with_stock(conn, id)?)
    })
    .await
    .map_err(ApiError::unavailable)?
    .ok_or_else(|| ApiError::not_found("no such activity"))
}

/// `POST /api/v1/admin/activities/{id}/warmup`: loads the database's
/// available stock into Redis once; later calls change nothing.
#[utoipa::path(post, path = "/api/v1/admin/activities/{id}/warmup", tag = "activities",
    params(("id" = i64, Path, description = "activity id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "warmed: status READY and the units Redis holds", body = Warmed),
        (status = 400, description = "BAD_REQUEST: a malformed body, path or query", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "FORBIDDEN: not an admin", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "NOT_ACTIVE: the activity has ended", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: Redis lost the activity or a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn warmup(
    _admin: AdminUser,
    state: web::Data<AppState>,
    path: web::Path<ActivityId>,
) -> Result<HttpResponse, ApiError> {
    let id = path.into_inner();
    let (activity, stock) = load(&state, id).await?;
    if activity.lifecycle(state.clock.now()) == Lifecycle::Ended {
        return Err(ApiError::new(
            ErrorCode::NotActive,
            "the activity has ended",
        ));
    }
    if activity.warmed_at.is_some()
        && !state
            .redis
            .gate
            .is_warm(id)
            .await
            .map_err(|e| ApiError::unavailable(e.into()))?
    {
        // Warmed before, gone from Redis now: loading the available count
        // alone would forget every holding and request id (and hand out
        // units of orders still in flight). Reconciliation restores it.
        state.sale.restore_wanted.notify_one();
        return Err(ApiError::new(
            ErrorCode::RetryLater,
            "Redis lost this activity; reconciliation is restoring it",
        ));
    }
    let spec = activity.warm_spec(stock.available);
    let (_, units) = state
        .redis
        .gate
        .warmup(&spec)
        .await
        .map_err(|e| ApiError::unavailable(e.into()))?;
    store::run(&state.pg.db, move |conn| Ok(repo::mark_warmed(conn, id)?))
        .await
        .map_err(ApiError::unavailable)?;
    state.sale.activities.forget(id);
    Ok(HttpResponse::Ok().json(Warmed {
        activity_id: id,
        status: "READY",
        warmed_stock: units,
    }))
}

/// A warm-up's answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct Warmed {
    #[schema(value_type = i64)]
    activity_id: ActivityId,
    /// Always READY.
    status: &'static str,
    /// The units Redis holds for the activity now.
    warmed_stock: i64,
}

/// `GET /api/v1/activities/{id}`: public view with the Redis remaining count.
#[utoipa::path(get, path = "/api/v1/activities/{id}", tag = "activities",
    params(("id" = i64, Path, description = "activity id")),
    responses(
        (status = 200, description = "the activity with remaining (Redis) units; Cache-Control public, max-age=2, and an ETag", body = ActivityView),
        (status = 304, description = "unchanged since the ETag given in If-None-Match"),
        (status = 400, description = "BAD_REQUEST: a malformed body, path or query", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn show(
    req: HttpRequest,
    state: web::Data<AppState>,
    path: web::Path<ActivityId>,
) -> Result<HttpResponse, ApiError> {
    let id = path.into_inner();
    let read = move |conn: &mut store::PgConn| Ok(repo::find_with_stock(conn, id)?);
    // The replica when it is read from; an activity it has not replayed
    // yet is asked of the primary, never "no such activity".
    let on_replica = match state.pg.replica.as_deref().and_then(|r| r.public_pool()) {
        Some(pool) => store::run(pool, read).await.ok().flatten(),
        None => None,
    };
    let (activity, stock) = match on_replica {
        Some(found) => found,
        // Anonymous and cheap to send in floods: its own pool.
        None => store::run(&state.pg.public, read)
            .await
            .map_err(ApiError::unavailable)?
            .ok_or_else(|| ApiError::not_found("no such activity"))?,
    };
    let mut body = view(&activity, stock.total, state.clock.now());
    body.remaining = Some(remaining(&state, &activity).await?);
    // The same for every caller: a CDN may keep it a moment (http::cache).
    let body = serde_json::to_vec(&with_room(&state, &activity, body).await?)
        .map_err(|e| ApiError::unexpected(e.into()))?;
    let etag = cache::etag(&body);
    Ok(cache::respond(
        &req,
        cache::LIVE_VIEW,
        &etag,
        "application/json",
        body,
        |_| {},
    ))
}

/// `POST /api/v1/admin/activities/{id}/end`: ends the sale now. The window
/// closes in the database, then in Redis, where admission reads it, so every
/// instance refuses the next purchase (409 NOT_ACTIVE). Orders already
/// taken go on as before: paid, or closed by their payment timeout.
/// Ending an ended activity changes nothing.
#[utoipa::path(post, path = "/api/v1/admin/activities/{id}/end", tag = "activities",
    params(("id" = i64, Path, description = "activity id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "the activity, status ENDED", body = ActivityView),
        (status = 400, description = "BAD_REQUEST: a malformed path", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "FORBIDDEN: not an admin", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable (ending again is safe)", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn end(
    _admin: AdminUser,
    state: web::Data<AppState>,
    path: web::Path<ActivityId>,
) -> Result<HttpResponse, ApiError> {
    let id = path.into_inner();
    let now = state.clock.now();
    let activity = store::run(&state.pg.db, move |conn| Ok(repo::end(conn, id, now)?))
        .await
        .map_err(ApiError::unavailable)?
        .ok_or_else(|| ApiError::not_found("no such activity"))?;
    state
        .redis
        .gate
        .end_sale(id, activity.layout(), activity.end_at.timestamp_millis())
        .await
        .map_err(|e| ApiError::unavailable(e.into()))?;
    state.sale.activities.forget(id);
    state
        .sale
        .rooms
        .end(id, activity.end_at)
        .await
        .map_err(super::queue::room_error)?;
    state.sale.rooms.forget(id);
    let (activity, stock) = load(&state, id).await?;
    let body = view(&activity, stock.total, state.clock.now());
    Ok(HttpResponse::Ok().json(with_room(&state, &activity, body).await?))
}

/// How long after its end an activity still shows in the list.
const LISTED_AFTER_END: chrono::Duration = chrono::Duration::hours(1);

/// `GET /api/v1/activities`: the activities on sale, coming up, or ended
/// within the hour (at most 50, the soonest first), each with the public
/// view's fields, and the server's clock (`server_time`) so a client's
/// countdown follows the sale's clock rather than its own.
#[utoipa::path(get, path = "/api/v1/activities", tag = "activities",
    responses(
        (status = 200, description = "server_time and the activities on sale, coming up or ended within the hour", body = ActivityList),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn list(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let now = state.clock.now();
    let since = now - LISTED_AFTER_END;
    let read = move |conn: &mut store::PgConn| Ok(repo::list_recent(conn, since, 50)?);
    let on_replica = match state.pg.replica.as_deref().and_then(|r| r.public_pool()) {
        Some(pool) => store::run(pool, read).await.ok(),
        None => None,
    };
    let rows = match on_replica {
        Some(rows) => rows,
        None => store::run(&state.pg.public, read)
            .await
            .map_err(ApiError::unavailable)?,
    };
    let mut activities = Vec::with_capacity(rows.len());
    for (activity, stock) in rows {
        let mut body = view(&activity, stock.total, now);
        body.remaining = Some(remaining(&state, &activity).await?);
        activities.push(with_room(&state, &activity, body).await?);
    }
    Ok(HttpResponse::Ok().json(ActivityList {
        server_time: now.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        activities,
    }))
}

/// `GET /api/v1/admin/activities/{id}/stats`: live figures from Redis and
/// PostgreSQL (docs/HTTP.md shape).
#[utoipa::path(get, path = "/api/v1/admin/activities/{id}/stats", tag = "activities",
    params(("id" = i64, Path, description = "activity id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Redis and database figures, orders by status", body = crate::activities::stats::ActivityStats),
        (status = 400, description = "BAD_REQUEST: a malformed body, path or query", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "FORBIDDEN: not an admin", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn stats(
    _admin: AdminUser,
    state: web::Data<AppState>,
    path: web::Path<ActivityId>,
) -> Result<HttpResponse, ApiError> {
    let id = path.into_inner();
    let mut stats =
        crate::activities::stats::read(&state.pg.db, &state.redis.gate, &*state.clock, id)
            .await
            .map_err(ApiError::unavailable)?
            .ok_or_else(|| ApiError::not_found("no such activity"))?;
    if let Some(figures) = stats.waiting_room.as_mut() {
        let room = state
            .sale
            .rooms
            .room(id)
            .await
            .map_err(ApiError::unavailable)?;
        figures.method = room.map(|r| r.room.method().as_str());
    }
    Ok(HttpResponse::Ok().json(stats))
}

/// `GET /api/v1/activities/{id}/token`: a one-time purchase token bound to
/// the caller and the activity. Redis only. An activity with a waiting
/// room asks for the pass of the caller's admitted ticket (`X-Queue-Pass`),
/// and uses it up.
#[utoipa::path(get, path = "/api/v1/activities/{id}/token", tag = "activities",
    params(("id" = i64, Path, description = "activity id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "token, expires_in", body = PurchaseToken),
        (status = 400, description = "BAD_REQUEST: a malformed body, path or query", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "QUEUE_PASS_REQUIRED: the sale has a waiting room and no X-Queue-Pass was sent; QUEUE_PASS_INVALID: a forged, expired, reused, or another user's or activity's pass", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "NOT_ACTIVE (also while the room's method is reject); SOLD_OUT: an admitted pass after the sell-out (the ticket is waitlisted)", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn token(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<ActivityId>,
    req: actix_web::HttpRequest,
) -> Result<HttpResponse, ApiError> {
    let id = path.into_inner();
    let rooms = &state.sale.rooms;
    let ttl = state.settings.admission.token_ttl_secs.as_secs();
    // Redis is down and this activity's purchases go to the database: a
    // signed token instead of one kept in Redis.
    match state.sale.admission.fallback.token(id, user.user_id.get()) {
        Ok(Some(token)) => {
            // A waiting room's passes are one-time in Redis: none can be
            // checked while it is down.
            if rooms
                .room_of_existing(id)
                .await
                .map_err(ApiError::unavailable)?
                .is_some()
            {
                return Err(ApiError::new(
                    ErrorCode::RetryLater,
                    "the waiting room needs Redis, which is unavailable; retry shortly",
                ));
            }
            return Ok(HttpResponse::Ok().json(PurchaseToken {
                token,
                expires_in: ttl,
            }));
        }
        Ok(None) => {}
        Err(_) => return Err(ApiError::new(ErrorCode::NotActive, "the sale is not open")),
    }
    let meta = match state
        .sale
        .activities
        .lookup(&state.redis.gate, &state.pg.db, id, &*state.clock)
        .await
        .map_err(ApiError::unavailable)?
    {
        Lookup::Warm(meta) => Some(meta),
        Lookup::Restoring => {
            state.sale.restore_wanted.notify_one();
            return Err(ApiError::new(
                ErrorCode::RetryLater,
                "the sale is being restored; retry shortly",
            ));
        }
        Lookup::NotActive => None,
    };
    let Some(meta) = meta.filter(|m| m.is_open(state.clock.now_ms())) else {
        return Err(ApiError::new(ErrorCode::NotActive, "the sale is not open"));
    };
    // Warm in Redis, so the activity exists: whether it has a room is read
    // for it, not for an id someone asked about before its creation.
    let mut most = None;
    let room = rooms
        .room_of_existing(id)
        .await
        .map_err(ApiError::unavailable)?;
    let method = room.as_ref().map(|r| r.room.method());
    if method == Some(crate::room::Method::Reject) {
        return Err(super::queue::room_error(crate::room::RoomError::Closed));
    }
    // Passthrough: the room is open without queueing, no pass asked.
    if method == Some(crate::room::Method::Fifo) {
        let pass = req
            .headers()
            .get(QUEUE_PASS)
            .map(|v| v.to_str().unwrap_or(""));
        let kind = rooms
            .redeem(id, user.user_id, pass, state.clock.now())
            .await
            .map_err(super::queue::room_error)?;
        // An offer holds one released unit: its token buys that one.
        if kind == crate::room::pass::Kind::Offer {
            most = Some(1);
        }
    }
    let token = uuid::Uuid::new_v4().simple().to_string();
    state
        .redis
        .gate
        .issue_token(id, meta.layout, user.user_id.get(), &token, ttl, most)
        .await
        .map_err(|e| ApiError::unavailable(e.into()))?;
    Ok(HttpResponse::Ok().json(PurchaseToken {
        token,
        expires_in: ttl,
    }))
}
