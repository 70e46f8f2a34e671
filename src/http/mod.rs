//! The HTTP edge: routes, extractors, the request-id / metrics middleware
//! and the single mapping from errors to the API's JSON error shape.

pub mod auth;
pub mod error;
pub mod health;

use std::time::Instant;

use actix_web::dev::{Service, ServiceRequest, ServiceResponse};
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::middleware::ErrorHandlers;
use actix_web::{HttpMessage, HttpResponse, web};
use tracing::Instrument;

use crate::activities::routes as activities;
use crate::coupons::routes as coupons;
use crate::metrics::Metrics;
use crate::orders::routes as orders;
use crate::payments::routes as payments;

/// The request-id header, echoed when valid, generated otherwise.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The request id of the current request, in its extensions.
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

/// Registers every route. Shared by the server and the tests.
pub fn routes(cfg: &mut web::ServiceConfig) {
    // `web::resource` (not `cfg.route`) so a known path with the wrong method
    // answers 405, not 404.
    // The purchase first: the router tries resources in this order, each
    // dynamic one a regex match, and nearly every request of a sale is
    // this one. No other pattern overlaps it.
    cfg.service(resource("/api/v1/activities/{id}/orders").post(orders::place))
        .service(resource("/health/live").get(health::live))
        .service(resource("/health/ready").get(health::ready))
        .service(resource("/metrics").get(health::metrics))
        .service(resource("/api/v1/openapi.json").get(openapi))
        .service(resource("/api/v1/me").get(me))
        .service(resource("/api/v1/admin/me").get(admin_me))
        .service(resource("/api/v1/admin/activities").post(activities::create))
        .service(resource("/api/v1/admin/activities/{id}/warmup").post(activities::warmup))
        .service(resource("/api/v1/admin/activities/{id}/stats").get(activities::stats))
        .service(resource("/api/v1/activities/{id}").get(activities::show))
        .service(resource("/api/v1/activities/{id}/token").get(activities::token))
        .service(resource("/api/v1/orders").get(orders::list))
        .service(resource("/api/v1/orders/{order_no}").get(orders::show))
        .service(resource("/api/v1/orders/{order_no}/cancel").post(orders::cancel))
        .service(resource("/api/v1/orders/{order_no}/pay").post(payments::pay))
        .service(resource("/api/v1/payments/notify").post(payments::notify))
        .service(resource("/api/v1/dev/payments/{payment_no}/simulate").post(payments::simulate))
        .service(resource("/api/v1/admin/reconcile").post(crate::reconcile::route))
        .service(resource("/api/v1/admin/coupons").post(coupons::create))
        .service(resource("/api/v1/admin/coupons/{id}/stats").get(coupons::stats))
        .service(resource("/api/v1/coupons/mine").get(coupons::mine))
        .service(resource("/api/v1/coupons/{id}/claim").post(coupons::claim));
}

/// The pattern of the resource a request was routed to: the route label
/// of the HTTP metrics, set by the resource itself ([`resource`]) so the
/// path is never matched against the router a second time.
#[derive(Clone, Copy)]
struct RouteLabel(&'static str);

/// `web::resource(path)`, labelling its requests with `path`.
fn resource(
    path: &'static str,
) -> actix_web::Resource<
    impl actix_web::dev::ServiceFactory<
        ServiceRequest,
        Config = (),
        Response = ServiceResponse,
        Error = actix_web::Error,
        InitError = (),
    >,
> {
    web::resource(path).wrap_fn(move |req, srv| {
        req.extensions_mut().insert(RouteLabel(path));
        tracing::Span::current().record("route", path);
        srv.call(req)
    })
}

/// Extractor configs whose failures answer in the API error shape.
pub fn extractor_configs(cfg: &mut web::ServiceConfig) {
    cfg.app_data(
        web::JsonConfig::default()
            .limit(16 * 1024)
            .error_handler(|err, _| error::extractor_error(err)),
    )
    // A path id that is not a number: 400 in our words, not the
    // extractor's.
    .app_data(web::PathConfig::default().error_handler(|_, _| {
        error::ApiError::bad_request("the id in the path must be a decimal integer").into()
    }))
    .app_data(web::QueryConfig::default().error_handler(|err, _| error::extractor_error(err)));
}

/// The JSON error rewriting for every 4xx/5xx actix produces itself.
pub fn error_handlers<B: actix_web::body::MessageBody + 'static>() -> ErrorHandlers<B> {
    ErrorHandlers::new()
        .default_handler_client(error::render_error)
        .default_handler_server(error::render_error)
}

/// Request id, tracing span and HTTP metrics around every request.
pub fn observe<S, B>(
    req: ServiceRequest,
    srv: &S,
    metrics: std::sync::Arc<Metrics>,
) -> impl Future<Output = Result<ServiceResponse<B>, actix_web::Error>> + use<S, B>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>,
    S::Future: 'static,
{
    let request_id = req
        .headers()
        .get(&REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| is_valid_request_id(v))
        .map(str::to_owned)
        // Not a secret: a thread-local PRNG, no getrandom syscall per request.
        .unwrap_or_else(|| format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..)));
    req.extensions_mut().insert(RequestId(request_id.clone()));
    let method = req.method().clone();
    let span = tracing::info_span!(
        "http",
        request_id = %request_id,
        method = %method,
        route = tracing::field::Empty
    );
    let started = Instant::now();
    let call = srv.call(req).instrument(span);
    async move {
        let mut res = call.await?;
        let route = res
            .request()
            .extensions()
            .get::<RouteLabel>()
            .map_or("unmatched", |r| r.0);

        metrics
            .http_duration
            .with_label_values(&[route, method.as_str()])
            .observe(started.elapsed().as_secs_f64());
        metrics
            .http_requests
            .with_label_values(&[route, method.as_str(), res.status().as_str()])
            .inc();
        if let Ok(value) = HeaderValue::from_str(&request_id) {
            res.headers_mut().insert(REQUEST_ID, value);
        }
        Ok(res)
    }
}

/// A client-supplied request id is echoed only if it is short printable
/// ASCII, so it cannot smuggle header or log injection.
fn is_valid_request_id(v: &str) -> bool {
    !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic())
}

/// `GET /api/v1/openapi.json`.
async fn openapi() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/json")
        .body(include_str!("../../docs/openapi.json"))
}

/// `GET /api/v1/me`: who the token says the caller is (lets a client or an
/// operator check a token without side effects).
async fn me(user: auth::AuthUser) -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({"user_id": user.user_id, "role": user.role}))
}

/// `GET /api/v1/admin/me`: the same, but only for admins.
async fn admin_me(admin: auth::AdminUser) -> HttpResponse {
    me(admin.0).await
}

/// A decimal id from the path (`order_no`, `payment_no`); anything else is
/// 404 with `not_found`, never 400: a malformed id names nothing that exists.
pub fn id_in_path(raw: &str, not_found: &'static str) -> Result<i64, error::ApiError> {
    crate::ids::OrderNo::parse(raw)
        .map(crate::ids::OrderNo::get)
        .ok_or_else(|| error::ApiError::not_found(not_found))
}

/// Fallback for unknown routes: 404 NOT_FOUND in the error shape.
pub async fn not_found() -> Result<HttpResponse, error::ApiError> {
    Err(error::ApiError::not_found("no such route"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_echoed_only_when_harmless() {
        assert!(is_valid_request_id("c0a8-01"));
        assert!(!is_valid_request_id(""));
        assert!(!is_valid_request_id("has space"));
        assert!(!is_valid_request_id("line\nbreak"));
        assert!(!is_valid_request_id(&"x".repeat(129)));
    }
}
