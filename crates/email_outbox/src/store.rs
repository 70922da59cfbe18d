//! All of the email outbox's SQL: the inserts producers make (one email, or a
//! batch that may record refusals), the fenced claim,
//! the result writes (one statement per group, each row a compare-and-set on
//! its attempt), handing back unsent claims, and the gauges.

use std::collections::HashSet;
use std::time::Duration;

use db::{Db, PgRow, Row, Tx, sql};
use leader::Fence;

use crate::email::{Email, Invalid, Queued};
use crate::verdict::Next;

pub(crate) async fn insert_email(
    tx: &mut Tx,
    tenant_id: &str,
    email: &Email,
    message_id: &str,
) -> Result<i64, db::Error> {
    let row = tx
        .fetch_one(
            sql("INSERT INTO email_outbox \
                   (tenant_id, message_id, sender, recipients, subject, text_body, html_body) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id")
            .bind(tenant_id.to_owned())
            .bind(message_id.to_owned())
            .bind(email.from.clone())
            .bind(email.to.clone())
            .bind(email.subject.clone())
            .bind(email.text.clone())
            .bind(email.html.clone()),
        )
        .await?;
    Ok(row.try_get("id")?)
}

/// One row of [`insert_batch`]: an email to queue, or a refused one to record
/// `failed` with its refusal.
pub(crate) struct NewRow<'a> {
    pub tenant_id: &'a str,
    pub email: &'a Email,
    pub refused: Option<&'a Invalid>,
}

