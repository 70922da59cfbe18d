//! The payment reconciler, the last step of the billing tick: two sweeps.
//!
//! ```text
//!  open      attempts 'unknown' or 'processing' of open invoices not flagged for
//!            review, whose claim is free or expired and whose next look is due,
//!            least recently checked first, AND leader_fence   (fenced; claims the invoice)
//!            per attempt, concurrently, each under the panic guard, the provider's
//!            record (docs/adr/0024), never a resend once the key may be forgotten:
//!              an intent id known      ─▶ GET /v1/payment_intents/{id}
//!              never sent              ─▶ the POST under its key (docs/adr/0091)
//!              else                    ─▶ the customer's recent intents, matched on
//!                                         metadata[hardcount_attempt] (at most 500)
//!              not found or not reached, key alive ─▶ the same POST under the same key
//!              not found or not reached, key may be gone ─▶ needs review (0090)
//!            an answer found paid by an intent an operator's settle already
//!            gave another attempt ─▶ needs review (docs/adr/0120)
//!            then one settling transaction for the batch (crate::batch):
//!                succeeded  ─▶ invoice.paid, payment.succeeded, receipt
//!                declined   ─▶ payment.failed, its email for a first attempt
//!                processing ─▶ polled again at a backoff (no dunning meanwhile)
//!                invalid, unreadable ─▶ needs review (invoice flagged)
//!                otherwise  ─▶ stays open, its reason noted, looked at again later
//!            then every checked attempt is stamped (last_checked_at), a panicked
//!            one too, and the claims given back: one bad row rotates to the back
//!  stale     auto-charge claims past their expiry freed, longest expired first
//!            (one fenced statement per batch)
//! ```
//!
//! An attempt is only looked up once its invoice's claim lease has expired
//! (the lease outlives the call by construction), so a lookup never races the
//! call it looks up. A refused key (401/403) stops every lookup of the tick
//! and fails it.

pub(crate) mod store;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::stream::{self, StreamExt};
use leader::{Fence, Role, Tick};
use scheduler::{FencedBatches, Panics, Payload, Shape, catch};
use tracing::{info, warn};

use crate::batch::Settled;
use crate::batch::{self, Answer, Gate, Started};
use crate::provider::{self, ChargeOutcome, Listed};
use crate::{Biller, Error};
use store::UnknownAttempt;

/// What the reconciler came to over a tick.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReconcileTally {
    /// Unknown attempts found charged and settled as paid.
    pub paid: usize,
    /// Unknown attempts found declined and recorded.
    pub declined: usize,
    /// Still unknown after the lookup (stamped, tried again later).
    pub still_unknown: usize,
    /// Accepted by the provider, not settled yet: polled again later.
    pub processing: usize,
    /// Sent to an operator's review (unreadable, refused, or the key may be
    /// forgotten).
    pub needs_review: usize,
    /// Settled by someone else first: nothing written.
    pub lost: usize,
    /// Checks that panicked: counted as failed, their rows stamped.
    pub failed: usize,
    /// Expired auto-charge claims freed by the stale-hold sweep.
    pub holds_freed: usize,
}

static CHECKS: AtomicU64 = AtomicU64::new(0);

fn check_identity(fence: &Fence) -> String {
    let n = CHECKS.fetch_add(1, Ordering::Relaxed);
    format!("reconciler:{}:{}:{n}", fence.token(), std::process::id())
}

/// What the provider's record says of one open attempt, without ever
/// sending it again once its key may be forgotten (docs/adr/0024): the
/// intent by id when an answer named one; else the customer's intents
/// searched for the attempt's metadata; else (none carries it, or more
/// intents than a lookup reads: docs/adr/0090), only while the key is
/// certainly alive, the same request under the same key (which answers
/// the stored result, or executes once if the first never did); else
/// needs review.
async fn look_up(biller: &Biller, u: &UnknownAttempt) -> ChargeOutcome {
    let Some(provider) = &biller.inner.provider else {
        return ChargeOutcome::Unknown {
            reason: "no provider configured".into(),
            payment_intent: None,
            outage: false,
        };
    };
    if let Some(pi) = &u.payment_intent {
        return provider.get_payment_intent(pi).await;
    }
    // Nothing under the key has left (docs/adr/0081), so no intent carries
    // it: the request goes without a listing, whose refusal or outage would
    // say nothing and yet leave the attempt counted as sent (docs/adr/0091).
    let listed = if u.never_sent {
        Ok(Listed::Absent)
    } else {
        provider
            .find_payment_intent(
                &u.claim.provider_customer,
                &u.idempotency_key,
                u.listed_since,
            )
            .await
    };
    // Whether the first request is known not to have executed: never sent,
    // or no intent carries the key's metadata (a legacy key has none, and an
    // unread listing did not look at them all).
    let first_ruled_out = u.never_sent
        || (matches!(listed, Ok(Listed::Absent)) && !provider::is_legacy_key(&u.idempotency_key));
    let searched = match listed {
        Ok(Listed::Found(found)) => return found,
        Err(why) => return why,
        _ if u.resend_ok => {
            let answer = provider
                .create_payment_intent(&batch::request(&started(u)))
                .await;
            return if first_ruled_out {
                answer
            } else {
                unproven_refusal(answer)
            };
        }
        Ok(Listed::Absent) => "no payment intent carries this attempt's key".to_owned(),
        Ok(Listed::Unread { read }) => format!(
            "none of the customer's {read} newest payment intents since this attempt carries \
             its key, and more were not read"
        ),
    };
    ChargeOutcome::NeedsReview {
        reason: format!(
            "{searched}; the key may be forgotten by the provider (first sent before the \
             resend window): sending it again could charge twice; check the provider's dashboard"
        ),
        raw: None,
        payment_intent: None,
    }
}

