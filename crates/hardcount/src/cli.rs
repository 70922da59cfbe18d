//! The command line: `migrate`, `serve`, `dev`, `leader
//! status|pause|unpause|history|clear-cooldown`, `tenants …`, `keys …`,
//! `secrets generate-key|rotate-key`, and the commands that are one database
//! call (`migrate`, `leader ...`, `secrets rotate-key`). `leader status --watch`
//! and `leader clear-cooldown` live in `cli/operate.rs`.

pub(crate) mod operate;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use db::Db;
use leader::Role;
use webhook_delivery::{Keyring, SECRETS_KEY_VAR};

use crate::settings::{Common, DevSettings, ServeSettings};

mod history;
mod tenants;

pub use tenants::{KeysCommand, TenantsCommand, keys_command, tenants_command};

#[derive(Debug, Parser)]
#[command(
    name = "hardcount",
    version,
    about = "Singleton background jobs for a billing platform, led through Postgres lease rows"
)]
pub struct Cli {
    #[command(flatten)]
    pub common: Common,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply pending migrations over MIGRATION_DATABASE_URL (or DATABASE_URL). Needs a direct or session-mode connection.
    Migrate,
    /// Run the roles named by HARDCOUNT_ROLES (default: all built ones) and serve /healthz, /readyz, /metrics.
    Serve(ServeSettings),
    /// Run the service with no configuration: a local Postgres (started and reused under
    /// HARDCOUNT_DEV_DIR unless DATABASE_URL is set), migrated, a demo tenant whose webhooks
    /// go to a receiver in this process. Ctrl-C stops everything it started.
    Dev(DevSettings),
    /// Inspect or steer leadership, over HARDCOUNT_OPERATOR_DATABASE_URL (or DATABASE_URL).
    Leader {
        #[command(subcommand)]
        command: LeaderCommand,
    },
    /// Payment attempts waiting for a person (docs/adr/0024), over
    /// HARDCOUNT_OPERATOR_DATABASE_URL (or DATABASE_URL), as hardcount_operator.
    Billing {
        #[command(subcommand)]
        command: BillingCommand,
    },
    /// Tenants of the tenant API, over HARDCOUNT_OPERATOR_DATABASE_URL (or DATABASE_URL).
    Tenants {
        #[command(subcommand)]
        command: TenantsCommand,
    },
    /// The tenant API's keys: made (shown once), listed, revoked; over
    /// HARDCOUNT_OPERATOR_DATABASE_URL (or DATABASE_URL).
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// The application key that seals webhook signing secrets (HARDCOUNT_SECRETS_KEY).
    Secrets {
        #[command(subcommand)]
        command: SecretsCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum SecretsCommand {
    /// Print a fresh key entry, `<id>:<base64 of 32 random bytes>`, for HARDCOUNT_SECRETS_KEY.
    GenerateKey {
        /// The key's id, stored beside every secret it seals (1 to 32 of A-Z a-z 0-9 _ -).
        #[arg(long, default_value = "k1")]
        id: String,
    },
    /// Reseal every webhook secret under the first key of HARDCOUNT_SECRETS_KEY (secrets
    /// still in clear, or sealed under an older key listed after it), as the schema owner
    /// over MIGRATION_DATABASE_URL (or DATABASE_URL). Safe to run again.
    RotateKey,
}

#[derive(Debug, Subcommand)]
pub enum LeaderCommand {
    /// Who leads what, since when, expires when, paused by whom (the leader_status view).
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Redraw the table every second until Ctrl-C.
        #[arg(long, conflicts_with = "json")]
        watch: bool,
    },
    /// Pause a role cluster-wide: its claims find nothing at once, its holder cancels its work at its next renewal, and no replica acquires it.
    Pause {
        #[arg(value_parser = parse_role)]
        role: Role,
        /// Why, for whoever reads leader_status next.
        #[arg(long)]
        reason: String,
        /// Who is pausing (default: cli@<hostname>).
        #[arg(long)]
        by: Option<String>,
    },
    /// Unpause a role; it is due at the next poll (a cooldown in not_before still holds).
    Unpause {
        #[arg(value_parser = parse_role)]
        role: Role,
    },
    /// Past and current terms (role, token, holder, acquired, held for, how the tick
    /// ended), newest first, from the leader_history view; names any overlap.
    History(history::HistoryArgs),
    /// As hardcount_operator: clear a role's cooldown (not_before, left by a lost, failed or
    /// panicked tick) after a fix, so it is due at the next poll; a paused role stays paused
    /// (unpause it too), a running tick goes on.
    ClearCooldown {
        #[arg(value_parser = parse_role)]
        role: Role,
    },
}

#[derive(Debug, Subcommand)]
pub enum BillingCommand {
    /// List the payment attempts that need review: the provider's record could not be
    /// read and the key may be forgotten, the answer did not parse, or the provider
    /// refused the request. No one charges their invoices until they are settled.
    Review {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Settle one attempt after checking the provider's dashboard: --paid (it charged;
    /// the invoice is paid and announced) or --failed (nothing was charged for it, or its
    /// charge counted for another invoice as the review's reason says; the invoice is
    /// chargeable again and dunning takes it). Records who and why.
    Settle {
        /// The attempt's id (the first column of `hardcount billing review`).
        attempt: i64,
        #[arg(long, conflicts_with = "failed", required_unless_present = "failed")]
        paid: bool,
        #[arg(long)]
        failed: bool,
        /// The provider's PaymentIntent (`pi_…`), when you found it.
        #[arg(long)]
        payment_intent: Option<String>,
        /// Why, as you checked it (kept on the attempt).
        #[arg(long)]
        reason: String,
        /// Who is settling (default: cli@<hostname>).
        #[arg(long)]
        by: Option<String>,
    },
}

/// `--by`, bounded and not blank (as the operator API requires), or
/// `cli@<hostname>` when not given.
fn operator_name(by: Option<String>) -> Result<String> {
    if by
        .as_ref()
        .is_some_and(|b| b.chars().count() > MAX_BY_CHARS)
    {
        bail!("--by is longer than {MAX_BY_CHARS} characters");
    }
    if by.as_ref().is_some_and(|b| b.trim().is_empty()) {
        bail!("--by is blank: name who acts, or leave it out for cli@<hostname>");
    }
    Ok(by.unwrap_or_else(|| {
        format!(
            "cli@{}",
            leader::holder_id().split(':').next().unwrap_or("unknown")
        )
    }))
}

/// `hardcount billing …`.
pub async fn billing_command(command: BillingCommand, database_url: &str) -> Result<()> {
    let db = Db::connect_lazy(database_url, 1)?;
    match command {
        BillingCommand::Review { json } => {
            let rows = billing::review::needing_review(&db)
                .await
                .map_err(billing_denied)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
                return Ok(());
            }
            println!(
                "{:>8} {:<12} {:>8} {:>4} {:<12} {:>12} {:<4} REASON",
                "ATTEMPT", "TENANT", "INVOICE", "SEQ", "STATUS", "AMOUNT", "CUR"
            );
            for r in &rows {
                println!(
                    "{:>8} {:<12} {:>8} {:>4} {:<12} {:>12} {:<4} {}",
                    r.attempt_id,
                    printable(&r.tenant_id),
                    r.invoice_id,
                    r.attempt_seq,
                    r.status,
                    r.amount,
                    printable(&r.currency),
                    printable(r.reason.as_deref().unwrap_or(""))
                );
            }
            println!("{} attempt(s) need review", rows.len());
        }
        BillingCommand::Settle {
            attempt,
            paid,
            failed: _,
            payment_intent,
            reason,
            by,
        } => {
            if reason.chars().count() > MAX_REASON_CHARS {
                bail!("--reason is longer than {MAX_REASON_CHARS} characters");
            }
            let by = operator_name(by)?;
            let how = if paid {
                billing::review::Settlement::Paid
            } else {
                billing::review::Settlement::Failed
            };
            let settled =
                billing::review::settle(&db, attempt, how, payment_intent.as_deref(), &by, &reason)
                    .await
                    .map_err(billing_denied)?;
            println!("attempt {attempt} settled {settled} (by {by}: {reason})");
        }
    }
    Ok(())
}

/// A refusal for want of a right names the operator role; any other error
/// (the function's own, by name) is shown as it is.
fn billing_denied(e: db::Error) -> anyhow::Error {
    let text = e.to_string();
    if text.contains("permission denied") {
        anyhow::anyhow!(
            "the database role cannot do this: `hardcount billing review|settle` needs the operator role \
             (hardcount_operator) through HARDCOUNT_OPERATOR_DATABASE_URL ({text})"
        )
    } else {
        anyhow::anyhow!(text)
    }
}

fn parse_role(s: &str) -> Result<Role, String> {
    s.parse::<Role>().map_err(|e| e.to_string())
}

/// Apply pending migrations over `url`; say what was done.
pub async fn migrate(url: &str) -> Result<()> {
    let report = db::migrate(url).await?;
    if report.applied.is_empty() {
        println!(
            "schema is current ({} migrations applied earlier); nothing to do",
            report.already
        );
    } else {
        println!(
            "applied {} migration(s): {:?}",
            report.applied.len(),
            report.applied
        );
    }
    Ok(())
}

/// The longest `--reason` kept (migration 0007 backs it with a constraint).
pub const MAX_REASON_CHARS: usize = 500;
/// The longest `--by` kept (migration 0007 backs it with a constraint).
pub const MAX_BY_CHARS: usize = 200;

/// `hardcount secrets …`.
pub async fn secrets_command(command: SecretsCommand, common: &Common) -> Result<()> {
    match command {
        SecretsCommand::GenerateKey { id } => {
            let entry = Keyring::generate_entry(&id).map_err(|e| anyhow::anyhow!("--id: {e}"))?;
            println!("{}", entry.as_str());
        }
        SecretsCommand::RotateKey => {
            let keyring = common.keyring()?.with_context(|| {
                format!("{SECRETS_KEY_VAR} is not set: it holds the key to seal with")
            })?;
            let owner = Db::connect_lazy(&common.migration_database_url()?, 1)?;
            let report = webhook_delivery::reseal_secrets(&owner, &keyring).await?;
            // The answers recorded under idempotency keys that show a secret
            // (docs/adr/0082): a replay after the old key is dropped opens them.
            let answers = api::scope::reseal_recorded_answers(&owner, &keyring).await?;
            owner.close().await;
            println!(
                "resealed the secrets of {} recorded API answer(s) under key {:?}",
                answers.resealed,
                keyring.current_id()
            );
            for (tenant, key) in &answers.skipped {
                println!(
                    "skipped the recorded answer of tenant {tenant:?} under idempotency key {key:?}: \
                     its secret opens with no key listed; it replays as an error until it expires"
                );
            }
            if report.skipped.is_empty() {
                println!(
                    "resealed the secrets of {} webhook endpoint(s) under key {:?} ({} expired previous secret(s) dropped); \
                     keys listed after it can now be removed from {SECRETS_KEY_VAR}",
                    report.resealed,
                    keyring.current_id(),
                    report.expired_dropped
                );
            } else {
                println!(
                    "resealed the secrets of {} webhook endpoint(s) under key {:?} ({} expired previous secret(s) dropped)",
                    report.resealed,
                    keyring.current_id(),
                    report.expired_dropped
                );
                for (endpoint, why) in &report.skipped {
                    println!("skipped webhook endpoint {endpoint}: {why}");
                }
                anyhow::bail!(
                    "{} webhook endpoint(s) skipped: their secrets do not open with the keys in \
                     {SECRETS_KEY_VAR}; list the key that sealed them after the current one and run \
                     this again (the keys after the current one must stay until then)",
                    report.skipped.len()
                );
            }
        }
    }
    Ok(())
}

/// What to say when the operator statement is refused for want of a right.
fn operator_denied(e: leader::store::StoreError) -> anyhow::Error {
    let denied =
        matches!(&e, leader::store::StoreError::Db(d) if d.code().as_deref() == Some("42501"));
    let e = anyhow::Error::new(e);
    if denied {
        e.context(
            "the database role cannot do this: `hardcount leader pause|unpause|clear-cooldown` needs the operator role \
             (hardcount_operator) through HARDCOUNT_OPERATOR_DATABASE_URL",
        )
    } else {
        e
    }
}

pub async fn leader_command(command: LeaderCommand, database_url: &str) -> Result<()> {
    let db = Db::connect_lazy(database_url, 1)?;
    match command {
        LeaderCommand::Status { json, watch: _ } => {
            let rows = leader::store::status(&db).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                print_status(&rows);
            }
        }
        LeaderCommand::Pause { role, reason, by } => {
            if reason.trim().is_empty() {
                bail!("--reason must say why the role is paused");
            }
            if reason.chars().count() > MAX_REASON_CHARS {
                bail!(
                    "--reason is {} characters; at most {MAX_REASON_CHARS} are kept",
                    reason.chars().count()
                );
            }
            let by = operator_name(by)?;
            leader::store::pause(&db, role, &by, &reason)
                .await
                .map_err(operator_denied)?;
            println!(
                "paused {role} (by {by}: {reason}); its claims find nothing now, and its holder cancels its work at its next renewal (within 3 s)"
            );
        }
        LeaderCommand::History(args) => history::history(&db, args).await?,
        LeaderCommand::Unpause { role } => {
            leader::store::unpause(&db, role)
                .await
                .map_err(operator_denied)?;
            println!(
                "unpaused {role}; it is due at the next poll unless a cooldown (not_before) holds"
            );
        }
        LeaderCommand::ClearCooldown { role } => operate::clear_cooldown(&db, role).await?,
    }
    Ok(())
}

