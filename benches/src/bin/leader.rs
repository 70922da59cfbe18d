//! Leader-lease benchmark (issue 3, item 8).
//!
//! 1. ACQUIRE and RENEW latency (p50, p99) with the real `leader::store`
//!    statements, directly and through PgBouncer, in one run.
//! 2. Idle load: replicas x 5 roles polling with a 1-hour interval through
//!    PgBouncer; transactions per second on Postgres and `lead()` calls per second.
//!
//! Run on the test bed, which exports `HARDCOUNT_TEST_PG` and `HARDCOUNT_TEST_BOUNCER`:
//!
//! ```sh
//! scripts/bed run cargo run --release -p benches --bin leader
//! ```
//!
//! It rewrites the generated part of `docs/benchmarks/leader.md` (between its
//! marker comments; the methodology above them is written by hand, and changes
//! with this code) and all of `docs/benchmarks/leader.json`.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use clap::Parser;
use db::Db;
use leader::store::{self, Acquire, Release, Renew};
use leader::{Manager, Role, Telemetry, TickEnd, TickOutcome, Timing};
use serde_json::{Map, Value, json};
use sqlx::postgres::PgConnection;
use testbed::{Leg, TestDb};
use tokio_util::sync::CancellationToken;

const COMMAND: &str = "scripts/bed run cargo run --release -p benches --bin leader";
const P99_TARGET_MS: f64 = 5.0;
const IDLE_TARGET_PER_S: f64 = 20.0;
const IDLE_INTERVAL: Duration = Duration::from_secs(3600);

#[derive(Parser, Debug)]
#[command(about = "ACQUIRE/RENEW latency and idle statement load of the leader leases")]
struct Args {
    /// Timed ACQUIRE -> RENEW -> RELEASE cycles per path.
    #[arg(long, default_value_t = 2000)]
    iterations: usize,
    /// Untimed cycles per path first.
    #[arg(long, default_value_t = 200)]
    warmup: usize,
    /// Cycles on one path before switching to the other.
    #[arg(long, default_value_t = 100)]
    block: usize,
    /// Connections in each app pool (latency phase and each replica).
    #[arg(long, default_value_t = 2)]
    pool: u32,
    /// Replicas in the idle phase, each with its own Manager and pool.
    #[arg(long, default_value_t = 10)]
    replicas: usize,
    /// Seconds the idle phase runs before counting.
    #[arg(long, default_value_t = 10)]
    settle_secs: u64,
    /// Seconds the idle phase counts.
    #[arg(long, default_value_t = 60)]
    window_secs: u64,
    /// Where to write leader.md and leader.json (default: the workspace's docs/benchmarks).
    #[arg(long)]
    out_dir: Option<PathBuf>,
}

/// One reported number; `target` is an upper bound when the issue sets one.
struct Figure {
    name: String,
    value: f64,
    unit: &'static str,
    target: Option<f64>,
}

impl Figure {
    fn new(name: impl Into<String>, value: f64, unit: &'static str) -> Figure {
        let name = name.into();
        Figure {
            name,
            value,
            unit,
            target: None,
        }
    }

