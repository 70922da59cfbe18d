//! A run's life: enrolment, declines, recovery, a run whose invoice was paid
//! elsewhere, a timeout, and a retry that panics.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use db::{Row, sql};
use dunning::DunningConfig;
use fake_provider::{Behaviour, FakeProvider};
use futures::FutureExt;
use leader::{Manager, Role, Telemetry};
use metrics_exporter_prometheus::PrometheusBuilder;
use testbed::TestDb;
use testbed::leadership::fast_timing;
use tokio_util::sync::CancellationToken;

use crate::{
    config, declined_invoice, dunner, dunning_emails, events, invoice_status, policy, run_of, tick,
};

const CALL: Duration = Duration::from_secs(5);

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
        // The next retry is 60 s × n after the first decline, an hour ago: due now.
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

/// The provider times out: the attempt is unknown, the run is rewound (count
/// as listed) and no later retry charges the invoice while the attempt's
/// outcome is unknown: the fake provider counted one charge.
#[tokio::test]
async fn a_timeout_rewinds_the_attempt_and_blocks_retries_until_settled() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 3, "pause_collection").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(&a.customer, Behaviour::Hang);
    let (d, metrics) = dunner(&t.db, &p, Duration::from_millis(300), config());
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.rewound, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 0));
    p.set_behaviour(&a.customer, Behaviour::Succeed);
    let r = tick(&t.db, &d).await;
    assert_eq!(
        r.tally.rewound, 1,
        "held while the attempt is unknown: {r:?}"
    );
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 0));
    assert_eq!(p.total_charges(), 1);
    assert_eq!(invoice_status(&t.db, a.invoice).await, "open");
    let rendered = metrics.render();
    assert!(
        rendered.contains("hardcount_dunning_attempts_total{outcome=\"unknown\"} 1"),
        "{rendered}"
    );
}

/// Three runs of three tenants in one batch; the first run's
/// `first_declined_at` is corrupt (the last minute chrono can hold, so the
/// next retry's time cannot be computed), so its first retry panics after
/// its attempt was recorded, planning what a decline would do, before the
/// charge. That attempt is rewound (count unchanged, nothing charged), the
/// other two tenants' runs are retried in the same tick, and the tick is
/// released as panicked.
///
/// Mutation check: `dunning_panic_rewind` (the panic path's rewind removed
/// from `retry_batch`) leaves the count at 1; seen failing under it.
#[tokio::test]
async fn a_retry_that_panics_is_rewound_and_the_other_runs_go_on() {
    scheduler::install_panic_hook();
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 2, "pause_collection").await;
    policy(&t.db, "tenant_b", 2, "pause_collection").await;
    policy(&t.db, "tenant_c", 2, "pause_collection").await;
    let bad = declined_invoice(&t.db, "tenant_a").await;
    let b = declined_invoice(&t.db, "tenant_b").await;
    let c = declined_invoice(&t.db, "tenant_c").await;
    p.set_behaviour(&b.customer, Behaviour::Decline("do_not_honor".into()));
    let (d, _) = dunner(&t.db, &p, CALL, config());
    crate::enrol(&t.db, &d).await;
    sqlx::query(
        "UPDATE dunning_runs SET first_declined_at = '262142-12-31 23:59:00+00' \
         WHERE invoice_id = $1",
    )
    .bind(bad.invoice)
    .execute(&mut t.superuser().await)
    .await
    .unwrap();
    let recorder = PrometheusBuilder::new().build_recorder();
    let lease_metrics = recorder.handle();
    let m = Manager::with_holder_id(
        t.db.clone(),
        fast_timing(),
        Telemetry::new(Arc::new(recorder)),
        "panicky:1:00000000".to_owned(),
    );
    let shutdown = CancellationToken::new();
    let led = AssertUnwindSafe(m.lead(
        Role::Dunning,
        Duration::ZERO,
        &shutdown,
        |tick| async move { d.run_tick(&tick).await.end },
    ))
    .catch_unwind()
    .await;
    let payload = led.expect_err("the tick's panic reaches the lease manager");
    let message = scheduler::panic_message(&*payload);
    assert!(message.contains("out of range"), "{message}");
    assert_eq!(run_of(&t.db, bad.invoice).await, ("active".to_owned(), 0));
    assert_eq!(run_of(&t.db, b.invoice).await, ("active".to_owned(), 1));
    assert_eq!(run_of(&t.db, c.invoice).await, ("recovered".to_owned(), 1));
    // Nothing asked of the provider for the bad run; one charge (tenant c).
    assert_eq!(crate::attempts(&t.db, bad.invoice).await.len(), 1);
    assert_eq!(crate::attempts(&t.db, b.invoice).await.len(), 2);
    assert_eq!(p.total_charges(), 1, "{:?}", p.charges());
    let rendered = lease_metrics.render();
    assert!(
        rendered.lines().any(|l| l.starts_with(
            "hardcount_leader_lease_lost_total{role=\"dunning\",reason=\"panicked\"}"
        ) && l.ends_with(" 1")),
        "{rendered}"
    );
}

