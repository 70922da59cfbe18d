//! Auto-charge against the fake provider over real HTTP: one charge per
//! invoice, its settlement and announcements, declines, unknown outcomes, and
//! a stale leader racing the new one on the same invoice.

use std::time::Duration;

use billing::{Charged, ProviderConfig, SecretKey};
use db::{Db, Row, sql};
use fake_provider::{Behaviour, FakeProvider, TEST_SECRET_KEY};
use leader::Role;
use testbed::TestDb;

use crate::{
    as_leader, biller, charging, config, due_monthly, invoice_status, manager, strings, tick,
};

/// One open automatic invoice of 1200 EUR (billed by a tick without a
/// provider), and its customer's `cus_…`.
async fn open_invoice(db: &Db) -> (i64, String) {
    due_monthly(db, "tenant_a", 1).await;
    let (b, _) = biller(db, config());
    assert_eq!(tick(db, &b).await.tally.invoiced, 1);
    let r = db
        .fetch_one(sql("SELECT i.id, c.provider_customer_id FROM invoices i \
             JOIN subscriptions s ON s.id = i.subscription_id \
             JOIN customers c ON c.id = s.customer_id"))
        .await
        .unwrap();
    (r.get("id"), r.get("provider_customer_id"))
}

async fn events(db: &Db) -> Vec<String> {
    strings(
        db,
        "SELECT event_type FROM webhook_events WHERE event_type <> 'invoice.finalized' ORDER BY id",
    )
    .await
}

async fn emails(db: &Db) -> Vec<String> {
    strings(db, "SELECT subject FROM email_outbox ORDER BY id").await
}

/// (status, decline code, idempotency key) of each attempt.
async fn attempts(db: &Db) -> Vec<(String, Option<String>, String)> {
    db.fetch_all(sql(
        "SELECT provider_status, decline_code, idempotency_key FROM payment_attempts ORDER BY id",
    ))
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

#[tokio::test]
async fn a_paid_invoice_is_charged_once_announced_and_receipted() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (invoice, _) = open_invoice(&t.db).await;
    let (b, _) = biller(&t.db, charging(&p, Duration::from_secs(5)));
    let report = tick(&t.db, &b).await;
    assert_eq!(report.charges.paid, 1, "{report:?}");
    assert_eq!(p.total_charges(), 1);
    let key = crate::attempt_key(&t.db, invoice, 1).await.unwrap();
    // The key the attempt's INSERT computed is the one the client documents.
    let created = testbed::payments::invoice_created_micros(&t.db, invoice).await;
    assert_eq!(
        key,
        billing::provider::idempotency_key("default", invoice, created, 1)
    );
    assert_eq!(p.charges().get(&key), Some(&1));
    assert_eq!(invoice_status(&t.db, invoice).await, "paid");
    assert_eq!(attempts(&t.db).await, vec![("succeeded".into(), None, key)]);
    assert_eq!(
        events(&t.db).await,
        vec!["invoice.paid", "payment.succeeded"]
    );
    assert_eq!(
        emails(&t.db).await,
        vec![format!("Receipt for invoice INV-{invoice:06}")]
    );
    // A paid invoice is never claimed again.
    let again = tick(&t.db, &b).await;
    assert_eq!((again.charge_claimed, p.total_charges()), (0, 1));
}

/// A decline Stripe's table says not to report to the customer
/// (`fraudulent`, `stolen_card`, ...; https://docs.stripe.com/declines/codes)
/// is emailed as `generic_decline`; the attempt and the tenant's event keep
/// the code (docs/adr/0141). Mutation `customer_sees_fraud_code` (the code
/// emailed as it is) fails here.
#[tokio::test]
async fn a_fraud_decline_is_emailed_to_the_customer_as_a_generic_decline() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (_, customer) = open_invoice(&t.db).await;
    p.set_behaviour(&customer, Behaviour::Decline("fraudulent".into()));
    let (b, _) = biller(&t.db, charging(&p, Duration::from_secs(5)));
    assert_eq!(tick(&t.db, &b).await.charges.declined, 1);
    let texts = strings(&t.db, "SELECT text_body FROM email_outbox").await;
    assert_eq!(texts.len(), 1, "{texts:?}");
    assert!(texts[0].contains("(generic_decline)"), "{texts:?}");
    assert!(!texts[0].contains("fraudulent"), "{texts:?}");
    let a = attempts(&t.db).await;
    assert_eq!(a[0].1.as_deref(), Some("fraudulent"));
    let payloads = strings(
        &t.db,
        "SELECT payload::text FROM webhook_events WHERE event_type = 'payment.failed'",
    )
    .await;
    assert!(
        payloads[0].contains("\"decline_code\": \"fraudulent\""),
        "{payloads:?}"
    );
}

