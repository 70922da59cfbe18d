//! The leadership schema, exercised as `hardcount_app` through the leg under test.

use db::{Db, Row, sql};
use testbed::TestDb;

const ROLES: [&str; 5] = [
    "billing",
    "dunning",
    "webhook_outbox",
    "email_outbox",
    "webhook_delivery",
];

/// Make `role` held by `holder` for `ttl_ms`, the way ACQUIRE does; returns the token.
async fn hold(db: &Db, role: &str, ttl_ms: f64) -> i64 {
    let row = db
        .fetch_one(
            sql("UPDATE leader_leases SET holder_token = holder_token + 1, holder_id = 'test:1:00000000', \
                 acquired_at = now(), expires_at = now() + make_interval(secs => $2 / 1000.0) \
                 WHERE role = $1 RETURNING holder_token")
            .bind(role.to_owned())
            .bind(ttl_ms),
        )
        .await
        .unwrap();
    row.get("holder_token")
}

async fn fence(db: &Db, role: &str, token: i64) -> bool {
    db.fetch_one(
        sql("SELECT leader_fence($1, $2) AS f")
            .bind(role.to_owned())
            .bind(token),
    )
    .await
    .unwrap()
    .get("f")
}

#[tokio::test]
async fn five_rows_are_seeded_with_epoch_millisecond_tokens() {
    let t = TestDb::new().await;
    let rows = t
        .db
        .fetch_all(sql(
            "SELECT role, holder_token, (extract(epoch FROM now()) * 1000)::int8 AS now_ms, holder_id \
             FROM leader_leases ORDER BY role",
        ))
        .await
        .unwrap();
    let mut roles: Vec<String> = rows.iter().map(|r| r.get("role")).collect();
    roles.sort();
    let mut expected: Vec<String> = ROLES.iter().map(|s| s.to_string()).collect();
    expected.sort();
    assert_eq!(roles, expected);
    for r in &rows {
        let token: i64 = r.get("holder_token");
        let now_ms: i64 = r.get("now_ms");
        assert!(
            now_ms - token >= 0 && now_ms - token < 3_600_000,
            "token {token} is not recent epoch ms"
        );
        assert!(r.get::<Option<String>, _>("holder_id").is_none());
    }
}

#[tokio::test]
async fn each_check_rejects_its_bad_row() {
    let t = TestDb::new().await;
    // The role column is not the app's to write (migration 0003); the owner's
    // write still meets the CHECK.
    let mut su = t.superuser().await;
    let err = sqlx::raw_sql("UPDATE leader_leases SET role = 'nosuch' WHERE role = 'billing'")
        .execute(&mut su)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("leader_leases_role_known"),
        "{err}"
    );
    let cases = [
        (
            "UPDATE leader_leases SET holder_id = 'h:1:00000000' WHERE role = 'billing'",
            "leader_leases_held_has_expiry",
        ),
        (
            "UPDATE leader_leases SET expires_at = now() WHERE role = 'billing'",
            "leader_leases_held_has_expiry",
        ),
        (
            "UPDATE leader_leases SET holder_id = 'h:1:00000000', expires_at = now(), paused_at = now() WHERE role = 'billing'",
            "leader_leases_paused_is_unheld",
        ),
    ];
    for (stmt, constraint) in cases {
        // paused_at is no longer the app's to write (migration 0012): the
        // operator's leader_pause writes it, as the owner.
        if stmt.contains("paused_at") {
            let err = sqlx::raw_sql(sqlx::AssertSqlSafe(stmt))
                .execute(&mut su)
                .await
                .unwrap_err();
            let err = err.as_database_error().expect("a server error");
            assert_eq!(err.code().as_deref(), Some("23514"), "{stmt}: {err}");
            assert_eq!(err.constraint(), Some(constraint), "{stmt}: {err}");
            continue;
        }
        let err = t.db.execute(sql(stmt)).await.unwrap_err();
        assert_eq!(err.code().as_deref(), Some("23514"), "{stmt}: {err}");
        assert_eq!(err.constraint(), Some(constraint), "{stmt}: {err}");
    }
}