fn print_status(rows: &[leader::LeaseStatus]) {
    println!(
        "{:<17} {:<13} {:<36} {:>12} {:<28} {:<22} {:<22} NOTE",
        "ROLE", "STATE", "HOLDER", "LAST TICK", "SCHEDULE", "LAST SLOT", "NEXT SLOT"
    );
    for r in rows {
        let age = r
            .last_tick_age_seconds
            .map(|s| format!("{s:.0}s ago"))
            .unwrap_or_else(|| "never".to_owned());
        let note = status_note(r);
        println!(
            "{:<17} {:<13} {:<36} {:>12} {:<28} {:<22} {:<22} {}",
            printable(&r.role),
            printable(&r.state),
            printable(r.holder_id.as_deref().unwrap_or("-")),
            age,
            printable(r.schedule.as_deref().unwrap_or("-")),
            printable(r.last_slot.as_deref().unwrap_or("-")),
            printable(r.next_slot.as_deref().unwrap_or("-")),
            printable(&note)
        );
    }
}

/// The NOTE column: who paused the role (the self-declared name and the
/// login, `paused_by_role`) and why, or until when it cools down. Raw: the
/// caller escapes it.
fn status_note(r: &leader::LeaseStatus) -> String {
    match (&r.paused_by, &r.pause_reason, &r.not_before) {
        (Some(by), reason, _) => format!(
            "paused by {by}: {} (login {})",
            reason.as_deref().unwrap_or(""),
            r.paused_by_role.as_deref().unwrap_or("unknown"),
        ),
        (None, _, Some(nb)) if r.state == "cooling_down" => format!("cooling down until {nb}"),
        _ => String::new(),
    }
}