#[tokio::test]
async fn a_decline_is_recorded_with_its_code_announced_and_emailed() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (invoice, customer) = open_invoice(&t.db).await;
    p.set_behaviour(&customer, Behaviour::Decline("insufficient_funds".into()));
    let (b, _) = biller(&t.db, charging(&p, Duration::from_secs(5)));
    let report = tick(&t.db, &b).await;
    assert_eq!(report.charges.declined, 1, "{report:?}");
    assert_eq!(p.total_charges(), 0);
    assert_eq!(invoice_status(&t.db, invoice).await, "open");
    let a = attempts(&t.db).await;
    assert_eq!(
        (a[0].0.as_str(), a[0].1.as_deref()),
        ("declined", Some("insufficient_funds"))
    );
    assert_eq!(events(&t.db).await, vec!["payment.failed"]);
    assert_eq!(
        emails(&t.db).await,
        vec![format!("Your payment for invoice INV-{invoice:06} failed")]
    );
    // Declined once: auto-charge does not retry it (dunning will).
    assert_eq!(tick(&t.db, &b).await.charge_claimed, 0);
    // The invoice counts its attempts, as the provider's invoice does
    // (`attempt_count`): the first charge's, then a dunning retry's, each
    // raised by the statement that writes the attempt (docs/adr/0050).
    assert_eq!(attempt_count(&t.db, invoice).await, 1);
    let mut tx = t.db.begin().await.unwrap();
    let retry = billing::RetryRequest {
        invoice_id: invoice,
        claimed_by: "dunning:test".into(),
    };
    let started = b.start_retries_in(&mut tx, &[retry]).await.unwrap();
    tx.commit().await.unwrap();
    assert!(started[0].is_ok(), "{started:?}");
    assert_eq!(attempt_count(&t.db, invoice).await, 2);
}

/// A first charge declined `authentication_required` (only the customer can
/// authenticate it: https://docs.stripe.com/declines/codes) emails a link to
/// the tenant's payment page, its `{invoice}` filled with the invoice's id,
/// and asks for the step that page is for: the card added again,
/// authenticated there, or another (docs/adr/0150). The page is read
/// by the settle only for such declines. Without a page the email asks for
/// another payment method and never to "confirm" anything
/// (`an_authentication_decline_without_a_page_asks_for_another_method`,
/// below). Mutation `payment_page_unread` (the settle reads no page) fails
/// here.
#[tokio::test]
async fn a_declined_charge_links_the_tenants_payment_page() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (invoice, customer) = open_invoice(&t.db).await;
    p.set_behaviour(
        &customer,
        Behaviour::Decline("authentication_required".into()),
    );
    let page = "https://pay.acme.example/i/{invoice}?via=mail";
    testbed::payments::set_payment_page(&t, "tenant_a", page).await;
    let (b, _) = biller(&t.db, charging(&p, Duration::from_secs(5)));
    assert_eq!(tick(&t.db, &b).await.charges.declined, 1);
    let texts = strings(&t.db, "SELECT text_body FROM email_outbox").await;
    assert_eq!(texts.len(), 1, "{texts:?}");
    assert!(
        texts[0].ends_with(&format!(
            "which only you can do: add it again on the page below, authenticating it there, \
             or add another payment method, and we will charge it.\n\nAdd or update your \
             payment method here: https://pay.acme.example/i/{invoice}?via=mail\n"
        )),
        "{texts:?}"
    );
}

