//! The `dunning` tick: enrolment, then the fenced-batch driver
//! ([`scheduler::drive`]) over due runs. Per batch: the final actions owed
//! and runs settled elsewhere (each its own transaction), the retries that
//! cannot be charged (counted in one transaction, no provider call), and the
//! charged retries (one transaction to count and claim, billing's calls, one
//! transaction for the outcomes, and its one-run-at-a-time fallback), each
//! run under the panic guard, a bounded number at once.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use billing::{Biller, NotCharged, Retried, RetryRequest, StartedRetry};
use chrono::{DateTime, Utc};
use db::Db;
use futures::StreamExt;
use leader::{Fence, Role, Telemetry, Tick, TickEnd};
use scheduler::{FencedBatches, Panics, Shape, Stop};
use tracing::{debug, info, warn};

use crate::notices::{self, final_notice, not_attempted, sender, warning};
use crate::policy::AfterDecline;
use crate::store::{self, FinalActed, LeftOut, NotChargeable, Run};
use crate::{DunningConfig, Error};

/// A batch with at least this many retries the provider did not answer, and
/// none it did, is taken for an outage: the tick stops as failed.
pub const OUTAGE_UNANSWERED: usize = 3;

/// Final actions of a batch run at once, each its own transaction.
pub const FINAL_ACTIONS_AT_ONCE: usize = 8;

/// What one listed run of a batch came to: `None` when it was not started
/// (out of budget, cancelled); else its result, or its panic.
type Outcome = Option<Result<Result<Retry, Error>, scheduler::Payload>>;

/// What became of one listed run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Retry {
    /// The retry paid the invoice; the run is recovered.
    Recovered,
    /// A definite decline; the next retry is scheduled.
    Declined { code: String },
    /// The retry could not be charged (no payment method, or a hard decline
    /// on the payment method the customer still has): counted without a
    /// provider call, the next retry scheduled.
    NotAttempted { why: NotChargeable },
    /// The last retry was declined (`code`: its decline code) or not attempted
    /// (`code`: why); the run is exhausted and its final action ran.
    Exhausted {
        code: String,
        final_action: FinalActed,
    },
    /// No definite answer (timeout, 5xx, a lost or held claim, an error):
    /// the attempt was rewound, the run is as it was listed. `unanswered`:
    /// the provider was asked and gave no answer to rely on.
    Rewound { why: String, unanswered: bool },
    /// The invoice was settled elsewhere; the run ended without a charge.
    Stopped { invoice_status: String },
    /// An exhausted run's owed final action ran (after a crash between the
    /// exhaustion and its action).
    FinalAction(FinalActed),
    /// Another worker moved the run first (its attempt compare-and-set, or a
    /// transition, found another count): nothing written.
    Lost,
}

/// What the retries of a tick came to.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally {
    pub recovered: usize,
    pub declined: usize,
    /// Due retries counted without a provider call (not chargeable).
    pub not_attempted: usize,
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
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    db: Db,
    config: DunningConfig,
    biller: Biller,
    telemetry: Telemetry,
}

impl Dunner {
    /// `biller` charges the retries (its provider, charge lease and email sender).
    ///
    /// # Errors
    /// [`Error::Config`] naming a setting out of range.
    pub fn new(
        db: Db,
        config: DunningConfig,
        biller: Biller,
        telemetry: Telemetry,
    ) -> Result<Dunner, Error> {
        config.validate()?;
        if biller.config().provider.is_none() {
            info!(role = %Role::Dunning, "no payment provider configured (BILLING_PROVIDER_URL): dunning enrols declined invoices but retries nothing");
        }
        Ok(Dunner {
            inner: Arc::new(Inner {
                db,
                config,
                biller,
                telemetry,
            }),
        })
    }

