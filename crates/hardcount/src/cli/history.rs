//! `hardcount leader history [ROLE] [--limit N] [--json]`: the lease history
//! (`leader_history`, migration 0027), newest term first, read as
//! `leader status` reads its view, over the operator's URL.

use anyhow::{Result, bail};
use db::Db;
use leader::{Role, Term};

use super::{parse_role, printable};

/// The arguments of `hardcount leader history`.
#[derive(Debug, clap::Args)]
pub struct HistoryArgs {
    /// Only this role's terms [default: every role's].
    #[arg(value_parser = parse_role)]
    pub role: Option<Role>,
    /// The most terms shown, newest first (1 to 10000).
    #[arg(long, default_value_t = 20,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(leader::store::HISTORY_LIMIT_MAX)))]
    pub limit: u32,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Print the terms `args` asks for, and any overlap between two terms of one
/// role among them (there should be none). An overlap is named on standard
/// error, with `--json` too, and fails the command, so a script that checks
/// the history sees it (docs/adr/0117).
pub async fn history(db: &Db, args: HistoryArgs) -> Result<()> {
    let terms = leader::store::history(db, args.role, args.limit).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&terms)?);
    } else {
        print_terms(&terms);
    }
    let overlaps = leader::overlapping_terms(&terms);
    for o in &overlaps {
        eprintln!(
            "OVERLAP: {} token {} began {:.3} s before token {} ended",
            printable(&o.role),
            o.later_token,
            o.overlap_us as f64 / 1e6,
            o.earlier_token
        );
    }
    if !overlaps.is_empty() {
        bail!(
            "{} overlap(s) between terms of one role: two replicas led it at once, \
             which the lease design rules out; keep these terms and report them",
            overlaps.len()
        );
    }
    Ok(())
}

fn print_terms(terms: &[Term]) {
    println!(
        "{:<17} {:>14} {:<36} {:<29} {:>9} {:<18} STATE",
        "ROLE", "TOKEN", "HOLDER", "ACQUIRED", "HELD", "END"
    );
    for t in terms {
        let held = (t.ended_epoch_us - t.acquired_epoch_us) as f64 / 1e6;
        println!(
            "{:<17} {:>14} {:<36} {:<29} {:>8.1}s {:<18} {}",
            printable(&t.role),
            t.token,
            printable(&t.holder_id),
            printable(&t.acquired_at),
            held,
            printable(t.tick_end.as_deref().unwrap_or("-")),
            printable(&t.state)
        );
    }
    println!("{} term(s)", terms.len());
}
