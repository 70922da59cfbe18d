//! System tests: real `hardcount` processes against the test bed that
//! `scripts/bed test` starts (Postgres 15, PgBouncer in transaction mode), run
//! once per leg. Crate-level tests (CLI parsing and refusals, `run` in-process)
//! stay with their crates.

mod api;
mod chaos;
mod dashboard;
mod deploy;
mod dev;
mod dunning;
mod e2e;
mod email;
mod logs;
mod serve;
mod stack;
mod wake;

use std::process::{Command, Output};

/// The real binary, built from `crates/hardcount/src/main.rs` in this package
/// (see Cargo.toml), with the caller's database settings removed.
pub fn hardcount() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hardcount-under-test"));
    c.env_remove("DATABASE_URL")
        .env_remove("MIGRATION_DATABASE_URL")
        .env_remove("HARDCOUNT_ROLES")
        .env_remove("HARDCOUNT_HTTP_ADDR")
        .env_remove("SMTP_URL")
        .env_remove("HARDCOUNT_LISTEN_URL")
        .env_remove("HARDCOUNT_SECRETS_KEY")
        .env_remove("HARDCOUNT_OPERATOR_DATABASE_URL")
        .env_remove("HARDCOUNT_API_ADDR")
        .env_remove("HARDCOUNT_API_DATABASE_URL")
        .env_remove("HARDCOUNT_LOG_FORMAT")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .env("RUST_LOG", "info");
    c
}

pub fn text(out: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
