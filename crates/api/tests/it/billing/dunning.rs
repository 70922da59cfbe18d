//! The dunning policy over HTTP, checked as the table checks it, and the
//! tenant's dunning runs with their payment attempts (the business window is
//! in `crate::dunning`).

use db::{Row as _, sql};
use reqwest::Method;
use serde_json::{Value, json};

use super::{bed, begun};

#[tokio::test]
async fn the_dunning_policy_is_checked_as_the_table_checks_it_and_runs_are_the_tenants() {
    let b = bed().await;
    let built_in = b.s.get("/v1/dunning/policy", &b.a).await;
    assert_eq!(
        (built_in.status.as_u16(), &built_in.json["id"]),
        (200, &Value::Null),
        "{}",
        built_in.text
    );
    assert_eq!(
        built_in.json["retry_offsets_secs"],
        json!([86400, 259200, 432000, 604800])
    );
    let put = Method::PUT;
    let path = "/v1/dunning/policy".to_string();
    let body = |offsets: Value, warn: Value| {
        Some(
            json!({"retry_offsets_secs": offsets, "final_action": "pause_collection", "warn_after": warn}),
        )
    };
    b.check_refusals(
        &b.a,
        &[
            (put.clone(), path.clone(), body(json!([]), json!([])), 400, "parameter_invalid", "retry_offsets_secs"),
            (put.clone(), path.clone(), body(json!([60, 0]), json!([])), 400, "parameter_out_of_range", "retry_offsets_secs[1]"),
            (put.clone(), path.clone(), body(json!([31_622_401]), json!([])), 400, "parameter_out_of_range", "retry_offsets_secs[0]"),
            // Offsets count from the first decline: one not after the one
            // before ran back to back with it (docs/adr/0117; mutation
            // `offsets_not_increasing`).
            (put.clone(), path.clone(), body(json!([86_400, 60]), json!([])), 400, "parameter_invalid", "retry_offsets_secs[1]"),
            (put.clone(), path.clone(), body(json!([60, 60]), json!([])), 400, "parameter_invalid", "retry_offsets_secs[1]"),
            (put.clone(), path.clone(), body(json!([60, 120]), json!([3])), 400, "parameter_out_of_range", "warn_after[0]"),
            // Each retry warned after at most once, so at most as many
            // entries as retries (docs/adr/0141).
            (put.clone(), path.clone(), body(json!([60]), json!(vec![1; 10_000])), 400, "parameter_invalid", "warn_after[1]"),
            (put.clone(), path.clone(), Some(json!({"retry_offsets_secs": [60], "final_action": "refund"})), 400, "parameter_invalid", "final_action"),
            (put.clone(), path.clone(), Some(json!({"retry_offsets_secs": [60], "final_action": "pause_collection", "pause_behavior": "x"})), 400, "parameter_invalid", "pause_behavior"),
        ],
    )
    .await;
    let w =
        b.s.call(
            put.clone(),
            &path,
            &b.a,
            body(json!([60, 3600]), json!([1])).as_ref(),
            None,
        )
        .await;
    assert_eq!(w.status, 200, "{}", w.text);
    let first = w.json["id"].as_i64().unwrap();
    let w2 =
        b.s.call(
            put.clone(),
            &path,
            &b.a,
            body(json!([120]), json!([])).as_ref(),
            None,
        )
        .await;
    assert_eq!(w2.status, 200, "{}", w2.text);
    let got = b.s.get("/v1/dunning/policy", &b.a).await;
    assert_eq!(got.json, w2.json);
    assert_ne!(got.json["id"].as_i64(), Some(first));
    // The other tenant still has the built-in default.
    assert_eq!(
        b.s.get("/v1/dunning/policy", &b.b).await.json["id"],
        Value::Null
    );

    // A run of tenant a (as the dunning role enrols one), seen by a only.
    let plan = b.plan(&b.a, "EUR", 3000).await;
    let sub = begun(&b, plan, 10).await;
    let invoice: i64 = b
        .t
        .db
        .fetch_one(
            sql("INSERT INTO invoices (tenant_id, subscription_id, period_start, period_end, amount, currency, collection_method) \
                 VALUES ('tenant_a', $1, now() - interval '1 month', now(), 3000, 'EUR', 'automatic') RETURNING id")
            .bind(sub),
        )
        .await
        .unwrap()
        .get("id");
    b.t.db
        .execute(
            sql("INSERT INTO payment_attempts (tenant_id, invoice_id, attempt_seq, idempotency_key, amount, currency, provider_status, decline_code) \
                 VALUES ('tenant_a', $1, 1, 'k' || $1, 3000, 'EUR', 'declined', 'card_declined')")
            .bind(invoice),
        )
        .await
        .unwrap();
    let run: i64 = b
        .t
        .db
        .fetch_one(
            sql("INSERT INTO dunning_runs (tenant_id, invoice_id, policy_id, first_declined_at, next_attempt_at) \
                 VALUES ('tenant_a', $1, $2, now(), now() + interval '1 hour') RETURNING id")
            .bind(invoice)
            .bind(first),
        )
        .await
        .unwrap()
        .get("id");
    let one = b.s.get(&format!("/v1/dunning/runs/{run}"), &b.a).await;
    assert_eq!(one.status, 200, "{}", one.text);
    assert_eq!(one.json["attempts"][0]["decline_code"], "card_declined");
    assert_eq!(
        b.s.get("/v1/dunning/runs", &b.a).await.json["data"][0]["id"].as_i64(),
        Some(run)
    );
    let inv = b.s.get(&format!("/v1/invoices/{invoice}"), &b.a).await;
    assert_eq!(inv.json["payment_attempts"][0]["status"], "declined");
    b.check_refusals(
        &b.b,
        &[
            (
                Method::GET,
                format!("/v1/dunning/runs/{run}"),
                None,
                404,
                "resource_missing",
                "id",
            ),
            (
                Method::GET,
                "/v1/dunning/runs?limit=101".into(),
                None,
                400,
                "parameter_out_of_range",
                "limit",
            ),
        ],
    )
    .await;
    assert_eq!(
        b.s.get("/v1/dunning/runs", &b.b).await.json["data"],
        json!([])
    );
}
