//! The payment provider client: Stripe's PaymentIntents API over reqwest.
//!
//! An off-session charge of the customer's saved card is one
//! `POST {base}/v1/payment_intents`, form-encoded, with an `Idempotency-Key`
//! fixed by (deployment, invoice, the invoice's creation instant, attempt
//! sequence) and metadata naming the same, so the provider's record of an
//! attempt can be found without sending it again (docs/adr/0024):
//!
//! ```text
//!  GET /v1/payment_intents/{id}                       an intent whose id we hold
//!  GET /v1/payment_intents?customer=…&created[gte]=…  the customer's recent intents,
//!                                                     matched on metadata[hardcount_attempt]
//! ```
//!
//! Every answer is read by [`classify`], a pure table (Stripe's error
//! documentation): what was charged, declined, is still processing, must be
//! tried later, says this deployment is misconfigured (401/403), says the
//! request itself was wrong (400/404), or cannot be known. The secret key is
//! sent only as the bearer token; it is never in a log, an error, a stored raw
//! answer or a `Debug` output ([`SecretKey`]).

use std::fmt;
use std::time::Duration;

/// A provider secret key (`sk_…`). `Debug` and `Display` redact it.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretKey(String);

impl SecretKey {
    pub fn new(key: impl Into<String>) -> SecretKey {
        SecretKey(key.into())
    }

    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretKey(redacted)")
    }
}

/// Where and how billing charges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderConfig {
    /// `https://api.stripe.com` or the fake provider's `http://127.0.0.1:PORT`.
    pub base_url: String,
    pub secret_key: SecretKey,
    /// One call's whole budget (connect, send, answer). Default 30 s.
    pub timeout: Duration,
}

impl ProviderConfig {
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

    pub fn new(base_url: impl Into<String>, secret_key: SecretKey) -> ProviderConfig {
        ProviderConfig {
            base_url: base_url.into(),
            secret_key,
            timeout: ProviderConfig::DEFAULT_TIMEOUT,
        }
    }
}

/// The Idempotency-Key of attempt `attempt_seq` of the invoice `invoice_id`
/// created at `created_micros` (Unix microseconds), in deployment `instance`.
/// The creation instant makes a key reissued after a database restore (an
/// invoice id handed out again) differ from the one the provider remembers;
/// the instance keeps two installs on one provider account apart. Billing
/// computes the same key in SQL when it writes the attempt
/// (`store::KEY_SQL`); a test pins that the two agree.
pub fn idempotency_key(
    instance: &str,
    invoice_id: i64,
    created_micros: i64,
    attempt_seq: i32,
) -> String {
    format!("hc:{instance}:invoice:{invoice_id}:{created_micros}:attempt:{attempt_seq}")
}

/// Keys written before migration 0019 (`hardcount-invoice-N-attempt-M`) were
/// sent without metadata; a resend must send exactly what they sent.
pub fn is_legacy_key(key: &str) -> bool {
    key.starts_with("hardcount-invoice-")
}

/// The deployment named in a key (`None` for a legacy key).
fn key_instance(key: &str) -> Option<&str> {
    key.strip_prefix("hc:")?.split(':').next()
}

/// What is charged: an invoice's amount to its customer's saved card, under
/// the attempt's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaymentRequest {
    pub invoice_id: i64,
    /// Integer minor units.
    pub amount: i64,
    /// ISO 4217 as stored (upper case); sent lower case.
    pub currency: String,
    /// `cus_…`
    pub customer: String,
    /// `pm_…`
    pub payment_method: String,
    /// The attempt's Idempotency-Key, as stored on the attempt row.
    pub key: String,
}

