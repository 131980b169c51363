//! The pub/sub multiplexer: one broadcast subscription per backend value
//! and, on a cluster, one sharded connection, each carrying every channel
//! registered with it, and a typed subscriber registry that hands each
//! message to the subscribers of its channel.
//!
//! A primitive registers a [`Subscriber`] for a channel and holds the
//! [`Subscription`] it gets back: while that lives, the channel stays
//! subscribed and its messages are delivered. A message published while a
//! channel is not heard is lost, so [`Subscription::live`] says whether it
//! is heard now (users poll meanwhile), and [`Subscriber::missed`] is told
//! when it is heard again after a loss.
//!
//! Broadcast channels (`SUBSCRIBE`) share one connection to one seed node
//! (behind Sentinel, the primary): a regular `PUBLISH` reaches every node of
//! a cluster. Shard channels (`SSUBSCRIBE`, cluster only) share one RESP3
//! cluster connection that routes each to the owner of its slot (see
//! `pubsub/sharded.rs`).
//!
//! Each listener is a task on the tokio runtime of the first subscriber.
//! It reconnects by itself, the broadcast one moving to the next seed node
//! after a failure; if its task ends (its runtime ended), its guard marks
//! it gone and the next subscriber starts it again on its own runtime.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use dashmap::DashMap;
use futures_util::StreamExt;
use tokio::sync::Notify;

use super::{Inner, Redis};

mod sharded;

/// How long connecting and subscribing to one node may take before the
/// listener tries the next one.
const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(2);

/// How often a live subscriber connection proves it is alive: a `PING` (which
/// a RESP2 subscriber may send; a sharded RESP3 connection pings every
/// primary it may hold channels on).
pub(super) const PING_EVERY: Duration = Duration::from_secs(1);

/// How long the answer to that `PING` may take: past it the connection is
/// taken for dead (a partition that sent no FIN or RST, a NAT or load balancer
/// that dropped it while idle) and replaced, and its channels are not heard
/// until the new one is subscribed. A dead subscriber connection goes unnoticed
/// for at most [`PING_EVERY`] + `PONG_WITHIN`: 2 s.
pub(super) const PONG_WITHIN: Duration = Duration::from_secs(1);

/// Who hears the messages of a channel.
pub(crate) trait Subscriber: Send + Sync {
    /// A message on the channel; called on the listener's task, so it must
    /// not block.
    fn message(&self, payload: &[u8]);

    /// Messages on the channel may have been lost: it is heard again after
    /// the subscription was down, or heard only now though registered
    /// before (a shard channel, a broadcast channel that joined a live
    /// connection). Look again at whatever they would have announced.
    fn missed(&self) {}
}

/// A subscriber's registration for one channel. The channel stays
/// subscribed while someone holds one; dropping the last lets it go.
#[must_use = "a channel is heard only while its subscription is held"]
pub(crate) struct Subscription {
    /// Weak: primitives keep their subscriptions in the backend itself.
    inner: Weak<Inner>,
    hub: Arc<Hub>,
    sharded: bool,
    channel: String,
    id: u64,
    heard: Arc<AtomicU64>,
}

impl Subscription {
    /// The number of the subscription that hears this channel now, or
    /// `None` while it is not heard. The number changes whenever the
    /// channel was lost in between, so a caller that saw the same number
    /// twice knows no message was missed in between.
    pub(crate) fn live(&self) -> Option<u64> {
        match self.heard.load(Ordering::Acquire) {
            0 => None,
            n => Some(n),
        }
    }

