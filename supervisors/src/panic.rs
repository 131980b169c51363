//! Catching panics of futures so a crash inside one key stays inside it.

use std::any::Any;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::task::{Context, Poll};

/// A panic caught while polling a future, with its message when it had one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Panic {
    message: String,
}

impl Panic {
    fn from_payload(payload: &(dyn Any + Send)) -> Self {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-string panic payload".to_owned());
        Self { message }
    }

    /// What the panic said.
    #[must_use]
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl std::fmt::Display for Panic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "panicked: {}", self.message)
    }
}

impl std::error::Error for Panic {}

pin_project_lite::pin_project! {
    /// Future returned by [`catch_panic`].
    #[derive(Debug)]
    #[must_use = "futures do nothing unless polled"]
    pub struct CatchPanic<F> {
        #[pin]
        inner: F,
    }
}

/// Wraps `future` so that a panic while polling it resolves to `Err(Panic)`
/// instead of unwinding into the caller.
///
/// # Examples
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// use throttlebeam_supervisors::catch_panic;
///
/// let caught = catch_panic(async { panic!("boom") }).await;
/// assert_eq!(caught.unwrap_err().message(), "boom");
/// assert_eq!(catch_panic(async { 7 }).await.unwrap(), 7);
/// # });
/// ```
pub fn catch_panic<F: Future>(future: F) -> CatchPanic<F> {
    CatchPanic { inner: future }
}

impl<F: Future> Future for CatchPanic<F> {
    type Output = Result<F::Output, Panic>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.project().inner;
        match catch_unwind(AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(value)) => Poll::Ready(Ok(value)),
            Err(payload) => Poll::Ready(Err(Panic::from_payload(&*payload))),
        }
    }
}

/// [`catch_panic`] over the future `f` returns, with `f` called at the first poll: a panic
/// while building the future is caught too, and the future takes the place of `f` (the two
/// never take room at once, as they would in `catch_panic(async move { f().await })`).
///
/// # Examples
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// use throttlebeam_supervisors::catch_panic_fn;
///
/// assert_eq!(catch_panic_fn(|| async { 7 }).await.unwrap(), 7);
/// let caught = catch_panic_fn(|| -> std::future::Ready<u8> { panic!("boom") }).await;
/// assert_eq!(caught.unwrap_err().message(), "boom");
/// let caught = catch_panic_fn(|| async { panic!("later") }).await;
/// assert_eq!(caught.map(|()| ()).unwrap_err().message(), "later");
/// # });
/// ```
pub fn catch_panic_fn<F, Fut>(f: F) -> impl Future<Output = Result<Fut::Output, Panic>>
where
    F: FnOnce() -> Fut,
    Fut: Future,
{
    catch_panic(Started::Not { f: Some(f) })
}

pin_project_lite::pin_project! {
    /// `f` until the first poll, then the future it returned.
    #[project = StartedProj]
    enum Started<F, Fut> {
        Not { f: Option<F> },
        Running { #[pin] future: Fut },
    }
}

impl<F, Fut> Future for Started<F, Fut>
where
    F: FnOnce() -> Fut,
    Fut: Future,
{
    type Output = Fut::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Fut::Output> {
        if let StartedProj::Not { f } = self.as_mut().project() {
            let f = f.take().expect("Started polled after its start panicked");
            self.set(Started::Running { future: f() });
        }
        match self.project() {
            StartedProj::Running { future } => future.poll(cx),
            StartedProj::Not { .. } => unreachable!("started above"),
        }
    }
}
