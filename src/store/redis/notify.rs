//! Completion notices for idempotency waiters and debounce notices: one
//! pub/sub subscription per backend value, on two channels, multiplexed over
//! every waiting key, with polling as the fallback when the subscription is
//! down.

use std::sync::{Arc, Weak};
use std::time::Duration;

use dashmap::DashMap;
use futures_util::StreamExt;
use tokio::sync::Notify;

use super::Inner;

/// Keys someone on this instance waits for, each with its wake-up.
pub(crate) struct Waiters {
    keys: DashMap<String, Arc<Notify>>,
    started: std::sync::Once,
    /// Whether the subscription is live, for users that should not publish
    /// before they can hear the answer.
    subscribed: tokio::sync::watch::Sender<bool>,
}

impl Default for Waiters {
    fn default() -> Self {
        Self {
            keys: DashMap::new(),
            started: std::sync::Once::new(),
            subscribed: tokio::sync::watch::Sender::new(false),
        }
    }
}

impl Waiters {
    fn wake(&self, key: &str) {
        if let Some(notify) = self.keys.get(key) {
            notify.notify_waiters();
        }
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
    pub(crate) fn into_changed(self) -> crate::KeyChanged {
        let mut notified = Box::pin(Arc::clone(&self.notify).notified_owned());
        notified.as_mut().enable();
        crate::KeyChanged::new(async move {
            let _registered = self;
            notified.await;
        })
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
    /// Starts the backend's one subscription, once (inside a tokio runtime).
    pub(crate) fn subscribe(&self) {
        // Outside tokio nothing can listen yet: leave it to the next caller.
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        self.inner.waiters.started.call_once(|| {
            tokio::spawn(listen(
                Arc::downgrade(&self.inner),
                self.inner.nodes[0].clone(),
                self.claims_channel(),
                self.debounce_channel(),
            ));
        });
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

/// The subscription loop: reconnects with a pause while the backend value
/// lives. Regular `PUBLISH` reaches every node of a cluster, so one seed
/// node is enough.
async fn listen(inner: Weak<Inner>, url: String, channel: String, bursts: String) {
    let mut pause = Duration::from_millis(100);
    loop {
        if inner.strong_count() == 0 {
            return;
        }
        let subscribed = async {
            let client = redis::Client::open(url.as_str())?;
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&[&channel, &bursts]).await?;
            Ok::<_, redis::RedisError>(pubsub)
        }
        .await;
        match subscribed {
            Ok(pubsub) => {
                pause = Duration::from_millis(100);
                tracing::debug!(%channel, %bursts, "subscribed to completions and debounce notices");
                if let Some(inner) = inner.upgrade() {
                    inner.waiters.subscribed.send_replace(true);
                }
                let mut messages = pubsub.into_on_message();
                while let Some(msg) = messages.next().await {
                    let Some(inner) = inner.upgrade() else { return };
                    if msg.get_channel_name() == bursts {
                        inner.bursts.deliver(msg.get_payload_bytes());
                    } else if let Ok(key) = msg.get_payload::<String>() {
                        inner.waiters.wake(&key);
                    }
                }
                if let Some(inner) = inner.upgrade() {
                    inner.waiters.subscribed.send_replace(false);
                }
                tracing::debug!(%channel, "completion subscription ended; reconnecting");
            }
            Err(e) => {
                tracing::debug!(%channel, error = %e, "completion subscription failed; polling meanwhile");
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}
