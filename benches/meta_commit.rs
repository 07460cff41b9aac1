//! Metadata commit latency and throughput of a real three-node Raft group on loopback.
//!
//! Three [`MetaRaft`] nodes talk over [`TcpTransport`] on 127.0.0.1, with production timing
//! (`MetaRaftConfig::default()`, `NodeLinkConfig::new`) and, by default, their logs on the
//! real file system through [`FileDisk`] (fsync included), in a fresh temporary folder that
//! is removed at the end. Each node runs on its own tokio runtime (two workers), as separate
//! processes would; `--shared-rt` puts everything on the driver's runtime instead.
//!
//! Measured, printed as Markdown tables:
//! 1. sequential `queue.declare` commits on the leader: p50/p90/p99/max and commits/s;
//! 2. the same with 16 and 64 proposals in flight;
//! 3. on a fresh cluster (so queue counts match phases 1 and 2: commit latency grows with
//!    the number of queues), proposals on a follower, forwarded to the leader: sequential
//!    p50/p90/p99/max and commits/s, the same with 16 in flight, and a paired run alternating
//!    one proposal on the leader with one on the follower, which isolates the forwarding hop;
//! 4. leader failover on three fresh clusters: time to a new leader and to its first commit.
//!
//! ```text
//! cargo bench --bench meta_commit -- [--n N] [--quick] [--mem] [--shared-rt]
//! ```
//!
//! Without `--bench` (which `cargo bench` passes), as under `cargo test --all-targets`, it
//! runs the `--quick` smoke version.

use std::collections::BTreeMap;
use std::future::Future;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use amq_protocol::types::FieldTable;
use hdrhistogram::Histogram;
use tokio::runtime::{Handle, Runtime};
use tokio::task::JoinSet;
use warren::meta::{Command, QueueDef};
use warren::runtime::file_disk::FileDisk;
use warren::runtime::node_link::{NodeLinkConfig, TcpTransport};
use warren::runtime::raft::{MetaRaft, MetaRaftConfig, MetaResponse, NodeId, ProposeError};
use warren::store::{Disk, MemDisk};

const CLUSTER: &str = "meta-bench";
const NODES: u64 = 3;
/// Longest wait for any single proposal (the node's own `propose_timeout` is 10 s).
const PROPOSE_BOUND: Duration = Duration::from_secs(15);
/// Longest wait for a leader, a start-up or a shutdown.
const STEP_BOUND: Duration = Duration::from_secs(20);

type BenchResult<T> = Result<T, String>;

#[derive(Clone, Debug)]
struct Options {
    n: usize,
    failover_runs: usize,
    mem: bool,
    shared_rt: bool,
    quick: bool,
}

const USAGE: &str =
    "usage: cargo bench --bench meta_commit -- [--n N] [--quick] [--mem] [--shared-rt]
  --n N        proposals per throughput phase (default 2000; 100 with --quick)
  --quick      small smoke run (also the default when cargo does not pass --bench)
  --mem        MemDisk instead of FileDisk (no file system, no fsync)
  --shared-rt  all three nodes on the driver's runtime instead of one runtime per node";

fn parse_args() -> Result<Options, String> {
    let mut n = None;
    let mut quick = false;
    let mut bench = false;
    let mut mem = false;
    let mut shared_rt = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--n" => {
                let v = args.next().ok_or("--n needs a value")?;
                let v: usize = v.parse().map_err(|e| format!("--n {v}: {e}"))?;
                if v == 0 {
                    return Err("--n must be at least 1".into());
                }
                n = Some(v);
            }
            "--quick" => quick = true,
            "--bench" => bench = true,
            "--mem" => mem = true,
            "--shared-rt" => shared_rt = true,
            "-h" | "--help" => return Err(String::new()),
            other if other.starts_with('-') => return Err(format!("unknown option {other}")),
            // `cargo bench FILTER` hands the filter to every bench binary: not ours to judge.
            other => eprintln!("ignoring argument {other:?}"),
        }
    }
    let quick = quick || !bench;
    Ok(Options {
        n: n.unwrap_or(if quick { 100 } else { 2000 }),
        failover_runs: if quick { 1 } else { 3 },
        mem,
        shared_rt,
        quick,
    })
}

