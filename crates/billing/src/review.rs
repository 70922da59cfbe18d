//! The operator's side of the needs-review state (docs/adr/0024): list the
//! payment attempts waiting for a person, and settle one after checking the
//! provider's dashboard. Both run as `hardcount_operator`: the list reads the
//! `payment_attempts_needing_review` view, the settle calls the definer
//! function `billing_settle_attempt` (migration 0019), which records who and
//! why and, for a paid settle, announces `invoice.paid` and `payment.succeeded`
//! in the same transaction.

use std::time::Duration;

use db::{Db, Row, sql};
use serde::Serialize;

/// One attempt waiting for an operator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AttemptForReview {
    pub attempt_id: i64,
    pub tenant_id: String,
    pub invoice_id: i64,
    pub attempt_seq: i32,
    /// `needs_review`, or `failed` (refused by the provider as invalid).
    pub status: String,
    pub amount: i64,
    pub currency: String,
    pub customer: Option<String>,
    pub idempotency_key: String,
    pub payment_intent: Option<String>,
    pub reason: Option<String>,
    pub raw_answer: Option<String>,
}

/// How an operator settles an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// The provider charged it: the invoice is paid.
    Paid,
    /// Nothing was charged for this invoice (or its charge counted for
    /// another invoice, as the review's reason said, docs/adr/0120): the
    /// invoice is chargeable again (dunning takes it).
    Failed,
}

const TIMEOUT: Duration = Duration::from_secs(10);

/// Every attempt waiting for review, oldest first.
///
/// # Errors
/// A database error (the role may lack the view's grant: it is the operator's).
pub async fn needing_review(db: &Db) -> Result<Vec<AttemptForReview>, db::Error> {
    let mut tx = db.begin_with_timeout(TIMEOUT).await?;
    let rows = tx
        .fetch_all(sql(
            "SELECT attempt_id, tenant_id, invoice_id, attempt_seq, provider_status, amount, \
                    currency, provider_customer_id, idempotency_key, provider_payment_intent, \
                    COALESCE(review_reason, last_error) AS reason, raw_answer \
             FROM payment_attempts_needing_review ORDER BY attempt_id",
        ))
        .await?;
    tx.commit().await?;
    rows.iter()
        .map(|r| {
            Ok(AttemptForReview {
                attempt_id: r.try_get("attempt_id")?,
                tenant_id: r.try_get("tenant_id")?,
                invoice_id: r.try_get("invoice_id")?,
                attempt_seq: r.try_get("attempt_seq")?,
                status: r.try_get("provider_status")?,
                amount: r.try_get("amount")?,
                currency: r.try_get("currency")?,
                customer: r.try_get("provider_customer_id")?,
                idempotency_key: r.try_get("idempotency_key")?,
                payment_intent: r.try_get("provider_payment_intent")?,
                reason: r.try_get("reason")?,
                raw_answer: r.try_get("raw_answer")?,
            })
        })
        .collect()
}

/// Settle attempt `attempt` as `how`, recording `by` and `note` (and the
/// login). `payment_intent`: the provider's `pi_…` when the operator found it.
///
/// # Errors
/// The function's refusal, by name: the attempt is unknown or not waiting
/// for review, a paid settle of an attempt the provider refused or of an
/// invoice no longer open, a missing `by` or `note`.
pub async fn settle(
    db: &Db,
    attempt: i64,
    how: Settlement,
    payment_intent: Option<&str>,
    by: &str,
    note: &str,
) -> Result<String, db::Error> {
    let mut tx = db.begin_with_timeout(TIMEOUT).await?;
    let row = tx
        .fetch_one(
            sql("SELECT billing_settle_attempt($1, $2, $3, $4, $5) AS settled")
                .bind(attempt)
                .bind(how == Settlement::Paid)
                .bind(payment_intent.map(str::to_owned))
                .bind(by.to_owned())
                .bind(note.to_owned()),
        )
        .await?;
    tx.commit().await?;
    Ok(row.try_get("settled")?)
}
