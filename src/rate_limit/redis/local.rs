//! Limited keys answered locally: the denials kept until shortly before the server's T, and
//! the notices that make every instance forget one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use throttlebeam_supervisors::{Counters, Sweep, TtlTable};
use tokio::time::Instant;

use super::operation::{Args, Operation, Ticket};
use crate::rate_limit::{Decision, RateLimitReply, ShaperReservation};
use crate::store::redis::{Redis, RedisBuilder, Subscriber, Subscription};

/// How many limited keys a [`Redis`] answers locally at most by default (see
/// `RedisBuilder::with_local_answers`).
pub(super) const DEFAULT_LOCAL_ANSWERS: usize = 10_000;

impl RedisBuilder {
    /// How many limited keys this instance may answer locally at once (default 10,000; 0
    /// turns local answers off).
    ///
    /// A check (or a shaper reservation) denied by the server until T is answered here,
    /// with no round trip, by later checks of the same key with the same limit and a cost at
    /// least as large, until shortly before T: nothing another instance does can admit it
    /// sooner, since spending only postpones T. The local answer is the server's denial with
    /// its retry-after counted down (`remaining`, `limit` and `reset_at_ms` as the server
    /// last reported them; for a larger cost than the one denied, the retry-after is when the
    /// denied cost could pass, and the server answers the check after it).
    ///
    /// What can admit a key sooner is announced through pub/sub: a `reset` (the script
    /// publishes it with the deletion, in the same call) and an override set or removed on
    /// a limiter; every instance forgets the key's local answer when the notice arrives.
    /// Local answers are only kept and given while this instance's subscription is live and
    /// has not been lost since the denial was sent, so a notice missed while the subscription
    /// was down never leaves a stale answer: whatever the subscription misses, the server
    /// decides. A key deleted behind the library's back (`DEL`, `FLUSHDB`, eviction under
    /// `maxmemory`) is seen once its local answer ends, before T. While a test pins the
    /// scripts' time ([`Redis::pin_time`]), nothing is answered locally.
    ///
    /// The notices travel on the backend's one pub/sub connection (the one idempotency
    /// waiters and shared debounce use), which the first rate-limit check opens when local
    /// answers are on.
    ///
    /// Memory is bounded: at most `max_keys` entries of a few hundred bytes; an entry ends
    /// at its T, and a full table first drops the ended ones, then answers new denials from
    /// the server. [`RedisStats::local_answers`](crate::store::RedisStats::local_answers) counts the
    /// answers given.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), throttlebeam::store::StoreError> {
    /// use throttlebeam::store::Redis;
    ///
    /// let redis = Redis::builder("redis://127.0.0.1:6379")
    ///     .with_local_answers(50_000)
    ///     .connect()
    ///     .await?;
    /// # drop(redis);
    /// # Ok(()) }
    /// ```
    pub fn with_local_answers(mut self, max_keys: usize) -> Self {
        self.local_answers = Some(max_keys);
        self
    }
}

/// A denial answered locally (see [`LocalAnswers`]), until `retry_after - 1 ms` after the
/// call was sent (never later than the server's T): its expiry in the table.
#[derive(Clone)]
pub(super) struct Denied {
    pub(super) kinds: Box<str>,
    pub(super) numbers: Box<[u64]>,
    /// The cost denied: checks of this cost or more are answered.
    pub(super) cost: u32,
    /// What retry-afters count down to: `retry_after` after the reply arrived, never earlier
    /// than the server's T.
    pub(super) admit_at: Instant,
    /// When the entry ends (its expiry in the table): `retry_after - 1 ms` after the call was
    /// sent, before the server's T.
    pub(super) until: Instant,
    /// The server's figures, when the denial was a check's (a reservation's carries none).
    pub(super) decision: Option<(u64, u64, u64)>,
    /// The subscription live when the denial was sent.
    pub(super) subscription: u64,
}

/// Denials this instance answers without a round trip (see
/// `RedisBuilder::with_local_answers`): at most `max_keys` keys, each until shortly before
/// the server's T, while the pub/sub subscription that would announce a reset is the one
/// that was live when the denial was sent.
pub(super) struct LocalAnswers {
    /// Shared with the subscription's handler, which forgets what a notice names.
    kept: Arc<Kept>,
    pub(super) max_keys: usize,
    /// Answers given.
    pub(super) answered: crate::stats::Counter,
    /// The subscription to the rate-limit channel, made by the first check that may be
    /// answered locally.
    resets: OnceLock<Subscription>,
}

