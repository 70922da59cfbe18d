//! Email benchmark (issue 9, item 7): emails per second from the `email_outbox`
//! role to a local SMTP sink, the peak number of SMTP connections it had open
//! (refused above `max_connections`, docs/adr/0016), and,
//! in the same run, the sink's own ceiling: what a minimal SMTP client reaches
//! against the same sink with the same number of connections.
//!
//! Two sinks: the bed's aiosmtpd (Python, maildir on tmpfs), and a minimal
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
use testbed::{Leg, MinimalSink, SmtpSink, TestDb};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
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
    /// Emails claimed per batch; default: the shipped default.
    #[arg(long)]
    batch_size: Option<usize>,
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
    if let Some(b) = args.batch_size {
        config.batch_size = b;
    }
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    let mut machine = benches::machine(&mut su).await?;
    let db = Db::connect_lazy(&t.app_url(Leg::PgBouncer), 10)?;

    // The aiosmtpd sink writes a file per message. On the disk's filesystem the
    // cost of a new file moved with what the machine had deleted lately (the
    // previous run's maildir): the sink's own pace varied twofold between runs
    // of one process, and the role and its ceiling were measured at different
    // paces. On tmpfs it holds still.
    let shm = std::path::Path::new("/dev/shm");
    let maildir_parent = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let python = SmtpSink::start_in(&maildir_parent);
    let fast = MinimalSink::start(Duration::ZERO).await;
    let mut sinks = Vec::new();
    let aiosmtpd = python.pid().context("the aiosmtpd sink is not running")?;
    let counts = [
        Count::Process {
            pid: aiosmtpd,
            idle: testbed::sockets::sockets_of(aiosmtpd),
        },
        Count::InProcess(&fast),
    ];
    for ((name, port, sink_pid), count) in [
        ("aiosmtpd (Python, maildir)", python.port, Some(aiosmtpd)),
        ("minimal in-process sink", fast.port, None),
    ]
    .into_iter()
    .zip(counts)
    {
        let connections = config.max_connections as usize;
        let (mut note, mut ceiling, mut role, mut peaks, mut cpu) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for run in 1..=args.runs {
            // The order alternates, so that whatever drifts within a run (the
            // sink's maildir grows by every message) falls on both sides.
            let role_first = run % 2 == 0;
            let mut ceilings = async || -> Result<()> {
                for (shape, what, rates) in [
                    (Shape::Note, "one-part notes", &mut note),
                    (Shape::Receipt, "the role's receipts", &mut ceiling),
                ] {
                    progress(&format!(
                        "{name}: run {run}/{}: minimal client, {what}",
                        args.runs
                    ));
                    let sampler = Sampler::start(count).await?;
                    rates.push(minimal_client(port, args.emails, connections, shape).await?);
                    sampler.stop().await?;
                }
                Ok(())
            };
            if !role_first {
                ceilings().await?;
            }
            progress(&format!(
                "{name}: run {run}/{}: email_outbox role",
                args.runs
            ));
            // The role's last tick ended drained, so its next tick is due an
            // interval (1 s here) after it. Until 2026-12-04 the role's clock
            // ran from there, and a run that started inside that second
            // waited out the rest of it: up to 0.4 s of a 0.6 s run, one run
            // in three. The benchmark measures sending, not the schedule.
            sqlx::query(
                "UPDATE leader_leases SET last_tick_ended_at = NULL WHERE role = 'email_outbox'",
            )
            .execute(&mut su)
            .await?;
            let sampler = Sampler::start(count).await?;
            let (rate, used, sink) = role_run(&db, port, args.emails, &config, sink_pid).await?;
            let peak = sampler.stop().await?;
            ensure!(
                peak <= connections,
                "{peak} SMTP connections open at once, above the bound {connections}"
            );
            progress(&format!(
                "  role {rate:.0}/s; CPU s: bench process {:.2}, Postgres {:.2}, PgBouncer {:.2}, sink {}, of {:.2}",
                used.this_process,
                used.postgres,
                used.pgbouncer,
                sink.map_or("-".into(), |s| format!("{s:.2}")),
                used.capacity,
            ));
            role.push(rate);
            peaks.push(peak);
            cpu.push(json!({
                "bench_process_s": used.this_process,
                "postgres_s": used.postgres,
                "pgbouncer_s": used.pgbouncer,
                "sink_process_s": sink,
                "others_s": (used.others - sink.unwrap_or(0.0)).max(0.0),
                "capacity_s": used.capacity,
            }));
            if role_first {
                ceilings().await?;
            }
        }
        let (n, c, r) = (median(&mut note), median(&mut ceiling), median(&mut role));
        progress(&format!(
            "{name}: role {r:.0}/s, sink ceiling {c:.0}/s (one-part notes {n:.0}/s), ratio {:.2}",
            r / c
        ));
        sinks.push(json!({
            "sink": name,
            "role_emails_per_s_median": r,
            "role_emails_per_s_runs": role,
            "ceiling_emails_per_s_median": c,
            "ceiling_emails_per_s_runs": ceiling,
            "ceiling_one_part_notes_per_s_median": n,
            "ceiling_one_part_notes_per_s_runs": note,
            "ratio_to_ceiling": r / c,
            "peak_smtp_connections": peaks.iter().max(),
            "role_run_cpu": cpu,
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
            "connection_count": format!(
                "on the sink's side: aiosmtpd's open sockets less its listening one, every {} ms; the minimal sink's sessions, counted as they open and end",
                Sampler::EVERY.as_millis()
            ),
            "aiosmtpd_maildir_parent": maildir_parent.display().to_string(),
            "order": "ceilings then role on odd runs, role then ceilings on even runs",
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
/// time until every one is sent. Returns emails/s, and the CPU used while
/// the clock ran: by process group, and by the sink's process when given.
async fn role_run(
    db: &Db,
    port: u16,
    n: usize,
    config: &SenderConfig,
    sink_pid: Option<u32>,
) -> Result<(f64, benches::CpuUse, Option<f64>)> {
    let mut tx = db.begin().await?;
    for i in 0..n {
        let email = receipt(i);
        enqueue(&mut tx, "tenant_bench", &email).await?;
    }
    tx.commit().await?;
    let url = SmtpUrl::parse(&format!("smtp://127.0.0.1:{port}"))?;
    let sender = Sender::new(db.clone(), config.clone(), &url, None, Telemetry::noop())?;
    let manager = Manager::new(db.clone(), Timing::ADR, Telemetry::noop());
    let shutdown = CancellationToken::new();
    let cpu_before = (
        benches::CpuSnapshot::take(),
        sink_pid.map(benches::process_cpu_seconds),
    );
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
    let used = benches::CpuSnapshot::take().since(&cpu_before.0);
    let sink = sink_pid
        .map(benches::process_cpu_seconds)
        .zip(cpu_before.1)
        .map(|(a, b)| a - b);
    shutdown.cancel();
    loop_.await?;
    let failed: i64 = db
        .fetch_one(sql(
            "SELECT count(*) AS n FROM email_outbox WHERE status <> 'sent'",
        ))
        .await?
        .try_get("n")?;
    ensure!(failed == 0, "{failed} emails not sent");
    Ok((n as f64 / elapsed, used, sink))
}

/// Where the peak number of SMTP connections is read, on the sink's side.
/// Until 2026-12-04 it was sampled from `/proc/net/tcp` (client sockets to
/// the sink's port), every 100 ms. Reading that file walks the kernel's
/// whole table of sockets: under `perf` it was 10 % of this process's
/// samples during the role's runs, CPU taken from the role on two full
/// cores (the minimal client's measure leaves a core idle).
#[derive(Clone, Copy)]
enum Count<'a> {
    /// aiosmtpd, a process of its own: its open sockets less those it held
    /// before any client came (its listening socket), every
    /// [`Sampler::EVERY`]. A session the client ended and the sink has not
    /// yet closed counts, so the figure errs high.
    Process { pid: u32, idle: usize },
    /// The in-process sink: counted as it accepts and ends each session.
    InProcess(&'a MinimalSink),
}

impl Count<'_> {
    fn now(self) -> usize {
        match self {
            Count::Process { pid, idle } => testbed::sockets::sockets_of(pid).saturating_sub(idle),
            Count::InProcess(sink) => sink.open_sessions(),
        }
    }

    /// Wait (up to 5 s) until the sink has closed the last measure's
    /// sessions, so that they do not count in the next.
    async fn settle(self) -> Result<()> {
        let until = Instant::now() + Duration::from_secs(5);
        while self.now() > 0 {
            ensure!(
                Instant::now() < until,
                "the sink still holds {} sessions of the last measure",
                self.now()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }
}

/// The peak number of SMTP connections while one measure runs.
struct Sampler<'a> {
    count: Count<'a>,
    peak: Arc<AtomicUsize>,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl<'a> Sampler<'a> {
    const EVERY: Duration = Duration::from_millis(20);

    async fn start(count: Count<'a>) -> Result<Sampler<'a>> {
        count.settle().await?;
        let (peak, stop) = (Arc::new(AtomicUsize::new(0)), CancellationToken::new());
        let task = match count {
            Count::Process { pid, idle } => {
                let (peak, stop) = (peak.clone(), stop.clone());
                Some(tokio::spawn(async move {
                    while !stop.is_cancelled() {
                        let open = Count::Process { pid, idle }.now();
                        peak.fetch_max(open, Ordering::Relaxed);
                        tokio::time::sleep(Sampler::EVERY).await;
                    }
                }))
            }
            Count::InProcess(sink) => {
                sink.take_peak();
                None
            }
        };
        Ok(Sampler {
            count,
            peak,
            stop,
            task,
        })
    }

    /// The peak number of connections seen.
    async fn stop(self) -> Result<usize> {
        self.stop.cancel();
        if let Some(task) = self.task {
            task.await?;
        }
        Ok(match self.count {
            Count::Process { .. } => self.peak.load(Ordering::Relaxed),
            Count::InProcess(sink) => sink.take_peak(),
        })
    }
}

/// What the minimal client sends in one message.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Shape {
    /// A four-line, one-part note (the ceiling's message before 2026-12-03).
    Note,
    /// The role's own message for the same email: the MIME bytes that
    /// `email_outbox::message` builds (text and HTML parts), terminated as
    /// lettre terminates them, so the sink parses and stores the same bytes.
    Receipt,
}

/// The email the role run queues as its `i`th, and the ceiling's receipts.
fn receipt(i: usize) -> Email {
    Email {
        from: "Billing <billing@example.com>".into(),
        to: vec![format!("customer{i}@example.org")],
        subject: format!("Receipt {i}"),
        text: format!("Paid invoice {i}: 12.00 EUR\n"),
        html: Some(format!("<p>Paid invoice {i}: <b>12.00 EUR</b></p>")),
    }
}

/// The wire bytes of the `i`th message of `shape`, built before the clock.
fn wire_message(shape: Shape, c: usize, i: usize) -> Result<(String, String)> {
    let rcpt = format!("c{c}-{i}@example.org");
    let data = match shape {
        Shape::Note => format!(
            "From: billing@example.com\r\nTo: {rcpt}\r\nSubject: Receipt {i}\r\n\r\nPaid invoice {i}: 12.00 EUR\r\n.\r\n"
        ),
        Shape::Receipt => {
            let mut email = receipt(i);
            email.to = vec![rcpt.clone()];
            let q = email_outbox::message::Queued {
                id: i64::try_from(i)?,
                tenant_id: "tenant_bench".into(),
                attempt: 1,
                resent_at_attempt: 0,
                message_id: outbox::email::new_message_id(&email.from),
                email,
            };
            let body = email_outbox::message::message(&q)
                .map_err(|e| anyhow::anyhow!("the receipt does not build: {e}"))?
                .formatted();
            // lettre writes the body, then CRLF . CRLF; no line of it starts with '.'.
            let body = String::from_utf8(body)?;
            ensure!(!body.contains("\n."), "the receipt would need dot-stuffing");
            format!("{body}\r\n.\r\n")
        }
    };
    Ok((rcpt, data))
}

/// The sink's ceiling: `connections` plain SMTP sessions, each sending its
/// share of `n` one-recipient messages of `shape` back to back, every reply
/// awaited. The messages are built before the clock starts.
async fn minimal_client(port: u16, n: usize, connections: usize, shape: Shape) -> Result<f64> {
    let mut shares = Vec::new();
    for c in 0..connections {
        let share = n / connections + usize::from(c < n % connections);
        shares.push(
            (0..share)
                .map(|i| wire_message(shape, c, i))
                .collect::<Result<Vec<_>>>()?,
        );
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for messages in shares {
        tasks.push(tokio::spawn(async move {
            let stream = TcpStream::connect(("127.0.0.1", port)).await?;
            stream.set_nodelay(true)?;
            let (r, mut w) = stream.into_split();
            let mut r = BufReader::new(r);
            reply(&mut r).await?;
            w.write_all(b"EHLO bench\r\n").await?;
            reply(&mut r).await?;
            for (rcpt, data) in messages {
                for cmd in [
                    "MAIL FROM:<billing@example.com>\r\n".to_owned(),
                    format!("RCPT TO:<{rcpt}>\r\n"),
                    "DATA\r\n".to_owned(),
                    data,
                ] {
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

fn write_report(report: &Value, out_dir: Option<std::path::PathBuf>) -> Result<()> {
    let dir = benches::report_dir(out_dir)?;
    std::fs::write(
        dir.join("email.json"),
        serde_json::to_string_pretty(report)? + "\n",
    )
    .context("write email.json")?;
    let mut table = String::from(
        "| sink | email_outbox role, emails/s (median) | sink ceiling, minimal client, the role's messages, emails/s | ratio | minimal client, one-part notes, emails/s | peak SMTP connections (bound) |\n|---|---|---|---|---|---|\n",
    );
    let bound = &report["settings"]["max_connections"];
    for s in report["sinks"].as_array().into_iter().flatten() {
        table.push_str(&format!(
            "| {} | {:.0} | {:.0} | {:.2} | {:.0} | {} ({bound}) |\n",
            s["sink"].as_str().unwrap_or("?"),
            s["role_emails_per_s_median"].as_f64().unwrap_or(0.0),
            s["ceiling_emails_per_s_median"].as_f64().unwrap_or(0.0),
            s["ratio_to_ceiling"].as_f64().unwrap_or(0.0),
            s["ceiling_one_part_notes_per_s_median"]
                .as_f64()
                .unwrap_or(0.0),
            s["peak_smtp_connections"],
        ));
    }
    let generated = format!("{table}\n{}", benches::machine_and_settings(report),);
    // The hand-written methodology above the markers stays; only the results change.
    benches::write_generated(&dir, "email.md", &generated)?;
    progress(&format!("wrote {}/email.{{md,json}}", dir.display()));
    Ok(())
}
