//! Webhook events as producers write them: checked, then inserted inside the
//! producer's transaction with the `webhook_outbox` role's wake-up, so an
//! event exists iff its producer committed (docs/adr/0005, 0014).

mod store;

/// The columns a claimed delivery is read with (`webhook_delivery`'s
/// `ClaimedRow::from_row`), in a statement that names the delivery, its
/// event and its endpoint `$d`, `$e` and `$ep`. With `endpoint $ep`, only
/// the endpoint's: the fan-out's deliveries claimed for the delivery role
/// (docs/adr/0087) read them once per endpoint into a [`HandedEndpoint`]
/// (docs/adr/0127), so the claim and the hand-over cannot drift apart.
#[macro_export]
#[rustfmt::skip]
macro_rules! webhook_claimed_columns {
    (endpoint $ep:literal) => {
        concat!(
            $ep, ".url, ", $ep, ".secret_ciphertext, ", $ep, ".secret_key_id, ",
            $ep, ".enabled, ", $ep, ".disabled_reason, ",
            "CASE WHEN ", $ep, ".previous_secret_expires_at > now() THEN ",
            $ep, ".previous_secret_ciphertext END AS previous_secret_ciphertext, ",
            "CASE WHEN ", $ep, ".previous_secret_expires_at > now() THEN ",
            $ep, ".previous_secret_key_id END AS previous_secret_key_id"
        )
    };
    ($d:literal, $e:literal, $ep:literal) => {
        concat!(
            $d, ".id, ", $d, ".tenant_id, ", $d, ".event_id, ", $d, ".endpoint_id, ",
            $d, ".attempts, ", $d, ".resent_at_attempt, ",
            $crate::webhook_claimed_columns!(endpoint $ep), ", ",
            $e, ".event_type, ", $e, ".message_id, ", $e, ".payload::text AS payload, ",
            $crate::webhook_event_time!($e), " AS event_time"
        )
    };
}

/// A delivery the fan-out claimed for the delivery role of its process
/// (docs/adr/0087), not written yet (docs/adr/0124): its pair, the
/// `webhook_handoffs` row that stands for it, and its event's and endpoint's
/// columns, made once per event and per endpoint and shared by their pairs
/// (docs/adr/0127).
#[derive(Debug, Clone)]
pub struct HandedDelivery {
    pub tenant_id: String,
    pub event_id: i64,
    pub endpoint_id: i64,
    /// The `webhook_handoffs` row that holds the pair.
    pub handoff: i64,
    /// How many pairs that row holds.
    pub handoff_pairs: usize,
    /// When the fan-out handed it over, on the database clock (seconds since
    /// the epoch): its claim.
    pub handed_at: f64,
    pub event: std::sync::Arc<HandedEvent>,
    pub endpoint: std::sync::Arc<HandedEndpoint>,
}

/// A handed delivery's event, as its attempt sends it.
#[derive(Debug, Clone)]
pub struct HandedEvent {
    pub event_type: String,
    pub message_id: String,
    /// As [`webhook_event_time!`] makes it.
    pub event_time: String,
    /// The payload's JSON text.
    pub payload: String,
}

/// A handed delivery's endpoint, as [`webhook_claimed_columns!`] reads it
/// (`endpoint`): the secrets sealed, the previous one only while its
/// rotation overlap lasts.
#[derive(Debug, Clone)]
pub struct HandedEndpoint {
    pub url: String,
    pub secret_ciphertext: Option<Vec<u8>>,
    pub secret_key_id: Option<String>,
    pub previous_secret_ciphertext: Option<Vec<u8>>,
    pub previous_secret_key_id: Option<String>,
    pub enabled: bool,
    pub disabled_reason: Option<String>,
}

impl HandedEvent {
    /// The event's columns of a row that selects [`webhook_claimed_columns!`]
    /// (or the same names: the fan-out's `event` parts).
    pub fn from_row(r: &db::PgRow) -> Result<HandedEvent, db::Error> {
        use db::Row;
        Ok(HandedEvent {
            event_type: r.try_get("event_type")?,
            message_id: r.try_get("message_id")?,
            event_time: r.try_get("event_time")?,
            payload: r.try_get("payload")?,
        })
    }
}

impl HandedEndpoint {
    /// The endpoint's columns of a row that selects
    /// [`webhook_claimed_columns!`] (`endpoint`, or the whole list).
    pub fn from_row(r: &db::PgRow) -> Result<HandedEndpoint, db::Error> {
        use db::Row;
        Ok(HandedEndpoint {
            url: r.try_get("url")?,
            secret_ciphertext: r.try_get("secret_ciphertext")?,
            secret_key_id: r.try_get("secret_key_id")?,
            previous_secret_ciphertext: r.try_get("previous_secret_ciphertext")?,
            previous_secret_key_id: r.try_get("previous_secret_key_id")?,
            enabled: r.try_get("enabled")?,
            disabled_reason: r.try_get("disabled_reason")?,
        })
    }
}

