//! A claimed batch of webhook deliveries: its attempts run concurrently, each
//! as a guarded task of its own under the limits, and are collected as they
//! finish, their outcomes and holds written in groups (compare-and-set, one
//! statement per group).
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
//! every carried attempt before it ends (`crate::tick`).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use leader::Role;
use scheduler::{Panics, Payload, Wake, catch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::warn;

use crate::attempt::{self, Attempted, Prepared, StartBy};
use crate::delivery::{Claimed, Outcome};
use crate::failure::Failure;
use crate::outcomes::{self, Finished, OUTCOME_GROUP, OutcomeBuffer, Step};
use crate::sealed::Sealed;
use crate::shared::Shared;
use crate::store::ClaimedRow;
use crate::store::HoldRow;
use crate::store::{Observed, OutcomeRow};

/// Outcomes counted over a tick.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    pub delivered: usize,
    pub retried: usize,
    pub dead: usize,
    pub refused: usize,
    pub stale: usize,
    pub released: usize,
    pub held: usize,
    pub unrecorded: usize,
    pub panicked: usize,
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

    /// A hand-back statement's counts; nothing when it failed (its claims
    /// come due when their leases end).
    pub(crate) fn holds(&mut self, holds: Option<outcomes::Holds>) {
        let h = holds.unwrap_or_default();
        self.held += h.held;
        self.stale += h.stale;
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
pub(crate) type Running = FuturesUnordered<Guarded<Key, Attempted>>;

/// A running attempt's delivery, its attempt number and the attempt it was
/// last resent at (where its retry schedule starts again, migration 0026).
pub(crate) type Key = (i64, i32, i32);

/// A guarded task's key and its output or its panic.
pub(crate) type Guarded<K, O> = Pin<Box<dyn Future<Output = (K, Result<O, Payload>)> + Send>>;

/// Attempt a claimed batch concurrently and write the outcomes in groups.
///
/// Deliveries of an endpoint whose circuit breaker is open are held at
/// once, in one statement. The rest run as tasks of their own; this
/// returns when they are all done, or when they are carried (see
/// [`collect`]; later batches and the tick's end collect them).
/// Attempts carried from earlier batches are collected here too.
///
/// Finished attempts are buffered and written in groups, one statement
/// per group ([`crate::store::record_outcomes`], each row still its own
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
#[allow(clippy::too_many_arguments)]
pub(crate) async fn attempt_batch(
    shared: &Arc<Shared>,
    claimed: Vec<Claimed>,
    tick_deadline: Instant,
    cancel: &CancellationToken,
    wake: Option<&Wake>,
    carried: &mut Running,
    panics: &mut Panics,
    report: &mut Tally,
) {
    let config = &shared.config;
    let carry_after = CARRY_AFTER.min(config.request_timeout / 2);
    if claimed.is_empty() {
        // Nothing claimed, attempts carried: collect those that are done
        // and go back to claiming (after BUSY_POLL, or a wake-up).
        let running = std::mem::take(carried);
        let carry = Carry::new(tokio::time::Instant::now(), None);
        collect(shared, running, carried, Some(carry), None, panics, report).await;
        return;
    }
    // A full batch means more is probably waiting: the next claim is made
    // once half of this one has finished, while the other half runs.
    let full = claimed.len() >= config.batch_size;
    let now = Instant::now();
    let (open, claimed): (Vec<_>, Vec<_>) = claimed
        .into_iter()
        .partition(|d| d.row.enabled && shared.breakers.open_for(d.row.endpoint_id, now).is_some());
    if !open.is_empty() {
        let held: Vec<_> = open
            .iter()
            .map(|d| {
                let wait = shared
                    .breakers
                    .open_for(d.row.endpoint_id, now)
                    .unwrap_or_default();
                (d.row.id, d.row.attempt, wait, None)
            })
            .collect();
        report.holds(outcomes::hold(shared, &held).await);
    }
    let carry = Carry::new(tokio::time::Instant::now() + carry_after, wake.cloned());
    // Each endpoint's URL and secrets, prepared once for this batch per
    // version of them: a batch can hold rows handed over by several fan-out
    // statements and rows of the claim's, so one endpoint can come with its
    // address or secrets from before and after a change (docs/adr/0133).
    let mut targets: HashMap<i64, Made> = HashMap::new();
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
                busy: carry.busy.clone(),
            };
            let key = (d.row.id, d.row.attempt, d.row.resent_at_attempt);
            let step = format!("{}/delivery {}", Role::WebhookDelivery, d.row.id);
            let target = d
                .row
                .enabled
                .then(|| match targets.get(&d.row.endpoint_id) {
                    Some(made) if made.is_for(&d.row) => Arc::clone(&made.target),
                    _ => {
                        let made = Made::new(shared, &d.row);
                        let target = Arc::clone(&made.target);
                        targets.insert(d.row.endpoint_id, made);
                        target
                    }
                });
            let shared = Arc::clone(shared);
            let (moved, wake) = (Arc::clone(&carry.moved), wake.cloned());
            spawn_guarded(key, step, async move {
                let done = attempt::attempt(&shared, d, target, &start_by).await;
                moved.finished(wake.as_ref());
                done
            })
        })
        .collect();
    let pipeline = full.then(|| running.len() / 2);
    collect(
        shared,
        running,
        carried,
        Some(carry),
        pipeline,
        panics,
        report,
    )
    .await;
}

