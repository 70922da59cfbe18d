//! The fenced-batch driver: the one loop of every role that drains a queue in
//! fenced batches within a time budget. A role says how to claim a batch and
//! how to run it ([`FencedBatches`]); [`drive`] decides when to stop and how
//! the tick ends.
//!
//! ```text
//!  drive(role, tick)  =  drive_until(role, tick, now + budget)
//!   loop ── tick.cancel fired? ───────────────────────────▶ Stop::Cancelled  → MoreWork ¹
//!        ── now + reserve ≥ deadline? ────────────────────▶ Stop::Budget     → MoreWork
//!                                     (after a short batch: Stop::Drained → see ²)
//!        ── after a short batch (only when kept open, below): the idle policy
//!           (`idle.rs`) waits for a wake-up or the wake's poll interval
//!           (listening), or BUSY_POLL (busy and the last claim found work,
//!           listening or not), or
//!           else probes until a probe says work is waiting (pauses from
//!           idle_probe / PROBE_BACKOFF after the start or after work, doubling
//!           up to idle_probe; a failed probe → Stop::Failed)
//!        ── role.claim(&fence, batch_size)   (guarded step)
//!             error ──────────────────────────────────────▶ Stop::Failed(e)  → Failed(e)
//!             panic ──────────────────────────────────────▶ Stop::Panicked   (raised at the end)
//!        ── role.run(claim, …) if it claimed any (guarded step; the role guards each item)
//!             error (its outside service is down) ────────▶ Stop::Failed(e)  → Failed(e)
//!        ── cancel fired? → Cancelled
//!        ── fewer than batch_size claimed (none, for a role whose short batch
//!           does not drain: FencedBatches::short_batch_drains):
//!             the role's wake listens, or it is busy and this claim found work,
//!             or it probes (idle_probe) → loop (kept open)
//!             else ───────────────────────────────────────▶ Stop::Drained    → ²
//!   role.finish(…): batches still in flight written (guarded; an error fails
//!   a drained or budget-stopped tick, a panic is raised at the end)
//!   role.end_tick(tick); one log line if anything was claimed; Panics::finish()
//! ```
//!
//! ¹ A cancelled tick is released as lost or interrupted whatever it returns.
//! ² `DrainedDueNow` (due again at once) if the tick listened or probed, or
//!   found work in a busy role ([`FencedBatches::due_again_after_work`]);
//!   else `Drained`.
//!
//! A tick of several steps runs each with [`drive_until`] under the tick's one
//! deadline ([`Steps`](crate::Steps)).
//!
//! The returned [`TickEnd`] decides the release (docs/adr/0007, 0014): a
//! drained tick waits its interval (or not, ²), a tick stopped by its budget
//! is due again at once, a failed one waits the short failure cooldown. A
//! panic kept by the guard is raised again after the log line, so the lease is
//! released as panicked.

use std::time::Instant;

use leader::{Tick, TickEnd};
use tracing::{debug, info};

use crate::idle::Idle;
use crate::panics::{Panics, catch};
use crate::source::{Driven, FencedBatches, Stop};

/// Run one tick of `role`: claim and run batches until a batch comes back
/// short, the budget is spent, `tick.cancel` fires or a claim fails.
///
/// # Panics
/// With the first panic the guard kept (in a claim, a batch or an item),
/// after the rest of the tick and its log line.
///
/// # Cancel safety
/// `tick.cancel` is checked between batches; what a batch does when its
/// future is dropped is the role's (`run`'s) contract.
pub async fn drive<R: FencedBatches>(role: &R, tick: &Tick) -> Driven<R::Counts> {
    drive_until(role, tick, Instant::now() + role.shape().budget).await
}

/// [`drive`] until `deadline` instead of the role's own budget from now: a
/// step of a tick of several ([`Steps`](crate::Steps)) gets what is left of
/// the tick's one budget. No batch starts once `now + reserve` reaches it.
///
/// # Panics
/// As [`drive`].
pub async fn drive_until<R: FencedBatches>(
    role: &R,
    tick: &Tick,
    deadline: Instant,
) -> Driven<R::Counts> {
    let (driven, panics) = drive_until_kept(role, tick, deadline).await;
    panics.finish();
    driven
}

