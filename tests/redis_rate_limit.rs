//! Rate limiting on real Redis servers (a single node and a 3-node cluster): decisions bit
//! for bit equal to the memory store's (a property test and the test vectors), one store
//! contract run on memory, a single node and a cluster, limits held across instances (R8,
//! S11), the fail policy while the server is down (R12, S6), and the batch queue: bounded,
//! and never charging a caller that gave up.
#![cfg(all(feature = "redis", feature = "http"))]

mod support;
mod vectors;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::FutureExt as _;
use proptest::prelude::*;
use proptest::strategy::Strategy as _;
use proptest::test_runner::{Config, FileFailurePersistence, TestRunner};
use support::redis::{RedisCluster, RedisNode};
use throttlebeam::clock::ManualClock;
use throttlebeam::rate_limit::{
    AsyncRateLimitStore, Decision, EnforceOutcome, Enforcer, FailMode, FixedWindow, Gcra,
    LeakyBucket, Limiter, MemoryRateLimitStore, RateLimitError, RateLimitOp, RateLimitReply,
    RateLimitRequest, RateLimitStore, ScriptedStrategy, ShaperReservation, SlidingWindow, Strategy,
    Tiered, TokenBucket,
};
use throttlebeam::store::{BreakerConfig, BreakerState, Redis, StoreError};
use vectors::{Expect, Op, Vector};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("non-zero")
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A fresh namespace per use, so runs on one server never share keys.
fn unique(label: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{label}{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

async fn single(node: &RedisNode) -> Redis {
    Redis::builder(node.url())
        .connect()
        .await
        .expect("connects")
}

async fn cluster(cluster: &RedisCluster) -> Redis {
    Redis::cluster(cluster.urls())
        .connect()
        .await
        .expect("connects to the cluster")
}

// ---------------------------------------------------------------------------------------------
// Bit for bit: the same random operations at the same times, memory against Redis.
// ---------------------------------------------------------------------------------------------

/// How the time moves before a step, in µs.
#[derive(Debug, Clone, Copy)]
enum Move {
    Stay,
    Forward(u64),
    Back(u64),
    /// Far ahead: keys come to rest, windows roll many times.
    Jump(u64),
}

/// The cost of a step, relative to the strategy's capacity where it matters.
#[derive(Debug, Clone, Copy)]
enum Cost {
    Units(u32),
    Limit,
    AboveLimit,
}

#[derive(Debug, Clone, Copy)]
enum StepOp {
    Check(Cost),
    Peek,
    Forecast(Cost),
    Reserve(Cost),
    Reset,
}

#[derive(Debug, Clone, Copy)]
struct Step {
    time: Move,
    key: u8,
    op: StepOp,
}

fn moves() -> impl proptest::strategy::Strategy<Value = Move> {
    prop_oneof![
        3 => Just(Move::Stay),
        // Within a millisecond: the strategies and the script read microseconds.
        3 => (1..=999u64).prop_map(Move::Forward),
        4 => (1..=60_000u64).prop_map(Move::Forward),
        3 => (1..=3_000_000u64).prop_map(Move::Forward),
        1 => (1..=2_000_000u64).prop_map(Move::Back),
        1 => (1..=10_000_000_000u64).prop_map(Move::Jump),
    ]
}

fn costs() -> impl proptest::strategy::Strategy<Value = Cost> {
    prop_oneof![
        8 => (1..=4u32).prop_map(Cost::Units),
        2 => (1..=40u32).prop_map(Cost::Units),
        1 => Just(Cost::Limit),
        1 => Just(Cost::AboveLimit),
    ]
}

fn ops() -> impl proptest::strategy::Strategy<Value = StepOp> {
    prop_oneof![
        10 => costs().prop_map(StepOp::Check),
        2 => Just(StepOp::Peek),
        2 => costs().prop_map(StepOp::Forecast),
        2 => costs().prop_map(StepOp::Reserve),
        1 => Just(StepOp::Reset),
    ]
}

fn steps() -> impl proptest::strategy::Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        (moves(), 0..2u8, ops()).prop_map(|(time, key, op)| Step { time, key, op }),
        1..48,
    )
}

/// Where a sequence starts, in µs: near 0, today-ish, or across the strategies' time ceiling
/// (in 2096), where time stands still.
fn starts() -> impl proptest::strategy::Strategy<Value = u64> {
    prop_oneof![
        2 => 0..=10_000_000u64,
        6 => 1_000_000_000_000_000..=2_000_000_000_000_000u64,
        1 => 3_999_999_900_000_000..=4_000_000_100_000_000u64,
    ]
}

fn period() -> impl proptest::strategy::Strategy<Value = Duration> {
    prop_oneof![
        3 => (1..=3_000u64).prop_map(ms),
        1 => (1..=120u64).prop_map(|s| Duration::from_secs(s * 60)),
    ]
}

fn small() -> impl proptest::strategy::Strategy<Value = u32> {
    prop_oneof![4 => 1..=12u32, 1 => 1..=1_000u32]
}

fn gcra() -> impl proptest::strategy::Strategy<Value = Gcra> {
    prop_oneof![
        (small(), period(), prop::option::of(1..=30u32)).prop_map(|(limit, period, burst)| {
            let g = Gcra::new(limit.min(period_ms(period) as u32), period).expect("valid");
            match burst {
                Some(b) => g.with_burst(nz(b)),
                None => g,
            }
        }),
        // Up to one per microsecond, fractional intervals included.
        (1..=1_000_000u32).prop_map(|n| Gcra::per_second(nz(n))),
    ]
}

fn period_ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

