//! Publishing an event without an idempotency key: authenticated, inserted
//! and committed in one message (`Scope::run_once`).

use serde_json::json;
use testbed::TestDb;

use crate::{serve, tenant};

async fn events_of(t: &TestDb, tenant: &str) -> i64 {
    // The role loops' pool: its policy passes every tenant's rows.
    let row =
        t.db.fetch_one(
            db::sql("SELECT count(*) AS n FROM webhook_events WHERE tenant_id = $1")
                .bind(tenant.to_owned()),
        )
        .await
        .unwrap();
    db::Row::try_get(&row, "n").unwrap()
}

/// A published event is stored for the key's tenant and answered as
/// stored; an unknown or revoked key writes nothing and gets the 401 every
/// other route gives.
///
/// Catches: the insert without its `api_tenant() IS NOT NULL` guard (with
/// it removed, the unauthenticated insert hits row-level security's check
/// and answers 500, not 401: seen), and an authentication that does not
/// hold the insert to the key's tenant.
#[tokio::test]
async fn a_publish_is_one_message_for_the_key_s_tenant_only() {
    let t = TestDb::new().await;
    let s = serve(&t).await;
    let key = tenant(&t, "acme").await;
    tenant(&t, "other").await;
    let body =
        json!({"type": "invoice.paid", "data": {"invoice": 7, "note": "it's \"quoted\" \\ ü"}});

    let a = s.post("/v1/events", &key, body.clone()).await;
    assert_eq!(a.status, 201, "{}", a.text);
    assert_eq!(a.json["type"], "invoice.paid");
    assert_eq!(a.json["data"], body["data"], "the payload as stored");
    assert_eq!(events_of(&t, "acme").await, 1);
    assert_eq!(events_of(&t, "other").await, 0);
    let id = a.json["id"].as_i64().unwrap();
    assert_eq!(s.get(&format!("/v1/events/{id}"), &key).await.json, a.json);

    let unknown = format!("hc_zzzzzzzz_{}", &key[12..]);
    let refused = s.post("/v1/events", &unknown, body.clone()).await;
    assert_eq!(refused.status, 401, "{}", refused.text);
    let prefix = &key[3..11];
    api::keys::revoke_key(&t.operator(), prefix).await.unwrap();
    let revoked = s.post("/v1/events", &key, body).await;
    assert_eq!(revoked.status, 401, "{}", revoked.text);
    assert_eq!(revoked.text, refused.text, "one 401 body");
    assert_eq!(
        events_of(&t, "acme").await,
        1,
        "nothing written without a tenant"
    );
}

/// A page of events is read backward through `webhook_events_tenant_id` and
/// sorts nothing, even right after a burst the statistics have not seen: the
/// table is analyzed with 1,000 events of another tenant, then this tenant
/// publishes 20,000, and the plan is read with this tenant set as the API
/// sets it (the planner evaluates `api_tenant()` for its estimate).
///
/// Mutation check (`event_pages` in scripts/mutation-check): migration 0037's
/// index keyed `(tenant_id, created_at)`, as before it, reads the tenant's
/// 20,000 rows through it and sorts them for the page; this test was run
/// against it and failed.
#[tokio::test]
async fn a_page_of_events_is_read_in_index_order_after_an_unseen_burst() {
    use sqlx::Row as _;
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "INSERT INTO webhook_events (tenant_id, event_type, payload) \
           SELECT 'tenant_a', 'seeded', '{}' FROM generate_series(1, 1000); \
         ANALYZE webhook_events; \
         INSERT INTO webhook_events (tenant_id, event_type, payload) \
           SELECT 'tenant_b', 'burst', '{}' FROM generate_series(1, 20000)",
    )
    .execute(&mut su)
    .await
    .unwrap();
    sqlx::raw_sql("BEGIN; SELECT set_config('hardcount.tenant_id', 'tenant_b', true)")
        .execute(&mut su)
        .await
        .unwrap();
    let explain = format!("EXPLAIN {}", api::routes::events::LIST);
    let plan: Vec<String> = sqlx::query(sqlx::AssertSqlSafe(explain))
        .bind(None::<i64>)
        .bind(None::<String>)
        .bind(101_i64)
        .fetch_all(&mut su)
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<String, _>(0))
        .collect();
    sqlx::raw_sql("ROLLBACK").execute(&mut su).await.unwrap();
    let plan = plan.join("\n");
    assert!(plan.contains("Index Scan Backward using"), "{plan}");
    for absent in ["Sort", "Seq Scan", "webhook_events_tenant_created"] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}
