//! The settings' unit tests.

use super::*;
use clap::Parser;

mod connections;
mod ignored;

#[derive(Parser)]
struct Serve {
    #[command(flatten)]
    settings: ServeSettings,
}

/// The settings `args` (flags standing in for the variables) give, or the
/// parser's refusal.
fn parsed(args: &[&str]) -> Result<ServeSettings, String> {
    Serve::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
        .map(|serve| serve.settings)
        .map_err(|e| e.to_string())
}

/// The settings `args` give (for the tests of `dev`, which fills them in).
pub(crate) fn serve_settings(args: &[&str]) -> ServeSettings {
    parsed(args).unwrap()
}

/// The configuration `args` (flags standing in for the variables) give, or the refusal.
fn check(args: &[&str]) -> Result<Config, String> {
    parsed(args)?
        .config("postgres://x".into(), None)
        .map_err(|e| format!("{e:#}"))
}

fn refusal(args: &[&str]) -> String {
    match check(args) {
        Ok(_) => panic!("{args:?} was accepted"),
        Err(e) => e,
    }
}

#[test]
fn defaults_run_every_role_with_the_documented_intervals() {
    let config = check(&[]).unwrap();
    assert_eq!(config.roles.len(), 5);
    assert!(!config.roles_explicit);
    assert_eq!(config.roles[0].interval, Duration::from_secs(3600));
    assert_eq!(config.webhook_delivery, WorkerConfig::default());
}

#[test]
fn durations_take_humantime_syntax() {
    let config = check(&[
        "--billing-interval",
        "2h 30m",
        "--webhook-retry-schedule",
        "1s, 5m,7days",
        "--webhook-timeout",
        "60s",
    ])
    .unwrap();
    assert_eq!(config.roles[0].interval, Duration::from_secs(9000));
    assert_eq!(
        config.webhook_delivery.retry_schedule.0,
        [1, 300, 7 * 86_400].map(Duration::from_secs).to_vec()
    );
    assert_eq!(
        config.webhook_delivery.request_timeout,
        Duration::from_secs(60)
    );
}

