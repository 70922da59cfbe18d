//! A per-key rate limit (GCRA, `governor`), checked before a request takes a
//! database connection. Keyed by the SHA-256 of the whole key as presented
//! (docs/adr/0076): a key nobody holds is refused 401 by the database a
//! moment later, and spends only its own bucket, never the bucket of the real
//! key whose visible prefix it copies. The table of keys seen is trimmed to
//! the recently active ones when it grows.

use std::num::NonZeroU32;

use governor::clock::{Clock as _, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

use crate::error::ApiError;

/// Past this many keys tracked, the idle ones are dropped.
const TRIM_ABOVE: usize = 100_000;

pub struct Limiter {
    inner: DefaultKeyedRateLimiter<[u8; 32]>,
    clock: DefaultClock,
}

impl Limiter {
    pub fn new(per_second: NonZeroU32, burst: NonZeroU32) -> Limiter {
        Limiter {
            inner: RateLimiter::keyed(Quota::per_second(per_second).allow_burst(burst)),
            clock: DefaultClock::default(),
        }
    }

    /// # Errors
    /// 429 with the seconds until the next request would pass.
    pub fn check(&self, key_hash: &[u8; 32]) -> Result<(), ApiError> {
        if self.inner.len() > TRIM_ABOVE {
            self.inner.retain_recent();
        }
        self.inner.check_key(key_hash).map_err(|not_until| {
            let wait = not_until.wait_time_from(self.clock.now());
            ApiError::rate_limited(wait.as_secs_f64().ceil() as u64)
        })
    }
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("keys", &self.inner.len())
            .finish()
    }
}
