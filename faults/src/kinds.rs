//! The fault kinds: for each, its servers and instances and a seeded plan of calls and faults.
//!
//! A plan depends only on the seed, the kind's name and its duration, so
//! `--seed S --seconds N --only KIND` replays the same calls and faults at the same offsets
//! (the machine's scheduling still varies: the checker does not rely on it).

use crate::checker::FaultEffect;
use crate::engine::{Action, Fault, RedisSetup, Setup, Step};
use crate::history::{Ending, OpKind};
use crate::rng::Rng;
use crate::worker::{OpSpec, Payload};

/// Every kind, in the order a full pass runs them.
pub(crate) const KINDS: &[(&str, &str)] = &[
    (
        "baseline",
        "no fault: Redis, duplicates across instances, failures by design",
    ),
    (
        "shutdown",
        "Runtime::shutdown with a grace shorter than the runs (instance processes)",
    ),
    (
        "oom",
        "maxmemory squeezed (noeviction) while completions happen",
    ),
    (
        "acl-channels",
        "an ACL user with +@all ~* and no channel rights (resetchannels)",
    ),
    (
        "pg-pool",
        "transactional runs longer than their lease on a pool of 2",
    ),
    (
        "codec",
        "results whose serde form needs a self-describing format (Redis and PostgreSQL)",
    ),
    (
        "partition",
        "proxy holds every byte both ways, no FIN, shorter and longer than the lease",
    ),
    ("latency", "proxy adds latency and jitter"),
    ("reset", "proxy resets every connection (RST)"),
    ("subscriber", "proxy silences the subscriber connections"),
    ("redis-kill", "redis-server kill -9, restarted with its AOF"),
    (
        "redis-pause",
        "redis-server SIGSTOP, shorter and longer than the lease",
    ),
    (
        "acl",
        "the instances' ACL user loses every right, then gets them back",
    ),
    (
        "instance-kill",
        "instance processes SIGKILLed mid-run (documented exception)",
    ),
    (
        "instance-pause",
        "instance processes SIGSTOPped past their lease (documented exception)",
    ),
    (
        "pg-instance-pause",
        "instance processes SIGSTOPped past their lease, idempotency on PostgreSQL",
    ),
    (
        "pg-terminate",
        "PostgreSQL: the store's sessions terminated",
    ),
    (
        "pg-read-only",
        "PostgreSQL: the store's new sessions read-only",
    ),
    (
        "pg-lock",
        "PostgreSQL: another session holds a lock on the store's table",
    ),
    (
        "pg-partition",
        "PostgreSQL behind the proxy: partitions without FIN, short and long",
    ),
    (
        "sentinel",
        "Sentinel: manual failovers or the primary killed (durable claims)",
    ),
    (
        "cluster",
        "Redis Cluster: manual failovers or a primary killed (durable claims)",
    ),
    (
        "http",
        "IdempotencyLayer over real sockets, instance kills and partitions",
    ),
    (
        "throttle",
        "leading throttle across instances, latency and resets",
    ),
    (
        "rate",
        "fixed-window rate limit across instances (fail closed), latency and resets",
    ),
    (
        "debounce",
        "debounce across instances, resets and short partitions",
    ),
];

/// The lease most keys use: short, so runs and faults meet within seconds.
const LEASE: u64 = 2_000;
/// The library's default lease, for some keys (on in-process instances, never killed).
const DEFAULT_LEASE: u64 = 30_000;

/// How one key's calls look.
#[derive(Clone, Copy)]
struct Once {
    kind: OpKind,
    dups: (u64, u64),
    run: (u64, u64),
    /// Share of keys whose runs outlast their lease (renewals must hold them).
    long: f64,
    lease: u64,
    wait: u64,
    fail: f64,
    panic: f64,
    /// Duplicates arrive within this long of the first call.
    spread: u64,
    /// Share of keys at the library's default lease.
    default_lease: f64,
}

impl Once {
    fn new(kind: OpKind) -> Self {
        Self {
            kind,
            dups: (2, 4),
            run: (100, 1_500),
            long: 0.15,
            lease: LEASE,
            wait: 8_000,
            fail: 0.1,
            panic: 0.03,
            spread: 2_500,
            default_lease: 0.1,
        }
    }
}

struct Gen {
    rng: Rng,
    steps: Vec<Step>,
    ops: u64,
    keys: u64,
    name: String,
    local: usize,
    total: usize,
}

