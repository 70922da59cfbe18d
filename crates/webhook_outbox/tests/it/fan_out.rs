//! The dispatcher: who gets a delivery, replays, the fence, and draining in batches.

use std::time::{Duration, Instant};

use db::{Row, sql};
use leader::{Role, TickEnd};
use testbed::TestDb;
use webhook_outbox::DispatcherConfig;

use crate::{as_leader, count, deliveries, dispatcher, endpoint, event, manager, series};

#[tokio::test]
async fn fan_out_gives_one_delivery_per_enabled_subscribed_endpoint_of_the_same_tenant() {
    let t = TestDb::new().await;
    let every = endpoint(&t, "tenant_a", &[], true).await;
    let paid_only = endpoint(&t, "tenant_a", &["invoice.paid"], true).await;
    let other_type = endpoint(&t, "tenant_a", &["invoice.voided"], true).await;
    let disabled = endpoint(&t, "tenant_a", &[], false).await;
    let other_tenant = endpoint(&t, "tenant_b", &[], true).await;
    let paid = event(&t.db, "tenant_a", "invoice.paid", r#"{"n": 1}"#).await;
    let finalized = event(&t.db, "tenant_a", "invoice.finalized", r#"{"n": 2}"#).await;
    let b_paid = event(&t.db, "tenant_b", "invoice.paid", r#"{"n": 3}"#).await;
    let lonely = event(&t.db, "tenant_c", "invoice.paid", r#"{"n": 4}"#).await;

    let (d, metrics) = dispatcher(&t.db, DispatcherConfig::default());
    let m = manager(&t.db, "a");
    let dispatched = as_leader(&m, Role::WebhookOutbox, |tick| async move {
        d.dispatch_batch(&tick.fence, 100).await.unwrap()
    })
    .await;
    assert_eq!(
        dispatched, 4,
        "every event is dispatched, even one with no endpoint"
    );

    let a = "tenant_a".to_owned();
    let expected = vec![
        (paid, every, a.clone()),
        (paid, paid_only, a.clone()),
        (finalized, every, a.clone()),
        (b_paid, other_tenant, "tenant_b".to_owned()),
    ];
    assert_eq!(deliveries(&t.db).await, expected);
    for unused in [other_type, disabled] {
        assert!(!deliveries(&t.db).await.iter().any(|(_, e, _)| *e == unused));
    }
    let _ = lonely;
    assert_eq!(
        count(
            &t.db,
            "SELECT count(*) FROM webhook_events WHERE dispatched_at IS NULL"
        )
        .await,
        0
    );
    let pending = count(
        &t.db,
        "SELECT count(*) FROM webhook_deliveries WHERE status = 'pending' AND attempts = 0 \
         AND next_attempt_at <= now()",
    )
    .await;
    assert_eq!(pending, 4, "new deliveries are pending and due now");
    assert_eq!(
        series(&metrics, "hardcount_webhook_events_dispatched_total"),
        Some(4.0)
    );
}

/// An operator (or a stale leader's late commit) replays a batch: the events
/// are claimed again, and `UNIQUE (event_id, endpoint_id)` adds nothing.
///
/// Mutation check: without `ON CONFLICT (event_id, endpoint_id) DO NOTHING`
/// the replay fails on the unique index (and without the index, duplicates
/// would appear); this test was run against the first mutation and failed.
#[tokio::test]
async fn a_replayed_batch_creates_no_duplicate_deliveries() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", &[], true).await;
    endpoint(&t, "tenant_a", &["invoice.paid"], true).await;
    for n in 0..5 {
        event(
            &t.db,
            "tenant_a",
            "invoice.paid",
            &format!(r#"{{"n": {n}}}"#),
        )
        .await;
    }
    let (d, _) = dispatcher(&t.db, DispatcherConfig::default());
    let m = manager(&t.db, "a");
    let d1 = d.clone();
    as_leader(&m, Role::WebhookOutbox, |tick| async move {
        assert_eq!(d1.dispatch_batch(&tick.fence, 100).await.unwrap(), 5);
    })
    .await;
    let before = deliveries(&t.db).await;
    assert_eq!(before.len(), 10);

    let mut su = t.superuser().await;
    sqlx::raw_sql("UPDATE webhook_events SET dispatched_at = NULL")
        .execute(&mut su)
        .await
        .unwrap();
    // A new endpoint meanwhile: the replay gives it the events, and only it.
    let late = endpoint(&t, "tenant_a", &[], true).await;
    let replayed = as_leader(&m, Role::WebhookOutbox, |tick| async move {
        d.dispatch_batch(&tick.fence, 100).await.unwrap()
    })
    .await;
    assert_eq!(replayed, 5);
    let after = deliveries(&t.db).await;
    assert_eq!(after.len(), 15);
    assert!(before.iter().all(|d| after.contains(d)));
    assert_eq!(after.iter().filter(|(_, e, _)| *e == late).count(), 5);
}

/// A leader replaced by a takeover claims nothing with its old token, while
/// the new leader's claim in the same moment takes the events.
///
/// Mutation check: removing `AND leader_fence($1, $2)` from the claim in
/// `store::claim_and_fan_out` makes the old token dispatch the events; this
/// test was run against that mutation and failed, then the predicate was restored.
#[tokio::test]
async fn a_stale_token_claims_nothing_after_a_takeover() {
    let t = TestDb::new().await;
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
    let old = as_leader(
        &manager(&t.db, "old"),
        Role::WebhookOutbox,
        |tick| async move { tick.fence },
    )
    .await;
    let (by_old, by_new) = as_leader(
        &manager(&t.db, "new"),
        Role::WebhookOutbox,
        |tick| async move {
            assert!(tick.fence.token() > old.token());
            let by_old = d.dispatch_batch(&old, 100).await.unwrap();
            let by_new = d.dispatch_batch(&tick.fence, 100).await.unwrap();
            (by_old, by_new)
        },
    )
    .await;
    assert_eq!((by_old, by_new), (0, 3));
    assert_eq!(deliveries(&t.db).await.len(), 3);
}

/// Several hundred events drain in one tick, a handful of statements per
/// batch of 500 (claim-and-mark, then one INSERT … SELECT), not one per event.
#[tokio::test]
async fn a_tick_drains_hundreds_of_events_in_set_based_batches() {
    let t = TestDb::new().await;
    for tenant in ["tenant_a", "tenant_b"] {
        endpoint(&t, tenant, &[], true).await;
        endpoint(&t, tenant, &["invoice.paid"], true).await;
    }
    let mut tx = t.db.begin().await.unwrap();
    for n in 0..700 {
        let tenant = if n % 2 == 0 { "tenant_a" } else { "tenant_b" };
        let kind = if n % 3 == 0 {
            "invoice.paid"
        } else {
            "invoice.finalized"
        };
        webhook_outbox::enqueue(&mut tx, tenant, kind, &format!(r#"{{"n": {n}}}"#))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();

    let (d, metrics) = dispatcher(&t.db, DispatcherConfig::default());
    let m = manager(&t.db, "a");
    let started = Instant::now();
    let report = as_leader(&m, Role::WebhookOutbox, |tick| async move {
        d.run_tick(&tick).await
    })
    .await;
    println!(
        "700 events fanned out in {:?} ({report:?})",
        started.elapsed()
    );
    // It found work: due again at once (docs/adr/0014).
    assert!(matches!(report.end, TickEnd::DrainedDueNow), "{report:?}");
    assert_eq!((report.batches, report.events), (2, 700));
    // Every event to its tenant's catch-all endpoint, a third also to the invoice.paid one.
    let paid = (0..700).filter(|n| n % 3 == 0).count() as u64;
    assert_eq!(report.deliveries, 700 + paid);
    assert_eq!(
        count(&t.db, "SELECT count(*) FROM webhook_deliveries").await as u64,
        700 + paid
    );
    assert_eq!(
        series(&metrics, "hardcount_webhook_events_dispatched_total"),
        Some(700.0)
    );
    let tenants_match =
        t.db.fetch_one(sql(
            "SELECT bool_and(d.tenant_id = e.tenant_id AND d.tenant_id = ep.tenant_id) AS ok \
             FROM webhook_deliveries d JOIN webhook_events e ON e.id = d.event_id \
             JOIN webhook_endpoints ep ON ep.id = d.endpoint_id",
        ))
        .await
        .unwrap()
        .get::<bool, _>("ok");
    assert!(tenants_match);
}

/// The budget stops a tick between batches; the next tick goes on where it stopped.
#[tokio::test]
async fn a_tick_stops_at_its_budget_and_the_next_one_goes_on() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", &[], true).await;
    for n in 0..30 {
        event(
            &t.db,
            "tenant_a",
            "invoice.paid",
            &format!(r#"{{"n": {n}}}"#),
        )
        .await;
    }
    let config = DispatcherConfig {
        batch_size: 10,
        // Spent before the first batch (a zero budget is refused).
        tick_budget: Duration::from_nanos(1),
        ..DispatcherConfig::default()
    };
    let (d, _) = dispatcher(&t.db, config);
    let m = manager(&t.db, "a");
    let d1 = d.clone();
    let report = as_leader(&m, Role::WebhookOutbox, |tick| async move {
        d1.run_tick(&tick).await
    })
    .await;
    assert!(matches!(report.end, TickEnd::MoreWork), "{report:?}");
    assert_eq!(report.events, 0);

    let config = DispatcherConfig {
        batch_size: 10,
        ..DispatcherConfig::default()
    };
    let (d, _) = dispatcher(&t.db, config);
    let report = as_leader(&m, Role::WebhookOutbox, |tick| async move {
        d.run_tick(&tick).await
    })
    .await;
    // 30 events in batches of 10: the fourth claim finds nothing; the tick
    // found work, so it is due again at once (docs/adr/0014).
    assert!(matches!(report.end, TickEnd::DrainedDueNow), "{report:?}");
    assert_eq!((report.batches, report.events), (3, 30));
    let undispatched =
        t.db.fetch_one(sql(
            "SELECT count(*) AS n FROM webhook_events WHERE dispatched_at IS NULL",
        ))
        .await
        .unwrap()
        .get::<i64, _>("n");
    assert_eq!(undispatched, 0);
}

/// The tenant check of migration 0015 (docs/adr/0019) runs once per
/// statement, over every row it inserted: one cross-tenant row among good
/// ones refuses the whole insert, by the foreign key's old name. A delivery's
/// target never changes, and an event or endpoint with deliveries cannot be
/// deleted or moved to another tenant, even by the owner; one without can.
///
/// Mutation check: the statement check without its tenant comparison for
/// events (`tenant_check_event`) lets the mixed insert through and this test
/// fails; so does the referents' trigger without its event branch
/// (`referent_kept`).
#[tokio::test]
async fn the_tenant_check_covers_every_row_of_a_statement_and_referents_stay() {
    let t = TestDb::new().await;
    let ep_a = endpoint(&t, "tenant_a", &[], true).await;
    let ep_b = endpoint(&t, "tenant_b", &[], true).await;
    let a1 = event(&t.db, "tenant_a", "invoice.paid", "{}").await;
    let a2 = event(&t.db, "tenant_a", "invoice.paid", "{}").await;
    let b1 = event(&t.db, "tenant_b", "invoice.paid", "{}").await;
    let insert = "INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id) \
                  SELECT 'tenant_a', e, $2 FROM unnest($1::int8[]) e";
    let err =
        t.db.execute(sql(insert).bind(vec![a1, b1, a2]).bind(ep_a))
            .await
            .unwrap_err();
    assert_eq!(
        err.constraint(),
        Some("webhook_deliveries_event_same_tenant"),
        "{err}"
    );
    assert_eq!(err.code().as_deref(), Some("23503"), "{err}");
    let err =
        t.db.execute(sql(insert).bind(vec![a1, a2]).bind(ep_b))
            .await
            .unwrap_err();
    assert_eq!(
        err.constraint(),
        Some("webhook_deliveries_endpoint_same_tenant"),
        "{err}"
    );
    assert_eq!(
        count(&t.db, "SELECT count(*) FROM webhook_deliveries").await,
        0
    );
    t.db.execute(sql(insert).bind(vec![a1, a2]).bind(ep_a))
        .await
        .unwrap();

    let mut owner = t.superuser().await;
    let refused = [
        format!("UPDATE webhook_deliveries SET endpoint_id = {ep_b} WHERE event_id = {a1}"),
        format!("UPDATE webhook_deliveries SET tenant_id = 'tenant_b' WHERE event_id = {a1}"),
        format!("DELETE FROM webhook_events WHERE id = {a1}"),
        format!("UPDATE webhook_events SET tenant_id = 'tenant_b' WHERE id = {a2}"),
        format!("DELETE FROM webhook_endpoints WHERE id = {ep_a}"),
        format!("UPDATE webhook_endpoints SET tenant_id = 'tenant_b' WHERE id = {ep_a}"),
    ];
    for statement in refused {
        let err = sqlx::raw_sql(sqlx::AssertSqlSafe(statement.clone()))
            .execute(&mut owner)
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("never change")
                || err.to_string().contains("has webhook deliveries"),
            "{statement}: {err}"
        );
    }
    // Without deliveries, the owner may delete an event and an endpoint.
    for statement in [
        format!("DELETE FROM webhook_events WHERE id = {b1}"),
        format!("DELETE FROM webhook_endpoints WHERE id = {ep_b}"),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(&mut owner)
            .await
            .unwrap();
    }
}

/// One statement fans out at most `max_deliveries_per_statement` deliveries
/// (one event always): a tenant with many endpoints fans out a few events a
/// statement, and another tenant's events behind it still go out; every
/// event is dispatched once, to every endpoint, across statements.
///
/// Catches: the bound ignored (seen: with `WHERE w.before < $5` made
/// `WHERE true`, the first statement dispatched all 30 events, 1,200
/// deliveries), and an event left behind by the bound.
#[tokio::test]
async fn a_tenant_with_many_endpoints_fans_out_a_bounded_number_a_statement() {
    let t = TestDb::new().await;
    for _ in 0..40 {
        endpoint(&t, "wide", &[], true).await;
    }
    endpoint(&t, "small", &[], true).await;
    let mut tx = t.db.begin().await.unwrap();
    for n in 0..30 {
        let tenant = if n == 29 { "small" } else { "wide" };
        webhook_outbox::enqueue(&mut tx, tenant, "invoice.paid", &format!(r#"{{"n": {n}}}"#))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let config = DispatcherConfig {
        max_deliveries_per_statement: 100,
        ..DispatcherConfig::default()
    };
    let (d, _) = dispatcher(&t.db, config);
    let m = manager(&t.db, "a");
    let first = as_leader(&m, Role::WebhookOutbox, |tick| {
        let d = d.clone();
        async move { d.dispatch_batch(&tick.fence, 500).await.unwrap() }
    })
    .await;
    // Events are taken turn by turn, the tenant with fewer endpoints first
    // in a turn (docs/adr/0048), while fewer than 100 deliveries were before
    // them: small's one (0 before), then wide's first three (1, 41, 81).
    assert_eq!(first, 4);
    assert_eq!(
        count(&t.db, "SELECT count(*) FROM webhook_deliveries").await,
        121
    );
    let mut statements = 1;
    loop {
        let n = as_leader(&m, Role::WebhookOutbox, |tick| {
            let d = d.clone();
            async move { d.dispatch_batch(&tick.fence, 500).await.unwrap() }
        })
        .await;
        if n == 0 {
            break;
        }
        assert!(n <= 3, "a statement took {n} events");
        statements += 1;
    }
    assert_eq!(statements, 10, "4 events, then 26 at 3 a statement");
    assert_eq!(
        count(&t.db, "SELECT count(*) FROM webhook_deliveries").await,
        29 * 40 + 1
    );
    assert_eq!(
        count(
            &t.db,
            "SELECT count(*) FROM webhook_events WHERE dispatched_at IS NULL"
        )
        .await,
        0
    );

    // One event to more endpoints than the bound still goes, alone.
    let config = DispatcherConfig {
        max_deliveries_per_statement: 10,
        ..DispatcherConfig::default()
    };
    let (d, _) = dispatcher(&t.db, config);
    event(&t.db, "wide", "invoice.paid", "{}").await;
    let n = as_leader(&m, Role::WebhookOutbox, |tick| {
        let d = d.clone();
        async move { d.dispatch_batch(&tick.fence, 500).await.unwrap() }
    })
    .await;
    assert_eq!(n, 1);
}