fn token_bucket() -> impl proptest::strategy::Strategy<Value = TokenBucket> {
    (small(), small(), period()).prop_map(|(capacity, refill, per)| {
        TokenBucket::new(capacity, refill.min(period_ms(per) as u32), per).expect("valid")
    })
}

fn fixed_window() -> impl proptest::strategy::Strategy<Value = FixedWindow> {
    (small(), period()).prop_map(|(limit, w)| FixedWindow::new(limit, w).expect("valid"))
}

fn sliding_window() -> impl proptest::strategy::Strategy<Value = SlidingWindow> {
    (small(), period()).prop_map(|(limit, w)| SlidingWindow::new(limit, w).expect("valid"))
}

fn leaky() -> impl proptest::strategy::Strategy<Value = LeakyBucket> {
    (small(), period(), 0..=2_000u64).prop_map(|(rate, per, queue)| {
        LeakyBucket::new(rate.min(period_ms(per) as u32), per, ms(queue)).expect("valid")
    })
}

/// One strategy of every kind, and tiers of them (nested tiers too).
#[derive(Debug, Clone)]
enum Spec {
    Gcra(Gcra),
    TokenBucket(TokenBucket),
    Fixed(FixedWindow),
    Sliding(SlidingWindow),
    Leaky(LeakyBucket),
    GcraFixed(Tiered<Gcra, FixedWindow>),
    BucketSliding(Tiered<TokenBucket, SlidingWindow>),
    Three(Tiered<LeakyBucket, Tiered<Gcra, SlidingWindow>>),
}

fn specs() -> impl proptest::strategy::Strategy<Value = Spec> {
    prop_oneof![
        gcra().prop_map(Spec::Gcra),
        token_bucket().prop_map(Spec::TokenBucket),
        fixed_window().prop_map(Spec::Fixed),
        sliding_window().prop_map(Spec::Sliding),
        leaky().prop_map(Spec::Leaky),
        (gcra(), fixed_window()).prop_map(|(a, b)| Spec::GcraFixed(Tiered::new(a, b))),
        (token_bucket(), sliding_window())
            .prop_map(|(a, b)| Spec::BucketSliding(Tiered::new(a, b))),
        (leaky(), gcra(), sliding_window())
            .prop_map(|(a, b, c)| Spec::Three(Tiered::new(a, Tiered::new(b, c)))),
    ]
}

fn resolve(cost: Cost, limit: u64) -> NonZeroU32 {
    let limit = u32::try_from(limit).unwrap_or(u32::MAX);
    match cost {
        Cost::Units(n) => nz(n),
        Cost::Limit => nz(limit),
        Cost::AboveLimit => nz(limit.saturating_add(1)),
    }
}

/// Every reply, and every error by its full `Debug` (variant, key, numbers).
fn shown(result: Result<RateLimitReply, RateLimitError>) -> Result<RateLimitReply, String> {
    result.map_err(|e| format!("{e:?}"))
}

async fn replay<S>(redis: &Redis, strategy: S, start: u64, steps: &[Step]) -> Result<(), String>
where
    S: ScriptedStrategy,
    Redis: AsyncRateLimitStore<S>,
    MemoryRateLimitStore<S::State>: RateLimitStore<S>,
{
    let steps: Vec<(Step, usize)> = steps.iter().map(|s| (*s, 0)).collect();
    replay_switching(redis, &[strategy], start, &steps).await
}

/// Replays `steps`, each with the strategy it names among `strategies` (one of them: no
/// override; several: a key's limits changed by overrides set and removed between steps).
async fn replay_switching<S>(
    redis: &Redis,
    strategies: &[S],
    start: u64,
    steps: &[(Step, usize)],
) -> Result<(), String>
where
    S: ScriptedStrategy,
    Redis: AsyncRateLimitStore<S>,
    MemoryRateLimitStore<S::State>: RateLimitStore<S>,
{
    let memory = MemoryRateLimitStore::<S::State>::new();
    let case = unique("bit");
    let mut now = start;
    for (i, (step, which)) in steps.iter().enumerate() {
        let strategy = &strategies[which % strategies.len()];
        let limit = strategy.limit();
        now = match step.time {
            Move::Stay => now,
            Move::Forward(d) | Move::Jump(d) => now + d,
            Move::Back(d) => now.saturating_sub(d),
        };
        let op = match step.op {
            StepOp::Check(c) => RateLimitOp::Check {
                cost: resolve(c, limit),
            },
            StepOp::Reserve(c) => RateLimitOp::Reserve {
                cost: resolve(c, limit),
            },
            StepOp::Forecast(c) => RateLimitOp::Forecast {
                cost: resolve(c, limit),
            },
            StepOp::Peek => RateLimitOp::Peek,
            StepOp::Reset => RateLimitOp::Reset,
        };
        let key = format!("{case}:{}", step.key);
        let request = || RateLimitRequest {
            key: &key,
            now_us: now,
            strategy,
            op,
        };
        let in_memory = shown(memory.apply(request()));
        redis.pin_time_us(now);
        let in_redis = shown(redis.apply_async(request()).await);
        if in_memory != in_redis {
            return Err(format!(
                "step {i} at {now} µs, {op:?} on key {} with strategy {which}:\n memory {in_memory:?}\n redis  {in_redis:?}",
                step.key
            ));
        }
    }
    Ok(())
}

