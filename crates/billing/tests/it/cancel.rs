//! Cancelling a subscription: now (the used part invoiced, the periods it is
//! behind closed first) or at its period's end (docs/adr/0025, 0077).

use billing::CancelAt;
use chrono::{SubsecRound, TimeDelta, Utc};
use db::{Db, Row, sql};
use sqlx::Executor;
use testbed::TestDb;

use crate::invoicing::{event_types, invoice_rows};
use crate::{biller, config, due_monthly, plan, subscription, tick};

/// A subscription of `tenant` to a ten-day plan of 1000 whose first period
/// began `days_ago` days ago.
pub(crate) async fn ten_day_subscription(db: &Db, tenant: &str, days_ago: i64) -> i64 {
    let p = plan(db, tenant, "day", 10, 1000).await;
    let start = Utc::now() - TimeDelta::days(days_ago);
    subscription(db, tenant, p, start, start, start + TimeDelta::days(10)).await
}

/// Asserts that `sub` of [`ten_day_subscription`] (25 days ago) has three
/// invoices, in period order: two whole periods, then half of the third for
/// `reason`; returns that last invoice's id.
pub(crate) async fn two_periods_and_half_of_one(db: &Db, sub: i64, reason: &str) -> i64 {
    let rows = db
        .fetch_all(
            sql("SELECT amount, reason, id FROM invoices WHERE subscription_id = $1 ORDER BY period_start")
                .bind(sub),
        )
        .await
        .unwrap();
    let invoices: Vec<(i64, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(invoices.len(), 3, "{invoices:?}");
    assert_eq!(invoices[0], (1000, "period".to_owned()));
    assert_eq!(invoices[1], (1000, "period".to_owned()));
    assert_eq!(invoices[2].1, reason);
    assert!((499..=501).contains(&invoices[2].0), "{invoices:?}");
    rows[2].get(2)
}

async fn subscription_status(db: &Db, sub: i64) -> String {
    db.fetch_one(sql("SELECT status FROM subscriptions WHERE id = $1").bind(sub))
        .await
        .unwrap()
        .get(0)
}

/// A cancel now of a subscription whose period ended before the tick closed
/// it (billing down, or behind): the ended periods are invoiced in full, as
/// the tick would, and the period holding now pro rata, in one
/// compare-and-set (docs/adr/0077). Before, the cancel truncated at the old
/// period's end: that period was invoiced, and the time used since it ended
/// never was.
/// Mutation: `cancel_not_behind` (the chain skipped: the old clamp) invoices
/// one period only; seen failing here.
#[tokio::test]
async fn a_cancel_now_of_a_subscription_behind_invoices_every_ended_period_and_the_used_part() {
    let t = TestDb::new().await;
    // Two ten-day periods ended, not closed; half of the third used.
    let sub = ten_day_subscription(&t.db, "tenant_a", 25).await;
    let (b, _) = biller(&t.db, config());
    let c = b
        .cancel_subscription("tenant_a", sub, CancelAt::Now)
        .await
        .unwrap();
    let last = two_periods_and_half_of_one(&t.db, sub, "cancel").await;
    assert_eq!(c.invoice_id, Some(last));
    assert_eq!(subscription_status(&t.db, sub).await, "canceled");
    // Announced once, by the chain's last closing; each invoice finalized.
    assert_eq!(
        event_types(&t.db).await,
        [
            "invoice.finalized",
            "invoice.finalized",
            "invoice.finalized",
            "subscription.canceled"
        ]
    );
    // The event names the subscription's plan (it said null: a closing
    // that changes no plan carries none). Mutation `canceled_plan_null`.
    let (plan, named): (i64, Option<i64>) =
        t.db.fetch_one(
            sql("SELECT s.plan_id, (e.payload->>'plan')::int8 AS named \
             FROM subscriptions s, webhook_events e \
             WHERE s.id = $1 AND e.event_type = 'subscription.canceled'")
            .bind(sub),
        )
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(named, Some(plan));
    // The canceled row shows its last period, [20 days after the start,
    // now): it showed the oldest period's start, 25 days ago, as the start of
    // a period that ended now. Mutation `ended_chain_oldest_start`.
    assert_eq!(period_of(&t.db, sub).await, (5, 0));
    // So does the event (it named the cut, now, as the period's start).
    // Mutation `ended_event_period_start`.
    let same: bool =
        t.db.fetch_one(
            sql(
                "SELECT (e.payload->>'current_period_start')::timestamptz = s.current_period_start \
             FROM subscriptions s, webhook_events e \
             WHERE s.id = $1 AND e.event_type = 'subscription.canceled'",
            )
            .bind(sub),
        )
        .await
        .unwrap()
        .get(0);
    assert!(same);
    // Nothing left for the tick.
    assert_eq!(tick(&t.db, &b).await.tally.invoiced, 0);
}

/// `sub`'s current period start and end, in whole days before now (a
/// start 5 days ago is 5; an end at now is 0).
async fn period_of(db: &Db, sub: i64) -> (i64, i64) {
    let r = db
        .fetch_one(
            sql(
                "SELECT round(extract(epoch FROM now() - current_period_start) / 86400)::int8, \
                        round(extract(epoch FROM now() - current_period_end) / 86400)::int8 \
                 FROM subscriptions WHERE id = $1",
            )
            .bind(sub),
        )
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

/// A cancel now, not behind, of a subscription whose pause of collection
/// passed its resume time a day ago and was not lifted yet: the used part
/// ends after the resume time, so its invoice is collected (open), not kept
/// as a draft, and the pause is lifted, as the tick's resume step would
/// (docs/adr/0088, 0110).
///
/// Mutation checks: `chain_lifts_pause_cancel` (the lift skipped) leaves the
/// pause; `pause_of_ignores_resume` (a pause applied whatever its resume
/// time) leaves the invoice a draft; each seen failing here.
#[tokio::test]
async fn a_cancel_now_collects_the_used_part_after_a_passed_pause_then_lifts_it() {
    let t = TestDb::new().await;
    let sub = ten_day_subscription(&t.db, "tenant_a", 5).await;
    crate::lifecycle::pause(&t.db, sub, Utc::now() - TimeDelta::days(1)).await;
    let (b, _) = biller(&t.db, config());
    let c = b
        .cancel_subscription("tenant_a", sub, CancelAt::Now)
        .await
        .unwrap();
    assert_eq!(crate::lifecycle::paused(&t.db, sub).await, None);
    let status: String = t
        .db
        .fetch_one(sql("SELECT status FROM invoices WHERE id = $1").bind(c.invoice_id.unwrap()))
        .await
        .unwrap()
        .get(0);
    assert_eq!(status, "open");
    assert_eq!(
        event_types(&t.db).await,
        [
            "invoice.finalized",
            "subscription.canceled",
            "subscription.collection_resumed"
        ]
    );
}

#[tokio::test]
async fn a_cancel_now_invoices_the_used_part_unless_the_tenant_says_not_to() {
    let t = TestDb::new().await;
    // Half of a ten-day period used.
    let sub = ten_day_subscription(&t.db, "tenant_a", 5).await;
    let (b, _) = biller(&t.db, config());
    let c = b
        .cancel_subscription("tenant_a", sub, CancelAt::Now)
        .await
        .unwrap();
    let r =
        t.db.fetch_one(
            sql("SELECT amount, reason FROM invoices WHERE id = $1").bind(c.invoice_id.unwrap()),
        )
        .await
        .unwrap();
    let (amount, reason): (i64, String) = (r.get(0), r.get(1));
    assert!((499..=501).contains(&amount), "{amount}");
    assert_eq!(reason, "cancel");
    assert_eq!(subscription_status(&t.db, sub).await, "canceled");
    assert_eq!(
        event_types(&t.db).await,
        vec!["invoice.finalized", "subscription.canceled"]
    );
    // Canceled is canceled: a second cancel finds no active subscription.
    let again = b.cancel_subscription("tenant_a", sub, CancelAt::Now).await;
    assert_eq!(again.unwrap_err().code(), "subscription_not_found");
    // A tenant that does not invoice cancels.
    t.superuser()
        .await
        .execute(
            "INSERT INTO tenant_settings (tenant_id, invoice_on_cancel) VALUES ('tenant_b', false)",
        )
        .await
        .unwrap();
    let sub = ten_day_subscription(&t.db, "tenant_b", 5).await;
    let c = b
        .cancel_subscription("tenant_b", sub, CancelAt::Now)
        .await
        .unwrap();
    assert_eq!(c.invoice_id, None);
}

#[tokio::test]
async fn a_cancel_at_period_end_bills_the_last_full_period_then_ends() {
    let t = TestDb::new().await;
    let sub = due_monthly(&t.db, "tenant_a", 1).await[0];
    // Its period ends in a moment: the cancel is made inside it.
    let mut su = t.superuser().await;
    su.execute(
        "UPDATE subscriptions SET \
                billing_anchor = billing_anchor + (now() + interval '2 seconds' - current_period_end), \
                current_period_start = current_period_start + (now() + interval '2 seconds' - current_period_end), \
                next_billing_at = now() + interval '2 seconds', \
                current_period_end = now() + interval '2 seconds'",
    )
    .await
    .unwrap();
    let (b, _) = biller(&t.db, config());
    b.cancel_subscription("tenant_a", sub, CancelAt::PeriodEnd)
        .await
        .unwrap();
    assert_eq!(invoice_rows(&t.db).await.len(), 0);
    tokio::time::sleep(std::time::Duration::from_millis(2100)).await;
    assert_eq!(tick(&t.db, &b).await.tally.invoiced, 1);
    assert_eq!(invoice_rows(&t.db).await[0].1, 1200);
    let r =
        t.db.fetch_one(
            sql("SELECT status, next_billing_at IS NULL AS ended FROM subscriptions WHERE id = $1")
                .bind(sub),
        )
        .await
        .unwrap();
    assert_eq!(
        (r.get::<String, _>(0), r.get::<bool, _>(1)),
        ("canceled".into(), true)
    );
    assert_eq!(
        event_types(&t.db).await,
        vec![
            "subscription.updated",
            "invoice.finalized",
            "subscription.canceled"
        ]
    );
    assert_eq!(tick(&t.db, &b).await.tally.invoiced, 0);
}

/// A cancel at the period's end made while the subscription is behind (two
/// ten-day periods ended, the tick not run since) ends it with the period
/// holding now, as the provider ends a subscription "at the end of the
/// current period": the two that ended are invoiced whole by the cancel, and
/// the subscription runs on to the end of the third (docs/adr/0096). Before,
/// the flag alone was set, and the tick's next closing of the oldest period
/// ended the subscription 15 days ago: ten days used, never invoiced.
/// Mutation `cape_behind_left` (the catch-up skipped) fails it; seen failing.
#[tokio::test]
async fn a_cancel_at_period_end_while_behind_ends_with_the_period_holding_now() {
    let t = TestDb::new().await;
    let sub = ten_day_subscription(&t.db, "tenant_a", 25).await;
    let (b, _) = biller(&t.db, config());
    b.cancel_subscription("tenant_a", sub, CancelAt::PeriodEnd)
        .await
        .unwrap();
    assert_eq!(tick(&t.db, &b).await.tally.invoiced, 0);
    let amounts: Vec<i64> = invoice_rows(&t.db).await.iter().map(|r| r.1).collect();
    assert_eq!(amounts, [1000, 1000]);
    let r = t
        .db
        .fetch_one(
            sql("SELECT status, cancel_at_period_end, \
                        current_period_end - now() BETWEEN interval '4 days' AND interval '6 days' AS five_days_on \
                 FROM subscriptions WHERE id = $1")
            .bind(sub),
        )
        .await
        .unwrap();
    assert_eq!(
        (
            r.get::<String, _>(0),
            r.get::<bool, _>(1),
            r.get::<bool, _>(2)
        ),
        ("active".into(), true, true)
    );
}

/// A change that changes nothing is not announced (docs/adr/0135; Stripe
/// sends `customer.subscription.updated` "whenever a subscription changes"):
/// a second cancel at the period's end, or the same pause again, writes
/// nothing and enqueues no event. A pause that differs (its resume time) is
/// written and announced. Before, each repeat announced the change again.
/// Mutations `repeat_cape_announced` and `same_pause_announced` fail it;
/// seen failing.
#[tokio::test]
async fn a_repeated_cancel_at_period_end_or_the_same_pause_announces_nothing() {
    let t = TestDb::new().await;
    let sub = ten_day_subscription(&t.db, "tenant_a", 5).await;
    let (b, _) = biller(&t.db, config());
    for _ in 0..2 {
        b.cancel_subscription("tenant_a", sub, CancelAt::PeriodEnd)
            .await
            .unwrap();
    }
    assert_eq!(event_types(&t.db).await, ["subscription.updated"]);
    let resumes = Utc::now() + TimeDelta::days(30);
    for (behavior, at) in [
        ("void", Some(resumes)),
        ("void", Some(resumes)),
        ("void", Some(resumes + TimeDelta::hours(1))),
    ] {
        let pause = crate::pause_through(&t.db, &b, sub, behavior, at).await;
        assert_eq!(pause.resumes_at, at.map(|t| t.trunc_subsecs(6)));
    }
    assert_eq!(
        event_types(&t.db).await,
        [
            "subscription.updated",
            "subscription.collection_paused",
            "subscription.collection_paused"
        ]
    );
}
