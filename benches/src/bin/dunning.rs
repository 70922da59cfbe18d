//! Dunning benchmark (issue 11, point 4): due runs retried in one tick of the
//! `dunning` role against the fake provider over HTTP, through PgBouncer;
//! runs per second.
//!
//! ```sh
//! scripts/bed run cargo run --release -p benches --bin dunning
//! ```
//!
//! Writes `docs/benchmarks/dunning.md` (the generated part) and `dunning.json`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use billing::{Biller, BillingConfig, ProviderConfig, SecretKey};
use clap::Parser;
use db::{Db, Row as _, sql};
use dunning::{Dunner, DunningConfig};
use fake_provider::{FakeProvider, TEST_SECRET_KEY};
use leader::{Manager, Role, Telemetry, Timing};
use serde_json::{Value, json};
use testbed::{Leg, TestDb};
use tokio_util::sync::CancellationToken;

#[derive(Parser, Debug)]
struct Args {
    /// Due runs, all retried in one tick.
    #[arg(long, default_value_t = 10_000)]
    runs: i64,
    /// Runs of a batch retried at once; default: the shipped default.
    #[arg(long)]
    concurrency: Option<usize>,
    /// App pool connections (to PgBouncer).
    #[arg(long, default_value_t = 20)]
    pool: u32,
    /// Where the report goes (default docs/benchmarks).
    #[arg(long)]
    out_dir: Option<std::path::PathBuf>,
}

fn progress(msg: &str) {
    eprintln!("[dunning bench] {msg}");
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(args.runs > 0, "--runs must be positive");
    let mut config = DunningConfig {
        tick_budget: Duration::from_secs(1800),
        ..DunningConfig::default()
    };
    if let Some(c) = args.concurrency {
        config.concurrency = c;
    }
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    let mut machine = benches::machine(&mut su).await?;
    progress(&format!("seeding {} due runs", args.runs));
    seed(&mut su, args.runs).await?;

    // The provider on a runtime of its own thread, so its work is not
    // scheduled among the role's futures.
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let provider_stop = CancellationToken::new();
    let stop = provider_stop.clone();
    let provider_thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().expect("provider runtime");
        rt.block_on(async move {
            let p = FakeProvider::start().await.expect("fake provider");
            addr_tx.send(p.base_url()).expect("send the address");
            stop.cancelled().await;
            p.total_charges()
        })
    });
    let base_url = addr_rx.recv().context("the fake provider did not start")?;

    let db = Db::connect_lazy(&t.app_url(Leg::PgBouncer), args.pool)?;
    let billing = BillingConfig {
        provider: Some(ProviderConfig {
            base_url,
            secret_key: SecretKey::new(TEST_SECRET_KEY),
            timeout: ProviderConfig::DEFAULT_TIMEOUT,
        }),
        ..BillingConfig::default()
    };
    let biller = Biller::new(db.clone(), billing, Telemetry::noop())?;
    let dunner = Dunner::new(db.clone(), config.clone(), biller, Telemetry::noop())?;
    let manager = Manager::new(db.clone(), Timing::ADR, Telemetry::noop());
    let shutdown = CancellationToken::new();
    progress("one tick");
    let started = Instant::now();
    let report = Arc::new(std::sync::Mutex::new(None));
    let slot = report.clone();
    manager
        .lead(
            Role::Dunning,
            Duration::ZERO,
            &shutdown,
            |tick| async move {
                let r = dunner.run_tick(&tick).await;
                let end = r.end.clone();
                *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
                end
            },
        )
        .await?;
    let elapsed = started.elapsed();
    let tick = report
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
        .context("the tick did not run")?;
    provider_stop.cancel();
    let charges = provider_thread
        .join()
        .map_err(|_| anyhow::anyhow!("provider thread panicked"))?;
    let recovered: i64 = db
        .fetch_one(sql(
            "SELECT count(*) AS n FROM dunning_runs WHERE status = 'recovered'",
        ))
        .await?
        .try_get("n")?;
    ensure!(
        recovered == args.runs && i64::from(charges) == args.runs,
        "expected {} recovered runs and charges, got {recovered} and {charges}: {tick:?}",
        args.runs
    );
    let rate = args.runs as f64 / elapsed.as_secs_f64();
    progress(&format!(
        "{} runs in {:.2} s: {rate:.0} runs/s",
        args.runs,
        elapsed.as_secs_f64()
    ));
    benches::machine_at_end(&mut machine);
    let report = json!({
        "machine": machine,
        "settings": {
            "runs": args.runs,
            "path": "app pool through PgBouncer (transaction mode)",
            "pool": args.pool,
            "batch_size": config.batch_size,
            "concurrency": config.concurrency,
            "provider": "fake_provider over HTTP on loopback, its own runtime thread",
            "outcome": "every retry succeeds (recover path: record, claim, attempt, call, settle, recover)",
            "release": cfg!(not(debug_assertions)),
        },
        "tick_seconds": elapsed.as_secs_f64(),
        "runs_per_s": rate,
        "batches": tick.batches,
    });
    write_report(&report, args.out_dir)
}