/// [`drive_until`], with the first panic kept in the returned [`Panics`]
/// instead of raised: for a role whose tick has work of its own after the
/// driver that a panic must not skip (webhook_delivery collects the attempts
/// it carried past their batches, docs/adr/0133). The caller raises it
/// ([`Panics::finish`]) once that work is done.
pub async fn drive_until_kept<R: FencedBatches>(
    role: &R,
    tick: &Tick,
    deadline: Instant,
) -> (Driven<R::Counts>, Panics) {
    let name = role.role();
    let shape = role.shape();
    let started = Instant::now();
    let spent = || Instant::now() + shape.reserve >= deadline;
    let mut panics = Panics::new(name.as_str());
    let mut counts = R::Counts::default();
    let (mut batches, mut claimed) = (0, 0);
    let mut idle = Idle::of(role);
    // The last claim came back short: the queue was drained.
    let mut drained = false;
    let mut stop = loop {
        if tick.cancel.is_cancelled() {
            break Stop::Cancelled;
        }
        if spent() {
            break if drained { Stop::Drained } else { Stop::Budget };
        }
        if drained {
            // Only a role whose idle policy keeps a short batch's tick open
            // gets here (below); none waits past the deadline.
            if let Err(stop) = idle
                .wait(role, tick, deadline, shape.reserve, &mut panics)
                .await
            {
                break stop;
            }
        }
        let claim = match panics
            .step("claim", role.claim(&tick.fence, shape.batch_size))
            .await
        {
            None => break Stop::Panicked,
            Some(Err(error)) => break Stop::Failed(error.to_string()),
            Some(Ok(claim)) => claim,
        };
        let n = R::claimed(&claim);
        drained = if role.short_batch_drains() {
            n < shape.batch_size
        } else {
            n == 0
        };
        idle.claimed(n);
        if n > 0 {
            batches += 1;
            claimed += n;
            let ran = catch(
                format!("{name}/batch"),
                role.run(claim, tick, deadline, &mut panics, &mut counts),
            )
            .await;
            match ran {
                Err(payload) => {
                    panics.record(payload);
                    break Stop::Panicked;
                }
                Ok(Err(error)) => break Stop::Failed(error.to_string()),
                Ok(Ok(())) => {}
            }
            if tick.cancel.is_cancelled() {
                break Stop::Cancelled;
            }
        }
        if drained && !idle.keeps_open(role) {
            break Stop::Drained;
        }
    };
    // Batches the role still has in flight (FencedBatches::finish) are
    // written before the tick ends, whatever stopped it.
    match catch(
        format!("{name}/finish"),
        role.finish(&mut panics, &mut counts),
    )
    .await
    {
        Err(payload) => {
            panics.record(payload);
            if !matches!(stop, Stop::Failed(_) | Stop::Cancelled) {
                stop = Stop::Panicked;
            }
        }
        Ok(Err(error)) if matches!(stop, Stop::Drained | Stop::Budget) => {
            stop = Stop::Failed(error.to_string());
        }
        Ok(_) => {}
    }
    // A drained tick that listened or probed, or that found work in a role
    // that asks for it, is due again at once (docs/adr/0014, 0019); else
    // after the interval.
    let due_now = idle.kept_open || (claimed > 0 && idle.busy());
    let end = match &stop {
        Stop::Drained if due_now => TickEnd::DrainedDueNow,
        other => other.tick_end(),
    };
    role.end_tick(tick).await;
    let driven = Driven {
        end,
        stop,
        batches,
        claimed,
        elapsed: started.elapsed(),
        counts,
    };
    if driven.claimed > 0 {
        info!(
            role = %name, batches = driven.batches, claimed = driven.claimed,
            end = driven.end.as_str(), stop = ?driven.stop, elapsed = ?driven.elapsed,
            counts = ?driven.counts, "tick done"
        );
    } else {
        debug!(role = %name, end = driven.end.as_str(), stop = ?driven.stop, "nothing claimed");
    }
    (driven, panics)
}
