//! A TCP fault proxy on loopback, in front of one server.
//!
//! Modes:
//! - pass: bytes flow;
//! - partition: nothing flows either way and no socket is closed (no FIN, no RST): bytes read
//!   are held and delivered when the partition heals, as a network that drops packets until
//!   TCP retransmits them would; new connections are accepted and held the same way;
//! - latency: every chunk is delivered `base ± jitter` after it was read, in order;
//! - silent subscribers: connections that sent `SUBSCRIBE`, `SSUBSCRIBE` or `PSUBSCRIBE` get
//!   nothing from the server (the other connections flow);
//! - reset: every open connection is closed with RST (`SO_LINGER` 0), both sides, at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// What the proxy does to the bytes now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Pass,
    Partition,
    Latency { base_ms: u64, jitter_ms: u64 },
    SilenceSubscribers,
}

struct Shared {
    mode: watch::Sender<Mode>,
    /// Bumped by [`Proxy::reset`]: every connection opened before it is reset.
    resets: watch::Sender<u64>,
    seed: AtomicU64,
    /// Connections seen subscribing so far.
    subscribers: AtomicU64,
}

/// A running proxy; stops accepting (and drops its connections) when dropped.
pub(crate) struct Proxy {
    pub(crate) port: u16,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `127.0.0.1:target`.
    pub(crate) async fn start(target: u16) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            mode: watch::Sender::new(Mode::Pass),
            resets: watch::Sender::new(0),
            seed: AtomicU64::new(u64::from(target) * 0x9e37_79b9),
            subscribers: AtomicU64::new(0),
        });
        let accept = {
            let shared = Arc::clone(&shared);
            tokio::spawn(async move {
                while let Ok((inbound, _)) = listener.accept().await {
                    let shared = Arc::clone(&shared);
                    tokio::spawn(connection(inbound, target, shared));
                }
            })
        };
        Ok(Self {
            port,
            shared,
            accept,
        })
    }

    pub(crate) fn set(&self, mode: Mode) {
        self.shared.mode.send_replace(mode);
    }

    /// Connections seen subscribing so far.
    pub(crate) fn subscribers(&self) -> u64 {
        self.shared.subscribers.load(Ordering::Relaxed)
    }

    /// Resets every open connection (RST both ways).
    pub(crate) fn reset(&self) {
        self.shared.resets.send_modify(|n| *n += 1);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        // Ends every connection (dropping them resets: their linger is set to zero then).
        self.reset();
    }
}

fn rst(stream: &TcpStream) {
    let _ = stream.set_zero_linger();
}

async fn connection(inbound: TcpStream, target: u16, shared: Arc<Shared>) {
    let mut resets = shared.resets.subscribe();
    let opened_at = *resets.borrow_and_update();
    let mut mode = shared.mode.subscribe();
    // Every close from here on is a reset unless a peer closed first (then its FIN is passed
    // on by `shutdown`, which sends a FIN whatever the linger).
    rst(&inbound);
    // A partitioned network: the connection is accepted (the kernel did that) but reaches no
    // server until the partition heals.
    while *mode.borrow_and_update() == Mode::Partition {
        tokio::select! {
            changed = mode.changed() => if changed.is_err() { return },
            _ = resets.changed() => return,
        }
    }
    let Ok(outbound) = TcpStream::connect(("127.0.0.1", target)).await else {
        return;
    };
    rst(&outbound);
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let subscriber = Arc::new(AtomicBool::new(false));
    // Not `into_split`: its write half sends a FIN when dropped, and a reset must not.
    let (inbound, outbound) = (Arc::new(inbound), Arc::new(outbound));
    let (in_read, in_write) = (Arc::clone(&inbound), Arc::clone(&inbound));
    let (out_read, out_write) = (Arc::clone(&outbound), Arc::clone(&outbound));
    let seed = shared.seed.fetch_add(2, Ordering::Relaxed);
    let up = pump(
        in_read,
        out_write,
        shared.mode.subscribe(),
        Arc::clone(&subscriber),
        Direction::Up,
        seed,
    );
    let counted = {
        let shared = Arc::clone(&shared);
        let subscriber = Arc::clone(&subscriber);
        async move {
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                if subscriber.load(Ordering::Relaxed) {
                    shared.subscribers.fetch_add(1, Ordering::Relaxed);
                    std::future::pending::<()>().await;
                }
            }
        }
    };
    let down = pump(
        out_read,
        in_write,
        shared.mode.subscribe(),
        subscriber,
        Direction::Down,
        seed + 1,
    );
    let both = async {
        tokio::pin!(up, down, counted);
        // Both directions until both closed; a broken one (a peer reset) ends both.
        tokio::select! {
            ok = &mut up => if ok { down.await; },
            ok = &mut down => if ok { up.await; },
            () = &mut counted => {}
        }
    };
    tokio::select! {
        () = both => {}
        () = async {
            loop {
                if resets.changed().await.is_err() || *resets.borrow_and_update() != opened_at {
                    return;
                }
            }
        } => {}
    }
    // Dropping the halves closes both sockets; with zero linger, that is a reset.
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// Client to server.
    Up,
    /// Server to client.
    Down,
}

