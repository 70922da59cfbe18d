//! The dev SMTP sink: Debian's aiosmtpd on loopback, keeping each message as a
//! maildir file under the state directory, so a newcomer can read what the
//! email_outbox role sent. Installed through apt when missing (as root).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::postgres::{apt_install, free_port, is_root};

/// The first python3 on PATH may be another interpreter without aiosmtpd.
const PYTHON: &str = "/usr/bin/python3";

pub struct LocalSmtp {
    child: Child,
    port: u16,
    maildir: PathBuf,
}

impl LocalSmtp {
    pub fn start(state_dir: &Path) -> Result<LocalSmtp> {
        if !installed() {
            if !is_root() {
                bail!(
                    "the dev SMTP sink needs aiosmtpd: run `apt-get install python3-aiosmtpd` \
                     as root, or set SMTP_URL"
                );
            }
            apt_install("python3-aiosmtpd")?;
        }
        let maildir = state_dir.join("mail");
        for sub in ["tmp", "new", "cur"] {
            std::fs::create_dir_all(maildir.join(sub))
                .with_context(|| format!("cannot create {}", maildir.display()))?;
        }
        let port = free_port()?;
        let child = Command::new(PYTHON)
            .args(["-m", "aiosmtpd", "-n", "-l", &format!("127.0.0.1:{port}")])
            .args(["-c", "aiosmtpd.handlers.Mailbox"])
            .arg(&maildir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start aiosmtpd")?;
        let sink = LocalSmtp {
            child,
            port,
            maildir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                bail!("aiosmtpd did not listen on 127.0.0.1:{port} within 10 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(sink)
    }

    pub fn url(&self) -> String {
        format!("smtp://127.0.0.1:{}", self.port)
    }

    /// Where each received message lands, one file per message.
    pub fn inbox(&self) -> PathBuf {
        self.maildir.join("new")
    }
}

impl Drop for LocalSmtp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn installed() -> bool {
    Command::new(PYTHON)
        .args(["-c", "import aiosmtpd"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}
