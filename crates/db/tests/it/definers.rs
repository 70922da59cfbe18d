//! Definer functions cannot be hijacked (issue 26, point 3; migration 0023,
//! docs/adr/0031). A `SECURITY DEFINER` function runs as its owner, so the
//! names in its body must resolve to the owner's objects whoever calls it.
//! Postgres searches the caller's temporary schema *first* for tables, views
//! and types unless the function's `search_path` names `pg_temp`, and every
//! login role may create temp tables (PUBLIC's `TEMPORARY` on the database);
//! PostgreSQL's rule is to name `pg_temp` last.

use db::{Row, sql};
use sqlx::Connection;
use testbed::TestDb;

/// Every definer function outside the system schemas whose `search_path` is
/// unsafe, with why: none set, `pg_temp` not last, or an entry before it that
/// someone other than the function's owner (a non-superuser role that logs
/// in, or PUBLIC) could put objects in — a schema they may `CREATE` in, one
/// that does not exist yet, or `$user`.
const UNSAFE_DEFINERS: &str = "\
WITH f AS (
    SELECT p.oid::regprocedure::text AS function, p.proowner AS owner,
           (SELECT string_to_array(replace(replace(substr(c, length('search_path=') + 1), ' ', ''), '\"', ''), ',')
            FROM unnest(p.proconfig) AS c WHERE c LIKE 'search_path=%') AS path
    FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
    WHERE p.prosecdef AND n.nspname NOT IN ('pg_catalog', 'information_schema')
), entry AS (
    SELECT f.function, f.owner, e.schema, ns.oid AS ns
    FROM f, unnest(f.path[1:cardinality(f.path) - 1]) AS e(schema)
    LEFT JOIN pg_namespace ns ON ns.nspname = e.schema
    WHERE e.schema <> 'pg_catalog'
)
SELECT function, 'no search_path' AS why FROM f WHERE path IS NULL
UNION ALL
SELECT function, 'pg_temp is not last' FROM f
WHERE path IS NOT NULL AND path[cardinality(path)] IS DISTINCT FROM 'pg_temp'
UNION ALL
SELECT function, schema || ' comes before the end' FROM entry WHERE schema = 'pg_temp'
UNION ALL
SELECT function, '$user is on the path' FROM entry WHERE schema = '$user'
UNION ALL
SELECT function, 'schema ' || schema || ' does not exist' FROM entry
WHERE ns IS NULL AND schema NOT IN ('pg_temp', '$user')
UNION ALL
SELECT function, 'schema ' || schema || ' takes objects from ' || w.who FROM entry,
LATERAL (SELECT string_agg(r, ', ' ORDER BY r) AS who
         FROM (SELECT 'PUBLIC' AS r WHERE has_schema_privilege('public', ns, 'CREATE')
               UNION ALL
               SELECT rolname::text FROM pg_roles
               WHERE rolcanlogin AND NOT rolsuper AND oid <> entry.owner
                 AND has_schema_privilege(oid, ns, 'CREATE')) AS writers) AS w
WHERE ns IS NOT NULL AND w.who IS NOT NULL
ORDER BY 1, 2";

