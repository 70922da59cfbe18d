//! Dunning benchmark (issue 11, point 4; issue 22, point 13): due runs
//! retried in one tick of the `dunning` role against the fake provider over
//! HTTP, through PgBouncer; runs per second. The runs take each path of a
//! charged retry: recovered (paid), declined and counted (the next retry
//! scheduled a day later), and declined at the last retry (exhausted, the
//! final action pausing collection, the final notice sent).
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
use fake_provider::{Behaviour, FakeProvider, TEST_SECRET_KEY};
use leader::{Manager, Role, Telemetry, Timing};
use serde_json::{Value, json};
use testbed::{Leg, TestDb};
use tokio_util::sync::CancellationToken;

#[derive(Parser, Debug)]
struct Args {
    /// Due runs, all retried in one tick.
    #[arg(long, default_value_t = 10_000)]
    runs: i64,
    /// Percent of the runs whose retry is declined and counted, the next
    /// retry scheduled.
    #[arg(long, default_value_t = 20)]
    declined_percent: i64,
    /// Percent of the runs whose last retry is declined: exhausted, then
    /// the final action (pause collection) and the final notice.
    #[arg(long, default_value_t = 20)]
    exhausted_percent: i64,
    /// Runs of a batch retried at once; default: the shipped default.
    #[arg(long)]
    concurrency: Option<usize>,
    /// App pool connections (to PgBouncer).
    #[arg(long, default_value_t = 20)]
    pool: u32,
    /// Where the report goes (default docs/benchmarks).
    #[arg(long)]
    out_dir: Option<std::path::PathBuf>,
    /// Leave every table unanalyzed (autovacuum off on each, no ANALYZE after
    /// the seed), as a first import or a restore leaves them; the run fails if
    /// any table was analyzed by its end (benches/never-analyzed.sh).
    #[arg(long)]
    never_analyzed: bool,
}

fn progress(msg: &str) {
    eprintln!("[dunning bench] {msg}");
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(args.runs > 0, "--runs must be positive");
    ensure!(
        args.declined_percent >= 0
            && args.exhausted_percent >= 0
            && args.declined_percent + args.exhausted_percent <= 100,
        "--declined-percent and --exhausted-percent must be shares of 100"
    );
    let mix = Mix::of(args.runs, args.declined_percent, args.exhausted_percent);
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
    progress(&format!(
        "seeding {} due runs ({} to recover, {} to decline, {} to exhaust)",
        args.runs, mix.recover, mix.declined, mix.exhausted
    ));
    if args.never_analyzed {
        testbed::plans::keep_tables_unanalyzed(&mut su).await?;
    }
    seed(&mut su, &mix, !args.never_analyzed).await?;

    // The provider on a runtime of its own thread, so its work is not
    // scheduled among the role's futures.
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let provider_stop = CancellationToken::new();
    let stop = provider_stop.clone();
    let declining = mix.declining_customers();
    let provider_thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().expect("provider runtime");
        rt.block_on(async move {
            let p = FakeProvider::start().await.expect("fake provider");
            for customer in declining {
                p.set_behaviour(&customer, Behaviour::Decline("insufficient_funds".into()));
            }
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
    let dunner = Dunner::new(
        db.clone(),
        config.clone(),
        std::sync::Arc::new(biller),
        Telemetry::noop(),
    )?;
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
    let outcomes = db
        .fetch_one(sql(
            "SELECT count(*) FILTER (WHERE status = 'recovered') AS recovered, \
                    count(*) FILTER (WHERE status = 'active' AND attempt_count = 1 \
                                     AND next_attempt_at > now()) AS declined, \
                    count(*) FILTER (WHERE status = 'exhausted' AND final_action_at IS NOT NULL) \
                      AS exhausted, \
                    (SELECT count(*) FROM subscriptions WHERE pause_collection_set_by = 'dunning') \
                      AS paused \
             FROM dunning_runs",
        ))
        .await?;
    let got = |c: &str| -> Result<i64> { Ok(outcomes.try_get(c)?) };
    let (recovered, declined, exhausted, paused) = (
        got("recovered")?,
        got("declined")?,
        got("exhausted")?,
        got("paused")?,
    );
    ensure!(
        recovered == mix.recover
            && i64::from(charges) == mix.recover
            && declined == mix.declined
            && exhausted == mix.exhausted
            && paused == mix.exhausted,
        "expected {mix:?} (recovered and charged, declined, exhausted and paused), got \
         {recovered} recovered, {charges} charges, {declined} declined, {exhausted} exhausted, \
         {paused} paused: {tick:?}"
    );
    let rate = args.runs as f64 / elapsed.as_secs_f64();
    progress(&format!(
        "{} runs in {:.2} s: {rate:.0} runs/s",
        args.runs,
        elapsed.as_secs_f64()
    ));
    if args.never_analyzed {
        benches::ensure_never_analyzed(&mut su).await?;
    }
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
            "outcome": format!(
                "{} recovered (record, claim, attempt, call, settle, recover), {} declined \
                 (… decline, next retry scheduled, warning), {} exhausted (… decline at the last \
                 retry, exhausted, pause collection, final notice)",
                mix.recover, mix.declined, mix.exhausted
            ),
            "release": cfg!(not(debug_assertions)),
            "statistics": if args.never_analyzed {
                "never analyzed (autovacuum off on every table)"
            } else {
                "analyzed after the seed"
            },
        },
        "tick_seconds": elapsed.as_secs_f64(),
        "runs_per_s": rate,
        "batches": tick.batches,
    });
    write_report(&report, args.out_dir)
}

