//! Unit tests of the limiter's internals: queues, counters, overrides, clocks.

use super::*;
use crate::rate_limit::Gcra;

#[tokio::test(start_paused = true)]
async fn waiting_queues_are_removed_when_the_last_waiter_leaves() {
    let limiter = Limiter::new(Gcra::new(1, Duration::from_secs(1)).unwrap());
    limiter.check("k").unwrap();
    let (a, b) = tokio::join!(limiter.until_ready("k"), limiter.until_ready("k"));
    assert!(a.unwrap().allowed && b.unwrap().allowed);
    assert!(limiter.inner.queues.is_empty());
    // A cancelled waiter leaves too.
    let cancelled = tokio::time::timeout(Duration::from_millis(10), limiter.until_ready("k")).await;
    assert!(cancelled.is_err());
    assert!(limiter.inner.queues.is_empty());
}

/// A store that replies to every request with `Reset`.
struct Broken;

impl RateLimitStore<Gcra> for Broken {
    fn apply(&self, _: RateLimitRequest<'_, Gcra>) -> Result<RateLimitReply, RateLimitError> {
        Ok(RateLimitReply::Reset)
    }
}

#[test]
fn a_store_replying_the_wrong_kind_is_a_counted_store_error() {
    let limiter = Limiter::builder(Gcra::per_second(NonZeroU32::MIN))
        .with_store(Broken)
        .build();
    let err = limiter.check("k").unwrap_err();
    assert!(matches!(err, RateLimitError::Store { .. }), "{err:?}");
    let cause = std::error::Error::source(&err).map(ToString::to_string);
    assert!(
        cause.is_some_and(|c| c.contains("replied Reset")),
        "{err:?}"
    );
    let stats = limiter.stats();
    assert_eq!((stats.allowed, stats.denied, stats.errors), (0, 0, 1));
}

#[test]
fn overrides_and_namespaces_take_the_same_path_as_the_default() {
    let limiter = Limiter::builder(Gcra::per_second(NonZeroU32::new(2).unwrap()))
        .with_namespace("ns")
        .with_clock(crate::clock::ManualClock::new(0))
        .build();
    limiter
        .set_local_override("vip", Gcra::per_second(NonZeroU32::new(3).unwrap()))
        .unwrap();
    let remaining = |key| limiter.check(key).unwrap().remaining;
    assert_eq!((remaining("vip"), remaining("vip")), (2, 1));
    assert_eq!((remaining("k"), remaining("k")), (1, 0));
    assert!(!limiter.check("k").unwrap().allowed);
    assert_eq!(limiter.store().len(), 2);
    let stats = limiter.stats();
    assert_eq!((stats.allowed, stats.denied), (4, 1));
}

#[test]
fn the_crates_clocks_are_read_directly_and_others_through_their_trait() {
    let tokio = LimiterClock::new(TokioClock::new());
    assert!(matches!(tokio, LimiterClock::Tokio(_)));
    assert!(matches!(
        LimiterClock::new(QuantaClock::new()),
        LimiterClock::Quanta(_)
    ));
    let manual = crate::clock::ManualClock::new(5);
    let clock = LimiterClock::new(manual.clone());
    assert!(matches!(clock, LimiterClock::Other(_)));
    manual.advance_ms(1);
    assert_eq!(clock.now_us(), 6_000);
    let (a, b) = (tokio.now_us(), tokio.now_us());
    assert!(a <= b);
}
