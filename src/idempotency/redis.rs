//! The idempotency claim protocol on Redis: claim, complete, release and
//! renew, one script call each, compare-and-set on the owner's token.
//!
//! A key's record is one hash at `{prefix:key}:i`:
//!
//! | field | meaning |
//! |---|---|
//! | `s` | `f` in flight, `c` completed |
//! | `t` | the owner's token (unique across processes) |
//! | `n` | the fencing counter of the claim |
//! | `fp` | the fingerprint digest (empty: none) |
//! | `v`, `ty` | the encoded result and its type tag (completed only) |
//!
//! In flight, the record expires with the lease (the owner renews it while
//! its function runs, so only an owner that is gone lets it lapse);
//! completed, with the result's TTL. The fencing counter lives beside it at
//! `{prefix:key}:in` with the token of the claim that took it
//! (`<fence>:<token>`, kept for the result's TTL) and only ever grows, so a
//! claim's counter orders it after every earlier claim of the key; a
//! completion that finds the record gone stores only if that last claim is
//! its own (an owner paused past its lease, whose key was taken over and
//! released since, is fenced off). Completion and release publish the
//! key on one channel per prefix (on a cluster, on the key's own shard
//! channel), so waiters elsewhere wake at once (see "Waiters" below).
//!
//! A claim's fence is the larger of the last one plus one and the server's
//! `TIME` in microseconds. A plain `INCR` would go backwards across a
//! failover: replication is asynchronous, so a replica promoted after its
//! primary died can lack the last increments, and hand out a fence already
//! issued. The server's clock does not go back that way: every fence the dead
//! primary issued is at most its clock (fences run ahead of the clock only
//! for claims of one key less than a microsecond apart), and the promoted
//! replica reads its own clock at least a failure-detection time later
//! (`cluster-node-timeout`, or Sentinel's `down-after-milliseconds`), so its
//! fences are larger unless the two hosts' clocks disagree by more than that.
//!
//! With durable claims (`RedisBuilder::with_durable_claims`, see `durable.rs`),
//! a claim that won and a completion that stored are acknowledged only once
//! replicated, so a replica promoted after a failover holds every claim that
//! was acknowledged, and its fence counter with it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use dashmap::DashMap;
use redis::Value;
use tokio::sync::Notify;

use crate::store::StoreError;
use crate::store::redis::script::LuaScript;
use crate::store::redis::{Redis, Subscriber, Subscription, cached, int, ms};
use crate::{
    idempotency::ClaimReply, idempotency::ClaimRequest, idempotency::ClaimToken,
    idempotency::IdempotencyStore, idempotency::IdempotencyStoreFuture, idempotency::KeyChanged,
    idempotency::StoredResult,
};

const CLAIM: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 'fp', 'v', 'ty', 't', 'n')
if rec[1] then
  -- The same claim sent again (its reply was lost; a cluster client re-sends after an I/O
  -- error): still this claimant's, with its lease from now.
  if rec[1] == 'f' and rec[5] == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return {'won', rec[6]}
  end
  if (rec[2] or '') ~= ARGV[2] then return {'mismatch'} end
  if rec[1] == 'c' then
    -- Durable claims: a write of this call's own (the record's expiry, unchanged), so that
    -- the `WAIT` after it covers the completion before it in the replication stream, written
    -- by another client: a result is replayed only once the replicas have it.
    if ARGV[5] == '1' then
      local left = redis.call('PTTL', KEYS[1])
      if left > 0 then redis.call('PEXPIRE', KEYS[1], left) end
    end
    return {'replay', rec[3] or '', rec[4] or ''}
  end
  return {'busy', redis.call('PTTL', KEYS[1])}
