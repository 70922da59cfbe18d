//! Deliveries: an event's to one endpoint, each with its attempt history;
//! list them by event or by endpoint, read one, and send one again.
//!
//! The history is a row per attempt that did not deliver, written by the
//! webhook_delivery role's outcome statement (`webhook_delivery_attempts`),
//! then, for a delivered delivery, the delivering attempt, read from the
//! delivery row's own `last_*` columns.

use std::collections::HashMap;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use chrono::{DateTime, Utc};
use db::{PgRow, Row as _};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::auth::Caller;
use crate::error::{ApiError, Code};
use crate::extract::{Id, Query};
use crate::page::{List, Page};
use crate::responses::{ReadErrors, WriteErrors};
use crate::scope::{Idempotency, Scope};
use crate::state::Api;

#[derive(Debug, Serialize, ToSchema)]
pub struct Delivery {
    pub id: i64,
    pub event_id: i64,
    pub endpoint_id: i64,
    /// `pending`, `delivered` or `dead`.
    pub status: String,
    /// Attempts made so far (a resend skips one number).
    pub attempts: i32,
    /// When a pending delivery is next due; null once delivered or dead.
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub last_attempt_at: Option<DateTime<Utc>>,
    pub delivered_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    /// Every attempt, oldest first.
    pub attempt_history: Vec<Attempt>,
}

/// One attempt of a delivery.
#[derive(Debug, Serialize, ToSchema)]
pub struct Attempt {
    pub attempt: i32,
    pub attempted_at: Option<DateTime<Utc>>,
    /// The receiver's HTTP status; null when it did not answer.
    pub status_code: Option<i32>,
    pub latency_ms: Option<i32>,
    /// Why it did not deliver (`http_5xx`, `timeout`, `dns`, …); null for
    /// the delivering attempt.
    pub error_category: Option<String>,
    /// The start of the receiver's answer to a failed attempt, at most 1024
    /// characters.
    pub response_snippet: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListDeliveries {
    /// One event's deliveries (give this or `endpoint_id`).
    #[param(minimum = 1)]
    pub event_id: Option<i64>,
    /// One endpoint's deliveries (give this or `event_id`).
    #[param(minimum = 1)]
    pub endpoint_id: Option<i64>,
    /// Page size, 1 to 100 (default 20).
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
    /// The `next_cursor` of the page before.
    pub starting_after: Option<String>,
}

/// The columns every read selects (a macro: statements are `'static`).
macro_rules! columns {
    () => {
        "id, event_id, endpoint_id, status, attempts,
    CASE WHEN status = 'pending' THEN next_attempt_at END AS next_attempt_at,
    last_attempt_at, delivered_at, created_at, last_status_code, last_latency_ms"
    };
}

/// A delivery row without its history, and its delivering attempt if it
/// was delivered.
fn from_row(row: &PgRow) -> Result<(Delivery, Option<Attempt>), db::Error> {
    let status: String = row.try_get("status")?;
    let attempts: i32 = row.try_get("attempts")?;
    let last_attempt_at = row.try_get("last_attempt_at")?;
    let delivering = (status == "delivered").then(|| -> Result<Attempt, db::Error> {
        Ok(Attempt {
            attempt: attempts,
            attempted_at: last_attempt_at,
            status_code: row.try_get("last_status_code")?,
            latency_ms: row.try_get("last_latency_ms")?,
            error_category: None,
            response_snippet: None,
        })
    });
    let delivery = Delivery {
        id: row.try_get("id")?,
        event_id: row.try_get("event_id")?,
        endpoint_id: row.try_get("endpoint_id")?,
        status,
        attempts,
        next_attempt_at: row.try_get("next_attempt_at")?,
        last_attempt_at,
        delivered_at: row.try_get("delivered_at")?,
        created_at: row.try_get("created_at")?,
        attempt_history: Vec::new(),
    };
    Ok((delivery, delivering.transpose()?))
}

/// Read a delivery and its attempts.
#[utoipa::path(
    get, path = "/v1/deliveries/{id}", tag = "deliveries", operation_id = "get_delivery",
    params(("id" = i64, Path, description = "The delivery's id.", minimum = 1)),
    responses((status = 200, body = Delivery), ReadErrors),
)]
pub async fn get(State(api): State<Api>, caller: Caller, Id(id): Id) -> Result<Response, ApiError> {
    let mut scope = Scope::begin(&api, &caller).await?;
    let delivery = read(&mut scope, id)
        .await?
        .ok_or_else(|| ApiError::missing("delivery", id))?;
    scope.respond(StatusCode::OK, &delivery).await
}

