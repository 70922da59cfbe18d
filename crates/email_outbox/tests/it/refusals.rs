//! A batch that must commit (a settle) with emails the outbox refuses:
//! `enqueue_many_or_record` queues the good ones and records each bad one as
//! failed with its reason, in the producer's transaction (issue 22, point 7).

use std::sync::Arc;

use db::{Row, sql};
use email_outbox::{Email, EnqueueError, Invalid, MAX_BODY_BYTES, enqueue_many_or_record};
use leader::Telemetry;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use testbed::{SmtpSink, TestDb};

use crate::{config, drain, email, sender};

fn telemetry() -> (Telemetry, PrometheusHandle) {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    (Telemetry::new(Arc::new(recorder)), handle)
}

/// A refused email as its row holds it.
#[derive(Debug, PartialEq)]
struct Recorded {
    status: String,
    refused: Option<String>,
    attempts: i32,
    recipients: Vec<String>,
    text_body: String,
    reply_text: Option<String>,
}

async fn recorded(t: &TestDb) -> Vec<Recorded> {
    t.db.fetch_all(sql(
        "SELECT status, refused, attempts, recipients, text_body, last_reply_text \
         FROM email_outbox ORDER BY id",
    ))
    .await
    .unwrap()
    .iter()
    .map(|r| Recorded {
        status: r.get("status"),
        refused: r.get("refused"),
        attempts: r.get("attempts"),
        recipients: r.get("recipients"),
        text_body: r.get("text_body"),
        reply_text: r.get("last_reply_text"),
    })
    .collect()
}

