//! A local Postgres 15 cluster for `dev`, kept under the state directory and
//! reused between runs: the machine's binaries (installed through apt when
//! missing, as `scripts/bed` does), run as the `postgres` OS user when this
//! process is root (initdb refuses root), listening on loopback only.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

const PGBIN: &str = "/usr/lib/postgresql/15/bin";
const DATABASE: &str = "hardcount";
/// Where a root run keeps a cluster whose state directory the `postgres` OS
/// user cannot reach (root's home and `mktemp -d` folders are mode 0700).
const REACHABLE_ROOT: &str = "/var/lib/hardcount-dev";

/// A running cluster. Dropping it stops the server if this process started it;
/// the data stays.
pub struct LocalPostgres {
    dir: PathBuf,
    port: u16,
    started_here: bool,
}

impl LocalPostgres {
    /// Install, create (once) and start the cluster under `state_dir/postgres`,
    /// or reuse it if a previous run left it running; make sure the `hardcount`
    /// database exists.
    pub fn start(state_dir: &Path) -> Result<LocalPostgres> {
        ensure_installed()?;
        let dir = cluster_dir(state_dir);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        if is_root() {
            run(Command::new("chown").arg("postgres:postgres").arg(&dir))?;
        }
        let data = dir.join("data");
        if !data.join("PG_VERSION").exists() {
            let t = Instant::now();
            println!(
                "creating a Postgres 15 cluster in {} (once)...",
                data.display()
            );
            let _ = std::fs::remove_dir_all(&data); // an initdb that died half-way
            run(as_postgres("initdb").arg("-D").arg(&data).args([
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
            ]))
            .context("initdb")?;
            println!("  created in {:.1}s", t.elapsed().as_secs_f64());
        }

        let mut pg = LocalPostgres {
            dir,
            port: 0,
            started_here: false,
        };
        if let Some(port) = pg.running_port() {
            println!("reusing the Postgres already running on 127.0.0.1:{port}");
            pg.port = port;
        } else {
            pg.port = free_port()?;
            let options = format!(
                "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories=''",
                pg.port
            );
            let started = run(as_postgres("pg_ctl")
                .arg("-D")
                .arg(&data)
                .arg("-l")
                .arg(pg.dir.join("postgres.log"))
                .args(["-w", "-t", "60", "start", "-o", &options]));
            if let Err(e) = started {
                // A start that timed out leaves a server coming up that no
                // one would stop, and the next run would take it for its own
                // reuse; stop it (a no-op when none is running).
                let _ = run(as_postgres("pg_ctl").arg("-D").arg(&data).args([
                    "-m",
                    "immediate",
                    "-w",
                    "stop",
                ]));
                return Err(e).with_context(|| {
                    format!(
                        "pg_ctl start; see {}",
                        pg.dir.join("postgres.log").display()
                    )
                });
            }
            pg.started_here = true;
        }
        pg.ensure_database()?;
        Ok(pg)
    }

