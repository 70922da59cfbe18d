//! Request extractors whose refusals name the field at fault, in the one
//! error shape: a JSON body, a query string, an id in the path.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::header;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use crate::error::{ApiError, Code};

/// The body, parsed as `T` (whose fields are `deny_unknown_fields`), and
/// the bytes it came from (an idempotency key's fingerprint).
pub struct JsonBody<T> {
    pub value: T,
    pub raw: Bytes,
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        if !declares_json(&req) {
            return Err(ApiError::unsupported_media_type());
        }
        let raw = body(req, state).await?;
        let value = parse_json(&raw)?;
        Ok(JsonBody { value, raw })
    }
}

/// Whether the request's content type is JSON (`application/json`, or an
/// `application/…+json`).
fn declares_json(req: &Request) -> bool {
    req.headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(|m| {
            let m = m.trim().to_ascii_lowercase();
            m == "application/json" || (m.starts_with("application/") && m.ends_with("+json"))
        })
        .unwrap_or(false)
}

/// The body limit of the routes a request reached, where it is not the tenant
/// API's [`crate::MAX_BODY_BYTES`]: set as a request extension by their router.
#[derive(Clone, Copy)]
pub(crate) struct BodyLimit(pub usize);

/// The body's bytes; one over the limit is a 413 naming the limit.
async fn body<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, ApiError> {
    let limit = req
        .extensions()
        .get::<BodyLimit>()
        .map_or(crate::MAX_BODY_BYTES, |l| l.0);
    Bytes::from_request(req, state)
        .await
        .map_err(|e: BytesRejection| {
            if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::body_too_large(limit)
            } else {
                ApiError::param("body", format!("the request body could not be read: {e}"))
            }
        })
}

/// [`JsonBody`] for an action whose body may be left out: an empty body
/// (with or without a content type) is read as `{}`, and so is a JSON
/// `null`, which the OpenAPI document allows for such a body (a generated
/// client may send its `None` so).
pub struct OptionalJsonBody<T>(pub JsonBody<T>);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for OptionalJsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        // Many clients send their content type on every request, an empty
        // one too: the body decides, then the type.
        let json = declares_json(&req);
        let raw = body(req, state).await?;
        if raw.is_empty() {
            let value = parse_json(b"{}")?;
            return Ok(OptionalJsonBody(JsonBody { value, raw }));
        }
        if !json {
            return Err(ApiError::unsupported_media_type());
        }
        if raw.trim_ascii() == b"null" {
            let value = parse_json(b"{}")?;
            return Ok(OptionalJsonBody(JsonBody { value, raw }));
        }
        let value = parse_json(&raw)?;
        Ok(OptionalJsonBody(JsonBody { value, raw }))
    }
}

