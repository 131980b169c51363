//! An instance: a runtime with its store connections, running the calls it is handed and
//! recording each one. In the harness's own process, or in a process of its own (the same
//! binary, `throttlebeam-faults worker <json config>`) that the harness can SIGKILL, SIGSTOP,
//! or tell to shut down with a short grace.
//!
//! A worker process reads JSON lines on stdin: `{"op": …}` runs a call; `{"shutdown":
//! grace_ms}` calls `Runtime::shutdown(grace)` (calls still running carry on); `{"exit":
//! within_ms}` waits for the calls in flight (at most `within_ms`) and exits. It prints
//! `ready` once its store answers.

use std::io::BufRead;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use throttlebeam::idempotency::postgres::PostgresStore;
use throttlebeam::rate_limit::{FixedWindow, Limiter};
use throttlebeam::store::Redis;
use throttlebeam::{IdempotencyOptions, Runtime, ThrottleOutcome};
use tokio::sync::Notify;

use crate::history::{Ending, Logs, OpKind, Record, now_us};
use crate::outcome::{Outcome, classify_http, classify_once, error_name};

/// How an instance reaches Redis.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RedisConfig {
    pub(crate) url: String,
    #[serde(default)]
    pub(crate) username: Option<String>,
    #[serde(default)]
    pub(crate) password: Option<String>,
    pub(crate) prefix: String,
    /// `with_durable_claims(1, 500 ms)`: claims and completions wait for a replica.
    #[serde(default)]
    pub(crate) durable: bool,
}

/// How an instance reaches PostgreSQL.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct PgConfig {
    pub(crate) url: String,
    pub(crate) table: String,
    pub(crate) effects: String,
    pub(crate) app_name: String,
    pub(crate) pool_size: usize,
}

/// The result type of the calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Payload {
    /// A `String`.
    #[default]
    Plain,
    /// A struct whose serde form needs a self-describing format (`skip_serializing_if`, a
    /// `serde_json::Value` field): what users store.
    Codec,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct InstanceConfig {
    pub(crate) id: String,
    pub(crate) dir: PathBuf,
    #[serde(default)]
    pub(crate) redis: Option<RedisConfig>,
    #[serde(default)]
    pub(crate) postgres: Option<PgConfig>,
    /// Idempotency on PostgreSQL rather than Redis.
    #[serde(default)]
    pub(crate) idem_on_postgres: bool,
    #[serde(default)]
    pub(crate) payload: Payload,
    /// Serve the HTTP layer (lease and wait timeout of its keys, ms).
    #[serde(default)]
    pub(crate) http: Option<(u64, u64)>,
    /// Rate limit: `limit` per `window_ms` (fixed windows, Redis, fail closed).
    #[serde(default)]
    pub(crate) rate: Option<(u32, u64)>,
}

/// One call to make.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct OpSpec {
    pub(crate) id: String,
    pub(crate) key: String,
    pub(crate) kind: OpKind,
    pub(crate) run_ms: u64,
    /// Lease (idempotency), interval (throttle), window (rate), delay (debounce), ms.
    pub(crate) lease_ms: u64,
    pub(crate) wait_ms: u64,
    pub(crate) ending: Ending,
    #[serde(default)]
    pub(crate) limit: u64,
}

impl OpSpec {
    /// How long the call may take: waiting, running, a lease to lapse, and the final
    /// completion's retries.
    pub(crate) fn bound_ms(&self) -> u64 {
        match self.kind {
            OpKind::Idem | OpKind::Tx | OpKind::Http => self.wait_ms + self.run_ms + self.lease_ms,
            OpKind::Throttle => self.run_ms + 1_000,
            OpKind::Rate => 1_000,
            OpKind::Debounce => self.lease_ms + self.run_ms + 4_000,
        }
    }
}

/// What a worker process is told, one per line.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Command {
    Op(OpSpec),
    Shutdown(u64),
    Exit(u64),
}

/// A value of the codec payload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct CodecValue {
    tag: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<String>,
    extra: serde_json::Value,
}

trait Value: Serialize + DeserializeOwned + Clone + Send + Sync + 'static {
    fn make(tag: &str) -> Self;
    fn tag(&self) -> String;
}

impl Value for String {
    fn make(tag: &str) -> Self {
        tag.to_owned()
    }

    fn tag(&self) -> String {
        self.clone()
    }
}