impl PaymentRequest {
    /// The form body. A new key carries metadata naming the deployment, the
    /// invoice and the attempt (found later by listing); a legacy key is sent
    /// exactly as it first was.
    fn form(&self) -> String {
        let mut f = url::form_urlencoded::Serializer::new(String::new());
        f.append_pair("amount", &self.amount.to_string())
            .append_pair("currency", &self.currency.to_ascii_lowercase())
            .append_pair("customer", &self.customer)
            .append_pair("payment_method", &self.payment_method)
            .append_pair("confirm", "true")
            .append_pair("off_session", "true");
        if let Some(instance) = key_instance(&self.key) {
            f.append_pair("metadata[hardcount_instance]", instance)
                .append_pair("metadata[hardcount_invoice]", &self.invoice_id.to_string())
                .append_pair("metadata[hardcount_attempt]", &self.key);
        }
        f.finish()
    }
}

/// What the provider's record says about one attempt (docs/adr/0024).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChargeOutcome {
    /// Charged: the PaymentIntent `pi_…` succeeded.
    Succeeded { payment_intent: String },
    /// A card decline (402 `card_error`, or an intent that needs a new payment
    /// method): `decline_code`, else `code`. See [`decline_class`].
    Declined {
        code: String,
        payment_intent: Option<String>,
    },
    /// Accepted, not settled (`processing`, `requires_capture`): polled by id.
    Processing { payment_intent: String },
    /// Not known whether it charged: a timeout, a transport error, a 5xx
    /// (fresh or a stored one replayed). `outage` when it says the provider
    /// is down now (no connection, or a fresh 5xx); a replayed answer says the
    /// provider is up.
    Unknown {
        reason: String,
        payment_intent: Option<String>,
        outage: bool,
    },
    /// 409 (the key in flight) or 429: not executed; the same key later,
    /// not before `after`.
    RetryLater { reason: String, after: Duration },
    /// 401/403: this deployment's key is wrong or rolled. Nothing executed;
    /// nothing is recorded against the customer, and no further call is made
    /// this tick.
    KeyRejected { status: u16, message: String },
    /// A 400/404 refusal of the request itself (this service's bug or bad
    /// data): not executed, not a decline. The attempt fails with the
    /// provider's message and the invoice is flagged for review.
    Invalid { reason: String },
    /// The answer cannot be relied on and the charge may have happened: an
    /// `idempotency_error`, an answer that does not parse, an id of the wrong
    /// shape. A person decides (`raw`: the answer's first bytes, escaped).
    NeedsReview {
        reason: String,
        raw: Option<String>,
        payment_intent: Option<String>,
    },
}

/// How a decline is followed up (Stripe's decline-code table, "next steps").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeclineClass {
    /// Retry on the dunning schedule (`insufficient_funds`, `generic_decline`, …).
    Soft,
    /// Do not try the same card again: wait for a new payment method and ask
    /// the customer for one.
    Hard,
    /// The bank wants the customer present (3-D Secure): ask them to
    /// authenticate; no off-session retry of the same card.
    AuthenticationRequired,
}

/// Decline codes whose next step in Stripe's table is "the customer should
/// use another card" or "do not try again", and the provider's
/// `resource_missing` (no usable payment method).
pub const HARD_DECLINES: [&str; 24] = [
    "card_not_supported",
    "currency_not_supported",
    "do_not_try_again",
    "expired_card",
    "fraudulent",
    "incorrect_cvc",
    "incorrect_number",
    "incorrect_zip",
    "invalid_account",
    "invalid_cvc",
    "invalid_expiry_month",
    "invalid_expiry_year",
    "invalid_number",
    "lost_card",
    "merchant_blacklist",
    "new_account_information_available",
    "pickup_card",
    "restricted_card",
    "revocation_of_all_authorizations",
    "revocation_of_authorization",
    "security_violation",
    "stolen_card",
    "stop_payment_order",
    "resource_missing",
];

/// The class of a decline code.
pub fn decline_class(code: &str) -> DeclineClass {
    if code == "authentication_required" {
        DeclineClass::AuthenticationRequired
    } else if HARD_DECLINES.contains(&code) {
        DeclineClass::Hard
    } else {
        DeclineClass::Soft
    }
}

impl ChargeOutcome {
    /// Whether this answer says the provider is down now.
    pub fn is_outage(&self) -> bool {
        matches!(self, ChargeOutcome::Unknown { outage: true, .. })
    }
}