/// The provider answers 503 to every retry: each run's attempt is rewound
/// (nothing counted), and the tick stops as failed so the role retries after
/// the short cooldown instead of timing out on every due run.
#[tokio::test]
async fn a_provider_outage_rewinds_every_retry_and_fails_the_tick() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 3, "pause_collection").await;
    let mut runs = Vec::new();
    for _ in 0..dunning::OUTAGE_UNANSWERED {
        let a = declined_invoice(&t.db, "tenant_a").await;
        p.set_behaviour(&a.customer, Behaviour::ServerError(503));
        runs.push(a);
    }
    let (d, metrics) = dunner(&t.db, &p, CALL, config());
    let r = tick(&t.db, &d).await;
    assert!(matches!(r.end, leader::TickEnd::Failed(_)), "{r:?}");
    assert_eq!(r.tally.unanswered, runs.len(), "{r:?}");
    for a in &runs {
        assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 0));
    }
    assert_eq!(p.total_charges(), 0);
    let rendered = metrics.render();
    let line = format!(
        "hardcount_dunning_attempts_total{{outcome=\"unknown\"}} {}",
        runs.len()
    );
    assert!(rendered.contains(&line), "{rendered}");
}

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
    let asked: Vec<String> = crate::strings(
        &t.db,
        "SELECT text_body FROM email_outbox WHERE subject LIKE 'Your payment%'",
    )
    .await;
    assert!(
        asked.iter().any(|b| b.contains("new payment method")),
        "{asked:?}"
    );
    p.set_behaviour(&a.customer, Behaviour::Succeed);
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.not_attempted, 1, "{r:?}");
    assert_eq!(r.tally.recovered + r.tally.declined, 0, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 2));
    assert_eq!(p.create_requests(), 1);
    assert_eq!(crate::payment_failed(&t.db).await, 1);
    assert_eq!(crate::next_retry_offset(&t.db, a.invoice).await, 180.0);
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
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.recovered, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("recovered".to_owned(), 3));
    assert_eq!(invoice_status(&t.db, a.invoice).await, "paid");
    assert_eq!(p.create_requests(), 2);
}

/// A customer without a payment method: each due retry is counted without a
/// provider call, the next one scheduled by the policy (60 s × n after the
/// first decline), the warning asks for a payment method, and the last one
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
    assert_eq!(crate::next_retry_offset(&t.db, a.invoice).await, 120.0);
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

/// A rolled secret key during retries is this deployment's error: one call is
/// refused, the batch's runs are rewound uncounted, nothing is recorded
/// against the customers (no `payment.failed`, no email), the tick ends
/// failed and the key-rejected counter the alert reads is set.
///
/// Mutation check: ignoring the refusal in `retry_batch`
/// (`dunning_key_rejected`) lets the tick end drained.
#[tokio::test]
async fn a_rolled_key_during_retries_fails_the_tick_and_counts_nothing_against_customers() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 4, "cancel_subscription").await;
    let mut invoices = Vec::new();
    for _ in 0..3 {
        invoices.push(declined_invoice(&t.db, "tenant_a").await.invoice);
    }
    let (d, metrics) = dunner(&t.db, &p, CALL, config());
    let failed_before: i64 =
        t.db.fetch_one(sql(
            "SELECT count(*) FROM webhook_events WHERE event_type = 'payment.failed'",
        ))
        .await
        .unwrap()
        .get(0);
    let emails_before: i64 =
        t.db.fetch_one(sql("SELECT count(*) FROM email_outbox"))
            .await
            .unwrap()
            .get(0);
    let created = p.create_requests();
    p.roll_secret_key("sk_test_rolled");
    let r = tick(&t.db, &d).await;
    assert!(matches!(r.end, leader::TickEnd::Failed(_)), "{r:?}");
    // One refused call closed the gate: the other retries were not sent.
    assert_eq!(p.unauthorized_requests(), 1);
    assert_eq!(p.create_requests(), created);
    for invoice in invoices {
        assert_eq!(run_of(&t.db, invoice).await, ("active".to_owned(), 0));
    }
    let failed_after: i64 =
        t.db.fetch_one(sql(
            "SELECT count(*) FROM webhook_events WHERE event_type = 'payment.failed'",
        ))
        .await
        .unwrap()
        .get(0);
    let emails_after: i64 =
        t.db.fetch_one(sql("SELECT count(*) FROM email_outbox"))
            .await
            .unwrap()
            .get(0);
    assert_eq!((failed_after, emails_after), (failed_before, emails_before));
    assert!(
        metrics
            .render()
            .contains("hardcount_billing_provider_key_rejected_total 1"),
        "{}",
        metrics.render()
    );
}
