//! Standard Webhooks verification as a receiver does it, written from the spec
//! (<https://www.standardwebhooks.com>) with hmac, sha2 and base64 directly.
//!
//! It deliberately does not call `webhook_delivery::signature`: a check that
//! shares the signing code would agree with any bug in it.
//!
//! ```text
//! secret:            whsec_<standard base64 of the key>
//! webhook-signature: v1,<base64(HMAC-SHA256(key, "{webhook-id}.{webhook-timestamp}.{body}"))>
//!                    (several, space separated, when keys rotate; one match is enough)
//! ```

use std::time::{Duration, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac as _};
use sha2::Sha256;

use crate::receiver::Received;

/// How far a signed timestamp may be from the moment the request arrived, as
/// the reference libraries allow.
pub const TOLERANCE: Duration = Duration::from_secs(5 * 60);

/// Verify a received request against the endpoint's `whsec_` secret: the three
/// `webhook-*` headers are present, the timestamp is within [`TOLERANCE`] of the
/// request's arrival, and one of the `v1,` signatures matches.
///
/// # Errors
/// Why the request does not verify, in words.
pub fn verify(secret: &str, received: &Received) -> Result<(), String> {
    let header = |name: &str| {
        received
            .try_header(name)
            .ok_or_else(|| format!("no {name} header"))
    };
    let id = header("webhook-id")?;
    let timestamp = header("webhook-timestamp")?;
    let signatures = header("webhook-signature")?;
    let sent_at: u64 = timestamp
        .parse()
        .map_err(|_| format!("webhook-timestamp {timestamp:?} is not unix seconds"))?;
    let arrived = received
        .received_at
        .duration_since(UNIX_EPOCH)
        .map_err(|e| e.to_string())?
        .as_secs();
    if sent_at.abs_diff(arrived) > TOLERANCE.as_secs() {
        return Err(format!(
            "timestamp {sent_at} is more than {TOLERANCE:?} from the arrival at {arrived}"
        ));
    }
    verify_signature(secret, id, timestamp, &received.body, signatures)
}

/// The signature check alone: does one of the space-separated `signatures`
/// sign `{id}.{timestamp}.{body}` with the key inside `secret`?
///
/// # Errors
/// A secret without `whsec_` or with bad base64, or no matching signature.
pub fn verify_signature(
    secret: &str,
    id: &str,
    timestamp: &str,
    body: &[u8],
    signatures: &str,
) -> Result<(), String> {
    let expected = sign(secret, id, timestamp, body)?;
    if signatures.split(' ').any(|s| s == expected) {
        Ok(())
    } else {
        Err(format!(
            "signature {signatures} of {id} does not match {expected}"
        ))
    }
}

/// `v1,<base64 HMAC>` of `{id}.{timestamp}.{body}` under `secret`'s key.
///
/// # Errors
/// A secret without `whsec_` or with bad base64.
pub fn sign(secret: &str, id: &str, timestamp: &str, body: &[u8]) -> Result<String, String> {
    let key = STANDARD
        .decode(
            secret
                .strip_prefix("whsec_")
                .ok_or("the secret has no whsec_ prefix")?,
        )
        .map_err(|e| format!("the secret is not base64 after whsec_: {e}"))?;
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).expect("HMAC takes keys of any length");
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    Ok(format!(
        "v1,{}",
        STANDARD.encode(mac.finalize().into_bytes())
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const SPEC_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const SPEC_BODY: &[u8] = br#"{"test": 2432232314}"#;
    const SPEC_SIGNATURE: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    fn received(timestamp: u64, signature: &str, age: Duration) -> Received {
        let mut headers = axum::http::HeaderMap::new();
        headers.insert("webhook-id", SPEC_ID.parse().unwrap());
        headers.insert("webhook-timestamp", timestamp.to_string().parse().unwrap());
        headers.insert("webhook-signature", signature.parse().unwrap());
        Received {
            path: "/hooks/in".into(),
            headers,
            body: axum::body::Bytes::from_static(SPEC_BODY),
            at: std::time::Instant::now(),
            received_at: UNIX_EPOCH + Duration::from_secs(timestamp) + age,
        }
    }

    #[test]
    fn the_standard_webhooks_test_vector_verifies() {
        // The vector published with the Standard Webhooks reference libraries.
        assert_eq!(
            sign(SPEC_SECRET, SPEC_ID, "1614265330", SPEC_BODY).unwrap(),
            SPEC_SIGNATURE
        );
        let r = received(1_614_265_330, SPEC_SIGNATURE, Duration::from_secs(1));
        assert_eq!(verify(SPEC_SECRET, &r), Ok(()));
    }

    #[test]
    fn one_matching_signature_among_several_is_enough() {
        let both = format!("v1,bm9wZQ== {SPEC_SIGNATURE}");
        let r = received(1_614_265_330, &both, Duration::ZERO);
        assert_eq!(verify(SPEC_SECRET, &r), Ok(()));
    }

    #[test]
    fn a_wrong_signature_a_stale_timestamp_or_a_bad_secret_is_refused() {
        let fresh = Duration::from_secs(1);
        let cases = [
            (
                SPEC_SECRET,
                received(1_614_265_330, "v1,bm9wZQ==", fresh),
                "does not match",
            ),
            (
                SPEC_SECRET,
                received(1_614_265_331, SPEC_SIGNATURE, fresh),
                "does not match",
            ),
            (
                SPEC_SECRET,
                received(1_614_265_330, SPEC_SIGNATURE, TOLERANCE + fresh),
                "more than",
            ),
            (
                "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
                received(1_614_265_330, SPEC_SIGNATURE, fresh),
                "whsec_",
            ),
        ];
        for (secret, r, why) in cases {
            let err = verify(secret, &r).unwrap_err();
            assert!(err.contains(why), "{err}");
        }
    }
}
