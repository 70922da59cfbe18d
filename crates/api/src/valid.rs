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

/// A payload within what the outbox accepts: `json`, the text of `value`,
/// within its size, and no string or key of `value` holding a NUL (jsonb
/// cannot store one). The NUL is looked for in the parsed strings, not in
/// the text: a string holding a backslash and `u0000` is written `\\u0000`
/// there, and is stored as it is.
pub fn payload(param: &str, value: &serde_json::Value, json: &str) -> Result<(), ApiError> {
    // The written length, before anything is sent. The length as stored (a
    // number in exponent notation written out, docs/adr/0129) is counted by
    // the outbox's own check, which every publish path runs and which
    // [`enqueue_error`] answers with the same refusal: one scan, not two.
    let max = outbox::webhook::MAX_PAYLOAD_BYTES;
    if json.len() > max {
        return Err(ApiError::out_of_range(param, too_large(json.len(), max)));
    }
    if outbox::webhook::contains_nul(value) {
        return Err(ApiError::param(
            param,
            "the payload holds a NUL character (\\u0000), which cannot be stored",
        ));
    }
    Ok(())
}

/// The refusal of a payload of `bytes` as stored, over `max`.
fn too_large(bytes: usize, max: usize) -> String {
    format!(
        "the payload is {bytes} bytes of JSON, counting each number in exponent notation \
         written out as it is stored and delivered (1e300 is 301 digits); at most {max} are \
         accepted"
    )
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
        E::PayloadTooLarge { bytes, max, .. } => {
            ApiError::out_of_range("data", too_large(bytes, max))
        }
        E::Db(e) => ApiError::from_db(&e),
    }
}

/// A text field: at most `max` characters and no NUL.
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

/// An identifier of the provider's (`pm_…`, `cus_…`): `prefix` then 1 to
/// 250 of letters, digits and `_`, as the columns' CHECKs allow.
pub fn provider_id(param: &str, value: &str, prefix: &str) -> Result<(), ApiError> {
    let ok = value.len() <= 255
        && value.strip_prefix(prefix).is_some_and(|rest| {
            !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        });
    if ok {
        Ok(())
    } else {
        Err(ApiError::param(
            param,
            format!("{param} is `{prefix}` then letters, digits and `_` (at most 255 characters)"),
        ))
    }
}

/// A time the service's date columns hold: from 1970 to before year 10000
/// (migration 0020's `*_times_in_range`).
pub fn time_in_range(param: &str, t: chrono::DateTime<chrono::Utc>) -> Result<(), ApiError> {
    let low = chrono::DateTime::<chrono::Utc>::UNIX_EPOCH;
    let high = "10000-01-01T00:00:00Z"
        .parse::<chrono::DateTime<chrono::Utc>>()
        .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC);
    if t < low || t >= high {
        return Err(ApiError::out_of_range(
            param,
            format!("{param} is from 1970-01-01 to before 10000-01-01 (UTC)"),
        ));
    }
    Ok(())
}

/// A refusal of billing's producers as the caller's answer: the conflicts a
/// caller can cause are 409s with their stable codes.
pub fn billing_error(e: billing::Error) -> ApiError {
    use billing::Error as E;
    match e {
        E::SubscriptionPeriodMoved { .. } => ApiError::conflict(
            Code::SubscriptionPeriodMoved,
            "the subscription's period moved while the change was made (billing closed it, \
             or another change did), or billing is further behind on it than one tick \
             closes, or its last period, set to end it, has ended; nothing was written: \
             read it again, and retry while it is still active",
        ),
        E::PlanCurrencyMismatch { from, to, .. } => ApiError::conflict(
            Code::CurrencyMismatch,
            format!("the subscription is billed in {from}; a plan in {to} cannot replace its plan"),
        ),
        E::SubscriptionNotFound { .. } => ApiError::conflict(
            Code::InvalidState,
            "the subscription is not active, so this change does not apply",
        ),
        E::InvalidState { reason, .. } => ApiError::conflict(Code::InvalidState, reason),
        E::Unbillable(u) => ApiError::conflict(
            Code::InvalidState,
            format!("the subscription's period cannot be computed: {u}"),
        ),
        E::Db(e) => ApiError::from_db(&e),
        E::Enqueue(e) => enqueue_error(e),
        other => {
            tracing::error!(error = %other, "billing producer failed");
            ApiError::internal()
        }
    }
}
