//! Enrolment and retries: each declined invoice enrolled once and announced
//! under its own tenant, retries declined until recovered, a run whose
//! invoice was paid elsewhere, retry batches in flight together, and the
//! sender of dunning mail.

use std::time::Duration;

use db::{Row, sql};
use dunning::DunningConfig;
use fake_provider::{Behaviour, FakeProvider};
use leader::Role;
use testbed::TestDb;

use super::CALL;
use crate::{
    config, declined_invoice, dunner, dunning_emails, events, invoice_status, policy, run_of, tick,
};

/// Dunning keeps three retry batches in flight (docs/adr/0054): a batch's
/// calls and settle run while the next batches are listed. Each run is
/// still retried once, the tick counts every batch before it ends, and the
/// batches together make no more calls at once than `concurrency`.
///
/// Mutations: the calls taking no permit (`call_permits_dunning`: 9 at once)
/// and `finish` waiting for nothing (`dunning_finish`) were seen failing it.
/// Not pinned: the listing leaving out the runs of the batches in flight.
/// With it removed this test still passed three times (a batch's first
/// transaction commits before the next listing reads, here); a run listed
/// twice would lose its compare-and-set on the attempt count and be counted
/// lost, never charged twice.
#[tokio::test]
async fn overlapping_retry_batches_retry_each_run_once_within_the_call_bound() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    // Slow enough that the batches overlap.
    p.set_latency(Duration::from_millis(30));
    policy(&t.db, "tenant_a", 2, "cancel_subscription").await;
    let mut invoices = Vec::new();
    for _ in 0..24 {
        invoices.push(declined_invoice(&t.db, "tenant_a").await.invoice);
    }
    let (d, _) = dunner(
        &t.db,
        &p,
        CALL,
        DunningConfig {
            batch_size: 4,
            concurrency: 2,
            ..config()
        },
    );
    let r = tick(&t.db, &d).await;
    assert_eq!((r.tally.recovered, r.tally.lost), (24, 0), "{r:?}");
    assert_eq!(p.total_charges(), 24);
    for invoice in invoices {
        assert_eq!(run_of(&t.db, invoice).await, ("recovered".to_owned(), 1));
    }
    assert_eq!(p.most_at_once(), 2, "calls at once across the batches");
}

/// A tenant without a policy gets the built-in default at its first
/// enrolment; each invoice is enrolled once, however many ticks see it.
#[tokio::test]
async fn enrolment_takes_each_declined_invoice_once_with_the_built_in_default() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let a = declined_invoice(&t.db, "tenant_a").await;
    let (d, _) = dunner(&t.db, &p, CALL, config());
    assert_eq!(tick(&t.db, &d).await.enrolled, 1);
    assert_eq!(tick(&t.db, &d).await.enrolled, 0);
    let r =
        t.db.fetch_one(
            sql(
                "SELECT p.retry_offsets_secs, p.final_action, r.next_attempt_at > now() AS later \
                 FROM dunning_runs r JOIN dunning_policies p ON p.id = r.policy_id \
                 WHERE r.invoice_id = $1",
            )
            .bind(a.invoice),
        )
        .await
        .unwrap();
    let offsets: Vec<i64> = r.get("retry_offsets_secs");
    assert_eq!(offsets, dunning::policy::DEFAULT_OFFSETS_SECS.to_vec());
    assert_eq!(r.get::<String, _>("final_action"), "mark_uncollectible");
    // The first retry is a day after the decline: not yet.
    assert!(r.get::<bool, _>("later"));
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 0));
    assert_eq!(events(&t.db).await, ["dunning.started"]);
    assert_eq!(p.total_charges(), 0);
}

