//! The sender's errors.

use crate::config::ConfigError;
use crate::smtp::SmtpUrlError;

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