/// Issue 26, point 3 (migration 0023). As `hardcount_operator`, a temp table
/// named `leader_leases` (with a row for `billing`) and a temp `now()`; then
/// `leader_pause` and `leader_unpause`. The real row is paused and unpaused,
/// on the real clock; the temp table is left as it was.
///
/// A function in `pg_temp` is never found by an unqualified call (Postgres
/// looks up functions and operators there only when the call names
/// `pg_temp.`), so the temp `now()` is not called even without migration 0023;
/// it is here to show that. The temp table is what 0023 fixes: seen failing
/// on the schema of migration 0022 (the test run before 0023 was written):
/// `leader_pause`, running as the owner with `search_path = pg_catalog,
/// public`, updated the temp table and left `billing` unpaused.
///
/// All in one transaction, rolled back: through PgBouncer in transaction mode
/// a temp object must not outlive it, and nothing is left on the server
/// connection.
#[tokio::test]
async fn a_temp_table_shadowing_leader_leases_does_not_catch_the_operators_pause() {
    let t = TestDb::new().await;
    let op = t.operator();
    let mut tx = op.begin().await.unwrap();
    let me: String = tx
        .fetch_one(sql("SELECT current_user::text AS me"))
        .await
        .unwrap()
        .get("me");
    assert_eq!(me, "hardcount_operator");
    tx.execute(sql(
        "CREATE TEMP TABLE leader_leases (role text PRIMARY KEY, holder_id text, \
         expires_at timestamptz, paused_at timestamptz, paused_by text, paused_by_role text, \
         pause_reason text, not_before timestamptz)",
    ))
    .await
    .unwrap();
    tx.execute(sql(
        "INSERT INTO pg_temp.leader_leases (role, paused_at, not_before) \
         VALUES ('billing', NULL, now() + interval '1 hour'), \
         ('dunning', '2000-01-01 00:00:00+00', NULL)",
    ))
    .await
    .unwrap();
    tx.execute(sql(
        "CREATE FUNCTION pg_temp.now() RETURNS timestamptz LANGUAGE sql \
         AS $$ SELECT timestamptz '2000-01-01 00:00:00+00' $$",
    ))
    .await
    .unwrap();

    tx.execute(sql("SELECT leader_pause('billing', 'mallory', 'shadowed')"))
        .await
        .unwrap();
    // leader_status is a view: bound to public.leader_leases when created.
    let real = tx
        .fetch_one(sql(
            "SELECT state, paused_by, paused_at > timestamptz '2001-01-01 00:00:00+00' AS real_clock \
             FROM leader_status WHERE role = 'billing'",
        ))
        .await
        .unwrap();
    assert_eq!(
        real.get::<String, _>("state"),
        "paused",
        "leader_pause wrote the temp table, not the real lease row"
    );
    assert_eq!(real.get::<String, _>("paused_by"), "mallory");
    assert!(
        real.get::<bool, _>("real_clock"),
        "leader_pause called the temp now()"
    );

    // The real dunning row is unpaused already; unpausing it must not reach the
    // temp row that claims a pause.
    tx.execute(sql("SELECT leader_unpause('dunning')"))
        .await
        .unwrap();
    let temp = tx
        .fetch_all(sql(
            "SELECT role, paused_at IS NULL AS unpaused, paused_by IS NULL AS no_one \
             FROM pg_temp.leader_leases ORDER BY role",
        ))
        .await
        .unwrap();
    let temp: Vec<(String, bool, bool)> = temp
        .iter()
        .map(|r| (r.get("role"), r.get("unpaused"), r.get("no_one")))
        .collect();
    assert_eq!(
        temp,
        [
            ("billing".to_owned(), true, true),
            ("dunning".to_owned(), false, true)
        ],
        "a definer function wrote the caller's temp table"
    );

    // Migration 0028: clearing a cooldown reaches the real rows too. The temp
    // table has no webhook_outbox row (a function reading it would refuse the
    // role as unknown) and a billing row cooling down (left as it was).
    tx.execute(sql("SELECT leader_clear_cooldown('webhook_outbox')"))
        .await
        .unwrap();
    tx.execute(sql("SELECT leader_clear_cooldown('billing')"))
        .await
        .unwrap();
    let cooling: bool = tx
        .fetch_one(sql(
            "SELECT not_before IS NOT NULL AS cooling FROM pg_temp.leader_leases WHERE role = 'billing'",
        ))
        .await
        .unwrap()
        .get("cooling");
    assert!(
        cooling,
        "leader_clear_cooldown wrote the caller's temp table"
    );
    tx.rollback().await.unwrap();
}

/// Issue 26, point 3 (migration 0023): every `SECURITY DEFINER` function has
/// a `search_path` that ends in `pg_temp` and whose other entries no role but
/// the owner can put objects in. Seen failing on the schema of migration 0022
/// (`leader_pause` and `leader_unpause`: `pg_temp is not last`).
///
/// The check itself is checked each run: three definer functions made wrong
/// on purpose, as the owner inside a transaction that is rolled back, are each
/// found with the right reason.
#[tokio::test]
async fn every_definer_function_has_a_search_path_ending_in_pg_temp() {
    let t = TestDb::new().await;
    let found: Vec<(String, String)> =
        t.db.fetch_all(sql(UNSAFE_DEFINERS))
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get("function"), r.get("why")))
            .collect();
    assert_eq!(
        found,
        Vec::<(String, String)>::new(),
        "definer functions with an unsafe search_path"
    );
    let n: i64 =
        t.db.fetch_one(sql("SELECT count(*) AS n FROM pg_proc \
             WHERE prosecdef AND pronamespace = 'public'::regnamespace"))
            .await
            .unwrap()
            .get("n");
    assert!(
        n >= 4,
        "leader_pause, leader_unpause, leader_clear_cooldown, billing_settle_attempt: {n}"
    );

    let mut su = t.superuser().await;
    let mut tx = su.begin().await.unwrap();
    for stmt in [
        "CREATE FUNCTION definer_without_pg_temp() RETURNS int LANGUAGE sql SECURITY DEFINER \
         SET search_path = pg_catalog, public AS 'SELECT 1'",
        "CREATE FUNCTION definer_without_path() RETURNS int LANGUAGE sql SECURITY DEFINER \
         AS 'SELECT 1'",
        "CREATE SCHEMA open_to_the_app",
        "GRANT CREATE ON SCHEMA open_to_the_app TO hardcount_app",
        "CREATE FUNCTION definer_on_an_open_schema() RETURNS int LANGUAGE sql SECURITY DEFINER \
         SET search_path = open_to_the_app, pg_catalog, pg_temp AS 'SELECT 1'",
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(stmt))
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    let found: Vec<(String, String)> = sqlx::query_as(UNSAFE_DEFINERS)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(
        found,
        [
            (
                "definer_on_an_open_schema()".to_owned(),
                "schema open_to_the_app takes objects from hardcount_app".to_owned()
            ),
            (
                "definer_without_path()".to_owned(),
                "no search_path".to_owned()
            ),
            (
                "definer_without_pg_temp()".to_owned(),
                "pg_temp is not last".to_owned()
            ),
        ]
    );
}
