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
    /// The sharded listener (cluster only), shared with its task.
    sharded: Arc<Sharded>,
}

/// The sharded listener's state: on a cluster, each waited-on key's shard
/// channel is subscribed to on the node that owns the key's slot.
#[derive(Default)]
struct Sharded {
    /// A sharded listener task is alive (or starting).
    listening: AtomicBool,
    /// A key was added: subscribe to its channel now.
    changed: Notify,
    /// Shard channel subscriptions confirmed so far.
    subscriptions: AtomicU64,
    /// Sharded notices received so far.
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
            sharded: Arc::default(),
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

    /// Shard channel subscriptions confirmed and sharded notices received
    /// so far.
    pub(super) fn sharded_counts(&self) -> (u64, u64) {
        (
            self.sharded.subscriptions.load(Ordering::Relaxed),
            self.sharded.notices.load(Ordering::Relaxed),
        )
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
        let mut added = false;
        let notify = inner
            .waiters
            .keys
            .entry(key.to_owned())
            .or_insert_with(|| {
                added = true;
                Arc::new(Notify::new())
            })
            .clone();
        if added && self.is_cluster() {
            self.subscribe_sharded();
            // A permit is kept if the task is busy: the key is never missed.
            inner.waiters.sharded.changed.notify_one();
        }
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

    /// The shard channel announcing changes of idempotency `key`'s record
    /// on a cluster: its hash tag is the key's, so it lives in the key's
    /// slot.
    pub(crate) fn done_channel(&self, key: &str) -> String {
        self.key(key, ":done")
    }

    /// Starts the sharded listener (cluster only) on the caller's tokio
    /// runtime, unless one is alive.
    fn subscribe_sharded(&self) {
        let sharded = &self.inner.waiters.sharded;
        if sharded.listening.load(Ordering::Acquire)
            || tokio::runtime::Handle::try_current().is_err()
            || sharded.listening.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let guard = ShardedListening {
            inner: Arc::downgrade(&self.inner),
            sharded: Arc::clone(sharded),
        };
        tokio::spawn(listen_sharded(guard));
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

/// How often the sharded listener subscribes again to the channels not
/// confirmed (a dead node, a slot moved) and drops the ones nobody waits on.
const RESYNC: Duration = Duration::from_millis(500);

/// The sharded listener task's hold on the backend; dropped on every exit
/// path, it marks the listener gone so the next waiter starts one, and
/// wakes every waiter to look again.
struct ShardedListening {
    inner: Weak<Inner>,
    sharded: Arc<Sharded>,
}

impl Drop for ShardedListening {
    fn drop(&mut self) {
        self.sharded.listening.store(false, Ordering::Release);
        if let Some(inner) = self.inner.upgrade() {
            inner.waiters.wake_all();
        }
    }
}

/// The sharded subscription loop (cluster only). One RESP3 cluster
/// connection carries every shard channel; redis-rs routes each
/// `SSUBSCRIBE` to the owner of the channel's slot and resubscribes after a
/// reconnect or a new slot map. This loop adds what it cannot know: a
/// channel the server dropped (`sunsubscribe` after a slot moved) or one
/// lost with a dead node is subscribed to again every [`RESYNC`] until
/// confirmed, and every confirmation wakes the key's waiters, since a
/// notice sent while the channel was not subscribed is lost. Waiters poll
/// meanwhile, as they always do.
async fn listen_sharded(guard: ShardedListening) {
    let mut pause = Duration::from_millis(100);
    let (mut conn, mut pushes) = loop {
        let client = {
            let Some(inner) = guard.inner.upgrade() else {
                return;
            };
            inner.link.sharded()
        };
        let Some(client) = client else {
            return;
        };
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let config = redis::cluster::ClusterConfig::new().set_push_sender(tx);
        match tokio::time::timeout(
            SUBSCRIBE_TIMEOUT,
            client.get_async_connection_with_config(config),
        )
        .await
        {
            Ok(Ok(conn)) => break (conn, rx),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "sharded pub/sub connection failed; polling meanwhile");
            }
            Err(_) => {
                tracing::debug!(timeout = ?SUBSCRIBE_TIMEOUT, "sharded pub/sub connection timed out; polling meanwhile");
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(5));
    };
    // Channel -> key, for every channel asked for; and the confirmed ones.
    let mut asked: std::collections::HashMap<String, String> = Default::default();
    let mut confirmed: std::collections::HashSet<String> = Default::default();
    let mut resync = tokio::time::interval(RESYNC);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let mut tick = false;
        tokio::select! {
            push = pushes.recv() => {
                let Some(push) = push else { return };
                let Some(inner) = guard.inner.upgrade() else { return };
                on_push(&inner, &guard.sharded, push, &asked, &mut confirmed);
                continue;
            }
            () = guard.sharded.changed.notified() => {}
            _ = resync.tick() => tick = true,
        }
        // What to (un)subscribe, worked out without holding the backend
        // across a round trip (so dropping it ends this task).
        let (subscribe, unsubscribe) = {
            let Some(inner) = guard.inner.upgrade() else {
                return;
            };
            let redis = super::Redis {
                inner: Arc::clone(&inner),
            };
            let mut subscribe = Vec::new();
            let mut wanted = std::collections::HashSet::new();
            for entry in &inner.waiters.keys {
                let channel = redis.done_channel(entry.key());
                let fresh = !asked.contains_key(&channel);
                if fresh || (tick && !confirmed.contains(&channel)) {
                    subscribe.push(channel.clone());
                }
                if fresh {
                    asked.insert(channel.clone(), entry.key().clone());
                }
                wanted.insert(channel);
            }
            // Dropped only on a tick: a waiter that looks again drops its
            // watch and makes a new one, which should not cost a round trip.
            let unsubscribe: Vec<String> = if tick {
                asked
                    .keys()
                    .filter(|c| !wanted.contains(*c))
                    .cloned()
                    .collect()
            } else {
                Vec::new()
            };
            (subscribe, unsubscribe)
        };
        for channel in unsubscribe {
            asked.remove(&channel);
            confirmed.remove(&channel);
            if let Err(e) = conn.sunsubscribe(&channel).await {
                tracing::debug!(%channel, error = %e, "sharded unsubscribe failed");
            }
        }
        for channel in subscribe {
            if let Err(e) = conn.ssubscribe(&channel).await {
                // Asked again on the next tick; the waiter polls meanwhile.
                tracing::debug!(%channel, error = %e, "sharded subscribe failed; polling meanwhile");
            }
        }
    }
}

/// One push of the sharded connection: a confirmation, a notice, a dropped
/// channel or a lost node.
fn on_push(
    inner: &Inner,
    sharded: &Sharded,
    push: redis::PushInfo,
    asked: &std::collections::HashMap<String, String>,
    confirmed: &mut std::collections::HashSet<String>,
) {
    let text = |v: Option<&redis::Value>| match v {
        Some(redis::Value::BulkString(b)) => Some(String::from_utf8_lossy(b).into_owned()),
        Some(redis::Value::SimpleString(s)) => Some(s.clone()),
        _ => None,
    };
    match push.kind {
        redis::PushKind::SSubscribe => {
            if let Some(channel) = text(push.data.first()) {
                sharded.subscriptions.fetch_add(1, Ordering::Relaxed);
                confirmed.insert(channel.clone());
                // Changes before the subscription were not heard: look again.
                if let Some(key) = asked.get(&channel) {
                    inner.waiters.wake(key);
                }
            }
        }
        redis::PushKind::SMessage => {
            sharded.notices.fetch_add(1, Ordering::Relaxed);
            if let Some(key) = text(push.data.get(1)) {
                inner.waiters.wake(&key);
            }
        }
        redis::PushKind::SUnsubscribe => {
            // Ours, or the server's after the slot moved: the next tick
            // subscribes again if someone still waits.
            if let Some(channel) = text(push.data.first()) {
                confirmed.remove(&channel);
            }
        }
        redis::PushKind::Disconnection => {
            // Which node's channels were lost is not said: ask for all again.
            confirmed.clear();
        }
        _ => {}
    }
}
