//! Email benchmark (issue 9, item 7): emails per second from the `email_outbox`
//! role to a local SMTP sink, the peak number of SMTP connections it had open
//! (refused above `max_connections`, docs/adr/0016), and,
//! in the same run, the sink's own ceiling: what a minimal SMTP client reaches
//! against the same sink with the same number of connections.
//!
//! Two sinks: the bed's aiosmtpd (Python, maildir on disk), and a minimal
//! in-process sink that answers every command at once, to show the role's own
//! ceiling when the sink is not the bottleneck.
//!
//! ```sh
//! scripts/bed run cargo run --release -p benches --bin email
//! ```
//!
//! Writes `docs/benchmarks/email.md` and `docs/benchmarks/email.json`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Parser;
use db::{Db, Row as _, sql};
use email_outbox::{Email, Sender, SenderConfig, SmtpUrl, enqueue};
use leader::{Manager, Role, Telemetry, Timing};
use scheduler::{RoleSpec, run_role, work};
use serde_json::{Value, json};
use testbed::{Leg, SmtpSink, TestDb};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

#[derive(Parser, Debug)]
struct Args {
    /// Emails per run.
    #[arg(long, default_value_t = 2000)]
    emails: usize,
    /// Runs per measure; the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// SMTP connections (and sends in flight); default: the shipped default.
    #[arg(long)]
    connections: Option<u32>,
    /// Where the report goes (default docs/benchmarks).
    #[arg(long)]
    out_dir: Option<std::path::PathBuf>,
}

