//! The `billing` tick: the fenced-batch driver ([`scheduler::drive`]) over due
//! subscriptions. Each subscription's closing is computed under the panic
//! guard; the ones that did not panic are closed together in one transaction.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use db::Db;
use leader::{Fence, Role, Telemetry, Tick, TickEnd};
use scheduler::{FencedBatches, LeftOut, Panics, Shape, Steps, Stop};
use tracing::{debug, info, warn};

use crate::action_required::{ActionRequired, AskTally};
use crate::charge::{AutoCharge, ChargeTally};
use crate::close::{self, Due};
use crate::invoice::{self, Closed};
use crate::lifecycle::{LifecycleTally, Resumes, Trials};
use crate::provider::Provider;
use crate::reconcile::{ReconcileTally, StaleHolds, UnknownSweep};
use crate::store;
use crate::{BillingConfig, Error};

/// What the closings of a tick came to.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally {
    /// Periods closed, each with its invoice and `invoice.finalized` event.
    pub invoiced: usize,
    /// Closings refused by the compare-and-set: another writer moved the period.
    pub period_moved: usize,
    /// Closings whose (subscription, period start) was already invoiced.
    pub already_invoiced: usize,
    /// Subscriptions whose closing panicked; left out of the rest of the tick.
    pub panicked: usize,
}

/// What one tick did.
#[derive(Debug)]
pub struct TickReport {
    /// Trials ended and pause-collections resumed.
    pub lifecycle: LifecycleTally,
    /// Batches that claimed at least one subscription.
    pub batches: usize,
    /// Due subscriptions claimed over the tick (one closing each; a
    /// subscription several periods behind is claimed once per period).
    pub claimed: usize,
    pub tally: Tally,
    /// Invoices auto-charge claimed, and what became of them (zero when no
    /// provider is configured).
    pub charge_claimed: usize,
    pub charges: ChargeTally,
    /// Customers asked for a payment method (`action_required`).
    pub asked: AskTally,
    /// What the payment reconciler resolved.
    pub reconciled: ReconcileTally,
    pub elapsed: Duration,
    /// Why the tick stopped claiming.
    pub stop: Stop,
    /// How the lease is released (docs/adr/0007).
    pub end: TickEnd,
}

/// Closes due billing periods. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Biller {
    pub(crate) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) db: Db,
    pub(crate) config: BillingConfig,
    pub(crate) telemetry: Telemetry,
    /// `None` when no provider is configured: the charge step is skipped.
    pub(crate) provider: Option<Provider>,
}

impl Biller {
    /// # Errors
    /// [`Error::Config`] naming a setting out of range.
    pub fn new(db: Db, config: BillingConfig, telemetry: Telemetry) -> Result<Biller, Error> {
        config.validate()?;
        let provider = match &config.provider {
            Some(p) => Some(Provider::new(p.clone()).map_err(crate::ConfigError::ProviderClient)?),
            None => {
                info!(role = %Role::Billing, "no payment provider configured (BILLING_PROVIDER_URL): the auto-charge step is skipped");
                None
            }
        };
        Ok(Biller {
            inner: Arc::new(Inner {
                db,
                config,
                telemetry,
                provider,
            }),
        })
    }

    pub fn config(&self) -> &BillingConfig {
        &self.inner.config
    }

