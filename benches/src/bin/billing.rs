//! Billing benchmark (issue 10, item 9): due subscriptions billed in one tick
//! through PgBouncer (invoices per second, tick duration), then the invoices
//! it made charged against the fake provider on loopback (charges per second).
//!
//! ```sh
//! scripts/bed run cargo run --release -p benches --bin billing -- --subscriptions 100000
//! ```
//!
//! Writes `docs/benchmarks/billing.md` (between the markers) and `billing.json`.
//! With `--provider-bin target/release/fake_provider` the fake provider runs as
//! a process of its own (as `hardcount serve` meets a provider), so the CPU of
//! the charge phase is reported for the service and the provider apart.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use billing::{Biller, BillingConfig, ProviderConfig, SecretKey, TickReport};
use clap::Parser;
use db::{Db, Row as _, sql};
use fake_provider::{FakeProvider, TEST_SECRET_KEY};
use leader::{Role, Telemetry};
use serde_json::{Value, json};
use testbed::{Leg, TestDb};

#[derive(Parser, Debug)]
struct Args {
    /// Due subscriptions billed in one tick (and then charged).
    #[arg(long, default_value_t = 2000)]
    subscriptions: usize,
    /// Due subscriptions closed per batch; default: the shipped default.
    #[arg(long)]
    batch_size: Option<usize>,
    /// Charges in flight; default: the shipped default.
    #[arg(long)]
    charge_concurrency: Option<usize>,
    /// Skip the charge phase.
    #[arg(long)]
    no_charges: bool,
    /// App pool size (connections to PgBouncer).
    #[arg(long, default_value_t = 40)]
    pool: u32,
    /// Where the report goes (default docs/benchmarks).
    #[arg(long)]
    out_dir: Option<std::path::PathBuf>,
    /// Run the fake provider as its own process from this binary (the
    /// workspace's `fake_provider`) instead of in this process.
    #[arg(long)]
    provider_bin: Option<std::path::PathBuf>,
    /// After the charges, this many trials that ended a moment ago, activated
    /// by one more tick (the lifecycle step: its listing, compare-and-set
    /// and `subscription.trial_ended` per trial); 0 skips it.
    #[arg(long, default_value_t = 0)]
    ended_trials: usize,
    /// Before the charges, the customers of this many invoices, the first in
    /// id order, lose their card: invoices no batch can take, which the
    /// charge claim passes over (docs/adr/0064); the rest are charged.
    #[arg(long, default_value_t = 0)]
    without_card: usize,
    /// Leave every table unanalyzed (autovacuum off on each, no ANALYZE after
    /// the seeds), as a first import or a restore leaves them; the run fails if
    /// any table was analyzed by its end. For sweeping the plans the money
    /// statements choose without statistics (benches/never-analyzed.sh).
    #[arg(long)]
    never_analyzed: bool,
    /// Tenants the subscriptions are spread over, evenly (the first is
    /// `tenant_bench`, the ended trials' tenant).
    #[arg(long, default_value_t = 1)]
    tenants: usize,
}

/// The fake provider the charges go to: in this process, or a child process
/// whose CPU is counted apart.
enum Provider {
    InProcess(FakeProvider),
    Child {
        child: tokio::process::Child,
        base_url: String,
    },
}

impl Provider {
    async fn start(bin: Option<&std::path::Path>) -> Result<Provider> {
        let Some(bin) = bin else {
            return Ok(Provider::InProcess(FakeProvider::start().await?));
        };
        let port = testbed::free_port();
        let mut child = tokio::process::Command::new(bin)
            .env("FAKE_PROVIDER_ADDR", format!("127.0.0.1:{port}"))
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("start {}", bin.display()))?;
        let stdout = child.stdout.take().context("the provider's stdout")?;
        let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
        let ready = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .context("the provider did not say it listens within 10 s")??;
        ensure!(
            ready.as_deref().is_some_and(|l| l.contains("listening")),
            "the provider said {ready:?} instead of listening"
        );
        Ok(Provider::Child {
            child,
            base_url: format!("http://127.0.0.1:{port}"),
        })
    }

    fn base_url(&self) -> String {
        match self {
            Provider::InProcess(p) => p.base_url(),
            Provider::Child { base_url, .. } => base_url.clone(),
        }
    }

    /// Successful charges the provider has counted.
    async fn total_charges(&self) -> Result<usize> {
        match self {
            Provider::InProcess(p) => Ok(p.total_charges() as usize),
            Provider::Child { base_url, .. } => {
                let text = reqwest::Client::new()
                    .get(format!("{base_url}/_test/charges"))
                    .bearer_auth(TEST_SECRET_KEY)
                    .send()
                    .await?
                    .error_for_status()?
                    .text()
                    .await?;
                let v: Value = serde_json::from_str(&text)?;
                let total = v["total"].as_u64().context("no total in /_test/charges")?;
                Ok(usize::try_from(total)?)
            }
        }
    }

    /// CPU seconds of the child so far; `None` in process (counted in ours).
    fn cpu_seconds(&self) -> Option<f64> {
        match self {
            Provider::InProcess(_) => None,
            Provider::Child { child, .. } => child.id().map(benches::process_cpu_seconds),
        }
    }
}

