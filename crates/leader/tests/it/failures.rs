//! A killed leader, a frozen leader, and a renewal blocked by a row lock.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use db::{Db, Row, sql};
use leader::{Fence, LostReason, Role, TickEnd, TickOutcome, Timing};
use testbed::proxy::{FaultProxy, Mode};
use testbed::{Leg, TestDb};
use tokio_util::sync::CancellationToken;

use crate::{claim_jobs, fast, lease, make_jobs, manager, series};

/// Poll like a role loop until `role` is won; returns the fence and the wait.
async fn acquire_when_due(m: &leader::Manager, role: Role) -> (Fence, Duration) {
    let started = Instant::now();
    let shutdown = CancellationToken::new();
    loop {
        let won = Arc::new(Mutex::new(None));
        let w = won.clone();
        let out = m
            .lead(role, Duration::ZERO, &shutdown, |tick| async move {
                *w.lock().unwrap() = Some(tick.fence);
                TickEnd::Drained
            })
            .await
            .unwrap();
        if let Some(fence) = won.lock().unwrap().take() {
            return (fence, started.elapsed());
        }
        match out {
            TickOutcome::NotLed { retry_in, .. } => tokio::time::sleep(retry_in).await,
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// A leader that dies without releasing (its runtime dropped mid-tick: no
/// heartbeat, no RELEASE) is replaced within TTL + max poll, and its token's
/// fence is false afterwards: a claim with it returns nothing.
///
/// Mutation check: dropping `AND holder_token = p_token` from `leader_fence`
/// makes the old token's claim take rows; this test then fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_is_replaced_within_ttl_and_its_token_claims_nothing() {
    let t = TestDb::new().await;
    make_jobs(&t, 30).await;
    let timing = fast();
    let url = t.app_url(Leg::current());
    let (tx, rx) = std::sync::mpsc::channel::<Fence>();
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let doomed = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let db = Db::connect_lazy(&url, 2).unwrap();
            let (m, _) = manager(&db, timing, "doomed");
            tokio::spawn(async move {
                let shutdown = CancellationToken::new();
                let _ = m
                    .lead(
                        Role::WebhookOutbox,
                        Duration::ZERO,
                        &shutdown,
                        |tick| async move {
                            tx.send(tick.fence).unwrap();
                            started_tx.send(()).unwrap();
                            std::future::pending::<TickEnd>().await
                        },
                    )
                    .await;
            });
            // The tick runs under its lease: kill it now.
            started_rx.await.unwrap();
        });
        // Dropping the runtime kills every task without running RELEASE.
        rt.shutdown_background();
    });
    let old = rx.recv().unwrap();
    doomed.join().unwrap();
    let killed_at = Instant::now();
    assert!(
        lease(&t.db, Role::WebhookOutbox)
            .await
            .holder_id
            .unwrap()
            .starts_with("doomed")
    );

    let (b, _) = manager(&t.db, timing, "survivor");
    let (new, waited) = acquire_when_due(&b, Role::WebhookOutbox).await;
    let since_kill = killed_at.elapsed();
    println!(
        "takeover after a killed leader: {since_kill:?} after the kill (TTL {:?}, max poll {:?})",
        timing.ttl, timing.max_poll
    );
    assert!(
        since_kill <= timing.ttl + timing.max_poll + Duration::from_millis(300),
        "{since_kill:?}"
    );
    assert!(waited > Duration::ZERO);
    assert!(new.token() > old.token());

    // Hold the role under the new token and try the old one's claim.
    let shutdown = CancellationToken::new();
    let db = t.db.clone();
    let claimed_by_old = Arc::new(Mutex::new(None));
    let c = claimed_by_old.clone();
    let out = b
        .lead(
            Role::WebhookOutbox,
            Duration::ZERO,
            &shutdown,
            |tick| async move {
                *c.lock().unwrap() = Some((
                    claim_jobs(&db, &old).await,
                    claim_jobs(&db, &tick.fence).await,
                ));
                TickEnd::Drained
            },
        )
        .await
        .unwrap();
    assert_eq!(out, TickOutcome::Completed);
    let (stale, current) = claimed_by_old.lock().unwrap().unwrap();
    assert_eq!(stale, 0, "the superseded token claimed rows");
    assert_eq!(current, 10, "the current token claims");
}

