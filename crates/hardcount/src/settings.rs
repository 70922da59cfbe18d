//! Every setting the process reads from its environment, in one place.
//!
//! Each variable is a clap argument with an `env` attribute, so `hardcount serve
//! --help` lists them all with their defaults. The values arrive as text and are
//! checked here, so a refusal names the variable and the value it was given.
//! Durations have one syntax everywhere: humantime's (`500ms`, `30s`, `5m`,
//! `1h`, `2h 30m`, `1d`).

use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use leader::Role;
use webhook_delivery::backoff::RetrySchedule;
use webhook_delivery::ssrf::{Allowlist, Ports};
use webhook_delivery::{Keyring, WorkerConfig};

use email_outbox::{SenderConfig, SmtpUrl};

use crate::serve::{Config, EmailConfig};

/// Where the database is, and how much to log: every command reads these.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Every command")]
pub struct Common {
    /// The app pool's URL, as hardcount_app; may point at PgBouncer in transaction mode.
    /// `dev` starts a local Postgres when it is unset.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    pub database_url: Option<String>,
    /// A direct or session-mode connection for migrations, as the schema owner
    /// [default: DATABASE_URL].
    #[arg(
        long,
        env = "MIGRATION_DATABASE_URL",
        hide_env_values = true,
        global = true
    )]
    pub migration_database_url: Option<String>,
    /// The operator's URL, as hardcount_operator (reads leader_status, pauses and
    /// unpauses roles), for `hardcount leader …` [default: DATABASE_URL, which can
    /// read the status but not pause].
    #[arg(
        long,
        env = "HARDCOUNT_OPERATOR_DATABASE_URL",
        hide_env_values = true,
        global = true
    )]
    pub operator_database_url: Option<String>,
    /// The keys that seal webhook signing secrets: `<id>:<base64 of 32 bytes>`, more
    /// comma-separated during a key rotation (the first seals, all open); make one with
    /// `hardcount secrets generate-key`. Required by webhook_delivery once endpoints exist.
    #[arg(
        long,
        env = "HARDCOUNT_SECRETS_KEY",
        hide_env_values = true,
        global = true
    )]
    pub secrets_key: Option<String>,
    /// Log filter (tracing's EnvFilter syntax), e.g. `info,leader=debug`.
    #[arg(long = "log", env = "RUST_LOG", default_value = "info", global = true)]
    pub rust_log: String,
}

impl Common {
    pub fn database_url(&self) -> Result<String> {
        non_empty(&self.database_url)
            .context("DATABASE_URL is not set (the app pool's URL; it may point at PgBouncer)")
    }

    /// HARDCOUNT_OPERATOR_DATABASE_URL, else DATABASE_URL.
    pub fn operator_database_url(&self) -> Result<String> {
        non_empty(&self.operator_database_url)
            .or_else(|| non_empty(&self.database_url))
            .context("neither HARDCOUNT_OPERATOR_DATABASE_URL nor DATABASE_URL is set")
    }

    /// HARDCOUNT_SECRETS_KEY parsed, when set. The error names the variable
    /// and never shows a key.
    pub fn keyring(&self) -> Result<Option<Keyring>> {
        non_empty(&self.secrets_key)
            .map(|text| Keyring::parse(&text))
            .transpose()
            .map_err(|e| anyhow!("{e}"))
    }

    /// MIGRATION_DATABASE_URL, else DATABASE_URL.
    pub fn migration_database_url(&self) -> Result<String> {
        non_empty(&self.migration_database_url)
            .or_else(|| non_empty(&self.database_url))
            .context("neither MIGRATION_DATABASE_URL nor DATABASE_URL is set")
    }
}

pub const DEFAULT_HTTP_ADDR: &str = "0.0.0.0:8080";