impl Value for CodecValue {
    fn make(tag: &str) -> Self {
        Self {
            tag: tag.to_owned(),
            note: None,
            extra: serde_json::json!({ "tag": tag, "n": 1 }),
        }
    }

    fn tag(&self) -> String {
        self.tag.clone()
    }
}

/// Why a user function failed, by design.
#[derive(Debug)]
struct ByDesign;

impl std::fmt::Display for ByDesign {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("failed by design")
    }
}

impl std::error::Error for ByDesign {}

/// The panic message of functions that panic by design (kept off stderr).
pub(crate) const BY_DESIGN: &str = "panicked by design";

/// Keeps the by-design panics quiet; any other panic is printed as usual.
pub(crate) fn quiet_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| info.payload().downcast_ref::<String>().map(String::as_str));
        if msg != Some(BY_DESIGN) {
            default(info);
        }
    }));
}

pub(crate) struct Instance {
    pub(crate) cfg: InstanceConfig,
    pub(crate) logs: Logs,
    pub(crate) runtime: Runtime,
    pub(crate) redis: Option<Redis>,
    pg: Option<PostgresStore>,
    limiter: Option<Limiter<FixedWindow, Redis>>,
    http: Option<(u16, HttpClient)>,
    in_flight: AtomicUsize,
    idle: Notify,
}

type HttpClient = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<bytes::Bytes>,
>;

