//! Memory benchmark (issue 26, point 6): the peak resident memory one batch
//! adds, at the size limits, for `webhook_delivery` (a batch of 500 pending
//! deliveries, the shipped `batch_size`, each with a payload of
//! `webhook_outbox::MAX_PAYLOAD_BYTES`) and `email_outbox` (a batch of the
//! shipped `batch_size` emails, each with text and HTML bodies of
//! `email_outbox::MAX_BODY_BYTES` and `MAX_RECIPIENTS` recipients), each beside
//! a control batch of small items.
//!
//! Each batch is sent by a child process of this binary that does nothing else
//! (`--child delivery|email`): it connects, builds the role's worker, reads its
//! `VmRSS`, resets its peak (`5` into `/proc/self/clear_refs`), runs the role
//! until the batch is done, and reports `VmHWM` (and the highest `VmRSS` a
//! thread sampled every 2 ms). Seeding, the webhook receiver (another child,
//! `--child receiver`) and the SMTP sink (aiosmtpd) live in other processes, so
//! none of their memory is counted.
//!
//! ```sh
//! scripts/bed run cargo run --release -p benches --bin memory
//! ```
//!
//! Writes `docs/benchmarks/memory.md` (between the markers) and `memory.json`.

use std::io::{BufRead as _, BufReader, Write as _};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use db::{Db, Row as _, sql};
use email_outbox::{Email, MAX_BODY_BYTES, Sender, SenderConfig, SmtpUrl};
use leader::{Manager, Role, Telemetry, Timing};
use scheduler::{RoleSpec, run_role, work};
use serde_json::{Value, json};
use testbed::receiver::{Receiver, Reply};
use testbed::{Leg, SmtpSink, TestDb};
use tokio_util::sync::CancellationToken;
use webhook_delivery::WorkerConfig;
use webhook_delivery::ssrf::Allowlist;
use webhook_outbox::{Dispatcher, DispatcherConfig, MAX_PAYLOAD_BYTES};

#[derive(Parser, Debug)]
struct Args {
    /// Where the report goes (default docs/benchmarks).
    #[arg(long)]
    out_dir: Option<std::path::PathBuf>,
    /// Internal: run one part in this process (`receiver`, `delivery`, `email`).
    #[arg(long, hide = true)]
    child: Option<String>,
    /// Internal: the database the child uses.
    #[arg(long, hide = true)]
    db_url: Option<String>,
    /// Internal: the SMTP sink's port, for `--child email`.
    #[arg(long, hide = true)]
    smtp_port: Option<u16>,
}

const TENANTS: usize = 4;
const ENDPOINTS_PER_TENANT: usize = 2;
/// Small items for the control batches: what a batch costs without its payloads.
const SMALL_BYTES: usize = 200;

fn progress(msg: &str) {
    eprintln!("[memory bench] {msg}");
}

fn main() -> Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Runtime::new()?;
    match args.child.as_deref() {
        None => rt.block_on(orchestrate(args.out_dir)),
        Some("receiver") => rt.block_on(receive()),
        Some(part) => {
            let db_url = args.db_url.context("--db-url")?;
            let figures = rt.block_on(measure(part, &db_url, args.smtp_port))?;
            println!("{figures}");
            Ok(())
        }
    }
}

// --- the orchestrating process -------------------------------------------------

