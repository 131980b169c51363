//! The recorded history: JSON lines, one file per instance (a process holds one or several),
//! each line written with one `write` call, so a SIGKILL loses at most the line being
//! written and never tears one that was written.
//!
//! Two files per instance:
//! - `history-<inst>.jsonl`: every call's invoke and completion, with its outcome;
//! - `effects-<inst>.jsonl`: every execution of a user function. The function's first action
//!   appends its start, before it does anything else; its last, its end. This log is outside
//!   the system under test: it is what really ran.
//!
//! Times are µs since the UNIX epoch, read from the host clock, which every process shares.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::outcome::Outcome;

/// Now, µs since the UNIX epoch.
pub(crate) fn now_us() -> u64 {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// What a call is: which primitive, on which store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum OpKind {
    /// `IdempotencyHandle::run_with` on the instance's runtime (its shared store).
    Idem,
    /// `PostgresStore::run_in_transaction`.
    Tx,
    /// A POST through the instance's `IdempotencyLayer`, over a real socket.
    Http,
    /// A leading throttle across instances.
    Throttle,
    /// A rate-limit check (fixed window, Redis store, fail closed).
    Rate,
    /// A debounce call across instances.
    Debounce,
}

impl OpKind {
    /// Kinds whose keys promise at-most-once.
    pub(crate) fn is_once(self) -> bool {
        matches!(self, Self::Idem | Self::Tx | Self::Http)
    }
}

/// How the user function of an op ends, by design.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Ending {
    /// Returns its value.
    #[default]
    Ok,
    /// Returns an error.
    Fail,
    /// Panics.
    Panic,
}

/// One line of a history or effects file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub(crate) enum Record {
    /// A call began.
    Invoke {
        op: String,
        inst: String,
        key: String,
        kind: OpKind,
        t: u64,
        /// The value this call's function returns (unique per op).
        value: String,
        /// How long the function runs, ms.
        run_ms: u64,
        /// The lease (idempotency) or interval (throttle) or window (rate), ms.
        lease_ms: u64,
        /// The longest this call may take before it counts as unbounded, ms.
        bound_ms: u64,
        /// A limit the checker needs (rate limit per window), 0 otherwise.
        #[serde(default)]
        limit: u64,
        ending: Ending,
    },
    /// A call ended.
    Complete {
        op: String,
        inst: String,
        key: String,
        t: u64,
        outcome: Outcome,
    },
    /// A user function started (written first thing) or ended (`ok` set).
    Effect {
        op: String,
        inst: String,
        key: String,
        t: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ok: Option<bool>,
    },
}

impl Record {
    pub(crate) fn t(&self) -> u64 {
        match self {
            Self::Invoke { t, .. } | Self::Complete { t, .. } | Self::Effect { t, .. } => *t,
        }
    }

    pub(crate) fn key(&self) -> &str {
        match self {
            Self::Invoke { key, .. } | Self::Complete { key, .. } | Self::Effect { key, .. } => key,
        }
    }

    pub(crate) fn op(&self) -> &str {
        match self {
            Self::Invoke { op, .. } | Self::Complete { op, .. } | Self::Effect { op, .. } => op,
        }
    }
}

/// An append-only JSON-lines file; every line is one `write` of the whole line.
#[derive(Clone)]
pub(crate) struct Log {
    file: Arc<Mutex<File>>,
}

impl Log {
    pub(crate) fn create(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            file: Arc::new(Mutex::new(file)),
        })
    }

    pub(crate) fn append(&self, record: &Record) {
        let mut line = serde_json::to_vec(record).expect("a record serializes");
        line.push(b'\n');
        let mut file = self
            .file
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // A failed write would silently lose history: the harness cannot judge without it.
        file.write_all(&line)
            .expect("the history file takes the line");
    }
}

/// The two logs of one instance.
#[derive(Clone)]
pub(crate) struct Logs {
    pub(crate) history: Log,
    pub(crate) effects: Log,
}

impl Logs {
    pub(crate) fn create(dir: &Path, inst: &str) -> std::io::Result<Self> {
        Ok(Self {
            history: Log::create(&dir.join(format!("history-{inst}.jsonl")))?,
            effects: Log::create(&dir.join(format!("effects-{inst}.jsonl")))?,
        })
    }
}

/// Every record of every file in `dir`, sorted by time; lines that do not parse (the tail of
/// a file whose writer was killed mid-line) are counted, not fatal.
pub(crate) fn read_dir(dir: &Path) -> std::io::Result<(Vec<Record>, usize)> {
    let mut records = Vec::new();
    let mut torn = 0;
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    paths.sort();
    for path in paths {
        for line in BufReader::new(File::open(&path)?).lines() {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<Record>(&line) {
                Ok(r) => records.push(r),
                Err(_) => torn += 1,
            }
        }
    }
    records.sort_by_key(Record::t);
    Ok((records, torn))
}