#[tokio::test]
async fn the_fence_is_true_only_for_the_current_token_of_a_held_unpaused_unexpired_row() {
    let t = TestDb::new().await;
    let token = hold(&t.db, "webhook_outbox", 60_000.0).await;
    assert!(fence(&t.db, "webhook_outbox", token).await);
    assert!(
        !fence(&t.db, "webhook_outbox", token - 1).await,
        "an older token"
    );
    assert!(
        !fence(&t.db, "webhook_outbox", token + 1).await,
        "a token not yet issued"
    );
    assert!(!fence(&t.db, "email_outbox", token).await, "another role");
    // Expired (a second ago, on the database clock).
    let short = hold(&t.db, "billing", -1000.0).await;
    assert!(!fence(&t.db, "billing", short).await, "an expired lease");
    // Released (unheld).
    t.db.execute(sql("UPDATE leader_leases SET holder_id = NULL, expires_at = NULL WHERE role = 'webhook_outbox'"))
        .await
        .unwrap();
    assert!(
        !fence(&t.db, "webhook_outbox", token).await,
        "a released lease"
    );
}

#[tokio::test]
async fn pause_unholds_and_pauses_in_one_statement_and_the_fence_is_false_from_its_commit() {
    let t = TestDb::new().await;
    let token = hold(&t.db, "email_outbox", 60_000.0).await;
    // Pausing is the operator role's (migration 0012).
    let operator = t.operator();
    let mut tx = operator.begin().await.unwrap();
    tx.execute(sql(
        "SELECT leader_pause('email_outbox', 'ops', 'rotating SMTP key')",
    ))
    .await
    .unwrap();
    // Not yet committed: other sessions still see the lease.
    assert!(fence(&t.db, "email_outbox", token).await);
    tx.commit().await.unwrap();
    assert!(!fence(&t.db, "email_outbox", token).await);
    let row = t
        .db
        .fetch_one(sql(
            "SELECT holder_id, expires_at IS NULL AS unheld, paused_at IS NOT NULL AS paused, paused_by, \
                    paused_by_role, pause_reason, state \
             FROM leader_status WHERE role = 'email_outbox'",
        ))
        .await
        .unwrap();
    assert!(row.get::<Option<String>, _>("holder_id").is_none());
    assert!(row.get::<bool, _>("unheld"));
    assert!(row.get::<bool, _>("paused"));
    assert_eq!(row.get::<String, _>("paused_by"), "ops");
    // Issue 12, point 9: beside the declared name, the login that paused, as
    // the database knows it (session_user, not the function's owner).
    // Catches: recording current_user (`paused_by_session_user`).
    assert_eq!(row.get::<String, _>("paused_by_role"), "hardcount_operator");
    assert_eq!(row.get::<String, _>("pause_reason"), "rotating SMTP key");
    assert_eq!(row.get::<String, _>("state"), "paused");

    operator
        .execute(sql("SELECT leader_unpause('email_outbox')"))
        .await
        .unwrap();
    let row =
        t.db.fetch_one(sql(
            "SELECT paused_at IS NULL AS unpaused, paused_by, paused_by_role, state \
                        FROM leader_status WHERE role = 'email_outbox'",
        ))
        .await
        .unwrap();
    assert!(row.get::<bool, _>("unpaused"));
    assert!(row.get::<Option<String>, _>("paused_by").is_none());
    assert!(row.get::<Option<String>, _>("paused_by_role").is_none());
    assert_eq!(row.get::<String, _>("state"), "idle");
}

#[tokio::test]
async fn pausing_an_unknown_role_names_it() {
    let t = TestDb::new().await;
    for stmt in [
        "SELECT leader_pause('nosuch', 'ops', 'why')",
        "SELECT leader_unpause('nosuch')",
        "SELECT leader_clear_cooldown('nosuch')",
    ] {
        let err = t
            .operator()
            .execute(sql(stmt))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown role \"nosuch\""), "{err}");
    }
}

