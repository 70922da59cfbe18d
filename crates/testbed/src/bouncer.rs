//! PgBouncer's queue on demand: hold its server pool so the next client's
//! statement waits, which is where a dropped future must land for the
//! cancel-safety tests (issue 14), count what was left idle in a transaction,
//! and give a test database its own lease path (an alias with its own pool).

use std::io::Write;

use sqlx::postgres::PgConnection;
use sqlx::{Connection, Row};

use crate::{Leg, TestDb};

/// PgBouncer's server pool per (database, user) in the bed (`scripts/bed`).
pub const BOUNCER_POOL: usize = 4;

/// Hold every server connection PgBouncer has for `hardcount_app` on this
/// database, each inside an open transaction, so the next client's `BEGIN`
/// waits in PgBouncer's queue. Hand them to [`release`] (or drop them) to let it run.
pub async fn saturate(t: &TestDb) -> Vec<PgConnection> {
    let mut held = Vec::new();
    for _ in 0..BOUNCER_POOL {
        let mut c = PgConnection::connect(&t.app_url(Leg::PgBouncer))
            .await
            .unwrap();
        sqlx::raw_sql("BEGIN; SELECT 1")
            .execute(&mut c)
            .await
            .unwrap();
        held.push(c);
    }
    held
}

/// Roll back and close what [`saturate`] held.
pub async fn release(held: Vec<PgConnection>) {
    for mut c in held {
        sqlx::raw_sql("ROLLBACK").execute(&mut c).await.unwrap();
        let _ = c.close().await;
    }
}

/// `hardcount_app` backends on this database that sit idle in a transaction.
pub async fn idle_in_transaction(su: &mut PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE usename = 'hardcount_app' AND datname = current_database() \
           AND state LIKE 'idle in transaction%'",
    )
    .fetch_one(su)
    .await
    .unwrap()
}

/// The lease path for this database (docs/adr/0036), as `hardcount_app`: a
/// PgBouncer alias `<db>_leases` with a server pool of its own
/// ([`LEASE_POOL`]), the shape of `deploy/pgbouncer/pgbouncer.ini`'s
/// `hardcount_leases`. The bed's PgBouncer includes `pgbouncer-leases.ini`
/// beside its own file (`scripts/bed`); this appends the alias there and
/// RELOADs through the admin console, so each test database gets its own.
///
/// # Panics
/// If the bed's PgBouncer has no such file (a bed started before the lease
/// path: restart it with `scripts/bed`), or the admin console refuses.
pub async fn lease_path(t: &TestDb) -> String {
    let admin_url = format!("postgres://postgres@{}/pgbouncer", Leg::PgBouncer.addr());
    let mut admin = PgConnection::connect(&admin_url)
        .await
        .expect("connect to PgBouncer's admin console as postgres");
    let conffile = sqlx::raw_sql("SHOW CONFIG")
        .fetch_all(&mut admin)
        .await
        .expect("SHOW CONFIG")
        .into_iter()
        .find_map(|row| {
            let key: String = row.get(0);
            (key == "conffile").then(|| row.get::<String, _>(1))
        })
        .expect("PgBouncer names its configuration file");
    let leases = std::path::Path::new(&conffile).with_file_name("pgbouncer-leases.ini");
    assert!(
        leases.exists(),
        "{} is missing: this bed predates the lease path; restart it with scripts/bed",
        leases.display()
    );
    let (host, port) = Leg::Direct
        .addr()
        .rsplit_once(':')
        .map(|(h, p)| (h.to_owned(), p.to_owned()))
        .expect("HARDCOUNT_TEST_PG is host:port");
    let alias = format!("{}_leases", t.name());
    let line = format!(
        "{alias} = host={host} port={port} dbname={} pool_size={LEASE_POOL}\n",
        t.name()
    );
    // One write of one line: tests appending at once do not interleave.
    std::fs::OpenOptions::new()
        .append(true)
        .open(&leases)
        .and_then(|mut f| f.write_all(line.as_bytes()))
        .unwrap_or_else(|e| panic!("append to {}: {e}", leases.display()));
    sqlx::raw_sql("RELOAD")
        .execute(&mut admin)
        .await
        .expect("RELOAD");
    let _ = admin.close().await;
    format!("postgres://hardcount_app@{}/{alias}", Leg::PgBouncer.addr())
}

/// The server pool of a test database's lease alias ([`lease_path`]).
pub const LEASE_POOL: usize = 2;
