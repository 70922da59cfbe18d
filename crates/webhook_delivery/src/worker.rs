//! The `webhook_delivery` tick: claim due deliveries, POST them concurrently
//! under limits, write the outcomes in groups, each row by compare-and-set.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use db::Db;
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use leader::{Fence, Telemetry, Tick};
use scheduler::{Panics, Payload, catch, panic_message};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use url::Url;

use crate::Error;
use crate::backoff::RetrySchedule;
use crate::send::{self, Answer, Limits, Request};
use crate::signature::Secret;
use crate::ssrf::{self, Allowlist};
use crate::store::{self, ClaimedRow, NextState, Observed, OutcomeRow};

const ROLE: &str = "webhook_delivery";

/// How deliveries are sent. `Default` is the production setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerConfig {
    /// Deliveries claimed per batch. Default 32.
    pub batch_size: usize,
    /// Requests in flight at once, across endpoints. Default 32.
    pub max_in_flight: usize,
    /// Requests in flight at once to one endpoint. Default 4.
    pub max_in_flight_per_endpoint: usize,
    /// TCP (and TLS) connect limit. Default 5 s.
    pub connect_timeout: Duration,
    /// One attempt, from connecting to the last byte read. Default 15 s.
    pub request_timeout: Duration,
    /// A claim holds a delivery for `request_timeout + claim_margin` (default
    /// 15 s, so 30 s): if this process dies mid-attempt, the delivery is due
    /// again after that. A claim not started within the margin is handed back.
    pub claim_margin: Duration,
    /// No attempt starts that could end after this much of the tick. Default 60 s.
    pub tick_budget: Duration,
    /// Bytes of a response read at most; the rest is not read. Default 64 KiB.
    pub max_response_bytes: usize,
    /// Delays between attempts; its length + 1 is the number of attempts.
    pub retry_schedule: RetrySchedule,
    /// Private ranges re-opened for delivery (default none).
    pub allowlist: Allowlist,
    /// The server cancels a store statement after this. Default 5 s.
    pub statement_timeout: Duration,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            batch_size: 32,
            max_in_flight: 32,
            max_in_flight_per_endpoint: 4,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(15),
            claim_margin: Duration::from_secs(15),
            tick_budget: Duration::from_secs(60),
            max_response_bytes: 64 * 1024,
            retry_schedule: RetrySchedule::default(),
            allowlist: Allowlist::default(),
            statement_timeout: Duration::from_secs(5),
        }
    }
}

/// A [`WorkerConfig`] that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("webhook delivery setting {0} must be greater than zero")]
    Zero(&'static str),
    #[error(
        "webhook delivery tick budget ({budget:?}) must be longer than the request timeout ({timeout:?})"
    )]
    BudgetTooShort { budget: Duration, timeout: Duration },
    #[error(
        "webhook delivery connect timeout ({connect:?}) must not exceed the request timeout ({timeout:?})"
    )]
    ConnectTooLong {
        connect: Duration,
        timeout: Duration,
    },
}

impl WorkerConfig {
    /// Checks the settings against each other.
    ///
    /// # Errors
    /// The first [`ConfigError`] found.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let counts = [
            ("batch_size", self.batch_size),
            ("max_in_flight", self.max_in_flight),
            (
                "max_in_flight_per_endpoint",
                self.max_in_flight_per_endpoint,
            ),
            ("max_response_bytes", self.max_response_bytes),
        ];
        let durations = [
            ("connect_timeout", self.connect_timeout),
            ("request_timeout", self.request_timeout),
            ("claim_margin", self.claim_margin),
            ("tick_budget", self.tick_budget),
            ("statement_timeout", self.statement_timeout),
        ];
        if let Some((name, _)) = counts.iter().find(|(_, n)| *n == 0) {
            return Err(ConfigError::Zero(name));
        }
        if let Some((name, _)) = durations.iter().find(|(_, d)| d.is_zero()) {
            return Err(ConfigError::Zero(name));
        }
        if self.tick_budget <= self.request_timeout {
            return Err(ConfigError::BudgetTooShort {
                budget: self.tick_budget,
                timeout: self.request_timeout,
            });
        }
        if self.connect_timeout > self.request_timeout {
            return Err(ConfigError::ConnectTooLong {
                connect: self.connect_timeout,
                timeout: self.request_timeout,
            });
        }
        Ok(())
    }

    /// How long a claim holds a delivery: `request_timeout + claim_margin`.
    pub fn claim_lease(&self) -> Duration {
        self.request_timeout + self.claim_margin
    }
}