    /// One tick of the role: its steps in order ([`scheduler::Steps`]), each
    /// a driven pass under the panic guard (a panic in one still lets the
    /// later ones run, and is raised after the last), all of them within the
    /// one `tick_budget`: expired trials, lifted pause-collection resumes, due
    /// billing, auto-charge, the payment-method request, then the payment
    /// reconciler's unknown-outcome and stale-hold sweeps (auto-charge, the
    /// request and the unknown-outcome sweep only when a provider is
    /// configured). Due billing closes batches of due subscriptions, a
    /// subscription several periods behind once per period, oldest first. A
    /// step that starts with the budget spent claims nothing and the tick is
    /// due again at once.
    ///
    /// The tick ends as its worst step did: [`TickEnd::Failed`] (a claim or a
    /// write failed, or the provider is down), then [`TickEnd::MoreWork`]
    /// (the budget ran out), else drained.
    ///
    /// # Panics
    /// When a step or a row panicked, after every other step ran (so the
    /// lease is released as panicked).
    ///
    /// # Cancel safety
    /// `tick.cancel` is checked between batches. A batch's close is one
    /// transaction: dropped mid-way it rolls back, and its subscriptions stay due.
    pub async fn run_tick(&self, tick: &Tick) -> TickReport {
        let mut steps = Steps::new(tick, self.inner.config.tick_budget);
        let mut lifecycle = LifecycleTally::default();
        let trials = Trials {
            biller: self,
            left_out: LeftOut::default(),
        };
        let resumes = Resumes {
            biller: self,
            left_out: LeftOut::default(),
        };
        for d in [
            steps.run("billing/trials", &trials).await,
            steps.run("billing/resumes", &resumes).await,
        ]
        .into_iter()
        .flatten()
        {
            lifecycle.trials_ended += d.counts.trials_ended;
            lifecycle.resumed += d.counts.resumed;
            lifecycle.lost += d.counts.lost;
            lifecycle.panicked += d.counts.panicked;
        }
        let due_billing = DueBilling {
            biller: self,
            left_out: LeftOut::default(),
        };
        let (batches, claimed, tally) = steps
            .run("billing/due_billing", &due_billing)
            .await
            .map(|d| (d.batches, d.claimed, d.counts))
            .unwrap_or_default();
        let (mut charge_claimed, mut charges) = (0, ChargeTally::default());
        let mut reconciled = ReconcileTally::default();
        let mut asked = AskTally::default();
        if self.inner.provider.is_some() {
            // One refused key closes the gate: no other call this tick.
            let gate = crate::batch::Gate::default();
            let auto_charge = AutoCharge {
                biller: self,
                gate: &gate,
            };
            if let Some(d) = steps.run("billing/auto_charge", &auto_charge).await {
                (charge_claimed, charges) = (d.claimed, d.counts);
            }
            let ask = ActionRequired { biller: self };
            if let Some(d) = steps.run("billing/action_required", &ask).await {
                asked = d.counts;
            }
            let unknown = UnknownSweep {
                biller: self,
                gate: &gate,
                checked: LeftOut::default(),
            };
            if let Some(d) = steps.run("billing/reconcile_unknown", &unknown).await {
                reconciled = d.counts;
            }
        }
        let stale = StaleHolds { biller: self };
        if let Some(d) = steps.run("billing/stale_holds", &stale).await {
            reconciled.holds_freed += d.counts.holds_freed;
        }
        let elapsed = steps.elapsed();
        let (stop, end) = steps.finish();
        TickReport {
            lifecycle,
            batches,
            claimed,
            tally,
            charge_claimed,
            charges,
            asked,
            reconciled,
            elapsed,
            stop,
            end,
        }
    }

    /// The fenced funnel: up to `limit` due subscriptions with the snapshot
    /// their closing will prove. Empty when nothing is due or `fence` is stale.
    ///
    /// # Errors
    /// A database error; nothing was claimed.
    pub async fn claim_due(&self, fence: &Fence, limit: usize) -> Result<Vec<Due>, Error> {
        self.claim_due_except(fence, limit, &[]).await
    }

    async fn claim_due_except(
        &self,
        fence: &Fence,
        limit: usize,
        except: &[i64],
    ) -> Result<Vec<Due>, Error> {
        let timeout = self.inner.config.statement_timeout;
        Ok(
            store::claim_due(&self.inner.db, fence, limit, except, timeout)
                .await?
                .rows,
        )
    }

