//! Rate limiting on Redis: [`Redis`] as an
//! [`AsyncRateLimitStore`] for every built-in strategy and every [`Tiered`] combination of
//! them, so limiters on several instances share one limit.
//!
//! # One script call per decision
//!
//! Every [`RateLimitOp`] (check, reserve, peek, forecast, reset) of every strategy is one call
//! of one Lua script (`EVALSHA`, sent again as `EVAL` on `NOSCRIPT`), which runs the
//! strategies' own integer maths on the server, atomically: a [`Tiered`] limit charges every
//! tier or none in that same call.
//!
//! On a single node, operations that arrive while two calls are already in flight share the
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
//! # Limited keys answered locally
//!
//! A check (or a shaper's reservation) the server denies until T is answered by this
//! instance, with no round trip, for later checks of the same key with the same limit and
//! at least the same cost, until `retry_after - 1 ms` after the call was sent (never past
//! T, whatever the latency). Spending only postpones T, so no other instance can make such an
//! answer wrong; a reset can, and so can an override (other limits on the same state): a
//! reset's script publishes its key on `<prefix>:rate-limit` in the same call, an override
//! set or removed on a limiter publishes it too, and every instance forgets that key's local
//! answer when the notice arrives. Answers are kept only while the subscription that would
//! carry such a notice is live and the same one as when the denial was sent, and a denial
//! whose call was sent before a notice arrived is not kept (the notice may overtake the
//! reply). See `RedisBuilder::with_local_answers`.
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
//! used. Tests pin the script's time with `Redis::pin_time_us` (or `Redis::pin_time`, in ms); while pinned, keys are kept an hour longer than their state lives,
//! since the server expires them on its own clock.
//!
//! # Failures
//!
//! A store failure (timeout, connection refused, breaker open, an unexpected reply) is
//! [`RateLimitError::Store`], which an `Enforcer` (feature `http`) maps to its `FailMode`:
//! admit or refuse. The command timeout and the circuit breaker of [`Redis`] bound every
//! call. A cost above what the strategy can ever admit is
//! [`RateLimitError::InsufficientCapacity`], decided before any round trip, as in memory.

use std::collections::VecDeque;
use std::future::Future;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::rate_limit::{
    AsyncRateLimitStore, Decision, FixedWindow, Forecast, Gcra, InsufficientCapacity, LeakyBucket,
    RateLimitError, RateLimitOp, RateLimitReply, RateLimitRequest, ScriptedStrategy,
    ShaperReservation, SlidingWindow, TIME_CEILING_US, TierParams, Tiered, TokenBucket,
};
use crate::store::StoreError;
use crate::store::redis::script::{LuaScript, ScriptCall};
use crate::store::redis::{Redis, RedisBuilder, cached};

/// The script of one operation: the library, then its entry point.
const SINGLE: &str = concat!(
    include_str!("rate_limit.lua"),
    r"
local now = clock(now_us(ARGV[1]))
local p, raw = params(2), false
if p[1] ~= 'x' then raw = redis.call('GET', KEYS[1]) end
local out = {}
decide(KEYS[1], p, now, raw, out, 1)
return out
"
);

/// The script of a batch: KEYS one per operation; ARGV[1] the pinned time or ''; ARGV[2] how
/// many distinct argument sets follow, each as its argument count and its arguments; then,
/// when there are several sets, per operation the number of its set. One `TIME` and one
/// `MGET` for all; each set parsed once; a key that holds a state is written once, at the
/// end, with what its last operation left; the replies in order in one flat array, each
/// after its length.
const BATCH: &str = concat!(
    include_str!("rate_limit.lua"),
    r"
local now = clock(now_us(ARGV[1]))
local sets, p, count = {}, 3, tonumber(ARGV[2])
for s = 1, count do
  sets[s] = params(p + 1)
  p = p + 1 + tonumber(ARGV[p])
end
local states = redis.call('MGET', unpack(KEYS))
deferred, deferred_keys = {}, {}
local out, i, set = {}, 1, sets[1]
for k = 1, #KEYS do
  local key = KEYS[k]
  local raw = written[key]
  if raw == nil then raw = states[k] end
  if count > 1 then set = sets[tonumber(ARGV[p + k - 1])] end
  local j = decide(key, set, now, raw, out, i + 1)
  out[i] = j - i - 1
  i = j
end
for _, key in ipairs(deferred_keys) do
  local px = deferred[key]
  if px then
    redis.call('SET', key, written[key], 'PX', string.format('%d', px))
    deferred[key] = nil
  end
end
return out
"
);

/// The replies of a batch of `operations` from its flat array (each reply after its length).
fn batch_replies(flat: &[i64], operations: usize) -> Result<Vec<&[i64]>, StoreError> {
    let mut replies = Vec::with_capacity(operations);
    let mut rest = flat;
    while let Some((&len, tail)) = rest.split_first() {
        let reply = usize::try_from(len)
            .ok()
            .and_then(|len| tail.get(..len))
            .ok_or_else(|| StoreError::Protocol(format!("rate limit batch replied {flat:?}")))?;
        replies.push(reply);
        rest = &tail[reply.len()..];
    }
    if replies.len() != operations {
        return Err(StoreError::Protocol(format!(
            "rate limit batch of {operations} replied {} times",
            replies.len()
        )));
    }
    Ok(replies)
}

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

/// One operation as the script reads it: the key and its arguments after the time.
struct Operation {
    key: String,
    args: Args,
    /// For a check or a reservation whose denial this instance may answer locally: what held
    /// when it was sent (see [`LocalAnswers::remember`]).
    ticket: Option<Ticket>,
}

/// An operation's arguments, the key aside: operations with equal ones share one set in a
/// batch.
#[derive(PartialEq, Eq)]
struct Args {
    op: &'static str,
    cost: u32,
    slack: u64,
    kinds: String,
    numbers: Vec<u64>,
    /// A reset's channel, where the script announces it (see [`LocalAnswers`]); empty for
    /// the other operations.
    channel: String,
}

impl Args {
    /// How many arguments [`Args::push`] adds.
    fn count(&self) -> usize {
        if self.op == "x" {
            2
        } else {
            4 + self.numbers.len()
        }
    }

    fn push(&self, call: &mut ScriptCall<'_>) {
        if self.op == "x" {
            // A reset needs no parameters: it deletes the key and says so on its channel.
            call.arg(self.op).arg(&self.channel);
            return;
        }
        call.arg(self.op)
            .arg(self.cost)
            .arg(self.slack)
            .arg(&self.kinds);
        for n in &self.numbers {
            call.arg(n);
        }
    }
}

/// A script reply as a result: code 5 is a key holding another strategy's state.
fn reply_of(key: &str, reply: &[i64]) -> Result<RateLimitReply, StoreError> {
    if reply == [5] {
        return Err(StoreError::Protocol(format!(
            "rate limit key {key} holds the state of another strategy, or a value of \
             another type"
        )));
    }
    decode(reply)
}

