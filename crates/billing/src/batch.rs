//! The set-based charge primitives auto-charge and dunning's retries share
//! (docs/adr/0017): a batch's attempts recorded with one statement, the
//! provider calls made concurrently, and every answer of the batch settled in
//! one transaction. Each row's write keeps its own condition (the claim still
//! ours and unexpired, the attempt still unknown), so a row whose condition
//! fails writes nothing while the others are written.
//!
//! ```text
//!  (the claim's transaction)  INSERT attempts … SELECT FROM unnest JOIN invoices
//!                             WHERE the row's claim holds the invoice      one statement
//!  calls                      POST /v1/payment_intents, charge_concurrency at once,
//!                             each under the panic guard
//!  settle (one transaction)   paid:     invoice open → paid + attempt → succeeded
//!                             declined: claim released + attempt → declined(code)
//!                             unknown:  attempt keeps unknown with its reason
//!                             then every event (enqueue_many) and every email
//!                             (email_outbox::enqueue_many) of the rows that won
//! ```
//!
//! A settle transaction that fails (a refused event or email, a database
//! error) rolls back whole and its rows are settled again one at a time by
//! the per-row functions of `store`, so one bad row costs that row only.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use db::{Db, Row, Tx, sql};
use futures::stream::{self, StreamExt};
use scheduler::{Payload, catch};
use tracing::warn;

use crate::Error;
use crate::provider::{self, ChargeOutcome, PaymentRequest, Provider};
use crate::store::{
    self, ChargeClaim, Settled, failed_email, paid_payload, payment_payload, receipt,
};

/// An attempt recorded for a claimed invoice, not yet answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Started {
    pub claim: ChargeClaim,
    pub attempt_id: i64,
    pub attempt_seq: i32,
}

/// What the provider said to one started attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The call was made; its outcome.
    Called(ChargeOutcome),
    /// The call was not made (the tick's budget ended, or it was cancelled):
    /// the attempt stays unknown, its claim is given back, and the reconciler
    /// sends it by its key, as after a crash between the attempt and the call.
    NotSent,
}

/// Why an attempt was recorded but not sent.
pub const NOT_SENT: &str =
    "not sent: the tick ended before the call; the reconciler sends it by its key";

/// Record `attempts` (claim, attempt sequence) as `unknown`, before their
/// calls, with one statement in the caller's transaction: each only while
/// its own claim still holds the invoice, under the (invoice, attempt) unique
/// key. Returns the attempts written; a row left out wrote nothing and must
/// not be called.
pub(crate) async fn start_attempts_in(
    tx: &mut Tx,
    attempts: &[(ChargeClaim, i32)],
) -> Result<Vec<Started>, db::Error> {
    if attempts.is_empty() {
        return Ok(Vec::new());
    }
    let col = |f: fn(&ChargeClaim, i32) -> String| {
        attempts.iter().map(|(c, s)| f(c, *s)).collect::<Vec<_>>()
    };
    let rows = tx
        .fetch_all(
            sql(
                "INSERT INTO payment_attempts (tenant_id, invoice_id, attempt_seq, idempotency_key, \
                                               amount, currency, provider_customer_id, \
                                               payment_method_id) \
                 SELECT i.tenant_id, i.id, u.seq, u.key, i.amount, i.currency, u.customer, u.card \
                 FROM unnest($1::bigint[], $2::int4[], $3::text[], $4::text[], $5::text[], \
                             $6::text[]) AS u(invoice_id, seq, key, claimed_by, customer, card) \
                 JOIN invoices i ON i.id = u.invoice_id \
                 WHERE i.status = 'open' \
                   AND i.auto_charge_claimed_by = u.claimed_by \
                   AND i.auto_charge_claimed_until > now() \
                 ON CONFLICT DO NOTHING \
                 RETURNING id, invoice_id",
            )
            .bind(attempts.iter().map(|(c, _)| c.invoice_id).collect::<Vec<_>>())
            .bind(attempts.iter().map(|(_, s)| *s).collect::<Vec<_>>())
            .bind(col(|c, s| provider::idempotency_key(c.invoice_id, s)))
            .bind(col(|c, _| c.claimed_by.clone()))
            .bind(col(|c, _| c.provider_customer.clone()))
            .bind(col(|c, _| c.payment_method.clone())),
        )
        .await?;
    let mut written = HashMap::with_capacity(rows.len());
    for r in &rows {
        written.insert(
            r.try_get::<i64, _>("invoice_id")?,
            r.try_get::<i64, _>("id")?,
        );
    }
    Ok(attempts
        .iter()
        .filter_map(|(c, seq)| {
            written.get(&c.invoice_id).map(|&attempt_id| Started {
                claim: c.clone(),
                attempt_id,
                attempt_seq: *seq,
            })
        })
        .collect())
}

