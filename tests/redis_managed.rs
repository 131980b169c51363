//! Redis as a managed service runs it (issue 33 items 3 and 4): ACL users
//! with a right and a wrong password, and a primary with a replica behind
//! three Sentinels, reached through a `redis+sentinel://` URL and followed
//! across a failover when the primary is killed mid-flood.
#![cfg(feature = "redis")]

mod support;

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::managed::{DOWN_AFTER, SentinelSetup, plain_node};
use support::{Oops, Runs};
use throttlebeam::rate_limit::{Gcra, Limiter, RateLimitError};
use throttlebeam::store::{Redis, StoreError};
use throttlebeam::{Error, IdempotencyOutcome, Runtime};

const HOUR: Duration = Duration::from_secs(3600);

/// A refusal must come well within this, however busy the machine.
const REFUSED_WITHIN: Duration = Duration::from_secs(5);

fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_user_connects_with_its_password_and_is_refused_with_another() {
    let Some((node, _dir)) = plain_node("an_acl_user_connects_with_its_password") else {
        return;
    };
    let port = node.port;
    // `app` may do everything; `reader` may not run scripts.
    for user in [
        &[
            "ACL",
            "SETUSER",
            "app",
            "on",
            ">p@ss:w/rd",
            "~*",
            "&*",
            "+@all",
        ][..],
        &[
            "ACL", "SETUSER", "reader", "on", ">r", "~*", "+ping", "+get", "+time", "+hello",
            "+client",
        ][..],
    ] {
        assert_eq!(node.cli(user).as_deref(), Some("OK"));
    }

    // In the URL (percent-encoded), and as builder options.
    let in_url = format!("redis://app:p%40ss%3Aw%2Frd@127.0.0.1:{port}");
    let redis = Redis::builder(in_url).connect().await.expect("connects");
    redis.ping().await.unwrap();
    let redis = Redis::builder(format!("redis://127.0.0.1:{port}"))
        .with_username("app")
        .with_password("p@ss:w/rd")
        .connect()
        .await
        .expect("connects");
    let rt = Runtime::builder()
        .with_redis(redis)
        .start()
        .await
        .expect("starts");
    let runs = Runs::default();
    let counted = {
        let runs = runs.clone();
        move || {
            runs.hit();
            std::future::ready(Ok::<_, Oops>(7_u64))
        }
    };
    let fresh = rt.idempotency().run("acl:1", counted).await.unwrap();
    assert_eq!(fresh, IdempotencyOutcome::Fresh(7));

    // A wrong password, an unknown user: a typed error, at once.
    for url in [
        format!("redis://app:wrong@127.0.0.1:{port}"),
        format!("redis://nobody:p%40ss%3Aw%2Frd@127.0.0.1:{port}"),
    ] {
        let started = Instant::now();
        let e = Redis::builder(url.clone()).connect().await.unwrap_err();
        assert!(matches!(e, StoreError::Auth(_)), "{url}: {}", chain(&e));
        assert!(started.elapsed() < REFUSED_WITHIN, "{url}: hung");
        assert!(!format!("{e:?}").contains("wrong"), "the password leaked");
    }
    // A URL that does not parse names itself without its password.
    let e = Redis::builder(format!("redis+sentinel://app:secret@127.0.0.1:{port}"))
        .connect()
        .await
        .unwrap_err();
    assert!(
        matches!(&e, StoreError::Config(m) if m.contains("names no master") && !m.contains("secret")),
        "{e}"
    );

    // A user the ACL forbids scripts: the store refuses, and says why.
    let reader = Redis::builder(format!("redis://reader:r@127.0.0.1:{port}"))
        .connect()
        .await
        .expect("connects");
    let limiter = Limiter::builder(Gcra::per_second(NonZeroU32::new(10).unwrap()))
        .with_store(reader)
        .build();
    match limiter.check_async("acl:limited").await {
        Err(RateLimitError::Store { source, .. }) => match source.downcast_ref::<StoreError>() {
            Some(StoreError::Auth(cause)) => {
                assert!(
                    chain(&**cause).contains("no permissions"),
                    "{}",
                    chain(&**cause)
                );
            }
            other => panic!("expected an Auth store error: {other:?}"),
        },
        other => panic!("expected an Auth store error: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_that_needs_a_password_is_found_through_sentinel() {
    let test = "a_primary_that_needs_a_password_is_found_through_sentinel";
    let Some(setup) = SentinelSetup::start_with_password(test, "s3cret") else {
        return;
    };
    // The URL's password is the data nodes' (these Sentinels need none).
    let redis = Redis::builder(setup.url())
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connects: {}", chain(&e)));
    redis.ping().await.unwrap();
    let limiter = Limiter::builder(Gcra::per_minute(NonZeroU32::new(1).unwrap()))
        .with_store(redis)
        .build();
    assert!(limiter.check_async("k").await.unwrap().allowed);
    assert!(!limiter.check_async("k").await.unwrap().allowed);

    // The same as builder options, and a wrong one: a typed error, at once.
    let plain = setup.url().replace(":s3cret@", "");
    let redis = Redis::builder(plain.clone())
        .with_password("s3cret")
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connects: {}", chain(&e)));
    redis.ping().await.unwrap();
    let started = Instant::now();
    let e = Redis::builder(plain)
        .with_password("wrong")
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::Auth(_)), "{}", chain(&e));
    assert!(started.elapsed() < REFUSED_WITHIN, "hung");
}

