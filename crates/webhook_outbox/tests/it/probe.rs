//! Idle probes (docs/adr/0019): without a listener, a drained tick of a
//! probing dispatcher stays open while it holds the lease and asks every
//! `scheduler::IDLE_PROBE` whether an event waits, so an event enqueued into
//! the idle role is fanned out within about a probe, not after the interval;
//! the tick still ends at its budget (due again at once) and at once on a
//! cancel.

use std::time::{Duration, Instant};

use leader::{Role, TickEnd};
use scheduler::{IDLE_PROBE, RoleSpec, Stop, run_role, work};
use testbed::TestDb;
use tokio_util::sync::CancellationToken;
use webhook_outbox::DispatcherConfig;

use crate::{as_leader, count, dispatcher, endpoint, event, manager};

/// The role led and run as `hardcount serve` runs it, probing while idle,
/// with a 5 s interval and no listener; cancel the token to stop it.
fn idle_probing_role(t: &TestDb) -> (tokio::task::JoinHandle<()>, CancellationToken) {
    let (d, _) = dispatcher(&t.db, DispatcherConfig::default());
    let d = d.with_idle_probe(IDLE_PROBE);
    let spec = RoleSpec {
        role: Role::WebhookOutbox,
        interval: Duration::from_secs(5),
        work: work(move |tick| {
            let d = d.clone();
            async move { d.run_tick(&tick).await.end }
        }),
    };
    let shutdown = CancellationToken::new();
    let role = tokio::spawn(run_role(manager(&t.db, "a"), spec, shutdown.child_token()));
    (role, shutdown)
}

/// With a 5 s interval and no listener, each of five events enqueued into
/// the idle, led role is fanned out within 500 ms of its commit (about one
/// probe, 100 ms).
///
/// Mutation check: the driver ending a drained tick although the role probes
/// (`&& probe_every.is_none() {` → `{`) leaves the role to its 5 s interval
/// and this test fails (scripts/mutation-check `driver_probes`); so does a
/// probe that never sees the waiting event (`outbox_probe`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_enqueued_into_an_idle_probing_role_is_dispatched_well_inside_one_interval() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", &[], true).await;
    let (role, shutdown) = idle_probing_role(&t);
    // Let the first tick drain the empty outbox and go idle.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let undispatched = "SELECT count(*) FROM webhook_events WHERE dispatched_at IS NULL";
    let mut waits = Vec::new();
    for n in 0..5 {
        event(
            &t.db,
            "tenant_a",
            "invoice.paid",
            &format!(r#"{{"n":{n}}}"#),
        )
        .await;
        let committed = Instant::now();
        while count(&t.db, undispatched).await > 0 {
            assert!(
                committed.elapsed() < Duration::from_secs(20),
                "never dispatched"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        waits.push(committed.elapsed());
        tokio::time::sleep(Duration::from_millis(70)).await;
    }
    shutdown.cancel();
    role.await.unwrap();
    println!("commit to dispatched: {waits:?}");
    assert!(
        waits.iter().all(|w| *w < Duration::from_millis(500)),
        "{waits:?}"
    );
    assert_eq!(
        count(&t.db, "SELECT count(*) FROM webhook_deliveries").await,
        5
    );
}

/// An idle probing tick claims what is enqueued while it waits, ends at its
/// budget as drained but due again at once (so the next tick follows without
/// the interval), and a cancelled one ends within a few milliseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_probing_tick_ends_at_its_budget_due_now_and_at_once_when_cancelled() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", &[], true).await;
    let config = DispatcherConfig {
        tick_budget: Duration::from_secs(1),
        ..DispatcherConfig::default()
    };
    let (d, _) = dispatcher(&t.db, config);
    let d = d.with_idle_probe(IDLE_PROBE);
    let m = manager(&t.db, "a");
    let db = t.db.clone();
    let producer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(400)).await;
        event(&db, "tenant_a", "invoice.paid", r#"{"n": 1}"#).await;
    });
    let report = as_leader(&m, Role::WebhookOutbox, |tick| {
        let d = d.clone();
        async move { d.run_tick(&tick).await }
    })
    .await;
    producer.await.unwrap();
    assert_eq!(report.stop, Stop::Drained, "{report:?}");
    assert_eq!(report.end, TickEnd::DrainedDueNow, "{report:?}");
    assert_eq!(report.events, 1, "{report:?}");
    assert!(report.elapsed >= Duration::from_millis(900), "{report:?}");

    let report = as_leader(&m, Role::WebhookOutbox, |tick| {
        let d = d.clone();
        let cancel = tick.cancel.clone();
        async move {
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(250)).await;
                cancel.cancel();
            });
            d.run_tick(&tick).await
        }
    })
    .await;
    assert_eq!(report.stop, Stop::Cancelled, "{report:?}");
    assert!(
        report.elapsed < Duration::from_millis(400),
        "a cancel ends the wait at once: {report:?}"
    );
}

/// A handoff whose lease ended (docs/adr/0124: the replica that led both
/// webhook roles died with first attempts in flight) is found by the idle
/// probe of a role with no event to fan out: its delivery is inserted
/// pending, at attempt 1, within about a probe, not after the 5 s interval.
///
/// Mutation check: a probe that reads only the events leaves it to the
/// interval and this test fails (scripts/mutation-check `outbox_probe_handoffs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_handoff_is_inserted_pending_by_an_idle_probing_role() {
    let t = TestDb::new().await;
    let endpoint_id = endpoint(&t, "tenant_a", &[], false).await;
    let event_id = event(&t.db, "tenant_a", "invoice.paid", r#"{"n":1}"#).await;
    let (role, shutdown) = idle_probing_role(&t);
    // The first tick fans the event out to no one (its endpoint is off) and
    // goes idle; then the endpoint is on, as it was when the lost replica
    // handed the pair over.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut su = t.superuser().await;
    sqlx::query("UPDATE webhook_endpoints SET enabled = true, disabled_reason = NULL")
        .execute(&mut su)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO webhook_handoffs (until, tenant_ids, event_ids, endpoint_ids) \
         VALUES (now() - interval '1 second', ARRAY['tenant_a'], ARRAY[$1::int8], ARRAY[$2::int8])",
    )
    .bind(event_id)
    .bind(endpoint_id)
    .execute(&mut su)
    .await
    .unwrap();
    let planted = Instant::now();
    let inserted = "SELECT count(*) FROM webhook_deliveries WHERE attempts = 1";
    while count(&t.db, inserted).await == 0 {
        assert!(
            planted.elapsed() < Duration::from_secs(20),
            "never inserted"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let waited = planted.elapsed();
    shutdown.cancel();
    role.await.unwrap();
    assert!(waited < Duration::from_millis(1500), "{waited:?}");
    assert_eq!(
        count(&t.db, "SELECT count(*) FROM webhook_handoffs").await,
        0
    );
}
