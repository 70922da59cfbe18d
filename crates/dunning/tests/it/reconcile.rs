//! A retry whose call timed out after the provider charged: billing's payment
//! reconciler finds the charge by its key, and dunning never charges again.
//! A retry answered `processing`: counted, and its later decline ends the run.

use std::time::Duration;

use billing::{Biller, BillingConfig};
use fake_provider::{Behaviour, FakeProvider};
use leader::{Role, Telemetry};
use testbed::TestDb;

use dunning::Dunner;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::{
    Declined, as_leader, attempts, billing, config, declined_invoice, due_now, dunner_with,
    dunning_emails, events, invoice_status, manager, patient_manager, policy,
    remove_payment_method, run_of, tick,
};

/// One declined invoice's run on a policy of `retries` retries (pausing
/// collection at the end), whose retries `p` answers as `behaviour` says,
/// and a dunner charging through billing with a 1 s claim lease and a 300 ms
/// call: the invoice, the dunner, its metrics, and billing's configuration
/// (for a biller whose reconciler looks after the lease).
async fn declined_run(
    t: &TestDb,
    p: &FakeProvider,
    retries: usize,
    behaviour: Behaviour,
) -> (Declined, Dunner, PrometheusHandle, BillingConfig) {
    policy(&t.db, "tenant_a", retries, "pause_collection").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(&a.customer, behaviour);
    let charging = BillingConfig {
        charge_lease: Duration::from_secs(1),
        ..billing(p, Duration::from_millis(300))
    };
    let (d, metrics) = dunner_with(&t.db, charging.clone(), config());
    (a, d, metrics, charging)
}

/// Past billing's claim lease, one billing tick (its reconciler looks at the
/// attempts whose next look is due).
async fn reconciler_looks(db: &db::Db, charging: &BillingConfig) {
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let biller = Biller::new(db.clone(), charging.clone(), Telemetry::noop()).unwrap();
    as_leader(
        &patient_manager(db, "biller"),
        Role::Billing,
        |tick| async move { biller.run_tick(&tick).await },
    )
    .await;
}

/// The provider charges retry 1 and then hangs: the attempt is unknown and
/// the run rewound; while the attempt is unknown no retry charges the
/// invoice; once billing's claim lease has expired, billing's reconciler
/// repeats the request with the same key, the stored charge answers, and the
/// invoice is settled paid; the next dunning tick ends the run as recovered,
/// and counts it in `hardcount_dunning_recoveries_total`. The provider
/// counted one charge. Mutation `stop_uncounted` (the stop's count removed)
/// and the counter is missing.
#[tokio::test]
async fn a_timeout_whose_charge_succeeded_is_found_by_the_reconciler_by_key() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (a, d, metrics, charging) = declined_run(&t, &p, 3, Behaviour::Hang).await;
    assert_eq!(tick(&t.db, &d).await.tally.rewound, 1);
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 0));
    assert_eq!(p.total_charges(), 1);
    // Held while unknown: nothing charged, however often dunning looks.
    p.set_behaviour(&a.customer, Behaviour::Succeed);
    assert_eq!(tick(&t.db, &d).await.tally.rewound, 1);
    assert_eq!(p.total_charges(), 1);
    reconciler_looks(&t.db, &charging).await;
    assert_eq!(invoice_status(&t.db, a.invoice).await, "paid");
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.stopped, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("recovered".to_owned(), 0));
    assert_eq!(p.total_charges(), 1, "{:?}", p.charges());
    assert_eq!(
        events(&t.db).await,
        ["dunning.started", "dunning.recovered"]
    );
    let rendered = metrics.render();
    assert!(
        rendered.contains("hardcount_dunning_recoveries_total 1"),
        "{rendered}"
    );
}

