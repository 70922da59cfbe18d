//! Webhook signing secrets sealed at rest (issue 12, point 2; docs/adr/0015).
//!
//! A secret is stored as XChaCha20-Poly1305 ciphertext under an application
//! key from configuration (`HARDCOUNT_SECRETS_KEY`), never in clear: a
//! database dump, or a role that can read the table, holds nothing usable.
//!
//! ```text
//! HARDCOUNT_SECRETS_KEY = <id>:<base64 of 32 bytes>[,<id>:<base64>...]
//!                         the first key seals; every key listed opens
//! *_ciphertext          = nonce (24 random bytes) || ciphertext || tag (16)
//! *_key_id              = the id of the key that sealed it
//! associated data       = "hardcount/webhook-secret/v1" 0 key_id 0 tenant_id
//! ```
//!
//! The tenant is bound into the associated data, so a ciphertext copied onto
//! another tenant's endpoint does not open. Keys rotate by listing a new key
//! first, running `hardcount secrets rotate-key` (which reseals every secret
//! under it), then dropping the old key. Opened secrets live in [`Zeroizing`]
//! buffers, wiped when dropped; [`Keyring`] wipes its keys the same way and
//! never prints them.

use std::fmt;
use std::sync::Arc;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use rand::RngCore as _;
use zeroize::Zeroizing;

use crate::signature::{Secret, SecretError};

/// The setting that holds the keys.
pub const SECRETS_KEY_VAR: &str = "HARDCOUNT_SECRETS_KEY";

const NONCE_LEN: usize = 24;
const KEY_LEN: usize = 32;
const AAD_PREFIX: &[u8] = b"hardcount/webhook-secret/v1";

/// Why `HARDCOUNT_SECRETS_KEY` was refused. Never contains key material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyringError {
    #[error("{SECRETS_KEY_VAR} is empty; expected <id>:<base64 of 32 bytes>[,<id>:<base64>...]")]
    Empty,
    #[error("{SECRETS_KEY_VAR}: entry {0} is not <id>:<base64 of 32 bytes>")]
    Shape(usize),
    /// Not echoed: an entry written the wrong way round (`<base64>:<id>`)
    /// has its key where the id goes (docs/adr/0101).
    #[error(
        "{SECRETS_KEY_VAR}: entry {0}'s key id is not 1 to 32 of A-Z a-z 0-9 _ - (entries are <id>:<base64>)"
    )]
    BadId(usize),
    #[error("key id {0:?} must be 1 to 32 of A-Z a-z 0-9 _ -")]
    BadNewId(String),
    #[error("{SECRETS_KEY_VAR}: key {0:?} is not standard base64 of exactly 32 bytes")]
    BadKey(String),
    #[error("{SECRETS_KEY_VAR}: key id {0:?} is listed twice")]
    Duplicate(String),
}

/// Why a sealed secret did not open. Never contains the secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    #[error("sealed with key {0:?}, which {SECRETS_KEY_VAR} does not hold")]
    UnknownKey(String),
    #[error(
        "sealed secret does not open with key {0:?} (wrong key, or altered or moved ciphertext)"
    )]
    Corrupt(String),
    #[error(transparent)]
    Secret(#[from] SecretError),
}

/// A secret as stored: the key id and the sealed bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    pub key_id: String,
    pub ciphertext: Vec<u8>,
}

struct Key {
    id: String,
    cipher: XChaCha20Poly1305,
    /// Kept only to compare keyrings; wiped on drop.
    bytes: Zeroizing<[u8; KEY_LEN]>,
}

/// The application keys: the first seals, all open. Cheap to clone; its
/// `Debug` shows the key ids only.
#[derive(Clone)]
pub struct Keyring {
    keys: Arc<Vec<Key>>,
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids: Vec<&str> = self.keys.iter().map(|k| k.id.as_str()).collect();
        write!(f, "Keyring({ids:?})")
    }
}

impl PartialEq for Keyring {
    fn eq(&self, other: &Self) -> bool {
        self.keys.len() == other.keys.len()
            && self
                .keys
                .iter()
                .zip(other.keys.iter())
                .all(|(a, b)| a.id == b.id && *a.bytes == *b.bytes)
    }
}

impl Eq for Keyring {}

