//! Wake-ups (docs/adr/0014): with a listener on the bed's Postgres directly
//! (the session a LISTEN needs, whichever leg the app pool uses), an enqueue
//! wakes the led, idle role within milliseconds; a listener whose connection
//! is killed falls back to polling and loses nothing.

use std::time::{Duration, Instant};

use leader::Role;
use scheduler::{RoleSpec, Wake, listen, run_role, work};
use testbed::{Leg, TestDb};
use tokio_util::sync::CancellationToken;
use webhook_outbox::{Dispatcher, DispatcherConfig};

use crate::{count, dispatcher, endpoint, event, manager};

/// A listener for `wake` on the bed's Postgres directly, and once it listens,
/// the role loop of `d` with `interval`, until `shutdown`. (A tick that
/// starts before the listener is up ends drained as without one: the role
/// listens from its next tick, one interval later.)
async fn spawn_listening(
    t: &TestDb,
    d: Dispatcher,
    wake: &Wake,
    interval: Duration,
    shutdown: &CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    let d = d.with_wake(wake.clone());
    let spec = RoleSpec {
        role: Role::WebhookOutbox,
        interval,
        work: work(move |tick| {
            let d = d.clone();
            async move { d.run_tick(&tick).await.end }
        }),
    };
    let listener = tokio::spawn(listen(
        t.app_url(Leg::Direct),
        vec![wake.clone()],
        Duration::from_millis(200),
        shutdown.child_token(),
    ));
    until(Duration::from_secs(10), "the listener", async || {
        wake.is_listening()
    })
    .await;
    let role = tokio::spawn(run_role(manager(&t.db, "a"), spec, shutdown.child_token()));
    vec![listener, role]
}

