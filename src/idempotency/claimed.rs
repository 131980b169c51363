//! The run of a key claimed at once ([`IdempotencyHandle::look`](super::IdempotencyHandle)):
//! a named future, so its owner boxes it once, with the work inside and nothing kept twice.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;
use serde::Serialize;
use serde::de::DeserializeOwned;
use throttlebeam_supervisors::CatchPanic;

use tokio::task::futures::TaskLocalFuture;

use super::Fence;
use super::claim::{CompletedNow, Ledger, Ticket, Unrecorded};
use crate::error::Error;
use crate::key::shown;

/// A key claimed by [`IdempotencyHandle::look`](super::IdempotencyHandle): dropped unrun, it
/// is released.
pub(crate) struct Claimed(pub(super) Ticket);

type Boxed<O> = Pin<Box<dyn Future<Output = O> + Send>>;

pin_project! {
    /// `work` under a claim's lease, then the value it comes to stored (or the key released);
    /// comes to what `work` handed back besides that value, or the error of its panic.
    ///
    /// Dropped before it ends, the ticket goes with it: the key is released.
    pub(crate) struct ClaimedRun<W, H> {
        ticket: Option<Ticket>,
        // The work sees its claim's fence (`Fence::current`).
        #[pin]
        work: CatchPanic<TaskLocalFuture<Fence, W>>,
        // Built once the work is pending: work that ends at its first poll renews nothing.
        renewing: Option<Boxed<()>>,
        // A completion that must wait (a shared store) and what to hand back after it: rare,
        // so boxed whole (the run's box stays small).
        completing: Option<Box<(Boxed<Result<(), Unrecorded>>, H)>>,
        // The task of the first poll: a run that ends in another has lost its caller.
        started_in: Option<Option<tokio::task::Id>>,
    }
}

impl<W: Future, H> ClaimedRun<W, H> {
    pub(super) fn new(claim: Claimed, work: W) -> Self {
        let work = throttlebeam_supervisors::catch_panic(claim.0.fence().scope(work));
        Self {
            ticket: Some(claim.0),
            work,
            renewing: None,
            completing: None,
            started_in: None,
        }
    }
}

impl<W, T, E, H> Future for ClaimedRun<W, H>
where
    W: Future<Output = (Result<T, E>, H)>,
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
{
    type Output = Result<H, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let started_in = *this.started_in.get_or_insert_with(tokio::task::try_id);
        if this.completing.is_none() {
            let caught = match this.work.poll(cx) {
                Poll::Ready(caught) => caught,
                Poll::Pending => {
                    let ticket = this.ticket.as_ref().expect("polled after completion");
                    let renewing = this.renewing.get_or_insert_with(|| ticket.renewing());
                    let _ = renewing.as_mut().poll(cx);
                    return Poll::Pending;
                }
            };
            *this.renewing = None;
            let ticket = this.ticket.take().expect("polled after completion");
            let gone = left(started_in, &ticket);
            let (value, handed) = match caught {
                Ok(ran) => ran,
                Err(panic) => {
                    let error = Error::panicked(ticket.key(), &panic);
                    ticket.release();
                    super::failed(gone.as_deref(), &error);
                    return Poll::Ready(Err(error));
                }
            };
            let value = match value {
                Ok(value) => value,
                Err(e) => {
                    // The error is made only for a caller that is gone: this one has `handed`.
                    if gone.is_some() {
                        super::failed(gone.as_deref(), &Error::failed(&shown(ticket.key()), e));
                    }
                    ticket.release();
                    return Poll::Ready(Ok(handed));
                }
            };
            // Not recorded (logged by the ticket): the handler ran, its response goes out.
            let (ticket, value) = match ticket.complete_now(value) {
                CompletedNow::Done => return Poll::Ready(Ok(handed)),
                CompletedNow::Waits(ticket, value) => (ticket, value),
            };
            // Boxed: a completion that waits is rare (a shared store).
            *this.completing = Some(Box::new((Box::pin(ticket.complete(value)), handed)));
        }
        let (completing, _) = &mut **this.completing.as_mut().expect("just set");
        // Not recorded (logged by the ticket): the handler ran, its response goes out.
        let _ = ready!(completing.as_mut().poll(cx));
        let (_, handed) = *this.completing.take().expect("just polled");
        Poll::Ready(Ok(handed))
    }
}

/// The ledger of `ticket` if its run has left the task of its first poll (`started_in`): its
/// caller is gone.
fn left(started_in: Option<tokio::task::Id>, ticket: &Ticket) -> Option<Arc<Ledger>> {
    (tokio::task::try_id() != started_in).then(|| ticket.ledger())
}
