//! Redis set up as a managed service would be: a node that speaks only TLS
//! (with a CA, a server and a client certificate made at test time), and a
//! primary with a replica behind three Sentinels. Every process runs on a
//! free loopback port and is killed (SIGKILL) when its value is dropped.
//!
//! Under `CI=true` a setup that cannot start fails the test; elsewhere the
//! test prints one line saying it was skipped and why (see [`super::redis`]).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::redis::{free_port, server_binary, unavailable};

/// A temporary directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(what: &str) -> std::io::Result<Self> {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "throttlebeam-{what}-{}-{n}-{}",
            std::process::id(),
            free_port(false)
        ));
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One `redis-server` process (a data node or a Sentinel).
pub struct Server {
    pub port: u16,
    child: Option<Child>,
    /// `redis-cli` arguments to reach it (TLS files), before `-p`.
    cli: Vec<String>,
}

impl Server {
    /// Starts `redis-server` with `args` and waits until it answers `PING`
    /// (through `redis-cli` with `cli` arguments), at most 10 s.
    fn spawn(port: u16, args: &[String], cli: Vec<String>) -> Result<Self, String> {
        let bin = server_binary().ok_or("redis-server was not found on PATH")?;
        let child = Command::new(bin)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("redis-server did not start: {e}"))?;
        let mut server = Self {
            port,
            child: Some(child),
            cli,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if server.cli(&["PING"]).as_deref() == Some("PONG") {
                return Ok(server);
            }
            if let Some(child) = server.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(format!("redis-server on port {port} exited: {status}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(format!(
            "redis-server on port {port} did not answer PING within 10 s"
        ))
    }