/// A settle's batch of three receipts, the middle one to an address lettre
/// refuses: the batch commits, the two good receipts are queued and sent, the
/// bad one is a failed row naming its reason and field, never claimed, and
/// the refusal is counted by reason.
///
/// Catches: the refusal written as an ordinary queued row
/// (`email_refusal_recorded`: the bad receipt is `queued`, then claimed and
/// failed by the sender), and a batch refused whole as `enqueue_many` does.
#[tokio::test]
async fn a_batch_with_one_bad_address_queues_the_others_and_records_the_bad_one_failed() {
    let t = TestDb::new().await;
    let sink = SmtpSink::start();
    let (telemetry, metrics) = telemetry();
    let good_1 = email("ada@example.org", 1);
    let bad = email("ada@@example.org", 2);
    let good_2 = email("bob@example.org", 3);
    let mut tx = t.db.begin().await.unwrap();
    let done = enqueue_many_or_record(
        &mut tx,
        &[
            ("tenant_a", &good_1),
            ("tenant_a", &bad),
            ("tenant_b", &good_2),
        ],
        &telemetry,
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(done.queued, 2);
    assert_eq!(done.refused.len(), 1);
    assert_eq!(done.refused[0].0, 1);
    assert_eq!(done.refused[0].1.reason(), "recipient");

    let rows = recorded(&t).await;
    assert_eq!(rows.len(), 3);
    assert_eq!(
        rows.iter().map(|r| r.status.as_str()).collect::<Vec<_>>(),
        ["queued", "failed", "queued"]
    );
    let r = &rows[1];
    assert_eq!(r.refused.as_deref(), Some("recipient"));
    assert_eq!(r.attempts, 0);
    assert_eq!(r.recipients, ["ada@@example.org"]);
    assert_eq!(r.text_body, "", "a refusal keeps no body");
    let why = r.reply_text.as_deref().unwrap();
    assert!(why.contains("email field `to` is not a mailbox"), "{why}");

    let (s, _) = sender(&t.db, &sink.url(), None, config());
    drain(&t, &s, 5).await;
    let rows = recorded(&t).await;
    assert_eq!(
        rows.iter()
            .map(|r| (r.status.as_str(), r.attempts))
            .collect::<Vec<_>>(),
        [("sent", 1), ("failed", 0), ("sent", 1)],
        "the refusal is never claimed"
    );
    assert_eq!(sink.messages().len(), 2);
    let text = metrics.render();
    assert!(
        text.contains("hardcount_email_refused_total{reason=\"recipient\"} 1"),
        "{text}"
    );
}

/// Whatever `enqueue` refuses for content is recordable: a sender lettre
/// cannot parse, no recipients, too many, a header injection, an empty or
/// over-long subject, a body too large, a NUL in a body or the subject. All
/// are written in one committed statement, each with its reason.
#[tokio::test]
async fn every_content_refusal_is_recorded_with_its_reason_and_the_batch_commits() {
    let t = TestDb::new().await;
    let (telemetry, metrics) = telemetry();
    type Mutate = fn(&mut Email);
    let cases: Vec<(Mutate, &str)> = vec![
        (|e| e.from = "Billing <billing@>".into(), "sender"),
        (
            |e| e.from = "billing@example.com\r\nBcc: eve@example.org".into(),
            "header",
        ),
        (|e| e.to.clear(), "recipients"),
        (|e| e.to = vec!["x@example.org".into(); 51], "recipients"),
        (
            |e| e.to = vec!["\"john doe\"@example.org".into()],
            "recipient",
        ),
        (|e| e.subject = " ".into(), "subject"),
        (|e| e.subject = "s".repeat(999), "subject"),
        (|e| e.text = "x".repeat(MAX_BODY_BYTES + 1), "too_large"),
        (|e| e.html = Some("a\0b".into()), "nul"),
        (|e| e.subject = "a\0b".into(), "nul"),
        (|e| e.to = vec!["ada\0@example.org".into()], "nul"),
    ];
    let emails: Vec<Email> = cases
        .iter()
        .map(|(mutate, _)| {
            let mut e = email("ada@example.org", 1);
            mutate(&mut e);
            e
        })
        .collect();
    let batch: Vec<(&str, &Email)> = emails.iter().map(|e| ("tenant_a", e)).collect();
    let mut tx = t.db.begin().await.unwrap();
    let done = enqueue_many_or_record(&mut tx, &batch, &telemetry)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(done.queued, 0);
    let want: Vec<&str> = cases.iter().map(|(_, reason)| *reason).collect();
    let got: Vec<&str> = done.refused.iter().map(|(_, why)| why.reason()).collect();
    assert_eq!(got, want);
    let rows = recorded(&t).await;
    assert_eq!(
        rows.iter()
            .map(|r| r.refused.as_deref().unwrap())
            .collect::<Vec<_>>(),
        want
    );
    assert!(rows.iter().all(|r| r.status == "failed" && r.attempts == 0));
    assert!(rows[3].recipients.len() == 50, "at most 50 recipients kept");
    assert_eq!(
        rows[10].recipients,
        ["ada\u{fffd}@example.org"],
        "NUL replaced"
    );
    let text = metrics.render();
    assert!(
        text.contains("hardcount_email_refused_total{reason=\"recipients\"} 2"),
        "{text}"
    );
}

/// An empty tenant is the caller's bug, not content: refused before anything
/// is written, the transaction still usable. A database error (here: the API
/// role acting for no tenant, whose row row-level security refuses) still
/// fails the call.
#[tokio::test]
async fn an_empty_tenant_and_a_database_error_still_fail() {
    let t = TestDb::new().await;
    let (telemetry, _) = telemetry();
    let e = email("ada@example.org", 1);
    let mut tx = t.db.begin().await.unwrap();
    let err = enqueue_many_or_record(&mut tx, &[(" ", &e)], &telemetry)
        .await
        .unwrap_err();
    assert!(
        matches!(err, EnqueueError::Invalid(Invalid::EmptyTenant)),
        "{err}"
    );
    let n: i64 = tx
        .fetch_one(sql("SELECT count(*) AS n FROM email_outbox"))
        .await
        .unwrap()
        .get("n");
    assert_eq!(n, 0);
    tx.commit().await.unwrap();

    let api = t.api();
    let mut tx = api.begin().await.unwrap();
    let err = enqueue_many_or_record(&mut tx, &[("tenant_a", &e)], &telemetry)
        .await
        .unwrap_err();
    assert!(matches!(err, EnqueueError::Db(_)), "{err}");
}
