//! The Redis side of debounce across instances: one record per key, one
//! script call per decision, and notices on one channel per prefix.
//!
//! A key's open burst is one hash at `{prefix:key}:d`:
//!
//! | field | meaning |
//! |---|---|
//! | `b` | the burst's id: the id of the call that opened it (unique across processes) |
//! | `g` | the generation: bumped by every call, so the latest call is the highest |
//! | `o` | the owner: the instance of the latest call, the one that will run |
//! | `d` | the deadline, ms on the server's clock: min(last call + delay, max deadline) |
//! | `m` | the burst's max deadline (`max_wait`), if any |
//! | `z` | the generation of a leading call that already ran (nothing to run if still latest) |
//! | `f` | a flush was asked: the owner fires now |
//! | `l` | between bursts (with `max_wait` only): when the last one fired |
//!
//! The record expires a slack after its deadline, so an owner that died
//! leaves nothing behind. Once a burst fires, its outcome lives at
//! `{prefix:key}:d:<burst>`: empty while the owner runs (a lease the owner
//! renews), then the encoded outcome for a while, so a waiter that missed
//! the notice reads it there. All keys of a script share the hash tag.
//!
//! Notices on [`Redis::debounce_channel`] are framed as
//! `<kind><burst> <key length> <key><payload>`: kind `R` (the outcome,
//! payload encoded by the caller), `C` (cancelled) or `F` (flush asked).

use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use redis::Value;

use crate::store::StoreError;
use crate::store::redis::script::LuaScript;
use crate::store::redis::{Redis, Subscriber, Subscription, cached, int, ms};

/// How long a running burst's lease lasts without renewal.
pub(crate) const RUN_LEASE: Duration = Duration::from_secs(3);
/// How long an outcome stays readable for waiters that missed its notice.
const OUTCOME_KEEP: Duration = Duration::from_secs(10);
/// How long a record outlives its deadline (an owner that never fires).
const RECORD_SLACK: Duration = Duration::from_secs(10);

const CALL: &str = r"
local now = now_ms(ARGV[7])
local rec = redis.call('HMGET', KEYS[1], 'b', 'm', 'l', 'f')
local b, m, f = rec[1], tonumber(rec[2]), rec[4]
local opened = 0
local g = redis.call('HINCRBY', KEYS[1], 'g', 1)
if not b then
  b = ARGV[2]
  opened = 1
  f = false
  m = nil
  local w = tonumber(ARGV[4])
  if w > 0 then
    local last = tonumber(rec[3])
    if last and last + w > now then m = last + w else m = now + w end
  end
  redis.call('HDEL', KEYS[1], 'l', 'f', 'm')
  local z = 0
  if ARGV[6] == '1' then z = g end
  redis.call('HSET', KEYS[1], 'b', b, 'z', z)
  if m then redis.call('HSET', KEYS[1], 'm', string.format('%.0f', m)) end
end
local d = now + tonumber(ARGV[3])
if m and m < d then d = m end
redis.call('HSET', KEYS[1], 'o', ARGV[1], 'd', string.format('%.0f', d))
redis.call('PEXPIRE', KEYS[1], math.max(d - now, 0) + tonumber(ARGV[5]))
local left = d - now
if f then left = 0 end
return {b, g, left, opened}
";

/// Fires the burst if the caller owns its latest generation and it is due
/// (or flushed), or if it is overdue by the rescue time (ARGV[8], 0: never)
/// because its owner never fired it; otherwise reports where the burst
/// stands. With an empty instance and no rescue it is a probe.
const FIRE: &str = r"
local now = now_ms(ARGV[7])
local rec = redis.call('HMGET', KEYS[1], 'b', 'g', 'o', 'd', 'f', 'z')
if rec[1] ~= ARGV[2] then
  local held = redis.call('GET', KEYS[2])
  if not held then return {'gone'} end
  if held == '' then return {'running', redis.call('PTTL', KEYS[2])} end
  return {'done', held}
