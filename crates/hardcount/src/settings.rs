//! Every setting the process reads from its environment, in one place.
//!
//! Each variable is a clap argument with an `env` attribute, so `hardcount serve
//! --help` lists them all with their defaults. The values arrive as text and are
//! checked here, so a refusal names the variable and the value it was given.
//! Durations have one syntax everywhere: humantime's (`500ms`, `30s`, `5m`,
//! `1h`, `2h 30m`, `1d`).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Result, anyhow};
use leader::Role;
use webhook_delivery::ssrf::{Allowlist, Ports};
use webhook_delivery::{Keyring, WorkerConfig};

use crate::secret::Secret;
use crate::serve::Config;

mod bounds;
mod common;
mod dev;
mod parse;
mod sections;
#[cfg(test)]
pub(crate) mod tests;

pub use bounds::{BREAKER_COOLOFF, DISABLE_AFTER, RETRY_DELAY, WEBHOOK_IN_FLIGHT, WEBHOOK_TIMEOUT};
pub use common::Common;
pub use dev::DevSettings;
pub use parse::duration;
pub(crate) use parse::non_empty;
use parse::{retry_schedule, roles_explicit, whole};

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
    /// billing's cron schedule instead of its interval: six fields with seconds
    /// (`0 5 * * * *`), five (second 0) or an alias (`@hourly`), optionally
    /// after `CRON_TZ=<IANA zone> ` [default: UTC]; due on the database clock
    /// (docs/adr/0043) [default: unset, the interval].
    #[arg(long, env = "HARDCOUNT_BILLING_SCHEDULE")]
    pub billing_schedule: Option<String>,
    /// dunning's cron schedule instead of its interval, as HARDCOUNT_BILLING_SCHEDULE
    /// [default: unset, the interval].
    #[arg(long, env = "HARDCOUNT_DUNNING_SCHEDULE")]
    pub dunning_schedule: Option<String>,
    /// webhook_outbox's cron schedule instead of its interval, as HARDCOUNT_BILLING_SCHEDULE
    /// [default: unset, the interval].
    #[arg(long, env = "HARDCOUNT_WEBHOOK_OUTBOX_SCHEDULE")]
    pub webhook_outbox_schedule: Option<String>,
    /// email_outbox's cron schedule instead of its interval, as HARDCOUNT_BILLING_SCHEDULE
    /// [default: unset, the interval].
    #[arg(long, env = "HARDCOUNT_EMAIL_OUTBOX_SCHEDULE")]
    pub email_outbox_schedule: Option<String>,
    /// webhook_delivery's cron schedule instead of its interval, as HARDCOUNT_BILLING_SCHEDULE
    /// [default: unset, the interval].
    #[arg(long, env = "HARDCOUNT_WEBHOOK_DELIVERY_SCHEDULE")]
    pub webhook_delivery_schedule: Option<String>,
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
    /// How long every attempt to an endpoint fails before the endpoint is turned
    /// off and its tenant told (1h to 90d, or `off`) [default: 5d].
    #[arg(long, env = "HARDCOUNT_WEBHOOK_DISABLE_AFTER")]
    pub webhook_disable_after: Option<String>,
    /// The sender of the email that tells a tenant's contact one of its endpoints
    /// was turned off, like notices@example.com [default: none: the tenant is told
    /// by the `endpoint.disabled` event only].
    #[arg(long, env = "HARDCOUNT_WEBHOOK_NOTICE_FROM")]
    pub webhook_notice_from: Option<String>,
    /// The SMTP server email_outbox sends through: `smtp://host:port` (plain),
    /// `smtp://host:port?tls=required` (STARTTLS), `smtps://host:port` (implicit
    /// TLS), with optional `user:password@`. Required when email_outbox runs.
    #[arg(long, env = "SMTP_URL", hide_env_values = true)]
    pub smtp_url: Option<Secret>,
    /// A PEM file of the CA that signed the SMTP server's certificate, for a
    /// private relay [default: the public web roots].
    #[arg(long, env = "HARDCOUNT_SMTP_CA_FILE")]
    pub smtp_ca_file: Option<String>,
    /// `true` to allow SMTP_URL's user and password over a connection that
    /// may be plain (`smtp://` without `tls=required`, or `tls=opportunistic`),
    /// for a relay on loopback or a private link; anything else refuses such a
    /// URL at boot [default: false].
    #[arg(long, env = "HARDCOUNT_SMTP_INSECURE_AUTH")]
    pub smtp_insecure_auth: Option<String>,
    /// SMTP connections email_outbox may have open at once, in use or idle, and so
    /// sends in flight (1 to 256) [default: 16].
    #[arg(long, env = "HARDCOUNT_EMAIL_CONNECTIONS")]
    pub email_connections: Option<String>,
    /// A session-capable URL (Postgres directly, or PgBouncer's session-mode
    /// alias) on which webhook_outbox and webhook_delivery LISTEN, so a commit
    /// wakes them within milliseconds [default: unset, they poll at their interval].
    #[arg(long, env = "HARDCOUNT_LISTEN_URL", hide_env_values = true)]
    pub listen_url: Option<Secret>,
    /// `standard` (a 10 s lease renewed every 3 s) or `fast` (3 s, renewed
    /// every second: takeovers in about 3 s for three times the lease
    /// statements; docs/adr/0047) [default: standard].
    #[arg(long, env = "HARDCOUNT_LEASE_PROFILE")]
    pub lease_profile: Option<String>,
    /// The lease statements' URL (ACQUIRE, RENEW, RELEASE), as hardcount_app: PgBouncer's
    /// lease alias, a server pool the job statements cannot fill (deploy/pgbouncer,
    /// docs/adr/0036) [default: DATABASE_URL].
    #[arg(long, env = "HARDCOUNT_LEASE_DATABASE_URL", hide_env_values = true)]
    pub lease_database_url: Option<Secret>,
    /// Where the tenant API listens, e.g. `0.0.0.0:8081` [default: unset, no API].
    #[arg(long, env = "HARDCOUNT_API_ADDR")]
    pub api_addr: Option<String>,
    /// The tenant API's pool, as `hardcount_api` (it may point at PgBouncer in
    /// transaction mode). Required with HARDCOUNT_API_ADDR.
    #[arg(long, env = "HARDCOUNT_API_DATABASE_URL", hide_env_values = true)]
    pub api_database_url: Option<Secret>,
    /// Requests per second per API key (1 to 100000) [default: 1000].
    #[arg(long, env = "HARDCOUNT_API_RATE_LIMIT")]
    pub api_rate_limit: Option<String>,
    /// Requests a key may send at once above its rate (1 to 1000000) [default: 2000].
    #[arg(long, env = "HARDCOUNT_API_RATE_BURST")]
    pub api_rate_burst: Option<String>,
    /// Whether tenants may create plans billed every minute or hour, for demos
    /// (true or false) [default: false; `hardcount dev`: true].
    #[arg(long, env = "HARDCOUNT_API_SHORT_PLANS")]
    pub api_short_plans: Option<String>,
    /// The bearer token of the operator API under `/operator/v1` on the tenant API's
    /// listener (at least 32 characters; needs HARDCOUNT_API_ADDR and
    /// HARDCOUNT_OPERATOR_DATABASE_URL) [default: unset, no operator API].
    #[arg(long, env = "HARDCOUNT_OPERATOR_TOKEN", hide_env_values = true)]
    pub operator_token: Option<Secret>,
    /// The payment provider billing's auto-charge calls (Stripe's PaymentIntents
    /// API), e.g. `https://api.stripe.com`. Unset: the charge step is skipped.
    #[arg(long, env = "BILLING_PROVIDER_URL")]
    pub billing_provider_url: Option<String>,
    /// The provider's secret key (`sk_…`); never logged. Required with BILLING_PROVIDER_URL.
    #[arg(long, env = "BILLING_PROVIDER_SECRET_KEY", hide_env_values = true)]
    pub billing_provider_secret_key: Option<Secret>,
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
    /// How long delivered and dead webhook deliveries (with their attempts)
    /// and dispatched events are kept before the webhook roles delete them
    /// (1h to 3650d) [default: 30d].
    #[arg(long, env = "HARDCOUNT_RETENTION_WEBHOOKS")]
    pub retention_webhooks: Option<String>,
    /// How long sent and failed emails are kept before email_outbox deletes
    /// them (1h to 3650d) [default: 30d].
    #[arg(long, env = "HARDCOUNT_RETENTION_EMAILS")]
    pub retention_emails: Option<String>,
    /// How long the provider's raw answer is kept on a resolved payment attempt
    /// before billing clears it; the attempt itself is never deleted (1h to
    /// 3650d) [default: 30d].
    #[arg(long, env = "HARDCOUNT_RETENTION_PAYMENT_LOGS")]
    pub retention_payment_logs: Option<String>,
    /// How long each role keeps its ended lease terms (leader_terms, `hardcount
    /// leader history`) before deleting them (1h to 3650d) [default: 30d].
    #[arg(long, env = "HARDCOUNT_RETENTION_LEASE_HISTORY")]
    pub retention_lease_history: Option<String>,
}

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

    /// The text of `role`'s interval variable (its name is the role's entry in
    /// `roles::REGISTRY`).
    fn interval(&self, role: Role) -> &Option<String> {
        match role {
            Role::Billing => &self.billing_interval,
            Role::Dunning => &self.dunning_interval,
            Role::WebhookOutbox => &self.webhook_outbox_interval,
            Role::EmailOutbox => &self.email_outbox_interval,
            Role::WebhookDelivery => &self.webhook_delivery_interval,
        }
    }

    /// The text of `role`'s schedule variable (`HARDCOUNT_<ROLE>_SCHEDULE`).
    fn schedule(&self, role: Role) -> &Option<String> {
        match role {
            Role::Billing => &self.billing_schedule,
            Role::Dunning => &self.dunning_schedule,
            Role::WebhookOutbox => &self.webhook_outbox_schedule,
            Role::EmailOutbox => &self.email_outbox_schedule,
            Role::WebhookDelivery => &self.webhook_delivery_schedule,
        }
    }

    /// The serve configuration these settings describe, on `database_url`,
    /// opening webhook secrets with `secrets` (HARDCOUNT_SECRETS_KEY).
    pub fn config(&self, database_url: String, secrets: Option<Keyring>) -> Result<Config> {
        let secrets_for_api = secrets.clone();
        let roles = non_empty(&self.roles);
        let mut intervals = Vec::new();
        for entry in crate::roles::REGISTRY {
            if let Some(text) = non_empty(self.interval(entry.role)) {
                // The scheduler owns the bounds (1s to 30d) and names them; this
                // only reads the text (a bound of its own here answered `0s`
                // with "at least 1ms").
                let any = Duration::ZERO..=Duration::MAX;
                intervals.push((entry.role, duration(entry.interval, &text, any)?));
            }
        }
        let mut roles = scheduler::roles_from_env(roles.as_deref(), |role| {
            intervals.iter().find(|(r, _)| *r == role).map(|(_, d)| *d)
        })?;
        // An interval or schedule set for a role this replica does not run
        // does nothing here: `serve` says so at startup (a replica's schedule
        // set on the wrong replica was silently ignored).
        let mut ignored = Vec::new();
        for entry in crate::roles::REGISTRY {
            if roles.iter().any(|rc| rc.role == entry.role) {
                continue;
            }
            if non_empty(self.interval(entry.role)).is_some() {
                ignored.push((entry.interval.to_owned(), entry.role));
            }
            if non_empty(self.schedule(entry.role)).is_some() {
                ignored.push((
                    format!(
                        "HARDCOUNT_{}_SCHEDULE",
                        entry.role.as_str().to_ascii_uppercase()
                    ),
                    entry.role,
                ));
            }
        }
        // A role's own settings do nothing on a replica that does not run it.
        // The SMTP settings are email_outbox's (a companion set without
        // SMTP_URL was accepted without a word). The webhook allowlist and
        // lowest port are also the API's guard on endpoint URLs (below), so
        // they are listed only where the API is off too.
        let set = |value: &Option<String>| non_empty(value).is_some();
        let api_off = non_empty(&self.api_addr).is_none();
        list_unless_run(
            &mut ignored,
            &roles,
            Role::EmailOutbox,
            &[
                ("SMTP_URL", Secret::set(&self.smtp_url).is_some()),
                ("HARDCOUNT_SMTP_CA_FILE", set(&self.smtp_ca_file)),
                (
                    "HARDCOUNT_SMTP_INSECURE_AUTH",
                    set(&self.smtp_insecure_auth),
                ),
                ("HARDCOUNT_EMAIL_CONNECTIONS", set(&self.email_connections)),
            ],
        );
        list_unless_run(
            &mut ignored,
            &roles,
            Role::WebhookDelivery,
            &[
                (
                    "HARDCOUNT_WEBHOOK_ALLOWLIST",
                    api_off && set(&self.webhook_allowlist),
                ),
                (
                    "HARDCOUNT_WEBHOOK_RETRY_SCHEDULE",
                    set(&self.webhook_retry_schedule),
                ),
                ("HARDCOUNT_WEBHOOK_TIMEOUT", set(&self.webhook_timeout)),
                (
                    "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT",
                    set(&self.webhook_max_in_flight),
                ),
                (
                    "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT",
                    set(&self.webhook_max_in_flight_per_endpoint),
                ),
                (
                    "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_TENANT",
                    set(&self.webhook_max_in_flight_per_tenant),
                ),
                (
                    "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_DESTINATION",
                    set(&self.webhook_max_in_flight_per_destination),
                ),
                (
                    "HARDCOUNT_WEBHOOK_BREAKER_TIMEOUTS",
                    set(&self.webhook_breaker_timeouts),
                ),
                (
                    "HARDCOUNT_WEBHOOK_BREAKER_COOLOFF",
                    set(&self.webhook_breaker_cooloff),
                ),
                (
                    "HARDCOUNT_WEBHOOK_MIN_PORT",
                    api_off && set(&self.webhook_min_port),
                ),
                (
                    "HARDCOUNT_WEBHOOK_DISABLE_AFTER",
                    set(&self.webhook_disable_after),
                ),
                (
                    "HARDCOUNT_WEBHOOK_NOTICE_FROM",
                    set(&self.webhook_notice_from),
                ),
            ],
        );
        list_unless_run(
            &mut ignored,
            &roles,
            Role::Dunning,
            &[
                (
                    "HARDCOUNT_DUNNING_BATCH_SIZE",
                    set(&self.dunning_batch_size),
                ),
                (
                    "HARDCOUNT_DUNNING_CONCURRENCY",
                    set(&self.dunning_concurrency),
                ),
                (
                    "HARDCOUNT_DUNNING_TICK_BUDGET",
                    set(&self.dunning_tick_budget),
                ),
            ],
        );
        for entry in crate::roles::REGISTRY {
            let Some(text) = non_empty(self.schedule(entry.role)) else {
                continue;
            };
            let var = format!(
                "HARDCOUNT_{}_SCHEDULE",
                entry.role.as_str().to_ascii_uppercase()
            );
            // The replica's clock only starts the "does it ever fire" search;
            // slots are due on the database clock (docs/adr/0043).
            let cron = leader::CronSchedule::parse(&text, None, chrono::Utc::now())
                .map_err(|e| anyhow!("{var}: {e}"))?;
            if let Some(rc) = roles.iter_mut().find(|rc| rc.role == entry.role) {
                rc.cron = Some(cron);
            }
        }

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
        if let Some(text) = non_empty(&self.webhook_disable_after) {
            w.disable_after = if text.trim().eq_ignore_ascii_case("off") {
                None
            } else {
                Some(duration(
                    "HARDCOUNT_WEBHOOK_DISABLE_AFTER",
                    &text,
                    DISABLE_AFTER,
                )?)
            };
        }
        if let Some(from) = non_empty(&self.webhook_notice_from) {
            outbox::email::check_sender(&from).map_err(|e| {
                anyhow!(
                    "HARDCOUNT_WEBHOOK_NOTICE_FROM={from:?}: expected a sender like \
                     notices@example.com or Example <notices@example.com> ({e})"
                )
            })?;
            w.notice_from = Some(from);
        }
        webhook_delivery.validate()?;
        // The API refuses endpoint URLs the delivery role's guard would.
        let api = self.api(secrets_for_api)?.map(|mut a| {
            a.config.webhook_allowlist = webhook_delivery.allowlist.clone();
            a.config.webhook_ports = webhook_delivery.ports;
            a
        });
        let (billing, dunning) = (self.billing()?, self.dunning()?);
        sections::dunning_budget_holds_a_call(&billing, &dunning)?;
        Ok(Config {
            database_url: database_url.into(),
            roles_explicit: roles_explicit(&self.roles),
            roles,
            ignored,
            webhook_delivery,
            email: self.email()?,
            billing,
            dunning,
            listen_url: self.listen_url()?,
            lease_database_url: self.lease_database_url()?,
            api,
            retention: self.retention()?,
            timing: parse::lease_profile(self.lease_profile.as_deref())?,
        })
    }
}

/// Lists each of `role`'s settings that `vars` marks set (variable, set) in
/// `ignored`, where this replica's `roles` leave `role` out: `serve` warns of
/// them at startup, naming the role (docs/adr/0120, 0140).
fn list_unless_run(
    ignored: &mut Vec<(String, Role)>,
    roles: &[scheduler::RoleConfig],
    role: Role,
    vars: &[(&str, bool)],
) {
    if roles.iter().any(|rc| rc.role == role) {
        return;
    }
    ignored.extend(
        vars.iter()
            .filter(|(_, set)| *set)
            .map(|(var, _)| ((*var).to_owned(), role)),
    );
}