end
-- Monotonic across a failover (see the module docs): never below the server's clock in µs.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
-- The last claim, `<fence>:<token>` (a build before 0.3 wrote the fence alone).
local last = redis.call('GET', KEYS[2]) or '0'
local n = #last
if n > 17 and string.sub(last, n - 16, n - 16) == ':' then last = string.sub(last, 1, n - 17) end
local fence = math.max((tonumber(last) or 0) + 1, now)
-- Written as digits: Lua would print a number this large as 1.7e+15.
local digits = string.format('%.0f', fence)
redis.call('SET', KEYS[2], digits .. ':' .. ARGV[1], 'PX', ARGV[4])
redis.call('HSET', KEYS[1], 's', 'f', 't', ARGV[1], 'n', digits, 'fp', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {'won', fence}
";

const COMPLETE: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 't', 'v')
if rec[1] == 'c' then
  -- The same completion retried after its reply was lost: stored. Written again (its TTL),
  -- so that a `WAIT` after it, on any connection, covers the first write too.
  if rec[2] == ARGV[1] and rec[3] == ARGV[3] then
    redis.call('PEXPIRE', KEYS[1], ARGV[5])
    return 1
  end
  return 0
end
if rec[1] == 'f' and rec[2] ~= ARGV[1] then return 0 end
if not rec[1] then
  -- The record is gone (the claim lapsed, or was released): the result is still the only one
  -- unless the key was claimed since this owner's claim (fenced: its late result is refused).
  local last = redis.call('GET', KEYS[2])
  if last then
    local n = #last
    if n <= 17 or string.sub(last, n - 16, n - 16) ~= ':' or string.sub(last, n - 15) ~= ARGV[1] then
      return 0
    end
  end
end
redis.call('HSET', KEYS[1], 's', 'c', 't', ARGV[1], 'fp', ARGV[2], 'v', ARGV[3], 'ty', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
-- PUBLISH, or SPUBLISH on a cluster (the channel shares the key's slot). Never an error after
-- the write (Redis does not undo a script's writes): a notice refused (a user without channel
-- rights) is answered 2, and waiters poll.
local sent = redis.pcall(ARGV[8], ARGV[6], ARGV[7])
if type(sent) == 'table' and sent.err then return 2 end
return 1
";

const RELEASE: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] ~= 'f' or rec[2] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
local sent = redis.pcall(ARGV[4], ARGV[2], ARGV[3])
if type(sent) == 'table' and sent.err then return 2 end
return 1
";

const RENEW: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] ~= 'f' or rec[2] ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
";

const READ: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 'fp', 'v', 'ty')
if not rec[1] then return {'none'} end
if rec[1] == 'c' then return {'c', rec[2] or '', rec[3] or '', rec[4] or ''} end
return {'f', rec[2] or '', redis.call('PTTL', KEYS[1])}
";

/// What a read found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RecordReply {
    /// Nothing stored.
    Missing,
    /// In flight under `fingerprint` for this long still.
    InFlight {
        fingerprint: Vec<u8>,
        left: Duration,
    },
    /// Completed.
    Completed {
        fingerprint: Vec<u8>,
        value: Vec<u8>,
        type_tag: String,
    },
}

fn bytes(v: Option<&Value>) -> Vec<u8> {
    match v {
        Some(Value::BulkString(b)) => b.clone(),
        Some(Value::SimpleString(s)) => s.clone().into_bytes(),
        _ => Vec::new(),
    }
}

fn left(v: Option<&Value>) -> Result<Duration, StoreError> {
    Ok(Duration::from_millis(int(v)?.max(0).unsigned_abs()))
}

impl Redis {
    /// The broadcast channel completions and releases are announced on
    /// (a single node, Sentinel): the key is the message.
    pub(crate) fn claims_channel(&self) -> String {
        format!("{}:idempotency", self.prefix())
    }

    /// The shard channel announcing changes of `key`'s record on a
    /// cluster: its hash tag is the key's, so it lives in the key's slot.
    pub(crate) fn done_channel(&self, key: &str) -> String {
        self.key(key, ":done")
    }

    /// Where a change of `key`'s record is announced, and how: on a
    /// cluster, `SPUBLISH` on the key's own shard channel (same hash tag,
    /// same slot, so only the slot's owner and its subscribers carry it);
    /// elsewhere `PUBLISH` on the prefix's claims channel.
    fn notice(&self, key: &str) -> (String, &'static str) {
        if self.is_cluster() {
            (self.done_channel(key), "SPUBLISH")
        } else {
            (self.claims_channel(), "PUBLISH")
        }
    }

