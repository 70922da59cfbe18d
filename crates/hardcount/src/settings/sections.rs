//! The sections of [`ServeSettings`] that each feed one part of the serve
//! configuration: retention, the tenant and operator APIs, the database URLs
//! beside DATABASE_URL, billing, dunning and email. Each refuses a value by
//! its variable's name and never echoes a secret.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use email_outbox::{SenderConfig, SmtpUrl};
use webhook_delivery::Keyring;

use super::ServeSettings;
use super::bounds::RETENTION;
use super::parse::{database_url, duration, non_empty, whole};
use crate::secret::Secret;
use crate::serve::{ApiServe, Config, EmailConfig, OperatorServe, RetentionSettings};

impl ServeSettings {
    /// The HARDCOUNT_RETENTION_* settings (docs/adr/0040), each refused by
    /// its name outside [`RETENTION`].
    pub(super) fn retention(&self) -> Result<RetentionSettings> {
        let mut r = RetentionSettings::default();
        for (var, value, slot) in [
            (
                "HARDCOUNT_RETENTION_WEBHOOKS",
                &self.retention_webhooks,
                &mut r.webhooks,
            ),
            (
                "HARDCOUNT_RETENTION_EMAILS",
                &self.retention_emails,
                &mut r.emails,
            ),
            (
                "HARDCOUNT_RETENTION_PAYMENT_LOGS",
                &self.retention_payment_logs,
                &mut r.payment_logs,
            ),
            (
                "HARDCOUNT_RETENTION_LEASE_HISTORY",
                &self.retention_lease_history,
                &mut r.lease_history,
            ),
        ] {
            if let Some(text) = non_empty(value) {
                *slot = duration(var, &text, RETENTION)?;
            }
        }
        Ok(r)
    }

    /// The tenant API's settings, when HARDCOUNT_API_ADDR is set. Errors name
    /// the variable and never echo a URL.
    pub(super) fn api(&self, keyring: Option<Keyring>) -> Result<Option<ApiServe>> {
        let Some(addr) = non_empty(&self.api_addr) else {
            // The API's own settings without its address would be accepted and
            // do nothing: the tenant API silently not served.
            let set: Vec<&str> = [
                (
                    "HARDCOUNT_API_DATABASE_URL",
                    Secret::set(&self.api_database_url).is_some(),
                ),
                (
                    "HARDCOUNT_API_RATE_LIMIT",
                    non_empty(&self.api_rate_limit).is_some(),
                ),
                (
                    "HARDCOUNT_API_RATE_BURST",
                    non_empty(&self.api_rate_burst).is_some(),
                ),
                (
                    "HARDCOUNT_API_SHORT_PLANS",
                    non_empty(&self.api_short_plans).is_some(),
                ),
            ]
            .into_iter()
            .filter_map(|(var, set)| set.then_some(var))
            .collect();
            if !set.is_empty() {
                bail!(
                    "{} set but HARDCOUNT_API_ADDR is not: the tenant API is served only on \
                     that address (set it, or unset {})",
                    set.join(" and "),
                    if set.len() == 1 { "it" } else { "them" }
                );
            }
            return Ok(None);
        };
        let addr: SocketAddr = addr.parse().map_err(|_| {
            anyhow!("HARDCOUNT_API_ADDR={addr:?} is not an address like 0.0.0.0:8081")
        })?;
        let url = Secret::set(&self.api_database_url).ok_or_else(|| {
            anyhow!(
                "HARDCOUNT_API_DATABASE_URL is required with HARDCOUNT_API_ADDR: the tenant API's \
                 pool, as hardcount_api (row-level security holds it to each caller's tenant)"
            )
        })?;
        let database_url = database_url("HARDCOUNT_API_DATABASE_URL", url.to_owned())?;
        let mut config = api::ApiConfig::default();
        if let Some(text) = non_empty(&self.api_rate_limit) {
            let n = whole("HARDCOUNT_API_RATE_LIMIT", &text, 1..=100_000)?;
            config.rate_per_second = NonZeroU32::new(n as u32).unwrap_or(NonZeroU32::MIN);
        }
        if let Some(text) = non_empty(&self.api_rate_burst) {
            let n = whole("HARDCOUNT_API_RATE_BURST", &text, 1..=1_000_000)?;
            config.rate_burst = NonZeroU32::new(n as u32).unwrap_or(NonZeroU32::MIN);
        }
        if let Some(text) = non_empty(&self.api_short_plans) {
            config.short_plans = match text.trim() {
                "true" => true,
                "false" => false,
                _ => bail!("HARDCOUNT_API_SHORT_PLANS={text:?} is not true or false"),
            };
        }
        Ok(Some(ApiServe {
            addr,
            database_url: database_url.into(),
            keyring,
            config,
            operator: None,
        }))
    }

