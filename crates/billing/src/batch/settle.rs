//! The settling of a batch's answers: one transaction, each row by its own
//! compare-and-set, with the rows' events and emails; redone a row at a time
//! when it fails whole.

use std::collections::HashSet;
use std::time::Duration;

use db::{Db, Row, sql};
use tracing::warn;

use super::messages::{failed_email, paid_payload, payment_payload, receipt};
use super::{Answer, NOT_SENT, Started};
use crate::Error;
use crate::batch::Settled;
use crate::provider::ChargeOutcome;

mod closed;
pub use closed::SETTLE_CLOSED;

/// How answers are written: the settle's settings.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settling<'a> {
    pub email_from: &'a str,
    /// Where an email the outbox refuses is counted
    /// (`hardcount_email_refused_total`): recorded failed, never a rollback.
    pub telemetry: &'a leader::Telemetry,
    pub statement_timeout: Duration,
    /// The reconciler's first wait before looking at an open attempt again;
    /// doubled per lookup, at most an hour.
    pub backoff: Duration,
}

/// The settle's one statement for the resolved rows; `pub` only for the plan
/// test (`tests/it/plans.rs`). The invoice (claim still ours, unexpired,
/// still open, `was`: `batch::OPEN`) is paid, flagged for review or given back, and the attempt
/// (still unknown or processing) resolved; per row, both or (the caller rolls
/// back) neither. `inv` carries each row's answer on through its `RETURNING`,
/// so `att` joins only the invoices written, by the attempt's key: in the
/// `begin_index_driven` transaction every row of the batch is reached once
/// by its primary key (issue 29, point 3), instead of the claims index read
/// whole (every invoice claimed by the tick) or the batch joined to itself.
///
/// The claim's expiry and the attempt's open status are compared through
/// `coalesce` (the same truth: neither column is NULL where it matters), so
/// that neither matches a partial index (`invoices_auto_charge_claims`,
/// `payment_attempts_open`). Statistics gathered while nothing was claimed
/// estimate one row in each; the planner then drove the nested loop from
/// that index and unnested the whole batch once per claimed invoice (250,000
/// rows filtered for a batch of 500, 260 ms a settle in the dunning
/// benchmark; docs/adr/0053).
pub const SETTLE: &str = "WITH u AS ( \
       SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[], \
                            $5::text[], $6::text[], $7::text[], $8::text[], $10::text[]) \
              AS u(invoice_id, claimed_by, attempt_id, status, code, intent, why, raw, was) \
     ), inv AS ( \
       UPDATE invoices i SET \
              status = CASE WHEN u.status = 'succeeded' THEN 'paid' ELSE i.status END, \
              paid_at = CASE WHEN u.status = 'succeeded' THEN now() ELSE i.paid_at END, \
              review_since = CASE WHEN u.status IN ('failed', 'needs_review') \
                                  THEN now() ELSE i.review_since END, \
              review_reason = CASE WHEN u.status IN ('failed', 'needs_review') \
                                   THEN u.why ELSE i.review_reason END, \
              auto_charge_claimed_until = NULL, auto_charge_claimed_by = NULL \
       FROM u \
       WHERE i.id = u.invoice_id AND i.status = u.was \
         AND i.auto_charge_claimed_by = u.claimed_by \
         AND coalesce(i.auto_charge_claimed_until, '-infinity') > now() \
       RETURNING i.id, u.attempt_id, u.status, u.code, u.intent, u.why, u.raw \
     ), att AS ( \
       UPDATE payment_attempts a SET provider_status = v.status, \
              decline_code = v.code, \
              provider_payment_intent = COALESCE(v.intent, a.provider_payment_intent), \
              last_error = v.why, raw_answer = v.raw, \
              resolved_at = CASE WHEN v.status IN ('processing', 'needs_review') \
                                 THEN NULL ELSE now() END, \
              last_checked_at = now(), lookups = a.lookups + 1, \
              next_check_at = now() + make_interval(secs => \
                  least($9 * power(2, least(a.lookups, 12)), 3600)) \
       FROM inv v \
       WHERE a.id = v.attempt_id \
         AND coalesce(a.provider_status, '') IN ('unknown', 'processing') \
       RETURNING a.id \
     ) \
     SELECT COALESCE((SELECT array_agg(id) FROM inv), '{}') AS invoices, \
            COALESCE((SELECT array_agg(id) FROM att), '{}') AS attempts";

