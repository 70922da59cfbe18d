//! The settings every command reads: where the database is, the secrets key,
//! how much to log and where traces go.

use anyhow::{Context, Result, anyhow};
use webhook_delivery::Keyring;

use super::parse::{database_url, own_or_database_url};
use crate::secret::Secret;

/// Where the database is, and how much to log: every command reads these.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Every command")]
pub struct Common {
    /// The app pool's URL, as hardcount_app; may point at PgBouncer in transaction mode.
    /// `dev` starts a local Postgres when it is unset.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    pub database_url: Option<Secret>,
    /// A direct or session-mode connection for migrations, as the schema owner
    /// [default: DATABASE_URL].
    #[arg(
        long,
        env = "MIGRATION_DATABASE_URL",
        hide_env_values = true,
        global = true
    )]
    pub migration_database_url: Option<Secret>,
    /// The operator's URL, as hardcount_operator (reads leader_status, pauses and
    /// unpauses roles), for `hardcount leader …` [default: DATABASE_URL, which can
    /// read the status but not pause].
    #[arg(
        long,
        env = "HARDCOUNT_OPERATOR_DATABASE_URL",
        hide_env_values = true,
        global = true
    )]
    pub operator_database_url: Option<Secret>,
    /// The keys that seal webhook signing secrets: `<id>:<base64 of 32 bytes>`, more
    /// comma-separated during a key rotation (the first seals, all open); make one with
    /// `hardcount secrets generate-key`. Required by webhook_delivery once endpoints exist.
    #[arg(
        long,
        env = "HARDCOUNT_SECRETS_KEY",
        hide_env_values = true,
        global = true
    )]
    pub secrets_key: Option<Secret>,
    /// Log filter (tracing's EnvFilter syntax), e.g. `info,leader=debug`.
    #[arg(long = "log", env = "RUST_LOG", default_value = "info", global = true)]
    pub rust_log: String,
    /// `text` (for people) or `json` (one object per line, for a log pipeline).
    #[arg(
        long,
        env = "HARDCOUNT_LOG_FORMAT",
        default_value = "text",
        global = true
    )]
    pub log_format: String,
    /// An OTLP/HTTP collector's base URL (`http://collector:4318`): the `tick`
    /// spans and the events in them are exported to `<it>/v1/traces` as protobuf
    /// (docs/adr/0039) [default: unset, nothing is exported].
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_ENDPOINT",
        hide_env_values = true,
        global = true
    )]
    pub otlp_endpoint: Option<Secret>,
}

impl Common {
    pub fn database_url(&self) -> Result<String> {
        let url = Secret::set(&self.database_url)
            .map(str::to_owned)
            .context("DATABASE_URL is not set (the app pool's URL; it may point at PgBouncer)")?;
        database_url("DATABASE_URL", url)
    }

    /// HARDCOUNT_OPERATOR_DATABASE_URL, else DATABASE_URL.
    pub fn operator_database_url(&self) -> Result<String> {
        let var = "HARDCOUNT_OPERATOR_DATABASE_URL";
        own_or_database_url(var, &self.operator_database_url, &self.database_url)
    }

    /// HARDCOUNT_SECRETS_KEY parsed, when set. The error names the variable
    /// and never shows a key.
    pub fn keyring(&self) -> Result<Option<Keyring>> {
        Secret::set(&self.secrets_key)
            .map(Keyring::parse)
            .transpose()
            .map_err(|e| anyhow!("{e}"))
    }

    /// MIGRATION_DATABASE_URL, else DATABASE_URL.
    pub fn migration_database_url(&self) -> Result<String> {
        let var = "MIGRATION_DATABASE_URL";
        own_or_database_url(var, &self.migration_database_url, &self.database_url)
    }
}
