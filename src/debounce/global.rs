//! [`Debounce`]: debounce on the default runtime, one call away.

use std::sync::OnceLock;
use std::time::Duration;

use super::{AcrossInstances, DebounceHandle, DebounceOptions, Debounced};
use crate::error::Error;
use crate::job::Job;
use crate::runtime::Runtime;

/// Debounce on the default runtime.
///
/// Every call for a key resets its timer; the function runs once the key has
/// been quiet for the delay, and the latest function passed wins. Each key
/// has its own process, so keys never delay each other.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
/// use std::time::Duration;
/// use throttlebeam::Debounce;
///
/// // Fire and forget: runs 50 ms after the last call for the key.
/// let _ = Debounce::call("autosave:doc_9", Duration::from_millis(50), || async {
///     Ok::<_, std::io::Error>(())
/// })?;
/// // Or await the run that covers the call.
/// let saved = Debounce::call("autosave:doc_9", Duration::from_millis(50), || async {
///     Ok::<_, std::io::Error>(())
/// })?
/// .await;
/// assert!(saved.is_ok());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Debounce;

impl Debounce {
    /// [`DebounceHandle::call`] on the default runtime.
    ///
    /// # Errors
    ///
    /// As [`DebounceHandle::call_with`], plus [`Error::Start`].
    pub fn call<T, J>(key: &str, delay: Duration, f: J) -> Result<Debounced<T>, Error>
    where
        J: Job<T>,
        T: Clone + Send + Sync + 'static,
    {
        global()?.call(key, delay, f)
    }

    /// [`DebounceHandle::call_with`] on the default runtime.
    ///
    /// # Errors
    ///
    /// As [`DebounceHandle::call_with`], plus [`Error::Start`].
    pub fn call_with<T, J>(
        key: &str,
        delay: Duration,
        options: DebounceOptions,
        f: J,
    ) -> Result<Debounced<T>, Error>
    where
        J: Job<T>,
        T: Clone + Send + Sync + 'static,
    {
        global()?.call_with(key, delay, options, f)
    }

    /// [`DebounceHandle::cancel`] on the default runtime.
    ///
    /// # Errors
    ///
    /// [`Error::Start`] if the default runtime could not start.
    pub fn cancel(key: &str) -> Result<bool, Error> {
        Ok(global()?.cancel(key))
    }

    /// [`DebounceHandle::flush`] on the default runtime.
    ///
    /// # Errors
    ///
    /// [`Error::Start`] if the default runtime could not start.
    pub fn flush(key: &str) -> Result<bool, Error> {
        Ok(global()?.flush(key))
    }

    /// [`DebounceHandle::across_instances`] on the default runtime (which
    /// shares Redis when [`REDIS_URL_ENV`](crate::store::REDIS_URL_ENV) or
    /// [`REDIS_CLUSTER_ENV`](crate::store::REDIS_CLUSTER_ENV) is set).
    ///
    /// # Errors
    ///
    /// [`Error::Start`] if the default runtime could not start.
    pub fn across_instances() -> Result<DebounceHandle<AcrossInstances>, Error> {
        Ok(global()?.across_instances())
    }

    /// [`DebounceHandle::is_pending`] on the default runtime.
    ///
    /// # Errors
    ///
    /// [`Error::Start`] if the default runtime could not start.
    pub fn is_pending(key: &str) -> Result<bool, Error> {
        Ok(global()?.is_pending(key))
    }
}

/// The default runtime's debounce, looked up once.
fn global() -> Result<&'static DebounceHandle, Error> {
    static GLOBAL: OnceLock<Result<DebounceHandle, Error>> = OnceLock::new();
    GLOBAL
        .get_or_init(|| Runtime::global().map(|rt| rt.debounce()))
        .as_ref()
        .map_err(Clone::clone)
}