    pub(crate) async fn claim_key(
        &self,
        key: &str,
        request: ClaimRequest<'_>,
    ) -> Result<ClaimReply, StoreError> {
        static SCRIPT: std::sync::OnceLock<LuaScript> = std::sync::OnceLock::new();
        let mut call = cached(&SCRIPT, CLAIM, false).prepare_invoke();
        call.key(self.key(key, ":i"))
            .key(self.key(key, ":in"))
            .arg(&request.token.to_bytes()[..])
            .arg(fingerprint_arg(request.fingerprint))
            .arg(px(request.lease))
            .arg(px(request.ttl.max(request.lease)))
            .arg(if self.durable_claims() { "1" } else { "0" });
        // Durable claims: a won claim wrote its claim, and a replay touched the result (see
        // the script), so that neither is answered before the replicas have it: a failover
        // then never takes back a claim won or a result handed to a caller.
        let wrote = |reply: &Vec<Value>| matches!(&bytes(reply.first())[..], b"won" | b"replay");
        let reply: Vec<Value> = self.invoke_replicated(&call, wrote).await?;
        let kind = bytes(reply.first());
        match kind.as_slice() {
            b"won" => Ok(ClaimReply::Won {
                fence: int(reply.get(1))?.max(0).unsigned_abs(),
            }),
            b"busy" => Ok(ClaimReply::Busy {
                lease_left: left(reply.get(1))?,
            }),
            b"replay" => Ok(ClaimReply::Completed(StoredResult::new(
                request.fingerprint.copied(),
                String::from_utf8_lossy(&bytes(reply.get(2))).into_owned(),
                bytes(reply.get(1)),
            ))),
            b"mismatch" => Ok(ClaimReply::Mismatch),
            other => Err(StoreError::Protocol(format!(
                "unexpected claim reply {:?}",
                String::from_utf8_lossy(other)
            ))),
        }
    }

    pub(crate) async fn complete_key(
        &self,
        key: &str,
        token: ClaimToken,
        result: &StoredResult,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        static SCRIPT: std::sync::OnceLock<LuaScript> = std::sync::OnceLock::new();
        let mut call = cached(&SCRIPT, COMPLETE, false).prepare_invoke();
        call.key(self.key(key, ":i"))
            .key(self.key(key, ":in"))
            .arg(&token.to_bytes()[..])
            .arg(fingerprint_arg(result.fingerprint.as_ref()))
            .arg(&result.value[..])
            .arg(&result.type_tag)
            .arg(px(ttl));
        let (channel, publish) = self.notice(key);
        call.arg(channel).arg(key).arg(publish);
        // The owner's run happened: never refused by an open breaker.
        let stored = |&stored: &i64| stored >= 1;
        let answer: i64 = self.invoke_replicated_must_try(&call, stored).await?;
        self.notice_sent(answer, key);
        Ok(answer >= 1)
    }

    pub(crate) async fn release_key(
        &self,
        key: &str,
        token: ClaimToken,
    ) -> Result<bool, StoreError> {
        static SCRIPT: std::sync::OnceLock<LuaScript> = std::sync::OnceLock::new();
        let mut call = cached(&SCRIPT, RELEASE, false).prepare_invoke();
        call.key(self.key(key, ":i")).arg(&token.to_bytes()[..]);
        let (channel, publish) = self.notice(key);
        call.arg(channel).arg(key).arg(publish);
        let answer: i64 = self.invoke(&call).await?;
        self.notice_sent(answer, key);
        Ok(answer >= 1)
    }

