//! The leading throttle on Redis: a window is one `SET NX PX GET` on the
//! server's clock, so every instance sharing the store agrees on who runs.

use std::future::Future;
use std::io::Write as _;
use std::time::Duration;

use super::seam::{SharedWindows, WindowOpen};
use crate::store::StoreError;
use crate::store::redis::{Redis, ms};

impl Redis {
    /// Opens the leading-throttle window of `key` for `window`, or learns
    /// how long the open one has left, in one round trip of one plain
    /// command: `SET key "<end_ms>:<token>" NX PX window GET`. Who opens is
    /// decided by the server's expiry, so instances with skewed clocks
    /// agree; the value carries the window's end on the server's clock (as
    /// estimated here, see [`Redis::sync_clock`]), so a loser reads the time
    /// left from the holder's reply without a second command.
    ///
    /// A server older than Redis 7.0 refuses `NX` with `GET`: from then on
    /// this sends `SET NX PX` and `PTTL` pipelined (still one round trip).
    /// A value that carries no end (written by an older version of this
    /// crate) costs one `PTTL` more.
    async fn open_window_now(
        &self,
        key: &str,
        window: Duration,
        token: u64,
    ) -> Result<WindowOpen, StoreError> {
        let px = ms(window);
        // Without a good estimate of the server's clock, the value carries no end: a loser
        // asks the key's `PTTL` instead.
        let now = self.server_now_ms_of(key);
        if let Some(now) = now
            && self.inner.clock.takes_set_nx_get()
        {
            let end = now.saturating_add(px);
            // The key and the value are written straight into the command's buffer, sized up
            // front: no string of their own, and no buffer grows, per decision.
            let name = WindowKey {
                prefix: self.prefix(),
                key,
            };
            let mut cmd = redis::Cmd::with_capacity(7, self.prefix().len() + key.len() + 80);
            cmd.arg("SET")
                .arg(&name)
                .arg(WindowValue { end, token })
                .arg("NX")
                .arg("PX")
                .arg(px)
                .arg("GET");
            match self.query::<Option<String>>(&cmd).await {
                Ok(None) => return Ok(WindowOpen::Opened),
                Ok(Some(held)) => {
                    return match window_end(&held) {
                        Some(end) => Ok(WindowOpen::Closed(Duration::from_millis(
                            end.saturating_sub(now).clamp(1, px),
                        ))),
                        None => self.time_left(&self.key(key, ":t")).await,
                    };
                }
                Err(StoreError::Protocol(reply)) if reply.contains("syntax") => {
                    if self.inner.clock.refuse_set_nx_get() {
                        tracing::info!(
                            %reply,
                            "Redis refuses SET with NX and GET (before 7.0): \
                             leading windows use SET NX PX and PTTL pipelined"
                        );
                    }
                }
                Err(error) => return Err(error),
            }
        }
        let key = self.key(key, ":t");
        let value = match now {
            Some(now) => window_value(now.saturating_add(px), token),
            None => token.to_string(),
        };
        let mut pipe = redis::pipe();
        pipe.cmd("SET")
            .arg(&key)
            .arg(&value)
            .arg("NX")
            .arg("PX")
            .arg(px)
            .cmd("PTTL")
            .arg(&key);
        let (opened, left): (Option<String>, i64) = self.query_pipe(&pipe).await?;
        Ok(if opened.is_some() {
            WindowOpen::Opened
        } else {
            closed_for(left)
        })
    }

    /// The time left on a window key, asked with `PTTL`.
    async fn time_left(&self, key: &str) -> Result<WindowOpen, StoreError> {
        let left: i64 = self.query(redis::cmd("PTTL").arg(key)).await?;
        Ok(closed_for(left))
    }
}

impl SharedWindows for Redis {
    fn open_window(
        &self,
        key: &str,
        window: Duration,
        token: u64,
    ) -> impl Future<Output = Result<WindowOpen, StoreError>> + Send {
        self.open_window_now(key, window, token)
    }
}

/// A leading window's key, `{<prefix>:<key>}:t` (as [`Redis::key`] makes it), written
/// into a command as one argument.
struct WindowKey<'a> {
    prefix: &'a str,
    key: &'a str,
}

impl redis::ToRedisArgs for WindowKey<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        let mut arg = out.writer_for_next_arg();
        for part in [
            b"{",
            self.prefix.as_bytes(),
            b":",
            self.key.as_bytes(),
            b"}:t",
        ] {
            // Into the command's own buffer: writing cannot fail.
            let _ = arg.write_all(part);
        }
    }
}

/// A leading window's value, `"<end_ms>:<token>"` (as [`window_value`] makes it), written
/// into a command as one argument.
struct WindowValue {
    end: u64,
    token: u64,
}

impl redis::ToRedisArgs for WindowValue {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        let (mut end, mut owner) = (itoa::Buffer::new(), itoa::Buffer::new());
        let mut arg = out.writer_for_next_arg();
        for part in [
            end.format(self.end).as_bytes(),
            b":",
            owner.format(self.token).as_bytes(),
        ] {
            let _ = arg.write_all(part);
        }
    }
}