/// One tenant with a two-retry policy, `n` customers each with an open
/// automatic invoice whose first attempt was declined an hour ago, and a
/// run per invoice due a minute ago.
async fn seed(su: &mut sqlx::PgConnection, n: i64) -> Result<()> {
    let statements = [
        "INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action, is_default) \
         SELECT 'tenant_bench', 'Bench', '{60, 120}', 'pause_collection', true WHERE $1 > 0",
        "INSERT INTO plans (tenant_id, name, amount, currency, interval_unit, interval_count) \
         SELECT 'tenant_bench', 'Pro', 1200, 'EUR', 'month', 1 WHERE $1 > 0",
        "INSERT INTO customers (tenant_id, email, provider_customer_id, payment_method_id) \
         SELECT 'tenant_bench', 'c' || g || '@example.org', 'cus_bench_' || g, 'pm_card_visa' \
         FROM generate_series(1, $1) g",
        "INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor, \
                                    current_period_start, current_period_end, next_billing_at) \
         SELECT 'tenant_bench', c.id, p.id, 'active', now(), now(), now() + interval '30 days', \
                now() + interval '30 days' FROM customers c, plans p WHERE $1 > 0",
        "INSERT INTO invoices (tenant_id, subscription_id, period_start, period_end, amount, currency, \
                               collection_method) \
         SELECT 'tenant_bench', id, now() - interval '30 days', now(), 1200, 'EUR', 'automatic' \
         FROM subscriptions WHERE $1 > 0",
        "INSERT INTO payment_attempts (tenant_id, invoice_id, attempt_seq, idempotency_key, amount, \
                                       currency, provider_status, decline_code, resolved_at) \
         SELECT 'tenant_bench', id, 1, 'hardcount-invoice-' || id || '-attempt-1', 1200, 'EUR', \
                'declined', 'insufficient_funds', now() - interval '1 hour' FROM invoices WHERE $1 > 0",
        "INSERT INTO dunning_runs (tenant_id, invoice_id, policy_id, first_declined_at, next_attempt_at) \
         SELECT 'tenant_bench', i.id, p.id, now() - interval '1 hour', now() - interval '1 minute' \
         FROM invoices i, dunning_policies p WHERE $1 > 0",
    ];
    for s in statements {
        sqlx::query(s).bind(n).execute(&mut *su).await?;
    }
    sqlx::query("ANALYZE").execute(&mut *su).await?;
    Ok(())
}

fn write_report(report: &Value, out_dir: Option<std::path::PathBuf>) -> Result<()> {
    let dir = benches::report_dir(out_dir)?;
    std::fs::write(
        dir.join("dunning.json"),
        serde_json::to_string_pretty(report)? + "\n",
    )
    .context("write dunning.json")?;
    let m = &report["machine"];
    let generated = format!(
        "| due runs | tick, s | runs/s |\n|---|---|---|\n| {} | {:.2} | {:.0} |\n\n\
         Machine: {} cores, {}, {}; Postgres {}, {}. Load at start {}, at end {}.\nSettings: {}.\n",
        report["settings"]["runs"],
        report["tick_seconds"].as_f64().unwrap_or(0.0),
        report["runs_per_s"].as_f64().unwrap_or(0.0),
        m["nproc"],
        m["cpu_model"].as_str().unwrap_or("?"),
        m["memory"].as_str().unwrap_or("?"),
        m["postgres"].as_str().unwrap_or("?"),
        m["pgbouncer"].as_str().unwrap_or("?"),
        m["loadavg_at_start"].as_str().unwrap_or("?"),
        m["loadavg_at_end"].as_str().unwrap_or("?"),
        report["settings"],
    );
    benches::write_generated(&dir, "dunning.md", &generated)
}