    pub(crate) async fn renew_key(
        &self,
        key: &str,
        token: ClaimToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        static SCRIPT: std::sync::OnceLock<LuaScript> = std::sync::OnceLock::new();
        let mut call = cached(&SCRIPT, RENEW, false).prepare_invoke();
        call.key(self.key(key, ":i"))
            .arg(&token.to_bytes()[..])
            .arg(px(lease));
        // A live owner showing it is alive: never refused by an open breaker.
        Ok(self.invoke_must_try::<i64>(&call).await? == 1)
    }

    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) async fn read_record(&self, key: &str) -> Result<RecordReply, StoreError> {
        static SCRIPT: std::sync::OnceLock<LuaScript> = std::sync::OnceLock::new();
        let mut call = cached(&SCRIPT, READ, false).prepare_invoke();
        call.key(self.key(key, ":i"));
        let reply: Vec<Value> = self.invoke(&call).await?;
        match bytes(reply.first()).as_slice() {
            b"none" => Ok(RecordReply::Missing),
            b"c" => Ok(RecordReply::Completed {
                fingerprint: bytes(reply.get(1)),
                value: bytes(reply.get(2)),
                type_tag: String::from_utf8_lossy(&bytes(reply.get(3))).into_owned(),
            }),
            b"f" => Ok(RecordReply::InFlight {
                fingerprint: bytes(reply.get(1)),
                left: left(reply.get(2))?,
            }),
            other => Err(StoreError::Protocol(format!(
                "unexpected record reply {:?}",
                String::from_utf8_lossy(other)
            ))),
        }
    }
}

/// A lease or TTL as a `PEXPIRE` argument, saturated at 2^53 ms (about
/// 285,000 years): `Duration::MAX` holds "for ever" instead of being refused
/// by the server as out of range.
fn px(d: Duration) -> u64 {
    ms(d).min(1 << 53)
}

/// The fingerprint digest as stored: empty for none.
fn fingerprint_arg(fingerprint: Option<&[u8; 32]>) -> &[u8] {
    fingerprint.map_or(&[][..], |f| &f[..])
}

/// Idempotency across instances: claims and results in Redis, one script
/// call each, completions announced on one pub/sub channel per prefix.
impl IdempotencyStore for Redis {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        request: ClaimRequest<'a>,
    ) -> IdempotencyStoreFuture<'a, ClaimReply> {
        Box::pin(self.claim_key(key, request))
    }

    fn complete<'a>(
        &'a self,
        key: &'a str,
        token: ClaimToken,
        result: &'a StoredResult,
        ttl: Duration,
    ) -> IdempotencyStoreFuture<'a, bool> {
        Box::pin(self.complete_key(key, token, result, ttl))
    }

    fn release<'a>(&'a self, key: &'a str, token: ClaimToken) -> IdempotencyStoreFuture<'a, bool> {
        Box::pin(self.release_key(key, token))
    }

    fn renew<'a>(
        &'a self,
        key: &'a str,
        token: ClaimToken,
        lease: Duration,
    ) -> IdempotencyStoreFuture<'a, bool> {
        Box::pin(self.renew_key(key, token, lease))
    }

    fn watch(&self, key: &str) -> KeyChanged {
        KeyChanged::new(self.watch_key(key).into_changed())
    }

    fn name(&self) -> &'static str {
        "redis"
    }
}

// Waiters: the keys someone on this instance waits for, each with its
// wake-up, registered with the backend's pub/sub multiplexer. Every waiter
// also polls, so a lost notice costs time, never a result.

/// The idempotency waiters of one backend value (its slice, see
/// `Redis::slice`).
struct Notices {
    waiters: Arc<Waiters>,
    /// The claims channel, which announces every key's changes on a single
    /// node or behind Sentinel (a cluster also listens to it, as older
    /// instances may publish there).
    claims: Subscription,
}

/// Keys someone on this instance waits for.
#[derive(Default)]
struct Waiters {
    keys: DashMap<String, Arc<Waiting>>,
}

impl Waiters {
    fn wake_all(&self) {
        for entry in &self.keys {
            entry.value().notify.notify_waiters();
        }
    }
}

/// A message on the claims channel names the key that changed.
impl Subscriber for Waiters {
    fn message(&self, payload: &[u8]) {
        let Ok(key) = std::str::from_utf8(payload) else {
            return;
        };
        if let Some(waiting) = self.keys.get(key) {
            waiting.notify.notify_waiters();
        }
    }

