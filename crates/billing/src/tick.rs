//! The `billing` tick: the fenced-batch driver ([`scheduler::drive`]) over due
//! subscriptions. Each subscription's closing is computed under the panic
//! guard; the ones that did not panic are closed together in one transaction.
//! A tick that prunes ([`Biller::with_retention`]) ends with the retention
//! prune (`retention.rs`).

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use leader::{Fence, Role, Tick, TickEnd};
use scheduler::{FencedBatches, LeftOut, Panics, Prunes, Shape, Steps, Stop};
use tracing::{debug, warn};

use crate::action_required::{ActionRequired, AskTally};
use crate::charge::{AutoCharge, ChargeTally};
use crate::close::{self, Due};
use crate::invoice::{self, Closed};
use crate::lifecycle::{LifecycleTally, Resumes, Trials};
use crate::reconcile::{ReconcileTally, StaleHolds, UnknownSweep};
use crate::retention::{IdempotencyKeys, RawAnswers};
use crate::store;
use crate::{Biller, Error};

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

/// The body of [`Biller::run_tick`].
pub(crate) async fn run_tick(biller: &Biller, tick: &Tick) -> TickReport {
    let budget = biller.inner.config.tick_budget;
    let plan = biller.pruning.as_ref().map(|p| p.plan(budget));
    let mut steps = Steps::until(
        tick,
        plan.map_or_else(|| Instant::now() + budget, |p| p.work_until),
    );
    let mut lifecycle = LifecycleTally::default();
    let mut add = |counts: &LifecycleTally| {
        lifecycle.trials_ended += counts.trials_ended;
        lifecycle.resumed += counts.resumed;
        lifecycle.lost += counts.lost;
        lifecycle.panicked += counts.panicked;
    };
    let trials = Trials {
        biller,
        left_out: LeftOut::default(),
    };
    if let Some(d) = steps.run("billing/trials", &trials).await {
        add(&d.counts);
    }
    let due_billing = DueBilling {
        biller,
        left_out: LeftOut::default(),
    };
    let (batches, claimed, tally) = steps
        .run("billing/due_billing", &due_billing)
        .await
        .map(|d| (d.batches, d.claimed, d.counts))
        .unwrap_or_default();
    // After the due billing: a period that ended before a pause's resume time
    // is closed under the pause first, and the pause of a subscription still
    // behind waits for the next tick (docs/adr/0110).
    let resumes = Resumes {
        biller,
        left_out: LeftOut::default(),
    };
    if let Some(d) = steps.run("billing/resumes", &resumes).await {
        add(&d.counts);
    }
    let (mut charge_claimed, mut charges) = (0, ChargeTally::default());
    let mut reconciled = ReconcileTally::default();
    let mut asked = AskTally::default();
    if biller.inner.provider.is_some() {
        // One refused key closes the gate: no other call this tick.
        let gate = std::sync::Arc::new(crate::batch::Gate::default());
        let auto_charge = AutoCharge::new(biller, &gate);
        if let Some(d) = steps.run("billing/auto_charge", &auto_charge).await {
            (charge_claimed, charges) = (d.claimed, d.counts);
        }
        let ask = ActionRequired { biller };
        if let Some(d) = steps.run("billing/action_required", &ask).await {
            asked = d.counts;
        }
        let unknown = UnknownSweep {
            biller,
            gate: &gate,
            checked: LeftOut::default(),
        };
        if let Some(d) = steps.run("billing/reconcile_unknown", &unknown).await {
            reconciled = d.counts;
        }
    }
    let stale = StaleHolds { biller };
    if let Some(d) = steps.run("billing/stale_holds", &stale).await {
        reconciled.holds_freed += d.counts.holds_freed;
    }
    // The gauges once every step has run: an attempt the charges or the
    // reconciler sent to review is counted by the tick that sent it, not an
    // interval later (read after the due billing, they missed both).
    if !tick.cancel.is_cancelled() {
        biller.refresh_gauges().await;
    }
    let elapsed = steps.elapsed();
    let (stop, end) = steps.finish();
    if let (Some(plan), Some(pruning)) = (plan, biller.pruning.as_deref())
        && let Some(mut prunes) = Prunes::of(&plan, pruning, tick, &biller.inner.telemetry)
    {
        prunes.run(&RawAnswers(biller)).await;
        prunes.run(&IdempotencyKeys(biller)).await;
        prunes.lease_history(&biller.inner.db).await;
        prunes.finish();
    }
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

/// The body of [`Biller::claim_due`].
pub(crate) async fn claim_due(
    biller: &Biller,
    fence: &Fence,
    limit: usize,
) -> Result<Vec<Due>, Error> {
    biller.claim_due_except(fence, limit, &[]).await
}

/// The body of [`Biller::claim_due_except`].
pub(crate) async fn claim_due_except(
    biller: &Biller,
    fence: &Fence,
    limit: usize,
    except: &[i64],
) -> Result<Vec<Due>, Error> {
    let timeout = biller.inner.config.statement_timeout;
    Ok(store::claim_due(
        &biller.inner.db,
        fence,
        &biller.inner.cursor,
        limit,
        except,
        timeout,
    )
    .await?
    .rows)
}

/// The body of [`Biller::undecodable`].
pub(crate) fn undecodable(biller: &Biller, step: &'static str, ids: &[i64]) {
    for id in ids {
        warn!(role = %Role::Billing, step, id, "row cannot be decoded (a timestamp out of range?); left out of this tick");
    }
    biller
        .inner
        .telemetry
        .counter(
            "hardcount_billing_rows_undecodable_total",
            &[("step", step)],
        )
        .increment(ids.len() as u64);
}

/// The body of [`Biller::writing`].
pub(crate) fn writing(biller: &Biller) -> invoice::Writing<'_> {
    invoice::Writing {
        email_from: &biller.inner.config.email_from,
        telemetry: &biller.inner.telemetry,
        statement_timeout: biller.inner.config.statement_timeout,
    }
}