/// The event's time as a delivery's body states it (RFC 3339, UTC,
/// microseconds), from `webhook_events` named `$e`.
#[macro_export]
#[rustfmt::skip]
macro_rules! webhook_event_time {
    ($e:literal) => {
        concat!(
            "to_char(", $e, ".created_at AT TIME ZONE 'UTC', ",
            "'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"
        )
    };
}

/// Why [`enqueue`] refused an event. Nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    #[error("webhook event has an empty tenant_id")]
    EmptyTenant,
    #[error("webhook event has an empty event type")]
    EmptyEventType,
    /// The payload is not one JSON value. The message names the line and column.
    #[error("webhook payload for `{event_type}` is not valid JSON: {problem}")]
    InvalidJson { event_type: String, problem: String },
    /// The payload's JSON text, each number counted at its length as stored
    /// ([`stored_len`]), is larger than [`MAX_PAYLOAD_BYTES`]; nothing was sent
    /// and `tx` is still usable.
    #[error(
        "webhook payload for `{event_type}` is {bytes} bytes (numbers in exponent notation \
         counted written out, as stored); at most {max} bytes are accepted"
    )]
    PayloadTooLarge {
        event_type: String,
        bytes: usize,
        max: usize,
    },
    /// The statement failed. The caller's transaction is aborted: roll it back.
    #[error("could not enqueue the webhook event: {0}")]
    Db(#[from] db::Error),
}

/// The largest payload [`enqueue`] accepts: 256 KiB of JSON text, as given.
///
/// Every delivery of an event holds its payload in memory and POSTs it, once per
/// subscribed endpoint and attempt; an unbounded payload lets one event exhaust
/// the delivery role's memory on every leader in turn (docs/security.md). 256 KiB is far
/// above what a billing event carries (ids and amounts) and matches email's body
/// limit. Migration 0007 backs it with `webhook_events_payload_bounded`: the
/// payload as Postgres renders it (what the claim reads and the worker sends) is
/// at most 1 MiB, which leaves room for jsonb's rendering (a space after each `:`
/// and `,`, at most 1.5×) and refuses inserts that bypass `enqueue`.
pub const MAX_PAYLOAD_BYTES: usize = 256 * 1024;

/// Add a webhook event to the outbox inside the caller's transaction and
/// return its id. The event is dispatched only if the caller commits.
///
/// `payload_json` is the event's `data`: one JSON value (usually an object).
///
/// # Errors
///
/// [`EnqueueError::InvalidJson`] (with line and column) when `payload_json` is not
/// JSON, [`EnqueueError::PayloadTooLarge`] past [`MAX_PAYLOAD_BYTES`], and
/// [`EnqueueError::EmptyTenant`] / [`EnqueueError::EmptyEventType`]; in
/// these cases nothing was sent to the database and `tx` is still usable.
/// [`EnqueueError::Db`] when the insert failed, which aborts `tx`.
pub async fn enqueue(
    tx: &mut db::Tx,
    tenant_id: &str,
    event_type: &str,
    payload_json: &str,
) -> Result<i64, EnqueueError> {
    check(tenant_id, event_type, payload_json)?;
    store::insert_event(tx, tenant_id, event_type, payload_json)
        .await
        .map_err(EnqueueError::Db)
}

/// [`enqueue`], returning the stored row (`id, event_type, payload,
/// message_id, created_at, dispatched_at`) from the same statement, for a
/// producer that answers with it (the tenant API).
///
/// # Errors
/// As [`enqueue`].
pub async fn enqueue_returning(
    tx: &mut db::Tx,
    tenant_id: &str,
    event_type: &str,
    payload_json: &str,
) -> Result<db::PgRow, EnqueueError> {
    check(tenant_id, event_type, payload_json)?;
    store::insert_event_returning(tx, tenant_id, event_type, payload_json)
        .await
        .map_err(EnqueueError::Db)
}

/// [`enqueue_returning`] as the text of one statement for a one-message
/// transaction ([`db::Db::run_once`]) whose earlier statement set the
/// caller's tenant for row-level security (`api_tenant()`, as the tenant
/// API's `api_authenticate` does). It returns the stored row, or no row
/// when no tenant was set (then nothing is written). The event's values are
/// in the text as hex literals only.
///
/// # Errors
/// As [`enqueue`] before anything is sent.
pub fn enqueue_for_caller(event_type: &str, payload_json: &str) -> Result<String, EnqueueError> {
    check_event(event_type, payload_json)?;
    Ok(store::insert_event_for_caller(event_type, payload_json))
}

/// One event for [`enqueue_many`]: (tenant, event type, payload JSON).
pub type NewEvent<'a> = (&'a str, &'a str, &'a str);

