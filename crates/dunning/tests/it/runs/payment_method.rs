//! A customer without a payment method that can be charged: a hard decline
//! waits for a new one; a run without one is counted on the policy's schedule
//! to its final action, unless a pause holds it; adding one resumes charging.

use db::sql;
use fake_provider::{Behaviour, FakeProvider};
use leader::Role;
use testbed::TestDb;

use super::CALL;
use crate::{config, declined_invoice, dunner, events, invoice_status, policy, run_of, tick};

/// A hard decline (`stolen_card`) is not retried on the same card: while the
/// customer's payment method is unchanged, each due retry is counted without
/// a provider call (`dunning.retry_skipped`, no `payment.failed`), on the
/// policy's schedule; once the payment method changes, the next due retry
/// charges it. The payment-failed email asks for a new payment method.
///
/// Mutation check: `held_declines` (drop the held-decline clause from
/// `listing::list_due`) and the second tick charges the stolen card again;
/// seen failing under it.
#[tokio::test]
async fn a_hard_decline_waits_for_a_new_payment_method() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 4, "cancel_subscription").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(&a.customer, Behaviour::Decline("stolen_card".into()));
    let (d, _) = dunner(&t.db, &p, CALL, config());
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.declined, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 1));
    let asked: Vec<String> =
        crate::strings(&t.db, "SELECT text_body FROM email_outbox ORDER BY id").await;
    // The policy's warning is the retry's one email, and asks for a new
    // card (docs/adr/0114).
    assert_eq!(asked.len(), 1, "{asked:?}");
    assert!(asked[0].contains("new payment method"), "{asked:?}");
    p.set_behaviour(&a.customer, Behaviour::Succeed);
    crate::due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.not_attempted, 1, "{r:?}");
    assert_eq!(r.tally.recovered + r.tally.declined, 0, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 2));
    assert_eq!(p.create_requests(), 1);
    assert_eq!(crate::payment_failed(&t.db).await, 1);
    // Retry 3 the policy's gap (60 s) after retry 2, counted an hour late.
    let next = crate::next_retry_in(&t.db, a.invoice).await;
    assert!((55.0..=60.0).contains(&next), "{next}");
    assert_eq!(
        events(&t.db).await,
        [
            "dunning.started",
            "dunning.attempt_failed",
            "dunning.retry_skipped"
        ]
    );
    t.api_as("tenant_a")
        .execute(
            sql(
                "UPDATE customers SET payment_method_id = 'pm_card_mastercard' \
             WHERE provider_customer_id = $1",
            )
            .bind(a.customer.clone()),
        )
        .await
        .unwrap();
    crate::due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.recovered, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("recovered".to_owned(), 3));
    assert_eq!(invoice_status(&t.db, a.invoice).await, "paid");
    assert_eq!(p.create_requests(), 2);
}

/// A customer without a payment method: each due retry is counted without a
/// provider call, the next one scheduled by the policy (60 s × n after the
/// first decline, or the gap after the one before when that has passed:
/// docs/adr/0092), the warning asks for a payment method, and the last one
/// exhausts the run: the invoice is written off, announced, and the final
/// notice says so. Nothing is sent to the provider, no `payment.failed`.
///
/// Mutation check: `dunning_no_payment_method` (the listing no longer marks
/// a run without a payment method as not chargeable) sends the run to
/// billing, which holds it, and the run never moves; seen failing under it.
#[tokio::test]
async fn a_run_without_a_payment_method_reaches_its_final_action_on_schedule() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 2, "mark_uncollectible").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    crate::remove_payment_method(&t.db, &a.customer).await;
    let (d, metrics) = dunner(&t.db, &p, CALL, config());
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.not_attempted, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 1));
    let next = crate::next_retry_in(&t.db, a.invoice).await;
    assert!((55.0..=60.0).contains(&next), "{next}");
    crate::due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.exhausted, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("exhausted".to_owned(), 2));
    assert_eq!(invoice_status(&t.db, a.invoice).await, "uncollectible");
    assert_eq!(tick(&t.db, &d).await.claimed, 0);
    assert_eq!(p.create_requests(), 0);
    assert_eq!(crate::payment_failed(&t.db).await, 0);
    assert_eq!(
        events(&t.db).await,
        [
            "dunning.started",
            "dunning.retry_skipped",
            "dunning.exhausted",
            "invoice.marked_uncollectible"
        ]
    );
    let bodies = crate::strings(
        &t.db,
        "SELECT subject || ': ' || text_body FROM email_outbox ORDER BY id",
    )
    .await;
    assert_eq!(bodies.len(), 2, "{bodies:?}");
    assert!(
        bodies[0].contains("needs a new payment method")
            && bodies[0].contains("no payment method on your account"),
        "{bodies:?}"
    );
    assert!(
        bodies[1].starts_with(&format!("Final notice for invoice {}", a.invoice))
            && bodies[1].contains("marked it uncollectible"),
        "{bodies:?}"
    );
    let rendered = metrics.render();
    assert!(
        rendered.contains("hardcount_dunning_attempts_total{outcome=\"not_attempted\"} 2"),
        "{rendered}"
    );
}

