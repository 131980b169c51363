//! Operations on a single node that go out together: one call slot for a lone caller, a
//! bounded queue and a batch task under load.

use std::collections::VecDeque;
use std::num::NonZeroUsize;
use std::sync::{Mutex, OnceLock, PoisonError};

use tokio::sync::oneshot;

use super::fresh::{self, Guess};
use super::local::{DEFAULT_LOCAL_ANSWERS, LocalAnswers};
use super::operation::{Fresh, Operation};
use super::script::{BATCH, argument_sets, batch_replies, reply_of};
use crate::rate_limit::RateLimitReply;
use crate::store::StoreError;
use crate::store::redis::script::LuaScript;
use crate::store::redis::{Redis, RedisBuilder, cached};

/// The most operations one batch carries: a script blocks the server while it runs, so a
/// batch stays short (about 64 decisions' worth of Lua).
pub(super) const MAX_BATCH: usize = 64;

/// Calls in flight at once: while the server runs one, the next ones are being built and
/// sent, so neither side waits for the other. Four rather than two since fresh keys' checks
/// are plain `SET NX`s: the server answers a batch of them sooner than the client can build
/// the next, and with two in flight both sides idled about a third of the time (fresh keys,
/// 64 callers: 143–170k checks/s with two, 173–188k with four, in alternating runs).
pub(super) const IN_FLIGHT: usize = 4;

/// How many rate-limit operations may wait for a batch at once by default: 16,384, a few MB of
/// queued operations (a few hundred bytes each), what 256 batch calls carry.
pub(crate) const DEFAULT_QUEUE: NonZeroUsize = NonZeroUsize::new(16_384).unwrap();

impl RedisBuilder {
    /// How many rate-limit operations may wait at once for a batch call on a single node
    /// (default 16,384: a few MB, what 256 batch calls carry). Operations queue while four
    /// calls are in flight; one that finds the queue full is refused at once, unsent, with
    /// [`RateLimitError::Store`](crate::rate_limit::RateLimitError::Store) whose source is [`StoreError::Overloaded`], which an
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
    pub(super) state: Mutex<BatchState>,
    /// The most operations waiting at once; past it, operations are refused.
    pub(super) max_queued: usize,
    /// The denials answered without a round trip (the rate limiter's other per-instance
    /// state, kept beside its batches).
    pub(super) local: LocalAnswers,
    /// Which checks try a plain `SET NX` first.
    pub(super) guess: Guess,
}

impl Default for Batcher {
    fn default() -> Self {
        Self::new(DEFAULT_QUEUE, DEFAULT_LOCAL_ANSWERS)
    }
}

#[derive(Default)]
pub(super) struct BatchState {
    pub(super) queue: VecDeque<Queued>,
    /// Operations sent alone, in flight.
    pub(super) alone: usize,
    /// Tasks sending batches.
    pub(super) tasks: usize,
}

impl BatchState {
    pub(super) fn slot_free(&self) -> bool {
        self.alone + self.tasks < IN_FLIGHT
    }

    /// Takes a slot for a new batch task when `wanted` and one is free; whether it did.
    pub(super) fn claim_task(&mut self, wanted: bool) -> bool {
        let claimed = wanted && self.slot_free();
        self.tasks += usize::from(claimed);
        claimed
    }
}

pub(super) struct Queued {
    pub(super) operation: Operation,
    pub(super) reply: oneshot::Sender<Result<RateLimitReply, StoreError>>,
}

impl Queued {
    /// Its caller gave up waiting (dropped its future, or timed out): sending it would charge
    /// a key for a request nobody made any more.
    pub(super) fn abandoned(&self) -> bool {
        self.reply.is_closed()
    }
}

