//! Which roles a replica runs and how often: `HARDCOUNT_ROLES` and
//! `HARDCOUNT_<ROLE>_INTERVAL`. Only the binary reads the environment; it
//! passes the lookup in, so this stays testable.

use std::time::Duration;

use leader::Role;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("HARDCOUNT_ROLES: {0}")]
    UnknownRole(#[from] leader::UnknownRole),
    #[error("HARDCOUNT_ROLES is empty: name at least one role, or unset it to run all five")]
    NoRoles,
    #[error("{var}={value:?}: {reason} (expected a duration like 500ms, 30s, 5m or 1h)")]
    BadInterval {
        var: String,
        value: String,
        reason: &'static str,
    },
}

/// A role this replica runs, and its tick interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoleConfig {
    pub role: Role,
    pub interval: Duration,
}

/// How often each role is due when its variable is unset.
pub fn default_interval(role: Role) -> Duration {
    match role {
        Role::Billing => Duration::from_secs(3600),
        Role::Dunning => Duration::from_secs(900),
        Role::WebhookOutbox | Role::WebhookDelivery | Role::EmailOutbox => Duration::from_secs(1),
    }
}

/// Read the role list and intervals through `var`, a lookup the binary builds
/// over its process environment.
pub fn roles_from_env(
    var: impl Fn(&str) -> Option<String>,
) -> Result<Vec<RoleConfig>, ConfigError> {
    let roles: Vec<Role> = match var("HARDCOUNT_ROLES") {
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
            let name = format!("HARDCOUNT_{}_INTERVAL", role.as_str().to_ascii_uppercase());
            let interval = match var(&name) {
                None => default_interval(role),
                Some(value) => {
                    parse_duration(&value).map_err(|reason| ConfigError::BadInterval {
                        var: name.clone(),
                        value: value.clone(),
                        reason,
                    })?
                }
            };
            Ok(RoleConfig { role, interval })
        })
        .collect()
}

/// `500ms`, `30s`, `5m`, `1h`, `1d`; whole numbers only, from one millisecond
/// to 30 days (longer would overflow the database's interval arithmetic for no use).
pub fn parse_duration(text: &str) -> Result<Duration, &'static str> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or("missing unit")?;
    let (digits, unit) = text.split_at(split);
    if digits.is_empty() {
        return Err("missing number");
    }
    let n: u64 = digits.parse().map_err(|_| "too large")?;
    let ms = match unit {
        "ms" => Some(n),
        "s" => n.checked_mul(1000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        "d" => n.checked_mul(86_400_000),
        _ => return Err("unknown unit"),
    }
    .ok_or("too large")?;
    if ms == 0 {
        return Err("must be positive");
    }
    if ms > 30 * 86_400_000 {
        return Err("must be at most 30d");
    }
    Ok(Duration::from_millis(ms))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn all_roles_run_by_default_with_billing_hourly() {
        let roles = roles_from_env(env(&[])).unwrap();
        assert_eq!(roles.len(), 5);
        assert_eq!(
            roles[0],
            RoleConfig {
                role: Role::Billing,
                interval: Duration::from_secs(3600)
            }
        );
    }

    #[test]
    fn roles_and_intervals_come_from_the_environment() {
        let roles = roles_from_env(env(&[
            ("HARDCOUNT_ROLES", "email_outbox, billing"),
            ("HARDCOUNT_BILLING_INTERVAL", "30m"),
        ]))
        .unwrap();
        assert_eq!(
            roles,
            vec![
                RoleConfig {
                    role: Role::EmailOutbox,
                    interval: Duration::from_secs(1)
                },
                RoleConfig {
                    role: Role::Billing,
                    interval: Duration::from_secs(1800)
                },
            ]
        );
    }

    #[test]
    fn bad_configuration_is_named() {
        let err = roles_from_env(env(&[("HARDCOUNT_ROLES", "billing,emails")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"emails\""), "{err}");
        let err = roles_from_env(env(&[("HARDCOUNT_BILLING_INTERVAL", "1 hour")]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("HARDCOUNT_BILLING_INTERVAL=\"1 hour\""),
            "{err}"
        );
        assert_eq!(
            roles_from_env(env(&[("HARDCOUNT_ROLES", " , ")])),
            Err(ConfigError::NoRoles)
        );
        assert_eq!(parse_duration("0s"), Err("must be positive"));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("31d"), Err("must be at most 30d"));
        assert_eq!(parse_duration("99999999999999999999h"), Err("too large"));
    }
}
