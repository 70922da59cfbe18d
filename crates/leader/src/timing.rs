//! The lease's runtime constants and the invariant that ties them together.

use std::time::Duration;

/// How long a lease lives, how often it is renewed, and when a leader gives up.
///
/// Invariant: `abandon_after + statement_timeout < ttl`. A leader stops starting
/// statements at `abandon_after` after its last acknowledged renewal; any statement
/// already sent is cancelled by the server within `statement_timeout`; so nothing
/// of ours runs when the lease can next be acquired. `heartbeat +
/// statement_timeout <= abandon_after` so that a renewal sent on time can be
/// answered before the leader gives up, and `cancel_grace <=
/// statement_timeout` so the work's wind-down fits in the same margin.
///
/// Outside this crate a `Timing` comes only from [`Timing::ADR`] or the checked
/// [`Timing::new`] (`non_exhaustive` forbids a struct literal), and
/// `Manager` checks it again, so a value that breaks the invariant cannot lead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Timing {
    pub ttl: Duration,
    pub heartbeat: Duration,
    pub statement_timeout: Duration,
    pub abandon_after: Duration,
    pub max_poll: Duration,
    /// The longest a replica sleeps between polls of a lease another
    /// replica holds (docs/adr/0047): a holder that shuts down releases
    /// its lease at once, and a waiter notices within this. At most
    /// `max_poll`. A lease left to expire is polled at its expiry anyway.
    pub held_poll: Duration,
    /// How long cancelled work may take to return before it is dropped.
    pub cancel_grace: Duration,
    /// The cooldown after a tick whose work returned `TickEnd::Failed`, capped
    /// at the role's interval (docs/adr/0007). 30 s: an hourly role retries a
    /// transient database error within a minute, and a broken one costs at most
    /// two ticks a minute.
    pub failure_cooldown: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TimingError {
    #[error(
        "abandon_after ({abandon:?}) + statement_timeout ({statement:?}) must be less than ttl ({ttl:?})"
    )]
    AbandonTooLate {
        abandon: Duration,
        statement: Duration,
        ttl: Duration,
    },
    #[error(
        "heartbeat ({heartbeat:?}) + statement_timeout ({statement:?}) must not exceed abandon_after ({abandon:?}): \
         a renewal sent on time must be able to finish before the leader gives up"
    )]
    HeartbeatTooSlow {
        heartbeat: Duration,
        statement: Duration,
        abandon: Duration,
    },
    #[error("cancel_grace ({grace:?}) must not exceed statement_timeout ({statement:?})")]
    GraceTooLong {
        grace: Duration,
        statement: Duration,
    },
    #[error("held_poll ({held:?}) must not exceed max_poll ({max:?})")]
    HeldPollTooLong { held: Duration, max: Duration },
    #[error("every duration must be positive")]
    Zero,
}

impl Timing {
    /// The design's timings, compiled in (docs/design.md §2.4).
    pub const ADR: Timing = Timing {
        ttl: Duration::from_secs(10),
        heartbeat: Duration::from_secs(3),
        statement_timeout: Duration::from_secs(2),
        abandon_after: Duration::from_secs(6),
        max_poll: Duration::from_secs(5),
        held_poll: Duration::from_secs(1),
        cancel_grace: Duration::from_secs(1),
        failure_cooldown: Duration::from_secs(30),
    };

    /// The fast profile (`HARDCOUNT_LEASE_PROFILE=fast`, docs/adr/0047): a
    /// lease of 3 s renewed every second, for deployments that would rather
    /// spend more lease statements than wait 10 s for a takeover. The same
    /// invariant holds: abandon 2 s + statement timeout 750 ms < TTL 3 s, and
    /// heartbeat 1 s + 750 ms <= abandon 2 s.
    pub const FAST: Timing = Timing {
        ttl: Duration::from_secs(3),
        heartbeat: Duration::from_secs(1),
        statement_timeout: Duration::from_millis(750),
        abandon_after: Duration::from_secs(2),
        max_poll: Duration::from_secs(1),
        held_poll: Duration::from_millis(500),
        cancel_grace: Duration::from_millis(750),
        failure_cooldown: Duration::from_secs(30),
    };

    /// Shortened timings for tests and benches, checked against the same invariant.
    pub fn new(
        ttl: Duration,
        heartbeat: Duration,
        statement_timeout: Duration,
        abandon_after: Duration,
        max_poll: Duration,
    ) -> Result<Timing, TimingError> {
        Timing {
            ttl,
            heartbeat,
            statement_timeout,
            abandon_after,
            max_poll,
            held_poll: max_poll.min(Duration::from_secs(1)),
            cancel_grace: statement_timeout.min(Duration::from_secs(1)),
            failure_cooldown: Timing::ADR.failure_cooldown,
        }
        .checked()
    }

    /// The same timings with another failure cooldown (tests shorten it).
    pub fn with_failure_cooldown(self, cooldown: Duration) -> Result<Timing, TimingError> {
        Timing {
            failure_cooldown: cooldown,
            ..self
        }
        .checked()
    }