/// What `serve` (and `dev`) run: roles, intervals, HTTP, webhook delivery.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeSettings {
    /// Where /healthz, /readyz and /metrics listen.
    #[arg(long, env = "HARDCOUNT_HTTP_ADDR", default_value = DEFAULT_HTTP_ADDR)]
    pub http_addr: String,
    /// Comma-separated roles this replica runs [default: every role this build implements].
    #[arg(long, env = "HARDCOUNT_ROLES")]
    pub roles: Option<String>,
    /// billing's tick interval (1s to 30d) [default: 1h].
    #[arg(long, env = "HARDCOUNT_BILLING_INTERVAL")]
    pub billing_interval: Option<String>,
    /// dunning's tick interval (1s to 30d) [default: 15m].
    #[arg(long, env = "HARDCOUNT_DUNNING_INTERVAL")]
    pub dunning_interval: Option<String>,
    /// Due dunning runs listed per batch (1 to 10000) [default: 500].
    #[arg(long, env = "HARDCOUNT_DUNNING_BATCH_SIZE")]
    pub dunning_batch_size: Option<String>,
    /// Dunning provider calls in flight at once (1 to 1000) [default: 32].
    #[arg(long, env = "HARDCOUNT_DUNNING_CONCURRENCY")]
    pub dunning_concurrency: Option<String>,
    /// How long a dunning tick lists batches (100ms to 1h) [default: 5m].
    #[arg(long, env = "HARDCOUNT_DUNNING_TICK_BUDGET")]
    pub dunning_tick_budget: Option<String>,
    /// webhook_outbox's tick interval (1s to 30d) [default: 1s].
    #[arg(long, env = "HARDCOUNT_WEBHOOK_OUTBOX_INTERVAL")]
    pub webhook_outbox_interval: Option<String>,
    /// email_outbox's tick interval (1s to 30d) [default: 1s].
    #[arg(long, env = "HARDCOUNT_EMAIL_OUTBOX_INTERVAL")]
    pub email_outbox_interval: Option<String>,
    /// webhook_delivery's tick interval (1s to 30d) [default: 1s].
    #[arg(long, env = "HARDCOUNT_WEBHOOK_DELIVERY_INTERVAL")]
    pub webhook_delivery_interval: Option<String>,
    /// CIDRs webhook delivery may reach although private, e.g. `10.1.0.0/16`; one covering
    /// 0.0.0.0/0, ::/0 or 169.254.169.254 is refused [default: none].
    #[arg(long, env = "HARDCOUNT_WEBHOOK_ALLOWLIST")]
    pub webhook_allowlist: Option<String>,
    /// Delays between delivery attempts, each 1s to 7d; dead after the last
    /// [default: 5s,5m,30m,2h,5h,10h,10h].
    #[arg(long, env = "HARDCOUNT_WEBHOOK_RETRY_SCHEDULE")]
    pub webhook_retry_schedule: Option<String>,
    /// One delivery attempt, connect to last byte (1s to 60s) [default: 15s].
    #[arg(long, env = "HARDCOUNT_WEBHOOK_TIMEOUT")]
    pub webhook_timeout: Option<String>,
    /// Webhook requests in flight at once, across tenants (1 to 1024) [default: 32].
    #[arg(long, env = "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT")]
    pub webhook_max_in_flight: Option<String>,
    /// Webhook requests in flight at once to one endpoint (1 to 1024) [default: 4].
    #[arg(long, env = "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT")]
    pub webhook_max_in_flight_per_endpoint: Option<String>,
    /// Webhook requests in flight at once for one tenant, across its endpoints (1 to
    /// 1024); at most half of HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT keeps one tenant's hung
    /// endpoints from taking the slots another tenant needs [default: 8].
    #[arg(long, env = "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_TENANT")]
    pub webhook_max_in_flight_per_tenant: Option<String>,
    /// Webhook requests in flight at once to one resolved address and port, across
    /// tenants (1 to 1024) [default: 16].
    #[arg(long, env = "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_DESTINATION")]
    pub webhook_max_in_flight_per_destination: Option<String>,
    /// Consecutive timeouts that open an endpoint's circuit breaker (1 to 1000)
    /// [default: 5].
    #[arg(long, env = "HARDCOUNT_WEBHOOK_BREAKER_TIMEOUTS")]
    pub webhook_breaker_timeouts: Option<String>,
    /// How long an open breaker holds the endpoint's deliveries before one trial
    /// (1s to 1h; doubled after each failed trial, up to 16 times it) [default: 30s].
    #[arg(long, env = "HARDCOUNT_WEBHOOK_BREAKER_COOLOFF")]
    pub webhook_breaker_cooloff: Option<String>,
    /// The lowest port a webhook may go to besides 80 and 443, which are always
    /// allowed (1 to 65535; 1 allows every port) [default: 1024].
    #[arg(long, env = "HARDCOUNT_WEBHOOK_MIN_PORT")]
    pub webhook_min_port: Option<String>,
    /// The SMTP server email_outbox sends through: `smtp://host:port` (plain),
    /// `smtp://host:port?tls=required` (STARTTLS), `smtps://host:port` (implicit
    /// TLS), with optional `user:password@`. Required when email_outbox runs.
    #[arg(long, env = "SMTP_URL", hide_env_values = true)]
    pub smtp_url: Option<String>,
    /// A PEM file of the CA that signed the SMTP server's certificate, for a
    /// private relay [default: the public web roots].
    #[arg(long, env = "HARDCOUNT_SMTP_CA_FILE")]
    pub smtp_ca_file: Option<PathBuf>,
    /// SMTP connections email_outbox may have open at once, in use or idle, and so
    /// sends in flight (1 to 256) [default: 16].
    #[arg(long, env = "HARDCOUNT_EMAIL_CONNECTIONS")]
    pub email_connections: Option<String>,
    /// A session-capable URL (Postgres directly, or PgBouncer's session-mode
    /// alias) on which webhook_outbox and webhook_delivery LISTEN, so a commit
    /// wakes them within milliseconds [default: unset, they poll at their interval].
    #[arg(long, env = "HARDCOUNT_LISTEN_URL", hide_env_values = true)]
    pub listen_url: Option<String>,
    /// The payment provider billing's auto-charge calls (Stripe's PaymentIntents
    /// API), e.g. `https://api.stripe.com`. Unset: the charge step is skipped.
    #[arg(long, env = "BILLING_PROVIDER_URL")]
    pub billing_provider_url: Option<String>,
    /// The provider's secret key (`sk_…`); never logged. Required with BILLING_PROVIDER_URL.
    #[arg(long, env = "BILLING_PROVIDER_SECRET_KEY", hide_env_values = true)]
    pub billing_provider_secret_key: Option<String>,
    /// This deployment's name in every payment idempotency key and charge metadata
    /// (a-z, 0-9, _; at most 32), so two installs on one provider account, or a
    /// restored copy, never replay each other's answers [default: default].
    #[arg(long, env = "HARDCOUNT_INSTANCE_ID")]
    pub instance_id: Option<String>,
    /// The sender of receipts and dunning mail: `billing@example.com` or
    /// `Example Billing <billing@example.com>`, checked at boot as the email
    /// outbox checks a sender; a tenant's `tenant_settings.email_from` overrides
    /// it [default: Billing <billing@example.com>].
    #[arg(long, env = "HARDCOUNT_EMAIL_FROM")]
    pub email_from: Option<String>,
    /// How long after an attempt's first send billing may send it again under the
    /// same idempotency key while looking up an unknown outcome (1m to 23h; the
    /// provider forgets keys after 24 h) [default: 12h].
    #[arg(long, env = "HARDCOUNT_BILLING_RESEND_WINDOW")]
    pub billing_resend_window: Option<String>,
}

