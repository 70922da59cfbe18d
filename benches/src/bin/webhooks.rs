//! Webhook benchmark (issue 5, item 7).
//!
//! Both roles (`webhook_outbox` and `webhook_delivery`) run the way `hardcount
//! serve` runs them: `scheduler::run_role` loops under a real `leader::Manager`,
//! on an app pool through PgBouncer in transaction mode, POSTing signed requests
//! to a local axum receiver on 127.0.0.1.
//!
//! 1. Throughput: events x endpoints deliveries are enqueued before the loops
//!    start; the wall time until every delivery is `delivered` gives signed
//!    deliveries per second (median of the runs).
//! 2. Latency: a producer commits events at a steady rate; each delivery's
//!    latency is its arrival at the receiver minus its event's commit, both on
//!    this process's monotonic clock.
//!
//! Run on the test bed, which exports `HARDCOUNT_TEST_PG` and `HARDCOUNT_TEST_BOUNCER`:
//!
//! ```sh
//! scripts/bed run cargo run --release -p benches --bin webhooks
//! ```
//!
//! It overwrites `docs/benchmarks/webhooks.md` and `docs/benchmarks/webhooks.json`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use benches::{CpuSnapshot, CpuUse};
use clap::{Parser, ValueEnum};
use db::{Db, Row as _, sql};
use hmac::{Hmac, Mac as _};
use leader::{Manager, Role, Telemetry, Timing};
use scheduler::{RoleSpec, run_role, work};
use serde_json::{Map, Value, json};
use sha2::Sha256;
use testbed::{Leg, TestDb};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use webhook_delivery::ssrf::Allowlist;
use webhook_delivery::{Worker, WorkerConfig, create_endpoint};
use webhook_outbox::{Dispatcher, DispatcherConfig};

const COMMAND: &str = "scripts/bed run cargo run --release -p benches --bin webhooks";
const THROUGHPUT_TARGET: f64 = 2000.0;
const P99_TARGET_MS: f64 = 2000.0;
const TENANT: &str = "tenant_bench";
const EVENT_TYPE: &str = "invoice.finalized";
/// How often the throughput phase counts delivered rows.
const POLL: Duration = Duration::from_millis(25);
/// Signed requests kept per endpoint and checked after each phase.
const SAMPLES_PER_ENDPOINT: usize = 5;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Path {
    /// Through PgBouncer in transaction mode: the production shape.
    Pgbouncer,
    /// Straight to Postgres: for comparison only.
    Direct,
}

impl Path {
    fn leg(self) -> Leg {
        match self {
            Path::Pgbouncer => Leg::PgBouncer,
            Path::Direct => Leg::Direct,
        }
    }
}

#[derive(Parser, Debug)]
#[command(about = "Throughput and latency of the webhook outbox and delivery roles")]
struct Args {
    /// Throughput runs; the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Events enqueued before each throughput run.
    #[arg(long, default_value_t = 2000)]
    events: usize,
    /// Endpoints of the tenant in the throughput runs (each gets every event).
    #[arg(long, default_value_t = 5)]
    endpoints: usize,
    /// Events per producer transaction when pre-loading.
    #[arg(long, default_value_t = 100)]
    events_per_tx: usize,
    /// Interval of both roles, in milliseconds (the pause after a tick ends).
    #[arg(long, default_value_t = 50)]
    interval_ms: u64,
    /// Events claimed per outbox batch (DispatcherConfig::batch_size).
    #[arg(long, default_value_t = 500)]
    outbox_batch: usize,
    /// Deliveries claimed per batch (WorkerConfig::batch_size).
    #[arg(long, default_value_t = 500)]
    batch_size: usize,
    /// Requests in flight across endpoints (WorkerConfig::max_in_flight).
    #[arg(long, default_value_t = 16)]
    max_in_flight: usize,
    /// Requests in flight per endpoint (WorkerConfig::max_in_flight_per_endpoint).
    #[arg(long, default_value_t = 4)]
    per_endpoint: usize,
    /// Connections in the roles' app pool (the leader manager shares it).
    #[arg(long, default_value_t = 8)]
    pool: u32,
    /// Connections in the latency phase's producer pool.
    #[arg(long, default_value_t = 4)]
    producer_pool: u32,
    /// Events per second the latency phase's producer commits.
    #[arg(long, default_value_t = 200)]
    rate: u32,
    /// Seconds the latency phase's producer runs.
    #[arg(long, default_value_t = 30)]
    latency_secs: u64,
    /// Endpoints of the tenant in the latency phase.
    #[arg(long, default_value_t = 2)]
    latency_endpoints: usize,
    /// Interval of the extra latency phase run at production's role interval
    /// (`HARDCOUNT_WEBHOOK_*_INTERVAL` default); 0 skips it.
    #[arg(long, default_value_t = 1000)]
    production_interval_ms: u64,
    /// Skip the extra throughput runs: one with `WorkerConfig::default()`'s batch
    /// size and concurrency, one straight to Postgres (the other path).
    #[arg(long)]
    skip_comparison_runs: bool,
    /// How the app reaches Postgres.
    #[arg(long, value_enum, default_value = "pgbouncer")]
    path: Path,
    /// Only the throughput runs.
    #[arg(long)]
    skip_latency: bool,
    /// Only the latency phase.
    #[arg(long)]
    skip_throughput: bool,
    /// Where to write webhooks.md and webhooks.json (default: the workspace's docs/benchmarks).
    #[arg(long)]
    out_dir: Option<PathBuf>,
}

impl Args {
    /// The tuned shape: the benchmark's interval, batch sizes and concurrency.
    fn shape(&self) -> Shape {
        Shape {
            interval: Duration::from_millis(self.interval_ms),
            worker: self.worker_config(),
            dispatcher: self.dispatcher_config(),
        }
    }

    fn worker_config(&self) -> WorkerConfig {
        WorkerConfig {
            batch_size: self.batch_size,
            max_in_flight: self.max_in_flight,
            max_in_flight_per_endpoint: self.per_endpoint,
            allowlist: Allowlist::parse("127.0.0.0/8").expect("a valid CIDR"),
            ..WorkerConfig::default()
        }
    }

    fn dispatcher_config(&self) -> DispatcherConfig {
        DispatcherConfig {
            batch_size: self.outbox_batch,
            ..DispatcherConfig::default()
        }
    }
}

/// How the two roles run.
#[derive(Clone)]
struct Shape {
    interval: Duration,
    worker: WorkerConfig,
    dispatcher: DispatcherConfig,
}

#[derive(Clone, Copy)]
enum Target {
    AtLeast(f64),
    AtMost(f64),
}

/// One reported number, with the issue's target when it sets one.
struct Figure {
    name: String,
    value: f64,
    unit: &'static str,
    target: Option<Target>,
}