fn main() -> ExitCode {
    let opts = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("meta_commit: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    let root = TempRoot::new();
    let outcome = run(&opts, &root);
    drop(root);
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("meta_commit: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(opts: &Options, root: &TempRoot) -> BenchResult<()> {
    let fsync = if opts.mem {
        None
    } else {
        Some(fsync_probe(&root.path, 200)?)
    };
    let driver = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("bench-driver")
        .enable_all()
        .build()
        .map_err(|e| format!("driver runtime: {e}"))?;
    let load_before = loadavg();
    let started = Instant::now();
    let report = driver.block_on(bench(opts, root))?;
    let load_after = loadavg();
    // Node runtimes are gone by now; the driver's last tasks are not worth waiting for.
    driver.shutdown_timeout(Duration::from_secs(2));
    print_report(
        opts,
        root,
        fsync.as_ref(),
        &report,
        &load_before,
        &load_after,
        started.elapsed(),
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The cluster
// ---------------------------------------------------------------------------------------

/// The temporary folder of one bench run, removed on drop.
struct TempRoot {
    path: PathBuf,
}

impl TempRoot {
    fn new() -> TempRoot {
        let path = std::env::temp_dir().join(format!("warren-meta-bench-{}", std::process::id()));
        TempRoot { path }
    }
}

impl Drop for TempRoot {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                eprintln!("meta_commit: cannot remove {}: {e}", self.path.display());
            }
        }
    }
}

fn raft_config() -> MetaRaftConfig {
    MetaRaftConfig {
        cluster_name: CLUSTER.into(),
        ..MetaRaftConfig::default()
    }
}

fn link_config(id: NodeId) -> NodeLinkConfig {
    NodeLinkConfig::new(CLUSTER, id)
}

fn declare_queue(name: String) -> Command {
    Command::DeclareQueue(QueueDef {
        vhost: "/".into(),
        name,
        durable: true,
        exclusive_owner: None,
        auto_delete: false,
        arguments: FieldTable::default(),
        home: 0,
    })
}

/// Awaits `fut` for at most `limit`.
async fn bounded<T>(what: &str, limit: Duration, fut: impl Future<Output = T>) -> BenchResult<T> {
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| format!("{what}: no outcome within {limit:?}"))
}

