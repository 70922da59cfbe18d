//! Sending: what arrives, what the server's replies do, a dead server, bad input.

use email_outbox::{EnqueueError, enqueue};
use leader::TickEnd;
use testbed::{SmtpSink, TestDb};

use crate::{config, drain, email, make_due, queue, queue_numbered, rows, sender, tick};

#[tokio::test]
async fn a_queued_email_arrives_with_its_parts_and_its_message_id() {
    let t = TestDb::new().await;
    let sink = SmtpSink::start();
    queue(&t.db, "tenant_a", &[email("ada@example.org", 1)]).await;
    let (s, handle) = sender(&t.db, &sink.url(), None, config());
    let (end, report) = tick(&t.db, &s).await;
    assert_eq!(end, TickEnd::Drained);
    assert_eq!(
        (report.claimed, report.tally.sent),
        (1, 1),
        "{report:?} {:?}",
        rows(&t.db).await
    );
    let row = &rows(&t.db).await[0];
    assert_eq!(
        (row.status.as_str(), row.attempts, row.reply_code),
        ("sent", 1, Some(250))
    );
    let got = sink.messages();
    assert_eq!(got.len(), 1);
    let m = &got[0];
    for part in [
        "From: \"Example Billing\" <billing@example.com>",
        "To: ada@example.org",
        "Subject: Receipt 1",
        &format!("Message-ID: {}", row.message_id),
        "Content-Type: text/plain",
        "Content-Type: text/html",
        "Paid invoice 1: 12.00 EUR",
        "<b>12.00 EUR</b>",
    ] {
        assert!(m.contains(part), "{part:?} missing from\n{m}");
    }
    let text = handle.render();
    assert!(
        text.contains("hardcount_emails_total{outcome=\"sent\",smtp_class=\"2xx\"} 1"),
        "{text}"
    );
    assert!(text.contains("hardcount_emails_queued 0"), "{text}");
}

#[tokio::test]
async fn a_451_is_retried_and_delivered_and_a_550_fails_at_once_with_its_reply() {
    let t = TestDb::new().await;
    let sink = SmtpSink::start();
    let ids = queue(
        &t.db,
        "tenant_a",
        &[
            email("defer-ada@example.org", 1),
            email("reject-bob@example.org", 2),
        ],
    )
    .await;
    let (s, handle) = sender(&t.db, &sink.url(), None, config());
    let (_, first) = tick(&t.db, &s).await;
    assert_eq!(
        (first.tally.retried, first.tally.failed, first.tally.sent),
        (1, 1, 0)
    );
    let r = rows(&t.db).await;
    assert_eq!(
        (r[0].id, r[0].status.as_str(), r[0].reply_code),
        (ids[0], "queued", Some(451))
    );
    assert_eq!(
        (r[1].status.as_str(), r[1].attempts, r[1].reply_code),
        ("failed", 1, Some(550))
    );
    assert!(
        r[1].reply_text
            .as_deref()
            .unwrap_or("")
            .contains("mailbox refused"),
        "{:?}",
        r[1].reply_text
    );
    drain(&t, &s, 5).await;
    let r = rows(&t.db).await;
    assert_eq!((r[0].status.as_str(), r[0].attempts), ("sent", 2));
    assert_eq!(r[1].attempts, 1, "a failed email is not tried again");
    assert_eq!(sink.messages().len(), 1);
    let text = handle.render();
    assert!(
        text.contains("outcome=\"failed\",smtp_class=\"5xx\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("outcome=\"retry\",smtp_class=\"4xx\"} 1"),
        "{text}"
    );
}

/// A server that refuses the session before any message (here a 554
/// greeting; stale credentials get a 535 to AUTH, a relay without STARTTLS a
/// 502, the same way) gave no reply to a message: the batch's first email
/// counts one attempt and stays queued, the rest are handed back, and the
/// tick fails as for a dead server (docs/adr/0079). Before, the 554 was each
/// email's permanent failure, one per connection: every queued email failed
/// for good.
/// Mutation: `session_refusal_permanent` (a refused greeting an SMTP error
/// again) fails the emails; seen failing here.
#[tokio::test]
async fn a_server_refusing_the_session_fails_no_email() {
    let t = TestDb::new().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        while let Ok((mut stream, _)) = listener.accept().await {
            let _ = stream.write_all(b"554 5.3.2 no service here\r\n").await;
        }
    });
    a_refused_session_fails_no_email(&t, port).await;
}

