//! What a role gives the driver: how its ticks are cut into batches
//! ([`Shape`]), how it claims and runs a batch ([`FencedBatches`]), the
//! pauses of a tick kept open, and what a driven tick returns ([`Stop`],
//! [`Driven`]). No loop here: [`drive`](crate::drive) runs it.

use std::fmt;
use std::future::Future;
use std::time::{Duration, Instant};

use leader::{Fence, Role, Tick, TickEnd};

use crate::panics::Panics;
use crate::wake::Wake;

/// How long a tick of a busy role ([`FencedBatches::due_again_after_work`])
/// without wake-ups waits after a short batch that found work before it
/// claims again: a steady stream waits at most this per role, not the
/// interval, and costs at most 20 claims a second while it flows.
pub const BUSY_POLL: Duration = Duration::from_millis(50);

/// How often an idle tick of a probing role ([`FencedBatches::idle_probe`])
/// asks whether new work is waiting, while it holds the lease and no listener
/// wakes it (docs/adr/0019): an event waits at most about this per role, not
/// the interval; an idle role costs one cheap read per role per probe.
pub const IDLE_PROBE: Duration = Duration::from_millis(100);

/// The first probe after a tick's start or after a claim that found work
/// waits the probe period divided by this; each next one waits twice as long
/// as the last, up to the period (docs/adr/0022). Work that follows work (a
/// burst that the other webhook role is still fanning out, a producer that
/// commits just after the first claim) waits milliseconds, not a period; an
/// idle role soon probes at the period again.
pub const PROBE_BACKOFF: u32 = 8;

/// How a role's ticks are cut into batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Items claimed per batch. A batch that claims fewer means nothing else
    /// is waiting. Must be at least 1 (each role's config refuses 0).
    pub batch_size: usize,
    /// No batch starts once `elapsed + reserve` reaches this.
    pub budget: Duration,
    /// How long a batch may run once started (the HTTP timeout of one
    /// attempt, say); zero for a batch that is one short transaction.
    pub reserve: Duration,
}

/// A role that drains its queue in fenced batches. Implemented by each job
/// crate's `tick.rs`; run with [`drive`].
pub trait FencedBatches: Sync {
    /// What one claim returns (the claimed rows, or a finished batch's summary
    /// when claim and outcome are one transaction).
    type Claim: Send;
    /// What the role counts over a tick; logged with the tick and returned.
    type Counts: Default + fmt::Debug + Send;
    /// A claim's error; it ends the tick as [`TickEnd::Failed`].
    type Error: fmt::Display + Send;

    fn role(&self) -> Role;

    fn shape(&self) -> Shape;

    /// The fenced claim of up to `limit` items: its SQL proves
    /// `leader_fence($role, $token)` in its innermost WHERE.
    ///
    /// # Errors
    /// A database error; the tick stops and is released as failed.
    fn claim(
        &self,
        fence: &Fence,
        limit: usize,
    ) -> impl Future<Output = Result<Self::Claim, Self::Error>> + Send;

    /// How many items `claim` holds.
    fn claimed(claim: &Self::Claim) -> usize;

