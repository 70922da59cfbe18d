//! Webhook endpoints, deliveries with their attempt history, and emails. Here
//! the helpers the tests share (and `operator.rs` uses) and the tenant
//! boundary across all three; each resource's tests in the modules below.

mod deliveries;
mod emails;
mod endpoints;

use std::time::Duration;

use leader::{Role, Telemetry};
use reqwest::StatusCode;
use serde_json::{Value, json};
use testbed::TestDb;
use testbed::leadership::{as_leader, manager};
use testbed::receiver::Receiver;
use webhook_delivery::backoff::RetrySchedule;
use webhook_delivery::ssrf::Allowlist;
use webhook_delivery::{Keyring, Worker, WorkerConfig};
use webhook_outbox::{Dispatcher, DispatcherConfig};

use crate::{Served, serve, tenant};

pub(crate) fn worker(t: &TestDb) -> Worker {
    let config = WorkerConfig {
        connect_timeout: Duration::from_millis(500),
        request_timeout: Duration::from_secs(1),
        claim_margin: Duration::from_secs(1),
        tick_budget: Duration::from_secs(5),
        retry_schedule: RetrySchedule::parse("200ms,200ms").unwrap(),
        allowlist: Allowlist::parse("127.0.0.0/8").unwrap(),
        secrets: Some(Keyring::parse(testbed::SECRETS_KEY).unwrap()),
        ..WorkerConfig::default()
    };
    Worker::new(t.db.clone(), config, Telemetry::noop()).unwrap()
}

/// Fan out the published events, then one delivery tick as leader.
pub(crate) async fn deliver(t: &TestDb, w: &Worker) {
    let dispatcher =
        Dispatcher::new(t.db.clone(), DispatcherConfig::default(), Telemetry::noop()).unwrap();
    as_leader(
        &manager(&t.db, "outbox"),
        Role::WebhookOutbox,
        |tick| async move {
            dispatcher.run_tick(&tick).await;
        },
    )
    .await;
    let w = w.clone();
    as_leader(
        &manager(&t.db, "worker"),
        Role::WebhookDelivery,
        |tick| async move {
            w.run_tick(&tick).await;
        },
    )
    .await;
}

pub(crate) async fn new_endpoint(s: &Served, key: &str, url: &str) -> Value {
    let a = s
        .post("/v1/webhook_endpoints", key, json!({"url": url}))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    a.json
}

/// `n` events of `key`'s tenant to a new endpoint that answers 410, fanned
/// out and delivered: every delivery dead (the first 410 turned the endpoint
/// off), then the endpoint turned on again. Its id.
pub(crate) async fn dead_on_enabled_endpoint(t: &TestDb, s: &Served, key: &str, n: usize) -> i64 {
    let rx = Receiver::answering(410).await;
    let id = new_endpoint(s, key, &rx.url()).await["id"]
        .as_i64()
        .unwrap();
    for n in 0..n {
        s.post("/v1/events", key, json!({"type": "a.b", "data": {"n": n}}))
            .await;
    }
    deliver(t, &worker(t)).await;
    enable(s, key, id).await;
    id
}

/// Turn the endpoint `id` on again.
pub(crate) async fn enable(s: &Served, key: &str, id: i64) {
    let on = s
        .post(
            &format!("/v1/webhook_endpoints/{id}/enable"),
            key,
            json!({}),
        )
        .await;
    assert_eq!(on.status, StatusCode::OK, "{}", on.text);
}

/// Row-level security hides another tenant's rows: every route answers 404
/// for them, as for an id that does not exist, and changes nothing.
#[tokio::test]
async fn another_tenant_s_ids_are_missing_on_every_route() {
    let t = TestDb::new().await;
    let s = serve(&t).await;
    let mine = tenant(&t, "acme").await;
    let theirs = tenant(&t, "globex").await;
    let rx = Receiver::answering(204).await;
    let ep = new_endpoint(&s, &theirs, &rx.url()).await;
    let ep_id = ep["id"].as_i64().unwrap();
    let ev = s
        .post("/v1/events", &theirs, json!({"type": "a.b", "data": {}}))
        .await;
    deliver(&t, &worker(&t)).await;
    let delivery = s
        .get(&format!("/v1/deliveries?endpoint_id={ep_id}"), &theirs)
        .await;
    let d_id = delivery.json["data"][0]["id"].as_i64().unwrap();
    let email = s
        .post(
            "/v1/emails",
            &theirs,
            json!({"from": "billing@example.com", "to": ["b@example.org"], "subject": "s", "text": "t"}),
        )
        .await;
    let e_id = email.json["id"].as_i64().unwrap();
    assert!(ev.status.is_success());

    let gets = [
        format!("/v1/webhook_endpoints/{ep_id}"),
        format!("/v1/deliveries/{d_id}"),
        format!("/v1/emails/{e_id}"),
        "/v1/webhook_endpoints/999999".to_owned(),
    ];
    for path in &gets {
        let a = s.get(path, &mine).await;
        assert_eq!(
            (a.status, a.code()),
            (StatusCode::NOT_FOUND, "resource_missing"),
            "{path}"
        );
    }
    let posts = [
        (
            format!("/v1/webhook_endpoints/{ep_id}"),
            json!({"url": "https://evil.example/"}),
        ),
        (
            format!("/v1/webhook_endpoints/{ep_id}/rotate_secret"),
            json!({}),
        ),
        (
            format!("/v1/webhook_endpoints/{ep_id}/recover"),
            json!({"since": "2000-01-01T00:00:00Z"}),
        ),
        (format!("/v1/webhook_endpoints/{ep_id}/disable"), json!({})),
        (format!("/v1/webhook_endpoints/{ep_id}/enable"), json!({})),
        (format!("/v1/deliveries/{d_id}/resend"), json!({})),
        (format!("/v1/emails/{e_id}/resend"), json!({})),
    ];
    for (path, body) in &posts {
        let a = s.post(path, &mine, body.clone()).await;
        assert_eq!(
            (a.status, a.code()),
            (StatusCode::NOT_FOUND, "resource_missing"),
            "{path}: {}",
            a.text
        );
    }
    let lists = [
        format!("/v1/deliveries?endpoint_id={ep_id}"),
        format!("/v1/deliveries?event_id={}", ev.json["id"]),
        "/v1/webhook_endpoints".to_owned(),
        "/v1/emails".to_owned(),
    ];
    for path in &lists {
        let a = s.get(path, &mine).await;
        assert_eq!(a.status, StatusCode::OK, "{path}");
        assert_eq!(a.json["data"], json!([]), "{path}");
    }
    let theirs_now = s
        .get(&format!("/v1/webhook_endpoints/{ep_id}"), &theirs)
        .await;
    assert_eq!(
        (&theirs_now.json["url"], &theirs_now.json["enabled"]),
        (&json!(rx.url()), &json!(true))
    );
}