#[test]
fn nonsense_is_refused_by_the_setting_s_name() {
    for (args, expected) in [
        (
            &["--billing-interval", "500ms"][..],
            "HARDCOUNT_BILLING_INTERVAL is 500ms: a role's interval must be from 1s",
        ),
        (
            &["--billing-interval", "0s"],
            "HARDCOUNT_BILLING_INTERVAL is 0ns: a role's interval must be from 1s",
        ),
        (
            &["--webhook-delivery-interval", "1 fortnight"],
            "HARDCOUNT_WEBHOOK_DELIVERY_INTERVAL=\"1 fortnight\": unknown time unit",
        ),
        (
            &["--dunning-interval", "31d"],
            "HARDCOUNT_DUNNING_INTERVAL is 2678400s",
        ),
        (
            &["--dunning-batch-size", "0"],
            "HARDCOUNT_DUNNING_BATCH_SIZE=0: must be from 1 to 10000",
        ),
        (
            &["--dunning-concurrency", "many"],
            "HARDCOUNT_DUNNING_CONCURRENCY=\"many\": expected a whole number",
        ),
        (
            &["--dunning-concurrency", "1001"],
            "HARDCOUNT_DUNNING_CONCURRENCY=1001: must be from 1 to 1000",
        ),
        (
            &["--dunning-tick-budget", "2h"],
            "HARDCOUNT_DUNNING_TICK_BUDGET=2h: must be from 100ms to 1h",
        ),
        (
            &["--webhook-retry-schedule", "5s,500ms"],
            "HARDCOUNT_WEBHOOK_RETRY_SCHEDULE=\"5s,500ms\": delay 2 is wrong: \
             HARDCOUNT_WEBHOOK_RETRY_SCHEDULE=\"500ms\": must be at least 1s",
        ),
        (
            &["--webhook-retry-schedule", "5s,8d"],
            "\"8d\": must be at most 7days",
        ),
        (&["--webhook-retry-schedule", "5s,,5m"], "delay 2 is wrong"),
        (
            &["--webhook-timeout", "61s"],
            "HARDCOUNT_WEBHOOK_TIMEOUT=\"61s\": must be at most 1m",
        ),
        (
            &["--webhook-timeout", "0s"],
            "HARDCOUNT_WEBHOOK_TIMEOUT=\"0s\": must be at least 1s",
        ),
        (
            &["--webhook-allowlist", "10.0.0.0/99"],
            "HARDCOUNT_WEBHOOK_ALLOWLIST=\"10.0.0.0/99\"",
        ),
        (
            &["--webhook-allowlist", "10.0.0.0/8,0.0.0.0/0"],
            "HARDCOUNT_WEBHOOK_ALLOWLIST=\"10.0.0.0/8,0.0.0.0/0\": invalid SSRF allowlist entry `0.0.0.0/0`: re-opens every IPv4 address",
        ),
        (
            &["--webhook-allowlist", "169.254.169.254/32"],
            "cloud metadata address",
        ),
        (&["--roles", "billing,emails"], "unknown role \"emails\""),
        (
            &["--webhook-max-in-flight-per-tenant", "0"],
            "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_TENANT=\"0\": expected a whole number from 1 to 1024",
        ),
        (
            &["--webhook-max-in-flight", "many"],
            "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT=\"many\": expected a whole number",
        ),
        (
            &["--webhook-max-in-flight-per-destination", "2000"],
            "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_DESTINATION=\"2000\"",
        ),
        (
            &["--webhook-max-in-flight-per-endpoint", "1.5"],
            "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT=\"1.5\"",
        ),
        (
            &["--webhook-breaker-timeouts", "0"],
            "HARDCOUNT_WEBHOOK_BREAKER_TIMEOUTS=\"0\": expected a whole number from 1 to 1000",
        ),
        (
            &["--webhook-breaker-cooloff", "500ms"],
            "HARDCOUNT_WEBHOOK_BREAKER_COOLOFF=\"500ms\": must be at least 1s",
        ),
        (
            &["--webhook-breaker-cooloff", "2h"],
            "HARDCOUNT_WEBHOOK_BREAKER_COOLOFF=\"2h\": must be at most 1h",
        ),
        (
            &["--webhook-min-port", "0"],
            "HARDCOUNT_WEBHOOK_MIN_PORT=\"0\": expected a whole number from 1 to 65535",
        ),
        (
            &["--webhook-min-port", "https"],
            "HARDCOUNT_WEBHOOK_MIN_PORT=\"https\"",
        ),
    ] {
        let err = refusal(args);
        assert!(err.contains(expected), "{args:?}: {err}");
    }
}

#[test]
fn the_fairness_breaker_and_port_settings_reach_the_worker_config() {
    let w = check(&[
        "--webhook-max-in-flight",
        "64",
        "--webhook-max-in-flight-per-endpoint",
        "2",
        "--webhook-max-in-flight-per-tenant",
        "16",
        "--webhook-max-in-flight-per-destination",
        "24",
        "--webhook-breaker-timeouts",
        "3",
        "--webhook-breaker-cooloff",
        "2m",
        "--webhook-min-port",
        "8000",
    ])
    .unwrap()
    .webhook_delivery;
    assert_eq!(
        (
            w.max_in_flight,
            w.max_in_flight_per_endpoint,
            w.max_in_flight_per_tenant,
            w.max_in_flight_per_destination,
            w.breaker_timeouts,
            w.breaker_cooloff,
        ),
        (64, 2, 16, 24, 3, Duration::from_secs(120))
    );
    assert!(w.ports.permits(443) && w.ports.permits(8000) && !w.ports.permits(7999));
    let every = check(&["--webhook-min-port", "1"])
        .unwrap()
        .webhook_delivery;
    assert!(every.ports.permits(22));
}

