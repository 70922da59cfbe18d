//! `Manager::lead`: one tick under a lease, with its heartbeat and its release.

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use db::Db;
use futures::FutureExt;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, warn};

use crate::announce::{Announcer, Heard};
use crate::heartbeat::{AbortOnDrop, Heartbeat, LostSignal, observe_drift};
use crate::schedule::{Due, Schedule};
use crate::store::{self, Acquire, Release, SlotStamp, StoreError};
use crate::{Fence, LostReason, Role, Telemetry, Tick, TickEnd, TickLog, TickOutcome, Timing};

mod reading;
pub(crate) use reading::Reading;
use reading::{epoch, until};

/// Runs ticks under leases. One per process; cheap to share by reference.
#[derive(Debug, Clone)]
pub struct Manager {
    db: Db,
    holder_id: String,
    timing: Timing,
    telemetry: Telemetry,
    announcer: Announcer,
    /// Each scheduled role's last reading of its lease row (docs/adr/0043).
    readings: Arc<Mutex<HashMap<Role, Reading>>>,
}

impl Manager {
    pub fn new(db: Db, timing: Timing, telemetry: Telemetry) -> Manager {
        Manager::with_holder_id(db, timing, telemetry, crate::holder_id())
    }

    /// # Panics
    /// If `timing` was altered after construction so that it breaks its
    /// invariant (see [`Timing`]): a programming error, not a runtime state.
    pub fn with_holder_id(
        db: Db,
        timing: Timing,
        telemetry: Telemetry,
        holder_id: String,
    ) -> Manager {
        if let Err(e) = timing.checked() {
            panic!("lease timing breaks its invariant: {e}");
        }
        Manager {
            db,
            holder_id,
            timing,
            telemetry,
            announcer: Announcer::default(),
            readings: Arc::default(),
        }
    }

    pub fn holder_id(&self) -> &str {
        &self.holder_id
    }

    pub fn timing(&self) -> Timing {
        self.timing
    }

    pub fn db(&self) -> &Db {
        &self.db
    }

    /// The tick ends this manager and its clones have announced, counted per
    /// role and outcome: each call of [`Manager::lead`] is counted once it has
    /// returned, after its RELEASE (or, for a panicking tick, just before the
    /// panic continues). A test waits on it (`wait_for`) for "the next tick
    /// ended" instead of sleeping; the role loops never read it.
    pub fn ticks(&self) -> watch::Receiver<TickLog> {
        self.announcer.subscribe()
    }

    /// ACQUIRE `role`; if won, run `work` under the lease and RELEASE it as
    /// the [`TickEnd`] it returns says (docs/adr/0007).
    ///
    /// The work runs with a [`Tick`]: the fence to pass to leader-only claims
    /// and a token cancelled on loss or on `shutdown`. A heartbeat renews the
    /// lease every `heartbeat`; a RENEW that finds no row of ours, or no
    /// acknowledged RENEW for `abandon_after`, cancels the work and drops it
    /// after `cancel_grace`. RELEASE runs on its own `statement_timeout`
    /// deadline whatever happened to the caller.
    ///
    /// An ACQUIRE answered `abandon_after` or more after it was sent starts no
    /// work: the lease is released as lost (`LostReason::HeartbeatTimeout`).
    /// If the heartbeat task ends without a verdict (a panic), the tick is
    /// abandoned at once (`LostReason::HeartbeatFailed`).
    ///
    /// # Errors
    /// Only ACQUIRE's: a database error, a missing lease row, or no answer
    /// within [`Timing::acquire_bound`] (a silent link). A failed
    /// RELEASE is logged; the lease then expires on its own. A completed tick
    /// whose RELEASE fails is therefore not stamped and runs again once the
    /// lease expires: the fence and the claims' CAS guards contain the rerun
    /// (docs/adr/0008).
    ///
    /// # Panics
    /// If `work` panics, the lease is released as panicked (or as lost or
    /// interrupted, which take precedence) and the panic continues from here.
    ///
    /// # Cancel safety
    /// Dropping the returned future mid-tick skips RELEASE: the lease expires
    /// after its TTL. Cancel through `shutdown` instead.
    pub async fn lead<F, Fut>(
        &self,
        role: Role,
        interval: Duration,
        shutdown: &CancellationToken,
        work: F,
    ) -> Result<TickOutcome, StoreError>
    where
        F: FnOnce(Tick) -> Fut,
        Fut: Future<Output = TickEnd>,
    {
        let t = self.timing;
        let sent = SystemTime::now();
        // The lease's expiry counts from the database's now() inside ACQUIRE, which
        // is no earlier than this instant: anchor the trust window here.
        let acquire_sent = Instant::now();
        let acquire = store::acquire(
            &self.db,
            role,
            &self.holder_id,
            t.ttl,
            interval,
            t.statement_timeout,
        );
        let acquired = store::answered(role, "ACQUIRE", t.acquire_bound(), acquire)
            .await
            .inspect_err(|_| self.announcer.announce(role, Heard::AcquireFailed, false));
        let token = match acquired? {
            Acquire::Lost {
                due_in,
                paused,
                held,
            } => {
                let retry_in = due_in.unwrap_or(t.max_poll).min(t.poll_cap(held));
                let outcome = TickOutcome::NotLed { retry_in, paused };
                self.announcer
                    .announce(role, Heard::Outcome(outcome), false);
                return Ok(outcome);
            }
            Acquire::Won {
                token,
                db_now_epoch,
            } => {
                observe_drift(&self.telemetry, role, sent, db_now_epoch);
                token
            }
        };
        let stamp = SlotStamp {
            schedule: Schedule::Every(interval).to_string(),
            slot: None,
            next_slot: None,
        };
        self.lead_won(role, token, interval, stamp, acquire_sent, shutdown, work)
            .await
    }

