//! Fencing tokens: what a holder hands its own downstream writes so that a holder whose
//! claim was taken over cannot write after the one that took it.

tokio::task_local! {
    static CURRENT: Fence;
}

/// The fencing token of an idempotency claim: it grows with every claim of its key, so a
/// holder whose claim lapsed (its instance paused or cut off past the lease) and was taken
/// over holds a smaller one than the holder that took the key.
///
/// The key's own store already refuses such a holder's late result. A system downstream of
/// the function (a ledger, a database of your own) can refuse its late *writes* the same way:
/// send the fence with each write and have the downstream keep the highest fence it has
/// accepted per key, refusing lower ones (`UPDATE … SET fence = $f WHERE key = $k AND fence <
/// $f`). Where the key's store is Redis, the fence is `max(last + 1, server µs)`, monotonic
/// across a failover with `RedisBuilder::with_durable_claims` (and otherwise unless the
/// hosts' clocks differ by more than the failure-detection time); on PostgreSQL it comes from
/// a sequence; without a shared store, from the runtime's own counter.
///
/// Inside an idempotent run ([`IdempotencyHandle::run_with`](crate::IdempotencyHandle::run_with),
/// [`Idempotency::run_with`](crate::Idempotency::run_with)), [`Fence::current`] is the run's
/// own; a reservation has [`IdempotencyReservation::fence`](crate::idempotency::IdempotencyReservation::fence).
///
/// # Examples
///
/// A downstream ledger that keeps the highest fence it accepted: a holder that failed (or
/// lost its claim) and writes late is refused once a later holder has written.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use throttlebeam::idempotency::Fence;
/// use throttlebeam::{Error, Runtime};
///
/// /// Accepts a write only if its fence is above every one accepted before.
/// fn write(ledger: &Mutex<Option<u64>>, fence: u64) -> bool {
///     let mut high = ledger.lock().unwrap();
///     if high.is_some_and(|high| fence <= high) {
///         return false;
///     }
///     *high = Some(fence);
///     true
/// }
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Error> {
/// let idempotency = Runtime::start().await?.idempotency();
/// let ledger = Arc::new(Mutex::new(None));
/// // The first holder takes its fence, then fails before writing: the key is released.
/// let seen = Arc::new(Mutex::new(None));
/// let first = idempotency
///     .run("refund:8", {
///         let seen = Arc::clone(&seen);
///         move || async move {
///             *seen.lock().unwrap() = Fence::current();
///             Err::<u64, _>(std::io::Error::other("processor timed out"))
///         }
///     })
///     .await;
/// assert!(matches!(first, Err(Error::Failed { .. })));
/// let stale = seen.lock().unwrap().expect("inside a run");
/// // The next holder writes with its own, larger fence.
/// let second = idempotency
///     .run("refund:8", || async {
///         let fence = Fence::current().expect("inside a run");
///         Ok::<_, std::io::Error>(fence.get())
///     })
///     .await?
///     .into_inner();
/// assert!(stale.get() < second);
/// assert!(write(&ledger, second));
/// // The first holder's late write is refused downstream.
/// assert!(!write(&ledger, stale.get()));
/// # Ok(()) }
/// ```
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct Fence(u64);

impl Fence {
    pub(crate) fn new(n: u64) -> Self {
        Self(n)
    }

    /// The fence as a number, for a downstream write.
    #[must_use]
    pub fn get(self) -> u64 {
        self.0
    }

    /// The fence of the idempotent run whose function is calling, or `None` outside one (and
    /// in a task the function spawned: pass the fence to it).
    #[must_use]
    pub fn current() -> Option<Self> {
        CURRENT.try_with(|fence| *fence).ok()
    }

    /// Runs `work` with `fence` as its [`Fence::current`].
    pub(crate) fn scope<F: std::future::Future>(
        self,
        work: F,
    ) -> tokio::task::futures::TaskLocalFuture<Self, F> {
        CURRENT.scope(self, work)
    }
}

impl std::fmt::Display for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}
