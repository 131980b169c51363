//! [`Enforcer`]: a limiter with a fail policy, headers and callbacks, for transports.

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;

use super::store::{AsyncRateLimitStore, MemoryRateLimitStore, RateLimitStore};
use super::{Decision, HeaderOptions, Limiter, RateLimitError, Strategy};

/// What to do when the store fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum FailMode {
    /// Admit the request (availability over strictness).
    #[default]
    Open,
    /// Refuse the request (strictness over availability).
    Closed,
}

/// How an enforcement ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EnforceOutcome {
    /// The limiter allowed the request.
    Ok,
    /// The limiter denied the request.
    Limited,
    /// The store failed; the fail policy decided.
    Error,
    /// The request itself was bad (an empty or over-long key): it is refused whatever the
    /// fail policy.
    Invalid,
    /// The limit cannot admit the request however long it waits (a cost above the
    /// strategy's capacity): the server's configuration, refused and logged at error.
    Misconfigured,
}

/// The result of [`Enforcer::enforce`]: whether to proceed, why, and the headers to send.
#[derive(Debug, Clone)]
pub struct Enforcement {
    /// Whether the request may proceed.
    pub allowed: bool,
    /// How the enforcement ended.
    pub outcome: EnforceOutcome,
    /// The limiter's decision (`None` when the store failed or the request was invalid).
    pub decision: Option<Decision>,
    /// Rate-limit headers for the response (empty when the store failed or the request was
    /// invalid: nothing is known).
    pub headers: HeaderMap,
}

type OnLimited = Arc<dyn Fn(&str, &Decision) + Send + Sync>;
type OnError = Arc<dyn Fn(&str, &RateLimitError) + Send + Sync>;

/// A [`Limiter`] plus what a transport needs around it: a [`FailMode`] for store outages,
/// [`HeaderOptions`], and callbacks on denials and on store errors.
///
/// It never returns an error: a store outage becomes an [`Enforcement`] with outcome
/// [`EnforceOutcome::Error`], allowed or not by the fail mode, after `on_error` has fired.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use throttlebeam::rate_limit::{EnforceOutcome, Enforcer, FailMode, Gcra, Limiter};
///
/// let enforcer = Enforcer::new(Limiter::new(Gcra::new(1, Duration::from_secs(60))?))
///     .with_fail_mode(FailMode::Closed)
///     .on_limited(|key, d| eprintln!("{key} limited for {} ms", d.retry_after_ms));
/// assert_eq!(enforcer.enforce("10.0.0.1").outcome, EnforceOutcome::Ok);
/// let denied = enforcer.enforce("10.0.0.1");
/// assert_eq!(denied.outcome, EnforceOutcome::Limited);
/// assert_eq!(denied.headers["retry-after"], "60");
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
#[must_use]
pub struct Enforcer<S: Strategy, St = MemoryRateLimitStore<<S as Strategy>::State>> {
    limiter: Limiter<S, St>,
    fail: FailMode,
    headers: HeaderOptions,
    on_limited: Option<OnLimited>,
    on_error: Option<OnError>,
}

impl<S: Strategy, St> fmt::Debug for Enforcer<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Enforcer")
            .field("limiter", &self.limiter)
            .field("fail", &self.fail)
            .field("headers", &self.headers)
            .finish_non_exhaustive()
    }
}

impl<S: Strategy, St> Enforcer<S, St> {
    /// Enforces `limiter`, failing open, with the draft headers whose policy window is the
    /// strategy's.
    pub fn new(limiter: Limiter<S, St>) -> Self {
        let window = Duration::from_millis(limiter.strategy().window_ms());
        Self {
            limiter,
            fail: FailMode::default(),
            headers: HeaderOptions::new().with_window(window),
            on_limited: None,
            on_error: None,
        }
    }

    /// Sets the store-outage policy.
    pub fn with_fail_mode(self, fail: FailMode) -> Self {
        Self { fail, ..self }
    }

    /// Chooses the headers; keeps the strategy's window unless `headers` sets one.
    pub fn with_headers(self, headers: HeaderOptions) -> Self {
        let headers = if headers.has_window() {
            headers
        } else {
            headers.with_window(Duration::from_millis(self.limiter.strategy().window_ms()))
        };
        Self { headers, ..self }
    }

    /// Calls `f` with the key and decision on every denial.
    pub fn on_limited(self, f: impl Fn(&str, &Decision) + Send + Sync + 'static) -> Self {
        Self {
            on_limited: Some(Arc::new(f)),
            ..self
        }
    }

    /// Calls `f` with the key and error whenever the store fails, before the fail policy.
    pub fn on_error(self, f: impl Fn(&str, &RateLimitError) + Send + Sync + 'static) -> Self {
        Self {
            on_error: Some(Arc::new(f)),
            ..self
        }
    }

    /// The limiter being enforced.
    #[must_use]
    pub fn limiter(&self) -> &Limiter<S, St> {
        &self.limiter
    }

