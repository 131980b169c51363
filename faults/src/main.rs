//! throttlebeam's fault-injection harness: real servers behind a fault proxy, instances in
//! their own processes, a recorded history and a checker. See `FAULTS.md`.
//!
//! ```text
//! cargo run -p throttlebeam-faults -- --seed S --minutes M [--only KIND[,KIND…]] [--soak]
//! cargo run -p throttlebeam-faults -- --seed S --seconds N --only KIND   # replays one kind
//! cargo run -p throttlebeam-faults -- --list
//! ```

mod checker;
mod engine;
mod history;
mod kinds;
mod outcome;
mod pg;
mod proxy;
mod report;
mod rng;
mod servers;
mod worker;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use report::Row;

/// Seconds a kind costs besides its run phase (servers, instances, draining, final reads),
/// on a 2-core machine; a budget is split so that the whole pass fits it.
const OVERHEAD_S: u64 = 4;
/// The shortest run phase worth having.
const MIN_PHASE_S: u64 = 4;

struct Args {
    seed: u64,
    budget_s: u64,
    only: Vec<String>,
    soak: bool,
    keep: Option<PathBuf>,
    details: usize,
    jobs: usize,
}

fn usage() -> ! {
    eprintln!(
        "usage: throttlebeam-faults [--seed S] [--minutes M | --seconds N] [--only KIND[,KIND…]] \
         [--skip KIND[,KIND…]] [--soak] [--jobs N] [--keep DIR] [--details N] [--list]\n\
         With one --only kind, --seconds is that kind's run phase (the replay command's form)."
    );
    std::process::exit(2);
}

fn parse() -> Args {
    let mut args = std::env::args().skip(1);
    let mut seed = None;
    let mut budget_s = None;
    let mut only = Vec::new();
    let mut skip = Vec::new();
    let mut soak = false;
    let mut keep = None;
    let mut details = 3;
    let mut jobs = None;
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| usage());
        match a.as_str() {
            "--seed" => seed = Some(value().parse().unwrap_or_else(|_| usage())),
            "--minutes" => {
                let m: f64 = value().parse().unwrap_or_else(|_| usage());
                budget_s = Some((m * 60.0).round() as u64);
            }
            "--seconds" => budget_s = Some(value().parse().unwrap_or_else(|_| usage())),
            "--only" => only.extend(value().split(',').map(str::to_owned)),
            "--skip" => skip.extend(value().split(',').map(str::to_owned)),
            "--soak" => soak = true,
            "--keep" => keep = Some(PathBuf::from(value())),
            "--details" => details = value().parse().unwrap_or_else(|_| usage()),
            "--jobs" => jobs = Some(value().parse::<usize>().unwrap_or_else(|_| usage()).max(1)),
            "--list" => {
                for (name, about) in kinds::KINDS {
                    println!("{name:<15} {about}");
                }
                std::process::exit(0);
            }
            _ => usage(),
        }
    }
    for k in only.iter().chain(&skip) {
        if !kinds::KINDS.iter().any(|(n, _)| n == k) {
            eprintln!("unknown kind {k:?} (see --list)");
            std::process::exit(2);
        }
    }
    if !skip.is_empty() {
        let listed = if only.is_empty() {
            kinds::KINDS.iter().map(|(n, _)| (*n).to_owned()).collect()
        } else {
            only
        };
        only = listed.into_iter().filter(|k| !skip.contains(k)).collect();
    }
    let seed = seed.unwrap_or_else(|| history::now_us() % 1_000_000);
    // Two kinds at a time by default: each mostly waits (runs sleep, faults last), and a
    // pass of every kind then fits its budget with run phases long enough to matter.
    let jobs = jobs.unwrap_or(if only.len() == 1 { 1 } else { 2 });
    Args {
        seed,
        budget_s: budget_s.unwrap_or(180),
        only,
        soak,
        keep,
        details,
        jobs,
    }
}

