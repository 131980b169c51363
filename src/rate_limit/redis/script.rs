//! What the scripts read and reply: the Lua entry points, an operation's arguments as the
//! scripts take them, the replies' decoding.

use crate::rate_limit::{
    Decision, Forecast, InsufficientCapacity, RateLimitError, RateLimitOp, RateLimitReply,
    RateLimitRequest, ScriptedStrategy, ShaperReservation, TIME_CEILING_US, TierParams,
};
use crate::store::StoreError;
use crate::store::redis::Redis;

use super::operation::{Args, Operation};

/// The script of one operation: the library, then its entry point.
pub(super) const SINGLE: &str = concat!(
    include_str!("../rate_limit.lua"),
    r"
local now = clock(now_us(ARGV[1]))
local p, raw = params(2), false
if p[1] ~= 'x' then raw = redis.call('GET', KEYS[1]) end
local out = {}
decide(KEYS[1], p, now, raw, out, 1)
return out
"
);

/// The script of a batch: KEYS one per operation; ARGV[1] the pinned time or ''; ARGV[2] how
/// many distinct argument sets follow, each as its argument count and its arguments; then,
/// when there are several sets, per operation the number of its set. One `TIME` and one
/// `MGET` for all; each set parsed once; a key that holds a state is written once, at the
/// end, with what its last operation left; the replies in order in one flat array, each
/// after its length.
pub(super) const BATCH: &str = concat!(
    include_str!("../rate_limit.lua"),
    r"
local now = clock(now_us(ARGV[1]))
local sets, p, count = {}, 3, tonumber(ARGV[2])
for s = 1, count do
  sets[s] = params(p + 1)
  p = p + 1 + tonumber(ARGV[p])
end
local states = redis.call('MGET', unpack(KEYS))
deferred, deferred_keys = {}, {}
local out, i, set = {}, 1, sets[1]
for k = 1, #KEYS do
  local key = KEYS[k]
  local raw = written[key]
  if raw == nil then raw = states[k] end
  if count > 1 then set = sets[tonumber(ARGV[p + k - 1])] end
  local j = decide(key, set, now, raw, out, i + 1)
  out[i] = j - i - 1
  i = j
end
for _, key in ipairs(deferred_keys) do
  local px = deferred[key]
  if px then
    redis.call('SET', key, written[key], 'PX', string.format('%d', px))
    deferred[key] = nil
  end
end
return out
"
);

/// The replies of a batch of `operations` from its flat array (each reply after its length).
pub(super) fn batch_replies(flat: &[i64], operations: usize) -> Result<Vec<&[i64]>, StoreError> {
    let mut replies = Vec::with_capacity(operations);
    let mut rest = flat;
    while let Some((&len, tail)) = rest.split_first() {
        let reply = usize::try_from(len)
            .ok()
            .and_then(|len| tail.get(..len))
            .ok_or_else(|| StoreError::Protocol(format!("rate limit batch replied {flat:?}")))?;
        replies.push(reply);
        rest = &tail[reply.len()..];
    }
    if replies.len() != operations {
        return Err(StoreError::Protocol(format!(
            "rate limit batch of {operations} replied {} times",
            replies.len()
        )));
    }
    Ok(replies)
}

/// The exact integer range of a Lua number.
pub(super) const MAX_EXACT: u64 = 1 << 53;

/// How far ahead of the time ceiling a tier's times may run and stay exact in Lua.
pub(super) const MAX_HORIZON_US: u64 = MAX_EXACT - TIME_CEILING_US;

/// How long a key outlives the rest point of its state: 1 ms on the server's clock covers
/// the rounding between the script's `TIME` and the server's expiry clock.
pub(super) const SLACK_MS: u64 = 1;

/// The same while the time is pinned: the server still expires keys on its own clock, which
/// has nothing to do with the pinned one, so keys linger (a state at rest is equal to no
/// state, so keeping it longer never changes a decision).
pub(super) const PINNED_SLACK_MS: u64 = 3_600_000;

/// A tier as the script reads it: its kind letter and four numbers.
pub(super) fn kind(tier: &TierParams) -> (char, [u64; 4]) {
    match *tier {
        TierParams::Emission {
            shaper,
            limit,
            period_us,
            per,
            tolerance,
        } => (
            if shaper { 'l' } else { 'g' },
            [limit, period_us, per, tolerance],
        ),
        TierParams::TokenBucket {
            capacity,
            per_us,
            refill,
        } => ('t', [capacity, capacity, per_us, refill]),
        TierParams::Window {
            sliding,
            limit,
            window_us,
        } => (if sliding { 's' } else { 'f' }, [limit, window_us, 0, 0]),
    }
}

/// A reply field as a `u64`.
pub(super) fn field(reply: &[i64], i: usize) -> Result<u64, StoreError> {
    reply
        .get(i)
        .and_then(|v| u64::try_from(*v).ok())
        .ok_or_else(|| StoreError::Protocol(format!("rate limit script replied {reply:?}")))
}

