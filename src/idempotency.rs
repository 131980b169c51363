//! Idempotency: run an operation at most once per key, and hand its result
//! to every retry.
//!
//! A key in flight is a slot in the ledger's registry, claimed under one
//! shard lock; its function runs in a per-key process, so the first caller
//! going away does not cancel it. The holder renews its lease while it is
//! alive, so only a gone holder is ever taken over. Completed results live
//! in a store for their TTL (in memory: a capped TTL table swept by the
//! runtime's sweeper), and a replay is a lookup and a clone: no process, no
//! message.

#[cfg(feature = "redis")]
mod backend;
mod claim;
#[cfg(feature = "http")]
mod claimed;
mod config;
mod derived;
mod fence;
mod full_key;
mod options;
mod outcome;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
#[cfg(feature = "redis")]
mod redis;
mod reservation;
mod seam;
mod store;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use throttlebeam_supervisors::catch_panic_fn;
use tokio::time::Instant;

use self::claim::{Ledger, Settled, Step, Tally, Ticket};
#[cfg(feature = "http")]
pub(crate) use self::claimed::Claimed;
#[cfg(feature = "http")]
use self::claimed::ClaimedRun;
pub use self::derived::IdempotencyKey;
pub use self::fence::Fence;
#[cfg(feature = "http")]
pub(crate) use self::options::Fingerprint;
pub use self::options::{IdempotencyOptions, InFlight};
pub use self::outcome::IdempotencyOutcome;
pub use self::reservation::{IdempotencyReservation, IdempotencyReserved};
pub use self::seam::{
    ClaimReply, ClaimRequest, ClaimToken, DEFAULT_SHARED_MEMORY_KEYS, IdempotencyStore,
    IdempotencyStoreFuture, KeyChanged, MemoryIdempotencyStore, StoredResult,
};
use self::store::ResultTable;
use crate::cell::RunCell;
use crate::error::Error;
pub use crate::error::NotRecorded;
use crate::error::check_key;
use crate::job::Job;
use crate::key::shown;
use crate::runtime::{Core, Runtime, Service};
pub use crate::stats::IdempotencyStats;
use crate::stats::Stats;

/// Completed results a runtime keeps by default, see
/// [`RuntimeBuilder::with_max_idempotency_results`](crate::runtime::RuntimeBuilder::with_max_idempotency_results).
///
/// A stored result costs roughly 200 bytes (table entry, digest, value
/// cell, insertion-order slot) plus what its value holds, so 100,000 cost
/// about 20 MiB: bounded for any host, and enough to keep every key of a
/// service taking one new key a second for its whole default 24 h TTL. Past the cap the oldest results are evicted
/// first, which is an early expiry: a retry of an evicted key runs again.
pub const DEFAULT_MAX_IDEMPOTENCY_RESULTS: usize = 100_000;

/// The byte budget of the completed results a runtime keeps by default
/// (256 MiB), see
/// [`RuntimeBuilder::with_max_idempotency_bytes`](crate::runtime::RuntimeBuilder::with_max_idempotency_bytes).
///
/// The count cap alone would let 100,000 results of 1 MiB each take 100 GiB;
/// with this budget they take at most 256 MiB (about 250 of them), the
/// oldest evicted first.
pub const DEFAULT_MAX_IDEMPOTENCY_BYTES: usize = 256 << 20;

/// The idempotency part of a runtime: its ledger of keys in flight and its
/// results store.
///
/// Neither lives in the supervision tree, so a restart after a failed root
/// keeps both: a run still going on holds its key (a retry waits for it and
/// replays its result, never runs it a second time) and stored results are
/// still replayed.
pub(crate) struct State {
    ledger: Arc<Ledger>,
}

impl State {
    fn new(core: &Core) -> Self {
        let counters = Arc::clone(&core.counters);
        let sweeper = core.tree.sweeper();
        let config = config::IdempotencyConfig::of(core);
        let store = ResultTable::new(
            Arc::clone(&counters),
            sweeper,
            core.clock,
            config.max_results,
            config.max_bytes as u64,
        );
        let ledger = Arc::new(Ledger::new(
            counters,
            core.cap,
            store,
            config.shared_store(core),
        ));
        #[cfg(feature = "postgres")]
        if let Some(postgres) = &config.postgres {
            postgres::report_in(core, postgres);
        }
        Self { ledger }
    }