/// A run whose last retry's outcome is unknown waits, also once the customer
/// has no payment method left: on a one-retry policy, retry 1 charges and
/// hangs (rewound, count 0), the card is removed, and the run is due. It is
/// not counted "not attempted" and exhausted, its invoice not written off
/// while the charge may have gone through: billing's reconciler then finds
/// it paid and the run ends recovered, with no final action. Mutation
/// `pending_no_method` (the listing's pending rule for a run without a
/// method removed) and the run is exhausted with the invoice still open.
#[tokio::test]
async fn a_run_without_a_method_waits_for_its_unknown_retry() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (a, d, _, charging) = declined_run(&t, &p, 1, Behaviour::Hang).await;
    assert_eq!(tick(&t.db, &d).await.tally.rewound, 1);
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 0));
    remove_payment_method(&t.db, &a.customer).await;
    p.set_behaviour(&a.customer, Behaviour::Succeed);
    due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.pending, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 0));
    reconciler_looks(&t.db, &charging).await;
    assert_eq!(invoice_status(&t.db, a.invoice).await, "paid");
    // The wait's hold passed.
    due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.stopped, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("recovered".to_owned(), 0));
    assert_eq!(p.total_charges(), 1);
    // Billing asked for a method when the card went: no final action.
    assert_eq!(
        events(&t.db).await,
        [
            "dunning.started",
            "invoice.payment_action_required",
            "dunning.recovered"
        ]
    );
}

/// A retry answered `processing` (a bank debit settles days later,
/// https://docs.stripe.com/payments/paymentintents/lifecycle) is an attempt
/// made (docs/adr/0073). With a two-retry policy:
/// - retry 1 is answered `processing`: the run keeps count 1, and while the
///   intent is processing no retry charges the invoice;
/// - the intent fails and billing's reconciler records the decline: retry 2
///   charges (count 2), and is answered `processing` too;
/// - the policy has no retry left: while retry 2 is processing the run waits
///   without a call; once it fails, the run is exhausted at count 2 (not
///   while collection is paused) and takes its final action, with no third
///   charge.
///
/// Before, `processing` rewound the run, so a decline that came through the
/// reconciler never counted: the run retried at count 0 for ever and never
/// reached its final action.
/// Mutations: `processing_counts` (the answer rewound again) leaves the count
/// at 0 after retry 1; `spent_not_charged` (the listing's spent rule removed)
/// sends a third charge request. Both seen failing here.
#[tokio::test]
async fn a_retry_answered_processing_counts_and_its_later_decline_exhausts_the_run() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (a, d, metrics, charging) = declined_run(&t, &p, 2, Behaviour::Processing).await;
    // The intent of attempt `seq` fails, and billing's reconciler records it.
    let fails = |seq: usize| {
        let (p, t, charging) = (&p, &t, &charging);
        async move {
            let intent = p.intents()[seq - 2].id.clone();
            assert!(p.settle_processing(&intent, false));
            // Its next poll due now, its claim expired.
            sqlx::query("UPDATE payment_attempts SET next_check_at = now() WHERE attempt_seq = $1")
                .bind(i32::try_from(seq).unwrap())
                .execute(&mut t.superuser().await)
                .await
                .unwrap();
            reconciler_looks(&t.db, charging).await;
        }
    };
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.pending, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 1));
    // Retry 2 is due (made due: it is the policy's gap after retry 1), but
    // the run waits while retry 1 is processing: a hold, no call, nothing
    // announced.
    due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    assert_eq!((r.tally.pending, r.tally.rewound), (1, 0), "{r:?}");
    assert_eq!(p.create_requests(), 1);
    assert_eq!(events(&t.db).await, vec!["dunning.started"]);
    fails(2).await;
    let seen = attempts(&t.db, a.invoice).await;
    assert_eq!(seen[1], (2, "declined".to_owned()), "{seen:?}");
    // Retry 1's decline is announced as a decline at once would have been
    // (docs/adr/0085): `dunning.attempt_failed` and the policy's warning
    // (it warns after retry 1), once. Mutation `owed_notice_announced` (the
    // listing's branch removed) charges retry 2 with neither sent. The run's
    // hold is over.
    due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.declined, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 1));
    assert_eq!(
        events(&t.db).await,
        vec!["dunning.started", "dunning.attempt_failed"]
    );
    assert_eq!(dunning_emails(&t.db).await.len(), 1);
    // Retry 2 is the policy's gap (60 s) after the decline was announced, not
    // at its passed offset (docs/adr/0092). Mutation `owed_decline_gap` (the
    // gap counted from the first decline) leaves it due at once.
    let next = crate::next_retry_in(&t.db, a.invoice).await;
    assert!((55.0..=60.0).contains(&next), "{next}");
    due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.pending, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 2));
    assert_eq!(dunning_emails(&t.db).await.len(), 1, "announced once");
    let seen = attempts(&t.db, a.invoice).await;
    assert_eq!(seen[2], (3, "processing".to_owned()), "{seen:?}");
    // Spent, the last retry processing: a hold, no call, nothing counted.
    due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.pending, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 2));
    assert_eq!(p.create_requests(), 2);
    fails(3).await;
    // A pause holds a spent run as it holds charges: no final action while
    // collection is paused. Mutation `spent_under_pause` (the pause's branch
    // of the listing removed) exhausts it here.
    let pause = |behavior: Option<&'static str>| {
        let t = &t;
        async move {
            sqlx::query("UPDATE subscriptions SET pause_collection_behavior = $1 WHERE id = $2")
                .bind(behavior)
                .bind(a.subscription)
                .execute(&mut t.superuser().await)
                .await
                .unwrap();
        }
    };
    pause(Some("keep_as_draft")).await;
    due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.exhausted, 0, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 2));
    pause(None).await;
    due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.exhausted, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("exhausted".to_owned(), 2));
    assert_eq!((p.create_requests(), p.total_charges()), (2, 0));
    assert_eq!(invoice_status(&t.db, a.invoice).await, "open");
    let events = events(&t.db).await;
    assert!(
        events.iter().any(|e| e == "dunning.exhausted"),
        "{events:?}"
    );
    let rendered = metrics.render();
    assert!(
        rendered.contains("hardcount_dunning_attempts_total{outcome=\"processing\"} 2"),
        "{rendered}"
    );
}

