//! The worker's error.

use crate::config::ConfigError;

/// Errors of the delivery worker: a setting refused at construction, the
/// HTTP client, or its store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot build the webhook HTTP client: {0}")]
    Client(String),
    #[error("webhook delivery store: {0}")]
    Db(#[from] db::Error),
    /// The notice of an endpoint turned off could not be queued; nothing
    /// was turned off.
    #[error("cannot queue the notice of a turned-off webhook endpoint: {0}")]
    Notice(String),
}
