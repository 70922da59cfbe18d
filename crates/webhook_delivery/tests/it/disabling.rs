//! A receiver that asks for no more retries of a message, and endpoints that
//! fail for days: turned off, their tenant told (docs/adr/0041).

use std::time::Duration;

use db::{Row, sql};
use leader::Role;
use testbed::TestDb;
use testbed::receiver::{Receiver, Reply};
use webhook_delivery::WorkerConfig;

use crate::{
    as_leader, config, deliveries, endpoint, endpoint_state, events, make_due, manager, series,
    tick, worker,
};

async fn failing_since(t: &TestDb, endpoint: i64) -> Option<f64> {
    t.db.fetch_one(
        sql(
            "SELECT extract(epoch FROM now() - failing_since)::float8 AS age \
             FROM webhook_endpoints WHERE id = $1",
        )
        .bind(endpoint),
    )
    .await
    .unwrap()
    .get("age")
}

/// A failure answered with `webhook-delivery: abort-message` makes that
/// delivery dead on its first attempt, with `aborted` as its error; the
/// endpoint stays on and its other deliveries are still sent.
///
/// Catches: the abort header ignored (seen: with the `abort: true` arm of
/// `verdict` removed, the delivery stays pending for its retries).
#[tokio::test]
async fn an_abort_header_ends_one_message_s_retries_and_keeps_the_endpoint() {
    let t = TestDb::new().await;
    let rx = Receiver::start(|i| {
        if i.n == 0 {
            Reply::WithHeaders(422, vec![("webhook-delivery", "abort-message".to_owned())])
        } else {
            Reply::Status(204)
        }
    })
    .await;
    let ep = endpoint(&t, "tenant_a", &rx.url()).await;
    events(&t.db, "tenant_a", 1).await;
    let config = WorkerConfig {
        batch_size: 1,
        ..config()
    };
    let (w, _) = worker(&t.db, config);
    tick(&t.db, &w).await;
    let d = &deliveries(&t.db).await[0];
    assert_eq!(
        (
            d.status.as_str(),
            d.attempts,
            d.last_status_code,
            d.last_error.as_deref()
        ),
        ("dead", 1, Some(422), Some("aborted")),
        "{d:?}"
    );
    events(&t.db, "tenant_a", 1).await;
    tick(&t.db, &w).await;
    let ds = deliveries(&t.db).await;
    assert_eq!(ds[1].status, "delivered", "{ds:?}");
    let on = endpoint_state(&t.db, ep.id).await.enabled;
    assert!(on, "the abort header turned the endpoint off");
}

/// `failing_since` is set by a group of failures and cleared by a delivery.
///
/// Catches: the outcome statement's `health` step removed (seen: neither is
/// written), or writing a delivery's success as a failure.
#[tokio::test]
async fn failures_start_an_endpoint_s_failing_run_and_a_delivery_ends_it() {
    let t = TestDb::new().await;
    let rx = Receiver::start(|i| Reply::Status(if i.n == 0 { 500 } else { 200 })).await;
    let ep = endpoint(&t, "tenant_a", &rx.url()).await;
    events(&t.db, "tenant_a", 1).await;
    let (w, _) = worker(&t.db, config());
    assert_eq!(failing_since(&t, ep.id).await, None);
    tick(&t.db, &w).await;
    let age = failing_since(&t, ep.id)
        .await
        .expect("a failure starts the run");
    assert!((0.0..30.0).contains(&age), "{age}");
    make_due(&t).await;
    tick(&t.db, &w).await;
    assert_eq!(deliveries(&t.db).await[0].status, "delivered");
    assert_eq!(
        failing_since(&t, ep.id).await,
        None,
        "a delivery ends the run"
    );
}