impl Figure {
    fn new(name: impl Into<String>, value: f64, unit: &'static str) -> Figure {
        Figure {
            name: name.into(),
            value,
            unit,
            target: None,
        }
    }

    fn target(self, target: Target) -> Figure {
        Figure {
            target: Some(target),
            ..self
        }
    }

    fn met(&self) -> Option<bool> {
        self.target.map(|t| match t {
            Target::AtLeast(x) => self.value >= x,
            Target::AtMost(x) => self.value <= x,
        })
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(
        args.runs > 0 && args.events > 0 && args.endpoints > 0 && args.events_per_tx > 0,
        "runs, events, endpoints and events-per-tx must be positive"
    );
    ensure!(
        args.rate > 0 && args.latency_secs > 0 && args.latency_endpoints > 0,
        "rate, latency-secs and latency-endpoints must be positive"
    );
    args.worker_config().validate()?;
    let leg = args.path.leg();
    let mut settings = settings(&args, leg);
    let mut figures = Vec::new();
    let mut notes = Vec::new();

    let receiver = Receiver::start().await?;
    progress(&format!(
        "setup: receiver on {}; app pool through {} ({})",
        receiver.addr,
        path_name(leg),
        leg.addr()
    ));
    let mut machine = {
        let t = TestDb::new().await;
        let mut su = t.superuser().await;
        benches::machine(&mut su).await?
    };

    let shape = args.shape();
    if !args.skip_throughput {
        let mut runs = Vec::new();
        for run in 1..=args.runs {
            progress(&format!(
                "phase 1/5: throughput run {run}/{}: {} events x {} endpoints",
                args.runs, args.events, args.endpoints
            ));
            let r = throughput_run(&args, &shape, leg, &receiver, &format!("run{run}")).await?;
            progress(&format!(
                "phase 1/5: run {run}: {} deliveries in {:.2} s = {:.0} deliveries/s (fan-out done at {:.2} s)",
                r.deliveries,
                r.wall.as_secs_f64(),
                r.rate(),
                r.fanned_out_after
            ));
            runs.push(r);
        }
        throughput_figures(&args, &runs, &mut figures, &mut notes);

        if !args.skip_comparison_runs {
            let d = WorkerConfig::default();
            let defaults = Shape {
                worker: WorkerConfig {
                    batch_size: d.batch_size,
                    max_in_flight: d.max_in_flight,
                    max_in_flight_per_endpoint: d.max_in_flight_per_endpoint,
                    ..shape.worker.clone()
                },
                ..shape.clone()
            };
            let other = match leg {
                Leg::PgBouncer => Leg::Direct,
                Leg::Direct => Leg::PgBouncer,
            };
            let comparisons = [
                (
                    format!(
                        "WorkerConfig::default() batch {} / in flight {} / per endpoint {}",
                        d.batch_size, d.max_in_flight, d.max_in_flight_per_endpoint
                    ),
                    defaults,
                    leg,
                    "defaults",
                ),
                (
                    format!("{}, same settings", path_name(other)),
                    shape.clone(),
                    other,
                    "other-path",
                ),
            ];
            for (what, s, l, label) in comparisons {
                progress(&format!("phase 2/5: one throughput run with {what}"));
                let r = throughput_run(&args, &s, l, &receiver, label).await?;
                progress(&format!(
                    "phase 2/5: {} deliveries in {:.2} s = {:.0} deliveries/s",
                    r.deliveries,
                    r.wall.as_secs_f64(),
                    r.rate()
                ));
                figures.push(Figure::new(
                    format!("throughput, {what} (one run): deliveries/s"),
                    r.rate(),
                    "deliveries/s",
                ));
                figures.push(Figure::new(
                    format!("throughput, {what} (one run): CPU per delivery"),
                    r.cpu_per_delivery() * 1e3,
                    "ms",
                ));
                figures.push(Figure::new(
                    format!("throughput, {what} (one run): CPU, other processes"),
                    100.0 * r.cpu.others / r.cpu.capacity.max(f64::MIN_POSITIVE),
                    "% of all CPUs",
                ));
            }
        }
    }

    if !args.skip_latency {
        progress(&format!(
            "phase 3/5: latency: {} events/s for {} s, {} endpoint(s), role interval {} ms",
            args.rate, args.latency_secs, args.latency_endpoints, args.interval_ms
        ));
        let l = latency_phase(&args, &shape, leg, &receiver, "steady").await?;
        latency_figures(&l, &mut figures, &mut notes);
        if args.production_interval_ms > 0 {
            let slow = Shape {
                interval: Duration::from_millis(args.production_interval_ms),
                ..shape.clone()
            };
            progress(&format!(
                "phase 4/5: latency again at production's role interval, {} ms",
                args.production_interval_ms
            ));
            let l = latency_phase(&args, &slow, leg, &receiver, "production").await?;
            let name = |q: &str| {
                format!(
                    "latency at {} ms role intervals: enqueue-to-delivered {q}",
                    args.production_interval_ms
                )
            };
            for (q, p) in [("p50", 50.0), ("p99", 99.0), ("max", 100.0)] {
                figures.push(Figure::new(
                    name(q),
                    benches::percentile_ms(&l.samples, p),
                    "ms",
                ));
            }
            ensure!(
                l.samples.len() == l.expected,
                "{} of {} deliveries arrived at {} ms intervals",
                l.samples.len(),
                l.expected,
                args.production_interval_ms
            );
        }
    }

    benches::machine_at_end(&mut machine);
    settings.insert("date".into(), json!(benches::now_utc()));
    progress("phase 5/5: writing docs/benchmarks/webhooks.{md,json}");
    let dir = benches::report_dir(args.out_dir.clone())?;
    let md = markdown(&args, &figures, &notes, &machine, &settings);
    std::fs::write(dir.join("webhooks.md"), &md)?;
    let records: Vec<Value> = figures
        .iter()
        .map(|f| json!({"name": f.name, "value": f.value, "unit": f.unit, "machine": machine, "settings": settings}))
        .collect();
    std::fs::write(
        dir.join("webhooks.json"),
        serde_json::to_string_pretty(&records)? + "\n",
    )?;
    println!("{}", table(&figures));
    for n in &notes {
        println!("{n}\n");
    }
    progress(&format!("wrote {}/webhooks.{{md,json}}", dir.display()));
    Ok(())
}

fn progress(msg: &str) {
    eprintln!(
        "[webhooks bench {}] {msg}",
        chrono::Utc::now().format("%H:%M:%S")
    );
}

fn path_name(leg: Leg) -> &'static str {
    match leg {
        Leg::PgBouncer => "PgBouncer (transaction mode)",
        Leg::Direct => "Postgres directly",
    }
}

// ---------------------------------------------------------------- receiver

