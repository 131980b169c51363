//! Input validation shared by every entry point.

use std::borrow::Borrow;
use std::hash::{Hash, Hasher};
use std::time::Duration;

use crate::error::Error;

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 1024;

/// Longest delay a timer accepts (tokio's timer wheel horizon, about 2.2 years).
pub const MAX_TIMER: Duration = Duration::from_millis((1 << 36) - 1);

/// A key shortened for error messages.
pub(crate) fn shown(key: &str) -> String {
    if key.len() <= 64 {
        return key.to_owned();
    }
    let mut end = 64;
    while !key.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &key[..end])
}

/// Checks a key: not empty, at most [`MAX_KEY_LEN`] bytes.
pub(crate) fn check_key(key: &str) -> Result<(), Error> {
    if key.is_empty() {
        return Err(Error::InvalidKey {
            key: String::new(),
            reason: "key is empty",
        });
    }
    if key.len() > MAX_KEY_LEN {
        return Err(Error::InvalidKey {
            key: shown(key),
            reason: "key is longer than 1024 bytes",
        });
    }
    Ok(())
}

/// Checks a duration that arms a timer: non-zero and schedulable.
pub(crate) fn check_timer(key: &str, what: &'static str, d: Duration) -> Result<(), Error> {
    if d.is_zero() {
        return Err(Error::InvalidArgument {
            key: shown(key),
            what,
            reason: "must be greater than zero",
        });
    }
    if d > MAX_TIMER {
        return Err(Error::InvalidArgument {
            key: shown(key),
            what,
            reason: "too large to schedule (over 2^36 - 1 ms)",
        });
    }
    Ok(())
}

/// Keys up to this many bytes live inside the map entry.
pub(crate) const INLINE_KEY: usize = 22;

/// A key as stored in a registry or store. Short keys (ids, IPs) are kept
/// inline, so a lookup compares them without chasing a pointer to another
/// cache line; longer ones go to the heap. Looked up by its bytes.
#[derive(Debug, Clone)]
pub(crate) enum InlineKey {
    Inline { len: u8, bytes: [u8; INLINE_KEY] },
    Heap(Box<[u8]>),
}

impl InlineKey {
    #[inline]
    pub(crate) fn new(key: &str) -> Self {
        Self::from_bytes(key.as_bytes())
    }

    #[inline]
    fn from_bytes(raw: &[u8]) -> Self {
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

    #[inline]
    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Self::Heap(bytes) => bytes,
        }
    }
}

impl From<Vec<u8>> for InlineKey {
    #[inline]
    fn from(raw: Vec<u8>) -> Self {
        if raw.len() <= INLINE_KEY {
            Self::from_bytes(&raw)
        } else {
            Self::Heap(raw.into_boxed_slice())
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