    fn at_most(self, target: f64) -> Figure {
        Figure {
            target: Some(target),
            ..self
        }
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(
        args.iterations > 0 && args.block > 0,
        "iterations and block must be positive"
    );
    let mut settings = settings(&args);
    let mut figures = Vec::new();

    progress("setup: creating a migrated database on the bed");
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    let mut machine = benches::machine(&mut su).await?;

    let direct = Db::connect_lazy(&t.app_url(Leg::Direct), args.pool)?;
    let bouncer = Db::connect_lazy(&t.app_url(Leg::PgBouncer), args.pool)?;
    progress(&format!(
        "phase 1/3: warm-up, {} cycles per path",
        args.warmup
    ));
    for _ in 0..args.warmup {
        cycle(&direct, None).await?;
        cycle(&bouncer, None).await?;
    }
    progress(&format!(
        "phase 1/3: latency, {} cycles per path, alternating every {}",
        args.iterations, args.block
    ));
    let (mut on_direct, mut on_bouncer) = (Samples::default(), Samples::default());
    let mut done = 0;
    while done < args.iterations {
        let n = args.block.min(args.iterations - done);
        // Alternate which path goes first so neither always follows the other.
        let order = if (done / args.block) % 2 == 0 {
            [(&direct, &mut on_direct), (&bouncer, &mut on_bouncer)]
        } else {
            [(&bouncer, &mut on_bouncer), (&direct, &mut on_direct)]
        };
        for (db, samples) in order {
            for _ in 0..n {
                cycle(db, Some(samples)).await?;
            }
        }
        done += n;
    }
    direct.close().await;
    bouncer.close().await;
    for (op, d, b) in [
        ("ACQUIRE", &mut on_direct.acquire, &mut on_bouncer.acquire),
        ("RENEW", &mut on_direct.renew, &mut on_bouncer.renew),
    ] {
        d.sort();
        b.sort();
        for p in [50.0, 99.0] {
            let (dv, bv) = (benches::percentile_ms(d, p), benches::percentile_ms(b, p));
            figures.push(Figure::new(format!("{op} p{p}, direct"), dv, "ms"));
            let through = Figure::new(format!("{op} p{p}, PgBouncer"), bv, "ms");
            figures.push(if p == 99.0 {
                through.at_most(P99_TARGET_MS)
            } else {
                through
            });
            figures.push(Figure::new(
                format!("{op} p{p}, PgBouncer / direct"),
                bv / dv,
                "ratio",
            ));
        }
    }
    drop(su);
    drop(t);

    progress(&format!(
        "phase 2/3: idle load, {} replicas x {} roles through PgBouncer, {} s settle",
        args.replicas,
        Role::ALL.len(),
        args.settle_secs
    ));
    let idle = idle_load(&args).await?;
    figures.push(
        Figure::new(
            "idle: transactions/s on Postgres",
            idle.transactions as f64 / idle.seconds,
            "transactions/s",
        )
        .at_most(IDLE_TARGET_PER_S),
    );
    if let Some(pooled) = idle.pooled {
        figures.push(Figure::new(
            "idle: PgBouncer total_xact_count/s (counts sqlx's pings too)",
            pooled as f64 / idle.seconds,
            "transactions/s",
        ));
    }
    figures.push(Figure::new(
        "idle: lead() calls/s",
        idle.calls as f64 / idle.seconds,
        "calls/s",
    ));
    figures.push(Figure::new(
        "idle: ticks won (whole phase)",
        idle.won as f64,
        "ticks",
    ));
    ensure!(
        idle.errors == 0,
        "{} lead() calls failed in the idle phase",
        idle.errors
    );
    settings.insert("idle_window_measured_s".into(), json!(idle.seconds));

    benches::machine_at_end(&mut machine);
    progress("phase 3/3: writing docs/benchmarks/leader.{md,json}");
    let dir = benches::report_dir(args.out_dir.clone())?;
    benches::write_generated(&dir, "leader.md", &markdown(&figures, &machine, &settings))?;
    let records: Vec<Value> = figures
        .iter()
        .map(|f| json!({"name": f.name, "value": f.value, "unit": f.unit, "machine": machine, "settings": settings}))
        .collect();
    std::fs::write(
        dir.join("leader.json"),
        serde_json::to_string_pretty(&records)? + "\n",
    )?;
    println!("{}", table(&figures));
    progress(&format!("wrote {}/leader.{{md,json}}", dir.display()));
    Ok(())
}

fn progress(msg: &str) {
    eprintln!(
        "[leader bench {}] {msg}",
        chrono::Utc::now().format("%H:%M:%S")
    );
}

#[derive(Default)]
struct Samples {
    acquire: Vec<Duration>,
    renew: Vec<Duration>,
}

/// ACQUIRE (interval 0, so it always wins) -> RENEW -> RELEASE completed, timing
/// the first two calls when `samples` is given. Anything but success is an error.
async fn cycle(db: &Db, samples: Option<&mut Samples>) -> Result<()> {
    const ROLE: Role = Role::Billing;
    let t = Timing::ADR;
    let started = Instant::now();
    let token = match store::acquire(
        db,
        ROLE,
        "bench",
        t.ttl,
        Duration::ZERO,
        t.statement_timeout,
    )
    .await?
    {
        Acquire::Won { token, .. } => token,
        lost => bail!("ACQUIRE did not win: {lost:?}"),
    };
    let acquire = started.elapsed();
    let started = Instant::now();
    let renewed = store::renew(db, ROLE, token, t.ttl, t.statement_timeout).await?;
    let renew = started.elapsed();
    ensure!(
        matches!(renewed, Renew::Extended { .. }),
        "RENEW lost the lease: {renewed:?}"
    );
    let released = store::release(
        db,
        ROLE,
        token,
        Release::Completed,
        Duration::ZERO,
        t.failure_cooldown,
        &store::SlotStamp::default(),
        t.statement_timeout,
    )
    .await?;
    ensure!(released.changed, "RELEASE changed no row");
    if let Some(s) = samples {
        s.acquire.push(acquire);
        s.renew.push(renew);
    }
    Ok(())
}

#[derive(Default)]
struct Counts {
    calls: AtomicU64,
    won: AtomicU64,
    errors: AtomicU64,
}

struct Idle {
    /// From `pg_stat_database`.
    transactions: i64,
    /// From PgBouncer's `SHOW STATS`, when its admin console answered.
    pooled: Option<i64>,
    calls: u64,
    won: u64,
    errors: u64,
    seconds: f64,
}

/// Replicas x roles polling through PgBouncer with a 1-hour interval on a fresh
/// database; counts the database's transactions and the loops' `lead()` calls
/// over the window that follows the settle.
async fn idle_load(args: &Args) -> Result<Idle> {
    let t = TestDb::new().await;
    let url = t.app_url(Leg::PgBouncer);
    let counts = Arc::new(Counts::default());
    let shutdown = CancellationToken::new();
    let mut loops = tokio::task::JoinSet::new();
    for r in 0..args.replicas {
        let db = Db::connect_lazy(&url, args.pool)?;
        let m = Manager::with_holder_id(
            db,
            Timing::ADR,
            Telemetry::noop(),
            format!("bench-replica-{r}"),
        );
        for role in Role::ALL {
            loops.spawn(role_loop(m.clone(), role, shutdown.clone(), counts.clone()));
        }
    }
    tokio::time::sleep(Duration::from_secs(args.settle_secs)).await;

    let mut su = t.superuser().await;
    let mut admin = benches::bouncer_admin().await;
    let (x0, p0, c0, t0) = (
        transactions(&mut su).await?,
        pooled_transactions(&mut admin, t.name()).await,
        counts.calls.load(Relaxed),
        Instant::now(),
    );
    progress(&format!(
        "phase 2/3: counting for {} s (transactions so far: {x0}, lead() calls so far: {c0})",
        args.window_secs
    ));
    tokio::time::sleep(Duration::from_secs(args.window_secs)).await;
    let (x1, p1, c1, seconds) = (
        transactions(&mut su).await?,
        pooled_transactions(&mut admin, t.name()).await,
        counts.calls.load(Relaxed),
        t0.elapsed().as_secs_f64(),
    );
    shutdown.cancel();
    while loops.join_next().await.is_some() {}
    Ok(Idle {
        transactions: x1 - x0,
        pooled: match (p0, p1) {
            (Ok(a), Ok(b)) => Some(b - a),
            (Err(e), _) | (_, Err(e)) => {
                progress(&format!(
                    "PgBouncer SHOW STATS unavailable, no cross-check: {e:#}"
                ));
                None
            }
        },
        calls: c1 - c0,
        won: counts.won.load(Relaxed),
        errors: counts.errors.load(Relaxed),
        seconds,
    })
}

/// The production loop's shape (scheduler's `run_role`): lead; after a poll
/// that did not win, sleep `retry_in` plus up to 5 % jitter; after a tick,
/// poll again at once; after an error, back off for the max poll.
async fn role_loop(m: Manager, role: Role, shutdown: CancellationToken, counts: Arc<Counts>) {
    while !shutdown.is_cancelled() {
        let outcome = m
            .lead(role, IDLE_INTERVAL, &shutdown, |_| async {
                TickEnd::Drained
            })
            .await;
        counts.calls.fetch_add(1, Relaxed);
        let pause = match outcome {
            Ok(TickOutcome::NotLed { retry_in, .. }) => {
                retry_in.mul_f64(1.0 + rand::random_range(0.0..0.05))
            }
            Ok(_) => {
                counts.won.fetch_add(1, Relaxed);
                Duration::ZERO
            }
            Err(e) => {
                counts.errors.fetch_add(1, Relaxed);
                eprintln!("{role}: lead failed: {e}");
                m.timing().max_poll
            }
        };
        shutdown
            .run_until_cancelled(tokio::time::sleep(pause))
            .await;
    }
}

/// Committed plus rolled-back transactions of this connection's database.
async fn transactions(su: &mut PgConnection) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT (xact_commit + xact_rollback)::int8 FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(su)
    .await?)
}

