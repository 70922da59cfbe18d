//! The outcomes' SQL: one statement per group of outcomes (`APPLY_OUTCOMES`),
//! each row a compare-and-set on the attempt number, a 410's with its
//! endpoint's disabling, and handing back an unsent claim (at once, or held
//! until later) by the same compare-and-set.

use std::collections::HashSet;
use std::time::Duration;

use db::{Db, Row, Tx, sql};

use super::unwritten::{NewRow, disable_gone, insert_outcomes, pair_written};

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
    /// The start of a failed answer's body, for the attempt history.
    pub response_snippet: Option<String>,
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

/// Write a group of outcomes with one statement in one transaction, and the
/// rows of deliveries handed over unwritten (`new`, docs/adr/0124) with one
/// more in the same transaction. Each row of `rows` is a compare-and-set of
/// its own: it is applied only if its delivery is still pending at exactly
/// its `attempt` (no later claim has been made); each of `new` is inserted
/// only if its pair is not written yet. Returns the `(id, attempt)` pairs
/// that were applied (`new` by their keys); a row not among them is stale
/// and nothing was written for it. On an error nothing was written.
///
/// `new` is inserted with no conflict check first; when one of its pairs is
/// already written, that transaction fails and the whole group is written
/// again in a new one that skips such pairs (docs/adr/0126).
pub(crate) async fn record_outcomes(
    db: &Db,
    rows: &[OutcomeRow],
    new: &[NewRow],
    statement_timeout: Duration,
) -> Result<HashSet<(i64, i32)>, db::Error> {
    if rows.is_empty() && new.is_empty() {
        return Ok(HashSet::new());
    }
    match write_outcomes(db, rows, new, false, statement_timeout).await {
        Err(e) if pair_written(&e) => write_outcomes(db, rows, new, true, statement_timeout).await,
        written => written,
    }
}

/// [`record_outcomes`] in one transaction, `new` inserted `tolerant` or not.
async fn write_outcomes(
    db: &Db,
    rows: &[OutcomeRow],
    new: &[NewRow],
    tolerant: bool,
    statement_timeout: Duration,
) -> Result<HashSet<(i64, i32)>, db::Error> {
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let written = async {
        let mut applied = if rows.is_empty() {
            HashSet::new()
        } else {
            apply_outcomes(&mut tx, rows).await?
        };
        applied.extend(inserted(&mut tx, new, tolerant).await?);
        Ok(applied)
    }
    .await;
    tx.commit_if_ok(written).await
}

/// Insert `new` in `tx`; the `(key, attempt)` pairs inserted.
async fn inserted(
    tx: &mut Tx,
    new: &[NewRow],
    tolerant: bool,
) -> Result<Vec<(i64, i32)>, db::Error> {
    let keys = insert_outcomes(tx, new, tolerant).await?;
    Ok(new
        .iter()
        .filter(|r| keys.contains(&r.key))
        .map(|r| (r.key, r.attempt))
        .collect())
}

/// A 410 Gone heard from `url`, the endpoint's address when the attempt was
/// claimed: what it turns off, and why.
#[derive(Debug, Clone)]
pub(crate) struct Gone {
    pub endpoint_id: i64,
    pub url: String,
    pub reason: String,
}

/// Write one attempt's outcome like [`record_outcomes`]: `row`, or `new`
/// when the delivery was handed over unwritten. `disable_endpoint` (a 410)
/// disables the endpoint in the same transaction, only when the outcome was
/// applied and the endpoint still has the URL that answered: a tenant that
/// moved it meanwhile to a new address keeps it on (docs/adr/0112). Returns
/// false for a stale attempt: nothing was written. `new` is inserted as
/// [`record_outcomes`] inserts it.
pub(crate) async fn record_outcome(
    db: &Db,
    row: &OutcomeRow,
    new: Option<&NewRow>,
    disable_endpoint: Option<Gone>,
    statement_timeout: Duration,
) -> Result<bool, db::Error> {
    match write_outcome(
        db,
        row,
        new,
        disable_endpoint.clone(),
        false,
        statement_timeout,
    )
    .await
    {
        Err(e) if pair_written(&e) => {
            write_outcome(db, row, new, disable_endpoint, true, statement_timeout).await
        }
        written => written,
    }
}