fn progress(msg: &str) {
    eprintln!("[billing bench] {msg}");
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(args.subscriptions > 0, "--subscriptions must be positive");
    ensure!(
        (1..=args.subscriptions).contains(&args.tenants),
        "--tenants must be between 1 and --subscriptions"
    );
    let mut config = BillingConfig {
        tick_budget: Duration::from_secs(3600),
        statement_timeout: Duration::from_secs(300),
        ..BillingConfig::default()
    };
    if let Some(b) = args.batch_size {
        config.batch_size = b;
    }
    if let Some(c) = args.charge_concurrency {
        config.charge_concurrency = c;
    }
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    let mut machine = benches::machine(&mut su).await?;
    let db = Db::connect_lazy(&t.app_url(Leg::PgBouncer), args.pool)?;
    let analyze = !args.never_analyzed;
    if args.never_analyzed {
        testbed::plans::keep_tables_unanalyzed(&mut su).await?;
    }

    progress(&format!("seeding {} due subscriptions", args.subscriptions));
    let api = t.api();
    for k in 0..args.tenants {
        // Tenant k takes the subscriptions numbered k, k + tenants, …
        let numbers: Vec<i64> = (k..args.subscriptions)
            .step_by(args.tenants)
            .map(|g| i64::try_from(g + 1))
            .collect::<Result<_, _>>()?;
        let tenant = match k {
            0 => "tenant_bench".to_owned(),
            k => format!("tenant_bench_{k}"),
        };
        seed(&api, &tenant, &numbers).await?;
    }
    if analyze {
        api.execute(sql("ANALYZE")).await.ok();
    }

    progress("billing: one tick");
    let biller = Biller::new(db.clone(), config.clone(), Telemetry::noop())?;
    let billed = one_tick(&db, &biller).await;
    let invoices = count(&db, "SELECT count(*) FROM invoices").await?;
    let events = count(
        &db,
        "SELECT count(*) FROM webhook_events WHERE event_type = 'invoice.finalized'",
    )
    .await?;
    ensure!(
        billed.tally.invoiced == args.subscriptions
            && usize::try_from(invoices)? == args.subscriptions
            && usize::try_from(events)? == args.subscriptions,
        "one tick billed {} of {} ({invoices} invoices, {events} events): {billed:?}",
        billed.tally.invoiced,
        args.subscriptions
    );
    let tick_s = billed.elapsed.as_secs_f64();
    let invoices_per_s = args.subscriptions as f64 / tick_s;
    progress(&format!(
        "billed {} in {tick_s:.2} s: {invoices_per_s:.0} invoices/s",
        args.subscriptions
    ));

    let mut charges = Value::Null;
    if !args.no_charges {
        let provider = Provider::start(args.provider_bin.as_deref()).await?;
        let charging = BillingConfig {
            provider: Some(ProviderConfig::new(
                provider.base_url(),
                SecretKey::new(TEST_SECRET_KEY),
            )),
            ..config.clone()
        };
        if args.without_card > 0 {
            progress(&format!(
                "removing the card of the first {} invoices' customers",
                args.without_card
            ));
            sqlx::query(
                "UPDATE customers SET payment_method_id = NULL WHERE id IN ( \
                   SELECT s.customer_id FROM invoices i \
                   JOIN subscriptions s ON s.id = i.subscription_id \
                   ORDER BY i.id LIMIT $1)",
            )
            .bind(i64::try_from(args.without_card)?)
            .execute(&mut su)
            .await?;
        }
        let chargeable = args.subscriptions.saturating_sub(args.without_card);
        progress("charging: one tick against the fake provider");
        let biller = Biller::new(db.clone(), charging, Telemetry::noop())?;
        let (cpu_before, provider_before) = (benches::CpuSnapshot::take(), provider.cpu_seconds());
        let charged = one_tick(&db, &biller).await;
        let cpu = benches::CpuSnapshot::take().since(&cpu_before);
        let provider_cpu = provider
            .cpu_seconds()
            .zip(provider_before)
            .map(|(after, before)| after - before);
        let paid = charged.charges.paid;
        let at_provider = provider.total_charges().await?;
        ensure!(
            paid == chargeable && at_provider == paid,
            "charged {paid} of {chargeable} ({at_provider} at the provider): {charged:?}",
        );
        let s = charged.elapsed.as_secs_f64();
        progress(&format!(
            "charged {paid} in {s:.2} s: {:.0} charges/s",
            paid as f64 / s
        ));
        progress(&format!(
            "CPU s while charging: bench process {:.2}, provider process {}, Postgres {:.2}, \
             PgBouncer {:.2}, others {:.2}, of {:.2}",
            cpu.this_process,
            provider_cpu.map_or("- (in process)".to_owned(), |c| format!("{c:.2}")),
            cpu.postgres,
            cpu.pgbouncer,
            (cpu.others - provider_cpu.unwrap_or(0.0)).max(0.0),
            cpu.capacity
        ));
        charges = json!({
            "charges": paid,
            "tick_seconds": s,
            "charges_per_s": paid as f64 / s,
            "provider": if provider_cpu.is_some() { "own process" } else { "in process" },
            "cpu_seconds": {
                "bench_process": cpu.this_process,
                "provider_process": provider_cpu,
                "postgres": cpu.postgres,
                "pgbouncer": cpu.pgbouncer,
                "capacity": cpu.capacity,
            },
        });
    }

    let mut trials = Value::Null;
    if args.ended_trials > 0 {
        progress(&format!("seeding {} ended trials", args.ended_trials));
        seed_ended_trials(&mut su, args.ended_trials, analyze).await?;
        progress("lifecycle: one tick");
        let ended = one_tick(&db, &biller).await;
        let announced = count(
            &db,
            "SELECT count(*) FROM webhook_events WHERE event_type = 'subscription.trial_ended'",
        )
        .await?;
        ensure!(
            ended.lifecycle.trials_ended == args.ended_trials
                && usize::try_from(announced)? == args.ended_trials,
            "one tick activated {} of {} trials ({announced} announced): {ended:?}",
            ended.lifecycle.trials_ended,
            args.ended_trials
        );
        let s = ended.elapsed.as_secs_f64();
        progress(&format!(
            "activated {} trials in {s:.2} s: {:.0} trials/s",
            args.ended_trials,
            args.ended_trials as f64 / s
        ));
        trials = json!({
            "trials": args.ended_trials,
            "tick_seconds": s,
            "trials_per_s": args.ended_trials as f64 / s,
        });
    }

    if args.never_analyzed {
        benches::ensure_never_analyzed(&mut su).await?;
    }
    benches::machine_at_end(&mut machine);
    let report = json!({
        "machine": machine,
        "settings": {
            "subscriptions": args.subscriptions,
            "path": "app pool through PgBouncer (transaction mode)",
            "app_pool": args.pool,
            "bouncer_pool": benches::bed_bouncer_pool_size(),
            "batch_size": config.batch_size,
            "charge_concurrency": config.charge_concurrency,
            "without_card": args.without_card,
            "tenants": args.tenants,
            "statistics": if args.never_analyzed {
                "never analyzed (autovacuum off on every table)"
            } else {
                "analyzed after the seed"
            },
            "build": benches::build_profile(),
        },
        "billing": {
            "invoices": args.subscriptions,
            "tick_seconds": tick_s,
            "invoices_per_s": invoices_per_s,
            "batches": billed.batches,
        },
        "charging": charges,
        "trials": trials,
    });
    write_report(&report, args.out_dir)?;
    Ok(())
}

