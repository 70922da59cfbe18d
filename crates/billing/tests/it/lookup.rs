//! The reconciler's look at an open attempt. Among more of the customer's
//! payment intents than it reads (docs/adr/0090): inside the resend window
//! the same request goes again under the same key, which the provider
//! answers with its stored result; past it, the attempt needs review. Before,
//! such an attempt stayed unknown at every look, for ever. And a first send
//! refused with 429 left nothing sent (docs/adr/0091): the attempt stays
//! never sent, and its next send is made without a listing; a 429
//! `lock_timeout` may come after the charge, and is looked up.

use std::time::Duration;

use billing::ReconcileTally;
use db::{Row, sql};
use fake_provider::{Behaviour, FakeProvider, TEST_SECRET_KEY};
use testbed::TestDb;

use crate::record::{after_the_lease, charging, legacy_attempt};
use crate::{biller, open_invoices, strings, tick};

/// `n` more succeeded intents of `customer`, each under a key of its own,
/// sent to the provider as another integration of the same account would.
async fn crowd(p: &FakeProvider, customer: &str, n: usize) {
    let client = reqwest::Client::new();
    for i in 0..n {
        let answer = client
            .post(format!("{}/v1/payment_intents", p.base_url()))
            .bearer_auth(TEST_SECRET_KEY)
            .header("idempotency-key", format!("elsewhere-{i}"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(
                url::form_urlencoded::Serializer::new(String::new())
                    .append_pair("amount", "500")
                    .append_pair("currency", "usd")
                    .append_pair("customer", customer)
                    .append_pair("payment_method", "pm_card_visa")
                    .append_pair("confirm", "true")
                    .append_pair("off_session", "true")
                    .finish(),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200, "{}", answer.text().await.unwrap());
    }
}

/// One open invoice whose auto-charge is answered as `first` says, charged
/// by one tick of a biller over `p`; then its customer's charges succeed.
/// Returns the biller, the customer and the tick's report.
async fn first_send(
    t: &TestDb,
    p: &FakeProvider,
    first: Behaviour,
) -> (billing::Biller, String, billing::TickReport) {
    let open = open_invoices(&t.db, 1).await;
    let customer = open[0].1.clone();
    p.set_behaviour(&customer, first);
    let (b, _) = biller(&t.db, charging(p));
    let report = tick(&t.db, &b).await;
    p.set_behaviour(&customer, Behaviour::Succeed);
    (b, customer, report)
}

/// [`first_send`] hanging (charged and stored, never answered), then 500
/// more of the customer's intents made: the attempt's is the 501st newest.
async fn hung_behind_500(t: &TestDb, p: &FakeProvider) -> billing::Biller {
    let (b, customer, first) = first_send(t, p, Behaviour::Hang).await;
    assert_eq!(first.charges.unknown, 1, "{first:?}");
    crowd(p, &customer, 500).await;
    b
}

/// The charge hangs (charged and stored, never answered), then 500 more of
/// the customer's intents are made: the attempt's is the 501st newest. The
/// lookup reads 500 without finding it; inside the resend window the same
/// request goes again, the provider answers its stored success, and the
/// invoice is paid with one charge under the key.
///
/// Mutation check: the unread rest not resent (`lookup_unread_resend`: as
/// past the window) leaves the attempt for review, and this test fails; the
/// lookup as it was (unknown again at every look) fails it too.
#[tokio::test]
async fn an_attempt_beyond_the_intents_read_is_resent_under_its_key_inside_the_window() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let b = hung_behind_500(&t, &p).await;
    after_the_lease().await;
    let report = tick(&t.db, &b).await;
    assert_eq!(report.reconciled.paid, 1, "{report:?}");
    assert_eq!(p.total_charges(), 501, "one charge under the attempt's key");
    assert_eq!(
        p.create_requests(),
        502,
        "the attempt, the crowd, the resend"
    );
    assert_eq!(
        strings(&t.db, "SELECT status FROM invoices").await,
        ["paid"]
    );
    after_the_lease().await;
    let again = tick(&t.db, &b).await;
    assert_eq!(again.reconciled, ReconcileTally::default(), "{again:?}");
}

/// The same past the resend window (the first send 13 h ago, the key maybe
/// forgotten): the attempt needs review, saying why, and is never sent again.
///
/// Mutation check: the unread rest read as no answer (`lookup_unread_unknown`:
/// unknown again, as before) leaves the attempt unknown, and this test fails.
#[tokio::test]
async fn past_the_window_an_attempt_beyond_the_intents_read_needs_review() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let b = hung_behind_500(&t, &p).await;
    let mut su = t.superuser().await;
    sqlx::query("UPDATE payment_attempts SET first_sent_at = now() - interval '13 hours'")
        .execute(&mut su)
        .await
        .unwrap();
    after_the_lease().await;
    let report = tick(&t.db, &b).await;
    assert_eq!(report.reconciled.needs_review, 1, "{report:?}");
    assert_eq!(p.create_requests(), 501, "never sent again");
    let reason = strings(&t.db, "SELECT review_reason FROM invoices").await;
    assert!(reason[0].contains("500 newest"), "{reason:?}");
}

