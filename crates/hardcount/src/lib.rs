//! `hardcount`: the service as a library, with a thin `main`.
//!
//! [`run`] serves a [`Config`] on a listener the caller bound until a
//! cancellation token the caller owns is cancelled, so tests start the real
//! service in-process on port 0. [`execute`] runs one command line; the binary's
//! `main` parses it, owns the signals (the first SIGTERM, SIGINT or SIGHUP
//! cancels, a second exits at once) and calls it.
//!
//! Modules: `settings` reads the environment (the only code that does, through
//! clap's `env` attributes so `--help` lists every variable); `cli` is the
//! command line and the one-call commands; `serve` is [`run`]; `http` the
//! routes; `dev` the zero-configuration demo (a local Postgres, a demo tenant);
//! [`roles`] the table that registers each role once (its settings, alerts and
//! series); `telemetry` the log lines and the optional trace export.

mod cli;
mod dev;
pub mod http;
pub mod roles;
pub mod secret;
mod serve;
mod settings;
pub mod telemetry;

use anyhow::{Context, Result};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use cli::{Cli, Command};
pub use serve::{Config, run};
pub use settings::{Common, DevSettings, ServeSettings};

/// Run one parsed command line until it finishes or `shutdown` is cancelled.
///
/// # Errors
///
/// Whatever the command refuses or fails on, with the setting or thing named.
pub async fn execute(cli: Cli, shutdown: CancellationToken) -> Result<()> {
    let common = cli.common;
    match cli.command {
        Command::Serve(settings) => {
            let mut config = settings.config(common.database_url()?, common.keyring()?)?;
            settings.add_operator_api(&mut config, &common.operator_database_url)?;
            let listener = bind(&settings).await?;
            run(config, listener, shutdown).await
        }
        Command::Dev(settings) => dev::run(&common, settings, shutdown).await,
        Command::Migrate => {
            until_cancelled(shutdown, cli::migrate(&common.migration_database_url()?)).await
        }
        Command::Leader { command } => {
            let url = common.operator_database_url()?;
            // A watch ends on Ctrl-C, which is its normal end (exit 0).
            if let cli::LeaderCommand::Status { watch: true, .. } = command {
                return cli::operate::watch(&url, shutdown).await;
            }
            until_cancelled(shutdown, cli::leader_command(command, &url)).await
        }
        Command::Billing { command } => {
            let url = common.operator_database_url()?;
            until_cancelled(shutdown, cli::billing_command(command, &url)).await
        }
        Command::Tenants { command } => {
            let url = common.operator_database_url()?;
            until_cancelled(shutdown, cli::tenants_command(command, &url)).await
        }
        Command::Keys { command } => {
            let url = common.operator_database_url()?;
            until_cancelled(shutdown, cli::keys_command(command, &url)).await
        }
        Command::Secrets { command } => {
            until_cancelled(shutdown, cli::secrets_command(command, &common)).await
        }
    }
}

/// Logs on stderr and, when configured, traces over OTLP ([`telemetry::init`]).
///
/// # Errors
/// A logging setting is refused (named; nothing is logged yet).
pub fn init_logging(cli: &Cli) -> Result<telemetry::Telemetry> {
    telemetry::init(cli)
}

/// Bind `HARDCOUNT_HTTP_ADDR`.
pub(crate) async fn bind(settings: &ServeSettings) -> Result<TcpListener> {
    let addr = settings.http_addr()?;
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} (HARDCOUNT_HTTP_ADDR)"))
}

async fn until_cancelled(
    shutdown: CancellationToken,
    command: impl Future<Output = Result<()>>,
) -> Result<()> {
    shutdown
        .run_until_cancelled(command)
        .await
        .unwrap_or_else(|| Err(anyhow::anyhow!("interrupted")))
}