impl Gen {
    fn new(seed: u64, name: &str, local: usize, procs: usize) -> Self {
        Self {
            rng: Rng::derive(seed, name),
            steps: Vec::new(),
            ops: 0,
            keys: 0,
            name: name.to_owned(),
            local,
            total: local + procs,
        }
    }

    fn key(&mut self, tag: &str) -> String {
        self.keys += 1;
        format!("{}:{tag}{}", self.name, self.keys)
    }

    fn op_id(&mut self) -> String {
        self.ops += 1;
        format!("op{}", self.ops)
    }

    fn slot(&mut self) -> usize {
        self.rng.below(self.total)
    }

    fn proc_slot(&mut self) -> usize {
        let procs = self.total - self.local;
        if procs == 0 {
            return self.slot();
        }
        self.local + self.rng.below(procs)
    }

    fn ending(&mut self, p: &Once) -> Ending {
        if self.rng.chance(p.fail) {
            Ending::Fail
        } else if self.rng.chance(p.panic) {
            Ending::Panic
        } else {
            Ending::Ok
        }
    }

    fn call(&mut self, at_ms: u64, slot: usize, op: OpSpec) {
        self.steps.push(Step {
            at_ms,
            action: Action::Call { slot, op },
        });
    }

    fn fault(&mut self, at_ms: u64, fault: Fault) {
        self.steps.push(Step {
            at_ms,
            action: Action::Fault(fault),
        });
    }

    fn spec(&mut self, key: &str, p: &Once, lease: u64, run: u64) -> OpSpec {
        let ending = self.ending(p);
        OpSpec {
            id: self.op_id(),
            key: key.to_owned(),
            kind: p.kind,
            run_ms: run,
            lease_ms: lease,
            wait_ms: p.wait,
            ending,
            limit: 0,
        }
    }

    /// A new key with its duplicate calls from `at`.
    fn once_key(&mut self, at: u64, p: &Once) -> String {
        let key = self.key("k");
        let default = self.local > 0 && p.kind != OpKind::Http && self.rng.chance(p.default_lease);
        let lease = if default { DEFAULT_LEASE } else { p.lease };
        let dups = self.rng.range(p.dups.0, p.dups.1);
        for i in 0..dups {
            let run = if !default && self.rng.chance(p.long) {
                self.rng.range(lease * 6 / 5, lease * 2)
            } else {
                self.rng.range(p.run.0, p.run.1)
            };
            let offset = if i == 0 {
                0
            } else {
                self.rng.range(0, p.spread)
            };
            let slot = if default {
                self.rng.below(self.local)
            } else {
                self.slot()
            };
            let op = self.spec(&key, p, lease, run);
            self.call(at + offset, slot, op);
        }
        key
    }

    /// Keys every `gap` ms over `[from, until)`.
    fn once_keys(&mut self, from: u64, until: u64, gap: (u64, u64), p: &Once) {
        let mut t = from;
        while t < until {
            self.once_key(t, p);
            t += self.rng.range(gap.0, gap.1);
        }
    }

    /// Faults made by `make` one after another over `[from, until)`, `gap` apart; `make`
    /// returns the fault and how long it lasts.
    fn faults(
        &mut self,
        from: u64,
        until: u64,
        gap: (u64, u64),
        mut make: impl FnMut(&mut Self) -> (Fault, u64),
    ) {
        let mut t = from + self.rng.range(gap.0, gap.1) / 2;
        while t < until {
            let (fault, lasts) = make(self);
            if t + lasts >= until {
                break;
            }
            self.fault(t, fault);
            t += lasts + self.rng.range(gap.0, gap.1);
        }
    }

    fn finish(mut self) -> Vec<Step> {
        self.steps.sort_by_key(|s| s.at_ms);
        self.steps
    }
}

/// One of `faults` at `first`, then every `every` ms until `until`.
fn one_then_every(g: &mut Gen, first: u64, until: u64, every: u64, faults: &[Fault]) {
    let mut t = first;
    while t < until {
        let fault = faults[g.rng.below(faults.len())].clone();
        g.fault(t, fault);
        t += every + g.rng.range(0, every / 4);
    }
}

fn redis_setup(redis: RedisSetup, local: usize, procs: usize, plan: Vec<Step>) -> Setup {
    Setup {
        redis,
        postgres: false,
        idem_on_postgres: false,
        pool_size: 8,
        payload: Payload::Plain,
        http: None,
        rate: None,
        local,
        procs,
        plan,
        standing_fault: None,
    }
}