/// A retry answered `processing` whose next retry is days away waits a hold
/// (600 s), not until that retry: its decline is announced within a hold of
/// the reconciler's (docs/adr/0085). Mutation `owed_notice_hold` (the wait
/// back to the planned retry) waits two days; seen failing.
#[tokio::test]
async fn a_processing_retry_is_looked_at_again_after_a_hold() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 2, "pause_collection").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(&a.customer, Behaviour::Processing);
    let mut su = t.superuser().await;
    sqlx::query("UPDATE dunning_policies SET retry_offsets_secs = '{86400, 172800}'")
        .execute(&mut su)
        .await
        .unwrap();
    let (d, _) = dunner_with(&t.db, billing(&p, Duration::from_millis(300)), config());
    assert_eq!(tick(&t.db, &d).await.enrolled, 1);
    // Retry 1 due now; retry 2 two days away.
    sqlx::query("UPDATE dunning_runs SET first_declined_at = now(), next_attempt_at = now()")
        .execute(&mut su)
        .await
        .unwrap();
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.pending, 1, "{r:?}");
    let (waits, marked): (f64, Option<i32>) = sqlx::query_as(
        "SELECT extract(epoch FROM next_attempt_at - now())::float8, owed_notice_attempt \
         FROM dunning_runs WHERE invoice_id = $1",
    )
    .bind(a.invoice)
    .fetch_one(&mut su)
    .await
    .unwrap();
    assert!((500.0..=700.0).contains(&waits), "waits {waits} s");
    assert_eq!(marked, Some(1));
}

