//! The bed is real: the project's access path survives transaction pooling, and
//! sqlx's plain paths do not.

use std::time::Duration;

use db::{Db, Row, sql};
use futures::future::join_all;
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};
use testbed::{Leg, TestDb};

const CONCURRENCY: i64 = 240;

/// Query `i % 6` of six distinct SQL texts, each computing a value from `i` that
/// no other text computes, so a statement run with another's parameters shows.
async fn through_access_path(db: &Db, i: i64) -> Result<(i64, i64), db::Error> {
    let (expected, row) = match i % 6 {
        0 => (
            i + 1,
            db.fetch_one(sql("SELECT $1::int8 + 1 AS v").bind(i))
                .await?,
        ),
        1 => (
            i * 3,
            db.fetch_one(sql("SELECT $1::int8 * 3 AS v").bind(i))
                .await?,
        ),
        2 => (
            i * 1000 + 7,
            db.fetch_one(
                sql("SELECT $1::int8 * 1000 + $2::int8 AS v")
                    .bind(i)
                    .bind(7_i64),
            )
            .await?,
        ),
        3 => (
            i - 5,
            db.fetch_one(
                sql("SELECT v FROM (SELECT $1::int8 - 5 AS v, pg_sleep(0.001)) s").bind(i),
            )
            .await?,
        ),
        4 => (
            i.to_string().len() as i64,
            db.fetch_one(sql("SELECT length($1::text)::int8 AS v").bind(i.to_string()))
                .await?,
        ),
        _ => (
            -i,
            db.fetch_one(sql("SELECT (-1 * $1::int8) AS v, 'filler'::text AS w").bind(i))
                .await?,
        ),
    };
    Ok((expected, row.try_get::<i64, _>("v")?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn access_path_returns_every_value_right_under_pooled_concurrency() {
    // Pool of 5 for 240 concurrent queries, and through PgBouncer a server pool of 4.
    let t = TestDb::with_pool(5).await;
    let results = join_all((0..CONCURRENCY).map(|i| {
        let db = t.db.clone();
        async move { through_access_path(&db, i).await }
    }))
    .await;
    for (i, r) in results.into_iter().enumerate() {
        let (expected, got) = r.unwrap_or_else(|e| panic!("query {i} failed: {e}"));
        assert_eq!(got, expected, "query {i} returned another query's value");
    }
}

/// Negative control: sqlx's plain unnamed-statement path, outside a transaction,
/// through PgBouncer. If PgBouncer were not really in the path (or not in
/// transaction mode), every value would come back right and this test fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plain_unnamed_statements_go_wrong_through_pgbouncer() {
    let t = TestDb::new().await;
    let options: PgConnectOptions = t.app_url(Leg::PgBouncer).parse().unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(5)
        .connect_with(options.statement_cache_capacity(0).extra_float_digits(None))
        .await
        .unwrap();
    let texts = [
        "SELECT $1::int8 + 1",
        "SELECT $1::int8 * 3",
        "SELECT $1::int8 - 5",
        "SELECT (-1 * $1::int8)",
    ];
    let mut broken = 0;
    for _round in 0..5 {
        let results = join_all((0..CONCURRENCY).map(|i| {
            let pool = pool.clone();
            let text = texts[(i % 4) as usize];
            async move {
                let got: Result<i64, _> = sqlx::query_scalar(text)
                    .persistent(false)
                    .bind(i)
                    .fetch_one(&pool)
                    .await;
                let expected = match i % 4 {
                    0 => i + 1,
                    1 => i * 3,
                    2 => i - 5,
                    _ => -i,
                };
                got.map(|v| v == expected).unwrap_or(false)
            }
        }))
        .await;
        broken += results.iter().filter(|ok| !**ok).count();
        if broken > 0 {
            break;
        }
    }
    assert!(
        broken > 0,
        "every plain unnamed statement came back right through PgBouncer: is it really in the path, in transaction mode?"
    );
}

#[tokio::test]
async fn a_session_advisory_lock_holds_directly_but_not_through_pgbouncer() {
    let t = TestDb::new().await;
    // Directly: the lock is the session's; the session's next statement sees it
    // and another session is refused.
    {
        let mut a = connect(&t.app_url(Leg::Direct)).await;
        let mut b = connect(&t.app_url(Leg::Direct)).await;
        simple(&mut a, "SELECT pg_advisory_lock(42)").await;
        let mine = simple(
            &mut a,
            "SELECT count(*)::text FROM pg_locks WHERE locktype = 'advisory' AND objid = 42 AND pid = pg_backend_pid()",
        )
        .await;
        assert_eq!(
            mine, "1",
            "directly, the lock is held on the next statement"
        );
        assert_eq!(
            simple(&mut b, "SELECT pg_try_advisory_lock(42)::text").await,
            "false"
        );
        simple(&mut a, "SELECT pg_advisory_unlock(42)").await;
    }
    // Through PgBouncer: the lock belongs to whichever server connection ran the
    // statement, which goes back to the pool. The next client handed that
    // connection "takes" the same lock: it protects nothing.
    let mut a = connect(&t.app_url(Leg::PgBouncer)).await;
    let mut b = connect(&t.app_url(Leg::PgBouncer)).await;
    let a_pid = simple(
        &mut a,
        "SELECT pg_backend_pid()::text FROM (SELECT pg_advisory_lock(43)) l",
    )
    .await;
    let b_pid = simple(&mut b, "SELECT pg_backend_pid()::text").await;
    assert_eq!(
        a_pid, b_pid,
        "PgBouncer gave the idle server connection to the next client"
    );
    assert_eq!(
        simple(&mut b, "SELECT pg_try_advisory_lock(43)::text").await,
        "true",
        "through PgBouncer another client acquired a lock a first client holds"
    );
    // The lock is stranded on the server connection, with no client holding it.
    let mut su = t.superuser().await;
    let stranded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 43",
    )
    .persistent(false)
    .fetch_one(&mut su)
    .await
    .unwrap();
    assert!(stranded >= 1);
}

async fn connect(url: &str) -> PgConnection {
    let options: PgConnectOptions = url.parse().unwrap();
    PgConnection::connect_with(&options.statement_cache_capacity(0).extra_float_digits(None))
        .await
        .unwrap()
}

/// One statement over the simple protocol; its first column as text.
async fn simple(conn: &mut PgConnection, text: &'static str) -> String {
    use sqlx::Row as _;
    let rows = sqlx::raw_sql(text).fetch_all(&mut *conn).await.unwrap();
    rows.first()
        .and_then(|r| r.try_get::<String, _>(0).ok())
        .unwrap_or_default()
}

#[tokio::test]
async fn a_statement_timeout_is_enforced_by_the_server_and_leaks_to_no_one() {
    let t = TestDb::with_pool(1).await;
    let mut tx =
        t.db.begin_with_timeout(Duration::from_millis(200))
            .await
            .unwrap();
    let err = tx.execute(sql("SELECT pg_sleep(5)")).await.unwrap_err();
    assert!(err.is_statement_timeout(), "{err}");
    drop(tx);
    // SET LOCAL died with the transaction: the next one, on the same pooled
    // connection, has no timeout.
    let row =
        t.db.fetch_one(sql("SELECT current_setting('statement_timeout') AS s"))
            .await
            .unwrap();
    assert_eq!(row.try_get::<String, _>("s").unwrap(), "0");
}

/// The index-driven transaction's settings hold inside it and leak to no
/// one: no bitmap scans, hash or merge joins, materialized inner sides, or
/// JIT (docs/adr/0023, 0048).
///
/// Mutation check (`index_driven_jit` in scripts/mutation-check): without
/// `SET LOCAL jit = off` this fails; the outbox claim with a million events
/// queued then spent 600 ms compiling a 20 ms statement.
#[tokio::test]
async fn an_index_driven_transaction_plans_by_key_and_compiles_nothing() {
    let t = TestDb::with_pool(1).await;
    let settings = "SELECT current_setting('enable_bitmapscan') || current_setting('enable_hashjoin') \
                    || current_setting('enable_mergejoin') || current_setting('enable_material') \
                    || current_setting('jit') AS s";
    let mut tx =
        t.db.begin_index_driven(Duration::from_secs(5))
            .await
            .unwrap();
    let inside: String = tx
        .fetch_one(sql(settings))
        .await
        .unwrap()
        .try_get("s")
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(inside, "offoffoffoffoff");
    let after: String =
        t.db.fetch_one(sql(settings))
            .await
            .unwrap()
            .try_get("s")
            .unwrap();
    assert_ne!(after, "offoffoffoffoff", "SET LOCAL leaked: {after}");
}

/// Architecture invariant: only `crates/db` runs SQL on the app pool. No other
/// product crate depends on sqlx at all (test-only crates and dev-dependencies
/// aside), and none names sqlx's query API or a pool in its source.
#[test]
fn only_the_db_crate_runs_sql() {
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut offenders = Vec::new();
    for entry in std::fs::read_dir(&crates).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == "db" || name == "testbed" {
            continue;
        }
        let manifest = std::fs::read_to_string(entry.path().join("Cargo.toml")).unwrap();
        if normal_dependencies(&manifest)
            .lines()
            .any(|l| l.trim_start().starts_with("sqlx"))
        {
            offenders.push(format!("crates/{name}/Cargo.toml depends on sqlx"));
        }
        visit(&entry.path().join("src"), &mut |path, text| {
            for needle in ["sqlx", "PgPool", "PgConnection"] {
                if text.contains(needle) {
                    offenders.push(format!("{}: {needle}", path.display()));
                }
            }
        });
    }
    assert!(
        offenders.is_empty(),
        "SQL outside crates/db's access path: {offenders:#?}"
    );
}