/// List an event's or an endpoint's deliveries, newest first, each with
/// its attempts.
///
/// One of `event_id` and `endpoint_id` is required: without either, 400
/// `parameter_missing` on `event_id`.
///
/// A delivery is listed once its row is written. A first attempt may be
/// written with its outcome, and its delivery then listed when that attempt
/// has ended, not while it is in flight.
#[utoipa::path(
    get, path = "/v1/deliveries", tag = "deliveries", operation_id = "list_deliveries",
    params(ListDeliveries),
    responses((status = 200, body = List<Delivery>), ReadErrors),
)]
pub async fn list(
    State(api): State<Api>,
    caller: Caller,
    Query(q): Query<ListDeliveries>,
) -> Result<Response, ApiError> {
    let page = Page::new(q.limit, q.starting_after.as_deref())?;
    if q.event_id.is_none() && q.endpoint_id.is_none() {
        return Err(ApiError::invalid(
            Code::ParameterMissing,
            "event_id",
            "list deliveries by event_id or by endpoint_id",
        ));
    }
    for (param, id) in [("event_id", q.event_id), ("endpoint_id", q.endpoint_id)] {
        if id.is_some_and(|id| id < 1) {
            return Err(ApiError::param(param, format!("{param} is a positive id")));
        }
    }
    let mut scope = Scope::begin(&api, &caller).await?;
    let rows = scope
        .tx()
        .fetch_all(
            db::sql(concat!(
                "SELECT ",
                columns!(),
                " FROM webhook_deliveries
                 WHERE tenant_id = api_tenant()
                   AND ($1::bigint IS NULL OR event_id = $1)
                   AND ($2::bigint IS NULL OR endpoint_id = $2)
                   AND ($3::bigint IS NULL OR id < $3)
                 ORDER BY id DESC LIMIT $4"
            ))
            .bind(q.event_id)
            .bind(q.endpoint_id)
            .bind(page.before)
            .bind(page.fetch()),
        )
        .await?;
    let rows = rows.iter().map(from_row).collect::<Result<Vec<_>, _>>()?;
    let deliveries = with_history(&mut scope, rows).await?;
    let list = page.list(deliveries, |d| d.id);
    scope.respond(StatusCode::OK, &list).await
}

/// A terminal delivery back to pending, due now (completed by a filter).
///
/// Only terminal rows are reset, and that cannot race a claim in flight:
/// the claim takes only pending rows and every outcome is a compare-and-set
/// on (id, attempts, pending), so nothing of the delivery worker holds or
/// writes a delivered or dead row. What may still be in flight is an older
/// attempt whose claim lease ran out (a stalled worker), or, for a delivery
/// the claim killed at its ceiling, the last one claimed; every such attempt
/// carries a number at most `attempts`. The reset never lowers `attempts`:
/// it moves it one past every number handed out, so none of those outcomes
/// can match the compare-and-set again, and records it as
/// `resent_at_attempt`, from which the claim's ceiling and the retry
/// schedule count again (migration 0026). The row lock of this UPDATE
/// orders it with any outcome statement on the same row.
macro_rules! reset {
    () => {
        "UPDATE webhook_deliveries
     SET status = 'pending', next_attempt_at = now(), delivered_at = NULL,
         attempts = attempts + 1, resent_at_attempt = attempts + 1
     WHERE tenant_id = api_tenant() AND status IN ('delivered', 'dead')"
    };
}

