//! The retention prune (docs/adr/0040): finished deliveries and their
//! attempt rows deleted once old, a bounded batch per fenced statement; young
//! and pending deliveries kept.

use std::time::Duration;

use db::{Db, Row, sql};
use leader::{Fence, Role};
use scheduler::Retention;
use testbed::TestDb;
use testbed::receiver::Receiver;
use webhook_delivery::WorkerConfig;
use webhook_delivery::statements::PRUNE_FINISHED;

use crate::{as_leader, config, endpoint, events, manager, series, tick, worker};

const MONTH: Duration = Duration::from_secs(30 * 86_400);

/// Prune on every tick, `batch` rows a statement.
fn pruning(batch: usize) -> WorkerConfig {
    WorkerConfig {
        retention: Some(Retention {
            keep: MONTH,
            lease_history: MONTH,
            every: Duration::ZERO,
            batch,
        }),
        ..config()
    }
}

/// `n` deliveries delivered by a tick of a worker that does not prune.
async fn delivered(t: &TestDb, n: usize) -> Vec<i64> {
    let rx = Receiver::answering(200).await;
    endpoint(t, "tenant_a", &rx.url()).await;
    events(&t.db, "tenant_a", n).await;
    let (w, _) = worker(&t.db, config());
    let report = tick(&t.db, &w).await;
    assert_eq!(report.delivered, n, "{report:?}");
    ids(&t.db).await
}

async fn ids(db: &Db) -> Vec<i64> {
    db.fetch_all(sql("SELECT id FROM webhook_deliveries ORDER BY id"))
        .await
        .unwrap()
        .iter()
        .map(|r| r.get("id"))
        .collect()
}

async fn owner(t: &TestDb, statement: &str) {
    let mut su = t.superuser().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_owned()))
        .execute(&mut su)
        .await
        .unwrap();
}

/// Age the deliveries `ids` by `days` (their last attempt came due then).
async fn age(t: &TestDb, ids: &[i64], days: u32) {
    let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    owner(
        t,
        &format!(
            "UPDATE webhook_deliveries SET next_attempt_at = now() - interval '{days} days' \
             WHERE id IN ({list})"
        ),
    )
    .await;
}

async fn prune_with(db: &Db, fence: &Fence, limit: i64) -> u64 {
    let mut tx = db.begin_index_driven(Duration::from_secs(5)).await.unwrap();
    let n = tx
        .execute(
            sql(PRUNE_FINISHED)
                .bind(fence.role_name())
                .bind(fence.token())
                .bind(MONTH.as_secs_f64())
                .bind(limit),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    n
}

/// Old delivered and dead deliveries go with their attempt rows; a young
/// dead one keeps its attempts, and an old pending one (held by a claim) is
/// never touched. Each deleted delivery is counted by kind.
#[tokio::test]
async fn a_tick_prunes_old_finished_deliveries_with_their_attempts_and_keeps_the_rest() {
    let t = TestDb::new().await;
    let d = delivered(&t, 6).await;
    // d[0], d[1]: old delivered; d[2]: old dead; d[3]: young dead;
    // d[4]: old pending under a live claim; d[5]: young delivered.
    age(&t, &d[0..3], 40).await;
    age(&t, &d[4..5], 40).await;
    owner(
        &t,
        &format!(
            "UPDATE webhook_deliveries SET status = 'dead', delivered_at = NULL \
             WHERE id IN ({}, {}); \
             UPDATE webhook_deliveries SET status = 'pending', delivered_at = NULL, \
                    claimed_until = now() + interval '1 hour' WHERE id = {}; \
             INSERT INTO webhook_delivery_attempts (tenant_id, delivery_id, attempt) \
             VALUES ('tenant_a', {}, 1), ('tenant_a', {}, 2), ('tenant_a', {}, 1)",
            d[2], d[3], d[4], d[2], d[2], d[3]
        ),
    )
    .await;
    let (w, metrics) = worker(&t.db, pruning(1000));
    tick(&t.db, &w).await;
    assert_eq!(ids(&t.db).await, vec![d[3], d[4], d[5]]);
    let attempts: Vec<i64> =
        t.db.fetch_all(sql(
            "SELECT delivery_id FROM webhook_delivery_attempts ORDER BY delivery_id",
        ))
        .await
        .unwrap()
        .iter()
        .map(|r| r.get("delivery_id"))
        .collect();
    assert_eq!(attempts, vec![d[3]]);
    assert_eq!(
        series(
            &metrics,
            "hardcount_retention_pruned_total",
            "kind=\"webhook_deliveries\""
        ),
        Some(3.0)
    );
}

/// A delivery that dies in a tick is kept for the whole retention from its
/// death, however long it waited before: one refused with 410 and one past
/// the attempt ceiling, both due since 40 days (a role down, a backlog),
/// under a month's retention, are dead and still there after the tick that
/// killed them and pruned. Before, a finishing write left `next_attempt_at`
/// as it was, so that tick's prune deleted both seconds after they died,
/// before a resend or a recover could reach them (docs/adr/0100). Mutation
/// `dead_pruned_at_death` (the outcome's stamp and the ceiling's removed)
/// fails it; seen failing.
#[tokio::test]
async fn a_delivery_that_dies_after_a_long_wait_is_kept_for_the_retention() {
    let t = TestDb::new().await;
    let gone = Receiver::answering(410).await;
    let fine = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &gone.url()).await;
    endpoint(&t, "tenant_a", &fine.url()).await;
    events(&t.db, "tenant_a", 1).await;
    let d = ids(&t.db).await;
    age(&t, &d, 40).await;
    owner(
        &t,
        &format!(
            "UPDATE webhook_deliveries SET attempts = 1000 WHERE id = {}",
            d[1]
        ),
    )
    .await;
    let (w, _) = worker(&t.db, pruning(1000));
    tick(&t.db, &w).await;
    let left: Vec<(i64, String)> =
        t.db.fetch_all(sql("SELECT id, status FROM webhook_deliveries ORDER BY id"))
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get("id"), r.get("status")))
            .collect();
    assert_eq!(
        left,
        [(d[0], "dead".to_owned()), (d[1], "dead".to_owned())],
        "{left:?}"
    );
    assert_eq!(fine.count(), 0, "the exhausted one was not sent");
}

