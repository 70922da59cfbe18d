//! The claim's SQL: the fenced claim of due emails (`CLAIM_DUE`).

use std::time::Duration;

use db::{Db, PgRow, Row, TENANTS_PER_CLAIM, TenantCursor, Walk, sql};
use leader::Fence;

use crate::message::Queued;
use outbox::email::Email;

fn queued(r: &PgRow) -> Result<Queued, db::Error> {
    Ok(Queued {
        id: r.try_get("id")?,
        tenant_id: r.try_get("tenant_id")?,
        attempt: r.try_get("attempts")?,
        resent_at_attempt: r.try_get("resent_at_attempt")?,
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
/// (`tests/it/plans.rs`). It interleaves tenants (docs/adr/0048, `db::fair`):
/// `tenants` walks `email_outbox_due` (tenant, due time, id) one descent per
/// tenant after the cursor (`$5`, at most `$6` tenants), `first` takes each
/// one's share of the limit in due order, `fill` shares the rest between the
/// tenants that took all of theirs, after the last row each took.
pub const CLAIM_DUE: &str = concat!(
    "WITH RECURSIVE ",
    db::fair_tenants!("email_outbox", "status = 'queued'", "$5", "$6", "$3"),
    "first AS MATERIALIZED ( \
           SELECT pick.* FROM tenants t CROSS JOIN share s, LATERAL ( \
             SELECT x.*, row_number() OVER () AS turn FROM ( \
               SELECT m.id, m.tenant_id, m.next_attempt_at, m.attempts - m.resent_at_attempt AS made FROM email_outbox m \
               WHERE m.status = 'queued' AND m.tenant_id = t.tenant_id \
                 AND m.next_attempt_at <= now() \
                 AND leader_fence($1, $2) \
               ORDER BY m.next_attempt_at, m.id \
               LIMIT s.quota \
               FOR UPDATE SKIP LOCKED) x) pick), \
         whole AS MATERIALIZED ( \
           SELECT f.tenant_id, f.next_attempt_at, f.id FROM first f, share s \
           WHERE f.turn = s.quota), \
         fill AS MATERIALIZED ( \
           SELECT more.* FROM whole w, LATERAL ( \
             SELECT m.id, m.tenant_id, m.next_attempt_at, m.attempts - m.resent_at_attempt AS made FROM email_outbox m \
             WHERE m.status = 'queued' AND m.tenant_id = w.tenant_id \
               AND m.next_attempt_at <= now() \
               AND (m.next_attempt_at, m.id) > (w.next_attempt_at, w.id) \
               AND leader_fence($1, $2) \
             ORDER BY m.next_attempt_at, m.id \
             LIMIT ($3 - (SELECT count(*) FROM first)) / greatest(1, (SELECT count(*) FROM whole)) \
             FOR UPDATE SKIP LOCKED) more), \
         due AS (SELECT id, made FROM first UNION ALL SELECT id, made FROM fill), \
         exhausted AS ( \
           UPDATE email_outbox m \
           SET status = 'failed', \
               last_attempt_at = now(), \
               last_reply_code = NULL, \
               last_reply_text = 'attempts_exhausted: every attempt was claimed and none wrote a result' \
           FROM due WHERE m.id = due.id AND due.made >= $7 \
           RETURNING m.id), \
         claimed AS ( \
           UPDATE email_outbox m \
           SET attempts = m.attempts + 1, \
               next_attempt_at = now() + make_interval(secs => $4), \
               last_attempt_at = now() \
           FROM due WHERE m.id = due.id AND due.made < $7 \
           RETURNING m.id, m.tenant_id, m.attempts, m.resent_at_attempt, m.message_id, \
                     m.sender, m.recipients, m.subject, m.text_body, m.html_body) \
         SELECT claimed.*, share.tenants, share.last_tenant, \
                (SELECT count(*) FROM exhausted) AS exhausted \
         FROM share LEFT JOIN claimed ON true"
);

/// The fenced funnel: claim up to `limit` due queued emails in one `UPDATE …
/// RETURNING`. Each claimed row's `attempts` goes up by one (the attempt its
/// result must prove) and `next_attempt_at` moves `lease` ahead, so if this
/// process dies before writing a result the email comes due again by itself.
///
/// Tenants are interleaved (docs/adr/0048): every tenant with due emails
/// among the next [`db::TENANTS_PER_CLAIM`] after `cursor` gets its share of
/// the batch, and `cursor` moves on. A statement that claims nothing is
/// followed by the next, until one claims or every tenant was visited
/// ([`Walk`]).
///
/// The fence sits in the innermost WHERE, next to `FOR UPDATE SKIP LOCKED`: a
/// stale token claims nothing, and rows another claim holds are skipped.
///
/// The ceiling: a due email already claimed `max_attempts` times (the
/// attempts a send's result would allow, `retry_delays` and one) since it was
/// last resent (`resent_at_attempt`, migration 0041) is not handed out again; the same statement marks it `failed` with
/// `attempts_exhausted`. An attempt whose process died before its result
/// (killed, out of memory) is counted by its claim, so an email that takes the
/// process down at every send stops after its attempts, as a webhook delivery
/// does (docs/adr/0072), instead of coming back to every next leader. Returns
/// the claimed emails; adds to `exhausted` how many the ceiling failed
/// (docs/adr/0109). Each statement of the walk commits on its own, so those
/// an earlier statement failed are added even when a later one errors
/// (docs/adr/0141).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn claim_due(
    db: &Db,
    fence: &Fence,
    cursor: &TenantCursor,
    limit: usize,
    lease: Duration,
    max_attempts: usize,
    statement_timeout: Duration,
    exhausted: &mut u64,
) -> Result<Vec<Queued>, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let bound = TENANTS_PER_CLAIM.min(limit);
    let mut walk = Walk::default();
    while let Some(after) = walk.next(cursor) {
        let mut tx = db.begin_index_driven(statement_timeout).await?;
        let rows = tx
            .fetch_all(
                sql(CLAIM_DUE)
                    .bind(fence.role_name())
                    .bind(fence.token())
                    .bind(limit)
                    .bind(lease.as_secs_f64())
                    .bind(after)
                    .bind(bound)
                    .bind(i32::try_from(max_attempts).unwrap_or(i32::MAX)),
            )
            .await?;
        tx.commit().await?;
        // The statement's one count, on each of its rows.
        if let Some(r) = rows.first() {
            let failed: i64 = r.try_get("exhausted")?;
            *exhausted += u64::try_from(failed).unwrap_or(0);
        }
        let mut claimed = cursor
            .claimed(rows, bound)?
            .iter()
            .map(queued)
            .collect::<Result<Vec<_>, _>>()?;
        if !claimed.is_empty() {
            claimed.sort_by_key(|q| q.id);
            return Ok(claimed);
        }
    }
    Ok(Vec::new())
}
