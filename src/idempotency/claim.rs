//! The ledger: which keys are in flight, who holds each, and the claim
//! protocol that keeps one execution per key.
//!
//! Claiming, joining, taking over, completing and releasing are each one
//! synchronous registry update; nothing awaits under a shard lock. The
//! order that makes it race-free:
//!
//! - claim: look the result up, claim the slot, look the result up again
//!   (a completion may have landed between the two). With the in-memory
//!   table, the first look is the replay fast path every run takes before
//!   it claims; the claim itself only looks after joining;
//! - complete: fence (mark the claim completing if it is still ours), store
//!   the result, compare-and-remove the slot, then wake the waiters;
//! - renew: push the lease out if the claim is still ours. The holder renews
//!   every third of its lease while it is alive, so only a gone holder's
//!   lease lapses, and only then may another caller take the key over.
//!
//! With a shared store, an owner whose function ran never gives its result
//! up to a store outage shorter than its lease (SCENARIOS S14): it renews
//! (sooner after a failure) while the function runs and retries the
//! completion until it is stored or the claim has certainly lapsed in the
//! store ([`Lapse`]). Those calls are never refused by an open circuit
//! breaker: they are probes themselves.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde::de::DeserializeOwned;
use throttlebeam_supervisors::{Counters, Generation, Registry, SlotEntry};
use tokio::time::Instant;

use super::full_key::{with_full_key, with_full_key_bytes};
use super::options::{Fingerprint, IdempotencyOptions};
use super::seam::{ClaimReply, ClaimRequest, ClaimToken, IdempotencyStore, KeyChanged};
use super::store::{Record, ResultTable};
#[cfg(feature = "http")]
use super::{Claimed, Looked};
use super::{Fence, NotRecorded};
use crate::cell::RunCell;
use crate::error::{BoxError, Error, with_causes};
use crate::key::{InlineKey, shown};
use crate::log_every::LogEvery;
use crate::store::{Fault, guard, store_call};

mod ticket;

#[cfg(feature = "http")]
pub(crate) use self::ticket::CompletedNow;
pub(crate) use self::ticket::{Lapse, Renewer, Ticket, Unrecorded};
use self::ticket::{MAX_POLL, may_have_landed, renew_period};

/// How a claim ended, as its waiters see it.
#[derive(Debug, Clone)]
pub(crate) enum Settled {
    /// Completed: replay this.
    Done(Record),
    /// Released, failed, taken over or shut down: look again.
    Released,
}

/// A key in flight: one registry slot, no process of its own.
struct Claim {
    /// Unique per holder; taking a key over issues a new one (fencing).
    token: ClaimToken,
    fingerprint: Option<Fingerprint>,
    lease_until: Instant,
    /// Set once the holder is storing its result; no takeover after that.
    completing: bool,
    /// Where the claim's end is told, made by the first caller that waits for it: a claim
    /// nobody waits for (most) costs no cell.
    cell: Option<Arc<RunCell<Settled>>>,
}

/// What one look at a key found.
pub(crate) enum Step<T> {
    /// A completed result.
    Replay(T),
    /// This caller now holds the key.
    Owner(Ticket),
    /// Another caller holds it: wait on `cell`, but no longer than
    /// `lease_until` (none once the holder is completing).
    Wait {
        cell: Arc<RunCell<Settled>>,
        lease_until: Option<Instant>,
    },
    /// This caller holds the key on this instance, but another instance
    /// holds it in the shared store for `lease_left` still: wait for it
    /// with [`Ledger::wait_remote`] (local duplicates wait on this caller).
    Remote {
        ticket: Ticket,
        lease_left: Duration,
    },
}

/// What the registry update decided: claimed (taking over a lapsed holder,
/// whose waiters must be woken) or wait.
enum Joined<T> {
    /// The claim's generation, its key as the registry stored it (shared with the ticket),
    /// and the lapsed claim this one took over, if any.
    Claimed(Generation, InlineKey, Option<Superseded>),
    Wait(Step<T>),
}