/// A request kept whole, to check its signature after the phase.
struct Sample {
    id: String,
    timestamp: String,
    signature: String,
    body: Bytes,
}

#[derive(Default)]
struct Inbox {
    requests: AtomicU64,
    /// Requests without one of the three `webhook-*` headers.
    unsigned: AtomicU64,
    /// Requests whose (webhook-id, path) had arrived before.
    repeats: AtomicU64,
    /// First arrival per (webhook-id, path).
    arrivals: Mutex<HashMap<(String, String), Instant>>,
    /// The first few requests per path.
    samples: Mutex<HashMap<String, Vec<Sample>>>,
}

struct Receiver {
    addr: SocketAddr,
    inbox: Arc<Inbox>,
}

impl Receiver {
    /// axum on 127.0.0.1:0, answering 200 with an empty body to every request.
    async fn start() -> Result<Receiver> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let inbox = Arc::new(Inbox::default());
        let app = Router::new().fallback(receive).with_state(inbox.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("receiver stopped: {e}");
            }
        });
        Ok(Receiver { addr, inbox })
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn requests(&self) -> u64 {
        self.inbox.requests.load(Relaxed)
    }

    fn arrived(&self) -> usize {
        self.inbox.arrivals.lock().unwrap().len()
    }

    /// Empty the inbox for the next phase, returning what it held.
    fn take(&self) -> Taken {
        Taken {
            requests: self.inbox.requests.swap(0, Relaxed),
            unsigned: self.inbox.unsigned.swap(0, Relaxed),
            repeats: self.inbox.repeats.swap(0, Relaxed),
            arrivals: std::mem::take(&mut *self.inbox.arrivals.lock().unwrap()),
            samples: std::mem::take(&mut *self.inbox.samples.lock().unwrap()),
        }
    }
}

struct Taken {
    requests: u64,
    unsigned: u64,
    repeats: u64,
    arrivals: HashMap<(String, String), Instant>,
    samples: HashMap<String, Vec<Sample>>,
}

async fn receive(
    State(inbox): State<Arc<Inbox>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> StatusCode {
    let at = Instant::now();
    inbox.requests.fetch_add(1, Relaxed);
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let (Some(id), Some(timestamp), Some(signature)) = (
        header("webhook-id"),
        header("webhook-timestamp"),
        header("webhook-signature"),
    ) else {
        inbox.unsigned.fetch_add(1, Relaxed);
        return StatusCode::OK;
    };
    let path = uri.path().to_owned();
    let first = {
        let mut arrivals = inbox.arrivals.lock().unwrap();
        let key = (id.to_owned(), path.clone());
        match arrivals.entry(key) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(at);
                true
            }
        }
    };
    if !first {
        inbox.repeats.fetch_add(1, Relaxed);
    }
    let mut samples = inbox.samples.lock().unwrap();
    let kept = samples.entry(path).or_default();
    if kept.len() < SAMPLES_PER_ENDPOINT {
        kept.push(Sample {
            id: id.to_owned(),
            timestamp: timestamp.to_owned(),
            signature: signature.to_owned(),
            body,
        });
    }
    StatusCode::OK
}

/// Standard Webhooks: `v1,` + base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}")),
/// checked here independently of the crate's signing code.
fn verify(secret: &str, s: &Sample) -> Result<()> {
    let key = STANDARD.decode(
        secret
            .strip_prefix("whsec_")
            .ok_or_else(|| anyhow!("secret has no whsec_ prefix"))?,
    )?;
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).map_err(|e| anyhow!("{e}"))?;
    mac.update(format!("{}.{}.", s.id, s.timestamp).as_bytes());
    mac.update(&s.body);
    let expected = format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()));
    ensure!(
        s.signature.split(' ').any(|x| x == expected),
        "signature of {} does not verify",
        s.id
    );
    Ok(())
}

/// Check every kept sample against its endpoint's secret; returns how many passed.
fn verify_samples(
    samples: &HashMap<String, Vec<Sample>>,
    secrets: &[(String, String)],
) -> Result<usize> {
    let mut verified = 0;
    for (path, secret) in secrets {
        let kept = samples
            .get(path)
            .ok_or_else(|| anyhow!("no request reached {path}"))?;
        for s in kept {
            verify(secret, s).with_context(|| format!("endpoint {path}"))?;
            verified += 1;
        }
    }
    Ok(verified)
}

// ---------------------------------------------------------------- role loops

/// What the role loops' ticks reported, summed.
#[derive(Default)]
struct Ticks {
    outbox_ticks: AtomicU64,
    outbox_events: AtomicU64,
    delivery_ticks: AtomicU64,
    delivery_batches: AtomicU64,
    claimed: AtomicU64,
    delivered: AtomicU64,
    /// Retried, dead, refused, stale, handed back, unrecorded or panicked.
    not_delivered: AtomicU64,
}

struct Loops {
    shutdown: CancellationToken,
    handles: Vec<tokio::task::JoinHandle<()>>,
    ticks: Arc<Ticks>,
}

impl Loops {
    /// Both roles on one replica, wired as `hardcount serve` wires them.
    fn start(db: &Db, shape: &Shape) -> Result<Loops> {
        let telemetry = Telemetry::noop();
        let manager = Manager::with_holder_id(
            db.clone(),
            Timing::ADR,
            telemetry.clone(),
            format!("bench-webhooks-{}", std::process::id()),
        );
        let dispatcher = Dispatcher::new(db.clone(), shape.dispatcher.clone(), telemetry.clone())?;
        let worker = Worker::new(db.clone(), shape.worker.clone(), telemetry)?;
        let ticks = Arc::new(Ticks::default());
        let (t1, t2) = (ticks.clone(), ticks.clone());
        let specs = [
            RoleSpec {
                role: Role::WebhookOutbox,
                interval: shape.interval,
                work: work(move |tick| {
                    let (dispatcher, t) = (dispatcher.clone(), t1.clone());
                    async move {
                        let r = dispatcher.run_tick(&tick).await;
                        t.outbox_ticks.fetch_add(1, Relaxed);
                        t.outbox_events.fetch_add(r.events as u64, Relaxed);
                        r.end
                    }
                }),
            },
            RoleSpec {
                role: Role::WebhookDelivery,
                interval: shape.interval,
                work: work(move |tick| {
                    let (worker, t) = (worker.clone(), t2.clone());
                    async move {
                        let r = worker.run_tick(&tick).await;
                        t.delivery_ticks.fetch_add(1, Relaxed);
                        t.delivery_batches.fetch_add(r.batches as u64, Relaxed);
                        t.claimed.fetch_add(r.claimed as u64, Relaxed);
                        t.delivered.fetch_add(r.delivered as u64, Relaxed);
                        let other = r.retried
                            + r.dead
                            + r.refused
                            + r.stale
                            + r.released
                            + r.unrecorded
                            + r.panicked;
                        t.not_delivered.fetch_add(other as u64, Relaxed);
                        r.end
                    }
                }),
            },
        ];
        let shutdown = CancellationToken::new();
        let handles = specs
            .into_iter()
            .map(|spec| tokio::spawn(run_role(manager.clone(), spec, shutdown.clone())))
            .collect();
        Ok(Loops {
            shutdown,
            handles,
            ticks,
        })
    }

