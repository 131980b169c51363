//! Durable writes: a script call pipelined with `WAIT <replicas> <timeout>`, so a write is
//! acknowledged only once that many replicas of its primary have it
//! (`RedisBuilder::with_durable_claims`).
//!
//! Redis replicates asynchronously: a primary that dies right after acknowledging a write can
//! take it along, and the replica promoted in its place never saw it. `WAIT` blocks its
//! client until the replicas acknowledged every write that client made, so the script and
//! its `WAIT` go out pipelined on one connection (a `WAIT` on another connection, or after a
//! reconnection, would cover nothing), on the node that owns the script's key: a cluster
//! routes the pipeline by that key. Because `WAIT` holds up every command behind it on its
//! connection, durable writes have a connection of their own, and a breaker of their own, so
//! that calls queued behind a `WAIT` on a primary left without replicas neither slow nor fail
//! the throttles and rate limits of the same backend.

use std::time::Duration;

use redis::{FromRedisValue, Value};

use super::script::ScriptCall;
use super::{Class, Conn, Redis, RedisBuilder, ms};
use crate::store::StoreError;

/// How many replicas must acknowledge a claim or a completion, and how long to wait for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Durability {
    replicas: u32,
    timeout: Duration,
}

/// Durable claims: their setting, and the backend whose connection their writes and `WAIT`s
/// go on. Its own breaker too: claims that time out waiting behind `WAIT`s on a primary left
/// without replicas must not open the breaker of the throttles and limits.
pub(super) struct Durable {
    durability: Durability,
    twin: Redis,
}

impl Durable {
    /// `Ok` if `acknowledged` replicas are enough.
    fn check(&self, acknowledged: u32) -> Result<(), StoreError> {
        let Durability { replicas, timeout } = self.durability;
        if acknowledged >= replicas {
            return Ok(());
        }
        Err(StoreError::NotReplicated {
            wanted: replicas,
            acknowledged,
            within: timeout,
        })
    }
}

impl RedisBuilder {
    /// Durable idempotency claims: a claim and a completion are acknowledged only once
    /// `replicas` replicas of the key's primary have them (`WAIT replicas timeout` on the node
    /// that owns the key's slot), so a failover that promotes one of those replicas loses no
    /// acknowledged claim and runs no key twice. Off by default: Redis replicates
    /// asynchronously, so a primary that dies right after acknowledging a claim can take it
    /// along, and a duplicate sent to the promoted replica then runs the key again.
    ///
    /// A claim not on `replicas` replicas within `timeout` is released and refused: its caller
    /// gets [`Error::StoreUnavailable`](crate::Error::StoreUnavailable) whose source is
    /// [`StoreError::NotReplicated`], and nothing runs (idempotency fails closed). A
    /// completion not replicated in time is retried like a completion the store did not
    /// answer, until it is replicated or the claim has lapsed. A replay is answered only once
    /// the replicas have the result too (the claim that finds it touches its expiry and waits),
    /// so a caller is never handed a result that a failover then takes back; one not
    /// replicated in time is refused the same way, having run nothing.
    ///
    /// Claims and completions then go on a connection of their own, with a circuit breaker
    /// of its own (the same settings): `WAIT` holds up every command behind it on its
    /// connection, and throttles and rate limits on the same backend are neither slowed nor
    /// failed by it. A refusal for want of replicas does not count against either breaker
    /// (the primary answered). Each claim and completion waits for its replicas, about one
    /// round trip to them, in turn with the others on its node; a primary with fewer than
    /// `replicas` replicas refuses every claim, each after `timeout`, e.g. after a failover
    /// until the old primary is back as a replica.
    ///
    /// Renewals are not waited for, so the lease
    /// ([`IdempotencyOptions::with_lease`](crate::IdempotencyOptions::with_lease)) should
    /// outlast a failover (detection, election, and the clients' move to the new primary)
    /// by half again or more.
    ///
    /// [`RedisBuilder::connect`] fails with [`StoreError::Config`] if `replicas` or
    /// `timeout` is zero.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), throttlebeam::store::StoreError> {
    /// use std::time::Duration;
    /// use throttlebeam::store::Redis;
    ///
    /// // Every claim and completion on at least one replica within 250 ms.
    /// let redis = Redis::cluster(["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"])
    ///     .with_durable_claims(1, Duration::from_millis(250))
    ///     .connect()
    ///     .await?;
    /// # drop(redis);
    /// # Ok(()) }
    /// ```
    pub fn with_durable_claims(mut self, replicas: u32, timeout: Duration) -> Self {
        self.durable_claims = Some(Durability { replicas, timeout });
        self
    }

    /// Checks the durable-claims setting.
    pub(super) fn validate_durable_claims(&self) -> Result<(), StoreError> {
        match self.durable_claims {
            Some(Durability { replicas: 0, .. }) => Err(StoreError::Config(
                "durable claims need at least one replica to wait for".to_owned(),
            )),
            Some(Durability { timeout, .. }) if timeout.is_zero() => Err(StoreError::Config(
                "durable claims need a replication timeout greater than zero \
                 (WAIT with 0 would wait for ever)"
                    .to_owned(),
            )),
            _ => Ok(()),
        }
    }

