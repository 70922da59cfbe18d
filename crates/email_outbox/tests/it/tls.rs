//! STARTTLS against the sink with a certificate from a test CA.

use leader::TickEnd;
use testbed::{SmtpSink, TestCa, TestDb};

use crate::{config, email, queue, rows, sender, tick};

#[tokio::test]
async fn starttls_with_the_right_ca_delivers() {
    let t = TestDb::new().await;
    let ca = TestCa::new();
    let sink = SmtpSink::start_tls(&ca);
    queue(&t.db, "tenant_a", &[email("ada@example.org", 1)]).await;
    let (s, _) = sender(&t.db, &sink.url(), Some(&ca.ca_pem()), config());
    let (end, report) = tick(&t.db, &s).await;
    assert_eq!((end, report.tally.sent), (TickEnd::Drained, 1));
    assert_eq!(sink.messages().len(), 1);
}

/// With a CA that did not sign the server's certificate the handshake is
/// refused: the email is retried later, and nothing is sent in clear.
#[tokio::test]
async fn starttls_with_the_wrong_ca_is_refused_and_never_sent_in_clear() {
    let t = TestDb::new().await;
    let (ca, other) = (TestCa::new(), TestCa::new());
    let sink = SmtpSink::start_tls(&ca);
    queue(&t.db, "tenant_a", &[email("ada@example.org", 1)]).await;
    let (s, _) = sender(&t.db, &sink.url(), Some(&other.ca_pem()), config());
    let (end, report) = tick(&t.db, &s).await;
    assert!(matches!(end, TickEnd::Failed(_)), "{end:?}");
    assert_eq!((report.tally.sent, report.tally.retried), (0, 1));
    let r = &rows(&t.db).await[0];
    assert_eq!((r.status.as_str(), r.reply_code), ("queued", None));
    assert!(
        r.reply_text
            .as_deref()
            .unwrap_or("")
            .contains("certificate"),
        "{:?}",
        r.reply_text
    );
    assert!(sink.messages().is_empty(), "nothing sent in clear");
}
