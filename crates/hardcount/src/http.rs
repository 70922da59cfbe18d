//! `/healthz`, `/readyz` and `/metrics`, bounded.
//!
//! No request runs a query. A background task ([`refresh_status`]) checks the
//! schema and reads `leader_status` every [`REFRESH_EVERY`] on its own
//! one-connection pool, each step under [`CHECK_TIMEOUT`], and keeps a
//! [`StatusSnapshot`]; `/readyz` and `/metrics` read that. A flood of probes or
//! scrapes therefore costs the database nothing and the app pool no connection
//! (issue 12, point 7). Every request is also bounded by tower layers:
//! [`REQUEST_TIMEOUT`] and at most [`MAX_CONCURRENT_REQUESTS`] served at once
//! (the rest wait, within the timeout).
//!
//! `/readyz` answers `ready` or `not ready`, nothing more: why goes to the log
//! (a driver error can name hosts and roles).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use db::Db;
use leader::Telemetry;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;
use tower::limit::GlobalConcurrencyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use tracing::{info, warn};

/// How often the background task refreshes the snapshot.
pub const REFRESH_EVERY: Duration = Duration::from_secs(2);
/// The most one check (schema, then `leader_status`) may take.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);
/// A snapshot older than this is not ready, whatever it says: the refresher is
/// stuck. Must exceed one refresh cycle (`REFRESH_EVERY + 2 × CHECK_TIMEOUT`).
pub const STALE_AFTER: Duration = Duration::from_secs(10);
/// The longest any request is served; past it, 503.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Requests served at once across every route.
pub const MAX_CONCURRENT_REQUESTS: usize = 16;

/// What the last background check found.
#[derive(Debug, Default)]
pub struct StatusSnapshot {
    /// When the last check passed; `None` when the last one failed (or none ran).
    ready_at: Mutex<Option<Instant>>,
}

impl StatusSnapshot {
    pub(crate) fn set(&self, ready: bool) {
        let mut at = self.ready_at.lock().unwrap_or_else(|e| e.into_inner());
        *at = ready.then(Instant::now);
    }

    /// Ready when the last check passed less than [`STALE_AFTER`] ago.
    pub fn is_ready(&self) -> bool {
        let at = self.ready_at.lock().unwrap_or_else(|e| e.into_inner());
        at.is_some_and(|t| t.elapsed() < STALE_AFTER)
    }
}

#[derive(Clone)]
pub struct AppState {
    pub status: Arc<StatusSnapshot>,
    pub metrics: PrometheusHandle,
}

pub fn router(state: AppState) -> Router {
    bounded(
        Router::new()
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(readyz))
            .route("/metrics", get(metrics))
            .with_state(state),
        REQUEST_TIMEOUT,
        MAX_CONCURRENT_REQUESTS,
    )
}

/// `routes` with a request timeout (503 past it) around a concurrency limit
/// shared by every route.
fn bounded(routes: Router, timeout: Duration, concurrent: usize) -> Router {
    routes
        .layer(GlobalConcurrencyLimitLayer::new(concurrent))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            timeout,
        ))
}

/// Ready when the last background check found the database answering and the
/// schema current, recently.
async fn readyz(State(s): State<AppState>) -> (StatusCode, &'static str) {
    if s.status.is_ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

/// The metrics as last refreshed; no query.
async fn metrics(State(s): State<AppState>) -> String {
    s.metrics.render()
}

/// One check: the schema, then (when ready) the cluster facts from
/// `leader_status` into `telemetry`. `Err` says why it is not ready.
async fn check(db: &Db, telemetry: &Telemetry, roles: &[leader::Role]) -> Result<(), String> {
    match tokio::time::timeout(CHECK_TIMEOUT, db::check_schema_ready(db)).await {
        Err(_) => return Err(format!("the readiness check took over {CHECK_TIMEOUT:?}")),
        Ok(Err(e)) => return Err(e.to_string()),
        Ok(Ok(())) => {}
    }
    if tokio::time::timeout(
        CHECK_TIMEOUT,
        scheduler::export_status(db, telemetry, roles),
    )
    .await
    .is_err()
    {
        warn!("reading leader_status for /metrics took over {CHECK_TIMEOUT:?}");
    }
    Ok(())
}

/// Refresh `snapshot` once now, then every [`REFRESH_EVERY`] until `stop`.
/// Logs a change of readiness once, with the reason.
pub async fn refresh_status(
    db: Db,
    telemetry: Telemetry,
    roles: Vec<leader::Role>,
    snapshot: Arc<StatusSnapshot>,
    stop: CancellationToken,
) {
    let mut was_ready = true;
    loop {
        let result = check(&db, &telemetry, &roles).await;
        match (&result, was_ready) {
            (Err(why), true) => warn!(reason = %why, "not ready"),
            (Ok(()), false) => info!("ready again"),
            _ => {}
        }
        was_ready = result.is_ok();
        snapshot.set(was_ready);
        if stop
            .run_until_cancelled(tokio::time::sleep(REFRESH_EVERY))
            .await
            .is_none()
        {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt as _;

    #[test]
    fn a_snapshot_goes_stale_only_after_a_whole_refresh_cycle() {
        assert!(STALE_AFTER > REFRESH_EVERY + CHECK_TIMEOUT * 2);
        assert!(REQUEST_TIMEOUT > Duration::ZERO && MAX_CONCURRENT_REQUESTS > 0);
        let s = StatusSnapshot::default();
        assert!(!s.is_ready());
        s.set(true);
        assert!(s.is_ready());
        s.set(false);
        assert!(!s.is_ready());
    }

    fn slow() -> Router {
        Router::new().route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                "done"
            }),
        )
    }

    async fn status(app: &Router) -> StatusCode {
        let req = Request::get("/slow").body(Body::empty()).unwrap();
        app.clone().oneshot(req).await.unwrap().status()
    }

    /// Fails without the timeout layer (the slow request is answered 200).
    #[tokio::test]
    async fn a_request_past_the_timeout_is_answered_503() {
        let app = bounded(slow(), Duration::from_millis(100), 4);
        assert_eq!(status(&app).await, StatusCode::SERVICE_UNAVAILABLE);
        let app = bounded(slow(), Duration::from_secs(2), 4);
        assert_eq!(status(&app).await, StatusCode::OK);
    }

    /// With one slot, three slow requests run one after another: the last waits
    /// past the timeout. Fails without the concurrency limit (all three at once).
    #[tokio::test]
    async fn requests_past_the_concurrency_limit_wait_within_the_timeout() {
        let app = bounded(slow(), Duration::from_millis(700), 1);
        let answers = futures_join3(status(&app), status(&app), status(&app)).await;
        let late = answers
            .iter()
            .filter(|s| **s == StatusCode::SERVICE_UNAVAILABLE)
            .count();
        assert_eq!(late, 1, "{answers:?}");
    }

    async fn futures_join3<F: Future<Output = StatusCode>>(a: F, b: F, c: F) -> [StatusCode; 3] {
        let (a, b, c) = tokio::join!(a, b, c);
        [a, b, c]
    }
}
