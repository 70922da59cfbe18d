//! The `webhook_delivery` tick: the fenced-batch driver ([`scheduler::drive`])
//! over this role's claim ([`Worker::claim_due`]) and batch (attempts run
//! concurrently under limits, outcomes written in groups by compare-and-set).

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use db::Db;
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use leader::{Fence, Role, Telemetry, Tick, TickEnd};
use scheduler::{FencedBatches, Panics, Payload, Shape, Stop, Wake, catch, panic_message};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::Error;
use crate::attempt::StartBy;
use crate::config::WorkerConfig;
use crate::delivery::{Claimed, Outcome};
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
    pub in_flight: Arc<Semaphore>,
    pub per_endpoint: Mutex<HashMap<i64, Arc<Semaphore>>>,
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
                in_flight: Arc::new(Semaphore::new(config.max_in_flight)),
                config,
                client,
                telemetry,
                per_endpoint: Mutex::new(HashMap::new()),
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
        let driven = scheduler::drive(&Deliveries(self), tick).await;
        let t = driven.counts;
        TickReport {
            batches: driven.batches,
            claimed: driven.claimed,
            delivered: t.delivered,
            retried: t.retried,
            dead: t.dead,
            refused: t.refused,
            stale: t.stale,
            released: t.released,
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
        };
        match self.attempt(claimed, &start_by).await {
            Step::Done(outcome) => {
                self.count(&outcome);
                outcome
            }
            Step::Write(finished) => self
                .write_outcomes(vec![finished])
                .await
                .pop()
                .map_or(Outcome::Unrecorded, |(_, outcome)| outcome),
        }
    }

    /// Attempt a claimed batch concurrently and write the outcomes in groups.
    ///
    /// Finished attempts are buffered and written with one statement per group
    /// ([`store::record_outcomes`], each row still its own compare-and-set), in
    /// a task of its own while the other attempts go on. A group is written
    /// when it holds [`OUTCOME_GROUP`] outcomes, when its first outcome has
    /// waited [`OUTCOME_LINGER`](crate::outcomes::OUTCOME_LINGER), or when no attempt of the batch is left,
    /// whichever comes first; this returns once every group is written. If
    /// this future is dropped (the tick is cancelled and then abandoned), the
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
        panics: &mut Panics,
        report: &mut Tally,
    ) {
        let config = &self.inner.config;
        let items = claimed
            .into_iter()
            .map(|d| {
                // Start only what can finish before both the tick and the claim end.
                let latest_end = tick_deadline.min(d.claimed_at + config.claim_lease());
                let start_by = StartBy {
                    deadline: latest_end
                        .checked_sub(config.request_timeout)
                        .unwrap_or(d.claimed_at),
                    cancel: cancel.clone(),
                };
                let key = (d.row.id, d.row.attempt);
                (
                    key,
                    format!("{}/delivery {}", Role::WebhookDelivery, d.row.id),
                    (d, start_by),
                )
            })
            .collect();
        let mut running = guarded(items, |(d, start_by)| async move {
            self.attempt(d, &start_by).await
        });
        let mut buffer = OutcomeBuffer {
            worker: self.clone(),
            rows: Vec::new(),
            flush_at: None,
        };
        let mut writes = FuturesUnordered::new();
        loop {
            let lingered = buffer
                .flush_at
                .is_some_and(|at| at <= tokio::time::Instant::now());
            if buffer.rows.len() >= OUTCOME_GROUP
                || (!buffer.rows.is_empty() && (running.is_empty() || lingered))
            {
                writes.push(buffer.flush());
            }
            if running.is_empty() && writes.is_empty() {
                break;
            }
            let flush_at = buffer.flush_at;
            tokio::select! {
                Some(((id, attempt), result)) = running.next(), if !running.is_empty() => {
                    match result {
                        Ok(Step::Done(outcome)) => {
                            self.count(&outcome);
                            report.add(&outcome);
                        }
                        Ok(Step::Write(finished)) => buffer.push(finished),
                        Err(payload) => {
                            // Count the panic as a failed attempt, so a delivery that
                            // panics every time dies after its last attempt.
                            report.panicked += 1;
                            let observed = Observed {
                                error: Some(format!(
                                    "processing panicked: {}",
                                    panic_message(&*payload)
                                )),
                                ..Observed::default()
                            };
                            panics.record(payload);
                            let next = self.after_failure(attempt);
                            buffer.push(Finished {
                                row: OutcomeRow { id, attempt, next, observed },
                                refused: false,
                            });
                        }
                    }
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
                () = sleep_until_some(flush_at) => {}
            }
        }
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

/// The role as the driver sees it: a claim is [`Worker::claim_due`], a batch
/// is [`Worker::attempt_batch`]; the gauges are read after the last batch.
struct Deliveries<'a>(&'a Worker);

impl FencedBatches for Deliveries<'_> {
    type Claim = Vec<Claimed>;
    type Counts = Tally;
    type Error = Error;

    fn role(&self) -> Role {
        Role::WebhookDelivery
    }

    fn shape(&self) -> Shape {
        let config = &self.0.inner.config;
        Shape {
            batch_size: config.batch_size,
            budget: config.tick_budget,
            // No attempt starts that could end after the budget.
            reserve: config.request_timeout,
        }
    }

    async fn claim(&self, fence: &Fence, limit: usize) -> Result<Vec<Claimed>, Error> {
        self.0.claim_due(fence, limit).await
    }

    fn claimed(claim: &Vec<Claimed>) -> usize {
        claim.len()
    }

    fn wake(&self) -> Option<&Wake> {
        self.0.wake.as_ref()
    }

    fn idle_probe(&self) -> Option<Duration> {
        self.0.idle_probe
    }

    async fn probe(&self) -> Result<bool, Error> {
        Ok(store::any_due(&self.0.inner.db).await?)
    }

    /// Deliveries are fanned out at any time: a tick that delivered some is
    /// followed at once by the next, not after the interval.
    fn due_again_after_work(&self) -> bool {
        true
    }

    async fn run(
        &self,
        claimed: Vec<Claimed>,
        tick: &Tick,
        deadline: Instant,
        panics: &mut Panics,
        tally: &mut Tally,
    ) -> Result<(), Error> {
        self.0
            .attempt_batch(claimed, deadline, &tick.cancel, panics, tally)
            .await;
        Ok(())
    }

    async fn end_tick(&self, tick: &Tick) {
        if !tick.cancel.is_cancelled() {
            self.0.refresh_gauges().await;
        }
        self.0.prune_endpoint_limits();
    }
}

/// Run `each` on every item concurrently, each as its own guarded step
/// ([`scheduler::catch`]), so one that panics ends only itself. Yields every
/// item's key with its output or its panic, in completion order.
fn guarded<K, T, O, F, Fut>(
    items: Vec<(K, String, T)>,
    each: F,
) -> FuturesUnordered<impl Future<Output = (K, Result<O, Payload>)>>
where
    F: Fn(T) -> Fut,
    Fut: Future<Output = O>,
{
    items
        .into_iter()
        .map(|(key, step, item)| {
            let guarded = catch(step, each(item));
            async move { (key, guarded.await) }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::AssertUnwindSafe;

    #[tokio::test]
    async fn a_panicking_delivery_ends_only_itself_and_the_tick_raises_it_at_the_end() {
        scheduler::install_panic_hook();
        let items = (1..=5)
            .map(|i| (i, format!("test/delivery {i}"), i))
            .collect();
        let results: Vec<_> = guarded(items, |i| async move {
            // Interleave: the panicking item is neither the first to start nor to finish.
            tokio::time::sleep(Duration::from_millis(10 * (5 - i))).await;
            assert_ne!(i, 3, "delivery 3 is poison");
            i * 10
        })
        .collect()
        .await;
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
