//! [`Biller`]: the billing role's handle, and its one `impl`. Each method's
//! work is a free function of the module of its step (`tick`, `charge`,
//! `retry`, `cancel`, `plan_change`, `lifecycle`, `reconcile`); the methods
//! here only hand `self` on, so the whole API reads in one place.

use std::sync::Arc;
use std::time::Instant;

use chrono::{DateTime, Utc};
use db::Db;
use leader::{Fence, Role, Telemetry, Tick};
use scheduler::{Panics, Payload};
use tracing::info;

use crate::batch::{self, ChargeClaim};
use crate::cancel::{CancelAt, Canceled};
use crate::charge::Charged;
use crate::close::Due;
use crate::collection::CollectionPause;
use crate::invoice::{self, Closed};
use crate::lifecycle::{EndedTrial, LiftedCollectionPause};
use crate::plan_change::{PlanChange, PlanChanged};
use crate::provider::Provider;
use crate::retry::{NotCharged, Retried, RetryRequest, StartedRetry};
use crate::tick::{Tally, TickReport};
use crate::{
    BillingConfig, Error, cancel, charge, collection, lifecycle, plan_change, retry, tick,
};

/// Closes due billing periods. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Biller {
    pub(crate) inner: Arc<Inner>,
    /// When a tick prunes ([`Biller::with_retention`]), if it does.
    pub(crate) pruning: Option<Arc<scheduler::Pruning>>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) db: Db,
    pub(crate) config: BillingConfig,
    pub(crate) telemetry: Telemetry,
    /// `None` when no provider is configured: the charge step is skipped.
    pub(crate) provider: Option<Provider>,
    /// Where the next due listing starts among tenants (docs/adr/0048).
    pub(crate) cursor: db::TenantCursor,
}

impl Biller {
    /// # Errors
    /// [`Error::Config`] naming a setting out of range.
    pub fn new(db: Db, config: BillingConfig, telemetry: Telemetry) -> Result<Biller, Error> {
        config.validate()?;
        let provider = match &config.provider {
            Some(p) => Some(Provider::new(p.clone()).map_err(crate::ConfigError::ProviderClient)?),
            None => {
                info!(role = %Role::Billing, "no payment provider configured (BILLING_PROVIDER_URL): the auto-charge step is skipped");
                None
            }
        };
        // At 0 from the start, so an alert's increase() sees the first
        // refusal of the key (docs/adr/0105).
        telemetry
            .counter("hardcount_billing_provider_key_rejected_total", &[])
            .increment(0);
        Ok(Biller {
            inner: Arc::new(Inner {
                db,
                config,
                telemetry,
                provider,
                cursor: db::TenantCursor::default(),
            }),
            pruning: None,
        })
    }

    /// Prune (docs/adr/0040): a tick at most every `retention.every` ends by
    /// clearing the raw provider answers of payment attempts resolved more
    /// than `retention.keep` ago (the attempts stay: money is never pruned)
    /// and deleting the role's lease history older than
    /// `retention.lease_history`, a fenced batch per statement in a slice of
    /// the budget ([`scheduler::Pruning`]).
    #[must_use]
    pub fn with_retention(mut self, retention: scheduler::Retention) -> Biller {
        self.pruning = Some(Arc::new(scheduler::Pruning::new(retention)));
        self
    }

    /// The fenced auto-charge funnel: up to `limit` invoices, each under a
    /// fresh claim lease. Empty when `fence` is stale.
    ///
    /// # Errors
    /// A database error; nothing was claimed.
    pub async fn claim_charges(
        &self,
        fence: &Fence,
        limit: usize,
    ) -> Result<Vec<ChargeClaim>, Error> {
        charge::claim_charges(self, fence, limit).await
    }

    /// Charge one claimed invoice and settle the answer (a batch of one).
    ///
    /// # Errors
    /// A database error or a refused event or email; the settling rolled
    /// back, and the attempt (if written) stays unknown for the reconciler.
    pub async fn charge(&self, claim: &ChargeClaim) -> Result<Charged, Error> {
        charge::charge(self, claim).await
    }