    /// The operator API's settings, when HARDCOUNT_OPERATOR_TOKEN is set: it
    /// is served on the tenant API's listener, over `operator_url`
    /// (HARDCOUNT_OPERATOR_DATABASE_URL, as hardcount_operator: DATABASE_URL's
    /// role can neither pause nor settle). Errors name the variables and
    /// never show the token or a URL.
    pub fn operator_api(&self, operator_url: &Option<Secret>) -> Result<Option<OperatorServe>> {
        let Some(token) = Secret::set(&self.operator_token) else {
            return Ok(None);
        };
        if non_empty(&self.api_addr).is_none() {
            bail!(
                "HARDCOUNT_OPERATOR_TOKEN is set but HARDCOUNT_API_ADDR is not: the operator API \
                 is served on the tenant API's listener"
            );
        }
        if token.chars().count() < api::operator::MIN_TOKEN_CHARS {
            bail!(
                "HARDCOUNT_OPERATOR_TOKEN is too short: at least {} characters (make one with \
                 `openssl rand -hex 32`)",
                api::operator::MIN_TOKEN_CHARS
            );
        }
        let url = Secret::set(operator_url).ok_or_else(|| {
            anyhow!(
                "HARDCOUNT_OPERATOR_DATABASE_URL is required with HARDCOUNT_OPERATOR_TOKEN: the \
                 operator API's pool, as hardcount_operator"
            )
        })?;
        let url = database_url("HARDCOUNT_OPERATOR_DATABASE_URL", url.to_owned())?;
        Ok(Some(OperatorServe {
            token: token.into(),
            database_url: url.into(),
        }))
    }

    /// Add the operator API ([`Self::operator_api`]) to `config`, as `serve`
    /// and `dev` both do. Checked even when there is no tenant API, so a
    /// token that would be ignored is refused.
    pub(crate) fn add_operator_api(
        &self,
        config: &mut Config,
        operator_url: &Option<Secret>,
    ) -> Result<()> {
        let operator = self.operator_api(operator_url)?;
        if let Some(api) = &mut config.api {
            api.operator = operator;
        }
        Ok(())
    }

    /// `HARDCOUNT_LEASE_DATABASE_URL`, checked as DATABASE_URL is; None when
    /// unset (the leases then share DATABASE_URL's path).
    pub(super) fn lease_database_url(&self) -> Result<Option<Secret>> {
        Secret::set(&self.lease_database_url)
            .map(|url| database_url("HARDCOUNT_LEASE_DATABASE_URL", url.to_owned()))
            .transpose()
            .map(|url| url.map(Secret::from))
    }

