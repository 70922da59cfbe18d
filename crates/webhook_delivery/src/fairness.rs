//! Fair shares of the requests in flight (issue 12, point 6; docs/adr/0018).
//!
//! An attempt sends only with four permits, taken in this order, each held
//! until the attempt ends:
//!
//! ```text
//!  endpoint (max_in_flight_per_endpoint)      its own endpoint's queue
//!  tenant (max_in_flight_per_tenant)          all of the tenant's endpoints
//!  destination (max_in_flight_per_destination) the resolved address and port,
//!                                             whatever names and tenants lead there
//!  global (max_in_flight)                     the worker
//! ```
//!
//! Waiting for a permit holds only the ones before it (the order is fixed, so
//! no two attempts wait on each other in a cycle), and never a global one: a
//! tenant whose endpoints hang holds at most its share of the global slots,
//! and the rest stay free for other tenants. With `max_in_flight` at least
//! twice `max_in_flight_per_tenant`, one tenant's tarpit leaves another tenant
//! every slot its own share allows.
//!
//! The destination is looked up with the SSRF guard's resolver
//! ([`GuardedResolver`]), which refuses the same addresses the HTTP client's
//! does; the first permitted address, with the URL's port, is the key. The
//! client resolves again when it opens a connection: a name that changes
//! between the two lookups is counted at the address seen first (the tenant
//! share still bounds it). An address that cannot be looked up takes no
//! destination permit; the request then fails in the client the same way.
//! A name's address is remembered for [`LOOKUP_TTL`], so a busy endpoint
//! costs one lookup per TTL here, not one per delivery.
//!
//! A wait lasts while its share makes progress: when none of the share's
//! permits has changed hands for [`STALL`], or for twice the time its permits
//! are typically held if that is longer (its holders all hang, say at a
//! tarpit), the waiting attempt gives up ([`Stalled`]) and is held back in the
//! table for a while, instead of sitting claimed behind requests that will
//! time out. A share whose requests answer changes hands often enough, so its
//! queue waits its turn, however slow its receiver is.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use url::{Host, Url};

use crate::config::WorkerConfig;
use crate::ssrf::GuardedResolver;

/// How long a looked-up destination address is used for its name.
pub(crate) const LOOKUP_TTL: Duration = Duration::from_secs(10);

/// A share none of whose permits changed hands for this long is stalled: an
/// attempt waiting on it gives up.
pub(crate) const STALL: Duration = Duration::from_millis(250);

/// A wait given up: the share had been quiet this long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stalled(pub Duration);

/// The permits of one attempt's turn; dropping it frees them.
pub(crate) struct Turn {
    _permits: Vec<Held>,
}

/// One limit's permits, when one last changed hands, and how long a permit
/// is typically held.
#[derive(Debug)]
struct Share {
    permits: Arc<Semaphore>,
    moved: Mutex<Moved>,
}

#[derive(Debug, Clone, Copy)]
struct Moved {
    at: Instant,
    /// A moving average of how long permits were held; zero before any
    /// was given back.
    typical: Duration,
}

