//! The payment reconciler against the fake provider: unknown outcomes settled
//! by key, charged once; provider outages end the tick as failed.

use std::time::Duration;

use billing::{BillingConfig, ProviderConfig, SecretKey};
use db::{Row, sql};
use fake_provider::{Behaviour, FakeProvider, TEST_SECRET_KEY};
use leader::TickEnd;
use testbed::TestDb;

use crate::{biller, config, open_invoices, strings, tick};

fn charging(p: &FakeProvider, timeout: Duration, lease: Duration) -> BillingConfig {
    BillingConfig {
        provider: Some(ProviderConfig {
            base_url: p.base_url(),
            secret_key: SecretKey::new(TEST_SECRET_KEY),
            timeout,
        }),
        charge_lease: lease,
        ..config()
    }
}

/// The reconciler's look at an unknown attempt whose invoice is closed while
/// the look is in flight: the stored charge answers paid, and the answer
/// goes to an operator's review, counted `needs_review` by the reconciler's
/// tally, never as lost (docs/adr/0147). A trigger, made after the first
/// tick, closes the invoice (uncollectible) as the reconciler's claim takes
/// it. Mutation `reconcile_reviewed_counted_lost` (the reconciler counts it
/// lost) fails here.
#[tokio::test]
async fn a_look_answered_after_its_invoice_closed_is_counted_for_review() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let open = open_invoices(&t.db, 1).await;
    let (invoice, customer) = open[0].clone();
    p.set_behaviour(&customer, Behaviour::Hang);
    let (b, _) = biller(
        &t.db,
        charging(&p, Duration::from_millis(300), Duration::from_secs(1)),
    );
    let first = tick(&t.db, &b).await;
    assert_eq!(first.charges.unknown, 1, "{first:?}");
    crate::close_invoices_as_claimed(&t).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let second = tick(&t.db, &b).await;
    assert_eq!(
        (
            second.reconciled.needs_review,
            second.reconciled.lost,
            second.reconciled.paid
        ),
        (1, 0, 0),
        "{second:?}"
    );
    assert_eq!(p.total_charges(), 1);
    assert_eq!(crate::invoice_status(&t.db, invoice).await, "uncollectible");
}

/// The provider charges and then hangs: the attempt is unknown, its claim
/// lease expires, and the reconciler asks the provider by key (the same
/// request, same key): the stored charge answers, the invoice is settled
/// paid with the same announcements as auto-charge, and the provider counted
/// exactly one charge.
#[tokio::test]
async fn a_provider_timeout_is_settled_by_key_and_charged_once() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let open = open_invoices(&t.db, 1).await;
    let (invoice, customer) = open[0].clone();
    p.set_behaviour(&customer, Behaviour::Hang);
    let (b, metrics) = biller(
        &t.db,
        charging(&p, Duration::from_millis(300), Duration::from_secs(1)),
    );
    let first = tick(&t.db, &b).await;
    assert_eq!(first.charges.unknown, 1, "{first:?}");
    // The claim still holds the invoice: the reconciler leaves it alone.
    assert_eq!(first.reconciled.paid, 0, "{first:?}");
    assert_eq!(p.total_charges(), 1);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let second = tick(&t.db, &b).await;
    assert_eq!(second.reconciled.paid, 1, "{second:?}");
    assert_eq!(p.total_charges(), 1);
    let rendered = metrics.render();
    assert!(
        rendered.contains(
            r#"hardcount_billing_reconciler_resolutions_total{sweep="unknown",outcome="paid"} 1"#
        ),
        "{rendered}"
    );
    let key = crate::attempt_key(&t.db, invoice, 1).await.unwrap();
    assert_eq!(p.charges().get(&key), Some(&1));
    assert_eq!(
        strings(&t.db, "SELECT status FROM invoices").await,
        vec!["paid"]
    );
    assert_eq!(
        strings(&t.db, "SELECT provider_status FROM payment_attempts").await,
        vec!["succeeded"]
    );
    assert_eq!(
        strings(
            &t.db,
            "SELECT event_type FROM webhook_events WHERE event_type <> 'invoice.finalized' ORDER BY id"
        )
        .await,
        vec!["invoice.paid", "payment.succeeded"]
    );
    assert_eq!(
        strings(&t.db, "SELECT subject FROM email_outbox").await,
        vec![format!("Receipt for invoice INV-{invoice:06}")]
    );
    // Settled: nothing more to reconcile, nothing charged again.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let third = tick(&t.db, &b).await;
    assert_eq!(third.reconciled, billing::ReconcileTally::default());
    assert_eq!(p.total_charges(), 1);
}