/// How many argument sets a batch looks through for one an operation can share: a batch
/// of operations that all differ (many limiters at once) costs at most this many comparisons
/// per operation, and a set sent twice is only parsed twice.
const SHARED_SETS: usize = 8;

/// The argument sets of `operations` (in order of first use; distinct among the first
/// [`SHARED_SETS`]), and for each operation the number of its set, from 1 as the script
/// counts.
fn argument_sets<'a>(
    operations: impl ExactSizeIterator<Item = &'a Operation>,
) -> (Vec<&'a Args>, Vec<usize>) {
    let mut sets: Vec<&Args> = Vec::new();
    let mut set_of = Vec::with_capacity(operations.len());
    for operation in operations {
        let args = &operation.args;
        let shared = sets.iter().take(SHARED_SETS).position(|set| *set == args);
        let set = match shared {
            Some(set) => set,
            None => {
                sets.push(args);
                sets.len() - 1
            }
        };
        set_of.push(set + 1);
    }
    (sets, set_of)
}

/// The most operations one batch carries: a script blocks the server while it runs, so a
/// batch stays short (about 64 decisions' worth of Lua).
const MAX_BATCH: usize = 64;

/// Calls in flight at once: while the server runs one, the next is being built and sent, so
/// neither side waits for the other.
const IN_FLIGHT: usize = 2;

/// How many rate-limit operations may wait for a batch at once by default: 16,384, a few MB of
/// queued operations (a few hundred bytes each), what 256 batch calls carry.
pub(crate) const DEFAULT_QUEUE: NonZeroUsize = NonZeroUsize::new(16_384).unwrap();

impl RedisBuilder {
    /// How many rate-limit operations may wait at once for a batch call on a single node
    /// (default 16,384: a few MB, what 256 batch calls carry). Operations queue while two
    /// calls are in flight; one that finds the queue full is refused at once, unsent, with
    /// [`RateLimitError::Store`] whose source is [`StoreError::Overloaded`], which an
    /// `Enforcer` maps to its `FailMode` like any store failure, rather than wait behind a
    /// backlog that could only grow. Operations whose callers gave up (a dropped future, a
    /// timeout) are never sent, so never charged, and make room first. A cluster sends every
    /// operation on its own call and queues nothing.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), throttlebeam::store::StoreError> {
    /// use std::num::NonZeroUsize;
    /// use throttlebeam::store::Redis;
    ///
    /// let redis = Redis::builder("redis://127.0.0.1:6379")
    ///     .with_rate_limit_queue(NonZeroUsize::new(1_024).unwrap())
    ///     .connect()
    ///     .await?;
    /// # drop(redis);
    /// # Ok(()) }
    /// ```
    pub fn with_rate_limit_queue(mut self, max: NonZeroUsize) -> Self {
        self.rate_limit_queue = Some(max);
        self
    }
}

/// Rate-limit operations of one `Redis` on a single node that go out together.
///
/// An operation that finds a call slot free and nothing queued goes at once, alone, from its
/// caller's task: a lone caller pays nothing for batching. Operations that arrive while
/// [`IN_FLIGHT`] calls are out wait in a queue of at most `max_queued`; a task sends them as
/// one call of the batch script (one `TIME`, the operations run in arrival order, one reply
/// each), and keeps sending what queues meanwhile until the queue is empty. Under load that
/// spreads a call's cost (the round trip, the script's start, the `TIME`) over every
/// operation in it. An operation whose caller has gone by the time its batch is built is
/// dropped unsent.
pub(crate) struct Batcher {
    state: Mutex<BatchState>,
    /// The most operations waiting at once; past it, operations are refused.
    max_queued: usize,
    /// The denials answered without a round trip (the rate limiter's other per-instance
    /// state, kept beside its batches).
    pub(super) local: LocalAnswers,
}

impl Default for Batcher {
    fn default() -> Self {
        Self::new(DEFAULT_QUEUE, DEFAULT_LOCAL_ANSWERS)
    }
}

#[derive(Default)]
struct BatchState {
    queue: VecDeque<Queued>,
    /// Operations sent alone, in flight.
    alone: usize,
    /// Tasks sending batches.
    tasks: usize,
}

impl BatchState {
    fn slot_free(&self) -> bool {
        self.alone + self.tasks < IN_FLIGHT
    }

    /// Takes a slot for a new batch task when `wanted` and one is free; whether it did.
    fn claim_task(&mut self, wanted: bool) -> bool {
        let claimed = wanted && self.slot_free();
        self.tasks += usize::from(claimed);
        claimed
    }
}

struct Queued {
    operation: Operation,
    reply: oneshot::Sender<Result<RateLimitReply, StoreError>>,
}

impl Queued {
    /// Its caller gave up waiting (dropped its future, or timed out): sending it would charge
    /// a key for a request nobody made any more.
    fn abandoned(&self) -> bool {
        self.reply.is_closed()
    }
}

impl Batcher {
    pub(crate) fn new(max_queued: NonZeroUsize, local_answers: usize) -> Self {
        Self {
            state: Mutex::default(),
            max_queued: max_queued.get(),
            local: LocalAnswers::new(local_answers),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BatchState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Redis {
    /// Local answers given so far and the keys held for them (for [`RedisStats`](crate::store::RedisStats)).
    pub(crate) fn local_answer_counts(&self) -> (u64, usize) {
        let batcher = self.batcher();
        (batcher.local.answered(), batcher.local.len())
    }
}

/// The rate limiter's slice of a connection (see `Redis::slice`).
struct RateLimitSlice(std::sync::Arc<Batcher>);

impl Redis {
    /// This connection's batcher (made on first use).
    fn batcher(&self) -> std::sync::Arc<Batcher> {
        let slice = self.slice(|| {
            let batcher = std::sync::Arc::new(Batcher::new(
                self.inner.rate_limit_queue.unwrap_or(DEFAULT_QUEUE),
                self.inner.local_answers.unwrap_or(DEFAULT_LOCAL_ANSWERS),
            ));
            // Another instance changed a limited key: forget its local answer.
            let heard = std::sync::Arc::downgrade(&batcher);
            self.inner.subscribers.register(
                self.rate_limit_channel(),
                std::sync::Arc::new(move |bytes: &[u8]| {
                    if let Some(batcher) = heard.upgrade() {
                        batcher.local.forget(&String::from_utf8_lossy(bytes));
                    }
                }),
            );
            RateLimitSlice(batcher)
        });
        std::sync::Arc::clone(&slice.0)
    }
}

/// An operation sent alone holds a slot until its call ends (or its caller gives up); then,
/// if operations queued meanwhile and no task is sending, it starts one for them.
struct AloneFlight {
    redis: Redis,
}

impl Drop for AloneFlight {
    fn drop(&mut self) {
        let start = {
            let batcher = self.redis.batcher();
            let mut state = batcher.lock();
            state.alone -= 1;
            let idle_queue = !state.queue.is_empty() && state.tasks == 0;
            state.claim_task(idle_queue)
        };
        if start {
            Draining::start(self.redis.clone());
        }
    }
}

/// A task sending batches. Whatever way it ends (its runtime shut down included), it gives
/// its slot back, so the next operation can start another; if it was dropped mid-way with
/// operations still queued and nobody else in flight, they are told at once rather than
/// left waiting.
struct Draining {
    redis: Redis,
    /// Gave its slot back on its own, finding the queue empty.
    done: bool,
}

impl Drop for Draining {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let left = {
            let batcher = self.redis.batcher();
            let mut state = batcher.lock();
            state.tasks -= 1;
            if state.tasks + state.alone > 0 {
                // Whoever is still in flight sends what is queued (or starts a task for it).
                return;
            }
            std::mem::take(&mut state.queue)
        };
        for queued in left {
            let _ = queued.reply.send(Err(StoreError::Protocol(
                "rate limit batch abandoned: its task ended".to_owned(),
            )));
        }
    }
}

impl Draining {
    /// Runs a task, holding the slot its starter claimed, on the current tokio runtime
    /// (without one, the slot is given back at once).
    fn start(redis: Redis) {
        let mut draining = Self { redis, done: false };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { draining.drain().await });
        }
    }

