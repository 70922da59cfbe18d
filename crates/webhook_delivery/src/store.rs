//! All of webhook delivery's SQL: creating endpoints, the fenced claim of due
//! deliveries, the outcome writes (one statement per group of outcomes, each
//! row a compare-and-set on the attempt number),
//! handing back an unsent claim (at once, or held until later), and the
//! gauges read at the end of a tick.

use std::collections::HashSet;
use std::time::Duration;

use db::{Db, PgRow, Row, Tx, sql};
use leader::Fence;

use crate::sealed::Sealed;

/// A new endpoint row, as inserted.
pub(crate) struct NewEndpoint {
    pub id: i64,
    pub enabled: bool,
}

pub(crate) async fn insert_endpoint(
    db: &Db,
    tenant_id: &str,
    url: &str,
    secret: &Sealed,
    event_types: Vec<String>,
) -> Result<NewEndpoint, db::Error> {
    let row = db
        .fetch_one(
            sql("INSERT INTO webhook_endpoints \
                     (tenant_id, url, secret_ciphertext, secret_key_id, event_types) \
                 VALUES ($1, $2, $3, $4, $5) RETURNING id, enabled")
            .bind(tenant_id.to_owned())
            .bind(url.to_owned())
            .bind(secret.ciphertext.clone())
            .bind(secret.key_id.clone())
            .bind(event_types),
        )
        .await?;
    Ok(NewEndpoint {
        id: row.try_get("id")?,
        enabled: row.try_get("enabled")?,
    })
}

/// Store `new_secret` (sealed) as the endpoint's current secret and keep the
/// one it replaces as the previous secret until `now() + overlap` on the
/// database clock, in one statement (the right-hand columns are the row's old
/// values). A previous secret still held is dropped. Returns whether the
/// endpoint (of this tenant, its secret sealed) exists.
pub(crate) async fn rotate_secret(
    db: &Db,
    tenant_id: &str,
    endpoint_id: i64,
    new_secret: &Sealed,
    overlap: Duration,
) -> Result<bool, db::Error> {
    let rotated = db
        .execute(
            sql("UPDATE webhook_endpoints \
                 SET previous_secret_ciphertext = secret_ciphertext, \
                     previous_secret_key_id = secret_key_id, \
                     previous_secret_expires_at = now() + make_interval(secs => $5), \
                     secret_ciphertext = $3, \
                     secret_key_id = $4 \
                 WHERE tenant_id = $1 AND id = $2 AND secret_ciphertext IS NOT NULL")
            .bind(tenant_id.to_owned())
            .bind(endpoint_id)
            .bind(new_secret.ciphertext.clone())
            .bind(new_secret.key_id.clone())
            .bind(overlap.as_secs_f64()),
        )
        .await?;
    Ok(rotated == 1)
}

/// What the delivery worker's boot check finds of the stored secrets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SecretsCensus {
    pub endpoints: i64,
    /// Endpoints with a secret (current or previous) still in clear.
    pub in_clear: i64,
    /// Every key id a stored secret is sealed under.
    pub key_ids: Vec<String>,
}

pub(crate) async fn secrets_census(db: &Db) -> Result<SecretsCensus, db::Error> {
    let row = db
        .fetch_one(sql(
            "SELECT (SELECT count(*) FROM webhook_endpoints) AS endpoints, \
                    (SELECT count(*) FROM webhook_endpoints \
                     WHERE secret_ciphertext IS NULL \
                        OR (previous_secret_expires_at IS NOT NULL \
                            AND previous_secret_ciphertext IS NULL)) AS in_clear, \
                    ARRAY(SELECT secret_key_id FROM webhook_endpoints WHERE secret_key_id IS NOT NULL \
                          UNION SELECT previous_secret_key_id FROM webhook_endpoints \
                                WHERE previous_secret_key_id IS NOT NULL \
                          ORDER BY 1) AS key_ids",
        ))
        .await?;
    Ok(SecretsCensus {
        endpoints: row.try_get("endpoints")?,
        in_clear: row.try_get("in_clear")?,
        key_ids: row.try_get("key_ids")?,
    })
}

