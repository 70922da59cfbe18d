//! Parsing one variable's text: durations, counts, retry schedules, each
//! refused with the variable's name and its bounds.

use std::ops::RangeInclusive;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use webhook_delivery::backoff::RetrySchedule;

use super::RETRY_DELAY;
use crate::secret::Secret;

/// `url`, read from `var`, if it parses and its TLS settings (`sslmode`,
/// `sslrootcert`) can be used; the refusal names `var` and shows the URL
/// without its password.
pub(super) fn database_url(var: &str, url: String) -> Result<String> {
    db::check_url(&url).map_err(|e| anyhow!("{var}: {e}"))?;
    Ok(url)
}

/// `own` (read from `var`) if set, else `DATABASE_URL`, checked as
/// [`database_url`] under the name of the one used.
pub(super) fn own_or_database_url(
    var: &str,
    own: &Option<Secret>,
    fallback: &Option<Secret>,
) -> Result<String> {
    match (Secret::set(own), Secret::set(fallback)) {
        (Some(url), _) => database_url(var, url.to_owned()),
        (None, Some(url)) => database_url("DATABASE_URL", url.to_owned()),
        (None, None) => bail!("neither {var} nor DATABASE_URL is set"),
    }
}

pub(super) fn roles_explicit(roles: &Option<String>) -> bool {
    non_empty(roles).is_some()
}

/// `HARDCOUNT_WEBHOOK_RETRY_SCHEDULE`: comma-separated delays, each within [`RETRY_DELAY`].
pub(super) fn retry_schedule(text: &str) -> Result<RetrySchedule> {
    const VAR: &str = "HARDCOUNT_WEBHOOK_RETRY_SCHEDULE";
    let mut delays = Vec::new();
    for (i, item) in text.split(',').map(str::trim).enumerate() {
        let delay = duration(VAR, item, RETRY_DELAY)
            .with_context(|| format!("{VAR}={text:?}: delay {} is wrong", i + 1))?;
        delays.push(delay);
    }
    // RetrySchedule::parse has its own (unbounded) grammar; the list is built here
    // so every duration setting goes through `duration`.
    Ok(RetrySchedule(delays))
}

/// The one duration parser: humantime's syntax, then `bounds`, refusing by name.
pub fn duration(var: &str, text: &str, bounds: RangeInclusive<Duration>) -> Result<Duration> {
    let text = text.trim();
    let value = humantime::parse_duration(text).map_err(|e| {
        anyhow!("{var}={text:?}: {e} (expected a duration like 500ms, 30s, 5m, 1h or 1d)")
    })?;
    let show = |d: &Duration| humantime::format_duration(*d).to_string();
    if value < *bounds.start() {
        bail!("{var}={text:?}: must be at least {}", show(bounds.start()));
    }
    if value > *bounds.end() {
        bail!("{var}={text:?}: must be at most {}", show(bounds.end()));
    }
    Ok(value)
}

/// A whole number within `bounds`, refusing by name.
pub(super) fn whole(var: &str, text: &str, bounds: RangeInclusive<usize>) -> Result<usize> {
    let text = text.trim();
    text.parse::<usize>()
        .ok()
        .filter(|n| bounds.contains(n))
        .ok_or_else(|| {
            anyhow!(
                "{var}={text:?}: expected a whole number from {} to {}",
                bounds.start(),
                bounds.end()
            )
        })
}

/// Set and not blank: an empty variable means unset, as it does to a shell user.
pub(crate) fn non_empty(value: &Option<String>) -> Option<String> {
    value
        .as_deref()
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_owned)
}

/// HARDCOUNT_LEASE_PROFILE: `standard` (unset or empty) or `fast`
/// (docs/adr/0047).
pub fn lease_profile(value: Option<&str>) -> Result<leader::Timing> {
    match value.map(str::trim).unwrap_or("") {
        "" | "standard" => Ok(leader::Timing::ADR),
        "fast" => Ok(leader::Timing::FAST),
        other => bail!(
            "HARDCOUNT_LEASE_PROFILE={other:?}: expected standard (a 10 s lease renewed every 3 s) \
             or fast (3 s, renewed every second)"
        ),
    }
}
