//! Per-call settings of an idempotent run.

use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::error::Error;
use crate::error::check_timer;
use crate::key::{MAX_KEY_LEN, MAX_TIMER, MIN_DURATION, shown};

/// What a duplicate does when it finds its key in flight (another call
/// holds it and is still running).
///
/// # Examples
///
/// ```
/// use throttlebeam::{IdempotencyOptions, idempotency::InFlight};
///
/// // An HTTP handler answers 409 with `Retry-After` instead of holding the request.
/// let options = IdempotencyOptions::new().with_in_flight(InFlight::Reject);
/// assert_eq!(options.in_flight(), InFlight::Reject);
/// assert_eq!(IdempotencyOptions::new().in_flight(), InFlight::Wait);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum InFlight {
    /// Wait for the holder, up to the wait timeout, and replay its result
    /// (or take the key over if the holder fails or is gone). The default.
    #[default]
    Wait,
    /// Fail at once with [`Error::InFlight`], which carries a retry hint
    /// (Stripe's `idempotency_key_in_use`).
    Reject,
}

/// The SHA-256 digest of a fingerprint: all that is kept of it, so a
/// fingerprint of any size costs 32 bytes.
pub(crate) type Fingerprint = [u8; 32];

/// Settings of one idempotent call: scope, fingerprint, its three times and
/// what a duplicate does while the key is in flight.
///
/// Every setting has a default (no scope, no fingerprint, TTL 24 h, lease
/// 30 s, wait timeout 30 s, duplicates wait); the setters override one
/// each. Settings are checked when the call is made, not here.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use throttlebeam::{IdempotencyOptions, idempotency::InFlight};
///
/// let options = IdempotencyOptions::new()
///     .with_scope("tenant-7")
///     .with_fingerprint("POST /charges amount=100")
///     .with_ttl(Duration::from_secs(3600))
///     .with_lease(Duration::from_secs(10))
///     .with_wait_timeout(Duration::from_secs(5))
///     .with_in_flight(InFlight::Wait);
/// assert_eq!(options.scope(), Some("tenant-7"));
/// assert_eq!(IdempotencyOptions::new().ttl(), IdempotencyOptions::DEFAULT_TTL);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct IdempotencyOptions {
    scope: Option<Arc<str>>,
    fingerprint: Option<Fingerprint>,
    ttl: Duration,
    lease: Duration,
    wait_timeout: Duration,
    in_flight: InFlight,
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
            in_flight: InFlight::Wait,
        }
    }

    /// A namespace for keys, for example a tenant id: the same key in two
    /// scopes names two independent operations. Must be non-empty and at
    /// most [`MAX_KEY_LEN`] bytes.
    pub fn with_scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(Arc::from(scope.into()));
        self
    }

    /// Describes the request the key stands for (method, path and body, say).
    /// A key reused with another fingerprint fails with
    /// [`Error::FingerprintMismatch`] instead of replaying. Fingerprints are
    /// compared exactly, and "no fingerprint" only matches "no fingerprint".
    ///
    /// Only its SHA-256 digest is kept (here, with keys in flight and with
    /// stored results), so the fingerprint may be a whole request body: it
    /// costs 32 bytes whatever its size.
    pub fn with_fingerprint(mut self, fingerprint: impl AsRef<[u8]>) -> Self {
        self.fingerprint = Some(Sha256::digest(fingerprint.as_ref()).into());
        self
    }

    /// [`IdempotencyOptions::with_fingerprint`] for a caller that already holds a SHA-256
    /// digest of what it fingerprints: kept as it is, not hashed again.
    #[cfg(feature = "http")]
    pub(crate) fn with_fingerprint_digest(mut self, digest: Fingerprint) -> Self {
        self.fingerprint = Some(digest);
        self
    }

    /// How long a completed result is replayed (default 24 h).
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long the holder of a key may go without showing it is alive
    /// before another caller may take the key over (default 30 s).
    ///
    /// The holder renews its lease every third of it while its function
    /// runs (or while its [`IdempotencyReservation`] exists), so a live run
    /// is never taken over however long it takes. The lease only lapses
    /// when its holder is gone without releasing the key (its process
    /// ended, or, with a store shared by several instances, its instance
    /// stopped renewing). Shorter leases notice a gone holder sooner and
    /// cost more renewals. Renewal runs on the holder's tokio runtime: a
    /// function that blocks its worker thread for longer than the lease
    /// keeps it from renewing.
    ///
    /// [`IdempotencyReservation`]: crate::idempotency::IdempotencyReservation
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long a duplicate waits for the first caller before failing with
    /// [`Error::Timeout`] (default 30 s). Unused with [`InFlight::Reject`].
    pub fn with_wait_timeout(mut self, wait_timeout: Duration) -> Self {
        self.wait_timeout = wait_timeout;
        self
    }

    /// What a duplicate does when its key is in flight: wait for the
    /// holder (the default) or fail at once with [`Error::InFlight`].
    pub fn with_in_flight(mut self, in_flight: InFlight) -> Self {
        self.in_flight = in_flight;
        self
    }

    /// The scope, if any.
    #[must_use]
    pub fn scope(&self) -> Option<&str> {
        self.scope.as_deref()
    }

    /// The SHA-256 digest of the fingerprint, if any: the fingerprint
    /// itself is not kept.
    #[must_use]
    pub fn fingerprint_digest(&self) -> Option<&[u8; 32]> {
        self.fingerprint.as_ref()
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

    /// What a duplicate does when its key is in flight.
    #[must_use]
    pub fn in_flight(&self) -> InFlight {
        self.in_flight
    }

    pub(crate) fn fingerprint(&self) -> Option<Fingerprint> {
        self.fingerprint
    }

    /// Checks every setting for `key`; needs no clock read.
    #[inline]
    pub(crate) fn check(&self, key: &str) -> Result<(), Error> {
        // Every replay checks its options: the common case in a few comparisons, inline.
        let in_range = |d: Duration| (MIN_DURATION..=MAX_TIMER).contains(&d);
        // A scope is checked inline too: the HTTP layer scopes every request.
        let scope_ok = self
            .scope
            .as_deref()
            .is_none_or(|scope| !scope.is_empty() && scope.len() <= MAX_KEY_LEN);
        if scope_ok && in_range(self.ttl) && in_range(self.lease) && in_range(self.wait_timeout) {
            return Ok(());
        }
        self.check_each(key)
    }

    /// [`IdempotencyOptions::check`] one setting at a time, naming the one out of range.
    #[cold]
    #[inline(never)]
    fn check_each(&self, key: &str) -> Result<(), Error> {
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
