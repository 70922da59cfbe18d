//! What `/metrics` says about the leaders when the database stops answering.

use std::sync::Arc;
use std::time::{Duration, Instant};

use db::Db;
use hardcount::http::{StatusSnapshot, refresh_status};
use leader::{Role, Telemetry};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use sqlx::Executor as _;
use testbed::TestDb;
use testbed::proxy::{FaultProxy, Mode};
use tokio_util::sync::CancellationToken;

const KNOWN: &str = "hardcount_leader_last_tick_known{role=\"webhook_outbox\"} 1";
const UNKNOWN: &str = "hardcount_leader_last_tick_known{role=\"webhook_outbox\"} 0";
const PAUSED: &str = "hardcount_leader_paused{role=\"billing\"} 1";
const NOT_PAUSED: &str = "hardcount_leader_paused{role=\"billing\"} 0";

async fn until(metrics: &PrometheusHandle, what: &str, limit: Duration) {
    let started = Instant::now();
    while !metrics.render().contains(what) {
        assert!(
            started.elapsed() < limit,
            "no {what:?} within {limit:?}:\n{}",
            metrics.render()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A replica whose database stops answering (connections reset, then a link
/// that swallows everything) exports every role's last tick as unknown and
/// counts the failed reads, and exports the ages again once it reads. Before,
/// the readiness check returned before the status read, so the last good
/// ages stayed exported at known = 1: the stall alert, gated on known = 1,
/// saw a healthy, frozen age for the whole outage, and the unknown and
/// read-error alerts saw nothing (docs/adr/0097). Mutation
/// `status_frozen_on_outage` (the unknown marking of a failed check removed)
/// fails it; seen failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_cannot_read_its_database_exports_every_last_tick_unknown() {
    let t = TestDb::new().await;
    t.superuser()
        .await
        .execute(
            "UPDATE leader_leases SET last_tick_ended_at = now() WHERE role = 'webhook_outbox'; \
             UPDATE leader_leases SET paused_at = now(), paused_by = 'ops' WHERE role = 'billing'",
        )
        .await
        .unwrap();
    let (proxy, url) = FaultProxy::in_front_of(&t).await;
    let db = Db::connect_lazy(&url, 2).unwrap();
    let recorder = PrometheusBuilder::new().build_recorder();
    let metrics = recorder.handle();
    let stop = CancellationToken::new();
    let refresher = tokio::spawn(refresh_status(
        db,
        None,
        Telemetry::new(Arc::new(recorder)),
        vec![Role::WebhookOutbox],
        Arc::new(StatusSnapshot::default()),
        stop.clone(),
    ));
    until(&metrics, KNOWN, Duration::from_secs(10)).await;
    until(&metrics, PAUSED, Duration::from_secs(10)).await;
    for mode in [Mode::Reset, Mode::Blackhole] {
        proxy.set(mode);
        until(&metrics, UNKNOWN, Duration::from_secs(10)).await;
        // It cannot say billing is paused: a 1 kept from its last read would
        // hold back every replica's stall alert once billing is unpaused
        // (docs/adr/0111). Mutation `unknown_keeps_paused`; seen failing.
        assert!(
            metrics.render().contains(NOT_PAUSED),
            "{mode}: {}",
            metrics.render()
        );
        let errors = metrics
            .render()
            .lines()
            .find_map(|l| l.strip_prefix("hardcount_leader_status_errors_total "))
            .and_then(|v| v.trim().parse::<f64>().ok());
        assert!(errors >= Some(1.0), "{mode}: {}", metrics.render());
        proxy.set(Mode::Pass);
        until(&metrics, KNOWN, Duration::from_secs(15)).await;
        until(&metrics, PAUSED, Duration::from_secs(15)).await;
    }
    // Only the roles the replica runs are marked: a role it does not run has
    // no series, which no later read would set back, and which paged
    // `HardcountRoleLastTickUnknown` for a role no one runs. Mutation
    // `unknown_all_roles` (every role marked) fails it; seen failing.
    let rendered = metrics.render();
    assert!(
        !rendered.contains("hardcount_leader_last_tick_known{role=\"billing\"}"),
        "{rendered}"
    );
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), refresher).await;
}
