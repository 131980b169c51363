//! Runs one fault kind: sets its servers and instances up, plays its seeded plan of calls and
//! faults, heals, drains, reads every key back, and hands everything to the checker.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::checker::{self, FINAL, FaultEffect, FaultSpan, Input, Verdict};
use crate::history::{self, OpKind, Record, now_us};
use crate::pg::PgSetup;
use crate::proxy::{Mode, Proxy};
use crate::servers::{Cluster, RedisNode, SentinelSetup, TempDir, signal};
use crate::worker::{Command, Instance, InstanceConfig, OpSpec, Payload, PgConfig, RedisConfig};

/// A fault the plan injects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The proxy holds every byte both ways for `ms`, closing nothing.
    Partition { ms: u64 },
    /// The proxy delays every chunk by `base_ms` plus up to `jitter_ms`, for `ms`.
    Latency {
        base_ms: u64,
        jitter_ms: u64,
        ms: u64,
    },
    /// The proxy resets every open connection.
    Reset,
    /// The proxy passes nothing to subscriber connections for `ms`.
    SilenceSubscribers { ms: u64 },
    /// Redis SIGKILLed, restarted after `ms` (AOF: the data survives).
    RedisKill { ms: u64 },
    /// Redis SIGSTOPped for `ms`.
    RedisPause { ms: u64 },
    /// `maxmemory` squeezed (`noeviction`: writes get OOM) for `ms`.
    Oom { ms: u64 },
    /// The instances' ACL user loses every right for `ms`.
    AclRevoke { ms: u64 },
    /// The instance in `slot` is SIGKILLed (and replaced).
    InstanceKill { slot: usize },
    /// The instance in `slot` is SIGSTOPped for `ms`.
    InstancePause { slot: usize, ms: u64 },
    /// The instance in `slot` is told `Runtime::shutdown(grace)` (and replaced).
    InstanceShutdown { slot: usize, grace_ms: u64 },
    /// Every session of the store's role is terminated.
    PgTerminate,
    /// New sessions of the store's role are read-only for `ms` (open ones terminated).
    PgReadOnly { ms: u64 },
    /// Another session holds an exclusive lock on the store's table for `ms`.
    PgLock { ms: u64 },
    /// `SENTINEL FAILOVER`: the replica becomes primary.
    SentinelFailover,
    /// `CLUSTER FAILOVER` on a replica: it takes over its primary's slots.
    ClusterFailover,
    /// The Sentinels' primary is SIGKILLed; they promote the replica; the old primary is
    /// restarted (AOF) and follows it.
    SentinelKill,
    /// A cluster primary is SIGKILLed; its replica is promoted; it is restarted and rejoins
    /// as a replica.
    ClusterKill,
}

impl Fault {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::Partition { .. } => "partition",
            Self::Latency { .. } => "latency",
            Self::Reset => "reset",
            Self::SilenceSubscribers { .. } => "silent-subscriber",
            Self::RedisKill { .. } => "redis-kill",
            Self::RedisPause { .. } => "redis-pause",
            Self::Oom { .. } => "oom",
            Self::AclRevoke { .. } => "acl-revoke",
            Self::InstanceKill { .. } => "instance-kill",
            Self::InstancePause { .. } => "instance-pause",
            Self::InstanceShutdown { .. } => "instance-shutdown",
            Self::PgTerminate => "pg-terminate",
            Self::PgReadOnly { .. } => "pg-read-only",
            Self::PgLock { .. } => "pg-lock",
            Self::SentinelFailover => "sentinel-failover",
            Self::ClusterFailover => "cluster-failover",
            Self::SentinelKill => "sentinel-kill",
            Self::ClusterKill => "cluster-kill",
        }
    }
}

/// One step of a plan, `at_ms` after the start of the run phase.
#[derive(Debug, Clone)]
pub(crate) enum Action {
    Call { slot: usize, op: OpSpec },
    Fault(Fault),
}

#[derive(Debug, Clone)]
pub(crate) struct Step {
    pub(crate) at_ms: u64,
    pub(crate) action: Action,
}

/// The Redis a kind runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RedisSetup {
    None,
    /// One durable node behind the fault proxy.
    Node,
    /// One durable node, instances logged in as an ACL user with every command and key but
    /// no channel (`resetchannels`, the Redis 7 default for a new user).
    NodeNoChannels,
    /// One durable node, instances logged in as an ACL user with every right (revocable).
    NodeAclUser,
    /// 3 primaries with a replica each.
    Cluster,
    /// A primary and a replica behind three Sentinels.
    Sentinel,
}

/// Everything a kind is.
pub(crate) struct Setup {
    pub(crate) redis: RedisSetup,
    /// Idempotency (and transactional runs) on PostgreSQL, behind the fault proxy.
    pub(crate) postgres: bool,
    pub(crate) idem_on_postgres: bool,
    pub(crate) pool_size: usize,
    pub(crate) payload: Payload,
    /// The HTTP layer's lease and wait timeout, ms, when the kind makes HTTP calls.
    pub(crate) http: Option<(u64, u64)>,
    /// Rate limit per window.
    pub(crate) rate: Option<(u32, u64)>,
    /// Instances in the harness's process, then instances in processes of their own.
    pub(crate) local: usize,
    pub(crate) procs: usize,
    pub(crate) plan: Vec<Step>,
    /// A fault that is the setup itself (an ACL user without channel rights), for the table.
    pub(crate) standing_fault: Option<(String, FaultEffect)>,
}