/// One endpoint's stored secrets, as the owner reads them to reseal.
pub(crate) struct StoredSecrets {
    pub id: i64,
    pub tenant_id: String,
    pub clear: Option<String>,
    pub sealed: Option<Sealed>,
    pub previous_clear: Option<String>,
    pub previous_sealed: Option<Sealed>,
    /// The previous secret's overlap is over: it is dropped, not resealed.
    pub previous_expired: bool,
}

fn sealed_from(ciphertext: Option<Vec<u8>>, key_id: Option<String>) -> Option<Sealed> {
    Some(Sealed {
        ciphertext: ciphertext?,
        key_id: key_id?,
    })
}

/// Up to `limit` endpoints, from `after_id` on, that hold a secret in clear or
/// sealed under a key other than `current_key`, locked until `tx` ends. Needs
/// the owner: only it reads the clear columns.
pub(crate) async fn secrets_to_reseal(
    tx: &mut Tx,
    current_key: &str,
    after_id: i64,
    limit: i64,
) -> Result<Vec<StoredSecrets>, db::Error> {
    let rows = tx
        .fetch_all(
            sql(
                "SELECT id, tenant_id, secret, secret_ciphertext, secret_key_id, previous_secret, \
                        previous_secret_ciphertext, previous_secret_key_id, \
                        coalesce(previous_secret_expires_at <= now(), false) AS previous_expired \
                 FROM webhook_endpoints \
                 WHERE id > $2 \
                   AND (secret IS NOT NULL OR previous_secret IS NOT NULL \
                        OR secret_key_id <> $1 OR previous_secret_key_id <> $1 \
                        OR previous_secret_expires_at <= now()) \
                 ORDER BY id LIMIT $3 FOR UPDATE",
            )
            .bind(current_key.to_owned())
            .bind(after_id)
            .bind(limit),
        )
        .await?;
    rows.iter()
        .map(|r| {
            Ok(StoredSecrets {
                id: r.try_get("id")?,
                tenant_id: r.try_get("tenant_id")?,
                clear: r.try_get("secret")?,
                sealed: sealed_from(r.try_get("secret_ciphertext")?, r.try_get("secret_key_id")?),
                previous_clear: r.try_get("previous_secret")?,
                previous_sealed: sealed_from(
                    r.try_get("previous_secret_ciphertext")?,
                    r.try_get("previous_secret_key_id")?,
                ),
                previous_expired: r.try_get("previous_expired")?,
            })
        })
        .collect()
}

/// Replace an endpoint's stored secrets with `current` and `previous` (both
/// sealed; `previous` None drops the previous secret and its expiry), clearing
/// the clear columns.
pub(crate) async fn store_resealed(
    tx: &mut Tx,
    id: i64,
    current: &Sealed,
    previous: Option<&Sealed>,
) -> Result<(), db::Error> {
    tx.execute(
        sql("UPDATE webhook_endpoints \
             SET secret = NULL, previous_secret = NULL, \
                 secret_ciphertext = $2, secret_key_id = $3, \
                 previous_secret_ciphertext = $4, previous_secret_key_id = $5, \
                 previous_secret_expires_at = CASE WHEN $4::bytea IS NULL THEN NULL \
                                                   ELSE previous_secret_expires_at END \
             WHERE id = $1")
        .bind(id)
        .bind(current.ciphertext.clone())
        .bind(current.key_id.clone())
        .bind(previous.map(|p| p.ciphertext.clone()))
        .bind(previous.map(|p| p.key_id.clone())),
    )
    .await?;
    Ok(())
}

/// One claimed delivery with what its attempt needs, as the claim returned it.
pub(crate) struct ClaimedRow {
    pub id: i64,
    pub tenant_id: String,
    pub event_id: i64,
    pub endpoint_id: i64,
    pub attempt: i32,
    pub url: String,
    /// The endpoint's secret, sealed (`sealed.rs`); opened only for the attempt.
    pub secret: Option<Sealed>,
    /// The previous secret while its rotation overlap lasts (decided by the
    /// claim on the database clock), sealed; `None` otherwise.
    pub previous_secret: Option<Sealed>,
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
            secret: sealed_from(r.try_get("secret_ciphertext")?, r.try_get("secret_key_id")?),
            previous_secret: sealed_from(
                r.try_get("previous_secret_ciphertext")?,
                r.try_get("previous_secret_key_id")?,
            ),
            enabled: r.try_get("enabled")?,
            disabled_reason: r.try_get("disabled_reason")?,
            event_type: r.try_get("event_type")?,
            message_id: r.try_get("message_id")?,
            event_time: r.try_get("event_time")?,
            payload: r.try_get("payload")?,
        })
    }
}

