//! Idempotency: run an operation at most once per key, and hand its result
//! to every retry.
//!
//! A key in flight is a slot in the ledger's registry, claimed under one
//! shard lock; its function runs in a per-key process, so the first caller
//! going away does not cancel it. Completed results live in a store for
//! their TTL (in memory: a TTL table swept by the runtime's sweeper), and a
//! replay is a lookup and a clone: no process, no message.

mod claim;
mod options;
mod reservation;
mod store;

use std::future::Future;
use std::sync::Arc;

use arc_swap::ArcSwap;
use serde::Serialize;
use serde::de::DeserializeOwned;
use throttlebeam_supervisors::{Counters, Sweeper, catch_panic};
use tokio::sync::oneshot;
use tokio::time::Instant;

use self::claim::{Ledger, Settled, Step, Ticket, replay};
pub use self::options::IdempotencyOptions;
pub use self::reservation::{Reservation, Reserved};
use self::store::MemoryStore;
use crate::error::Error;
use crate::key::{check_key, shown};
use crate::runtime::{Core, Runtime, Service};

/// Whether an idempotent call ran its function or replayed a stored result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use]
pub enum Outcome<T> {
    /// This call ran the function; the value is also stored for replays.
    Fresh(T),
    /// Another call already ran it (or was running it); this is its value.
    Replay(T),
}

impl<T> Outcome<T> {
    /// The value, fresh or replayed.
    pub fn into_inner(self) -> T {
        match self {
            Self::Fresh(value) | Self::Replay(value) => value,
        }
    }

    /// The value, by reference.
    #[must_use]
    pub fn value(&self) -> &T {
        match self {
            Self::Fresh(value) | Self::Replay(value) => value,
        }
    }

    /// Whether this call ran the function.
    #[must_use]
    pub fn is_fresh(&self) -> bool {
        matches!(self, Self::Fresh(_))
    }

    /// Whether the value is another call's stored result.
    #[must_use]
    pub fn is_replay(&self) -> bool {
        matches!(self, Self::Replay(_))
    }
}

/// The idempotency part of a runtime: its ledger of keys in flight and its
/// results store. A restart swaps in a fresh ledger: what the old one held is
/// forgotten, as after an expiry.
pub(crate) struct State {
    ledger: ArcSwap<Ledger>,
    counters: Arc<Counters>,
    cap: usize,
    sweeper: Sweeper,
}

impl State {
    fn new(core: &Core) -> Self {
        let counters = Arc::clone(&core.counters);
        let sweeper = core.tree.sweeper().clone();
        Self {
            ledger: ArcSwap::new(Self::ledger_for(&counters, core.cap, &sweeper)),
            counters,
            cap: core.cap,
            sweeper,
        }
    }

    fn ledger_for(counters: &Arc<Counters>, cap: usize, sweeper: &Sweeper) -> Arc<Ledger> {
        let store = MemoryStore::new(Arc::clone(counters), sweeper);
        Arc::new(Ledger::new(Arc::clone(counters), cap, Box::new(store)))
    }

    /// This runtime's idempotency state.
    pub(crate) fn of(core: &Core) -> Arc<Self> {
        core.service(Self::new)
    }

    /// The ledger in force.
    pub(crate) fn ledger(&self) -> Arc<Ledger> {
        self.ledger.load_full()
    }
}

impl Service for State {
    fn stopped(&self) {
        self.ledger.load().shutdown();
    }

    fn reset(&self) {
        let fresh = Self::ledger_for(&self.counters, self.cap, &self.sweeper);
        let old = self.ledger.swap(fresh);
        // Waiters on the old ledger look again and find the fresh one empty.
        old.shutdown();
    }
}

/// Idempotent calls on an explicit [`Runtime`]; from [`Runtime::idempotency`].
///
/// A cheap handle (`Clone`). See [`Deduplicator::run`] for the behaviour and
/// [`Idempotency`] for the same calls on the default runtime.
#[derive(Clone)]
pub struct Deduplicator {
    runtime: Runtime,
    state: Arc<State>,
}

impl std::fmt::Debug for Deduplicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deduplicator").finish_non_exhaustive()
    }
}

impl Runtime {
    /// Idempotent calls on this runtime.
    #[must_use]
    pub fn idempotency(&self) -> Deduplicator {
        Deduplicator {
            runtime: self.clone(),
            state: State::of(&self.core),
        }
    }
}

