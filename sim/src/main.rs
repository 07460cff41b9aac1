//! `sim --seed N` replays one run and prints its trace; `sim --seeds A..B` sweeps.

use std::process::ExitCode;

const USAGE: &str = "usage: sim --seed N [--quiet] | sim --seeds A..B [--verbose]
  --seed N     run seed N, print its trace, then PASS or FAIL
  --seeds A..B run seeds A to B-1 (A..=B includes B), one line per seed
  --quiet      (with --seed) print only the verdict
  --verbose    (with --seeds) print every trace, not only failing ones";

fn parse_range(s: &str) -> Option<(u64, u64)> {
    if let Some((a, b)) = s.split_once("..=") {
        let (a, b) = (a.parse().ok()?, b.parse::<u64>().ok()?);
        return Some((a, b.checked_add(1)?));
    }
    let (a, b) = s.split_once("..")?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |f: &str| args.iter().any(|a| a == f);
    let value = |f: &str| {
        args.iter()
            .position(|a| a == f)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    if let Some(seed) = value("--seed") {
        let Ok(seed) = seed.parse::<u64>() else {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        };
        let out = sim::run_seed(seed);
        if !flag("--quiet") {
            for line in &out.trace {
                println!("{line}");
            }
        }
        return report(&out);
    }
    if let Some(range) = value("--seeds") {
        let Some((a, b)) = parse_range(&range) else {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        };
        let mut failed = Vec::new();
        for seed in a..b {
            let out = sim::run_seed(seed);
            if flag("--verbose") || !out.passed() {
                for line in &out.trace {
                    println!("{line}");
                }
            }
            if report(&out) != ExitCode::SUCCESS {
                failed.push(seed);
            }
        }
        println!(
            "{} of {} seeds passed{}",
            (b - a) as usize - failed.len(),
            b - a,
            if failed.is_empty() {
                String::new()
            } else {
                format!("; failed: {failed:?}")
            }
        );
        return if failed.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    eprintln!("{USAGE}");
    ExitCode::from(2)
}

fn report(out: &sim::Outcome) -> ExitCode {
    if out.passed() {
        println!("seed {} PASS", out.seed);
        ExitCode::SUCCESS
    } else {
        println!("seed {} FAIL", out.seed);
        for f in &out.failures {
            println!("  {f}");
        }
        println!("  reproduce: cargo run -p sim -- --seed {}", out.seed);
        ExitCode::FAILURE
    }
}
