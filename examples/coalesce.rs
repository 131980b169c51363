// Run: cargo run --example coalesce
//! A coalescing (leading + trailing) throttle in front of a slow sync job.
//!
//! Change events for a room arrive in bursts; each should lead to a sync of
//! the room, but never more than one sync per window per room, and never two
//! at once. The first event syncs now; the rest of the burst collapses into
//! one trailing sync at the end of the window.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use throttlebeam::{Coalesce, Error, Runtime, coalesce::Phase};

/// Stands in for "read the room from the database and push it to clients".
async fn sync_room(room: &str, phase: Phase, version: Arc<AtomicU64>) -> Result<u64, Error> {
    tokio::time::sleep(Duration::from_millis(50)).await;
    let v = version.load(Ordering::SeqCst);
    println!("    sync {room} ({phase:?}) saw version {v}");
    Ok(v)
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let started = Instant::now();
    let at = move || started.elapsed().as_millis();
    let runtime = Runtime::builder().start().await?;
    let rooms: Coalesce<u64> = runtime
        .coalesce("sync:room:")
        .with_window(Duration::from_millis(300))
        .build()?;
    let version = Arc::new(AtomicU64::new(0));

    println!("a burst of 20 change events on room 42:");
    let mut waiters = Vec::new();
    for i in 0..20 {
        version.fetch_add(1, Ordering::SeqCst);
        let v = version.clone();
        if i == 0 {
            // The first event leads: `call` resolves once the sync is done.
            let ran = rooms
                .call("42", move |phase| sync_room("42", phase, v))
                .await?;
            println!("  t={:>4} ms  event {i}: ran now = {ran}", at());
        } else if i % 5 == 0 {
            // Callers that need the outcome wait for the run that covers them.
            let rooms = rooms.clone();
            waiters.push(tokio::spawn(async move {
                let synced = rooms
                    .call_and_wait("42", move |phase| sync_room("42", phase, v))
                    .await;
                (i, synced)
            }));
        } else {
            // The rest return `false` at once: the trailing sync covers them.
            let ran = rooms
                .call("42", move |phase| sync_room("42", phase, v))
                .await?;
            assert!(!ran);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!("  t={:>4} ms  burst over; {:?}", at(), rooms.stats());
    for waiter in waiters {
        let (i, synced) = waiter.await.expect("waiter task");
        println!(
            "  t={:>4} ms  event {i} covered by a sync of version {}",
            at(),
            synced?
        );
    }

    println!("a caller that cannot wait long:");
    let v = version.clone();
    match rooms
        .call_and_wait_timeout("42", Duration::from_millis(20), move |phase| {
            sync_room("42", phase, v)
        })
        .await
    {
        Err(Error::Timeout { key, after }) => {
            println!("  gave up on room {key} after {after:?}; the sync still happens");
        }
        other => println!("  {other:?}"),
    }

    // Graceful: the pending trailing sync still runs when its window ends.
    runtime.shutdown(Duration::from_secs(5)).await;
    println!("  t={:>4} ms  shut down; {:?}", at(), rooms.stats());
    Ok(())
}
