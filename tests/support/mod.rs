//! Helpers shared by the behaviour tests.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use throttlebeam::Runtime;

/// A runtime of its own for one test.
pub async fn runtime() -> Runtime {
    Runtime::builder().start().await.expect("runtime starts")
}

/// Milliseconds.
pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A shared counter of function runs.
#[derive(Clone, Default)]
pub struct Runs(Arc<AtomicUsize>);

impl Runs {
    pub fn hit(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }

    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// The error type test functions return.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Oops(pub &'static str);

impl std::fmt::Display for Oops {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "oops: {}", self.0)
    }
}

impl std::error::Error for Oops {}

/// Lets spawned tasks run without moving paused time.
pub async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[cfg(feature = "redis")]
pub mod redis;
