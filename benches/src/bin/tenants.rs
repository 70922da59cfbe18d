//! Fair claims benchmark (issue 25, point 4; docs/adr/0048): a small tenant's
//! webhook latency while another tenant's backlog of `--backlog` (1,000,000)
//! undispatched events drains through the same two roles. How it measures is
//! written by hand in `docs/benchmarks/tenants.md`; this binary rewrites that
//! file's generated part and `tenants.json`.
//!
//! ```sh
//! scripts/bed run cargo run --release -p benches --bin tenants
//! ```

use std::time::{Duration, Instant, SystemTime};

use anyhow::{Result, bail};
use clap::Parser;
use db::Db;
use leader::{Manager, Role, Telemetry, Timing};
use scheduler::{IDLE_PROBE, RoleSpec, Wake, run_role, work};
use serde_json::{Value, json};
use testbed::receiver::Receiver;
use testbed::{Leg, TestDb};
use tokio_util::sync::CancellationToken;
use webhook_delivery::{Keyring, Worker, WorkerConfig, create_endpoint};
use webhook_outbox::{Dispatcher, DispatcherConfig};

const BIG: &str = "tenant_big";
const SMALL: &str = "tenant_small";

#[derive(Parser, Debug)]
struct Args {
    /// Undispatched events of the big tenant queued before the roles start.
    #[arg(long, default_value_t = 1_000_000)]
    backlog: usize,
    /// Events the small tenant publishes, one every `--every-ms`.
    #[arg(long, default_value_t = 300)]
    small: usize,
    /// Milliseconds between the small tenant's events.
    #[arg(long, default_value_t = 100)]
    every_ms: u64,
    /// Endpoints of the big tenant (each gets every event), as the other
    /// webhook benchmarks have; the small tenant has one.
    #[arg(long, default_value_t = 5)]
    big_endpoints: usize,
    /// `bouncer` (the default, PgBouncer in transaction mode) or `direct`.
    #[arg(long, default_value = "bouncer")]
    path: String,
    /// Where to write tenants.{md,json} [default: docs/benchmarks].
    #[arg(long)]
    out_dir: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let leg = match args.path.as_str() {
        "bouncer" => Leg::PgBouncer,
        "direct" => Leg::Direct,
        other => bail!("--path {other:?}: expected bouncer or direct"),
    };
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    let mut machine = benches::machine(&mut su).await?;
    let (big_rx, small_rx) = (
        Receiver::answering(200).await,
        Receiver::answering(200).await,
    );
    let keyring = Keyring::parse(testbed::SECRETS_KEY)?;
    for i in 0..args.big_endpoints {
        let url = big_rx.url_at(&format!("/big/ep{i}"));
        create_endpoint(&t.api(), &keyring, BIG, &url, &[] as &[&str]).await?;
    }
    create_endpoint(&t.api(), &keyring, SMALL, &small_rx.url(), &[] as &[&str]).await?;
    progress(&format!("queueing {} events of {BIG}", args.backlog));
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO webhook_events (tenant_id, event_type, payload) \
         SELECT '{BIG}', 'invoice.paid', jsonb_build_object('n', g) FROM generate_series(1, {n}) g",
        n = args.backlog
    )))
    .execute(&mut su)
    .await?;
    sqlx::raw_sql("VACUUM ANALYZE webhook_events")
        .execute(&mut su)
        .await?;

    let db = Db::connect_lazy(&t.app_url(leg), 10)?;
    let telemetry = Telemetry::noop();
    let manager = Manager::with_holder_id(
        db.clone(),
        Timing::ADR,
        telemetry.clone(),
        "bench-tenants".into(),
    );
    // As `hardcount serve`: the fan-out hands its deliveries over (docs/adr/0070).
    let delivery = Wake::new(
        Role::WebhookDelivery,
        scheduler::default_interval(Role::WebhookDelivery),
    );
    let dispatcher = Dispatcher::new(db.clone(), DispatcherConfig::default(), telemetry.clone())?
        .with_idle_probe(IDLE_PROBE)
        .with_hand_over(delivery.clone());
    let worker = Worker::new(
        db.clone(),
        WorkerConfig {
            allowlist: webhook_delivery::ssrf::Allowlist::parse("127.0.0.0/8")?,
            secrets: Some(keyring),
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
    let started = Instant::now();
    let handles: Vec<_> = specs
        .into_iter()
        .map(|spec| tokio::spawn(run_role(manager.clone(), spec, shutdown.clone())))
        .collect();

    // The small tenant publishes at a steady pace; each event's commit time
    // is kept by its number, which its payload carries to the receiver.
    let mut committed = Vec::with_capacity(args.small);
    let mut pace = tokio::time::interval(Duration::from_millis(args.every_ms));
    let mut big_seen = 0usize;
    for i in 0..args.small {
        pace.tick().await;
        let mut tx = db.begin().await?;
        webhook_outbox::enqueue(&mut tx, SMALL, "invoice.paid", &format!(r#"{{"n":{i}}}"#)).await?;
        tx.commit().await?;
        committed.push(Instant::now());
        big_seen += big_rx.take().len();
        if i % 50 == 49 {
            progress(&format!(
                "  {} small events published, {} small and {big_seen} big deliveries received",
                i + 1,
                small_rx.count()
            ));
        }
    }
    let publishing = started.elapsed();
    small_rx
        .until_count(args.small, Duration::from_secs(120))
        .await;
    big_seen += big_rx.take().len();
    let window = started.elapsed();
    shutdown.cancel();
    for h in handles {
        h.await?;
    }
    // Where a small event's time went: commit to fan-out (the outbox
    // claim), fan-out to its delivery's claim (the delivery claim), medians.
    let (to_fan_out, to_claim): (f64, f64) = sqlx::query_as(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM e.dispatched_at - e.created_at)) * 1e3, \
                percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM d.last_attempt_at - e.dispatched_at)) * 1e3 \
         FROM webhook_events e JOIN webhook_deliveries d ON d.event_id = e.id \
         WHERE e.tenant_id = 'tenant_small'",
    )
    .fetch_one(&mut su)
    .await?;
    let backlog_left: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM webhook_events WHERE dispatched_at IS NULL) \
              + (SELECT count(*) FROM webhook_deliveries WHERE status = 'pending') \
              + (SELECT coalesce(sum(cardinality(event_ids)), 0) FROM webhook_handoffs)",
    )
    .fetch_one(&mut su)
    .await?;

    let mut latencies = Vec::with_capacity(args.small);
    for r in small_rx.requests() {
        let body: Value = serde_json::from_slice(&r.body)?;
        let n = body["data"]["n"]
            .as_u64()
            .or_else(|| body["n"].as_u64())
            .ok_or_else(|| anyhow::anyhow!("a small delivery without its number: {body}"))?;
        if let Some(at) = committed.get(n as usize) {
            latencies.push(r.at.saturating_duration_since(*at));
        }
    }
    latencies.sort();
    if latencies.len() < args.small {
        bail!(
            "{} of {} small events were delivered",
            latencies.len(),
            args.small
        );
    }
    benches::machine_at_end(&mut machine);
    let big_rate = big_seen as f64 / window.as_secs_f64();
    // In id order a small event waits for every delivery queued before it:
    // the backlog's events times the big tenant's endpoints.
    let ahead = (args.backlog * args.big_endpoints) as f64;
    let fifo_wait = ahead / big_rate.max(1.0);
    let p = |q: f64| benches::percentile_ms(&latencies, q);
    let report = json!({
        "machine": Value::Object(machine),
        "settings": {
            "backlog": args.backlog, "big_endpoints": args.big_endpoints,
            "small": args.small, "every_ms": args.every_ms,
            "path": args.path, "tenants_per_claim": db::TENANTS_PER_CLAIM,
            "date": benches::now_utc(), "build": benches::build_profile(),
            "unix_time": SystemTime::now().duration_since(SystemTime::UNIX_EPOCH)?.as_secs(),
        },
        "small_latency_ms": {"p50": p(50.0), "p95": p(95.0), "p99": p(99.0), "max": p(100.0)},
        "small_events": latencies.len(),
        "small_median_ms_commit_to_fan_out": to_fan_out,
        "small_median_ms_fan_out_to_claim": to_claim,
        "publishing_s": publishing.as_secs_f64(),
        "big_deliveries_in_window": big_seen,
        "big_deliveries_per_s": big_rate,
        "big_backlog_left_at_end": backlog_left,
        "fifo_wait_estimate_s": fifo_wait,
    });
    let dir = benches::report_dir(args.out_dir.clone())?;
    std::fs::write(
        dir.join("tenants.json"),
        serde_json::to_string_pretty(&report)? + "\n",
    )?;
    let generated = format!(
        "| measure | value |\n|---|---|\n\
         | small tenant, commit to POST, p50 / p95 / p99 / max | {:.1} / {:.1} / {:.1} / {:.1} ms ({} events) |\n\
         | small tenant, median commit to fan-out / fan-out to its delivery's claim | {to_fan_out:.1} / {to_claim:.1} ms |\n\
         | big tenant's deliveries meanwhile | {big_seen} in {:.1} s = {big_rate:.0}/s |\n\
         | big tenant's rows still queued at the end | {backlog_left} |\n\
         | wait behind the backlog in id order, estimated | {fifo_wait:.0} s ({ahead:.0} deliveries ahead at {big_rate:.0}/s) |\n\n{}",
        p(50.0),
        p(95.0),
        p(99.0),
        p(100.0),
        latencies.len(),
        window.as_secs_f64(),
        benches::machine_and_settings(&report)
    );
    benches::write_generated(&dir, "tenants.md", &generated)?;
    println!(
        "small p99 {:.1} ms, big {big_rate:.0} deliveries/s, {backlog_left} left",
        p(99.0)
    );
    Ok(())
}

fn progress(msg: &str) {
    eprintln!(
        "[tenants bench {}] {msg}",
        chrono::Utc::now().format("%H:%M:%S")
    );
}
