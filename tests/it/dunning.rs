//! `hardcount serve` runs the dunning role when HARDCOUNT_ROLES names it,
//! charging the provider billing reads (BILLING_PROVIDER_URL).

use std::time::{Duration, Instant};

use db::{Row, sql};
use fake_provider::{FakeProvider, TEST_SECRET_KEY};
use testbed::{Leg, TestDb};

use crate::serve::Serve;

/// An invoice billing declined an hour ago, a policy retrying a second after
/// the decline, a card that now succeeds: the served dunning role enrols the
/// invoice, retries it and recovers the run, and /metrics counts it.
#[tokio::test]
async fn serve_runs_dunning_and_a_declined_invoice_recovers() {
    let t = TestDb::new().await;
    let provider = FakeProvider::start().await.unwrap();
    declined_an_invoice(&t, "{1, 2}", "pm_card_visa", "1 hour").await;
    let url = provider.base_url();
    let serve = Serve::start(
        &t.app_url(Leg::current()),
        &[
            ("HARDCOUNT_ROLES", "dunning"),
            ("HARDCOUNT_DUNNING_INTERVAL", "1s"),
            ("BILLING_PROVIDER_URL", url.as_str()),
            ("BILLING_PROVIDER_SECRET_KEY", TEST_SECRET_KEY),
        ],
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status: Option<String> =
            t.db.fetch_optional(sql("SELECT status FROM dunning_runs"))
                .await
                .unwrap()
                .map(|r| r.get("status"));
        if status.as_deref() == Some("recovered") {
            break;
        }
        assert!(Instant::now() < deadline, "no recovered run: {status:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(provider.total_charges(), 1);
    let (code, body) = serve.get("/metrics").await;
    assert_eq!(code, 200);
    assert!(
        body.contains("hardcount_dunning_recoveries_total 1"),
        "{body}"
    );
}

/// A replica whose clock is two hours behind the database's declines a
/// retry: the next one is written the policy's gap ahead on the database's
/// clock, as every due time is compared, and no second charge follows. The
/// policy retries a minute after the first decline, then an hour after it;
/// the first decline was a day ago, so the second retry is floored at the gap
/// (59 min) after this decline (docs/adr/0092). Before, the floor was reckoned
/// on the replica's clock: written already due, it was charged again at the
/// next tick, and the schedule ran out in seconds (docs/adr/0133). Mutation
/// `dunning_replica_clock` (the replica's clock again) fails it; seen failing.
#[tokio::test]
async fn a_replica_behind_the_database_clock_spaces_retries_by_the_database() {
    let faketime = crate::chaos::harness::LIBFAKETIME;
    assert!(
        std::path::Path::new(faketime).exists(),
        "{faketime} is missing: apt-get install faketime"
    );
    let t = TestDb::new().await;
    let provider = FakeProvider::start().await.unwrap();
    declined_an_invoice(&t, "{60, 3600, 7200}", "pm_card_chargeDeclined", "1 day").await;
    let url = provider.base_url();
    let _serve = Serve::start(
        &t.app_url(Leg::current()),
        &[
            ("HARDCOUNT_ROLES", "dunning"),
            ("HARDCOUNT_DUNNING_INTERVAL", "1s"),
            ("BILLING_PROVIDER_URL", url.as_str()),
            ("BILLING_PROVIDER_SECRET_KEY", TEST_SECRET_KEY),
            ("LD_PRELOAD", faketime),
            ("FAKETIME", "-2h"),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ],
    )
    .await;
    let run = || async {
        t.db.fetch_optional(sql("SELECT attempt_count, \
                    extract(epoch FROM next_attempt_at - now())::float8 AS ahead \
             FROM dunning_runs"))
            .await
            .unwrap()
            .map(|r| (r.get::<i32, _>("attempt_count"), r.get::<f64, _>("ahead")))
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while run().await.is_none_or(|(count, _)| count < 1) {
        assert!(
            Instant::now() < deadline,
            "no retry declined: {:?}",
            run().await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A few more ticks (1 s apart): none may charge again.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (count, ahead) = run().await.unwrap();
    assert_eq!(
        (count, provider.create_requests()),
        (1, 1),
        "ahead {ahead} s"
    );
    assert!(
        ahead > 3500.0,
        "the next retry is {ahead} s ahead on the database clock"
    );
}

/// Tenant A's default policy retrying at `offsets` (seconds after the first
/// decline, an SQL array literal), and one automatic invoice whose first
/// attempt was declined (`insufficient_funds`) `ago` (an SQL interval), its
/// customer's card now `card`: what billing leaves for dunning to enrol.
async fn declined_an_invoice(t: &TestDb, offsets: &str, card: &str, ago: &str) {
    sqlx::query(
        "WITH p AS ( \
           INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action, is_default) \
           VALUES ('tenant_a', 'Retries', $1::int4[], 'pause_collection', true)) \
         INSERT INTO customers (tenant_id, email, provider_customer_id, payment_method_id) \
         VALUES ('tenant_a', 'ada@example.org', 'cus_ada', $2)",
    )
    .bind(offsets)
    .bind(card)
    .execute(&mut t.superuser().await)
    .await
    .unwrap();
    sqlx::raw_sql(
        "INSERT INTO plans (tenant_id, name, amount, currency, interval_unit, interval_count) \
           VALUES ('tenant_a', 'Pro', 1200, 'EUR', 'month', 1); \
         INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor, \
                                    current_period_start, current_period_end, next_billing_at) \
           SELECT 'tenant_a', c.id, p.id, 'active', now(), now(), now() + interval '30 days', \
                  now() + interval '30 days' FROM customers c, plans p; \
         INSERT INTO invoices (tenant_id, subscription_id, period_start, period_end, amount, currency, \
                               collection_method, attempt_count) \
           SELECT 'tenant_a', id, now() - interval '30 days', now(), 1200, 'EUR', 'automatic', 1 \
           FROM subscriptions",
    )
    .execute(&mut t.superuser().await)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO payment_attempts (tenant_id, invoice_id, attempt_seq, idempotency_key, amount, \
                                       currency, provider_status, decline_code, resolved_at) \
         SELECT 'tenant_a', id, 1, 'hardcount-invoice-' || id || '-attempt-1', 1200, 'EUR', \
                'declined', 'insufficient_funds', now() - $1::interval FROM invoices",
    )
    .bind(ago)
    .execute(&mut t.superuser().await)
    .await
    .unwrap();
}
