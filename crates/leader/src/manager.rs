//! `Manager::lead`: one tick under a lease, with its heartbeat and its release.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use db::Db;
use futures::FutureExt;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::store::{self, Acquire, Release, Renew, StoreError};
use crate::{Role, Telemetry, Timing};

/// Proof of a won lease: the role and the token its ACQUIRE returned.
///
/// Only [`Manager::lead`] constructs one, so a store method that takes a
/// `&Fence` cannot be called outside a tick. A clone that outlives its tick is
/// harmless: `leader_fence` is false for it once the term has ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    role: Role,
    token: i64,
}

impl Fence {
    pub fn role(&self) -> Role {
        self.role
    }

    /// The role's name, as the SQL `leader_fence($role, $token)` takes it.
    pub fn role_name(&self) -> &'static str {
        self.role.as_str()
    }

    pub fn token(&self) -> i64 {
        self.token
    }
}

/// What the tick's work receives.
#[derive(Debug, Clone)]
pub struct Tick {
    pub fence: Fence,
    /// Cancelled when the lease is lost or the process shuts down. Work that
    /// ignores it is dropped after `Timing::cancel_grace`.
    pub cancel: CancellationToken,
}

/// Why a lease was lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LostReason {
    /// A RENEW found another token (a takeover) or no holder (a release).
    Superseded,
    /// A RENEW found the role paused.
    Paused,
    /// No RENEW was acknowledged for `abandon_after`, or ACQUIRE itself was
    /// answered only after that long.
    HeartbeatTimeout,
    /// The heartbeat task ended without a verdict (it panicked): nothing
    /// renews the lease, so the tick is abandoned at once.
    HeartbeatFailed,
}

impl LostReason {
    /// The `reason` label on `hardcount_leader_lease_lost_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            LostReason::Superseded => "superseded",
            LostReason::Paused => "paused",
            LostReason::HeartbeatTimeout => "heartbeat_timeout",
            LostReason::HeartbeatFailed => "heartbeat_failed",
        }
    }
}

/// How a tick's work says it ended; [`Manager::lead`] turns it into a RELEASE
/// (docs/adr/0007).
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "the tick's end decides its release: return it to Manager::lead"]
pub enum TickEnd {
    /// Nothing is left: released as completed, due again after the interval.
    Drained,
    /// Stopped at its budget with work left: released due again at once,
    /// without stamping the tick as completed.
    MoreWork,
    /// An error the tick could not absorb (a statement timeout, a dropped
    /// connection, a provider outage): not stamped completed, due again after
    /// the short failure cooldown (`min(interval, Timing::failure_cooldown)`).
    Failed(String),
    /// Nothing is left, but the role wants to run again at once: it found
    /// work this tick (more may have come meanwhile) or it listens for
    /// wake-ups and keeps a tick open. Released as completed, stamped one
    /// interval back so it is due at once (docs/adr/0014).
    DrainedDueNow,
}

impl TickEnd {
    /// The `end` label on `hardcount_tick_total` for a tick that returned.
    pub fn as_str(&self) -> &'static str {
        match self {
            TickEnd::Drained | TickEnd::DrainedDueNow => "drained",
            TickEnd::MoreWork => "more_work",
            TickEnd::Failed(_) => "failed",
        }
    }
}

/// How one call of [`Manager::lead`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TickOutcome {
    /// Not acquired. `retry_in` is when to poll again: the row's own due time on
    /// the database clock, capped at `max_poll`.
    NotLed {
        retry_in: Duration,
        paused: bool,
    },
    /// The work drained its queue; released as completed.
    Completed,
    /// The work stopped at its budget with work left; released due at once.
    MoreWork,
    /// The work failed; released with the failure cooldown.
    Failed,
    /// Shutdown cancelled the tick.
    Interrupted,
    Lost(LostReason),
}

/// Runs ticks under leases. One per process; cheap to share by reference.
#[derive(Debug, Clone)]
pub struct Manager {
    db: Db,
    holder_id: String,
    timing: Timing,
    telemetry: Telemetry,
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
    /// Only ACQUIRE's: a database error or a missing lease row. A failed
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
        let token = match store::acquire(
            &self.db,
            role,
            &self.holder_id,
            t.ttl,
            interval,
            t.statement_timeout,
        )
        .await?
        {
            Acquire::Lost { due_in, paused } => {
                let retry_in = due_in.unwrap_or(t.max_poll).min(t.max_poll);
                return Ok(TickOutcome::NotLed { retry_in, paused });
            }
            Acquire::Won {
                token,
                db_now_epoch,
            } => {
                self.observe_drift(role, sent, db_now_epoch);
                token
            }
        };
        let started = Instant::now();
        let lost = LostSignal::default();
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
                    started,
                    Ending::Lost,
                    Ok(TickEnd::Drained),
                    &lost,
                )
                .await);
        }
        info!(role = %role, token, holder = %self.holder_id, "lease acquired");
        let fence = Fence { role, token };
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
            Ok(fut) => Box::pin(AssertUnwindSafe(fut).catch_unwind()),
            Err(payload) => {
                self.finish(
                    role,
                    token,
                    interval,
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
                manager: self.clone(),
                last_ack: acquire_sent,
            }
            .run(),
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
            .finish(role, token, interval, started, ending, result, &lost)
            .await)
    }

    /// Decide the outcome, report it, RELEASE, and re-raise a panic.
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
        let (outcome, release) = if let Some(reason) = lost.reason() {
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
        if panic.is_some() && !matches!(outcome, TickOutcome::Lost(_)) {
            self.lease_lost(role, "panicked");
        }
        if let TickOutcome::Lost(reason) = outcome {
            self.lease_lost(role, reason.as_str());
        }

        let released = tokio::time::timeout(
            t.statement_timeout + Duration::from_millis(500),
            store::release(
                &self.db,
                role,
                token,
                release,
                interval,
                t.failure_cooldown,
                t.statement_timeout,
            ),
        )
        .await;
        match released {
            Ok(Ok(changed)) => info!(
                role = %role, token, outcome = release.as_str(), changed, elapsed = ?started.elapsed(),
                "lease released"
            ),
            Ok(Err(e)) => {
                warn!(role = %role, token, outcome = release.as_str(), error = %e, "release failed; the lease will expire")
            }
            Err(_) => {
                warn!(role = %role, token, outcome = release.as_str(), "release timed out; the lease will expire")
            }
        }
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

    /// Database clock minus application clock, seen through `RETURNING now()`.
    /// Exported as a gauge; never used in a decision.
    fn observe_drift(&self, role: Role, sent: SystemTime, db_now_epoch: f64) {
        let received = SystemTime::now();
        let epoch = |s: SystemTime| {
            s.duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs_f64()
        };
        let midpoint = (epoch(sent) + epoch(received)) / 2.0;
        let drift = db_now_epoch - midpoint;
        self.telemetry
            .gauge(
                "hardcount_leader_clock_drift_seconds",
                &[("role", role.as_str())],
            )
            .set(drift);
        debug!(role = %role, drift_seconds = drift, "database clock drift");
    }
}