/// The claim statement of [`claim_due`]; `pub` only for the plan tests
/// (`tests/it/plans.rs`).
pub const CLAIM_DUE: &str = "WITH due AS MATERIALIZED ( \
           SELECT id, attempts FROM webhook_deliveries \
           WHERE status = 'pending' \
             AND next_attempt_at <= now() \
             AND (claimed_until IS NULL OR claimed_until <= now()) \
             AND leader_fence($1, $2) \
           ORDER BY next_attempt_at, id \
           LIMIT $3 \
           FOR UPDATE SKIP LOCKED), \
         exhausted AS ( \
           UPDATE webhook_deliveries d \
           SET status = 'dead', last_error = 'attempts_exhausted' \
           FROM due WHERE d.id = due.id AND due.attempts >= $5 \
           RETURNING d.id) \
         UPDATE webhook_deliveries d \
         SET attempts = d.attempts + 1, \
             claimed_until = now() + make_interval(secs => $4), \
             last_attempt_at = now() \
         FROM due, webhook_events e, webhook_endpoints ep \
         WHERE d.id = due.id AND due.attempts < $5 \
           AND e.id = d.event_id AND ep.id = d.endpoint_id \
         RETURNING d.id, d.tenant_id, d.event_id, d.endpoint_id, d.attempts, \
                   ep.url, ep.secret_ciphertext, ep.secret_key_id, \
                   ep.enabled, ep.disabled_reason, \
                   CASE WHEN ep.previous_secret_expires_at > now() \
                        THEN ep.previous_secret_ciphertext END AS previous_secret_ciphertext, \
                   CASE WHEN ep.previous_secret_expires_at > now() \
                        THEN ep.previous_secret_key_id END AS previous_secret_key_id, \
                   e.event_type, e.message_id, e.payload::text AS payload, \
                   to_char(e.created_at AT TIME ZONE 'UTC', \
                           'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') AS event_time";

