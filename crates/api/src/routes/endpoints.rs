//! Webhook endpoints: register one (its signing secret generated and sealed
//! here, shown once), read and list them, change their URL or filters,
//! rotate the secret (shown once), disable and enable them, and recover
//! their dead deliveries.
//!
//! A secret leaves the server only in the 201 of a create and the 200 of a
//! rotation; it is never logged, and no read shows it.

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use chrono::{DateTime, Utc};
use db::{PgRow, Row as _};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use webhook_delivery::{EndpointError, Keyring, MAX_ROTATION_OVERLAP, RotateError};

use crate::auth::Caller;
use crate::error::{ApiError, Code};
use crate::extract::{Id, JsonBody, Query};
use crate::page::{List, Page};
use crate::responses::{ReadErrors, WriteErrors};
use crate::routes::deliveries;
use crate::scope::{Idempotency, Scope};
use crate::state::Api;
use crate::valid;

/// The most event types one endpoint filters on.
pub const MAX_EVENT_TYPES: usize = 100;
/// The overlap a rotation gives the previous secret when none is asked for.
pub const DEFAULT_ROTATION_OVERLAP_SECONDS: u64 = 24 * 60 * 60;

/// An endpoint to register.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewEndpoint {
    /// Where deliveries are POSTed: http or https, at most 2048 bytes.
    pub url: String,
    /// The event types it receives; empty or absent: every type.
    #[serde(default)]
    #[schema(max_items = 100)]
    pub event_types: Vec<String>,
}

/// A change to an endpoint; absent fields, and fields given as `null`, stay
/// as they are.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EndpointUpdate {
    /// The new URL; `null`: unchanged.
    pub url: Option<String>,
    /// The new filter; an empty list: every type; `null`: unchanged.
    #[schema(max_items = 100)]
    pub event_types: Option<Vec<String>>,
}

/// A rotation of the signing secret.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Rotation {
    /// How long the previous secret keeps signing beside the new one, in
    /// seconds: 0 to 2592000 (30 days); default 86400.
    #[schema(minimum = 0, maximum = 2592000)]
    pub overlap_seconds: Option<u64>,
}