/// A relay that requires AUTH answers MAIL FROM with 530 when it was given
/// none (an SMTP_URL without credentials; one with a user and no password,
/// now refused at start, sent none either): the session's refusal, as a 535
/// to AUTH is, so the batch's first email counts one attempt and stays
/// queued, the rest are handed back and the tick fails (docs/adr/0133).
/// Before, the 530 was each email's permanent failure: one tick failed every
/// queued email for good. Mutation `mail_530_permanent` (the 530 read as
/// before) fails it; seen failing.
#[tokio::test]
async fn a_relay_requiring_auth_fails_no_email() {
    let t = TestDb::new().await;
    let port = crate::scripted_sink_with(
        "250-scripted relay\r\n250 AUTH PLAIN LOGIN\r\n",
        "530 5.7.0 Authentication required\r\n",
        "250 queued\r\n",
    )
    .await;
    a_refused_session_fails_no_email(&t, port).await;
}

/// A resent email gets the whole retry schedule again, as the claim's
/// ceiling counts from the resend and the runbook promises: with two retry
/// delays (three attempts), an email failed after its three attempts and
/// resent by the runbook's statement is retried after a 4xx twice and fails
/// at the third. Before, the schedule was read from the row's attempts since
/// it was queued, so the resent email failed at its first 4xx. Mutation
/// `email_retry_from_resend` (the attempts counted from the start again)
/// fails it; seen failing.
#[tokio::test]
async fn a_resent_email_gets_the_retry_schedule_again() {
    let t = TestDb::new().await;
    let port = crate::scripted_sink("250 scripted sink\r\n", "451 4.7.1 greylisted\r\n").await;
    queue(&t.db, "tenant_a", &[email("ada@example.org", 1)]).await;
    {
        use sqlx::Executor as _;
        let mut su = t.superuser().await;
        su.execute(
            "UPDATE email_outbox SET status = 'failed', attempts = 3, last_attempt_at = now()",
        )
        .await
        .unwrap();
        su.execute(
            "UPDATE email_outbox SET status = 'queued', next_attempt_at = now(), \
             attempts = attempts + 1, resent_at_attempt = attempts + 1 \
             WHERE status = 'failed' AND refused IS NULL",
        )
        .await
        .unwrap();
    }
    let (s, _) = sender(&t.db, &format!("smtp://127.0.0.1:{port}"), None, config());
    let mut seen = Vec::new();
    for _ in 0..3 {
        make_due(&t).await;
        let _ = tick(&t.db, &s).await;
        let r = &rows(&t.db).await[0];
        seen.push((r.status.clone(), r.attempts));
    }
    let at = |status: &str, attempts| (status.to_owned(), attempts);
    assert_eq!(seen, [at("queued", 5), at("queued", 6), at("failed", 7)]);
}

/// The sink stops while ten emails are queued. The tick that meets the dead
/// server makes one connection attempt (the first email, which counts as a
/// failed attempt), hands the other nine back unattempted and ends as failed
/// (the short cooldown). After a restart every email is delivered; none is lost.
#[tokio::test]
async fn a_dead_server_costs_one_connection_and_loses_nothing() {
    let t = TestDb::new().await;
    let mut sink = SmtpSink::start();
    queue_numbered(&t.db, "tenant_a", "c", 10).await;
    sink.stop();
    // Batches of 4: the first batch's first send gets no reply, and no second
    // batch is claimed or attempted, though batches are sent two at a time
    // (docs/adr/0068). Seen failing under mutation `email_dead_probe` (the
    // unanswered batch not waited for): a second batch was claimed and its
    // first email attempted too.
    let mut c = config();
    c.batch_size = 4;
    let (s, _) = sender(&t.db, &sink.url(), None, c);
    let (end, report) = tick(&t.db, &s).await;
    assert!(matches!(end, TickEnd::Failed(_)), "{end:?}");
    assert_eq!(
        (
            report.claimed,
            report.tally.unreachable,
            report.tally.retried,
            report.tally.handed_back
        ),
        (4, 1, 1, 3)
    );
    let attempts: Vec<i32> = rows(&t.db).await.iter().map(|r| r.attempts).collect();
    assert_eq!(attempts, [1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    sink.restart();
    drain(&t, &s, 5).await;
    assert!(rows(&t.db).await.iter().all(|r| r.status == "sent"));
    assert_eq!(sink.messages().len(), 10);
    make_due(&t).await;
}

#[tokio::test]
async fn an_enqueue_whose_producer_rolls_back_leaves_nothing_queued() {
    let t = TestDb::new().await;
    let mut tx = t.db.begin().await.unwrap();
    enqueue(&mut tx, "tenant_a", &email("ada@example.org", 1))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert!(rows(&t.db).await.is_empty());
}

/// Bad input is refused before anything is sent, naming the field, and the
/// producer's transaction stays usable.
#[tokio::test]
async fn bad_input_is_refused_by_field_and_the_transaction_goes_on() {
    let t = TestDb::new().await;
    let mut tx = t.db.begin().await.unwrap();
    let mut bad = email("ada@example.org", 1);
    bad.subject = "Receipt\r\nBcc: everyone@example.org".into();
    let err = enqueue(&mut tx, "tenant_a", &bad).await.unwrap_err();
    assert!(matches!(err, EnqueueError::Invalid(_)));
    assert!(
        err.to_string().contains("`subject` contains a CR or LF"),
        "{err}"
    );
    let mut bad = email("ada@example", 1);
    bad.to = vec!["not-an-address".into()];
    let err = enqueue(&mut tx, "tenant_a", &bad)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`to`") && err.contains("not-an-address"),
        "{err}"
    );
    let err = enqueue(&mut tx, "", &email("ada@example.org", 1))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("tenant_id"), "{err}");
    enqueue(&mut tx, "tenant_a", &email("ada@example.org", 2))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(rows(&t.db).await.len(), 1);
}

