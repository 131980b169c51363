//! Real `redis-server` processes for tests: a single node (alone or with a
//! replica), a 3-node cluster, or a 6-node cluster of 3 primaries with a
//! replica each, on free loopback ports, never the shared server on 6379.
//! Every process is killed when its value is dropped.
//!
//! Under `CI=true` a server that cannot start fails the test; elsewhere the
//! test prints one line saying it was skipped and why.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Whether Redis tests must run (CI) rather than skip.
pub fn required() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Skips (returns `None` after one line on stderr) or, under CI, panics.
pub fn unavailable<T>(test: &str, why: &str) -> Option<T> {
    if required() {
        panic!("{test}: Redis is required under CI=true but {why}");
    }
    eprintln!("skipped {test}: {why}");
    None
}

pub fn server_binary() -> Option<String> {
    let bin = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".to_owned());
    Command::new(&bin)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .ok()
        .filter(|s| s.success())
        .map(|_| bin)
}

fn free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A free port; for a cluster node also its bus port (+10000), so at most 55535.
pub fn free_port(cluster: bool) -> u16 {
    if !cluster {
        return TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
    }
    let seed = std::process::id().wrapping_mul(7919);
    for _ in 0..10_000 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = 20_000 + ((seed.wrapping_add(n.wrapping_mul(13))) % 35_000) as u16;
        if port <= 55_535 && free(port) && free(port + 10_000) {
            return port;
        }
    }
    panic!("no free port pair for a cluster node");
}

/// One `redis-server` process.
pub struct RedisNode {
    pub port: u16,
    bin: String,
    dir: PathBuf,
    cluster: bool,
    /// Append-only file with fsync on every write: a restart keeps the data.
    durable: bool,
    /// `cluster-node-timeout` in ms (cluster nodes only).
    node_timeout_ms: u32,
    child: Option<Child>,
}

/// The `cluster-node-timeout` of a cluster node unless a test asks for another.
const NODE_TIMEOUT_MS: u32 = 2000;

impl RedisNode {
    /// Starts a single node, or skips (see the module docs).
    pub fn start(test: &str) -> Option<Self> {
        let Some(bin) = server_binary() else {
            return unavailable(test, "redis-server was not found on PATH");
        };
        match Self::spawn(bin, false) {
            Ok(node) => Some(node),
            Err(e) => unavailable(test, &e),
        }
    }

    /// Starts a single node that keeps its data across [`RedisNode::restart`]
    /// (append-only file, fsync on every write), or skips.
    #[allow(dead_code, reason = "not every test binary restarts a durable node")]
    pub fn start_durable(test: &str) -> Option<Self> {
        let Some(bin) = server_binary() else {
            return unavailable(test, "redis-server was not found on PATH");
        };
        let port = free_port(false);
        let dir =
            std::env::temp_dir().join(format!("throttlebeam-redis-{}-{port}", std::process::id()));
        if let Err(e) = std::fs::create_dir_all(&dir) {
            return unavailable(test, &format!("cannot create {dir:?}: {e}"));
        }
        let mut node = Self {
            port,
            bin,
            dir,
            cluster: false,
            durable: true,
            node_timeout_ms: NODE_TIMEOUT_MS,
            child: None,
        };
        match node.launch() {
            Ok(()) => Some(node),
            Err(e) => unavailable(test, &e),
        }
    }

    fn spawn(bin: String, cluster: bool) -> Result<Self, String> {
        Self::spawn_with(bin, cluster, NODE_TIMEOUT_MS)
    }

    fn spawn_with(bin: String, cluster: bool, node_timeout_ms: u32) -> Result<Self, String> {
        let port = free_port(cluster);
        let dir =
            std::env::temp_dir().join(format!("throttlebeam-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {dir:?}: {e}"))?;
        let mut node = Self {
            port,
            bin,
            dir,
            cluster,
            durable: false,
            node_timeout_ms,
            child: None,
        };
        node.launch()?;
        Ok(node)
    }

