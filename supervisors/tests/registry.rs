//! Registry: lookup-or-start races, compare-and-remove, cap, counts.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use throttlebeam_supervisors::{
    CapacityError, Counters, Generation, Registry, SlotEntry, Sweep, Tree, TreeConfig,
};
use tokio::time::Instant;

/// A key's state in the race tests: callers inside the key right now.
#[derive(Debug)]
struct Busy {
    pending: u32,
}

/// Lookup-or-start: joins the live incarnation or starts one. Returns the
/// incarnation joined and whether this call started it.
fn acquire(registry: &Registry<String, Busy>, key: &str) -> (Generation, bool) {
    registry.update(key, |entry| match entry {
        SlotEntry::Occupied(slot) => {
            slot.state.pending += 1;
            (slot.generation(), false)
        }
        SlotEntry::Vacant(vacant) => {
            let slot = vacant.insert(Busy { pending: 1 }).expect("no cap");
            (slot.generation(), true)
        }
    })
}

/// Leaves the incarnation `generation` and removes it if it went idle.
fn release(registry: &Registry<String, Busy>, key: &str, generation: Generation) -> bool {
    registry
        .with_slot(key, |slot| {
            // A slot cannot be replaced while one of its callers is inside.
            assert_eq!(
                slot.generation(),
                generation,
                "ABA: slot replaced under a caller"
            );
            slot.state.pending -= 1;
        })
        .expect("slot removed while a caller was inside");
    registry
        .remove_if(key, generation, |busy| busy.pending == 0)
        .is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_or_start_race_keeps_counts_exact_and_has_no_aba() {
    const TASKS: usize = 8;
    const ROUNDS: usize = 2_000;
    const KEYS: [&str; 3] = ["a", "b", "c"];

    let counters = Arc::new(Counters::new());
    let registry = Arc::new(Registry::<String, Busy>::new(counters.clone(), usize::MAX));
    let started = Arc::new(AtomicUsize::new(0));
    let removed = Arc::new(AtomicUsize::new(0));

    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let (registry, started, removed) = (registry.clone(), started.clone(), removed.clone());
            tokio::spawn(async move {
                let mut dead: Vec<(&str, Generation)> = Vec::new();
                for round in 0..ROUNDS {
                    let key = KEYS[(task + round) % KEYS.len()];
                    let (generation, fresh) = acquire(&registry, key);
                    started.fetch_add(usize::from(fresh), Ordering::Relaxed);
                    if round % 3 == 0 {
                        tokio::task::yield_now().await;
                    }
                    // An incarnation that was removed never matches again.
                    for &(key, old) in dead.iter().rev().take(4) {
                        assert!(registry.remove_if(key, old, |_| true).is_none());
                    }
                    assert!(registry.len() <= KEYS.len());
                    if release(&registry, key, generation) {
                        removed.fetch_add(1, Ordering::Relaxed);
                        dead.push((key, generation));
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }

    assert_eq!(registry.len(), 0);
    assert_eq!(counters.keys(), 0);
    assert_eq!(
        started.load(Ordering::Relaxed),
        removed.load(Ordering::Relaxed)
    );
    assert!(started.load(Ordering::Relaxed) >= KEYS.len());
}

#[test]
fn an_old_generation_never_removes_its_successor() {
    let counters = Arc::new(Counters::new());
    let registry = Registry::<String, Busy>::new(counters.clone(), usize::MAX);

    let (first, _) = acquire(&registry, "k");
    assert!(release(&registry, "k", first));
    let (second, fresh) = acquire(&registry, "k");
    assert!(fresh);
    assert_ne!(first, second);

    assert!(registry.remove_if("k", first, |_| true).is_none());
    assert_eq!(
        registry.with_slot("k", |slot| slot.generation()),
        Some(second)
    );
    // The right generation with a failing predicate removes nothing either.
    assert!(
        registry
            .remove_if("k", second, |busy| busy.pending == 0)
            .is_none()
    );
    assert_eq!((registry.len(), counters.keys()), (1, 1));
}

#[test]
fn update_finds_the_live_slot_without_inserting() {
    let registry = Registry::<String, u32>::new(Arc::new(Counters::new()), usize::MAX);
    let inserted = registry.update("k", |entry| match entry {
        SlotEntry::Vacant(vacant) => {
            assert_eq!(vacant.key(), "k");
            vacant.insert(1).unwrap().generation()
        }
        SlotEntry::Occupied(_) => unreachable!("empty registry"),
    });
    let found = registry.update("k", |entry| match entry {
        SlotEntry::Occupied(slot) => {
            slot.state += 1;
            slot.generation()
        }
        SlotEntry::Vacant(_) => unreachable!("key inserted"),
    });
    assert_eq!(inserted, found);
    assert_eq!(registry.with_slot("k", |slot| slot.state), Some(2));
    assert_eq!(registry.with_slot("missing", |slot| slot.state), None);
    // A vacancy left unfilled inserts nothing.
    registry.update("other", |_| ());
    assert_eq!(registry.len(), 1);
}

#[test]
fn cap_reached_refuses_and_inserts_nothing() {
    let counters = Arc::new(Counters::new());
    let registry = Registry::<String, u32>::new(counters.clone(), 2);
    let insert = |key: &str| {
        registry.update(key, |entry| match entry {
            SlotEntry::Vacant(vacant) => vacant.insert(0).map(|slot| slot.generation()),
            SlotEntry::Occupied(_) => unreachable!("fresh key"),
        })
    };
    insert("a").unwrap();
    insert("b").unwrap();
    assert_eq!(insert("c").unwrap_err(), CapacityError { cap: 2 });
    assert_eq!(registry.with_slot("c", |_| ()), None);
    assert_eq!((registry.len(), counters.keys()), (2, 2));

    // The cap is shared by every registry counting in the same counters.
    let sibling = Registry::<String, u32>::new(counters.clone(), 2);
    let refused = sibling.update("x", |entry| match entry {
        SlotEntry::Vacant(vacant) => vacant.insert(0).map(|_| ()),
        SlotEntry::Occupied(_) => unreachable!("fresh key"),
    });
    assert!(refused.is_err());
    assert_eq!(sibling.len(), 0);

    // Freeing a key makes room again.
    let generation = registry.with_slot("a", |slot| slot.generation()).unwrap();
    registry.remove_if("a", generation, |_| true).unwrap();
    insert("c").unwrap();
    assert_eq!(counters.keys(), 2);
}

/// A caller the cap refused, which finds room made since (another caller's
/// pass, or keys removed) when it comes to make room, tries again without a
/// pass: one would free little, and a pass that frees little holds back
/// the next refused caller.
#[tokio::test(start_paused = true)]
async fn a_refused_caller_that_finds_room_tries_again_without_a_pass() {
    let counters = Arc::new(Counters::new());
    let registry = Registry::<u32, bool>::new(counters.clone(), 2);
    let add = |key, live| {
        registry.update(&key, |slot| match slot {
            SlotEntry::Vacant(vacant) => vacant.insert(live).is_ok(),
            SlotEntry::Occupied(_) => true,
        })
    };
    assert!(add(1, true) && add(2, false));
    // Two callers are refused; the first one's pass frees key 2 (over).
    assert!(!add(3, true) && !add(4, true));
    assert!(registry.retain_when_full(|_, live| *live));
    // The second comes to make room a while later: there is room already.
    tokio::time::advance(Duration::from_millis(5)).await;
    assert!(registry.retain_when_full(|_, _| panic!("a pass while there is room")));
    assert!(add(4, true));
    // Full of live keys: the next refused caller gets a pass at once.
    assert!(!add(5, true));
    let mut visited = 0;
    assert!(registry.retain_when_full(|_, _| {
        visited += 1;
        true
    }));
    assert_eq!((visited, counters.keys()), (2, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cap_holds_under_concurrent_inserts() {
    const CAP: usize = 100;
    let counters = Arc::new(Counters::new());
    let registry = Arc::new(Registry::<String, u32>::new(counters.clone(), CAP));
    let tasks: Vec<_> = (0..4)
        .map(|task| {
            let registry = registry.clone();
            tokio::spawn(async move {
                let mut refused = 0;
                for i in 0..100 {
                    let key = format!("{task}-{i}");
                    let result = registry.update(&*key, |entry| match entry {
                        SlotEntry::Vacant(vacant) => vacant.insert(0).map(|_| ()),
                        SlotEntry::Occupied(_) => unreachable!("fresh key"),
                    });
                    refused += usize::from(result.is_err());
                }
                refused
            })
        })
        .collect();
    let mut refused = 0;
    for task in tasks {
        refused += task.await.unwrap();
    }
    assert_eq!(refused, 400 - CAP);
    assert_eq!((registry.len(), counters.keys()), (CAP, CAP));
}

fn filled(counters: &Arc<Counters>, n: u32) -> Registry<u32, u32> {
    let registry = Registry::new(counters.clone(), usize::MAX);
    for key in 0..n {
        registry.update(&key, |entry| match entry {
            SlotEntry::Vacant(vacant) => {
                vacant.insert(key).unwrap();
            }
            SlotEntry::Occupied(_) => unreachable!("fresh key"),
        });
    }
    registry
}

#[test]
fn retain_and_drain_keep_counts_exact() {
    let counters = Arc::new(Counters::new());
    let registry = filled(&counters, 10);
    assert_eq!((registry.len(), counters.keys()), (10, 10));

    assert_eq!(registry.retain(|_, n| *n % 2 == 0), 5);
    assert_eq!((registry.len(), counters.keys()), (5, 5));
    assert_eq!(registry.with_slot(&3, |_| ()), None);

    let mut drained = registry.drain();
    drained.sort_unstable();
    assert_eq!(drained, vec![(0, 0), (2, 2), (4, 4), (6, 6), (8, 8)]);
    assert!(registry.is_empty());
    assert_eq!(counters.keys(), 0);
}

#[test]
fn retain_counts_removals_even_when_the_predicate_panics() {
    let counters = Arc::new(Counters::new());
    let registry = filled(&counters, 10);
    let mut seen = 0;
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        registry.retain(|_, _| {
            seen += 1;
            assert!(seen < 5, "keep panicked");
            false
        })
    }));
    assert!(panicked.is_err());
    assert_eq!(registry.len(), 6);
    assert_eq!(counters.keys(), 6);
    assert_eq!(registry.drain().len(), 6);
}

#[test]
fn dropping_a_registry_releases_its_keys() {
    let counters = Arc::new(Counters::new());
    let registry = filled(&counters, 3);
    let other = filled(&counters, 2);
    assert_eq!(counters.keys(), 5);
    drop(registry);
    assert_eq!(counters.keys(), 2);
    drop(other);
    assert_eq!(counters.keys(), 0);
}

/// Throttle-style windows: a slot lives until its deadline.
struct Windows {
    registry: Registry<String, Instant>,
}

impl Sweep for Windows {
    fn sweep(&self, now: Instant) -> usize {
        self.registry.retain(|_, until| *until > now)
    }
}

fn open_window(windows: &Windows, key: &str, length: Duration) {
    windows.registry.update(key, |entry| match entry {
        SlotEntry::Vacant(vacant) => {
            vacant.insert(Instant::now() + length).unwrap();
        }
        SlotEntry::Occupied(slot) => slot.state = Instant::now() + length,
    });
}

#[tokio::test(start_paused = true)]
async fn with_sweeper_kicks_on_empty_to_non_empty() {
    let interval = Duration::from_secs(10);
    let counters = Arc::new(Counters::new());
    let config = TreeConfig::default().with_sweep_interval(interval);
    let tree = Tree::start(config, counters.clone()).await.unwrap();
    let windows = Arc::new(Windows {
        registry: Registry::with_sweeper(counters.clone(), usize::MAX, tree.sweeper()),
    });
    let weak = Arc::downgrade(&windows);
    tree.sweeper().register(weak);
    support::settle().await;
    assert_eq!(counters.timers(), 0, "dormant while empty");

    open_window(&windows, "a", Duration::from_secs(5));
    support::settle().await;
    assert_eq!(counters.timers(), 1, "the first key wakes the sweeper");
    open_window(&windows, "b", Duration::from_secs(5));
    support::settle().await;
    assert_eq!(counters.timers(), 1, "one tick however many keys");

    tokio::time::advance(interval).await;
    support::settle().await;
    assert!(windows.registry.is_empty());
    assert_eq!((counters.keys(), counters.timers()), (0, 0));

    open_window(&windows, "c", Duration::from_secs(5));
    support::settle().await;
    assert_eq!(
        counters.timers(),
        1,
        "empty to non-empty again wakes it again"
    );
    tokio::time::advance(interval).await;
    support::settle().await;
    assert_eq!((counters.keys(), counters.timers()), (0, 0));

    tree.shutdown(Instant::now()).await;
}

#[test]
fn a_swept_flood_gives_its_memory_back() {
    let registry = Registry::<u32, u64>::new(Arc::new(Counters::new()), usize::MAX);
    for key in 0..100_000u32 {
        registry.update(&key, |slot| {
            if let SlotEntry::Vacant(vacant) = slot {
                vacant.insert(u64::from(key)).unwrap();
            }
        });
    }
    let peak = registry.capacity();
    assert!(peak >= 100_000);
    assert_eq!(registry.retain(|key, _| *key < 10), 10);
    assert!(
        registry.capacity() < peak / 8,
        "capacity {} kept after sweeping down from {peak}",
        registry.capacity()
    );
}
