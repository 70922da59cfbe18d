//! What a tick does after a short batch: the idle policy of [`drive`](crate::drive).
//!
//! ```text
//!  after a short batch
//!   ├─ the role's wake listens ──────────▶ wait for a wake-up or its poll (BUSY_POLL
//!   │                                      when busy and the last claim found work),
//!   │                                      claim again
//!   ├─ busy and the last claim found work ▶ wait BUSY_POLL, claim again
//!   ├─ probes (idle_probe) ──────────────▶ probe after a pause (short after work,
//!   │                                      doubling up to the period) until a probe
//!   │                                      says work is waiting, then claim
//!   └─ else ─────────────────────────────▶ the tick ends drained
//! ```
//!
//! None waits past the tick's deadline, and a cancel ends every wait at once.
//! A poke of the role's wake ends the two pauses that are not a listener's
//! too, and the tick claims at once: another role of this process that just
//! committed work for it says so ([`Wake::poke`], docs/adr/0070), where a
//! listener is not there to.

use std::time::{Duration, Instant};

use leader::Tick;

use crate::panics::Panics;
use crate::source::{BUSY_POLL, FencedBatches, PROBE_BACKOFF, Stop};
use crate::wake::Wake;

/// One tick's idle policy, built from what the role says of itself.
pub(crate) struct Idle {
    /// The role claims again at once when the queue fills (a busy role).
    busy: bool,
    /// How often a drained tick probes; `None` ends it instead.
    probe_every: Option<Duration>,
    /// The first probe's pause after the start or after work.
    first_pause: Duration,
    /// The next probe's pause.
    pause: Duration,
    /// The last claim found work.
    found: bool,
    /// The tick was kept open at least once (it is then due again at once).
    pub(crate) kept_open: bool,
}

impl Idle {
    pub(crate) fn of<R: FencedBatches>(role: &R) -> Idle {
        let probe_every = role.idle_probe();
        let first_pause = probe_every.unwrap_or_default() / PROBE_BACKOFF;
        Idle {
            busy: role.due_again_after_work(),
            probe_every,
            first_pause,
            pause: first_pause,
            found: false,
            kept_open: false,
        }
    }

    pub(crate) fn busy(&self) -> bool {
        self.busy
    }

    /// A claim came back with `n` items: work found resets the probe's back-off.
    pub(crate) fn claimed(&mut self, n: usize) {
        self.found = n > 0;
        if self.found {
            self.pause = self.first_pause;
        }
    }

    /// Whether a short batch keeps the tick open (else it ends drained).
    pub(crate) fn keeps_open<R: FencedBatches>(&self, role: &R) -> bool {
        listening(role) || (self.busy && self.found) || self.probe_every.is_some()
    }

    /// Wait, after a short batch, until the next claim is worth making.
    ///
    /// # Errors
    /// The [`Stop`] that ends the tick instead: cancelled, drained (the
    /// deadline came while probing), a failed or panicked probe.
    pub(crate) async fn wait<R: FencedBatches>(
        &mut self,
        role: &R,
        tick: &Tick,
        deadline: Instant,
        reserve: Duration,
        panics: &mut Panics,
    ) -> Result<(), Stop> {
        let left = || deadline.saturating_duration_since(Instant::now() + reserve);
        if let Some(wake) = role.wake().filter(|w| w.is_listening()) {
            // A listener that goes down pokes too: the claim after it finds
            // what was missed. A busy role whose last claim found work claims
            // again after BUSY_POLL, as without a listener: its fair claim
            // comes back short while other tenants' rows wait, and nothing
            // announces those (docs/adr/0109).
            self.kept_open = true;
            let poll = if self.busy && self.found {
                BUSY_POLL
            } else {
                wake.poll()
            };
            return tokio::select! {
                _ = wake.wait(poll.min(left())) => Ok(()),
                () = tick.cancel.cancelled() => Err(Stop::Cancelled),
            };
        }
        let Some(every) = self.probe_every.filter(|_| !(self.busy && self.found)) else {
            return tokio::select! {
                _ = pause(role.wake(), BUSY_POLL.min(left())) => Ok(()),
                () = tick.cancel.cancelled() => Err(Stop::Cancelled),
            };
        };
        loop {
            self.kept_open = true;
            let wait = self.pause.min(every);
            self.pause = (wait * 2).min(every);
            let poked = tokio::select! {
                poked = pause(role.wake(), wait.min(left())) => poked,
                () = tick.cancel.cancelled() => return Err(Stop::Cancelled),
            };
            if left().is_zero() {
                return Err(Stop::Drained);
            }
            // Work handed over in this process needs no probe; a listener
            // that came up meanwhile takes over at the claim.
            if poked || listening(role) {
                return Ok(());
            }
            match panics.step("probe", role.probe()).await {
                None => return Err(Stop::Panicked),
                Some(Err(error)) => return Err(Stop::Failed(error.to_string())),
                Some(Ok(true)) => return Ok(()),
                Some(Ok(false)) => {}
            }
        }
    }
}

/// Sleep `at_most`, or less if `wake` is poked first. True when poked.
async fn pause(wake: Option<&Wake>, at_most: Duration) -> bool {
    match wake {
        Some(wake) => wake.wait(at_most).await,
        None => {
            tokio::time::sleep(at_most).await;
            false
        }
    }
}

fn listening<R: FencedBatches>(role: &R) -> bool {
    role.wake().is_some_and(Wake::is_listening)
}
