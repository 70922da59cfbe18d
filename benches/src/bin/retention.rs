//! Retention benchmark (issue 25, point 2; docs/adr/0040): webhook throughput
//! of the `webhook_outbox` and `webhook_delivery` roles alone, and again while
//! the delivery role prunes `--old` old delivered deliveries (1,000,000 by
//! default) in its ticks. How it measures is written by hand in
//! `docs/benchmarks/retention.md`; this binary rewrites that file's generated
//! part and `retention.json`.
//!
//! ```sh
//! scripts/bed run cargo run --release -p benches --bin retention
//! ```

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::Parser;
use db::Db;
use leader::{Manager, Role, Telemetry, Timing};
use scheduler::{IDLE_PROBE, Retention, RoleSpec, Wake, run_role, work};
use serde_json::{Value, json};
use testbed::receiver::Receiver;
use testbed::{Leg, TestDb};
use tokio_util::sync::CancellationToken;
use webhook_delivery::{Keyring, Worker, WorkerConfig, create_endpoint};
use webhook_outbox::{Dispatcher, DispatcherConfig, NewEvent, enqueue_many};

const TENANT: &str = "tenant_bench";
const GIVE_UP: Duration = Duration::from_secs(1800);

#[derive(Parser, Debug)]
struct Args {
    /// Old delivered deliveries seeded before the run that prunes.
    #[arg(long, default_value_t = 1_000_000)]
    old: usize,
    /// Events enqueued per run (each fanned out to every endpoint).
    #[arg(long, default_value_t = 20_000)]
    events: usize,
    /// Endpoints, all of one tenant, on the local receiver.
    #[arg(long, default_value_t = 5)]
    endpoints: usize,
    /// Pairs of runs (alone, then during the prune); the median of each is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// How often the delivery role's own ticks prune (the shipped
    /// `scheduler::PRUNE_EVERY`, 5m, by default); the continuous pruner runs
    /// besides.
    #[arg(long, default_value = "5m")]
    prune_every: String,
    /// `bouncer` (the default, PgBouncer in transaction mode) or `direct`.
    #[arg(long, default_value = "bouncer")]
    path: String,
    /// Where to write retention.{md,json} [default: docs/benchmarks].
    #[arg(long)]
    out_dir: Option<std::path::PathBuf>,
}

struct Run {
    deliveries: usize,
    wall: Duration,
    /// Old deliveries deleted while the run lasted.
    pruned: i64,
}

