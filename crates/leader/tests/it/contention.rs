//! Many managers, five roles, short ticks: never two leaders of one role at once.

use std::time::Duration;

use db::{Row, sql};
use leader::{Role, TickEnd, TickOutcome};
use testbed::TestDb;
use tokio_util::sync::CancellationToken;

use crate::manager;

/// The design's timing proportions (docs/design.md §2.4) at 3/10 scale (TTL
/// 3 s). With ten replicas x five roles polling through PgBouncer's four server
/// connections on two cores, a 1 s TTL loses leases to queueing alone; what is
/// tested here is mutual exclusion, not that.
fn timing() -> leader::Timing {
    let ms = Duration::from_millis;
    leader::Timing::new(ms(3000), ms(900), ms(600), ms(1800), ms(500)).unwrap()
}

/// Run `replicas` managers against all five roles until each has led each
/// role `ticks_each` times (as the managers announce; `limit` bounds the
/// wait), each tick recording its start and end on the database clock. Then,
/// per role, no two ticks overlap and every replica led some.
///
/// Mutation check: dropping `AND (expires_at IS NULL OR expires_at <= now())`
/// from ACQUIRE lets a second replica win a held role; this test then fails on
/// overlapping ticks.
async fn contend(replicas: usize, ticks_each: u64, limit: Duration) {
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "CREATE TABLE ticks (id bigserial PRIMARY KEY, role text, holder text, token bigint, \
                             started timestamptz NOT NULL, ended timestamptz); \
         GRANT SELECT, INSERT, UPDATE ON ticks TO hardcount_app; \
         GRANT USAGE ON SEQUENCE ticks_id_seq TO hardcount_app",
    )
    .execute(&mut su)
    .await
    .unwrap();

    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    let mut announced = Vec::new();
    for r in 0..replicas {
        // Each replica has its own pool, as separate processes would.
        let db = db::Db::connect_lazy(&t.app_url(testbed::Leg::current()), 6).unwrap();
        let (m, _) = manager(&db, timing(), &format!("replica{r}"));
        announced.push(m.ticks());
        for role in Role::ALL {
            let m = m.clone();
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                while !stop.is_cancelled() {
                    let db = m.db().clone();
                    let holder = m.holder_id().to_owned();
                    let outcome = m
                        .lead(role, Duration::ZERO, &stop, |tick| async move {
                            let row = db
                                .fetch_one(
                                    sql("INSERT INTO ticks (role, holder, token, started) \
                                         VALUES ($1, $2, $3, clock_timestamp()) RETURNING id")
                                    .bind(role.as_str())
                                    .bind(holder)
                                    .bind(tick.fence.token()),
                                )
                                .await
                                .unwrap();
                            let id: i64 = row.get("id");
                            tokio::time::sleep(Duration::from_millis(rand::random_range(5..30)))
                                .await;
                            db.execute(
                                sql("UPDATE ticks SET ended = clock_timestamp() WHERE id = $1")
                                    .bind(id),
                            )
                            .await
                            .unwrap();
                            TickEnd::Drained
                        })
                        .await
                        .unwrap();
                    // Spread wins: a replica that just led waits a little before polling again.
                    let pause = match outcome {
                        TickOutcome::NotLed { retry_in, .. } => {
                            retry_in.min(Duration::from_millis(50))
                        }
                        _ => Duration::from_millis(rand::random_range(10..40)),
                    };
                    tokio::time::sleep(pause).await;
                }
            }));
        }
    }
    // Until every replica has led every role `ticks_each` times, or `limit`
    // has passed: the assertions below judge what ran either way.
    let started = std::time::Instant::now();
    for ticks in &mut announced {
        let left = limit.saturating_sub(started.elapsed());
        let _ = tokio::time::timeout(
            left,
            ticks.wait_for(|l| Role::ALL.iter().all(|r| l.role(*r).completed >= ticks_each)),
        )
        .await;
    }
    println!(
        "{replicas} replicas contended for {:?} (until each led each role {ticks_each} times)",
        started.elapsed()
    );
    stop.cancel();
    for task in tasks {
        task.await.unwrap();
    }

    // A tick whose lease was lost (a slow RENEW on this loaded machine) was
    // dropped before it could record its end; it stopped acting no later than
    // abandon_after + cancel_grace after it started, so that is its end here.
    let t_ = timing();
    let dropped_after_ms = (t_.abandon_after + t_.cancel_grace).as_secs_f64() * 1000.0;
    let row = t
        .db
        .fetch_one(
            sql("WITH ended AS ( \
                   SELECT id, role, tstzrange(started, coalesce(ended, started + make_interval(secs => $1 / 1000.0))) AS span \
                   FROM ticks) \
                 SELECT (SELECT count(*) FROM ended a JOIN ended b \
                           ON a.role = b.role AND a.id < b.id AND a.span && b.span) AS overlaps, \
                        (SELECT count(*) FROM ticks WHERE ended IS NULL) AS dropped")
            .bind(dropped_after_ms),
        )
        .await
        .unwrap();
    let overlaps: i64 = row.get("overlaps");
    let dropped: i64 = row.get("dropped");
    println!("{replicas} replicas: {dropped} ticks lost their lease and were dropped");
    let per_role = t
        .db
        .fetch_all(sql(
            "SELECT role, count(*) AS ticks, count(DISTINCT holder) AS holders, count(DISTINCT token) AS tokens \
             FROM ticks GROUP BY role ORDER BY role",
        ))
        .await
        .unwrap();
    for r in &per_role {
        println!(
            "{replicas} replicas, {}: {} ticks by {} replicas",
            r.get::<String, _>("role"),
            r.get::<i64, _>("ticks"),
            r.get::<i64, _>("holders")
        );
    }
    assert_eq!(overlaps, 0, "two ticks of one role overlapped");
    assert_eq!(per_role.len(), 5, "every role ticked");
    for r in &per_role {
        assert_eq!(
            r.get::<i64, _>("ticks"),
            r.get::<i64, _>("tokens"),
            "each tick had its own token"
        );
        assert_eq!(
            r.get::<i64, _>("holders"),
            replicas as i64,
            "every replica led some ticks"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_managers_never_lead_one_role_at_once() {
    contend(2, 20, Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_managers_never_lead_one_role_at_once() {
    contend(10, 3, Duration::from_secs(30)).await;
}
