//! The `dunning` tick: enrolment, then the fenced-batch driver
//! ([`scheduler::drive`]) over due runs. Per batch: the final actions owed
//! and runs settled elsewhere (each its own transaction), the retries that
//! cannot be charged (counted in one transaction, no provider call), and the
//! charged retries (one transaction to count and claim, billing's calls, one
//! transaction for the outcomes, and its one-run-at-a-time fallback), each
//! run under the panic guard, a bounded number at once. The steps are in
//! their modules; this one splits a batch among them and counts what they did.

use std::sync::Arc;
use std::time::{Duration, Instant};

use db::{Db, Row, sql};
use futures::StreamExt;
use leader::{Fence, Role, Telemetry, Tick, TickEnd};
use payments::Collector;
use scheduler::{FencedBatches, Panics, Prunes, Pruning, Retention, Shape, Steps, Stop};
use tracing::{debug, info, warn};

use crate::ctx::Ctx;
use crate::listing::{self, LeftOut, Listing};
use crate::outcomes::{self, stopped};
use crate::run::{FinalActed, Outcome, Retry, Run};
use crate::{DunningConfig, Error, charge, enrol, final_action, not_attempted};

/// A batch with at least this many retries the provider did not answer, and
/// none it did, is taken for an outage: the tick stops as failed.
pub const OUTAGE_UNANSWERED: usize = 3;

/// What the retries of a tick came to.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally {
    pub recovered: usize,
    pub declined: usize,
    /// Due retries counted without a provider call (not chargeable).
    pub not_attempted: usize,
    /// Retries answered `processing`, and spent runs still waiting for their
    /// last retry's outcome: waiting, nothing rewound (docs/adr/0073).
    pub pending: usize,
    pub exhausted: usize,
    pub rewound: usize,
    /// Of the rewound: the provider gave no answer to rely on.
    pub unanswered: usize,
    pub stopped: usize,
    pub final_actions: usize,
    pub lost: usize,
    pub errors: usize,
    /// Runs whose retry panicked; rewound and left out of the rest of the tick.
    pub panicked: usize,
    /// Listed rows left out of the tick: a policy failing the schedule
    /// checks, or a row that did not decode (each logged with its run).
    pub left_out: usize,
}

/// What one tick did.
#[derive(Debug)]
pub struct TickReport {
    /// Invoices enrolled by this tick.
    pub enrolled: usize,
    pub batches: usize,
    pub claimed: usize,
    pub tally: Tally,
    pub elapsed: Duration,
    pub stop: Stop,
    /// How the lease is released (docs/adr/0007).
    pub end: TickEnd,
}

/// Retries dunning runs. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Dunner {
    ctx: Arc<Ctx>,
    /// When a tick prunes ([`Dunner::with_retention`]), if it does.
    pruning: Option<Arc<Pruning>>,
}

/// The `hardcount_dunning_attempts_total` outcomes that
/// deploy/prometheus/rules.yml reads, exported at 0 by [`Dunner::new`].
pub const OUTCOMES_ALERTED: [&str; 5] = ["succeeded", "declined", "processing", "unknown", "error"];

impl Dunner {
    /// `collector` charges the retries (billing, through the collection port).
    ///
    /// # Errors
    /// [`Error::Config`] naming a setting out of range.
    pub fn new(
        db: Db,
        config: DunningConfig,
        collector: Arc<dyn Collector>,
        telemetry: Telemetry,
    ) -> Result<Dunner, Error> {
        config.validate()?;
        // At 0 from the start, the series the alert takes increase() of: a
        // series born at its first retry had that retry unseen, and a new
        // leader's first answers did not hold HardcountDunningAttemptsFailing
        // (docs/adr/0141).
        for outcome in OUTCOMES_ALERTED {
            telemetry
                .counter("hardcount_dunning_attempts_total", &[("outcome", outcome)])
                .increment(0);
        }
        if !collector.has_provider() {
            info!(role = %Role::Dunning, "no payment provider configured (BILLING_PROVIDER_URL): dunning enrols declined invoices but retries nothing");
        }
        Ok(Dunner {
            ctx: Arc::new(Ctx {
                db,
                calls: tokio::sync::Semaphore::new(config.concurrency.max(1)),
                config,
                collector,
                telemetry,
            }),
            pruning: None,
        })
    }

