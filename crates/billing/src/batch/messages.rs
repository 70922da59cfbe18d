//! What a settled charge announces: the events' data and the emails.

use crate::batch::ChargeClaim;
use crate::money::money;

/// `invoice.paid`'s data.
pub(crate) fn paid_payload(c: &ChargeClaim, payment_intent: &str) -> String {
    serde_json::json!({
        "object": "invoice",
        "id": c.invoice_id,
        "subscription": c.subscription_id,
        "status": "paid",
        "amount_paid": c.amount,
        "currency": c.currency,
        "payment_intent": payment_intent,
    })
    .to_string()
}

/// The receipt of a paid charge.
pub(crate) fn receipt(c: &ChargeClaim, from: &str) -> outbox::email::Email {
    outbox::email::Email {
        from: c.email_from.clone().unwrap_or_else(|| from.to_owned()),
        to: vec![c.email.clone()],
        subject: format!("Receipt for invoice {}", c.label()),
        text: format!(
            "We received your payment of {} for invoice {}. Thank you.\n",
            money(c.amount, &c.currency),
            c.label()
        ),
        html: None,
    }
}

/// The payment-failed email of a declined charge, asking for what the
/// decline calls for (its class, `provider::decline_class`), with a link to
/// the tenant's payment page when it set one (`page`, docs/adr/0150).
pub(crate) fn failed_email(
    c: &ChargeClaim,
    code: &str,
    from: &str,
    page: Option<&str>,
) -> outbox::email::Email {
    use crate::provider::{DeclineClass, decline_class};
    let amount = money(c.amount, &c.currency);
    let ask = match (decline_class(code), page) {
        (DeclineClass::Soft, _) => "We will try again in a few days; you can also update your \
                                    payment method now."
            .to_owned(),
        (DeclineClass::Hard, _) => "We will not try this card again: please add a new payment \
                                    method, and we will charge it."
            .to_owned(),
        // Only the customer can authenticate (Stripe's
        // `authentication_required`: retry with the cardholder present), and
        // this card is not charged off session again: a card added again on
        // the page, authenticated there, is a new payment method, charged.
        (DeclineClass::AuthenticationRequired, Some(_)) => "Your bank asks you to authenticate \
                                                            this card, which only you can do: \
                                                            add it again on the page below, \
                                                            authenticating it there, or add \
                                                            another payment method, and we will \
                                                            charge it."
            .to_owned(),
        (DeclineClass::AuthenticationRequired, None) => "Your bank asks you to authenticate \
                                                         this payment, which only you can do, \
                                                         so we will not charge this card for it \
                                                         again: please add another payment \
                                                         method, and we will charge it."
            .to_owned(),
    };
    outbox::email::Email {
        from: c.email_from.clone().unwrap_or_else(|| from.to_owned()),
        to: vec![c.email.clone()],
        subject: format!("Your payment for invoice {} failed", c.label()),
        text: format!(
            "We could not charge {amount} for invoice {} to your saved card ({}). {ask}\n{}",
            c.label(),
            payments::customer_facing(code),
            payments::payment_page_line(page, c.invoice_id),
        ),
        html: None,
    }
}

pub(crate) fn payment_payload(
    claim: &ChargeClaim,
    attempt_seq: i32,
    payment_intent: Option<&str>,
    decline_code: Option<&str>,
) -> String {
    serde_json::json!({
        "object": "payment",
        "invoice": claim.invoice_id,
        "attempt": attempt_seq,
        "amount": claim.amount,
        "currency": claim.currency,
        "payment_intent": payment_intent,
        "decline_code": decline_code,
    })
    .to_string()
}
