//! Where per-key state lives: the [`Store`] contract (one atomic primitive) and the in-memory
//! [`MemoryStore`].

mod memory;

use std::future::Future;

pub use memory::MemoryStore;

use super::RateLimitError;
use super::strategy::Outcome;

/// A pure read-modify-write of one key's state, run atomically by a store.
///
/// The built-in transitions wrap a [`Strategy`](super::Strategy)'s `check`, `peek` and
/// `forecast` (and the shaper's `reserve`); they close over the strategy and the cost. A store
/// never needs to know which one it runs.
pub trait Transition<S> {
    /// What the caller gets back.
    type Output;

    /// Computes the outcome from the key's current state (`None` if absent or expired).
    fn run(&self, state: Option<S>, now_ms: u64) -> Outcome<S, Self::Output>;
}

/// Storage for per-key state with exactly one mutating primitive, [`Store::apply`], plus
/// [`Store::remove`] to forget a key.
///
/// Adding an algorithm never touches a store, and adding a backend means implementing these
/// two methods. A remote store (Redis) implements [`AsyncStore`] instead and runs the same
/// transition as a script in one round trip; the strategies' integer maths let it reproduce
/// every decision bit for bit.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use throttlebeam::rate_limit::{FixedWindow, Limiter, MemoryStore};
///
/// let store = MemoryStore::new().with_max_keys(std::num::NonZeroUsize::new(10_000).unwrap());
/// let limiter = Limiter::builder(FixedWindow::new(100, Duration::from_secs(60))?)
///     .with_store(store)
///     .build();
/// assert!(limiter.check("user:1")?.allowed);
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
pub trait Store<S>: Send + Sync + 'static {
    /// Runs `transition` on `key`'s state at `now_ms`, atomically with respect to every other
    /// `apply` on the same key, and stores its update.
    ///
    /// # Errors
    ///
    /// A [`RateLimitError::Store`] when the backend fails.
    fn apply<T: Transition<S>>(
        &self,
        key: &str,
        now_ms: u64,
        transition: &T,
    ) -> Result<T::Output, RateLimitError>;

    /// Forgets `key`'s state.
    ///
    /// # Errors
    ///
    /// A [`RateLimitError::Store`] when the backend fails.
    fn remove(&self, key: &str) -> Result<(), RateLimitError>;
}

/// The asynchronous form of [`Store`], for backends behind a network. Every [`Store`] is an
/// `AsyncStore` whose futures are ready at once.
pub trait AsyncStore<S>: Send + Sync + 'static {
    /// Like [`Store::apply`], awaited.
    ///
    /// # Errors
    ///
    /// A [`RateLimitError::Store`] when the backend fails.
    fn apply_async<T>(
        &self,
        key: &str,
        now_ms: u64,
        transition: &T,
    ) -> impl Future<Output = Result<T::Output, RateLimitError>> + Send
    where
        T: Transition<S> + Sync,
        T::Output: Send;

    /// Like [`Store::remove`], awaited.
    ///
    /// # Errors
    ///
    /// A [`RateLimitError::Store`] when the backend fails.
    fn remove_async(&self, key: &str) -> impl Future<Output = Result<(), RateLimitError>> + Send;
}

impl<S, St: Store<S>> AsyncStore<S> for St {
    fn apply_async<T>(
        &self,
        key: &str,
        now_ms: u64,
        transition: &T,
    ) -> impl Future<Output = Result<T::Output, RateLimitError>> + Send
    where
        T: Transition<S> + Sync,
        T::Output: Send,
    {
        std::future::ready(self.apply(key, now_ms, transition))
    }

    fn remove_async(&self, key: &str) -> impl Future<Output = Result<(), RateLimitError>> + Send {
        std::future::ready(self.remove(key))
    }
}