/// The denials kept, each until it ends (the table's expiry); a read never sees an ended one.
struct Kept {
    entries: TtlTable<String, Denied>,
    /// Bumped by every invalidation: a denial sent before one is not kept (its notice may
    /// have arrived before its reply).
    epoch: AtomicU64,
    /// Notices that overrides changed somewhere (see `Redis::overrides_version`).
    override_notices: AtomicU64,
}

impl Kept {
    fn forget(&self, key: &str) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        self.entries.remove(key);
    }
}

/// A message on the rate-limit channel names a key (as stored) whose limits changed or
/// that was reset elsewhere: its denial no longer holds. One naming a namespace's overrides
/// (see `overrides.rs`) says they changed: limiters read them again.
impl Subscriber for Kept {
    fn message(&self, payload: &[u8]) {
        if payload.ends_with(super::overrides::SUFFIX.as_bytes()) {
            self.override_notices.fetch_add(1, Ordering::SeqCst);
            return;
        }
        self.forget(&String::from_utf8_lossy(payload));
    }
}

impl LocalAnswers {
    pub(super) fn new(max_keys: usize) -> Self {
        Self {
            kept: Arc::new(Kept {
                entries: TtlTable::new(Arc::new(Counters::new())),
                epoch: AtomicU64::new(0),
                override_notices: AtomicU64::new(0),
            }),
            max_keys,
            answered: crate::stats::Counter::default(),
            resets: OnceLock::new(),
        }
    }

    /// The number of the subscription that hears resets now, if it does: what a kept
    /// denial holds on to, since a notice sent while nobody listened is lost. The first
    /// call subscribes; while none is live, the listener is started (again) here.
    pub(super) fn live_subscription(&self, redis: &Redis) -> Option<u64> {
        let resets = self.resets.get_or_init(|| {
            let subscriber: Weak<dyn Subscriber> = Arc::downgrade(&self.kept) as Weak<_>;
            redis.subscribe(redis.rate_limit_channel(), subscriber)
        });
        let live = resets.live();
        if live.is_none() {
            resets.listen();
        }
        live
    }

    /// [`LocalAnswers::live_subscription`] without subscribing.
    pub(super) fn subscription_live(&self) -> Option<u64> {
        self.resets.get().and_then(Subscription::live)
    }

    /// Notices that overrides changed, heard so far.
    pub(super) fn override_notices(&self) -> u64 {
        self.kept.override_notices.load(Ordering::SeqCst)
    }

    /// Answers given so far.
    pub(super) fn answered(&self) -> u64 {
        self.answered.get()
    }

    /// Keys answered locally now (ended ones not yet dropped included).
    pub(super) fn len(&self) -> usize {
        self.kept.entries.len()
    }

    /// What to note when sending `args`, if its denial may be kept.
    pub(super) fn ticket(&self, args: &Args, subscription: Option<u64>) -> Option<Ticket> {
        (self.max_keys > 0 && matches!(args.op, "c" | "r")).then(|| Ticket {
            sent: Instant::now(),
            epoch: self.kept.epoch.load(Ordering::SeqCst),
            subscription,
        })
    }

    /// The local answer to `operation`, if a denial covers it.
    ///
    /// The entry is found first and the clock read after: a denial a concurrent
    /// [`LocalAnswers::remember`] keeps was stamped with a reading taken before it was
    /// inserted, so a reading taken once it is seen is never earlier, and the countdown never
    /// says more than the server's own retry-after (a reading taken before the lookup could
    /// precede the insertion: the answer then said later than the server would).
    pub(super) fn answer(
        &self,
        operation: &Operation,
        subscription: Option<u64>,
    ) -> Option<RateLimitReply> {
        let subscription = subscription?;
        let entries = &self.kept.entries;
        let args = &operation.args;
        let found = entries.read_at(&*operation.key, Instant::now(), |entry| {
            if entry.subscription != subscription {
                return Err(());
            }
            if args.cost < entry.cost
                || *entry.kinds != *args.kinds
                || *entry.numbers != *args.numbers
            {
                return Ok(None);
            }
            Ok(Some((entry.admit_at, entry.until, entry.decision)))
        })?;
        let Ok(covering) = found else {
            // Kept under a subscription since lost: a notice may have been missed. A newer
            // denial kept meanwhile may go with it, which only costs a round trip.
            entries.remove(&*operation.key);
            return None;
        };
        let (admit_at, until, decision) = covering?;
        let now = answer_clock();
        if now >= until {
            // Ended between the lookup and the reading: the server decides.
            return None;
        }
        // Rounded up, as the server rounds: waiting it suffices.
        let left = admit_at.saturating_duration_since(now);
        let retry_after_ms = u64::try_from(left.as_micros().div_ceil(1_000))
            .unwrap_or(u64::MAX)
            .max(1);
        let reply = match (args.op, decision) {
            ("c", Some((limit, remaining, reset_at_ms))) => RateLimitReply::Decision(Decision {
                allowed: false,
                limit,
                remaining,
                reset_at_ms,
                retry_after_ms,
            }),
            ("r", _) => {
                RateLimitReply::Reservation(ShaperReservation::QueueFull { retry_after_ms })
            }
            _ => return None,
        };
        self.answered.incr();
        Some(reply)
    }