/// A frozen leader (its whole runtime blocked past the TTL, like a GC pause or
/// SIGSTOP) resumes to find its fence false: its claim returns nothing, and it
/// learns it lost the lease.
///
/// Mutation check: removing `AND leader_fence($1, $2)` from the claim in
/// `claim_jobs` lets the frozen leader claim rows after the takeover; this
/// test then fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_leader_resumes_to_a_false_fence_and_claims_nothing() {
    let t = TestDb::new().await;
    make_jobs(&t, 30).await;
    let timing = fast();
    let url = t.app_url(Leg::current());
    let (froze_tx, froze_rx) = std::sync::mpsc::channel::<()>();
    let (resume_tx, resume_rx) = std::sync::mpsc::channel::<()>();
    let (claimed_tx, claimed_rx) = tokio::sync::oneshot::channel::<()>();
    let frozen = std::thread::spawn(move || {
        // One thread: blocking it freezes the work and the heartbeat together.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let db = Db::connect_lazy(&url, 2).unwrap();
            let (m, _) = manager(&db, timing, "frozen");
            let shutdown = CancellationToken::new();
            let claimed = Arc::new(Mutex::new(None));
            let c = claimed.clone();
            let out = m
                .lead(
                    Role::Dunning,
                    Duration::ZERO,
                    &shutdown,
                    |tick| async move {
                        froze_tx.send(()).unwrap();
                        resume_rx.recv().unwrap(); // frozen here, blocking the runtime
                        *c.lock().unwrap() = Some(claim_jobs(&db, &tick.fence).await);
                        claimed_tx.send(()).unwrap();
                        TickEnd::Drained
                    },
                )
                .await
                .unwrap();
            (out, *claimed.lock().unwrap())
        })
    });
    froze_rx.recv().unwrap();
    // While it is frozen, another replica takes over once the lease expires.
    let (b, _) = manager(&t.db, timing, "successor");
    let shutdown = CancellationToken::new();
    let (fence, _) = acquire_when_due(&b, Role::Dunning).await;
    let _ = fence;
    // Hold it under the successor while the frozen one resumes.
    let db = t.db.clone();
    let out = b
        .lead(
            Role::Dunning,
            Duration::ZERO,
            &shutdown,
            |_tick| async move {
                resume_tx.send(()).unwrap();
                // Held until the resumed leader's claim has run.
                claimed_rx.await.unwrap();
                let _ = db;
                TickEnd::Drained
            },
        )
        .await
        .unwrap();
    assert_eq!(out, TickOutcome::Completed);
    let (frozen_out, frozen_claimed) = frozen.join().unwrap();
    assert_eq!(
        frozen_claimed,
        Some(0),
        "the frozen leader claimed rows after its lease passed"
    );
    // It may see its work finish before its heartbeat notices the abandon;
    // either way RELEASE matched no row of its term.
    println!("frozen leader's tick ended as {frozen_out:?}");
    assert!(
        lease(&t.db, Role::Dunning).await.completed,
        "the successor's tick completed"
    );
    let unclaimed =
        t.db.fetch_one(sql(
            "SELECT count(*) AS n FROM jobs WHERE claimed_by IS NULL",
        ))
        .await
        .unwrap();
    assert_eq!(unclaimed.get::<i64, _>("n"), 30);
}