impl Deduplicator {
    /// Runs `f` at most once per key (within `options`' scope) and returns
    /// its value to this call and to every duplicate for the TTL.
    ///
    /// - No result and nobody holding the key: this call claims it, runs `f`
    ///   and gets [`Outcome::Fresh`]; the value is stored for the TTL.
    /// - A stored result: [`Outcome::Replay`] at once; `f` does not run.
    /// - Another call holds the key: this one waits, up to the wait timeout,
    ///   and gets that call's value as [`Outcome::Replay`]. If that call
    ///   fails, panics or lets its lease lapse, one waiting duplicate takes
    ///   over and runs its own `f`.
    ///
    /// `f` runs in the key's own process: dropping this future does not
    /// cancel it; it runs to the end and its result is stored and replayed.
    /// If it fails or panics, nothing is stored and the key is released, so
    /// a retry runs `f` again. The key is held for the lease only; a caller
    /// arriving after it lapses takes the key over, and a late completion of
    /// the old run is rejected.
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidKey`], [`Error::InvalidArgument`] (zero or over
    ///   [`MAX_TIMER`](crate::MAX_TIMER) TTL, lease or wait timeout; empty or
    ///   over-long scope): nothing runs.
    /// - [`Error::FingerprintMismatch`]: the key completed or is in flight
    ///   with another fingerprint; `f` does not run.
    /// - [`Error::Timeout`]: this duplicate waited its wait timeout while the
    ///   first call was still running (which carries on and stores its result).
    /// - [`Error::Failed`], [`Error::Panicked`]: `f` ran here and failed.
    /// - [`Error::LeaseLost`]: `f` ran here but finished after its lease
    ///   lapsed and another call took the key over; its value was not stored.
    /// - [`Error::TypeMismatch`]: the key's stored result is of another type.
    /// - [`Error::TooManyKeys`], [`Error::ShutDown`],
    ///   [`Error::StoreUnavailable`].
    ///
    /// After shutdown began, a run whose `f` still finishes gets its value
    /// as [`Outcome::Fresh`], but nothing is stored.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// use throttlebeam::{IdempotencyOptions, Outcome, Runtime};
    ///
    /// let dedup = Runtime::start().await?.idempotency();
    /// let options = IdempotencyOptions::new().with_scope("tenant-1").with_fingerprint("order-9");
    /// let charge = || async { Ok::<_, std::io::Error>(String::from("ch_1")) };
    ///
    /// let first = dedup.run("pay:9", charge, options.clone()).await?;
    /// assert_eq!(first, Outcome::Fresh("ch_1".to_owned()));
    /// let retry = dedup.run("pay:9", charge, options).await?;
    /// assert_eq!(retry, Outcome::Replay("ch_1".to_owned()));
    /// # Ok(()) }
    /// ```
    pub async fn run<F, Fut, T, E>(
        &self,
        key: &str,
        f: F,
        options: IdempotencyOptions,
    ) -> Result<Outcome<T>, Error>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>> + Send + 'static,
    {
        let core = &self.runtime.core;
        // A replay reads the ledger in force without taking a reference to it.
        if let Some(value) = fast_replay(core, &self.state.ledger.load(), key, &options)? {
            return Ok(Outcome::Replay(value));
        }
        run_in(core, &self.state.ledger(), key, f, options).await
    }

    /// Claims `key` by hand, for a result produced somewhere other than one
    /// function call: returns the stored result as [`Reserved::Replay`], or
    /// a [`Reservation`] to [`complete`](Reservation::complete) or
    /// [`release`](Reservation::release).
    ///
    /// A key in flight (another run or reservation) is waited for exactly as
    /// [`Deduplicator::run`] waits: its result is replayed, or this call
    /// takes the key over if the holder releases it, fails or lets its lease
    /// lapse, or fails with [`Error::Timeout`] after the wait timeout.
    ///
    /// # Errors
    ///
    /// As [`Deduplicator::run`], except the ones about running a function.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// use throttlebeam::{IdempotencyOptions, Reserved, Runtime};
    ///
    /// let dedup = Runtime::start().await?.idempotency();
    /// let Reserved::Fresh(reservation) = dedup.reserve::<String>("job:4", IdempotencyOptions::new()).await? else {
    ///     unreachable!("nobody else used job:4");
    /// };
    /// reservation.complete("done".to_owned()).await?;
    /// let again = dedup.reserve::<String>("job:4", IdempotencyOptions::new()).await?;
    /// assert!(matches!(again, Reserved::Replay(s) if s == "done"));
    /// # Ok(()) }
    /// ```
    pub async fn reserve<T>(
        &self,
        key: &str,
        options: IdempotencyOptions,
    ) -> Result<Reserved<T>, Error>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    {
        let core = &self.runtime.core;
        reserve_in(core, &self.state.ledger(), key, options).await
    }
}

