//! The claim interleaves tenants (issue 25, point 4; docs/adr/0048): one
//! tenant's queue does not stand in front of another tenant's emails.

use std::collections::BTreeMap;

use db::{Row, sql};
use leader::Role;
use testbed::TestDb;

use crate::{as_leader, config, email, manager, queue, queue_numbered, sender, tick};

/// Tenant A queued 200 emails before tenant B's 2, yet one claim of 10 takes
/// B's 2 and gives A the rest of the batch.
///
/// Mutation check (`fair_email_share` in scripts/mutation-check): `LIMIT
/// s.quota` replaced by `LIMIT $3` in the claim lets tenant A, first in the
/// walk, take the whole batch; this test was run against it and failed.
#[tokio::test]
async fn a_small_tenant_is_in_the_first_claim_beside_a_backlog() {
    let t = TestDb::new().await;
    queue_numbered(&t.db, "tenant_a", "a", 200).await;
    queue(
        &t.db,
        "tenant_b",
        &[email("b0@example.org", 0), email("b1@example.org", 1)],
    )
    .await;
    let (s, _) = sender(&t.db, "smtp://127.0.0.1:9", None, config());
    let n = as_leader(&manager(&t.db, "s"), Role::EmailOutbox, |tick| async move {
        s.claim_due(&tick.fence, 10).await.unwrap().len()
    })
    .await;
    assert_eq!(n, 10);
    let by: BTreeMap<String, i64> = t
        .db
        .fetch_all(sql(
            "SELECT tenant_id, count(*) AS n FROM email_outbox WHERE attempts > 0 GROUP BY tenant_id",
        ))
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get("tenant_id"), r.get("n")))
        .collect();
    assert_eq!(by.get("tenant_b"), Some(&2), "{by:?}");
    assert_eq!(by.get("tenant_a"), Some(&8), "{by:?}");
}

/// 100 tenants with 2 emails each: a claim visits at most 64 tenants
/// (`db::TENANTS_PER_CLAIM`), so the first comes back with 128 of a batch of
/// 500, short while 72 wait. One tick still sends all 200: a short claim does
/// not end the tick, an empty one does (docs/adr/0067).
///
/// Mutation check (`email_short_batch` in scripts/mutation-check): with
/// `short_batch_drains` true, as the driver's default, the tick ended after
/// the first claim and sent 128; this test was run against it and failed.
#[tokio::test]
async fn one_tick_sends_for_more_tenants_than_a_claim_visits() {
    let t = TestDb::new().await;
    for k in 0..100 {
        queue(
            &t.db,
            &format!("tenant_{k:03}"),
            &[email("a@example.org", 0), email("b@example.org", 1)],
        )
        .await;
    }
    let sink = testbed::MinimalSink::start(std::time::Duration::ZERO).await;
    let (s, _) = sender(&t.db, &sink.url(), None, config());
    let (_, report) = tick(&t.db, &s).await;
    assert_eq!(report.claimed, 200, "{report:?}");
    assert_eq!(report.tally.sent, 200, "{report:?}");
}
