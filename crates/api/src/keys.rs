//! What an operator does to tenants and API keys (`hardcount tenants …`,
//! `hardcount keys …`), as `hardcount_operator`. A key is shown once, when
//! it is created; only its prefix and hash are stored.

use chrono::{DateTime, Utc};
use db::{Db, Row as _};

use crate::auth;

mod settings;
pub use settings::{SettingsChange, TenantSettings, set_tenant_settings, tenant_settings};

#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    #[error(
        "tenant id {0:?} is not valid: 1 to 63 of lower-case letters, digits, `_` and `-`, starting with a letter or digit"
    )]
    BadTenantId(String),
    #[error("tenant {0:?} already exists")]
    TenantExists(String),
    #[error("no tenant {0:?}: create it first with `hardcount tenants create`")]
    NoTenant(String),
    #[error("no API key with prefix {0:?}")]
    NoKey(String),
    #[error(
        "contact_email {0:?} is not a bare email address such as ops@example.com (no display name, no angle brackets); nothing was created"
    )]
    BadContactEmail(String),
    #[error("{0}")]
    Invalid(String),
    /// A tenant setting refused, by name.
    #[error("{message}")]
    BadSetting {
        param: &'static str,
        message: String,
    },
    #[error("database: {0}")]
    Db(#[from] db::Error),
}

#[derive(Debug, Clone)]
pub struct Tenant {
    pub id: String,
    pub name: String,
    pub contact_email: Option<String>,
    pub created_at: DateTime<Utc>,
}

/// A key as listed: never the key itself.
#[derive(Debug, Clone)]
pub struct KeyInfo {
    pub id: i64,
    pub tenant_id: String,
    pub prefix: String,
    pub name: String,
    pub created_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
}

/// A key just made. `key` is shown to the operator once and never again.
pub struct NewKey {
    pub info: KeyInfo,
    pub key: String,
}

impl std::fmt::Debug for NewKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NewKey")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

fn valid_tenant_id(id: &str) -> bool {
    let b = id.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_' || *c == b'-')
}

/// # Errors
/// A bad or taken id, a contact address the outbox would refuse, a database error.
pub async fn create_tenant(
    db: &Db,
    id: &str,
    name: &str,
    contact_email: Option<&str>,
) -> Result<Tenant, KeysError> {
    if !valid_tenant_id(id) {
        return Err(KeysError::BadTenantId(id.to_owned()));
    }
    if name.trim().is_empty() || name.chars().count() > 200 {
        return Err(KeysError::Invalid(
            "a tenant's name is 1 to 200 characters".to_owned(),
        ));
    }
    if let Some(email) = contact_email {
        // The column holds a bare address (`tenants_contact_email_valid`); a
        // mailbox with a display name parses but would be refused there.
        let bare = outbox::email::mailbox("contact_email", email)
            .is_ok_and(|m| m.name.is_none() && !email.contains('<'));
        if !bare {
            return Err(KeysError::BadContactEmail(email.to_owned()));
        }
    }
    let row = db
        .fetch_optional(
            db::sql(
                "INSERT INTO tenants (id, name, contact_email) VALUES ($1, $2, $3)
                 ON CONFLICT (id) DO NOTHING
                 RETURNING id, name, contact_email, created_at",
            )
            .bind(id.to_owned())
            .bind(name.trim().to_owned())
            .bind(contact_email.map(str::to_owned)),
        )
        .await
        .map_err(|e| match e.constraint() {
            // The database is stricter than the parser in a few corners
            // (migrations/0022_email_addresses.sql).
            Some("tenants_contact_email_valid") => {
                KeysError::BadContactEmail(contact_email.unwrap_or_default().to_owned())
            }
            _ => KeysError::Db(e),
        })?;
    match row {
        Some(row) => Ok(tenant(&row)?),
        None => Err(KeysError::TenantExists(id.to_owned())),
    }
}

fn tenant(row: &db::PgRow) -> Result<Tenant, db::Error> {
    Ok(Tenant {
        id: row.try_get("id").map_err(db::Error::Sql)?,
        name: row.try_get("name").map_err(db::Error::Sql)?,
        contact_email: row.try_get("contact_email").map_err(db::Error::Sql)?,
        created_at: row.try_get("created_at").map_err(db::Error::Sql)?,
    })
}

/// # Errors
/// A database error.
pub async fn list_tenants(db: &Db) -> Result<Vec<Tenant>, KeysError> {
    let rows = db
        .fetch_all(db::sql(
            "SELECT id, name, contact_email, created_at FROM tenants ORDER BY id",
        ))
        .await?;
    Ok(rows.iter().map(tenant).collect::<Result<_, _>>()?)
}

/// Make a key for `tenant_id`.
///
/// # Errors
/// [`KeysError::NoTenant`], a database error.
pub async fn create_key(db: &Db, tenant_id: &str, name: &str) -> Result<NewKey, KeysError> {
    if name.chars().count() > 200 {
        return Err(KeysError::Invalid(
            "a key's name is at most 200 characters".to_owned(),
        ));
    }
    let (key, prefix, hash) = auth::generate();
    let row = db
        .fetch_optional(
            db::sql(
                "INSERT INTO api_keys (tenant_id, prefix, key_hash, name)
                 SELECT id, $2, $3, $4 FROM tenants WHERE id = $1
                 RETURNING id, tenant_id, prefix, name, created_at, revoked_at",
            )
            .bind(tenant_id.to_owned())
            .bind(prefix)
            .bind(hash.to_vec())
            .bind(name.to_owned()),
        )
        .await?
        .ok_or_else(|| KeysError::NoTenant(tenant_id.to_owned()))?;
    Ok(NewKey {
        info: key_info(&row)?,
        key,
    })
}

fn key_info(row: &db::PgRow) -> Result<KeyInfo, db::Error> {
    let get = |e| db::Error::Sql(e);
    Ok(KeyInfo {
        id: row.try_get("id").map_err(get)?,
        tenant_id: row.try_get("tenant_id").map_err(get)?,
        prefix: row.try_get("prefix").map_err(get)?,
        name: row.try_get("name").map_err(get)?,
        created_at: row.try_get("created_at").map_err(get)?,
        revoked_at: row.try_get("revoked_at").map_err(get)?,
    })
}

/// Keys, of one tenant or all, oldest first.
///
/// # Errors
/// A database error.
pub async fn list_keys(db: &Db, tenant_id: Option<&str>) -> Result<Vec<KeyInfo>, KeysError> {
    let rows = db
        .fetch_all(
            db::sql(
                "SELECT id, tenant_id, prefix, name, created_at, revoked_at FROM api_keys
                 WHERE $1::text IS NULL OR tenant_id = $1 ORDER BY id",
            )
            .bind(tenant_id.map(str::to_owned)),
        )
        .await?;
    Ok(rows.iter().map(key_info).collect::<Result<_, _>>()?)
}

/// Revoke the key with `prefix`: the next request with it answers 401.
/// Revoking a revoked key changes nothing.
///
/// # Errors
/// [`KeysError::NoKey`], a database error.
pub async fn revoke_key(db: &Db, prefix: &str) -> Result<KeyInfo, KeysError> {
    let row = db
        .fetch_optional(
            db::sql(
                "UPDATE api_keys SET revoked_at = coalesce(revoked_at, now()) WHERE prefix = $1
                 RETURNING id, tenant_id, prefix, name, created_at, revoked_at",
            )
            .bind(prefix.to_owned()),
        )
        .await?
        .ok_or_else(|| KeysError::NoKey(prefix.to_owned()))?;
    Ok(key_info(&row)?)
}
