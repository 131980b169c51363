//! Rate limiting on Redis: [`Redis`] as an
//! [`AsyncRateLimitStore`] for every built-in strategy and every [`Tiered`] combination of
//! them, so limiters on several instances share one limit.
//!
//! # One script call per decision
//!
//! Every [`RateLimitOp`] (check, reserve, peek, forecast, reset) of every strategy is one call
//! of one Lua script (`EVALSHA`, sent again as `EVAL` on `NOSCRIPT`), which runs the
//! strategies' own integer maths on the server, atomically: a [`Tiered`] limit charges every
//! tier or none in that same call. A fresh key's first check is a plain `SET NX` instead (see
//! "Fresh keys").
//!
//! On a single node, operations that arrive while four calls are already in flight share the
//! next call: the batch script runs each of them in arrival order, each exactly as it would
//! run alone, at one `TIME`, and replies to each on its own (a key holding another
//! strategy's state, or a value of another type, fails only its own operation and is left as
//! it is). The batch reads every state with one `MGET`; an operation on a key that an earlier
//! one of the batch wrote sees that write, and a key that already holds a state is written
//! once at the end of the batch, however many of its operations it carries (a hot key: a
//! global or per-tenant limit). A lone caller never waits for a batch: an
//! operation that finds a call slot free goes at once. Each decision still takes one round
//! trip; under load the call's fixed cost (the round trip, the script's start, the `TIME`,
//! the read of the states) is spread over every operation in it. The queue is bounded
//! (`RedisBuilder::with_rate_limit_queue`, 16,384 by default): an operation that finds it full
//! is refused at once with [`StoreError::Overloaded`], and an operation whose caller has gone
//! (a dropped future, a timeout) before its batch is built is never sent, so never charged.
//! A cluster runs a script on one slot's keys only, so there every operation is its own
//! call. The strategy's parameters
//! travel as plain integers (see [`ScriptedStrategy`]); the state of a key lives at
//! `{prefix:key}:r` (all tiers in one value, so one cluster slot), in microseconds exactly as
//! the Rust strategies keep it, and expires (`PX`) once it is at rest, when it is equal to no
//! state at all.
//!
//! # Fresh keys
//!
//! A check of a key this instance has not seen holding a state is first sent as a plain
//! `SET key state PX ttl NX` (pipelined with the other fresh checks of a batch, beside its
//! script call): a key with no state takes any check its limit allows, and what the check
//! leaves there depends only on the time, so the state is computed here with the script's own
//! maths (a test compares both, byte for byte, for every strategy and tier) at this instance's
//! estimate of the server's clock. The server runs that `SET` in a fraction of a script's time.
//! A key that holds anything (another instance's state, a value of another type) is left
//! alone and the check goes to the script. Keys the script decided are remembered (at most
//! 10,000, each until its state ends) and go straight to the script; while most tries find
//! their key taken, only one check in 64 tries. See `RedisBuilder::with_fresh_key_writes`.
//!
//! # Limited keys answered locally
//!
//! A check (or a shaper's reservation) the server denies until T is answered by this
//! instance, with no round trip, for later checks of the same key with the same limit and
//! at least the same cost, until `retry_after - 1 ms` after the call was sent (never past
//! T, whatever the latency). Spending only postpones T, so no other instance can make such an
//! answer wrong; a reset can, and so can an override (other limits on the same state): a
//! reset's script publishes its key on `<prefix>:rate-limit` in the same call, so does an
//! override's (and a limiter's override of its own instance, `set_local_override`), and
//! every instance forgets that key's local answer when the notice arrives. An answer's
//! retry-after counts down from when the server's reply arrived, never from earlier: it never
//! says more than the server did. Answers are kept only while the subscription that would
//! carry such a notice is live and the same one as when the denial was sent, and a denial
//! whose call was sent before a notice arrived is not kept (the notice may overtake the
//! reply). See `RedisBuilder::with_local_answers`.
//!
//! # Overrides
//!
//! `Limiter::set_override` keeps a key's other limits here, for every instance: one hash per
//! limiter namespace, `{prefix:<namespace>}:o`, a field per key holding the strategy's tiers
//! as the script reads them, and its expiry on the server's clock for one set for a while.
//! Setting or removing one is one script, which also publishes the change on the rate-limit
//! channel; limiters read the namespace's overrides again at their next call after such a
//! notice, after a subscription replaced one that was lost, and every few seconds (see
//! `Limiter::set_override` for the bounds).
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
//! The script reads the server's `TIME` to the microsecond, as the strategies read time, so
//! instances with skewed clocks agree; the limiter's clock (the request's `now_us`) is not
//! used. A fresh key's first check (see above) is stamped with this instance's estimate of
//! that clock instead, measured with `TIME`: skew between hosts does not shift it, only the
//! estimate's error (at most half a `TIME` round trip plus 100 ppm of its age, and 5 ms by default, or the check goes to the script: see `RedisBuilder::with_max_clock_error`) does, once per key. Tests pin the script's time with `Redis::pin_time_us` (or `Redis::pin_time`, in ms); while pinned, keys are kept an hour longer than their state lives,
//! since the server expires them on its own clock.
//!
//! # Failures
//!
//! A store failure (timeout, connection refused, breaker open, an unexpected reply) is
//! [`RateLimitError::Store`], which an `Enforcer` (feature `http`) maps to its `FailMode`:
//! admit or refuse. The command timeout and the circuit breaker of [`Redis`] bound every
//! call. A cost above what the strategy can ever admit is
//! [`RateLimitError::InsufficientCapacity`], decided before any round trip, as in memory.

