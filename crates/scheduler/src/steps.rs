//! A tick of several steps under one budget.
//!
//! A role whose tick is more than one queue (billing: trials, resumes, due
//! billing, charges, …; dunning: enrolment, then retries) lists its steps in
//! order on a [`Steps`]. Each step is a fenced batch source run by the driver
//! until the tick's one deadline, `tick start + budget`, so a tick of six
//! steps is bounded by its budget, not six of them: a step that starts with
//! the budget spent claims nothing and ends as [`Stop::Budget`], and the
//! tick is due again at once.
//!
//! ```text
//!  Steps::new(tick, budget)          deadline = now + budget
//!   .run("billing/trials", &trials)  drive_until(trials, tick, deadline)   ─┐ each under
//!   .run("billing/due", &due)        drive_until(due, tick, deadline)       │ the panic
//!   .once("dunning/enrol", fut)      fut (one statement; its error fails)  ─┘ guard
//!   .finish()                        the worst end (failed > more work >
//!                                    drained, due now > drained); the first
//!                                    panic raised last
//! ```

use std::fmt;
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use leader::{Tick, TickEnd};
use tracing::warn;

use crate::driver::drive_until;
use crate::panics::{Payload, catch};
use crate::source::{Driven, FencedBatches, Stop};

/// The steps of one tick, run in order under the tick's one budget.
pub struct Steps<'t> {
    tick: &'t Tick,
    started: Instant,
    deadline: Instant,
    /// Each finished step's stop and end, in order.
    ends: Vec<(Stop, TickEnd)>,
    /// The first panic of a step (logged by the hook where it happened).
    panic: Option<Payload>,
}

impl<'t> Steps<'t> {
    /// A tick's steps, all of them within `budget` from now.
    pub fn new(tick: &'t Tick, budget: Duration) -> Steps<'t> {
        let started = Instant::now();
        Steps {
            tick,
            started,
            deadline: started + budget,
            ends: Vec::new(),
            panic: None,
        }
    }

    /// A tick's steps, all of them before `deadline` (a tick that prunes
    /// holds back the prune's slice: [`PrunePlan::work_until`](crate::PrunePlan)).
    pub fn until(tick: &'t Tick, deadline: Instant) -> Steps<'t> {
        Steps {
            tick,
            started: Instant::now(),
            deadline,
            ends: Vec::new(),
            panic: None,
        }
    }

    /// Run one step: `step` driven until the tick's deadline (or its own
    /// shape's budget from now, if sooner), under the panic guard. `None`
    /// when it panicked: the panic is kept, raised by [`finish`](Self::finish).
    pub async fn run<R: FencedBatches>(
        &mut self,
        name: &str,
        step: &R,
    ) -> Option<Driven<R::Counts>> {
        let deadline = self.deadline.min(Instant::now() + step.shape().budget);
        match catch(name.to_owned(), drive_until(step, self.tick, deadline)).await {
            Ok(driven) => {
                self.ends.push((driven.stop.clone(), driven.end.clone()));
                Some(driven)
            }
            Err(payload) => {
                self.panic.get_or_insert(payload);
                None
            }
        }
    }

    /// Run a step that is one call rather than a queue (an enrolment, say),
    /// under the panic guard. Its error is logged and ends the tick as
    /// failed (after the later steps ran); `None` when it failed or panicked.
    pub async fn once<T, E: fmt::Display>(
        &mut self,
        name: &str,
        call: impl Future<Output = Result<T, E>>,
    ) -> Option<T> {
        match catch(name.to_owned(), call).await {
            Ok(Ok(value)) => Some(value),
            Ok(Err(error)) => {
                warn!(step = name, error = %error, "step failed; the later steps run");
                let stop = Stop::Failed(format!("{name}: {error}"));
                self.ends.push((stop.clone(), stop.tick_end()));
                None
            }
            Err(payload) => {
                self.panic.get_or_insert(payload);
                None
            }
        }
    }

    /// How long the steps have run.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// The tick's end: its worst step's (failed, then more work, then drained
    /// but due again at once, then drained), with that step's stop.
    ///
    /// # Panics
    /// With the first panic a step raised, after every step ran.
    pub fn finish(self) -> (Stop, TickEnd) {
        if let Some(payload) = self.panic {
            std::panic::resume_unwind(payload);
        }
        worst(self.ends)
    }
}

/// The worst of several steps' ends; drained when there were none.
pub fn worst(ends: Vec<(Stop, TickEnd)>) -> (Stop, TickEnd) {
    let rank = |e: &TickEnd| match e {
        TickEnd::Failed(_) => 3,
        TickEnd::MoreWork => 2,
        TickEnd::DrainedDueNow => 1,
        _ => 0,
    };
    ends.into_iter()
        .reduce(|worst, e| {
            if rank(&e.1) > rank(&worst.1) {
                e
            } else {
                worst
            }
        })
        .unwrap_or((Stop::Drained, TickEnd::Drained))
}

/// The rows a step leaves out for the rest of its tick (a row whose work
/// panicked, one that does not decode, one already done but still listed),
/// so one bad row cannot fill every batch. Shared by a step's claim and run.
#[derive(Debug, Default)]
pub struct LeftOut(Mutex<Vec<i64>>);

impl LeftOut {
    /// The ids left out so far, for the next claim's `<> ALL ($n)`.
    pub fn ids(&self) -> Vec<i64> {
        self.lock().clone()
    }

    pub fn extend(&self, ids: impl IntoIterator<Item = i64>) {
        self.lock().extend(ids);
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// The list, a poisoned one too (a panic cannot leave a list of ids
    /// half-written).
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<i64>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worst_end_wins_whatever_the_order() {
        let drained = (Stop::Drained, TickEnd::Drained);
        let due_now = (Stop::Drained, TickEnd::DrainedDueNow);
        let budget = (Stop::Budget, TickEnd::MoreWork);
        let failed = (Stop::Failed("x".into()), TickEnd::Failed("x".into()));
        let cases = [
            (vec![], drained.clone()),
            (vec![drained.clone(), due_now.clone()], due_now.clone()),
            (
                vec![due_now.clone(), budget.clone(), drained.clone()],
                budget.clone(),
            ),
            (vec![failed.clone(), budget.clone()], failed.clone()),
            (
                vec![budget.clone(), failed.clone(), due_now.clone()],
                failed.clone(),
            ),
        ];
        for (ends, expected) in cases {
            assert_eq!(worst(ends.clone()), expected, "{ends:?}");
        }
    }
}