impl Instance {
    /// Connects the stores (retrying for up to `within`) and starts the runtime.
    pub(crate) async fn start(cfg: InstanceConfig, within: Duration) -> Result<Arc<Self>, String> {
        let logs = Logs::create(&cfg.dir, &cfg.id).map_err(|e| e.to_string())?;
        let deadline = tokio::time::Instant::now() + within;
        let redis = match &cfg.redis {
            None => None,
            Some(rc) => loop {
                let mut b = Redis::builder(rc.url.clone())
                    .with_prefix(rc.prefix.clone())
                    .with_breaker(breaker());
                if rc.durable {
                    b = b.with_durable_claims(1, Duration::from_millis(500));
                }
                if let Some(u) = &rc.username {
                    b = b.with_username(u.clone());
                }
                if let Some(p) = &rc.password {
                    b = b.with_password(p.clone());
                }
                match b.connect().await {
                    Ok(r) => break Some(r),
                    Err(e) if tokio::time::Instant::now() > deadline => {
                        return Err(format!("{}: Redis did not connect: {e}", cfg.id));
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            },
        };
        let pg = match &cfg.postgres {
            None => None,
            Some(pc) => loop {
                let b = PostgresStore::builder(&pc.url)
                    .with_table(pc.table.clone())
                    .with_application_name(pc.app_name.clone())
                    .with_pool_size(pc.pool_size)
                    .with_breaker(breaker());
                match b.connect().await {
                    Ok(s) => break Some(s),
                    Err(e) if tokio::time::Instant::now() > deadline => {
                        return Err(format!("{}: PostgreSQL did not connect: {e}", cfg.id));
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            },
        };
        let mut builder = Runtime::builder().with_name(&cfg.id);
        if let Some(r) = &redis {
            builder = builder.with_redis(r.clone());
        }
        if cfg.idem_on_postgres
            && let Some(p) = &pg
        {
            builder = builder.with_postgres(p.clone());
        }
        let runtime = builder.start().await.map_err(|e| e.to_string())?;
        let limiter = match (cfg.rate, &redis) {
            (Some((limit, window_ms)), Some(r)) => Some(
                Limiter::builder(
                    FixedWindow::new(limit, Duration::from_millis(window_ms))
                        .map_err(|e| e.to_string())?,
                )
                .with_store(r.clone())
                .with_namespace("faults")
                .build(),
            ),
            _ => None,
        };
        let http = match cfg.http {
            None => None,
            Some((lease_ms, wait_ms)) => {
                Some(serve(&runtime, &logs, &cfg.id, lease_ms, wait_ms).await?)
            }
        };
        Ok(Arc::new(Self {
            cfg,
            logs,
            runtime,
            redis,
            pg,
            limiter,
            http,
            in_flight: AtomicUsize::new(0),
            idle: Notify::new(),
        }))
    }

    pub(crate) fn id(&self) -> &str {
        &self.cfg.id
    }

    /// Runs `op` in a task of its own, recording its invoke and completion.
    pub(crate) fn exec(self: &Arc<Self>, op: OpSpec) {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let me = Arc::clone(self);
        tokio::spawn(async move {
            let _ = me.call(op).await;
            if me.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
                me.idle.notify_waiters();
            }
        });
    }

    /// The value op `op` of this instance returns.
    pub(crate) fn value_of(&self, op: &str) -> String {
        format!("{}-{op}", self.cfg.id)
    }

    /// Makes the call `op` and records it; what the caller was told.
    pub(crate) async fn call(&self, op: OpSpec) -> Option<Outcome> {
        let value = self.value_of(&op.id);
        self.logs.history.append(&Record::Invoke {
            op: op.id.clone(),
            inst: self.cfg.id.clone(),
            key: op.key.clone(),
            kind: op.kind,
            t: now_us(),
            value: value.clone(),
            run_ms: op.run_ms,
            lease_ms: op.lease_ms,
            bound_ms: op.bound_ms(),
            limit: op.limit,
            ending: op.ending,
        });
        let outcome = match op.kind {
            OpKind::Idem => match self.cfg.payload {
                Payload::Plain => self.idem::<String>(&op, &value).await,
                Payload::Codec => self.idem::<CodecValue>(&op, &value).await,
            },
            OpKind::Tx => match self.cfg.payload {
                Payload::Plain => self.tx::<String>(&op, &value).await,
                Payload::Codec => self.tx::<CodecValue>(&op, &value).await,
            },
            OpKind::Http => self.http(&op, &value).await,
            OpKind::Throttle => self.throttle(&op, &value).await,
            OpKind::Rate => self.rate(&op).await,
            OpKind::Debounce => self.debounce(&op, &value).await,
        };
        self.logs.history.append(&Record::Complete {
            op: op.id.clone(),
            inst: self.cfg.id.clone(),
            key: op.key.clone(),
            t: now_us(),
            outcome: outcome.clone(),
        });
        Some(outcome)
    }

    fn options(op: &OpSpec) -> IdempotencyOptions {
        IdempotencyOptions::new()
            .with_lease(Duration::from_millis(op.lease_ms))
            .with_wait_timeout(Duration::from_millis(op.wait_ms))
            .with_ttl(Duration::from_secs(3_600))
            .with_fingerprint(format!("faults {}", op.key))
    }

    async fn idem<T: Value>(&self, op: &OpSpec, value: &str) -> Outcome {
        let f = job::<T>(self.logs.clone(), &self.cfg.id, op, value);
        let result = self
            .runtime
            .idempotency()
            .run_with(&op.key, Self::options(op), f)
            .await;
        classify_once(result, T::tag)
    }

    async fn tx<T: Value>(&self, op: &OpSpec, value: &str) -> Outcome {
        let Some(pg) = &self.pg else {
            return Outcome::NothingRan {
                why: "no PostgreSQL store configured".to_owned(),
            };
        };
        let effects = self
            .cfg
            .postgres
            .as_ref()
            .map(|p| p.effects.clone())
            .unwrap_or_default();
        let (logs, inst, key, id) = (
            self.logs.clone(),
            self.cfg.id.clone(),
            op.key.clone(),
            op.id.clone(),
        );
        let (run, ending, value) = (
            Duration::from_millis(op.run_ms),
            op.ending,
            value.to_owned(),
        );
        let result = pg
            .run_in_transaction(&op.key, Self::options(op), move |tx| {
                Box::pin(async move {
                    effect(&logs, &id, &inst, &key, None);
                    let written = tx
                        .execute(
                            &format!("INSERT INTO {effects} (key, op) VALUES ($1, $2)"),
                            &[&key, &id],
                        )
                        .await;
                    if let Err(e) = written {
                        effect(&logs, &id, &inst, &key, Some(false));
                        return Err(Box::new(e) as Box<dyn std::error::Error + Send + Sync>);
                    }
                    tokio::time::sleep(run).await;
                    finish(&logs, &id, &inst, &key, ending)?;
                    Ok(T::make(&value))
                })
            })
            .await;
        classify_once(result, T::tag)
    }

    async fn http(&self, op: &OpSpec, value: &str) -> Outcome {
        let Some((port, client)) = &self.http else {
            return Outcome::NothingRan {
                why: "no HTTP server".to_owned(),
            };
        };
        let request = hyper::Request::post(format!("http://127.0.0.1:{port}/op"))
            .header("idempotency-key", &op.key)
            .header("x-op", &op.id)
            .header("x-value", value)
            .header("x-run-ms", op.run_ms.to_string())
            .header(
                "x-ending",
                match op.ending {
                    Ending::Ok => "ok",
                    Ending::Fail => "fail",
                    Ending::Panic => "panic",
                },
            )
            .body(http_body_util::Full::new(bytes::Bytes::from(
                op.key.clone(),
            )))
            .expect("a valid request");
        let bound = Duration::from_millis(op.bound_ms() + 30_000);
        match tokio::time::timeout(bound, client.request(request)).await {
            Err(_) => Outcome::NothingRan {
                why: "HTTP client gave up".to_owned(),
            },
            Ok(Err(e)) => Outcome::NothingRan {
                why: format!("HTTP error: {e}"),
            },
            Ok(Ok(response)) => {
                use http_body_util::BodyExt;
                let status = response.status().as_u16();
                let replayed = response
                    .headers()
                    .get("idempotent-replayed")
                    .is_some_and(|v| v == "true");
                let body = match response.into_body().collect().await {
                    Ok(b) => String::from_utf8_lossy(&b.to_bytes()).into_owned(),
                    Err(e) => format!("body error: {e}"),
                };
                classify_http(status, replayed, body)
            }
        }
    }

    async fn throttle(&self, op: &OpSpec, value: &str) -> Outcome {
        let f = job::<String>(self.logs.clone(), &self.cfg.id, op, value);
        match self
            .runtime
            .throttle()
            .call(&op.key, Duration::from_millis(op.lease_ms), f)
            .await
        {
            Ok(ThrottleOutcome::Executed(v)) => Outcome::Executed { value: v },
            Ok(ThrottleOutcome::Throttled { .. }) => Outcome::Throttled,
            Err(e) => match e {
                throttlebeam::Error::Failed { .. } | throttlebeam::Error::Panicked { .. } => {
                    Outcome::RanFailed {
                        why: error_name(&e),
                    }
                }
                _ => Outcome::NothingRan {
                    why: error_name(&e),
                },
            },
        }
    }

    async fn rate(&self, op: &OpSpec) -> Outcome {
        let Some(limiter) = &self.limiter else {
            return Outcome::Denied {
                why: "no limiter".to_owned(),
            };
        };
        match limiter.check_async(&op.key).await {
            Ok(d) if d.allowed => Outcome::Allowed {
                reset_at_ms: d.reset_at_ms,
            },
            Ok(_) => Outcome::Denied {
                why: "limited".to_owned(),
            },
            // Fail closed: a store error refuses.
            Err(e) => Outcome::Denied {
                why: format!("error: {e}"),
            },
        }
    }

    async fn debounce(&self, op: &OpSpec, value: &str) -> Outcome {
        let f = job::<String>(self.logs.clone(), &self.cfg.id, op, value);
        let called = self.runtime.debounce().across_instances().call(
            &op.key,
            Duration::from_millis(op.lease_ms),
            f,
        );
        match called {
            Err(e) => Outcome::NothingRan {
                why: error_name(&e),
            },
            Ok(handle) => match handle.await {
                Ok(v) => Outcome::Debounced { value: v },
                Err(e) => Outcome::NothingRan {
                    why: error_name(&e),
                },
            },
        }
    }

    /// Waits until no call is in flight, at most `within`; whether it got there.
    pub(crate) async fn drain(&self, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let idle = self.idle.notified();
            if self.in_flight.load(Ordering::SeqCst) == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return self.in_flight.load(Ordering::SeqCst) == 0;
            }
        }
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }
}

/// The stores' circuit breaker: the default (5 failures in a row open it) with a cooldown of
/// [`crate::engine::COOLDOWN_MS`] rather than 10 s, so a run heals within seconds.
fn breaker() -> throttlebeam::store::BreakerConfig {
    throttlebeam::store::BreakerConfig::default()
        .with_cooldown(Duration::from_millis(crate::engine::COOLDOWN_MS))
}

fn effect(logs: &Logs, op: &str, inst: &str, key: &str, ok: Option<bool>) {
    logs.effects.append(&Record::Effect {
        op: op.to_owned(),
        inst: inst.to_owned(),
        key: key.to_owned(),
        t: now_us(),
        ok,
    });
}

/// Records the function's end and ends it as designed.
fn finish(logs: &Logs, op: &str, inst: &str, key: &str, ending: Ending) -> Result<(), ByDesign> {
    match ending {
        Ending::Ok => {
            effect(logs, op, inst, key, Some(true));
            Ok(())
        }
        Ending::Fail => {
            effect(logs, op, inst, key, Some(false));
            Err(ByDesign)
        }
        Ending::Panic => {
            effect(logs, op, inst, key, Some(false));
            std::panic::panic_any(BY_DESIGN);
        }
    }
}

/// The user function of a call: its first action records its start in the effect log.
fn job<T: Value>(
    logs: Logs,
    inst: &str,
    op: &OpSpec,
    value: &str,
) -> impl FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, ByDesign>> + Send>>
+ Send
+ 'static {
    let (inst, id, key, value) = (
        inst.to_owned(),
        op.id.clone(),
        op.key.clone(),
        value.to_owned(),
    );
    let (run, ending) = (Duration::from_millis(op.run_ms), op.ending);
    move || {
        Box::pin(async move {
            effect(&logs, &id, &inst, &key, None);
            tokio::time::sleep(run).await;
            finish(&logs, &id, &inst, &key, ending)?;
            Ok(T::make(&value))
        })
    }
}