/// A resend's refusal where the first request may have executed: Stripe's
/// rate limiter and its checks of most invalid parameters run before its
/// idempotency layer, so they answer a key whose first request charged as
/// they would a new one (https://docs.stripe.com/error-low-level). A 400
/// or a missing payment method or customer then says nothing of the first
/// request: a person decides (docs/adr/0103), rather than the attempt being
/// written not charged, or declined, and the invoice charged again under a
/// new key.
fn unproven_refusal(answer: ChargeOutcome) -> ChargeOutcome {
    let refusal = match &answer {
        ChargeOutcome::Invalid { reason } => reason.clone(),
        ChargeOutcome::Declined {
            code,
            payment_intent: None,
        } if code == "resource_missing" => {
            "the payment method or customer is missing (resource_missing)".to_owned()
        }
        _ => return answer,
    };
    ChargeOutcome::NeedsReview {
        reason: format!(
            "the resend under the attempt's key was refused before the provider's idempotency \
             check ({refusal}), and the first request may have charged: check the provider's \
             dashboard"
        ),
        raw: None,
        payment_intent: None,
    }
}

/// An open attempt as the settling primitives take it.
fn started(u: &UnknownAttempt) -> Started {
    Started {
        claim: u.claim.clone(),
        attempt_id: u.attempt_id,
        attempt_seq: u.attempt_seq,
        key: u.idempotency_key.clone(),
        // The claim stamped `first_sent_at` on an attempt never sent: an
        // answer that says nothing was sent (a refused key, no call made)
        // takes the stamp back, as after auto-charge's own first send.
        first_send: u.never_sent,
    }
}

/// The unknown-outcome sweep as the driver sees it.
pub(crate) struct UnknownSweep<'a> {
    pub biller: &'a Biller,
    /// Closed by a refused key: no lookup is made for the rest of the tick.
    pub gate: &'a Gate,
    /// Attempts checked this tick: not listed again until the next.
    pub checked: scheduler::LeftOut,
}