    /// Prune (docs/adr/0040): a tick at most every `retention.every` ends by
    /// deleting the role's lease history older than `retention.lease_history`,
    /// a fenced batch per statement in a slice of the budget. Dunning runs are
    /// money and are never pruned; `retention.keep` is unused.
    #[must_use]
    pub fn with_retention(mut self, retention: Retention) -> Dunner {
        self.pruning = Some(Arc::new(Pruning::new(retention)));
        self
    }

    pub fn config(&self) -> &DunningConfig {
        &self.ctx.config
    }

    /// One tick: enrolment, then batches of due runs until none is due, the
    /// budget is spent, a listing fails or `tick.cancel` fires.
    ///
    /// # Panics
    /// When enrolment or a run's retry panicked, after every other due run
    /// was processed (so the lease is released as panicked).
    ///
    /// # Cancel safety
    /// `tick.cancel` is checked between batches and before each run's
    /// attempt. A retry dropped after its attempt was recorded leaves the run
    /// held until `attempt_hold` passes; the charge's attempt row is settled
    /// by billing's reconciler.
    pub async fn run_tick(&self, tick: &Tick) -> TickReport {
        let budget = self.ctx.config.tick_budget;
        let plan = self.pruning.as_ref().map(|p| p.plan(budget));
        let mut steps = Steps::until(
            tick,
            plan.map_or_else(|| Instant::now() + budget, |p| p.work_until),
        );
        let enrolled = steps
            .once("dunning/enrol", self.enrol(&tick.fence))
            .await
            .unwrap_or(0);
        let retries = Retries::new(self);
        // Without a provider nothing can be retried: enrolment only.
        let driven = if self.ctx.collector.has_provider() {
            steps.run("dunning/retries", &retries).await
        } else {
            None
        };
        let (batches, claimed, tally) = driven
            .map(|d| (d.batches, d.claimed, d.counts))
            .unwrap_or_default();
        let elapsed = steps.elapsed();
        let (stop, end) = steps.finish();
        if let (Some(plan), Some(pruning)) = (plan, self.pruning.as_deref())
            && let Some(mut prunes) = Prunes::of(&plan, pruning, tick, &self.ctx.telemetry)
        {
            prunes.lease_history(&self.ctx.db).await;
            prunes.finish();
        }
        TickReport {
            enrolled,
            batches,
            claimed,
            tally,
            elapsed,
            stop,
            end,
        }
    }

    /// Enrolment, fenced: a run for each open automatic invoice whose latest
    /// attempt was declined and that has none yet, with its tenant's default
    /// policy (created as the built-in default if the tenant has none).
    ///
    /// # Errors
    /// A database error or a refused event; nothing was enrolled.
    pub async fn enrol(&self, fence: &Fence) -> Result<usize, Error> {
        enrol::enrol(&self.ctx, fence).await
    }

    /// The fenced funnel: up to `limit` due runs (or runs owing their final
    /// action) with the snapshot their writes prove. Empty when `fence` is stale.
    ///
    /// # Errors
    /// A database error; nothing was listed.
    /// Rows left out (a bad policy, a row that does not decode) are logged
    /// and counted, not returned.
    pub async fn list_due(&self, fence: &Fence, limit: usize) -> Result<Vec<Run>, Error> {
        Ok(listing::list(&self.ctx, fence, limit, &[]).await?.runs)
    }

    /// Retry one listed run: the tick's batch path (`retry_batch`) for
    /// a batch of one. Not fenced: every write proves the run's status and
    /// attempt count as listed, so a stale or second worker writes nothing.
    ///
    /// # Errors
    /// A database error or a refused event or email. A recorded attempt
    /// without a definite answer was rewound (the run is as listed); one
    /// whose outcome could not be written is left counted and held, for the
    /// listing to write its outcome from its attempt (docs/adr/0120).
    ///
    /// # Panics
    /// When the retry panicked, after its attempt was rewound.
    pub async fn retry(&self, run: &Run) -> Result<Retry, Error> {
        let far = Instant::now() + Duration::from_secs(365 * 24 * 3600);
        let mut out = self.retry_runs(vec![run.clone()], far, || false).await;
        match out.pop().and_then(|(_, outcome)| outcome) {
            Some(Ok(result)) => result,
            Some(Err(payload)) => std::panic::resume_unwind(payload),
            None => Ok(Retry::Lost),
        }
    }

