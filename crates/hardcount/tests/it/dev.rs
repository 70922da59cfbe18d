//! `hardcount dev` as the real binary, on a local Postgres of its own under a
//! state directory of the test's (the newcomer's whole run, webhooks and mail,
//! is the system test `tests/it/dev.rs`). Needs no database of the bed, so it
//! runs the same on both legs.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::hardcount;

/// How long a dev from nothing may take to say it is ready (initdb, migrations).
const READY_WITHIN: Duration = Duration::from_secs(120);

/// A running `hardcount dev` on its own state directory, ports picked at bind,
/// its stdout and stderr collected.
struct Dev {
    child: Child,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
}

impl Dev {
    fn start(state: &StateDir, env: &[(&str, &str)]) -> Dev {
        let mut cmd = hardcount();
        cmd.arg("dev")
            .env("HARDCOUNT_DEV_DIR", &state.0)
            .env("HARDCOUNT_HTTP_ADDR", "127.0.0.1:0")
            .env("HARDCOUNT_API_ADDR", "127.0.0.1:0")
            .env_remove("HARDCOUNT_OPERATOR_TOKEN")
            .env_remove("BILLING_PROVIDER_URL")
            .env_remove("SMTP_URL")
            .env_remove("HARDCOUNT_API_DATABASE_URL")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let stdout = collect(child.stdout.take().unwrap());
        let stderr = collect(child.stderr.take().unwrap());
        Dev {
            child,
            stdout,
            stderr,
        }
    }

    fn output(&self) -> String {
        format!(
            "stdout:\n{}\n--- stderr ---\n{}",
            self.stdout.lock().unwrap(),
            self.stderr.lock().unwrap()
        )
    }

