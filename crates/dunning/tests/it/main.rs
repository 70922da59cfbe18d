//! Dunning against real Postgres and the fake provider over HTTP, directly and
//! through PgBouncer.
//!
//! Each guard test names, in its comment, the mutation that makes it fail and
//! that it was seen failing under (`scripts/mutation-check`).

mod bad_rows;
mod final_action;
mod guards;
mod never_analyzed;
mod reconcile;
mod retention;
mod runs;
mod window_rule;
mod windows;

use std::sync::Arc;
use std::time::Duration;

use billing::{Biller, BillingConfig, ProviderConfig, SecretKey};
use db::{Db, Row, sql};
use dunning::{Dunner, DunningConfig, TickReport};
use fake_provider::{FakeProvider, TEST_SECRET_KEY};
use leader::{Role, Telemetry};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

pub use testbed::leadership::{as_leader, manager, patient_manager};

pub fn config() -> DunningConfig {
    DunningConfig {
        tick_budget: Duration::from_secs(30),
        statement_timeout: Duration::from_secs(10),
        ..DunningConfig::default()
    }
}

/// Billing's settings charging `provider` with this call timeout.
pub fn billing(provider: &FakeProvider, timeout: Duration) -> BillingConfig {
    BillingConfig {
        statement_timeout: Duration::from_secs(10),
        provider: Some(ProviderConfig {
            base_url: provider.base_url(),
            secret_key: SecretKey::new(TEST_SECRET_KEY),
            timeout,
        }),
        ..BillingConfig::default()
    }
}

/// A dunner charging `provider` (timeout `timeout`), and its metrics.
pub fn dunner(
    db: &Db,
    provider: &FakeProvider,
    timeout: Duration,
    config: DunningConfig,
) -> (Dunner, PrometheusHandle) {
    dunner_with(db, billing(provider, timeout), config)
}

/// A dunner whose retries charge with `billing`'s settings, and its metrics.
pub fn dunner_with(
    db: &Db,
    billing: BillingConfig,
    config: DunningConfig,
) -> (Dunner, PrometheusHandle) {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let telemetry = Telemetry::new(Arc::new(recorder));
    let biller = Biller::new(db.clone(), billing, telemetry.clone()).unwrap();
    let d = Dunner::new(db.clone(), config, Arc::new(biller), telemetry).unwrap();
    (d, handle)
}

/// One tick as the leader of `dunning`, under a lease that tolerates
/// renewals answered seconds late (`testbed::leadership::patient_timing`):
/// these tests are about the tick's work, not its lease.
pub async fn tick(db: &Db, d: &Dunner) -> TickReport {
    let d = d.clone();
    as_leader(
        &patient_manager(db, "dunner"),
        Role::Dunning,
        |tick| async move { d.run_tick(&tick).await },
    )
    .await
}

/// `tenant`'s default policy: retries 60, 120, … s after the first decline
/// (`retries` of them), a warning after retry 1, a final notice, `action`.
pub async fn policy(db: &Db, tenant: &str, retries: usize, action: &str) -> i64 {
    let offsets: Vec<i64> = (1..=retries as i64).map(|n| 60 * n).collect();
    db.fetch_one(
        sql(
            "INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action, \
                                           warn_after, final_notice, is_default) \
             VALUES ($1, 'Test', $2, $3, '{1}', true, true) RETURNING id",
        )
        .bind(tenant.to_owned())
        .bind(offsets)
        .bind(action.to_owned()),
    )
    .await
    .unwrap()
    .get("id")
}

/// An open automatic invoice of 1200 EUR whose first attempt billing
/// recorded as declined an hour ago (so every retry of a test policy is due).
#[derive(Debug, Clone)]
pub struct Declined {
    pub invoice: i64,
    pub subscription: i64,
    /// The customer's `cus_…`, to tell the fake provider how to answer.
    pub customer: String,
}

pub async fn declined_invoice(db: &Db, tenant: &str) -> Declined {
    let tenant = tenant.to_owned();
    let api = testbed::tenant_writer(db, &tenant);
    let c = api
        .fetch_one(
            sql("INSERT INTO customers (tenant_id, email, name, provider_customer_id, payment_method_id) \
                 VALUES ($1, 'ada@example.org', 'Ada', 'cus_' || md5(random()::text), 'pm_card_visa') \
                 RETURNING id, provider_customer_id")
            .bind(tenant.clone()),
        )
        .await
        .unwrap();
    let plan: i64 = api
        .fetch_one(
            sql("INSERT INTO plans (tenant_id, name, amount, currency, interval_unit, interval_count) \
                 VALUES ($1, 'Pro', 1200, 'EUR', 'month', 1) RETURNING id")
            .bind(tenant.clone()),
        )
        .await
        .unwrap()
        .get("id");
    let subscription: i64 = api
        .fetch_one(
            sql("INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor, \
                                            current_period_start, current_period_end, next_billing_at) \
                 VALUES ($1, $2, $3, 'active', now() - interval '30 days', now(), \
                         now() + interval '30 days', now() + interval '30 days') RETURNING id")
            .bind(tenant.clone())
            .bind(c.get::<i64, _>("id"))
            .bind(plan),
        )
        .await
        .unwrap()
        .get("id");
    let invoice: i64 = db
        .fetch_one(
            sql("INSERT INTO invoices (tenant_id, subscription_id, period_start, period_end, amount, \
                                       currency, collection_method) \
                 VALUES ($1, $2, now() - interval '30 days', now(), 1200, 'EUR', 'automatic') \
                 RETURNING id")
            .bind(tenant.clone())
            .bind(subscription),
        )
        .await
        .unwrap()
        .get("id");
    db.execute(
        // The attempt raises the invoice's count, as billing's attempts insert
        // does (migration 0038): enrolment reads only invoices attempted.
        sql("WITH a AS ( \
               INSERT INTO payment_attempts (tenant_id, invoice_id, attempt_seq, idempotency_key, \
                                             amount, currency, provider_status, decline_code, resolved_at) \
               VALUES ($1, $2, 1, 'hardcount-invoice-' || $2 || '-attempt-1', 1200, 'EUR', \
                       'declined', 'insufficient_funds', now() - interval '1 hour') \
               RETURNING invoice_id) \
             UPDATE invoices SET attempt_count = attempt_count + 1 \
             WHERE id IN (SELECT invoice_id FROM a)")
        .bind(tenant)
        .bind(invoice),
    )
    .await
    .unwrap();
    Declined {
        invoice,
        subscription,
        customer: c.get("provider_customer_id"),
    }
}

