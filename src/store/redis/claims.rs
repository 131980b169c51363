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
//! `{prefix:key}:in` and only ever grows, so a claim's counter orders it
//! after every earlier claim of the key. Completion and release publish the
//! key on one channel per prefix, so waiters elsewhere wake at once.

use std::time::Duration;

use redis::{Script, Value};

use super::{Redis, cached, ms};
use crate::store::StoreError;

const CLAIM: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 'fp', 'v', 'ty')
if rec[1] then
  if (rec[2] or '') ~= ARGV[2] then return {'mismatch'} end
  if rec[1] == 'c' then return {'replay', rec[3] or '', rec[4] or ''} end
  return {'busy', redis.call('PTTL', KEYS[1])}
end
local fence = redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('HSET', KEYS[1], 's', 'f', 't', ARGV[1], 'n', fence, 'fp', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {'won', fence}
";

const COMPLETE: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] == 'c' then return 0 end
if rec[1] == 'f' and rec[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 's', 'c', 't', ARGV[1], 'fp', ARGV[2], 'v', ARGV[3], 'ty', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('PUBLISH', ARGV[6], ARGV[7])
return 1
";

const RELEASE: &str = r"
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] ~= 'f' or rec[2] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[2], ARGV[3])
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

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ClaimReply {
    /// The key is ours, with this fencing counter.
    Won { fence: u64 },
    /// Another owner holds it for this long still.
    Busy { left: Duration },
    /// Completed: the encoded result and its type tag.
    Replay { value: Vec<u8>, type_tag: String },
    /// Held or completed under another fingerprint.
    Mismatch,
}

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

fn int(v: Option<&Value>) -> Result<i64, StoreError> {
    match v {
        Some(Value::Int(n)) => Ok(*n),
        Some(Value::BulkString(b)) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| StoreError::Protocol("expected an integer".to_owned())),
        other => Err(StoreError::Protocol(format!(
            "expected an integer, got {other:?}"
        ))),
    }
}

fn left(v: Option<&Value>) -> Result<Duration, StoreError> {
    Ok(Duration::from_millis(int(v)?.max(0).unsigned_abs()))
}

impl Redis {
    /// The channel completions and releases are published on.
    pub(crate) fn claims_channel(&self) -> String {
        format!("{}:idempotency", self.prefix())
    }

    /// Claims `key` for `token` under `fingerprint` for `lease`, or reports
    /// who has it. `keep` bounds how long the fencing counter outlives its
    /// last claim (the result TTL is a good choice).
    pub(crate) async fn claim(
        &self,
        key: &str,
        token: u64,
        fingerprint: &[u8],
        lease: Duration,
        keep: Duration,
    ) -> Result<ClaimReply, StoreError> {
        static SCRIPT: std::sync::OnceLock<Script> = std::sync::OnceLock::new();
        let mut call = cached(&SCRIPT, CLAIM, false).prepare_invoke();
        call.key(self.key(key, ":i"))
            .key(self.key(key, ":in"))
            .arg(token)
            .arg(fingerprint)
            .arg(ms(lease))
            .arg(ms(keep.max(lease)));
        let reply: Vec<Value> = self.invoke(&call).await?;
        let kind = bytes(reply.first());
        match kind.as_slice() {
            b"won" => Ok(ClaimReply::Won {
                fence: int(reply.get(1))?.max(0).unsigned_abs(),
            }),
            b"busy" => Ok(ClaimReply::Busy {
                left: left(reply.get(1))?,
            }),
            b"replay" => Ok(ClaimReply::Replay {
                value: bytes(reply.get(1)),
                type_tag: String::from_utf8_lossy(&bytes(reply.get(2))).into_owned(),
            }),
            b"mismatch" => Ok(ClaimReply::Mismatch),
            other => Err(StoreError::Protocol(format!(
                "unexpected claim reply {:?}",
                String::from_utf8_lossy(other)
            ))),
        }
    }

    /// Stores the result of `token`'s run for `ttl`, unless another owner
    /// holds the key or it is already completed. `true` if stored.
    pub(crate) async fn complete(
        &self,
        key: &str,
        token: u64,
        fingerprint: &[u8],
        value: &[u8],
        type_tag: &str,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        static SCRIPT: std::sync::OnceLock<Script> = std::sync::OnceLock::new();
        let mut call = cached(&SCRIPT, COMPLETE, false).prepare_invoke();
        call.key(self.key(key, ":i"))
            .arg(token)
            .arg(fingerprint)
            .arg(value)
            .arg(type_tag)
            .arg(ms(ttl))
            .arg(self.claims_channel())
            .arg(key);
        Ok(self.invoke::<i64>(&call).await? == 1)
    }

    /// Gives `key` up if `token` holds it in flight. `true` if released.
    pub(crate) async fn release(&self, key: &str, token: u64) -> Result<bool, StoreError> {
        static SCRIPT: std::sync::OnceLock<Script> = std::sync::OnceLock::new();
        let mut call = cached(&SCRIPT, RELEASE, false).prepare_invoke();
        call.key(self.key(key, ":i"))
            .arg(token)
            .arg(self.claims_channel())
            .arg(key);
        Ok(self.invoke::<i64>(&call).await? == 1)
    }

