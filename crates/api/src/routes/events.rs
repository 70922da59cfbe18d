//! Events: publish one (fanned out by the webhook_outbox role to the
//! tenant's subscribed endpoints), read one, list them.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use chrono::{DateTime, Utc};
use db::{PgRow, Row as _};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use utoipa::{IntoParams, ToSchema};

use crate::auth::Caller;
use crate::error::{ApiError, Code};
use crate::extract::{Id, JsonBody, Query};
use crate::page::{List, Page};
use crate::responses::{ReadErrors, WriteErrors};
use crate::scope::{self, Idempotency, Scope};
use crate::state::Api;
use crate::valid;

/// An event to publish.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewEvent {
    /// The event type endpoints filter on, e.g. `invoice.paid`: 1 to 128 of
    /// letters, digits and `_ . : -`, starting with a letter or digit.
    #[serde(rename = "type")]
    #[schema(pattern = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")]
    pub event_type: String,
    /// The event's payload, any JSON value (at most 256 KiB as JSON text,
    /// a number in exponent notation counted written out), stored and
    /// delivered with its numbers' digits as sent: they are not read through
    /// a 64-bit float (a 23-digit integer and `1.10` arrive as sent). A number
    /// in exponent notation is stored and delivered written out (`1e3` as
    /// `1000`).
    #[schema(value_type = serde_json::Value)]
    pub data: Box<RawValue>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Event {
    pub id: i64,
    #[serde(rename = "type")]
    pub event_type: String,
    /// As stored (Postgres `jsonb`: keys ordered, whitespace normalized,
    /// numbers exact).
    #[schema(value_type = serde_json::Value)]
    pub data: Box<RawValue>,
    /// The Standard Webhooks `webhook-id` every delivery of it carries.
    pub message_id: String,
    pub created_at: DateTime<Utc>,
    /// When the fan-out made its deliveries; null until then.
    pub dispatched_at: Option<DateTime<Utc>>,
}

impl Event {
    fn from_row(row: &PgRow) -> Result<Event, db::Error> {
        let db::Json(data) = row.try_get::<db::Json<Box<RawValue>>, _>("payload")?;
        Ok(Event {
            id: row.try_get("id")?,
            event_type: row.try_get("event_type")?,
            data,
            message_id: row.try_get("message_id")?,
            created_at: row.try_get("created_at")?,
            dispatched_at: row.try_get("dispatched_at")?,
        })
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListEvents {
    /// Page size, 1 to 100 (default 20).
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
    /// The `next_cursor` of the page before.
    pub starting_after: Option<String>,
    /// Only events of this type.
    #[serde(rename = "type")]
    #[param(rename = "type", pattern = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")]
    pub event_type: Option<String>,
}

/// Publish an event.
#[utoipa::path(
    post, path = "/v1/events", tag = "events", operation_id = "publish_event",
    params(("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = "Retry safely: the same key and body return the first answer for 24 hours.")),
    request_body = NewEvent,
    responses((status = 201, description = "Published; its deliveries follow.", body = Event), WriteErrors),
)]
pub async fn publish(
    State(api): State<Api>,
    caller: Caller,
    idem: Idempotency,
    body: JsonBody<NewEvent>,
) -> Result<Response, ApiError> {
    let NewEvent { event_type, data } = &body.value;
    valid::event_type("type", event_type)?;
    // The payload's own text, as the caller wrote it: parsed into a
    // `serde_json::Value` and printed again, a number was read through an
    // f64 (docs/adr/0119). The parsed copy only looks for NUL characters.
    let payload = data.get();
    // A RawValue checks the syntax only: a number out of an f64's range
    // (`1e400`) or a lone surrogate (`"\ud800"`) passes it and fails here,
    // a 400 as it was when the whole body was read into a Value.
    let parsed: serde_json::Value = serde_json::from_str(payload).map_err(|e| {
        ApiError::invalid(
            Code::InvalidJson,
            "data",
            format!("the payload is not JSON: {e}"),
        )
    })?;
    valid::payload("data", &parsed, payload)?;
    if idem.key.is_none() {
        // Nothing to bind a key to: authenticate, insert and commit in one
        // message.
        let insert = outbox::webhook::enqueue_for_caller(event_type, payload)
            .map_err(valid::enqueue_error)?;
        let rows = Scope::run_once(&api, &caller, &insert).await?;
        let row = rows.first().ok_or_else(ApiError::internal)?;
        return scope::answer(StatusCode::CREATED, &Event::from_row(row)?);
    }
    let mut scope = Scope::begin(&api, &caller).await?;
    if let Some(replay) = scope.idempotent(&idem, &body.raw).await? {
        return Ok(replay);
    }
    let tenant = scope.tenant().to_owned();
    // The row as stored, from the insert itself: one round trip.
    let row = outbox::webhook::enqueue_returning(scope.tx(), &tenant, event_type, payload)
        .await
        .map_err(valid::enqueue_error)?;
    let event = Event::from_row(&row)?;
    scope.respond(StatusCode::CREATED, &event).await
}

/// Read an event.
#[utoipa::path(
    get, path = "/v1/events/{id}", tag = "events", operation_id = "get_event",
    params(("id" = i64, Path, description = "The event's id.", minimum = 1)),
    responses((status = 200, body = Event), ReadErrors),
)]
pub async fn get(State(api): State<Api>, caller: Caller, Id(id): Id) -> Result<Response, ApiError> {
    let mut scope = Scope::begin(&api, &caller).await?;
    let event = read(&mut scope, id)
        .await?
        .ok_or_else(|| ApiError::missing("event", id))?;
    scope.respond(StatusCode::OK, &event).await
}