    /// Wait until it prints that it is ready (`Ok`) or exits (`Err` with its
    /// exit code; `None` for a signal).
    async fn ready_or_exit(&mut self) -> Result<(), Option<i32>> {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // Let the readers drain the pipes.
                tokio::time::sleep(Duration::from_millis(200)).await;
                return Err(status.code());
            }
            if self.stdout.lock().unwrap().contains("ready in ") {
                return Ok(());
            }
            assert!(
                started.elapsed() < READY_WITHIN,
                "dev neither ready nor exited within {READY_WITHIN:?}:\n{}",
                self.output()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The tenant API's bound address, from its log line (`run` binds it
    /// after dev says it is ready).
    async fn api_addr(&self) -> String {
        let started = Instant::now();
        loop {
            let addr = self
                .stderr
                .lock()
                .unwrap()
                .lines()
                .filter(|l| l.contains("tenant API listening"))
                .find_map(|l| l.split("addr=").nth(1))
                .and_then(|rest| rest.split_whitespace().next())
                .map(str::to_owned);
            if let Some(addr) = addr {
                return addr;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "no tenant API address logged:\n{}",
                self.output()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Send `signal` (`-INT`, `-HUP`), then the exit code (`None` for a signal).
    async fn signal(&mut self, signal: &str) -> Option<i32> {
        let pid = self.child.id().to_string();
        assert!(
            Command::new("kill")
                .args([signal, &pid])
                .status()
                .unwrap()
                .success()
        );
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                tokio::time::sleep(Duration::from_millis(200)).await;
                return status.code();
            }
            assert!(
                Instant::now() < deadline,
                "dev did not exit after {signal}:\n{}",
                self.output()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Dev {
    /// A failed test's dev is interrupted first, so it stops its SMTP sink and
    /// Postgres itself; killed only if it outlives that.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = Command::new("kill")
                .args(["-INT", &self.child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(20);
            while let Ok(None) = self.child.try_wait() {
                if Instant::now() > deadline {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn collect(pipe: impl std::io::Read + Send + 'static) -> Arc<Mutex<String>> {
    let buf = Arc::new(Mutex::new(String::new()));
    let sink = buf.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            let mut s = sink.lock().unwrap();
            s.push_str(&line);
            s.push('\n');
        }
    });
    buf
}

/// A state directory of its own, removed at the end (its Postgres stopped
/// first if a failed test left it running).
struct StateDir(PathBuf);

impl StateDir {
    fn new() -> StateDir {
        let dir = std::env::temp_dir().join(format!(
            "hardcount-crate-dev-test-{}-{}",
            std::process::id(),
            testbed::free_port()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        StateDir(dir)
    }

    fn data(&self) -> PathBuf {
        self.0.join("postgres/data")
    }

    /// Postgres runs on the data directory: pg_ctl's own test, the pid file.
    fn postgres_running(&self) -> bool {
        self.data().join("postmaster.pid").exists()
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        if self.postgres_running() {
            let pg_ctl = "/usr/lib/postgresql/15/bin/pg_ctl";
            let data = self.data();
            let _ = Command::new("runuser")
                .args(["-u", "postgres", "--", pg_ctl, "-D"])
                .arg(&data)
                .args(["-m", "immediate", "stop"])
                .status();
            let _ = Command::new(pg_ctl)
                .arg("-D")
                .arg(&data)
                .args(["-m", "immediate", "stop"])
                .status();
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `dev` adds the operator API as `serve` does: with a token of 64
/// characters, `/operator/v1/leaders` answers 200 to it (over the local
/// cluster's hardcount_operator) and 401 without it; a token too short is
/// refused by its variable's name and dev exits non-zero, its Postgres
/// stopped. Before, dev built its configuration without the operator API:
/// the route was a 404 and the short token was ignored (dev got ready).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_serves_the_operator_api_with_its_token_and_refuses_a_short_one() {
    let state = StateDir::new();

    let mut short = Dev::start(&state, &[("HARDCOUNT_OPERATOR_TOKEN", "too-short")]);
    let exit = short.ready_or_exit().await;
    assert!(
        matches!(exit, Err(Some(code)) if code != 0),
        "{exit:?}:\n{}",
        short.output()
    );
    assert!(
        short
            .stderr
            .lock()
            .unwrap()
            .contains("HARDCOUNT_OPERATOR_TOKEN is too short"),
        "{}",
        short.output()
    );
    assert!(!state.postgres_running(), "dev left its Postgres running");

    let token = "0123456789abcdef".repeat(4);
    let mut dev = Dev::start(&state, &[("HARDCOUNT_OPERATOR_TOKEN", &token)]);
    if let Err(code) = dev.ready_or_exit().await {
        panic!("dev exited ({code:?}):\n{}", dev.output());
    }
    let leaders = format!("http://{}/operator/v1/leaders", dev.api_addr().await);
    let http = reqwest::Client::new();
    let answer = http.get(&leaders).bearer_auth(&token).send().await.unwrap();
    let status = answer.status().as_u16();
    let body = answer.text().await.unwrap();
    assert_eq!(status, 200, "{body}\n{}", dev.output());
    assert!(body.contains("billing"), "{body}");
    let anonymous = http.get(&leaders).send().await.unwrap().status().as_u16();
    assert_eq!(anonymous, 401);
    assert_eq!(dev.signal("-INT").await, Some(0), "{}", dev.output());
    assert!(!state.postgres_running(), "dev left its Postgres running");
}

/// A closed terminal (SIGHUP) stops dev as Ctrl-C does: it exits 0 and stops
/// the Postgres it started. Before, SIGHUP's default action ended the process
/// without running a destructor, leaving the cluster running for every later
/// run to reuse and never stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sighup_stops_dev_and_the_postgres_it_started() {
    let state = StateDir::new();
    let mut dev = Dev::start(&state, &[]);
    if let Err(code) = dev.ready_or_exit().await {
        panic!("dev exited ({code:?}):\n{}", dev.output());
    }
    assert!(state.postgres_running());
    assert_eq!(dev.signal("-HUP").await, Some(0), "{}", dev.output());
    assert!(
        dev.stdout
            .lock()
            .unwrap()
            .contains("stopped the local Postgres"),
        "{}",
        dev.output()
    );
    assert!(!state.postgres_running(), "dev left its Postgres running");
}
