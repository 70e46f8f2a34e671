//! Coupon routes: create (admin), claim, mine, stats (admin).

use actix_web::{HttpResponse, web};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::json;

use crate::bus::{PublishError, events::CouponClaimed};
use crate::coupons::gate::Claim;
use crate::coupons::repo::{self, NewCoupon};
use crate::domain::RequestId;
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
    let coupon = store::run(&state.db, move |conn| {
        repo::create(conn, &new, |c| {
            rt.block_on(
                st.coupons
                    .warm(c.id, c.total, c.valid_until.timestamp_millis()),
            )?;
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
        (status = 202, description = "coupon_id, status CLAIMED"),
        (status = 200, description = "a replayed request_id"),
        (status = 400, description = "BAD_REQUEST: a malformed body, path or query", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "COUPON_EXHAUSTED, ALREADY_CLAIMED or COUPON_EXPIRED", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn claim(
    user: AuthUser,
    state: web::Data<AppState>,
    path: web::Path<i64>,
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
    let background = state.background.clone();
    let fresh = background
        .spawn(claim_and_publish(state, coupon_id, user_id, request_id))
        .await
        .map_err(|e| ApiError::unavailable(anyhow::anyhow!("coupon claim task failed: {e}")))??;
    let claimed = json!({"coupon_id": coupon_id, "status": "CLAIMED"});
    Ok(if fresh {
        HttpResponse::Accepted().json(claimed)
    } else {
        HttpResponse::Ok().json(claimed)
    })
}

/// The claim in Redis, then its event: delivered → whether the claim is
/// new (202) or a replay (200); definitely not delivered → undone, 503;
/// unknown → kept, 503 (retry with the same request_id).
async fn claim_and_publish(
    state: web::Data<AppState>,
    coupon_id: i64,
    user_id: i64,
    request_id: String,
) -> Result<bool, ApiError> {
    let now_ms = state.clock.now_ms();
    let redis_err = |e: redis::RedisError| ApiError::unavailable(e.into());
    let fresh = match state
        .coupons
        .claim(coupon_id, user_id, &request_id, now_ms)
        .await
        .map_err(redis_err)?
    {
        Claim::Claimed => true,
        Claim::Replay => false,
        Claim::Exhausted => {
            return Err(ApiError::new(ErrorCode::CouponExhausted, "no coupons left"));
        }
        Claim::AlreadyClaimed => {
            return Err(ApiError::new(
                ErrorCode::AlreadyClaimed,
                "you already hold this coupon",
            ));
        }
        Claim::Expired => {
            return Err(ApiError::new(
                ErrorCode::CouponExpired,
                "this coupon batch has expired",
            ));
        }
        Claim::Unknown => {
            // A batch the database has and Redis lost is being restored.
            let exists = store::run(&state.db, move |conn| {
                Ok(crate::coupons::repo::find(conn, coupon_id)?.is_some())
            })
            .await
            .map_err(ApiError::unavailable)?;
            if !exists {
                return Err(ApiError::not_found("no such coupon"));
            }
            state.restore_wanted.notify_one();
            return Err(ApiError::new(
                ErrorCode::RetryLater,
                "this coupon batch is being restored; retry shortly",
            )
            .with_retry_after(1));
        }
    };
    // A replay sends the claim again too: its first delivery may have been
    // unknown. The consumer writes one row per (coupon, user) whatever the
    // number of copies.
    let event = CouponClaimed {
        event_id: format!("claim-{coupon_id}-{user_id}"),
        coupon_id,
        user_id,
        request_id,
        claimed_at_ms: now_ms,
    };
    let key = user_id.to_string();
    let topic = &state.topics.coupon_claimed;
    let payload = event.encode();
    // At most the publish budget; past it the outcome is unknown (the
    // message may still be delivered, and the claim is kept for it).
    let published = tokio::time::timeout(
        state.publisher.budget,
        state.producer.publish(topic, &key, &payload, None),
    )
    .await
    .unwrap_or(Err(PublishError::Unknown(
        rdkafka::error::KafkaError::MessageProduction(
            rdkafka::error::RDKafkaErrorCode::MessageTimedOut,
        ),
    )));
    match published {
        Ok(()) => {
            // Not confirmed here (a Redis error), the reconciler sends the
            // claim once more: a duplicate the consumer ignores.
            if let Err(e) = state
                .coupons
                .confirm(coupon_id, user_id, &event.request_id)
                .await
            {
                tracing::warn!(error = %e, coupon_id, user_id, "confirming a delivered coupon claim failed");
            }
            Ok(fresh)
        }
        Err(e @ (PublishError::QueueFull | PublishError::NotDelivered(_))) if fresh => {
            tracing::warn!(error = %e, coupon_id, user_id, "coupon claim not delivered; undoing the claim");
            if let Err(e) = state
                .coupons
                .unclaim(coupon_id, user_id, &event.request_id)
                .await
            {
                tracing::error!(error = %e, coupon_id, user_id, "undoing a coupon claim failed");
            }
            Err(ApiError::new(
                ErrorCode::RetryLater,
                "the claim could not be recorded; nothing was kept",
            ))
        }
        // Unknown (or a replay's send failed): the claim stays, a retry with
        // the same request_id sends it again.
        Err(e) => {
            tracing::warn!(error = %e, coupon_id, user_id, "coupon claim delivery unconfirmed; the claim is kept");
            Err(ApiError::new(
                ErrorCode::RetryLater,
                "the claim is not confirmed yet; retry with the same request_id",
            ))
        }
    }
}

/// `GET /api/v1/coupons/mine`.
#[utoipa::path(get, path = "/api/v1/coupons/mine", tag = "coupons",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "coupons"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn mine(user: AuthUser, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let user_id = user.user_id.get();
    let coupons = store::run(&state.db, move |conn| Ok(repo::mine(conn, user_id)?))
        .await
        .map_err(ApiError::unavailable)?;
    Ok(HttpResponse::Ok().json(json!({"coupons": coupons})))
}

/// `GET /api/v1/admin/coupons/{id}/stats`: Redis and database figures.
#[utoipa::path(get, path = "/api/v1/admin/coupons/{id}/stats", tag = "coupons",
    params(("id" = i64, Path, description = "coupon batch id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Redis and database figures"),
        (status = 400, description = "BAD_REQUEST: a malformed body, path or query", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "FORBIDDEN: not an admin", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn stats(
    _admin: AdminUser,
    state: web::Data<AppState>,
    path: web::Path<i64>,
) -> Result<HttpResponse, ApiError> {
    let id = path.into_inner();
    let (found, counts) = store::run(&state.db, move |conn| {
        Ok((repo::find(conn, id)?, repo::status_counts(conn, id)?))
    })
    .await
    .map_err(ApiError::unavailable)?;
    let (coupon, claimed) = found.ok_or_else(|| ApiError::not_found("no such coupon"))?;
    let remaining = state
        .coupons
        .remaining(id)
        .await
        .map_err(|e| ApiError::unavailable(e.into()))?;
    let mut by_status = json!({"UNUSED": 0, "LOCKED": 0, "USED": 0});
    for (status, n) in counts {
        by_status[status] = json!(n);
    }
    Ok(HttpResponse::Ok().json(json!({
        "coupon_id": coupon.id,
        "total": coupon.total,
        "redis_remaining": remaining,
        "db_claimed": claimed,
        "user_coupons": by_status,
    })))
}