    async fn stop(self) -> Result<Arc<Ticks>> {
        self.shutdown.cancel();
        for h in self.handles {
            h.await.context("a role loop panicked")?;
        }
        Ok(self.ticks)
    }
}

async fn endpoints(
    db: &Db,
    receiver: &Receiver,
    prefix: &str,
    n: usize,
) -> Result<Vec<(String, String)>> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let path = format!("/{prefix}/ep{i}");
        let ep = create_endpoint(db, TENANT, &receiver.url(&path), &[] as &[&str]).await?;
        out.push((path, ep.secret.expose()));
    }
    Ok(out)
}

/// An invoice-shaped payload of about 200 bytes.
fn payload(i: usize) -> String {
    format!(
        r#"{{"invoice":"in_{i:08}","customer":"cus_{:08x}","status":"open","currency":"eur","amount_due":{},"lines":[{{"price":"price_basic","quantity":1}}],"period_end":"2026-12-01T00:00:00Z"}}"#,
        i.wrapping_mul(2_654_435_761) & 0xffff_ffff,
        1000 + i % 90_000
    )
}

/// PgBouncer's counters for `database`, if its admin console answers (only on
/// the PgBouncer path).
async fn bouncer_snapshot(leg: Leg, database: &str) -> Option<HashMap<String, i64>> {
    if leg != Leg::PgBouncer {
        return None;
    }
    let mut admin = benches::bouncer_admin().await.ok()?;
    benches::bouncer_stats(&mut admin, database).await.ok()
}

/// PgBouncer counters over a phase.
struct Bouncer {
    transactions: i64,
    queries: i64,
    /// Microseconds clients waited for a server connection.
    wait_us: i64,
    /// Sampled from `SHOW POOLS`: mean server connections in use, mean clients waiting.
    mean_active: f64,
    mean_waiting: f64,
}

/// Mean `sv_active` and `cl_waiting` of `hardcount_app`'s pool for `database`,
/// sampled every 50 ms until stopped.
struct PoolSampler {
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<Option<(f64, f64)>>,
}

impl PoolSampler {
    fn start(leg: Leg, database: &str) -> PoolSampler {
        let stop = CancellationToken::new();
        let (until, database) = (stop.clone(), database.to_owned());
        let handle = tokio::spawn(async move {
            if leg != Leg::PgBouncer {
                return None;
            }
            let mut admin = benches::bouncer_admin().await.ok()?;
            let (mut active, mut waiting, mut n) = (0i64, 0i64, 0u32);
            while !until.is_cancelled() {
                if let Ok(Some((a, w))) =
                    benches::bouncer_pool(&mut admin, &database, "hardcount_app").await
                {
                    active += a;
                    waiting += w;
                    n += 1;
                }
                until
                    .run_until_cancelled(tokio::time::sleep(Duration::from_millis(50)))
                    .await;
            }
            (n > 0).then(|| (active as f64 / f64::from(n), waiting as f64 / f64::from(n)))
        });
        PoolSampler { stop, handle }
    }

    async fn stop(self) -> Option<(f64, f64)> {
        self.stop.cancel();
        self.handle.await.ok().flatten()
    }
}

fn bouncer_delta(
    before: Option<HashMap<String, i64>>,
    after: Option<HashMap<String, i64>>,
    sampled: Option<(f64, f64)>,
) -> Option<Bouncer> {
    let (b, a) = (before?, after?);
    let d = |k: &str| a.get(k).copied().unwrap_or(0) - b.get(k).copied().unwrap_or(0);
    let (mean_active, mean_waiting) = sampled.unwrap_or((f64::NAN, f64::NAN));
    Some(Bouncer {
        transactions: d("total_xact_count"),
        queries: d("total_query_count"),
        wait_us: d("total_wait_time"),
        mean_active,
        mean_waiting,
    })
}

// ---------------------------------------------------------------- throughput

struct Run {
    deliveries: usize,
    /// Until the poll saw every delivery `delivered`.
    wall: Duration,
    /// The same on the database clock: the last `delivered_at` minus the start.
    db_wall: f64,
    /// When the last event was stamped dispatched, on the database clock.
    fanned_out_after: f64,
    attempts: i64,
    cpu: CpuUse,
    bouncer: Option<Bouncer>,
    ticks: Arc<Ticks>,
    verified: usize,
}

impl Run {
    fn rate(&self) -> f64 {
        self.deliveries as f64 / self.wall.as_secs_f64()
    }

    /// CPU seconds of this process, Postgres and PgBouncer per delivery.
    fn cpu_per_delivery(&self) -> f64 {
        (self.cpu.this_process + self.cpu.postgres + self.cpu.pgbouncer) / self.deliveries as f64
    }
}