    /// The connection of durable claims, if they are on: one more connection made like the
    /// main one, whose command timeout leaves room for the replicas' time.
    pub(super) async fn durable_connection(&self) -> Result<Option<Durable>, StoreError> {
        let Some(durability) = self.durable_claims else {
            return Ok(None);
        };
        let mut twin = self.clone();
        twin.durable_claims = None;
        twin.command_timeout = twin.command_timeout.saturating_add(durability.timeout);
        let redis = Box::pin(twin.connect()).await?;
        Ok(Some(Durable {
            durability,
            twin: redis,
        }))
    }
}

impl Redis {
    /// Whether durable claims are on ([`RedisBuilder::with_durable_claims`]).
    pub(crate) fn durable_claims(&self) -> bool {
        self.inner.durable.is_some()
    }

    /// Calls a script (see [`Redis::invoke`]); with durable claims on, pipelined with `WAIT`
    /// on the durable connection, and refused with [`StoreError::NotReplicated`] if `wrote`
    /// says the reply made a write that too few replicas acknowledged in time.
    pub(crate) async fn invoke_replicated<T: FromRedisValue>(
        &self,
        call: &ScriptCall<'_>,
        wrote: impl FnOnce(&T) -> bool,
    ) -> Result<T, StoreError> {
        match &self.inner.durable {
            None => self.invoke(call).await,
            Some(durable) => {
                self.replicated(Class::Refusable, call, durable, wrote)
                    .await
            }
        }
    }

    /// [`Redis::invoke_replicated`] for a call that must be tried even while the breaker is
    /// open (see [`Redis::invoke_must_try`]).
    pub(crate) async fn invoke_replicated_must_try<T: FromRedisValue>(
        &self,
        call: &ScriptCall<'_>,
        wrote: impl FnOnce(&T) -> bool,
    ) -> Result<T, StoreError> {
        match &self.inner.durable {
            None => self.invoke_must_try(call).await,
            Some(durable) => self.replicated(Class::MustTry, call, durable, wrote).await,
        }
    }

    async fn replicated<T: FromRedisValue>(
        &self,
        class: Class,
        call: &ScriptCall<'_>,
        durable: &Durable,
        wrote: impl FnOnce(&T) -> bool,
    ) -> Result<T, StoreError> {
        let (reply, acknowledged) = self.invoke_durable::<T>(class, call, durable).await?;
        if wrote(&reply) {
            durable.check(acknowledged)?;
        }
        Ok(reply)
    }

    /// Calls a script and `WAIT`s for the replicas of durable claims, pipelined on the
    /// durable connection: the script's reply and how many replicas
    /// acknowledged every write made on that connection so far. Bounded by the command
    /// timeout plus the replicas' time, guarded by the durable connection's breaker.
    async fn invoke_durable<T: FromRedisValue>(
        &self,
        class: Class,
        call: &ScriptCall<'_>,
        durable: &Durable,
    ) -> Result<(T, u32), StoreError> {
        let after = self
            .inner
            .command_timeout
            .saturating_add(durable.durability.timeout);
        // Counted here too: the backend's stats count every command it sends.
        self.inner.commands.incr();
        let replies = durable
            .twin
            .guarded_for(class, after, |conn| async move {
                match conn {
                    Conn::Single(mut c) => evaluate_durable(call, durable.durability, &mut c).await,
                    Conn::Cluster(mut c) => {
                        evaluate_durable(call, durable.durability, &mut c).await
                    }
                }
            })
            .await?;
        let (reply, acknowledged) = replies;
        let reply = T::from_redis_value(reply)
            .map_err(|e| StoreError::Protocol(format!("unexpected script reply: {e}")))?;
        Ok((reply, acknowledged))
    }
}

/// `call` pipelined with `WAIT`, as `EVALSHA` then as `EVAL` if the server does not know its
/// script: the script's reply, and how many replicas acknowledged.
async fn evaluate_durable<C>(
    call: &ScriptCall<'_>,
    durability: Durability,
    conn: &mut C,
) -> redis::RedisResult<(Value, u32)>
where
    C: redis::aio::ConnectionLike + Send,
{
    let pipe = |script: redis::Cmd| {
        let mut pipe = redis::pipe();
        pipe.ignore_errors()
            .add_command(script)
            .cmd("WAIT")
            .arg(durability.replicas)
            .arg(ms(durability.timeout));
        pipe
    };
    let refused = |replies: &[Value], code: &str| {
        replies.len() == 2 && matches!(&replies[0], Value::ServerError(e) if e.code() == code)
    };
    let mut replies: Vec<Value> = pipe(call.evalsha()).query_async(conn).await?;
    if refused(&replies, "MOVED") {
        // The slot moved (a failover): a cluster client follows a moved command and
        // refreshes its slot map, but not a reply inside a pipeline. A plain read of the key
        // makes it; then the pipeline goes to the key's new primary.
        if let Some(key) = call.first_key() {
            let moved: redis::RedisResult<Value> =
                redis::cmd("PTTL").arg(key).query_async(conn).await;
            moved?;
            replies = pipe(call.evalsha()).query_async(conn).await?;
        }
    }
    if refused(&replies, "NOSCRIPT") {
        replies = pipe(call.eval()).query_async(conn).await?;
    }
    let mut replies = replies.into_iter();
    let (Some(reply), Some(acks)) = (replies.next(), replies.next()) else {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "a script call and WAIT pipelined did not get two replies",
        )));
    };
    let reply = reply.extract_error()?;
    let acks = match acks.extract_error()? {
        Value::Int(n) => u32::try_from(n.max(0)).unwrap_or(u32::MAX),
        other => {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "WAIT did not answer an integer",
                format!("{other:?}"),
            )));
        }
    };
    Ok((reply, acks))
}
