//! The one mapping from failures to HTTP. Every 4xx/5xx body is an RFC 9457
//! problem, served as `application/problem+json`, that keeps the stable
//! code: `{"type": "urn:seckill:problem:SOLD_OUT", "title": "Sold out",
//! "status": 409, "detail": "…", "code": "SOLD_OUT", "message": "…"}`
//! (`message` repeats `detail` for clients written before the problem
//! fields; docs/HTTP.md).
//!
//! When to use what: handlers return [`ApiError`]. Build it from an
//! [`ErrorCode`] for outcomes the client can act on (bad input, sold out, not
//! found); wrap anything else with [`ApiError::unexpected`], which logs the
//! cause once, here at the boundary, and answers 500 without leaking it.

use std::borrow::Cow;
use std::fmt;

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::ServiceResponse;
use actix_web::http::StatusCode;
use actix_web::http::header::{self, HeaderValue};
use actix_web::middleware::ErrorHandlerResponse;
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;
use utoipa::ToSchema;

/// The media type of every error body (RFC 9457).
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Declares the error codes once: each variant, its code as clients see
/// it, and its problem title (`type` is the code's URN, made at compile
/// time, so no answer allocates for it).
macro_rules! error_codes {
    ($($variant:ident => $code:literal, $title:literal;)*) => {
        /// Stable, machine-readable error codes. Clients switch on these;
        /// never rename one.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum ErrorCode {
            $($variant,)*
        }

        impl ErrorCode {
            /// The code as it appears in JSON.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $code,)*
                }
            }

            /// The problem type (RFC 9457 `type`): `urn:seckill:problem:<code>`.
            pub fn problem_type(self) -> &'static str {
                match self {
                    $(Self::$variant => concat!("urn:seckill:problem:", $code),)*
                }
            }

            /// The problem type's short, human summary (RFC 9457 `title`):
            /// the same for every occurrence of the code.
            pub fn title(self) -> &'static str {
                match self {
                    $(Self::$variant => $title,)*
                }
            }
        }
    };
}

error_codes! {
    BadRequest => "BAD_REQUEST", "Bad request";
    Unauthorized => "UNAUTHORIZED", "Not signed in";
    Forbidden => "FORBIDDEN", "Not allowed";
    NotFound => "NOT_FOUND", "Not found";
    MethodNotAllowed => "METHOD_NOT_ALLOWED", "Method not allowed";
    PayloadTooLarge => "PAYLOAD_TOO_LARGE", "Body too large";
    UnsupportedMediaType => "UNSUPPORTED_MEDIA_TYPE", "Unsupported media type";
    NotReady => "NOT_READY", "Activity not warmed up";
    NotActive => "NOT_ACTIVE", "Activity not on sale";
    SoldOut => "SOLD_OUT", "Sold out";
    LimitExceeded => "LIMIT_EXCEEDED", "Purchase limit reached";
    InvalidToken => "INVALID_TOKEN", "Invalid purchase token";
    InvalidState => "INVALID_STATE", "Not allowed in the current state";
    CouponInvalid => "COUPON_INVALID", "Coupon not usable";
    RateLimited => "RATE_LIMITED", "Too many requests";
    Busy => "BUSY", "Orders are backed up";
    RetryLater => "RETRY_LATER", "Temporarily unavailable";
    BadSignature => "BAD_SIGNATURE", "Bad signature";
    AmountMismatch => "AMOUNT_MISMATCH", "Amount mismatch";
    CouponExhausted => "COUPON_EXHAUSTED", "Coupons all claimed";
    AlreadyClaimed => "ALREADY_CLAIMED", "Coupon already claimed";
    CouponExpired => "COUPON_EXPIRED", "Coupon expired";
    PowInvalid => "POW_INVALID", "Proof of work not accepted";
    NotInQueue => "NOT_IN_QUEUE", "No ticket in the queue";
    QueuePassRequired => "QUEUE_PASS_REQUIRED", "Queue pass required";
    QueuePassInvalid => "QUEUE_PASS_INVALID", "Queue pass not valid";
    OpenidRequired => "OPENID_REQUIRED", "The buyer's WeChat openid is needed";
    Internal => "INTERNAL", "Internal error";
}