async fn orchestrate(out_dir: Option<std::path::PathBuf>) -> Result<()> {
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    let mut machine = benches::machine(&mut su).await?;
    let url = t.app_url(Leg::PgBouncer);
    let db = Db::connect_lazy(&url, 4)?;
    let (mut receiver, ports) = spawn_receiver()?;
    // Endpoints are written as tenants write them, as hardcount_api.
    let urls = endpoints(&t.api(), &ports).await?;
    progress(&format!("{} endpoints on ports {ports:?}", urls.len()));

    let delivery_batch = WorkerConfig::default().batch_size;
    let email_batch = SenderConfig::default().batch_size;
    let mut runs = Vec::new();
    for (label, bytes) in [
        ("delivery, small payloads (control)", SMALL_BYTES),
        ("delivery, payloads at the limit", MAX_PAYLOAD_BYTES),
    ] {
        let before = count(&db, DELIVERED).await?;
        seed_deliveries(&db, delivery_batch, bytes).await?;
        progress(&format!("{label}: {delivery_batch} deliveries pending"));
        let mut figures = run_child("delivery", &url, None)?;
        let delivered = count(&db, DELIVERED).await? - before;
        ensure!(
            delivered == delivery_batch as i64,
            "{label}: {delivered} delivered, not {delivery_batch}"
        );
        figures["label"] = json!(label);
        figures["items"] = json!(delivery_batch);
        figures["item_bytes"] = json!(bytes);
        figures["payload_mib"] = json!((delivery_batch * bytes) as f64 / MIB);
        progress(&format!("{label}: {figures}"));
        runs.push(figures);
    }
    let sink = SmtpSink::start();
    let max_to = outbox::email::MAX_RECIPIENTS;
    for (label, body, recipients) in [
        ("email, small bodies (control)", SMALL_BYTES, 1),
        (
            "email, bodies at the limit, one recipient",
            MAX_BODY_BYTES,
            1,
        ),
        (
            "email, bodies and recipients at the limits",
            MAX_BODY_BYTES,
            max_to,
        ),
    ] {
        let before = count(&db, SENT_EMAILS).await?;
        let bytes = seed_emails(&db, email_batch, body, recipients).await?;
        progress(&format!("{label}: {email_batch} emails queued"));
        let mut figures = run_child("email", &url, Some(sink.port))?;
        // A refusal by the sink is reported, not fatal: the message was
        // built and sent whole before the sink answered.
        let sent = count(&db, SENT_EMAILS).await? - before;
        // The distinct reasons of every email not sent so far, this run's among them.
        let why: Option<String> = (sent < email_batch as i64)
            .then_some(db.fetch_one(sql(UNSENT_EMAILS)).await?.try_get("why")?)
            .flatten();
        figures["label"] = json!(label);
        figures["recipients"] = json!(recipients);
        figures["sent"] = json!(sent);
        figures["not_sent_because"] = json!(why);
        figures["items"] = json!(email_batch);
        figures["item_bytes"] = json!(bytes);
        figures["payload_mib"] = json!((email_batch * bytes) as f64 / MIB);
        progress(&format!("{label}: {figures}"));
        runs.push(figures);
    }
    let _ = receiver.kill();
    let _ = receiver.wait();
    benches::machine_at_end(&mut machine);
    let report = json!({
        "machine": machine,
        "settings": {
            "path": "app pool through PgBouncer (transaction mode)",
            "release": cfg!(not(debug_assertions)),
            "webhook_delivery": {
                "batch_size": delivery_batch,
                "max_in_flight": WorkerConfig::default().max_in_flight,
                "max_payload_bytes": MAX_PAYLOAD_BYTES,
                "tenants": TENANTS,
                "endpoints": TENANTS * ENDPOINTS_PER_TENANT,
            },
            "email_outbox": {
                "batch_size": email_batch,
                "max_connections": SenderConfig::default().max_connections,
                "max_body_bytes": MAX_BODY_BYTES,
                "max_recipients": outbox::email::MAX_RECIPIENTS,
            },
            "kubernetes_memory_limit": "256Mi (deploy/kubernetes/deployment.yaml)",
        },
        "runs": runs,
    });
    write_report(&report, out_dir)
}

const MIB: f64 = 1024.0 * 1024.0;

const PENDING_DELIVERIES: &str =
    "SELECT count(*) AS n FROM webhook_deliveries WHERE status = 'pending'";
const DELIVERED: &str = "SELECT count(*) AS n FROM webhook_deliveries WHERE status = 'delivered'";
const QUEUED_EMAILS: &str = "SELECT count(*) AS n FROM email_outbox WHERE status = 'queued'";
const UNSENT_EMAILS: &str = "SELECT string_agg(DISTINCT concat_ws(' ', status, refused, last_reply_code, last_reply_text), '; ') AS why FROM email_outbox WHERE status <> 'sent'";
const SENT_EMAILS: &str = "SELECT count(*) AS n FROM email_outbox WHERE status = 'sent'";

/// The one number a `SELECT count(*) AS n` statement returns.
async fn count(db: &Db, statement: &'static str) -> Result<i64> {
    Ok(db.fetch_one(sql(statement)).await?.try_get("n")?)
}

/// `ENDPOINTS_PER_TENANT` endpoints for each of `TENANTS` tenants, alternating
/// between the receiver's ports, so that the batch can fill `max_in_flight`
/// (per tenant 8, per endpoint 4, per destination 16 by default).
async fn endpoints(db: &Db, ports: &[u16]) -> Result<Vec<String>> {
    let keyring = webhook_delivery::Keyring::parse(testbed::SECRETS_KEY)?;
    let mut urls = Vec::new();
    for tenant in 0..TENANTS {
        for e in 0..ENDPOINTS_PER_TENANT {
            let port = ports[(tenant * ENDPOINTS_PER_TENANT + e) % ports.len()];
            let url = format!("http://127.0.0.1:{port}/t{tenant}/ep{e}");
            webhook_delivery::create_endpoint(
                db,
                &keyring,
                &tenant_id(tenant),
                &url,
                &[] as &[&str],
            )
            .await?;
            urls.push(url);
        }
    }
    Ok(urls)
}

