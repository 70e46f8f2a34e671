//! The one mapping from failures to HTTP. Every 4xx/5xx body is
//! `{"code": "SOME_CODE", "message": "human text"}` (docs/HTTP.md).
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

/// Stable, machine-readable error codes. Clients switch on these; never
/// rename one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    BadRequest,
    Unauthorized,
    Forbidden,
    NotFound,
    MethodNotAllowed,
    PayloadTooLarge,
    UnsupportedMediaType,
    NotReady,
    NotActive,
    SoldOut,
    LimitExceeded,
    InvalidToken,
    InvalidState,
    CouponInvalid,
    RateLimited,
    Busy,
    RetryLater,
    BadSignature,
    AmountMismatch,
    CouponExhausted,
    AlreadyClaimed,
    CouponExpired,
    Internal,
}

impl ErrorCode {
    /// The code as it appears in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BadRequest => "BAD_REQUEST",
            Self::Unauthorized => "UNAUTHORIZED",
            Self::Forbidden => "FORBIDDEN",
            Self::NotFound => "NOT_FOUND",
            Self::MethodNotAllowed => "METHOD_NOT_ALLOWED",
            Self::PayloadTooLarge => "PAYLOAD_TOO_LARGE",
            Self::UnsupportedMediaType => "UNSUPPORTED_MEDIA_TYPE",
            Self::NotReady => "NOT_READY",
            Self::NotActive => "NOT_ACTIVE",
            Self::SoldOut => "SOLD_OUT",
            Self::LimitExceeded => "LIMIT_EXCEEDED",
            Self::InvalidToken => "INVALID_TOKEN",
            Self::InvalidState => "INVALID_STATE",
            Self::CouponInvalid => "COUPON_INVALID",
            Self::RateLimited => "RATE_LIMITED",
            Self::Busy => "BUSY",
            Self::RetryLater => "RETRY_LATER",
            Self::BadSignature => "BAD_SIGNATURE",
            Self::AmountMismatch => "AMOUNT_MISMATCH",
            Self::CouponExhausted => "COUPON_EXHAUSTED",
            Self::AlreadyClaimed => "ALREADY_CLAIMED",
            Self::CouponExpired => "COUPON_EXPIRED",
            Self::Internal => "INTERNAL",
        }
    }

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
            Self::InvalidToken => StatusCode::FORBIDDEN,
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

/// The JSON error body.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    /// Machine-readable code.
    pub code: &'a str,
    /// Human-readable explanation.
    pub message: &'a str,
    /// A purchase whose delivery is not confirmed yet keeps this order
    /// number; a retry with the same request_id gets it (503 RETRY_LATER).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub order_no: Option<String>,
}

/// An error answered to the client.
#[derive(Debug)]
pub struct ApiError {
    code: &'static str,
    status: StatusCode,
    /// Static on the hot path (sold out, limit reached): no allocation.
    message: Cow<'static, str>,
    /// The order number a pending purchase keeps.
    order_no: Option<i64>,
}

impl ApiError {
    /// A client-visible outcome.
    pub fn new(code: ErrorCode, message: impl Into<Cow<'static, str>>) -> Self {
        Self::with_status(code.as_str(), code.status(), message)
    }

    /// A code owned by another module (e.g. `SOLD_OUT`) with its status.
    pub fn with_status(
        code: &'static str,
        status: StatusCode,
        message: impl Into<Cow<'static, str>>,
    ) -> Self {
        Self {
            code,
            status,
            message: message.into(),
            order_no: None,
        }
    }

    /// The same error, naming the order a pending purchase keeps.
    pub fn with_order_no(mut self, order_no: i64) -> Self {
        self.order_no = Some(order_no);
        self
    }

    /// A failure the client cannot act on. Logged here, once, with its cause
    /// chain; the client sees a generic 500.
    pub fn unexpected(error: anyhow::Error) -> Self {
        tracing::error!(error = format!("{error:#}"), "unexpected error");
        Self::new(ErrorCode::Internal, "internal error")
    }

    /// A dependency (Redis, PostgreSQL, Kafka) failed: 503 RETRY_LATER, or
    /// 500 when the database answered with an error that is ours. Logged once.
    pub fn unavailable(error: anyhow::Error) -> Self {
        use diesel::result::{DatabaseErrorKind, Error as DieselError};
        // A connection the database closed (a restart) is the database
        // being away, not a fault of ours.
        let connection_lost = matches!(
            error.downcast_ref::<DieselError>(),
            Some(DieselError::DatabaseError(
                DatabaseErrorKind::ClosedConnection | DatabaseErrorKind::UnableToSendCommand,
                _
            ))
        );
        if error.downcast_ref::<crate::store::Unavailable>().is_none()
            && error.downcast_ref::<redis::RedisError>().is_none()
            && !connection_lost
        {
            return Self::unexpected(error);
        }
        tracing::warn!(error = format!("{error:#}"), "dependency unavailable");
        Self::new(
            ErrorCode::RetryLater,
            "a backing service is unavailable; retry later",
        )
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
        self.code
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse<BoxBody> {
        HttpResponse::build(self.status).json(ErrorBody {
            code: self.code,
            message: &self.message,
            order_no: self.order_no.map(|o| o.to_string()),
        })
    }
}

/// Turns actix's own extractor failures (bad JSON, unknown fields, bad path
/// or query) into 400 BAD_REQUEST with the parser's explanation.
pub fn extractor_error(err: impl fmt::Display) -> actix_web::Error {
    ApiError::bad_request(err.to_string()).into()
}

/// Middleware hook for every 4xx/5xx: responses that are not already our JSON
/// (actix's default 404, 405, payload errors) are rewritten into the error
/// shape, so no client ever sees a plain-text error.
pub fn render_error<B: MessageBody + 'static>(
    res: ServiceResponse<B>,
) -> actix_web::Result<ErrorHandlerResponse<B>> {
    let is_json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if is_json {
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
    let body = serde_json::to_string(&ErrorBody {
        code: code.as_str(),
        message: &message,
        order_no: None,
    })
    .unwrap_or_else(|_| format!("{{\"code\":\"{}\",\"message\":\"error\"}}", code.as_str()));
    let (req, mut res) = res.into_parts();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let res = res.set_body(body);
    Ok(ErrorHandlerResponse::Response(
        ServiceResponse::new(req, res)
            .map_into_boxed_body()
            .map_into_right_body(),
    ))
}
