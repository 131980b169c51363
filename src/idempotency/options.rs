//! Per-call settings of an idempotent run.

use std::sync::Arc;
use std::time::Duration;

use crate::error::Error;
use crate::key::{MAX_KEY_LEN, check_timer, shown};

/// Settings of one idempotent call: scope, fingerprint and its three times.
///
/// Every setting has a default (no scope, no fingerprint, TTL 24 h, lease
/// 30 s, wait timeout 30 s); the setters override one each. Settings are
/// checked when the call is made, not here.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use throttlebeam::IdempotencyOptions;
///
/// let options = IdempotencyOptions::new()
///     .with_scope("tenant-7")
///     .with_fingerprint("POST /charges amount=100")
///     .with_ttl(Duration::from_secs(3600))
///     .with_lease(Duration::from_secs(10))
///     .with_wait_timeout(Duration::from_secs(5));
/// assert_eq!(options.scope(), Some("tenant-7"));
/// assert_eq!(IdempotencyOptions::new().ttl(), IdempotencyOptions::DEFAULT_TTL);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct IdempotencyOptions {
    scope: Option<Arc<str>>,
    fingerprint: Option<Arc<str>>,
    ttl: Duration,
    lease: Duration,
    wait_timeout: Duration,
}

impl Default for IdempotencyOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotencyOptions {
    /// How long a completed result is replayed by default: 24 hours.
    pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);
    /// How long the first caller may hold a key by default: 30 seconds.
    pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
    /// How long a duplicate waits for the first caller by default: 30 seconds.
    pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(30);

    /// The defaults: no scope, no fingerprint, [`DEFAULT_TTL`](Self::DEFAULT_TTL),
    /// [`DEFAULT_LEASE`](Self::DEFAULT_LEASE) and
    /// [`DEFAULT_WAIT_TIMEOUT`](Self::DEFAULT_WAIT_TIMEOUT).
    pub fn new() -> Self {
        Self {
            scope: None,
            fingerprint: None,
            ttl: Self::DEFAULT_TTL,
            lease: Self::DEFAULT_LEASE,
            wait_timeout: Self::DEFAULT_WAIT_TIMEOUT,
        }
    }

    /// A namespace for keys, for example a tenant id: the same key in two
    /// scopes names two independent operations. Must be non-empty and at
    /// most [`MAX_KEY_LEN`] bytes.
    pub fn with_scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(Arc::from(scope.into()));
        self
    }

    /// Describes the request the key stands for (a digest of method, path
    /// and body, say). A key reused with another fingerprint fails with
    /// [`Error::FingerprintMismatch`] instead of replaying. Fingerprints are
    /// compared exactly, and "no fingerprint" only matches "no fingerprint".
    pub fn with_fingerprint(mut self, fingerprint: impl Into<String>) -> Self {
        self.fingerprint = Some(Arc::from(fingerprint.into()));
        self
    }

    /// How long a completed result is replayed (default 24 h).
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long the first caller may hold the key before another may take
    /// it over (default 30 s). Set it above your slowest operation.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long a duplicate waits for the first caller before failing with
    /// [`Error::Timeout`] (default 30 s).
    pub fn with_wait_timeout(mut self, wait_timeout: Duration) -> Self {
        self.wait_timeout = wait_timeout;
        self
    }

    /// The scope, if any.
    #[must_use]
    pub fn scope(&self) -> Option<&str> {
        self.scope.as_deref()
    }

    /// The fingerprint, if any.
    #[must_use]
    pub fn fingerprint(&self) -> Option<&str> {
        self.fingerprint.as_deref()
    }

    /// How long a completed result is replayed.
    #[must_use]
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// How long the first caller may hold the key.
    #[must_use]
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// How long a duplicate waits.
    #[must_use]
    pub fn wait_timeout(&self) -> Duration {
        self.wait_timeout
    }

    pub(crate) fn fingerprint_shared(&self) -> Option<Arc<str>> {
        self.fingerprint.clone()
    }

    /// Checks every setting for `key`; needs no clock read.
    pub(crate) fn check(&self, key: &str) -> Result<(), Error> {
        if let Some(scope) = self.scope.as_deref() {
            let reason = if scope.is_empty() {
                Some("must not be empty")
            } else if scope.len() > MAX_KEY_LEN {
                Some("is longer than 1024 bytes")
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(Error::InvalidArgument {
                    key: shown(key),
                    what: "scope",
                    reason,
                });
            }
        }
        // All three bound to the timer horizon, so `now + d` never overflows.
        check_timer(key, "ttl", self.ttl)?;
        check_timer(key, "lease", self.lease)?;
        check_timer(key, "wait timeout", self.wait_timeout)
    }
}
