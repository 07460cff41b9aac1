//! `warren-chaos`: a fault campaign against real `warren` processes (issue 16). Each run
//! starts a cluster on loopback, drives lapin clients (confirmed publishers, consumers,
//! `basic.get`, admin changes) through a fault schedule drawn from its seed (kill -9,
//! pauses, restarts, whole-cluster restarts, nftables partitions, and with `--extended`
//! full and slow disks), drains the queues and
//! checks the history: nothing confirmed lost (in the drain, and before it in the files
//! of every copy recorded synchronised), no unflagged duplicate, per-publisher order,
//! liveness. One line per run; exit 0 only when every run passed.
//!
//! Needs root and `nft` (partitions), and release builds of `warren` and `warrenctl`
//! (`cargo build --release --bin warren --bin warrenctl`).

#[path = "warren_chaos/checker.rs"]
mod checker;
#[path = "warren_chaos/cluster.rs"]
mod cluster;
#[path = "warren_chaos/copies.rs"]
mod copies;
#[path = "warren_chaos/disk.rs"]
mod disk;
#[path = "warren_chaos/faults.rs"]
mod faults;
#[path = "warren_chaos/history.rs"]
mod history;
#[path = "warren_chaos/net.rs"]
mod net;
#[path = "warren_chaos/returns.rs"]
mod returns;
#[path = "warren_chaos/run.rs"]
mod run;
#[path = "warren_chaos/schedule.rs"]
mod schedule;
#[path = "warren_chaos/workload.rs"]
mod workload;

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Parser;

#[derive(Parser)]
#[command(about = "Seeded fault campaign against a real Warren cluster")]
struct Args {
    /// Run one seed.
    #[arg(long, conflicts_with = "seeds")]
    seed: Option<u64>,
    /// Run a range of seeds, A..B (B excluded).
    #[arg(long)]
    seeds: Option<String>,
    /// Cluster size: 3 or 5.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// How long the fault schedule runs, in seconds (restarts and the drain add to it).
    #[arg(long, default_value_t = 30)]
    duration: u64,
    /// Folder holding `warren` and `warrenctl` (default: this binary's own folder).
    #[arg(long)]
    bin: Option<PathBuf>,
    /// Keep the data and logs of passing runs too (failing runs' are always kept).
    #[arg(long)]
    keep: bool,
    /// Print each seed's schedule and exit.
    #[arg(long)]
    plan_only: bool,
    /// The extended mix: disk faults (a node's file system full, its fsyncs slow) and a node
    /// joining and being forgotten join the schedules; each node's data folder becomes its
    /// own small ext4 image (needs mkfs.ext4, loop devices and the cgroup v1 blkio
    /// controller). Changes every seed's schedule.
    #[arg(long)]
    extended: bool,
    /// A dead-letter stream joins the workload: confirmed persistent publishes to a source
    /// queue with a 200 ms message TTL, dead-lettered into a target queue mastered on
    /// another node. Its messages must not be lost; duplicates and order are not judged
    /// (a dead letter in flight when its node stops is dead-lettered again).
    #[arg(long)]
    dead_letters: bool,
}

fn seeds(args: &Args) -> Result<Vec<u64>> {
    if let Some(s) = args.seed {
        return Ok(vec![s]);
    }
    let Some(range) = &args.seeds else {
        bail!("give --seed N or --seeds A..B");
    };
    let Some((a, b)) = range.split_once("..") else {
        bail!("--seeds takes A..B, got {range}");
    };
    let (a, b): (u64, u64) = (a.trim().parse()?, b.trim().parse()?);
    if a >= b {
        bail!("--seeds {range} is empty");
    }
    Ok((a..b).collect())
}

fn main() -> Result<()> {
    let args = Args::parse();
    if ![3, 5].contains(&args.nodes) {
        bail!("--nodes must be 3 or 5");
    }
    let seeds = seeds(&args)?;
    if args.plan_only {
        for s in seeds {
            println!("seed={s}:");
            for step in schedule::plan(s, args.nodes, args.duration * 1000, args.extended) {
                println!("  - {step}");
            }
        }
        return Ok(());
    }
    net::check_available()?;
    if args.extended {
        disk::check_available()?;
    }
    let bin = match &args.bin {
        Some(b) => b.clone(),
        None => std::env::current_exe()?
            .parent()
            .map(PathBuf::from)
            .unwrap_or_default(),
    };
    let opts = run::Opts {
        nodes: args.nodes,
        duration_ms: args.duration * 1000,
        bin,
        keep: args.keep,
        extended: args.extended,
        dead_letters: args.dead_letters,
    };
    // A panic must not leave partitions behind.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        net::remove_all();
        disk::remove_all();
        hook(info);
    }));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()?;
    let (passed, failed) = rt.block_on(async {
        let mut lines = Vec::new();
        let (mut passed, mut failed) = (0, 0);
        for seed in seeds {
            tokio::select! {
                (line, ok) = run::run(seed, &opts) => {
                    println!("{line}");
                    lines.push(line);
                    if ok { passed += 1 } else { failed += 1 }
                }
                (name, code) = interrupted() => {
                    // Dropping the run killed its nodes and removed its cuts.
                    net::remove_all();
                    disk::remove_all();
                    eprintln!("warren-chaos: {name} during seed {seed}");
                    std::process::exit(code);
                }
            }
        }
        if lines.len() > 1 {
            println!("--- summary");
            for l in &lines {
                println!("{l}");
            }
        }
        (passed, failed)
    });
    println!("chaos: {passed} passed, {failed} failed");
    std::process::exit(if failed == 0 { 0 } else { 1 });
}

/// Resolves on Ctrl-C or SIGTERM (`timeout`, a CI runner stopping a job): the signal's name
/// and the exit status a shell gives it. Either way the run cleans up before exiting.
async fn interrupted() -> (&'static str, i32) {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => tokio::select! {
            _ = tokio::signal::ctrl_c() => ("interrupted", 130),
            _ = term.recv() => ("terminated", 143),
        },
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            ("interrupted", 130)
        }
    }
}