end
local d = tonumber(rec[4])
local rescue = tonumber(ARGV[8])
if rec[2] ~= ARGV[3] or rec[3] ~= ARGV[1] then
  if rescue == 0 or now - d < rescue then return {'open', d - now} end
elseif ARGV[4] ~= '1' and not rec[5] and now < d then
  return {'wait', d - now}
end
local quiet = rec[6] == rec[2]
if tonumber(ARGV[6]) > 0 then
  redis.call('HDEL', KEYS[1], 'b', 'o', 'd', 'm', 'f', 'z')
  redis.call('HSET', KEYS[1], 'l', string.format('%.0f', now))
  redis.call('PEXPIRE', KEYS[1], ARGV[6])
else
  redis.call('DEL', KEYS[1])
end
if quiet then return {'quiet'} end
redis.call('SET', KEYS[2], '', 'PX', ARGV[5])
return {'fired'}
";

const RENEW: &str = r"
if redis.call('GET', KEYS[1]) ~= '' then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
";

const PUBLISH: &str = r"
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[1])
local sent = redis.pcall('PUBLISH', ARGV[2], ARGV[3])
if type(sent) == 'table' and sent.err then return 2 end
return 1
";

const CANCEL: &str = r"
if redis.call('HGET', KEYS[1], 'b') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[2])
local sent = redis.pcall('PUBLISH', ARGV[3], ARGV[4])
if type(sent) == 'table' and sent.err then return 2 end
return 1
";

const FLUSH: &str = r"
local b = redis.call('HGET', KEYS[1], 'b')
if not b then return 0 end
redis.call('HSET', KEYS[1], 'f', '1')
local sent = redis.pcall('PUBLISH', ARGV[1], 'F' .. b .. ' ' .. string.len(ARGV[2]) .. ' ' .. ARGV[2])
if type(sent) == 'table' and sent.err then return 2 end
return 1
";

/// What a call script answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BurstJoined {
    /// The id of the burst the call joined (or opened).
    pub(crate) burst: String,
    /// The call's generation: the owner's if nobody calls after it.
    pub(crate) generation: u64,
    /// Time until the burst is due, by the server's clock (zero if flushed).
    pub(crate) left: Duration,
    /// Whether this call opened the burst.
    pub(crate) opened: bool,
}

/// Where a burst stands, from a fire attempt or a probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BurstState {
    /// This instance fired it: run the function, then publish.
    Fired,
    /// Closed with nothing to run (its only call ran on the leading edge).
    Quiet,
    /// Ours, due in this long.
    Wait(Duration),
    /// Open and owned by a later call elsewhere; due in this many ms (negative:
    /// overdue).
    Open(i64),
    /// Fired and running; its lease has this long left.
    Running(Duration),
    /// Finished (or cancelled): the notice that was published.
    Done(Vec<u8>),
    /// No trace of it: cancelled long ago, or its owner died.
    Gone,
}

/// A notice received on the debounce channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BurstNotice {
    /// The logical key.
    pub(crate) key: String,
    /// The burst it is about.
    pub(crate) burst: String,
    /// What happened.
    pub(crate) kind: NoticeKind,
}

/// What a notice says about its burst.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NoticeKind {
    /// The run finished; its outcome, as the running instance encoded it.
    Outcome(Vec<u8>),
    /// The burst was cancelled.
    Cancelled,
    /// A flush was asked: the owner should fire now.
    Flush,
}

