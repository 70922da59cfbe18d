//! How dunning collects through billing without depending on it: the
//! payment collection port ([`Collector`]) and the data a charge attempt
//! carries across it. `billing` implements it (its provider client, charge
//! claims, attempts and settling); `dunning` holds an `Arc<dyn Collector>`
//! that the binary hands it. Neither role crate depends on the other
//! (docs/adr/0029).
//!
//! ```text
//!  dunning (a run's retry)                    billing (implements Collector)
//!  ───────────────────────                    ─────────────────────────────
//!  BEGIN; count the attempt (CAS)
//!  start_retries_in(tx, requests) ──────────▶ claim the invoices, record attempts
//!  COMMIT
//!  finish_retries(started, …) ──────────────▶ call the provider, settle every answer
//!  final action "cancel":
//!  cancel_now_in(tx, tenant, subscription) ─▶ the used part invoiced, subscription.canceled
//! ```
//!
//! **API Boundary**: everything a retry needs crosses here as plain data
//! ([`RetryRequest`], [`Started`], [`Retried`], [`NotCharged`],
//! [`Canceled`]) or as [`Error`]; dunning never sees billing's provider,
//! settings or errors.

mod page;
mod window;

pub use page::{INVOICE_PLACEHOLDER, payment_page, payment_page_line, payment_pages};

use std::fmt;
use std::time::{Duration, Instant};

use db::{Row, Tx};
use futures::future::BoxFuture;
use scheduler::Payload;
use tokio::sync::Semaphore;

/// What dunning asks of whoever charges invoices (billing).
pub trait Collector: fmt::Debug + Send + Sync {
    /// Whether a payment provider is configured; without one nothing is
    /// charged and [`start_retries_in`](Self::start_retries_in) answers
    /// [`NotCharged::NoProvider`] for every request.
    fn has_provider(&self) -> bool;

    /// How long one provider call may take (zero without a provider).
    fn call_timeout(&self) -> Duration;

    /// The first half of a batch of retries, in the caller's transaction (so
    /// the caller's own compare-and-set commits with it): every invoice
    /// claimed, and its next attempt recorded. Per request, in order: the
    /// started retry, or why nothing will be charged for it.
    ///
    /// # Errors
    /// A database error: the caller's transaction is aborted, roll it back.
    fn start_retries_in<'a>(
        &'a self,
        tx: &'a mut Tx,
        wanted: &'a [RetryRequest],
    ) -> BoxFuture<'a, Result<Vec<Result<StartedRetry, NotCharged>>, Error>>;

    /// The second half: the calls (at most `concurrency` at once; none
    /// started after `deadline` or once `cancelled` says so, each such
    /// attempt left unknown with [`NOT_SENT`]), then every answer settled.
    /// Each call holds one of `calls`' permits: the caller's bound on calls at
    /// once, shared by its batches in flight (docs/adr/0054).
    /// Per started retry: what it came to, or its panic. A refused key is
    /// [`Error::ProviderKeyRejected`] for its row, and the batch's other
    /// calls are not made.
    fn finish_retries<'a>(
        &'a self,
        started: Vec<StartedRetry>,
        calls: &'a Semaphore,
        deadline: Instant,
        cancelled: &'a (dyn Fn() -> bool + Sync),
        step: &'a (dyn Fn(&StartedRetry) -> String + Sync),
    ) -> BoxFuture<'a, Vec<Finished>>;

    /// Cancel `subscription` now, inside the caller's transaction: the used
    /// part of the period invoiced pro rata (unless the tenant says not to)
    /// and `subscription.canceled` queued. `None` when it is no longer
    /// active.
    ///
    /// # Errors
    /// The period moved under the cancel, or a database error (the caller's
    /// transaction is aborted).
    fn cancel_now_in<'a>(
        &'a self,
        tx: &'a mut Tx,
        tenant_id: &'a str,
        subscription: i64,
    ) -> BoxFuture<'a, Result<Option<Canceled>, Error>>;
}

/// One started retry after [`Collector::finish_retries`]: what it came to,
/// or the panic of its call or settle.
pub type Finished = (StartedRetry, Result<Result<Retried, Error>, Payload>);

