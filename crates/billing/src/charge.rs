//! Auto-charge, a step of the billing tick after due billing: open automatic
//! invoices never attempted are claimed (a lease per invoice, fenced funnel),
//! an attempt row is written before the provider call, and the answer is
//! settled by compare-and-set while the claim still holds the invoice. The
//! tick does this a batch at a time (`crate::batch`, docs/adr/0017);
//! [`Biller::charge`] is the same for one claimed invoice.
//!
//! ```text
//!  claim ≤ batch invoices   status open, automatic, lease free or expired, no attempt,
//!                           AND leader_fence('billing', $token) → lease = now() + charge_lease
//!  INSERT attempt 1 (unknown, key = (invoice, 1))   only while the claim holds it
//!                           (the batch: the claim's own statement, which leases and
//!                           counts only the invoices whose attempt it wrote)
//!  POST /v1/payment_intents with that Idempotency-Key   (each under the panic guard)
//!      succeeded ─▶ invoice open → paid (claim still ours), attempt → succeeded,
//!                   invoice.paid + payment.succeeded + receipt email        (one transaction)
//!      declined  ─▶ attempt → declined(code), claim released,
//!                   payment.failed + payment-failed email                  (one transaction)
//!      unknown   ─▶ attempt stays unknown with its reason; the lease expires;
//!                   the reconciler asks the provider by key
//!  (the batch: every answer settled in one transaction, each row by its own CAS)
//! ```

pub(crate) mod store;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Instant;

use leader::{Fence, Role, Tick};
use scheduler::{FencedBatches, Panics, Shape};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::batch::{self, Answer, Started};
use crate::batch::{ChargeClaim, Settled};
use crate::provider::ChargeOutcome;
use crate::{Biller, Error};

/// Auto-charge's attempt sequence: the first attempt of an invoice. Later
/// attempts (dunning's retries) take the next numbers.
pub const AUTO_CHARGE_ATTEMPT: i32 = 1;

/// What became of one claimed invoice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Charged {
    /// Charged; the invoice is paid and announced.
    Paid { payment_intent: String },
    /// Declined; recorded with its code and announced.
    Declined { code: String },
    /// No answer to rely on; the attempt is left unknown for the reconciler
    /// (or, for an invoice closed during the call, for an operator's review).
    Unknown { reason: String },
    /// The claim no longer held the invoice (or the attempt existed): not
    /// charged, or charged but left for the reconciler to settle.
    ClaimLost,
    /// No provider is configured.
    NoProvider,
}

/// What auto-charge came to over a tick.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ChargeTally {
    pub paid: usize,
    pub declined: usize,
    pub unknown: usize,
    pub claim_lost: usize,
    /// Accepted and not settled yet (bank debits): polled by the reconciler.
    pub processing: usize,
    /// Refused as invalid or unreadable: waiting for an operator.
    pub needs_review: usize,
    /// Attempts recorded but not sent (the budget ended, or the tick was
    /// cancelled, during the batch; the key was refused; the send was
    /// refused with 429): their claims were given back and the reconciler
    /// sends each by its key.
    pub released: usize,
    pub panicked: usize,
}

static CLAIMS: AtomicU64 = AtomicU64::new(0);

/// A claim identity no other claim shares: the fence's token, this process
/// and a per-process sequence.
fn claim_identity(fence: &Fence) -> String {
    let n = CLAIMS.fetch_add(1, Ordering::Relaxed);
    format!("billing:{}:{}:{n}", fence.token(), std::process::id())
}

/// The body of [`Biller::claim_charges`].
pub(crate) async fn claim_charges(
    biller: &Biller,
    fence: &Fence,
    limit: usize,
) -> Result<Vec<ChargeClaim>, Error> {
    let c = &biller.inner.config;
    Ok(store::claim_charges(
        &biller.inner.db,
        fence,
        limit,
        &claim_identity(fence),
        c.charge_lease,
        c.statement_timeout,
    )
    .await?)
}

/// The body of [`Biller::charge`].
pub(crate) async fn charge(biller: &Biller, claim: &ChargeClaim) -> Result<Charged, Error> {
    let Some(provider) = &biller.inner.provider else {
        return Ok(Charged::NoProvider);
    };
    let c = &biller.inner.config;
    let db = &biller.inner.db;
    let Some(started) = store::start_attempt(
        db,
        claim,
        AUTO_CHARGE_ATTEMPT,
        &c.instance_id,
        c.statement_timeout,
    )
    .await?
    else {
        return Ok(Charged::ClaimLost);
    };
    let outcome = provider
        .create_payment_intent(&batch::request(&started))
        .await;
    let answer = Answer::Called(outcome.clone());
    let settled = batch::settle_all(db, &[(&started, &answer)], biller.settling())
        .await
        .pop()
        .unwrap_or(Ok(Settled::Lost))?;
    Ok(match (outcome, settled) {
        (_, Settled::Lost) => Charged::ClaimLost,
        (_, Settled::Reviewed) => Charged::Unknown {
            reason: batch::CLOSED_FOR_REVIEW.to_owned(),
        },
        (ChargeOutcome::Succeeded { payment_intent }, _) => Charged::Paid { payment_intent },
        (ChargeOutcome::Declined { code, .. }, _) => Charged::Declined { code },
        (other, _) => Charged::Unknown {
            reason: format!("{other:?}"),
        },
    })
}