impl BurstNotice {
    /// The notice's wire form.
    pub(crate) fn frame(&self) -> Vec<u8> {
        let (kind, payload): (u8, &[u8]) = match &self.kind {
            NoticeKind::Outcome(bytes) => (b'R', bytes),
            NoticeKind::Cancelled => (b'C', &[]),
            NoticeKind::Flush => (b'F', &[]),
        };
        let len = self.key.len().to_string();
        let mut out =
            Vec::with_capacity(3 + self.burst.len() + len.len() + self.key.len() + payload.len());
        out.push(kind);
        out.extend_from_slice(self.burst.as_bytes());
        out.push(b' ');
        out.extend_from_slice(len.as_bytes());
        out.push(b' ');
        out.extend_from_slice(self.key.as_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// Reads a notice; `None` for anything malformed.
    pub(crate) fn parse(bytes: &[u8]) -> Option<Self> {
        let (&kind, rest) = bytes.split_first()?;
        let space = rest.iter().position(|&b| b == b' ')?;
        let burst = std::str::from_utf8(&rest[..space]).ok()?.to_owned();
        let rest = &rest[space + 1..];
        let space = rest.iter().position(|&b| b == b' ')?;
        let len: usize = std::str::from_utf8(&rest[..space]).ok()?.parse().ok()?;
        let rest = &rest[space + 1..];
        if rest.len() < len {
            return None;
        }
        let key = std::str::from_utf8(&rest[..len]).ok()?.to_owned();
        let payload = &rest[len..];
        let kind = match kind {
            b'R' => NoticeKind::Outcome(payload.to_vec()),
            b'C' => NoticeKind::Cancelled,
            b'F' => NoticeKind::Flush,
            _ => return None,
        };
        Some(Self { key, burst, kind })
    }
}

/// Whoever wants the debounce notices of one backend (a runtime's debounce).
pub(crate) trait BurstListener: Send + Sync + 'static {
    /// Called on the subscription's task for every notice; must not block.
    fn notice(&self, notice: BurstNotice);
}

/// The debounce's slice of a connection (see `Redis::slice`).
struct Holder {
    listeners: Arc<BurstListeners>,
    subscription: Subscription,
}

/// The listeners of one backend value, held weakly: a runtime that goes
/// away stops listening.
#[derive(Default)]
pub(crate) struct BurstListeners {
    list: Mutex<Vec<Weak<dyn BurstListener>>>,
}

impl BurstListeners {
    fn add(&self, listener: Weak<dyn BurstListener>) {
        let mut list = self.list.lock().unwrap_or_else(PoisonError::into_inner);
        list.retain(|l| l.strong_count() > 0);
        list.push(listener);
    }

    /// Hands a raw message to every live listener.
    fn deliver(&self, bytes: &[u8]) {
        let Some(notice) = BurstNotice::parse(bytes) else {
            tracing::debug!("ignored a malformed debounce notice");
            return;
        };
        let live: Vec<_> = self
            .list
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for listener in live {
            listener.notice(notice.clone());
        }
    }
}

/// The debounce channel's messages are notices, for every listener. A
/// missed one costs a grace: waiters probe the burst after it.
impl Subscriber for BurstListeners {
    fn message(&self, payload: &[u8]) {
        self.deliver(payload);
    }
}

fn text(v: Option<&Value>) -> Result<String, StoreError> {
    match v {
        Some(Value::BulkString(b)) => String::from_utf8(b.clone())
            .map_err(|_| StoreError::Protocol("expected text".to_owned())),
        Some(Value::SimpleString(s)) => Ok(s.clone()),
        other => Err(StoreError::Protocol(format!(
            "expected text, got {other:?}"
        ))),
    }
}

fn span(ms: i64) -> Duration {
    Duration::from_millis(ms.max(0).unsigned_abs())
}

fn burst_state(reply: &[Value]) -> Result<BurstState, StoreError> {
    Ok(match text(reply.first())?.as_str() {
        "fired" => BurstState::Fired,
        "quiet" => BurstState::Quiet,
        "wait" => BurstState::Wait(span(int(reply.get(1))?)),
        "open" => BurstState::Open(int(reply.get(1))?),
        "running" => BurstState::Running(span(int(reply.get(1))?)),
        "done" => match reply.get(1) {
            Some(Value::BulkString(b)) => BurstState::Done(b.clone()),
            other => {
                return Err(StoreError::Protocol(format!(
                    "expected an outcome, got {other:?}"
                )));
            }
        },
        "gone" => BurstState::Gone,
        other => {
            return Err(StoreError::Protocol(format!(
                "unknown burst state {other:?}"
            )));
        }
    })
}

impl Redis {
    /// The channel debounce notices are published on.
    pub(crate) fn debounce_channel(&self) -> String {
        format!("{}:debounce", self.prefix())
    }