/// Deliveries to send again.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Recovery {
    /// Dead deliveries whose last attempt was at or after this time.
    pub since: DateTime<Utc>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Recovered {
    /// How many dead deliveries went back to pending (at most 10,000 a call).
    pub recovered: u64,
    /// True when the call recovered as many as one call may: call again
    /// (with a new idempotency key) until it is false.
    pub has_more: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Endpoint {
    pub id: i64,
    pub url: String,
    /// Empty: every event type.
    pub event_types: Vec<String>,
    pub enabled: bool,
    /// Why it is disabled (by the tenant, after a 410 Gone, or after failing for
    /// days: `HARDCOUNT_WEBHOOK_DISABLE_AFTER`); null while enabled.
    pub disabled_reason: Option<String>,
    pub disabled_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
}

/// An endpoint with its signing secret, shown this once.
#[derive(Debug, Serialize, ToSchema)]
pub struct EndpointWithSecret {
    #[serde(flatten)]
    pub endpoint: Endpoint,
    /// `whsec_…`: verify deliveries with it (Standard Webhooks). Store it
    /// now; it is never shown again.
    pub secret: String,
}

/// A new signing secret, shown this once.
#[derive(Debug, Serialize, ToSchema)]
pub struct RotatedSecret {
    pub endpoint_id: i64,
    /// `whsec_…`, signing from now on; never shown again.
    pub secret: String,
    /// Until when the previous secret also signs; null without an overlap.
    pub previous_secret_expires_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListEndpoints {
    /// Page size, 1 to 100 (default 20).
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
    /// The `next_cursor` of the page before.
    pub starting_after: Option<String>,
}

/// The columns every read selects (a macro: statements are `'static`).
macro_rules! columns {
    () => {
        "id, url, event_types, enabled, disabled_reason, disabled_at, created_at"
    };
}

/// Why an endpoint is disabled when its tenant disabled it.
const DISABLED_BY_TENANT: &str = "disabled through the API";

impl Endpoint {
    fn from_row(row: &PgRow) -> Result<Endpoint, db::Error> {
        Ok(Endpoint {
            id: row.try_get("id")?,
            url: row.try_get("url")?,
            event_types: row.try_get("event_types")?,
            enabled: row.try_get("enabled")?,
            disabled_reason: row.try_get("disabled_reason")?,
            disabled_at: row.try_get("disabled_at")?,
            created_at: row.try_get("created_at")?,
        })
    }
}

/// Register an endpoint. Its signing secret is generated here and shown in
/// this answer only.
#[utoipa::path(
    post, path = "/v1/webhook_endpoints", tag = "webhook_endpoints", operation_id = "create_webhook_endpoint",
    params(("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = "Retry safely: the same key and body return the first answer for 24 hours.")),
    request_body = NewEndpoint,
    responses((status = 201, description = "Registered; `secret` is shown this once.", body = EndpointWithSecret), WriteErrors),
)]
pub async fn create(
    State(api): State<Api>,
    caller: Caller,
    idem: Idempotency,
    body: JsonBody<NewEndpoint>,
) -> Result<Response, ApiError> {
    let NewEndpoint { url, event_types } = &body.value;
    guarded_url(&api, url)?;
    event_type_filter(event_types)?;
    let keyring = keyring(&api)?;
    let mut scope = Scope::begin(&api, &caller).await?;
    if let Some(replay) = scope.idempotent(&idem, &body.raw).await? {
        return Ok(replay);
    }
    let tenant = scope.tenant().to_owned();
    let created =
        webhook_delivery::create_endpoint_in(scope.tx(), keyring, &tenant, url, event_types)
            .await
            .map_err(endpoint_error)?;
    let endpoint = read(&mut scope, created.id)
        .await?
        .ok_or_else(ApiError::internal)?;
    let answer = EndpointWithSecret {
        endpoint,
        secret: created.secret.expose(),
    };
    let shown = answer.secret.clone();
    scope
        .respond_with_secret(StatusCode::CREATED, &answer, &shown, keyring)
        .await
}

/// Read an endpoint (never its secret).
#[utoipa::path(
    get, path = "/v1/webhook_endpoints/{id}", tag = "webhook_endpoints", operation_id = "get_webhook_endpoint",
    params(("id" = i64, Path, description = "The endpoint's id.", minimum = 1)),
    responses((status = 200, body = Endpoint), ReadErrors),
)]
pub async fn get(State(api): State<Api>, caller: Caller, Id(id): Id) -> Result<Response, ApiError> {
    let mut scope = Scope::begin(&api, &caller).await?;
    let endpoint = found(read(&mut scope, id).await?, id)?;
    scope.respond(StatusCode::OK, &endpoint).await
}

/// List endpoints, newest first.
#[utoipa::path(
    get, path = "/v1/webhook_endpoints", tag = "webhook_endpoints", operation_id = "list_webhook_endpoints",
    params(ListEndpoints),
    responses((status = 200, body = List<Endpoint>), ReadErrors),
)]
pub async fn list(
    State(api): State<Api>,
    caller: Caller,
    Query(q): Query<ListEndpoints>,
) -> Result<Response, ApiError> {
    let page = Page::new(q.limit, q.starting_after.as_deref())?;
    let mut scope = Scope::begin(&api, &caller).await?;
    let rows = scope
        .tx()
        .fetch_all(
            db::sql(concat!(
                "SELECT ",
                columns!(),
                " FROM webhook_endpoints
                 WHERE tenant_id = api_tenant() AND ($1::bigint IS NULL OR id < $1)
                 ORDER BY id DESC LIMIT $2"
            ))
            .bind(page.before)
            .bind(page.fetch()),
        )
        .await?;
    let list = page.rows(&rows, Endpoint::from_row, |e| e.id)?;
    scope.respond(StatusCode::OK, &list).await
}