fn main() {
    let mut argv = std::env::args().skip(1);
    if argv.next().as_deref() == Some("worker") {
        let config = argv.next().unwrap_or_else(|| usage());
        worker::main(&config);
    }
    let args = parse();
    worker::quiet_panics();
    let names: Vec<&str> = if args.only.is_empty() {
        kinds::KINDS.iter().map(|(n, _)| *n).collect()
    } else {
        args.only.iter().map(String::as_str).collect()
    };
    let k = names.len() as u64;
    let phase_s = if args.only.len() == 1 && !args.soak {
        args.budget_s.max(1)
    } else if args.soak {
        // A soak gives each kind a minute at a time and goes round until the budget is spent.
        60
    } else {
        (args.budget_s * args.jobs as u64 / k)
            .saturating_sub(OVERHEAD_S)
            .max(MIN_PHASE_S)
    };
    println!(
        "throttlebeam-faults: seed {} | budget {} s{} | {} kinds, run phase {} s each, {} at a \
         time | slack {} s, breaker cooldown {} s, clock error {} ms",
        args.seed,
        args.budget_s,
        if args.soak { " (soak)" } else { "" },
        names.len(),
        phase_s,
        args.jobs,
        engine::SLACK_MS / 1000,
        engine::COOLDOWN_MS / 1000,
        engine::CLOCK_ERROR_MS
    );
    println!("kinds: {}", names.join(", "));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let began = Instant::now();
    let mut rows: Vec<Row> = Vec::new();
    let mut round = 0u64;
    loop {
        // Round r of a soak runs every kind with seed + r.
        let seed = args.seed + round;
        let keep = args.keep.clone();
        let jobs = args.jobs;
        let soak = args.soak;
        let budget = Duration::from_secs(args.budget_s);
        let names2: Vec<String> = names.iter().map(|s| (*s).to_owned()).collect();
        let mut done: Vec<(usize, Row)> = rt.block_on(async move {
            let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(jobs));
            let mut set = tokio::task::JoinSet::new();
            for (i, name) in names2.into_iter().enumerate() {
                let gate = std::sync::Arc::clone(&gate);
                let keep = keep.clone();
                set.spawn(async move {
                    let _permit = gate.acquire_owned().await.expect("the gate stays open");
                    if soak && round > 0 && began.elapsed() >= budget {
                        return None;
                    }
                    let setup = kinds::build(&name, seed, phase_s * 1000)?;
                    eprintln!(
                        "[{:>5.0}s] {name} (seed {seed}, {phase_s} s)…",
                        began.elapsed().as_secs_f64()
                    );
                    let result = engine::run(&name, setup, keep.as_deref()).await;
                    match &result {
                        Ok(run) => eprintln!(
                            "[{:>5.0}s] {name}: {} calls, {} violations, took {:.0}s",
                            began.elapsed().as_secs_f64(),
                            run.verdict.ops,
                            run.verdict.violations.len(),
                            run.took.as_secs_f64()
                        ),
                        Err(e) => eprintln!(
                            "[{:>5.0}s] {name}: could not run: {e}",
                            began.elapsed().as_secs_f64()
                        ),
                    }
                    Some((
                        i,
                        Row {
                            kind: name,
                            seed,
                            seconds: phase_s,
                            result,
                        },
                    ))
                });
            }
            let mut done = Vec::new();
            while let Some(joined) = set.join_next().await {
                if let Ok(Some(row)) = joined {
                    done.push(row);
                }
            }
            done
        });
        done.sort_by_key(|(i, _)| *i);
        rows.extend(done.into_iter().map(|(_, r)| r));
        round += 1;
        if !args.soak || began.elapsed() >= Duration::from_secs(args.budget_s) {
            break;
        }
    }
    rt.shutdown_timeout(Duration::from_secs(5));
    println!();
    print!("{}", report::table(&rows));
    for row in &rows {
        print!("{}", report::details(row, args.details));
    }
    let violations: usize = rows
        .iter()
        .filter_map(|r| r.result.as_ref().ok())
        .map(|r| r.verdict.violations.len())
        .sum();
    let broken = rows.iter().filter(|r| r.result.is_err()).count();
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    println!(
        "\n{} kinds run in {:.0} s: {violations} violations{}",
        rows.len(),
        began.elapsed().as_secs_f64(),
        if broken > 0 {
            format!(
                ", {broken} kinds could not run{}",
                if ci { " (a failure under CI)" } else { "" }
            )
        } else {
            String::new()
        }
    );
    if violations > 0 || (broken > 0 && ci) {
        std::process::exit(1);
    }
}