/// The body of [`Biller::settling`].
pub(crate) fn settling(biller: &Biller) -> batch::Settling<'_> {
    let c = &biller.inner.config;
    batch::Settling {
        email_from: &c.email_from,
        telemetry: &biller.inner.telemetry,
        statement_timeout: c.statement_timeout,
        backoff: c.reconcile_backoff,
    }
}

/// Batches of auto-charge in flight at once (docs/adr/0054): while one
/// batch calls the provider and settles, the next are claimed and their
/// calls start, so the database works while calls wait on the provider and
/// the other way round. Measured: 1.7 times the charges a second with two,
/// 1.9 with three, no more with four or six. The calls of all of them
/// together stay within `charge_concurrency`.
pub(crate) const IN_FLIGHT: usize = 3;

/// The auto-charge step as the driver sees it: per batch, one transaction
/// claims the invoices and records their attempts, the calls run
/// concurrently, and one transaction settles every answer (`crate::batch`).
/// The calls and the settle of a batch run as a task of their own, so the
/// driver claims the next batch meanwhile; `run` waits for the oldest once
/// [`IN_FLIGHT`] are running, and `finish` for the rest.
pub(crate) struct AutoCharge<'a> {
    pub biller: &'a Biller,
    /// Closed by a refused key: the rest of the tick makes no call.
    pub gate: &'a Arc<batch::Gate>,
    /// `charge_concurrency` permits, shared by the batches in flight.
    calls: Arc<Semaphore>,
    /// The batches still calling or settling, oldest first.
    in_flight: scheduler::InFlight<BatchDone>,
    /// The last invoice id a batch of this tick claimed: the next claim walks
    /// on from it, so the invoices the funnel passes over are read once a
    /// tick (docs/adr/0064).
    after: AtomicI64,
}

impl<'a> AutoCharge<'a> {
    pub(crate) fn new(biller: &'a Biller, gate: &'a Arc<batch::Gate>) -> AutoCharge<'a> {
        AutoCharge {
            biller,
            gate,
            calls: Arc::new(Semaphore::new(
                biller.inner.config.charge_concurrency.max(1),
            )),
            in_flight: scheduler::InFlight::new(IN_FLIGHT),
            after: AtomicI64::new(0),
        }
    }

    /// Wait for finished batches (all, or those past the newest) and count
    /// them into the tick's; the first error is the verdict on the provider.
    async fn collect(
        &self,
        all: bool,
        panics: &mut Panics,
        tally: &mut ChargeTally,
    ) -> Result<(), Error> {
        let mut verdict = Ok(());
        for ((), done) in self.in_flight.wait(all).await {
            tally.add(&done.tally);
            for payload in done.panics {
                panics.record(payload);
            }
            if verdict.is_ok() {
                verdict = done.verdict;
            }
        }
        verdict
    }
}

/// What one batch's task came to.
struct BatchDone {
    tally: ChargeTally,
    /// Calls that panicked: raised at the tick's end, after the others settled.
    panics: Vec<scheduler::Payload>,
    verdict: Result<(), Error>,
}

impl ChargeTally {
    fn add(&mut self, o: &ChargeTally) {
        self.paid += o.paid;
        self.declined += o.declined;
        self.unknown += o.unknown;
        self.claim_lost += o.claim_lost;
        self.processing += o.processing;
        self.needs_review += o.needs_review;
        self.released += o.released;
        self.panicked += o.panicked;
    }
}

impl FencedBatches for AutoCharge<'_> {
    type Claim = Vec<Started>;
    type Counts = ChargeTally;
    type Error = Error;

    fn role(&self) -> Role {
        Role::Billing
    }

    fn shape(&self) -> Shape {
        let c = &self.biller.inner.config;
        Shape {
            // Calls run `charge_concurrency` at a time; a batch of at most eight
            // rounds keeps each claim's lease well past its calls.
            batch_size: c.batch_size.min(c.charge_concurrency * 8),
            budget: c.tick_budget,
            // One provider call must fit before the budget ends.
            reserve: c.provider.as_ref().map(|p| p.timeout).unwrap_or_default(),
        }
    }

    async fn claim(&self, fence: &Fence, limit: usize) -> Result<Vec<Started>, Error> {
        let b = &self.biller.inner;
        let c = &b.config;
        if b.provider.is_none() || self.gate.closed() {
            return Ok(Vec::new());
        }
        let started = store::claim_and_start(
            &b.db,
            fence,
            limit,
            &claim_identity(fence),
            (c.charge_lease, &c.instance_id),
            self.after.load(Ordering::Relaxed),
            c.statement_timeout,
        )
        .await?;
        if let Some(last) = started.iter().map(|s| s.claim.invoice_id).max() {
            self.after.fetch_max(last, Ordering::Relaxed);
        }
        Ok(started)
    }

    fn claimed(batch: &Vec<Started>) -> usize {
        batch.len()
    }

    async fn run(
        &self,
        batch: Vec<Started>,
        tick: &Tick,
        deadline: Instant,
        panics: &mut Panics,
        tally: &mut ChargeTally,
    ) -> Result<(), Error> {
        let task = tokio::spawn(charge_batch(
            self.biller.clone(),
            Arc::clone(self.gate),
            Arc::clone(&self.calls),
            batch,
            tick.cancel.clone(),
            deadline,
        ));
        self.in_flight.push((), task);
        self.collect(false, panics, tally).await
    }

    async fn finish(&self, panics: &mut Panics, tally: &mut ChargeTally) -> Result<(), Error> {
        self.collect(true, panics, tally).await
    }
}