impl ErrorCode {
    /// The HTTP status this code is answered with.
    pub fn status(self) -> StatusCode {
        match self {
            Self::BadRequest => StatusCode::BAD_REQUEST,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::Forbidden => StatusCode::FORBIDDEN,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::NotReady | Self::Busy | Self::RetryLater => StatusCode::SERVICE_UNAVAILABLE,
            Self::NotActive
            | Self::SoldOut
            | Self::LimitExceeded
            | Self::InvalidState
            | Self::CouponExhausted
            | Self::AlreadyClaimed
            | Self::CouponExpired => StatusCode::CONFLICT,
            Self::InvalidToken | Self::QueuePassRequired | Self::QueuePassInvalid => {
                StatusCode::FORBIDDEN
            }
            Self::PowInvalid | Self::OpenidRequired => StatusCode::BAD_REQUEST,
            Self::NotInQueue => StatusCode::NOT_FOUND,
            Self::CouponInvalid | Self::AmountMismatch => StatusCode::BAD_REQUEST,
            Self::BadSignature => StatusCode::UNAUTHORIZED,
            Self::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            Self::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The code a bare status (from actix itself) maps to.
    fn for_status(status: StatusCode) -> Self {
        match status {
            StatusCode::BAD_REQUEST => Self::BadRequest,
            StatusCode::UNAUTHORIZED => Self::Unauthorized,
            StatusCode::FORBIDDEN => Self::Forbidden,
            StatusCode::NOT_FOUND => Self::NotFound,
            StatusCode::METHOD_NOT_ALLOWED => Self::MethodNotAllowed,
            StatusCode::PAYLOAD_TOO_LARGE => Self::PayloadTooLarge,
            StatusCode::UNSUPPORTED_MEDIA_TYPE => Self::UnsupportedMediaType,
            StatusCode::SERVICE_UNAVAILABLE => Self::RetryLater,
            StatusCode::TOO_MANY_REQUESTS => Self::RateLimited,
            s if s.is_client_error() => Self::BadRequest,
            _ => Self::Internal,
        }
    }
}

/// The error body: an RFC 9457 problem with the stable code beside it.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Problem)]
pub struct Problem<'a> {
    /// The problem type: `urn:seckill:problem:<code>`, one per code.
    #[serde(rename = "type")]
    #[schema(value_type = String)]
    pub kind: &'a str,
    /// The problem type's summary, the same for every occurrence.
    #[schema(value_type = String)]
    pub title: &'a str,
    /// The HTTP status, repeated.
    pub status: u16,
    /// What happened this time, for a person.
    #[schema(value_type = String)]
    pub detail: &'a str,
    /// Machine-readable code; clients switch on it (docs/HTTP.md lists them).
    #[schema(value_type = String)]
    pub code: &'a str,
    /// The same text as `detail` (the field clients read before the
    /// problem fields existed).
    #[schema(value_type = String)]
    pub message: &'a str,
    /// A purchase whose delivery is not confirmed yet keeps this order
    /// number; a retry with the same request_id gets it (503 RETRY_LATER).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub order_no: Option<String>,
}

impl<'a> Problem<'a> {
    /// The problem of `code` answered with `status` (the code's own, but
    /// for a bare status from actix, e.g. 414, mapped to a nearby code).
    fn new(code: ErrorCode, status: StatusCode, detail: &'a str, order_no: Option<i64>) -> Self {
        Problem {
            kind: code.problem_type(),
            title: code.title(),
            status: status.as_u16(),
            detail,
            code: code.as_str(),
            message: detail,
            order_no: order_no.map(|o| o.to_string()),
        }
    }

    /// The body of `code` answered with `status`, as JSON.
    fn render(
        code: ErrorCode,
        status: StatusCode,
        detail: &'a str,
        order_no: Option<i64>,
    ) -> String {
        // Serialising strings and integers cannot fail.
        serde_json::to_string(&Self::new(code, status, detail, order_no)).unwrap_or_default()
    }
}

/// An error answered to the client.
#[derive(Debug)]
pub struct ApiError {
    code: ErrorCode,
    /// Static on the hot path (sold out, limit reached): no allocation.
    message: Cow<'static, str>,
    /// The order number a pending purchase keeps.
    order_no: Option<i64>,
    /// Seconds a 429 or 503 asks the client to wait (`Retry-After`); the
    /// code's default when not set.
    retry_after: Option<u32>,
}

impl ApiError {
    /// A client-visible outcome.
    pub fn new(code: ErrorCode, message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            code,
            message: message.into(),
            order_no: None,
            retry_after: None,
        }
    }

    /// The same error, naming the order a pending purchase keeps.
    pub fn with_order_no(mut self, order_no: i64) -> Self {
        self.order_no = Some(order_no);
        self
    }

    /// The same error, asking the client to retry in `secs` seconds (a 429
    /// or 503; ignored on other statuses).
    pub fn with_retry_after(mut self, secs: u32) -> Self {
        self.retry_after = Some(secs.max(1));
        self
    }

    /// A failure the client cannot act on. Logged here, once, with its cause
    /// chain; the client sees a generic 500.
    /// A database that said "not now" (a deadlock, a serialization
    /// failure, a timeout, a restart: [`crate::store::is_transient`]) is
    /// 503 RETRY_LATER instead: the request changed nothing and may be
    /// sent again.
    pub fn unexpected(error: anyhow::Error) -> Self {
        if crate::store::is_transient(&error) {
            return Self::transient(&error);
        }
        tracing::error!(error = format!("{error:#}"), "unexpected error");
        Self::new(ErrorCode::Internal, "internal error")
    }

