//! Input validation shared by every entry point.

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