    /// This runtime's idempotency state.
    pub(crate) fn of(core: &Core) -> Arc<Self> {
        core.service(Self::new)
    }

    /// The ledger.
    pub(crate) fn ledger(&self) -> Arc<Ledger> {
        Arc::clone(&self.ledger)
    }

    /// This runtime's idempotency counters.
    pub(crate) fn stats(&self) -> IdempotencyStats {
        stats_of(&self.ledger)
    }
}

impl Service for State {
    fn stopped(&self) {
        self.ledger.shutdown();
    }

    // No `reset`: a restart loses nothing here (see the type's docs).

    fn stats(&self, stats: &mut Stats) {
        stats.idempotency = State::stats(self);
    }
}

/// Idempotent calls on an explicit [`Runtime`]; from [`Runtime::idempotency`].
///
/// A cheap handle (`Clone`). See [`IdempotencyHandle::run_with`] for the
/// behaviour and [`Idempotency`] for the same calls on the default runtime.
#[derive(Clone)]
pub struct IdempotencyHandle {
    runtime: Runtime,
    state: Arc<State>,
}

impl std::fmt::Debug for IdempotencyHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyHandle").finish_non_exhaustive()
    }
}

impl Runtime {
    /// Idempotent calls on this runtime.
    #[must_use]
    pub fn idempotency(&self) -> IdempotencyHandle {
        IdempotencyHandle {
            runtime: self.clone(),
            state: State::of(&self.core),
        }
    }
}