/// The statement of [`list`]: a page of the caller's events, newest first.
/// `webhook_events_tenant_id (tenant_id, id)` (migration 0037) reads it
/// backward and stops after the page, whatever the statistics say of a
/// tenant's burst; `pub` only for the plan test (`tests/it/events.rs`).
pub const LIST: &str = "SELECT id, event_type, payload, message_id, created_at, dispatched_at
                 FROM webhook_events
                 WHERE tenant_id = api_tenant()
                   AND ($1::bigint IS NULL OR id < $1)
                   AND ($2::text IS NULL OR event_type = $2)
                 ORDER BY id DESC LIMIT $3";

/// List events, newest first.
#[utoipa::path(
    get, path = "/v1/events", tag = "events", operation_id = "list_events",
    params(ListEvents),
    responses((status = 200, body = List<Event>), ReadErrors),
)]
pub async fn list(
    State(api): State<Api>,
    caller: Caller,
    Query(q): Query<ListEvents>,
) -> Result<Response, ApiError> {
    let page = Page::new(q.limit, q.starting_after.as_deref())?;
    // A type no event can have is refused by name, not left to Postgres (a
    // NUL in it was a 400 about the body).
    if let Some(t) = &q.event_type {
        valid::event_type("type", t)?;
    }
    let mut scope = Scope::begin(&api, &caller).await?;
    let rows = scope
        .tx()
        .fetch_all(
            db::sql(LIST)
                .bind(page.before)
                .bind(q.event_type)
                .bind(page.fetch()),
        )
        .await?;
    let list = page.rows(&rows, Event::from_row, |e| e.id)?;
    scope.respond(StatusCode::OK, &list).await
}

async fn read(scope: &mut Scope, id: i64) -> Result<Option<Event>, ApiError> {
    let row = scope
        .tx()
        .fetch_optional(
            db::sql(
                "SELECT id, event_type, payload, message_id, created_at, dispatched_at
                 FROM webhook_events WHERE tenant_id = api_tenant() AND id = $1",
            )
            .bind(id),
        )
        .await?;
    Ok(row.as_ref().map(Event::from_row).transpose()?)
}
