//! The email sender's settings: defaults and validation.

use std::time::Duration;

/// How an `email_outbox` tick is shaped.
#[derive(Debug, Clone, PartialEq)]
pub struct SenderConfig {
    /// Emails claimed per batch. Default 500 (docs/adr/0051: a batch ends
    /// with its slowest sends, the connections idle meanwhile).
    pub batch_size: usize,
    /// SMTP connections open at once (in use or idle), and so sends in flight at
    /// once: a hard bound (docs/adr/0016). Default 16.
    pub max_connections: u32,
    /// One SMTP command's timeout (connect, each reply). Default 30 s.
    pub send_timeout: Duration,
    /// No batch is claimed after this much of the tick. Default 20 s.
    pub tick_budget: Duration,
    /// The server cancels a store statement after this. Default 5 s.
    pub statement_timeout: Duration,
    /// Waits between attempts; failed after the last. Default 1m, 5m, 30m, 2h, 6h (6 attempts).
    pub retry_delays: Vec<Duration>,
    /// A tick ends with the backlog gauges' read at most once per this
    /// (docs/adr/0138): the read counts every pending row, however few the
    /// tick took. Default [`scheduler::BACKLOG_READ_EVERY`] (15 s); zero reads
    /// at every tick's end.
    pub backlog_read_every: Duration,
}

impl Default for SenderConfig {
    fn default() -> SenderConfig {
        let m = |n: u64| Duration::from_secs(60 * n);
        SenderConfig {
            batch_size: 500,
            max_connections: 16,
            send_timeout: Duration::from_secs(30),
            tick_budget: Duration::from_secs(20),
            statement_timeout: Duration::from_secs(5),
            retry_delays: vec![m(1), m(5), m(30), m(120), m(360)],
            backlog_read_every: scheduler::BACKLOG_READ_EVERY,
        }
    }
}

/// A setting out of range. Refused at boot, naming the setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("email batch_size must be between 1 and 10000, not {0}")]
    BatchSize(usize),
    #[error("email max_connections must be between 1 and 256, not {0}")]
    MaxConnections(u32),
    #[error("email {field} must be between {min:?} and {max:?}, not {value:?}")]
    Duration {
        field: &'static str,
        value: Duration,
        min: Duration,
        max: Duration,
    },
    #[error("email retry_delays must have between 1 and 20 entries, not {0}")]
    RetryCount(usize),
}

impl SenderConfig {
    /// # Errors
    /// The first setting out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=10_000).contains(&self.batch_size) {
            return Err(ConfigError::BatchSize(self.batch_size));
        }
        if !(1..=256).contains(&self.max_connections) {
            return Err(ConfigError::MaxConnections(self.max_connections));
        }
        let s = Duration::from_secs;
        let ranges = [
            (
                "send_timeout",
                self.send_timeout,
                Duration::from_millis(100),
                s(300),
            ),
            (
                "tick_budget",
                self.tick_budget,
                Duration::from_millis(100),
                s(3600),
            ),
            (
                "statement_timeout",
                self.statement_timeout,
                Duration::from_millis(100),
                s(60),
            ),
        ];
        for (field, value, min, max) in ranges {
            if value < min || value > max {
                return Err(ConfigError::Duration {
                    field,
                    value,
                    min,
                    max,
                });
            }
        }
        if !(1..=20).contains(&self.retry_delays.len()) {
            return Err(ConfigError::RetryCount(self.retry_delays.len()));
        }
        for &value in &self.retry_delays {
            // The binary refuses delays under 1 s by the setting's name; tests use less.
            if value < Duration::from_millis(1) || value > s(7 * 24 * 3600) {
                return Err(ConfigError::Duration {
                    field: "retry_delays",
                    value,
                    min: Duration::from_millis(1),
                    max: s(7 * 24 * 3600),
                });
            }
        }
        Ok(())
    }

    /// How long a claim keeps an email from other senders: the rest of the
    /// tick plus two command timeouts and a margin, so a send started inside
    /// the tick's window has two command timeouts of its lease left. A send
    /// slower than that (its deadline is four) can outlast the lease and be
    /// claimed again: a second copy, which at-least-once allows
    /// (docs/adr/0051).
    pub fn claim_lease(&self) -> Duration {
        self.tick_budget + self.send_timeout * 2 + Duration::from_secs(10)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_valid_and_nonsense_is_named() {
        assert_eq!(SenderConfig::default().validate(), Ok(()));
        let bad = [
            (
                SenderConfig {
                    batch_size: 0,
                    ..Default::default()
                },
                "batch_size",
            ),
            (
                SenderConfig {
                    max_connections: 0,
                    ..Default::default()
                },
                "max_connections",
            ),
            (
                SenderConfig {
                    send_timeout: Duration::ZERO,
                    ..Default::default()
                },
                "send_timeout",
            ),
            (
                SenderConfig {
                    retry_delays: vec![],
                    ..Default::default()
                },
                "retry_delays",
            ),
            (
                SenderConfig {
                    retry_delays: vec![Duration::from_secs(8 * 24 * 3600)],
                    ..Default::default()
                },
                "retry_delays",
            ),
        ];
        for (config, field) in bad {
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{field} not in {err}");
        }
    }
}
