//! A dunning retry charge: one more attempt on an open automatic invoice whose
//! earlier attempts were declined, under the same guards as auto-charge.
//!
//! ```text
//!  claim the invoice        open, automatic, claim lease free or expired,
//!                           no attempt of unknown outcome, card saved, not paused
//!                           → lease = now() + charge_lease, claimed_by = the caller's
//!  INSERT attempt N         N = the invoice's last attempt + 1, key = (invoice, N),
//!                           only while the claim holds the invoice
//!  POST /v1/payment_intents with that Idempotency-Key
//!    succeeded ─▶ invoice paid (claim still ours) + invoice.paid, payment.succeeded, receipt
//!    declined  ─▶ attempt declined(code), claim released, payment.failed + email
//!    unknown   ─▶ attempt stays unknown for the reconciler; no claim takes the
//!                 invoice again until the reconciler settles it
//! ```
//!
//! The claim is not fenced: the dunning role's funnel and its run
//! compare-and-set decide who retries; this lease only stops two workers
//! charging one invoice at once (ADR-114's effect table).

use db::{Row, sql};

use crate::provider::{self, ChargeOutcome, PaymentRequest};
use crate::store::{self, ChargeClaim, Settled};
use crate::{Biller, Error};

/// What one retry charge came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Retried {
    /// Charged: the invoice is paid and announced.
    Paid {
        attempt_seq: i32,
        payment_intent: String,
    },
    /// A definite decline, recorded with its code and announced.
    Declined { attempt_seq: i32, code: String },
    /// No answer to rely on (timeout, 5xx): the attempt is left unknown for
    /// the reconciler, which settles it by its key.
    Unknown { attempt_seq: i32, reason: String },
    /// Nothing was charged.
    NotCharged(NotCharged),
}

/// Why a retry charged nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotCharged {
    /// The invoice is no longer open (`paid`, `void`, `uncollectible`).
    InvoiceClosed { status: String },
    /// The invoice is open but not chargeable now: another claim holds it, an
    /// attempt's outcome is still unknown, collection is paused, no saved card.
    Held,
    /// The claim was lost before the attempt was written.
    ClaimLost,
    /// No provider is configured.
    NoProvider,
}

impl Biller {
    /// Retry the charge of `invoice_id` as the next attempt, holding the
    /// invoice's claim lease as `claimed_by` (an identity no other claim shares).
    ///
    /// # Errors
    /// A database error or a refused event or email. An attempt written
    /// before the error stays unknown for the reconciler.
    ///
    /// # Cancel safety
    /// Dropped after the attempt row is written, the attempt stays unknown and
    /// the reconciler settles it by its key; no later retry charges the
    /// invoice before that.
    pub async fn retry_charge(&self, invoice_id: i64, claimed_by: &str) -> Result<Retried, Error> {
        let Some(provider) = &self.inner.provider else {
            return Ok(Retried::NotCharged(NotCharged::NoProvider));
        };
        let c = &self.inner.config;
        let db = &self.inner.db;
        let timeout = c.statement_timeout;
        let (claim, seq) = match claim_retry(self, invoice_id, claimed_by).await? {
            Ok(claimed) => claimed,
            Err(not) => return Ok(Retried::NotCharged(not)),
        };
        let key = provider::idempotency_key(invoice_id, seq);
        let Some(attempt) = store::start_attempt(db, &claim, seq, &key, timeout).await? else {
            return Ok(Retried::NotCharged(NotCharged::ClaimLost));
        };
        let req = PaymentRequest {
            invoice_id,
            amount: claim.amount,
            currency: claim.currency.clone(),
            customer: claim.provider_customer.clone(),
            payment_method: claim.payment_method.clone(),
        };
        let from = &c.email_from;
        Ok(match provider.create_payment_intent(&req, seq).await {
            ChargeOutcome::Succeeded { payment_intent } => {
                match store::settle_paid(db, &claim, attempt, seq, &payment_intent, from, timeout)
                    .await?
                {
                    Settled::Written => Retried::Paid {
                        attempt_seq: seq,
                        payment_intent,
                    },
                    // Charged, but the claim moved: the reconciler settles it.
                    Settled::Lost => Retried::Unknown {
                        attempt_seq: seq,
                        reason: "charged, but the claim was lost before settling".to_owned(),
                    },
                }
            }
            ChargeOutcome::Declined {
                code,
                payment_intent,
            } => {
                let pi = payment_intent.as_deref();
                match store::settle_declined(db, &claim, attempt, seq, (&code, pi), from, timeout)
                    .await?
                {
                    Settled::Written => Retried::Declined {
                        attempt_seq: seq,
                        code,
                    },
                    Settled::Lost => Retried::Unknown {
                        attempt_seq: seq,
                        reason: "declined, but the claim was lost before settling".to_owned(),
                    },
                }
            }
            ChargeOutcome::Unknown { reason } => {
                store::note_unknown(db, attempt, &reason, timeout).await?;
                Retried::Unknown {
                    attempt_seq: seq,
                    reason,
                }
            }
        })
    }
}

