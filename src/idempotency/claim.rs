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

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use throttlebeam_supervisors::{Counters, Generation, Registry, SlotEntry};
use tokio::time::Instant;

use super::options::{Fingerprint, IdempotencyOptions};
use super::seam::{
    ClaimReply, ClaimRequest, ClaimToken, IdempotencyStore, KeyChanged, StoredResult,
};
use super::store::{Form, Pending, Record, ResultStore, stored_result};
use crate::cell::RunCell;
use crate::error::{BoxError, Error};
use crate::key::{InlineKey, shown, update_slot};
use crate::store::{Fault, StoreError, guard, store_call};

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
    cell: Arc<RunCell<Settled>>,
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
    /// and the cell of a holder whose lapsed claim this one took over.
    Claimed(Generation, InlineKey, Option<Arc<RunCell<Settled>>>),
    Wait(Step<T>),
}

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
    pub(crate) store: Box<dyn ResultStore>,
    /// The store shared with other instances, if any: claims go there
    /// too, and results live there instead of in `store`.
    shared: Option<Arc<dyn IdempotencyStore>>,
    pub(crate) tally: Tally,
    cap: usize,
    closed: AtomicBool,
}

impl Ledger {
    pub(crate) fn new(
        counters: Arc<Counters>,
        cap: usize,
        store: Box<dyn ResultStore>,
        shared: Option<Arc<dyn IdempotencyStore>>,
    ) -> Self {
        Self {
            claims: Registry::new(counters, cap),
            store,
            shared,
            tally: Tally::default(),
            cap,
            closed: AtomicBool::new(false),
        }
    }