    /// Rows a claim could not decode (an `infinity` timestamp written before
    /// the CHECKs, say): each logged by id and counted; the caller leaves
    /// them out of the rest of the tick.
    pub(crate) fn undecodable(&self, step: &'static str, ids: &[i64]) {
        for id in ids {
            warn!(role = %Role::Billing, step, id, "row cannot be decoded (a timestamp out of range?); left out of this tick");
        }
        self.inner
            .telemetry
            .counter(
                "hardcount_billing_rows_undecodable_total",
                &[("step", step)],
            )
            .increment(ids.len() as u64);
    }

    /// How a period writer writes: the sender of receipts and the timeout.
    pub(crate) fn writing(&self) -> invoice::Writing<'_> {
        invoice::Writing {
            email_from: &self.inner.config.email_from,
            telemetry: &self.inner.telemetry,
            statement_timeout: self.inner.config.statement_timeout,
        }
    }

    /// Close `due`'s current period from the snapshot it holds: advance the
    /// period by compare-and-set, create its invoice and enqueue
    /// `invoice.finalized`, in one transaction. Not fenced: the
    /// compare-and-set and the dedup index stop a stale or second closer.
    ///
    /// # Errors
    /// [`Error::Unbillable`] when the period cannot be computed (nothing
    /// written); a database error (rolled back, nothing written).
    pub async fn close_period(&self, due: &Due) -> Result<Closed, Error> {
        let closing = close::close(due)?;
        let outcomes = invoice::close_periods(&self.inner.db, &[closing], self.writing()).await?;
        Ok(outcomes
            .first()
            .map(|(_, c)| *c)
            .unwrap_or(Closed::PeriodMoved))
    }

    /// Close a batch: each closing computed under `panics` (a subscription
    /// whose closing panics is returned in the left-out list), the rest in
    /// one transaction.
    async fn close_batch(
        &self,
        batch: Vec<Due>,
        at: DateTime<Utc>,
        panics: &mut Panics,
        tally: &mut Tally,
    ) -> Result<Vec<i64>, Error> {
        let claimed: Vec<i64> = batch.iter().map(|d| d.subscription_id).collect();
        let max = self.inner.config.catch_up_periods;
        let chains = panics
            .drain(
                batch,
                |d| format!("close subscription {}", d.subscription_id),
                |d| async move {
                    // A row billing cannot compute is corrupt: raise it under the
                    // guard, which leaves it out, bills the rest and pages
                    // (the tick is released as panicked) — docs/adr/0010.
                    match close::close_behind(&d, at, max) {
                        Ok(c) => c,
                        Err(e) => panic!(
                            "subscription {} (tenant {}) cannot be billed: {e}",
                            d.subscription_id, d.tenant_id
                        ),
                    }
                },
            )
            .await;
        let mut left_out: Vec<i64> = claimed
            .iter()
            .copied()
            .filter(|id| !chains.iter().any(|c| c[0].subscription_id == *id))
            .collect();
        tally.panicked += left_out.len();
        // Still behind after `catch_up_periods`: the rest next tick.
        left_out.extend(
            chains
                .iter()
                .filter(|c| c.len() >= max && c.last().is_some_and(|l| !l.ends && l.next_end <= at))
                .map(|c| c[0].subscription_id),
        );
        let closings: Vec<close::Closing> = chains.into_iter().flatten().collect();
        let outcomes = invoice::close_periods(&self.inner.db, &closings, self.writing()).await?;
        let t = &self.inner.telemetry;
        for (subscription, outcome) in outcomes {
            let label = match outcome {
                Closed::Invoiced { .. } => {
                    tally.invoiced += 1;
                    t.counter(
                        "hardcount_billing_invoices_created_total",
                        &[("source", "tick")],
                    )
                    .increment(1);
                    "invoiced"
                }
                Closed::Advanced => "advanced",
                Closed::PeriodMoved => {
                    tally.period_moved += 1;
                    debug!(role = %Role::Billing, subscription, "period moved under the closing; nothing written");
                    "period_moved"
                }
                Closed::AlreadyInvoiced => {
                    tally.already_invoiced += 1;
                    // Still due, and would be listed again at once: leave it out.
                    left_out.push(subscription);
                    warn!(role = %Role::Billing, subscription, "period already invoiced but not advanced; left out of this tick");
                    "already_invoiced"
                }
            };
            t.counter("hardcount_billing_closes_total", &[("outcome", label)])
                .increment(1);
        }
        Ok(left_out)
    }

    /// A refused key: counted (the alert `HardcountPaymentProviderKeyRejected`
    /// fires on it), logged once for the tick, and the tick's error.
    pub(crate) fn key_rejected(&self, status: u16, message: String) -> Error {
        self.inner
            .telemetry
            .counter("hardcount_billing_provider_key_rejected_total", &[])
            .increment(1);
        tracing::error!(role = %Role::Billing, status, reason = %message, "the payment provider refused the secret key; no charge or lookup for the rest of the tick");
        Error::ProviderKeyRejected { status }
    }

    async fn refresh_gauges(&self) {
        match store::backlog(&self.inner.db, self.inner.config.statement_timeout).await {
            Ok(b) => {
                let t = &self.inner.telemetry;
                t.gauge("hardcount_billing_due_subscriptions", &[])
                    .set(b.due as f64);
                t.gauge("hardcount_billing_oldest_due_age_seconds", &[])
                    .set(b.oldest_due_age);
                t.gauge("hardcount_billing_payment_attempts_needing_review", &[])
                    .set(b.needs_review as f64);
                t.gauge("hardcount_billing_payment_attempts_processing", &[])
                    .set(b.processing as f64);
            }
            Err(e) => {
                debug!(role = %Role::Billing, error = %e, "billing backlog gauges not refreshed")
            }
        }
    }
}

