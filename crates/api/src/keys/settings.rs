//! A tenant's settings, read and set by an operator (`hardcount tenants
//! settings`, `/operator/v1/tenants/{id}/settings`; docs/adr/0148): its
//! invoice numbers' prefix, whether a cancel invoices the used part of the
//! period, the sender of its mail, and the payment page its asking emails
//! link to (docs/adr/0150). The sender's domain is one every
//! tenant email may then leave from (docs/adr/0143), so it is the operator's
//! to set, never the tenant's.

use chrono::{DateTime, Utc};
use db::{Db, Row as _};

use tracing::info;

use super::KeysError;
use crate::routes::emails::sender_domain;

/// A tenant's settings; the defaults for a tenant that never set any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantSettings {
    pub tenant_id: String,
    pub invoice_prefix: String,
    pub invoice_on_cancel: bool,
    /// `None`: `HARDCOUNT_EMAIL_FROM`.
    pub email_from: Option<String>,
    /// Where its customers pay an invoice or change their payment method, a
    /// template in which `{invoice}` stands for the invoice's id; `None`: the
    /// emails name no page.
    pub payment_page_url: Option<String>,
    /// `None`: never set.
    pub updated_at: Option<DateTime<Utc>>,
}

/// What to change; `None` leaves a setting as it is.
#[derive(Debug, Clone, Default)]
pub struct SettingsChange {
    pub invoice_prefix: Option<String>,
    pub invoice_on_cancel: Option<bool>,
    /// `Some(None)`: back to `HARDCOUNT_EMAIL_FROM`.
    pub email_from: Option<Option<String>>,
    /// `Some(None)`: no page.
    pub payment_page_url: Option<Option<String>>,
}

impl SettingsChange {
    fn is_empty(&self) -> bool {
        self.invoice_prefix.is_none()
            && self.invoice_on_cancel.is_none()
            && self.email_from.is_none()
            && self.payment_page_url.is_none()
    }
}

const READ: &str = "SELECT t.id AS tenant_id, \
            COALESCE(s.invoice_prefix, 'INV') AS invoice_prefix, \
            COALESCE(s.invoice_on_cancel, true) AS invoice_on_cancel, \
            s.email_from, s.payment_page_url, s.updated_at \
     FROM tenants t LEFT JOIN tenant_settings s ON s.tenant_id = t.id \
     WHERE t.id = $1";

/// `tenant`'s settings.
///
/// # Errors
/// [`KeysError::NoTenant`], a database error.
pub async fn tenant_settings(db: &Db, tenant: &str) -> Result<TenantSettings, KeysError> {
    let row = db
        .fetch_optional(db::sql(READ).bind(tenant.to_owned()))
        .await?
        .ok_or_else(|| KeysError::NoTenant(tenant.to_owned()))?;
    settings(&row)
}

