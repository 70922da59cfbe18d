//! Webhook delivery against real Postgres (directly and through PgBouncer) and
//! real HTTP receivers on loopback.
//!
//! Each guard test names, in its comment, the mutation that makes it fail and
//! that it was seen failing under.

mod backlog_reads;
mod disabling;
mod endpoints;
mod fairness;
mod fencing;
mod gone;
mod outcomes;
mod plans;
mod probe;
mod relay;
mod retention;
mod rotation;
mod sealed;
mod ssrf_table;
mod tenants;
mod tick_ends;
mod wake;
mod wiring;

use std::sync::Arc;
use std::time::Duration;

use db::{Db, Row, sql};
use leader::{Role, Telemetry};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use scheduler::{RoleSpec, Wake, run_role, work};
use testbed::TestDb;
use tokio_util::sync::CancellationToken;
use webhook_delivery::backoff::RetrySchedule;
use webhook_delivery::ssrf::Allowlist;
use webhook_delivery::{Endpoint, Keyring, TickReport, Worker, WorkerConfig, create_endpoint};
use webhook_outbox::{Dispatcher, DispatcherConfig};

pub use testbed::leadership::{as_leader, fast_timing as fast, manager, patient_manager};
/// Verify a received delivery the way a receiver would, independently of this
/// crate's `signature` module: headers, a timestamp fresh at arrival, the HMAC.
pub use testbed::webhook_verify::verify;

/// Fast settings for tests: loopback allowed, 1 s per request, retries 200 ms
/// apart: longer than the driver's `BUSY_POLL` (50 ms) plus jitter, so a retry
/// is not attempted again within the tick that scheduled it.
pub fn config() -> WorkerConfig {
    WorkerConfig {
        connect_timeout: Duration::from_millis(500),
        request_timeout: Duration::from_secs(1),
        claim_margin: Duration::from_secs(1),
        tick_budget: Duration::from_secs(5),
        retry_schedule: RetrySchedule::parse("200ms,200ms,200ms").unwrap(),
        allowlist: Allowlist::parse("127.0.0.0/8").unwrap(),
        secrets: Some(keyring()),
        ..WorkerConfig::default()
    }
}

/// A worker with its own metrics.
pub fn worker(db: &Db, config: WorkerConfig) -> (Worker, PrometheusHandle) {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let w = Worker::new(db.clone(), config, Telemetry::new(Arc::new(recorder))).unwrap();
    (w, handle)
}

/// The value of one series in a Prometheus text rendering, if present.
pub fn series(handle: &PrometheusHandle, name: &str, labels: &str) -> Option<f64> {
    let wanted = if labels.is_empty() {
        format!("{name} ")
    } else {
        format!("{name}{{{labels}}} ")
    };
    handle
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(&wanted).map(|v| v.trim().parse().unwrap()))
}

pub fn outcomes(handle: &PrometheusHandle, outcome: &str) -> f64 {
    series(
        handle,
        "hardcount_webhook_deliveries_total",
        &format!("outcome=\"{outcome}\""),
    )
    .unwrap_or(0.0)
}

/// The test bed's application key ([`testbed::SECRETS_KEY`]).
pub fn keyring() -> Keyring {
    Keyring::parse(testbed::SECRETS_KEY).unwrap()
}

/// An endpoint of `tenant`, created as the API role creates it.
pub async fn endpoint(t: &TestDb, tenant: &str, url: &str) -> Endpoint {
    create_endpoint(&t.api(), &keyring(), tenant, url, &[] as &[&str])
        .await
        .unwrap()
}

/// Enqueue events for `tenant` and fan them out, so each endpoint of the
/// tenant gets one pending delivery per event. Returns the event ids.
pub async fn events(db: &Db, tenant: &str, n: usize) -> Vec<i64> {
    events_handed_over(db, tenant, n, None).await
}