/// The fenced funnel: claim up to `limit` due pending deliveries in one
/// `UPDATE … RETURNING`. Each claimed row's `attempts` goes up by one (the
/// attempt number its outcome must prove) and its `claimed_until` is set
/// `lease` ahead, so if this process dies before writing an outcome the
/// delivery comes due again by itself. A row is due when `next_attempt_at`
/// and its `claimed_until` (if any) have passed. The claim writes no indexed
/// column, so it is a HOT update (migration 0011, docs/adr/0014).
///
/// The fence sits in the innermost WHERE, next to `FOR UPDATE SKIP LOCKED`: a
/// stale token claims nothing, and rows another claim holds are skipped.
///
/// The previous secret of an endpoint being rotated is returned only while its
/// `previous_secret_expires_at` is ahead of the claim's `now()`.
///
/// The ceiling: a due row that has already been claimed `max_attempts` times is
/// not handed out again; the same statement marks it `dead` with `last_error =
/// 'attempts_exhausted'` (a worker that dies while attempting, e.g. out of
/// memory, never writes an outcome, and the claim lease would otherwise bring
/// the row back to every next leader forever, issue 12).
pub(crate) async fn claim_due(
    db: &Db,
    fence: &Fence,
    limit: usize,
    lease: Duration,
    max_attempts: u32,
    statement_timeout: Duration,
) -> Result<Vec<ClaimedRow>, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let rows = tx
        .fetch_all(
            sql(CLAIM_DUE)
                .bind(fence.role_name())
                .bind(fence.token())
                .bind(limit)
                .bind(lease.as_secs_f64())
                .bind(i32::try_from(max_attempts).unwrap_or(i32::MAX)),
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

/// Whether any delivery is due: one read of the partial index
/// `webhook_deliveries_due`, exactly the claim's predicate without its fence
/// and lock (it claims nothing; rows whose claim lease runs are skipped as
/// the claim skips them). An idle probing tick runs it every
/// `scheduler::IDLE_PROBE` (docs/adr/0019).
pub(crate) async fn any_due(db: &Db) -> Result<bool, db::Error> {
    let row = db
        .fetch_one(sql("SELECT EXISTS ( \
                   SELECT 1 FROM webhook_deliveries \
                   WHERE status = 'pending' \
                     AND next_attempt_at <= now() \
                     AND (claimed_until IS NULL OR claimed_until <= now())) AS due"))
        .await?;
    Ok(row.try_get("due")?)
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

/// One finished attempt's outcome, waiting to be written.
#[derive(Debug, Clone)]
pub(crate) struct OutcomeRow {
    pub id: i64,
    pub attempt: i32,
    pub next: NextState,
    pub observed: Observed,
}

/// Write a group of outcomes with one statement in one transaction. Each row
/// is a compare-and-set of its own: it is applied only if its delivery is
/// still pending at exactly its `attempt` (no later claim has been made).
/// Returns the `(id, attempt)` pairs that were applied; a row of `rows` not
/// among them is stale and nothing was written for it. On an error nothing
/// was written.
pub(crate) async fn record_outcomes(
    db: &Db,
    rows: &[OutcomeRow],
    statement_timeout: Duration,
) -> Result<HashSet<(i64, i32)>, db::Error> {
    if rows.is_empty() {
        return Ok(HashSet::new());
    }
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let applied = apply_outcomes(&mut tx, rows).await?;
    tx.commit().await?;
    Ok(applied)
}

/// Write one attempt's outcome like [`record_outcomes`]. `disable_endpoint`
/// (a 410) disables the endpoint in the same transaction, only when the
/// outcome was applied. Returns false for a stale attempt: nothing was written.
pub(crate) async fn record_outcome(
    db: &Db,
    row: &OutcomeRow,
    disable_endpoint: Option<(i64, String)>,
    statement_timeout: Duration,
) -> Result<bool, db::Error> {
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let applied = apply_outcomes(&mut tx, std::slice::from_ref(row))
        .await?
        .contains(&(row.id, row.attempt));
    if applied && let Some((endpoint_id, reason)) = disable_endpoint {
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
    Ok(applied)
}

/// The outcome statement of [`apply_outcomes`]; `pub` only for the plan tests
/// (`tests/it/plans.rs`).
pub const APPLY_OUTCOMES: &str = "UPDATE webhook_deliveries d \
         SET status = o.next_state, \
             claimed_until = NULL, \
             next_attempt_at = CASE WHEN o.next_state = 'pending' \
                                    THEN now() + make_interval(secs => o.retry_secs) \
                                    ELSE d.next_attempt_at END, \
             delivered_at = CASE WHEN o.next_state = 'delivered' THEN now() END, \
             last_status_code = o.status_code, \
             last_error = o.error, \
             last_latency_ms = o.latency_ms \
         FROM unnest($1::int8[], $2::int4[], $3::text[], $4::float8[], \
                     $5::int4[], $6::text[], $7::int4[], $8::text[]) \
              AS o(id, attempt, next_state, retry_secs, status_code, error, latency_ms, was) \
         WHERE d.id = o.id AND d.attempts = o.attempt AND d.status = o.was \
         RETURNING d.id, o.attempt";

/// The status a compare-and-set expects its delivery in. It is bound as one
/// more column of the unnested group (`was`), not written as a literal, so
/// that the predicate does not match `webhook_deliveries_due`'s and the
/// planner reaches each row by its primary key: with the literal, a table
/// whose statistics expect few pending rows was scanned pending row by
/// pending row for every group (docs/adr/0023).
const PENDING: &str = "pending";

/// The one outcome statement: `rows` unnested into a relation and joined to
/// their deliveries by the compare-and-set predicate, in a transaction that
/// keeps the join to primary-key lookups (`Db::begin_index_driven`).
async fn apply_outcomes(
    tx: &mut Tx,
    rows: &[OutcomeRow],
) -> Result<HashSet<(i64, i32)>, db::Error> {
    let n = rows.len();
    let mut ids = Vec::with_capacity(n);
    let mut attempts = Vec::with_capacity(n);
    let mut states = Vec::with_capacity(n);
    let mut retry_secs = Vec::with_capacity(n);
    let mut codes = Vec::with_capacity(n);
    let mut errors = Vec::with_capacity(n);
    let mut latencies = Vec::with_capacity(n);
    for r in rows {
        let (status, wait) = match r.next {
            NextState::Delivered => ("delivered", 0.0),
            NextState::RetryAfter(wait) => ("pending", wait.as_secs_f64()),
            NextState::Dead => ("dead", 0.0),
        };
        ids.push(r.id);
        attempts.push(r.attempt);
        states.push(status.to_owned());
        retry_secs.push(wait);
        codes.push(r.observed.status_code.map(i32::from));
        errors.push(
            r.observed
                .error
                .as_ref()
                .map(|e| e.chars().take(MAX_ERROR_CHARS).collect::<String>()),
        );
        latencies.push(
            r.observed
                .latency
                .map(|l| i32::try_from(l.as_millis()).unwrap_or(i32::MAX)),
        );
    }
    let applied = tx
        .fetch_all(
            sql(APPLY_OUTCOMES)
                .bind(ids)
                .bind(attempts)
                .bind(states)
                .bind(retry_secs)
                .bind(codes)
                .bind(errors)
                .bind(latencies)
                .bind(vec![PENDING; n]),
        )
        .await?;
    applied
        .iter()
        .map(|r| Ok((r.try_get::<i64, _>(0)?, r.try_get::<i32, _>(1)?)))
        .collect()
}

/// Hand back a claim that was never sent (the tick ran out of time or was
/// cancelled before its turn): due now (its lease cleared; `next_attempt_at`
/// had passed when it was claimed), and the attempt not counted. The same
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
                 SET attempts = attempts - 1, claimed_until = NULL \
                 WHERE id = $1 AND attempts = $2 AND status = 'pending'")
            .bind(delivery_id)
            .bind(attempt),
        )
        .await?;
    tx.commit().await?;
    Ok(released == 1)
}

/// Hand back claims that were not sent and must not come due at once (their
/// endpoint's circuit breaker is open, or their turn did not come while the
/// batch ran): the attempt not counted, like [`release_unsent`], and due again
/// at `now() + hold` on the database clock (`next_attempt_at`, never brought
/// forward; the claim lease cleared), so the claim skips them until then and
/// then hands out deliveries that were due before them first. One statement
/// for the group, each row the same compare-and-set as an outcome. Returns how
/// many were held. Not a HOT update (`next_attempt_at` is indexed); holds
/// happen only while an endpoint or tenant is saturated.
pub(crate) async fn hold_unsent(
    db: &Db,
    held: &[(i64, i32, Duration)],
    statement_timeout: Duration,
) -> Result<u64, db::Error> {
    if held.is_empty() {
        return Ok(0);
    }
    let ids: Vec<i64> = held.iter().map(|h| h.0).collect();
    let attempts: Vec<i32> = held.iter().map(|h| h.1).collect();
    let secs: Vec<f64> = held.iter().map(|h| h.2.as_secs_f64()).collect();
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let n = tx
        .execute(
            sql("UPDATE webhook_deliveries d \
                 SET attempts = d.attempts - 1, \
                     claimed_until = NULL, \
                     next_attempt_at = GREATEST(d.next_attempt_at, \
                                                now() + make_interval(secs => h.secs)) \
                 FROM unnest($1::int8[], $2::int4[], $3::float8[], $4::text[]) \
                      AS h(id, attempt, secs, was) \
                 WHERE d.id = h.id AND d.attempts = h.attempt AND d.status = h.was")
            .bind(ids)
            .bind(attempts)
            .bind(secs)
            .bind(vec![PENDING; held.len()]),
        )
        .await?;
    tx.commit().await?;
    Ok(n)
}

/// The backlog, read on the database clock through the partial indexes: the
/// pending count and the oldest pending delivery in one pass over
/// `webhook_deliveries_due` (migration 0015 dropped the index that served the
/// age alone), the dead count through `webhook_deliveries_dead`.
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
        .fetch_one(sql("SELECT p.pending, \
                    (SELECT count(*) FROM webhook_deliveries WHERE status = 'dead') AS dead, \
                    coalesce(extract(epoch FROM now() - p.oldest_created), 0)::float8 AS oldest \
             FROM (SELECT count(*) AS pending, min(created_at) AS oldest_created \
                   FROM webhook_deliveries WHERE status = 'pending') p"))
        .await?;
    tx.commit().await?;
    Ok(Backlog {
        pending: row.try_get("pending")?,
        dead: row.try_get("dead")?,
        oldest_pending_age: row.try_get("oldest")?,
    })
}