fn tenant_id(i: usize) -> String {
    format!("tenant_mem{i}")
}

/// A JSON object of exactly `bytes` bytes (at least 40).
fn json_payload(i: usize, bytes: usize) -> String {
    let head = format!(r#"{{"invoice":"in_{i:08}","pad":""#);
    let pad = bytes.saturating_sub(head.len() + 2);
    let mut s = String::with_capacity(bytes);
    s.push_str(&head);
    s.extend(std::iter::repeat_n('x', pad));
    s.push_str("\"}");
    s
}

/// `n` pending deliveries of `bytes` each: events enqueued one by one (so this
/// process never holds more than one payload), fanned out by the outbox role.
async fn seed_deliveries(db: &Db, n: usize, bytes: usize) -> Result<()> {
    ensure!(
        count(db, PENDING_DELIVERIES).await? == 0,
        "deliveries already pending"
    );
    for i in 0..n / ENDPOINTS_PER_TENANT {
        let mut tx = db.begin().await?;
        let payload = json_payload(i, bytes);
        webhook_outbox::enqueue(
            &mut tx,
            &tenant_id(i % TENANTS),
            "invoice.finalized",
            &payload,
        )
        .await?;
        tx.commit().await?;
    }
    let manager = Manager::new(db.clone(), Timing::ADR, Telemetry::noop());
    let dispatcher = Dispatcher::new(db.clone(), DispatcherConfig::default(), Telemetry::noop())?;
    let stop = CancellationToken::new();
    let spec = RoleSpec {
        role: Role::WebhookOutbox,
        interval: Duration::from_millis(200),
        work: work(move |tick| {
            let d = dispatcher.clone();
            async move { d.run_tick(&tick).await.end }
        }),
    };
    let role = tokio::spawn(run_role(manager, spec, stop.clone()));
    let deadline = Instant::now() + Duration::from_secs(120);
    while count(db, PENDING_DELIVERIES).await? < n as i64 {
        ensure!(
            Instant::now() < deadline,
            "the fan-out did not finish in 120 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    role.await?;
    Ok(())
}

/// `n` queued emails with text and HTML bodies of `body` bytes each and
/// `recipients` recipients. Returns the body bytes of one email.
async fn seed_emails(db: &Db, n: usize, body: usize, recipients: usize) -> Result<usize> {
    // Lines of 76 characters, as a real receipt would wrap.
    let text = |fill: char| -> String {
        let line: String = std::iter::repeat_n(fill, 75).chain(['\n']).collect();
        line.repeat(body / line.len() + 1)[..body].to_owned()
    };
    for i in 0..n {
        let email = Email {
            from: "Billing <billing@example.com>".into(),
            to: (0..recipients)
                .map(|r| format!("customer{i}-{r}@example.org"))
                .collect(),
            subject: format!("Receipt {i}"),
            text: text('t'),
            html: Some(text('h')),
        };
        let mut tx = db.begin().await?;
        email_outbox::enqueue(&mut tx, "tenant_mem", &email).await?;
        tx.commit().await?;
    }
    Ok(2 * body)
}

/// The receiver child: its ports on the first line of its stdout.
fn spawn_receiver() -> Result<(Child, Vec<u16>)> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--child", "receiver"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("stdout")?).read_line(&mut line)?;
    let ports = line
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<Vec<u16>, _>>()
        .with_context(|| format!("receiver said {line:?}"))?;
    ensure!(!ports.is_empty(), "receiver said {line:?}");
    Ok((child, ports))
}

/// Run one measuring child to its end; its one line of JSON.
fn run_child(part: &str, db_url: &str, smtp_port: Option<u16>) -> Result<Value> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["--child", part, "--db-url", db_url]);
    if let Some(p) = smtp_port {
        cmd.args(["--smtp-port", &p.to_string()]);
    }
    let out = cmd.stderr(Stdio::inherit()).output()?;
    ensure!(
        out.status.success(),
        "--child {part} failed: {:?}",
        out.status
    );
    let text = String::from_utf8(out.stdout)?;
    let line = text.lines().last().context("no output")?;
    Ok(serde_json::from_str(line)?)
}

// --- the children --------------------------------------------------------------

/// Two receivers (two destinations, for `max_in_flight_per_destination`) that
/// answer 200 and drop what they received.
async fn receive() -> Result<()> {
    let a = Receiver::start(|_| Reply::Status(200)).await;
    let b = Receiver::start(|_| Reply::Status(200)).await;
    println!("{} {}", a.port(), b.port());
    std::io::stdout().flush()?;
    // Gone with the parent: it holds our stdin.
    std::thread::spawn(|| {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        std::process::exit(0);
    });
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop((a.take(), b.take()));
    }
}