    pub fn config(&self) -> &DunningConfig {
        &self.inner.config
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
        let started = Instant::now();
        let enrolled = scheduler::catch("dunning/enrol".to_owned(), self.enrol(&tick.fence)).await;
        let retries = Retries {
            dunner: self,
            left_out: Mutex::new(Vec::new()),
        };
        // Without a provider nothing can be retried: enrolment only.
        let driven = if self.inner.biller.config().provider.is_some() {
            scheduler::catch(
                "dunning/retries".to_owned(),
                scheduler::drive(&retries, tick),
            )
            .await
        } else {
            Ok(scheduler::Driven {
                end: TickEnd::Drained,
                stop: Stop::Drained,
                batches: 0,
                claimed: 0,
                elapsed: Duration::ZERO,
                counts: Tally::default(),
            })
        };
        let (enrolled, driven) = match (enrolled, driven) {
            (Err(payload), _) | (_, Err(payload)) => std::panic::resume_unwind(payload),
            (Ok(e), Ok(d)) => (e, d),
        };
        let (mut stop, mut end) = (driven.stop, driven.end);
        let enrolled = match enrolled {
            Ok(n) => n,
            Err(e) => {
                warn!(role = %Role::Dunning, error = %e, "enrolment failed; retries ran");
                if !matches!(end, TickEnd::Failed(_)) {
                    stop = Stop::Failed(e.to_string());
                    end = stop.tick_end();
                }
                0
            }
        };
        TickReport {
            enrolled,
            batches: driven.batches,
            claimed: driven.claimed,
            tally: driven.counts,
            elapsed: started.elapsed(),
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
        let c = &self.inner.config;
        let n = store::enrol(&self.inner.db, fence, c.enrol_limit, c.statement_timeout).await?;
        if n > 0 {
            self.inner
                .telemetry
                .counter("hardcount_dunning_enrolled_total", &[])
                .increment(n as u64);
        }
        Ok(n)
    }

    /// The fenced funnel: up to `limit` due runs (or runs owing their final
    /// action) with the snapshot their writes prove. Empty when `fence` is stale.
    ///
    /// # Errors
    /// A database error; nothing was listed.
    /// Rows left out (a bad policy, a row that does not decode) are logged
    /// and counted, not returned.
    pub async fn list_due(&self, fence: &Fence, limit: usize) -> Result<Vec<Run>, Error> {
        Ok(self.list_due_except(fence, limit, &[]).await?.runs)
    }

    async fn list_due_except(
        &self,
        fence: &Fence,
        limit: usize,
        except: &[i64],
    ) -> Result<store::Listing, Error> {
        let timeout = self.inner.config.statement_timeout;
        let listing = store::list_due(&self.inner.db, fence, limit, except, timeout).await?;
        let t = &self.inner.telemetry;
        for left in &listing.left_out {
            match left {
                LeftOut::Policy {
                    run,
                    tenant_id,
                    policy_id,
                } => {
                    warn!(role = %Role::Dunning, tenant = %tenant_id, policy = policy_id, run, "dunning policy fails the schedule checks (a NULL or out-of-range offset or warning); its runs are skipped until it is mended");
                    t.counter("hardcount_dunning_policies_skipped_total", &[])
                        .increment(1);
                }
                LeftOut::Undecodable { run, error } => {
                    warn!(role = %Role::Dunning, run, error = %error, "dunning run row does not decode; left out of the tick");
                    t.counter("hardcount_dunning_rows_undecodable_total", &[])
                        .increment(1);
                }
            }
        }
        Ok(listing)
    }

    /// Retry one listed run: the tick's batch path (`retry_batch`) for
    /// a batch of one. Not fenced: every write proves the run's status and
    /// attempt count as listed, so a stale or second worker writes nothing.
    ///
    /// # Errors
    /// A database error or a refused event or email; a recorded attempt
    /// was rewound (the run is as listed).
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
        cancelled: impl Fn() -> bool + Copy,
    ) -> Vec<(Run, Outcome)> {
        let c = &self.inner.config;
        let reserve = self.call_reserve();
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
            out.extend(self.count_not_attempted(skip).await);
        }
        if !charge.is_empty() {
            out.extend(self.charge_runs(charge, deadline, cancelled).await);
        }
        out
    }

    /// A run that is not charged: its owed final action, or its end because
    /// the invoice was settled elsewhere.
    async fn settled_elsewhere(&self, run: &Run) -> Result<Retry, Error> {
        let (db, timeout) = (&self.inner.db, self.inner.config.statement_timeout);
        if run.status == "exhausted" {
            let notice = self.final_notice(run);
            return Ok(Retry::FinalAction(
                store::final_action(db, &self.inner.biller, run, notice, timeout).await?,
            ));
        }
        Ok(stopped(
            store::stop(db, run, &run.invoice_status, timeout).await?,
            &run.invoice_status,
        ))
    }

    /// The final notice of `run`'s final action, if its policy sends one;
    /// queued by the action's transaction only if the action changed something.
    fn final_notice(&self, run: &Run) -> Option<email_outbox::Email> {
        let from = sender(run, &self.inner.config.email_from);
        let notice = run.policy.final_notice.then(|| final_notice(run, from));
        self.sendable(run, notice)
    }

    /// `email` as the outbox takes it (a tenant's sender that does not parse
    /// replaced by the configured one), or `None`, logged and counted, when
    /// the outbox would still refuse it: the transition goes on without it
    /// rather than roll back a retry the provider answered.
    fn sendable(
        &self,
        run: &Run,
        email: Option<email_outbox::Email>,
    ) -> Option<email_outbox::Email> {
        match notices::sendable(email?, &self.inner.config.email_from) {
            Ok(email) => Some(email),
            Err(e) => {
                warn!(role = %Role::Dunning, run = run.id, tenant = %run.tenant_id, error = %e, "dunning email refused; the transition goes on without it");
                self.inner
                    .telemetry
                    .counter("hardcount_dunning_emails_refused_total", &[])
                    .increment(1);
                None
            }
        }
    }

    /// Due retries that cannot be charged (no payment method, or a hard
    /// decline on the payment method the customer still has): per run, under
    /// the guard, the next retry from the policy (or exhaustion) and the
    /// warning; then ONE transaction counts them all by the attempt
    /// compare-and-set (`store::not_attempted_in`); then each exhausted run's
    /// final action. No provider call.
    async fn count_not_attempted(&self, runs: Vec<Run>) -> Vec<(Run, Outcome)> {
        let c = &self.inner.config;
        let t = &self.inner.telemetry;
        let mut exhausted: Vec<(&Run, String)> = Vec::new();
        let mut out: HashMap<i64, Outcome> = HashMap::with_capacity(runs.len());
        let mut rows: Vec<store::NotAttempted<'_>> = Vec::new();
        for run in &runs {
            let Some(why) = run.not_chargeable else {
                continue;
            };
            let attempt = run.attempt_count + 1;
            let step = format!("dunning/run {} (tenant {})", run.id, run.tenant_id);
            let prepared = scheduler::catch(step, async {
                match run.policy.after_decline(run.first_declined_at, attempt) {
                    AfterDecline::Next { at } => {
                        let from = sender(run, &c.email_from);
                        let email = run
                            .policy
                            .warns_after(attempt)
                            .then(|| not_attempted(run, from, why, at));
                        (Some(at), email)
                    }
                    AfterDecline::Exhausted => (None, None),
                }
            })
            .await;
            match prepared {
                Ok((next, email)) => rows.push(store::NotAttempted {
                    run,
                    why,
                    next,
                    email: self.sendable(run, email),
                }),
                Err(payload) => {
                    out.insert(run.id, Some(Err(payload)));
                }
            }
        }
        let counted = async {
            let mut tx = self
                .inner
                .db
                .begin_with_timeout(c.statement_timeout)
                .await?;
            let won = store::not_attempted_in(&mut tx, &rows).await?;
            tx.commit().await?;
            Ok::<_, Error>(won)
        };
        match counted.await {
            Err(e) => {
                // Rolled back: nothing counted, the runs are as listed.
                warn!(role = %Role::Dunning, error = %e, runs = rows.len(), "retries not attempted were not counted");
                let why = e.to_string();
                for n in &rows {
                    let e = Error::NotCounted(why.clone());
                    out.insert(n.run.id, Some(Ok(Err(e))));
                }
            }
            Ok(won) => {
                for n in rows {
                    let id = n.run.id;
                    if !won.contains(&id) {
                        out.insert(id, Some(Ok(Ok(Retry::Lost))));
                        continue;
                    }
                    t.counter(
                        "hardcount_dunning_attempts_total",
                        &[("outcome", "not_attempted")],
                    )
                    .increment(1);
                    match n.next {
                        Some(_) => {
                            out.insert(id, Some(Ok(Ok(Retry::NotAttempted { why: n.why }))));
                        }
                        None => exhausted.push((n.run, n.why.as_str().to_owned())),
                    }
                }
            }
        }
        out.extend(self.all_exhausted(exhausted).await);
        runs.into_iter()
            .map(|run| {
                let outcome = out.remove(&run.id).unwrap_or(None);
                (run, outcome)
            })
            .collect()
    }

    /// [`exhausted`](Dunner::exhausted) for each run, [`FINAL_ACTIONS_AT_ONCE`]
    /// at a time (a group waits for its slowest): each final action is its own short transaction on its own
    /// subscription's row (two on one subscription wait on its lock).
    async fn all_exhausted(&self, runs: Vec<(&Run, String)>) -> Vec<(i64, Outcome)> {
        if runs.is_empty() {
            return Vec::new();
        }
        // First all in one transaction; on an error or a panic, each on its own.
        let (db, timeout) = (&self.inner.db, self.inner.config.statement_timeout);
        let step = format!("dunning/final actions of {} runs", runs.len());
        let batch = scheduler::catch(step, async {
            let items: Vec<(&Run, Option<email_outbox::Email>)> = runs
                .iter()
                .map(|(run, _)| (*run, self.final_notice(run)))
                .collect();
            store::final_actions(db, &self.inner.biller, &items, timeout).await
        })
        .await;
        match batch {
            Ok(Ok(acted)) => {
                return runs
                    .into_iter()
                    .zip(acted)
                    .map(|((run, code), final_action)| {
                        self.count_exhaustion(run);
                        (
                            run.id,
                            Some(Ok(Ok(Retry::Exhausted { code, final_action }))),
                        )
                    })
                    .collect();
            }
            Ok(Err(e)) => {
                warn!(role = %Role::Dunning, error = %e, runs = runs.len(), "final actions of the batch not written together; each on its own")
            }
            Err(_) => {
                warn!(role = %Role::Dunning, runs = runs.len(), "final actions of the batch panicked together; each on its own")
            }
        }
        let mut done = Vec::with_capacity(runs.len());
        for chunk in runs.chunks(FINAL_ACTIONS_AT_ONCE) {
            let mut acting = Vec::with_capacity(chunk.len());
            for (run, code) in chunk {
                acting.push(self.exhausted(run, code.clone()));
            }
            let results = futures::future::join_all(acting).await;
            for ((run, _), r) in chunk.iter().zip(results) {
                done.push((run.id, Some(r)));
            }
        }
        done
    }

    fn count_exhaustion(&self, run: &Run) {
        let action = run.policy.final_action.as_str();
        self.inner
            .telemetry
            .counter(
                "hardcount_dunning_exhaustions_total",
                &[("final_action", action)],
            )
            .increment(1);
    }

    /// A run just exhausted: counted, and its final action's step run under
    /// the guard (stamped once; a crash before it is finished by the next
    /// tick's funnel).
    async fn exhausted(
        &self,
        run: &Run,
        code: String,
    ) -> Result<Result<Retry, Error>, scheduler::Payload> {
        self.count_exhaustion(run);
        let step = format!("dunning/run {} (tenant {})", run.id, run.tenant_id);
        let (db, timeout) = (&self.inner.db, self.inner.config.statement_timeout);
        scheduler::catch(step, async {
            let notice = self.final_notice(run);
            let final_action =
                store::final_action(db, &self.inner.biller, run, notice, timeout).await?;
            Ok(Retry::Exhausted { code, final_action })
        })
        .await
    }

    /// The charged path of [`retry_runs`](Dunner::retry_runs) for active runs
    /// whose invoice was listed open.
    async fn charge_runs(
        &self,
        runs: Vec<Run>,
        deadline: Instant,
        cancelled: impl Fn() -> bool + Copy,
    ) -> Vec<(Run, Outcome)> {
        let db = &self.inner.db;
        let c = &self.inner.config;
        let t = &self.inner.telemetry;
        let biller = &self.inner.biller;
        let timeout = c.statement_timeout;
        let mut out: HashMap<i64, Outcome> = HashMap::with_capacity(runs.len());
        // Per run, under the guard: what a decline would do (pure; a corrupt
        // policy panics here, before anything of this run is charged).
        let mut planned: HashMap<i64, AfterDecline> = HashMap::new();
        let mut panicked: Vec<(i64, scheduler::Payload)> = Vec::new();
        // 1. One transaction: the attempt compare-and-set of every run, the
        //    plan under the guard, billing's claims and attempts, and the
        //    rewind of the runs that cannot be charged now.
        let first = async {
            let mut tx = db.begin_with_timeout(timeout).await?;
            let refs: Vec<&Run> = runs.iter().collect();
            let held = store::record_attempts_in(&mut tx, &refs, c.attempt_hold).await?;
            let mut wanted = Vec::new();
            for run in runs.iter().filter(|r| held.contains_key(&r.id)) {
                let attempt = run.attempt_count + 1;
                let step = format!("dunning/run {} (tenant {})", run.id, run.tenant_id);
                let plan = scheduler::catch(step, async {
                    run.policy.after_decline(run.first_declined_at, attempt)
                })
                .await;
                match plan {
                    Ok(plan) => {
                        planned.insert(run.id, plan);
                        wanted.push((
                            run,
                            RetryRequest {
                                invoice_id: run.invoice_id,
                                claimed_by: claim_identity(run),
                            },
                        ));
                    }
                    Err(payload) => panicked.push((run.id, payload)),
                }
            }
            let requests: Vec<RetryRequest> = wanted.iter().map(|(_, w)| w.clone()).collect();
            let started = biller.start_retries_in(&mut tx, &requests).await?;
            let mut to_rewind: Vec<(&Run, DateTime<Utc>)> = Vec::new();
            let mut charged = Vec::new();
            let mut not_charged = Vec::new();
            for ((run, _), s) in wanted.into_iter().zip(started) {
                match s {
                    Ok(s) => charged.push((run, s)),
                    Err(why) => {
                        to_rewind.push((run, held[&run.id]));
                        not_charged.push((run, why));
                    }
                }
            }
            // The runs whose planning panicked: rewound in this transaction.
            for (id, _) in &panicked {
                if let Some(run) = runs.iter().find(|r| r.id == *id) {
                    to_rewind.push((run, held[&run.id]));
                }
            }
            store::rewind_in(&mut tx, &to_rewind).await?;
            tx.commit().await?;
            Ok::<_, Error>((held, charged, not_charged))
        };
        let (held, charged, not_charged) = match first.await {
            Ok(x) => x,
            Err(e) => {
                // Rolled back: nothing of this batch was counted or claimed.
                warn!(role = %Role::Dunning, error = %e, runs = runs.len(), "batch not started; nothing counted");
                let why = e.to_string();
                let mut result: Vec<(Run, Outcome)> = Vec::with_capacity(runs.len());
                let mut panicked: HashMap<i64, scheduler::Payload> = panicked.into_iter().collect();
                for run in runs {
                    let outcome = match panicked.remove(&run.id) {
                        Some(p) => Err(p),
                        None => Ok(Err(Error::BatchNotStarted(why.clone()))),
                    };
                    result.push((run, Some(outcome)));
                }
                return result;
            }
        };
        for run in runs.iter().filter(|r| !held.contains_key(&r.id)) {
            out.insert(run.id, Some(Ok(Ok(Retry::Lost))));
        }
        for (id, payload) in panicked {
            out.insert(id, Some(Err(payload)));
        }
        for (run, why) in not_charged {
            t.counter(
                "hardcount_dunning_attempts_total",
                &[("outcome", "not_charged")],
            )
            .increment(1);
            let result = match why {
                NotCharged::InvoiceClosed { status } => store::stop(db, run, &status, timeout)
                    .await
                    .map(|applied| stopped(applied, &status)),
                why => Ok(Retry::Rewound {
                    why: format!("{why:?}"),
                    unanswered: false,
                }),
            };
            out.insert(run.id, Some(Ok(result)));
        }
        // 2. Billing's calls, concurrent, and its one settling transaction.
        let run_of: HashMap<i64, &Run> = charged
            .iter()
            .map(|(r, s)| (s.claim.invoice_id, *r))
            .collect();
        let started: Vec<StartedRetry> = charged.into_iter().map(|(_, s)| s).collect();
        let finished = biller
            .finish_retries(started, c.concurrency, deadline, cancelled, |s| {
                format!(
                    "dunning/charge invoice {} (tenant {})",
                    s.claim.invoice_id, s.claim.tenant_id
                )
            })
            .await;
        // 3. The outcomes: recoveries, declines (the next retry scheduled, or
        //    the run exhausted) and rewinds in one transaction.
        let mut recover: Vec<(&Run, i32)> = Vec::new();
        let mut rewind: Vec<(&Run, DateTime<Utc>, Outcome)> = Vec::new();
        let mut declined: Vec<(&Run, String)> = Vec::new();
        for (s, result) in finished {
            let Some(&run) = run_of.get(&s.claim.invoice_id) else {
                continue;
            };
            let hold = held[&run.id];
            let label = match &result {
                Ok(Ok(Retried::Paid { .. })) => "succeeded",
                Ok(Ok(Retried::Declined { .. })) => "declined",
                Ok(Ok(Retried::Unknown { .. })) => "unknown",
                Ok(Ok(Retried::NotCharged(_))) => "not_charged",
                Ok(Err(_)) => "error",
                Err(_) => "panicked",
            };
            t.counter("hardcount_dunning_attempts_total", &[("outcome", label)])
                .increment(1);
            match result {
                Ok(Ok(Retried::Paid { .. })) => recover.push((run, run.attempt_count + 1)),
                Ok(Ok(Retried::Declined { code, .. })) => declined.push((run, code)),
                Ok(Ok(Retried::Unknown { reason, .. })) => {
                    let unanswered = reason != billing::batch::NOT_SENT;
                    let r = Retry::Rewound {
                        why: reason,
                        unanswered,
                    };
                    rewind.push((run, hold, Some(Ok(Ok(r)))));
                }
                Ok(Ok(Retried::NotCharged(why))) => {
                    let r = Retry::Rewound {
                        why: format!("{why:?}"),
                        unanswered: false,
                    };
                    rewind.push((run, hold, Some(Ok(Ok(r)))));
                }
                Ok(Err(e)) => rewind.push((run, hold, Some(Ok(Err(Error::Billing(e)))))),
                Err(payload) => rewind.push((run, hold, Some(Err(payload)))),
            }
        }
        // Per declined run, under the guard: the transition it takes (from the
        // plan made before the charge) and its warning; a panic here rewinds
        // that run with the others.
        let from = &c.email_from;
        let mut declines: Vec<store::Decline<'_>> = Vec::new();
        for (run, code) in declined {
            let attempt = run.attempt_count + 1;
            let plan = planned.get(&run.id).cloned();
            let step = format!("dunning/run {} (tenant {})", run.id, run.tenant_id);
            let prepared = scheduler::catch(step, async {
                let plan = plan
                    .unwrap_or_else(|| run.policy.after_decline(run.first_declined_at, attempt));
                match plan {
                    AfterDecline::Next { at } => {
                        let email = run
                            .policy
                            .warns_after(attempt)
                            .then(|| warning(run, sender(run, from), &code, at));
                        (Some(at), email)
                    }
                    AfterDecline::Exhausted => (None, None),
                }
            })
            .await;
            match prepared {
                Ok((next, email)) => declines.push(store::Decline {
                    run,
                    attempt,
                    held: held[&run.id],
                    code,
                    next,
                    email: self.sendable(run, email),
                }),
                Err(payload) => rewind.push((run, held[&run.id], Some(Err(payload)))),
            }
        }
        let pairs: Vec<(&Run, DateTime<Utc>)> = rewind.iter().map(|(r, h, _)| (*r, *h)).collect();
        let last = async {
            let mut tx = db.begin_with_timeout(timeout).await?;
            let recovered = store::recover_in(&mut tx, &recover).await?;
            let declined = store::decline_in(&mut tx, &declines).await?;
            let rewound = store::rewind_in(&mut tx, &pairs).await?;
            tx.commit().await?;
            Ok::<_, Error>((recovered, declined, rewound))
        };
        let (recovered, declined, rewound) = match last.await {
            Ok(x) => x,
            Err(e) => {
                // One at a time, as before batching. A run whose own
                // transition fails too is rewound (by the hold its record
                // wrote, so a transition that did land stays): as listed,
                // rather than counted with a hold and no schedule.
                debug!(role = %Role::Dunning, error = %e, "batched transitions failed; one run at a time");
                let mut failed: Vec<(&Run, Error)> = Vec::new();
                let mut declined = HashSet::new();
                for d in &declines {
                    let email = d.email.clone();
                    let applied = match d.next {
                        Some(at) => {
                            let attempt = (d.attempt, d.held);
                            store::decline(db, d.run, attempt, (&d.code, at), email, timeout).await
                        }
                        None => store::exhaust(db, d.run, d.attempt, &d.code, timeout).await,
                    };
                    match applied {
                        Ok(true) => {
                            declined.insert(d.run.id);
                        }
                        Ok(false) => {}
                        Err(e) => failed.push((d.run, e)),
                    }
                }
                let mut recovered = HashSet::new();
                for (run, attempt) in &recover {
                    match store::recover(db, run, *attempt, timeout).await {
                        Ok(true) => {
                            recovered.insert(run.id);
                        }
                        Ok(false) => {}
                        Err(e) => failed.push((run, e)),
                    }
                }
                for (run, e) in failed {
                    match store::rewind(db, run, held[&run.id], timeout).await {
                        Ok(_) => {
                            warn!(role = %Role::Dunning, run = run.id, tenant = %run.tenant_id, error = %e, "retry outcome not written; rewound");
                        }
                        Err(re) => {
                            warn!(role = %Role::Dunning, run = run.id, tenant = %run.tenant_id, error = %e, rewind = %re, "retry outcome not written and not rewound; the run waits out its hold");
                        }
                    }
                    out.insert(run.id, Some(Ok(Err(e))));
                }
                let mut rewound = HashSet::new();
                for (run, hold) in &pairs {
                    if let Ok(true) = store::rewind(db, run, *hold, timeout).await {
                        rewound.insert(run.id);
                    }
                }
                (recovered, declined, rewound)
            }
        };
        for (run, _) in recover {
            if out.contains_key(&run.id) {
                continue;
            }
            let r = if recovered.contains(&run.id) {
                t.counter("hardcount_dunning_recoveries_total", &[])
                    .increment(1);
                Retry::Recovered
            } else {
                Retry::Lost
            };
            out.insert(run.id, Some(Ok(Ok(r))));
        }
        for (run, _, outcome) in rewind {
            let outcome = match outcome {
                // A rewind that found the run moved: another worker's.
                Some(Ok(Ok(Retry::Rewound { .. }))) if !rewound.contains(&run.id) => {
                    Some(Ok(Ok(Retry::Lost)))
                }
                other => other,
            };
            out.insert(run.id, outcome);
        }
        // The declines that applied; an exhausted run's final action is its
        // own transaction (stamped once; a crash before it is finished by the
        // next tick's funnel).
        let mut exhausted = Vec::new();
        for d in declines {
            let id = d.run.id;
            if out.contains_key(&id) {
                continue;
            }
            let outcome = match (declined.contains(&id), d.next) {
                (false, _) => Ok(Ok(Retry::Lost)),
                (true, Some(_)) => Ok(Ok(Retry::Declined { code: d.code })),
                (true, None) => {
                    exhausted.push((d.run, d.code));
                    continue;
                }
            };
            out.insert(id, Some(outcome));
        }
        out.extend(self.all_exhausted(exhausted).await);
        runs.into_iter()
            .map(|run| {
                let outcome = out.remove(&run.id).unwrap_or(None);
                (run, outcome)
            })
            .collect()
    }

    /// Retry a listed batch ([`retry_runs`](Dunner::retry_runs)) and count
    /// it. Returns the runs to leave out of the rest of the tick, and the
    /// error that ends the tick as failed: the provider refused this
    /// deployment's key (billing counted it; every run was rewound), or the
    /// batch looks like an outage (at least [`OUTAGE_UNANSWERED`] retries
    /// without an answer and none answered).
    async fn retry_batch(
        &self,
        batch: Vec<Run>,
        tick: &Tick,
        deadline: Instant,
        panics: &mut Panics,
        tally: &mut Tally,
    ) -> (Vec<i64>, Option<Error>) {
        let results = self
            .retry_runs(batch, deadline, || tick.cancel.is_cancelled())
            .await;
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
                    if let Error::Billing(billing::Error::ProviderKeyRejected { status }) = e {
                        rejected = Some(status);
                    }
                    warn!(role = %Role::Dunning, run = run.id, tenant = %run.tenant_id, error = %e, "retry failed; rewound");
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
                Retry::Exhausted { .. } => {
                    tally.exhausted += 1;
                    answered += 1;
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
                Retry::FinalAction(_) => tally.final_actions += 1,
                Retry::Lost => {
                    tally.lost += 1;
                    left_out.push(run.id);
                }
            }
        }
        if let Some(status) = rejected {
            let e = billing::Error::ProviderKeyRejected { status };
            return (left_out, Some(Error::Billing(e)));
        }
        let outage = (unanswered >= OUTAGE_UNANSWERED && answered == 0)
            .then_some(Error::ProviderOutage { unanswered });
        (left_out, outage)
    }

    /// How long one retry may run: the provider call and a few statements.
    fn call_reserve(&self) -> Duration {
        self.inner
            .biller
            .config()
            .provider
            .as_ref()
            .map(|p| p.timeout)
            .unwrap_or_default()
    }

    async fn refresh_gauges(&self) {
        match store::active_runs(&self.inner.db, self.inner.config.statement_timeout).await {
            Ok(n) => self
                .inner
                .telemetry
                .gauge("hardcount_dunning_active_runs", &[])
                .set(n as f64),
            Err(e) => debug!(role = %Role::Dunning, error = %e, "active runs gauge not refreshed"),
        }
    }
}

