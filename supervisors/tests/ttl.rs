//! TTL table: expiry on read, counts, and sweeping under a tree.

mod support;

use std::sync::Arc;
use std::time::Duration;

use throttlebeam_supervisors::{Counters, Sweep, Tree, TreeConfig, TtlTable};
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
