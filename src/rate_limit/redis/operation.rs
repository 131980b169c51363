//! What one rate-limit operation is, as the scripts and the fresh-key path both read it: the
//! key and its arguments, what held when it was sent, and a fresh check's write. Kept apart
//! from `script.rs` (the scripts and their replies) and `fresh.rs` (the plain `SET NX`), which
//! both use these and neither the other.

use tokio::time::Instant;

use crate::rate_limit::RateLimitReply;
use crate::store::redis::script::ScriptCall;

/// One operation as the script reads it: the key and its arguments after the time.
pub(super) struct Operation {
    pub(super) key: String,
    pub(super) args: Args,
    /// For a check or a reservation whose denial this instance may answer locally: what held
    /// when it was sent (see `LocalAnswers::remember`).
    pub(super) ticket: Option<Ticket>,
    /// For a check of a key this instance has not seen holding a state: its write and reply
    /// if the key has none, sent as a plain `SET NX` before any script (see `fresh.rs`).
    pub(super) fresh: Option<Fresh>,
    /// A check tried as a fresh key (its key not known to hold a state): the script's
    /// decision on it, if it comes to that, is noted among the known keys.
    pub(super) learn: bool,
}

/// What held when a check that may be answered locally later was sent: its denial is kept
/// only if no invalidation came and the subscription stayed the same meanwhile.
#[derive(Clone, Copy)]
pub(super) struct Ticket {
    pub(super) sent: Instant,
    pub(super) epoch: u64,
    /// The live subscription (its number), if any.
    pub(super) subscription: Option<u64>,
}

/// An operation's arguments, the key aside: operations with equal ones share one set in a
/// batch.
#[derive(PartialEq, Eq)]
pub(super) struct Args {
    pub(super) op: &'static str,
    pub(super) cost: u32,
    pub(super) slack: u64,
    pub(super) kinds: String,
    pub(super) numbers: Vec<u64>,
    /// A reset's channel, where the script announces it (see `LocalAnswers`); empty for
    /// the other operations.
    pub(super) channel: String,
}

impl Args {
    /// How many arguments [`Args::push`] adds.
    pub(super) fn count(&self) -> usize {
        if self.op == "x" {
            2
        } else {
            4 + self.numbers.len()
        }
    }

    pub(super) fn push(&self, call: &mut ScriptCall<'_>) {
        if self.op == "x" {
            // A reset needs no parameters: it deletes the key and says so on its channel.
            call.arg(self.op).arg(&self.channel);
            return;
        }
        call.arg(self.op)
            .arg(self.cost)
            .arg(self.slack)
            .arg(&self.kinds);
        for n in &self.numbers {
            call.arg(n);
        }
    }
}

/// A check's write if its key has no state: the value and its life, and the reply it makes.
pub(super) struct Fresh {
    /// The state, encoded as the script stores it: the kinds, then each tier's fields and the
    /// state's rest time as little-endian doubles.
    pub(super) value: Vec<u8>,
    /// Its life in ms (`PX`), the slack included.
    pub(super) px: u64,
    /// The decision, if the `SET` takes.
    pub(super) reply: RateLimitReply,
}
