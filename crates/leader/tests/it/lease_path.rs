//! Leases survive a saturated app pool (issue 27, point 2; docs/adr/0036).
//!
//! Through PgBouncer a server pool belongs to a (database, user): the lease
//! statements on DATABASE_URL queue behind the job statements for the same
//! few server connections, and no statement timeout bounds that wait (the
//! statement has not reached the server). Their own alias
//! (`HARDCOUNT_LEASE_DATABASE_URL`, `<db>_leases` in the bed) has its own
//! server pool, which job statements cannot fill.
//!
//! Directly there is no server pool to share (each client connection is a
//! backend), so these tests check something only on the pgbouncer leg.

use std::time::{Duration, Instant};

use db::Db;
use leader::store::{self, Renew};
use leader::{Role, TickEnd, TickOutcome, Timing};
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use testbed::bouncer::{self, BOUNCER_POOL};
use testbed::{Leg, TestDb};
use tokio_util::sync::CancellationToken;

use crate::manager;

/// How long each app statement holds its server connection: past the
/// abandon deadline (6 s), inside the TTL (10 s) plus the statement timeout.
const HOLD: Duration = Duration::from_secs(8);

/// What one tick on `lease_db` saw while [`BOUNCER_POOL`] app transactions
/// each ran `pg_sleep` for [`HOLD`] on every server connection PgBouncer has
/// for the app's (database, user).
struct Saturated {
    outcome: TickOutcome,
    /// A RENEW sent once the pool was full: its answer, or None if none came
    /// within the statement timeout.
    renew: Option<Renew>,
    renew_took: Duration,
}

async fn tick_beside_a_saturated_app_pool(t: &TestDb, lease_db: &Db) -> Saturated {
    let timing = Timing::ADR;
    let (m, _) = manager(lease_db, timing, "saturated");
    let shutdown = CancellationToken::new();
    let app_url = t.app_url(Leg::PgBouncer);
    let su_url = t.superuser_url();
    let name = t.name().to_owned();
    let lease_db = lease_db.clone();
    let mut probe = None;
    let outcome = m
        .lead(Role::Billing, Duration::ZERO, &shutdown, |tick| {
            let probe = &mut probe;
            async move {
                let sleepers: Vec<_> = (0..BOUNCER_POOL)
                    .map(|_| {
                        let url = app_url.clone();
                        tokio::spawn(async move {
                            let mut c = PgConnection::connect(&url).await.unwrap();
                            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                                "BEGIN; SELECT pg_sleep({}); COMMIT",
                                HOLD.as_secs_f64()
                            )))
                            .execute(&mut c)
                            .await
                            .unwrap();
                        })
                    })
                    .collect();
                wait_for_sleepers(&su_url, &name).await;
                let sent = Instant::now();
                let renew = tokio::time::timeout(
                    timing.statement_timeout,
                    store::renew(
                        &lease_db,
                        Role::Billing,
                        tick.fence.token(),
                        timing.ttl,
                        timing.statement_timeout,
                    ),
                )
                .await
                .ok()
                .map(|r| r.unwrap());
                *probe = Some((renew, sent.elapsed()));
                let all_done = async {
                    for s in sleepers {
                        s.await.unwrap();
                    }
                };
                tokio::select! {
                    _ = tick.cancel.cancelled() => TickEnd::Failed("lease lost".into()),
                    _ = all_done => TickEnd::Drained,
                }
            }
        })
        .await
        .unwrap();
    let (renew, renew_took) = probe.expect("the tick ran");
    Saturated {
        outcome,
        renew,
        renew_took,
    }
}

/// Until every server connection of the app's pool on this database runs a
/// `pg_sleep` (as the server sees it); 10 s is a safety bound, not the pace.
async fn wait_for_sleepers(su_url: &str, database: &str) {
    let mut su = PgConnection::connect(su_url).await.unwrap();
    let started = Instant::now();
    loop {
        let sleeping: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE usename = 'hardcount_app' AND datname = $1 \
               AND state = 'active' AND query LIKE '%pg_sleep%'",
        )
        .bind(database)
        .fetch_one(&mut su)
        .await
        .unwrap();
        if sleeping >= BOUNCER_POOL as i64 {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{sleeping} of {BOUNCER_POOL} app statements sleeping"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The lease path's own pool: while every app server connection runs an
/// 8 s statement, a RENEW lands within its statement timeout, the
/// heartbeat keeps the lease past the abandon deadline (6 s), and the tick
/// is released as completed, its term renewed in the history.
///
/// Catches: a lease alias that shares the app's server pool (a `<db>_leases`
/// without its own pool, or `HARDCOUNT_LEASE_DATABASE_URL` ignored by the
/// serve process): the tick is then lost as below. Checked by hand (`lease_path_own_pool` in scripts/mutation-check) by
/// pointing `lease_db` at `t.db`: this test then fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renew_on_the_lease_path_lands_while_the_app_pool_is_saturated() {
    if Leg::current() == Leg::Direct {
        return;
    }
    let t = TestDb::new().await;
    let lease_db = Db::connect_lazy(&bouncer::lease_path(&t).await, 2).unwrap();
    let seen = tick_beside_a_saturated_app_pool(&t, &lease_db).await;
    let timing = Timing::ADR;
    assert!(
        matches!(seen.renew, Some(Renew::Extended { .. })),
        "no RENEW within {:?} (took {:?})",
        timing.statement_timeout,
        seen.renew_took
    );
    assert!(seen.renew_took < timing.statement_timeout);
    assert_eq!(seen.outcome, TickOutcome::Completed);
    let term = &store::history(&t.operator(), Some(Role::Billing), 1)
        .await
        .unwrap()[0];
    assert_eq!(term.tick_end.as_deref(), Some("completed"), "{term:?}");
    assert!(term.last_renewed_at.is_some(), "{term:?}");
}

/// The control: the same tick with the lease statements on DATABASE_URL's
/// path. Their BEGIN waits in PgBouncer's queue behind the app's
/// statements, where no statement timeout reaches it: no RENEW answers
/// within the statement timeout, and the heartbeat gives the lease up at
/// the abandon deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renew_on_the_shared_path_starves_while_the_app_pool_is_saturated() {
    if Leg::current() == Leg::Direct {
        return;
    }
    let t = TestDb::new().await;
    let seen = tick_beside_a_saturated_app_pool(&t, &t.db).await;
    assert_eq!(seen.renew, None, "a RENEW landed in {:?}", seen.renew_took);
    assert!(
        matches!(seen.outcome, TickOutcome::Lost(_)),
        "{:?}",
        seen.outcome
    );
}
