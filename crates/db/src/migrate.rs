//! Applying `migrations/` over a direct (or session-mode) connection.

use sqlx::Connection;
use sqlx::migrate::Migrator;
use sqlx::postgres::PgConnection;

use crate::redacted_url;

/// Every migration in `migrations/`, embedded at build time.
pub static MIGRATOR: Migrator = sqlx::migrate!("../../migrations");

/// What a run of [`migrate`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationReport {
    /// Versions applied by this run, oldest first. Empty on a no-op run.
    pub applied: Vec<i64>,
    /// Versions that were already applied before this run.
    pub already: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("invalid migration database URL {url}: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("cannot connect to the migration database at {url}: {source}")]
    Connect {
        url: String,
        #[source]
        source: sqlx::Error,
    },
    #[error(
        "migration failed in a way that shows a transaction pooler between us and Postgres \
         ({detail}); migrations need a direct or session-mode connection: point \
         MIGRATION_DATABASE_URL at Postgres itself or at a PgBouncer pool in session mode"
    )]
    ThroughTransactionPooler { detail: String },
    #[error(
        "migration lock not acquired within 60 s: another `hardcount migrate` is running, or a \
         run through a transaction pooler left the lock on a pooled server connection (restart \
         that pool, or find it with `SELECT pid FROM pg_locks WHERE locktype = 'advisory'`)"
    )]
    LockTimeout,
    #[error("migration failed: {0}")]
    Failed(#[source] sqlx::migrate::MigrateError),
}

/// Apply every pending migration over a fresh session on `url`.
///
/// A second run is a no-op. Uses a session advisory lock (sqlx's), which is
/// why it must not go through a transaction pooler.
///
/// # Errors
/// A clear [`MigrateError`] naming the (redacted) URL or the pooler.
pub async fn migrate(url: &str) -> Result<MigrationReport, MigrateError> {
    let shown = redacted_url(url);
    let options =
        crate::connect::options_or_refusal(url).map_err(|reason| MigrateError::BadUrl {
            url: shown.clone(),
            reason,
        })?;
    let options = options
        .extra_float_digits(None)
        .application_name("hardcount migrate");
    let mut conn = PgConnection::connect_with(&options)
        .await
        .map_err(|source| MigrateError::Connect {
            url: shown.clone(),
            source,
        })?;
    // sqlx's migrator waits on a session advisory lock. If another migrate
    // holds it, or a run through a transaction pooler stranded it on a pooled
    // backend, say so instead of waiting forever. (A session SET: this
    // connection is direct or session-mode by contract.)
    sqlx::raw_sql("SET lock_timeout = '60s'")
        .execute(&mut conn)
        .await
        .map_err(classify_sqlx)?;
    let before = applied_versions(&mut conn).await.map_err(classify_sqlx)?;
    MIGRATOR.run(&mut conn).await.map_err(classify)?;
    let after = applied_versions(&mut conn).await.map_err(classify_sqlx)?;
    let _ = conn.close().await;
    let applied = after
        .iter()
        .copied()
        .filter(|v| !before.contains(v))
        .collect();
    Ok(MigrationReport {
        applied,
        already: before.len(),
    })
}

async fn applied_versions(conn: &mut PgConnection) -> Result<Vec<i64>, sqlx::Error> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .persistent(false)
        .fetch_one(&mut *conn)
        .await?;
    if !exists {
        return Ok(Vec::new());
    }
    sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success ORDER BY version")
        .persistent(false)
        .fetch_all(&mut *conn)
        .await
}

fn classify(e: sqlx::migrate::MigrateError) -> MigrateError {
    let text = e.to_string();
    if looks_like_transaction_pooler(&text) {
        MigrateError::ThroughTransactionPooler { detail: text }
    } else if text.contains("lock timeout") {
        MigrateError::LockTimeout
    } else {
        MigrateError::Failed(e)
    }
}

fn classify_sqlx(e: sqlx::Error) -> MigrateError {
    classify(sqlx::migrate::MigrateError::Execute(e))
}

/// The errors a session-scoped protocol produces when its server connection
/// changes under it: sqlx's named statements vanish or collide, and PgBouncer
/// names the unsupported feature.
pub(crate) fn looks_like_transaction_pooler(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    (t.contains("prepared statement")
        && (t.contains("does not exist") || t.contains("already exists")))
        || t.contains("unsupported pkt type")
        || t.contains("pgbouncer")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooler_symptoms_are_recognised() {
        assert!(looks_like_transaction_pooler(
            "error returned from database: prepared statement \"sqlx_s_1\" already exists"
        ));
        assert!(looks_like_transaction_pooler(
            "prepared statement \"sqlx_s_3\" does not exist"
        ));
        assert!(!looks_like_transaction_pooler(
            "relation \"x\" does not exist"
        ));
    }
}
