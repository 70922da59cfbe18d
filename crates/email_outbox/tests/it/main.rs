//! The email outbox against real Postgres (directly and through PgBouncer) and a
//! real SMTP server on loopback (the bed's aiosmtpd sink).
//!
//! Each guard test names, in its comment, the mutation that makes it fail and
//! that it was seen failing under.

mod addresses;
mod backlog_reads;
mod guards;
mod plans;
mod pool;
mod refusals;
mod retention;
mod sending;
mod tenants;
mod tls;

use std::sync::Arc;
use std::time::Duration;

use db::{Db, Row, sql};
use email_outbox::{Email, Sender, SenderConfig, SmtpUrl, TickReport, enqueue};
use leader::{Role, Telemetry, TickEnd};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

pub use testbed::leadership::{as_leader, manager, patient_manager};

/// Fast settings for tests: retries 50 ms apart, three attempts in all.
pub fn config() -> SenderConfig {
    SenderConfig {
        send_timeout: Duration::from_secs(5),
        tick_budget: Duration::from_secs(10),
        retry_delays: vec![Duration::from_millis(50), Duration::from_millis(50)],
        ..SenderConfig::default()
    }
}

pub fn sender(
    db: &Db,
    url: &str,
    ca_pem: Option<&[u8]>,
    config: SenderConfig,
) -> (Sender, PrometheusHandle) {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let url = SmtpUrl::parse(url).unwrap();
    let s = Sender::new(
        db.clone(),
        config,
        &url,
        ca_pem,
        Telemetry::new(Arc::new(recorder)),
    )
    .unwrap();
    (s, handle)
}

pub fn email(to: &str, n: usize) -> Email {
    Email {
        from: "Example Billing <billing@example.com>".into(),
        to: vec![to.into()],
        subject: format!("Receipt {n}"),
        text: format!("Paid invoice {n}: 12.00 EUR"),
        html: Some(format!("<p>Paid invoice {n}: <b>12.00 EUR</b></p>")),
    }
}

/// Queue `n` emails for `tenant`, the `i`th to `{prefix}{i}@example.org`
/// ([`email`]), in one committed transaction.
pub async fn queue_numbered(db: &Db, tenant: &str, prefix: &str, n: usize) -> Vec<i64> {
    let emails: Vec<_> = (0..n)
        .map(|i| email(&format!("{prefix}{i}@example.org"), i))
        .collect();
    queue(db, tenant, &emails).await
}

/// Queue `emails` for `tenant` in one committed transaction.
pub async fn queue(db: &Db, tenant: &str, emails: &[Email]) -> Vec<i64> {
    let mut tx = db.begin().await.unwrap();
    let mut ids = Vec::new();
    for e in emails {
        ids.push(enqueue(&mut tx, tenant, e).await.unwrap());
    }
    tx.commit().await.unwrap();
    ids
}

/// One tick as the leader of `email_outbox`, under a lease that tolerates
/// renewals answered seconds late (`testbed::leadership::patient_timing`).
pub async fn tick(db: &Db, s: &Sender) -> (TickEnd, TickReport) {
    let s = s.clone();
    let report = as_leader(
        &patient_manager(db, "sender"),
        Role::EmailOutbox,
        |tick| async move { s.run_tick(&tick).await },
    )
    .await;
    (report.end.clone(), report)
}

#[derive(Debug, Clone, PartialEq)]
pub struct Row_ {
    pub id: i64,
    pub status: String,
    pub attempts: i32,
    pub reply_code: Option<i32>,
    pub reply_text: Option<String>,
    pub message_id: String,
}

pub async fn rows(db: &Db) -> Vec<Row_> {
    db.fetch_all(sql(
        "SELECT id, status, attempts, last_reply_code, last_reply_text, message_id FROM email_outbox ORDER BY id",
    ))
    .await
    .unwrap()
    .iter()
    .map(|r| Row_ {
        id: r.get("id"),
        status: r.get("status"),
        attempts: r.get("attempts"),
        reply_code: r.get("last_reply_code"),
        reply_text: r.get("last_reply_text"),
        message_id: r.get("message_id"),
    })
    .collect()
}

/// Make every queued email due now (skips a retry's wait).
pub async fn make_due(t: &testbed::TestDb) {
    use sqlx::Executor as _;
    let mut su = t.superuser().await;
    su.execute("UPDATE email_outbox SET next_attempt_at = now() WHERE status = 'queued'")
        .await
        .unwrap();
}

/// Tick until nothing is queued (at most `ticks` ticks).
pub async fn drain(t: &testbed::TestDb, s: &Sender, ticks: usize) {
    for _ in 0..ticks {
        if rows(&t.db).await.iter().all(|r| r.status != "queued") {
            return;
        }
        make_due(t).await;
        let _ = tick(&t.db, s).await;
    }
    panic!("still queued after {ticks} ticks: {:?}", rows(&t.db).await);
}

/// After DATA, in a test's SMTP server: answer 354, then read the message up
/// to its final dot (or the connection's end).
pub async fn take_message(
    r: &mut (impl tokio::io::AsyncBufRead + Unpin),
    w: &mut (impl tokio::io::AsyncWrite + Unpin),
) -> std::io::Result<()> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    w.write_all(b"354 go on\r\n").await?;
    let mut line = String::new();
    while r.read_line(&mut line).await? > 0 && line != ".\r\n" {
        line.clear();
    }
    Ok(())
}

/// A loopback SMTP server that answers EHLO with `ehlo` (its lines, CRLF
/// ended), AUTH with 235, the end of every message with `end_reply` and any
/// other command with 250. Its port.
pub async fn scripted_sink(ehlo: &'static str, end_reply: &'static str) -> u16 {
    scripted_sink_with(ehlo, "250 ok\r\n", end_reply).await
}

/// [`scripted_sink`], answering MAIL FROM with `mail_reply`.
pub async fn scripted_sink_with(
    ehlo: &'static str,
    mail_reply: &'static str,
    end_reply: &'static str,
) -> u16 {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (r, mut w) = stream.into_split();
                let mut r = BufReader::new(r);
                w.write_all(b"220 scripted sink\r\n").await?;
                let mut line = String::new();
                loop {
                    line.clear();
                    if r.read_line(&mut line).await? == 0 {
                        return std::io::Result::Ok(());
                    }
                    let verb = line.get(..4).unwrap_or("").to_ascii_uppercase();
                    let answer: &str = match verb.as_str() {
                        "EHLO" => ehlo,
                        "AUTH" => "235 2.7.0 accepted\r\n",
                        "MAIL" => mail_reply,
                        "DATA" => {
                            take_message(&mut r, &mut w).await?;
                            end_reply
                        }
                        "QUIT" => {
                            w.write_all(b"221 bye\r\n").await?;
                            return Ok(());
                        }
                        _ => "250 ok\r\n",
                    };
                    w.write_all(answer.as_bytes()).await?;
                }
            });
        }
    });
    port
}