/// An endpoint whose run of failures is older than `disable_after` is
/// turned off; its tenant gets an `endpoint.disabled` event (fanned out to
/// its healthy endpoint) and an email to its contact. A younger run, and
/// another tenant's endpoint, are left on; a stale leader turns nothing off.
///
/// Catches: `leader_fence` removed from `DISABLE_FAILING` (seen: the stale
/// token turned the endpoint off), and the threshold ignored (the young run
/// turned off).
#[tokio::test]
async fn an_endpoint_failing_for_too_long_is_turned_off_and_its_tenant_told() {
    let t = TestDb::new().await;
    {
        let mut su = t.superuser().await;
        sqlx::raw_sql(
            "INSERT INTO tenants (id, name, contact_email) VALUES \
             ('tenant_a', 'A', 'ops@a.example'), ('tenant_b', 'B', NULL) \
             ON CONFLICT (id) DO UPDATE SET contact_email = EXCLUDED.contact_email",
        )
        .execute(&mut su)
        .await
        .unwrap();
    }
    let down = Receiver::answering(503).await;
    let up = Receiver::answering(200).await;
    let old = endpoint(&t, "tenant_a", &format!("{}/in?token=s3cr3t", down.url())).await;
    let healthy = endpoint(&t, "tenant_a", &up.url()).await;
    let young = endpoint(&t, "tenant_b", &down.url()).await;
    events(&t.db, "tenant_a", 1).await;
    events(&t.db, "tenant_b", 1).await;
    let config = WorkerConfig {
        disable_after: Some(Duration::from_secs(3600)),
        notice_from: Some("notices@hardcount.example".to_owned()),
        ..config()
    };
    let (w, metrics) = worker(&t.db, config);
    tick(&t.db, &w).await;
    assert!(failing_since(&t, old.id).await.is_some());
    assert_eq!(failing_since(&t, healthy.id).await, None);
    {
        let mut su = t.superuser().await;
        sqlx::query(
            "UPDATE webhook_endpoints SET failing_since = now() - interval '2 hours' WHERE id = $1",
        )
        .bind(old.id)
        .execute(&mut su)
        .await
        .unwrap();
    }

    let stale = as_leader(
        &manager(&t.db, "old"),
        Role::WebhookDelivery,
        |tick| async move { tick.fence },
    )
    .await;
    let by_new = as_leader(&manager(&t.db, "new"), Role::WebhookDelivery, |tick| {
        let w = w.clone();
        async move {
            let by_stale = w.disable_failing_endpoints(&stale).await.unwrap();
            assert_eq!(by_stale, 0, "a stale token turned an endpoint off");
            w.disable_failing_endpoints(&tick.fence).await.unwrap()
        }
    })
    .await;
    assert_eq!(by_new, 1);
    let off = endpoint_state(&t.db, old.id).await;
    assert!(!off.enabled && off.stamped, "{off:?}");
    let reason = off.reason.unwrap_or_default();
    assert!(
        reason.starts_with("every attempt failed since "),
        "{reason}"
    );
    for other in [healthy.id, young.id] {
        let on = endpoint_state(&t.db, other).await.enabled;
        assert!(on, "endpoint {other} was turned off");
    }

    let notice =
        t.db.fetch_one(sql(
            "SELECT payload FROM webhook_events WHERE tenant_id = 'tenant_a' \
                 AND event_type = 'endpoint.disabled'",
        ))
        .await
        .unwrap();
    let payload: serde_json::Value = notice.get("payload");
    assert_eq!(payload["endpoint_id"], old.id);
    assert_eq!(payload["host"], "127.0.0.1");
    assert!(!payload.to_string().contains("s3cr3t"), "{payload}");
    let mail =
        t.db.fetch_all(sql(
            "SELECT tenant_id, sender, recipients, subject, text_body FROM email_outbox",
        ))
        .await
        .unwrap();
    assert_eq!(mail.len(), 1, "one email, to tenant_a's contact");
    assert_eq!(mail[0].get::<String, _>("tenant_id"), "tenant_a");
    assert_eq!(
        mail[0].get::<String, _>("sender"),
        "notices@hardcount.example"
    );
    assert_eq!(
        mail[0].get::<Vec<String>, _>("recipients"),
        vec!["ops@a.example".to_owned()]
    );
    let body: String = mail[0].get("text_body");
    assert!(
        body.contains(&old.id.to_string()) && !body.contains("s3cr3t"),
        "{body}"
    );
    assert_eq!(
        series(
            &metrics,
            "hardcount_webhook_endpoints_disabled_total",
            "reason=\"failing\""
        ),
        Some(1.0)
    );

    // The notice is an event like any other: the tenant's healthy endpoint
    // receives it.
    crate::events(&t.db, "tenant_c", 0).await;
    tick(&t.db, &w).await;
    assert!(
        up.requests()
            .iter()
            .any(|r| String::from_utf8_lossy(&r.body).contains("endpoint.disabled")),
        "the healthy endpoint was not told"
    );
}