/// Serves `POST /op` behind the runtime's `IdempotencyLayer` on a free loopback port.
async fn serve(
    runtime: &Runtime,
    logs: &Logs,
    inst: &str,
    lease_ms: u64,
    wait_ms: u64,
) -> Result<(u16, HttpClient), String> {
    use axum::http::{HeaderMap, StatusCode};
    use throttlebeam::http::IdempotencyLayer;
    let layer = IdempotencyLayer::builder(runtime)
        .with_options(
            IdempotencyOptions::new()
                .with_lease(Duration::from_millis(lease_ms))
                .with_wait_timeout(Duration::from_millis(wait_ms))
                .with_ttl(Duration::from_secs(3_600)),
        )
        .build()
        .map_err(|e| e.to_string())?;
    let (logs, inst) = (logs.clone(), inst.to_owned());
    let handler = move |headers: HeaderMap| {
        let (logs, inst) = (logs.clone(), inst.clone());
        async move {
            let h = |name: &str| {
                headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned()
            };
            let (op, value, key) = (h("x-op"), h("x-value"), h("idempotency-key"));
            let run = Duration::from_millis(h("x-run-ms").parse().unwrap_or(0));
            effect(&logs, &op, &inst, &key, None);
            tokio::time::sleep(run).await;
            let ending = match h("x-ending").as_str() {
                "fail" | "panic" => Ending::Fail,
                _ => Ending::Ok,
            };
            match finish(&logs, &op, &inst, &key, ending) {
                Ok(()) => (StatusCode::OK, value),
                Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, format!("failed {value}")),
            }
        }
    };
    let app = axum::Router::new()
        .route("/op", axum::routing::post(handler))
        .route_layer(layer);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .map_err(|e| e.to_string())?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    Ok((port, client))
}