/// A 5xx charged nothing; once the provider is back, the reconciler's
/// lookup by key executes the charge, once. A lookup that is still unknown
/// is stamped, so it goes behind the attempts never checked.
#[tokio::test]
async fn a_5xx_is_charged_once_by_the_reconciler_when_the_provider_is_back() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let open = open_invoices(&t.db, 2).await;
    for (_, customer) in &open {
        p.set_behaviour(customer, Behaviour::ServerError(503));
    }
    let (b, _) = biller(
        &t.db,
        charging(&p, Duration::from_millis(300), Duration::from_secs(1)),
    );
    let first = tick(&t.db, &b).await;
    assert_eq!(first.charges.unknown, 2, "{first:?}");
    assert_eq!(p.total_charges(), 0);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // The first invoice's customer is still failing, the second's is back.
    p.set_behaviour(&open[1].1, Behaviour::Succeed);
    let second = tick(&t.db, &b).await;
    assert_eq!(
        (second.reconciled.paid, second.reconciled.still_unknown),
        (1, 1),
        "{second:?}"
    );
    assert_eq!(p.total_charges(), 1);
    let stamped: i64 =
        t.db.fetch_one(sql(
            "SELECT count(*) FROM payment_attempts WHERE last_checked_at IS NOT NULL",
        ))
        .await
        .unwrap()
        .get(0);
    assert_eq!(stamped, 2);
}

/// A provider outage (nothing listening: connection refused on every call)
/// ends the tick as failed, so the role retries after the short cooldown,
/// and each attempt is left unknown for the reconciler.
#[tokio::test]
async fn a_provider_outage_ends_the_tick_as_failed() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let config = charging(&p, Duration::from_millis(500), Duration::from_secs(1));
    drop(p);
    tokio::time::sleep(Duration::from_millis(50)).await;
    open_invoices(&t.db, 3).await;
    let (b, _) = biller(&t.db, config);
    let report = tick(&t.db, &b).await;
    assert!(matches!(report.end, TickEnd::Failed(_)), "{report:?}");
    assert_eq!(report.charges.unknown, 3, "{report:?}");
}

/// A batch charged concurrently: each invoice charged once, each settled.
#[tokio::test]
async fn a_batch_is_charged_concurrently_each_invoice_once() {
    let t = TestDb::with_pool(16).await;
    let p = FakeProvider::start().await.unwrap();
    open_invoices(&t.db, 60).await;
    let (b, metrics) = biller(
        &t.db,
        BillingConfig {
            charge_concurrency: 8,
            ..charging(&p, Duration::from_secs(5), Duration::from_secs(60))
        },
    );
    let report = tick(&t.db, &b).await;
    assert_eq!(report.charges.paid, 60, "{report:?}");
    let rendered = metrics.render();
    assert!(
        rendered.contains(r#"hardcount_billing_charges_total{outcome="succeeded"} 60"#),
        "{rendered}"
    );
    assert_eq!(p.total_charges(), 60);
    assert!(p.charges().values().all(|n| *n == 1));
    assert_eq!(
        strings(&t.db, "SELECT DISTINCT status FROM invoices").await,
        vec!["paid"]
    );
}

/// A claim that expired without an attempt (its holder died before the call)
/// is freed by the stale-hold sweep; the invoice is then charged once.
#[tokio::test]
async fn an_expired_claim_is_freed_and_the_invoice_charged_once() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    open_invoices(&t.db, 1).await;
    let (b, _) = biller(
        &t.db,
        charging(&p, Duration::from_millis(300), Duration::from_secs(1)),
    );
    let b2 = b.clone();
    let held = crate::as_leader(
        &crate::manager(&t.db, "dead"),
        leader::Role::Billing,
        |tick| async move { b2.claim_charges(&tick.fence, 10).await.unwrap() },
    )
    .await;
    assert_eq!(held.len(), 1);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // A tick without a provider runs only the stale-hold sweep of the reconciler.
    let (plain, _) = biller(&t.db, config());
    let report = tick(&t.db, &plain).await;
    assert_eq!(report.reconciled.holds_freed, 1, "{report:?}");
    let holders: Vec<Option<String>> =
        t.db.fetch_all(sql("SELECT auto_charge_claimed_by FROM invoices"))
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
    assert_eq!(holders, vec![None]);
    let charged = tick(&t.db, &b).await;
    assert_eq!(charged.charges.paid, 1, "{charged:?}");
    assert_eq!(p.total_charges(), 1);
}

