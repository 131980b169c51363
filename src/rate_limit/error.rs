//! The error type of the rate-limiting area.

use std::error::Error as StdError;

/// What can go wrong in rate limiting: bad configuration or input, a store that failed, a
/// shaper queue that is full.
///
/// Being denied by a limiter is not an error: it is a [`Decision`](super::Decision) with
/// `allowed == false`. Callers who prefer `?` can turn a denial into
/// [`RateLimited`](super::RateLimited) with [`Decision::into_result`](super::Decision::into_result).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RateLimitError {
    /// A limit, quota or burst of zero.
    #[error("limit must be at least 1")]
    ZeroLimit,
    /// A period, window, queue length or sweep interval outside the crate's one duration
    /// range, 1 ms ..= 2^36 - 1 ms ([`MAX_TIMER`](crate::clock::MAX_TIMER)).
    #[error("invalid {what}: {reason}")]
    InvalidDuration {
        /// Which setting.
        what: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A quota finer than the strategies' resolution: more than one unit per microsecond.
    #[error("{what} of {units} per {period_us} µs is finer than one per microsecond")]
    TooFine {
        /// Which setting.
        what: &'static str,
        /// Units per period.
        units: u64,
        /// The period in microseconds.
        period_us: u64,
    },
    /// A token bucket with no room for a single token.
    #[error("capacity must be at least 1")]
    ZeroCapacity,
    /// A token bucket or shaper that never refills.
    #[error("refill rate must be at least 1")]
    ZeroRate,
    /// A configuration whose integer maths would exceed 2^53 (the exact range of a Redis Lua
    /// number), so it could not be reproduced bit for bit by a remote store.
    #[error("{what} is too large")]
    TooLarge {
        /// Which setting is out of range.
        what: &'static str,
    },
    /// An empty key, or one longer than [`MAX_KEY_LEN`](crate::store::MAX_KEY_LEN) bytes.
    #[error("invalid key {key:?}: {reason}")]
    InvalidKey {
        /// The key (truncated to 64 bytes).
        key: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A call with a cost of zero units.
    #[error("invalid cost for key {key:?}: must be at least 1")]
    ZeroCost {
        /// The key of the call (truncated to 64 bytes).
        key: String,
    },
    /// A cost larger than the limiter can ever admit at once (its burst, capacity, quota or
    /// queue slots): waiting would never help, so it is an error rather than a denial.
    #[error(
        "cost {cost} for key {key:?} exceeds the capacity {capacity}: it can never be admitted"
    )]
    InsufficientCapacity {
        /// The key of the call (truncated to 64 bytes).
        key: String,
        /// The cost that was asked for.
        cost: u32,
        /// The most the limiter admits at once.
        capacity: u64,
    },
    /// The leaky-bucket shaper's queue is full.
    #[error("shaper queue full for key {key:?}, retry after {retry_after_ms} ms")]
    QueueFull {
        /// The key of the call (truncated to 64 bytes).
        key: String,
        /// Milliseconds until a reservation of the same cost would be accepted.
        retry_after_ms: u64,
    },
    /// A policy name that cannot be written into a structured header field.
    #[error("invalid policy name `{name}`: use 1 to 64 printable ASCII characters")]
    InvalidPolicyName {
        /// The rejected name.
        name: String,
    },
    /// An IPv6 aggregation prefix longer than 128 bits.
    #[error("invalid ipv6 prefix length {0}: must be at most 128")]
    InvalidIpv6Prefix(u8),
    /// A trusted-proxy entry that is neither an IP address nor a CIDR block.
    #[cfg(feature = "http")]
    #[cfg_attr(docsrs, doc(cfg(feature = "http")))]
    #[error("invalid trusted proxy `{entry}`")]
    InvalidTrustedProxy {
        /// The rejected entry.
        entry: String,
        /// Why it did not parse.
        #[source]
        source: ipnet::AddrParseError,
    },
    /// An empty HMAC secret.
    #[error("hmac secret must not be empty")]
    EmptySecret,
    /// [`Limiter::spawn_sweeper`](super::Limiter::spawn_sweeper) was called outside a tokio
    /// runtime.
    #[error("no tokio runtime to run the sweeper on")]
    NoRuntime,
    /// The store failed while applying an operation.
    #[error("store failed for key {key:?}")]
    Store {
        /// The store key that was being updated (truncated to 64 bytes).
        key: String,
        /// What the store reported.
        #[source]
        source: Box<dyn StdError + Send + Sync + 'static>,
    },
}

impl RateLimitError {
    /// Wraps a store backend's failure for `key`.
    ///
    /// Store implementations use this so that every store reports outages the same way.
    pub fn store(key: &str, source: impl Into<Box<dyn StdError + Send + Sync + 'static>>) -> Self {
        Self::Store {
            key: crate::key::shown(key),
            source: source.into(),
        }
    }

    /// `key`'s problem under the crate's one key rule, if any.
    #[inline]
    pub(crate) fn check_key(key: &str) -> Result<(), Self> {
        match crate::key::key_problem(key) {
            None => Ok(()),
            Some(reason) => Err(Self::invalid_key(key, reason)),
        }
    }

    #[cold]
    #[inline(never)]
    fn invalid_key(key: &str, reason: &'static str) -> Self {
        Self::InvalidKey {
            key: crate::key::shown(key),
            reason,
        }
    }

    /// Whether this error is a store failure, which an [`Enforcer`](super::Enforcer) turns into
    /// its fail policy.
    #[must_use]
    pub fn is_store(&self) -> bool {
        matches!(self, Self::Store { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_errors_keep_their_cause() {
        let err = RateLimitError::store("k", std::io::Error::other("down"));
        assert_eq!(err.to_string(), r#"store failed for key "k""#);
        assert_eq!(
            err.source().map(ToString::to_string).as_deref(),
            Some("down")
        );
        assert!(err.is_store());
    }
}
