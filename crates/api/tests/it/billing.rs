//! Customers, plans, subscriptions, invoices and dunning over HTTP. Here the
//! bed the tests share (two tenants' keys on one served API) and its helpers;
//! the tests, by resource, in the modules below.

mod customers;
mod dunning;
mod plans;
mod proration;
mod subscriptions;

use db::{Row as _, sql};
use reqwest::Method;
use serde_json::{Value, json};
use testbed::TestDb;

use crate::{Answer, Served, serve, tenant};

/// A request `(method, path, body)` and the refusal it must get: `(status, code, param)`.
type Refusal<'a> = (Method, String, Option<Value>, u16, &'a str, &'a str);

/// Two tenants' keys on one served API.
struct Bed {
    t: TestDb,
    s: Served,
    a: String,
    b: String,
}

async fn bed() -> Bed {
    let t = TestDb::new().await;
    let s = serve(&t).await;
    let a = tenant(&t, "tenant_a").await;
    let b = tenant(&t, "tenant_b").await;
    Bed { t, s, a, b }
}

impl Bed {
    async fn created(&self, key: &str, path: &str, body: Value) -> Value {
        let r = self.s.post(path, key, body).await;
        assert_eq!(r.status, 201, "{path}: {}", r.text);
        r.json
    }

    async fn customer(&self, key: &str) -> i64 {
        self.created(
            key,
            "/v1/customers",
            json!({"email": "ada@example.org", "name": "Ada",
                   "provider_customer_id": format!("cus_{}", rand_suffix()),
                   "payment_method": "pm_card_visa"}),
        )
        .await["id"]
            .as_i64()
            .unwrap()
    }

    async fn plan(&self, key: &str, currency: &str, amount: i64) -> i64 {
        self.created(
            key,
            "/v1/plans",
            json!({"name": "Pro", "amount": amount, "currency": currency,
                   "interval": "month", "interval_count": 1}),
        )
        .await["id"]
            .as_i64()
            .unwrap()
    }

    /// A subscription of a new customer to `plan`, trialing for ten days.
    async fn trialing(&self, key: &str, plan: i64) -> Value {
        let customer = self.customer(key).await;
        let near = (chrono::Utc::now() + chrono::TimeDelta::days(10)).to_rfc3339();
        self.created(
            key,
            "/v1/subscriptions",
            json!({"customer": customer, "plan": plan, "trial_end": near}),
        )
        .await
    }

    async fn subscription(&self, key: &str, plan: i64) -> Value {
        let customer = self.customer(key).await;
        self.created(
            key,
            "/v1/subscriptions",
            json!({"customer": customer, "plan": plan}),
        )
        .await
    }

    /// Each `(method, path, body)` is refused with `(status, code, param)`.
    async fn check_refusals(&self, key: &str, cases: &[Refusal<'_>]) {
        for (method, path, body, status, code, param) in cases {
            let r: Answer = self
                .s
                .call(method.clone(), path, key, body.as_ref(), None)
                .await;
            assert_eq!(
                (r.status.as_u16(), r.refusal()),
                (*status, (code.to_string(), Some(param.to_string()))),
                "{method} {path} {body:?}: {}",
                r.text
            );
        }
    }
}

fn rand_suffix() -> String {
    format!("{:016x}", rand_u64())
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .elapsed()
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0),
    );
    h.finish()
}

async fn events(t: &TestDb) -> Vec<String> {
    t.db.fetch_all(sql("SELECT event_type FROM webhook_events ORDER BY id"))
        .await
        .unwrap()
        .iter()
        .map(|r| r.get("event_type"))
        .collect()
}

/// A subscription whose period began `days` days ago (as billing's seeders
/// write it), so a change or cancel now has a used part to invoice.
async fn begun(b: &Bed, plan: i64, days: i32) -> i64 {
    let s = b.subscription(&b.a, plan).await;
    let id = s["id"].as_i64().unwrap();
    b.t.db
        .execute(
            sql("UPDATE subscriptions SET current_period_start = now() - make_interval(days => $2), \
                        current_period_end = now() - make_interval(days => $2) + interval '1 month', \
                        next_billing_at = now() - make_interval(days => $2) + interval '1 month' \
                 WHERE id = $1")
            .bind(id)
            .bind(days),
        )
        .await
        .unwrap();
    id
}