    /// Sends batches until the queue is empty.
    async fn drain(&mut self) {
        static SCRIPT: OnceLock<LuaScript> = OnceLock::new();
        loop {
            let batch: Vec<Queued> = {
                let batcher = self.redis.batcher();
                let mut state = batcher.lock();
                let mut batch = Vec::with_capacity(state.queue.len().min(MAX_BATCH));
                while batch.len() < MAX_BATCH
                    && let Some(queued) = state.queue.pop_front()
                {
                    if !queued.abandoned() {
                        batch.push(queued);
                    }
                }
                if batch.is_empty() {
                    // The queue is empty. Gives the slot back under the lock that queues: an
                    // operation queued after this sees the slot free and starts another task.
                    state.tasks -= 1;
                    self.done = true;
                    return;
                }
                batch
            };
            let mut call = cached(&SCRIPT, BATCH, false).prepare_invoke();
            call.arg(self.redis.pinned_us());
            // Operations with the same arguments (one limiter's checks, usually all of them)
            // share one set: the server parses it once.
            let (sets, set_of) = argument_sets(batch.iter().map(|q| &q.operation));
            for queued in &batch {
                call.key(&queued.operation.key);
            }
            call.arg(sets.len());
            for args in &sets {
                call.arg(args.count());
                args.push(&mut call);
            }
            // One set (the usual batch: one limiter's checks) needs no number per operation.
            if sets.len() > 1 {
                for set in set_of {
                    call.arg(set);
                }
            }
            let flat = self.redis.invoke::<Vec<i64>>(&call).await;
            match flat.and_then(|flat| {
                let replies = batch_replies(&flat, batch.len())?;
                Ok(replies
                    .into_iter()
                    .zip(&batch)
                    .map(|(reply, queued)| reply_of(&queued.operation.key, reply))
                    .collect::<Vec<_>>())
            }) {
                Ok(answers) => {
                    for (queued, answer) in batch.into_iter().zip(answers) {
                        if let Ok(reply) = &answer {
                            self.redis.remember(&queued.operation, reply);
                        }
                        let _ = queued.reply.send(answer);
                    }
                }
                Err(error) => {
                    for queued in batch {
                        let _ = queued.reply.send(Err(error.clone()));
                    }
                }
            }
        }
    }
}

/// How many limited keys a [`Redis`] answers locally at most by default (see
/// `RedisBuilder::with_local_answers`).
pub(super) const DEFAULT_LOCAL_ANSWERS: usize = 10_000;

impl RedisBuilder {
    /// How many limited keys this instance may answer locally at once (default 10,000; 0
    /// turns local answers off).
    ///
    /// A check (or a shaper reservation) denied by the server until T is answered here,
    /// with no round trip, by later checks of the same key with the same limit and a cost at
    /// least as large, until shortly before T: nothing another instance does can admit it
    /// sooner, since spending only postpones T. The local answer is the server's denial with
    /// its retry-after counted down (`remaining`, `limit` and `reset_at_ms` as the server
    /// last reported them; for a larger cost than the one denied, the retry-after is when the
    /// denied cost could pass, and the server answers the check after it).
    ///
    /// What can admit a key sooner is announced through pub/sub: a `reset` (the script
    /// publishes it with the deletion, in the same call) and an override set or removed on
    /// a limiter; every instance forgets the key's local answer when the notice arrives.
    /// Local answers are only kept and given while this instance's subscription is live and
    /// has not been lost since the denial was sent, so a notice missed while the subscription
    /// was down never leaves a stale answer: whatever the subscription misses, the server
    /// decides. A key deleted behind the library's back (`DEL`, `FLUSHDB`, eviction under
    /// `maxmemory`) is seen once its local answer ends, before T. While a test pins the
    /// scripts' time ([`Redis::pin_time`]), nothing is answered locally.
    ///
    /// The notices travel on the backend's one pub/sub connection (the one idempotency
    /// waiters and shared debounce use), which the first rate-limit check opens when local
    /// answers are on.
    ///
    /// Memory is bounded: at most `max_keys` entries of a few hundred bytes; an entry ends
    /// at its T, and a full table first drops the ended ones, then answers new denials from
    /// the server. [`RedisStats::local_answers`](crate::store::RedisStats::local_answers) counts the
    /// answers given.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), throttlebeam::store::StoreError> {
    /// use throttlebeam::store::Redis;
    ///
    /// let redis = Redis::builder("redis://127.0.0.1:6379")
    ///     .with_local_answers(50_000)
    ///     .connect()
    ///     .await?;
    /// # drop(redis);
    /// # Ok(()) }
    /// ```
    pub fn with_local_answers(mut self, max_keys: usize) -> Self {
        self.local_answers = Some(max_keys);
        self
    }
}

/// What held when a check that may be answered locally later was sent: its denial is kept
/// only if no invalidation came and the subscription stayed the same meanwhile.
#[derive(Clone, Copy)]
struct Ticket {
    sent: Instant,
    epoch: u64,
    /// The live subscription (its number), if any.
    subscription: Option<u64>,
}

/// A denial answered locally (see [`LocalAnswers`]).
struct Denied {
    kinds: Box<str>,
    numbers: Box<[u64]>,
    /// The cost denied: checks of this cost or more are answered.
    cost: u32,
    /// Answered locally before this instant: `retry_after - 1 ms` after the call was sent,
    /// never later than the server's T.
    until: Instant,
    /// What retry-afters count down to: `retry_after` after the reply arrived, never earlier
    /// than the server's T.
    admit_at: Instant,
    /// The server's figures, when the denial was a check's (a reservation's carries none).
    decision: Option<(u64, u64, u64)>,
    /// The subscription live when the denial was sent.
    subscription: u64,
}

