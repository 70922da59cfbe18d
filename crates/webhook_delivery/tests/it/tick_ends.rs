//! How a delivery tick ends, and what the role loop does with it
//! (docs/adr/0007): a failed claim ends it failed, a spent budget with
//! deliveries left ends it with more work, and the loop runs the next tick at once.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use db::Row;
use leader::{Role, TickEnd};
use scheduler::{RoleSpec, Stop, run_role, work};
use testbed::TestDb;
use testbed::leadership::until_ticks;
use tokio_util::sync::CancellationToken;
use webhook_delivery::WorkerConfig;

use crate::{as_leader, config, deliveries, endpoint, events, manager, worker};
use testbed::receiver::{Receiver, Reply};

/// Ten due deliveries, claimed two at a time by a worker whose budget leaves
/// room for about one batch a tick (a 1.2 s budget, 1 s requests, a receiver
/// that answers after 250 ms), all reach the receiver through
/// `scheduler::run_role` with an hourly interval within seconds: each
/// budget-stopped tick is due again at once.
///
/// Mutation check: the driver mapping `Stop::Budget` to `TickEnd::Drained`
/// stamps the first tick completed, the role waits its hour, and eight
/// deliveries stay pending (seen failing so).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_larger_than_one_budget_is_delivered_in_consecutive_ticks_without_the_interval() {
    let t = TestDb::new().await;
    let rx = Receiver::start(|_| Reply::Delayed(Duration::from_millis(250), 200)).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    events(&t.db, "tenant_a", 10).await;
    let (w, _) = worker(
        &t.db,
        WorkerConfig {
            batch_size: 2,
            tick_budget: Duration::from_millis(1200),
            ..config()
        },
    );
    let ends = Arc::new(Mutex::new(Vec::new()));
    let e = ends.clone();
    let spec = RoleSpec {
        role: Role::WebhookDelivery,
        interval: Duration::from_secs(3600),
        work: work(move |tick| {
            let (w, e) = (w.clone(), e.clone());
            async move {
                let end = w.run_tick(&tick).await.end;
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
    let delivered = |ds: &[crate::Delivery]| ds.iter().filter(|d| d.status == "delivered").count();
    // The loop's first refused poll: the tick before it found nothing due.
    until_ticks(&mut ticks, Duration::from_secs(30), "a refused poll", |l| {
        l.role(Role::WebhookDelivery).not_led >= 1
    })
    .await;
    let drained_after = started.elapsed();
    shutdown.cancel();
    l.await.unwrap();
    let ends = ends.lock().unwrap().clone();
    println!(
        "10 deliveries made after {drained_after:?} in {} ticks",
        ends.len()
    );
    assert_eq!(delivered(&deliveries(&t.db).await), 10, "ends: {ends:?}");
    assert!(drained_after < Duration::from_secs(20), "{drained_after:?}");
    assert!(
        ends.iter().filter(|e| **e == TickEnd::MoreWork).count() >= 2,
        "several budget-stopped ticks: {ends:?}"
    );
    assert_eq!(rx.requests().len(), 10);
}

/// A claim that cannot take its rows (`webhook_deliveries` locked past the
/// 200 ms statement timeout) ends the tick failed with the database's error
/// and sends nothing; once the lock is gone the next tick delivers.
///
/// Mutation check: the driver mapping `Stop::Failed` to `TickEnd::Drained`
/// would release the tick as completed (an hourly role then waits an hour);
/// this test then fails on the first tick's end (seen failing so).
#[tokio::test]
async fn a_claim_that_times_out_on_a_locked_table_ends_the_tick_failed() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    events(&t.db, "tenant_a", 1).await;
    let (w, _) = worker(
        &t.db,
        WorkerConfig {
            statement_timeout: Duration::from_millis(200),
            ..config()
        },
    );
    let m = manager(&t.db, "a");
    let mut owner = t.superuser().await;
    sqlx::raw_sql("BEGIN; LOCK TABLE webhook_deliveries IN ACCESS EXCLUSIVE MODE")
        .execute(&mut owner)
        .await
        .unwrap();
    let w1 = w.clone();
    let report = as_leader(&m, Role::WebhookDelivery, |tick| async move {
        w1.run_tick(&tick).await
    })
    .await;
    sqlx::raw_sql("ROLLBACK").execute(&mut owner).await.unwrap();
    let TickEnd::Failed(error) = &report.end else {
        panic!("a failed claim must end the tick failed: {report:?}");
    };
    assert!(error.contains("statement timeout"), "{error}");
    assert!(matches!(report.stop, Stop::Failed(_)), "{report:?}");
    assert_eq!(report.claimed, 0);
    assert!(rx.requests().is_empty());

    let report = as_leader(&m, Role::WebhookDelivery, |tick| async move {
        w.run_tick(&tick).await
    })
    .await;
    assert_eq!(report.end, TickEnd::DrainedDueNow, "{report:?}");
    assert_eq!(report.delivered, 1, "{report:?}");
    let attempts: i32 =
        t.db.fetch_one(db::sql("SELECT attempts FROM webhook_deliveries"))
            .await
            .unwrap()
            .get("attempts");
    assert_eq!(attempts, 1, "the failed claim counted no attempt");
}
