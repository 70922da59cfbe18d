//! The SQL of deliveries handed over unwritten (docs/adr/0124): each is
//! inserted once, with its first attempt's outcome or handed back unsent,
//! and the `webhook_handoffs` row that stood for it is deleted once every
//! pair of it is written.

use std::collections::HashMap;
use std::time::Duration;

use db::{Db, Row, Tx, sql};

use super::outcomes::{Columns, Gone, NextState, Observed, endpoint_health};

/// A delivery handed over by the fan-out and not written yet, with what its
/// row needs.
#[derive(Debug, Clone)]
pub(crate) struct Pair {
    pub tenant_id: String,
    pub event_id: i64,
    pub endpoint_id: i64,
    /// The `webhook_handoffs` row that stands for it until it is written.
    pub handoff: i64,
    /// When the fan-out handed it over, on the database clock (seconds since
    /// the epoch): its claim, so its attempt's time, as a claim would stamp
    /// `last_attempt_at`.
    pub handed_at: f64,
}

/// One unwritten delivery's row, to insert: after its attempt (`attempt` 1,
/// claimed at `pair.handed_at`), or handed back unsent (`attempt` 0, due
/// after a wait, `observed.error` saying why when it says).
#[derive(Debug, Clone)]
pub(crate) struct NewRow {
    /// The id the delivery role knows it by (negative; docs/adr/0124).
    pub key: i64,
    pub pair: Pair,
    pub attempt: i32,
    pub next: NextState,
    pub observed: Observed,
}

/// The statement of [`insert_outcomes`], with its `ON CONFLICT` clause
/// (`$conflict`): [`INSERT_OUTCOMES`] has none, [`INSERT_OUTCOMES_TOLERANT`]
/// skips a pair already written. An attempted row that did not deliver
/// writes its attempt's history, and the endpoints' `failing_since` is kept
/// as `APPLY_OUTCOMES` keeps it.
macro_rules! insert_outcomes_sql {
    ($conflict:literal) => {
        concat!(
    "WITH o AS MATERIALIZED ( \
         SELECT * FROM unnest($1::text[], $2::int8[], $3::int8[], $4::int4[], $5::text[], \
                              $6::float8[], $7::int4[], $8::text[], $9::int4[], $10::text[], \
                              $11::float8[]) \
              AS o(tenant_id, event_id, endpoint_id, attempt, next_state, retry_secs, \
                   status_code, error, latency_ms, snippet, handed_at)), \
       applied AS ( \
         INSERT INTO webhook_deliveries \
             (tenant_id, event_id, endpoint_id, attempts, status, next_attempt_at, \
              last_attempt_at, delivered_at, last_status_code, last_error, last_latency_ms) \
         SELECT o.tenant_id, o.event_id, o.endpoint_id, o.attempt, o.next_state, \
                CASE WHEN o.next_state = 'pending' \
                     THEN now() + make_interval(secs => o.retry_secs) ELSE now() END, \
                CASE WHEN o.attempt > 0 THEN to_timestamp(o.handed_at) END, \
                CASE WHEN o.next_state = 'delivered' THEN now() END, \
                o.status_code, o.error, o.latency_ms \
         FROM o \
         ORDER BY o.event_id, o.endpoint_id ",
    $conflict,
    "    RETURNING id, tenant_id, event_id, endpoint_id, attempts, status, last_attempt_at), \
       history AS ( \
         INSERT INTO webhook_delivery_attempts \
             (tenant_id, delivery_id, attempt, attempted_at, status_code, latency_ms, \
              error_category, response_snippet) \
         SELECT a.tenant_id, a.id, a.attempts, a.last_attempt_at, o.status_code, \
                o.latency_ms, o.error, o.snippet \
         FROM applied a JOIN o ON o.event_id = a.event_id AND o.endpoint_id = a.endpoint_id \
         WHERE a.attempts > 0 AND a.status <> 'delivered'), \
       ends AS ( \
         SELECT endpoint_id, bool_or(status = 'delivered') AS delivered \
         FROM applied WHERE attempts > 0 GROUP BY endpoint_id), \
",
    endpoint_health!(),
    "       SELECT event_id, endpoint_id FROM applied"
        )
    };
}

/// Each row inserted once, with no conflict clause; `pub` only for the plan
/// tests (`tests/it/plans.rs`). A pair is almost never written already (the
/// fan-out inserts a handed pair only after its handoff's lease ended), and
/// a plain insert costs Postgres less per row than one that first checks
/// for a conflict (docs/adr/0126): when one is there, the statement fails on
/// `webhook_deliveries_event_endpoint_key` and [`insert_outcomes`]'s caller
/// writes the group again with [`INSERT_OUTCOMES_TOLERANT`].
pub const INSERT_OUTCOMES: &str = insert_outcomes_sql!("");