/// Runs of two tenants enrolled in one tick: each gets one `dunning.started`,
/// under its own tenant and naming its own run and invoice, though the batch's
/// events are written by one statement.
#[tokio::test]
async fn one_enrolment_announces_each_run_under_its_own_tenant() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let mut invoices = Vec::new();
    for tenant in ["tenant_a", "tenant_b", "tenant_a"] {
        invoices.push(declined_invoice(&t.db, tenant).await.invoice);
    }
    let (d, _) = dunner(&t.db, &p, CALL, config());
    assert_eq!(tick(&t.db, &d).await.enrolled, 3);
    let rows =
        t.db.fetch_all(sql("SELECT r.invoice_id, \
                    count(e.id) AS announced, \
                    bool_and(e.tenant_id = r.tenant_id \
                             AND (e.payload->>'id')::bigint = r.id \
                             AND (e.payload->>'invoice')::bigint = r.invoice_id) AS its_own \
             FROM dunning_runs r \
             LEFT JOIN webhook_events e ON e.event_type = 'dunning.started' \
                                       AND (e.payload->>'id')::bigint = r.id \
             GROUP BY r.id ORDER BY r.invoice_id"))
            .await
            .unwrap();
    let seen: Vec<(i64, i64, bool)> = rows
        .iter()
        .map(|r| (r.get("invoice_id"), r.get("announced"), r.get("its_own")))
        .collect();
    invoices.sort_unstable();
    let want: Vec<(i64, i64, bool)> = invoices.iter().map(|&i| (i, 1, true)).collect();
    assert_eq!(seen, want);
    assert_eq!(events(&t.db).await.len(), 3);
}

/// Declined, declined, then paid: recovered after the third retry, the
/// invoice paid once, each attempt charged once under its own key, the
/// subscription still active.
#[tokio::test]
async fn decline_decline_success_recovers_after_the_third_retry() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 4, "cancel_subscription").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(&a.customer, Behaviour::Decline("insufficient_funds".into()));
    let (d, metrics) = dunner(&t.db, &p, CALL, config());
    for expected in 1..=2 {
        let r = tick(&t.db, &d).await;
        assert_eq!(r.tally.declined, 1, "{r:?}");
        assert_eq!(
            run_of(&t.db, a.invoice).await,
            ("active".to_owned(), expected)
        );
        // The next retry is a minute on (the policy's gap); made due now.
        crate::due_now(&t.db).await;
    }
    p.set_behaviour(&a.customer, Behaviour::Succeed);
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.recovered, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("recovered".to_owned(), 3));
    assert_eq!(invoice_status(&t.db, a.invoice).await, "paid");
    // One request per retry, each under its own key; money moved once.
    let declined = |seq: i32| (seq, "declined".to_owned());
    assert_eq!(
        crate::attempts(&t.db, a.invoice).await,
        [
            declined(1),
            declined(2),
            declined(3),
            (4, "succeeded".to_owned())
        ]
    );
    // Each retry's key, written by `START_RETRIES`, is the one the client
    // documents.
    let created = testbed::payments::invoice_created_micros(&t.db, a.invoice).await;
    for seq in 2..=4 {
        let key = crate::attempt_key(&t.db, a.invoice, seq).await.unwrap();
        assert!(p.has_result(&key), "{key}");
        assert_eq!(
            key,
            billing::provider::idempotency_key("default", a.invoice, created, seq)
        );
    }
    let charges = p.charges();
    assert_eq!(p.total_charges(), 1, "{charges:?}");
    assert_eq!(
        charges.get(&crate::attempt_key(&t.db, a.invoice, 4).await.unwrap()),
        Some(&1)
    );
    let paid: i64 =
        t.db.fetch_one(sql(
            "SELECT count(*) AS n FROM webhook_events WHERE event_type = 'invoice.paid'",
        ))
        .await
        .unwrap()
        .get("n");
    assert_eq!(paid, 1);
    let sub: String =
        t.db.fetch_one(sql("SELECT status FROM subscriptions WHERE id = $1").bind(a.subscription))
            .await
            .unwrap()
            .get("status");
    assert_eq!(sub, "active");
    assert_eq!(
        events(&t.db).await,
        [
            "dunning.started",
            "dunning.attempt_failed",
            "dunning.attempt_failed",
            "dunning.recovered"
        ]
    );
    // The policy warns after retry 1 only.
    assert_eq!(dunning_emails(&t.db).await.len(), 1);
    let rendered = metrics.render();
    for line in [
        "hardcount_dunning_attempts_total{outcome=\"declined\"} 2",
        "hardcount_dunning_attempts_total{outcome=\"succeeded\"} 1",
        "hardcount_dunning_recoveries_total 1",
    ] {
        assert!(rendered.contains(line), "{line} not in {rendered}");
    }
}

