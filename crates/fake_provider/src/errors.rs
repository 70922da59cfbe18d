//! Stripe-shaped error bodies and the refusals the fake answers with.

use super::*;

pub(super) fn error(
    status: StatusCode,
    kind: &str,
    code: Option<&str>,
    param: Option<&str>,
    message: &str,
) -> Response {
    (
        status,
        axum::Json(json!({ "error": error_json(kind, code, param, message) })),
    )
        .into_response()
}

/// Stripe's `error` object.
pub(super) fn error_json(
    kind: &str,
    code: Option<&str>,
    param: Option<&str>,
    message: &str,
) -> Value {
    let mut e = json!({ "type": kind, "message": message });
    if let Some(code) = code {
        e["code"] = json!(code);
    }
    if let Some(param) = param {
        e["param"] = json!(param);
    }
    e
}

pub(super) fn invalid(code: &str, param: &str, message: String) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        Some(code),
        Some(param),
        &message,
    )
}

/// 404 `resource_missing` naming `param`.
pub(super) fn missing(param: &str, message: String) -> Response {
    error(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        Some("resource_missing"),
        Some(param),
        &message,
    )
}

pub(super) fn no_such_intent(id: &str) -> Response {
    missing("intent", format!("No such payment_intent: '{id}'"))
}

/// The `card_error` of a decline with `decline_code`; Stripe puts
/// `authentication_required` in `code` too, any other in `card_declined`.
pub(super) fn card_error(decline_code: &str) -> Value {
    let (code, message) = if decline_code == "authentication_required" {
        (
            "authentication_required",
            "Your card was declined. This transaction requires authentication.",
        )
    } else {
        ("card_declined", "Your card was declined.")
    };
    json!({
        "type": "card_error",
        "code": code,
        "decline_code": decline_code,
        "message": message,
    })
}