async fn replay_spec(redis: &Redis, spec: Spec, start: u64, steps: &[Step]) -> Result<(), String> {
    match spec {
        Spec::Gcra(s) => replay(redis, s, start, steps).await,
        Spec::TokenBucket(s) => replay(redis, s, start, steps).await,
        Spec::Fixed(s) => replay(redis, s, start, steps).await,
        Spec::Sliding(s) => replay(redis, s, start, steps).await,
        Spec::Leaky(s) => replay(redis, s, start, steps).await,
        Spec::GcraFixed(s) => replay(redis, s, start, steps).await,
        Spec::BucketSliding(s) => replay(redis, s, start, steps).await,
        Spec::Three(s) => replay(redis, s, start, steps).await,
    }
}

/// Three strategies of one kind (and shape, for tiers): the default and two overrides.
#[derive(Debug, Clone)]
enum Trio {
    Gcra([Gcra; 3]),
    TokenBucket([TokenBucket; 3]),
    Fixed([FixedWindow; 3]),
    Sliding([SlidingWindow; 3]),
    Leaky([LeakyBucket; 3]),
    GcraFixed([Tiered<Gcra, FixedWindow>; 3]),
    BucketSliding([Tiered<TokenBucket, SlidingWindow>; 3]),
}

fn three<T: std::fmt::Debug, S: proptest::strategy::Strategy<Value = T>>(
    one: impl Fn() -> S,
) -> impl proptest::strategy::Strategy<Value = [T; 3]> {
    (one(), one(), one()).prop_map(|(a, b, c)| [a, b, c])
}

fn trios() -> impl proptest::strategy::Strategy<Value = Trio> {
    prop_oneof![
        three(gcra).prop_map(Trio::Gcra),
        three(token_bucket).prop_map(Trio::TokenBucket),
        three(fixed_window).prop_map(Trio::Fixed),
        three(sliding_window).prop_map(Trio::Sliding),
        three(leaky).prop_map(Trio::Leaky),
        three(|| (gcra(), fixed_window()).prop_map(|(a, b)| Tiered::new(a, b)))
            .prop_map(Trio::GcraFixed),
        three(|| (token_bucket(), sliding_window()).prop_map(|(a, b)| Tiered::new(a, b)))
            .prop_map(Trio::BucketSliding),
    ]
}

/// Steps that each pick the default (0) or an override (1, 2), the default most often.
fn switching_steps() -> impl proptest::strategy::Strategy<Value = Vec<(Step, usize)>> {
    prop::collection::vec(
        (
            (moves(), 0..2u8, ops()).prop_map(|(time, key, op)| Step { time, key, op }),
            prop_oneof![3 => Just(0usize), 2 => Just(1usize), 1 => Just(2usize)],
        ),
        1..48,
    )
}

async fn replay_trio(
    redis: &Redis,
    trio: Trio,
    start: u64,
    steps: &[(Step, usize)],
) -> Result<(), String> {
    match trio {
        Trio::Gcra(s) => replay_switching(redis, &s, start, steps).await,
        Trio::TokenBucket(s) => replay_switching(redis, &s, start, steps).await,
        Trio::Fixed(s) => replay_switching(redis, &s, start, steps).await,
        Trio::Sliding(s) => replay_switching(redis, &s, start, steps).await,
        Trio::Leaky(s) => replay_switching(redis, &s, start, steps).await,
        Trio::GcraFixed(s) => replay_switching(redis, &s, start, steps).await,
        Trio::BucketSliding(s) => replay_switching(redis, &s, start, steps).await,
    }
}