/// A delivery claimed for one attempt. Its `Debug` shows no secret or URL.
pub struct Claimed {
    row: ClaimedRow,
    /// Taken before the claim was sent: the lease ends no earlier than this + lease.
    claimed_at: Instant,
}

impl Claimed {
    pub fn id(&self) -> i64 {
        self.row.id
    }
    pub fn tenant_id(&self) -> &str {
        &self.row.tenant_id
    }
    pub fn event_id(&self) -> i64 {
        self.row.event_id
    }
    pub fn endpoint_id(&self) -> i64 {
        self.row.endpoint_id
    }
    /// This attempt's number (1 for the first); its outcome must prove it.
    pub fn attempt(&self) -> u32 {
        u32::try_from(self.row.attempt).unwrap_or(0)
    }
    /// The `webhook-id` sent with every attempt of this event.
    pub fn message_id(&self) -> &str {
        &self.row.message_id
    }
    pub fn event_type(&self) -> &str {
        &self.row.event_type
    }

    /// The request body: a Standard Webhooks envelope around the payload,
    /// `{"type":…,"timestamp":…,"data":…}`, the same bytes on every attempt.
    pub fn body(&self) -> Vec<u8> {
        let event_type = serde_json::Value::String(self.row.event_type.clone());
        let timestamp = serde_json::Value::String(self.row.event_time.clone());
        format!(
            "{{\"type\":{event_type},\"timestamp\":{timestamp},\"data\":{}}}",
            self.row.payload
        )
        .into_bytes()
    }
}

impl fmt::Debug for Claimed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Claimed")
            .field("id", &self.row.id)
            .field("tenant_id", &self.row.tenant_id)
            .field("event_id", &self.row.event_id)
            .field("endpoint_id", &self.row.endpoint_id)
            .field("attempt", &self.row.attempt)
            .finish_non_exhaustive()
    }
}

/// What became of one claimed delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A 2xx answer; recorded.
    Delivered,
    /// Failed; recorded and scheduled again.
    Retry,
    /// Failed for the last time, answered 410, or its endpoint is disabled; recorded.
    Dead,
    /// The SSRF guard refused the target (no connection made); recorded and
    /// scheduled again like any failure (dead after the last attempt).
    Refused,
    /// A later claim superseded this attempt: its result was not written.
    Stale,
    /// Never sent (out of time, or cancelled): handed back, attempt not counted.
    Released,
    /// Sent, but the outcome could not be written; the claim's lease brings
    /// the delivery back (the receiver may see it again).
    Unrecorded,
}

impl Outcome {
    /// The `outcome` label on `hardcount_webhook_deliveries_total`, if counted there.
    pub fn label(&self) -> Option<&'static str> {
        Some(match self {
            Outcome::Delivered => "delivered",
            Outcome::Retry => "retry",
            Outcome::Dead => "dead",
            Outcome::Refused => "refused",
            Outcome::Stale => "stale",
            Outcome::Released | Outcome::Unrecorded => return None,
        })
    }
}

/// Why a tick stopped.
#[derive(Debug)]
pub enum TickEnd {
    /// A batch came back short: nothing else was due.
    Drained,
    /// Too little budget was left for another attempt.
    BudgetSpent,
    /// The lease was lost or the process is shutting down.
    Cancelled,
    /// The claim failed (logged); nothing was claimed.
    Failed(Error),
}

impl TickEnd {
    /// How the lease manager should release this tick (docs/adr/0007).
    pub fn for_release(&self) -> leader::TickEnd {
        match self {
            TickEnd::BudgetSpent => leader::TickEnd::MoreWork,
            TickEnd::Failed(e) => leader::TickEnd::Failed(e.to_string()),
            // A cancelled tick is released as lost or interrupted, whatever it says.
            _ => leader::TickEnd::Drained,
        }
    }
}

/// What one tick did, per outcome.
#[derive(Debug)]
pub struct TickReport {
    pub batches: usize,
    pub claimed: usize,
    pub delivered: usize,
    pub retried: usize,
    pub dead: usize,
    pub refused: usize,
    pub stale: usize,
    pub released: usize,
    pub unrecorded: usize,
    /// Deliveries whose processing panicked (recorded as failed attempts).
    pub panicked: usize,
    pub elapsed: Duration,
    pub end: TickEnd,
}

