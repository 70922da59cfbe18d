//! A setting that holds a secret: a database URL with its password, the
//! secrets key, the provider's secret key, SMTP credentials. `Debug` never
//! shows it, so a derived `Debug` of the settings or of [`crate::serve::Config`]
//! cannot leak one; the value is read only through [`Secret::expose`], at the
//! place that connects or signs.

use std::fmt;

/// A secret setting's text. `Debug` prints `<redacted>`; there is no `Display`.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The text, for the one call that needs it (a connect, a parse).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The text of a set, non-blank setting.
    pub fn set(setting: &Option<Secret>) -> Option<&str> {
        setting
            .as_ref()
            .map(|s| s.0.trim())
            .filter(|s| !s.is_empty())
    }
}

impl From<String> for Secret {
    fn from(text: String) -> Secret {
        Secret(text)
    }
}

impl From<&str> for Secret {
    fn from(text: &str) -> Secret {
        Secret(text.to_owned())
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_text() {
        let s = Secret::from("postgres://app:hunter2@db/hardcount");
        assert_eq!(format!("{s:?}"), "<redacted>");
        assert_eq!(format!("{:?}", Some(s.clone())), "Some(<redacted>)");
        assert_eq!(s.expose(), "postgres://app:hunter2@db/hardcount");
        assert_eq!(Secret::set(&Some(Secret::from("  "))), None);
    }
}