#[tokio::test]
async fn an_authentication_decline_without_a_page_asks_for_another_method() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (_, customer) = open_invoice(&t.db).await;
    p.set_behaviour(
        &customer,
        Behaviour::Decline("authentication_required".into()),
    );
    let (b, _) = biller(&t.db, charging(&p, Duration::from_secs(5)));
    assert_eq!(tick(&t.db, &b).await.charges.declined, 1);
    let texts = strings(&t.db, "SELECT text_body FROM email_outbox").await;
    assert_eq!(texts.len(), 1, "{texts:?}");
    assert!(
        texts[0].ends_with(
            "which only you can do, so we will not charge this card for it again: please \
             add another payment method, and we will charge it.\n"
        ),
        "{texts:?}"
    );
    assert!(!texts[0].contains("confirm"), "{texts:?}");
}

/// A charge whose invoice is closed while its call is in flight is paid at
/// the provider, and its answer goes to an operator's review; auto-charge's
/// tally counts it `needs_review`, never as a claim lost (docs/adr/0147).
/// A trigger closes the invoice (uncollectible) as the claim takes it, so
/// the call is made on an invoice that is no longer open. Mutation
/// `charge_reviewed_counted_lost` (auto-charge counts it a lost claim) fails
/// here.
#[tokio::test]
async fn a_charge_answered_after_its_invoice_closed_is_counted_for_review() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (invoice, _) = open_invoice(&t.db).await;
    crate::close_invoices_as_claimed(&t).await;
    let (b, _) = biller(&t.db, charging(&p, Duration::from_secs(5)));
    let report = tick(&t.db, &b).await;
    assert_eq!(
        (
            report.charges.needs_review,
            report.charges.claim_lost,
            report.charges.paid
        ),
        (1, 0, 0),
        "{report:?}"
    );
    assert_eq!(p.total_charges(), 1);
    assert_eq!(attempts(&t.db).await[0].0, "needs_review");
    assert_eq!(invoice_status(&t.db, invoice).await, "uncollectible");
}

async fn attempt_count(db: &Db, invoice: i64) -> i32 {
    db.fetch_one(sql("SELECT attempt_count FROM invoices WHERE id = $1").bind(invoice))
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn a_provider_that_times_out_leaves_the_attempt_unknown_and_the_invoice_open_charged_once() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (invoice, customer) = open_invoice(&t.db).await;
    p.set_behaviour(&customer, Behaviour::Hang);
    let (b, _) = biller(&t.db, charging(&p, Duration::from_millis(300)));
    let report = tick(&t.db, &b).await;
    assert_eq!(report.charges.unknown, 1, "{report:?}");
    assert_eq!(invoice_status(&t.db, invoice).await, "open");
    let a = attempts(&t.db).await;
    assert_eq!((a.len(), a[0].0.as_str()), (1, "unknown"));
    assert_eq!(p.total_charges(), 1);
    assert_eq!(events(&t.db).await, Vec::<String>::new());
    assert_eq!(emails(&t.db).await, Vec::<String>::new());
    // The attempt exists: auto-charge leaves it to the reconciler.
    assert_eq!(tick(&t.db, &b).await.charge_claimed, 0);
    assert_eq!(p.total_charges(), 1);
}

#[tokio::test]
async fn a_5xx_leaves_the_attempt_unknown_and_charges_nothing() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (invoice, customer) = open_invoice(&t.db).await;
    p.set_behaviour(&customer, Behaviour::ServerError(500));
    let (b, _) = biller(&t.db, charging(&p, Duration::from_secs(5)));
    let report = tick(&t.db, &b).await;
    assert_eq!(report.charges.unknown, 1, "{report:?}");
    assert_eq!(invoice_status(&t.db, invoice).await, "open");
    assert_eq!(attempts(&t.db).await[0].0, "unknown");
    assert_eq!(p.total_charges(), 0);
}