mod batcher;
mod fresh;
mod local;
mod operation;
mod overrides;
mod runtime_store;
mod script;
#[cfg(test)]
mod tests;

use std::future::Future;
use std::sync::OnceLock;

use crate::rate_limit::{
    AsyncRateLimitStore, FixedWindow, Gcra, LeakyBucket, RateLimitError, RateLimitReply,
    RateLimitRequest, ScriptedStrategy, SlidingWindow, StoredOverride, Tiered, TokenBucket,
};
use crate::store::StoreError;
use crate::store::redis::script::LuaScript;
use crate::store::redis::{Redis, cached};

use self::operation::Operation;
pub use self::runtime_store::RuntimeStore;
use self::script::{SINGLE, reply_of};

impl Redis {
    /// Runs `request` as one script call, alone or in a batch.
    async fn rate_limit<S: ScriptedStrategy>(
        &self,
        request: RateLimitRequest<'_, S>,
    ) -> Result<RateLimitReply, RateLimitError> {
        let mut operation = self.operation(&request)?;
        let batcher = self.batcher();
        let local = &batcher.local;
        if local.max_keys > 0
            && matches!(operation.args.op, "c" | "r")
            && self.pinned_us_at().is_none()
        {
            let live = local.live_subscription(self);
            if let Some(reply) = local.answer(&operation, live) {
                return Ok(reply);
            }
            if live.is_some() {
                operation.ticket = local.ticket(&operation.args, live);
            }
        }
        if operation.args.op == "c"
            && self.inner.fresh_key_writes
            && batcher.guess.worth_trying(&operation.key)
        {
            operation.learn = true;
            // No good estimate of the server's clock yet: the script decides on its `TIME`.
            operation.fresh = self
                .server_now_us(&operation.key)
                .and_then(|now| fresh::check(&operation.args, now));
        }
        let reset = (operation.args.op == "x").then(|| operation.key.clone());
        let reply = if self.is_cluster() {
            // A cluster runs a script on one slot's keys only: one call per operation.
            Box::pin(self.alone(&operation)).await
        } else {
            self.batched(&batcher, operation).await
        };
        if let Some(key) = reset {
            // Whatever the reply: a reset that timed out may have run.
            local.forget(&key);
            batcher.guess.forget(&key);
        }
        reply.map_err(|e| RateLimitError::store(request.key, e))
    }

