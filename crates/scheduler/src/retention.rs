//! Retention (docs/adr/0040): each role deletes the rows it finished once
//! they are older than a configured age, as the last step of a tick.
//!
//! ```text
//!  tick start: Pruning::plan(budget)        due? (the first tick, then at most
//!                                           once every `every` per replica)
//!   ├─ the role's own work until            start + budget − slice   (due)
//!   │                                       start + budget           (not due)
//!   └─ Prunes::run(kind) for each kind      one fenced statement of ≤ batch rows,
//!      (and Prunes::lease_history)          again until one reads a short batch,
//!                                           the tick's deadline or a cancel
//! ```
//!
//! Guarantees:
//!
//! - **A prune never delays the role's work by more than its slice** (at most
//!   [`MAX_SLICE`], a tenth of the budget), and only on a tick that prunes.
//! - **Each statement is bounded**: at most `batch` rows ([`PRUNE_BATCH`]),
//!   reached through an index in age order with `FOR UPDATE SKIP LOCKED`, in
//!   a transaction of its own, so no lock is held longer than one batch and
//!   a row someone else holds is skipped, not waited for.
//! - **A replaced leader prunes nothing**: every prune statement carries
//!   `leader_fence($role, $token)` in its WHERE and takes a [`Fence`].
//! - **A failed prune does not fail the tick**: it is logged, the role's work
//!   is already done, and the next prune is `every` later. A panic is raised
//!   at the tick's end, like a step's.
//! - Each kind's deleted rows are counted in
//!   `hardcount_retention_pruned_total{kind}`.

use std::fmt;
use std::future::Future;
use std::time::{Duration, Instant};

use db::Db;
use leader::{Fence, Telemetry, Tick};
use tracing::{debug, warn};

use crate::every::Every;
use crate::panics::{Payload, catch};

/// Run one fenced prune statement in its own index-driven transaction and
/// return how many rows it deleted. `statement` binds, in order, the
/// fence's role (`$1`) and token (`$2`), the retention in seconds (`$3`)
/// and the batch's row limit (`$4`), as every role's prune statement does.
///
/// # Errors
/// A database error; nothing was deleted.
pub async fn run_prune_statement(
    db: &Db,
    statement: &'static str,
    fence: &Fence,
    keep: Duration,
    limit: usize,
    statement_timeout: Duration,
) -> Result<u64, db::Error> {
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let deleted = tx
        .execute(
            db::sql(statement)
                .bind(fence.role_name())
                .bind(fence.token())
                .bind(keep.as_secs_f64())
                .bind(i64::try_from(limit).unwrap_or(i64::MAX)),
        )
        .await?;
    tx.commit().await?;
    Ok(deleted)
}

/// Rows one prune statement deletes at most.
pub const PRUNE_BATCH: usize = 1_000;

/// How often a replica's role prunes, at most.
pub const PRUNE_EVERY: Duration = Duration::from_secs(5 * 60);

/// The most of a tick's budget a prune takes; never more than a tenth of it.
pub const MAX_SLICE: Duration = Duration::from_secs(2);

/// How long finished rows are kept when nothing is configured.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(30 * 86_400);

/// What a role keeps and how it prunes the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// How long the role's own finished rows are kept (unused by a role that
    /// finishes none it prunes, dunning).
    pub keep: Duration,
    /// How long the role's lease history (`leader_terms`) is kept.
    pub lease_history: Duration,
    /// At most one prune per this, per replica.
    pub every: Duration,
    /// Rows per prune statement, at most.
    pub batch: usize,
}

impl Default for Retention {
    fn default() -> Retention {
        Retention {
            keep: DEFAULT_RETENTION,
            lease_history: DEFAULT_RETENTION,
            every: PRUNE_EVERY,
            batch: PRUNE_BATCH,
        }
    }
}

impl Retention {
    /// `self` with `keep` as the role's own rows' age.
    #[must_use]
    pub fn keeping(self, keep: Duration) -> Retention {
        Retention { keep, ..self }
    }
}

/// A role's prune schedule on one replica.
#[derive(Debug)]
pub struct Pruning {
    retention: Retention,
    due: Every,
}

/// One tick's share of the prune: when the role's own work stops, and whether
/// (and until when) this tick prunes.
#[derive(Debug, Clone, Copy)]
pub struct PrunePlan {
    /// The deadline of the role's own work.
    pub work_until: Instant,
    /// The tick's deadline, when this tick prunes.
    pub prune_until: Option<Instant>,
}

impl Pruning {
    pub fn new(retention: Retention) -> Pruning {
        Pruning {
            due: Every::new(retention.every),
            retention,
        }
    }

    pub fn retention(&self) -> &Retention {
        &self.retention
    }

    /// At a tick's start, for a tick of `budget`: whether it prunes (the
    /// first tick, then one at least `every` after the last that did; it is
    /// recorded as pruning now) and the deadline of the role's own work.
    pub fn plan(&self, budget: Duration) -> PrunePlan {
        let now = Instant::now();
        let deadline = now + budget;
        if !self.due.due_at(now) {
            return PrunePlan {
                work_until: deadline,
                prune_until: None,
            };
        }
        PrunePlan {
            work_until: deadline - slice(budget),
            prune_until: Some(deadline),
        }
    }
}

/// A prune's share of a tick of `budget`.
pub fn slice(budget: Duration) -> Duration {
    (budget / 10).min(MAX_SLICE)
}

/// What one prune statement did: the rows it deleted, and the candidates it
/// read. A kind whose old rows can be kept back (an event with deliveries
/// left) reads past them and deletes fewer than it read; the round goes on
/// while a statement reads a full batch, whatever it deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pruned {
    pub deleted: u64,
    pub read: u64,
}

