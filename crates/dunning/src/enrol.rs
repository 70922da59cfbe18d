//! Enrolment, the tick's first step: a run for each open automatic invoice
//! whose latest payment attempt billing recorded as declined (the hand-off,
//! docs/adr/0013), or an operator settled as not charged (docs/adr/0074),
//! with its tenant's default policy and `dunning.started`; fenced, one
//! transaction.

use std::time::Duration;

use chrono::{DateTime, Utc};
use db::{Db, Row, sql};
use leader::Fence;

use crate::Error;
use crate::ctx::Ctx;
use crate::policy;

/// Enrolment, fenced: a run for each open automatic invoice whose latest
/// attempt was declined (or settled by an operator as not charged: nothing
/// else would take the invoice again, docs/adr/0074) and that has none yet,
/// with its tenant's default
/// policy (created as the built-in default if the tenant has none).
///
/// # Errors
/// A database error or a refused event; nothing was enrolled.
pub(crate) async fn enrol(ctx: &Ctx, fence: &Fence) -> Result<usize, Error> {
    let c = &ctx.config;
    let n = insert_runs(&ctx.db, fence, c.enrol_limit, c.statement_timeout).await?;
    if n > 0 {
        ctx.telemetry
            .counter("hardcount_dunning_enrolled_total", &[])
            .increment(n as u64);
    }
    Ok(n)
}

/// Enrol, fenced: create the built-in default policy for tenants without one,
/// then a run for up to `limit` enrollable invoices with their tenant's
/// default policy (one per invoice, `ON CONFLICT DO NOTHING`), and
/// `dunning.started` for each run created (one statement); one transaction. A tenant whose
/// default policy's first offset is out of range (written before migration
/// 0021's checks) enrols nothing: its offset would fail the statement for
/// every tenant.
///
/// Both statements read only invoices attempted at least once:
/// `attempt_count` is raised by every attempt's insert (migration 0038), so an
/// invoice whose latest attempt was declined has one, and the many invoices
/// of a tick waiting for their first charge are passed over without their
/// latest attempt looked up (docs/adr/0063).
async fn insert_runs(
    db: &Db,
    fence: &Fence,
    limit: usize,
    statement_timeout: Duration,
) -> Result<usize, Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    tx.execute(
        sql("INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action, \
                                           warn_after, final_notice, is_default) \
             SELECT DISTINCT i.tenant_id, 'Default', $3, $4, $5, true, true \
             FROM invoices i \
             JOIN LATERAL (SELECT a.provider_status, a.reviewed_at FROM payment_attempts a \
                           WHERE a.invoice_id = i.id ORDER BY a.attempt_seq DESC LIMIT 1) l ON true \
             WHERE i.status = 'open' AND i.collection_method = 'automatic' \
               AND i.attempt_count > 0 \
               AND (l.provider_status = 'declined' \
                    OR (l.provider_status = 'failed' AND l.reviewed_at IS NOT NULL)) \
               AND NOT EXISTS (SELECT 1 FROM dunning_runs r WHERE r.invoice_id = i.id) \
               AND NOT EXISTS (SELECT 1 FROM dunning_policies p \
                               WHERE p.tenant_id = i.tenant_id AND p.is_default) \
               AND leader_fence($1, $2) \
             ON CONFLICT (tenant_id) WHERE is_default DO NOTHING")
        .bind(fence.role_name())
        .bind(fence.token())
        .bind(policy::DEFAULT_OFFSETS_SECS.to_vec())
        .bind(policy::DEFAULT_FINAL_ACTION.as_str())
        .bind(policy::DEFAULT_WARN_AFTER.to_vec()),
    )
    .await?;
    let rows = tx
        .fetch_all(
            sql("INSERT INTO dunning_runs (tenant_id, invoice_id, policy_id, first_declined_at, \
                                           next_attempt_at) \
                 SELECT i.tenant_id, i.id, p.id, l.declined_at, \
                        l.declined_at + make_interval(secs => p.retry_offsets_secs[1]::float8) \
                 FROM invoices i \
                 JOIN LATERAL (SELECT a.provider_status, a.reviewed_at, \
                                      COALESCE(a.reviewed_at, a.resolved_at, a.created_at) \
                                        AS declined_at \
                               FROM payment_attempts a \
                               WHERE a.invoice_id = i.id ORDER BY a.attempt_seq DESC LIMIT 1) l ON true \
                 JOIN dunning_policies p ON p.tenant_id = i.tenant_id AND p.is_default \
                 WHERE i.status = 'open' AND i.collection_method = 'automatic' \
                   AND i.attempt_count > 0 \
                   AND (l.provider_status = 'declined' \
                        OR (l.provider_status = 'failed' AND l.reviewed_at IS NOT NULL)) \
                   AND array_ndims(p.retry_offsets_secs) = 1 \
                   AND p.retry_offsets_secs[1] BETWEEN 1 AND 31622400 \
                   AND NOT EXISTS (SELECT 1 FROM dunning_runs r WHERE r.invoice_id = i.id) \
                   AND leader_fence($1, $2) \
                 ORDER BY i.id \
                 LIMIT $3 \
                 ON CONFLICT (invoice_id) DO NOTHING \
                 RETURNING id, tenant_id, invoice_id, next_attempt_at")
            .bind(fence.role_name())
            .bind(fence.token())
            .bind(limit),
        )
        .await?;
    let mut events = Vec::with_capacity(rows.len());
    for r in &rows {
        let tenant: String = r.try_get("tenant_id").map_err(db::Error::from)?;
        let next: DateTime<Utc> = r.try_get("next_attempt_at").map_err(db::Error::from)?;
        let payload = serde_json::json!({
            "object": "dunning_run",
            "id": r.try_get::<i64, _>("id").map_err(db::Error::from)?,
            "invoice": r.try_get::<i64, _>("invoice_id").map_err(db::Error::from)?,
            "status": "active",
            "attempt_count": 0,
            "next_attempt_at": next.to_rfc3339(),
        });
        events.push((tenant, payload.to_string()));
    }
    // One statement for the batch's events, not a round trip per run.
    outbox::webhook::enqueue_many_of(&mut tx, "dunning.started", &events).await?;
    tx.commit().await?;
    Ok(rows.len())
}
