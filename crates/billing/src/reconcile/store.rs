//! The payment reconciler's SQL: the fenced claim of open attempts, the
//! stamps of what was checked, and the stale-hold sweep.

use std::time::Duration;

use db::{Db, Row, sql};
use leader::Fence;

use crate::batch::{ChargeClaim, chargeable_invoice};

/// An attempt still open (unknown or processing), with the claim the
/// reconciler took on its invoice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UnknownAttempt {
    pub attempt_id: i64,
    pub attempt_seq: i32,
    pub idempotency_key: String,
    /// The PaymentIntent an earlier answer named: read by id.
    pub payment_intent: Option<String>,
    /// The key is certainly alive at the provider (first sent within the
    /// resend window, on the database clock), or no request of it executed.
    pub resend_ok: bool,
    /// Unix seconds from which the customer's intents are listed.
    pub listed_since: i64,
    /// No request of it had been sent before this claim stamped
    /// `first_sent_at` (docs/adr/0081): if this look sends nothing either,
    /// the stamp is taken back, so the attempt stays "never sent".
    pub never_sent: bool,
    /// Amount, currency, customer and card as the attempt was sent.
    pub claim: ChargeClaim,
}

/// The statement of [`claim_unknown`]; `pub` only for the plan test
/// (`tests/it/plans.rs`).
pub const CLAIM_UNKNOWN: &str = concat!(
    "WITH picked AS ( \
      SELECT a.id AS attempt_id, i.id, \
             (a.first_sent_at IS NULL \
              OR a.first_sent_at > now() - make_interval(secs => $7)) AS resend_ok, \
             c.provider_customer_id AS customer_now, c.payment_method_id AS method_now \
      FROM payment_attempts a \
      JOIN invoices i ON i.id = a.invoice_id \
      JOIN subscriptions s ON s.id = i.subscription_id \
      JOIN customers c ON c.id = s.customer_id \
      WHERE a.provider_status IN ('unknown', 'processing') AND i.status = 'open' \
        AND i.review_since IS NULL \
        AND (a.next_check_at IS NULL OR a.next_check_at <= now()) \
        AND (i.auto_charge_claimed_until IS NULL OR i.auto_charge_claimed_until <= now()) \
        AND COALESCE(a.payment_method_id, c.payment_method_id) IS NOT NULL \
        AND (a.first_sent_at IS NOT NULL OR ( ",
    chargeable_invoice!(),
    "   AND (a.attempt_seq = 1 OR a.tenant_id NOT IN (",
    payments::window_closed_tenants!(),
    ")))) \
        AND a.id <> ALL ($6) \
        AND NOT EXISTS (SELECT 1 FROM payment_attempts e \
                        WHERE e.invoice_id = a.invoice_id \
                          AND e.provider_status IN ('unknown', 'processing') \
                          AND e.attempt_seq < a.attempt_seq) \
        AND leader_fence($1, $2) \
      ORDER BY a.last_checked_at NULLS FIRST, a.id \
      LIMIT $3 \
      FOR UPDATE OF i SKIP LOCKED \
    ), claimed AS ( \
      UPDATE invoices i \
      SET auto_charge_claimed_until = now() + make_interval(secs => $4), \
          auto_charge_claimed_by = $5 \
      FROM (SELECT DISTINCT id FROM picked) p WHERE i.id = p.id \
      RETURNING i.id, i.tenant_id, i.subscription_id, i.number \
    ), sent AS ( \
      UPDATE payment_attempts a SET first_sent_at = now(), \
             provider_customer_id = p.customer_now, payment_method_id = p.method_now \
      FROM picked p WHERE a.id = p.attempt_id AND a.first_sent_at IS NULL \
    ) \
    SELECT a.id AS attempt_id, a.attempt_seq, a.idempotency_key, a.amount, a.currency, \
           a.provider_payment_intent, p.resend_ok, a.first_sent_at IS NULL AS never_sent, \
           (extract(epoch FROM a.created_at))::bigint - 300 AS listed_since, \
           k.id, k.tenant_id, k.subscription_id, k.number, c.email, \
           (SELECT ts.email_from FROM tenant_settings ts \
            WHERE ts.tenant_id = k.tenant_id) AS tenant_from, \
           CASE WHEN a.first_sent_at IS NULL THEN p.customer_now \
                ELSE COALESCE(a.provider_customer_id, c.provider_customer_id) END \
             AS provider_customer_id, \
           CASE WHEN a.first_sent_at IS NULL THEN p.method_now \
                ELSE COALESCE(a.payment_method_id, c.payment_method_id) END \
             AS payment_method_id \
    FROM claimed k \
    JOIN picked p ON p.id = k.id \
    JOIN payment_attempts a ON a.id = p.attempt_id \
    JOIN subscriptions s ON s.id = k.subscription_id \
    JOIN customers c ON c.id = s.customer_id \
    ORDER BY a.last_checked_at NULLS FIRST, a.id"
);

