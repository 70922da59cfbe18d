//! The crate's own tests: the command line (parsing, refusals, the one-call
//! commands) as the real binary, and [`hardcount::run`] in-process on a
//! listener the test bound. Whole replicas (SIGTERM, failover, webhooks end to
//! end, `dev` from nothing, its operator API and signals) are system tests, in
//! the workspace's top-level `tests/`.

mod cli;
mod history;
mod idle_connections;
mod in_process;
mod operate;
mod production_build;
mod status;

use std::process::{Command, Output};

pub fn hardcount() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hardcount"));
    c.env_remove("DATABASE_URL")
        .env_remove("MIGRATION_DATABASE_URL")
        .env_remove("HARDCOUNT_ROLES")
        .env_remove("HARDCOUNT_OPERATOR_DATABASE_URL")
        .env_remove("HARDCOUNT_SECRETS_KEY")
        .env("RUST_LOG", "info");
    c
}

/// Run to completion, killing the process if it outlives `limit` (a refusal
/// that turned into a running server must fail the test, not hang it).
pub fn run(cmd: &mut Command, limit: std::time::Duration) -> Output {
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        if rx.recv_timeout(limit).is_err() {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    });
    let out = child.wait_with_output().unwrap();
    let _ = tx.send(());
    out
}

pub fn text(out: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
