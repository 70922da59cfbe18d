//! Idle probes of the delivery role (docs/adr/0019): without a listener, the
//! idle, led role asks every `scheduler::IDLE_PROBE` whether a delivery is
//! due and delivers a fanned-out one within about a probe, not the interval;
//! a fan-out in the same process that hands its deliveries over ends the
//! probe's pause at once (docs/adr/0070).

use std::time::Duration;

use leader::Role;
use scheduler::{IDLE_PROBE, Wake};
use testbed::TestDb;
use testbed::receiver::Receiver;
use webhook_delivery::Worker;

use crate::{config, endpoint, events_handed_over, led_role, worker};

/// Run `w` as the led delivery role at a 5 s interval and, once it idles,
/// fan out one event three times (handing each over to `hand_over`), each
/// after the last one's POST arrived. Returns how long each POST took to
/// arrive once its fan-out had committed.
async fn waits_to_post(hand_over: Option<&Wake>, w: impl Fn(Worker) -> Worker) -> Vec<Duration> {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    let (plain, _) = worker(&t.db, config());
    let w = w(plain);
    let (role, shutdown) = led_role(&t.db, w);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut waits = Vec::new();
    for n in 1..=3 {
        events_handed_over(&t.db, "tenant_a", 1, hand_over).await;
        waits.push(rx.until_count(n, Duration::from_secs(20)).await);
        tokio::time::sleep(Duration::from_millis(70)).await;
    }
    shutdown.cancel();
    role.await.unwrap();
    println!("fan-out commit to POST: {waits:?}");
    waits
}

/// With a 5 s interval and no listener, each of three deliveries fanned out
/// while the role is idle reaches the receiver within 500 ms of the fan-out's
/// commit.
///
/// Mutation check: a probe that never sees a due delivery leaves the role to
/// its budget and this test fails (scripts/mutation-check `delivery_probe`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fanned_out_delivery_reaches_the_idle_probing_role_well_inside_one_interval() {
    let waits = waits_to_post(None, |w| w.with_idle_probe(IDLE_PROBE)).await;
    assert!(
        waits.iter().all(|w| *w < Duration::from_millis(500)),
        "{waits:?}"
    );
}

/// With no listener and a 16 s probe period (the first pause 2 s), each of
/// three deliveries fanned out by a dispatcher that hands them over to the
/// role's wake reaches the receiver within 500 ms of the fan-out's commit.
///
/// Mutation check: the fan-out without its poke (`hand_over_fan_out`)
/// leaves each delivery to the role's next probe, 2 s or more on, and this
/// test fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_handed_over_in_this_process_reaches_the_idle_role_at_once() {
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    let waits = waits_to_post(Some(&wake), |w| {
        w.with_idle_probe(Duration::from_secs(16))
            .with_wake(wake.clone())
    })
    .await;
    assert!(
        waits.iter().all(|w| *w < Duration::from_millis(500)),
        "{waits:?}"
    );
}
