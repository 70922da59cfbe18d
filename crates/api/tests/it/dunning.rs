//! The dunning policy's business window over HTTP (docs/adr/0045): checked by
//! field, read back as written, and followed by the dunning role's funnel for
//! the tenant's runs, those already scheduled included.

use std::sync::Arc;

use db::{Db, Row as _, sql};
use leader::{Role, Telemetry};
use reqwest::Method;
use serde_json::{Value, json};
use testbed::TestDb;
use testbed::leadership::{as_leader, manager};

use crate::{Served, serve, tenant};

const PATH: &str = "/v1/dunning/policy";

async fn put(s: &Served, key: &str, body: Value) -> crate::Answer {
    s.call(Method::PUT, PATH, key, Some(&body), None).await
}

/// A policy of one 60 s retry with `window` (`Value::Null`: none).
fn with_window(window: Value) -> Value {
    json!({"retry_offsets_secs": [60], "final_action": "mark_uncollectible", "business_window": window})
}

/// Each bad window is refused with a 400 naming its field; nothing written.
#[tokio::test]
async fn a_bad_business_window_is_refused_by_its_field() {
    let t = TestDb::new().await;
    let s = serve(&t).await;
    let key = tenant(&t, "tenant_a").await;
    let w = |zone: &str, opens: &str, closes: &str, days: Value| {
        with_window(json!({"time_zone": zone, "opens": opens, "closes": closes, "weekdays": days}))
    };
    let week = json!([1, 2, 3, 4, 5]);
    let cases: Vec<(Value, &str, &str)> = vec![
        (
            w("Mars/Base", "09:00", "17:00", week.clone()),
            "parameter_invalid",
            "business_window.time_zone",
        ),
        // Postgres would take a POSIX string; a tenant's zone is an IANA name.
        (
            w("XYZ5", "09:00", "17:00", week.clone()),
            "parameter_invalid",
            "business_window.time_zone",
        ),
        (
            w("Europe/Berlin", "9am", "17:00", week.clone()),
            "parameter_invalid",
            "business_window.opens",
        ),
        (
            w("Europe/Berlin", "25:00", "17:00", week.clone()),
            "parameter_out_of_range",
            "business_window.opens",
        ),
        (
            w("Europe/Berlin", "24:00", "17:00", week.clone()),
            "parameter_out_of_range",
            "business_window.opens",
        ),
        (
            w("Europe/Berlin", "09:00", "17:61", week.clone()),
            "parameter_out_of_range",
            "business_window.closes",
        ),
        (
            w("Europe/Berlin", "09:00", "09:00", week.clone()),
            "parameter_invalid",
            "business_window.closes",
        ),
        (
            w("Europe/Berlin", "09:00", "17:00", json!([])),
            "parameter_invalid",
            "business_window.weekdays",
        ),
        (
            w("Europe/Berlin", "09:00", "17:00", json!([1, 8])),
            "parameter_out_of_range",
            "business_window.weekdays[1]",
        ),
        (
            w("Europe/Berlin", "09:00", "17:00", json!([2, 2])),
            "parameter_invalid",
            "business_window.weekdays[1]",
        ),
        (
            w("Europe/Berlin", "09:00", "17:00", json!(["mon"])),
            "parameter_invalid_type",
            "business_window.weekdays[0]",
        ),
        (
            with_window(json!({"time_zone": "UTC", "opens": "09:00"})),
            "parameter_missing",
            "business_window.closes",
        ),
        (
            with_window(
                json!({"time_zone": "UTC", "opens": "09:00", "closes": "17:00", "days": [1]}),
            ),
            "parameter_unknown",
            "business_window.days",
        ),
    ];
    for (body, code, param) in cases {
        let r = put(&s, &key, body.clone()).await;
        assert_eq!(
            (r.status.as_u16(), r.refusal()),
            (400, (code.to_owned(), Some(param.to_owned()))),
            "{body}: {}",
            r.text
        );
    }
    let got = s.get(PATH, &key).await;
    assert_eq!(got.json["id"], Value::Null, "{}", got.text);
}

/// A window is written and read back as the tenant wrote it; weekdays left
/// out are all seven; a policy without one says null.
#[tokio::test]
async fn a_business_window_is_read_back_as_written() {
    let t = TestDb::new().await;
    let s = serve(&t).await;
    let key = tenant(&t, "tenant_a").await;
    assert_eq!(s.get(PATH, &key).await.json["business_window"], Value::Null);
    let window = json!({"time_zone": "Europe/Berlin", "opens": "09:00:30", "closes": "24:00",
                        "weekdays": [5, 1, 2]});
    let w = put(&s, &key, with_window(window.clone())).await;
    assert_eq!(w.status, 200, "{}", w.text);
    assert_eq!(w.json["business_window"], window);
    assert_eq!(s.get(PATH, &key).await.json, w.json);
    let every_day = put(
        &s,
        &key,
        with_window(json!({"time_zone": "Asia/Kolkata", "opens": "22:00", "closes": "06:00:00"})),
    )
    .await;
    assert_eq!(
        every_day.json["business_window"],
        json!({"time_zone": "Asia/Kolkata", "opens": "22:00", "closes": "06:00",
               "weekdays": [1, 2, 3, 4, 5, 6, 7]}),
        "{}",
        every_day.text
    );
    let none = put(&s, &key, with_window(Value::Null)).await;
    assert_eq!(
        (none.status.as_u16(), &none.json["business_window"]),
        (200, &Value::Null)
    );
}

