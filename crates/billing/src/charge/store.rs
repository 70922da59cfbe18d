//! Auto-charge's SQL: the fenced claim of open automatic invoices never
//! attempted (a conditional UPDATE sets each one's lease) and their attempts.

use std::time::Duration;

use db::{Db, Row, sql};
use leader::Fence;

use crate::batch::ChargeClaim;
use crate::batch::{chargeable_invoice, insert_attempts};

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
    // Index-driven (docs/adr/0023), as the batch claim: the funnel walks
    // `invoices_charge_pending` and its update reaches each invoice by key;
    // its joins run as written (docs/adr/0065).
    let mut tx = db.begin_index_driven_as_written(statement_timeout).await?;
    let claims = claim_charges_in(&mut tx, fence, limit, claimed_by, lease).await?;
    tx.commit().await?;
    Ok(claims)
}

/// The batch's claims and their first attempts with one statement
/// ([`CLAIM_AND_START`]): only a claimed invoice whose attempt was written is
/// returned; the call may be made for it.
pub(crate) async fn claim_and_start(
    db: &Db,
    fence: &Fence,
    limit: usize,
    claimed_by: &str,
    (lease, instance): (Duration, &str),
    after: i64,
    statement_timeout: Duration,
) -> Result<Vec<crate::batch::Started>, db::Error> {
    // Index-driven (docs/adr/0023): the claim's update reaches each invoice
    // whose attempt was written by its key. As written (docs/adr/0065): each
    // invoice, then its subscription, then its customer, each by key; left
    // free, on tables never analyzed, the planner joined every customer of the
    // tenant to each invoice (31.8 s for one claim at 1,000 customers).
    let mut tx = db.begin_index_driven_as_written(statement_timeout).await?;
    let rows = tx
        .fetch_all(
            funnel(CLAIM_AND_START, fence, limit, claimed_by, lease)
                .bind(instance.to_owned())
                .bind(crate::charge::AUTO_CHARGE_ATTEMPT)
                .bind(after),
        )
        .await?;
    // Decoded before the commit: a row that cannot be read claims nothing.
    let started = rows
        .iter()
        .map(|r| {
            Ok(crate::batch::Started {
                claim: ChargeClaim::decode(r, claimed_by.to_owned())?,
                attempt_id: r.try_get("attempt_id")?,
                attempt_seq: crate::charge::AUTO_CHARGE_ATTEMPT,
                key: r.try_get("idempotency_key")?,
                first_send: true,
            })
        })
        .collect::<Result<Vec<_>, db::Error>>()?;
    tx.commit().await?;
    Ok(started)
}

/// A charge claim's statement (`text`) with the parameters of the funnel and
/// the lease bound: `$1`/`$2` the fence, `$3` the limit, `$4` the lease in
/// seconds, `$5` the holder.
fn funnel(
    text: &'static str,
    fence: &Fence,
    limit: usize,
    claimed_by: &str,
    lease: Duration,
) -> db::Stmt<'static> {
    sql(text)
        .bind(fence.role_name())
        .bind(fence.token())
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .bind(lease.as_secs_f64())
        .bind(claimed_by.to_owned())
}

/// The fenced funnel both charge claims lock their invoices with: open
/// automatic invoices never attempted, whose lease is free or expired, in id
/// order, `$3` at most, `$1`/`$2` the fence. `i.attempt_count = 0` is what
/// lets it walk `invoices_charge_pending`, the open automatic invoices never
/// attempted, so a claim reads the invoices it can take and not the ones
/// earlier batches claimed or dunning waits on (docs/adr/0050); the `NOT
/// EXISTS` on the attempts stays the rule itself. `$after` is the id the
/// walk starts after: the auto-charge tick passes the last id its previous
/// batch claimed, so invoices it cannot charge (a customer without a card, a
/// paused subscription) are read once per tick, not once per batch.
macro_rules! charge_funnel {
    ($after:literal) => {
        concat!(
            "SELECT i.id, i.tenant_id, i.created_at, i.amount, i.currency, \
                    c.provider_customer_id, c.payment_method_id \
             FROM invoices i \
             JOIN subscriptions s ON s.tenant_id = i.tenant_id AND s.id = i.subscription_id \
             JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id \
             WHERE ",
            chargeable_invoice!(),
            "\
               AND i.attempt_count = 0 \
               AND i.id > ",
            $after,
            " \
               AND NOT EXISTS (SELECT 1 FROM payment_attempts a WHERE a.invoice_id = i.id) \
               AND leader_fence($1, $2) \
             ORDER BY i.id \
             LIMIT $3 \
             FOR UPDATE OF i SKIP LOCKED "
        )
    };
}

/// Auto-charge's batch claim (docs/adr/0055); `pub` only for the plan test
/// (`tests/it/plans.rs`). One statement locks the funnel's invoices, writes
/// attempt `$7` of each (as `unknown`, key of instance `$6`, under the
/// (invoice, attempt) unique key), after invoice `$8`, and sets the lease (`$4` seconds, holder
/// `$5`) and raises `attempt_count` of exactly the invoices whose attempt was
/// written, in one new version of each: the invoice is claimed and counted
/// together, never one without the other. An invoice the funnel locked whose
/// attempt already existed is neither claimed nor returned.
pub const CLAIM_AND_START: &str = concat!(
    "WITH picked AS ( ",
    charge_funnel!("$8"),
    "), started AS ( ",
    insert_attempts!(
        "$6",
        "p",
        "$7::int4",
        "p.provider_customer_id",
        "p.payment_method_id"
    ),
    "FROM picked p \
       ON CONFLICT DO NOTHING \
       RETURNING id, invoice_id, idempotency_key \
     ), claimed AS ( \
       UPDATE invoices i \
       SET auto_charge_claimed_until = now() + make_interval(secs => $4), \
           auto_charge_claimed_by = $5, \
           attempt_count = i.attempt_count + 1 \
       FROM started WHERE i.id = started.invoice_id \
       RETURNING i.id, i.tenant_id, i.subscription_id, i.amount, i.currency, i.number, \
                 started.id AS attempt_id, started.idempotency_key \
     ) \
     SELECT k.id, k.tenant_id, k.subscription_id, k.amount, k.currency, k.number, \
            k.attempt_id, k.idempotency_key, \
            c.email, c.provider_customer_id, c.payment_method_id, \
            (SELECT ts.email_from FROM tenant_settings ts \
             WHERE ts.tenant_id = k.tenant_id) AS tenant_from \
     FROM claimed k \
     JOIN subscriptions s ON s.tenant_id = k.tenant_id AND s.id = k.subscription_id \
     JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id \
     ORDER BY k.id"
);

/// The single charge claim ([`claim_charges`], [`crate::Biller::charge`]'s
/// first half): the funnel's invoices leased, their attempts written by a
/// later statement (`batch::START_ATTEMPTS`); `pub` only for the plan test
/// (`tests/it/plans.rs`).
pub const CLAIM_CHARGES: &str = concat!(
    "WITH picked AS ( ",
    charge_funnel!("0"),
    "), claimed AS ( \
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
    let rows = tx
        .fetch_all(funnel(CLAIM_CHARGES, fence, limit, claimed_by, lease))
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
