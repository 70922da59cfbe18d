//! The claim and the outcome statement reach their rows through keys and
//! ordered indexes on a table whose statistics know nothing of its backlog
//! (docs/adr/0023): work per batch, not per pending row.
//!
//! The tables here are never analyzed, as in the first minutes of a fresh
//! database or after a burst the statistics have not caught up with. The plans
//! are read with EXPLAIN inside the same kind of transaction the role uses
//! (`testbed::plans::explain_index_driven`), on the role's own statement texts.

use db::{Row, sql};
use testbed::TestDb;
use testbed::plans::{
    INDEX_DRIVEN_SETTINGS, PlansNoticed, assert_planned_with, explain_index_driven,
};
use webhook_delivery::statements::{
    APPLY_OUTCOMES, CLAIM_DUE, INSERT_OUTCOMES, INSERT_OUTCOMES_TOLERANT,
};

use crate::{config, endpoint, events, tick, worker};

/// 1,500 pending deliveries: 500 events to 3 endpoints, fanned out as the
/// outbox does, so each fan-out's deliveries share one `next_attempt_at`.
async fn backlog(t: &TestDb) -> Vec<i64> {
    for i in 0..3 {
        endpoint(t, "tenant_a", &format!("http://127.0.0.1:9/{i}")).await;
    }
    events(&t.db, "tenant_a", 500).await;
    let ids: Vec<i64> =
        t.db.fetch_all(sql(
            "SELECT id FROM webhook_deliveries WHERE status = 'pending' ORDER BY id",
        ))
        .await
        .unwrap()
        .iter()
        .map(|r| r.get("id"))
        .collect();
    assert_eq!(ids.len(), 1500);
    ids
}

/// Guards: the due index's key `(next_attempt_at, id)` (migration 0017; led by
/// `tenant_id` since migration 0036, docs/adr/0048) and the
/// planner settings of `begin_index_driven`. Seen failing with the index on
/// `next_attempt_at` alone (an Incremental Sort over the whole fan-out) and
/// with `begin_with_timeout` in the EXPLAIN's transaction (a Bitmap Heap Scan
/// and a Sort of every pending row).
#[tokio::test]
async fn a_claim_reads_its_batch_in_index_order_and_sorts_nothing() {
    let t = TestDb::new().await;
    backlog(&t).await;
    let plan = explain_index_driven(&t.db, CLAIM_DUE, |s| {
        s.bind("webhook_delivery")
            .bind(1_i64)
            .bind(100_i64)
            .bind(30.0_f64)
            .bind(8_i32)
            .bind("")
            .bind(64_i64)
    })
    .await;
    assert!(
        plan.contains("Index Scan using webhook_deliveries_due on webhook_deliveries"),
        "{plan}"
    );
    for absent in ["Sort", "Bitmap", "Seq Scan on webhook_deliveries", "Hash"] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}

/// Guards: the compare-and-set's expected status bound per row (`was`), not
/// written as a literal, and the planner settings of `begin_index_driven`. Seen
/// failing with `d.status = 'pending'` in the statement (the pending rows
/// scanned through `webhook_deliveries_due` on the outer side of the join) and
/// with `begin_with_timeout` in the EXPLAIN's transaction (a Hash Join over a
/// Bitmap Heap Scan of every pending row).
#[tokio::test]
async fn a_group_of_outcomes_finds_each_delivery_by_its_key() {
    let t = TestDb::new().await;
    let ids = backlog(&t).await;
    let group: Vec<i64> = ids.iter().copied().step_by(6).take(200).collect();
    let n = group.len();
    let plan = explain_index_driven(&t.db, APPLY_OUTCOMES, move |s| {
        s.bind(group)
            .bind(vec![1_i32; n])
            .bind(vec!["delivered".to_owned(); n])
            .bind(vec![0.0_f64; n])
            .bind(vec![Some(204_i32); n])
            .bind(vec![None::<String>; n])
            .bind(vec![Some(3_i32); n])
            .bind(vec!["pending".to_owned(); n])
            .bind(vec![None::<String>; n])
    })
    .await;
    assert!(
        plan.contains("Index Scan using webhook_deliveries_pkey on webhook_deliveries d"),
        "{plan}"
    );
    // Each endpoint of the group is reached by its key for its
    // failing_since (migration 0031); the group's endpoints are gathered by
    // a hash aggregate over the group's own rows, which is bounded by it.
    assert!(
        plan.contains("Index Scan using webhook_endpoints_pkey on webhook_endpoints e"),
        "{plan}"
    );
    for absent in [
        "webhook_deliveries_due",
        "Bitmap",
        "Hash Join",
        "Materialize",
        "Seq Scan on webhook_deliveries",
        "Seq Scan on webhook_endpoints",
    ] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}

