//! The error type of the keyed runtime: debounce, throttle, idempotency.

use std::sync::Arc;
use std::time::Duration;

/// A boxed, shareable error from a user function or a store.
pub type BoxError = Arc<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong with a call on the keyed runtime.
///
/// Being throttled is not an error (see [`crate::ThrottleOutcome`]); this type
/// covers bad input, a stopped runtime, and a user function that failed,
/// panicked or took too long. Messages name the key; causes are kept as
/// [`source`](std::error::Error::source).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key is empty or too long.
    #[error("invalid key {key:?}: {reason}")]
    InvalidKey {
        /// The key (truncated to 64 bytes).
        key: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A duration, cap or other argument is out of range.
    #[error("invalid {what} for key {key:?}: {reason}")]
    InvalidArgument {
        /// The key the call was for.
        key: String,
        /// Which argument.
        what: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A setting of a prefixed primitive (a coalescing throttle's prefix,
    /// window or store timeout) is out of range.
    #[error("{}", setting_message(prefix, what, reason))]
    InvalidSetting {
        /// The prefix (truncated to 64 bytes).
        prefix: String,
        /// Which setting (`"prefix"`, `"window"`, …).
        what: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Runtime configuration is out of range.
    #[error("invalid runtime configuration: {what} {reason}")]
    InvalidConfig {
        /// Which setting.
        what: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The runtime already tracks its cap of keys.
    #[error("too many keys tracked (cap {cap}); key {key:?} was not accepted")]
    TooManyKeys {
        /// The key that was refused.
        key: String,
        /// The cap in force.
        cap: usize,
    },
    /// The runtime (or throttle) is shut down; the call was not accepted.
    #[error("shut down; call for key {key:?} was not accepted")]
    ShutDown {
        /// The key the call was for.
        key: String,
    },
    /// The runtime's root actor failed and the runtime has not been
    /// restarted yet ([`crate::Runtime::restart`]); the call was not
    /// accepted.
    #[error("runtime is down until restarted; call for key {key:?} was not accepted")]
    RuntimeDown {
        /// The key the call was for.
        key: String,
    },
    /// Accepted work was discarded before it ran: cancelled, or dropped by
    /// a shutdown or a destroyed throttle.
    #[error("pending call for key {key:?} was discarded: {reason}")]
    Discarded {
        /// The key the call was for.
        key: String,
        /// Why (`"cancelled"`, `"destroyed"`, `"dropped at shutdown"`,
        /// `"its process was lost"`, `"the runtime restarted"`; across
        /// instances also `"the instance owning its run was lost"` and
        /// `"discarded on another instance"`).
        reason: &'static str,
    },
    /// The user function returned an error.
    #[error("function for key {key:?} failed")]
    Failed {
        /// The key.
        key: String,
        /// The function's error.
        #[source]
        source: BoxError,
    },
    /// The user function panicked.
    #[error("function for key {key:?} panicked: {message}")]
    Panicked {
        /// The key.
        key: String,
        /// The panic message.
        message: String,
    },
    /// Waiting for the run covering this call took longer than allowed.
    #[error("timed out after {after:?} waiting on key {key:?}")]
    Timeout {
        /// The key.
        key: String,
        /// The timeout that elapsed.
        after: Duration,
    },
    /// An idempotency key was reused with a different fingerprint.
    #[error("idempotency key {key:?} was reused with a different fingerprint")]
    FingerprintMismatch {
        /// The key.
        key: String,
    },
    /// The key's result is of another type than the one asked for: the
    /// result stored for it (idempotency: it does not decode as this type),
    /// or the work in flight for it (a call of another result type is
    /// pending).
    #[error("key {key:?} holds a result of another type than the one asked for")]
    TypeMismatch {
        /// The key.
        key: String,
    },
    /// An idempotency key's function ran, but its result could not be
    /// stored: its encoding does not decode as its own type, say (the
    /// source is then a [`WireError::RoundTrip`](crate::store::WireError::RoundTrip)
    /// naming the type and why). The key is recorded as having run, so every
    /// later call of it gets this error instead of running the function
    /// again, until the record's TTL ends or the key is reset.
    #[error("idempotency key {key:?} ran, but its result could not be stored")]
    Unstorable {
        /// The key.
        key: String,
        /// Why the result could not be stored.
        #[source]
        source: BoxError,
    },
    /// A transactional run (`PostgresStore::run_in_transaction`) was taken
    /// over before it could commit: its transaction was rolled back, so
    /// nothing of it was committed. (A run or reservation whose work ran and
    /// was not recorded is [`IdempotencyOutcome::Unrecorded`](crate::IdempotencyOutcome::Unrecorded)
    /// or [`Error::NotRecorded`].)
    #[error("lease on idempotency key {key:?} lapsed before completion")]
    LeaseLost {
        /// The key.
        key: String,
    },
    /// An idempotency holder's work ran (a reservation's result was produced), but its
    /// result was not recorded as the key's, for `reason`; the key was not released for
    /// another run by it. The value is the caller's own (see
    /// [`IdempotencyOutcome::Unrecorded`](crate::IdempotencyOutcome::Unrecorded) for runs).
    #[error("idempotency key {key:?} ran, but its result was not recorded: {reason}")]
    NotRecorded {
        /// The key.
        key: String,
        /// Why.
        reason: NotRecorded,
        /// The store's last error, when a store failure is why.
        #[source]
        source: Option<BoxError>,
    },
    /// Another call holds this idempotency key and is still running, and
    /// this call asked not to wait
    /// ([`InFlight::Reject`](crate::idempotency::InFlight::Reject)); try again after
    /// `retry_after` (Stripe's `idempotency_key_in_use`, HTTP 409).
    #[error("idempotency key {key:?} is in flight; retry after {retry_after:?}")]
    InFlight {
        /// The key.
        key: String,
        /// When a retry may find the key completed (or free to take over).
        retry_after: Duration,
    },
    /// The call was made outside a tokio runtime.
    #[error("no tokio runtime: throttlebeam must be called from inside a tokio runtime")]
    NoTokio,
    /// The runtime could not start its supervision tree.
    #[error("runtime failed to start")]
    Start(#[source] BoxError),
    /// A store could not be reached.
    #[error("store unavailable for key {key:?}")]
    StoreUnavailable {
        /// The key.
        key: String,
        /// The store's error.
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// The key this error is about, when it has one.
    #[must_use]
    pub fn key(&self) -> Option<&str> {
        match self {
            Self::InvalidKey { key, .. }
            | Self::InvalidArgument { key, .. }
            | Self::TooManyKeys { key, .. }
            | Self::ShutDown { key }
            | Self::RuntimeDown { key }
            | Self::Discarded { key, .. }
            | Self::Failed { key, .. }
            | Self::Panicked { key, .. }
            | Self::Timeout { key, .. }
            | Self::FingerprintMismatch { key }
            | Self::TypeMismatch { key }
            | Self::Unstorable { key, .. }
            | Self::LeaseLost { key }
            | Self::NotRecorded { key, .. }
            | Self::InFlight { key, .. }
            | Self::StoreUnavailable { key, .. } => Some(key),
            Self::InvalidSetting { prefix, .. } => Some(prefix),
            Self::InvalidConfig { .. } | Self::NoTokio | Self::Start(_) => None,
        }
    }

    /// The user function panicked with `panic`.
    pub(crate) fn panicked(key: &str, panic: &throttlebeam_supervisors::Panic) -> Self {
        Self::Panicked {
            key: crate::key::shown(key),
            message: panic.message().to_owned(),
        }
    }

    /// A per-key process ended without handing back the result it owed.
    pub(crate) fn process_lost(key: &str) -> Self {
        Self::Discarded {
            key: crate::key::shown(key),
            reason: "its process was lost",
        }
    }

    /// The outcome of a user function run under `catch_panic`.
    pub(crate) fn from_run<T, E>(
        key: &str,
        caught: Result<Result<T, E>, throttlebeam_supervisors::Panic>,
    ) -> Result<T, Self>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    {
        match caught {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(Self::failed(key, e)),
            Err(panic) => Err(Self::panicked(key, &panic)),
        }
    }

    pub(crate) fn failed<E>(key: &str, source: E) -> Self
    where
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    {
        Self::Failed {
            key: key.to_owned(),
            source: Arc::from(source.into()),
        }
    }
}

/// Why a function that ran and succeeded was not recorded as its key's result
/// ([`IdempotencyOutcome::Unrecorded`](crate::IdempotencyOutcome::Unrecorded), [`Error::NotRecorded`](crate::Error::NotRecorded)).
///
/// None of these releases the key for another run: the claim holds until it lapses in the
/// store (a lease after the holder's last renewal), or the key stays recorded as run
/// ([`NotRecorded::Unstorable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NotRecorded {
    /// This holder's claim was taken over before its result was stored: its lease lapsed in
    /// the shared store while it ran (its instance was cut off from the store, or paused,
    /// for longer than the lease). The key's result, if any, is the new holder's, whose
    /// function may run too.
    LeaseLost,
    /// The shared store refused the result (it answered that it did nothing: `OOM`,
    /// `NOPERM`, `READONLY`, a standby) until the claim certainly lapsed there: a retry after
    /// the lapse may run the function again.
    StoreUnavailable,
    /// The shared store did not confirm the result before the claim certainly lapsed there
    /// (no answer: an outage, a partition, a paused server, for longer than the lease), and a
    /// try that was sent may still land: the store may hold the result or not. A retry
    /// replays it if it does, and may run the function again if it does not.
    Unconfirmed,
    /// The runtime shut down before the result was stored, and its results lived in this
    /// runtime only (no shared store): nothing of it survives the runtime.
    ShutDown,
    /// The value cannot be stored for replays: its encoding does not read back as its type
    /// (a field skipped when serialized with no default, say). The key is recorded as run
    /// with the cause, so every later call gets [`Error::Unstorable`](crate::Error::Unstorable)
    /// instead of running the function again. Checked for every value with a shared store;
    /// in memory, for the first value of each type, so a type that a shared store could
    /// never replay is found where it is developed.
    Unstorable,
}

impl std::fmt::Display for NotRecorded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::LeaseLost => "its claim was taken over after its lease lapsed in the store",
            Self::StoreUnavailable => {
                "the store refused the result until the claim lapsed there"
            }
            Self::Unconfirmed => {
                "the store did not confirm the result before the claim lapsed there (it may still land)"
            }
            Self::ShutDown => "the runtime shut down before the result was stored",
            Self::Unstorable => "the result does not read back from its own encoding",
        })
    }
}

/// `error` and its sources, `: `-separated, for a log line.
pub(crate) fn with_causes(error: &(dyn std::error::Error + '_)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(inner) = cause {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        cause = inner.source();
    }
    text
}

fn setting_message(prefix: &str, what: &str, reason: &str) -> String {
    if what == "prefix" {
        format!("invalid prefix {prefix:?}: {reason}")
    } else {
        format!("invalid {what} for prefix {prefix:?}: {reason}")
    }
}

/// Checks a key: not empty, at most [`MAX_KEY_LEN`](crate::store::MAX_KEY_LEN) bytes.
#[inline]
pub(crate) fn check_key(key: &str) -> Result<(), Error> {
    // The accepted range in one comparison; the error is built out of line.
    if key.len().wrapping_sub(1) < crate::key::MAX_KEY_LEN {
        Ok(())
    } else {
        Err(invalid_key(key))
    }
}

#[cold]
#[inline(never)]
fn invalid_key(key: &str) -> Error {
    Error::InvalidKey {
        key: crate::key::shown(key),
        reason: crate::key::key_problem(key).unwrap_or("key is invalid"),
    }
}

/// Checks a duration that arms a timer: within the one duration range,
/// `MIN_DURATION ..= MAX_TIMER`.
#[inline]
pub(crate) fn check_timer(key: &str, what: &'static str, d: Duration) -> Result<(), Error> {
    // A hot path's check: two comparisons inline, the error built out of line.
    if d >= crate::key::MIN_DURATION && d <= crate::key::MAX_TIMER {
        Ok(())
    } else {
        Err(invalid_timer(key, what, d))
    }
}

#[cold]
#[inline(never)]
fn invalid_timer(key: &str, what: &'static str, d: Duration) -> Error {
    Error::InvalidArgument {
        key: crate::key::shown(key),
        what,
        reason: crate::key::duration_problem(d).unwrap_or("out of range"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_and_timer_checks_name_what_is_wrong() {
        assert!(matches!(check_key(""), Err(Error::InvalidKey { .. })));
        assert!(matches!(
            check_timer("k", "delay", Duration::from_micros(50)),
            Err(Error::InvalidArgument {
                reason: "must be at least 1 ms",
                ..
            })
        ));
    }
}