/// With a 5 s interval and a listener, the idle, led role: `rounds` times,
/// `enqueue(n)` commits events and the wait until none is left undispatched
/// is timed. Returns the waits, once the role and the listener have stopped.
async fn waits_to_fan_out(
    t: &TestDb,
    rounds: usize,
    mut enqueue: impl AsyncFnMut(usize),
) -> Vec<Duration> {
    let (d, _) = dispatcher(&t.db, DispatcherConfig::default());
    let interval = Duration::from_secs(5);
    let wake = Wake::new(Role::WebhookOutbox, interval);
    let shutdown = CancellationToken::new();
    let tasks = spawn_listening(t, d, &wake, interval, &shutdown).await;
    // Let the first tick drain the empty outbox and go idle.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut waits = Vec::new();
    for n in 0..rounds {
        enqueue(n).await;
        let waited = until(Duration::from_secs(20), "the fan-out", async || {
            count(
                &t.db,
                "SELECT count(*) FROM webhook_events WHERE dispatched_at IS NULL",
            )
            .await
                == 0
        })
        .await;
        waits.push(waited);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    for task in tasks {
        task.await.unwrap();
    }
    println!("commit to dispatched: {waits:?}");
    waits
}

async fn until(limit: Duration, what: &str, mut f: impl AsyncFnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !f().await {
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    started.elapsed()
}

/// With a 5 s interval, an event enqueued into the idle, led, listening role
/// is fanned out within 500 ms (each of five, one after another); without
/// wake-ups it would wait for the interval.
///
/// Mutation check: the driver ending a drained tick although its wake listens
/// (`if drained && !listening()` → `if drained`) leaves the role polling at
/// its 5 s interval, and this test fails (scripts/mutation-check
/// `driver_listens_outbox`); so does `enqueue` without its `pg_notify`
/// (`enqueue_notify`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_enqueued_into_an_idle_listening_role_is_dispatched_within_milliseconds() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", &[], true).await;
    let waits = waits_to_fan_out(&t, 5, async |n| {
        event(
            &t.db,
            "tenant_a",
            "invoice.paid",
            &format!(r#"{{"n":{n}}}"#),
        )
        .await;
    })
    .await;
    assert!(
        waits.iter().all(|w| *w < Duration::from_millis(500)),
        "{waits:?}"
    );
    assert_eq!(
        count(&t.db, "SELECT count(*) FROM webhook_deliveries").await,
        5
    );
}

/// Events enqueued in bulk (`enqueue_many`, as billing's closing announces its
/// invoices) wake the idle, led, listening role like a single `enqueue`: with
/// a 5 s interval, each of three batches is fanned out within 500 ms.
///
/// Mutation check: `enqueue_many` without its `pg_notify` leaves the role
/// polling at its 5 s interval, and this test fails (scripts/mutation-check
/// `enqueue_many_notify`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_enqueued_in_bulk_wake_the_idle_listening_role() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", &[], true).await;
    let waits = waits_to_fan_out(&t, 3, async |n| {
        let payloads: Vec<String> = (0..4).map(|i| format!(r#"{{"n":{n},"i":{i}}}"#)).collect();
        let events: Vec<webhook_outbox::NewEvent<'_>> = payloads
            .iter()
            .map(|p| ("tenant_a", "invoice.paid", p.as_str()))
            .collect();
        let mut tx = t.db.begin().await.unwrap();
        assert_eq!(
            webhook_outbox::enqueue_many(&mut tx, &events)
                .await
                .unwrap(),
            4
        );
        tx.commit().await.unwrap();
    })
    .await;
    assert!(
        waits.iter().all(|w| *w < Duration::from_millis(500)),
        "{waits:?}"
    );
    assert_eq!(
        count(&t.db, "SELECT count(*) FROM webhook_deliveries").await,
        12
    );
}

/// Events enqueued every few milliseconds while the listener's connection is
/// terminated twice: the role falls back to polling its 1 s interval, the
/// listener reconnects, and every event is fanned out exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_listener_connection_falls_back_to_polling_and_nothing_is_lost() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", &[], true).await;
    let (d, _) = dispatcher(&t.db, DispatcherConfig::default());
    let interval = Duration::from_secs(1);
    let wake = Wake::new(Role::WebhookOutbox, interval);
    let shutdown = CancellationToken::new();
    let tasks = spawn_listening(&t, d, &wake, interval, &shutdown).await;
    let mut admin = t.superuser().await;
    let total = 300;
    let mut kills = 0;
    for n in 0..total {
        event(
            &t.db,
            "tenant_a",
            "invoice.paid",
            &format!(r#"{{"n":{n}}}"#),
        )
        .await;
        if n % 100 == 50 {
            let killed: i64 = sqlx::query_scalar(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE application_name = $1 AND datname = current_database()",
            )
            .bind(db::LISTEN_APPLICATION_NAME)
            .fetch_one(&mut admin)
            .await
            .unwrap();
            kills += killed;
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    let undispatched = "SELECT count(*) FROM webhook_events WHERE dispatched_at IS NULL";
    let drained = until(
        Duration::from_secs(20),
        "every event dispatched",
        async || count(&t.db, undispatched).await == 0,
    )
    .await;
    until(Duration::from_secs(10), "the listener back", async || {
        wake.is_listening()
    })
    .await;
    shutdown.cancel();
    for task in tasks {
        task.await.unwrap();
    }
    println!(
        "{kills} listener connections killed; the rest dispatched {drained:?} after the last enqueue"
    );
    assert!(kills >= 2, "the listener was killed {kills} times");
    assert_eq!(
        count(&t.db, "SELECT count(*) FROM webhook_deliveries").await,
        total
    );
}

/// Events of three tenants enqueued in one transaction (one notification)
/// into the idle, led, listening role: a fair claim gives each tenant a third
/// of the batch, so the first claims come back short (498 of 500) while
/// events wait, and no notification announces those. The role claims again
/// after `BUSY_POLL`, as without a listener, and all 1,200 are fanned out
/// well within the 5 s poll interval.
///
/// Mutation check: `listening_busy_waits_poll` (a listening role waiting
/// its whole poll after a short claim that found work) makes each short claim
/// wait 5 s, and this test fails; seen failing under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_of_several_tenants_is_fanned_out_without_waiting_the_poll() {
    let t = TestDb::new().await;
    let waits = waits_to_fan_out(&t, 1, async |_| {
        let events: Vec<webhook_outbox::NewEvent<'_>> = ["tenant_a", "tenant_b", "tenant_c"]
            .iter()
            .flat_map(|tenant| (0..400).map(move |_| (*tenant, "invoice.paid", "{}")))
            .collect();
        let mut tx = t.db.begin().await.unwrap();
        webhook_outbox::enqueue_many(&mut tx, &events)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    })
    .await;
    assert!(waits[0] < Duration::from_secs(2), "{waits:?}");
}
