//! Redis benches, each side by side with its anchor, against `redis-server`
//! processes this bench starts itself on free loopback ports.
//!
//! - `redis_throttle_fresh`: leading throttle decisions on fresh keys, 64
//!   concurrent callers, against raw `SET key v NX PX ms` through the same
//!   client (a connection manager, as the backend uses) at the same
//!   concurrency. Target: ratio <= 1.25. Printed beside it: ours against
//!   the same command on a bare multiplexed connection, and the manager's
//!   own cost over that bare connection.
//! - `redis_throttle_hot`: a throttled call on a closed hot key with Redis
//!   against the in-memory throttle's throttled call. Target: <= 2.
//! - `redis_vs_benchmark`: our decision throughput (fresh keys, 64
//!   concurrent) against `redis-benchmark -t set -c 64 -n 200000 -q` on the
//!   same server (ratio = their throughput / ours). Target: <= 2.
//! - `redis_gcra`: a GCRA check through the Redis rate-limit store (one
//!   script call: read the state, run the maths, write it back) against
//!   `EVALSHA` of a script that returns 1, through the same client (a
//!   connection manager) at the same concurrency (64 callers over 10,000
//!   keys). Target: ratio <= 1.5. The same with one caller is printed too,
//!   and `redis_gcra_raw_script*`: the store's script called raw through the
//!   same client with the same arguments, which splits our cost into the
//!   script's server time and our client side. `redis_gcra_floor`: a
//!   script doing only what any server-timed stateful check must (`TIME`,
//!   `GET`, `SET PX`) against the same anchor, and `redis_gcra_over_floor`:
//!   our check against that floor. `redis_gcra_server_script` and
//!   `redis_gcra_server_cpu`: what each side costs the server per check,
//!   by `INFO` (script time of `EVALSHA`, and the server process's CPU).
//! - `redis_gcra_hot_key`: the same checks, all on one key (a global limit), against the
//!   same anchor; with the server's script time and CPU per check.
//! - `redis_cluster_fresh`: the same decisions on a 3-node cluster, printing
//!   throughput (median of 5 rounds).
//! - `redis_cluster_fresh_keys`: rate-limit checks (fixed window) of fresh keys on
//!   a 3-node cluster, 64 callers, each a plain `SET NX` stamped with the
//!   estimate of its slot's primary's clock; median of 5 rounds.
//! - `redis_idempotency_replay`: replaying a completed key across instances
//!   (one caller, one round trip each) against one `GET` of a key holding a
//!   value of the same size through the same client. Target: <= 1.3.
//! - `redis_idempotency_fresh`: claim, run an empty function, complete, on
//!   fresh keys (one caller) against two `EVALSHA` round trips of a script
//!   that returns 1. Target: <= 1.5.
//!
//! - `redis_vs_peer`: our side of the comparison with rate-limiter-flexible's
//!   `RateLimiterRedis` (ioredis): 64 tasks, 200,000 checks, 10 per 60 s,
//!   fixed window, GCRA, token bucket and sliding window (the peer's limiter
//!   is a fixed window), on fresh keys (every check a new key) and on one
//!   hot limited key (denied after its first 10, so answered locally), the
//!   best of 3 rounds, printing ns per check and checks per second. The Node
//!   side runs against the same server: start a `redis-server`, point this
//!   bench at it with `THROTTLEBEAM_BENCH_REDIS_URL=redis://127.0.0.1:<port>`
//!   and run the peer's script against the same port (benches/README.md).
//!
//! Run: `cargo bench --features redis --bench redis` (all), or with a name
//! filter: `cargo bench --features redis --bench redis -- redis_gcra`. With
//! `THROTTLEBEAM_BENCH_REDIS_URL` set, the single-node benches use that
//! server instead of starting one (`redis_vs_benchmark` is then skipped).

#[path = "support/figures.rs"]
#[allow(dead_code)]
mod figures;
#[path = "../tests/support/redis.rs"]
#[allow(dead_code, unreachable_pub)]
mod support_redis;

use std::convert::Infallible;
use std::hint::black_box;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use figures::{median, selected};
use support_redis::{RedisCluster, RedisNode};
use throttlebeam::rate_limit::{
    AsyncRateLimitStore, FixedWindow, Gcra, Limiter, SlidingWindow, Strategy, TokenBucket,
};
use throttlebeam::store::Redis;
use throttlebeam::{Runtime, ThrottleOutcome};