/// Idempotent calls on the default runtime.
///
/// A client that retries a request sends the same key and gets the first
/// request's result back instead of running the operation again, including
/// while the first request is still running: duplicates wait for it and
/// share its result. See [`Deduplicator::run`] for the details and
/// [`IdempotencyOptions`] for scope, fingerprint, TTL, lease and wait
/// timeout.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
/// use throttlebeam::{Error, Idempotency, IdempotencyOptions, Outcome};
///
/// let options = IdempotencyOptions::new().with_scope("tenant-42").with_fingerprint("order-17");
/// match Idempotency::run("key-from-client", || async { Ok::<_, std::io::Error>(1700_u64) }, options).await {
///     Ok(Outcome::Fresh(charge)) => assert_eq!(charge, 1700), // ran in this call
///     Ok(Outcome::Replay(charge)) => assert_eq!(charge, 1700), // another call ran it
///     Err(Error::FingerprintMismatch { .. }) => {}            // key reused for another request
///     Err(Error::Timeout { .. }) => {}                        // the first call is still running
///     Err(e) => return Err(e),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Idempotency;

impl Idempotency {
    /// [`Deduplicator::run`] on the default runtime.
    ///
    /// # Errors
    ///
    /// As [`Deduplicator::run`], plus [`Error::Start`] if the default runtime
    /// could not start.
    pub async fn run<F, Fut, T, E>(
        key: &str,
        f: F,
        options: IdempotencyOptions,
    ) -> Result<Outcome<T>, Error>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>> + Send + 'static,
    {
        Runtime::global()?.idempotency().run(key, f, options).await
    }

    /// [`Deduplicator::reserve`] on the default runtime.
    ///
    /// # Errors
    ///
    /// As [`Deduplicator::reserve`], plus [`Error::Start`] if the default
    /// runtime could not start.
    pub async fn reserve<T>(key: &str, options: IdempotencyOptions) -> Result<Reserved<T>, Error>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    {
        Runtime::global()?.idempotency().reserve(key, options).await
    }
}

/// What [`acquire`] ended with.
enum Acquired<T> {
    Replay(T),
    Owner(Ticket),
}

/// Looks at the key until it replays, is held by this caller, or the wait
/// timeout passes.
/// The replay fast path, before any future is built: validates, then reads
/// a completed result straight from a store that can answer at once.
fn fast_replay<T>(
    core: &Core,
    ledger: &Ledger,
    key: &str,
    options: &IdempotencyOptions,
) -> Result<Option<T>, Error>
where
    T: DeserializeOwned + Clone + 'static,
{
    check_key(key)?;
    options.check(key)?;
    core.check_open(key)?;
    ledger.try_replay(key, options, Instant::now()).transpose()
}

async fn acquire<T>(
    core: &Core,
    ledger: &Arc<Ledger>,
    key: &str,
    options: &IdempotencyOptions,
) -> Result<Acquired<T>, Error>
where
    T: DeserializeOwned + Clone + 'static,
{
    check_key(key)?;
    options.check(key)?;
    // One clock read per look: the replay path is a lookup, not a timer.
    let mut now = Instant::now();
    let deadline = now + options.wait_timeout();
    loop {
        core.check_open(key)?;
        let (cell, lease_until) = match ledger.attempt(key, options, now).await? {
            Step::Replay(value) => return Ok(Acquired::Replay(value)),
            Step::Owner(ticket) => return Ok(Acquired::Owner(ticket)),
            Step::Wait { cell, lease_until } => (cell, lease_until),
        };
        let until = lease_until.map_or(deadline, |lease| lease.min(deadline));
        match tokio::time::timeout_at(until, cell.wait()).await {
            Ok(Ok(Settled::Done(record))) => {
                return replay(&record, key, options.fingerprint()).map(Acquired::Replay);
            }
            // Released, failed, taken over or shut down: look again.
            Ok(_) => now = Instant::now(),
            Err(_) => {
                now = Instant::now();
                if now >= deadline {
                    return Err(Error::Timeout {
                        key: shown(key),
                        after: options.wait_timeout(),
                    });
                }
                // Only the holder's lease lapsed: look again and take the key over.
            }
        }
    }
}

