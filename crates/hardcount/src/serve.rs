//! `hardcount serve`: boot checks, role loops, HTTP, and shutdown, on a listener
//! and a cancellation token the caller owns.
//!
//! Shutdown follows the tokio pattern: the caller's `CancellationToken` is the
//! root (the binary's `main` cancels it on the first SIGTERM or SIGINT), each role
//! loop gets a child, a `TaskTracker` waits. On cancel, loops stop acquiring,
//! running ticks are cancelled and released as interrupted (no cooldown,
//! docs/adr/0003), and [`run`] returns.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use db::Db;
use email_outbox::{Sender, SenderConfig, SmtpUrl};
use leader::{Manager, Role, Telemetry, Timing};
use metrics_exporter_prometheus::PrometheusBuilder;
use scheduler::{RoleConfig, RoleSpec, Wake, Work};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};
use webhook_delivery::{Worker, WorkerConfig};
use webhook_outbox::{Dispatcher, DispatcherConfig};

use crate::http::{AppState, StatusSnapshot, refresh_status, router};
use crate::secret::Secret;

/// How often histogram samples are drained into their buckets, scraped or
/// not (the interval `PrometheusBuilder::install` would use).
const METRICS_UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// What [`run`] runs; built from the environment by `settings`.
#[derive(Debug, Clone)]
pub struct Config {
    /// The app pool's URL, as `hardcount_app` (never printed: it may hold a password).
    pub database_url: Secret,
    pub roles: Vec<RoleConfig>,
    /// True when HARDCOUNT_ROLES was set: naming a role this build cannot run is then an error.
    pub roles_explicit: bool,
    /// Variables set for roles this replica does not run (HARDCOUNT_ROLES),
    /// each with its role: intervals, schedules, and the settings read by
    /// email_outbox (SMTP), webhook_delivery (the allowlist and lowest port
    /// only where the tenant API is off) and dunning (docs/adr/0140). They take
    /// effect only on a replica that runs the role. `run` warns of each at
    /// startup.
    pub ignored: Vec<(String, Role)>,
    pub webhook_delivery: WorkerConfig,
    /// SMTP_URL and the sender's settings; None when SMTP_URL is unset.
    pub email: Option<EmailConfig>,
    /// Billing's settings, with the payment provider when one is configured.
    pub billing: billing::BillingConfig,
    /// Dunning's settings (HARDCOUNT_DUNNING_*); its email sender is billing's.
    pub dunning: dunning::DunningConfig,
    /// `HARDCOUNT_LISTEN_URL`: a session-capable connection (Postgres directly,
    /// or a session-mode pooler) on which the webhook roles LISTEN for
    /// wake-ups (docs/adr/0014). None: they poll at their interval.
    pub listen_url: Option<Secret>,
    /// `HARDCOUNT_API_ADDR` and its settings: the tenant API, served beside
    /// the roles (a producer, never a role: docs/adr/0035). None: no API.
    pub api: Option<ApiServe>,
    /// `HARDCOUNT_LEASE_DATABASE_URL`: the lease statements' own path (a
    /// PgBouncer alias with its own server pool, docs/adr/0036). None: DATABASE_URL.
    pub lease_database_url: Option<Secret>,
    /// How long each kind of finished row is kept (HARDCOUNT_RETENTION_*,
    /// docs/adr/0040); every role prunes what it finished.
    pub retention: RetentionSettings,
    /// The lease's timings (`HARDCOUNT_LEASE_PROFILE`: `Timing::ADR`, or
    /// `Timing::FAST`, docs/adr/0047).
    pub timing: Timing,
}

/// How long each kind of finished row is kept before its role deletes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionSettings {
    /// Delivered and dead deliveries with their attempts, dispatched events.
    pub webhooks: Duration,
    /// Sent and failed emails.
    pub emails: Duration,
    /// The raw provider answer on a resolved payment attempt.
    pub payment_logs: Duration,
    /// Every role's ended lease terms.
    pub lease_history: Duration,
}