#[test]
fn smtp_settings_are_checked_by_name_and_never_echo_the_password() {
    assert!(check(&[]).unwrap().email.is_none());
    let ok = check(&[
        "--smtp-url",
        "smtps://u:hunter2@mail.example.com",
        "--email-connections",
        "8",
    ])
    .unwrap();
    assert_eq!(ok.email.unwrap().sender.max_connections, 8);
    for url in [
        "smtp://u:hunter2@mail.example.com?tls=required",
        "smtp://mail.example.com",
        "smtp://mail.example.com?tls=opportunistic",
    ] {
        assert!(check(&["--smtp-url", url]).is_ok(), "{url}");
    }
    let allowed = check(&[
        "--smtp-url",
        "smtp://u:hunter2@127.0.0.1:2525",
        "--smtp-insecure-auth",
        "true",
    ]);
    assert!(allowed.is_ok(), "the documented insecure setting allows it");
    for (args, expected) in [
        // Credentials that may cross the network in clear: refused by name
        // unless HARDCOUNT_SMTP_INSECURE_AUTH=true (mutation `smtp_clear_auth`).
        (
            vec!["--smtp-url", "smtp://u:hunter2@mail.example.com"],
            "HARDCOUNT_SMTP_INSECURE_AUTH=true",
        ),
        (
            vec![
                "--smtp-url",
                "smtp://u:hunter2@mail.example.com?tls=opportunistic",
            ],
            "its connection may be plain",
        ),
        (
            vec![
                "--smtp-url",
                "smtp://u:hunter2@mail.example.com",
                "--smtp-insecure-auth",
                "yes",
            ],
            "HARDCOUNT_SMTP_INSECURE_AUTH is \"yes\"",
        ),
        (
            vec!["--smtp-url", "smtpx://u:hunter2@mail.example.com"],
            "SMTP_URL: SMTP_URL has the unknown scheme `smtpx`",
        ),
        (
            vec!["--smtp-url", "//u:hunter2@mail.example.com"],
            "SMTP_URL: SMTP_URL is not a URL",
        ),
        (
            vec![
                "--smtp-url",
                "smtp://mail.example.com",
                "--email-connections",
                "0",
            ],
            "HARDCOUNT_EMAIL_CONNECTIONS=\"0\"",
        ),
        (
            vec![
                "--smtp-url",
                "smtp://mail.example.com",
                "--smtp-ca-file",
                "/nonexistent/ca.pem",
            ],
            "HARDCOUNT_SMTP_CA_FILE=/nonexistent/ca.pem",
        ),
    ] {
        let err = refusal(&args);
        assert!(err.contains(expected), "{expected:?} not in {err:?}");
        assert!(!err.contains("hunter2"), "{err}");
    }
}

#[test]
fn the_email_sender_reaches_billing_and_dunning_and_one_that_does_not_parse_is_refused() {
    let default = check(&[]).unwrap();
    assert_eq!(default.billing.email_from, "Billing <billing@example.com>");
    assert_eq!(default.dunning.email_from, default.billing.email_from);
    for from in [
        "receipts@shop.example",
        "Shop Receipts <receipts@shop.example>",
        "\"Shop, Inc.\" <receipts@shop.example>",
    ] {
        let config = check(&["--email-from", from]).unwrap();
        assert_eq!(config.billing.email_from, from);
        assert_eq!(config.dunning.email_from, from);
    }
    for from in [
        "receipts",
        "Shop <receipts@>",
        "receipts@shop.example>",
        "Shop <receipts@[192.0.2.1]>",
    ] {
        let err = refusal(&["--email-from", from]);
        assert!(
            err.starts_with(&format!("HARDCOUNT_EMAIL_FROM={from:?}: expected a sender")),
            "{from:?}: {err}"
        );
    }
}

#[derive(Parser)]
struct Dev {
    #[command(flatten)]
    settings: DevSettings,
}