    /// The store-outage policy.
    #[must_use]
    pub fn fail_mode(&self) -> FailMode {
        self.fail
    }

    fn settle(
        &self,
        key: &str,
        now_ms: u64,
        result: Result<Decision, RateLimitError>,
    ) -> Enforcement {
        match result {
            Ok(decision) => {
                let outcome = if decision.allowed {
                    EnforceOutcome::Ok
                } else {
                    if let Some(f) = &self.on_limited {
                        f(key, &decision);
                    }
                    EnforceOutcome::Limited
                };
                Enforcement {
                    allowed: decision.allowed,
                    outcome,
                    decision: Some(decision),
                    headers: self.headers.headers(&decision, now_ms),
                }
            }
            Err(err @ RateLimitError::InsufficientCapacity { .. }) => {
                tracing::error!(
                    key,
                    error = %err,
                    "rate limit misconfigured: the quota can never admit this cost; refusing"
                );
                Enforcement {
                    allowed: false,
                    outcome: EnforceOutcome::Misconfigured,
                    decision: None,
                    headers: HeaderMap::new(),
                }
            }
            Err(err) if !err.is_store() => {
                tracing::debug!(key, error = %err, "rate limit request refused");
                Enforcement {
                    allowed: false,
                    outcome: EnforceOutcome::Invalid,
                    decision: None,
                    headers: HeaderMap::new(),
                }
            }
            Err(err) => {
                let error: &(dyn std::error::Error + 'static) = &err;
                match self.fail {
                    FailMode::Open => tracing::warn!(
                        key,
                        error,
                        "rate limit store failed; failing open: the request passes unlimited \
                         (FailMode::Open), so this limit is not enforced while the store is down"
                    ),
                    FailMode::Closed => tracing::warn!(
                        key,
                        error,
                        "rate limit store failed; failing closed: the request is refused with \
                         503 (FailMode::Closed)"
                    ),
                }
                if let Some(f) = &self.on_error {
                    f(key, &err);
                }
                Enforcement {
                    allowed: self.fail == FailMode::Open,
                    outcome: EnforceOutcome::Error,
                    decision: None,
                    headers: HeaderMap::new(),
                }
            }
        }
    }
}

impl<S: Strategy, St: RateLimitStore<S>> Enforcer<S, St> {
    /// Spends one unit for `key`.
    pub fn enforce(&self, key: &str) -> Enforcement {
        self.enforce_n(key, NonZeroU32::MIN)
    }

    /// Spends `cost` units for `key`.
    pub fn enforce_n(&self, key: &str, cost: NonZeroU32) -> Enforcement {
        let now_us = self.limiter.now_us();
        let result = self.limiter.check_n_at(key, cost.get(), now_us);
        self.settle(key, now_us / 1_000, result)
    }
}

impl<S: Strategy, St: AsyncRateLimitStore<S>> Enforcer<S, St> {
    /// Spends `cost` units for `key` through an asynchronous store.
    pub async fn enforce_async(&self, key: &str, cost: NonZeroU32) -> Enforcement {
        let now_us = self.limiter.now_us();
        let result = self.limiter.check_n_async_at(key, cost.get(), now_us).await;
        self.settle(key, now_us / 1_000, result)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::rate_limit::{Gcra, RateLimitReply, RateLimitRequest};

    struct Down;

    impl RateLimitStore<Gcra> for Down {
        fn apply(
            &self,
            request: RateLimitRequest<'_, Gcra>,
        ) -> Result<RateLimitReply, RateLimitError> {
            Err(RateLimitError::store(request.key, "connection refused"))
        }
    }

    struct Capture(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn logged(f: impl FnOnce()) -> String {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let writer = Arc::clone(&lines);
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || Capture(Arc::clone(&writer)))
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        String::from_utf8(lines.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn the_fail_open_warning_says_the_limit_is_not_enforced() {
        let gcra = || Gcra::new(1, Duration::from_secs(1)).unwrap();
        let open = Enforcer::new(Limiter::builder(gcra()).with_store(Down).build());
        let text = logged(|| assert!(open.enforce("k").allowed));
        assert!(text.contains("WARN"), "{text}");
        assert!(text.contains("failing open"), "{text}");
        assert!(text.contains("not enforced"), "{text}");
        let closed = Enforcer::new(Limiter::builder(gcra()).with_store(Down).build())
            .with_fail_mode(FailMode::Closed);
        let text = logged(|| assert!(!closed.enforce("k").allowed));
        assert!(text.contains("failing closed"), "{text}");
    }

    #[test]
    fn a_cost_above_the_capacity_is_logged_at_error() {
        let enforcer = Enforcer::new(Limiter::new(Gcra::new(1, Duration::from_secs(1)).unwrap()));
        let text = logged(|| {
            let e = enforcer.enforce_n("k", NonZeroU32::new(2).unwrap());
            assert_eq!(e.outcome, EnforceOutcome::Misconfigured);
        });
        assert!(text.contains("ERROR"), "{text}");
        assert!(text.contains("exceeds the capacity"), "{text}");
    }
}
