//! A one-shot result shared by every caller a run covers.

use std::sync::{Arc, OnceLock};

use tokio::sync::Notify;

use crate::error::Error;

/// Set once by the run, read by any number of waiters.
#[derive(Debug)]
pub(crate) struct RunCell<V> {
    result: OnceLock<Result<V, Error>>,
    notify: Notify,
}

impl<V> Default for RunCell<V> {
    fn default() -> Self {
        Self {
            result: OnceLock::new(),
            notify: Notify::new(),
        }
    }
}

impl<V: Clone> RunCell<V> {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Publishes the result; the first publish wins. Returns whether this one did.
    pub(crate) fn set(&self, result: Result<V, Error>) -> bool {
        let won = self.result.set(result).is_ok();
        if won {
            self.notify.notify_waiters();
        }
        won
    }

    /// The result, if published.
    pub(crate) fn get(&self) -> Option<Result<V, Error>> {
        self.result.get().cloned()
    }

    /// Waits for the result.
    pub(crate) async fn wait(&self) -> Result<V, Error> {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(result) = self.result.get() {
                return result.clone();
            }
            notified.await;
        }
    }
}
