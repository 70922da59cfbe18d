//! The `hardcount` binary: parse the command line, own the signals, and hand
//! everything else to the library.
//!
//! The first SIGTERM, SIGINT or SIGHUP cancels the root token: `serve` stops
//! acquiring, running ticks are released as interrupted, and the process exits
//! 0; `dev` also stops the Postgres it started. A second signal exits at once
//! (130).

use std::process::ExitCode;

use clap::Parser;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

fn main() -> ExitCode {
    let cli = hardcount::Cli::parse();
    let telemetry = match hardcount::init_logging(&cli) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let shutdown = CancellationToken::new();
        on_signals(shutdown.clone())?;
        hardcount::execute(cli, shutdown).await
    });
    // Outside `block_on`: the exporter's client blocks while it sends the last spans.
    telemetry.shutdown();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Cancel `shutdown` on the first SIGTERM, SIGINT or SIGHUP; exit at once on
/// the second. SIGHUP (a closed terminal) would otherwise end the process
/// without unwinding, leaving `dev`'s Postgres running.
fn on_signals(shutdown: CancellationToken) -> anyhow::Result<()> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => info!("SIGTERM: stopping; running ticks are released as interrupted"),
            _ = int.recv() => info!("SIGINT: stopping; running ticks are released as interrupted"),
            _ = hup.recv() => info!("SIGHUP: stopping; running ticks are released as interrupted"),
        }
        shutdown.cancel();
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {}, _ = hup.recv() => {} }
        warn!("second signal: exiting at once");
        std::process::exit(130);
    });
    Ok(())
}