impl TickReport {
    fn new() -> TickReport {
        TickReport {
            batches: 0,
            claimed: 0,
            delivered: 0,
            retried: 0,
            dead: 0,
            refused: 0,
            stale: 0,
            released: 0,
            unrecorded: 0,
            panicked: 0,
            elapsed: Duration::ZERO,
            end: TickEnd::Drained,
        }
    }

    fn add(&mut self, outcome: &Outcome) {
        let slot = match outcome {
            Outcome::Delivered => &mut self.delivered,
            Outcome::Retry => &mut self.retried,
            Outcome::Dead => &mut self.dead,
            Outcome::Refused => &mut self.refused,
            Outcome::Stale => &mut self.stale,
            Outcome::Released => &mut self.released,
            Outcome::Unrecorded => &mut self.unrecorded,
        };
        *slot += 1;
    }
}

/// Sends webhook deliveries. Cheap to clone; clones share the HTTP client and
/// the concurrency limits.
#[derive(Clone)]
pub struct Worker {
    inner: Arc<Inner>,
}

struct Inner {
    db: Db,
    config: WorkerConfig,
    client: reqwest::Client,
    telemetry: Telemetry,
    in_flight: Arc<Semaphore>,
    per_endpoint: Mutex<HashMap<i64, Arc<Semaphore>>>,
}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// When an attempt must have started, and what stops it from starting.
struct StartBy {
    deadline: Instant,
    cancel: CancellationToken,
}

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
        Ok(Worker {
            inner: Arc::new(Inner {
                db,
                in_flight: Arc::new(Semaphore::new(config.max_in_flight)),
                config,
                client,
                telemetry,
                per_endpoint: Mutex::new(HashMap::new()),
            }),
        })
    }

    pub fn config(&self) -> &WorkerConfig {
        &self.inner.config
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
        let config = &self.inner.config;
        let started = Instant::now();
        let tick_deadline = started + config.tick_budget;
        let mut panics = Panics::new(ROLE);
        let mut report = TickReport::new();
        report.end = loop {
            if tick.cancel.is_cancelled() {
                break TickEnd::Cancelled;
            }
            if Instant::now() + config.request_timeout > tick_deadline {
                break TickEnd::BudgetSpent;
            }
            let claimed = match self.claim_due(&tick.fence, config.batch_size).await {
                Ok(claimed) => claimed,
                Err(e) => {
                    warn!(role = ROLE, error = %e, "claiming due webhook deliveries failed");
                    break TickEnd::Failed(e);
                }
            };
            if claimed.is_empty() {
                break TickEnd::Drained;
            }
            report.batches += 1;
            report.claimed += claimed.len();
            let full = claimed.len() >= config.batch_size;
            self.attempt_batch(
                claimed,
                tick_deadline,
                &tick.cancel,
                &mut panics,
                &mut report,
            )
            .await;
            if tick.cancel.is_cancelled() {
                break TickEnd::Cancelled;
            }
            if !full {
                break TickEnd::Drained;
            }
        };
        if !tick.cancel.is_cancelled() {
            self.refresh_gauges().await;
        }
        self.prune_endpoint_limits();
        report.elapsed = started.elapsed();
        if report.claimed > 0 {
            info!(
                role = ROLE, claimed = report.claimed, delivered = report.delivered,
                retried = report.retried, dead = report.dead, refused = report.refused,
                stale = report.stale, released = report.released, panicked = report.panicked,
                elapsed = ?report.elapsed, end = ?report.end, "webhook deliveries attempted"
            );
        } else {
            debug!(role = ROLE, end = ?report.end, "no webhook deliveries due");
        }
        panics.finish();
        report
    }

    /// The fenced funnel: claim up to `limit` due pending deliveries for one
    /// attempt each (see the crate docs). Empty when nothing is due or `fence`
    /// is stale.
    ///
    /// # Errors
    /// A database error; nothing was claimed.
    pub async fn claim_due(&self, fence: &Fence, limit: usize) -> Result<Vec<Claimed>, Error> {
        let config = &self.inner.config;
        let claimed_at = Instant::now();
        let rows = store::claim_due(
            &self.inner.db,
            fence,
            limit,
            config.claim_lease(),
            config.statement_timeout,
        )
        .await?;
        Ok(rows
            .into_iter()
            .map(|row| Claimed { row, claimed_at })
            .collect())
    }

    /// Make the attempt `claimed` stands for and write its outcome, outside a
    /// tick (the tick does the same for each delivery it claims, writing the
    /// outcomes in groups). The attempt is handed back unsent if it cannot
    /// start within the claim margin.
    pub async fn deliver(&self, claimed: Claimed) -> Outcome {
        let start_by = StartBy {
            deadline: claimed.claimed_at + self.inner.config.claim_margin,
            cancel: CancellationToken::new(),
        };
        match self.attempt(claimed, &start_by).await {
            Step::Done(outcome) => {
                self.count(&outcome);
                outcome
            }
            Step::Write(finished) => self
                .write_outcomes(vec![finished])
                .await
                .pop()
                .map_or(Outcome::Unrecorded, |(_, outcome)| outcome),
        }
    }

    /// Attempt a claimed batch concurrently and write the outcomes in groups.
    ///
    /// Finished attempts are buffered and written with one statement per group
    /// ([`store::record_outcomes`], each row still its own compare-and-set), in
    /// a task of its own while the other attempts go on. A group is written
    /// when it holds [`OUTCOME_GROUP`] outcomes, when its first outcome has
    /// waited [`OUTCOME_LINGER`], or when no attempt of the batch is left,
    /// whichever comes first; this returns once every group is written. If
    /// this future is dropped (the tick is cancelled and then abandoned), the
    /// groups already handed to their tasks are still written, and so is
    /// whatever is left in the buffer ([`OutcomeBuffer`]'s `Drop` hands it to
    /// a task of its own). A buffered outcome that cannot be written (the
    /// statement fails, or the runtime is gone) is not lost silently: it is
    /// logged, and its delivery, still `pending` at this attempt, comes due
    /// again when its claim lease ends (at-least-once: the receiver may see it
    /// again, with the same `webhook-id`).
    async fn attempt_batch(
        &self,
        claimed: Vec<Claimed>,
        tick_deadline: Instant,
        cancel: &CancellationToken,
        panics: &mut Panics,
        report: &mut TickReport,
    ) {
        let config = &self.inner.config;
        let items = claimed
            .into_iter()
            .map(|d| {
                // Start only what can finish before both the tick and the claim end.
                let latest_end = tick_deadline.min(d.claimed_at + config.claim_lease());
                let start_by = StartBy {
                    deadline: latest_end
                        .checked_sub(config.request_timeout)
                        .unwrap_or(d.claimed_at),
                    cancel: cancel.clone(),
                };
                let key = (d.row.id, d.row.attempt);
                (key, format!("{ROLE}/delivery {}", d.row.id), (d, start_by))
            })
            .collect();
        let mut running = guarded(items, |(d, start_by)| async move {
            self.attempt(d, &start_by).await
        });
        let mut buffer = OutcomeBuffer {
            worker: self.clone(),
            rows: Vec::new(),
            flush_at: None,
        };
        let mut writes = FuturesUnordered::new();
        loop {
            let lingered = buffer
                .flush_at
                .is_some_and(|at| at <= tokio::time::Instant::now());
            if buffer.rows.len() >= OUTCOME_GROUP
                || (!buffer.rows.is_empty() && (running.is_empty() || lingered))
            {
                writes.push(buffer.flush());
            }
            if running.is_empty() && writes.is_empty() {
                break;
            }
            let flush_at = buffer.flush_at;
            tokio::select! {
                Some(((id, attempt), result)) = running.next(), if !running.is_empty() => {
                    match result {
                        Ok(Step::Done(outcome)) => {
                            self.count(&outcome);
                            report.add(&outcome);
                        }
                        Ok(Step::Write(finished)) => buffer.push(finished),
                        Err(payload) => {
                            // Count the panic as a failed attempt, so a delivery that
                            // panics every time dies after its last attempt.
                            report.panicked += 1;
                            let observed = Observed {
                                error: Some(format!(
                                    "processing panicked: {}",
                                    panic_message(&*payload)
                                )),
                                ..Observed::default()
                            };
                            panics.record(payload);
                            let next = self.next_after_failure(attempt, None);
                            buffer.push(Finished {
                                row: OutcomeRow { id, attempt, next, observed },
                                refused: false,
                            });
                        }
                    }
                }
                Some((n, written)) = writes.next(), if !writes.is_empty() => match written {
                    Ok(outcomes) => {
                        for (_, outcome) in &outcomes {
                            report.add(outcome);
                        }
                    }
                    Err(e) => {
                        warn!(
                            role = ROLE, outcomes = n, error = %e,
                            "a webhook outcome write did not finish; its deliveries come due again when their claim leases end"
                        );
                        report.unrecorded += n;
                    }
                },
                () = sleep_until_some(flush_at) => {}
            }
        }
    }

    /// One delivery: wait for its turn and send. The outcome is left to write
    /// ([`Step::Write`]) unless it was handed back or was a 410 (written at
    /// once, with the endpoint disabled in the same transaction).
    async fn attempt(&self, d: Claimed, start_by: &StartBy) -> Step {
        let (id, attempt) = (d.row.id, d.row.attempt);
        let finished = |next: NextState, observed: Observed| {
            Step::Write(Finished {
                row: OutcomeRow {
                    id,
                    attempt,
                    next,
                    observed,
                },
                refused: false,
            })
        };
        if !d.row.enabled {
            let reason = d
                .row
                .disabled_reason
                .as_deref()
                .unwrap_or("no reason given");
            let observed = Observed {
                error: Some(format!("endpoint disabled: {reason}")),
                ..Observed::default()
            };
            return finished(NextState::Dead, observed);
        }
        let Some(_permits) = self.wait_turn(d.row.endpoint_id, start_by).await else {
            return Step::Done(self.release(id, attempt).await);
        };
        let observed_started = Instant::now();
        let prepared = Url::parse(&d.row.url)
            .map_err(|e| format!("endpoint URL does not parse: {e}"))
            .and_then(|url| {
                Secret::parse(&d.row.secret)
                    .map(|secret| (url, secret))
                    .map_err(|e| format!("endpoint secret is unusable: {e}"))
            });
        let (url, secret) = match prepared {
            Ok(p) => p,
            Err(error) => {
                let observed = Observed {
                    error: Some(error),
                    ..Observed::default()
                };
                return finished(self.next_after_failure(attempt, None), observed);
            }
        };
        let config = &self.inner.config;
        let sent = send::post(
            &self.inner.client,
            Request {
                url: &url,
                message_id: &d.row.message_id,
                secret: &secret,
                body: d.body(),
            },
            &Limits {
                allowlist: &config.allowlist,
                timeout: config.request_timeout,
                max_response_bytes: config.max_response_bytes,
            },
        )
        .await;
        self.inner
            .telemetry
            .histogram("hardcount_webhook_attempt_duration_seconds", &[])
            .record(observed_started.elapsed().as_secs_f64());
        let host = url.host_str().unwrap_or("");
        let latency = Some(sent.latency);
        match sent.answer {
            Answer::Status { code, .. } if (200..300).contains(&code) => {
                let observed = Observed {
                    status_code: Some(code),
                    latency,
                    ..Observed::default()
                };
                finished(NextState::Delivered, observed)
            }
            Answer::Status {
                code: 410, body, ..
            } => {
                let observed = Observed {
                    status_code: Some(410),
                    error: Some(status_error(410, &body)),
                    latency,
                };
                let reason = format!("receiver answered 410 Gone to delivery {id}");
                warn!(
                    role = ROLE,
                    delivery = id,
                    endpoint = d.row.endpoint_id,
                    host,
                    "410 Gone: disabling the webhook endpoint"
                );
                let row = OutcomeRow {
                    id,
                    attempt,
                    next: NextState::Dead,
                    observed,
                };
                let outcome = self.record(row, Some((d.row.endpoint_id, reason))).await;
                Step::Done(outcome)
            }
            Answer::Status {
                code,
                retry_after,
                body,
            } => {
                let observed = Observed {
                    status_code: Some(code),
                    error: Some(status_error(code, &body)),
                    latency,
                };
                let next = self.next_after_failure(attempt, retry_after);
                debug!(
                    role = ROLE,
                    delivery = id,
                    endpoint = d.row.endpoint_id,
                    host,
                    code,
                    "webhook receiver answered with a failure"
                );
                finished(next, observed)
            }
            Answer::Refused(error) => {
                warn!(role = ROLE, delivery = id, endpoint = d.row.endpoint_id, error = %error, "webhook target refused by the SSRF guard");
                let observed = Observed {
                    error: Some(error),
                    ..Observed::default()
                };
                let next = self.next_after_failure(attempt, None);
                Step::Write(Finished {
                    row: OutcomeRow {
                        id,
                        attempt,
                        next,
                        observed,
                    },
                    refused: true,
                })
            }
            Answer::Failed(error) => {
                debug!(role = ROLE, delivery = id, endpoint = d.row.endpoint_id, host, error = %error, "webhook attempt failed");
                let observed = Observed {
                    error: Some(error),
                    latency,
                    ..Observed::default()
                };
                let next = self.next_after_failure(attempt, None);
                finished(next, observed)
            }
        }
    }

    /// Both permits (the endpoint's first, so a slow endpoint's queue does not
    /// hold the global ones), or `None` if the start deadline or a cancel comes first.
    async fn wait_turn(
        &self,
        endpoint_id: i64,
        start_by: &StartBy,
    ) -> Option<(OwnedSemaphorePermit, OwnedSemaphorePermit)> {
        let endpoint = self.endpoint_limit(endpoint_id);
        let global = self.inner.in_flight.clone();
        let both = async move {
            let e = endpoint.acquire_owned().await.ok()?;
            let g = global.acquire_owned().await.ok()?;
            Some((e, g))
        };
        let deadline = tokio::time::Instant::from_std(start_by.deadline);
        tokio::select! {
            biased;
            _ = start_by.cancel.cancelled() => None,
            permits = tokio::time::timeout_at(deadline, both) => permits.ok().flatten(),
        }
    }

    fn endpoint_limit(&self, endpoint_id: i64) -> Arc<Semaphore> {
        let mut map = self
            .inner
            .per_endpoint
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        map.entry(endpoint_id)
            .or_insert_with(|| {
                Arc::new(Semaphore::new(self.inner.config.max_in_flight_per_endpoint))
            })
            .clone()
    }

    /// Forget the limits of endpoints nothing is waiting on.
    fn prune_endpoint_limits(&self) {
        let mut map = self
            .inner
            .per_endpoint
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        map.retain(|_, s| Arc::strong_count(s) > 1);
    }

    fn next_after_failure(&self, attempt: i32, retry_after: Option<Duration>) -> NextState {
        let made = u32::try_from(attempt).unwrap_or(0);
        let mut rng = rand::rng();
        match self
            .inner
            .config
            .retry_schedule
            .next_delay_with_retry_after(made, retry_after, &mut rng)
        {
            Some(wait) => NextState::RetryAfter(wait),
            None => NextState::Dead,
        }
    }

    /// Write one outcome (a 410's, with its endpoint disabled in the same
    /// transaction) by compare-and-set on (`id`, `attempt`, pending); not counted.
    async fn record(&self, row: OutcomeRow, disable_endpoint: Option<(i64, String)>) -> Outcome {
        let written = store::record_outcome(
            &self.inner.db,
            &row,
            disable_endpoint,
            self.inner.config.statement_timeout,
        )
        .await;
        match written {
            Ok(applied) => applied_outcome(&row, false, applied),
            Err(e) => {
                warn!(
                    role = ROLE, delivery = row.id, attempt = row.attempt, error = %e,
                    "could not record a webhook attempt; the delivery comes due again when its claim lease ends"
                );
                Outcome::Unrecorded
            }
        }
    }

    /// Write a group of outcomes with one statement ([`store::record_outcomes`])
    /// and count each. Returns each one's key and outcome: the ones whose
    /// compare-and-set matched no row are `Stale`; if the write fails, all
    /// are `Unrecorded` (their deliveries come due again after their claim lease).
    async fn write_outcomes(&self, group: Vec<Finished>) -> Written {
        let rows: Vec<OutcomeRow> = group.iter().map(|f| f.row.clone()).collect();
        let written =
            store::record_outcomes(&self.inner.db, &rows, self.inner.config.statement_timeout)
                .await;
        let outcomes: Vec<_> = match written {
            Ok(applied) => group
                .iter()
                .map(|f| {
                    let key = (f.row.id, f.row.attempt);
                    (
                        key,
                        applied_outcome(&f.row, f.refused, applied.contains(&key)),
                    )
                })
                .collect(),
            Err(e) => {
                warn!(
                    role = ROLE, outcomes = group.len(), error = %e,
                    "could not record webhook attempts; their deliveries come due again when their claim leases end"
                );
                group
                    .iter()
                    .map(|f| ((f.row.id, f.row.attempt), Outcome::Unrecorded))
                    .collect()
            }
        };
        for (_, outcome) in &outcomes {
            self.count(outcome);
        }
        outcomes
    }

    async fn release(&self, id: i64, attempt: i32) -> Outcome {
        let statement_timeout = self.inner.config.statement_timeout;
        match store::release_unsent(&self.inner.db, id, attempt, statement_timeout).await {
            Ok(true) => {
                debug!(
                    role = ROLE,
                    delivery = id,
                    attempt,
                    "unsent webhook claim handed back"
                )
            }
            Ok(false) => {
                debug!(
                    role = ROLE,
                    delivery = id,
                    attempt,
                    "unsent webhook claim already superseded"
                )
            }
            Err(e) => warn!(
                role = ROLE, delivery = id, attempt, error = %e,
                "could not hand back an unsent webhook claim; it comes due when its lease ends"
            ),
        }
        Outcome::Released
    }

    fn count(&self, outcome: &Outcome) {
        if let Some(label) = outcome.label() {
            self.inner
                .telemetry
                .counter("hardcount_webhook_deliveries_total", &[("outcome", label)])
                .increment(1);
        }
    }

    async fn refresh_gauges(&self) {
        match store::backlog(&self.inner.db, self.inner.config.statement_timeout).await {
            Ok(b) => {
                let t = &self.inner.telemetry;
                t.gauge("hardcount_webhook_deliveries_pending", &[])
                    .set(b.pending as f64);
                t.gauge("hardcount_webhook_deliveries_dead", &[])
                    .set(b.dead as f64);
                t.gauge("hardcount_webhook_oldest_pending_age_seconds", &[])
                    .set(b.oldest_pending_age);
            }
            Err(e) => warn!(role = ROLE, error = %e, "could not read the webhook delivery backlog"),
        }
    }
}

