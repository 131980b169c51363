//! The function a primitive runs for a key: one bound for every primitive.

use std::future::Future;

/// A function that debounce, throttle and idempotency run for a key: called at most once,
/// it returns a future that resolves to `Result<T, E>`, where `E` is any error that converts
/// into a boxed [`std::error::Error`].
///
/// Every `FnOnce() -> impl Future<Output = Result<T, E>>` that is `Send + 'static`, with a
/// `Send + 'static` future and error, is a `Job<T>`: pass a closure or an `async fn`, and
/// name the trait only to write a function generic over what it forwards. It cannot be
/// implemented by hand (its one implementation covers every such function).
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
/// use std::time::Duration;
/// use throttlebeam::{Job, Runtime, ThrottleHandle, ThrottleOutcome};
///
/// // A wrapper that throttles whatever job it is given, per user.
/// async fn once_a_minute<T: Send + 'static>(
///     throttle: &ThrottleHandle,
///     user: u64,
///     job: impl Job<T>,
/// ) -> Result<ThrottleOutcome<T>, throttlebeam::Error> {
///     throttle.call(&format!("user:{user}"), Duration::from_secs(60), job).await
/// }
///
/// async fn send_digest() -> Result<&'static str, std::io::Error> {
///     Ok("sent")
/// }
///
/// let throttle = Runtime::start().await?.throttle();
/// assert_eq!(once_a_minute(&throttle, 7, send_digest).await?, ThrottleOutcome::Executed("sent"));
/// assert!(once_a_minute(&throttle, 7, || async { Ok::<_, std::io::Error>("again") }).await?.is_throttled());
/// # Ok(()) }
/// ```
pub trait Job<T>: FnOnce() -> <Self as Job<T>>::Future + Send + 'static {
    /// The future the function returns.
    type Future: Future<Output = Result<T, Self::Error>> + Send + 'static;
    /// The function's error.
    type Error: Into<Box<dyn std::error::Error + Send + Sync + 'static>> + Send + 'static;
}

impl<F, Fut, T, E> Job<T> for F
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync + 'static>> + Send + 'static,
{
    type Future = Fut;
    type Error = E;
}