    /// Each waiter looks at its key again (and registers again).
    fn missed(&self) {
        self.wake_all();
    }
}

/// One waited-on key.
struct Waiting {
    notify: Arc<Notify>,
    /// Its watches, counted under the map's lock (a reference count would
    /// also count the listener's, taken while it delivers).
    watches: AtomicUsize,
    /// On a cluster, the key's shard channel.
    shard: Option<Subscription>,
}

/// A message on the key's shard channel: the key changed.
impl Subscriber for Waiting {
    fn message(&self, _: &[u8]) {
        self.notify.notify_waiters();
    }

    fn missed(&self) {
        self.notify.notify_waiters();
    }
}

/// A registration for one key; dropping it forgets the key once nobody
/// else waits for it.
pub(crate) struct Watch {
    waiters: Arc<Waiters>,
    key: String,
    waiting: Arc<Waiting>,
}

impl Watch {
    /// The next change as a future that owns this registration; it listens
    /// from now on, before it is first polled, so a notice that lands
    /// before the wait begins still wakes it.
    pub(crate) fn into_changed(self) -> impl Future<Output = ()> + Send + 'static {
        let mut notified = Box::pin(Arc::clone(&self.waiting.notify).notified_owned());
        notified.as_mut().enable();
        async move {
            let _registered = self;
            notified.await;
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // The key's entry is this watch's while it lives: only the last
        // watch removes it.
        let removed = self.waiters.keys.remove_if(&self.key, |_, w| {
            Arc::ptr_eq(w, &self.waiting) && w.watches.fetch_sub(1, Ordering::AcqRel) == 1
        });
        // Unregistered from the multiplexer here, outside the map's lock.
        drop(removed);
    }
}

impl Redis {
    fn notices(&self) -> Arc<Notices> {
        self.slice(|| {
            let waiters = Arc::new(Waiters::default());
            let subscriber: Weak<dyn Subscriber> = Arc::downgrade(&waiters) as Weak<_>;
            let claims = self.subscribe(self.claims_channel(), subscriber);
            Notices { waiters, claims }
        })
    }