/// Which arm ended the wait for the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Returned,
    Lost,
    Shutdown,
}

/// A task aborted when this handle is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The first loss the heartbeat saw, and a token cancelled when it did.
#[derive(Clone, Default)]
struct LostSignal {
    token: CancellationToken,
    reason: Arc<Mutex<Option<LostReason>>>,
}

impl LostSignal {
    fn set(&self, reason: LostReason) {
        let mut r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        r.get_or_insert(reason);
        self.token.cancel();
    }

    fn reason(&self) -> Option<LostReason> {
        *self.reason.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct Heartbeat {
    db: Db,
    role: Role,
    token: i64,
    timing: Timing,
    lost: LostSignal,
    manager: Manager,
    /// Send instant of the last acknowledged statement (ACQUIRE at first).
    last_ack: Instant,
}

impl Heartbeat {
    /// Renew every `heartbeat`. The last acknowledgement is anchored at the
    /// send instant of the statement that set the expiry (ACQUIRE, then each
    /// acknowledged RENEW) on the monotonic clock; "abandon" is checked before
    /// each RENEW is sent and raced against one in flight, so no RENEW starts
    /// after it and the work is cancelled on time even if the database hangs.
    ///
    /// A missed beat (an error or no answer) is retried after
    /// [`Timing::retry_pause`] while a whole statement still fits before the
    /// abandon deadline, so one transient failure does not lose the lease.
    async fn run(self) {
        let t = self.timing;
        let mut last_ack = self.last_ack;
        let mut next_beat = last_ack + t.heartbeat;
        let mut retrying = false;
        loop {
            let abandon_at = last_ack + t.abandon_after;
            tokio::time::sleep_until(next_beat.min(abandon_at).into()).await;
            let now = Instant::now();
            if now >= abandon_at || (retrying && now + t.statement_timeout >= abandon_at) {
                // A retry that cannot finish before the deadline is not sent.
                tokio::time::sleep_until(abandon_at.into()).await;
                self.abandon(last_ack);
                return;
            }
            let sent_at = Instant::now();
            let sent_wall = SystemTime::now();
            let renew = store::renew(&self.db, self.role, self.token, t.ttl, t.statement_timeout);
            // The server cancels the statement at statement_timeout; the client
            // gives it a little longer to say so. Abandon does not wait for it.
            let renew =
                tokio::time::timeout(t.statement_timeout + Duration::from_millis(250), renew);
            let outcome = tokio::select! {
                r = renew => r,
                _ = tokio::time::sleep_until(abandon_at.into()) => {
                    self.abandon(last_ack);
                    return;
                }
            };
            match outcome {
                Ok(Ok(Renew::Extended { db_now_epoch })) => {
                    last_ack = sent_at;
                    next_beat = sent_at + t.heartbeat;
                    retrying = false;
                    self.manager
                        .observe_drift(self.role, sent_wall, db_now_epoch);
                }
                Ok(Ok(Renew::Gone { paused })) => {
                    let reason = if paused {
                        LostReason::Paused
                    } else {
                        LostReason::Superseded
                    };
                    info!(role = %self.role, token = self.token, reason = reason.as_str(), "lease lost");
                    self.lost.set(reason);
                    return;
                }
                Ok(Err(e)) => self.missed(&e.to_string()),
                Err(_) => self.missed("no answer within the statement timeout"),
            }
            if last_ack != sent_at {
                // Missed: retry soon rather than at the next regular beat,
                // which would land on the abandon deadline.
                next_beat = Instant::now() + t.retry_pause();
                retrying = true;
            }
        }
    }

    fn abandon(&self, last_ack: Instant) {
        warn!(role = %self.role, token = self.token, since_ack = ?last_ack.elapsed(), "no renewal acknowledged in time; abandoning the lease");
        self.lost.set(LostReason::HeartbeatTimeout);
    }

    fn missed(&self, why: &str) {
        warn!(role = %self.role, token = self.token, error = why, "lease renewal missed a beat");
        self.manager
            .telemetry
            .counter(
                "hardcount_leader_heartbeat_missed_total",
                &[("role", self.role.as_str())],
            )
            .increment(1);
    }
}
