//! The retention prune (docs/adr/0040): sent and failed emails, deleted once
//! old, a bounded batch per statement.

use std::time::Duration;

use db::Db;
use leader::Fence;

/// The prune statement of [`prune_finished`]; `pub` only for the plan tests
/// (`tests/it/plans.rs`). A finished email's age is its last attempt, read in
/// order through `email_outbox_finished` (migration 0030). Fenced next to
/// `FOR UPDATE SKIP LOCKED`, as the claim is: a replaced leader deletes
/// nothing, and an email an API resend holds is skipped.
pub const PRUNE_FINISHED: &str = "WITH doomed AS MATERIALIZED ( \
           SELECT id FROM email_outbox \
           WHERE status IN ('sent', 'failed') \
             AND last_attempt_at < now() - make_interval(secs => $3) \
             AND leader_fence($1, $2) \
           ORDER BY last_attempt_at, id \
           LIMIT $4 \
           FOR UPDATE SKIP LOCKED) \
         DELETE FROM email_outbox m USING doomed WHERE m.id = doomed.id";

/// Delete at most `limit` sent or failed emails whose last attempt was more
/// than `keep` ago; returns how many went. None when `fence` is stale.
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