/// The fenced reconciler funnel: up to `limit` open attempts (unknown or
/// processing) of open invoices not flagged for review, whose auto-charge
/// claim is free or expired (so no call of theirs can still be in flight) and
/// whose next look is due, least recently checked first, only the earliest
/// open attempt of an invoice; each invoice taken under a fresh claim lease by
/// the same conditional UPDATE auto-charge uses. An attempt whose key no
/// request executed (`first_sent_at` NULL: recorded, then never sent because
/// the budget ran out, the tick was cancelled or the key was refused) is
/// listed only while its invoice is still chargeable by auto-charge's own
/// rule (`chargeable_invoice!`: open, automatic, collection not paused, a
/// saved card; whatever the subscription's status, so a cancelled
/// subscription's final invoice too, docs/adr/0071) and not flagged, and is
/// stamped as sent now, since the reconciler may send it, with the customer's
/// payment method as it is now, which the attempt records: the customer may
/// have replaced the card it was recorded with (docs/adr/0113). A dunning
/// retry's (any attempt after auto-charge's first) waits, besides, for its
/// tenant's business window, as dunning's funnel does (docs/adr/0147): the
/// key never reached the provider, so nothing expires while it waits.
///
/// Index-driven (docs/adr/0062): the open attempts in
/// `payment_attempts_open` order, so the limit stops the walk, each one's
/// rows reached by key; planned freely, on tables never analyzed, it read
/// every open attempt through a bitmap and sorted them, for each batch.
/// The joins are taken as written (`begin_index_driven_as_written`), each by
/// the primary key of the row before it: the invoice, subscription and
/// customer by id alone, since their composite foreign keys already hold
/// them to the attempt's tenant. With the joins planned freely and the
/// tenant in each, the planner at times drove the walk from a scan of every
/// open invoice and reached each subscription by `tenant_id` alone
/// (docs/adr/0154), as dunning's listing once did (docs/adr/0056).
pub(crate) async fn claim_unknown(
    db: &Db,
    fence: &Fence,
    limit: usize,
    except: &[i64],
    claimed_by: &str,
    (lease, resend_window): (Duration, Duration),
    statement_timeout: Duration,
) -> Result<Vec<UnknownAttempt>, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_index_driven_as_written(statement_timeout).await?;
    let rows = tx
        .fetch_all(
            sql(CLAIM_UNKNOWN)
                .bind(fence.role_name())
                .bind(fence.token())
                .bind(limit)
                .bind(lease.as_secs_f64())
                .bind(claimed_by.to_owned())
                .bind(except.to_vec())
                .bind(resend_window.as_secs_f64()),
        )
        .await?;
    tx.commit().await?;
    rows.iter()
        .map(|r| {
            Ok(UnknownAttempt {
                attempt_id: r.try_get("attempt_id")?,
                attempt_seq: r.try_get("attempt_seq")?,
                idempotency_key: r.try_get("idempotency_key")?,
                payment_intent: r.try_get("provider_payment_intent")?,
                resend_ok: r.try_get("resend_ok")?,
                listed_since: r.try_get("listed_since")?,
                never_sent: r.try_get("never_sent")?,
                claim: ChargeClaim::decode(r, claimed_by.to_owned())?,
            })
        })
        .collect()
}

