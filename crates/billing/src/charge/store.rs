//! Auto-charge's SQL: the fenced claim of open automatic invoices never
//! attempted (a conditional UPDATE sets each one's lease) and their attempts.

use std::time::Duration;

use db::{Db, sql};
use leader::Fence;

use crate::batch::ChargeClaim;
use crate::batch::chargeable_invoice;

/// The fenced auto-charge funnel: up to `limit` open automatic invoices that
/// have never been attempted, whose customer has a saved card and whose
/// subscription's collection is not paused, and whose claim lease is free or
/// expired; each taken by the conditional UPDATE that sets the lease.
///
/// The lease predicate sits in the locking subquery: a row a concurrent claim
/// just took is re-checked after its lock and left alone.
pub(crate) async fn claim_charges(
    db: &Db,
    fence: &Fence,
    limit: usize,
    claimed_by: &str,
    lease: Duration,
    statement_timeout: Duration,
) -> Result<Vec<ChargeClaim>, db::Error> {
    // Index-driven (docs/adr/0023): the attempts' insert reaches each claimed
    // invoice by its key (`batch::START_ATTEMPTS`).
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let claims = claim_charges_in(&mut tx, fence, limit, claimed_by, lease).await?;
    tx.commit().await?;
    Ok(claims)
}

/// [`claim_charges`] and, in the same transaction, attempt 1 of every
/// invoice claimed (`batch::start_attempts_in`): the batch's claims and
/// attempts with two statements. Only a claimed invoice whose attempt was
/// written is returned; the call may be made for it.
pub(crate) async fn claim_and_start(
    db: &Db,
    fence: &Fence,
    limit: usize,
    claimed_by: &str,
    (lease, instance): (Duration, &str),
    statement_timeout: Duration,
) -> Result<Vec<crate::batch::Started>, db::Error> {
    // Index-driven (docs/adr/0023): the attempts' insert reaches each claimed
    // invoice by its key (`batch::START_ATTEMPTS`).
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let claims = claim_charges_in(&mut tx, fence, limit, claimed_by, lease).await?;
    let attempts: Vec<(ChargeClaim, i32)> = claims
        .into_iter()
        .map(|c| (c, crate::charge::AUTO_CHARGE_ATTEMPT))
        .collect();
    let started = crate::batch::start_attempts_in(&mut tx, &attempts, instance).await?;
    tx.commit().await?;
    Ok(started)
}

/// The charge claim's statement; `pub` only for the plan test
/// (`tests/it/plans.rs`). `i.attempt_count = 0` is what lets it walk
/// `invoices_charge_pending`, the open automatic invoices never attempted,
/// so a claim reads the invoices it can take and not the ones earlier
/// batches claimed or dunning waits on (docs/adr/0050); the `NOT EXISTS` on
/// the attempts stays the rule itself.
pub const CLAIM_CHARGES: &str = concat!(
    "WITH picked AS ( \
            SELECT i.id FROM invoices i \
            JOIN subscriptions s ON s.tenant_id = i.tenant_id AND s.id = i.subscription_id \
            JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id \
            WHERE ",
    chargeable_invoice!(),
    "\
              AND i.attempt_count = 0 \
              AND NOT EXISTS (SELECT 1 FROM payment_attempts a WHERE a.invoice_id = i.id) \
              AND leader_fence($1, $2) \
            ORDER BY i.id \
            LIMIT $3 \
            FOR UPDATE OF i SKIP LOCKED \
          ), claimed AS ( \
            UPDATE invoices i \
            SET auto_charge_claimed_until = now() + make_interval(secs => $4), \
                auto_charge_claimed_by = $5 \
            FROM picked WHERE i.id = picked.id \
            RETURNING i.id, i.tenant_id, i.subscription_id, i.amount, i.currency, i.number \
          ) \
          SELECT k.id, k.tenant_id, k.subscription_id, k.amount, k.currency, k.number, \
                 c.email, c.provider_customer_id, c.payment_method_id, \
                 (SELECT ts.email_from FROM tenant_settings ts \
                  WHERE ts.tenant_id = k.tenant_id) AS tenant_from \
          FROM claimed k \
          JOIN subscriptions s ON s.tenant_id = k.tenant_id AND s.id = k.subscription_id \
          JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id \
          ORDER BY k.id"
);

async fn claim_charges_in(
    tx: &mut db::Tx,
    fence: &Fence,
    limit: usize,
    claimed_by: &str,
    lease: Duration,
) -> Result<Vec<ChargeClaim>, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let rows = tx
        .fetch_all(
            sql(CLAIM_CHARGES)
                .bind(fence.role_name())
                .bind(fence.token())
                .bind(limit)
                .bind(lease.as_secs_f64())
                .bind(claimed_by.to_owned()),
        )
        .await?;
    rows.iter()
        .map(|r| ChargeClaim::decode(r, claimed_by.to_owned()))
        .collect()
}

/// Record attempt `attempt_seq` (as `unknown`, before the call) if the claim
/// still holds the invoice, under the key of `instance`. `None`: the claim
/// was lost or the attempt exists.
pub(crate) async fn start_attempt(
    db: &Db,
    claim: &ChargeClaim,
    attempt_seq: i32,
    instance: &str,
    statement_timeout: Duration,
) -> Result<Option<crate::batch::Started>, db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let started =
        crate::batch::start_attempts_in(&mut tx, &[(claim.clone(), attempt_seq)], instance).await?;
    tx.commit().await?;
    Ok(started.into_iter().next())
}
