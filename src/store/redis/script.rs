//! Script calls: `EVALSHA`, and the same call as `EVAL` with the script's text when the
//! server answers `NOSCRIPT`.
//!
//! A server that does not know a script (a first deployment, a restarted node, a flushed
//! script cache) answers `NOSCRIPT`; the call is then sent once more as `EVAL`, which runs the
//! script and leaves it in the server's cache, so the next `EVALSHA` finds it. That is one
//! extra round trip for a call that finds its script missing, on the node that serves its
//! keys, and nothing for any other call.
//!
//! It never sends `SCRIPT LOAD`. The `redis` crate's own fallback does (`SCRIPT LOAD`, then
//! `EVALSHA` again: two round trips), and in a cluster that load goes to every primary as one
//! fan-out request; the cluster client dispatches the parts of a fan-out only the next time
//! something else wakes its task, so a fan-out sent after every other reply had arrived
//! waited for the command timeout, and with it every call that waited for that load (seen
//! about once in 60 fresh clusters met by 250 calls at once). `EVAL` is routed by its keys
//! like `EVALSHA`, so a call that finds its script missing never waits on another node.

use redis::{Cmd, ToRedisArgs};

/// A Lua script: its text and its SHA-1 (what `EVALSHA` names it by).
pub(crate) struct LuaScript {
    source: String,
    hash: String,
}

impl LuaScript {
    pub(crate) fn new(source: String) -> Self {
        // The `redis` crate's digest, so the name is the one the server computes.
        let hash = redis::Script::new(&source).get_hash().to_owned();
        Self { source, hash }
    }

    /// A call of this script, to which keys and arguments are added.
    pub(crate) fn prepare_invoke(&self) -> ScriptCall<'_> {
        ScriptCall {
            script: self,
            keys: Vec::new(),
            args: Vec::new(),
        }
    }
}

/// One call of a [`LuaScript`]: its keys (`KEYS`) and arguments (`ARGV`).
pub(crate) struct ScriptCall<'s> {
    script: &'s LuaScript,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl ScriptCall<'_> {
    /// Adds a key (`KEYS[i]`).
    pub(crate) fn key<T: ToRedisArgs>(&mut self, key: T) -> &mut Self {
        key.write_redis_args(&mut self.keys);
        self
    }

    /// Adds an argument (`ARGV[i]`).
    pub(crate) fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        arg.write_redis_args(&mut self.args);
        self
    }

    /// The first key (`KEYS[1]`), if any.
    pub(crate) fn first_key(&self) -> Option<&[u8]> {
        self.keys.first().map(Vec::as_slice)
    }

    /// `EVALSHA <hash> …`.
    pub(crate) fn evalsha(&self) -> Cmd {
        self.command("EVALSHA", &self.script.hash)
    }

    /// `EVAL <source> …`, for a server that does not know the script.
    pub(crate) fn eval(&self) -> Cmd {
        self.command("EVAL", &self.script.source)
    }

    fn command(&self, name: &str, script: &str) -> Cmd {
        let bytes: usize = self.keys.iter().chain(&self.args).map(Vec::len).sum();
        let mut cmd = Cmd::with_capacity(
            3 + self.keys.len() + self.args.len(),
            name.len() + script.len() + 4 + bytes,
        );
        cmd.arg(name)
            .arg(script.as_bytes())
            .arg(self.keys.len())
            .arg(&*self.keys)
            .arg(&*self.args);
        cmd
    }
}

/// Whether `error` is the server saying it does not know the script.
pub(crate) fn is_no_script(error: &redis::RedisError) -> bool {
    error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_forms_carry_the_same_keys_and_arguments() {
        let script = LuaScript::new("return KEYS[1]".to_owned());
        let mut call = script.prepare_invoke();
        call.key("k").arg(7).arg("x");
        let packed = |cmd: Cmd| String::from_utf8(cmd.get_packed_command()).unwrap();
        assert_eq!(
            packed(call.evalsha()),
            "*6\r\n$7\r\nEVALSHA\r\n$40\r\n4a2267357833227dd98abdedb8cf24b15a986445\r\n\
             $1\r\n1\r\n$1\r\nk\r\n$1\r\n7\r\n$1\r\nx\r\n"
        );
        assert_eq!(
            packed(call.eval()),
            "*6\r\n$4\r\nEVAL\r\n$14\r\nreturn KEYS[1]\r\n$1\r\n1\r\n$1\r\nk\r\n$1\r\n7\r\n$1\r\nx\r\n"
        );
    }
}
