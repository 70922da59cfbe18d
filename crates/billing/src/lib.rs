//! The `billing` role: each due subscription's period closed once, each closed
//! period invoiced once, each invoice announced once with `invoice.finalized`.
//!
//! ```text
//!  billing tick (leader only)
//!  ──────────────────────────────────────────────────────────────────────────
//!  claim ≤ batch due subscriptions          status = 'active', next_billing_at <= now(),
//!    with their plan (the snapshot)          AND leader_fence('billing', $token),
//!                                            FOR UPDATE OF s SKIP LOCKED      (fenced)
//!    a row whose timestamps are out of 0020's range ──▶ left out, logged, counted
//!  per subscription, under the panic guard:
//!    close::close_behind(snapshot, now) ── pure: the periods it is behind, each
//!      invoiced [start, end), at most catch_up_periods (the rest next tick)
//!    panics ──▶ left out for the rest of the tick, raised at the end
//!  invoice::close_periods, one transaction for the batch (docs/adr/0025):
//!    1. UPDATE subscriptions … FROM unnest(…)    the compare-and-set, per chain:
//!         WHERE status, current_period_start,    lost ──▶ nothing written
//!           next_billing_at, cancel_at_period_end = $read
//!    2. invoice::dispose (pure): draft | void | uncollectible under a pause,
//!         paid at once (nothing due, or under the provider's minimum and carried
//!         to the customer's balance), else open
//!    3. the tenant's next invoice numbers (invoice_counters, gap-free)
//!    4. INSERT invoices … ON CONFLICT ON CONSTRAINT idx_invoices_billing_period_dedup
//!         DO NOTHING                             hit ──▶ roll back, redo without it
//!    5. the balances' net change; the events (one statement) and receipts
//!  COMMIT; the next batch, until a short batch, the budget, or cancel
//! ```
//!
//! Then auto-charge (`charge`, docs/adr/0011), a batch at a time through the
//! set-based primitives of [`batch`] (docs/adr/0017), when a provider is configured:
//!
//! ```text
//!  one transaction:
//!    claim ≤ 8 × charge_concurrency invoices  lease free or expired, no attempt yet,
//!      lease = now() + charge_lease            AND leader_fence('billing', $token)  (fenced)
//!    INSERT attempt 1 (unknown, key) per invoice  only while that row's claim holds it
//!  POST /v1/payment_intents, Idempotency-Key = (invoice, attempt),
//!    charge_concurrency at a time, each call under the panic guard
//!  one transaction for every answer of the batch, each row by its own CAS:
//!      succeeded ─▶ open → paid (claim still ours, unexpired), attempt succeeded
//!      declined  ─▶ claim released, attempt declined(code)
//!      unknown   ─▶ attempt stays unknown with its reason; lease expires; the reconciler's
//!      any answer that may have charged, its invoice closed meanwhile ─▶ attempt needs
//!                   review, invoice flagged, keeping its status (docs/adr/0142)
//!    + invoice.paid, payment.succeeded, payment.failed (enqueue_many) and the receipts
//!      and payment-failed emails (outbox::email::enqueue_many) of the rows that won
//!    (failing whole, it is redone one row at a time)
//!  every call of the batch an outage (refused, 5xx) ─▶ the tick ends as failed
//! ```
//!
//! The tick's steps, in this order, each a driven pass under the panic guard
//! (a panic in one lets the later ones run and is raised after the last):
//!
//! 1. **expired trials** activate by compare-and-set on status (and the trial
//!    end read) with `subscription.trial_ended`; a trial that ends off the
//!    anchor's grid starts a partial period (`lifecycle`);
//! 2. **due billing** (above); a partial period is invoiced pro rata, rounded
//!    half up ([`period::pro_rata`], [`close`]); a period that ended before a
//!    pause's resume time is invoiced under the pause, whenever it is closed;
//! 3. **lifted pause-collections** resume by compare-and-set on the pause read,
//!    with `subscription.collection_resumed` in the same transaction, once the
//!    subscription is not behind (docs/adr/0110);
//! 4. **auto-charge** (above), `charge_concurrency` calls at a time;
//! 5. **the payment-method request** (`action_required`): an open automatic
//!    invoice whose customer has no payment method is announced with
//!    `invoice.payment_action_required` and one email, once;
//! 6. **the payment reconciler** (`reconcile`): open attempts whose claim has
//!    expired are resolved from the provider's record (docs/adr/0024); an
//!    attempt never sent is sent only while its invoice is chargeable;
//! 7. **stale holds**: expired claims are freed.
//!
//! A plan change ([`Biller::change_plan`]) closes the periods that ended and
//! were not closed yet, as the tick would (docs/adr/0088), then truncates the
//! period holding now through the closing's compare-and-set and invoices the
//! used part pro rata; it fails
//! with [`Error::SubscriptionPeriodMoved`] (`subscription_period_moved`) and
//! writes nothing when the watermark moved, and with
//! [`Error::PlanCurrencyMismatch`] for a plan in another currency. A cancel
//! ([`Biller::cancel_subscription`]) ends the subscription now, invoicing the
//! used part unless the tenant says not to, or at the period's end.
//!
//! **Dunning enrolment is not billing's**: an open invoice whose attempt was
//! declined is the hand-off; the dunning crate enrols such invoices as the
//! first step of its own tick (docs/adr/0012), and charges its retries through
//! [`Biller::start_retries_in`] and [`Biller::finish_retries`] (a batch, of
//! one or many; `retry`).
//!
//! Guarantees:
//!
//! - **Each period is closed once.** The closing's first statement proves the
//!   (status, period start, watermark) snapshot it was computed from, per row;
//!   a second closer (a stale leader's in-flight batch, a concurrent tick)
//!   waits on the row lock, re-checks against the winner's row and writes nothing.
//! - **Each (subscription, period start) is invoiced once**, by
//!   `idx_invoices_billing_period_dedup`. A dedup hit writes nothing, not even
//!   the period advance, and is left out of the tick with a warning.
//! - **An invoice exists iff its event does**: the period advance, the invoice
//!   and `invoice.finalized` commit or roll back together.
//! - **A replaced leader claims nothing**: the funnel proves
//!   `leader_fence('billing', $token)` and takes a [`leader::Fence`]. Closing
//!   is not fenced (docs/design.md §3.3): what a stale leader listed before
//!   the takeover lands only through the compare-and-set.
//! - **Periods follow the anchor**, in UTC, clamped at month ends, never
//!   chained ([`period`]).
//! - **A row that panics stops itself, not billing**: it is left out, every
//!   other due subscription is billed in the same tick, and the tick then ends
//!   as panicked (released with its cooldown, counted on
//!   `hardcount_leader_lease_lost_total{reason="panicked"}`).
//! - **Money is integer minor units**, never a float.
//! - **An invoice is charged once**: one claim holds it at a time (the lease),
//!   the attempt row is written before the call and is unique per (invoice,
//!   attempt), and the provider's idempotency key is fixed by that pair.
//! - **A charge's result and its announcements commit together**: paid with
//!   `invoice.paid`, `payment.succeeded` and the receipt; declined with
//!   `payment.failed` and, for an invoice's first attempt, its email (a
//!   retry's is the dunning policy's, docs/adr/0114); only while the claim
//!   still holds it.
//! - **The secret key is never shown**: not in logs, errors or `Debug`.
//! - **An unknown outcome is settled by its key, once**: the reconciler looks it
//!   up only after the claim that made the call expired, under its own claim;
//!   a refusal of the key is not taken for a decline; one answered after its
//!   invoice was closed is sent to review, not left where no one looks.
//! - **A provider outage fails the tick** (every call of a batch refused or
//!   5xx): released as failed, retried after the short cooldown.
//!
//! Modules: `config` (defaults and validation), `tick` ([`Biller`], the
//! driver's implementation of due billing), `invoice` (the one writer of
//! invoices and its pure rules), `store` (the claims, auto-charge's and the
//! reconciler's SQL), `lifecycle` (trials, resumes), `charge` and [`batch`]
//! (auto-charge), `action_required`, `reconcile` (the payment reconciler),
//! `retry` (dunning's seam), `plan_change`, `cancel`, `collection` (pause and
//! resume collection), [`review`] (the
//! operator's), [`provider`] (the HTTP client and its answer table), and the
//! pure [`close`], [`period`] and [`money`].

