//! Tenant API benchmark (issue 24, point 7): events published per second
//! through the API and PgBouncer with their latency; a 100-item page read's
//! latency; both with row-level security on and off (the same statements,
//! the policies disabled as the schema owner between runs); and the webhook
//! throughput benchmark alone and while the API publishes.
//!
//! The API is served in this process as `hardcount serve` serves it
//! (`api::router` on `hardcount::http::serve_bounded`, the `hardcount_api`
//! pool through PgBouncer in transaction mode); the load comes from `wrk` in
//! another process (`apt-get install wrk`).
//!
//! ```sh
//! cargo build --release -p benches --bin webhooks
//! scripts/bed run cargo run --release -p benches --bin api
//! ```
//!
//! Writes `docs/benchmarks/api.md` (between its markers) and `api.json`.
//!
//! One concern per module: `wrk` (its Lua scripts, its runs, its output read),
//! `webhooks` (the webhook benchmark run beside a paced publishing load and
//! the CPU that load takes), `report` (medians, the generated markdown, the JSON).

mod report;
mod webhooks;
mod wrk;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Parser;
use db::Db;
use serde_json::{Value, json};
use testbed::{Leg, TestDb};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::report::{median, summary, write_report};
use crate::webhooks::{WEBHOOK_FLAGS, cores, own_cpu_seconds, paced_publish, webhooks_bench};
use crate::wrk::{get_lua, publish_lua, script, tempdir, which, wrk};

#[derive(Parser, Debug)]
struct Args {
    /// Seconds per wrk run.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Runs per measure; the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// wrk connections for the publish runs.
    #[arg(long, default_value_t = 32)]
    connections: usize,
    /// wrk connections for the page reads (latency, not rate).
    #[arg(long, default_value_t = 4)]
    read_connections: usize,
    /// The API pool's connections (PgBouncer multiplexes them).
    #[arg(long, default_value_t = 32)]
    pool: u32,
    /// Events published per second beside the webhook benchmark, one
    /// measure per rate (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [100, 500])]
    background_rates: Vec<u32>,
    /// Interleaved rounds of the webhook benchmark (alone, then beside each
    /// rate); medians are reported.
    #[arg(long, default_value_t = 3)]
    webhook_rounds: usize,
    /// Seconds of each background rate run alone, before the webhook rounds,
    /// to measure what the API load itself costs the machine.
    #[arg(long, default_value_t = 15)]
    load_alone_seconds: u64,
    /// Skip the webhook benchmark runs.
    #[arg(long)]
    skip_webhooks: bool,
    /// Time the page reads right after the publish runs, without waiting
    /// for autovacuum to finish with their rows.
    #[arg(long)]
    no_settle: bool,
    /// Where the report goes (default docs/benchmarks).
    #[arg(long)]
    out_dir: Option<PathBuf>,
}

