//! Role loops and the panic guard against real Postgres, in both legs of the bed.

mod hand_over;
mod steps;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use db::{Db, Row, sql};
use leader::{Manager, Role, Telemetry, TickEnd, TickOutcome, Timing};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use scheduler::{Panics, RoleSpec, run_role, work};
use testbed::TestDb;
use testbed::leadership::until_ticks;
use tokio_util::sync::CancellationToken;

fn fast() -> Timing {
    let ms = Duration::from_millis;
    Timing::new(ms(1000), ms(300), ms(200), ms(600), ms(200)).unwrap()
}

pub(crate) fn manager(db: &Db) -> (Manager, PrometheusHandle, Telemetry) {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let telemetry = Telemetry::new(Arc::new(recorder));
    (
        Manager::new(db.clone(), fast(), telemetry.clone()),
        handle,
        telemetry,
    )
}

fn series(handle: &PrometheusHandle, line_prefix: &str) -> Option<f64> {
    handle.render().lines().find_map(|l| {
        l.strip_prefix(line_prefix)
            .map(|v| v.trim().parse().unwrap())
    })
}

async fn lease_state(db: &Db, role: Role) -> (bool, Option<f64>) {
    let r = db
        .fetch_one(
            sql("SELECT last_tick_ended_at IS NOT NULL AS completed, extract(epoch FROM not_before - now())::float8 AS cooldown \
                 FROM leader_leases WHERE role = $1")
            .bind(role.as_str()),
        )
        .await
        .unwrap();
    (r.get("completed"), r.get("cooldown"))
}

/// A panic stops a step, not the tick (docs/design.md §5): the third step runs
/// although the second panicked, and the tick is still released as panicked
/// with the interval as its cooldown (§2.3).
///
/// Mutation check: making `Panics::finish` return without re-raising releases
/// the tick as completed; the cooldown assertion then fails.
#[tokio::test]
async fn a_tick_whose_second_step_panics_runs_the_third_and_is_released_as_panicked() {
    scheduler::install_panic_hook();
    let t = TestDb::new().await;
    let (m, handle, _) = manager(&t.db);
    let ran = Arc::new(Mutex::new(Vec::new()));
    let r = ran.clone();
    let out = scheduler::catch(
        "test".into(),
        m.lead(
            Role::Billing,
            Duration::from_secs(120),
            &CancellationToken::new(),
            |_tick| async move {
                let mut panics = Panics::new("billing");
                panics
                    .step("trials", async { r.lock().unwrap().push("trials") })
                    .await;
                panics
                    .step("resumes", async { panic!("nil subscription plan") })
                    .await;
                panics
                    .step("due_billing", async {
                        r.lock().unwrap().push("due_billing")
                    })
                    .await;
                panics.finish();
                TickEnd::Drained
            },
        ),
    )
    .await;
    assert!(out.is_err(), "the panic reaches the loop");
    assert_eq!(*ran.lock().unwrap(), vec!["trials", "due_billing"]);
    let (completed, cooldown) = lease_state(&t.db, Role::Billing).await;
    assert!(!completed);
    let cooldown = cooldown.expect("released as panicked");
    assert!((110.0..=120.0).contains(&cooldown), "{cooldown}");
    assert_eq!(
        series(
            &handle,
            "hardcount_leader_lease_lost_total{role=\"billing\",reason=\"panicked\"} "
        ),
        Some(1.0)
    );
}

