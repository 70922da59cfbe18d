//! How a dispatcher tick ends, and what the role loop does with it
//! (docs/adr/0007): a failed claim ends it failed, a spent budget with events
//! left ends it with more work, and the loop runs the next tick at once.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leader::{Role, TickEnd};
use scheduler::{RoleSpec, Stop, run_role, work};
use testbed::TestDb;
use testbed::leadership::until_ticks;
use tokio_util::sync::CancellationToken;
use webhook_outbox::DispatcherConfig;

use crate::{as_leader, count, dispatcher, endpoint, event, manager};

/// A backlog of 200 events with batches of 10 and a 1 ms budget (about one
/// batch a tick) drains through `scheduler::run_role` with an hourly interval
/// within seconds: each budget-stopped tick is due again at once. The test
/// waits for the loop's first refused poll: the tick before it found nothing.
///
/// Mutation check: the driver mapping `Stop::Budget` to `TickEnd::Drained`
/// stamps the first tick completed, the role waits its hour, and the backlog
/// stays (seen failing so).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_larger_than_one_budget_drains_in_consecutive_ticks_without_the_interval() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", &[], true).await;
    let mut tx = t.db.begin().await.unwrap();
    for n in 0..200 {
        webhook_outbox::enqueue(
            &mut tx,
            "tenant_a",
            "invoice.paid",
            &format!(r#"{{"n": {n}}}"#),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let config = DispatcherConfig {
        batch_size: 10,
        tick_budget: Duration::from_millis(1),
        ..DispatcherConfig::default()
    };
    let (d, _) = dispatcher(&t.db, config);
    let ends = Arc::new(Mutex::new(Vec::new()));
    let e = ends.clone();
    let spec = RoleSpec {
        role: Role::WebhookOutbox,
        interval: Duration::from_secs(3600),
        work: work(move |tick| {
            let (d, e) = (d.clone(), e.clone());
            async move {
                let end = d.run_tick(&tick).await.end;
                e.lock().unwrap().push(end.clone());
                end
            }
        }),
    };
    let shutdown = CancellationToken::new();
    let m = manager(&t.db, "a");
    let mut ticks = m.ticks();
    let started = Instant::now();
    let l = tokio::spawn(run_role(m, spec, shutdown.child_token()));
    let undispatched = "SELECT count(*) FROM webhook_events WHERE dispatched_at IS NULL";
    until_ticks(&mut ticks, Duration::from_secs(30), "a refused poll", |l| {
        l.role(Role::WebhookOutbox).not_led >= 1
    })
    .await;
    let drained_after = started.elapsed();
    shutdown.cancel();
    l.await.unwrap();
    let ends = ends.lock().unwrap().clone();
    println!(
        "200 events drained after {drained_after:?} in {} ticks",
        ends.len()
    );
    assert_eq!(count(&t.db, undispatched).await, 0, "ends: {ends:?}");
    assert!(drained_after < Duration::from_secs(20), "{drained_after:?}");
    assert!(
        ends.iter().filter(|e| **e == TickEnd::MoreWork).count() >= 2,
        "several budget-stopped ticks: {ends:?}"
    );
    assert_eq!(
        count(&t.db, "SELECT count(*) FROM webhook_deliveries").await,
        200
    );
}

/// A claim that cannot take its rows (the table locked past the 200 ms
/// statement timeout) ends the tick failed, with the database's error, and
/// dispatches nothing; once the lock is gone the next tick does the work.
///
/// Mutation check: the driver mapping `Stop::Failed` to `TickEnd::Drained`
/// would release the tick as completed (an hourly role then waits an hour);
/// this test then fails on the first tick's end (seen failing so).
#[tokio::test]
async fn a_claim_that_times_out_on_a_locked_table_ends_the_tick_failed() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", &[], true).await;
    event(&t.db, "tenant_a", "invoice.paid", "{}").await;
    let config = DispatcherConfig {
        statement_timeout: Duration::from_millis(200),
        ..DispatcherConfig::default()
    };
    let (d, _) = dispatcher(&t.db, config);
    let m = manager(&t.db, "a");
    let mut owner = t.superuser().await;
    sqlx::raw_sql("BEGIN; LOCK TABLE webhook_events IN ACCESS EXCLUSIVE MODE")
        .execute(&mut owner)
        .await
        .unwrap();
    let d1 = d.clone();
    let report = as_leader(&m, Role::WebhookOutbox, |tick| async move {
        d1.run_tick(&tick).await
    })
    .await;
    sqlx::raw_sql("ROLLBACK").execute(&mut owner).await.unwrap();
    let TickEnd::Failed(error) = &report.end else {
        panic!("a failed claim must end the tick failed: {report:?}");
    };
    assert!(error.contains("statement timeout"), "{error}");
    assert!(matches!(report.stop, Stop::Failed(_)), "{report:?}");
    assert_eq!((report.batches, report.events), (0, 0));

    let report = as_leader(&m, Role::WebhookOutbox, |tick| async move {
        d.run_tick(&tick).await
    })
    .await;
    assert_eq!(report.end, TickEnd::DrainedDueNow, "{report:?}");
    assert_eq!(report.events, 1);
}

