//! The results' SQL: one statement per group of results (`RECORD_RESULTS`),
//! each row a compare-and-set on its attempt, and handing back unsent claims
//! by the same compare-and-set.

use std::collections::HashSet;
use std::time::Duration;

use db::{Db, Row, sql};

use super::columns::{QUEUED, reply_text};
use crate::verdict::Next;

/// The result statement of [`record_results`]; `pub` only for the plan tests
/// (`tests/it/plans.rs`).
pub const RECORD_RESULTS: &str = "UPDATE email_outbox m \
         SET status = o.next_state, \
             next_attempt_at = CASE WHEN o.next_state = 'queued' \
                                    THEN now() + make_interval(secs => o.wait_secs) \
                                    ELSE m.next_attempt_at END, \
             sent_at = CASE WHEN o.next_state = 'sent' THEN now() END, \
             last_reply_code = o.reply_code, \
             last_reply_text = o.reply_text \
         FROM unnest($1::int8[], $2::int4[], $3::text[], $4::float8[], $5::int4[], $6::text[], \
                     $7::text[]) \
              AS o(id, attempt, next_state, wait_secs, reply_code, reply_text, was) \
         WHERE m.id = o.id AND m.attempts = o.attempt AND m.status = o.was \
         RETURNING m.id, o.attempt";

/// One finished send's result, waiting to be written.
#[derive(Debug, Clone)]
pub(crate) struct ResultRow {
    pub id: i64,
    pub attempt: i32,
    pub next: Next,
    pub reply_code: Option<u16>,
    pub reply_text: String,
}

/// Write a group of results with one statement. Each row is a compare-and-set
/// of its own: applied only while its email is queued at exactly `attempt`.
/// Returns the `(id, attempt)` pairs applied; the others were stale and
/// nothing was written for them. On an error nothing was written.
pub(crate) async fn record_results(
    db: &Db,
    rows: &[ResultRow],
    statement_timeout: Duration,
) -> Result<HashSet<(i64, i32)>, db::Error> {
    if rows.is_empty() {
        return Ok(HashSet::new());
    }
    let n = rows.len();
    let (mut ids, mut attempts, mut states, mut waits, mut codes, mut texts) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for r in rows {
        let (state, wait) = match r.next {
            Next::Sent => ("sent", 0.0),
            Next::RetryAfter(wait) => ("queued", wait.as_secs_f64()),
            Next::Failed => ("failed", 0.0),
        };
        ids.push(r.id);
        attempts.push(r.attempt);
        states.push(state.to_owned());
        waits.push(wait);
        codes.push(r.reply_code.map(i32::from));
        texts.push(reply_text(&r.reply_text));
    }
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let applied = tx
        .fetch_all(
            sql(RECORD_RESULTS)
                .bind(ids)
                .bind(attempts)
                .bind(states)
                .bind(waits)
                .bind(codes)
                .bind(texts)
                .bind(vec![QUEUED; n]),
        )
        .await?;
    tx.commit().await?;
    applied
        .iter()
        .map(|r| Ok((r.try_get::<i64, _>(0)?, r.try_get::<i32, _>(1)?)))
        .collect()
}

/// Hand back claims that were never sent (the server was unreachable, the tick
/// ran out of time or was cancelled): due now, the attempt not counted. The same
/// compare-and-set as a result, so a claim taken over meanwhile is left alone.
/// Returns how many were handed back.
pub(crate) async fn hand_back(
    db: &Db,
    claims: &[(i64, i32)],
    statement_timeout: Duration,
) -> Result<u64, db::Error> {
    if claims.is_empty() {
        return Ok(0);
    }
    let ids: Vec<i64> = claims.iter().map(|c| c.0).collect();
    let attempts: Vec<i32> = claims.iter().map(|c| c.1).collect();
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let n = tx
        .execute(
            sql("UPDATE email_outbox m \
                 SET attempts = m.attempts - 1, next_attempt_at = now() \
                 FROM unnest($1::int8[], $2::int4[], $3::text[]) AS o(id, attempt, was) \
                 WHERE m.id = o.id AND m.attempts = o.attempt AND m.status = o.was")
            .bind(ids)
            .bind(attempts)
            .bind(vec![QUEUED; claims.len()]),
        )
        .await?;
    tx.commit().await?;
    Ok(n)
}
