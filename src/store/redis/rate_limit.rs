//! Rate limiting on Redis: [`Redis`] as an
//! [`AsyncRateLimitStore`] for every built-in strategy and every [`Tiered`] combination of
//! them, so limiters on several instances share one limit.
//!
//! # One script call per decision
//!
//! Every [`RateLimitOp`] (check, reserve, peek, forecast, reset) of every strategy is one call
//! of one Lua script (`EVALSHA`, loading it on `NOSCRIPT`), which runs the strategies' own
//! integer maths on the server, atomically: a [`Tiered`] limit charges every tier or none in
//! that same call. The strategy's parameters travel as plain integers (see
//! [`ScriptedStrategy`]); the state of a key lives at `{prefix:key}:r` (all tiers in one
//! value, so one cluster slot), in microseconds exactly as the Rust strategies keep it, and
//! expires (`PX`) once it is at rest, when it is equal to no state at all.
//!
//! # Bit for bit
//!
//! Every value the maths reaches stays an integer below 2^53, so a Lua number (a double)
//! holds it exactly and divisions go through `fmod`, which is exact: decisions, forecasts and
//! reservations are identical to [`MemoryRateLimitStore`](crate::rate_limit::MemoryRateLimitStore)'s
//! for the same inputs (a property test compares every field). The store checks that range
//! before sending: a tier whose state could run more than about 158 years ahead of the
//! strategies' time ceiling (a GCRA of one per period with a burst window that long, or a
//! token bucket that long to refill) is refused with [`RateLimitError::TooLarge`].
//!
//! # Time
//!
//! The script reads the server's `TIME`, so instances with skewed clocks agree; the
//! limiter's clock (the request's `now_ms`) is not used. Tests pin the script's time with
//! `Redis::pin_time`; while pinned, keys are kept an hour longer than their state lives,
//! since the server expires them on its own clock.
//!
//! # Failures
//!
//! A store failure (timeout, connection refused, breaker open, an unexpected reply) is
//! [`RateLimitError::Store`], which an `Enforcer` (feature `http`) maps to its `FailMode`:
//! admit or refuse. The command timeout and the circuit breaker of [`Redis`] bound every
//! call. A cost above what the strategy can ever admit is
//! [`RateLimitError::InsufficientCapacity`], decided before any round trip, as in memory.

use std::future::Future;
use std::sync::OnceLock;

use redis::Script;

use super::{Redis, cached};
use crate::rate_limit::{
    AsyncRateLimitStore, Decision, FixedWindow, Forecast, Gcra, InsufficientCapacity, LeakyBucket,
    RateLimitError, RateLimitOp, RateLimitReply, RateLimitRequest, ScriptedStrategy,
    ShaperReservation, SlidingWindow, TIME_CEILING_US, TierParams, Tiered, TokenBucket,
};
use crate::store::StoreError;

const SCRIPT_BODY: &str = include_str!("rate_limit.lua");

/// The exact integer range of a Lua number.
const MAX_EXACT: u64 = 1 << 53;

/// How far ahead of the time ceiling a tier's times may run and stay exact in Lua.
const MAX_HORIZON_US: u64 = MAX_EXACT - TIME_CEILING_US;

/// How long a key outlives the rest point of its state: 1 ms on the server's clock covers
/// the rounding between the script's `TIME` and the server's expiry clock.
const SLACK_MS: u64 = 1;

/// The same while the time is pinned: the server still expires keys on its own clock, which
/// has nothing to do with the pinned one, so keys linger (a state at rest is equal to no
/// state, so keeping it longer never changes a decision).
const PINNED_SLACK_MS: u64 = 3_600_000;

/// A tier as the script reads it: its kind letter and four numbers.
fn kind(tier: &TierParams) -> (char, [u64; 4]) {
    match *tier {
        TierParams::Emission {
            shaper,
            limit,
            period_us,
            per,
            tolerance,
        } => (
            if shaper { 'l' } else { 'g' },
            [limit, period_us, per, tolerance],
        ),
        TierParams::TokenBucket {
            capacity,
            per_us,
            refill,
        } => ('t', [capacity, capacity, per_us, refill]),
        TierParams::Window {
            sliding,
            limit,
            window_us,
        } => (if sliding { 's' } else { 'f' }, [limit, window_us, 0, 0]),
    }
}

/// A reply field as a `u64`.
fn field(reply: &[i64], i: usize) -> Result<u64, StoreError> {
    reply
        .get(i)
        .and_then(|v| u64::try_from(*v).ok())
        .ok_or_else(|| StoreError::Protocol(format!("rate limit script replied {reply:?}")))
}

