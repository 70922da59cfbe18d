//! `hardcount dev`: the service with no configuration.
//!
//! Without `DATABASE_URL` it starts (or reuses) a local Postgres 15 under the
//! state directory, migrates it as the owner, connects as `hardcount_app`,
//! seals webhook secrets with HARDCOUNT_SECRETS_KEY or a key it keeps in
//! `<state dir>/secrets-key`, seeds a demo tenant whose webhook endpoint is a receiver in this process
//! (127.0.0.1/32 allowlisted for the SSRF guard), starts an SMTP sink (aiosmtpd,
//! mail kept under the state directory) unless `SMTP_URL` is set, enqueues an
//! event and a receipt email every few seconds, and runs the roles through [`crate::run`], as `serve` does. Ctrl-C
//! stops all of it, including the Postgres it started; the data stays.

// Reached by the settings' tests too: what dev makes of blank intervals.
pub(crate) mod billing;
mod demo;
pub(crate) mod dunning;
mod postgres;
mod smtp;

use std::time::Instant;

use anyhow::{Context, Result};
use db::Db;
use tokio_util::sync::CancellationToken;
use webhook_delivery::Keyring;

use crate::secret::Secret;
use crate::settings::{Common, DevSettings};
use postgres::LocalPostgres;

pub async fn run(
    common: &Common,
    mut settings: DevSettings,
    shutdown: CancellationToken,
) -> Result<()> {
    let started = Instant::now();
    let event_every = settings.event_every()?;
    // The settings as given, before dev fills in its own (docs/adr/0141).
    let given = settings.serve.clone();
    // Declared first so it is dropped (the server stopped) after everything using it.
    let mut local = None;
    let (owner_url, app_url) = match Secret::set(&common.database_url) {
        Some(url) => (common.migration_database_url()?, url.to_owned()),
        _ => {
            let state_dir = absolute(&settings.state_dir())?;
            let pg = local.insert(LocalPostgres::start(&state_dir)?);
            println!(
                "Postgres 15 on 127.0.0.1:{} (data in {})",
                pg.port(),
                pg.data_dir().display()
            );
            (pg.owner_url(), pg.app_url())
        }
    };
    crate::cli::migrate(&owner_url)
        .await
        .context("migrating the dev database")?;
    // The key that seals the demo endpoint's secret: HARDCOUNT_SECRETS_KEY, or
    // one kept beside the cluster. Secrets stored in clear by an older dev run
    // are sealed with it now.
    let keyring = match common.keyring()? {
        Some(keyring) => keyring,
        None => dev_key(&absolute(&settings.state_dir())?)?,
    };
    // dev plays the API too: it seeds the demo endpoint as the owner.
    let owner = Db::connect_lazy(&owner_url, 1)?;
    let resealed = webhook_delivery::reseal_secrets(&owner, &keyring)
        .await
        .context("sealing the dev database's webhook secrets")?;
    for (endpoint, why) in &resealed.skipped {
        eprintln!("dev: webhook endpoint {endpoint} keeps its old secret: {why}");
    }

    let allow = "127.0.0.1/32";
    let serve = &mut settings.serve;
    serve.webhook_allowlist = Some(match serve.webhook_allowlist.take() {
        Some(list) if !list.trim().is_empty() => format!("{list},{allow}"),
        _ => allow.to_owned(),
    });
    // Declared here so the sink outlives the roles that send to it.
    let mut sink = None;
    if Secret::set(&serve.smtp_url).is_none() {
        let s = sink.insert(smtp::LocalSmtp::start(&absolute(&settings.state_dir())?)?);
        println!(
            "SMTP sink on {}: received mail lands in {}",
            db::redacted_url(&s.url()),
            s.inbox().display()
        );
        settings.serve.smtp_url = Some(s.url().into());
    }
    // Declared here so the provider outlives the roles that charge it; dunning
    // charges the provider billing is given, so billing's is set first.
    let billing_demo = billing::prepare(&mut settings.serve);
    let _provider = billing_demo.start_provider(&mut settings.serve).await?;
    let dunning_demo = dunning::prepare(&mut settings.serve);
    let serve = &mut settings.serve;
    // The tenant API on loopback, over the local cluster (README "Call it"),
    // unless HARDCOUNT_API_ADDR says otherwise.
    let api_help = match &local {
        Some(pg) => {
            if serve
                .api_addr
                .as_deref()
                .is_none_or(|a| a.trim().is_empty())
            {
                serve.api_addr = Some(DEV_API_ADDR.to_owned());
            }
            if Secret::set(&serve.api_database_url).is_none() {
                serve.api_database_url = Some(pg.role_url("hardcount_api").into());
            }
            serve
                .api_addr
                .clone()
                .map(|addr| (addr, pg.role_url("hardcount_operator")))
        }
        None => None,
    };
    let mut config = serve.config(app_url.clone(), Some(keyring.clone()))?;
    // The demo's own plan bills every two minutes; a developer's may too,
    // unless HARDCOUNT_API_SHORT_PLANS says otherwise (docs/adr/0152).
    if let Some(api) = &mut config.api
        && crate::settings::non_empty(&serve.api_short_plans).is_none()
    {
        api.config.short_plans = true;
    }
    warn_only_of_given(&mut config, &given, &app_url, &keyring);
    // The operator API as `serve` adds it, over the local cluster's
    // hardcount_operator unless HARDCOUNT_OPERATOR_DATABASE_URL says otherwise.
    let operator_url = match (&local, Secret::set(&common.operator_database_url)) {
        (Some(pg), None) => Some(pg.role_url("hardcount_operator").into()),
        _ => common.operator_database_url.clone(),
    };
    serve.add_operator_api(&mut config, &operator_url)?;
    let listener = crate::bind(serve).await?;
    let addr = listener.local_addr()?;

    let demo_stop = CancellationToken::new();
    let receiver = demo::start_receiver(demo_stop.clone()).await?;
    let db = Db::connect_lazy(&app_url, 2)?;
    // Seeding writes what tenants write (endpoints, plans, customers,
    // subscriptions, a dunning policy): the owner's, not the app's
    // (docs/adr/0031).
    demo::seed(&owner, &keyring, &receiver).await?;
    // The demo tenant can be given an API key (`hardcount keys create demo`).
    owner
        .execute(db::sql(
            "INSERT INTO tenants (id, name) VALUES ('demo', 'Demo') ON CONFLICT (id) DO NOTHING",
        ))
        .await
        .context("creating the demo tenant")?;
    billing_demo.seed(&owner, &keyring, &receiver).await?;
    dunning_demo.seed(&owner, &db, demo_stop.clone()).await?;
    owner.close().await;
    let trickle = tokio::spawn(demo::trickle(db.clone(), event_every, demo_stop.clone()));

    let host = if addr.ip().is_unspecified() {
        "127.0.0.1".to_owned()
    } else {
        addr.ip().to_string()
    };
    println!(
        "ready in {:.1}s: metrics at http://{host}:{}/metrics; an event every {}; Ctrl-C stops",
        started.elapsed().as_secs_f64(),
        addr.port(),
        humantime::format_duration(event_every)
    );
    if let Some((api, operator)) = &api_help {
        println!(
            "tenant API at http://{api} (its OpenAPI document at /openapi.json); an API key for \
             the demo tenant: HARDCOUNT_OPERATOR_DATABASE_URL={operator} hardcount keys create demo; \
             webhooks to {receiver} are printed here"
        );
    }
    let served = crate::run(config, listener, shutdown).await;
    demo_stop.cancel();
    let _ = trickle.await;
    db.close().await;
    drop(sink);
    drop(local);
    served
}

