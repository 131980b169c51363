//! Wake-ups for waiting duplicates: one `LISTEN` connection per store,
//! multiplexed over every key someone on this instance waits for, with
//! polling as the fallback while it is down.
//!
//! Completions and releases `NOTIFY` the table's channel with the SHA-256
//! of the key (hex): a fixed size whatever the key, within the 8,000 bytes
//! a payload may hold. The listener is a task on the tokio runtime of the
//! first watcher, on a connection of its own (outside the pool). It
//! reconnects by itself; if its task ends (its runtime ended), its guard
//! marks it gone and wakes every waiter, and the next watcher starts it
//! again on its own runtime. It stops when the store is dropped.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::Poll;
use std::time::Duration;

use dashmap::DashMap;
use sha2::{Digest, Sha256};
use tokio::sync::Notify;
use tokio_postgres::AsyncMessage;

use super::Inner;
use crate::idempotency::KeyChanged;

/// How long connecting and subscribing may take before the listener tries
/// again.
const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Keys someone on this instance waits for, by the digest a notice names.
#[derive(Default)]
pub(super) struct Waiters {
    keys: DashMap<String, Arc<Notify>>,
    /// A listener task is alive (or starting); its guard clears this when
    /// the task ends, however it ends.
    listening: AtomicBool,
    /// Whether the `LISTEN` is in force.
    subscribed: AtomicBool,
    subscriptions: AtomicU64,
    notices: AtomicU64,
}

impl Waiters {
    fn wake(&self, digest: &str) {
        if let Some(notify) = self.keys.get(digest) {
            notify.notify_waiters();
        }
    }

    /// Wakes every waiter: notices may have been missed while nobody
    /// listened, so each looks at its key again.
    fn wake_all(&self) {
        for entry in &self.keys {
            entry.value().notify_waiters();
        }
    }

    /// Subscriptions made and notices received so far.
    pub(super) fn counts(&self) -> (u64, u64) {
        (
            self.subscriptions.load(Ordering::Relaxed),
            self.notices.load(Ordering::Relaxed),
        )
    }

    /// Whether the `LISTEN` is in force now.
    pub(super) fn is_subscribed(&self) -> bool {
        self.subscribed.load(Ordering::Acquire)
    }
}

/// What a notice names for `key`: its SHA-256, in hex, as the server's
/// `encode(sha256(key), 'hex')` writes it.
fn digest(key: &str) -> String {
    let hash = Sha256::digest(key.as_bytes());
    let mut hex = String::with_capacity(64);
    for byte in hash {
        hex.push(char::from(b"0123456789abcdef"[usize::from(byte >> 4)]));
        hex.push(char::from(b"0123456789abcdef"[usize::from(byte & 15)]));
    }
    hex
}

/// A registration for one key; dropping it forgets the key once nobody
/// else waits for it.
struct Watch {
    inner: Arc<Inner>,
    digest: String,
    notify: Arc<Notify>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        // Two references: this watch's and the map's.
        self.inner.waiters.keys.remove_if(&self.digest, |_, n| {
            Arc::ptr_eq(n, &self.notify) && Arc::strong_count(n) <= 2
        });
    }
}

/// A wake-up for the next change of `key`, listening from now on (before
/// it is first polled), so a notice that lands before the wait begins
/// still wakes it.
pub(super) fn watch(inner: &Arc<Inner>, key: &str) -> KeyChanged {
    subscribe(inner);
    let digest = digest(key);
    let notify = Arc::clone(
        inner
            .waiters
            .keys
            .entry(digest.clone())
            .or_insert_with(|| Arc::new(Notify::new()))
            .value(),
    );
    let mut notified = Box::pin(Arc::clone(&notify).notified_owned());
    notified.as_mut().enable();
    let registered = Watch {
        inner: Arc::clone(inner),
        digest,
        notify,
    };
    KeyChanged::new(async move {
        let _registered = registered;
        notified.await;
    })
}

/// Starts the store's listener on the caller's tokio runtime, unless one is
/// alive.
pub(super) fn subscribe(inner: &Arc<Inner>) {
    let waiters = &inner.waiters;
    if waiters.listening.load(Ordering::Acquire) {
        return;
    }
    // Outside tokio nothing can listen yet: leave it to the next caller.
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    if waiters.listening.swap(true, Ordering::AcqRel) {
        return;
    }
    // Made before the spawn: a task dropped unpolled hands back too.
    let guard = Listening(Arc::downgrade(inner));
    let mut stopped = inner.stop.subscribe();
    runtime.spawn(async move {
        tokio::select! {
            () = listen(&guard) => {}
            _ = stopped.changed() => {}
        }
        drop(guard);
    });
}

