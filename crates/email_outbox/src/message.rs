//! The MIME message a queued email becomes. No SQL and no I/O.

use lettre::Message;
use lettre::message::header::ContentType;
use lettre::message::{MultiPart, SinglePart};
use outbox::email::{Email, Invalid, mailbox};

/// What a queued row holds, as the claim returns it.
#[derive(Clone, PartialEq, Eq)]
pub struct Queued {
    pub id: i64,
    pub tenant_id: String,
    /// The claim this send proves in its outcome write.
    pub attempt: i32,
    /// `attempt` when the email was last resent (0 if never): the retry
    /// schedule counts from there, as the claim's ceiling does.
    pub resent_at_attempt: i32,
    pub message_id: String,
    pub email: Email,
}

impl std::fmt::Debug for Queued {
    // Recipients and bodies are customers' data: keep them out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queued")
            .field("id", &self.id)
            .field("tenant_id", &self.tenant_id)
            .field("attempt", &self.attempt)
            .field("message_id", &self.message_id)
            .finish_non_exhaustive()
    }
}

/// The MIME message for a queued email: the same `Message-ID` on every attempt.
///
/// # Errors
/// A row that no longer passes the enqueue checks (edited by hand): the
/// message says which field.
pub fn message(q: &Queued) -> Result<Message, Invalid> {
    q.email.validate()?;
    let mut builder = Message::builder()
        .from(mailbox("from", &q.email.from)?)
        .subject(q.email.subject.clone())
        .message_id(Some(q.message_id.clone()));
    for to in &q.email.to {
        builder = builder.to(mailbox("to", to)?);
    }
    let built = match &q.email.html {
        Some(html) => builder.multipart(MultiPart::alternative_plain_html(
            q.email.text.clone(),
            html.clone(),
        )),
        None => builder.singlepart(
            SinglePart::builder()
                .header(ContentType::TEXT_PLAIN)
                .body(q.email.text.clone()),
        ),
    };
    built.map_err(|e| Invalid::Address {
        field: "to",
        value: String::new(),
        problem: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use outbox::email::new_message_id;

    use super::*;

    fn email() -> Email {
        Email {
            from: "Billing <billing@example.com>".into(),
            to: vec!["ada@example.org".into()],
            subject: "Your receipt".into(),
            text: "Paid: 12.00 EUR".into(),
            html: Some("<p>Paid: 12.00 EUR</p>".into()),
        }
    }

    #[test]
    fn a_message_carries_its_fixed_message_id_and_both_parts() {
        let q = Queued {
            id: 1,
            tenant_id: "t".into(),
            attempt: 1,
            resent_at_attempt: 0,
            message_id: new_message_id("Billing <billing@example.com>"),
            email: email(),
        };
        assert!(q.message_id.ends_with("@example.com>"), "{}", q.message_id);
        let raw = String::from_utf8(message(&q).unwrap().formatted()).unwrap();
        assert!(
            raw.contains(&format!("Message-ID: {}", q.message_id)),
            "{raw}"
        );
        assert!(raw.contains("multipart/alternative"), "{raw}");
        assert!(
            raw.contains("Paid: 12.00 EUR") && raw.contains("<p>Paid"),
            "{raw}"
        );
        assert!(
            !format!("{q:?}").contains("ada@"),
            "recipients stay out of Debug"
        );
    }
}