    /// [`Manager::lead`] for a role on `schedule`: an interval (exactly
    /// `lead`), or a cron schedule's slots (docs/adr/0043).
    ///
    /// On a cron schedule, the slot to claim is computed from this role's
    /// last reading of the lease row (its last completed slot and the
    /// database's clock, carried forward on the monotonic clock, never the
    /// replica's wall clock) and ACQUIRE takes it only once it has come on
    /// the database clock and is later than the last completed slot. A won
    /// tick covers the latest slot that has come by ACQUIRE's clock; the
    /// slots skipped between the last completed one and it (a downtime) are
    /// logged, counted in `hardcount_leader_slots_missed_total{role}` by the
    /// tick that completes the slot, and run as that one tick. A tick that completes stamps its slot; any
    /// other end leaves it due, retried after the usual cooldown (the
    /// cooldowns' "interval" is the gap to the slot after).
    ///
    /// # Errors, Panics, Cancel safety
    /// As [`Manager::lead`].
    pub async fn lead_on<F, Fut>(
        &self,
        role: Role,
        schedule: &Schedule,
        shutdown: &CancellationToken,
        work: F,
    ) -> Result<TickOutcome, StoreError>
    where
        F: FnOnce(Tick) -> Fut,
        Fut: Future<Output = TickEnd>,
    {
        let cron = match schedule {
            Schedule::Every(interval) => return self.lead(role, *interval, shutdown, work).await,
            Schedule::Cron(cron) => cron,
        };
        let t = self.timing;
        let reading = self.reading(role);
        let candidate = reading.as_ref().and_then(|r| r.candidate(cron));
        let sent = SystemTime::now();
        let acquire_sent = Instant::now();
        let acquire = store::acquire_slot(
            &self.db,
            role,
            &self.holder_id,
            t.ttl,
            candidate,
            t.statement_timeout,
        );
        let a = store::answered(role, "ACQUIRE", t.acquire_bound(), acquire)
            .await
            .inspect_err(|_| self.announcer.announce(role, Heard::AcquireFailed, false))?;
        let first_seen = reading.map_or(a.db_now, |r| r.first_seen);
        let since = a.since.unwrap_or(first_seen);
        if a.since.is_none() {
            // A role that has never completed a tick has no next slot on its
            // row (RELEASE writes it): export the first slot this replica
            // waits for, so that an alert on a role with no known tick can
            // tell "before its first slot" from "never ran" (docs/adr/0121).
            if let Some(first) = cron.next_after(since) {
                self.telemetry
                    .gauge(
                        "hardcount_leader_first_slot_timestamp_seconds",
                        &[("role", role.as_str())],
                    )
                    .set(epoch(first));
            }
        }
        self.remember(
            role,
            Reading {
                db_now: a.db_now,
                at: acquire_sent,
                since,
                first_seen,
            },
        );
        let Some(token) = a.token else {
            let retry_in = if a.paused {
                t.max_poll
            } else {
                match cron.due(since, a.db_now) {
                    // Due, but held, cooling down, or our slot was stale:
                    // poll once the row is free (never in a tight loop).
                    Due::Slot { .. } => a.blocked_for.max(SLOT_REPOLL),
                    Due::Wait { next } => a.blocked_for.max(until(a.db_now, next)),
                    Due::Never => t.max_poll,
                }
            }
            .min(t.poll_cap(a.held));
            let outcome = TickOutcome::NotLed {
                retry_in,
                paused: a.paused,
            };
            self.announcer
                .announce(role, Heard::Outcome(outcome), false);
            return Ok(outcome);
        };
        observe_drift(&self.telemetry, role, sent, epoch(a.db_now));
        // The latest slot that has come by ACQUIRE's clock: no earlier than
        // the one we asked for, which the database found due.
        let slot = match (cron.latest_at_or_before(a.db_now), candidate) {
            (Some(latest), Some(asked)) => latest.max(asked),
            (latest, asked) => latest.or(asked).unwrap_or(a.db_now),
        };
        let missed = if a.since.is_some() {
            cron.count_between(since, slot)
        } else {
            0
        };
        let next_slot = cron.next_after(slot);
        let late = until(slot, a.db_now);
        if missed > 0 {
            warn!(role = %role, slot = %slot, missed, at_least = missed >= crate::schedule::MISSED_COUNT_LIMIT,
                  since = %since, "slots were missed (the role was down or paused); running the latest once");
        }
        self.telemetry
            .histogram(
                "hardcount_leader_slot_lateness_seconds",
                &[("role", role.as_str())],
            )
            .record(late.as_secs_f64());
        info!(role = %role, slot = %slot, late = ?late, "slot due");
        // The cooldowns of a failed, lost or panicked tick are bounded by
        // the gap to the next slot, as an interval role's by its interval.
        let gap = next_slot
            .map_or(t.max_poll, |n| until(slot, n))
            .max(Duration::from_secs(1));
        let stamp = SlotStamp {
            schedule: schedule.to_string(),
            slot: Some(slot),
            next_slot,
        };
        let outcome = self
            .lead_won(role, token, gap, stamp, acquire_sent, shutdown, work)
            .await?;
        if outcome == TickOutcome::Completed {
            // What the RELEASE stamped: the next poll asks for the slot after.
            self.update_reading(role, |r| r.since = r.since.max(slot));
            // Counted by the tick that completes the slot, so once: every tick
            // of a slot not completed (a backlog's more_work, a failure), on
            // any replica, found the same slots missed since the last stamp.
            if missed > 0 {
                self.telemetry
                    .counter(
                        "hardcount_leader_slots_missed_total",
                        &[("role", role.as_str())],
                    )
                    .increment(missed);
            }
        }
        Ok(outcome)
    }