/// [`INSERT_OUTCOMES`] that leaves a pair already in `webhook_deliveries`
/// (the fan-out inserted it pending after the handoff's lease ended, or a
/// replayed event's pair handed over twice) as it is: its outcome is stale,
/// as an outcome whose compare-and-set found a later claim.
pub const INSERT_OUTCOMES_TOLERANT: &str = insert_outcomes_sql!(
    "\
         ON CONFLICT (event_id, endpoint_id) DO NOTHING \
     "
);

/// The key a plain [`INSERT_OUTCOMES`] fails on when a pair is already
/// written.
const PAIR_KEY: &str = "webhook_deliveries_event_endpoint_key";

/// Whether `e` is [`INSERT_OUTCOMES`] finding a pair already written (or
/// twice in its group: a replayed event handed over again while its first
/// handoff was unwritten): the group is to be written again with
/// [`INSERT_OUTCOMES_TOLERANT`]. Postgres logs each such failure as an
/// ERROR; it is expected and rare.
pub(crate) fn pair_written(e: &db::Error) -> bool {
    e.code().as_deref() == Some("23505") && e.constraint() == Some(PAIR_KEY)
}

/// Insert `rows` in `tx`; returns the keys of the rows inserted. With
/// `tolerant` ([`INSERT_OUTCOMES_TOLERANT`]) a row not among them was stale:
/// its pair was already written. Without it ([`INSERT_OUTCOMES`]) such a row
/// fails the statement ([`pair_written`]), and the transaction with it.
pub(crate) async fn insert_outcomes(
    tx: &mut Tx,
    rows: &[NewRow],
    tolerant: bool,
) -> Result<Vec<i64>, db::Error> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let n = rows.len();
    let mut tenants = Vec::with_capacity(n);
    let mut events = Vec::with_capacity(n);
    let mut endpoints = Vec::with_capacity(n);
    let mut attempts = Vec::with_capacity(n);
    let mut c = Columns::with_capacity(n);
    let mut handed_at = Vec::with_capacity(n);
    let mut keys = HashMap::with_capacity(n);
    for r in rows {
        keys.insert((r.pair.event_id, r.pair.endpoint_id), r.key);
        tenants.push(r.pair.tenant_id.clone());
        events.push(r.pair.event_id);
        endpoints.push(r.pair.endpoint_id);
        attempts.push(r.attempt);
        c.push(r.next, &r.observed);
        handed_at.push(r.pair.handed_at);
    }
    let applied = tx
        .fetch_all(
            sql(if tolerant {
                INSERT_OUTCOMES_TOLERANT
            } else {
                INSERT_OUTCOMES
            })
            .bind(tenants)
            .bind(events)
            .bind(endpoints)
            .bind(attempts)
            .bind(c.states)
            .bind(c.retry_secs)
            .bind(c.codes)
            .bind(c.errors)
            .bind(c.latencies)
            .bind(c.snippets)
            .bind(handed_at),
        )
        .await?;
    applied
        .iter()
        .map(|r| {
            let pair = (r.try_get::<i64, _>(0)?, r.try_get::<i64, _>(1)?);
            Ok(keys.get(&pair).copied().unwrap_or_default())
        })
        .collect()
}

/// Disable the endpoint that answered 410 Gone, in `tx`, while it still has
/// the URL that answered (docs/adr/0112).
pub(crate) async fn disable_gone(tx: &mut Tx, gone: Gone) -> Result<(), db::Error> {
    tx.execute(
        sql("UPDATE webhook_endpoints \
             SET enabled = false, disabled_reason = $2, disabled_at = now() \
             WHERE id = $1 AND enabled AND url = $3")
        .bind(gone.endpoint_id)
        .bind(gone.reason)
        .bind(gone.url),
    )
    .await?;
    Ok(())
}

/// Delete the handoffs whose every pair is written: nothing is left for the
/// fan-out to recover from them. Best effort: a handoff left behind costs
/// the fan-out a check of each pair (all already written) after its lease.
pub(crate) async fn delete_handoffs(
    db: &Db,
    handoffs: &[i64],
    statement_timeout: Duration,
) -> Result<u64, db::Error> {
    if handoffs.is_empty() {
        return Ok(0);
    }
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let n = tx
        .execute(sql("DELETE FROM webhook_handoffs WHERE id = ANY ($1)").bind(handoffs.to_vec()))
        .await?;
    tx.commit().await?;
    Ok(n)
}

impl NewRow {
    /// The row of an attempt's outcome (`row`, keyed by its negative id).
    pub(crate) fn outcome(row: &super::OutcomeRow, pair: Pair) -> NewRow {
        NewRow {
            key: row.id,
            pair,
            attempt: row.attempt,
            next: row.next,
            observed: row.observed.clone(),
        }
    }

    /// The row of a delivery handed back unsent: attempt 0 (none was made),
    /// due after `wait`, with `why` as its `last_error` when given.
    pub(crate) fn unsent(key: i64, pair: Pair, wait: Duration, why: Option<String>) -> NewRow {
        NewRow {
            key,
            pair,
            attempt: 0,
            next: NextState::RetryAfter(wait),
            observed: Observed {
                error: why,
                ..Observed::default()
            },
        }
    }
}