impl Default for RetentionSettings {
    fn default() -> RetentionSettings {
        let d = scheduler::DEFAULT_RETENTION;
        RetentionSettings {
            webhooks: d,
            emails: d,
            payment_logs: d,
            lease_history: d,
        }
    }
}

impl RetentionSettings {
    /// A role's prune settings, keeping its own rows `keep`.
    pub fn role(&self, keep: Duration) -> scheduler::Retention {
        scheduler::Retention {
            keep,
            lease_history: self.lease_history,
            ..scheduler::Retention::default()
        }
    }
}

/// Where and how the tenant API is served.
#[derive(Debug, Clone)]
pub struct ApiServe {
    pub addr: std::net::SocketAddr,
    /// `HARDCOUNT_API_DATABASE_URL`, as `hardcount_api` (never printed).
    pub database_url: Secret,
    /// Seals the secrets of the endpoints the API creates.
    pub keyring: Option<webhook_delivery::Keyring>,
    pub config: api::ApiConfig,
    /// `HARDCOUNT_OPERATOR_TOKEN` and its pool: the operator API on the same
    /// listener (docs/adr/0042). None: no operator API.
    pub operator: Option<OperatorServe>,
}

/// The operator API's token and pool.
#[derive(Debug, Clone)]
pub struct OperatorServe {
    /// Never printed.
    pub token: Secret,
    /// `HARDCOUNT_OPERATOR_DATABASE_URL`, as `hardcount_operator`.
    pub database_url: Secret,
}

/// How email_outbox reaches its SMTP server.
#[derive(Debug, Clone)]
pub struct EmailConfig {
    pub url: SmtpUrl,
    /// The CA for a private relay's certificate, PEM.
    pub ca_pem: Option<Vec<u8>>,
    pub sender: SenderConfig,
}

/// The work of each role this build implements.
fn work_for(
    role: Role,
    config: &Config,
    db: &Db,
    telemetry: &Telemetry,
    wake: Option<Wake>,
    hand_over: Option<Wake>,
) -> Result<Option<Work>> {
    Ok(match role {
        Role::WebhookOutbox => {
            // Without a listener an idle tick probes (docs/adr/0019).
            let mut dispatcher =
                Dispatcher::new(db.clone(), DispatcherConfig::default(), telemetry.clone())?
                    .with_idle_probe(scheduler::IDLE_PROBE)
                    .with_retention(config.retention.role(config.retention.webhooks));
            if let Some(wake) = wake {
                dispatcher = dispatcher.with_wake(wake);
            }
            if let Some(delivery) = hand_over {
                dispatcher = dispatcher.with_hand_over(delivery);
            }
            let dispatcher = Arc::new(dispatcher);
            Some(scheduler::work(move |tick| {
                let dispatcher = dispatcher.clone();
                async move { dispatcher.run_tick(&tick).await.end }
            }))
        }
        Role::WebhookDelivery => {
            let mut worker = Worker::new(
                db.clone(),
                WorkerConfig {
                    retention: Some(config.retention.role(config.retention.webhooks)),
                    ..config.webhook_delivery.clone()
                },
                telemetry.clone(),
            )?
            .with_idle_probe(scheduler::IDLE_PROBE);
            if let Some(wake) = wake {
                worker = worker.with_wake(wake);
            }
            let worker = Arc::new(worker);
            Some(scheduler::work(move |tick| {
                let worker = worker.clone();
                async move { worker.run_tick(&tick).await.end }
            }))
        }
        Role::EmailOutbox => {
            let Some(email) = &config.email else {
                bail!(
                    "email_outbox is among the roles this replica runs (HARDCOUNT_ROLES, default every role) \
                     but SMTP_URL is not set: set SMTP_URL, or leave email_outbox out of HARDCOUNT_ROLES"
                );
            };
            let sender = Arc::new(
                Sender::new(
                    db.clone(),
                    email.sender.clone(),
                    &email.url,
                    email.ca_pem.as_deref(),
                    telemetry.clone(),
                )?
                .with_retention(config.retention.role(config.retention.emails)),
            );
            Some(scheduler::work(move |tick| {
                let sender = sender.clone();
                async move { sender.run_tick(&tick).await.end }
            }))
        }
        Role::Billing => {
            let biller = Arc::new(
                billing::Biller::new(db.clone(), config.billing.clone(), telemetry.clone())?
                    .with_retention(config.retention.role(config.retention.payment_logs)),
            );
            Some(scheduler::work(move |tick| {
                let biller = biller.clone();
                async move { biller.run_tick(&tick).await.end }
            }))
        }
        Role::Dunning => {
            // Retries charge through billing, dunning's collector (the
            // payments port): its client, claim lease and sender.
            let biller =
                billing::Biller::new(db.clone(), config.billing.clone(), telemetry.clone())?;
            let dunner = Arc::new(
                dunning::Dunner::new(
                    db.clone(),
                    config.dunning.clone(),
                    Arc::new(biller),
                    telemetry.clone(),
                )?
                // Dunning prunes only its lease history: its runs are money.
                .with_retention(config.retention.role(config.retention.lease_history)),
            );
            Some(scheduler::work(move |tick| {
                let dunner = dunner.clone();
                async move { dunner.run_tick(&tick).await.end }
            }))
        }
    })
}

