//! The retention prune of billing (docs/adr/0040): the provider's raw
//! answer kept on a resolved payment attempt, cleared once old. The attempt
//! itself is money and is never deleted; `raw_answer` (migration 0019, the
//! first bytes of an answer that did not parse) is the only request or
//! response text the service keeps of a call. And the tenant API's
//! idempotency keys, deleted once they can no longer be replayed
//! (docs/adr/0117): the API is a producer, not a role, so a role prunes for
//! it.

use std::time::Duration;

use db::sql;
use leader::Fence;
use scheduler::{Prune, Pruned};

use crate::{Biller, Error};

/// The prune statement of [`RawAnswers`]; `pub` only for the plan tests
/// (`tests/it/plans.rs`). Resolved attempts (succeeded, declined, failed)
/// resolved more than the retention ago, oldest first through
/// `payment_attempts_raw_answer_kept` (migration 0030); fenced next to
/// `FOR UPDATE OF p SKIP LOCKED`, as the claims are. An attempt whose invoice
/// waits for an operator's review keeps its answer (the review reads it).
/// Nothing but `raw_answer` changes.
pub const CLEAR_RAW_ANSWERS: &str = "WITH doomed AS MATERIALIZED ( \
           SELECT p.id FROM payment_attempts p \
           WHERE p.raw_answer IS NOT NULL AND p.resolved_at IS NOT NULL \
             AND p.resolved_at < now() - make_interval(secs => $3) \
             AND p.provider_status IN ('succeeded', 'declined', 'failed') \
             AND NOT EXISTS (SELECT 1 FROM invoices i \
                             WHERE i.id = p.invoice_id AND i.review_since IS NOT NULL) \
             AND leader_fence($1, $2) \
           ORDER BY p.resolved_at, p.id \
           LIMIT $4 \
           FOR UPDATE OF p SKIP LOCKED) \
         UPDATE payment_attempts a SET raw_answer = NULL \
         FROM doomed WHERE a.id = doomed.id";

/// Set before [`CLEAR_RAW_ANSWERS`], for its transaction: on statistics
/// that do not know how few attempts keep an answer, the planner read
/// `payment_attempts` whole and sorted it instead of walking the partial
/// index. `pub` only for the plan test.
pub use db::NO_SEQUENTIAL_SCAN;

/// The raw answers of resolved attempts, as a prune kind.
pub(crate) struct RawAnswers<'a>(pub &'a Biller);

impl Prune for RawAnswers<'_> {
    type Error = Error;

    fn kind(&self) -> &'static str {
        "payment_logs"
    }

    async fn prune(&self, fence: &Fence, keep: Duration, limit: usize) -> Result<Pruned, Error> {
        prune_with(self.0, CLEAR_RAW_ANSWERS, fence, keep, limit).await
    }
}

/// One prune statement of billing's (`$1`, `$2` the fence, `$3` the age in
/// seconds, `$4` the batch), in an index-driven transaction without
/// sequential scans; how many rows it wrote.
async fn prune_with(
    biller: &Biller,
    statement: &'static str,
    fence: &Fence,
    age: Duration,
    limit: usize,
) -> Result<Pruned, Error> {
    let inner = &biller.inner;
    let mut tx = inner
        .db
        .begin_index_driven(inner.config.statement_timeout)
        .await?;
    tx.fetch_all(sql(NO_SEQUENTIAL_SCAN)).await?;
    let written = tx
        .execute(
            sql(statement)
                .bind(fence.role_name())
                .bind(fence.token())
                .bind(age.as_secs_f64())
                .bind(i64::try_from(limit).unwrap_or(i64::MAX)),
        )
        .await?;
    tx.commit().await?;
    Ok(written.into())
}

/// How long an idempotency key answers with its first answer (docs/adr/0035;
/// `crates/api/src/scope.rs` reuses an older one in place).
pub const IDEMPOTENCY_KEY_LIFE: Duration = Duration::from_secs(24 * 3600);

/// The prune statement of [`IdempotencyKeys`]; `pub` only for the plan test.
/// Keys older than their life (`$3`), oldest first through
/// `api_idempotency_keys_created`, fenced, deleted by the table's key. No row
/// lock is taken to choose them (that needs UPDATE, which the app is not
/// granted): the age is checked again on the row deleted, so a key a request
/// reused in place meanwhile (a new `created_at`) is waited for and kept.
pub const DELETE_IDEMPOTENCY_KEYS: &str = "WITH doomed AS MATERIALIZED ( \
           SELECT k.tenant_id, k.idempotency_key FROM api_idempotency_keys k \
           WHERE k.created_at < now() - make_interval(secs => $3) \
             AND leader_fence($1, $2) \
           ORDER BY k.created_at \
           LIMIT $4) \
         DELETE FROM api_idempotency_keys a USING doomed \
         WHERE a.tenant_id = doomed.tenant_id AND a.idempotency_key = doomed.idempotency_key \
           AND a.created_at < now() - make_interval(secs => $3)";

/// The tenant API's idempotency keys past their life, as a prune kind. The
/// configured retention does not apply: a key is kept exactly as long as it
/// can be replayed.
pub(crate) struct IdempotencyKeys<'a>(pub &'a Biller);

impl Prune for IdempotencyKeys<'_> {
    type Error = Error;

    fn kind(&self) -> &'static str {
        "idempotency_keys"
    }

    async fn prune(&self, fence: &Fence, _keep: Duration, limit: usize) -> Result<Pruned, Error> {
        prune_with(
            self.0,
            DELETE_IDEMPOTENCY_KEYS,
            fence,
            IDEMPOTENCY_KEY_LIFE,
            limit,
        )
        .await
    }
}