impl IdempotencyHandle {
    /// The runtime these calls run on.
    #[cfg(feature = "postgres")]
    pub(crate) fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// [`IdempotencyHandle::run_with`] with the default
    /// [`IdempotencyOptions`]: no scope, no fingerprint, TTL 24 h, lease
    /// 30 s, duplicates wait up to 30 s.
    ///
    /// # Errors
    ///
    /// As [`IdempotencyHandle::run_with`].
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// use throttlebeam::{IdempotencyOutcome, Runtime};
    ///
    /// let idempotency = Runtime::start().await?.idempotency();
    /// let send = || async { Ok::<_, std::io::Error>(7_u32) };
    /// assert_eq!(idempotency.run("mail:7", send).await?, IdempotencyOutcome::Fresh(7));
    /// assert_eq!(idempotency.run("mail:7", send).await?, IdempotencyOutcome::Replay(7));
    /// # Ok(()) }
    /// ```
    // A plain function returning `run_with`'s future: an `async fn` around it would hold that
    // future inside its own, one more copy on every call.
    pub fn run<'a, T, J>(
        &'a self,
        key: &'a str,
        f: J,
    ) -> impl Future<Output = Result<IdempotencyOutcome<T>, Error>> + 'a
    where
        J: Job<T>,
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    {
        self.run_with(key, IdempotencyOptions::new(), f)
    }

    /// Runs `f` at most once per key (within `options`' scope) and returns
    /// its value to this call and to every duplicate for the TTL.
    ///
    /// - No result and nobody holding the key: this call claims it, runs `f`
    ///   and gets [`IdempotencyOutcome::Fresh`]; the value is stored for the TTL.
    /// - A stored result: [`IdempotencyOutcome::Replay`] at once; `f` does not run.
    /// - Another call holds the key: with [`InFlight::Wait`] (the default)
    ///   this one waits, up to the wait timeout, and gets that call's value
    ///   as [`IdempotencyOutcome::Replay`]; with [`InFlight::Reject`] it
    ///   fails at once with [`Error::InFlight`]. If the holder fails,
    ///   panics or is gone, one waiting duplicate takes over and runs its
    ///   own `f`.
    ///
    /// `f` runs as the key's own process, driven in the caller's task (no
    /// task spawned): dropping this future does not cancel it, as the rest
    /// of the run moves into a task of its own; it runs to the end and its
    /// result is stored and replayed.
    /// While it runs, the process renews the key's lease every third of it,
    /// so a live run is never taken over and never runs twice, however
    /// long it takes. If `f` fails or panics, nothing is stored and the key
    /// is released, so a retry runs `f` again. If the process itself ends
    /// without finishing (its tokio runtime shut down, say), the key is
    /// released too (its owner is certainly gone).
    ///
    /// Once `f` has succeeded, nothing frees the key for another run: its
    /// value is stored, or the call ends in
    /// [`IdempotencyOutcome::Unrecorded`] with the value and the reason
    /// ([`NotRecorded`]), while the claim holds until it lapses in the store.
    /// With a shared store, the owner retries the store through failures of
    /// any kind (no answer, `OOM`, a refused command) until its claim has
    /// certainly lapsed there, and a [`Runtime::shutdown`] whose grace ends
    /// before `f` does still stores the result there.
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidKey`], [`Error::InvalidArgument`] (zero or over
    ///   [`MAX_TIMER`](crate::clock::MAX_TIMER) TTL, lease or wait timeout; empty or
    ///   over-long scope): nothing runs.
    /// - [`Error::FingerprintMismatch`]: the key completed or is in flight
    ///   with another fingerprint; `f` does not run.
    /// - [`Error::InFlight`]: with [`InFlight::Reject`], another call holds
    ///   the key; `f` does not run.
    /// - [`Error::Timeout`]: this duplicate waited its wait timeout while the
    ///   first call was still running (which carries on and stores its result).
    /// - [`Error::Failed`], [`Error::Panicked`]: `f` ran here and failed
    ///   (the key is released).
    /// - [`Error::TypeMismatch`]: the key's stored result is of another type.
    /// - [`Error::TooManyKeys`], [`Error::ShutDown`],
    ///   [`Error::StoreUnavailable`], [`Error::NoTokio`] (polled outside a
    ///   tokio runtime): nothing ran.
    ///
    /// Every error but [`Error::Failed`] and [`Error::Panicked`] means `f`
    /// did not run in this call. A run of `f` that succeeded but whose value
    /// is not the key's recorded result is not an error:
    /// [`IdempotencyOutcome::Unrecorded`] hands the value back with the
    /// reason, e.g. [`NotRecorded::ShutDown`] for a run that outlived the
    /// shutdown of a runtime with no shared store.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// use throttlebeam::{IdempotencyOptions, IdempotencyOutcome, Runtime};
    ///
    /// let idempotency = Runtime::start().await?.idempotency();
    /// let options = IdempotencyOptions::new().with_scope("tenant-1").with_fingerprint("order-9");
    /// let charge = || async { Ok::<_, std::io::Error>(String::from("ch_1")) };
    ///
    /// let first = idempotency.run_with("pay:9", options.clone(), charge).await?;
    /// assert_eq!(first, IdempotencyOutcome::Fresh("ch_1".to_owned()));
    /// let retry = idempotency.run_with("pay:9", options, charge).await?;
    /// assert_eq!(retry, IdempotencyOutcome::Replay("ch_1".to_owned()));
    /// # Ok(()) }
    /// ```
    #[allow(clippy::manual_async_fn)] // an `async fn` would hold its arguments twice
    pub fn run_with<'a, T, J>(
        &'a self,
        key: &'a str,
        options: IdempotencyOptions,
        f: J,
    ) -> impl Future<Output = Result<IdempotencyOutcome<T>, Error>> + 'a
    where
        J: Job<T>,
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    {
        async move {
            let core = &self.runtime.core;
            // A replay reads the ledger in force without taking a reference to it.
            if let Some(value) = fast_replay(core, &self.state.ledger, key, &options)? {
                return Ok(IdempotencyOutcome::Replay(value));
            }
            // The claim and the run, boxed: inline, their future (waits on a holder, the
            // shared store's round trips) would size every replay's future, which is moved
            // whole wherever it goes.
            Box::pin(self.run_after_miss(key, options, f)).await
        }
    }

    /// The replay fast path, then a claim made at once if the key is free: a stored
    /// result, or the key now held by this caller (run it with
    /// [`IdempotencyHandle::run_claim`]); `None` when only [`IdempotencyHandle::run_after_miss`]
    /// can tell (the key is in flight, or a shared store answers later). What `run_with` does
    /// first, without building a future, for a request with `fingerprint` instead of the
    /// one of `options` (so a caller's options can be shared by every request, unchanged).
    #[cfg(feature = "http")]
    pub(crate) fn look<T>(
        &self,
        key: &str,
        options: &IdempotencyOptions,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Option<Looked<T>>, Error>
    where
        T: DeserializeOwned + Clone + 'static,
    {
        check_key(key)?;
        options.check(key)?;
        self.runtime.core.check_open(key)?;
        self.state.ledger.look_now(key, options, fingerprint)
    }

    /// Runs `work` as the process of the key `claim` holds (`key`, as `claim` was looked up
    /// with), as [`IdempotencyHandle::run_with`] does once it holds a key: the value `work`
    /// comes to is stored (or the key released) before the run ends. `work` also comes to
    /// what its caller gets back besides that value (the run's output; an error when `work`
    /// panicked), so the value is never cloned for the caller. Dropped before it ends, the
    /// run moves into a process of its own.
    #[cfg(feature = "http")]
    pub(crate) fn run_claim<T, E, H, W>(
        &self,
        key: &str,
        claim: Claimed,
        work: W,
    ) -> Result<throttlebeam_supervisors::RunHere<Result<H, Error>>, Error>
    where
        W: Future<Output = (Result<T, E>, H)> + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
        H: Send + 'static,
        T: Serialize + DeserializeOwned + Send + Sync + 'static,
    {
        // Boxed where it is built, as in `run_claimed`.
        self.runtime
            .core
            .run_here_boxed(key, Box::pin(ClaimedRun::new(claim, work)))
    }

    /// [`IdempotencyHandle::run_with`] past its replay fast path (or for a caller that has
    /// just seen [`IdempotencyHandle::try_replay`] find nothing): the run, without reading the
    /// result table again (a result stored since is still found when the key is claimed).
    ///
    /// A plain function returning the run's future, not an `async fn` around it: a
    /// forwarding layer of its own would be one more copy of the whole run's future.
    pub(crate) fn run_after_miss<'a, T, J>(
        &'a self,
        key: &'a str,
        options: IdempotencyOptions,
        f: J,
    ) -> impl Future<Output = Result<IdempotencyOutcome<T>, Error>> + 'a
    where
        J: Job<T>,
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    {
        run_claimed(&self.runtime.core, self.state.ledger(), key, f, options)
    }

    /// Claims `key` by hand, for a result produced somewhere other than one
    /// function call: returns the stored result as
    /// [`IdempotencyReserved::Replay`], or an [`IdempotencyReservation`] to
    /// [`complete`](IdempotencyReservation::complete) or
    /// [`release`](IdempotencyReservation::release).
    ///
    /// The reservation renews the key's lease in the background for as long
    /// as it exists, so it is never taken over while held; dropping it
    /// unfinished releases the key. A key in flight (another run or
    /// reservation) is handled exactly as [`IdempotencyHandle::run_with`]
    /// does: waited for (its result replayed, or the key taken over if the
    /// holder releases it, fails or is gone) or rejected, per the options.
    ///
    /// # Errors
    ///
    /// As [`IdempotencyHandle::run_with`], except the ones about running a
    /// function.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// use throttlebeam::{IdempotencyOptions, idempotency::IdempotencyReserved, Runtime};
    ///
    /// let idempotency = Runtime::start().await?.idempotency();
    /// let IdempotencyReserved::Fresh(reservation) =
    ///     idempotency.reserve::<String>("job:4", IdempotencyOptions::new()).await?
    /// else {
    ///     unreachable!("nobody else used job:4");
    /// };
    /// reservation.complete("done".to_owned()).await?;
    /// let again = idempotency.reserve::<String>("job:4", IdempotencyOptions::new()).await?;
    /// assert!(matches!(again, IdempotencyReserved::Replay(s) if s == "done"));
    /// # Ok(()) }
    /// ```
    pub async fn reserve<T>(
        &self,
        key: &str,
        options: IdempotencyOptions,
    ) -> Result<IdempotencyReserved<T>, Error>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    {
        let core = &self.runtime.core;
        reserve_in(core, &self.state.ledger(), key, options).await
    }

    /// Counters of this runtime's idempotent calls and its stored results.
    #[must_use]
    pub fn stats(&self) -> IdempotencyStats {
        self.state.stats()
    }
}

