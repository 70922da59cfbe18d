//! The guards: the fence on the funnel, the compare-and-set on the period, and
//! the dedup index, each alone and together (a stale leader racing the new one).

use billing::Closed;
use leader::Role;
use testbed::TestDb;

use crate::{as_leader, biller, config, due_monthly, finalized, invoices, manager, period, tick};

/// Twenty closers race on one snapshot: exactly one closes the period, creates
/// the invoice and announces it; the nineteen others are refused by the
/// compare-and-set (not by the dedup index) and write nothing.
///
/// Mutation check: removing the snapshot proof from `store::close_once`'s
/// UPDATE (the three predicates on status, period start and watermark) lets all
/// twenty advance the period; the index then refuses nineteen invoices, so they
/// report `AlreadyInvoiced`, not `PeriodMoved`, and this fails. Removing only
/// the watermark predicate does not fail this test (the period-start
/// predicate refuses the racers too); that one is pinned by
/// `a_closing_whose_watermark_moved_under_it_writes_nothing`.
#[tokio::test]
async fn twenty_concurrent_closings_of_one_snapshot_invoice_once() {
    let t = TestDb::with_pool(24).await;
    let sub = due_monthly(&t.db, "tenant_a", 1).await[0];
    let (b, _) = biller(&t.db, config());
    let b2 = b.clone();
    let due = as_leader(&manager(&t.db, "a"), Role::Billing, |tick| async move {
        b2.claim_due(&tick.fence, 10).await.unwrap()
    })
    .await;
    assert_eq!(due.len(), 1);
    let before = period(&t.db, sub).await;
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(20));
    let racers: Vec<_> = (0..20)
        .map(|_| {
            let (b, d, barrier) = (b.clone(), due[0].clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                b.close_period(&d).await.unwrap()
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for r in racers {
        outcomes.push(r.await.unwrap());
    }
    let won: Vec<_> = outcomes
        .iter()
        .filter(|o| matches!(o, Closed::Invoiced { .. }))
        .collect();
    let moved = outcomes
        .iter()
        .filter(|o| **o == Closed::PeriodMoved)
        .count();
    assert_eq!((won.len(), moved), (1, 19), "{outcomes:?}");
    let inv = invoices(&t.db).await;
    assert_eq!(inv.len(), 1);
    assert_eq!((inv[0].start, inv[0].end), (before.0, before.1));
    let Closed::Invoiced { invoice_id } = won[0] else {
        unreachable!()
    };
    assert_eq!(finalized(&t.db).await, vec![*invoice_id]);
    let after = period(&t.db, sub).await;
    assert_eq!(
        after.0, before.1,
        "the next period starts where the closed one ended"
    );
    assert_eq!(after.2, after.1, "the watermark is the new period's end");
}

/// A closer holds a snapshot; meanwhile another writer moves only the
/// watermark (here an operator deferring the bill by an hour). The stale
/// closing is refused and writes nothing.
///
/// Mutation check: removing `AND s.next_billing_at = i.watermark` from
/// `store::close_once` lets the stale closing invoice and advance the period
/// from its old snapshot; this test was run against that mutation and failed.
#[tokio::test]
async fn a_closing_whose_watermark_moved_under_it_writes_nothing() {
    use sqlx::Executor as _;
    let t = TestDb::new().await;
    let sub = due_monthly(&t.db, "tenant_a", 1).await[0];
    let (b, _) = biller(&t.db, config());
    let b2 = b.clone();
    let due = as_leader(&manager(&t.db, "a"), Role::Billing, |tick| async move {
        b2.claim_due(&tick.fence, 10).await.unwrap()
    })
    .await;
    let mut su = t.superuser().await;
    su.execute("UPDATE subscriptions SET next_billing_at = next_billing_at + interval '1 hour'")
        .await
        .unwrap();
    let moved = period(&t.db, sub).await;
    assert_eq!(b.close_period(&due[0]).await.unwrap(), Closed::PeriodMoved);
    assert_eq!(invoices(&t.db).await, vec![]);
    assert_eq!(finalized(&t.db).await, Vec::<i64>::new());
    assert_eq!(period(&t.db, sub).await, moved);
}

/// A leader replaced by a takeover lists nothing with its old token, while
/// the new leader's funnel lists every due subscription.
///
/// Mutation check: removing `AND leader_fence($1, $2)` from `store::claim_due`
/// makes the old token list all three; this test was run against that
/// mutation and failed, then the predicate was restored.
#[tokio::test]
async fn a_stale_token_claims_nothing_after_a_takeover() {
    let t = TestDb::new().await;
    due_monthly(&t.db, "tenant_a", 3).await;
    let (b, _) = biller(&t.db, config());
    let old = as_leader(&manager(&t.db, "old"), Role::Billing, |tick| async move {
        tick.fence
    })
    .await;
    let (by_old, by_new) = as_leader(&manager(&t.db, "new"), Role::Billing, |tick| async move {
        assert!(tick.fence.token() > old.token());
        let by_old = b.claim_due(&old, 10).await.unwrap().len();
        let by_new = b.claim_due(&tick.fence, 10).await.unwrap().len();
        (by_old, by_new)
    })
    .await;
    assert_eq!((by_old, by_new), (0, 3));
}

/// The old leader listed the due set before it was replaced and closes it
/// from that listing, concurrently with the new leader's tick over the same
/// set: each (subscription, period) is invoiced exactly once and announced
/// exactly once, and each period advanced exactly once.
#[tokio::test]
async fn a_stale_leader_and_the_new_leader_bill_the_same_due_set_once() {
    let t = TestDb::with_pool(16).await;
    let subs = due_monthly(&t.db, "tenant_a", 40).await;
    let before: Vec<_> = {
        let mut v = Vec::new();
        for s in &subs {
            v.push(period(&t.db, *s).await);
        }
        v
    };
    let (b, _) = biller(
        &t.db,
        billing::BillingConfig {
            batch_size: 7,
            ..config()
        },
    );
    let b2 = b.clone();
    let stale = as_leader(&manager(&t.db, "old"), Role::Billing, |tick| async move {
        b2.claim_due(&tick.fence, 100).await.unwrap()
    })
    .await;
    assert_eq!(stale.len(), 40);
    let old = {
        let b = b.clone();
        tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for d in stale.iter().rev() {
                outcomes.push(b.close_period(d).await.unwrap());
            }
            outcomes
        })
    };
    let report = tick(&t.db, &b).await;
    let old = old.await.unwrap();
    let by_old = old
        .iter()
        .filter(|o| matches!(o, Closed::Invoiced { .. }))
        .count();
    assert_eq!(by_old + report.tally.invoiced, 40, "{report:?}");
    assert_eq!(report.tally.already_invoiced, 0);
    let inv = invoices(&t.db).await;
    assert_eq!(inv.len(), 40);
    let mut keys: Vec<_> = inv.iter().map(|i| (i.subscription, i.start)).collect();
    keys.dedup();
    assert_eq!(keys.len(), 40);
    let mut announced = finalized(&t.db).await;
    announced.sort_unstable();
    let mut ids: Vec<i64> =
        t.db.fetch_all(db::sql("SELECT id FROM invoices ORDER BY id"))
            .await
            .unwrap()
            .iter()
            .map(|r| db::Row::get(r, "id"))
            .collect();
    ids.sort_unstable();
    assert_eq!(announced, ids);
    for (s, b) in subs.iter().zip(before) {
        let after = period(&t.db, *s).await;
        assert_eq!(after.0, b.1, "subscription {s} advanced exactly once");
    }
    // Nothing is due any more: a further tick bills nothing.
    let again = tick(&t.db, &b).await;
    assert_eq!(again.claimed, 0);
}
