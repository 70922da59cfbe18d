//! API keys: `hc_<prefix>_<secret>`, 8 + 43 characters of randomness, shown
//! once; stored as the SHA-256 of the whole key beside the visible prefix
//! (docs/adr/0035). The key is 256 random bits, so a fast hash is enough: no
//! one guesses a preimage, and a slow hash would cost every request.

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use rand::RngCore as _;
use sha2::{Digest as _, Sha256};

use crate::error::ApiError;
use crate::state::Api;

const PREFIX_LEN: usize = 8;
const SECRET_BYTES: usize = 32;
/// `hc_` + prefix + `_` + 43 base64url characters.
const KEY_LEN: usize = 3 + PREFIX_LEN + 1 + 43;

/// A key as presented: its visible prefix and its hash. The key itself is
/// not kept.
#[derive(Clone)]
pub struct Presented {
    pub prefix: String,
    pub hash: [u8; 32],
}

impl std::fmt::Debug for Presented {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Presented")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// Parse a key's text; `None` for anything not shaped like a key.
pub fn parse(key: &str) -> Option<Presented> {
    let rest = key.strip_prefix("hc_")?;
    if key.len() != KEY_LEN {
        return None;
    }
    let (prefix, secret) = rest.split_at(PREFIX_LEN);
    let secret = secret.strip_prefix('_')?;
    let prefix_ok = prefix
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if !prefix_ok || URL_SAFE_NO_PAD.decode(secret).ok()?.len() != SECRET_BYTES {
        return None;
    }
    Some(Presented {
        prefix: prefix.to_owned(),
        hash: hash(key),
    })
}

/// The credentials of an `Authorization` value in the Bearer scheme, whose
/// name is case-insensitive (RFC 9110, section 11.1; RFC 6750): `Bearer`,
/// `bearer` and `BEARER` all carry a token.
pub fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token)
}

pub fn hash(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// A new key: (the key, shown once; its prefix; its hash, stored).
pub fn generate() -> (String, String, [u8; 32]) {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    let mut raw = [0u8; PREFIX_LEN];
    rng.fill_bytes(&mut raw);
    let prefix: String = raw
        .iter()
        .map(|b| ALPHABET[usize::from(*b) % ALPHABET.len()] as char)
        .collect();
    let mut secret = [0u8; SECRET_BYTES];
    rng.fill_bytes(&mut secret);
    let key = format!("hc_{prefix}_{}", URL_SAFE_NO_PAD.encode(secret));
    let digest = hash(&key);
    (key, prefix, digest)
}

/// The caller of a `/v1` route: a well-formed key within its rate limit.
/// Whether the key is live, and whose it is, is asked in the request's own
/// transaction ([`crate::scope::Scope::begin`]).
#[derive(Debug, Clone)]
pub struct Caller(pub Presented);

impl FromRequestParts<Api> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, api: &Api) -> Result<Self, ApiError> {
        let presented = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer)
            .and_then(|k| parse(k.trim()))
            .ok_or_else(ApiError::unauthorized)?;
        api.limiter().check(&presented.hash)?;
        Ok(Caller(presented))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scheme's name is matched without regard to case, as HTTP says;
    /// `bearer hc_…` was refused 401. Mutation `bearer_case` (the exact
    /// `Bearer ` prefix again).
    #[test]
    fn the_bearer_scheme_is_matched_in_any_case() {
        for value in ["Bearer k1", "bearer k1", "BEARER k1"] {
            assert_eq!(bearer(value), Some("k1"), "{value}");
        }
        for value in ["Basic k1", "Bearerk1", "k1", ""] {
            assert_eq!(bearer(value), None, "{value}");
        }
    }

    #[test]
    fn a_generated_key_parses_to_its_prefix_and_hash() {
        let (key, prefix, digest) = generate();
        assert_eq!(key.len(), KEY_LEN);
        let p = parse(&key).unwrap();
        assert_eq!(p.prefix, prefix);
        assert_eq!(p.hash, digest);
        assert!(
            !format!("{p:?}").contains(&key[12..]),
            "Debug shows no secret"
        );
    }

    #[test]
    fn malformed_keys_are_refused() {
        let (key, _, _) = generate();
        for bad in [
            String::new(),
            "hc_".to_owned(),
            key[..key.len() - 1].to_owned(),
            format!("{key}A"),
            key.replacen("hc_", "hk_", 1),
            format!("hc_ABCDEFGH{}", &key[11..]),
            key.replace('_', "-"),
        ] {
            assert!(parse(&bad).is_none(), "{bad}");
        }
    }
}
