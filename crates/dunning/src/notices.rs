//! The customer's emails of a run: the warning after a declined retry and the
//! final notice at exhaustion. Pure; queued by the transition that sends them.

use chrono::{DateTime, Utc};

use crate::store::Run;

/// After a declined retry the policy warns about: when the next one is.
pub(crate) fn warning(
    run: &Run,
    from: &str,
    code: &str,
    next: DateTime<Utc>,
) -> email_outbox::Email {
    email_outbox::Email {
        from: from.to_owned(),
        to: vec![run.email.clone()],
        subject: format!(
            "Payment for invoice {} failed: we will retry",
            run.invoice_id
        ),
        text: format!(
            "We could not charge your saved card for invoice {} ({code}). \
             We will try again on {}. Please update your payment method.\n",
            run.invoice_id,
            next.format("%Y-%m-%d %H:%M UTC")
        ),
        html: None,
    }
}

/// At exhaustion, when the policy sends one: what the final action does.
pub(crate) fn final_notice(run: &Run, from: &str) -> email_outbox::Email {
    email_outbox::Email {
        from: from.to_owned(),
        to: vec![run.email.clone()],
        subject: format!("Final notice for invoice {}", run.invoice_id),
        text: format!(
            "We could not collect invoice {} after {} retries. \
             Your subscription's billing has been stopped ({}).\n",
            run.invoice_id,
            run.policy.offsets_secs.len(),
            run.policy.final_action.as_str().replace('_', " ")
        ),
        html: None,
    }
}
