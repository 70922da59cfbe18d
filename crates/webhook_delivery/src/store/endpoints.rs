//! The endpoints' SQL, for registering an endpoint and for its secrets:
//! the insert, a rotation, the boot check's census, and the owner's reseal.

use std::time::Duration;

use db::{Db, Row, Tx, sql};
use leader::Fence;

use crate::sealed::Sealed;

/// A new endpoint row, as inserted.
pub(crate) struct NewEndpoint {
    pub id: i64,
    pub enabled: bool,
}

/// Insert an endpoint in `tx`, whose tenant is already set (row-level
/// security checks the row against it).
pub(crate) async fn insert_endpoint(
    tx: &mut Tx,
    tenant_id: &str,
    url: &str,
    secret: &Sealed,
    event_types: Vec<String>,
) -> Result<NewEndpoint, db::Error> {
    let row = tx
        .fetch_one(
            sql("INSERT INTO webhook_endpoints \
                     (tenant_id, url, secret_ciphertext, secret_key_id, event_types) \
                 VALUES ($1, $2, $3, $4, $5) RETURNING id, enabled")
            .bind(tenant_id.to_owned())
            .bind(url.to_owned())
            .bind(secret.ciphertext.clone())
            .bind(secret.key_id.clone())
            .bind(event_types),
        )
        .await?;
    Ok(NewEndpoint {
        id: row.try_get("id")?,
        enabled: row.try_get("enabled")?,
    })
}

/// Store `new_secret` (sealed) as the endpoint's current secret and keep the
/// one it replaces as the previous secret until `now() + overlap` on the
/// database clock, in one statement (the right-hand columns are the row's old
/// values). A previous secret still held is dropped. Returns whether the
/// endpoint (of this tenant, its secret sealed) exists. In `tx`, whose
/// tenant is already set.
pub(crate) async fn rotate_secret(
    tx: &mut Tx,
    tenant_id: &str,
    endpoint_id: i64,
    new_secret: &Sealed,
    overlap: Duration,
) -> Result<bool, db::Error> {
    let rotated = tx
        .execute(
            sql("UPDATE webhook_endpoints \
                 SET previous_secret_ciphertext = secret_ciphertext, \
                     previous_secret_key_id = secret_key_id, \
                     previous_secret_expires_at = now() + make_interval(secs => $5), \
                     secret_ciphertext = $3, \
                     secret_key_id = $4 \
                 WHERE tenant_id = $1 AND id = $2 AND secret_ciphertext IS NOT NULL")
            .bind(tenant_id.to_owned())
            .bind(endpoint_id)
            .bind(new_secret.ciphertext.clone())
            .bind(new_secret.key_id.clone())
            .bind(overlap.as_secs_f64()),
        )
        .await?;
    Ok(rotated == 1)
}

/// What the delivery worker's boot check finds of the stored secrets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SecretsCensus {
    pub endpoints: i64,
    /// Endpoints with a secret (current or previous) still in clear.
    pub in_clear: i64,
    /// Every key id a stored secret is sealed under.
    pub key_ids: Vec<String>,
    /// Endpoints whose current secret is in clear or sealed under a key id
    /// not in `held`: their deliveries wait.
    pub unusable: i64,
}

pub(crate) async fn secrets_census(db: &Db, held: &[String]) -> Result<SecretsCensus, db::Error> {
    let row = db
        .fetch_one(sql(
            "SELECT (SELECT count(*) FROM webhook_endpoints) AS endpoints, \
                    (SELECT count(*) FROM webhook_endpoints \
                     WHERE secret_ciphertext IS NULL OR secret_key_id <> ALL ($1)) AS unusable, \
                    (SELECT count(*) FROM webhook_endpoints \
                     WHERE secret_ciphertext IS NULL \
                        OR (previous_secret_expires_at IS NOT NULL \
                            AND previous_secret_ciphertext IS NULL)) AS in_clear, \
                    ARRAY(SELECT secret_key_id FROM webhook_endpoints WHERE secret_key_id IS NOT NULL \
                          UNION SELECT previous_secret_key_id FROM webhook_endpoints \
                                WHERE previous_secret_key_id IS NOT NULL \
                          ORDER BY 1) AS key_ids",
        ).bind(held.to_vec()))
        .await?;
    Ok(SecretsCensus {
        endpoints: row.try_get("endpoints")?,
        unusable: row.try_get("unusable")?,
        in_clear: row.try_get("in_clear")?,
        key_ids: row.try_get("key_ids")?,
    })
}

/// One endpoint's stored secrets, as the owner reads them to reseal.
pub(crate) struct StoredSecrets {
    pub id: i64,
    pub tenant_id: String,
    pub clear: Option<String>,
    pub sealed: Option<Sealed>,
    pub previous_clear: Option<String>,
    pub previous_sealed: Option<Sealed>,
    /// The previous secret's overlap is over: it is dropped, not resealed.
    pub previous_expired: bool,
}