/// Send a delivered or dead delivery again: back to pending, due now, its
/// attempts counted afresh. A pending one is already going: 409. One whose
/// endpoint is disabled would die unsent at its next claim: 409 too, enable
/// the endpoint first (as its recovery says).
#[utoipa::path(
    post, path = "/v1/deliveries/{id}/resend", tag = "deliveries", operation_id = "resend_delivery",
    params(
        ("id" = i64, Path, description = "The delivery's id.", minimum = 1),
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = "Retry safely: the same key returns the first answer for 24 hours."),
    ),
    responses((status = 200, description = "Pending again.", body = Delivery), WriteErrors),
)]
pub async fn resend(
    State(api): State<Api>,
    caller: Caller,
    Id(id): Id,
    idem: Idempotency,
) -> Result<Response, ApiError> {
    let mut scope = Scope::begin(&api, &caller).await?;
    if let Some(replay) = scope.idempotent(&idem, b"").await? {
        return Ok(replay);
    }
    // The endpoint's state, by the delivery (none: the 404 comes below),
    // locked: a disable in flight is waited for and seen, not missed, so the
    // reset below never lands on an endpoint turned off meanwhile
    // (docs/adr/0112).
    let endpoint = scope
        .tx()
        .fetch_optional(
            db::sql(
                "SELECT e.id, e.enabled FROM webhook_deliveries d
                 JOIN webhook_endpoints e ON e.tenant_id = d.tenant_id AND e.id = d.endpoint_id
                 WHERE d.tenant_id = api_tenant() AND d.id = $1
                 FOR SHARE OF e",
            )
            .bind(id),
        )
        .await?
        .map(|r| -> Result<(i64, bool), db::Error> {
            Ok((r.try_get("id")?, r.try_get("enabled")?))
        })
        .transpose()?;
    if let Some((endpoint, false)) = endpoint {
        return Err(ApiError::conflict(
            Code::InvalidState,
            format!(
                "webhook endpoint {endpoint} is disabled: delivery {id} would die unsent; \
                 enable it (POST /v1/webhook_endpoints/{endpoint}/enable), then resend"
            ),
        ));
    }
    // A delivered row's delivering attempt lives only in its `last_*`
    // columns, which the resent delivery's next attempt overwrites: it goes
    // into the history first, under the row's lock, so the history keeps
    // what was delivered before (docs/adr/0119). A dead row's last attempt
    // is in the history already.
    scope
        .tx()
        .execute(
            db::sql(
                "WITH d AS (
                   SELECT tenant_id, id, attempts, last_attempt_at, delivered_at,
                          last_status_code, last_latency_ms
                   FROM webhook_deliveries
                   WHERE tenant_id = api_tenant() AND id = $1 AND status = 'delivered'
                   FOR UPDATE)
                 INSERT INTO webhook_delivery_attempts
                        (tenant_id, delivery_id, attempt, attempted_at, status_code, latency_ms)
                 SELECT tenant_id, id, attempts, COALESCE(last_attempt_at, delivered_at, now()),
                        last_status_code, last_latency_ms
                 FROM d
                 ON CONFLICT (delivery_id, attempt) DO NOTHING",
            )
            .bind(id),
        )
        .await?;
    let reset = scope
        .tx()
        .execute(db::sql(concat!(reset!(), " AND id = $1")).bind(id))
        .await?;
    let delivery = read(&mut scope, id)
        .await?
        .ok_or_else(|| ApiError::missing("delivery", id))?;
    if reset == 0 {
        return Err(ApiError::conflict(
            Code::InvalidState,
            format!(
                "delivery {id} is {}: only a delivered or dead delivery can be resent",
                delivery.status
            ),
        ));
    }
    scope.respond(StatusCode::OK, &delivery).await
}