    /// Starts this channel's listener on the caller's tokio runtime,
    /// unless one is alive: one whose task ended (its runtime ended) is
    /// started again here.
    pub(crate) fn listen(&self) {
        if self.hub.listening.load(Ordering::Acquire) {
            return;
        }
        if let Some(inner) = self.inner.upgrade() {
            let redis = Redis { inner };
            if self.sharded {
                redis.listen_sharded();
            } else {
                redis.listen();
            }
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        // Dropped from the server's subscriptions lazily: a sharded one at
        // the listener's next tick, a broadcast one at its next connection.
        self.hub.unregister(&self.channel, self.id);
    }
}

/// The pub/sub state of one backend value.
pub(super) struct PubSub {
    broadcast: Arc<Hub>,
    sharded: Arc<Hub>,
    /// Which seed node the next broadcast subscription tries: moved on
    /// after a failure or a lost subscription.
    node: AtomicUsize,
    /// Whether the broadcast connection is live.
    subscribed: tokio::sync::watch::Sender<bool>,
}

impl Default for PubSub {
    fn default() -> Self {
        Self {
            broadcast: Arc::default(),
            sharded: Arc::default(),
            node: AtomicUsize::new(0),
            subscribed: tokio::sync::watch::Sender::new(false),
        }
    }
}

/// The counters of [`PubSub`], for [`RedisStats`](super::RedisStats).
pub(super) struct Counts {
    pub(super) subscriptions: u64,
    pub(super) notices: u64,
    pub(super) sharded_subscriptions: u64,
    pub(super) sharded_notices: u64,
}

impl PubSub {
    pub(super) fn counts(&self) -> Counts {
        Counts {
            subscriptions: self.broadcast.subscriptions.load(Ordering::Relaxed),
            notices: self.broadcast.notices.load(Ordering::Relaxed),
            sharded_subscriptions: self.sharded.subscriptions.load(Ordering::Relaxed),
            sharded_notices: self.sharded.notices.load(Ordering::Relaxed),
        }
    }
}

/// The registered channels of one kind (broadcast or sharded) and what
/// their listener shares with them.
#[derive(Default)]
struct Hub {
    channels: DashMap<String, Channel>,
    /// A channel was registered: subscribe to it now. A permit is kept
    /// while the listener is busy, so a registration is never missed.
    changed: Notify,
    /// A listener task is alive (or starting); its guard clears this when
    /// the task ends, however it ends, so the next subscriber starts one.
    listening: AtomicBool,
    /// Broadcast: connections subscribed; sharded: channels confirmed.
    subscriptions: AtomicU64,
    /// Messages received.
    notices: AtomicU64,
    /// Tells registrations of one channel apart.
    next_id: AtomicU64,
}

struct Channel {
    /// Held weakly: the registry never keeps a primitive's state alive.
    subscribers: Vec<(u64, Weak<dyn Subscriber>)>,
    /// The number of the subscription that confirmed the channel; 0 while
    /// it is not heard.
    heard: Arc<AtomicU64>,
}

impl Hub {
    /// Adds a registration; its id, its channel's heard number, and whether
    /// the channel is new (to be subscribed).
    fn register(
        &self,
        channel: String,
        subscriber: Weak<dyn Subscriber>,
    ) -> (u64, Arc<AtomicU64>, bool) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut fresh = false;
        let mut entry = self.channels.entry(channel).or_insert_with(|| {
            fresh = true;
            Channel {
                subscribers: Vec::new(),
                heard: Arc::default(),
            }
        });
        entry.subscribers.retain(|(_, s)| s.strong_count() > 0);
        entry.subscribers.push((id, subscriber));
        (id, Arc::clone(&entry.heard), fresh)
    }

    fn unregister(&self, channel: &str, id: u64) {
        self.channels.remove_if_mut(channel, |_, c| {
            c.subscribers.retain(|(i, _)| *i != id);
            c.subscribers.is_empty()
        });
    }

    fn names(&self) -> Vec<String> {
        self.channels.iter().map(|e| e.key().clone()).collect()
    }

    /// Records that `channel` is heard on subscription `number` (0: not).
    fn heard(&self, channel: &str, number: u64) {
        if let Some(c) = self.channels.get(channel) {
            c.heard.store(number, Ordering::Release);
        }
    }