    pub(crate) fn checked(self) -> Result<Timing, TimingError> {
        let all = [
            self.ttl,
            self.heartbeat,
            self.statement_timeout,
            self.abandon_after,
            self.max_poll,
            self.held_poll,
            self.failure_cooldown,
        ];
        if all.iter().any(Duration::is_zero) {
            return Err(TimingError::Zero);
        }
        if self.abandon_after + self.statement_timeout >= self.ttl {
            return Err(TimingError::AbandonTooLate {
                abandon: self.abandon_after,
                statement: self.statement_timeout,
                ttl: self.ttl,
            });
        }
        if self.heartbeat + self.statement_timeout > self.abandon_after {
            return Err(TimingError::HeartbeatTooSlow {
                heartbeat: self.heartbeat,
                statement: self.statement_timeout,
                abandon: self.abandon_after,
            });
        }
        if self.held_poll > self.max_poll {
            return Err(TimingError::HeldPollTooLong {
                held: self.held_poll,
                max: self.max_poll,
            });
        }
        if self.cancel_grace > self.statement_timeout {
            return Err(TimingError::GraceTooLong {
                grace: self.cancel_grace,
                statement: self.statement_timeout,
            });
        }
        Ok(self)
    }
}

impl Timing {
    /// How long the heartbeat waits after a missed beat before it retries: a
    /// tenth of the heartbeat (300 ms for the design's timings, [`Timing::ADR`],
    /// docs/design.md §2.4). A retry is sent only while `now +
    /// statement_timeout` is before the abandon deadline, so with those timings
    /// a RENEW that failed fast at 3 s is retried until 4 s; one that hung for
    /// its whole statement timeout is not.
    pub fn retry_pause(&self) -> Duration {
        self.heartbeat / 10
    }

    /// How long a poll waits for ACQUIRE's answer before it gives up on a
    /// silent link (docs/adr/0075): the TTL, the statement timeout and
    /// `store::CLIENT_MARGIN`, so that an answer that is only late (a BEGIN
    /// queued in PgBouncer) still comes back and, past the abandon deadline,
    /// is released as lost. An ACQUIRE given up on may still commit later and
    /// hold the lease for up to a TTL: nobody acts on its token (the fence),
    /// and the other replicas wait that TTL at most.
    pub fn acquire_bound(&self) -> Duration {
        self.ttl + self.statement_timeout + crate::store::CLIENT_MARGIN
    }

    /// The longest a role loop takes to stop once shutdown is asked: an
    /// ACQUIRE already sent, answered as late as [`Timing::acquire_bound`]
    /// (or running work given its `cancel_grace`), then that term's RELEASE.
    /// `serve` waits this long before it closes the lease pool: closed
    /// sooner, a late-won ACQUIRE's RELEASE found the pool closed and the
    /// lease stood held, with nobody working, for a TTL.
    pub fn shutdown_bound(&self) -> Duration {
        self.acquire_bound()
            .max(self.cancel_grace + self.statement_timeout)
            + self.statement_timeout
            + crate::store::CLIENT_MARGIN
    }

    /// The longest sleep before the next poll of a lease that was not won:
    /// `held_poll` while another term holds it, else `max_poll`.
    pub fn poll_cap(&self, held: bool) -> Duration {
        if held { self.held_poll } else { self.max_poll }
    }
}

impl Default for Timing {
    fn default() -> Timing {
        Timing::ADR
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `serve` outwaits an ACQUIRE answered at its bound and its RELEASE,
    /// within the 30 s a Kubernetes pod is given (deploy/kubernetes). Fails
    /// with the wait `serve` used before (grace, a statement, 2 s: 5 s).
    #[test]
    fn shutdown_outwaits_an_acquire_and_its_release() {
        for t in [Timing::ADR, Timing::FAST] {
            assert!(t.shutdown_bound() >= t.acquire_bound() + t.statement_timeout);
            assert!(t.shutdown_bound() >= t.cancel_grace + t.statement_timeout * 2);
            assert!(t.shutdown_bound() + Duration::from_secs(2) < Duration::from_secs(30));
        }
    }

    #[test]
    fn the_adr_constants_keep_abandon_plus_statement_timeout_under_ttl() {
        let t = Timing::ADR;
        assert!(t.abandon_after + t.statement_timeout < t.ttl);
        assert_eq!(t.checked(), Ok(t));
        assert_eq!(Timing::FAST.checked(), Ok(Timing::FAST));
        assert_eq!(t.poll_cap(true), Duration::from_secs(1));
        assert_eq!(t.poll_cap(false), t.max_poll);
        assert_eq!(
            (
                t.ttl,
                t.heartbeat,
                t.statement_timeout,
                t.abandon_after,
                t.max_poll
            ),
            (
                Duration::from_secs(10),
                Duration::from_secs(3),
                Duration::from_secs(2),
                Duration::from_secs(6),
                Duration::from_secs(5)
            )
        );
    }

    #[test]
    fn shortened_timings_are_checked_against_the_same_invariant() {
        let ms = Duration::from_millis;
        assert!(Timing::new(ms(1000), ms(300), ms(200), ms(600), ms(500)).is_ok());
        assert!(matches!(
            Timing::new(ms(1000), ms(300), ms(400), ms(600), ms(500)),
            Err(TimingError::AbandonTooLate { .. })
        ));
        assert!(matches!(
            Timing::new(ms(1000), ms(600), ms(200), ms(600), ms(500)),
            Err(TimingError::HeartbeatTooSlow { .. })
        ));
        assert_eq!(
            Timing::new(ms(0), ms(1), ms(1), ms(1), ms(1)),
            Err(TimingError::Zero)
        );
    }
}