    /// The schema owner (the cluster's superuser), for migrations.
    pub fn owner_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{DATABASE}", self.port)
    }

    /// The application's role, as `serve` connects.
    pub fn app_url(&self) -> String {
        format!(
            "postgres://hardcount_app@127.0.0.1:{}/{DATABASE}",
            self.port
        )
    }

    /// `role` on the dev database (the local cluster trusts loopback).
    pub fn role_url(&self, role: &str) -> String {
        format!("postgres://{role}@127.0.0.1:{}/{DATABASE}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The cluster's data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// The port of a server already running on this data directory, if any.
    fn running_port(&self) -> Option<u16> {
        let status = as_postgres("pg_ctl")
            .arg("-D")
            .arg(self.dir.join("data"))
            .arg("status")
            .output()
            .ok()?;
        if !status.status.success() {
            return None;
        }
        // postmaster.pid: pid, data dir, start time, port, ...
        let pid_file = std::fs::read_to_string(self.dir.join("data/postmaster.pid")).ok()?;
        pid_file.lines().nth(3)?.trim().parse().ok()
    }

    fn ensure_database(&self) -> Result<()> {
        let port = self.port.to_string();
        let connect = ["-h", "127.0.0.1", "-p", &port, "-U", "postgres"];
        let exists = run(Command::new(format!("{PGBIN}/psql"))
            .args(connect)
            .args(["-d", "postgres", "-tAc"])
            .arg(format!(
                "SELECT 1 FROM pg_database WHERE datname = '{DATABASE}'"
            )))?;
        if exists.trim() != "1" {
            run(Command::new(format!("{PGBIN}/createdb"))
                .args(connect)
                .arg(DATABASE))?;
        }
        Ok(())
    }
}

impl Drop for LocalPostgres {
    fn drop(&mut self) {
        if !self.started_here {
            return;
        }
        let stopped = run(as_postgres("pg_ctl")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-m", "fast", "-w", "stop"]));
        // Written without println!, which panics once a hung-up terminal
        // (SIGHUP) refuses the line.
        use std::io::Write as _;
        let _ = match stopped {
            Ok(_) => writeln!(
                std::io::stdout(),
                "stopped the local Postgres (data kept in {})",
                self.dir.join("data").display()
            ),
            Err(e) => writeln!(
                std::io::stderr(),
                "could not stop the local Postgres: {e:#}"
            ),
        };
    }
}

/// The cluster's directory: `state_dir/postgres`, unless this process is root
/// and the `postgres` OS user (which runs the server) cannot reach the state
/// directory; then a directory of its own under [`REACHABLE_ROOT`], named
/// after the state directory so a rerun finds it again, and said so.
fn cluster_dir(state_dir: &Path) -> PathBuf {
    let inside = state_dir.join("postgres");
    if !is_root() || postgres_can_enter(state_dir) {
        return inside;
    }
    let name: String = state_dir
        .to_string_lossy()
        .trim_start_matches('/')
        .chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '.' | '_' | '-' => c,
            _ => '-',
        })
        .collect();
    let dir = Path::new(REACHABLE_ROOT).join(name);
    println!(
        "the postgres OS user cannot reach {} (a 0700 directory on its path): the cluster lives in {} instead",
        state_dir.display(),
        dir.display()
    );
    dir
}

/// Whether the `postgres` OS user can enter `dir` (every directory on its
/// path searchable by it).
fn postgres_can_enter(dir: &Path) -> bool {
    Command::new("runuser")
        .args(["-u", "postgres", "--", "test", "-x"])
        .arg(dir)
        .status()
        .is_ok_and(|s| s.success())
}

fn ensure_installed() -> Result<()> {
    if Path::new(PGBIN).join("initdb").exists() {
        return Ok(());
    }
    if !is_root() {
        bail!(
            "Postgres 15 is not installed ({PGBIN}/initdb is missing): run \
             `apt-get install postgresql-15` as root, or set DATABASE_URL"
        );
    }
    apt_install("postgresql-15")
}

/// `apt-get install PACKAGE` (after an update if the first try fails), with a
/// progress line: what `dev` does for a package it needs, as root.
pub(super) fn apt_install(package: &str) -> Result<()> {
    let t = Instant::now();
    println!("installing {package} through apt (once; a minute or two)...");
    let install = || {
        run(Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "-q", package]))
    };
    if install().is_err() {
        run(Command::new("apt-get").args(["update", "-q"]))?;
        install().with_context(|| format!("apt-get install {package}"))?;
    }
    println!("  installed in {:.0}s", t.elapsed().as_secs_f64());
    Ok(())
}

pub(super) fn is_root() -> bool {
    // The effective uid, without unsafe code or a libc dependency.
    std::fs::metadata("/proc/self").is_ok_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
}

/// A Postgres server binary, run as the `postgres` OS user when we are root.
fn as_postgres(program: &str) -> Command {
    let program = format!("{PGBIN}/{program}");
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--", &program]);
        c
    } else {
        Command::new(program)
    }
}

/// Run to completion; its stdout, or an error with its output.
fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("cannot run {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!(
            "{:?} {:?} failed ({}):\n{}{}",
            cmd.get_program(),
            cmd.get_args().collect::<Vec<_>>(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub(super) fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("no free local port")?;
    Ok(listener.local_addr()?.port())
}