async fn throughput_run(
    args: &Args,
    shape: &Shape,
    leg: Leg,
    receiver: &Receiver,
    label: &str,
) -> Result<Run> {
    let t = TestDb::new().await;
    let db = Db::connect_lazy(&t.app_url(leg), args.pool)?;
    let secrets = endpoints(&db, receiver, label, args.endpoints).await?;
    let mut next = 0;
    while next < args.events {
        let mut tx = db.begin().await?;
        for i in next..(next + args.events_per_tx).min(args.events) {
            webhook_outbox::enqueue(&mut tx, TENANT, EVENT_TYPE, &payload(i)).await?;
        }
        tx.commit().await?;
        next += args.events_per_tx;
    }
    let deliveries = args.events * args.endpoints;
    let mut su = t.superuser().await;
    let _ = receiver.take();

    let bouncer0 = bouncer_snapshot(leg, t.name()).await;
    let sampler = PoolSampler::start(leg, t.name());
    let cpu0 = CpuSnapshot::take();
    let db_t0: f64 = sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
        .fetch_one(&mut su)
        .await?;
    let started = Instant::now();
    let loops = Loops::start(&db, shape)?;
    let mut reported = Instant::now();
    let wall = loop {
        // Cheap enough to poll often: both probes stop at the first row of a
        // partial index (undispatched events, pending deliveries).
        let busy: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM webhook_events WHERE dispatched_at IS NULL) \
                 OR EXISTS (SELECT 1 FROM webhook_deliveries WHERE status = 'pending')",
        )
        .fetch_one(&mut su)
        .await?;
        if !busy {
            break started.elapsed();
        }
        if started.elapsed() > Duration::from_secs(300) {
            bail!("not all delivered after 300 s");
        }
        if reported.elapsed() >= Duration::from_secs(1) {
            reported = Instant::now();
            progress(&format!(
                "  {:>5.1} s: {} requests received",
                started.elapsed().as_secs_f64(),
                receiver.requests()
            ));
        }
        tokio::time::sleep(POLL).await;
    };
    let cpu = CpuSnapshot::take().since(&cpu0);
    let sampled = sampler.stop().await;
    let bouncer = bouncer_delta(bouncer0, bouncer_snapshot(leg, t.name()).await, sampled);
    let ticks = loops.stop().await?;

    let (delivered, dead): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'delivered'), count(*) FILTER (WHERE status = 'dead') \
         FROM webhook_deliveries",
    )
    .fetch_one(&mut su)
    .await?;
    ensure!(
        delivered as usize == deliveries && dead == 0,
        "{delivered} of {deliveries} delivered and {dead} dead (see last_error)"
    );
    let (db_wall, fanned_out_after, attempts): (f64, f64, i64) = sqlx::query_as(
        "SELECT extract(epoch FROM (SELECT max(delivered_at) FROM webhook_deliveries))::float8 - $1, \
                extract(epoch FROM (SELECT max(dispatched_at) FROM webhook_events))::float8 - $1, \
                (SELECT sum(attempts) FROM webhook_deliveries)::int8",
    )
    .bind(db_t0)
    .fetch_one(&mut su)
    .await?;
    let got = receiver.take();
    ensure!(got.unsigned == 0, "{} requests came unsigned", got.unsigned);
    ensure!(
        got.arrivals.len() == deliveries,
        "the receiver saw {} distinct deliveries, expected {deliveries}",
        got.arrivals.len()
    );
    let verified = verify_samples(&got.samples, &secrets)?;
    if got.repeats > 0 || got.requests as usize != deliveries {
        progress(&format!(
            "  note: {} requests for {deliveries} deliveries ({} repeats)",
            got.requests, got.repeats
        ));
    }
    drop(su);
    db.close().await;
    Ok(Run {
        deliveries,
        wall,
        db_wall,
        fanned_out_after,
        attempts,
        cpu,
        bouncer,
        ticks,
        verified,
    })
}

fn cpu_figures(phase: &str, cpu: &CpuUse, wall: f64, figures: &mut Vec<Figure>) {
    // Share of the whole machine (all CPUs) over the phase's wall time.
    let capacity = if cpu.capacity > 0.0 {
        cpu.capacity
    } else {
        wall
    };
    for (who, secs) in [
        (
            "this process (role loops, HTTP client, receiver)",
            cpu.this_process,
        ),
        ("Postgres", cpu.postgres),
        ("PgBouncer", cpu.pgbouncer),
        ("other processes", cpu.others),
    ] {
        figures.push(Figure::new(
            format!("{phase}: CPU, {who}"),
            100.0 * secs / capacity,
            "% of all CPUs",
        ));
    }
    figures.push(Figure::new(
        format!("{phase}: CPU, machine busy"),
        100.0 * cpu.machine_busy_share,
        "% of all CPUs",
    ));
}

fn bouncer_figures(
    phase: &str,
    b: &Bouncer,
    deliveries: usize,
    pool_size: Option<f64>,
    figures: &mut Vec<Figure>,
) {
    figures.push(Figure::new(
        format!(
            "{phase}: PgBouncer transactions per delivery (each sqlx release ping counts as one)"
        ),
        b.transactions as f64 / deliveries as f64,
        "transactions",
    ));
    figures.push(Figure::new(
        format!("{phase}: PgBouncer queries (round trips) per delivery"),
        b.queries as f64 / deliveries as f64,
        "queries",
    ));
    figures.push(Figure::new(
        format!("{phase}: PgBouncer mean wait for a server connection, per transaction"),
        b.wait_us as f64 / b.transactions.max(1) as f64 / 1e3,
        "ms",
    ));
    let of = pool_size.map_or_else(String::new, |n| format!(" (of {n})"));
    figures.push(Figure::new(
        format!("{phase}: PgBouncer server connections in use, sampled mean{of}"),
        b.mean_active,
        "connections",
    ));
    figures.push(Figure::new(
        format!("{phase}: PgBouncer clients waiting for a server connection, sampled mean"),
        b.mean_waiting,
        "clients",
    ));
}

fn throughput_figures(
    args: &Args,
    runs: &[Run],
    figures: &mut Vec<Figure>,
    notes: &mut Vec<String>,
) {
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by(|&a, &b| runs[a].rate().total_cmp(&runs[b].rate()));
    let median = &runs[order[order.len() / 2]];
    let name = if runs.len() > 1 {
        format!(
            "throughput: signed deliveries/s, median of {} runs",
            runs.len()
        )
    } else {
        "throughput: signed deliveries/s".to_owned()
    };
    figures.push(
        Figure::new(name, median.rate(), "deliveries/s").target(Target::AtLeast(THROUGHPUT_TARGET)),
    );
    for (i, r) in runs.iter().enumerate() {
        figures.push(Figure::new(
            format!("throughput: run {}: deliveries/s", i + 1),
            r.rate(),
            "deliveries/s",
        ));
    }
    let m = median;
    let wall = m.wall.as_secs_f64();
    figures.push(Figure::new(
        "throughput (median run): wall time, loop start to all delivered (polled)",
        wall,
        "s",
    ));
    figures.push(Figure::new(
        "throughput (median run): wall time on the database clock (last delivered_at)",
        m.db_wall,
        "s",
    ));
    figures.push(Figure::new(
        "throughput (median run): fan-out done (last dispatched_at)",
        m.fanned_out_after,
        "s",
    ));
    figures.push(Figure::new(
        "throughput (median run): attempts per delivery",
        m.attempts as f64 / m.deliveries as f64,
        "attempts",
    ));
    let batches = m.ticks.delivery_batches.load(Relaxed);
    figures.push(Figure::new(
        "throughput (median run): deliveries claimed per batch, mean",
        m.ticks.claimed.load(Relaxed) as f64 / batches.max(1) as f64,
        "deliveries",
    ));
    let nproc = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let cpu_per_delivery = m.cpu_per_delivery();
    figures.push(Figure::new(
        "throughput (median run): CPU per delivery, this process + Postgres + PgBouncer",
        cpu_per_delivery * 1e3,
        "ms",
    ));
    figures.push(Figure::new(
        "throughput (median run): CPU ceiling, all CPUs / CPU per delivery",
        nproc / cpu_per_delivery,
        "deliveries/s",
    ));
    cpu_figures("throughput (median run)", &m.cpu, wall, figures);
    let pool: Option<f64> = benches::bed_bouncer_pool_size().parse().ok();
    if let Some(b) = &m.bouncer {
        bouncer_figures("throughput (median run)", b, m.deliveries, pool, figures);
    }
    let per = |secs: f64| secs / m.deliveries as f64 * 1e3;
    notes.push(format!(
        "Throughput target ({THROUGHPUT_TARGET} deliveries/s) {}: the median run spent {:.2} ms of CPU \
         per delivery (this process {:.2}, Postgres {:.2}, PgBouncer {:.2}); {nproc} CPUs fully busy \
         at that cost would give {:.0} deliveries/s, and {THROUGHPUT_TARGET}/s needs at most {:.2} ms \
         per delivery. The machine was {:.0}% busy; the rest is time the pipeline waited on itself \
         (a claim running alone, a batch waiting for its last delivery, lease polls).",
        if median.rate() >= THROUGHPUT_TARGET { "met" } else { "not met" },
        cpu_per_delivery * 1e3,
        per(m.cpu.this_process),
        per(m.cpu.postgres),
        per(m.cpu.pgbouncer),
        nproc / cpu_per_delivery,
        nproc * 1e3 / THROUGHPUT_TARGET,
        100.0 * m.cpu.machine_busy_share,
    ));
    notes.push(format!(
        "Throughput, median run: {} deliveries ({} events x {} endpoints) in {:.2} s; \
         {} outbox ticks fanned out {} events, {} delivery ticks claimed {} deliveries in {} batches \
         and recorded {} delivered, {} otherwise; {} signatures of kept requests verified. \
         CPU seconds over the run: this process {:.2}, Postgres {:.2}, PgBouncer {:.2}, others {:.2}, \
         out of {:.2} available ({} CPUs x wall); the machine was {:.0}% busy.",
        m.deliveries,
        args.events,
        args.endpoints,
        wall,
        m.ticks.outbox_ticks.load(Relaxed),
        m.ticks.outbox_events.load(Relaxed),
        m.ticks.delivery_ticks.load(Relaxed),
        m.ticks.claimed.load(Relaxed),
        batches,
        m.ticks.delivered.load(Relaxed),
        m.ticks.not_delivered.load(Relaxed),
        m.verified,
        m.cpu.this_process,
        m.cpu.postgres,
        m.cpu.pgbouncer,
        m.cpu.others,
        m.cpu.capacity,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        100.0 * m.cpu.machine_busy_share,
    ));
}