/// Batches in flight (docs/adr/0068): the next batch is claimed and starts
/// sending while the last sends of one are still out. The sink holds its
/// reply to the last email of the first batch until the first email of the
/// second batch reaches it, so a tick that waited for a whole batch before
/// claiming the next would wait on that reply until the send timeout, and
/// the held email would end without a reply. Seen failing under mutation
/// `email_in_flight` (one batch at a time): the held email got no reply and
/// the tick failed as unreachable.
#[tokio::test]
async fn the_next_batch_sends_while_the_last_sends_of_one_are_out() {
    let t = TestDb::new().await;
    let port = holding_sink("c3@example.org", "c4@example.org").await;
    queue_numbered(&t.db, "tenant_a", "c", 8).await;
    let mut c = config();
    c.batch_size = 4;
    c.max_connections = 4;
    c.send_timeout = std::time::Duration::from_secs(2);
    let (s, _) = sender(&t.db, &format!("smtp://127.0.0.1:{port}"), None, c);
    let (end, report) = tick(&t.db, &s).await;
    assert_eq!(
        (
            &end,
            report.batches,
            report.tally.sent,
            report.tally.unreachable
        ),
        (&TickEnd::Drained, 2, 8, 0),
        "{report:?}"
    );
    assert!(rows(&t.db).await.iter().all(|r| r.status == "sent"));
}

/// A loopback SMTP server that accepts everything, except that it answers
/// the end of `hold`'s message only once a `RCPT` for `until` has arrived on
/// any connection (or after 10 s, so a failing test does not hang).
async fn holding_sink(hold: &'static str, until: &'static str) -> u16 {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (seen, _) = tokio::sync::watch::channel(false);
    let seen = std::sync::Arc::new(seen);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let (r, mut w) = stream.into_split();
                let mut r = BufReader::new(r);
                w.write_all(b"220 holding sink\r\n").await?;
                let (mut line, mut rcpt) = (String::new(), String::new());
                loop {
                    line.clear();
                    if r.read_line(&mut line).await? == 0 {
                        return std::io::Result::Ok(());
                    }
                    let verb = line.get(..4).unwrap_or("").to_ascii_uppercase();
                    let answer: &[u8] = match verb.as_str() {
                        "RCPT" => {
                            rcpt = line.clone();
                            if line.contains(until) {
                                seen.send_replace(true);
                            }
                            b"250 ok\r\n"
                        }
                        "DATA" => {
                            crate::take_message(&mut r, &mut w).await?;
                            if rcpt.contains(hold) {
                                let mut rx = seen.subscribe();
                                let _ = tokio::time::timeout(
                                    std::time::Duration::from_secs(10),
                                    rx.wait_for(|s| *s),
                                )
                                .await;
                            }
                            b"250 queued\r\n"
                        }
                        "QUIT" => {
                            w.write_all(b"221 bye\r\n").await?;
                            return Ok(());
                        }
                        _ => b"250 ok\r\n",
                    };
                    w.write_all(answer).await?;
                }
            });
        }
    });
    port
}