/// `dev`: the service on a local Postgres with a demo tenant.
#[derive(Debug, Clone, clap::Args)]
pub struct DevSettings {
    /// Where `dev` keeps its Postgres cluster between runs.
    #[arg(long, env = "HARDCOUNT_DEV_DIR", default_value = ".hardcount-dev")]
    pub state_dir: PathBuf,
    /// How often the demo tenant enqueues a webhook event (100ms to 1h).
    #[arg(long, env = "HARDCOUNT_DEV_EVENT_EVERY", default_value = "2s")]
    pub event_every: String,
    #[command(flatten)]
    pub serve: ServeSettings,
}

impl DevSettings {
    pub fn event_every(&self) -> Result<Duration> {
        duration(
            "HARDCOUNT_DEV_EVENT_EVERY",
            &self.event_every,
            Duration::from_millis(100)..=Duration::from_secs(3600),
        )
    }
}

/// The bounds of a webhook retry delay: shorter hammers a failing receiver,
/// longer outlives any receiver's memory of the event.
pub const RETRY_DELAY: RangeInclusive<Duration> =
    Duration::from_secs(1)..=Duration::from_secs(7 * 86_400);

/// The bounds of one webhook attempt: a hung receiver must not hold a delivery
/// (and the tick's budget) for minutes.
pub const WEBHOOK_TIMEOUT: RangeInclusive<Duration> =
    Duration::from_secs(1)..=Duration::from_secs(60);

/// The bounds of each webhook concurrency setting.
pub const WEBHOOK_IN_FLIGHT: RangeInclusive<usize> = 1..=1024;