    /// Run a won tick (token `token`) to its RELEASE.
    #[allow(clippy::too_many_arguments)]
    async fn lead_won<F, Fut>(
        &self,
        role: Role,
        token: i64,
        interval: Duration,
        stamp: SlotStamp,
        acquire_sent: Instant,
        shutdown: &CancellationToken,
        work: F,
    ) -> Result<TickOutcome, StoreError>
    where
        F: FnOnce(Tick) -> Fut,
        Fut: Future<Output = TickEnd>,
    {
        let t = self.timing;
        let started = Instant::now();
        let lost = LostSignal::default();
        // Every line logged from here on (the tick's work, heartbeat and
        // release, and what this function says about them) is inside the
        // `tick` span: it carries the role, the token and a tick id of this
        // process, in text and JSON logs and in exported traces.
        let span = info_span!("tick", role = %role, token, tick = next_tick_id());
        async {
            // The trust window counts from ACQUIRE's send. A reply that came back
            // after the abandon deadline (queued in a pooler, a stalled process)
            // leaves no window to work in: run nothing and release it as lost.
            let waited = acquire_sent.elapsed();
            if waited >= t.abandon_after {
                warn!(role = %role, token, waited = ?waited, abandon_after = ?t.abandon_after,
                      "ACQUIRE answered past the abandon deadline; not starting the tick");
                lost.set(LostReason::HeartbeatTimeout);
                return Ok(self
                    .finish(
                        role,
                        token,
                        interval,
                        &stamp,
                        started,
                        Ending::Lost,
                        Ok(TickEnd::Drained),
                        &lost,
                    )
                    .await);
            }
            info!(holder = %self.holder_id, "lease acquired");
            let fence = Fence::won(role, token, stamp.slot);
            let cancel = shutdown.child_token();

            // Build the work before the heartbeat exists, so a closure that panics
            // while building it leaves nothing running.
            let work = std::panic::catch_unwind(AssertUnwindSafe(|| {
                work(Tick {
                    fence,
                    cancel: cancel.clone(),
                })
            }));
            let mut work = match work {
                Ok(fut) => Box::pin(AssertUnwindSafe(fut.instrument(span.clone())).catch_unwind()),
                Err(payload) => {
                    self.finish(
                        role,
                        token,
                        interval,
                        &stamp,
                        started,
                        Ending::Returned,
                        Err(payload),
                        &lost,
                    )
                    .await;
                    unreachable!("finish re-raises the panic");
                }
            };
            // Aborted on drop: if this future is dropped mid-tick, nothing renews the
            // lease and it expires after its TTL.
            let heartbeat = AbortOnDrop(tokio::spawn(
                Heartbeat {
                    db: self.db.clone(),
                    role,
                    token,
                    timing: t,
                    lost: lost.clone(),
                    telemetry: self.telemetry.clone(),
                    last_ack: acquire_sent,
                }
                .run()
                .instrument(span.clone()),
            ));

            let mut heartbeat = heartbeat;
            let (mut ending, mut result) = tokio::select! {
                r = &mut work => (Ending::Returned, Some(r)),
                _ = lost.token.cancelled() => (Ending::Lost, None),
                ended = &mut heartbeat.0 => {
                    // The heartbeat returns only after reporting a loss. Ending
                    // without one (a panic) leaves nothing renewing the lease, so
                    // nothing would abandon it either: abandon now.
                    if lost.reason().is_none() {
                        let panicked = ended.as_ref().err().is_some_and(|e| e.is_panic());
                        warn!(role = %role, token, panicked, "the heartbeat ended without a verdict; abandoning the lease");
                        lost.set(LostReason::HeartbeatFailed);
                    }
                    (Ending::Lost, None)
                }
                _ = shutdown.cancelled() => (Ending::Shutdown, None),
            };
            // Work that returned once shutdown had begun was cut short by it (its
            // cancel token is a child of shutdown); work that returned before any
            // shutdown completed, whatever happens next.
            if ending == Ending::Returned && shutdown.is_cancelled() {
                ending = Ending::Shutdown;
            }
            if result.is_none() {
                // Lost or shutting down: ask the work to stop, give it the grace, then drop it.
                cancel.cancel();
                result = tokio::time::timeout(t.cancel_grace, &mut work).await.ok();
                if result.is_none() {
                    warn!(role = %role, token, grace = ?t.cancel_grace, "tick did not return after cancel; dropped");
                }
            }
            drop(work);
            drop(heartbeat);

            // No result: the work was dropped after its grace; the ending (lost or
            // shutdown) decides the release.
            let result = result.unwrap_or(Ok(TickEnd::Drained));
            Ok(self
                .finish(role, token, interval, &stamp, started, ending, result, &lost)
                .await)
        }
        .instrument(span.clone())
        .await
    }