mod action_required;
pub mod batch;
mod biller;
mod cancel;
mod charge;
pub mod close;
mod collection;
mod config;
mod invoice;
mod lifecycle;
pub mod money;
pub mod period;
mod plan_change;
pub mod provider;
mod reconcile;
mod retention;
/// The retention prune's statement text, for the plan tests; not an API.
#[doc(hidden)]
pub mod statements {
    pub use crate::batch::START_ATTEMPTS;
    pub use crate::batch::settle::{SETTLE, SETTLE_CLOSED, SETTLE_OPEN};
    pub use crate::charge::store::{CLAIM_AND_START, CLAIM_CHARGES};
    pub use crate::reconcile::store::{CLAIM_UNKNOWN, FREE_STALE_HOLDS, OPERATOR_SETTLED};
    pub use crate::retention::{CLEAR_RAW_ANSWERS, DELETE_IDEMPOTENCY_KEYS, NO_SEQUENTIAL_SCAN};
    pub use crate::retry::{CLAIM_RETRIES, START_RETRIES, WRITTEN_JOIN_ORDER};
    pub use crate::store::CLAIM_DUE;
}
mod retry;
pub mod review;
mod store;
mod tick;

pub use action_required::AskTally;
pub use batch::ChargeClaim;
pub use biller::Biller;
pub use cancel::{CancelAt, Canceled};
pub use charge::{ChargeTally, Charged};
pub use close::{Due, Plan, Unbillable};
pub use collection::{CollectionPause, SET_BY_API};
pub use config::{BillingConfig, ConfigError};
pub use invoice::Closed;
pub use lifecycle::{EndedTrial, LifecycleTally, LiftedCollectionPause};
pub use plan_change::{PlanChange, PlanChanged};
pub use provider::{ChargeOutcome, Provider, ProviderConfig, SecretKey};
pub use reconcile::ReconcileTally;
pub use retry::{NotCharged, Retried, RetryRequest, StartedRetry};
pub use tick::{Tally, TickReport};