/// The worker process: `throttlebeam-faults worker <json config>`.
pub(crate) fn main(config: &str) -> ! {
    quiet_panics();
    let cfg: InstanceConfig = serde_json::from_str(config).expect("a valid worker config");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async move {
        let instance = match Instance::start(cfg, Duration::from_secs(20)).await {
            Ok(i) => i,
            Err(e) => {
                eprintln!("worker failed to start: {e}");
                std::process::exit(2);
            }
        };
        println!("ready");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Command>();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                match serde_json::from_str::<Command>(&line) {
                    Ok(c) => {
                        if tx.send(c).is_err() {
                            break;
                        }
                    }
                    Err(e) => eprintln!("worker: bad command {line:?}: {e}"),
                }
            }
            // Stdin closed: the harness is gone; leave once the calls in flight end.
            let _ = tx.send(Command::Exit(60_000));
        });
        while let Some(command) = rx.recv().await {
            match command {
                Command::Op(op) => instance.exec(op),
                Command::Shutdown(grace_ms) => {
                    let runtime = instance.runtime.clone();
                    tokio::spawn(async move {
                        runtime.shutdown(Duration::from_millis(grace_ms)).await;
                    });
                }
                Command::Exit(within_ms) => {
                    instance.drain(Duration::from_millis(within_ms)).await;
                    std::process::exit(0);
                }
            }
        }
        std::process::exit(0);
    })
}