// ---------------------------------------------------------------- latency

struct Latency {
    /// Arrival minus commit, one per delivery that arrived.
    samples: Vec<Duration>,
    expected: usize,
    committed: usize,
    produce_secs: f64,
    /// Producer transactions (BEGIN, enqueue, read message_id, COMMIT), timed whole.
    commit_times: Vec<Duration>,
    producer_errors: u64,
    /// Percentiles on the database clock: delivered_at - the event's created_at.
    db_p50_ms: f64,
    db_p99_ms: f64,
    cpu: CpuUse,
    wall: f64,
    bouncer: Option<Bouncer>,
    verified: usize,
    requests: u64,
}

/// What the producer recorded per committed event.
#[derive(Default)]
struct Commits {
    /// message_id -> the instant its transaction's COMMIT returned.
    at: Mutex<HashMap<String, Instant>>,
    durations: Mutex<Vec<Duration>>,
    errors: AtomicU64,
}

async fn produce_one(db: Db, commits: Arc<Commits>, i: usize) -> Result<()> {
    let started = Instant::now();
    let mut tx = db.begin().await?;
    let id = webhook_outbox::enqueue(&mut tx, TENANT, EVENT_TYPE, &payload(i)).await?;
    let row = tx
        .fetch_one(sql("SELECT message_id FROM webhook_events WHERE id = $1").bind(id))
        .await?;
    let message_id: String = row.try_get("message_id").map_err(db::Error::from)?;
    tx.commit().await?;
    let at = Instant::now();
    commits.at.lock().unwrap().insert(message_id, at);
    commits.durations.lock().unwrap().push(at - started);
    Ok(())
}

async fn latency_phase(
    args: &Args,
    shape: &Shape,
    leg: Leg,
    receiver: &Receiver,
    label: &str,
) -> Result<Latency> {
    let t = TestDb::new().await;
    let url = t.app_url(leg);
    let db = Db::connect_lazy(&url, args.pool)?;
    let producer = Db::connect_lazy(&url, args.producer_pool)?;
    let secrets = endpoints(&db, receiver, label, args.latency_endpoints).await?;
    let mut su = t.superuser().await;
    let _ = receiver.take();

    let loops = Loops::start(&db, shape)?;
    // Let both roles take their first leases and the HTTP client connect.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let bouncer0 = bouncer_snapshot(leg, t.name()).await;
    let sampler = PoolSampler::start(leg, t.name());
    let cpu0 = CpuSnapshot::take();
    let started = Instant::now();
    let commits = Arc::new(Commits::default());
    let mut tasks = JoinSet::new();
    let mut every = tokio::time::interval(Duration::from_secs(1) / args.rate);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let total = args.rate as usize * args.latency_secs as usize;
    let mut reported = Instant::now();
    for i in 0..total {
        every.tick().await;
        let (p, c) = (producer.clone(), commits.clone());
        tasks.spawn(async move {
            if let Err(e) = produce_one(p, c.clone(), i).await
                && c.errors.fetch_add(1, Relaxed) == 0
            {
                eprintln!("producer transaction failed: {e:#}");
            }
        });
        while tasks.try_join_next().is_some() {}
        if reported.elapsed() >= Duration::from_secs(5) {
            reported = Instant::now();
            progress(&format!(
                "  {:>4.1} s: {} events committed, {} deliveries arrived",
                started.elapsed().as_secs_f64(),
                commits.at.lock().unwrap().len(),
                receiver.arrived()
            ));
        }
    }
    while tasks.join_next().await.is_some() {}
    let produce_secs = started.elapsed().as_secs_f64();
    let committed = commits.at.lock().unwrap().len();
    let expected = committed * args.latency_endpoints;
    progress(&format!(
        "  producer done: {committed} events in {produce_secs:.1} s; waiting for {expected} deliveries"
    ));
    let drain_until = Instant::now() + Duration::from_secs(60);
    loop {
        let delivered: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM webhook_deliveries WHERE status = 'delivered'",
        )
        .fetch_one(&mut su)
        .await?;
        if delivered as usize >= expected || Instant::now() > drain_until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let wall = started.elapsed().as_secs_f64();
    let cpu = CpuSnapshot::take().since(&cpu0);
    let sampled = sampler.stop().await;
    let bouncer = bouncer_delta(bouncer0, bouncer_snapshot(leg, t.name()).await, sampled);
    loops.stop().await?;

    let (db_p50, db_p99): (Option<f64>, Option<f64>) = sqlx::query_as(
        "SELECT percentile_disc(0.5) WITHIN GROUP (ORDER BY x), percentile_disc(0.99) WITHIN GROUP (ORDER BY x) \
         FROM (SELECT extract(epoch FROM d.delivered_at - e.created_at)::float8 * 1000 AS x \
               FROM webhook_deliveries d JOIN webhook_events e ON e.id = d.event_id \
               WHERE d.status = 'delivered') s",
    )
    .fetch_one(&mut su)
    .await?;
    let got = receiver.take();
    ensure!(got.unsigned == 0, "{} requests came unsigned", got.unsigned);
    let verified = verify_samples(&got.samples, &secrets)?;
    let at = std::mem::take(&mut *commits.at.lock().unwrap());
    let mut samples = Vec::with_capacity(expected);
    for ((id, _path), arrived) in &got.arrivals {
        if let Some(committed) = at.get(id) {
            samples.push(arrived.saturating_duration_since(*committed));
        }
    }
    samples.sort();
    let mut commit_times = std::mem::take(&mut *commits.durations.lock().unwrap());
    commit_times.sort();
    drop(su);
    db.close().await;
    producer.close().await;
    ensure!(
        samples.len() == expected,
        "only {} of {expected} deliveries reached the receiver",
        samples.len()
    );
    Ok(Latency {
        samples,
        expected,
        committed,
        produce_secs,
        commit_times,
        producer_errors: commits.errors.load(Relaxed),
        db_p50_ms: db_p50.unwrap_or(f64::NAN),
        db_p99_ms: db_p99.unwrap_or(f64::NAN),
        cpu,
        wall,
        bouncer,
        verified,
        requests: got.requests,
    })
}

