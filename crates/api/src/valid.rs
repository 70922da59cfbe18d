//! Checks shared by the routes: each refusal is a 400 naming its field.

use crate::error::{ApiError, Code};

/// An event type: 1 to 128 of letters, digits and `_ . : -`, starting with
/// a letter or digit.
pub fn event_type(param: &str, value: &str) -> Result<(), ApiError> {
    let ok = !value.is_empty()
        && value.len() <= 128
        && value.as_bytes()[0].is_ascii_alphanumeric()
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ApiError::param(
            param,
            "an event type is 1 to 128 letters, digits and `_ . : -`, starting with a letter or digit",
        ))
    }
}

/// A payload's JSON text within what the outbox accepts.
pub fn payload(param: &str, json: &str) -> Result<(), ApiError> {
    if json.len() > outbox::webhook::MAX_PAYLOAD_BYTES {
        return Err(ApiError::out_of_range(
            param,
            format!(
                "the payload is {} bytes of JSON; at most {} are accepted",
                json.len(),
                outbox::webhook::MAX_PAYLOAD_BYTES
            ),
        ));
    }
    if json.contains("\\u0000") {
        return Err(ApiError::param(
            param,
            "the payload holds a NUL character (\\u0000), which cannot be stored",
        ));
    }
    Ok(())
}

/// A refused event as the caller's 400, or the database's error.
pub fn enqueue_error(e: outbox::webhook::EnqueueError) -> ApiError {
    use outbox::webhook::EnqueueError as E;
    match e {
        E::EmptyTenant => ApiError::internal(),
        E::EmptyEventType => ApiError::param("type", "the event type is empty"),
        E::InvalidJson { problem, .. } => ApiError::invalid(
            Code::InvalidJson,
            "data",
            format!("the payload is not JSON: {problem}"),
        ),
        E::PayloadTooLarge { bytes, max, .. } => ApiError::out_of_range(
            "data",
            format!("the payload is {bytes} bytes of JSON; at most {max} are accepted"),
        ),
        E::Db(e) => ApiError::from_db(&e),
    }
}

/// A text field: at most `max` characters and no NUL. (No route takes free
/// text yet.)
#[allow(dead_code)]
pub fn text(param: &str, value: &str, max: usize) -> Result<(), ApiError> {
    if value.contains('\0') {
        return Err(ApiError::param(
            param,
            format!("{param} holds a NUL character"),
        ));
    }
    if value.chars().count() > max {
        return Err(ApiError::out_of_range(
            param,
            format!("{param} is at most {max} characters"),
        ));
    }
    Ok(())
}