/// Denials this instance answers without a round trip (see
/// `RedisBuilder::with_local_answers`): at most `max_keys` keys, each until shortly before
/// the server's T, while the pub/sub subscription that would announce a reset is the one
/// that was live when the denial was sent.
pub(super) struct LocalAnswers {
    entries: dashmap::DashMap<String, Denied, ahash::RandomState>,
    max_keys: usize,
    /// Bumped by every invalidation: a denial sent before one is not kept (its notice may
    /// have arrived before its reply).
    epoch: AtomicU64,
    /// Answers given.
    answered: crate::stats::Counter,
}

impl LocalAnswers {
    pub(super) fn new(max_keys: usize) -> Self {
        Self {
            entries: dashmap::DashMap::default(),
            max_keys,
            epoch: AtomicU64::new(0),
            answered: crate::stats::Counter::default(),
        }
    }

    /// Answers given so far.
    pub(super) fn answered(&self) -> u64 {
        self.answered.get()
    }

    /// Keys answered locally now (ended ones not yet dropped included).
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    /// What to note when sending `args`, if its denial may be kept.
    fn ticket(&self, args: &Args, subscription: Option<u64>) -> Option<Ticket> {
        (self.max_keys > 0 && matches!(args.op, "c" | "r")).then(|| Ticket {
            sent: Instant::now(),
            epoch: self.epoch.load(Ordering::SeqCst),
            subscription,
        })
    }

    /// The local answer to `operation`, if a denial covers it.
    fn answer(&self, operation: &Operation, subscription: Option<u64>) -> Option<RateLimitReply> {
        let subscription = subscription?;
        let entry = self.entries.get(&operation.key)?;
        let args = &operation.args;
        let now = Instant::now();
        if now >= entry.until || entry.subscription != subscription {
            drop(entry);
            self.entries.remove_if(&operation.key, |_, d| {
                now >= d.until || d.subscription != subscription
            });
            return None;
        }
        if args.cost < entry.cost || *entry.kinds != *args.kinds || *entry.numbers != *args.numbers
        {
            return None;
        }
        // Rounded up, as the server rounds: waiting it suffices.
        let left = entry.admit_at.saturating_duration_since(now);
        let retry_after_ms = u64::try_from(left.as_micros().div_ceil(1_000))
            .unwrap_or(u64::MAX)
            .max(1);
        let reply = match (args.op, entry.decision) {
            ("c", Some((limit, remaining, reset_at_ms))) => RateLimitReply::Decision(Decision {
                allowed: false,
                limit,
                remaining,
                reset_at_ms,
                retry_after_ms,
            }),
            ("r", _) => {
                RateLimitReply::Reservation(ShaperReservation::QueueFull { retry_after_ms })
            }
            _ => return None,
        };
        drop(entry);
        self.answered.incr();
        Some(reply)
    }

    /// Keeps the denial `reply` to `operation` if it is sound to answer locally: sent while a
    /// subscription was live that is still the live one, no invalidation since, and more
    /// than a millisecond to wait.
    fn remember(&self, operation: &Operation, reply: &RateLimitReply, live: Option<u64>) {
        let Some(ticket) = operation.ticket else {
            return;
        };
        let (retry_after_ms, decision) = match *reply {
            RateLimitReply::Decision(d) if !d.allowed => (
                d.retry_after_ms,
                Some((d.limit, d.remaining, d.reset_at_ms)),
            ),
            RateLimitReply::Reservation(ShaperReservation::QueueFull { retry_after_ms }) => {
                (retry_after_ms, None)
            }
            _ => return,
        };
        let Some(subscription) = ticket.subscription.filter(|s| live == Some(*s)) else {
            return;
        };
        // The server decided at or after `sent`, and its T is more than `retry - 1` ms after
        // that (the retry-after is rounded up); the reply came at `now`, at or after it, so T
        // is at most `retry` ms after `now`.
        let now = Instant::now();
        let until = ticket.sent + Duration::from_millis(retry_after_ms.saturating_sub(1));
        if until <= now {
            return;
        }
        let admit_at = now + Duration::from_millis(retry_after_ms);
        if self.entries.len() >= self.max_keys {
            self.entries.retain(|_, d| d.until > now);
            if self.entries.len() >= self.max_keys {
                return;
            }
        }
        let args = &operation.args;
        let denied = Denied {
            kinds: args.kinds.as_str().into(),
            numbers: args.numbers.as_slice().into(),
            cost: args.cost,
            until,
            admit_at,
            decision,
            subscription,
        };
        // Under the key's shard lock: an invalidation bumps the epoch before it removes the
        // key, so either this sees the bump, or the removal comes after this insertion.
        match self.entries.entry(operation.key.clone()) {
            dashmap::Entry::Occupied(mut held) => {
                if self.epoch.load(Ordering::SeqCst) != ticket.epoch {
                    return;
                }
                let kept = held.get();
                let covers_more = kept.until > now
                    && kept.cost < denied.cost
                    && kept.subscription == subscription
                    && kept.kinds == denied.kinds
                    && kept.numbers == denied.numbers;
                if !covers_more {
                    held.insert(denied);
                }
            }
            dashmap::Entry::Vacant(slot) => {
                if self.epoch.load(Ordering::SeqCst) == ticket.epoch {
                    slot.insert(denied);
                }
            }
        }
    }

    /// Forgets the local answer of `key` (a stored key name), and stops keeping denials sent
    /// before now.
    pub(super) fn forget(&self, key: &str) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        self.entries.remove(key);
    }
}

impl Redis {
    /// The channel where resets and overrides of rate-limited keys are announced, for the
    /// instances that answer their denials locally.
    pub(crate) fn rate_limit_channel(&self) -> String {
        format!("{}:rate-limit", self.prefix())
    }

    /// The live subscription's number, when local answers may be given; starts the listener
    /// if none runs.
    fn live_subscription(&self) -> Option<u64> {
        let live = self.subscription_live();
        if live.is_none() {
            self.subscribe();
        }
        live
    }

    /// Forgets the local answers of `key` (a limiter's store key) here, and has every other
    /// instance forget theirs: its limits changed (an override set or removed).
    fn limits_changed(&self, key: &str) {
        let key = self.key(key, ":r");
        let batcher = self.batcher();
        let local = &batcher.local;
        if local.max_keys == 0 {
            return;
        }
        local.forget(&key);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::debug!(
                key,
                "no tokio runtime to announce a changed limit: other instances forget their local answers at their T"
            );
            return;
        };
        let redis = self.clone();
        runtime.spawn(async move {
            let mut publish = redis::cmd("PUBLISH");
            publish.arg(redis.rate_limit_channel()).arg(&key);
            if let Err(error) = redis.query::<i64>(&publish).await {
                tracing::debug!(key, %error, "announcing a changed limit failed");
            }
        });
    }
}