    pub(crate) fn settling(&self) -> batch::Settling<'_> {
        charge::settling(self)
    }

    /// Change `subscription`'s plan to `plan` now: close the periods that
    /// ended and the tick has not closed, as it would (at most
    /// `catch_up_periods`, docs/adr/0088), truncate the period holding now,
    /// invoice its used part pro rata, start the next period on the new
    /// plan. One transaction; see [`Biller::apply_plan_change`].
    ///
    /// # Errors
    /// [`Error::SubscriptionNotFound`], [`Error::SubscriptionPeriodMoved`]
    /// (nothing written; also when further behind than `catch_up_periods`),
    /// [`Error::Unbillable`], or a database error.
    pub async fn change_plan(
        &self,
        tenant_id: &str,
        subscription: i64,
        plan: i64,
    ) -> Result<PlanChanged, Error> {
        plan_change::change_plan(self, tenant_id, subscription, plan).await
    }

    /// [`Biller::change_plan`] inside the caller's transaction (the HTTP
    /// API's, so the change commits with the request's answer): the snapshot
    /// is read unlocked and proven by the compare-and-set.
    ///
    /// # Errors
    /// As [`Biller::change_plan`]; on any error the caller must roll back
    /// (a dedup hit has written into `tx` before it).
    pub async fn change_plan_in(
        &self,
        tx: &mut db::Tx,
        tenant_id: &str,
        subscription: i64,
        plan: i64,
    ) -> Result<PlanChanged, Error> {
        plan_change::change_plan_in(self, tx, tenant_id, subscription, plan).await
    }

    /// Read a fresh snapshot and compute the change, writing nothing.
    ///
    /// # Errors
    /// [`Error::SubscriptionNotFound`], [`Error::SubscriptionPeriodMoved`]
    /// (further behind than `catch_up_periods`), [`Error::Unbillable`], or a
    /// database error.
    pub async fn plan_change(
        &self,
        tenant_id: &str,
        subscription: i64,
        plan: i64,
    ) -> Result<PlanChange, Error> {
        plan_change::plan_change(self, tenant_id, subscription, plan).await
    }

    /// Write `change` if its snapshot still holds: the compare-and-set on
    /// (status, period start, watermark) first, then the invoices (the
    /// periods it was behind, then the used part) and their
    /// `invoice.finalized`, in one transaction.
    ///
    /// # Errors
    /// [`Error::SubscriptionPeriodMoved`] when the snapshot no longer holds or
    /// the period is already invoiced (nothing written); a database error.
    pub async fn apply_plan_change(&self, change: &PlanChange) -> Result<PlanChanged, Error> {
        plan_change::apply_plan_change(self, change).await
    }

    /// The first half of a retry, in the caller's transaction (so the
    /// caller's own compare-and-set commits with it): every invoice of
    /// `wanted` claimed by one conditional UPDATE (the lease free or
    /// expired, no attempt of unknown outcome, a saved card, collection not
    /// paused), then attempt
    /// `max(attempt_seq) + 1` of each claimed invoice recorded (one
    /// statement). Per request, in order: the started retry, or why nothing
    /// will be charged for it.
    ///
    /// # Errors
    /// A database error: the caller's transaction is aborted, roll it back.
    pub async fn start_retries_in(
        &self,
        tx: &mut db::Tx,
        wanted: &[RetryRequest],
    ) -> Result<Vec<Result<StartedRetry, NotCharged>>, Error> {
        retry::start_retries_in(self, tx, wanted).await
    }

    /// The second half of a retry:
    /// the calls of `started`, `concurrency` at once (the caller's setting), each under the
    /// panic guard (`step` names it; a call that would start after
    /// `deadline` or once `cancelled` is not made and stays unknown for the
    /// reconciler), then every answer settled in one transaction
    /// (`invoice.paid`, `payment.succeeded` and the receipt; `payment.failed`,
    /// with no email: a retry's is dunning's, docs/adr/0114), each row by its own compare-and-set. Per started
    /// retry: what it came to, or its panic (its attempt stays unknown for the
    /// reconciler, its claim lease expires). A refused key (401/403) is
    /// [`Error::ProviderKeyRejected`] for its row, counted on
    /// `hardcount_billing_provider_key_rejected_total`; the gate it closed
    /// leaves the batch's other retries unsent and rewound.
    pub async fn finish_retries(
        &self,
        started: Vec<StartedRetry>,
        calls: &tokio::sync::Semaphore,
        deadline: Instant,
        cancelled: impl Fn() -> bool + Copy,
        step: impl Fn(&StartedRetry) -> String + Copy,
    ) -> Vec<(StartedRetry, Result<Result<Retried, Error>, Payload>)> {
        retry::finish_retries(self, started, calls, deadline, cancelled, step).await
    }

    /// Cancel `subscription` of `tenant_id`, now or at the period's end.
    ///
    /// # Errors
    /// [`Error::SubscriptionNotFound`] (no active subscription),
    /// [`Error::SubscriptionPeriodMoved`] (nothing written),
    /// [`Error::Unbillable`], or a database error.
    pub async fn cancel_subscription(
        &self,
        tenant_id: &str,
        subscription: i64,
        at: CancelAt,
    ) -> Result<Canceled, Error> {
        cancel::cancel_subscription(self, tenant_id, subscription, at).await
    }

    /// [`Biller::cancel_subscription`] inside the caller's transaction (the
    /// HTTP API's): the subscription's row locked, then the same writes.
    ///
    /// # Errors
    /// As [`Biller::cancel_subscription`]; on any error the caller must roll back.
    pub async fn cancel_subscription_in(
        &self,
        tx: &mut db::Tx,
        tenant_id: &str,
        subscription: i64,
        at: CancelAt,
    ) -> Result<Canceled, Error> {
        cancel::cancel_subscription_in(self, tx, tenant_id, subscription, at).await
    }

    /// Pause `subscription`'s collection in the caller's transaction with
    /// `behavior` (`keep_as_draft`, `mark_uncollectible` or `void`: the
    /// column's CHECK) until `resumes_at` (or until resumed), set by
    /// [`crate::SET_BY_API`], announced with `subscription.collection_paused`.
    /// Replaces any pause in force, dunning's included.
    ///
    /// The periods that ended before now are closed first, as the tick would
    /// (docs/adr/0096).
    ///
    /// # Errors
    /// [`Error::SubscriptionNotFound`], [`Error::InvalidState`] (canceled),
    /// [`Error::SubscriptionPeriodMoved`] (more than `catch_up_periods`
    /// behind), or a database error; on any error the caller must roll back.
    pub async fn pause_collection_in(
        &self,
        tx: &mut db::Tx,
        tenant_id: &str,
        subscription: i64,
        behavior: &str,
        resumes_at: Option<DateTime<Utc>>,
    ) -> Result<CollectionPause, Error> {
        collection::pause_collection_in(self, tx, tenant_id, subscription, behavior, resumes_at)
            .await
    }

    /// Clear `subscription`'s pause in the caller's transaction, announced
    /// with `subscription.collection_resumed`; returns the pause cleared.
    ///
    /// The periods that ended before now are closed first, under the pause
    /// (docs/adr/0096).
    ///
    /// # Errors
    /// [`Error::SubscriptionNotFound`], [`Error::InvalidState`] (no pause in
    /// force), [`Error::SubscriptionPeriodMoved`] (more than
    /// `catch_up_periods` behind), or a database error; on any error the
    /// caller must roll back.
    pub async fn resume_collection_in(
        &self,
        tx: &mut db::Tx,
        tenant_id: &str,
        subscription: i64,
    ) -> Result<CollectionPause, Error> {
        collection::resume_collection_in(self, tx, tenant_id, subscription).await
    }

    /// A cancel now inside the caller's transaction (dunning's final action,
    /// which writes its notice in the same transaction): the used part
    /// invoiced as [`Biller::cancel_subscription`] does, after the periods it
    /// is behind (docs/adr/0077). `None` when the subscription is not active:
    /// nothing written.
    ///
    /// # Errors
    /// [`Error::SubscriptionPeriodMoved`] when the period is already invoiced
    /// or moved (the caller must roll back), or more than `catch_up_periods`
    /// are due; [`Error::Unbillable`], or a database error.
    pub async fn cancel_now_in(
        &self,
        tx: &mut db::Tx,
        tenant_id: &str,
        subscription: i64,
    ) -> Result<Option<Canceled>, Error> {
        cancel::cancel_now_in(self, tx, tenant_id, subscription).await
    }

    /// The fenced trial funnel (for tests and tools): up to `limit` ended
    /// trials, as the activation will prove them.
    ///
    /// # Errors
    /// A database error.
    pub async fn claim_ended_trials(
        &self,
        fence: &Fence,
        limit: usize,
    ) -> Result<Vec<EndedTrial>, Error> {
        lifecycle::claim_ended_trials(self, fence, limit).await
    }

    /// Activate `trials` from the snapshot they hold; returns how many this
    /// call activated (a lost compare-and-set writes nothing).
    ///
    /// # Errors
    /// [`Error::Unbillable`] (nothing written), or a database error.
    pub async fn end_trials(&self, trials: &[EndedTrial]) -> Result<usize, Error> {
        lifecycle::end_trials(self, trials).await
    }

    /// The fenced resume funnel (for tests and tools).
    ///
    /// # Errors
    /// A database error.
    pub async fn claim_lifted_pauses(
        &self,
        fence: &Fence,
        limit: usize,
    ) -> Result<Vec<LiftedCollectionPause>, Error> {
        lifecycle::claim_lifted_pauses(self, fence, limit).await
    }

    /// Resume `pauses` from the snapshot they hold; returns how many this
    /// call resumed.
    ///
    /// # Errors
    /// A database error.
    pub async fn resume_collections(
        &self,
        pauses: &[LiftedCollectionPause],
    ) -> Result<usize, Error> {
        lifecycle::resume_collections(self, pauses).await
    }

    pub fn config(&self) -> &BillingConfig {
        &self.inner.config
    }

    /// One tick of the role: its steps in order ([`scheduler::Steps`]), each
    /// a driven pass under the panic guard (a panic in one still lets the
    /// later ones run, and is raised after the last), all of them within the
    /// one `tick_budget`: expired trials, lifted pause-collection resumes, due
    /// billing, auto-charge, the payment-method request, then the payment
    /// reconciler's unknown-outcome and stale-hold sweeps (auto-charge, the
    /// request and the unknown-outcome sweep only when a provider is
    /// configured). Due billing closes batches of due subscriptions, a
    /// subscription several periods behind once per period, oldest first. A
    /// step that starts with the budget spent claims nothing and the tick is
    /// due again at once.
    ///
    /// The tick ends as its worst step did: [`TickEnd::Failed`] (a claim or a
    /// write failed, or the provider is down), then [`TickEnd::MoreWork`]
    /// (the budget ran out), else drained.
    ///
    /// # Panics
    /// When a step or a row panicked, after every other step ran (so the
    /// lease is released as panicked).
    ///
    /// # Cancel safety
    /// `tick.cancel` is checked between batches. A batch's close is one
    /// transaction: dropped mid-way it rolls back, and its subscriptions stay due.
    pub async fn run_tick(&self, tick: &Tick) -> TickReport {
        tick::run_tick(self, tick).await
    }

    /// The fenced funnel: up to `limit` due subscriptions with the snapshot
    /// their closing will prove. Empty when nothing is due or `fence` is stale.
    ///
    /// # Errors
    /// A database error; nothing was claimed.
    pub async fn claim_due(&self, fence: &Fence, limit: usize) -> Result<Vec<Due>, Error> {
        tick::claim_due(self, fence, limit).await
    }

    pub(crate) async fn claim_due_except(
        &self,
        fence: &Fence,
        limit: usize,
        except: &[i64],
    ) -> Result<Vec<Due>, Error> {
        tick::claim_due_except(self, fence, limit, except).await
    }

    /// Rows a claim could not decode (an `infinity` timestamp written before
    /// the CHECKs, say): each logged by id and counted; the caller leaves
    /// them out of the rest of the tick.
    pub(crate) fn undecodable(&self, step: &'static str, ids: &[i64]) {
        tick::undecodable(self, step, ids)
    }

    /// How a period writer writes: the sender of receipts and the timeout.
    pub(crate) fn writing(&self) -> invoice::Writing<'_> {
        tick::writing(self)
    }

    /// Close `due`'s current period from the snapshot it holds: advance the
    /// period by compare-and-set, create its invoice and enqueue
    /// `invoice.finalized`, in one transaction. Not fenced: the
    /// compare-and-set and the dedup index stop a stale or second closer.
    ///
    /// # Errors
    /// [`Error::Unbillable`] when the period cannot be computed (nothing
    /// written); a database error (rolled back, nothing written).
    pub async fn close_period(&self, due: &Due) -> Result<Closed, Error> {
        tick::close_period(self, due).await
    }

    /// Close a batch: each closing computed under `panics` (a subscription
    /// whose closing panics is returned in the left-out list), the rest in
    /// one transaction.
    pub(crate) async fn close_batch(
        &self,
        batch: Vec<Due>,
        at: DateTime<Utc>,
        panics: &mut Panics,
        tally: &mut Tally,
    ) -> Result<Vec<i64>, Error> {
        tick::close_batch(self, batch, at, panics, tally).await
    }

    /// A refused key: counted (the alert `HardcountPaymentProviderKeyRejected`
    /// fires on it), logged once for the tick, and the tick's error.
    pub(crate) fn key_rejected(&self, status: u16, message: String) -> Error {
        tick::key_rejected(self, status, message)
    }

    pub(crate) async fn refresh_gauges(&self) {
        tick::refresh_gauges(self).await
    }
}