/// `total_xact_count` of `database` in PgBouncer's `SHOW STATS`: the transactions
/// it pooled, a cross-check on `pg_stat_database`, which backends update lazily.
async fn pooled_transactions(admin: &mut Result<PgConnection>, database: &str) -> Result<i64> {
    let admin = admin.as_mut().map_err(|e| anyhow::anyhow!("{e:#}"))?;
    let stats = benches::bouncer_stats(admin, database).await?;
    stats
        .get("total_xact_count")
        .copied()
        .ok_or_else(|| anyhow::anyhow!("SHOW STATS has no total_xact_count"))
}

fn settings(args: &Args) -> Map<String, Value> {
    let t = Timing::ADR;
    let mut m = Map::new();
    let mut set = |k: &str, v: Value| {
        m.insert(k.to_owned(), v);
    };
    set("build_profile", json!(benches::build_profile()));
    set("date", json!(benches::now_utc()));
    set("latency_iterations_per_path", json!(args.iterations));
    set("latency_warmup_cycles_per_path", json!(args.warmup));
    set("latency_block", json!(args.block));
    set("app_pool_max_connections", json!(args.pool));
    set("pgbouncer_pool_mode", json!("transaction"));
    set(
        "pgbouncer_default_pool_size",
        json!(benches::bed_bouncer_pool_size()),
    );
    set("idle_replicas", json!(args.replicas));
    set("idle_roles", json!(Role::ALL.len()));
    set("idle_interval_s", json!(IDLE_INTERVAL.as_secs()));
    set("idle_settle_s", json!(args.settle_secs));
    set("idle_window_s", json!(args.window_secs));
    set(
        "timing",
        json!(format!(
            "ttl {:?}, heartbeat {:?}, statement_timeout {:?}, max_poll {:?}",
            t.ttl, t.heartbeat, t.statement_timeout, t.max_poll
        )),
    );
    m
}

