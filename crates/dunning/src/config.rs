//! The dunning role's settings: defaults and validation.

use std::time::Duration;

/// How a `dunning` tick is shaped.
#[derive(Debug, Clone, PartialEq)]
pub struct DunningConfig {
    /// Due runs listed per batch. Default 500.
    pub batch_size: usize,
    /// Provider calls at once, across the batches in flight (each retry a
    /// few statements and one call; docs/adr/0054). Default 32.
    pub concurrency: usize,
    /// Invoices enrolled per tick at most. Default 10,000.
    pub enrol_limit: usize,
    /// No batch is listed after this much of the tick. Default 5 min.
    pub tick_budget: Duration,
    /// The server cancels a store statement after this. Default 30 s.
    pub statement_timeout: Duration,
    /// How far a recorded attempt moves the run's next attempt, so a process
    /// that dies mid-retry does not have the run listed again at once.
    /// Default 10 min (billing's charge lease).
    pub attempt_hold: Duration,
    /// The sender of warning and final-notice emails, for a tenant without
    /// its own (`tenant_settings.email_from`) or whose own does not parse.
    pub email_from: String,
}

impl Default for DunningConfig {
    fn default() -> DunningConfig {
        DunningConfig {
            batch_size: 500,
            concurrency: 32,
            enrol_limit: 10_000,
            tick_budget: Duration::from_secs(300),
            statement_timeout: Duration::from_secs(30),
            attempt_hold: Duration::from_secs(600),
            email_from: "Billing <billing@example.com>".to_owned(),
        }
    }
}

/// A setting out of range. Refused at construction, naming the setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("dunning {field} must be between {min} and {max}, not {value}")]
    Count {
        field: &'static str,
        value: usize,
        min: usize,
        max: usize,
    },
    #[error("dunning {field} must be between {min:?} and {max:?}, not {value:?}")]
    Duration {
        field: &'static str,
        value: Duration,
        min: Duration,
        max: Duration,
    },
    #[error("dunning email_from is empty")]
    EmailFrom,
}

impl DunningConfig {
    /// # Errors
    /// The first setting out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let counts = [
            ("batch_size", self.batch_size, 1, 10_000),
            ("concurrency", self.concurrency, 1, 1_000),
            ("enrol_limit", self.enrol_limit, 1, 100_000),
        ];
        for (field, value, min, max) in counts {
            if !(min..=max).contains(&value) {
                return Err(ConfigError::Count {
                    field,
                    value,
                    min,
                    max,
                });
            }
        }
        let ms = Duration::from_millis;
        let s = Duration::from_secs;
        let ranges = [
            ("tick_budget", self.tick_budget, ms(100), s(3600)),
            ("statement_timeout", self.statement_timeout, ms(100), s(300)),
            ("attempt_hold", self.attempt_hold, s(1), s(86_400)),
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
        if self.email_from.trim().is_empty() {
            return Err(ConfigError::EmailFrom);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_valid_and_nonsense_is_named() {
        assert_eq!(DunningConfig::default().validate(), Ok(()));
        let bad = [
            (
                DunningConfig {
                    batch_size: 0,
                    ..Default::default()
                },
                "batch_size",
            ),
            (
                DunningConfig {
                    concurrency: 0,
                    ..Default::default()
                },
                "concurrency",
            ),
            (
                DunningConfig {
                    attempt_hold: Duration::ZERO,
                    ..Default::default()
                },
                "attempt_hold",
            ),
            (
                DunningConfig {
                    email_from: " ".into(),
                    ..Default::default()
                },
                "email_from",
            ),
        ];
        for (config, field) in bad {
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{field} not in {err}");
        }
    }
}
