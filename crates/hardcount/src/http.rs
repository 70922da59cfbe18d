//! `/healthz`, `/readyz` and `/metrics`.

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use db::Db;
use leader::Telemetry;
use metrics_exporter_prometheus::PrometheusHandle;

#[derive(Clone)]
pub struct AppState {
    pub db: Db,
    pub telemetry: Telemetry,
    pub metrics: PrometheusHandle,
    /// The roles this deployment runs: their last-tick ages are exported.
    pub roles: Vec<leader::Role>,
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// Ready when the database answers and the schema is current.
async fn readyz(State(s): State<AppState>) -> (StatusCode, String) {
    match db::check_schema_ready(&s.db).await {
        Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}\n")),
    }
}

/// Refresh the cluster facts read from `leader_status`, then render.
async fn metrics(State(s): State<AppState>) -> String {
    scheduler::export_status(&s.db, &s.telemetry, &s.roles).await;
    s.metrics.render()
}