/// Change `tenant`'s settings as `change` says, in one transaction; the
/// settings after it. `platform_from` is the deployment's sender
/// (`HARDCOUNT_EMAIL_FROM`), whose domain no tenant's sender may have.
///
/// # Errors
/// [`KeysError::BadSetting`] naming the setting refused (nothing changed),
/// [`KeysError::NoTenant`], a database error.
pub async fn set_tenant_settings(
    db: &Db,
    tenant: &str,
    change: &SettingsChange,
    platform_from: &str,
) -> Result<TenantSettings, KeysError> {
    if let Some(p) = &change.invoice_prefix
        && !prefix_valid(p)
    {
        return Err(KeysError::BadSetting {
            param: "invoice_prefix",
            message: format!(
                "invoice_prefix {p:?} is not 1 to 12 of A-Z and 0-9; nothing was changed"
            ),
        });
    }
    if let Some(Some(page)) = &change.payment_page_url
        && let Err(why) = page_valid(page)
    {
        return Err(KeysError::BadSetting {
            param: "payment_page_url",
            message: format!(
                "payment_page_url {why}: give an https address such as \
                 https://acme.example/pay/{{invoice}}, where {{invoice}} stands for the \
                 invoice's id, or null for none; nothing was changed"
            ),
        });
    }
    let domain = match &change.email_from {
        Some(Some(from)) => match outbox::email::mailbox("email_from", from) {
            Ok(m) => Some(sender_domain(m.email.domain())),
            Err(e) => {
                return Err(KeysError::BadSetting {
                    param: "email_from",
                    message: format!(
                        "{e}: give an address such as billing@acme.example or \
                         Acme Billing <billing@acme.example>; nothing was changed"
                    ),
                });
            }
        },
        _ => None,
    };
    // A tenant sends from any address at its sender's domain (docs/adr/0143):
    // at the deployment's own, it could send as the platform.
    let platform = outbox::email::mailbox("HARDCOUNT_EMAIL_FROM", platform_from)
        .ok()
        .map(|m| sender_domain(m.email.domain()));
    if let Some(domain) = &domain
        && platform.as_ref() == Some(domain)
    {
        return Err(KeysError::BadSetting {
            param: "email_from",
            message: format!(
                "{domain} is the deployment's own sender domain (HARDCOUNT_EMAIL_FROM), and \
                 a tenant may send from any address at its own, so it could send as the \
                 platform: give the tenant a domain of its own, or null to send as \
                 HARDCOUNT_EMAIL_FROM itself; nothing was changed"
            ),
        });
    }
    if change.is_empty() {
        return tenant_settings(db, tenant).await;
    }
    // Bounded, so a stuck holder of the sender lock (below) fails a change
    // by its timeout instead of hanging it.
    let mut tx = db.begin_with_timeout(SETTINGS_TIMEOUT).await?;
    // Two tenants at one domain could each send in the other's name. Sender
    // changes wait for each other (one lock for all: they are rare), so two
    // at the same domain cannot both find it free.
    if let Some(domain) = &domain {
        tx.execute(db::sql(
            "SELECT pg_advisory_xact_lock(hashtextextended('hardcount tenant sender domains', 0))",
        ))
        .await?;
        let others = tx
            .fetch_all(
                db::sql(
                    "SELECT tenant_id, email_from FROM tenant_settings \
                     WHERE tenant_id <> $1 AND email_from IS NOT NULL ORDER BY tenant_id",
                )
                .bind(tenant.to_owned()),
            )
            .await?;
        for r in others {
            let (other, from): (String, String) = (
                r.try_get("tenant_id").map_err(db::Error::Sql)?,
                r.try_get("email_from").map_err(db::Error::Sql)?,
            );
            let taken = outbox::email::mailbox("email_from", &from)
                .is_ok_and(|m| sender_domain(m.email.domain()) == *domain);
            if taken {
                return Err(KeysError::BadSetting {
                    param: "email_from",
                    message: format!(
                        "{domain} is tenant {other}'s sender domain, and a tenant may send \
                         from any address at its own: give each tenant a domain of its own; \
                         nothing was changed"
                    ),
                });
            }
        }
    }
    let before = tx
        .fetch_optional(
            db::sql("SELECT email_from FROM tenant_settings WHERE tenant_id = $1")
                .bind(tenant.to_owned()),
        )
        .await?
        .map(|r| r.try_get::<Option<String>, _>("email_from"))
        .transpose()
        .map_err(db::Error::Sql)?
        .flatten();
    // The row, with the table's defaults, if the tenant has none yet.
    tx.execute(
        db::sql(
            "INSERT INTO tenant_settings (tenant_id) SELECT id FROM tenants WHERE id = $1 \
             ON CONFLICT (tenant_id) DO NOTHING",
        )
        .bind(tenant.to_owned()),
    )
    .await?;
    let (set_from, from) = match &change.email_from {
        Some(from) => (true, from.clone()),
        None => (false, None),
    };
    let (set_page, page) = match &change.payment_page_url {
        Some(page) => (true, page.clone()),
        None => (false, None),
    };
    let changed = tx
        .execute(
            db::sql(
                "UPDATE tenant_settings SET \
                        invoice_prefix = COALESCE($2, invoice_prefix), \
                        invoice_on_cancel = COALESCE($3, invoice_on_cancel), \
                        email_from = CASE WHEN $4 THEN $5 ELSE email_from END, \
                        payment_page_url = CASE WHEN $6 THEN $7 ELSE payment_page_url END, \
                        updated_at = now() \
                 WHERE tenant_id = $1",
            )
            .bind(tenant.to_owned())
            .bind(change.invoice_prefix.clone())
            .bind(change.invoice_on_cancel)
            .bind(set_from)
            .bind(from)
            .bind(set_page)
            .bind(page),
        )
        .await
        .map_err(|e| match e.constraint() {
            // The column's rule is stricter than the parser in a few corners
            // (migrations/0022_email_addresses.sql).
            Some("tenant_settings_email_from_valid" | "tenant_settings_email_from_length") => {
                KeysError::BadSetting {
                    param: "email_from",
                    message: "the tenant's sender (the one given, or the one stored when \
                              none is given) is not an address the outbox can send from: \
                              give a new email_from, or null for HARDCOUNT_EMAIL_FROM, with \
                              the change; nothing was changed"
                        .to_owned(),
                }
            }
            // Only a writer that skipped `page_valid` meets it.
            Some("tenant_settings_payment_page_url_shape") => KeysError::BadSetting {
                param: "payment_page_url",
                message: "payment_page_url is not an https address of at most 2,000 \
                          characters; nothing was changed"
                    .to_owned(),
            },
            _ => KeysError::Db(e),
        })?;
    if changed != 1 {
        return Err(KeysError::NoTenant(tenant.to_owned()));
    }
    let row = tx.fetch_one(db::sql(READ).bind(tenant.to_owned())).await?;
    tx.commit().await?;
    let after = settings(&row)?;
    if after.email_from != before {
        // Who may send as what is worth a line of its own (the operator's
        // login is the connection's, `hardcount_operator`).
        info!(
            tenant,
            before = before.as_deref().unwrap_or("(HARDCOUNT_EMAIL_FROM)"),
            after = after
                .email_from
                .as_deref()
                .unwrap_or("(HARDCOUNT_EMAIL_FROM)"),
            "a tenant's sender changed: its API email may come from any address at its domain"
        );
    }
    Ok(after)
}