#[tokio::test]
async fn the_app_role_cannot_insert_delete_truncate_alter_or_drop_and_owns_nothing() {
    let t = TestDb::new().await;
    let denied = [
        // docs/adr/0002: the app never INSERTs a lease row; ACQUIRE is an UPDATE.
        "INSERT INTO leader_leases (role, holder_token) VALUES ('billing', 1)",
        "DELETE FROM leader_leases WHERE role = 'billing'",
        "TRUNCATE leader_leases",
        "ALTER TABLE leader_leases ADD COLUMN x int",
        "ALTER TABLE leader_leases DROP CONSTRAINT leader_leases_role_known",
        "DROP VIEW leader_status",
        "DROP FUNCTION leader_fence(text, bigint)",
        "CREATE OR REPLACE FUNCTION leader_fence(p_role text, p_token bigint) RETURNS boolean LANGUAGE sql AS 'SELECT true'",
        "DROP TABLE leader_leases",
        "CREATE TABLE sneaky (x int)",
        "DELETE FROM _sqlx_migrations",
        "UPDATE leader_leases SET role = 'dunning2' WHERE role = 'dunning'",
    ];
    for stmt in denied {
        let err = t.db.execute(sql(stmt)).await.unwrap_err();
        assert_eq!(
            err.code().as_deref(),
            Some("42501"),
            "{stmt} was not refused for lack of privilege: {err}"
        );
    }
    let owned =
        t.db.fetch_one(sql(
            "SELECT (SELECT count(*) FROM pg_class WHERE relowner = r.oid) \
                  + (SELECT count(*) FROM pg_proc WHERE proowner = r.oid) \
                  + (SELECT count(*) FROM pg_namespace WHERE nspowner = r.oid) \
                  + (SELECT count(*) FROM pg_type WHERE typowner = r.oid) AS n, \
                    r.rolsuper OR r.rolcreaterole OR r.rolcreatedb AS powerful, \
                    current_user::text AS me \
             FROM pg_roles r WHERE r.rolname = 'hardcount_app'",
        ))
        .await
        .unwrap();
    assert_eq!(owned.get::<String, _>("me"), "hardcount_app");
    assert_eq!(owned.get::<i64, _>("n"), 0, "hardcount_app owns something");
    assert!(!owned.get::<bool, _>("powerful"));
}