    /// Keeps the denial `reply` to `operation` if it is sound to answer locally: sent while a
    /// subscription was live that is still the live one, no invalidation since, and more
    /// than a millisecond to wait.
    pub(super) fn remember(
        &self,
        operation: &Operation,
        reply: &RateLimitReply,
        live: Option<u64>,
    ) {
        let Some(ticket) = operation.ticket else {
            return;
        };
        let (retry_after_ms, decision) = match *reply {
            RateLimitReply::Decision(d) if !d.allowed => (
                d.retry_after_ms,
                Some((d.limit, d.remaining, d.reset_at_ms)),
            ),
            RateLimitReply::Reservation(ShaperReservation::QueueFull { retry_after_ms }) => {
                (retry_after_ms, None)
            }
            _ => return,
        };
        let Some(subscription) = ticket.subscription.filter(|s| live == Some(*s)) else {
            return;
        };
        // The server decided at or after `sent`, and its T is more than `retry - 1` ms after
        // that (the retry-after is rounded up); the reply came at `now`, at or after it, so T
        // is at most `retry` ms after `now`.
        let now = Instant::now();
        let until = ticket.sent + Duration::from_millis(retry_after_ms.saturating_sub(1));
        if until <= now {
            return;
        }
        let admit_at = now + Duration::from_millis(retry_after_ms);
        let Kept { entries, epoch, .. } = &*self.kept;
        // A full table drops the ended denials, then keeps no new one: the server answers it.
        if entries.len() >= self.max_keys && entries.sweep(now) >= self.max_keys {
            return;
        }
        let args = &operation.args;
        let denied = Denied {
            kinds: args.kinds.as_str().into(),
            numbers: args.numbers.as_slice().into(),
            cost: args.cost,
            admit_at,
            until,
            decision,
            subscription,
        };
        // Under the key's shard lock: an invalidation bumps the epoch before it removes the
        // key, so either this sees the bump, or the removal comes after this insertion.
        entries.upsert_at(operation.key.clone(), now, |held| {
            if epoch.load(Ordering::SeqCst) != ticket.epoch {
                return (None, ());
            }
            // A live denial of a smaller cost with the same limit answers more checks: kept.
            let covers_more = held.is_some_and(|kept| {
                kept.cost < denied.cost
                    && kept.subscription == subscription
                    && kept.kinds == denied.kinds
                    && kept.numbers == denied.numbers
            });
            (
                (!covers_more).then(|| (denied, until.saturating_duration_since(now))),
                (),
            )
        });
    }

    /// Forgets the local answer of `key` (a stored key name), and stops keeping denials sent
    /// before now.
    pub(super) fn forget(&self, key: &str) {
        self.kept.forget(key);
    }
}

/// The clock a local answer counts down on, read once its denial is found. Unit tests hook it,
/// to act right after the reading.
fn answer_clock() -> Instant {
    let now = Instant::now();
    #[cfg(test)]
    super::tests::clock_hook::run();
    now
}

impl Redis {
    /// The channel where resets and overrides of rate-limited keys are announced, for the
    /// instances that answer their denials locally.
    pub(crate) fn rate_limit_channel(&self) -> String {
        format!("{}:rate-limit", self.prefix())
    }

    /// Forgets the local answers of `key` (a limiter's store key) here, and has every other
    /// instance forget theirs: its limits changed (an override set or removed).
    pub(super) fn limits_changed(&self, key: &str) {
        let key = self.key(key, ":r");
        let batcher = self.batcher();
        let local = &batcher.local;
        if local.max_keys == 0 {
            return;
        }
        local.forget(&key);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::debug!(
                key,
                "no tokio runtime to announce a changed limit: other instances forget their local answers at their T"
            );
            return;
        };
        let redis = self.clone();
        runtime.spawn(async move {
            let mut publish = redis::cmd("PUBLISH");
            publish.arg(redis.rate_limit_channel()).arg(&key);
            if let Err(error) = redis.query::<i64>(&publish).await {
                tracing::debug!(key, %error, "announcing a changed limit failed");
            }
        });
    }
}
