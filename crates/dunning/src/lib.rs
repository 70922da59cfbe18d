//! The `dunning` role: retry runs for declined invoices, each attempt counted
//! once, charged once, and each run ended by its final action once.
//!
//! ```text
//!  dunning tick (leader only)                                             tick.rs
//!  ──────────────────────────────────────────────────────────────────────────────
//!  1. enrol (fenced, one transaction)   open automatic invoices whose latest
//!       payment attempt billing recorded as declined, with no run yet, of a
//!       tenant whose default policy passes the offsets check
//!       → a run with the tenant's default policy (ON CONFLICT (invoice) DO NOTHING;
//!         the built-in default policy is created for a tenant without one)
//!       + dunning.started                                                enrol.rs
//!  2. list ≤ batch runs (fenced)        active and due, or exhausted with the final
//!       AND leader_fence('dunning', $token)    action owed; FOR UPDATE SKIP LOCKED;
//!       per row: not_chargeable (every retry made: retries_spent, or
//!       outcome_pending while the last one's outcome is unsettled; no payment
//!       method, or a hard decline on the payment method the customer still
//!       has; these two not marked while collection is paused: billing holds
//!       those), policy_valid (migration 0021's CHECK
//!       expressions, repeated), the tenant's sender
//!       only tenants whose default policy's business window is open at the
//!       statement's now(), in its zone (docs/adr/0045): a closed tenant's due
//!       runs are not listed, so they wait, due, for the opening
//!       left out, logged with the run and counted: a policy failing the checks
//!       (tenant and policy named), a row that does not decode (even by a panic)
//!                                                                      listing.rs
//!  per batch (docs/adr/0017), split by tick.rs:
//!     exhausted, or invoice not open ─▶ final action / run recovered (paid) or
//!                      stopped, no charge; each its own transaction, under the guard
//!                      (final_action/, outcomes.rs)
//!     not chargeable ─▶ ONE transaction, no provider call, no payment.failed:
//!                attempt_count = n + 1, next attempt from the policy (or exhausted)
//!                WHERE attempt_count = n AND invoice open
//!                  AND the customer's payment method is still the one listed
//!                + dunning.retry_skipped (+ warning) / dunning.exhausted
//!                then the final action step of each exhausted run  not_attempted.rs
//!                (retries_spent: exhausted at n, no count; outcome_pending:
//!                next_attempt_at = now() + hold, nothing counted, docs/adr/0073)
//!     ONE transaction for the others:                                   charge.rs
//!       record:  attempt_count = n + 1, next_attempt_at = now() + hold
//!                WHERE status = 'active' AND attempt_count = n  (per row, one
//!                UPDATE … FROM unnest)                        lost ─▶ nothing
//!       plan what a decline would do, per run under the guard (pure; a time out
//!                of range panics here: that run is rewound in this transaction)
//!       payments::Collector::start_retries_in   claim leases, attempts (invoice, seq)
//!       rewind the runs that panicked or whose invoice is held
//!     payments::Collector::finish_retries   calls, ≤ concurrency at once (with the
//!                other batches in flight, docs/adr/0054), each under
//!                the guard; one settling transaction for the batch
//!     ONE transaction for the batch's outcomes, each run by its compare-and-set
//!                on the count (and, for a decline, the hold) its retry wrote:
//!       paid        ─▶ run recovered + dunning.recovered
//!       processing  ─▶ the count stays; next_attempt_at = the policy's next
//!                      retry, or after the last one now() + hold (docs/adr/0073)
//!       declined    ─▶ next attempt from the policy + dunning.attempt_failed
//!                      (+ warning email), or, after the last retry:
//!                      run exhausted + dunning.exhausted,
//!                      then the final action step           (per run, after it)
//!       unknown, not charged, error, panic
//!                   ─▶ rewind: attempt_count = n, next_attempt_at as listed
//!                      WHERE attempt_count = n + 1 AND next_attempt_at = hold
//!     that transaction failed ─▶ each run's transition in its own transaction;
//!                a run whose own fails too stays counted and held; after
//!                the hold the listing writes its outcome from its attempt
//!                (the writes of the outcomes: outcomes.rs)
//!  final action step (one transaction; per run, or the batch's exhausted runs
//!     together, then per run on an error)                     final_action/mod.rs
//!     final_action_at stamped only if unset,
//!     then by a conditional write:
//!       cancel_subscription  subscription → canceled      + subscription.canceled
//!       mark_uncollectible   invoice → uncollectible + invoice.marked_uncollectible
//!       pause_collection     subscription row locked, then (docs/design.md §4.3):
//!                                                           final_action/pause.rs
//!           dunning's pause in force ─▶ already held, nothing
//!           a pause lifted (resumes_at ≤ now) ─▶ cleared by CAS on it
//!                                   + subscription.collection_resumed, then ↓
//!           none, or anyone else's ─▶ pause (policy's pause_behavior, no resume
//!                                   time, set_by dunning) by CAS on the pause read
//!                                   + subscription.collection_paused
//!     + the final notice saying what the action did: only if it changed a row
//! ```
//!
//! The hand-off from billing (docs/adr/0013): billing records a declined
//! attempt (`payment_attempts.provider_status = 'declined'`) and leaves the
//! invoice open; dunning's enrolment, the first step of its tick, turns that
//! into a run. Billing never writes `dunning_runs`.
//!
//! Guarantees:
//!
//! - **An attempt is counted once**: the record proves the count it read
//!   (`AND attempt_count = $expected`); a stale leader's in-flight retry, or a
//!   second worker, finds another count and writes nothing.
//! - **A card is charged once per attempt**: billing's claim lease holds the
//!   invoice during the call, the attempt's idempotency key is fixed by
//!   (invoice, attempt sequence), and no retry claims an invoice whose last
//!   attempt's outcome is unknown: the reconciler settles it by its key first.
//! - **Only a definite decline counts.** A timeout, a 5xx, a lost or held claim,
//!   an error or a panic rewinds the attempt through the same compare-and-set;
//!   the run is as it was listed (docs/design.md §5). So does an outcome that
//!   could not be written, batched or alone; a decline written once stays once
//!   (its write and the rewind both prove the hold).
//! - **A retry that cannot be charged follows the schedule** (docs/adr/0026):
//!   no payment method, or a hard decline on the unchanged payment method, is
//!   counted without a provider call, so the run reaches its final action on
//!   time; a payment method added before the count is charged instead.
//! - **Effects only with their transition**: `dunning.*` events, the warnings
//!   and the final notice are queued in the transaction of the transition
//!   that caused them, and only when it changed the row; the final notice
//!   only when the final action changed something.
//! - **The final action runs once**: its step stamps the run first (only if
//!   unstamped), and writes the pause, cancel or write-off only if not already
//!   in force and the invoice is still open; a retried step writes nothing.
//! - **Business windows hold on the database clock**: a run whose tenant's
//!   default policy has a window is listed only while the window is open at
//!   the listing's `now()` in the window's zone, so its retry, warning and
//!   final action (with its notice) are written only then; a new default
//!   moves the runs already scheduled. Without a window, always open.
//! - **A replaced leader lists nothing**: enrolment and the funnel prove
//!   `leader_fence('dunning', $token)` and take a [`leader::Fence`].
//! - **A provider outage stops the tick, not the runs' counts**: a batch in
//!   which the provider answered none of at least [`OUTAGE_UNANSWERED`]
//!   retries (all rewound) ends the tick as failed, retried after the short
//!   cooldown, instead of timing out on every due run.
//! - **One tenant's bad rows never stop another's**: each run is retried
//!   under the guard, a failing run is rewound and left out of the tick, and the
//!   tick goes on; a panic is raised at the end (released as panicked). A
//!   policy failing the schedule checks and a row that does not decode are
//!   left out at the listing, logged and counted.
//! - **An email never rolls back a transition**: a tenant's sender that does
//!   not parse is replaced by the configured one; an email the outbox would
//!   still refuse is dropped, logged and counted, and the transition commits.
//!
//! Modules, each step with its SQL, each using only those listed before it
//! (no import circle):
//!
//! - [`policy`] (pure: schedules, final actions, pause behaviours),
//!   [`window`] (pure: a business window and its checks) and `config`
//!   (defaults and validation);
//! - `run` (types: the listed [`Run`], [`NotChargeable`], what became of a
//!   run, [`Retry`], and of its final action, [`FinalActed`]);
//! - `notices` (pure: the customer's emails and their sender);
//! - `ctx` (the role's handles every step borrows: pool, settings, billing,
//!   telemetry; an email as the outbox takes it, a run's final notice);
//! - `enrol` (enrolment and its SQL);
//! - `listing` (the fenced funnel, its decoding, the bad-row and bad-policy
//!   skips, [`LeftOut`]);
//! - `outcomes` (the writes of a retry's outcome: recover, decline or
//!   exhaust, rewind, stop; batched and one run at a time);
//! - `final_action` (the per-run and batched final actions; `pause`: the
//!   pause rules);
//! - `not_attempted` (retries that cannot be charged, counted without a
//!   provider call);
//! - `charge` (the charged path: the count and claim transaction, billing's
//!   calls, the outcomes' transaction and its one-run-at-a-time fallback);
//! - `tick` ([`Dunner`]: the tick, the split of a batch among the steps, the
//!   tally, the driver's implementation).
//!
//! The charge itself is billing's, through the collection port
//! (`payments::Collector`: `start_retries_in`, `finish_retries`,
//! `cancel_now_in`); the binary hands dunning billing's `Biller` as it.