/// A leading window's value: `"<end_ms>:<token>"`.
fn window_value(end_ms: u64, token: u64) -> String {
    let (mut end, mut owner) = (itoa::Buffer::new(), itoa::Buffer::new());
    let (end, owner) = (end.format(end_ms), owner.format(token));
    let mut value = String::with_capacity(end.len() + 1 + owner.len());
    value.push_str(end);
    value.push(':');
    value.push_str(owner);
    value
}

/// The end (ms on the server's clock) a leading window's value carries:
/// `"<end_ms>:<token>"`.
fn window_end(value: &str) -> Option<u64> {
    value.split_once(':')?.0.parse().ok()
}

/// A `PTTL` reply as a closed window; below 1 ms (the key expired between
/// the commands) it is over in 1 ms.
fn closed_for(left_ms: i64) -> WindowOpen {
    WindowOpen::Closed(Duration::from_millis(left_ms.max(1).unsigned_abs()))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::store::redis::each_server;

    #[test]
    fn the_written_key_and_value_are_the_string_forms() {
        let written = |arg: &dyn Fn(&mut redis::Cmd)| {
            let mut cmd = redis::Cmd::new();
            arg(&mut cmd);
            cmd.args_iter()
                .map(|a| match a {
                    redis::Arg::Simple(bytes) => bytes.to_vec(),
                    _ => Vec::new(),
                })
                .collect::<Vec<_>>()
        };
        let key = written(&|c: &mut redis::Cmd| {
            c.arg(WindowKey {
                prefix: "tb",
                key: "user:7",
            });
        });
        assert_eq!(key, vec![b"{tb:user:7}:t".to_vec()]);
        let value = written(&|c: &mut redis::Cmd| {
            c.arg(WindowValue {
                end: u64::MAX,
                token: 42,
            });
        });
        assert_eq!(value, vec![window_value(u64::MAX, 42).into_bytes()]);
    }

    #[test]
    fn a_window_value_carries_its_end_then_its_token() {
        assert_eq!(window_value(1_700_000_000_123, 42), "1700000000123:42");
        assert_eq!(window_value(0, 0), "0:0");
        let widest = window_value(u64::MAX, u64::MAX);
        assert_eq!(widest, format!("{}:{}", u64::MAX, u64::MAX));
        assert_eq!(window_end(&widest), Some(u64::MAX));
        assert_eq!(window_end("17:3"), Some(17));
        assert_eq!(window_end("legacy"), None);
    }

    #[tokio::test]
    async fn leading_window_opens_once_then_reports_its_time_left() {
        each_server("leading_window_opens_once", async |redis: Redis| {
            for key in ["a", "b", "c", "d"] {
                let w = Duration::from_secs(10);
                assert_eq!(
                    redis.open_window(key, w, 1).await.unwrap(),
                    WindowOpen::Opened
                );
                match redis.open_window(key, w, 2).await.unwrap() {
                    WindowOpen::Closed(left) => assert!(left > Duration::from_secs(9) && left <= w),
                    other => panic!("{other:?}"),
                }
            }
        })
        .await;
    }

    #[tokio::test]
    async fn a_lost_leading_window_reads_the_holders_end_from_one_command() {
        each_server("leading_window_end", async |redis: Redis| {
            let w = Duration::from_secs(10);
            let closed = |s: u64| WindowOpen::Closed(Duration::from_secs(s));
            redis.pin_time(1_000_000);
            assert_eq!(
                redis.open_window("e", w, 1).await.unwrap(),
                WindowOpen::Opened
            );
            // Another instance, 4 s later on the server's clock.
            redis.pin_time(1_004_000);
            let sent = redis.stats().commands;
            assert_eq!(redis.open_window("e", w, 2).await.unwrap(), closed(6));
            assert_eq!(redis.stats().commands - sent, 1, "one command");
            // A caller with a shorter window asks again after its own.
            let short = Duration::from_secs(2);
            assert_eq!(redis.open_window("e", short, 2).await.unwrap(), closed(2));
            redis.unpin_time();

            // A value carrying no end (an older version's token): one PTTL more.
            let legacy = redis.key("legacy", ":t");
            let () = redis
                .query(redis::cmd("SET").arg(&legacy).arg(1).arg("PX").arg(5000))
                .await
                .unwrap();
            let sent = redis.stats().commands;
            match redis.open_window("legacy", w, 3).await.unwrap() {
                WindowOpen::Closed(left) => {
                    assert!(left > Duration::from_secs(4) && left <= Duration::from_secs(5));
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(redis.stats().commands - sent, 2);

            // A server that refuses NX with GET (before 7.0): the pipeline.
            redis.inner.clock.refuse_set_nx_get();
            assert_eq!(
                redis.open_window("old", w, 1).await.unwrap(),
                WindowOpen::Opened
            );
            match redis.open_window("old", w, 2).await.unwrap() {
                WindowOpen::Closed(left) => assert!(left > Duration::from_secs(9) && left <= w),
                other => panic!("{other:?}"),
            }
            // What the pipeline wrote carries its end: a reader that uses
            // `GET` finds it.
            redis.inner.clock.set_nx_get.store(true, Ordering::Relaxed);
            match redis.open_window("old", w, 3).await.unwrap() {
                WindowOpen::Closed(left) => assert!(left > Duration::from_secs(8) && left <= w),
                other => panic!("{other:?}"),
            }
        })
        .await;
    }
}