    fn outcome_key(&self, key: &str, burst: &str) -> String {
        let mut suffix = String::with_capacity(3 + burst.len());
        suffix.push_str(":d:");
        suffix.push_str(burst);
        self.key(key, &suffix)
    }

    /// Starts delivering this backend's debounce notices to `listener`
    /// (subscribing if nobody did yet).
    pub(crate) fn listen_bursts(&self, listener: Weak<dyn BurstListener>) {
        let holder = self.bursts();
        holder.listeners.add(listener);
        holder.subscription.listen();
    }

    /// Makes sure the debounce notices are listened for: a listener whose
    /// runtime ended is started again here.
    pub(crate) fn keep_listening_for_bursts(&self) {
        self.bursts().subscription.listen();
    }

    fn bursts(&self) -> Arc<Holder> {
        self.slice(|| {
            let listeners = Arc::new(BurstListeners::default());
            let subscriber: Weak<dyn Subscriber> = Arc::downgrade(&listeners) as Weak<_>;
            let subscription = self.subscribe(self.debounce_channel(), subscriber);
            Holder {
                listeners,
                subscription,
            }
        })
    }

    /// Joins (or opens) `key`'s burst with a call from `instance`, making
    /// it the owner. `call` names the burst if this call opens it.
    pub(crate) async fn burst_call(
        &self,
        key: &str,
        instance: &str,
        call: &str,
        delay: Duration,
        max_wait: Option<Duration>,
        leading: bool,
    ) -> Result<BurstJoined, StoreError> {
        static SCRIPT: std::sync::OnceLock<LuaScript> = std::sync::OnceLock::new();
        let mut invocation = cached(&SCRIPT, CALL, true).prepare_invoke();
        invocation
            .key(self.key(key, ":d"))
            .arg(instance)
            .arg(call)
            .arg(ms(delay))
            .arg(max_wait.map_or(0, ms))
            .arg(ms(RECORD_SLACK))
            .arg(if leading { "1" } else { "0" })
            .arg(self.pinned());
        let reply: Vec<Value> = self.invoke(&invocation).await?;
        Ok(BurstJoined {
            burst: text(reply.first())?,
            generation: u64::try_from(int(reply.get(1))?).unwrap_or(0),
            left: span(int(reply.get(2))?),
            opened: int(reply.get(3))? == 1,
        })
    }

    /// Fires `burst` if `instance` owns its generation `generation` and it is
    /// due (`force`: now), or if its owner left it overdue by `rescue`;
    /// otherwise where it stands.
    #[allow(clippy::too_many_arguments)] // one script's arguments, named
    pub(crate) async fn burst_fire(
        &self,
        key: &str,
        instance: &str,
        burst: &str,
        generation: u64,
        force: bool,
        max_wait: Option<Duration>,
        rescue: Option<Duration>,
    ) -> Result<BurstState, StoreError> {
        static SCRIPT: std::sync::OnceLock<LuaScript> = std::sync::OnceLock::new();
        let mut invocation = cached(&SCRIPT, FIRE, true).prepare_invoke();
        invocation
            .key(self.key(key, ":d"))
            .key(self.outcome_key(key, burst))
            .arg(instance)
            .arg(burst)
            .arg(generation)
            .arg(if force { "1" } else { "0" })
            .arg(ms(RUN_LEASE))
            .arg(max_wait.map_or(0, ms))
            .arg(self.pinned())
            .arg(rescue.map_or(0, ms));
        let reply: Vec<Value> = self.invoke(&invocation).await?;
        burst_state(&reply)
    }

    /// Where `burst` stands, without firing it.
    pub(crate) async fn burst_probe(
        &self,
        key: &str,
        burst: &str,
    ) -> Result<BurstState, StoreError> {
        self.burst_fire(key, "", burst, 0, false, None, None).await
    }