/// A batch with one panicking item processes all the others, and the
/// lease-lost counter moves by exactly one.
#[tokio::test]
async fn a_batch_with_one_panicking_item_processes_all_the_others() {
    scheduler::install_panic_hook();
    let t = TestDb::new().await;
    let (m, handle, telemetry) = manager(&t.db);
    scheduler::precreate_series(&telemetry);
    let key = "hardcount_leader_lease_lost_total{role=\"dunning\",reason=\"panicked\"} ";
    assert_eq!(series(&handle, key), Some(0.0));
    // Every reason an alert counts with increase(): a series born at 1 shows
    // no increase, so the first event after a start raised nothing. Mutation
    // `precreate_panicked_only` fails it.
    for reason in ["heartbeat_failed", "superseded", "heartbeat_timeout"] {
        let other =
            format!("hardcount_leader_lease_lost_total{{role=\"dunning\",reason=\"{reason}\"}} ");
        assert_eq!(series(&handle, &other), Some(0.0), "{reason}");
    }
    // The status reads' errors too, which HardcountStatusReadErrors takes a
    // rate of. Mutation `precreate_status_errors`.
    assert_eq!(
        series(&handle, "hardcount_leader_status_errors_total "),
        Some(0.0)
    );
    // And each role's failed backlog reads, which HardcountBacklogUnread
    // takes an increase of (docs/adr/0137). Mutation
    // `precreate_backlog_read_errors`.
    assert_eq!(
        series(
            &handle,
            "hardcount_backlog_read_errors_total{role=\"dunning\"} "
        ),
        Some(0.0)
    );

    let done = Arc::new(AtomicUsize::new(0));
    let d = done.clone();
    let out = scheduler::catch(
        "test".into(),
        m.lead(
            Role::Dunning,
            Duration::from_secs(60),
            &CancellationToken::new(),
            |_tick| async move {
                let mut panics = Panics::new("dunning");
                let runs: Vec<u32> = (1..=20).collect();
                panics
                    .drain(
                        runs,
                        |run| format!("run {run}"),
                        |run| {
                            let d = d.clone();
                            async move {
                                assert_ne!(run, 7, "run 7 has no policy");
                                d.fetch_add(1, Ordering::SeqCst);
                            }
                        },
                    )
                    .await;
                panics.finish();
                TickEnd::Drained
            },
        ),
    )
    .await;
    assert!(out.is_err());
    assert_eq!(done.load(Ordering::SeqCst), 19);
    assert_eq!(series(&handle, key), Some(1.0));
}

/// A role whose every tick panics keeps its loop alive, and another role's
/// loop on the same replica ticks on untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_one_role_leaves_the_other_roles_ticking() {
    scheduler::install_panic_hook();
    let t = TestDb::new().await;
    let (m, handle, _) = manager(&t.db);
    let shutdown = CancellationToken::new();
    let panicking = Arc::new(AtomicUsize::new(0));
    let healthy = Arc::new(AtomicUsize::new(0));
    let p = panicking.clone();
    let h = healthy.clone();
    let specs = [
        RoleSpec {
            role: Role::EmailOutbox,
            interval: Duration::from_millis(100),
            work: work(move |_| {
                let p = p.clone();
                async move {
                    p.fetch_add(1, Ordering::SeqCst);
                    panic!("bad email row");
                }
            }),
        },
        RoleSpec {
            role: Role::WebhookOutbox,
            interval: Duration::from_millis(100),
            work: work(move |_| {
                let h = h.clone();
                async move {
                    h.fetch_add(1, Ordering::SeqCst);
                    TickEnd::Drained
                }
            }),
        },
    ];
    let mut ticks = m.ticks();
    let started = Instant::now();
    let loops: Vec<_> = specs
        .into_iter()
        .map(|s| tokio::spawn(run_role(m.clone(), s, shutdown.child_token())))
        .collect();
    until_ticks(
        &mut ticks,
        Duration::from_secs(20),
        "two panicked ticks and ten healthy ones",
        |l| l.role(Role::EmailOutbox).panicked >= 2 && l.role(Role::WebhookOutbox).completed >= 10,
    )
    .await;
    let took = started.elapsed();
    shutdown.cancel();
    for l in loops {
        l.await.expect("a role loop died");
    }
    let (p, h) = (
        panicking.load(Ordering::SeqCst),
        healthy.load(Ordering::SeqCst),
    );
    println!("panicking role ticked {p} times, healthy role {h} times in {took:?}");
    assert!(
        p >= 2,
        "the panicking role's loop kept polling after its first panic ({p})"
    );
    assert!(h >= 10, "the healthy role kept ticking ({h})");
    assert_eq!(
        series(
            &handle,
            "hardcount_leader_lease_lost_total{role=\"webhook_outbox\",reason=\"panicked\"} "
        ),
        None
    );
    assert_eq!(
        series(
            &handle,
            "hardcount_leader_lease_lost_total{role=\"email_outbox\",reason=\"panicked\"} "
        ),
        Some(p as f64)
    );
}

