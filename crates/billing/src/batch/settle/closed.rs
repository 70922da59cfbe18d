//! An answer that may have charged, for an invoice closed while it was in
//! flight: sent to an operator's review instead of left unknown where the
//! reconciler never looks (docs/adr/0142).

use std::collections::HashSet;

use db::{Row, sql};
use tracing::error;

use super::Cols;
use crate::Error;
use crate::batch::{Answer, Started};
use crate::provider::ChargeOutcome;

/// The settle's statement for an answer that may have charged (paid,
/// processing, unknown, or one for review) whose invoice is no longer open,
/// so [`SETTLE`](super::SETTLE) could not pay it; `pub` only for the plan test. Money was
/// taken, or may be, for an invoice already paid, written off or voided: left
/// `unknown`, the attempt was never looked at again (the reconciler reads open
/// invoices), and the charge stayed unrecorded. The attempt (still unknown or
/// processing) now needs review with the intent, and the invoice is flagged,
/// keeping its status: the operator refunds at the provider and settles the
/// attempt as not charged (`billing_settle_attempt` refuses to pay a closed
/// invoice). Each invoice is locked first, by id, and its status tested on
/// the locked row, so a close in flight is waited for and seen; its claim is
/// given back if it is still this row's (docs/adr/0142).
pub const SETTLE_CLOSED: &str = "WITH u AS ( \
       SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::text[], $5::text[], \
                            $6::text[], $7::text[]) \
              AS u(invoice_id, attempt_id, claimed_by, answer, intent, was, why) \
     ), locked AS ( \
       SELECT i.id, i.status, u.was, u.attempt_id, u.claimed_by, u.answer, u.intent, u.why \
       FROM u JOIN invoices i ON i.id = u.invoice_id \
       ORDER BY i.id \
       FOR UPDATE OF i \
     ), att AS ( \
       UPDATE payment_attempts a SET provider_status = 'needs_review', \
              provider_payment_intent = COALESCE(c.intent, a.provider_payment_intent), \
              resolved_at = NULL, last_checked_at = now(), \
              last_error = format('%s (%s) after invoice %s became %s: if it charged, refund \
                                   it at the provider; then settle this attempt as not \
                                   charged', \
                  CASE c.answer WHEN 'succeeded' THEN 'charged' \
                                WHEN 'processing' THEN 'accepted as processing' \
                                WHEN 'needs_review' THEN 'answered for review: ' \
                                                         || COALESCE(c.why, 'no reason given') \
                                ELSE 'answered without an outcome' END, \
                  COALESCE(c.intent, a.provider_payment_intent, \
                           'key ' || a.idempotency_key), c.id, c.status) \
       FROM locked c \
       WHERE a.id = c.attempt_id \
         AND c.status <> c.was \
         AND coalesce(a.provider_status, '') IN ('unknown', 'processing') \
       RETURNING a.id, a.invoice_id, a.last_error, c.claimed_by \
     ) \
     UPDATE invoices i SET review_since = now(), review_reason = att.last_error, \
            auto_charge_claimed_until = CASE WHEN i.auto_charge_claimed_by = att.claimed_by \
                                             THEN NULL ELSE i.auto_charge_claimed_until END, \
            auto_charge_claimed_by = CASE WHEN i.auto_charge_claimed_by = att.claimed_by \
                                          THEN NULL ELSE i.auto_charge_claimed_by END \
     FROM att \
     WHERE i.id = att.invoice_id \
     RETURNING att.id, i.id AS invoice_id, att.last_error";

/// [`SETTLE_CLOSED`] for the rows whose answer says the charge was or may
/// have been made ([`may_have_charged`]) that [`SETTLE`](super::SETTLE) did
/// not resolve (their claim lost, or their invoice closed). Returns the
/// attempts sent to review, which the caller reports
/// [`Settled::Reviewed`](crate::batch::Settled::Reviewed); each is logged.
pub(super) async fn review_closed(
    tx: &mut db::Tx,
    answers: &[(&Started, &Answer)],
    won: &HashSet<i64>,
) -> Result<HashSet<i64>, Error> {
    let mut rows = Cols::default();
    for (s, a) in answers {
        if let Some((answer, intent, why)) = may_have_charged(a)
            && !won.contains(&s.attempt_id)
        {
            rows.invoice.push(s.claim.invoice_id);
            rows.attempt.push(s.attempt_id);
            rows.claimed_by.push(s.claim.claimed_by.clone());
            rows.status.push(answer.to_owned());
            rows.intent.push(intent.map(str::to_owned));
            rows.why.push(why.map(str::to_owned));
        }
    }
    let mut sent = HashSet::new();
    if rows.attempt.is_empty() {
        return Ok(sent);
    }
    let was = vec![crate::batch::OPEN; rows.attempt.len()];
    let reviewed = tx
        .fetch_all(
            sql(SETTLE_CLOSED)
                .bind(rows.invoice)
                .bind(rows.attempt)
                .bind(rows.claimed_by)
                .bind(rows.status)
                .bind(rows.intent)
                .bind(was)
                .bind(rows.why),
        )
        .await?;
    for r in reviewed {
        let (attempt, invoice, why): (i64, i64, String) = (
            r.try_get(0).map_err(db::Error::from)?,
            r.try_get(1).map_err(db::Error::from)?,
            r.try_get(2).map_err(db::Error::from)?,
        );
        error!(invoice, attempt, reason = %why, "a charge answered after its invoice was closed needs an operator's review (hardcount billing review)");
        sent.insert(attempt);
    }
    Ok(sent)
}

/// The answer a charge may have been made under, its intent if known, and
/// for one sent to review its reason: paid, processing, unknown (a timeout, a
/// 5xx, a `lock_timeout`), or for review (an `idempotency_error`, an intent
/// waiting for the customer's action, an answer that does not parse).
fn may_have_charged(a: &Answer) -> Option<(&'static str, Option<&str>, Option<&str>)> {
    match a {
        Answer::Called(ChargeOutcome::Succeeded { payment_intent }) => {
            Some(("succeeded", Some(payment_intent), None))
        }
        Answer::Called(ChargeOutcome::Processing { payment_intent }) => {
            Some(("processing", Some(payment_intent), None))
        }
        Answer::Called(ChargeOutcome::Unknown { payment_intent, .. }) => {
            Some(("unknown", payment_intent.as_deref(), None))
        }
        Answer::Called(ChargeOutcome::NeedsReview {
            reason,
            payment_intent,
            ..
        }) => Some(("needs_review", payment_intent.as_deref(), Some(reason))),
        _ => None,
    }
}
