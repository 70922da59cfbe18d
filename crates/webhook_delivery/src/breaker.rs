//! The circuit breaker: an endpoint whose attempts keep timing out is backed
//! off, so its deliveries wait in the table instead of holding slots for the
//! whole request timeout each (issue 12, point 6; docs/adr/0018).
//!
//! ```text
//!            timeout (count < threshold)        any answer, or a failure
//!              ┌────┐                            that is not a timeout
//!              ▼    │                          ┌────────────────────────┐
//!          ┌────────┴─┐  threshold-th timeout  ▼                        │
//!   ──────▶│  closed  │──────────────────────▶ open ── cool-off ends ──▶ half-open
//!          └──────────┘                        ▲  (held: not attempted)   (one trial;
//!               ▲                              │                           others held)
//!               │        trial times out: open again, cool-off doubled    │
//!               │        (at most MAX_COOLOFF_DOUBLINGS times)            │
//!               └──────── trial answered (any status) or failed otherwise ┘
//! ```
//!
//! A delivery the breaker holds is handed back unsent, due again when the
//! breaker lets an attempt through (`store::hold_unsent`):
//! its attempt is not counted, so the attempts ceiling counts only requests
//! made, and it is not claimed again until then.
//!
//! The state is in memory, per worker: a new leader starts with every breaker
//! closed and learns again after `threshold` timeouts (docs/adr/0018 says why).
//! No SQL and no I/O here; the clock is passed in.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A failed trial doubles the cool-off at most this many times (30 s becomes 8 min).
pub(crate) const MAX_COOLOFF_DOUBLINGS: u32 = 4;

/// What the breaker lets a delivery of an endpoint do now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Send it.
    Go,
    /// Send it as the half-open trial: its result closes or reopens the breaker.
    Trial,
    /// Do not send it; hand it back to come due after this long.
    Hold(Duration),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Consecutive timeouts so far.
    Closed { timeouts: u32 },
    /// Nothing goes through until `until`; `doublings` failed trials so far.
    Open { until: Instant, doublings: u32 },
    /// One trial in flight since `since`; the rest are held.
    HalfOpen { since: Instant, doublings: u32 },
}

/// Every endpoint's breaker, shared by the worker's clones.
#[derive(Debug)]
pub(crate) struct Breakers {
    threshold: u32,
    cooloff: Duration,
    /// A trial not reported within this long (its task was dropped) no longer
    /// blocks another: the request timeout plus a margin.
    trial_limit: Duration,
    states: Mutex<HashMap<i64, State>>,
}

