//! OTP-style machinery for short-lived per-key processes, on tokio and ractor.
//!
//! `throttlebeam-supervisors` knows nothing about throttles: it is what an
//! actor-per-key runtime is built from. A [`Registry`] owns each busy key's
//! state; a temporary process, started under a partitioned [`Supervisor`],
//! owns that key's time and work and exits when the key goes idle; a
//! [`TtlTable`] keeps results that expire; a [`Tree`] of ractor actors
//! supervises the machinery and can live under a host's own supervisor.
//!
//! # Examples
//!
//! ```
//! # tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap().block_on(async {
//! use std::{sync::Arc, time::Duration};
//! use throttlebeam_supervisors::{Counters, Registry, SlotEntry, Tree, TreeConfig, TtlTable};
//! use tokio::time::Instant;
//!
//! let counters = Arc::new(Counters::new());
//! let tree = Tree::start(TreeConfig::default(), counters.clone()).await.unwrap();
//!
//! // Lookup-or-start, race-free: only the caller that finds the key
//! // vacant starts its process.
//! let registry = Arc::new(Registry::<String, u32>::new(counters.clone(), 10_000));
//! let started = registry.update("user-7", |slot| match slot {
//!     SlotEntry::Occupied(slot) => { slot.state += 1; None }
//!     SlotEntry::Vacant(vacant) => Some(vacant.insert(1).unwrap().generation()),
//! });
//! if let Some(generation) = started {
//!     let registry = registry.clone();
//!     tree.supervisor().start_child(7, async move {
//!         // ... the key's work and timers ...
//!         // Idle exit: compare-and-remove, never removing a successor.
//!         registry.remove_if("user-7", generation, |calls| *calls == 1);
//!     }).unwrap();
//! }
//!
//! // Results that expire, swept while any are held.
//! let results: Arc<TtlTable<String, u64>> = TtlTable::with_sweeper(counters.clone(), tree.sweeper());
//! results.insert("order-1".to_owned(), 42, Duration::from_secs(60));
//! assert_eq!(results.get("order-1"), Some(42));
//!
//! assert_eq!(tree.shutdown(Instant::now() + Duration::from_secs(1)).await, 0);
//! assert_eq!(tree.snapshot().keys, 0);
//! # });
//! ```
//!
//! # Pieces
//!
//! | piece | what it does |
//! |---|---|
//! | [`Registry`] | keyed map of slots, one per busy key: lookup-or-start under one shard lock, generation stamps, compare-and-remove on idle exit, a cap on keys |
//! | [`Supervisor`] | partitioned dynamic supervision of temporary per-key processes (one tokio task each), panics caught, graceful shutdown with a deadline |
//! | [`TtlTable`] | entries that expire, checked on every read, swept periodically; optionally capped by count and weight, oldest evicted first; compare-and-set per key ([`Update`]) |
//! | [`Sweeper`] | sweeps its [`Sweep`] targets every interval, only while they hold entries |
//! | [`Tree`] | the ractor supervision tree (root, partition actors, sweeper), startable under a host supervisor |
//! | [`Counters`] | keys tracked, timers armed, TTL entries; [`Tree::snapshot`] adds live processes |
//! | [`catch_panic`] | turns a panic inside a future into a [`Panic`] value |
//!
//! # Consistency model
//!
//! - Every [`Registry`] and [`TtlTable`] operation on one key runs under
//!   that key's shard lock: a caller sees the live slot or a vacancy it alone
//!   may fill. Nothing is ever held across an `.await`.
//! - A slot's [`Generation`] identifies one incarnation of its key; a process
//!   of an old incarnation can never remove its successor.
//! - Counts ([`Registry::len`], [`TtlTable::len`], [`Counters`]) count an
//!   entry just before it becomes visible and uncount it just after it is
//!   gone: exact once operations settle, never below the truth, briefly
//!   above it while removals are in flight. Dropping a registry or table
//!   releases its counts.
//! - A [`TtlTable`] never returns an expired entry, swept or not.
//! - [`Supervisor::shutdown`] waits for children and never cancels them.
//!
//! # Supervision and embedding
//!
//! Per-key processes are tokio tasks, not ractor actors (an idle ractor
//! actor costs about 8 KB): they are temporary, never restarted, and their
//! panics are caught and logged by their partition. Infrastructure (the
//! partition actors and the sweeper) is restarted by the tree's root within
//! a restart intensity; past it the root fails, and a host that started the
//! tree with [`Tree::start_linked`] receives `ActorFailed` for
//! [`Tree::root`]. The host restarts a failed tree with [`Tree::restart`],
//! keeping its supervisor, sweeper and sweep targets, so every handle works
//! again.
//!
//! ractor logs a span per actor at INFO; hosts usually filter with
//! `ractor=warn` (for example `RUST_LOG=info,ractor=warn`).

// The README's example runs as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod panic;
mod registry;
mod stats;
mod supervisor;
mod sweeper;
mod tree;
mod ttl;

pub use panic::{CatchPanic, Panic, catch_panic, catch_panic_fn};
pub use registry::{
    CapacityError, Generation, NoGeneration, Registry, Slot, SlotEntry, SlotGuard, Stamp,
    VacantSlot,
};
pub use stats::{Counters, Snapshot, TimerGuard};
pub use supervisor::{RunHere, StartError, Supervisor};
pub use sweeper::{Sweep, Sweeper};
pub use tree::{StartTreeError, Tree, TreeConfig};
pub use ttl::{TokioClock, TtlClock, TtlTable, Update};
