//! What a tick's work receives ([`Tick`], its [`Fence`]) and how a tick ends: the
//! work's own [`TickEnd`], and the [`TickOutcome`] that `Manager::lead` returns.

use std::time::Duration;

use chrono::{DateTime, Utc};

use tokio_util::sync::CancellationToken;

use crate::Role;

/// Proof of a won lease: the role and the token its ACQUIRE returned.
///
/// Only [`Manager::lead`](crate::Manager::lead) constructs one, so a store
/// method that takes a `&Fence` cannot be called outside a tick. A clone that
/// outlives its tick is harmless: `leader_fence` is false for it once the term
/// has ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    role: Role,
    token: i64,
    /// The slot the tick covers, for a role on a cron schedule.
    slot: Option<DateTime<Utc>>,
}

impl Fence {
    /// Only `Manager::lead` calls this, with the token its ACQUIRE returned.
    pub(crate) fn won(role: Role, token: i64, slot: Option<DateTime<Utc>>) -> Fence {
        Fence { role, token, slot }
    }

    /// The slot this tick covers when the role runs on a cron schedule
    /// (docs/adr/0043): the latest that had come when the lease was won. None
    /// on an interval.
    pub fn slot(&self) -> Option<DateTime<Utc>> {
        self.slot
    }

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
    /// The tick ended as done, but its lease had expired before the release
    /// (nobody took over): its claims proved a false fence, so what read as
    /// drained was nothing claimed. Recorded lost (docs/adr/0145).
    Expired,
}

impl LostReason {
    /// The `reason` label on `hardcount_leader_lease_lost_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            LostReason::Superseded => "superseded",
            LostReason::Paused => "paused",
            LostReason::HeartbeatTimeout => "heartbeat_timeout",
            LostReason::HeartbeatFailed => "heartbeat_failed",
            LostReason::Expired => "expired",
        }
    }
}

/// How a tick's work says it ended; [`Manager::lead`](crate::Manager::lead)
/// turns it into a RELEASE (docs/adr/0007).
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

/// How one call of [`Manager::lead`](crate::Manager::lead) ended.
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