/// A leader replaced by a takeover deletes nothing with its old token; the
/// new leader's prune in the same moment deletes the old rows.
///
/// Mutation check: removing `AND leader_fence($1, $2)` from PRUNE_FINISHED
/// (`store/prune.rs`) makes the old token delete all four; this test was run
/// against that mutation and failed, then the predicate was restored.
#[tokio::test]
async fn a_stale_token_prunes_nothing_after_a_takeover() {
    let t = TestDb::new().await;
    let d = delivered(&t, 4).await;
    age(&t, &d, 40).await;
    let old = as_leader(
        &manager(&t.db, "old"),
        Role::WebhookDelivery,
        |tick| async move { tick.fence },
    )
    .await;
    let db = &t.db;
    let (by_old, by_new) = as_leader(
        &manager(&t.db, "new"),
        Role::WebhookDelivery,
        |tick| async move {
            assert!(tick.fence.token() > old.token());
            let by_old = prune_with(db, &old, 100).await;
            let by_new = prune_with(db, &tick.fence, 100).await;
            (by_old, by_new)
        },
    )
    .await;
    assert_eq!((by_old, by_new), (0, 4));
    assert!(ids(&t.db).await.is_empty());
}

/// One statement deletes at most its limit; a tick runs statements until one
/// comes back short, so 25 old rows in batches of 10 go in three.
#[tokio::test]
async fn each_prune_statement_deletes_at_most_its_batch() {
    let t = TestDb::new().await;
    let d = delivered(&t, 25).await;
    age(&t, &d, 40).await;
    let db = &t.db;
    let first = as_leader(
        &manager(&t.db, "w"),
        Role::WebhookDelivery,
        |tick| async move { prune_with(db, &tick.fence, 10).await },
    )
    .await;
    assert_eq!(first, 10);
    // The oldest due first: equal ages, so the lowest ids.
    assert_eq!(ids(&t.db).await, d[10..].to_vec());
    let (w, metrics) = worker(&t.db, pruning(10));
    tick(&t.db, &w).await;
    assert!(ids(&t.db).await.is_empty());
    assert_eq!(
        series(
            &metrics,
            "hardcount_retention_pruned_total",
            "kind=\"webhook_deliveries\""
        ),
        Some(15.0)
    );
}