/// A 429 whose `Retry-After` is one second.
const RATE_LIMITED: Behaviour = Behaviour::RateLimited {
    retry_after_secs: 1,
};

/// Whether the one attempt is still never sent (`first_sent_at IS NULL`).
async fn never_sent(t: &TestDb) -> bool {
    t.db.fetch_one(sql(
        "SELECT first_sent_at IS NULL AS never FROM payment_attempts",
    ))
    .await
    .unwrap()
    .get("never")
}

/// Auto-charge's first send is answered 429 (refused before execution:
/// nothing stored under the key), so the attempt stays never sent. The
/// tenant then pauses collection: the attempt follows auto-charge's rule
/// (docs/adr/0071, 0081) and the paused invoice is not charged.
///
/// Mutation check: the 429 taken as a send (`rate_limited_unsent`: the stamp
/// kept, as before) lets the reconciler skip the rule and charge into the
/// pause, and this test fails.
#[tokio::test]
async fn a_first_send_refused_with_429_leaves_the_attempt_never_sent() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (b, _, first) = first_send(&t, &p, RATE_LIMITED).await;
    assert_eq!(
        (p.create_requests(), p.total_charges()),
        (1, 0),
        "{first:?}"
    );
    assert_eq!(first.charges.released, 1, "{first:?}");
    assert!(never_sent(&t).await, "a 429 sent nothing");
    sqlx::query("UPDATE subscriptions SET pause_collection_behavior = 'keep_as_draft'")
        .execute(&mut t.superuser().await)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let report = tick(&t.db, &b).await;
    assert_eq!(
        (p.create_requests(), p.total_charges()),
        (1, 0),
        "{report:?}"
    );
    assert_eq!(
        strings(&t.db, "SELECT status FROM invoices").await,
        ["open"]
    );
}

/// A never-sent attempt (its first send refused with 429) is sent by the
/// reconciler without listing the customer's intents first: no request under
/// its key has left, so none carries it, and a refused or failed listing
/// would only have left the attempt counted as sent. It is paid by one send.
/// Its tenant's dunning window is closed: that holds dunning's retries, never
/// auto-charge's own first attempt (docs/adr/0147).
///
/// Mutation check: the listing made first (`never_sent_listed`: the
/// reconciler's branch for never-sent attempts removed) makes a list request,
/// and this test fails; so does the window held for a first attempt too
/// (`reconcile_window_holds_auto_charge`).
#[tokio::test]
async fn a_never_sent_attempt_is_sent_without_a_listing() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (b, _, _) = first_send(&t, &p, RATE_LIMITED).await;
    sqlx::query(
        "INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action, \
                is_default, window_time_zone, window_opens, window_closes, window_weekdays) \
         SELECT tenant_id, 'Closed now', '{60}', 'mark_uncollectible', true, 'UTC', \
                (now() AT TIME ZONE 'UTC' + interval '1 hour')::time, \
                (now() AT TIME ZONE 'UTC' + interval '2 hours')::time, '{1,2,3,4,5,6,7}' \
         FROM invoices LIMIT 1",
    )
    .execute(&mut t.superuser().await)
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let report = tick(&t.db, &b).await;
    assert_eq!(report.reconciled.paid, 1, "{report:?}");
    assert_eq!(
        (p.list_requests(), p.create_requests(), p.total_charges()),
        (0, 2, 1)
    );
    assert!(!never_sent(&t).await, "sent");
}