const CALLERS: usize = 64;
const DECISIONS: u64 = 100_000;
const HOT_CALLS: u64 = 1_000_000;
const WINDOW: Duration = Duration::from_secs(60);

fn tokio_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn compare(name: &str, ours: f64, anchor: f64) {
    println!(
        "compare {name}: ours {ours:.0} ns, anchor {anchor:.0} ns, ratio {:.2}",
        ours / anchor
    );
}

/// A `compare` line whose figures are medians over rounds and whose ratio
/// is the median of the rounds' ratios.
fn compare_median(name: &str, ours: f64, anchor: f64, ratio: f64) {
    println!(
        "compare {name}: ours {ours:.0} ns, anchor {anchor:.0} ns, ratio {ratio:.2} \
         (medians of 7 alternating rounds)"
    );
}

/// Runs `total` operations over `CALLERS` tasks; returns ns per operation
/// (wall time / operations, so the inverse of throughput).
async fn concurrent<F, Fut>(total: u64, op: F) -> f64
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    concurrent_with(CALLERS, total, op).await
}

/// Like [`concurrent`] with `callers` tasks.
async fn concurrent_with<F, Fut>(callers: usize, total: u64, op: F) -> f64
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..callers)
        .map(|_| {
            let (next, op) = (next.clone(), op.clone());
            tokio::spawn(async move {
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= total {
                        break;
                    }
                    op(n).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("caller");
    }
    start.elapsed().as_nanos() as f64 / total as f64
}

async fn ours_fresh(runtime: &Runtime, run: u64) -> f64 {
    let throttle = runtime.throttle();
    concurrent(DECISIONS, move |n| {
        let throttle = throttle.clone();
        async move {
            let key = format!("fresh:{run}:{n}");
            let outcome = throttle
                .call(&key, WINDOW, || async { Ok::<_, Infallible>(()) })
                .await
                .expect("decision");
            drop(black_box(outcome));
        }
    })
    .await
}

/// Raw `SET NX PX` on fresh keys through `conn`.
async fn raw_set<C>(conn: C, run: u64) -> f64
where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
{
    concurrent(DECISIONS, move |n| {
        let mut conn = conn.clone();
        async move {
            let key = format!("raw:{run}:{n}");
            let set: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg(1)
                .arg("NX")
                .arg("PX")
                .arg(WINDOW.as_millis() as u64)
                .query_async(&mut conn)
                .await
                .expect("SET NX PX");
            black_box(set);
        }
    })
    .await
}

/// The client the `Redis` backend uses on a single node: a connection
/// manager (reconnecting, over one multiplexed connection).
async fn manager(url: &str) -> redis::aio::ConnectionManager {
    let client = redis::Client::open(url).expect("client");
    redis::aio::ConnectionManager::new(client)
        .await
        .expect("connection manager")
}

/// A bare multiplexed connection, without the manager's reconnect layer.
async fn multiplexed(url: &str) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(url).expect("client");
    client
        .get_multiplexed_async_connection()
        .await
        .expect("connection")
}

/// `SET NX PX` and `PTTL` pipelined, raw: what our decision sends.
async fn raw_pipe(url: &str, run: u64) -> f64 {
    let client = redis::Client::open(url).expect("client");
    let conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connection");
    concurrent(DECISIONS, move |n| {
        let mut conn = conn.clone();
        async move {
            let key = format!("pipe:{run}:{n}");
            let reply: (Option<String>, i64) = redis::pipe()
                .cmd("SET")
                .arg(&key)
                .arg(1)
                .arg("NX")
                .arg("PX")
                .arg(WINDOW.as_millis() as u64)
                .cmd("PTTL")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .expect("SET NX PX; PTTL");
            black_box(reply);
        }
    })
    .await
}

async fn hot(runtime: &Runtime) -> f64 {
    let throttle = runtime.throttle();
    let first = throttle
        .call("hot", WINDOW, || async { Ok::<_, Infallible>(()) })
        .await
        .expect("first call");
    assert!(matches!(first, ThrottleOutcome::Executed(())));
    for _ in 0..1_000 {
        let outcome = throttle
            .call("hot", WINDOW, || async { Ok::<_, Infallible>(()) })
            .await
            .expect("warm-up");
        drop(black_box(outcome));
    }
    let start = Instant::now();
    for _ in 0..HOT_CALLS {
        let outcome = throttle
            .call("hot", WINDOW, || async { Ok::<_, Infallible>(()) })
            .await
            .expect("throttled call");
        assert!(matches!(outcome, ThrottleOutcome::Throttled { .. }));
    }
    start.elapsed().as_nanos() as f64 / HOT_CALLS as f64
}

/// Keys the GCRA bench spreads its checks over.
const GCRA_KEYS: u64 = 10_000;

/// GCRA checks through the Redis store, `callers` at a time: ns per check.
async fn ours_gcra(limiter: &Limiter<Gcra, Redis>, callers: usize, total: u64) -> f64 {
    ours_gcra_on(limiter, callers, total, GCRA_KEYS).await
}

/// [`ours_gcra`] over `keys` keys.
async fn ours_gcra_on(
    limiter: &Limiter<Gcra, Redis>,
    callers: usize,
    total: u64,
    keys: u64,
) -> f64 {
    let limiter = limiter.clone();
    concurrent_with(callers, total, move |n| {
        let limiter = limiter.clone();
        async move {
            let key = format!("gcra:{}", n % keys);
            let decision = limiter.check_async(&key).await.expect("decision");
            black_box(decision);
        }
    })
    .await
}

/// `EVALSHA` of `return 1` through a connection manager, `callers` at a
/// time: ns per call.
async fn script_returning_one(url: &str, callers: usize, total: u64) -> f64 {
    script_calls(url, callers, total, "return 1", "one").await
}

/// `EVALSHA` of `source` on keys `{throttlebeam:<name>:<n>}:r` through a
/// connection manager, `callers` at a time: ns per call.
async fn script_calls(
    url: &str,
    callers: usize,
    total: u64,
    source: &'static str,
    name: &'static str,
) -> f64 {
    let client = redis::Client::open(url).expect("client");
    let conn = redis::aio::ConnectionManager::new(client)
        .await
        .expect("connection manager");
    let script = Arc::new(redis::Script::new(source));
    concurrent_with(callers, total, move |n| {
        let (mut conn, script) = (conn.clone(), script.clone());
        async move {
            let key = format!("{{throttlebeam:{name}:{}}}:r", n % GCRA_KEYS);
            let reply: redis::Value = script
                .key(key)
                .invoke_async(&mut conn)
                .await
                .expect("EVALSHA");
            black_box(reply);
        }
    })
    .await
}

async fn gcra(url: &str, redis: &Redis) {
    // 1,000 per minute per key: every check is allowed, and reads and writes a
    // state that stays live between the checks of its key.
    let limiter = Limiter::builder(Gcra::per_minute(std::num::NonZeroU32::new(1_000).unwrap()))
        .with_store(redis.clone())
        .with_namespace("bench")
        .build();
    ours_gcra(&limiter, CALLERS, DECISIONS / 4).await;
    script_returning_one(url, CALLERS, DECISIONS / 4).await;
    // The floor alternates with both sides, so all three see the same load.
    let (mut ours, mut anchor, mut floor) = (f64::MAX, f64::MAX, f64::MAX);
    // What each side costs the server per check: script time and process CPU.
    let mut server = ServerProbe::new(url).await;
    let (mut ours_server, mut anchor_server) = ([f64::MAX; 3], [f64::MAX; 3]);
    let min_each = |a: [f64; 3], b: [f64; 3]| [0, 1, 2].map(|i| a[i].min(b[i]));
    for _ in 0..3 {
        server.start().await;
        ours = ours.min(ours_gcra(&limiter, CALLERS, DECISIONS).await);
        ours_server = min_each(ours_server, server.per_call(DECISIONS).await);
        server.start().await;
        anchor = anchor.min(script_returning_one(url, CALLERS, DECISIONS).await);
        anchor_server = min_each(anchor_server, server.per_call(DECISIONS).await);
        floor = floor.min(floor_script(url, CALLERS, DECISIONS).await);
    }
    compare("redis_gcra", ours, anchor);
    compare("redis_gcra_floor", floor, anchor);
    compare("redis_gcra_over_floor", ours, floor);
    compare("redis_gcra_server_script", ours_server[0], anchor_server[0]);
    compare("redis_gcra_server_cpu", ours_server[1], anchor_server[1]);
    println!(
        "redis_gcra: {:.3} script calls per check (a call per {:.1} checks)",
        ours_server[2],
        1.0 / ours_server[2]
    );
    // One hot key (a global limit): a limit no check reaches, so every check is allowed and
    // writes the key.
    let hot = Limiter::builder(Gcra::per_second(
        std::num::NonZeroU32::new(1_000_000).unwrap(),
    ))
    .with_store(redis.clone())
    .with_namespace("bench-hot")
    .build();
    let (mut ours, mut anchor, mut hot_server) = (f64::MAX, f64::MAX, [f64::MAX; 3]);
    for _ in 0..3 {
        server.start().await;
        ours = ours.min(ours_gcra_on(&hot, CALLERS, DECISIONS, 1).await);
        hot_server = min_each(hot_server, server.per_call(DECISIONS).await);
        anchor = anchor.min(script_returning_one(url, CALLERS, DECISIONS).await);
    }
    compare("redis_gcra_hot_key", ours, anchor);
    println!(
        "redis_gcra_hot_key: {:.0} ns of script time and {:.0} ns of server CPU per check",
        hot_server[0], hot_server[1]
    );
    let (mut ours, mut anchor) = (f64::MAX, f64::MAX);
    for _ in 0..3 {
        ours = ours.min(ours_gcra(&limiter, 1, DECISIONS / 5).await);
        anchor = anchor.min(script_returning_one(url, 1, DECISIONS / 5).await);
    }
    compare("redis_gcra_one_caller", ours, anchor);
    let (mut raw, mut anchor) = (f64::MAX, f64::MAX);
    for _ in 0..3 {
        raw = raw.min(raw_script(url, 1, DECISIONS / 5).await);
        anchor = anchor.min(script_returning_one(url, 1, DECISIONS / 5).await);
    }
    compare("redis_gcra_raw_script_one_caller", raw, anchor);
    let (mut raw, mut anchor) = (f64::MAX, f64::MAX);
    for _ in 0..3 {
        raw = raw.min(raw_script(url, CALLERS, DECISIONS).await);
        anchor = anchor.min(script_returning_one(url, CALLERS, DECISIONS).await);
    }
    compare("redis_gcra_raw_script", raw, anchor);
}

/// The server's cost per check, read from `INFO`: script time (`EVALSHA` in
/// `commandstats`, reset by `start`) and the process's CPU (`used_cpu_*`).
struct ServerProbe {
    conn: redis::aio::ConnectionManager,
    cpu_at_start: f64,
}

impl ServerProbe {
    async fn new(url: &str) -> Self {
        let client = redis::Client::open(url).expect("client");
        let conn = redis::aio::ConnectionManager::new(client)
            .await
            .expect("connection manager");
        Self {
            conn,
            cpu_at_start: 0.0,
        }
    }

    /// The numbers after each of `lines` in `INFO <section>` (0 when missing), from one
    /// `INFO`; with `field`, the value of that `field=` of a `k=v,k=v` line.
    async fn info<const N: usize>(
        &mut self,
        section: &str,
        lines: [&str; N],
        field: &str,
    ) -> [f64; N] {
        let info: String = redis::cmd("INFO")
            .arg(section)
            .query_async(&mut self.conn)
            .await
            .expect("INFO");
        lines.map(|line| {
            info.lines()
                .find_map(|l| l.strip_prefix(line))
                .and_then(|rest| rest.split(',').find_map(|kv| kv.strip_prefix(field)))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0.0)
        })
    }

    async fn cpu(&mut self) -> f64 {
        let [user, sys] = self
            .info("cpu", ["used_cpu_user:", "used_cpu_sys:"], "")
            .await;
        user + sys
    }

    async fn start(&mut self) {
        redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .exec_async(&mut self.conn)
            .await
            .expect("CONFIG RESETSTAT");
        self.cpu_at_start = self.cpu().await;
    }

    /// Script time and server CPU per check, in ns, and script calls per check, since
    /// `start`, over `checks`.
    async fn per_call(&mut self, checks: u64) -> [f64; 3] {
        let cpu = self.cpu().await - self.cpu_at_start;
        let [script_us] = self
            .info("commandstats", ["cmdstat_evalsha:"], "usec=")
            .await;
        let [calls] = self
            .info("commandstats", ["cmdstat_evalsha:"], "calls=")
            .await;
        [
            script_us * 1_000.0 / checks as f64,
            cpu * 1e9 / checks as f64,
            calls / checks as f64,
        ]
    }
}