/// [`record_outcome`] in one transaction, `new` inserted `tolerant` or not.
async fn write_outcome(
    db: &Db,
    row: &OutcomeRow,
    new: Option<&NewRow>,
    disable_endpoint: Option<Gone>,
    tolerant: bool,
    statement_timeout: Duration,
) -> Result<bool, db::Error> {
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let written = async {
        let applied = match new {
            Some(new) => !inserted(&mut tx, std::slice::from_ref(new), tolerant)
                .await?
                .is_empty(),
            None => apply_outcomes(&mut tx, std::slice::from_ref(row))
                .await?
                .contains(&(row.id, row.attempt)),
        };
        if applied && let Some(gone) = disable_endpoint {
            disable_gone(&mut tx, gone).await?;
        }
        Ok(applied)
    }
    .await;
    tx.commit_if_ok(written).await
}

/// The CTE that keeps each endpoint's `failing_since` (migration 0031) from
/// an outcome statement's `ends (endpoint_id, delivered)`: set when the
/// statement holds only failures for it, cleared when one delivered, and left
/// unwritten when that is already so. Shared by [`APPLY_OUTCOMES`] and
/// `unwritten::INSERT_OUTCOMES`.
macro_rules! endpoint_health {
    () => {
        "health AS ( \
           UPDATE webhook_endpoints e \
           SET failing_since = CASE WHEN s.delivered THEN NULL ELSE now() END \
           FROM ends s \
           WHERE e.id = s.endpoint_id \
             AND (e.failing_since IS NULL) = NOT s.delivered) "
    };
}
pub(super) use endpoint_health;

/// The outcome statement of [`apply_outcomes`]; `pub` only for the plan tests
/// (`tests/it/plans.rs`). An applied outcome that did not deliver also writes
/// its attempt's row of the delivery's history (`webhook_delivery_attempts`,
/// at the attempt's claim time), in the same statement: it is fenced by the
/// same compare-and-set, so a stale attempt writes no history either. The
/// delivering attempt is the delivery row's own `last_*` columns. An outcome
/// that finishes a delivery stamps `next_attempt_at` now: the retention
/// prune's age is from when it finished (docs/adr/0100). Each
/// endpoint of the group has its `failing_since` (migration 0031) set when
/// the group holds only failures for it, cleared when one of them
/// delivered, and left unwritten when that is already so.
pub const APPLY_OUTCOMES: &str = concat!(
    "WITH applied AS ( \
         UPDATE webhook_deliveries d \
         SET status = o.next_state, \
             claimed_until = NULL, \
             next_attempt_at = CASE WHEN o.next_state = 'pending' \
                                    THEN now() + make_interval(secs => o.retry_secs) \
                                    ELSE now() END, \
             delivered_at = CASE WHEN o.next_state = 'delivered' THEN now() END, \
             last_status_code = o.status_code, \
             last_error = o.error, \
             last_latency_ms = o.latency_ms \
         FROM unnest($1::int8[], $2::int4[], $3::text[], $4::float8[], \
                     $5::int4[], $6::text[], $7::int4[], $8::text[], $9::text[]) \
              AS o(id, attempt, next_state, retry_secs, status_code, error, latency_ms, was, snippet) \
         WHERE d.id = o.id AND d.attempts = o.attempt AND d.status = o.was \
         RETURNING d.id, d.tenant_id, d.endpoint_id, o.attempt, o.next_state, \
                   d.last_attempt_at, o.status_code, o.latency_ms, o.error, o.snippet), \
       history AS ( \
         INSERT INTO webhook_delivery_attempts \
             (tenant_id, delivery_id, attempt, attempted_at, status_code, latency_ms, \
              error_category, response_snippet) \
         SELECT tenant_id, id, attempt, coalesce(last_attempt_at, now()), status_code, \
                latency_ms, error, snippet \
         FROM applied WHERE next_state <> 'delivered'), \
       ends AS ( \
         SELECT endpoint_id, bool_or(next_state = 'delivered') AS delivered \
         FROM applied GROUP BY endpoint_id), \
",
    endpoint_health!(),
    "       SELECT id, attempt FROM applied"
);

/// The status a compare-and-set expects its delivery in. It is bound as one
/// more column of the unnested group (`was`), not written as a literal, so
/// that the predicate does not match `webhook_deliveries_due`'s and the
/// planner reaches each row by its primary key: with the literal, a table
/// whose statistics expect few pending rows was scanned pending row by
/// pending row for every group (docs/adr/0023).
const PENDING: &str = "pending";

/// An outcome group's columns as its statement binds them: the next state
/// and its wait, and what the attempt saw (the error cut to
/// [`MAX_ERROR_CHARS`]).
pub(super) struct Columns {
    pub states: Vec<String>,
    pub retry_secs: Vec<f64>,
    pub codes: Vec<Option<i32>>,
    pub errors: Vec<Option<String>>,
    pub latencies: Vec<Option<i32>>,
    pub snippets: Vec<Option<String>>,
}

