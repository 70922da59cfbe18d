//! Settings for a role this replica does not run: listed as ignored, with
//! their role, for `serve` to warn of at startup (docs/adr/0120).

use super::*;

/// The ignored settings `args` leave, as (variable, role).
fn ignored(args: &[&str]) -> Vec<(String, Role)> {
    check(args).unwrap().ignored
}

fn each(role: Role, vars: &[&str]) -> Vec<(String, Role)> {
    vars.iter().map(|v| ((*v).to_owned(), role)).collect()
}

/// An interval or schedule set for a role this replica does not run is
/// listed as ignored; one for a role it runs is not. It was silently
/// ignored: a daily billing schedule set on the replicas that run only the
/// outboxes never took effect, and nothing said so. Mutation
/// `ignored_setting_unlisted`.
#[test]
fn a_setting_for_a_role_not_run_is_listed_as_ignored() {
    let listed = ignored(&[
        "--roles",
        "webhook_outbox,webhook_delivery",
        "--billing-schedule",
        "@daily",
        "--dunning-interval",
        "30s",
        "--webhook-outbox-schedule",
        "@hourly",
    ]);
    let expected = [
        each(Role::Billing, &["HARDCOUNT_BILLING_SCHEDULE"]),
        each(Role::Dunning, &["HARDCOUNT_DUNNING_INTERVAL"]),
    ]
    .concat();
    assert_eq!(listed, expected);
    assert!(ignored(&[]).is_empty());
}

/// The SMTP settings are email_outbox's alone: on a replica that does not run
/// it, those set are listed as ignored (`HARDCOUNT_EMAIL_CONNECTIONS` set
/// without `SMTP_URL` was accepted without a word); on one that runs it they
/// are not. Mutation `smtp_settings_unlisted`.
#[test]
fn smtp_settings_on_a_replica_without_email_outbox_are_listed_as_ignored() {
    let listed = ignored(&[
        "--roles",
        "billing,dunning",
        "--smtp-url",
        "smtp://127.0.0.1:2525",
        "--email-connections",
        "4",
        "--smtp-insecure-auth",
        "true",
    ]);
    let expected = each(
        Role::EmailOutbox,
        &[
            "SMTP_URL",
            "HARDCOUNT_SMTP_INSECURE_AUTH",
            "HARDCOUNT_EMAIL_CONNECTIONS",
        ],
    );
    assert_eq!(listed, expected);
    let listed = ignored(&[
        "--roles",
        "email_outbox",
        "--smtp-url",
        "smtp://127.0.0.1:2525",
        "--email-connections",
        "4",
    ]);
    assert!(listed.is_empty(), "{listed:?}");
}

/// webhook_delivery's settings on a replica that does not run it are listed
/// as ignored; the allowlist and the lowest port only where the API is off
/// too, since it refuses endpoint URLs by them. On a replica that runs the
/// role none is listed. Mutations `delivery_settings_unlisted`,
/// `delivery_api_settings_listed` (the API's two listed where it runs) and
/// `ignored_settings_listed_where_run` (listed where the role runs).
#[test]
fn delivery_settings_on_a_replica_without_webhook_delivery_are_listed_as_ignored() {
    let set = [
        "--webhook-allowlist",
        "10.1.0.0/16",
        "--webhook-retry-schedule",
        "5s,1m",
        "--webhook-timeout",
        "5s",
        "--webhook-max-in-flight",
        "16",
        "--webhook-max-in-flight-per-endpoint",
        "2",
        "--webhook-max-in-flight-per-tenant",
        "4",
        "--webhook-max-in-flight-per-destination",
        "8",
        "--webhook-breaker-timeouts",
        "3",
        "--webhook-breaker-cooloff",
        "10s",
        "--webhook-min-port",
        "8000",
        "--webhook-disable-after",
        "off",
        "--webhook-notice-from",
        "notices@example.com",
    ];
    // Every webhook_delivery setting the role registry names, but its schedule
    // (listed with the intervals) and the secrets key (the API seals with it):
    // a setting added to the registry and not to the list fails here.
    let all: Vec<&str> = crate::roles::entry(Role::WebhookDelivery)
        .expect("webhook_delivery is registered")
        .settings
        .iter()
        .copied()
        .filter(|v| {
            ![
                "HARDCOUNT_WEBHOOK_DELIVERY_SCHEDULE",
                "HARDCOUNT_SECRETS_KEY",
            ]
            .contains(v)
        })
        .collect();
    let listed = ignored(&[&["--roles", "billing,email_outbox"][..], &set[..]].concat());
    assert_eq!(listed, each(Role::WebhookDelivery, &all));

    let api = [
        "--roles",
        "billing",
        "--api-addr",
        "127.0.0.1:8081",
        "--api-database-url",
        "postgres://hardcount_api@127.0.0.1/hardcount",
    ];
    let with_api = ignored(&[&api[..], &set[..]].concat());
    let read_by_the_api = ["HARDCOUNT_WEBHOOK_ALLOWLIST", "HARDCOUNT_WEBHOOK_MIN_PORT"];
    let rest: Vec<&str> = all
        .iter()
        .copied()
        .filter(|v| !read_by_the_api.contains(v))
        .collect();
    assert_eq!(with_api, each(Role::WebhookDelivery, &rest));

    let runs = ignored(&[&["--roles", "webhook_delivery"][..], &set[..]].concat());
    assert!(runs.is_empty(), "{runs:?}");
}

/// dunning's batch settings on a replica that does not run it are listed as
/// ignored; on one that runs it they are not. Mutation
/// `dunning_settings_unlisted`.
#[test]
fn dunning_settings_on_a_replica_without_dunning_are_listed_as_ignored() {
    let set = ["--dunning-batch-size", "100", "--dunning-concurrency", "8"];
    let listed = ignored(&[&["--roles", "billing,webhook_outbox"][..], &set[..]].concat());
    let expected = each(
        Role::Dunning,
        &[
            "HARDCOUNT_DUNNING_BATCH_SIZE",
            "HARDCOUNT_DUNNING_CONCURRENCY",
        ],
    );
    assert_eq!(listed, expected);
    let runs = ignored(&[&["--roles", "dunning"][..], &set[..]].concat());
    assert!(runs.is_empty(), "{runs:?}");
}
