//! The command line as the real binary: `serve`'s settings, refusals and logs
//! here, and `migrate`, `leader` and `secrets` in a file each.

mod leader;
mod migrate;
mod secrets;

use testbed::{Leg, TestDb};

use std::time::Duration;

use crate::{hardcount, run, text};

#[test]
fn serve_help_lists_every_variable() {
    let out = hardcount().args(["serve", "--help"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let help = String::from_utf8_lossy(&out.stdout);
    for var in [
        "DATABASE_URL",
        "MIGRATION_DATABASE_URL",
        "HARDCOUNT_HTTP_ADDR",
        "HARDCOUNT_ROLES",
        "HARDCOUNT_BILLING_INTERVAL",
        "HARDCOUNT_DUNNING_INTERVAL",
        "HARDCOUNT_WEBHOOK_OUTBOX_INTERVAL",
        "HARDCOUNT_EMAIL_OUTBOX_INTERVAL",
        "HARDCOUNT_WEBHOOK_DELIVERY_INTERVAL",
        "HARDCOUNT_OPERATOR_DATABASE_URL",
        "HARDCOUNT_SECRETS_KEY",
        "HARDCOUNT_WEBHOOK_ALLOWLIST",
        "HARDCOUNT_WEBHOOK_RETRY_SCHEDULE",
        "HARDCOUNT_WEBHOOK_TIMEOUT",
        "HARDCOUNT_LISTEN_URL",
        "HARDCOUNT_EMAIL_FROM",
        "RUST_LOG",
    ] {
        assert!(
            help.contains(&format!("[env: {var}")),
            "{var} missing:\n{help}"
        );
    }
}

#[test]
fn serve_refuses_nonsense_settings_by_name_before_touching_the_database() {
    for (var, value, expected) in [
        (
            "HARDCOUNT_WEBHOOK_OUTBOX_INTERVAL",
            "100ms",
            "HARDCOUNT_WEBHOOK_OUTBOX_INTERVAL is 100ms",
        ),
        (
            "HARDCOUNT_WEBHOOK_TIMEOUT",
            "2m",
            "HARDCOUNT_WEBHOOK_TIMEOUT=\"2m\": must be at most 1m",
        ),
        (
            "HARDCOUNT_WEBHOOK_RETRY_SCHEDULE",
            "5s,30d",
            "must be at most 7days",
        ),
        (
            "HARDCOUNT_HTTP_ADDR",
            "localhost",
            "HARDCOUNT_HTTP_ADDR=\"localhost\"",
        ),
        // Issue 22, point 11. Catches: the sender not parsed at boot
        // (`email_from_unchecked`: serve goes on to the database).
        (
            "HARDCOUNT_EMAIL_FROM",
            "Billing <billing@>",
            "HARDCOUNT_EMAIL_FROM=\"Billing <billing@>\": expected a sender",
        ),
    ] {
        let out = run(
            hardcount()
                .arg("serve")
                .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
                .env(var, value),
            Duration::from_secs(20),
        );
        let all = text(&out);
        assert_eq!(out.status.code(), Some(1), "{all}");
        assert!(all.contains(expected), "{var}={value}: {all}");
    }
}

/// Issue 26, point 5: a whole `serve` run at the most verbose log level
/// (`RUST_LOG=trace`, sqlx's connection and statement logging included)
/// prints neither the database password in its URLs nor the secrets key.
/// Fails if any layer (ours, sqlx's, the pool's) logs a connection URL or
/// its options with their values.
#[tokio::test]
async fn a_trace_level_serve_run_prints_no_password_and_no_key() {
    let t = TestDb::new().await;
    let password = "seeded-pw-4f1c";
    let url = t.app_url(Leg::current()).replacen(
        "hardcount_app@",
        &format!("hardcount_app:{password}@"),
        1,
    );
    assert!(url.contains(password), "{url}");
    let key_bytes = testbed::SECRETS_KEY.split(':').nth(1).unwrap();
    let all = run_until(
        hardcount()
            .arg("serve")
            .env("DATABASE_URL", &url)
            .env("HARDCOUNT_LISTEN_URL", &url)
            .env("HARDCOUNT_SECRETS_KEY", testbed::SECRETS_KEY)
            .env("HARDCOUNT_ROLES", "webhook_outbox,webhook_delivery")
            .env("HARDCOUNT_HTTP_ADDR", "127.0.0.1:0")
            .env("RUST_LOG", "trace"),
        "nothing claimed",
        Duration::from_secs(30),
    );
    assert!(
        all.contains("nothing claimed"),
        "no tick ran at trace level: {all}"
    );
    assert!(!all.contains(password), "the database password was printed");
    assert!(!all.contains(key_bytes), "the secrets key was printed");
}

/// An empty `RUST_LOG` is unset (README: the default, `info`), not a filter
/// with no rules: that turned every line off, panics and lost leases
/// included (docs/adr/0101). Mutation `empty_rust_log_silent` (the empty
/// value passed to the filter again) fails it; seen failing.
#[tokio::test]
async fn an_empty_rust_log_logs_at_info() {
    let t = TestDb::new().await;
    let all = run_until(
        serve_outbox(&t).env("RUST_LOG", " "),
        "serving",
        Duration::from_secs(30),
    );
    assert!(all.contains("serving"), "nothing logged: {all:?}");
}

/// The OTLP exporter's debug lines carry the endpoint's URL with its
/// credentials: at `RUST_LOG=debug`, with an endpoint that refuses (port 1),
/// two batch exports (5 s apart) fail and neither the token nor the URL
/// reaches stderr (docs/adr/0101). Mutation `otlp_debug_lines` (the stderr
/// filter removed) fails it; seen failing.
#[tokio::test]
async fn a_debug_serve_run_prints_no_otlp_credentials() {
    let t = TestDb::new().await;
    let all = run_until(
        serve_outbox(&t)
            .env(
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "http://otlp:seeded-otlp-tok@127.0.0.1:1",
            )
            .env("RUST_LOG", "debug"),
        "a line never printed",
        Duration::from_secs(12),
    );
    assert!(all.contains("serving"), "{all}");
    assert!(
        !all.contains("seeded-otlp-tok"),
        "the OTLP token was printed"
    );
}

/// Issue 25, point 6: `HARDCOUNT_LOG_FORMAT=json` makes every line one JSON
/// object, and every line logged within a tick carries the tick's `role`,
/// `token` and `tick` id (the `tick` span of `Manager::lead`); a format
/// that is neither text nor json is refused by name. Fails if the span is
/// not entered around the work (the lines inside a tick lose their fields).
#[tokio::test]
async fn json_logs_are_one_object_per_line_and_a_ticks_lines_carry_role_token_and_tick() {
    let t = TestDb::new().await;
    let all = run_until(
        serve_outbox(&t)
            .env("HARDCOUNT_LOG_FORMAT", "json")
            .env("RUST_LOG", "info,scheduler=debug"),
        "nothing claimed",
        Duration::from_secs(30),
    );
    let lines: Vec<serde_json::Value> = all
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let in_tick = lines
        .iter()
        .find(|l| l["fields"]["message"] == "nothing claimed" || l["message"] == "nothing claimed")
        .unwrap_or_else(|| panic!("no tick line: {all}"));
    let span = &in_tick["span"];
    assert_eq!(span["name"], "tick", "{in_tick}");
    assert_eq!(span["role"], "webhook_outbox", "{in_tick}");
    assert!(
        span["token"].is_number() && span["tick"].is_number(),
        "{in_tick}"
    );

    let out = run(
        hardcount()
            .args(["leader", "status"])
            .env("DATABASE_URL", t.app_url(Leg::current()))
            .env("HARDCOUNT_LOG_FORMAT", "yaml"),
        Duration::from_secs(20),
    );
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(all.contains("HARDCOUNT_LOG_FORMAT is \"yaml\""), "{all}");
}

/// `hardcount serve` of the webhook outbox role alone on `t`, its health
/// port on a port the kernel picks.
fn serve_outbox(t: &TestDb) -> std::process::Command {
    let mut cmd = hardcount();
    cmd.arg("serve")
        .env("DATABASE_URL", t.app_url(Leg::current()))
        .env("HARDCOUNT_ROLES", "webhook_outbox")
        .env("HARDCOUNT_HTTP_ADDR", "127.0.0.1:0");
    cmd
}

/// Run `cmd` until a line of its output contains `needle` (then kill it), or
/// until it exits, or `limit`; all it printed.
fn run_until(cmd: &mut std::process::Command, needle: &str, limit: Duration) -> String {
    use std::io::{BufRead, BufReader};
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    for pipe in [
        Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
        Box::new(child.stderr.take().unwrap()),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
    }
    drop(tx);
    let deadline = std::time::Instant::now() + limit;
    let mut all = String::new();
    while let Ok(line) =
        rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
    {
        all.push_str(&line);
        all.push('\n');
        if line.contains(needle) {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    all
}
