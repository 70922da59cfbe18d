//! The retention prune of dispatched events (docs/adr/0040, 0108), held while
//! a handoff's pairs wait for their recovery (docs/adr/0144).

use std::time::Duration;

use chrono::{DateTime, Utc};
use db::{Db, PgRow, Row, sql};
use leader::{Fence, Role};
use tracing::warn;

/// The prune statement of [`prune_dispatched`]; `pub` only for the plan test
/// (`tests/it/plans.rs`). Reads at most `$4` dispatched events older than the
/// retention, in stamp order through `webhook_events_dispatched` (migration
/// 0030) from just past the cursor `($5, $6)`, and deletes those none of whose
/// deliveries remain (the delivery role prunes those first;
/// `webhook_deliveries_event_endpoint_key` answers the check, and the delete
/// trigger of migration 0015 refuses an event that still has some), locked
/// `SKIP LOCKED`. Fenced in the read. Returns the events read and deleted, and
/// the last read's key, where the next statement starts: an event kept back
/// by its deliveries is read once per pass, not by every statement
/// (docs/adr/0108).
pub const PRUNE_DISPATCHED: &str = "WITH seen AS MATERIALIZED ( \
           SELECT e.id, e.dispatched_at FROM webhook_events e \
           WHERE e.dispatched_at IS NOT NULL \
             AND e.dispatched_at < now() - make_interval(secs => $3) \
             AND (e.dispatched_at, e.id) > ($5::timestamptz, $6::bigint) \
             AND leader_fence($1, $2) \
           ORDER BY e.dispatched_at, e.id \
           LIMIT $4), \
         doomed AS MATERIALIZED ( \
           SELECT e.id FROM seen JOIN webhook_events e ON e.id = seen.id \
           WHERE NOT EXISTS (SELECT 1 FROM webhook_deliveries d WHERE d.event_id = e.id) \
           FOR UPDATE OF e SKIP LOCKED), \
         gone AS (DELETE FROM webhook_events e USING doomed WHERE e.id = doomed.id RETURNING e.id) \
         SELECT (SELECT count(*) FROM seen) AS seen, (SELECT count(*) FROM gone) AS gone, \
                last.at AS last_at, \
                (SELECT max(id) FROM seen WHERE dispatched_at = last.at) AS last_id \
         FROM (SELECT max(dispatched_at) AS at FROM seen) last";

/// Where a pass of the event prune has read to: the stamp and id of the last
/// event read (docs/adr/0108). The start of a pass is before every event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PruneCursor {
    pub at: DateTime<Utc>,
    pub id: i64,
}

impl Default for PruneCursor {
    fn default() -> PruneCursor {
        PruneCursor {
            at: DateTime::UNIX_EPOCH,
            id: 0,
        }
    }
}

/// What one [`prune_dispatched`] statement did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrunedEvents {
    pub deleted: u64,
    pub read: u64,
    /// The last event read, or `None` when none was.
    pub last: Option<PruneCursor>,
}

/// Read at most `limit` dispatched events older than `keep` from just past
/// `from`, and delete those that have no deliveries left. Nothing is read or
/// deleted when `fence` is stale.
///
/// # Errors
/// A database error; nothing was deleted.
pub(crate) async fn prune_dispatched(
    db: &Db,
    fence: &Fence,
    keep: Duration,
    limit: usize,
    from: PruneCursor,
    statement_timeout: Duration,
) -> Result<PrunedEvents, db::Error> {
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    // A handoff whose lease ended holds pairs not written yet: its recovery
    // failed, or is still to run. Its events stay until it is recovered; gone,
    // the recovery would drop those pairs, and their deliveries with them,
    // unseen (docs/adr/0144). The table holds a row per fan-out in flight.
    let waiting: bool = tx
        .fetch_one(sql(HANDOFFS_EXPIRED))
        .await?
        .try_get("waiting")?;
    if waiting {
        tx.commit().await?;
        warn!(
            role = %Role::WebhookOutbox,
            "event prune held: a webhook handoff's lease ended before its pairs were written; \
             its recovery runs first"
        );
        return Ok(PrunedEvents {
            deleted: 0,
            read: 0,
            last: None,
        });
    }
    // With the cursor's bound, statistics of a table never analyzed put a
    // batch at most of the candidates, and a whole read and sort looked cheaper.
    tx.fetch_all(sql(db::NO_SEQUENTIAL_SCAN)).await?;
    let row = tx
        .fetch_one(
            sql(PRUNE_DISPATCHED)
                .bind(fence.role_name())
                .bind(fence.token())
                .bind(keep.as_secs_f64())
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .bind(from.at)
                .bind(from.id),
        )
        .await?;
    tx.commit().await?;
    pruned_events(&row)
}

/// Whether a handoff's lease has ended with its pairs still here.
const HANDOFFS_EXPIRED: &str =
    "SELECT EXISTS (SELECT 1 FROM webhook_handoffs WHERE until < now()) AS waiting";

/// The row of [`PRUNE_DISPATCHED`]; `pub` for its tests.
///
/// # Errors
/// A column missing or of another type.
pub fn pruned_events(row: &PgRow) -> Result<PrunedEvents, db::Error> {
    let count = |name| {
        row.try_get::<i64, _>(name)
            .map(|n| u64::try_from(n).unwrap_or(0))
    };
    let last = match row.try_get::<Option<DateTime<Utc>>, _>("last_at")? {
        Some(at) => Some(PruneCursor {
            at,
            id: row.try_get("last_id")?,
        }),
        None => None,
    };
    Ok(PrunedEvents {
        deleted: count("gone")?,
        read: count("seen")?,
        last,
    })
}