/// An address the server cannot take (it needs SMTPUTF8, which the server
/// does not offer, so lettre refuses before a command goes out) is that
/// email's permanent failure; the rest of its batch is sent and the tick does
/// not fail. Before, the refusal was "no reply": the batch was handed back as
/// for a dead server and the tick failed, every time that email came due.
/// Mutation `email_client_refusal_down` (the arm removed) fails it; seen
/// failing.
#[tokio::test]
async fn an_address_the_server_cannot_take_fails_that_email_and_the_rest_are_sent() {
    let t = TestDb::new().await;
    let port =
        crate::scripted_sink("250-scripted sink\r\n250 8BITMIME\r\n", "250 queued\r\n").await;
    let mut emails = vec![email("jörg@bücher.de", 0)];
    emails.extend((1..4).map(|i| email(&format!("c{i}@example.org"), i)));
    queue(&t.db, "tenant_a", &emails).await;
    let mut c = config();
    c.batch_size = 4;
    let (s, _) = sender(&t.db, &format!("smtp://127.0.0.1:{port}"), None, c);
    let (end, report) = tick(&t.db, &s).await;
    assert!(!matches!(end, TickEnd::Failed(_)), "{end:?}");
    assert_eq!(
        (
            report.tally.unreachable,
            report.tally.failed,
            report.tally.sent
        ),
        (0, 1, 3),
        "{report:?}"
    );
    let r = rows(&t.db).await;
    assert_eq!(
        (r[0].status.as_str(), r[0].attempts),
        ("failed", 1),
        "{r:?}"
    );
    assert!(
        r[0].reply_text
            .as_deref()
            .unwrap_or("")
            .contains("SMTPUTF8"),
        "{:?}",
        r[0].reply_text
    );
    assert!(r[1..].iter().all(|r| r.status == "sent"), "{r:?}");
}

/// A 3xx to the message's end is not a completion (RFC 5321 4.2.5: only a
/// 2xx says the server took the message): the email is retried, not written
/// sent. lettre counts any positive answer as success. Mutation
/// `email_end_reply_any_positive` (every answer accepted) fails it; seen failing.
#[tokio::test]
async fn a_3xx_to_the_end_of_a_message_is_not_a_send() {
    let t = TestDb::new().await;
    let port = crate::scripted_sink("250 scripted sink\r\n", "354 more, please\r\n").await;
    queue(&t.db, "tenant_a", &[email("ada@example.org", 1)]).await;
    let (s, _) = sender(&t.db, &format!("smtp://127.0.0.1:{port}"), None, config());
    let (_, report) = tick(&t.db, &s).await;
    assert_eq!(
        (report.tally.sent, report.tally.retried),
        (0, 1),
        "{report:?}"
    );
    let r = rows(&t.db).await;
    assert_eq!(
        (r[0].status.as_str(), r[0].attempts, r[0].reply_code),
        ("queued", 1, Some(354)),
        "{r:?}"
    );
}

/// Four emails queued and one tick against the SMTP server on `port`, which
/// refuses the session: the batch's first email counts one attempt and stays
/// queued, the rest are handed back, and the tick fails as for a dead server.
async fn a_refused_session_fails_no_email(t: &TestDb, port: u16) {
    queue_numbered(&t.db, "tenant_a", "c", 4).await;
    let mut c = config();
    c.batch_size = 4;
    let (s, _) = sender(&t.db, &format!("smtp://127.0.0.1:{port}"), None, c);
    let (end, report) = tick(&t.db, &s).await;
    assert!(matches!(end, TickEnd::Failed(_)), "{end:?}");
    assert_eq!(report.tally.unreachable, 1, "{report:?}");
    let seen: Vec<(String, i32)> = rows(&t.db)
        .await
        .iter()
        .map(|r| (r.status.clone(), r.attempts))
        .collect();
    let queued = |attempts| ("queued".to_owned(), attempts);
    assert_eq!(seen, [queued(1), queued(0), queued(0), queued(0)]);
}

/// A new sender exports at 0 each outcome and class the email alerts read: a
/// series made at its first send had that send unseen by the alerts'
/// `increase()`, so a new leader's first sends did not hold
/// `HardcountEmailsDelayed` (docs/adr/0141). Mutation
/// `email_outcomes_not_zeroed` fails here.
#[tokio::test]
async fn a_new_sender_exports_the_alerted_outcomes_at_zero() {
    let t = TestDb::new().await;
    let sink = SmtpSink::start();
    let (_, metrics) = sender(&t.db, &sink.url(), None, config());
    let rendered = metrics.render();
    for (outcome, class) in email_outbox::OUTCOMES_ALERTED {
        let line =
            format!("hardcount_emails_total{{outcome=\"{outcome}\",smtp_class=\"{class}\"}} 0");
        assert!(rendered.lines().any(|l| l == line), "{line} in {rendered}");
    }
}
