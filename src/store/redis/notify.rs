//! Completion notices for idempotency waiters, debounce notices and rate
//! limiting's resets: one pub/sub subscription per backend value, on three
//! channels, multiplexed over every waiting key, with polling as the fallback
//! when the subscription is down (rate limiting then answers nothing
//! locally).
//!
//! The listener is a task on the tokio runtime of the first subscriber.
//! It reconnects by itself, moving to the next seed node after a failure;
//! if its task ends (its runtime ended), its guard marks it gone and the
//! next subscriber starts it again on its own runtime.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use dashmap::DashMap;
use futures_util::StreamExt;
use tokio::sync::Notify;

use super::Inner;

/// How long connecting and subscribing to one node may take before the
/// listener tries the next one.
const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Keys someone on this instance waits for, each with its wake-up.
pub(crate) struct Waiters {
    keys: DashMap<String, Arc<Notify>>,
    /// A listener task is alive (or starting); its guard clears this when
    /// the task ends, however it ends, so the next subscriber starts one.
    listening: AtomicBool,
    /// Whether the subscription is live, for users that should not publish
    /// before they can hear the answer.
    subscribed: tokio::sync::watch::Sender<bool>,
    /// Which seed node the next subscription tries: moved on after a
    /// failure or a lost subscription.
    node: AtomicUsize,
    /// Subscriptions made so far.
    subscriptions: AtomicU64,
    /// Notices received so far.
    notices: AtomicU64,
}

impl Default for Waiters {
    fn default() -> Self {
        Self {
            keys: DashMap::new(),
            listening: AtomicBool::new(false),
            subscribed: tokio::sync::watch::Sender::new(false),
            node: AtomicUsize::new(0),
            subscriptions: AtomicU64::new(0),
            notices: AtomicU64::new(0),
        }
    }
}

impl Waiters {
    fn wake(&self, key: &str) {
        if let Some(notify) = self.keys.get(key) {
            notify.notify_waiters();
        }
    }

    /// Wakes every waiter: notices may have been missed while nobody
    /// listened, so each looks at its key again (and subscribes again).
    fn wake_all(&self) {
        for entry in &self.keys {
            entry.value().notify_waiters();
        }
    }

    /// The live subscription's number (how many were made before it, itself
    /// included), or `None` while none is live: what rate limiting's local
    /// answers hold on to, since a notice sent while nobody listened is lost.
    pub(super) fn live_subscription(&self) -> Option<u64> {
        if *self.subscribed.borrow() {
            Some(self.subscriptions.load(Ordering::Acquire))
        } else {
            None
        }
    }

    /// Subscriptions made and notices received so far.
    pub(super) fn counts(&self) -> (u64, u64) {
        (
            self.subscriptions.load(Ordering::Relaxed),
            self.notices.load(Ordering::Relaxed),
        )
    }
}

/// A registration for one key; dropping it forgets the key once nobody
/// else waits for it.
pub(crate) struct Watch {
    inner: Arc<Inner>,
    key: String,
    notify: Arc<Notify>,
}

impl Watch {
    /// The next change as a future that owns this registration; it listens
    /// from now on, before it is first polled, so a notice that lands
    /// before the wait begins still wakes it.
    pub(crate) fn into_changed(self) -> impl Future<Output = ()> + Send + 'static {
        let mut notified = Box::pin(Arc::clone(&self.notify).notified_owned());
        notified.as_mut().enable();
        async move {
            let _registered = self;
            notified.await;
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // Two references: this watch's and the map's.
        self.inner.waiters.keys.remove_if(&self.key, |_, n| {
            Arc::ptr_eq(n, &self.notify) && Arc::strong_count(n) <= 2
        });
    }
}

impl super::Redis {
    /// Starts watching `key` for completion notices. Register before
    /// reading the record, so a notice between the read and the wait is
    /// never missed.
    pub(crate) fn watch(&self, key: &str) -> Watch {
        let inner = &self.inner;
        self.subscribe();
        let notify = inner
            .waiters
            .keys
            .entry(key.to_owned())
            .or_insert_with(|| Arc::new(Notify::new()))
            .clone();
        Watch {
            inner: self.inner.clone(),
            key: key.to_owned(),
            notify,
        }
    }
}

