//! Real servers on free loopback ports, and the faults done to them: `redis-server` nodes
//! (durable, with AOF and fsync on every write), a replicated cluster, a primary behind
//! Sentinels, and a schema and role of their own on the machine's PostgreSQL.
//!
//! Every process started here is killed when its value is dropped. Under `CI=true` a server
//! that cannot start is a failure (the harness never skips a kind silently).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A free loopback port; for a cluster node also its bus port (+10000), so at most 55535.
pub(crate) fn free_port(cluster: bool) -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
    if !cluster {
        return TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
    }
    let seed = std::process::id().wrapping_mul(7919);
    for _ in 0..10_000 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = 20_000 + (seed.wrapping_add(n.wrapping_mul(13)) % 35_000) as u16;
        if port <= 55_535 && free(port) && free(port + 10_000) {
            return port;
        }
    }
    panic!("no free port pair for a cluster node");
}

/// A temporary directory, removed on drop.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    pub(crate) fn new(what: &str) -> std::io::Result<Self> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "throttlebeam-faults-{what}-{}-{n}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::env::var_os("THROTTLEBEAM_FAULTS_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Sends `signal` (`-STOP`, `-CONT`, `-KILL`) to `pid` with `kill(1)` (the crate forbids
/// unsafe code, so no libc).
pub(crate) fn signal(pid: u32, signal: &str) -> bool {
    Command::new("kill")
        .arg(signal)
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `redis-cli` on `port` with `args`, given at most `within`; its trimmed output, or `None`
/// when it failed or took too long.
pub(crate) fn cli(port: u16, args: &[&str], within: Duration) -> Option<String> {
    let mut child = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let deadline = Instant::now() + within;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let out = child.wait_with_output().ok()?;
                return status
                    .success()
                    .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned());
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// One `redis-server` process (data node or Sentinel), restartable on its port.
pub(crate) struct RedisServer {
    pub(crate) port: u16,
    args: Vec<String>,
    child: Option<Child>,
}

impl RedisServer {
    /// A data node on `port` keeping its data in `dir`: `appendonly yes`, `appendfsync
    /// always` when `durable`; `extra` arguments after.
    pub(crate) fn node(
        port: u16,
        dir: &Path,
        durable: bool,
        extra: &[&str],
    ) -> Result<Self, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {dir:?}: {e}"))?;
        let mut args: Vec<String> = [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--protected-mode",
            "no",
            "--dir",
            &dir.to_string_lossy(),
        ]
        .map(str::to_owned)
        .to_vec();
        if durable {
            args.extend(["--appendonly", "yes", "--appendfsync", "always"].map(str::to_owned));
        } else {
            args.extend(["--appendonly", "no"].map(str::to_owned));
        }
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let mut server = Self {
            port,
            args,
            child: None,
        };
        server.launch()?;
        Ok(server)
    }

    /// A Sentinel with the configuration file `conf`.
    pub(crate) fn sentinel(port: u16, conf: &Path) -> Result<Self, String> {
        let mut server = Self {
            port,
            args: vec![conf.to_string_lossy().into_owned(), "--sentinel".to_owned()],
            child: None,
        };
        server.launch()?;
        Ok(server)
    }

    fn launch(&mut self) -> Result<(), String> {
        let child = Command::new("redis-server")
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("redis-server did not start: {e}"))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if self.cli(&["PING"]).as_deref() == Some("PONG") {
                return Ok(());
            }
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                return Err(format!(
                    "redis-server on port {} exited: {status}",
                    self.port
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(format!(
            "redis-server on port {} did not answer PING within 15 s",
            self.port
        ))
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub(crate) fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// `redis-cli` against this server, at most 5 s.
    pub(crate) fn cli(&self, args: &[&str]) -> Option<String> {
        cli(self.port, args, Duration::from_secs(5))
    }

    /// SIGKILL, and wait for the process.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on its port with its data (AOF, `nodes.conf`).
    pub(crate) fn restart(&mut self) -> Result<(), String> {
        self.kill();
        self.launch()
    }

    /// SIGSTOP: every command hangs, no socket closes.
    pub(crate) fn pause(&self) -> bool {
        self.pid().is_some_and(|p| signal(p, "-STOP"))
    }

    /// SIGCONT.
    pub(crate) fn resume(&self) -> bool {
        self.pid().is_some_and(|p| signal(p, "-CONT"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(pid) = self.pid() {
            signal(pid, "-CONT");
        }
        self.kill();
    }
}

/// A durable single node.
pub(crate) struct RedisNode {
    pub(crate) server: RedisServer,
    _dir: TempDir,
}

impl RedisNode {
    pub(crate) fn start(extra: &[&str]) -> Result<Self, String> {
        let dir = TempDir::new("redis").map_err(|e| e.to_string())?;
        let port = free_port(false);
        let server = RedisServer::node(port, &dir.0, true, extra)?;
        Ok(Self { server, _dir: dir })
    }

    pub(crate) fn port(&self) -> u16 {
        self.server.port
    }
}

/// A Redis Cluster of 3 primaries with one replica each.
pub(crate) struct Cluster {
    pub(crate) nodes: Vec<RedisServer>,
    _dir: TempDir,
}

impl Cluster {
    pub(crate) fn start() -> Result<Self, String> {
        let dir = TempDir::new("cluster").map_err(|e| e.to_string())?;
        let mut nodes = Vec::new();
        for i in 0..6 {
            let port = free_port(true);
            let data = dir.0.join(format!("n{i}"));
            nodes.push(RedisServer::node(
                port,
                &data,
                true,
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ],
            )?);
        }
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !created.is_ok_and(|s| s.success()) {
            return Err("redis-cli --cluster create failed".to_owned());
        }
        let cluster = Self { nodes, _dir: dir };
        if !cluster.wait_ok(Duration::from_secs(30)) {
            return Err("the cluster did not reach cluster_state:ok within 30 s".to_owned());
        }
        // Every replica linked, so a failover has someone to promote.
        let deadline = Instant::now() + Duration::from_secs(30);
        while cluster.replicas_linked() < 3 {
            if Instant::now() > deadline {
                return Err("the cluster's replicas did not link within 30 s".to_owned());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(cluster)
    }

    pub(crate) fn wait_ok(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            if self.nodes.iter().filter(|n| n.is_running()).all(|n| {
                n.cli(&["CLUSTER", "INFO"])
                    .is_some_and(|i| i.contains("cluster_state:ok"))
            }) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn role(&self, i: usize) -> Option<String> {
        let info = self.nodes[i].cli(&["INFO", "replication"])?;
        info.lines()
            .find_map(|l| l.trim().strip_prefix("role:").map(str::to_owned))
    }

    fn replicas_linked(&self) -> usize {
        (0..self.nodes.len())
            .filter(|&i| {
                self.nodes[i]
                    .cli(&["INFO", "replication"])
                    .is_some_and(|r| {
                        r.contains("role:slave") && r.contains("master_link_status:up")
                    })
            })
            .count()
    }

    /// Indices of the running replicas whose link to their primary is up.
    pub(crate) fn linked_replicas(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| {
                self.nodes[i].is_running()
                    && self.nodes[i]
                        .cli(&["INFO", "replication"])
                        .is_some_and(|r| {
                            r.contains("role:slave") && r.contains("master_link_status:up")
                        })
            })
            .collect()
    }

    /// Indices of the running primaries.
    pub(crate) fn primaries(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].is_running() && self.role(i).as_deref() == Some("master"))
            .collect()
    }
}

/// The master name the Sentinels watch.
pub(crate) const MASTER: &str = "mymaster";

/// A durable primary, a replica, and three Sentinels (down after 1 s, quorum 2).
pub(crate) struct SentinelSetup {
    pub(crate) data: Vec<RedisServer>,
    pub(crate) sentinels: Vec<RedisServer>,
    _dir: TempDir,
}

impl SentinelSetup {
    pub(crate) fn start() -> Result<Self, String> {
        let dir = TempDir::new("sentinel").map_err(|e| e.to_string())?;
        let p = free_port(false);
        let primary = RedisServer::node(p, &dir.0.join("primary"), true, &[])?;
        let r = free_port(false);
        let rp = p.to_string();
        let replica = RedisServer::node(
            r,
            &dir.0.join("replica"),
            true,
            &["--replicaof", "127.0.0.1", &rp],
        )?;
        let mut sentinels = Vec::new();
        for i in 0..3 {
            let port = free_port(false);
            let sdir = dir.0.join(format!("sentinel{i}"));
            std::fs::create_dir_all(&sdir).map_err(|e| e.to_string())?;
            let conf = sdir.join("sentinel.conf");
            let text = format!(
                "port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {dir}\n\
                 sentinel monitor {MASTER} 127.0.0.1 {p} 2\n\
                 sentinel down-after-milliseconds {MASTER} 1000\n\
                 sentinel failover-timeout {MASTER} 5000\n\
                 sentinel parallel-syncs {MASTER} 1\n",
                dir = sdir.display()
            );
            std::fs::write(&conf, text).map_err(|e| e.to_string())?;
            sentinels.push(RedisServer::sentinel(port, &conf)?);
        }
        let setup = Self {
            data: vec![primary, replica],
            sentinels,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let synced = setup.data[1]
                .cli(&["INFO", "replication"])
                .is_some_and(|i| i.contains("master_link_status:up"));
            let known = setup.sentinels.iter().all(|s| {
                s.cli(&["SENTINEL", "MASTER", MASTER]).is_some_and(|m| {
                    let lines: Vec<&str> = m.lines().map(str::trim).collect();
                    let field = |name: &str| {
                        lines
                            .iter()
                            .position(|l| *l == name)
                            .and_then(|i| lines.get(i + 1))
                            .copied()
                    };
                    field("num-slaves") == Some("1") && field("num-other-sentinels") == Some("2")
                })
            });
            if synced && known {
                return Ok(setup);
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the Sentinel setup was not ready within 30 s (replica in sync: {synced}, \
                     Sentinels know each other: {known})"
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub(crate) fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        format!("redis+sentinel://{}/{MASTER}", hosts.join(","))
    }

    /// The data node the Sentinels name as primary now.
    pub(crate) fn primary(&self) -> Option<usize> {
        let reply = self.sentinels[0].cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER])?;
        let port: u16 = reply.lines().nth(1)?.trim().parse().ok()?;
        self.data.iter().position(|d| d.port == port)
    }

    /// Waits until the Sentinels name a running primary whose replica is linked.
    pub(crate) fn wait_settled(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(p) = self.primary() {
                let other = 1 - p;
                let primary_ok = self.data[p].is_running()
                    && self.data[p]
                        .cli(&["INFO", "replication"])
                        .is_some_and(|i| i.contains("role:master"));
                let replica_ok = !self.data[other].is_running()
                    || self.data[other]
                        .cli(&["INFO", "replication"])
                        .is_some_and(|i| i.contains("master_link_status:up"));
                if primary_ok && replica_ok {
                    return true;
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }
}

/// Where the machine's PostgreSQL is.
pub(crate) fn postgres_url() -> String {
    std::env::var("THROTTLEBEAM_TEST_POSTGRES_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}