fn progress(msg: &str) {
    eprintln!("[api bench] {msg}");
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(
        args.runs > 0 && args.seconds > 0,
        "runs and seconds must be positive"
    );
    which("wrk").context("wrk is not installed (apt-get install wrk)")?;
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    let mut machine = benches::machine(&mut su).await?;
    let op = t.operator();
    api::keys::create_tenant(&op, "bench", "Bench", None).await?;
    let key = api::keys::create_key(&op, "bench", "bench").await?.key;
    // Another tenant's rows beside, so the policy has something to keep out.
    api::keys::create_tenant(&op, "other", "Other", None).await?;
    let pool = Db::connect_lazy(&t.role_url("hardcount_api", Leg::PgBouncer), args.pool)?;
    let mut config = api::ApiConfig::default();
    // The rate limit is not what is measured.
    config.rate_per_second = std::num::NonZeroU32::new(1_000_000).unwrap();
    config.rate_burst = config.rate_per_second;
    let state = api::Api::new(pool.clone(), None, config);
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop = CancellationToken::new();
    let server = tokio::spawn(hardcount::http::serve_bounded(
        listener,
        api::router(state),
        stop.clone(),
    ));
    let base = format!("http://{addr}");
    let scripts = tempdir()?;

    // Seed a page's worth and more for both tenants (outside every clock).
    let app = Db::connect_lazy(&t.app_url(Leg::PgBouncer), 4)?;
    for tenant in ["bench", "other"] {
        let mut tx = app.begin().await?;
        let payloads: Vec<String> = (0..5_000).map(|n| format!("{{\"n\": {n}}}")).collect();
        let events: Vec<(&str, &str, &str)> = payloads
            .iter()
            .map(|p| (tenant, "seeded", p.as_str()))
            .collect();
        webhook_outbox::enqueue_many(&mut tx, &events).await?;
        tx.commit().await?;
    }
    // Nothing dispatches them: no role runs here.

    let publish = script(&scripts, "publish.lua", &publish_lua(&key, false))?;
    let publish_idem = script(&scripts, "publish_idem.lua", &publish_lua(&key, true))?;
    let page = script(&scripts, "page.lua", &get_lua(&key))?;
    let events_url = format!("{base}/v1/events");
    let page_url = format!("{base}/v1/events?limit=100");

    let mut results = serde_json::Map::new();
    let mut settled = Vec::new();
    for rls in [true, false] {
        set_rls(&mut su, rls).await?;
        let label = if rls { "rls_on" } else { "rls_off" };
        for (name, script, url, conns) in [
            ("publish", &publish, &events_url, args.connections),
            (
                "publish_idempotent",
                &publish_idem,
                &events_url,
                args.connections,
            ),
            ("page_100", &page, &page_url, args.read_connections),
        ] {
            if !rls && name == "publish_idempotent" {
                continue;
            }
            if name == "page_100" && !args.no_settle {
                let waited = settle(&mut su).await?;
                progress(&format!(
                    "{label}: the database settled after the publish runs in {waited:.1} s \
                     (no autovacuum worker for 3 s, then CHECKPOINT)"
                ));
                settled.push(waited);
            }
            let mut runs = Vec::new();
            for run in 1..=args.runs {
                progress(&format!("{label} {name}: run {run}/{}", args.runs));
                let r = wrk(script, url, conns, args.seconds).await?;
                progress(&format!(
                    "  {:.0} req/s, p50 {:.2} ms, p99 {:.2} ms, {} errors",
                    r.rps, r.p50_ms, r.p99_ms, r.errors
                ));
                runs.push(r);
            }
            results.insert(format!("{label}.{name}"), summary(&runs));
        }
    }
    set_rls(&mut su, true).await?;

    let mut webhooks = Value::Null;
    if !args.skip_webhooks {
        // Interleaved rounds: alone, then beside each rate, so drift on a
        // noisy machine falls on every measure alike.
        // First each rate alone: the CPU the API load takes with nothing else
        // running (this process, i.e. the API and its paced client, and the
        // Postgres and PgBouncer work it causes), the share of the cores a
        // CPU-bound neighbour must give up to it.
        // After the publish runs' rows are vacuumed: their autovacuum would
        // count as the load's CPU, and slow the first webhook rounds.
        let waited = settle(&mut su).await?;
        progress(&format!(
            "the database settled in {waited:.1} s before the load alone"
        ));
        let mut load_alone: BTreeMap<u32, Value> = BTreeMap::new();
        for &rate in &args.background_rates {
            let load_stop = CancellationToken::new();
            let before = benches::CpuSnapshot::take();
            let loader = tokio::spawn(paced_publish(
                events_url.clone(),
                key.clone(),
                rate,
                load_stop.clone(),
            ));
            tokio::time::sleep(Duration::from_secs(args.load_alone_seconds)).await;
            load_stop.cancel();
            let (sent, failed) = loader.await??;
            let used = benches::CpuSnapshot::take().since(&before);
            let share = (used.this_process + used.postgres + used.pgbouncer) / used.capacity;
            progress(&format!(
                "{rate} events/s alone: {sent} published, {failed} failed; CPU s: API process {:.2}, \
                 Postgres {:.2}, PgBouncer {:.2}, of {:.2}: {:.1} % of the cores",
                used.this_process,
                used.postgres,
                used.pgbouncer,
                used.capacity,
                share * 100.0
            ));
            load_alone.insert(
                rate,
                json!({
                    "published": sent, "failed": failed,
                    "api_process_s": used.this_process, "postgres_s": used.postgres,
                    "pgbouncer_s": used.pgbouncer, "capacity_s": used.capacity,
                    "others_s": used.others, "core_share": share,
                }),
            );
        }
        let mut alone = Vec::new();
        let mut beside: BTreeMap<u32, Vec<(f64, f64, u64, u64)>> = BTreeMap::new();
        for round in 1..=args.webhook_rounds {
            let a = webhooks_bench(&scripts.join("alone")).await?;
            progress(&format!(
                "round {round}: webhooks alone: {a:.0} deliveries/s"
            ));
            alone.push(a);
            for &rate in &args.background_rates {
                let load_stop = CancellationToken::new();
                let cpu_before = own_cpu_seconds();
                let wall = Instant::now();
                let loader = tokio::spawn(paced_publish(
                    events_url.clone(),
                    key.clone(),
                    rate,
                    load_stop.clone(),
                ));
                let d = webhooks_bench(&scripts.join(format!("beside-{rate}"))).await?;
                load_stop.cancel();
                let (sent, failed) = loader.await??;
                // This process is the API server and its paced client: the
                // share of the machine's cores it took while the webhook
                // benchmark ran beside it.
                let share =
                    (own_cpu_seconds() - cpu_before) / (wall.elapsed().as_secs_f64() * cores());
                progress(&format!(
                    "round {round}: webhooks beside {rate} events/s: {d:.0} deliveries/s \
                     ({sent} published, {failed} failed; the API process took {:.1} % of the cores)",
                    share * 100.0
                ));
                beside
                    .entry(rate)
                    .or_default()
                    .push((d, share, sent, failed));
            }
        }
        let alone_median = median(alone.clone());
        let rows: Vec<Value> = beside
            .iter()
            .map(|(rate, runs)| {
                let d = median(runs.iter().map(|r| r.0).collect());
                let share = median(runs.iter().map(|r| r.1).collect());
                json!({
                    "api_events_per_s": rate,
                    "deliveries_per_s_median": d,
                    "ratio": d / alone_median,
                    "api_process_core_share_median": share,
                    "ratio_expected_from_core_share": 1.0 - share,
                    "load_alone": load_alone[rate],
                    "ratio_expected_from_load_alone": 1.0 - load_alone[rate]["core_share"].as_f64().unwrap_or(0.0),
                    "runs": runs.iter().map(|r| json!({
                        "deliveries_per_s": r.0, "api_process_core_share": r.1,
                        "published": r.2, "failed": r.3,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        webhooks = json!({
            "deliveries_per_s_alone_median": alone_median,
            "deliveries_per_s_alone_runs": alone,
            "beside": rows,
            "webhook_bench_flags": WEBHOOK_FLAGS.join(" "),
        });
    }

    stop.cancel();
    let _ = server.await;
    benches::machine_at_end(&mut machine);
    let report = json!({
        "machine": machine,
        "settings": {
            "date": benches::now_utc(),
            "build_profile": benches::build_profile(),
            "path": "hardcount_api pool through PgBouncer (transaction mode)",
            "api_pool_max_connections": args.pool,
            "pgbouncer_default_pool_size": benches::bed_bouncer_pool_size(),
            "wrk_seconds_per_run": args.seconds,
            "runs": args.runs,
            "publish_connections": args.connections,
            "page_connections": args.read_connections,
            "seeded_events_per_tenant": 5_000,
            "tenants": 2,
            "publish_body": PUBLISH_BODY,
            "page_reads_after_settling": !args.no_settle,
            "settle_seconds": settled,
        },
        "results": results,
        "webhooks": webhooks,
    });
    write_report(&report, args.out_dir)?;
    Ok(())
}

const PUBLISH_BODY: &str =
    r#"{"type": "invoice.paid", "data": {"invoice": 1234, "amount": 1200, "currency": "EUR"}}"#;

/// Wait until no autovacuum worker has run for 3 s (at most 5 minutes),
/// then CHECKPOINT: the page reads measure a read, not a read beside the
/// vacuum of the ~170,000 rows the publish runs just wrote. Returns the
/// seconds waited.
async fn settle(su: &mut sqlx::PgConnection) -> Result<f64> {
    let started = Instant::now();
    let mut quiet = 0;
    while quiet < 3 && started.elapsed() < Duration::from_secs(300) {
        let workers: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'",
        )
        .fetch_one(&mut *su)
        .await?;
        quiet = if workers == 0 { quiet + 1 } else { 0 };
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    sqlx::raw_sql("CHECKPOINT").execute(&mut *su).await?;
    Ok(started.elapsed().as_secs_f64())
}

async fn set_rls(su: &mut sqlx::PgConnection, on: bool) -> Result<()> {
    let verb = if on { "ENABLE" } else { "DISABLE" };
    for table in ["webhook_events", "api_idempotency_keys"] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE {table} {verb} ROW LEVEL SECURITY"
        )))
        .execute(&mut *su)
        .await?;
    }
    Ok(())
}