    /// HARDCOUNT_LISTEN_URL, checked to be a Postgres URL; the error never
    /// echoes it (it may hold a password).
    pub(super) fn listen_url(&self) -> Result<Option<Secret>> {
        let Some(url) = Secret::set(&self.listen_url) else {
            return Ok(None);
        };
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            bail!("HARDCOUNT_LISTEN_URL must be a postgres:// or postgresql:// URL");
        }
        database_url("HARDCOUNT_LISTEN_URL", url.to_owned()).map(|u| Some(Secret::from(u)))
    }

    /// Billing's settings: the payment provider when BILLING_PROVIDER_URL is
    /// set. Errors name the variable and never echo the key.
    pub(super) fn billing(&self) -> Result<billing::BillingConfig> {
        let mut config = billing::BillingConfig::default();
        if non_empty(&self.billing_provider_url).is_none()
            && Secret::set(&self.billing_provider_secret_key).is_some()
        {
            // Accepted, the key would leave auto-charge off with only an info
            // line: no invoice charged, and nothing pages for it.
            bail!(
                "BILLING_PROVIDER_SECRET_KEY is set but BILLING_PROVIDER_URL is not: auto-charge \
                 runs only with the provider's URL (e.g. https://api.stripe.com); set it, or \
                 unset the key"
            );
        }
        if let Some(url) = non_empty(&self.billing_provider_url) {
            let key = Secret::set(&self.billing_provider_secret_key).ok_or_else(|| {
                anyhow!("BILLING_PROVIDER_SECRET_KEY is required when BILLING_PROVIDER_URL is set")
            })?;
            let provider =
                billing::ProviderConfig::new(url, billing::SecretKey::new(key.to_owned()));
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
    pub(super) fn email_from(&self) -> Result<Option<String>> {
        let Some(from) = non_empty(&self.email_from) else {
            return Ok(None);
        };
        outbox::email::check_sender(&from).map_err(|e| {
            anyhow!(
                "HARDCOUNT_EMAIL_FROM={from:?}: expected a sender like billing@example.com \
                 or Example Billing <billing@example.com> ({e})"
            )
        })?;
        Ok(Some(from))
    }

    /// Dunning's HARDCOUNT_DUNNING_* settings; a value out of the range
    /// `DunningConfig` accepts is refused by its variable's name.
    pub(super) fn dunning(&self) -> Result<dunning::DunningConfig> {
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
    pub(super) fn email(&self) -> Result<Option<EmailConfig>> {
        let Some(text) = Secret::set(&self.smtp_url) else {
            return Ok(None);
        };
        let url = SmtpUrl::parse(text).map_err(|e| anyhow!("SMTP_URL: {e}"))?;
        let insecure_auth = match non_empty(&self.smtp_insecure_auth).as_deref() {
            None | Some("false") => false,
            Some("true") => true,
            Some(other) => {
                bail!("HARDCOUNT_SMTP_INSECURE_AUTH is {other:?}; expected true or false")
            }
        };
        // Credentials over a connection that may be plain (docs/security.md).
        if url.credentials_may_travel_in_clear() && !insecure_auth {
            bail!(
                "SMTP_URL has a user and password but its connection may be plain \
                 (smtp:// without tls=required, or tls=opportunistic): the password would \
                 cross the network in clear. Use smtps:// or ?tls=required, or set \
                 HARDCOUNT_SMTP_INSECURE_AUTH=true for a relay on loopback or a private link"
            );
        }
        // Text, not a path: clap refuses an empty path before a blank
        // variable can count as unset.
        let ca_pem = non_empty(&self.smtp_ca_file)
            .map(|path| {
                std::fs::read(&path)
                    .with_context(|| format!("HARDCOUNT_SMTP_CA_FILE={path}: cannot read it"))
            })
            .transpose()?;
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

/// A dunning retry batch starts only while a provider call's timeout is left
/// in the tick's budget (it keeps that in reserve), so a budget not above it
/// retried nothing: every tick ended "more work" at once, back to back, and
/// no alert saw it (`HardcountRoleStalled` waits out ticks that end so).
/// Refused below twice the call timeout, as webhook_delivery's budget is kept
/// at twice its request timeout.
pub(super) fn dunning_budget_holds_a_call(
    billing: &billing::BillingConfig,
    dunning: &dunning::DunningConfig,
) -> Result<()> {
    let Some(provider) = &billing.provider else {
        // No provider: dunning retries nothing, whatever its budget.
        return Ok(());
    };
    let floor = provider.timeout * 2;
    if dunning.tick_budget < floor {
        bail!(
            "HARDCOUNT_DUNNING_TICK_BUDGET={}: must be at least {} with a payment provider \
             (twice its call timeout, {}): a retry batch starts only while a call's timeout \
             is left in the budget, so one of the timeout or less retries nothing and a \
             shorter one loses most of each tick",
            show(dunning.tick_budget),
            show(floor),
            show(provider.timeout)
        );
    }
    Ok(())
}

/// A duration as the settings are written (`1m 30s`).
fn show(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}
