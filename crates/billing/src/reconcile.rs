//! The payment reconciler, the last step of the billing tick: two sweeps.
//!
//! ```text
//!  unknown   attempts 'unknown' of open invoices whose claim is free or expired,
//!            least recently checked first, AND leader_fence   (fenced; claims the invoice)
//!            per attempt, concurrently, each under the panic guard:
//!              the same POST with the same Idempotency-Key and parameters
//!              (the lookup by key, docs/adr/0012)
//!                succeeded ─▶ settle_paid: invoice.paid, payment.succeeded, receipt
//!                declined  ─▶ settle_declined: payment.failed, payment-failed email
//!                otherwise ─▶ stays unknown (its reason noted)
//!            then every checked attempt is stamped (last_checked_at), a panicked
//!            one too, and the claims given back: one bad row rotates to the back
//!  stale     auto-charge claims past their expiry freed, longest expired first
//!            (one fenced statement per batch)
//! ```
//!
//! An attempt is only looked up once its invoice's claim lease has expired
//! (the lease outlives the call by construction), so a lookup never races the
//! call it looks up. A refusal of the key (`idempotency_error`: the stored
//! request had other parameters) is not a decline: the first request may have
//! charged, so the attempt stays unknown and is flagged in `last_error`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::stream::{self, StreamExt};
use leader::{Fence, Role, Tick};
use scheduler::{FencedBatches, Panics, Shape, catch};
use tracing::{info, warn};

use crate::charge::Guarded;
use crate::provider::{self, ChargeOutcome, PaymentRequest};
use crate::store::{self, Settled, UnknownAttempt};
use crate::{Biller, Error};

/// What the reconciler came to over a tick.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReconcileTally {
    /// Unknown attempts found charged and settled as paid.
    pub paid: usize,
    /// Unknown attempts found declined and recorded.
    pub declined: usize,
    /// Still unknown after the lookup (stamped, tried again later).
    pub still_unknown: usize,
    /// Settled by someone else first: nothing written.
    pub lost: usize,
    /// Checks that panicked: counted as failed, their rows stamped.
    pub failed: usize,
    /// Expired auto-charge claims freed by the stale-hold sweep.
    pub holds_freed: usize,
}

/// How one unknown attempt's lookup ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    Paid,
    Declined { code: String },
    StillUnknown { reason: String },
    Lost,
}

static CHECKS: AtomicU64 = AtomicU64::new(0);

fn check_identity(fence: &Fence) -> String {
    let n = CHECKS.fetch_add(1, Ordering::Relaxed);
    format!("reconciler:{}:{}:{n}", fence.token(), std::process::id())
}

impl Biller {
    /// Look up one unknown attempt by its key and settle what the provider says.
    async fn resolve(&self, u: &UnknownAttempt) -> Result<Resolution, Error> {
        let Some(provider) = &self.inner.provider else {
            return Ok(Resolution::StillUnknown {
                reason: "no provider configured".into(),
            });
        };
        let c = &self.inner.config;
        let (db, timeout, from) = (&self.inner.db, c.statement_timeout, &c.email_from);
        let claim = &u.claim;
        let req = PaymentRequest {
            invoice_id: claim.invoice_id,
            amount: claim.amount,
            currency: claim.currency.clone(),
            customer: claim.provider_customer.clone(),
            payment_method: claim.payment_method.clone(),
        };
        let (attempt, seq) = (u.attempt_id, u.attempt_seq);
        let outcome = provider
            .payment_intent_with_key(&req, &u.idempotency_key)
            .await;
        let settled = match outcome {
            ChargeOutcome::Succeeded { payment_intent } => {
                store::settle_paid(db, claim, attempt, seq, &payment_intent, from, timeout).await?
            }
            ChargeOutcome::Declined { code, .. } if code == "idempotency_error" => {
                let reason = "the provider refused the key with these parameters: \
                              settle by hand (the first request may have charged)"
                    .to_owned();
                store::note_unknown(db, attempt, &reason, timeout).await?;
                return Ok(Resolution::StillUnknown { reason });
            }
            ChargeOutcome::Declined {
                code,
                payment_intent,
            } => {
                let pi = payment_intent.as_deref();
                match store::settle_declined(db, claim, attempt, seq, (&code, pi), from, timeout)
                    .await?
                {
                    Settled::Written => return Ok(Resolution::Declined { code }),
                    Settled::Lost => Settled::Lost,
                }
            }
            ChargeOutcome::Unknown { reason } => {
                store::note_unknown(db, attempt, &reason, timeout).await?;
                return Ok(Resolution::StillUnknown { reason });
            }
        };
        Ok(match settled {
            Settled::Written => Resolution::Paid,
            Settled::Lost => Resolution::Lost,
        })
    }
}

