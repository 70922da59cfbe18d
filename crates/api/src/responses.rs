//! The error answers each kind of route can give, for the OpenAPI document.

use std::collections::BTreeMap;

use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder, response::Response};

fn error(description: &str) -> RefOr<Response> {
    ResponseBuilder::new()
        .description(description)
        .content(
            "application/json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ErrorBody")))
                .build(),
        )
        .build()
        .into()
}

fn set(statuses: &[(&str, &str)]) -> BTreeMap<String, RefOr<Response>> {
    statuses
        .iter()
        .map(|(s, d)| ((*s).to_owned(), error(d)))
        .collect()
}

const BAD_REQUEST: (&str, &str) = ("400", "The request is invalid; `param` names the field.");
const UNAUTHORIZED: (&str, &str) = ("401", "No valid API key.");
const NOT_FOUND: (&str, &str) = ("404", "No such resource for this tenant.");
const TOO_MANY: (&str, &str) = ("429", "Rate limited; see Retry-After.");
const INTERNAL: (&str, &str) = (
    "500",
    "Internal error; retry with the same idempotency key.",
);
const UNAVAILABLE: (&str, &str) = (
    "503",
    "Busy or timed out; retry with the same idempotency key.",
);

/// A read: `GET`.
pub struct ReadErrors;

impl utoipa::IntoResponses for ReadErrors {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        set(&[
            BAD_REQUEST,
            UNAUTHORIZED,
            NOT_FOUND,
            TOO_MANY,
            INTERNAL,
            UNAVAILABLE,
        ])
    }
}

/// A write: `POST` with a JSON body and an optional idempotency key.
pub struct WriteErrors;

impl utoipa::IntoResponses for WriteErrors {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        set(&[
            BAD_REQUEST,
            UNAUTHORIZED,
            NOT_FOUND,
            (
                "409",
                "Conflicts with the resource's state, or the idempotency key was used for another request.",
            ),
            ("413", "The body is too large."),
            ("415", "The body is not JSON."),
            TOO_MANY,
            INTERNAL,
            UNAVAILABLE,
        ])
    }
}
