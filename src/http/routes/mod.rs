//! The HTTP routes, one file per resource family. Handlers parse and
//! authorize the request, call the domain, and map its answer to the API's
//! shape; the domain modules know nothing of HTTP.

pub(super) mod activities;
pub(super) mod console;
pub(super) mod coupons;
pub(super) mod health;
pub(super) mod orders;
pub(super) mod payments;
pub(super) mod queue;
pub(super) mod reconcile;
pub(super) mod streams;

use actix_web::dev::{Service, ServiceRequest, ServiceResponse};
use actix_web::{HttpMessage, HttpResponse, web};
use serde::Deserialize;
use utoipa::ToSchema;

use super::auth::{AdminUser, AuthUser, JwtKeys, Role};
use super::error::{ApiError, Problem};
use crate::state::AppState;

/// The one list of routes: `configure` registers them and [`ROUTES`] names
/// them, so the OpenAPI test (`http::openapi`) checks the router itself,
/// not a copy of it. One line per path, its methods joined by `|`: a second
/// resource with the same path would never be reached.
macro_rules! routes {
    ($($method:ident $(| $more:ident)* $path:literal => $handler:path $(| $more_handler:path)*;)*) => {
        /// Every route the router serves, as `(method, path pattern)`.
        pub const ROUTES: &[(&str, &str)] = &[
            $((stringify!($method), $path), $((stringify!($more), $path),)*)*
        ];

        /// Every resource (path pattern) of the router, once each.
        pub const RESOURCES: &[&str] = &[$($path),*];

        /// Registers every route. Shared by the server and the tests.
        pub fn configure(cfg: &mut web::ServiceConfig) {
            // `web::resource` (not `cfg.route`) so a known path with the
            // wrong method answers 405, not 404.
            $(cfg.service(resource($path).$method($handler)$(.$more($more_handler))*);)*
        }
    };
}

// The purchase first: the router tries resources in this order, each
// dynamic one a regex match, and nearly every request of a sale is this
// one. No other pattern overlaps it.
routes! {
    post "/api/v1/activities/{id}/orders" => orders::place;
    get "/health/live" => health::live;
    get "/health/ready" => health::ready;
    get "/metrics" => health::metrics;
    get "/api/v1/openapi.json" => openapi;
    get "/api/v1/me" => me;
    get "/api/v1/admin/me" => admin_me;
    post "/api/v1/admin/activities" => activities::create;
    post "/api/v1/admin/activities/{id}/warmup" => activities::warmup;
    get "/api/v1/admin/activities/{id}/stats" => activities::stats;
    post "/api/v1/admin/activities/{id}/end" => activities::end;
    get "/api/v1/activities" => activities::list;
    get "/api/v1/activities/{id}" => activities::show;
    get "/api/v1/activities/{id}/token" => activities::token;
    get "/api/v1/activities/{id}/queue/challenge" => queue::challenge;
    post "/api/v1/activities/{id}/queue" => queue::join;
    get | delete "/api/v1/activities/{id}/queue/me" => queue::me | queue::leave;
    get "/api/v1/activities/{id}/queue/events" => queue::events;
    get "/api/v1/activities/{id}/queue/draw" => queue::draw;
    patch "/api/v1/admin/activities/{id}/waiting-room" => queue::set_rate;
    get "/api/v1/orders" => orders::list;
    get "/api/v1/orders/{order_no}" => orders::show;
    get "/api/v1/orders/{order_no}/events" => streams::order_events;
    post "/api/v1/orders/{order_no}/cancel" => orders::cancel;
    post "/api/v1/orders/{order_no}/pay" => payments::pay;
    get "/api/v1/orders/{order_no}/pay/qr" => payments::pay_qr;
    post "/api/v1/payments/notify" => payments::notify;
    post "/api/v1/payments/notify/wechatpay" => payments::notify_wechatpay;
    post "/api/v1/payments/notify/stripe" => payments::notify_stripe;
    post "/api/v1/admin/orders/{order_no}/refund" => payments::refund;
    post "/api/v1/admin/payments/statement" => payments::statement;
    get "/api/v1/admin/payments/statements" => payments::statements;
    post "/api/v1/dev/payments/{payment_no}/simulate" => payments::simulate;
    post "/api/v1/dev/token" => dev_token;
    post "/api/v1/admin/reconcile" => reconcile::run;
    get "/api/v1/admin/reconcile/last" => reconcile::last;
    post "/api/v1/admin/coupons" => coupons::create;
    get "/api/v1/admin/coupons/{id}/stats" => coupons::stats;
    get "/api/v1/coupons/mine" => coupons::mine;
    post "/api/v1/coupons/{id}/claim" => coupons::claim;
    get "/console" => console::root;
    get "/console/{file:.*}" => console::file;
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

/// `GET /api/v1/openapi.json`: this API's OpenAPI document, generated from
/// the routes' own annotations (`http::openapi`).
#[utoipa::path(get, path = "/api/v1/openapi.json", tag = "meta",
    responses((status = 200, description = "OpenAPI 3.1", content_type = "application/json")))]
