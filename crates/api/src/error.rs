//! One error shape for every answer that is not a success:
//! `{"error": {"type", "code", "message", "param"}}`, with stable codes.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tracing::{error, warn};
use utoipa::ToSchema;

/// The broad class of an error (`type`): what the caller should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorType {
    /// The request is wrong: fix it before retrying.
    InvalidRequestError,
    /// No valid API key.
    AuthenticationError,
    /// Too many requests for this key: retry after `Retry-After`.
    RateLimitError,
    /// The request conflicts with the resource's state or with an earlier
    /// request under the same idempotency key.
    ConflictError,
    /// The service could not answer: retry with the same idempotency key.
    ApiError,
}

/// Every code the API answers with. Stable: clients may match on them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Code {
    InvalidJson,
    ParameterMissing,
    ParameterUnknown,
    ParameterInvalidType,
    ParameterInvalid,
    ParameterOutOfRange,
    UnsupportedMediaType,
    BodyTooLarge,
    Unauthorized,
    RateLimited,
    ResourceMissing,
    RouteNotFound,
    MethodNotAllowed,
    AlreadyExists,
    IdempotencyKeyReused,
    IdempotencyKeyInvalid,
    SubscriptionPeriodMoved,
    CurrencyMismatch,
    InvalidState,
    Timeout,
    ServiceUnavailable,
    Internal,
}

/// The body of every error answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    #[serde(rename = "type")]
    pub kind: ErrorType,
    pub code: Code,
    /// For people; may change between versions.
    pub message: String,
    /// The request field or parameter at fault, when there is one (a path
    /// such as `to[2]` for a nested field).
    pub param: Option<String>,
}

/// An error answer. Build one with the constructors; its status follows
/// from its code.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: ErrorType,
    pub code: Code,
    pub message: String,
    pub param: Option<String>,
    /// Seconds for `Retry-After` (429, 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: ErrorType, code: Code, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            code,
            message: message.into(),
            param: None,
            retry_after: None,
        }
    }

    /// 400 naming `param`.
    pub fn invalid(code: Code, param: impl Into<String>, message: impl Into<String>) -> Self {
        let mut e = ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorType::InvalidRequestError,
            code,
            message,
        );
        e.param = Some(param.into());
        e
    }

    /// 400 `parameter_invalid` naming `param`.
    pub fn param(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::invalid(Code::ParameterInvalid, param, message)
    }

    /// 400 `parameter_out_of_range` naming `param`.
    pub fn out_of_range(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::invalid(Code::ParameterOutOfRange, param, message)
    }

    /// 401, the same body for a missing, malformed, unknown or revoked key.
    pub fn unauthorized() -> Self {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            ErrorType::AuthenticationError,
            Code::Unauthorized,
            "a valid API key is required: send `Authorization: Bearer hc_…`",
        )
    }

    /// 404 for a resource of this tenant that does not exist.
    pub fn missing(what: &str, id: impl std::fmt::Display) -> Self {
        let mut e = ApiError::new(
            StatusCode::NOT_FOUND,
            ErrorType::InvalidRequestError,
            Code::ResourceMissing,
            format!("no {what} {id}"),
        );
        e.param = Some("id".to_owned());
        e
    }

    /// 409 with `code`.
    pub fn conflict(code: Code, message: impl Into<String>) -> Self {
        ApiError::new(
            StatusCode::CONFLICT,
            ErrorType::ConflictError,
            code,
            message,
        )
    }

    pub fn rate_limited(retry_after: u64) -> Self {
        let mut e = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            ErrorType::RateLimitError,
            Code::RateLimited,
            "too many requests for this API key; retry after the Retry-After seconds",
        );
        e.retry_after = Some(retry_after.max(1));
        e
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorType::ApiError,
            Code::ServiceUnavailable,
            message,
        );
        e.retry_after = Some(1);
        e
    }

    pub fn route_not_found() -> Self {
        ApiError::new(
            StatusCode::NOT_FOUND,
            ErrorType::InvalidRequestError,
            Code::RouteNotFound,
            "no such route: see /openapi.json",
        )
    }

    pub fn method_not_allowed() -> Self {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            ErrorType::InvalidRequestError,
            Code::MethodNotAllowed,
            "this route does not take that method: see /openapi.json",
        )
    }

    pub fn unsupported_media_type() -> Self {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorType::InvalidRequestError,
            Code::UnsupportedMediaType,
            "send the body as JSON with `Content-Type: application/json`",
        )
    }

    pub fn body_too_large(limit: usize) -> Self {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorType::InvalidRequestError,
            Code::BodyTooLarge,
            format!("the request body is larger than the {limit} bytes accepted"),
        )
    }

    /// 400 for a request a layer or an extractor of axum's own refused with
    /// a plain-text answer (a path segment that is not UTF-8): the caller's
    /// input, never a 500.
    pub fn unreadable_request() -> Self {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorType::InvalidRequestError,
            Code::ParameterInvalid,
            "the request could not be read: check its path and query",
        )
    }

    /// An operator request that ran out of time. The operator API takes no
    /// idempotency key: what the request did is read back, not replayed.
    pub fn operator_timeout() -> Self {
        ApiError::timed_out(
            "the request took too long; it may or may not have taken effect: read the state back before retrying",
        )
    }

    pub fn timeout() -> Self {
        ApiError::timed_out("the request took too long; retry it with the same idempotency key")
    }

    /// 503 `timeout`, retry after a second.
    fn timed_out(message: &'static str) -> Self {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorType::ApiError,
            Code::Timeout,
            message,
        );
        e.retry_after = Some(1);
        e
    }

    pub fn internal() -> Self {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorType::ApiError,
            Code::Internal,
            "internal error; retry it with the same idempotency key",
        )
    }

    /// A database error as the caller should see it: a value the database
    /// refuses (a data exception or a CHECK) is the request's fault (400),
    /// a unique violation a conflict (409), a timeout or a lost connection
    /// a 503; anything else is logged and a 500. Never shows the SQL.
    pub fn from_db(e: &db::Error) -> Self {
        let code = e.code().unwrap_or_default();
        if code.starts_with("22") {
            return ApiError::invalid(
                Code::ParameterInvalid,
                "body",
                "a value in the request cannot be stored (e.g. a NUL character or a number out of range)",
            );
        }
        match code.as_str() {
            "23514" => ApiError::invalid(
                Code::ParameterInvalid,
                e.constraint().unwrap_or("body").to_owned(),
                format!(
                    "a value in the request is refused by the rule `{}`",
                    e.constraint().unwrap_or("?")
                ),
            ),
            "23505" => ApiError::conflict(
                Code::AlreadyExists,
                format!(
                    "it already exists (`{}`)",
                    e.constraint().unwrap_or("unique")
                ),
            ),
            "23503" => ApiError::invalid(
                Code::ResourceMissing,
                e.constraint().unwrap_or("body").to_owned(),
                "the request refers to something this tenant does not have",
            ),
            "57014" => ApiError::timeout(),
            code if retryable(code, &e.to_string()) => {
                warn!(sqlstate = %code, "API statement refused; answering 503");
                ApiError::unavailable("the database is busy or unavailable; retry shortly")
            }
            "" => {
                warn!(error = %e, "API database unreachable; answering 503");
                ApiError::unavailable("the database is unavailable; retry shortly")
            }
            _ => {
                error!(sqlstate = %code, error = %e, "API statement failed");
                ApiError::internal()
            }
        }
    }
}