    /// Decide the outcome, report it, RELEASE, announce it, and re-raise a panic.
    ///
    /// Precedence: a lost lease first (reported once), then a shutdown that
    /// cancelled the tick, then a panic, then the work's own [`TickEnd`]. A
    /// tick whose work returned before a shutdown arrived is not "interrupted".
    #[allow(clippy::too_many_arguments)]
    async fn finish(
        &self,
        role: Role,
        token: i64,
        interval: Duration,
        stamp: &SlotStamp,
        started: Instant,
        ending: Ending,
        result: Result<TickEnd, Box<dyn std::any::Any + Send>>,
        lost: &LostSignal,
    ) -> TickOutcome {
        let t = self.timing;
        let (end, panic) = match result {
            Ok(end) => (Some(end), None),
            Err(payload) => (None, Some(payload)),
        };
        let (mut outcome, release) = if let Some(reason) = lost.reason() {
            (TickOutcome::Lost(reason), Release::Lost)
        } else if ending == Ending::Shutdown {
            (TickOutcome::Interrupted, Release::Interrupted)
        } else {
            match &end {
                None => (TickOutcome::Completed, Release::Panicked),
                Some(TickEnd::Drained) => (TickOutcome::Completed, Release::Completed),
                Some(TickEnd::DrainedDueNow) => (TickOutcome::Completed, Release::CompletedDueNow),
                Some(TickEnd::MoreWork) => (TickOutcome::MoreWork, Release::MoreWork),
                Some(TickEnd::Failed(error)) => {
                    warn!(role = %role, token, %error, "tick failed; released with the failure cooldown");
                    (TickOutcome::Failed, Release::Failed)
                }
            }
        };
        // A slot is done once its tick completes: "due again at once" would
        // mean the same slot again, which a slot never is (docs/adr/0043).
        let release = match release {
            Release::CompletedDueNow if stamp.slot.is_some() => Release::Completed,
            other => other,
        };
        if panic.is_some() && !matches!(outcome, TickOutcome::Lost(_)) {
            self.lease_lost(role, "panicked");
        }
        if let TickOutcome::Lost(reason) = outcome {
            self.lease_lost(role, reason.as_str());
        }

        let released = tokio::time::timeout(
            t.statement_timeout + store::CLIENT_MARGIN,
            store::release(
                &self.db,
                role,
                token,
                release,
                interval,
                t.failure_cooldown,
                stamp,
                t.statement_timeout,
            ),
        )
        .await;
        let release = match released {
            Ok(Ok(done)) if done.recorded != release => {
                // Its lease expired before the release: its claims proved a
                // false fence, so "drained" meant nothing claimed (docs/adr/0145).
                warn!(role = %role, token, outcome = release.as_str(), "lease expired before the release; recorded lost");
                outcome = TickOutcome::Lost(LostReason::Expired);
                self.lease_lost(role, LostReason::Expired.as_str());
                done.recorded
            }
            Ok(Ok(done)) => {
                info!(role = %role, token, outcome = release.as_str(), changed = done.changed, elapsed = ?started.elapsed(), "lease released");
                release
            }
            Ok(Err(e)) => {
                warn!(role = %role, token, outcome = release.as_str(), error = %e, "release failed; the lease will expire");
                release
            }
            Err(_) => {
                warn!(role = %role, token, outcome = release.as_str(), "release timed out; the lease will expire");
                release
            }
        };
        self.telemetry
            .histogram(
                "hardcount_leader_tick_duration_seconds",
                &[("role", role.as_str()), ("outcome", release.as_str())],
            )
            .record(started.elapsed().as_secs_f64());
        self.telemetry
            .counter(
                "hardcount_tick_total",
                &[("role", role.as_str()), ("end", release.tick_end_label())],
            )
            .increment(1);
        self.announcer
            .announce(role, Heard::Outcome(outcome), panic.is_some());

        if let Some(payload) = panic {
            std::panic::resume_unwind(payload);
        }
        outcome
    }

    fn lease_lost(&self, role: Role, reason: &str) {
        self.telemetry
            .counter(
                "hardcount_leader_lease_lost_total",
                &[("role", role.as_str()), ("reason", reason)],
            )
            .increment(1);
    }
}

/// How soon a due slot that ACQUIRE did not give us is asked for again, when
/// nothing on the row says how long it is held: not a tight loop.
const SLOT_REPOLL: Duration = Duration::from_millis(20);

/// Which arm ended the wait for the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Returned,
    Lost,
    Shutdown,
}

/// A tick id unique within this process, for the `tick` span's field.
fn next_tick_id() -> u64 {
    static TICKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    TICKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
}
