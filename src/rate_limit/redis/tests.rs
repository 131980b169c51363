use std::num::NonZeroU32;
use std::time::Duration;

use super::fresh::{self, Guess, PROBE_EVERY};
use super::local::LocalAnswers;
use super::operation::{Args, Fresh};
use super::script::{argument_sets, batch_replies, decode};
use super::*;
use crate::rate_limit::{
    Decision, FixedWindow, Gcra, LeakyBucket, MemoryRateLimitStore, RateLimitOp, RateLimitStore,
    ShaperReservation, SlidingWindow, Tiered, TokenBucket,
};
use crate::store::redis::{RedisBuilder, each_server, each_server_with};

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
        // The theoretical arrival time 1.5 s in µs, no remainder, then the rest time: when
        // the state is at rest under these limits (for a GCRA, its arrival time).
        assert_eq!(
            decode_state(&stored("k").await, "g"),
            [1_500_000, 0, 1_500_000]
        );
        apply(&redis, &gcra(), "k", check).await.unwrap();
        assert_eq!(
            decode_state(&stored("k").await, "g"),
            [2_000_000, 0, 2_000_000]
        );
        // Two tiers in one value, each one's fields (a sliding window keeps three), then the
        // later of their rest times (the sliding window's: two windows on).
        let tiered = Tiered::new(
            gcra(),
            SlidingWindow::new(10, Duration::from_secs(1)).unwrap(),
        );
        apply(&redis, &tiered, "t", check).await.unwrap();
        let state = decode_state(&stored("t").await, "gs");
        assert_eq!(state, [1_500_000, 0, 1_000_000, 0, 1, 3_000_000]);

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