/// The least a server-timed stateful script does: `TIME`, `GET` of the
/// state, `SET PX` of the next state, and a reply of the same shape as a
/// decision. What no GCRA on Redis with the server's clock can skip.
const FLOOR: &str = r"
local t = redis.call('TIME')
local state = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], t[1], 'PX', 60000)
return {1, 1, 1000, 999, 1, 0}
";

/// [`FLOOR`] through a connection manager, `callers` at a time: ns per call.
async fn floor_script(url: &str, callers: usize, total: u64) -> f64 {
    script_calls(url, callers, total, FLOOR, "floor").await
}

/// A GCRA check of 1,000 per minute as the script reads it: pinned time (none),
/// op, cost, slack ms, kinds, then the limit, period_us, per and tolerance.
const GCRA_ARGS: [&str; 9] = [
    "",
    "c",
    "1",
    "1",
    "g",
    "1000",
    "60000000",
    "1000",
    "60000000000",
];

/// The store's rate-limit script called raw through a connection manager
/// with a GCRA check's arguments, `callers` at a time: ns per call. What
/// separates it from `ours_gcra` is our client side; what separates it from
/// `script_returning_one` is the script's work on the server.
async fn raw_script(url: &str, callers: usize, total: u64) -> f64 {
    // The library (its own `TIME` reader included), then the store's entry point for one
    // operation.
    let body = include_str!("../src/rate_limit/rate_limit.lua");
    let src = format!(
        "{body}\nlocal now = clock(now_us(ARGV[1]))\nlocal out = {{}}\n\
         decide(KEYS[1], params(2), now, redis.call('GET', KEYS[1]), out, 1)\nreturn out\n"
    );
    let client = redis::Client::open(url).expect("client");
    let conn = redis::aio::ConnectionManager::new(client)
        .await
        .expect("connection manager");
    let script = Arc::new(redis::Script::new(&src));
    concurrent_with(callers, total, move |n| {
        let (mut conn, script) = (conn.clone(), script.clone());
        async move {
            let key = format!("{{throttlebeam:raw:{}}}:r", n % GCRA_KEYS);
            let one: Vec<i64> = script
                .key(key)
                .arg(GCRA_ARGS.as_slice())
                .invoke_async(&mut conn)
                .await
                .expect("EVALSHA");
            black_box(one);
        }
    })
    .await
}

