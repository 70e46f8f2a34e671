//! The HTTP edge: routes, extractors, the request-id / metrics middleware
//! and the single mapping from errors to the API's JSON error shape.

pub mod auth;
pub mod cache;
pub mod error;
pub mod openapi;
pub mod routes;

use std::time::Instant;

use actix_web::dev::{Service, ServiceRequest, ServiceResponse};
use actix_web::http::header::{CACHE_CONTROL, HeaderName, HeaderValue};
use actix_web::middleware::ErrorHandlers;
use actix_web::{HttpMessage, web};
use tracing::Instrument;

use crate::metrics::Metrics;
use routes::RouteLabel;

/// The request-id header, echoed when valid, generated otherwise.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The `X-Request-Id` of the current request (tracing and logs; not the
/// purchase's idempotency key, `domain::RequestId`), in its extensions.
#[derive(Debug, Clone)]
pub struct TraceId(pub String);

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

/// Request id, tracing span, HTTP metrics and the default caching policy
/// around every request.
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
    req.extensions_mut().insert(TraceId(request_id.clone()));
    let method = method_label(req.method());
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
            .with_label_values(&[route, method])
            .observe(started.elapsed().as_secs_f64());
        metrics
            .http_requests
            .with_label_values(&[route, method, res.status().as_str()])
            .inc();
        let headers = res.headers_mut();
        if let Ok(value) = HeaderValue::from_str(&request_id) {
            headers.insert(REQUEST_ID, value);
        }
        // What sets no caching policy of its own is never stored (`cache`).
        if !headers.contains_key(CACHE_CONTROL) {
            headers.insert(CACHE_CONTROL, HeaderValue::from_static(cache::DEFAULT));
        }
        Ok(res)
    }
}

/// The method as a metric label: the standard ones by name, any other
/// token a client makes up as `other` (each label value is a series kept
/// for the life of the process).
fn method_label(method: &actix_web::http::Method) -> &'static str {
    use actix_web::http::Method;
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

/// A client-supplied request id is echoed only if it is short printable
/// ASCII, so it cannot smuggle header or log injection.
fn is_valid_request_id(v: &str) -> bool {
    !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic())
}

/// A decimal id from the path (`order_no`, `payment_no`); anything else is
/// 404 with `not_found`, never 400: a malformed id names nothing that exists.
pub fn id_in_path<T>(
    raw: &str,
    parse: impl Fn(&str) -> Option<T>,
    not_found: &'static str,
) -> Result<T, error::ApiError> {
    parse(raw).ok_or_else(|| error::ApiError::not_found(not_found))
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