async fn run_in<F, Fut, T, E>(
    core: &Core,
    ledger: &Arc<Ledger>,
    key: &str,
    f: F,
    options: IdempotencyOptions,
) -> Result<Outcome<T>, Error>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
    T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync + 'static>> + Send + 'static,
{
    if let Some(value) = fast_replay(core, ledger, key, &options)? {
        return Ok(Outcome::Replay(value));
    }
    let ticket = match acquire(core, ledger, key, &options).await? {
        Acquired::Replay(value) => return Ok(Outcome::Replay(value)),
        Acquired::Owner(ticket) => ticket,
    };
    let (tx, rx) = oneshot::channel();
    // If the process never starts, dropping it drops the ticket: released.
    core.start_process(key, async move {
        let caught = catch_panic(async move { f().await }).await;
        let result = match Error::from_run(ticket.key(), caught) {
            Ok(value) => match ticket.complete(value.clone()).await {
                Ok(()) | Err(Error::ShutDown { .. }) => Ok(value),
                Err(e) => Err(e),
            },
            Err(e) => {
                ticket.release();
                Err(e)
            }
        };
        let _ = tx.send(result);
    })?;
    match rx.await {
        Ok(result) => result.map(Outcome::Fresh),
        Err(_) => Err(Error::process_lost(key)),
    }
}