/// At most `limit` of the endpoint's dead deliveries whose last attempt (or,
/// never attempted, creation) was at or after `since` back to pending, as
/// [`resend`] does one, lowest ids first; how many. Bounded so that a long
/// outage's deaths are recovered call by call within the statement timeout,
/// where one statement for all of them timed out at every retry
/// (docs/adr/0102). A row another transaction holds (a prune, another reset)
/// is skipped; a batch made short by that reads as the last.
pub(crate) async fn recover_dead(
    scope: &mut Scope,
    endpoint_id: i64,
    since: DateTime<Utc>,
    limit: usize,
) -> Result<u64, ApiError> {
    Ok(scope
        .tx()
        .execute(
            // Picked once (MATERIALIZED): as a subquery of the UPDATE, the
            // LIMIT held per scan of it, and a rescan reset more.
            db::sql(concat!(
                "WITH picked AS MATERIALIZED (
                   SELECT id FROM webhook_deliveries
                   WHERE tenant_id = api_tenant() AND status = 'dead' AND endpoint_id = $1
                     AND coalesce(last_attempt_at, created_at) >= $2
                   ORDER BY id LIMIT $3
                   FOR UPDATE SKIP LOCKED) ",
                reset!(),
                " AND id IN (SELECT id FROM picked)"
            ))
            .bind(endpoint_id)
            .bind(since)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX)),
        )
        .await?)
}

async fn read(scope: &mut Scope, id: i64) -> Result<Option<Delivery>, ApiError> {
    let row = scope
        .tx()
        .fetch_optional(
            db::sql(concat!(
                "SELECT ",
                columns!(),
                " FROM webhook_deliveries WHERE tenant_id = api_tenant() AND id = $1"
            ))
            .bind(id),
        )
        .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let row = from_row(&row)?;
    Ok(with_history(scope, vec![row]).await?.pop())
}

/// The deliveries with their attempt histories, read with one statement.
async fn with_history(
    scope: &mut Scope,
    rows: Vec<(Delivery, Option<Attempt>)>,
) -> Result<Vec<Delivery>, ApiError> {
    let ids: Vec<i64> = rows.iter().map(|(d, _)| d.id).collect();
    let history = scope
        .tx()
        .fetch_all(
            db::sql(
                "SELECT delivery_id, attempt, attempted_at, status_code, latency_ms,
                        error_category, response_snippet
                 FROM webhook_delivery_attempts
                 WHERE tenant_id = api_tenant() AND delivery_id = ANY($1)
                 ORDER BY delivery_id, attempt",
            )
            .bind(ids),
        )
        .await?;
    let mut by_delivery: HashMap<i64, Vec<Attempt>> = HashMap::new();
    for r in &history {
        let attempt = Attempt {
            attempt: r.try_get("attempt").map_err(db::Error::Sql)?,
            attempted_at: r.try_get("attempted_at").map_err(db::Error::Sql)?,
            status_code: r.try_get("status_code").map_err(db::Error::Sql)?,
            latency_ms: r.try_get("latency_ms").map_err(db::Error::Sql)?,
            error_category: r.try_get("error_category").map_err(db::Error::Sql)?,
            response_snippet: r.try_get("response_snippet").map_err(db::Error::Sql)?,
        };
        let id: i64 = r.try_get("delivery_id").map_err(db::Error::Sql)?;
        by_delivery.entry(id).or_default().push(attempt);
    }
    Ok(rows
        .into_iter()
        .map(|(mut d, delivering)| {
            d.attempt_history = by_delivery.remove(&d.id).unwrap_or_default();
            // A resend that committed between the row's read and this one has
            // copied the delivering attempt into the history already.
            let copied = |a: &Attempt| d.attempt_history.iter().any(|h| h.attempt == a.attempt);
            if let Some(a) = delivering.filter(|a| !copied(a)) {
                d.attempt_history.push(a);
            }
            d
        })
        .collect())
}