    /// Retry a listed batch (docs/adr/0017): per run, under the guard, what a
    /// decline would do is planned; then ONE transaction counts every run's
    /// attempt by its compare-and-set, has billing claim the invoices and
    /// record their attempts, and rewinds the runs that panicked or found
    /// their invoice held; then billing's calls (concurrent) and its one
    /// settling transaction; then one transaction recovers the paid runs,
    /// schedules or exhausts the declined ones and rewinds those without a
    /// definite answer. Final actions, and runs whose invoice was settled
    /// elsewhere, take their own transactions.
    ///
    /// Per run, in the batch's order: `None` when not started (out of budget,
    /// cancelled); else its result, or its panic (the attempt rewound).
    async fn retry_runs(
        &self,
        runs: Vec<Run>,
        deadline: Instant,
        cancelled: impl Fn() -> bool + Copy + Sync,
    ) -> Vec<(Run, Outcome)> {
        let c = &self.ctx.config;
        let reserve = self.ctx.call_reserve();
        let mut out: Vec<(Run, Outcome)> = Vec::with_capacity(runs.len());
        let (mut single, mut skip, mut charge) = (Vec::new(), Vec::new(), Vec::new());
        for run in runs {
            if Instant::now() + reserve > deadline || cancelled() {
                out.push((run, None));
            } else if run.status == "exhausted" || run.invoice_status != "open" {
                single.push(run);
            } else if run.not_chargeable.is_some() {
                skip.push(run);
            } else {
                charge.push(run);
            }
        }
        // Exhausted runs owing their final action, and runs whose invoice was
        // settled elsewhere: their own transactions, each under the guard.
        let singles: Vec<(Run, Outcome)> = futures::stream::iter(single)
            .map(|run| async move {
                let step = format!("dunning/run {} (tenant {})", run.id, run.tenant_id);
                let result = scheduler::catch(step, self.settled_elsewhere(&run)).await;
                (run, Some(result))
            })
            .buffer_unordered(c.concurrency.max(1))
            .collect()
            .await;
        out.extend(singles);
        if !skip.is_empty() {
            out.extend(not_attempted::count(&self.ctx, skip).await);
        }
        if !charge.is_empty() {
            out.extend(charge::charge_runs(&self.ctx, charge, deadline, cancelled).await);
        }
        out
    }

    /// A run that is not charged: its owed final action, or its end because
    /// the invoice was settled elsewhere.
    async fn settled_elsewhere(&self, run: &Run) -> Result<Retry, Error> {
        let (db, timeout) = (&self.ctx.db, self.ctx.config.statement_timeout);
        if run.status == "exhausted" {
            let notice = self.ctx.final_notice(run);
            let acted =
                final_action::final_action(db, &*self.ctx.collector, run, notice, timeout).await?;
            // Its invoice paid meanwhile (a held write-off's charge settled
            // paid): the step was not taken, the run ended recovered
            // (docs/adr/0147).
            if acted == FinalActed::Recovered {
                final_action::count_recovery(&self.ctx);
                return Ok(stopped(true, "paid"));
            }
            return Ok(Retry::FinalAction(acted));
        }
        let applied = outcomes::stop(db, run, &run.invoice_status, timeout).await?;
        // Paid meanwhile (a retry's charge found by billing's reconciler, or
        // paid by hand): the run ends recovered, and counts as one.
        if applied && run.invoice_status == "paid" {
            self.ctx
                .telemetry
                .counter("hardcount_dunning_recoveries_total", &[])
                .increment(1);
        }
        Ok(stopped(applied, &run.invoice_status))
    }