/// The rows of deliveries handed over unwritten (docs/adr/0124) are inserted
/// without reading `webhook_deliveries` (the tolerant form only through its
/// unique key, its conflict check), and each endpoint of the group is reached by its key for
/// its `failing_since`, on tables never analyzed.
///
/// Mutation check: the endpoints matched by an expression instead of their
/// key (`e.id + 0`) are read whole and this test fails (scripts/mutation-check
/// `insert_outcomes_endpoint_by_key`).
#[tokio::test]
async fn a_group_of_unwritten_deliveries_reads_each_endpoint_by_its_key() {
    let t = TestDb::new().await;
    backlog(&t).await;
    let pairs: Vec<(i64, i64)> =
        t.db.fetch_all(sql(
            "SELECT event_id, endpoint_id FROM webhook_deliveries ORDER BY id LIMIT 200",
        ))
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get("event_id"), r.get("endpoint_id")))
        .collect();
    let n = pairs.len();
    for (statement, tolerant) in [(INSERT_OUTCOMES, false), (INSERT_OUTCOMES_TOLERANT, true)] {
        let pairs = pairs.clone();
        let plan = explain_index_driven(&t.db, statement, move |s| {
            s.bind(vec!["tenant_a".to_owned(); n])
                .bind(pairs.iter().map(|p| p.0).collect::<Vec<i64>>())
                .bind(pairs.iter().map(|p| p.1).collect::<Vec<i64>>())
                .bind(vec![1_i32; n])
                .bind(vec!["pending".to_owned(); n])
                .bind(vec![30.0_f64; n])
                .bind(vec![Some(500_i32); n])
                .bind(vec![Some("http_5xx".to_owned()); n])
                .bind(vec![Some(3_i32); n])
                .bind(vec![None::<String>; n])
                .bind(vec![0.01_f64; n])
        })
        .await;
        assert!(
            plan.contains("Index Scan using webhook_endpoints_pkey on webhook_endpoints e"),
            "{plan}"
        );
        // The plain insert checks no conflict before its rows: its unique key
        // refuses a pair already written (docs/adr/0126).
        assert_eq!(
            plan.contains("Conflict Arbiter Indexes: webhook_deliveries_event_endpoint_key"),
            tolerant,
            "{plan}"
        );
        for absent in [
            "Seq Scan on webhook_deliveries",
            "Seq Scan on webhook_endpoints",
            "Bitmap",
            "Hash Join",
        ] {
            assert!(!plan.contains(absent), "{absent} in\n{plan}");
        }
    }
}

/// Guards: the prune's index `webhook_deliveries_finished (next_attempt_at,
/// id)` (migration 0030) and its ORDER BY matching it. Seen failing with the
/// index keyed on `id` alone instead. The attempt rows are reached by their
/// primary key.
#[tokio::test]
async fn a_prune_reads_its_batch_in_index_order_and_sorts_nothing() {
    let t = TestDb::new().await;
    backlog(&t).await;
    let plan = explain_index_driven(&t.db, webhook_delivery::statements::PRUNE_FINISHED, |s| {
        s.bind("webhook_delivery")
            .bind(1_i64)
            .bind(86_400.0_f64)
            .bind(1000_i64)
    })
    .await;
    assert!(
        plan.contains("Index Scan using webhook_deliveries_finished on webhook_deliveries"),
        "{plan}"
    );
    for absent in ["Sort", "Bitmap", "Seq Scan", "Hash"] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}

