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

/// `socat` terminating TLS on a free port in front of a plain sink: an
/// implicit-TLS (`smtps://`) server. Killed on drop.
struct TlsFront {
    port: u16,
    child: std::process::Child,
}

impl TlsFront {
    fn start(ca: &TestCa, sink: &SmtpSink) -> TlsFront {
        let port = testbed::free_port();
        let listen = format!(
            "OPENSSL-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork,verify=0,cert={},key={}",
            ca.server_cert.display(),
            ca.server_key.display()
        );
        let child = std::process::Command::new("socat")
            .arg(listen)
            .arg(format!("TCP:127.0.0.1:{}", sink.port))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start socat (apt-get install socat)");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(std::time::Instant::now() < deadline, "socat did not listen");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        TlsFront { port, child }
    }

    fn url(&self) -> String {
        format!("smtps://127.0.0.1:{}", self.port)
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Implicit TLS (`smtps://`, the pool's own TCP connection with TLS made by
/// lettre): delivered with the right CA; with the wrong CA the handshake is
/// refused, the email retried, and nothing reaches the server.
#[tokio::test]
async fn implicit_tls_delivers_with_the_right_ca_and_refuses_the_wrong_one() {
    let t = TestDb::new().await;
    let (ca, other) = (TestCa::new(), TestCa::new());
    let sink = SmtpSink::start();
    let front = TlsFront::start(&ca, &sink);
    queue(&t.db, "tenant_a", &[email("ada@example.org", 1)]).await;
    let (wrong, _) = sender(&t.db, &front.url(), Some(&other.ca_pem()), config());
    let (end, report) = tick(&t.db, &wrong).await;
    assert!(matches!(end, TickEnd::Failed(_)), "{end:?}");
    assert_eq!((report.tally.sent, report.tally.retried), (0, 1));
    assert!(sink.messages().is_empty(), "nothing sent without TLS");
    let (right, _) = sender(&t.db, &front.url(), Some(&ca.ca_pem()), config());
    crate::make_due(&t).await;
    let (end, report) = tick(&t.db, &right).await;
    assert_eq!((end, report.tally.sent), (TickEnd::Drained, 1));
    assert_eq!(sink.messages().len(), 1);
    assert_eq!(rows(&t.db).await[0].status, "sent");
}
