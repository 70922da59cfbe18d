//! The crate's errors: why an email was not enqueued, and the sender's.

use crate::config::ConfigError;
use crate::email::Invalid;
use crate::smtp::SmtpUrlError;

/// Why [`crate::enqueue`] refused an email.
#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    /// Bad input, naming the field. Nothing was sent to the database; the
    /// caller's transaction is still usable.
    #[error(transparent)]
    Invalid(#[from] Invalid),
    /// The insert failed, which aborts the caller's transaction: roll it back.
    #[error("could not enqueue the email: {0}")]
    Db(#[from] db::Error),
}

/// Errors of the sender.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Smtp(#[from] SmtpUrlError),
    #[error("email outbox store: {0}")]
    Db(#[from] db::Error),
    /// A send got no SMTP reply at all; the rest of the batch was handed back.
    #[error("the SMTP server is unreachable; unsent emails were handed back")]
    Unreachable,
}
