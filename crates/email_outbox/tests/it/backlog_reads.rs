//! A tick ends with the backlog gauges' read at most once per
//! `backlog_read_every` (docs/adr/0138): the read counts every queued email,
//! and the role ticks every second.

use std::time::Duration;

use email_outbox::SenderConfig;
use metrics_exporter_prometheus::PrometheusHandle;
use testbed::{SmtpSink, TestDb};

use crate::{config, queue_numbered, sender, tick};

/// Queue `n` emails that are not due for an hour: a tick sends none of them,
/// so what the gauge says is only what the read saw.
async fn queue_later(t: &TestDb, prefix: &str, n: usize) {
    use sqlx::Executor as _;
    queue_numbered(&t.db, "tenant_a", prefix, n).await;
    t.superuser()
        .await
        .execute("UPDATE email_outbox SET next_attempt_at = now() + interval '1 hour'")
        .await
        .unwrap();
}

fn gauge(handle: &PrometheusHandle, line: &str) -> Option<String> {
    handle
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(line).map(|v| v.trim().to_owned()))
}

fn queued(handle: &PrometheusHandle) -> Option<String> {
    gauge(handle, "hardcount_emails_queued ")
}

fn stamp(handle: &PrometheusHandle) -> Option<String> {
    gauge(
        handle,
        "hardcount_backlog_read_timestamp_seconds{role=\"email_outbox\"} ",
    )
}

/// Pins the gate: with the check in `scheduler::Every::due_at` taken
/// out (mutation `backlog_read_every_tick`), or the email tick's end reading
/// without asking it (mutation `email_backlog_read_ungated`), the second tick
/// reads 5 and stamps again, and this fails.
#[tokio::test]
async fn a_tick_within_the_interval_leaves_the_last_read_standing() {
    let t = TestDb::new().await;
    let sink = SmtpSink::start();
    queue_later(&t, "a", 2).await;
    let hourly = SenderConfig {
        backlog_read_every: Duration::from_secs(3600),
        ..config()
    };
    let (s, handle) = sender(&t.db, &sink.url(), None, hourly);
    let _ = tick(&t.db, &s).await;
    assert_eq!(queued(&handle).as_deref(), Some("2"));
    let first = stamp(&handle).expect("the first tick reads and stamps");

    queue_later(&t, "b", 3).await;
    let _ = tick(&t.db, &s).await;
    assert_eq!(
        queued(&handle).as_deref(),
        Some("2"),
        "a tick within the interval does not read again"
    );
    assert_eq!(stamp(&handle), Some(first));
    assert!(sink.messages().is_empty());
}

#[tokio::test]
async fn zero_reads_at_every_tick() {
    let t = TestDb::new().await;
    let sink = SmtpSink::start();
    queue_later(&t, "a", 2).await;
    let every_tick = SenderConfig {
        backlog_read_every: Duration::ZERO,
        ..config()
    };
    let (s, handle) = sender(&t.db, &sink.url(), None, every_tick);
    let _ = tick(&t.db, &s).await;
    assert_eq!(queued(&handle).as_deref(), Some("2"));
    queue_later(&t, "b", 3).await;
    let _ = tick(&t.db, &s).await;
    assert_eq!(queued(&handle).as_deref(), Some("5"));
}
