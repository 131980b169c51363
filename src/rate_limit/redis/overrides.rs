//! Per-key overrides kept in Redis, so that one set on any instance applies on all of them.
//!
//! The overrides of the limiters of one namespace live in one hash, `{prefix:<namespace>}:o`:
//! a field per key, holding `<expiry, epoch ms on the server's clock, 0 for none> <kinds>
//! <numbers…>`, the strategy's tiers as the rate-limit script reads them. Setting or removing
//! one is one script call, which drops the overrides that expired, keeps the hash as long as
//! its longest override (no expiry while one is permanent), and publishes, on the rate-limit
//! channel, the hash (every instance reads the namespace's overrides again) and the key's
//! state (every instance forgets what it answers locally for it). Reading them is one script
//! call too, on the hash's node, which reads that server's clock for the expiries. Limiters
//! read them when they start using the store, when a notice arrives or notices may have been
//! missed (see [`Redis::overrides_version`]), and every few seconds.

use std::sync::OnceLock;
use std::time::Duration;

use crate::rate_limit::{RateLimitError, ScriptedStrategy, StoredOverride, TierParams};
use crate::store::StoreError;
use crate::store::redis::script::LuaScript;
use crate::store::redis::{Redis, cached};

use super::script::{MAX_HORIZON_US, kind};

/// The suffix of a namespace's overrides hash; a notice naming a key that ends with it is an
/// override's (the rate-limit states end with `:r`).
pub(super) const SUFFIX: &str = ":o";

/// KEYS[1] the namespace's overrides. ARGV[1] the operation: `s` set (ARGV[2] the key, ARGV[3]
/// its strategy, ARGV[4] its life in ms or 0, ARGV[5] the channel, ARGV[6] the key's state),
/// `d` delete (the same without ARGV[3] and ARGV[4]), `r` read: the server's time in ms, then
/// each override that still applies, its key and its value.
const SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local key, op = KEYS[1], ARGV[1]
local function expiry(value)
  return tonumber(string.match(value, '^(%d+) '))
