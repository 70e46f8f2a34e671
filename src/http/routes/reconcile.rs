//! `POST /api/v1/admin/reconcile`.

use std::time::{Duration, Instant};

use actix_web::{HttpResponse, web};
use serde::Serialize;
use utoipa::ToSchema;

use crate::http::auth::AdminUser;
use crate::http::error::{ApiError, ErrorCode, Problem};
use crate::reconcile::Report;
use crate::state::AppState;

/// Reconciles every recent activity now, waiting a little for the lease if
/// another run holds it.
#[utoipa::path(post, path = "/api/v1/admin/reconcile", tag = "reconcile",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "what each recent activity's reconciliation found and did", body = Reconciled),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "FORBIDDEN: not an admin", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn run(_admin: AdminUser, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let reconciler = state.reconciler();
    // On a task of its own: a client that hangs up drops this request's
    // future, and a run dropped halfway would leave its work half done.
    // The run ends as it would have; only its answer goes unheard.
    let running = tokio::spawn(async move {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match reconciler.run().await? {
                Some(activities) => return Ok(Some(activities)),
                None if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                None => return Ok::<_, anyhow::Error>(None),
            }
        }
    });
    match running
        .await
        .map_err(|e| ApiError::unavailable(anyhow::anyhow!(e)))?
    {
        Ok(Some(activities)) => Ok(HttpResponse::Ok().json(Reconciled { activities })),
        Ok(None) => Err(ApiError::new(
            ErrorCode::RetryLater,
            "another instance is reconciling; retry shortly",
        )),
        Err(e) => Err(ApiError::unavailable(e)),
    }
}

/// `GET /api/v1/admin/reconcile/last`: the report of the last
/// reconciliation run, whichever instance ran it (kept in Redis), or `null`.
#[utoipa::path(get, path = "/api/v1/admin/reconcile/last", tag = "reconcile",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "the last run: at, by, activities (null when none is kept)", body = LastRun),
        (status = 401, description = "UNAUTHORIZED: no valid bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "FORBIDDEN: not an admin", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "RETRY_LATER: a backing service is unavailable", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn last(_admin: AdminUser, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let report = state
        .reconciler()
        .last_report()
        .await
        .map_err(ApiError::unavailable)?;
    Ok(HttpResponse::Ok().json(LastRun { last: report }))
}

/// A run's answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct Reconciled {
    activities: Vec<Report>,
}

/// The last run's report, as the instance that ran it kept it.
#[derive(Debug, Serialize, ToSchema)]
pub struct LastRun {
    /// `{at, by, activities}`; null when none is kept.
    #[schema(value_type = Option<Object>)]
    last: Option<serde_json::Value>,
}