fn progress(msg: &str) {
    eprintln!("[email bench] {msg}");
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(
        args.emails > 0 && args.runs > 0,
        "emails and runs must be positive"
    );
    let mut config = SenderConfig::default();
    if let Some(c) = args.connections {
        config.max_connections = c;
    }
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    let mut machine = benches::machine(&mut su).await?;
    let db = Db::connect_lazy(&t.app_url(Leg::PgBouncer), 10)?;

    let python = SmtpSink::start();
    let fast = FastSink::start().await?;
    let mut sinks = Vec::new();
    for (name, port) in [
        ("aiosmtpd (Python, maildir)", python.port),
        ("minimal in-process sink", fast.port),
    ] {
        let mut ceiling = Vec::new();
        let mut role = Vec::new();
        let mut peaks = Vec::new();
        for run in 1..=args.runs {
            progress(&format!("{name}: run {run}/{}: minimal client", args.runs));
            ceiling.push(minimal_client(port, args.emails, config.max_connections as usize).await?);
            progress(&format!(
                "{name}: run {run}/{}: email_outbox role",
                args.runs
            ));
            let (rate, peak) = role_run(&db, port, args.emails, &config).await?;
            role.push(rate);
            peaks.push(peak);
        }
        let (c, r) = (median(&mut ceiling), median(&mut role));
        progress(&format!(
            "{name}: role {r:.0}/s, sink ceiling {c:.0}/s, ratio {:.2}",
            r / c
        ));
        sinks.push(json!({
            "sink": name,
            "role_emails_per_s_median": r,
            "role_emails_per_s_runs": role,
            "ceiling_emails_per_s_median": c,
            "ceiling_emails_per_s_runs": ceiling,
            "ratio_to_ceiling": r / c,
            "peak_smtp_connections": peaks.iter().max(),
        }));
    }
    benches::machine_at_end(&mut machine);
    let report = json!({
        "machine": machine,
        "settings": {
            "emails_per_run": args.emails,
            "runs": args.runs,
            "path": "app pool through PgBouncer (transaction mode)",
            "batch_size": config.batch_size,
            "max_connections": config.max_connections,
            "release": cfg!(not(debug_assertions)),
        },
        "sinks": sinks,
    });
    write_report(&report, args.out_dir)?;
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Queue `n` emails (outside the clock), then run the role as `serve` does and
/// time until every one is sent. Returns emails/s and the peak number of open
/// connections to the sink, sampled every 5 ms.
async fn role_run(db: &Db, port: u16, n: usize, config: &SenderConfig) -> Result<(f64, usize)> {
    let mut tx = db.begin().await?;
    for i in 0..n {
        let email = Email {
            from: "Billing <billing@example.com>".into(),
            to: vec![format!("customer{i}@example.org")],
            subject: format!("Receipt {i}"),
            text: format!("Paid invoice {i}: 12.00 EUR\n"),
            html: Some(format!("<p>Paid invoice {i}: <b>12.00 EUR</b></p>")),
        };
        enqueue(&mut tx, "tenant_bench", &email).await?;
    }
    tx.commit().await?;
    let url = SmtpUrl::parse(&format!("smtp://127.0.0.1:{port}"))?;
    let sender = Sender::new(db.clone(), config.clone(), &url, None, Telemetry::noop())?;
    let manager = Manager::new(db.clone(), Timing::ADR, Telemetry::noop());
    let shutdown = CancellationToken::new();
    let peak = Arc::new(AtomicUsize::new(0));
    let repeats = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (peak, repeats, stop) = (peak.clone(), repeats.clone(), shutdown.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let (open, repeated) = testbed::sockets::established_to(port);
                peak.fetch_max(open, Ordering::Relaxed);
                repeats.fetch_add(repeated, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let started = Instant::now();
    let spec = RoleSpec {
        role: Role::EmailOutbox,
        interval: Duration::from_secs(1),
        work: work(move |tick| {
            let sender = sender.clone();
            async move { sender.run_tick(&tick).await.end }
        }),
    };
    let loop_ = tokio::spawn(run_role(manager, spec, shutdown.clone()));
    loop {
        let left: i64 = db
            .fetch_one(sql(
                "SELECT count(*) AS n FROM email_outbox WHERE status = 'queued'",
            ))
            .await?
            .try_get("n")?;
        if left == 0 {
            break;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(300),
            "{left} emails still queued after 300 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    shutdown.cancel();
    loop_.await?;
    sampler.await?;
    let failed: i64 = db
        .fetch_one(sql(
            "SELECT count(*) AS n FROM email_outbox WHERE status <> 'sent'",
        ))
        .await?
        .try_get("n")?;
    ensure!(failed == 0, "{failed} emails not sent");
    let peak = peak.load(Ordering::Relaxed);
    let repeats = repeats.load(Ordering::Relaxed);
    if repeats > 0 {
        progress(&format!(
            "/proc/net/tcp listed a socket twice {repeats} times (each counted once)"
        ));
    }
    ensure!(
        peak <= config.max_connections as usize,
        "{peak} SMTP connections open at once, above the bound {}",
        config.max_connections
    );
    Ok((n as f64 / elapsed, peak))
}

/// The sink's ceiling: `connections` plain SMTP sessions, each sending its
/// share of `n` one-recipient messages back to back, every reply awaited.
async fn minimal_client(port: u16, n: usize, connections: usize) -> Result<f64> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..connections {
        let share = n / connections + usize::from(c < n % connections);
        tasks.push(tokio::spawn(async move {
            let stream = TcpStream::connect(("127.0.0.1", port)).await?;
            let (r, mut w) = stream.into_split();
            let mut r = BufReader::new(r);
            reply(&mut r).await?;
            w.write_all(b"EHLO bench\r\n").await?;
            reply(&mut r).await?;
            for i in 0..share {
                let body = format!(
                    "From: billing@example.com\r\nTo: c{c}-{i}@example.org\r\nSubject: Receipt {i}\r\n\r\nPaid invoice {i}: 12.00 EUR\r\n.\r\n"
                );
                for cmd in ["MAIL FROM:<billing@example.com>\r\n".to_owned(), format!("RCPT TO:<c{c}-{i}@example.org>\r\n"), "DATA\r\n".to_owned(), body] {
                    w.write_all(cmd.as_bytes()).await?;
                    reply(&mut r).await?;
                }
            }
            w.write_all(b"QUIT\r\n").await?;
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

/// Read one (possibly multi-line) SMTP reply; refuse anything but 2xx/3xx.
async fn reply<R: tokio::io::AsyncBufRead + Unpin>(r: &mut R) -> Result<()> {
    loop {
        let mut line = String::new();
        ensure!(
            r.read_line(&mut line).await? > 0,
            "the sink closed the connection"
        );
        ensure!(
            line.starts_with('2') || line.starts_with('3'),
            "sink refused: {line}"
        );
        if line.as_bytes().get(3) != Some(&b'-') {
            return Ok(());
        }
    }
}

/// A minimal SMTP server: accepts every command at once and drops the message.
struct FastSink {
    port: u16,
}

impl FastSink {
    async fn start() -> Result<FastSink> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let _ = serve_session(stream).await;
                });
            }
        });
        Ok(FastSink { port })
    }
}

async fn serve_session(stream: TcpStream) -> Result<()> {
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r);
    w.write_all(b"220 fast sink\r\n").await?;
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).await? == 0 {
            return Ok(());
        }
        let verb = line.get(..4).unwrap_or("").to_ascii_uppercase();
        match verb.as_str() {
            "EHLO" => w.write_all(b"250-fast sink\r\n250 8BITMIME\r\n").await?,
            "DATA" => {
                w.write_all(b"354 go on\r\n").await?;
                loop {
                    line.clear();
                    if r.read_line(&mut line).await? == 0 {
                        return Ok(());
                    }
                    if line == ".\r\n" || line == ".\n" {
                        break;
                    }
                }
                w.write_all(b"250 queued\r\n").await?;
            }
            "QUIT" => {
                w.write_all(b"221 bye\r\n").await?;
                return Ok(());
            }
            _ => w.write_all(b"250 ok\r\n").await?,
        }
    }
}

fn write_report(report: &Value, out_dir: Option<std::path::PathBuf>) -> Result<()> {
    let dir = benches::report_dir(out_dir)?;
    std::fs::write(
        dir.join("email.json"),
        serde_json::to_string_pretty(report)? + "\n",
    )
    .context("write email.json")?;
    let mut table = String::from(
        "| sink | email_outbox role, emails/s (median) | sink ceiling, minimal client, emails/s | ratio | peak SMTP connections (bound) |\n|---|---|---|---|---|\n",
    );
    let bound = &report["settings"]["max_connections"];
    for s in report["sinks"].as_array().into_iter().flatten() {
        table.push_str(&format!(
            "| {} | {:.0} | {:.0} | {:.2} | {} ({bound}) |\n",
            s["sink"].as_str().unwrap_or("?"),
            s["role_emails_per_s_median"].as_f64().unwrap_or(0.0),
            s["ceiling_emails_per_s_median"].as_f64().unwrap_or(0.0),
            s["ratio_to_ceiling"].as_f64().unwrap_or(0.0),
            s["peak_smtp_connections"],
        ));
    }
    let generated = format!("{table}\n{}", benches::machine_and_settings(report),);
    // The hand-written methodology above the markers stays; only the results change.
    benches::write_generated(&dir, "email.md", &generated)?;
    progress(&format!("wrote {}/email.{{md,json}}", dir.display()));
    Ok(())
}
