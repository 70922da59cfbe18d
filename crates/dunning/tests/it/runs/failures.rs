//! A retry that fails: a timeout rewinds its attempt and holds later retries
//! until it is settled; a panic rewinds its own run while the others go on;
//! a provider outage and a rolled key each rewind the batch and fail the tick.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use db::{Row, sql};
use fake_provider::{Behaviour, FakeProvider};
use futures::FutureExt;
use leader::{Manager, Role, Telemetry};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use testbed::TestDb;
use testbed::leadership::fast_timing;
use tokio_util::sync::CancellationToken;

use super::CALL;
use crate::{config, declined_invoice, dunner, invoice_status, policy, run_of, tick};

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

/// [`dunning::OUTAGE_UNANSWERED`] due runs whose retries the provider
/// answers as `behaviour` says, and one tick over them: its report, the runs,
/// and the tick's metrics.
async fn one_batch_answered(
    t: &TestDb,
    p: &FakeProvider,
    behaviour: Behaviour,
) -> (dunning::TickReport, Vec<crate::Declined>, PrometheusHandle) {
    policy(&t.db, "tenant_a", 3, "pause_collection").await;
    let mut runs = Vec::new();
    for _ in 0..dunning::OUTAGE_UNANSWERED {
        let a = declined_invoice(&t.db, "tenant_a").await;
        p.set_behaviour(&a.customer, behaviour.clone());
        runs.push(a);
    }
    let (d, metrics) = dunner(&t.db, p, CALL, config());
    (tick(&t.db, &d).await, runs, metrics)
}

/// The provider answers 503 to every retry: each run's attempt is rewound
/// (nothing counted), and the tick stops as failed so the role retries after
/// the short cooldown instead of timing out on every due run.
#[tokio::test]
async fn a_provider_outage_rewinds_every_retry_and_fails_the_tick() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (r, runs, metrics) = one_batch_answered(&t, &p, Behaviour::ServerError(503)).await;
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

/// Answers that are not a charge or a decline (here, bodies billing cannot
/// trust, which it sends to review) are answers: a batch of them is not an
/// outage, and the tick does not fail for it. Each run is rewound, as for
/// any outcome not relied on.
///
/// Mutation check: every unknown outcome counted unanswered, as before
/// (`dunning_answered_unknown`), takes the batch for an outage, and this test
/// fails.
#[tokio::test]
async fn answers_not_relied_on_are_not_an_outage() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let malformed = Behaviour::Malformed(fake_provider::MalformedKind::NotJson);
    let (r, _, _) = one_batch_answered(&t, &p, malformed).await;
    assert!(!matches!(r.end, leader::TickEnd::Failed(_)), "{r:?}");
    assert_eq!(r.tally.unanswered, 0, "{r:?}");
}

/// The provider refuses every retry of a batch for load (429): that is an
/// outage to dunning's rule, and the tick stops for the cooldown instead of
/// sending the rest of its due runs into the limit. Each run is rewound.
///
/// Mutation check: the 429 counted as an answer (`dunning_rate_limited_outage`)
/// lets the tick end drained, and this test fails.
#[tokio::test]
async fn a_batch_refused_for_load_is_an_outage() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let limited = Behaviour::RateLimited {
        retry_after_secs: 30,
    };
    let (r, runs, _) = one_batch_answered(&t, &p, limited).await;
    assert!(matches!(r.end, leader::TickEnd::Failed(_)), "{r:?}");
    assert_eq!(r.tally.unanswered, runs.len(), "{r:?}");
    for a in &runs {
        assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 0));
    }
    assert_eq!(p.total_charges(), 0);
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

/// A new dunner exports at 0 each outcome `HardcountDunningAttemptsFailing`
/// reads: a series made at its first retry had that retry unseen by the
/// alert's `increase()`, so a new leader's first answer did not hold the page
/// (docs/adr/0141). Mutation `dunning_outcomes_not_zeroed` fails here.
#[tokio::test]
async fn a_new_dunner_exports_the_alerted_outcomes_at_zero() {
    let t = TestDb::new().await;
    let (_, metrics) = crate::dunner_with(&t.db, billing::BillingConfig::default(), config());
    let rendered = metrics.render();
    for outcome in dunning::OUTCOMES_ALERTED {
        let line = format!("hardcount_dunning_attempts_total{{outcome=\"{outcome}\"}} 0");
        assert!(rendered.lines().any(|l| l == line), "{line} in {rendered}");
    }
}