/// A resend refused before the provider's idempotency layer says nothing of
/// the first request (https://docs.stripe.com/error-low-level): here a legacy
/// key's first request charged, its answer was lost, and the card was then
/// detached, so the resend under the same key is answered 404
/// `resource_missing` on the payment method. The attempt needs review: it is
/// not declined (a `payment.failed`, and dunning charging again under a new
/// key). Mutation `resend_refusal_declines` (the reconciler takes the
/// resend's answer as it comes) and it is written `declined`.
#[tokio::test]
async fn a_resend_refused_before_the_key_is_checked_needs_review() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let first = legacy_attempt(&t, &p, Behaviour::Succeed).await;
    assert!(
        matches!(first, billing::provider::ChargeOutcome::Succeeded { .. }),
        "{first:?}"
    );
    let customer = strings(&t.db, "SELECT provider_customer_id FROM customers").await;
    p.set_behaviour(&customer[0], Behaviour::MissingPaymentMethod);
    let (b, _) = biller(&t.db, charging(&p));
    let report = tick(&t.db, &b).await;
    assert_eq!(
        (report.reconciled.needs_review, report.reconciled.declined),
        (1, 0),
        "{report:?}"
    );
    assert_eq!(
        strings(&t.db, "SELECT provider_status FROM payment_attempts").await,
        ["needs_review"]
    );
    assert_eq!(
        strings(
            &t.db,
            "SELECT event_type FROM webhook_events WHERE event_type LIKE 'payment.%'"
        )
        .await,
        Vec::<String>::new()
    );
    assert_eq!(p.total_charges(), 1);
}

/// A 200 to the listing that is not a list page (a proxy's stub, an empty
/// page that says it has more) says nothing of whether an intent carries the
/// key, so it is no proof that the first request never ran (docs/adr/0128).
/// The charge ran and its answer was a stored 500; the provider then forgot
/// the key, as a day later. Each body sends the attempt to review with
/// nothing sent again. Mutation `list_page_unread_absent` (such a body read
/// as an empty list, as before): the request is sent again as a first one
/// and the provider counts a second charge.
#[tokio::test]
async fn a_listing_that_is_not_a_list_page_needs_review_and_sends_nothing() {
    for body in [
        r#"{}"#,
        r#"{"object":"list","data":[]}"#,
        r#"{"object":"list","has_more":true,"data":[]}"#,
    ] {
        let t = TestDb::new().await;
        let p = FakeProvider::start().await.unwrap();
        let (b, _, first) =
            first_send(&t, &p, Behaviour::StoredServerError { with_intent: false }).await;
        assert_eq!(first.charges.unknown, 1, "{body}");
        p.prune_keys();
        p.set_list_body(Some(body));
        after_the_lease().await;
        let report = tick(&t.db, &b).await;
        assert_eq!(report.reconciled.needs_review, 1, "{body}: {report:?}");
        assert_eq!(p.list_requests(), 1, "{body}");
        assert_eq!(
            (p.total_charges(), p.create_requests()),
            (1, 1),
            "{body}: {:?}",
            p.charges()
        );
        assert_eq!(
            strings(&t.db, "SELECT provider_status FROM payment_attempts").await,
            ["needs_review"],
            "{body}"
        );
    }
}

/// Auto-charge's first send is answered 429 `lock_timeout` after the charge
/// was made (the fake stores that 429 under the key, as Stripe saves an
/// answer once execution began). The attempt is unknown, not never sent: the
/// reconciler lists the customer's intents, finds the succeeded one, and the
/// invoice is paid with the one charge, no second request under the key.
///
/// Mutation check: a fresh `lock_timeout` read as the rate limiter's 429
/// (`fresh_lock_timeout_not_sent`) leaves the attempt never sent, resent
/// without a listing at the next look (the replay is then unknown), so this
/// look pays nothing, and this test fails.
#[tokio::test]
async fn a_lock_timeout_after_the_charge_is_looked_up_and_paid_once() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (b, _, first) = first_send(&t, &p, Behaviour::StoredRateLimited).await;
    assert_eq!(first.charges.unknown, 1, "{first:?}");
    assert_eq!((p.create_requests(), p.total_charges()), (1, 1));
    assert!(
        !never_sent(&t).await,
        "the 429 came after the request began"
    );
    after_the_lease().await;
    let report = tick(&t.db, &b).await;
    assert_eq!(report.reconciled.paid, 1, "{report:?}");
    assert_eq!(
        (p.list_requests(), p.create_requests(), p.total_charges()),
        (1, 1, 1)
    );
    assert_eq!(
        strings(&t.db, "SELECT status FROM invoices").await,
        ["paid"]
    );
}
