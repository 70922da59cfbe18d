//! The outbox against real Postgres, directly and through PgBouncer.
//!
//! Each guard test names, in its comment, the mutation that makes it fail and
//! that it was seen failing under.

mod enqueue;
mod fan_out;
mod plans;
mod probe;
mod retention;
mod tenants;
mod tick_ends;
mod wake;

use std::sync::Arc;

use db::{Db, Row, sql};
use leader::Telemetry;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use testbed::TestDb;
use webhook_outbox::{Dispatcher, DispatcherConfig};

pub use testbed::leadership::{as_leader, fast_timing as fast, manager};

/// A dispatcher with its own metrics.
pub fn dispatcher(db: &Db, config: DispatcherConfig) -> (Dispatcher, PrometheusHandle) {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    (
        Dispatcher::new(db.clone(), config, Telemetry::new(Arc::new(recorder))).unwrap(),
        handle,
    )
}

/// The value of one series in a Prometheus text rendering, if present.
pub fn series(handle: &PrometheusHandle, name: &str) -> Option<f64> {
    let wanted = format!("{name} ");
    handle
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(&wanted).map(|v| v.trim().parse().unwrap()))
}

/// Register an endpoint directly, as the API role (the outbox does not depend
/// on the delivery crate; the sealed secret is a placeholder it never opens).
pub async fn endpoint(t: &TestDb, tenant: &str, event_types: &[&str], enabled: bool) -> i64 {
    let types: Vec<String> = event_types.iter().map(|s| s.to_string()).collect();
    t.api_as(tenant)
        .fetch_one(
            sql(
                "INSERT INTO webhook_endpoints (tenant_id, url, secret_ciphertext, secret_key_id, \
                                            event_types, enabled, disabled_reason) \
             VALUES ($1, 'https://hooks.example.com/x', decode(repeat('00', 64), 'hex'), 'test', \
                     $2, $3, CASE WHEN $3 THEN NULL ELSE 'test' END) RETURNING id",
            )
            .bind(tenant.to_owned())
            .bind(types)
            .bind(enabled),
        )
        .await
        .unwrap()
        .get("id")
}

/// Enqueue one event in its own committed transaction.
pub async fn event(db: &Db, tenant: &str, event_type: &str, payload: &str) -> i64 {
    let mut tx = db.begin().await.unwrap();
    let id = webhook_outbox::enqueue(&mut tx, tenant, event_type, payload)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    id
}

/// (event_id, endpoint_id, tenant_id) of every delivery, sorted.
pub async fn deliveries(db: &Db) -> Vec<(i64, i64, String)> {
    db.fetch_all(sql(
        "SELECT event_id, endpoint_id, tenant_id FROM webhook_deliveries ORDER BY event_id, endpoint_id",
    ))
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get("event_id"), r.get("endpoint_id"), r.get("tenant_id")))
    .collect()
}

pub async fn count(db: &Db, query: &'static str) -> i64 {
    db.fetch_one(sql(query)).await.unwrap().get(0)
}
