//! A tick of several steps under one budget ([`scheduler::Steps`]).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leader::{Fence, Role, Tick, TickEnd};
use scheduler::{FencedBatches, Panics, Shape, Steps, Stop};
use testbed::TestDb;
use tokio_util::sync::CancellationToken;

use crate::manager;

/// A queue that never drains: every claim is a full batch, every batch
/// takes `batch_time`, or panics when `poisoned`.
struct Endless {
    budget: Duration,
    batch_time: Duration,
    poisoned: bool,
}

impl FencedBatches for Endless {
    type Claim = usize;
    type Counts = usize;
    type Error = String;

    fn role(&self) -> Role {
        Role::Billing
    }

    fn shape(&self) -> Shape {
        Shape {
            batch_size: 10,
            budget: self.budget,
            reserve: Duration::ZERO,
        }
    }

    async fn claim(&self, _fence: &Fence, limit: usize) -> Result<usize, String> {
        Ok(limit)
    }

    fn claimed(claim: &usize) -> usize {
        *claim
    }

    async fn run(
        &self,
        _claim: usize,
        _tick: &Tick,
        _deadline: Instant,
        _panics: &mut Panics,
        batches: &mut usize,
    ) -> Result<(), String> {
        assert!(!self.poisoned, "a poisoned batch");
        tokio::time::sleep(self.batch_time).await;
        *batches += 1;
        Ok(())
    }
}

/// Three steps whose queues never drain, each allowed the whole budget by its
/// own shape: the first spends the tick's one budget, the other two start
/// with nothing left, claim nothing and stop on the budget, and the tick is
/// due again at once. Billing's tick used to give each of its steps a full
/// budget (six budgets a tick).
///
/// Mutation check (`steps_one_budget`): giving each step its own budget from
/// its start (`Instant::now() + step.shape().budget` instead of the tick's
/// deadline) makes the later steps run batches and the tick last three
/// budgets; this test then fails.
#[tokio::test]
async fn a_tick_of_several_steps_stops_at_its_one_budget() {
    let t = TestDb::new().await;
    let (m, _, _) = manager(&t.db);
    let budget = Duration::from_millis(600);
    let step = Endless {
        budget,
        batch_time: Duration::from_millis(100),
        poisoned: false,
    };
    let seen = Arc::new(Mutex::new(None));
    let s = seen.clone();
    m.lead(
        Role::Billing,
        Duration::from_secs(60),
        &CancellationToken::new(),
        move |tick| async move {
            let started = Instant::now();
            let mut steps = Steps::new(&tick, budget);
            let mut per_step = Vec::new();
            for name in ["one", "two", "three"] {
                let d = steps.run(name, &step).await.expect("no panic");
                per_step.push((d.counts, d.stop));
            }
            let (stop, end) = steps.finish();
            *s.lock().unwrap() = Some((per_step, stop, end.clone(), started.elapsed()));
            end
        },
    )
    .await
    .unwrap();
    let (per_step, stop, end, elapsed) = seen.lock().unwrap().take().expect("led");
    assert!(
        per_step[0].0 >= 3,
        "the first step ran batches: {per_step:?}"
    );
    assert_eq!(
        per_step[1..],
        [(0, Stop::Budget), (0, Stop::Budget)],
        "the later steps found the budget spent"
    );
    assert_eq!((stop, end), (Stop::Budget, TickEnd::MoreWork));
    // One budget and at most one batch past it (the batch that started before
    // the deadline), not three budgets.
    assert!(
        elapsed < budget + Duration::from_millis(400),
        "the tick ran {elapsed:?} for a budget of {budget:?}"
    );
}

/// A drive whose batch panics stops as panicked. `drive_until_kept` hands
/// the panic back instead of raising it, so that a role's own work after the
/// driver runs first (webhook_delivery collects the attempts it carried,
/// docs/adr/0133); raising it is the caller's, and `drive_until` does so at
/// once. Mutation `drive_kept_raises` (the kept drive raising the panic
/// itself) fails it; seen failing.
#[tokio::test]
async fn a_kept_drive_hands_its_panic_back_to_be_raised_after() {
    scheduler::install_panic_hook();
    let t = TestDb::new().await;
    let (m, _, _) = manager(&t.db);
    let seen = Arc::new(Mutex::new(None));
    let s = seen.clone();
    let led = scheduler::catch(
        "test".into(),
        m.lead(
            Role::WebhookDelivery,
            Duration::from_secs(60),
            &CancellationToken::new(),
            move |tick| async move {
                let deadline = Instant::now() + Duration::from_secs(5);
                let poisoned = Endless {
                    budget: Duration::from_secs(5),
                    batch_time: Duration::ZERO,
                    poisoned: true,
                };
                let (driven, panics) =
                    scheduler::drive_until_kept(&poisoned, &tick, deadline).await;
                *s.lock().unwrap() = Some((driven.stop, panics.panicked()));
                panics.finish();
                TickEnd::Drained
            },
        ),
    )
    .await;
    assert!(led.is_err(), "the kept panic is raised by finish");
    assert_eq!(*seen.lock().unwrap(), Some((Stop::Panicked, 1)));
}