/// The listener task's hold on the store. Dropped on every exit path (the
/// store dropped, the task's runtime ended, a panic), it marks the listener
/// gone, so the next watcher starts one, and wakes every waiter.
struct Listening(Weak<Inner>);

impl Drop for Listening {
    fn drop(&mut self) {
        if let Some(inner) = self.0.upgrade() {
            let waiters = &inner.waiters;
            waiters.subscribed.store(false, Ordering::Release);
            waiters.listening.store(false, Ordering::Release);
            waiters.wake_all();
            tracing::debug!("postgres change listener ended; the next watcher restarts it");
        }
    }
}

/// Connects, listens and hands notices out until the connection is lost,
/// then again after a pause, while the store lives.
async fn listen(guard: &Listening) {
    let mut pause = Duration::from_millis(100);
    loop {
        let (config, channel) = {
            let Some(inner) = guard.0.upgrade() else {
                return;
            };
            (
                (
                    inner.connections.config.clone(),
                    inner.connections.tls.clone(),
                ),
                inner.sql.channel.clone(),
            )
        };
        let (config, tls) = config;
        let connected = tokio::time::timeout(SUBSCRIBE_TIMEOUT, config.connect(tls)).await;
        match connected {
            Ok(Ok((client, connection))) => {
                match serve(guard, &client, connection, &channel).await {
                    Ok(true) => pause = Duration::from_millis(100),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::debug!(%channel, error = %e, "postgres change listener lost its connection; polling meanwhile");
                    }
                }
            }
            Ok(Err(e)) => {
                tracing::debug!(%channel, error = %e, "postgres change listener cannot connect; polling meanwhile");
            }
            Err(_) => {
                tracing::debug!(%channel, timeout = ?SUBSCRIBE_TIMEOUT, "postgres change listener timed out connecting; polling meanwhile");
            }
        }
        let Some(inner) = guard.0.upgrade() else {
            return;
        };
        inner.waiters.subscribed.store(false, Ordering::Release);
        drop(inner);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

/// Sends `LISTEN` and delivers notices until the connection ends. Whether
/// the `LISTEN` took effect.
async fn serve(
    guard: &Listening,
    client: &tokio_postgres::Client,
    mut connection: tokio_postgres::Connection<
        tokio_postgres::Socket,
        <super::tls::Tls as tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket>>::Stream,
    >,
    channel: &str,
) -> Result<bool, tokio_postgres::Error> {
    let statement = format!("LISTEN \"{channel}\"");
    let mut listen = std::pin::pin!(client.batch_execute(&statement));
    let mut listening = false;
    std::future::poll_fn(|cx| {
        if !listening {
            match listen.as_mut().poll(cx) {
                Poll::Ready(Ok(())) => {
                    listening = true;
                    let Some(inner) = guard.0.upgrade() else {
                        return Poll::Ready(Ok(true));
                    };
                    let waiters = &inner.waiters;
                    let again = waiters.subscriptions.fetch_add(1, Ordering::Relaxed) > 0;
                    waiters.subscribed.store(true, Ordering::Release);
                    tracing::debug!(%channel, "listening for postgres idempotency changes");
                    if again {
                        // Notices sent while nobody listened are lost: every
                        // waiter looks again.
                        waiters.wake_all();
                    }
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {}
            }
        }
        loop {
            match connection.poll_message(cx) {
                Poll::Ready(Some(Ok(AsyncMessage::Notification(notice)))) => {
                    let Some(inner) = guard.0.upgrade() else {
                        return Poll::Ready(Ok(listening));
                    };
                    inner.waiters.notices.fetch_add(1, Ordering::Relaxed);
                    inner.waiters.wake(notice.payload());
                }
                Poll::Ready(Some(Ok(_))) => {}
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e)),
                Poll::Ready(None) => return Poll::Ready(Ok(listening)),
                Poll::Pending => return Poll::Pending,
            }
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_digest_is_the_servers_hex_sha256() {
        // What `SELECT encode(sha256('abc'::bytea), 'hex')` answers.
        assert_eq!(
            super::digest("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
