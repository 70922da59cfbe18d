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

use crate::ConfigError;

mod answer;

pub use answer::{
    ChargeOutcome, DeclineClass, HARD_DECLINES, RAW_LIMIT, classify, decline_class, is_intent_id,
};
use answer::{RETRY_AFTER_MARK, intent_outcome, needs_review, raw_answer};

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

    /// # Errors
    /// The first setting out of range, never echoing the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        // The URL as the error shows it: its scheme, host and port only. A
        // key may sit in its credentials, path or query, or be the whole
        // value (the two variables swapped), so nothing else is echoed.
        let bad = || ConfigError::ProviderUrl(redacted(&self.base_url));
        let url = url::Url::parse(&self.base_url).map_err(|_| bad())?;
        if !matches!(url.scheme(), "http" | "https")
            || url.host_str().is_none()
            || !url.username().is_empty()
            || url.password().is_some()
            || url.query().is_some()
            || url.fragment().is_some()
            || !url.path().trim_end_matches('/').is_empty()
        {
            return Err(bad());
        }
        let key = self.secret_key.expose();
        if !key.starts_with("sk_") || key.len() < 4 || key.chars().any(|c| c.is_whitespace()) {
            return Err(ConfigError::ProviderSecretKey);
        }
        let (min, max) = (Duration::from_millis(100), Duration::from_secs(120));
        if self.timeout < min || self.timeout > max {
            return Err(ConfigError::Duration {
                field: "provider timeout",
                value: self.timeout,
                min,
                max,
            });
        }
        Ok(())
    }
}

/// The Idempotency-Key of attempt `attempt_seq` of the invoice `invoice_id`
/// created at `created_micros` (Unix microseconds), in deployment `instance`.
/// The creation instant makes a key reissued after a database restore (an
/// invoice id handed out again) differ from the one the provider remembers;
/// the instance keeps two installs on one provider account apart. Billing
/// computes the same key in SQL when it writes the attempt
/// (`batch::attempt_key!`); a charge test pins that the two agree.
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

/// `amount` ISO 4217 minor units of `currency` (as invoices hold them,
/// `crate::money`) in the provider's minor units, where Stripe departs from
/// ISO 4217 (docs/adr/0078): ISK is two-decimal in its API, amounts in
/// hundredths of a króna that must be whole krónur (ISO: no decimals), so
/// × 100; MGA is zero-decimal in its API (ISO: two decimals), so ÷ 100, a
/// fraction of an ariary rounded half up (under one ariary, which no
/// card can be charged). Every other currency as it is.
/// Sources: <https://docs.stripe.com/currencies> (zero-decimal currencies,
/// MGA among them) and
/// <https://support.stripe.com/questions/deprecation-of-fractional-isk-charges-and-refunds>.
pub fn provider_amount(amount: i64, currency: &str) -> i64 {
    if currency.eq_ignore_ascii_case("ISK") {
        amount.saturating_mul(100)
    } else if currency.eq_ignore_ascii_case("MGA") {
        amount.saturating_add(50).div_euclid(100)
    } else {
        amount
    }
}

/// The largest amount, in the provider's minor units, of one payment in
/// `currency`: "up to eight digits" (999,999.99 in a two-decimal currency),
/// twelve for IDR (<https://docs.stripe.com/currencies>, "Minimum and maximum
/// charge amounts"). A plan priced above it is refused by the API, since
/// every charge of it would be refused as invalid and sent to review.
pub fn max_provider_amount(currency: &str) -> i64 {
    if currency.eq_ignore_ascii_case("IDR") {
        999_999_999_999
    } else {
        99_999_999
    }
}

/// The steps, in ISO 4217 minor units, that the provider charges `currency`
/// in: 10 for the three-decimal currencies, 1 for every other. Stripe takes
/// three-decimal amounts (KWD, BHD, JOD, OMR, TND) only with a last digit of
/// 0 and asks integrations to round to the nearest ten
/// (<https://docs.stripe.com/currencies>, "Three-decimal currencies"), so an
/// invoice in one is made in such steps: a pro rata amount rounded half up to
/// them, a plan's price refused by the API unless it is one (docs/adr/0086).
pub fn amount_step(currency: &str) -> i64 {
    if crate::money::exponent(currency) == 3 {
        10
    } else {
        1
    }
}

/// What is charged: an invoice's amount to its customer's saved card, under
/// the attempt's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaymentRequest {
    pub invoice_id: i64,
    /// Integer ISO 4217 minor units, as the invoice holds them; sent in the
    /// provider's ([`provider_amount`]).
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
        f.append_pair(
            "amount",
            &provider_amount(self.amount, &self.currency).to_string(),
        )
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

