//! The gauges' SQL, read at a tick's end at most once per
//! `backlog_read_every` (docs/adr/0138).

use std::time::Duration;

use db::{Db, Row, sql};

/// The backlog, on the database clock, through the partial indexes. The
/// failed count is of the failed emails kept: the retention prune
/// (docs/adr/0040) deletes them once older than `HARDCOUNT_RETENTION_EMAILS`,
/// so it reads at most the retention window's, not all history.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Backlog {
    pub queued: i64,
    pub failed: i64,
    /// Seconds since the oldest queued email was created; 0 when none.
    pub oldest_queued_age: f64,
    /// When these were read: the transaction's `now()` in epoch seconds.
    pub read_at: f64,
}

pub(crate) async fn backlog(db: &Db, statement_timeout: Duration) -> Result<Backlog, db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let row = tx
        .fetch_one(sql(
            "SELECT (SELECT count(*) FROM email_outbox WHERE status = 'queued') AS queued, \
                    (SELECT count(*) FROM email_outbox WHERE status = 'failed') AS failed, \
                    coalesce(extract(epoch FROM now() - \
                        (SELECT min(created_at) FROM email_outbox WHERE status = 'queued')), \
                        0)::float8 AS oldest, \
                    extract(epoch FROM now())::float8 AS read_at",
        ))
        .await?;
    tx.commit().await?;
    Ok(Backlog {
        queued: row.try_get("queued")?,
        failed: row.try_get("failed")?,
        oldest_queued_age: row.try_get("oldest")?,
        read_at: row.try_get("read_at")?,
    })
}