/// How long a settings change may wait on a statement, the sender lock among
/// them.
const SETTINGS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

/// The longest payment page migration 0058 stores.
const PAGE_MAX: usize = 2000;

/// Why `page` is not a payment page template: an https address with a host,
/// no credentials, no space or control character, at most [`PAGE_MAX`]
/// characters (migration 0058's `tenant_settings_payment_page_url_shape`,
/// which holds any other writer), that parses with its `{invoice}` filled in.
fn page_valid(page: &str) -> Result<(), String> {
    if page.chars().count() > PAGE_MAX {
        return Err(format!("is longer than {PAGE_MAX} characters"));
    }
    if page.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("has a space or a control character".to_owned());
    }
    let Some(rest) = page.strip_prefix("https://") else {
        return Err("is not https: a customer types their card on it".to_owned());
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.contains('@') {
        return Err("carries credentials, which every customer's email would show".to_owned());
    }
    if authority.is_empty() {
        return Err("names no host".to_owned());
    }
    // As the emails fill it in.
    let filled = payments::payment_page(page, 1);
    let url = url::Url::parse(&filled).map_err(|e| format!("is not an address ({e})"))?;
    if url.host_str().is_none_or(str::is_empty) {
        return Err("names no host".to_owned());
    }
    Ok(())
}

/// Migration 0020's `tenant_settings_invoice_prefix_shape`: `^[A-Z0-9]{1,12}$`.
fn prefix_valid(p: &str) -> bool {
    (1..=12).contains(&p.len())
        && p.bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit())
}

fn settings(r: &db::PgRow) -> Result<TenantSettings, KeysError> {
    Ok(TenantSettings {
        tenant_id: r.try_get("tenant_id").map_err(db::Error::Sql)?,
        invoice_prefix: r.try_get("invoice_prefix").map_err(db::Error::Sql)?,
        invoice_on_cancel: r.try_get("invoice_on_cancel").map_err(db::Error::Sql)?,
        email_from: r.try_get("email_from").map_err(db::Error::Sql)?,
        payment_page_url: r.try_get("payment_page_url").map_err(db::Error::Sql)?,
        updated_at: r.try_get("updated_at").map_err(db::Error::Sql)?,
    })
}