/// `redis-benchmark -t set -c 64 -n 200000 -q` against `port`: requests/s.
fn redis_benchmark(port: u16) -> Option<f64> {
    let out = Command::new("redis-benchmark")
        .args([
            "-p",
            &port.to_string(),
            "-t",
            "set",
            "-c",
            "64",
            "-n",
            "200000",
            "-q",
        ])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    // "SET: 123456.79 requests per second, p50=0.255 msec" (possibly after \r progress lines)
    let line = text.rsplit(['\r', '\n']).find(|l| l.starts_with("SET:"))?;
    line.trim_start_matches("SET:")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Callers and checks of `redis_vs_peer`, as the peer's script runs them.
const PEER_CALLERS: usize = 64;
const PEER_CHECKS: u64 = 200_000;

/// `PEER_CHECKS` checks of `strategy` over `PEER_CALLERS` tasks, on fresh keys (`hot`
/// false: every check a new key) or all on one key: ns per check.
/// The round's keys are deleted after it, unmeasured.
async fn peer_round<S: Strategy>(
    (url, redis): (&str, &Redis),
    strategy: S,
    namespace: String,
    hot: bool,
) -> f64
where
    Redis: AsyncRateLimitStore<S>,
{
    let limiter = Limiter::builder(strategy)
        .with_store(redis.clone())
        .with_namespace(namespace.clone())
        .build();
    let ns = concurrent_with(PEER_CALLERS, PEER_CHECKS, move |n| {
        let limiter = limiter.clone();
        async move {
            let decision = if hot {
                limiter.check_async("hot").await
            } else {
                limiter.check_async(&format!("k{n}")).await
            };
            black_box(decision.expect("decision"));
        }
    })
    .await;
    forget_namespace(url, &namespace).await;
    ns
}

/// Deletes the keys a round wrote under `namespace` (`SCAN` and `UNLINK`, unmeasured), so that
/// every round starts on a server holding what the peer's run starts on: the keys of at most
/// one round, not a million of earlier rounds (a fuller keyspace makes every `SET` dearer).
async fn forget_namespace(url: &str, namespace: &str) {
    let mut conn = multiplexed(url).await;
    let pattern = format!("*:{namespace}:*");
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(10_000)
            .query_async(&mut conn)
            .await
            .expect("SCAN");
        if !keys.is_empty() {
            let _: u64 = redis::cmd("UNLINK")
                .arg(&keys)
                .query_async(&mut conn)
                .await
                .expect("UNLINK");
        }
        if next == 0 {
            return;
        }
        cursor = next;
    }
}

