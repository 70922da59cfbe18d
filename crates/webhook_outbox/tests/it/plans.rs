//! The fan-out's claim reads its batch of events in index order on a table
//! whose statistics know nothing of its backlog (docs/adr/0023): work per
//! batch, not per undispatched event. The table is never analyzed, as in a
//! fresh database or after a burst; the plan is read with EXPLAIN inside the
//! kind of transaction the role uses, on the role's own statement text.

use leader::Role;
use testbed::TestDb;
use testbed::plans::{
    INDEX_DRIVEN_SETTINGS, PlansNoticed, assert_planned_with, explain_index_driven,
};
use webhook_outbox::statements::{BACKLOG, CLAIM_AND_FAN_OUT};
use webhook_outbox::{DispatcherConfig, NewEvent, enqueue_many};

use crate::{as_leader, dispatcher, endpoint, event, manager};

/// Guard: the planner settings of `Db::begin_index_driven`. Seen failing with
/// `begin_with_timeout` in the EXPLAIN's transaction (a Bitmap Heap Scan of
/// every undispatched event and a Sort of them all by id, to claim 100).
/// The fan-out statement's plan for a batch of 100 events, with an offer from
/// the delivery role's `token` (room 4,000) or none, as the outbox binds it.
async fn explain_fan_out(t: &TestDb, token: Option<i64>) -> String {
    explain_index_driven(&t.db, CLAIM_AND_FAN_OUT, move |s| {
        s.bind("webhook_outbox")
            .bind(1_i64)
            .bind(100_i64)
            .bind("hardcount_wake_webhook_delivery")
            .bind(10_000_i64)
            .bind("")
            .bind(64_i64)
            .bind(token)
            .bind(if token.is_some() { 30.0_f64 } else { 0.0 })
            .bind(if token.is_some() { 4_000_i64 } else { 0 })
            .bind(if token.is_some() { 1_000_000_i64 } else { 0 })
    })
    .await
}

/// Also: each endpoint of a handed pair is read by its key, once
/// (docs/adr/0127). Mutation `handed_endpoint_by_key` (the join key written
/// so that the primary key does not match) reads the endpoints whole for
/// each part instead: seen failing here.
#[tokio::test]
async fn the_fan_out_claims_its_events_in_index_order() {
    let t = TestDb::new().await;
    for _ in 0..3 {
        endpoint(&t, "tenant_a", &[], true).await;
    }
    a_thousand_events(&t).await;

    let plan = explain_fan_out(&t, None).await;
    assert!(
        plan.contains("Index Scan using webhook_events_undispatched on webhook_events"),
        "{plan}"
    );
    // Each handed endpoint's columns are read once, by key (docs/adr/0127).
    let endpoint = "Index Scan using webhook_endpoints_pkey on webhook_endpoints ep ";
    assert!(plan.contains(endpoint), "{endpoint} not in\n{plan}");
    for absent in [
        "Bitmap",
        "Sort Key: webhook_events.id",
        "Seq Scan on webhook_events",
    ] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}