/// This process's `VmRSS` and `VmHWM`, in KiB.
fn rss_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Build the role, note the resident memory, reset the peak, run the role until
/// nothing is left to do, and report the figures as one JSON object.
async fn measure(part: &str, db_url: &str, smtp_port: Option<u16>) -> Result<Value> {
    let db = Db::connect_lazy(db_url, 10)?;
    // Open the pool's connections before the baseline.
    let mut warm = Vec::new();
    for _ in 0..4 {
        warm.push(db.begin().await?);
    }
    drop(warm);
    let (role, left, work) = match part {
        "delivery" => {
            let config = WorkerConfig {
                allowlist: Allowlist::parse("127.0.0.0/8")?,
                secrets: Some(webhook_delivery::Keyring::parse(testbed::SECRETS_KEY)?),
                ..WorkerConfig::default()
            };
            let worker = webhook_delivery::Worker::new(db.clone(), config, Telemetry::noop())?;
            (
                Role::WebhookDelivery,
                PENDING_DELIVERIES,
                work(move |tick| {
                    let w = worker.clone();
                    async move { w.run_tick(&tick).await.end }
                }),
            )
        }
        "email" => {
            let port = smtp_port.context("--smtp-port")?;
            let url = SmtpUrl::parse(&format!("smtp://127.0.0.1:{port}"))?;
            let sender = Sender::new(
                db.clone(),
                SenderConfig::default(),
                &url,
                None,
                Telemetry::noop(),
            )?;
            (
                Role::EmailOutbox,
                QUEUED_EMAILS,
                work(move |tick| {
                    let s = sender.clone();
                    async move { s.run_tick(&tick).await.end }
                }),
            )
        }
        other => bail!("unknown part {other}"),
    };
    let manager = Manager::new(db.clone(), Timing::ADR, Telemetry::noop());
    let (baseline_kib, _) = rss_kib();
    std::fs::write("/proc/self/clear_refs", "5").context("reset VmHWM")?;
    let sampled = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (sampled, done) = (sampled.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                sampled.fetch_max(rss_kib().0, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    let started = Instant::now();
    let stop = CancellationToken::new();
    let spec = RoleSpec {
        role,
        interval: Duration::from_millis(200),
        work,
    };
    let running = tokio::spawn(run_role(manager, spec, stop.clone()));
    let deadline = Instant::now() + Duration::from_secs(300);
    while count(&db, left).await? > 0 {
        ensure!(Instant::now() < deadline, "{part}: not done in 300 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed();
    let (_, hwm_kib) = rss_kib();
    done.store(true, Ordering::Relaxed);
    sampler.join().ok();
    stop.cancel();
    running.await?;
    db.close().await;
    let kib = |v: u64| v as f64 / 1024.0;
    Ok(json!({
        "baseline_rss_mib": kib(baseline_kib),
        "peak_rss_mib": kib(hwm_kib),
        "sampled_peak_rss_mib": kib(sampled.load(Ordering::Relaxed)),
        "added_mib": kib(hwm_kib.saturating_sub(baseline_kib)),
        "seconds": elapsed.as_secs_f64(),
    }))
}

// --- the report ----------------------------------------------------------------

fn write_report(report: &Value, out_dir: Option<std::path::PathBuf>) -> Result<()> {
    let dir = benches::report_dir(out_dir)?;
    std::fs::write(
        dir.join("memory.json"),
        serde_json::to_string_pretty(report)? + "\n",
    )
    .context("write memory.json")?;
    let mut table = String::from(
        "| batch | items | bytes per item | recipients | delivered or sent | payload, MiB | RSS before, MiB | peak RSS (VmHWM), MiB | peak sampled every 2 ms, MiB | added by the batch, MiB | seconds |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    for r in report["runs"].as_array().into_iter().flatten() {
        table.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} |\n",
            r["label"].as_str().unwrap_or("?"),
            r["items"],
            r["item_bytes"],
            r.get("recipients").map_or("—".into(), Value::to_string),
            r.get("sent").unwrap_or(&r["items"]),
            f(&r["payload_mib"]),
            f(&r["baseline_rss_mib"]),
            f(&r["peak_rss_mib"]),
            f(&r["sampled_peak_rss_mib"]),
            f(&r["added_mib"]),
            f(&r["seconds"]),
        ));
    }
    for r in report["runs"].as_array().into_iter().flatten() {
        if let Some(why) = r["not_sent_because"].as_str() {
            table.push_str(&format!(
                "\n{}: not sent because: {why}\n",
                r["label"].as_str().unwrap_or("?")
            ));
        }
    }
    let generated = format!("{table}\n{}", benches::machine_and_settings(report),);
    benches::write_generated(&dir, "memory.md", &generated)?;
    progress(&format!("wrote {}/memory.{{md,json}}", dir.display()));
    Ok(())
}
