//! Registering a tenant's webhook endpoint.

use std::fmt;
use std::time::Duration;

use db::{Db, Tx};
use url::Url;

use crate::sealed::{Keyring, OpenError, SECRETS_KEY_VAR, Sealed};
use crate::signature::Secret;
use crate::store;

/// Longest accepted endpoint URL.
pub const MAX_URL_LEN: usize = 2048;

/// Why an endpoint was not created. Never contains a password from the URL.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("webhook endpoint has an empty tenant_id")]
    EmptyTenant,
    #[error("invalid webhook endpoint URL: {reason}")]
    InvalidUrl { reason: String },
    #[error("webhook endpoint URL scheme `{scheme}` is not allowed; use http or https")]
    UnsupportedScheme { scheme: String },
    #[error("webhook endpoint URL has no host")]
    MissingHost,
    #[error("webhook endpoint URL is {len} bytes long; at most {MAX_URL_LEN} are accepted")]
    UrlTooLong { len: usize },
    #[error("webhook endpoint subscribes to an empty event type (an empty list means every type)")]
    EmptyEventType,
    #[error("could not store the webhook endpoint: {0}")]
    Db(#[from] db::Error),
}

/// A stored endpoint. Its `Debug` hides the secret and any password in the URL.
#[derive(Clone)]
pub struct Endpoint {
    pub id: i64,
    pub tenant_id: String,
    pub url: Url,
    /// Show it to the endpoint's owner once ([`Secret::expose`]); never log it.
    pub secret: Secret,
    /// Empty means every event type.
    pub event_types: Vec<String>,
    pub enabled: bool,
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("id", &self.id)
            .field("tenant_id", &self.tenant_id)
            .field("url", &redacted_url(&self.url))
            .field("secret", &self.secret)
            .field("event_types", &self.event_types)
            .field("enabled", &self.enabled)
            .finish()
    }
}

/// `url` with its password and secret query parameters replaced by `***`, for
/// logs and errors (the workspace's one redactor, `db::redacted`).
pub fn redacted_url(url: &Url) -> String {
    db::redacted(url)
}

/// Check an endpoint URL the way [`create_endpoint`] does: it parses, is http
/// or https, has a host, and is at most [`MAX_URL_LEN`] bytes. Whether its
/// addresses may be connected to is decided at each delivery (the SSRF guard),
/// since a name can resolve differently later.
///
/// # Errors
/// An [`EndpointError`] naming the problem.
pub fn parse_endpoint_url(url: &str) -> Result<Url, EndpointError> {
    let url = url.trim();
    if url.len() > MAX_URL_LEN {
        return Err(EndpointError::UrlTooLong { len: url.len() });
    }
    let parsed = Url::parse(url).map_err(|e| EndpointError::InvalidUrl {
        reason: e.to_string(),
    })?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(EndpointError::UnsupportedScheme {
            scheme: parsed.scheme().to_owned(),
        });
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(EndpointError::MissingHost);
    }
    // The URL is stored and sent as parsed: percent-encoding can make it
    // several times longer than what was given.
    let stored = parsed.as_str().len();
    if stored > MAX_URL_LEN {
        return Err(EndpointError::UrlTooLong { len: stored });
    }
    Ok(parsed)
}

/// Register an endpoint for `tenant_id` with a fresh `whsec_` secret, stored
/// sealed under `keyring`'s current key. It receives the events whose type is
/// in `event_types`, or every event when the list is empty, from the next
/// fan-out on. `db` is the API role's pool (`hardcount_api`): the role loops'
/// role cannot create endpoints. Its own transaction, acting for `tenant_id`
/// ([`create_endpoint_in`] does the same in the caller's).
///
/// # Errors
/// [`EndpointError`] for an empty tenant or event type, or a URL that does not
/// parse or is not http(s); [`EndpointError::Db`] if the insert fails.
pub async fn create_endpoint<S: AsRef<str>>(
    db: &Db,
    keyring: &Keyring,
    tenant_id: &str,
    url: &str,
    event_types: &[S],
) -> Result<Endpoint, EndpointError> {
    // Bad input is refused before a connection is taken.
    checked(tenant_id, url, event_types)?;
    let mut tx = db.begin().await?;
    tx.act_for_tenant(tenant_id).await?;
    let endpoint = create_endpoint_in(&mut tx, keyring, tenant_id, url, event_types).await?;
    tx.commit().await?;
    Ok(endpoint)
}