/// Guard: the plan above is read under `begin_index_driven`'s settings, which
/// the EXPLAIN applies itself; here the role's own fan-out of three events,
/// as `auto_explain` reported it, ran under those settings. Seen failing
/// with a plain `begin_with_timeout` in `store` (mutation
/// `fan_out_index_driven` in scripts/mutation-check).
#[tokio::test]
async fn the_roles_own_fan_out_plans_as_this_test_does() {
    let t = TestDb::with_plans_noticed().await;
    endpoint(&t, "tenant_a", &[], true).await;
    for n in 0..3 {
        event(
            &t.db,
            "tenant_a",
            "invoice.paid",
            &format!(r#"{{"n": {n}}}"#),
        )
        .await;
    }
    let (d, _) = dispatcher(&t.db, DispatcherConfig::default());
    let noticed = PlansNoticed::start();
    let dispatched = as_leader(
        &manager(&t.db, "plans"),
        Role::WebhookOutbox,
        |tick| async move { d.dispatch_batch(&tick.fence, 100).await.unwrap() },
    )
    .await;
    assert_eq!(dispatched, 3);
    assert_planned_with(
        &[noticed.plan_of(CLAIM_AND_FAN_OUT)],
        &INDEX_DRIVEN_SETTINGS,
    );
}

/// Guard (docs/adr/0061): on statistics that have seen a backlog, the
/// fan-out reaches each tenant's undispatched events through
/// `webhook_events_undispatched` `(tenant_id, id)`, both its first share
/// (`e`) and its fill (`e_1`), not by walking the primary key and filtering by
/// tenant, which reads every later event of the other tenants, dispatched or
/// not, to find a small tenant's few. 100,000 events of a big tenant, half of
/// them dispatched, and 5 of a small tenant after them, analyzed. Seen failing
/// with the tenant matched by equality and the events ordered by `id`
/// (mutation `fan_out_tenant_range`): the fill walked `webhook_events_pkey`
/// from the last event taken; the `auto_explain` audit of the webhook and
/// tenants benchmarks saw both steps do so after autovacuum's analyze.
#[tokio::test]
async fn the_fan_out_reaches_each_tenants_events_by_tenant_after_an_analyze() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_big", &[], true).await;
    endpoint(&t, "tenant_small", &[], true).await;
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "INSERT INTO webhook_events (tenant_id, event_type, payload, dispatched_at) \
         SELECT 'tenant_big', 'invoice.paid', '{}', CASE WHEN g <= 50000 THEN now() END \
         FROM generate_series(1, 100000) g; \
         INSERT INTO webhook_events (tenant_id, event_type, payload) \
         SELECT 'tenant_small', 'invoice.paid', '{}' FROM generate_series(1, 5); \
         ANALYZE webhook_events",
    )
    .execute(&mut su)
    .await
    .unwrap();
    let plan = explain_index_driven(&t.db, CLAIM_AND_FAN_OUT, |s| {
        s.bind("webhook_outbox")
            .bind(1_i64)
            .bind(500_i64)
            .bind("hardcount_wake_webhook_delivery")
            .bind(10_000_i64)
            .bind("")
            .bind(64_i64)
            .bind(None::<i64>)
            .bind(0.0_f64)
            .bind(0_i64)
            .bind(0_i64)
    })
    .await;
    for scan in ["e", "e_1"] {
        let by_tenant =
            format!("Index Scan using webhook_events_undispatched on webhook_events {scan} ");
        assert!(plan.contains(&by_tenant), "{by_tenant} not in\n{plan}");
    }
    // The deliveries claimed for the delivery role (docs/adr/0087) whose
    // payload is too large to carry read it by key (docs/adr/0126).
    let by_key = "Index Scan using webhook_events_pkey on webhook_events ev ";
    assert!(plan.contains(by_key), "{by_key} not in\n{plan}");
    for absent in [
        "Index Scan using webhook_events_pkey on webhook_events e ",
        "Index Scan using webhook_events_pkey on webhook_events e_1 ",
        "Seq Scan on webhook_events",
        "Bitmap",
    ] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}

/// Guard: the backlog gauges' read (`BACKLOG`, read at a tick's end)
/// reads the undispatched events through their partial index, not the events
/// kept for retention: 1,000 events of which 990 are dispatched, on a table
/// never analyzed. Mutation `outbox_backlog_seqscan` (the predicate written
/// so that the partial index does not match) reads every event: seen failing
/// here.
#[tokio::test]
async fn the_backlog_gauges_read_only_undispatched_events() {
    let t = TestDb::new().await;
    a_thousand_events(&t).await;
    let mut owner = t.superuser().await;
    sqlx::raw_sql(
        "UPDATE webhook_events SET dispatched_at = now() \
         WHERE id NOT IN (SELECT id FROM webhook_events ORDER BY id DESC LIMIT 10)",
    )
    .execute(&mut owner)
    .await
    .unwrap();
    let plan = explain_index_driven(&t.db, BACKLOG, |s| s).await;
    assert!(plan.contains("webhook_events_undispatched"), "{plan}");
    assert!(!plan.contains("Seq Scan on webhook_events"), "{plan}");
}

/// 1,000 events of tenant_a, enqueued as producers do.
async fn a_thousand_events(t: &TestDb) {
    let payloads: Vec<String> = (0..1000).map(|i| format!(r#"{{"n": {i}}}"#)).collect();
    let events: Vec<NewEvent<'_>> = payloads
        .iter()
        .map(|p| ("tenant_a", "invoice.finalized", p.as_str()))
        .collect();
    let mut tx = t.db.begin().await.unwrap();
    assert_eq!(enqueue_many(&mut tx, &events).await.unwrap(), 1000);
    tx.commit().await.unwrap();
}

/// With an offer from the delivery role (docs/adr/0124), each event's check
/// for deliveries already written (an event fanned out again) is a probe of
/// their unique key, not a hash of the whole table: a fan-out of 500 events
/// reads 500 index entries whatever the table holds.
#[tokio::test]
async fn a_fan_out_that_hands_over_probes_each_event_by_its_key() {
    let t = TestDb::new().await;
    for _ in 0..3 {
        endpoint(&t, "tenant_a", &[], true).await;
    }
    a_thousand_events(&t).await;
    let plan = explain_fan_out(&t, Some(1)).await;
    assert!(
        plan.contains("using webhook_deliveries_event_endpoint_key on webhook_deliveries d"),
        "{plan}"
    );
    for absent in ["hashed SubPlan", "Seq Scan on webhook_deliveries"] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}
