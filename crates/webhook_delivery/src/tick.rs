//! The `webhook_delivery` tick: the fenced-batch driver ([`scheduler::drive`])
//! over this role's claim ([`Worker::claim_due`]) and batch (attempts run
//! concurrently under limits, outcomes written in groups by compare-and-set).
//!
//! A batch does not wait for its slow attempts: once none of them has
//! finished for [`CARRY_QUIET`] they are carried as they are (they go on, each
//! in a task of its own, and later batches collect their outcomes), and after
//! [`CARRY_AFTER`] at the latest, when the ones still waiting for a turn are
//! held for [`crate::attempt::BUSY_HOLD`]; the driver claims again. So a
//! tenant whose endpoints hang costs other tenants' deliveries neither slots
//! (the per-tenant share, [`crate::fairness`]) nor time (the next claim does
//! not wait for the hung requests). A full batch (more is probably waiting)
//! carries its second half as soon as its first half has finished, so the
//! next claim and the last outcome write overlap the requests still running
//! instead of leaving the HTTP slots idle (docs/adr/0021). The tick collects
//! every carried attempt before it ends.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use db::Db;
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use leader::{Fence, Role, Telemetry, Tick, TickEnd};
use scheduler::{FencedBatches, Panics, Payload, Shape, Stop, Wake, catch, panic_message};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::warn;

use crate::Error;
use crate::attempt::{Attempted, Prepared, StartBy};
use crate::breaker::Breakers;
use crate::config::WorkerConfig;
use crate::delivery::{Claimed, Outcome};
use crate::fairness::Limits;
use crate::outcomes::{Finished, OUTCOME_GROUP, OutcomeBuffer, Step, sleep_until_some};
use crate::ssrf;
use crate::store::{self, Observed, OutcomeRow};

/// What one tick did, per outcome.
#[derive(Debug)]
pub struct TickReport {
    pub batches: usize,
    pub claimed: usize,
    pub delivered: usize,
    pub retried: usize,
    pub dead: usize,
    pub refused: usize,
    pub stale: usize,
    pub released: usize,
    /// Handed back unsent to come due later: their endpoint's circuit breaker
    /// was open, or no turn came while their batch ran.
    pub held: usize,
    pub unrecorded: usize,
    /// Deliveries whose processing panicked (recorded as failed attempts).
    pub panicked: usize,
    pub elapsed: Duration,
    /// Why the tick stopped claiming.
    pub stop: Stop,
    /// How the lease is released (docs/adr/0007).
    pub end: TickEnd,
}

/// Outcomes counted over a tick.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    delivered: usize,
    retried: usize,
    dead: usize,
    refused: usize,
    stale: usize,
    released: usize,
    held: usize,
    unrecorded: usize,
    panicked: usize,
}

impl Tally {
    fn add(&mut self, outcome: &Outcome) {
        let slot = match outcome {
            Outcome::Delivered => &mut self.delivered,
            Outcome::Retry => &mut self.retried,
            Outcome::Dead => &mut self.dead,
            Outcome::Refused => &mut self.refused,
            Outcome::Stale => &mut self.stale,
            Outcome::Released => &mut self.released,
            Outcome::Held => &mut self.held,
            Outcome::Unrecorded => &mut self.unrecorded,
        };
        *slot += 1;
    }
}

/// Sends webhook deliveries. Cheap to clone; clones share the HTTP client and
/// the concurrency limits.
#[derive(Clone)]
pub struct Worker {
    pub(crate) inner: Arc<Inner>,
    wake: Option<Wake>,
    /// Set by `with_idle_probe` (lib.rs).
    pub(crate) idle_probe: Option<Duration>,
}