/// A lapsed claim taken over: the cell its waiters wait on, if any.
struct Superseded(Option<Arc<RunCell<Settled>>>);

/// Counters of what the ledger decided, for [`crate::idempotency::IdempotencyStats`].
#[derive(Debug, Default)]
pub(crate) struct Tally {
    pub(crate) fresh: AtomicU64,
    pub(crate) replays: AtomicU64,
    pub(crate) fingerprint_mismatches: AtomicU64,
    pub(crate) takeovers: AtomicU64,
    pub(crate) in_flight_rejections: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) failures_after_caller_left: AtomicU64,
}

impl Tally {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Keys in flight plus the store of completed results.
pub(crate) struct Ledger {
    claims: Registry<InlineKey, Claim>,
    pub(crate) store: ResultTable,
    /// The store shared with other instances, if any: claims go there
    /// too, and results live there instead of in `store`.
    shared: Option<Arc<dyn IdempotencyStore>>,
    pub(crate) tally: Tally,
    /// Lines logged for many calls at once, at most once per interval each.
    pub(crate) logs: Logs,
    /// The fencing counter of claims made without a shared store.
    fences: AtomicU64,
    cap: usize,
    closed: AtomicBool,
}

impl Ledger {
    pub(crate) fn new(
        counters: Arc<Counters>,
        cap: usize,
        store: ResultTable,
        shared: Option<Arc<dyn IdempotencyStore>>,
    ) -> Self {
        let logs = Logs::new(shared.as_deref().map_or("memory", |s| s.name()));
        Self {
            claims: Registry::new(counters, cap),
            store,
            shared,
            tally: Tally::default(),
            logs,
            fences: AtomicU64::new(0),
            cap,
            closed: AtomicBool::new(false),
        }
    }

    /// Replays a completed key at once from the runtime's table (not with a shared store):
    /// no claim, no future, one map read.
    pub(crate) fn try_replay<T>(
        &self,
        key: &str,
        options: &IdempotencyOptions,
    ) -> Option<Result<T, Error>>
    where
        T: DeserializeOwned + Clone + 'static,
    {
        if self.shared.is_some() {
            return None;
        }
        with_full_key_bytes(options.scope(), key, |full| {
            self.store.read(full, |record| {
                self.replay(record, key, options.fingerprint().as_ref())
            })
        })
    }