/// Migration 0003: a token only grows, so the app cannot reissue one a fence
/// already saw. Mutation check: dropping the trigger lets the UPDATE through.
#[tokio::test]
async fn a_lease_token_can_only_grow() {
    let t = TestDb::new().await;
    let err =
        t.db.execute(sql(
            "UPDATE leader_leases SET holder_token = holder_token - 1 WHERE role = 'billing'",
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code().as_deref(), Some("23514"), "{err}");
    assert!(err.to_string().contains("may only grow"), "{err}");
    let grew =
        t.db.execute(sql(
            "UPDATE leader_leases SET holder_token = holder_token + 1 WHERE role = 'billing'",
        ))
        .await
        .unwrap();
    assert_eq!(grew, 1);
}

/// Issue 14, item 3 (migration 0004): the fence reads the statement's clock.
/// A claim in a transaction begun while the lease was live, run after it
/// expired, finds the fence false, as the same claim in a fresh transaction
/// does.
///
/// Mutation check (`fence_statement_clock` in scripts/mutation-check): going
/// back to `expires_at > now()` (the transaction's start) makes the stalled
/// claim pass the fence; checked by hand, this test then fails.
#[tokio::test]
async fn the_fence_in_a_transaction_begun_before_expiry_is_false_after_it() {
    let t = TestDb::new().await;
    let token = hold(&t.db, "email_outbox", 400.0).await;
    let mut tx = t.db.begin().await.unwrap();
    let live: bool = tx
        .fetch_one(
            sql("SELECT leader_fence($1, $2) AS f")
                .bind("email_outbox")
                .bind(token),
        )
        .await
        .unwrap()
        .get("f");
    assert!(live, "the fence holds while the lease is live");
    // The lease expires now, after the transaction began (moved on the
    // database clock from another session rather than waited for).
    t.db.execute(sql(
        "UPDATE leader_leases SET expires_at = clock_timestamp() WHERE role = 'email_outbox'",
    ))
    .await
    .unwrap();
    let stale: bool = tx
        .fetch_one(
            sql("SELECT leader_fence($1, $2) AS f")
                .bind("email_outbox")
                .bind(token),
        )
        .await
        .unwrap()
        .get("f");
    tx.commit().await.unwrap();
    assert!(
        !stale,
        "a claim in a transaction begun before expiry passed the fence after it"
    );
    assert!(!fence(&t.db, "email_outbox", token).await);
}

/// Issue 12, point 9 (migration 0007): a token past the ceiling (one year of
/// milliseconds ahead of the clock) is refused, even for the owner, so no one can
/// wedge a role by setting a token whose successor overflows bigint. Fails
/// without the `leader_leases_token_bounded` trigger (checked: the UPDATE went
/// through).
#[tokio::test]
async fn a_lease_token_past_the_ceiling_is_refused() {
    let t = TestDb::new().await;
    let mut owner = t.superuser().await;
    let err = sqlx::raw_sql(
        "UPDATE leader_leases SET holder_token = 9223372036854775807 WHERE role = 'billing'",
    )
    .execute(&mut owner)
    .await
    .unwrap_err();
    assert!(err.to_string().contains("past the ceiling"), "{err}");
    let grew =
        t.db.execute(sql(
            "UPDATE leader_leases SET holder_token = \
             (extract(epoch FROM clock_timestamp()) * 1000)::bigint + 86400000 WHERE role = 'billing'",
        ))
        .await
        .unwrap();
    assert_eq!(grew, 1, "a token a day ahead is within the ceiling");
}

/// Issue 12, point 9 (migration 0007), and issue 26, point 3 (migration
/// 0023): every function in the schema has the one fixed `search_path`,
/// `pg_catalog, public, pg_temp` (`pg_temp` last: otherwise Postgres searches
/// the caller's temp tables first), or a standard SQL body, bound when it was
/// created; and no role but the owner may create objects in `public`.
/// Fails if an `ALTER FUNCTION … SET search_path` is missing (checked by
/// dropping one; on the schema of migration 0022 it listed every function
/// but `billing_settle_attempt`) or a new function is added without one.
/// The definer functions' own test is `definers.rs`. (The CREATE revoke is
/// Postgres 15's default for new databases, so on the test bed it pins the
/// state rather than the statement.)
#[tokio::test]
async fn every_function_has_a_fixed_search_path_and_public_takes_no_new_objects() {
    let t = TestDb::new().await;
    let loose: Vec<String> =
        t.db.fetch_all(sql("SELECT p.proname::text AS name FROM pg_proc p \
             JOIN pg_namespace n ON n.oid = p.pronamespace \
             WHERE n.nspname = 'public' \
               AND NOT (p.prosqlbody IS NOT NULL AND NOT p.prosecdef) \
               AND NOT EXISTS (SELECT 1 FROM unnest(coalesce(p.proconfig, '{}')) c \
                               WHERE c = 'search_path=pg_catalog, public, pg_temp') \
             ORDER BY 1"))
            .await
            .unwrap()
            .iter()
            .map(|r| r.get("name"))
            .collect();
    assert_eq!(
        loose,
        Vec::<String>::new(),
        "functions without the fixed search_path"
    );
    let can_create: bool =
        t.db.fetch_one(sql(
            "SELECT has_schema_privilege('hardcount_app', 'public', 'CREATE') \
                 OR has_schema_privilege('public', 'public', 'CREATE') AS c",
        ))
        .await
        .unwrap()
        .get("c");
    assert!(!can_create);
}

/// Issue 12, point 9 (migration 0007): what a pause records is bounded even
/// when `leader_pause` is called directly. Fails without the constraints.
#[tokio::test]
async fn a_pause_reason_past_500_characters_is_refused_by_the_table() {
    let t = TestDb::new().await;
    let long = "x".repeat(501);
    let err = t
        .operator()
        .execute(sql("SELECT leader_pause('billing', 'oncall', $1)").bind(long))
        .await
        .unwrap_err();
    assert_eq!(
        err.constraint(),
        Some("leader_leases_pause_reason_bounded"),
        "{err}"
    );
}
