//! `secrets rotate-key` and `generate-key`, and `serve` with the secrets key
//! missing or unable to open a stored secret.

use db::Row;
use testbed::{Leg, TestDb};

use std::time::Duration;

use super::run_until;
use crate::{hardcount, run, text};

/// Issue 12, point 2, and issue 26, point 4: `serve` refuses to run webhook
/// delivery without any key while endpoints exist, naming
/// HARDCOUNT_SECRETS_KEY; a secret stored in clear (before migration 0012),
/// or sealed under a key this replica does not hold, no longer stops it: it
/// starts, says which rows and what to run, and only those endpoints wait.
/// `hardcount secrets rotate-key` seals clear secrets, a key rotation reseals
/// every secret under the new key, and a row that does not open with the
/// keys given is skipped and named (the command exits non-zero) while the
/// others are resealed. The secret itself never changes (receivers notice
/// nothing).
///
/// Catches: serve not checking the stored secrets (`serve_secrets_check`:
/// the refusal without a key turns into a running server, killed by the
/// limit), and a boot check that still refuses for one row (the started
/// server's warning is then a refusal).
#[tokio::test]
async fn secrets_rotate_key_seals_clear_secrets_and_serve_runs_past_a_secret_it_cannot_open() {
    use webhook_delivery::Keyring;
    let t = TestDb::new().await;
    let clear = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let mut su = t.superuser().await;
    sqlx::query(
        "INSERT INTO webhook_endpoints (tenant_id, url, secret) VALUES ('tenant_a', 'https://a.example.com/', $1)",
    )
    .bind(clear)
    .execute(&mut su)
    .await
    .unwrap();
    let serve_cmd = |key: Option<&str>| {
        let mut cmd = hardcount();
        cmd.arg("serve")
            .env("DATABASE_URL", t.app_url(Leg::current()))
            .env("HARDCOUNT_ROLES", "webhook_delivery")
            .env("HARDCOUNT_HTTP_ADDR", "127.0.0.1:0");
        if let Some(key) = key {
            cmd.env("HARDCOUNT_SECRETS_KEY", key);
        }
        cmd
    };
    let refused = |key: Option<&str>| {
        let out = run(&mut serve_cmd(key), Duration::from_secs(20));
        let all = text(&out);
        assert_eq!(out.status.code(), Some(1), "{all}");
        assert!(all.contains("refusing to serve"), "{all}");
        all
    };
    // Started: the warning naming the rows is printed, and the server runs
    // until stopped (it is killed once the line is seen).
    let started_with = |key: &str, needle: &str| {
        let all = run_until(&mut serve_cmd(Some(key)), needle, Duration::from_secs(20));
        assert!(
            all.contains(needle) && !all.contains("refusing to serve"),
            "{all}"
        );
        all
    };
    let secrets_out = |args: &[&str], key: &str| {
        run(
            hardcount()
                .arg("secrets")
                .args(args)
                .env("MIGRATION_DATABASE_URL", t.superuser_url())
                .env("HARDCOUNT_SECRETS_KEY", key),
            Duration::from_secs(20),
        )
    };
    let secrets = |args: &[&str], key: &str| {
        let out = secrets_out(args, key);
        assert!(out.status.success(), "{}", text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let stored = async |su: &mut sqlx::PgConnection| -> (Option<String>, String, Vec<u8>) {
        let row =
            sqlx::query("SELECT secret, secret_key_id, secret_ciphertext FROM webhook_endpoints")
                .fetch_one(su)
                .await
                .unwrap();
        (row.get(0), row.get(1), row.get(2))
    };

    let all = refused(None);
    assert!(all.contains("HARDCOUNT_SECRETS_KEY is not set"), "{all}");
    let all = started_with(testbed::SECRETS_KEY, "hardcount secrets rotate-key");
    assert!(all.contains("in clear"), "{all}");

    let said = secrets(&["rotate-key"], testbed::SECRETS_KEY);
    assert!(
        said.contains("resealed the secrets of 1 webhook endpoint"),
        "{said}"
    );
    let (in_clear, key_id, sealed) = stored(&mut su).await;
    assert_eq!((in_clear, key_id.as_str()), (None, "test"));
    let test_key = Keyring::parse(testbed::SECRETS_KEY).unwrap();
    assert_eq!(
        test_key.open("tenant_a", "test", &sealed).unwrap().expose(),
        clear
    );
    // A second run has nothing to do.
    let said = secrets(&["rotate-key"], testbed::SECRETS_KEY);
    assert!(
        said.contains("resealed the secrets of 0 webhook endpoint"),
        "{said}"
    );

    // Rotate to a new key: listed first, the old one after it.
    let k2 = secrets(&["generate-key", "--id", "k2"], testbed::SECRETS_KEY);
    let k2 = k2.trim();
    assert!(k2.starts_with("k2:") && !k2.contains(','), "{k2}");
    secrets(&["rotate-key"], &format!("{k2},{}", testbed::SECRETS_KEY));
    let (_, key_id, sealed) = stored(&mut su).await;
    assert_eq!(key_id, "k2");
    let new_key = Keyring::parse(k2).unwrap();
    assert_eq!(
        new_key.open("tenant_a", "k2", &sealed).unwrap().expose(),
        clear
    );

    let all = started_with(testbed::SECRETS_KEY, "HARDCOUNT_SECRETS_KEY does not hold");
    assert!(all.contains("key id(s) [\"k2\"]"), "{all}");
    assert!(!all.contains(k2.split(':').nth(1).unwrap()), "{all}");

    // Rotating back to the test key without k2 listed: the row does not
    // open, so it is skipped and named, and the command says so.
    let out = secrets_out(&["rotate-key"], testbed::SECRETS_KEY);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(
        all.contains("skipped webhook endpoint") && all.contains("1 webhook endpoint(s) skipped"),
        "{all}"
    );
    let (_, key_id, _) = stored(&mut su).await;
    assert_eq!(key_id, "k2", "a skipped row is left as it was");
}
