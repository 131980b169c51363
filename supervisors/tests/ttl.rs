//! TTL table: expiry on read, counts, and sweeping under a tree.

mod support;

use std::sync::Arc;
use std::time::Duration;

use throttlebeam_supervisors::{Counters, Sweep, Tree, TreeConfig, TtlTable, Update};
use tokio::time::Instant;

fn table() -> (Arc<Counters>, TtlTable<String, u32>) {
    let counters = Arc::new(Counters::new());
    (counters.clone(), TtlTable::new(counters))
}

#[tokio::test(start_paused = true)]
async fn an_expired_entry_is_never_returned_even_before_sweeping() {
    let (counters, table) = table();
    table.insert("k".to_owned(), 1, Duration::from_secs(5));
    tokio::time::advance(Duration::from_millis(4_999)).await;
    assert_eq!(table.get("k"), Some(1));

    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(table.get("k"), None, "expired at exactly its TTL");
    // The read removed it.
    assert_eq!((table.len(), counters.ttl_entries()), (0, 0));
    assert_eq!(table.get("k"), None);
}

#[tokio::test(start_paused = true)]
async fn get_at_reads_as_of_a_given_instant() {
    let (_, table) = table();
    let start = Instant::now();
    table.insert("k".to_owned(), 1, Duration::from_secs(5));
    assert_eq!(table.get_at("k", start + Duration::from_secs(4)), Some(1));
    assert_eq!(table.get_at("k", start + Duration::from_secs(5)), None);
    assert!(table.is_empty());
}

#[tokio::test(start_paused = true)]
async fn replacing_an_entry_counts_it_once() {
    let (counters, table) = table();
    table.insert("k".to_owned(), 1, Duration::from_secs(5));
    table.insert("k".to_owned(), 2, Duration::from_secs(20));
    assert_eq!((table.len(), counters.ttl_entries()), (1, 1));

    // The replacement carries its own TTL.
    tokio::time::advance(Duration::from_secs(10)).await;
    assert_eq!(table.get("k"), Some(2));

    // Replacing an expired, unswept entry still counts once.
    tokio::time::advance(Duration::from_secs(10)).await;
    table.insert("k".to_owned(), 3, Duration::from_secs(5));
    assert_eq!((table.len(), counters.ttl_entries()), (1, 1));
    assert_eq!(table.get("k"), Some(3));
}

