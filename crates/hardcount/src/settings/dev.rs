//! `hardcount dev`'s own settings, beside the serve settings it flattens.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;

use super::{ServeSettings, duration};

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
