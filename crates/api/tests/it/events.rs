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

/// The rate limit is the key's own (docs/adr/0076): keys that copy a real
/// key's visible prefix (it is shown to operators and in key listings) with
/// other secrets are refused 401, then 429 once their own burst is spent,
/// and the real key is still served; it is limited by its own burst.
///
/// Mutation: `limit_by_prefix` (the bucket keyed by the prefix again) lets
/// the forged keys spend the real key's burst, so the real key gets 429;
/// seen failing here.
#[tokio::test]
async fn keys_that_copy_a_prefix_do_not_spend_the_real_keys_rate() {
    let t = TestDb::new().await;
    let config = api::ApiConfig {
        rate_per_second: std::num::NonZeroU32::new(1).unwrap(),
        rate_burst: std::num::NonZeroU32::new(2).unwrap(),
        ..crate::config()
    };
    let keyring = webhook_delivery::Keyring::parse(testbed::SECRETS_KEY).unwrap();
    let s = crate::serve_api(api::Api::new(t.api(), Some(keyring), config)).await;
    let key = tenant(&t, "acme").await;
    // The same prefix, another 43-character secret.
    let forged = format!("{}{}", &key[..12], "A".repeat(43));
    assert_ne!(forged, key);
    let mut forged_seen = Vec::new();
    for _ in 0..6 {
        forged_seen.push(s.get("/v1/events", &forged).await.status.as_u16());
    }
    // A token comes back each second: a slow machine may see a third 401.
    assert_eq!(forged_seen[..2], [401, 401], "{forged_seen:?}");
    assert!(forged_seen.contains(&429), "{forged_seen:?}");
    let first = s.get("/v1/events", &key).await;
    assert_eq!(first.status, 200, "{}", first.text);
    let mut seen = Vec::new();
    for _ in 0..4 {
        seen.push(s.get("/v1/events", &key).await.status.as_u16());
    }
    assert!(seen.contains(&429), "limited by its own burst: {seen:?}");
}

/// A payload whose string holds a backslash followed by `u0000` (text, not
/// a NUL) is stored and answered as sent; one whose string holds a NUL is
/// refused with a 400 naming `data`, and nothing is written.
///
/// Catches: the NUL looked for in the payload's JSON text (as it was), where
/// the escaped backslash reads `\\u0000` and the first payload was refused
/// (mutation `payload_nul_text`).
#[tokio::test]
async fn a_backslash_before_u0000_is_text_and_only_a_nul_is_refused() {
    let t = TestDb::new().await;
    let s = serve(&t).await;
    let key = tenant(&t, "acme").await;
    let text = json!({"type": "file.saved", "data": {"path": "C:\\u0000"}});
    let a = s.post("/v1/events", &key, text.clone()).await;
    assert_eq!(a.status, 201, "{}", a.text);
    assert_eq!(a.json["data"]["path"], "C:\\u0000");
    let nul = json!({"type": "file.saved", "data": {"path": "C:\u{0}"}});
    let refused = s.post("/v1/events", &key, nul).await;
    assert_eq!(refused.status, 400, "{}", refused.text);
    assert_eq!(refused.json["error"]["param"], "data", "{}", refused.text);
    assert_eq!(events_of(&t, "acme").await, 1);
    // A NUL in the list's type filter is refused naming the filter, not a
    // body the GET does not have. Mutation `type_filter_unchecked` and the
    // param is `body`.
    let filter = s.get("/v1/events?type=a%00b", &key).await;
    assert_eq!(
        (filter.status.as_u16(), filter.param()),
        (400, "type"),
        "{}",
        filter.text
    );
}

