//! The checker: a pure function from the merged history, the fault timeline and what was
//! found after healing, to violations of the library's promises.
//!
//! Properties (issue #47):
//! - (a) no key's function ran twice, except the documented exceptions (counted apart): the
//!   earlier run failed or panicked; its owner was killed during it; its owner was paused, or
//!   cut off from the store, past its lease during it (and then its caller must not have been
//!   told `Fresh`); a transactional run whose transaction an injected database fault broke.
//! - (b) every `Fresh` and `Replay` of a key carries the same value, the one recorded.
//! - (c) no caller told "nothing ran" for a run that ran; no caller told `Fresh` for a value
//!   that is not the one recorded; no caller told it ran for a run that never did.
//! - (d) every call ended within its bound; calls of live instances that never ended are
//!   wedged.
//! - (e) no rate-limit window admitted more than its limit, no leading-throttle window ran
//!   twice (except while the store was faulted, plus the breaker's cooldown: fail open).
//! - (f) after healing, every key completes (the final read works), nothing is stuck.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::history::{Ending, OpKind, Record};
use crate::outcome::Outcome;

/// The instance name of the final reads made after healing.
pub(crate) const FINAL: &str = "final";

/// What an injected fault does, as far as the checker cares.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "what", rename_all = "snake_case")]
pub(crate) enum FaultEffect {
    /// The instance's process was SIGKILLed at `start`.
    InstanceKill { inst: String },
    /// The instance's process was SIGSTOPped over the span.
    InstancePause { inst: String },
    /// The instance was told `Runtime::shutdown(grace)` at `start` (not an exception).
    InstanceShutdown { inst: String },
    /// The store was unreachable or refused every command over the span (partition, server
    /// stopped or killed, rights revoked).
    StoreCut,
    /// The store answered, badly, over the span (latency, resets, OOM, a silent subscriber, a
    /// failover).
    StoreDegraded,
    /// The database broke transactions over the span (terminated backends, read-only, a lock);
    /// a long one cuts owners off like [`FaultEffect::StoreCut`].
    PgBroken,
}

/// One injected fault, as the timeline records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct FaultSpan {
    pub(crate) id: usize,
    /// What was done, for people (`"partition 3.2s"`).
    pub(crate) label: String,
    pub(crate) effect: FaultEffect,
    pub(crate) start: u64,
    pub(crate) end: u64,
}

/// What the checker is given besides the records.
#[derive(Debug, Clone, Default)]
pub(crate) struct Input {
    pub(crate) records: Vec<Record>,
    pub(crate) faults: Vec<FaultSpan>,
    /// Transactional keys: the op ids whose effect rows committed (read from the database).
    pub(crate) committed: BTreeMap<String, Vec<String>>,
    /// Problems found after healing (gauges not back to zero, a breaker stuck open).
    pub(crate) health: Vec<String>,
    /// Slack on every bound, ms (a busy 2-core machine).
    pub(crate) slack_ms: u64,
    /// How long after a store fault throttles may still fail open (the breaker's cooldown).
    pub(crate) cooldown_ms: u64,
    /// The documented error of an instance's estimate of the server clock, ms.
    pub(crate) clock_error_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub(crate) enum Property {
    A,
    B,
    C,
    D,
    E,
    F,
}

impl Property {
    pub(crate) const ALL: [Self; 6] = [Self::A, Self::B, Self::C, Self::D, Self::E, Self::F];

    pub(crate) fn letter(self) -> char {
        match self {
            Self::A => 'a',
            Self::B => 'b',
            Self::C => 'c',
            Self::D => 'd',
            Self::E => 'e',
            Self::F => 'f',
        }
    }
}

/// A documented exception to (a) or (e), counted apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub(crate) enum Exception {
    /// The earlier run failed or panicked: released by design.
    Failed,
    /// The earlier run's owner was SIGKILLed during it.
    Killed,
    /// The earlier run's owner was paused past its lease; its caller was told "not recorded".
    Paused,
    /// The store was unreachable past the earlier run's lease; its caller was told so.
    CutOff,
    /// A transactional run rolled back by an injected database fault (nothing committed).
    RolledBack,
    /// A throttle window ran twice while the store was faulted (fail open, per instance).
    FailOpen,
}

