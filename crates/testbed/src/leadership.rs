//! Leases for tests: short timings, named managers, and "run this as the leader".

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use db::Db;
use leader::{Manager, Role, Telemetry, Tick, TickEnd, TickLog, TickOutcome, Timing};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Short lease timings in the proportions of the design's timings
/// (docs/design.md §2.4): TTL 1 s, heartbeat 300 ms, statement timeout 200 ms,
/// abandon after 600 ms, max poll 500 ms.
pub fn fast_timing() -> Timing {
    let ms = Duration::from_millis;
    Timing::new(ms(1000), ms(300), ms(200), ms(600), ms(500)).unwrap()
}

/// Lease timings for a test whose subject is a tick's work, not its lease
/// (the roles' `tick` helpers): TTL 10 s, heartbeat 1 s, statement timeout
/// 2 s, abandon after 6 s, max poll 500 ms. Under `fast_timing` a heavy tick
/// (a plan test over never-analyzed tables, every plan logged) once lost its
/// lease to a renewal answered more than 600 ms late while the whole suite
/// ran on two cores.
pub fn patient_timing() -> Timing {
    let ms = Duration::from_millis;
    Timing::new(ms(10_000), ms(1000), ms(2000), ms(6000), ms(500)).unwrap()
}

/// A manager whose holder id starts with `name`, with fast timings and no metrics.
pub fn manager(db: &Db, name: &str) -> Manager {
    managed(db, name, fast_timing())
}

/// A manager like `manager`, with `patient_timing`.
pub fn patient_manager(db: &Db, name: &str) -> Manager {
    managed(db, name, patient_timing())
}

fn managed(db: &Db, name: &str, timing: Timing) -> Manager {
    Manager::with_holder_id(
        db.clone(),
        timing,
        Telemetry::noop(),
        format!(
            "{name}:{}:{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ),
    )
}

/// Poll `role` like a role loop until `m` leads it, run `work` in that tick
/// and return what it returned.
///
/// # Panics
/// If the tick is lost or interrupted before `work` returns.
pub async fn as_leader<T, F, Fut>(m: &Manager, role: Role, work: F) -> T
where
    F: FnOnce(Tick) -> Fut,
    Fut: Future<Output = T>,
{
    let shutdown = CancellationToken::new();
    let mut work = Some(work);
    let out = Arc::new(Mutex::new(None));
    loop {
        let slot = out.clone();
        let w = &mut work;
        let led = m
            .lead(role, Duration::ZERO, &shutdown, |tick| async move {
                let f = w.take().expect("work runs once");
                let value = f(tick).await;
                *slot.lock().unwrap() = Some(value);
                TickEnd::Drained
            })
            .await
            .unwrap();
        if let Some(value) = out.lock().unwrap().take() {
            return value;
        }
        match led {
            TickOutcome::NotLed { retry_in, .. } => tokio::time::sleep(retry_in).await,
            other => panic!("the tick did not complete: {other:?}"),
        }
    }
}

/// Wait until the tick ends a manager has announced (`Manager::ticks`) satisfy
/// `done`, and return them. `limit` is a safety bound, never the pace: the
/// wait ends as soon as a tick's end makes `done` true.
///
/// # Panics
/// After `limit`, naming `what` and the ticks seen so far.
pub async fn until_ticks(
    ticks: &mut watch::Receiver<TickLog>,
    limit: Duration,
    what: &str,
    mut done: impl FnMut(&TickLog) -> bool,
) -> TickLog {
    let waited = tokio::time::timeout(limit, ticks.wait_for(|log| done(log)))
        .await
        .map(|seen| seen.map(|log| log.clone()));
    match waited {
        Ok(Ok(log)) => log,
        Ok(Err(_)) => panic!("the manager is gone before {what}"),
        Err(_) => panic!(
            "timed out after {limit:?} waiting for {what}; ticks: {:?}",
            *ticks.borrow()
        ),
    }
}