/// SQLSTATEs after which the same request may succeed: lock timeouts,
/// serialization failures, deadlocks, a read-only database, too many
/// connections, a server shutting down or restarting, a session ended for
/// idling, and the connection exceptions (class 08). `08P01` is a protocol
/// violation, which Postgres answers to a client's bug (a bind with the
/// wrong number of parameters): retryable only as PgBouncer's own failures,
/// which it reports under that code ([`POOLER_FAILURES`]; docs/adr/0141).
fn retryable(code: &str, message: &str) -> bool {
    match code {
        "08P01" => POOLER_FAILURES.iter().any(|m| message.contains(m)),
        code if code.starts_with("08") => true,
        code => matches!(
            code,
            "55P03"
                | "40001"
                | "40P01"
                | "25006"
                | "25P03"
                | "57P01"
                | "57P02"
                | "57P03"
                | "57P05"
                | "53300"
        ),
    }
}

/// What PgBouncer's own `08P01` errors say when a pool cannot serve the
/// request for now: a wait for a server connection timed out, no client
/// slot, a server connection lost or not made.
const POOLER_FAILURES: [&str; 5] = [
    "query_wait_timeout",
    "no more connections allowed",
    "server conn crashed",
    "pgbouncer cannot connect to server",
    "server login has been failing",
];

impl From<db::Error> for ApiError {
    fn from(e: db::Error) -> Self {
        ApiError::from_db(&e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                kind: self.kind,
                code: self.code,
                message: self.message,
                param: self.param,
            },
        };
        let mut response = (self.status, axum::Json(body)).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

#[cfg(test)]
mod retryable_tests {
    use super::retryable;

    /// A pooler's or a restarting server's refusal is a 503 with
    /// `Retry-After`, not a 500 logged as a bug (review of the API):
    /// PgBouncer answers its own failures with `08P01`. A protocol violation
    /// of the client's own (a bind that does not fit its statement) stays a
    /// 500. Mutations `connection_errors_internal` (class 08 left out) and
    /// `protocol_bugs_retryable` (every `08P01` retried) fail here.
    #[test]
    fn connection_and_shutdown_refusals_are_retryable() {
        for code in [
            "08006", "08003", "57P02", "25P03", "57P05", "40001", "53300",
        ] {
            assert!(retryable(code, "whatever it says"), "{code}");
        }
        assert!(retryable(
            "08P01",
            "error returned from database: query_wait_timeout"
        ));
        assert!(!retryable(
            "08P01",
            "bind message supplies 1 parameters, but prepared statement requires 2"
        ));
        for code in ["23505", "42P01", "XX000", "22P02"] {
            assert!(!retryable(code, "query_wait_timeout"), "{code}");
        }
    }
}