/// After the unknown-outcome checks of a batch: stamp every checked attempt
/// (settled, still unknown, or whose check panicked) so it goes to the back
/// of the sweep, and give back the claims the checks still hold.
pub(crate) async fn stamp_checked(
    db: &Db,
    attempt_ids: &[i64],
    invoice_ids: &[i64],
    claimed_by: &str,
    statement_timeout: Duration,
) -> Result<(), db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    tx.execute(
        sql("UPDATE payment_attempts SET last_checked_at = now() WHERE id = ANY($1)")
            .bind(attempt_ids.to_vec()),
    )
    .await?;
    tx.execute(
        sql(
            "UPDATE invoices SET auto_charge_claimed_until = NULL, auto_charge_claimed_by = NULL \
             WHERE id = ANY($1) AND auto_charge_claimed_by = $2",
        )
        .bind(invoice_ids.to_vec())
        .bind(claimed_by.to_owned()),
    )
    .await?;
    tx.commit().await
}

/// The statement of [`operator_settled`]; `pub` only for the plan test
/// (`tests/it/plans/other_batches.rs`). Through
/// `payment_attempts_one_paid_intent`, the unique index of succeeded
/// attempts' intents (migration 0052): at most one attempt read per intent.
/// An operator's settle writes `succeeded` or `failed`; a failed one gave no
/// intent to anyone.
pub const OPERATOR_SETTLED: &str = "SELECT provider_payment_intent, id, invoice_id, provider_customer_id \
     FROM payment_attempts \
     WHERE reviewed_at IS NOT NULL AND provider_payment_intent IS NOT NULL \
       AND provider_payment_intent = ANY($1) AND provider_status = 'succeeded'";

/// An attempt an operator settled paid with an intent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OperatorSettled {
    pub intent: String,
    pub attempt: i64,
    pub invoice: i64,
    /// The `cus_…` it was sent for, when it was sent.
    pub customer: Option<String>,
}

/// Of `intents`, those an operator's settle already pays with an attempt.
/// Billing's own answers give one intent per key; only a person can have
/// named one for another invoice (docs/adr/0120).
pub(crate) async fn operator_settled(
    db: &Db,
    intents: &[String],
    statement_timeout: Duration,
) -> Result<Vec<OperatorSettled>, db::Error> {
    if intents.is_empty() {
        return Ok(Vec::new());
    }
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let rows = tx
        .fetch_all(sql(OPERATOR_SETTLED).bind(intents.to_vec()))
        .await?;
    tx.commit().await?;
    rows.iter()
        .map(|r| {
            Ok(OperatorSettled {
                intent: r.try_get(0)?,
                attempt: r.try_get(1)?,
                invoice: r.try_get(2)?,
                customer: r.try_get(3)?,
            })
        })
        .collect()
}

/// The statement of [`free_stale_holds`]; `pub` only for the plan test
/// (`tests/it/plans.rs`).
pub const FREE_STALE_HOLDS: &str = "UPDATE invoices SET auto_charge_claimed_until = NULL, auto_charge_claimed_by = NULL \
     WHERE id IN (SELECT id FROM invoices \
                  WHERE auto_charge_claimed_until <= now() AND leader_fence($1, $2) \
                  ORDER BY auto_charge_claimed_until, id LIMIT $3 \
                  FOR UPDATE SKIP LOCKED) \
       AND auto_charge_claimed_until <= now()";

/// The stale-hold sweep, fenced: free up to `limit` auto-charge claims past
/// their expiry, the longest expired first. One statement; a freed row
/// leaves the sweep, so no row can hold up the ones behind it. Index-driven
/// (docs/adr/0060): the expired claims through `invoices_auto_charge_claims`,
/// each freed by its key; planned freely, on a table never analyzed, it
/// hashed the batch and read every invoice for each batch.
pub(crate) async fn free_stale_holds(
    db: &Db,
    fence: &Fence,
    limit: usize,
    statement_timeout: Duration,
) -> Result<u64, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let n = tx
        .execute(
            sql(FREE_STALE_HOLDS)
                .bind(fence.role_name())
                .bind(fence.token())
                .bind(limit),
        )
        .await?;
    tx.commit().await?;
    Ok(n)
}