    /// What a look finds at once, with the full key built once: the stored result (the
    /// replay fast path), else the key claimed if it is free, when it still has no result
    /// once claimed (a completion may land between the read and the claim). `None` when only
    /// [`Ledger::attempt`] can tell: the key is in flight (wait for it, or reject), or the
    /// store answers later (a shared store).
    ///
    /// `fingerprint` stands for the fingerprint of `options`: a caller whose options are
    /// shared by every request keeps each request's apart.
    #[cfg(feature = "http")]
    pub(crate) fn look_now<T>(
        self: &Arc<Self>,
        key: &str,
        options: &IdempotencyOptions,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Option<Looked<T>>, Error>
    where
        T: DeserializeOwned + Clone + 'static,
    {
        if self.shared.is_some() {
            return Ok(None);
        }
        with_full_key_bytes(options.scope(), key, |full| {
            match self.read_now::<T>(full, key, fingerprint.as_ref()) {
                Some(found) => found.map(|value| Some(Looked::Replay(value))),
                None => self.claim_now(full, key, options, fingerprint),
            }
        })
    }

    /// [`Ledger::look_now`] past a read that found nothing: claims the key if it is free.
    /// Out of line, so the replay path's frame stays small.
    #[cfg(feature = "http")]
    #[inline(never)]
    fn claim_now<T>(
        self: &Arc<Self>,
        full: &[u8],
        key: &str,
        options: &IdempotencyOptions,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Option<Looked<T>>, Error>
    where
        T: DeserializeOwned + Clone + 'static,
    {
        let ticket = match self.join::<T>(full, key, options, fingerprint, Instant::now())? {
            Step::Owner(ticket) => ticket,
            _ => return Ok(None),
        };
        // An early return drops the ticket, which releases the key.
        if let Some(found) = self.read_now::<T>(full, key, ticket.fingerprint.as_ref()) {
            return found.map(|value| Some(Looked::Replay(value)));
        }
        Tally::bump(&self.tally.fresh);
        Ok(Some(Looked::Owner(Claimed(ticket))))
    }

    /// The stored result of `full` for `key`'s caller, read at once from the table.
    #[cfg(feature = "http")]
    fn read_now<T>(
        &self,
        full: &[u8],
        key: &str,
        fingerprint: Option<&Fingerprint>,
    ) -> Option<Result<T, Error>>
    where
        T: DeserializeOwned + Clone + 'static,
    {
        self.store
            .read(full, |record| self.replay(record, key, fingerprint))
    }

    /// One look at the key: replay it, claim it, or wait for its holder.
    /// A shared store's claim is bounded by the caller's `deadline` (and the
    /// lease): a hanging store never holds a caller past its wait.
    pub(crate) async fn attempt<T>(
        self: &Arc<Self>,
        key: &str,
        options: &IdempotencyOptions,
        now: Instant,
        deadline: Instant,
    ) -> Result<Step<T>, Error>
    where
        T: DeserializeOwned + Clone + 'static,
    {
        if let Some(shared) = &self.shared {
            let ticket = match with_full_key(options.scope(), key, |full| {
                self.join(full.as_bytes(), key, options, options.fingerprint(), now)
            })? {
                Step::Owner(ticket) => ticket,
                other => return Ok(other),
            };
            // Boxed: this path's future would otherwise size every run's future.
            let bound = store_bound(ticket.lease, now, deadline);
            return Box::pin(self.claim_shared(shared.as_ref(), ticket, key, bound)).await;
        }
        // The table was read by the replay fast path every run takes first (and a caller
        // back from waiting has the look after the claim below).
        // The full key on the stack: a claim needs it only as bytes.
        let ticket = match with_full_key_bytes(options.scope(), key, |full| {
            self.join(full, key, options, options.fingerprint(), now)
        })? {
            Step::Owner(ticket) => ticket,
            other => return Ok(other),
        };
        // An early return from here drops the ticket, which releases the key.
        match self.store.get(&ticket.full, now) {
            Some(record) => self
                .replay(&record, key, options.fingerprint().as_ref())
                .map(Step::Replay),
            None => Ok(Step::Owner(ticket)),
        }
    }

    /// Claims the key this caller holds locally in the shared store: one
    /// round trip that wins it, finds its result, or finds it held elsewhere,
    /// through the store guard (no longer than `bound`; a panic is an error).
    async fn claim_shared<T>(
        &self,
        shared: &dyn IdempotencyStore,
        mut ticket: Ticket,
        key: &str,
        bound: Duration,
    ) -> Result<Step<T>, Error>
    where
        T: DeserializeOwned + Clone + 'static,
    {
        let request = ClaimRequest::new(
            ticket.token,
            ticket.fingerprint.as_ref(),
            ticket.lease,
            ticket.ttl,
        );
        let full = ticket.full.as_str();
        let sent = store_call(bound, || shared.claim(full, request));
        ticket.unanswered = true;
        let reply = sent.await;
        // An early return (or this future dropped) drops the ticket, which
        // releases the local claim, and the shared one if it may be there.
        ticket.unanswered = reply.as_ref().is_err_and(may_have_landed);
        let reply = reply.map_err(|e| self.logs.failing_closed(key, Arc::new(e)))?;
        match reply {
            ClaimReply::Won { fence } => {
                ticket.fence = Fence::new(fence);
                // The store started the lease no later than its reply.
                ticket.lapse = Some(Lapse::new(Instant::now() + ticket.lease));
                Ok(Step::Owner(ticket))
            }
            ClaimReply::Busy { lease_left } => Ok(Step::Remote { ticket, lease_left }),
            ClaimReply::Completed(result) => {
                let record = Record::from_stored(result);
                let value = self.replay(&record, key, ticket.fingerprint.as_ref());
                // Local duplicates replay the same record.
                ticket.settle(record);
                value.map(Step::Replay)
            }
            ClaimReply::Mismatch => {
                Tally::bump(&self.tally.fingerprint_mismatches);
                Err(Error::FingerprintMismatch { key: shown(key) })
            }
        }
    }

    /// Waits for another instance's claim on the key this caller holds
    /// locally: on every change the store announces (or every poll), claims
    /// again, until it wins, replays, or `deadline` passes.
    pub(crate) async fn wait_remote<T>(
        &self,
        ticket: Ticket,
        key: &str,
        mut lease_left: Duration,
        deadline: Instant,
        wait_timeout: Duration,
    ) -> Result<Step<T>, Error>
    where
        T: DeserializeOwned + Clone + 'static,
    {
        let Some(shared) = self.shared.as_deref() else {
            return Ok(Step::Owner(ticket));
        };
        let mut ticket = ticket;
        let mut changed = None;
        loop {
            if let Some(changed) = changed.take() {
                let now = Instant::now();
                if now >= deadline {
                    Tally::bump(&self.tally.timeouts);
                    return Err(Error::Timeout {
                        key: shown(key),
                        after: wait_timeout,
                    });
                }
                // Woken at least every third of this instance's own lease, so
                // the local claim this caller holds is renewed in time: a
                // caller waiting for another instance is alive, and local
                // duplicates must keep joining it, not take it over.
                let wait = (lease_left + Duration::from_millis(1))
                    .min(MAX_POLL)
                    .min(renew_period(ticket.lease));
                // Fired or timed out: look again. A wake-up that panicked
                // says nothing: wait out the poll instead.
                let until = (now + wait).min(deadline);
                if let Err(Fault::Panicked(panic)) = guard(until - now, || changed).await {
                    tracing::warn!(key, %panic, "idempotency store wake-up panicked; polling");
                    tokio::time::sleep_until(until).await;
                }
                if until >= deadline && Instant::now() >= deadline {
                    // Waited out: a last claim now would have no time left
                    // to answer in (and fail as a store error).
                    Tally::bump(&self.tally.timeouts);
                    return Err(Error::Timeout {
                        key: shown(key),
                        after: wait_timeout,
                    });
                }
            }
            if self.is_closed() {
                return Err(Error::ShutDown { key: shown(key) });
            }
            if !self.renew(
                ticket.full.as_str(),
                ticket.generation,
                ticket.token,
                ticket.lease,
            ) {
                // The local claim is gone (the runtime was reset): start over.
                return Err(Error::Discarded {
                    key: shown(key),
                    reason: "its local claim was lost while waiting for another instance",
                });
            }
            // Registered before the claim, so a change right after it wakes us.
            changed = Some(watch(shared, ticket.full.as_str()));
            let bound = store_bound(ticket.lease, Instant::now(), deadline);
            match self.claim_shared(shared, ticket, key, bound).await? {
                Step::Remote {
                    ticket: again,
                    lease_left: left,
                } => {
                    ticket = again;
                    lease_left = left;
                }
                other => return Ok(other),
            }
        }
    }

    /// Claims a free or lapsed key, or joins the live claim on it, for a caller whose
    /// request has `fingerprint` (and the other settings of `options`).
    fn join<T>(
        self: &Arc<Self>,
        full: &[u8],
        key: &str,
        options: &IdempotencyOptions,
        fingerprint: Option<Fingerprint>,
        now: Instant,
    ) -> Result<Step<T>, Error> {
        let token = ClaimToken::new();
        let fresh = Claim {
            token,
            fingerprint,
            lease_until: now + options.lease(),
            completing: false,
            cell: None,
        };
        let joined = self.claims.update_with(
            full,
            || InlineKey::from_bytes(full),
            |slot| match slot {
                SlotEntry::Occupied(slot) => {
                    let generation = slot.generation();
                    let claim = &mut slot.state;
                    if claim.completing || claim.lease_until > now {
                        if claim.fingerprint != fingerprint {
                            Tally::bump(&self.tally.fingerprint_mismatches);
                            return Err(Error::FingerprintMismatch { key: shown(key) });
                        }
                        let cell = claim.cell.get_or_insert_with(|| self.new_cell());
                        return Ok(Joined::Wait(Step::Wait {
                            cell: Arc::clone(cell),
                            lease_until: (!claim.completing).then_some(claim.lease_until),
                        }));
                    }
                    // The lease lapsed: a live holder renews it, so the holder is gone.
                    let old = std::mem::replace(claim, fresh);
                    Ok(Joined::Claimed(
                        generation,
                        InlineKey::from_bytes(full),
                        Some(Superseded(old.cell)),
                    ))
                }
                SlotEntry::Vacant(vacant) => {
                    let stored = vacant.key().clone();
                    match vacant.insert(fresh) {
                        Ok(slot) => Ok(Joined::Claimed(slot.generation(), stored, None)),
                        Err(_) => Err(Error::TooManyKeys {
                            key: shown(key),
                            cap: self.cap,
                        }),
                    }
                }
            },
        )?;
        let (generation, stored, superseded) = match joined {
            Joined::Claimed(generation, stored, superseded) => (generation, stored, superseded),
            Joined::Wait(wait) => return Ok(wait),
        };
        if let Some(Superseded(old)) = superseded {
            Tally::bump(&self.tally.takeovers);
            tracing::debug!(key = %shown(key), "idempotency lease lapsed; key taken over");
            // Wakes the old holder's waiters; they will find the new claim.
            if let Some(old) = old {
                old.set(Ok(Settled::Released));
            }
        }
        Ok(Step::Owner(Ticket {
            ledger: Arc::clone(self),
            full: stored,
            // Checked: at most 1024 bytes.
            key_len: u16::try_from(key.len()).unwrap_or(u16::MAX),
            generation,
            token,
            fingerprint,
            ttl: options.ttl(),
            lease: options.lease(),
            claimed_at: now,
            held: true,
            // Without a shared store the ledger's counter fences; a shared store's claim
            // replaces it with the store's.
            fence: Fence::new(self.fences.fetch_add(1, Ordering::Relaxed) + 1),
            lapse: None,
            unanswered: false,
            ran: false,
        }))
    }

    /// The cell a claim's first waiter makes; after shutdown it is told at once (the
    /// shutdown's pass over the claims has gone by, or will tell it).
    fn new_cell(&self) -> Arc<RunCell<Settled>> {
        let cell = RunCell::new();
        if self.is_closed() {
            cell.set(Ok(Settled::Released));
        }
        cell
    }

    /// Pushes the lease of the claim `(generation, token)` on `full` out to
    /// `lease` from now. `false` once the claim is no longer that holder's
    /// to renew (completing, completed, released or taken over): renewing
    /// can stop.
    fn renew(
        &self,
        full: &str,
        generation: Generation,
        token: ClaimToken,
        lease: Duration,
    ) -> bool {
        self.claims
            .with_slot(full.as_bytes(), |slot| {
                let ours = slot.generation() == generation && slot.state.token == token;
                if ours && !slot.state.completing {
                    slot.state.lease_until = Instant::now() + lease;
                }
                // A completing claim needs no renewal: its completion decides.
                ours && !slot.state.completing
            })
            .unwrap_or(false)
    }

    /// The record's value for this caller, if the fingerprints agree;
    /// counts the replay or the mismatch.
    pub(crate) fn replay<T>(
        &self,
        record: &Record,
        key: &str,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<T, Error>
    where
        T: DeserializeOwned + Clone + 'static,
    {
        if record.fingerprint() != fingerprint {
            Tally::bump(&self.tally.fingerprint_mismatches);
            return Err(Error::FingerprintMismatch { key: shown(key) });
        }
        let value = record.value(key)?;
        Tally::bump(&self.tally.replays);
        Ok(value)
    }

    /// Stops storing results, wakes every waiter (they see the shutdown
    /// when they look again) and drops the results this instance holds.
    pub(crate) fn shutdown(&self) {
        self.closed.store(true, Ordering::Release);
        let mut cells = Vec::new();
        self.claims.retain(|_, claim| {
            cells.extend(claim.cell.clone());
            true
        });
        for cell in cells {
            cell.set(Ok(Settled::Released));
        }
        self.store.close();
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

/// How long one shared-store call of a caller may take: no longer than the
/// caller waits (until `deadline`), nor than the lease it is about; at
/// least 1 ms.
fn store_bound(lease: Duration, now: Instant, deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(now)
        .min(lease)
        .max(Duration::from_millis(1))
}

/// The store's wake-up for `key`; a store that panics making one gives
/// none (the caller polls).
fn watch(shared: &dyn IdempotencyStore, key: &str) -> KeyChanged {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| shared.watch(key))).unwrap_or_else(
        |_| {
            tracing::warn!(key, "idempotency store panicked in watch; polling instead");
            KeyChanged::never()
        },
    )
}

/// How often a line that many calls would log goes out, with a count of the others: one line
/// per breaker cooldown (by default) and cause, not one per call.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// The ledger's log lines that many calls share.
pub(crate) struct Logs {
    /// What kind of shared store the ledger has ("memory" without one).
    store: &'static str,
    failing_closed: LogEvery,
    unrecorded: LogEvery,
}

impl Logs {
    fn new(store: &'static str) -> Self {
        Self {
            store,
            failing_closed: LogEvery::new(LOG_EVERY),
            unrecorded: LogEvery::new(LOG_EVERY),
        }
    }

    /// The error of a store that failed `key`'s caller before anything ran (idempotency fails
    /// closed), logged at warn with its causes at most once per [`LOG_EVERY`].
    pub(crate) fn failing_closed(&self, key: &str, source: BoxError) -> Error {
        if tracing::enabled!(tracing::Level::WARN)
            && let Some(held_back) = self.failing_closed.due()
        {
            let error = with_causes(&*source);
            tracing::warn!(
                store = self.store,
                key = %shown(key),
                %error,
                held_back,
                "idempotency store unavailable; failing closed (nothing ran): one line per \
                 {LOG_EVERY:?}, held_back counts the calls since the last"
            );
        }
        Error::StoreUnavailable {
            key: shown(key),
            source,
        }
    }

    /// Logs a result that ran but was not recorded (`cause`: the store's last error), at most
    /// once per [`LOG_EVERY`]: at error when the store is why (a retry after the lease may run
    /// the operation again), at warn for a claim taken over.
    pub(crate) fn unrecorded(
        &self,
        key: &str,
        why: NotRecorded,
        cause: Option<&(dyn std::error::Error + Send + Sync)>,
    ) {
        let Some(held_back) = self.unrecorded.due() else {
            return;
        };
        let error = cause.map(|e| with_causes(e)).unwrap_or_default();
        if why == NotRecorded::LeaseLost {
            tracing::warn!(
                store = self.store,
                key,
                %why,
                held_back,
                "idempotency result not recorded: this holder's lease lapsed in the store while it \
                 ran (cut off or paused past its lease); the key is another holder's"
            );
        } else {
            tracing::error!(
                store = self.store,
                key,
                %why,
                %error,
                held_back,
                "idempotency result not recorded: the store did not take it before the claim \
                 lapsed there; its key was not released, but a retry after the lease may run the \
                 operation again"
            );
        }
    }
}