fn stats_of(ledger: &Ledger) -> IdempotencyStats {
    let tally = &ledger.tally;
    let counts = ledger.store.counts();
    IdempotencyStats {
        fresh: tally.fresh.load(Ordering::Relaxed),
        replays: tally.replays.load(Ordering::Relaxed),
        fingerprint_mismatches: tally.fingerprint_mismatches.load(Ordering::Relaxed),
        takeovers: tally.takeovers.load(Ordering::Relaxed),
        in_flight_rejections: tally.in_flight_rejections.load(Ordering::Relaxed),
        timeouts: tally.timeouts.load(Ordering::Relaxed),
        failures_after_caller_left: tally.failures_after_caller_left.load(Ordering::Relaxed),
        evictions: counts.evictions,
        stored_results: counts.stored,
        stored_bytes: counts.bytes,
    }
}

/// Idempotent calls on the default runtime.
///
/// A client that retries a request sends the same key and gets the first
/// request's result back instead of running the operation again, including
/// while the first request is still running: duplicates wait for it and
/// share its result (or, with [`InFlight::Reject`], are told to retry
/// later). See [`IdempotencyHandle::run_with`] for the details and
/// [`IdempotencyOptions`] for scope, fingerprint, TTL, lease, wait timeout
/// and in-flight policy.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
/// use throttlebeam::{Error, Idempotency, IdempotencyOptions, IdempotencyOutcome};
///
/// let options = IdempotencyOptions::new().with_scope("tenant-42").with_fingerprint("order-17");
/// let charge = || async { Ok::<_, std::io::Error>(1700_u64) };
/// match Idempotency::run_with("key-from-client", options, charge).await {
///     Ok(IdempotencyOutcome::Fresh(charge)) => assert_eq!(charge, 1700), // ran in this call
///     Ok(IdempotencyOutcome::Replay(charge)) => assert_eq!(charge, 1700), // another call ran it
///     Ok(IdempotencyOutcome::Unrecorded(charge, _)) => assert_eq!(charge, 1700), // ran, not stored
///     Err(Error::FingerprintMismatch { .. }) => {} // key reused for another request
///     Err(Error::Timeout { .. }) => {}             // the first call is still running
///     Err(e) => return Err(e),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Idempotency;