/// A variable set to the empty string is unset (README), as flags given ""
/// show: clap parses both alike. Fails if a setting is typed so that clap
/// refuses "" (HARDCOUNT_SMTP_CA_FILE and HARDCOUNT_DEV_DIR were paths: exit
/// 2), if dev's own defaults do not stand in for "", or if dev takes a blank
/// interval for a set one and keeps billing at 1 h and dunning at 15 m
/// instead of its 10 s and 5 s.
#[test]
fn a_blank_variable_means_unset() {
    let config = check(&["--roles", " ", "--webhook-timeout", ""]).unwrap();
    assert_eq!(config.roles.len(), 5);
    assert!(!config.roles_explicit);
    let bad = ServeSettings {
        http_addr: "8080".into(),
        ..Serve::try_parse_from(["serve"]).unwrap().settings
    };
    let err = bad.http_addr().unwrap_err().to_string();
    assert!(err.contains("HARDCOUNT_HTTP_ADDR=\"8080\""), "{err}");

    let config = check(&["--smtp-url", "smtp://127.0.0.1:2525", "--smtp-ca-file", ""]).unwrap();
    assert_eq!(config.email.map(|e| e.ca_pem), Some(None));

    let blank = [
        "dev",
        "--state-dir",
        "",
        "--event-every",
        "",
        "--billing-interval",
        "",
        "--dunning-interval",
        " ",
    ];
    let mut dev = Dev::try_parse_from(blank)
        .map_err(|e| e.to_string())
        .unwrap()
        .settings;
    assert_eq!(dev.state_dir(), std::path::Path::new(".hardcount-dev"));
    assert_eq!(dev.event_every().unwrap(), Duration::from_secs(2));
    crate::dev::billing::prepare(&mut dev.serve);
    crate::dev::dunning::prepare(&mut dev.serve);
    let config = dev.serve.config("postgres://x".into(), None).unwrap();
    let interval = |role| {
        config
            .roles
            .iter()
            .find(|rc| rc.role == role)
            .unwrap()
            .interval
    };
    assert_eq!(interval(Role::Billing), Duration::from_secs(10));
    assert_eq!(interval(Role::Dunning), Duration::from_secs(5));
}

#[test]
fn retention_defaults_to_thirty_days_and_is_refused_by_name_outside_its_bounds() {
    let config = check(&[]).unwrap();
    let month = Duration::from_secs(30 * 86_400);
    assert_eq!(
        config.retention,
        crate::serve::RetentionSettings {
            webhooks: month,
            emails: month,
            payment_logs: month,
            lease_history: month,
        }
    );
    let config = check(&[
        "--retention-webhooks",
        "7d",
        "--retention-emails",
        "90d",
        "--retention-payment-logs",
        "1h",
        "--retention-lease-history",
        "3650d",
    ])
    .unwrap();
    assert_eq!(config.retention.webhooks, Duration::from_secs(7 * 86_400));
    assert_eq!(config.retention.emails, Duration::from_secs(90 * 86_400));
    assert_eq!(config.retention.payment_logs, Duration::from_secs(3600));
    assert_eq!(
        config.retention.lease_history,
        Duration::from_secs(3650 * 86_400)
    );
    for (args, expected) in [
        (
            &["--retention-webhooks", "59m"][..],
            "HARDCOUNT_RETENTION_WEBHOOKS=\"59m\": must be at least 1h",
        ),
        (
            &["--retention-emails", "forever"],
            "HARDCOUNT_RETENTION_EMAILS=\"forever\":",
        ),
        (
            &["--retention-payment-logs", "3651d"],
            "HARDCOUNT_RETENTION_PAYMENT_LOGS=\"3651d\": must be at most",
        ),
        (
            &["--retention-lease-history", "0s"],
            "HARDCOUNT_RETENTION_LEASE_HISTORY=\"0s\": must be at least 1h",
        ),
    ] {
        let e = refusal(args);
        assert!(e.contains(expected), "{args:?}: {e}");
    }
}

/// Issue 28, point 1: a role's cron schedule reaches its role config, and
/// one that does not parse, names an unknown zone or never fires is refused
/// by its variable's name.
#[test]
fn a_cron_schedule_reaches_its_role_and_a_bad_one_is_refused_by_name() {
    let config = check(&[
        "--dunning-schedule",
        "CRON_TZ=Europe/Berlin 0 0 9 * * MON-FRI",
        "--billing-schedule",
        "@hourly",
    ])
    .unwrap();
    let dunning = config
        .roles
        .iter()
        .find(|r| r.role == Role::Dunning)
        .unwrap();
    assert_eq!(
        dunning.schedule().to_string(),
        "CRON_TZ=Europe/Berlin 0 0 9 * * MON-FRI"
    );
    let outbox = config
        .roles
        .iter()
        .find(|r| r.role == Role::WebhookOutbox)
        .unwrap();
    assert_eq!(outbox.schedule().to_string(), "every 1s");
    for (flag, value, says) in [
        (
            "--billing-schedule",
            "0 61 * * * *",
            "not a cron expression",
        ),
        (
            "--dunning-schedule",
            "CRON_TZ=Europe/Berln @daily",
            "not an IANA time zone",
        ),
        ("--email-outbox-schedule", "0 0 0 30 2 *", "never fires"),
    ] {
        let err = refusal(&[flag, value]);
        let var = format!(
            "HARDCOUNT_{}:",
            flag.trim_start_matches("--")
                .replace('-', "_")
                .to_ascii_uppercase()
        );
        assert!(err.starts_with(&var) && err.contains(says), "{err}");
    }
}

