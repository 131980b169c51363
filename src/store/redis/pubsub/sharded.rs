//! The sharded listener (cluster only): every registered shard channel is
//! subscribed to on the node that owns its slot.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::{Hub, Inner, PING_EVERY, PONG_WITHIN, Redis, SUBSCRIBE_TIMEOUT, claim_listener};

/// How often the sharded listener subscribes again to the channels not
/// confirmed (a dead node, a slot moved) and drops the ones nobody holds.
const RESYNC: Duration = Duration::from_millis(500);

impl Redis {
    /// Starts the sharded listener (cluster only) on the caller's tokio
    /// runtime, unless one is alive.
    pub(super) fn listen_sharded(&self) {
        let hub = &self.inner.pubsub.sharded;
        if !self.is_cluster() || !claim_listener(hub) {
            return;
        }
        let guard = ShardedListening {
            inner: Arc::downgrade(&self.inner),
            hub: Arc::clone(hub),
        };
        tokio::spawn(listen_sharded(guard));
    }
}

/// The sharded listener task's hold on the backend; dropped on every exit
/// path, it marks the listener gone so the next subscriber starts one, and
/// tells every subscriber it may have missed messages.
struct ShardedListening {
    inner: Weak<Inner>,
    hub: Arc<Hub>,
}

impl Drop for ShardedListening {
    fn drop(&mut self) {
        self.hub.unheard_all();
        self.hub.listening.store(false, Ordering::Release);
        if self.inner.strong_count() > 0 {
            self.hub.missed_all();
        }
    }
}

/// The sharded subscription loop. One RESP3 cluster connection carries
/// every shard channel; redis-rs routes each `SSUBSCRIBE` to the owner of
/// the channel's slot and resubscribes after a reconnect or a new slot map.
/// This loop adds what it cannot know: a channel the server dropped
/// (`sunsubscribe` after a slot moved) or one lost with a dead node is
/// subscribed to again every [`RESYNC`] until confirmed, and every
/// confirmation tells the channel's subscribers they may have missed
/// messages, since one sent while the channel was not subscribed is lost.
/// Subscribers poll meanwhile, as they always do.
async fn listen_sharded(guard: ShardedListening) {
    let hub = Arc::clone(&guard.hub);
    let mut pause = Duration::from_millis(100);
    loop {
        let Some((conn, pushes)) = connect(&guard, &mut pause).await else {
            return;
        };
        if serve(&guard, conn, pushes).await.is_break() {
            return;
        }
        // A silent connection, replaced: nothing on it is heard any more.
        hub.unheard_all();
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

type Pushes = tokio::sync::mpsc::UnboundedReceiver<redis::PushInfo>;

/// A new sharded connection, trying again with a growing pause; `None` once
/// the backend is gone.
async fn connect(
    guard: &ShardedListening,
    pause: &mut Duration,
) -> Option<(redis::cluster_async::ClusterConnection, Pushes)> {
    loop {
        let client = guard.inner.upgrade()?.link.sharded()?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let config = redis::cluster::ClusterConfig::new().set_push_sender(tx);
        match tokio::time::timeout(
            SUBSCRIBE_TIMEOUT,
            client.get_async_connection_with_config(config),
        )
        .await
        {
            Ok(Ok(conn)) => {
                *pause = Duration::from_millis(100);
                return Some((conn, rx));
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "sharded pub/sub connection failed; polling meanwhile");
            }
            Err(_) => {
                tracing::debug!(timeout = ?SUBSCRIBE_TIMEOUT, "sharded pub/sub connection timed out; polling meanwhile");
            }
        }
        tokio::time::sleep(*pause).await;
        *pause = (*pause * 2).min(Duration::from_secs(5));
    }
}

/// Serves one sharded connection until the backend is gone (`Break`) or the
/// connection is silent (`Continue`): every [`PING_EVERY`] each primary is
/// sent a `PING`, and one that does not answer within [`PONG_WITHIN`] (a
/// partition without FIN or RST) makes the whole connection replaced, its
/// channels subscribed again on the new one.
async fn serve(
    guard: &ShardedListening,
    mut conn: redis::cluster_async::ClusterConnection,
    mut pushes: Pushes,
) -> std::ops::ControlFlow<()> {
    use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
    let hub = &guard.hub;
    // Every channel asked for, and the confirmed ones.
    let mut asked: HashSet<String> = HashSet::new();
    let mut confirmed: HashSet<String> = HashSet::new();
    let mut resync = tokio::time::interval(RESYNC);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + PING_EVERY, PING_EVERY);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let mut tick = false;
        tokio::select! {
            push = pushes.recv() => {
                let Some(push) = push else { return std::ops::ControlFlow::Break(()) };
                if guard.inner.strong_count() == 0 {
                    return std::ops::ControlFlow::Break(());
                }
                on_push(hub, push, &mut confirmed);
                continue;
            }
            () = hub.changed.notified() => {}
            _ = resync.tick() => tick = true,
            _ = ping.tick() => {
                let routing = RoutingInfo::MultiNode((
                    MultipleNodeRoutingInfo::AllMasters,
                    Some(ResponsePolicy::AllSucceeded),
                ));
                let pinged = conn.route_command(redis::cmd("PING"), routing);
                match tokio::time::timeout(PONG_WITHIN, pinged).await {
                    Ok(Ok(_)) => continue,
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "sharded pub/sub PING failed; reconnecting");
                    }
                    Err(_) => {
                        tracing::warn!(
                            within = ?PONG_WITHIN,
                            "a node of the sharded pub/sub connection did not answer PING: \
                             taken for dead, reconnecting"
                        );
                    }
                }
                return std::ops::ControlFlow::Continue(());
            }
        }
        // The backend dropped ends this task.
        if guard.inner.strong_count() == 0 {
            return std::ops::ControlFlow::Break(());
        }
        let mut subscribe = Vec::new();
        let mut wanted = HashSet::new();
        for channel in hub.names() {
            if confirmed.contains(&channel) {
                // Let go and registered again: heard all along.
                hub.heard_if_unheard(&channel, hub.subscriptions.load(Ordering::Relaxed));
            }
            let fresh = !asked.contains(&channel);
            if fresh || (tick && !confirmed.contains(&channel)) {
                subscribe.push(channel.clone());
            }
            if fresh {
                asked.insert(channel.clone());
            }
            wanted.insert(channel);
        }
        // Dropped only on a tick: a subscriber that lets go and registers
        // again at once (a waiter looking again) should not cost a round
        // trip.
        let unsubscribe: Vec<String> = if tick {
            asked.difference(&wanted).cloned().collect()
        } else {
            Vec::new()
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
                // Asked again on the next tick; subscribers poll meanwhile.
                tracing::debug!(%channel, error = %e, "sharded subscribe failed; polling meanwhile");
            }
        }
    }
}

