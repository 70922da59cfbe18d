//! How the `webhook_outbox` tick is shaped: defaults and validation.

use std::time::Duration;

/// How a dispatcher tick is shaped. Checked by [`Dispatcher::new`](crate::Dispatcher::new).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatcherConfig {
    /// Events claimed per transaction. Default 500.
    pub batch_size: usize,
    /// No batch starts after this much of the tick has passed. Default 10 s.
    pub tick_budget: Duration,
    /// The server cancels a batch's statements after this. Default 10 s.
    pub statement_timeout: Duration,
    /// Deliveries one statement may fan out before it stops taking events
    /// (at least one event is always taken). Default 10,000: a batch of
    /// 500 events to 20 endpoints each; a tenant with far more endpoints
    /// fans out fewer events a statement instead of one statement running
    /// for its whole budget (issue 25, point 4).
    pub max_deliveries_per_statement: usize,
    /// A tick ends with the backlog gauges' read at most once per this
    /// (docs/adr/0138): the read counts every pending row, however few the
    /// tick took. Default [`scheduler::BACKLOG_READ_EVERY`] (15 s); zero reads
    /// at every tick's end.
    pub backlog_read_every: Duration,
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        DispatcherConfig {
            batch_size: 500,
            tick_budget: Duration::from_secs(10),
            statement_timeout: Duration::from_secs(10),
            max_deliveries_per_statement: 10_000,
            backlog_read_every: scheduler::BACKLOG_READ_EVERY,
        }
    }
}

/// A [`DispatcherConfig`] that cannot work, naming the setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("webhook outbox setting {0} must be greater than zero")]
    Zero(&'static str),
}

impl DispatcherConfig {
    /// # Errors
    /// The first setting that cannot work: a zero batch size would never
    /// drain, a zero budget would never dispatch, a zero timeout cancels every
    /// statement.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.batch_size == 0 {
            return Err(ConfigError::Zero("batch_size"));
        }
        if self.max_deliveries_per_statement == 0 {
            return Err(ConfigError::Zero("max_deliveries_per_statement"));
        }
        let durations = [
            ("tick_budget", self.tick_budget),
            ("statement_timeout", self.statement_timeout),
        ];
        if let Some((name, _)) = durations.iter().find(|(_, d)| d.is_zero()) {
            return Err(ConfigError::Zero(name));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_config_is_valid_and_a_zero_setting_is_refused_by_name() {
        assert_eq!(DispatcherConfig::default().validate(), Ok(()));
        let cases = [
            (
                DispatcherConfig {
                    batch_size: 0,
                    ..DispatcherConfig::default()
                },
                "batch_size",
            ),
            (
                DispatcherConfig {
                    tick_budget: Duration::ZERO,
                    ..DispatcherConfig::default()
                },
                "tick_budget",
            ),
            (
                DispatcherConfig {
                    statement_timeout: Duration::ZERO,
                    ..DispatcherConfig::default()
                },
                "statement_timeout",
            ),
        ];
        for (config, setting) in cases {
            let err = config.validate().unwrap_err();
            assert_eq!(err, ConfigError::Zero(setting));
            assert_eq!(
                err.to_string(),
                format!("webhook outbox setting {setting} must be greater than zero")
            );
        }
    }
}