end
if op == 'r' then
  local all = redis.call('HGETALL', key)
  local out = {string.format('%d', now)}
  for i = 1, #all, 2 do
    local e = expiry(all[i + 1])
    if e and (e == 0 or e > now) then
      out[#out + 1] = all[i]
      out[#out + 1] = all[i + 1]
    end
  end
  return out
end
if op == 's' then
  local life = tonumber(ARGV[4])
  local e = 0
  if life > 0 then e = now + life end
  redis.call('HSET', key, ARGV[2], string.format('%d', e) .. ' ' .. ARGV[3])
else
  redis.call('HDEL', key, ARGV[2])
end
-- Expired (or unreadable) overrides go; the hash lives as long as its longest override.
local all = redis.call('HGETALL', key)
local last, forever = 0, false
for i = 1, #all, 2 do
  local e = expiry(all[i + 1])
  if e == 0 then
    forever = true
  elseif not e or e <= now then
    redis.call('HDEL', key, all[i])
  elseif e > last then
    last = e
  end
end
if forever then
  redis.call('PERSIST', key)
elseif last > 0 then
  redis.call('PEXPIREAT', key, string.format('%d', last))
end
-- pcall: a notice refused (no channel rights) must not fail the script after its write.
redis.pcall('PUBLISH', ARGV[5], key)
redis.pcall('PUBLISH', ARGV[5], ARGV[6])
return 1
";

static CALL: OnceLock<LuaScript> = OnceLock::new();

/// A strategy's tiers as an override's value holds them: its kinds, then four numbers a tier.
fn spec(tiers: &[TierParams]) -> String {
    let mut kinds = String::with_capacity(tiers.len());
    let mut numbers = String::new();
    for tier in tiers {
        let (kind, values) = kind(tier);
        kinds.push(kind);
        for value in values {
            numbers.push(' ');
            numbers.push_str(&value.to_string());
        }
    }
    kinds + &numbers
}

/// The tiers of a strategy from its `kinds` and numbers (see [`spec`]), as [`kind`] wrote them.
fn tiers_of(kinds: &str, numbers: &[u64]) -> Option<Vec<TierParams>> {
    if numbers.len() != 4 * kinds.len() {
        return None;
    }
    kinds
        .chars()
        .zip(numbers.chunks_exact(4))
        .map(|(kind, n)| {
            Some(match kind {
                'g' | 'l' => TierParams::Emission {
                    shaper: kind == 'l',
                    limit: n[0],
                    period_us: n[1],
                    per: n[2],
                    tolerance: n[3],
                },
                't' if n[0] == n[1] => TierParams::TokenBucket {
                    capacity: n[0],
                    per_us: n[2],
                    refill: n[3],
                },
                'f' | 's' if n[2] == 0 && n[3] == 0 => TierParams::Window {
                    sliding: kind == 's',
                    limit: n[0],
                    window_us: n[1],
                },
                _ => return None,
            })
        })
        .collect()
}

/// An override's value read back at `now_ms` (the server's clock): its strategy and how long
/// it still applies. `None` for a value this build cannot read as an `S`.
fn parse<S: ScriptedStrategy>(value: &str, now_ms: u64) -> Option<(S, Option<Duration>)> {
    let mut words = value.split(' ');
    let expires: u64 = words.next()?.parse().ok()?;
    let kinds = words.next()?;
    let numbers: Vec<u64> = words.map(str::parse).collect::<Result<_, _>>().ok()?;
    let tiers = tiers_of(kinds, &numbers)?;
    let mut read = tiers.iter();
    let strategy = S::from_tiers(&mut read)?;
    if read.next().is_some() {
        return None;
    }
    let expires_in = (expires > 0).then(|| Duration::from_millis(expires.saturating_sub(now_ms)));
    Some((strategy, expires_in))
}

impl Redis {
    /// The hash of the overrides of the limiters of `namespace`.
    fn overrides_key(&self, namespace: &str) -> String {
        self.key(namespace, SUFFIX)
    }

    /// Keeps `strategy` as `key`'s override in `namespace` for `ttl` (removes it on `None`),
    /// and announces it (see the module's documentation).
    pub(super) async fn keep_override<S: ScriptedStrategy>(
        &self,
        namespace: &str,
        key: &str,
        strategy: Option<&S>,
        ttl: Option<Duration>,
    ) -> Result<(), RateLimitError> {
        let store_key = if namespace.is_empty() {
            key.to_owned()
        } else {
            format!("{namespace}:{key}")
        };
        let mut call = cached(&CALL, SCRIPT, false).prepare_invoke();
        call.key(self.overrides_key(namespace));
        match strategy {
            Some(strategy) => {
                let mut tiers = Vec::with_capacity(2);
                strategy.push_tiers(&mut tiers);
                if tiers.iter().any(|t| t.horizon_us() > MAX_HORIZON_US) {
                    return Err(RateLimitError::TooLarge {
                        what: "a time to refill from empty of over 5 * 10^15 µs, for the Redis store,",
                    });
                }
                let life = ttl.map_or(0, |ttl| {
                    u64::try_from(ttl.as_micros().div_ceil(1_000)).unwrap_or(u64::MAX)
                });
                call.arg("s").arg(key).arg(spec(&tiers)).arg(life);
            }
            None => {
                call.arg("d").arg(key).arg("").arg(0);
            }
        }
        let state = self.key(&store_key, ":r");
        call.arg(self.rate_limit_channel()).arg(&state);
        let written: Result<i64, StoreError> = self.invoke(&call).await;
        // Whatever the reply: a call that timed out may have run. The other instances hear of
        // it from the script.
        self.batcher().local.forget(&state);
        written.map_err(|e| RateLimitError::store(key, e))?;
        Ok(())
    }

    /// The overrides of `namespace` that still apply, as this build reads them (a value it
    /// cannot read, written by another build or by hand, is skipped and logged).
    pub(super) async fn overrides_of<S: ScriptedStrategy>(
        &self,
        namespace: &str,
    ) -> Result<Vec<StoredOverride<S>>, RateLimitError> {
        let hash = self.overrides_key(namespace);
        let mut call = cached(&CALL, SCRIPT, false).prepare_invoke();
        call.key(&hash).arg("r");
        let reply: Vec<String> = self
            .invoke(&call)
            .await
            .map_err(|e| RateLimitError::store(namespace, e))?;
        let (now, pairs) = reply.split_first().ok_or_else(|| {
            RateLimitError::store(
                namespace,
                StoreError::Protocol("reading overrides replied nothing".to_owned()),
            )
        })?;
        let now_ms: u64 = now.parse().map_err(|_| {
            RateLimitError::store(
                namespace,
                StoreError::Protocol(format!("reading overrides replied the time {now:?}")),
            )
        })?;
        let mut overrides = Vec::with_capacity(pairs.len() / 2);
        for pair in pairs.chunks_exact(2) {
            match parse::<S>(&pair[1], now_ms) {
                Some((strategy, expires_in)) => {
                    overrides.push(StoredOverride::new(pair[0].clone(), strategy, expires_in));
                }
                None => tracing::warn!(
                    hash,
                    key = pair[0],
                    value = pair[1],
                    "an override this limiter cannot read (another strategy, or not written by \
                     throttlebeam): ignored"
                ),
            }
        }
        Ok(overrides)
    }

    /// Changes whenever the overrides kept here may have changed since they were last read:
    /// a notice of a change arrived on the rate-limit channel, or a subscription replaced one
    /// that was lost (notices were lost with it). Subscribes on the first call. The first
    /// subscription going live changes nothing (a limiter's first read may precede it: a
    /// change in between waits for the refresh), nor does a subscription that is down (the
    /// refresh reads the overrides meanwhile; its replacement changes it).
    pub(super) fn overrides_version(&self) -> u64 {
        let batcher = self.batcher();
        let local = &batcher.local;
        let replaced = local.live_subscription(self).unwrap_or(1).saturating_sub(1);
        // Subscription numbers and notices both stay far below 2^32.
        (replaced << 32) ^ local.override_notices()
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use crate::rate_limit::{Gcra, Tiered, TokenBucket};

    #[test]
    fn a_value_reads_back_as_the_strategy_it_was_written_for() {
        let tiered = Tiered::new(
            Gcra::per_second(NonZeroU32::new(10).unwrap()),
            TokenBucket::per_second(NonZeroU32::new(5).unwrap(), NonZeroU32::MIN),
        );
        let mut tiers = Vec::new();
        tiered.push_tiers(&mut tiers);
        let value = format!("1500 {}", spec(&tiers));
        assert_eq!(
            parse::<Tiered<Gcra, TokenBucket>>(&value, 1_000),
            Some((tiered, Some(Duration::from_millis(500))))
        );
        let forever = format!("0 {}", spec(&tiers));
        assert_eq!(
            parse::<Tiered<Gcra, TokenBucket>>(&forever, 1_000),
            Some((tiered, None))
        );
        // Another strategy, more tiers than it takes, words that are not numbers: none.
        assert_eq!(parse::<Gcra>(&forever, 1_000), None);
        assert_eq!(parse::<TokenBucket>("0 t 5 5 x 1", 0), None);
        assert_eq!(parse::<TokenBucket>("0 t 5 6 1000000 1", 0), None);
        assert_eq!(parse::<TokenBucket>("", 0), None);
    }
}
