//! Publishing and reading events as README's "call it" does: read back and
//! fanned out, a POST retried with its `Idempotency-Key` (racing retries
//! included), and cursor pages that neither skip nor repeat while events
//! arrive.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::json;

use super::ApiBed;

/// README's "call it": a tenant and its key from the CLI, an event
/// published, read back, listed, and fanned out by the webhook_outbox role.
#[tokio::test]
async fn a_tenant_publishes_an_event_and_reads_it_back() {
    let bed = ApiBed::start(&[]).await;
    let key = bed.tenant("acme");
    let a = bed
        .post(
            "/v1/events",
            &key,
            &json!({"type": "invoice.paid", "data": {"invoice": 7}}),
        )
        .await;
    assert_eq!(a.status, 201, "{}", a.text);
    let id = a.json["id"].as_i64().unwrap();
    assert_eq!(a.json["type"], "invoice.paid");
    assert_eq!(a.json["data"], json!({"invoice": 7}));
    assert!(a.json["message_id"].as_str().unwrap().starts_with("msg_"));

    let got = bed.get(&format!("/v1/events/{id}"), &key).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(got.json["id"], id);
    let list = bed.get("/v1/events?type=invoice.paid", &key).await;
    assert_eq!(list.status, 200);
    assert_eq!(list.json["data"][0]["id"], id);
    assert_eq!(list.json["has_more"], false);

    // The webhook_outbox role fans it out (to no endpoint) and stamps it.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let got = bed.get(&format!("/v1/events/{id}"), &key).await;
        if got.json["dispatched_at"].is_string() {
            break;
        }
        assert!(Instant::now() < deadline, "never dispatched: {}", got.text);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A POST retried with its `Idempotency-Key` and body returns the first
/// answer and publishes nothing more, even when the retries race; another
/// body under the key answers 409; after 24 hours the key is forgotten.
///
/// Catches: dropping the fingerprint comparison in `Scope::idempotent` (the
/// other body gets the first answer), and binding the key outside the
/// request's transaction (the racing retries publish twice).
#[tokio::test]
async fn a_retry_with_the_same_idempotency_key_returns_the_first_answer() {
    let bed = ApiBed::start(&[]).await;
    let key = bed.tenant("acme");
    let body = r#"{"type": "order.created", "data": {"n": 1}}"#;
    let idem = [("idempotency-key", "order-1")];
    let first = bed
        .call(Method::POST, "/v1/events", Some(&key), Some(body), &idem)
        .await;
    assert_eq!(first.status, 201, "{}", first.text);
    let mut racing = Vec::new();
    for _ in 0..8 {
        racing.push(bed.call(Method::POST, "/v1/events", Some(&key), Some(body), &idem));
    }
    // Polled together: each waits on the first request's key row.
    for again in futures::future::join_all(racing).await {
        assert_eq!(again.status, 201);
        assert_eq!(again.text, first.text);
        assert_eq!(again.headers["idempotent-replayed"], "true");
    }
    let other = bed
        .call(
            Method::POST,
            "/v1/events",
            Some(&key),
            Some(r#"{"type": "order.created", "data": {"n": 2}}"#),
            &idem,
        )
        .await;
    assert_eq!(other.status, 409, "{}", other.text);
    assert_eq!(other.error().0, "idempotency_key_reused");
    let bad = bed
        .call(
            Method::POST,
            "/v1/events",
            Some(&key),
            Some(body),
            &[("idempotency-key", "has space")],
        )
        .await;
    assert_eq!(bad.status, 400);
    assert_eq!(
        bad.error(),
        (
            "idempotency_key_invalid".into(),
            Some("Idempotency-Key".into())
        )
    );
    let list = bed.get("/v1/events", &key).await;
    assert_eq!(
        list.json["data"].as_array().unwrap().len(),
        1,
        "{}",
        list.text
    );

    // A day later the key is forgotten: the same request publishes again.
    let mut owner = bed.t.superuser().await;
    sqlx::query(
        "UPDATE api_idempotency_keys SET created_at = now() - interval '24 hours 1 second'",
    )
    .execute(&mut owner)
    .await
    .unwrap();
    let later = bed
        .call(Method::POST, "/v1/events", Some(&key), Some(body), &idem)
        .await;
    assert_eq!(later.status, 201);
    assert_ne!(later.json["id"], first.json["id"]);
    assert!(later.headers.get("idempotent-replayed").is_none());
}

/// Paging newest first by cursor while events keep arriving: every event
/// that existed when paging began is read exactly once, none twice.
#[tokio::test]
async fn pages_neither_skip_nor_repeat_while_events_arrive() {
    let bed = ApiBed::start(&[]).await;
    let key = bed.tenant("acme");
    let mut before = Vec::new();
    for n in 0..25 {
        let a = bed
            .post(
                "/v1/events",
                &key,
                &json!({"type": "tick", "data": {"n": n}}),
            )
            .await;
        before.push(a.json["id"].as_i64().unwrap());
    }
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/events?limit=10&starting_after={c}"),
            None => "/v1/events?limit=10".to_owned(),
        };
        let page = bed.get(&path, &key).await;
        assert_eq!(page.status, 200, "{}", page.text);
        for e in page.json["data"].as_array().unwrap() {
            seen.push(e["id"].as_i64().unwrap());
        }
        // Another producer publishes between pages.
        bed.post("/v1/events", &key, &json!({"type": "tick", "data": {}}))
            .await;
        match page.json["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    before.reverse();
    assert_eq!(seen, before, "newest first, each once");
}