/// Change an endpoint's URL or event types.
#[utoipa::path(
    post, path = "/v1/webhook_endpoints/{id}", tag = "webhook_endpoints", operation_id = "update_webhook_endpoint",
    params(
        ("id" = i64, Path, description = "The endpoint's id.", minimum = 1),
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = "Retry safely: the same key and body return the first answer for 24 hours."),
    ),
    request_body = EndpointUpdate,
    responses((status = 200, description = "Changed; deliveries made from now on use it.", body = Endpoint), WriteErrors),
)]
pub async fn update(
    State(api): State<Api>,
    caller: Caller,
    Id(id): Id,
    idem: Idempotency,
    body: JsonBody<EndpointUpdate>,
) -> Result<Response, ApiError> {
    let EndpointUpdate { url, event_types } = &body.value;
    let url = url.as_deref().map(|u| guarded_url(&api, u)).transpose()?;
    if let Some(types) = event_types {
        event_type_filter(types)?;
    }
    let mut scope = Scope::begin(&api, &caller).await?;
    if let Some(replay) = scope.idempotent(&idem, &body.raw).await? {
        return Ok(replay);
    }
    let row = scope
        .tx()
        .fetch_optional(
            db::sql(concat!(
                "UPDATE webhook_endpoints
                 SET url = coalesce($2, url), event_types = coalesce($3, event_types),
                     failing_since = CASE WHEN $2 IS DISTINCT FROM NULL AND $2 <> url
                                          THEN NULL ELSE failing_since END
                 WHERE tenant_id = api_tenant() AND id = $1
                 RETURNING ",
                columns!()
            ))
            .bind(id)
            .bind(url)
            .bind(event_types.clone()),
        )
        .await?;
    let endpoint = found(row.as_ref().map(Endpoint::from_row).transpose()?, id)?;
    scope.respond(StatusCode::OK, &endpoint).await
}

/// Rotate the signing secret: the new one signs from now on, the previous
/// one beside it until the overlap ends. The new secret is shown this once.
#[utoipa::path(
    post, path = "/v1/webhook_endpoints/{id}/rotate_secret", tag = "webhook_endpoints", operation_id = "rotate_webhook_endpoint_secret",
    params(
        ("id" = i64, Path, description = "The endpoint's id.", minimum = 1),
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = "Retry safely: the same key and body return the first answer for 24 hours."),
    ),
    request_body = Rotation,
    responses((status = 200, description = "Rotated; `secret` is shown this once.", body = RotatedSecret), WriteErrors),
)]
pub async fn rotate_secret(
    State(api): State<Api>,
    caller: Caller,
    Id(id): Id,
    idem: Idempotency,
    body: JsonBody<Rotation>,
) -> Result<Response, ApiError> {
    let secs = body
        .value
        .overlap_seconds
        .unwrap_or(DEFAULT_ROTATION_OVERLAP_SECONDS);
    if secs > MAX_ROTATION_OVERLAP.as_secs() {
        return Err(ApiError::out_of_range(
            "overlap_seconds",
            format!(
                "overlap_seconds is 0 to {}, not {secs}",
                MAX_ROTATION_OVERLAP.as_secs()
            ),
        ));
    }
    let keyring = keyring(&api)?;
    let mut scope = Scope::begin(&api, &caller).await?;
    if let Some(replay) = scope.idempotent(&idem, &body.raw).await? {
        return Ok(replay);
    }
    let tenant = scope.tenant().to_owned();
    let overlap = Duration::from_secs(secs);
    let secret = webhook_delivery::rotate_secret_in(scope.tx(), keyring, &tenant, id, overlap)
        .await
        .map_err(|e| match e {
            RotateError::NotFound { .. } => ApiError::missing("webhook endpoint", id),
            RotateError::OverlapTooLong { .. } => {
                ApiError::out_of_range("overlap_seconds", e.to_string())
            }
            RotateError::Db(e) => ApiError::from_db(&e),
        })?;
    let row = scope
        .tx()
        .fetch_one(
            db::sql(
                "SELECT CASE WHEN previous_secret_expires_at > now()
                             THEN previous_secret_expires_at END AS until
                 FROM webhook_endpoints WHERE tenant_id = api_tenant() AND id = $1",
            )
            .bind(id),
        )
        .await?;
    let answer = RotatedSecret {
        endpoint_id: id,
        secret: secret.expose(),
        previous_secret_expires_at: row.try_get("until").map_err(db::Error::Sql)?,
    };
    let shown = answer.secret.clone();
    scope
        .respond_with_secret(StatusCode::OK, &answer, &shown, keyring)
        .await
}

/// Disable an endpoint: its pending deliveries die at their next attempt,
/// and the fan-out makes it none. Disabling a disabled endpoint changes nothing.
#[utoipa::path(
    post, path = "/v1/webhook_endpoints/{id}/disable", tag = "webhook_endpoints", operation_id = "disable_webhook_endpoint",
    params(
        ("id" = i64, Path, description = "The endpoint's id.", minimum = 1),
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = "Retry safely: the same key returns the first answer for 24 hours."),
    ),
    responses((status = 200, body = Endpoint), WriteErrors),
)]
pub async fn disable(
    State(api): State<Api>,
    caller: Caller,
    Id(id): Id,
    idem: Idempotency,
) -> Result<Response, ApiError> {
    set_enabled(&api, &caller, id, &idem, false).await
}