/// Per-key runs of an idempotent function, shared by the flood's tasks.
#[derive(Clone, Default)]
struct RunsByKey(Arc<Mutex<HashMap<String, u32>>>);

impl RunsByKey {
    fn hit(&self, key: &str) {
        *self.0.lock().unwrap().entry(key.to_owned()).or_default() += 1;
    }

    fn twice(&self) -> usize {
        self.0.lock().unwrap().values().filter(|n| **n > 1).count()
    }
}

/// What one flood task saw.
#[derive(Default)]
struct Seen {
    /// (when, whether the idempotent call succeeded) per call.
    runs: Vec<(Instant, bool)>,
    /// Keys whose call succeeded.
    done: Vec<String>,
    /// The longest a rate-limit check and a throttle call took.
    slowest_check: Duration,
    slowest_throttle: Duration,
    slowest_run: Duration,
    /// Rate-limit checks that failed (store unreachable: the fail policy decides).
    check_errors: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_behind_sentinel_is_followed_across_a_kill_mid_flood() {
    let test = "a_primary_behind_sentinel_is_followed_across_a_kill";
    let Some(mut setup) = SentinelSetup::start(test) else {
        return;
    };
    let command_timeout = Duration::from_millis(500);
    let redis = Redis::builder(setup.url())
        .with_command_timeout(command_timeout)
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connects through Sentinel: {}", chain(&e)));
    assert!(!redis.is_cluster());
    let start = || async {
        Runtime::builder()
            .with_redis(redis.clone())
            .start()
            .await
            .expect("starts")
    };
    let (rt, other) = (start().await, start().await);

    // Everything works through the Sentinel URL: a throttle shared by two
    // instances, a rate limit, idempotency.
    let ok = || async { Ok::<_, Oops>(()) };
    assert!(
        rt.throttle()
            .call("s:t", HOUR, ok)
            .await
            .unwrap()
            .is_executed()
    );
    assert!(
        other
            .throttle()
            .call("s:t", HOUR, ok)
            .await
            .unwrap()
            .is_throttled()
    );
    assert_eq!(other.stats().throttle.throttled_remotely, 1);
    let limiter = Limiter::builder(Gcra::per_minute(NonZeroU32::new(3).unwrap()))
        .with_store(redis.clone())
        .with_namespace("s")
        .build();
    for allowed in [true, true, true, false] {
        assert_eq!(limiter.check_async("hot").await.unwrap().allowed, allowed);
    }
    let runs = RunsByKey::default();
    let run = |key: &str| {
        let (runs, key) = (runs.clone(), key.to_owned());
        move || {
            runs.hit(&key);
            std::future::ready(Ok::<_, Oops>(1_u64))
        }
    };
    assert_eq!(
        rt.idempotency().run("s:1", run("s:1")).await.unwrap(),
        IdempotencyOutcome::Fresh(1)
    );
    assert_eq!(
        other.idempotency().run("s:1", run("s:1")).await.unwrap(),
        IdempotencyOutcome::Replay(1)
    );

    // A flood: tasks each run fresh idempotency keys, check a rate limit and
    // call a throttle, in turn, until stopped.
    let stop = Arc::new(AtomicBool::new(false));
    let flood_limiter = Limiter::builder(Gcra::per_second(NonZeroU32::new(1_000_000).unwrap()))
        .with_store(redis.clone())
        .with_namespace("flood")
        .build();
    let mut tasks = Vec::new();
    for w in 0..8 {
        let (rt, limiter, stop, runs) = (
            if w % 2 == 0 {
                rt.clone()
            } else {
                other.clone()
            },
            flood_limiter.clone(),
            Arc::clone(&stop),
            runs.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut seen = Seen::default();
            let mut i = 0_u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let key = format!("f:{w}:{i}");
                let began = Instant::now();
                let runs = runs.clone();
                let k = key.clone();
                let outcome = rt
                    .idempotency()
                    .run(&key, move || {
                        runs.hit(&k);
                        std::future::ready(Ok::<_, Oops>(i))
                    })
                    .await;
                let took = began.elapsed();
                seen.slowest_run = seen.slowest_run.max(took);
                match outcome {
                    Ok(_) => {
                        seen.done.push(key.clone());
                        seen.runs.push((Instant::now(), true));
                    }
                    Err(Error::StoreUnavailable { .. }) => seen.runs.push((Instant::now(), false)),
                    Err(e) => panic!("{key}: {e:?}"),
                }
                let began = Instant::now();
                if limiter.check_async(&key).await.is_err() {
                    seen.check_errors += 1;
                }
                seen.slowest_check = seen.slowest_check.max(began.elapsed());
                let began = Instant::now();
                let throttle = rt.throttle();
                let throttled = throttle.call(&key, HOUR, || async { Ok::<_, Oops>(()) });
                assert!(
                    throttled.await.expect("throttles fail open").is_executed(),
                    "{key}: a fresh key runs"
                );
                seen.slowest_throttle = seen.slowest_throttle.max(began.elapsed());
                if !outcome_ok_recently(&seen) {
                    // While the store is down, calls fail fast: do not spin.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            seen
        }));
    }