mod charge;
mod config;
mod ctx;
mod enrol;
mod final_action;
mod listing;
mod not_attempted;
mod notices;
mod outcomes;
pub mod policy;
mod run;
mod tick;
pub mod window;

/// The funnel's statement and its window rule, for the tests (the plan test
/// and the window rule's table test in `tests/it/window_rule.rs`); not an API.
#[doc(hidden)]
pub mod statements {
    pub use crate::listing::{LIST_DUE, WINDOW_OPEN_AT};
}

pub use config::{ConfigError, DunningConfig};
pub use listing::LeftOut;
pub use policy::{
    AfterDecline, FinalAction, MAX_OFFSET_SECS, MAX_RETRIES, PauseBehavior, Policy,
    ScheduleInvalid, check_schedule,
};
pub use run::{FinalActed, NotChargeable, Retry, Run};
pub use tick::{Dunner, OUTAGE_UNANSWERED, OUTCOMES_ALERTED, Tally, TickReport};
pub use window::{BusinessWindow, LocalTime, TimeInvalid, WindowInvalid, check_window};

/// Errors of the dunning role.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("dunning store: {0}")]
    Db(#[from] db::Error),
    /// The retry charge failed (the collector's error); its attempt row, if
    /// written, stays unknown for the reconciler.
    #[error("dunning retry charge: {0}")]
    Billing(#[from] payments::Error),
    /// A `dunning.*` event was refused; the transition rolled back.
    #[error("dunning could not enqueue an event: {0}")]
    Enqueue(#[from] outbox::webhook::EnqueueError),
    /// A warning or final-notice email was refused; the transition rolled back.
    #[error("dunning could not enqueue an email: {0}")]
    EmailEnqueue(#[from] outbox::email::EnqueueError),
    /// The transaction that counts a batch's attempts and claims their
    /// invoices failed: it rolled back, nothing of the batch was counted.
    #[error("dunning batch not started (rolled back, nothing counted): {0}")]
    BatchNotStarted(String),
    /// A retry not attempted could not be counted: the batch's transaction
    /// failed, and so did this run's own (it rolled back; the run is as
    /// listed).
    #[error("dunning retries not attempted were not counted (rolled back): {0}")]
    NotCounted(String),
    /// The provider answered none of a batch's retries (timeouts, 5xx): each
    /// was rewound, and the tick stops as failed to retry after the cooldown.
    #[error(
        "the payment provider answered none of {unanswered} dunning retries in a batch; the tick stops"
    )]
    ProviderOutage { unanswered: usize },
}