fn latency_figures(l: &Latency, figures: &mut Vec<Figure>, notes: &mut Vec<String>) {
    let p = |q| benches::percentile_ms(&l.samples, q);
    figures.push(Figure::new(
        "latency: enqueue-to-delivered p50",
        p(50.0),
        "ms",
    ));
    figures.push(
        Figure::new("latency: enqueue-to-delivered p99", p(99.0), "ms")
            .target(Target::AtMost(P99_TARGET_MS)),
    );
    figures.push(Figure::new(
        "latency: enqueue-to-delivered max",
        p(100.0),
        "ms",
    ));
    figures.push(Figure::new(
        "latency: producer rate achieved",
        l.committed as f64 / l.produce_secs,
        "events/s",
    ));
    figures.push(Figure::new(
        "latency: producer transaction p99 (BEGIN, enqueue, read message_id, COMMIT)",
        benches::percentile_ms(&l.commit_times, 99.0),
        "ms",
    ));
    figures.push(Figure::new(
        "latency, database clock: delivered_at - event created_at, p50",
        l.db_p50_ms,
        "ms",
    ));
    figures.push(Figure::new(
        "latency, database clock: delivered_at - event created_at, p99",
        l.db_p99_ms,
        "ms",
    ));
    cpu_figures("latency", &l.cpu, l.wall, figures);
    let pool: Option<f64> = benches::bed_bouncer_pool_size().parse().ok();
    if let Some(b) = &l.bouncer {
        bouncer_figures("latency", b, l.expected.max(1), pool, figures);
    }
    notes.push(format!(
        "Latency: {} events committed in {:.1} s ({} producer errors), {} deliveries expected, \
         {} arrived ({} requests in all); {} signatures of kept requests verified.",
        l.committed,
        l.produce_secs,
        l.producer_errors,
        l.expected,
        l.samples.len(),
        l.requests,
        l.verified,
    ));
}

// ---------------------------------------------------------------- report

fn settings(args: &Args, leg: Leg) -> Map<String, Value> {
    let w = args.worker_config();
    let t = Timing::ADR;
    let mut m = Map::new();
    let mut set = |k: &str, v: Value| {
        m.insert(k.to_owned(), v);
    };
    set("build_profile", json!(benches::build_profile()));
    set("date", json!(benches::now_utc()));
    set("app_path", json!(path_name(leg)));
    set("pgbouncer_pool_mode", json!("transaction"));
    set(
        "pgbouncer_default_pool_size",
        json!(benches::bed_bouncer_pool_size()),
    );
    set("app_pool_max_connections", json!(args.pool));
    set("producer_pool_max_connections", json!(args.producer_pool));
    set("role_interval_ms", json!(args.interval_ms));
    set("outbox_batch_size", json!(args.outbox_batch));
    set("delivery_batch_size", json!(w.batch_size));
    set("delivery_max_in_flight", json!(w.max_in_flight));
    set(
        "delivery_max_in_flight_per_endpoint",
        json!(w.max_in_flight_per_endpoint),
    );
    set(
        "delivery_timeouts",
        json!(format!(
            "connect {:?}, request {:?}, claim margin {:?}, tick budget {:?}",
            w.connect_timeout, w.request_timeout, w.claim_margin, w.tick_budget
        )),
    );
    set(
        "leader_timing",
        json!(format!(
            "ttl {:?}, heartbeat {:?}, statement_timeout {:?}, max_poll {:?}",
            t.ttl, t.heartbeat, t.statement_timeout, t.max_poll
        )),
    );
    set("throughput_runs", json!(args.runs));
    set("throughput_events", json!(args.events));
    set("throughput_endpoints", json!(args.endpoints));
    set(
        "throughput_preload_events_per_tx",
        json!(args.events_per_tx),
    );
    set("latency_rate_events_per_s", json!(args.rate));
    set("latency_producer_secs", json!(args.latency_secs));
    set("latency_endpoints", json!(args.latency_endpoints));
    set("payload_bytes", json!(payload(0).len()));
    set(
        "tokio_worker_threads",
        json!(std::thread::available_parallelism().map_or(0, |n| n.get())),
    );
    m
}

fn table(figures: &[Figure]) -> String {
    let mut out = String::from("| figure | value | target | met |\n|---|---:|---|---|\n");
    for f in figures {
        let value = match f.unit {
            "ms" if f.value < 10.0 => format!("{:.2} ms", f.value),
            "ms" => format!("{:.1} ms", f.value),
            "s" => format!("{:.2} s", f.value),
            "ratio" => format!("{:.4}", f.value),
            "% of all CPUs" | "% of the pool" => format!("{:.0} {}", f.value, f.unit),
            unit => format!("{:.2} {unit}", f.value),
        };
        let target = match f.target {
            Some(Target::AtLeast(t)) => format!(">= {t} {}", f.unit),
            Some(Target::AtMost(t)) => format!("<= {t} {}", f.unit),
            None => String::new(),
        };
        let met = match f.met() {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "",
        };
        out.push_str(&format!("| {} | {value} | {target} | {met} |\n", f.name));
    }
    out
}

