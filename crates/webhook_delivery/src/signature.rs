//! Standard Webhooks signing (<https://www.standardwebhooks.com>).
//!
//! Receivers verify a delivery with off-the-shelf Standard Webhooks libraries, so
//! the format is fixed by the spec, not by us:
//!
//! ```text
//! webhook-id:        msg_...                 (stable across retries of one delivery)
//! webhook-timestamp: 1614265330              (unix seconds of this attempt)
//! webhook-signature: v1,<base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}"))>
//! ```
//!
//! While an endpoint's secret is being rotated ([`crate::rotate_secret`]) the
//! header carries one signature per secret, space-separated, the new one first
//! (`v1,<sig-new> v1,<sig-old>`, [`sign_all`]); the spec's verifiers accept a
//! request when any one of them matches.
//!
//! A key must be at least [`MIN_KEY_LEN`] (24) bytes, as the spec asks.
//!
//! The endpoint secret is `whsec_` followed by the standard base64 of the key
//! bytes. A [`Secret`] never prints itself: its `Debug` is `Secret(***)` and its
//! parse errors do not echo the input, so it cannot leak through a log line.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac as _};
use rand::RngCore as _;
use sha2::Sha256;
use std::fmt;
use zeroize::Zeroizing;

/// Header carrying the message id; the same on every attempt so receivers can dedupe.
pub const HEADER_ID: &str = "webhook-id";
/// Header carrying the attempt's unix timestamp in seconds.
pub const HEADER_TIMESTAMP: &str = "webhook-timestamp";
/// Header carrying the value returned by [`sign`].
pub const HEADER_SIGNATURE: &str = "webhook-signature";

const SECRET_PREFIX: &str = "whsec_";
/// Key length of generated secrets; the spec asks for 24 to 64 bytes.
const GENERATED_KEY_LEN: usize = 24;
/// The shortest key [`Secret::parse`] accepts: Standard Webhooks asks for 24 to 64 bytes.
pub const MIN_KEY_LEN: usize = 24;

/// Why a `whsec_...` string was rejected. Never contains the secret text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    #[error("webhook secret must start with `whsec_`")]
    MissingPrefix,
    // The base64 crate's error names the offending byte, so it is not kept as a source.
    #[error("webhook secret is not valid standard base64 after `whsec_`")]
    InvalidBase64,
    #[error("webhook secret has an empty key after `whsec_`")]
    EmptyKey,
    #[error(
        "webhook secret key is {len} bytes long; Standard Webhooks asks for at least {MIN_KEY_LEN}"
    )]
    KeyTooShort { len: usize },
}

/// An endpoint's signing key, wiped from memory when dropped.
#[derive(Clone)]
pub struct Secret {
    key: Zeroizing<Vec<u8>>,
}

impl Secret {
    /// Parses a `whsec_<base64>` secret.
    ///
    /// # Errors
    ///
    /// [`SecretError`] when the prefix is missing, the base64 is invalid, or the
    /// key is empty or shorter than [`MIN_KEY_LEN`] bytes
    /// ([`SecretError::KeyTooShort`]). The error never includes the input.
    pub fn parse(text: &str) -> Result<Self, SecretError> {
        let encoded = text
            .strip_prefix(SECRET_PREFIX)
            .ok_or(SecretError::MissingPrefix)?;
        let key = Zeroizing::new(
            STANDARD
                .decode(encoded)
                .map_err(|_| SecretError::InvalidBase64)?,
        );
        if key.is_empty() {
            return Err(SecretError::EmptyKey);
        }
        if key.len() < MIN_KEY_LEN {
            return Err(SecretError::KeyTooShort { len: key.len() });
        }
        Ok(Self { key })
    }

    /// A fresh secret of 24 random bytes from the thread-local CSPRNG.
    pub fn generate() -> Self {
        let mut key = Zeroizing::new(vec![0; GENERATED_KEY_LEN]);
        rand::rng().fill_bytes(&mut key);
        Self { key }
    }

