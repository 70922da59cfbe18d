//! Billing against real Postgres, directly and through PgBouncer.
//!
//! Each guard test names, in its comment, the mutation that makes it fail and
//! that it was seen failing under (`scripts/mutation-check`).

mod batch;
mod cancel;
mod charges;
mod drain;
mod gauges;
mod guards;
mod invoicing;
mod lifecycle;
mod lookup;
mod periods;
mod plans;
mod reconcile;
mod record;
mod retention;
mod tenants;

use std::sync::Arc;
use std::time::Duration;

use billing::{Biller, BillingConfig, ProviderConfig, SecretKey, TickReport};
use chrono::{DateTime, Utc};
use db::{Db, Row, sql};
use fake_provider::{FakeProvider, TEST_SECRET_KEY};
use leader::{Role, Telemetry};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

pub use testbed::leadership::{as_leader, manager, patient_manager};

pub fn config() -> BillingConfig {
    BillingConfig {
        tick_budget: Duration::from_secs(30),
        statement_timeout: Duration::from_secs(10),
        ..BillingConfig::default()
    }
}

/// [`config`] charging through the fake provider `p`, each call bounded by `timeout`.
pub fn charging(p: &FakeProvider, timeout: Duration) -> BillingConfig {
    BillingConfig {
        provider: Some(ProviderConfig {
            base_url: p.base_url(),
            secret_key: SecretKey::new(TEST_SECRET_KEY),
            timeout,
        }),
        ..config()
    }
}

pub fn biller(db: &Db, config: BillingConfig) -> (Biller, PrometheusHandle) {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let b = Biller::new(db.clone(), config, Telemetry::new(Arc::new(recorder))).unwrap();
    (b, handle)
}

/// A plan of `amount` EUR minor units every `count` `unit`s, and its id,
/// written as the tenant API writes it.
pub async fn plan(db: &Db, tenant: &str, unit: &str, count: i32, amount: i64) -> i64 {
    plan_as(
        &testbed::tenant_writer(db, tenant),
        tenant,
        unit,
        count,
        amount,
    )
    .await
}

async fn plan_as(
    api: &testbed::TenantWriter,
    tenant: &str,
    unit: &str,
    count: i32,
    amount: i64,
) -> i64 {
    api.fetch_one(
        sql(
            "INSERT INTO plans (tenant_id, name, amount, currency, interval_unit, interval_count) \
             VALUES ($1, 'Pro', $2, 'EUR', $3, $4) RETURNING id",
        )
        .bind(tenant.to_owned())
        .bind(amount)
        .bind(unit.to_owned())
        .bind(count),
    )
    .await
    .unwrap()
    .get("id")
}

/// An active subscription of a new customer to `plan`, anchored at `anchor`,
/// in the period `[start, end)` with its watermark at `end`, written as the
/// tenant API writes them.
pub async fn subscription(
    db: &Db,
    tenant: &str,
    plan: i64,
    anchor: DateTime<Utc>,
    start: DateTime<Utc>,
    end: DateTime<Utc>,
) -> i64 {
    let api = testbed::tenant_writer(db, tenant);
    subscription_as(&api, tenant, plan, anchor, start, end).await
}

async fn subscription_as(
    api: &testbed::TenantWriter,
    tenant: &str,
    plan: i64,
    anchor: DateTime<Utc>,
    start: DateTime<Utc>,
    end: DateTime<Utc>,
) -> i64 {
    let customer: i64 = api
        .fetch_one(
            sql("INSERT INTO customers (tenant_id, email, name, provider_customer_id, payment_method_id) \
                 VALUES ($1, 'ada@example.org', 'Ada', 'cus_' || md5(random()::text), 'pm_card_visa') \
                 RETURNING id")
            .bind(tenant.to_owned()),
        )
        .await
        .unwrap()
        .get("id");
    api.fetch_one(
        sql(
            "INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor, \
                                        current_period_start, current_period_end, next_billing_at) \
             VALUES ($1, $2, $3, 'active', $4, $5, $6, $6) RETURNING id",
        )
        .bind(tenant.to_owned())
        .bind(customer)
        .bind(plan)
        .bind(anchor)
        .bind(start)
        .bind(end),
    )
    .await
    .unwrap()
    .get("id")
}