/// When and how a batch's attempts are carried (see [`collect`]).
pub(crate) struct Carry {
    /// The batch's carry instant.
    at: tokio::time::Instant,
    /// Fired at that instant: attempts still waiting for a turn are held.
    busy: CancellationToken,
    /// Shared with the batch's attempt tasks: whether they were carried.
    moved: Arc<Moved>,
    /// The role's wake, poked for a carried attempt that has finished.
    wake: Option<Wake>,
}

impl Carry {
    pub(crate) fn new(at: tokio::time::Instant, wake: Option<Wake>) -> Carry {
        Carry {
            at,
            busy: CancellationToken::new(),
            moved: Arc::default(),
            wake,
        }
    }

    /// The batch's attempts still running are moved to `carried`, `taken`
    /// of them having been collected: poke the wake if one has finished
    /// uncollected, as each still running will when it finishes.
    fn moved(&self, taken: usize) {
        if self.moved.carry(taken)
            && let Some(wake) = &self.wake
        {
            wake.poke();
        }
    }
}

/// A carried attempt's result is written only by the driver's next batch,
/// so the role's wake is poked for it: a listening role then does not wait
/// out its interval while the claim lease runs and claim the delivery again
/// (docs/adr/0084). Either the attempt sees that it was carried or the
/// driver sees that it had finished (both sides `SeqCst`), so no carried
/// result is left without a poke.
#[derive(Debug, Default)]
pub(crate) struct Moved {
    carried: AtomicBool,
    finished: AtomicUsize,
}

impl Moved {
    /// In an attempt's task, once it has its result.
    fn finished(&self, wake: Option<&Wake>) {
        self.finished.fetch_add(1, SeqCst);
        if self.carried.load(SeqCst)
            && let Some(wake) = wake
        {
            wake.poke();
        }
    }

