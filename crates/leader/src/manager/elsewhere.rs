//! The gauges a role's leader owns, zeroed on a replica that finds another
//! replica leading the role (docs/adr/0136).
//!
//! A role's backlog gauges are read by the replica that leads a tick, at its
//! end. A replica that stopped leading kept its last values, and alerts that
//! take the `max()` across replicas (a backlog's age) went on firing on that
//! stale value after the leader had cleared the backlog. A replica whose
//! ACQUIRE finds another term's lease live sets them to 0, so the `max()` is
//! the leader's. A replica that finds the role merely not due keeps them: it
//! may be the last leader, whose values are the current ones.

use super::Manager;
use crate::Role;

impl Manager {
    /// `names` are gauges (no labels) that `role`'s leader sets; this
    /// replica sets them to 0 each time it finds another replica leading
    /// `role`. For the service's wiring; call before the role loops start.
    #[must_use]
    pub fn with_led_gauges(mut self, role: Role, names: &'static [&'static str]) -> Manager {
        let mut map = (*self.led_gauges).clone();
        map.insert(role, names);
        self.led_gauges = std::sync::Arc::new(map);
        self
    }

    /// Called when ACQUIRE lost; `held`: to another term's live lease.
    pub(super) fn led_elsewhere(&self, role: Role, held: bool) {
        if !held {
            return;
        }
        for name in self.led_gauges.get(&role).copied().unwrap_or_default() {
            self.telemetry.gauge(name, &[]).set(0.0);
        }
    }
}