/// A customer without a payment method whose subscription's collection is
/// paused (by an operator, resuming tomorrow): the pause stops the schedule
/// as it stops charges. Nothing is counted or sent while it holds.
///
/// Mutation check: `dunning_not_attempted_paused` (the listing marks a paused
/// run as not chargeable) counts its retry; seen failing under it.
#[tokio::test]
async fn a_pause_in_force_holds_a_run_without_a_payment_method() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 2, "mark_uncollectible").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    crate::remove_payment_method(&t.db, &a.customer).await;
    t.db.execute(
        sql(
            "UPDATE subscriptions SET pause_collection_behavior = 'keep_as_draft', \
                    pause_collection_resumes_at = now() + interval '1 day', \
                    pause_collection_set_by = 'operator' WHERE id = $1",
        )
        .bind(a.subscription),
    )
    .await
    .unwrap();
    let (d, _) = dunner(&t.db, &p, CALL, config());
    for _ in 0..2 {
        let r = tick(&t.db, &d).await;
        assert_eq!(r.tally.not_attempted + r.tally.exhausted, 0, "{r:?}");
    }
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 0));
    assert_eq!(invoice_status(&t.db, a.invoice).await, "open");
    assert_eq!(p.create_requests(), 0);
    assert_eq!(events(&t.db).await, ["dunning.started"]);
}

/// A customer without a payment method adds one: a retry from a listing made
/// before (which saw no payment method) writes nothing, and the next tick
/// charges the new one and recovers the run; one charge.
///
/// Mutation check: `dunning_not_attempted_payment_method` (the count of a
/// retry not attempted no longer proves the payment method as listed) counts
/// the stale retry as not attempted; seen failing under it.
#[tokio::test]
async fn adding_a_payment_method_resumes_charging() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 3, "pause_collection").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    crate::remove_payment_method(&t.db, &a.customer).await;
    let (d, _) = dunner(&t.db, &p, CALL, config());
    assert_eq!(tick(&t.db, &d).await.tally.not_attempted, 1);
    crate::due_now(&t.db).await;
    let d2 = d.clone();
    let listed = crate::as_leader(
        &crate::manager(&t.db, "lister"),
        Role::Dunning,
        |tick| async move { d2.list_due(&tick.fence, 10).await.unwrap() },
    )
    .await;
    assert_eq!(listed.len(), 1);
    assert_eq!(
        listed[0].not_chargeable,
        Some(dunning::NotChargeable::NoPaymentMethod)
    );
    t.api_as("tenant_a").execute(
        sql("UPDATE customers SET payment_method_id = 'pm_card_visa' WHERE provider_customer_id = $1")
            .bind(a.customer.clone()),
    )
    .await
    .unwrap();
    assert_eq!(d.retry(&listed[0]).await.unwrap(), dunning::Retry::Lost);
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 1));
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.recovered, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("recovered".to_owned(), 2));
    assert_eq!(invoice_status(&t.db, a.invoice).await, "paid");
    assert_eq!(p.total_charges(), 1);
}