/// The bounds of the breaker's cool-off: shorter is no back-off at all,
/// longer (16 times, after failed trials) outlives the retry schedule.
pub const BREAKER_COOLOFF: RangeInclusive<Duration> =
    Duration::from_secs(1)..=Duration::from_secs(3600);

impl ServeSettings {
    pub fn http_addr(&self) -> Result<SocketAddr> {
        let addr = match self.http_addr.trim() {
            "" => DEFAULT_HTTP_ADDR,
            addr => addr,
        };
        addr.parse().map_err(|_| {
            anyhow!("HARDCOUNT_HTTP_ADDR={addr:?} is not an address like 0.0.0.0:8080")
        })
    }

    /// The serve configuration these settings describe, on `database_url`,
    /// opening webhook secrets with `secrets` (HARDCOUNT_SECRETS_KEY).
    pub fn config(&self, database_url: String, secrets: Option<Keyring>) -> Result<Config> {
        let roles = non_empty(&self.roles);
        let mut intervals = Vec::new();
        for (role, value) in [
            (Role::Billing, &self.billing_interval),
            (Role::Dunning, &self.dunning_interval),
            (Role::WebhookOutbox, &self.webhook_outbox_interval),
            (Role::EmailOutbox, &self.email_outbox_interval),
            (Role::WebhookDelivery, &self.webhook_delivery_interval),
        ] {
            if let Some(text) = non_empty(value) {
                let var = format!("HARDCOUNT_{}_INTERVAL", role.as_str().to_ascii_uppercase());
                // The scheduler owns the bounds (1s to 30d); this only reads the text.
                let any = Duration::from_millis(1)..=Duration::MAX;
                intervals.push((role, duration(&var, &text, any)?));
            }
        }
        let roles = scheduler::roles_from_env(roles.as_deref(), |role| {
            intervals.iter().find(|(r, _)| *r == role).map(|(_, d)| *d)
        })?;

        let mut webhook_delivery = WorkerConfig {
            secrets,
            ..WorkerConfig::default()
        };
        if let Some(text) = non_empty(&self.webhook_allowlist) {
            webhook_delivery.allowlist = Allowlist::parse(&text)
                .map_err(|e| anyhow!("HARDCOUNT_WEBHOOK_ALLOWLIST={text:?}: {e}"))?;
        }
        if let Some(text) = non_empty(&self.webhook_retry_schedule) {
            webhook_delivery.retry_schedule = retry_schedule(&text)?;
        }
        if let Some(text) = non_empty(&self.webhook_timeout) {
            let timeout = duration("HARDCOUNT_WEBHOOK_TIMEOUT", &text, WEBHOOK_TIMEOUT)?;
            webhook_delivery.request_timeout = timeout;
            webhook_delivery.connect_timeout = webhook_delivery.connect_timeout.min(timeout);
            webhook_delivery.tick_budget = webhook_delivery.tick_budget.max(timeout * 2);
        }
        let w = &mut webhook_delivery;
        for (var, value, slot) in [
            (
                "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT",
                &self.webhook_max_in_flight,
                &mut w.max_in_flight,
            ),
            (
                "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT",
                &self.webhook_max_in_flight_per_endpoint,
                &mut w.max_in_flight_per_endpoint,
            ),
            (
                "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_TENANT",
                &self.webhook_max_in_flight_per_tenant,
                &mut w.max_in_flight_per_tenant,
            ),
            (
                "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_DESTINATION",
                &self.webhook_max_in_flight_per_destination,
                &mut w.max_in_flight_per_destination,
            ),
        ] {
            if let Some(text) = non_empty(value) {
                *slot = whole(var, &text, WEBHOOK_IN_FLIGHT)?;
            }
        }
        if let Some(text) = non_empty(&self.webhook_breaker_timeouts) {
            let n = whole("HARDCOUNT_WEBHOOK_BREAKER_TIMEOUTS", &text, 1..=1000)?;
            w.breaker_timeouts = u32::try_from(n).unwrap_or(u32::MAX);
        }
        if let Some(text) = non_empty(&self.webhook_breaker_cooloff) {
            w.breaker_cooloff =
                duration("HARDCOUNT_WEBHOOK_BREAKER_COOLOFF", &text, BREAKER_COOLOFF)?;
        }
        if let Some(text) = non_empty(&self.webhook_min_port) {
            let port = whole("HARDCOUNT_WEBHOOK_MIN_PORT", &text, 1..=65535)?;
            w.ports = Ports {
                lowest_unprivileged: u16::try_from(port).unwrap_or(u16::MAX),
            };
        }
        webhook_delivery.validate()?;
        Ok(Config {
            database_url,
            roles_explicit: roles_explicit(&self.roles),
            roles,
            webhook_delivery,
            email: self.email()?,
            billing: self.billing()?,
            dunning: self.dunning()?,
            listen_url: self.listen_url()?,
        })
    }