/// Issue 50 item 3: what an override means for a key's state is the same in memory and in
/// Redis. Keys whose limits change between steps (an override set, replaced, removed: a
/// larger or smaller capacity, window, limit, rate or burst) get the same replies, field for
/// field, from both stores: 128 random sequences of up to 47 steps.
fn overrides_bit_identical(redis: &Redis, rt: &tokio::runtime::Runtime) {
    let config = Config {
        cases: 128,
        source_file: Some(file!()),
        failure_persistence: Some(Box::new(FileFailurePersistence::SourceParallel(
            "proptest-regressions",
        ))),
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let result = runner.run(
        &(trios(), starts(), switching_steps()),
        |(trio, start, steps)| {
            rt.block_on(replay_trio(redis, trio, start, &steps))
                .map_err(TestCaseError::fail)
        },
    );
    if let Err(e) = result {
        panic!("memory and Redis disagree on an override: {e}");
    }
}

#[test]
fn overrides_mean_the_same_in_memory_and_on_a_single_node() {
    let Some(node) = RedisNode::start("overrides_mean_the_same_on_a_single_node") else {
        return;
    };
    let rt = tokio_rt();
    let redis = rt.block_on(single(&node));
    overrides_bit_identical(&redis, &rt);
}

#[test]
fn overrides_mean_the_same_in_memory_and_on_a_cluster() {
    let Some(nodes) = RedisCluster::start("overrides_mean_the_same_on_a_cluster") else {
        return;
    };
    let rt = tokio_rt();
    let redis = rt.block_on(cluster(&nodes));
    overrides_bit_identical(&redis, &rt);
}

/// Runs the property on one server: 192 random sequences of up to 47 steps each.
fn bit_identical(redis: &Redis, rt: &tokio::runtime::Runtime) {
    let config = Config {
        cases: 192,
        source_file: Some(file!()),
        failure_persistence: Some(Box::new(FileFailurePersistence::SourceParallel(
            "proptest-regressions",
        ))),
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let result = runner.run(&(specs(), starts(), steps()), |(spec, start, steps)| {
        rt.block_on(replay_spec(redis, spec, start, &steps))
            .map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("memory and Redis disagree: {e}");
    }
}

fn tokio_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

#[test]
fn decisions_are_bit_identical_in_memory_and_on_a_single_node() {
    let Some(node) = RedisNode::start("decisions_are_bit_identical_on_a_single_node") else {
        return;
    };
    let rt = tokio_rt();
    let redis = rt.block_on(single(&node));
    bit_identical(&redis, &rt);
}

#[test]
fn decisions_are_bit_identical_in_memory_and_on_a_cluster() {
    let Some(nodes) = RedisCluster::start("decisions_are_bit_identical_on_a_cluster") else {
        return;
    };
    let rt = tokio_rt();
    let redis = rt.block_on(cluster(&nodes));
    bit_identical(&redis, &rt);
}

// ---------------------------------------------------------------------------------------------
// The test vectors, replayed through a limiter on Redis.
// ---------------------------------------------------------------------------------------------

async fn replay_vector<S>(redis: &Redis, v: &Vector<S>)
where
    S: ScriptedStrategy,
    Redis: AsyncRateLimitStore<S>,
{
    let limiter = Limiter::builder((v.strategy)())
        .with_store(redis.clone())
        .with_namespace(unique("vector"))
        .build();
    for (i, step) in v.steps.iter().enumerate() {
        redis.pin_time(step.at);
        let got = match step.op {
            Op::Check(cost) => match limiter.check_n_async("k", cost).await {
                Ok(d) => Expect::Decision(d),
                Err(RateLimitError::InsufficientCapacity { key, capacity, .. }) => {
                    assert_eq!(key, "k");
                    Expect::Insufficient(capacity)
                }
                Err(err) => panic!("{} step {i}: {err}", v.name),
            },
            Op::Peek => Expect::Decision(limiter.peek_async("k").await.expect("peek")),
            Op::Forecast(cost) => {
                Expect::Forecast(limiter.forecast_async("k", cost).await.expect("forecast"))
            }
            Op::Reset => {
                limiter.reset_async("k").await.expect("reset");
                Expect::Reset
            }
        };
        assert_eq!(got, step.expect, "{} step {i} (redis)", v.name);
    }
}

async fn replay_all_vectors(redis: &Redis) {
    use vectors::{fixed_window, gcra, leaky, sliding_window, token_bucket};
    for v in [&gcra::R1, &gcra::R2, &gcra::R3, &gcra::R7] {
        replay_vector(redis, v).await;
    }
    for v in &token_bucket::ALL {
        replay_vector(redis, v).await;
    }
    for v in &fixed_window::ALL {
        replay_vector(redis, v).await;
    }
    for v in &sliding_window::ALL {
        replay_vector(redis, v).await;
    }
    for v in &leaky::ALL {
        replay_vector(redis, v).await;
    }
    // R6: the shaper's reservations, with and without a queue.
    let shapers = [
        (leaky::ten_per_second_queue_150(), leaky::R6_RESERVATIONS),
        (
            LeakyBucket::new(10, Duration::from_secs(1), Duration::ZERO).expect("valid"),
            leaky::R6_NO_QUEUE,
        ),
    ];
    for (shaper, steps) in shapers {
        let limiter = Limiter::builder(shaper)
            .with_store(redis.clone())
            .with_namespace(unique("r6"))
            .build();
        for &(at, cost, expected) in steps {
            redis.pin_time(at);
            let got = limiter.try_reserve_async("k", cost).await.expect("reserve");
            assert_eq!(got, expected, "R6 at {at}");
        }
    }
    let (at, cost, capacity) = leaky::R6_TOO_LARGE;
    let limiter = Limiter::builder(leaky::ten_per_second_queue_150())
        .with_store(redis.clone())
        .build();
    redis.pin_time(at);
    assert!(matches!(
        limiter.try_reserve_async("k", cost).await,
        Err(RateLimitError::InsufficientCapacity { capacity: c, .. }) if c == capacity
    ));
}

#[tokio::test]
async fn test_vectors_replay_exactly_through_redis() {
    if let Some(node) = RedisNode::start("test_vectors_replay_on_a_single_node") {
        replay_all_vectors(&single(&node).await).await;
    }
    if let Some(nodes) = RedisCluster::start("test_vectors_replay_on_a_cluster") {
        replay_all_vectors(&cluster(&nodes).await).await;
    }
}

// ---------------------------------------------------------------------------------------------
// One store contract: the same assertions on memory, a single node and a cluster.
// ---------------------------------------------------------------------------------------------

/// A store under test: memory (timed by a manual clock) or Redis (timed by a pinned clock).
#[derive(Clone)]
enum Backend {
    Memory,
    Redis(Redis),
}

/// Builds a limiter of `$strategy` on `$backend` and runs `$case(limiter, at)` on it, where
/// `at(ms)` sets the time that store decides at.
macro_rules! on {
    ($backend:expr, $strategy:expr, $case:ident) => {
        match $backend {
            Backend::Memory => {
                let clock = ManualClock::new(0);
                let limiter = Limiter::builder($strategy)
                    .with_clock(clock.clone())
                    .build();
                $case(limiter, move |t| clock.set(t)).await
            }
            Backend::Redis(redis) => {
                let limiter = Limiter::builder($strategy)
                    .with_store(redis.clone())
                    .with_namespace(unique("contract"))
                    .build();
                let r = redis.clone();
                $case(limiter, move |t| r.pin_time(t)).await
            }
        }
    };
}

async fn reads_never_write_and_keys_are_independent<St>(
    limiter: Limiter<Gcra, St>,
    at: impl Fn(u64),
) where
    St: AsyncRateLimitStore<Gcra>,
{
    at(10_000);
    let fresh = limiter.peek_async("a").await.unwrap();
    assert_eq!((fresh.allowed, fresh.remaining), (true, 3));
    limiter.forecast_async("a", 1).await.unwrap();
    assert_eq!(limiter.peek_async("a").await.unwrap(), fresh);
    assert_eq!(limiter.check_async("a").await.unwrap().remaining, 2);
    assert_eq!(limiter.check_n_async("a", 2).await.unwrap().remaining, 0);
    let denied = limiter.check_async("a").await.unwrap();
    assert_eq!(
        (denied.allowed, denied.retry_after_ms, denied.reset_at_ms),
        (false, 334, 11_000)
    );
    // Another key is untouched.
    assert_eq!(limiter.check_async("b").await.unwrap().remaining, 2);
    // A denial spends nothing: the same wait a moment later.
    at(10_100);
    assert_eq!(limiter.check_async("a").await.unwrap().retry_after_ms, 234);
    let stats = limiter.stats();
    assert_eq!((stats.allowed, stats.denied, stats.errors), (3, 2, 0));
}

async fn reset_and_rest_equal_a_fresh_key<St>(limiter: Limiter<TokenBucket, St>, at: impl Fn(u64))
where
    St: AsyncRateLimitStore<TokenBucket>,
{
    at(5_000);
    let fresh = limiter.peek_async("k").await.unwrap();
    limiter.check_n_async("k", 5).await.unwrap();
    assert!(!limiter.check_async("k").await.unwrap().allowed);
    limiter.reset_async("k").await.unwrap();
    assert_eq!(limiter.peek_async("k").await.unwrap(), fresh);
    limiter.check_n_async("k", 5).await.unwrap();
    // Full again after 500 ms (10 per second): the same as a key never seen, at that time.
    at(5_500);
    let rested = limiter.peek_async("k").await.unwrap();
    assert_eq!(rested, limiter.peek_async("never-seen").await.unwrap());
    assert_eq!(rested.remaining, 5);
    // Errors are the limiter's, with the key, whatever the store.
    match limiter.check_n_async("k", 6).await {
        Err(RateLimitError::InsufficientCapacity {
            key,
            cost: 6,
            capacity: 5,
        }) => assert_eq!(key, "k"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        limiter.check_n_async("k", 0).await,
        Err(RateLimitError::ZeroCost { .. })
    ));
    assert!(matches!(
        limiter.check_async("").await,
        Err(RateLimitError::InvalidKey { .. })
    ));
}

async fn tiers_are_charged_all_or_nothing<St>(
    limiter: Limiter<Tiered<Gcra, FixedWindow>, St>,
    at: impl Fn(u64),
) where
    St: AsyncRateLimitStore<Tiered<Gcra, FixedWindow>>,
{
    at(60_000);
    assert!(limiter.check_async("k").await.unwrap().allowed);
    assert!(limiter.check_async("k").await.unwrap().allowed);
    // The daily quota (2) denies; the per-second tier (5) is not charged.
    let denied = limiter.check_async("k").await.unwrap();
    assert!(!denied.allowed);
    assert_eq!(denied.remaining, 0);
    let f = limiter.forecast_async("k", 1).await.unwrap();
    assert_eq!(f.spendable_now, 0);
    assert_eq!(f.full_at_ms, 86_400_000);
}

async fn shaper_reservations_queue<St>(limiter: Limiter<LeakyBucket, St>, at: impl Fn(u64))
where
    St: AsyncRateLimitStore<LeakyBucket>,
{
    at(1_000);
    let granted = |delay_ms| ShaperReservation::Granted { delay_ms };
    assert_eq!(limiter.try_reserve_async("k", 1).await.unwrap(), granted(0));
    assert_eq!(
        limiter.try_reserve_async("k", 1).await.unwrap(),
        granted(100)
    );
    assert_eq!(
        limiter.try_reserve_async("k", 1).await.unwrap(),
        ShaperReservation::QueueFull { retry_after_ms: 50 }
    );
    at(1_050);
    assert_eq!(
        limiter.try_reserve_async("k", 1).await.unwrap(),
        granted(150)
    );
    // The waiting form: a full queue is an error naming the key and the wait.
    match limiter.reserve_async("k", 1).await {
        Err(RateLimitError::QueueFull {
            key,
            retry_after_ms: 100,
        }) => assert_eq!(key, "k"),
        other => panic!("{other:?}"),
    }
    at(2_000);
    assert_eq!(limiter.reserve_async("other", 1).await.unwrap(), ms(0));
    let stats = limiter.stats();
    assert_eq!((stats.allowed, stats.denied), (4, 2));
}

async fn overrides_keep_the_key_state<St>(limiter: Limiter<SlidingWindow, St>, at: impl Fn(u64))
where
    St: AsyncRateLimitStore<SlidingWindow>,
{
    at(3_000);
    assert_eq!(limiter.check_n_async("vip", 2).await.unwrap().remaining, 0);
    limiter
        .set_override(
            "vip",
            SlidingWindow::new(10, Duration::from_secs(1)).unwrap(),
        )
        .await
        .unwrap();
    // The two spent units still count against the larger quota.
    assert_eq!(limiter.check_async("vip").await.unwrap().remaining, 7);
    assert_eq!(
        limiter.check_n_async("other", 2).await.unwrap().remaining,
        0
    );
}

async fn contract(backend: Backend) {
    let gcra = Gcra::new(3, Duration::from_secs(1)).unwrap();
    on!(
        backend.clone(),
        gcra,
        reads_never_write_and_keys_are_independent
    );
    let bucket = TokenBucket::new(5, 10, Duration::from_secs(1)).unwrap();
    on!(backend.clone(), bucket, reset_and_rest_equal_a_fresh_key);
    let tiers = Tiered::new(
        Gcra::per_second(nz(5)),
        FixedWindow::new(2, Duration::from_secs(86_400)).unwrap(),
    );
    on!(backend.clone(), tiers, tiers_are_charged_all_or_nothing);
    let shaper = LeakyBucket::new(10, Duration::from_secs(1), ms(150)).unwrap();
    on!(backend.clone(), shaper, shaper_reservations_queue);
    let window = SlidingWindow::new(2, Duration::from_secs(1)).unwrap();
    on!(backend, window, overrides_keep_the_key_state);
}

#[tokio::test]
async fn store_contract_on_memory_a_single_node_and_a_cluster() {
    contract(Backend::Memory).await;
    if let Some(node) = RedisNode::start("store_contract_on_a_single_node") {
        contract(Backend::Redis(single(&node).await)).await;
    }
    if let Some(nodes) = RedisCluster::start("store_contract_on_a_cluster") {
        contract(Backend::Redis(cluster(&nodes).await)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Across instances, on the server's clock.
// ---------------------------------------------------------------------------------------------

/// R8: `calls` concurrent checks against a limit of 50 admit exactly 50.
async fn r8_exactly_the_limit<S, St>(limiter: Limiter<S, St>) -> usize
where
    S: Strategy,
    St: AsyncRateLimitStore<S>,
{
    let admitted = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let (limiter, admitted) = (limiter.clone(), admitted.clone());
            tokio::spawn(async move {
                if limiter.check_async("hot").await.expect("decides").allowed {
                    admitted.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    admitted.load(Ordering::Relaxed)
}

async fn r8_on(redis: Option<Redis>) {
    let gcra = Gcra::new(50, Duration::from_secs(3_600)).unwrap();
    let bucket = TokenBucket::new(50, 1, Duration::from_secs(3_600)).unwrap();
    let (a, b) = match redis {
        None => (
            r8_exactly_the_limit(Limiter::new(gcra)).await,
            r8_exactly_the_limit(Limiter::new(bucket)).await,
        ),
        Some(redis) => (
            r8_exactly_the_limit(
                Limiter::builder(gcra)
                    .with_store(redis.clone())
                    .with_namespace(unique("r8g"))
                    .build(),
            )
            .await,
            r8_exactly_the_limit(
                Limiter::builder(bucket)
                    .with_store(redis)
                    .with_namespace(unique("r8t"))
                    .build(),
            )
            .await,
        ),
    };
    assert_eq!((a, b), (50, 50));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r8_two_hundred_concurrent_checks_admit_exactly_fifty() {
    r8_on(None).await;
    if let Some(node) = RedisNode::start("r8_on_a_single_node") {
        r8_on(Some(single(&node).await)).await;
    }
    if let Some(nodes) = RedisCluster::start("r8_on_a_cluster") {
        r8_on(Some(cluster(&nodes).await)).await;
    }
}

/// S11: four instances (each its own connection and limiter) hammer one key of a GCRA limit
/// of 100 per second with a burst of 100 for 1.5 s: together they get at most the burst plus
/// the rate over the elapsed time, and (the limit being exact) not much less.
async fn s11_four_instances(connect: impl AsyncFn() -> Redis) {
    const RATE: u64 = 100;
    let gcra = Gcra::per_second(nz(RATE as u32));
    let namespace = unique("s11");
    let mut limiters = Vec::new();
    for _ in 0..4 {
        limiters.push(
            Limiter::builder(gcra)
                .with_store(connect().await)
                .with_namespace(namespace.clone())
                .build(),
        );
    }
    let run_for = ms(1_500);
    let started = Instant::now();
    let tasks: Vec<_> = limiters
        .into_iter()
        .map(|limiter| {
            tokio::spawn(async move {
                let (mut admitted, mut calls) = (0u64, 0u64);
                while started.elapsed() < run_for {
                    calls += 1;
                    if limiter
                        .check_async("shared")
                        .await
                        .expect("decides")
                        .allowed
                    {
                        admitted += 1;
                    }
                }
                (admitted, calls)
            })
        })
        .collect();
    let (mut admitted, mut calls) = (0, 0);
    for task in tasks {
        let (a, c) = task.await.expect("instance");
        admitted += a;
        calls += c;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let bound = RATE + (RATE as f64 * elapsed).ceil() as u64;
    assert!(
        admitted <= bound,
        "{admitted} admitted in {elapsed:.3} s, bound {bound}"
    );
    let floor = RATE + (RATE as f64 * (elapsed - 0.3)) as u64;
    assert!(
        admitted >= floor,
        "{admitted} admitted in {elapsed:.3} s of {calls} calls, expected at least {floor}"
    );
    assert!(calls > admitted, "the limit was never reached");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s11_a_gcra_limit_holds_across_four_instances() {
    if let Some(node) = RedisNode::start("s11_on_a_single_node") {
        s11_four_instances(async || single(&node).await).await;
    }
    if let Some(nodes) = RedisCluster::start("s11_on_a_cluster") {
        s11_four_instances(async || cluster(&nodes).await).await;
    }
}

// ---------------------------------------------------------------------------------------------
// R12, S6: the fail policy while the server is down, and recovery.
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn fail_mode_decides_while_redis_is_down_and_recovery_is_automatic() {
    let Some(mut node) = RedisNode::start("fail_mode_while_redis_is_down") else {
        return;
    };
    let timeout = ms(200);
    let redis = Redis::builder(node.url())
        .with_command_timeout(timeout)
        .with_breaker(
            BreakerConfig::default()
                .with_failures(3)
                .with_cooldown(ms(300)),
        )
        .connect()
        .await
        .expect("connects");
    let errors = Arc::new(AtomicUsize::new(0));
    let enforcer = |fail: FailMode| {
        let errors = errors.clone();
        // Slow enough that no unit comes back between the checks below, however loaded the
        // machine (at 100 per second, one did after 10 ms).
        Enforcer::new(
            Limiter::builder(Gcra::new(100, Duration::from_secs(3_600)).unwrap())
                .with_store(redis.clone())
                .build(),
        )
        .with_fail_mode(fail)
        .on_error(move |key, err| {
            assert_eq!(key, "k");
            assert!(err.is_store(), "{err:?}");
            errors.fetch_add(1, Ordering::Relaxed);
        })
    };
    let (closed, open) = (enforcer(FailMode::Closed), enforcer(FailMode::Open));
    assert_eq!(
        closed.enforce_async("k", NonZeroU32::MIN).await.outcome,
        EnforceOutcome::Ok
    );

    node.kill();
    for i in 0..6 {
        for (enforcer, admits) in [(&closed, false), (&open, true)] {
            let started = Instant::now();
            let e = enforcer.enforce_async("k", NonZeroU32::MIN).await;
            assert_eq!(
                (e.outcome, e.allowed),
                (EnforceOutcome::Error, admits),
                "call {i}"
            );
            assert!(e.headers.is_empty() && e.decision.is_none());
            assert!(
                started.elapsed() < timeout + ms(150),
                "call {i} took {:?}",
                started.elapsed()
            );
        }
    }
    assert_eq!(errors.load(Ordering::Relaxed), 12);
    let stats = redis.stats().breaker;
    assert_eq!(stats.state, BreakerState::Open);

    // Back: an empty server (no script cached, no state); decisions resume by themselves.
    node.restart();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let e = closed.enforce_async("k", NonZeroU32::MIN).await;
        if e.outcome == EnforceOutcome::Ok {
            assert_eq!(e.decision.expect("decision").remaining, 99);
            break;
        }
        assert!(Instant::now() < deadline, "no recovery: {:?}", e.outcome);
        tokio::time::sleep(ms(100)).await;
    }
    let e = open.enforce_async("k", NonZeroU32::MIN).await;
    assert_eq!(e.outcome, EnforceOutcome::Ok);
    assert_eq!(e.decision.expect("decision").remaining, 98);
    assert_eq!(redis.stats().breaker.state, BreakerState::Closed);
}

/// A burst of concurrent checks (batched on a single node) while Redis stalls and while it
/// is down: every one ends within the command timeout with a store error, none hangs; back
/// up, a burst is decided exactly again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_burst_during_an_outage_fails_fast_and_recovers_exactly() {
    let Some(mut node) = RedisNode::start("burst_during_outage") else {
        return;
    };
    let timeout = ms(200);
    let redis = Redis::builder(node.url())
        .with_command_timeout(timeout)
        .with_breaker(BreakerConfig::default().with_cooldown(ms(300)))
        .connect()
        .await
        .expect("connects");
    // 50 at once, then one every 72 s: no window boundary for a burst to straddle.
    let limiter = Limiter::builder(Gcra::new(50, Duration::from_secs(3_600)).unwrap())
        .with_store(redis.clone())
        .build();
    let burst = |key: &'static str| {
        let tasks: Vec<_> = (0..200)
            .map(|_| {
                let limiter = limiter.clone();
                tokio::spawn(async move {
                    let started = Instant::now();
                    let result = limiter.check_async(key).await;
                    (result, started.elapsed())
                })
            })
            .collect();
        async move {
            let mut out = Vec::new();
            for task in tasks {
                out.push(task.await.expect("no panic"));
            }
            out
        }
    };
    let up = burst("before").await;
    let admitted = up
        .iter()
        .filter(|(r, _)| r.as_ref().unwrap().allowed)
        .count();
    assert_eq!(admitted, 50);

    // A server that stops answering (every client paused for 800 ms): each check gives
    // up at the command timeout, queued ones included.
    node.cli(&["CLIENT", "PAUSE", "800", "ALL"])
        .expect("pauses clients");
    for (result, took) in burst("stalled").await {
        let err = result.expect_err("Redis does not answer");
        assert!(err.is_store(), "{err:?}");
        assert!(took < timeout + ms(300), "took {took:?}");
    }
    tokio::time::sleep(ms(800)).await;

    node.kill();
    for (result, took) in burst("down").await {
        let err = result.expect_err("Redis is down");
        assert!(err.is_store(), "{err:?}");
        assert!(took < timeout + ms(300), "took {took:?}");
    }

    node.restart();
    let deadline = Instant::now() + Duration::from_secs(5);
    while limiter.check_async("probe").await.is_err() {
        assert!(Instant::now() < deadline, "no recovery");
        tokio::time::sleep(ms(100)).await;
    }
    let back = burst("after").await;
    let admitted = back
        .iter()
        .filter(|(r, _)| r.as_ref().unwrap().allowed)
        .count();
    assert_eq!(admitted, 50);
}

// ---------------------------------------------------------------------------------------------
// The batch queue (single node): bounded, and a caller that gave up is never charged.
// ---------------------------------------------------------------------------------------------

/// A check in flight, polled by hand.
type Call<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Decision, RateLimitError>> + Send + 'a>,
>;

/// `n` checks of `key`, each polled once in order: the first two take the two call slots and
/// go alone, the others join the batch queue. None can end at its first poll: its answer
/// needs the connection's task, which runs only once the test yields (and the server holds
/// its answers meanwhile).
fn start_checks<'a, St>(
    limiter: &'a Limiter<FixedWindow, St>,
    key: &'a str,
    n: usize,
) -> Vec<Call<'a>>
where
    St: AsyncRateLimitStore<FixedWindow>,
{
    (0..n)
        .map(|i| {
            let mut call: Call<'a> = Box::pin(limiter.check_async(key));
            assert!(
                (&mut call).now_or_never().is_none(),
                "check {i} ended at once"
            );
            call
        })
        .collect()
}

/// A single node with a long command timeout (nothing here may time out) and the given queue.
async fn batching_node(test: &str, queue: usize) -> Option<(RedisNode, Redis)> {
    let node = RedisNode::start(test)?;
    let redis = Redis::builder(node.url())
        .with_command_timeout(Duration::from_secs(10))
        .with_rate_limit_queue(std::num::NonZeroUsize::new(queue).expect("non-zero"))
        .connect()
        .await
        .expect("connects");
    // Answers held for a moment, so calls stay in flight while the test looks at them.
    node.cli(&["CLIENT", "PAUSE", "100", "ALL"])
        .expect("pauses clients");
    Some((node, redis))
}

fn remaining_sorted(decisions: Vec<Result<Decision, RateLimitError>>) -> Vec<u64> {
    let mut remaining: Vec<u64> = decisions
        .into_iter()
        .map(|d| {
            let d = d.expect("decided");
            assert!(d.allowed, "{d:?}");
            d.remaining
        })
        .collect();
    remaining.sort_unstable();
    remaining
}

#[tokio::test]
async fn a_caller_that_gave_up_before_its_batch_went_out_is_never_charged() {
    let Some((_node, redis)) = batching_node("abandoned_batch_callers", 16_384).await else {
        return;
    };
    let limiter = Limiter::builder(FixedWindow::new(100, Duration::from_secs(3_600)).unwrap())
        .with_store(redis.clone())
        .with_namespace(unique("abandoned"))
        .build();
    // Its first call would wait for the first read of the overrides: read them first.
    limiter.refresh_overrides().await.unwrap();
    // Four go alone, ten queue; seven of those callers give up (drop their futures), three
    // wait. Sent anyway, the seven would spend seven units nobody asked for any more.
    let calls = start_checks(&limiter, "k", 14);
    let kept: Vec<Call<'_>> = calls
        .into_iter()
        .enumerate()
        .filter(|(i, _)| *i < 4 || (i - 4) % 3 == 0)
        .map(|(_, call)| call)
        .collect();
    assert_eq!(kept.len(), 8);
    let decided = futures_util::future::join_all(kept).await;
    assert_eq!(remaining_sorted(decided), [92, 93, 94, 95, 96, 97, 98, 99]);
    assert_eq!(limiter.peek_async("k").await.unwrap().remaining, 92);
}

#[tokio::test]
async fn a_full_batch_queue_refuses_at_once_and_drains_cleanly() {
    let Some((node, redis)) = batching_node("full_batch_queue", 4).await else {
        return;
    };
    let namespace = unique("full");
    let limiter = Limiter::builder(FixedWindow::new(100, Duration::from_secs(3_600)).unwrap())
        .with_store(redis.clone())
        .with_namespace(namespace.clone())
        .build();
    // Its first call would wait for the first read of the overrides: read them first.
    limiter.refresh_overrides().await.unwrap();
    // Four alone, four queued: the queue is full. The next is refused at its first poll,
    // unsent, with a store error that names the key and says why.
    let calls = start_checks(&limiter, "k", 8);
    let refused = limiter
        .check_async("k")
        .now_or_never()
        .expect("refused at once");
    let err = refused.expect_err("the queue is full");
    assert!(err.is_store(), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!(r#"store failed for key "{namespace}:k""#)
    );
    let source = std::error::Error::source(&err).expect("a cause");
    assert!(
        matches!(
            source.downcast_ref::<StoreError>(),
            Some(StoreError::Overloaded { queued: 4 })
        ),
        "{source:?}"
    );
    assert_eq!(
        source.to_string(),
        "store is overloaded: 4 operations already wait for it, its cap"
    );
    // Behind an enforcer, the fail mode decides, at once too.
    for (fail, admits) in [(FailMode::Closed, false), (FailMode::Open, true)] {
        let enforcer = Enforcer::new(limiter.clone()).with_fail_mode(fail);
        let e = enforcer
            .enforce_async("k", NonZeroU32::MIN)
            .now_or_never()
            .expect("decided at once");
        assert_eq!((e.outcome, e.allowed), (EnforceOutcome::Error, admits));
    }
    // The eight are decided as if nothing had been refused.
    let decided = futures_util::future::join_all(calls).await;
    assert_eq!(remaining_sorted(decided), [92, 93, 94, 95, 96, 97, 98, 99]);

    // Callers that gave up make room: four queued and dropped, the next one queues.
    node.cli(&["CLIENT", "PAUSE", "100", "ALL"])
        .expect("pauses clients");
    let mut calls = start_checks(&limiter, "k", 8);
    calls.truncate(4);
    calls.extend(start_checks(&limiter, "k", 1));
    let decided = futures_util::future::join_all(calls).await;
    assert_eq!(remaining_sorted(decided), [87, 88, 89, 90, 91]);
    assert_eq!(limiter.peek_async("k").await.unwrap().remaining, 87);
}