fn table(figures: &[Figure]) -> String {
    let mut out = String::from("| figure | value | target | met |\n|---|---:|---|---|\n");
    for f in figures {
        let value = match f.unit {
            "ms" => format!("{:.3} ms", f.value),
            "ratio" => format!("{:.2}x", f.value),
            "ticks" => format!("{}", f.value),
            unit => format!("{:.2} {unit}", f.value),
        };
        let (target, met) = match f.target {
            Some(t) if f.unit == "ms" => (format!("<= {t} ms"), f.value <= t),
            Some(t) => (format!("<= {t} statements/s"), f.value <= t),
            None => {
                out.push_str(&format!("| {} | {value} | | |\n", f.name));
                continue;
            }
        };
        let met = if met { "yes" } else { "**no**" };
        out.push_str(&format!("| {} | {value} | {target} | {met} |\n", f.name));
    }
    out
}

/// The generated part of `leader.md`: the figures, the machine, the settings.
/// What they mean is the hand-written part of that file, which this never writes.
fn markdown(
    figures: &[Figure],
    machine: &Map<String, Value>,
    settings: &Map<String, Value>,
) -> String {
    format!(
        "<!-- Written by benches/src/bin/leader.rs; refresh with `{COMMAND}`. -->\n\n\
         ## Results\n\n{}\n## Machine\n\n{}\n## Settings\n\n{}",
        table(figures),
        benches::markdown_list(machine),
        benches::markdown_list(settings),
    )
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::Args;

    /// A new flag changes what the benchmark does, so the hand-written
    /// methodology must say what it is for.
    #[test]
    fn the_methodology_names_every_flag() {
        let doc = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/benchmarks/leader.md");
        let text = std::fs::read_to_string(doc).unwrap();
        let end = text
            .find(benches::GENERATED_BEGIN)
            .expect("leader.md has a generated part");
        assert!(text.contains(benches::GENERATED_END));
        for arg in Args::command().get_arguments() {
            if let Some(long) = arg.get_long().filter(|l| *l != "help") {
                assert!(
                    text[..end].contains(&format!("`--{long}")),
                    "docs/benchmarks/leader.md does not mention --{long}"
                );
            }
        }
    }
}