/// An attempt whose answer could not be read goes to an operator, who finds
/// nothing charged at the provider and settles it as not charged
/// (`billing_settle_attempt`, migration 0019: "the invoice is chargeable
/// again and dunning takes it"). Auto-charge takes only invoices never
/// attempted, so dunning must: the next tick enrols the invoice, and its
/// first retry charges it once (docs/adr/0074).
/// Mutation: `settled_not_charged_enrolled` (enrolment back to declined
/// attempts only) enrols nothing; seen failing here.
#[tokio::test]
async fn an_attempt_an_operator_settles_as_not_charged_is_taken_by_dunning() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 2, "pause_collection").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    // The fixture's attempt, as if its answer had not parsed.
    let mut su = t.superuser().await;
    sqlx::query(
        "UPDATE payment_attempts SET provider_status = 'needs_review', decline_code = NULL, \
                resolved_at = NULL WHERE invoice_id = $1",
    )
    .bind(a.invoice)
    .execute(&mut su)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE invoices SET review_since = now(), review_reason = 'unreadable' WHERE id = $1",
    )
    .bind(a.invoice)
    .execute(&mut su)
    .await
    .unwrap();
    let (d, _) = dunner_with(&t.db, billing(&p, Duration::from_secs(5)), config());
    let r = tick(&t.db, &d).await;
    assert_eq!(r.enrolled, 0, "nothing while it waits for review: {r:?}");
    let op = t.operator();
    let listed = billing::review::needing_review(&op).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    let settled = billing::review::settle(
        &op,
        listed[0].attempt_id,
        billing::review::Settlement::Failed,
        None,
        "oncall",
        "no intent at the provider",
    )
    .await
    .unwrap();
    assert_eq!(settled, "failed");
    let r = tick(&t.db, &d).await;
    assert_eq!(r.enrolled, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 0));
    sqlx::query("UPDATE dunning_runs SET next_attempt_at = now() WHERE invoice_id = $1")
        .bind(a.invoice)
        .execute(&mut su)
        .await
        .unwrap();
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.recovered, 1, "{r:?}");
    assert_eq!(invoice_status(&t.db, a.invoice).await, "paid");
    assert_eq!((p.create_requests(), p.total_charges()), (1, 1));
}

/// A retry answered `processing` whose debit then fails owes its decline's
/// notices (docs/adr/0085). The run is listed so; then the customer pays the
/// invoice by hand before the decline is written: nothing is announced (no
/// `dunning.attempt_failed`, no warning), the run is left as listed, and the
/// next tick stops it.
///
/// Mutation check: the decline without its invoice check
/// (`owed_decline_paid`) announces the decline of a paid invoice, and this
/// test fails.
#[tokio::test]
async fn an_owed_decline_of_an_invoice_paid_since_its_listing_is_not_announced() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (a, d, _, charging) = declined_run(&t, &p, 2, Behaviour::Processing).await;
    assert_eq!(tick(&t.db, &d).await.tally.pending, 1);
    // The debit fails; billing's reconciler records the decline.
    assert!(p.settle_processing(&p.intents()[0].id, false));
    let mut su = t.superuser().await;
    sqlx::query("UPDATE payment_attempts SET next_check_at = now()")
        .execute(&mut su)
        .await
        .unwrap();
    reconciler_looks(&t.db, &charging).await;
    due_now(&t.db).await;
    let d2 = d.clone();
    let listed = as_leader(
        &manager(&t.db, "lister"),
        Role::Dunning,
        |tick| async move { d2.list_due(&tick.fence, 10).await.unwrap() },
    )
    .await;
    assert_eq!(
        listed[0].not_chargeable,
        Some(dunning::NotChargeable::DeclineUnannounced)
    );
    sqlx::query("UPDATE invoices SET status = 'paid', paid_at = now() WHERE id = $1")
        .bind(a.invoice)
        .execute(&mut su)
        .await
        .unwrap();
    assert_eq!(d.retry(&listed[0]).await.unwrap(), dunning::Retry::Lost);
    assert_eq!(events(&t.db).await, ["dunning.started"]);
    assert!(dunning_emails(&t.db).await.is_empty());
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 1));
    assert_eq!(tick(&t.db, &d).await.tally.stopped, 1);
}

