//! A private Postgres 15 cluster and PgBouncer (transaction mode) for the
//! failure harness (docs/adr/0038): the harness restarts them, turns the
//! database read-only and back, which it must not do to the bed every other
//! test shares. The shape of `scripts/bed`'s (trust on loopback, a small
//! server pool per database and user) plus the lease path's alias
//! `hardcount_leases` with a pool of its own, as `deploy/pgbouncer` has it.
//! One database, `hardcount`, migrated. Stopped and removed on drop.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use sqlx::Connection;
use sqlx::postgres::PgConnection;

use crate::free_port;

const PGBIN: &str = "/usr/lib/postgresql/15/bin";
pub const DATABASE: &str = "hardcount";
/// PgBouncer's server pool per (database, user) for the application.
pub const APP_POOL: usize = 8;
/// The lease alias's server pool.
pub const LEASE_POOL: usize = 3;

pub struct Cluster {
    dir: PathBuf,
    pg_port: u16,
    bouncer_port: u16,
}

fn is_root() -> bool {
    // The bed runs as root and starts the servers as the postgres OS user.
    std::env::var("USER").map(|u| u == "root").unwrap_or(false)
        || Command::new("id")
            .arg("-u")
            .output()
            .map(|o| o.stdout.starts_with(b"0"))
            .unwrap_or(false)
}

fn as_postgres(program: &str) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--", program]);
        c
    } else {
        Command::new(program)
    }
}