/// `text` fit for a terminal: control characters (an escape sequence in a pause
/// reason would otherwise drive the operator's terminal) and the bidirectional
/// overrides that reorder what is shown are written as `\u{..}` escapes.
fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        let bidi = matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if c.is_control() || bidi {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{operator_name, printable, status_note};

    /// A blank `--by` is refused, as the operator API refuses one: a pause
    /// by nobody read "paused by : …" in `leader status`.
    #[test]
    fn a_blank_operator_name_is_refused() {
        for blank in ["", "  "] {
            let e = operator_name(Some(blank.into())).unwrap_err().to_string();
            assert!(e.contains("--by is blank"), "{e}");
        }
        assert_eq!(operator_name(Some("oncall".into())).unwrap(), "oncall");
        assert!(operator_name(None).unwrap().starts_with("cli@"));
    }

    /// `leader status` shows the login that paused beside the declared name,
    /// each escaped like the other fields.
    #[test]
    fn a_paused_role_shows_who_paused_it_and_the_login_escaped() {
        let row = leader::LeaseStatus {
            role: "billing".into(),
            state: "paused".into(),
            holder_id: None,
            holder_token: 0,
            acquired_at: None,
            expires_at: None,
            last_tick_ended_at: None,
            last_tick_holder: None,
            last_tick_age_seconds: None,
            not_before: None,
            paused_at: Some("2026-12-01 02:00:00+00".into()),
            paused_by: Some("cli@ops\u{1b}[2J".into()),
            pause_reason: Some("rotating SMTP key".into()),
            paused_by_role: Some("hardcount_operator\u{202e}".into()),
            schedule: None,
            last_slot: None,
            next_slot: None,
            next_slot_epoch: None,
        };
        assert_eq!(
            printable(&status_note(&row)),
            "paused by cli@ops\\u{1b}[2J: rotating SMTP key (login hardcount_operator\\u{202e})"
        );
    }

    #[test]
    fn printable_escapes_control_and_bidi_characters_only() {
        assert_eq!(printable("rotating SMTP key"), "rotating SMTP key");
        assert_eq!(printable("né 支付"), "né 支付");
        assert_eq!(printable("\u{1b}[2Jgone"), "\\u{1b}[2Jgone");
        assert_eq!(printable("a\nb\rc"), "a\\u{a}b\\u{d}c");
        assert_eq!(printable("x\u{202e}y"), "x\\u{202e}y");
    }
}