/// `n` monthly subscriptions whose period ended a minute ago; the next one
/// ends a month later, so each is due exactly once.
pub async fn due_monthly(db: &Db, tenant: &str, n: usize) -> Vec<i64> {
    let api = testbed::tenant_writer(db, tenant);
    let p = plan_as(&api, tenant, "month", 1, 1200).await;
    let end = Utc::now() - chrono::TimeDelta::minutes(1);
    let start = end - chrono::TimeDelta::days(30);
    let mut ids = Vec::new();
    for _ in 0..n {
        ids.push(subscription_as(&api, tenant, p, start, start, end).await);
    }
    ids
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invoice {
    pub subscription: i64,
    pub start: DateTime<Utc>,
    pub end: DateTime<Utc>,
    pub amount: i64,
}

pub async fn invoices(db: &Db) -> Vec<Invoice> {
    db.fetch_all(sql(
        "SELECT subscription_id, period_start, period_end, amount FROM invoices \
         ORDER BY subscription_id, period_start",
    ))
    .await
    .unwrap()
    .iter()
    .map(|r| Invoice {
        subscription: r.get("subscription_id"),
        start: r.get("period_start"),
        end: r.get("period_end"),
        amount: r.get("amount"),
    })
    .collect()
}

/// The invoice ids announced by `invoice.finalized` events, in event order.
pub async fn finalized(db: &Db) -> Vec<i64> {
    db.fetch_all(sql(
        "SELECT (payload->>'id')::bigint AS id FROM webhook_events \
         WHERE event_type = 'invoice.finalized' ORDER BY id",
    ))
    .await
    .unwrap()
    .iter()
    .map(|r| r.get("id"))
    .collect()
}

/// (period start, period end, watermark) of a subscription.
pub async fn period(db: &Db, id: i64) -> (DateTime<Utc>, DateTime<Utc>, DateTime<Utc>) {
    let r = db
        .fetch_one(
            sql(
                "SELECT current_period_start, current_period_end, next_billing_at \
                 FROM subscriptions WHERE id = $1",
            )
            .bind(id),
        )
        .await
        .unwrap();
    (
        r.get("current_period_start"),
        r.get("current_period_end"),
        r.get("next_billing_at"),
    )
}

/// `b` pauses `sub`'s collection (`tenant_a`'s) in a committed transaction
/// of its own, as the API does.
pub async fn pause_through(
    db: &Db,
    b: &Biller,
    sub: i64,
    behavior: &str,
    resumes_at: Option<DateTime<Utc>>,
) -> billing::CollectionPause {
    let mut tx = db.begin().await.unwrap();
    let pause = b
        .pause_collection_in(&mut tx, "tenant_a", sub, behavior, resumes_at)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    pause
}

/// `b` resumes `sub`'s collection (`tenant_a`'s) in a committed
/// transaction of its own; the pause cleared.
pub async fn resume_through(db: &Db, b: &Biller, sub: i64) -> billing::CollectionPause {
    let mut tx = db.begin().await.unwrap();
    let pause = b
        .resume_collection_in(&mut tx, "tenant_a", sub)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    pause
}

/// One tick as the leader of `billing`, under a lease that tolerates renewals
/// answered seconds late (`testbed::leadership::patient_timing`).
pub async fn tick(db: &Db, b: &Biller) -> TickReport {
    let b = b.clone();
    as_leader(
        &patient_manager(db, "biller"),
        Role::Billing,
        |tick| async move { b.run_tick(&tick).await },
    )
    .await
}

pub use testbed::payments::attempt_key;

/// (invoice, `cus_…`) of every invoice, in id order, after a tick without a
/// provider billed `n` subscriptions.
pub async fn open_invoices(db: &Db, n: usize) -> Vec<(i64, String)> {
    due_monthly(db, "tenant_a", n).await;
    let (b, _) = biller(db, config());
    assert_eq!(tick(db, &b).await.tally.invoiced, n);
    db.fetch_all(sql("SELECT i.id, c.provider_customer_id FROM invoices i \
         JOIN subscriptions s ON s.id = i.subscription_id \
         JOIN customers c ON c.id = s.customer_id ORDER BY i.id"))
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get("id"), r.get("provider_customer_id")))
        .collect()
}

/// The first column of every row of `q`, as the query orders them.
/// An invoice's status.
pub async fn invoice_status(db: &Db, id: i64) -> String {
    db.fetch_one(sql("SELECT status FROM invoices WHERE id = $1").bind(id))
        .await
        .unwrap()
        .get("status")
}

/// Close (uncollectible) every invoice as a claim takes it, by a trigger on
/// the claim's new lease: its call is then made on an invoice no longer
/// open, as if an operator closed it mid-call.
pub async fn close_invoices_as_claimed(t: &testbed::TestDb) {
    sqlx::raw_sql(
        "CREATE FUNCTION close_on_claim() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN \
           IF NEW.auto_charge_claimed_until > coalesce(OLD.auto_charge_claimed_until, '-infinity') \
           THEN NEW.status := 'uncollectible'; NEW.closed_at := now(); END IF; \
           RETURN NEW; \
         END $$; \
         CREATE TRIGGER close_on_claim BEFORE UPDATE ON invoices \
           FOR EACH ROW EXECUTE FUNCTION close_on_claim();",
    )
    .execute(&mut t.superuser().await)
    .await
    .unwrap();
}

pub async fn strings(db: &Db, q: &'static str) -> Vec<String> {
    db.fetch_all(sql(q))
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<String, _>(0))
        .collect()
}
