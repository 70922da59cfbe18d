//! [`Api`]: what every handler shares.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use billing::{Biller, BillingConfig};
use db::Db;
use leader::Telemetry;
use webhook_delivery::Keyring;
use webhook_delivery::ssrf::{Allowlist, Ports};

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
    /// Requests served at once; the rest wait for a slot, and the request
    /// timeout starts once they have one (docs/adr/0120).
    pub max_concurrent: usize,
    /// What billing's producers write with (the receipts' sender, the
    /// statement timeout of their own transactions); the provider is unused:
    /// the API charges nothing.
    pub billing: BillingConfig,
    /// The delivery role's SSRF guard (`HARDCOUNT_WEBHOOK_ALLOWLIST`, the
    /// ports): an endpoint URL it refuses on its face (an IP literal, a
    /// port) is refused when it is registered (docs/adr/0102).
    pub webhook_allowlist: Allowlist,
    pub webhook_ports: Ports,
    /// The most dead deliveries one recover puts back to pending; the
    /// answer says whether more may remain (docs/adr/0102).
    pub recover_batch: usize,
    /// Whether a plan may bill every minute or hour
    /// (`HARDCOUNT_API_SHORT_PLANS`; `hardcount dev` sets it): demo units,
    /// refused otherwise, since a plan made with one by mistake would charge
    /// each customer up to tens of thousands of times a month (docs/adr/0152).
    pub short_plans: bool,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            rate_per_second: NonZeroU32::new(1_000).expect("non-zero"),
            rate_burst: NonZeroU32::new(2_000).expect("non-zero"),
            request_timeout: Duration::from_secs(10),
            statement_timeout: Duration::from_secs(5),
            max_concurrent: 256,
            billing: BillingConfig::default(),
            webhook_allowlist: Allowlist::default(),
            webhook_ports: Ports::default(),
            recover_batch: 10_000,
            short_plans: false,
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
    biller: Biller,
    config: ApiConfig,
}

impl Api {
    /// `db` is the API role's pool (`hardcount_api`); `keyring` seals the
    /// webhook secrets the API generates (without one, creating an endpoint
    /// answers 503).
    ///
    /// # Panics
    /// When `config.billing` is out of range (billing's own validation).
    pub fn new(db: Db, keyring: Option<Keyring>, config: ApiConfig) -> Api {
        Api::with_telemetry(db, keyring, config, Telemetry::noop())
    }

    /// [`Api::new`], billing's producers counting on `telemetry`.
    ///
    /// # Panics
    /// As [`Api::new`].
    pub fn with_telemetry(
        db: Db,
        keyring: Option<Keyring>,
        config: ApiConfig,
        telemetry: Telemetry,
    ) -> Api {
        let billing = BillingConfig {
            provider: None,
            ..config.billing.clone()
        };
        let biller = Biller::new(db.clone(), billing, telemetry)
            .expect("the API's billing settings are in range");
        Api {
            inner: Arc::new(Inner {
                biller,
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

    /// Billing's producers (plan changes, cancels, pauses), on the API's pool.
    pub fn biller(&self) -> &Biller {
        &self.inner.biller
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