/// An invoice paid by hand (or by billing) after enrolment: the run stops as
/// recovered without a charge, announced once.
#[tokio::test]
async fn a_run_whose_invoice_was_paid_elsewhere_stops_without_charging() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 3, "pause_collection").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    let (d, _) = dunner(&t.db, &p, CALL, config());
    let d2 = d.clone();
    let enrolled = crate::as_leader(
        &crate::manager(&t.db, "enroller"),
        Role::Dunning,
        |tick| async move { d2.enrol(&tick.fence).await.unwrap() },
    )
    .await;
    assert_eq!(enrolled, 1);
    t.db.execute(
        sql("UPDATE invoices SET status = 'paid', paid_at = now() WHERE id = $1").bind(a.invoice),
    )
    .await
    .unwrap();
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.stopped, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("recovered".to_owned(), 0));
    assert_eq!(crate::attempts(&t.db, a.invoice).await.len(), 1);
    assert_eq!(p.total_charges(), 0);
    assert_eq!(
        events(&t.db).await,
        ["dunning.started", "dunning.recovered"]
    );
    // Ended: a later tick lists nothing.
    assert_eq!(tick(&t.db, &d).await.claimed, 0);
}

/// Dunning mail is from the tenant's sender (`tenant_settings.email_from`)
/// when it has one, else from the configured sender; a tenant's sender that
/// does not parse is replaced by the configured one rather than refused.
///
/// Mutation checks: `dunning_tenant_sender` (always the configured sender)
/// and `dunning_sender_fallback` (a tenant's sender kept even when it does
/// not parse, so the warning is refused) each seen failing under it.
#[tokio::test]
async fn dunning_mail_is_from_the_tenants_sender_when_it_has_one() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let mut su = t.superuser().await;
    // tenant_c's sender was written before the CHECK on it existed.
    sqlx::query("ALTER TABLE tenant_settings DROP CONSTRAINT tenant_settings_email_from_valid")
        .execute(&mut su)
        .await
        .unwrap();
    for (tenant, from) in [
        ("tenant_a", "Acme Billing <billing@acme.test>"),
        ("tenant_c", "not a mailbox"),
    ] {
        sqlx::query("INSERT INTO tenant_settings (tenant_id, email_from) VALUES ($1, $2)")
            .bind(tenant)
            .bind(from)
            .execute(&mut su)
            .await
            .unwrap();
    }
    for tenant in ["tenant_a", "tenant_b", "tenant_c"] {
        policy(&t.db, tenant, 2, "pause_collection").await;
        let a = declined_invoice(&t.db, tenant).await;
        p.set_behaviour(&a.customer, Behaviour::Decline("insufficient_funds".into()));
    }
    let (d, _) = dunner(&t.db, &p, CALL, config());
    assert_eq!(tick(&t.db, &d).await.tally.declined, 3);
    let senders = crate::strings(
        &t.db,
        "SELECT tenant_id || ' ' || sender FROM email_outbox \
         WHERE subject LIKE '%we will retry' ORDER BY tenant_id",
    )
    .await;
    let configured = config().email_from;
    assert_eq!(
        senders,
        [
            "tenant_a Acme Billing <billing@acme.test>".to_owned(),
            format!("tenant_b {configured}"),
            format!("tenant_c {configured}"),
        ]
    );
}