impl Idempotency {
    /// [`IdempotencyHandle::run`] on the default runtime.
    ///
    /// # Errors
    ///
    /// As [`IdempotencyHandle::run_with`], plus [`Error::Start`] if the
    /// default runtime could not start.
    pub async fn run<T, J>(key: &str, f: J) -> Result<IdempotencyOutcome<T>, Error>
    where
        J: Job<T>,
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    {
        Runtime::global()?.idempotency().run(key, f).await
    }

    /// [`IdempotencyHandle::run_with`] on the default runtime.
    ///
    /// # Errors
    ///
    /// As [`IdempotencyHandle::run_with`], plus [`Error::Start`] if the
    /// default runtime could not start.
    pub async fn run_with<T, J>(
        key: &str,
        options: IdempotencyOptions,
        f: J,
    ) -> Result<IdempotencyOutcome<T>, Error>
    where
        J: Job<T>,
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    {
        Runtime::global()?
            .idempotency()
            .run_with(key, options, f)
            .await
    }

    /// [`IdempotencyHandle::reserve`] on the default runtime.
    ///
    /// # Errors
    ///
    /// As [`IdempotencyHandle::reserve`], plus [`Error::Start`] if the
    /// default runtime could not start.
    pub async fn reserve<T>(
        key: &str,
        options: IdempotencyOptions,
    ) -> Result<IdempotencyReserved<T>, Error>
    where
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    {
        Runtime::global()?.idempotency().reserve(key, options).await
    }
}

/// What [`IdempotencyHandle::look`] found at once.
#[cfg(feature = "http")]
pub(crate) enum Looked<T> {
    /// A stored result.
    Replay(T),
    /// The key is now this caller's.
    Owner(Claimed),
}

/// What [`acquire`] ended with.
enum Acquired<T> {
    Replay(T),
    Owner(Ticket),
}

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
    ledger.try_replay(key, options).transpose()
}

/// How long a rejected duplicate should wait before retrying: until its
/// holder next has to show it is alive (a retry then replays, still finds
/// the key in flight, or takes it over), at most a second, at least 1 ms.
fn retry_hint(lease_until: Option<Instant>, now: Instant) -> Duration {
    hint(lease_until.map_or(Duration::ZERO, |lease| lease.saturating_duration_since(now)))
}