/// Without wake-ups (no listener), a tick that found work is followed at once
/// by the next, which finds nothing and ends drained; an idle role then waits
/// its (hourly) interval: the loop's next poll is refused.
///
/// Mutation check: the driver ignoring work found (`let due_now = listened
/// || (claimed > 0 && role.due_again_after_work());` → `let due_now =
/// listened;`) ends the first tick drained and no second tick runs within the
/// hour: this test fails (scripts/mutation-check `driver_due_after_work`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_that_found_work_is_followed_at_once_and_an_idle_one_waits_its_interval() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", &[], true).await;
    event(&t.db, "tenant_a", "invoice.paid", r#"{"n": 1}"#).await;
    let (d, _) = dispatcher(&t.db, DispatcherConfig::default());
    let ends = Arc::new(Mutex::new(Vec::new()));
    let e = ends.clone();
    let spec = RoleSpec {
        role: Role::WebhookOutbox,
        interval: Duration::from_secs(3600),
        work: work(move |tick| {
            let (d, e) = (d.clone(), e.clone());
            async move {
                let end = d.run_tick(&tick).await.end;
                e.lock().unwrap().push(end.clone());
                end
            }
        }),
    };
    let shutdown = CancellationToken::new();
    let m = manager(&t.db, "a");
    let mut ticks = m.ticks();
    let l = tokio::spawn(run_role(m, spec, shutdown.child_token()));
    until_ticks(&mut ticks, Duration::from_secs(10), "a refused poll", |l| {
        l.role(Role::WebhookOutbox).not_led >= 1
    })
    .await;
    shutdown.cancel();
    l.await.unwrap();
    let ends = ends.lock().unwrap().clone();
    assert_eq!(ends, vec![TickEnd::DrainedDueNow, TickEnd::Drained]);
    assert_eq!(
        count(&t.db, "SELECT count(*) FROM webhook_deliveries").await,
        1
    );
}

/// A tick that ends with events left exports how many wait and how long the
/// oldest has waited (`HardcountWebhookEventsUndispatched` reads the age); a
/// tick that drains sets both to 0. Mutation `outbox_backlog_unset` (the
/// count gauge set to 0 at the tick's end): seen failing here.
#[tokio::test]
async fn a_tick_exports_the_events_left_and_the_oldest_ones_age() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", &[], true).await;
    for _ in 0..5 {
        event(&t.db, "tenant_a", "invoice.paid", "{}").await;
    }
    let mut owner = t.superuser().await;
    sqlx::raw_sql("UPDATE webhook_events SET created_at = now() - interval '300 seconds'")
        .execute(&mut owner)
        .await
        .unwrap();
    let m = manager(&t.db, "a");
    let short = DispatcherConfig {
        batch_size: 2,
        tick_budget: Duration::from_millis(1),
        ..DispatcherConfig::default()
    };
    let (d, metrics) = dispatcher(&t.db, short);
    let report = as_leader(&m, Role::WebhookOutbox, |tick| async move {
        d.run_tick(&tick).await
    })
    .await;
    assert!(report.events < 5, "{report:?}");
    assert_eq!(
        crate::series(&metrics, "hardcount_webhook_events_undispatched"),
        Some((5 - report.events) as f64)
    );
    let age = crate::series(
        &metrics,
        "hardcount_webhook_events_oldest_undispatched_age_seconds",
    )
    .unwrap();
    assert!((300.0..400.0).contains(&age), "{age}");

    let (d, metrics) = dispatcher(&t.db, DispatcherConfig::default());
    as_leader(&m, Role::WebhookOutbox, |tick| async move {
        d.run_tick(&tick).await
    })
    .await;
    assert_eq!(
        crate::series(&metrics, "hardcount_webhook_events_undispatched"),
        Some(0.0)
    );
    assert_eq!(
        crate::series(
            &metrics,
            "hardcount_webhook_events_oldest_undispatched_age_seconds"
        ),
        Some(0.0)
    );
}

/// A tick's end reads the backlog at most once per `backlog_read_every`
/// (docs/adr/0138): a second tick within the interval leaves the first
/// tick's read standing, its stamp and its count. With the tick's end
/// reading without asking (mutation `outbox_backlog_read_ungated`) the second
/// tick reads the event added between them and stamps again: this fails.
#[tokio::test]
async fn a_tick_within_the_backlog_read_interval_does_not_read_again() {
    let t = TestDb::new().await;
    // A patient lease: the test is about the tick's end, not its lease.
    let m = testbed::leadership::patient_manager(&t.db, "a");
    let hourly = DispatcherConfig {
        backlog_read_every: Duration::from_secs(3600),
        tick_budget: Duration::from_millis(1),
        batch_size: 1,
        ..DispatcherConfig::default()
    };
    let (d, metrics) = dispatcher(&t.db, hourly);
    let stamp = || {
        crate::series(
            &metrics,
            "hardcount_backlog_read_timestamp_seconds{role=\"webhook_outbox\"}",
        )
    };
    let first = d.clone();
    as_leader(&m, Role::WebhookOutbox, |tick| async move {
        first.run_tick(&tick).await
    })
    .await;
    let read = stamp().expect("the first tick reads and stamps");
    assert_eq!(
        crate::series(&metrics, "hardcount_webhook_events_undispatched"),
        Some(0.0)
    );

    // An event the next tick, with its 1 ms budget, may leave undispatched:
    // a read would count it or stamp a later time, either way not this.
    endpoint(&t, "tenant_a", &[], true).await;
    event(&t.db, "tenant_a", "invoice.paid", "{}").await;
    as_leader(&m, Role::WebhookOutbox, |tick| async move {
        d.run_tick(&tick).await
    })
    .await;
    assert_eq!(stamp(), Some(read), "the second tick read again");
    assert_eq!(
        crate::series(&metrics, "hardcount_webhook_events_undispatched"),
        Some(0.0)
    );
}
