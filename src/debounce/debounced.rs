//! [`Debounced`]: the future of one debounced call.

use std::future::{Future, IntoFuture};
use std::marker::PhantomData;
use std::pin::Pin;

use super::{Cell, Value};
use crate::error::Error;
use crate::key::shown;

/// A scheduled debounced call; await it for the outcome of the run that
/// covers it, or drop it to fire and forget.
///
/// Awaiting gives the value of that run (which uses the latest function
/// passed for the key), or its error: [`Error::Failed`], [`Error::Panicked`],
/// or [`Error::Discarded`] if the run was cancelled or dropped at shutdown.
#[must_use = "the call is scheduled either way; await this to get the outcome"]
pub struct Debounced<T> {
    pub(super) cell: Cell,
    pub(super) _type: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for Debounced<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Debounced")
            .field("key", &self.cell.key)
            .field("done", &self.cell.result.get().is_some())
            .finish()
    }
}

impl<T: Clone + Send + Sync + 'static> Debounced<T> {
    /// The outcome, if the covering run has finished.
    pub fn try_outcome(&self) -> Option<Result<T, Error>> {
        self.cell.result.get().map(|r| self.downcast(r))
    }

    fn downcast(&self, result: Result<Value, Error>) -> Result<T, Error> {
        let value = result?;
        value
            .downcast_ref::<T>()
            .cloned()
            .ok_or_else(|| Error::TypeMismatch {
                key: shown(&self.cell.key),
            })
    }
}

impl<T: Clone + Send + Sync + 'static> IntoFuture for Debounced<T> {
    type Output = Result<T, Error>;
    type IntoFuture = Pin<Box<dyn Future<Output = Result<T, Error>> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move {
            let result = self.cell.result.wait().await;
            self.downcast(result)
        })
    }
}
