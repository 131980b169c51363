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
        let leaf = |names: Vec<String>, usage: ExtendedKeyUsagePurpose| {
            let mut params = CertificateParams::new(names).unwrap();
            params
                .distinguished_name
                .push(DnType::CommonName, "throttlebeam test");
            params.extended_key_usages = vec![usage];
            params.use_authority_key_identifier_extension = true;
            let key = KeyPair::generate().unwrap();
            let cert = params.signed_by(&key, &authority).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert, server_key) = leaf(
            vec!["127.0.0.1".to_owned(), "localhost".to_owned()],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let (client_cert, client_key) = leaf(
            vec!["client".to_owned()],
            ExtendedKeyUsagePurpose::ClientAuth,
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
        let file = |name: &str| dir.0.join(name).to_string_lossy().into_owned();
        let port = free_port(false);
        let mut args = plain(0, &dir.0);
        args.extend(
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
            ]
            .map(str::to_owned),
        );
        let cli = [
            "--tls",
            "--cacert",
            &file("ca.crt"),
            "--cert",
            &file("client.crt"),
            "--key",
            &file("client.key"),
        ]
        .map(str::to_owned)
        .to_vec();
        let server = Server::spawn(port, &args, cli)
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
    pub dir: TempDir,
}

impl SentinelSetup {
    /// Starts every process and waits until the replica is in sync and
    /// every Sentinel knows the replica and the two other Sentinels.
    pub fn start(test: &str) -> Option<Self> {
        match Self::spawn() {
            Ok(setup) => Some(setup),
            Err(e) => unavailable(test, &e),
        }
    }

    fn spawn() -> Result<Self, String> {
        let dir = TempDir::new("sentinel").map_err(|e| format!("no temp dir: {e}"))?;
        let data = |name: &str| -> Result<PathBuf, String> {
            let d = dir.0.join(name);
            std::fs::create_dir_all(&d).map_err(|e| format!("cannot create {d:?}: {e}"))?;
            Ok(d)
        };
        let p = free_port(false);
        let primary = Server::spawn(p, &plain(p, &data("primary")?), Vec::new())?;
        let r = free_port(false);
        let mut args = plain(r, &data("replica")?);
        args.extend(["--replicaof", "127.0.0.1", &p.to_string()].map(str::to_owned));
        let replica = Server::spawn(r, &args, Vec::new())?;
        let mut sentinels = Vec::new();
        for i in 0..3 {
            let port = free_port(false);
            let sdir = data(&format!("sentinel{i}"))?;
            let conf = sdir.join("sentinel.conf");
            let text = format!(
                "port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {dir}\n\
                 sentinel monitor {MASTER} 127.0.0.1 {p} 2\n\
                 sentinel down-after-milliseconds {MASTER} {down}\n\
                 sentinel failover-timeout {MASTER} 5000\n\
                 sentinel parallel-syncs {MASTER} 1\n",
                dir = sdir.display(),
                down = DOWN_AFTER.as_millis(),
            );
            std::fs::write(&conf, text).map_err(|e| format!("cannot write {conf:?}: {e}"))?;
            let args = [conf.to_string_lossy().into_owned(), "--sentinel".to_owned()];
            sentinels.push(Server::spawn(port, &args, Vec::new())?);
        }
        let setup = Self {
            primary,
            replica,
            sentinels,
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

    /// `redis+sentinel://127.0.0.1:<s1>,…/mymaster`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        format!("redis+sentinel://{}/{MASTER}", hosts.join(","))
    }

    /// The primary's port as the first Sentinel names it now.
    pub fn named_primary(&self) -> Option<u16> {
        let reply = self.sentinels[0].cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER])?;
        reply.lines().nth(1)?.trim().parse().ok()
    }
}
