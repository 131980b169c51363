//! The report: a table per fault kind, then every violation with its key's whole history, the
//! faults around it and the command that replays it.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::checker::{Exception, FaultSpan, Property, Verdict, Violation};
use crate::engine::Run;
use crate::history::Record;

/// One kind's line in the table.
pub(crate) struct Row {
    pub(crate) kind: String,
    pub(crate) seed: u64,
    pub(crate) seconds: u64,
    pub(crate) result: Result<Run, String>,
}

fn secs(us: u64, base: u64) -> String {
    let d = i128::from(us) - i128::from(base);
    format!("{:+.3}s", d as f64 / 1e6)
}

pub(crate) fn replay_command(seed: u64, seconds: u64, kind: &str) -> String {
    format!("cargo run -p throttlebeam-faults -- --seed {seed} --seconds {seconds} --only {kind}")
}

fn faults_cell(counts: &BTreeMap<String, usize>, faults: &[FaultSpan]) -> String {
    if counts.is_empty() {
        // A standing fault (the setup itself), if any.
        return faults
            .first()
            .map_or_else(|| "-".to_owned(), |f| format!("standing: {}", f.label));
    }
    counts
        .iter()
        .map(|(k, n)| format!("{k} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn exceptions_cell(v: &Verdict) -> String {
    let parts: Vec<String> = Exception::ALL
        .iter()
        .filter_map(|e| v.exceptions.get(e).map(|n| format!("{} {n}", e.name())))
        .collect();
    if parts.is_empty() {
        "-".to_owned()
    } else {
        parts.join(", ")
    }
}

/// The table of every kind.
pub(crate) fn table(rows: &[Row]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| kind | seed | faults injected | calls | (a) | (b) | (c) | (d) | (e) | (f) | exceptions | took |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"
    );
    for row in rows {
        match &row.result {
            Ok(run) => {
                let v = &run.verdict;
                let cells: Vec<String> = Property::ALL
                    .iter()
                    .map(|p| v.count(*p).to_string())
                    .collect();
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {} | {:.0}s |",
                    row.kind,
                    row.seed,
                    faults_cell(&run.fault_counts, &run.faults),
                    v.ops,
                    cells.join(" | "),
                    exceptions_cell(v),
                    run.took.as_secs_f64()
                );
            }
            Err(e) => {
                let _ = writeln!(
                    out,
                    "| {} | could not run: {e} | | | | | | | | | |",
                    row.kind
                );
            }
        }
    }
    out
}

/// Everything about the violations of one kind.
pub(crate) fn details(row: &Row, max: usize) -> String {
    let mut out = String::new();
    let Ok(run) = &row.result else {
        return out;
    };
    let v = &run.verdict;
    if v.violations.is_empty() && run.notes.is_empty() {
        return out;
    }
    let _ = writeln!(out, "\n## {} (seed {})", row.kind, row.seed);
    for n in &run.notes {
        let _ = writeln!(out, "note: {n}");
    }
    if v.violations.is_empty() {
        return out;
    }
    let base = run.records.first().map_or(0, Record::t);
    let _ = writeln!(
        out,
        "{} violations; replay: {}",
        v.violations.len(),
        replay_command(row.seed, row.seconds, &row.kind)
    );
    for x in &v.violations {
        let _ = writeln!(out, "- ({}) {}", x.property.letter(), x.message);
    }
    // The full story of the first few keys.
    let mut shown = 0;
    let mut seen = std::collections::BTreeSet::new();
    for x in &v.violations {
        if shown >= max {
            let _ = writeln!(
                out,
                "(histories of the other keys left out; rerun with --details N)"
            );
            break;
        }
        let Some(key) = &x.key else { continue };
        if !seen.insert(key.clone()) {
            continue;
        }
        shown += 1;
        out.push_str(&key_story(run, key, x, base));
    }
    out
}

fn key_story(run: &Run, key: &str, x: &Violation, base: u64) -> String {
    let mut out = String::new();
    let records: Vec<&Record> = run.records.iter().filter(|r| r.key() == key).collect();
    let first = records.first().map_or(x.at, |r| r.t());
    let last = records.last().map_or(x.at, |r| r.t()).max(x.at);
    let _ = writeln!(out, "\n### {key}  (times from the start of the run)");
    for r in &records {
        let line = match r {
            Record::Invoke {
                op,
                inst,
                run_ms,
                lease_ms,
                ending,
                value,
                kind,
                ..
            } => format!(
                "{inst:<6} {op:<14} called {kind:?}: runs {run_ms}ms, lease {lease_ms}ms, ends {ending:?}, value {value}"
            ),
            Record::Effect { op, inst, ok, .. } => match ok {
                None => format!("{inst:<6} {op:<14} function started (effect log)"),
                Some(true) => format!("{inst:<6} {op:<14} function returned"),
                Some(false) => format!("{inst:<6} {op:<14} function failed"),
            },
            Record::Complete {
                op, inst, outcome, ..
            } => format!("{inst:<6} {op:<14} told {}", outcome.short()),
        };
        let _ = writeln!(out, "  {}  {line}", secs(r.t(), base));
    }
    let around: Vec<&FaultSpan> = run
        .faults
        .iter()
        .filter(|f| f.end + 3_000_000 >= first && f.start <= last + 3_000_000)
        .collect();
    if around.is_empty() {
        let _ = writeln!(out, "  faults around it: none");
    } else {
        let _ = writeln!(out, "  faults around it:");
        for f in around {
            let _ = writeln!(
                out,
                "  {} .. {}  {}",
                secs(f.start, base),
                secs(f.end, base),
                f.label
            );
        }
    }
    out
}