    tokio::time::sleep(Duration::from_secs(1)).await;
    let old_primary = setup.primary.port;
    let killed = Instant::now();
    setup.primary.kill();

    // Until the Sentinels promote the replica and the backend follows.
    let bound = Duration::from_secs(30);
    let moved = loop {
        if redis.stats().failovers >= 1 {
            break killed.elapsed();
        }
        assert!(
            killed.elapsed() < bound,
            "the backend did not follow a new primary within {bound:?} (the Sentinels name port {:?})",
            setup.named_primary()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Keep flooding a while on the new primary.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let mut seen = Vec::new();
    for task in tasks {
        seen.push(task.await.expect("a flood task panicked"));
    }
    let new_primary = setup.named_primary();
    assert_eq!(
        new_primary,
        Some(setup.replica.port),
        "the replica was promoted"
    );
    assert_ne!(new_primary, Some(old_primary));

    // When idempotent calls succeeded again after the kill: the first
    // success after which none failed.
    let mut events: Vec<(Instant, bool)> =
        seen.iter().flat_map(|s| s.runs.iter().copied()).collect();
    events.sort_by_key(|(at, _)| *at);
    let last_failure = events.iter().rev().find(|(_, ok)| !ok).map(|(at, _)| *at);
    let recovered = events
        .iter()
        .find(|(at, ok)| *ok && *at > killed && last_failure.is_none_or(|f| *at > f))
        .map(|(at, _)| at.duration_since(killed))
        .expect("idempotent calls succeed again");
    let failed = events.iter().filter(|(_, ok)| !ok).count();
    let slowest_check = seen.iter().map(|s| s.slowest_check).max().unwrap();
    let slowest_throttle = seen.iter().map(|s| s.slowest_throttle).max().unwrap();
    let slowest_run = seen.iter().map(|s| s.slowest_run).max().unwrap();
    let check_errors: u64 = seen.iter().map(|s| s.check_errors).sum();

    // Every key that succeeded, asked again: replayed, unless its record
    // died with the old primary before it was replicated (then it runs twice).
    let done: Vec<String> = seen.into_iter().flat_map(|s| s.done).collect();
    for key in &done {
        let (runs, k) = (runs.clone(), key.clone());
        rt.idempotency()
            .run(key, move || {
                runs.hit(&k);
                std::future::ready(Ok::<_, Oops>(0_u64))
            })
            .await
            .map(drop)
            .unwrap_or_else(|e| panic!("{key} after the failover: {e:?}"));
    }
    let twice = runs.twice();
    println!(
        "sentinel failover: primary killed (SIGKILL) mid-flood, down-after {} ms; \
         backend followed the new primary after {moved:?}; idempotent calls succeed again \
         after {recovered:?}; {failed} calls refused meanwhile (fail closed), {check_errors} \
         rate-limit checks failed (fail policy); slowest rate-limit check {slowest_check:?}, \
         throttle call {slowest_throttle:?}, idempotent call {slowest_run:?}; {} keys \
         completed, {twice} of them ran twice",
        DOWN_AFTER.as_millis(),
        done.len()
    );
    assert!(recovered < bound, "recovered after {recovered:?}");
    // Nothing hangs: one store command each, bounded by the command timeout
    // (plus a busy machine's scheduling).
    let slack = Duration::from_millis(1500);
    assert!(
        slowest_check <= command_timeout + slack,
        "{slowest_check:?}"
    );
    assert!(
        slowest_throttle <= command_timeout + slack,
        "{slowest_throttle:?}"
    );
    assert!(!done.is_empty());
}

/// Whether the task's last idempotent call succeeded.
fn outcome_ok_recently(seen: &Seen) -> bool {
    seen.runs.last().is_some_and(|(_, ok)| *ok)
}

/// `SENTINEL FAILOVER`: the old primary stays up and answers (as a primary
/// until Sentinel demotes it, up to 10 s later, then `READONLY`), so no
/// command fails to tell the backend: its once-a-second lookup finds the new
/// primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manual_sentinel_failover_is_followed() {
    let Some(setup) = SentinelSetup::start("a_manual_sentinel_failover_is_followed") else {
        return;
    };
    let redis = Redis::builder(setup.url())
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connects through Sentinel: {}", chain(&e)));
    let limiter = Limiter::builder(Gcra::per_second(NonZeroU32::new(1_000_000).unwrap()))
        .with_store(redis.clone())
        .build();
    assert!(limiter.check_async("m:0").await.unwrap().allowed);
    let old = setup.primary.port;
    assert_eq!(
        setup.sentinels[0]
            .cli(&["SENTINEL", "FAILOVER", support::managed::MASTER])
            .as_deref(),
        Some("OK")
    );
    let began = Instant::now();
    let bound = Duration::from_secs(30);
    let mut failed = 0_u64;
    let mut i = 0_u64;
    let followed = loop {
        i += 1;
        let checked = limiter.check_async(&format!("m:{i}")).await;
        if redis.stats().failovers >= 1 && checked.is_ok() {
            break began.elapsed();
        }
        if checked.is_err() {
            failed += 1;
        }
        assert!(
            began.elapsed() < bound,
            "not followed within {bound:?}: the Sentinels name port {:?}, {failed} checks failed",
            setup.named_primary()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert_eq!(setup.named_primary(), Some(setup.replica.port));
    assert_ne!(setup.named_primary(), Some(old));
    // The old primary, now a replica, is not written to any more.
    for n in 0..50 {
        assert!(
            limiter
                .check_async(&format!("after:{n}"))
                .await
                .unwrap()
                .allowed
        );
    }
    println!(
        "manual sentinel failover: followed after {followed:?}, {failed} rate-limit checks \
         failed meanwhile"
    );
    // Within the lookup's period, not Sentinel's 10 s demotion (a busy
    // machine's delays on top).
    assert!(followed < Duration::from_secs(8), "{followed:?}");
}

/// The pub/sub clients of `server` other than the Sentinels' own (`name=sentinel-…`).
fn our_subscribers(server: &support::managed::Server) -> usize {
    server
        .cli(&["CLIENT", "LIST", "TYPE", "pubsub"])
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.contains("name=sentinel"))
        .count()
}

/// Issue 50, item 2: the broadcast listener follows the primary across a Sentinel failover
/// (before, it stayed on the old primary for the life of its connection). After
/// `SENTINEL FAILOVER`, within a `PING` period of the backend following the new primary,
/// the listener is subscribed there, and a reset on another instance re-admits a key this
/// instance answered locally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pubsub_listener_follows_the_primary_across_a_sentinel_failover() {
    use throttlebeam::rate_limit::FixedWindow;

    let Some(setup) = SentinelSetup::start("the_pubsub_listener_follows_the_primary") else {
        return;
    };
    let a = Redis::builder(setup.url())
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connects through Sentinel: {}", chain(&e)));
    let limit = || FixedWindow::new(1, Duration::from_secs(3_600)).unwrap();
    let on_a = Limiter::builder(limit())
        .with_store(a.clone())
        .with_namespace("follow")
        .build();
    assert!(on_a.check_async("k").await.unwrap().allowed);
    let deadline = Instant::now() + Duration::from_secs(20);
    while a.stats().subscriptions < 1 {
        assert!(Instant::now() < deadline, "subscribed: {:?}", a.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(our_subscribers(&setup.primary), 1, "on the primary");
    assert_eq!(our_subscribers(&setup.replica), 0);

    assert_eq!(
        setup.sentinels[0]
            .cli(&["SENTINEL", "FAILOVER", support::managed::MASTER])
            .as_deref(),
        Some("OK")
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while a.stats().failovers < 1 {
        assert!(
            Instant::now() < deadline,
            "the backend followed: {:?}",
            a.stats()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let followed = Instant::now();
    while our_subscribers(&setup.replica) < 1 || a.stats().subscriptions < 2 {
        assert!(
            followed.elapsed() < Duration::from_secs(10),
            "the listener moved to the new primary: {:?}",
            a.stats()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let took = followed.elapsed();
    println!("pub/sub listener on the new primary {took:?} after the backend followed it");
    // A PING period (1 s), a reconnection's pause and the subscription, on a busy machine.
    assert!(took < Duration::from_secs(4), "{took:?}");

    // Denied and answered locally under the new subscription; a reset elsewhere re-admits.
    let b = Redis::builder(setup.url())
        .connect()
        .await
        .expect("B connects");
    let on_b = Limiter::builder(limit())
        .with_store(b)
        .with_namespace("follow")
        .build();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(!on_a.check_async("k").await.unwrap().allowed);
        let local = a.stats().local_answers;
        assert!(!on_a.check_async("k").await.unwrap().allowed);
        if a.stats().local_answers > local {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "answered locally: {:?}",
            a.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    on_b.reset_async("k").await.unwrap();
    while !on_a.check_async("k").await.unwrap().allowed {
        assert!(
            Instant::now() < deadline,
            "the reset reached A: {:?}",
            a.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