/// The settle's statement for the rows left open (unknown, retry later, key
/// refused, not sent); `pub` only for the plan test. It notes why, when to
/// look again and, for a key no request executed, takes back the send stamp
/// (docs/adr/0081), but only while the claim the row was sent under still
/// holds its invoice (`auto_charge_claimed_by`, unique per claim), proved
/// under a share lock of the invoice: a batch whose calls outlasted its lease,
/// after the reconciler took the invoice over and sent the key, must not mark
/// that attempt never sent (docs/adr/0083). The lock waits out a takeover in
/// flight and re-reads its holder; a claim that meets it skips the invoice.
/// Expiry alone is not checked: a lapsed claim nobody took still writes, and
/// so does one the stale-hold sweep gave back (no holder) while no look has
/// been made at the attempt since (`last_checked_at`, stamped after every
/// look): left stamped, a never-sent attempt would skip auto-charge's rule.
pub const SETTLE_OPEN: &str = "WITH u AS ( \
       SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::float8[], $5::bool[], \
                            $7::bigint[], $8::text[]) \
              AS u(id, why, intent, delay, unsent, invoice_id, claimed_by) \
     ), held AS ( \
       SELECT u.*, i.auto_charge_claimed_by IS NULL AS freed \
       FROM u JOIN invoices i ON i.id = u.invoice_id \
       WHERE i.auto_charge_claimed_by = u.claimed_by OR i.auto_charge_claimed_by IS NULL \
       FOR SHARE OF i \
     ) \
     UPDATE payment_attempts a SET last_error = h.why, \
            provider_payment_intent = COALESCE(h.intent, a.provider_payment_intent), \
            lookups = a.lookups + 1, \
            next_check_at = now() + make_interval(secs => COALESCE(h.delay, \
                least($6 * power(2, least(a.lookups, 12)), 3600))), \
            first_sent_at = CASE WHEN h.unsent THEN NULL ELSE a.first_sent_at END \
     FROM held h \
     WHERE a.id = h.id AND (NOT h.freed OR a.last_checked_at IS NULL) \
       AND coalesce(a.provider_status, '') IN ('unknown', 'processing') \
     RETURNING a.id";

