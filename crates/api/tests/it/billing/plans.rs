//! Plans over HTTP: created as the table allows, each refusal naming its
//! field, another tenant's plan missing.

use reqwest::Method;
use serde_json::{Value, json};

use super::bed;

#[tokio::test]
async fn plans_are_created_as_the_table_allows_and_refused_by_field() {
    let b = bed().await;
    let plan = b
        .created(
            &b.a,
            "/v1/plans",
            json!({"name": "Pro", "amount": 1999, "currency": "EUR", "interval": "week", "interval_count": 2}),
        )
        .await;
    assert_eq!(
        (
            plan["amount"].as_i64(),
            plan["currency"].as_str(),
            plan["interval"].as_str(),
            plan["interval_count"].as_i64()
        ),
        (Some(1999), Some("EUR"), Some("week"), Some(2))
    );
    let id = plan["id"].as_i64().unwrap();
    assert_eq!(b.s.get(&format!("/v1/plans/{id}"), &b.a).await.json, plan);
    assert_eq!(b.s.get("/v1/plans", &b.a).await.json["data"][0], plan);
    // The most the provider takes in one payment is a price (docs/adr/0117).
    for (amount, currency) in [(99_999_999_i64, "EUR"), (999_999_999_999, "IDR")] {
        b.created(
            &b.a,
            "/v1/plans",
            json!({"name": "Most", "amount": amount, "currency": currency, "interval": "month"}),
        )
        .await;
    }
    let ok = json!({"name": "Pro", "amount": 1, "currency": "EUR", "interval": "month"});
    let with = |k: &str, v: Value| {
        let mut o = ok.clone();
        o[k] = v;
        Some(o)
    };
    let p = Method::POST;
    let path = "/v1/plans".to_string();
    b.check_refusals(
        &b.a,
        &[
            (
                p.clone(),
                path.clone(),
                with("amount", json!(0)),
                400,
                "parameter_out_of_range",
                "amount",
            ),
            (
                p.clone(),
                path.clone(),
                with("amount", json!(-5)),
                400,
                "parameter_out_of_range",
                "amount",
            ),
            // A three-decimal currency is charged in tens of its minor unit
            // (docs/adr/0086): 1.235 KWD cannot be charged.
            (
                p.clone(),
                path.clone(),
                Some(
                    json!({"name": "Pro", "amount": 1235, "currency": "KWD", "interval": "month"}),
                ),
                400,
                "parameter_invalid",
                "amount",
            ),
            // More than the provider charges in one payment (eight digits
            // of its minor units): every charge would go to review. In ISK
            // the provider counts hundredths, so 1,000,000 ISK is too much
            // (docs/adr/0117; mutation `plan_amount_unbounded`).
            (
                p.clone(),
                path.clone(),
                with("amount", json!(100_000_000)),
                400,
                "parameter_out_of_range",
                "amount",
            ),
            (
                p.clone(),
                path.clone(),
                Some(
                    json!({"name": "Pro", "amount": 1_000_000, "currency": "ISK", "interval": "month"}),
                ),
                400,
                "parameter_out_of_range",
                "amount",
            ),
            // IDR has twelve digits: 10,000,000,000.00 IDR is one too many.
            (
                p.clone(),
                path.clone(),
                Some(
                    json!({"name": "Pro", "amount": 1_000_000_000_000_i64, "currency": "IDR", "interval": "month"}),
                ),
                400,
                "parameter_out_of_range",
                "amount",
            ),
            // Past bigint: refused by the body's type, never a 500.
            (
                p.clone(),
                path.clone(),
                with("amount", json!(1e20)),
                400,
                "parameter_invalid_type",
                "amount",
            ),
            (
                p.clone(),
                path.clone(),
                with("amount", json!(9_223_372_036_854_775_808u64)),
                400,
                "parameter_invalid",
                "amount",
            ),
            (
                p.clone(),
                path.clone(),
                with("currency", json!("eur")),
                400,
                "parameter_invalid",
                "currency",
            ),
            (
                p.clone(),
                path.clone(),
                with("currency", json!("EURO")),
                400,
                "parameter_invalid",
                "currency",
            ),
            (
                p.clone(),
                path.clone(),
                with("interval", json!("fortnight")),
                400,
                "parameter_invalid",
                "interval",
            ),
            // Demo units, refused unless the deployment allows them
            // (docs/adr/0152; mutation `short_plans_allowed`).
            (
                p.clone(),
                path.clone(),
                with("interval", json!("minute")),
                400,
                "parameter_invalid",
                "interval",
            ),
            (
                p.clone(),
                path.clone(),
                with("interval", json!("hour")),
                400,
                "parameter_invalid",
                "interval",
            ),
            (
                p.clone(),
                path.clone(),
                with("interval_count", json!(0)),
                400,
                "parameter_out_of_range",
                "interval_count",
            ),
            (
                p.clone(),
                path.clone(),
                with("interval_count", json!(1001)),
                400,
                "parameter_out_of_range",
                "interval_count",
            ),
            (
                p.clone(),
                path.clone(),
                with("name", json!("")),
                400,
                "parameter_invalid",
                "name",
            ),
            (
                p.clone(),
                path.clone(),
                with("name", json!("a\u{0}b")),
                400,
                "parameter_invalid",
                "name",
            ),
        ],
    )
    .await;
    b.check_refusals(
        &b.b,
        &[(
            Method::GET,
            format!("/v1/plans/{id}"),
            None,
            404,
            "resource_missing",
            "id",
        )],
    )
    .await;
}

/// A deployment that allows short plans (`HARDCOUNT_API_SHORT_PLANS`, as
/// `hardcount dev` sets it) takes minute and hour plans (docs/adr/0152).
#[tokio::test]
async fn minute_and_hour_plans_where_the_deployment_allows_them() {
    let t = testbed::TestDb::new().await;
    let keyring = webhook_delivery::Keyring::parse(testbed::SECRETS_KEY).unwrap();
    let config = api::ApiConfig {
        short_plans: true,
        ..crate::config()
    };
    let s = crate::serve_api(api::Api::new(t.api(), Some(keyring), config)).await;
    let key = crate::tenant(&t, "tenant_a").await;
    for interval in ["minute", "hour"] {
        let r = s
            .post(
                "/v1/plans",
                &key,
                json!({"name": "Demo", "amount": 100, "currency": "EUR", "interval": interval, "interval_count": 2}),
            )
            .await;
        assert_eq!(
            (r.status.as_u16(), r.json["interval"].as_str()),
            (201, Some(interval)),
            "{}",
            r.text
        );
    }
}