/// The client. Cheap to clone.
#[derive(Clone)]
pub struct Provider {
    client: reqwest::Client,
    config: ProviderConfig,
}

impl fmt::Debug for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Provider")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// How many pages of a customer's intents a lookup reads (100 each).
const LOOKUP_PAGES: usize = 5;

impl Provider {
    /// # Errors
    /// The HTTP client could not be built (no TLS roots); the message names
    /// neither the key nor the request.
    pub fn new(config: ProviderConfig) -> Result<Provider, String> {
        let client = reqwest::Client::builder()
            .timeout(config.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("payment provider client: {e}"))?;
        Ok(Provider { client, config })
    }

    pub fn config(&self) -> &ProviderConfig {
        &self.config
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.config.base_url.trim_end_matches('/'))
    }

    /// Charge `req` off session under its idempotency key. Never errors:
    /// what cannot be known is [`ChargeOutcome::Unknown`]. The reconciler
    /// resends a key only while it is certainly alive at the provider.
    ///
    /// # Cancel safety
    /// Dropped mid-call, the charge may or may not have happened; the
    /// attempt row written before the call is what the reconciler settles.
    pub async fn create_payment_intent(&self, req: &PaymentRequest) -> ChargeOutcome {
        let sent = self
            .client
            .post(self.url("/v1/payment_intents"))
            .bearer_auth(self.config.secret_key.expose())
            .header("idempotency-key", &req.key)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(req.form())
            .send()
            .await;
        self.read(sent).await
    }

    /// The current state of an intent whose id we hold.
    pub async fn get_payment_intent(&self, id: &str) -> ChargeOutcome {
        if !is_intent_id(id) {
            return needs_review(
                format!("stored payment intent id {id:?} is malformed"),
                None,
            );
        }
        let sent = self
            .client
            .get(self.url(&format!("/v1/payment_intents/{id}")))
            .bearer_auth(self.config.secret_key.expose())
            .send()
            .await;
        match self.read(sent).await {
            ChargeOutcome::Invalid { reason } => needs_review(
                format!("the provider has no payment intent {id}: {reason}"),
                None,
            ),
            other => other,
        }
    }

    /// The provider's record of the attempt under `key`, found among the
    /// customer's intents created since `since` (Unix seconds) by its
    /// `metadata[hardcount_attempt]`: `Ok(None)` when no intent carries it
    /// (the request never executed, or it was a legacy key sent without
    /// metadata), `Err` with why the list could not be read.
    pub async fn find_payment_intent(
        &self,
        customer: &str,
        key: &str,
        since: i64,
    ) -> Result<Option<ChargeOutcome>, ChargeOutcome> {
        let mut after: Option<String> = None;
        for _ in 0..LOOKUP_PAGES {
            let url = {
                let mut query = url::form_urlencoded::Serializer::new(String::new());
                query
                    .append_pair("customer", customer)
                    .append_pair("created[gte]", &since.to_string())
                    .append_pair("limit", "100");
                if let Some(a) = &after {
                    query.append_pair("starting_after", a);
                }
                format!("{}?{}", self.url("/v1/payment_intents"), query.finish())
            };
            let sent = self
                .client
                .get(url)
                .bearer_auth(self.config.secret_key.expose())
                .send()
                .await;
            let (status, _, text) = match self.fetch(sent).await {
                Ok(answer) => answer,
                Err(unknown) => return Err(unknown),
            };
            if !(200..300).contains(&status) {
                return Err(classify(status, &text, false, None));
            }
            let Ok(list) = serde_json::from_str::<serde_json::Value>(&text) else {
                return Err(needs_review(
                    "the provider's list of payment intents did not parse".into(),
                    Some(self.raw(&text)),
                ));
            };
            let data = list["data"].as_array().cloned().unwrap_or_default();
            if let Some(found) = data
                .iter()
                .find(|pi| pi["metadata"]["hardcount_attempt"].as_str() == Some(key))
            {
                return Ok(Some(intent_outcome(found, || self.raw(&text))));
            }
            match (
                list["has_more"].as_bool(),
                data.last().and_then(|pi| pi["id"].as_str()),
            ) {
                (Some(true), Some(last)) => after = Some(last.to_owned()),
                _ => return Ok(None),
            }
        }
        Err(ChargeOutcome::Unknown {
            reason: format!(
                "more than {} recent intents of the customer; not found in them",
                LOOKUP_PAGES * 100
            ),
            payment_intent: None,
            outage: false,
        })
    }

    async fn fetch(
        &self,
        sent: Result<reqwest::Response, reqwest::Error>,
    ) -> Result<(u16, bool, String), ChargeOutcome> {
        let transport = |e: reqwest::Error| {
            let outage = e.is_connect();
            ChargeOutcome::Unknown {
                reason: describe(e),
                payment_intent: None,
                outage,
            }
        };
        let response = sent.map_err(transport)?;
        let status = response.status().as_u16();
        let replayed = response
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        let text = response.text().await.map_err(transport)?;
        // The Retry-After travels in front of the body for the classifier.
        let text = match (status, retry_after) {
            (429, Some(secs)) => format!("{RETRY_AFTER_MARK}{secs}\n{text}"),
            _ => text,
        };
        Ok((status, replayed, text))
    }

    async fn read(&self, sent: Result<reqwest::Response, reqwest::Error>) -> ChargeOutcome {
        match self.fetch(sent).await {
            Ok((status, replayed, text)) => {
                let raw = self.raw(&text);
                classify(status, &text, replayed, Some(raw))
            }
            Err(unknown) => unknown,
        }
    }

    /// An answer's first bytes as they may be stored: escaped, the secret key
    /// redacted, at most [`RAW_LIMIT`] characters.
    fn raw(&self, text: &str) -> String {
        let text = text.replace(self.config.secret_key.expose(), "[redacted]");
        escape_prefix(&text)
    }
}