/// Proposes `command` on `node` and insists on an applied, accepted outcome.
async fn commit(node: &MetaRaft, command: Command) -> BenchResult<MetaResponse> {
    let resp = bounded("proposal", PROPOSE_BOUND, node.propose(command))
        .await?
        .map_err(|e| format!("proposal on node {} failed: {e}", node.id()))?;
    if let Err(rejected) = &resp.outcome {
        return Err(format!(
            "command at index {} was rejected: {rejected}",
            resp.index
        ));
    }
    Ok(resp)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

struct Member {
    raft: MetaRaft,
    link: TcpTransport,
}

/// Three nodes on ephemeral loopback ports, each on its own runtime unless `--shared-rt`.
struct Cluster {
    members: BTreeMap<NodeId, Member>,
    runtimes: Vec<Runtime>,
}

impl Cluster {
    /// Starts and initialises a cluster whose nodes keep their data under `dir` (unless
    /// `--mem`); `seed_base` varies the election timeouts between clusters.
    async fn start(opts: &Options, dir: &Path, seed_base: u64) -> BenchResult<Cluster> {
        let mut cluster = Cluster {
            members: BTreeMap::new(),
            runtimes: Vec::new(),
        };
        let mut handles = BTreeMap::new();
        for id in 1..=NODES {
            let handle = if opts.shared_rt {
                Handle::current()
            } else {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name(format!("node-{id}"))
                    .enable_all()
                    .build()
                    .map_err(|e| format!("runtime of node {id}: {e}"))?;
                let handle = rt.handle().clone();
                cluster.runtimes.push(rt);
                handle
            };
            handles.insert(id, handle);
        }
        // Every listener is up before any node starts, so the first calls find their peers.
        let mut links = BTreeMap::new();
        for (&id, handle) in &handles {
            let bind = handle.spawn(TcpTransport::bind("127.0.0.1:0", link_config(id)));
            let link = bounded("bind", STEP_BOUND, bind)
                .await?
                .map_err(|e| format!("bind task: {e}"))?
                .map_err(|e| format!("node {id} cannot listen: {e}"))?;
            links.insert(id, link);
        }
        let addrs: BTreeMap<NodeId, String> = links
            .iter()
            .map(|(&id, l)| (id, l.local_addr().to_string()))
            .collect();
        for (id, link) in &links {
            for (peer, addr) in &addrs {
                if peer != id {
                    link.set_peer(*peer, addr.clone());
                }
            }
        }
        for (id, link) in links {
            let disk: Arc<dyn Disk> = if opts.mem {
                Arc::new(MemDisk::new())
            } else {
                Arc::new(FileDisk::new())
            };
            let path = if opts.mem {
                PathBuf::from("/raft")
            } else {
                dir.join(format!("node-{id}"))
            };
            let transport = link.clone();
            let seed = seed_base + id;
            let start = handles[&id].spawn(async move {
                MetaRaft::start(id, transport, disk, &path, &raft_config(), seed)
                    .await
                    .map_err(|e| e.to_string())
            });
            let raft = bounded("start", STEP_BOUND, start)
                .await?
                .map_err(|e| format!("start task: {e}"))?
                .map_err(|e| format!("node {id} does not start: {e}"))?;
            link.serve(raft.rpc_server());
            cluster.members.insert(id, Member { raft, link });
        }
        bounded(
            "initialise",
            STEP_BOUND,
            cluster.members[&1].raft.initialize(addrs),
        )
        .await?
        .map_err(|e| format!("initialise: {e}"))?;
        Ok(cluster)
    }

    fn node(&self, id: NodeId) -> &MetaRaft {
        &self.members[&id].raft
    }

    /// Waits until a running node leads and every running node knows it.
    async fn settled_leader(&self) -> BenchResult<NodeId> {
        let leader = bounded("leader election", STEP_BOUND, async {
            loop {
                if let Some((&id, _)) = self.members.iter().find(|(_, m)| m.raft.is_leader()) {
                    return id;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await?;
        for (id, m) in &self.members {
            if m.raft
                .wait_for_leader(STEP_BOUND, |l| l == leader)
                .await
                .is_none()
            {
                return Err(format!("node {id} never learnt that {leader} leads"));
            }
        }
        Ok(leader)
    }

    /// Stops node `id` like a crashed process: Raft stops, its listener and links close.
    async fn kill(&mut self, id: NodeId) -> BenchResult<()> {
        let m = self
            .members
            .remove(&id)
            .ok_or_else(|| format!("node {id} is not running"))?;
        let stopped = bounded("shutdown", STEP_BOUND, m.raft.shutdown()).await;
        m.link.shutdown();
        stopped?.map_err(|e| format!("node {id} shutdown: {e}"))
    }

    async fn stop(mut self) -> BenchResult<()> {
        let ids: Vec<NodeId> = self.members.keys().copied().collect();
        let mut first_err = None;
        for id in ids {
            if let Err(e) = self.kill(id).await {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for m in self.members.values() {
            m.link.shutdown();
        }
        // Allowed from async code, unlike dropping a runtime; it kills whatever remains.
        for rt in self.runtimes.drain(..) {
            rt.shutdown_background();
        }
    }
}

// ---------------------------------------------------------------------------------------
// Measurements
// ---------------------------------------------------------------------------------------

struct Phase {
    name: String,
    in_flight: usize,
    queues_before: usize,
    wall: Duration,
    hist: Histogram<u64>,
    /// p50 of the first and of the last tenth of a sequential run, in µs.
    drift: Option<(u64, u64)>,
}

fn new_hist() -> BenchResult<Histogram<u64>> {
    // 1 µs .. 10 min, 3 significant digits.
    Histogram::new_with_bounds(1, 600_000_000, 3).map_err(|e| format!("histogram: {e}"))
}

fn queue_count(node: &MetaRaft) -> usize {
    node.snapshot().vhost("/").map_or(0, |v| v.queues.len())
}

fn median(sorted: &[u64]) -> u64 {
    sorted.get(sorted.len() / 2).copied().unwrap_or(0)
}

async fn sequential(node: &MetaRaft, prefix: &str, n: usize) -> BenchResult<Phase> {
    let queues_before = queue_count(node);
    let mut hist = new_hist()?;
    let mut samples = Vec::with_capacity(n);
    let started = Instant::now();
    for i in 0..n {
        let t = Instant::now();
        commit(node, declare_queue(format!("{prefix}-{i}"))).await?;
        let us = micros(t.elapsed());
        hist.saturating_record(us);
        samples.push(us);
    }
    let wall = started.elapsed();
    let tenth = (n / 10).max(1);
    let mut first = samples[..tenth.min(n)].to_vec();
    let mut last = samples[n.saturating_sub(tenth)..].to_vec();
    first.sort_unstable();
    last.sort_unstable();
    Ok(Phase {
        name: "sequential".into(),
        in_flight: 1,
        queues_before,
        wall,
        hist,
        drift: Some((median(&first), median(&last))),
    })
}

async fn concurrent(
    node: &MetaRaft,
    prefix: &str,
    n: usize,
    in_flight: usize,
) -> BenchResult<Phase> {
    let queues_before = queue_count(node);
    let next = Arc::new(AtomicUsize::new(0));
    let mut workers = JoinSet::new();
    let started = Instant::now();
    for _ in 0..in_flight {
        let node = node.clone();
        let next = Arc::clone(&next);
        let prefix = prefix.to_string();
        workers.spawn(async move {
            let mut samples = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return Ok::<_, String>(samples);
                }
                let t = Instant::now();
                commit(&node, declare_queue(format!("{prefix}-{i}"))).await?;
                samples.push(micros(t.elapsed()));
            }
        });
    }
    let limit =
        Duration::from_secs(60) + Duration::from_millis(20) * u32::try_from(n).unwrap_or(u32::MAX);
    let deadline = tokio::time::Instant::now() + limit;
    let mut hist = new_hist()?;
    loop {
        let joined = tokio::time::timeout_at(deadline, workers.join_next())
            .await
            .map_err(|_| format!("{in_flight} in flight: not done within {limit:?}"))?;
        let Some(joined) = joined else { break };
        let samples = joined.map_err(|e| format!("proposer task: {e}"))??;
        for us in samples {
            hist.saturating_record(us);
        }
    }
    let wall = started.elapsed();
    Ok(Phase {
        name: "concurrent".into(),
        in_flight,
        queues_before,
        wall,
        hist,
        drift: None,
    })
}

struct Failover {
    old: NodeId,
    new: NodeId,
    shutdown: Duration,
    elected: Duration,
    committed: Duration,
}

/// Kills the leader of a fresh cluster and times the way back to a commit.
async fn failover(opts: &Options, dir: &Path, run: u64) -> BenchResult<Failover> {
    let mut cluster = Cluster::start(opts, dir, 1000 * (run + 2)).await?;
    let leader = cluster.settled_leader().await?;
    commit(cluster.node(leader), Command::AddVhost { name: "/".into() }).await?;
    for i in 0..20 {
        commit(cluster.node(leader), declare_queue(format!("pre-{i}"))).await?;
    }
    // Let heartbeats flow in the steady state before the crash.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let t0 = Instant::now();
    cluster.kill(leader).await?;
    let shutdown = t0.elapsed();
    let (new, elected) = bounded("re-election", STEP_BOUND, async {
        loop {
            if let Some((&id, _)) = cluster.members.iter().find(|(_, m)| m.raft.is_leader()) {
                return (id, t0.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await?;
    // The new leader's first proposal (openraft may still be settling: retry briefly).
    let committed = bounded("first commit after failover", STEP_BOUND, async {
        let mut i = 0;
        loop {
            let leader = cluster
                .members
                .iter()
                .find(|(_, m)| m.raft.is_leader())
                .map(|(&id, _)| id);
            if let Some(id) = leader {
                match cluster
                    .node(id)
                    .propose(declare_queue(format!("post-{i}")))
                    .await
                {
                    Ok(r) if r.outcome.is_ok() => return Ok(t0.elapsed()),
                    Ok(r) => return Err(format!("rejected after failover: {:?}", r.outcome)),
                    // Leadership still settling: try again (a fresh queue name each time, so
                    // an attempt whose outcome is unknown cannot make a later one fail).
                    Err(ProposeError::NotLeader { .. } | ProposeError::NoLeader { .. }) => {}
                    Err(e) if e.outcome_unknown() => {}
                    Err(e) => return Err(format!("proposal after failover: {e}")),
                }
                i += 1;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await??;
    cluster.stop().await?;
    Ok(Failover {
        old: leader,
        new,
        shutdown,
        elected,
        committed,
    })
}

/// Proposals on a follower, which forwards them to the leader.
struct Forwarded {
    follower: NodeId,
    leader: NodeId,
    /// Sequential and concurrent runs on the follower.
    phases: Vec<Phase>,
    /// Alternating leader / follower proposals: (leader, follower) latencies in µs.
    paired: (Histogram<u64>, Histogram<u64>),
}

/// Alternates a proposal on `leader` with one on `follower`, `pairs` times.
async fn paired(
    leader: &MetaRaft,
    follower: &MetaRaft,
    pairs: usize,
) -> BenchResult<(Histogram<u64>, Histogram<u64>)> {
    let (mut on_leader, mut on_follower) = (new_hist()?, new_hist()?);
    for i in 0..pairs {
        for (node, hist, tag) in [
            (leader, &mut on_leader, "l"),
            (follower, &mut on_follower, "f"),
        ] {
            let t = Instant::now();
            commit(node, declare_queue(format!("pair-{tag}-{i}"))).await?;
            hist.saturating_record(micros(t.elapsed()));
        }
    }
    Ok((on_leader, on_follower))
}

/// Proposals on a follower of a fresh cluster, so queue counts match the leader's phases.
async fn forwarded(opts: &Options, dir: &Path) -> BenchResult<Forwarded> {
    let cluster = Cluster::start(opts, dir, 500).await?;
    let leader = cluster.settled_leader().await?;
    commit(cluster.node(leader), Command::AddVhost { name: "/".into() }).await?;
    let follower = cluster
        .members
        .keys()
        .copied()
        .find(|&id| id != leader)
        .ok_or("no follower")?;
    let node = cluster.node(follower);
    // Warm-up: links, allocators, page cache, the forwarding path. Not measured.
    for i in 0..(opts.n / 10).clamp(10, 100) {
        commit(node, declare_queue(format!("warm-{i}"))).await?;
    }
    let mut phases = vec![sequential(node, "seq", opts.n).await?];
    tokio::time::sleep(Duration::from_millis(200)).await;
    phases.push(concurrent(node, "c16", opts.n, 16).await?);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let paired = paired(cluster.node(leader), node, (opts.n / 2).max(1)).await?;
    if !cluster.node(leader).is_leader() {
        return Err(format!(
            "node {leader} lost its leadership during the follower runs"
        ));
    }
    cluster.stop().await?;
    Ok(Forwarded {
        follower,
        leader,
        phases,
        paired,
    })
}

struct Report {
    phases: Vec<Phase>,
    forwarded: Forwarded,
    failovers: Vec<Failover>,
    snapshot_built: Option<bool>,
}

async fn bench(opts: &Options, root: &TempRoot) -> BenchResult<Report> {
    let dir = root.path.join("main");
    let cluster = Cluster::start(opts, &dir, 1000).await?;
    let leader_id = cluster.settled_leader().await?;
    let leader = cluster.node(leader_id).clone();
    commit(&leader, Command::AddVhost { name: "/".into() }).await?;
    // Warm-up: links, allocators, page cache. Not measured.
    for i in 0..(opts.n / 10).clamp(10, 100) {
        commit(&leader, declare_queue(format!("warm-{i}"))).await?;
    }
    let mut phases = vec![sequential(&leader, "seq", opts.n).await?];
    for in_flight in [16, 64] {
        tokio::time::sleep(Duration::from_millis(200)).await;
        phases.push(concurrent(&leader, &format!("c{in_flight}"), opts.n, in_flight).await?);
    }
    if !leader.is_leader() {
        return Err(format!(
            "node {leader_id} lost its leadership during the run"
        ));
    }
    cluster.stop().await?;
    let snapshot_built =
        (!opts.mem).then(|| dir.join(format!("node-{leader_id}/snapshot")).exists());
    let forwarded = forwarded(opts, &root.path.join("forward")).await?;

    let mut failovers = Vec::new();
    for run in 0..opts.failover_runs {
        let run = u64::try_from(run).unwrap_or(u64::MAX);
        let dir = root.path.join(format!("failover-{run}"));
        failovers.push(failover(opts, &dir, run).await?);
    }
    Ok(Report {
        phases,
        forwarded,
        failovers,
        snapshot_built,
    })
}

/// Raw cost of the durability primitive the log relies on: append ~100 bytes, fdatasync.
fn fsync_probe(dir: &Path, rounds: usize) -> BenchResult<Histogram<u64>> {
    std::fs::create_dir_all(dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
    let path = dir.join("fsync-probe");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| format!("open {}: {e}", path.display()))?;
    let mut hist = new_hist()?;
    let record = [0x5Au8; 100];
    for _ in 0..rounds {
        let t = Instant::now();
        f.write_all(&record)
            .and_then(|()| f.sync_data())
            .map_err(|e| format!("fsync probe: {e}"))?;
        hist.saturating_record(micros(t.elapsed()));
    }
    drop(f);
    let _ = std::fs::remove_file(&path);
    Ok(hist)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "n/a".into())
}

// ---------------------------------------------------------------------------------------
// Output
// ---------------------------------------------------------------------------------------

fn per_sec(count: u64, wall: Duration) -> f64 {
    count as f64 / wall.as_secs_f64().max(1e-9)
}

fn ms(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1000.0)
}

/// A table of phases (the leader's and the follower's runs).
fn print_phases(phases: &[Phase]) {
    println!("| phase | in flight | commits | queues before | p50 µs | p90 µs | p99 µs | max µs | commits/s |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for p in phases {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.0} |",
            p.name,
            p.in_flight,
            p.hist.len(),
            p.queues_before,
            p.hist.value_at_quantile(0.50),
            p.hist.value_at_quantile(0.90),
            p.hist.value_at_quantile(0.99),
            p.hist.max(),
            per_sec(p.hist.len(), p.wall)
        );
    }
}

fn print_forwarded(f: &Forwarded) {
    println!(
        "\n### Proposals on a follower (fresh cluster; node {}, forwarded to the leader, node {})\n",
        f.follower, f.leader
    );
    print_phases(&f.phases);
    for p in &f.phases {
        if let Some((first, last)) = p.drift {
            println!(
                "\nSequential p50 over the first tenth: {first} µs; over the last tenth: {last} µs."
            );
        }
    }
    let (on_leader, on_follower) = &f.paired;
    println!(
        "\nPaired, {} rounds of one proposal on the leader then one on the follower (same queue counts):\n",
        on_leader.len()
    );
    println!("| proposed on | p50 µs | p90 µs | p99 µs | max µs |");
    println!("|---|---:|---:|---:|---:|");
    for (name, h) in [("leader", on_leader), ("follower", on_follower)] {
        println!(
            "| {name} | {} | {} | {} | {} |",
            h.value_at_quantile(0.50),
            h.value_at_quantile(0.90),
            h.value_at_quantile(0.99),
            h.max()
        );
    }
    let p50 = |h: &Histogram<u64>| i128::from(h.value_at_quantile(0.50));
    println!(
        "\nThe forwarding hop adds {} µs at p50.",
        p50(on_follower) - p50(on_leader)
    );
}

fn print_report(
    opts: &Options,
    root: &TempRoot,
    fsync: Option<&Histogram<u64>>,
    report: &Report,
    load_before: &str,
    load_after: &str,
    total: Duration,
) {
    let cfg = raft_config();
    let link = link_config(1);
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!("## meta_commit: 3-node metadata Raft over TCP loopback\n");
    println!(
        "- storage: {}",
        if opts.mem {
            "MemDisk (no fsync)".to_string()
        } else {
            format!("FileDisk with fsync under {}", root.path.display())
        }
    );
    println!(
        "- runtimes: {}; {cores} CPUs; load average {load_before} before, {load_after} after",
        if opts.shared_rt {
            "all nodes on the driver's 2-worker runtime".to_string()
        } else {
            "one 2-worker runtime per node + a 2-worker driver".to_string()
        }
    );
    println!(
        "- raft: heartbeat {:?}, election timeout {:?}..{:?}, snapshot every {} entries; link heartbeat {:?}",
        cfg.heartbeat,
        cfg.election_timeout_min,
        cfg.election_timeout_max,
        cfg.snapshot_after,
        link.heartbeat_interval
    );
    println!(
        "- N = {} per phase{}",
        opts.n,
        if opts.quick { " (quick)" } else { "" }
    );
    if let Some(h) = fsync {
        println!(
            "- raw 100-byte append + fdatasync in the same folder: p50 {} µs, p99 {} µs, max {} µs ({} rounds)",
            h.value_at_quantile(0.50),
            h.value_at_quantile(0.99),
            h.max(),
            h.len()
        );
    }
    println!();
    println!("### Commit latency and queue.declare rate (proposals on the leader)\n");
    print_phases(&report.phases);
    for p in &report.phases {
        if let Some((first, last)) = p.drift {
            println!(
                "\nSequential p50 over the first tenth: {first} µs; over the last tenth: {last} µs."
            );
        }
    }
    if let Some(built) = report.snapshot_built {
        println!(
            "Snapshot file on the leader at the end: {}.",
            if built { "yes" } else { "no" }
        );
    }
    print_forwarded(&report.forwarded);
    println!("\n### Leader failover (fresh cluster per run; t0 = shutdown of the leader begins)\n");
    println!("| run | old leader | new leader | shutdown ms | new leader ms | first commit ms |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for (i, f) in report.failovers.iter().enumerate() {
        println!(
            "| {} | {} | {} | {} | {} | {} |",
            i + 1,
            f.old,
            f.new,
            ms(f.shutdown),
            ms(f.elected),
            ms(f.committed)
        );
    }
    let summary = |pick: fn(&Failover) -> Duration| {
        let mut v: Vec<Duration> = report.failovers.iter().map(pick).collect();
        v.sort_unstable();
        match (v.first(), v.get(v.len() / 2), v.last()) {
            (Some(a), Some(b), Some(c)) => format!("{} / {} / {}", ms(*a), ms(*b), ms(*c)),
            _ => "n/a".into(),
        }
    };
    println!(
        "\nFailover min / median / max: new leader {} ms; first commit {} ms.",
        summary(|f| f.elected),
        summary(|f| f.committed)
    );
    println!("\nTotal bench time {:.1} s.", total.as_secs_f64());
}