impl Share {
    fn new(size: usize) -> Arc<Share> {
        Arc::new(Share {
            permits: Arc::new(Semaphore::new(size)),
            moved: Mutex::new(Moved {
                at: Instant::now(),
                typical: Duration::ZERO,
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Moved> {
        self.moved.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A permit held for `held` was given back (`None`: one was taken).
    fn stamp(&self, held: Option<Duration>) {
        let mut m = self.lock();
        m.at = Instant::now();
        if let Some(held) = held {
            m.typical = if m.typical.is_zero() {
                held
            } else {
                m.typical * 7 / 8 + held / 8
            };
        }
    }

    /// Since a permit was last taken or given back, and how quiet this
    /// share may be before it counts as stalled: [`STALL`], or twice the
    /// time its permits are typically held if longer (a receiver that
    /// answers slowly is not a tarpit).
    fn quiet(&self) -> (Duration, Duration) {
        let m = *self.lock();
        (m.at.elapsed(), STALL.max(m.typical * 2))
    }

    /// Wait for a permit while the share makes progress; give up when none
    /// changed hands for longer than the share's stall window. Cancel safe.
    async fn acquire(self: Arc<Share>) -> Result<Held, Stalled> {
        loop {
            match tokio::time::timeout(STALL, self.permits.clone().acquire_owned()).await {
                Ok(Ok(permit)) => {
                    self.stamp(None);
                    return Ok(Held {
                        _permit: permit,
                        share: self,
                        taken: Instant::now(),
                    });
                }
                // Closed: never, these semaphores are not closed.
                Ok(Err(_)) => return Err(Stalled(Duration::ZERO)),
                Err(_) => {
                    let (quiet, window) = self.quiet();
                    if quiet >= window {
                        return Err(Stalled(quiet));
                    }
                }
            }
        }
    }
}

/// A permit of a share; giving it back stamps the share.
struct Held {
    _permit: OwnedSemaphorePermit,
    share: Arc<Share>,
    taken: Instant,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.share.stamp(Some(self.taken.elapsed()));
    }
}

/// One share of `size` permits per key, made on first use.
#[derive(Debug)]
struct Keyed<K> {
    size: usize,
    map: Mutex<HashMap<K, Arc<Share>>>,
}

impl<K: Eq + Hash> Keyed<K> {
    fn new(size: usize) -> Keyed<K> {
        Keyed {
            size,
            map: Mutex::new(HashMap::new()),
        }
    }

    fn get(&self, key: K) -> Arc<Share> {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(key)
            .or_insert_with(|| Share::new(self.size))
            .clone()
    }

    /// Forget the semaphores no attempt holds or waits on.
    fn prune(&self) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|_, s| Arc::strong_count(s) > 1);
    }
}

/// The worker's concurrency limits, shared by its clones.
#[derive(Debug)]
pub(crate) struct Limits {
    global: Arc<Share>,
    endpoint: Keyed<i64>,
    tenant: Keyed<String>,
    destination: Keyed<SocketAddr>,
    resolver: GuardedResolver,
    lookup_timeout: Duration,
    /// Host name -> the address it led to, and when it was looked up.
    looked_up: Mutex<HashMap<String, (IpAddr, Instant)>>,
}

impl Limits {
    pub fn new(config: &WorkerConfig) -> Limits {
        Limits {
            global: Share::new(config.max_in_flight),
            endpoint: Keyed::new(config.max_in_flight_per_endpoint),
            tenant: Keyed::new(config.max_in_flight_per_tenant),
            destination: Keyed::new(config.max_in_flight_per_destination),
            resolver: GuardedResolver::new(config.allowlist.clone()),
            lookup_timeout: config.connect_timeout,
            looked_up: Mutex::new(HashMap::new()),
        }
    }

    /// Wait for all four permits, in order, each while its share makes
    /// progress. Cancel safe: a dropped wait holds nothing.
    ///
    /// # Errors
    /// [`Stalled`] when a share's permits did not change hands for [`STALL`].
    pub async fn turn(&self, endpoint: i64, tenant: &str, url: &str) -> Result<Turn, Stalled> {
        let mut permits = Vec::with_capacity(4);
        let (endpoint, tenant) = (self.endpoint.get(endpoint), self.tenant.get(tenant.into()));
        permits.push(endpoint.acquire().await?);
        permits.push(tenant.acquire().await?);
        if let Some(addr) = self.destination(url).await {
            let destination = self.destination.get(addr);
            permits.push(destination.acquire().await?);
        }
        permits.push(self.global.clone().acquire().await?);
        Ok(Turn { _permits: permits })
    }

    /// Where a request to `url` connects: the first address the guarded
    /// resolver permits (or the literal), with the URL's port.
    async fn destination(&self, url: &str) -> Option<SocketAddr> {
        let url = Url::parse(url).ok()?;
        let port = url.port_or_known_default()?;
        let ip = match url.host()? {
            Host::Ipv4(v4) => IpAddr::V4(v4),
            Host::Ipv6(v6) => IpAddr::V6(v6),
            Host::Domain(name) => {
                let remembered = self.lookups().get(name).copied();
                match remembered {
                    Some((ip, at)) if at.elapsed() < LOOKUP_TTL => ip,
                    _ => {
                        let lookup = self.resolver.resolve_host(name);
                        let addrs = tokio::time::timeout(self.lookup_timeout, lookup)
                            .await
                            .ok()?
                            .ok()?;
                        let ip = addrs.first()?.ip();
                        self.lookups().insert(name.to_owned(), (ip, Instant::now()));
                        ip
                    }
                }
            }
        };
        Some(SocketAddr::new(ip, port))
    }

    fn lookups(&self) -> std::sync::MutexGuard<'_, HashMap<String, (IpAddr, Instant)>> {
        self.looked_up.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forget the per-key semaphores nothing holds, and expired lookups.
    pub fn prune(&self) {
        self.endpoint.prune();
        self.tenant.prune();
        self.destination.prune();
        self.lookups()
            .retain(|_, (_, at)| at.elapsed() < LOOKUP_TTL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ssrf::Allowlist;

    fn limits() -> Limits {
        Limits::new(&WorkerConfig {
            max_in_flight: 4,
            max_in_flight_per_endpoint: 2,
            max_in_flight_per_tenant: 2,
            max_in_flight_per_destination: 2,
            allowlist: Allowlist::parse("127.0.0.0/8").unwrap(),
            ..WorkerConfig::default()
        })
    }

    /// Whether a turn comes within a moment.
    async fn gets_turn(l: &Limits, endpoint: i64, tenant: &str, url: &str) -> Option<Turn> {
        tokio::time::timeout(Duration::from_millis(50), l.turn(endpoint, tenant, url))
            .await
            .ok()
            .and_then(Result::ok)
    }

    /// Each limit, alone binding: a third attempt waits while two hold the
    /// share, and others go on. Fails if a level's acquire is removed from
    /// `Limits::turn` (the third attempt then gets its turn).
    #[tokio::test]
    async fn each_share_binds_its_own_key_only() {
        let l = limits();
        let a = "http://127.0.0.1:9001/";
        // Per endpoint: same endpoint, different tenants and destinations.
        let e1 = gets_turn(&l, 1, "t1", a).await.unwrap();
        let e2 = gets_turn(&l, 1, "t2", "http://127.0.0.2:9001/")
            .await
            .unwrap();
        assert!(
            gets_turn(&l, 1, "t3", "http://127.0.0.3:9001/")
                .await
                .is_none()
        );
        drop((e1, e2));
        // Per tenant: different endpoints and destinations.
        let t1 = gets_turn(&l, 1, "t", "http://127.0.0.1:9001/")
            .await
            .unwrap();
        let t2 = gets_turn(&l, 2, "t", "http://127.0.0.2:9001/")
            .await
            .unwrap();
        assert!(
            gets_turn(&l, 3, "t", "http://127.0.0.3:9001/")
                .await
                .is_none()
        );
        assert!(
            gets_turn(&l, 3, "u", "http://127.0.0.3:9001/")
                .await
                .is_some()
        );
        drop((t1, t2));
        // Per destination: a name and a literal that reach the same address
        // and port count together; another port is another destination.
        let d1 = gets_turn(&l, 1, "t1", "http://127.0.0.1:9001/")
            .await
            .unwrap();
        let d2 = gets_turn(&l, 2, "t2", "http://localhost:9001/")
            .await
            .unwrap();
        assert!(
            gets_turn(&l, 3, "t3", "http://127.0.0.1:9001/")
                .await
                .is_none()
        );
        let other_port = gets_turn(&l, 3, "t3", "http://127.0.0.1:9002/")
            .await
            .unwrap();
        // Global: four in all.
        let g = gets_turn(&l, 4, "t4", "http://127.0.0.4:9001/")
            .await
            .unwrap();
        assert!(
            gets_turn(&l, 5, "t5", "http://127.0.0.5:9001/")
                .await
                .is_none()
        );
        drop((d1, d2, other_port, g));
        l.prune();
        assert!(l.tenant.map.lock().unwrap().is_empty());
    }

    /// A wait goes on while the share's permits change hands, even past
    /// `STALL` in all, and gives up once none has for `STALL`, saying how long.
    /// Fails if `Share::acquire` gives up at the first `STALL` (the last
    /// waiters then stall) or never gives up.
    #[tokio::test]
    async fn a_wait_lasts_while_its_share_moves_and_gives_up_when_it_stalls() {
        let l = Arc::new(limits());
        let url = "http://127.0.0.1:9001/";
        // Endpoint 1's share of 2, passed along every STALL / 2 by 8 attempts.
        let started = Instant::now();
        let waiters: Vec<_> = (0..8)
            .map(|_| {
                let l = l.clone();
                tokio::spawn(async move {
                    let turn = l.turn(1, "t", url).await;
                    tokio::time::sleep(STALL / 2).await;
                    turn.is_ok()
                })
            })
            .collect();
        for w in waiters {
            assert!(w.await.unwrap(), "a waiter gave up while the share moved");
        }
        assert!(started.elapsed() >= STALL * 2, "{:?}", started.elapsed());
        // Stalled: both permits held, nothing moves.
        let (_a, _b) = (
            l.turn(1, "t", url).await.unwrap(),
            l.turn(1, "t", url).await.unwrap(),
        );
        let waited = Instant::now();
        let Err(Stalled(quiet)) = l.turn(1, "t", url).await else {
            panic!("a stalled share gave a turn");
        };
        assert!(quiet >= STALL && waited.elapsed() < STALL * 3, "{quiet:?}");
    }

    /// A share whose permits are typically held long (a slow receiver) may
    /// be quiet for twice that before a waiter gives up.
    #[tokio::test]
    async fn a_slow_share_is_not_taken_for_a_stalled_one() {
        let share = Share::new(1);
        let held = share.clone().acquire().await.unwrap();
        tokio::time::sleep(STALL * 2).await;
        drop(held); // typical: 2 x STALL
        let _held = share.clone().acquire().await.unwrap();
        let waited = Instant::now();
        let Err(Stalled(quiet)) = share.clone().acquire().await else {
            panic!("a stalled share gave a permit");
        };
        assert!(quiet >= STALL * 4, "gave up after {quiet:?}");
        assert!(waited.elapsed() < STALL * 6, "{:?}", waited.elapsed());
    }
}
