//! A request's transaction: begun, the caller authenticated and its tenant
//! set for row-level security in the same transaction, then, for a POST,
//! its idempotency key bound to the one result it commits (docs/adr/0035).

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use db::{Row as _, Tx};
use serde::Serialize;
use sha2::{Digest as _, Sha256};

use crate::auth::Caller;
use crate::error::{ApiError, Code};
use crate::state::Api;

/// The header a POST's idempotency key comes in.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Set on an answer replayed from an earlier request with the same key.
pub const REPLAYED: &str = "idempotent-replayed";
/// Marks a sealed secret in a recorded answer: `hc-sealed:<key id>:<base64url>`.
const SEALED: &str = "hc-sealed:";
/// A recorded answer that holds a sealed secret starts with this character,
/// the token's byte offset in the JSON that follows, and the character again.
/// serde_json escapes U+0001 inside strings and no JSON text starts with it,
/// so no text a tenant wrote can make an answer read as sealed.
const SEALED_AT: char = '\u{1}';

/// A tenant's transaction. Dropped without [`Scope::respond`], it
/// rolls back: nothing of the request stays, nor its
/// idempotency key.
pub struct Scope {
    tx: Tx,
    tenant: String,
    key: Option<String>,
    /// Opens a secret sealed in a recorded answer when it is replayed.
    keyring: Option<webhook_delivery::Keyring>,
}

impl Scope {
    /// Begin the request's transaction and authenticate `caller` in it
    /// (`api_authenticate` sets `hardcount.tenant_id` for this transaction
    /// only, so a server connection PgBouncer hands on keeps nothing).
    ///
    /// # Errors
    /// 401 for a key that is unknown or revoked; a database error.
    pub async fn begin(api: &Api, caller: &Caller) -> Result<Scope, ApiError> {
        // BEGIN, its timeouts and the key's lookup in one round trip.
        let (tx, tenant) = api
            .db()
            .begin_calling(
                api.config().statement_timeout,
                "api_authenticate",
                &caller.0.hash,
            )
            .await?;
        match tenant {
            Some(tenant) => Ok(Scope {
                tx,
                tenant,
                key: None,
                keyring: api.keyring().cloned(),
            }),
            None => {
                let _ = tx.rollback().await;
                Err(ApiError::unauthorized())
            }
        }
    }

    /// A request as one message and one transaction (`db::Db::run_once`):
    /// authenticate `caller`, then run `statements`, whose values must be
    /// hex literals only and which must write nothing when no tenant is set
    /// (`api_tenant()` NULL). The rows of `statements`, committed. For a
    /// request without an idempotency key, whose whole work is statements
    /// that need no answer of an earlier one: a publish, one round trip
    /// instead of four.
    ///
    /// # Errors
    /// 401 for a key that is unknown or revoked (nothing was written); a
    /// database error (everything rolled back).
    pub async fn run_once(
        api: &Api,
        caller: &Caller,
        statements: &str,
    ) -> Result<Vec<db::PgRow>, ApiError> {
        let text = format!(
            "SELECT api_authenticate({}); {statements}",
            db::hex_bytea(&caller.0.hash)
        );
        let mut rows = api
            .db()
            .run_once(api.config().statement_timeout, &text)
            .await?
            .into_iter();
        let tenant: Option<String> = match rows.next() {
            Some(row) => row.try_get(0).map_err(db::Error::Sql)?,
            None => None,
        };
        match tenant {
            Some(_) => Ok(rows.collect()),
            None => Err(ApiError::unauthorized()),
        }
    }

    pub fn tx(&mut self) -> &mut Tx {
        &mut self.tx
    }