/// A lookup the provider refuses as a reused key (the attempt predates
/// migration 0009 and the customer's card and provider id changed since, so
/// no intent of the customer carries the key and the resend differs) is not a
/// decline: the first request may have charged. The attempt needs review, the
/// invoice is flagged, and nothing is announced.
#[tokio::test]
async fn a_refused_lookup_is_not_taken_for_a_decline() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (b, _) = charged_then_hung(&t, &p).await;
    let mut su = t.superuser().await;
    // A customer moved to another provider id: a row from before migration
    // 0057, whose trigger now keeps a customer's id.
    sqlx::raw_sql(
        "UPDATE payment_attempts SET provider_customer_id = NULL, payment_method_id = NULL; \
         ALTER TABLE customers DISABLE TRIGGER customers_provider_customer_set_once; \
         UPDATE customers SET payment_method_id = 'pm_card_mastercard', \
                provider_customer_id = 'cus_moved'; \
         ALTER TABLE customers ENABLE TRIGGER customers_provider_customer_set_once",
    )
    .execute(&mut su)
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let report = tick(&t.db, &b).await;
    assert_eq!(
        (
            report.reconciled.still_unknown,
            report.reconciled.declined,
            report.reconciled.needs_review
        ),
        (0, 0, 1),
        "{report:?}"
    );
    in_review_charged_once(&t, &p, "idempotency_error").await;
}

/// One open invoice charged by a provider that then hangs: its attempt is
/// unknown after the tick, with one charge counted. The biller (a 300 ms
/// call timeout, a 1 s claim lease) and the invoice's provider customer.
async fn charged_then_hung(t: &TestDb, p: &FakeProvider) -> (billing::Biller, String) {
    let open = open_invoices(&t.db, 1).await;
    p.set_behaviour(&open[0].1, Behaviour::Hang);
    let (b, _) = biller(
        &t.db,
        charging(p, Duration::from_millis(300), Duration::from_secs(1)),
    );
    assert_eq!(tick(&t.db, &b).await.charges.unknown, 1);
    assert_eq!(p.total_charges(), 1);
    (b, open[0].1.clone())
}

/// The one attempt needs review with `why` in its error, its invoice is
/// flagged, nothing is announced, and the provider counted one charge.
async fn in_review_charged_once(t: &TestDb, p: &FakeProvider, why: &str) {
    let r =
        t.db.fetch_one(sql(
            "SELECT provider_status, last_error FROM payment_attempts",
        ))
        .await
        .unwrap();
    let (status, error): (String, Option<String>) = (r.get(0), r.get(1));
    assert_eq!(status, "needs_review");
    assert!(
        error.as_deref().unwrap_or_default().contains(why),
        "{error:?}"
    );
    assert_eq!(
        strings(
            &t.db,
            "SELECT (review_reason IS NOT NULL)::text FROM invoices"
        )
        .await,
        vec!["true"]
    );
    assert_eq!(
        strings(
            &t.db,
            "SELECT event_type FROM webhook_events WHERE event_type <> 'invoice.finalized'"
        )
        .await,
        Vec::<String>::new()
    );
    assert_eq!(p.total_charges(), 1);
}

/// The customer is deleted at the provider after a charge whose answer was
/// lost: the list of its intents is refused with 404 `resource_missing` on
/// `customer`. A refused read says nothing of the charge, so it is not a
/// decline (which would announce `payment.failed`, email the customer and hand
/// the invoice to dunning, whose retry would charge again under a new key):
/// the attempt needs review, the invoice is flagged, nothing is announced,
/// and the provider counted the one charge. Seen failing with the listing's
/// refusal passed on as `classify` reads it (docs/adr/0071; mutation
/// `lookup_refusal_declined`): declined, `payment.failed` announced.
#[tokio::test]
async fn a_listing_refused_for_a_deleted_customer_is_not_taken_for_a_decline() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (b, customer) = charged_then_hung(&t, &p).await;
    p.delete_customer(&customer);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let report = tick(&t.db, &b).await;
    assert_eq!(
        (
            report.reconciled.declined,
            report.reconciled.needs_review,
            report.reconciled.paid
        ),
        (0, 1, 0),
        "{report:?}"
    );
    in_review_charged_once(&t, &p, "resource_missing").await;
}

