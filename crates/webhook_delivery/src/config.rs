//! How deliveries are sent: the settings, their defaults, and the checks that
//! refuse, by name, settings that cannot work.

use std::time::Duration;

use crate::backoff::RetrySchedule;
use crate::sealed::Keyring;
use crate::ssrf::{Allowlist, Ports};

/// How deliveries are sent. `Default` is the production setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerConfig {
    /// Deliveries claimed per batch. Default 500: a batch waits for its
    /// slowest attempt and the next claim runs alone, so small batches cost
    /// throughput; at the benchmark's scale (issue 13) 500 beat 256 in each
    /// of six interleaved runs at the shipped 1 s interval, with no more
    /// Postgres CPU per delivery (docs/adr/0014, docs/adr/0020).
    pub batch_size: usize,
    /// Requests in flight at once, across endpoints. Default 32.
    pub max_in_flight: usize,
    /// Requests in flight at once to one endpoint. Default 4.
    pub max_in_flight_per_endpoint: usize,
    /// Requests in flight at once for one tenant, across its endpoints.
    /// Default 8: a quarter of `max_in_flight`, so a tenant whose endpoints
    /// all hang holds at most a quarter of the slots (docs/adr/0018).
    pub max_in_flight_per_tenant: usize,
    /// Requests in flight at once to one resolved address and port, across
    /// tenants and host names. Default 16.
    pub max_in_flight_per_destination: usize,
    /// Consecutive timeouts of an endpoint that open its circuit breaker.
    /// Default 5.
    pub breaker_timeouts: u32,
    /// How long an opened breaker holds the endpoint's deliveries before one
    /// trial attempt; doubled after each failed trial, up to 16 times this.
    /// Default 30 s.
    pub breaker_cooloff: Duration,
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
    /// The ports a webhook may go to (default [`Ports::WEB`]: 80, 443, 1024 up).
    pub ports: Ports,
    /// The server cancels a store statement after this. Default 5 s.
    pub statement_timeout: Duration,
    /// The keys that open the sealed signing secrets (`HARDCOUNT_SECRETS_KEY`);
    /// default none, and then no delivery is signed (`bad_secret`).
    pub secrets: Option<Keyring>,
    /// An enabled endpoint whose every attempt has failed for this long is
    /// turned off and its tenant told (`HARDCOUNT_WEBHOOK_DISABLE_AFTER`,
    /// docs/adr/0041). Default 5 days; `None` never turns one off.
    pub disable_after: Option<Duration>,
    /// The sender of the email that tells a tenant's contact an endpoint
    /// was turned off (`HARDCOUNT_WEBHOOK_NOTICE_FROM`). Default none: only
    /// the `endpoint.disabled` event tells the tenant.
    pub notice_from: Option<String>,
    /// Delete delivered and dead deliveries (with their attempts) and this
    /// role's lease history once old, as the tick's last step
    /// (docs/adr/0040); default none, nothing is pruned.
    pub retention: Option<scheduler::Retention>,
    /// A tick ends with the backlog gauges' read at most once per this
    /// (docs/adr/0138): the read counts every pending row, however few the
    /// tick took. Default [`scheduler::BACKLOG_READ_EVERY`] (15 s); zero reads
    /// at every tick's end.
    pub backlog_read_every: Duration,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            batch_size: 500,
            max_in_flight: 32,
            max_in_flight_per_endpoint: 4,
            max_in_flight_per_tenant: 8,
            max_in_flight_per_destination: 16,
            breaker_timeouts: 5,
            breaker_cooloff: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(15),
            claim_margin: Duration::from_secs(15),
            tick_budget: Duration::from_secs(60),
            max_response_bytes: 64 * 1024,
            retry_schedule: RetrySchedule::default(),
            allowlist: Allowlist::default(),
            ports: Ports::default(),
            statement_timeout: Duration::from_secs(5),
            secrets: None,
            disable_after: Some(Duration::from_secs(5 * 86_400)),
            notice_from: None,
            retention: None,
            backlog_read_every: scheduler::BACKLOG_READ_EVERY,
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
            ("max_in_flight_per_tenant", self.max_in_flight_per_tenant),
            (
                "max_in_flight_per_destination",
                self.max_in_flight_per_destination,
            ),
            ("breaker_timeouts", self.breaker_timeouts as usize),
            ("max_response_bytes", self.max_response_bytes),
        ];
        let durations = [
            ("connect_timeout", self.connect_timeout),
            ("request_timeout", self.request_timeout),
            ("claim_margin", self.claim_margin),
            ("tick_budget", self.tick_budget),
            ("statement_timeout", self.statement_timeout),
            ("breaker_cooloff", self.breaker_cooloff),
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
