//! Leader leases: a row per role, claimed for one tick, fenced by a token.
//!
//! This crate knows nothing about billing or webhooks. It owns `leader_leases`'
//! four statements ([`store`]), the runtime that drives them ([`Manager::lead`]),
//! and the [`Fence`] a won lease hands to the tick's work.
//! [`Manager::ticks`] announces how each call of `lead` ended ([`TickLog`]),
//! so a caller (a test, above all) waits for a tick's end instead of sleeping.
//! [`Manager::lead_on`] leads a role on a [`Schedule`]: an interval, or a cron
//! expression's slots ([`schedule`]), each claimed by `store::acquire_slot`
//! only once it has come on the database clock and is later than the last
//! completed slot, which a completed tick's RELEASE stamps (docs/adr/0043).
//!
//! ```text
//!             ACQUIRE (1 row)                 work returns Drained
//!   idle ───────────────────────▶ leading ─────────────────▶ RELEASE completed
//!    ▲   0 rows: not due, held,     │  RENEW every heartbeat    (stamps last_tick_*)
//!    │   paused or cooling down     │
//!    │                              ├─ work returns DrainedDueNow ─▶ RELEASE completed_due_now
//!    │                              │     (stamped one interval back: due at once, docs/adr/0014)
//!    │                              ├─ work returns MoreWork ─▶ RELEASE more_work (due at once)
//!    │                              ├─ work returns Failed ───▶ RELEASE failed (min(interval, 30 s))
//!    │                              ├─ shutdown cancels ──────▶ RELEASE interrupted (no cooldown)
//!    │                              ├─ RENEW 0 rows / abandon ─▶ RELEASE lost (min(interval, 60 s))
//!    │                              └─ work panics ───────────▶ RELEASE panicked (interval), re-raise
//!    └──────────────────────────────────────────────────────────┘
//! ```
//!
//! The trust window: the work may act as leader from ACQUIRE until the first of
//! (a) a RENEW that finds no row of ours, (b) `abandon_after` since the send
//! instant of the last acknowledged statement that set the expiry (ACQUIRE,
//! then each RENEW), measured on the monotonic clock, (c) the heartbeat task
//! ending without a verdict (a panic). Because `abandon_after +
//! statement_timeout < ttl`, no lease statement of ours is started or still
//! running on the server when another replica can acquire, and the work is
//! cancelled by then. An ACQUIRE answered `abandon_after` or more after its
//! send opens no window: the work is not started and the lease is released
//! as lost. A missed beat is retried after `Timing::retry_pause` while a whole
//! statement still fits before the abandon deadline, so one transient error
//! does not lose the tick.
//!
//! What makes the window hold on the server (docs/adr/0008): each lease
//! statement runs in a transaction `db` began one round trip earlier on a
//! connection that is never pooled inside a transaction it did not finish
//! (a dropped BEGIN closes its connection); expiry is set and compared with
//! `statement_timestamp()`, and so is the fence; and every lease transaction
//! is ended by the server if its client stalls for `max(statement_timeout,
//! 1 s)`, so a frozen holder cannot keep the row locked past its TTL.
//! Tokens are at least the epoch milliseconds of their ACQUIRE, so they are
//! not reissued after a restore that lost committed ACQUIREs.
//!
//! The window does not bound the work's own statements: a job's statement may
//! run on past it (its own timeout, the cancel grace), and a frozen process
//! (GC pause, SIGSTOP) can outlive it entirely. That is what the fence is for:
//! every leader-only claim statement carries `AND leader_fence($role, $token)`
//! in its innermost WHERE, so a stale leader's claim returns zero rows in the
//! claim's own snapshot, and every completion after a claim lands by a
//! conditional write that a newer term's claim invalidates.
//!
//! Only a won lease builds a [`Fence`], and leader-only store methods take one
//! as an argument, so "forgot to fence" does not compile.
//!
//! The lease history (`leader_terms`, migration 0027) records every term,
//! written by the lease statements themselves (no extra round trip):
//! ACQUIRE inserts it, RENEW stamps its last renewal, RELEASE its release and
//! how the tick ended. [`overlapping_terms`] checks what [`store::history`]
//! reads back: no two terms of one role overlap, a term spanning its claim to
//! `min(released, last renewal + TTL)`.

mod announce;
mod heartbeat;
mod history;
mod manager;
pub mod schedule;
pub mod store;
mod telemetry;
mod tick;
mod timing;

use std::fmt;
use std::str::FromStr;

pub use announce::{RoleTicks, TickLog};
pub use history::{Overlap, overlapping_terms};
pub use manager::Manager;
pub use schedule::{CronSchedule, Due, Schedule, ScheduleError};
pub use store::{LeaseStatus, StoreError, Term};
pub use telemetry::Telemetry;
pub use tick::{Fence, LostReason, Tick, TickEnd, TickOutcome};
pub use timing::{Timing, TimingError};

/// The five singleton roles. The migration's CHECK lists the same names, pinned
/// by `the_role_list_equals_the_check_constraint`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Billing,
    Dunning,
    WebhookOutbox,
    EmailOutbox,
    WebhookDelivery,
}

impl Role {
    pub const ALL: [Role; 5] = [
        Role::Billing,
        Role::Dunning,
        Role::WebhookOutbox,
        Role::EmailOutbox,
        Role::WebhookDelivery,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Billing => "billing",
            Role::Dunning => "dunning",
            Role::WebhookOutbox => "webhook_outbox",
            Role::EmailOutbox => "email_outbox",
            Role::WebhookDelivery => "webhook_delivery",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown role name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown role {0:?}: expected one of billing, dunning, webhook_outbox, email_outbox, webhook_delivery"
)]
pub struct UnknownRole(pub String);

impl FromStr for Role {
    type Err = UnknownRole;

    fn from_str(s: &str) -> Result<Role, UnknownRole> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| UnknownRole(s.to_owned()))
    }
}

/// `hostname:pid:8hex`, identifying this process as a holder. Observability only.
pub fn holder_id() -> String {
    let host = hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "unknown".to_owned());
    format!(
        "{host}:{}:{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_names_round_trip_and_unknown_names_are_named() {
        for r in Role::ALL {
            assert_eq!(r.as_str().parse::<Role>().unwrap(), r);
        }
        let err = "biling".parse::<Role>().unwrap_err().to_string();
        assert!(err.contains("\"biling\""), "{err}");
    }

    #[test]
    fn holder_id_is_host_pid_8hex() {
        let id = holder_id();
        let parts: Vec<&str> = id.rsplitn(3, ':').collect();
        assert_eq!(parts[0].len(), 8, "{id}");
        assert!(parts[0].chars().all(|c| c.is_ascii_hexdigit()), "{id}");
        assert_eq!(parts[1], std::process::id().to_string());
    }
}