/// Architecture invariant: only `crates/hardcount` reads the environment
/// (the test-only `testbed` reads the bed's variables, and the fake payment
/// provider's own binary, `crates/fake_provider/src/main.rs`, its settings; its
/// library, which tests start in-process, reads none).
#[test]
fn only_the_binary_reads_the_environment() {
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut offenders = Vec::new();
    for entry in std::fs::read_dir(&crates).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == "hardcount" || name == "testbed" {
            continue;
        }
        visit(&entry.path().join("src"), &mut |path, text| {
            if name == "fake_provider" && path.ends_with("src/main.rs") {
                return;
            }
            for needle in ["env::var", "env::vars", "env!(\"HARDCOUNT", "env::args"] {
                if text.contains(needle) {
                    offenders.push(format!("{}: {needle}", path.display()));
                }
            }
        });
    }
    assert!(
        offenders.is_empty(),
        "environment read outside crates/hardcount: {offenders:#?}"
    );
}

/// The `[dependencies]` section of a manifest (not dev- or build-dependencies).
fn normal_dependencies(manifest: &str) -> &str {
    let Some(start) = manifest.find("\n[dependencies]") else {
        return "";
    };
    let rest = &manifest[start + 1..];
    let body = &rest[rest.find('\n').map_or(rest.len(), |i| i + 1)..];
    body.find("\n[").map_or(body, |end| &body[..end])
}

fn visit(dir: &std::path::Path, f: &mut dyn FnMut(&std::path::Path, &str)) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            visit(&p, f);
        } else if p.extension().is_some_and(|x| x == "rs") {
            f(&p, &std::fs::read_to_string(&p).unwrap());
        }
    }
}
