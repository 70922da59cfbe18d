//! The claim's SQL: the fenced claim of due emails (`CLAIM_DUE`).

use std::time::Duration;

use db::{Db, PgRow, Row, sql};
use leader::Fence;

use crate::message::Queued;
use outbox::email::Email;

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
