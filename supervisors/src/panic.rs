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