/// Leaves in `config.ignored` (the settings `serve` warns of, set for a role
/// this replica does not run) only those the `given` settings list too: the
/// allowlist, SMTP sink and demo intervals dev fills in are its own, made
/// whatever `HARDCOUNT_ROLES` says, and no one set them (docs/adr/0141).
/// Given settings that do not make a configuration alone leave the list as
/// it is.
fn warn_only_of_given(
    config: &mut crate::serve::Config,
    given: &crate::settings::ServeSettings,
    database_url: &str,
    keyring: &Keyring,
) {
    if let Ok(own) = given.config(database_url.to_owned(), Some(keyring.clone())) {
        config.ignored.retain(|entry| own.ignored.contains(entry));
    }
}

/// Where `dev` serves the tenant API when HARDCOUNT_API_ADDR is unset.
const DEV_API_ADDR: &str = "127.0.0.1:8081";

/// The dev key under `state_dir` (`secrets-key`, owner-only), made on first use.
fn dev_key(state_dir: &std::path::Path) -> Result<Keyring> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let path = state_dir.join("secrets-key");
    if !path.exists() {
        let entry = Keyring::generate_entry("dev").map_err(|e| anyhow::anyhow!("{e}"))?;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .and_then(|mut f| f.write_all(entry.as_bytes()))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let text = zeroize::Zeroizing::new(
        std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?,
    );
    Keyring::parse(text.trim()).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

fn absolute(path: &std::path::Path) -> Result<std::path::PathBuf> {
    std::fs::create_dir_all(path).with_context(|| format!("cannot create {}", path.display()))?;
    std::path::absolute(path).with_context(|| format!("{}", path.display()))
}

#[cfg(test)]
mod tests {
    use leader::Role;

    use super::*;
    use crate::settings::tests::serve_settings as settings;

    /// dev on a replica of billing alone fills in the allowlist, an SMTP
    /// sink's URL and the demo intervals, which are other roles' settings:
    /// `serve` warned of them as set for roles not run, though no one set
    /// them. Only a setting given is warned of. Mutation
    /// `dev_warns_of_its_own` (the list left as it is) fails here.
    #[test]
    fn dev_warns_only_of_settings_given_for_roles_not_run() {
        let url = "postgres://hardcount_app@127.0.0.1:1/none";
        let keyring = Keyring::parse(&Keyring::generate_entry("t").unwrap()).unwrap();
        let given = settings(&["--roles", "billing", "--email-connections", "4"]);
        let mut filled = given.clone();
        filled.webhook_allowlist = Some("127.0.0.1/32".to_owned());
        filled.smtp_url = Some("smtp://127.0.0.1:2525".into());
        filled.dunning_interval = Some("5s".to_owned());
        let mut config = filled
            .config(url.to_owned(), Some(keyring.clone()))
            .unwrap();
        assert_eq!(
            config.ignored.len(),
            4,
            "the fills are listed before: {:?}",
            config.ignored
        );
        warn_only_of_given(&mut config, &given, url, &keyring);
        assert_eq!(
            config.ignored,
            vec![("HARDCOUNT_EMAIL_CONNECTIONS".to_owned(), Role::EmailOutbox)]
        );
    }
}
