//! What a manager remembers of a scheduled role's row between ticks: the
//! last ACQUIRE's reading of the database clock and of the last slot, from
//! which the next slot is proposed without reading the replica's wall clock.

use std::collections::HashMap;
use std::time::Instant;

use chrono::{DateTime, TimeDelta, Utc};

use super::Manager;
use crate::Role;
use crate::schedule::{CronSchedule, Due};

impl Manager {
    pub(super) fn reading(&self, role: Role) -> Option<Reading> {
        self.lock_readings().get(&role).copied()
    }

    pub(super) fn remember(&self, role: Role, reading: Reading) {
        self.lock_readings().insert(role, reading);
    }

    pub(super) fn update_reading(&self, role: Role, f: impl FnOnce(&mut Reading)) {
        if let Some(r) = self.lock_readings().get_mut(&role) {
            f(r);
        }
    }

    fn lock_readings(&self) -> std::sync::MutexGuard<'_, HashMap<Role, Reading>> {
        self.readings.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One ACQUIRE's reading of a scheduled role's row, on the database clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reading {
    /// The database's clock at the statement.
    pub(crate) db_now: DateTime<Utc>,
    /// When the statement was sent, on the monotonic clock: `db_now` is
    /// carried forward from here, so the replica's wall clock is never read.
    pub(crate) at: Instant,
    /// The last completed slot (else the last completed tick, else
    /// `first_seen`): slots after it are due.
    pub(crate) since: DateTime<Utc>,
    /// The database's clock at this process's first reading of the row.
    pub(crate) first_seen: DateTime<Utc>,
}

impl Reading {
    /// The database's clock now, as this reading and the monotonic clock say.
    pub(crate) fn db_now_at(&self, now: Instant) -> DateTime<Utc> {
        let elapsed = now.saturating_duration_since(self.at);
        self.db_now + TimeDelta::from_std(elapsed).unwrap_or(TimeDelta::MAX)
    }

    /// The slot to ask ACQUIRE for: the due one, or else the next (which
    /// ACQUIRE refuses until it has come on the database clock).
    pub(crate) fn candidate(&self, cron: &CronSchedule) -> Option<DateTime<Utc>> {
        match cron.due(self.since, self.db_now_at(Instant::now())) {
            Due::Slot { slot, .. } => Some(slot),
            Due::Wait { next } => Some(next),
            Due::Never => None,
        }
    }
}

/// `to - from` as a duration, zero when `to` is not later.
pub(super) fn until(from: DateTime<Utc>, to: DateTime<Utc>) -> std::time::Duration {
    (to - from).to_std().unwrap_or(std::time::Duration::ZERO)
}

/// A database-clock instant as epoch seconds.
pub(super) fn epoch(t: DateTime<Utc>) -> f64 {
    t.timestamp_micros() as f64 / 1e6
}