/// One push of the sharded connection: a confirmation, a message, a
/// dropped channel or a lost node.
fn on_push(hub: &Hub, push: redis::PushInfo, confirmed: &mut HashSet<String>) {
    match push.kind {
        redis::PushKind::SSubscribe => {
            if let Some(channel) = text(push.data.first()) {
                let number = hub.subscriptions.fetch_add(1, Ordering::Relaxed) + 1;
                hub.heard(&channel, number);
                confirmed.insert(channel.clone());
                // Messages before the subscription were not heard.
                hub.missed(&channel);
            }
        }
        redis::PushKind::SMessage => {
            hub.notices.fetch_add(1, Ordering::Relaxed);
            if let (Some(channel), Some(payload)) =
                (text(push.data.first()), bytes(push.data.get(1)))
            {
                hub.deliver(&channel, payload);
            }
        }
        redis::PushKind::SUnsubscribe => {
            // Ours, or the server's after the slot moved: the next tick
            // subscribes again if someone still holds the channel.
            if let Some(channel) = text(push.data.first()) {
                hub.heard(&channel, 0);
                confirmed.remove(&channel);
            }
        }
        redis::PushKind::Disconnection => {
            // Which node's channels were lost is not said: ask for all again.
            hub.unheard_all();
            confirmed.clear();
        }
        _ => {}
    }
}

fn bytes(v: Option<&redis::Value>) -> Option<&[u8]> {
    match v {
        Some(redis::Value::BulkString(b)) => Some(b),
        Some(redis::Value::SimpleString(s)) => Some(s.as_bytes()),
        _ => None,
    }
}

fn text(v: Option<&redis::Value>) -> Option<String> {
    bytes(v).map(|b| String::from_utf8_lossy(b).into_owned())
}