/// The local time in `zone` `secs` seconds from the database's now.
async fn local(db: &Db, zone: &str, secs: f64) -> String {
    db.fetch_one(
        sql("SELECT to_char((now() + make_interval(secs => $2)) AT TIME ZONE $1, 'HH24:MI:SS') AS t")
            .bind(zone.to_owned())
            .bind(secs),
    )
    .await
    .unwrap()
    .get("t")
}

/// An open automatic invoice of `tenant` whose charge was declined an hour ago.
pub async fn declined_invoice(t: &TestDb, tenant: &str) -> i64 {
    let writer = t.api_as(tenant);
    let customer: i64 = writer
        .fetch_one(sql(
            "INSERT INTO customers (tenant_id, email, name, provider_customer_id, payment_method_id) \
             VALUES (api_tenant(), 'ada@example.org', 'Ada', 'cus_window', 'pm_card_visa') RETURNING id",
        ))
        .await
        .unwrap()
        .get("id");
    let plan: i64 = writer
        .fetch_one(sql(
            "INSERT INTO plans (tenant_id, name, amount, currency, interval_unit, interval_count) \
             VALUES (api_tenant(), 'Pro', 1200, 'EUR', 'month', 1) RETURNING id",
        ))
        .await
        .unwrap()
        .get("id");
    let subscription: i64 = writer
        .fetch_one(
            sql("INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor, \
                                            current_period_start, current_period_end, next_billing_at) \
                 VALUES (api_tenant(), $1, $2, 'active', now() - interval '30 days', now(), \
                         now() + interval '30 days', now() + interval '30 days') RETURNING id")
            .bind(customer)
            .bind(plan),
        )
        .await
        .unwrap()
        .get("id");
    let invoice: i64 =
        t.db.fetch_one(
            sql("INSERT INTO invoices (tenant_id, subscription_id, period_start, period_end, amount, \
                                       currency, collection_method) \
                 VALUES ($1, $2, now() - interval '30 days', now(), 1200, 'EUR', 'automatic') RETURNING id")
            .bind(tenant.to_owned())
            .bind(subscription),
        )
        .await
        .unwrap()
        .get("id");
    t.db.execute(
        // The attempt raises the invoice's count, as billing's attempts insert
        // does (migration 0038).
        sql("WITH a AS ( \
               INSERT INTO payment_attempts (tenant_id, invoice_id, attempt_seq, idempotency_key, \
                                             amount, currency, provider_status, decline_code, resolved_at) \
               VALUES ($1, $2, 1, 'k-' || $2, 1200, 'EUR', 'declined', 'insufficient_funds', \
                       now() - interval '1 hour') \
               RETURNING invoice_id) \
             UPDATE invoices SET attempt_count = attempt_count + 1 \
             WHERE id IN (SELECT invoice_id FROM a)")
        .bind(tenant.to_owned())
        .bind(invoice),
    )
    .await
    .unwrap();
    invoice
}

/// Enrol, then list the due runs, as the leader of `dunning`.
async fn listed(db: &Db, d: &dunning::Dunner) -> Vec<dunning::Run> {
    let d = d.clone();
    as_leader(&manager(db, "dunner"), Role::Dunning, |tick| async move {
        d.enrol(&tick.fence).await.unwrap();
        d.list_due(&tick.fence, 10).await.unwrap()
    })
    .await
}

/// A policy with a window closed now, written through the API: the run
/// enrolled with it is not listed by the dunning role's funnel. A new policy
/// whose window (in the tenant's zone, 9 h from the database's UTC) is open
/// now lists that run, which keeps its first policy.
///
/// Guard: the funnel's window predicate (`dunning_window`); the dunning
/// crate's tests pin it, and this one fails with it removed as well.
#[tokio::test]
async fn a_window_written_through_the_api_holds_the_tenants_runs_already_scheduled() {
    let t = TestDb::new().await;
    let s = serve(&t).await;
    let key = tenant(&t, "tenant_a").await;
    let zone = "Asia/Tokyo";
    let window = |opens: String, closes: String| {
        with_window(json!({"time_zone": zone, "opens": opens, "closes": closes}))
    };
    let closed = put(
        &s,
        &key,
        window(
            local(&t.db, zone, 7200.0).await,
            local(&t.db, zone, 10_800.0).await,
        ),
    )
    .await;
    assert_eq!(closed.status, 200, "{}", closed.text);
    let first = closed.json["id"].as_i64().unwrap();
    let invoice = declined_invoice(&t, "tenant_a").await;
    let telemetry = Telemetry::noop();
    let biller = billing::Biller::new(
        t.db.clone(),
        billing::BillingConfig::default(),
        telemetry.clone(),
    )
    .unwrap();
    let dunner = dunning::Dunner::new(
        t.db.clone(),
        dunning::DunningConfig::default(),
        Arc::new(biller),
        telemetry,
    )
    .unwrap();
    assert!(listed(&t.db, &dunner).await.is_empty());
    let open = put(
        &s,
        &key,
        window(
            local(&t.db, zone, -3600.0).await,
            local(&t.db, zone, 3600.0).await,
        ),
    )
    .await;
    assert_eq!(open.status, 200, "{}", open.text);
    let runs = listed(&t.db, &dunner).await;
    assert_eq!(
        runs.iter()
            .map(|r| (r.invoice_id, r.policy_id))
            .collect::<Vec<_>>(),
        [(invoice, first)]
    );
}