impl Run {
    fn rate(&self) -> f64 {
        self.deliveries as f64 / self.wall.as_secs_f64()
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let leg = match args.path.as_str() {
        "bouncer" => Leg::PgBouncer,
        "direct" => Leg::Direct,
        other => bail!("--path {other:?}: expected bouncer or direct"),
    };
    let every = humantime::parse_duration(&args.prune_every)
        .map_err(|e| anyhow::anyhow!("--prune-every {:?}: {e}", args.prune_every))?;
    let receiver = Receiver::answering(200).await;
    let mut machine = {
        let t = TestDb::new().await;
        let mut su = t.superuser().await;
        benches::machine(&mut su).await?
    };
    let (mut alone, mut pruning) = (Vec::new(), Vec::new());
    for run in 1..=args.runs {
        progress(&format!("run {run}/{}: throughput alone", args.runs));
        let r = run_once(&args, leg, &receiver, None).await?;
        progress(&format!(
            "  {} deliveries in {:.2} s = {:.0}/s",
            r.deliveries,
            r.wall.as_secs_f64(),
            r.rate()
        ));
        alone.push(r);
        progress(&format!(
            "run {run}/{}: throughput while {} old deliveries are pruned",
            args.runs, args.old
        ));
        let r = run_once(&args, leg, &receiver, Some(every)).await?;
        progress(&format!(
            "  {} deliveries in {:.2} s = {:.0}/s, {} old deliveries pruned meanwhile",
            r.deliveries,
            r.wall.as_secs_f64(),
            r.rate(),
            r.pruned
        ));
        pruning.push(r);
    }
    benches::machine_at_end(&mut machine);
    let median = |runs: &[Run]| {
        let mut rates: Vec<f64> = runs.iter().map(Run::rate).collect();
        rates.sort_by(f64::total_cmp);
        rates[rates.len() / 2]
    };
    let (a, p) = (median(&alone), median(&pruning));
    let report = json!({
        "machine": Value::Object(machine),
        "settings": {
            "old": args.old, "events": args.events, "endpoints": args.endpoints,
            "runs": args.runs, "prune_every": args.prune_every, "path": args.path,
            "prune_batch": scheduler::PRUNE_BATCH, "date": benches::now_utc(),
            "build": benches::build_profile(),
        },
        "alone_deliveries_per_s": alone.iter().map(Run::rate).collect::<Vec<_>>(),
        "during_prune_deliveries_per_s": pruning.iter().map(Run::rate).collect::<Vec<_>>(),
        "pruned_during_run": pruning.iter().map(|r| r.pruned).collect::<Vec<_>>(),
        "median_alone": a,
        "median_during_prune": p,
        "during_prune_over_alone": p / a,
    });
    let dir = benches::report_dir(args.out_dir.clone())?;
    std::fs::write(
        dir.join("retention.json"),
        serde_json::to_string_pretty(&report)? + "\n",
    )?;
    let generated = format!(
        "| measure | deliveries/s (median of {}) |\n|---|---|\n| throughput alone | {a:.0} |\n\
         | throughput while the prune runs | {p:.0} ({:.0} % of alone; {} old deliveries pruned in the median run's span) |\n\n{}",
        args.runs,
        100.0 * p / a,
        pruning.iter().map(|r| r.pruned).max().unwrap_or(0),
        benches::machine_and_settings(&report)
    );
    benches::write_generated(&dir, "retention.md", &generated)?;
    println!(
        "alone {a:.0}/s, during prune {p:.0}/s ({:.0} %)",
        100.0 * p / a
    );
    Ok(())
}

/// One run on a fresh database: `--endpoints` endpoints, then (when
/// `prune_every` is given) `--old` delivered deliveries 40 days old, then both
/// roles started and `--events` events enqueued; the clock runs from the start
/// of the roles to the last delivery.
async fn run_once(
    args: &Args,
    leg: Leg,
    receiver: &Receiver,
    prune_every: Option<Duration>,
) -> Result<Run> {
    let t = TestDb::new().await;
    let keyring = Keyring::parse(testbed::SECRETS_KEY)?;
    let mut first = None;
    for i in 0..args.endpoints {
        let url = format!("{}/retention/ep{i}", receiver.base_url());
        let ep = create_endpoint(&t.api(), &keyring, TENANT, &url, &[] as &[&str]).await?;
        first.get_or_insert(ep.id);
    }
    let mut su = t.superuser().await;
    if prune_every.is_some() {
        progress(&format!("  seeding {} old delivered deliveries", args.old));
        // One old event per old delivery, dispatched and delivered 40 days ago.
        let seed = format!(
            "INSERT INTO webhook_events (tenant_id, event_type, payload, created_at, dispatched_at) \
             SELECT '{TENANT}', 'invoice.paid', '{{}}', now() - interval '41 days', now() - interval '41 days' \
             FROM generate_series(1, {n}); \
             INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id, attempts, status, \
                                             next_attempt_at, last_attempt_at, delivered_at, created_at) \
             SELECT '{TENANT}', id, {ep}, 1, 'delivered', now() - interval '40 days', \
                    now() - interval '40 days', now() - interval '40 days', now() - interval '41 days' \
             FROM webhook_events",
            n = args.old,
            ep = first.unwrap_or(1),
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(seed))
            .execute(&mut su)
            .await?;
        // Its own statements: VACUUM refuses a transaction block.
        for table in ["webhook_events", "webhook_deliveries"] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("VACUUM ANALYZE {table}")))
                .execute(&mut su)
                .await?;
        }
    }
    let db = Db::connect_lazy(&t.app_url(leg), 10)?;
    let telemetry = Telemetry::noop();
    let manager = Manager::with_holder_id(
        db.clone(),
        Timing::ADR,
        telemetry.clone(),
        "bench-retention".into(),
    );
    let retention = prune_every.map(|every| Retention {
        every,
        ..Retention::default()
    });
    // As `hardcount serve`: the fan-out hands its deliveries over (docs/adr/0070).
    let delivery = Wake::new(
        Role::WebhookDelivery,
        scheduler::default_interval(Role::WebhookDelivery),
    );
    let mut dispatcher =
        Dispatcher::new(db.clone(), DispatcherConfig::default(), telemetry.clone())?
            .with_idle_probe(IDLE_PROBE)
            .with_hand_over(delivery.clone());
    if let Some(r) = retention {
        dispatcher = dispatcher.with_retention(r);
    }
    let worker = Worker::new(
        db.clone(),
        WorkerConfig {
            allowlist: webhook_delivery::ssrf::Allowlist::parse("127.0.0.0/8")?,
            secrets: Some(keyring),
            retention,
            ..WorkerConfig::default()
        },
        telemetry,
    )?
    .with_idle_probe(IDLE_PROBE)
    .with_wake(delivery);
    let shutdown = CancellationToken::new();
    let specs = [
        RoleSpec {
            role: Role::WebhookOutbox,
            interval: scheduler::default_interval(Role::WebhookOutbox),
            work: work(move |tick| {
                let d = dispatcher.clone();
                async move { d.run_tick(&tick).await.end }
            }),
        },
        RoleSpec {
            role: Role::WebhookDelivery,
            interval: scheduler::default_interval(Role::WebhookDelivery),
            work: work(move |tick| {
                let w = worker.clone();
                async move { w.run_tick(&tick).await.end }
            }),
        },
    ];
    let _ = receiver.take();
    // The prune running the whole time: the delivery role's own statement
    // (`PRUNE_FINISHED`), batch after batch on a pool of its own, under the
    // fence of whoever leads webhook_delivery now, as the role's prune step
    // would run it if it never paused.
    let pruner = prune_every.map(|_| {
        let (url, stop) = (t.app_url(leg), shutdown.clone());
        let owner_url = t.superuser_url();
        tokio::spawn(async move { prune_continuously(&url, &owner_url, stop).await })
    });
    let started = Instant::now();
    let handles: Vec<_> = specs
        .into_iter()
        .map(|spec| tokio::spawn(run_role(manager.clone(), spec, shutdown.clone())))
        .collect();
    let payloads: Vec<String> = (0..args.events)
        .map(|i| format!(r#"{{"n":{i}}}"#))
        .collect();
    for chunk in payloads.chunks(500) {
        let batch: Vec<NewEvent<'_>> = chunk
            .iter()
            .map(|p| (TENANT, "invoice.paid", p.as_str()))
            .collect();
        let mut tx = db.begin().await?;
        enqueue_many(&mut tx, &batch).await?;
        tx.commit().await?;
    }
    let wall = loop {
        let busy: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM webhook_events WHERE dispatched_at IS NULL) \
                 OR EXISTS (SELECT 1 FROM webhook_deliveries WHERE status = 'pending') \
                 OR EXISTS (SELECT 1 FROM webhook_handoffs)",
        )
        .fetch_one(&mut su)
        .await?;
        if !busy {
            break started.elapsed();
        }
        if started.elapsed() > GIVE_UP {
            bail!("not all delivered after {GIVE_UP:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    shutdown.cancel();
    for h in handles {
        h.await?;
    }
    if let Some(p) = pruner {
        p.await??;
    }
    let old_left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM webhook_deliveries WHERE next_attempt_at < now() - interval '30 days'",
    )
    .fetch_one(&mut su)
    .await?;
    let pruned = if prune_every.is_some() {
        args.old as i64 - old_left
    } else {
        0
    };
    Ok(Run {
        deliveries: args.events * args.endpoints,
        wall,
        pruned,
    })
}

/// Run the delivery prune statement until `stop`, a batch of
/// `scheduler::PRUNE_BATCH` at a time, with the token of the current
/// webhook_delivery leader (a batch while no one leads deletes nothing).
async fn prune_continuously(app_url: &str, owner_url: &str, stop: CancellationToken) -> Result<()> {
    let db = Db::connect_lazy(app_url, 1)?;
    let mut owner = <sqlx::PgConnection as sqlx::Connection>::connect(owner_url).await?;
    while !stop.is_cancelled() {
        let token: Option<i64> = sqlx::query_scalar(
            "SELECT holder_token FROM leader_leases WHERE role = 'webhook_delivery' AND holder_id IS NOT NULL",
        )
        .fetch_optional(&mut owner)
        .await?;
        let Some(token) = token else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let mut tx = db.begin_index_driven(Duration::from_secs(5)).await?;
        let n = tx
            .execute(
                db::sql(webhook_delivery::statements::PRUNE_FINISHED)
                    .bind("webhook_delivery")
                    .bind(token)
                    .bind(Retention::default().keep.as_secs_f64())
                    .bind(scheduler::PRUNE_BATCH as i64),
            )
            .await?;
        tx.commit().await?;
        if n == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

fn progress(msg: &str) {
    eprintln!(
        "[retention bench {}] {msg}",
        chrono::Utc::now().format("%H:%M:%S")
    );
}