    /// The caller's tenant.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// For a POST: bind `idem`'s key, if one was sent, to this request.
    /// `Some(answer)` when the key already holds a committed answer to the
    /// same request (replay it; nothing else is done), 409
    /// `idempotency_key_reused` when it holds one to another request. A key
    /// older than 24 hours is forgotten and bound afresh.
    ///
    /// # Errors
    /// 409 as above; a database error.
    pub async fn idempotent(
        &mut self,
        idem: &Idempotency,
        body: &[u8],
    ) -> Result<Option<Response>, ApiError> {
        let Some(key) = &idem.key else {
            return Ok(None);
        };
        let fingerprint = {
            let mut h = Sha256::new();
            h.update(idem.route.as_bytes());
            h.update(b"\n");
            h.update(body);
            h.finalize().to_vec()
        };
        // A concurrent request with the same key waits here for the first
        // to commit (or roll back) and then sees its row.
        let fresh = self
            .tx
            .fetch_optional(
                db::sql(
                    "INSERT INTO api_idempotency_keys (tenant_id, idempotency_key, request_hash)
                     VALUES (api_tenant(), $1, $2)
                     ON CONFLICT (tenant_id, idempotency_key) DO UPDATE
                         SET request_hash = EXCLUDED.request_hash, created_at = now(),
                             status = NULL, response = NULL
                         WHERE api_idempotency_keys.created_at < now() - interval '24 hours'
                     RETURNING 1",
                )
                .bind(key.clone())
                .bind(fingerprint.clone()),
            )
            .await?
            .is_some();
        if fresh {
            self.key = Some(key.clone());
            return Ok(None);
        }
        let row = self
            .tx
            .fetch_one(
                db::sql(
                    "SELECT request_hash, status, response FROM api_idempotency_keys
                     WHERE tenant_id = api_tenant() AND idempotency_key = $1",
                )
                .bind(key.clone()),
            )
            .await?;
        let hash: Vec<u8> = row.try_get(0).map_err(db::Error::Sql)?;
        let status: Option<i16> = row.try_get(1).map_err(db::Error::Sql)?;
        let response: Option<String> = row.try_get(2).map_err(db::Error::Sql)?;
        if hash != fingerprint {
            return Err(ApiError::conflict(
                Code::IdempotencyKeyReused,
                "this Idempotency-Key was used with another request (a different route or body) \
                 in the last 24 hours; send a new key",
            ));
        }
        let (Some(status), Some(body)) = (status, response) else {
            return Err(ApiError::conflict(
                Code::IdempotencyKeyReused,
                "this Idempotency-Key's first request has no answer recorded; send a new key",
            ));
        };
        let body = self.unseal(body)?;
        let status = StatusCode::from_u16(status as u16).unwrap_or(StatusCode::OK);
        let mut answer = json_response(status, body);
        answer
            .headers_mut()
            .insert(REPLAYED, HeaderValue::from_static("true"));
        Ok(Some(answer))
    }

    /// [`Scope::respond`] for an answer that shows `secret` (a webhook
    /// signing secret, shown once): the answer recorded under the
    /// idempotency key holds it sealed with `keyring` (as the endpoint row
    /// does), never in clear, and a replay opens it again.
    ///
    /// # Errors
    /// A database error: nothing was committed.
    pub async fn respond_with_secret<T: Serialize>(
        mut self,
        status: StatusCode,
        body: &T,
        secret: &str,
        keyring: &webhook_delivery::Keyring,
    ) -> Result<Response, ApiError> {
        let text = serde_json::to_string(body).map_err(|_| ApiError::internal())?;
        if let Some(key) = self.key.take() {
            let sealed = keyring.seal_text(&self.tenant, secret);
            let token = format!(
                "{SEALED}{}:{}",
                sealed.key_id,
                URL_SAFE_NO_PAD.encode(&sealed.ciphertext)
            );
            let recorded = text.replace(secret, &token);
            let recorded = match recorded.find(&token) {
                Some(at) => format!("{SEALED_AT}{at}{SEALED_AT}{recorded}"),
                None => recorded,
            };
            self.record(key, status, recorded).await?;
        }
        self.tx.commit().await?;
        Ok(json_response(status, text))
    }

    async fn record(
        &mut self,
        key: String,
        status: StatusCode,
        text: String,
    ) -> Result<(), ApiError> {
        self.tx
            .execute(
                db::sql(
                    "UPDATE api_idempotency_keys SET status = $2, response = $3
                     WHERE tenant_id = api_tenant() AND idempotency_key = $1",
                )
                .bind(key)
                .bind(status.as_u16() as i16)
                .bind(text),
            )
            .await?;
        Ok(())
    }

    /// A recorded answer with its sealed secret (if any) opened. Only an
    /// answer marked by [`SEALED_AT`] holds one: an answer whose text merely
    /// contains `hc-sealed:` (a customer's name, an event's data) is replayed
    /// as it was recorded.
    fn unseal(&self, recorded: String) -> Result<String, ApiError> {
        let Some(marked) = Marked::of(&recorded) else {
            return Ok(self.unseal_unmarked(recorded));
        };
        let m = marked.ok_or_else(ApiError::internal)?;
        let secret = self.open_sealed(m.key_id, m.b64)?;
        Ok(format!("{}{secret}{}", m.before, m.after))
    }