/// The due-billing step as the driver sees it. `left_out` holds the
/// subscriptions this tick will not list again (their closing panicked, or
/// their period is already invoiced), so one bad row cannot fill every batch.
struct DueBilling<'a> {
    biller: &'a Biller,
    left_out: LeftOut,
}

impl FencedBatches for DueBilling<'_> {
    type Claim = store::Listed<Due>;
    type Counts = Tally;
    type Error = Error;

    fn role(&self) -> Role {
        Role::Billing
    }

    fn shape(&self) -> Shape {
        let c = &self.biller.inner.config;
        Shape {
            batch_size: c.batch_size,
            budget: c.tick_budget,
            // A batch is one close transaction under the statement timeout.
            reserve: Duration::ZERO,
        }
    }

    async fn claim(&self, fence: &Fence, limit: usize) -> Result<store::Listed<Due>, Error> {
        let except = self.left_out.ids();
        let b = &self.biller.inner;
        let listed =
            store::claim_due(&b.db, fence, limit, &except, b.config.statement_timeout).await?;
        self.biller.undecodable("due_billing", &listed.undecodable);
        self.left_out.extend(listed.undecodable.iter().copied());
        Ok(listed)
    }

    fn claimed(batch: &store::Listed<Due>) -> usize {
        batch.rows.len() + batch.undecodable.len()
    }

    async fn run(
        &self,
        batch: store::Listed<Due>,
        _tick: &Tick,
        _deadline: Instant,
        panics: &mut Panics,
        tally: &mut Tally,
    ) -> Result<(), Error> {
        // A chain closes the periods that had ended on the database's clock.
        let at = batch.at.unwrap_or_else(Utc::now);
        let left_out = self
            .biller
            .close_batch(batch.rows, at, panics, tally)
            .await?;
        self.left_out.extend(left_out);
        Ok(())
    }

    async fn end_tick(&self, tick: &Tick) {
        if !tick.cancel.is_cancelled() {
            self.biller.refresh_gauges().await;
        }
    }
}