pub(super) fn sealed_from(ciphertext: Option<Vec<u8>>, key_id: Option<String>) -> Option<Sealed> {
    Some(Sealed {
        ciphertext: ciphertext?,
        key_id: key_id?,
    })
}

/// Up to `limit` endpoints, from `after_id` on, that hold a secret in clear or
/// sealed under a key other than `current_key`, locked until `tx` ends. Needs
/// the owner: only it reads the clear columns.
pub(crate) async fn secrets_to_reseal(
    tx: &mut Tx,
    current_key: &str,
    after_id: i64,
    limit: i64,
) -> Result<Vec<StoredSecrets>, db::Error> {
    let rows = tx
        .fetch_all(
            sql(
                "SELECT id, tenant_id, secret, secret_ciphertext, secret_key_id, previous_secret, \
                        previous_secret_ciphertext, previous_secret_key_id, \
                        coalesce(previous_secret_expires_at <= now(), false) AS previous_expired \
                 FROM webhook_endpoints \
                 WHERE id > $2 \
                   AND (secret IS NOT NULL OR previous_secret IS NOT NULL \
                        OR secret_key_id <> $1 OR previous_secret_key_id <> $1 \
                        OR previous_secret_expires_at <= now()) \
                 ORDER BY id LIMIT $3 FOR UPDATE",
            )
            .bind(current_key.to_owned())
            .bind(after_id)
            .bind(limit),
        )
        .await?;
    rows.iter()
        .map(|r| {
            Ok(StoredSecrets {
                id: r.try_get("id")?,
                tenant_id: r.try_get("tenant_id")?,
                clear: r.try_get("secret")?,
                sealed: sealed_from(r.try_get("secret_ciphertext")?, r.try_get("secret_key_id")?),
                previous_clear: r.try_get("previous_secret")?,
                previous_sealed: sealed_from(
                    r.try_get("previous_secret_ciphertext")?,
                    r.try_get("previous_secret_key_id")?,
                ),
                previous_expired: r.try_get("previous_expired")?,
            })
        })
        .collect()
}

/// Replace an endpoint's stored secrets with `current` and `previous` (both
/// sealed; `previous` None drops the previous secret and its expiry), clearing
/// the clear columns.
pub(crate) async fn store_resealed(
    tx: &mut Tx,
    id: i64,
    current: &Sealed,
    previous: Option<&Sealed>,
) -> Result<(), db::Error> {
    tx.execute(
        sql("UPDATE webhook_endpoints \
             SET secret = NULL, previous_secret = NULL, \
                 secret_ciphertext = $2, secret_key_id = $3, \
                 previous_secret_ciphertext = $4, previous_secret_key_id = $5, \
                 previous_secret_expires_at = CASE WHEN $4::bytea IS NULL THEN NULL \
                                                   ELSE previous_secret_expires_at END \
             WHERE id = $1")
        .bind(id)
        .bind(current.ciphertext.clone())
        .bind(current.key_id.clone())
        .bind(previous.map(|p| p.ciphertext.clone()))
        .bind(previous.map(|p| p.key_id.clone())),
    )
    .await?;
    Ok(())
}

/// Turn off, inside `tx`, the enabled endpoints whose every attempt has
/// failed for longer than `after` (`failing_since`, migration 0031): at
/// most [`crate::disabling::PER_STATEMENT`] a statement, oldest run first,
/// reached through `webhook_endpoints_failing`, locked with SKIP LOCKED (an
/// endpoint a tenant is changing is left for the next look) and fenced in
/// the innermost WHERE, so a stale leader turns nothing off. Each row with
/// its tenant's contact address.
pub(crate) async fn disable_failing(
    tx: &mut Tx,
    fence: &Fence,
    after: Duration,
) -> Result<Vec<crate::disabling::Disabled>, db::Error> {
    let rows = tx
        .fetch_all(
            sql(DISABLE_FAILING)
                .bind(fence.role_name())
                .bind(fence.token())
                .bind(after.as_secs_f64())
                .bind(crate::disabling::PER_STATEMENT),
        )
        .await?;
    rows.iter().map(crate::disabling::row).collect()
}

/// The statement of [`disable_failing`]; `pub` for the plan tests.
pub const DISABLE_FAILING: &str = "UPDATE webhook_endpoints e \
     SET enabled = false, disabled_at = now(), \
         disabled_reason = 'every attempt failed since ' \
             || to_char(e.failing_since AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI') || ' UTC' \
     WHERE e.id IN ( \
         SELECT f.id FROM webhook_endpoints f \
         WHERE f.enabled AND f.failing_since IS NOT NULL \
           AND f.failing_since < now() - make_interval(secs => $3) \
           AND leader_fence($1, $2) \
         ORDER BY f.failing_since LIMIT $4 \
         FOR UPDATE SKIP LOCKED) \
     RETURNING e.id, e.tenant_id, e.url, e.failing_since, \
               (SELECT t.contact_email FROM tenants t WHERE t.id = e.tenant_id) AS contact_email";
