//! The settings the service connects with: the lease and listen URLs, the
//! lease profile, database URLs' TLS settings, and secrets kept out of Debug.

use super::*;

#[test]
fn the_lease_url_defaults_to_none_and_a_bad_one_is_named_without_its_password() {
    assert_eq!(check(&[]).unwrap().lease_database_url, None);
    let url = "postgres://app:pw@pgbouncer:6432/hardcount_leases";
    let config = check(&["--lease-database-url", url]).unwrap();
    assert_eq!(
        config.lease_database_url.as_ref().map(|u| u.expose()),
        Some(url)
    );
    let err = refusal(&[
        "--lease-database-url",
        "postgres://app:hunter2@db/x?sslmode=sometimes",
    ]);
    assert!(err.starts_with("HARDCOUNT_LEASE_DATABASE_URL: "), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
}

#[test]
fn the_lease_profile_is_standard_unless_fast_is_asked_and_anything_else_is_refused() {
    assert_eq!(check(&[]).unwrap().timing, leader::Timing::ADR);
    let fast = check(&["--lease-profile", "fast"]).unwrap().timing;
    assert_eq!(fast, leader::Timing::FAST);
    assert_eq!(fast.ttl, Duration::from_secs(3));
    let err = refusal(&["--lease-profile", "quick"]);
    assert!(
        err.starts_with("HARDCOUNT_LEASE_PROFILE=\"quick\": expected standard"),
        "{err}"
    );
}

#[test]
fn the_listen_url_is_optional_and_a_non_postgres_one_is_refused_without_echo() {
    assert_eq!(check(&[]).unwrap().listen_url, None);
    let url = "postgres://app:pw@db:5432/hardcount";
    let config = check(&["--listen-url", url]).unwrap();
    assert_eq!(config.listen_url.as_ref().map(|u| u.expose()), Some(url));
    let err = check(&["--listen-url", "mysql://u:hunter2@db/x"])
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("HARDCOUNT_LISTEN_URL must be"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
}

/// Issue 26, point 5: every setting that holds a secret is a `Secret`, so a
/// `Debug` of the parsed command line or of the serve configuration (what a
/// panic, a `dbg!` or a careless log line would print) shows none of them.
/// Fails when one of those fields goes back to `String`.
#[test]
fn no_secret_setting_reaches_a_debug_print() {
    let seeded = "hunter2-seeded";
    let url = format!("postgres://app:{seeded}@db/hardcount");
    let key = format!("k1:{seeded}");
    let cli = crate::Cli::try_parse_from([
        "hardcount",
        "--database-url",
        &url,
        "--migration-database-url",
        &url,
        "--operator-database-url",
        &url,
        "--secrets-key",
        &key,
        "serve",
        "--smtp-url",
        &format!("smtps://u:{seeded}@mail.example.com"),
        "--listen-url",
        &url,
        "--billing-provider-url",
        "https://api.example.com",
        "--billing-provider-secret-key",
        &format!("sk_{seeded}"),
    ])
    .unwrap();
    let printed = format!("{cli:?}");
    assert!(printed.contains("<redacted>"), "{printed}");
    assert!(!printed.contains(seeded), "{printed}");
    let crate::Command::Serve(settings) = cli.command else {
        unreachable!()
    };
    let config = settings.config(url.clone(), None).unwrap();
    let printed = format!("{config:?}");
    assert!(!printed.contains(seeded), "{printed}");
}

/// Issue 26: an unknown sslmode is refused at start under the name of the
/// variable that gave the URL, which is shown without its password.
#[test]
fn a_database_url_with_an_unknown_sslmode_is_refused_by_its_variable() {
    let url = "postgres://app:hunter2@db/x?sslmode=verify_full";
    let common = |database: Option<&str>, own: Option<&str>| Common {
        database_url: database.map(Secret::from),
        migration_database_url: own.map(Secret::from),
        operator_database_url: own.map(Secret::from),
        secrets_key: None,
        rust_log: String::new(),
        log_format: String::new(),
        otlp_endpoint: None,
    };
    let good = "postgres://app:hunter2@db/x?sslmode=verify-full";
    let rows = [
        (common(Some(url), None).database_url(), "DATABASE_URL: "),
        (
            common(Some(url), None).migration_database_url(),
            "DATABASE_URL: ",
        ),
        (
            common(Some(good), Some(url)).migration_database_url(),
            "MIGRATION_DATABASE_URL: ",
        ),
        (
            common(Some(good), Some(url)).operator_database_url(),
            "HARDCOUNT_OPERATOR_DATABASE_URL: ",
        ),
        (
            check(&["--listen-url", url])
                .map(|_| String::new())
                .map_err(|e| anyhow!(e)),
            "HARDCOUNT_LISTEN_URL: ",
        ),
    ];
    for (got, var) in rows {
        let err = format!("{:#}", got.unwrap_err());
        assert!(err.starts_with(var), "{err}");
        assert!(err.contains("unknown sslmode \"verify_full\""), "{err}");
        assert!(err.contains("postgres://app:***@db/x"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }
    assert_eq!(
        common(Some(good), None).operator_database_url().unwrap(),
        good
    );
}