#[tokio::test(start_paused = true)]
async fn remove_returns_only_live_values_and_counts_both() {
    let (counters, table) = table();
    table.insert("live".to_owned(), 1, Duration::from_secs(10));
    table.insert("stale".to_owned(), 2, Duration::from_secs(1));
    tokio::time::advance(Duration::from_secs(2)).await;
    assert_eq!(counters.ttl_entries(), 2);

    assert_eq!(table.remove("stale"), None);
    assert_eq!(counters.ttl_entries(), 1);
    assert_eq!(table.remove("live"), Some(1));
    assert_eq!(table.remove("live"), None);
    assert_eq!((table.len(), counters.ttl_entries()), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn clear_and_sweep_keep_counts_exact() {
    let (counters, table) = table();
    for (i, secs) in [1, 2, 3, 10, 10].into_iter().enumerate() {
        table.insert(i.to_string(), 0, Duration::from_secs(secs));
    }
    assert_eq!(counters.ttl_entries(), 5);

    tokio::time::advance(Duration::from_secs(3)).await;
    assert_eq!(table.sweep(Instant::now()), 2);
    assert_eq!((table.len(), counters.ttl_entries()), (2, 2));

    table.clear();
    assert_eq!((table.len(), counters.ttl_entries()), (0, 0));
    assert_eq!(table.get("3"), None);
}

#[tokio::test(start_paused = true)]
async fn a_huge_ttl_does_not_panic() {
    let (_, table) = table();
    table.insert("forever".to_owned(), 1, Duration::MAX);
    tokio::time::advance(Duration::from_secs(365 * 24 * 3600)).await;
    assert_eq!(table.get("forever"), Some(1));
}

#[tokio::test(start_paused = true)]
async fn a_zero_ttl_is_expired_at_once() {
    let (counters, table) = table();
    table.insert("k".to_owned(), 1, Duration::ZERO);
    assert_eq!(table.get("k"), None);
    assert_eq!(counters.ttl_entries(), 0);
}

#[tokio::test(start_paused = true)]
async fn dropping_a_table_releases_its_count() {
    let counters = Arc::new(Counters::new());
    let table: TtlTable<u32, u32> = TtlTable::new(counters.clone());
    table.insert(1, 1, Duration::from_secs(1));
    table.insert(2, 2, Duration::from_secs(1));
    assert_eq!(counters.ttl_entries(), 2);
    drop(table);
    assert_eq!(counters.ttl_entries(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_insert_and_remove_never_miscount() {
    const KEYS: u32 = 2;
    const TASKS: u32 = 4;
    let counters = Arc::new(Counters::new());
    let table = Arc::new(TtlTable::<u32, u32>::new(counters.clone()));
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let table = table.clone();
            tokio::spawn(async move {
                for i in 0..50_000u32 {
                    let key = ((task + i) / 2) % KEYS;
                    if (task + i) % 2 == 0 {
                        table.insert(key, i, Duration::from_secs(60));
                    } else {
                        table.remove(&key);
                    }
                    // A remove counted before the insert it undoes would
                    // wrap below zero; a remove not yet counted may leave
                    // one extra per task for a moment.
                    let len = table.len();
                    assert!(len <= (KEYS + TASKS) as usize, "len {len}");
                    if i % 64 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let live = (0..KEYS).filter(|k| table.get(k).is_some()).count();
    assert_eq!((table.len(), counters.ttl_entries()), (live, live));
    table.clear();
    assert_eq!(counters.ttl_entries(), 0);
}

async fn tree_with_table(interval: Duration) -> (Tree, Arc<TtlTable<String, u32>>) {
    let counters = Arc::new(Counters::new());
    let config = TreeConfig::default().with_sweep_interval(interval);
    let tree = Tree::start(config, counters.clone()).await.unwrap();
    let table = TtlTable::with_sweeper(counters, tree.sweeper());
    support::settle().await;
    (tree, table)
}

#[tokio::test(start_paused = true)]
async fn the_sweeper_removes_expired_entries_after_the_interval() {
    let interval = Duration::from_secs(10);
    let (tree, table) = tree_with_table(interval).await;
    let counters = tree.counters().clone();
    assert_eq!(counters.timers(), 0, "no timer while the table is empty");

    table.insert("short".to_owned(), 1, Duration::from_secs(3));
    table.insert("long".to_owned(), 2, Duration::from_secs(25));
    support::settle().await;
    assert_eq!(counters.timers(), 1, "ticking while entries exist");

    // Expired but not yet swept: counted, never returned.
    tokio::time::advance(Duration::from_secs(5)).await;
    assert_eq!(counters.ttl_entries(), 2);

    tokio::time::advance(interval - Duration::from_secs(5)).await;
    support::settle().await;
    assert_eq!(counters.ttl_entries(), 1, "first tick swept `short`");
    assert_eq!(counters.timers(), 1, "`long` keeps it ticking");
    let sweeps = tree.sweeper().sweeps();

    tokio::time::advance(interval).await;
    support::settle().await;
    assert_eq!(tree.sweeper().sweeps(), sweeps + 1);
    assert_eq!(counters.ttl_entries(), 1);

    tokio::time::advance(interval).await;
    support::settle().await;
    assert!(table.is_empty());
    assert_eq!(counters.ttl_entries(), 0);
    assert_eq!(counters.timers(), 0, "dormant once empty");

    // Dormant means no more sweeps however long we wait.
    let sweeps = tree.sweeper().sweeps();
    tokio::time::advance(interval * 10).await;
    support::settle().await;
    assert_eq!(tree.sweeper().sweeps(), sweeps);

    // The next insert wakes it again.
    table.insert("again".to_owned(), 3, Duration::from_secs(1));
    support::settle().await;
    assert_eq!(counters.timers(), 1);
    tokio::time::advance(interval).await;
    support::settle().await;
    assert_eq!((counters.ttl_entries(), counters.timers()), (0, 0));

    tree.shutdown(Instant::now()).await;
}

#[tokio::test(start_paused = true)]
async fn entries_removed_by_hand_let_the_sweeper_sleep() {
    let interval = Duration::from_secs(10);
    let (tree, table) = tree_with_table(interval).await;
    table.insert("k".to_owned(), 1, Duration::from_secs(60));
    support::settle().await;
    assert_eq!(tree.counters().timers(), 1);
    table.remove("k");
    tokio::time::advance(interval).await;
    support::settle().await;
    assert_eq!(tree.counters().timers(), 0);
    tree.shutdown(Instant::now()).await;
}

#[tokio::test(start_paused = true)]
async fn shutdown_disarms_a_ticking_sweeper() {
    let (tree, table) = tree_with_table(Duration::from_secs(10)).await;
    table.insert("k".to_owned(), 1, Duration::from_secs(60));
    support::settle().await;
    assert_eq!(tree.counters().timers(), 1);
    tree.shutdown(Instant::now()).await;
    assert_eq!(tree.counters().timers(), 0);
    // The table itself still works without its sweeper.
    assert_eq!(table.get("k"), Some(1));
    table.insert("j".to_owned(), 2, Duration::from_secs(60));
    assert_eq!(tree.sweeper().sweep_now(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_swept_table_gives_its_memory_back() {
    let table: TtlTable<u32, u32> = TtlTable::new(Arc::new(Counters::new()));
    for key in 0..100_000 {
        table.insert(key, key, Duration::from_secs(1));
    }
    let peak = table.capacity();
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(table.sweep(tokio::time::Instant::now()), 0);
    assert!(
        table.capacity() < peak / 8,
        "capacity {} of {peak}",
        table.capacity()
    );
}

const SEC: Duration = Duration::from_secs(1);

fn capped(max_len: usize) -> (Arc<Counters>, TtlTable<u32, u32>) {
    let counters = Arc::new(Counters::new());
    (
        Arc::clone(&counters),
        TtlTable::new(Arc::clone(&counters)).with_max_len(max_len),
    )
}

#[tokio::test(start_paused = true)]
async fn past_the_cap_the_oldest_inserted_go_first_and_are_counted() {
    let (counters, table) = capped(3);
    for k in 0..3 {
        assert_eq!(table.insert(k, k * 10, 10 * SEC), 0);
    }
    // Replacing key 0 makes it the newest.
    assert_eq!(table.insert(0, 1, 10 * SEC), 0);
    assert_eq!(table.insert(3, 30, 10 * SEC), 1, "key 1 evicted");
    assert_eq!(table.insert(4, 40, 10 * SEC), 1, "key 2 evicted");
    assert_eq!(table.get(&1), None);
    assert_eq!(table.get(&2), None);
    assert_eq!(
        (table.get(&0), table.get(&3), table.get(&4)),
        (Some(1), Some(30), Some(40))
    );
    assert_eq!((table.len(), table.evictions()), (3, 2));
    assert_eq!(counters.ttl_entries(), 3);
}

#[tokio::test(start_paused = true)]
async fn past_the_weight_budget_the_oldest_go_first_and_weight_is_exact() {
    let table: TtlTable<u32, Vec<u8>> = TtlTable::new(Arc::new(Counters::new()))
        .with_max_len(100)
        .with_max_weight(100, |k, v| u64::from(*k % 2) + v.len() as u64);
    assert_eq!(
        (table.max_len(), table.max_weight()),
        (Some(100), Some(100))
    );
    table.insert(0, vec![0; 40], 10 * SEC);
    table.insert(2, vec![0; 40], 20 * SEC);
    assert_eq!(table.weight(), 80);
    // Replacing an entry swaps its weight.
    table.insert(0, vec![0; 10], 10 * SEC);
    assert_eq!(table.weight(), 50);
    // Past the budget the oldest (key 2: key 0 was replaced after it) go first.
    assert_eq!(table.insert(4, vec![0; 60], 30 * SEC), 1);
    assert_eq!(table.get(&2), None);
    assert_eq!((table.weight(), table.evictions()), (70, 1));
    // Odd keys weigh one more: the weigher sees the key.
    table.insert(5, vec![0; 19], 30 * SEC);
    assert_eq!(table.weight(), 90);
    // Every way out takes the entry's weight off.
    assert!(table.remove(&5).is_some());
    assert_eq!(table.weight(), 70);
    tokio::time::advance(10 * SEC).await;
    assert_eq!(table.get(&0), None, "expired on read");
    assert_eq!(table.weight(), 60);
    table.insert(6, vec![0; 30], SEC);
    tokio::time::advance(SEC).await;
    assert_eq!(table.sweep(Instant::now()), 1);
    assert_eq!(table.weight(), 60);
    let nx = |live: Option<&Vec<u8>>| (live.is_none().then(|| (vec![0; 5], SEC)), ());
    table.upsert_at(8, Instant::now(), nx);
    assert_eq!(table.weight(), 65);
    // An entry heavier than the whole budget evicts everything, itself last.
    assert_eq!(table.insert(10, vec![0; 101], SEC), 3);
    assert_eq!((table.len(), table.weight(), table.evictions()), (0, 0, 4));
    table.insert(12, vec![0; 7], SEC);
    table.clear();
    assert_eq!(table.weight(), 0);
}

#[tokio::test(start_paused = true)]
async fn an_uncapped_table_never_evicts() {
    let table: TtlTable<u32, u32> = TtlTable::new(Arc::new(Counters::new()));
    for k in 0..10_000 {
        assert_eq!(table.insert(k, k, SEC), 0);
    }
    assert_eq!(
        (table.len(), table.evictions(), table.max_len()),
        (10_000, 0, None)
    );
}

fn numbers() -> (Arc<Counters>, TtlTable<u32, u32>) {
    let counters = Arc::new(Counters::new());
    (Arc::clone(&counters), TtlTable::new(counters))
}

#[tokio::test(start_paused = true)]
async fn upsert_sees_only_live_values_and_counts_new_entries() {
    let (counters, t) = numbers();
    let ttl = Duration::from_millis(100);
    let nx = |v: u32| {
        move |live: Option<&u32>| match live {
            Some(_) => (None, false),
            None => (Some((v, ttl)), true),
        }
    };
    assert!(t.upsert_at(1, Instant::now(), nx(10)));
    assert!(!t.upsert_at(1, Instant::now(), nx(11)));
    assert_eq!(t.get(&1), Some(10));
    assert_eq!(t.len(), 1);
    // Expired: absent for `f`, replaced without counting twice.
    tokio::time::advance(ttl).await;
    assert!(t.upsert_at(1, Instant::now(), nx(12)));
    assert_eq!(
        (t.get(&1), t.len(), counters.ttl_entries()),
        (Some(12), 1, 1)
    );
    // Compare-and-set: writes only when `f` says so.
    let cas = |expect: u32, v: u32| {
        move |live: Option<&u32>| {
            if live == Some(&expect) {
                (Some((v, ttl)), true)
            } else {
                (None, false)
            }
        }
    };
    assert!(!t.upsert_at(1, Instant::now(), cas(99, 13)));
    assert!(t.upsert_at(1, Instant::now(), cas(12, 13)));
    assert_eq!(t.get(&1), Some(13));
    // Nothing written for a missing key when `f` declines.
    assert!(!t.upsert_at(2, Instant::now(), cas(0, 1)));
    assert_eq!(t.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn evict_soonest_removes_the_earliest_expiries_first() {
    let (counters, t) = numbers();
    for k in 0..10u32 {
        t.insert(k, k, Duration::from_secs(u64::from(10 - k)));
    }
    assert_eq!(t.evict_soonest(3), 3);
    assert_eq!(t.len(), 7);
    assert_eq!(counters.ttl_entries(), 7);
    for k in 7..10 {
        assert_eq!(t.get(&k), None, "{k} expires soonest");
    }
    for k in 0..7 {
        assert_eq!(t.get(&k), Some(k));
    }
    assert_eq!(t.evict_soonest(100), 7);
    assert!(t.is_empty());
    assert_eq!(t.evict_soonest(1), 0);
}

#[tokio::test(start_paused = true)]
async fn update_sees_expired_entries_and_keeps_sets_or_removes() {
    let (counters, t) = numbers();
    let seen = |key| {
        t.update_at(key, Instant::now(), |held: Option<(&u32, Duration)>| {
            (Update::Keep, held.map(|(v, left)| (*v, left)))
        })
    };
    assert_eq!(seen(1), None);
    assert_eq!(t.len(), 0, "keeping a missing key adds nothing");
    t.insert(1, 10, 3 * SEC);
    tokio::time::advance(SEC).await;
    assert_eq!(seen(1), Some((10, 2 * SEC)));
    tokio::time::advance(5 * SEC).await;
    assert_eq!(seen(1), Some((10, Duration::ZERO)), "expired, still shown");
    assert_eq!(t.len(), 1, "and kept");
    // Set revives it for a fresh TTL, counted once.
    t.update_at(1, Instant::now(), |_| (Update::Set(11, SEC), ()));
    assert_eq!(
        (t.get(&1), t.len(), counters.ttl_entries()),
        (Some(11), 1, 1)
    );
    // Remove uncounts it; removing a missing key does nothing.
    t.update_at(1, Instant::now(), |_| (Update::Remove, ()));
    t.update_at(2, Instant::now(), |_| (Update::Remove, ()));
    assert_eq!((t.get(&1), t.len(), counters.ttl_entries()), (None, 0, 0));
    // Set on a missing key inserts it.
    t.update_at(3, Instant::now(), |held| {
        assert!(held.is_none());
        (Update::Set(30, SEC), ())
    });
    assert_eq!((t.get(&3), t.len()), (Some(30), 1));
}

#[tokio::test(start_paused = true)]
async fn update_within_refuses_only_a_new_key_at_the_limit() {
    let (counters, t) = numbers();
    let put = |v: u32| move |_: Option<(&u32, Duration)>| (Update::Set(v, SEC), v);
    assert_eq!(t.update_within_at(1, Instant::now(), 2, put(1)), Some(1));
    assert_eq!(t.update_within_at(2, Instant::now(), 2, put(2)), Some(2));
    let mut ran = false;
    let refused = t.update_within_at(3, Instant::now(), 2, |_| {
        ran = true;
        (Update::Set(3, SEC), 3)
    });
    assert_eq!((refused, ran), (None, false), "refused without running f");
    // A held key, expired too, is rewritten at the limit.
    tokio::time::advance(SEC).await;
    assert_eq!(t.update_within_at(1, Instant::now(), 2, put(10)), Some(10));
    // A new key declined leaves the count as it was.
    t.remove(&2);
    let keep = |_: Option<(&u32, Duration)>| (Update::Keep, 0);
    assert_eq!(t.update_within_at(4, Instant::now(), 2, keep), Some(0));
    assert_eq!((t.len(), counters.ttl_entries()), (1, 1));
    assert_eq!(t.update_within_at(4, Instant::now(), 2, put(4)), Some(4));
    assert_eq!(t.update_within_at(5, Instant::now(), 2, put(5)), None);
    assert_eq!((t.len(), t.get(&1), t.get(&4)), (2, Some(10), Some(4)));
}