    /// Runs a command through `redis-cli`; its trimmed output.
    pub fn cli(&self, args: &[&str]) -> Option<String> {
        let out = Command::new("redis-cli")
            .args(&self.cli)
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Kills the process (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

fn plain(port: u16, dir: &Path) -> Vec<String> {
    [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--protected-mode",
        "no",
        "--dir",
        &dir.to_string_lossy(),
    ]
    .map(str::to_owned)
    .to_vec()
}

/// A CA, a server certificate for `127.0.0.1` and `localhost` and a client
/// certificate it signed, and a second CA that signed neither, as PEM.
pub struct Certs {
    pub ca: String,
    pub server_cert: String,
    pub server_key: String,
    pub client_cert: String,
    pub client_key: String,
    /// A CA that signed nothing here: trusting only it, no server is trusted.
    pub other_ca: String,
}

impl Certs {
    /// Made now with rcgen (ECDSA P-256).
    pub fn make() -> Self {
        use rcgen::{
            BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose,
            IsCa, KeyPair, KeyUsagePurpose,
        };
        let ca = |name: &str| {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.distinguished_name.push(DnType::CommonName, name);
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
            CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
        };
        let authority = ca("throttlebeam test CA");
        let other = ca("throttlebeam unrelated CA");
        let leaf = |names: Vec<String>, usages: Vec<ExtendedKeyUsagePurpose>| {
            let mut params = CertificateParams::new(names).unwrap();
            params
                .distinguished_name
                .push(DnType::CommonName, "throttlebeam test");
            params.extended_key_usages = usages;
            params.use_authority_key_identifier_extension = true;
            let key = KeyPair::generate().unwrap();
            let cert = params.signed_by(&key, &authority).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        // Servers are clients of each other too (replication, the cluster
        // bus, Sentinels): their certificate serves both ways.
        let (server_cert, server_key) = leaf(
            vec!["127.0.0.1".to_owned(), "localhost".to_owned()],
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        );
        let (client_cert, client_key) = leaf(
            vec!["client".to_owned()],
            vec![ExtendedKeyUsagePurpose::ClientAuth],
        );
        Self {
            ca: authority.pem(),
            server_cert,
            server_key,
            client_cert,
            client_key,
            other_ca: other.pem(),
        }
    }

    /// Writes every file into `dir`: `ca.crt`, `server.crt`, `server.key`,
    /// `client.crt`, `client.key`.
    fn write(&self, dir: &Path) -> std::io::Result<()> {
        for (name, pem) in [
            ("ca.crt", &self.ca),
            ("server.crt", &self.server_cert),
            ("server.key", &self.server_key),
            ("client.crt", &self.client_cert),
            ("client.key", &self.client_key),
        ] {
            std::fs::write(dir.join(name), pem)?;
        }
        Ok(())
    }
}

/// `redis-server` arguments to speak only TLS on `port` (with `--port 0`),
/// with the files [`Certs::write`] wrote to `dir`, replication and the
/// cluster bus over TLS too.
fn tls_args(port: u16, dir: &Path, clients_need_certs: bool) -> Vec<String> {
    let file = |name: &str| dir.join(name).to_string_lossy().into_owned();
    [
        "--tls-port",
        &port.to_string(),
        "--tls-cert-file",
        &file("server.crt"),
        "--tls-key-file",
        &file("server.key"),
        "--tls-ca-cert-file",
        &file("ca.crt"),
        "--tls-auth-clients",
        if clients_need_certs { "yes" } else { "no" },
        "--tls-replication",
        "yes",
        "--tls-cluster",
        "yes",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// `redis-cli` arguments to reach a TLS node with the client certificate.
fn tls_cli(dir: &Path) -> Vec<String> {
    let file = |name: &str| dir.join(name).to_string_lossy().into_owned();
    [
        "--tls",
        "--cacert",
        &file("ca.crt"),
        "--cert",
        &file("client.crt"),
        "--key",
        &file("client.key"),
    ]
    .map(str::to_owned)
    .to_vec()
}

/// A node that speaks only TLS (`--port 0 --tls-port P`).
pub struct TlsNode {
    pub server: Server,
    pub certs: Certs,
    pub dir: TempDir,
}

impl TlsNode {
    /// Starts a TLS-only node; with `clients_need_certs`, it refuses clients
    /// without a certificate its CA signed (`--tls-auth-clients yes`).
    pub fn start(test: &str, clients_need_certs: bool) -> Option<Self> {
        match Self::spawn(clients_need_certs) {
            Ok(node) => Some(node),
            Err(e) => unavailable(test, &e),
        }
    }

    fn spawn(clients_need_certs: bool) -> Result<Self, String> {
        let dir = TempDir::new("tls").map_err(|e| format!("no temp dir: {e}"))?;
        let certs = Certs::make();
        certs
            .write(&dir.0)
            .map_err(|e| format!("cannot write the certificates: {e}"))?;
        let port = free_port(false);
        let mut args = plain(0, &dir.0);
        args.extend(tls_args(port, &dir.0, clients_need_certs));
        let server = Server::spawn(port, &args, tls_cli(&dir.0))
            .map_err(|e| format!("{e} (is redis-server built with TLS?)"))?;
        Ok(Self { server, certs, dir })
    }

    /// `rediss://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.server.port)
    }

    /// The path of one of the files [`Certs::write`] wrote.
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.0.join(name)
    }
}

/// A 3-node Redis Cluster that speaks only TLS (clients, cluster bus),
/// clients presenting a certificate.
pub struct TlsCluster {
    pub nodes: Vec<Server>,
    pub certs: Certs,
    pub dir: TempDir,
}

impl TlsCluster {
    /// Starts and joins three TLS nodes, or skips.
    pub fn start(test: &str) -> Option<Self> {
        match Self::spawn() {
            Ok(cluster) => Some(cluster),
            Err(e) => unavailable(test, &e),
        }
    }

    fn spawn() -> Result<Self, String> {
        let dir = TempDir::new("tls-cluster").map_err(|e| format!("no temp dir: {e}"))?;
        let certs = Certs::make();
        certs
            .write(&dir.0)
            .map_err(|e| format!("cannot write the certificates: {e}"))?;
        let mut nodes = Vec::new();
        for i in 0..3 {
            let port = free_port(true);
            let data = dir.0.join(format!("node{i}"));
            std::fs::create_dir_all(&data).map_err(|e| format!("cannot create {data:?}: {e}"))?;
            let mut args = plain(0, &data);
            args.extend(tls_args(port, &dir.0, true));
            args.extend(
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ]
                .map(str::to_owned),
            );
            nodes.push(Server::spawn(port, &args, tls_cli(&dir.0))?);
        }
        let created = Command::new("redis-cli")
            .args(tls_cli(&dir.0))
            .args(["--cluster", "create"])
            .args(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)))
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !created.is_ok_and(|s| s.success()) {
            return Err("redis-cli --tls --cluster create failed".to_owned());
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if nodes.iter().all(|n| {
                n.cli(&["CLUSTER", "INFO"])
                    .is_some_and(|info| info.contains("cluster_state:ok"))
            }) {
                return Ok(Self { nodes, certs, dir });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err("the TLS cluster did not reach cluster_state:ok within 20 s".to_owned())
    }

    /// `rediss+cluster://127.0.0.1:<p1>,127.0.0.1:<p2>,127.0.0.1:<p3>`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("rediss+cluster://{}", hosts.join(","))
    }
}

/// A plain node, for ACL users made with `ACL SETUSER`.
pub fn plain_node(test: &str) -> Option<(Server, TempDir)> {
    let dir = match TempDir::new("acl") {
        Ok(dir) => dir,
        Err(e) => return unavailable(test, &format!("no temp dir: {e}")),
    };
    let port = free_port(false);
    match Server::spawn(port, &plain(port, &dir.0), Vec::new()) {
        Ok(server) => Some((server, dir)),
        Err(e) => unavailable(test, &e),
    }
}

/// The master name the Sentinels monitor.
pub const MASTER: &str = "mymaster";

/// How long the Sentinels wait before they call the primary down.
pub const DOWN_AFTER: Duration = Duration::from_millis(1000);

/// A primary, one replica, and three Sentinels watching them
/// (`down-after-milliseconds` [`DOWN_AFTER`], quorum 2).
pub struct SentinelSetup {
    pub primary: Server,
    pub replica: Server,
    pub sentinels: Vec<Server>,
    /// The certificates, when every process speaks only TLS.
    pub certs: Option<Certs>,
    /// The data nodes' password (`requirepass`), when they need one.
    pub password: Option<String>,
    pub dir: TempDir,
}

impl SentinelSetup {
    /// Starts every process and waits until the replica is in sync and
    /// every Sentinel knows the replica and the two other Sentinels.
    pub fn start(test: &str) -> Option<Self> {
        match Self::spawn(false, None) {
            Ok(setup) => Some(setup),
            Err(e) => unavailable(test, &e),
        }
    }

    /// [`SentinelSetup::start`] with every process speaking only TLS
    /// (Sentinels included), clients presenting a certificate.
    pub fn start_tls(test: &str) -> Option<Self> {
        match Self::spawn(true, None) {
            Ok(setup) => Some(setup),
            Err(e) => unavailable(test, &e),
        }
    }

    /// [`SentinelSetup::start`] with data nodes that need `password`
    /// (`requirepass`; the replica and the Sentinels are told it).
    pub fn start_with_password(test: &str, password: &str) -> Option<Self> {
        match Self::spawn(false, Some(password)) {
            Ok(setup) => Some(setup),
            Err(e) => unavailable(test, &e),
        }
    }

    fn spawn(tls: bool, password: Option<&str>) -> Result<Self, String> {
        let dir = TempDir::new("sentinel").map_err(|e| format!("no temp dir: {e}"))?;
        let certs = tls.then(Certs::make);
        if let Some(certs) = &certs {
            certs
                .write(&dir.0)
                .map_err(|e| format!("cannot write the certificates: {e}"))?;
        }
        let data = |name: &str| -> Result<PathBuf, String> {
            let d = dir.0.join(name);
            std::fs::create_dir_all(&d).map_err(|e| format!("cannot create {d:?}: {e}"))?;
            Ok(d)
        };
        let node_args = |port: u16, data: &Path| {
            let mut args = if tls {
                let mut args = plain(0, data);
                args.extend(tls_args(port, &dir.0, true));
                args
            } else {
                plain(port, data)
            };
            if let Some(pw) = password {
                args.extend(["--requirepass", pw, "--masterauth", pw].map(str::to_owned));
            }
            args
        };
        let cli = || if tls { tls_cli(&dir.0) } else { Vec::new() };
        let data_cli = || {
            let mut args = cli();
            if let Some(pw) = password {
                args.extend(["-a", pw, "--no-auth-warning"].map(str::to_owned));
            }
            args
        };
        let p = free_port(false);
        let primary = Server::spawn(p, &node_args(p, &data("primary")?), data_cli())?;
        let r = free_port(false);
        let mut args = node_args(r, &data("replica")?);
        args.extend(["--replicaof", "127.0.0.1", &p.to_string()].map(str::to_owned));
        let replica = Server::spawn(r, &args, data_cli())?;
        let mut sentinels = Vec::new();
        for i in 0..3 {
            let port = free_port(false);
            let sdir = data(&format!("sentinel{i}"))?;
            let conf = sdir.join("sentinel.conf");
            let listen = if tls {
                let file = |name: &str| dir.0.join(name).display().to_string();
                format!(
                    "port 0\ntls-port {port}\ntls-cert-file {}\ntls-key-file {}\n\
                     tls-ca-cert-file {}\ntls-auth-clients yes\ntls-replication yes\n",
                    file("server.crt"),
                    file("server.key"),
                    file("ca.crt"),
                )
            } else {
                format!("port {port}\n")
            };
            let text = format!(
                "{listen}bind 127.0.0.1\nprotected-mode no\ndir {dir}\n\
                 sentinel monitor {MASTER} 127.0.0.1 {p} 2\n\
                 sentinel down-after-milliseconds {MASTER} {down}\n\
                 sentinel failover-timeout {MASTER} 5000\n\
                 sentinel parallel-syncs {MASTER} 1\n{auth}",
                dir = sdir.display(),
                down = DOWN_AFTER.as_millis(),
                auth = password
                    .map(|pw| format!("sentinel auth-pass {MASTER} {pw}\n"))
                    .unwrap_or_default(),
            );
            std::fs::write(&conf, text).map_err(|e| format!("cannot write {conf:?}: {e}"))?;
            let args = [conf.to_string_lossy().into_owned(), "--sentinel".to_owned()];
            sentinels.push(Server::spawn(port, &args, cli())?);
        }
        let setup = Self {
            primary,
            replica,
            sentinels,
            certs,
            password: password.map(str::to_owned),
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let synced = setup
                .replica
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
                     Sentinels know each other and the replica: {known})"
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `redis+sentinel://[:<password>@]127.0.0.1:<s1>,…/mymaster`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        let scheme = if self.certs.is_some() {
            "rediss"
        } else {
            "redis"
        };
        let auth = self
            .password
            .as_ref()
            .map(|pw| format!(":{pw}@"))
            .unwrap_or_default();
        format!("{scheme}+sentinel://{auth}{}/{MASTER}", hosts.join(","))
    }

    /// The primary's port as the first Sentinel names it now.
    pub fn named_primary(&self) -> Option<u16> {
        let reply = self.sentinels[0].cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER])?;
        reply.lines().nth(1)?.trim().parse().ok()
    }
}