impl FencedBatches for UnknownSweep<'_> {
    type Claim = Vec<UnknownAttempt>;
    type Counts = ReconcileTally;
    type Error = Error;

    fn role(&self) -> Role {
        Role::Billing
    }

    fn shape(&self) -> Shape {
        let c = &self.biller.inner.config;
        Shape {
            batch_size: c.batch_size.min(c.charge_concurrency * 8),
            budget: c.tick_budget,
            reserve: c.provider.as_ref().map(|p| p.timeout).unwrap_or_default(),
        }
    }

    async fn claim(&self, fence: &Fence, limit: usize) -> Result<Vec<UnknownAttempt>, Error> {
        let c = &self.biller.inner.config;
        if self.gate.closed() {
            return Ok(Vec::new());
        }
        let except = self.checked.ids();
        Ok(store::claim_unknown(
            &self.biller.inner.db,
            fence,
            limit,
            &except,
            &check_identity(fence),
            (c.charge_lease, c.resend_window),
            c.statement_timeout,
        )
        .await?)
    }

    fn claimed(batch: &Vec<UnknownAttempt>) -> usize {
        batch.len()
    }

    async fn run(
        &self,
        claimed: Vec<UnknownAttempt>,
        tick: &Tick,
        deadline: Instant,
        panics: &mut Panics,
        tally: &mut ReconcileTally,
    ) -> Result<(), Error> {
        let biller = self.biller;
        let c = &biller.inner.config;
        let call = c.provider.as_ref().map(|p| p.timeout).unwrap_or_default();
        let attempts: Vec<i64> = claimed.iter().map(|u| u.attempt_id).collect();
        self.checked.extend(attempts.iter().copied());
        let invoices: Vec<i64> = claimed.iter().map(|u| u.claim.invoice_id).collect();
        let claimed_by = claimed
            .first()
            .map(|u| u.claim.claimed_by.clone())
            .unwrap_or_default();
        let gate = self.gate;
        let results: Vec<(Started, Result<Option<ChargeOutcome>, Payload>)> = stream::iter(claimed)
            .map(|u| {
                let step = format!("{}/reconcile attempt {}", Role::Billing, u.attempt_id);
                let s = started(&u);
                let check = async move {
                    if Instant::now() + call > deadline
                        || tick.cancel.is_cancelled()
                        || gate.closed()
                    {
                        return None;
                    }
                    let outcome = look_up(biller, &u).await;
                    if matches!(outcome, ChargeOutcome::KeyRejected { .. }) {
                        gate.close();
                    }
                    Some(outcome)
                };
                async move { (s, catch(step, check).await) }
            })
            .buffer_unordered(c.charge_concurrency)
            .collect()
            .await;
        let mut answers = Vec::with_capacity(results.len());
        for (s, result) in &results {
            match result {
                Err(_) => tally.failed += 1,
                // Not looked up (out of time, cancelled, the key refused): a
                // never-sent attempt keeps "never sent" (docs/adr/0081), so
                // the chargeable rule decides its next send and its resend
                // window starts at a real send.
                Ok(None) if s.first_send => answers.push((s, Answer::NotSent)),
                Ok(None) => {}
                Ok(Some(outcome)) => answers.push((s, Answer::Called(outcome.clone()))),
            }
        }
        taken_by_operator(biller, &mut answers).await;
        let rows: Vec<(&Started, &Answer)> = answers.iter().map(|(s, a)| (*s, a)).collect();
        let settled = batch::settle_all(&biller.inner.db, &rows, biller.settling()).await;
        let t = &biller.inner.telemetry;
        let mut health = batch::ProviderHealth::default();
        for ((s, answer), settled) in rows.iter().zip(settled) {
            let attempt = s.attempt_id;
            let Answer::Called(outcome) = answer else {
                continue;
            };
            health.saw(outcome);
            let label = match (outcome, settled) {
                (_, Err(e)) => {
                    tally.failed += 1;
                    warn!(role = %Role::Billing, attempt, error = %e, "reconciling a charge failed");
                    "failed"
                }
                (_, Ok(Settled::Lost)) => {
                    tally.lost += 1;
                    "lost"
                }
                (_, Ok(Settled::Reviewed)) => {
                    tally.needs_review += 1;
                    "needs_review"
                }
                (ChargeOutcome::Succeeded { .. }, _) => {
                    tally.paid += 1;
                    info!(role = %Role::Billing, attempt, "open charge found paid; settled");
                    "paid"
                }
                (ChargeOutcome::Declined { code, .. }, _) => {
                    tally.declined += 1;
                    info!(role = %Role::Billing, attempt, decline_code = %code, "open charge found declined; recorded");
                    "declined"
                }
                (ChargeOutcome::Processing { .. }, _) => {
                    tally.processing += 1;
                    "processing"
                }
                (ChargeOutcome::Invalid { .. } | ChargeOutcome::NeedsReview { .. }, _) => {
                    tally.needs_review += 1;
                    "needs_review"
                }
                (ChargeOutcome::KeyRejected { .. }, _) => {
                    tally.still_unknown += 1;
                    "key_rejected"
                }
                (other, _) => {
                    tally.still_unknown += 1;
                    warn!(role = %Role::Billing, attempt, outcome = ?other, "charge outcome still unknown");
                    "still_unknown"
                }
            };
            t.counter(
                "hardcount_billing_reconciler_resolutions_total",
                &[("sweep", "unknown"), ("outcome", label)],
            )
            .increment(1);
        }
        // The panics are raised at the tick's end, after the others settled.
        for (_, result) in results {
            if let Err(payload) = result {
                panics.record(payload);
            }
        }
        // Every listed attempt is stamped, a panicked or unattempted one too,
        // so the sweep's order moves it behind the rows it would block.
        store::stamp_checked(
            &biller.inner.db,
            &attempts,
            &invoices,
            &claimed_by,
            c.statement_timeout,
        )
        .await?;
        health.verdict(biller)
    }
}

/// The stale-hold sweep as the driver sees it: claim and outcome are one statement.
pub(crate) struct StaleHolds<'a> {
    pub biller: &'a Biller,
}