fn valid_id(id: &str) -> bool {
    (1..=32).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl Keyring {
    /// Parse `<id>:<base64 of 32 bytes>[,<id>:<base64>...]`.
    ///
    /// # Errors
    /// A [`KeyringError`] naming the setting and the entry; never the key.
    pub fn parse(text: &str) -> Result<Keyring, KeyringError> {
        let mut keys: Vec<Key> = Vec::new();
        for (i, entry) in text
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .enumerate()
        {
            let (id, encoded) = entry.split_once(':').ok_or(KeyringError::Shape(i + 1))?;
            let id = id.trim();
            if !valid_id(id) {
                return Err(KeyringError::BadId(i + 1));
            }
            let decoded = Zeroizing::new(
                STANDARD
                    .decode(encoded.trim())
                    .map_err(|_| KeyringError::BadKey(id.to_owned()))?,
            );
            let bytes: [u8; KEY_LEN] = decoded
                .as_slice()
                .try_into()
                .map_err(|_| KeyringError::BadKey(id.to_owned()))?;
            let bytes = Zeroizing::new(bytes);
            if keys.iter().any(|k| k.id == id) {
                return Err(KeyringError::Duplicate(id.to_owned()));
            }
            keys.push(Key {
                id: id.to_owned(),
                cipher: XChaCha20Poly1305::new(bytes.as_ref().into()),
                bytes,
            });
        }
        if keys.is_empty() {
            return Err(KeyringError::Empty);
        }
        Ok(Keyring {
            keys: Arc::new(keys),
        })
    }

    /// A fresh key entry, `<id>:<base64 of 32 random bytes>`, for
    /// `hardcount secrets generate-key`.
    ///
    /// # Errors
    /// [`KeyringError::BadNewId`] for an id that could not be parsed back.
    pub fn generate_entry(id: &str) -> Result<Zeroizing<String>, KeyringError> {
        if !valid_id(id) {
            return Err(KeyringError::BadNewId(id.to_owned()));
        }
        let mut key = Zeroizing::new([0u8; KEY_LEN]);
        rand::rng().fill_bytes(key.as_mut());
        Ok(Zeroizing::new(format!(
            "{id}:{}",
            STANDARD.encode(key.as_ref())
        )))
    }

    /// The id of the key that seals.
    pub fn current_id(&self) -> &str {
        &self.keys[0].id
    }

    /// Whether `id` is among the keys.
    pub fn holds(&self, id: &str) -> bool {
        self.keys.iter().any(|k| k.id == id)
    }

    /// The key ids held, current first.
    pub fn ids(&self) -> Vec<String> {
        self.keys.iter().map(|k| k.id.clone()).collect()
    }

    fn aad(key_id: &str, tenant_id: &str) -> Vec<u8> {
        let mut aad = Vec::with_capacity(AAD_PREFIX.len() + key_id.len() + tenant_id.len() + 2);
        aad.extend_from_slice(AAD_PREFIX);
        aad.push(0);
        aad.extend_from_slice(key_id.as_bytes());
        aad.push(0);
        aad.extend_from_slice(tenant_id.as_bytes());
        aad
    }

    /// Seal `secret` for an endpoint of `tenant_id` under the current key.
    pub fn seal(&self, tenant_id: &str, secret: &Secret) -> Sealed {
        self.seal_text(tenant_id, &Zeroizing::new(secret.expose()))
    }

    /// Seal any text as [`Keyring::seal`] seals a secret's `whsec_` form
    /// (tests store malformed secrets this way).
    pub fn seal_text(&self, tenant_id: &str, plain: &str) -> Sealed {
        let key = &self.keys[0];
        let mut nonce = [0u8; NONCE_LEN];
        rand::rng().fill_bytes(&mut nonce);
        let sealed = key
            .cipher
            .encrypt(
                &XNonce::from(nonce),
                Payload {
                    msg: plain.as_bytes(),
                    aad: &Self::aad(&key.id, tenant_id),
                },
            )
            .expect("XChaCha20-Poly1305 seals any message under 256 GiB");
        let mut ciphertext = Vec::with_capacity(NONCE_LEN + sealed.len());
        ciphertext.extend_from_slice(&nonce);
        ciphertext.extend_from_slice(&sealed);
        Sealed {
            key_id: key.id.clone(),
            ciphertext,
        }
    }

    /// Open a secret sealed for `tenant_id`. The clear text is wiped before
    /// this returns; the [`Secret`] wipes its key when dropped.
    ///
    /// # Errors
    /// [`OpenError::UnknownKey`] for a key id not held, [`OpenError::Corrupt`]
    /// when authentication fails, [`OpenError::Secret`] when what opened is
    /// not a usable `whsec_` secret.
    pub fn open(
        &self,
        tenant_id: &str,
        key_id: &str,
        ciphertext: &[u8],
    ) -> Result<Secret, OpenError> {
        let key = self
            .keys
            .iter()
            .find(|k| k.id == key_id)
            .ok_or_else(|| OpenError::UnknownKey(key_id.to_owned()))?;
        if ciphertext.len() < NONCE_LEN {
            return Err(OpenError::Corrupt(key_id.to_owned()));
        }
        let (nonce, sealed) = ciphertext.split_at(NONCE_LEN);
        let nonce: [u8; NONCE_LEN] = nonce.try_into().expect("split at NONCE_LEN");
        let plain = Zeroizing::new(
            key.cipher
                .decrypt(
                    &XNonce::from(nonce),
                    Payload {
                        msg: sealed,
                        aad: &Self::aad(key_id, tenant_id),
                    },
                )
                .map_err(|_| OpenError::Corrupt(key_id.to_owned()))?,
        );
        let text =
            std::str::from_utf8(&plain).map_err(|_| OpenError::Corrupt(key_id.to_owned()))?;
        Ok(Secret::parse(text)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K1: &str = "k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    const K2: &str = "k2:ICEiIyQlJicoKSorLC0uLzAxMjM0NTY3ODk6Ozw9Pj8=";

    #[test]
    fn a_sealed_secret_opens_only_with_its_key_and_tenant() {
        let ring = Keyring::parse(K1).unwrap();
        let secret = Secret::generate();
        let sealed = ring.seal("tenant_a", &secret);
        assert_eq!(sealed.key_id, "k1");
        assert_eq!(sealed.ciphertext.len(), NONCE_LEN + 38 + 16);
        let text = secret.expose();
        assert!(
            !sealed
                .ciphertext
                .windows(8)
                .any(|w| text.as_bytes().windows(8).any(|t| t == w)),
            "the ciphertext holds no run of the clear text"
        );
        let opened = ring.open("tenant_a", "k1", &sealed.ciphertext).unwrap();
        assert_eq!(opened.expose(), text);

        assert_eq!(
            ring.open("tenant_b", "k1", &sealed.ciphertext).unwrap_err(),
            OpenError::Corrupt("k1".into())
        );
        let mut altered = sealed.ciphertext.clone();
        altered[30] ^= 1;
        assert!(matches!(
            ring.open("tenant_a", "k1", &altered),
            Err(OpenError::Corrupt(_))
        ));
        assert_eq!(
            ring.open("tenant_a", "k9", &sealed.ciphertext).unwrap_err(),
            OpenError::UnknownKey("k9".into())
        );
        // The same key under another id does not open it either: the id is bound.
        let renamed = Keyring::parse(&K1.replace("k1:", "k3:")).unwrap();
        assert!(renamed.open("tenant_a", "k3", &sealed.ciphertext).is_err());
    }

    #[test]
    fn the_first_key_seals_and_every_key_opens() {
        let old = Keyring::parse(K1).unwrap();
        let sealed = old.seal("t", &Secret::generate());
        let both = Keyring::parse(&format!("{K2}, {K1}")).unwrap();
        assert_eq!(both.current_id(), "k2");
        assert!(both.holds("k1") && both.holds("k2") && !both.holds("k3"));
        assert!(both.open("t", "k1", &sealed.ciphertext).is_ok());
        assert_eq!(both.seal("t", &Secret::generate()).key_id, "k2");
        let entry = Keyring::generate_entry("k4").unwrap();
        assert_eq!(Keyring::parse(&entry).unwrap().current_id(), "k4");
    }

    #[test]
    fn bad_settings_are_refused_by_name_without_the_key() {
        for (text, expected) in [
            ("", KeyringError::Empty),
            ("nocolon", KeyringError::Shape(1)),
            ("bad id:AAAA", KeyringError::BadId(1)),
            // Written the wrong way round: the key is where the id goes, and
            // is not echoed (it was, as the id, before docs/adr/0101).
            (
                &format!("{}:k1", K1.split_once(':').unwrap().1),
                KeyringError::BadId(1),
            ),
            ("k1:c2hvcnQ=", KeyringError::BadKey("k1".into())),
            ("k1:not base64!", KeyringError::BadKey("k1".into())),
            (&format!("{K1},{K1}"), KeyringError::Duplicate("k1".into())),
        ] {
            let err = Keyring::parse(text).unwrap_err();
            assert_eq!(err, expected, "{text}");
            let shown = err.to_string();
            assert!(shown.contains(SECRETS_KEY_VAR), "{shown}");
            assert!(
                !shown.contains("AAEC")
                    && !shown.contains("c2hvcnQ")
                    && !shown.contains(K1.split_once(':').unwrap().1),
                "{shown}"
            );
        }
        let shown = format!("{:?}", Keyring::parse(K1).unwrap());
        assert_eq!(shown, "Keyring([\"k1\"])");
    }
}
