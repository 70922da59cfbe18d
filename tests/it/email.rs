//! The email outbox across a SIGKILL: real `hardcount serve` processes sending to
//! the bed's SMTP sink.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sqlx::Executor as _;
use testbed::{Leg, SmtpSink, TestDb};

use crate::serve::Serve;

const EMAILS: usize = 300;

/// Replica A sends a queue of emails and is killed with SIGKILL mid-batch;
/// replica B, already running, takes the role over once A's lease expires.
/// A's claims come due when their claim lease ends (forced here rather than
/// waited for). Every email reaches the sink at least once; the duplicates
/// are counted and are at most the batch A had claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_email_is_sent_at_least_once_across_a_sigkill() {
    let t = TestDb::new().await;
    let sink = SmtpSink::start();
    let mut tx = t.db.begin().await.unwrap();
    for i in 0..EMAILS {
        let email = email_outbox::Email {
            from: "Billing <billing@example.com>".into(),
            to: vec![format!("c{i}@example.org")],
            subject: format!("Receipt {i}"),
            text: format!("Paid invoice {i}"),
            html: None,
        };
        email_outbox::enqueue(&mut tx, "tenant_a", &email)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();

    let url = t.app_url(Leg::current());
    let smtp = sink.url();
    let env = [
        ("HARDCOUNT_ROLES", "email_outbox"),
        ("SMTP_URL", smtp.as_str()),
        ("HARDCOUNT_EMAIL_CONNECTIONS", "2"),
    ];
    let mut a = Serve::start(&url, &env).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while sink.messages().len() < 10 {
        assert!(Instant::now() < deadline, "A sent nothing");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b = Serve::start(&url, &env).await;
    a.signal("KILL");
    assert_eq!(
        a.wait(Duration::from_secs(10)).await,
        None,
        "killed, no exit code"
    );
    let at_kill = sink.messages().len();

    // A's claims: the lease would end on its own; end it now.
    let mut su = t.superuser().await;
    su.execute("UPDATE email_outbox SET next_attempt_at = now() WHERE status = 'queued'")
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let queued: i64 =
            sqlx::query_scalar("SELECT count(*) FROM email_outbox WHERE status <> 'sent'")
                .fetch_one(&mut su)
                .await
                .unwrap();
        if queued == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{queued} emails never sent after the kill"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(b);

    let mut copies: HashMap<String, usize> = HashMap::new();
    for m in sink.messages() {
        let subject = m
            .lines()
            .find_map(|l| l.strip_prefix("Subject: "))
            .unwrap_or("")
            .to_owned();
        *copies.entry(subject).or_default() += 1;
    }
    let missing: Vec<usize> = (0..EMAILS)
        .filter(|i| !copies.contains_key(&format!("Receipt {i}")))
        .collect();
    assert!(missing.is_empty(), "never received: {missing:?}");
    let duplicates: usize = copies.values().map(|n| n - 1).sum();
    println!("{at_kill} messages before the kill; {duplicates} duplicates of {EMAILS} emails");
    assert!(
        duplicates <= 100,
        "duplicates bounded by A's claimed batch: {duplicates}"
    );
}