/// The body of [`Biller::close_period`].
pub(crate) async fn close_period(biller: &Biller, due: &Due) -> Result<Closed, Error> {
    let closing = close::close(due)?;
    let outcomes = invoice::close_periods(&biller.inner.db, &[closing], biller.writing()).await?;
    Ok(outcomes
        .first()
        .map(|(_, c)| *c)
        .unwrap_or(Closed::PeriodMoved))
}

/// The body of [`Biller::close_batch`].
pub(crate) async fn close_batch(
    biller: &Biller,
    batch: Vec<Due>,
    at: DateTime<Utc>,
    panics: &mut Panics,
    tally: &mut Tally,
) -> Result<Vec<i64>, Error> {
    let claimed: Vec<i64> = batch.iter().map(|d| d.subscription_id).collect();
    let max = biller.inner.config.catch_up_periods;
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
    let outcomes = invoice::close_periods(&biller.inner.db, &closings, biller.writing()).await?;
    let t = &biller.inner.telemetry;
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

/// The body of [`Biller::key_rejected`].
pub(crate) fn key_rejected(biller: &Biller, status: u16, message: String) -> Error {
    biller
        .inner
        .telemetry
        .counter("hardcount_billing_provider_key_rejected_total", &[])
        .increment(1);
    tracing::error!(role = %Role::Billing, status, reason = %message, "the payment provider refused the secret key; no charge or lookup for the rest of the tick");
    Error::ProviderKeyRejected { status }
}

/// The body of [`Biller::refresh_gauges`].
pub(crate) async fn refresh_gauges(biller: &Biller) {
    match store::backlog(&biller.inner.db, biller.inner.config.statement_timeout).await {
        Ok(b) => {
            let t = &biller.inner.telemetry;
            t.gauge("hardcount_billing_due_subscriptions", &[])
                .set(b.due as f64);
            t.gauge("hardcount_billing_oldest_due_age_seconds", &[])
                .set(b.oldest_due_age);
            t.gauge("hardcount_billing_payment_attempts_needing_review", &[])
                .set(b.needs_review as f64);
            t.gauge("hardcount_billing_payment_attempts_processing", &[])
                .set(b.processing as f64);
            t.backlog_read(Role::Billing, b.read_at);
        }
        Err(e) => {
            biller.inner.telemetry.backlog_read_failed(Role::Billing);
            warn!(role = %Role::Billing, error = %e, "billing backlog gauges not refreshed: they keep their last values")
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
        let listed = store::claim_due(
            &b.db,
            fence,
            &b.cursor,
            limit,
            &except,
            b.config.statement_timeout,
        )
        .await?;
        self.biller.undecodable("due_billing", &listed.undecodable);
        self.left_out.extend(listed.undecodable.iter().copied());
        Ok(listed)
    }

    fn claimed(batch: &store::Listed<Due>) -> usize {
        batch.rows.len() + batch.undecodable.len()
    }

    /// The listing visits at most `TENANTS_PER_CLAIM` tenants a claim and
    /// gives each a share of the batch (docs/adr/0048): with more tenants
    /// due, or shares that do not divide the batch, it comes back short
    /// while subscriptions wait. Drained only when a listing finds nothing,
    /// or the next tick would be an interval (an hour by default) away
    /// (docs/adr/0067). Rows the tick cannot close are left out of later
    /// listings (`left_out`), so the loop ends.
    fn short_batch_drains(&self) -> bool {
        false
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
}
