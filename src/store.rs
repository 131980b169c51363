//! Shared stores: the error type every store reports, the circuit breaker
//! that guards a remote store, and (feature `redis`) the Redis backend.
//!
//! This is the engine below every primitive, and it knows none of them:
//! connections, the breaker, the guarded call, the script cache, the
//! server's clock, and a pub/sub multiplexer whose channels and handlers
//! the primitives register. Each primitive's Redis adapter lives in its own
//! module (`idempotency`, `debounce`, `rate_limit`, `throttle`, `coalesce`).
//!
//! The in-memory stores live beside the seam they implement
//! ([`crate::coalesce::MemoryWindowStore`], the rate limiter's memory store, the
//! idempotency result table). A remote store is guarded by a circuit
//! breaker ([`BreakerConfig`]): after a run of consecutive failures it stops
//! sending commands for a cooldown, then lets one probe decide whether the
//! store is back.

mod breaker;
mod guard;
#[cfg(feature = "redis")]
pub(crate) mod redis;

use std::sync::Arc;
use std::time::Duration;

#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) use self::breaker::Breaker;
pub use self::breaker::{BreakerConfig, BreakerState, BreakerStats};
#[cfg(feature = "runtime")]
pub(crate) use self::guard::store_call;
pub(crate) use self::guard::{Fault, guard};
#[cfg(all(feature = "redis", any(test, feature = "test-util")))]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub use self::redis::SteppedClock;
#[cfg(feature = "redis")]
pub use self::redis::{
    REDIS_CA_FILE_ENV, REDIS_CLIENT_CERT_FILE_ENV, REDIS_CLIENT_KEY_FILE_ENV, REDIS_CLUSTER_ENV,
    REDIS_PASSWORD_ENV, REDIS_URL_ENV, REDIS_USERNAME_ENV, Redis, RedisBuilder, RedisStats,
};
pub use crate::key::MAX_KEY_LEN;
#[cfg(feature = "runtime")]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
pub use crate::wire::WireError;

/// Why a store could not answer.
///
/// A store failure is never a decision: each primitive maps it to its
/// failure policy (throttles fail open, idempotency fails closed, rate
/// limiting follows its `FailMode`).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store did not answer within the command timeout.
    #[error("store command timed out after {after:?}")]
    Timeout {
        /// The timeout that elapsed.
        after: Duration,
    },
    /// The circuit breaker is open: the store failed repeatedly and is
    /// skipped until its cooldown ends.
    #[error("store circuit breaker is open; next probe in {retry_in:?}")]
    BreakerOpen {
        /// Time until the breaker lets a probe through.
        retry_in: Duration,
    },
    /// The store could not be reached, or the command's fate is unknown (the connection
    /// broke after it was sent).
    #[error("store unavailable")]
    Unavailable(#[source] Arc<dyn std::error::Error + Send + Sync + 'static>),
    /// The store answered that it cannot serve the command now, and did not apply it: at
    /// `maxmemory` (`OOM`), loading its data (`LOADING`), busy with a slow script (`BUSY`), a
    /// replica since a failover (`READONLY`), no primary or replicas (`MASTERDOWN`,
    /// `NOREPLICAS`, `CLUSTERDOWN`, `TRYAGAIN`); PostgreSQL's read-only, resource,
    /// serialization and shutdown errors. A store fault (the breaker counts it), like
    /// [`StoreError::Unavailable`], except that nothing was done.
    #[error("store cannot serve now")]
    NotServing(#[source] Arc<dyn std::error::Error + Send + Sync + 'static>),
    /// The store answered with something this library did not expect.
    #[error("unexpected store reply: {0}")]
    Protocol(String),
    /// The store panicked while answering (a store of your own): the panic
    /// was caught at the store's boundary and never reaches the caller.
    #[error("store panicked: {message}")]
    Panicked {
        /// The panic's message.
        message: String,
    },
    /// The store's configuration is invalid.
    #[error("invalid store configuration: {0}")]
    Config(String),
    /// The store and this client did not trust each other: the server
    /// refused the username or password (an ACL user, `requirepass`) or a
    /// command the ACL user may not run, or the TLS handshake failed on
    /// trust (the server's certificate not signed by the CA given, or not
    /// naming the host; the client's certificate refused). Retrying does
    /// not help until the configuration changes; the cause says which.
    #[error("store authentication failed")]
    Auth(#[source] Arc<dyn std::error::Error + Send + Sync + 'static>),
    /// The store holds as many keys as it may.
    #[error("store is full: it holds its cap of {cap} keys")]
    Full {
        /// The cap.
        cap: usize,
    },
    /// A write the store applied but did not replicate to as many replicas as asked within
    /// the time allowed (`RedisBuilder::with_durable_claims`): it may be lost if its primary
    /// fails now. The store itself is up, so this does not count against the breaker.
    #[error(
        "store write reached {acknowledged} of the {wanted} replicas required within {within:?}"
    )]
    NotReplicated {
        /// Replicas that had to acknowledge the write.
        wanted: u32,
        /// Replicas that did.
        acknowledged: u32,
        /// How long the store waited for them.
        within: Duration,
    },
    /// Refused here, unsent: as many operations as may wait for the store already do (e.g.
    /// the Redis store's rate-limit queue, see `RedisBuilder::with_rate_limit_queue`).
    #[error("store is overloaded: {queued} operations already wait for it, its cap")]
    Overloaded {
        /// The operations waiting, the cap.
        queued: usize,
    },
}

impl StoreError {
    /// Wraps any error as [`StoreError::Unavailable`].
    pub fn unavailable<E>(source: E) -> Self
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        Self::Unavailable(Arc::new(source))
    }

    /// Whether this failure counts against the circuit breaker (the store
    /// misbehaved), as opposed to a refusal made locally.
    #[must_use]
    pub fn is_store_fault(&self) -> bool {
        matches!(
            self,
            Self::Timeout { .. }
                | Self::Unavailable(_)
                | Self::NotServing(_)
                | Self::Panicked { .. }
                | Self::Auth(_)
        )
    }

    /// Whether the command may have been applied although it failed: it was sent and no
    /// answer says it was not (a timeout, a connection broken after sending, a reply this
    /// library did not expect, a store that panicked). `false` for a refusal made before
    /// sending and for a store's own answer that it did nothing.
    #[must_use]
    pub fn may_have_been_applied(&self) -> bool {
        !matches!(
            self,
            Self::BreakerOpen { .. }
                | Self::Config(_)
                | Self::Full { .. }
                | Self::Overloaded { .. }
                | Self::NotServing(_)
                | Self::Auth(_)
        )
    }
}