/// Insert many emails with one statement; returns how many rows were written.
/// Each gets its own `Message-ID`. A refused row is written as given: the
/// caller passes [`Email::refusal_record`].
pub(crate) async fn insert_batch(tx: &mut Tx, rows: &[NewRow<'_>]) -> Result<u64, db::Error> {
    if rows.is_empty() {
        return Ok(0);
    }
    let col = |f: &dyn Fn(&NewRow<'_>) -> String| rows.iter().map(f).collect::<Vec<_>>();
    let opt = |f: &dyn Fn(&NewRow<'_>) -> Option<String>| rows.iter().map(f).collect::<Vec<_>>();
    // Recipients vary in number per email: one flat array, and each email's
    // slice of it (1-based, inclusive bounds; empty when hi < lo).
    let (mut flat, mut lo, mut hi) = (Vec::new(), Vec::new(), Vec::new());
    for r in rows {
        lo.push(i32::try_from(flat.len() + 1).unwrap_or(i32::MAX));
        flat.extend(r.email.to.iter().cloned());
        hi.push(i32::try_from(flat.len()).unwrap_or(i32::MAX));
    }
    tx.execute(
        sql("INSERT INTO email_outbox \
               (tenant_id, message_id, sender, recipients, subject, text_body, html_body, \
                status, refused, last_reply_text) \
             SELECT e.tenant_id, e.message_id, e.sender, ($4::text[])[e.lo:e.hi], e.subject, \
                    e.text_body, e.html_body, e.status, e.refused, e.reply_text \
             FROM unnest($1::text[], $2::text[], $3::text[], $5::int4[], $6::int4[], \
                         $7::text[], $8::text[], $9::text[], $10::text[], $11::text[], \
                         $12::text[]) \
                  AS e(tenant_id, message_id, sender, lo, hi, subject, text_body, html_body, \
                       status, refused, reply_text)")
        .bind(col(&|r| r.tenant_id.to_owned()))
        .bind(col(&|r| crate::email::new_message_id(&r.email.from)))
        .bind(col(&|r| r.email.from.clone()))
        .bind(flat)
        .bind(lo)
        .bind(hi)
        .bind(col(&|r| r.email.subject.clone()))
        .bind(col(&|r| r.email.text.clone()))
        .bind(opt(&|r| r.email.html.clone()))
        .bind(col(&|r| {
            if r.refused.is_some() {
                "failed"
            } else {
                QUEUED
            }
            .to_owned()
        }))
        .bind(opt(&|r| r.refused.map(|i| i.reason().to_owned())))
        .bind(opt(&|r| r.refused.map(|i| reply_text(&i.to_string())))),
    )
    .await
}

/// `text` as `last_reply_text` keeps it: at most [`MAX_REPLY_CHARS`]
/// characters, NUL (which Postgres text cannot hold) replaced by U+FFFD.
fn reply_text(text: &str) -> String {
    text.chars()
        .take(MAX_REPLY_CHARS)
        .map(|c| {
            if c == '\0' {
                char::REPLACEMENT_CHARACTER
            } else {
                c
            }
        })
        .collect()
}

fn queued(r: &PgRow) -> Result<Queued, db::Error> {
    Ok(Queued {
        id: r.try_get("id")?,
        tenant_id: r.try_get("tenant_id")?,
        attempt: r.try_get("attempts")?,
        message_id: r.try_get("message_id")?,
        email: Email {
            from: r.try_get("sender")?,
            to: r.try_get("recipients")?,
            subject: r.try_get("subject")?,
            text: r.try_get("text_body")?,
            html: r.try_get("html_body")?,
        },
    })
}

/// The claim statement of [`claim_due`]; `pub` only for the plan tests
/// (`tests/it/plans.rs`).
pub const CLAIM_DUE: &str = "WITH due AS MATERIALIZED ( \
           SELECT id FROM email_outbox \
           WHERE status = 'queued' \
             AND next_attempt_at <= now() \
             AND leader_fence($1, $2) \
           ORDER BY next_attempt_at, id \
           LIMIT $3 \
           FOR UPDATE SKIP LOCKED) \
         UPDATE email_outbox m \
         SET attempts = m.attempts + 1, \
             next_attempt_at = now() + make_interval(secs => $4), \
             last_attempt_at = now() \
         FROM due WHERE m.id = due.id \
         RETURNING m.id, m.tenant_id, m.attempts, m.message_id, m.sender, m.recipients, \
                   m.subject, m.text_body, m.html_body";

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

/// The status a result's or a hand-back's compare-and-set expects its email
/// in, bound as a column of the unnested group (`was`) rather than written as a
/// literal: the literal matches `email_outbox_due`'s predicate, and a table
/// whose statistics expect few queued rows was then read queued row by queued
/// row for every group (docs/adr/0023).
const QUEUED: &str = "queued";

/// The fenced funnel: claim up to `limit` due queued emails in one `UPDATE …
/// RETURNING`. Each claimed row's `attempts` goes up by one (the attempt its
/// result must prove) and `next_attempt_at` moves `lease` ahead, so if this
/// process dies before writing a result the email comes due again by itself.
///
/// The fence sits in the innermost WHERE, next to `FOR UPDATE SKIP LOCKED`: a
/// stale token claims nothing, and rows another claim holds are skipped.
pub(crate) async fn claim_due(
    db: &Db,
    fence: &Fence,
    limit: usize,
    lease: Duration,
    statement_timeout: Duration,
) -> Result<Vec<Queued>, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let rows = tx
        .fetch_all(
            sql(CLAIM_DUE)
                .bind(fence.role_name())
                .bind(fence.token())
                .bind(limit)
                .bind(lease.as_secs_f64()),
        )
        .await?;
    tx.commit().await?;
    let mut claimed = rows.iter().map(queued).collect::<Result<Vec<_>, _>>()?;
    claimed.sort_by_key(|q| q.id);
    Ok(claimed)
}

/// Longest `last_reply_text` kept.
const MAX_REPLY_CHARS: usize = 1000;

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

/// The backlog, on the database clock, through the partial indexes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Backlog {
    pub queued: i64,
    pub failed: i64,
    /// Seconds since the oldest queued email was created; 0 when none.
    pub oldest_queued_age: f64,
}

pub(crate) async fn backlog(db: &Db, statement_timeout: Duration) -> Result<Backlog, db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let row = tx
        .fetch_one(sql(
            "SELECT (SELECT count(*) FROM email_outbox WHERE status = 'queued') AS queued, \
                    (SELECT count(*) FROM email_outbox WHERE status = 'failed') AS failed, \
                    coalesce(extract(epoch FROM now() - \
                        (SELECT min(created_at) FROM email_outbox WHERE status = 'queued')), \
                        0)::float8 AS oldest",
        ))
        .await?;
    tx.commit().await?;
    Ok(Backlog {
        queued: row.try_get("queued")?,
        failed: row.try_get("failed")?,
        oldest_queued_age: row.try_get("oldest")?,
    })
}