/// [`retry_hint`] for a holder whose lease has `left` to run (as a shared
/// store reports it, possibly huge: never added to an instant).
fn hint(left: Duration) -> Duration {
    const MAX_HINT: Duration = Duration::from_secs(1);
    left.clamp(Duration::from_millis(1), MAX_HINT)
}

/// Where a claim that found its key held waits: on the holder here, or (boxed) on the
/// holder on another instance.
enum Look<W> {
    Here(Arc<RunCell<Settled>>, Option<Instant>),
    Elsewhere(W),
}

/// Looks at the key until it replays, is held by this caller, or the wait
/// timeout passes (or, with [`InFlight::Reject`], until it is found in flight).
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
        // The step is taken apart in a statement of its own, and the waits come after it:
        // a step kept across a wait would size every run's future.
        let look = match ledger.attempt(key, options, now, deadline).await? {
            Step::Replay(value) => return Ok(Acquired::Replay(value)),
            Step::Owner(ticket) => {
                Tally::bump(&ledger.tally.fresh);
                return Ok(Acquired::Owner(ticket));
            }
            Step::Wait { cell, lease_until } => Look::Here(cell, lease_until),
            Step::Remote { ticket, lease_left } => {
                if options.in_flight() == InFlight::Reject {
                    Tally::bump(&ledger.tally.in_flight_rejections);
                    // Dropping the ticket frees the local claim for the next look.
                    return Err(Error::InFlight {
                        key: shown(key),
                        retry_after: hint(lease_left),
                    });
                }
                // Boxed: this rare wait (a key in flight on another instance) would
                // otherwise size, and be copied with, every run's future.
                Look::Elsewhere(Box::pin(ledger.wait_remote(
                    ticket,
                    key,
                    lease_left,
                    deadline,
                    options.wait_timeout(),
                )))
            }
        };
        let (cell, lease_until) = match look {
            Look::Here(cell, lease_until) => (cell, lease_until),
            Look::Elsewhere(waited) => match waited.await? {
                Step::Replay(value) => return Ok(Acquired::Replay(value)),
                Step::Owner(ticket) => {
                    Tally::bump(&ledger.tally.fresh);
                    return Ok(Acquired::Owner(ticket));
                }
                // wait_remote ends only in a replay or a claim.
                Step::Wait { .. } | Step::Remote { .. } => {
                    now = Instant::now();
                    continue;
                }
            },
        };
        if options.in_flight() == InFlight::Reject {
            Tally::bump(&ledger.tally.in_flight_rejections);
            return Err(Error::InFlight {
                key: shown(key),
                retry_after: retry_hint(lease_until, now),
            });
        }
        let until = lease_until.map_or(deadline, |lease| lease.min(deadline));
        match tokio::time::timeout_at(until, cell.wait()).await {
            Ok(Ok(Settled::Done(record))) => {
                return ledger
                    .replay(&record, key, options.fingerprint().as_ref())
                    .map(Acquired::Replay);
            }
            // Released, failed, taken over or shut down: look again.
            Ok(_) => now = Instant::now(),
            Err(_) => {
                now = Instant::now();
                if now >= deadline {
                    Tally::bump(&ledger.tally.timeouts);
                    return Err(Error::Timeout {
                        key: shown(key),
                        after: options.wait_timeout(),
                    });
                }
                // The holder's lease was due: look again. A live holder has
                // renewed it (wait on); a gone one has not (take the key over).
            }
        }
    }
}

/// The replay fast path, then [`run_claimed`]: what [`IdempotencyHandle::run_with`] does, on
/// a given ledger.
#[cfg(test)]
async fn run_in<T, J>(
    core: &Core,
    ledger: &Arc<Ledger>,
    key: &str,
    f: J,
    options: IdempotencyOptions,
) -> Result<IdempotencyOutcome<T>, Error>
where
    J: Job<T>,
    T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
{
    if let Some(value) = fast_replay(core, ledger, key, &options)? {
        return Ok(IdempotencyOutcome::Replay(value));
    }
    run_claimed(core, Arc::clone(ledger), key, f, options).await
}