impl Batcher {
    pub(crate) fn new(max_queued: NonZeroUsize, local_answers: usize) -> Self {
        Self {
            state: Mutex::default(),
            max_queued: max_queued.get(),
            local: LocalAnswers::new(local_answers),
            guess: Guess::new(),
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, BatchState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Redis {
    /// Local answers given so far and the keys held for them (for [`RedisStats`](crate::store::RedisStats)).
    pub(crate) fn local_answer_counts(&self) -> (u64, usize) {
        let batcher = self.batcher();
        (batcher.local.answered(), batcher.local.len())
    }

    /// Fresh keys' checks written with a plain `SET NX`, and tries that found the key taken
    /// (for [`RedisStats`](crate::store::RedisStats)).
    pub(crate) fn fresh_key_counts(&self) -> (u64, u64) {
        self.batcher().guess.counts()
    }
}

/// The rate limiter's slice of a connection (see `Redis::slice`).
pub(super) struct RateLimitSlice(std::sync::Arc<Batcher>);

impl Redis {
    /// This connection's batcher (made on first use).
    pub(super) fn batcher(&self) -> std::sync::Arc<Batcher> {
        let slice = self.slice(|| {
            let batcher = std::sync::Arc::new(Batcher::new(
                self.inner.rate_limit_queue.unwrap_or(DEFAULT_QUEUE),
                self.inner.local_answers.unwrap_or(DEFAULT_LOCAL_ANSWERS),
            ));
            RateLimitSlice(batcher)
        });
        std::sync::Arc::clone(&slice.0)
    }
}

/// An operation sent alone holds a slot until its call ends (or its caller gives up); then,
/// if operations queued meanwhile and no task is sending, it starts one for them.
pub(super) struct AloneFlight {
    pub(super) redis: Redis,
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
pub(super) struct Draining {
    pub(super) redis: Redis,
    /// Gave its slot back on its own, finding the queue empty.
    pub(super) done: bool,
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
    pub(super) fn start(redis: Redis) {
        let mut draining = Self { redis, done: false };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { draining.drain().await });
        }
    }

    /// Sends batches until the queue is empty.
    pub(super) async fn drain(&mut self) {
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
            // Fresh checks go as plain `SET NX`s, beside the script call of the others.
            let mut fresh = Vec::new();
            let mut scripted = Vec::with_capacity(batch.len());
            for mut queued in batch {
                match queued.operation.fresh.take() {
                    Some(write) => fresh.push((queued, write)),
                    None => scripted.push(queued),
                }
            }
            let script = cached(&SCRIPT, BATCH, false);
            let ((), taken) = tokio::join!(self.script(script, scripted), self.sets(fresh));
            if !taken.is_empty() {
                // Their keys hold something: the script decides them, first in the next batch.
                let batcher = self.redis.batcher();
                let mut state = batcher.lock();
                for queued in taken.into_iter().rev() {
                    state.queue.push_front(queued);
                }
            }
        }
    }

    /// Sends `batch` as one call of the batch script, and replies to each operation.
    async fn script(&self, script: &LuaScript, batch: Vec<Queued>) {
        if batch.is_empty() {
            return;
        }
        let mut call = script.prepare_invoke();
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
            Err(error) => fail(batch, &error),
        }
    }

    /// Sends the fresh checks of `batch` (each with its write) as one pipeline of `SET NX`s
    /// and replies to those that wrote their key; returns the others, for the script.
    async fn sets(&self, batch: Vec<(Queued, Fresh)>) -> Vec<Queued> {
        if batch.is_empty() {
            return Vec::new();
        }
        let mut pipe = redis::pipe();
        for (queued, write) in &batch {
            pipe.add_command(fresh::set(&queued.operation.key, write));
        }
        let written = self
            .redis
            .query_pipe::<Vec<redis::Value>>(&pipe)
            .await
            .and_then(|written| {
                if written.len() == batch.len() {
                    Ok(written)
                } else {
                    Err(StoreError::Protocol(format!(
                        "a pipeline of {} rate limit SET NX replied {} times",
                        batch.len(),
                        written.len()
                    )))
                }
            });
        let written = match written {
            Ok(written) => written,
            Err(error) => {
                fail(batch.into_iter().map(|(queued, _)| queued), &error);
                return Vec::new();
            }
        };
        let guess = &self.redis.batcher().guess;
        let mut taken = Vec::new();
        for ((queued, fresh), written) in batch.into_iter().zip(&written) {
            match guess.outcome(&fresh, written) {
                Ok(Some(reply)) => {
                    let _ = queued.reply.send(Ok(reply));
                }
                Ok(None) => taken.push(queued),
                Err(error) => {
                    let _ = queued.reply.send(Err(error));
                }
            }
        }
        taken
    }
}

/// Replies `error` to every operation of `batch`.
fn fail(batch: impl IntoIterator<Item = Queued>, error: &StoreError) {
    for queued in batch {
        let _ = queued.reply.send(Err(error.clone()));
    }
}

impl Redis {
    /// Sends `operation` at once if a call slot is free and nothing is queued; otherwise
    /// queues it for the next batch (starting a task to send it if a slot is free) and waits
    /// for its reply, at most the command timeout. Refuses it, unsent, when the queue is full.
    pub(super) async fn batched(
        &self,
        batches: &Batcher,
        operation: Operation,
    ) -> Result<RateLimitReply, StoreError> {
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
                // Boxed: the common path (queued) stays a small future.
                return Box::pin(self.alone(&operation)).await;
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