async fn reserve_in<T>(
    core: &Core,
    ledger: &Arc<Ledger>,
    key: &str,
    options: IdempotencyOptions,
) -> Result<Reserved<T>, Error>
where
    T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
{
    if let Some(value) = fast_replay(core, ledger, key, &options)? {
        return Ok(Reserved::Replay(value));
    }
    Ok(match acquire(core, ledger, key, &options).await? {
        Acquired::Replay(value) => Reserved::Replay(value),
        Acquired::Owner(ticket) => Reserved::Fresh(Reservation::new(ticket)),
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::Duration;
    use tokio::time::Instant;

    use super::store::{Form, Pending, Record, ResultStore};
    use super::*;
    use crate::error::BoxError;

    /// Behaves like a store shared across processes: takes encoded values
    /// and answers after a round trip.
    #[derive(Default)]
    struct RemoteLike {
        records: Mutex<HashMap<String, (Arc<Record>, Instant)>>,
        fail_puts: AtomicBool,
        /// Holds the next lookup's answer (read at call time) until fired.
        stall_next_get: Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
    }

    impl ResultStore for RemoteLike {
        fn form(&self) -> Form {
            Form::Encoded
        }

        fn get(
            &self,
            key: &str,
            now: Instant,
        ) -> Pending<'_, Result<Option<Arc<Record>>, BoxError>> {
            let found = self
                .records
                .lock()
                .unwrap()
                .get(key)
                .filter(|(_, expires_at)| *expires_at > now)
                .map(|(record, _)| Arc::clone(record));
            let stall = self.stall_next_get.lock().unwrap().take();
            Pending::Later(Box::pin(async move {
                if let Some(stall) = stall {
                    let _ = stall.await;
                }
                tokio::task::yield_now().await;
                Ok(found)
            }))
        }

        fn put(
            &self,
            key: &str,
            record: Arc<Record>,
            ttl: Duration,
        ) -> Pending<'_, Result<(), BoxError>> {
            let key = key.to_owned();
            Pending::Later(Box::pin(async move {
                tokio::task::yield_now().await;
                if self.fail_puts.load(Ordering::SeqCst) {
                    return Err(Arc::new(std::io::Error::other("connection refused")) as BoxError);
                }
                let expires_at = Instant::now() + ttl;
                self.records
                    .lock()
                    .unwrap()
                    .insert(key, (record, expires_at));
                Ok(())
            }))
        }

        fn close(&self) {}
    }

    #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Charge {
        id: u64,
        note: String,
    }

    fn counted(
        runs: &Arc<AtomicUsize>,
        id: u64,
    ) -> impl FnOnce() -> std::pin::Pin<
        Box<dyn Future<Output = Result<Charge, std::io::Error>> + Send>,
    > + Send
    + 'static {
        let runs = Arc::clone(runs);
        move || {
            Box::pin(async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
                Ok(Charge {
                    id,
                    note: "paid".to_owned(),
                })
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_encoded_store_on_round_trips_runs_once_and_replays() {
        let runtime = Runtime::builder().start().await.unwrap();
        let core = &runtime.core;
        let store = Arc::new(RemoteLike::default());
        let ledger = Arc::new(Ledger::new(
            Arc::new(Counters::new()),
            usize::MAX,
            Box::new(Shared(Arc::clone(&store))),
        ));
        let runs = Arc::new(AtomicUsize::new(0));
        let options = IdempotencyOptions::new().with_fingerprint("fp");

        let (a, b) = tokio::join!(
            run_in(core, &ledger, "k", counted(&runs, 1), options.clone()),
            run_in(core, &ledger, "k", counted(&runs, 2), options.clone()),
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(a.is_fresh(), !b.is_fresh());
        assert_eq!(a.value(), b.value());

        let again = run_in(core, &ledger, "k", counted(&runs, 3), options.clone())
            .await
            .unwrap();
        assert_eq!(again, Outcome::Replay(a.into_inner()));
        assert_eq!(runs.load(Ordering::SeqCst), 1);

        let other_type = run_in(
            core,
            &ledger,
            "k",
            || async { Ok::<_, std::io::Error>(String::new()) },
            options.clone(),
        )
        .await;
        assert!(matches!(other_type, Err(Error::TypeMismatch { .. })));

        let mismatch = run_in(
            core,
            &ledger,
            "k",
            counted(&runs, 4),
            options.with_fingerprint("other"),
        )
        .await;
        assert!(matches!(mismatch, Err(Error::FingerprintMismatch { .. })));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_that_refuses_the_result_fails_closed_and_releases_the_key() {
        let runtime = Runtime::builder().start().await.unwrap();
        let core = &runtime.core;
        let store = Arc::new(RemoteLike::default());
        store.fail_puts.store(true, Ordering::SeqCst);
        let counters = Arc::new(Counters::new());
        let ledger = Arc::new(Ledger::new(
            Arc::clone(&counters),
            usize::MAX,
            Box::new(Shared(Arc::clone(&store))),
        ));
        let runs = Arc::new(AtomicUsize::new(0));

        let refused = run_in(
            core,
            &ledger,
            "k",
            counted(&runs, 1),
            IdempotencyOptions::new(),
        )
        .await;
        assert!(matches!(refused, Err(Error::StoreUnavailable { .. })));
        assert_eq!(counters.keys(), 0, "the key is released");

        store.fail_puts.store(false, Ordering::SeqCst);
        let retry = run_in(
            core,
            &ledger,
            "k",
            counted(&runs, 2),
            IdempotencyOptions::new(),
        )
        .await
        .unwrap();
        assert!(retry.is_fresh());
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_completion_between_lookup_and_claim_is_replayed_not_run_again() {
        let runtime = Runtime::builder().start().await.unwrap();
        let store = Arc::new(RemoteLike::default());
        let ledger = Arc::new(Ledger::new(
            Arc::new(Counters::new()),
            usize::MAX,
            Box::new(Shared(Arc::clone(&store))),
        ));
        let runs = Arc::new(AtomicUsize::new(0));
        let (fire, stalled) = tokio::sync::oneshot::channel();
        *store.stall_next_get.lock().unwrap() = Some(stalled);

        // Late looks first (and sees nothing), then stalls before claiming.
        let late = {
            let (runtime, ledger, f) = (runtime.clone(), Arc::clone(&ledger), counted(&runs, 2));
            tokio::spawn(async move {
                run_in(&runtime.core, &ledger, "k", f, IdempotencyOptions::new()).await
            })
        };
        tokio::task::yield_now().await;
        // Meanwhile another caller claims, runs, stores and frees the key.
        let first = run_in(
            &runtime.core,
            &ledger,
            "k",
            counted(&runs, 1),
            IdempotencyOptions::new(),
        )
        .await
        .unwrap();
        fire.send(()).unwrap();

        assert!(first.is_fresh());
        let late = late.await.unwrap().unwrap();
        assert_eq!(late, Outcome::Replay(first.into_inner()));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    /// Lets a test keep a handle on the store it gives the ledger.
    struct Shared(Arc<RemoteLike>);

    impl ResultStore for Shared {
        fn form(&self) -> Form {
            self.0.form()
        }
        fn get(
            &self,
            key: &str,
            now: Instant,
        ) -> Pending<'_, Result<Option<Arc<Record>>, BoxError>> {
            self.0.get(key, now)
        }
        fn put(
            &self,
            key: &str,
            record: Arc<Record>,
            ttl: Duration,
        ) -> Pending<'_, Result<(), BoxError>> {
            self.0.put(key, record, ttl)
        }
        fn close(&self) {
            self.0.close();
        }
    }
}
