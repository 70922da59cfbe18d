//! Producers' side: an event exists iff its transaction committed, and only valid JSON.

use db::{Row, sql};
use testbed::TestDb;
use webhook_outbox::{EnqueueError, MAX_PAYLOAD_BYTES, enqueue};

use crate::count;

#[tokio::test]
async fn an_event_enqueued_in_a_committed_transaction_is_stored_as_given() {
    let t = TestDb::new().await;
    let mut tx = t.db.begin().await.unwrap();
    let id = enqueue(
        &mut tx,
        "tenant_a",
        "invoice.paid",
        r#"{"invoice": "in_1", "amount": 12345678901234567890, "lines": [1, 2]}"#,
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let row = t
        .db
        .fetch_one(
            sql("SELECT tenant_id, event_type, payload->>'invoice' AS invoice, \
                        payload->>'amount' AS amount, message_id, dispatched_at IS NULL AS undispatched \
                 FROM webhook_events WHERE id = $1")
            .bind(id),
        )
        .await
        .unwrap();
    assert_eq!(row.get::<String, _>("tenant_id"), "tenant_a");
    assert_eq!(row.get::<String, _>("event_type"), "invoice.paid");
    assert_eq!(row.get::<String, _>("invoice"), "in_1");
    // Big numbers keep every digit: the text is stored, not a float of it.
    assert_eq!(row.get::<String, _>("amount"), "12345678901234567890");
    let message_id: String = row.get("message_id");
    assert!(
        message_id.starts_with("msg_") && message_id.len() == 36,
        "{message_id}"
    );
    assert!(row.get::<bool, _>("undispatched"));
}

#[tokio::test]
async fn enqueue_inside_a_transaction_that_rolls_back_leaves_no_event() {
    let t = TestDb::new().await;
    let mut tx = t.db.begin().await.unwrap();
    enqueue(&mut tx, "tenant_a", "invoice.finalized", r#"{"id": 1}"#)
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    // Dropped without commit: also a rollback.
    {
        let mut tx = t.db.begin().await.unwrap();
        enqueue(&mut tx, "tenant_a", "invoice.finalized", r#"{"id": 2}"#)
            .await
            .unwrap();
    }
    assert_eq!(count(&t.db, "SELECT count(*) FROM webhook_events").await, 0);
}

#[tokio::test]
async fn invalid_json_is_refused_with_its_position_and_nothing_is_written() {
    let t = TestDb::new().await;
    let mut tx = t.db.begin().await.unwrap();
    let cases: &[(&str, &str, &str, &str)] = &[
        ("t", "invoice.paid", r#"{"id": 1,}"#, "line 1 column 10"),
        ("t", "invoice.paid", "", "EOF while parsing"),
        (
            "t",
            "invoice.paid",
            "{\"a\": 1} trailing",
            "trailing characters",
        ),
        ("t", "invoice.paid", "{'a': 1}", "key must be a string"),
        (
            "t",
            "invoice.paid",
            r#"{"note": "nul \u0000 here"}"#,
            "\\u0000 (NUL)",
        ),
    ];
    for (tenant, event_type, payload, expected) in cases {
        let err = enqueue(&mut tx, tenant, event_type, payload)
            .await
            .unwrap_err();
        assert!(
            matches!(err, EnqueueError::InvalidJson { .. }),
            "{payload}: {err}"
        );
        let text = err.to_string();
        assert!(
            text.contains("webhook payload for `invoice.paid` is not valid JSON")
                && text.contains(expected),
            "{payload}: {text}"
        );
    }
    assert!(matches!(
        enqueue(&mut tx, " ", "invoice.paid", "{}").await,
        Err(EnqueueError::EmptyTenant)
    ));
    assert!(matches!(
        enqueue(&mut tx, "t", "", "{}").await,
        Err(EnqueueError::EmptyEventType)
    ));
    // Refused before reaching the database: the caller's transaction still works.
    enqueue(&mut tx, "t", "invoice.paid", "{}").await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(count(&t.db, "SELECT count(*) FROM webhook_events").await, 1);
}

/// A JSON object `{"pad":"xxx…"}` of exactly `bytes` bytes.
fn payload_of(bytes: usize) -> String {
    let pad = bytes - r#"{"pad":""}"#.len();
    format!(r#"{{"pad":"{}"}}"#, "x".repeat(pad))
}

/// Issue 12, point 5: `enqueue` had no size limit, so one 20 MB payload fanned out
/// to 8 endpoints exhausted the delivery role's memory. A payload one byte over
/// [`MAX_PAYLOAD_BYTES`] is refused by name before anything is sent (the caller's
/// transaction still works); one at the limit is stored. Fails if the check in
/// `enqueue` goes (checked: the oversized payload was stored).
#[tokio::test]
async fn a_payload_over_the_size_limit_is_refused_by_name_and_nothing_is_written() {
    let t = TestDb::new().await;
    let mut tx = t.db.begin().await.unwrap();
    let err = enqueue(
        &mut tx,
        "t",
        "invoice.paid",
        &payload_of(MAX_PAYLOAD_BYTES + 1),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, EnqueueError::PayloadTooLarge { bytes, max, .. }
            if bytes == MAX_PAYLOAD_BYTES + 1 && max == MAX_PAYLOAD_BYTES),
        "{err}"
    );
    assert!(err.to_string().contains("at most 262144 bytes"), "{err}");
    enqueue(&mut tx, "t", "invoice.paid", &payload_of(MAX_PAYLOAD_BYTES))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(count(&t.db, "SELECT count(*) FROM webhook_events").await, 1);
}

/// The backstop behind the limit: an insert that bypasses `enqueue` (here as the
/// schema owner) with a payload Postgres renders past 1 MiB is refused by the
/// constraint `webhook_events_payload_bounded` (migration 0007). Fails without it
/// (checked: the 2 MiB row was stored).
#[tokio::test]
async fn an_oversized_payload_inserted_around_enqueue_is_refused_by_the_table() {
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    let err = sqlx::query(
        "INSERT INTO webhook_events (tenant_id, event_type, payload) \
         VALUES ('t', 'invoice.paid', $1::jsonb)",
    )
    .bind(payload_of(2 * 1024 * 1024))
    .execute(&mut su)
    .await
    .unwrap_err();
    assert!(
        err.to_string().contains("webhook_events_payload_bounded"),
        "{err}"
    );
    sqlx::query(
        "INSERT INTO webhook_events (tenant_id, event_type, payload) \
         VALUES ('t', 'invoice.paid', $1::jsonb)",
    )
    .bind(payload_of(MAX_PAYLOAD_BYTES))
    .execute(&mut su)
    .await
    .unwrap();
}

/// `enqueue_many` writes every event with one statement, and refuses a batch
/// with one bad event before sending anything (the transaction still works).
#[tokio::test]
async fn enqueue_many_writes_all_or_refuses_before_sending() {
    let t = TestDb::new().await;
    let mut tx = t.db.begin().await.unwrap();
    let bad = [
        ("t", "invoice.paid", r#"{"id": 1}"#),
        ("t", "invoice.paid", r#"{"id": 2,}"#),
    ];
    let err = webhook_outbox::enqueue_many(&mut tx, &bad)
        .await
        .unwrap_err();
    assert!(matches!(err, EnqueueError::InvalidJson { .. }), "{err}");
    let good = [
        ("t", "invoice.paid", r#"{"id": 1}"#),
        ("u", "invoice.finalized", r#"{"id": 2}"#),
    ];
    assert_eq!(
        webhook_outbox::enqueue_many(&mut tx, &good).await.unwrap(),
        2
    );
    tx.commit().await.unwrap();
    assert_eq!(count(&t.db, "SELECT count(*) FROM webhook_events").await, 2);
}