/// [`events`], the fan-out handing its deliveries over to `hand_over` (the
/// delivery role's wake in this process; docs/adr/0070).
pub async fn events_handed_over(
    db: &Db,
    tenant: &str,
    n: usize,
    hand_over: Option<&Wake>,
) -> Vec<i64> {
    let payloads: Vec<String> = (0..n)
        .map(|i| format!(r#"{{"invoice": "in_{i}", "amount_due": {}}}"#, 1000 + i))
        .collect();
    payloads_handed_over(db, tenant, &payloads, hand_over).await
}

/// Enqueue these payloads of `tenant`, one event each, in one transaction,
/// not fanned out; their events' ids.
pub async fn enqueue_payloads(db: &Db, tenant: &str, payloads: &[String]) -> Vec<i64> {
    let mut tx = db.begin().await.unwrap();
    let mut ids = Vec::new();
    for payload in payloads {
        ids.push(
            webhook_outbox::enqueue(&mut tx, tenant, "invoice.finalized", payload)
                .await
                .unwrap(),
        );
    }
    tx.commit().await.unwrap();
    ids
}

/// [`events_handed_over`] with these payloads, one event each.
pub async fn payloads_handed_over(
    db: &Db,
    tenant: &str,
    payloads: &[String],
    hand_over: Option<&Wake>,
) -> Vec<i64> {
    let ids = enqueue_payloads(db, tenant, payloads).await;
    let mut dispatcher =
        Dispatcher::new(db.clone(), DispatcherConfig::default(), Telemetry::noop()).unwrap();
    if let Some(wake) = hand_over {
        dispatcher = dispatcher.with_hand_over(wake.clone());
    }
    as_leader(
        &patient_manager(db, "outbox"),
        Role::WebhookOutbox,
        |tick| async move {
            dispatcher.run_tick(&tick).await;
        },
    )
    .await;
    ids
}

/// Run `w` as the led delivery role at a 5 s interval, in the background,
/// until the token is cancelled; then await the handle.
pub fn led_role(db: &Db, w: Worker) -> (tokio::task::JoinHandle<()>, CancellationToken) {
    let spec = RoleSpec {
        role: Role::WebhookDelivery,
        interval: Duration::from_secs(5),
        work: work(move |tick| {
            let w = w.clone();
            async move { w.run_tick(&tick).await.end }
        }),
    };
    let shutdown = CancellationToken::new();
    let role = tokio::spawn(run_role(manager(db, "w"), spec, shutdown.child_token()));
    (role, shutdown)
}

/// One webhook_delivery tick as leader, under a lease that tolerates renewals
/// answered seconds late (`testbed::leadership::patient_timing`).
pub async fn tick(db: &Db, w: &Worker) -> TickReport {
    let w = w.clone();
    as_leader(
        &patient_manager(db, "worker"),
        Role::WebhookDelivery,
        |tick| async move { w.run_tick(&tick).await },
    )
    .await
}

/// Whether an endpoint is on, whether its turn-off is stamped, and why it was
/// turned off.
#[derive(Debug)]
pub struct EndpointState {
    pub enabled: bool,
    pub stamped: bool,
    pub reason: Option<String>,
}

pub async fn endpoint_state(db: &Db, id: i64) -> EndpointState {
    let row = db
        .fetch_one(
            sql(
                "SELECT enabled, disabled_reason, disabled_at IS NOT NULL AS stamped \
                 FROM webhook_endpoints WHERE id = $1",
            )
            .bind(id),
        )
        .await
        .unwrap();
    EndpointState {
        enabled: row.get("enabled"),
        stamped: row.get("stamped"),
        reason: row.get("disabled_reason"),
    }
}

/// A delivery row, as the tests look at it.
#[derive(Debug, Clone, PartialEq)]
pub struct Delivery {
    pub id: i64,
    pub endpoint_id: i64,
    pub status: String,
    pub attempts: i32,
    pub last_status_code: Option<i32>,
    pub last_error: Option<String>,
    pub delivered: bool,
    /// Seconds until it is due: the later of `next_attempt_at` and its claim's
    /// lease (`claimed_until`), minus `now()`.
    pub due_in: f64,
}

pub async fn deliveries(db: &Db) -> Vec<Delivery> {
    db.fetch_all(sql(
        "SELECT id, endpoint_id, status, attempts, last_status_code, last_error, \
                delivered_at IS NOT NULL AS delivered, \
                extract(epoch FROM GREATEST(next_attempt_at, claimed_until) - now())::float8 AS due_in \
         FROM webhook_deliveries ORDER BY id",
    ))
    .await
    .unwrap()
    .iter()
    .map(|r| Delivery {
        id: r.get("id"),
        endpoint_id: r.get("endpoint_id"),
        status: r.get("status"),
        attempts: r.get("attempts"),
        last_status_code: r.get("last_status_code"),
        last_error: r.get("last_error"),
        delivered: r.get("delivered"),
        due_in: r.get("due_in"),
    })
    .collect()
}

/// Make every pending delivery due now, as time passing would.
pub async fn make_due(t: &testbed::TestDb) {
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "UPDATE webhook_deliveries SET next_attempt_at = now() - interval '1 second', \
                claimed_until = NULL \
         WHERE status = 'pending'",
    )
    .execute(&mut su)
    .await
    .unwrap();
}