/// Forwards one direction; `true` if it ended with a clean close (passed on), `false` if a
/// side broke.
async fn pump(
    from: Arc<TcpStream>,
    to: Arc<TcpStream>,
    mode: watch::Receiver<Mode>,
    subscriber: Arc<AtomicBool>,
    dir: Direction,
    seed: u64,
) -> bool {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Option<Vec<u8>>)>();
    let reader = {
        let mode = mode.clone();
        let subscriber = Arc::clone(&subscriber);
        async move {
            let mut buf = vec![0u8; 16 * 1024];
            let mut rng = crate::rng::Rng::new(seed);
            loop {
                let read = read(&from, &mut buf).await;
                let chunk = match read {
                    Ok(0) => None,
                    Ok(n) => Some(buf[..n].to_vec()),
                    Err(_) => return false,
                };
                if let Some(chunk) = &chunk
                    && dir == Direction::Up
                    && !subscriber.load(Ordering::Relaxed)
                    && is_subscribe(chunk)
                {
                    subscriber.store(true, Ordering::Relaxed);
                }
                let delay = match *mode.borrow() {
                    Mode::Latency { base_ms, jitter_ms } => {
                        Duration::from_millis(base_ms + rng.range(0, jitter_ms))
                    }
                    _ => Duration::ZERO,
                };
                let closed = chunk.is_none();
                if tx.send((Instant::now() + delay, chunk)).is_err() || closed {
                    return true;
                }
            }
        }
    };
    let writer = async move {
        let mut mode = mode;
        let mut last = Instant::now();
        while let Some((at, chunk)) = rx.recv().await {
            // In order: never before the chunk ahead of it.
            last = last.max(at);
            tokio::time::sleep_until(last).await;
            loop {
                let held = match *mode.borrow_and_update() {
                    Mode::Partition => true,
                    Mode::SilenceSubscribers => {
                        dir == Direction::Down && subscriber.load(Ordering::Relaxed)
                    }
                    _ => false,
                };
                if !held {
                    break;
                }
                if mode.changed().await.is_err() {
                    return false;
                }
            }
            match chunk {
                Some(chunk) => {
                    if write_all(&to, &chunk).await.is_err() {
                        return false;
                    }
                }
                None => {
                    // The peer closed its side: close ours towards the other end (a FIN only
                    // because a peer sent one: the proxy never invents a close).
                    let _ = socket2::SockRef::from(&*to).shutdown(std::net::Shutdown::Write);
                    return true;
                }
            }
        }
        false
    };
    tokio::pin!(reader, writer);
    tokio::select! {
        read_ok = &mut reader => read_ok && writer.await,
        write_ok = &mut writer => write_ok,
    }
}

async fn read(stream: &TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        stream.readable().await?;
        match stream.try_read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            other => return other,
        }
    }
}

