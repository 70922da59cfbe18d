//! The claim interleaves tenants (issue 25, point 4; docs/adr/0048): one
//! tenant's undispatched events do not stand in front of another tenant's.

use db::{Row, sql};
use leader::Role;
use testbed::TestDb;
use webhook_outbox::{DispatcherConfig, NewEvent, enqueue_many};

use crate::{as_leader, dispatcher, endpoint, event, manager};

async fn dispatched(t: &TestDb, tenant: &str) -> i64 {
    t.db.fetch_one(
        sql("SELECT count(*) AS n FROM webhook_events \
             WHERE tenant_id = $1 AND dispatched_at IS NOT NULL")
        .bind(tenant.to_owned()),
    )
    .await
    .unwrap()
    .get("n")
}

async fn backlog(t: &TestDb, tenant: &str, n: usize) {
    let payloads: Vec<String> = (0..n).map(|i| format!(r#"{{"n": {i}}}"#)).collect();
    let events: Vec<NewEvent<'_>> = payloads
        .iter()
        .map(|p| (tenant, "invoice.finalized", p.as_str()))
        .collect();
    let mut tx = t.db.begin().await.unwrap();
    enqueue_many(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
}

/// Tenant A queued 300 events before tenant B's one, yet one batch of 10
/// dispatches B's and gives A the rest.
///
/// Mutation check (`fair_event_share` in scripts/mutation-check): `LIMIT
/// s.quota` replaced by `LIMIT $3` in the claim lets tenant A, first in the
/// walk, take the whole batch; this test was run against it and failed.
#[tokio::test]
async fn a_small_tenant_is_in_the_first_batch_beside_a_backlog() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", &[], true).await;
    endpoint(&t, "tenant_b", &[], true).await;
    backlog(&t, "tenant_a", 300).await;
    event(&t.db, "tenant_b", "invoice.paid", "{}").await;
    let (d, _) = dispatcher(&t.db, DispatcherConfig::default());
    let n = as_leader(
        &manager(&t.db, "d"),
        Role::WebhookOutbox,
        |tick| async move { d.dispatch_batch(&tick.fence, 10).await.unwrap() },
    )
    .await;
    assert_eq!(n, 10);
    assert_eq!(dispatched(&t, "tenant_b").await, 1);
    assert_eq!(dispatched(&t, "tenant_a").await, 9);
}

/// The fan-out bound takes events turn by turn, the tenant with fewer
/// endpoints first in a turn: with A's 30 endpoints against a bound of 20, A
/// fans out one event a statement, and B's event (one endpoint) is taken
/// beside it instead of waiting for A's backlog.
///
/// Mutation check (`fair_event_turns`): the running sum ordered by `c.id`
/// alone takes A's first event and stops; this test was run against it and
/// failed.
#[tokio::test]
async fn the_fan_out_bound_does_not_keep_a_small_tenant_behind_a_wide_one() {
    let t = TestDb::new().await;
    for _ in 0..30 {
        endpoint(&t, "tenant_a", &[], true).await;
    }
    endpoint(&t, "tenant_b", &[], true).await;
    backlog(&t, "tenant_a", 5).await;
    event(&t.db, "tenant_b", "invoice.paid", "{}").await;
    let config = DispatcherConfig {
        max_deliveries_per_statement: 20,
        ..DispatcherConfig::default()
    };
    let (d, _) = dispatcher(&t.db, config);
    let n = as_leader(
        &manager(&t.db, "d"),
        Role::WebhookOutbox,
        |tick| async move { d.dispatch_batch(&tick.fence, 100).await.unwrap() },
    )
    .await;
    assert_eq!(n, 2);
    assert_eq!(dispatched(&t, "tenant_b").await, 1);
    assert_eq!(dispatched(&t, "tenant_a").await, 1);
}