/// A RENEW blocked by a row lock that another session holds is cancelled by the
/// server at the statement timeout (no statement left running), counted as a
/// missed beat, and the work is cancelled at `abandon_after`, before the TTL.
/// Uses the design's own timings (`Timing::ADR`, docs/design.md §2.4).
///
/// Mutation checks: dropping the `statement_timeout` `SET LOCAL` from RENEW
/// leaves the blocked UPDATE running on the server (the pg_stat_activity
/// assertion fails); releasing a lost tick with no cooldown fails the
/// cooldown assertion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_blocked_by_a_row_lock_is_abandoned_and_the_work_cancelled_before_ttl() {
    let t = TestDb::new().await;
    let timing = Timing::ADR;
    let (m, metrics) = manager(&t.db, timing, "blocked");
    let shutdown = CancellationToken::new();
    let superuser_url = t.superuser_url();
    let cancelled_after = Arc::new(Mutex::new(None));
    let c = cancelled_after.clone();
    let lingering = Arc::new(Mutex::new(None));
    let l = lingering.clone();
    let out = m
        .lead(
            Role::Billing,
            Duration::from_secs(120),
            &shutdown,
            |tick| async move {
                let acquired = Instant::now();
                use sqlx::Connection;
                let mut locker = sqlx::postgres::PgConnection::connect(&superuser_url)
                    .await
                    .unwrap();
                sqlx::raw_sql(
                    "BEGIN; SELECT 1 FROM leader_leases WHERE role = 'billing' FOR UPDATE",
                )
                .execute(&mut locker)
                .await
                .unwrap();
                // The first RENEW (at 3 s) blocks and the server cancels it at
                // 5 s; no retry fits before the abandon at 6 s, which cancels us.
                tick.cancel.cancelled().await;
                *c.lock().unwrap() = Some(acquired.elapsed());
                let running: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' \
                 AND query LIKE 'WITH renewed AS (%UPDATE leader_leases SET expires_at%'",
                )
                .fetch_one(&mut locker)
                .await
                .unwrap();
                *l.lock().unwrap() = Some(running);
                sqlx::raw_sql("ROLLBACK")
                    .execute(&mut locker)
                    .await
                    .unwrap();
                TickEnd::Drained
            },
        )
        .await
        .unwrap();
    assert_eq!(out, TickOutcome::Lost(LostReason::HeartbeatTimeout));
    assert_eq!(
        lingering.lock().unwrap().unwrap(),
        0,
        "a renewal kept running on the server"
    );
    let after = cancelled_after.lock().unwrap().unwrap();
    println!(
        "blocked renewal: work cancelled {after:?} after acquire (abandon {:?}, TTL {:?})",
        timing.abandon_after, timing.ttl
    );
    assert!(
        // The abandon clock starts when ACQUIRE is sent, a little before the work.
        after >= timing.abandon_after - Duration::from_millis(200) && after < timing.ttl,
        "{after:?}"
    );
    assert!(
        series(
            &metrics,
            "hardcount_leader_heartbeat_missed_total",
            "role=\"billing\""
        )
        .unwrap()
            >= 1.0
    );
    assert_eq!(
        series(
            &metrics,
            "hardcount_leader_lease_lost_total",
            "role=\"billing\",reason=\"heartbeat_timeout\""
        ),
        Some(1.0)
    );
    // Released as lost (the row lock is gone by then): a cooldown of
    // min(interval, 60 s), no completion stamp.
    let l = lease(&t.db, Role::Billing).await;
    assert!(!l.completed && l.holder_id.is_none());
    let cooldown = l.cooldown.expect("a lost tick cools down");
    assert!((50.0..=60.0).contains(&cooldown), "cooldown {cooldown}");
}

/// ACQUIRE over a link that went silent (a black-holed connection: no reset,
/// no reply, so the server's `statement_timeout` cannot answer either) gives
/// up after `Timing::acquire_bound` (1.7 s at the fast timings), as RENEW and
/// RELEASE give up on theirs, and the role loop polls again instead of
/// waiting on it for ever (and ignoring a shutdown meanwhile).
/// Mutation: `acquire_client_timeout` (the client's wait removed) leaves the
/// poll waiting until this test's own limit; seen failing here.
#[tokio::test]
async fn an_acquire_over_a_silent_link_gives_up() {
    let t = TestDb::new().await;
    let (proxy, url) = FaultProxy::in_front_of(&t).await;
    let db = Db::connect_lazy(&url, 1).unwrap();
    let (m, _) = manager(&db, fast(), "silent");
    // The pool's one connection, opened over the working link.
    assert_eq!(
        crate::drained(&m, Role::Billing, Duration::ZERO).await,
        TickOutcome::Completed
    );
    proxy.set(Mode::Blackhole);
    let started = Instant::now();
    let shutdown = CancellationToken::new();
    let poll = m.lead(Role::Billing, Duration::ZERO, &shutdown, |_| async {
        TickEnd::Drained
    });
    let out = tokio::time::timeout(Duration::from_secs(10), poll)
        .await
        .expect("ACQUIRE still waiting on a silent link after 10 s");
    assert!(
        matches!(
            out,
            Err(leader::store::StoreError::NoAnswer {
                statement: "ACQUIRE",
                ..
            })
        ),
        "{out:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}