    /// The `whsec_...` text, to store or to show the endpoint owner once.
    /// Named so that every place that reveals the secret is easy to find.
    pub fn expose(&self) -> String {
        format!("{SECRET_PREFIX}{}", STANDARD.encode(self.key.as_slice()))
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// The `webhook-signature` header value (`v1,<base64>`) for one attempt.
///
/// `timestamp_secs` must be the value sent in `webhook-timestamp`: receivers
/// recompute the HMAC from the headers and reject stale timestamps, so every retry
/// is signed afresh with its own time.
pub fn sign(secret: &Secret, msg_id: &str, timestamp_secs: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(&secret.key)
        .expect("HMAC-SHA256 accepts keys of any length");
    mac.update(msg_id.as_bytes());
    mac.update(b".");
    mac.update(timestamp_secs.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
}

/// The `webhook-signature` header value for one attempt signed with each of
/// `secrets`, in order, space-separated: `v1,<sig-new> v1,<sig-old>` during a
/// rotation's overlap (the current secret first, then the previous one).
pub fn sign_all(secrets: &[&Secret], msg_id: &str, timestamp_secs: i64, body: &[u8]) -> String {
    secrets
        .iter()
        .map(|secret| sign(secret, msg_id, timestamp_secs, body))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

    #[test]
    fn signs_the_standard_webhooks_test_vector() {
        // The vector published with the Standard Webhooks reference libraries. The
        // expected value was also recomputed independently with Python's hmac,
        // hashlib and base64 modules and matched.
        let secret = Secret::parse(SPEC_SECRET).unwrap();
        let signature = sign(
            &secret,
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1_614_265_330,
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn every_signed_field_changes_the_signature() {
        let secret = Secret::parse(SPEC_SECRET).unwrap();
        let base = sign(&secret, "msg_1", 1, b"{}");
        assert_ne!(base, sign(&secret, "msg_2", 1, b"{}"));
        assert_ne!(base, sign(&secret, "msg_1", 2, b"{}"));
        assert_ne!(base, sign(&secret, "msg_1", 1, b"{ }"));
        assert_ne!(base, sign(&Secret::generate(), "msg_1", 1, b"{}"));
    }

    #[test]
    fn bad_secrets_are_rejected_without_echoing_them() {
        let cases = [
            (
                "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
                SecretError::MissingPrefix,
            ),
            (
                "WHSEC_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
                SecretError::MissingPrefix,
            ),
            (
                "whsec_MfKQ9r8GKYqr$wjUPD8ILPZIo2LaLaSw",
                SecretError::InvalidBase64,
            ),
            (
                "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaS",
                SecretError::InvalidBase64,
            ),
            ("whsec_", SecretError::EmptyKey),
            // 23 bytes: one short of the spec's minimum.
            (
                "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaQ=",
                SecretError::KeyTooShort { len: 23 },
            ),
        ];
        for (input, expected) in cases {
            let err = Secret::parse(input).unwrap_err();
            assert_eq!(err, expected, "{input}");
            let shown = format!("{err} {err:?}");
            assert!(!shown.contains("MfKQ9r8G"), "{shown}");
        }
    }

    #[test]
    fn keys_shorter_than_24_bytes_are_refused_by_name() {
        for len in [1, 4, 16, MIN_KEY_LEN - 1] {
            let text = format!("{SECRET_PREFIX}{}", STANDARD.encode(vec![7u8; len]));
            assert_eq!(
                Secret::parse(&text).unwrap_err(),
                SecretError::KeyTooShort { len }
            );
        }
        let text = format!("{SECRET_PREFIX}{}", STANDARD.encode([7u8; MIN_KEY_LEN]));
        assert!(Secret::parse(&text).is_ok());
    }

    #[test]
    fn sign_all_joins_one_signature_per_secret_current_first() {
        let current = Secret::generate();
        let previous = Secret::parse(SPEC_SECRET).unwrap();
        let both = sign_all(&[&current, &previous], "msg_1", 1, b"{}");
        assert_eq!(
            both,
            format!(
                "{} {}",
                sign(&current, "msg_1", 1, b"{}"),
                sign(&previous, "msg_1", 1, b"{}")
            )
        );
        assert_eq!(
            sign_all(&[&current], "msg_1", 1, b"{}"),
            sign(&current, "msg_1", 1, b"{}")
        );
    }

    #[test]
    fn debug_redacts_the_key() {
        let secret = Secret::parse(SPEC_SECRET).unwrap();
        assert_eq!(format!("{secret:?}"), "Secret(***)");
    }

    #[test]
    fn generated_secret_round_trips_through_its_text() {
        let secret = Secret::generate();
        let text = secret.expose();
        assert!(text.starts_with("whsec_"), "{text}");
        let parsed = Secret::parse(&text).unwrap();
        assert_eq!(parsed.key.len(), GENERATED_KEY_LEN);
        assert_eq!(sign(&secret, "m", 0, b""), sign(&parsed, "m", 0, b""));
        assert_ne!(text, Secret::generate().expose());
    }
}