/// A retry refused for load (429, before the provider read its key) is an
/// attempt no request of which executed (`first_sent_at` NULL, docs/adr/0081).
/// The customer then removes their card: billing will not send it without
/// one, and nothing can be found paid, so it does not hold the run: the next
/// due retry is counted not attempted (`dunning.retry_skipped`) on schedule,
/// where it used to wait, a hold at a time, until a card came. With a card
/// again, billing's reconciler sends that attempt, with the new card, and it
/// pays the invoice once (docs/adr/0116).
///
/// Mutation check: `unsent_holds_run` (the listing's exception for an
/// attempt never sent removed) leaves the run waiting; seen failing it.
#[tokio::test]
async fn a_retry_never_sent_does_not_hold_a_run_whose_customer_has_no_card() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let limited = Behaviour::RateLimited {
        retry_after_secs: 1,
    };
    let (a, d, _, charging) = declined_run(&t, &p, 2, limited).await;
    assert_eq!(tick(&t.db, &d).await.tally.unanswered, 1);
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 0));
    assert_eq!(p.total_charges(), 0);
    remove_payment_method(&t.db, &a.customer).await;
    due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.not_attempted, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 1));
    assert_eq!(
        events(&t.db).await,
        ["dunning.started", "dunning.retry_skipped"]
    );
    // The attempt is still open and never sent: a card brings it out.
    assert_eq!(
        attempts(&t.db, a.invoice).await,
        [(1, "declined".to_owned()), (2, "unknown".to_owned())]
    );
    p.set_behaviour(&a.customer, Behaviour::Succeed);
    testbed::tenant_writer(&t.db, "tenant_a")
        .execute(
            db::sql(
                "UPDATE customers SET payment_method_id = 'pm_card_mastercard' \
                     WHERE provider_customer_id = $1",
            )
            .bind(a.customer.clone()),
        )
        .await
        .unwrap();
    let mut su = t.superuser().await;
    sqlx::query("UPDATE payment_attempts SET next_check_at = now() WHERE invoice_id = $1")
        .bind(a.invoice)
        .execute(&mut su)
        .await
        .unwrap();
    reconciler_looks(&t.db, &charging).await;
    assert_eq!(invoice_status(&t.db, a.invoice).await, "paid");
    // The refused request and the one sent with the new card.
    assert_eq!((p.create_requests(), p.total_charges()), (2, 1));
    let methods: Vec<String> = p.intents().into_iter().map(|i| i.payment_method).collect();
    assert_eq!(methods, ["pm_card_mastercard"]);
}

/// A retry refused for load (429: never sent) waits for its tenant's
/// business window at billing's reconciler too: with the window closed, the
/// reconciler's look sends nothing and leaves the attempt never sent; once
/// the window is open, it sends it and the invoice is paid once. Before, the
/// reconciler sent it whatever the hour: a retry, its receipt and its events
/// outside the window dunning's funnel keeps (docs/adr/0147).
///
/// Mutation `reconcile_unsent_window` (the reconciler's window guard
/// dropped) sends the retry while the window is closed; seen failing under it.
#[tokio::test]
async fn a_never_sent_retry_waits_for_its_window_at_the_reconciler() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let limited = Behaviour::RateLimited {
        retry_after_secs: 1,
    };
    let (a, d, _, charging) = declined_run(&t, &p, 2, limited).await;
    assert_eq!(tick(&t.db, &d).await.tally.unanswered, 1);
    assert_eq!(p.create_requests(), 1);
    p.set_behaviour(&a.customer, Behaviour::Succeed);
    let mut su = t.superuser().await;
    // Opens in an hour and closes in two, every day, in UTC: closed now
    // (whatever the hour; a window past midnight included).
    for (opens, closes, sent) in [(3600, 7200, 1), (-3600, 3600, 2)] {
        sqlx::query(
            "UPDATE dunning_policies SET window_time_zone = 'UTC', \
                    window_opens = (now() AT TIME ZONE 'UTC' + make_interval(secs => $1))::time, \
                    window_closes = (now() AT TIME ZONE 'UTC' + make_interval(secs => $2))::time, \
                    window_weekdays = '{1,2,3,4,5,6,7}' \
             WHERE tenant_id = 'tenant_a' AND is_default",
        )
        .bind(f64::from(opens))
        .bind(f64::from(closes))
        .execute(&mut su)
        .await
        .unwrap();
        sqlx::query("UPDATE payment_attempts SET next_check_at = now() WHERE invoice_id = $1")
            .bind(a.invoice)
            .execute(&mut su)
            .await
            .unwrap();
        reconciler_looks(&t.db, &charging).await;
        assert_eq!(p.create_requests(), sent, "window opens in {opens} s");
        // Held, it stays never sent: its resend window has not begun.
        let unsent: bool = sqlx::query_scalar(
            "SELECT first_sent_at IS NULL FROM payment_attempts \
             WHERE invoice_id = $1 AND attempt_seq = 2",
        )
        .bind(a.invoice)
        .fetch_one(&mut su)
        .await
        .unwrap();
        assert_eq!(unsent, sent == 1, "window opens in {opens} s");
    }
    assert_eq!(invoice_status(&t.db, a.invoice).await, "paid");
    assert_eq!(p.total_charges(), 1);
}