/// [`create_endpoint`] in the caller's transaction, whose tenant is already
/// set to `tenant_id` (the tenant API's request transaction). The endpoint
/// exists only if the caller commits.
///
/// # Errors
/// As [`create_endpoint`]; after [`EndpointError::Db`], `tx` is aborted.
pub async fn create_endpoint_in<S: AsRef<str>>(
    tx: &mut Tx,
    keyring: &Keyring,
    tenant_id: &str,
    url: &str,
    event_types: &[S],
) -> Result<Endpoint, EndpointError> {
    let (url, event_types) = checked(tenant_id, url, event_types)?;
    let secret = Secret::generate();
    let sealed = keyring.seal(tenant_id, &secret);
    let row =
        store::insert_endpoint(tx, tenant_id, url.as_str(), &sealed, event_types.clone()).await?;
    Ok(Endpoint {
        id: row.id,
        tenant_id: tenant_id.to_owned(),
        url,
        secret,
        event_types,
        enabled: row.enabled,
    })
}

/// An endpoint's tenant, URL and event types, checked and trimmed.
fn checked<S: AsRef<str>>(
    tenant_id: &str,
    url: &str,
    event_types: &[S],
) -> Result<(Url, Vec<String>), EndpointError> {
    if tenant_id.trim().is_empty() {
        return Err(EndpointError::EmptyTenant);
    }
    let url = parse_endpoint_url(url)?;
    let event_types: Vec<String> = event_types
        .iter()
        .map(|t| t.as_ref().trim().to_owned())
        .collect();
    if event_types.iter().any(String::is_empty) {
        return Err(EndpointError::EmptyEventType);
    }
    Ok((url, event_types))
}

/// Longest overlap [`rotate_secret`] accepts: the previous secret keeps signing
/// for at most this long.
pub const MAX_ROTATION_OVERLAP: Duration = Duration::from_secs(30 * 24 * 60 * 60);

/// Why a secret was not rotated. Never contains a secret.
#[derive(Debug, thiserror::Error)]
pub enum RotateError {
    #[error("webhook endpoint {endpoint_id} of tenant {tenant_id:?} does not exist")]
    NotFound { tenant_id: String, endpoint_id: i64 },
    #[error(
        "webhook secret rotation overlap of {overlap:?} is longer than the {MAX_ROTATION_OVERLAP:?} allowed"
    )]
    OverlapTooLong { overlap: Duration },
    #[error("could not rotate the webhook secret: {0}")]
    Db(#[from] db::Error),
}

/// Rotate an endpoint's signing secret (Standard Webhooks): a fresh secret
/// becomes current, and the one it replaces stays as the previous secret
/// until `now() + overlap` on the database clock. Until then every delivery
/// carries both signatures, `v1,<sig-new> v1,<sig-old>`, so the receiver can
/// move to the new secret when it is ready; after it, only the new one. A
/// previous secret still in its overlap is dropped by a second rotation.
///
/// Returns the new secret: show it to the endpoint's owner once
/// ([`Secret::expose`]); never log it.
///
/// # Errors
/// [`RotateError::NotFound`] when `tenant_id` has no endpoint `endpoint_id`
/// (or its secret is still in clear: `hardcount secrets rotate-key` first),
/// [`RotateError::OverlapTooLong`] past [`MAX_ROTATION_OVERLAP`],
/// [`RotateError::Db`] if the update fails.
pub async fn rotate_secret(
    db: &Db,
    keyring: &Keyring,
    tenant_id: &str,
    endpoint_id: i64,
    overlap: Duration,
) -> Result<Secret, RotateError> {
    if overlap > MAX_ROTATION_OVERLAP {
        return Err(RotateError::OverlapTooLong { overlap });
    }
    let mut tx = db.begin().await?;
    tx.act_for_tenant(tenant_id).await?;
    let secret = rotate_secret_in(&mut tx, keyring, tenant_id, endpoint_id, overlap).await?;
    tx.commit().await?;
    Ok(secret)
}

