//! The billing role's settings: defaults and validation.

use std::time::Duration;

/// How a `billing` tick is shaped.
#[derive(Debug, Clone, PartialEq)]
pub struct BillingConfig {
    /// Due subscriptions claimed and closed per batch (one transaction). Default 500.
    pub batch_size: usize,
    /// No batch is claimed after this much of the tick. Default 10 min: the
    /// role runs hourly, and a tick stopped by its budget is due again at once.
    pub tick_budget: Duration,
    /// The server cancels a store statement after this. Default 30 s.
    pub statement_timeout: Duration,
}

impl Default for BillingConfig {
    fn default() -> BillingConfig {
        BillingConfig {
            batch_size: 500,
            tick_budget: Duration::from_secs(600),
            statement_timeout: Duration::from_secs(30),
        }
    }
}

/// A setting out of range. Refused at construction, naming the setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("billing batch_size must be between 1 and 10000, not {0}")]
    BatchSize(usize),
    #[error("billing {field} must be between {min:?} and {max:?}, not {value:?}")]
    Duration {
        field: &'static str,
        value: Duration,
        min: Duration,
        max: Duration,
    },
}

impl BillingConfig {
    /// # Errors
    /// The first setting out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=10_000).contains(&self.batch_size) {
            return Err(ConfigError::BatchSize(self.batch_size));
        }
        let ms = Duration::from_millis;
        let s = Duration::from_secs;
        let ranges = [
            ("tick_budget", self.tick_budget, ms(100), s(3600)),
            ("statement_timeout", self.statement_timeout, ms(100), s(300)),
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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_valid_and_nonsense_is_named() {
        assert_eq!(BillingConfig::default().validate(), Ok(()));
        let bad = [
            (
                BillingConfig {
                    batch_size: 0,
                    ..Default::default()
                },
                "batch_size",
            ),
            (
                BillingConfig {
                    batch_size: 10_001,
                    ..Default::default()
                },
                "batch_size",
            ),
            (
                BillingConfig {
                    tick_budget: Duration::ZERO,
                    ..Default::default()
                },
                "tick_budget",
            ),
            (
                BillingConfig {
                    statement_timeout: Duration::from_secs(301),
                    ..Default::default()
                },
                "statement_timeout",
            ),
        ];
        for (config, field) in bad {
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{field} not in {err}");
        }
    }
}