/// One claimed batch: its calls (each its own guarded step: one that panics
/// ends only itself, its attempt stays unknown for the reconciler and its
/// lease expires), then the settling of every answer.
async fn charge_batch(
    biller: Biller,
    gate: Arc<batch::Gate>,
    calls: Arc<Semaphore>,
    batch: Vec<Started>,
    cancel: CancellationToken,
    deadline: Instant,
) -> BatchDone {
    let mut tally = ChargeTally::default();
    let Some(provider) = &biller.inner.provider else {
        return BatchDone {
            tally,
            panics: Vec::new(),
            verdict: Ok(()),
        };
    };
    let called = batch::call_all(
        provider,
        batch,
        &calls,
        deadline,
        || cancel.is_cancelled(),
        |s| format!("{}/charge invoice {}", Role::Billing, s.claim.invoice_id),
        &gate,
    )
    .await;
    let mut answered = Vec::with_capacity(called.len());
    for (started, result) in &called {
        match result {
            Ok(answer) => answered.push((started, answer)),
            Err(_) => {
                tally.panicked += 1;
                biller
                    .inner
                    .telemetry
                    .counter(
                        "hardcount_billing_charges_total",
                        &[("outcome", "panicked")],
                    )
                    .increment(1);
            }
        }
    }
    let settled = batch::settle_all(&biller.inner.db, &answered, biller.settling()).await;
    let t = &biller.inner.telemetry;
    let mut health = batch::ProviderHealth::default();
    for ((started, answer), settled) in answered.iter().zip(settled) {
        let invoice = started.claim.invoice_id;
        let Answer::Called(outcome) = answer else {
            tally.released += 1;
            continue;
        };
        health.saw(outcome);
        let label = match (outcome, settled) {
            (_, Err(e)) => {
                tally.unknown += 1;
                warn!(role = %Role::Billing, invoice, error = %e, "charge not settled; left for the reconciler");
                "error"
            }
            (ChargeOutcome::KeyRejected { .. }, Ok(_)) => {
                tally.released += 1;
                "key_rejected"
            }
            (_, Ok(Settled::Lost)) => {
                tally.claim_lost += 1;
                "claim_lost"
            }
            (_, Ok(Settled::Reviewed)) => {
                tally.needs_review += 1;
                "needs_review"
            }
            (ChargeOutcome::Succeeded { .. }, Ok(Settled::Written)) => {
                tally.paid += 1;
                "succeeded"
            }
            (ChargeOutcome::Declined { code, .. }, Ok(Settled::Written)) => {
                tally.declined += 1;
                info!(role = %Role::Billing, invoice, decline_code = %code, "charge declined");
                "declined"
            }
            (ChargeOutcome::Processing { .. }, Ok(Settled::Written)) => {
                tally.processing += 1;
                "processing"
            }
            (
                ChargeOutcome::Invalid { .. } | ChargeOutcome::NeedsReview { .. },
                Ok(Settled::Written),
            ) => {
                tally.needs_review += 1;
                "needs_review"
            }
            // Refused before execution: nothing sent, the claim given back,
            // the reconciler sends it after `Retry-After` (docs/adr/0091).
            (
                ChargeOutcome::RetryLater {
                    in_flight: false, ..
                },
                Ok(Settled::Written),
            ) if started.first_send => {
                tally.released += 1;
                "rate_limited"
            }
            (other, Ok(Settled::Written)) => {
                tally.unknown += 1;
                warn!(role = %Role::Billing, invoice, outcome = ?other, "charge outcome unknown; left for the reconciler");
                "unknown"
            }
        };
        t.counter("hardcount_billing_charges_total", &[("outcome", label)])
            .increment(1);
    }
    let panics = called
        .into_iter()
        .filter_map(|(_, result)| result.err())
        .collect();
    BatchDone {
        tally,
        panics,
        verdict: health.verdict(&biller),
    }
}