/// The same retry refused for load, but the process dies before dunning
/// rewinds it (here a trigger refuses the rewind): the run is left counted,
/// owing that retry's notices (docs/adr/0115), with the attempt never sent.
/// With the card removed, no decline was made, so none is announced: the run
/// goes on without a card, its next retry counted not attempted
/// (docs/adr/0116), and it does not wait for a card for ever.
///
/// Mutation check: `unsent_owed_announced` (the listing announces an owed
/// decline whatever became of its attempt) announces a decline `unknown`;
/// seen failing it.
#[tokio::test]
async fn a_retry_never_sent_and_never_rewound_is_not_announced_as_declined() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let limited = Behaviour::RateLimited {
        retry_after_secs: 1,
    };
    let (a, d, _, _) = declined_run(&t, &p, 3, limited).await;
    crate::refuse_run_updates(
        &t,
        "refuse_rewinds",
        "NEW.attempt_count < OLD.attempt_count",
    )
    .await;
    tick(&t.db, &d).await;
    crate::allow_run_updates(&t, "refuse_rewinds").await;
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 1));
    remove_payment_method(&t.db, &a.customer).await;
    due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.not_attempted, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 2));
    assert_eq!(
        events(&t.db).await,
        ["dunning.started", "dunning.retry_skipped"]
    );
    assert_eq!(p.total_charges(), 0);
}

/// A retry answered `processing` owes its decline's notices (docs/adr/0085);
/// collection is then paused and the debit fails. While paused the run is
/// held as a charge is: listed for the charge, refused by billing, rewound.
/// The rewind takes back only what its record wrote, so the mark the
/// processing answer left stays (docs/adr/0115), and once collection resumes
/// the decline is announced once and retry 2 waits for the policy's gap.
///
/// Mutation check: `rewind_clears_any_owed` (the rewinds clear every mark,
/// as 0115 first did) charges retry 2 at once on the resume, retry 1's
/// decline never announced; seen failing it.
#[tokio::test]
async fn an_owed_decline_outlives_a_pause_of_collection() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (a, d, _, charging) = declined_run(&t, &p, 3, Behaviour::Processing).await;
    assert_eq!(tick(&t.db, &d).await.tally.pending, 1);
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 1));
    let mut su = t.superuser().await;
    let pause = |behavior: Option<&'static str>| {
        sqlx::query("UPDATE subscriptions SET pause_collection_behavior = $1 WHERE id = $2")
            .bind(behavior)
            .bind(a.subscription)
    };
    pause(Some("keep_as_draft")).execute(&mut su).await.unwrap();
    let intent = p.intents()[0].id.clone();
    assert!(p.settle_processing(&intent, false));
    sqlx::query("UPDATE payment_attempts SET next_check_at = now() WHERE attempt_seq = 2")
        .execute(&mut su)
        .await
        .unwrap();
    reconciler_looks(&t.db, &charging).await;
    assert_eq!(
        attempts(&t.db, a.invoice).await[1],
        (2, "declined".to_owned())
    );
    due_now(&t.db).await;
    tick(&t.db, &d).await;
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 1));
    assert_eq!(events(&t.db).await, ["dunning.started"]);
    pause(None).execute(&mut su).await.unwrap();
    due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.declined, 1, "{r:?}");
    assert_eq!(p.create_requests(), 1, "retry 2 charged at once");
    assert_eq!(
        events(&t.db).await,
        ["dunning.started", "dunning.attempt_failed"]
    );
    let next = crate::next_retry_in(&t.db, a.invoice).await;
    assert!((55.0..=60.0).contains(&next), "{next}");
}