fn decode(reply: &[i64]) -> Result<RateLimitReply, StoreError> {
    let f = |i| field(reply, i);
    Ok(match f(0)? {
        1 => RateLimitReply::Decision(Decision {
            allowed: f(1)? == 1,
            limit: f(2)?,
            remaining: f(3)?,
            reset_at_ms: f(4)?,
            retry_after_ms: f(5)?,
        }),
        2 => RateLimitReply::Forecast(Forecast {
            spendable_now: f(1)?,
            next_replenish_at_ms: f(2)?,
            full_at_ms: f(3)?,
        }),
        3 if f(1)? == 1 => {
            RateLimitReply::Reservation(ShaperReservation::Granted { delay_ms: f(2)? })
        }
        3 => RateLimitReply::Reservation(ShaperReservation::QueueFull {
            retry_after_ms: f(2)?,
        }),
        4 => RateLimitReply::Reset,
        _ => {
            return Err(StoreError::Protocol(format!(
                "rate limit script replied {reply:?}"
            )));
        }
    })
}

impl Redis {
    /// Runs `request` as one script call.
    async fn rate_limit<S: ScriptedStrategy>(
        &self,
        request: RateLimitRequest<'_, S>,
    ) -> Result<RateLimitReply, RateLimitError> {
        let (op, cost) = match request.op {
            RateLimitOp::Check { cost } => ("c", Some(cost)),
            RateLimitOp::Reserve { cost } => ("r", Some(cost)),
            RateLimitOp::Peek => ("p", None),
            RateLimitOp::Forecast { cost } => ("f", Some(cost)),
            RateLimitOp::Reset => ("x", None),
        };
        let capacity = request.strategy.limit();
        if let RateLimitOp::Check { cost } | RateLimitOp::Reserve { cost } = request.op
            && u64::from(cost.get()) > capacity
        {
            return Err(InsufficientCapacity {
                cost: cost.get(),
                capacity,
            }
            .for_key(request.key));
        }
        let mut tiers = Vec::with_capacity(2);
        request.strategy.push_tiers(&mut tiers);
        if tiers.iter().any(|t| t.horizon_us() > MAX_HORIZON_US) {
            return Err(RateLimitError::TooLarge {
                what: "a time to refill from empty of over 5 * 10^15 µs, for the Redis store,",
            });
        }

        static SCRIPT: OnceLock<Script> = OnceLock::new();
        let pinned = self.pinned();
        let slack = if pinned.is_empty() {
            SLACK_MS
        } else {
            PINNED_SLACK_MS
        };
        let tiers: Vec<_> = tiers.iter().map(kind).collect();
        let kinds: String = tiers.iter().map(|(k, _)| k).collect();
        let mut call = cached(&SCRIPT, SCRIPT_BODY, true).prepare_invoke();
        call.key(self.key(request.key, ":r"))
            .arg(pinned)
            .arg(op)
            .arg(cost.map_or(1, |c| c.get()))
            .arg(slack)
            .arg(kinds);
        for (_, numbers) in &tiers {
            for n in numbers {
                call.arg(n);
            }
        }
        let reply: Vec<i64> = self
            .invoke(&call)
            .await
            .map_err(|e| RateLimitError::store(request.key, e))?;
        decode(&reply).map_err(|e| RateLimitError::store(request.key, e))
    }
}

// `impl<S: ScriptedStrategy> AsyncRateLimitStore<S> for Redis` would be rejected (E0119): it
// overlaps the blanket `impl<S, St: RateLimitStore<S>> AsyncRateLimitStore<S> for St`, since
// another crate may implement `RateLimitStore<ItsStrategy>` for `Redis` (coherence does not
// know `ScriptedStrategy` is sealed). One impl per concrete strategy, and one for `Tiered`
// (no other crate can implement a trait of ours for `Redis` and `Tiered<_, _>`, none of them
// its own type), cannot overlap. The same is said on `Redis`, where users see it.
macro_rules! scripted_store {
    ($($strategy:ty),+ $(,)?) => {$(
        /// One script call per operation, on the server's clock (see [`Redis`]).
        impl AsyncRateLimitStore<$strategy> for Redis {
            fn apply_async(
                &self,
                request: RateLimitRequest<'_, $strategy>,
            ) -> impl Future<Output = Result<RateLimitReply, RateLimitError>> + Send {
                self.rate_limit(request)
            }
        }
    )+};
}