/// A running instance in a slot.
enum Live {
    Local(Arc<Instance>),
    Proc(Box<Proc>),
}

struct Proc {
    id: String,
    pid: u32,
    child: tokio::process::Child,
    lines: mpsc::UnboundedSender<String>,
}

struct Slot {
    local: bool,
    generation: u32,
    live: Option<Live>,
}

/// What one kind's servers are.
pub(crate) struct Env {
    pub(crate) dir: TempDir,
    redis: Option<Mutex<RedisNode>>,
    redis_port: u16,
    redis_proxy: Option<Proxy>,
    acl_user: Option<String>,
    cluster: Option<Mutex<Cluster>>,
    sentinel: Option<Mutex<SentinelSetup>>,
    pg: Option<PgSetup>,
    pg_proxy: Option<Proxy>,
    timeline: Mutex<Vec<FaultSpan>>,
    slots: Mutex<Vec<Slot>>,
    base: InstanceConfig,
    /// The worker binary (this one).
    exe: PathBuf,
    pub(crate) notes: Mutex<Vec<String>>,
}

const ACL_PASSWORD: &str = "faults-pw";

impl Env {
    async fn new(name: &str, setup: &Setup) -> Result<Arc<Self>, String> {
        let dir = TempDir::new(&format!("history-{name}")).map_err(|e| e.to_string())?;
        let mut redis = None;
        let mut redis_port = 0;
        let mut redis_proxy = None;
        let mut acl_user = None;
        let mut cluster = None;
        let mut sentinel = None;
        let mut redis_cfg = None;
        let prefix = format!("tbf-{name}");
        match setup.redis {
            RedisSetup::None => {}
            RedisSetup::Node | RedisSetup::NodeNoChannels | RedisSetup::NodeAclUser => {
                let node = tokio::task::spawn_blocking(|| RedisNode::start(&[]))
                    .await
                    .map_err(|e| e.to_string())??;
                redis_port = node.port();
                let proxy = Proxy::start(redis_port).await.map_err(|e| e.to_string())?;
                let (username, password) = if setup.redis == RedisSetup::Node {
                    (None, None)
                } else {
                    let channels = if setup.redis == RedisSetup::NodeNoChannels {
                        "resetchannels"
                    } else {
                        "allchannels"
                    };
                    let pw = format!(">{ACL_PASSWORD}");
                    let made = node.server.cli(&[
                        "ACL", "SETUSER", "tbf", "reset", "on", &pw, "+@all", "~*", channels,
                    ]);
                    if made.as_deref() != Some("OK") {
                        return Err(format!("ACL SETUSER failed: {made:?}"));
                    }
                    acl_user = Some("tbf".to_owned());
                    (Some("tbf".to_owned()), Some(ACL_PASSWORD.to_owned()))
                };
                redis_cfg = Some(RedisConfig {
                    url: format!("redis://127.0.0.1:{}", proxy.port),
                    username,
                    password,
                    prefix,
                    durable: false,
                });
                redis = Some(Mutex::new(node));
                redis_proxy = Some(proxy);
            }
            RedisSetup::Cluster => {
                let c = tokio::task::spawn_blocking(Cluster::start)
                    .await
                    .map_err(|e| e.to_string())??;
                redis_cfg = Some(RedisConfig {
                    url: format!(
                        "redis+cluster://{}",
                        c.nodes
                            .iter()
                            .map(|n| format!("127.0.0.1:{}", n.port))
                            .collect::<Vec<_>>()
                            .join(",")
                    ),
                    username: None,
                    password: None,
                    prefix,
                    // Failovers lose what was not replicated; durable claims are the
                    // documented way to run no key twice across them.
                    durable: true,
                });
                cluster = Some(Mutex::new(c));
            }
            RedisSetup::Sentinel => {
                let s = tokio::task::spawn_blocking(SentinelSetup::start)
                    .await
                    .map_err(|e| e.to_string())??;
                redis_cfg = Some(RedisConfig {
                    url: s.url(),
                    username: None,
                    password: None,
                    prefix,
                    // Failovers lose what was not replicated; durable claims are the
                    // documented way to run no key twice across them.
                    durable: true,
                });
                sentinel = Some(Mutex::new(s));
            }
        }
        let mut pg = None;
        let mut pg_proxy = None;
        let mut pg_cfg = None;
        if setup.postgres {
            let p = PgSetup::create(name).await?;
            let proxy = Proxy::start(p.server_port())
                .await
                .map_err(|e| e.to_string())?;
            let cfg = PgConfig {
                url: p.store_url(proxy.port),
                table: p.table(),
                effects: p.effects(),
                app_name: p.name.clone(),
                pool_size: setup.pool_size,
            };
            // The table, made once by the role that owns the schema.
            let store = throttlebeam::idempotency::postgres::PostgresStore::builder(
                &p.store_url(p.server_port()),
            )
            .with_table(p.table())
            .connect()
            .await
            .map_err(|e| format!("the store does not connect: {e}"))?;
            store
                .migrate()
                .await
                .map_err(|e| format!("the migration failed: {e}"))?;
            drop(store);
            pg_cfg = Some(cfg);
            pg = Some(p);
            pg_proxy = Some(proxy);
        }
        let base = InstanceConfig {
            id: String::new(),
            dir: dir.0.clone(),
            redis: redis_cfg,
            postgres: pg_cfg,
            idem_on_postgres: setup.idem_on_postgres,
            payload: setup.payload,
            http: setup.http,
            rate: setup.rate,
        };
        Ok(Arc::new(Self {
            dir,
            redis,
            redis_port,
            redis_proxy,
            acl_user,
            cluster,
            sentinel,
            pg,
            pg_proxy,
            timeline: Mutex::new(Vec::new()),
            slots: Mutex::new(Vec::new()),
            base,
            exe: std::env::current_exe().map_err(|e| e.to_string())?,
            notes: Mutex::new(Vec::new()),
        }))
    }