/// Active monthly subscriptions of `tenant`, each its own customer (numbered
/// by `numbers`, `cus_bench{g}`) with a saved card, whose period ended a
/// minute ago: due once each.
async fn seed(db: &Db, tenant: &str, numbers: &[i64]) -> Result<()> {
    let mut tx = db.begin().await?;
    // The API role writes under row-level security (docs/adr/0035): the
    // tenant is set for this transaction, as the tenant API sets it.
    tx.fetch_one(sql("SELECT set_config('hardcount.tenant_id', $1, true)").bind(tenant.to_owned()))
        .await?;
    tx.execute(
        sql(
            "INSERT INTO plans (tenant_id, name, amount, currency, interval_unit, interval_count) \
             VALUES ($1, 'Pro', 1200, 'EUR', 'month', 1)",
        )
        .bind(tenant.to_owned()),
    )
    .await?;
    tx.execute(
        sql(
            "INSERT INTO customers (tenant_id, email, provider_customer_id, payment_method_id) \
             SELECT $1, 'c' || g || '@example.org', 'cus_bench' || g, 'pm_card_visa' \
             FROM unnest($2::bigint[]) g",
        )
        .bind(tenant.to_owned())
        .bind(numbers.to_vec()),
    )
    .await?;
    tx.execute(
        sql(
            "INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor, \
                                        current_period_start, current_period_end, next_billing_at) \
             SELECT c.tenant_id, c.id, p.id, 'active', b.start, b.start, b.end_, b.end_ \
             FROM customers c \
             CROSS JOIN (SELECT id FROM plans WHERE tenant_id = $1) p \
             CROSS JOIN (SELECT now() - interval '1 month 1 minute' AS start, \
                                now() - interval '1 minute' AS end_) b \
             WHERE c.tenant_id = $1",
        )
        .bind(tenant.to_owned()),
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

/// `n` trialing subscriptions of the seeded tenant whose trial ended within
/// the last `n` milliseconds (each an existing customer's, the plan billed
/// monthly), written as the superuser like the rest of the seed.
async fn seed_ended_trials(su: &mut sqlx::PgConnection, n: usize, analyze: bool) -> Result<()> {
    let n = i64::try_from(n)?;
    sqlx::query(
        "INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor, \
                                    current_period_start, current_period_end, trial_end) \
         SELECT c.tenant_id, c.id, p.id, 'trialing', t.start, t.start, t.end_, t.end_ \
         FROM generate_series(1, $1) g \
         CROSS JOIN (SELECT tenant_id, id FROM customers WHERE tenant_id = 'tenant_bench' \
                     ORDER BY id LIMIT 1) c \
         CROSS JOIN (SELECT id FROM plans WHERE tenant_id = 'tenant_bench') p \
         CROSS JOIN LATERAL (SELECT now() - interval '14 days' AS start, \
                                    now() - g * interval '1 millisecond' AS end_) t",
    )
    .bind(n)
    .execute(&mut *su)
    .await?;
    if analyze {
        sqlx::query("ANALYZE subscriptions")
            .execute(&mut *su)
            .await?;
    }
    Ok(())
}

async fn one_tick(db: &Db, biller: &Biller) -> TickReport {
    let b = Arc::new(biller.clone());
    let m = testbed::leadership::manager(db, "bench");
    testbed::leadership::as_leader(
        &m,
        Role::Billing,
        |tick| async move { b.run_tick(&tick).await },
    )
    .await
}

async fn count(db: &Db, q: &'static str) -> Result<i64> {
    Ok(db.fetch_one(sql(q)).await?.try_get(0)?)
}

fn write_report(report: &Value, out_dir: Option<std::path::PathBuf>) -> Result<()> {
    let dir = benches::report_dir(out_dir)?;
    std::fs::write(
        dir.join("billing.json"),
        serde_json::to_string_pretty(report)? + "\n",
    )
    .context("write billing.json")?;
    let (b, c) = (&report["billing"], &report["charging"]);
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    let charges = if c.is_null() {
        "not measured (--no-charges)".to_owned()
    } else {
        format!(
            "{} charges in {:.2} s: **{:.0} charges/s**",
            c["charges"],
            f(&c["tick_seconds"]),
            f(&c["charges_per_s"])
        )
    };
    let t = &report["trials"];
    let trials = if t.is_null() {
        String::new()
    } else {
        format!(
            "| ended trials activated in one tick | {} in {:.2} s: **{:.0} trials/s** |\n",
            t["trials"],
            f(&t["tick_seconds"]),
            f(&t["trials_per_s"])
        )
    };
    let generated = format!(
        "| measure | result |\n|---|---|\n\
         | due subscriptions billed in one tick | {} in {:.2} s: **{:.0} invoices/s** ({} batches) |\n\
         | charges against the fake provider | {charges} |\n\
         {trials}\n\
         {}",
        b["invoices"],
        f(&b["tick_seconds"]),
        f(&b["invoices_per_s"]),
        b["batches"],
        benches::machine_and_settings(report),
    );
    benches::write_generated(&dir, "billing.md", &generated)?;
    progress(&format!("wrote {}/billing.{{md,json}}", dir.display()));
    Ok(())
}
