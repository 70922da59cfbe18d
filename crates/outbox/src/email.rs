//! Emails as producers queue them: the email, its checks, and its
//! `Message-ID`; queued inside the producer's transaction ([`enqueue`],
//! [`enqueue_many`], [`enqueue_many_or_record`]).

use lettre::message::Mailbox;

mod enqueue;
mod store;

pub use enqueue::{
    EnqueueError, Enqueued, enqueue, enqueue_many, enqueue_many_or_record, enqueue_or_record,
};
pub use store::reply_text;

/// The largest text or HTML body accepted, each: 256 KiB. Receipts and dunning
/// notices are a few KiB; anything near this is a rendering bug, and refusing it
/// at enqueue keeps one row from holding a sender's memory or a batch's time.
pub const MAX_BODY_BYTES: usize = 256 * 1024;

/// The most recipients on one email. Billing mail goes to a customer's billing
/// contacts, a handful at most.
pub const MAX_RECIPIENTS: usize = 50;

/// The longest subject accepted, in characters.
pub const MAX_SUBJECT_CHARS: usize = 998;

/// An email to queue. Bodies are rendered before they are queued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Email {
    /// `billing@example.com` or `Example Billing <billing@example.com>`.
    pub from: String,
    /// One or more mailboxes, in the same forms as `from`.
    pub to: Vec<String>,
    pub subject: String,
    pub text: String,
    /// An HTML alternative to `text`, sent as `multipart/alternative`.
    pub html: Option<String>,
}

/// Why an email was refused at enqueue. Nothing was written. Each names the
/// field; none echoes a body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    #[error("email has an empty tenant_id")]
    EmptyTenant,
    #[error("email field `{field}` is not a mailbox ({value:?}): {problem}")]
    Address {
        field: &'static str,
        value: String,
        problem: String,
    },
    #[error("email field `to` is empty: at least one recipient is needed")]
    NoRecipients,
    #[error("email field `to` has {count} recipients; at most {MAX_RECIPIENTS} are allowed")]
    TooManyRecipients { count: usize },
    #[error("email field `{field}` contains a CR or LF, which would inject a header")]
    HeaderInjection { field: &'static str },
    #[error("email field `subject` is empty")]
    EmptySubject,
    #[error(
        "email field `subject` has {chars} characters; at most {MAX_SUBJECT_CHARS} are allowed"
    )]
    SubjectTooLong { chars: usize },
    #[error("email field `{field}` is {bytes} bytes; at most {MAX_BODY_BYTES} are allowed")]
    BodyTooLarge { field: &'static str, bytes: usize },
    #[error("email field `{field}` contains a NUL character, which Postgres text cannot store")]
    Nul { field: &'static str },
}

impl Invalid {
    /// The refusal's short name: the `refused` column of a recorded refusal and
    /// the `reason` label of `hardcount_email_refused_total`. Few and fixed,
    /// so a label never carries an address.
    pub fn reason(&self) -> &'static str {
        match self {
            Invalid::EmptyTenant => "tenant",
            Invalid::Address { field: "from", .. } => "sender",
            Invalid::Address { .. } => "recipient",
            Invalid::NoRecipients | Invalid::TooManyRecipients { .. } => "recipients",
            Invalid::HeaderInjection { .. } => "header",
            Invalid::EmptySubject | Invalid::SubjectTooLong { .. } => "subject",
            Invalid::BodyTooLarge { .. } => "too_large",
            Invalid::Nul { .. } => "nul",
        }
    }
}

/// Check a sender (`billing@example.com` or `Example Billing
/// <billing@example.com>`) as [`Email::validate`] checks `from`: what
/// `HARDCOUNT_EMAIL_FROM` must pass at boot.
///
/// # Errors
/// [`Invalid`] naming the field `from`.
pub fn check_sender(from: &str) -> Result<(), Invalid> {
    mailbox("from", from).map(drop)
}

/// The longest sender, recipient or subject a recorded refusal keeps, in
/// characters (an SMTP header line's limit).
const MAX_RECORDED_CHARS: usize = 998;