/// Take the claim lease of one invoice for a retry, with the attempt
/// sequence the retry will use; or why it cannot be taken.
async fn claim_retry(
    biller: &Biller,
    invoice_id: i64,
    claimed_by: &str,
) -> Result<Result<(ChargeClaim, i32), NotCharged>, db::Error> {
    let c = &biller.inner.config;
    let mut tx = biller
        .inner
        .db
        .begin_with_timeout(c.statement_timeout)
        .await?;
    let row = tx
        .fetch_optional(
            sql(
                "WITH picked AS ( \
                   SELECT i.id FROM invoices i \
                   JOIN subscriptions s ON s.tenant_id = i.tenant_id AND s.id = i.subscription_id \
                   JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id \
                   WHERE i.id = $1 AND i.status = 'open' AND i.collection_method = 'automatic' \
                     AND (i.auto_charge_claimed_until IS NULL OR i.auto_charge_claimed_until <= now()) \
                     AND s.pause_collection_behavior IS NULL \
                     AND c.payment_method_id IS NOT NULL \
                     AND NOT EXISTS (SELECT 1 FROM payment_attempts a \
                                     WHERE a.invoice_id = i.id AND a.provider_status = 'unknown') \
                   FOR UPDATE OF i SKIP LOCKED \
                 ), claimed AS ( \
                   UPDATE invoices i \
                   SET auto_charge_claimed_until = now() + make_interval(secs => $2), \
                       auto_charge_claimed_by = $3 \
                   FROM picked WHERE i.id = picked.id \
                   RETURNING i.id, i.tenant_id, i.subscription_id, i.amount, i.currency \
                 ) \
                 SELECT k.id, k.tenant_id, k.subscription_id, k.amount, k.currency, \
                        c.email, c.provider_customer_id, c.payment_method_id, \
                        (SELECT COALESCE(max(a.attempt_seq), 0) + 1 FROM payment_attempts a \
                         WHERE a.invoice_id = k.id) AS next_seq \
                 FROM claimed k \
                 JOIN subscriptions s ON s.tenant_id = k.tenant_id AND s.id = k.subscription_id \
                 JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id",
            )
            .bind(invoice_id)
            .bind(c.charge_lease.as_secs_f64())
            .bind(claimed_by.to_owned()),
        )
        .await?;
    let Some(r) = row else {
        let status: Option<String> = tx
            .fetch_optional(sql("SELECT status FROM invoices WHERE id = $1").bind(invoice_id))
            .await?
            .map(|r| r.try_get("status"))
            .transpose()?;
        tx.commit().await?;
        return Ok(Err(match status {
            Some(s) if s != "open" => NotCharged::InvoiceClosed { status: s },
            _ => NotCharged::Held,
        }));
    };
    tx.commit().await?;
    let claim = ChargeClaim {
        invoice_id: r.try_get("id")?,
        tenant_id: r.try_get("tenant_id")?,
        subscription_id: r.try_get("subscription_id")?,
        amount: r.try_get("amount")?,
        currency: r.try_get("currency")?,
        email: r.try_get("email")?,
        provider_customer: r.try_get("provider_customer_id")?,
        payment_method: r.try_get("payment_method_id")?,
        claimed_by: claimed_by.to_owned(),
    };
    Ok(Ok((claim, r.try_get("next_seq")?)))
}
