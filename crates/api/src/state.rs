//! [`Api`]: what every handler shares.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use db::Db;
use webhook_delivery::Keyring;

use crate::limit::Limiter;

/// The API's settings; [`ApiConfig::default`] holds the documented defaults.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Requests per second per API key (`HARDCOUNT_API_RATE_LIMIT`).
    pub rate_per_second: NonZeroU32,
    /// Requests a key may send at once above its rate (`HARDCOUNT_API_RATE_BURST`).
    pub rate_burst: NonZeroU32,
    /// Each request's whole time, body read included (503 `timeout` past it).
    pub request_timeout: Duration,
    /// Each transaction's statement timeout.
    pub statement_timeout: Duration,
    /// Requests served at once; the rest wait for a slot within the timeout.
    pub max_concurrent: usize,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            rate_per_second: NonZeroU32::new(1_000).expect("non-zero"),
            rate_burst: NonZeroU32::new(2_000).expect("non-zero"),
            request_timeout: Duration::from_secs(10),
            statement_timeout: Duration::from_secs(5),
            max_concurrent: 256,
        }
    }
}

/// The handlers' shared state. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Api {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    db: Db,
    keyring: Option<Keyring>,
    limiter: Limiter,
    config: ApiConfig,
}

impl Api {
    /// `db` is the API role's pool (`hardcount_api`); `keyring` seals the
    /// webhook secrets the API generates (without one, creating an endpoint
    /// answers 503).
    pub fn new(db: Db, keyring: Option<Keyring>, config: ApiConfig) -> Api {
        Api {
            inner: Arc::new(Inner {
                db,
                keyring,
                limiter: Limiter::new(config.rate_per_second, config.rate_burst),
                config,
            }),
        }
    }

    pub fn db(&self) -> &Db {
        &self.inner.db
    }

    pub fn keyring(&self) -> Option<&Keyring> {
        self.inner.keyring.as_ref()
    }

    pub fn config(&self) -> &ApiConfig {
        &self.inner.config
    }

    pub(crate) fn limiter(&self) -> &Limiter {
        &self.inner.limiter
    }
}