    fn note(&self, s: String) {
        self.notes.lock().unwrap().push(s);
    }

    fn span(&self, label: String, effect: FaultEffect, start: u64, end: u64) {
        let mut t = self.timeline.lock().unwrap();
        let id = t.len();
        t.push(FaultSpan {
            id,
            label,
            effect,
            start,
            end,
        });
    }

    fn config(&self, id: &str) -> InstanceConfig {
        let mut cfg = self.base.clone();
        cfg.id = id.to_owned();
        cfg
    }

    /// The config of the instance that reads every key back after healing: straight to the
    /// servers, no proxy.
    fn final_config(&self) -> InstanceConfig {
        let mut cfg = self.config(FINAL);
        if let Some(r) = &mut cfg.redis
            && self.redis_proxy.is_some()
        {
            r.url = format!("redis://127.0.0.1:{}", self.redis_port);
        }
        if let (Some(p), Some(pg)) = (&mut cfg.postgres, &self.pg) {
            p.url = pg.store_url(pg.server_port());
            p.app_name = format!("{}_final", pg.name);
        }
        cfg
    }

    async fn spawn_proc(&self, id: &str) -> Result<Proc, String> {
        let cfg = serde_json::to_string(&self.config(id)).map_err(|e| e.to_string())?;
        let stderr = std::fs::File::create(self.dir.0.join(format!("stderr-{id}.log")))
            .map_err(|e| e.to_string())?;
        let mut child = tokio::process::Command::new(&self.exe)
            .arg("worker")
            .arg(cfg)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("the worker did not start: {e}"))?;
        let pid = child.id().ok_or("the worker has no pid")?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut stdout = BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(Duration::from_secs(30), stdout.next_line()).await;
        if !matches!(&ready, Ok(Ok(Some(l))) if l == "ready") {
            let _ = child.start_kill();
            let log = std::fs::read_to_string(self.dir.0.join(format!("stderr-{id}.log")))
                .unwrap_or_default();
            return Err(format!("worker {id} did not get ready: {}", log.trim()));
        }
        let mut stdin = child.stdin.take().ok_or("no stdin")?;
        let (lines, mut rx) = mpsc::unbounded_channel::<String>();
        // A writer of its own: a stopped worker's full pipe never blocks the plan.
        tokio::spawn(async move {
            while let Some(line) = rx.recv().await {
                if stdin.write_all(line.as_bytes()).await.is_err() {
                    return;
                }
            }
        });
        Ok(Proc {
            id: id.to_owned(),
            pid,
            child,
            lines,
        })
    }

    async fn start_slot(&self, index: usize, local: bool, generation: u32) -> Result<Live, String> {
        let id = if generation == 0 {
            format!("{}{}", if local { "i" } else { "w" }, index + 1)
        } else {
            format!(
                "{}{}.{generation}",
                if local { "i" } else { "w" },
                index + 1
            )
        };
        if local {
            let instance = Instance::start(self.config(&id), Duration::from_secs(20)).await?;
            Ok(Live::Local(instance))
        } else {
            Ok(Live::Proc(Box::new(self.spawn_proc(&id).await?)))
        }
    }

    /// Hands `op` to the instance in `slot`, or to the next live one.
    fn dispatch(&self, slot: usize, op: OpSpec) {
        let slots = self.slots.lock().unwrap();
        let n = slots.len();
        for i in 0..n {
            let s = &slots[(slot + i) % n];
            match &s.live {
                Some(Live::Local(inst)) => {
                    inst.exec(op);
                    return;
                }
                Some(Live::Proc(p)) => {
                    let line = serde_json::to_string(&Command::Op(op)).expect("serializes") + "\n";
                    let _ = p.lines.send(line);
                    return;
                }
                None => {}
            }
        }
    }

    /// Takes the process out of `slot` (for a kill or a shutdown); `None` for a local one.
    fn take_proc(&self, slot: usize) -> Option<(Box<Proc>, u32)> {
        let mut slots = self.slots.lock().unwrap();
        let n = slots.len();
        let s = &mut slots[slot % n];
        if s.local || !matches!(s.live, Some(Live::Proc(_))) {
            return None;
        }
        let Some(Live::Proc(p)) = s.live.take() else {
            unreachable!()
        };
        s.generation += 1;
        Some((p, s.generation))
    }

    fn proc_pid(&self, slot: usize) -> Option<(String, u32)> {
        let slots = self.slots.lock().unwrap();
        let n = slots.len();
        match &slots[slot % n].live {
            Some(Live::Proc(p)) => Some((p.id.clone(), p.pid)),
            _ => None,
        }
    }

    async fn respawn(self: &Arc<Self>, slot: usize, generation: u32) {
        let n = self.slots.lock().unwrap().len();
        match self.start_slot(slot % n, false, generation).await {
            Ok(live) => {
                let mut slots = self.slots.lock().unwrap();
                if slots[slot % n].generation == generation {
                    slots[slot % n].live = Some(live);
                }
            }
            Err(e) => self.note(format!("slot {slot} was not replaced: {e}")),
        }
    }

    fn redis_cli(&self, args: &[&str]) -> Option<String> {
        self.redis.as_ref()?.lock().unwrap().server.cli(args)
    }

    /// Applies `fault`; returns when it has healed.
    async fn apply(self: Arc<Self>, fault: Fault) {
        let label = fault_label(&fault);
        let start = now_us();
        let blocking = |f: Box<dyn FnOnce(&Self) + Send>| {
            let me = Arc::clone(&self);
            async move {
                let _ = tokio::task::spawn_blocking(move || f(&me)).await;
            }
        };
        let sleep = |ms: u64| tokio::time::sleep(Duration::from_millis(ms));
        match fault {
            Fault::Partition { ms }
            | Fault::Latency { ms, .. }
            | Fault::SilenceSubscribers { ms } => {
                let Some(proxy) = self.redis_proxy.as_ref().or(self.pg_proxy.as_ref()) else {
                    return;
                };
                let (mode, effect) = match fault {
                    Fault::Partition { .. } => (Mode::Partition, FaultEffect::StoreCut),
                    // Both ways delayed: a round trip past the command timeout (500 ms) is
                    // an outage to the client (every command times out), not a slowdown.
                    Fault::Latency {
                        base_ms, jitter_ms, ..
                    } => (
                        Mode::Latency { base_ms, jitter_ms },
                        if 2 * (base_ms + jitter_ms) >= COMMAND_TIMEOUT_MS {
                            FaultEffect::StoreCut
                        } else {
                            FaultEffect::StoreDegraded
                        },
                    ),
                    _ => (Mode::SilenceSubscribers, FaultEffect::StoreDegraded),
                };
                proxy.set(mode);
                sleep(ms).await;
                proxy.set(Mode::Pass);
                let label = if matches!(fault, Fault::SilenceSubscribers { .. }) {
                    format!(
                        "{label} ({} subscriber connections so far)",
                        proxy.subscribers()
                    )
                } else {
                    label
                };
                self.span(label, effect, start, now_us());
            }
            Fault::Reset => {
                for p in [&self.redis_proxy, &self.pg_proxy].into_iter().flatten() {
                    p.reset();
                }
                self.span(label, FaultEffect::StoreDegraded, start, now_us());
            }
            Fault::RedisKill { ms } => {
                blocking(Box::new(|me| {
                    if let Some(r) = &me.redis {
                        r.lock().unwrap().server.kill();
                    }
                }))
                .await;
                let start = now_us();
                sleep(ms).await;
                let restarted = Arc::new(Mutex::new(Ok(())));
                let r2 = Arc::clone(&restarted);
                blocking(Box::new(move |me| {
                    if let Some(r) = &me.redis {
                        *r2.lock().unwrap() = r.lock().unwrap().server.restart();
                    }
                }))
                .await;
                if let Err(e) = &*restarted.lock().unwrap() {
                    self.note(format!("Redis did not restart: {e}"));
                }
                self.span(label, FaultEffect::StoreCut, start, now_us());
            }
            Fault::RedisPause { ms } => {
                let paused = self
                    .redis
                    .as_ref()
                    .is_some_and(|r| r.lock().unwrap().server.pause());
                let start = now_us();
                sleep(ms).await;
                if paused && let Some(r) = &self.redis {
                    r.lock().unwrap().server.resume();
                }
                self.span(label, FaultEffect::StoreCut, start, now_us());
            }
            Fault::Oom { ms } => {
                blocking(Box::new(|me| {
                    me.redis_cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
                    me.redis_cli(&["CONFIG", "SET", "maxmemory", "1"]);
                }))
                .await;
                let start = now_us();
                sleep(ms).await;
                blocking(Box::new(|me| {
                    me.redis_cli(&["CONFIG", "SET", "maxmemory", "0"]);
                }))
                .await;
                self.span(label, FaultEffect::StoreDegraded, start, now_us());
            }
            Fault::AclRevoke { ms } => {
                let Some(user) = self.acl_user.clone() else {
                    return;
                };
                let u2 = user.clone();
                blocking(Box::new(move |me| {
                    me.redis_cli(&["ACL", "SETUSER", &u2, "-@all"]);
                }))
                .await;
                let start = now_us();
                sleep(ms).await;
                blocking(Box::new(move |me| {
                    me.redis_cli(&["ACL", "SETUSER", &user, "+@all"]);
                }))
                .await;
                self.span(label, FaultEffect::StoreCut, start, now_us());
            }
            Fault::InstanceKill { slot } => {
                let Some((mut p, generation)) = self.take_proc(slot) else {
                    return;
                };
                let t = now_us();
                let _ = p.child.start_kill();
                let _ = p.child.wait().await;
                self.span(
                    format!("{label} {}", p.id),
                    FaultEffect::InstanceKill { inst: p.id.clone() },
                    t,
                    t,
                );
                sleep(500).await;
                self.respawn(slot, generation).await;
            }
            Fault::InstancePause { slot, ms } => {
                let Some((id, pid)) = self.proc_pid(slot) else {
                    return;
                };
                let start = now_us();
                signal(pid, "-STOP");
                sleep(ms).await;
                signal(pid, "-CONT");
                self.span(
                    format!("{label} {id}"),
                    FaultEffect::InstancePause { inst: id },
                    start,
                    now_us(),
                );
            }
            Fault::InstanceShutdown { slot, grace_ms } => {
                let Some((mut p, generation)) = self.take_proc(slot) else {
                    return;
                };
                let t = now_us();
                let _ = p.lines.send(
                    serde_json::to_string(&Command::Shutdown(grace_ms)).expect("serializes") + "\n",
                );
                self.span(
                    format!("{label} {}", p.id),
                    FaultEffect::InstanceShutdown { inst: p.id.clone() },
                    t,
                    t,
                );
                // It keeps its calls running; once they ended, it exits.
                let _ = p.lines.send(
                    serde_json::to_string(&Command::Exit(60_000)).expect("serializes") + "\n",
                );
                let me = Arc::clone(&self);
                tokio::spawn(async move {
                    if tokio::time::timeout(Duration::from_secs(70), p.child.wait())
                        .await
                        .is_err()
                    {
                        me.note(format!("{} did not exit after its shutdown", p.id));
                        let _ = p.child.start_kill();
                    }
                });
                sleep(grace_ms + 300).await;
                self.respawn(slot, generation).await;
            }
            Fault::PgTerminate => {
                if let Some(pg) = &self.pg {
                    let n = pg.terminate().await;
                    self.span(
                        format!("{label} ({n} sessions)"),
                        FaultEffect::PgBroken,
                        start,
                        now_us(),
                    );
                }
            }
            Fault::PgReadOnly { ms } => {
                if let Some(pg) = &self.pg {
                    pg.read_only(true).await;
                    sleep(ms).await;
                    pg.read_only(false).await;
                    self.span(label, FaultEffect::PgBroken, start, now_us());
                }
            }
            Fault::PgLock { ms } => {
                if let Some(pg) = &self.pg {
                    if let Err(e) = pg.hold_lock(Duration::from_millis(ms)).await {
                        self.note(format!("the lock was not held: {e}"));
                    }
                    self.span(label, FaultEffect::PgBroken, start, now_us());
                }
            }
            Fault::SentinelFailover => {
                let ok = Arc::new(Mutex::new(String::new()));
                let ok2 = Arc::clone(&ok);
                blocking(Box::new(move |me| {
                    if let Some(s) = &me.sentinel {
                        let s = s.lock().unwrap();
                        let before = s.primary();
                        let reply = s.sentinels[0]
                            .cli(&["SENTINEL", "FAILOVER", crate::servers::MASTER])
                            .unwrap_or_default();
                        let deadline = std::time::Instant::now() + Duration::from_secs(20);
                        while s.primary() == before && std::time::Instant::now() < deadline {
                            std::thread::sleep(Duration::from_millis(50));
                        }
                        if s.primary() == before || !s.wait_settled(Duration::from_secs(20)) {
                            *ok2.lock().unwrap() = format!("did not settle ({reply})");
                        }
                    }
                }))
                .await;
                let why = ok.lock().unwrap().clone();
                if !why.is_empty() {
                    self.note(format!("Sentinel failover {why}"));
                }
                // Until the old primary follows the new one, durable claims have no replica
                // to wait for: the store refuses claims and completions.
                self.span(label, FaultEffect::StoreCut, start, now_us());
            }
            Fault::ClusterFailover => {
                let why = Arc::new(Mutex::new(String::new()));
                let w2 = Arc::clone(&why);
                blocking(Box::new(move |me| {
                    if let Some(c) = &me.cluster {
                        let c = c.lock().unwrap();
                        let replicas = c.linked_replicas();
                        let Some(&r) = replicas.first() else {
                            *w2.lock().unwrap() = "no linked replica".to_owned();
                            return;
                        };
                        let reply = c.nodes[r].cli(&["CLUSTER", "FAILOVER"]).unwrap_or_default();
                        std::thread::sleep(Duration::from_millis(500));
                        if !c.wait_ok(Duration::from_secs(20)) || c.primaries().len() != 3 {
                            *w2.lock().unwrap() = format!("did not settle ({reply})");
                        }
                    }
                }))
                .await;
                let why = why.lock().unwrap().clone();
                if !why.is_empty() {
                    self.note(format!("cluster failover {why}"));
                }
                self.span(label, FaultEffect::StoreCut, start, now_us());
            }
            Fault::SentinelKill | Fault::ClusterKill => {
                let why = Arc::new(Mutex::new(None));
                let w2 = Arc::clone(&why);
                blocking(Box::new(move |me| *w2.lock().unwrap() = me.kill_primary())).await;
                if let Some(why) = why.lock().unwrap().clone() {
                    self.note(format!("{label}: {why}"));
                }
                // With durable claims, nothing is written until a replica follows again.
                self.span(label, FaultEffect::StoreCut, start, now_us());
            }
        }
    }

    /// Kills the primary of the Sentinel setup or of the cluster, waits for the failover,
    /// restarts it, and waits until every primary has a linked replica again; what went
    /// wrong, if anything.
    fn kill_primary(&self) -> Option<String> {
        let wait = |ok: &dyn Fn() -> bool, within: u64| {
            let deadline = std::time::Instant::now() + Duration::from_secs(within);
            while !ok() {
                if std::time::Instant::now() > deadline {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            true
        };
        if let Some(s) = &self.sentinel {
            let mut s = s.lock().unwrap();
            let p = s.primary()?;
            s.data[p].kill();
            if !wait(&|| s.primary().is_some_and(|q| q != p), 30) {
                return Some("the Sentinels did not promote the replica within 30 s".to_owned());
            }
            if let Err(e) = s.data[p].restart() {
                return Some(format!("the old primary did not restart: {e}"));
            }
            if !s.wait_settled(Duration::from_secs(40)) {
                return Some("the old primary did not follow the new one within 40 s".to_owned());
            }
            return None;
        }
        if let Some(c) = &self.cluster {
            let mut c = c.lock().unwrap();
            let primaries = c.primaries();
            let p = *primaries.first()?;
            c.nodes[p].kill();
            if !wait(
                &|| c.primaries().len() == 3 && c.wait_ok(Duration::ZERO),
                30,
            ) {
                return Some("the replica was not promoted within 30 s".to_owned());
            }
            if let Err(e) = c.nodes[p].restart() {
                return Some(format!("the old primary did not restart: {e}"));
            }
            if !wait(
                &|| c.wait_ok(Duration::ZERO) && c.linked_replicas().len() == 3,
                40,
            ) {
                return Some("the old primary did not rejoin as a replica within 40 s".to_owned());
            }
        }
        None
    }

    /// Ends every fault that could still be on (a last safety net after the plan's own heals).
    fn heal(&self) {
        for p in [&self.redis_proxy, &self.pg_proxy].into_iter().flatten() {
            p.set(Mode::Pass);
        }
        if let Some(r) = &self.redis {
            let r = r.lock().unwrap();
            if r.server.is_running() {
                r.server.resume();
            }
        }
        if self.redis.is_some() {
            self.redis_cli(&["CONFIG", "SET", "maxmemory", "0"]);
            if let Some(u) = &self.acl_user {
                self.redis_cli(&["ACL", "SETUSER", u, "+@all"]);
            }
        }
        let slots = self.slots.lock().unwrap();
        for s in slots.iter() {
            if let Some(Live::Proc(p)) = &s.live {
                signal(p.pid, "-CONT");
            }
        }
    }
}

fn fault_label(f: &Fault) -> String {
    match f {
        Fault::Partition { ms } => format!("partition {ms}ms"),
        Fault::Latency {
            base_ms,
            jitter_ms,
            ms,
        } => format!("latency {base_ms}+{jitter_ms}ms for {ms}ms"),
        Fault::Reset => "reset all connections".to_owned(),
        Fault::SilenceSubscribers { ms } => format!("silent subscribers {ms}ms"),
        Fault::RedisKill { ms } => format!("redis kill -9, restart after {ms}ms"),
        Fault::RedisPause { ms } => format!("redis SIGSTOP {ms}ms"),
        Fault::Oom { ms } => format!("maxmemory squeeze {ms}ms"),
        Fault::AclRevoke { ms } => format!("ACL rights revoked {ms}ms"),
        Fault::InstanceKill { .. } => "instance kill -9".to_owned(),
        Fault::InstancePause { ms, .. } => format!("instance SIGSTOP {ms}ms"),
        Fault::InstanceShutdown { grace_ms, .. } => format!("instance shutdown grace {grace_ms}ms"),
        Fault::PgTerminate => "pg_terminate_backend".to_owned(),
        Fault::PgReadOnly { ms } => format!("read-only sessions {ms}ms"),
        Fault::PgLock { ms } => format!("table lock held {ms}ms"),
        Fault::SentinelFailover => "SENTINEL FAILOVER".to_owned(),
        Fault::ClusterFailover => "CLUSTER FAILOVER".to_owned(),
        Fault::SentinelKill => "kill -9 of the Sentinels' primary, restarted".to_owned(),
        Fault::ClusterKill => "kill -9 of a cluster primary, restarted".to_owned(),
    }
}

/// What running one kind produced.
pub(crate) struct Run {
    pub(crate) verdict: Verdict,
    pub(crate) records: Vec<Record>,
    pub(crate) faults: Vec<FaultSpan>,
    pub(crate) fault_counts: BTreeMap<String, usize>,
    pub(crate) notes: Vec<String>,
    pub(crate) took: Duration,
}

/// The checker's tolerances.
pub(crate) const SLACK_MS: u64 = 5_000;
pub(crate) const COOLDOWN_MS: u64 = 2_000;
pub(crate) const CLOCK_ERROR_MS: u64 = 50;
/// The stores' command timeout (the library's default).
pub(crate) const COMMAND_TIMEOUT_MS: u64 = 500;

/// Runs one kind end to end.
pub(crate) async fn run(name: &str, setup: Setup, keep: Option<&Path>) -> Result<Run, String> {
    let began = Instant::now();
    let env = Env::new(name, &setup).await?;
    let result = run_in(&env, name, &setup).await;
    // Teardown, whatever happened.
    {
        let mut slots = env.slots.lock().unwrap();
        for s in slots.iter_mut() {
            if let Some(Live::Proc(mut p)) = s.live.take() {
                signal(p.pid, "-CONT");
                let _ = p.child.start_kill();
            }
        }
    }
    if let Some(pg) = &env.pg {
        pg.drop_all().await;
    }
    if let Some(dest) = keep {
        let _ = copy_dir(&env.dir.0, &dest.join(name));
    }
    let mut run = result?;
    run.took = began.elapsed();
    Ok(run)
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        std::fs::copy(e.path(), to.join(e.file_name()))?;
    }
    Ok(())
}

