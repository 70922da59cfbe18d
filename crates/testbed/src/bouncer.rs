//! PgBouncer's queue on demand: hold its server pool so the next client's
//! statement waits, which is where a dropped future must land for the
//! cancel-safety tests (issue 14), and count what was left idle in a transaction.

use sqlx::Connection;
use sqlx::postgres::PgConnection;

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
