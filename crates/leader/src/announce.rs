//! Announced tick ends: every call of `Manager::lead` is counted, per role and
//! outcome, in a value a caller can watch. The role loops do not read it; it is
//! how a test (or an operator's tool in the process) waits for "the next tick
//! ended" or "a tick failed" instead of sleeping for a guess.

use std::sync::Arc;

use tokio::sync::watch;

use crate::{Role, TickOutcome};

/// What one role's calls of `Manager::lead` have ended in so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RoleTicks {
    /// Polls that did not win the lease (`TickOutcome::NotLed`).
    pub not_led: u64,
    /// ACQUIREs that returned an error.
    pub acquire_failed: u64,
    pub completed: u64,
    pub more_work: u64,
    pub failed: u64,
    pub interrupted: u64,
    pub lost: u64,
    /// Ticks whose work panicked, whatever their outcome.
    pub panicked: u64,
    /// The outcome of the last call that reached one.
    pub last: Option<TickOutcome>,
}

impl RoleTicks {
    /// Ticks that ran under a won lease, however they ended.
    pub fn led(&self) -> u64 {
        self.completed + self.more_work + self.failed + self.interrupted + self.lost
    }

    /// Every call of `Manager::lead` that has returned (or re-raised).
    pub fn calls(&self) -> u64 {
        self.led() + self.not_led + self.acquire_failed
    }
}

/// Every role's [`RoleTicks`], as announced by one `Manager` and its clones.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TickLog {
    roles: [RoleTicks; Role::ALL.len()],
}

impl TickLog {
    pub fn role(&self, role: Role) -> &RoleTicks {
        &self.roles[index(role)]
    }
}

fn index(role: Role) -> usize {
    Role::ALL
        .iter()
        .position(|r| *r == role)
        .expect("Role::ALL lists every role")
}

/// The sending side, shared by a manager's clones.
#[derive(Clone, Default)]
pub(crate) struct Announcer(Arc<watch::Sender<TickLog>>);

impl std::fmt::Debug for Announcer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Announcer")
    }
}

/// How one call of `Manager::lead` ended, as announced.
pub(crate) enum Heard {
    Outcome(TickOutcome),
    AcquireFailed,
}

impl Announcer {
    pub(crate) fn subscribe(&self) -> watch::Receiver<TickLog> {
        self.0.subscribe()
    }

    /// Count one call's end. Never blocks; a value nobody watches costs one
    /// uncontended lock.
    pub(crate) fn announce(&self, role: Role, heard: Heard, panicked: bool) {
        self.0.send_modify(|log| {
            let r = &mut log.roles[index(role)];
            if panicked {
                r.panicked += 1;
            }
            let outcome = match heard {
                Heard::AcquireFailed => {
                    r.acquire_failed += 1;
                    return;
                }
                Heard::Outcome(o) => o,
            };
            match outcome {
                TickOutcome::NotLed { .. } => r.not_led += 1,
                TickOutcome::Completed => r.completed += 1,
                TickOutcome::MoreWork => r.more_work += 1,
                TickOutcome::Failed => r.failed += 1,
                TickOutcome::Interrupted => r.interrupted += 1,
                TickOutcome::Lost(_) => r.lost += 1,
            }
            r.last = Some(outcome);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LostReason;

    #[test]
    fn each_end_is_counted_under_its_role_and_the_last_outcome_kept() {
        let a = Announcer::default();
        let mut seen = a.subscribe();
        let not_led = TickOutcome::NotLed {
            retry_in: std::time::Duration::from_millis(5),
            paused: false,
        };
        a.announce(Role::Billing, Heard::Outcome(not_led), false);
        a.announce(Role::Billing, Heard::Outcome(TickOutcome::Completed), true);
        a.announce(Role::Billing, Heard::AcquireFailed, false);
        a.announce(
            Role::Dunning,
            Heard::Outcome(TickOutcome::Lost(LostReason::Paused)),
            false,
        );
        assert!(seen.has_changed().unwrap());
        let log = seen.borrow_and_update().clone();
        let billing = log.role(Role::Billing);
        assert_eq!(
            (
                billing.not_led,
                billing.completed,
                billing.panicked,
                billing.acquire_failed
            ),
            (1, 1, 1, 1)
        );
        assert_eq!((billing.led(), billing.calls()), (1, 3));
        assert_eq!(billing.last, Some(TickOutcome::Completed));
        assert_eq!(log.role(Role::Dunning).lost, 1);
        assert_eq!(*log.role(Role::EmailOutbox), RoleTicks::default());
    }
}