pub(crate) struct Inner {
    pub db: Db,
    pub config: WorkerConfig,
    pub client: reqwest::Client,
    pub telemetry: Telemetry,
    pub limits: Limits,
    pub breakers: Breakers,
}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// A worker with its HTTP client: the SSRF-guarded builder from
    /// [`ssrf::client_builder`], no redirects, no proxy, the configured
    /// connect timeout.
    ///
    /// # Errors
    /// [`Error::Config`] for settings that cannot work, [`Error::Client`] if the
    /// HTTP client cannot be built (no TLS roots, for instance).
    pub fn new(db: Db, config: WorkerConfig, telemetry: Telemetry) -> Result<Worker, Error> {
        config.validate()?;
        let client = ssrf::client_builder(config.allowlist.clone())
            .connect_timeout(config.connect_timeout)
            .user_agent(concat!("hardcount-webhooks/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Error::Client(e.to_string()))?;
        Ok(Worker {
            inner: Arc::new(Inner {
                db,
                limits: Limits::new(&config),
                breakers: Breakers::new(
                    config.breaker_timeouts,
                    config.breaker_cooloff,
                    config.request_timeout,
                ),
                config,
                client,
                telemetry,
            }),
            wake: None,
            idle_probe: None,
        })
    }

    /// Listen for wake-ups (docs/adr/0014): while `wake` is listening, a tick
    /// that drained stays open and claims again when the outbox's fan-out
    /// commits (or at `wake`'s poll interval) until its budget.
    #[must_use]
    pub fn with_wake(mut self, wake: Wake) -> Worker {
        self.wake = Some(wake);
        self
    }

    pub fn config(&self) -> &WorkerConfig {
        &self.inner.config
    }

    /// One tick of the role: claim batches of due deliveries and attempt each,
    /// until nothing is due, the budget is spent, or `tick.cancel` fires; then
    /// refresh the backlog gauges.
    ///
    /// Each delivery runs under the panic guard: one that panics is recorded as
    /// a failed attempt (so a poison delivery dies after its last attempt
    /// instead of panicking every tick), the others go on, and the first panic
    /// is raised again at the end so the lease is released as panicked.
    ///
    /// # Panics
    /// When a delivery panicked, after the rest of the tick.
    ///
    /// # Cancel safety
    /// On `tick.cancel`, attempts not yet started are handed back and no batch
    /// is claimed; attempts in flight go on. Under `Manager::lead` the tick is
    /// dropped if it has not returned within the cancel grace (1 s): attempts
    /// still in flight then stop, and their deliveries come due again when
    /// their claim lease ends (at-least-once: the receiver may have seen them).
    pub async fn run_tick(&self, tick: &Tick) -> TickReport {
        let deliveries = Deliveries {
            worker: self,
            carried: Mutex::new(Running::new()),
            waits: AtomicUsize::new(0),
        };
        let driven = scheduler::drive(&deliveries, tick).await;
        let mut t = driven.counts;
        // Collect the attempts carried past their batches; a panic among them
        // is raised after the count, as the driver raises its own.
        let carried = deliveries.take_carried();
        let mut panics = Panics::new(Role::WebhookDelivery.as_str());
        if !carried.is_empty() {
            self.collect(
                carried,
                &mut Running::new(),
                None,
                None,
                &mut panics,
                &mut t,
            )
            .await;
        }
        self.end_of_tick();
        panics.finish();
        TickReport {
            // Less the empty claims that only waited for carried attempts.
            batches: driven.batches - deliveries.waits.load(Relaxed),
            claimed: driven.claimed - deliveries.waits.load(Relaxed),
            delivered: t.delivered,
            retried: t.retried,
            dead: t.dead,
            refused: t.refused,
            stale: t.stale,
            released: t.released,
            held: t.held,
            unrecorded: t.unrecorded,
            panicked: t.panicked,
            elapsed: driven.elapsed,
            stop: driven.stop,
            end: driven.end,
        }
    }

    /// The fenced funnel: claim up to `limit` due pending deliveries for one
    /// attempt each (see the crate docs). Empty when nothing is due or `fence`
    /// is stale.
    ///
    /// # Errors
    /// A database error; nothing was claimed.
    pub async fn claim_due(&self, fence: &Fence, limit: usize) -> Result<Vec<Claimed>, Error> {
        let config = &self.inner.config;
        let claimed_at = Instant::now();
        let rows = store::claim_due(
            &self.inner.db,
            fence,
            limit,
            config.claim_lease(),
            config.retry_schedule.max_attempts(),
            config.statement_timeout,
        )
        .await?;
        Ok(rows
            .into_iter()
            .map(|row| Claimed { row, claimed_at })
            .collect())
    }

    /// Make the attempt `claimed` stands for and write its outcome, outside a
    /// tick (the tick does the same for each delivery it claims, writing the
    /// outcomes in groups). The attempt is handed back unsent if it cannot
    /// start within the claim margin.
    pub async fn deliver(&self, claimed: Claimed) -> Outcome {
        let start_by = StartBy {
            deadline: claimed.claimed_at + self.inner.config.claim_margin,
            cancel: CancellationToken::new(),
            busy: CancellationToken::new(),
        };
        match self.attempt(claimed, None, &start_by).await {
            Attempted::Step(Step::Done(outcome)) => {
                self.count(&outcome);
                outcome
            }
            Attempted::Step(Step::Write(finished)) => self
                .write_outcomes(vec![finished])
                .await
                .pop()
                .map_or(Outcome::Unrecorded, |(_, outcome)| outcome),
            Attempted::Hold { id, attempt, wait } => {
                if self.hold(&[(id, attempt, wait)]).await == 1 {
                    Outcome::Held
                } else {
                    Outcome::Released
                }
            }
        }
    }

    /// Attempt a claimed batch concurrently and write the outcomes in groups.
    ///
    /// Deliveries of an endpoint whose circuit breaker is open are held at
    /// once, in one statement. The rest run as tasks of their own; this
    /// returns when they are all done, or when they are carried (see
    /// [`Worker::collect`]; later batches and the tick's end collect them).
    /// Attempts carried from earlier batches are collected here too.
    ///
    /// Finished attempts are buffered and written in groups, one statement
    /// per group ([`store::record_outcomes`], each row still its own
    /// compare-and-set), in a task of its own while the other attempts go on.
    /// A group is written when it holds [`OUTCOME_GROUP`] outcomes, when its
    /// first outcome has waited
    /// [`OUTCOME_LINGER`](crate::outcomes::OUTCOME_LINGER), or when no
    /// attempt of the batch is left, whichever comes first; this returns once
    /// every group is written. If this future is dropped (the tick is
    /// cancelled and then abandoned), the attempts' tasks are aborted, the
    /// groups already handed to their tasks are still written, and so is
    /// whatever is left in the buffer ([`OutcomeBuffer`]'s `Drop` hands it to
    /// a task of its own). A buffered outcome that cannot be written (the
    /// statement fails, or the runtime is gone) is not lost silently: it is
    /// logged, and its delivery, still `pending` at this attempt, comes due
    /// again when its claim lease ends (at-least-once: the receiver may see it
    /// again, with the same `webhook-id`).
    async fn attempt_batch(
        &self,
        claimed: Vec<Claimed>,
        tick_deadline: Instant,
        cancel: &CancellationToken,
        carried: &mut Running,
        panics: &mut Panics,
        report: &mut Tally,
    ) {
        let config = &self.inner.config;
        let carry_after = CARRY_AFTER.min(config.request_timeout / 2);
        if claimed.is_empty() {
            // Nothing claimed, attempts carried: collect those that are done
            // and go back to claiming (after BUSY_POLL, or a wake-up).
            let running = std::mem::take(carried);
            let carry = (tokio::time::Instant::now(), CancellationToken::new());
            self.collect(running, carried, Some(carry), None, panics, report)
                .await;
            return;
        }
        // A full batch means more is probably waiting: the next claim is made
        // once half of this one has finished, while the other half runs.
        let full = claimed.len() >= config.batch_size;
        let now = Instant::now();
        let (open, claimed): (Vec<_>, Vec<_>) = claimed.into_iter().partition(|d| {
            d.row.enabled
                && self
                    .inner
                    .breakers
                    .open_for(d.row.endpoint_id, now)
                    .is_some()
        });
        if !open.is_empty() {
            let held: Vec<_> = open
                .iter()
                .map(|d| {
                    let wait = self
                        .inner
                        .breakers
                        .open_for(d.row.endpoint_id, now)
                        .unwrap_or_default();
                    (d.row.id, d.row.attempt, wait)
                })
                .collect();
            report.held += self.hold(&held).await;
        }
        let busy = CancellationToken::new();
        // Each endpoint's URL and secrets, prepared once for this batch.
        let mut targets: HashMap<i64, Arc<Prepared>> = HashMap::new();
        let running: Running = claimed
            .into_iter()
            .map(|d| {
                // Start only what can finish before both the tick and the claim end.
                let latest_end = tick_deadline.min(d.claimed_at + config.claim_lease());
                let start_by = StartBy {
                    deadline: latest_end
                        .checked_sub(config.request_timeout)
                        .unwrap_or(d.claimed_at),
                    cancel: cancel.clone(),
                    busy: busy.clone(),
                };
                let key = (d.row.id, d.row.attempt);
                let step = format!("{}/delivery {}", Role::WebhookDelivery, d.row.id);
                let target = d.row.enabled.then(|| {
                    targets
                        .entry(d.row.endpoint_id)
                        .or_insert_with(|| Arc::new(self.prepare(&d.row)))
                        .clone()
                });
                let worker = self.clone();
                spawn_guarded(key, step, async move {
                    worker.attempt(d, target, &start_by).await
                })
            })
            .collect();
        let carry_at = tokio::time::Instant::now() + carry_after;
        let pipeline = full.then(|| running.len() / 2);
        self.collect(
            running,
            carried,
            Some((carry_at, busy)),
            pipeline,
            panics,
            report,
        )
        .await;
    }

    /// Collect the attempts of `running` (and of `carried`, as they finish):
    /// count them, write their outcomes and holds in groups. Returns when
    /// `running` is empty and every group is written, or when `running` is
    /// carried. With `carry`:
    ///
    /// - once no attempt of `running` has finished for [`CARRY_QUIET`] (what
    ///   is left hangs, or waits on shares that other attempts hold), its
    ///   attempts are moved to `carried` as they are, unless `carried` would
    ///   then hold more than two batches: the waiting ones go on waiting there
    ///   (each gives up once its share stalls, `fairness::STALL`);
    /// - at its instant, its token fires (so the attempts still waiting for a
    ///   turn are held at once) and the rest are moved to `carried`;
    /// - with `pipeline`, once no more than that many attempts of `running`
    ///   are left, they are moved to `carried` as they are (they keep their
    ///   places in the shares' queues; the token still fires at its instant),
    ///   so the driver's next claim runs while they finish instead of after
    ///   them.
    async fn collect(
        &self,
        mut running: Running,
        carried: &mut Running,
        mut carry: Option<(tokio::time::Instant, CancellationToken)>,
        pipeline: Option<usize>,
        panics: &mut Panics,
        report: &mut Tally,
    ) {
        let mut buffer = OutcomeBuffer {
            worker: self.clone(),
            rows: Vec::new(),
            flush_at: None,
        };
        let mut holds: Vec<(i64, i32, Duration)> = Vec::new();
        let mut writes = FuturesUnordered::new();
        // Hold groups written by tasks of their own, like outcome groups.
        let mut held = FuturesUnordered::new();
        // The last time an attempt of `running` finished.
        let mut progress = tokio::time::Instant::now();
        loop {
            let lingered = buffer
                .flush_at
                .is_some_and(|at| at <= tokio::time::Instant::now());
            if buffer.rows.len() >= OUTCOME_GROUP
                || (!buffer.rows.is_empty() && (running.is_empty() || lingered))
            {
                writes.push(buffer.flush());
            }
            if !holds.is_empty() && (running.is_empty() || holds.len() >= OUTCOME_GROUP) {
                let group = std::mem::take(&mut holds);
                let worker = self.clone();
                held.push(AbortOnDropHandle::new(tokio::spawn(async move {
                    worker.hold(&group).await
                })));
            }
            if running.is_empty() && writes.is_empty() && held.is_empty() {
                break;
            }
            let flush_at = buffer.flush_at;
            // Carried at the batch's deadline, or as it is once nothing of it
            // has finished for CARRY_QUIET (if not too much is carried already).
            let early = running.len() + carried.len() <= 2 * self.inner.config.batch_size;
            let carry_at = carry.as_ref().map(|(at, _)| {
                if early {
                    (*at).min(progress + CARRY_QUIET)
                } else {
                    *at
                }
            });
            tokio::select! {
                // In this order: what finished first, the carry timer last.
                biased;
                Some(((id, attempt), result)) = running.next(), if !running.is_empty() => {
                    progress = tokio::time::Instant::now();
                    self.finished(id, attempt, result, &mut buffer, &mut holds, panics, report);
                    if pipeline.is_some_and(|left| running.len() <= left)
                        && let Some((at, busy)) = carry.take()
                    {
                        // What still waits for a turn at the batch's carry
                        // instant is held then, as if it had not been carried.
                        tokio::spawn(async move {
                            tokio::time::sleep_until(at).await;
                            busy.cancel();
                        });
                        carried.extend(std::mem::take(&mut running));
                    }
                }
                // Only while this batch runs: once it is done or carried, the
                // rest wait for the next batch (a late one would be written alone).
                Some(((id, attempt), result)) = carried.next(), if !carried.is_empty() && !running.is_empty() => {
                    self.finished(id, attempt, result, &mut buffer, &mut holds, panics, report);
                }
                Some((n, written)) = writes.next(), if !writes.is_empty() => match written {
                    Ok(outcomes) => {
                        for (_, outcome) in &outcomes {
                            report.add(outcome);
                        }
                    }
                    Err(e) => {
                        warn!(
                            role = %Role::WebhookDelivery, outcomes = n, error = %e,
                            "a webhook outcome write did not finish; its deliveries come due again when their claim leases end"
                        );
                        report.unrecorded += n;
                    }
                },
                Some(n) = held.next(), if !held.is_empty() => {
                    // A task that did not finish left its claims to their leases.
                    report.held += n.unwrap_or(0);
                }
                () = sleep_until_some(flush_at) => {}
                () = sleep_until_some(carry_at) => {
                    if let Some((at, busy)) = carry.take() {
                        if tokio::time::Instant::now() >= at {
                            busy.cancel();
                        }
                        carried.extend(std::mem::take(&mut running));
                    }
                }
            }
        }
    }

    /// Take in one finished attempt: count it, or buffer its outcome or hold.
    #[allow(clippy::too_many_arguments)]
    fn finished(
        &self,
        id: i64,
        attempt: i32,
        result: Result<Attempted, Payload>,
        buffer: &mut OutcomeBuffer,
        holds: &mut Vec<(i64, i32, Duration)>,
        panics: &mut Panics,
        report: &mut Tally,
    ) {
        match result {
            Ok(Attempted::Step(Step::Done(outcome))) => {
                self.count(&outcome);
                report.add(&outcome);
            }
            Ok(Attempted::Step(Step::Write(finished))) => buffer.push(finished),
            Ok(Attempted::Hold { id, attempt, wait }) => holds.push((id, attempt, wait)),
            Err(payload) => {
                // Count the panic as a failed attempt, so a delivery that
                // panics every time dies after its last attempt.
                report.panicked += 1;
                let observed = Observed {
                    error: Some(format!("processing panicked: {}", panic_message(&*payload))),
                    ..Observed::default()
                };
                panics.record(payload);
                let next = self.after_failure(attempt);
                buffer.push(Finished {
                    row: OutcomeRow {
                        id,
                        attempt,
                        next,
                        observed,
                    },
                    refused: false,
                });
            }
        }
    }

    /// At a tick's end: forget the limits nothing holds, set the breaker gauge.
    fn end_of_tick(&self) {
        self.inner.limits.prune();
        self.inner
            .telemetry
            .gauge("hardcount_webhook_breakers_open", &[])
            .set(self.inner.breakers.open_count() as f64);
    }

    /// Read the backlog gauges on the database clock.
    async fn refresh_gauges(&self) {
        match store::backlog(&self.inner.db, self.inner.config.statement_timeout).await {
            Ok(b) => {
                let t = &self.inner.telemetry;
                t.gauge("hardcount_webhook_deliveries_pending", &[])
                    .set(b.pending as f64);
                t.gauge("hardcount_webhook_deliveries_dead", &[])
                    .set(b.dead as f64);
                t.gauge("hardcount_webhook_oldest_pending_age_seconds", &[])
                    .set(b.oldest_pending_age);
            }
            Err(e) => {
                warn!(role = %Role::WebhookDelivery, error = %e, "could not read the webhook delivery backlog")
            }
        }
    }
}

/// A batch does not wait longer than this (or half the request timeout, if
/// shorter) for its slow attempts: the rest are carried, and the driver claims
/// again. Long against a receiver that answers (milliseconds), short against
/// the request timeout (15 s by default).
pub(crate) const CARRY_AFTER: Duration = Duration::from_secs(1);

/// A batch none of whose attempts finished for this long is carried as it
/// is, and the driver claims again: a receiver that answers finishes an
/// attempt every few milliseconds.
pub(crate) const CARRY_QUIET: Duration = Duration::from_millis(50);

/// Attempts running as tasks of their own, each yielding its delivery's key
/// and what the attempt left, or its panic. Dropping it aborts them.
pub(crate) type Running = FuturesUnordered<Guarded<(i64, i32), Attempted>>;

/// A guarded task's key and its output or its panic.
pub(crate) type Guarded<K, O> = Pin<Box<dyn Future<Output = (K, Result<O, Payload>)> + Send>>;

/// The role as the driver sees it: a claim is [`Worker::claim_due`], a batch
/// is [`Worker::attempt_batch`]; attempts carried past their batches wait in
/// `carried` for the next batch or the tick's end.
///
/// While attempts are carried, a claim that finds nothing still counts as one
/// item (`Batch::waits`), so the driver runs a batch that only collects them
/// and then claims again (after `BUSY_POLL`, or a wake-up) instead of ending
/// the tick: deliveries that come due while a tarpit's requests hang are
/// claimed then, not after them.
struct Deliveries<'a> {
    worker: &'a Worker,
    carried: Mutex<Running>,
    /// Empty claims counted as one item, taken off the tick's report.
    waits: AtomicUsize,
}