impl Redis {
    /// The pinned time in µs as a script argument, or empty for the server's `TIME`.
    fn pinned_us(&self) -> String {
        self.pinned_us_at()
            .map(|n| n.to_string())
            .unwrap_or_default()
    }

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
            let live = self.live_subscription();
            if let Some(reply) = local.answer(&operation, live) {
                return Ok(reply);
            }
            if live.is_some() {
                operation.ticket = local.ticket(&operation.args, live);
            }
        }
        let reset = (operation.args.op == "x").then(|| operation.key.clone());
        let reply = if self.is_cluster() {
            // A cluster runs a script on one slot's keys only: one call per operation.
            self.alone(&operation).await
        } else {
            self.batched(operation).await
        };
        if let Some(key) = reset {
            // Whatever the reply: a reset that timed out may have run.
            local.forget(&key);
        }
        reply.map_err(|e| RateLimitError::store(request.key, e))
    }

    /// Keeps `reply` to `operation` as a local answer if it is a denial that may be one.
    fn remember(&self, operation: &Operation, reply: &RateLimitReply) {
        if operation.ticket.is_some() {
            let live = self.subscription_live();
            self.batcher().local.remember(operation, reply, live);
        }
    }

    /// The script's view of `request`, after the checks made before any round trip.
    fn operation<S: ScriptedStrategy>(
        &self,
        request: &RateLimitRequest<'_, S>,
    ) -> Result<Operation, RateLimitError> {
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
        let slack = if self.pinned_ms().is_none() {
            SLACK_MS
        } else {
            PINNED_SLACK_MS
        };
        let mut kinds = String::with_capacity(tiers.len());
        let mut numbers = Vec::with_capacity(4 * tiers.len());
        for tier in &tiers {
            let (kind, values) = kind(tier);
            kinds.push(kind);
            numbers.extend_from_slice(&values);
        }
        let channel = if op == "x" {
            self.rate_limit_channel()
        } else {
            String::new()
        };
        Ok(Operation {
            key: self.key(request.key, ":r"),
            args: Args {
                op,
                cost: cost.map_or(1, |c| c.get()),
                slack,
                kinds,
                numbers,
                channel,
            },
            ticket: None,
        })
    }

    /// One call of the script for one operation.
    async fn alone(&self, operation: &Operation) -> Result<RateLimitReply, StoreError> {
        static SCRIPT: OnceLock<LuaScript> = OnceLock::new();
        let mut call = cached(&SCRIPT, SINGLE, false).prepare_invoke();
        call.key(&operation.key).arg(self.pinned_us());
        operation.args.push(&mut call);
        let reply: Vec<i64> = self.invoke(&call).await?;
        let reply = reply_of(&operation.key, &reply)?;
        self.remember(operation, &reply);
        Ok(reply)
    }

    /// Sends `operation` at once if a call slot is free and nothing is queued; otherwise
    /// queues it for the next batch (starting a task to send it if a slot is free) and waits
    /// for its reply, at most the command timeout. Refuses it, unsent, when the queue is full.
    async fn batched(&self, operation: Operation) -> Result<RateLimitReply, StoreError> {
        let batches = self.batcher();
        let queued = {
            let mut state = batches.lock();
            if state.queue.is_empty() && state.slot_free() {
                state.alone += 1;
                Err(operation)
            } else {
                if state.queue.len() >= batches.max_queued {
                    // Callers time out in the order they queued, so the ones that gave up
                    // are at the front: making room costs each of them one look, once.
                    while state.queue.front().is_some_and(Queued::abandoned) {
                        state.queue.pop_front();
                    }
                    if state.queue.len() >= batches.max_queued {
                        return Err(StoreError::Overloaded {
                            queued: state.queue.len(),
                        });
                    }
                }
                let (reply, rx) = oneshot::channel();
                state.queue.push_back(Queued { operation, reply });
                Ok((rx, state.claim_task(true)))
            }
        };
        let (rx, start) = match queued {
            Ok(queued) => queued,
            Err(operation) => {
                let _flight = AloneFlight {
                    redis: self.clone(),
                };
                return self.alone(&operation).await;
            }
        };
        if start {
            Draining::start(self.clone());
        }
        let after = self.inner.command_timeout;
        match tokio::time::timeout(after, rx).await {
            Err(_) => Err(StoreError::Timeout { after }),
            Ok(Err(_)) => Err(StoreError::Protocol(
                "rate limit batch abandoned".to_owned(),
            )),
            Ok(Ok(reply)) => reply,
        }
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

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;
    use std::time::Duration;

    use super::*;
    use crate::store::redis::{each_server, each_server_bounded};

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
                now_us: 0,
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

    /// A stored state: its kinds, then its fields as little-endian doubles.
    fn decode_state(stored: &[u8], kinds: &str) -> Vec<u64> {
        assert_eq!(&stored[..kinds.len()], kinds.as_bytes());
        let doubles = &stored[kinds.len()..];
        assert_eq!(doubles.len() % 8, 0, "{stored:?}");
        doubles
            .chunks_exact(8)
            .map(|d| {
                let v = f64::from_le_bytes(d.try_into().unwrap());
                assert_eq!(v.fract(), 0.0, "{v}");
                v as u64
            })
            .collect()
    }

    #[tokio::test]
    async fn state_is_stored_in_microseconds_and_expires_at_rest() {
        each_server("rate_limit_state_and_expiry", async |redis: Redis| {
            let check = RateLimitOp::Check {
                cost: NonZeroU32::MIN,
            };
            let stored = async |key: &str| -> Vec<u8> {
                redis
                    .query(redis::cmd("GET").arg(redis.key(key, ":r")))
                    .await
                    .unwrap()
            };
            redis.pin_time(1_000);
            apply(&redis, &gcra(), "k", check).await.unwrap();
            // The theoretical arrival time 1.5 s in µs, no remainder.
            assert_eq!(decode_state(&stored("k").await, "g"), [1_500_000, 0]);
            apply(&redis, &gcra(), "k", check).await.unwrap();
            assert_eq!(decode_state(&stored("k").await, "g"), [2_000_000, 0]);
            // Two tiers in one value, each one's fields (a sliding window keeps three).
            let tiered = Tiered::new(
                gcra(),
                SlidingWindow::new(10, Duration::from_secs(1)).unwrap(),
            );
            apply(&redis, &tiered, "t", check).await.unwrap();
            let state = decode_state(&stored("t").await, "gs");
            assert_eq!(state, [1_500_000, 0, 1_000_000, 0, 1]);

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
    async fn the_script_reads_the_server_clock_to_the_microsecond() {
        each_server("rate_limit_server_us", async |redis: Redis| {
            // One per hour: a first check stores an arrival time of the server's TIME plus
            // exactly an hour. Read in whole ms, every one would end in 000 µs.
            let g = Gcra::new(1, Duration::from_secs(3_600)).unwrap();
            let mut sub_ms = std::collections::BTreeSet::new();
            for i in 0..20 {
                let key = format!("us{i}");
                apply(&redis, &g, &key, check_one()).await.unwrap();
                let stored: Vec<u8> = redis
                    .query(redis::cmd("GET").arg(redis.key(&key, ":r")))
                    .await
                    .unwrap();
                sub_ms.insert(decode_state(&stored, "g")[0] % 1_000);
            }
            assert!(sub_ms.len() > 1, "{sub_ms:?}");
            // A pinned time is read to the microsecond too.
            redis.pin_time_us(5_000_000_250);
            apply(&redis, &g, "pinned", check_one()).await.unwrap();
            let stored: Vec<u8> = redis
                .query(redis::cmd("GET").arg(redis.key("pinned", ":r")))
                .await
                .unwrap();
            assert_eq!(decode_state(&stored, "g"), [8_600_000_250, 0]);
        })
        .await;
    }

    /// On a single node, has the server hold its answers for a moment (`CLIENT PAUSE`), so
    /// no call ends at its first poll and the calls made meanwhile queue deterministically.
    async fn hold_answers(redis: &Redis) {
        if !redis.is_cluster() {
            redis
                .query::<()>(redis::cmd("CLIENT").arg("PAUSE").arg(100).arg("ALL"))
                .await
                .unwrap();
        }
    }

    fn check_one() -> RateLimitOp {
        RateLimitOp::Check {
            cost: NonZeroU32::MIN,
        }
    }

    #[tokio::test]
    async fn concurrent_operations_go_out_in_batches_and_each_is_decided_exactly() {
        // 250 operations at once, each alone on a cluster just created: what is decided is
        // checked here, not how fast, so the bound is looser than the default.
        let bound = Some(Duration::from_secs(2));
        each_server_bounded("rate_limit_batches", bound, async |redis: Redis| {
            redis.pin_time(1_000_000);
            let limit = FixedWindow::new(100, Duration::from_secs(60)).unwrap();
            let before = redis.stats().commands;
            let calls = (0..250).map(|_| apply(&redis, &limit, "hot", check_one()));
            let replies = futures_util::future::join_all(calls).await;
            let calls = redis.stats().commands - before;
            let mut allowed = 0;
            let mut remaining = Vec::new();
            for reply in replies {
                match reply.unwrap() {
                    RateLimitReply::Decision(d) if d.allowed => {
                        allowed += 1;
                        remaining.push(d.remaining);
                    }
                    RateLimitReply::Decision(d) => assert_eq!(d.remaining, 0),
                    other => panic!("{other:?}"),
                }
            }
            // Exactly the limit, each admission seeing the one before it.
            assert_eq!(allowed, 100);
            remaining.sort_unstable();
            assert_eq!(remaining, (0..100).collect::<Vec<u64>>());
            if redis.is_cluster() {
                assert_eq!(calls, 250, "a cluster sends each operation alone");
            } else {
                assert!(
                    calls < 250,
                    "{calls} calls: operations in flight together are batched"
                );
            }
        })
        .await;
    }

    /// `SET`s the server ran (scripts' included) since it started: single node only.
    async fn sets_run(redis: &Redis) -> u64 {
        let info: String = redis
            .query(redis::cmd("INFO").arg("commandstats"))
            .await
            .unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("cmdstat_set:calls="))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |n| n.parse().unwrap())
    }

    #[tokio::test]
    async fn a_batch_writes_a_hot_key_once_with_what_its_last_operation_left() {
        each_server("rate_limit_hot_key", async |redis: Redis| {
            // A long window: its state must outlive the pause below.
            let window = FixedWindow::new(1_000, Duration::from_secs(3_600)).unwrap();
            apply(&redis, &window, "hot", check_one()).await.unwrap();
            let sets = if redis.is_cluster() {
                0
            } else {
                sets_run(&redis).await
            };
            hold_answers(&redis).await;
            let calls = (0..40).map(|_| apply(&redis, &window, "hot", check_one()));
            let mut remaining: Vec<u64> = futures_util::future::join_all(calls)
                .await
                .into_iter()
                .map(|reply| match reply.unwrap() {
                    RateLimitReply::Decision(d) if d.allowed => d.remaining,
                    other => panic!("{other:?}"),
                })
                .collect();
            // Each saw the one before it, batched or not.
            remaining.sort_unstable();
            assert_eq!(remaining, (959..999).collect::<Vec<u64>>());
            if !redis.is_cluster() {
                // The first two went alone; the other 38 queued into one batch, one write.
                assert_eq!(sets_run(&redis).await - sets, 3);
            }
            // What was stored is what the last operation left.
            match apply(&redis, &window, "hot", RateLimitOp::Peek)
                .await
                .unwrap()
            {
                RateLimitReply::Decision(d) => assert_eq!(d.remaining, 959),
                other => panic!("{other:?}"),
            }
        })
        .await;
    }

    #[tokio::test]
    async fn each_operation_of_a_batch_is_answered_on_its_own() {
        each_server("rate_limit_batch_errors", async |redis: Redis| {
            // A long window: its state must outlive the pause below.
            let window = FixedWindow::new(2, Duration::from_secs(3_600)).unwrap();
            apply(&redis, &window, "window", check_one()).await.unwrap();
            // A key holding a value of another type: refused, and left as it is.
            let hashed = redis.key("hashed", ":r");
            redis
                .query::<()>(redis::cmd("HSET").arg(&hashed).arg("f").arg("v"))
                .await
                .unwrap();
            let g = gcra();
            hold_answers(&redis).await;
            let before = redis.stats().commands;
            // The first two fill the call slots; the other four wait and go together.
            let (first, second, a, foreign, b, other_type) = tokio::join!(
                apply(&redis, &g, "first", check_one()),
                apply(&redis, &g, "second", check_one()),
                apply(&redis, &g, "a", check_one()),
                apply(&redis, &g, "window", check_one()),
                apply(&redis, &g, "b", check_one()),
                apply(&redis, &g, "hashed", check_one()),
            );
            let calls = redis.stats().commands - before;
            if redis.is_cluster() {
                assert_eq!(calls, 6);
            } else {
                assert_eq!(calls, 3, "two alone, then one batch of four");
            }
            let err = other_type.unwrap_err();
            assert!(err.is_store(), "{err:?}");
            let kind: String = redis.query(redis::cmd("TYPE").arg(&hashed)).await.unwrap();
            assert_eq!(kind, "hash");
            for ok in [first, second] {
                assert!(matches!(ok.unwrap(), RateLimitReply::Decision(d) if d.allowed));
            }
            let err = foreign.unwrap_err();
            assert!(err.is_store(), "{err:?}");
            assert!(
                format!("{err:?}").contains("holds the state of another strategy"),
                "{err:?}"
            );
            for ok in [a, b] {
                assert!(matches!(ok.unwrap(), RateLimitReply::Decision(d) if d.allowed));
            }
        })
        .await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_denial_is_kept_only_when_sound_and_answered_until_shortly_before_its_end() {
        let local = LocalAnswers::new(2);
        let args = |cost, limit| Args {
            op: "c",
            cost,
            slack: 1,
            kinds: "f".to_owned(),
            numbers: vec![limit, 60_000_000, 0, 0],
            channel: String::new(),
        };
        let sent = |key: &str, cost, limit, live| {
            let args = args(cost, limit);
            let ticket = local.ticket(&args, live);
            Operation {
                key: key.to_owned(),
                args,
                ticket,
            }
        };
        let denial = |retry_after_ms| {
            RateLimitReply::Decision(Decision {
                allowed: false,
                limit: 2,
                remaining: 0,
                reset_at_ms: 90_000,
                retry_after_ms,
            })
        };
        let retry = |reply: Option<RateLimitReply>| match reply {
            Some(RateLimitReply::Decision(d)) => {
                assert!(
                    !d.allowed && d.limit == 2 && d.reset_at_ms == 90_000,
                    "{d:?}"
                );
                Some(d.retry_after_ms)
            }
            None => None,
            other => panic!("{other:?}"),
        };
        // Sent and answered under subscription 1: kept; counted down on time.
        let op = sent("k", 2, 2, Some(1));
        local.remember(&op, &denial(30_000), Some(1));
        assert_eq!(retry(local.answer(&op, Some(1))), Some(30_000));
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(retry(local.answer(&op, Some(1))), Some(20_000));
        // A larger cost is answered; a smaller one, or other limits, go to the server.
        assert_eq!(
            retry(local.answer(&sent("k", 2, 2, None), Some(1))),
            Some(20_000)
        );
        assert_eq!(local.answer(&sent("k", 1, 2, None), Some(1)), None);
        assert_eq!(local.answer(&sent("k", 2, 3, None), Some(1)), None);
        // Answered until 1 ms before the server's retry-after ended, never after.
        tokio::time::advance(Duration::from_millis(19_998)).await;
        assert_eq!(retry(local.answer(&op, Some(1))), Some(2));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(local.answer(&op, Some(1)), None);
        assert_eq!(local.len(), 0, "an ended answer is dropped");
        assert_eq!(local.answered(), 4);

        // Under another subscription, or none: not answered (and dropped).
        let op = sent("k", 1, 2, Some(1));
        local.remember(&op, &denial(30_000), Some(1));
        assert_eq!(local.answer(&op, None), None);
        assert_eq!(local.len(), 1);
        assert_eq!(local.answer(&op, Some(2)), None);
        assert_eq!(local.len(), 0);
        // The subscription changed between the call and its reply: not kept.
        let op = sent("k", 1, 2, Some(1));
        local.remember(&op, &denial(30_000), Some(2));
        assert_eq!(local.len(), 0);
        // A call sent with no live subscription: not kept.
        let op = sent("k", 1, 2, None);
        local.remember(&op, &denial(30_000), Some(1));
        assert_eq!(local.len(), 0);
        // A notice (of any key) between the call and its reply: not kept, it may be this
        // key's, overtaking the reply.
        let op = sent("k", 1, 2, Some(1));
        local.forget("other");
        local.remember(&op, &denial(30_000), Some(1));
        assert_eq!(local.len(), 0);
        // A retry-after of 1 ms leaves nothing to answer; an allowed check is never kept.
        let op = sent("k", 1, 2, Some(1));
        local.remember(&op, &denial(1), Some(1));
        let allowed = RateLimitReply::Decision(Decision {
            allowed: true,
            limit: 2,
            remaining: 1,
            reset_at_ms: 90_000,
            retry_after_ms: 0,
        });
        local.remember(&op, &allowed, Some(1));
        assert_eq!(local.len(), 0);
        // A notice forgets its key.
        local.remember(&op, &denial(30_000), Some(1));
        assert_eq!(local.len(), 1);
        local.forget("k");
        assert_eq!(local.answer(&op, Some(1)), None);
        // At most `max_keys` keys: a full table drops ended answers first, then keeps no more.
        for key in ["a", "b", "c"] {
            let op = sent(key, 1, 2, Some(1));
            local.remember(&op, &denial(30_000), Some(1));
        }
        assert_eq!(local.len(), 2);
        tokio::time::advance(Duration::from_secs(30)).await;
        let op = sent("c", 1, 2, Some(1));
        local.remember(&op, &denial(30_000), Some(1));
        assert_eq!(local.len(), 1);
    }

    #[test]
    fn a_batch_reply_is_split_by_its_lengths_and_checked() {
        let flat = [6, 1, 1, 2, 1, 1000, 0, 1, 4, 1, 5];
        let replies = batch_replies(&flat, 3).unwrap();
        assert_eq!(replies, [&flat[1..7], &[4][..], &[5][..]]);
        assert_eq!(batch_replies(&[], 0).unwrap().len(), 0);
        // Too few or too many replies, a length past the end, a negative length.
        for (bad, operations) in [
            (&flat[..], 2),
            (&flat[..], 4),
            (&[3, 1][..], 1),
            (&[-1][..], 1),
        ] {
            let err = batch_replies(bad, operations).unwrap_err();
            assert!(matches!(err, StoreError::Protocol(_)), "{err:?}");
        }
    }

    #[test]
    fn operations_with_the_same_arguments_share_one_set() {
        let op = |key: &str, op, cost, numbers: &[u64]| Operation {
            key: key.to_owned(),
            args: Args {
                op,
                cost,
                slack: 1,
                kinds: "g".to_owned(),
                numbers: numbers.to_vec(),
                channel: String::new(),
            },
            ticket: None,
        };
        let ops = [
            op("a", "c", 1, &[2, 500_000, 1, 1_000_000]),
            op("b", "p", 1, &[2, 500_000, 1, 1_000_000]),
            op("c", "c", 1, &[2, 500_000, 1, 1_000_000]),
            op("d", "c", 2, &[2, 500_000, 1, 1_000_000]),
            op("e", "c", 1, &[3, 500_000, 1, 1_000_000]),
            op("f", "p", 1, &[2, 500_000, 1, 1_000_000]),
        ];
        let (sets, set_of) = argument_sets(ops.iter());
        // Each set is the arguments of the operation that used it first.
        let first_user = |set: &&Args| ops.iter().find(|o| std::ptr::eq(&o.args, *set));
        let keys: Vec<&str> = sets
            .iter()
            .map(|s| first_user(s).unwrap().key.as_str())
            .collect();
        assert_eq!(keys, ["a", "b", "d", "e"]);
        assert_eq!(set_of, [1, 2, 1, 3, 4, 2]);

        // Only the first sets are looked through: past them, each operation brings its own.
        let limit = |n| op("k", "c", 1, &[n, 500_000, 1, 1_000_000]);
        let mut many: Vec<Operation> = (1..=10).map(limit).collect();
        many.extend([limit(1), limit(8), limit(9), limit(9)]);
        let (sets, set_of) = argument_sets(many.iter());
        assert_eq!(sets.len(), 12);
        assert_eq!(set_of, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 8, 11, 12]);
    }

    #[tokio::test]
    async fn a_batch_of_several_limits_and_operations_decides_each_with_its_own() {
        each_server("rate_limit_batch_sets", async |redis: Redis| {
            let now_us = 1_000_000_250;
            redis.pin_time_us(now_us);
            let (g, other) = (gcra(), Gcra::new(5, Duration::from_secs(1)).unwrap());
            let window = FixedWindow::new(4, Duration::from_secs(60)).unwrap();
            let two = RateLimitOp::Check {
                cost: NonZeroU32::new(2).unwrap(),
            };
            // What the memory store decides for the same operations in the same order.
            let memory_g = crate::rate_limit::MemoryRateLimitStore::new();
            let memory_w = crate::rate_limit::MemoryRateLimitStore::new();
            let expect_g = |strategy: &Gcra, key: &str, op| {
                let request = RateLimitRequest {
                    key,
                    now_us,
                    strategy,
                    op,
                };
                crate::rate_limit::RateLimitStore::apply(&memory_g, request).unwrap()
            };
            let expect_w = |key: &str, op| {
                let request = RateLimitRequest {
                    key,
                    now_us,
                    strategy: &window,
                    op,
                };
                crate::rate_limit::RateLimitStore::apply(&memory_w, request).unwrap()
            };
            let expected = [
                expect_g(&g, "first", check_one()),
                expect_g(&g, "second", check_one()),
                expect_g(&g, "a", check_one()),
                expect_w("w", two),
                expect_g(&other, "o", check_one()),
                expect_g(&g, "a", RateLimitOp::Peek),
                expect_w("w", check_one()),
                expect_g(&g, "a", check_one()),
                expect_w("w", two),
                expect_g(&other, "o", check_one()),
                expect_g(&g, "a", RateLimitOp::Reset),
                expect_g(&g, "a", check_one()),
            ];
            hold_answers(&redis).await;
            let before = redis.stats().commands;
            // The first two fill the call slots; the other ten go together, in this order
            // (`join_all` polls them in order), with five different argument sets among them;
            // a key's later operations see what its earlier ones wrote, a reset included.
            type Call<'a> = std::pin::Pin<
                Box<dyn Future<Output = Result<RateLimitReply, RateLimitError>> + Send + 'a>,
            >;
            let calls: Vec<Call<'_>> = vec![
                Box::pin(apply(&redis, &g, "first", check_one())),
                Box::pin(apply(&redis, &g, "second", check_one())),
                Box::pin(apply(&redis, &g, "a", check_one())),
                Box::pin(apply(&redis, &window, "w", two)),
                Box::pin(apply(&redis, &other, "o", check_one())),
                Box::pin(apply(&redis, &g, "a", RateLimitOp::Peek)),
                Box::pin(apply(&redis, &window, "w", check_one())),
                Box::pin(apply(&redis, &g, "a", check_one())),
                Box::pin(apply(&redis, &window, "w", two)),
                Box::pin(apply(&redis, &other, "o", check_one())),
                Box::pin(apply(&redis, &g, "a", RateLimitOp::Reset)),
                Box::pin(apply(&redis, &g, "a", check_one())),
            ];
            let got = futures_util::future::join_all(calls).await;
            let calls = redis.stats().commands - before;
            if !redis.is_cluster() {
                assert_eq!(calls, 3, "two alone, then one batch of ten");
            }
            let got: Vec<RateLimitReply> = got.into_iter().map(Result::unwrap).collect();
            assert_eq!(got, expected);
            // The last check of the window was denied: 2 + 1 + 2 over a limit of 4.
            assert!(matches!(got[8], RateLimitReply::Decision(d) if !d.allowed));
            // What the batch left stored (writes to keys with a state wait for its end) is
            // what the memory store holds.
            let peek = RateLimitOp::Peek;
            assert_eq!(
                apply(&redis, &g, "a", peek).await.unwrap(),
                expect_g(&g, "a", peek)
            );
            assert_eq!(
                apply(&redis, &other, "o", peek).await.unwrap(),
                expect_g(&other, "o", peek)
            );
            assert_eq!(
                apply(&redis, &window, "w", peek).await.unwrap(),
                expect_w("w", peek)
            );
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_task_dropped_with_its_runtime_wedges_nothing() {
        each_server("rate_limit_batch_dropped", async |redis: Redis| {
            if redis.is_cluster() {
                return; // no batches on a cluster
            }
            // Twice: a runtime whose callers fill both call slots and queue a third
            // operation, then give up; the batch task started for the queued one never
            // runs before the runtime ends. Two abandoned tasks that kept their slots would
            // wedge every later call. The server holds its answers meanwhile, so that no
            // call can end at its first poll.
            redis
                .query::<()>(redis::cmd("CLIENT").arg("PAUSE").arg(400).arg("ALL"))
                .await
                .unwrap();
            let paused_at = tokio::time::Instant::now();
            for _ in 0..2 {
                let short_redis = redis.clone();
                std::thread::spawn(move || {
                    let redis = short_redis;
                    let short = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap();
                    short.block_on(async {
                        let g = gcra();
                        let mut calls: Vec<_> = (0..3)
                            .map(|_| Box::pin(apply(&redis, &g, "k", check_one())))
                            .collect();
                        for call in &mut calls {
                            assert!(futures_util::FutureExt::now_or_never(call).is_none());
                        }
                        let batcher = redis.batcher();
                        let state = batcher.lock();
                        assert_eq!((state.alone, state.tasks, state.queue.len()), (2, 0, 1));
                    });
                })
                .join()
                .unwrap();
                let batcher = redis.batcher();
                let state = batcher.lock();
                assert_eq!((state.alone, state.tasks, state.queue.len()), (0, 0, 0));
            }
            tokio::time::sleep_until(paused_at + Duration::from_millis(500)).await;
            let g = gcra();
            let reply =
                tokio::time::timeout(Duration::from_secs(5), apply(&redis, &g, "k", check_one()))
                    .await
                    .expect("not wedged");
            assert!(matches!(reply.unwrap(), RateLimitReply::Decision(_)));
        })
        .await;
    }

    #[tokio::test]
    async fn a_key_of_another_strategy_is_a_store_error_and_too_wide_a_tier_is_refused() {
        each_server("rate_limit_other_strategy", async |redis: Redis| {
            let check = RateLimitOp::Check {
                cost: NonZeroU32::MIN,
            };
            // A slow GCRA: its state must outlive the next call, however loaded the machine.
            let slow_gcra = Gcra::new(2, Duration::from_secs(3_600)).unwrap();
            apply(&redis, &slow_gcra, "mixed", check).await.unwrap();
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