/// Claims `key` (or replays what the claim finds, or waits for its holder) and
/// runs `f` as the key's process.
///
/// A plain function around an `async move` block, not an `async fn`: an `async fn` keeps its
/// arguments twice in its future (as captured, and as the body's locals), and `f` holds the
/// caller's whole request.
#[allow(clippy::manual_async_fn)] // an `async fn` would hold its arguments twice
fn run_claimed<'a, T, J>(
    core: &'a Core,
    ledger: Arc<Ledger>,
    key: &'a str,
    f: J,
    options: IdempotencyOptions,
) -> impl Future<Output = Result<IdempotencyOutcome<T>, Error>> + 'a
where
    J: Job<T>,
    T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
{
    async move {
        let ticket = match acquire(core, &ledger, key, &options).await? {
            Acquired::Replay(value) => return Ok(IdempotencyOutcome::Replay(value)),
            Acquired::Owner(ticket) => ticket,
        };
        // The run is the key's process, driven in this task (no spawn, no
        // hand-off); if this caller leaves mid-run, the rest moves into a
        // process of its own and still completes. If it never starts, or is
        // dropped before it ends (its tokio runtime went away), dropping it
        // drops the ticket: the key is released. Boxed where it is built: it
        // holds `f`'s whole future.
        let run = core.run_here_boxed(key, Box::pin(owned_run(ticket, f)))?;
        run.await
    }
}

/// The run a claim's owner drives: `f` under `ticket`'s lease, then its result completed (or
/// the key released). The work's future is dropped before completing, so the two never take
/// room in this future at once.
#[allow(clippy::manual_async_fn)] // an `async fn` would hold its arguments twice
fn owned_run<T, J>(
    ticket: Ticket,
    f: J,
) -> impl Future<Output = Result<IdempotencyOutcome<T>, Error>> + Send + 'static
where
    J: Job<T>,
    T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
{
    async move {
        // The run moves into a task of its own when its caller leaves: a
        // task other than this one at the end means nobody sees the outcome.
        let started_in = tokio::task::try_id();
        let ledger = ticket.ledger();
        let caught = {
            // The function sees its claim's fence (`Fence::current`).
            let work = std::pin::pin!(ticket.fence().scope(catch_panic_fn(f)));
            ticket.hold(work).await
        };
        // The one decision of how a run ends: work that ran is completed (recorded, or told
        // why not, never released); work that failed releases the key.
        let outcome = match ran(&ticket, caught) {
            Ok(value) => match ticket.complete(value.clone()).await {
                Ok(()) => Ok(IdempotencyOutcome::Fresh(value)),
                Err(unrecorded) => Ok(IdempotencyOutcome::Unrecorded(value, unrecorded.why)),
            },
            Err(e) => {
                ticket.release();
                Err(e)
            }
        };
        if tokio::task::try_id() != started_in
            && let Err(error) = &outcome
        {
            failed(Some(&ledger), error);
        }
        outcome
    }
}

/// Counts and logs the `error` of a run whose caller is gone (`gone` is its ledger): nobody
/// else sees it. (A run that ran but was not recorded is logged where that is decided.)
fn failed(gone: Option<&Ledger>, error: &Error) {
    let Some(ledger) = gone else {
        return;
    };
    Tally::bump(&ledger.tally.failures_after_caller_left);
    let key = error.key().unwrap_or_default();
    let error = crate::error::with_causes(error);
    tracing::warn!(key, %error, "idempotency run failed after its caller left");
}

/// What `f` came to, as [`Error::from_run`] tells it, naming the key only in an error: a run
/// that succeeds never builds the key's message form.
fn ran<T, E>(
    ticket: &Ticket,
    caught: Result<Result<T, E>, throttlebeam_supervisors::Panic>,
) -> Result<T, Error>
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    match caught {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(Error::failed(&shown(ticket.key()), e)),
        Err(panic) => Err(Error::panicked(&shown(ticket.key()), &panic)),
    }
}

async fn reserve_in<T>(
    core: &Core,
    ledger: &Arc<Ledger>,
    key: &str,
    options: IdempotencyOptions,
) -> Result<IdempotencyReserved<T>, Error>
where
    T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
{
    if let Some(value) = fast_replay(core, ledger, key, &options)? {
        return Ok(IdempotencyReserved::Replay(value));
    }
    Ok(match acquire(core, ledger, key, &options).await? {
        Acquired::Replay(value) => IdempotencyReserved::Replay(value),
        Acquired::Owner(ticket) => IdempotencyReserved::Fresh(IdempotencyReservation::new(ticket)?),
    })
}

#[cfg(test)]
mod tests;