    /// Extends `token`'s lease on `key`. `false` if it no longer holds it.
    pub(crate) async fn renew(
        &self,
        key: &str,
        token: u64,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        static SCRIPT: std::sync::OnceLock<Script> = std::sync::OnceLock::new();
        let mut call = cached(&SCRIPT, RENEW, false).prepare_invoke();
        call.key(self.key(key, ":i")).arg(token).arg(ms(lease));
        Ok(self.invoke::<i64>(&call).await? == 1)
    }

    /// The record of `key`: one round trip, for replays.
    pub(crate) async fn read_record(&self, key: &str) -> Result<RecordReply, StoreError> {
        static SCRIPT: std::sync::OnceLock<Script> = std::sync::OnceLock::new();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::redis::each_server;

    const LEASE: Duration = Duration::from_secs(30);
    const TTL: Duration = Duration::from_secs(3600);

    #[tokio::test]
    async fn one_claim_wins_then_duplicates_see_it_busy_then_replay() {
        each_server("claims_win_busy_replay", async |r: Redis| {
            for key in ["pay:1", "pay:2", "pay:3"] {
                let ClaimReply::Won { fence } = r.claim(key, 11, b"fp", LEASE, TTL).await.unwrap()
                else {
                    panic!("first claim wins")
                };
                assert_eq!(fence, 1);
                match r.claim(key, 12, b"fp", LEASE, TTL).await.unwrap() {
                    ClaimReply::Busy { left } => assert!(left > Duration::from_secs(29)),
                    other => panic!("{other:?}"),
                }
                assert_eq!(
                    r.claim(key, 12, b"other", LEASE, TTL).await.unwrap(),
                    ClaimReply::Mismatch
                );
                assert!(r.renew(key, 11, LEASE).await.unwrap());
                assert!(!r.renew(key, 12, LEASE).await.unwrap(), "not the owner");
                assert!(!r.complete(key, 12, b"fp", b"x", "u8", TTL).await.unwrap());
                assert!(
                    r.complete(key, 11, b"fp", b"\x2a", "u8", TTL)
                        .await
                        .unwrap()
                );
                assert!(
                    !r.complete(key, 11, b"fp", b"\x2b", "u8", TTL)
                        .await
                        .unwrap(),
                    "once"
                );
                assert_eq!(
                    r.claim(key, 13, b"fp", LEASE, TTL).await.unwrap(),
                    ClaimReply::Replay {
                        value: vec![0x2a],
                        type_tag: "u8".to_owned()
                    }
                );
                assert_eq!(
                    r.read_record(key).await.unwrap(),
                    RecordReply::Completed {
                        fingerprint: b"fp".to_vec(),
                        value: vec![0x2a],
                        type_tag: "u8".to_owned()
                    }
                );
            }
        })
        .await;
    }

    #[tokio::test]
    async fn a_lapsed_lease_is_taken_over_once_and_the_old_owner_is_fenced() {
        each_server("claims_takeover_fencing", async |r: Redis| {
            let key = "order:9";
            let short = Duration::from_millis(50);
            assert_eq!(
                r.claim(key, 1, b"", short, TTL).await.unwrap(),
                ClaimReply::Won { fence: 1 }
            );
            tokio::time::sleep(Duration::from_millis(80)).await;
            assert_eq!(r.read_record(key).await.unwrap(), RecordReply::Missing);
            // Two duplicates race for the lapsed key: exactly one wins.
            let (a, b) = tokio::join!(
                r.claim(key, 2, b"", LEASE, TTL),
                r.claim(key, 3, b"", LEASE, TTL)
            );
            let wins = [a.unwrap(), b.unwrap()]
                .into_iter()
                .filter(|c| matches!(c, ClaimReply::Won { fence: 2 }))
                .count();
            assert_eq!(wins, 1);
            // The old owner can neither renew, release nor complete.
            assert!(!r.renew(key, 1, LEASE).await.unwrap());
            assert!(!r.release(key, 1).await.unwrap());
            assert!(!r.complete(key, 1, b"", b"late", "s", TTL).await.unwrap());
            // The new owner releases; the next claim gets a higher fence.
            let owner = if r.renew(key, 2, LEASE).await.unwrap() {
                2
            } else {
                3
            };
            assert!(r.release(key, owner).await.unwrap());
            assert_eq!(
                r.claim(key, 4, b"", LEASE, TTL).await.unwrap(),
                ClaimReply::Won { fence: 3 }
            );
        })
        .await;
    }
}

#[cfg(test)]
mod notice_tests {
    use std::time::Instant;

    use super::*;
    use crate::store::redis::each_server;

    #[tokio::test]
    async fn a_waiter_wakes_on_the_published_completion_not_on_polling() {
        each_server("claims_pubsub_wakeup", async |r: Redis| {
            // Two backend values: two "instances".
            let other = r.clone();
            let key = "wake:1";
            assert!(matches!(
                r.claim(
                    key,
                    1,
                    b"",
                    Duration::from_secs(30),
                    Duration::from_secs(60)
                )
                .await
                .unwrap(),
                ClaimReply::Won { .. }
            ));
            let watch = other.watch(key);
            // Let the subscription settle before completing.
            tokio::time::sleep(Duration::from_millis(200)).await;
            let started = Instant::now();
            let waiter = async {
                watch.changed(Duration::from_secs(5)).await;
                started.elapsed()
            };
            let completer = async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                r.complete(key, 1, b"", b"v", "t", Duration::from_secs(60))
                    .await
                    .unwrap()
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