    /// Notes what the script's `reply` to `operation` says: a denial that may be answered
    /// locally is kept, and a key a check found holding a state (or left holding one) is
    /// known to hold it until the state ends, at least [`fresh::KNOWN_AT_LEAST`].
    fn remember(&self, operation: &Operation, reply: &RateLimitReply) {
        if operation.ticket.is_none() && !operation.learn {
            return;
        }
        let batcher = self.batcher();
        if operation.ticket.is_some() {
            let local = &batcher.local;
            local.remember(operation, reply, local.subscription_live());
        }
        if operation.learn
            && let RateLimitReply::Decision(decision) = reply
        {
            // Without an estimate of the server's clock: the least.
            let left = self
                .server_now_us(&operation.key)
                .map_or(0, |us| decision.reset_at_ms.saturating_sub(us / 1_000));
            let life = std::time::Duration::from_millis(left).max(fresh::KNOWN_AT_LEAST);
            batcher.guess.seen(&operation.key, life);
        }
    }

    /// An operation alone: a fresh check's plain `SET NX`, and if that finds the key taken
    /// (or the operation is not one), one call of the script.
    async fn alone(&self, operation: &Operation) -> Result<RateLimitReply, StoreError> {
        if let Some(fresh) = &operation.fresh {
            let written: redis::Value = self.query(&fresh::set(&operation.key, fresh)).await?;
            if let Some(reply) = self.batcher().guess.outcome(fresh, &written)? {
                return Ok(reply);
            }
        }
        static SCRIPT: OnceLock<LuaScript> = OnceLock::new();
        let mut call = cached(&SCRIPT, SINGLE, false).prepare_invoke();
        call.key(&operation.key).arg(self.pinned_us());
        operation.args.push(&mut call);
        let reply: Vec<i64> = self.invoke(&call).await?;
        let reply = reply_of(&operation.key, &reply)?;
        self.remember(operation, &reply);
        Ok(reply)
    }
}

// `impl<S: ScriptedStrategy> AsyncRateLimitStore<S> for Redis` would be rejected (E0119): it
// overlaps the blanket `impl<S, St: RateLimitStore<S>> AsyncRateLimitStore<S> for St`, since
// another crate may implement `RateLimitStore<ItsStrategy>` for `Redis` (coherence does not
// know `ScriptedStrategy` is sealed). One impl per concrete strategy, and one for `Tiered`
// (no other crate can implement a trait of ours for `Redis` and `Tiered<_, _>`, none of them
// its own type), cannot overlap. The same is said on `Redis`, where users see it.
// The methods every scripted strategy's store shares (one body for the plain strategies and
// for `Tiered`).
macro_rules! scripted_store_body {
    ($strategy:ty) => {
        fn apply_async(
            &self,
            request: RateLimitRequest<'_, $strategy>,
        ) -> impl Future<Output = Result<RateLimitReply, RateLimitError>> + Send {
            self.rate_limit(request)
        }

        /// `None`: every call is bounded by the command timeout already.
        fn call_timeout(&self) -> Option<std::time::Duration> {
            None
        }

        fn local_answers(&self) -> u64 {
            self.batcher().local.answered()
        }

        fn limits_changed(&self, key: &str) {
            Redis::limits_changed(self, key);
        }

        /// `true`: overrides live in Redis, for every instance (see [`Redis`]).
        fn shares_overrides(&self) -> bool {
            true
        }

        fn write_override(
            &self,
            namespace: &str,
            key: &str,
            strategy: Option<&$strategy>,
            ttl: Option<std::time::Duration>,
        ) -> impl Future<Output = Result<(), RateLimitError>> + Send {
            self.keep_override(namespace, key, strategy, ttl)
        }

        fn read_overrides(
            &self,
            namespace: &str,
        ) -> impl Future<Output = Result<Vec<StoredOverride<$strategy>>, RateLimitError>> + Send {
            self.overrides_of(namespace)
        }

        fn overrides_version(&self) -> u64 {
            Redis::overrides_version(self)
        }
    };
}

macro_rules! scripted_store {
    ($($strategy:ty),+ $(,)?) => {$(
        /// One script call per operation, on the server's clock (see [`Redis`]).
        impl AsyncRateLimitStore<$strategy> for Redis {
            scripted_store_body!($strategy);
        }
    )+};
}

scripted_store!(Gcra, TokenBucket, FixedWindow, SlidingWindow, LeakyBucket);

/// Every tier charged or none, in one script call (see [`Redis`]).
impl<A: ScriptedStrategy, B: ScriptedStrategy> AsyncRateLimitStore<Tiered<A, B>> for Redis {
    scripted_store_body!(Tiered<A, B>);
}
