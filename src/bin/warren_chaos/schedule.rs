//! The run's plan, drawn from the seed alone: a list of steps (faults and admin operations),
//! each with its own timing, so the same seed always gives the same schedule. Targets that
//! depend on the cluster's state (the queue master's node, the Raft leader) stay symbolic
//! here and are resolved when the step runs.

use std::fmt;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Which node a fault hits; `Master` and `Leader` are looked up when the step runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A node by index (0-based).
    Node(usize),
    /// The node that masters the queue `ha.q<n>`.
    Master(usize),
    /// The Raft leader.
    Leader,
}

/// Which nodes a partition cuts off from the rest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Side {
    /// These node indexes (a minority).
    Nodes(Vec<usize>),
    /// The node of the target alone.
    Of(Target),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// `kill -9`, down for `down_ms`, then start again.
    Kill { target: Target, down_ms: u64 },
    /// SIGSTOP, SIGCONT after `ms`.
    Pause { target: Target, ms: u64 },
    /// SIGTERM, wait for the exit, down for `down_ms`, start again.
    Restart { target: Target, down_ms: u64 },
    /// Every node stopped (SIGTERM, or `kill -9` when not `clean`), then all started.
    ClusterRestart { clean: bool, down_ms: u64 },
    /// The minority `side` cut off from the rest, both directions, for `ms`.
    Partition { side: Side, ms: u64 },
    /// Only what `side` sends to the rest is dropped, for `ms`.
    OneWay { side: Side, ms: u64 },
    /// `side` cut off and healed `cycles` times, `on_ms` cut and `off_ms` healed each.
    Flapping {
        side: Side,
        cycles: u32,
        on_ms: u64,
        off_ms: u64,
    },
    /// The `ha` policy set to one of [`Policy`].
    SetPolicy(Policy),
    /// `warrenctl sync_queue ha.q<n>` (or `cancel_sync_queue`).
    Sync { queue: usize, cancel: bool },
    /// `ha.q<n>` deleted and declared again.
    Redeclare { queue: usize },
    /// A new node joins (`join_cluster`), stays `ms` (mirrors sync to it), is killed
    /// (`kill -9`) and forgotten (`forget_cluster_node`).
    JoinForget { ms: u64 },
    /// The node's file system filled up for `ms`, then freed (`--extended`).
    DiskFull { target: Target, ms: u64 },
    /// The node's writes throttled to a trickle for `ms`, so every fsync is slow
    /// (`--extended`).
    SlowDisk { target: Target, ms: u64 },
    /// Nothing happens for `ms` (the workload runs).
    Quiet { ms: u64 },
}

/// The `ha` policy's definitions the workload cycles through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    All,
    Exactly2,
    /// `ha-mode: nodes` naming the first two nodes.
    Nodes,
    /// Policy cleared (queues not mirrored).
    Cleared,
}

