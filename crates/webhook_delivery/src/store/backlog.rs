//! The gauges' SQL, read at a tick's end at most once per
//! `backlog_read_every` (docs/adr/0138).

use std::time::Duration;

use db::{Db, Row, sql};

/// The backlog, read on the database clock through the partial indexes: the
/// pending count and the oldest pending delivery in one pass over
/// `webhook_deliveries_due` (migration 0015 dropped the index that served the
/// age alone), the dead count through `webhook_deliveries_dead`. The dead
/// count is of the dead deliveries kept: the retention prune (docs/adr/0040)
/// deletes them once older than `HARDCOUNT_RETENTION_WEBHOOKS`, so it reads
/// at most the retention window's, not all history.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Backlog {
    pub pending: i64,
    pub dead: i64,
    /// Seconds since the oldest pending delivery was created; 0 when none.
    pub oldest_pending_age: f64,
    /// Seconds the longest-due unclaimed delivery has been due (`next_attempt_at`
    /// passed, no live claim); 0 when none is due. Unlike the age above it does
    /// not grow while a delivery waits out its retry schedule or a hold: it is
    /// how far the worker is behind.
    pub oldest_due_age: f64,
    /// When these were read: the transaction's `now()` in epoch seconds.
    pub read_at: f64,
}

pub(crate) async fn backlog(db: &Db, statement_timeout: Duration) -> Result<Backlog, db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let row = tx
        .fetch_one(sql("SELECT p.pending, \
                    (SELECT count(*) FROM webhook_deliveries WHERE status = 'dead') AS dead, \
                    coalesce(extract(epoch FROM now() - p.oldest_created), 0)::float8 AS oldest, \
                    coalesce(extract(epoch FROM now() - p.oldest_due), 0)::float8 AS oldest_due, \
                    extract(epoch FROM now())::float8 AS read_at \
             FROM (SELECT count(*) AS pending, min(created_at) AS oldest_created, \
                          min(next_attempt_at) FILTER (WHERE next_attempt_at <= now() \
                              AND (claimed_until IS NULL OR claimed_until <= now())) AS oldest_due \
                   FROM webhook_deliveries WHERE status = 'pending') p"))
        .await?;
    tx.commit().await?;
    Ok(Backlog {
        pending: row.try_get("pending")?,
        dead: row.try_get("dead")?,
        oldest_pending_age: row.try_get("oldest")?,
        oldest_due_age: row.try_get("oldest_due")?,
        read_at: row.try_get("read_at")?,
    })
}