    fn transient(error: &anyhow::Error) -> Self {
        tracing::warn!(error = format!("{error:#}"), "dependency unavailable");
        Self::new(
            ErrorCode::RetryLater,
            "a backing service is unavailable; retry later",
        )
    }

    /// A dependency (Redis, PostgreSQL, Kafka) failed: 503 RETRY_LATER, or
    /// 500 when the database answered with an error that is ours. Logged once.
    pub fn unavailable(error: anyhow::Error) -> Self {
        if error.downcast_ref::<redis::RedisError>().is_none() {
            // PostgreSQL's "not now" is answered 503 there; the rest is ours.
            return Self::unexpected(error);
        }
        Self::transient(&error)
    }

    /// 400 BAD_REQUEST.
    pub fn bad_request(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(ErrorCode::BadRequest, message)
    }

    /// 404 NOT_FOUND.
    pub fn not_found(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }

    /// The machine-readable code.
    pub fn code(&self) -> &'static str {
        self.code.as_str()
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.code.status()
    }

    fn error_response(&self) -> HttpResponse<BoxBody> {
        let mut response = HttpResponse::build(self.code.status());
        response.content_type(PROBLEM_JSON);
        if let Some(secs) = retry_after(self.code.status(), self.retry_after) {
            response.insert_header((header::RETRY_AFTER, secs));
        }
        response.body(Problem::render(
            self.code,
            self.code.status(),
            &self.message,
            self.order_no,
        ))
    }
}

/// The `Retry-After` of an answer with `status`: every 429 and 503 has one,
/// `wanted` when the refusal knew, else a second.
fn retry_after(status: StatusCode, wanted: Option<u32>) -> Option<u32> {
    matches!(
        status,
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
    )
    .then(|| wanted.unwrap_or(1).max(1))
}

/// A problem of `code` with members of its own beside the standard ones
/// (RFC 9457 extension members), such as readiness's `checks`.
pub fn problem_with(
    code: ErrorCode,
    detail: &str,
    retry_after_secs: Option<u32>,
    extra: serde_json::Map<String, serde_json::Value>,
) -> HttpResponse {
    let mut body = match serde_json::to_value(Problem::new(code, code.status(), detail, None)) {
        Ok(serde_json::Value::Object(members)) => members,
        _ => serde_json::Map::new(),
    };
    body.extend(extra);
    let mut response = HttpResponse::build(code.status());
    response.content_type(PROBLEM_JSON);
    if let Some(secs) = retry_after(code.status(), retry_after_secs) {
        response.insert_header((header::RETRY_AFTER, secs));
    }
    response.body(serde_json::Value::Object(body).to_string())
}

/// Turns actix's own extractor failures (bad JSON, unknown fields, bad path
/// or query) into 400 BAD_REQUEST with the parser's explanation.
pub fn extractor_error(err: impl fmt::Display) -> actix_web::Error {
    ApiError::bad_request(err.to_string()).into()
}

/// Marks an error answer in a payment provider's own shape (WeChat Pay's
/// `{"code": "FAIL", "message"}`): the provider reads it, not a client, so
/// it is left as it is.
pub struct ProviderAnswer;

/// Middleware hook for every 4xx/5xx: responses that are not already a
/// problem (actix's default 404, 405, payload errors) are rewritten into
/// one, so no client ever sees a plain-text error.
pub fn render_error<B: MessageBody + 'static>(
    res: ServiceResponse<B>,
) -> actix_web::Result<ErrorHandlerResponse<B>> {
    let is_problem = res
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(PROBLEM_JSON.as_bytes()));
    if is_problem || res.response().extensions().contains::<ProviderAnswer>() {
        return Ok(ErrorHandlerResponse::Response(res.map_into_left_body()));
    }
    let status = res.status();
    let code = ErrorCode::for_status(status);
    let message = match code {
        ErrorCode::NotFound => "no such route".to_owned(),
        ErrorCode::MethodNotAllowed => "method not allowed on this route".to_owned(),
        _ => res
            .response()
            .error()
            .map(|e| e.to_string())
            .unwrap_or_else(|| status.canonical_reason().unwrap_or("error").to_owned()),
    };
    let body = Problem::render(code, status, &message, None);
    let (req, mut res) = res.into_parts();
    res.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    if let Some(secs) = retry_after(status, None) {
        res.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    let res = res.set_body(body);
    Ok(ErrorHandlerResponse::Response(
        ServiceResponse::new(req, res)
            .map_into_boxed_body()
            .map_into_right_body(),
    ))
}