impl FencedBatches for StaleHolds<'_> {
    type Claim = usize;
    type Counts = ReconcileTally;
    type Error = Error;

    fn role(&self) -> Role {
        Role::Billing
    }

    fn shape(&self) -> Shape {
        let c = &self.biller.inner.config;
        Shape {
            batch_size: c.batch_size,
            budget: c.tick_budget,
            reserve: Duration::ZERO,
        }
    }

    async fn claim(&self, fence: &Fence, limit: usize) -> Result<usize, Error> {
        let c = &self.biller.inner.config;
        let n = store::free_stale_holds(&self.biller.inner.db, fence, limit, c.statement_timeout)
            .await?;
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }

    fn claimed(batch: &usize) -> usize {
        *batch
    }

    async fn run(
        &self,
        batch: usize,
        _tick: &Tick,
        _deadline: Instant,
        _panics: &mut Panics,
        tally: &mut ReconcileTally,
    ) -> Result<(), Error> {
        tally.holds_freed += batch;
        self.biller
            .inner
            .telemetry
            .counter(
                "hardcount_billing_reconciler_resolutions_total",
                &[("sweep", "stale_hold"), ("outcome", "freed")],
            )
            .increment(batch as u64);
        Ok(())
    }
}

/// An answer found paid by an intent that an operator's settle already gave
/// another attempt goes to review instead: one charge pays one invoice, and
/// the operator's settle must be mended by a person. It happens only when an
/// operator named, for another invoice, the intent of this attempt before its
/// answer was read (docs/adr/0120). A declined answer with such an intent is
/// recorded as the decline it is (this invoice was not charged), and the log
/// says that the other invoice was paid by no charge. A processing one is
/// polled on until it is one or the other. If the check cannot be read, the
/// answers go on as they are (it fails open): it guards a person's slip, not
/// billing's own writes, and migration 0052's unique index of paid intents
/// still refuses a paid write that the check missed (docs/adr/0122).
async fn taken_by_operator(biller: &Biller, answers: &mut [(&Started, Answer)]) {
    let intents: Vec<String> = answers
        .iter()
        .filter_map(|(_, a)| answered_intent(a).map(|(i, _)| i.to_owned()))
        .collect();
    let c = &biller.inner.config;
    let taken = match store::operator_settled(&biller.inner.db, &intents, c.statement_timeout).await
    {
        Ok(taken) => taken,
        Err(e) => {
            warn!(role = %Role::Billing, error = %e, "could not check the answers against operators' settles");
            return;
        }
    };
    for (s, answer) in answers.iter_mut() {
        let Some((pi, paid)) = answered_intent(answer) else {
            continue;
        };
        let Some(t) = taken
            .iter()
            .find(|t| t.intent == pi && t.attempt != s.attempt_id)
        else {
            continue;
        };
        let (other, invoice) = (t.attempt, t.invoice);
        if !paid {
            warn!(role = %Role::Billing, attempt = s.attempt_id, other, invoice, payment_intent = %pi,
                  "an operator settled attempt {other} (invoice {invoice}) paid with this attempt's intent, which the provider declined: invoice {invoice} was paid by no charge and is collected by hand");
            continue;
        }
        let took = format!("an operator settled attempt {other} (invoice {invoice}) paid with it");
        let same_customer = t.customer.as_deref() == Some(s.claim.provider_customer.as_str());
        let reason = if same_customer {
            format!(
                "payment intent {pi} is this attempt's own charge, but {took}, so it counts for that invoice: one charge pays one invoice. If invoice {invoice}'s own attempt charged too (the intent whose metadata hardcount_attempt is that attempt's key), refund that charge at the provider; then settle this attempt --failed and its invoice is charged again"
            )
        } else {
            format!(
                "payment intent {pi} charged this attempt's customer, but {took}, which is another customer's invoice: refund {pi} at the provider, then settle this attempt --failed and its invoice is charged again; invoice {invoice} was not paid by its own customer and is collected by hand"
            )
        };
        warn!(role = %Role::Billing, attempt = s.attempt_id, other, invoice, "this attempt's charge was settled by an operator for another attempt; to review");
        *answer = Answer::Called(ChargeOutcome::NeedsReview {
            reason,
            raw: None,
            payment_intent: Some(pi.to_owned()),
        });
    }
}

/// The intent an answer names, and whether it says paid (else declined).
fn answered_intent(answer: &Answer) -> Option<(&str, bool)> {
    match answer {
        Answer::Called(ChargeOutcome::Succeeded { payment_intent }) => Some((payment_intent, true)),
        Answer::Called(ChargeOutcome::Declined {
            payment_intent: Some(payment_intent),
            ..
        }) => Some((payment_intent, false)),
        _ => None,
    }
}