    /// Run a claimed batch and write its outcomes (each by CAS). Items run
    /// under `panics` (a panicking item stops itself, not the batch); nothing
    /// may start that could end after `deadline`. Errors writing an outcome
    /// are the role's to absorb: the claim's lease brings the item back.
    ///
    /// # Errors
    /// When the role's outside service is down (an SMTP server that does not
    /// answer, a payment provider outage): the role hands back what it did not
    /// attempt, and the tick stops and is released as failed, so the role
    /// retries after the short cooldown instead of burning attempts.
    fn run(
        &self,
        claim: Self::Claim,
        tick: &Tick,
        deadline: Instant,
        panics: &mut Panics,
        counts: &mut Self::Counts,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// The role's wake-up signal, if it has one (docs/adr/0014). While it is
    /// listening, a short batch does not end the tick: the driver waits for a
    /// wake-up or the signal's poll interval and claims again, until the
    /// budget. Default: none.
    fn wake(&self) -> Option<&Wake> {
        None
    }

    /// Whether the role's queue fills at any time (producers commit whenever
    /// they like), so that work found means more is likely on its way. If
    /// so, without a listening wake a short batch that found work does not
    /// end the tick: the driver waits [`BUSY_POLL`] and claims again, until a
    /// claim finds nothing or the budget is spent; and a tick that found work
    /// is followed at once by the next ([`TickEnd::DrainedDueNow`]) instead of
    /// after the interval. An idle role still polls at its interval. Default:
    /// false.
    fn due_again_after_work(&self) -> bool {
        false
    }

    /// Whether a claim of fewer than `batch_size` rows means the queue is
    /// drained (the default: the claim took all there was). A role whose
    /// claim can come back short while rows wait, because it visits only
    /// some tenants per claim (docs/adr/0048), says no: its tick claims
    /// again, and ends drained only when a claim finds nothing
    /// (docs/adr/0067).
    fn short_batch_drains(&self) -> bool {
        true
    }

    /// How often a drained tick asks [`probe`](Self::probe) whether new work
    /// is waiting instead of ending (docs/adr/0019); `None` (the default)
    /// ends it. A probing tick without a listening wake stays open until its
    /// budget, probing every this long and claiming when a probe says so, and
    /// is then due again at once ([`TickEnd::DrainedDueNow`]): the role leads
    /// without a gap and an event waits about one probe, not an interval.
    /// Every claim is still fenced and the lease still renewed; a cancel
    /// (lease lost, paused, shutting down) ends the wait at once.
    fn idle_probe(&self) -> Option<Duration> {
        None
    }

    /// Whether a claim now would find work: one cheap read (an index probe)
    /// that claims nothing, so it needs no fence. Default: true (a role that
    /// probes without one claims every probe).
    ///
    /// # Errors
    /// A database error; the tick stops and is released as failed.
    fn probe(&self) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        async { Ok(true) }
    }

    /// After the last batch, before [`end_tick`](Self::end_tick): a role
    /// whose `run` returns while its batch is still calling or settling (it
    /// overlaps a batch's provider calls with the next claim, docs/adr/0054)
    /// waits for those batches here and counts them, so a tick ends only
    /// when every batch it claimed is written. Run under the panic guard; an
    /// error fails the tick as a batch's would. Default: nothing in flight.
    ///
    /// # Errors
    /// As [`run`](Self::run), for a batch finished here.
    fn finish(
        &self,
        _panics: &mut Panics,
        _counts: &mut Self::Counts,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        async { Ok(()) }
    }

    /// After the last batch, before the log line (gauges, caches).
    fn end_tick(&self, _tick: &Tick) -> impl Future<Output = ()> + Send {
        async {}
    }
}

/// Why [`drive`] stopped claiming.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// A batch came back short: nothing else was waiting.
    Drained,
    /// Too little budget was left for another batch; work may be left.
    Budget,
    /// `tick.cancel` fired (lease lost or shutting down).
    Cancelled,
    /// A claim failed; nothing of that batch was claimed.
    Failed(String),
    /// A claim or a batch panicked outside an item; raised at the end.
    Panicked,
}

impl Stop {
    /// How the lease is released after a tick that stopped this way.
    pub fn tick_end(&self) -> TickEnd {
        match self {
            Stop::Drained => TickEnd::Drained,
            Stop::Budget => TickEnd::MoreWork,
            // Released as lost or interrupted whatever it says; work may be left.
            Stop::Cancelled => TickEnd::MoreWork,
            Stop::Failed(error) => TickEnd::Failed(error.clone()),
            // Never returned: Panics::finish raises the panic.
            Stop::Panicked => TickEnd::Failed("a batch panicked".to_owned()),
        }
    }
}

/// What one driven tick did.
#[derive(Debug)]
pub struct Driven<C> {
    /// The tick's end, for `Manager::lead`: `stop.tick_end()`.
    pub end: TickEnd,
    pub stop: Stop,
    /// Batches that claimed at least one item.
    pub batches: usize,
    /// Items claimed over the tick.
    pub claimed: usize,
    pub elapsed: Duration,
    pub counts: C,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_stop_maps_to_its_release() {
        let cases = [
            (Stop::Drained, TickEnd::Drained),
            (Stop::Budget, TickEnd::MoreWork),
            (Stop::Cancelled, TickEnd::MoreWork),
            (
                Stop::Failed("statement timeout".into()),
                TickEnd::Failed("statement timeout".into()),
            ),
        ];
        for (stop, end) in cases {
            assert_eq!(stop.tick_end(), end, "{stop:?}");
        }
    }
}