/// Run `each` on every item concurrently, each as its own guarded step
/// ([`scheduler::catch`]), so one that panics ends only itself. Yields every
/// item's key with its output or its panic, in completion order.
fn guarded<K, T, O, F, Fut>(
    items: Vec<(K, String, T)>,
    each: F,
) -> FuturesUnordered<impl Future<Output = (K, Result<O, Payload>)>>
where
    F: Fn(T) -> Fut,
    Fut: Future<Output = O>,
{
    items
        .into_iter()
        .map(|(key, step, item)| {
            let guarded = catch(step, each(item));
            async move { (key, guarded.await) }
        })
        .collect()
}

/// Outcomes written with one statement at most this many at a time.
const OUTCOME_GROUP: usize = 64;
/// A buffered outcome waits at most this long for others to join its group.
const OUTCOME_LINGER: Duration = Duration::from_millis(20);

/// Each outcome of a written group, by (id, attempt).
type Written = Vec<((i64, i32), Outcome)>;

/// What an attempt left to do.
enum Step {
    /// Nothing: handed back, or already written (a 410). Not yet counted.
    Done(Outcome),
    /// Its outcome is still to be written.
    Write(Finished),
}

/// A finished attempt whose outcome is not written yet.
struct Finished {
    row: OutcomeRow,
    /// Refused by the SSRF guard: counted as `refused` when written as a retry.
    refused: bool,
}