impl Columns {
    pub(super) fn with_capacity(n: usize) -> Columns {
        Columns {
            states: Vec::with_capacity(n),
            retry_secs: Vec::with_capacity(n),
            codes: Vec::with_capacity(n),
            errors: Vec::with_capacity(n),
            latencies: Vec::with_capacity(n),
            snippets: Vec::with_capacity(n),
        }
    }

    pub(super) fn push(&mut self, next: NextState, observed: &Observed) {
        let (status, wait) = match next {
            NextState::Delivered => ("delivered", 0.0),
            NextState::RetryAfter(wait) => ("pending", wait.as_secs_f64()),
            NextState::Dead => ("dead", 0.0),
        };
        self.states.push(status.to_owned());
        self.retry_secs.push(wait);
        self.codes.push(observed.status_code.map(i32::from));
        self.errors.push(
            observed
                .error
                .as_ref()
                .map(|e| e.chars().take(MAX_ERROR_CHARS).collect::<String>()),
        );
        self.latencies.push(
            observed
                .latency
                .map(|l| i32::try_from(l.as_millis()).unwrap_or(i32::MAX)),
        );
        self.snippets.push(observed.response_snippet.clone());
    }
}

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
    let mut c = Columns::with_capacity(n);
    for r in rows {
        ids.push(r.id);
        attempts.push(r.attempt);
        c.push(r.next, &r.observed);
    }
    let applied = tx
        .fetch_all(
            sql(APPLY_OUTCOMES)
                .bind(ids)
                .bind(attempts)
                .bind(c.states)
                .bind(c.retry_secs)
                .bind(c.codes)
                .bind(c.errors)
                .bind(c.latencies)
                .bind(vec![PENDING; n])
                .bind(c.snippets),
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
/// Returns whether the claim was handed back. A delivery handed over
/// unwritten is inserted instead, pending and due now ([`hold_unsent`]).
pub(crate) async fn release_unsent(
    db: &Db,
    delivery_id: i64,
    attempt: i32,
    new: Option<&NewRow>,
    statement_timeout: Duration,
) -> Result<bool, db::Error> {
    if let Some(new) = new {
        let held = hold_unsent(db, &[], std::slice::from_ref(new), statement_timeout).await?;
        return Ok(held == 1);
    }
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
/// happen only while an endpoint or tenant is saturated. A hold that says why
/// (an endpoint whose secret cannot be opened) writes it as `last_error`.
/// Deliveries handed over unwritten (`new`, at attempt 0) are inserted in
/// the same transaction, pending until their wait ends, skipping a pair
/// already written (rare enough on this path not to try a plain insert
/// first).
pub(crate) async fn hold_unsent(
    db: &Db,
    held: &[HoldRow],
    new: &[NewRow],
    statement_timeout: Duration,
) -> Result<u64, db::Error> {
    if held.is_empty() {
        if new.is_empty() {
            return Ok(0);
        }
        let mut tx = db.begin_index_driven(statement_timeout).await?;
        let n = inserted(&mut tx, new, true).await?.len();
        tx.commit().await?;
        return Ok(n as u64);
    }
    let ids: Vec<i64> = held.iter().map(|h| h.0).collect();
    let attempts: Vec<i32> = held.iter().map(|h| h.1).collect();
    let secs: Vec<f64> = held.iter().map(|h| h.2.as_secs_f64()).collect();
    let why: Vec<Option<String>> = held.iter().map(|h| h.3.map(|f| f.to_string())).collect();
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let n = tx
        .execute(
            sql("UPDATE webhook_deliveries d \
                 SET attempts = d.attempts - 1, \
                     claimed_until = NULL, \
                     next_attempt_at = GREATEST(d.next_attempt_at, \
                                                now() + make_interval(secs => h.secs)), \
                     last_error = COALESCE(h.why, d.last_error) \
                 FROM unnest($1::int8[], $2::int4[], $3::float8[], $4::text[], $5::text[]) \
                      AS h(id, attempt, secs, was, why) \
                 WHERE d.id = h.id AND d.attempts = h.attempt AND d.status = h.was")
            .bind(ids)
            .bind(attempts)
            .bind(secs)
            .bind(vec![PENDING; held.len()])
            .bind(why),
        )
        .await?;
    let n = n + inserted(&mut tx, new, true).await?.len() as u64;
    tx.commit().await?;
    Ok(n)
}

/// A claim to hand back unsent: its id, the attempt its claim set, how long
/// to hold it, and why (written as `last_error` when given).
pub(crate) type HoldRow = (i64, i32, Duration, Option<crate::failure::Failure>);
