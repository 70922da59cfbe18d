//! The customer's emails of a run: the warning after a declined (or not
//! attempted) retry, and the final notice of a final action that changed
//! something. Pure; queued by the transition that sends them.

use chrono::{DateTime, Utc};

use crate::policy::{FinalAction, PauseBehavior};
use crate::run::{NotChargeable, Run};

/// The invoice as the customer knows it: its number, or its id before numbers.
fn invoice(run: &Run) -> String {
    run.invoice_number
        .clone()
        .unwrap_or_else(|| run.invoice_id.to_string())
}

/// The line that links the tenant's payment page, if it set one
/// (docs/adr/0150).
fn page_line(run: &Run) -> String {
    payments::payment_page_line(run.payment_page_url.as_deref(), run.invoice_id)
}

/// The tenant's sender when it has one, else the configured one.
pub(crate) fn sender<'a>(run: &'a Run, configured: &'a str) -> &'a str {
    run.email_from.as_deref().unwrap_or(configured)
}

/// After a declined retry the policy warns about: what the decline asks of
/// the customer (its class, as billing's email of a first decline words it)
/// and when the next retry is. The only email of a declined retry: billing
/// sends none for a retry (docs/adr/0114).
pub(crate) fn warning(
    run: &Run,
    from: &str,
    code: &str,
    next: DateTime<Utc>,
) -> outbox::email::Email {
    use payments::{DeclineClass, decline_class};
    let invoice = invoice(run);
    let at = next.format("%Y-%m-%d %H:%M UTC");
    let ask = match decline_class(code) {
        DeclineClass::Soft => {
            format!("We will try again on {at}; you can also update your payment method now.")
        }
        DeclineClass::Hard => format!(
            "We will not try this card again: please add a new payment method before {at}, \
             when we will charge it."
        ),
        // Only the customer can authenticate a payment; without a page to
        // do it on, the email names no step it cannot link.
        DeclineClass::AuthenticationRequired if run.payment_page_url.is_some() => format!(
            "Your bank asks you to authenticate this card, which only you can do: add it \
             again on the page below, authenticating it there, or add another payment \
             method before {at}, when we will try again."
        ),
        DeclineClass::AuthenticationRequired => format!(
            "Your bank asks you to authenticate this payment, which only you can do, so we \
             will not charge this card for it again: please add another payment method \
             before {at}, when we will try again."
        ),
    };
    // The subject ends as every warning's does ("we will retry"); a hard
    // decline's says that a new payment method comes first.
    let subject = match decline_class(code) {
        DeclineClass::Soft => format!("Payment for invoice {invoice} failed: we will retry"),
        DeclineClass::Hard | DeclineClass::AuthenticationRequired => {
            format!("Payment for invoice {invoice} failed: add a payment method and we will retry")
        }
    };
    outbox::email::Email {
        from: from.to_owned(),
        to: vec![run.email.clone()],
        subject,
        text: format!(
            "We could not charge your saved card for invoice {invoice} ({}). {ask}\n{}",
            payments::customer_facing(code),
            page_line(run),
        ),
        html: None,
    }
}

/// After a due retry that was not attempted, when the policy warns after it:
/// why nothing was charged, and when the next retry is.
pub(crate) fn not_attempted(
    run: &Run,
    from: &str,
    why: NotChargeable,
    next: DateTime<Utc>,
) -> outbox::email::Email {
    let invoice = invoice(run);
    let reason = match why {
        NotChargeable::NoPaymentMethod => "there is no payment method on your account",
        NotChargeable::PaymentMethodUnchanged => {
            "your card was declined in a way that trying it again will not change"
        }
        // Never warned of (docs/adr/0073, 0085): a spent run is exhausted, a
        // pending one waits without a count, a decline owed its notices gets
        // the decline's warning.
        NotChargeable::RetriesSpent
        | NotChargeable::OutcomePending
        | NotChargeable::DeclineUnannounced => "your last payment has not been settled yet",
    };
    outbox::email::Email {
        from: from.to_owned(),
        to: vec![run.email.clone()],
        subject: format!("Payment for invoice {invoice} needs a new payment method: we will retry"),
        text: format!(
            "We did not try to charge invoice {invoice}: {reason}. \
             Please add a payment method; we will try again on {}.\n{}",
            next.format("%Y-%m-%d %H:%M UTC"),
            page_line(run),
        ),
        html: None,
    }
}

/// The final notice: what the final action did. Queued by the final action's
/// transaction only when the action changed something.
pub(crate) fn final_notice(run: &Run, from: &str) -> outbox::email::Email {
    let invoice = invoice(run);
    let done = match run.policy.final_action {
        FinalAction::CancelSubscription => {
            format!("Your subscription has been canceled. Invoice {invoice} remains unpaid.")
        }
        FinalAction::PauseCollection => {
            let later = match run.policy.pause_behavior {
                PauseBehavior::KeepAsDraft => "kept as drafts",
                PauseBehavior::MarkUncollectible => "marked uncollectible",
                PauseBehavior::Void => "voided",
            };
            format!(
                "Collection of payments for your subscription is paused: we will not charge \
                 you, and invoices made while it is paused are {later}. Invoice {invoice} \
                 remains unpaid."
            )
        }
        FinalAction::MarkUncollectible => format!(
            "We have stopped trying to collect invoice {invoice} and marked it uncollectible: \
             we will not charge you for it again."
        ),
    };
    outbox::email::Email {
        from: from.to_owned(),
        to: vec![run.email.clone()],
        subject: format!("Final notice for invoice {invoice}"),
        text: format!("We could not collect payment for invoice {invoice}. {done}\n"),
        html: None,
    }
}

/// `email` as the outbox will take it: a tenant's sender that does not parse
/// is replaced by `configured`. Refused (the outbox's own check) when it still
/// would be: the caller sends the transition without it, since a refused
/// email would roll back, and so repeat, a retry the provider already answered.
pub(crate) fn sendable(
    mut email: outbox::email::Email,
    configured: &str,
) -> Result<outbox::email::Email, outbox::email::Invalid> {
    if let Err(outbox::email::Invalid::Address { field: "from", .. }) = email.validate() {
        email.from = configured.to_owned();
    }
    email.validate()?;
    Ok(email)
}
