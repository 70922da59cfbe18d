//! All of webhook delivery's SQL: creating endpoints, the fenced claim of due
//! deliveries, the outcome write (a compare-and-set on the attempt number),
//! handing back an unsent claim, and the gauges read at the end of a tick.

use std::time::Duration;

use db::{Db, PgRow, Row, sql};
use leader::Fence;

/// A new endpoint row, as inserted.
pub(crate) struct NewEndpoint {
    pub id: i64,
    pub enabled: bool,
}

pub(crate) async fn insert_endpoint(
    db: &Db,
    tenant_id: &str,
    url: &str,
    secret: &str,
    event_types: Vec<String>,
) -> Result<NewEndpoint, db::Error> {
    let row = db
        .fetch_one(
            sql(
                "INSERT INTO webhook_endpoints (tenant_id, url, secret, event_types) \
                 VALUES ($1, $2, $3, $4) RETURNING id, enabled",
            )
            .bind(tenant_id.to_owned())
            .bind(url.to_owned())
            .bind(secret.to_owned())
            .bind(event_types),
        )
        .await?;
    Ok(NewEndpoint {
        id: row.try_get("id")?,
        enabled: row.try_get("enabled")?,
    })
}

/// One claimed delivery with what its attempt needs, as the claim returned it.
pub(crate) struct ClaimedRow {
    pub id: i64,
    pub tenant_id: String,
    pub event_id: i64,
    pub endpoint_id: i64,
    pub attempt: i32,
    pub url: String,
    pub secret: String,
    pub enabled: bool,
    pub disabled_reason: Option<String>,
    pub event_type: String,
    pub message_id: String,
    pub event_time: String,
    pub payload: String,
}

impl ClaimedRow {
    fn from_row(r: &PgRow) -> Result<ClaimedRow, db::Error> {
        Ok(ClaimedRow {
            id: r.try_get("id")?,
            tenant_id: r.try_get("tenant_id")?,
            event_id: r.try_get("event_id")?,
            endpoint_id: r.try_get("endpoint_id")?,
            attempt: r.try_get("attempts")?,
            url: r.try_get("url")?,
            secret: r.try_get("secret")?,
            enabled: r.try_get("enabled")?,
            disabled_reason: r.try_get("disabled_reason")?,
            event_type: r.try_get("event_type")?,
            message_id: r.try_get("message_id")?,
            event_time: r.try_get("event_time")?,
            payload: r.try_get("payload")?,
        })
    }
}

/// The fenced funnel: claim up to `limit` due pending deliveries in one
/// `UPDATE … RETURNING`. Each claimed row's `attempts` goes up by one (the
/// attempt number its outcome must prove) and its `next_attempt_at` moves
/// `lease` ahead, so if this process dies before writing an outcome the
/// delivery comes due again by itself.
///
/// The fence sits in the innermost WHERE, next to `FOR UPDATE SKIP LOCKED`: a
/// stale token claims nothing, and rows another claim holds are skipped.
pub(crate) async fn claim_due(
    db: &Db,
    fence: &Fence,
    limit: usize,
    lease: Duration,
    statement_timeout: Duration,
) -> Result<Vec<ClaimedRow>, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let rows = tx
        .fetch_all(
            sql("WITH due AS MATERIALIZED ( \
                   SELECT id FROM webhook_deliveries \
                   WHERE status = 'pending' \
                     AND next_attempt_at <= now() \
                     AND leader_fence($1, $2) \
                   ORDER BY next_attempt_at, id \
                   LIMIT $3 \
                   FOR UPDATE SKIP LOCKED) \
                 UPDATE webhook_deliveries d \
                 SET attempts = d.attempts + 1, \
                     next_attempt_at = now() + make_interval(secs => $4), \
                     last_attempt_at = now() \
                 FROM due, webhook_events e, webhook_endpoints ep \
                 WHERE d.id = due.id AND e.id = d.event_id AND ep.id = d.endpoint_id \
                 RETURNING d.id, d.tenant_id, d.event_id, d.endpoint_id, d.attempts, \
                           ep.url, ep.secret, ep.enabled, ep.disabled_reason, \
                           e.event_type, e.message_id, e.payload::text AS payload, \
                           to_char(e.created_at AT TIME ZONE 'UTC', \
                                   'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') AS event_time")
            .bind(fence.role_name())
            .bind(fence.token())
            .bind(limit)
            .bind(lease.as_secs_f64()),
        )
        .await?;
    tx.commit().await?;
    let mut claimed = rows
        .iter()
        .map(ClaimedRow::from_row)
        .collect::<Result<Vec<_>, _>>()?;
    claimed.sort_by_key(|c| c.id);
    Ok(claimed)
}

