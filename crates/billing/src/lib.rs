//! The `billing` role: each due subscription's period closed once, each closed
//! period invoiced once, each invoice announced once with `invoice.finalized`.
//!
//! ```text
//!  billing tick (leader only)
//!  ──────────────────────────────────────────────────────────────────────────
//!  claim ≤ batch due subscriptions          status = 'active', next_billing_at <= now(),
//!    with their plan (the snapshot)          AND leader_fence('billing', $token),
//!                                            FOR UPDATE OF s SKIP LOCKED      (fenced)
//!  per subscription, under the panic guard:
//!    close::close(snapshot)  ── pure: invoice [start, end), next period [end, end')
//!    panics ──▶ left out for the rest of the tick, raised at the end
//!  one transaction for the batch:
//!    1. UPDATE subscriptions … FROM unnest(…)    the compare-and-set, per row:
//!         WHERE status = $read AND current_period_start = $read
//!           AND next_billing_at = $read          lost ──▶ nothing written
//!    2. INSERT invoices … ON CONFLICT ON CONSTRAINT idx_invoices_billing_period_dedup
//!         DO NOTHING                             hit ──▶ roll back, redo without it
//!    3. webhook_outbox::enqueue(invoice.finalized) per invoice created
//!  COMMIT; the next batch, until a short batch, the budget, or cancel
//! ```
//!
//! Then auto-charge (`charge`, docs/adr/0011), when a provider is configured:
//!
//! ```text
//!  claim ≤ 50 open automatic invoices       lease free or expired, no attempt yet,
//!    lease = now() + charge_lease            AND leader_fence('billing', $token)  (fenced)
//!  per invoice, under the panic guard:
//!    INSERT attempt 1 (unknown, key)         only while our claim holds the invoice
//!    POST /v1/payment_intents, Idempotency-Key = (invoice, attempt)
//!      succeeded ─▶ open → paid by CAS (claim still ours) + invoice.paid,
//!                   payment.succeeded, receipt email            (one transaction)
//!      declined  ─▶ attempt declined(code), payment.failed, email (one transaction)
//!      unknown   ─▶ attempt stays unknown; lease expires; the reconciler's
//! ```
//!
//! Built so far: the schema (migration 0006), period math ([`period`]), the
//! due-billing step, auto-charge and the provider client ([`provider`]).
//! **Not built yet** (docs/adr/0010 and issue 10): expired trials,
//! pause-collection resumes, enrolment into dunning, the payment reconciler,
//! plan changes. Each will run under the panic guard in the order DESIGN.md gives.
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
//!   is not fenced (ADR-114): what a stale leader listed before the takeover
//!   lands only through the compare-and-set.
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
//!   `payment.failed` and its email; only while the claim still holds it.
//! - **The secret key is never shown**: not in logs, errors or `Debug`.
//!
//! Modules: `config` (defaults and validation), `store` (all SQL), `tick`
//! ([`Biller`], the driver's implementation), `charge` (the auto-charge step),
//! [`provider`] (the HTTP client), `close` and [`period`] (pure).

mod charge;
pub mod close;
mod config;
pub mod period;
pub mod provider;
mod retry;
mod store;
mod tick;

pub use charge::{ChargeTally, Charged};
pub use close::{Due, Unbillable};
pub use config::{BillingConfig, ConfigError};
pub use provider::{ChargeOutcome, Provider, ProviderConfig, SecretKey};
pub use retry::{NotCharged, Retried};
pub use store::{ChargeClaim, Closed};
pub use tick::{Biller, Tally, TickReport};

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
    Enqueue(#[from] webhook_outbox::EnqueueError),
    /// A receipt or payment-failed email was refused; the settling rolled back.
    #[error("billing could not enqueue an email: {0}")]
    EmailEnqueue(#[from] email_outbox::EnqueueError),
}