/// Errors of the billing role.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("billing store: {0}")]
    Db(#[from] db::Error),
    #[error(transparent)]
    Unbillable(#[from] Unbillable),
    /// `invoice.finalized` was refused; the closing rolled back.
    #[error("billing could not enqueue invoice.finalized: {0}")]
    Enqueue(#[from] outbox::webhook::EnqueueError),
    /// A receipt or payment-failed email was refused; the settling rolled back.
    #[error("billing could not enqueue an email: {0}")]
    EmailEnqueue(#[from] outbox::email::EnqueueError),
    /// Every provider call of a batch found the provider down (connection
    /// refused or 5xx): the tick stops and is released as failed.
    #[error("payment provider outage: all {calls} calls of the batch failed ({last})")]
    ProviderOutage { calls: usize, last: String },
    /// The provider refused this deployment's secret key (401/403): rolled or
    /// wrong. Nothing was recorded against any customer; no further call is
    /// made this tick, which ends failed.
    #[error(
        "the payment provider refused BILLING_PROVIDER_SECRET_KEY (HTTP {status}): rolled or wrong; no charge is attempted until it is fixed"
    )]
    ProviderKeyRejected { status: u16 },
    /// A plan change found the period moved since its snapshot (the tick
    /// closed it, or another change truncated it), or the subscription
    /// further behind than `catch_up_periods`, or its period set to end it
    /// ended (docs/adr/0088): nothing was written.
    /// Code `subscription_period_moved` (HTTP 409 once the API exists).
    #[error("subscription {subscription} period moved under the plan change; nothing written")]
    SubscriptionPeriodMoved { subscription: i64 },
    /// A plan change to a plan in another currency: refused, as the
    /// provider refuses it. Code `plan_currency_mismatch` (HTTP 409).
    #[error("subscription {subscription} is billed in {from}; a plan in {to} is refused")]
    PlanCurrencyMismatch {
        subscription: i64,
        from: String,
        to: String,
    },
    /// A plan change named no active subscription of the tenant, or a plan
    /// not of the tenant. Code `subscription_not_found`.
    #[error("no active subscription {subscription} with plan {plan} in tenant {tenant}")]
    SubscriptionNotFound {
        tenant: String,
        subscription: i64,
        plan: i64,
    },
    /// The subscription's state does not allow the change (a canceled
    /// subscription paused, a resume with no pause in force): nothing
    /// written. Code `invalid_state` (HTTP 409).
    #[error("subscription {subscription}: {reason}")]
    InvalidState {
        subscription: i64,
        reason: &'static str,
    },
}

impl Error {
    /// A stable machine-readable code, for the API's error bodies.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Config(_) => "billing_config",
            Error::Db(_) => "billing_store",
            Error::Unbillable(_) => "subscription_unbillable",
            Error::Enqueue(_) | Error::EmailEnqueue(_) => "billing_enqueue",
            Error::ProviderOutage { .. } => "payment_provider_outage",
            Error::ProviderKeyRejected { .. } => "payment_provider_key_rejected",
            Error::SubscriptionPeriodMoved { .. } => "subscription_period_moved",
            Error::SubscriptionNotFound { .. } => "subscription_not_found",
            Error::PlanCurrencyMismatch { .. } => "plan_currency_mismatch",
            Error::InvalidState { .. } => "invalid_state",
        }
    }
}
