//! A real SMTP server on loopback: Debian's aiosmtpd running `sink/smtp_sink.py`,
//! keeping messages as maildir files. Tests steer it through recipients
//! (`reject…@` gets 550, `defer…@` gets 451 once), can stop and restart it on
//! the same port, and can give it a certificate for STARTTLS ([`TestCa`]).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/sink/smtp_sink.py");

/// An aiosmtpd process on 127.0.0.1 and a free port; killed on drop.
pub struct SmtpSink {
    pub port: u16,
    maildir: PathBuf,
    tls: Option<(PathBuf, PathBuf)>,
    child: Option<Child>,
}

impl SmtpSink {
    /// A plain sink (no TLS).
    pub fn start() -> SmtpSink {
        SmtpSink::launch(None)
    }

    /// A sink that offers STARTTLS with `ca`'s server certificate and requires it.
    pub fn start_tls(ca: &TestCa) -> SmtpSink {
        SmtpSink::launch(Some((ca.server_cert.clone(), ca.server_key.clone())))
    }

    /// A plain sink keeping its maildir under `parent` (a benchmark puts it
    /// on tmpfs, so that the filesystem's cost of a new file does not move
    /// the sink's pace from one run to the next).
    pub fn start_in(parent: &Path) -> SmtpSink {
        SmtpSink::launch_in(parent, None)
    }

    fn launch(tls: Option<(PathBuf, PathBuf)>) -> SmtpSink {
        SmtpSink::launch_in(&std::env::temp_dir(), tls)
    }

    fn launch_in(parent: &Path, tls: Option<(PathBuf, PathBuf)>) -> SmtpSink {
        let port = free_port();
        let maildir = parent.join(format!("hardcount-smtp-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&maildir).expect("create maildir");
        let mut sink = SmtpSink {
            port,
            maildir,
            tls,
            child: None,
        };
        sink.restart();
        sink
    }

    /// `smtp://127.0.0.1:PORT`, with `?tls=required` for a TLS sink.
    pub fn url(&self) -> String {
        match self.tls {
            Some(_) => format!("smtp://127.0.0.1:{}?tls=required", self.port),
            None => format!("smtp://127.0.0.1:{}", self.port),
        }
    }

    /// The server's process id while it runs (benchmarks read its CPU time).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stop the server; its port then refuses connections. Messages stay.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Start the server again on the same port (after [`stop`](Self::stop)).
    pub fn restart(&mut self) {
        self.stop();
        // The first python3 on PATH may be another interpreter without aiosmtpd.
        let mut cmd = Command::new("/usr/bin/python3");
        cmd.arg(SCRIPT)
            .arg(self.port.to_string())
            .arg(&self.maildir);
        if let Some((cert, key)) = &self.tls {
            cmd.arg("--tls-cert").arg(cert).arg("--tls-key").arg(key);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start aiosmtpd (apt-get install python3-aiosmtpd)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "aiosmtpd did not listen on {} within 10 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The raw messages received so far.
    pub fn messages(&self) -> Vec<String> {
        let mut out = Vec::new();
        for sub in ["new", "cur"] {
            if let Ok(entries) = std::fs::read_dir(self.maildir.join(sub)) {
                for e in entries.flatten() {
                    if let Ok(text) = std::fs::read_to_string(e.path()) {
                        out.push(text);
                    }
                }
            }
        }
        out
    }
}

impl Drop for SmtpSink {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.maildir);
    }
}

/// A throwaway certificate authority and a server certificate it signed for
/// `127.0.0.1` and `localhost`, made with the `openssl` command. Removed on drop.
pub struct TestCa {
    dir: PathBuf,
    pub ca_cert: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
}

impl TestCa {
    pub fn new() -> TestCa {
        let dir = std::env::temp_dir().join(format!(
            "hardcount-ca-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).expect("create CA dir");
        let ca = TestCa {
            ca_cert: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            dir,
        };
        let d = &ca.dir;
        openssl(
            d,
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-subj",
                "/CN=hardcount test CA",
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
            ],
        );
        openssl(
            d,
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                "/CN=127.0.0.1",
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
            ],
        );
        std::fs::write(
            d.join("ext.cnf"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n",
        )
        .expect("write ext.cnf");
        openssl(
            d,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                "ext.cnf",
                "-out",
                "server.pem",
            ],
        );
        ca
    }

    /// The CA's certificate, PEM.
    pub fn ca_pem(&self) -> Vec<u8> {
        std::fs::read(&self.ca_cert).expect("read ca.pem")
    }
}

impl Default for TestCa {
    fn default() -> TestCa {
        TestCa::new()
    }
}

impl Drop for TestCa {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl (apt-get install openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A minimal SMTP server in this process: every command accepted, each reply
/// (the greeting aside) sent `reply_after` after its command, the message
/// dropped. The email benchmark uses it with no wait to show the role's own
/// ceiling; a test gives it a wait to play a slow server.
pub struct MinimalSink {
    pub port: u16,
    connections: Arc<Connections>,
}

/// The sink's open sessions, and the most open at once since last asked.
#[derive(Default)]
struct Connections {
    open: AtomicUsize,
    peak: AtomicUsize,
}

/// One accepted session, counted open until it is dropped.
struct Session(Arc<Connections>);

impl Session {
    fn open(c: &Arc<Connections>) -> Session {
        let now = c.open.fetch_add(1, Ordering::SeqCst) + 1;
        c.peak.fetch_max(now, Ordering::SeqCst);
        Session(c.clone())
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

impl MinimalSink {
    /// # Panics
    /// When no loopback port can be bound.
    pub async fn start(reply_after: Duration) -> MinimalSink {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let port = listener.local_addr().expect("a bound address").port();
        let connections = Arc::new(Connections::default());
        let counted = connections.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let session = Session::open(&counted);
                tokio::spawn(async move {
                    let _ = minimal_session(stream, reply_after).await;
                    drop(session);
                });
            }
        });
        MinimalSink { port, connections }
    }

    /// The most sessions this sink had open at once since the last call (or
    /// its start), counted as it accepts and ends them; the count starts
    /// again from those open now.
    pub fn take_peak(&self) -> usize {
        let c = &self.connections;
        c.peak.swap(c.open.load(Ordering::SeqCst), Ordering::SeqCst)
    }

    /// Sessions open now.
    pub fn open_sessions(&self) -> usize {
        self.connections.open.load(Ordering::SeqCst)
    }

    /// `smtp://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("smtp://127.0.0.1:{}", self.port)
    }
}

async fn minimal_session(stream: tokio::net::TcpStream, wait: Duration) -> std::io::Result<()> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let pause = || async move {
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    };
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r);
    w.write_all(b"220 minimal sink\r\n").await?;
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).await? == 0 {
            return Ok(());
        }
        let verb = line.get(..4).unwrap_or("").to_ascii_uppercase();
        pause().await;
        match verb.as_str() {
            "EHLO" => w.write_all(b"250-minimal sink\r\n250 8BITMIME\r\n").await?,
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
                pause().await;
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
