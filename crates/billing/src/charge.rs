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
//!                           (the batch: in the claim's transaction, one statement)
//!  POST /v1/payment_intents with that Idempotency-Key   (each under the panic guard)
//!      succeeded ─▶ invoice open → paid (claim still ours), attempt → succeeded,
//!                   invoice.paid + payment.succeeded + receipt email        (one transaction)
//!      declined  ─▶ attempt → declined(code), claim released,
//!                   payment.failed + payment-failed email                  (one transaction)
//!      unknown   ─▶ attempt stays unknown with its reason; the lease expires;
//!                   the reconciler asks the provider by key
//!  (the batch: every answer settled in one transaction, each row by its own CAS)
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use leader::{Fence, Role, Tick};
use scheduler::{FencedBatches, Panics, Payload, Shape};
use tracing::{info, warn};

use crate::batch::{self, Answer, Started};
use crate::provider::{self, ChargeOutcome, PaymentRequest};
use crate::store::{self, ChargeClaim, Settled};
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
    /// No answer to rely on; the attempt is left unknown for the reconciler.
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
    /// Attempts recorded but not sent (the budget ended, or the tick was
    /// cancelled, during the batch): their claims were given back and the
    /// reconciler sends each by its key.
    pub released: usize,
    pub panicked: usize,
}

/// One concurrently run item of a batch: its id, and its result (`None`:
/// not started, out of budget) or its panic.
pub(crate) type Guarded<T> = (i64, Result<Option<Result<T, Error>>, Payload>);

static CLAIMS: AtomicU64 = AtomicU64::new(0);

/// A claim identity no other claim shares: the fence's token, this process
/// and a per-process sequence.
fn claim_identity(fence: &Fence) -> String {
    let n = CLAIMS.fetch_add(1, Ordering::Relaxed);
    format!("billing:{}:{}:{n}", fence.token(), std::process::id())
}

impl Biller {
    /// The fenced auto-charge funnel: up to `limit` invoices, each under a
    /// fresh claim lease. Empty when `fence` is stale.
    ///
    /// # Errors
    /// A database error; nothing was claimed.
    pub async fn claim_charges(
        &self,
        fence: &Fence,
        limit: usize,
    ) -> Result<Vec<ChargeClaim>, Error> {
        let c = &self.inner.config;
        Ok(store::claim_charges(
            &self.inner.db,
            fence,
            limit,
            &claim_identity(fence),
            c.charge_lease,
            c.statement_timeout,
        )
        .await?)
    }

    /// Charge one claimed invoice and settle the answer.
    ///
    /// # Errors
    /// A database error or a refused event or email; the settling rolled
    /// back, and the attempt (if written) stays unknown for the reconciler.
    pub async fn charge(&self, claim: &ChargeClaim) -> Result<Charged, Error> {
        let Some(provider) = &self.inner.provider else {
            return Ok(Charged::NoProvider);
        };
        let c = &self.inner.config;
        let timeout = c.statement_timeout;
        let seq = AUTO_CHARGE_ATTEMPT;
        let key = provider::idempotency_key(claim.invoice_id, seq);
        let db = &self.inner.db;
        let Some(attempt) = store::start_attempt(db, claim, seq, &key, timeout).await? else {
            return Ok(Charged::ClaimLost);
        };
        let req = PaymentRequest {
            invoice_id: claim.invoice_id,
            amount: claim.amount,
            currency: claim.currency.clone(),
            customer: claim.provider_customer.clone(),
            payment_method: claim.payment_method.clone(),
        };
        let outcome = provider.create_payment_intent(&req, seq).await;
        let from = &c.email_from;
        Ok(match outcome {
            ChargeOutcome::Succeeded { payment_intent } => {
                match store::settle_paid(db, claim, attempt, seq, &payment_intent, from, timeout)
                    .await?
                {
                    Settled::Written => Charged::Paid { payment_intent },
                    Settled::Lost => Charged::ClaimLost,
                }
            }
            ChargeOutcome::Declined {
                code,
                payment_intent,
            } => {
                let pi = payment_intent.as_deref();
                match store::settle_declined(db, claim, attempt, seq, (&code, pi), from, timeout)
                    .await?
                {
                    Settled::Written => Charged::Declined { code },
                    Settled::Lost => Charged::ClaimLost,
                }
            }
            ChargeOutcome::Unknown { reason } => {
                store::note_unknown(db, attempt, &reason, timeout).await?;
                Charged::Unknown { reason }
            }
        })
    }
}

/// The auto-charge step as the driver sees it: per batch, one transaction
/// claims the invoices and records their attempts, the calls run
/// concurrently, and one transaction settles every answer (`crate::batch`).
pub(crate) struct AutoCharge<'a> {
    pub biller: &'a Biller,
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
        if b.provider.is_none() {
            return Ok(Vec::new());
        }
        Ok(store::claim_and_start(
            &b.db,
            fence,
            limit,
            &claim_identity(fence),
            c.charge_lease,
            c.statement_timeout,
        )
        .await?)
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
        let biller = self.biller;
        let c = &biller.inner.config;
        let Some(provider) = &biller.inner.provider else {
            return Ok(());
        };
        // Each call its own guarded step: one that panics ends only itself
        // (its attempt stays unknown for the reconciler, its lease expires).
        let called = batch::call_all(
            provider,
            batch,
            c.charge_concurrency,
            deadline,
            || tick.cancel.is_cancelled(),
            |s| format!("{}/charge invoice {}", Role::Billing, s.claim.invoice_id),
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
        let settled = batch::settle_all(
            &biller.inner.db,
            &answered,
            &c.email_from,
            c.statement_timeout,
        )
        .await;
        let t = &biller.inner.telemetry;
        let (mut calls, mut outages, mut last_outage) = (0, 0, String::new());
        for ((started, answer), settled) in answered.iter().zip(settled) {
            let invoice = started.claim.invoice_id;
            let label = match (answer, settled) {
                (Answer::NotSent, _) => {
                    tally.released += 1;
                    continue;
                }
                (_, Err(e)) => {
                    tally.unknown += 1;
                    warn!(role = %Role::Billing, invoice, error = %e, "charge not settled; left for the reconciler");
                    "error"
                }
                (Answer::Called(ChargeOutcome::Unknown { reason }), Ok(_)) => {
                    calls += 1;
                    tally.unknown += 1;
                    if provider::is_outage_reason(reason) {
                        outages += 1;
                        last_outage.clone_from(reason);
                    }
                    warn!(role = %Role::Billing, invoice, reason = %reason, "charge outcome unknown; left for the reconciler");
                    "unknown"
                }
                (Answer::Called(_), Ok(Settled::Lost)) => {
                    calls += 1;
                    tally.claim_lost += 1;
                    "claim_lost"
                }
                (Answer::Called(ChargeOutcome::Succeeded { .. }), Ok(Settled::Written)) => {
                    calls += 1;
                    tally.paid += 1;
                    "succeeded"
                }
                (Answer::Called(ChargeOutcome::Declined { code, .. }), Ok(Settled::Written)) => {
                    calls += 1;
                    tally.declined += 1;
                    info!(role = %Role::Billing, invoice, decline_code = %code, "charge declined");
                    "declined"
                }
            };
            t.counter("hardcount_billing_charges_total", &[("outcome", label)])
                .increment(1);
        }
        // The panics are raised at the tick's end, after the others settled.
        for (_, result) in called {
            if let Err(payload) = result {
                panics.record(payload);
            }
        }
        if calls > 0 && outages == calls {
            return Err(Error::ProviderOutage {
                calls,
                last: last_outage,
            });
        }
        Ok(())
    }
}