    /// HARDCOUNT_LISTEN_URL, checked to be a Postgres URL; the error never
    /// echoes it (it may hold a password).
    fn listen_url(&self) -> Result<Option<String>> {
        let Some(url) = non_empty(&self.listen_url) else {
            return Ok(None);
        };
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            bail!("HARDCOUNT_LISTEN_URL must be a postgres:// or postgresql:// URL");
        }
        Ok(Some(url))
    }

    /// Billing's settings: the payment provider when BILLING_PROVIDER_URL is
    /// set. Errors name the variable and never echo the key.
    fn billing(&self) -> Result<billing::BillingConfig> {
        let mut config = billing::BillingConfig::default();
        if let Some(url) = non_empty(&self.billing_provider_url) {
            let key = non_empty(&self.billing_provider_secret_key).ok_or_else(|| {
                anyhow!("BILLING_PROVIDER_SECRET_KEY is required when BILLING_PROVIDER_URL is set")
            })?;
            let provider = billing::ProviderConfig::new(url, billing::SecretKey::new(key));
            provider
                .validate()
                .map_err(|e| anyhow!("BILLING_PROVIDER_URL / BILLING_PROVIDER_SECRET_KEY: {e}"))?;
            config.provider = Some(provider);
        }
        if let Some(id) = non_empty(&self.instance_id) {
            config.instance_id = id;
        }
        if let Some(w) = non_empty(&self.billing_resend_window) {
            config.resend_window = duration(
                "HARDCOUNT_BILLING_RESEND_WINDOW",
                &w,
                Duration::from_secs(60)..=Duration::from_secs(23 * 3600),
            )?;
        }
        if let Some(from) = self.email_from()? {
            config.email_from = from;
        }
        config.validate()?;
        Ok(config)
    }

    /// HARDCOUNT_EMAIL_FROM, when set: parsed as the outbox parses a sender
    /// (a lettre `Mailbox`), so a sender every email would be refused for is
    /// refused here, at boot, by the variable's name.
    fn email_from(&self) -> Result<Option<String>> {
        let Some(from) = non_empty(&self.email_from) else {
            return Ok(None);
        };
        email_outbox::check_sender(&from).map_err(|e| {
            anyhow!(
                "HARDCOUNT_EMAIL_FROM={from:?}: expected a sender like billing@example.com \
                 or Example Billing <billing@example.com> ({e})"
            )
        })?;
        Ok(Some(from))
    }

    /// Dunning's HARDCOUNT_DUNNING_* settings; a value out of the range
    /// `DunningConfig` accepts is refused by its variable's name.
    fn dunning(&self) -> Result<dunning::DunningConfig> {
        let mut d = dunning::DunningConfig::default();
        for (var, value, slot) in [
            (
                "HARDCOUNT_DUNNING_BATCH_SIZE",
                &self.dunning_batch_size,
                &mut d.batch_size,
            ),
            (
                "HARDCOUNT_DUNNING_CONCURRENCY",
                &self.dunning_concurrency,
                &mut d.concurrency,
            ),
        ] {
            if let Some(text) = non_empty(value) {
                *slot = text
                    .parse()
                    .map_err(|_| anyhow!("{var}={text:?}: expected a whole number"))?;
            }
        }
        if let Some(text) = non_empty(&self.dunning_tick_budget) {
            // DunningConfig owns the bounds; this only reads the text.
            let any = Duration::ZERO..=Duration::MAX;
            d.tick_budget = duration("HARDCOUNT_DUNNING_TICK_BUDGET", &text, any)?;
        }
        if let Some(from) = self.email_from()? {
            d.email_from = from;
        }
        d.validate().map_err(|e| match e {
            dunning::ConfigError::Count {
                field,
                value,
                min,
                max,
            } => anyhow!(
                "HARDCOUNT_DUNNING_{}={value}: must be from {min} to {max}",
                field.to_ascii_uppercase()
            ),
            dunning::ConfigError::Duration {
                field,
                value,
                min,
                max,
            } => {
                let show = |d: Duration| humantime::format_duration(d).to_string();
                anyhow!(
                    "HARDCOUNT_DUNNING_{}={}: must be from {} to {}",
                    field.to_ascii_uppercase(),
                    show(value),
                    show(min),
                    show(max)
                )
            }
            other => anyhow!(other),
        })?;
        Ok(d)
    }

    /// SMTP_URL and the email settings, when SMTP_URL is set. Errors name the
    /// variable and never echo the URL (it may hold a password).
    fn email(&self) -> Result<Option<EmailConfig>> {
        let Some(text) = non_empty(&self.smtp_url) else {
            return Ok(None);
        };
        let url = SmtpUrl::parse(&text).map_err(|e| anyhow!("SMTP_URL: {e}"))?;
        let ca_pem = match &self.smtp_ca_file {
            Some(path) if !path.as_os_str().is_empty() => {
                Some(std::fs::read(path).with_context(|| {
                    format!("HARDCOUNT_SMTP_CA_FILE={}: cannot read it", path.display())
                })?)
            }
            _ => None,
        };
        let mut sender = SenderConfig::default();
        if let Some(text) = non_empty(&self.email_connections) {
            sender.max_connections = text
                .parse::<u32>()
                .ok()
                .filter(|n| (1..=256).contains(n))
                .ok_or_else(|| {
                    anyhow!("HARDCOUNT_EMAIL_CONNECTIONS={text:?}: expected a whole number from 1 to 256")
                })?;
        }
        sender.validate()?;
        Ok(Some(EmailConfig {
            url,
            ca_pem,
            sender,
        }))
    }
}