    /// In the driver, as the attempts are carried: whether more finished
    /// than the `taken` it collected.
    fn carry(&self, taken: usize) -> bool {
        self.carried.store(true, SeqCst);
        self.finished.load(SeqCst) > taken
    }
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
pub(crate) async fn collect(
    shared: &Arc<Shared>,
    mut running: Running,
    carried: &mut Running,
    mut carry: Option<Carry>,
    pipeline: Option<usize>,
    panics: &mut Panics,
    report: &mut Tally,
) {
    let mut buffer = OutcomeBuffer {
        shared: Arc::clone(shared),
        rows: Vec::new(),
        flush_at: None,
    };
    let mut holds: Vec<HoldRow> = Vec::new();
    let mut writes = FuturesUnordered::new();
    // Hold groups written by tasks of their own, like outcome groups.
    let mut held = FuturesUnordered::new();
    // The last time an attempt of `running` finished, and how many did.
    let mut progress = tokio::time::Instant::now();
    let mut taken = 0;
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
            let shared = Arc::clone(shared);
            held.push(AbortOnDropHandle::new(tokio::spawn(async move {
                outcomes::hold(&shared, &group).await
            })));
        }
        if running.is_empty() && writes.is_empty() && held.is_empty() {
            break;
        }
        let flush_at = buffer.flush_at;
        // Carried at the batch's deadline, or as it is once nothing of it
        // has finished for CARRY_QUIET (if not too much is carried already).
        let early = running.len() + carried.len() <= 2 * shared.config.batch_size;
        let carry_at = carry.as_ref().map(|c| {
            if early {
                c.at.min(progress + CARRY_QUIET)
            } else {
                c.at
            }
        });
        tokio::select! {
            // In this order: what finished first, the carry timer last.
            biased;
            Some((key, result)) = running.next(), if !running.is_empty() => {
                progress = tokio::time::Instant::now();
                taken += 1;
                finished(shared, key, result, &mut buffer, &mut holds, panics, report);
                if pipeline.is_some_and(|left| running.len() <= left)
                    && let Some(c) = carry.take()
                {
                    let (at, busy) = (c.at, c.busy.clone());
                    // What still waits for a turn at the batch's carry
                    // instant is held then, as if it had not been carried.
                    tokio::spawn(async move {
                        tokio::time::sleep_until(at).await;
                        busy.cancel();
                    });
                    c.moved(taken);
                    carried.extend(std::mem::take(&mut running));
                }
            }
            // Only while this batch runs: once it is done or carried, the
            // rest wait for the next batch (a late one would be written alone).
            Some((key, result)) = carried.next(), if !carried.is_empty() && !running.is_empty() => {
                finished(shared, key, result, &mut buffer, &mut holds, panics, report);
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
                report.holds(n.ok().flatten());
            }
            () = sleep_until_some(flush_at) => {}
            () = sleep_until_some(carry_at) => {
                if let Some(c) = carry.take() {
                    if tokio::time::Instant::now() >= c.at {
                        c.busy.cancel();
                    }
                    c.moved(taken);
                    carried.extend(std::mem::take(&mut running));
                }
            }
        }
    }
}

/// Take in one finished attempt: count it, or buffer its outcome or hold.
#[allow(clippy::too_many_arguments)]
fn finished(
    shared: &Shared,
    (id, attempt, resent_at): Key,
    result: Result<Attempted, Payload>,
    buffer: &mut OutcomeBuffer,
    holds: &mut Vec<HoldRow>,
    panics: &mut Panics,
    report: &mut Tally,
) {
    match result {
        Ok(Attempted::Step(Step::Done(outcome))) => {
            outcomes::count(shared, &outcome);
            report.add(&outcome);
        }
        Ok(Attempted::Step(Step::Write(finished))) => buffer.push(finished),
        Ok(Attempted::Hold {
            id,
            attempt,
            wait,
            why,
        }) => holds.push((id, attempt, wait, why)),
        Err(payload) => {
            // Count the panic as a failed attempt, so a delivery that
            // panics every time dies after its last attempt. Its message is
            // the operator's (the panic hook logged it); `last_error` and the
            // tenant's attempt history get the category only.
            report.panicked += 1;
            let observed = Observed {
                error: Some(Failure::Panicked.to_string()),
                ..Observed::default()
            };
            panics.record(payload);
            let next = attempt::after_failure(&shared.config.retry_schedule, (attempt, resent_at));
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

/// Sleeps until `at`, or forever when there is none.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// An endpoint's target prepared for a batch, with the address and secrets
/// it was made from.
struct Made {
    url: String,
    secret: Option<Sealed>,
    previous_secret: Option<Sealed>,
    target: Arc<Prepared>,
}

impl Made {
    fn new(shared: &Shared, row: &ClaimedRow) -> Made {
        Made {
            url: row.url.clone(),
            secret: row.secret.clone(),
            previous_secret: row.previous_secret.clone(),
            target: Arc::new(attempt::prepare(shared, row)),
        }
    }

    /// Whether `row` came with the address and secrets this was made from.
    fn is_for(&self, row: &ClaimedRow) -> bool {
        self.url == row.url
            && self.secret == row.secret
            && self.previous_secret == row.previous_secret
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use scheduler::panic_message;
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