/// A claim: the deliveries claimed, or none while attempts are carried.
struct Batch {
    claimed: Vec<Claimed>,
    waits: bool,
}

impl Deliveries<'_> {
    fn take_carried(&self) -> Running {
        std::mem::take(&mut *self.carried.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl FencedBatches for Deliveries<'_> {
    type Claim = Batch;
    type Counts = Tally;
    type Error = Error;

    fn role(&self) -> Role {
        Role::WebhookDelivery
    }

    fn shape(&self) -> Shape {
        let config = &self.worker.inner.config;
        Shape {
            batch_size: config.batch_size,
            budget: config.tick_budget,
            // No attempt starts that could end after the budget.
            reserve: config.request_timeout,
        }
    }

    async fn claim(&self, fence: &Fence, limit: usize) -> Result<Batch, Error> {
        let claimed = self.worker.claim_due(fence, limit).await?;
        let waits = claimed.is_empty()
            && !self
                .carried
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty();
        if waits {
            self.waits.fetch_add(1, Relaxed);
        }
        Ok(Batch { claimed, waits })
    }

    fn claimed(claim: &Batch) -> usize {
        claim.claimed.len().max(usize::from(claim.waits))
    }

    fn wake(&self) -> Option<&Wake> {
        self.worker.wake.as_ref()
    }

    fn idle_probe(&self) -> Option<Duration> {
        self.worker.idle_probe
    }

    async fn probe(&self) -> Result<bool, Error> {
        Ok(store::any_due(&self.worker.inner.db).await?)
    }

    /// Deliveries are fanned out at any time: a tick that delivered some is
    /// followed at once by the next, not after the interval.
    fn due_again_after_work(&self) -> bool {
        true
    }

    async fn run(
        &self,
        batch: Batch,
        tick: &Tick,
        deadline: Instant,
        panics: &mut Panics,
        tally: &mut Tally,
    ) -> Result<(), Error> {
        let mut carried = self.take_carried();
        self.worker
            .attempt_batch(
                batch.claimed,
                deadline,
                &tick.cancel,
                &mut carried,
                panics,
                tally,
            )
            .await;
        *self.carried.lock().unwrap_or_else(|p| p.into_inner()) = carried;
        Ok(())
    }

    async fn end_tick(&self, tick: &Tick) {
        if !tick.cancel.is_cancelled() {
            self.worker.refresh_gauges().await;
        }
    }
}

/// Run `attempt` as a task of its own, as a guarded step
/// ([`scheduler::catch`]), so one that panics ends only itself; yields `key`
/// with its output or its panic. The task is aborted if this is dropped.
fn spawn_guarded<K, O>(
    key: K,
    step: String,
    attempt: impl Future<Output = O> + Send + 'static,
) -> Guarded<K, O>
where
    K: Send + 'static,
    O: Send + 'static,
{
    let task = AbortOnDropHandle::new(tokio::spawn(catch(step, attempt)));
    Box::pin(async move {
        let result = match task.await {
            Ok(result) => result,
            // Only a runtime shutting down aborts it (a panic is caught inside).
            Err(join) => Err(Box::new(format!("attempt task ended: {join}")) as Payload),
        };
        (key, result)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::AssertUnwindSafe;

    #[tokio::test]
    async fn a_panicking_delivery_ends_only_itself_and_the_tick_raises_it_at_the_end() {
        scheduler::install_panic_hook();
        let running: FuturesUnordered<_> = (1..=5)
            .map(|i| {
                spawn_guarded(i, format!("test/delivery {i}"), async move {
                    // Interleave: the panicking item is neither the first to start nor to finish.
                    tokio::time::sleep(Duration::from_millis(10 * (5 - i))).await;
                    assert_ne!(i, 3, "delivery 3 is poison");
                    i * 10
                })
            })
            .collect();
        let results: Vec<_> = running.collect().await;
        let mut done: Vec<_> = results
            .iter()
            .filter_map(|(k, r)| r.as_ref().ok().map(|v| (*k, *v)))
            .collect();
        done.sort();
        assert_eq!(done, vec![(1, 10), (2, 20), (4, 40), (5, 50)]);
        let mut panics = Panics::new("test");
        for (key, result) in results {
            if let Err(payload) = result {
                assert_eq!(key, 3);
                assert!(panic_message(&*payload).contains("delivery 3 is poison"));
                panics.record(payload);
            }
        }
        assert_eq!(panics.panicked(), 1);
        let raised = std::panic::catch_unwind(AssertUnwindSafe(|| panics.finish())).unwrap_err();
        assert!(panic_message(&*raised).contains("delivery 3 is poison"));
    }
}