fn roles_explicit(roles: &Option<String>) -> bool {
    non_empty(roles).is_some()
}

/// `HARDCOUNT_WEBHOOK_RETRY_SCHEDULE`: comma-separated delays, each within [`RETRY_DELAY`].
fn retry_schedule(text: &str) -> Result<RetrySchedule> {
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
fn whole(var: &str, text: &str, bounds: RangeInclusive<usize>) -> Result<usize> {
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
fn non_empty(value: &Option<String>) -> Option<String> {
    value
        .as_deref()
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Serve {
        #[command(flatten)]
        settings: ServeSettings,
    }

    /// The configuration `args` (flags standing in for the variables) give, or the refusal.
    fn check(args: &[&str]) -> Result<Config, String> {
        let serve = Serve::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        serve
            .settings
            .config("postgres://x".into(), None)
            .map_err(|e| format!("{e:#}"))
    }

    fn refusal(args: &[&str]) -> String {
        match check(args) {
            Ok(_) => panic!("{args:?} was accepted"),
            Err(e) => e,
        }
    }

    #[test]
    fn defaults_run_every_role_with_the_documented_intervals() {
        let config = check(&[]).unwrap();
        assert_eq!(config.roles.len(), 5);
        assert!(!config.roles_explicit);
        assert_eq!(config.roles[0].interval, Duration::from_secs(3600));
        assert_eq!(config.webhook_delivery, WorkerConfig::default());
    }

    #[test]
    fn durations_take_humantime_syntax() {
        let config = check(&[
            "--billing-interval",
            "2h 30m",
            "--webhook-retry-schedule",
            "1s, 5m,7days",
            "--webhook-timeout",
            "60s",
        ])
        .unwrap();
        assert_eq!(config.roles[0].interval, Duration::from_secs(9000));
        assert_eq!(
            config.webhook_delivery.retry_schedule.0,
            [1, 300, 7 * 86_400].map(Duration::from_secs).to_vec()
        );
        assert_eq!(
            config.webhook_delivery.request_timeout,
            Duration::from_secs(60)
        );
    }

    #[test]
    fn nonsense_is_refused_by_the_setting_s_name() {
        for (args, expected) in [
            (
                &["--billing-interval", "500ms"][..],
                "HARDCOUNT_BILLING_INTERVAL is 500ms: a role's interval must be from 1s",
            ),
            (
                &["--webhook-delivery-interval", "1 fortnight"],
                "HARDCOUNT_WEBHOOK_DELIVERY_INTERVAL=\"1 fortnight\": unknown time unit",
            ),
            (
                &["--dunning-interval", "31d"],
                "HARDCOUNT_DUNNING_INTERVAL is 2678400s",
            ),
            (
                &["--dunning-batch-size", "0"],
                "HARDCOUNT_DUNNING_BATCH_SIZE=0: must be from 1 to 10000",
            ),
            (
                &["--dunning-concurrency", "many"],
                "HARDCOUNT_DUNNING_CONCURRENCY=\"many\": expected a whole number",
            ),
            (
                &["--dunning-concurrency", "1001"],
                "HARDCOUNT_DUNNING_CONCURRENCY=1001: must be from 1 to 1000",
            ),
            (
                &["--dunning-tick-budget", "2h"],
                "HARDCOUNT_DUNNING_TICK_BUDGET=2h: must be from 100ms to 1h",
            ),
            (
                &["--webhook-retry-schedule", "5s,500ms"],
                "HARDCOUNT_WEBHOOK_RETRY_SCHEDULE=\"5s,500ms\": delay 2 is wrong: \
                 HARDCOUNT_WEBHOOK_RETRY_SCHEDULE=\"500ms\": must be at least 1s",
            ),
            (
                &["--webhook-retry-schedule", "5s,8d"],
                "\"8d\": must be at most 7days",
            ),
            (&["--webhook-retry-schedule", "5s,,5m"], "delay 2 is wrong"),
            (
                &["--webhook-timeout", "61s"],
                "HARDCOUNT_WEBHOOK_TIMEOUT=\"61s\": must be at most 1m",
            ),
            (
                &["--webhook-timeout", "0s"],
                "HARDCOUNT_WEBHOOK_TIMEOUT=\"0s\": must be at least 1s",
            ),
            (
                &["--webhook-allowlist", "10.0.0.0/99"],
                "HARDCOUNT_WEBHOOK_ALLOWLIST=\"10.0.0.0/99\"",
            ),
            (
                &["--webhook-allowlist", "10.0.0.0/8,0.0.0.0/0"],
                "HARDCOUNT_WEBHOOK_ALLOWLIST=\"10.0.0.0/8,0.0.0.0/0\": invalid SSRF allowlist entry `0.0.0.0/0`: re-opens every IPv4 address",
            ),
            (
                &["--webhook-allowlist", "169.254.169.254/32"],
                "cloud metadata address",
            ),
            (&["--roles", "billing,emails"], "unknown role \"emails\""),
            (
                &["--webhook-max-in-flight-per-tenant", "0"],
                "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_TENANT=\"0\": expected a whole number from 1 to 1024",
            ),
            (
                &["--webhook-max-in-flight", "many"],
                "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT=\"many\": expected a whole number",
            ),
            (
                &["--webhook-max-in-flight-per-destination", "2000"],
                "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_DESTINATION=\"2000\"",
            ),
            (
                &["--webhook-max-in-flight-per-endpoint", "1.5"],
                "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT=\"1.5\"",
            ),
            (
                &["--webhook-breaker-timeouts", "0"],
                "HARDCOUNT_WEBHOOK_BREAKER_TIMEOUTS=\"0\": expected a whole number from 1 to 1000",
            ),
            (
                &["--webhook-breaker-cooloff", "500ms"],
                "HARDCOUNT_WEBHOOK_BREAKER_COOLOFF=\"500ms\": must be at least 1s",
            ),
            (
                &["--webhook-breaker-cooloff", "2h"],
                "HARDCOUNT_WEBHOOK_BREAKER_COOLOFF=\"2h\": must be at most 1h",
            ),
            (
                &["--webhook-min-port", "0"],
                "HARDCOUNT_WEBHOOK_MIN_PORT=\"0\": expected a whole number from 1 to 65535",
            ),
            (
                &["--webhook-min-port", "https"],
                "HARDCOUNT_WEBHOOK_MIN_PORT=\"https\"",
            ),
        ] {
            let err = refusal(args);
            assert!(err.contains(expected), "{args:?}: {err}");
        }
    }

    #[test]
    fn the_fairness_breaker_and_port_settings_reach_the_worker_config() {
        let w = check(&[
            "--webhook-max-in-flight",
            "64",
            "--webhook-max-in-flight-per-endpoint",
            "2",
            "--webhook-max-in-flight-per-tenant",
            "16",
            "--webhook-max-in-flight-per-destination",
            "24",
            "--webhook-breaker-timeouts",
            "3",
            "--webhook-breaker-cooloff",
            "2m",
            "--webhook-min-port",
            "8000",
        ])
        .unwrap()
        .webhook_delivery;
        assert_eq!(
            (
                w.max_in_flight,
                w.max_in_flight_per_endpoint,
                w.max_in_flight_per_tenant,
                w.max_in_flight_per_destination,
                w.breaker_timeouts,
                w.breaker_cooloff,
            ),
            (64, 2, 16, 24, 3, Duration::from_secs(120))
        );
        assert!(w.ports.permits(443) && w.ports.permits(8000) && !w.ports.permits(7999));
        let every = check(&["--webhook-min-port", "1"])
            .unwrap()
            .webhook_delivery;
        assert!(every.ports.permits(22));
    }

    #[test]
    fn smtp_settings_are_checked_by_name_and_never_echo_the_password() {
        assert!(check(&[]).unwrap().email.is_none());
        let ok = check(&[
            "--smtp-url",
            "smtp://u:hunter2@127.0.0.1:2525",
            "--email-connections",
            "8",
        ])
        .unwrap();
        assert_eq!(ok.email.unwrap().sender.max_connections, 8);
        for (args, expected) in [
            (
                vec!["--smtp-url", "smtpx://u:hunter2@mail.example.com"],
                "SMTP_URL: SMTP_URL has the unknown scheme `smtpx`",
            ),
            (
                vec!["--smtp-url", "//u:hunter2@mail.example.com"],
                "SMTP_URL: SMTP_URL is not a URL",
            ),
            (
                vec![
                    "--smtp-url",
                    "smtp://mail.example.com",
                    "--email-connections",
                    "0",
                ],
                "HARDCOUNT_EMAIL_CONNECTIONS=\"0\"",
            ),
            (
                vec![
                    "--smtp-url",
                    "smtp://mail.example.com",
                    "--smtp-ca-file",
                    "/nonexistent/ca.pem",
                ],
                "HARDCOUNT_SMTP_CA_FILE=/nonexistent/ca.pem",
            ),
        ] {
            let err = refusal(&args);
            assert!(err.contains(expected), "{expected:?} not in {err:?}");
            assert!(!err.contains("hunter2"), "{err}");
        }
    }

    #[test]
    fn the_email_sender_reaches_billing_and_dunning_and_one_that_does_not_parse_is_refused() {
        let default = check(&[]).unwrap();
        assert_eq!(default.billing.email_from, "Billing <billing@example.com>");
        assert_eq!(default.dunning.email_from, default.billing.email_from);
        for from in [
            "receipts@shop.example",
            "Shop Receipts <receipts@shop.example>",
            "\"Shop, Inc.\" <receipts@shop.example>",
        ] {
            let config = check(&["--email-from", from]).unwrap();
            assert_eq!(config.billing.email_from, from);
            assert_eq!(config.dunning.email_from, from);
        }
        for from in [
            "receipts",
            "Shop <receipts@>",
            "receipts@shop.example>",
            "Shop <receipts@[192.0.2.1]>",
        ] {
            let err = refusal(&["--email-from", from]);
            assert!(
                err.starts_with(&format!("HARDCOUNT_EMAIL_FROM={from:?}: expected a sender")),
                "{from:?}: {err}"
            );
        }
    }

    #[test]
    fn a_blank_variable_means_unset() {
        let config = check(&["--roles", " ", "--webhook-timeout", ""]).unwrap();
        assert_eq!(config.roles.len(), 5);
        assert!(!config.roles_explicit);
        let bad = ServeSettings {
            http_addr: "8080".into(),
            ..Serve::try_parse_from(["serve"]).unwrap().settings
        };
        let err = bad.http_addr().unwrap_err().to_string();
        assert!(err.contains("HARDCOUNT_HTTP_ADDR=\"8080\""), "{err}");
    }

    #[test]
    fn the_listen_url_is_optional_and_a_non_postgres_one_is_refused_without_echo() {
        assert_eq!(check(&[]).unwrap().listen_url, None);
        let url = "postgres://app:pw@db:5432/hardcount";
        let config = check(&["--listen-url", url]).unwrap();
        assert_eq!(config.listen_url.as_deref(), Some(url));
        let err = check(&["--listen-url", "mysql://u:hunter2@db/x"])
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("HARDCOUNT_LISTEN_URL must be"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }
}