/// A loop that is not due sleeps until the row's due time, not a fixed poll:
/// with a 2 s interval and a 200 ms max poll, it polls about every 200 ms,
/// and ticks about every 2 s (timed between the first two ticks' ends, as
/// the manager announces them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_loop_ticks_once_per_interval() {
    let t = TestDb::new().await;
    let (m, _, _) = manager(&t.db);
    let shutdown = CancellationToken::new();
    let ticks = Arc::new(AtomicUsize::new(0));
    let c = ticks.clone();
    let spec = RoleSpec {
        role: Role::WebhookDelivery,
        interval: Duration::from_secs(2),
        work: work(move |_| {
            let c = c.clone();
            async move {
                c.fetch_add(1, Ordering::SeqCst);
                TickEnd::Drained
            }
        }),
    };
    let mut announced = m.ticks();
    let l = tokio::spawn(run_role(m.clone(), spec, shutdown.child_token()));
    let role = Role::WebhookDelivery;
    let limit = Duration::from_secs(10);
    let first = until_ticks(&mut announced, limit, "the first tick", |l| {
        l.role(role).completed >= 1
    })
    .await;
    let first_at = Instant::now();
    let second = until_ticks(&mut announced, limit, "the second tick", |l| {
        l.role(role).completed >= 2
    })
    .await;
    let between = first_at.elapsed();
    shutdown.cancel();
    l.await.unwrap();
    let n = ticks.load(Ordering::SeqCst);
    let polls = second.role(role).not_led - first.role(role).not_led;
    println!("second tick {between:?} after the first, {polls} refused polls between");
    assert_eq!(n, 2, "{n} ticks for two announced");
    assert!(
        between >= Duration::from_millis(1900) && between < Duration::from_secs(3),
        "{between:?} between ticks at a 2 s interval"
    );
    assert!(
        (5..=20).contains(&polls),
        "{polls} polls in one 2 s interval at a 200 ms max poll"
    );
    let out = m
        .lead(
            Role::WebhookDelivery,
            Duration::from_secs(2),
            &CancellationToken::new(),
            |_| async { TickEnd::Drained },
        )
        .await
        .unwrap();
    assert!(matches!(
        out,
        TickOutcome::NotLed { .. } | TickOutcome::Completed
    ));
}

/// The claim a failing tick makes: `webhook_events` under a row lock the test
/// holds, read with a 200 ms server timeout.
async fn claim_under_timeout(db: &Db) -> Result<(), db::Error> {
    let mut tx = db.begin_with_timeout(Duration::from_millis(200)).await?;
    tx.fetch_all(sql(
        "SELECT id FROM webhook_events WHERE dispatched_at IS NULL FOR UPDATE",
    ))
    .await?;
    tx.commit().await
}

