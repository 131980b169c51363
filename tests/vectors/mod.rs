//! Test vectors for every strategy, as data: the memory store and any future store (Redis)
//! must reproduce each step exactly. Times are epoch ms, starting from a fresh key (the
//! strategies keep microseconds inside; every value here is what callers see).

#![allow(dead_code, unreachable_pub)]

pub mod fixed_window;
pub mod gcra;
pub mod leaky;
pub mod sliding_window;
pub mod token_bucket;

use throttlebeam::rate_limit::{Decision, Forecast};

/// What a step does.
#[derive(Debug, Clone, Copy)]
pub enum Op {
    /// Spend this many units.
    Check(u32),
    /// Look without spending.
    Peek,
    /// Forecast requests of this cost.
    Forecast(u32),
    /// Forget the key.
    Reset,
}

/// What a step must return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    Decision(Decision),
    Forecast(Forecast),
    /// The cost exceeds what the strategy can ever admit, this capacity: an error.
    Insufficient(u64),
    /// The key was forgotten.
    Reset,
}

/// One call at one time.
#[derive(Debug, Clone, Copy)]
pub struct Step {
    pub at: u64,
    pub op: Op,
    pub expect: Expect,
}

/// A named sequence of steps against one key of one strategy.
pub struct Vector<S> {
    pub name: &'static str,
    pub strategy: fn() -> S,
    pub steps: &'static [Step],
}

pub const fn check(at: u64, cost: u32, expect: Decision) -> Step {
    Step {
        at,
        op: Op::Check(cost),
        expect: Expect::Decision(expect),
    }
}

pub const fn peek(at: u64, expect: Decision) -> Step {
    Step {
        at,
        op: Op::Peek,
        expect: Expect::Decision(expect),
    }
}

pub const fn forecast(at: u64, cost: u32, spendable: u64, next: u64, full: u64) -> Step {
    Step {
        at,
        op: Op::Forecast(cost),
        expect: Expect::Forecast(Forecast {
            spendable_now: spendable,
            next_replenish_at_ms: next,
            full_at_ms: full,
        }),
    }
}

pub const fn allow(limit: u64, remaining: u64, reset_at_ms: u64) -> Decision {
    Decision {
        allowed: true,
        limit,
        remaining,
        reset_at_ms,
        retry_after_ms: 0,
    }
}

pub const fn deny(limit: u64, remaining: u64, reset_at_ms: u64, retry_after_ms: u64) -> Decision {
    Decision {
        allowed: false,
        limit,
        remaining,
        reset_at_ms,
        retry_after_ms,
    }
}

pub const fn reset(at: u64) -> Step {
    Step {
        at,
        op: Op::Reset,
        expect: Expect::Reset,
    }
}

/// A cost the strategy can never admit: an error naming its capacity, never a denial.
pub const fn insufficient(at: u64, cost: u32, capacity: u64) -> Step {
    Step {
        at,
        op: Op::Check(cost),
        expect: Expect::Insufficient(capacity),
    }
}