impl Step {
    /// The fault's kind as the result line names it (`None` for admin steps).
    pub fn fault_name(&self) -> Option<&'static str> {
        Some(match self {
            Step::Kill { .. } => "kill9",
            Step::Pause { .. } => "pause",
            Step::Restart { .. } => "restart",
            Step::ClusterRestart { clean: true, .. } => "cluster_stop",
            Step::ClusterRestart { clean: false, .. } => "cluster_kill9",
            Step::Partition { .. } => "partition",
            Step::OneWay { .. } => "oneway",
            Step::Flapping { .. } => "flapping",
            Step::DiskFull { .. } => "disk_full",
            Step::SlowDisk { .. } => "slow_fsync",
            _ => return None,
        })
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Node(i) => write!(f, "node{}", i + 1),
            Target::Master(q) => write!(f, "master(ha.q{q})"),
            Target::Leader => write!(f, "leader"),
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Side::Nodes(ns) => {
                let names: Vec<String> = ns.iter().map(|i| format!("node{}", i + 1)).collect();
                write!(f, "{{{}}}", names.join(","))
            }
            Side::Of(t) => write!(f, "{{{t}}}"),
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Kill { target, down_ms } => write!(f, "kill -9 {target}, down {down_ms}ms"),
            Step::Pause { target, ms } => write!(f, "SIGSTOP {target} for {ms}ms"),
            Step::Restart { target, down_ms } => {
                write!(f, "SIGTERM {target}, down {down_ms}ms")
            }
            Step::ClusterRestart { clean, down_ms } => write!(
                f,
                "whole cluster {} , down {down_ms}ms",
                if *clean { "SIGTERM" } else { "kill -9" }
            ),
            Step::Partition { side, ms } => write!(f, "partition {side} | rest for {ms}ms"),
            Step::OneWay { side, ms } => write!(f, "one-way drop {side} -> rest for {ms}ms"),
            Step::Flapping {
                side,
                cycles,
                on_ms,
                off_ms,
            } => write!(
                f,
                "flapping {side} | rest, {cycles}x ({on_ms}ms cut, {off_ms}ms healed)"
            ),
            Step::SetPolicy(p) => write!(f, "policy ha -> {p:?}"),
            Step::Sync { queue, cancel } => write!(
                f,
                "{} ha.q{queue}",
                if *cancel {
                    "cancel_sync_queue"
                } else {
                    "sync_queue"
                }
            ),
            Step::Redeclare { queue } => write!(f, "delete and re-declare ha.q{queue}"),
            Step::JoinForget { ms } => {
                write!(f, "a new node joins, stays {ms}ms, is killed and forgotten")
            }
            Step::DiskFull { target, ms } => write!(f, "disk of {target} full for {ms}ms"),
            Step::SlowDisk { target, ms } => write!(f, "disk of {target} slow for {ms}ms"),
            Step::Quiet { ms } => write!(f, "quiet {ms}ms"),
        }
    }
}

/// How many queues the workload uses (`ha.q0`, `ha.q1`).
pub const QUEUES: usize = 2;

/// The schedule for `seed` on `nodes` nodes, about `duration_ms` long: quiet gaps between
/// steps, one fault or admin operation at a time (so each fault's effect can be judged alone).
/// Disk faults and joins are drawn only with `disk` (so seeds without it keep their
/// schedules: the extended mix).
pub fn plan(seed: u64, nodes: usize, duration_ms: u64, disk: bool) -> Vec<Step> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut steps = Vec::new();
    let mut planned = 0u64;
    let mut policy = Policy::All;
    while planned < duration_ms {
        let gap = rng.gen_range(1_000..3_000);
        steps.push(Step::Quiet { ms: gap });
        planned += gap;
        let step = if rng.gen_bool(0.65) {
            fault(&mut rng, nodes, disk)
        } else {
            admin(&mut rng, &mut policy, disk)
        };
        planned += length(&step);
        steps.push(step);
    }
    // The workload ends under the policy it started with, so the end state is comparable.
    if policy != Policy::All {
        steps.push(Step::SetPolicy(Policy::All));
    }
    steps
}

/// How long a step is planned to take (restarts add the nodes' start time on top).
fn length(step: &Step) -> u64 {
    match step {
        Step::Kill { down_ms, .. }
        | Step::Restart { down_ms, .. }
        | Step::ClusterRestart { down_ms, .. } => down_ms + 3_000,
        Step::Pause { ms, .. }
        | Step::Partition { ms, .. }
        | Step::OneWay { ms, .. }
        | Step::DiskFull { ms, .. }
        | Step::SlowDisk { ms, .. }
        | Step::Quiet { ms } => *ms,
        Step::JoinForget { ms } => ms + 3_000,
        Step::Flapping {
            cycles,
            on_ms,
            off_ms,
            ..
        } => *cycles as u64 * (on_ms + off_ms),
        _ => 500,
    }
}

fn target(rng: &mut StdRng, nodes: usize) -> Target {
    match rng.gen_range(0..4) {
        0 => Target::Master(rng.gen_range(0..QUEUES)),
        1 => Target::Leader,
        _ => Target::Node(rng.gen_range(0..nodes)),
    }
}

/// A minority: one node (any, or the master's, or the leader's), or two of five.
fn minority(rng: &mut StdRng, nodes: usize) -> Side {
    let size = if nodes >= 5 && rng.gen_bool(0.5) {
        2
    } else {
        1
    };
    if size == 1 && rng.gen_bool(0.5) {
        return Side::Of(target(rng, nodes));
    }
    let mut picked = Vec::new();
    while picked.len() < size {
        let n = rng.gen_range(0..nodes);
        if !picked.contains(&n) {
            picked.push(n);
        }
    }
    picked.sort();
    Side::Nodes(picked)
}

