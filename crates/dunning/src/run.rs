//! A run as the funnel listed it, and what became of it: the snapshot every
//! write of a retry proves ([`Run`]), why a due retry cannot be charged
//! ([`NotChargeable`]), the result of one listed run ([`Retry`]) and of its
//! final action ([`FinalActed`]). Types only.

use chrono::{DateTime, TimeDelta, Utc};

use crate::Error;
use crate::policy::Policy;

/// A run as the funnel listed it: the snapshot every write of this retry proves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub id: i64,
    pub tenant_id: String,
    pub invoice_id: i64,
    /// The invoice's `PREFIX-000123`, once billing numbers it.
    pub invoice_number: Option<String>,
    pub subscription_id: i64,
    pub policy_id: i64,
    /// `active`, or `exhausted` with its final action still owed.
    pub status: String,
    pub attempt_count: i32,
    pub first_declined_at: DateTime<Utc>,
    pub next_attempt_at: DateTime<Utc>,
    /// The database's clock less this replica's when the run was listed: the
    /// next retry is reckoned on the database's clock ([`Run::database_now`]),
    /// which every due time is compared with, not on a replica's that may be
    /// skewed (docs/adr/0045, 0133).
    pub clock_skew: TimeDelta,
    /// The invoice's status when listed.
    pub invoice_status: String,
    pub amount: i64,
    pub currency: String,
    pub email: String,
    /// The customer's payment method when listed (a retry not attempted
    /// proves it unchanged).
    pub payment_method: Option<String>,
    /// Why an active run's due retry cannot be charged, if it cannot.
    pub not_chargeable: Option<NotChargeable>,
    /// With [`NotChargeable::DeclineUnannounced`]: what the retry that was
    /// answered `processing` settled as (its decline code, else its status).
    pub owed_code: Option<String>,
    /// The tenant's sender (`tenant_settings.email_from`), if it set one.
    pub email_from: Option<String>,
    /// The tenant's payment page (`tenant_settings.payment_page_url`, a
    /// template), if it set one: the warnings link to it (docs/adr/0150).
    pub payment_page_url: Option<String>,
    pub policy: Policy,
}

impl Run {
    /// Now on the database's clock, as read through this replica's.
    pub fn database_now(&self) -> DateTime<Utc> {
        Utc::now() + self.clock_skew
    }
}

/// Why a due retry is counted without a provider call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotChargeable {
    /// The customer has no payment method.
    NoPaymentMethod,
    /// The last attempt was a hard decline (or wanted authentication) on the
    /// payment method the customer still has (docs/adr/0024).
    PaymentMethodUnchanged,
    /// Every retry of the policy was made, the last one answered `processing`
    /// and since settled without paying the invoice (docs/adr/0073): the run
    /// is exhausted at its count, with no further charge.
    RetriesSpent,
    /// Every retry of the policy was made and the last one's outcome is still
    /// pending (processing, unknown, or in review): the run waits a hold for
    /// it, with no charge and nothing counted (docs/adr/0073).
    OutcomePending,
    /// The last retry was answered `processing` and has since settled without
    /// paying the invoice: its decline is announced (`dunning.attempt_failed`,
    /// the warning) and the next retry scheduled, with no charge
    /// (docs/adr/0085).
    DeclineUnannounced,
}

impl NotChargeable {
    pub fn as_str(self) -> &'static str {
        match self {
            NotChargeable::NoPaymentMethod => "no_payment_method",
            NotChargeable::PaymentMethodUnchanged => "payment_method_unchanged",
            NotChargeable::RetriesSpent => "retries_spent",
            NotChargeable::OutcomePending => "outcome_pending",
            NotChargeable::DeclineUnannounced => "decline_unannounced",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<NotChargeable> {
        Some(match s {
            "no_payment_method" => NotChargeable::NoPaymentMethod,
            "payment_method_unchanged" => NotChargeable::PaymentMethodUnchanged,
            "retries_spent" => NotChargeable::RetriesSpent,
            "outcome_pending" => NotChargeable::OutcomePending,
            "decline_unannounced" => NotChargeable::DeclineUnannounced,
            _ => return None,
        })
    }
}

/// What became of one listed run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Retry {
    /// The retry paid the invoice; the run is recovered.
    Recovered,
    /// A definite decline; the next retry is scheduled.
    Declined { code: String },
    /// The retry could not be charged (no payment method, or a hard decline
    /// on the payment method the customer still has): counted without a
    /// provider call, the next retry scheduled.
    NotAttempted { why: NotChargeable },
    /// The last retry was declined (`code`: its decline code) or not attempted
    /// (`code`: why); the run is exhausted and its final action ran.
    Exhausted {
        code: String,
        final_action: FinalActed,
    },
    /// The provider accepted the retry and has not settled it (`processing`),
    /// or, after the policy's last retry, that retry's outcome is still
    /// pending: the attempt counts, and the run waits until `next_attempt_at`
    /// (docs/adr/0073). Billing's reconciler settles the attempt meanwhile.
    Pending { next_attempt_at: DateTime<Utc> },
    /// No definite answer (timeout, 5xx, a lost or held claim, an error):
    /// the attempt was rewound, the run is as it was listed. `unanswered`:
    /// the provider was asked and gave no answer to rely on.
    Rewound { why: String, unanswered: bool },
    /// The invoice was settled elsewhere; the run ended without a charge.
    Stopped { invoice_status: String },
    /// An exhausted run's owed final action ran (after a crash between the
    /// exhaustion and its action).
    FinalAction(FinalActed),
    /// Another worker moved the run first (its attempt compare-and-set, or a
    /// transition, found another count): nothing written.
    Lost,
}

/// What the final-action step wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalActed {
    /// This call took the action, announced it and sent the final notice.
    Written,
    /// The action was already in force (dunning's pause held, the
    /// subscription canceled) or the invoice is no longer open: nothing
    /// written, announced or sent.
    NothingToDo,
    /// Another call already ran the step, or the pause moved under it:
    /// nothing written (a step not stamped is listed again).
    Lost,
    /// A write-off whose invoice a charge may be in flight on (billing's
    /// claim unexpired, or an attempt sent and not settled): nothing
    /// written and the step not stamped, so a later listing takes it again
    /// once the charge is settled (docs/adr/0141).
    Held,
    /// The invoice was found paid under its row lock (the charge a held
    /// write-off waited for settled paid, or a payment by hand): the step
    /// was not taken; the run ended `recovered` with `dunning.recovered`
    /// (docs/adr/0147).
    Recovered,
}

/// What one listed run of a batch came to: `None` when it was not started
/// (out of budget, cancelled); else its result, or its panic.
pub(crate) type Outcome = Option<Result<Result<Retry, Error>, scheduler::Payload>>;