fn stopped(applied: bool, invoice_status: &str) -> Retry {
    if applied {
        Retry::Stopped {
            invoice_status: invoice_status.to_owned(),
        }
    } else {
        Retry::Lost
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A claim identity no other claim shares: the run, its attempt, this process
/// and a per-process sequence.
fn claim_identity(run: &Run) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static CLAIMS: AtomicU64 = AtomicU64::new(0);
    let n = CLAIMS.fetch_add(1, Ordering::Relaxed);
    format!(
        "dunning:{}:{}:{}:{n}",
        run.id,
        run.attempt_count + 1,
        std::process::id()
    )
}

/// The retry step as the driver sees it. `left_out` holds runs this tick
/// will not list again (rewound, lost, failed, panicked, a bad policy, a row
/// that does not decode), so a run whose retry cannot finish cannot fill
/// every batch.
struct Retries<'a> {
    dunner: &'a Dunner,
    left_out: Mutex<Vec<i64>>,
}

impl FencedBatches for Retries<'_> {
    /// The listing: the driver counts every row listed (a full batch is
    /// followed by another claim), the runs are retried.
    type Claim = store::Listing;
    type Counts = Tally;
    type Error = Error;

    fn role(&self) -> Role {
        Role::Dunning
    }

    fn shape(&self) -> Shape {
        let c = &self.dunner.inner.config;
        Shape {
            batch_size: c.batch_size,
            budget: c.tick_budget,
            reserve: self.dunner.call_reserve(),
        }
    }

    async fn claim(&self, fence: &Fence, limit: usize) -> Result<store::Listing, Error> {
        let except = lock(&self.left_out).clone();
        let listing = self.dunner.list_due_except(fence, limit, &except).await?;
        lock(&self.left_out).extend(listing.left_out.iter().map(LeftOut::run));
        Ok(listing)
    }

    fn claimed(listing: &store::Listing) -> usize {
        listing.runs.len() + listing.left_out.len()
    }

    async fn run(
        &self,
        listing: store::Listing,
        tick: &Tick,
        deadline: Instant,
        panics: &mut Panics,
        tally: &mut Tally,
    ) -> Result<(), Error> {
        tally.left_out += listing.left_out.len();
        let batch = listing.runs;
        let (left_out, outage) = self
            .dunner
            .retry_batch(batch, tick, deadline, panics, tally)
            .await;
        lock(&self.left_out).extend(left_out);
        match outage {
            // Stop the tick as failed (short cooldown) rather than time out on
            // every due run, or call again with a refused key: each was
            // rewound, nothing is counted.
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    async fn end_tick(&self, tick: &Tick) {
        if !tick.cancel.is_cancelled() {
            self.dunner.refresh_gauges().await;
        }
    }
}
