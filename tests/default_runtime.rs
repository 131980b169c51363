//! The default runtime supervises itself: a process of its own, so that
//! killing its root does not disturb other tests.

mod support;

use std::time::Duration;

use support::Oops;
use throttlebeam::{Error, Runtime, Throttle};

/// Issue 7 item 3 for the runtime nobody supervises: after its root goes
/// down, calls fail fast with a typed error, then it restarts on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_runtime_restarts_itself_after_its_root_goes_down() {
    let ok = || async { Ok::<_, Oops>(()) };
    let hour = Duration::from_secs(3600);
    let rt = Runtime::global().unwrap();
    assert!(Throttle::call("g:1", hour, ok).await.unwrap().is_executed());

    rt.root_actor().kill();
    tokio::time::timeout(Duration::from_secs(5), async {
        while !rt.is_down() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the kill lands");
    let e = Throttle::call("g:2", hour, ok).await.unwrap_err();
    assert!(
        matches!(&e, Error::RuntimeDown { key } if key == "g:2"),
        "{e}"
    );

    tokio::time::timeout(Duration::from_secs(5), async {
        while rt.is_down() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("restarted on its own within 5 s");
    assert_eq!(rt.stats().restarts, 1);
    // Its window was forgotten with the old root, and calls work again.
    assert!(Throttle::call("g:1", hour, ok).await.unwrap().is_executed());
    assert!(Throttle::call("g:2", hour, ok).await.unwrap().is_executed());
}
