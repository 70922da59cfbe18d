//! A real SMTP server on loopback: Debian's aiosmtpd, keeping messages as maildir files.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// An aiosmtpd process on 127.0.0.1 and a free port; killed on drop.
pub struct SmtpSink {
    pub port: u16,
    maildir: PathBuf,
    child: Child,
}

impl SmtpSink {
    pub fn start() -> SmtpSink {
        let port = free_port();
        let maildir =
            std::env::temp_dir().join(format!("hardcount-smtp-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&maildir).expect("create maildir");
        // The first python3 on PATH may be another interpreter without aiosmtpd.
        let child = Command::new("/usr/bin/python3")
            .args(["-m", "aiosmtpd", "-n", "-l", &format!("127.0.0.1:{port}")])
            .args(["-c", "aiosmtpd.handlers.Mailbox"])
            .arg(&maildir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start aiosmtpd (apt-get install python3-aiosmtpd)");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "aiosmtpd did not listen on {port} within 10 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        SmtpSink {
            port,
            maildir,
            child,
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
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.maildir);
    }
}

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