    /// An answer recorded before answers were marked (at most a day before
    /// the upgrade): its first `hc-sealed:` token is opened if it is one of
    /// this tenant's, and the answer is replayed as recorded otherwise.
    fn unseal_unmarked(&self, recorded: String) -> String {
        let opened = recorded.find(SEALED).and_then(|at| {
            let rest = &recorded[at + SEALED.len()..];
            let end = rest.find('"')?;
            let (key_id, b64) = rest[..end].split_once(':')?;
            let secret = self.open_sealed(key_id, b64).ok()?;
            Some(format!("{}{secret}{}", &recorded[..at], &rest[end..]))
        });
        opened.unwrap_or(recorded)
    }

    /// The secret a sealed token holds, opened with this tenant's keyring.
    fn open_sealed(&self, key_id: &str, b64: &str) -> Result<String, ApiError> {
        let ciphertext = URL_SAFE_NO_PAD
            .decode(b64)
            .map_err(|_| ApiError::internal())?;
        let keyring = self.keyring.as_ref().ok_or_else(|| {
            ApiError::unavailable("this answer holds a webhook secret and no secrets key is set")
        })?;
        let secret = keyring
            .open(&self.tenant, key_id, &ciphertext)
            .map_err(|_| ApiError::internal())?;
        Ok(secret.expose().to_string())
    }

    /// Commit with `body` as the answer, recorded under the request's
    /// idempotency key (if any) in the same transaction.
    ///
    /// # Errors
    /// A database error: nothing was committed.
    pub async fn respond<T: Serialize>(
        mut self,
        status: StatusCode,
        body: &T,
    ) -> Result<Response, ApiError> {
        let text = serde_json::to_string(body).map_err(|_| ApiError::internal())?;
        if let Some(key) = self.key.take() {
            self.record(key, status, text.clone()).await?;
        }
        self.tx.commit().await?;
        Ok(json_response(status, text))
    }
}

/// `body` as the JSON answer with `status`, for a request that committed
/// without a [`Scope`] ([`Scope::run_once`]).
pub(crate) fn answer<T: Serialize>(status: StatusCode, body: &T) -> Result<Response, ApiError> {
    let text = serde_json::to_string(body).map_err(|_| ApiError::internal())?;
    Ok(json_response(status, text))
}

fn json_response(status: StatusCode, body: String) -> Response {
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response()
}

/// A POST's `Idempotency-Key` (optional; 1 to 255 printable ASCII
/// characters) and the route it came with.
#[derive(Debug, Clone)]
pub struct Idempotency {
    pub key: Option<String>,
    route: String,
}

impl<S: Send + Sync> FromRequestParts<S> for Idempotency {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let route = format!("{} {}", parts.method, parts.uri.path());
        let Some(value) = parts.headers.get(IDEMPOTENCY_KEY) else {
            return Ok(Idempotency { key: None, route });
        };
        let key = value
            .to_str()
            .ok()
            .filter(|k| {
                !k.is_empty() && k.len() <= 255 && k.bytes().all(|b| (0x21..=0x7e).contains(&b))
            })
            .ok_or_else(|| {
                ApiError::invalid(
                    Code::IdempotencyKeyInvalid,
                    "Idempotency-Key",
                    "an Idempotency-Key is 1 to 255 printable ASCII characters without spaces",
                )
            })?;
        Ok(Idempotency {
            key: Some(key.to_owned()),
            route,
        })
    }
}

/// What [`reseal_recorded_answers`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ResealedAnswers {
    /// Recorded answers whose secret is now sealed under the current key.
    pub resealed: usize,
    /// Answers whose secret opens with no key listed, by (tenant, key): they
    /// replay as 500 until they expire (a day after they were recorded).
    pub skipped: Vec<(String, String)>,
}

