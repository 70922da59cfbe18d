//! Two steps of the billing tick: expired trials (the first) and lifted
//! pause-collections (after due billing, docs/adr/0110). Each is a fenced
//! listing and a compare-and-set on what was listed, with its event in the
//! same transaction.
//!
//! ```text
//!  trials   status = 'trialing', trial_end <= now()  AND leader_fence  (fenced)
//!           per row, under the panic guard: the first paid period
//!             [trial_end, end_after(anchor, trial_end))    (pure)
//!           UPDATE … SET status = 'active', period, watermark
//!             WHERE status = 'trialing' AND trial_end = $read       CAS
//!           + subscription.trial_ended                  (one transaction)
//!  resumes  pause_collection_resumes_at <= now()
//!           AND not behind (next_billing_at null or later) AND leader_fence  (fenced)
//!           UPDATE … SET pause_collection_* = NULL
//!             WHERE behaviour, resumes_at, set_by = $read           CAS
//!           + subscription.collection_resumed           (one transaction)
//! ```
//!
//! A trial that ends mid-period starts a partial first period, from the
//! trial end to the next boundary of the anchor's grid, which the due-billing
//! step invoices pro rata ([`crate::close`]).

mod store;

use std::time::{Duration, Instant};

use leader::{Fence, Role, Tick};
use scheduler::{FencedBatches, LeftOut, Panics, Shape};

use crate::close::Unbillable;
use crate::period::{self, Interval, Unit};
use crate::store::Listed;
use crate::{Biller, Error};
use store::{LiftedPause, TrialEnded};

/// What the trial and resume steps came to over a tick.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct LifecycleTally {
    /// Trials activated, each with `subscription.trial_ended`.
    pub trials_ended: usize,
    /// Pauses cleared, each with `subscription.collection_resumed`.
    pub resumed: usize,
    /// Listed rows another writer changed first: nothing written.
    pub lost: usize,
    /// Trials whose first period could not be computed; left out.
    pub panicked: usize,
}

/// Activate `tenant_id`'s subscription `subscription` in `tx` if it is
/// trialing and its trial has ended, as the tick's trial step would (its
/// compare-and-set and `subscription.trial_ended`): a cancel now then
/// invoices the paid time since the trial ended (docs/adr/0077). `false`
/// when it is not such a trial.
pub(crate) async fn activate_ended_trial_in(
    tx: &mut db::Tx,
    tenant_id: &str,
    subscription: i64,
) -> Result<bool, Error> {
    let Some(trial) = store::ended_trial_in(tx, tenant_id, subscription).await? else {
        return Ok(false);
    };
    let end = first_period_end(&trial)?;
    Ok(!store::activate_trials_in(tx, &[(trial, end)])
        .await?
        .is_empty())
}

/// Resume `subscription`'s collection in `tx` if its pause's resume time has
/// passed, as the tick's resume step would (its compare-and-set and
/// `subscription.collection_resumed`), once a cancel or a plan change has
/// closed the periods it was behind, each under the pause it ended in, as
/// the tick closes them before that step (docs/adr/0088, 0110). `false` when
/// there is no such pause.
pub(crate) async fn resume_lifted_pause_in(
    biller: &Biller,
    tx: &mut db::Tx,
    subscription: i64,
) -> Result<bool, Error> {
    let Some(pause) = store::lifted_pause_in(tx, subscription).await? else {
        return Ok(false);
    };
    let resumed = !store::resume_lifted_pauses_in(tx, &[pause])
        .await?
        .is_empty();
    if resumed {
        biller
            .inner
            .telemetry
            .counter("hardcount_billing_collections_resumed_total", &[])
            .increment(1);
    }
    Ok(resumed)
}

/// The first paid period's end of an ended trial.
fn first_period_end(t: &TrialEnded) -> Result<chrono::DateTime<chrono::Utc>, Unbillable> {
    let bad = || Unbillable::Interval {
        unit: t.interval_unit.clone(),
        count: t.interval_count,
    };
    let interval = Interval {
        unit: Unit::parse(&t.interval_unit).ok_or_else(bad)?,
        count: u32::try_from(t.interval_count)
            .ok()
            .filter(|c| *c > 0)
            .ok_or_else(bad)?,
    };
    period::end_after(t.billing_anchor, interval, t.trial_end)
        .ok_or(Unbillable::OutOfRange(t.trial_end))
}

fn lifecycle_shape(biller: &Biller) -> Shape {
    let c = &biller.inner.config;
    Shape {
        batch_size: c.batch_size,
        budget: c.tick_budget,
        reserve: Duration::ZERO,
    }
}

/// The trial step as the driver sees it.
pub(crate) struct Trials<'a> {
    pub biller: &'a Biller,
    /// Trials whose activation panicked: not listed again this tick.
    pub left_out: LeftOut,
}