/// How many characters of an unreadable answer are kept.
pub const RAW_LIMIT: usize = 256;

const RETRY_AFTER_MARK: &str = "\u{1}retry-after:";

fn escape_prefix(text: &str) -> String {
    let mut out = String::new();
    for c in text.chars() {
        if out.len() >= RAW_LIMIT {
            out.push('…');
            break;
        }
        out.extend(c.escape_debug());
    }
    out
}

/// A transport error without the URL's secrets (there are none in the URL,
/// but the key is never in reqwest's errors either: it is a header).
fn describe(e: reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "connection failed"
    } else {
        "request failed"
    };
    format!("{kind}: {}", e.without_url())
}

/// The shape the `provider_payment_intent` column accepts.
pub fn is_intent_id(id: &str) -> bool {
    id.len() <= 255
        && id.strip_prefix("pi_").is_some_and(|r| {
            !r.is_empty() && r.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        })
}

/// The shape a decline or error code must have to be stored.
fn is_code(code: &str) -> bool {
    (1..=64).contains(&code.len()) && code.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

fn needs_review(reason: String, raw: Option<String>) -> ChargeOutcome {
    ChargeOutcome::NeedsReview {
        reason,
        raw,
        payment_intent: None,
    }
}

/// An intent object's meaning, by its `status`.
fn intent_outcome(pi: &serde_json::Value, raw: impl Fn() -> String) -> ChargeOutcome {
    let Some(id) = pi["id"].as_str() else {
        return needs_review("a payment intent without an id".into(), Some(raw()));
    };
    if !is_intent_id(id) {
        return needs_review(
            "a payment intent id of the wrong shape".to_owned(),
            Some(raw()),
        );
    }
    let id = id.to_owned();
    let error = &pi["last_payment_error"];
    let code = error["decline_code"]
        .as_str()
        .or_else(|| error["code"].as_str());
    match pi["status"].as_str() {
        Some("succeeded") => ChargeOutcome::Succeeded { payment_intent: id },
        Some("processing" | "requires_capture") => ChargeOutcome::Processing { payment_intent: id },
        Some("requires_action" | "requires_confirmation") => ChargeOutcome::Declined {
            code: "authentication_required".into(),
            payment_intent: Some(id),
        },
        Some("requires_payment_method" | "canceled") => match code {
            Some(c) if !is_code(c) => {
                needs_review("a decline code of the wrong shape".into(), Some(raw()))
            }
            c => ChargeOutcome::Declined {
                code: c
                    .unwrap_or(if pi["status"] == "canceled" {
                        "canceled"
                    } else {
                        "card_declined"
                    })
                    .to_owned(),
                payment_intent: Some(id),
            },
        },
        other => ChargeOutcome::NeedsReview {
            reason: format!("payment intent in status {other:?}"),
            raw: Some(raw()),
            payment_intent: Some(id),
        },
    }
}

/// An answer's meaning, by status and Stripe's error body (a pure table;
/// docs/adr/0024 lists its rows and the documentation each relies on).
/// `replayed`: the answer carried `Idempotent-Replayed: true`.
pub fn classify(status: u16, body: &str, replayed: bool, raw: Option<String>) -> ChargeOutcome {
    let (retry_after, body) = match body.strip_prefix(RETRY_AFTER_MARK) {
        Some(rest) => match rest.split_once('\n') {
            Some((secs, body)) => (secs.parse::<u64>().ok(), body),
            None => (None, rest),
        },
        None => (None, body),
    };
    let raw = || raw.clone().unwrap_or_else(|| escape_prefix(body));
    let parsed: Option<serde_json::Value> = serde_json::from_str(body).ok();
    let json = parsed.clone().unwrap_or_default();
    let s = |v: &serde_json::Value| v.as_str().map(str::to_owned);
    let error = &json["error"];
    let (kind, code) = (s(&error["type"]).unwrap_or_default(), s(&error["code"]));
    let message = s(&error["message"]).unwrap_or_default();
    let carried = || s(&error["payment_intent"]["id"]).filter(|id| is_intent_id(id));
    match status {
        200..=299 => match parsed {
            Some(pi) => intent_outcome(&pi, raw),
            None => needs_review(format!("HTTP {status} whose body is not JSON"), Some(raw())),
        },
        401 | 403 => ChargeOutcome::KeyRejected {
            status,
            message: format!(
                "HTTP {status} {kind}: the provider refused this deployment's secret key"
            ),
        },
        402 => {
            let decline = s(&error["decline_code"]).or(code);
            match decline {
                Some(c) if is_code(&c) => match s(&error["payment_intent"]["id"]) {
                    Some(id) if !is_intent_id(&id) => needs_review(
                        "a decline whose payment intent id has the wrong shape".into(),
                        Some(raw()),
                    ),
                    pi => ChargeOutcome::Declined {
                        code: c,
                        payment_intent: pi,
                    },
                },
                Some(_) => needs_review("a decline code of the wrong shape".into(), Some(raw())),
                None if parsed.is_none() => {
                    needs_review("HTTP 402 whose body is not JSON".into(), Some(raw()))
                }
                None => ChargeOutcome::Declined {
                    code: "card_declined".into(),
                    payment_intent: carried(),
                },
            }
        }
        409 => ChargeOutcome::RetryLater {
            reason: format!("HTTP 409 {kind}: another request with this key is in flight"),
            after: Duration::from_secs(5),
        },
        429 => ChargeOutcome::RetryLater {
            reason: format!("HTTP 429 {kind}: rate limited"),
            after: Duration::from_secs(retry_after.unwrap_or(60).clamp(1, 3600)),
        },
        400 | 404 if kind == "idempotency_error" => needs_review(
            format!(
                "HTTP {status} idempotency_error: the provider refused the key ({message}); the first request may have charged"
            ),
            Some(raw()),
        ),
        400 | 404
            if code.as_deref() == Some("resource_missing")
                && matches!(
                    s(&error["param"]).as_deref(),
                    Some("customer" | "payment_method")
                ) =>
        {
            ChargeOutcome::Declined {
                code: "resource_missing".into(),
                payment_intent: None,
            }
        }
        400..=499 => ChargeOutcome::Invalid {
            reason: format!(
                "HTTP {status} {kind} {}{}: {message}",
                code.unwrap_or_default(),
                s(&error["param"])
                    .map(|p| format!(" (param {p})"))
                    .unwrap_or_default()
            ),
        },
        _ => ChargeOutcome::Unknown {
            // "HTTP 5…" is an outage when fresh; a stored one replayed is not.
            reason: if replayed {
                format!("stored HTTP {status} replayed by the provider for this key")
            } else {
                format!("HTTP {status} from the payment provider")
            },
            payment_intent: carried(),
            outage: !replayed,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_secret_key_is_redacted_from_debug() {
        let c = ProviderConfig::new("http://127.0.0.1:1", SecretKey::new("sk_test_very_secret"));
        let p = Provider::new(c.clone()).unwrap();
        for shown in [format!("{c:?}"), format!("{p:?}")] {
            assert!(!shown.contains("very_secret"), "{shown}");
        }
        assert!(
            !p.raw("echo sk_test_very_secret back")
                .contains("very_secret")
        );
    }

    fn label(o: ChargeOutcome) -> String {
        match o {
            ChargeOutcome::Succeeded { .. } => "succeeded".into(),
            ChargeOutcome::Declined { code, .. } => format!("declined:{code}"),
            ChargeOutcome::Processing { .. } => "processing".into(),
            ChargeOutcome::Unknown {
                outage,
                payment_intent,
                ..
            } => {
                format!(
                    "unknown{}{}",
                    if outage { ":outage" } else { "" },
                    if payment_intent.is_some() { ":pi" } else { "" }
                )
            }
            ChargeOutcome::RetryLater { after, .. } => format!("later:{}", after.as_secs()),
            ChargeOutcome::KeyRejected { status, .. } => format!("key_rejected:{status}"),
            ChargeOutcome::Invalid { .. } => "invalid".into(),
            ChargeOutcome::NeedsReview { .. } => "review".into(),
        }
    }

    /// One row per class of answer (docs/adr/0024's table).
    #[test]
    fn answers_are_classified_as_stripe_means_them() {
        let r = |retry: &str, body: &str| format!("{RETRY_AFTER_MARK}{retry}\n{body}");
        let cases: Vec<(u16, String, bool, &str)> = vec![
            (200, r#"{"id":"pi_1","status":"succeeded"}"#.into(), false, "succeeded"),
            (200, r#"{"id":"pi_1","status":"processing"}"#.into(), false, "processing"),
            (200, r#"{"id":"pi_1","status":"requires_capture"}"#.into(), false, "processing"),
            (200, r#"{"id":"pi_1","status":"requires_action"}"#.into(), false, "declined:authentication_required"),
            (200, r#"{"id":"pi_1","status":"requires_payment_method","last_payment_error":{"code":"card_declined","decline_code":"insufficient_funds"}}"#.into(), false, "declined:insufficient_funds"),
            (200, r#"{"id":"pi_1","status":"canceled"}"#.into(), false, "declined:canceled"),
            (200, r#"{"object":"payment_intent","status":"succeeded"}"#.into(), false, "review"),
            (200, r#"{"id":"pi_bad id/../x","status":"succeeded"}"#.into(), false, "review"),
            (200, "<html>upstream proxy error</html>".into(), false, "review"),
            (200, r#"{"id":"pi_1","status":"weird"}"#.into(), false, "review"),
            (402, r#"{"error":{"type":"card_error","code":"card_declined","decline_code":"insufficient_funds"}}"#.into(), false, "declined:insufficient_funds"),
            (402, r#"{"error":{"type":"card_error","code":"authentication_required","decline_code":"authentication_required"}}"#.into(), false, "declined:authentication_required"),
            (402, r#"{"error":{"type":"card_error","code":"expired_card"}}"#.into(), false, "declined:expired_card"),
            (402, "{\"error\":{\"type\":\"card_error\",\"decline_code\":\"gen\\u0000eric\"}}".into(), false, "review"),
            (402, "not json".into(), false, "review"),
            (401, r#"{"error":{"type":"invalid_request_error","message":"Invalid API Key provided: sk_****"}}"#.into(), false, "key_rejected:401"),
            (403, r#"{"error":{"type":"invalid_request_error"}}"#.into(), false, "key_rejected:403"),
            (400, r#"{"error":{"type":"invalid_request_error","code":"amount_too_small","param":"amount"}}"#.into(), false, "invalid"),
            (400, r#"{"error":{"type":"invalid_request_error","code":"parameter_missing","param":"payment_method"}}"#.into(), false, "invalid"),
            (404, r#"{"error":{"type":"invalid_request_error","code":"resource_missing","param":"payment_method"}}"#.into(), false, "declined:resource_missing"),
            (400, r#"{"error":{"type":"invalid_request_error","code":"resource_missing","param":"customer"}}"#.into(), false, "declined:resource_missing"),
            (404, r#"{"error":{"type":"invalid_request_error","code":"resource_missing","param":"intent"}}"#.into(), false, "invalid"),
            (400, r#"{"error":{"type":"idempotency_error"}}"#.into(), false, "review"),
            (409, r#"{"error":{"type":"idempotency_error"}}"#.into(), false, "later:5"),
            (429, r(r#"7"#, r#"{"error":{"type":"rate_limit_error"}}"#), false, "later:7"),
            (429, r#"{"error":{"type":"rate_limit_error"}}"#.into(), false, "later:60"),
            (500, "".into(), false, "unknown:outage"),
            (500, r#"{"error":{"type":"api_error"}}"#.into(), true, "unknown"),
            (500, r#"{"error":{"type":"api_error","payment_intent":{"id":"pi_9","status":"succeeded"}}}"#.into(), true, "unknown:pi"),
            (503, "<html>".into(), false, "unknown:outage"),
        ];
        for (status, body, replayed, want) in cases {
            assert_eq!(
                label(classify(status, &body, replayed, None)),
                want,
                "{status} {body}"
            );
        }
    }

    #[test]
    fn decline_codes_are_classed_by_stripes_next_steps() {
        for code in [
            "stolen_card",
            "lost_card",
            "pickup_card",
            "fraudulent",
            "restricted_card",
            "invalid_account",
            "incorrect_number",
            "expired_card",
            "do_not_try_again",
            "resource_missing",
        ] {
            assert_eq!(decline_class(code), DeclineClass::Hard, "{code}");
        }
        for code in [
            "insufficient_funds",
            "generic_decline",
            "card_declined",
            "do_not_honor",
            "processing_error",
            "try_again_later",
            "card_velocity_exceeded",
        ] {
            assert_eq!(decline_class(code), DeclineClass::Soft, "{code}");
        }
        assert_eq!(
            decline_class("authentication_required"),
            DeclineClass::AuthenticationRequired
        );
    }

    #[test]
    fn new_keys_carry_metadata_and_legacy_keys_do_not() {
        let key = idempotency_key("eu1", 42, 1_700_000_000_123_456, 2);
        assert_eq!(key, "hc:eu1:invoice:42:1700000000123456:attempt:2");
        let req = |key: &str| PaymentRequest {
            invoice_id: 42,
            amount: 500,
            currency: "EUR".into(),
            customer: "cus_1".into(),
            payment_method: "pm_1".into(),
            key: key.into(),
        };
        let form = req(&key).form();
        assert!(
            form.contains("metadata%5Bhardcount_instance%5D=eu1"),
            "{form}"
        );
        assert!(
            form.contains("metadata%5Bhardcount_attempt%5D=hc%3Aeu1"),
            "{form}"
        );
        assert!(is_legacy_key("hardcount-invoice-42-attempt-1"));
        assert!(
            !req("hardcount-invoice-42-attempt-1")
                .form()
                .contains("metadata")
        );
    }

    #[test]
    fn raw_answers_are_escaped_and_bounded() {
        let raw = escape_prefix("a\u{0}b\nc");
        assert_eq!(raw, "a\\0b\\nc");
        assert!(escape_prefix(&"x".repeat(5000)).len() <= RAW_LIMIT + 4);
    }
}