/// Settle every answered attempt of a batch in one transaction (see the
/// module's diagram). Returns, per row of `answers` and in their order, how it
/// was written: [`Settled::Lost`] when its claim no longer held the invoice or
/// its attempt was already settled (nothing written for it); an answer that
/// leaves the attempt open (unknown, later, key refused, not sent) is
/// `Written` (its reason noted), or `Lost` if another claim has the invoice
/// ([`SETTLE_OPEN`]); an answer that may have charged whose invoice was
/// closed meanwhile is [`Settled::Reviewed`] ([`SETTLE_CLOSED`]). A batch that cannot be written whole is
/// settled again one row at a time, so an `Err` is that row's own.
pub(crate) async fn settle_all(
    db: &Db,
    answers: &[(&Started, &Answer)],
    how: Settling<'_>,
) -> Vec<Result<Settled, Error>> {
    let mut lost: HashSet<i64> = HashSet::new();
    loop {
        let pending: Vec<(&Started, &Answer)> = answers
            .iter()
            .copied()
            .filter(|(s, _)| !lost.contains(&s.attempt_id))
            .collect();
        match settle_once(db, &pending, how).await {
            Ok(Once::Committed {
                lost: no_write,
                reviewed,
            }) => {
                lost.extend(no_write);
                return answers
                    .iter()
                    .map(|(s, _)| Ok(settled(s.attempt_id, &lost, &reviewed)))
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
    for row in answers {
        out.push(match settle_once(db, &[*row], how).await {
            Ok(Once::Committed { lost, reviewed }) => Ok(settled(
                row.0.attempt_id,
                &lost.into_iter().collect(),
                &reviewed,
            )),
            Ok(Once::RolledBack(_)) => Ok(Settled::Lost),
            Err(e) => Err(e),
        });
    }
    out
}

enum Once {
    /// Committed; these attempts' rows lost their condition and wrote nothing
    /// (`lost`), and of them these were sent to review (`reviewed`).
    Committed {
        lost: Vec<i64>,
        reviewed: HashSet<i64>,
    },
    /// Rolled back: these attempts' invoices were written but the attempts
    /// were already settled; they are settled `Lost`, the rest again.
    RolledBack(Vec<i64>),
}

/// How one attempt of a committed settle was written.
fn settled(attempt: i64, lost: &HashSet<i64>, reviewed: &HashSet<i64>) -> Settled {
    if reviewed.contains(&attempt) {
        Settled::Reviewed
    } else if lost.contains(&attempt) {
        Settled::Lost
    } else {
        Settled::Written
    }
}

/// What a resolved answer writes: the attempt's new status, its decline
/// code, the payment intent, and why (the review reason).
type Resolved<'a> = (
    &'static str,
    Option<&'a str>,
    Option<&'a str>,
    Option<String>,
);

/// What a settled answer writes (the invoice is paid for `succeeded`,
/// flagged for `failed` and `needs_review`). `None`: the attempt stays open.
fn resolution(a: &Answer) -> Option<Resolved<'_>> {
    match a {
        Answer::Called(ChargeOutcome::Succeeded { payment_intent }) => {
            Some(("succeeded", None, Some(payment_intent), None))
        }
        Answer::Called(ChargeOutcome::Declined {
            code,
            payment_intent,
        }) => Some(("declined", Some(code), payment_intent.as_deref(), None)),
        Answer::Called(ChargeOutcome::Processing { payment_intent }) => {
            Some(("processing", None, Some(payment_intent), None))
        }
        Answer::Called(ChargeOutcome::Invalid { reason }) => {
            Some(("failed", None, None, Some(reason.clone())))
        }
        Answer::Called(ChargeOutcome::NeedsReview {
            reason,
            payment_intent,
            ..
        }) => Some((
            "needs_review",
            None,
            payment_intent.as_deref(),
            Some(reason.clone()),
        )),
        _ => None,
    }
}

/// The resolved rows, as the statement binds them.
#[derive(Default)]
struct Cols {
    invoice: Vec<i64>,
    claimed_by: Vec<String>,
    attempt: Vec<i64>,
    status: Vec<String>,
    code: Vec<Option<String>>,
    intent: Vec<Option<String>>,
    why: Vec<Option<String>>,
    raw: Vec<Option<String>>,
}

/// The rows left open, as the statement binds them.
#[derive(Default)]
struct Open {
    attempt: Vec<i64>,
    /// The claim each row was sent under, which the write proves.
    invoice: Vec<i64>,
    claimed_by: Vec<String>,
    why: Vec<String>,
    intent: Vec<Option<String>>,
    /// Seconds until the next look; `None`: the reconciler's backoff.
    delay: Vec<Option<f64>>,
    /// No request of this key executed: the resend window restarts.
    unsent: Vec<bool>,
    /// Give the invoice's claim back now (nothing can be in flight).
    release: Vec<(i64, String)>,
}

async fn settle_once(
    db: &Db,
    answers: &[(&Started, &Answer)],
    how: Settling<'_>,
) -> Result<Once, Error> {
    if answers.is_empty() {
        return Ok(Once::Committed {
            lost: Vec::new(),
            reviewed: HashSet::new(),
        });
    }
    let (mut done, mut open) = (Cols::default(), Open::default());
    for (s, a) in answers {
        if let Some((status, code, intent, why)) = resolution(a) {
            done.invoice.push(s.claim.invoice_id);
            done.claimed_by.push(s.claim.claimed_by.clone());
            done.attempt.push(s.attempt_id);
            done.status.push(status.to_owned());
            done.code.push(code.map(str::to_owned));
            done.intent.push(intent.map(str::to_owned));
            done.why.push(why);
            done.raw.push(match a {
                Answer::Called(ChargeOutcome::NeedsReview { raw, .. }) => raw.clone(),
                _ => None,
            });
            continue;
        }
        let (why, intent, delay, unsent) = match a {
            Answer::Called(ChargeOutcome::Unknown {
                reason,
                payment_intent,
                ..
            }) => {
                // After a first call the claim's lease decides the first look.
                let delay = s.first_send.then_some(0.0);
                (reason.clone(), payment_intent.clone(), delay, false)
            }
            // A 429 was refused before execution: a first send's stamp is
            // taken back, as after a refused key (docs/adr/0091).
            Answer::Called(ChargeOutcome::RetryLater {
                reason,
                after,
                in_flight,
            }) => (
                reason.clone(),
                None,
                Some(after.as_secs_f64()),
                s.first_send && !in_flight,
            ),
            Answer::Called(ChargeOutcome::KeyRejected { message, .. }) => {
                (message.clone(), None, Some(0.0), s.first_send)
            }
            _ => (NOT_SENT.to_owned(), None, Some(0.0), s.first_send),
        };
        if unsent || matches!(a, Answer::Called(ChargeOutcome::KeyRejected { .. })) {
            open.release
                .push((s.claim.invoice_id, s.claim.claimed_by.clone()));
        }
        open.attempt.push(s.attempt_id);
        open.invoice.push(s.claim.invoice_id);
        open.claimed_by.push(s.claim.claimed_by.clone());
        open.why.push(why);
        open.intent.push(intent);
        open.delay.push(delay);
        open.unsent.push(unsent);
    }
    let backoff = how.backoff.as_secs_f64();
    let mut tx = db.begin_index_driven(how.statement_timeout).await?;
    // Resolved rows: the invoice (claim still ours, unexpired, still open)
    // paid, flagged for review or just given back, and the attempt (still
    // unknown or processing) resolved; per row, both or (rolled back) neither.
    let won = if done.invoice.is_empty() {
        Ok(HashSet::new())
    } else {
        let row = tx
            .fetch_one(
                sql(SETTLE)
                    .bind(done.invoice.clone())
                    .bind(done.claimed_by.clone())
                    .bind(done.attempt.clone())
                    .bind(done.status.clone())
                    .bind(done.code.clone())
                    .bind(done.intent.clone())
                    .bind(done.why.clone())
                    .bind(done.raw.clone())
                    .bind(backoff)
                    .bind(vec![super::OPEN; done.invoice.len()]),
            )
            .await?;
        won_pairs(&row, &done)?
    };
    let won = match won {
        Ok(w) => w,
        Err(bad) => {
            // An invoice written whose attempt was already settled: roll back,
            // and settle those rows as lost.
            tx.rollback().await?;
            return Ok(Once::RolledBack(bad));
        }
    };
    // Before the rows left open take their share locks: this takes the
    // invoices' update locks, and one after the other in the same
    // transaction could deadlock with another settle of the same attempt.
    let reviewed = closed::review_closed(&mut tx, answers, &won).await?;
    let mut kept_open = HashSet::new();
    if !open.attempt.is_empty() {
        let rows = tx
            .fetch_all(
                sql(SETTLE_OPEN)
                    .bind(open.attempt.clone())
                    .bind(open.why)
                    .bind(open.intent)
                    .bind(open.delay)
                    .bind(open.unsent)
                    .bind(backoff)
                    .bind(open.invoice)
                    .bind(open.claimed_by),
            )
            .await?;
        for r in rows {
            kept_open.insert(r.try_get::<i64, _>(0).map_err(db::Error::from)?);
        }
    }
    if !open.release.is_empty() {
        let (ids, by): (Vec<i64>, Vec<String>) = open.release.into_iter().unzip();
        tx.execute(
            sql("UPDATE invoices i SET auto_charge_claimed_until = NULL, auto_charge_claimed_by = NULL \
                 FROM unnest($1::bigint[], $2::text[]) AS u(id, claimed_by) \
                 WHERE i.id = u.id AND i.auto_charge_claimed_by = u.claimed_by")
            .bind(ids)
            .bind(by),
        )
        .await?;
    }
    // The effects of the rows that won, each kind with one statement. The
    // payment pages are read only when a first attempt's decline asks its
    // customer to act (docs/adr/0150): a paid batch reads none.
    let asking: HashSet<String> = answers
        .iter()
        .filter(|(s, a)| {
            won.contains(&s.attempt_id)
                && s.attempt_seq == crate::charge::AUTO_CHARGE_ATTEMPT
                && matches!(a, Answer::Called(ChargeOutcome::Declined { .. }))
        })
        .map(|(s, _)| s.claim.tenant_id.clone())
        .collect();
    let pages = payments::payment_pages(&mut tx, asking.into_iter().collect()).await?;
    let mut payloads: Vec<(&str, &'static str, String)> = Vec::new();
    let mut emails: Vec<(&str, outbox::email::Email)> = Vec::new();
    for (s, a) in answers {
        if !won.contains(&s.attempt_id) {
            continue;
        }
        let c = &s.claim;
        let tenant = c.tenant_id.as_str();
        match a {
            Answer::Called(ChargeOutcome::Succeeded { payment_intent }) => {
                payloads.push((tenant, "invoice.paid", paid_payload(c, payment_intent)));
                let pi = Some(payment_intent.as_str());
                payloads.push((
                    tenant,
                    "payment.succeeded",
                    payment_payload(c, s.attempt_seq, pi, None),
                ));
                emails.push((tenant, receipt(c, how.email_from)));
            }
            Answer::Called(ChargeOutcome::Declined {
                code,
                payment_intent,
            }) => {
                let pi = payment_intent.as_deref();
                payloads.push((
                    tenant,
                    "payment.failed",
                    payment_payload(c, s.attempt_seq, pi, Some(code)),
                ));
                // A retry's decline is dunning's to announce, as its policy
                // says (the warning, or the final notice after the last):
                // billing's "we will try again" beside it was a second
                // email, and after the last retry an untrue one
                // (docs/adr/0114).
                if s.attempt_seq == crate::charge::AUTO_CHARGE_ATTEMPT {
                    let page = pages.get(tenant).map(String::as_str);
                    emails.push((tenant, failed_email(c, code, how.email_from, page)));
                }
            }
            Answer::Called(
                ChargeOutcome::Invalid { reason } | ChargeOutcome::NeedsReview { reason, .. },
            ) => {
                warn!(invoice = c.invoice_id, attempt = s.attempt_id, reason = %reason, "payment attempt needs an operator's review (hardcount billing review)");
            }
            _ => {}
        }
    }
    let events: Vec<outbox::webhook::NewEvent<'_>> = payloads
        .iter()
        .map(|(t, e, p)| (*t, *e, p.as_str()))
        .collect();
    outbox::webhook::enqueue_many(&mut tx, &events).await?;
    let emails: Vec<(&str, &outbox::email::Email)> = emails.iter().map(|(t, e)| (*t, e)).collect();
    // A receipt the outbox refuses (an address it cannot send to) is
    // recorded failed with its reason; the settle commits (docs/adr/0027).
    outbox::email::enqueue_many_or_record(&mut tx, &emails, how.telemetry).await?;
    tx.commit().await?;
    let lost: Vec<i64> = answers
        .iter()
        .filter(|(s, a)| {
            if resolution(a).is_some() {
                !won.contains(&s.attempt_id)
            } else {
                !kept_open.contains(&s.attempt_id)
            }
        })
        .map(|(s, _)| s.attempt_id)
        .collect();
    Ok(Once::Committed { lost, reviewed })
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