/// docs/adr/0007: a tick whose claim fails (here the claim's table is locked
/// past its statement timeout) is not stamped completed and retries after the
/// failure cooldown (`min(interval, 30 s)`), not after the hourly interval.
/// The cooldown is read from the row and seen to hold the loop off (a poll is
/// refused); then the test moves `not_before` into the past instead of
/// waiting 30 s, and the next poll retries and does the work.
///
/// Mutation check: releasing `TickEnd::Failed` as completed stamps the tick
/// (`failed_as_completed`), and a cooldown of the whole interval
/// (`failed_cooldown`) fails the cooldown's bounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_hourly_tick_is_not_a_completion_and_retries_within_a_minute() {
    let t = TestDb::new().await;
    let (m, handle, _) = manager(&t.db);
    // Lock the claim's table from the owner's side for the first tick.
    let mut owner = t.superuser().await;
    sqlx::raw_sql("BEGIN; LOCK TABLE webhook_events IN ACCESS EXCLUSIVE MODE")
        .execute(&mut owner)
        .await
        .unwrap();
    let ends = Arc::new(Mutex::new(Vec::new()));
    let (e, db) = (ends.clone(), t.db.clone());
    let spec = RoleSpec {
        role: Role::Billing,
        interval: Duration::from_secs(3600),
        work: work(move |_| {
            let (e, db) = (e.clone(), db.clone());
            async move {
                let end = match claim_under_timeout(&db).await {
                    Ok(()) => TickEnd::Drained,
                    Err(err) => TickEnd::Failed(err.to_string()),
                };
                e.lock().unwrap().push(end.clone());
                end
            }
        }),
    };
    let shutdown = CancellationToken::new();
    let mut ticks = m.ticks();
    let l = tokio::spawn(run_role(m.clone(), spec, shutdown.child_token()));
    let limit = Duration::from_secs(10);

    // The first tick fails: not stamped, a cooldown of about 30 s, and the
    // loop's next poll is refused.
    let failed = until_ticks(&mut ticks, limit, "the first tick's end", |l| {
        l.role(Role::Billing).led() >= 1
    })
    .await;
    assert_eq!(failed.role(Role::Billing).failed, 1, "{failed:?}");
    assert!(matches!(ends.lock().unwrap()[0], TickEnd::Failed(_)));
    let (completed, cooldown) = lease_state(&t.db, Role::Billing).await;
    assert!(!completed, "a failed tick is not stamped completed");
    let cooldown = cooldown.expect("released with the failure cooldown");
    assert!((25.0..=30.0).contains(&cooldown), "cooldown {cooldown}");
    let refused = until_ticks(&mut ticks, limit, "a poll inside the cooldown", |l| {
        l.role(Role::Billing).not_led >= 1
    })
    .await;
    assert_eq!(refused.role(Role::Billing).led(), 1, "{refused:?}");
    sqlx::raw_sql("ROLLBACK").execute(&mut owner).await.unwrap();

    // The cooldown passes (moved into the past on the database clock): the
    // retry does the work.
    sqlx::raw_sql(
        "UPDATE leader_leases SET not_before = now() - interval '1 second' WHERE role = 'billing'",
    )
    .execute(&mut owner)
    .await
    .unwrap();
    until_ticks(&mut ticks, limit, "the retry", |l| {
        l.role(Role::Billing).led() >= 2
    })
    .await;
    shutdown.cancel();
    l.await.unwrap();
    assert_eq!(ends.lock().unwrap()[1], TickEnd::Drained);
    let (completed, _) = lease_state(&t.db, Role::Billing).await;
    assert!(completed, "the retry completed the tick");
    assert_eq!(
        series(
            &handle,
            "hardcount_tick_total{role=\"billing\",end=\"failed\"} "
        ),
        Some(1.0)
    );
    assert_eq!(
        series(
            &handle,
            "hardcount_tick_total{role=\"billing\",end=\"drained\"} "
        ),
        Some(1.0)
    );
}

/// docs/adr/0007: a backlog larger than one tick's budget drains in
/// consecutive ticks with no interval wait between them (the interval here is
/// an hour), and only the tick that drained it is stamped completed.
///
/// Mutation check: releasing `TickEnd::MoreWork` as completed stamps the first
/// tick, the role waits an hour, and the backlog stays at 7. The test waits
/// for the loop's first refused poll, the sign that no tick is due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_larger_than_one_budget_drains_in_consecutive_ticks() {
    let t = TestDb::new().await;
    let (m, handle, _) = manager(&t.db);
    let backlog = Arc::new(AtomicUsize::new(10));
    let b = backlog.clone();
    let spec = RoleSpec {
        role: Role::Dunning,
        interval: Duration::from_secs(3600),
        work: work(move |_| {
            let b = b.clone();
            async move {
                // A budget of three items per tick.
                let left = b.load(Ordering::SeqCst).saturating_sub(3);
                b.store(left, Ordering::SeqCst);
                if left > 0 {
                    TickEnd::MoreWork
                } else {
                    TickEnd::Drained
                }
            }
        }),
    };
    let shutdown = CancellationToken::new();
    let mut ticks = m.ticks();
    let started = Instant::now();
    let l = tokio::spawn(run_role(m.clone(), spec, shutdown.child_token()));
    until_ticks(&mut ticks, Duration::from_secs(10), "a refused poll", |l| {
        l.role(Role::Dunning).not_led >= 1
    })
    .await;
    let drained_after = started.elapsed();
    shutdown.cancel();
    l.await.unwrap();
    println!("backlog of 4 budgets drained after {drained_after:?}");
    assert_eq!(
        backlog.load(Ordering::SeqCst),
        0,
        "the backlog drained in consecutive ticks"
    );
    assert!(drained_after < Duration::from_secs(5), "{drained_after:?}");
    assert_eq!(
        series(
            &handle,
            "hardcount_tick_total{role=\"dunning\",end=\"more_work\"} "
        ),
        Some(3.0)
    );
    assert_eq!(
        series(
            &handle,
            "hardcount_tick_total{role=\"dunning\",end=\"drained\"} "
        ),
        Some(1.0),
        "no tick after the drained one: it waits the hour"
    );
    let (completed, cooldown) = lease_state(&t.db, Role::Dunning).await;
    assert!(completed && cooldown.is_none());
}