impl Breakers {
    pub fn new(threshold: u32, cooloff: Duration, request_timeout: Duration) -> Breakers {
        Breakers {
            threshold,
            cooloff,
            trial_limit: request_timeout + Duration::from_secs(1),
            states: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i64, State>> {
        self.states.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// While the endpoint's breaker is open (not yet half-open), how long it
    /// stays so; `None` otherwise. Takes no trial: for sorting a claimed batch.
    pub fn open_for(&self, endpoint: i64, now: Instant) -> Option<Duration> {
        match self.lock().get(&endpoint) {
            Some(State::Open { until, .. }) if *until > now => Some(*until - now),
            _ => None,
        }
    }

    /// Whether a delivery of `endpoint` may be sent now; when the breaker is
    /// half-open and no trial is in flight, this delivery becomes the trial.
    pub fn admit(&self, endpoint: i64, now: Instant) -> Admit {
        let mut states = self.lock();
        let Some(state) = states.get_mut(&endpoint) else {
            return Admit::Go;
        };
        match *state {
            State::Closed { .. } => Admit::Go,
            State::Open { until, .. } if until > now => Admit::Hold(until - now),
            State::Open { doublings, .. } => {
                *state = State::HalfOpen {
                    since: now,
                    doublings,
                };
                Admit::Trial
            }
            State::HalfOpen { since, doublings } if now >= since + self.trial_limit => {
                *state = State::HalfOpen {
                    since: now,
                    doublings,
                };
                Admit::Trial
            }
            // Held until the trial must have ended; its result decides then.
            State::HalfOpen { since, .. } => Admit::Hold(since + self.trial_limit - now),
        }
    }

    /// Report how an admitted attempt ended: `timed_out` or not. Returns the
    /// cool-off when this report opened (or reopened) the breaker.
    pub fn record(
        &self,
        endpoint: i64,
        admitted: Admit,
        timed_out: bool,
        now: Instant,
    ) -> Option<Duration> {
        let mut states = self.lock();
        if !timed_out {
            // Any answer, or a fast failure: the endpoint is not holding slots.
            match states.get(&endpoint) {
                Some(State::HalfOpen { .. }) if admitted != Admit::Trial => {}
                _ => {
                    states.remove(&endpoint);
                }
            }
            return None;
        }
        let state = states
            .entry(endpoint)
            .or_insert(State::Closed { timeouts: 0 });
        match *state {
            State::Closed { timeouts } if timeouts + 1 >= self.threshold => {
                *state = State::Open {
                    until: now + self.cooloff,
                    doublings: 0,
                };
                Some(self.cooloff)
            }
            State::Closed { timeouts } => {
                *state = State::Closed {
                    timeouts: timeouts + 1,
                };
                None
            }
            State::HalfOpen { doublings, .. } if admitted == Admit::Trial => {
                let doublings = (doublings + 1).min(MAX_COOLOFF_DOUBLINGS);
                let cooloff = self.cooloff * 2u32.pow(doublings);
                *state = State::Open {
                    until: now + cooloff,
                    doublings,
                };
                Some(cooloff)
            }
            // A late timeout of an attempt admitted before the breaker opened:
            // already counted by the state it is in.
            State::Open { .. } | State::HalfOpen { .. } => None,
        }
    }

    /// The number of breakers open or half-open, for the gauge. (A breaker
    /// is forgotten when its endpoint answers, so the map holds only
    /// endpoints that timed out since their last answer.)
    pub fn open_count(&self) -> usize {
        self.lock()
            .values()
            .filter(|s| !matches!(s, State::Closed { .. }))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn the_breaker_opens_after_the_threshold_holds_then_lets_one_trial_through() {
        let b = Breakers::new(3, 10 * S, 2 * S);
        let t0 = Instant::now();
        let e = 7;
        // Two timeouts, then an answer: the count starts again.
        for _ in 0..2 {
            assert_eq!(b.admit(e, t0), Admit::Go);
            assert_eq!(b.record(e, Admit::Go, true, t0), None);
        }
        assert_eq!(b.record(e, Admit::Go, false, t0), None);
        for _ in 0..2 {
            assert_eq!(b.record(e, Admit::Go, true, t0), None);
        }
        assert_eq!(b.open_for(e, t0), None);
        // The third consecutive timeout opens it for the cool-off.
        assert_eq!(b.record(e, Admit::Go, true, t0), Some(10 * S));
        assert_eq!(b.open_for(e, t0 + S), Some(9 * S));
        assert_eq!(b.admit(e, t0 + S), Admit::Hold(9 * S));
        assert_eq!(b.open_count(), 1);
        // Other endpoints are not touched.
        assert_eq!(b.admit(8, t0 + S), Admit::Go);
        // Cool-off over: one trial; the others wait for its result.
        let t1 = t0 + 10 * S;
        assert_eq!(b.open_for(e, t1), None);
        assert_eq!(b.admit(e, t1), Admit::Trial);
        assert_eq!(b.admit(e, t1), Admit::Hold(3 * S));
        // A late answer of an attempt admitted earlier decides nothing.
        assert_eq!(b.record(e, Admit::Go, false, t1), None);
        assert_eq!(b.admit(e, t1), Admit::Hold(3 * S));
        // The trial times out: open again, for twice as long.
        assert_eq!(b.record(e, Admit::Trial, true, t1), Some(20 * S));
        assert_eq!(b.admit(e, t1 + 5 * S), Admit::Hold(15 * S));
        // The next trial is answered: closed, forgotten.
        let t2 = t1 + 20 * S;
        assert_eq!(b.admit(e, t2), Admit::Trial);
        assert_eq!(b.record(e, Admit::Trial, false, t2), None);
        assert_eq!(b.admit(e, t2), Admit::Go);
        assert_eq!(b.open_count(), 0);
    }

    #[test]
    fn a_lost_trial_does_not_hold_the_endpoint_forever_and_the_cooloff_is_capped() {
        let b = Breakers::new(1, 10 * S, 2 * S);
        let t0 = Instant::now();
        assert_eq!(b.record(1, Admit::Go, true, t0), Some(10 * S));
        let mut t = t0 + 10 * S;
        let mut cooloffs = Vec::new();
        for _ in 0..6 {
            assert_eq!(b.admit(1, t), Admit::Trial);
            let c = b.record(1, Admit::Trial, true, t).unwrap();
            cooloffs.push(c.as_secs());
            t += c;
        }
        assert_eq!(cooloffs, [20, 40, 80, 160, 160, 160]);
        // A trial never reported (its task was dropped) is replaced after the
        // request timeout and a margin.
        assert_eq!(b.admit(1, t), Admit::Trial);
        assert_eq!(b.admit(1, t + 2 * S), Admit::Hold(S));
        assert_eq!(b.admit(1, t + 3 * S), Admit::Trial);
    }
}