/// [`rotate_secret`] in the caller's transaction, whose tenant is already set
/// to `tenant_id`. The new secret holds only if the caller commits.
///
/// # Errors
/// As [`rotate_secret`]; after [`RotateError::Db`], `tx` is aborted.
pub async fn rotate_secret_in(
    tx: &mut Tx,
    keyring: &Keyring,
    tenant_id: &str,
    endpoint_id: i64,
    overlap: Duration,
) -> Result<Secret, RotateError> {
    if overlap > MAX_ROTATION_OVERLAP {
        return Err(RotateError::OverlapTooLong { overlap });
    }
    let secret = Secret::generate();
    let sealed = keyring.seal(tenant_id, &secret);
    if store::rotate_secret(tx, tenant_id, endpoint_id, &sealed, overlap).await? {
        Ok(secret)
    } else {
        Err(RotateError::NotFound {
            tenant_id: tenant_id.to_owned(),
            endpoint_id,
        })
    }
}

/// What is wrong with the stored secrets, for `serve`. Only
/// [`SecretsError::NoKey`] (no key at all while endpoints exist) and a
/// database error refuse to start; the others are warnings: the endpoints
/// they name wait (their deliveries held, `bad_secret`), everything else runs.
/// Names the setting or the command; never shows a secret or a key.
#[derive(Debug, thiserror::Error)]
pub enum SecretsError {
    #[error(
        "{SECRETS_KEY_VAR} is not set, and {0} webhook endpoint(s) exist whose signing secrets \
         are sealed with it: set {SECRETS_KEY_VAR} (the key that sealed them), or leave \
         webhook_delivery out of HARDCOUNT_ROLES"
    )]
    NoKey(i64),
    #[error(
        "{0} webhook endpoint(s) still hold a signing secret in clear: run \
         `hardcount secrets rotate-key` (as the schema owner, MIGRATION_DATABASE_URL) to seal them"
    )]
    InClear(i64),
    #[error(
        "webhook signing secrets are sealed with key id(s) {0:?}, which {SECRETS_KEY_VAR} does not hold: \
         list those keys after the current one until `hardcount secrets rotate-key` has resealed them"
    )]
    MissingKeys(Vec<String>),
    #[error("could not reseal webhook secrets: endpoint {endpoint_id}: {error}")]
    Open { endpoint_id: i64, error: OpenError },
    #[error("could not read the stored webhook secrets: {0}")]
    Db(#[from] db::Error),
}

/// What the boot check found: the problems that leave some endpoints
/// waiting, and how many endpoints that is.
#[derive(Debug, Default)]
pub struct SecretsReport {
    /// [`SecretsError::InClear`] and [`SecretsError::MissingKeys`], if any.
    pub problems: Vec<SecretsError>,
    /// Endpoints whose current secret cannot be opened with the keys held
    /// (in clear, or sealed under a key id not held): their deliveries wait.
    pub unusable_endpoints: i64,
}

/// The boot check of a replica that runs webhook delivery: every stored
/// secret sealed, under a key `keyring` holds. A row that is not no longer
/// stops the replica: it is reported, and only its endpoint's deliveries
/// wait. With no keyring it passes only while there is no endpoint.
///
/// # Errors
/// [`SecretsError::NoKey`] (no key at all while endpoints exist) or a
/// database error.
pub async fn check_secrets(
    db: &Db,
    keyring: Option<&Keyring>,
) -> Result<SecretsReport, SecretsError> {
    let held = keyring.map(Keyring::ids).unwrap_or_default();
    let census = store::secrets_census(db, &held).await?;
    let Some(keyring) = keyring else {
        return match census.endpoints {
            0 => Ok(SecretsReport::default()),
            n => Err(SecretsError::NoKey(n)),
        };
    };
    let mut problems = Vec::new();
    if census.in_clear > 0 {
        problems.push(SecretsError::InClear(census.in_clear));
    }
    let missing: Vec<String> = census
        .key_ids
        .into_iter()
        .filter(|id| !keyring.holds(id))
        .collect();
    if !missing.is_empty() {
        problems.push(SecretsError::MissingKeys(missing));
    }
    Ok(SecretsReport {
        problems,
        unusable_endpoints: census.unusable,
    })
}

/// What [`reseal_secrets`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResealReport {
    /// Endpoints whose secrets were written again under the current key.
    pub resealed: u64,
    /// Previous secrets dropped because their overlap was over.
    pub expired_dropped: u64,
    /// Endpoints left as they were because a secret of theirs does not open
    /// with any key listed (a key missing, or a corrupt row), with why.
    pub skipped: Vec<(i64, String)>,
}

