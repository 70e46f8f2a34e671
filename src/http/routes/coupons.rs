//! Coupon routes: create (admin), claim, mine, stats (admin).

use actix_web::{HttpResponse, web};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::coupons::claim::{ClaimRefusal, Claimed};
use crate::coupons::repo::{self, NewCoupon};
use crate::domain::{CouponId, RequestId};
use crate::http::auth::{AdminUser, AuthUser};
use crate::http::error::{ApiError, ErrorCode, Problem};
use crate::state::AppState;
use crate::store;

/// `POST /api/v1/admin/coupons` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateCoupon {
    /// 1..=200 characters.
    name: String,
    /// Coupons in the batch.
    #[schema(minimum = 1)]
    total: i32,
    /// What one coupon takes off an order.
    #[schema(minimum = 1)]
    discount_cents: i64,
    /// The smallest order it applies to.
    #[serde(default)]
    #[schema(minimum = 0, default = 0)]
    min_amount_cents: i64,
    /// Coupons per user (only 1 is supported).
    #[serde(default = "one")]
    #[schema(minimum = 1, maximum = 1, default = 1)]
    per_user_limit: i32,
    /// When unclaimed and unused coupons stop being usable.
    valid_until: DateTime<Utc>,
}

fn one() -> i32 {
    1
}

impl CreateCoupon {
    fn validate(self, now: DateTime<Utc>) -> Result<NewCoupon, ApiError> {
        let name = self.name.trim().to_owned();
        if name.is_empty() || name.chars().count() > 200 {
            return Err(ApiError::bad_request("name must be 1..=200 characters"));
        }
        if self.total < 1 {
            return Err(ApiError::bad_request("total must be at least 1"));
        }
        if self.discount_cents < 1 {
            return Err(ApiError::bad_request("discount_cents must be at least 1"));
        }
        if self.min_amount_cents < 0 {
            return Err(ApiError::bad_request(
                "min_amount_cents must not be negative",
            ));
        }
        if self.per_user_limit != 1 {
            // user_coupons is unique per (coupon_id, user_id): one per user.
            return Err(ApiError::bad_request("per_user_limit must be 1"));
        }
        if self.valid_until <= now {
            return Err(ApiError::bad_request("valid_until must be in the future"));
        }
        Ok(NewCoupon {
            name,
            total: self.total,
            discount_cents: self.discount_cents,
            min_amount_cents: self.min_amount_cents,
            per_user_limit: self.per_user_limit,
            valid_until: self.valid_until,
        })
    }
}

