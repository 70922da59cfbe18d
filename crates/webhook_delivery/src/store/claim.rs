//! The claim's SQL: the fenced claim of due deliveries (`CLAIM_DUE`) and the
//! idle probe's read of the same predicate.

use std::sync::Arc;
use std::time::Duration;

use db::{Db, PgRow, Row, TENANTS_PER_CLAIM, TenantCursor, Walk, sql};
use leader::Fence;
use outbox::webhook::{HandedDelivery, HandedEndpoint, HandedEvent};

use super::endpoints::sealed_from;
use crate::sealed::Sealed;

/// One claimed delivery with what its attempt needs, as the claim returned it.
pub(crate) struct ClaimedRow {
    pub id: i64,
    pub tenant_id: String,
    pub event_id: i64,
    pub endpoint_id: i64,
    pub attempt: i32,
    /// `attempts` when the delivery was last resent (0 if never): the claim's
    /// ceiling and the retry schedule count the attempts since.
    pub resent_at_attempt: i32,
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
    /// One row of [`CLAIM_DUE`] (`outbox::webhook_claimed_columns!`). The
    /// fan-out's deliveries claimed for this role come as
    /// [`HandedDelivery`] instead ([`ClaimedRow::from_handed`]; docs/adr/0127).
    pub(crate) fn from_row(r: &PgRow) -> Result<ClaimedRow, db::Error> {
        Ok(ClaimedRow::of(
            Keys {
                id: r.try_get("id")?,
                tenant_id: r.try_get("tenant_id")?,
                event_id: r.try_get("event_id")?,
                endpoint_id: r.try_get("endpoint_id")?,
                attempt: r.try_get("attempts")?,
                resent_at_attempt: r.try_get("resent_at_attempt")?,
            },
            HandedEndpoint::from_row(r)?,
            HandedEvent::from_row(r)?,
        ))
    }

    /// A delivery the fan-out handed over (docs/adr/0087, 0127), not written
    /// yet: its id is given by the caller (docs/adr/0124), its attempt is
    /// the first. The last delivery to hold its event or endpoint takes it
    /// without a copy.
    pub(crate) fn from_handed(d: HandedDelivery) -> ClaimedRow {
        ClaimedRow::of(
            Keys {
                id: 0,
                tenant_id: d.tenant_id,
                event_id: d.event_id,
                endpoint_id: d.endpoint_id,
                attempt: 1,
                resent_at_attempt: 0,
            },
            Arc::unwrap_or_clone(d.endpoint),
            Arc::unwrap_or_clone(d.event),
        )
    }

    fn of(pair: Keys, ep: HandedEndpoint, event: HandedEvent) -> ClaimedRow {
        ClaimedRow {
            id: pair.id,
            tenant_id: pair.tenant_id,
            event_id: pair.event_id,
            endpoint_id: pair.endpoint_id,
            attempt: pair.attempt,
            resent_at_attempt: pair.resent_at_attempt,
            url: ep.url,
            secret: sealed_from(ep.secret_ciphertext, ep.secret_key_id),
            previous_secret: sealed_from(ep.previous_secret_ciphertext, ep.previous_secret_key_id),
            enabled: ep.enabled,
            disabled_reason: ep.disabled_reason,
            event_type: event.event_type,
            message_id: event.message_id,
            event_time: event.event_time,
            payload: event.payload,
        }
    }
}

/// A claimed row's own columns, beside its endpoint's and event's.
struct Keys {
    id: i64,
    tenant_id: String,
    event_id: i64,
    endpoint_id: i64,
    attempt: i32,
    resent_at_attempt: i32,
}

