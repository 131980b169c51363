//! A TCP fault proxy on loopback: forwards every connection made to it to
//! an upstream port, and on demand delays the server's replies or stops
//! forwarding (a blackhole: both sockets stay open, no FIN, no RST, the bytes
//! wait as a partition's would in TCP's retransmissions), for every
//! connection or for one. It runs on a thread and runtime of its own, so a
//! test on paused tokio time does not pause it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One connection through the proxy.
struct Link {
    /// The local port of the proxy's connection to the server: what the
    /// server sees as the client's (`CLIENT LIST`'s `addr`).
    upstream_port: u16,
    blackholed: AtomicBool,
    /// Closes both sockets (FIN) when notified.
    cut: tokio::sync::Notify,
}

#[derive(Default)]
struct Shared {
    /// Reply delays, used in turn, one per chunk the server sends.
    delays: Mutex<Vec<Duration>>,
    next_delay: AtomicUsize,
    /// New connections start blackholed.
    all_blackholed: AtomicBool,
    links: Mutex<Vec<Arc<Link>>>,
}

impl Shared {
    fn reply_delay(&self) -> Duration {
        let delays = self.delays.lock().unwrap();
        if delays.is_empty() {
            return Duration::ZERO;
        }
        delays[self.next_delay.fetch_add(1, Ordering::Relaxed) % delays.len()]
    }
}

/// A running proxy; dropping it closes every connection.
pub struct FaultProxy {
    pub port: u16,
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FaultProxy {
    /// A proxy on a free loopback port to `127.0.0.1:upstream`.
    pub fn start(upstream: u16) -> Self {
        let shared = Arc::new(Shared::default());
        let (port_tx, port_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let state = Arc::clone(&shared);
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("the proxy's runtime");
            runtime.block_on(async move {
                let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
                port_tx
                    .send(listener.local_addr().expect("bound").port())
                    .expect("told");
                let accepting = async {
                    loop {
                        let Ok((client, _)) = listener.accept().await else {
                            continue;
                        };
                        let state = Arc::clone(&state);
                        tokio::spawn(async move {
                            let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await
                            else {
                                return;
                            };
                            let _ = client.set_nodelay(true);
                            let _ = server.set_nodelay(true);
                            let link = Arc::new(Link {
                                upstream_port: server.local_addr().map_or(0, |a| a.port()),
                                blackholed: AtomicBool::new(
                                    state.all_blackholed.load(Ordering::SeqCst),
                                ),
                                cut: tokio::sync::Notify::new(),
                            });
                            state.links.lock().unwrap().push(Arc::clone(&link));
                            pump(client, server, link, state).await;
                        });
                    }
                };
                tokio::select! {
                    () = accepting => {}
                    _ = stopped => {}
                }
            });
        });
        let port = port_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the proxy listens");
        Self {
            port,
            shared,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Delays every chunk the server sends by `delay` (requests go at once).
    pub fn delay_replies(&self, delay: Duration) {
        self.delay_replies_in_turn(&[delay]);
    }

    /// Delays the server's chunks by each of `delays` in turn.
    pub fn delay_replies_in_turn(&self, delays: &[Duration]) {
        *self.shared.delays.lock().unwrap() = delays.to_vec();
    }

    /// Stops forwarding on every connection, and on new ones.
    pub fn blackhole(&self) {
        self.shared.all_blackholed.store(true, Ordering::SeqCst);
        for link in self.shared.links.lock().unwrap().iter() {
            link.blackholed.store(true, Ordering::SeqCst);
        }
    }

    /// Stops forwarding on the connection the server sees coming from
    /// `upstream_port`; whether there is one.
    pub fn blackhole_upstream_port(&self, upstream_port: u16) -> bool {
        let links = self.shared.links.lock().unwrap();
        let link = links.iter().find(|l| l.upstream_port == upstream_port);
        if let Some(link) = link {
            link.blackholed.store(true, Ordering::SeqCst);
        }
        link.is_some()
    }

    /// Closes every connection made so far (both sockets, FIN): the server
    /// went away.
    pub fn cut_all(&self) {
        for link in self.shared.links.lock().unwrap().drain(..) {
            link.cut.notify_one();
        }
    }

    /// Forwards again, everything that waited first.
    pub fn heal(&self) {
        self.shared.all_blackholed.store(false, Ordering::SeqCst);
        for link in self.shared.links.lock().unwrap().iter() {
            link.blackholed.store(false, Ordering::SeqCst);
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Waits while `link` is blackholed.
async fn open(link: &Link) {
    while link.blackholed.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn link_cut(link: &Link) {
    link.cut.notified().await;
}

/// Forwards both ways until either side closes, or the link is cut.
async fn pump(client: TcpStream, server: TcpStream, link: Arc<Link>, state: Arc<Shared>) {
    let link_for_cut = Arc::clone(&link);
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    let requests = {
        let link = Arc::clone(&link);
        async move {
            let mut buf = vec![0_u8; 64 * 1024];
            loop {
                let n = match client_rx.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                open(&link).await;
                if server_tx.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    };
    // Replies: read as they come, each written once its delay is over.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let reading = async move {
        let mut buf = vec![0_u8; 64 * 1024];
        loop {
            let n = match server_rx.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let due = tokio::time::Instant::now() + state.reply_delay();
            if tx.send((due, buf[..n].to_vec())).is_err() {
                return;
            }
        }
    };
    let writing = async move {
        while let Some((due, bytes)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            open(&link).await;
            if client_tx.write_all(&bytes).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        () = requests => {}
        () = async { tokio::join!(reading, writing); } => {}
        () = link_cut(&link_for_cut) => {}
    }
}