/// Enrol as the leader of `dunning` (runs exist, nothing retried), under the
/// patient lease as [`tick`].
pub async fn enrol(db: &Db, d: &Dunner) -> usize {
    let d = d.clone();
    as_leader(
        &patient_manager(db, "enroller"),
        Role::Dunning,
        |tick| async move { d.enrol(&tick.fence).await.unwrap() },
    )
    .await
}

/// The customer (by its `cus_…`) no longer has a payment method.
pub async fn remove_payment_method(db: &Db, customer: &str) {
    testbed::tenant_writer(db, "tenant_a")
        .execute(
            sql("UPDATE customers SET payment_method_id = NULL WHERE provider_customer_id = $1")
                .bind(customer.to_owned()),
        )
        .await
        .unwrap();
}

/// `payment.failed` events billing queued.
pub async fn payment_failed(db: &Db) -> i64 {
    db.fetch_one(sql(
        "SELECT count(*) AS n FROM webhook_events WHERE event_type = 'payment.failed'",
    ))
    .await
    .unwrap()
    .get("n")
}

/// Every active run scheduled later made due now, as its schedule's gap would
/// after a while. The test runs are declined an hour before their policy's
/// one-minute offsets, so a retry made now schedules the next one a minute on,
/// not at its passed offset (docs/adr/0092).
pub async fn due_now(db: &Db) {
    db.execute(sql("UPDATE dunning_runs SET next_attempt_at = now() \
         WHERE status = 'active' AND next_attempt_at > now()"))
        .await
        .unwrap();
}

/// Seconds from now to the run's next attempt.
pub async fn next_retry_in(db: &Db, invoice: i64) -> f64 {
    db.fetch_one(
        sql(
            "SELECT extract(epoch FROM next_attempt_at - now())::float8 AS s \
             FROM dunning_runs WHERE invoice_id = $1",
        )
        .bind(invoice),
    )
    .await
    .unwrap()
    .get("s")
}

/// Seconds from the run's first decline to its next attempt.
pub async fn next_retry_offset(db: &Db, invoice: i64) -> f64 {
    db.fetch_one(
        sql(
            "SELECT extract(epoch FROM next_attempt_at - first_declined_at)::float8 AS s \
             FROM dunning_runs WHERE invoice_id = $1",
        )
        .bind(invoice),
    )
    .await
    .unwrap()
    .get("s")
}

/// (status, attempt_count) of the run of `invoice`.
pub async fn run_of(db: &Db, invoice: i64) -> (String, i32) {
    let r = db
        .fetch_one(
            sql("SELECT status, attempt_count FROM dunning_runs WHERE invoice_id = $1")
                .bind(invoice),
        )
        .await
        .unwrap();
    (r.get("status"), r.get("attempt_count"))
}

pub async fn strings(db: &Db, q: &'static str) -> Vec<String> {
    db.fetch_all(sql(q))
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<String, _>(0))
        .collect()
}

/// Event types other than billing's, in order.
pub async fn events(db: &Db) -> Vec<String> {
    strings(
        db,
        "SELECT event_type FROM webhook_events \
         WHERE event_type NOT IN ('payment.failed', 'payment.succeeded', 'invoice.paid') ORDER BY id",
    )
    .await
}

/// Subjects of dunning's own emails (warnings and final notices), in order.
pub async fn dunning_emails(db: &Db) -> Vec<String> {
    strings(
        db,
        "SELECT subject FROM email_outbox \
         WHERE subject LIKE '%we will retry' OR subject LIKE 'Final notice%' ORDER BY id",
    )
    .await
}

pub async fn invoice_status(db: &Db, id: i64) -> String {
    db.fetch_one(sql("SELECT status FROM invoices WHERE id = $1").bind(id))
        .await
        .unwrap()
        .get("status")
}

/// The attempt sequences of `invoice` the provider was asked about, in order
/// (the first is billing's, written by the fixture).
pub async fn attempts(db: &Db, invoice: i64) -> Vec<(i32, String)> {
    db.fetch_all(
        sql("SELECT attempt_seq, provider_status FROM payment_attempts \
             WHERE invoice_id = $1 ORDER BY attempt_seq")
        .bind(invoice),
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

pub use testbed::payments::attempt_key;

/// A trigger that refuses every update of `dunning_runs` for which `when`
/// (over `OLD` and `NEW`) holds, standing in for a write that fails or a
/// process that dies before it; [`allow_run_updates`] takes it away.
pub async fn refuse_run_updates(t: &testbed::TestDb, name: &str, when: &str) {
    t.refuse_updates("dunning_runs", name, when).await;
}

/// Take away the trigger [`refuse_run_updates`] made.
pub async fn allow_run_updates(t: &testbed::TestDb, name: &str) {
    t.allow_updates("dunning_runs", name).await;
}