/// Enable an endpoint again (after a disable or a 410 Gone). Its dead
/// deliveries stay dead: recover them.
#[utoipa::path(
    post, path = "/v1/webhook_endpoints/{id}/enable", tag = "webhook_endpoints", operation_id = "enable_webhook_endpoint",
    params(
        ("id" = i64, Path, description = "The endpoint's id.", minimum = 1),
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = "Retry safely: the same key returns the first answer for 24 hours."),
    ),
    responses((status = 200, body = Endpoint), WriteErrors),
)]
pub async fn enable(
    State(api): State<Api>,
    caller: Caller,
    Id(id): Id,
    idem: Idempotency,
) -> Result<Response, ApiError> {
    set_enabled(&api, &caller, id, &idem, true).await
}

/// Send the endpoint's dead deliveries again: each whose last attempt was
/// at or after `since` goes back to pending, due now, with its attempts
/// counted afresh, at most 10,000 a call (`has_more` says to call again). A
/// disabled endpoint is refused (409 `invalid_state`): enable it first.
#[utoipa::path(
    post, path = "/v1/webhook_endpoints/{id}/recover", tag = "webhook_endpoints", operation_id = "recover_webhook_endpoint",
    params(
        ("id" = i64, Path, description = "The endpoint's id.", minimum = 1),
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = "Retry safely: the same key and body return the first answer for 24 hours."),
    ),
    request_body = Recovery,
    responses((status = 200, description = "How many went back to pending.", body = Recovered), WriteErrors),
)]
pub async fn recover(
    State(api): State<Api>,
    caller: Caller,
    Id(id): Id,
    idem: Idempotency,
    body: JsonBody<Recovery>,
) -> Result<Response, ApiError> {
    let mut scope = Scope::begin(&api, &caller).await?;
    if let Some(replay) = scope.idempotent(&idem, &body.raw).await? {
        return Ok(replay);
    }
    // A disabled endpoint's deliveries die at their next claim unsent
    // (`endpoint_disabled`): refused here, as the operator's recovery skips
    // them, rather than reported recovered.
    // Locked, so a disable in flight is waited for and seen (docs/adr/0112).
    if !found(read_locked(&mut scope, id).await?, id)?.enabled {
        return Err(ApiError::conflict(
            Code::InvalidState,
            format!(
                "webhook endpoint {id} is disabled: its deliveries would die unsent; \
                 enable it (POST /v1/webhook_endpoints/{id}/enable), then recover"
            ),
        ));
    }
    let batch = api.config().recover_batch;
    let recovered = deliveries::recover_dead(&mut scope, id, body.value.since, batch).await?;
    let has_more = recovered >= batch as u64;
    scope
        .respond(
            StatusCode::OK,
            &Recovered {
                recovered,
                has_more,
            },
        )
        .await
}

async fn set_enabled(
    api: &Api,
    caller: &Caller,
    id: i64,
    idem: &Idempotency,
    enabled: bool,
) -> Result<Response, ApiError> {
    let mut scope = Scope::begin(api, caller).await?;
    if let Some(replay) = scope.idempotent(idem, b"").await? {
        return Ok(replay);
    }
    // Only a change is written: disabling again keeps the first reason and time.
    let row = scope
        .tx()
        .fetch_optional(
            db::sql(concat!(
                "UPDATE webhook_endpoints
                 SET enabled = $2,
                     disabled_reason = CASE WHEN $2 THEN NULL ELSE $3 END,
                     disabled_at = CASE WHEN $2 THEN NULL ELSE now() END,
                     -- Turned on again, it has a new run to fail or not
                     -- (migration 0031).
                     failing_since = CASE WHEN $2 THEN NULL ELSE failing_since END
                 WHERE tenant_id = api_tenant() AND id = $1 AND enabled <> $2
                 RETURNING ",
                columns!()
            ))
            .bind(id)
            .bind(enabled)
            .bind(DISABLED_BY_TENANT),
        )
        .await?;
    let endpoint = match row {
        Some(row) => Endpoint::from_row(&row)?,
        None => found(read(&mut scope, id).await?, id)?,
    };
    scope.respond(StatusCode::OK, &endpoint).await
}

async fn read(scope: &mut Scope, id: i64) -> Result<Option<Endpoint>, ApiError> {
    fetch(scope, id, false).await
}

