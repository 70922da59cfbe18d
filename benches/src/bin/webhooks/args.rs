//! The flags, and the shape they give the two roles.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, ensure};
use clap::{Parser, ValueEnum};
use leader::Role;
use testbed::Leg;
use webhook_delivery::WorkerConfig;
use webhook_delivery::ssrf::Allowlist;
use webhook_outbox::DispatcherConfig;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Path {
    /// Through PgBouncer in transaction mode: the production shape.
    Pgbouncer,
    /// Straight to Postgres: for comparison only.
    Direct,
}

impl Path {
    pub fn leg(self) -> Leg {
        match self {
            Path::Pgbouncer => Leg::PgBouncer,
            Path::Direct => Leg::Direct,
        }
    }
}

/// The other way to reach Postgres, for the comparison run.
pub fn other(leg: Leg) -> Leg {
    match leg {
        Leg::PgBouncer => Leg::Direct,
        Leg::Direct => Leg::PgBouncer,
    }
}

pub fn path_name(leg: Leg) -> &'static str {
    match leg {
        Leg::PgBouncer => "PgBouncer (transaction mode)",
        Leg::Direct => "Postgres directly",
    }
}

#[derive(Parser, Debug)]
#[command(about = "Throughput and latency of the webhook outbox and delivery roles")]
pub struct Args {
    /// Throughput runs; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Events enqueued before each throughput run.
    #[arg(long, default_value_t = 2000)]
    pub events: usize,
    /// Endpoints of the tenant in the throughput runs (each gets every event).
    #[arg(long, default_value_t = 5)]
    pub endpoints: usize,
    /// Enqueue the throughput runs' events before the clock starts (the
    /// figures of issue 5); by default they are enqueued inside it, while the
    /// roles run, like for like with a job queue whose insert is timed.
    #[arg(long)]
    pub enqueue_outside_clock: bool,
    /// Events per producer transaction in the throughput runs.
    #[arg(long, default_value_t = 100)]
    pub events_per_tx: usize,
    /// Enqueue the throughput runs' events with one `enqueue` statement each;
    /// by default each transaction's events go in one `enqueue_many` statement,
    /// like for like with the peer's bulk insert.
    #[arg(long)]
    pub enqueue_each: bool,
    /// The tuned shape (its throughput row, the latency and fairness phases):
    /// interval of both roles, in milliseconds (the pause after a tick ends).
    #[arg(long, default_value_t = 50)]
    pub interval_ms: u64,
    /// The tuned shape: events claimed per outbox batch (DispatcherConfig::batch_size).
    #[arg(long, default_value_t = 500)]
    pub outbox_batch: usize,
    /// The tuned shape: deliveries claimed per batch (WorkerConfig::batch_size).
    #[arg(long, default_value_t = 500)]
    pub batch_size: usize,
    /// The tuned shape: requests in flight across endpoints (WorkerConfig::max_in_flight).
    #[arg(long, default_value_t = 16)]
    pub max_in_flight: usize,
    /// The tuned shape: requests in flight per endpoint (WorkerConfig::max_in_flight_per_endpoint).
    #[arg(long, default_value_t = 4)]
    pub per_endpoint: usize,
    /// Connections in the roles' app pool (the leader manager shares it).
    #[arg(long, default_value_t = 8)]
    pub pool: u32,
    /// Connections in the latency phase's producer pool.
    #[arg(long, default_value_t = 4)]
    pub producer_pool: u32,
    /// Events per second the latency phase's producer commits.
    #[arg(long, default_value_t = 200)]
    pub rate: u32,
    /// Seconds the latency phase's producer runs.
    #[arg(long, default_value_t = 30)]
    pub latency_secs: u64,
    /// Endpoints of the tenant in the latency phase.
    #[arg(long, default_value_t = 2)]
    pub latency_endpoints: usize,
    /// Interval of the extra latency phase run at production's role interval
    /// (`HARDCOUNT_WEBHOOK_*_INTERVAL` default); 0 skips it.
    #[arg(long, default_value_t = 1000)]
    pub production_interval_ms: u64,
    /// Skip the latency phase with wake-ups: both roles LISTEN on a session
    /// connection straight to Postgres (`HARDCOUNT_LISTEN_URL`), at production's
    /// role interval.
    #[arg(long)]
    pub skip_listen: bool,
    /// Skip the extra throughput runs: one with the tuned shape, one with the
    /// shipped defaults over the other path.
    #[arg(long)]
    pub skip_comparison_runs: bool,
    /// How the app reaches Postgres.
    #[arg(long, value_enum, default_value = "pgbouncer")]
    pub path: Path,
    /// Only the throughput runs.
    #[arg(long)]
    pub skip_latency: bool,
    /// Only the latency phase.
    #[arg(long)]
    pub skip_throughput: bool,
    /// Where to write webhooks.md and webhooks.json (default: the workspace's docs/benchmarks).
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    #[command(flatten)]
    pub fairness: FairnessFlags,
}