fn markdown(
    args: &Args,
    figures: &[Figure],
    notes: &[String],
    machine: &Map<String, Value>,
    settings: &Map<String, Value>,
) -> String {
    let w = args.worker_config();
    format!(
        "# Webhook benchmark

Generated by `benches/src/bin/webhooks.rs`; do not edit by hand. To refresh this file and
`webhooks.json`, run from the repository root:

```sh
{COMMAND}
```

(`--help` lists the knobs: runs, events, endpoints, batch sizes, concurrency, pool sizes,
rate, and `--path direct` to compare with a direct connection; `--out-dir` writes the
reports elsewhere, for experiments.)

**Shape.** One process plays one replica: the `webhook_outbox` and `webhook_delivery` roles
run in `scheduler::run_role` loops under one `leader::Manager` (ADR timing), with an
interval of {interval} ms each, on one app pool of {pool} connections as `hardcount_app`
through {path}; the bed's PgBouncer gives each (database, user) {bouncer} server
connections. The delivery worker POSTs to an axum receiver on 127.0.0.1 (allowlisted
`127.0.0.0/8`) that answers 200 at once, records each request's first arrival by
(`webhook-id`, path), and keeps the first {samples} requests per endpoint, whose Standard
Webhooks signatures are verified after the phase with an HMAC written here, not the crate's. Everything (loops, HTTP client,
receiver, producer) shares this process's tokio runtime; Postgres and PgBouncer run on the
same {nproc} CPUs.

**Throughput.** For each run: a fresh database, {endpoints} endpoints of one tenant, and
{events} events enqueued with `webhook_outbox::enqueue` in transactions of {per_tx}, so
{deliveries} deliveries once fanned out. The clock starts when the loops are spawned; every
{poll} ms a direct superuser connection asks whether any event is undispatched or any
delivery pending (two probes of partial indexes, cheap for Postgres); the run ends when
neither is, and all {deliveries} must then be `delivered` with the receiver having seen each
one. Deliveries/s is deliveries over that wall time, which includes the fan-out, the lease
polls and the poll granularity; the reported figure is the median of {runs} runs. Worker
settings: batch_size {batch}, max_in_flight {in_flight}, max_in_flight_per_endpoint
{per_ep}; outbox batch {outbox_batch}. Two more runs, one each, are for comparison: with
`WorkerConfig::default()`'s batch size and concurrency, and with the same settings over the
other path (straight to Postgres when the main runs go through PgBouncer). CPU time per
process group comes from `/proc` (this process; the bed's postmaster and its children; the
bed's PgBouncer; `other processes` is the rest of the machine's busy time); PgBouncer's
figures come from its admin console (`SHOW STATS` before and after, `SHOW POOLS` sampled
every 50 ms).

**Latency.** A fresh database, {lat_eps} endpoint(s), the loops running for 2 s first; then
a producer starts one transaction every {gap:.1} ms for {secs} s ({rate} events/s) on its
own pool of {ppool} connections: `BEGIN`, `enqueue`, `SELECT message_id` of the new event by
id, `COMMIT`, and notes the instant `COMMIT` returned under the event's `webhook-id`. A
delivery's latency is its first arrival at the receiver minus that instant (same process,
monotonic clock); percentiles are nearest-rank over every delivery, and every delivery must
arrive. As a cross-check the database's own `delivered_at - created_at` is given too
(created_at is the producer transaction's start, delivered_at the outcome write's, both on
the database clock). The phase is then repeated with both role intervals at {prod} ms,
production's default, to show what the intervals cost (no target: the issue sets it for the
benchmark's short intervals).

**What bounds the numbers.** Latency is bounded below by the two poll intervals: an event
waits for the next outbox tick (up to one interval after the last one ended, plus that
tick's work), its delivery for the next delivery tick (again up to one interval), then one
claim and the POST; with {interval} ms intervals that is at most about {twice} ms of
waiting, with production's {prod} ms about {twice_prod} ms, plus the batch ahead of it. A
role is due an interval after its last tick *ended* (`last_tick_ended_at + interval`), so
its period is the interval plus the tick's own length: under load a long delivery tick
(many deliveries, few allowed in flight per endpoint) stretches the wait of everything
enqueued meanwhile, which is why the production-interval figures are more than twice the
interval.

Throughput: each delivery costs one HTTP POST and one outcome transaction (`BEGIN`,
`set_config(statement_timeout)`, a compare-and-set `UPDATE`, `COMMIT`), plus its share of one
claim per batch and one fan-out per outbox batch. Through PgBouncer that transaction is
several round trips (sqlx sends a parameterized statement as Parse/Describe, then
Bind/Execute, each ending in a Sync, since its statement cache is off for the pooler) and
sqlx pings every connection it takes back into its pool (a bare Sync, which PgBouncer
forwards to a server connection and counts as a transaction): the `PgBouncer transactions`
and `queries (round trips) per delivery` rows count them. Each round trip wakes this
process, PgBouncer and a Postgres backend in turn on {nproc} shared CPUs, so the CPU rows
say where the time goes: `CPU per delivery` times the rate is the CPU the run used, and
`CPU ceiling` is the rate at which the {nproc} CPUs would be fully busy at that cost. A
batch is claimed, attempted with bounded concurrency, and only then is the next one
claimed, so each batch also waits for its slowest delivery and the claim runs alone. If
`server connections in use` sat near {bouncer} with clients waiting, the server pool would
be the limit. `other processes` is the rest of the shared machine (builds, other tests);
`loadavg_*` and `cpu_pressure_*` below say how busy it was; rerun before reading much into
one number.

{table}
{notes}
## Machine

{machine}
## Settings

{settings}",
        interval = args.interval_ms,
        twice = 2 * args.interval_ms,
        prod = args.production_interval_ms,
        twice_prod = 2 * args.production_interval_ms,
        pool = args.pool,
        path = settings
            .get("app_path")
            .and_then(Value::as_str)
            .unwrap_or("?"),
        bouncer = benches::bed_bouncer_pool_size(),
        samples = SAMPLES_PER_ENDPOINT,
        nproc = std::thread::available_parallelism().map_or(0, |n| n.get()),
        endpoints = args.endpoints,
        events = args.events,
        per_tx = args.events_per_tx,
        deliveries = args.events * args.endpoints,
        poll = POLL.as_millis(),
        runs = args.runs,
        batch = w.batch_size,
        in_flight = w.max_in_flight,
        per_ep = w.max_in_flight_per_endpoint,
        outbox_batch = args.outbox_batch,
        lat_eps = args.latency_endpoints,
        gap = 1000.0 / f64::from(args.rate),
        secs = args.latency_secs,
        rate = args.rate,
        ppool = args.producer_pool,
        table = table(figures),
        notes = notes.iter().map(|n| format!("{n}\n\n")).collect::<String>(),
        machine = benches::markdown_list(machine),
        settings = benches::markdown_list(settings),
    )
}
