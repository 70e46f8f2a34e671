//! The HTTP routes, one file per resource family. Handlers parse and
//! authorize the request, call the domain, and map its answer to the API's
//! shape; the domain modules know nothing of HTTP.

mod activities;
mod coupons;
mod health;
mod orders;
mod payments;
mod reconcile;

use actix_web::dev::{Service, ServiceRequest, ServiceResponse};
use actix_web::{HttpMessage, HttpResponse, web};

use super::auth::{AdminUser, AuthUser};
use super::error::ApiError;

/// Registers every route. Shared by the server and the tests.
pub fn configure(cfg: &mut web::ServiceConfig) {
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
        .service(resource("/api/v1/admin/reconcile").post(reconcile::run))
        .service(resource("/api/v1/admin/coupons").post(coupons::create))
        .service(resource("/api/v1/admin/coupons/{id}/stats").get(coupons::stats))
        .service(resource("/api/v1/coupons/mine").get(coupons::mine))
        .service(resource("/api/v1/coupons/{id}/claim").post(coupons::claim));
}

/// The pattern of the resource a request was routed to: the route label
/// of the HTTP metrics, set by the resource itself ([`resource`]) so the
/// path is never matched against the router a second time.
#[derive(Clone, Copy)]
pub(super) struct RouteLabel(pub(super) &'static str);

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

/// `GET /api/v1/openapi.json`.
async fn openapi() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/json")
        .body(include_str!("../../../docs/openapi.json"))
}

/// `GET /api/v1/me`: who the token says the caller is (lets a client or an
/// operator check a token without side effects).
async fn me(user: AuthUser) -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({"user_id": user.user_id, "role": user.role}))
}

/// `GET /api/v1/admin/me`: the same, but only for admins.
async fn admin_me(admin: AdminUser) -> HttpResponse {
    me(admin.0).await
}

/// Fallback for unknown routes: 404 NOT_FOUND in the error shape.
pub async fn not_found() -> Result<HttpResponse, ApiError> {
    Err(ApiError::not_found("no such route"))
}