    /// Count a retried batch ([`retry_runs`](Dunner::retry_runs)). Returns
    /// the runs to leave out of the rest of the tick, and the error that ends
    /// the tick as failed: the provider refused this deployment's key
    /// (billing counted it; every run was rewound), or the batch looks like
    /// an outage (at least [`OUTAGE_UNANSWERED`] retries without an answer
    /// and none answered).
    fn count_batch(
        results: Vec<(Run, Outcome)>,
        panics: &mut Panics,
        tally: &mut Tally,
    ) -> (Vec<i64>, Option<Error>) {
        let mut left_out = Vec::new();
        let (mut answered, mut unanswered) = (0, 0);
        let mut rejected = None;
        for (run, result) in results {
            let Some(result) = result else { continue };
            let retry = match result {
                Err(payload) => {
                    // Rewound in the batch's own transactions.
                    tally.panicked += 1;
                    left_out.push(run.id);
                    panics.record(payload);
                    continue;
                }
                Ok(Err(e)) => {
                    tally.errors += 1;
                    left_out.push(run.id);
                    if let Error::Billing(payments::Error::ProviderKeyRejected { status }) = e {
                        rejected = Some(status);
                    }
                    warn!(role = %Role::Dunning, run = run.id, tenant = %run.tenant_id, error = %e, "retry failed");
                    continue;
                }
                Ok(Ok(retry)) => retry,
            };
            match retry {
                Retry::Recovered => {
                    tally.recovered += 1;
                    answered += 1;
                }
                Retry::Declined { .. } => {
                    tally.declined += 1;
                    answered += 1;
                }
                Retry::NotAttempted { .. } => tally.not_attempted += 1,
                // An answer, but not of the provider's health: neither side
                // of the outage test (a spent run's wait made no call).
                // Left out of the tick: one whose next retry is already past
                // would be listed again and only refused (its attempt holds
                // the invoice).
                Retry::Pending { .. } => {
                    tally.pending += 1;
                    left_out.push(run.id);
                }
                Retry::Exhausted { final_action, .. } => {
                    tally.exhausted += 1;
                    answered += 1;
                    // A held write-off is owed again: not in this tick, which
                    // would list it first and only hold it (docs/adr/0141).
                    if final_action == FinalActed::Held {
                        left_out.push(run.id);
                    }
                }
                Retry::Rewound {
                    why,
                    unanswered: no_answer,
                } => {
                    tally.rewound += 1;
                    if no_answer {
                        tally.unanswered += 1;
                        unanswered += 1;
                    }
                    left_out.push(run.id);
                    debug!(role = %Role::Dunning, run = run.id, why = %why, "no definite answer; attempt rewound");
                }
                Retry::Stopped { .. } => tally.stopped += 1,
                Retry::FinalAction(acted) => {
                    tally.final_actions += 1;
                    if acted == FinalActed::Held {
                        left_out.push(run.id);
                    }
                }
                Retry::Lost => {
                    tally.lost += 1;
                    left_out.push(run.id);
                }
            }
        }
        if let Some(status) = rejected {
            let e = payments::Error::ProviderKeyRejected { status };
            return (left_out, Some(Error::Billing(e)));
        }
        let outage = (unanswered >= OUTAGE_UNANSWERED && answered == 0)
            .then_some(Error::ProviderOutage { unanswered });
        (left_out, outage)
    }

    async fn refresh_gauges(&self) {
        match gauges(&self.ctx.db, self.ctx.config.statement_timeout).await {
            Ok((active, oldest_due_age, read_at)) => {
                let t = &self.ctx.telemetry;
                t.gauge("hardcount_dunning_active_runs", &[])
                    .set(active as f64);
                t.gauge("hardcount_dunning_oldest_due_age_seconds", &[])
                    .set(oldest_due_age);
                t.backlog_read(Role::Dunning, read_at);
            }
            Err(e) => {
                self.ctx.telemetry.backlog_read_failed(Role::Dunning);
                warn!(role = %Role::Dunning, error = %e, "dunning gauges not refreshed: they keep their last values")
            }
        }
    }
}

/// Active runs, the age of the oldest retry the listing would make now, and
/// when they were read (epoch seconds), for the gauges
/// ([`crate::listing::GAUGES`]).
async fn gauges(db: &Db, statement_timeout: Duration) -> Result<(i64, f64, f64), db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let row = tx.fetch_one(sql(crate::listing::GAUGES)).await?;
    tx.commit().await?;
    Ok((
        row.try_get("active")?,
        row.try_get("oldest_due_age")?,
        row.try_get("read_at")?,
    ))
}