/// Why a collection call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The provider refused the secret key (401/403): no charge is attempted
    /// until it is fixed; the caller's tick should fail.
    #[error(
        "the payment provider refused BILLING_PROVIDER_SECRET_KEY (HTTP {status}): rolled or wrong; no charge is attempted until it is fixed"
    )]
    ProviderKeyRejected { status: u16 },
    /// Anything else (a database error, a refused event), as the collector
    /// words it.
    #[error("{0}")]
    Failed(Box<dyn std::error::Error + Send + Sync>),
}

/// An open automatic invoice this worker holds the auto-charge claim of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChargeClaim {
    pub invoice_id: i64,
    pub tenant_id: String,
    pub subscription_id: i64,
    /// Integer minor units.
    pub amount: i64,
    pub currency: String,
    pub email: String,
    /// `cus_…`
    pub provider_customer: String,
    /// `pm_…`
    pub payment_method: String,
    /// This claim's identity, written to `auto_charge_claimed_by`.
    pub claimed_by: String,
    /// `INV-000123`; `None` for invoices made before numbering.
    pub number: Option<String>,
    /// The tenant's sender (`tenant_settings.email_from`), when it names one.
    pub email_from: Option<String>,
}

impl ChargeClaim {
    /// A claimed invoice as the claims return it (auto-charge's, the
    /// reconciler's and dunning's retries select the same columns:
    /// `id, tenant_id, subscription_id, amount, currency, number, email,
    /// provider_customer_id, payment_method_id, tenant_from`), held by `claimed_by`.
    pub fn decode(r: &db::PgRow, claimed_by: String) -> Result<ChargeClaim, db::Error> {
        Ok(ChargeClaim {
            invoice_id: r.try_get("id")?,
            tenant_id: r.try_get("tenant_id")?,
            subscription_id: r.try_get("subscription_id")?,
            amount: r.try_get("amount")?,
            currency: r.try_get("currency")?,
            email: r.try_get("email")?,
            provider_customer: r.try_get("provider_customer_id")?,
            payment_method: r.try_get("payment_method_id")?,
            claimed_by,
            number: r.try_get("number")?,
            email_from: r.try_get("tenant_from")?,
        })
    }

    /// The invoice as people read it: its number, else its id.
    pub fn label(&self) -> String {
        self.number
            .clone()
            .unwrap_or_else(|| self.invoice_id.to_string())
    }
}

/// An attempt recorded for a claimed invoice, not yet answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Started {
    pub claim: ChargeClaim,
    pub attempt_id: i64,
    pub attempt_seq: i32,
    /// The attempt's Idempotency-Key, as stored.
    pub key: String,
    /// This is the attempt's first call (auto-charge or a dunning retry), not
    /// the reconciler's: a 401/403 or a call not made then proves that no
    /// request of this key executed, and the resend window restarts.
    pub first_send: bool,
}

/// Why an attempt was recorded but not sent.
pub const NOT_SENT: &str =
    "not sent: the tick ended before the call; the reconciler sends it by its key";

/// What one retry charge came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Retried {
    /// Charged: the invoice is paid and announced.
    Paid {
        attempt_seq: i32,
        payment_intent: String,
    },
    /// A definite decline, recorded with its code and announced.
    Declined { attempt_seq: i32, code: String },
    /// Accepted and not settled yet (`processing`: a bank debit can take days,
    /// https://docs.stripe.com/payments/paymentintents/lifecycle): recorded as
    /// such; billing's reconciler polls it and settles it as paid or declined.
    /// The attempt was made: it counts.
    Processing {
        attempt_seq: i32,
        payment_intent: String,
    },
    /// No answer to rely on (timeout, 5xx, a refusal billing cannot read as
    /// a charge or a decline, an answer whose claim was lost): the attempt is
    /// left unknown for the reconciler, which settles it by its key; or an
    /// answer that may have charged for an invoice closed meanwhile, whose
    /// attempt waits for an operator's review (docs/adr/0147).
    /// `unanswered`: no answer came at all (a timeout, a transport error, a
    /// 5xx) or the provider refused it for load (429), what an outage looks
    /// like; a refusal of the request, or an answer not relied on, is an
    /// answer (docs/adr/0092).
    Unknown {
        attempt_seq: i32,
        reason: String,
        unanswered: bool,
    },
    /// Nothing was charged.
    NotCharged(NotCharged),
}

