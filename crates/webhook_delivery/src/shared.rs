//! What a [`crate::Worker`]'s clones share, and what its steps (a tick, a
//! batch, an attempt, an outcome write) are given: the database, the
//! settings, the HTTP client, the metrics, the concurrency limits, the
//! circuit breakers and the deliveries handed over unwritten. Plain data; each step is a free function over it.

use db::Db;
use leader::Telemetry;

use crate::breaker::Breakers;
use crate::config::WorkerConfig;
use crate::fairness::Limits;
use crate::unwritten::Unwritten;

pub(crate) struct Shared {
    pub db: Db,
    pub config: WorkerConfig,
    pub client: reqwest::Client,
    pub telemetry: Telemetry,
    pub limits: Limits,
    pub breakers: Breakers,
    /// When this leader last looked for endpoints to turn off.
    pub disabling: scheduler::Every,
    /// When the tick prunes (`config.retention`), if it does.
    pub pruning: Option<scheduler::Pruning>,
    /// When a tick's end reads the backlog gauges (docs/adr/0138).
    pub backlog_reads: scheduler::Every,
    /// Where the next claim starts among tenants (docs/adr/0048).
    pub cursor: db::TenantCursor,
    /// Deliveries handed over by this process's fan-out, not written yet
    /// (docs/adr/0124).
    pub unwritten: Unwritten,
}
