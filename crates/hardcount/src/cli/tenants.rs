//! `hardcount tenants create|list|settings` and `hardcount keys create|list|revoke`:
//! the tenant API's tenants and keys, as `hardcount_operator`
//! (docs/adr/0035). A key is printed once, when it is made.

use anyhow::Result;
use clap::Subcommand;
use db::Db;

use super::printable;

#[derive(Debug, Subcommand)]
pub enum TenantsCommand {
    /// Create a tenant of the tenant API.
    Create {
        /// Its id, as every tenant row names it: 1 to 63 of a-z 0-9 _ -, starting with a letter or digit.
        id: String,
        /// A name for people (default: the id).
        #[arg(long)]
        name: Option<String>,
        /// Where operational notices go (an endpoint turned off): a bare address such as ops@example.com.
        #[arg(long)]
        contact_email: Option<String>,
    },
    /// List the tenants.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show a tenant's settings, or change those given (the rest stay as they are).
    Settings {
        tenant: String,
        /// Its invoice numbers' prefix: 1 to 12 of A-Z 0-9 (default INV).
        #[arg(long)]
        invoice_prefix: Option<String>,
        /// Whether a cancel invoices the used part of the period (default true).
        #[arg(long)]
        invoice_on_cancel: Option<bool>,
        /// The sender of its receipts and dunning mail, e.g. "Acme Billing <billing@acme.example>".
        /// Its tenant-API emails may then come from any address at that domain: set only a
        /// domain the relay sends for (docs/adr/0143). Needs HARDCOUNT_EMAIL_FROM set as
        /// serve has it: the deployment's own domain, or another tenant's, is refused.
        #[arg(long, conflicts_with = "default_email_from")]
        email_from: Option<String>,
        /// Send its mail as HARDCOUNT_EMAIL_FROM again.
        #[arg(long)]
        default_email_from: bool,
        /// The page where its customers add or update a payment method, linked from the emails
        /// that ask for one (a declined charge, dunning's warnings, the ask for a payment
        /// method): an https address where {invoice} stands for the invoice's id, e.g.
        /// "https://acme.example/billing/{invoice}". Never a page that takes a payment.
        #[arg(long, conflicts_with = "no_payment_page_url")]
        payment_page_url: Option<String>,
        /// Link no payment page from its emails again.
        #[arg(long)]
        no_payment_page_url: bool,
        /// Print JSON instead of lines.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Make an API key for a tenant and print it once: it is stored only as a hash.
    Create {
        /// The tenant (`hardcount tenants create` first).
        tenant: String,
        /// What the key is for, shown by `keys list`.
        #[arg(long, default_value = "")]
        name: String,
    },
    /// List keys (prefix, tenant, when made, when revoked); never a key itself.
    List {
        /// Only this tenant's keys.
        #[arg(long)]
        tenant: Option<String>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key by its prefix (the 8 characters after `hc_`): its next request answers 401.
    Revoke { prefix: String },
}

fn operator_only(e: api::keys::KeysError) -> anyhow::Error {
    if let api::keys::KeysError::Db(d) = &e
        && d.code().as_deref() == Some("42501")
    {
        return anyhow::anyhow!(
            "the database role cannot do this: tenants and keys need the operator role \
             (hardcount_operator) through HARDCOUNT_OPERATOR_DATABASE_URL ({e})"
        );
    }
    anyhow::Error::new(e)
}

/// `hardcount tenants …`.
pub async fn tenants_command(command: TenantsCommand, database_url: &str) -> Result<()> {
    let db = Db::connect_lazy(database_url, 1)?;
    match command {
        TenantsCommand::Create {
            id,
            name,
            contact_email,
        } => {
            let name = name.unwrap_or_else(|| id.clone());
            let t = api::keys::create_tenant(&db, &id, &name, contact_email.as_deref())
                .await
                .map_err(operator_only)?;
            println!(
                "tenant {} created; make its API key with `hardcount keys create {}`",
                t.id, t.id
            );
        }
        TenantsCommand::List { json } => {
            let tenants = api::keys::list_tenants(&db).await.map_err(operator_only)?;
            if json {
                let rows: Vec<_> = tenants
                    .iter()
                    .map(|t| {
                        serde_json::json!({
                            "id": t.id, "name": t.name,
                            "contact_email": t.contact_email, "created_at": t.created_at,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&rows)?);
                return Ok(());
            }
            println!("{:<24} {:<25} {:<30} NAME", "TENANT", "CREATED", "CONTACT");
            for t in &tenants {
                println!(
                    "{:<24} {:<25} {:<30} {}",
                    t.id,
                    t.created_at.format("%Y-%m-%dT%H:%M:%SZ"),
                    printable(t.contact_email.as_deref().unwrap_or("-")),
                    printable(&t.name)
                );
            }
            println!("{} tenant(s)", tenants.len());
        }
        TenantsCommand::Settings {
            tenant,
            invoice_prefix,
            invoice_on_cancel,
            email_from,
            default_email_from,
            payment_page_url,
            no_payment_page_url,
            json,
        } => {
            let change = api::keys::SettingsChange {
                invoice_prefix,
                invoice_on_cancel,
                email_from: if default_email_from {
                    Some(None)
                } else {
                    email_from.map(Some)
                },
                payment_page_url: if no_payment_page_url {
                    Some(None)
                } else {
                    payment_page_url.map(Some)
                },
            };
            // The deployment's sender, as `hardcount serve` reads it, whose
            // domain no tenant's may have (docs/adr/0151): a sender is not
            // set without it, since the shipped default would check nothing.
            let platform_from = std::env::var("HARDCOUNT_EMAIL_FROM")
                .ok()
                .filter(|f| !f.trim().is_empty());
            let platform_from = match platform_from {
                Some(from) => from,
                None if matches!(change.email_from, Some(Some(_))) => anyhow::bail!(
                    "--email-from needs HARDCOUNT_EMAIL_FROM set to the deployment's sender, \
                     as hardcount serve has it, so that a tenant is never given the \
                     platform's own domain; nothing was changed"
                ),
                None => billing::BillingConfig::default().email_from,
            };
            let s = api::keys::set_tenant_settings(&db, &tenant, &change, &platform_from)
                .await
                .map_err(operator_only)?;
            if json {
                let row = serde_json::json!({
                    "tenant_id": s.tenant_id, "invoice_prefix": s.invoice_prefix,
                    "invoice_on_cancel": s.invoice_on_cancel, "email_from": s.email_from,
                    "payment_page_url": s.payment_page_url, "updated_at": s.updated_at,
                });
                println!("{}", serde_json::to_string_pretty(&row)?);
                return Ok(());
            }
            println!("tenant             {}", s.tenant_id);
            println!("invoice_prefix     {}", s.invoice_prefix);
            println!("invoice_on_cancel  {}", s.invoice_on_cancel);
            println!(
                "email_from         {}",
                s.email_from
                    .as_deref()
                    .map_or_else(|| "(HARDCOUNT_EMAIL_FROM)".to_owned(), printable)
            );
            println!(
                "payment_page_url   {}",
                s.payment_page_url
                    .as_deref()
                    .map_or_else(|| "(none)".to_owned(), printable)
            );
        }
    }
    Ok(())
}

/// `hardcount keys …`.
pub async fn keys_command(command: KeysCommand, database_url: &str) -> Result<()> {
    let db = Db::connect_lazy(database_url, 1)?;
    match command {
        KeysCommand::Create { tenant, name } => {
            let k = api::keys::create_key(&db, &tenant, &name)
                .await
                .map_err(operator_only)?;
            // The one time the key is shown: on stdout, alone on its line, so
            // `KEY=$(hardcount keys create t | head -1)` takes it.
            println!("{}", k.key);
            eprintln!(
                "API key {} for tenant {} made; it is shown once (above) and stored only as a hash",
                k.info.prefix, k.info.tenant_id
            );
        }
        KeysCommand::List { tenant, json } => {
            let keys = api::keys::list_keys(&db, tenant.as_deref())
                .await
                .map_err(operator_only)?;
            if json {
                let rows: Vec<_> = keys
                    .iter()
                    .map(|k| {
                        serde_json::json!({
                            "prefix": k.prefix, "tenant_id": k.tenant_id, "name": k.name,
                            "created_at": k.created_at, "revoked_at": k.revoked_at,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&rows)?);
                return Ok(());
            }
            println!(
                "{:<10} {:<24} {:<25} {:<25} NAME",
                "PREFIX", "TENANT", "CREATED", "REVOKED"
            );
            for k in &keys {
                println!(
                    "{:<10} {:<24} {:<25} {:<25} {}",
                    k.prefix,
                    k.tenant_id,
                    k.created_at.format("%Y-%m-%dT%H:%M:%SZ"),
                    k.revoked_at
                        .map(|t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string())
                        .unwrap_or_else(|| "-".into()),
                    printable(&k.name)
                );
            }
            println!("{} key(s)", keys.len());
        }
        KeysCommand::Revoke { prefix } => {
            let k = api::keys::revoke_key(&db, &prefix)
                .await
                .map_err(operator_only)?;
            println!(
                "API key {} of tenant {} revoked; its next request answers 401",
                k.prefix, k.tenant_id
            );
        }
    }
    Ok(())
}
