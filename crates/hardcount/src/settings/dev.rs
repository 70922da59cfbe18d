//! `hardcount dev`'s own settings, beside the serve settings it flattens.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;

use super::{ServeSettings, duration};

const DEFAULT_STATE_DIR: &str = ".hardcount-dev";
const DEFAULT_EVENT_EVERY: &str = "2s";

/// `dev`: the service on a local Postgres with a demo tenant.
///
/// Both of its own settings are text with their default shown: clap takes a
/// variable set to the empty string as a value (and refuses an empty path),
/// while a blank variable means unset (README).
#[derive(Debug, Clone, clap::Args)]
pub struct DevSettings {
    /// Where `dev` keeps its Postgres cluster between runs.
    #[arg(long, env = "HARDCOUNT_DEV_DIR", default_value = DEFAULT_STATE_DIR)]
    pub state_dir: String,
    /// How often the demo tenant enqueues a webhook event (100ms to 1h).
    #[arg(long, env = "HARDCOUNT_DEV_EVENT_EVERY", default_value = DEFAULT_EVENT_EVERY)]
    pub event_every: String,
    #[command(flatten)]
    pub serve: ServeSettings,
}

impl DevSettings {
    pub fn state_dir(&self) -> PathBuf {
        PathBuf::from(or_default(&self.state_dir, DEFAULT_STATE_DIR))
    }

    pub fn event_every(&self) -> Result<Duration> {
        duration(
            "HARDCOUNT_DEV_EVENT_EVERY",
            or_default(&self.event_every, DEFAULT_EVENT_EVERY),
            Duration::from_millis(100)..=Duration::from_secs(3600),
        )
    }
}

fn or_default<'a>(text: &'a str, default: &'a str) -> &'a str {
    match text.trim() {
        "" => default,
        _ => text,
    }
}