/// Outcomes waiting for their group's write. Dropped with outcomes still in
/// it (the tick was abandoned mid-batch), it hands them to a task of their
/// own, so they are written anyway; only if there is no runtime left are they
/// not written, and then their deliveries come due again after the claim
/// lease (at-least-once).
struct OutcomeBuffer {
    worker: Worker,
    rows: Vec<Finished>,
    /// When the first buffered outcome has waited [`OUTCOME_LINGER`].
    flush_at: Option<tokio::time::Instant>,
}

impl OutcomeBuffer {
    fn push(&mut self, finished: Finished) {
        if self.rows.is_empty() {
            self.flush_at = Some(tokio::time::Instant::now() + OUTCOME_LINGER);
        }
        self.rows.push(finished);
    }

    /// Hand the buffered outcomes to a task that writes them; resolves to
    /// their number and their outcomes (already counted in the metrics).
    fn flush(
        &mut self,
    ) -> impl Future<Output = (usize, Result<Written, tokio::task::JoinError>)> + use<> {
        let group = std::mem::take(&mut self.rows);
        self.flush_at = None;
        let n = group.len();
        let worker = self.worker.clone();
        let task = tokio::spawn(async move { worker.write_outcomes(group).await });
        async move { (n, task.await) }
    }
}

impl Drop for OutcomeBuffer {
    fn drop(&mut self) {
        if self.rows.is_empty() {
            return;
        }
        let group = std::mem::take(&mut self.rows);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let worker = self.worker.clone();
                runtime.spawn(async move { worker.write_outcomes(group).await });
            }
            Err(_) => warn!(
                role = ROLE,
                outcomes = group.len(),
                "webhook outcomes not written (no runtime); their deliveries come due again when their claim leases end"
            ),
        }
    }
}

