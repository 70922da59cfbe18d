//! LISTEN on a session connection, for wake-ups (docs/adr/0014).
//!
//! LISTEN needs a session: a server connection that stays ours between
//! statements. The app pool may be PgBouncer in transaction mode, which has
//! none, so a listener takes its own URL (Postgres directly, or a
//! session-mode pooler). `pg_notify` itself needs no session and is sent
//! through the app pool inside the producer's transaction.

use std::time::Duration;

use sqlx::postgres::{PgListener, PgPoolOptions};

use crate::connect::{connect_error, connect_options};
use crate::{Error, Result};

/// The `application_name` of a listener's connection, as `pg_stat_activity`
/// shows it.
pub const LISTEN_APPLICATION_NAME: &str = "hardcount-listen";

/// One session connection that LISTENs on a fixed set of channels.
pub struct Listener {
    inner: PgListener,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print options: they hold the password.
        f.debug_struct("Listener").finish_non_exhaustive()
    }
}

impl Listener {
    /// Connect to `url` and LISTEN on every channel of `channels`.
    ///
    /// # Errors
    /// [`Error::BadUrl`] (the URL redacted), [`Error::Tls`] or the
    /// connection's error.
    pub async fn connect(url: &str, channels: &[&str]) -> Result<Listener> {
        let options = connect_options(url)?
            .statement_cache_capacity(0)
            .extra_float_digits(None)
            .application_name(LISTEN_APPLICATION_NAME);
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(5))
            .max_lifetime(None)
            .idle_timeout(None)
            .connect_with(options)
            .await
            .map_err(|e| connect_error(e, url))?;
        let mut inner = PgListener::connect_with(&pool).await?;
        // The caller notices a lost connection and reconnects (marking its
        // roles as not listening meanwhile); sqlx must not do it silently.
        inner.eager_reconnect(false);
        inner.ignore_pool_close_event(true);
        inner.listen_all(channels.iter().copied()).await?;
        Ok(Listener { inner })
    }

    /// The channel of the next notification.
    ///
    /// # Errors
    /// When the connection is lost (notifications may have been missed
    /// meanwhile): drop this listener and connect a new one.
    ///
    /// # Cancel safety
    /// Cancel safe: a notification not yet returned stays buffered.
    pub async fn recv(&mut self) -> Result<String> {
        match self.inner.try_recv().await? {
            Some(n) => Ok(n.channel().to_owned()),
            None => Err(Error::Sql(sqlx::Error::Protocol(
                "the LISTEN connection was lost".to_owned(),
            ))),
        }
    }
}