/// Seal every webhook secret under `keyring`'s current key: secrets still in
/// clear (stored before migration 0012) and secrets sealed under an older key
/// listed after it. Previous secrets past their overlap are dropped. In
/// batches of 100 endpoints, each batch one transaction with its rows locked,
/// so a rotation running meanwhile waits rather than being overwritten.
/// `owner` must be the schema owner's pool (only it reads the clear columns);
/// it may be run again at any time, and then does nothing.
///
/// An endpoint whose secret does not open with any key listed is skipped
/// and named in [`ResealReport::skipped`]; the others are resealed.
///
/// # Errors
/// [`SecretsError::Db`].
pub async fn reseal_secrets(owner: &Db, keyring: &Keyring) -> Result<ResealReport, SecretsError> {
    let mut report = ResealReport::default();
    let mut after = 0;
    loop {
        let mut tx = owner.begin().await?;
        let rows = store::secrets_to_reseal(&mut tx, keyring.current_id(), after, 100).await?;
        let Some(last) = rows.last() else {
            tx.commit().await?;
            return Ok(report);
        };
        after = last.id;
        for row in &rows {
            let open = |clear: &Option<String>,
                        sealed: &Option<Sealed>|
             -> Result<Option<Secret>, SecretsError> {
                let opened = match (clear, sealed) {
                    (_, Some(s)) => Some(keyring.open(&row.tenant_id, &s.key_id, &s.ciphertext)),
                    (Some(text), None) => Some(Secret::parse(text).map_err(OpenError::from)),
                    (None, None) => None,
                };
                opened.transpose().map_err(|error| SecretsError::Open {
                    endpoint_id: row.id,
                    error,
                })
            };
            let opened = open(&row.clear, &row.sealed).and_then(|current| {
                let current = current.ok_or(SecretsError::Open {
                    endpoint_id: row.id,
                    error: OpenError::Corrupt("none".into()),
                })?;
                let previous = if row.previous_expired {
                    None
                } else {
                    open(&row.previous_clear, &row.previous_sealed)?
                };
                Ok((current, previous))
            });
            let (current, previous) = match opened {
                Ok(both) => both,
                Err(e) => {
                    report.skipped.push((row.id, e.to_string()));
                    continue;
                }
            };
            if row.previous_expired {
                report.expired_dropped += 1;
            }
            let current = keyring.seal(&row.tenant_id, &current);
            let previous = previous.map(|p| keyring.seal(&row.tenant_id, &p));
            store::store_resealed(&mut tx, row.id, &current, previous.as_ref()).await?;
            report.resealed += 1;
        }
        tx.commit().await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_urls_must_parse_and_be_http_or_https() {
        assert!(parse_endpoint_url("https://hooks.example.com/x?y=1").is_ok());
        assert!(parse_endpoint_url(" http://127.0.0.1:8080/ ").is_ok());
        let cases: &[(&str, &str)] = &[
            (
                "not a url",
                "invalid webhook endpoint URL: relative URL without a base",
            ),
            ("ftp://example.com/", "scheme `ftp` is not allowed"),
            ("javascript:alert(1)", "scheme `javascript` is not allowed"),
            ("http://", "invalid webhook endpoint URL: empty host"),
            ("https://exa mple.com/", "invalid webhook endpoint URL"),
        ];
        for (url, expected) in cases {
            let err = parse_endpoint_url(url).unwrap_err().to_string();
            assert!(err.contains(expected), "{url}: {err}");
        }
        let long = format!("https://example.com/{}", "a".repeat(MAX_URL_LEN));
        assert!(matches!(
            parse_endpoint_url(&long),
            Err(EndpointError::UrlTooLong { .. })
        ));
        // 1,000 bytes as given, 3,000 once percent-encoded as stored.
        // Mutation `endpoint_url_stored_len` (the stored length unchecked)
        // accepts it.
        let encoded = format!("https://example.com/{}", "\"".repeat(1000));
        assert!(encoded.len() <= MAX_URL_LEN);
        assert!(matches!(
            parse_endpoint_url(&encoded),
            Err(EndpointError::UrlTooLong { len }) if len > 3000
        ));
    }

    #[test]
    fn debug_hides_the_secret_and_the_url_password() {
        let endpoint = Endpoint {
            id: 1,
            tenant_id: "t".into(),
            url: Url::parse("https://user:hunter2@example.com/hook").unwrap(),
            secret: Secret::generate(),
            event_types: vec![],
            enabled: true,
        };
        let shown = format!("{endpoint:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(!shown.contains("whsec_"), "{shown}");
        assert!(shown.contains("Secret(***)"), "{shown}");
        assert!(shown.contains("user:***@example.com"), "{shown}");
    }
}
