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

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use db::Db;
use serde_json::{Value, json};
use testbed::{Leg, TestDb};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

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

/// What one wrk run measured.
#[derive(Debug, Clone)]
struct Run {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: u64,
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

fn publish_lua(key: &str, idempotent: bool) -> String {
    let idem = if idempotent {
        r#"
local counter = 0
local thread_id = 0
function setup(thread)
  thread_id = thread_id + 1
  thread:set("tid", thread_id)
end
function request()
  counter = counter + 1
  wrk.headers["Idempotency-Key"] = "bench-" .. tid .. "-" .. counter .. "-" .. os.time()
  return wrk.format()
end
"#
    } else {
        ""
    };
    format!(
        "wrk.method = \"POST\"\nwrk.body = '{PUBLISH_BODY}'\nwrk.headers[\"Content-Type\"] = \"application/json\"\nwrk.headers[\"Authorization\"] = \"Bearer {key}\"\n{idem}"
    )
}

fn get_lua(key: &str) -> String {
    format!("wrk.method = \"GET\"\nwrk.headers[\"Authorization\"] = \"Bearer {key}\"\n")
}

fn tempdir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("hardcount-api-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn script(dir: &std::path::Path, name: &str, text: &str) -> Result<PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, text)?;
    Ok(path)
}

fn which(cmd: &str) -> Result<()> {
    let ok = std::process::Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .stdout(Stdio::null())
        .status()?
        .success();
    if ok { Ok(()) } else { bail!("{cmd} not found") }
}

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

/// One wrk run: 2 threads, `connections`, `seconds`, latency distribution.
async fn wrk(script: &PathBuf, url: &str, connections: usize, seconds: u64) -> Result<Run> {
    let out = tokio::process::Command::new("wrk")
        .arg("-t2")
        .arg(format!("-c{connections}"))
        .arg(format!("-d{seconds}s"))
        .arg("--latency")
        .arg("-s")
        .arg(script)
        .arg(url)
        .output()
        .await?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(out.status.success(), "wrk failed: {text}");
    parse_wrk(&text).with_context(|| format!("cannot read wrk's output:\n{text}"))
}

fn parse_wrk(text: &str) -> Option<Run> {
    let mut rps = None;
    let (mut p50, mut p99) = (None, None);
    let mut errors = 0;
    for line in text.lines() {
        let l = line.trim();
        if let Some(v) = l.strip_prefix("Requests/sec:") {
            rps = v.trim().parse().ok();
        } else if let Some(v) = l.strip_prefix("50%") {
            p50 = ms(v.trim());
        } else if let Some(v) = l.strip_prefix("99%") {
            p99 = ms(v.trim());
        } else if let Some(v) = l.strip_prefix("Non-2xx or 3xx responses:") {
            errors += v.trim().parse::<u64>().unwrap_or(0);
        } else if let Some(v) = l.strip_prefix("Socket errors:") {
            errors += v
                .split(',')
                .filter_map(|p| p.split_whitespace().last()?.parse::<u64>().ok())
                .sum::<u64>();
        }
    }
    Some(Run {
        rps: rps?,
        p50_ms: p50?,
        p99_ms: p99?,
        errors,
    })
}

fn ms(v: &str) -> Option<f64> {
    let (num, factor) = if let Some(n) = v.strip_suffix("us") {
        (n, 0.001)
    } else if let Some(n) = v.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1000.0)
    } else {
        return None;
    };
    num.parse::<f64>().ok().map(|n| n * factor)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn summary(runs: &[Run]) -> Value {
    json!({
        "requests_per_s_median": median(runs.iter().map(|r| r.rps).collect()),
        "p50_ms_median": median(runs.iter().map(|r| r.p50_ms).collect()),
        "p99_ms_median": median(runs.iter().map(|r| r.p99_ms).collect()),
        "errors": runs.iter().map(|r| r.errors).sum::<u64>(),
        "runs": runs.iter().map(|r| json!({
            "requests_per_s": r.rps, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "errors": r.errors,
        })).collect::<Vec<_>>(),
    })
}

/// The webhook benchmark's throughput phase, as its own release binary
/// (built beside this one), its report in `dir`; the median deliveries/s.
const WEBHOOK_FLAGS: &[&str] = &[
    "--skip-latency",
    "--skip-comparison-runs",
    "--skip-fairness",
];

async fn webhooks_bench(dir: &std::path::Path) -> Result<f64> {
    std::fs::create_dir_all(dir)?;
    // The report's hand-written half is copied from docs/benchmarks.
    let exe = std::env::current_exe()?.with_file_name("webhooks");
    ensure!(
        exe.exists(),
        "{} is missing: cargo build --release -p benches --bin webhooks",
        exe.display()
    );
    let status = tokio::process::Command::new(&exe)
        .args(WEBHOOK_FLAGS)
        .arg("--out-dir")
        .arg(dir)
        .stdout(Stdio::null())
        .status()
        .await?;
    ensure!(status.success(), "the webhook benchmark failed");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("webhooks.json"))?)?;
    report
        .as_array()
        .and_then(|rows| {
            rows.iter().find(|r| {
                r["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("throughput at the shipped defaults"))
            })
        })
        .and_then(|r| r["value"].as_f64())
        .context("no throughput row in the webhook benchmark's report")
}

