//! The retention prune of dispatched events (docs/adr/0040): an old event
//! goes once none of its deliveries remain; a young one, or one with a
//! delivery left, stays. Fenced, bounded, and read in index order.

use std::time::Duration;

use db::NO_SEQUENTIAL_SCAN;
use db::{Db, Row, sql};
use leader::{Fence, Role};
use metrics_exporter_prometheus::PrometheusHandle;
use scheduler::Retention;
use testbed::TestDb;
use testbed::plans::{
    INDEX_DRIVEN_SETTINGS, PlansNoticed, assert_planned_with, explain_index_driven_after,
};
use webhook_outbox::statements::{PRUNE_DISPATCHED, PruneCursor, PrunedEvents, pruned_events};
use webhook_outbox::{Dispatcher, DispatcherConfig, NewEvent, enqueue_many};

use crate::{as_leader, dispatcher, endpoint, event, manager};

const MONTH: Duration = Duration::from_secs(30 * 86_400);

async fn owner(t: &TestDb, statement: String) {
    let mut su = t.superuser().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
        .execute(&mut su)
        .await
        .unwrap();
}

async fn event_ids(db: &Db) -> Vec<i64> {
    db.fetch_all(sql("SELECT id FROM webhook_events ORDER BY id"))
        .await
        .unwrap()
        .iter()
        .map(|r| r.get("id"))
        .collect()
}