/// What a customer's intents since an attempt say of it
/// ([`Provider::find_payment_intent`]).
#[derive(Debug)]
pub enum Listed {
    /// An intent carries the attempt's key: what it says.
    Found(ChargeOutcome),
    /// None of them carries it (the request never executed, or it was a
    /// legacy key sent without metadata).
    Absent,
    /// More of them than a lookup reads, none of those read carrying it
    /// (docs/adr/0090): whether the rest do is not known.
    Unread {
        /// How many were read.
        read: usize,
    },
}

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
    /// `metadata[hardcount_attempt]` ([`Listed`]), newest first, at most
    /// `LOOKUP_PAGES` pages; `Err` with why the list could not be read.
    pub async fn find_payment_intent(
        &self,
        customer: &str,
        key: &str,
        since: i64,
    ) -> Result<Listed, ChargeOutcome> {
        let mut after: Option<String> = None;
        let mut read = 0;
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
                // A refused read says nothing of the charge: a 4xx here is
                // never a decline or a failure of the attempt (docs/adr/0071).
                return Err(
                    match classify(status, &text, false, self.config.secret_key.expose()) {
                        ChargeOutcome::Declined { code, .. } => needs_review(
                            format!(
                                "HTTP {status} {code} listing the customer's payment intents: \
                                 whether this attempt charged cannot be read there; check the \
                                 provider's dashboard"
                            ),
                            Some(self.raw(&text)),
                        ),
                        ChargeOutcome::Invalid { reason } => needs_review(
                            format!(
                                "the provider refused the listing of the customer's payment \
                                 intents ({reason}): whether this attempt charged cannot be read \
                                 there; check the provider's dashboard"
                            ),
                            Some(self.raw(&text)),
                        ),
                        other => other,
                    },
                );
            }
            let Ok(list) = serde_json::from_str::<serde_json::Value>(&text) else {
                return Err(needs_review(
                    "the provider's list of payment intents did not parse".into(),
                    Some(self.raw(&text)),
                ));
            };
            // Only a page read whole says that no intent carries the key:
            // `Absent` lets the request be sent again as a first one
            // (docs/adr/0103), so a body that is not a list page, or a page
            // that says it has more but names no last intent, is for review
            // (docs/adr/0128).
            let (Some(data), Some(has_more)) =
                (list["data"].as_array(), list["has_more"].as_bool())
            else {
                return Err(needs_review(
                    "the provider's answer to a list of payment intents is not a list page (no \
                     data array or no has_more): whether this attempt charged cannot be read \
                     there; check the provider's dashboard"
                        .into(),
                    Some(self.raw(&text)),
                ));
            };
            if let Some(found) = data
                .iter()
                .find(|pi| pi["metadata"]["hardcount_attempt"].as_str() == Some(key))
            {
                return Ok(Listed::Found(intent_outcome(found, || self.raw(&text))));
            }
            read += data.len();
            if !has_more {
                return Ok(Listed::Absent);
            }
            match data.last().and_then(|pi| pi["id"].as_str()) {
                Some(last) => after = Some(last.to_owned()),
                None => {
                    return Err(needs_review(
                        "the provider's list of payment intents says it has more but ends \
                         without an intent id: the rest cannot be read; check the provider's \
                         dashboard"
                            .into(),
                        Some(self.raw(&text)),
                    ));
                }
            }
        }
        Ok(Listed::Unread { read })
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
                classify(status, &text, replayed, self.config.secret_key.expose())
            }
            Err(unknown) => unknown,
        }
    }

    /// An answer's first bytes as they may be stored: escaped, the secret key
    /// redacted, at most [`RAW_LIMIT`] characters.
    fn raw(&self, text: &str) -> String {
        raw_answer(text, self.config.secret_key.expose())
    }
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

/// What an error message shows of a refused base URL: its scheme, host and
/// port, never its credentials, path, query or fragment (saying that some
/// were left out), or only its length when it is not a URL with a host.
fn redacted(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(u) if u.host_str().is_some() => {
            let port = u.port().map(|p| format!(":{p}")).unwrap_or_default();
            let hidden = !u.username().is_empty()
                || u.password().is_some()
                || !u.path().trim_end_matches('/').is_empty()
                || u.query().is_some()
                || u.fragment().is_some();
            format!(
                "{:?}{}",
                format!(
                    "{}://{}{port}",
                    u.scheme(),
                    u.host_str().unwrap_or_default()
                ),
                if hidden {
                    " with credentials, a path, a query or a fragment (not shown)"
                } else {
                    ""
                }
            )
        }
        _ => format!(
            "a value of {} characters that is not a URL with a host (not shown)",
            url.chars().count()
        ),
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

    /// A refused provider URL is named by its scheme, host and port alone:
    /// a key in its credentials, path or query, or a key given as the URL
    /// (the two variables swapped), is never echoed.
    #[test]
    fn a_refused_provider_url_never_echoes_its_credentials() {
        let refused = |url: &str| {
            ProviderConfig::new(url, SecretKey::new("sk_test_1"))
                .validate()
                .unwrap_err()
                .to_string()
        };
        let err = refused("https://user:hunter2@api.example.com");
        assert!(
            err.contains("\"https://api.example.com\" with credentials"),
            "{err}"
        );
        assert!(!err.contains("hunter2") && !err.contains("user"), "{err}");
        for url in [
            "sk_live_abcdef0123456789",
            "https://api.example.com/v1/sk_live_abcdef0123456789",
            "https://api.example.com/?key=sk_live_abcdef0123456789",
            "https://api.example.com:8443/#sk_live_abcdef0123456789",
        ] {
            let err = refused(url);
            assert!(!err.contains("sk_live"), "{err}");
            assert!(err.contains("not shown"), "{err}");
        }
        assert!(refused("sk_live_abcdef0123456789").contains("24 characters"));
        assert!(
            refused("https://api.example.com:8443/#x").contains("\"https://api.example.com:8443\"")
        );
    }

    #[test]
    fn amounts_are_converted_only_where_stripe_departs_from_iso() {
        assert_eq!(provider_amount(1200, "ISK"), 120_000);
        assert_eq!(provider_amount(1200, "isk"), 120_000);
        assert_eq!(provider_amount(120_000, "MGA"), 1200);
        assert_eq!(provider_amount(120_049, "MGA"), 1200);
        assert_eq!(provider_amount(120_050, "MGA"), 1201);
        for (amount, currency) in [(1200, "EUR"), (1200, "JPY"), (1234, "KWD"), (17_500, "HUF")] {
            assert_eq!(provider_amount(amount, currency), amount, "{currency}");
        }
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
}
