//! One `SCRIPT LOAD` for every call that finds a script missing at once.
//!
//! A script call is an `EVALSHA`; a server that does not know the script answers `NOSCRIPT`,
//! and the `redis` crate then sends `SCRIPT LOAD` (to every primary, in a cluster) and calls
//! again. On a cold server (a first deployment, a restarted node, a flushed script cache),
//! every call in flight gets `NOSCRIPT` at once, and each would load the script itself:
//! thousands of loads of the same script, each compiled by the server, delaying every
//! command behind them past its timeout. Here the calls of one connection that find the same
//! script missing share one load and its answer: the load in flight, or one that ended after
//! the call went out. A call that went out after the last load ended loads the script again
//! (the server may have lost its scripts since).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use redis::aio::ConnectionLike;
use redis::{Arg, Cmd, RedisFuture, RedisResult, Value};
use tokio::sync::OnceCell;

/// One load of a script: its answer once the server gave it, and when it ended.
#[derive(Default)]
struct Load {
    answer: OnceCell<RedisResult<Value>>,
    /// The tick at which it ended; 0 while in flight.
    ended_at: AtomicU64,
}

impl Load {
    /// Whether a call whose script call went out at tick `sent_at` can take this load's
    /// answer: the load is in flight, or it ended well after that call went out (so the
    /// call's `NOSCRIPT` came before it).
    fn covers(&self, sent_at: u64) -> bool {
        match self.ended_at.load(Ordering::Acquire) {
            0 => true,
            ended_at => ended_at > sent_at && matches!(self.answer.get(), Some(Ok(_))),
        }
    }
}

/// The latest load of each script on one connection, by the script's text (a handful of
/// scripts: the map stays that small).
#[derive(Default)]
pub(super) struct ScriptLoads {
    latest: Mutex<HashMap<Vec<u8>, Arc<Load>>>,
    /// Counts ended loads: a call notes it before its script call goes out.
    ticks: AtomicU64,
}

impl ScriptLoads {
    /// `conn`, with its script loads shared through `self`; call it just before the script
    /// call goes out.
    pub(super) fn on<'c, C>(&'c self, conn: &'c mut C) -> SharedLoads<'c, C> {
        SharedLoads {
            conn,
            loads: self,
            sent_at: self.ticks.load(Ordering::Acquire),
        }
    }

    /// Sends `cmd` (a `SCRIPT LOAD` of `script`) unless a load of the same script is in
    /// flight, or ended after the call that found it missing went out at `sent_at`; then
    /// answers with that load's answer.
    async fn load<C: ConnectionLike>(
        &self,
        script: &[u8],
        sent_at: u64,
        conn: &mut C,
        cmd: &Cmd,
    ) -> RedisResult<Value> {
        let load = {
            let mut latest = self.latest.lock().unwrap_or_else(PoisonError::into_inner);
            match latest.get(script) {
                Some(load) if load.covers(sent_at) => Arc::clone(load),
                _ => {
                    let load = Arc::new(Load::default());
                    latest.insert(script.to_vec(), Arc::clone(&load));
                    load
                }
            }
        };
        // A caller dropped mid-load (its timeout) hands the load to the next waiter. Only
        // the caller that sent the load marks its end.
        load.answer
            .get_or_init(|| async {
                let answer = conn.req_packed_command(cmd).await;
                let tick = self.ticks.fetch_add(1, Ordering::AcqRel) + 1;
                load.ended_at.store(tick, Ordering::Release);
                answer
            })
            .await
            .clone()
    }
}

/// A connection whose script loads go through [`ScriptLoads`]; every other command goes
/// straight through.
pub(super) struct SharedLoads<'c, C> {
    conn: &'c mut C,
    loads: &'c ScriptLoads,
    sent_at: u64,
}

impl<C: ConnectionLike + Send> ConnectionLike for SharedLoads<'_, C> {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match loaded_script(cmd) {
            Some(script) => Box::pin(self.loads.load(script, self.sent_at, &mut *self.conn, cmd)),
            None => self.conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.conn.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.conn.get_db()
    }
}

/// The script a `SCRIPT LOAD` command loads; `None` for any other command.
fn loaded_script(cmd: &Cmd) -> Option<&[u8]> {
    let mut args = cmd.args_iter();
    match (args.next(), args.next(), args.next(), args.next()) {
        (Some(Arg::Simple(name)), Some(Arg::Simple(sub)), Some(Arg::Simple(script)), None)
            if name.eq_ignore_ascii_case(b"SCRIPT") && sub.eq_ignore_ascii_case(b"LOAD") =>
        {
            Some(script)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_script_loads_are_recognised() {
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg("return 1");
        assert_eq!(loaded_script(&load), Some(&b"return 1"[..]));
        let mut lower = redis::cmd("script");
        lower.arg("load").arg("return 2");
        assert_eq!(loaded_script(&lower), Some(&b"return 2"[..]));
        let mut flush = redis::cmd("SCRIPT");
        flush.arg("FLUSH");
        assert_eq!(loaded_script(&flush), None);
        let mut get = redis::cmd("GET");
        get.arg("LOAD").arg("x");
        assert_eq!(loaded_script(&get), None);
    }
}