pub(super) fn decode(reply: &[i64]) -> Result<RateLimitReply, StoreError> {
    let f = |i| field(reply, i);
    Ok(match f(0)? {
        1 => RateLimitReply::Decision(Decision {
            allowed: f(1)? == 1,
            limit: f(2)?,
            remaining: f(3)?,
            reset_at_ms: f(4)?,
            retry_after_ms: f(5)?,
        }),
        2 => RateLimitReply::Forecast(Forecast {
            spendable_now: f(1)?,
            next_replenish_at_ms: f(2)?,
            full_at_ms: f(3)?,
        }),
        3 if f(1)? == 1 => {
            RateLimitReply::Reservation(ShaperReservation::Granted { delay_ms: f(2)? })
        }
        3 => RateLimitReply::Reservation(ShaperReservation::QueueFull {
            retry_after_ms: f(2)?,
        }),
        4 => RateLimitReply::Reset,
        _ => {
            return Err(StoreError::Protocol(format!(
                "rate limit script replied {reply:?}"
            )));
        }
    })
}

/// A script reply as a result: code 5 is a key holding another strategy's state.
pub(super) fn reply_of(key: &str, reply: &[i64]) -> Result<RateLimitReply, StoreError> {
    if reply == [5] {
        return Err(StoreError::Protocol(format!(
            "rate limit key {key} holds the state of another strategy, or a value of \
             another type"
        )));
    }
    decode(reply)
}

/// How many argument sets a batch looks through for one an operation can share: a batch
/// of operations that all differ (many limiters at once) costs at most this many comparisons
/// per operation, and a set sent twice is only parsed twice.
pub(super) const SHARED_SETS: usize = 8;

/// The argument sets of `operations` (in order of first use; distinct among the first
/// [`SHARED_SETS`]), and for each operation the number of its set, from 1 as the script
/// counts.
pub(super) fn argument_sets<'a>(
    operations: impl ExactSizeIterator<Item = &'a Operation>,
) -> (Vec<&'a Args>, Vec<usize>) {
    let mut sets: Vec<&Args> = Vec::new();
    let mut set_of = Vec::with_capacity(operations.len());
    for operation in operations {
        let args = &operation.args;
        let shared = sets.iter().take(SHARED_SETS).position(|set| *set == args);
        let set = match shared {
            Some(set) => set,
            None => {
                sets.push(args);
                sets.len() - 1
            }
        };
        set_of.push(set + 1);
    }
    (sets, set_of)
}

impl Redis {
    /// The pinned time in µs as a script argument, or empty for the server's `TIME`.
    pub(super) fn pinned_us(&self) -> String {
        self.pinned_us_at()
            .map(|n| n.to_string())
            .unwrap_or_default()
    }

    /// The script's view of `request`, after the checks made before any round trip.
    pub(super) fn operation<S: ScriptedStrategy>(
        &self,
        request: &RateLimitRequest<'_, S>,
    ) -> Result<Operation, RateLimitError> {
        let (op, cost) = match request.op {
            RateLimitOp::Check { cost } => ("c", Some(cost)),
            RateLimitOp::Reserve { cost } => ("r", Some(cost)),
            RateLimitOp::Peek => ("p", None),
            RateLimitOp::Forecast { cost } => ("f", Some(cost)),
            RateLimitOp::Reset => ("x", None),
        };
        let capacity = request.strategy.limit();
        if let RateLimitOp::Check { cost } | RateLimitOp::Reserve { cost } = request.op
            && u64::from(cost.get()) > capacity
        {
            return Err(InsufficientCapacity {
                cost: cost.get(),
                capacity,
            }
            .for_key(request.key));
        }
        let mut tiers = Vec::with_capacity(2);
        request.strategy.push_tiers(&mut tiers);
        if tiers.iter().any(|t| t.horizon_us() > MAX_HORIZON_US) {
            return Err(RateLimitError::TooLarge {
                what: "a time to refill from empty of over 5 * 10^15 µs, for the Redis store,",
            });
        }
        let slack = if self.pinned_ms().is_none() {
            SLACK_MS
        } else {
            PINNED_SLACK_MS
        };
        let mut kinds = String::with_capacity(tiers.len());
        let mut numbers = Vec::with_capacity(4 * tiers.len());
        for tier in &tiers {
            let (kind, values) = kind(tier);
            kinds.push(kind);
            numbers.extend_from_slice(&values);
        }
        let channel = if op == "x" {
            self.rate_limit_channel()
        } else {
            String::new()
        };
        Ok(Operation {
            key: self.key(request.key, ":r"),
            args: Args {
                op,
                cost: cost.map_or(1, |c| c.get()),
                slack,
                kinds,
                numbers,
                channel,
            },
            ticket: None,
            fresh: None,
            learn: false,
        })
    }
}
