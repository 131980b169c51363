//! [`ConfigError`]: a layer setting refused when the layer is built.

use std::borrow::Cow;
use std::fmt;

/// A setting of a layer that cannot work, refused by the layer's builder (rather than
/// answering every request with 500).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    setting: &'static str,
    reason: Cow<'static, str>,
}

impl ConfigError {
    pub(crate) fn new(setting: &'static str, reason: impl Into<Cow<'static, str>>) -> Self {
        Self {
            setting,
            reason: reason.into(),
        }
    }

    /// The setting refused (`"wait timeout"`, `"kept headers"`, …).
    #[must_use]
    pub fn setting(&self) -> &'static str {
        self.setting
    }

    /// What is wrong with it.
    #[must_use]
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid idempotency layer setting `{}`: {}",
            self.setting, self.reason
        )
    }
}

impl std::error::Error for ConfigError {}
