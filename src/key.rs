//! Input validation shared by every entry point.

use std::borrow::Borrow;
use std::hash::{Hash, Hasher};
use std::time::Duration;

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 1024;

/// Longest delay a timer accepts (tokio's timer wheel horizon, about 2.2 years).
pub const MAX_TIMER: Duration = Duration::from_millis((1 << 36) - 1);

/// Longest prefix of a key quoted in an error message, in bytes.
pub(crate) const SHOWN_KEY_LEN: usize = 64;

/// The shortest duration accepted anywhere: timers, windows, periods.
pub(crate) const MIN_DURATION: Duration = Duration::from_millis(1);

/// A key shortened for error messages: at most [`SHOWN_KEY_LEN`] bytes (cut on a character
/// boundary) and an ellipsis. Every message quotes it as `{key:?}`.
pub(crate) fn shown(key: &str) -> String {
    if key.len() <= SHOWN_KEY_LEN {
        return key.to_owned();
    }
    let mut end = SHOWN_KEY_LEN;
    while !key.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &key[..end])
}

/// What is wrong with `key`, if anything: the one key rule of the crate (not empty, at most
/// [`MAX_KEY_LEN`] bytes). Each area maps the reason into its own error type.
#[inline]
pub(crate) fn key_problem(key: &str) -> Option<&'static str> {
    if key.is_empty() {
        Some("key is empty")
    } else if key.len() > MAX_KEY_LEN {
        Some("key is longer than 1024 bytes")
    } else {
        None
    }
}

/// What is wrong with a duration, if anything: the one duration range of the crate,
/// [`MIN_DURATION`] ..= [`MAX_TIMER`].
pub(crate) fn duration_problem(d: Duration) -> Option<&'static str> {
    if d.is_zero() {
        Some("must be greater than zero")
    } else if d < MIN_DURATION {
        Some("must be at least 1 ms")
    } else if d > MAX_TIMER {
        Some("too large to schedule (over 2^36 - 1 ms)")
    } else {
        None
    }
}

/// Keys up to this many bytes live inside the map entry.
pub(crate) const INLINE_KEY: usize = 22;

/// A key as stored in a registry or store. Short keys (ids, IPs) are kept
/// inline, so a lookup compares them without chasing a pointer to another
/// cache line; longer ones go to the heap, shared by every clone (a claim, its ticket, the
/// result stored and the results' eviction queue hold one allocation between them). Looked
/// up by its bytes.
#[derive(Debug, Clone)]
pub(crate) enum InlineKey {
    Inline { len: u8, bytes: [u8; INLINE_KEY] },
    Heap(std::sync::Arc<[u8]>),
}

impl InlineKey {
    #[inline]
    pub(crate) fn new(key: &str) -> Self {
        Self::from_bytes(key.as_bytes())
    }

    #[inline]
    pub(crate) fn from_bytes(raw: &[u8]) -> Self {
        if raw.len() <= INLINE_KEY {
            let mut bytes = [0; INLINE_KEY];
            bytes[..raw.len()].copy_from_slice(raw);
            // At most INLINE_KEY, so it fits a u8.
            Self::Inline {
                len: raw.len() as u8,
                bytes,
            }
        } else {
            Self::Heap(raw.into())
        }
    }

    /// The key as text: always, for a key made from a `&str`.
    #[cfg(feature = "runtime")]
    #[inline]
    pub(crate) fn as_str(&self) -> &str {
        std::str::from_utf8(self.as_bytes()).unwrap_or_default()
    }

    #[inline]
    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Self::Heap(bytes) => bytes,
        }
    }
}

/// Runs `f` on `key`'s slot in `registry`, building the stored key
/// straight into its inline form if the key is new.
#[cfg(feature = "runtime")]
pub(crate) fn update_slot<S, G: throttlebeam_supervisors::Stamp, R>(
    registry: &throttlebeam_supervisors::Registry<InlineKey, S, G>,
    key: &str,
    f: impl FnOnce(throttlebeam_supervisors::SlotEntry<'_, InlineKey, S, G>) -> R,
) -> R {
    registry.update_with(key.as_bytes(), || InlineKey::new(key), f)
}

impl From<Vec<u8>> for InlineKey {
    #[inline]
    fn from(raw: Vec<u8>) -> Self {
        if raw.len() <= INLINE_KEY {
            Self::from_bytes(&raw)
        } else {
            Self::Heap(raw.into())
        }
    }
}

// Hash and equality go through the bytes, as `Borrow<[u8]>` requires.
impl Hash for InlineKey {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl PartialEq for InlineKey {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for InlineKey {}

impl Borrow<[u8]> for InlineKey {
    #[inline]
    fn borrow(&self) -> &[u8] {
        self.as_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_key_rule() {
        assert_eq!(key_problem(""), Some("key is empty"));
        assert_eq!(key_problem(&"k".repeat(MAX_KEY_LEN)), None);
        assert_eq!(
            key_problem(&"k".repeat(MAX_KEY_LEN + 1)),
            Some("key is longer than 1024 bytes")
        );
    }

    #[test]
    fn one_duration_range() {
        assert_eq!(
            duration_problem(Duration::ZERO),
            Some("must be greater than zero")
        );
        assert_eq!(
            duration_problem(Duration::from_micros(999)),
            Some("must be at least 1 ms")
        );
        assert_eq!(duration_problem(MIN_DURATION), None);
        assert_eq!(duration_problem(MAX_TIMER), None);
        assert!(duration_problem(MAX_TIMER + Duration::from_millis(1)).is_some());
    }

    #[test]
    fn shown_cuts_long_keys_on_a_char_boundary() {
        let key = format!("{}é{}", "a".repeat(63), "b".repeat(100));
        let s = shown(&key);
        assert_eq!(s, format!("{}…", "a".repeat(63)));
        assert_eq!(shown("short"), "short");
    }
}