impl Email {
    /// What a refused email is recorded as: its sender, at most
    /// [`MAX_RECIPIENTS`] recipients and its subject, each cut to
    /// [`MAX_RECORDED_CHARS`] characters with any NUL (which Postgres text
    /// cannot hold) replaced by U+FFFD; no bodies. Storable whatever the email
    /// held, so recording a refusal cannot fail for its content.
    pub(crate) fn refusal_record(&self) -> Email {
        let keep = |s: &str| -> String {
            s.chars()
                .take(MAX_RECORDED_CHARS)
                .map(|c| {
                    if c == '\0' {
                        char::REPLACEMENT_CHARACTER
                    } else {
                        c
                    }
                })
                .collect()
        };
        Email {
            from: keep(&self.from),
            to: self
                .to
                .iter()
                .take(MAX_RECIPIENTS)
                .map(|t| keep(t))
                .collect(),
            subject: keep(&self.subject),
            text: String::new(),
            html: None,
        }
    }

    /// Check every field; the first problem found is returned.
    ///
    /// # Errors
    /// [`Invalid`], naming the field.
    pub fn validate(&self) -> Result<(), Invalid> {
        mailbox("from", &self.from)?;
        if self.to.is_empty() {
            return Err(Invalid::NoRecipients);
        }
        if self.to.len() > MAX_RECIPIENTS {
            return Err(Invalid::TooManyRecipients {
                count: self.to.len(),
            });
        }
        for to in &self.to {
            mailbox("to", to)?;
        }
        header_value("subject", &self.subject)?;
        if self.subject.trim().is_empty() {
            return Err(Invalid::EmptySubject);
        }
        let chars = self.subject.chars().count();
        if chars > MAX_SUBJECT_CHARS {
            return Err(Invalid::SubjectTooLong { chars });
        }
        body("text", &self.text)?;
        if let Some(html) = &self.html {
            body("html", html)?;
        }
        Ok(())
    }
}

fn header_value(field: &'static str, value: &str) -> Result<(), Invalid> {
    if value.contains(['\r', '\n']) {
        return Err(Invalid::HeaderInjection { field });
    }
    if value.contains('\0') {
        return Err(Invalid::Nul { field });
    }
    Ok(())
}

/// `value` parsed as a mailbox (`a@example.com` or `Name <a@example.com>`), as
/// lettre will parse it when the email is sent.
///
/// # Errors
/// [`Invalid`] naming `field`: a CR, LF or NUL, or not a mailbox.
pub fn mailbox(field: &'static str, value: &str) -> Result<Mailbox, Invalid> {
    header_value(field, value)?;
    value.parse::<Mailbox>().map_err(|e| Invalid::Address {
        field,
        value: value.to_owned(),
        problem: e.to_string(),
    })
}

fn body(field: &'static str, value: &str) -> Result<(), Invalid> {
    if value.len() > MAX_BODY_BYTES {
        return Err(Invalid::BodyTooLarge {
            field,
            bytes: value.len(),
        });
    }
    if value.contains('\0') {
        return Err(Invalid::Nul { field });
    }
    Ok(())
}

/// A `Message-ID` for a new email: random (it reveals no volume), with the
/// sender's domain on the right as RFC 5322 suggests.
pub fn new_message_id(from: &str) -> String {
    let domain = from
        .parse::<Mailbox>()
        .map(|m| m.email.domain().to_owned())
        .unwrap_or_else(|_| "hardcount.invalid".to_owned());
    format!("<{:032x}@{domain}>", rand::random::<u128>())
}

#[cfg(test)]
mod tests {
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
    fn each_refused_field_is_named() {
        type Mutate = fn(&mut Email);
        let cases: Vec<(Mutate, &str)> = vec![
            (|e| e.from = "not an address".into(), "`from`"),
            (|e| e.to = vec!["ada@".into()], "`to`"),
            (|e| e.to.clear(), "`to` is empty"),
            (|e| e.to = vec!["x@example.org".into(); 51], "51 recipients"),
            (
                |e| e.subject = "Receipt\r\nBcc: all@example.org".into(),
                "`subject` contains a CR or LF",
            ),
            (
                |e| e.from = "billing@example.com\nBcc: x@example.org".into(),
                "`from` contains a CR or LF",
            ),
            (|e| e.subject = "  ".into(), "`subject` is empty"),
            (
                |e| e.text = "x".repeat(MAX_BODY_BYTES + 1),
                "`text` is 262145 bytes",
            ),
            (
                |e| e.html = Some("x".repeat(MAX_BODY_BYTES + 1)),
                "`html` is 262145 bytes",
            ),
            (|e| e.text = "a\0b".into(), "`text` contains a NUL"),
        ];
        for (mutate, expected) in cases {
            let mut e = email();
            mutate(&mut e);
            let err = e.validate().unwrap_err().to_string();
            assert!(err.contains(expected), "{expected:?} not in {err:?}");
        }
        assert_eq!(email().validate(), Ok(()));
    }
}
