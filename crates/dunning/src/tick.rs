//! The `dunning` tick: enrolment, then the fenced-batch driver
//! ([`scheduler::drive`]) over due runs, each run retried under the panic
//! guard, a bounded number at once.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use billing::{Biller, NotCharged, Retried};
use chrono::{DateTime, Utc};
use db::Db;
use futures::StreamExt;
use leader::{Fence, Role, Telemetry, Tick, TickEnd};
use scheduler::{FencedBatches, Panics, Shape, Stop};
use tracing::{debug, info, warn};

use crate::notices::{final_notice, warning};
use crate::policy::AfterDecline;
use crate::store::{self, FinalActed, Run};
use crate::{DunningConfig, Error};

/// A batch with at least this many retries the provider did not answer, and
/// none it did, is taken for an outage: the tick stops as failed.
pub const OUTAGE_UNANSWERED: usize = 3;

/// What became of one listed run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Retry {
    /// The retry paid the invoice; the run is recovered.
    Recovered,
    /// A definite decline; the next retry is scheduled.
    Declined { code: String },
    /// The last retry was declined; the run is exhausted and its final action ran.
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
    pub async fn list_due(&self, fence: &Fence, limit: usize) -> Result<Vec<Run>, Error> {
        self.list_due_except(fence, limit, &[]).await
    }

    async fn list_due_except(
        &self,
        fence: &Fence,
        limit: usize,
        except: &[i64],
    ) -> Result<Vec<Run>, Error> {
        let timeout = self.inner.config.statement_timeout;
        Ok(store::list_due(&self.inner.db, fence, limit, except, timeout).await?)
    }

    /// Retry one listed run. Not fenced: every write proves the run's status
    /// and attempt count as listed, so a stale or second worker writes nothing.
    ///
    /// # Errors
    /// A database error or a refused event or email; a recorded attempt
    /// was rewound (the run is as listed).
    pub async fn retry(&self, run: &Run) -> Result<Retry, Error> {
        let held = Mutex::new(None);
        let result = self.retry_holding(run, &held).await;
        if result.is_err() {
            let hold = *lock(&held);
            self.rewind_held(run, hold).await;
        }
        result
    }

    /// [`retry`](Dunner::retry), writing the recorded attempt's hold to
    /// `held` so the caller can rewind it if this future panics or is dropped.
    async fn retry_holding(
        &self,
        run: &Run,
        held: &Mutex<Option<DateTime<Utc>>>,
    ) -> Result<Retry, Error> {
        let db = &self.inner.db;
        let c = &self.inner.config;
        let timeout = c.statement_timeout;
        if run.status == "exhausted" {
            return Ok(Retry::FinalAction(
                store::final_action(db, run, timeout).await?,
            ));
        }
        if run.invoice_status != "open" {
            return Ok(stopped(
                store::stop(db, run, &run.invoice_status, timeout).await?,
                &run.invoice_status,
            ));
        }
        let attempt = run.attempt_count + 1;
        let Some(hold) = store::record_attempt(db, run, c.attempt_hold, timeout).await? else {
            return Ok(Retry::Lost);
        };
        *lock(held) = Some(hold);
        // Planned before the charge, from the listing: a corrupt policy panics
        // here, under the guard, which rewinds the attempt.
        let plan = run.policy.after_decline(run.first_declined_at, attempt);
        let t = &self.inner.telemetry;
        let claimed_by = claim_identity(run);
        let retried = self
            .inner
            .biller
            .retry_charge(run.invoice_id, &claimed_by)
            .await;
        let label = match &retried {
            Ok(Retried::Paid { .. }) => "succeeded",
            Ok(Retried::Declined { .. }) => "declined",
            Ok(Retried::Unknown { .. }) => "unknown",
            Ok(Retried::NotCharged(_)) => "not_charged",
            Err(_) => "error",
        };
        t.counter("hardcount_dunning_attempts_total", &[("outcome", label)])
            .increment(1);
        let from = &c.email_from;
        Ok(match retried? {
            Retried::Paid { .. } => {
                if store::recover(db, run, attempt, timeout).await? {
                    t.counter("hardcount_dunning_recoveries_total", &[])
                        .increment(1);
                    Retry::Recovered
                } else {
                    Retry::Lost
                }
            }
            Retried::Declined { code, .. } => match plan {
                AfterDecline::Next { at } => {
                    let email = run
                        .policy
                        .warns_after(attempt)
                        .then(|| warning(run, from, &code, at));
                    if store::decline(db, run, attempt, (&code, at), email, timeout).await? {
                        Retry::Declined { code }
                    } else {
                        Retry::Lost
                    }
                }
                AfterDecline::Exhausted => {
                    let email = run.policy.final_notice.then(|| final_notice(run, from));
                    if !store::exhaust(db, run, attempt, &code, email, timeout).await? {
                        return Ok(Retry::Lost);
                    }
                    let action = run.policy.final_action.as_str();
                    t.counter(
                        "hardcount_dunning_exhaustions_total",
                        &[("final_action", action)],
                    )
                    .increment(1);
                    let final_action = store::final_action(db, run, timeout).await?;
                    Retry::Exhausted { code, final_action }
                }
            },
            Retried::Unknown { reason, .. } => self.rewound(run, hold, reason, true).await?,
            Retried::NotCharged(NotCharged::InvoiceClosed { status }) => {
                self.rewound(run, hold, String::new(), false).await?;
                stopped(store::stop(db, run, &status, timeout).await?, &status)
            }
            Retried::NotCharged(why) => self.rewound(run, hold, format!("{why:?}"), false).await?,
        })
    }

    async fn rewound(
        &self,
        run: &Run,
        held: DateTime<Utc>,
        why: String,
        unanswered: bool,
    ) -> Result<Retry, Error> {
        let timeout = self.inner.config.statement_timeout;
        Ok(
            if store::rewind(&self.inner.db, run, held, timeout).await? {
                Retry::Rewound { why, unanswered }
            } else {
                Retry::Lost
            },
        )
    }

    /// Rewind the attempt a retry recorded and could not finish (it failed,
    /// panicked or was dropped). Logged, never raised: the hold brings the
    /// run back if the rewind itself fails.
    async fn rewind_held(&self, run: &Run, held: Option<DateTime<Utc>>) {
        let Some(hold) = held else { return };
        let timeout = self.inner.config.statement_timeout;
        match store::rewind(&self.inner.db, run, hold, timeout).await {
            Ok(true) => debug!(role = %Role::Dunning, run = run.id, "attempt rewound"),
            Ok(false) => {
                debug!(role = %Role::Dunning, run = run.id, "nothing to rewind: the run moved on")
            }
            Err(e) => {
                warn!(role = %Role::Dunning, run = run.id, error = %e, "rewind failed; the run comes back after its hold")
            }
        }
    }

    /// Retry a listed batch, at most `concurrency` at once, each under the
    /// guard. Returns the runs to leave out of the rest of the tick, and
    /// whether the batch looks like a provider outage: at least
    /// [`OUTAGE_UNANSWERED`] retries without an answer and none answered.
    async fn retry_batch(
        &self,
        batch: Vec<Run>,
        tick: &Tick,
        deadline: Instant,
        panics: &mut Panics,
        tally: &mut Tally,
    ) -> (Vec<i64>, Option<usize>) {
        let reserve = self.call_reserve();
        let results: Vec<_> = futures::stream::iter(batch)
            .map(|run| async move {
                if Instant::now() + reserve > deadline || tick.cancel.is_cancelled() {
                    return (run, None, None);
                }
                let held = Mutex::new(None);
                let step = format!("dunning/run {} (tenant {})", run.id, run.tenant_id);
                let result = scheduler::catch(step, self.retry_holding(&run, &held)).await;
                let hold = *lock(&held);
                (run, hold, Some(result))
            })
            .buffer_unordered(self.inner.config.concurrency)
            .collect()
            .await;
        let mut left_out = Vec::new();
        let (mut answered, mut unanswered) = (0, 0);
        for (run, hold, result) in results {
            let Some(result) = result else { continue };
            let retry = match result {
                Err(payload) => {
                    tally.panicked += 1;
                    left_out.push(run.id);
                    if hold.is_some() {
                        self.rewind_held(&run, hold).await;
                    }
                    panics.record(payload);
                    continue;
                }
                Ok(Err(e)) => {
                    tally.errors += 1;
                    left_out.push(run.id);
                    warn!(role = %Role::Dunning, run = run.id, tenant = %run.tenant_id, error = %e, "retry failed; rewound");
                    self.rewind_held(&run, hold).await;
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
        let outage = (unanswered >= OUTAGE_UNANSWERED && answered == 0).then_some(unanswered);
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
/// will not list again (rewound, lost, failed, panicked), so a run whose
/// retry cannot finish cannot fill every batch.
struct Retries<'a> {
    dunner: &'a Dunner,
    left_out: Mutex<Vec<i64>>,
}

impl FencedBatches for Retries<'_> {
    type Claim = Vec<Run>;
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

    async fn claim(&self, fence: &Fence, limit: usize) -> Result<Vec<Run>, Error> {
        let except = lock(&self.left_out).clone();
        self.dunner.list_due_except(fence, limit, &except).await
    }

    fn claimed(batch: &Vec<Run>) -> usize {
        batch.len()
    }

    async fn run(
        &self,
        batch: Vec<Run>,
        tick: &Tick,
        deadline: Instant,
        panics: &mut Panics,
        tally: &mut Tally,
    ) -> Result<(), Error> {
        let (left_out, outage) = self
            .dunner
            .retry_batch(batch, tick, deadline, panics, tally)
            .await;
        lock(&self.left_out).extend(left_out);
        match outage {
            // Stop the tick as failed (short cooldown) rather than time out on
            // every due run: each was rewound, nothing is counted.
            Some(unanswered) => Err(Error::ProviderOutage { unanswered }),
            None => Ok(()),
        }
    }

    async fn end_tick(&self, tick: &Tick) {
        if !tick.cancel.is_cancelled() {
            self.dunner.refresh_gauges().await;
        }
    }
}
