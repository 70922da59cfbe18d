//! The billing role's settings: defaults and validation.

use std::time::Duration;

use crate::provider::ProviderConfig;

/// How a `billing` tick is shaped.
#[derive(Debug, Clone, PartialEq)]
pub struct BillingConfig {
    /// Due subscriptions claimed and closed per batch (one transaction). Default 500.
    pub batch_size: usize,
    /// Each step of the tick (trials, resumes, due billing, auto-charge, the
    /// payment-method request, the reconciler, stale holds) claims no batch
    /// after this much of its own run; the steps run one after another, so a
    /// tick whose every step has a backlog runs several budgets. Default
    /// 10 min: the role runs hourly, and a tick a budget stopped is due again
    /// at once.
    pub tick_budget: Duration,
    /// The server cancels a store statement after this. Default 30 s.
    pub statement_timeout: Duration,
    /// The payment provider auto-charge calls; `None` skips the charge step.
    pub provider: Option<ProviderConfig>,
    /// How long an auto-charge claim holds an invoice. Default 10 min; must
    /// exceed twice the provider timeout, so a claim outlives its call.
    pub charge_lease: Duration,
    /// The sender of receipts and payment-failed emails.
    pub email_from: String,
    /// Provider calls in flight at once (auto-charge and the reconciler's
    /// lookups), each with its own database work. Default 32: at a few
    /// milliseconds per charge on loopback that is well over 1,000 charges/s.
    pub charge_concurrency: usize,
    /// This deployment's name in every idempotency key and in each charge's
    /// metadata, so two installs on one provider account (or a restored copy)
    /// never replay each other's answers. `[a-z0-9_]`, 1 to 32 characters.
    /// Default `default`.
    pub instance_id: String,
    /// How long after an attempt's first send the reconciler may send the
    /// same request again under its key (docs/adr/0024). Stripe keeps a key at
    /// least 24 hours, so at most 23 h. Default 12 h.
    pub resend_window: Duration,
    /// The reconciler's first wait before looking at an open attempt again
    /// (a processing intent, a lookup that failed); doubled per look, at most
    /// an hour. Default 30 s.
    pub reconcile_backoff: Duration,
    /// At most this many periods of one subscription are closed in one tick
    /// (a subscription further behind, after an outage or on an hourly plan,
    /// catches up over the next ticks). Default 100.
    pub catch_up_periods: usize,
}

impl Default for BillingConfig {
    fn default() -> BillingConfig {
        BillingConfig {
            batch_size: 500,
            tick_budget: Duration::from_secs(600),
            statement_timeout: Duration::from_secs(30),
            provider: None,
            charge_lease: Duration::from_secs(600),
            email_from: "Billing <billing@example.com>".to_owned(),
            charge_concurrency: 32,
            instance_id: "default".to_owned(),
            resend_window: Duration::from_secs(12 * 3600),
            reconcile_backoff: Duration::from_secs(30),
            catch_up_periods: 100,
        }
    }
}

/// A setting out of range. Refused at construction, naming the setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("billing batch_size must be between 1 and 10000, not {0}")]
    BatchSize(usize),
    #[error("billing catch_up_periods must be between 1 and 10000, not {0}")]
    CatchUpPeriods(usize),
    #[error("billing charge_concurrency must be between 1 and 256, not {0}")]
    ChargeConcurrency(usize),
    #[error("billing {field} must be between {min:?} and {max:?}, not {value:?}")]
    Duration {
        field: &'static str,
        value: Duration,
        min: Duration,
        max: Duration,
    },
    #[error(
        "billing provider base URL must be an http(s) URL without a path, query, fragment or credentials, not {0}"
    )]
    ProviderUrl(String),
    #[error("billing provider secret key must be a non-empty `sk_…` key (value not shown)")]
    ProviderSecretKey,
    #[error(
        "billing charge_lease ({lease:?}) must be at least twice the provider timeout ({timeout:?})"
    )]
    ChargeLease { lease: Duration, timeout: Duration },
    #[error(
        "billing instance_id (HARDCOUNT_INSTANCE_ID) must be 1 to 32 characters of a-z, 0-9 and _, not {0:?}"
    )]
    InstanceId(String),
    #[error("billing email_from is empty")]
    EmailFrom,
    #[error("billing provider client: {0}")]
    ProviderClient(String),
}

impl BillingConfig {
    /// # Errors
    /// The first setting out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=10_000).contains(&self.batch_size) {
            return Err(ConfigError::BatchSize(self.batch_size));
        }
        if !(1..=10_000).contains(&self.catch_up_periods) {
            return Err(ConfigError::CatchUpPeriods(self.catch_up_periods));
        }
        if !(1..=256).contains(&self.charge_concurrency) {
            return Err(ConfigError::ChargeConcurrency(self.charge_concurrency));
        }
        let ms = Duration::from_millis;
        let s = Duration::from_secs;
        let ranges = [
            ("tick_budget", self.tick_budget, ms(100), s(3600)),
            ("statement_timeout", self.statement_timeout, ms(100), s(300)),
            ("charge_lease", self.charge_lease, s(1), s(86_400)),
            // Stripe prunes keys after at least 24 h: resend only well inside it.
            ("resend_window", self.resend_window, s(60), s(23 * 3600)),
            (
                "reconcile_backoff",
                self.reconcile_backoff,
                Duration::ZERO,
                s(3600),
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
        let id = &self.instance_id;
        if !(1..=32).contains(&id.len())
            || !id
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            return Err(ConfigError::InstanceId(id.clone()));
        }
        if self.email_from.trim().is_empty() {
            return Err(ConfigError::EmailFrom);
        }
        if let Some(p) = &self.provider {
            p.validate()?;
            if self.charge_lease < p.timeout * 2 {
                return Err(ConfigError::ChargeLease {
                    lease: self.charge_lease,
                    timeout: p.timeout,
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
                    charge_concurrency: 0,
                    ..Default::default()
                },
                "charge_concurrency",
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
            (
                BillingConfig {
                    resend_window: Duration::from_secs(23 * 3600 + 1),
                    ..Default::default()
                },
                "resend_window",
            ),
            (
                BillingConfig {
                    instance_id: "eu-1".into(),
                    ..Default::default()
                },
                "instance_id",
            ),
        ];
        let provider = |url: &str, key: &str, timeout: u64| BillingConfig {
            provider: Some(ProviderConfig {
                base_url: url.to_owned(),
                secret_key: crate::provider::SecretKey::new(key),
                timeout: Duration::from_secs(timeout),
            }),
            ..Default::default()
        };
        assert_eq!(
            provider("http://127.0.0.1:9", "sk_test_x", 30).validate(),
            Ok(())
        );
        let bad = bad.into_iter().chain([
            (provider("ftp://x", "sk_test_x", 30), "base URL"),
            (provider("http://u:p@x", "sk_test_x", 30), "base URL"),
            (provider("http://x/v1", "sk_test_x", 30), "base URL"),
            (provider("http://x", "pk_test_x", 30), "secret key"),
            (provider("http://x", "sk_test_x", 0), "provider timeout"),
            (
                BillingConfig {
                    charge_lease: Duration::from_secs(100),
                    ..provider("http://x", "sk_test_x", 60)
                },
                "charge_lease",
            ),
        ]);
        for (config, field) in bad {
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{field} not in {err}");
        }
    }
}
