//! Work handed over in this process (docs/adr/0070): a poke of a role's wake,
//! with no listener, ends a probing tick's pause and a busy tick's pause, and
//! the tick claims at once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leader::{Fence, Role, Tick, TickEnd};
use scheduler::{BUSY_POLL, FencedBatches, Panics, Shape, Wake, drive};
use testbed::TestDb;
use tokio_util::sync::CancellationToken;

use crate::manager;

/// A queue the test fills: a claim takes all that waits (up to the batch),
/// and says when it found work.
struct Queue {
    waiting: AtomicUsize,
    wake: Wake,
    found: tokio::sync::mpsc::UnboundedSender<Instant>,
}

impl FencedBatches for Queue {
    type Claim = usize;
    type Counts = usize;
    type Error = String;

    fn role(&self) -> Role {
        Role::WebhookDelivery
    }

    fn shape(&self) -> Shape {
        Shape {
            batch_size: 100,
            budget: Duration::from_secs(20),
            reserve: Duration::ZERO,
        }
    }

    async fn claim(&self, _fence: &Fence, _limit: usize) -> Result<usize, String> {
        let n = self.waiting.swap(0, Ordering::SeqCst);
        if n > 0 {
            let _ = self.found.send(Instant::now());
        }
        Ok(n)
    }

    fn claimed(claim: &usize) -> usize {
        *claim
    }

    async fn run(
        &self,
        claim: usize,
        _tick: &Tick,
        _deadline: Instant,
        _panics: &mut Panics,
        items: &mut usize,
    ) -> Result<(), String> {
        *items += claim;
        Ok(())
    }

    fn wake(&self) -> Option<&Wake> {
        Some(&self.wake)
    }

    /// A long probe period: without the hand-over, work put in while the
    /// tick waits is found only after seconds.
    fn idle_probe(&self) -> Option<Duration> {
        Some(Duration::from_secs(60))
    }

    async fn probe(&self) -> Result<bool, String> {
        Ok(self.waiting.load(Ordering::SeqCst) > 0)
    }

    fn due_again_after_work(&self) -> bool {
        true
    }
}

/// An idle, probing tick (its first pause 60 s / 8 = 7.5 s) claims work put
/// in and handed over 300 ms into its pause within 500 ms; then, five times,
/// work handed over at once after a claim that found some (the busy tick's
/// `BUSY_POLL` pause, 50 ms) is claimed in a median under 25 ms. The wake
/// never listens.
///
/// Mutation checks: the probe's pause slept out whatever pokes it
/// (`hand_over_probe`) leaves the first claim to the next probe, 7.5 s on;
/// the busy pause slept out (`hand_over_busy`) makes each later claim wait
/// about 50 ms. Either fails this test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poke_ends_a_probing_or_busy_ticks_pause_and_the_tick_claims_at_once() {
    let t = TestDb::new().await;
    let (m, _, _) = manager(&t.db);
    let (found, mut claims) = tokio::sync::mpsc::unbounded_channel();
    let queue = Arc::new(Queue {
        waiting: AtomicUsize::new(0),
        wake: Wake::new(Role::WebhookDelivery, Duration::from_secs(60)),
        found,
    });
    let q = queue.clone();
    let stop = CancellationToken::new();
    let ended = Arc::new(Mutex::new(None));
    let e = ended.clone();
    let tick_stop = stop.clone();
    let lead = tokio::spawn(async move {
        m.lead(
            Role::WebhookDelivery,
            Duration::from_secs(60),
            &CancellationToken::new(),
            move |mut tick| async move {
                tick.cancel = tick_stop;
                let driven = drive(&*q, &tick).await;
                *e.lock().unwrap() = Some(driven.counts);
                TickEnd::Drained
            },
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let hand_over = |n: usize| {
        queue.waiting.fetch_add(n, Ordering::SeqCst);
        queue.wake.poke();
        Instant::now()
    };
    let handed = hand_over(3);
    let first = tokio::time::timeout(Duration::from_secs(5), claims.recv())
        .await
        .expect("the idle tick claimed within 5 s")
        .unwrap();
    let first = first.saturating_duration_since(handed);
    let mut busy = Vec::new();
    for _ in 0..5 {
        let handed = hand_over(2);
        let claimed = tokio::time::timeout(Duration::from_secs(5), claims.recv())
            .await
            .expect("the busy tick claimed within 5 s")
            .unwrap();
        busy.push(claimed.saturating_duration_since(handed));
    }
    stop.cancel();
    lead.await.unwrap().unwrap();
    assert_eq!(*ended.lock().unwrap(), Some(13), "every item claimed once");
    println!("hand-over to claim: idle {first:?}, busy {busy:?}");
    assert!(first < Duration::from_millis(500), "idle: {first:?}");
    busy.sort();
    assert!(
        busy[2] < BUSY_POLL / 2,
        "busy, median {:?} (all {busy:?})",
        busy[2]
    );
}