impl Exception {
    pub(crate) const ALL: [Self; 6] = [
        Self::Failed,
        Self::Killed,
        Self::Paused,
        Self::CutOff,
        Self::RolledBack,
        Self::FailOpen,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Failed => "failed",
            Self::Killed => "killed",
            Self::Paused => "paused",
            Self::CutOff => "cut-off",
            Self::RolledBack => "rolled-back",
            Self::FailOpen => "fail-open",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Violation {
    pub(crate) property: Property,
    /// The key, when the violation is about one.
    pub(crate) key: Option<String>,
    pub(crate) message: String,
    /// When it shows, µs since the epoch (for the fault timeline around it).
    pub(crate) at: u64,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Verdict {
    pub(crate) violations: Vec<Violation>,
    pub(crate) exceptions: BTreeMap<Exception, usize>,
    /// Calls made (final reads excluded).
    pub(crate) ops: usize,
    /// Calls by outcome class, for the report.
    pub(crate) outcomes: BTreeMap<String, usize>,
}

impl Verdict {
    pub(crate) fn count(&self, p: Property) -> usize {
        self.violations.iter().filter(|v| v.property == p).count()
    }
}

/// One call, put together from its records.
#[derive(Debug, Clone, Default)]
struct Call {
    op: String,
    inst: String,
    key: String,
    kind: Option<OpKind>,
    value: String,
    lease_ms: u64,
    bound_ms: u64,
    limit: u64,
    ending: Ending,
    invoked: Option<u64>,
    completed: Option<(u64, Outcome)>,
    started: Option<(u64, String)>,
    ended: Option<(u64, bool)>,
}

impl Call {
    fn outcome(&self) -> Option<&Outcome> {
        self.completed.as_ref().map(|(_, o)| o)
    }

    fn is_final(&self) -> bool {
        self.inst == FINAL
    }
}

thread_local! {
    /// The time messages are relative to: the first record's.
    static BASE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A time in a message: seconds from the start of the history.
fn ms(us: u64) -> String {
    let base = BASE.with(std::cell::Cell::get);
    format!("+{:.3}s", us.saturating_sub(base) as f64 / 1e6)
}

/// Checks `input`; see the module docs.
pub(crate) fn check(input: &Input) -> Verdict {
    BASE.with(|b| b.set(input.records.first().map_or(0, Record::t)));
    let mut calls: BTreeMap<String, Call> = BTreeMap::new();
    for r in &input.records {
        let call = calls.entry(r.op().to_owned()).or_default();
        call.op = r.op().to_owned();
        call.key = r.key().to_owned();
        match r {
            Record::Invoke {
                inst,
                kind,
                t,
                value,
                lease_ms,
                bound_ms,
                limit,
                ending,
                ..
            } => {
                call.inst.clone_from(inst);
                call.kind = Some(*kind);
                call.value.clone_from(value);
                call.lease_ms = *lease_ms;
                call.bound_ms = *bound_ms;
                call.limit = *limit;
                call.ending = *ending;
                call.invoked = Some(*t);
            }
            Record::Complete {
                inst, t, outcome, ..
            } => {
                call.inst.clone_from(inst);
                call.completed = Some((*t, outcome.clone()));
            }
            Record::Effect { inst, t, ok, .. } => match ok {
                None => call.started = Some((*t, inst.clone())),
                Some(ok) => call.ended = Some((*t, *ok)),
            },
        }
    }
    let mut verdict = Verdict::default();
    for call in calls.values() {
        if !call.is_final() && call.invoked.is_some() {
            verdict.ops += 1;
            let class = match call.outcome() {
                None => "pending".to_owned(),
                Some(o) => o.short().split(['(', '[']).next().unwrap_or("").to_owned(),
            };
            *verdict.outcomes.entry(class).or_default() += 1;
        }
    }
    let mut by_key: BTreeMap<&str, Vec<&Call>> = BTreeMap::new();
    for call in calls.values() {
        by_key.entry(call.key.as_str()).or_default().push(call);
    }
    for (key, calls) in &by_key {
        let kind = calls.iter().find_map(|c| c.kind);
        match kind {
            Some(k) if k.is_once() => check_once(input, key, k, calls, &mut verdict),
            Some(OpKind::Throttle) => check_throttle(input, key, calls, &mut verdict),
            Some(OpKind::Rate) => check_rate(input, key, calls, &mut verdict),
            Some(OpKind::Debounce) => check_debounce(input, key, calls, &mut verdict),
            _ => {}
        }
    }
    check_bounds(input, &calls, &mut verdict);
    for problem in &input.health {
        verdict.violations.push(Violation {
            property: Property::F,
            key: None,
            message: problem.clone(),
            at: input.records.last().map_or(0, Record::t),
        });
    }
    verdict
}

/// What the key held when the final read looked: `Some(value)` for a recorded result, `None`
/// when the final read ran its own function (nothing was recorded); `Err` when it failed.
fn recorded(calls: &[&Call]) -> Result<Option<String>, String> {
    // The last attempt decides (earlier ones may have met a store still recovering).
    let Some(fin) = calls
        .iter()
        .filter(|c| c.is_final())
        .max_by_key(|c| c.invoked)
    else {
        return Err("no final read was made".to_owned());
    };
    match fin.outcome() {
        Some(Outcome::Replay { value }) => Ok(Some(value.clone())),
        Some(Outcome::Fresh { .. }) => Ok(None),
        Some(other) => Err(format!("the final read got {}", other.short())),
        None => Err("the final read never ended (wedged)".to_owned()),
    }
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 <= b.1 && b.0 <= a.1
}

fn check_once(input: &Input, key: &str, kind: OpKind, calls: &[&Call], verdict: &mut Verdict) {
    let mut push = |property, message: String, at| {
        verdict.violations.push(Violation {
            property,
            key: Some(key.to_owned()),
            message,
            at,
        });
    };
    let last_t = calls
        .iter()
        .filter_map(|c| c.completed.as_ref().map(|(t, _)| *t).or(c.invoked))
        .max()
        .unwrap_or(0);
    // (f) the key completes after healing.
    let held = match recorded(calls) {
        Ok(held) => Some(held),
        Err(why) => {
            push(Property::F, format!("{key}: {why}"), last_t);
            None
        }
    };
    let value_of: BTreeMap<&str, &Call> = calls.iter().map(|c| (c.value.as_str(), *c)).collect();
    let committed: Option<BTreeSet<&str>> = (kind == OpKind::Tx).then(|| {
        input
            .committed
            .get(key)
            .map(|v| v.iter().map(String::as_str).collect())
            .unwrap_or_default()
    });
    // (a) runs in the order they started; each but the last must be excused.
    let mut runs: Vec<&Call> = calls
        .iter()
        .copied()
        .filter(|c| c.started.is_some())
        .collect();
    runs.sort_by_key(|c| c.started.as_ref().map(|s| s.0));
    for pair in runs.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        match excuse(input, a, b) {
            Ok(e) => *verdict.exceptions.entry(e).or_default() += 1,
            Err(why) => {
                let b_start = b.started.as_ref().map_or(0, |s| s.0);
                verdict.violations.push(Violation {
                    property: Property::A,
                    key: Some(key.to_owned()),
                    message: format!(
                        "{key}: ran twice: {} on {} (started {}, told {}) then {} on {} (started \
                         {}); {why}",
                        a.op,
                        a.inst,
                        ms(a.started.as_ref().map_or(0, |s| s.0)),
                        a.outcome().map_or("nothing yet".to_owned(), Outcome::short),
                        b.op,
                        b.inst,
                        ms(b_start),
                    ),
                    at: b_start,
                });
            }
        }
    }
    let mut push = |property, message: String, at| {
        verdict.violations.push(Violation {
            property,
            key: Some(key.to_owned()),
            message,
            at,
        });
    };
    if let Some(committed) = &committed
        && committed.len() > 1
    {
        push(
            Property::A,
            format!(
                "{key}: {} transactional effects committed: {committed:?}",
                committed.len()
            ),
            last_t,
        );
    }
    // (b) and (c), call by call.
    let mut fresh_values: Vec<(&str, &str)> = Vec::new();
    for c in calls {
        let Some((t, outcome)) = &c.completed else {
            continue;
        };
        let ran = match &committed {
            // A transactional run "ran" when its effect committed; its function may have run
            // and rolled back, which is nothing to its caller.
            Some(set) => set.contains(c.op.as_str()),
            None => c.started.is_some(),
        };
        let told = outcome.short();
        if c.is_final() {
            continue;
        }
        let says_ran = matches!(
            outcome,
            Outcome::Fresh { .. } | Outcome::RanFailed { .. } | Outcome::RanNotRecorded { .. }
        );
        if matches!(outcome, Outcome::NothingRan { .. }) && ran {
            push(
                Property::C,
                format!(
                    "{key}: {} on {} was told {told}, but its run ran",
                    c.op, c.inst
                ),
                *t,
            );
        } else if says_ran && c.started.is_none() {
            push(
                Property::C,
                format!(
                    "{key}: {} on {} was told {told}, but its function never ran",
                    c.op, c.inst
                ),
                *t,
            );
        }
        match outcome {
            Outcome::Fresh { value } => {
                fresh_values.push((c.op.as_str(), value.as_str()));
                if let Some(held) = &held
                    && held.as_deref() != Some(value.as_str())
                {
                    push(
                        Property::C,
                        format!(
                            "{key}: {} on {} was told {told}, but the key holds {}",
                            c.op,
                            c.inst,
                            held.as_deref().unwrap_or("no result")
                        ),
                        *t,
                    );
                }
            }
            Outcome::Replay { value } => {
                if let Some(held) = &held
                    && held.as_deref() != Some(value.as_str())
                {
                    push(
                        Property::B,
                        format!(
                            "{key}: {} on {} replayed {value}, but the key holds {}",
                            c.op,
                            c.inst,
                            held.as_deref().unwrap_or("no result")
                        ),
                        *t,
                    );
                }
                if value_of
                    .get(value.as_str())
                    .is_none_or(|o| o.started.is_none())
                {
                    push(
                        Property::B,
                        format!(
                            "{key}: {} replayed {value}, a value no run of the key produced",
                            c.op
                        ),
                        *t,
                    );
                }
            }
            // "Unconfirmed" says the store may hold the value or not: either is the truth.
            Outcome::RanNotRecorded { why, .. } if !why.contains("Unconfirmed") => {
                if let Some(Some(held)) = &held
                    && *held == c.value
                {
                    push(
                        Property::C,
                        format!(
                            "{key}: {} on {} was told {told}, but its value {held} is recorded",
                            c.op, c.inst
                        ),
                        *t,
                    );
                }
            }
            _ => {}
        }
    }
    // (b) two callers told Fresh with different values.
    for pair in fresh_values.windows(2) {
        if pair[0].1 != pair[1].1 {
            push(
                Property::B,
                format!(
                    "{key}: two callers were told Fresh with different values: {} got {}, {} got {}",
                    pair[0].0, pair[0].1, pair[1].0, pair[1].1
                ),
                last_t,
            );
        }
    }
}

/// Why run `a` may be followed by run `b` of the same key, or why not.
fn excuse(input: &Input, a: &Call, b: &Call) -> Result<Exception, String> {
    let a_start = a.started.as_ref().map_or(0, |s| s.0);
    let b_start = b.started.as_ref().map_or(0, |s| s.0);
    let slack = input.slack_ms * 1000;
    let lease = a.lease_ms * 1000;
    // The span over which `a` was live: from its start to its caller's answer (or forever).
    let a_until = a.completed.as_ref().map_or(u64::MAX, |(t, _)| *t);
    let mut late_failure = None;
    if let Some((end, false)) = a.ended {
        // Released by its failure: the next run may start once it failed (a little clock
        // jitter between processes allowed). A failure after the next run started needs
        // another excuse (its owner was paused or cut off meanwhile, say).
        if b_start + 2_000 >= end {
            return Ok(Exception::Failed);
        }
        late_failure = Some(end);
    }
    let told_fresh = matches!(a.outcome(), Some(Outcome::Fresh { .. }));
    for f in &input.faults {
        let long = f.end - f.start >= lease / 2;
        let during = overlaps((f.start, f.end), (a_start, a_until)) && b_start >= f.start;
        match &f.effect {
            FaultEffect::InstanceKill { inst }
                if *inst == a.inst
                    && f.start >= a_start
                    && a.completed.is_none()
                    && b_start >= f.start =>
            {
                return Ok(Exception::Killed);
            }
            FaultEffect::InstancePause { inst } if *inst == a.inst && during && long => {
                if told_fresh {
                    return Err(format!(
                        "its owner was paused past its lease ({}), but its late completion was \
                         accepted: its caller was told Fresh",
                        f.label
                    ));
                }
                return Ok(Exception::Paused);
            }
            FaultEffect::PgBroken if a.kind == Some(OpKind::Tx) => {
                let committed = input
                    .committed
                    .get(&a.key)
                    .is_some_and(|v| v.contains(&a.op));
                if !committed
                    && !told_fresh
                    && overlaps((f.start, f.end + slack), (a_start, a_until))
                {
                    return Ok(Exception::RolledBack);
                }
            }
            // A database refusing writes (read-only, locked) cuts the owner off too.
            FaultEffect::StoreCut | FaultEffect::PgBroken if during && long => {
                if told_fresh {
                    return Err(format!(
                        "the store was cut off past its lease ({}), but its caller was told Fresh",
                        f.label
                    ));
                }
                return Ok(Exception::CutOff);
            }
            _ => {}
        }
    }
    let mut why = match a.outcome() {
        None => "no fault explains it (the first never answered)".to_owned(),
        Some(o) => format!("no fault explains it (the first was told {})", o.short()),
    };
    if let Some(end) = late_failure {
        why.push_str(&format!(
            "; the first failed at {}, after the second had started",
            ms(end)
        ));
    }
    Err(why)
}

fn check_throttle(input: &Input, key: &str, calls: &[&Call], verdict: &mut Verdict) {
    for c in calls {
        let Some((t, outcome)) = &c.completed else {
            continue;
        };
        let lie = match outcome {
            Outcome::Executed { .. } | Outcome::RanFailed { .. } => c.started.is_none(),
            Outcome::Throttled | Outcome::NothingRan { .. } => c.started.is_some(),
            _ => false,
        };
        if lie {
            verdict.violations.push(Violation {
                property: Property::C,
                key: Some(key.to_owned()),
                message: format!(
                    "{key}: {} on {} was told {}, but its function {}",
                    c.op,
                    c.inst,
                    outcome.short(),
                    if c.started.is_some() {
                        "ran"
                    } else {
                        "never ran"
                    }
                ),
                at: *t,
            });
        }
    }
    let mut runs: Vec<&Call> = calls
        .iter()
        .copied()
        .filter(|c| c.started.is_some())
        .collect();
    runs.sort_by_key(|c| c.started.as_ref().map(|s| s.0));
    for pair in runs.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        let (Some(ia), Some((tb, _))) = (a.invoked, b.started.as_ref()) else {
            continue;
        };
        let window_end = ia + a.lease_ms * 1000;
        // A window opens no earlier than its call was made; the next run needs it expired.
        if *tb + 5_000 >= window_end {
            continue;
        }
        if store_faulted(input, (ia, *tb)) {
            *verdict.exceptions.entry(Exception::FailOpen).or_default() += 1;
            continue;
        }
        verdict.violations.push(Violation {
            property: Property::E,
            key: Some(key.to_owned()),
            message: format!(
                "{key}: throttle window of {} (called {}, {} ms) ran again: {} on {} started {}",
                a.op,
                ms(ia),
                a.lease_ms,
                b.op,
                b.inst,
                ms(*tb)
            ),
            at: *tb,
        });
    }
}

/// Whether a store fault (plus the breaker's cooldown) overlaps `span`: throttles and debounce
/// fail open then, deciding per instance.
fn store_faulted(input: &Input, span: (u64, u64)) -> bool {
    let cooldown = (input.cooldown_ms + input.slack_ms) * 1000;
    input.faults.iter().any(|f| {
        matches!(f.effect, FaultEffect::StoreCut | FaultEffect::StoreDegraded)
            && overlaps((f.start, f.end + cooldown), span)
    })
}

/// A debounce key of the workload is one burst (its calls come closer together than the
/// delay): one run across every instance, and every caller gets that run's value.
fn check_debounce(input: &Input, key: &str, calls: &[&Call], verdict: &mut Verdict) {
    let runs: Vec<&Call> = calls
        .iter()
        .copied()
        .filter(|c| c.started.is_some())
        .collect();
    let first = calls.iter().filter_map(|c| c.invoked).min().unwrap_or(0);
    let last = calls
        .iter()
        .filter_map(|c| c.completed.as_ref().map(|(t, _)| *t).or(c.invoked))
        .max()
        .unwrap_or(first);
    if runs.len() > 1 {
        if store_faulted(input, (first, last)) {
            *verdict.exceptions.entry(Exception::FailOpen).or_default() += 1;
        } else {
            verdict.violations.push(Violation {
                property: Property::E,
                key: Some(key.to_owned()),
                message: format!(
                    "{key}: one burst ran {} times: {}",
                    runs.len(),
                    runs.iter()
                        .map(|r| format!("{} on {}", r.op, r.inst))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                at: runs[1].started.as_ref().map_or(0, |s| s.0),
            });
        }
    }
    for c in calls {
        if let Some((t, Outcome::Debounced { value })) = &c.completed
            && !runs.iter().any(|r| r.value == *value)
        {
            verdict.violations.push(Violation {
                property: Property::B,
                key: Some(key.to_owned()),
                message: format!(
                    "{key}: {} on {} got {value}, the value of no run of the burst",
                    c.op, c.inst
                ),
                at: *t,
            });
        }
    }
}

fn check_rate(input: &Input, key: &str, calls: &[&Call], verdict: &mut Verdict) {
    let err = input.clock_error_ms * 1000;
    let mut counted: BTreeMap<u64, Vec<&str>> = BTreeMap::new();
    let mut window_us = 0;
    let mut limit = 0;
    for c in calls {
        let (Some(i), Some((t, Outcome::Allowed { .. }))) = (c.invoked, &c.completed) else {
            continue;
        };
        window_us = c.lease_ms * 1000;
        limit = c.limit;
        if window_us == 0 {
            continue;
        }
        let (lo, hi) = (i.saturating_sub(err), t + err);
        if lo / window_us == hi / window_us {
            counted.entry(lo / window_us).or_default().push(&c.op);
        }
    }
    for (w, ops) in counted {
        if ops.len() as u64 > limit {
            verdict.violations.push(Violation {
                property: Property::E,
                key: Some(key.to_owned()),
                message: format!(
                    "{key}: the window [{}, {}) admitted {} calls, limit {limit}: {}",
                    ms(w * window_us),
                    ms((w + 1) * window_us),
                    ops.len(),
                    ops.join(", ")
                ),
                at: w * window_us,
            });
        }
    }
}

fn check_bounds(input: &Input, calls: &BTreeMap<String, Call>, verdict: &mut Verdict) {
    let slack = input.slack_ms * 1000;
    for c in calls.values() {
        let Some(invoked) = c.invoked else {
            continue;
        };
        let paused = |until: u64| -> u64 {
            input
                .faults
                .iter()
                .filter(
                    |f| matches!(&f.effect, FaultEffect::InstancePause { inst } if *inst == c.inst),
                )
                .map(|f| f.end.min(until).saturating_sub(f.start.max(invoked)))
                .sum()
        };
        match &c.completed {
            Some((t, outcome)) => {
                let took = t.saturating_sub(invoked);
                let bound = c.bound_ms * 1000 + slack + paused(*t);
                if took > bound {
                    verdict.violations.push(Violation {
                        property: Property::D,
                        key: Some(c.key.clone()),
                        message: format!(
                            "{}: {} on {} took {} (bound {}), told {}",
                            c.key,
                            c.op,
                            c.inst,
                            ms(took),
                            ms(bound),
                            outcome.short()
                        ),
                        at: *t,
                    });
                }
            }
            None => {
                let killed = input.faults.iter().any(|f| {
                    matches!(&f.effect, FaultEffect::InstanceKill { inst } if *inst == c.inst)
                        && f.start >= invoked
                });
                if !killed && !c.is_final() {
                    verdict.violations.push(Violation {
                        property: Property::D,
                        key: Some(c.key.clone()),
                        message: format!(
                            "{}: {} on {} (called {}) never ended: wedged",
                            c.key,
                            c.op,
                            c.inst,
                            ms(invoked)
                        ),
                        at: invoked,
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A little language for hand-made histories.
    struct H {
        records: Vec<Record>,
        faults: Vec<FaultSpan>,
        committed: BTreeMap<String, Vec<String>>,
    }

    const S: u64 = 1_000_000;

    impl H {
        fn new() -> Self {
            Self {
                records: Vec::new(),
                faults: Vec::new(),
                committed: BTreeMap::new(),
            }
        }

        fn invoke(&mut self, op: &str, inst: &str, key: &str, t: u64) -> &mut Self {
            self.invoke_kind(op, inst, key, t, OpKind::Idem, 2_000, 0)
        }

        #[allow(clippy::too_many_arguments)]
        fn invoke_kind(
            &mut self,
            op: &str,
            inst: &str,
            key: &str,
            t: u64,
            kind: OpKind,
            lease_ms: u64,
            limit: u64,
        ) -> &mut Self {
            self.records.push(Record::Invoke {
                op: op.into(),
                inst: inst.into(),
                key: key.into(),
                kind,
                t,
                value: format!("v-{op}"),
                run_ms: 500,
                lease_ms,
                bound_ms: 10_000,
                limit,
                ending: Ending::Ok,
            });
            self
        }

        fn effect(
            &mut self,
            op: &str,
            inst: &str,
            key: &str,
            t: u64,
            ok: Option<bool>,
        ) -> &mut Self {
            self.records.push(Record::Effect {
                op: op.into(),
                inst: inst.into(),
                key: key.into(),
                t,
                ok,
            });
            self
        }

        fn complete(
            &mut self,
            op: &str,
            inst: &str,
            key: &str,
            t: u64,
            outcome: Outcome,
        ) -> &mut Self {
            self.records.push(Record::Complete {
                op: op.into(),
                inst: inst.into(),
                key: key.into(),
                t,
                outcome,
            });
            self
        }

        /// A whole call that ran: invoke, effect start and end, completion.
        fn ran(&mut self, op: &str, inst: &str, key: &str, t: u64, outcome: Outcome) -> &mut Self {
            let ok = !matches!(outcome, Outcome::RanFailed { .. });
            self.invoke(op, inst, key, t)
                .effect(op, inst, key, t + 1_000, None)
                .effect(op, inst, key, t + S / 2, Some(ok))
                .complete(op, inst, key, t + S / 2 + 1_000, outcome)
        }

        fn replayed(&mut self, op: &str, inst: &str, key: &str, t: u64, value: &str) -> &mut Self {
            self.invoke(op, inst, key, t).complete(
                op,
                inst,
                key,
                t + 1_000,
                Outcome::Replay {
                    value: value.into(),
                },
            )
        }

        /// The final read after healing: a replay of `value`, or its own fresh run.
        fn final_read(&mut self, key: &str, t: u64, value: Option<&str>) -> &mut Self {
            let op = format!("final:{key}");
            match value {
                Some(v) => self.replayed(&op, FINAL, key, t, v),
                None => self.ran(&op, FINAL, key, t, fresh(&format!("v-{op}"))),
            }
        }

        fn fault(&mut self, effect: FaultEffect, start: u64, end: u64) -> &mut Self {
            let id = self.faults.len();
            self.faults.push(FaultSpan {
                id,
                label: format!("{effect:?}"),
                effect,
                start,
                end,
            });
            self
        }

        fn check(&self) -> Verdict {
            let mut records = self.records.clone();
            records.sort_by_key(Record::t);
            check(&Input {
                records,
                faults: self.faults.clone(),
                committed: self.committed.clone(),
                health: Vec::new(),
                slack_ms: 3_000,
                cooldown_ms: 10_000,
                clock_error_ms: 50,
            })
        }
    }

    fn fresh(v: &str) -> Outcome {
        Outcome::Fresh { value: v.into() }
    }

    fn counts(v: &Verdict) -> [usize; 6] {
        Property::ALL.map(|p| v.count(p))
    }

    #[test]
    fn a_clean_history_has_no_violation() {
        let mut h = H::new();
        h.ran("op1", "i1", "k", S, fresh("v-op1"))
            .replayed("op2", "w1", "k", 2 * S, "v-op1")
            .final_read("k", 9 * S, Some("v-op1"));
        let v = h.check();
        assert_eq!(v.violations, vec![]);
        assert_eq!(v.ops, 2);
    }

    #[test]
    fn a_double_run_is_a_violation_of_a() {
        let mut h = H::new();
        h.ran("op1", "i1", "k", S, fresh("v-op1"))
            .ran("op2", "w1", "k", 3 * S, fresh("v-op2"))
            .final_read("k", 9 * S, Some("v-op2"));
        let v = h.check();
        assert_eq!(v.count(Property::A), 1, "{:#?}", v.violations);
        // op1 was told Fresh for a value that is not recorded; two Fresh values differ.
        assert_eq!(v.count(Property::C), 1, "{:#?}", v.violations);
        assert_eq!(v.count(Property::B), 1, "{:#?}", v.violations);
    }

    #[test]
    fn a_wrong_replay_value_is_a_violation_of_b() {
        let mut h = H::new();
        h.ran("op1", "i1", "k", S, fresh("v-op1"))
            .replayed("op2", "w1", "k", 2 * S, "v-op9")
            .final_read("k", 9 * S, Some("v-op1"));
        let v = h.check();
        // Not the recorded value, and no run of the key produced it.
        assert_eq!(counts(&v), [0, 2, 0, 0, 0, 0], "{:#?}", v.violations);
    }

    #[test]
    fn told_nothing_ran_though_it_ran_is_a_violation_of_c() {
        let mut h = H::new();
        h.ran(
            "op1",
            "i1",
            "k",
            S,
            Outcome::NothingRan {
                why: "StoreUnavailable".into(),
            },
        )
        .replayed("op2", "w1", "k", 2 * S, "v-op1")
        .final_read("k", 9 * S, Some("v-op1"));
        let v = h.check();
        assert_eq!(counts(&v), [0, 0, 1, 0, 0, 0], "{:#?}", v.violations);
        assert!(v.violations[0].message.contains("StoreUnavailable"));
    }

    #[test]
    fn told_fresh_for_a_value_not_recorded_is_a_violation_of_c() {
        let mut h = H::new();
        // op1 is told Fresh; the final read finds nothing recorded (and runs its own).
        h.ran("op1", "i1", "k", S, fresh("v-op1"))
            .final_read("k", 9 * S, None);
        let v = h.check();
        // (c) the false Fresh; (a) the final read ran the key again with no excuse.
        assert_eq!(v.count(Property::C), 1, "{:#?}", v.violations);
        assert_eq!(v.count(Property::A), 1, "{:#?}", v.violations);
    }

    #[test]
    fn told_not_recorded_for_a_recorded_value_is_c_unless_it_said_unconfirmed() {
        let not_recorded = |why: &str| Outcome::RanNotRecorded {
            value: Some("v-op1".into()),
            why: why.into(),
        };
        // "Refused until the lapse": a definite no, false if the value is recorded.
        let mut h = H::new();
        h.ran(
            "op1",
            "i1",
            "k",
            S,
            not_recorded("Unrecorded(StoreUnavailable)"),
        )
        .final_read("k", 9 * S, Some("v-op1"));
        let v = h.check();
        assert_eq!(counts(&v), [0, 0, 1, 0, 0, 0], "{:#?}", v.violations);
        // "No answer, a write may still land": recorded or not, both are true.
        let mut h = H::new();
        h.ran("op1", "i1", "k", S, not_recorded("Unrecorded(Unconfirmed)"))
            .final_read("k", 9 * S, Some("v-op1"));
        let v = h.check();
        assert_eq!(counts(&v), [0, 0, 0, 0, 0, 0], "{:#?}", v.violations);
    }

    #[test]
    fn a_wedged_call_and_a_slow_call_are_violations_of_d() {
        let mut h = H::new();
        h.ran("op1", "i1", "k", S, fresh("v-op1"))
            .invoke("op2", "w1", "k", 2 * S)
            .invoke("op3", "w2", "k", 2 * S)
            .complete(
                "op3",
                "w2",
                "k",
                40 * S,
                Outcome::Replay {
                    value: "v-op1".into(),
                },
            )
            .final_read("k", 41 * S, Some("v-op1"));
        let v = h.check();
        assert_eq!(counts(&v), [0, 0, 0, 2, 0, 0], "{:#?}", v.violations);
        assert!(v.violations.iter().any(|x| x.message.contains("wedged")));
        // A call of a killed instance that never ended is not wedged.
        h.fault(
            FaultEffect::InstanceKill { inst: "w1".into() },
            3 * S,
            3 * S,
        );
        assert_eq!(counts(&h.check()), [0, 0, 0, 1, 0, 0]);
    }

    #[test]
    fn an_over_admitted_window_is_a_violation_of_e() {
        let mut h = H::new();
        for (i, inst) in ["i1", "w1", "w2", "i2"].iter().enumerate() {
            let op = format!("r{i}");
            let t = 10 * S + 100_000 + i as u64 * 100_000;
            h.invoke_kind(&op, inst, "rate:k", t, OpKind::Rate, 1_000, 3)
                .complete(
                    &op,
                    inst,
                    "rate:k",
                    t + 2_000,
                    Outcome::Allowed {
                        reset_at_ms: 11_000,
                    },
                );
        }
        let v = h.check();
        assert_eq!(counts(&v), [0, 0, 0, 0, 1, 0], "{:#?}", v.violations);
        // Straddling a window's edge, a decision counts nowhere: no violation.
        let mut h = H::new();
        for (i, inst) in ["i1", "w1", "w2", "i2"].iter().enumerate() {
            let op = format!("r{i}");
            let t = 10 * S + 990_000 + i as u64 * 1_000;
            h.invoke_kind(&op, inst, "rate:k", t, OpKind::Rate, 1_000, 3)
                .complete(
                    &op,
                    inst,
                    "rate:k",
                    t + 2_000,
                    Outcome::Allowed {
                        reset_at_ms: 11_000,
                    },
                );
        }
        assert_eq!(counts(&h.check()), [0; 6]);
    }

    #[test]
    fn a_throttle_window_run_twice_is_e_unless_the_store_was_faulted() {
        let mut h = H::new();
        for (op, inst, t) in [("t1", "i1", 10 * S), ("t2", "w1", 10 * S + 300_000)] {
            h.invoke_kind(op, inst, "thr:k", t, OpKind::Throttle, 2_000, 0)
                .effect(op, inst, "thr:k", t + 1_000, None)
                .effect(op, inst, "thr:k", t + 2_000, Some(true))
                .complete(
                    op,
                    inst,
                    "thr:k",
                    t + 3_000,
                    Outcome::Executed {
                        value: format!("v-{op}"),
                    },
                );
        }
        assert_eq!(counts(&h.check()), [0, 0, 0, 0, 1, 0]);
        h.fault(FaultEffect::StoreCut, 5 * S, 6 * S);
        let v = h.check();
        assert_eq!(counts(&v), [0; 6]);
        assert_eq!(v.exceptions.get(&Exception::FailOpen), Some(&1));
    }

    #[test]
    fn a_debounce_burst_run_twice_or_a_foreign_value_is_reported() {
        let mut h = H::new();
        for (op, inst, t) in [("d1", "i1", 10 * S), ("d2", "w1", 10 * S + 50_000)] {
            h.invoke_kind(op, inst, "deb:k", t, OpKind::Debounce, 200, 0)
                .effect(op, inst, "deb:k", t + 300_000, None)
                .effect(op, inst, "deb:k", t + 310_000, Some(true))
                .complete(
                    op,
                    inst,
                    "deb:k",
                    t + 320_000,
                    Outcome::Debounced {
                        value: "v-d9".into(),
                    },
                );
        }
        let v = h.check();
        // Ran twice; and both callers got a value no run produced.
        assert_eq!(counts(&v), [0, 2, 0, 0, 1, 0], "{:#?}", v.violations);
    }

    #[test]
    fn the_documented_exceptions_are_counted_not_reported() {
        let mut h = H::new();
        // Failed by design, then a retry runs.
        h.ran(
            "f1",
            "i1",
            "kf",
            S,
            Outcome::RanFailed {
                why: "Failed".into(),
            },
        )
        .ran("f2", "w1", "kf", 2 * S, fresh("v-f2"))
        .final_read("kf", 30 * S, Some("v-f2"));
        // Owner killed mid-run: no completion; another instance takes over after the lease.
        h.invoke("k1", "w2", "kk", S)
            .effect("k1", "w2", "kk", S + 1_000, None)
            .fault(
                FaultEffect::InstanceKill { inst: "w2".into() },
                S + 200_000,
                S + 200_000,
            )
            .ran("k2", "i1", "kk", 4 * S, fresh("v-k2"))
            .final_read("kk", 30 * S, Some("v-k2"));
        // Owner paused past its lease: told "not recorded"; another ran and recorded.
        h.invoke("p1", "w3", "kp", S)
            .effect("p1", "w3", "kp", S + 1_000, None)
            .fault(
                FaultEffect::InstancePause { inst: "w3".into() },
                S + 100_000,
                5 * S,
            )
            .ran("p2", "i2", "kp", 4 * S, fresh("v-p2"))
            .effect("p1", "w3", "kp", 5 * S + 500_000, Some(true))
            .complete(
                "p1",
                "w3",
                "kp",
                5 * S + 600_000,
                Outcome::RanNotRecorded {
                    value: None,
                    why: "LeaseLost".into(),
                },
            )
            .final_read("kp", 30 * S, Some("v-p2"));
        // The store cut off past the lease: the owner is told "not recorded", another runs.
        h.invoke("c1", "w1", "kc", 40 * S)
            .effect("c1", "w1", "kc", 40 * S + 1_000, None)
            .fault(FaultEffect::StoreCut, 40 * S + 200_000, 44 * S)
            .effect("c1", "w1", "kc", 40 * S + 900_000, Some(true))
            .complete(
                "c1",
                "w1",
                "kc",
                44 * S + 100_000,
                Outcome::RanNotRecorded {
                    value: None,
                    why: "LeaseLost".into(),
                },
            )
            .ran("c2", "i1", "kc", 45 * S, fresh("v-c2"))
            .final_read("kc", 60 * S, Some("v-c2"));
        // A transactional run whose connection was terminated: nothing committed, the retry
        // runs (and commits).
        h.invoke_kind("t1", "w1", "kt", 70 * S, OpKind::Tx, 2_000, 0)
            .effect("t1", "w1", "kt", 70 * S + 1_000, None)
            .fault(FaultEffect::PgBroken, 70 * S + 300_000, 70 * S + 300_000)
            .effect("t1", "w1", "kt", 70 * S + 400_000, Some(true))
            .complete(
                "t1",
                "w1",
                "kt",
                70 * S + 500_000,
                Outcome::NothingRan {
                    why: "StoreUnavailable".into(),
                },
            )
            .invoke_kind("t2", "i1", "kt", 71 * S, OpKind::Tx, 2_000, 0)
            .effect("t2", "i1", "kt", 71 * S + 1_000, None)
            .effect("t2", "i1", "kt", 71 * S + 2_000, Some(true))
            .complete("t2", "i1", "kt", 71 * S + 3_000, fresh("v-t2"))
            .invoke_kind("final:kt", FINAL, "kt", 90 * S, OpKind::Tx, 2_000, 0)
            .complete(
                "final:kt",
                FINAL,
                "kt",
                90 * S + 1_000,
                Outcome::Replay {
                    value: "v-t2".into(),
                },
            );
        h.committed.insert("kt".into(), vec!["t2".into()]);
        let v = h.check();
        assert_eq!(v.violations, vec![]);
        assert_eq!(v.exceptions.get(&Exception::Failed), Some(&1));
        assert_eq!(v.exceptions.get(&Exception::Killed), Some(&1));
        assert_eq!(v.exceptions.get(&Exception::Paused), Some(&1));
        assert_eq!(v.exceptions.get(&Exception::CutOff), Some(&1));
        assert_eq!(v.exceptions.get(&Exception::RolledBack), Some(&1));
    }

    #[test]
    fn a_paused_owner_told_fresh_is_no_exception() {
        let mut h = H::new();
        h.invoke("p1", "w3", "kp", S)
            .effect("p1", "w3", "kp", S + 1_000, None)
            .fault(
                FaultEffect::InstancePause { inst: "w3".into() },
                S + 100_000,
                5 * S,
            )
            .ran("p2", "i2", "kp", 4 * S, fresh("v-p2"))
            .effect("p1", "w3", "kp", 5 * S + 500_000, Some(true))
            .complete("p1", "w3", "kp", 5 * S + 600_000, fresh("v-p1"))
            .final_read("kp", 30 * S, Some("v-p2"));
        let v = h.check();
        assert_eq!(v.count(Property::A), 1, "{:#?}", v.violations);
        assert!(v.violations[0].message.contains("late completion"));
    }

    #[test]
    fn a_final_read_that_fails_is_a_violation_of_f() {
        let mut h = H::new();
        h.ran("op1", "i1", "k", S, fresh("v-op1"))
            .invoke("final:k", FINAL, "k", 9 * S)
            .complete(
                "final:k",
                FINAL,
                "k",
                9 * S + 10,
                Outcome::NothingRan {
                    why: "TypeMismatch".into(),
                },
            );
        let v = h.check();
        assert_eq!(v.count(Property::F), 1, "{:#?}", v.violations);
    }
}
