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

/// Tracing events of this crate, captured on the current thread.
#[derive(Clone, Default)]
pub struct Events(Arc<std::sync::Mutex<Vec<(tracing::Level, String)>>>);

struct Message(String);

impl tracing::field::Visit for Message {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Events {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let meta = event.metadata();
        if meta.target().starts_with("throttlebeam") {
            let mut message = Message(String::new());
            event.record(&mut message);
            self.0.lock().unwrap().push((*meta.level(), message.0));
        }
    }
}

impl Events {
    /// Captures events on this thread (a current-thread test) until the
    /// guard is dropped.
    pub fn install(&self) -> tracing::subscriber::DefaultGuard {
        use tracing_subscriber::layer::SubscriberExt;
        tracing::subscriber::set_default(tracing_subscriber::registry().with(self.clone()))
    }

    /// The messages of the events at `level`.
    pub fn at(&self, level: tracing::Level) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(l, _)| *l == level)
            .map(|(_, m)| m.clone())
            .collect()
    }
}

pub mod cancel;
#[cfg(feature = "runtime")]
pub mod contract;
#[cfg(feature = "redis")]
pub mod managed;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod proxy;
#[cfg(feature = "redis")]
pub mod redis;
