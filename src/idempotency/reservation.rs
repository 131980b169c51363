//! Holding a key by hand: `reserve`, then `complete` or `release`.

use std::marker::PhantomData;

use serde::Serialize;

use super::claim::Ticket;
use crate::error::Error;

/// What [`Deduplicator::reserve`](super::Deduplicator::reserve) found.
#[derive(Debug)]
#[must_use]
pub enum Reserved<T> {
    /// The key is now held by this caller; produce the result and
    /// [`complete`](Reservation::complete) it.
    Fresh(Reservation<T>),
    /// The key already completed within its TTL: this is its result.
    Replay(T),
}

/// The right to produce a key's result, for results made somewhere other
/// than one function call.
///
/// While it is held, duplicates of the key wait (see
/// [`Deduplicator::run`](super::Deduplicator::run)). End it with
/// [`complete`](Self::complete) or [`release`](Self::release); dropping it
/// unfinished releases the key, so the next caller runs. Like a run, a
/// reservation holds the key for its lease only: once the lease lapses,
/// another caller may take the key over, and this reservation's
/// `complete` is then rejected.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
/// use throttlebeam::{IdempotencyOptions, Outcome, Reserved, Runtime};
///
/// let dedup = Runtime::start().await?.idempotency();
/// match dedup.reserve::<u64>("refund:31", IdempotencyOptions::new()).await? {
///     Reserved::Fresh(reservation) => reservation.complete(31).await?,
///     Reserved::Replay(refund) => println!("already refunded: {refund}"),
/// }
/// let again = dedup
///     .run("refund:31", || async { Ok::<u64, std::io::Error>(0) }, IdempotencyOptions::new())
///     .await?;
/// assert_eq!(again, Outcome::Replay(31));
/// # Ok(()) }
/// ```
pub struct Reservation<T> {
    ticket: Ticket,
    _result: PhantomData<fn(T)>,
}

impl<T> Reservation<T>
where
    T: Serialize + Send + Sync + 'static,
{
    pub(crate) fn new(ticket: Ticket) -> Self {
        Self {
            ticket,
            _result: PhantomData,
        }
    }

    /// The key this reservation holds (shortened if very long).
    #[must_use]
    pub fn key(&self) -> &str {
        self.ticket.key()
    }

    /// Stores `value` as the key's result for the TTL of the reservation's
    /// options and hands it to every waiting duplicate.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] if the lease lapsed and another caller took the
    /// key over (nothing is stored); [`Error::ShutDown`] if the runtime shut
    /// down (nothing is stored); [`Error::StoreUnavailable`] if the store
    /// refused the result (the key is released).
    pub async fn complete(self, value: T) -> Result<(), Error> {
        self.ticket.complete(value).await
    }

    /// Gives the key up without a result: the next caller, or one of the
    /// waiting duplicates, runs.
    pub async fn release(self) {
        self.ticket.release();
    }
}

impl<T> std::fmt::Debug for Reservation<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("key", &self.ticket.key())
            .finish_non_exhaustive()
    }
}