/// A state written by 0.2 (its fields and no rest time) is still read, as that release read
/// it; and a state at rest under the limits that wrote it reads as no state under others.
#[tokio::test]
async fn a_state_without_a_rest_time_is_read_and_one_at_rest_is_none() {
    each_server("rate_limit_state_formats", async |redis: Redis| {
        let check = RateLimitOp::Check {
            cost: NonZeroU32::MIN,
        };
        let double = |v: u64| (v as f64).to_le_bytes();
        // A GCRA of 2 per second: its arrival time 2 s, as 0.2 wrote it (no rest time).
        let mut old = b"g".to_vec();
        old.extend_from_slice(&double(2_000_000));
        old.extend_from_slice(&double(0));
        let _: () = redis
            .query(redis::cmd("SET").arg(redis.key("old", ":r")).arg(old))
            .await
            .unwrap();
        redis.pin_time(1_000);
        match apply(&redis, &gcra(), "old", check).await.unwrap() {
            RateLimitReply::Decision(d) => assert_eq!((d.allowed, d.retry_after_ms), (false, 500)),
            other => panic!("{other:?}"),
        }
        // A fixed window of 1 per ms spends its unit at 0; read a second later by a window of
        // 1 per minute (which holds the same start), it is at rest: no state.
        let short = FixedWindow::new(1, Duration::from_millis(1)).unwrap();
        let long = FixedWindow::new(1, Duration::from_secs(60)).unwrap();
        redis.pin_time_us(0);
        apply(&redis, &short, "w", check).await.unwrap();
        redis.pin_time_us(999);
        match apply(&redis, &long, "w", check).await.unwrap() {
            RateLimitReply::Decision(d) => assert!(!d.allowed, "{d:?}"),
            other => panic!("{other:?}"),
        }
        redis.pin_time_us(1_000_000);
        match apply(&redis, &long, "w", check).await.unwrap() {
            RateLimitReply::Decision(d) => assert!(d.allowed, "{d:?}"),
            other => panic!("{other:?}"),
        }
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
        assert_eq!(
            decode_state(&stored, "g"),
            [8_600_000_250, 0, 8_600_000_250]
        );
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

/// A backend whose checks all go through the script (no plain `SET NX` for fresh keys): for
/// the tests of the batch script itself.
fn scripts_only(builder: RedisBuilder) -> RedisBuilder {
    builder.with_fresh_key_writes(false)
}

/// [`each_server`] on backends whose checks all go through the script.
async fn each_scripted_server(test: &str, check: impl AsyncFn(Redis)) {
    each_server_with(test, scripts_only, check).await;
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
    let bound = |b: RedisBuilder| scripts_only(b).with_command_timeout(Duration::from_secs(2));
    each_server_with("rate_limit_batches", bound, async |redis: Redis| {
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
    each_scripted_server("rate_limit_hot_key", async |redis: Redis| {
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
            // The first four went alone; the other 36 queued into one batch, one write.
            assert_eq!(sets_run(&redis).await - sets, 5);
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
    each_scripted_server("rate_limit_batch_errors", async |redis: Redis| {
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
        // The first four fill the call slots; the other four wait and go together.
        let (first, second, third, fourth, a, foreign, b, other_type) = tokio::join!(
            apply(&redis, &g, "first", check_one()),
            apply(&redis, &g, "second", check_one()),
            apply(&redis, &g, "third", check_one()),
            apply(&redis, &g, "fourth", check_one()),
            apply(&redis, &g, "a", check_one()),
            apply(&redis, &g, "window", check_one()),
            apply(&redis, &g, "b", check_one()),
            apply(&redis, &g, "hashed", check_one()),
        );
        let calls = redis.stats().commands - before;
        if redis.is_cluster() {
            assert_eq!(calls, 8);
        } else {
            assert_eq!(calls, 5, "four alone, then one batch of four");
        }
        let err = other_type.unwrap_err();
        assert!(err.is_store(), "{err:?}");
        let kind: String = redis.query(redis::cmd("TYPE").arg(&hashed)).await.unwrap();
        assert_eq!(kind, "hash");
        for ok in [first, second, third, fourth] {
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
            fresh: None,
            learn: false,
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

/// Lets a unit test act at the moment a local answer reads its clock (see `answer_clock`).
pub(super) mod clock_hook {
    use std::cell::RefCell;

    thread_local! {
        static HOOK: RefCell<Option<Box<dyn FnOnce()>>> = const { RefCell::new(None) };
    }

    /// Runs `hook` right after a local answer on this thread next reads its clock.
    pub(in super::super) fn set(hook: impl FnOnce() + 'static) {
        HOOK.with(|h| *h.borrow_mut() = Some(Box::new(hook)));
    }

    pub(in super::super) fn run() {
        if let Some(hook) = HOOK.with(|h| h.borrow_mut().take()) {
            hook();
        }
    }
}

/// Issue 50 item 5: a check reads the clock for its local answer while another check's
/// denial (a later one, stamped with a later reading) is kept. The answer still counts down
/// from a reading taken no earlier than the denial it uses: it never says more than the
/// server's retry-after (GCRA, emission interval 20 ms: never over 20 ms). Real time: the hook
/// lets 3 ms pass between the lookup and the reading, and keeps the other denial then.
#[test]
fn a_local_answer_never_says_later_than_the_server() {
    let local: &'static LocalAnswers = Box::leak(Box::new(LocalAnswers::new(16)));
    let args = || Args {
        op: "c",
        cost: 1,
        slack: 1,
        kinds: "g".to_owned(),
        numbers: vec![1, 1_000_000, 50, 1_000_000],
        channel: String::new(),
    };
    let sent = move || {
        let args = args();
        let ticket = local.ticket(&args, Some(1));
        Operation {
            key: "k".to_owned(),
            args,
            ticket,
            fresh: None,
            learn: false,
        }
    };
    let denial = RateLimitReply::Decision(Decision {
        allowed: false,
        limit: 1,
        remaining: 0,
        reset_at_ms: 90_000,
        retry_after_ms: 20,
    });
    for _ in 0..3 {
        local.forget("k");
        local.remember(&sent(), &denial, Some(1));
        // While the next check reads its clock, 3 ms pass and another denial of 20 ms (sent
        // and answered then) is kept.
        let other = sent();
        clock_hook::set(move || {
            std::thread::sleep(Duration::from_millis(3));
            let other = Operation {
                ticket: local.ticket(&other.args, Some(1)),
                ..other
            };
            local.remember(&other, &denial, Some(1));
        });
        match local.answer(&sent(), Some(1)) {
            Some(RateLimitReply::Decision(d)) => {
                assert!(!d.allowed);
                assert!(
                    (1..=20).contains(&d.retry_after_ms),
                    "a local answer of {} ms where the server says at most 20",
                    d.retry_after_ms
                );
            }
            None => {}
            other => panic!("{other:?}"),
        }
    }
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
        fresh: None,
        learn: false,
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
    each_scripted_server("rate_limit_batch_sets", async |redis: Redis| {
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
            expect_g(&g, "third", check_one()),
            expect_g(&g, "fourth", check_one()),
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
        // The first four fill the call slots; the other ten go together, in this order
        // (`join_all` polls them in order), with five different argument sets among them;
        // a key's later operations see what its earlier ones wrote, a reset included.
        type Call<'a> = std::pin::Pin<
            Box<dyn Future<Output = Result<RateLimitReply, RateLimitError>> + Send + 'a>,
        >;
        let calls: Vec<Call<'_>> = vec![
            Box::pin(apply(&redis, &g, "first", check_one())),
            Box::pin(apply(&redis, &g, "second", check_one())),
            Box::pin(apply(&redis, &g, "third", check_one())),
            Box::pin(apply(&redis, &g, "fourth", check_one())),
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
            assert_eq!(calls, 5, "four alone, then one batch of ten");
        }
        let got: Vec<RateLimitReply> = got.into_iter().map(Result::unwrap).collect();
        assert_eq!(got, expected);
        // The last check of the window was denied: 2 + 1 + 2 over a limit of 4.
        assert!(matches!(got[10], RateLimitReply::Decision(d) if !d.allowed));
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
    each_scripted_server("rate_limit_batch_dropped", async |redis: Redis| {
        if redis.is_cluster() {
            return; // no batches on a cluster
        }
        // Twice: a runtime whose callers fill the four call slots and queue a fifth
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
                    let mut calls: Vec<_> = (0..5)
                        .map(|_| Box::pin(apply(&redis, &g, "k", check_one())))
                        .collect();
                    for call in &mut calls {
                        assert!(futures_util::FutureExt::now_or_never(call).is_none());
                    }
                    let batcher = redis.batcher();
                    let state = batcher.lock();
                    assert_eq!((state.alone, state.tasks, state.queue.len()), (4, 0, 1));
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

/// A check of `cost` on an empty key, made by a plain `SET NX` (key `<name>-set`) and by the
/// script (`<name>-script`): the same decision, the same stored state and life, and the
/// memory store's decision at the pinned time `now_us`.
async fn fresh_set_matches_the_script<S: ScriptedStrategy>(
    redis: &Redis,
    strategy: &S,
    name: &str,
    cost: u32,
    now_us: u64,
) where
    Redis: AsyncRateLimitStore<S>,
{
    let op = RateLimitOp::Check {
        cost: NonZeroU32::new(cost).unwrap(),
    };
    let (set_key, script_key) = (format!("{name}-set"), format!("{name}-script"));
    let written = redis.stats().fresh_key_writes;
    let by_set = apply(redis, strategy, &set_key, op).await.unwrap();
    assert_eq!(
        redis.stats().fresh_key_writes,
        written + 1,
        "{name}: one SET"
    );
    let request = RateLimitRequest {
        key: &script_key,
        now_us: 0,
        strategy,
        op,
    };
    let operation = redis.operation(&request).unwrap();
    assert!(operation.fresh.is_none());
    let by_script = redis.alone(&operation).await.unwrap();
    assert_eq!(by_set, by_script, "{name}");
    let memory = MemoryRateLimitStore::new();
    let expected = RateLimitStore::apply(&memory, RateLimitRequest { now_us, ..request }).unwrap();
    assert_eq!(by_set, expected, "{name}");
    let stored = async |key: &str| {
        let key = redis.key(key, ":r");
        let raw: Vec<u8> = redis.query(redis::cmd("GET").arg(&key)).await.unwrap();
        let ttl: i64 = redis.query(redis::cmd("PTTL").arg(&key)).await.unwrap();
        (raw, ttl)
    };
    let ((set_raw, set_ttl), (script_raw, script_ttl)) =
        (stored(&set_key).await, stored(&script_key).await);
    assert_eq!(set_raw, script_raw, "{name}");
    // The same life, give or take the time between the writes and the reads (generous for
    // a busy machine): both expire on the server's clock.
    assert!(
        set_ttl > 0 && script_ttl > 0 && set_ttl.abs_diff(script_ttl) < 10_000,
        "{name}: {set_ttl} ms, {script_ttl} ms"
    );
}

#[tokio::test]
async fn a_fresh_keys_first_check_is_one_set_that_writes_what_the_script_would() {
    each_server("rate_limit_fresh_set", async |redis: Redis| {
        let minute = Duration::from_secs(60);
        let window = FixedWindow::new(4, minute).unwrap();
        let sliding = SlidingWindow::new(4, minute).unwrap();
        let bucket = TokenBucket::new(5, 2, Duration::from_secs(3)).unwrap();
        let shaper = LeakyBucket::new(7, Duration::from_secs(2), Duration::from_secs(1)).unwrap();
        let slow = Gcra::new(3, Duration::from_secs(7)).unwrap();
        let tiered = Tiered::new(gcra(), window);
        let sliding_tiers = Tiered::new(sliding, bucket);
        // Inside a window, on a window's first and last microsecond, and at a time that
        // splits an emission interval unevenly.
        for (t, now_us) in [
            1_000_000_250,
            1_800_000_000_000,
            1_800_000_000_001,
            1_799_999_999_999,
            1_700_000_123_457,
        ]
        .into_iter()
        .enumerate()
        {
            redis.pin_time_us(now_us);
            for cost in [1, 2] {
                let at = |name: &str| format!("{name}-{t}-{cost}");
                fresh_set_matches_the_script(&redis, &gcra(), &at("g"), cost, now_us).await;
                fresh_set_matches_the_script(&redis, &slow, &at("slow"), cost, now_us).await;
                fresh_set_matches_the_script(&redis, &window, &at("f"), cost, now_us).await;
                fresh_set_matches_the_script(&redis, &sliding, &at("s"), cost, now_us).await;
                fresh_set_matches_the_script(&redis, &bucket, &at("t"), cost, now_us).await;
                fresh_set_matches_the_script(&redis, &shaper, &at("l"), cost, now_us).await;
                fresh_set_matches_the_script(&redis, &tiered, &at("gf"), cost, now_us).await;
                fresh_set_matches_the_script(&redis, &sliding_tiers, &at("st"), cost, now_us).await;
            }
        }
        assert_eq!(redis.stats().fresh_key_misses, 0);
    })
    .await;
}

#[tokio::test]
async fn concurrent_first_checks_of_one_key_split_between_set_and_script_decide_exactly() {
    // 250 checks of one fresh key at once: none knows the key, so each tries a SET NX; one
    // writes it, the others find it taken and go to the script, on a cluster each alone.
    let bound = |b: RedisBuilder| b.with_command_timeout(Duration::from_secs(2));
    each_server_with("rate_limit_fresh_burst", bound, async |redis: Redis| {
        redis.pin_time(1_000_000);
        let limit = FixedWindow::new(100, Duration::from_secs(60)).unwrap();
        let calls = (0..250).map(|_| apply(&redis, &limit, "burst", check_one()));
        let replies = futures_util::future::join_all(calls).await;
        let mut remaining = Vec::new();
        for reply in replies {
            match reply.unwrap() {
                RateLimitReply::Decision(d) if d.allowed => remaining.push(d.remaining),
                RateLimitReply::Decision(d) => assert_eq!(d.remaining, 0),
                other => panic!("{other:?}"),
            }
        }
        // Exactly the limit, each admission seeing the ones before it, the SET's included.
        remaining.sort_unstable();
        assert_eq!(remaining, (0..100).collect::<Vec<u64>>());
        let stats = redis.stats();
        assert_eq!(stats.fresh_key_writes, 1, "{stats:?}");
        assert!(stats.fresh_key_misses >= 1, "{stats:?}");
    })
    .await;
}

#[tokio::test]
async fn a_key_that_holds_anything_is_decided_by_the_script_and_then_known() {
    each_server("rate_limit_fresh_taken", async |redis: Redis| {
        let window = FixedWindow::new(3, Duration::from_secs(3_600)).unwrap();
        let counts = || {
            let stats = redis.stats();
            (stats.fresh_key_writes, stats.fresh_key_misses)
        };
        let remaining = async |key: &str| match apply(&redis, &window, key, check_one()).await {
            Ok(RateLimitReply::Decision(d)) => d.remaining,
            other => panic!("{other:?}"),
        };
        let (w, m) = counts();
        assert_eq!(remaining("k").await, 2);
        assert_eq!(counts(), (w + 1, m), "a SET wrote the fresh key");
        assert_eq!(remaining("k").await, 1);
        assert_eq!(
            counts(),
            (w + 1, m + 1),
            "the SET found it taken; the script decided"
        );
        assert_eq!(remaining("k").await, 0);
        assert_eq!(
            counts(),
            (w + 1, m + 1),
            "known now: straight to the script"
        );
        // A value of another type is left as it is, and the check is a store error.
        let hashed = redis.key("hashed", ":r");
        redis
            .query::<()>(redis::cmd("HSET").arg(&hashed).arg("f").arg("v"))
            .await
            .unwrap();
        let err = apply(&redis, &window, "hashed", check_one())
            .await
            .unwrap_err();
        assert!(err.is_store(), "{err:?}");
        let kind: String = redis.query(redis::cmd("TYPE").arg(&hashed)).await.unwrap();
        assert_eq!(kind, "hash");
        assert_eq!(counts(), (w + 1, m + 2));
        // A reset empties the key and forgets it: its next check is a SET again.
        apply(&redis, &window, "k", RateLimitOp::Reset)
            .await
            .unwrap();
        assert_eq!(remaining("k").await, 2);
        assert_eq!(counts(), (w + 2, m + 2));
    })
    .await;
}

#[tokio::test]
async fn with_fresh_key_writes_off_every_check_is_a_script_call() {
    each_scripted_server("rate_limit_fresh_off", async |redis: Redis| {
        let window = FixedWindow::new(3, Duration::from_secs(3_600)).unwrap();
        for key in ["a", "b", "a"] {
            apply(&redis, &window, key, check_one()).await.unwrap();
        }
        let stats = redis.stats();
        assert_eq!((stats.fresh_key_writes, stats.fresh_key_misses), (0, 0));
    })
    .await;
}

#[tokio::test]
async fn tries_pause_while_most_find_their_key_taken_and_resume_when_they_write() {
    let guess = Guess::new();
    let fresh = Fresh {
        value: Vec::new(),
        px: 1,
        reply: RateLimitReply::Reset,
    };
    let taken = redis::Value::Nil;
    let wrote = redis::Value::Okay;
    assert!(guess.worth_trying("a"));
    // A miss for each hit still climbs (+2 - 1 a round): paused from 64.
    for _ in 0..63 {
        assert_eq!(guess.outcome(&fresh, &taken).unwrap(), None);
        assert!(guess.worth_trying("a"));
        assert_eq!(
            guess.outcome(&fresh, &wrote).unwrap(),
            Some(RateLimitReply::Reset)
        );
    }
    assert_eq!(guess.outcome(&fresh, &taken).unwrap(), None);
    // Paused: one check in PROBE_EVERY tries.
    let tried = (0..10 * PROBE_EVERY)
        .filter(|_| guess.worth_trying("a"))
        .count();
    assert_eq!(tried, 10);
    // However many misses came, a few probes that write bring it back.
    for _ in 0..1_000 {
        guess.outcome(&fresh, &taken).unwrap();
    }
    for _ in 0..5 {
        let tried = (0..PROBE_EVERY).filter(|_| guess.worth_trying("a")).count();
        assert_eq!(tried, 1);
        guess.outcome(&fresh, &wrote).unwrap();
    }
    assert!((0..100).all(|_| guess.worth_trying("a")));
    // A key seen holding a state is not tried until it is forgotten (a reset).
    guess.seen("k", Duration::from_secs(60));
    assert!(!guess.worth_trying("k"));
    guess.forget("k");
    assert!(guess.worth_trying("k"));
    // Any other reply to the SET is a protocol error, not a decision.
    let err = guess.outcome(&fresh, &redis::Value::Int(1)).unwrap_err();
    assert!(matches!(err, StoreError::Protocol(_)), "{err:?}");
}

#[test]
fn only_checks_that_a_fresh_key_can_take_are_written_plainly() {
    let args = |op, kinds: &str, numbers: Vec<u64>| Args {
        op,
        cost: 1,
        slack: 1,
        kinds: kinds.to_owned(),
        numbers,
        channel: String::new(),
    };
    let window = vec![4, 60_000_000, 0, 0];
    assert!(fresh::check(&args("c", "f", window.clone()), 1_000_000).is_some());
    // Peeks, forecasts, reservations and resets go to the script.
    for op in ["p", "f", "r", "x"] {
        assert!(fresh::check(&args(op, "f", window.clone()), 1_000_000).is_none());
    }
    // Parameters that would divide by zero, or that no fresh key can take, and a malformed
    // set, are the script's to decide (or refuse).
    assert!(fresh::check(&args("c", "f", vec![4, 0, 0, 0]), 1_000_000).is_none());
    assert!(fresh::check(&args("c", "g", vec![1, 1_000_000, 0, 0]), 1_000_000).is_none());
    assert!(fresh::check(&args("c", "t", vec![1, 1, 1, 0]), 1_000_000).is_none());
    assert!(fresh::check(&args("c", "g", vec![1, 1_000_000, 1, 0]), 1_000_000).is_none());
    assert!(fresh::check(&args("c", "ff", window), 1_000_000).is_none());
}
