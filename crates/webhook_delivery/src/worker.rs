//! The [`Worker`]: the role's one public handle, built from its settings
//! (refused by name when they cannot work) with its HTTP client, and what it
//! offers: a tick ([`Worker::run_tick`], `crate::tick`), a claim
//! ([`Worker::claim_due`]) and one attempt outside a tick
//! ([`Worker::deliver`]). Its clones share one [`Shared`]; every step below is
//! a free function over it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use db::Db;
use leader::{Fence, Telemetry, Tick};
use scheduler::Wake;
use tokio_util::sync::CancellationToken;

use crate::attempt::{self, Attempted, StartBy};
use crate::breaker::Breakers;
use crate::config::WorkerConfig;
use crate::delivery::{Claimed, Outcome};
use crate::disabling;
use crate::error::Error;
use crate::fairness::Limits;
use crate::outcomes::{self, Step};
use crate::shared::Shared;
use crate::ssrf;
use crate::tick::{self, TickReport};
use crate::unwritten::Unwritten;

/// Sends webhook deliveries. Cheap to clone; clones share the HTTP client and
/// the concurrency limits.
#[derive(Clone)]
pub struct Worker {
    shared: Arc<Shared>,
    wake: Option<Wake>,
    idle_probe: Option<Duration>,
}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

/// The `hardcount_webhook_deliveries_total` outcomes that
/// deploy/prometheus/rules.yml reads, exported at 0 by [`Worker::new`].
pub const OUTCOMES_ALERTED: [&str; 4] = ["delivered", "retry", "dead", "refused"];