scripted_store!(Gcra, TokenBucket, FixedWindow, SlidingWindow, LeakyBucket);

/// Every tier charged or none, in one script call (see [`Redis`]).
impl<A: ScriptedStrategy, B: ScriptedStrategy> AsyncRateLimitStore<Tiered<A, B>> for Redis {
    fn apply_async(
        &self,
        request: RateLimitRequest<'_, Tiered<A, B>>,
    ) -> impl Future<Output = Result<RateLimitReply, RateLimitError>> + Send {
        self.rate_limit(request)
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;
    use std::time::Duration;

    use super::*;
    use crate::store::redis::each_server;

    fn gcra() -> Gcra {
        Gcra::new(2, Duration::from_secs(1)).unwrap()
    }

    async fn apply<S: ScriptedStrategy>(
        redis: &Redis,
        strategy: &S,
        key: &str,
        op: RateLimitOp,
    ) -> Result<RateLimitReply, RateLimitError>
    where
        Redis: AsyncRateLimitStore<S>,
    {
        redis
            .apply_async(RateLimitRequest {
                key,
                now_ms: 0,
                strategy,
                op,
            })
            .await
    }

    #[test]
    fn replies_decode_or_are_protocol_errors() {
        assert_eq!(
            decode(&[1, 0, 2, 0, 1_500, 500]).unwrap(),
            RateLimitReply::Decision(Decision {
                allowed: false,
                limit: 2,
                remaining: 0,
                reset_at_ms: 1_500,
                retry_after_ms: 500,
            })
        );
        assert_eq!(
            decode(&[3, 1, 100]).unwrap(),
            RateLimitReply::Reservation(ShaperReservation::Granted { delay_ms: 100 })
        );
        assert_eq!(decode(&[4]).unwrap(), RateLimitReply::Reset);
        for bad in [&[][..], &[1, 1, 2][..], &[2, -1, 0, 0][..], &[9][..]] {
            assert!(
                matches!(decode(bad), Err(StoreError::Protocol(_))),
                "{bad:?}"
            );
        }
    }

    #[tokio::test]
    async fn state_is_stored_in_microseconds_and_expires_at_rest() {
        each_server("rate_limit_state_and_expiry", async |redis: Redis| {
            let check = RateLimitOp::Check {
                cost: NonZeroU32::MIN,
            };
            redis.pin_time(1_000);
            apply(&redis, &gcra(), "k", check).await.unwrap();
            let stored: Option<String> = redis
                .query(redis::cmd("GET").arg(redis.key("k", ":r")))
                .await
                .unwrap();
            assert_eq!(stored.as_deref(), Some("g 1500000 0"));
            // On the server's clock, the key lives until its state is at rest (+1 ms).
            redis.unpin_time();
            apply(&redis, &gcra(), "k2", check).await.unwrap();
            let left: i64 = redis
                .query(redis::cmd("PTTL").arg(redis.key("k2", ":r")))
                .await
                .unwrap();
            assert!((1..=501).contains(&left), "{left}");
            apply(&redis, &gcra(), "k2", RateLimitOp::Reset)
                .await
                .unwrap();
            let exists: i64 = redis
                .query(redis::cmd("EXISTS").arg(redis.key("k2", ":r")))
                .await
                .unwrap();
            assert_eq!(exists, 0);
        })
        .await;
    }

    #[tokio::test]
    async fn a_key_of_another_strategy_is_a_store_error_and_too_wide_a_tier_is_refused() {
        each_server("rate_limit_other_strategy", async |redis: Redis| {
            let check = RateLimitOp::Check {
                cost: NonZeroU32::MIN,
            };
            apply(&redis, &gcra(), "mixed", check).await.unwrap();
            let window = FixedWindow::new(2, Duration::from_secs(1)).unwrap();
            let err = apply(&redis, &window, "mixed", check).await.unwrap_err();
            assert!(err.is_store(), "{err:?}");
            // One per second with a burst of 2^32 - 1: a burst window of 136 years, fine;
            // a bucket of 6,000,000 tokens refilling one per 1000 s (190 years) is not.
            let wide = Gcra::per_second(NonZeroU32::MIN).with_burst(NonZeroU32::MAX);
            apply(&redis, &wide, "wide", check).await.unwrap();
            let slow = TokenBucket::new(6_000_000, 1, Duration::from_secs(1_000)).unwrap();
            let err = apply(&redis, &slow, "slow", check).await.unwrap_err();
            assert!(matches!(err, RateLimitError::TooLarge { .. }), "{err:?}");
        })
        .await;
    }
}