    /// Records that `channel` is heard on subscription `number`, unless it
    /// is heard already.
    fn heard_if_unheard(&self, channel: &str, number: u64) {
        if let Some(c) = self.channels.get(channel) {
            let _ = c
                .heard
                .compare_exchange(0, number, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// Nothing is heard any more: the connection is gone.
    fn unheard_all(&self) {
        for c in &self.channels {
            c.heard.store(0, Ordering::Release);
        }
    }

    /// The live subscribers of `channel`, taken out of the registry so that
    /// none is called under its lock.
    fn subscribers_of(&self, channel: &str) -> Vec<Arc<dyn Subscriber>> {
        self.channels.get(channel).map_or_else(Vec::new, |c| {
            c.subscribers
                .iter()
                .filter_map(|(_, s)| s.upgrade())
                .collect()
        })
    }

    fn deliver(&self, channel: &str, payload: &[u8]) {
        for subscriber in self.subscribers_of(channel) {
            subscriber.message(payload);
        }
    }

    fn missed(&self, channel: &str) {
        for subscriber in self.subscribers_of(channel) {
            subscriber.missed();
        }
    }

    fn missed_all(&self) {
        let all: Vec<Arc<dyn Subscriber>> = self
            .channels
            .iter()
            .flat_map(|c| {
                c.subscribers
                    .iter()
                    .filter_map(|(_, s)| s.upgrade())
                    .collect::<Vec<_>>()
            })
            .collect();
        for subscriber in all {
            subscriber.missed();
        }
    }
}

impl Redis {
    /// Hands the messages of the broadcast channel `channel` to
    /// `subscriber` while the returned subscription is held. The channel is
    /// subscribed on the backend's one pub/sub connection: at once if it is
    /// live, else when it is made (the listener is started here if none
    /// runs).
    pub(crate) fn subscribe(
        &self,
        channel: String,
        subscriber: Weak<dyn Subscriber>,
    ) -> Subscription {
        let subscription = self.register(false, channel, subscriber);
        self.listen();
        subscription
    }

    /// [`Redis::subscribe`] for the shard channel `channel`, on a cluster:
    /// `SSUBSCRIBE`d on the node that owns its slot, over the backend's one
    /// sharded connection. Elsewhere nothing subscribes it, and it is never
    /// live.
    pub(crate) fn subscribe_sharded(
        &self,
        channel: String,
        subscriber: Weak<dyn Subscriber>,
    ) -> Subscription {
        let subscription = self.register(true, channel, subscriber);
        self.listen_sharded();
        subscription
    }

    fn register(
        &self,
        sharded: bool,
        channel: String,
        subscriber: Weak<dyn Subscriber>,
    ) -> Subscription {
        let pubsub = &self.inner.pubsub;
        let hub = if sharded {
            &pubsub.sharded
        } else {
            &pubsub.broadcast
        };
        let (id, heard, fresh) = hub.register(channel.clone(), subscriber);
        if fresh {
            hub.changed.notify_one();
        }
        Subscription {
            inner: Arc::downgrade(&self.inner),
            hub: Arc::clone(hub),
            sharded,
            channel,
            id,
            heard,
        }
    }

    /// Starts the broadcast listener on the caller's tokio runtime, unless
    /// one is alive.
    fn listen(&self) {
        let hub = &self.inner.pubsub.broadcast;
        if !claim_listener(hub) {
            return;
        }
        // Made before the spawn: a task dropped unpolled hands back too.
        let guard = Listening {
            inner: Arc::downgrade(&self.inner),
            hub: Arc::clone(hub),
        };
        tokio::spawn(listen(guard));
    }

    /// Waits until the broadcast connection is live, at most `max`.
    /// Whether it is.
    #[cfg(test)]
    pub(crate) async fn subscribed(&self, max: Duration) -> bool {
        let mut live = self.inner.pubsub.subscribed.subscribe();
        tokio::time::timeout(max, live.wait_for(|up| *up))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

/// Whether the caller is to start `hub`'s listener: none is alive, and
/// there is a tokio runtime to start it on (outside one, nothing can listen
/// yet: left to the next caller).
fn claim_listener(hub: &Hub) -> bool {
    !hub.listening.load(Ordering::Acquire)
        && tokio::runtime::Handle::try_current().is_ok()
        && !hub.listening.swap(true, Ordering::AcqRel)
}

/// The broadcast listener task's hold on the backend. Dropped on every exit
/// path (the backend dropped, the task's tokio runtime ended, a panic), it
/// marks the listener gone, so the next subscriber starts one on its own
/// runtime, and tells every subscriber it may have missed messages.
struct Listening {
    inner: Weak<Inner>,
    hub: Arc<Hub>,
}

impl Drop for Listening {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade() {
            inner.pubsub.subscribed.send_replace(false);
            self.hub.unheard_all();
            self.hub.listening.store(false, Ordering::Release);
            self.hub.missed_all();
            tracing::debug!("pub/sub listener ended; the next subscriber restarts it");
        }
    }
}

/// The subscription loop: reconnects with a pause while the backend value
/// lives, moving to the next seed node after a failure or a lost
/// subscription. Regular `PUBLISH` reaches every node of a cluster, so one
/// node at a time is enough.
async fn listen(guard: Listening) {
    let hub = Arc::clone(&guard.hub);
    let mut pause = Duration::from_millis(100);
    loop {
        let (url, client, again) = {
            let Some(inner) = guard.inner.upgrade() else {
                return;
            };
            let (url, client) = inner
                .link
                .subscriber(inner.pubsub.node.load(Ordering::Relaxed));
            (url, client, hub.subscriptions.load(Ordering::Relaxed) > 0)
        };
        let connected = tokio::time::timeout(SUBSCRIBE_TIMEOUT, async {
            let client = client.ok_or_else(|| {
                redis::RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "no node to subscribe on",
                ))
            })?;
            let (mut sink, messages) = client.get_async_pubsub().await?.split();
            // The channels registered so far; later ones join on the way.
            let channels = hub.names();
            if !channels.is_empty() {
                sink.subscribe(&channels).await?;
            }
            Ok::<_, redis::RedisError>((sink, messages, channels))
        })
        .await;
        match connected {
            Ok(Ok((sink, messages, channels))) => {
                pause = Duration::from_millis(100);
                tracing::debug!(?channels, %url, "subscribed to the pub/sub channels");
                let number = hub.subscriptions.fetch_add(1, Ordering::Relaxed) + 1;
                for channel in &channels {
                    hub.heard(channel, number);
                }
                if let Some(inner) = guard.inner.upgrade() {
                    inner.pubsub.subscribed.send_replace(true);
                }
                if again {
                    // Messages sent while nobody listened are lost: every
                    // subscriber looks again.
                    hub.missed_all();
                }
                let live = Live {
                    guard: &guard,
                    number,
                    url: url.clone(),
                    subscribed: channels.into_iter().collect(),
                };
                if live.run(sink, messages).await.is_break() {
                    return;
                }
                tracing::debug!(%url, "pub/sub subscription ended; reconnecting");
            }
            Ok(Err(e)) => {
                tracing::debug!(%url, error = %e, "pub/sub subscription failed; polling meanwhile");
            }
            Err(_) => {
                tracing::debug!(%url, timeout = ?SUBSCRIBE_TIMEOUT, "pub/sub subscription timed out; polling meanwhile");
            }
        }
        hub.unheard_all();
        if let Some(inner) = guard.inner.upgrade() {
            inner.pubsub.subscribed.send_replace(false);
            inner.pubsub.node.fetch_add(1, Ordering::Relaxed);
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

/// A live broadcast connection.
struct Live<'a> {
    guard: &'a Listening,
    /// Its subscription number.
    number: u64,
    /// The node it is connected to.
    url: String,
    /// The channels subscribed on it.
    subscribed: HashSet<String>,
}

impl Live<'_> {
    /// Delivers messages and subscribes the channels registered meanwhile,
    /// until the connection is lost or silent, or the primary it is on is no
    /// longer the one to listen to (`Continue`: reconnect), or the backend is
    /// dropped (`Break`). Every [`PING_EVERY`] it sends a `PING`, whose answer
    /// must come within [`PONG_WITHIN`].
    async fn run(
        mut self,
        mut sink: redis::aio::PubSubSink,
        mut messages: redis::aio::PubSubStream,
    ) -> std::ops::ControlFlow<()> {
        type Pong = std::pin::Pin<
            Box<
                dyn Future<
                        Output = Result<
                            redis::RedisResult<redis::Value>,
                            tokio::time::error::Elapsed,
                        >,
                    > + Send,
            >,
        >;
        let hub = &self.guard.hub;
        let mut ping =
            tokio::time::interval_at(tokio::time::Instant::now() + PING_EVERY, PING_EVERY);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut pong: Option<Pong> = None;
        loop {
            tokio::select! {
                _ = ping.tick(), if pong.is_none() => {
                    if !self.still_the_node() {
                        return std::ops::ControlFlow::Continue(());
                    }
                    let mut sink = sink.clone();
                    pong = Some(Box::pin(tokio::time::timeout(PONG_WITHIN, async move {
                        sink.ping::<redis::Value>().await
                    })));
                }
                answered = async { pong.as_mut().expect("polled only while a PING is out").await }, if pong.is_some() => {
                    pong = None;
                    match answered {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => {
                            tracing::debug!(url = %self.url, error = %e, "pub/sub PING failed; reconnecting");
                            return std::ops::ControlFlow::Continue(());
                        }
                        Err(_) => {
                            tracing::warn!(
                                url = %self.url,
                                within = ?PONG_WITHIN,
                                "the pub/sub connection did not answer PING: taken for dead, reconnecting"
                            );
                            return std::ops::ControlFlow::Continue(());
                        }
                    }
                }
                msg = messages.next() => {
                    let Some(msg) = msg else {
                        return std::ops::ControlFlow::Continue(());
                    };
                    if self.guard.inner.strong_count() == 0 {
                        return std::ops::ControlFlow::Break(());
                    }
                    hub.notices.fetch_add(1, Ordering::Relaxed);
                    hub.deliver(msg.get_channel_name(), msg.get_payload_bytes());
                }
                () = hub.changed.notified() => {
                    let mut fresh = Vec::new();
                    for channel in hub.names() {
                        if self.subscribed.contains(&channel) {
                            // Let go and registered again: heard all along.
                            hub.heard(&channel, self.number);
                        } else {
                            fresh.push(channel);
                        }
                    }
                    if fresh.is_empty() {
                        continue;
                    }
                    match tokio::time::timeout(SUBSCRIBE_TIMEOUT, sink.subscribe(&fresh)).await {
                        Ok(Ok(())) => {
                            for channel in &fresh {
                                hub.heard(channel, self.number);
                                // Registered before it was heard: whatever
                                // was sent meanwhile is lost.
                                hub.missed(channel);
                            }
                            self.subscribed.extend(fresh);
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(?fresh, error = %e, "subscribing more channels failed; reconnecting");
                            return std::ops::ControlFlow::Continue(());
                        }
                        Err(_) => {
                            tracing::debug!(?fresh, timeout = ?SUBSCRIBE_TIMEOUT, "subscribing more channels timed out; reconnecting");
                            return std::ops::ControlFlow::Continue(());
                        }
                    }
                }
            }
        }
    }
}

impl Live<'_> {
    /// Whether this connection is still on the node to listen to: behind
    /// Sentinel, the primary the Sentinels name now (followed within a
    /// [`PING_EVERY`] of a failover the backend followed).
    fn still_the_node(&self) -> bool {
        let Some(inner) = self.guard.inner.upgrade() else {
            return true;
        };
        let (url, _) = inner
            .link
            .subscriber(inner.pubsub.node.load(Ordering::Relaxed));
        if url == self.url {
            return true;
        }
        tracing::info!(from = %self.url, to = %url, "the Redis primary moved: pub/sub follows it");
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::redis::each_server;

    #[derive(Debug, PartialEq, Eq)]
    enum Event {
        Message(Vec<u8>),
        Missed,
    }

    /// A subscriber that reports what it hears, in order.
    struct Heard(tokio::sync::mpsc::UnboundedSender<Event>);

    impl Subscriber for Heard {
        fn message(&self, payload: &[u8]) {
            let _ = self.0.send(Event::Message(payload.to_vec()));
        }

        fn missed(&self) {
            let _ = self.0.send(Event::Missed);
        }
    }

    fn heard() -> (Arc<Heard>, tokio::sync::mpsc::UnboundedReceiver<Event>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (Arc::new(Heard(tx)), rx)
    }

    async fn next(events: &mut tokio::sync::mpsc::UnboundedReceiver<Event>) -> Event {
        tokio::time::timeout(Duration::from_secs(20), events.recv())
            .await
            .expect("an event within 20 s")
            .expect("the subscriber lives")
    }

    async fn publish(redis: &Redis, channel: &str, message: &str) {
        let _: i64 = redis
            .query(redis::cmd("PUBLISH").arg(channel).arg(message))
            .await
            .expect("PUBLISH");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_channel_registered_while_the_connection_is_live_joins_it() {
        each_server("pubsub_late_channel", async |redis: Redis| {
            let (first, mut first_events) = heard();
            let a = redis.subscribe("test:first".to_owned(), Arc::downgrade(&first) as Weak<_>);
            assert!(redis.subscribed(Duration::from_secs(20)).await, "live");
            assert_eq!(a.live(), Some(1), "in the first SUBSCRIBE");

            let (second, mut second_events) = heard();
            let b = redis.subscribe("test:second".to_owned(), Arc::downgrade(&second) as Weak<_>);
            // Confirmed on the live connection: told that it may have missed messages.
            assert_eq!(next(&mut second_events).await, Event::Missed);
            assert_eq!(b.live(), Some(1), "the same subscription");
            assert_eq!(redis.stats().subscriptions, 1, "no new connection");

            publish(&redis, "test:second", "to-second").await;
            assert_eq!(
                next(&mut second_events).await,
                Event::Message(b"to-second".to_vec())
            );
            // Let go: still subscribed on the server, no longer delivered.
            drop(b);
            publish(&redis, "test:second", "nobody").await;
            publish(&redis, "test:first", "to-first").await;
            assert_eq!(
                next(&mut first_events).await,
                Event::Message(b"to-first".to_vec())
            );
            // On a cluster the two may come from two nodes, in either order: wait until both
            // were received.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            while redis.stats().notices < 3 {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{:?}",
                    redis.stats()
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(second_events.try_recv().is_err(), "not delivered");

            // Registered again while still subscribed: heard all along, on the same
            // subscription, with nothing missed.
            let (third, mut third_events) = heard();
            let c = redis.subscribe("test:second".to_owned(), Arc::downgrade(&third) as Weak<_>);
            while c.live().is_none() {
                assert!(tokio::time::Instant::now() < deadline, "heard again");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(c.live(), Some(1));
            publish(&redis, "test:second", "again").await;
            assert_eq!(
                next(&mut third_events).await,
                Event::Message(b"again".to_vec())
            );
            assert_eq!(redis.stats().subscriptions, 1, "no new connection");
        })
        .await;
    }

    #[test]
    fn the_registry_holds_subscribers_weakly_and_drops_a_channel_with_its_last_registration() {
        let hub = Hub::default();
        let (one, _) = heard();
        let (two, _) = heard();
        let (a, heard_a, fresh_a) = hub.register("c".to_owned(), Arc::downgrade(&one) as Weak<_>);
        let (b, heard_b, fresh_b) = hub.register("c".to_owned(), Arc::downgrade(&two) as Weak<_>);
        assert!(
            fresh_a && !fresh_b,
            "the second registration joins the channel"
        );
        assert!(
            Arc::ptr_eq(&heard_a, &heard_b),
            "one channel, one heard state"
        );
        hub.heard("c", 7);
        assert_eq!(heard_b.load(Ordering::Acquire), 7);
        drop(one);
        assert_eq!(
            hub.subscribers_of("c").len(),
            1,
            "a dropped subscriber is not called"
        );
        hub.unregister("c", a);
        assert_eq!(hub.names(), ["c"]);
        hub.unregister("c", b);
        assert!(hub.names().is_empty());
    }
}