/// The setup and plan of kind `name`, running `ms` long, from `seed`.
pub(crate) fn build(name: &str, seed: u64, ms: u64) -> Option<Setup> {
    // Calls stop a little before the end, so the last ones meet the last faults; faults end
    // before the calls do.
    let calls_until = ms.saturating_sub(500);
    let faults_until = ms.saturating_sub(1_000);
    let idem = Once::new(OpKind::Idem);
    // Where the store is cut off for long, a default-lease claim whose owner gave up holds
    // its key for 30 s: the final read would wait that long. Those kinds use short leases.
    let short = Once {
        default_lease: 0.0,
        ..idem
    };
    let setup = match name {
        "baseline" => {
            let mut g = Gen::new(seed, name, 2, 2);
            g.once_keys(0, calls_until, (150, 400), &idem);
            redis_setup(RedisSetup::Node, 2, 2, g.finish())
        }
        "shutdown" => {
            let (local, procs) = (1, 3);
            let mut g = Gen::new(seed, name, local, procs);
            g.once_keys(0, calls_until, (300, 700), &idem);
            // Victims: runs on one instance process longer than the grace it is given, then
            // duplicates elsewhere once it has shut down.
            let mut t = 800;
            while t + 4_000 < faults_until {
                let slot = g.proc_slot();
                let mut keys = Vec::new();
                for i in 0..3 {
                    let key = g.key("victim");
                    let lease = if i == 0 { DEFAULT_LEASE } else { LEASE };
                    let p = Once {
                        fail: 0.0,
                        panic: 0.0,
                        ..idem
                    };
                    let run = g.rng.range(1_800, 3_000);
                    let op = g.spec(&key, &p, lease, run);
                    g.call(t, slot, op);
                    keys.push((key, lease));
                }
                let grace = g.rng.range(100, 500);
                g.fault(
                    t + 400,
                    Fault::InstanceShutdown {
                        slot,
                        grace_ms: grace,
                    },
                );
                for (key, lease) in keys {
                    for later in [1_200, 2_200, 4_000] {
                        let p = Once {
                            fail: 0.0,
                            panic: 0.0,
                            ..idem
                        };
                        let other = (slot + 1 + g.rng.below(local + procs - 1)) % (local + procs);
                        let op = g.spec(&key, &p, lease, 300);
                        g.call(t + later, other, op);
                    }
                }
                t += g.rng.range(4_500, 6_000);
            }
            redis_setup(RedisSetup::Node, local, procs, g.finish())
        }
        "oom" => {
            let mut g = Gen::new(seed, name, 2, 2);
            let p = Once {
                run: (150, 900),
                ..short
            };
            g.once_keys(0, calls_until, (80, 200), &p);
            g.faults(0, faults_until, (400, 1_200), |g| {
                let ms = g.rng.range(200, 800);
                (Fault::Oom { ms }, ms)
            });
            redis_setup(RedisSetup::Node, 2, 2, g.finish())
        }
        "acl-channels" => {
            let mut g = Gen::new(seed, name, 2, 2);
            g.once_keys(0, calls_until, (150, 400), &short);
            let mut s = redis_setup(RedisSetup::NodeNoChannels, 2, 2, g.finish());
            s.standing_fault = Some((
                "ACL user +@all ~* resetchannels (no channel rights)".to_owned(),
                FaultEffect::StoreDegraded,
            ));
            s
        }
        "pg-pool" => {
            let (local, procs) = (1, 2);
            let mut g = Gen::new(seed, name, local, procs);
            let tx = Once {
                kind: OpKind::Tx,
                fail: 0.0,
                panic: 0.0,
                ..idem
            };
            // Two long runs at once on one instance (its pool of 2 is then full), and their
            // duplicates elsewhere.
            let mut t = 0;
            while t + 1_000 < calls_until {
                let slot = g.slot();
                for _ in 0..2 {
                    let key = g.key("k");
                    let run = g.rng.range(LEASE * 3 / 2, LEASE * 5 / 2);
                    let op = g.spec(&key, &tx, LEASE, run);
                    g.call(t, slot, op);
                    for _ in 0..2 {
                        let at = t + g.rng.range(200, LEASE * 2);
                        let other = (slot + 1 + g.rng.below(local + procs - 1)) % (local + procs);
                        let op = g.spec(&key, &tx, LEASE, 300);
                        g.call(at, other, op);
                    }
                }
                t += g.rng.range(1_500, 3_000);
            }
            Setup {
                postgres: true,
                pool_size: 2,
                ..redis_setup(RedisSetup::None, local, procs, g.finish())
            }
        }
        "codec" => {
            let mut g = Gen::new(seed, name, 2, 1);
            g.once_keys(0, calls_until, (300, 700), &short);
            let tx = Once {
                kind: OpKind::Tx,
                long: 0.0,
                ..short
            };
            g.once_keys(100, calls_until, (400, 900), &tx);
            Setup {
                postgres: true,
                payload: Payload::Codec,
                ..redis_setup(RedisSetup::Node, 2, 1, g.finish())
            }
        }
        "partition" => {
            let mut g = Gen::new(seed, name, 2, 2);
            g.once_keys(0, calls_until, (150, 400), &short);
            g.faults(0, faults_until, (1_000, 2_500), |g| {
                let ms = if g.rng.chance(0.5) {
                    g.rng.range(LEASE * 3 / 10, LEASE * 7 / 10)
                } else {
                    g.rng.range(LEASE * 3 / 2, LEASE * 5 / 2)
                };
                (Fault::Partition { ms }, ms)
            });
            redis_setup(RedisSetup::Node, 2, 2, g.finish())
        }
        "latency" => {
            let mut g = Gen::new(seed, name, 2, 2);
            g.once_keys(0, calls_until, (150, 400), &idem);
            g.faults(0, faults_until, (500, 1_500), |g| {
                let ms = g.rng.range(1_000, 3_000);
                // Half slow (round trips under the 500 ms command timeout), half slower than
                // the timeout (every command times out: an outage to the client).
                let (base_ms, jitter_ms) = if g.rng.chance(0.5) {
                    (g.rng.range(20, 120), g.rng.range(0, 100))
                } else {
                    (g.rng.range(150, 300), g.rng.range(0, 200))
                };
                (
                    Fault::Latency {
                        base_ms,
                        jitter_ms,
                        ms,
                    },
                    ms,
                )
            });
            redis_setup(RedisSetup::Node, 2, 2, g.finish())
        }
        "reset" => {
            let mut g = Gen::new(seed, name, 2, 2);
            g.once_keys(0, calls_until, (150, 400), &idem);
            g.faults(0, faults_until, (400, 1_500), |_| (Fault::Reset, 0));
            redis_setup(RedisSetup::Node, 2, 2, g.finish())
        }
        "subscriber" => {
            let mut g = Gen::new(seed, name, 2, 2);
            let p = Once {
                dups: (3, 5),
                spread: 1_000,
                ..idem
            };
            g.once_keys(0, calls_until, (150, 400), &p);
            g.faults(0, faults_until, (500, 1_500), |g| {
                let ms = g.rng.range(2_000, 5_000);
                (Fault::SilenceSubscribers { ms }, ms)
            });
            redis_setup(RedisSetup::Node, 2, 2, g.finish())
        }
        "redis-kill" => {
            let mut g = Gen::new(seed, name, 2, 2);
            g.once_keys(0, calls_until, (150, 400), &short);
            g.faults(0, faults_until, (1_500, 3_000), |g| {
                let ms = g.rng.range(200, LEASE * 3 / 4);
                (Fault::RedisKill { ms }, ms + 500)
            });
            redis_setup(RedisSetup::Node, 2, 2, g.finish())
        }
        "redis-pause" => {
            let mut g = Gen::new(seed, name, 2, 2);
            g.once_keys(0, calls_until, (150, 400), &short);
            g.faults(0, faults_until, (1_500, 3_000), |g| {
                let ms = if g.rng.chance(0.5) {
                    g.rng.range(300, LEASE / 2)
                } else {
                    g.rng.range(LEASE * 3 / 2, LEASE * 2)
                };
                (Fault::RedisPause { ms }, ms)
            });
            redis_setup(RedisSetup::Node, 2, 2, g.finish())
        }
        "acl" => {
            let mut g = Gen::new(seed, name, 2, 2);
            g.once_keys(0, calls_until, (150, 400), &short);
            g.faults(0, faults_until, (1_000, 2_500), |g| {
                let ms = g.rng.range(300, LEASE * 3 / 2);
                (Fault::AclRevoke { ms }, ms)
            });
            redis_setup(RedisSetup::NodeAclUser, 2, 2, g.finish())
        }
        "instance-kill" => {
            let mut g = Gen::new(seed, name, 1, 3);
            let p = Once {
                run: (500, 2_500),
                ..idem
            };
            g.once_keys(0, calls_until, (120, 300), &p);
            g.faults(0, faults_until, (1_500, 3_000), |g| {
                let slot = g.proc_slot();
                (Fault::InstanceKill { slot }, 800)
            });
            redis_setup(RedisSetup::Node, 1, 3, g.finish())
        }
        "instance-pause" | "pg-instance-pause" => {
            let (local, procs) = (1, 3);
            let mut g = Gen::new(seed, name, local, procs);
            let p = Once {
                run: (500, 2_500),
                ..idem
            };
            g.once_keys(0, calls_until, (120, 300), &p);
            // An instance process stopped past the lease of a run it owns; a duplicate takes
            // the lapsed key over and fails by design (releasing it); then the owner resumes
            // and completes late: that completion must be refused, its caller told "not
            // recorded". Everything else the instance was running is paused too.
            let mut t = 300;
            while t + 4_500 < faults_until {
                let slot = g.proc_slot();
                let key = g.key("paused");
                let sure = Once {
                    fail: 0.0,
                    panic: 0.0,
                    default_lease: 0.0,
                    ..idem
                };
                let run = g.rng.range(800, 1_500);
                let op = g.spec(&key, &sure, LEASE, run);
                g.call(t, slot, op);
                let ms = g.rng.range(LEASE * 3 / 2 + 300, LEASE * 2 + 500);
                g.fault(t + 200, Fault::InstancePause { slot, ms });
                let other = (slot + 1 + g.rng.below(local + procs - 1)) % (local + procs);
                let failing = Once { fail: 1.0, ..sure };
                let op = g.spec(&key, &failing, LEASE, 100);
                g.call(t + 200 + LEASE + 500, other, op);
                t += ms + g.rng.range(800, 2_000);
            }
            if name == "pg-instance-pause" {
                Setup {
                    postgres: true,
                    idem_on_postgres: true,
                    ..redis_setup(RedisSetup::None, local, procs, g.finish())
                }
            } else {
                redis_setup(RedisSetup::Node, local, procs, g.finish())
            }
        }
        "pg-terminate" | "pg-read-only" | "pg-lock" | "pg-partition" => {
            let mut g = Gen::new(seed, name, 2, 1);
            g.once_keys(0, calls_until, (200, 500), &short);
            let tx = Once {
                kind: OpKind::Tx,
                ..short
            };
            g.once_keys(100, calls_until, (250, 600), &tx);
            let which = name.to_owned();
            g.faults(0, faults_until, (1_000, 2_500), move |g| {
                match which.as_str() {
                    "pg-terminate" => (Fault::PgTerminate, 200),
                    "pg-read-only" => {
                        let ms = g.rng.range(500, 2_000);
                        (Fault::PgReadOnly { ms }, ms)
                    }
                    "pg-partition" => {
                        let ms = if g.rng.chance(0.5) {
                            g.rng.range(LEASE * 3 / 10, LEASE * 7 / 10)
                        } else {
                            g.rng.range(LEASE * 3 / 2, LEASE * 5 / 2)
                        };
                        (Fault::Partition { ms }, ms)
                    }
                    _ => {
                        let ms = g.rng.range(300, 1_500);
                        (Fault::PgLock { ms }, ms)
                    }
                }
            });
            Setup {
                postgres: true,
                idem_on_postgres: true,
                ..redis_setup(RedisSetup::None, 2, 1, g.finish())
            }
        }
        "sentinel" => {
            let mut g = Gen::new(seed, name, 2, 1);
            g.once_keys(0, calls_until, (200, 500), &short);
            // A failover takes about 15 s to settle here (the old primary follows the new one
            // late): one early in the run, another every 20 s or so in longer runs.
            one_then_every(
                &mut g,
                ms / 4,
                faults_until,
                20_000,
                &[Fault::SentinelFailover, Fault::SentinelKill],
            );
            redis_setup(RedisSetup::Sentinel, 2, 1, g.finish())
        }
        "cluster" => {
            let mut g = Gen::new(seed, name, 2, 1);
            g.once_keys(0, calls_until, (150, 400), &short);
            one_then_every(
                &mut g,
                ms / 4,
                faults_until,
                8_000,
                &[Fault::ClusterFailover, Fault::ClusterKill],
            );
            redis_setup(RedisSetup::Cluster, 2, 1, g.finish())
        }
        "http" => {
            let mut g = Gen::new(seed, name, 1, 2);
            let p = Once {
                kind: OpKind::Http,
                panic: 0.0,
                ..idem
            };
            g.once_keys(0, calls_until, (150, 400), &p);
            g.faults(0, faults_until, (1_500, 3_000), |g| {
                if g.rng.chance(0.5) {
                    let slot = g.proc_slot();
                    (Fault::InstanceKill { slot }, 800)
                } else {
                    let ms = g.rng.range(LEASE * 3 / 10, LEASE * 7 / 10);
                    (Fault::Partition { ms }, ms)
                }
            });
            Setup {
                http: Some((LEASE, 8_000)),
                ..redis_setup(RedisSetup::Node, 1, 2, g.finish())
            }
        }
        "throttle" => {
            let mut g = Gen::new(seed, name, 2, 2);
            let mut t = 0;
            while t < calls_until {
                let key = g.key("t");
                let interval = g.rng.range(300, 1_500);
                let calls = g.rng.range(3, 8);
                for _ in 0..calls {
                    let at = t + g.rng.range(0, interval * 3);
                    let slot = g.slot();
                    let id = g.op_id();
                    let run_ms = g.rng.range(5, 200);
                    g.call(
                        at,
                        slot,
                        OpSpec {
                            id,
                            key: key.clone(),
                            kind: OpKind::Throttle,
                            run_ms,
                            lease_ms: interval,
                            wait_ms: 0,
                            ending: Ending::Ok,
                            limit: 0,
                        },
                    );
                }
                t += g.rng.range(100, 300);
            }
            g.faults(0, faults_until, (1_500, 3_000), |g| {
                if g.rng.chance(0.5) {
                    (Fault::Reset, 0)
                } else {
                    let ms = g.rng.range(500, 1_500);
                    (
                        Fault::Latency {
                            base_ms: 100,
                            jitter_ms: 100,
                            ms,
                        },
                        ms,
                    )
                }
            });
            redis_setup(RedisSetup::Node, 2, 2, g.finish())
        }
        "rate" => {
            let (limit, window) = (5, 1_000);
            let mut g = Gen::new(seed, name, 2, 2);
            let keys: Vec<String> = (0..4).map(|_| g.key("r")).collect();
            let mut t = 0;
            while t < calls_until {
                let key = keys[g.rng.below(keys.len())].clone();
                let slot = g.slot();
                let id = g.op_id();
                g.call(
                    t,
                    slot,
                    OpSpec {
                        id,
                        key,
                        kind: OpKind::Rate,
                        run_ms: 0,
                        lease_ms: window,
                        wait_ms: 0,
                        ending: Ending::Ok,
                        limit: u64::from(limit),
                    },
                );
                t += g.rng.range(5, 40);
            }
            g.faults(0, faults_until, (1_000, 2_500), |g| {
                if g.rng.chance(0.5) {
                    (Fault::Reset, 0)
                } else {
                    let ms = g.rng.range(500, 1_500);
                    (
                        Fault::Latency {
                            base_ms: 50,
                            jitter_ms: 150,
                            ms,
                        },
                        ms,
                    )
                }
            });
            Setup {
                rate: Some((limit, window)),
                ..redis_setup(RedisSetup::Node, 2, 2, g.finish())
            }
        }
        "debounce" => {
            let mut g = Gen::new(seed, name, 2, 2);
            let mut t = 0;
            while t < calls_until {
                let key = g.key("d");
                let delay = g.rng.range(100, 400);
                let calls = g.rng.range(2, 6);
                let mut at = t;
                for _ in 0..calls {
                    let slot = g.slot();
                    let id = g.op_id();
                    let run_ms = g.rng.range(5, 300);
                    g.call(
                        at,
                        slot,
                        OpSpec {
                            id,
                            key: key.clone(),
                            kind: OpKind::Debounce,
                            run_ms,
                            lease_ms: delay,
                            wait_ms: 0,
                            ending: Ending::Ok,
                            limit: 0,
                        },
                    );
                    at += g.rng.range(10, delay / 2);
                }
                t += g.rng.range(150, 400);
            }
            g.faults(0, faults_until, (1_500, 3_000), |g| {
                if g.rng.chance(0.5) {
                    (Fault::Reset, 0)
                } else {
                    let ms = g.rng.range(300, 1_000);
                    (Fault::Partition { ms }, ms)
                }
            });
            redis_setup(RedisSetup::Node, 2, 2, g.finish())
        }
        _ => return None,
    };
    Some(setup)
}