/// A look that sends nothing leaves a never-sent attempt never sent
/// (docs/adr/0081). The key is rolled: auto-charge's 401 leaves attempt 1
/// unknown and never sent; the reconciler's look at it is refused too (401).
/// Its claim had stamped `first_sent_at`; the stamp is taken back. Then the
/// tenant pauses collection and the key is mended: the attempt, still never
/// sent, follows auto-charge's rule (docs/adr/0071) and the paused invoice
/// is not charged. Before, the stamp stayed, the rule was skipped, and the
/// reconciler sent the charge into the pause.
/// Mutation: `reconcile_never_sent_kept` (the reconciler's first send taken
/// as false again) charges the paused invoice; seen failing here.
#[tokio::test]
async fn a_look_refused_leaves_a_never_sent_attempt_to_the_chargeable_rule() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let open = open_invoices(&t.db, 1).await;
    p.roll_secret_key("sk_test_rolled_elsewhere");
    let (b, _) = biller(
        &t.db,
        charging(&p, Duration::from_millis(300), Duration::from_secs(1)),
    );
    let first_sent = || async {
        t.db.fetch_one(sql(
            "SELECT first_sent_at IS NULL AS never FROM payment_attempts",
        ))
        .await
        .unwrap()
        .get::<bool, _>("never")
    };
    assert!(matches!(tick(&t.db, &b).await.end, TickEnd::Failed(_)));
    assert!(first_sent().await, "auto-charge's 401 sent nothing");
    assert!(matches!(tick(&t.db, &b).await.end, TickEnd::Failed(_)));
    assert!(
        first_sent().await,
        "the reconciler's 401 sent nothing either"
    );
    sqlx::query("UPDATE subscriptions SET pause_collection_behavior = 'keep_as_draft'")
        .execute(&mut t.superuser().await)
        .await
        .unwrap();
    p.roll_secret_key(TEST_SECRET_KEY);
    let report = tick(&t.db, &b).await;
    assert_eq!(
        (p.create_requests(), p.total_charges()),
        (0, 0),
        "{report:?}"
    );
    assert_eq!(
        strings(&t.db, "SELECT status FROM invoices").await,
        ["open"],
        "{open:?}"
    );
}

/// An attempt recorded and never sent (here the provider refused the key, so
/// no request of it executed), after which the customer replaced the card:
/// the reconciler sends it with the customer's card as it is now, and the
/// attempt records that card. Before, it was sent with the card recorded at
/// its start, one the customer had replaced (docs/adr/0113).
///
/// Mutation check: `unsent_old_card` (the never-sent attempt sent with the
/// card it recorded) charges the replaced card; seen failing.
#[tokio::test]
async fn an_attempt_never_sent_is_sent_with_the_customers_card_as_it_is_now() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    open_invoices(&t.db, 1).await;
    p.roll_secret_key("sk_test_rolled_elsewhere");
    let (b, _) = biller(
        &t.db,
        charging(&p, Duration::from_secs(5), Duration::from_secs(60)),
    );
    tick(&t.db, &b).await;
    assert_eq!(p.unauthorized_requests(), 1);
    let recorded = "SELECT payment_method_id || ':' || (first_sent_at IS NULL)::text \
                    FROM payment_attempts";
    assert_eq!(strings(&t.db, recorded).await, ["pm_card_visa:true"]);
    sqlx::query("UPDATE customers SET payment_method_id = 'pm_card_mastercard'")
        .execute(&mut t.superuser().await)
        .await
        .unwrap();
    p.roll_secret_key(TEST_SECRET_KEY);
    tick(&t.db, &b).await;
    let sent: Vec<String> = p
        .intents()
        .iter()
        .map(|i| i.payment_method.clone())
        .collect();
    assert_eq!(sent, ["pm_card_mastercard"]);
    assert_eq!(strings(&t.db, recorded).await, ["pm_card_mastercard:false"]);
    assert_eq!(
        strings(&t.db, "SELECT status FROM invoices").await,
        ["paid"]
    );
}