/// The old leader claimed the invoice before a takeover and charges it from
/// that claim after the new leader's tick ran: the new leader leaves the
/// claimed invoice alone, and the provider charged it once. (Run with the
/// charge spawned concurrently, the old charge usually writes its attempt
/// first and the no-attempt predicate alone hides the invoice, so the lease
/// would go untested: the order here is the one only the lease covers.)
///
/// Mutation check: removing the lease predicate
/// (`AND (i.auto_charge_claimed_until IS NULL OR …)`) from
/// `store::claim_charges` lets the new leader claim and charge the invoice
/// the old one holds; this test was run against that mutation and failed.
#[tokio::test]
async fn a_stale_leader_and_the_new_leader_charging_one_invoice_charge_it_once() {
    let t = TestDb::with_pool(8).await;
    let p = FakeProvider::start().await.unwrap();
    let (invoice, _) = open_invoice(&t.db).await;
    let (b, _) = biller(&t.db, charging(&p, Duration::from_secs(5)));
    let b2 = b.clone();
    let (old_fence, held) = as_leader(&manager(&t.db, "old"), Role::Billing, |tick| async move {
        let held = b2.claim_charges(&tick.fence, 10).await.unwrap();
        (tick.fence, held)
    })
    .await;
    assert_eq!(held.len(), 1);
    // The new leader's whole tick runs while the old claim is held and its
    // charge not yet made (the old leader is paused mid-tick, say); then
    // the old leader goes on with the charge it claimed.
    let new = tick(&t.db, &b).await;
    let old = b.charge(&held[0]).await.unwrap();
    assert!(matches!(old, Charged::Paid { .. }), "{old:?}");
    assert_eq!((new.charge_claimed, new.charges.paid), (0, 0), "{new:?}");
    // The replaced leader's fence claims nothing more.
    assert!(b.claim_charges(&old_fence, 10).await.unwrap().is_empty());
    assert_eq!(p.total_charges(), 1);
    // The single path's attempt (`START_ATTEMPTS`) is keyed as the client
    // documents, as the batch path's is (above).
    let created = testbed::payments::invoice_created_micros(&t.db, invoice).await;
    assert_eq!(
        crate::attempt_key(&t.db, invoice, 1).await.unwrap(),
        billing::provider::idempotency_key("default", invoice, created, 1)
    );
    assert_eq!(invoice_status(&t.db, invoice).await, "paid");
    assert_eq!(
        events(&t.db).await,
        vec!["invoice.paid", "payment.succeeded"]
    );
    assert_eq!(emails(&t.db).await.len(), 1);
}

/// The same idempotency key with another amount is refused by the provider
/// and charges nothing, as Stripe refuses it; the refusal is read as "needs
/// review" (the first request may have charged), never as a decline.
#[tokio::test]
async fn the_same_key_with_another_amount_is_refused_by_the_provider() {
    let p = FakeProvider::start().await.unwrap();
    let provider = billing::Provider::new(ProviderConfig::new(
        p.base_url(),
        SecretKey::new(TEST_SECRET_KEY),
    ))
    .unwrap();
    let mut req = billing::provider::PaymentRequest {
        invoice_id: 42,
        amount: 1200,
        currency: "EUR".into(),
        customer: "cus_ada".into(),
        payment_method: "pm_card_visa".into(),
        key: billing::provider::idempotency_key("test", 42, 1, 1),
    };
    let first = provider.create_payment_intent(&req).await;
    assert!(
        matches!(first, billing::ChargeOutcome::Succeeded { .. }),
        "{first:?}"
    );
    assert_eq!(provider.create_payment_intent(&req).await, first);
    req.amount = 1300;
    let other = provider.create_payment_intent(&req).await;
    assert!(
        matches!(other, billing::ChargeOutcome::NeedsReview { ref reason, .. } if reason.contains("idempotency_error")),
        "{other:?}"
    );
    assert_eq!(p.total_charges(), 1);
}

/// A leader replaced by a takeover claims no invoice to charge with its old
/// token, while the new leader's funnel claims it.
///
/// Mutation check: removing `AND leader_fence($1, $2)` from
/// `store::claim_charges` lets the old token claim the invoice; this test was
/// run against that mutation and failed.
#[tokio::test]
async fn a_stale_token_claims_no_invoice_to_charge() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    open_invoice(&t.db).await;
    let (b, _) = biller(&t.db, charging(&p, Duration::from_secs(5)));
    let old = as_leader(&manager(&t.db, "old"), Role::Billing, |tick| async move {
        tick.fence
    })
    .await;
    let (by_old, by_new) = as_leader(&manager(&t.db, "new"), Role::Billing, |tick| async move {
        let by_old = b.claim_charges(&old, 10).await.unwrap().len();
        let by_new = b.claim_charges(&tick.fence, 10).await.unwrap().len();
        (by_old, by_new)
    })
    .await;
    assert_eq!((by_old, by_new), (0, 1));
    assert_eq!(p.total_charges(), 0);
}