    /// Starts watching `key` for completion notices. Register before
    /// reading the record, so a notice between the read and the wait is
    /// never missed.
    pub(crate) fn watch_key(&self, key: &str) -> Watch {
        let notices = self.notices();
        // A listener whose runtime ended is started again here.
        notices.claims.listen();
        let cluster = self.is_cluster();
        let waiting = {
            let entry = notices
                .waiters
                .keys
                .entry(key.to_owned())
                .or_insert_with(|| {
                    Arc::new_cyclic(|me: &Weak<Waiting>| {
                        let subscriber: Weak<dyn Subscriber> = me.clone();
                        Waiting {
                            notify: Arc::new(Notify::new()),
                            watches: AtomicUsize::new(0),
                            shard: cluster.then(|| {
                                self.subscribe_sharded(self.done_channel(key), subscriber)
                            }),
                        }
                    })
                });
            entry.watches.fetch_add(1, Ordering::AcqRel);
            Arc::clone(&entry)
        };
        if let Some(shard) = &waiting.shard {
            shard.listen();
        }
        Watch {
            waiters: Arc::clone(&notices.waiters),
            key: key.to_owned(),
            waiting,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::store::redis::each_server;

    const LEASE: Duration = Duration::from_secs(30);
    const TTL: Duration = Duration::from_secs(3600);

    fn token(n: u8) -> ClaimToken {
        ClaimToken::from_bytes([n; 16])
    }

    fn request(n: u8, fingerprint: Option<&[u8; 32]>, lease: Duration) -> ClaimRequest<'_> {
        ClaimRequest::new(token(n), fingerprint, lease, TTL)
    }

    #[tokio::test]
    async fn one_claim_wins_then_duplicates_see_it_busy_then_replay() {
        each_server("claims_win_busy_replay", async |r: Redis| {
            let fp = [7u8; 32];
            let other = [8u8; 32];
            for key in ["pay:1", "pay:2", "pay:3"] {
                assert!(matches!(
                    r.claim(key, request(11, Some(&fp), LEASE)).await.unwrap(),
                    ClaimReply::Won { .. }
                ));
                match r.claim(key, request(12, Some(&fp), LEASE)).await.unwrap() {
                    ClaimReply::Busy { lease_left } => {
                        assert!(lease_left > Duration::from_secs(29));
                    }
                    other => panic!("{other:?}"),
                }
                assert_eq!(
                    r.claim(key, request(12, Some(&other), LEASE))
                        .await
                        .unwrap(),
                    ClaimReply::Mismatch
                );
                assert!(r.renew(key, token(11), LEASE).await.unwrap());
                assert!(
                    !r.renew(key, token(12), LEASE).await.unwrap(),
                    "not the owner"
                );
                let result = StoredResult::new(Some(fp), "u8", vec![0x2a]);
                assert!(!r.complete(key, token(12), &result, TTL).await.unwrap());
                assert!(r.complete(key, token(11), &result, TTL).await.unwrap());
                let again = StoredResult::new(Some(fp), "u8", vec![0x2b]);
                assert!(
                    !r.complete(key, token(11), &again, TTL).await.unwrap(),
                    "once"
                );
                assert_eq!(
                    r.claim(key, request(13, Some(&fp), LEASE)).await.unwrap(),
                    ClaimReply::Completed(result)
                );
                assert_eq!(
                    r.read_record(key).await.unwrap(),
                    RecordReply::Completed {
                        fingerprint: fp.to_vec(),
                        value: vec![0x2a],
                        type_tag: "u8".to_owned()
                    }
                );
            }
        })
        .await;
    }

    #[tokio::test]
    async fn a_lease_or_ttl_of_duration_max_holds_rather_than_erring() {
        each_server("claims_duration_max", async |r: Redis| {
            let key = "forever:1";
            let max = Duration::MAX;
            let won = r.claim(key, ClaimRequest::new(token(1), None, max, max));
            assert!(matches!(won.await.unwrap(), ClaimReply::Won { .. }));
            assert!(r.renew(key, token(1), max).await.unwrap());
            let result = StoredResult::new(None, "u8", vec![1]);
            assert!(r.complete(key, token(1), &result, max).await.unwrap());
            assert_eq!(
                r.claim(key, request(2, None, LEASE)).await.unwrap(),
                ClaimReply::Completed(result)
            );
        })
        .await;
    }

    #[tokio::test]
    async fn a_lapsed_lease_is_taken_over_once_and_the_old_owner_is_fenced() {
        each_server("claims_takeover_fencing", async |r: Redis| {
            let key = "order:9";
            let short = Duration::from_millis(50);
            let ClaimReply::Won { fence: first } =
                r.claim(key, request(1, None, short)).await.unwrap()
            else {
                panic!("a free key is won")
            };
            tokio::time::sleep(Duration::from_millis(80)).await;
            assert_eq!(r.read_record(key).await.unwrap(), RecordReply::Missing);
            // Two duplicates race for the lapsed key: exactly one wins.
            let (a, b) = tokio::join!(
                r.claim(key, request(2, None, LEASE)),
                r.claim(key, request(3, None, LEASE))
            );
            let wins: Vec<u64> = [a.unwrap(), b.unwrap()]
                .into_iter()
                .filter_map(|c| match c {
                    ClaimReply::Won { fence } => Some(fence),
                    _ => None,
                })
                .collect();
            assert_eq!(wins.len(), 1);
            assert!(wins[0] > first, "fences grow");
            // The old owner can neither renew, release nor complete.
            assert!(!r.renew(key, token(1), LEASE).await.unwrap());
            assert!(!r.release(key, token(1)).await.unwrap());
            let late = StoredResult::new(None, "s", b"late".to_vec());
            assert!(!r.complete(key, token(1), &late, TTL).await.unwrap());
            // The new owner releases; the next claim gets a higher fence.
            let owner = if r.renew(key, token(2), LEASE).await.unwrap() {
                2
            } else {
                3
            };
            assert!(r.release(key, token(owner)).await.unwrap());
            // Fenced for good: with the key free again, the old owner's late result is still
            // refused (a claim came after its own), so the next caller runs.
            assert!(!r.complete(key, token(1), &late, TTL).await.unwrap());
            assert_eq!(r.read_record(key).await.unwrap(), RecordReply::Missing);
            match r.claim(key, request(4, None, LEASE)).await.unwrap() {
                ClaimReply::Won { fence } => assert!(fence > wins[0], "fences grow"),
                other => panic!("{other:?}"),
            }
        })
        .await;
    }

    #[tokio::test]
    async fn a_result_whose_claim_lapsed_with_nobody_after_it_is_still_stored() {
        each_server("claims_lapsed_unclaimed", async |r: Redis| {
            let key = "order:10";
            let short = Duration::from_millis(50);
            assert!(matches!(
                r.claim(key, request(1, None, short)).await.unwrap(),
                ClaimReply::Won { .. }
            ));
            tokio::time::sleep(Duration::from_millis(80)).await;
            assert_eq!(r.read_record(key).await.unwrap(), RecordReply::Missing);
            // Nobody claimed since: the owner's result is the only one, stored.
            let result = StoredResult::new(None, "s", b"mine".to_vec());
            assert!(r.complete(key, token(1), &result, TTL).await.unwrap());
            assert_eq!(
                r.claim(key, request(2, None, LEASE)).await.unwrap(),
                ClaimReply::Completed(result)
            );
        })
        .await;
    }

    #[tokio::test]
    async fn a_fence_written_by_an_older_build_is_read_and_grows() {
        each_server("claims_old_fence", async |r: Redis| {
            let key = "order:11";
            let old = 9_000_000_000_000_000_u64;
            let _: () = r
                .query(
                    redis::cmd("SET")
                        .arg(r.key(&format!("-{key}"), ":in"))
                        .arg(old),
                )
                .await
                .unwrap();
            match r
                .claim(&format!("-{key}"), request(1, None, LEASE))
                .await
                .unwrap()
            {
                ClaimReply::Won { fence } => assert_eq!(fence, old + 1),
                other => panic!("{other:?}"),
            }
        })
        .await;
    }

    #[tokio::test]
    async fn watches_of_one_key_share_one_entry_which_the_last_one_forgets() {
        each_server("claims_watch_entries", async |r: Redis| {
            let keys = || r.notices().waiters.keys.len();
            let (first, second) = (r.watch_key("w:1"), r.watch_key("w:1"));
            assert!(Arc::ptr_eq(&first.waiting, &second.waiting));
            assert_eq!(keys(), 1);
            drop(first);
            assert_eq!(keys(), 1, "one watch left");
            // The listener holds the entry while it delivers: no watch.
            let delivering = Arc::clone(&second.waiting);
            drop(second);
            assert_eq!(keys(), 0, "the last watch forgets the key");
            drop(delivering);
        })
        .await;
    }

    #[tokio::test]
    async fn a_waiter_wakes_on_the_published_completion_not_on_polling() {
        each_server("claims_pubsub_wakeup", async |r: Redis| {
            // Two backend values: two "instances".
            let other = r.clone();
            let key = "wake:1";
            assert!(matches!(
                r.claim(key, request(1, None, LEASE)).await.unwrap(),
                ClaimReply::Won { .. }
            ));
            let changed = IdempotencyStore::watch(&other, key);
            // Let the subscription settle before completing.
            tokio::time::sleep(Duration::from_millis(200)).await;
            let started = Instant::now();
            let waiter = async {
                let _ = tokio::time::timeout(Duration::from_secs(5), changed).await;
                started.elapsed()
            };
            let completer = async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let result = StoredResult::new(None, "t", b"v".to_vec());
                r.complete(key, token(1), &result, TTL).await.unwrap()
            };
            let (woke_after, stored) = tokio::join!(waiter, completer);
            assert!(stored);
            assert!(
                woke_after < Duration::from_secs(1),
                "woke after {woke_after:?}: the notice did not arrive"
            );
        })
        .await;
    }
}