/// [`enqueue`] for many events with one statement (a producer that announces
/// a batch, such as billing's closing); returns how many were added. Every
/// event is checked first, as [`enqueue`] checks it.
///
/// # Errors
/// The first event [`enqueue`] would refuse, before anything was sent (`tx`
/// is still usable); [`EnqueueError::Db`] when the insert failed (`tx` is
/// aborted: roll it back).
pub async fn enqueue_many(tx: &mut db::Tx, events: &[NewEvent<'_>]) -> Result<u64, EnqueueError> {
    for (tenant_id, event_type, payload_json) in events {
        check(tenant_id, event_type, payload_json)?;
    }
    store::insert_events(tx, events)
        .await
        .map_err(EnqueueError::Db)
}

/// [`enqueue_many`] for events of one type, each a (tenant, payload JSON) a
/// producer built for its batch.
///
/// # Errors
/// As [`enqueue_many`].
pub async fn enqueue_many_of(
    tx: &mut db::Tx,
    event_type: &str,
    events: &[(String, String)],
) -> Result<u64, EnqueueError> {
    let refs: Vec<NewEvent<'_>> = events
        .iter()
        .map(|(tenant, payload)| (tenant.as_str(), event_type, payload.as_str()))
        .collect();
    enqueue_many(tx, &refs).await
}

/// What [`enqueue`] refuses before it sends anything.
fn check(tenant_id: &str, event_type: &str, payload_json: &str) -> Result<(), EnqueueError> {
    if tenant_id.trim().is_empty() {
        return Err(EnqueueError::EmptyTenant);
    }
    check_event(event_type, payload_json)
}

/// [`check`] but the tenant.
fn check_event(event_type: &str, payload_json: &str) -> Result<(), EnqueueError> {
    if event_type.trim().is_empty() {
        return Err(EnqueueError::EmptyEventType);
    }
    // The written length first: a text past the bound is not scanned.
    let bytes = if payload_json.len() > MAX_PAYLOAD_BYTES {
        payload_json.len()
    } else {
        stored_len(payload_json)
    };
    if bytes > MAX_PAYLOAD_BYTES {
        return Err(EnqueueError::PayloadTooLarge {
            event_type: event_type.to_owned(),
            bytes,
            max: MAX_PAYLOAD_BYTES,
        });
    }
    let invalid = |problem: String| EnqueueError::InvalidJson {
        event_type: event_type.to_owned(),
        problem,
    };
    let value: serde_json::Value =
        serde_json::from_str(payload_json).map_err(|e| invalid(e.to_string()))?;
    // JSON allows \u0000 in strings; jsonb refuses it, and would abort `tx`.
    if contains_nul(&value) {
        return Err(invalid(
            "a string contains \\u0000 (NUL), which Postgres jsonb cannot store".to_owned(),
        ));
    }
    Ok(())
}

/// The length of the JSON text `json` with each number counted as Postgres
/// stores and renders it: jsonb keeps a number as `numeric`, which prints
/// without an exponent, so `1e300` (5 bytes) is stored, read back and
/// delivered as 301 digits, and `1e-1000` as 1,002 characters. The
/// 256 KiB bound holds for that length (docs/adr/0129); the spaces jsonb
/// adds after `:` and `,` are left to the 1 MiB backstop's headroom
/// (migration 0007). Strings are skipped; `json` is assumed to be JSON
/// (a text that is not is refused by its parse).
pub fn stored_len(json: &str) -> usize {
    let b = json.as_bytes();
    let (mut i, mut extra) = (0, 0usize);
    while i < b.len() {
        match b[i] {
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                i += 1;
                while i < b.len() && matches!(b[i], b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-')
                {
                    i += 1;
                }
                let token = &json[start..i];
                extra += numeric_len(token).saturating_sub(token.len());
            }
            _ => i += 1,
        }
    }
    json.len().saturating_add(extra)
}

/// How many characters Postgres's `numeric` prints for the JSON number
/// `token`: the integer part (at least `0`), then the fraction to the
/// scale the text gave it (`1.50` keeps two places, `1.5e-3` four).
fn numeric_len(token: &str) -> usize {
    let (sign, unsigned) = match token.strip_prefix('-') {
        Some(rest) => (1, rest),
        None => (0, token),
    };
    let (mantissa, exp) = match unsigned.find(['e', 'E']) {
        Some(at) => (
            &unsigned[..at],
            unsigned[at + 1..]
                .parse::<i64>()
                .unwrap_or(0)
                .clamp(-1_000_000, 1_000_000),
        ),
        None => (unsigned, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = int.len() + frac.len();
    let zeros = int
        .bytes()
        .chain(frac.bytes())
        .take_while(|d| *d == b'0')
        .count();
    // Digits before the point once the exponent moved it, less leading
    // zeros; a zero is `0` whatever its exponent.
    let int_len = if zeros == digits {
        1
    } else {
        (int.len() as i64 + exp - zeros as i64).max(1)
    };
    let scale = (frac.len() as i64 - exp).max(0);
    sign + usize::try_from(int_len + if scale > 0 { 1 + scale } else { 0 }).unwrap_or(usize::MAX)
}

/// True if a string or key anywhere in `value` holds a NUL character.
pub fn contains_nul(value: &serde_json::Value) -> bool {
    use serde_json::Value;
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(contains_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || contains_nul(v)),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}