/// The claim statement of [`claim_due`]; `pub` only for the plan tests
/// (`tests/it/plans.rs`). It interleaves tenants (docs/adr/0048, `db::fair`):
/// `tenants` walks `webhook_deliveries_due` (tenant, due time, id) one
/// descent per tenant after the cursor (`$6`, at most `$7` tenants), `first`
/// takes each one's share of the limit in due order, `fill` shares the rest
/// between the tenants that took all of theirs, after the last row each took.
/// The fence sits in both takes' WHERE, next to `FOR UPDATE SKIP LOCKED`.
pub const CLAIM_DUE: &str = concat!(
    "WITH RECURSIVE ",
    db::fair_tenants!("webhook_deliveries", "status = 'pending'", "$6", "$7", "$3"),
    "first AS MATERIALIZED ( \
           SELECT pick.* FROM tenants t CROSS JOIN share s, LATERAL ( \
             SELECT x.*, row_number() OVER () AS turn FROM ( \
               SELECT d.id, d.tenant_id, d.next_attempt_at, d.attempts - d.resent_at_attempt AS made \
               FROM webhook_deliveries d \
               WHERE d.status = 'pending' AND d.tenant_id = t.tenant_id \
                 AND d.next_attempt_at <= now() \
                 AND (d.claimed_until IS NULL OR d.claimed_until <= now()) \
                 AND leader_fence($1, $2) \
               ORDER BY d.next_attempt_at, d.id \
               LIMIT s.quota \
               FOR UPDATE SKIP LOCKED) x) pick), \
         whole AS MATERIALIZED ( \
           SELECT f.tenant_id, f.next_attempt_at, f.id FROM first f, share s \
           WHERE f.turn = s.quota), \
         fill AS MATERIALIZED ( \
           SELECT more.* FROM whole w, LATERAL ( \
             SELECT d.id, d.tenant_id, d.next_attempt_at, d.attempts - d.resent_at_attempt AS made \
             FROM webhook_deliveries d \
             WHERE d.status = 'pending' AND d.tenant_id = w.tenant_id \
               AND d.next_attempt_at <= now() \
               AND (d.next_attempt_at, d.id) > (w.next_attempt_at, w.id) \
               AND (d.claimed_until IS NULL OR d.claimed_until <= now()) \
               AND leader_fence($1, $2) \
             ORDER BY d.next_attempt_at, d.id \
             LIMIT ($3 - (SELECT count(*) FROM first)) / greatest(1, (SELECT count(*) FROM whole)) \
             FOR UPDATE SKIP LOCKED) more), \
         due AS (SELECT id, made FROM first UNION ALL SELECT id, made FROM fill), \
         exhausted AS ( \
           UPDATE webhook_deliveries d \
           SET status = 'dead', last_error = 'attempts_exhausted', next_attempt_at = now() \
           FROM due WHERE d.id = due.id AND due.made >= $5 \
           RETURNING d.id), \
         claimed AS ( \
         UPDATE webhook_deliveries d \
         SET attempts = d.attempts + 1, \
             claimed_until = now() + make_interval(secs => $4), \
             last_attempt_at = now() \
         FROM due, webhook_events e, webhook_endpoints ep \
         WHERE d.id = due.id AND due.made < $5 \
           AND e.id = d.event_id AND ep.id = d.endpoint_id \
         RETURNING ",
    outbox::webhook_claimed_columns!("d", "e", "ep"),
    ") \
         SELECT claimed.*, share.tenants, share.last_tenant, \
                (SELECT count(*) FROM exhausted) AS exhausted \
         FROM share LEFT JOIN claimed ON true"
);

/// The fenced funnel: claim up to `limit` due pending deliveries in one
/// `UPDATE … RETURNING`. Each claimed row's `attempts` goes up by one (the
/// attempt number its outcome must prove) and its `claimed_until` is set
/// `lease` ahead, so if this process dies before writing an outcome the
/// delivery comes due again by itself. A row is due when `next_attempt_at`
/// and its `claimed_until` (if any) have passed. The claim writes no indexed
/// column, so it is a HOT update (migration 0011, docs/adr/0014).
///
/// Tenants are interleaved (docs/adr/0048): every tenant with due rows among
/// the next [`db::TENANTS_PER_CLAIM`] after `cursor` gets its share of the
/// batch, and `cursor` moves on. A statement that claims nothing is followed
/// by the next, until one claims or every tenant was visited ([`Walk`]).
///
/// The fence sits in the innermost WHERE, next to `FOR UPDATE SKIP LOCKED`: a
/// stale token claims nothing, and rows another claim holds are skipped.
///
/// The previous secret of an endpoint being rotated is returned only while its
/// `previous_secret_expires_at` is ahead of the claim's `now()`.
///
/// The ceiling: a due row that has already been claimed `max_attempts` times
/// (since it was last resent, `resent_at_attempt`) is not handed out again; the same statement marks it `dead` with `last_error =
/// 'attempts_exhausted'` (a worker that dies while attempting, e.g. out of
/// memory, never writes an outcome, and the claim lease would otherwise bring
/// the row back to every next leader forever, issue 12). Returns the rows
/// claimed; adds to `exhausted` how many the ceiling marked dead meanwhile.
/// Each statement of the walk commits on its own, so those an earlier
/// statement marked are added even when a later one errors (docs/adr/0141).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn claim_due(
    db: &Db,
    fence: &Fence,
    cursor: &TenantCursor,
    limit: usize,
    lease: Duration,
    max_attempts: u32,
    statement_timeout: Duration,
    exhausted: &mut u64,
) -> Result<Vec<ClaimedRow>, db::Error> {
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
                    .bind(i32::try_from(max_attempts).unwrap_or(i32::MAX))
                    .bind(after)
                    .bind(bound),
            )
            .await?;
        tx.commit().await?;
        if let Some(r) = rows.first() {
            let dead: i64 = r.try_get("exhausted")?;
            *exhausted += u64::try_from(dead).unwrap_or(0);
        }
        let mut claimed = cursor
            .claimed(rows, bound)?
            .iter()
            .map(ClaimedRow::from_row)
            .collect::<Result<Vec<_>, _>>()?;
        if !claimed.is_empty() {
            claimed.sort_by_key(|c| c.id);
            return Ok(claimed);
        }
    }
    Ok(Vec::new())
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
