//! `migrate`, and `serve`'s refusal of a schema that is not migrated to its
//! version.

use testbed::{Leg, TestDb};

use std::time::Duration;

use crate::{hardcount, run, text};

#[tokio::test]
async fn migrate_applies_then_a_second_run_is_a_no_op() {
    let t = TestDb::unmigrated(1).await;
    let first = hardcount()
        .arg("migrate")
        .env("MIGRATION_DATABASE_URL", t.superuser_url())
        .output()
        .unwrap();
    assert!(first.status.success(), "{}", text(&first));
    assert!(
        String::from_utf8_lossy(&first.stdout).contains("applied"),
        "{}",
        text(&first)
    );
    // Falls back to DATABASE_URL when MIGRATION_DATABASE_URL is unset.
    let second = hardcount()
        .arg("migrate")
        .env("DATABASE_URL", t.superuser_url())
        .output()
        .unwrap();
    assert!(second.status.success(), "{}", text(&second));
    assert!(
        String::from_utf8_lossy(&second.stdout).contains("nothing to do"),
        "{}",
        text(&second)
    );
}

/// Issue 12, point 4: `hardcount migrate` printed a password given as a query
/// parameter, and `?application_name=a@b` garbled the redaction. Fails if the
/// redactor pattern-matches on `@` or ignores the query (checked: the old
/// `redact_url` printed `hunter2` for the second and third rows).
#[tokio::test]
async fn migrate_names_an_unreachable_database_and_hides_its_password() {
    let port = testbed::free_port();
    let rows = [
        (
            format!("postgres://owner:hunter2@127.0.0.1:{port}/x"),
            format!("postgres://owner:***@127.0.0.1:{port}/x"),
        ),
        (
            format!("postgres://owner@127.0.0.1:{port}/x?password=hunter2"),
            format!("postgres://owner@127.0.0.1:{port}/x?password=***"),
        ),
        (
            format!("postgres://owner@127.0.0.1:{port}/x?application_name=a@b&password=hunter2"),
            format!("postgres://owner@127.0.0.1:{port}/x?application_name=a@b&password=***"),
        ),
        (
            format!("postgres://owner:hunter2@127.0.0.1:{port}/x?application_name=a@b"),
            format!("postgres://owner:***@127.0.0.1:{port}/x?application_name=a@b"),
        ),
    ];
    for (url, shown) in rows {
        let out = hardcount()
            .arg("migrate")
            .env("MIGRATION_DATABASE_URL", &url)
            .output()
            .unwrap();
        let all = text(&out);
        assert_eq!(out.status.code(), Some(1), "{all}");
        assert!(
            all.contains(&format!(
                "cannot connect to the migration database at {shown}:"
            )),
            "{url}: {all}"
        );
        assert!(!all.contains("hunter2"), "{url}: {all}");
    }
}

#[tokio::test]
async fn migrate_through_a_transaction_pooler_says_it_needs_a_direct_connection() {
    let t = TestDb::unmigrated(1).await;
    let url = format!("postgres://postgres@{}/{}", Leg::PgBouncer.addr(), t.name());
    let mut last = String::new();
    for _ in 0..3 {
        let out = hardcount()
            .arg("migrate")
            .env("MIGRATION_DATABASE_URL", &url)
            .output()
            .unwrap();
        last = text(&out);
        if !out.status.success() {
            break;
        }
    }
    assert!(
        last.contains("migrations need a direct or session-mode connection"),
        "{last}"
    );
}

#[tokio::test]
async fn serve_refuses_an_unmigrated_database() {
    let t = TestDb::unmigrated(1).await;
    let out = run(
        hardcount()
            .arg("serve")
            .env("DATABASE_URL", t.superuser_url())
            .env("HARDCOUNT_HTTP_ADDR", "127.0.0.1:0"),
        Duration::from_secs(20),
    );
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(
        all.contains("refusing to serve") && all.contains("run `hardcount migrate` first"),
        "{all}"
    );
}

#[tokio::test]
async fn serve_refuses_a_schema_behind_and_names_the_missing_migration() {
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    let (version, description): (i64, String) =
        sqlx::query_as("DELETE FROM _sqlx_migrations WHERE version = (SELECT max(version) FROM _sqlx_migrations) RETURNING version, description")
            .fetch_one(&mut su)
            .await
            .unwrap();
    let out = run(
        hardcount()
            .arg("serve")
            .env("DATABASE_URL", t.app_url(Leg::current()))
            .env("HARDCOUNT_HTTP_ADDR", "127.0.0.1:0"),
        Duration::from_secs(20),
    );
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    let name = format!("migration {version:04}_{}", description.replace(' ', "_"));
    assert!(all.contains(&name), "expected {name:?} in {all}");
}