/// Seal the webhook secret held by every recorded idempotent answer (an
/// endpoint created or its secret rotated under an idempotency key,
/// [`Scope::respond_with_secret`]) under `keyring`'s current key, as
/// `webhook_delivery::reseal_secrets` does for the endpoints' own secrets
/// (docs/adr/0082): after `hardcount secrets rotate-key`, dropping an older
/// key strands no answer a client may still replay. `owner` is the schema
/// owner's pool (row-level security does not bind it). In batches of 100,
/// each one transaction with its rows locked; idempotent.
///
/// # Errors
/// A database error; the batches before it stay resealed.
pub async fn reseal_recorded_answers(
    owner: &db::Db,
    keyring: &webhook_delivery::Keyring,
) -> Result<ResealedAnswers, db::Error> {
    let mut report = ResealedAnswers::default();
    let (mut after_tenant, mut after_key) = (String::new(), String::new());
    loop {
        let mut tx = owner.begin().await?;
        let rows = tx
            .fetch_all(
                db::sql(
                    "SELECT tenant_id, idempotency_key, response FROM api_idempotency_keys
                     WHERE starts_with(response, chr(1))
                       AND (tenant_id, idempotency_key) > ($1, $2)
                     ORDER BY tenant_id, idempotency_key
                     LIMIT 100
                     FOR UPDATE",
                )
                .bind(after_tenant.clone())
                .bind(after_key.clone()),
            )
            .await?;
        let Some(last) = rows.last() else {
            tx.commit().await?;
            return Ok(report);
        };
        after_tenant = last.try_get("tenant_id")?;
        after_key = last.try_get("idempotency_key")?;
        for r in &rows {
            let tenant: String = r.try_get("tenant_id")?;
            let key: String = r.try_get("idempotency_key")?;
            let recorded: String = r.try_get("response")?;
            match resealed(&recorded, &tenant, keyring) {
                Ok(None) => {}
                Ok(Some(text)) => {
                    tx.execute(
                        db::sql(
                            "UPDATE api_idempotency_keys SET response = $3
                             WHERE tenant_id = $1 AND idempotency_key = $2",
                        )
                        .bind(tenant)
                        .bind(key)
                        .bind(text),
                    )
                    .await?;
                    report.resealed += 1;
                }
                Err(()) => report.skipped.push((tenant, key)),
            }
        }
        tx.commit().await?;
    }
}

/// A recorded answer marked by [`SEALED_AT`], in parts: the JSON before its
/// sealed token (which starts at `offset`), the token's key id and
/// ciphertext (base64url), and the JSON after it.
struct Marked<'a> {
    offset: usize,
    before: &'a str,
    key_id: &'a str,
    b64: &'a str,
    after: &'a str,
}

impl<'a> Marked<'a> {
    /// `None`: not marked; `Some(None)`: marked, but not as
    /// [`Scope::respond_with_secret`] writes it.
    fn of(recorded: &'a str) -> Option<Option<Marked<'a>>> {
        recorded.strip_prefix(SEALED_AT).map(Marked::parts)
    }

    /// What follows the first [`SEALED_AT`]: `offset`, [`SEALED_AT`], the JSON.
    fn parts(marked: &'a str) -> Option<Marked<'a>> {
        let (at, json) = marked.split_once(SEALED_AT)?;
        let offset: usize = at.parse().ok()?;
        let before = json.get(..offset)?;
        let token = json.get(offset..)?.strip_prefix(SEALED)?;
        let end = token.find('"')?;
        let (key_id, b64) = token[..end].split_once(':')?;
        Some(Marked {
            offset,
            before,
            key_id,
            b64,
            after: &token[end..],
        })
    }
}

/// A marked recorded answer with its sealed token under the keyring's
/// current key: `None` when it is already, `Err` when the token does not
/// open with any key held. The token's offset is unchanged: only the token
/// itself is rewritten.
fn resealed(
    recorded: &str,
    tenant: &str,
    keyring: &webhook_delivery::Keyring,
) -> Result<Option<String>, ()> {
    let m = Marked::of(recorded).flatten().ok_or(())?;
    if m.key_id == keyring.current_id() {
        return Ok(None);
    }
    let ciphertext = URL_SAFE_NO_PAD.decode(m.b64).map_err(|_| ())?;
    let secret = keyring
        .open(tenant, m.key_id, &ciphertext)
        .map_err(|_| ())?;
    let sealed = keyring.seal(tenant, &secret);
    Ok(Some(format!(
        "{SEALED_AT}{}{SEALED_AT}{}{SEALED}{}:{}{}",
        m.offset,
        m.before,
        sealed.key_id,
        URL_SAFE_NO_PAD.encode(&sealed.ciphertext),
        m.after
    )))
}
