//! Wake-ups of the delivery role (docs/adr/0014): the fan-out's `pg_notify`
//! wakes the idle, led, listening role (listener on the bed's Postgres
//! directly), which delivers within milliseconds instead of its interval.

use std::time::{Duration, Instant};

use leader::Role;
use scheduler::{RoleSpec, Wake, listen, run_role, work};
use testbed::Leg;
use testbed::TestDb;
use testbed::receiver::{Receiver, Reply};
use tokio_util::sync::CancellationToken;

use crate::{config, deliveries, endpoint, events, manager, outcomes, worker};

/// The delivery role run as `hardcount serve` runs it, led, with a wake at
/// `interval` whose listener (straight to the bed's Postgres) is up, and
/// idle for 300 ms.
struct Listening {
    shutdown: CancellationToken,
    listener: tokio::task::JoinHandle<()>,
    role: tokio::task::JoinHandle<()>,
}

impl Listening {
    async fn start(t: &TestDb, w: webhook_delivery::Worker, interval: Duration) -> Listening {
        let wake = Wake::new(Role::WebhookDelivery, interval);
        let w = w.with_wake(wake.clone());
        let shutdown = CancellationToken::new();
        let listener = tokio::spawn(listen(
            t.app_url(Leg::Direct),
            vec![wake.clone()],
            Duration::from_millis(200),
            shutdown.child_token(),
        ));
        let started = Instant::now();
        while !wake.is_listening() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "never listening"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let spec = RoleSpec {
            role: Role::WebhookDelivery,
            interval,
            work: work(move |tick| {
                let w = w.clone();
                async move { w.run_tick(&tick).await.end }
            }),
        };
        let role = tokio::spawn(run_role(manager(&t.db, "w"), spec, shutdown.child_token()));
        tokio::time::sleep(Duration::from_millis(300)).await;
        Listening {
            shutdown,
            listener,
            role,
        }
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.listener.await.unwrap();
        self.role.await.unwrap();
    }
}

/// With a 5 s interval, each of three events fanned out while the listening
/// role is idle reaches the receiver within 500 ms of the fan-out's commit.
///
/// Mutation check: the fan-out without its `pg_notify` leaves the role to its
/// interval poll and this test fails (scripts/mutation-check `fanout_notify`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fanned_out_delivery_wakes_the_idle_listening_role_within_milliseconds() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    let (w, _) = worker(&t.db, config());
    let running = Listening::start(&t, w, Duration::from_secs(5)).await;
    let mut waits = Vec::new();
    for n in 1..=3 {
        // Enqueued and fanned out (the fan-out commits with its pg_notify).
        events(&t.db, "tenant_a", 1).await;
        waits.push(rx.until_count(n, Duration::from_secs(20)).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    running.stop().await;
    println!("fan-out commit to POST: {waits:?}");
    assert!(
        waits.iter().all(|w| *w < Duration::from_millis(500)),
        "{waits:?}"
    );
}

/// A listening role whose one delivery is slow (800 ms, past the batch's
/// carry instant of 500 ms) carries it and waits for a wake-up, at most its
/// interval (3 s, longer than the 2 s claim lease). The attempt pokes the
/// role as it finishes, so its result is written at once: one request, the
/// delivery delivered at its first attempt, nothing stale (docs/adr/0084).
///
/// Mutation check: `carried_poke` (no poke) leaves the result unwritten
/// until the interval, when the lease has ended: the delivery is claimed and
/// sent again, and this test fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_carried_attempt_wakes_the_listening_role_before_its_lease_ends() {
    let t = TestDb::new().await;
    let rx = Receiver::start(|_| Reply::Delayed(Duration::from_millis(800), 200)).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    let (w, metrics) = worker(&t.db, config());
    let running = Listening::start(&t, w, Duration::from_secs(3)).await;
    events(&t.db, "tenant_a", 1).await;
    rx.until_count(1, Duration::from_secs(10)).await;
    // Past the lease (2 s) and the interval (3 s) after the first request.
    tokio::time::sleep(Duration::from_millis(4500)).await;
    running.stop().await;
    assert_eq!(rx.requests().len(), 1, "sent again");
    let d = &deliveries(&t.db).await[0];
    assert_eq!((d.status.as_str(), d.attempts), ("delivered", 1));
    assert_eq!(outcomes(&metrics, "stale"), 0.0);
}