/// Sleeps until `at`, or forever when there is none.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The outcome of a written (`applied`) or stale attempt; logs a stale one.
fn applied_outcome(row: &OutcomeRow, refused: bool, applied: bool) -> Outcome {
    if !applied {
        warn!(
            role = ROLE,
            delivery = row.id,
            attempt = row.attempt,
            "stale webhook attempt: a later claim superseded it, so its result is not written"
        );
        return Outcome::Stale;
    }
    match row.next {
        NextState::Delivered => Outcome::Delivered,
        NextState::RetryAfter(_) if refused => Outcome::Refused,
        NextState::RetryAfter(_) => Outcome::Retry,
        NextState::Dead => Outcome::Dead,
    }
}

/// `last_error` for a failure status: the code and the start of the body.
fn status_error(code: u16, body: &[u8]) -> String {
    const SHOWN: usize = 256;
    let text = String::from_utf8_lossy(&body[..body.len().min(SHOWN)]);
    let text = text.trim();
    if text.is_empty() {
        format!("HTTP {code}")
    } else {
        format!("HTTP {code}: {text}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::AssertUnwindSafe;

    #[tokio::test]
    async fn a_panicking_delivery_ends_only_itself_and_the_tick_raises_it_at_the_end() {
        scheduler::install_panic_hook();
        let items = (1..=5)
            .map(|i| (i, format!("test/delivery {i}"), i))
            .collect();
        let results: Vec<_> = guarded(items, |i| async move {
            // Interleave: the panicking item is neither the first to start nor to finish.
            tokio::time::sleep(Duration::from_millis(10 * (5 - i))).await;
            assert_ne!(i, 3, "delivery 3 is poison");
            i * 10
        })
        .collect()
        .await;
        let mut done: Vec<_> = results
            .iter()
            .filter_map(|(k, r)| r.as_ref().ok().map(|v| (*k, *v)))
            .collect();
        done.sort();
        assert_eq!(done, vec![(1, 10), (2, 20), (4, 40), (5, 50)]);
        let mut panics = Panics::new("test");
        for (key, result) in results {
            if let Err(payload) = result {
                assert_eq!(key, 3);
                assert!(panic_message(&*payload).contains("delivery 3 is poison"));
                panics.record(payload);
            }
        }
        assert_eq!(panics.panicked(), 1);
        let raised = std::panic::catch_unwind(AssertUnwindSafe(|| panics.finish())).unwrap_err();
        assert!(panic_message(&*raised).contains("delivery 3 is poison"));
    }

    #[test]
    fn the_default_config_is_valid_and_nonsense_is_named() {
        let config = WorkerConfig::default();
        assert_eq!(config.validate(), Ok(()));
        assert_eq!(config.claim_lease(), Duration::from_secs(30));
        assert_eq!(config.request_timeout, Duration::from_secs(15));
        assert_eq!(config.max_response_bytes, 64 * 1024);
        let zero = WorkerConfig {
            max_in_flight_per_endpoint: 0,
            ..WorkerConfig::default()
        };
        assert_eq!(
            zero.validate(),
            Err(ConfigError::Zero("max_in_flight_per_endpoint"))
        );
        let short = WorkerConfig {
            tick_budget: Duration::from_secs(10),
            ..WorkerConfig::default()
        };
        let err = short.validate().unwrap_err();
        assert!(matches!(err, ConfigError::BudgetTooShort { .. }));
        let text = err.to_string();
        assert!(
            text.contains("tick budget (10s)") && text.contains("request timeout (15s)"),
            "{text}"
        );
    }

    #[test]
    fn a_failure_status_keeps_the_start_of_the_body() {
        assert_eq!(status_error(500, b""), "HTTP 500");
        assert_eq!(
            status_error(503, b"  down for maintenance\n"),
            "HTTP 503: down for maintenance"
        );
        let long = vec![b'x'; 10_000];
        assert_eq!(status_error(500, &long).len(), "HTTP 500: ".len() + 256);
    }
}
