//! One role's loop: poll, lead, tick, sleep.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use leader::{Manager, Role, Schedule, Tick, TickEnd, TickOutcome};
use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

use crate::panics::{catch, panic_message};

/// A role's work for one tick. It returns how the tick ended, which decides
/// the release (drained, more work, failed; docs/adr/0007).
pub type Work = Arc<dyn Fn(Tick) -> BoxFuture<'static, TickEnd> + Send + Sync>;

/// Wrap an async function of a [`Tick`] as [`Work`].
pub fn work<F, Fut>(f: F) -> Work
where
    F: Fn(Tick) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = TickEnd> + Send + 'static,
{
    Arc::new(move |tick| Box::pin(f(tick)))
}

/// A role this replica runs.
#[derive(Clone)]
pub struct RoleSpec {
    pub role: Role,
    pub interval: Duration,
    pub work: Work,
}

/// Poll and lead `spec.role` until `shutdown` is cancelled.
///
/// After a poll that did not win, sleeps until the row says the role could be
/// claimed (on the database clock) plus up to 5 % jitter, at most 20 ms, so
/// idle replicas do not poll in lockstep, and never longer than the max poll
/// (the held poll while another replica holds the lease). The jitter is
/// capped because a waiter's wake-up at an expiry is the takeover's slack;
/// the row lock already decides a race between waiters (docs/adr/0047). After a tick, polls again
/// at once: ACQUIRE then reports the next due time (at once after a tick that
/// stopped with more work, the failure cooldown after a failed one). A database error backs off
/// for the max poll. A panic (already logged with its stack by the guard or
/// the hook) ends the tick, never the loop.
pub async fn run_role(manager: Manager, spec: RoleSpec, shutdown: CancellationToken) {
    let schedule = Schedule::Every(spec.interval);
    run_role_on(manager, spec, schedule, shutdown).await;
}

/// [`run_role`] with the role due on `schedule` (a cron schedule's slots,
/// docs/adr/0043) rather than `spec.interval`. A poll that did not win
/// sleeps until the next slot on the database clock, capped at the max poll.
pub async fn run_role_on(
    manager: Manager,
    spec: RoleSpec,
    schedule: Schedule,
    shutdown: CancellationToken,
) {
    let role = spec.role;
    let max_poll = manager.timing().max_poll;
    while !shutdown.is_cancelled() {
        let work = spec.work.clone();
        let lead = manager.lead_on(role, &schedule, &shutdown, move |tick| work(tick));
        let pause = match catch(role.as_str().to_owned(), lead).await {
            Ok(Ok(TickOutcome::NotLed { retry_in, .. })) => jitter(retry_in).min(max_poll),
            Ok(Ok(_)) => Duration::ZERO,
            Ok(Err(e)) => {
                error!(role = %role, error = %e, "lease poll failed; retrying");
                max_poll
            }
            Err(payload) => {
                warn!(role = %role, panic = %panic_message(&*payload), "tick ended in a panic; the role loop goes on");
                Duration::ZERO
            }
        };
        if !pause.is_zero() {
            shutdown
                .run_until_cancelled(tokio::time::sleep(pause))
                .await;
        }
    }
}

fn jitter(d: Duration) -> Duration {
    let extra =
        (d.as_secs_f64() * 0.05).min(JITTER_CAP.as_secs_f64()) * rand::random_range(0.0..1.0);
    d + Duration::from_secs_f64(extra)
}

/// The most jitter a poll's sleep gets.
const JITTER_CAP: Duration = Duration::from_millis(20);