/// How many runs take each path; by customer number `g` (1-based): the first
/// `recover`, then `declined`, then `exhausted`.
#[derive(Debug, Clone, Copy)]
struct Mix {
    recover: i64,
    declined: i64,
    exhausted: i64,
}

impl Mix {
    fn of(runs: i64, declined_percent: i64, exhausted_percent: i64) -> Mix {
        let declined = runs * declined_percent / 100;
        let exhausted = runs * exhausted_percent / 100;
        Mix {
            recover: runs - declined - exhausted,
            declined,
            exhausted,
        }
    }

    fn total(&self) -> i64 {
        self.recover + self.declined + self.exhausted
    }

    /// The customers the provider declines: every one not recovering.
    fn declining_customers(&self) -> Vec<String> {
        (self.recover + 1..=self.total())
            .map(|g| format!("cus_bench_{g}"))
            .collect()
    }
}

/// One tenant, `mix.total()` customers each with an open automatic invoice
/// whose first attempt was declined an hour ago, and a run per invoice due a
/// minute ago: recovering runs on a two-retry policy at retry 1; declined
/// runs on a policy whose retry 2 is a day later (so it is not due again in
/// the tick); exhausting runs on the two-retry policy at retry 2, pausing
/// collection.
async fn seed(su: &mut sqlx::PgConnection, mix: &Mix, analyze: bool) -> Result<()> {
    let statements = [
        "INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action, warn_after, \
                                       is_default) \
         SELECT 'tenant_bench', 'Bench', '{60, 120}', 'pause_collection', '{1}', true WHERE $1 > 0",
        "INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action, warn_after) \
         SELECT 'tenant_bench', 'Bench, a day apart', '{60, 86400}', 'pause_collection', '{1}' \
         WHERE $1 > 0",
        "INSERT INTO plans (tenant_id, name, amount, currency, interval_unit, interval_count) \
         SELECT 'tenant_bench', 'Pro', 1200, 'EUR', 'month', 1 WHERE $1 > 0",
        "INSERT INTO customers (tenant_id, email, provider_customer_id, payment_method_id) \
         SELECT 'tenant_bench', 'c' || g || '@example.org', 'cus_bench_' || g, 'pm_card_visa' \
         FROM generate_series(1, $1) g",
        "INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor, \
                                    current_period_start, current_period_end, next_billing_at) \
         SELECT 'tenant_bench', c.id, p.id, 'active', now(), now(), now() + interval '30 days', \
                now() + interval '30 days' FROM customers c, plans p WHERE $1 > 0",
        // attempt_count 1: each invoice's one attempt, inserted next (migration 0038).
        "INSERT INTO invoices (tenant_id, subscription_id, period_start, period_end, amount, currency, \
                               collection_method, attempt_count) \
         SELECT 'tenant_bench', id, now() - interval '30 days', now(), 1200, 'EUR', 'automatic', 1 \
         FROM subscriptions WHERE $1 > 0",
        "INSERT INTO payment_attempts (tenant_id, invoice_id, attempt_seq, idempotency_key, amount, \
                                       currency, provider_status, decline_code, resolved_at) \
         SELECT 'tenant_bench', id, 1, 'hardcount-invoice-' || id || '-attempt-1', 1200, 'EUR', \
                'declined', 'insufficient_funds', now() - interval '1 hour' FROM invoices WHERE $1 > 0",
        // The customer's number `g` picks the path: ≤ $2 recover, ≤ $3 decline, the rest exhaust.
        "INSERT INTO dunning_runs (tenant_id, invoice_id, policy_id, attempt_count, first_declined_at, \
                                   next_attempt_at) \
         SELECT 'tenant_bench', i.id, p.id, \
                CASE WHEN g.n > $3 THEN 1 ELSE 0 END, now() - interval '1 hour', \
                now() - interval '1 minute' \
         FROM invoices i \
         JOIN subscriptions s ON s.id = i.subscription_id \
         JOIN customers c ON c.id = s.customer_id \
         CROSS JOIN LATERAL (SELECT substr(c.provider_customer_id, 11)::bigint AS n) g \
         JOIN dunning_policies p ON p.tenant_id = 'tenant_bench' \
          AND p.is_default = NOT (g.n > $2 AND g.n <= $3) \
         WHERE $1 > 0",
    ];
    for s in statements {
        sqlx::query(s)
            .bind(mix.total())
            .bind(mix.recover)
            .bind(mix.recover + mix.declined)
            .execute(&mut *su)
            .await?;
    }
    if analyze {
        sqlx::query("ANALYZE").execute(&mut *su).await?;
    }
    Ok(())
}

fn write_report(report: &Value, out_dir: Option<std::path::PathBuf>) -> Result<()> {
    let dir = benches::report_dir(out_dir)?;
    std::fs::write(
        dir.join("dunning.json"),
        serde_json::to_string_pretty(report)? + "\n",
    )
    .context("write dunning.json")?;
    let generated = format!(
        "| due runs | tick, s | runs/s |\n|---|---|---|\n| {} | {:.2} | {:.0} |\n\n\
         {}",
        report["settings"]["runs"],
        report["tick_seconds"].as_f64().unwrap_or(0.0),
        report["runs_per_s"].as_f64().unwrap_or(0.0),
        benches::machine_and_settings(report),
    );
    benches::write_generated(&dir, "dunning.md", &generated)
}