/// Why a retry charged nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotCharged {
    /// The invoice is no longer open (`paid`, `void`, `uncollectible`).
    InvoiceClosed { status: String },
    /// The invoice is open but not chargeable now: another claim holds it, an
    /// attempt's outcome is still unknown, collection is paused, no saved card.
    Held,
    /// No provider is configured.
    NoProvider,
}

/// One invoice a caller (dunning) wants retried, under its own claim identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryRequest {
    pub invoice_id: i64,
    /// An identity no other claim shares.
    pub claimed_by: String,
}

/// A retry claimed and recorded by [`Collector::start_retries_in`], not yet called.
pub type StartedRetry = Started;

/// What a cancel wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Canceled {
    /// The invoice of the used part (a cancel now that invoiced one).
    pub invoice_id: Option<i64>,
}

/// How a decline is followed up (Stripe's decline-code table, "next steps":
/// https://docs.stripe.com/declines/codes). Billing words its first
/// attempt's email by it, dunning its warning after a retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeclineClass {
    /// Retry on the dunning schedule (`insufficient_funds`, `generic_decline`, …).
    Soft,
    /// Do not try the same card again: wait for a new payment method and ask
    /// the customer for one.
    Hard,
    /// The bank wants the customer present (3-D Secure): ask them to
    /// authenticate; no off-session retry of the same card.
    AuthenticationRequired,
}

/// The class of a decline code.
pub fn decline_class(code: &str) -> DeclineClass {
    if code == "authentication_required" {
        DeclineClass::AuthenticationRequired
    } else if HARD_DECLINES.contains(&code) {
        DeclineClass::Hard
    } else {
        DeclineClass::Soft
    }
}

/// Decline codes Stripe's table says not to report to the customer, but to
/// present as `generic_decline` (the rows of `fraudulent`, `lost_card`,
/// `merchant_blacklist`, `pickup_card` and `stolen_card`:
/// https://docs.stripe.com/declines/codes): telling the holder of a card
/// flagged as lost, stolen or fraudulent that it was flagged is what the
/// advice guards against. Tenants still see the code (events, attempts).
pub const HIDDEN_FROM_CUSTOMER: [&str; 5] = [
    "fraudulent",
    "lost_card",
    "merchant_blacklist",
    "pickup_card",
    "stolen_card",
];

/// A decline code as the customer's email shows it: `generic_decline` for
/// those of [`HIDDEN_FROM_CUSTOMER`], else the code (docs/adr/0141).
pub fn customer_facing(code: &str) -> &str {
    if HIDDEN_FROM_CUSTOMER.contains(&code) {
        "generic_decline"
    } else {
        code
    }
}

/// Decline codes whose next step in Stripe's table is "the customer should
/// use another card" or "do not try again", and the provider's
/// `resource_missing` (no usable payment method).
pub const HARD_DECLINES: [&str; 24] = [
    "card_not_supported",
    "currency_not_supported",
    "do_not_try_again",
    "expired_card",
    "fraudulent",
    "incorrect_cvc",
    "incorrect_number",
    "incorrect_zip",
    "invalid_account",
    "invalid_cvc",
    "invalid_expiry_month",
    "invalid_expiry_year",
    "invalid_number",
    "lost_card",
    "merchant_blacklist",
    "new_account_information_available",
    "pickup_card",
    "restricted_card",
    "revocation_of_all_authorizations",
    "revocation_of_authorization",
    "security_violation",
    "stolen_card",
    "stop_payment_order",
    "resource_missing",
];

#[cfg(test)]
mod tests {
    use super::*;

    /// The five codes are shown as `generic_decline`, every other code as
    /// it is, and each hidden one stays a hard decline.
    #[test]
    fn codes_stripe_says_to_hide_are_shown_as_a_generic_decline() {
        for code in HIDDEN_FROM_CUSTOMER {
            assert_eq!(customer_facing(code), "generic_decline");
            assert_eq!(decline_class(code), DeclineClass::Hard, "{code}");
        }
        for code in ["insufficient_funds", "expired_card", "generic_decline"] {
            assert_eq!(customer_facing(code), code);
        }
    }
}
