//! Tickets: the right to complete or release one claim, its lease renewal
//! and its completion in the shared store.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use throttlebeam_supervisors::Generation;
use tokio::time::Instant;

use super::{Ledger, Settled};
use crate::cell::RunCell;
use crate::error::{BoxError, Error};
use crate::idempotency::options::Fingerprint;
use crate::idempotency::seam::{ClaimToken, IdempotencyStore, StoredResult};
use crate::idempotency::store::{
    Record, check_round_trip, checked_stored_result, unstorable_result,
};
use crate::idempotency::{Fence, NotRecorded};
use crate::key::{InlineKey, shown};
use crate::store::{StoreError, store_call};

/// The right to complete or release one claim; releases it when dropped.
///
/// Held by the per-key process of a run, or inside a [`crate::idempotency::IdempotencyReservation`].
pub(crate) struct Ticket {
    pub(super) ledger: Arc<Ledger>,
    /// The scoped key the ledger knows (the claim's own, shared).
    pub(super) full: InlineKey,
    /// How long the caller's key is (at most 1024 bytes): `full` ends with it, so the key
    /// needs no copy of its own (messages shorten it when they are made).
    pub(super) key_len: u16,
    pub(super) generation: Generation,
    pub(super) token: ClaimToken,
    pub(super) fingerprint: Option<Fingerprint>,
    pub(super) ttl: Duration,
    pub(super) lease: Duration,
    /// When the claim was made: its lease runs from here.
    pub(super) claimed_at: Instant,
    pub(super) held: bool,
    /// The claim's fencing token: the shared store's counter for the claim it won there, or
    /// the ledger's own without a shared store. Handed to the work ([`Fence::current`]).
    pub(super) fence: Fence,
    /// A claim of this ticket's went to the shared store and may have
    /// landed there, but no answer came back (its caller left, or the call
    /// failed after it was sent): released there too when the ticket is,
    /// so it does not hold the key for a whole lease with nobody behind it.
    pub(super) unanswered: bool,
    /// When that claim has certainly lapsed in the shared store.
    pub(super) lapse: Option<Arc<Lapse>>,
    /// The holder's work ran and its completion began: from here on nothing but the store's
    /// answer ends the claim, and a dropped completion leaves the shared claim to lapse
    /// rather than releasing it.
    pub(super) ran: bool,
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
    pub(super) fn new(at: Instant) -> Arc<Self> {
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
/// work there): see [`StoreError::may_have_been_applied`].
pub(super) fn may_have_landed(error: &StoreError) -> bool {
    error.may_have_been_applied()
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
    /// tried again sooner (from 50 ms, doubling up to the period, but never
    /// more than a third of what may be left of the lease), so a store back
    /// from an outage hears from a live owner before its lease lapses: an
    /// outage that began just before a renewal leaves the owner two thirds
    /// of a lease, and a retry backed off to a period would waste one of them.
    pub(crate) async fn keep_renewing(&self) {
        let period = self.period();
        let first_retry = RENEW_RETRY.min(period);
        let (mut due, mut retry) = (self.start + period, first_retry);
        // The earliest the claim may lapse in the store: a lease after the last renewal that
        // took was sent (the claim itself was made after `start`).
        let mut held_until = self.start + self.lease;
        loop {
            tokio::time::sleep_until(due).await;
            let sent = Instant::now();
            match self.renew().await {
                Renewal::Renewed => {
                    due = Instant::now() + period;
                    retry = first_retry;
                    held_until = sent + self.lease;
                }
                Renewal::Failed => {
                    let now = Instant::now();
                    let left = held_until.saturating_duration_since(now);
                    due = now + retry.min(left / 3).max(first_retry);
                    retry = (retry * 2).min(period);
                }
                Renewal::Over => return,
            }
        }
    }
}

/// The longest a caller waiting for another instance sleeps between two
/// looks when no change notice arrives.
pub(super) const MAX_POLL: Duration = Duration::from_millis(500);

/// How storing a result in the shared store ended.
enum Completion {
    Stored,
    /// Another owner holds the key there.
    Lost,
    /// The store did not take it before the claim certainly lapsed there: its last error, and
    /// whether a try may still have landed (sent, and never answered).
    Lapsed(StoreError, bool),
}

/// Why a holder's result was not recorded, with the store's last error when one is why.
#[derive(Debug)]
pub(crate) struct Unrecorded {
    pub(crate) why: NotRecorded,
    pub(crate) cause: Option<BoxError>,
}

impl Unrecorded {
    fn new(why: NotRecorded) -> Self {
        Self { why, cause: None }
    }

    /// A completion whose task was dropped before it ended (its tokio runtime shut down):
    /// the shared claim is left to lapse.
    pub(crate) fn cancelled() -> Self {
        Self::new(NotRecorded::StoreUnavailable)
    }

    /// The error a caller holding the value already (a reservation) gets.
    pub(crate) fn into_error(self, key: &str) -> Error {
        Error::NotRecorded {
            key: shown(key),
            reason: self.why,
            source: self.cause,
        }
    }
}

/// The longest pause between two tries of a completion.
const COMPLETE_RETRY_MAX: Duration = Duration::from_millis(500);

/// How often a holder renews a `lease`: every third of it (at least 1 ms),
/// so two renewals can be late before the lease lapses.
pub(super) fn renew_period(lease: Duration) -> Duration {
    (lease / 3).max(Duration::from_millis(1))
}

impl Ticket {
    /// The caller's key, whole: the end of the scoped key (messages quote it [`shown`]).
    pub(crate) fn key(&self) -> &str {
        let full = self.full.as_str();
        full.get(full.len().saturating_sub(usize::from(self.key_len))..)
            .unwrap_or_default()
    }

    /// The claim's fencing token.
    pub(crate) fn fence(&self) -> Fence {
        self.fence
    }

    /// Whether [`Ticket::complete`] ends at its first poll (no shared store to wait for).
    pub(crate) fn completes_at_once(&self) -> bool {
        self.ledger.shared.is_none()
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

    /// [`Ticket::renew_from`] owning what it needs: for a run that keeps its ticket beside
    /// its work instead of lending it.
    #[cfg(feature = "http")]
    pub(crate) fn renewing(&self) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
        let renewer = self.renewer();
        Box::pin(async move {
            renewer.keep_renewing().await;
            std::future::pending::<()>().await;
        })
    }

    /// What renews this ticket's lease from elsewhere.
    pub(crate) fn renewer(&self) -> Renewer {
        Renewer {
            ledger: Arc::clone(&self.ledger),
            full: self.full.clone(),
            key: shown(self.key()).into(),
            generation: self.generation,
            token: self.token,
            lease: self.lease,
            start: self.claimed_at,
            lapse: self.lapse.clone(),
        }
    }

    /// [`Ticket::complete`] at once, when neither the store nor a shared store makes it wait
    /// (the in-memory table): the result is stored and the claim removed in one step, under
    /// the claim's lock, so a completing claim is never seen. Otherwise the ticket and the
    /// value come back, for [`Ticket::complete`]. A completion done at once ends as
    /// [`Ticket::complete`] does.
    #[cfg(feature = "http")]
    pub(crate) fn complete_now<T>(mut self, value: T) -> CompletedNow<T>
    where
        T: Serialize + DeserializeOwned + Send + Sync + 'static,
    {
        let ledger = &*self.ledger;
        if ledger.shared.is_some() {
            return CompletedNow::Waits(self, value);
        }
        self.ran = true;
        let (record, unstorable) = memory_record(self.fingerprint, value);
        let (generation, token) = (self.generation, self.token);
        let mut ended = Ended::NotOurs;
        let mut record = Some(record);
        let removed = ledger
            .claims
            .remove_if(self.full.as_bytes(), generation, |claim| {
                if claim.token != token {
                    return false;
                }
                ended = if ledger.is_closed() {
                    Ended::Closed
                } else {
                    let record = record.take().expect("stored once");
                    // Waiters replay the record too: cloned only when there are any.
                    let kept = claim.cell.is_some().then(|| record.clone());
                    // The table stores at once: nothing is awaited under the lock.
                    ledger.store.put(&self.full, record, self.ttl);
                    Ended::Stored(kept)
                };
                true
            });
        self.held = false;
        let waiters = removed.and_then(|claim| claim.cell);
        let why = match ended {
            Ended::Stored(kept) => {
                if let (Some(cell), Some(record)) = (waiters, kept) {
                    cell.set(Ok(Settled::Done(record)));
                }
                if let Some(unstorable) = unstorable {
                    self.unrecorded(unstorable);
                }
                return CompletedNow::Done;
            }
            Ended::NotOurs => NotRecorded::LeaseLost,
            Ended::Closed => NotRecorded::ShutDown,
        };
        // Not recorded: the waiters look again (and find the new holder, or the shutdown).
        if let Some(cell) = waiters {
            cell.set(Ok(Settled::Released));
        }
        self.unrecorded(Unrecorded::new(why));
        CompletedNow::Done
    }

    /// Stores `value` as the key's result and wakes the waiters.
    ///
    /// This is the one place a claim whose work ran ends (see [`Ticket::release`] for work
    /// that failed): it never frees the key for another run. Recorded, the waiters replay
    /// the value. Not recorded ([`Unrecorded`]), the local claim ends and its waiters look
    /// again, while the claim in the shared store holds until it lapses there:
    ///
    /// - [`NotRecorded::LeaseLost`]: another holder took the key over (here, or in the
    ///   shared store);
    /// - [`NotRecorded::StoreUnavailable`]: the shared store refused every try with an answer
    ///   that it did nothing (`OOM`, `NOPERM`, `READONLY`) until the claim certainly lapsed
    ///   there (see [`Ticket::complete_shared`]); [`NotRecorded::Unconfirmed`] when a try may
    ///   still land (sent, never answered: a timeout, a broken connection);
    /// - [`NotRecorded::ShutDown`]: the runtime shut down and it has no shared store. With
    ///   one, a shutdown changes nothing here: the result is stored there, which outlives
    ///   this runtime.
    ///
    /// A plain function around an `async move` block, not an `async fn`, which would keep
    /// the ticket and the value twice in its future.
    #[allow(clippy::manual_async_fn)] // an `async fn` would hold its arguments twice
    pub(crate) fn complete<T>(
        mut self,
        value: T,
    ) -> impl Future<Output = Result<(), Unrecorded>> + Send + 'static
    where
        T: Serialize + DeserializeOwned + Send + Sync + 'static,
    {
        async move {
            self.ran = true;
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
                // Not ours to end either: the slot belongs to the new holder.
                self.held = false;
                return Err(self.unrecorded(Unrecorded::new(NotRecorded::LeaseLost)));
            }
            let shared_claim = ledger.shared.as_deref().zip(self.lapse.clone());
            let mut unstorable = None;
            let record = if let Some((shared, lapse)) = shared_claim {
                let stored = match checked_stored_result(self.fingerprint, &value) {
                    Ok(stored) => stored,
                    Err(e) => {
                        // It ran, and its value would never come back: the key is recorded as
                        // run with the cause, so retries are told so instead of running again.
                        let stored = unstorable_result::<T>(self.fingerprint, &e);
                        unstorable = Some(Unrecorded {
                            why: NotRecorded::Unstorable,
                            cause: Some(Arc::new(e)),
                        });
                        stored
                    }
                };
                // Boxed: this path's future would otherwise size every run's future.
                match Box::pin(self.complete_shared(shared, &lapse, &stored)).await {
                    Completion::Stored => {}
                    Completion::Lost => {
                        return Err(self.end_unrecorded(Unrecorded::new(NotRecorded::LeaseLost)));
                    }
                    Completion::Lapsed(e, unsure) => {
                        let why = if unsure {
                            NotRecorded::Unconfirmed
                        } else {
                            NotRecorded::StoreUnavailable
                        };
                        return Err(self.end_unrecorded(Unrecorded {
                            why,
                            cause: Some(Arc::new(e)),
                        }));
                    }
                }
                // Local waiters replay the typed value, not the bytes.
                match unstorable {
                    None => Record::new(self.fingerprint, value),
                    Some(_) => Record::from_stored(stored),
                }
            } else {
                if ledger.is_closed() {
                    return Err(self.end_unrecorded(Unrecorded::new(NotRecorded::ShutDown)));
                }
                let record;
                (record, unstorable) = memory_record(self.fingerprint, value);
                ledger.store.put(&self.full, record.clone(), self.ttl);
                if ledger.is_closed() {
                    // Shutdown cleared the table while we were putting: gone with it.
                    ledger.store.close();
                    return Err(self.end_unrecorded(Unrecorded::new(NotRecorded::ShutDown)));
                }
                record
            };
            // Removed here, not by the drop.
            self.held = false;
            let removed = ledger
                .claims
                .remove_if(self.full.as_bytes(), generation, |claim| {
                    claim.token == token
                });
            if let Some(cell) = removed.and_then(|claim| claim.cell) {
                cell.set(Ok(Settled::Done(record)));
            }
            match unstorable {
                None => Ok(()),
                Some(unstorable) => Err(self.unrecorded(unstorable)),
            }
        }
    }

    /// Ends the local claim of a run that was not recorded, waking its waiters to look again
    /// (the claim in the shared store, if any, is left to lapse there: the work ran), and
    /// says so in the log.
    fn end_unrecorded(&mut self, unrecorded: Unrecorded) -> Unrecorded {
        if let Some(cell) = self.drop_local() {
            cell.set(Ok(Settled::Released));
        }
        self.unrecorded(unrecorded)
    }

    /// Logs why this holder's result was not recorded (at most once per interval per
    /// ledger, with a count of the others), and hands the reason on.
    fn unrecorded(&self, unrecorded: Unrecorded) -> Unrecorded {
        let key = shown(self.key());
        match unrecorded.why {
            NotRecorded::ShutDown => {
                tracing::debug!(key = %key, "idempotency result not recorded: the runtime shut down");
            }
            why => self
                .ledger
                .logs
                .unrecorded(&key, why, unrecorded.cause.as_deref()),
        }
        unrecorded
    }

    /// Stores `stored` in the shared store, trying again whatever the store answers short of
    /// a decision (no answer, an error reply, a script error), until it is stored, refused
    /// because another owner holds the key, or the claim has certainly lapsed there
    /// (`lapse`): a result that ran must not be lost to a store that fails for less than the
    /// lease, nor its key freed, or a retry would run the operation again.
    /// Each try is a must-try call (never refused by an open breaker) and may take what is
    /// left until the lapse (at least a renewal period). Trying up to the lapse and once past
    /// it is safe: the store refuses the result if another owner took the key over, and
    /// stores it if nobody did.
    async fn complete_shared(
        &self,
        shared: &dyn IdempotencyStore,
        lapse: &Lapse,
        stored: &StoredResult,
    ) -> Completion {
        let mut pause = Duration::from_millis(20);
        let full = self.full.as_str();
        let mut unsure = false;
        loop {
            let bound = lapse
                .at()
                .saturating_duration_since(Instant::now())
                .clamp(renew_period(self.lease), self.lease);
            let complete = || shared.complete(full, self.token, stored, self.ttl);
            let error = match store_call(bound, complete).await {
                Ok(true) => return Completion::Stored,
                Ok(false) => return Completion::Lost,
                Err(e) => e,
            };
            unsure |= may_have_landed(&error);
            let (now, give_up) = (Instant::now(), lapse.at());
            if now >= give_up {
                return Completion::Lapsed(error, unsure);
            }
            tracing::debug!(key = %shown(self.key()), %error, "storing idempotency result failed; retrying");
            // The last try goes out when the claim lapses, not a pause past it.
            tokio::time::sleep_until((now + pause).min(give_up)).await;
            pause = (pause * 2).min(COMPLETE_RETRY_MAX);
        }
    }

    /// Ends the local claim with a result found in the shared store: local
    /// waiters replay it.
    pub(super) fn settle(mut self, record: Record) {
        if let Some(cell) = self.drop_local() {
            cell.set(Ok(Settled::Done(record)));
        }
    }

    /// Removes the local claim without touching the shared store; returns the cell its
    /// waiters wait on, if any.
    fn drop_local(&mut self) -> Option<Arc<RunCell<Settled>>> {
        if !std::mem::replace(&mut self.held, false) {
            return None;
        }
        let token = self.token;
        let removed =
            self.ledger
                .claims
                .remove_if(self.full.as_bytes(), self.generation, |claim| {
                    claim.token == token
                });
        self.lapse = None;
        removed.and_then(|claim| claim.cell)
    }

    /// Gives the key up so the next caller (or a waiting one) runs: for work that failed or
    /// panicked, or never started. Work that ran ends in [`Ticket::complete`].
    pub(crate) fn release(mut self) {
        self.release_now();
    }

    fn release_now(&mut self) {
        if !self.held {
            return;
        }
        // A completion dropped half way (its task's runtime ended): the work ran, so the
        // shared claim is left to lapse; local waiters look again and find it there.
        let shared = (self.lapse.is_some() || self.unanswered) && !self.ran;
        let waiters = self.drop_local();
        if shared {
            self.release_shared();
        }
        if let Some(cell) = waiters {
            cell.set(Ok(Settled::Released));
        }
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
        let (full, key, token) = (
            self.full.clone(),
            Box::<str>::from(shown(self.key())),
            self.token,
        );
        let bound = self.lease;
        runtime.spawn(async move {
            let release = || shared.release(full.as_str(), token);
            if let Err(e) = store_call(bound, release).await {
                tracing::debug!(key = %key, error = %e, "releasing an idempotency claim failed; its lease will lapse");
            }
        });
    }
}

/// The record the in-memory table keeps for `value`: the typed value, or, for a type whose
/// first value does not read back from its own encoding (a shared store could never replay
/// it), the record of a run whose result could not be stored, with why.
fn memory_record<T>(fingerprint: Option<Fingerprint>, value: T) -> (Record, Option<Unrecorded>)
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
{
    match check_round_trip(&value) {
        Ok(()) => (Record::new(fingerprint, value), None),
        Err(e) => {
            let record = Record::unstorable::<T>(fingerprint, &e);
            let unstorable = Unrecorded {
                why: NotRecorded::Unstorable,
                cause: Some(Arc::new(e)),
            };
            (record, Some(unstorable))
        }
    }
}

/// What [`Ticket::complete_now`] came to.
#[cfg(feature = "http")]
pub(crate) enum CompletedNow<T> {
    /// Completed at once, recorded or not (logged).
    Done,
    /// The store makes it wait: the ticket and the value, for [`Ticket::complete`].
    Waits(Ticket, T),
}

/// How [`Ticket::complete_now`] found its claim.
#[cfg(feature = "http")]
enum Ended {
    /// Stored; the record again for the waiters, if any.
    Stored(Option<Record>),
    /// Taken over: the slot is another holder's.
    NotOurs,
    /// The runtime shut down: removed, nothing stored.
    Closed,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.release_now();
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("key", &shown(self.key()))
            .field("token", &self.token)
            .field("held", &self.held)
            .finish_non_exhaustive()
    }
}