impl Args {
    /// Refuse flags that would make a phase empty or the worker refuse its config.
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.runs > 0 && self.events > 0 && self.endpoints > 0 && self.events_per_tx > 0,
            "runs, events, endpoints and events-per-tx must be positive"
        );
        ensure!(
            self.rate > 0 && self.latency_secs > 0 && self.latency_endpoints > 0,
            "rate, latency-secs and latency-endpoints must be positive"
        );
        self.worker_config().validate()?;
        Ok(())
    }

    /// The shipped shape, the main throughput runs': what `hardcount serve`
    /// runs with no tuning (`WorkerConfig::default()`, `DispatcherConfig::default()`,
    /// the roles' default interval), with the benchmark's allowlist and keys.
    pub fn shipped_shape(&self) -> Shape {
        let interval = scheduler::default_interval(Role::WebhookDelivery);
        debug_assert_eq!(interval, scheduler::default_interval(Role::WebhookOutbox));
        Shape {
            interval,
            worker: WorkerConfig {
                allowlist: Allowlist::parse("127.0.0.0/8").expect("a valid CIDR"),
                secrets: Some(crate::workload::bench_keyring()),
                ..WorkerConfig::default()
            },
            dispatcher: DispatcherConfig::default(),
            listen: false,
        }
    }

    /// The tuned shape: the benchmark's interval, batch sizes and concurrency.
    pub fn shape(&self) -> Shape {
        Shape {
            interval: Duration::from_millis(self.interval_ms),
            worker: self.worker_config(),
            dispatcher: self.dispatcher_config(),
            listen: false,
        }
    }

    pub fn worker_config(&self) -> WorkerConfig {
        WorkerConfig {
            batch_size: self.batch_size,
            max_in_flight: self.max_in_flight,
            max_in_flight_per_endpoint: self.per_endpoint,
            // One tenant: its share and its one receiver's are the whole
            // worker's, as before they existed (the fairness phase sets them).
            max_in_flight_per_tenant: self.max_in_flight,
            max_in_flight_per_destination: self.max_in_flight,
            allowlist: Allowlist::parse("127.0.0.0/8").expect("a valid CIDR"),
            secrets: Some(crate::workload::bench_keyring()),
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
pub struct Shape {
    pub interval: Duration,
    pub worker: WorkerConfig,
    pub dispatcher: DispatcherConfig,
    /// Both roles LISTEN for wake-ups on a direct session connection.
    pub listen: bool,
}

impl Shape {
    /// How the throughput rows name this shape: its interval, batch sizes and
    /// concurrency.
    pub fn describe(&self) -> String {
        let w = &self.worker;
        format!(
            "interval {} ms, outbox batch {}, batch {} / in flight {} / per endpoint {} / per tenant {} / per destination {}",
            self.interval.as_millis(),
            self.dispatcher.batch_size,
            w.batch_size,
            w.max_in_flight,
            w.max_in_flight_per_endpoint,
            w.max_in_flight_per_tenant,
            w.max_in_flight_per_destination
        )
    }

    /// This shape with wake-ups on.
    pub fn listening(&self) -> Shape {
        Shape {
            listen: true,
            ..self.clone()
        }
    }

    /// This shape with both role intervals at `interval`.
    pub fn with_interval(&self, interval: Duration) -> Shape {
        Shape {
            interval,
            ..self.clone()
        }
    }
}

/// The fairness phase's flags (flattened into `Args`).
#[derive(clap::Args, Debug)]
pub struct FairnessFlags {
    /// Skip the fairness phase: the healthy tenant alone, then beside a tenant
    /// whose 8 endpoints point at a tarpit.
    #[arg(long)]
    pub skip_fairness: bool,
    /// Events of the healthy tenant in each fairness run (each to its 2 endpoints).
    #[arg(long, default_value_t = 10_000)]
    pub fairness_events: usize,
    /// Pairs of fairness runs (alone, then beside the tarpit), interleaved; the
    /// median of each is reported.
    #[arg(long, default_value_t = 5)]
    pub fairness_runs: usize,
}
