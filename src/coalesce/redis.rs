//! [`WindowStore`] on Redis: the coalescing throttle's windows shared by
//! every instance, each operation one script call on the server's clock.

use std::time::Duration;

use crate::coalesce::{WindowClaim, WindowEntry, WindowStore, WindowStoreFuture};
use crate::store::StoreError;
use crate::store::redis::script::LuaScript;
use crate::store::redis::{Redis, cached, ms};

/// The holder's entry with its end on this instance's wall clock: the
/// server's time left added to our now, so clock skew between instances
/// never shifts a retry.
fn local(held: HeldWindow) -> Option<WindowEntry> {
    let now_ms = crate::clock::duration_ms(crate::clock::since_epoch());
    let left = u64::try_from(held.left.as_millis()).unwrap_or(u64::MAX);
    held.token
        .map(|token| WindowEntry::new(now_ms.saturating_add(left), token))
}

impl WindowStore for Redis {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, WindowClaim> {
        Box::pin(async move {
            let held = self
                .window_claim(&self.key(key, ":w"), entry.token, ttl)
                .await?;
            Ok(match held {
                None => WindowClaim::Won,
                Some(held) => WindowClaim::Lost {
                    holder: local(held),
                },
            })
        })
    }

    fn extend<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, bool> {
        Box::pin(async move {
            Ok(self
                .window_cas(&self.key(key, ":w"), entry.token, ttl)
                .await?)
        })
    }

    /// Recording a run is the same compare-and-set as extending the window.
    fn record<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, bool> {
        self.extend(key, entry, ttl)
    }
}

/// Coalescing-throttle window claim: `SET NX PX` of `"<end_ms>:<token>"`
/// (end on the server's clock); on a lost race, what the holder stores and
/// its time left, in the same round trip.
const WINDOW_CLAIM: &str = r"
local now = now_ms(ARGV[3])
local value = string.format('%.0f', now + tonumber(ARGV[2])) .. ':' .. ARGV[1]
if redis.call('SET', KEYS[1], value, 'NX', 'PX', ARGV[2]) then return {1, 0, ''} end
local held = redis.call('GET', KEYS[1])
local left = redis.call('PTTL', KEYS[1])
return {0, left, held or ''}
";

/// Compare-and-set on the owner's token: write `"<end_ms>:<token>"` for
/// `ttl` unless another token holds the key.
const WINDOW_CAS: &str = r"
local held = redis.call('GET', KEYS[1])
if held then
  local token = string.match(held, ':(%d+)$') or '0'
  if token ~= ARGV[1] then return 0 end
end
local now = now_ms(ARGV[3])
local value = string.format('%.0f', now + tonumber(ARGV[2])) .. ':' .. ARGV[1]
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return 1
";

/// What a window key holds, from the Redis side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HeldWindow {
    /// Time left on the key, by the server's clock.
    pub(crate) left: Duration,
    /// The owner's token, when the value is readable.
    pub(crate) token: Option<u64>,
    /// The stored text.
    pub(crate) raw: String,
}

impl HeldWindow {
    fn parse(left: i64, raw: String) -> Self {
        let token = raw.rsplit_once(':').and_then(|(_, t)| t.parse().ok());
        Self {
            left: Duration::from_millis(left.max(0).unsigned_abs()),
            token,
            raw,
        }
    }
}

impl Redis {
    /// Takes a coalescing-throttle window for `token` if it is free.
    /// `Ok(None)`: won; `Ok(Some(held))`: lost to `held`.
    pub(crate) async fn window_claim(
        &self,
        key: &str,
        token: u64,
        ttl: Duration,
    ) -> Result<Option<HeldWindow>, StoreError> {
        static SCRIPT: std::sync::OnceLock<LuaScript> = std::sync::OnceLock::new();
        let mut call = cached(&SCRIPT, WINDOW_CLAIM, true).prepare_invoke();
        call.key(key).arg(token).arg(ms(ttl)).arg(self.pinned());
        let (won, left, raw): (i64, i64, String) = self.invoke(&call).await?;
        Ok((won != 1).then(|| HeldWindow::parse(left, raw)))
    }

    /// Extends or records the window of `key` for `token`, unless another
    /// token holds it. `true` if written.
    pub(crate) async fn window_cas(
        &self,
        key: &str,
        token: u64,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        static SCRIPT: std::sync::OnceLock<LuaScript> = std::sync::OnceLock::new();
        let mut call = cached(&SCRIPT, WINDOW_CAS, true).prepare_invoke();
        call.key(key).arg(token).arg(ms(ttl)).arg(self.pinned());
        let written: i64 = self.invoke(&call).await?;
        Ok(written == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::redis::each_server;

    #[tokio::test]
    async fn window_claim_and_compare_and_set_on_the_token() {
        each_server("window_claim_and_cas", async |redis: Redis| {
            let lease = Duration::from_secs(30);
            for k in ["w1", "w2", "w3"] {
                redis.pin_time(1_000_000);
                let key = redis.key(k, "");
                assert_eq!(redis.window_claim(&key, 7, lease).await.unwrap(), None);
                let held = redis
                    .window_claim(&key, 8, lease)
                    .await
                    .unwrap()
                    .expect("lost");
                assert_eq!(held.token, Some(7));
                assert_eq!(held.raw, "1030000:7");
                assert!(held.left > Duration::from_secs(29));
                // Another token can neither extend nor record.
                assert!(!redis.window_cas(&key, 8, lease).await.unwrap());
                // The owner can; the stored end follows the (pinned) server time.
                redis.pin_time(2_000_000);
                assert!(
                    redis
                        .window_cas(&key, 7, Duration::from_secs(5))
                        .await
                        .unwrap()
                );
                // A claim by another token on the live key writes nothing and reads the holder.
                let held = redis
                    .window_claim(&key, 9, lease)
                    .await
                    .unwrap()
                    .expect("live");
                assert_eq!(held.raw, "2005000:7");
                assert!(held.left <= Duration::from_secs(5));
            }
        })
        .await;
    }
}
