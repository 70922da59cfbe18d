//! How often a role reads its backlog gauges (docs/adr/0138).
//!
//! The roles that tick every second read their backlog (a count and the
//! oldest row's age over every waiting row) as their tick ends. That read
//! grows with the backlog, not with the tick's work: an SMTP server down for
//! hours leaves a million emails queued on their retry schedule, the email
//! role's tick finds none or a few due every second, and each tick's read
//! counted the million again. [`BacklogReads`] lets a tick end with the read
//! only when the last one is at least its interval old, so the read costs the
//! same at any tick rate and the gauges are at most that interval behind the
//! last tick (`deploy/prometheus/prometheus.yml` scrapes every 15 s).

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The shipped interval between two backlog reads of one role on one
/// replica: a scrape interval.
pub const BACKLOG_READ_EVERY: Duration = Duration::from_secs(15);

/// When a role's tick ends with its backlog read. Shared by the role's
/// clones.
#[derive(Debug)]
pub struct BacklogReads {
    every: Duration,
    last: Mutex<Option<Instant>>,
}

impl BacklogReads {
    /// Reads at most once per `every`; [`Duration::ZERO`] reads at every
    /// tick's end.
    #[must_use]
    pub fn every(every: Duration) -> BacklogReads {
        BacklogReads {
            every,
            last: Mutex::new(None),
        }
    }

    /// Whether the tick ending now reads: the process's first tick, then one
    /// at least `every` after the last that read. Not reset when this replica
    /// leads again after another did: the rules read the newest stamp across
    /// replicas (docs/adr/0137), so the other's read stands meanwhile. It is recorded as read now whatever
    /// the read then comes to, so a read that times out on a huge backlog is
    /// not tried again at every tick either.
    pub fn due(&self) -> bool {
        self.due_at(Instant::now())
    }

    fn due_at(&self, now: Instant) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|at| now.duration_since(at) < self.every) {
            return false;
        }
        *last = Some(now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_tick_reads_then_none_until_the_interval_has_passed() {
        let reads = BacklogReads::every(Duration::from_secs(15));
        let start = Instant::now();
        let at = |secs| start + Duration::from_secs(secs);
        assert!(reads.due_at(at(0)));
        assert!(!reads.due_at(at(1)));
        assert!(!reads.due_at(at(14)));
        assert!(reads.due_at(at(15)));
        // From the read at 15 s, not from the tick at 14 s that did not read.
        assert!(!reads.due_at(at(29)));
        assert!(reads.due_at(at(30)));
    }

    #[test]
    fn zero_reads_at_every_tick() {
        let reads = BacklogReads::every(Duration::ZERO);
        assert!(reads.due());
        assert!(reads.due());
    }
}