/// [`read`], its row locked `FOR SHARE` until the transaction ends.
async fn read_locked(scope: &mut Scope, id: i64) -> Result<Option<Endpoint>, ApiError> {
    fetch(scope, id, true).await
}

async fn fetch(scope: &mut Scope, id: i64, locked: bool) -> Result<Option<Endpoint>, ApiError> {
    const READ: &str = concat!(
        "SELECT ",
        columns!(),
        " FROM webhook_endpoints WHERE tenant_id = api_tenant() AND id = $1"
    );
    const LOCKED: &str = concat!(
        "SELECT ",
        columns!(),
        " FROM webhook_endpoints WHERE tenant_id = api_tenant() AND id = $1 FOR SHARE"
    );
    let statement = if locked { LOCKED } else { READ };
    let row = scope
        .tx()
        .fetch_optional(db::sql(statement).bind(id))
        .await?;
    Ok(row.as_ref().map(Endpoint::from_row).transpose()?)
}

/// Another tenant's endpoint is invisible (row-level security): a 404 too.
fn found(endpoint: Option<Endpoint>, id: i64) -> Result<Endpoint, ApiError> {
    endpoint.ok_or_else(|| ApiError::missing("webhook endpoint", id))
}

fn keyring(api: &Api) -> Result<&Keyring, ApiError> {
    api.keyring().ok_or_else(|| {
        ApiError::unavailable(
            "webhook secrets cannot be sealed: this server has no secrets key; retry later",
        )
    })
}

/// The URL as [`webhook_delivery::create_endpoint`] checks it, as a 400 naming `url`.
fn checked_url(url: &str) -> Result<url::Url, ApiError> {
    webhook_delivery::parse_endpoint_url(url).map_err(endpoint_error)
}

/// [`checked_url`], then what the delivery role's SSRF guard decides from
/// the URL alone: its port, and an IP literal against the allowlist. A URL
/// refused there is refused at every attempt (each retried for a day, the
/// endpoint disabled days later), so it is a 400 now. A host name is left to
/// delivery time, when it is resolved (docs/adr/0102).
fn guarded_url(api: &Api, url: &str) -> Result<String, ApiError> {
    let parsed = checked_url(url)?;
    let c = api.config();
    webhook_delivery::ssrf::check_url(&parsed, &c.webhook_allowlist, c.webhook_ports)
        .map_err(|e| ApiError::param("url", format!("webhooks are not sent to this URL: {e}")))?;
    Ok(parsed.to_string())
}

fn event_type_filter(types: &[String]) -> Result<(), ApiError> {
    if types.len() > MAX_EVENT_TYPES {
        return Err(ApiError::out_of_range(
            "event_types",
            format!(
                "an endpoint filters on at most {MAX_EVENT_TYPES} event types, not {}",
                types.len()
            ),
        ));
    }
    for (i, t) in types.iter().enumerate() {
        valid::event_type(&format!("event_types[{i}]"), t)?;
    }
    Ok(())
}

fn endpoint_error(e: EndpointError) -> ApiError {
    match e {
        EndpointError::EmptyTenant => ApiError::internal(),
        EndpointError::UrlTooLong { .. } => ApiError::out_of_range("url", e.to_string()),
        EndpointError::InvalidUrl { .. }
        | EndpointError::UnsupportedScheme { .. }
        | EndpointError::MissingHost => ApiError::param("url", e.to_string()),
        EndpointError::EmptyEventType => ApiError::param("event_types", e.to_string()),
        EndpointError::Db(e) => ApiError::from_db(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_url_or_filter_names_its_field() {
        for url in ["not a url", "ftp://example.com/", "http://", "javascript:x"] {
            assert_eq!(checked_url(url).unwrap_err().param.as_deref(), Some("url"));
        }
        let long = format!("https://example.com/{}", "a".repeat(2048));
        assert_eq!(
            checked_url(&long).unwrap_err().param.as_deref(),
            Some("url")
        );
        let types = vec!["a.b".to_owned(), " x".to_owned()];
        assert_eq!(
            event_type_filter(&types).unwrap_err().param.as_deref(),
            Some("event_types[1]")
        );
        let many = vec!["a".to_owned(); MAX_EVENT_TYPES + 1];
        assert_eq!(
            event_type_filter(&many).unwrap_err().param.as_deref(),
            Some("event_types")
        );
    }
}
