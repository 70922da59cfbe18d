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
        "--email-connections",
        "4",
        "--smtp-insecure-auth",
        "true",
    ]);
    let expected = each(
        Role::EmailOutbox,
        &[
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