/// A declined retry sends the customer one email: the policy's warning,
/// worded by the decline's class (a hard decline asks for a new payment
/// method), and billing's payment-failed email of a first attempt is not
/// sent beside it. After the last retry the final notice is the only one
/// (`exhaustion_runs_the_final_action_once`). Docs/adr/0114.
///
/// Mutation checks: `retry_decline_billing_email` (billing emails every
/// attempt's decline, as before) and `warning_ignores_class` (the warning
/// words every decline as a soft one) each seen failing it.
#[tokio::test]
async fn a_declined_retry_sends_one_email_that_asks_what_its_decline_needs() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 2, "pause_collection").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(&a.customer, Behaviour::Decline("expired_card".into()));
    let (d, _) = dunner(&t.db, &p, CALL, config());
    assert_eq!(tick(&t.db, &d).await.tally.declined, 1);
    let texts = crate::strings(
        &t.db,
        "SELECT subject || ' | ' || text_body FROM email_outbox ORDER BY id",
    )
    .await;
    assert_eq!(texts.len(), 1, "{texts:?}");
    let invoice = a.invoice;
    assert!(
        texts[0].starts_with(&format!(
            "Payment for invoice {invoice} failed: add a payment method and we will retry | \
             We could not charge your saved card for invoice {invoice} (expired_card). \
             We will not try this card again: please add a new payment method before "
        )),
        "{texts:?}"
    );
}

/// A retry declined `authentication_required` (only the customer can
/// authenticate it: https://docs.stripe.com/declines/codes) warns with a
/// link to the tenant's payment page, its `{invoice}` filled with the
/// invoice's id; a tenant without one is asked for another payment method
/// and never to "confirm" (docs/adr/0150). Mutation
/// `dunning_payment_page_unlisted` (the listing reads no page) fails here.
#[tokio::test]
async fn an_authentication_decline_warns_with_the_tenants_payment_page() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    testbed::payments::set_payment_page(&t, "tenant_a", "https://acme.example/pay/{invoice}").await;
    let mut invoices = Vec::new();
    for tenant in ["tenant_a", "tenant_b"] {
        policy(&t.db, tenant, 2, "pause_collection").await;
        let a = declined_invoice(&t.db, tenant).await;
        p.set_behaviour(
            &a.customer,
            Behaviour::Decline("authentication_required".into()),
        );
        invoices.push(a.invoice);
    }
    let (d, _) = dunner(&t.db, &p, CALL, config());
    assert_eq!(tick(&t.db, &d).await.tally.declined, 2);
    let texts = crate::strings(
        &t.db,
        "SELECT text_body FROM email_outbox ORDER BY tenant_id",
    )
    .await;
    assert_eq!(texts.len(), 2, "{texts:?}");
    let a = invoices[0];
    assert!(
        texts[0].contains("which only you can do: add it again on the page below")
            && texts[0].ends_with(&format!(
                "\n\nAdd or update your payment method here: https://acme.example/pay/{a}\n"
            )),
        "{texts:?}"
    );
    assert!(
        texts[1].contains("so we will not charge this card for it again: please add another")
            && !texts[1].contains("here:"),
        "{texts:?}"
    );
    assert!(texts.iter().all(|t| !t.contains("confirm")), "{texts:?}");
}

/// A retry declined with a code Stripe's table says not to report to the
/// customer (`stolen_card`; https://docs.stripe.com/declines/codes) is
/// worded in the warning as `generic_decline`, and still as the hard decline
/// it is; the tenant's event keeps the code (docs/adr/0141). Mutation
/// `warning_shows_fraud_code` (the code emailed as it is) fails here.
#[tokio::test]
async fn a_retry_declined_as_stolen_warns_the_customer_of_a_generic_decline() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 2, "pause_collection").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(&a.customer, Behaviour::Decline("stolen_card".into()));
    let (d, _) = dunner(&t.db, &p, CALL, config());
    assert_eq!(tick(&t.db, &d).await.tally.declined, 1);
    let texts = crate::strings(&t.db, "SELECT text_body FROM email_outbox").await;
    assert_eq!(texts.len(), 1, "{texts:?}");
    assert!(
        texts[0].contains("(generic_decline). We will not try this card again"),
        "{texts:?}"
    );
    assert!(!texts[0].contains("stolen"), "{texts:?}");
    let payloads = crate::strings(
        &t.db,
        "SELECT payload::text FROM webhook_events WHERE event_type = 'dunning.attempt_failed'",
    )
    .await;
    assert!(payloads[0].contains("stolen_card"), "{payloads:?}");
}