    /// Renews the lease of a running burst. `false` if it is not running.
    pub(crate) async fn burst_renew(&self, key: &str, burst: &str) -> Result<bool, StoreError> {
        static SCRIPT: std::sync::OnceLock<LuaScript> = std::sync::OnceLock::new();
        let mut invocation = cached(&SCRIPT, RENEW, false).prepare_invoke();
        invocation
            .key(self.outcome_key(key, burst))
            .arg(ms(RUN_LEASE));
        let renewed: i64 = self.invoke(&invocation).await?;
        Ok(renewed == 1)
    }

    /// Stores a finished burst's outcome for late readers and publishes it.
    pub(crate) async fn burst_publish(
        &self,
        key: &str,
        burst: &str,
        outcome: Vec<u8>,
    ) -> Result<(), StoreError> {
        static SCRIPT: std::sync::OnceLock<LuaScript> = std::sync::OnceLock::new();
        let notice = BurstNotice {
            key: key.to_owned(),
            burst: burst.to_owned(),
            kind: NoticeKind::Outcome(outcome),
        };
        let mut invocation = cached(&SCRIPT, PUBLISH, false).prepare_invoke();
        invocation
            .key(self.outcome_key(key, burst))
            .arg(ms(OUTCOME_KEEP))
            .arg(self.debounce_channel())
            .arg(notice.frame());
        let answer: i64 = self.invoke(&invocation).await?;
        self.notice_sent(answer, key);
        Ok(())
    }

    /// Cancels `key`'s open burst, wherever its calls came from; the
    /// cancelled burst's id, or `None` if no burst was open.
    pub(crate) async fn burst_cancel(&self, key: &str) -> Result<Option<String>, StoreError> {
        static SCRIPT: std::sync::OnceLock<LuaScript> = std::sync::OnceLock::new();
        // The outcome key is named after the burst, which a script may not
        // compute (cluster scripts declare their keys): read it first, then
        // cancel only if it is still the open one.
        for _ in 0..3 {
            let burst: Option<String> = self
                .query(redis::cmd("HGET").arg(self.key(key, ":d")).arg("b"))
                .await?;
            let Some(burst) = burst else { return Ok(None) };
            let notice = BurstNotice {
                key: key.to_owned(),
                burst: burst.clone(),
                kind: NoticeKind::Cancelled,
            };
            let mut invocation = cached(&SCRIPT, CANCEL, false).prepare_invoke();
            invocation
                .key(self.key(key, ":d"))
                .key(self.outcome_key(key, &burst))
                .arg(&burst)
                .arg(ms(OUTCOME_KEEP))
                .arg(self.debounce_channel())
                .arg(notice.frame());
            let cancelled: i64 = self.invoke(&invocation).await?;
            self.notice_sent(cancelled, key);
            if cancelled >= 1 {
                return Ok(Some(burst));
            }
        }
        Ok(None)
    }