/// `redis_vs_peer`: one strategy, fresh keys then one hot limited key, best of 3 rounds.
async fn peer_side<S: Strategy>(url: &str, redis: &Redis, name: &str, strategy: S)
where
    Redis: AsyncRateLimitStore<S>,
{
    let (mut fresh, mut hot) = (f64::MAX, f64::MAX);
    let answered = redis.stats().local_answers;
    for round in 0..3 {
        let run = format!("{}-{round}", std::process::id());
        fresh = fresh.min(
            peer_round(
                (url, redis),
                strategy.clone(),
                format!("peer-fresh-{name}-{run}"),
                false,
            )
            .await,
        );
        hot = hot.min(
            peer_round(
                (url, redis),
                strategy.clone(),
                format!("peer-hot-{name}-{run}"),
                true,
            )
            .await,
        );
    }
    let local = redis.stats().local_answers - answered;
    for (line, ns) in [("fresh", fresh), ("hot_limited", hot)] {
        println!(
            "redis_vs_peer {name}_{line}: {ns:.0} ns/op, {:.0} ops/s ({PEER_CALLERS} tasks, \
             {PEER_CHECKS} checks, 10 per 60 s, best of 3)",
            1e9 / ns
        );
    }
    println!(
        "redis_vs_peer {name}: {local} of the hot key's {} checks answered locally",
        3 * PEER_CHECKS
    );
}