async fn write_all(stream: &TcpStream, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        stream.writable().await?;
        match stream.try_write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Whether a client's chunk sends a `SUBSCRIBE`, `SSUBSCRIBE` or `PSUBSCRIBE` command (RESP:
/// the command's name is the first bulk string of an array), not merely mentions the word.
fn is_subscribe(chunk: &[u8]) -> bool {
    const NAMES: [&[u8]; 3] = [
        b"$9\r\nsubscribe\r\n",
        b"$10\r\nssubscribe\r\n",
        b"$10\r\npsubscribe\r\n",
    ];
    NAMES.iter().any(|name| {
        chunk.windows(name.len()).enumerate().any(|(i, w)| {
            w.eq_ignore_ascii_case(name) && {
                // Preceded by the array header `*<n>\r\n`.
                let before = &chunk[..i];
                before.ends_with(b"\r\n")
                    && before[..before.len() - 2]
                        .iter()
                        .rev()
                        .take_while(|b| b.is_ascii_digit())
                        .count()
                        > 0
                    && {
                        let digits = before[..before.len() - 2]
                            .iter()
                            .rev()
                            .take_while(|b| b.is_ascii_digit())
                            .count();
                        before.len() >= digits + 3 && before[before.len() - 3 - digits] == b'*'
                    }
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn echo() -> u16 {
        let l = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut b = [0u8; 1024];
                    while let Ok(n) = s.read(&mut b).await {
                        if n == 0 || s.write_all(&b[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        port
    }

    async fn roundtrip(s: &mut TcpStream, msg: &[u8], within: Duration) -> Option<Vec<u8>> {
        s.write_all(msg).await.ok()?;
        let mut b = vec![0u8; msg.len()];
        tokio::time::timeout(within, s.read_exact(&mut b))
            .await
            .ok()?
            .ok()?;
        Some(b)
    }

    #[tokio::test]
    async fn partitions_hold_bytes_and_resets_close_with_rst() {
        let proxy = Proxy::start(echo().await).await.unwrap();
        let mut s = TcpStream::connect(("127.0.0.1", proxy.port)).await.unwrap();
        assert_eq!(
            roundtrip(&mut s, b"ping", Duration::from_secs(2))
                .await
                .as_deref(),
            Some(&b"ping"[..])
        );
        proxy.set(Mode::Partition);
        assert_eq!(
            roundtrip(&mut s, b"held", Duration::from_millis(300)).await,
            None
        );
        proxy.set(Mode::Pass);
        let mut b = [0u8; 4];
        tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&b, b"held");
        proxy.set(Mode::Latency {
            base_ms: 200,
            jitter_ms: 0,
        });
        let t = Instant::now();
        roundtrip(&mut s, b"slow", Duration::from_secs(3))
            .await
            .unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(390),
            "{:?}",
            t.elapsed()
        );
        proxy.set(Mode::Pass);
        proxy.reset();
        let mut b = [0u8; 4];
        let read = tokio::time::timeout(Duration::from_secs(2), s.read(&mut b))
            .await
            .unwrap();
        assert!(
            matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
            "{read:?}"
        );
    }

    #[tokio::test]
    async fn silent_subscribers_hear_nothing_while_others_flow() {
        let proxy = Proxy::start(echo().await).await.unwrap();
        let mut sub = TcpStream::connect(("127.0.0.1", proxy.port)).await.unwrap();
        let mut other = TcpStream::connect(("127.0.0.1", proxy.port)).await.unwrap();
        let cmd = b"*2\r\n$9\r\nSUBSCRIBE\r\n$2\r\nch\r\n";
        roundtrip(&mut sub, cmd, Duration::from_secs(2))
            .await
            .unwrap();
        // A command that only mentions the word is not a subscription.
        let eval = b"*3\r\n$4\r\nEVAL\r\n$23\r\n-- wake the subscribers\r\n$1\r\n0\r\n";
        roundtrip(&mut other, eval, Duration::from_secs(2))
            .await
            .unwrap();
        proxy.set(Mode::SilenceSubscribers);
        assert_eq!(
            roundtrip(&mut sub, b"x", Duration::from_millis(300)).await,
            None
        );
        assert!(
            roundtrip(&mut other, b"y", Duration::from_secs(2))
                .await
                .is_some()
        );
    }
}