/// The unknown-outcome sweep as the driver sees it.
pub(crate) struct UnknownSweep<'a> {
    pub biller: &'a Biller,
    /// Attempts checked this tick: not listed again until the next.
    pub checked: std::sync::Mutex<Vec<i64>>,
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
        let except = self
            .checked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        Ok(store::claim_unknown(
            &self.biller.inner.db,
            fence,
            limit,
            &except,
            &check_identity(fence),
            c.charge_lease,
            c.statement_timeout,
        )
        .await?)
    }

    fn claimed(batch: &Vec<UnknownAttempt>) -> usize {
        batch.len()
    }

    async fn run(
        &self,
        batch: Vec<UnknownAttempt>,
        tick: &Tick,
        deadline: Instant,
        panics: &mut Panics,
        tally: &mut ReconcileTally,
    ) -> Result<(), Error> {
        let biller = self.biller;
        let c = &biller.inner.config;
        let call = c.provider.as_ref().map(|p| p.timeout).unwrap_or_default();
        let attempts: Vec<i64> = batch.iter().map(|u| u.attempt_id).collect();
        self.checked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(&attempts);
        let invoices: Vec<i64> = batch.iter().map(|u| u.claim.invoice_id).collect();
        let claimed_by = batch
            .first()
            .map(|u| u.claim.claimed_by.clone())
            .unwrap_or_default();
        let results: Vec<Guarded<Resolution>> = stream::iter(batch)
            .map(|u| {
                let step = format!("{}/reconcile attempt {}", Role::Billing, u.attempt_id);
                let id = u.attempt_id;
                let check = async move {
                    if Instant::now() + call > deadline || tick.cancel.is_cancelled() {
                        return None;
                    }
                    Some(biller.resolve(&u).await)
                };
                async move { (id, catch(step, check).await) }
            })
            .buffer_unordered(c.charge_concurrency)
            .collect()
            .await;
        let t = &biller.inner.telemetry;
        let (mut calls, mut outages, mut last_outage) = (0, 0, String::new());
        for (attempt, result) in results {
            let label = match result {
                Err(payload) => {
                    tally.failed += 1;
                    panics.record(payload);
                    "failed"
                }
                Ok(None) => continue,
                Ok(Some(Ok(Resolution::Paid))) => {
                    calls += 1;
                    tally.paid += 1;
                    info!(role = %Role::Billing, attempt, "unknown charge found paid; settled");
                    "paid"
                }
                Ok(Some(Ok(Resolution::Declined { code }))) => {
                    calls += 1;
                    tally.declined += 1;
                    info!(role = %Role::Billing, attempt, decline_code = %code, "unknown charge found declined; recorded");
                    "declined"
                }
                Ok(Some(Ok(Resolution::StillUnknown { reason }))) => {
                    calls += 1;
                    tally.still_unknown += 1;
                    if provider::is_outage_reason(&reason) {
                        outages += 1;
                        last_outage.clone_from(&reason);
                    }
                    warn!(role = %Role::Billing, attempt, reason = %reason, "charge outcome still unknown");
                    "still_unknown"
                }
                Ok(Some(Ok(Resolution::Lost))) => {
                    tally.lost += 1;
                    "lost"
                }
                Ok(Some(Err(e))) => {
                    tally.failed += 1;
                    warn!(role = %Role::Billing, attempt, error = %e, "reconciling a charge failed");
                    "failed"
                }
            };
            t.counter(
                "hardcount_billing_reconciler_resolutions_total",
                &[("sweep", "unknown"), ("outcome", label)],
            )
            .increment(1);
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
        if calls > 0 && outages == calls {
            return Err(Error::ProviderOutage {
                calls,
                last: last_outage,
            });
        }
        Ok(())
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
