//! A throwaway Postgres 15 of a test's own that speaks TLS only, with a
//! server certificate from a [`TestCa`]: `ssl=on`, and `pg_hba.conf` lets TCP
//! clients in through `hostssl` lines alone, so a plaintext connection is
//! refused by the server. It listens on 127.0.0.1 (the certificate's address,
//! and `localhost`) and 127.0.0.2 (a name the certificate does not hold).
//! Started as the `postgres` OS user when the tests run as root, as
//! `scripts/bed` starts the bed's cluster; stopped and removed on drop.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{TestCa, free_port};

const PGBIN: &str = "/usr/lib/postgresql/15/bin";

/// The server; `pg_ctl stop` and its directory removed on drop.
pub struct TlsPostgres {
    dir: PathBuf,
    pub port: u16,
}

impl TlsPostgres {
    /// initdb, then start with `ca`'s server certificate (about 1 s).
    pub fn start(ca: &TestCa) -> TlsPostgres {
        let dir = std::env::temp_dir().join(format!(
            "hardcount-tls-pg-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).expect("create the TLS server's directory");
        // The server runs as `postgres`, which must traverse it.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
            .expect("chmod the TLS server's directory");
        let server = TlsPostgres {
            dir,
            port: free_port(),
        };
        chown_to_postgres(&server.dir);
        let data = server.data();
        as_postgres(
            Command::new(format!("{PGBIN}/initdb"))
                .arg("-D")
                .arg(&data)
                .args(["-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"]),
        );
        std::fs::copy(&ca.server_cert, data.join("server.crt")).expect("copy server.crt");
        std::fs::copy(&ca.server_key, data.join("server.key")).expect("copy server.key");
        // Postgres refuses a key that others can read.
        std::fs::set_permissions(
            data.join("server.key"),
            std::fs::Permissions::from_mode(0o600),
        )
        .expect("chmod server.key");
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\n\
             hostssl all all 127.0.0.0/8 trust\n\
             hostssl all all ::1/128 trust\n",
        )
        .expect("write pg_hba.conf");
        chown_to_postgres(&data);
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1,127.0.0.2 -c ssl=on \
             -c ssl_cert_file=server.crt -c ssl_key_file=server.key \
             -c fsync=off -c synchronous_commit=off -c full_page_writes=off",
            server.port,
            server.dir.display()
        );
        let started = run_as_postgres(
            Command::new(format!("{PGBIN}/pg_ctl"))
                .arg("-D")
                .arg(&data)
                .arg("-l")
                .arg(server.dir.join("pg.log"))
                .args(["-w", "-t", "30", "start", "-o", &options]),
        );
        assert!(
            started.status.success(),
            "the TLS server did not start: {}",
            std::fs::read_to_string(server.dir.join("pg.log")).unwrap_or_default()
        );
        server
    }

    /// `postgres://postgres:<password>@<host>:<port>/postgres?<query>`. The
    /// server trusts every client: the password is there for tests to check
    /// that no error shows it.
    pub fn url(&self, host: &str, query: &str) -> String {
        format!(
            "postgres://postgres:{PASSWORD}@{host}:{}/postgres?{query}",
            self.port
        )
    }

    fn data(&self) -> PathBuf {
        self.dir.join("pg")
    }
}

/// The password [`TlsPostgres::url`] carries (the server ignores it).
pub const PASSWORD: &str = "hunter2";

impl Drop for TlsPostgres {
    fn drop(&mut self) {
        let _ = run_as_postgres(
            Command::new(format!("{PGBIN}/pg_ctl"))
                .arg("-D")
                .arg(self.data())
                .args(["-m", "immediate", "stop"]),
        );
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn is_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// `initdb` and `pg_ctl` refuse root: run them as `postgres` then.
fn run_as_postgres(cmd: &mut Command) -> std::process::Output {
    let cmd = if is_root() {
        let mut wrapped = Command::new("runuser");
        wrapped
            .args(["-u", "postgres", "--"])
            .arg(cmd.get_program());
        wrapped.args(cmd.get_args());
        wrapped.output()
    } else {
        cmd.output()
    };
    cmd.expect("run a Postgres 15 binary (apt-get install postgresql-15)")
}

fn as_postgres(cmd: &mut Command) {
    let out = run_as_postgres(cmd);
    assert!(
        out.status.success(),
        "{:?} failed: {}{}",
        cmd.get_program(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn chown_to_postgres(path: &Path) {
    if is_root() {
        let status = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(path)
            .status()
            .expect("run chown");
        assert!(status.success(), "chown postgres {}", path.display());
    }
}