/// Call the provider for every started attempt, `concurrency` at once, each
/// under the panic guard (`step` names it). A call that would start after
/// `deadline`, or once `cancelled` says so, is not made ([`Answer::NotSent`]).
/// A panic is that row's only: its attempt stays unknown and its claim
/// lease expires, for the reconciler.
pub(crate) async fn call_all(
    provider: &Provider,
    started: Vec<Started>,
    concurrency: usize,
    deadline: Instant,
    cancelled: impl Fn() -> bool + Copy,
    step: impl Fn(&Started) -> String + Copy,
) -> Vec<(Started, Result<Answer, Payload>)> {
    let call = provider.config().timeout;
    stream::iter(started)
        .map(|s| async move {
            let answer = catch(step(&s), async {
                if Instant::now() + call > deadline || cancelled() {
                    return Answer::NotSent;
                }
                let c = &s.claim;
                let req = PaymentRequest {
                    invoice_id: c.invoice_id,
                    amount: c.amount,
                    currency: c.currency.clone(),
                    customer: c.provider_customer.clone(),
                    payment_method: c.payment_method.clone(),
                };
                Answer::Called(provider.create_payment_intent(&req, s.attempt_seq).await)
            })
            .await;
            (s, answer)
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await
}

/// Settle every answered attempt of a batch in one transaction (see the
/// module's diagram). Returns, per row of `answers` and in their order, how it
/// was written: [`Settled::Lost`] when its claim no longer held the invoice or
/// its attempt was already settled (nothing written for it); an unknown or
/// unsent answer is `Written` (its reason noted). A batch that cannot be
/// written whole is settled again one row at a time, so an `Err` is that
/// row's own.
pub(crate) async fn settle_all(
    db: &Db,
    answers: &[(&Started, &Answer)],
    email_from: &str,
    statement_timeout: Duration,
) -> Vec<Result<Settled, Error>> {
    let mut lost: HashSet<i64> = HashSet::new();
    loop {
        let pending: Vec<(&Started, &Answer)> = answers
            .iter()
            .copied()
            .filter(|(s, _)| !lost.contains(&s.attempt_id))
            .collect();
        match settle_once(db, &pending, email_from, statement_timeout).await {
            Ok(Once::Committed(no_write)) => {
                lost.extend(no_write);
                return answers
                    .iter()
                    .map(|(s, _)| {
                        Ok(if lost.contains(&s.attempt_id) {
                            Settled::Lost
                        } else {
                            Settled::Written
                        })
                    })
                    .collect();
            }
            Ok(Once::RolledBack(bad)) => lost.extend(bad),
            Err(e) => {
                warn!(rows = pending.len(), error = %e, "batch settling failed whole; settling one row at a time");
                break;
            }
        }
    }
    // One at a time: each row in its own transaction, as before batching.
    let mut out = Vec::with_capacity(answers.len());
    for (s, a) in answers {
        out.push(settle_one(db, s, a, email_from, statement_timeout).await);
    }
    out
}

async fn settle_one(
    db: &Db,
    s: &Started,
    a: &Answer,
    from: &str,
    timeout: Duration,
) -> Result<Settled, Error> {
    let (claim, attempt, seq) = (&s.claim, s.attempt_id, s.attempt_seq);
    match a {
        Answer::Called(ChargeOutcome::Succeeded { payment_intent }) => {
            store::settle_paid(db, claim, attempt, seq, payment_intent, from, timeout).await
        }
        Answer::Called(ChargeOutcome::Declined {
            code,
            payment_intent,
        }) => {
            let pi = payment_intent.as_deref();
            store::settle_declined(db, claim, attempt, seq, (code, pi), from, timeout).await
        }
        Answer::Called(ChargeOutcome::Unknown { reason }) => {
            store::note_unknown(db, attempt, reason, timeout).await?;
            Ok(Settled::Written)
        }
        Answer::NotSent => {
            store::note_unknown(db, attempt, NOT_SENT, timeout).await?;
            store::release_claims(db, &[claim.invoice_id], &claim.claimed_by, timeout).await?;
            Ok(Settled::Written)
        }
    }
}

enum Once {
    /// Committed; these attempts' rows lost their condition and wrote nothing.
    Committed(Vec<i64>),
    /// Rolled back: these attempts' invoices were written but the attempts
    /// were already settled; they are settled `Lost`, the rest again.
    RolledBack(Vec<i64>),
}

/// The rows of one kind (paid or declined), as the statements bind them.
#[derive(Default)]
struct Cols {
    invoice: Vec<i64>,
    claimed_by: Vec<String>,
    attempt: Vec<i64>,
    intent: Vec<Option<String>>,
    code: Vec<Option<String>>,
}

impl Cols {
    fn push(&mut self, s: &Started, intent: Option<&str>, code: Option<&str>) {
        self.invoice.push(s.claim.invoice_id);
        self.claimed_by.push(s.claim.claimed_by.clone());
        self.attempt.push(s.attempt_id);
        self.intent.push(intent.map(str::to_owned));
        self.code.push(code.map(str::to_owned));
    }
}

async fn settle_once(
    db: &Db,
    answers: &[(&Started, &Answer)],
    from: &str,
    timeout: Duration,
) -> Result<Once, Error> {
    if answers.is_empty() {
        return Ok(Once::Committed(Vec::new()));
    }
    let (mut paid, mut declined) = (Cols::default(), Cols::default());
    let (mut unknown_ids, mut unknown_why) = (Vec::new(), Vec::new());
    let mut unsent = Vec::new();
    for (s, a) in answers {
        match a {
            Answer::Called(ChargeOutcome::Succeeded { payment_intent }) => {
                paid.push(s, Some(payment_intent), None);
            }
            Answer::Called(ChargeOutcome::Declined {
                code,
                payment_intent,
            }) => declined.push(s, payment_intent.as_deref(), Some(code)),
            Answer::Called(ChargeOutcome::Unknown { reason }) => {
                unknown_ids.push(s.attempt_id);
                unknown_why.push(reason.clone());
            }
            Answer::NotSent => {
                unknown_ids.push(s.attempt_id);
                unknown_why.push(NOT_SENT.to_owned());
                unsent.push(s);
            }
        }
    }
    let mut tx = db.begin_with_timeout(timeout).await?;
    // Paid: the invoice open → paid while this row's claim holds it unexpired,
    // and its attempt unknown → succeeded; per row, both or (rolled back) neither.
    let paid_won = if paid.invoice.is_empty() {
        Ok(HashSet::new())
    } else {
        let row = tx
            .fetch_one(
                sql("WITH u AS ( \
                       SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[]) \
                              AS u(invoice_id, claimed_by, attempt_id, intent) \
                     ), inv AS ( \
                       UPDATE invoices i SET status = 'paid', paid_at = now(), \
                              auto_charge_claimed_until = NULL, auto_charge_claimed_by = NULL \
                       FROM u \
                       WHERE i.id = u.invoice_id AND i.status = 'open' \
                         AND i.auto_charge_claimed_by = u.claimed_by \
                         AND i.auto_charge_claimed_until > now() \
                       RETURNING i.id \
                     ), att AS ( \
                       UPDATE payment_attempts a SET provider_status = 'succeeded', \
                              decline_code = NULL, provider_payment_intent = u.intent, \
                              resolved_at = now(), last_checked_at = now() \
                       FROM u JOIN inv ON inv.id = u.invoice_id \
                       WHERE a.id = u.attempt_id AND a.provider_status = 'unknown' \
                       RETURNING a.id \
                     ) \
                     SELECT COALESCE((SELECT array_agg(id) FROM inv), '{}') AS invoices, \
                            COALESCE((SELECT array_agg(id) FROM att), '{}') AS attempts")
                .bind(paid.invoice.clone())
                .bind(paid.claimed_by.clone())
                .bind(paid.attempt.clone())
                .bind(paid.intent.clone()),
            )
            .await?;
        won_pairs(&row, &paid)?
    };
    let declined_won = if declined.invoice.is_empty() {
        Ok(HashSet::new())
    } else {
        let row = tx
            .fetch_one(
                sql("WITH u AS ( \
                       SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[], \
                                            $5::text[]) \
                              AS u(invoice_id, claimed_by, attempt_id, intent, code) \
                     ), inv AS ( \
                       UPDATE invoices i SET auto_charge_claimed_until = NULL, \
                              auto_charge_claimed_by = NULL \
                       FROM u \
                       WHERE i.id = u.invoice_id AND i.status = 'open' \
                         AND i.auto_charge_claimed_by = u.claimed_by \
                         AND i.auto_charge_claimed_until > now() \
                       RETURNING i.id \
                     ), att AS ( \
                       UPDATE payment_attempts a SET provider_status = 'declined', \
                              decline_code = u.code, provider_payment_intent = u.intent, \
                              resolved_at = now(), last_checked_at = now() \
                       FROM u JOIN inv ON inv.id = u.invoice_id \
                       WHERE a.id = u.attempt_id AND a.provider_status = 'unknown' \
                       RETURNING a.id \
                     ) \
                     SELECT COALESCE((SELECT array_agg(id) FROM inv), '{}') AS invoices, \
                            COALESCE((SELECT array_agg(id) FROM att), '{}') AS attempts")
                .bind(declined.invoice.clone())
                .bind(declined.claimed_by.clone())
                .bind(declined.attempt.clone())
                .bind(declined.intent.clone())
                .bind(declined.code.clone()),
            )
            .await?;
        won_pairs(&row, &declined)?
    };
    let (paid_won, declined_won) = match (paid_won, declined_won) {
        (Ok(p), Ok(d)) => (p, d),
        (p, d) => {
            // An invoice written whose attempt was already settled: roll back,
            // and settle those rows as lost.
            tx.rollback().await?;
            let mut ids = Vec::new();
            for r in [p, d] {
                if let Err(bad) = r {
                    ids.extend(bad);
                }
            }
            return Ok(Once::RolledBack(ids));
        }
    };
    if !unknown_ids.is_empty() {
        tx.execute(
            sql("UPDATE payment_attempts a SET last_error = u.why \
                 FROM unnest($1::bigint[], $2::text[]) AS u(id, why) \
                 WHERE a.id = u.id AND a.provider_status = 'unknown'")
            .bind(unknown_ids)
            .bind(unknown_why),
        )
        .await?;
    }
    if !unsent.is_empty() {
        tx.execute(
            sql("UPDATE invoices i SET auto_charge_claimed_until = NULL, auto_charge_claimed_by = NULL \
                 FROM unnest($1::bigint[], $2::text[]) AS u(id, claimed_by) \
                 WHERE i.id = u.id AND i.auto_charge_claimed_by = u.claimed_by")
            .bind(unsent.iter().map(|s| s.claim.invoice_id).collect::<Vec<_>>())
            .bind(unsent.iter().map(|s| s.claim.claimed_by.clone()).collect::<Vec<_>>()),
        )
        .await?;
    }
    // The effects of the rows that won, each kind with one statement.
    let mut payloads: Vec<(&str, &'static str, String)> = Vec::new();
    let mut emails: Vec<(&str, email_outbox::Email)> = Vec::new();
    for (s, a) in answers {
        let c = &s.claim;
        let tenant = c.tenant_id.as_str();
        match a {
            Answer::Called(ChargeOutcome::Succeeded { payment_intent })
                if paid_won.contains(&s.attempt_id) =>
            {
                payloads.push((tenant, "invoice.paid", paid_payload(c, payment_intent)));
                let pi = Some(payment_intent.as_str());
                payloads.push((
                    tenant,
                    "payment.succeeded",
                    payment_payload(c, s.attempt_seq, pi, None),
                ));
                emails.push((tenant, receipt(c, from)));
            }
            Answer::Called(ChargeOutcome::Declined {
                code,
                payment_intent,
            }) if declined_won.contains(&s.attempt_id) => {
                let pi = payment_intent.as_deref();
                payloads.push((
                    tenant,
                    "payment.failed",
                    payment_payload(c, s.attempt_seq, pi, Some(code)),
                ));
                emails.push((tenant, failed_email(c, code, from)));
            }
            _ => {}
        }
    }
    let events: Vec<webhook_outbox::NewEvent<'_>> = payloads
        .iter()
        .map(|(t, e, p)| (*t, *e, p.as_str()))
        .collect();
    webhook_outbox::enqueue_many(&mut tx, &events).await?;
    let emails: Vec<(&str, &email_outbox::Email)> = emails.iter().map(|(t, e)| (*t, e)).collect();
    email_outbox::enqueue_many(&mut tx, &emails).await?;
    tx.commit().await?;
    let lost: Vec<i64> = answers
        .iter()
        .filter(|(s, a)| match a {
            Answer::Called(ChargeOutcome::Succeeded { .. }) => !paid_won.contains(&s.attempt_id),
            Answer::Called(ChargeOutcome::Declined { .. }) => !declined_won.contains(&s.attempt_id),
            _ => false,
        })
        .map(|(s, _)| s.attempt_id)
        .collect();
    Ok(Once::Committed(lost))
}

/// The attempts whose invoice and attempt were both written; `Err` with the
/// attempts whose invoice was written but whose attempt was not.
fn won_pairs(row: &db::PgRow, cols: &Cols) -> Result<Result<HashSet<i64>, Vec<i64>>, db::Error> {
    let invoices: HashSet<i64> = row
        .try_get::<Vec<i64>, _>("invoices")?
        .into_iter()
        .collect();
    let attempts: HashSet<i64> = row
        .try_get::<Vec<i64>, _>("attempts")?
        .into_iter()
        .collect();
    let mut bad = Vec::new();
    for (inv, att) in cols.invoice.iter().zip(&cols.attempt) {
        if invoices.contains(inv) && !attempts.contains(att) {
            bad.push(*att);
        }
    }
    Ok(if bad.is_empty() {
        Ok(attempts)
    } else {
        Err(bad)
    })
}