/// Settings that would do nothing without the one they depend on are refused
/// by name, as HARDCOUNT_OPERATOR_TOKEN without HARDCOUNT_API_ADDR is: a
/// provider key without its URL left auto-charge off with an info line, and
/// the tenant API's settings without its address left it unserved.
#[test]
fn settings_without_the_one_they_need_are_refused() {
    let e = refusal(&["--billing-provider-secret-key", "sk_test_1"]);
    assert!(
        e.contains("BILLING_PROVIDER_SECRET_KEY is set but BILLING_PROVIDER_URL is not"),
        "{e}"
    );
    assert!(!e.contains("sk_test_1"), "{e}");
    let e = refusal(&["--api-rate-limit", "0"]);
    assert!(
        e.contains("HARDCOUNT_API_RATE_LIMIT set but HARDCOUNT_API_ADDR is not"),
        "{e}"
    );
    let e = refusal(&[
        "--api-database-url",
        "postgres://hardcount_api:secret@db/x",
        "--api-rate-burst",
        "5",
    ]);
    assert!(
        e.contains("HARDCOUNT_API_DATABASE_URL and HARDCOUNT_API_RATE_BURST set"),
        "{e}"
    );
    assert!(!e.contains("secret@"), "{e}");
    // With what they need, both are taken.
    check(&[
        "--billing-provider-url",
        "https://api.example.com",
        "--billing-provider-secret-key",
        "sk_test_1",
    ])
    .unwrap();
}

/// A dunning tick budget that leaves no room for a provider call is refused
/// when a provider is set (every retry batch keeps the call's timeout, 30 s,
/// in reserve: at 30 s or less no run was ever listed again, and nothing
/// paged); without a provider dunning retries nothing and any budget in range
/// is taken. Mutation `dunning_budget_below_call`; seen failing.
#[test]
fn a_dunning_budget_with_no_room_for_a_call_is_refused() {
    let provider = [
        "--billing-provider-url",
        "https://api.example.com",
        "--billing-provider-secret-key",
        "sk_test_1",
    ];
    let with = |budget: &'static str| {
        let mut args = provider.to_vec();
        args.extend(["--dunning-tick-budget", budget]);
        args
    };
    let e = refusal(&with("30s"));
    assert!(
        e.contains("HARDCOUNT_DUNNING_TICK_BUDGET=30s: must be at least 1m"),
        "{e}"
    );
    assert!(!e.contains("sk_test_1"), "{e}");
    check(&with("1m")).unwrap();
    check(&["--dunning-tick-budget", "30s"]).unwrap();
}

/// HARDCOUNT_API_SHORT_PLANS takes `true` or `false` (off by default), and
/// anything else is refused by name (docs/adr/0152).
#[test]
fn short_plans_are_off_unless_set_and_refused_unless_true_or_false() {
    let api = [
        "--api-addr",
        "127.0.0.1:8081",
        "--api-database-url",
        "postgres://hardcount_api@db/x",
    ];
    let short = |config: Config| config.api.expect("the API is served").config.short_plans;
    assert!(!short(check(&api).unwrap()));
    assert!(short(
        check(&[&api[..], &["--api-short-plans", "true"]].concat()).unwrap()
    ));
    let e = refusal(&[&api[..], &["--api-short-plans", "yes"]].concat());
    assert!(
        e.contains("HARDCOUNT_API_SHORT_PLANS=\"yes\" is not true or false"),
        "{e}"
    );
}
