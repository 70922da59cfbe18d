//! The retention prune (docs/adr/0040): finished deliveries and their
//! attempt history, deleted once old, a bounded batch per statement.

use std::time::Duration;

use db::Db;
use leader::Fence;

/// The prune statement of [`prune_finished`]; `pub` only for the plan tests
/// (`tests/it/plans.rs`). A finished delivery's age is its `next_attempt_at`,
/// which the write that finishes it stamps (docs/adr/0100; migration 0030
/// says why not `last_attempt_at`), read in order through
/// `webhook_deliveries_finished`;
/// its attempt rows go in the same statement, found by their primary key's
/// first column. The fence sits next to `FOR UPDATE SKIP LOCKED`, as in the
/// claim: a replaced leader deletes nothing, and a delivery an API resend
/// holds is skipped.
pub const PRUNE_FINISHED: &str = "WITH doomed AS MATERIALIZED ( \
           SELECT id FROM webhook_deliveries \
           WHERE status IN ('delivered', 'dead') \
             AND next_attempt_at < now() - make_interval(secs => $3) \
             AND leader_fence($1, $2) \
           ORDER BY next_attempt_at, id \
           LIMIT $4 \
           FOR UPDATE SKIP LOCKED), \
         history AS ( \
           DELETE FROM webhook_delivery_attempts a USING doomed \
           WHERE a.delivery_id = doomed.id) \
         DELETE FROM webhook_deliveries d USING doomed \
         WHERE d.id = doomed.id";

/// Delete at most `limit` delivered or dead deliveries that finished more
/// than `keep` ago, with their attempt rows; returns how many deliveries
/// went. None when `fence` is stale.
///
/// # Errors
/// A database error; nothing was deleted.
pub(crate) async fn prune_finished(
    db: &Db,
    fence: &Fence,
    keep: Duration,
    limit: usize,
    statement_timeout: Duration,
) -> Result<u64, db::Error> {
    scheduler::run_prune_statement(db, PRUNE_FINISHED, fence, keep, limit, statement_timeout).await
}