fn run(cmd: &mut Command, what: &str) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn wait_for_port(port: u16, limit: Duration, what: &str) {
    let deadline = Instant::now() + limit;
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{what} did not listen on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Cluster {
    /// initdb, start Postgres and PgBouncer, create and migrate `hardcount`.
    ///
    /// # Panics
    /// When Postgres 15 or PgBouncer is not installed (`scripts/bed` installs
    /// them), or either fails to start.
    pub async fn start() -> Cluster {
        let c = tokio::task::spawn_blocking(Self::start_blocking)
            .await
            .unwrap();
        let mut admin = c.superuser("postgres").await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {DATABASE}")))
            .execute(&mut admin)
            .await
            .expect("create the harness database");
        let _ = admin.close().await;
        db::migrate(&c.superuser_url())
            .await
            .expect("migrate the harness database");
        c
    }

    fn start_blocking() -> Cluster {
        let dir = std::env::temp_dir().join(format!(
            "hardcount-cluster-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        if is_root() {
            run(
                Command::new("chown").arg("postgres:postgres").arg(&dir),
                "chown the cluster directory",
            );
        }
        let c = Cluster {
            dir,
            pg_port: free_port(),
            bouncer_port: free_port(),
        };
        run(
            as_postgres(&format!("{PGBIN}/initdb"))
                .arg("-D")
                .arg(c.dir.join("pg"))
                .args(["-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"]),
            "initdb",
        );
        c.start_postgres();
        std::fs::write(
            c.dir.join("users.txt"),
            "\"postgres\" \"\"\n\"hardcount_app\" \"\"\n\"hardcount_api\" \"\"\n\"hardcount_operator\" \"\"\n",
        )
        .unwrap();
        let pg = c.pg_port;
        let dir = c.dir.display();
        std::fs::write(
            c.dir.join("pgbouncer.ini"),
            format!(
                "[databases]\n\
                 hardcount_leases = host=127.0.0.1 port={pg} dbname={DATABASE} pool_size={LEASE_POOL}\n\
                 * = host=127.0.0.1 port={pg}\n\
                 [pgbouncer]\n\
                 listen_addr = 127.0.0.1\n\
                 listen_port = {}\n\
                 unix_socket_dir =\n\
                 auth_type = trust\n\
                 auth_file = {dir}/users.txt\n\
                 pool_mode = transaction\n\
                 server_login_retry = 1\n\
                 default_pool_size = {APP_POOL}\n\
                 max_client_conn = 2000\n\
                 ignore_startup_parameters = extra_float_digits\n\
                 logfile = {dir}/pgbouncer.log\n\
                 pidfile = {dir}/pgbouncer.pid\n\
                 admin_users = postgres\n",
                c.bouncer_port
            ),
        )
        .unwrap();
        if is_root() {
            run(
                Command::new("chown")
                    .arg("-R")
                    .arg("postgres:postgres")
                    .arg(&c.dir),
                "chown the cluster files",
            );
        }
        c.start_bouncer();
        c
    }

    fn start_postgres(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off \
             -c full_page_writes=off -c max_connections=200",
            self.pg_port,
            self.dir.display()
        );
        run(
            as_postgres(&format!("{PGBIN}/pg_ctl"))
                .arg("-D")
                .arg(self.dir.join("pg"))
                .arg("-l")
                .arg(self.dir.join("pg.log"))
                .args(["-w", "-t", "60", "start", "-o", &options]),
            "pg_ctl start",
        );
    }

    fn start_bouncer(&self) {
        start_bouncer(&self.dir, self.bouncer_port);
    }

    fn stop_bouncer(&self) {
        stop_bouncer(&self.dir);
    }

    /// Postgres, direct.
    pub fn pg_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.pg_port))
    }

    /// PgBouncer.
    pub fn bouncer_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.bouncer_port))
    }

    /// A direct superuser URL for `hardcount` (setup, faults, inspection).
    pub fn superuser_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{DATABASE}", self.pg_port)
    }

    /// `role` on `hardcount` through `host_port` (PgBouncer, or a proxy in
    /// front of it), as the database `database` (`hardcount`, or the lease
    /// alias `hardcount_leases`).
    pub fn url_via(host_port: &str, role: &str, database: &str) -> String {
        format!("postgres://{role}@{host_port}/{database}")
    }

    pub async fn superuser(&self, database: &str) -> PgConnection {
        PgConnection::connect(&format!(
            "postgres://postgres@127.0.0.1:{}/{database}",
            self.pg_port
        ))
        .await
        .unwrap_or_else(|e| panic!("connect to the harness cluster as postgres: {e}"))
    }

    /// Restart Postgres (`pg_ctl restart -m fast`: every session ended, a
    /// checkpoint, up again on the same port).
    pub async fn restart_postgres(&self) {
        let data = self.dir.join("pg");
        let log = self.dir.join("pg.log");
        let port = self.pg_port;
        tokio::task::spawn_blocking(move || {
            // With its log file: without one the new server would write to
            // pg_ctl's stdout, and holding that pipe open, never let it end.
            run(
                as_postgres(&format!("{PGBIN}/pg_ctl"))
                    .arg("-D")
                    .arg(&data)
                    .arg("-l")
                    .arg(&log)
                    .args(["-w", "-t", "60", "-m", "fast", "restart"]),
                "pg_ctl restart",
            );
            wait_for_port(port, Duration::from_secs(30), "Postgres");
        })
        .await
        .unwrap();
    }

    /// Stop PgBouncer (SIGTERM: every client cut), then start it again on the same port.
    pub async fn restart_bouncer(&self) {
        let (dir, port) = (self.dir.clone(), self.bouncer_port);
        tokio::task::spawn_blocking(move || {
            stop_bouncer(&dir);
            start_bouncer(&dir, port);
        })
        .await
        .unwrap();
    }

    /// Turn the whole cluster read-only (`default_transaction_read_only`,
    /// reloaded: every session's next transaction is read-only) or writable.
    pub async fn set_read_only(&self, read_only: bool) {
        let mut su = self.superuser(DATABASE).await;
        let value = if read_only { "on" } else { "off" };
        // One statement each: ALTER SYSTEM refuses to run in the implicit
        // transaction of a multi-statement query.
        sqlx::raw_sql("SET default_transaction_read_only = off")
            .execute(&mut su)
            .await
            .expect("SET default_transaction_read_only");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER SYSTEM SET default_transaction_read_only = {value}"
        )))
        .execute(&mut su)
        .await
        .expect("ALTER SYSTEM SET default_transaction_read_only");
        sqlx::raw_sql("SELECT pg_reload_conf()")
            .execute(&mut su)
            .await
            .expect("pg_reload_conf");
        let _ = su.close().await;
    }
}

fn start_bouncer(dir: &Path, port: u16) {
    run(
        as_postgres("pgbouncer")
            .arg("-d")
            .arg(dir.join("pgbouncer.ini")),
        "pgbouncer -d",
    );
    wait_for_port(port, Duration::from_secs(10), "PgBouncer");
}

fn stop_bouncer(dir: &Path) {
    let Some(pid) = std::fs::read_to_string(dir.join("pgbouncer.pid"))
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
    else {
        return;
    };
    let _ = Command::new("kill").args(["-TERM", &pid]).status();
    let deadline = Instant::now() + Duration::from_secs(10);
    while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = std::fs::remove_file(dir.join("pgbouncer.pid"));
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop_bouncer();
        let _ = as_postgres(&format!("{PGBIN}/pg_ctl"))
            .arg("-D")
            .arg(self.dir.join("pg"))
            .args(["-m", "immediate", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