    /// Replays a completed key at once when the store can answer without a
    /// round trip: no claim, no future, one map read.
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
        super::full_key::with_full_key_bytes(options.scope(), key, |full| {
            let mut out = None;
            self.store.read_now(full, &mut |record| {
                out = Some(self.replay(record, key, options.fingerprint().as_ref()));
            });
            out
        })
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
                self.join(full, key, options, now)
            })? {
                Step::Owner(ticket) => ticket,
                other => return Ok(other),
            };
            // Boxed: this path's future would otherwise size every run's future.
            let bound = store_bound(ticket.lease, now, deadline);
            return Box::pin(self.claim_shared(shared.as_ref(), ticket, key, bound)).await;
        }
        // A store that answers at once was read by the replay fast path every run takes
        // first (and a caller back from waiting has the look after the claim below): look
        // before claiming only in a store that answers later.
        let now = if self.store.answers_at_once() {
            now
        } else {
            let lookup = with_full_key(options.scope(), key, |full| self.store.get(full, now));
            let round_trip = matches!(lookup, Pending::Later(_));
            let found = lookup.resolve().await.map_err(|e| unavailable(key, e))?;
            if let Some(record) = found {
                return self
                    .replay(&record, key, options.fingerprint().as_ref())
                    .map(Step::Replay);
            }
            // A round trip took time: claim with a fresh clock.
            if round_trip { Instant::now() } else { now }
        };
        let ticket = match with_full_key(options.scope(), key, |full| {
            self.join(full, key, options, now)
        })? {
            Step::Owner(ticket) => ticket,
            other => return Ok(other),
        };
        // An early return from here drops the ticket, which releases the key.
        let found = self
            .store
            .get(ticket.full.as_str(), now)
            .resolve()
            .await
            .map_err(|e| unavailable(key, e))?;
        match found {
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
        let reply = reply.map_err(|e| unavailable(key, Arc::new(e)))?;
        match reply {
            ClaimReply::Won { fence } => {
                ticket.fence = Some(fence);
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

    /// Claims a free or lapsed key, or joins the live claim on it.
    fn join<T>(
        self: &Arc<Self>,
        full: &str,
        key: &str,
        options: &IdempotencyOptions,
        now: Instant,
    ) -> Result<Step<T>, Error> {
        let fingerprint = options.fingerprint();
        let token = ClaimToken::new();
        let cell = RunCell::new();
        let fresh = Claim {
            token,
            fingerprint,
            lease_until: now + options.lease(),
            completing: false,
            cell: Arc::clone(&cell),
        };
        let joined = update_slot(&self.claims, full, |slot| match slot {
            SlotEntry::Occupied(slot) => {
                let generation = slot.generation();
                let claim = &mut slot.state;
                if claim.completing || claim.lease_until > now {
                    if claim.fingerprint != fingerprint {
                        Tally::bump(&self.tally.fingerprint_mismatches);
                        return Err(Error::FingerprintMismatch { key: shown(key) });
                    }
                    return Ok(Joined::Wait(Step::Wait {
                        cell: Arc::clone(&claim.cell),
                        lease_until: (!claim.completing).then_some(claim.lease_until),
                    }));
                }
                // The lease lapsed: a live holder renews it, so the holder is gone.
                let old = std::mem::replace(claim, fresh);
                Ok(Joined::Claimed(
                    generation,
                    InlineKey::new(full),
                    Some(old.cell),
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
        })?;
        let (generation, stored, superseded) = match joined {
            Joined::Claimed(generation, stored, superseded) => (generation, stored, superseded),
            Joined::Wait(wait) => return Ok(wait),
        };
        if let Some(old) = superseded {
            Tally::bump(&self.tally.takeovers);
            tracing::debug!(key = %shown(key), "idempotency lease lapsed; key taken over");
            // Wakes the old holder's waiters; they will find the new claim.
            old.set(Ok(Settled::Released));
        }
        Ok(Step::Owner(Ticket {
            ledger: Arc::clone(self),
            full: stored,
            key: shown(key).into(),
            generation,
            token,
            fingerprint,
            ttl: options.ttl(),
            lease: options.lease(),
            claimed_at: now,
            cell,
            held: true,
            fence: None,
            lapse: None,
            unanswered: false,
        }))
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
            cells.push(Arc::clone(&claim.cell));
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

/// The right to complete or release one claim; releases it when dropped.
///
/// Held by the per-key process of a run, or inside a [`super::IdempotencyReservation`].
pub(crate) struct Ticket {
    ledger: Arc<Ledger>,
    /// The scoped key the ledger knows (the claim's own, shared).
    full: InlineKey,
    /// The caller's key, shortened for errors.
    key: Box<str>,
    generation: Generation,
    token: ClaimToken,
    fingerprint: Option<Fingerprint>,
    ttl: Duration,
    lease: Duration,
    /// When the claim was made: its lease runs from here.
    claimed_at: Instant,
    cell: Arc<RunCell<Settled>>,
    held: bool,
    /// The fencing counter of the claim won in the shared store, if any.
    fence: Option<u64>,
    /// A claim of this ticket's went to the shared store and may have
    /// landed there, but no answer came back (its caller left, or the call
    /// failed after it was sent): released there too when the ticket is,
    /// so it does not hold the key for a whole lease with nobody behind it.
    unanswered: bool,
    /// When that claim has certainly lapsed in the shared store.
    lapse: Option<Arc<Lapse>>,
}

/// When a claim in the shared store has certainly lapsed, as its holder can
/// know it: every claim or renewal that may have reached the store pushes it
/// to the instant that call ended plus the lease (the store started the
/// lease no later than that). Measured after the call, not before it was
/// sent: this bound decides when the holder may stop trying, so it must not
/// be early. (A command the network or a frozen server holds past its
/// timeout can still extend the lease later; no client can know that.)
#[derive(Debug)]
pub(crate) struct Lapse(std::sync::Mutex<Instant>);

impl Lapse {
    fn new(at: Instant) -> Arc<Self> {
        Arc::new(Self(std::sync::Mutex::new(at)))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Instant> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The claim holds until `at` at least.
    fn push(&self, at: Instant) {
        let mut lapse = self.lock();
        *lapse = (*lapse).max(at);
    }

    /// When the claim has certainly lapsed.
    fn at(&self) -> Instant {
        *self.lock()
    }
}

/// Whether a failed call may still have reached the store (and done its
/// work there): anything but a refusal made before sending it.
fn may_have_landed(error: &StoreError) -> bool {
    !matches!(
        error,
        StoreError::BreakerOpen { .. } | StoreError::Config(_) | StoreError::Full { .. }
    )
}

/// What one renewal came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Renewal {
    /// Renewed (here, and in the shared store if the claim is there).
    Renewed,
    /// The shared store did not answer; the claim may still be this holder's.
    Failed,
    /// The claim is no longer this holder's (completing, completed,
    /// released or taken over): renewing is over.
    Over,
}

/// Renews one claim's lease from wherever its holder lives.
pub(crate) struct Renewer {
    ledger: Arc<Ledger>,
    full: InlineKey,
    key: Box<str>,
    generation: Generation,
    token: ClaimToken,
    lease: Duration,
    /// When the lease started (the claim was made).
    start: Instant,
    /// The claim's lapse in the shared store, if it is held there.
    lapse: Option<Arc<Lapse>>,
}

/// The first pause before a renewal that failed is tried again; it doubles
/// up to the renewal period.
const RENEW_RETRY: Duration = Duration::from_millis(50);

impl Renewer {
    /// How often the holder renews.
    pub(crate) fn period(&self) -> Duration {
        renew_period(self.lease)
    }

    /// Renews the lease, here and in the shared store.
    ///
    /// A renewal of the shared claim is never refused by an open breaker (the
    /// owner is alive; the store must hear it as soon as it is back), takes
    /// no longer than a period (a slower one is late: the next one goes out
    /// instead), and pushes the claim's [`Lapse`] whenever it may have
    /// reached the store.
    pub(crate) async fn renew(&self) -> Renewal {
        if !self
            .ledger
            .renew(self.full.as_str(), self.generation, self.token, self.lease)
        {
            return Renewal::Over;
        }
        let (Some(shared), Some(lapse)) = (self.ledger.shared.as_deref(), self.lapse.as_deref())
        else {
            return Renewal::Renewed;
        };
        let full = self.full.as_str();
        let renewed =
            store_call(self.period(), || shared.renew(full, self.token, self.lease)).await;
        let ended = Instant::now();
        match renewed {
            Ok(true) => {
                lapse.push(ended + self.lease);
                Renewal::Renewed
            }
            Ok(false) => {
                tracing::warn!(
                    key = %self.key,
                    "idempotency claim lost in the shared store while its function runs \
                     (its lease lapsed there); its result will be refused"
                );
                Renewal::Over
            }
            Err(e) => {
                if may_have_landed(&e) {
                    lapse.push(ended + self.lease);
                }
                tracing::debug!(key = %self.key, error = %e, "idempotency lease renewal failed; trying again soon");
                Renewal::Failed
            }
        }
    }

    /// Renews one period after the claim, then a period after each renewal,
    /// until the claim is no longer this holder's. A renewal that failed is
    /// tried again sooner (from 50 ms, doubling up to the period), so a store
    /// back from an outage hears from a live owner before its lease lapses.
    pub(crate) async fn keep_renewing(&self) {
        let period = self.period();
        let first_retry = RENEW_RETRY.min(period);
        let (mut due, mut retry) = (self.start + period, first_retry);
        loop {
            tokio::time::sleep_until(due).await;
            match self.renew().await {
                Renewal::Renewed => {
                    due = Instant::now() + period;
                    retry = first_retry;
                }
                Renewal::Failed => {
                    due = Instant::now() + retry;
                    retry = (retry * 2).min(period);
                }
                Renewal::Over => return,
            }
        }
    }
}

/// The longest a caller waiting for another instance sleeps between two
/// looks when no change notice arrives.
const MAX_POLL: Duration = Duration::from_millis(500);

/// How storing a result in the shared store ended.
enum Completion {
    Stored,
    /// Another owner holds the key there.
    Lost,
    /// The store answered with an error of its own: it will not take it.
    Refused(StoreError),
    /// The store did not answer before the claim certainly lapsed there.
    Lapsed(StoreError),
}

/// The longest pause between two tries of a completion.
const COMPLETE_RETRY_MAX: Duration = Duration::from_millis(500);

/// How often a holder renews a `lease`: every third of it (at least 1 ms),
/// so two renewals can be late before the lease lapses.
fn renew_period(lease: Duration) -> Duration {
    (lease / 3).max(Duration::from_millis(1))
}

impl Ticket {
    /// The caller's key, shortened for messages.
    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    /// The ledger that holds this ticket's claim.
    pub(crate) fn ledger(&self) -> Arc<Ledger> {
        Arc::clone(&self.ledger)
    }

    /// Runs `work`, renewing the lease every third of it until `work` ends:
    /// a holder that is alive is never taken over, however long it takes.
    ///
    /// `work` comes pinned where the caller keeps it, so the work's future
    /// is not moved into this one's (a second copy of it in every run).
    pub(crate) async fn hold<F: std::future::Future>(
        &self,
        mut work: std::pin::Pin<&mut F>,
    ) -> F::Output {
        // Renewing runs beside the work, never between its polls. It is
        // built and polled only once the work is pending, so work that ends
        // at its first poll (most does) costs no renewer, arms no timer and
        // carries no renewer in its future (boxed, the renewer's store call
        // stays out of every run's future); the first renewal is still due
        // one period after the start.
        let mut renewing: Option<std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>>> = None;
        std::future::poll_fn(|cx| {
            if let std::task::Poll::Ready(output) = work.as_mut().poll(cx) {
                return std::task::Poll::Ready(output);
            }
            let renewing = renewing.get_or_insert_with(|| Box::pin(self.renew_from()));
            let _ = renewing.as_mut().poll(cx);
            std::task::Poll::Pending
        })
        .await
    }

    /// Renews the lease (see [`Renewer::keep_renewing`]) until the claim is
    /// no longer this holder's; then never ends.
    async fn renew_from(&self) {
        self.renewer().keep_renewing().await;
        std::future::pending::<()>().await;
    }

    /// What renews this ticket's lease from elsewhere.
    pub(crate) fn renewer(&self) -> Renewer {
        Renewer {
            ledger: Arc::clone(&self.ledger),
            full: self.full.clone(),
            key: self.key.clone(),
            generation: self.generation,
            token: self.token,
            lease: self.lease,
            start: self.claimed_at,
            lapse: self.lapse.clone(),
        }
    }

    /// Stores `value` as the key's result and wakes the waiters.
    ///
    /// Fails with [`Error::LeaseLost`] if another caller took the key over
    /// (nothing is stored), [`Error::ShutDown`] after the runtime shut down
    /// (nothing is stored, the key is released), and
    /// [`Error::StoreUnavailable`] if the store refused it (released too) or
    /// did not answer before the claim certainly lapsed there (not released:
    /// see [`Ticket::complete_shared`]).
    ///
    /// A plain function around an `async move` block, not an `async fn`, which would keep
    /// the ticket and the value twice in its future.
    #[allow(clippy::manual_async_fn)] // an `async fn` would hold its arguments twice
    pub(crate) fn complete<T>(
        mut self,
        value: T,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'static
    where
        T: Serialize + Send + Sync + 'static,
    {
        async move {
            let ledger = Arc::clone(&self.ledger);
            let (generation, token) = (self.generation, self.token);
            let ours = ledger
                .claims
                .with_slot(self.full.as_bytes(), |slot| {
                    let ours = slot.generation() == generation && slot.state.token == token;
                    if ours {
                        slot.state.completing = true;
                    }
                    ours
                })
                .unwrap_or(false);
            if !ours {
                // Not ours to release either: the slot belongs to the new holder.
                self.held = false;
                tracing::debug!(key = %self.key, "idempotency completion rejected: lease lost");
                return Err(Error::LeaseLost {
                    key: self.key.to_string(),
                });
            }
            if ledger.is_closed() {
                self.release_now();
                return Err(Error::ShutDown {
                    key: self.key.to_string(),
                });
            }
            let shared_claim = ledger.shared.as_deref().zip(self.lapse.clone());
            let record = if let Some((shared, lapse)) = shared_claim {
                let stored = match stored_result(self.fingerprint, &value) {
                    Ok(stored) => stored,
                    Err(e) => {
                        self.release_now();
                        return Err(unavailable(&self.key, Arc::new(e)));
                    }
                };
                // Boxed: this path's future would otherwise size every run's future.
                match Box::pin(self.complete_shared(shared, &lapse, &stored)).await {
                    Completion::Stored => {}
                    Completion::Lost => {
                        // Taken over in the shared store: the key is another owner's.
                        self.drop_local();
                        tracing::debug!(key = %self.key, "idempotency completion refused: lease lost");
                        return Err(Error::LeaseLost {
                            key: self.key.to_string(),
                        });
                    }
                    Completion::Refused(e) => {
                        // The store answered and will not take it: free the key.
                        self.release_now();
                        return Err(unavailable(&self.key, Arc::new(e)));
                    }
                    Completion::Lapsed(e) => {
                        // Not released in the store (the function ran: nothing
                        // may free the key early); the claim lapsed there.
                        self.drop_local();
                        self.cell.set(Ok(Settled::Released));
                        return Err(unavailable(&self.key, Arc::new(e)));
                    }
                }
                // Local waiters replay the typed value, not the bytes.
                match Record::new(Form::Typed, self.fingerprint, value) {
                    Ok(record) => record,
                    Err(e) => {
                        self.release_now();
                        return Err(unavailable(&self.key, Arc::new(e)));
                    }
                }
            } else {
                let record = match Record::new(ledger.store.form(), self.fingerprint, value) {
                    Ok(record) => record,
                    Err(e) => {
                        self.release_now();
                        return Err(unavailable(&self.key, Arc::new(e)));
                    }
                };
                let put = ledger
                    .store
                    .put(&self.full, record.clone(), self.ttl)
                    .resolve()
                    .await;
                if let Err(e) = put {
                    self.release_now();
                    return Err(unavailable(&self.key, e));
                }
                record
            };
            if ledger.is_closed() {
                // Shutdown cleared the store while we were putting.
                ledger.store.close();
            }
            ledger
                .claims
                .remove_if(self.full.as_bytes(), generation, |claim| {
                    claim.token == token
                });
            self.held = false;
            self.cell.set(Ok(Settled::Done(record)));
            Ok(())
        }
    }

    /// Stores `stored` in the shared store, trying again while the store
    /// does not answer, until it is stored or the claim has certainly lapsed
    /// there (`lapse`): a result that ran must not be lost to an outage
    /// shorter than the lease, or a retry would run the operation again.
    /// Each try is a must-try call (never refused by an open breaker) and may
    /// take what is left until the lapse (at least a renewal period).
    /// Trying up to the lapse and once past it is safe: the store refuses the
    /// result if another owner took the key over, and stores it if nobody did.
    async fn complete_shared(
        &self,
        shared: &dyn IdempotencyStore,
        lapse: &Lapse,
        stored: &StoredResult,
    ) -> Completion {
        let mut pause = Duration::from_millis(20);
        let full = self.full.as_str();
        loop {
            let bound = lapse
                .at()
                .saturating_duration_since(Instant::now())
                .clamp(renew_period(self.lease), self.lease);
            let complete = || shared.complete(full, self.token, stored, self.ttl);
            let error = match store_call(bound, complete).await {
                Ok(true) => return Completion::Stored,
                Ok(false) => return Completion::Lost,
                // Stored but not yet on enough replicas (durable claims): retried too, so the
                // result is not lost with its primary.
                Err(e)
                    if !(e.is_store_fault()
                        || matches!(
                            e,
                            StoreError::BreakerOpen { .. } | StoreError::NotReplicated { .. }
                        )) =>
                {
                    return Completion::Refused(e);
                }
                Err(e) => e,
            };
            let (now, give_up) = (Instant::now(), lapse.at());
            if now >= give_up {
                tracing::error!(
                    key = %self.key,
                    error = %error,
                    "idempotency result could not be stored: the shared store did not answer \
                     before the claim lapsed there; a retry may run the operation again"
                );
                return Completion::Lapsed(error);
            }
            tracing::debug!(key = %self.key, %error, "storing idempotency result failed; retrying");
            // The last try goes out when the claim lapses, not a pause past it.
            tokio::time::sleep_until((now + pause).min(give_up)).await;
            pause = (pause * 2).min(COMPLETE_RETRY_MAX);
        }
    }

    /// Ends the local claim with a result found in the shared store: local
    /// waiters replay it.
    fn settle(mut self, record: Record) {
        self.drop_local();
        self.cell.set(Ok(Settled::Done(record)));
    }

    /// Removes the local claim without touching the shared store.
    fn drop_local(&mut self) {
        if !std::mem::replace(&mut self.held, false) {
            return;
        }
        let token = self.token;
        self.ledger
            .claims
            .remove_if(self.full.as_bytes(), self.generation, |claim| {
                claim.token == token
            });
        self.fence = None;
        self.lapse = None;
    }

    /// Gives the key up so the next caller (or a waiting one) runs.
    pub(crate) fn release(mut self) {
        self.release_now();
    }

    fn release_now(&mut self) {
        if !self.held {
            return;
        }
        let shared = self.fence.is_some() || self.unanswered;
        self.drop_local();
        if shared {
            self.release_shared();
        }
        self.cell.set(Ok(Settled::Released));
    }

    /// Frees the claim in the shared store in the background (a drop cannot
    /// wait); without a tokio runtime to do it on, the lease lapses instead.
    fn release_shared(&self) {
        let Some(shared) = self.ledger.shared.clone() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (full, key, token) = (self.full.clone(), self.key.clone(), self.token);
        let bound = self.lease;
        runtime.spawn(async move {
            let release = || shared.release(full.as_str(), token);
            if let Err(e) = store_call(bound, release).await {
                tracing::debug!(key = %key, error = %e, "releasing an idempotency claim failed; its lease will lapse");
            }
        });
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.release_now();
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("key", &self.key)
            .field("token", &self.token)
            .field("held", &self.held)
            .finish_non_exhaustive()
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

/// `error` and its sources, `: `-separated, for a log line.
pub(crate) fn with_causes(error: &(dyn std::error::Error + '_)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(inner) = cause {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        cause = inner.source();
    }
    text
}

/// The error of a store that failed `key`'s caller (idempotency fails
/// closed), logged at warn with its causes.
fn unavailable(key: &str, source: BoxError) -> Error {
    if tracing::enabled!(tracing::Level::WARN) {
        let error = with_causes(&*source);
        tracing::warn!(key = %shown(key), %error, "idempotency store unavailable; failing closed");
    }
    Error::StoreUnavailable {
        key: shown(key),
        source,
    }
}

/// Runs `f` on the scoped form of `key`, built in a reused per-thread
/// buffer so the replay path allocates nothing.
///
/// The form is `-key` without a scope and `<len>:<scope>key` with one:
/// the first byte tells them apart and the length says where the scope
/// ends, so no two (scope, key) pairs share a form.
pub(crate) fn with_full_key<R>(scope: Option<&str>, key: &str, f: impl FnOnce(&str) -> R) -> R {
    thread_local! {
        static BUFFER: RefCell<String> = const { RefCell::new(String::new()) };
    }
    fn encode(buffer: &mut String, scope: Option<&str>, key: &str) {
        buffer.clear();
        match scope {
            None => buffer.push('-'),
            Some(scope) => {
                // `itoa`, not `write!`: this runs on every lookup.
                buffer.push_str(itoa::Buffer::new().format(scope.len()));
                buffer.push(':');
                buffer.push_str(scope);
            }
        }
        buffer.push_str(key);
    }
    // `with` only fails inside another thread-local's destructor, which never calls us.
    BUFFER.with(|buffer| match buffer.try_borrow_mut() {
        Ok(mut buffer) => {
            encode(&mut buffer, scope, key);
            f(&buffer)
        }
        Err(_) => {
            let mut own = String::new();
            encode(&mut own, scope, key);
            f(&own)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::with_full_key;

    #[test]
    fn full_keys_never_collide_across_scopes() {
        let forms: Vec<String> = [
            (None, "1:ab"),
            (Some("a"), "b"),
            (Some("ab"), ""),
            (Some("1:a"), "b"),
            (None, "-x"),
        ]
        .iter()
        .map(|(scope, key)| with_full_key(*scope, key, str::to_owned))
        .collect();
        let mut unique = forms.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), forms.len(), "{forms:?}");
        assert_eq!(forms[1], "1:ab");
        assert_eq!(forms[0], "-1:ab");
        // The scope's length in decimal, every digit of it.
        for len in [9, 10, 14, 99, 100, 255, 1000] {
            let scope = "s".repeat(len);
            let full = with_full_key(Some(&scope), "k", str::to_owned);
            assert_eq!(full, format!("{len}:{scope}k"));
        }
    }
}