impl FencedBatches for Trials<'_> {
    type Claim = Listed<TrialEnded>;
    type Counts = LifecycleTally;
    type Error = Error;

    fn role(&self) -> Role {
        Role::Billing
    }

    fn shape(&self) -> Shape {
        lifecycle_shape(self.biller)
    }

    async fn claim(&self, fence: &Fence, limit: usize) -> Result<Listed<TrialEnded>, Error> {
        let except = self.left_out.ids();
        let c = &self.biller.inner.config;
        let listed = store::claim_trials(
            &self.biller.inner.db,
            fence,
            limit,
            &except,
            c.statement_timeout,
        )
        .await?;
        self.biller.undecodable("trials", &listed.undecodable);
        self.left_out.extend(listed.undecodable.iter().copied());
        Ok(listed)
    }

    fn claimed(batch: &Listed<TrialEnded>) -> usize {
        batch.rows.len() + batch.undecodable.len()
    }

    async fn run(
        &self,
        batch: Listed<TrialEnded>,
        _tick: &Tick,
        _deadline: Instant,
        panics: &mut Panics,
        tally: &mut LifecycleTally,
    ) -> Result<(), Error> {
        let batch = batch.rows;
        let claimed: Vec<i64> = batch.iter().map(|t| t.subscription_id).collect();
        let activations = panics
            .drain(
                batch,
                |t| format!("end trial of subscription {}", t.subscription_id),
                |t| async move {
                    match first_period_end(&t) {
                        Ok(end) => (t, end),
                        Err(e) => panic!(
                            "subscription {} (tenant {}) cannot start its first period: {e}",
                            t.subscription_id, t.tenant_id
                        ),
                    }
                },
            )
            .await;
        let panicked: Vec<i64> = claimed
            .into_iter()
            .filter(|id| !activations.iter().any(|(t, _)| t.subscription_id == *id))
            .collect();
        tally.panicked += panicked.len();
        self.left_out.extend(panicked);
        let b = &self.biller.inner;
        let activated =
            store::activate_trials(&b.db, &activations, b.config.statement_timeout).await?;
        tally.trials_ended += activated.len();
        tally.lost += activations.len() - activated.len();
        b.telemetry
            .counter("hardcount_billing_trials_ended_total", &[])
            .increment(activated.len() as u64);
        Ok(())
    }
}

/// The resume step as the driver sees it.
pub(crate) struct Resumes<'a> {
    pub biller: &'a Biller,
    /// Rows that could not be decoded: not listed again this tick.
    pub left_out: LeftOut,
}

impl FencedBatches for Resumes<'_> {
    type Claim = Listed<LiftedPause>;
    type Counts = LifecycleTally;
    type Error = Error;

    fn role(&self) -> Role {
        Role::Billing
    }

    fn shape(&self) -> Shape {
        lifecycle_shape(self.biller)
    }

    async fn claim(&self, fence: &Fence, limit: usize) -> Result<Listed<LiftedPause>, Error> {
        let c = &self.biller.inner.config;
        let except = self.left_out.ids();
        let listed = store::claim_lifted_pauses(
            &self.biller.inner.db,
            fence,
            limit,
            &except,
            c.statement_timeout,
        )
        .await?;
        self.biller.undecodable("resumes", &listed.undecodable);
        self.left_out.extend(listed.undecodable.iter().copied());
        Ok(listed)
    }

    fn claimed(batch: &Listed<LiftedPause>) -> usize {
        batch.rows.len() + batch.undecodable.len()
    }

    async fn run(
        &self,
        batch: Listed<LiftedPause>,
        _tick: &Tick,
        _deadline: Instant,
        _panics: &mut Panics,
        tally: &mut LifecycleTally,
    ) -> Result<(), Error> {
        let b = &self.biller.inner;
        let batch = batch.rows;
        let resumed =
            store::resume_lifted_pauses(&b.db, &batch, b.config.statement_timeout).await?;
        tally.resumed += resumed.len();
        tally.lost += batch.len() - resumed.len();
        b.telemetry
            .counter("hardcount_billing_collections_resumed_total", &[])
            .increment(resumed.len() as u64);
        Ok(())
    }
}

/// The body of [`Biller::claim_ended_trials`].
pub(crate) async fn claim_ended_trials(
    biller: &Biller,
    fence: &Fence,
    limit: usize,
) -> Result<Vec<EndedTrial>, Error> {
    let c = &biller.inner.config;
    let listed =
        store::claim_trials(&biller.inner.db, fence, limit, &[], c.statement_timeout).await?;
    Ok(listed.rows.into_iter().map(EndedTrial).collect())
}

/// The body of [`Biller::end_trials`].
pub(crate) async fn end_trials(biller: &Biller, trials: &[EndedTrial]) -> Result<usize, Error> {
    let mut rows = Vec::with_capacity(trials.len());
    for t in trials {
        rows.push((t.0.clone(), first_period_end(&t.0)?));
    }
    let timeout = biller.inner.config.statement_timeout;
    Ok(store::activate_trials(&biller.inner.db, &rows, timeout)
        .await?
        .len())
}

/// The body of [`Biller::claim_lifted_pauses`].
pub(crate) async fn claim_lifted_pauses(
    biller: &Biller,
    fence: &Fence,
    limit: usize,
) -> Result<Vec<LiftedCollectionPause>, Error> {
    let c = &biller.inner.config;
    let listed =
        store::claim_lifted_pauses(&biller.inner.db, fence, limit, &[], c.statement_timeout)
            .await?;
    Ok(listed.rows.into_iter().map(LiftedCollectionPause).collect())
}

/// The body of [`Biller::resume_collections`].
pub(crate) async fn resume_collections(
    biller: &Biller,
    pauses: &[LiftedCollectionPause],
) -> Result<usize, Error> {
    let rows: Vec<LiftedPause> = pauses.iter().map(|p| p.0.clone()).collect();
    let timeout = biller.inner.config.statement_timeout;
    Ok(
        store::resume_lifted_pauses(&biller.inner.db, &rows, timeout)
            .await?
            .len(),
    )
}

/// An ended trial as listed (opaque: its activation proves it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndedTrial(TrialEnded);

impl EndedTrial {
    pub fn subscription_id(&self) -> i64 {
        self.0.subscription_id
    }
}

/// A lifted pause-collection as listed (opaque: its clear proves it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiftedCollectionPause(LiftedPause);

impl LiftedCollectionPause {
    pub fn subscription_id(&self) -> i64 {
        self.0.subscription_id
    }
}