/// `POST /api/v1/admin/coupons` → 201; the batch is in Redis before the row
/// commits, so a claim can never meet a batch that is only half there.
#[utoipa::path(post, path = "/api/v1/admin/coupons", tag = "coupons",
    request_body = CreateCoupon,
    security(("bearer" = [])),
    responses(
        (status = 201, description = "the batch"),
        (status = 400, description = "BAD_REQUEST: a malformed body, path or query", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "FORBIDDEN: not an admin", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn create(
    _admin: AdminUser,
    state: web::Data<AppState>,
    body: web::Json<CreateCoupon>,
) -> Result<HttpResponse, ApiError> {
    let new = body.into_inner().validate(state.clock.now())?;
    let rt = tokio::runtime::Handle::current();
    let st = state.clone();
    let coupon = store::run(&state.pg.db, move |conn| {
        repo::create(conn, &new, |c| {
            rt.block_on(st.redis.coupons.warm(
                c.id,
                c.total,
                c.valid_until.timestamp_millis(),
                c.min_amount_cents,
            ))?;
            Ok(())
        })
    })
    .await
    .map_err(ApiError::unavailable)?;
    Ok(HttpResponse::Created().json(coupon))
}

/// `POST /api/v1/coupons/{id}/claim` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClaimBody {
    /// The client's key for this claim: a retry with the same one is a replay.
    #[schema(min_length = 1, max_length = 64)]
    request_id: String,
}

/// `POST /api/v1/coupons/{id}/claim`: one Lua call, then `coupon.claimed`;
/// if the publish fails the claim is undone and the answer is 503.
#[utoipa::path(post, path = "/api/v1/coupons/{id}/claim", tag = "coupons",
    params(("id" = i64, Path, description = "coupon batch id")),
    request_body = ClaimBody,
    security(("bearer" = [])),
    responses(
        (status = 202, description = "claimed", body = ClaimAnswer),
        (status = 200, description = "a replayed request_id", body = ClaimAnswer),
        (status = 400, description = "BAD_REQUEST: a malformed body, path or query", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "COUPON_EXHAUSTED, ALREADY_CLAIMED or COUPON_EXPIRED", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn claim(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<CouponId>,
    body: web::Json<ClaimBody>,
) -> Result<HttpResponse, ApiError> {
    let coupon_id = path.into_inner();
    let request_id = RequestId::parse_owned(body.into_inner().request_id)
        .ok_or_else(|| {
            ApiError::bad_request("request_id must be 1..=64 printable ASCII characters")
        })?
        .into_string();
    let user_id = user.user_id.get();
    // The claim and its publish-or-undo run in a task of their own, on the
    // main runtime: a dropped request (a client gone, a shutdown out of
    // time) drops this handler, not the task, so a claim is never left
    // taken in Redis with its event neither sent nor undone.
    let claims = state.sale.claims.clone();
    let claimed = state
        .background
        .spawn(async move { claims.claim(coupon_id, user_id, request_id).await })
        .await
        .map_err(|e| ApiError::unavailable(anyhow::anyhow!("coupon claim task failed: {e}")))?
        .map_err(refused)?;
    let body = ClaimAnswer {
        coupon_id,
        status: "CLAIMED",
    };
    Ok(match claimed {
        Claimed::New => HttpResponse::Accepted().json(body),
        Claimed::Replay => HttpResponse::Ok().json(body),
    })
}

/// A claim's answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct ClaimAnswer {
    #[schema(value_type = i64)]
    coupon_id: CouponId,
    /// Always CLAIMED.
    status: &'static str,
}

/// `GET /api/v1/coupons/mine`'s answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct MyCoupons {
    coupons: Vec<repo::Mine>,
}

/// A coupon batch's figures, from Redis and the database.
#[derive(Debug, Serialize, ToSchema)]
pub struct CouponStats {
    #[schema(value_type = i64)]
    coupon_id: CouponId,
    total: i32,
    /// What Redis has left to claim; null while Redis has lost the batch.
    redis_remaining: Option<i64>,
    /// Claims written to the database.
    db_claimed: i32,
    user_coupons: UserCouponCounts,
}

/// The batch's user coupons by state.
#[derive(Debug, Default, Serialize, ToSchema)]
#[serde(rename_all = "UPPERCASE")]
pub struct UserCouponCounts {
    unused: i64,
    locked: i64,
    used: i64,
}

/// The one mapping from a refused claim to its answer.
fn refused(refusal: ClaimRefusal) -> ApiError {
    match refusal {
        ClaimRefusal::Exhausted => ApiError::new(ErrorCode::CouponExhausted, "no coupons left"),
        ClaimRefusal::AlreadyClaimed => {
            ApiError::new(ErrorCode::AlreadyClaimed, "you already hold this coupon")
        }
        ClaimRefusal::Expired => {
            ApiError::new(ErrorCode::CouponExpired, "this coupon batch has expired")
        }
        ClaimRefusal::NotFound => ApiError::not_found("no such coupon"),
        ClaimRefusal::Restoring => ApiError::new(
            ErrorCode::RetryLater,
            "this coupon batch is being restored; retry shortly",
        )
        .with_retry_after(1),
        ClaimRefusal::NotKept => ApiError::new(
            ErrorCode::RetryLater,
            "the claim could not be recorded; nothing was kept",
        ),
        ClaimRefusal::Unconfirmed => ApiError::new(
            ErrorCode::RetryLater,
            "the claim is not confirmed yet; retry with the same request_id",
        ),
        ClaimRefusal::Unavailable(e) => ApiError::unavailable(e),
    }
}

/// `GET /api/v1/coupons/mine`.
#[utoipa::path(get, path = "/api/v1/coupons/mine", tag = "coupons",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "the caller's coupons, newest claim first", body = MyCoupons),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn mine(user: AuthUser, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let user_id = user.user_id.get();
    let coupons = store::run(&state.pg.db, move |conn| Ok(repo::mine(conn, user_id)?))
        .await
        .map_err(ApiError::unavailable)?;
    Ok(HttpResponse::Ok().json(MyCoupons { coupons }))
}

/// `GET /api/v1/admin/coupons/{id}/stats`: Redis and database figures.
#[utoipa::path(get, path = "/api/v1/admin/coupons/{id}/stats", tag = "coupons",
    params(("id" = i64, Path, description = "coupon batch id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Redis and database figures", body = CouponStats),
        (status = 400, description = "BAD_REQUEST: a malformed body, path or query", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "FORBIDDEN: not an admin", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn stats(
    _admin: AdminUser,
    state: web::Data<AppState>,
    path: web::Path<CouponId>,
) -> Result<HttpResponse, ApiError> {
    let id = path.into_inner();
    let (found, counts) = store::run(&state.pg.db, move |conn| {
        Ok((repo::find(conn, id)?, repo::status_counts(conn, id)?))
    })
    .await
    .map_err(ApiError::unavailable)?;
    let (coupon, claimed) = found.ok_or_else(|| ApiError::not_found("no such coupon"))?;
    let remaining = state
        .redis
        .coupons
        .remaining(id)
        .await
        .map_err(|e| ApiError::unavailable(e.into()))?;
    let mut user_coupons = UserCouponCounts::default();
    for (status, n) in counts {
        match status.as_str() {
            "UNUSED" => user_coupons.unused = n,
            "LOCKED" => user_coupons.locked = n,
            "USED" => user_coupons.used = n,
            other => tracing::warn!(status = other, "a user coupon in an unknown state"),
        }
    }
    Ok(HttpResponse::Ok().json(CouponStats {
        coupon_id: coupon.id,
        total: coupon.total,
        redis_remaining: remaining,
        db_claimed: claimed,
        user_coupons,
    }))
}
