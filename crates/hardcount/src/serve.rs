//! `hardcount serve`: boot checks, role loops, HTTP, and shutdown.
//!
//! Shutdown follows the tokio pattern: one root `CancellationToken` owned here,
//! a child per role loop, a `TaskTracker` to wait. The first SIGTERM or SIGINT
//! cancels the root: loops stop acquiring, running ticks are cancelled and
//! released as interrupted (no cooldown, docs/adr/0003), and the process exits
//! 0. A second signal exits at once.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use db::Db;
use leader::{Manager, Role, Telemetry, Timing};
use metrics_exporter_prometheus::PrometheusBuilder;
use scheduler::{RoleConfig, RoleSpec, Work};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};
use webhook_delivery::backoff::RetrySchedule;
use webhook_delivery::ssrf::Allowlist;
use webhook_delivery::{Worker, WorkerConfig};
use webhook_outbox::{Dispatcher, DispatcherConfig};

use crate::http::{AppState, router};

pub struct Config {
    pub database_url: String,
    pub http_addr: SocketAddr,
    pub roles: Vec<RoleConfig>,
    /// True when HARDCOUNT_ROLES was set: naming a role this build cannot run is then an error.
    pub roles_explicit: bool,
    pub webhook_delivery: WorkerConfig,
}

impl Config {
    pub fn from_env() -> Result<Config> {
        let var = |k: &str| std::env::var(k).ok();
        let http_addr = match var("HARDCOUNT_HTTP_ADDR").filter(|v| !v.is_empty()) {
            Some(a) => a.parse().with_context(|| {
                format!("HARDCOUNT_HTTP_ADDR={a:?} is not an address like 0.0.0.0:8080")
            })?,
            None => SocketAddr::from(([0, 0, 0, 0], 8080)),
        };
        let mut webhook_delivery = WorkerConfig::default();
        if let Some(v) = var("HARDCOUNT_WEBHOOK_ALLOWLIST") {
            webhook_delivery.allowlist = Allowlist::parse(&v)
                .map_err(|e| anyhow::anyhow!("HARDCOUNT_WEBHOOK_ALLOWLIST: {e}"))?;
        }
        if let Some(v) = var("HARDCOUNT_WEBHOOK_RETRY_SCHEDULE") {
            webhook_delivery.retry_schedule = RetrySchedule::parse(&v)
                .map_err(|e| anyhow::anyhow!("HARDCOUNT_WEBHOOK_RETRY_SCHEDULE: {e}"))?;
        }
        if let Some(v) = var("HARDCOUNT_WEBHOOK_TIMEOUT") {
            webhook_delivery.request_timeout = scheduler::parse_duration(&v)
                .map_err(|reason| anyhow::anyhow!("HARDCOUNT_WEBHOOK_TIMEOUT={v:?}: {reason}"))?;
            webhook_delivery.connect_timeout = webhook_delivery
                .connect_timeout
                .min(webhook_delivery.request_timeout);
            webhook_delivery.tick_budget = webhook_delivery
                .tick_budget
                .max(webhook_delivery.request_timeout * 2);
        }
        webhook_delivery.validate()?;
        Ok(Config {
            database_url: crate::cli::database_url()?,
            http_addr,
            roles: scheduler::roles_from_env(var)?,
            roles_explicit: var("HARDCOUNT_ROLES").is_some(),
            webhook_delivery,
        })
    }
}

/// The work of each role this build implements.
fn work_for(role: Role, config: &Config, db: &Db, telemetry: &Telemetry) -> Result<Option<Work>> {
    Ok(match role {
        Role::WebhookOutbox => {
            let dispatcher = Arc::new(Dispatcher::new(
                db.clone(),
                DispatcherConfig::default(),
                telemetry.clone(),
            )?);
            Some(scheduler::work(move |tick| {
                let dispatcher = dispatcher.clone();
                async move { dispatcher.run_tick(&tick).await.end }
            }))
        }
        Role::WebhookDelivery => {
            let worker = Arc::new(Worker::new(
                db.clone(),
                config.webhook_delivery.clone(),
                telemetry.clone(),
            )?);
            Some(scheduler::work(move |tick| {
                let worker = worker.clone();
                async move { worker.run_tick(&tick).await.end }
            }))
        }
        Role::Billing | Role::Dunning | Role::EmailOutbox => None,
    })
}

pub async fn serve(config: Config) -> Result<()> {
    scheduler::install_panic_hook();
    let db = Db::connect_lazy(&config.database_url, 10)?;
    db::check_schema_ready(&db)
        .await
        .context("refusing to serve")?;
    leader::store::check_roles_seeded(&db)
        .await
        .context("refusing to serve")?;

    let recorder = PrometheusBuilder::new()
        .set_buckets(&[
            0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0,
        ])
        .context("metrics buckets")?
        .build_recorder();
    let metrics = recorder.handle();
    let telemetry = Telemetry::new(Arc::new(recorder));
    scheduler::precreate_series(&telemetry);

    let mut specs = Vec::new();
    for rc in &config.roles {
        match work_for(rc.role, &config, &db, &telemetry)? {
            Some(work) => specs.push(RoleSpec {
                role: rc.role,
                interval: rc.interval,
                work,
            }),
            None if config.roles_explicit => bail!(
                "HARDCOUNT_ROLES names {}, which this build does not implement yet",
                rc.role
            ),
            None => info!(role = %rc.role, "role not implemented in this build; not polling it"),
        }
    }

    // Lease statements get their own small pool, so a burst of job statements
    // cannot make a RENEW wait for a connection.
    let lease_db = Db::connect_lazy(&config.database_url, specs.len() as u32 + 1)?;
    let manager = Manager::new(lease_db.clone(), Timing::ADR, telemetry.clone());
    // Handlers first: a SIGTERM from here on releases leases rather than killing the process.
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    let root = CancellationToken::new();
    let tracker = TaskTracker::new();

    let listener = tokio::net::TcpListener::bind(config.http_addr)
        .await
        .with_context(|| format!("cannot listen on {}", config.http_addr))?;
    info!(addr = %listener.local_addr()?, holder = manager.holder_id(), roles = ?specs.iter().map(|s| s.role.as_str()).collect::<Vec<_>>(), "serving");
    let app = router(AppState {
        db: db.clone(),
        telemetry: telemetry.clone(),
        metrics,
        roles: specs.iter().map(|s| s.role).collect(),
    });
    let http_stop = root.clone();
    let http = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { http_stop.cancelled().await })
            .await
    });

    for spec in specs {
        tracker.spawn(scheduler::run_role(
            manager.clone(),
            spec,
            root.child_token(),
        ));
    }
    tracker.close();

    tokio::select! {
        _ = term.recv() => info!("SIGTERM: stopping; running ticks are released as interrupted"),
        _ = int.recv() => info!("SIGINT: stopping; running ticks are released as interrupted"),
    }
    root.cancel();
    tokio::spawn(async move {
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        warn!("second signal: exiting at once");
        std::process::exit(130);
    });
    // Lead gives cancelled work its grace, then releases on its own deadline.
    let t = Timing::ADR;
    if tokio::time::timeout(
        t.cancel_grace + t.statement_timeout + Duration::from_secs(2),
        tracker.wait(),
    )
    .await
    .is_err()
    {
        warn!("role loops did not stop in time; their leases will expire");
    }
    let _ = http.await;
    lease_db.close().await;
    db.close().await;
    info!("stopped");
    Ok(())
}