/// Batches of retries in flight at once (docs/adr/0054): while one batch
/// calls the provider and settles, the next are listed and their calls
/// start. Their calls together stay within the collector's bound.
const IN_FLIGHT: usize = 3;

/// The retry step as the driver sees it. `left_out` holds runs this tick
/// will not list again (rewound, lost, failed, panicked, a bad policy, a row
/// that does not decode), so a run whose retry cannot finish cannot fill
/// every batch. A batch is retried by a task of its own, so the driver
/// lists the next meanwhile; `run` waits for the oldest once [`IN_FLIGHT`]
/// are running, and `finish` for the rest.
struct Retries<'a> {
    dunner: &'a Dunner,
    left_out: scheduler::LeftOut,
    /// Listed batches being retried by tasks of their own, each with its
    /// runs' ids (listed again by no claim while it runs).
    in_flight: scheduler::InFlight<Vec<(Run, Outcome)>, Vec<i64>>,
}

impl<'a> Retries<'a> {
    fn new(dunner: &'a Dunner) -> Retries<'a> {
        Retries {
            dunner,
            left_out: scheduler::LeftOut::default(),
            in_flight: scheduler::InFlight::new(IN_FLIGHT),
        }
    }

    /// Wait for batches (all, or those past the newest) and count them; the
    /// first error is the verdict.
    async fn collect(
        &self,
        all: bool,
        panics: &mut Panics,
        tally: &mut Tally,
    ) -> Result<(), Error> {
        let mut verdict = Ok(());
        for (_, results) in self.in_flight.wait(all).await {
            let (left_out, outage) = Dunner::count_batch(results, panics, tally);
            self.left_out.extend(left_out);
            if let (Some(e), Ok(())) = (outage, &verdict) {
                // Stop the tick as failed (short cooldown) rather than time
                // out on every due run, or call again with a refused key:
                // each was rewound, nothing is counted.
                verdict = Err(e);
            }
        }
        verdict
    }
}

impl FencedBatches for Retries<'_> {
    /// The listing: the driver counts every row listed (a full batch is
    /// followed by another claim), the runs are retried.
    type Claim = Listing;
    type Counts = Tally;
    type Error = Error;

    fn role(&self) -> Role {
        Role::Dunning
    }

    fn shape(&self) -> Shape {
        let c = &self.dunner.ctx.config;
        Shape {
            batch_size: c.batch_size,
            budget: c.tick_budget,
            reserve: self.dunner.ctx.call_reserve(),
        }
    }

    async fn claim(&self, fence: &Fence, limit: usize) -> Result<Listing, Error> {
        let mut except = self.left_out.ids();
        self.in_flight
            .with_meta(|batches| except.extend(batches.flat_map(|ids| ids.iter().copied())));
        let listing = listing::list(&self.dunner.ctx, fence, limit, &except).await?;
        self.left_out
            .extend(listing.left_out.iter().map(LeftOut::run));
        Ok(listing)
    }

    fn claimed(listing: &Listing) -> usize {
        listing.runs.len() + listing.left_out.len()
    }

    async fn run(
        &self,
        listing: Listing,
        tick: &Tick,
        deadline: Instant,
        panics: &mut Panics,
        tally: &mut Tally,
    ) -> Result<(), Error> {
        tally.left_out += listing.left_out.len();
        let batch = listing.runs;
        let ids = batch.iter().map(|r| r.id).collect();
        let (dunner, cancel) = (self.dunner.clone(), tick.cancel.clone());
        let task = tokio::spawn(async move {
            let cancel = &cancel;
            dunner
                .retry_runs(batch, deadline, move || cancel.is_cancelled())
                .await
        });
        self.in_flight.push(ids, task);
        self.collect(false, panics, tally).await
    }

    async fn finish(&self, panics: &mut Panics, tally: &mut Tally) -> Result<(), Error> {
        self.collect(true, panics, tally).await
    }

    async fn end_tick(&self, tick: &Tick) {
        if !tick.cancel.is_cancelled() {
            self.dunner.refresh_gauges().await;
        }
    }
}