async fn run_in(env: &Arc<Env>, name: &str, setup: &Setup) -> Result<Run, String> {
    let began = Instant::now();
    let mut phases: Vec<(&str, Duration)> = Vec::new();
    let mark = |what, phases: &mut Vec<(&str, Duration)>| phases.push((what, began.elapsed()));
    // Instances.
    let total = setup.local + setup.procs;
    {
        let mut slots = Vec::new();
        for i in 0..total {
            let local = i < setup.local;
            slots.push(Slot {
                local,
                generation: 0,
                live: Some(env.start_slot(i, local, 0).await?),
            });
        }
        *env.slots.lock().unwrap() = slots;
    }
    mark("setup", &mut phases);
    if let Some((label, effect)) = &setup.standing_fault {
        env.span(label.clone(), effect.clone(), now_us(), now_us());
    }
    // The plan.
    let mut fault_counts: BTreeMap<String, usize> = BTreeMap::new();
    let mut faults = Vec::new();
    let t0 = Instant::now();
    let mut max_bound = 0;
    let mut once_keys: BTreeMap<String, (OpKind, u64)> = BTreeMap::new();
    for step in &setup.plan {
        tokio::time::sleep_until(t0 + Duration::from_millis(step.at_ms)).await;
        match &step.action {
            Action::Call { slot, op } => {
                max_bound = max_bound.max(op.bound_ms());
                if op.kind.is_once() {
                    let e = once_keys.entry(op.key.clone()).or_insert((op.kind, 0));
                    e.1 = e.1.max(op.lease_ms);
                }
                env.dispatch(*slot, op.clone());
            }
            Action::Fault(f) => {
                *fault_counts.entry(f.name().to_owned()).or_default() += 1;
                faults.push(tokio::spawn(Arc::clone(env).apply(f.clone())));
            }
        }
    }
    mark("plan", &mut phases);
    // Heal: every fault ends on its own; then a safety net.
    for f in faults {
        let _ = f.await;
    }
    {
        let env2 = Arc::clone(env);
        let _ = tokio::task::spawn_blocking(move || env2.heal()).await;
    }
    // Drain: every call in flight ends (or is wedged).
    let drain_for = Duration::from_millis(max_bound + SLACK_MS + 2_000);
    let (locals, procs) = {
        let mut slots = env.slots.lock().unwrap();
        let mut locals = Vec::new();
        let mut procs = Vec::new();
        for s in slots.iter_mut() {
            match s.live.take() {
                Some(Live::Local(i)) => locals.push(i),
                Some(Live::Proc(p)) => procs.push(p),
                None => {}
            }
        }
        (locals, procs)
    };
    let exit_line = serde_json::to_string(&Command::Exit(
        u64::try_from(drain_for.as_millis()).unwrap_or(u64::MAX),
    ))
    .expect("serializes")
        + "\n";
    let mut waits = Vec::new();
    for mut p in procs {
        let _ = p.lines.send(exit_line.clone());
        let limit = drain_for + Duration::from_secs(10);
        let me = Arc::clone(env);
        waits.push(tokio::spawn(async move {
            if tokio::time::timeout(limit, p.child.wait()).await.is_err() {
                me.note(format!(
                    "worker {} did not exit within {limit:?}: killed",
                    p.id
                ));
                let _ = p.child.start_kill();
                let _ = p.child.wait().await;
            }
        }));
    }
    let mut health = Vec::new();
    for i in &locals {
        if !i.drain(drain_for).await {
            health.push(format!(
                "{}: {} calls still in flight after healing",
                i.id(),
                i.in_flight()
            ));
        }
    }
    for w in waits {
        let _ = w.await;
    }
    mark("heal+drain", &mut phases);
    // Health of the in-process instances: gauges back to zero, no breaker stuck open.
    for i in &locals {
        i.runtime.sweep_now();
        let deadline = Instant::now() + Duration::from_millis(COOLDOWN_MS + 5_000);
        loop {
            let stats = i.runtime.stats();
            let breaker_open = i.redis.as_ref().is_some_and(|r| {
                r.stats().breaker.state != throttlebeam::store::BreakerState::Closed
            });
            let busy = stats.processes > 0 || stats.keys > 0;
            if !busy && !breaker_open {
                break;
            }
            if Instant::now() > deadline {
                if busy {
                    health.push(format!(
                        "{}: gauges not back to zero after healing: processes {}, keys {}",
                        i.id(),
                        stats.processes,
                        stats.keys
                    ));
                }
                if breaker_open {
                    health.push(format!(
                        "{}: the Redis breaker is stuck open after healing",
                        i.id()
                    ));
                }
                break;
            }
            if let Some(r) = &i.redis {
                let _ = r.ping().await;
            }
            i.runtime.sweep_now();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    mark("health", &mut phases);
    // Final reads, straight to the servers.
    let reader = Instance::start(env.final_config(), Duration::from_secs(30)).await?;
    let max_lease = once_keys.values().map(|v| v.1).max().unwrap_or(0);
    let finals: Vec<(String, OpKind)> = once_keys
        .iter()
        .map(|(key, (kind, _))| (key.clone(), *kind))
        .collect();
    let wait_ms = max_lease + 15_000;
    for chunk in finals.chunks(8) {
        let calls = chunk.iter().cloned().map(|(key, kind)| {
            let r = Arc::clone(&reader);
            async move { final_read(&r, key, kind, wait_ms).await }
        });
        futures_join_all(calls).await;
    }
    reader.runtime.shutdown(Duration::from_secs(5)).await;
    let mut committed: BTreeMap<String, Vec<String>> = BTreeMap::new();
    if let Some(pg) = &env.pg {
        for (key, op) in pg.committed().await? {
            committed.entry(key).or_default().push(op);
        }
    }
    for i in &locals {
        i.runtime.shutdown(Duration::from_secs(2)).await;
    }
    mark("final reads", &mut phases);
    eprintln!(
        "        {name}: {}",
        phases
            .iter()
            .map(|(w, d)| format!("{w} at {:.1}s", d.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let (records, torn) = history::read_dir(&env.dir.0).map_err(|e| e.to_string())?;
    if torn > 0 {
        env.note(format!(
            "{torn} torn lines in the history (writers killed mid-line)"
        ));
    }
    let faults: Vec<FaultSpan> = env.timeline.lock().unwrap().clone();
    let _ = std::fs::write(
        env.dir.0.join("faults.json"),
        serde_json::to_string_pretty(&faults).unwrap_or_default(),
    );
    let input = Input {
        records: records.clone(),
        faults: faults.clone(),
        committed,
        health,
        slack_ms: SLACK_MS,
        cooldown_ms: COOLDOWN_MS,
        clock_error_ms: CLOCK_ERROR_MS,
    };
    let verdict = checker::check(&input);
    Ok(Run {
        verdict,
        records,
        faults,
        fault_counts,
        notes: env.notes.lock().unwrap().clone(),
        took: Duration::ZERO,
    })
}

/// Reads `key` back after healing: a call whose function records a special value. A store
/// still recovering gets a few more tries over about 10 s; every try is in the history.
async fn final_read(reader: &Instance, key: String, kind: OpKind, wait_ms: u64) {
    for attempt in 0..6 {
        let op = OpSpec {
            id: if attempt == 0 {
                format!("final:{key}")
            } else {
                format!("final:{key}#{attempt}")
            },
            key: key.clone(),
            kind,
            run_ms: 5,
            lease_ms: 3_000,
            wait_ms,
            ending: history::Ending::Ok,
            limit: 0,
        };
        if !reader.call(op).await.is_some_and(|o| {
            matches!(&o, crate::outcome::Outcome::NothingRan { why } if why.starts_with("StoreUnavailable"))
        }) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500 << attempt.min(4))).await;
    }
}

/// Awaits every future (no extra crate for `join_all`).
async fn futures_join_all<F: std::future::Future<Output = ()> + Send + 'static>(
    futures: impl IntoIterator<Item = F>,
) {
    let handles: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
    for h in handles {
        let _ = h.await;
    }
}
