//! The claim interleaves tenants (issue 25, point 4; docs/adr/0048): one
//! tenant's backlog does not stand in front of another tenant's deliveries.

use std::collections::BTreeMap;

use db::{Db, Row, sql};
use leader::Role;
use testbed::TestDb;

use crate::{as_leader, config, endpoint, events, manager, worker};

/// Claimed deliveries (attempted once, not yet answered) by tenant.
async fn claimed_by_tenant(db: &Db) -> BTreeMap<String, i64> {
    db.fetch_all(sql(
        "SELECT tenant_id, count(*) AS n FROM webhook_deliveries \
         WHERE attempts > 0 GROUP BY tenant_id",
    ))
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get("tenant_id"), r.get("n")))
    .collect()
}

/// Tenant A queued 300 deliveries before tenant B's 2, yet one claim of 10
/// takes B's 2 and gives A the rest of the batch.
///
/// Mutation check (`fair_delivery_share` in scripts/mutation-check):
/// `LIMIT s.quota` replaced by `LIMIT $3` in the claim lets tenant A, first in
/// the walk, take the whole batch; this test was run against it and failed.
#[tokio::test]
async fn a_small_tenant_is_in_the_first_claim_beside_a_backlog() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", "http://127.0.0.1:9/a").await;
    events(&t.db, "tenant_a", 300).await;
    endpoint(&t, "tenant_b", "http://127.0.0.1:9/b").await;
    events(&t.db, "tenant_b", 2).await;
    let (w, _) = worker(&t.db, config());
    let n = as_leader(
        &manager(&t.db, "w"),
        Role::WebhookDelivery,
        |tick| async move { w.claim_due(&tick.fence, 10).await.unwrap().len() },
    )
    .await;
    assert_eq!(n, 10);
    let by = claimed_by_tenant(&t.db).await;
    assert_eq!(by.get("tenant_b"), Some(&2), "{by:?}");
    assert_eq!(by.get("tenant_a"), Some(&8), "{by:?}");
}

/// 25 tenants with one delivery each and claims of 10: a claim visits at most
/// 10 tenants, and the next starts after the last one visited, so three claims
/// reach all 25 (10, 10, 5). Claimed rows stay pending in the index while
/// their attempt runs; a walk that always started at the first tenant would
/// meet only those and claim nothing the second time.
///
/// Mutation check (`fair_cursor`): `TenantCursor::advance` always starting
/// over makes the second claim find nothing; this test was run against it and
/// failed.
#[tokio::test]
async fn claims_go_round_the_tenants_when_more_have_work_than_one_visits() {
    let t = TestDb::new().await;
    for i in 0..25 {
        let tenant = format!("tenant_{i:02}");
        endpoint(&t, &tenant, "http://127.0.0.1:9/x").await;
        events(&t.db, &tenant, 1).await;
    }
    let (w, _) = worker(&t.db, config());
    let sizes = as_leader(
        &manager(&t.db, "w"),
        Role::WebhookDelivery,
        |tick| async move {
            let mut sizes = Vec::new();
            for _ in 0..4 {
                sizes.push(w.claim_due(&tick.fence, 10).await.unwrap().len());
            }
            sizes
        },
    )
    .await;
    assert_eq!(sizes, [10, 10, 5, 0]);
    let by = claimed_by_tenant(&t.db).await;
    assert_eq!(by.len(), 25);
    assert!(by.values().all(|&n| n == 1), "{by:?}");
}
