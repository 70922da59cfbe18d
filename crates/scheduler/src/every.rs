//! Work done at most once per an interval ([`Every`]): a role's backlog
//! read (docs/adr/0138), its prune (docs/adr/0040), the delivery role's look
//! for endpoints to turn off.
//!
//! The roles that tick every second read their backlog (a count and the
//! oldest row's age over every waiting row) as their tick ends. That read
//! grows with the backlog, not with the tick's work: an SMTP server down for
//! hours leaves a million emails queued on their retry schedule, the email
//! role's tick finds none or a few due every second, and each tick's read
//! counted the million again. An [`Every`] lets a tick end with the read
//! only when the last one is at least its interval old, so the read costs the
//! same at any tick rate and the gauges are at most that interval behind the
//! last tick (`deploy/prometheus/prometheus.yml` scrapes every 15 s).

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The shipped interval between two backlog reads of one role on one
/// replica: a scrape interval.
pub const BACKLOG_READ_EVERY: Duration = Duration::from_secs(15);

/// Whether some work is due now: at most once per an interval, on one
/// replica. Shared by a role's clones.
#[derive(Debug)]
pub struct Every {
    every: Duration,
    last: Mutex<Option<Instant>>,
}

impl Every {
    /// Due at most once per `every`; [`Duration::ZERO`] is due at every ask.
    #[must_use]
    pub fn new(every: Duration) -> Every {
        Every {
            every,
            last: Mutex::new(None),
        }
    }

    /// Whether the work is due now: at the first ask, then at least `every`
    /// after the last ask that was due. A due ask is recorded as done now,
    /// whatever the work then comes to: a backlog read that times out on a
    /// huge backlog is not tried again at every tick either. For the backlog
    /// read, the process's first tick reads, and the gate is not reset when
    /// this replica leads again after another did: the rules read the newest
    /// stamp across replicas (docs/adr/0137), so the other's read stands.
    pub fn due(&self) -> bool {
        self.due_at(Instant::now())
    }

    /// [`Every::due`] at `now`.
    pub fn due_at(&self, now: Instant) -> bool {
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
        let reads = Every::new(Duration::from_secs(15));
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
        let reads = Every::new(Duration::ZERO);
        assert!(reads.due());
        assert!(reads.due());
    }
}
