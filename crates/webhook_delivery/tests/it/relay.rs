//! Deliveries the fan-out claims for the delivery role of its own process
//! (docs/adr/0087): claimed only under that role's live token, sent once by
//! its tick without a claim statement, and claimed again after their lease
//! when nobody takes them.

use std::time::Duration;

use db::{Db, Row, sql};
use leader::Role;
use scheduler::Wake;
use testbed::TestDb;
use testbed::receiver::Receiver;

use crate::{
    as_leader, config, deliveries, endpoint, events_handed_over, led_role, manager, tick, worker,
};

/// Offer `wake`'s relay to the fan-out as a delivery tick leading under
/// `token` would (its lease, its room), then fan out `events` events of
/// tenant_a handed over to it.
async fn offered(db: &Db, wake: &Wake, token: i64, lease: Duration, room: usize, events: usize) {
    wake.relay().lead(token, lease, room);
    events_handed_over(db, "tenant_a", events, Some(wake)).await;
}

/// While the delivery role leads under a token, a fan-out handed its relay
/// claims up to the room offered (attempt 1, the lease ahead) and leaves the
/// rest pending; under a token the role does not hold it claims none.
///
/// Mutation check: the fan-out without `leader_fence('webhook_delivery', $8)`
/// claims for the stale token too, and this test fails (scripts/mutation-check
/// `relay_fence`).
#[tokio::test]
async fn the_fan_out_claims_for_the_delivery_role_only_under_its_live_token() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", "http://127.0.0.1:9/a").await;
    endpoint(&t, "tenant_a", "http://127.0.0.1:9/b").await;
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    let (db, relay) = (t.db.clone(), wake.clone());
    as_leader(
        &manager(&t.db, "w"),
        Role::WebhookDelivery,
        |tick| async move {
            let token = tick.fence.token();
            offered(&db, &relay, token + 1, Duration::from_secs(30), 3, 1).await;
            assert_eq!(relay.relay().waiting(), 0, "a stale token claims nothing");
            offered(&db, &relay, token, Duration::from_secs(30), 3, 2).await;
            assert_eq!(relay.relay().waiting(), 3, "the room offered");
        },
    )
    .await;
    let claimed: Vec<(i32, bool)> = deliveries(&t.db)
        .await
        .iter()
        .map(|d| (d.attempts, d.due_in > 20.0))
        .collect();
    assert_eq!(
        claimed,
        [
            (0, false),
            (0, false),
            (1, true),
            (1, true),
            (1, true),
            (0, false)
        ]
    );
}

/// A fan-out while a delivery tick runs in the same process hands its
/// deliveries over: each is sent once, at attempt 1, and its attempt is the
/// one the fan-out's transaction counted (`last_attempt_at` is the
/// delivery's `created_at`: no claim statement wrote it).
///
/// Mutation check: a tick that never takes the handed deliveries leaves them
/// to their claim lease (2 s here), after which the claim statement sends
/// them at attempt 2, and this test fails (scripts/mutation-check
/// `relay_taken`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_handed_over_are_sent_once_by_the_running_tick() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    endpoint(&t, "tenant_a", &rx.url_at("/b")).await;
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    let (w, _) = worker(&t.db, config());
    let w = w
        .with_idle_probe(Duration::from_secs(16))
        .with_wake(wake.clone());
    let (role, shutdown) = led_role(&t.db, w);
    tokio::time::sleep(Duration::from_millis(300)).await;
    events_handed_over(&t.db, "tenant_a", 3, Some(&wake)).await;
    rx.until_count(6, Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    shutdown.cancel();
    role.await.unwrap();
    assert_eq!(rx.count(), 6, "each delivery sent once");
    let d = deliveries(&t.db).await;
    assert!(d.iter().all(|d| d.delivered && d.attempts == 1), "{d:?}");
    let handed: i64 =
        t.db.fetch_one(sql(
            "SELECT count(*) AS n FROM webhook_deliveries WHERE last_attempt_at = created_at",
        ))
        .await
        .unwrap()
        .get("n");
    assert_eq!(handed, 6, "claimed by the fan-out's transaction");
}

/// Deliveries handed over that no tick takes (the process stopped) are not
/// lost: once their lease has passed, the claim statement of whoever leads
/// claims and sends them.
#[tokio::test]
async fn handed_deliveries_nobody_takes_are_claimed_again_after_their_lease() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    let (db, relay) = (t.db.clone(), wake.clone());
    as_leader(
        &manager(&t.db, "w"),
        Role::WebhookDelivery,
        |tick| async move {
            offered(
                &db,
                &relay,
                tick.fence.token(),
                Duration::from_secs(3),
                10,
                1,
            )
            .await;
            assert_eq!(relay.relay().take(10).len(), 1, "handed, then dropped");
        },
    )
    .await;
    let (w, _) = worker(&t.db, config());
    tick(&t.db, &w).await;
    assert_eq!(rx.count(), 0, "not claimable while its lease runs");
    tokio::time::sleep(Duration::from_millis(3200)).await;
    tick(&t.db, &w).await;
    assert_eq!(rx.count(), 1);
    let d = deliveries(&t.db).await;
    assert!(d[0].delivered && d[0].attempts == 2, "{d:?}");
}

/// A tick cancelled (a shutdown, a lost lease) with deliveries handed over
/// and not yet taken hands them back at once, unsent and their attempt not
/// counted, instead of leaving them to their claim lease.
///
/// Mutation check: without the hand-back they stay claimed for their lease
/// and this test fails (scripts/mutation-check `relay_hand_back`).
#[tokio::test]
async fn a_cancelled_tick_hands_back_the_deliveries_it_did_not_take() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", "http://127.0.0.1:9/a").await;
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    let (w, _) = worker(&t.db, config());
    let w = w.with_wake(wake.clone());
    let (db, relay) = (t.db.clone(), wake.clone());
    let report = as_leader(
        &manager(&t.db, "w"),
        Role::WebhookDelivery,
        |tick| async move {
            offered(
                &db,
                &relay,
                tick.fence.token(),
                Duration::from_secs(30),
                10,
                2,
            )
            .await;
            assert_eq!(relay.relay().waiting(), 2);
            tick.cancel.cancel();
            w.run_tick(&tick).await
        },
    )
    .await;
    assert_eq!((report.claimed, report.held), (0, 2), "{report:?}");
    assert_eq!(wake.relay().waiting(), 0);
    let d = deliveries(&t.db).await;
    assert!(
        d.iter().all(|d| d.attempts == 0 && d.due_in <= 0.0),
        "{d:?}"
    );
}
