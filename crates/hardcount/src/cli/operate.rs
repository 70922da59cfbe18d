//! `hardcount leader clear-cooldown ROLE` and `hardcount leader status --watch`:
//! the two operator commands of the runbook (docs/runbook.md) that are more
//! than one call of the status table.
//!
//! `clear-cooldown` calls `leader_clear_cooldown` (migration 0028) as the
//! operator; `--watch` redraws the status table every second until Ctrl-C,
//! which ends it with exit status 0 (it is how a watch is stopped).

use std::io::Write;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use db::Db;
use leader::Role;
use tokio_util::sync::CancellationToken;

use super::{operator_denied, print_status, printable};

/// How often `--watch` redraws.
pub const WATCH_EVERY: Duration = Duration::from_secs(1);
/// A read that takes longer is shown as an error and tried again at the next
/// redraw, so a hung connection does not freeze the screen.
const READ_LIMIT: Duration = Duration::from_secs(5);
/// Moves the cursor home and clears the screen.
const CLEAR: &str = "\x1b[H\x1b[2J";

/// `hardcount leader clear-cooldown ROLE`. A paused role's cooldown is
/// cleared too and the role stays paused (docs/adr/0037): the output says so.
pub async fn clear_cooldown(db: &Db, role: Role) -> Result<()> {
    let cleared = leader::store::clear_cooldown(db, role)
        .await
        .map_err(operator_denied)?;
    let what = match cleared.left {
        Some(left) => format!(
            "cleared the cooldown of {role} ({}s were left)",
            left.as_secs_f64().round()
        ),
        None => format!("{role} had no cooldown"),
    };
    if cleared.paused {
        println!("{what}; it is still paused: `hardcount leader unpause {role}` to run it");
    } else {
        println!(
            "{what}; it is due at the next poll unless a tick is running or its interval \
             since the last completed tick has not passed"
        );
    }
    Ok(())
}

/// `hardcount leader status --watch`: the table, redrawn every [`WATCH_EVERY`]
/// until `shutdown` (Ctrl-C). The first read must work (a wrong URL or
/// credential is an error at once); a later failure is shown in the frame and
/// the next redraw tries again, since a watch is often kept open through the
/// very outage it is watching.
pub async fn watch(database_url: &str, shutdown: CancellationToken) -> Result<()> {
    let db = Db::connect_lazy(database_url, 1)?;
    let first = shutdown
        .run_until_cancelled(tokio::time::timeout(READ_LIMIT, leader::store::status(&db)))
        .await;
    let Some(first) = first else {
        return Ok(());
    };
    let mut rows = first
        .context("reading leader_status timed out")?
        .context("cannot read leader_status")?;
    let mut error: Option<String> = None;
    let mut ticker = tokio::time::interval(WATCH_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    loop {
        draw(&rows, error.as_deref());
        if shutdown.run_until_cancelled(ticker.tick()).await.is_none() {
            break;
        }
        let read = shutdown
            .run_until_cancelled(tokio::time::timeout(READ_LIMIT, leader::store::status(&db)))
            .await;
        match read {
            None => break,
            Some(Ok(Ok(new))) => {
                rows = new;
                error = None;
            }
            Some(Ok(Err(e))) => error = Some(format!("cannot read leader_status: {e}")),
            Some(Err(_)) => {
                error = Some(format!(
                    "reading leader_status took over {}s",
                    READ_LIMIT.as_secs()
                ))
            }
        }
    }
    db.close().await;
    Ok(())
}

/// One frame: clear, a header with the local time, the table (the last one
/// read when the latest read failed, under the error).
fn draw(rows: &[leader::LeaseStatus], error: Option<&str>) {
    print!("{CLEAR}");
    println!(
        "leader_status at {} (every {}s; Ctrl-C to stop)",
        humantime::format_rfc3339_seconds(SystemTime::now()),
        WATCH_EVERY.as_secs()
    );
    if let Some(e) = error {
        println!("{} (showing the last table read)", printable(e));
    }
    println!();
    print_status(rows);
    let _ = std::io::stdout().flush();
}