async fn openapi(document: web::Data<OpenApiJson>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/json")
        .body(document.0)
}

/// The OpenAPI document, handed to the routes by the assembly: the
/// document is made from the routes (`http::openapi`), so the routes do
/// not reach for it themselves.
pub struct OpenApiJson(pub &'static str);

/// `GET /api/v1/me`: who the token says the caller is (lets a client or an
/// operator check a token without side effects).
#[utoipa::path(get, path = "/api/v1/me", tag = "meta", security(("bearer" = [])),
    responses(
        (status = 200, description = "who the token says the caller is", body = Me),
        (status = 401, description = "UNAUTHORIZED", body = Problem, content_type = "application/problem+json"),
    ))]
async fn me(user: AuthUser) -> HttpResponse {
    HttpResponse::Ok().json(Me {
        user_id: user.user_id,
        role: user.role,
    })
}

/// Who a token says its bearer is.
#[derive(Debug, serde::Serialize, ToSchema)]
pub struct Me {
    #[schema(value_type = i64)]
    user_id: crate::domain::UserId,
    /// user or admin.
    #[schema(value_type = String)]
    role: Role,
}

/// A development token's answer.
#[derive(Debug, serde::Serialize, ToSchema)]
pub struct DevTokenAnswer {
    token: String,
    user_id: i64,
    /// user or admin.
    #[schema(value_type = String)]
    role: Role,
    /// Seconds the token is valid for.
    expires_in: i64,
}

/// `GET /api/v1/admin/me`: the same, but only for admins.
#[utoipa::path(get, path = "/api/v1/admin/me", tag = "meta", security(("bearer" = [])),
    responses(
        (status = 200, description = "user_id and role"),
        (status = 401, description = "UNAUTHORIZED", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "FORBIDDEN: not an admin", body = Problem, content_type = "application/problem+json"),
    ))]
async fn admin_me(admin: AdminUser) -> HttpResponse {
    me(admin.0).await
}

/// `POST /api/v1/dev/token` body.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DevToken {
    /// Who the token is for.
    #[schema(minimum = 1)]
    user_id: i64,
    /// An admin token (the operator page) rather than a shopper's.
    #[serde(default)]
    admin: bool,
}

/// How long a development token lives.
const DEV_TOKEN_TTL_SECS: i64 = 3600;

/// `POST /api/v1/dev/token`: a token for any user, so the web console
/// signs in without an identity provider. Served only when `app.env =
/// development`; elsewhere the route does not exist (404).
#[utoipa::path(post, path = "/api/v1/dev/token", tag = "dev", request_body = DevToken,
    responses(
        (status = 200, description = "a token (development only)", body = DevTokenAnswer),
        (status = 400, description = "BAD_REQUEST", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "NOT_FOUND: not a development server", body = Problem, content_type = "application/problem+json"),
    ))]
async fn dev_token(
    state: web::Data<AppState>,
    keys: web::Data<JwtKeys>,
    body: web::Json<DevToken>,
) -> Result<HttpResponse, ApiError> {
    // Nor with an identity provider: only it issues tokens then.
    if state.settings.app.env != crate::config::Environment::Development
        || keys.provider().is_some()
    {
        return Err(ApiError::not_found("no such route"));
    }
    if body.user_id < 1 {
        return Err(ApiError::bad_request("user_id must be positive"));
    }
    let role = if body.admin { Role::Admin } else { Role::User };
    let token = keys
        .mint(body.user_id, role, DEV_TOKEN_TTL_SECS)
        .map_err(ApiError::unexpected)?;
    Ok(HttpResponse::Ok().json(DevTokenAnswer {
        token,
        user_id: body.user_id,
        role,
        expires_in: DEV_TOKEN_TTL_SECS,
    }))
}

/// Fallback for unknown routes: 404 NOT_FOUND in the error shape.
pub async fn not_found() -> Result<HttpResponse, ApiError> {
    Err(ApiError::not_found("no such route"))
}