async fn prune_from(db: &Db, fence: &Fence, limit: i64, from: PruneCursor) -> PrunedEvents {
    let mut tx = db.begin_index_driven(Duration::from_secs(5)).await.unwrap();
    tx.fetch_all(sql(NO_SEQUENTIAL_SCAN)).await.unwrap();
    let row = tx
        .fetch_one(
            sql(PRUNE_DISPATCHED)
                .bind(fence.role_name())
                .bind(fence.token())
                .bind(MONTH.as_secs_f64())
                .bind(limit)
                .bind(from.at)
                .bind(from.id),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    pruned_events(&row).unwrap()
}

async fn prune_with(db: &Db, fence: &Fence, limit: i64) -> u64 {
    prune_from(db, fence, limit, PruneCursor::default())
        .await
        .deleted
}

/// One tick of a dispatcher without retention, led by `holder`: every event
/// fanned out. Returns the tick's fence.
async fn fan_out(t: &TestDb, holder: &str) -> Fence {
    let (plain, _) = dispatcher(&t.db, DispatcherConfig::default());
    as_leader(
        &manager(&t.db, holder),
        Role::WebhookOutbox,
        |tick| async move {
            plain.run_tick(&tick).await;
            tick.fence
        },
    )
    .await
}

/// A dispatcher that prunes at every tick, `batch` events a statement, with
/// its metrics.
fn pruning(t: &TestDb, budget: Duration, batch: usize) -> (Dispatcher, PrometheusHandle) {
    let (d, metrics) = dispatcher(
        &t.db,
        DispatcherConfig {
            tick_budget: budget,
            ..DispatcherConfig::default()
        },
    );
    let d = d.with_retention(Retention {
        keep: MONTH,
        lease_history: MONTH,
        every: Duration::ZERO,
        batch,
    });
    (d, metrics)
}

/// Whether `metrics` counts `n` pruned events.
fn counts_pruned(metrics: &PrometheusHandle, n: u64) -> bool {
    let line = format!("hardcount_retention_pruned_total{{kind=\"webhook_events\"}} {n}");
    metrics.render().lines().any(|l| l == line)
}

/// Every dispatched event stamped 40 days ago.
async fn age_dispatched(t: &TestDb) {
    owner(
        t,
        "UPDATE webhook_events SET dispatched_at = now() - interval '40 days'".to_owned(),
    )
    .await;
}

/// Five events fanned out: e0..e3 to tenant_a's endpoint, e4 to nobody
/// (tenant_b has none). The deliveries of e0 and e1 are gone (pruned); e0,
/// e1, e2 and e4 were dispatched 40 days ago, e3 today, and e5 is not
/// dispatched at all. The prune takes e0, e1 and e4; e2 keeps its delivery.
#[tokio::test]
async fn an_old_dispatched_event_goes_once_its_deliveries_are_gone() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", &[], true).await;
    let mut e = Vec::new();
    for i in 0..4 {
        e.push(
            event(
                &t.db,
                "tenant_a",
                "invoice.paid",
                &format!(r#"{{"n": {i}}}"#),
            )
            .await,
        );
    }
    e.push(event(&t.db, "tenant_b", "invoice.paid", "{}").await);
    fan_out(&t, "d").await;
    e.push(event(&t.db, "tenant_a", "invoice.paid", "{}").await);
    owner(
        &t,
        format!(
            "DELETE FROM webhook_deliveries WHERE event_id IN ({}, {}); \
             UPDATE webhook_events SET dispatched_at = now() - interval '40 days' \
             WHERE id IN ({}, {}, {}, {}); \
             UPDATE webhook_events SET created_at = now() - interval '40 days' WHERE id = {}",
            e[0], e[1], e[0], e[1], e[2], e[4], e[5]
        ),
    )
    .await;

    let (d, metrics) = pruning(&t, Duration::from_millis(500), 1000);
    // The tick dispatches e5 (young now), then prunes.
    as_leader(
        &manager(&t.db, "d"),
        Role::WebhookOutbox,
        |tick| async move { d.run_tick(&tick).await },
    )
    .await;
    assert_eq!(event_ids(&t.db).await, vec![e[2], e[3], e[5]]);
    assert!(counts_pruned(&metrics, 3), "{}", metrics.render());
}

/// Mutation check: removing `AND leader_fence($1, $2)` from PRUNE_DISPATCHED
/// (`store.rs`) makes the old token delete the three; this test was run
/// against that mutation and failed, then the predicate was restored. The
/// batch bound: a limit of 2 deletes two of the three.
#[tokio::test]
async fn a_stale_token_prunes_no_event_and_a_batch_is_bounded() {
    let t = TestDb::new().await;
    for _ in 0..3 {
        event(&t.db, "tenant_b", "invoice.paid", "{}").await;
    }
    let old = fan_out(&t, "old").await;
    age_dispatched(&t).await;
    let db = &t.db;
    let (by_old, by_new) = as_leader(
        &manager(&t.db, "new"),
        Role::WebhookOutbox,
        |tick| async move {
            assert!(tick.fence.token() > old.token());
            (
                prune_with(db, &old, 100).await,
                prune_with(db, &tick.fence, 2).await,
            )
        },
    )
    .await;
    assert_eq!((by_old, by_new), (0, 2));
    assert_eq!(event_ids(&t.db).await.len(), 1);
}

/// Guard: `webhook_events_dispatched (dispatched_at, id)` (migration 0030).
/// Seen failing with the index keyed on `id` alone instead. The cursor is a
/// bound of the index scan, not a filter after it (docs/adr/0108), and
/// without `NO_SEQUENTIAL_SCAN` the table is read whole and sorted (seen).
/// The delivery check is an index probe per event. 20,000 events: on a table
/// of a few hundred, a sort of all of them is the cheaper plan and is chosen.
#[tokio::test]
async fn a_prune_reads_its_events_in_index_order() {
    let t = TestDb::new().await;
    let events: Vec<NewEvent<'_>> = (0..20_000)
        .map(|_| ("tenant_b", "invoice.paid", "{}"))
        .collect();
    let mut tx = t.db.begin().await.unwrap();
    enqueue_many(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let plan = explain_index_driven_after(&t.db, Some(NO_SEQUENTIAL_SCAN), PRUNE_DISPATCHED, |s| {
        s.bind("webhook_outbox")
            .bind(1_i64)
            .bind(86_400.0_f64)
            .bind(1000_i64)
            .bind(PruneCursor::default().at)
            .bind(0_i64)
    })
    .await;
    assert!(
        plan.contains("Scan using webhook_events_dispatched on webhook_events"),
        "{plan}"
    );
    let bound = plan
        .lines()
        .find(|l| l.contains("ROW(dispatched_at, id) > ROW("))
        .unwrap_or_default();
    assert!(bound.contains("Index Cond:"), "{plan}");
    for absent in ["Sort", "Bitmap", "Seq Scan", "Hash"] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}

/// An event kept back by its deliveries is read once a pass, not by every
/// statement (docs/adr/0108): a statement reads at most its limit from the
/// cursor on, deleting what it may, and the round goes on while statements
/// read full batches. Four old events of `tenant_a` keep their deliveries and
/// come first in stamp order; three of `tenant_b` have none. With batches of
/// two, the first statement reads two kept-back events and deletes nothing,
/// and the round still reaches and deletes the three.
///
/// Mutation checks: the round stopping on a statement that deleted less than
/// its limit (`prune_round_on_deleted`, `scheduler/src/retention.rs`), the
/// cursor not moved on (`prune_cursor_stays`, `tick.rs`) and the statement
/// without its cursor predicate (`prune_cursor_ignored`) each leave the
/// three events; each was seen failing this test. The role's own statements
/// run index-driven without sequential scans, as the plan test below
/// applies them itself (mutation `prune_events_seqscan`).
#[tokio::test]
async fn a_prune_reads_past_events_kept_back_once_a_pass() {
    let t = TestDb::with_plans_noticed().await;
    endpoint(&t, "tenant_a", &[], true).await;
    let mut kept = Vec::new();
    for _ in 0..4 {
        kept.push(event(&t.db, "tenant_a", "invoice.paid", "{}").await);
    }
    let mut free = Vec::new();
    for _ in 0..3 {
        free.push(event(&t.db, "tenant_b", "invoice.paid", "{}").await);
    }
    fan_out(&t, "d").await;
    age_dispatched(&t).await;

    let db = &t.db;
    let (first, second) = as_leader(
        &manager(&t.db, "d"),
        Role::WebhookOutbox,
        |tick| async move {
            let first = prune_from(db, &tick.fence, 2, PruneCursor::default()).await;
            let second = prune_from(db, &tick.fence, 2, first.last.unwrap()).await;
            (first, second)
        },
    )
    .await;
    assert_eq!((first.read, first.deleted), (2, 0), "{first:?}");
    assert_eq!(first.last.map(|c| c.id), Some(kept[1]), "{first:?}");
    assert_eq!((second.read, second.deleted), (2, 0), "{second:?}");
    assert_eq!(second.last.map(|c| c.id), Some(kept[3]), "{second:?}");
    assert_eq!(event_ids(&t.db).await.len(), 7);

    let (d, metrics) = pruning(&t, Duration::from_secs(2), 2);
    let plans = PlansNoticed::start();
    for _ in 0..2 {
        let d = d.clone();
        as_leader(
            &manager(&t.db, "d"),
            Role::WebhookOutbox,
            |tick| async move { d.run_tick(&tick).await },
        )
        .await;
    }
    assert_eq!(event_ids(&t.db).await, kept);
    assert_planned_with(
        &plans.plans_of(PRUNE_DISPATCHED),
        &[&INDEX_DRIVEN_SETTINGS[..], &["enable_seqscan = 'off'"]].concat(),
    );
    assert!(counts_pruned(&metrics, 3), "{}", metrics.render());
}

/// A handoff whose lease ended with its pair unwritten holds the event prune
/// while its recovery fails (here a trigger refuses to delete the handoff):
/// its event, dispatched 40 days ago with no delivery row yet, is kept. Once
/// the recovery runs, the pair is written pending and the event keeps its
/// delivery. Before, the prune deleted the event (no delivery of it
/// remained) and the recovery then skipped the pair as gone: a delivery lost
/// with no line and no count (docs/adr/0144).
///
/// Mutation check: the prune not held (`prune_ignores_handoffs`) deletes the
/// event in the first tick, and this test fails.
#[tokio::test]
async fn an_expired_handoff_holds_the_event_prune_until_it_is_recovered() {
    let t = TestDb::new().await;
    let endpoint_id = endpoint(&t, "tenant_a", &[], true).await;
    let e = event(&t.db, "tenant_a", "invoice.paid", "{}").await;
    owner(
        &t,
        format!(
            "UPDATE webhook_events SET dispatched_at = now() - interval '40 days' WHERE id = {e}; \
             INSERT INTO webhook_handoffs (until, tenant_ids, event_ids, endpoint_ids) \
             VALUES (now() - interval '1 second', ARRAY['tenant_a'], ARRAY[{e}::int8], \
                     ARRAY[{endpoint_id}::int8]); \
             CREATE FUNCTION keep_handoffs() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN RAISE EXCEPTION 'refused for the test'; END $$; \
             CREATE TRIGGER keep_handoffs BEFORE DELETE ON webhook_handoffs \
               FOR EACH ROW EXECUTE FUNCTION keep_handoffs()"
        ),
    )
    .await;
    let tick = |t: &TestDb| {
        let (d, _) = pruning(t, Duration::from_millis(300), 1000);
        let m = manager(&t.db, "d");
        async move {
            as_leader(&m, Role::WebhookOutbox, |tick| async move {
                d.run_tick(&tick).await
            })
            .await
        }
    };
    tick(&t).await;
    assert_eq!(event_ids(&t.db).await, vec![e], "the prune was held");
    owner(
        &t,
        "DROP TRIGGER keep_handoffs ON webhook_handoffs".to_owned(),
    )
    .await;
    tick(&t).await;
    assert_eq!(event_ids(&t.db).await, vec![e], "kept by its delivery");
    let written: i64 =
        t.db.fetch_one(sql(
            "SELECT count(*) FROM webhook_deliveries WHERE attempts = 1",
        ))
        .await
        .unwrap()
        .get(0);
    assert_eq!(written, 1, "the pair was recovered");
}
