//! OTP-style machinery for short-lived per-key processes, on tokio and ractor.
//!
//! `throttlebeam-supervisors` knows nothing about throttles. It provides the
//! pieces an actor-per-key runtime is built from:
//!
//! | piece | what it does |
//! |---|---|
//! | [`Registry`] | a keyed map of slots, one per busy key: race-free lookup-or-start under one shard lock, generation stamps, compare-and-remove on idle exit |
//! | [`Supervisor`] | partitioned dynamic supervision of temporary per-key processes (one tokio task each), panics caught, graceful shutdown |
//! | [`TtlTable`] | entries that expire, checked on every read, swept periodically |
//! | [`Sweeper`] | a ractor actor that sweeps its targets every interval, only while they hold entries |
//! | [`Tree`] | the ractor supervision tree (root, partition actors, sweeper), startable under a host supervisor |
//! | [`Counters`] | keys tracked, live processes, timers scheduled, TTL entries |
//!
//! The principle: the map owns state, the process owns time and work. Hot
//! paths touch the registry only; a process exists while its key has a
//! timer, a running function or a lease.
//!
//! # Examples
//!
//! ```
//! # tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap().block_on(async {
//! use std::{sync::Arc, time::Duration};
//! use throttlebeam_supervisors::{Counters, Tree, TreeConfig, TtlTable};
//!
//! let counters = Arc::new(Counters::new());
//! let tree = Tree::start(TreeConfig::default(), counters.clone()).await.unwrap();
//! let table: Arc<TtlTable<String, u64>> = TtlTable::with_sweeper(counters.clone(), tree.sweeper());
//! table.insert("order-1".to_owned(), 42, Duration::from_secs(60));
//! assert_eq!(table.get("order-1"), Some(42));
//! assert_eq!(tree.snapshot().ttl_entries, 1);
//! tree.shutdown(tokio::time::Instant::now() + Duration::from_secs(1)).await;
//! # });
//! ```
//!
//! ractor logs a span per actor at INFO; hosts usually filter with `ractor=warn`.

mod panic;
mod registry;
mod stats;
mod supervisor;
mod sweeper;
mod tree;
mod ttl;

pub use panic::{CatchPanic, Panic, catch_panic};
pub use registry::{CapacityError, Generation, Registry, Slot, SlotEntry, SlotGuard, VacantSlot};
pub use stats::{Counters, Snapshot, TimerGuard};
pub use supervisor::{StartError, Supervisor};
pub use sweeper::{Sweep, Sweeper};
pub use tree::{StartTreeError, Tree, TreeConfig};
pub use ttl::TtlTable;