async fn vs_peer(url: &str, redis: &Redis) {
    let (limit, period) = (10, Duration::from_secs(60));
    // Warm-up, unmeasured: the scripts loaded, the pub/sub listener subscribed, the
    // runtime's threads and allocator busy.
    let warm = format!("peer-warm-{}", std::process::id());
    let window = FixedWindow::new(limit, period).expect("limit");
    peer_round((url, redis), window, format!("{warm}-fixed"), false).await;
    peer_round(
        (url, redis),
        Gcra::new(limit, period).expect("limit"),
        format!("{warm}-gcra"),
        false,
    )
    .await;
    peer_side(
        url,
        redis,
        "fixed_window",
        FixedWindow::new(limit, period).expect("limit"),
    )
    .await;
    peer_side(url, redis, "gcra", Gcra::new(limit, period).expect("limit")).await;
    peer_side(
        url,
        redis,
        "token_bucket",
        TokenBucket::new(limit, limit, period).expect("limit"),
    )
    .await;
    peer_side(
        url,
        redis,
        "sliding_window",
        SlidingWindow::new(limit, period).expect("limit"),
    )
    .await;
}

fn main() {
    let rt = tokio_runtime();
    // A server of the user's (to run the peer against the same one), or one of our own.
    let external = std::env::var("THROTTLEBEAM_BENCH_REDIS_URL")
        .ok()
        .filter(|u| !u.is_empty());
    let node = match &external {
        Some(_) => None,
        None => match RedisNode::start("bench redis") {
            Some(node) => Some(node),
            None => return,
        },
    };
    let url = external.unwrap_or_else(|| node.as_ref().map(RedisNode::url).unwrap_or_default());
    rt.block_on(async {
        let redis = Redis::builder(url.clone())
            .connect()
            .await
            .expect("connects");
        if selected("redis_vs_peer") {
            vs_peer(&url, &redis).await;
        }
        if selected("redis_gcra") {
            gcra(&url, &redis).await;
        }
        if !selected("redis_throttle") && !selected("redis_vs_benchmark") {
            return;
        }
        let runtime = Runtime::builder()
            .with_redis(redis)
            .start()
            .await
            .expect("runtime");
        let memory = Runtime::builder().start().await.expect("memory runtime");

        // Warm-up every side, then 7 rounds alternating them; each figure
        // is the median over the rounds, and the ratio the median of the
        // rounds' ratios (one round of either side varies by up to 1.5x on
        // a shared VM). The anchor goes through the same client as ours (a
        // connection manager); the bare multiplexed connection under it is
        // printed beside.
        let (through_manager, bare) = (manager(&url).await, multiplexed(&url).await);
        ours_fresh(&runtime, 0).await;
        raw_set(through_manager.clone(), 0).await;
        raw_set(bare.clone(), 0).await;
        let (mut ours_runs, mut anchor_runs, mut bare_runs) = (vec![], vec![], vec![]);
        for run in 1..=7 {
            ours_runs.push(ours_fresh(&runtime, run).await);
            anchor_runs.push(raw_set(through_manager.clone(), run).await);
            bare_runs.push(raw_set(bare.clone(), run + 100).await);
        }
        // Ratios first: the medians below sort the runs in place.
        let ratios_to = |other: &[f64]| -> Vec<f64> {
            ours_runs.iter().zip(other).map(|(o, a)| o / a).collect()
        };
        let (mut ratios, mut bare_ratios) = (ratios_to(&anchor_runs), ratios_to(&bare_runs));
        let ours = median(&mut ours_runs);
        let anchor = median(&mut anchor_runs);
        compare_median("redis_throttle_fresh", ours, anchor, median(&mut ratios));
        compare_median(
            "redis_throttle_fresh_vs_bare_connection",
            ours,
            median(&mut bare_runs),
            median(&mut bare_ratios),
        );
        let mut pipe = f64::MAX;
        for run in 1..=3 {
            pipe = pipe.min(raw_pipe(&url, run).await);
        }
        compare("redis_throttle_fresh_raw_pipeline", pipe, anchor);

        let (hot_ours, hot_anchor) = (hot(&runtime).await, hot(&memory).await);
        compare("redis_throttle_hot", hot_ours, hot_anchor);

        match node.as_ref().and_then(|node| redis_benchmark(node.port)) {
            Some(theirs) => {
                let ours_rps = 1e9 / ours;
                println!(
                    "compare redis_vs_benchmark: ours {ours:.0} ns, anchor {:.0} ns, ratio {:.2} \
                     (ours {ours_rps:.0} decisions/s, redis-benchmark {theirs:.0} SET/s)",
                    1e9 / theirs,
                    theirs / ours_rps
                );
            }
            None => println!("redis_vs_benchmark: skipped, redis-benchmark did not run"),
        }
        idempotency(&runtime, &url).await;
        runtime.shutdown(Duration::from_secs(1)).await;
        memory.shutdown(Duration::from_secs(1)).await;
    });

    if !selected("redis_cluster_fresh") {
        return;
    }
    let Some(cluster) = RedisCluster::start("bench redis cluster") else {
        return;
    };
    rt.block_on(async {
        let redis = Redis::cluster(cluster.urls())
            .connect()
            .await
            .expect("connects to the cluster");
        let runtime = Runtime::builder()
            .with_redis(redis.clone())
            .start()
            .await
            .expect("runtime");
        ours_fresh(&runtime, 0).await;
        let mut throttle_runs: Vec<f64> = Vec::new();
        for run in 1..=5 {
            throttle_runs.push(ours_fresh(&runtime, run).await);
        }
        let ns = median(&mut throttle_runs);
        println!(
            "redis_cluster_fresh: {ns:.0} ns per decision, {:.0} decisions/s (3-node cluster, 64 callers, median of 5)",
            1e9 / ns
        );
        // Rate-limit checks of fresh keys: each a plain `SET NX` of the state the script would
        // write, stamped with the estimate of the clock of the key's slot's primary.
        let limiter = Limiter::builder(FixedWindow::new(10, WINDOW).expect("a limit"))
            .with_store(redis.clone())
            .with_namespace(format!("cluster-fresh-{}", std::process::id()))
            .build();
        fresh_checks(&limiter, 0).await;
        let before = redis.stats();
        let mut check_runs: Vec<f64> = Vec::new();
        for run in 1..=5 {
            check_runs.push(fresh_checks(&limiter, run).await);
        }
        let after = redis.stats();
        let ns = median(&mut check_runs);
        println!(
            "redis_cluster_fresh_keys: {ns:.0} ns per check, {:.0} checks/s (3-node cluster, 64 callers, \
             median of 5; {} of {} checks written with SET NX)",
            1e9 / ns,
            after.fresh_key_writes - before.fresh_key_writes,
            5 * DECISIONS
        );
        runtime.shutdown(Duration::from_secs(1)).await;
    });
}