impl Worker {
    /// A worker with its HTTP client: the SSRF-guarded builder from
    /// [`ssrf::client_builder`], no redirects, no proxy, the configured
    /// connect timeout.
    ///
    /// # Errors
    /// [`Error::Config`] for settings that cannot work, [`Error::Client`] if the
    /// HTTP client cannot be built (no TLS roots, for instance).
    pub fn new(db: Db, config: WorkerConfig, telemetry: Telemetry) -> Result<Worker, Error> {
        config.validate()?;
        let client = ssrf::client_builder(config.allowlist.clone())
            .connect_timeout(config.connect_timeout)
            .user_agent(concat!("hardcount-webhooks/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Error::Client(e.to_string()))?;
        // At 0 from the start, the series the alert takes increase() of: a
        // series born at its first outcome had that outcome unseen
        // (docs/adr/0141).
        for outcome in OUTCOMES_ALERTED {
            telemetry
                .counter(
                    "hardcount_webhook_deliveries_total",
                    &[("outcome", outcome)],
                )
                .increment(0);
        }
        Ok(Worker {
            shared: Arc::new(Shared {
                db,
                limits: Limits::new(&config),
                breakers: Breakers::new(
                    config.breaker_timeouts,
                    config.breaker_cooloff,
                    config.request_timeout,
                ),
                disabling: scheduler::Every::new(disabling::CHECK_EVERY),
                pruning: config.retention.map(scheduler::Pruning::new),
                backlog_reads: scheduler::Every::new(config.backlog_read_every),
                cursor: db::TenantCursor::default(),
                unwritten: Unwritten::default(),
                config,
                client,
                telemetry,
            }),
            wake: None,
            idle_probe: None,
        })
    }

    /// Listen for wake-ups (docs/adr/0014): while `wake` is listening, a tick
    /// that drained stays open and claims again when the outbox's fan-out
    /// commits (or at `wake`'s poll interval) until its budget. While it does
    /// not, a poke still ends a probe's or a busy tick's pause: the fan-out's
    /// hand-over in this process (docs/adr/0070).
    #[must_use]
    pub fn with_wake(mut self, wake: Wake) -> Worker {
        self.wake = Some(wake);
        self
    }

    /// Probe while idle (docs/adr/0019): a tick that drained stays open until
    /// its budget and asks every `every` (`scheduler::IDLE_PROBE` in
    /// `hardcount serve`) whether a delivery is due, one index read, and
    /// claims when one is; the next tick follows at once. A fanned-out
    /// delivery then waits about `every` without a listener, not the
    /// interval. With a listening wake, the wake decides instead.
    #[must_use]
    pub fn with_idle_probe(mut self, every: Duration) -> Worker {
        self.idle_probe = Some(every);
        self
    }

    pub fn config(&self) -> &WorkerConfig {
        &self.shared.config
    }

    /// One tick of the role: claim batches of due deliveries and attempt each,
    /// until nothing is due, the budget is spent, or `tick.cancel` fires; then
    /// refresh the backlog gauges.
    ///
    /// Each delivery runs under the panic guard: one that panics is recorded as
    /// a failed attempt (so a poison delivery dies after its last attempt
    /// instead of panicking every tick), the others go on, and the first panic
    /// is raised again at the end so the lease is released as panicked.
    ///
    /// # Panics
    /// When a delivery panicked, after the rest of the tick.
    ///
    /// # Cancel safety
    /// On `tick.cancel`, attempts not yet started are handed back and no batch
    /// is claimed; attempts in flight go on. Under `Manager::lead` the tick is
    /// dropped if it has not returned within the cancel grace (1 s): attempts
    /// still in flight then stop, and their deliveries come due again when
    /// their claim lease ends (at-least-once: the receiver may have seen them).
    pub async fn run_tick(&self, tick: &Tick) -> TickReport {
        tick::run_tick(&self.shared, self.wake.as_ref(), self.idle_probe, tick).await
    }

    /// The fenced funnel: claim up to `limit` due pending deliveries for one
    /// attempt each (see the crate docs). Empty when nothing is due or `fence`
    /// is stale.
    ///
    /// # Errors
    /// A database error; nothing was claimed.
    pub async fn claim_due(&self, fence: &Fence, limit: usize) -> Result<Vec<Claimed>, Error> {
        tick::claim_due(&self.shared, fence, limit).await
    }

    /// Turn off now the enabled endpoints whose every attempt has failed for
    /// longer than `disable_after`, telling their tenants (the look each
    /// tick's end makes at most once a minute; docs/adr/0041). How many were
    /// turned off; none when `fence` is stale.
    ///
    /// # Errors
    /// A database error, or a notice that could not be queued: nothing was
    /// turned off.
    pub async fn disable_failing_endpoints(&self, fence: &Fence) -> Result<usize, Error> {
        disabling::disable_failing(&self.shared, fence).await
    }

    /// Make the attempt `claimed` stands for and write its outcome, outside a
    /// tick (the tick does the same for each delivery it claims, writing the
    /// outcomes in groups). The attempt is handed back unsent if it cannot
    /// start within the claim margin (`Released`), or held back for a while
    /// (`Held`: its endpoint's breaker is open, its secret cannot be opened,
    /// its share stalled). Either hand-back of a claim that a later claim
    /// superseded meanwhile writes nothing and is `Stale`.
    pub async fn deliver(&self, claimed: Claimed) -> Outcome {
        let shared = &self.shared;
        let start_by = StartBy {
            deadline: claimed.claimed_at + shared.config.claim_margin,
            cancel: CancellationToken::new(),
            busy: CancellationToken::new(),
        };
        match attempt::attempt(shared, claimed, None, &start_by).await {
            Attempted::Step(Step::Done(outcome)) => {
                outcomes::count(shared, &outcome);
                outcome
            }
            Attempted::Step(Step::Write(finished)) => {
                outcomes::write_outcomes(shared, vec![finished])
                    .await
                    .pop()
                    .map_or(Outcome::Unrecorded, |(_, outcome)| outcome)
            }
            Attempted::Hold {
                id,
                attempt,
                wait,
                why,
            } => match outcomes::hold(shared, &[(id, attempt, wait, why)]).await {
                Some(h) if h.held == 1 => Outcome::Held,
                // A later claim has the delivery: nothing was handed back.
                Some(_) => Outcome::Stale,
                None => Outcome::Released,
            },
        }
    }
}
