//! The retention prune of billing (docs/adr/0040): the provider's raw
//! answer kept on a resolved payment attempt, cleared once old. The attempt
//! itself is money and is never deleted; `raw_answer` (migration 0019, the
//! first bytes of an answer that did not parse) is the only request or
//! response text the service keeps of a call.

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
        let inner = &self.0.inner;
        let mut tx = inner
            .db
            .begin_index_driven(inner.config.statement_timeout)
            .await?;
        tx.fetch_all(sql(NO_SEQUENTIAL_SCAN)).await?;
        let cleared = tx
            .execute(
                sql(CLEAR_RAW_ANSWERS)
                    .bind(fence.role_name())
                    .bind(fence.token())
                    .bind(keep.as_secs_f64())
                    .bind(i64::try_from(limit).unwrap_or(i64::MAX)),
            )
            .await?;
        tx.commit().await?;
        Ok(cleared.into())
    }
}
