//! The due listing interleaves tenants (issue 25, point 4; docs/adr/0048):
//! one tenant's due subscriptions do not stand in front of another tenant's.

use leader::Role;
use testbed::TestDb;

use crate::{as_leader, biller, config, due_monthly, invoices, manager, tick};

/// Tenant A has 300 subscriptions due before tenant B's 2, yet one listing of
/// 10 holds B's 2 and gives A the rest.
///
/// Mutation check (`fair_billing_share` in scripts/mutation-check): `LIMIT
/// sh.quota` replaced by `LIMIT $4` in the listing lets tenant A, first in the
/// walk, take the whole batch; this test was run against it and failed.
#[tokio::test]
async fn a_small_tenant_is_in_the_first_listing_beside_a_backlog() {
    let t = TestDb::new().await;
    due_monthly(&t.db, "tenant_a", 300).await;
    let b_subs = due_monthly(&t.db, "tenant_b", 2).await;
    let (b, _) = biller(&t.db, config());
    let due = as_leader(&manager(&t.db, "b"), Role::Billing, |tick| async move {
        b.claim_due(&tick.fence, 10).await.unwrap()
    })
    .await;
    assert_eq!(due.len(), 10);
    let mut of_b: Vec<i64> = due
        .iter()
        .filter(|d| d.tenant_id == "tenant_b")
        .map(|d| d.subscription_id)
        .collect();
    of_b.sort_unstable();
    assert_eq!(of_b, b_subs);
}

/// 100 tenants with 2 due subscriptions each: a listing visits at most 64
/// tenants (`db::TENANTS_PER_CLAIM`), so the first comes back with 128 of a
/// batch of 500, short while 72 wait. One tick still bills all 200: a short
/// listing does not end billing's tick, an empty one does (docs/adr/0067).
///
/// Mutation check (`billing_short_batch` in scripts/mutation-check): with
/// `short_batch_drains` true, as the driver's default, the tick ended after
/// the first listing, the other 72 left for the next tick, an hour later at
/// the default interval; this test was run against it and failed.
#[tokio::test]
async fn one_tick_bills_more_tenants_than_a_listing_visits() {
    let t = TestDb::new().await;
    for k in 0..100 {
        due_monthly(&t.db, &format!("tenant_{k:03}"), 2).await;
    }
    let (b, _) = biller(&t.db, config());
    let report = tick(&t.db, &b).await;
    assert_eq!(report.tally.invoiced, 200, "{report:?}");
    assert!(report.batches >= 2, "{report:?}");
    assert_eq!(invoices(&t.db).await.len(), 200);
}
