//! `sim --seed N` replays one run and prints its trace; `sim --seeds A..B` sweeps.
//! `--scenario raft|gm|mirror|all` picks the scenario (default: all three, in that order).

use std::process::ExitCode;

const USAGE: &str = "usage: sim [--scenario raft|gm|mirror|mirror-old-mix|mirror-slow-clocks|all] --seed N [--quiet] | sim [--scenario ...] --seeds A..B [--verbose]
  --scenario S  raft: the metadata Raft group; gm: the GM ring; mirror: a mirrored queue;
                mirror-old-mix: the same without the faults session 34 added (the whole
                cluster's crash, the queue's delete and declare); mirror-slow-clocks:
                the mirror scenario with every node's clock at 0.1 of the failure
                detectors' rate, beyond what the lease allows (expected to fail: it shows
                the checkers catch two masters); all (default): raft, gm and mirror
  --seed N      run seed N, print its trace, then PASS or FAIL
  --seeds A..B  run seeds A to B-1 (A..=B includes B), one line per seed
  --quiet       (with --seed) print only the verdict
  --verbose     (with --seeds) print every trace, not only failing ones";

fn parse_range(s: &str) -> Option<(u64, u64)> {
    if let Some((a, b)) = s.split_once("..=") {
        let (a, b) = (a.parse().ok()?, b.parse::<u64>().ok()?);
        return Some((a, b.checked_add(1)?));
    }
    let (a, b) = s.split_once("..")?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// Log lines' time: the simulated time, in the trace's format (`-` outside a host).
struct SimTime;

impl tracing_subscriber::fmt::time::FormatTime for SimTime {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        match turmoil::sim_elapsed() {
            Some(d) => write!(w, "{:>7}ms", d.as_millis()),
            None => write!(w, "{:>7}", "-"),
        }
    }
}

type Scenario = (&'static str, fn(u64) -> sim::Outcome);

fn main() -> ExitCode {
    // `RUST_LOG=warren=info sim --seed N` also prints the node code's own logs (to stderr,
    // stamped with simulated time as the trace is); the trace on stdout is unchanged.
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_timer(SimTime)
            .with_ansi(false)
            .with_writer(std::io::stderr)
            .init();
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |f: &str| args.iter().any(|a| a == f);
    let value = |f: &str| {
        args.iter()
            .position(|a| a == f)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let raft: Scenario = ("raft", sim::run_seed);
    let gm: Scenario = ("gm", sim::gm_scenario::run_seed);
    let mirror: Scenario = ("mirror", sim::mirror_scenario::run_seed);
    let mirror_old: Scenario = ("mirror-old-mix", sim::mirror_scenario::run_seed_old_mix);
    let slow: Scenario = ("mirror-slow-clocks", |seed| {
        let rates: Vec<(u64, u64)> = (1..=4).map(|id| (id, 100_000)).collect();
        sim::mirror_scenario::run_seed_with_clock_rates(seed, &rates)
    });
    let scenarios: Vec<Scenario> = match value("--scenario").as_deref() {
        None | Some("all") => vec![raft, gm, mirror],
        Some("raft") => vec![raft],
        Some("gm") => vec![gm],
        Some("mirror") => vec![mirror],
        Some("mirror-old-mix") => vec![mirror_old],
        Some("mirror-slow-clocks") => vec![slow],
        Some(_) => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    if let Some(seed) = value("--seed") {
        let Ok(seed) = seed.parse::<u64>() else {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        };
        let mut status = ExitCode::SUCCESS;
        for (name, run) in &scenarios {
            let out = run(seed);
            if !flag("--quiet") {
                for line in &out.trace {
                    println!("{line}");
                }
            }
            if report(name, &out) != ExitCode::SUCCESS {
                status = ExitCode::FAILURE;
            }
        }
        return status;
    }
    if let Some(range) = value("--seeds") {
        let Some((a, b)) = parse_range(&range) else {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        };
        let mut failed = Vec::new();
        let mut runs = 0;
        for seed in a..b {
            for (name, run) in &scenarios {
                runs += 1;
                let out = run(seed);
                if flag("--verbose") || !out.passed() {
                    for line in &out.trace {
                        println!("{line}");
                    }
                }
                if report(name, &out) != ExitCode::SUCCESS {
                    failed.push(format!("{name}:{seed}"));
                }
            }
        }
        println!(
            "{} of {runs} runs passed{}",
            runs - failed.len(),
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

fn report(scenario: &str, out: &sim::Outcome) -> ExitCode {
    if out.passed() {
        println!("{scenario} seed {} PASS", out.seed);
        ExitCode::SUCCESS
    } else {
        println!("{scenario} seed {} FAIL", out.seed);
        for f in &out.failures {
            println!("  {f}");
        }
        println!(
            "  reproduce: cargo run -p sim -- --scenario {scenario} --seed {}",
            out.seed
        );
        ExitCode::FAILURE
    }
}
