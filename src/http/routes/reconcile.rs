//! `POST /api/v1/admin/reconcile`.

use std::time::{Duration, Instant};

use actix_web::{HttpResponse, web};
use serde_json::json;

use crate::http::auth::AdminUser;
use crate::http::error::{ApiError, ErrorCode};
use crate::state::AppState;

/// Reconciles every recent activity now, waiting a little for the lease if
/// another run holds it.
pub async fn run(_admin: AdminUser, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let reconciler = state.reconciler();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match reconciler.run().await.map_err(ApiError::unavailable)? {
            Some(reports) => return Ok(HttpResponse::Ok().json(json!({"activities": reports}))),
            None if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            None => {
                return Err(ApiError::new(
                    ErrorCode::RetryLater,
                    "another instance is reconciling; retry shortly",
                ));
            }
        }
    }
}