/// Guard: the plans above are read under `begin_index_driven`'s settings,
/// which the EXPLAIN applies itself; here a tick's own claim and outcomes
/// (three deliveries to an endpoint that refuses connections), as
/// `auto_explain` reported them, ran under those settings. Seen failing with
/// a plain `begin_with_timeout` in the claim (`store::claim`) or in
/// `store::outcomes::record_outcomes` (mutations `delivery_claim_index_driven`
/// and `delivery_outcomes_index_driven` in scripts/mutation-check).
#[tokio::test]
async fn a_ticks_own_claim_and_outcomes_plan_as_these_tests_do() {
    let t = TestDb::with_plans_noticed().await;
    endpoint(&t, "tenant_a", "http://127.0.0.1:9/refused").await;
    events(&t.db, "tenant_a", 3).await;
    let (w, _) = worker(&t.db, config());
    let noticed = PlansNoticed::start();
    let report = tick(&t.db, &w).await;
    for statement in [CLAIM_DUE, APPLY_OUTCOMES] {
        let plans = noticed.plans_of(statement);
        assert!(
            !plans.is_empty(),
            "no plan of {statement:?} in a tick: {report:?}"
        );
        assert_planned_with(&plans, &INDEX_DRIVEN_SETTINGS);
    }
}

/// How many sequential scans of `webhook_events` the bed's Postgres has
/// counted so far, after `su`'s own pending counts are flushed.
async fn event_seq_scans(su: &mut sqlx::PgConnection) -> i64 {
    // Forces the flush when this session next goes idle: after this
    // statement, before the next.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut *su)
        .await
        .unwrap();
    sqlx::query_scalar("SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'webhook_events'")
        .fetch_one(&mut *su)
        .await
        .unwrap()
}

/// Guard: the tenant check of inserted deliveries, whose plan a session
/// keeps from its first insert (migration 0054), still reaches each event by
/// its key when the session planned it on a table analyzed while it held
/// one event (as autovacuum may analyze a new database's). One connection
/// inserts that event's deliveries; 20,000 events later, the same connection
/// inserts 500 deliveries, and Postgres counts no sequential scan of
/// `webhook_events` for that insert.
///
/// Mutation check: the check's function without its planner settings keeps
/// the plan made for one event (seen: a nested loop over a sequential scan
/// of the events), scans the 20,001 events for the 500 deliveries, and this
/// test fails (scripts/mutation-check `tenant_check_plan_kept`).
#[tokio::test]
async fn the_tenant_check_keeps_a_plan_that_reads_events_by_key() {
    let t = TestDb::new().await;
    for i in 0..5 {
        endpoint(&t, "tenant_a", &format!("http://127.0.0.1:9/{i}")).await;
    }
    let mut su = t.superuser().await;
    // No analyze but this test's own: one by autovacuum after the 20,000
    // events would drop the kept plan and let a mutant pass.
    testbed::plans::keep_tables_unanalyzed(&mut su)
        .await
        .unwrap();
    // Each in a transaction of its own: the plan made in the analyze's
    // transaction would be dropped at its commit.
    for step in [
        "INSERT INTO webhook_events (tenant_id, event_type, payload) \
         VALUES ('tenant_a', 'invoice.paid', '{}')",
        "ANALYZE webhook_events",
        "INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id) \
         SELECT 'tenant_a', e.id, ep.id FROM webhook_events e, webhook_endpoints ep",
    ] {
        sqlx::raw_sql(step).execute(&mut su).await.unwrap();
    }
    t.db.execute(sql(
        "INSERT INTO webhook_events (tenant_id, event_type, payload) \
         SELECT 'tenant_a', 'invoice.paid', '{}' FROM generate_series(1, 20000)",
    ))
    .await
    .unwrap();
    let (events, endpoints): (Vec<i64>, Vec<i64>) = sqlx::query_as(
        "SELECT array_agg(e.id), array_agg(ep.id) \
         FROM (SELECT id FROM webhook_events ORDER BY id DESC LIMIT 100) e, webhook_endpoints ep",
    )
    .fetch_one(&mut su)
    .await
    .unwrap();
    let before = event_seq_scans(&mut su).await;
    let inserted = sqlx::query(
        "INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id) \
         SELECT 'tenant_a', e, ep FROM unnest($1::int8[], $2::int8[]) AS p(e, ep)",
    )
    .bind(&events)
    .bind(&endpoints)
    .execute(&mut su)
    .await
    .unwrap();
    assert_eq!(inserted.rows_affected(), 500);
    let after = event_seq_scans(&mut su).await;
    assert_eq!(after, before, "the check scanned webhook_events");
}