/// Parse `raw` as `T`, naming the field a refusal is about.
pub fn parse_json<T: DeserializeOwned>(raw: &[u8]) -> Result<T, ApiError> {
    let not_json = |e: &dyn std::fmt::Display| {
        ApiError::invalid(
            Code::InvalidJson,
            "body",
            format!("the body is not valid JSON: {e}"),
        )
    };
    // The whole body's syntax, read only when a refusal must tell bad JSON
    // from a body that breaks its type (`{} x` is bad JSON, not a body
    // missing its fields).
    let syntax = || serde_json::from_slice::<serde::de::IgnoredAny>(raw).map_err(|e| not_json(&e));
    // Every body is an object: serde would also read a struct from an array
    // (`[]` for a body whose fields all have defaults).
    if raw.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        syntax()?;
        return Err(ApiError::invalid(
            Code::ParameterInvalidType,
            "body",
            "the body must be a JSON object",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(raw);
    let value = match serde_path_to_error::deserialize(&mut de) {
        Ok(value) => value,
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            use serde_json::error::Category;
            return Err(match inner.classify() {
                Category::Syntax | Category::Eof | Category::Io => not_json(&inner),
                Category::Data => match syntax() {
                    Err(bad) => bad,
                    Ok(_) => refusal(&path, &inner.to_string()),
                },
            });
        }
    };
    de.end().map_err(|e| not_json(&e))?;
    Ok(value)
}

/// serde's data error as a coded 400: the field comes from the path, or
/// for a missing or unknown field from the message (serde quotes it).
fn refusal(path: &str, message: &str) -> ApiError {
    let quoted = || {
        let start = message.find('`')? + 1;
        let end = start + message[start..].find('`')?;
        Some(&message[start..end])
    };
    let join = |field: &str| {
        // serde_path_to_error already ends the path with an unknown field
        // when the struct has optional fields.
        if path == field || path.ends_with(&format!(".{field}")) {
            path.to_owned()
        } else if path == "." || path.is_empty() {
            field.to_owned()
        } else {
            format!("{path}.{field}")
        }
    };
    // The message without serde's position suffix, for people.
    let text = message
        .split(" at line ")
        .next()
        .unwrap_or(message)
        .to_owned();
    let param = if path == "." || path.is_empty() {
        "body".to_owned()
    } else {
        path.to_owned()
    };
    if message.starts_with("missing field") {
        let field = join(quoted().unwrap_or("?"));
        ApiError::invalid(Code::ParameterMissing, field, text)
    } else if message.starts_with("unknown field") {
        let field = join(quoted().unwrap_or("?"));
        ApiError::invalid(Code::ParameterUnknown, field, text)
    } else if message.starts_with("invalid type")
        || message.starts_with("invalid length")
        // A query value that is not a number (serde_urlencoded's words).
        || message.starts_with("invalid digit")
        || message.starts_with("cannot parse")
    {
        ApiError::invalid(Code::ParameterInvalidType, param, text)
    } else {
        ApiError::invalid(Code::ParameterInvalid, param, text)
    }
}

/// The query string parsed as `T` (`deny_unknown_fields`), naming the
/// parameter a refusal is about.
pub struct Query<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let query = parts.uri.query().unwrap_or("");
        let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(query.as_bytes()));
        serde_path_to_error::deserialize(de)
            .map(Query)
            .map_err(|e| {
                let path = e.path().to_string();
                refusal(&path, &e.into_inner().to_string())
            })
    }
}

/// A resource id in the path: a positive integer.
pub struct Id(pub i64);

impl<S: Send + Sync> FromRequestParts<S> for Id {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let axum::extract::Path(text) =
            axum::extract::Path::<String>::from_request_parts(parts, state)
                .await
                .map_err(|_| ApiError::param("id", "the id in the path is missing"))?;
        let digits = text.strip_prefix('-').unwrap_or(&text);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(ApiError::invalid(
                Code::ParameterInvalidType,
                "id",
                format!(
                    "`{}` is not an id (a positive integer)",
                    text.escape_debug()
                ),
            ));
        }
        match text.parse::<i64>() {
            Ok(id) if id > 0 => Ok(Id(id)),
            _ => Err(ApiError::out_of_range(
                "id",
                format!("an id is 1 to {}, not {text}", i64::MAX),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        n: u32,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Outer {
        name: String,
        items: Vec<Inner>,
    }

    fn refuse(body: &str) -> (Code, Option<String>) {
        let e = parse_json::<Outer>(body.as_bytes()).unwrap_err();
        (e.code, e.param)
    }

    #[test]
    fn each_refusal_names_its_field() {
        let cases = [
            ("{", Code::InvalidJson, "body"),
            ("{} x", Code::InvalidJson, "body"),
            (r#"{"items": []}"#, Code::ParameterMissing, "name"),
            (
                r#"{"name": "a", "items": [], "extra": 1}"#,
                Code::ParameterUnknown,
                "extra",
            ),
            (
                r#"{"name": 5, "items": []}"#,
                Code::ParameterInvalidType,
                "name",
            ),
            (
                r#"{"name": "a", "items": [{"n": 1}, {"n": -1}]}"#,
                Code::ParameterInvalid,
                "items[1].n",
            ),
            (
                r#"{"name": "a", "items": [{}]}"#,
                Code::ParameterMissing,
                "items[0].n",
            ),
            ("[]", Code::ParameterInvalidType, "body"),
        ];
        for (body, code, param) in cases {
            assert_eq!(refuse(body), (code, Some(param.to_owned())), "body {body}");
        }
    }
}
