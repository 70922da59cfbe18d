use db::{MigrateError, check_schema_ready};
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use testbed::{Leg, TestDb};

#[tokio::test]
async fn a_second_migrate_is_a_no_op() {
    let t = TestDb::new().await;
    let again = db::migrate(&t.superuser_url()).await.unwrap();
    assert!(again.applied.is_empty(), "{again:?}");
    assert!(again.already >= 1);
    check_schema_ready(&t.db).await.unwrap();
}

#[tokio::test]
async fn an_unreachable_database_is_a_clear_error_without_the_password() {
    let port = testbed::free_port();
    let err = db::migrate(&format!("postgres://owner:s3cret@127.0.0.1:{port}/x"))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, MigrateError::Connect { .. }), "{text}");
    assert!(
        text.contains("cannot connect to the migration database"),
        "{text}"
    );
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    assert!(!text.contains("s3cret"), "{text}");
}

#[tokio::test]
async fn serve_refuses_an_unmigrated_database_and_names_the_missing_migration() {
    let t = TestDb::new().await;
    // Forget the last migration, as if this binary were newer than the schema.
    let mut su = t.superuser().await;
    let last: i64 = sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations")
        .fetch_one(&mut su)
        .await
        .unwrap();
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = $1")
        .bind(last)
        .execute(&mut su)
        .await
        .unwrap();
    let err = check_schema_ready(&t.db).await.unwrap_err().to_string();
    assert!(
        err.contains(&format!("migration {last:04}_"))
            || err.contains(&format!("migration {last}_")),
        "{err}"
    );
    assert!(err.contains("hardcount migrate"), "{err}");
}

/// Migrating through PgBouncer in transaction mode is reported as such.
/// sqlx's migrator takes a session advisory lock and uses named statements; the
/// first run may get through, a later one fails.
#[tokio::test]
async fn migrating_through_a_transaction_pooler_is_reported_as_such() {
    let t = TestDb::new().await;
    let url = format!("postgres://postgres@{}/{}", Leg::PgBouncer.addr(), t.name());
    let mut saw = None;
    for _ in 0..3 {
        if let Err(e) = db::migrate(&url).await {
            saw = Some(e);
            break;
        }
    }
    let err = saw.expect("three migrate runs through PgBouncer all succeeded");
    let text = err.to_string();
    assert!(
        matches!(err, MigrateError::ThroughTransactionPooler { .. }),
        "{text}"
    );
    assert!(text.contains("direct or session-mode connection"), "{text}");
    // Nothing was lost or half-applied: the schema is still complete.
    check_schema_ready(&t.db).await.unwrap();
    let _ = PgConnection::connect(&t.superuser_url())
        .await
        .unwrap()
        .close()
        .await;
}