/// The state an attempt leaves its delivery in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum NextState {
    Delivered,
    /// Still pending, due again after this wait (on the database clock).
    RetryAfter(Duration),
    Dead,
}

/// What an attempt saw, for the `last_*` columns.
#[derive(Debug, Clone, Default)]
pub(crate) struct Observed {
    pub status_code: Option<u16>,
    pub error: Option<String>,
    pub latency: Option<Duration>,
}

/// Longest `last_error` kept; the rest is cut at a character boundary.
const MAX_ERROR_CHARS: usize = 1000;

/// Write an attempt's outcome, only if the delivery is still pending at
/// exactly `attempt` (no later claim has been made). `disable_endpoint` (a
/// 410) disables the endpoint in the same transaction, only when the outcome
/// was applied. Returns false for a stale attempt: nothing was written.
pub(crate) async fn record_outcome(
    db: &Db,
    delivery_id: i64,
    attempt: i32,
    next: NextState,
    observed: &Observed,
    disable_endpoint: Option<(i64, String)>,
    statement_timeout: Duration,
) -> Result<bool, db::Error> {
    let (status, retry_secs) = match next {
        NextState::Delivered => ("delivered", 0.0),
        NextState::RetryAfter(wait) => ("pending", wait.as_secs_f64()),
        NextState::Dead => ("dead", 0.0),
    };
    let error = observed
        .error
        .as_ref()
        .map(|e| e.chars().take(MAX_ERROR_CHARS).collect::<String>());
    let latency_ms = observed
        .latency
        .map(|l| i32::try_from(l.as_millis()).unwrap_or(i32::MAX));
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let applied = tx
        .execute(
            sql("UPDATE webhook_deliveries \
                 SET status = $3, \
                     next_attempt_at = CASE WHEN $3 = 'pending' \
                                            THEN now() + make_interval(secs => $4) \
                                            ELSE next_attempt_at END, \
                     delivered_at = CASE WHEN $3 = 'delivered' THEN now() END, \
                     last_status_code = $5, \
                     last_error = $6, \
                     last_latency_ms = $7 \
                 WHERE id = $1 AND attempts = $2 AND status = 'pending'")
            .bind(delivery_id)
            .bind(attempt)
            .bind(status)
            .bind(retry_secs)
            .bind(observed.status_code.map(i32::from))
            .bind(error)
            .bind(latency_ms),
        )
        .await?;
    if applied == 1
        && let Some((endpoint_id, reason)) = disable_endpoint
    {
        tx.execute(
            sql("UPDATE webhook_endpoints \
                 SET enabled = false, disabled_reason = $2, disabled_at = now() \
                 WHERE id = $1 AND enabled")
            .bind(endpoint_id)
            .bind(reason),
        )
        .await?;
    }
    tx.commit().await?;
    Ok(applied == 1)
}

/// Hand back a claim that was never sent (the tick ran out of time or was
/// cancelled before its turn): due now, and the attempt not counted. The same
/// compare-and-set as an outcome, so a claim taken over meanwhile is left alone.
/// Returns whether the claim was handed back.
pub(crate) async fn release_unsent(
    db: &Db,
    delivery_id: i64,
    attempt: i32,
    statement_timeout: Duration,
) -> Result<bool, db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let released = tx
        .execute(
            sql("UPDATE webhook_deliveries \
                 SET attempts = attempts - 1, next_attempt_at = now() \
                 WHERE id = $1 AND attempts = $2 AND status = 'pending'")
            .bind(delivery_id)
            .bind(attempt),
        )
        .await?;
    tx.commit().await?;
    Ok(released == 1)
}

/// The backlog, read on the database clock through the partial indexes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Backlog {
    pub pending: i64,
    pub dead: i64,
    /// Seconds since the oldest pending delivery was created; 0 when none.
    pub oldest_pending_age: f64,
}

pub(crate) async fn backlog(db: &Db, statement_timeout: Duration) -> Result<Backlog, db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let row = tx
        .fetch_one(sql(
            "SELECT (SELECT count(*) FROM webhook_deliveries WHERE status = 'pending') AS pending, \
                    (SELECT count(*) FROM webhook_deliveries WHERE status = 'dead') AS dead, \
                    coalesce(extract(epoch FROM now() - \
                        (SELECT min(created_at) FROM webhook_deliveries WHERE status = 'pending')), \
                        0)::float8 AS oldest",
        ))
        .await?;
    tx.commit().await?;
    Ok(Backlog {
        pending: row.try_get("pending")?,
        dead: row.try_get("dead")?,
        oldest_pending_age: row.try_get("oldest")?,
    })
}