impl From<u64> for Pruned {
    /// A kind that deletes every row it reads.
    fn from(deleted: u64) -> Pruned {
        Pruned {
            deleted,
            read: deleted,
        }
    }
}

/// One kind of row a role deletes once old.
pub trait Prune: Sync {
    type Error: fmt::Display + Send;

    /// The `kind` label of `hardcount_retention_pruned_total`.
    fn kind(&self) -> &'static str;

    /// Delete at most `limit` rows of this kind finished more than `keep`
    /// ago (on the database clock), oldest first, in one statement that
    /// proves `leader_fence($role, $token)` and reads at most `limit`
    /// candidates; return how many went and how many were read.
    ///
    /// # Errors
    /// A database error; nothing of this batch was deleted.
    fn prune(
        &self,
        fence: &Fence,
        keep: Duration,
        limit: usize,
    ) -> impl Future<Output = Result<Pruned, Self::Error>> + Send;
}

/// The role's own lease history (`leader_terms`), pruned through
/// [`leader::store::prune_own_terms`].
pub struct LeaseHistory<'a>(pub &'a Db);

impl Prune for LeaseHistory<'_> {
    type Error = leader::StoreError;

    fn kind(&self) -> &'static str {
        "lease_history"
    }

    async fn prune(
        &self,
        fence: &Fence,
        keep: Duration,
        limit: usize,
    ) -> Result<Pruned, Self::Error> {
        let limit = u32::try_from(limit).unwrap_or(u32::MAX);
        leader::store::prune_own_terms(self.0, fence, keep, limit)
            .await
            .map(Pruned::from)
    }
}

/// The prunes of one tick that prunes, each kind run until a statement reads
/// a short batch, the tick's deadline, or a cancel.
pub struct Prunes<'t> {
    tick: &'t Tick,
    telemetry: &'t Telemetry,
    retention: Retention,
    deadline: Instant,
    pruned: Vec<(&'static str, u64)>,
    panic: Option<Payload>,
}

impl<'t> Prunes<'t> {
    /// The prunes of `tick`, if `plan` says it prunes.
    pub fn of(
        plan: &PrunePlan,
        pruning: &Pruning,
        tick: &'t Tick,
        telemetry: &'t Telemetry,
    ) -> Option<Prunes<'t>> {
        Some(Prunes {
            tick,
            telemetry,
            retention: pruning.retention,
            deadline: plan.prune_until?,
            pruned: Vec::new(),
            panic: None,
        })
    }

    /// Delete `kind`'s rows older than the role's `keep`, a batch at a time.
    pub async fn run<P: Prune>(&mut self, kind: &P) -> u64 {
        self.run_keeping(kind, self.retention.keep).await
    }

    /// Delete the role's own lease terms older than `lease_history`.
    pub async fn lease_history(&mut self, db: &Db) -> u64 {
        self.run_keeping(&LeaseHistory(db), self.retention.lease_history)
            .await
    }

    async fn run_keeping<P: Prune>(&mut self, kind: &P, keep: Duration) -> u64 {
        let name = kind.kind();
        let batch = self.retention.batch.max(1);
        let counter = self
            .telemetry
            .counter("hardcount_retention_pruned_total", &[("kind", name)]);
        let mut total = 0;
        while !self.tick.cancel.is_cancelled() && Instant::now() < self.deadline {
            let step = format!("{}/prune/{name}", self.tick.fence.role_name());
            match catch(step, kind.prune(&self.tick.fence, keep, batch)).await {
                Ok(Ok(Pruned { deleted, read })) => {
                    total += deleted;
                    counter.increment(deleted);
                    if read < batch as u64 {
                        break;
                    }
                }
                Ok(Err(error)) => {
                    warn!(
                        role = %self.tick.fence.role(), kind = name, error = %error,
                        "prune failed; the next is a prune interval later"
                    );
                    break;
                }
                Err(payload) => {
                    self.panic.get_or_insert(payload);
                    break;
                }
            }
        }
        debug!(role = %self.tick.fence.role(), kind = name, rows = total, "pruned");
        self.pruned.push((name, total));
        total
    }

    /// The rows each kind lost, in order.
    ///
    /// # Panics
    /// With the first panic a prune raised.
    pub fn finish(self) -> Vec<(&'static str, u64)> {
        if let Some(payload) = self.panic {
            std::panic::resume_unwind(payload);
        }
        self.pruned
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prune_takes_a_tenth_of_the_budget_at_most_two_seconds() {
        for (budget, want) in [
            (Duration::from_secs(1), Duration::from_millis(100)),
            (Duration::from_secs(20), MAX_SLICE),
            (Duration::from_secs(600), MAX_SLICE),
            (Duration::ZERO, Duration::ZERO),
        ] {
            assert_eq!(slice(budget), want, "{budget:?}");
        }
    }

    #[test]
    fn the_first_tick_prunes_then_one_every_interval() {
        let pruning = Pruning::new(Retention {
            every: Duration::from_secs(3600),
            ..Retention::default()
        });
        let budget = Duration::from_secs(20);
        let first = pruning.plan(budget);
        assert!(first.prune_until.is_some());
        assert_eq!(first.prune_until.unwrap() - first.work_until, MAX_SLICE);
        let second = pruning.plan(budget);
        assert!(second.prune_until.is_none(), "{second:?}");
        let eager = Pruning::new(Retention {
            every: Duration::ZERO,
            ..Retention::default()
        });
        assert!(eager.plan(budget).prune_until.is_some());
        assert!(eager.plan(budget).prune_until.is_some());
    }
}