    fn launch(&mut self) -> Result<(), String> {
        let mut cmd = Command::new(&self.bin);
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--protected-mode", "no"])
            .arg("--dir")
            .arg(&self.dir);
        if self.durable {
            cmd.args(["--appendonly", "yes", "--appendfsync", "always"]);
        } else {
            cmd.args(["--appendonly", "no"]);
        }
        if self.cluster {
            let _ = std::fs::remove_file(self.dir.join("nodes.conf"));
            cmd.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ])
            .args(["--cluster-node-timeout", &self.node_timeout_ms.to_string()]);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("redis-server did not start: {e}"))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok()
                && cli(self.port, &["PING"]).as_deref() == Some("PONG")
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(format!(
            "redis-server on port {} did not answer PING within 10 s",
            self.port
        ))
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL) and waits for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port (a single node comes back
    /// empty unless durable; a cluster node rejoins with its saved
    /// configuration).
    pub fn restart(&mut self) {
        self.kill();
        let keep_conf = self.cluster;
        if keep_conf {
            // Keep nodes.conf so the node rejoins with its slots.
            let mut cmd = Command::new(&self.bin);
            cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
                .arg("--dir")
                .arg(&self.dir)
                .args([
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                ])
                .args(["--cluster-node-timeout", &self.node_timeout_ms.to_string()]);
            self.child = Some(
                cmd.stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("redis-server restarts"),
            );
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && cli(self.port, &["PING"]).as_deref() != Some("PONG")
            {
                std::thread::sleep(Duration::from_millis(20));
            }
        } else {
            self.launch().expect("redis-server restarts");
        }
    }

    /// Makes the next [`RedisNode::restart_loading`] of this durable node
    /// slow: writes `keys` filler keys of 2 KB and rewrites the append-only
    /// file, so they load from its snapshot part (where `key-load-delay`
    /// applies).
    #[allow(dead_code, reason = "not every test binary restarts a node slowly")]
    pub fn fill_for_slow_loading(&self, keys: u32) {
        let script =
            format!("for i=1,{keys} do redis.call('SET','filler:'..i,string.rep('x',2000)) end");
        assert!(self.cli(&["EVAL", &script, "0"]).is_some(), "filled");
        assert!(self.cli(&["BGREWRITEAOF"]).is_some(), "rewrite started");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let info = self.cli(&["INFO", "persistence"]).unwrap_or_default();
            if info.contains("aof_rewrite_in_progress:0")
                && info.contains("aof_rewrite_scheduled:0")
            {
                return;
            }
            assert!(Instant::now() < deadline, "the rewrite did not end: {info}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server and starts it again loading every key slowly
    /// (`key-load-delay` µs each) and answering clients between keys;
    /// returns once it answers `LOADING`, so clients meet a server that is up
    /// but cannot serve yet.
    #[allow(dead_code, reason = "not every test binary restarts a node slowly")]
    pub fn restart_loading(&mut self, key_load_delay_us: u32) {
        assert!(self.durable, "only a durable node has data to load");
        self.kill();
        let child = Command::new(&self.bin)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--protected-mode", "no"])
            .args(["--appendonly", "yes", "--appendfsync", "always"])
            .args(["--key-load-delay", &key_load_delay_us.to_string()])
            // Clients are answered every 1 KB loaded (once per filler key), not every 2 MB.
            .args(["--loading-process-events-interval-bytes", "1024"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server restarts");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let answer = cli(self.port, &["PING"]).unwrap_or_default();
            if answer.starts_with("LOADING") {
                return;
            }
            assert!(
                answer != "PONG" && Instant::now() < deadline,
                "the server did not answer LOADING (last answer: {answer:?})"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Runs a script that never ends on its own (from `redis-cli`, in the
    /// background), with `busy-reply-threshold` at 100 ms; returns once other
    /// clients get `BUSY`. [`RedisNode::end_busy_script`] kills it.
    #[allow(dead_code, reason = "not every test binary keeps a node busy")]
    pub fn start_busy_script(&self) -> std::process::Child {
        assert_eq!(
            self.cli(&["CONFIG", "SET", "busy-reply-threshold", "100"])
                .as_deref(),
            Some("OK")
        );
        let mut child = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["EVAL", "while true do end", "0"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-cli runs");
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut answer = String::new();
        while Instant::now() < deadline {
            answer = self.cli(&["GET", "busy-probe"]).unwrap_or_default();
            if answer.starts_with("BUSY") {
                return child;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("the server never answered BUSY (last answer: {answer:?})");
    }

    /// Ends the script of [`RedisNode::start_busy_script`] (`SCRIPT KILL`).
    #[allow(dead_code, reason = "not every test binary keeps a node busy")]
    pub fn end_busy_script(&self, mut script: std::process::Child) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.cli(&["SCRIPT", "KILL"]).as_deref() != Some("OK") {
            assert!(Instant::now() < deadline, "SCRIPT KILL never took");
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = script.wait();
    }

    /// Stops the server process (SIGSTOP) without closing its sockets: every
    /// command sent to it hangs until [`RedisNode::thaw`].
    #[allow(dead_code, reason = "not every test binary freezes a node")]
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Lets a frozen server run again (SIGCONT).
    #[allow(dead_code, reason = "not every test binary freezes a node")]
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("the server is running");
        let sent = Command::new("kill")
            .arg(signal)
            .arg(child.id().to_string())
            .status()
            .is_ok_and(|s| s.success());
        assert!(sent, "kill {signal} {} failed", child.id());
    }

    /// Runs a command through `redis-cli` and returns its trimmed output.
    pub fn cli(&self, args: &[&str]) -> Option<String> {
        cli(self.port, args)
    }
}

impl Drop for RedisNode {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn cli(port: u16, args: &[&str]) -> Option<String> {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// A 3-node Redis Cluster (no replicas).
pub struct RedisCluster {
    pub nodes: Vec<RedisNode>,
}

impl RedisCluster {
    /// Starts and joins three nodes, or skips (see the module docs).
    pub fn start(test: &str) -> Option<Self> {
        let Some(bin) = server_binary() else {
            return unavailable(test, "redis-server was not found on PATH");
        };
        let mut nodes = Vec::new();
        for _ in 0..3 {
            match RedisNode::spawn(bin.clone(), true) {
                Ok(node) => nodes.push(node),
                Err(e) => return unavailable(test, &e),
            }
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let created = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !created.is_ok_and(|s| s.success()) {
            return unavailable(test, "redis-cli --cluster create failed");
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            let ok = nodes.iter().all(|n| {
                n.cli(&["CLUSTER", "INFO"])
                    .is_some_and(|info| info.contains("cluster_state:ok"))
            });
            if ok {
                return Some(Self { nodes });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        unavailable(
            test,
            "the cluster did not reach cluster_state:ok within 15 s",
        )
    }

    /// Seed URLs of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisNode::url).collect()
    }

    /// Waits until every node reports `cluster_state:ok` again.
    pub fn wait_ok(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if self.nodes.iter().all(|n| {
                n.cli(&["CLUSTER", "INFO"])
                    .is_some_and(|info| info.contains("cluster_state:ok"))
            }) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }
}

impl RedisNode {
    /// Starts a single node on `port` (which must be free), or skips: for
    /// a test that points something at a port before a server listens there.
    #[allow(dead_code, reason = "only tests of connecting late use it")]
    pub fn start_on(test: &str, port: u16) -> Option<Self> {
        let Some(bin) = server_binary() else {
            return unavailable(test, "redis-server was not found on PATH");
        };
        let dir =
            std::env::temp_dir().join(format!("throttlebeam-redis-{}-{port}", std::process::id()));
        if let Err(e) = std::fs::create_dir_all(&dir) {
            return unavailable(test, &format!("cannot create {dir:?}: {e}"));
        }
        let mut node = Self {
            port,
            bin,
            dir,
            cluster: false,
            durable: false,
            node_timeout_ms: NODE_TIMEOUT_MS,
            child: None,
        };
        match node.launch() {
            Ok(()) => Some(node),
            Err(e) => unavailable(test, &e),
        }
    }
}

impl RedisNode {
    /// Starts a single node that replicates `primary` (`REPLICAOF`), once its link is up and
    /// it holds the primary's data, or skips.
    #[allow(dead_code, reason = "only the replication tests use it")]
    pub fn start_replica_of(test: &str, primary: &RedisNode) -> Option<Self> {
        let node = Self::start(test)?;
        let port = primary.port.to_string();
        if node.cli(&["REPLICAOF", "127.0.0.1", &port]).as_deref() != Some("OK") {
            return unavailable(test, "REPLICAOF was refused");
        }
        if !primary.wait_replicas_in_sync(1, Duration::from_secs(20)) {
            return unavailable(test, "the replica did not sync within 20 s");
        }
        Some(node)
    }

    /// `INFO replication` as `field:value` lines.
    #[allow(dead_code, reason = "only the replication tests use it")]
    pub fn replication(&self) -> Vec<(String, String)> {
        self.cli(&["INFO", "replication"])
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().split_once(':'))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    /// Whether this node is a primary (`role:master`).
    #[allow(dead_code, reason = "only the replication tests use it")]
    pub fn is_primary(&self) -> bool {
        self.replication()
            .iter()
            .any(|(k, v)| k == "role" && v == "master")
    }

    /// The port of the primary this node replicates, if it is a replica.
    #[allow(dead_code, reason = "only the replication tests use it")]
    pub fn primary_port(&self) -> Option<u16> {
        let info = self.replication();
        let replica = info.iter().any(|(k, v)| k == "role" && v == "slave");
        let port = info.iter().find(|(k, _)| k == "master_port")?;
        replica.then(|| port.1.parse().ok()).flatten()
    }

    /// Waits until this primary has at least `replicas` replicas online that acknowledged
    /// its whole replication stream (at rest).
    #[allow(dead_code, reason = "only the replication tests use it")]
    pub fn wait_replicas_in_sync(&self, replicas: usize, within: Duration) -> bool {
        self.wait_replicas(replicas, within, true)
    }

    /// Waits until this primary has at least `replicas` replicas online that acknowledged
    /// its stream within the last second (under writes, acknowledgements trail by design).
    #[allow(dead_code, reason = "only the replication tests use it")]
    pub fn wait_replicas_online(&self, replicas: usize, within: Duration) -> bool {
        self.wait_replicas(replicas, within, false)
    }

    fn wait_replicas(&self, replicas: usize, within: Duration, at_rest: bool) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            let info = self.replication();
            let offset = info
                .iter()
                .find(|(k, _)| k == "master_repl_offset")
                .and_then(|(_, v)| v.parse::<u64>().ok());
            let synced = info
                .iter()
                .filter(|(k, _)| k.starts_with("slave") && k[5..].parse::<u32>().is_ok())
                .filter(|(_, v)| {
                    let field = |name: &str| {
                        v.split(',')
                            .find_map(|f| f.strip_prefix(name))
                            .and_then(|o| o.parse::<u64>().ok())
                    };
                    v.contains("state=online")
                        && (field("offset=") == offset
                            || !at_rest && field("lag=").is_some_and(|l| l <= 1))
                })
                .count();
            if synced >= replicas {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// The process id of the server, while it runs.
    #[allow(dead_code, reason = "only the replication tests use it")]
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

/// A 6-node Redis Cluster: 3 primaries, each with one replica, for failover tests.
#[allow(dead_code, reason = "only the failover tests use it")]
pub struct ReplicatedCluster {
    /// Every node; which are primaries changes with failovers (see
    /// [`ReplicatedCluster::primaries`]).
    pub nodes: Vec<RedisNode>,
}

#[allow(dead_code, reason = "only the failover tests use it")]
impl ReplicatedCluster {
    /// Starts six nodes with `cluster-node-timeout` `node_timeout_ms`, joins them as three
    /// primaries with one replica each, and waits until the cluster is ok and every replica
    /// is in sync; or skips (see the module docs).
    pub fn start(test: &str, node_timeout_ms: u32) -> Option<Self> {
        let Some(bin) = server_binary() else {
            return unavailable(test, "redis-server was not found on PATH");
        };
        let mut nodes = Vec::new();
        for _ in 0..6 {
            match RedisNode::spawn_with(bin.clone(), true, node_timeout_ms) {
                Ok(node) => nodes.push(node),
                Err(e) => return unavailable(test, &e),
            }
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let created = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !created.is_ok_and(|s| s.success()) {
            return unavailable(test, "redis-cli --cluster create failed");
        }
        let cluster = Self { nodes };
        if !cluster.wait_ok(Duration::from_secs(30)) {
            return unavailable(
                test,
                "the cluster did not reach cluster_state:ok within 30 s",
            );
        }
        if !cluster.wait_in_sync(Duration::from_secs(30)) {
            return unavailable(test, "the replicas were not in sync within 30 s");
        }
        Some(cluster)
    }

    /// Seed URLs of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisNode::url).collect()
    }

    /// Indices of the nodes that are primaries now (a killed node is none).
    pub fn primaries(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].child.is_some() && self.nodes[i].is_primary())
            .collect()
    }

    /// The index of the node replicating the primary at `primary`, if any.
    pub fn replica_of(&self, primary: usize) -> Option<usize> {
        let port = self.nodes[primary].port;
        (0..self.nodes.len()).find(|&i| {
            i != primary
                && self.nodes[i].child.is_some()
                && self.nodes[i].primary_port() == Some(port)
        })
    }

    /// The index of the primary that serves `slot` now, as the node at `asked` sees it.
    pub fn primary_of_slot(&self, asked: usize, slot: u16) -> Option<usize> {
        let nodes = self.nodes[asked].cli(&["CLUSTER", "NODES"])?;
        nodes.lines().find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 9 || !fields[2].contains("master") || fields[2].contains("fail") {
                return None;
            }
            let port: u16 = fields[1].split([':', '@']).nth(1)?.parse().ok()?;
            let serves = fields[8..].iter().any(|range| match range.split_once('-') {
                Some((a, b)) => {
                    a.parse::<u16>().is_ok_and(|a| a <= slot)
                        && b.parse::<u16>().is_ok_and(|b| slot <= b)
                }
                None => range.parse::<u16>().is_ok_and(|s| s == slot),
            });
            serves
                .then(|| self.nodes.iter().position(|n| n.port == port))
                .flatten()
        })
    }

    /// Waits until every running node reports `cluster_state:ok`.
    pub fn wait_ok(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                n.cli(&["CLUSTER", "INFO"])
                    .is_some_and(|info| info.contains("cluster_state:ok"))
            }) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// Waits until every primary has a replica online that acknowledged its whole stream
    /// (at rest).
    pub fn wait_in_sync(&self, within: Duration) -> bool {
        self.wait_replicas(within, true)
    }

    /// Waits until every primary has a replica online that acknowledged its stream within the
    /// last second (under writes).
    pub fn wait_replicating(&self, within: Duration) -> bool {
        self.wait_replicas(within, false)
    }

    fn wait_replicas(&self, within: Duration, at_rest: bool) -> bool {
        let deadline = Instant::now() + within;
        loop {
            let primaries = self.primaries();
            let left = deadline.saturating_duration_since(Instant::now());
            if primaries.len() == 3
                && primaries
                    .iter()
                    .all(|&p| self.nodes[p].wait_replicas(1, left, at_rest))
            {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
