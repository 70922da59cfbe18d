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
}