    /// Asks the owner of `key`'s open burst to fire now. `false` if no
    /// burst was open.
    pub(crate) async fn burst_flush(&self, key: &str) -> Result<bool, StoreError> {
        static SCRIPT: std::sync::OnceLock<LuaScript> = std::sync::OnceLock::new();
        let mut invocation = cached(&SCRIPT, FLUSH, false).prepare_invoke();
        invocation
            .key(self.key(key, ":d"))
            .arg(self.debounce_channel())
            .arg(key);
        let flushed: i64 = self.invoke(&invocation).await?;
        self.notice_sent(flushed, key);
        Ok(flushed >= 1)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::store::redis::each_server;

    #[test]
    fn notices_round_trip_through_their_frame() {
        for kind in [
            NoticeKind::Outcome(b"bytes with spaces and \n".to_vec()),
            NoticeKind::Cancelled,
            NoticeKind::Flush,
        ] {
            let notice = BurstNotice {
                key: "user 7:\u{e9}".to_owned(),
                burst: "00ff.12".to_owned(),
                kind,
            };
            assert_eq!(BurstNotice::parse(&notice.frame()), Some(notice));
        }
        assert_eq!(BurstNotice::parse(b""), None);
        assert_eq!(BurstNotice::parse(b"Xb 1 k"), None);
        assert_eq!(BurstNotice::parse(b"Rb 9 k"), None);
    }

    #[tokio::test]
    async fn the_latest_call_owns_the_burst_and_only_it_fires() {
        each_server("burst_latest_call_owns", async |redis: Redis| {
            for key in ["d1", "d2"] {
                redis.pin_time(1_000_000);
                let delay = Duration::from_millis(100);
                let a = redis
                    .burst_call(key, "a", "a.1", delay, None, false)
                    .await
                    .unwrap();
                assert!(a.opened);
                assert_eq!(a.burst, "a.1");
                assert_eq!(a.left, delay);
                redis.pin_time(1_000_050);
                let b = redis
                    .burst_call(key, "b", "b.1", delay, None, false)
                    .await
                    .unwrap();
                assert!(!b.opened);
                assert_eq!(b.burst, "a.1", "joins the open burst");
                assert_eq!(b.generation, a.generation + 1);
                // The superseded owner cannot fire; it learns the new deadline.
                redis.pin_time(1_000_120);
                let stale = redis
                    .burst_fire(key, "a", "a.1", a.generation, false, None, None)
                    .await
                    .unwrap();
                assert_eq!(stale, BurstState::Open(30));
                // The owner waits for its deadline, then fires once.
                let early = redis
                    .burst_fire(key, "b", "a.1", b.generation, false, None, None)
                    .await
                    .unwrap();
                assert_eq!(early, BurstState::Wait(Duration::from_millis(30)));
                redis.pin_time(1_000_150);
                let fired = redis
                    .burst_fire(key, "b", "a.1", b.generation, false, None, None)
                    .await
                    .unwrap();
                assert_eq!(fired, BurstState::Fired);
                let probe = redis.burst_probe(key, "a.1").await.unwrap();
                assert!(matches!(probe, BurstState::Running(_)), "{probe:?}");
                assert!(redis.burst_renew(key, "a.1").await.unwrap());
                redis
                    .burst_publish(key, "a.1", b"value".to_vec())
                    .await
                    .unwrap();
                let BurstState::Done(notice) = redis.burst_probe(key, "a.1").await.unwrap() else {
                    panic!("the outcome is readable");
                };
                let notice = BurstNotice::parse(&notice).expect("a notice");
                assert_eq!(notice.kind, NoticeKind::Outcome(b"value".to_vec()));
                // The next call opens a fresh burst.
                let c = redis
                    .burst_call(key, "a", "a.2", delay, None, false)
                    .await
                    .unwrap();
                assert!(c.opened);
                assert_eq!(c.burst, "a.2");
                assert_eq!(
                    redis.burst_probe(key, "zz.9").await.unwrap(),
                    BurstState::Gone
                );
            }
        })
        .await;
    }

    #[tokio::test]
    async fn a_burst_its_owner_left_overdue_is_rescued_once() {
        each_server("burst_rescue", async |redis: Redis| {
            let delay = Duration::from_millis(100);
            let rescue = Some(Duration::from_millis(500));
            redis.pin_time(3_000_000);
            let owned = redis
                .burst_call("r", "dead", "dead.1", delay, None, false)
                .await
                .unwrap();
            redis.pin_time(3_000_400);
            let early = redis
                .burst_fire("r", "b", &owned.burst, 0, false, None, rescue)
                .await
                .unwrap();
            assert_eq!(early, BurstState::Open(-300), "not overdue enough");
            redis.pin_time(3_000_700);
            let rescued = redis
                .burst_fire("r", "b", &owned.burst, 0, false, None, rescue)
                .await
                .unwrap();
            assert_eq!(rescued, BurstState::Fired);
            let again = redis
                .burst_fire("r", "c", &owned.burst, 0, false, None, rescue)
                .await
                .unwrap();
            assert!(matches!(again, BurstState::Running(_)), "{again:?}");
            let late = redis
                .burst_fire(
                    "r",
                    "dead",
                    &owned.burst,
                    owned.generation,
                    false,
                    None,
                    None,
                )
                .await
                .unwrap();
            assert!(
                matches!(late, BurstState::Running(_)),
                "the owner cannot fire it now"
            );
        })
        .await;
    }

    #[tokio::test]
    async fn max_wait_caps_the_deadline_and_spaces_the_next_burst() {
        each_server("burst_max_wait", async |redis: Redis| {
            let delay = Duration::from_millis(100);
            let max = Some(Duration::from_millis(250));
            redis.pin_time(2_000_000);
            let first = redis
                .burst_call("m", "a", "a.1", delay, max, false)
                .await
                .unwrap();
            assert_eq!(first.left, delay);
            redis.pin_time(2_000_200);
            let later = redis
                .burst_call("m", "b", "b.1", delay, max, false)
                .await
                .unwrap();
            assert_eq!(
                later.left,
                Duration::from_millis(50),
                "capped by first + max_wait"
            );
            redis.pin_time(2_000_250);
            let fired = redis
                .burst_fire("m", "b", "a.1", later.generation, false, max, None)
                .await
                .unwrap();
            assert_eq!(fired, BurstState::Fired);
            // Calls keep coming: the next burst runs at most max_wait after the last run.
            redis.pin_time(2_000_260);
            let next = redis
                .burst_call("m", "a", "a.2", delay, max, false)
                .await
                .unwrap();
            assert!(next.opened);
            assert_eq!(next.left, delay);
            redis.pin_time(2_000_450);
            let again = redis
                .burst_call("m", "a", "a.3", delay, max, false)
                .await
                .unwrap();
            assert_eq!(again.left, Duration::from_millis(50));
        })
        .await;
    }

    #[tokio::test]
    async fn a_leading_call_alone_closes_quietly_and_flush_and_cancel_reach_listeners() {
        struct Seen(Mutex<Vec<BurstNotice>>, tokio::sync::Notify);
        impl BurstListener for Seen {
            fn notice(&self, notice: BurstNotice) {
                self.0.lock().unwrap().push(notice);
                self.1.notify_one();
            }
        }
        each_server("burst_leading_flush_cancel", async |redis: Redis| {
            let delay = Duration::from_secs(5);
            let opened = redis
                .burst_call("l", "a", "a.1", delay, None, true)
                .await
                .unwrap();
            let quiet = redis
                .burst_fire("l", "a", "a.1", opened.generation, true, None, None)
                .await
                .unwrap();
            assert_eq!(quiet, BurstState::Quiet);

            let seen = Arc::new(Seen(Mutex::default(), tokio::sync::Notify::new()));
            let listener: Arc<dyn BurstListener> = seen.clone();
            redis.listen_bursts(Arc::downgrade(&listener));
            redis.subscribed(Duration::from_secs(2)).await;
            assert!(!redis.burst_flush("f").await.unwrap(), "nothing open");
            let call = redis
                .burst_call("f", "a", "a.2", delay, None, false)
                .await
                .unwrap();
            assert!(redis.burst_flush("f").await.unwrap());
            // A call after the flush is due at once too.
            let after = redis
                .burst_call("f", "b", "b.1", delay, None, false)
                .await
                .unwrap();
            assert_eq!(after.left, Duration::ZERO);
            assert_eq!(
                redis.burst_cancel("f").await.unwrap().as_deref(),
                Some(call.burst.as_str())
            );
            assert_eq!(redis.burst_cancel("f").await.unwrap(), None);
            while seen.0.lock().unwrap().len() < 2 {
                tokio::time::timeout(Duration::from_secs(2), seen.1.notified())
                    .await
                    .expect("notices arrive");
            }
            let kinds: Vec<_> = seen
                .0
                .lock()
                .unwrap()
                .iter()
                .map(|n| n.kind.clone())
                .collect();
            assert_eq!(kinds, [NoticeKind::Flush, NoticeKind::Cancelled]);
            let BurstState::Done(bytes) = redis.burst_probe("f", &call.burst).await.unwrap() else {
                panic!("the cancellation is readable");
            };
            assert_eq!(
                BurstNotice::parse(&bytes).map(|n| n.kind),
                Some(NoticeKind::Cancelled)
            );
        })
        .await;
    }
}