/// Serve `config` on `listener` until `shutdown` is cancelled.
///
/// Refuses to start (an `Err` saying why) when the schema is behind or a lease
/// row is missing. Otherwise runs the role loops and `/healthz`, `/readyz`,
/// `/metrics` on `listener`; once `shutdown` is cancelled it waits for the loops
/// to release their leases (bounded by the lease timing), closes its pools and
/// returns `Ok`.
///
/// # Errors
///
/// A database that is unreachable or not migrated, a role this build does not
/// implement named in `HARDCOUNT_ROLES`, an invalid role configuration.
pub async fn run(config: Config, listener: TcpListener, shutdown: CancellationToken) -> Result<()> {
    scheduler::install_panic_hook();
    for (var, role) in &config.ignored {
        warn!(
            setting = %var,
            %role,
            "ignored: it is set for a role this replica does not run (HARDCOUNT_ROLES); set it on the replicas that run the role"
        );
    }
    let db = Db::connect_lazy(config.database_url.expose(), 10)?;
    // The first statement on DATABASE_URL: a refused connection (TLS, auth)
    // says which variable to fix.
    db::check_schema_ready(&db)
        .await
        .context("refusing to serve (DATABASE_URL)")?;
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

    // Only the delivery worker opens webhook secrets, so only a replica that
    // runs it needs (and is refused without) HARDCOUNT_SECRETS_KEY. A row
    // whose secret cannot be opened here only holds that endpoint's
    // deliveries: it is reported, counted, and everything else runs.
    if config
        .roles
        .iter()
        .any(|rc| rc.role == Role::WebhookDelivery)
    {
        let report = webhook_delivery::check_secrets(&db, config.webhook_delivery.secrets.as_ref())
            .await
            .context("refusing to serve")?;
        for problem in &report.problems {
            warn!(role = %Role::WebhookDelivery, unusable_endpoints = report.unusable_endpoints, "{problem}; those endpoints' deliveries wait, everything else runs");
        }
        telemetry
            .gauge("hardcount_webhook_endpoints_secret_unusable", &[])
            .set(report.unusable_endpoints as f64);
    }

    let mut specs = Vec::new();
    // With HARDCOUNT_LISTEN_URL, the webhook roles are woken by their
    // producers' pg_notify instead of waiting for their interval.
    let mut wakes = Vec::new();
    // The delivery role's wake always exists when this process runs it: the
    // outbox role pokes it after each fan-out (docs/adr/0070), listener or not.
    let delivery_wake = config
        .roles
        .iter()
        .find(|rc| rc.role == Role::WebhookDelivery)
        .map(|rc| match config.listen_url {
            Some(_) => Wake::reporting(rc.role, rc.interval, &telemetry),
            None => Wake::new(rc.role, rc.interval),
        });
    for rc in &config.roles {
        let listens =
            config.listen_url.is_some() && crate::roles::entry(rc.role).is_some_and(|e| e.listens);
        let wake = if rc.role == Role::WebhookDelivery {
            delivery_wake.clone()
        } else {
            listens.then(|| Wake::reporting(rc.role, rc.interval, &telemetry))
        };
        if listens {
            wakes.extend(wake.clone());
        }
        let hand_over = delivery_wake
            .clone()
            .filter(|_| rc.role == Role::WebhookOutbox);
        match work_for(rc.role, &config, &db, &telemetry, wake, hand_over)? {
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
    // cannot make a RENEW wait for a connection; through their own URL (a
    // PgBouncer alias), so they cannot wait for a server connection either
    // (docs/adr/0036).
    let lease_url = config
        .lease_database_url
        .as_ref()
        .unwrap_or(&config.database_url);
    let lease_db = Db::connect_lazy(lease_url.expose(), specs.len() as u32 + 1)?;
    if config.lease_database_url.is_some() {
        leader::store::check_roles_seeded(&lease_db)
            .await
            .context("refusing to serve (HARDCOUNT_LEASE_DATABASE_URL)")?;
    }
    let manager = Manager::new(lease_db.clone(), config.timing, telemetry.clone());
    let root = shutdown;
    let tracker = TaskTracker::new();

    // Logged where something reads it: the delivery role, or the tenant API
    // that refuses endpoint URLs by it (elsewhere it was warned of as ignored,
    // docs/adr/0141).
    if config.api.is_some() || specs.iter().any(|s| s.role == Role::WebhookDelivery) {
        let allowlist = config.webhook_delivery.allowlist.to_string();
        info!(
            webhook_allowlist = if allowlist.is_empty() {
                "none"
            } else {
                allowlist.as_str()
            },
            "SSRF allowlist (HARDCOUNT_WEBHOOK_ALLOWLIST): forbidden ranges re-opened for webhook delivery"
        );
    }
    info!(addr = %listener.local_addr()?, holder = manager.holder_id(), roles = ?specs.iter().map(|s| s.role.as_str()).collect::<Vec<_>>(), "serving");
    // /readyz and /metrics read a snapshot that one task refreshes on its own
    // one-connection pool: no request queries, and a flood of probes cannot take
    // a connection from the roles (issue 12, point 7).
    let status_db = Db::connect_lazy(config.database_url.expose(), 1)?;
    // A lease path of its own is checked on a connection of its own, not one
    // of the lease pool's, which are the RENEWs'.
    let lease_status_db = match &config.lease_database_url {
        Some(url) => Some(Db::connect_lazy(url.expose(), 1)?),
        None => None,
    };
    let status = Arc::new(StatusSnapshot::default());
    // The boot checks above just passed: ready until the first refresh says otherwise.
    status.set(true);
    let refresher = tokio::spawn(refresh_status(
        status_db.clone(),
        lease_status_db.clone(),
        telemetry.clone(),
        specs.iter().map(|s| s.role).collect(),
        status.clone(),
        root.clone(),
    ));
    // `build_recorder` starts no upkeep: a histogram's samples are drained
    // into its buckets only by a render, so a replica nobody scrapes
    // (Prometheus down, a scrape config that misses it, `dev` alone) kept
    // every sample of every attempt and tick, about 8 bytes each, until it
    // ran out of memory. The upkeep drains them whether or not anyone reads.
    let upkeep = tokio::spawn({
        let (metrics, stop) = (metrics.clone(), root.clone());
        async move {
            while stop
                .run_until_cancelled(tokio::time::sleep(METRICS_UPKEEP_EVERY))
                .await
                .is_some()
            {
                metrics.run_upkeep();
            }
        }
    });
    let app = router(AppState { status, metrics });
    let http_stop = root.clone();
    let http = tokio::spawn(crate::http::serve_bounded(listener, app, http_stop));
    let api = match config.api.clone() {
        Some(mut a) => {
            // Receipts of a plan change or a cancel made through the API go
            // out as billing's own do.
            a.config.billing = config.billing.clone();
            Some(serve_api(a, telemetry.clone(), root.clone()).await?)
        }
        None => None,
    };

    if let Some(url) = config.listen_url.clone().filter(|_| !wakes.is_empty()) {
        info!(roles = ?wakes.iter().map(Wake::channel).collect::<Vec<_>>(), "wake-ups on (HARDCOUNT_LISTEN_URL)");
        tracker.spawn(scheduler::listen(
            url.expose().to_owned(),
            wakes,
            config.timing.max_poll,
            root.child_token(),
        ));
    }
    for spec in specs {
        // A role's cron schedule, when it has one, decides when it is due
        // (docs/adr/0043); else its interval.
        let schedule = config
            .roles
            .iter()
            .find(|rc| rc.role == spec.role)
            .map_or(leader::Schedule::Every(spec.interval), |rc| rc.schedule());
        info!(role = %spec.role, schedule = %schedule, "role due on its schedule");
        tracker.spawn(scheduler::run_role_on(
            manager.clone(),
            spec,
            schedule,
            root.child_token(),
        ));
    }
    tracker.close();

    root.cancelled().await;
    // Lead gives cancelled work its grace, then releases on its own deadline;
    // an ACQUIRE already sent is answered within its bound, then released
    // (docs/adr/0099). Only then is the lease pool closed.
    if tokio::time::timeout(
        config.timing.shutdown_bound() + Duration::from_secs(2),
        tracker.wait(),
    )
    .await
    .is_err()
    {
        warn!("role loops did not stop in time; their leases will expire");
    }
    let _ = http.await;
    if let Some((task, api_db)) = api {
        let _ = task.await;
        api_db.close().await;
    }
    let _ = refresher.await;
    let _ = upkeep.await;
    status_db.close().await;
    if let Some(lease_status_db) = lease_status_db {
        lease_status_db.close().await;
    }
    lease_db.close().await;
    db.close().await;
    info!("stopped");
    Ok(())
}

/// Bind the tenant API's listener and serve it until `stop`; its task and pool.
async fn serve_api(
    a: ApiServe,
    telemetry: Telemetry,
    stop: CancellationToken,
) -> Result<(tokio::task::JoinHandle<()>, Db)> {
    let listener = TcpListener::bind(a.addr)
        .await
        .with_context(|| format!("cannot listen on {} (HARDCOUNT_API_ADDR)", a.addr))?;
    // One connection per request in flight; PgBouncer multiplexes them.
    let api_db = Db::connect_lazy(a.database_url.expose(), 32)?;
    db::check_schema_ready(&api_db)
        .await
        .context("refusing to serve the tenant API (HARDCOUNT_API_DATABASE_URL)")?;
    info!(addr = %listener.local_addr()?, "tenant API listening (HARDCOUNT_API_ADDR)");
    let platform_from = a.config.billing.email_from.clone();
    let mut app = api::router(api::Api::with_telemetry(
        api_db.clone(),
        a.keyring,
        a.config,
        telemetry,
    ));
    if let Some(o) = a.operator {
        let operator_db = Db::connect_lazy(
            o.database_url.expose(),
            api::operator::MAX_CONCURRENT as u32,
        )?;
        let operator = api::operator::Operator::new(operator_db, o.token.expose())
            .map_err(|e| anyhow::anyhow!("HARDCOUNT_OPERATOR_TOKEN: {e}"))?
            .with_platform_sender(&platform_from);
        app = app.merge(api::operator::router(operator));
        info!("operator API at /operator/v1 (HARDCOUNT_OPERATOR_TOKEN)");
    }
    Ok((
        tokio::spawn(crate::http::serve_bounded(listener, app, stop)),
        api_db,
    ))
}