/// `DECISIONS` checks of `limiter` over 64 callers, each of a key never checked before.
async fn fresh_checks(limiter: &Limiter<FixedWindow, Redis>, run: u64) -> f64 {
    let limiter = limiter.clone();
    concurrent(DECISIONS, move |n| {
        let limiter = limiter.clone();
        async move {
            let key = format!("fresh-check:{run}:{n}");
            let decision = limiter.check_async(&key).await.expect("decided");
            assert!(decision.allowed);
        }
    })
    .await
}

/// Sequential operations per measurement of the idempotency benches.
const IDEMPOTENT_CALLS: u64 = 20_000;

/// Mean ns of `op` over `n` sequential calls.
async fn sequential<F, Fut>(n: u64, mut op: F) -> f64
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let start = Instant::now();
    for i in 0..n {
        op(i).await;
    }
    start.elapsed().as_nanos() as f64 / n as f64
}

async fn idempotency(runtime: &Runtime, url: &str) {
    let idem = runtime.idempotency();
    let client = redis::Client::open(url).expect("client");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connection");
    // The replayed value: 9 bytes of MessagePack, as a GET of 8 bytes.
    let stored = idem
        .run("bench:replay", || async { Ok::<_, Infallible>(u64::MAX) })
        .await
        .expect("stored");
    assert!(stored.is_fresh());
    let _: () = redis::cmd("SET")
        .arg("bench:get")
        .arg(&u64::MAX.to_le_bytes()[..])
        .query_async(&mut conn)
        .await
        .expect("SET");
    let script = redis::Script::new("return 1");
    let (mut replay, mut get, mut fresh, mut evalsha) = (f64::MAX, f64::MAX, f64::MAX, f64::MAX);
    for run in 0..3u64 {
        replay = replay.min(
            sequential(IDEMPOTENT_CALLS, |_| {
                let idem = idem.clone();
                async move {
                    let outcome = idem
                        .run("bench:replay", || async { Ok::<_, Infallible>(0u64) })
                        .await
                        .expect("replay");
                    assert!(outcome.is_replay());
                }
            })
            .await,
        );
        get = get.min(
            sequential(IDEMPOTENT_CALLS, |_| {
                let mut conn = conn.clone();
                async move {
                    let value: Vec<u8> = redis::cmd("GET")
                        .arg("bench:get")
                        .query_async(&mut conn)
                        .await
                        .expect("GET");
                    black_box(value);
                }
            })
            .await,
        );
        fresh = fresh.min(
            sequential(IDEMPOTENT_CALLS, |i| {
                let idem = idem.clone();
                async move {
                    let outcome = idem
                        .run(&format!("bench:fresh:{run}:{i}"), move || async move {
                            Ok::<_, Infallible>(i)
                        })
                        .await
                        .expect("fresh");
                    assert!(outcome.is_fresh());
                }
            })
            .await,
        );
        evalsha = evalsha.min(
            sequential(IDEMPOTENT_CALLS, |_| {
                let (mut conn, script) = (conn.clone(), &script);
                async move {
                    for _ in 0..2 {
                        let one: i64 = script.invoke_async(&mut conn).await.expect("EVALSHA");
                        black_box(one);
                    }
                }
            })
            .await,
        );
    }
    compare("redis_idempotency_replay", replay, get);
    compare("redis_idempotency_fresh", fresh, evalsha);
}
