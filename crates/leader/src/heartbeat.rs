//! The heartbeat that renews a tick's lease, the loss it reports, and the
//! clock drift both lease statements let us see.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use db::Db;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::store::{self, Renew};
use crate::{LostReason, Role, Telemetry, Timing};

/// A task aborted when this handle is dropped.
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The first loss the heartbeat saw, and a token cancelled when it did.
#[derive(Clone, Default)]
pub(crate) struct LostSignal {
    pub(crate) token: CancellationToken,
    reason: Arc<Mutex<Option<LostReason>>>,
}

impl LostSignal {
    pub(crate) fn set(&self, reason: LostReason) {
        let mut r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        r.get_or_insert(reason);
        self.token.cancel();
    }

    pub(crate) fn reason(&self) -> Option<LostReason> {
        *self.reason.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The task that renews one tick's lease while its work runs.
pub(crate) struct Heartbeat {
    pub(crate) db: Db,
    pub(crate) role: Role,
    pub(crate) token: i64,
    pub(crate) timing: Timing,
    pub(crate) lost: LostSignal,
    pub(crate) telemetry: Telemetry,
    /// Send instant of the last acknowledged statement (ACQUIRE at first).
    pub(crate) last_ack: Instant,
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
    pub(crate) async fn run(self) {
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
                    observe_drift(&self.telemetry, self.role, sent_wall, db_now_epoch);
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
        self.telemetry
            .counter(
                "hardcount_leader_heartbeat_missed_total",
                &[("role", self.role.as_str())],
            )
            .increment(1);
    }
}

/// Database clock minus application clock, seen through `RETURNING now()`.
/// Exported as a gauge; never used in a decision.
pub(crate) fn observe_drift(
    telemetry: &Telemetry,
    role: Role,
    sent: SystemTime,
    db_now_epoch: f64,
) {
    let received = SystemTime::now();
    let epoch = |s: SystemTime| {
        s.duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64()
    };
    let midpoint = (epoch(sent) + epoch(received)) / 2.0;
    let drift = db_now_epoch - midpoint;
    telemetry
        .gauge(
            "hardcount_leader_clock_drift_seconds",
            &[("role", role.as_str())],
        )
        .set(drift);
    debug!(role = %role, drift_seconds = drift, "database clock drift");
}