impl super::Redis {
    /// Starts the backend's one subscription on the caller's tokio runtime,
    /// unless a listener is alive; a listener whose task ended (its runtime
    /// ended) is started again here.
    pub(crate) fn subscribe(&self) {
        let waiters = &self.inner.waiters;
        if waiters.listening.load(Ordering::Acquire) {
            return;
        }
        // Outside tokio nothing can listen yet: leave it to the next caller.
        if tokio::runtime::Handle::try_current().is_err()
            || waiters.listening.swap(true, Ordering::AcqRel)
        {
            return;
        }
        // Made before the spawn: a task dropped unpolled hands back too.
        let guard = Listening {
            inner: Arc::downgrade(&self.inner),
        };
        tokio::spawn(listen(
            guard,
            self.claims_channel(),
            self.debounce_channel(),
            self.rate_limit_channel(),
        ));
    }

    /// The live subscription's number, if the subscription is live.
    pub(crate) fn subscription_live(&self) -> Option<u64> {
        self.inner.waiters.live_subscription()
    }

    /// Waits until the subscription is live, at most `max`. Whether it is.
    #[cfg(test)]
    pub(crate) async fn subscribed(&self, max: Duration) -> bool {
        let mut live = self.inner.waiters.subscribed.subscribe();
        tokio::time::timeout(max, live.wait_for(|up| *up))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

/// The listener task's hold on the backend. Dropped on every exit path
/// (the backend dropped, the task's tokio runtime ended, a panic), it marks
/// the listener gone, so the next subscriber starts one on its own runtime,
/// and wakes every waiter, whose next look subscribes again.
struct Listening {
    inner: Weak<Inner>,
}

impl Drop for Listening {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade() {
            let waiters = &inner.waiters;
            waiters.subscribed.send_replace(false);
            waiters.listening.store(false, Ordering::Release);
            waiters.wake_all();
            tracing::debug!("completion listener ended; the next subscriber restarts it");
        }
    }
}

/// The subscription loop: reconnects with a pause while the backend value
/// lives, moving to the next seed node after a failure or a lost
/// subscription. Regular `PUBLISH` reaches every node of a cluster, so one
/// node at a time is enough.
async fn listen(guard: Listening, channel: String, bursts: String, limits: String) {
    let mut pause = Duration::from_millis(100);
    loop {
        let (url, client, again) = {
            let Some(inner) = guard.inner.upgrade() else {
                return;
            };
            let waiters = &inner.waiters;
            let (url, client) = inner.link.subscriber(waiters.node.load(Ordering::Relaxed));
            (
                url,
                client,
                waiters.subscriptions.load(Ordering::Relaxed) > 0,
            )
        };
        let subscribed = tokio::time::timeout(SUBSCRIBE_TIMEOUT, async {
            let client = client.ok_or_else(|| {
                redis::RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "no node to subscribe on",
                ))
            })?;
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&[&channel, &bursts, &limits]).await?;
            Ok::<_, redis::RedisError>(pubsub)
        })
        .await;
        match subscribed {
            Ok(Ok(pubsub)) => {
                pause = Duration::from_millis(100);
                tracing::debug!(%channel, %bursts, %url, "subscribed to completions and debounce notices");
                if let Some(inner) = guard.inner.upgrade() {
                    let waiters = &inner.waiters;
                    waiters.subscriptions.fetch_add(1, Ordering::Relaxed);
                    waiters.subscribed.send_replace(true);
                    if again {
                        // Notices sent while nobody listened are lost: every
                        // waiter looks again.
                        waiters.wake_all();
                    }
                }
                let mut messages = pubsub.into_on_message();
                while let Some(msg) = messages.next().await {
                    let Some(inner) = guard.inner.upgrade() else {
                        return;
                    };
                    inner.waiters.notices.fetch_add(1, Ordering::Relaxed);
                    if msg.get_channel_name() == bursts {
                        inner.subscribers.deliver(&bursts, msg.get_payload_bytes());
                    } else if msg.get_channel_name() == limits {
                        inner.subscribers.deliver(&limits, msg.get_payload_bytes());
                    } else if let Ok(key) = msg.get_payload::<String>() {
                        inner.waiters.wake(&key);
                    }
                }
                tracing::debug!(%channel, %url, "completion subscription ended; reconnecting");
            }
            Ok(Err(e)) => {
                tracing::debug!(%channel, %url, error = %e, "completion subscription failed; polling meanwhile");
            }
            Err(_) => {
                tracing::debug!(%channel, %url, timeout = ?SUBSCRIBE_TIMEOUT, "completion subscription timed out; polling meanwhile");
            }
        }
        if let Some(inner) = guard.inner.upgrade() {
            inner.waiters.subscribed.send_replace(false);
            inner.waiters.node.fetch_add(1, Ordering::Relaxed);
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}
