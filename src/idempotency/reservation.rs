//! Holding a key by hand: `reserve`, then `complete` or `release`.

use std::marker::PhantomData;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::oneshot;

use super::claim::{Renewer, Ticket, Unrecorded};
use crate::error::Error;
use crate::key::shown;

/// What [`IdempotencyHandle::reserve`](super::IdempotencyHandle::reserve) found.
#[derive(Debug)]
#[must_use]
// Returned once per claim and matched at once: boxing the reservation would cost every
// claim an allocation to save a move of about 200 bytes.
#[allow(clippy::large_enum_variant)]
pub enum IdempotencyReserved<T> {
    /// The key is now held by this caller; produce the result and
    /// [`complete`](IdempotencyReservation::complete) it.
    Fresh(IdempotencyReservation<T>),
    /// The key already completed within its TTL: this is its result.
    Replay(T),
}

/// The right to produce a key's result, for results made somewhere other
/// than one function call.
///
/// While it exists, the key is held: duplicates wait for it (or are
/// rejected, see [`InFlight`](crate::idempotency::InFlight)), and its lease is renewed
/// in the background every third of the lease, so it is never taken over
/// however long it is held. End it with [`complete`](Self::complete) or
/// [`release`](Self::release); dropping it unfinished releases the key, so
/// the next caller runs. The renewal runs on the tokio runtime that made
/// the reservation: if that runtime ends first, renewal stops, the lease
/// lapses, another caller may take the key over, and this reservation's
/// `complete` is then refused with [`Error::NotRecorded`].
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
/// use throttlebeam::{IdempotencyOptions, IdempotencyOutcome, idempotency::IdempotencyReserved, Runtime};
///
/// let idempotency = Runtime::start().await?.idempotency();
/// match idempotency.reserve::<u64>("refund:31", IdempotencyOptions::new()).await? {
///     IdempotencyReserved::Fresh(reservation) => reservation.complete(31).await?,
///     IdempotencyReserved::Replay(refund) => println!("already refunded: {refund}"),
/// }
/// let again = idempotency
///     .run("refund:31", || async { Ok::<u64, std::io::Error>(0) })
///     .await?;
/// assert_eq!(again, IdempotencyOutcome::Replay(31));
/// # Ok(()) }
/// ```
pub struct IdempotencyReservation<T> {
    ticket: Ticket,
    /// The key, shortened if very long.
    key: Box<str>,
    /// Dropped with the reservation: stops its renewal.
    _renewing: oneshot::Sender<()>,
    _result: PhantomData<fn(T)>,
}

impl<T> IdempotencyReservation<T>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
{
    /// Holds `ticket` and starts renewing its lease on the current tokio
    /// runtime; without one, the ticket is dropped (released).
    pub(crate) fn new(ticket: Ticket) -> Result<Self, Error> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| Error::NoTokio)?;
        let (renewing, stopped) = oneshot::channel();
        // A heartbeat, not work: it ends with the reservation (or once the
        // claim is no longer its own), and shutdown has nothing to wait for.
        runtime.spawn(renew_until(ticket.renewer(), stopped));
        Ok(Self {
            key: shown(ticket.key()).into(),
            ticket,
            _renewing: renewing,
            _result: PhantomData,
        })
    }

    /// The key this reservation holds (shortened if very long).
    #[must_use]
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The claim's fencing token, for downstream writes made while holding it (see
    /// [`Fence`](crate::idempotency::Fence)).
    #[must_use]
    pub fn fence(&self) -> crate::idempotency::Fence {
        self.ticket.fence()
    }

    /// Stores `value` as the key's result for the TTL of the reservation's
    /// options and hands it to every waiting duplicate.
    ///
    /// With a shared store this holds through store failures shorter than the lease (the
    /// result is retried until stored) and through a shutdown of the runtime (the store
    /// outlives it).
    ///
    /// # Errors
    ///
    /// [`Error::NotRecorded`]: the result is not the key's, and the key was not released
    /// for another run by it; the reason says why: [`NotRecorded::LeaseLost`] (the lease
    /// lapsed, say because renewal stopped with its tokio runtime, and another caller took
    /// the key over), [`NotRecorded::StoreUnavailable`] (the shared store did not take it
    /// before the claim lapsed there; the store's error is the source),
    /// [`NotRecorded::ShutDown`] (the runtime shut down and has no shared store).
    ///
    /// [`NotRecorded::LeaseLost`]: crate::idempotency::NotRecorded::LeaseLost
    /// [`NotRecorded::StoreUnavailable`]: crate::idempotency::NotRecorded::StoreUnavailable
    /// [`NotRecorded::ShutDown`]: crate::idempotency::NotRecorded::ShutDown
    pub async fn complete(self, value: T) -> Result<(), Error> {
        let key = self.key;
        let completing = self.ticket.completes_at_once();
        let completion = self.ticket.complete(value);
        let completed = if completing {
            completion.await
        } else {
            // A completion that waits for a shared store goes on in a task of its own: the
            // work it records happened, so dropping this future must not drop its result.
            tokio::spawn(completion)
                .await
                .unwrap_or_else(|_| Err(Unrecorded::cancelled()))
        };
        completed.map_err(|unrecorded| unrecorded.into_error(&key))
    }

    /// Gives the key up without a result: the next caller, or one of the
    /// waiting duplicates, runs.
    pub async fn release(self) {
        self.ticket.release();
    }
}

/// Renews (see [`Renewer::keep_renewing`]) until `stopped` fires or is
/// dropped, or the claim is no longer the renewer's.
async fn renew_until(renewer: Renewer, stopped: oneshot::Receiver<()>) {
    tokio::select! {
        _ = stopped => {}
        () = renewer.keep_renewing() => {}
    }
}

impl<T> std::fmt::Debug for IdempotencyReservation<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyReservation")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}