/// Publish at `rate` per second until `stop`; (published, failed).
async fn paced_publish(
    url: String,
    key: String,
    rate: u32,
    stop: CancellationToken,
) -> Result<(u64, u64)> {
    let client = reqwest::Client::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1) / rate.max(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let failed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let tasks = tokio_util::task::TaskTracker::new();
    let started = Instant::now();
    while !stop.is_cancelled() {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        let (client, url, key) = (client.clone(), url.clone(), key.clone());
        let (sent, failed) = (sent.clone(), failed.clone());
        tasks.spawn(async move {
            let ok = client
                .post(&url)
                .header("authorization", format!("Bearer {key}"))
                .header("content-type", "application/json")
                .body(PUBLISH_BODY)
                .send()
                .await
                .is_ok_and(|r| r.status().as_u16() == 201);
            let counter = if ok { &sent } else { &failed };
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        });
    }
    tasks.close();
    tasks.wait().await;
    let _ = started;
    Ok((
        sent.load(std::sync::atomic::Ordering::Relaxed),
        failed.load(std::sync::atomic::Ordering::Relaxed),
    ))
}

fn write_report(report: &Value, out_dir: Option<PathBuf>) -> Result<()> {
    let dir = benches::report_dir(out_dir)?;
    std::fs::write(
        dir.join("api.json"),
        serde_json::to_string_pretty(report)? + "\n",
    )?;
    let r = &report["results"];
    let row = |k: &str| -> String {
        let v = &r[k];
        if v.is_null() {
            return "| (not run) | | | |".to_owned();
        }
        format!(
            "| {:.0} | {:.2} | {:.2} | {} |",
            v["requests_per_s_median"].as_f64().unwrap_or(0.0),
            v["p50_ms_median"].as_f64().unwrap_or(0.0),
            v["p99_ms_median"].as_f64().unwrap_or(0.0),
            v["errors"]
        )
    };
    let mut md = String::new();
    md.push_str(
        "| Measure | Row-level security | Requests/s (median) | p50 ms | p99 ms | Errors |\n",
    );
    md.push_str("|---|---|---:|---:|---:|---:|\n");
    for (name, label) in [
        ("publish", "POST /v1/events"),
        (
            "publish_idempotent",
            "POST /v1/events with an Idempotency-Key",
        ),
        ("page_100", "GET /v1/events?limit=100"),
    ] {
        for (rls, on) in [("rls_on", "on"), ("rls_off", "off")] {
            let key = format!("{rls}.{name}");
            if r[&key].is_null() {
                continue;
            }
            md.push_str(&format!("| {label} | {on} {}\n", row(&key)));
        }
    }
    let w = &report["webhooks"];
    if !w.is_null() {
        md.push_str(&format!(
            "\nWebhook throughput benchmark (`webhooks {}`), interleaved rounds, medians: \
             {:.0} deliveries/s alone.\n\n\
             | API load | Deliveries/s | Ratio to alone | API process's share of the cores | 1 − that share | the load alone: API, Postgres and PgBouncer's share of the cores | 1 − that share |\n\
             |---|---:|---:|---:|---:|---:|---:|\n",
            w["webhook_bench_flags"].as_str().unwrap_or(""),
            w["deliveries_per_s_alone_median"].as_f64().unwrap_or(0.0),
        ));
        for b in w["beside"].as_array().into_iter().flatten() {
            md.push_str(&format!(
                "| {} events/s | {:.0} | {:.2} | {:.1} % | {:.2} | {:.1} % | {:.2} |\n",
                b["api_events_per_s"],
                b["deliveries_per_s_median"].as_f64().unwrap_or(0.0),
                b["ratio"].as_f64().unwrap_or(0.0),
                b["api_process_core_share_median"].as_f64().unwrap_or(0.0) * 100.0,
                b["ratio_expected_from_core_share"].as_f64().unwrap_or(0.0),
                b["load_alone"]["core_share"].as_f64().unwrap_or(0.0) * 100.0,
                b["ratio_expected_from_load_alone"].as_f64().unwrap_or(0.0),
            ));
        }
    }
    md.push('\n');
    md.push_str(&benches::machine_and_settings(report));
    benches::write_generated(&dir, "api.md", &md)
}

/// This process's CPU time so far (user + system), in seconds.
fn own_cpu_seconds() -> f64 {
    benches::process_cpu_seconds(std::process::id())
}

fn cores() -> f64 {
    std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64)
}
