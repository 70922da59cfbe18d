//! Which roles a replica runs and how often: `HARDCOUNT_ROLES`,
//! `HARDCOUNT_<ROLE>_INTERVAL` and `HARDCOUNT_<ROLE>_SCHEDULE`. Only the binary reads the environment (and parses
//! durations, with one parser for every setting); it passes the values in, so this
//! stays testable and knows nothing of text formats for time.

use std::time::Duration;

use leader::{CronSchedule, Role, Schedule};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("HARDCOUNT_ROLES: {0}")]
    UnknownRole(#[from] leader::UnknownRole),
    #[error("HARDCOUNT_ROLES is empty: name at least one role, or unset it to run all five")]
    NoRoles,
    #[error("{var} is {interval:?}: a role's interval must be from 1s to 30 days")]
    BadInterval { var: String, interval: Duration },
}

/// The shortest tick interval: below it a role would poll its lease row faster
/// than the heartbeat renews it, for no job that needs it.
pub const MIN_INTERVAL: Duration = Duration::from_secs(1);

/// The longest tick interval; longer would overflow the database's interval
/// arithmetic for no use.
pub const MAX_INTERVAL: Duration = Duration::from_secs(30 * 86_400);

/// A role this replica runs, its tick interval, and its cron schedule when
/// it has one (`HARDCOUNT_<ROLE>_SCHEDULE`, docs/adr/0043), which then
/// decides when it is due; the interval stays the wake-up poll.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoleConfig {
    pub role: Role,
    pub interval: Duration,
    pub cron: Option<CronSchedule>,
}

impl RoleConfig {
    /// When the role is due: its cron schedule, else its interval.
    pub fn schedule(&self) -> Schedule {
        match &self.cron {
            Some(cron) => Schedule::Cron(Box::new(cron.clone())),
            None => Schedule::Every(self.interval),
        }
    }
}

/// How often each role is due when its variable is unset.
pub fn default_interval(role: Role) -> Duration {
    match role {
        Role::Billing => Duration::from_secs(3600),
        Role::Dunning => Duration::from_secs(900),
        Role::WebhookOutbox | Role::WebhookDelivery | Role::EmailOutbox => Duration::from_secs(1),
    }
}

/// The variable that sets `role`'s interval: `HARDCOUNT_BILLING_INTERVAL`, ...
fn interval_var(role: Role) -> String {
    format!("HARDCOUNT_{}_INTERVAL", role.as_str().to_ascii_uppercase())
}

/// The roles named by `roles` (the value of `HARDCOUNT_ROLES`; `None` runs all
/// five) with the interval `interval(role)` gives, or the default. The binary
/// reads and parses the variables; this checks what they mean.
pub fn roles_from_env(
    roles: Option<&str>,
    interval: impl Fn(Role) -> Option<Duration>,
) -> Result<Vec<RoleConfig>, ConfigError> {
    let roles: Vec<Role> = match roles {
        None => Role::ALL.to_vec(),
        Some(list) => {
            let mut roles = Vec::new();
            for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let role: Role = name.parse()?;
                if !roles.contains(&role) {
                    roles.push(role);
                }
            }
            if roles.is_empty() {
                return Err(ConfigError::NoRoles);
            }
            roles
        }
    };
    roles
        .into_iter()
        .map(|role| {
            let interval = interval(role).unwrap_or_else(|| default_interval(role));
            if !(MIN_INTERVAL..=MAX_INTERVAL).contains(&interval) {
                return Err(ConfigError::BadInterval {
                    var: interval_var(role),
                    interval,
                });
            }
            Ok(RoleConfig {
                role,
                interval,
                cron: None,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_roles_run_by_default_with_billing_hourly() {
        let roles = roles_from_env(None, |_| None).unwrap();
        assert_eq!(roles.len(), 5);
        assert_eq!(
            roles[0],
            RoleConfig {
                role: Role::Billing,
                interval: Duration::from_secs(3600),
                cron: None,
            }
        );
    }

    #[test]
    fn roles_and_intervals_come_from_the_environment() {
        let roles = roles_from_env(Some("email_outbox, billing, email_outbox"), |role| {
            (role == Role::Billing).then_some(Duration::from_secs(1800))
        })
        .unwrap();
        assert_eq!(
            roles,
            vec![
                RoleConfig {
                    role: Role::EmailOutbox,
                    interval: Duration::from_secs(1),
                    cron: None,
                },
                RoleConfig {
                    role: Role::Billing,
                    interval: Duration::from_secs(1800),
                    cron: None,
                },
            ]
        );
    }

    #[test]
    fn bad_configuration_is_named() {
        let err = roles_from_env(Some("billing,emails"), |_| None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"emails\""), "{err}");
        assert_eq!(
            roles_from_env(Some(" , "), |_| None),
            Err(ConfigError::NoRoles)
        );
        let err = roles_from_env(Some("billing"), |_| Some(Duration::from_millis(500)))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("HARDCOUNT_BILLING_INTERVAL is 500ms"),
            "{err}"
        );
        let month = Duration::from_secs(31 * 86_400);
        assert!(roles_from_env(Some("billing"), |_| Some(month)).is_err());
        assert!(roles_from_env(Some("billing"), |_| Some(MIN_INTERVAL)).is_ok());
    }
}