fn fault(rng: &mut StdRng, nodes: usize, disk: bool) -> Step {
    match rng.gen_range(0..if disk { 12 } else { 9 }) {
        0 | 1 => Step::Kill {
            target: target(rng, nodes),
            down_ms: rng.gen_range(500..4_000),
        },
        2 => Step::Pause {
            target: target(rng, nodes),
            ms: rng.gen_range(1_000..10_000),
        },
        3 => Step::Restart {
            target: target(rng, nodes),
            down_ms: rng.gen_range(500..3_000),
        },
        4 => Step::ClusterRestart {
            clean: rng.gen_bool(0.5),
            down_ms: rng.gen_range(500..2_000),
        },
        5 | 6 => Step::Partition {
            side: minority(rng, nodes),
            ms: rng.gen_range(4_000..12_000),
        },
        7 => Step::OneWay {
            side: minority(rng, nodes),
            ms: rng.gen_range(3_000..8_000),
        },
        8 => Step::Flapping {
            side: minority(rng, nodes),
            cycles: rng.gen_range(3..7),
            on_ms: rng.gen_range(300..2_500),
            off_ms: rng.gen_range(300..2_000),
        },
        9 | 10 => Step::DiskFull {
            target: target(rng, nodes),
            ms: rng.gen_range(2_000..8_000),
        },
        _ => Step::SlowDisk {
            target: target(rng, nodes),
            ms: rng.gen_range(2_000..8_000),
        },
    }
}

fn admin(rng: &mut StdRng, policy: &mut Policy, joins: bool) -> Step {
    match rng.gen_range(0..if joins { 5 } else { 4 }) {
        // all -> exactly 2 -> nodes -> cleared -> all, one move at a time.
        0 | 1 => {
            *policy = match policy {
                Policy::All => Policy::Exactly2,
                Policy::Exactly2 => Policy::Nodes,
                Policy::Nodes => Policy::Cleared,
                Policy::Cleared => Policy::All,
            };
            Step::SetPolicy(*policy)
        }
        2 => Step::Sync {
            queue: rng.gen_range(0..QUEUES),
            cancel: rng.gen_bool(0.4),
        },
        3 => Step::Redeclare {
            queue: rng.gen_range(0..QUEUES),
        },
        _ => Step::JoinForget {
            ms: rng.gen_range(2_000..8_000),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        for seed in 0..50 {
            assert_eq!(plan(seed, 3, 30_000, false), plan(seed, 3, 30_000, false));
            assert_eq!(plan(seed, 5, 30_000, false), plan(seed, 5, 30_000, false));
        }
    }

    #[test]
    fn different_seeds_give_different_schedules() {
        let plans: std::collections::BTreeSet<String> = (0..50)
            .map(|seed| format!("{:?}", plan(seed, 3, 30_000, false)))
            .collect();
        assert_eq!(plans.len(), 50);
    }

    #[test]
    fn disk_faults_and_joins_come_only_with_the_extended_mix() {
        let disk = |s: &Step| {
            matches!(
                s,
                Step::DiskFull { .. } | Step::SlowDisk { .. } | Step::JoinForget { .. }
            )
        };
        for seed in 0..50 {
            assert!(
                !plan(seed, 3, 30_000, false).iter().any(disk),
                "seed {seed}"
            );
        }
        let with: usize = (0..50)
            .map(|seed| {
                plan(seed, 3, 30_000, true)
                    .iter()
                    .filter(|s| disk(s))
                    .count()
            })
            .sum();
        assert!(with > 10, "only {with} disk faults in 50 schedules");
    }

    #[test]
    fn a_schedule_has_faults_and_ends_under_the_first_policy() {
        for seed in 0..50 {
            let steps = plan(seed, 3, 30_000, false);
            let mut policy = Policy::All;
            for s in &steps {
                if let Step::SetPolicy(p) = s {
                    policy = *p;
                }
            }
            assert_eq!(policy, Policy::All, "seed {seed}");
        }
    }
}
