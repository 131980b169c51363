//! The one guard every store call goes through: a timeout, a panic
//! boundary, and cancellation safety.
//!
//! A store is the user's code (a custom [`IdempotencyStore`], an
//! [`AsyncRateLimitStore`]) or a network client: it may hang, fail or panic.
//! [`guard`] runs one call so that none of it reaches the caller as
//! anything but a typed [`Fault`]: the call is built and polled inside
//! `catch_unwind`, and bounded by a timer. Dropping the guarded future drops
//! the call and holds nothing else, so a caller may leave at any await.
//!
//! A call that answers at its first poll (an in-memory store) costs no timer
//! and needs no tokio runtime.
//!
//! [`IdempotencyStore`]: crate::idempotency::IdempotencyStore
//! [`AsyncRateLimitStore`]: crate::rate_limit::AsyncRateLimitStore

use std::any::Any;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::pin;
use std::task::Poll;
use std::time::Duration;

use super::StoreError;

/// Why a guarded call gave no answer of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fault {
    /// It did not answer within its bound.
    TimedOut(Duration),
    /// It panicked (while being built or polled), with this message.
    Panicked(String),
}

impl From<Fault> for StoreError {
    fn from(fault: Fault) -> Self {
        match fault {
            Fault::TimedOut(after) => StoreError::Timeout { after },
            Fault::Panicked(message) => StoreError::Panicked { message },
        }
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::TimedOut(after) => write!(f, "store call timed out after {after:?}"),
            Fault::Panicked(message) => write!(f, "store call panicked: {message}"),
        }
    }
}

/// Runs the store call `call` builds, bounded by `timeout`, with a panic in
/// `call` or in the future it returns caught as [`Fault::Panicked`].
///
/// The timer starts when the call first returns pending; a call ready at
/// once arms none. No timeout (`None`) is for a call bounded already (the
/// Redis client's command timeout). Outside a tokio runtime no timer can be
/// armed, and the call is awaited unbounded (only a store behind a
/// tokio-driven client can hang, and that needs a runtime already).
pub(crate) async fn guard<Fut: Future>(
    timeout: impl Into<Option<Duration>>,
    call: impl FnOnce() -> Fut,
) -> Result<Fut::Output, Fault> {
    let timeout = timeout.into();
    let call = catch_unwind(AssertUnwindSafe(call)).map_err(|p| panicked(&*p))?;
    let mut call = pin!(call);
    let mut poll =
        move |cx: &mut std::task::Context<'_>| match catch_unwind(AssertUnwindSafe(|| {
            call.as_mut().poll(cx)
        })) {
            Ok(Poll::Ready(out)) => Poll::Ready(Ok(out)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(p) => Poll::Ready(Err(panicked(&*p))),
        };
    // The first poll alone: most calls end here, with no timer.
    let first = std::future::poll_fn(|cx| Poll::Ready(poll(cx))).await;
    if let Poll::Ready(out) = first {
        return out;
    }
    let Some(timeout) = timeout.filter(|_| tokio::runtime::Handle::try_current().is_ok()) else {
        return std::future::poll_fn(poll).await;
    };
    let mut expired = pin!(tokio::time::sleep(timeout));
    std::future::poll_fn(|cx| {
        if let Poll::Ready(out) = poll(cx) {
            return Poll::Ready(out);
        }
        expired
            .as_mut()
            .poll(cx)
            .map(|()| Err(Fault::TimedOut(timeout)))
    })
    .await
}

/// [`guard`] over a call that answers with a [`StoreError`]: its faults are
/// store errors too ([`StoreError::Timeout`], [`StoreError::Panicked`]).
#[cfg(feature = "runtime")]
pub(crate) async fn store_call<T, Fut>(
    timeout: impl Into<Option<Duration>>,
    call: impl FnOnce() -> Fut,
) -> Result<T, StoreError>
where
    Fut: Future<Output = Result<T, StoreError>>,
{
    guard(timeout, call)
        .await
        .unwrap_or_else(|fault| Err(fault.into()))
}

/// The message of a panic payload.
fn panicked(payload: &(dyn Any + Send)) -> Fault {
    let message = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a non-string payload".to_owned());
    Fault::Panicked(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUND: Duration = Duration::from_secs(1);

    #[tokio::test(start_paused = true)]
    async fn a_ready_call_answers_without_a_timer() {
        assert_eq!(guard(BOUND, || async { 7 }).await, Ok(7));
        // No runtime needed either.
        let out = block_on_without_runtime(guard(BOUND, || std::future::ready(8)));
        assert_eq!(out, Ok(8));
    }

    #[tokio::test(start_paused = true)]
    async fn a_hanging_call_times_out_at_its_bound() {
        let started = tokio::time::Instant::now();
        let out = guard(BOUND, std::future::pending::<()>).await;
        assert_eq!(out, Err(Fault::TimedOut(BOUND)));
        assert_eq!(started.elapsed(), BOUND);
        // A slow call within its bound answers.
        let slow = guard(BOUND, || async {
            tokio::time::sleep(BOUND / 2).await;
            3
        });
        assert_eq!(slow.await, Ok(3));
    }

    #[tokio::test(start_paused = true)]
    async fn panics_while_building_or_polling_are_faults() {
        let built = guard(BOUND, || -> std::future::Ready<u8> { panic!("built") }).await;
        assert_eq!(built, Err(Fault::Panicked("built".to_owned())));
        let first = guard(BOUND, || async { panic!("first poll {}", 1) }).await;
        assert_eq!(first, Err(Fault::Panicked("first poll 1".into())));
        let later = guard(BOUND, || async {
            tokio::time::sleep(BOUND / 4).await;
            std::panic::panic_any(5_u8)
        })
        .await;
        assert_eq!(
            later,
            Err(Fault::Panicked("a panic with a non-string payload".into()))
        );
        let error = StoreError::from(Fault::Panicked("boom".into()));
        assert_eq!(error.to_string(), "store panicked: boom");
        assert!(error.is_store_fault());
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_the_guard_drops_the_call() {
        struct Dropped(std::sync::Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Dropped {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let held = Dropped(std::sync::Arc::clone(&flag));
        let call = guard(BOUND, move || async move {
            let _held = held;
            std::future::pending::<()>().await;
        });
        let cut = tokio::time::timeout(BOUND / 10, call).await;
        assert!(cut.is_err());
        assert!(flag.load(std::sync::atomic::Ordering::SeqCst));
    }

    /// Polls a future on this thread with no runtime in scope.
    fn block_on_without_runtime<F>(fut: F) -> F::Output
    where
        F: Future + Send,
        F::Output: Send,
    {
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut fut = pin!(fut);
                let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                loop {
                    if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
                        return out;
                    }
                }
            })
            .join()
            .expect("no panic")
        })
    }
}