/// A payload is stored and answered with its numbers as the caller wrote
/// them: a 23-digit integer and `1.10` were read through a 64-bit float and
/// stored as `1.2345678901234568e22` and `1.1` (docs/adr/0119). Both publish
/// paths (one message without a key, the keyed transaction) and the read.
///
/// Mutation check: `payload_through_value` (the payload parsed into a
/// `serde_json::Value` and printed again, as before) seen failing it.
#[tokio::test]
async fn a_payloads_numbers_are_kept_as_written() {
    let t = TestDb::new().await;
    let s = serve(&t).await;
    let key = tenant(&t, "acme").await;
    let body = r#"{"type": "meter.read", "data": {"big": 12345678901234567890123, "p": 1.10}}"#;
    for idem in [None, Some("reading-1")] {
        let mut req = s
            .client
            .post(format!("{}/v1/events", s.base))
            .bearer_auth(&key)
            .header("content-type", "application/json")
            .body(body);
        if let Some(idem) = idem {
            req = req.header("idempotency-key", idem);
        }
        let answer = req.send().await.unwrap();
        assert_eq!(answer.status(), 201);
        let text = answer.text().await.unwrap();
        for exact in ["12345678901234567890123", "1.10"] {
            assert!(text.contains(exact), "{idem:?}: {exact} not in {text}");
        }
    }
    let stored: Vec<String> =
        t.db.fetch_all(db::sql(
            "SELECT payload::text AS p FROM webhook_events ORDER BY id",
        ))
        .await
        .unwrap()
        .iter()
        .map(|r| db::Row::get(r, "p"))
        .collect();
    assert_eq!(
        stored, [r#"{"p": 1.10, "big": 12345678901234567890123}"#; 2],
        "as stored"
    );
    let read = s.get("/v1/events?type=meter.read", &key).await;
    assert!(
        read.text.contains("12345678901234567890123"),
        "{}",
        read.text
    );
    // Past an f64 the payload is still refused as JSON it cannot hold, a 400
    // naming `data`, never a 500 (a review found the first form answered 500).
    for data in [r#"{"n": 1e400}"#, r#""\ud800""#] {
        let body = format!(r#"{{"type": "meter.read", "data": {data}}}"#);
        let answer = s
            .client
            .post(format!("{}/v1/events", s.base))
            .bearer_auth(&key)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 400, "{data}");
        let text = answer.text().await.unwrap();
        assert!(text.contains(r#""param":"data""#), "{data}: {text}");
    }
}

/// A number in exponent notation counts at its length as stored: jsonb keeps
/// it as `numeric`, which prints it written out, so `1e300` is stored and
/// delivered as 301 digits and `1e-1000` as 1,002 characters. A payload of
/// 1,040 such numbers (about 9 KB sent) was stored and delivered as 1 MB, four
/// times the 256 KiB bound the delivery role's memory is sized by
/// (docs/adr/0129). Now it is refused with a 400 naming `data`, by both
/// publish paths, and nothing is written. The count is checked against
/// Postgres's own rendering of each number, so it cannot drift from it.
///
/// Mutation `payload_stored_len_written` (the written length counted, as
/// before) fails it at the first number; with that check left out, both
/// payloads were stored (201).
#[tokio::test]
async fn numbers_in_exponent_notation_count_at_their_stored_length() {
    let t = TestDb::new().await;
    for token in [
        "1e300",
        "1e-1000",
        "-1.5E+3",
        "0.05e3",
        "1.50",
        "0",
        "-0.0",
        "0e5",
        "12345",
        "1.5e-3",
        "123.456e1",
        "9.99e-2",
        "-7",
    ] {
        let row =
            t.db.fetch_one(
                db::sql("SELECT octet_length($1::jsonb::text)::int8 AS n").bind(token.to_owned()),
            )
            .await
            .unwrap();
        let rendered: i64 = db::Row::get(&row, "n");
        let rendered = usize::try_from(rendered).unwrap();
        assert_eq!(
            outbox::webhook::stored_len(token),
            rendered.max(token.len()),
            "{token}"
        );
    }
    let s = serve(&t).await;
    let key = tenant(&t, "acme").await;
    for number in ["1e-1000", "1e300"] {
        let data = format!("[{}]", vec![number; 1040].join(","));
        let body = format!(r#"{{"type": "meter.read", "data": {data}}}"#);
        for idem in [None, Some(number)] {
            let mut req = s
                .client
                .post(format!("{}/v1/events", s.base))
                .bearer_auth(&key)
                .header("content-type", "application/json")
                .body(body.clone());
            if let Some(idem) = idem {
                req = req.header("idempotency-key", idem);
            }
            let answer = req.send().await.unwrap();
            assert_eq!(answer.status(), 400, "{number} {idem:?}");
            let text = answer.text().await.unwrap();
            assert!(text.contains(r#""param":"data""#), "{number}: {text}");
            assert!(text.contains("exponent notation"), "{number}: {text}");
        }
    }
    // A few such numbers are well within the bound: accepted, and stored
    // written out, as counted.
    let small = s
        .post(
            "/v1/events",
            &key,
            json!({"type": "meter.read", "data": {"n": 1e300}}),
        )
        .await;
    assert_eq!(small.status, 201, "{}", small.text);
    assert_eq!(events_of(&t, "acme").await, 1);
    let row =
        t.db.fetch_one(db::sql("SELECT payload::text AS p FROM webhook_events"))
            .await
            .unwrap();
    let stored: String = db::Row::get(&row, "p");
    assert_eq!(stored, format!(r#"{{"n": 1{}}}"#, "0".repeat(300)));
}
