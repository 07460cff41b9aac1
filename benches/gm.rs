//! The GM ring (guaranteed multicast, RabbitMQ's gm.erl redone) over real TCP on loopback,
//! with 3 and with 5 members.
//!
//! Every node is a [`MetaRaft`] member plus a [`GmHost`], each on its own tokio runtime (two
//! workers), as separate processes would be, talking over [`TcpTransport`] node links on
//! 127.0.0.1 with the production timings of a clustered node (`[cluster]` defaults for the
//! link heartbeat and peer timeout, `MetaRaftConfig::default()`, `GmHostConfig::default()`).
//! The Raft logs are in memory ([`MemDisk`]): GM does not touch the disk, and the metadata
//! only carries the group record (one commit per join and one `NodeDown`). `--shared-rt`
//! puts every node on the driver's runtime instead. One member per node joins the group,
//! one after another; each then makes one confirmed broadcast (warm-up: the joiners get
//! their state) before anything is measured. Every member's events are drained and counted
//! by its own task on its node's runtime. Payloads are 1 KiB.
//!
//! Measured, printed as Markdown tables, for 3 and for 5 members (a fresh cluster each):
//! 1. throughput: every member makes `--count` confirmed broadcasts with `--window` in
//!    flight; total confirmed broadcasts/s (until the last member's last confirm), each
//!    member's delivered messages/s (until it delivered every member's messages), and the
//!    confirm latency at that load;
//! 2. lap latency: one member makes `--seq` confirmed broadcasts one at a time (time from
//!    the call to the confirm): p50/p90/p99/max, with the others idle, then with the others
//!    broadcasting in the background, one confirm in flight each (light load) and
//!    `--bg-window` in flight each (near saturation);
//! 3. a member death: every member broadcasts steadily (`--bg-window` in flight each), one
//!    node that is not the Raft leader is killed (its node links and Raft shut down, its
//!    runtime dropped, as in a crash), and after a short pause `NodeDown` for it is committed
//!    through the Raft leader (a survivor), which is what the cluster's failure detector
//!    does on the leader once the peer has been silent for `peer_timeout_ms`. Reported: the time from the `NodeDown`
//!    commit, and from the kill, to the first confirm completed afterwards at each survivor
//!    (laps complete again), the longest gap between two confirms, and the survivors'
//!    confirms/s before and after. The detector's timeout is not in these figures; it is
//!    printed separately ("detection time excluded"). The pause stands in for it, so that
//!    laps which had passed the dead member before it died have completed by the commit.
//!
//! ```text
//! cargo bench --bench gm -- [--quick] [--count N] [--window W] [--seq N] [--bg-window W]
//!                           [--max-batch N] [--shared-rt]
//! ```
//!
//! Without `--bench` (which `cargo bench` passes), as under `cargo test --all-targets`, it
//! runs the `--quick` smoke version.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use tokio::runtime::{Handle, Runtime};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::AbortHandle;
use warren::config::ClusterConfig;
use warren::gm::Event;
use warren::meta::Command;
use warren::runtime::gm_host::{GmError, GmHandle, GmHost, GmHostConfig};
use warren::runtime::node_link::{NodeLinkConfig, TcpTransport};
use warren::runtime::raft::{MetaRaft, MetaRaftConfig, NodeId};
use warren::store::{Disk, MemDisk};

const CLUSTER: &str = "gm-bench";
const GROUP: &str = "bench";
const PAYLOAD_BYTES: usize = 1024;
const SIZES: [u64; 2] = [3, 5];
/// Longest wait for a start-up, a join, a leader, a shutdown or a commit.
const STEP_BOUND: Duration = Duration::from_secs(20);
/// Longest wait, once told to stop, for a member's confirms still in flight.
const DRAIN_BOUND: Duration = Duration::from_secs(15);
/// Longest wait after `NodeDown` for every survivor's laps to complete again.
const RECOVERY_BOUND: Duration = Duration::from_secs(20);
/// The failure detector's tick (`watch_nodes` in `src/runtime/cluster.rs`).
const DETECTOR_TICK: Duration = Duration::from_millis(200);

type BenchResult<T> = Result<T, String>;

#[derive(Clone, Debug)]
struct Options {
    count: u64,
    window: usize,
    seq: u64,
    bg_window: usize,
    /// Steady broadcasting before the kill, and after the laps complete again.
    steady_before: Duration,
    steady_after: Duration,
    /// Between the kill and the `NodeDown` proposal (stands in for the detection time).
    pause: Duration,
    /// Messages per GM frame at most (`GmHostConfig::max_batch`).
    max_batch: usize,
    shared_rt: bool,
    quick: bool,
}

const USAGE: &str = "usage: cargo bench --bench gm -- [--quick] [--count N] [--window W] [--seq N] [--bg-window W] [--max-batch N] [--shared-rt]
  --count N      confirmed broadcasts per member in the throughput phase (default 50000; 300 with --quick)
  --window W     confirms in flight per member in the throughput phase (default 1000; 100 with --quick)
  --seq N        sequential confirmed broadcasts per latency run (default 2000; 50 with --quick)
  --bg-window W  confirms in flight per background member (latency under load, member death;
                 default 100; 10 with --quick)
  --quick        small smoke run (also the default when cargo does not pass --bench)
  --max-batch N  messages per GM frame at most (default: GmHostConfig's, 256)
  --shared-rt    every node on the driver's runtime instead of one 2-worker runtime per node";

fn parse_args() -> Result<Options, String> {
    let mut count = None;
    let mut window = None;
    let mut seq = None;
    let mut bg_window = None;
    let mut quick = false;
    let mut bench = false;
    let mut shared_rt = false;
    let mut max_batch = None;
    let mut args = std::env::args().skip(1);
    let number = |name: &str, v: Option<String>| -> Result<u64, String> {
        let v = v.ok_or(format!("{name} needs a value"))?;
        let n: u64 = v.parse().map_err(|e| format!("{name} {v}: {e}"))?;
        if n == 0 {
            return Err(format!("{name} must be at least 1"));
        }
        Ok(n)
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--count" => count = Some(number("--count", args.next())?),
            "--window" => window = Some(number("--window", args.next())?),
            "--seq" => seq = Some(number("--seq", args.next())?),
            "--bg-window" => bg_window = Some(number("--bg-window", args.next())?),
            "--quick" => quick = true,
            "--bench" => bench = true,
            "--shared-rt" => shared_rt = true,
            "--max-batch" => max_batch = Some(number("--max-batch", args.next())?),
            "-h" | "--help" => return Err(String::new()),
            other if other.starts_with('-') => return Err(format!("unknown option {other}")),
            // `cargo bench FILTER` hands the filter to every bench binary: not ours to judge.
            other => eprintln!("ignoring argument {other:?}"),
        }
    }
    let quick = quick || !bench;
    let usize_of = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    Ok(Options {
        count: count.unwrap_or(if quick { 300 } else { 50_000 }),
        window: window.map_or(if quick { 100 } else { 1000 }, usize_of),
        seq: seq.unwrap_or(if quick { 50 } else { 2000 }),
        bg_window: bg_window.map_or(if quick { 10 } else { 100 }, usize_of),
        steady_before: Duration::from_millis(if quick { 300 } else { 2000 }),
        steady_after: Duration::from_millis(if quick { 500 } else { 2000 }),
        pause: Duration::from_millis(if quick { 200 } else { 500 }),
        max_batch: max_batch.map_or(GmHostConfig::default().max_batch, usize_of),
        shared_rt,
        quick,
    })
}

fn main() -> ExitCode {
    let opts = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("gm: {e}");
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
    match run(&opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gm: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(opts: &Options) -> BenchResult<()> {
    let defaults = cluster_defaults()?;
    let driver = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("bench-driver")
        .enable_all()
        .build()
        .map_err(|e| format!("driver runtime: {e}"))?;
    let load_before = loadavg();
    let started = Instant::now();
    let mut reports = Vec::new();
    for (i, &n) in SIZES.iter().enumerate() {
        let seed = 1000 * (u64::try_from(i).unwrap_or(0) + 1);
        let report = driver.block_on(bench_size(opts, &defaults, n, seed))?;
        reports.push(report);
    }
    let load_after = loadavg();
    // Node runtimes are gone by now; the driver's last tasks are not worth waiting for.
    driver.shutdown_timeout(Duration::from_secs(2));
    print_report(
        opts,
        &defaults,
        &reports,
        &load_before,
        &load_after,
        started.elapsed(),
    );
    Ok(())
}

/// The `[cluster]` defaults of a node's config file (only the required keys given).
fn cluster_defaults() -> BenchResult<ClusterConfig> {
    toml::from_str(&format!(
        "node_id = 1\ncluster_id = \"{CLUSTER}\"\nlisten = \"127.0.0.1:0\"\n"
    ))
    .map_err(|e| format!("default [cluster] section: {e}"))
}

// ---------------------------------------------------------------------------------------
// The cluster
// ---------------------------------------------------------------------------------------

/// What a clustered node sets from its `[cluster]` section (`src/runtime/cluster.rs`).
fn link_config(cc: &ClusterConfig, id: NodeId) -> NodeLinkConfig {
    NodeLinkConfig {
        heartbeat_interval: Duration::from_millis(cc.heartbeat_ms),
        peer_timeout: Duration::from_millis(cc.peer_timeout_ms),
        ..NodeLinkConfig::new(CLUSTER, id)
    }
}

fn gm_config(opts: &Options) -> GmHostConfig {
    GmHostConfig {
        max_batch: opts.max_batch,
        ..GmHostConfig::default()
    }
}

fn raft_config(cc: &ClusterConfig) -> MetaRaftConfig {
    MetaRaftConfig {
        cluster_name: CLUSTER.into(),
        propose_timeout: Duration::from_millis(cc.commit_timeout_ms),
        ..MetaRaftConfig::default()
    }
}

/// Awaits `fut` for at most `limit`.
async fn bounded<T>(what: &str, limit: Duration, fut: impl Future<Output = T>) -> BenchResult<T> {
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| format!("{what}: no outcome within {limit:?}"))
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// What a member's task counts as its events come (read by the driver at any time).
#[derive(Default)]
struct Stats {
    delivered: AtomicU64,
    confirmed: AtomicU64,
    deaths_seen: AtomicU64,
    stopped: AtomicBool,
}

/// The driver's end of one member: its task takes jobs and drains the member's events.
struct Member {
    jobs: mpsc::UnboundedSender<Job>,
    stats: Arc<Stats>,
    task: AbortHandle,
}

struct Node {
    raft: MetaRaft,
    link: TcpTransport,
    host: GmHost<TcpTransport>,
    handle: Handle,
    /// `None` with `--shared-rt`.
    rt: Option<Runtime>,
    member: Option<Member>,
}

/// `n` nodes on ephemeral loopback ports, each on its own runtime unless `--shared-rt`.
struct Cluster {
    nodes: BTreeMap<NodeId, Node>,
}

impl Cluster {
    async fn start(opts: &Options, cc: &ClusterConfig, n: u64, seed: u64) -> BenchResult<Cluster> {
        let mut runtimes = BTreeMap::new();
        for id in 1..=n {
            if opts.shared_rt {
                runtimes.insert(id, (Handle::current(), None));
            } else {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name(format!("node-{id}"))
                    .enable_all()
                    .build()
                    .map_err(|e| format!("runtime of node {id}: {e}"))?;
                runtimes.insert(id, (rt.handle().clone(), Some(rt)));
            }
        }
        // Every listener is up before any node starts, so the first calls find their peers.
        let mut links = BTreeMap::new();
        for (&id, (handle, _)) in &runtimes {
            let bind = handle.spawn(TcpTransport::bind("127.0.0.1:0", link_config(cc, id)));
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
        let mut cluster = Cluster {
            nodes: BTreeMap::new(),
        };
        for (id, link) in links {
            let (handle, rt) = runtimes.remove(&id).ok_or("runtime missing")?;
            let disk: Arc<dyn Disk> = Arc::new(MemDisk::new());
            let transport = link.clone();
            let config = raft_config(cc);
            let start = handle.spawn(async move {
                MetaRaft::start(id, transport, disk, Path::new("/raft"), &config, seed + id)
                    .await
                    .map_err(|e| e.to_string())
            });
            let raft = bounded("start", STEP_BOUND, start)
                .await?
                .map_err(|e| format!("start task: {e}"))?
                .map_err(|e| format!("node {id} does not start: {e}"))?;
            link.serve(raft.rpc_server());
            let host = GmHost::new(id, link.clone(), raft.clone(), gm_config(opts));
            let frames = host.clone();
            link.serve_gm(Arc::new(move |f: &bytes::Bytes| frames.handle_frame(f)));
            cluster.nodes.insert(
                id,
                Node {
                    raft,
                    link,
                    host,
                    handle,
                    rt,
                    member: None,
                },
            );
        }
        bounded(
            "initialise",
            STEP_BOUND,
            cluster.nodes[&1].raft.initialize(addrs),
        )
        .await?
        .map_err(|e| format!("initialise: {e}"))?;
        Ok(cluster)
    }

    /// Waits until a node leads and every node knows it.
    async fn settled_leader(&self) -> BenchResult<NodeId> {
        let leader = bounded("leader election", STEP_BOUND, async {
            loop {
                if let Some((&id, _)) = self.nodes.iter().find(|(_, n)| n.raft.is_leader()) {
                    return id;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await?;
        for (id, n) in &self.nodes {
            if n.raft
                .wait_for_leader(STEP_BOUND, |l| l == leader)
                .await
                .is_none()
            {
                return Err(format!("node {id} never learnt that {leader} leads"));
            }
        }
        Ok(leader)
    }

    /// One member per node joins, in node order; each makes one confirmed broadcast before
    /// the next joins, then all are quiet.
    async fn join_all(&mut self) -> BenchResult<()> {
        let payload = Bytes::from(vec![0x5A_u8; PAYLOAD_BYTES]);
        for (&id, node) in self.nodes.iter_mut() {
            let host = node.host.clone();
            // On the node's runtime: the member's tasks are spawned where it joins.
            let join = node
                .handle
                .spawn(async move { host.join(GROUP, false).await });
            let handle = bounded("join", STEP_BOUND, join)
                .await?
                .map_err(|e| format!("join task: {e}"))?
                .map_err(|e| format!("node {id} cannot join: {e}"))?;
            let (jobs, rx) = mpsc::unbounded_channel();
            let stats = Arc::new(Stats::default());
            let task = node
                .handle
                .spawn(member_task(handle, rx, Arc::clone(&stats), payload.clone()))
                .abort_handle();
            let member = Member { jobs, stats, task };
            let out = member
                .run(Job::counted(1, 1, None), STEP_BOUND)
                .await
                .map_err(|e| format!("warm-up broadcast of node {id}: {e}"))?;
            if let Some(e) = out.error {
                return Err(format!("warm-up broadcast of node {id}: {e}"));
            }
            node.member = Some(member);
        }
        self.quiesce().await
    }

    fn members(&self) -> impl Iterator<Item = (NodeId, &Member)> {
        self.nodes
            .iter()
            .filter_map(|(&id, n)| n.member.as_ref().map(|m| (id, m)))
    }

    fn member(&self, id: NodeId) -> BenchResult<&Member> {
        self.nodes
            .get(&id)
            .and_then(|n| n.member.as_ref())
            .ok_or_else(|| format!("no member on node {id}"))
    }

    /// Waits until no member's delivery count moved for 100 ms.
    async fn quiesce(&self) -> BenchResult<()> {
        let counts = || -> Vec<u64> {
            self.members()
                .map(|(_, m)| m.stats.delivered.load(Ordering::Relaxed))
                .collect()
        };
        bounded("quiet ring", STEP_BOUND, async {
            let mut last = counts();
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let now = counts();
                if now == last {
                    return;
                }
                last = now;
            }
        })
        .await
    }

    /// Stops node `id` like a crashed process: its member's driver task goes, its links
    /// close, its Raft stops, its runtime (and every GM task on it) is dropped.
    async fn kill(&mut self, id: NodeId) -> BenchResult<()> {
        let node = self
            .nodes
            .remove(&id)
            .ok_or_else(|| format!("node {id} is not running"))?;
        if let Some(m) = &node.member {
            m.task.abort();
        }
        node.link.shutdown();
        let stopped = bounded("shutdown", STEP_BOUND, node.raft.shutdown()).await;
        if let Some(rt) = node.rt {
            rt.shutdown_background();
        }
        stopped?.map_err(|e| format!("node {id} shutdown: {e}"))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in std::mem::take(&mut self.nodes).into_values() {
            if let Some(m) = &node.member {
                m.task.abort();
            }
            node.link.shutdown();
            // Allowed from async code, unlike dropping a runtime; it kills whatever remains.
            if let Some(rt) = node.rt {
                rt.shutdown_background();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// A member's task
// ---------------------------------------------------------------------------------------

/// Confirmed broadcasts for a member's task to make.
struct Job {
    /// How many; `None`: until `stop`.
    count: Option<u64>,
    /// At most this many in flight.
    window: usize,
    /// The job also waits until the member's delivery count reaches this.
    deliver_target: Option<u64>,
    stop: Option<watch::Receiver<bool>>,
    /// Keep the completion time of every confirm.
    keep_completions: bool,
    deadline: Duration,
    reply: Option<oneshot::Sender<JobOut>>,
}

impl Job {
    fn counted(count: u64, window: usize, deliver_target: Option<u64>) -> Job {
        Job {
            count: Some(count),
            window,
            deliver_target,
            stop: None,
            keep_completions: false,
            deadline: STEP_BOUND,
            reply: None,
        }
    }

    fn until(stop: watch::Receiver<bool>, window: usize) -> Job {
        Job {
            count: None,
            window,
            deliver_target: None,
            stop: Some(stop),
            keep_completions: true,
            deadline: Duration::from_secs(3600),
            reply: None,
        }
    }
}

struct JobOut {
    issued: u64,
    /// Confirm latency (call to confirm), µs.
    hist: Histogram<u64>,
    last_confirm: Option<Instant>,
    /// When the delivery count reached the job's target.
    delivered_at: Option<Instant>,
    completions: Vec<Instant>,
    error: Option<String>,
}

impl Member {
    /// Sends `job` and returns its receipt.
    fn start(&self, mut job: Job) -> BenchResult<oneshot::Receiver<JobOut>> {
        let (tx, rx) = oneshot::channel();
        job.reply = Some(tx);
        self.jobs
            .send(job)
            .map_err(|_| "the member's task is gone".to_string())?;
        Ok(rx)
    }

    async fn run(&self, mut job: Job, limit: Duration) -> BenchResult<JobOut> {
        job.deadline = limit;
        let rx = self.start(job)?;
        receive(rx, limit + Duration::from_secs(1)).await
    }
}

async fn receive(rx: oneshot::Receiver<JobOut>, limit: Duration) -> BenchResult<JobOut> {
    bounded("member job", limit, rx)
        .await?
        .map_err(|_| "the member's task ended without a reply".to_string())
}

fn new_hist() -> Histogram<u64> {
    // 1 µs .. 10 min, 3 significant digits.
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid histogram bounds")
}

/// Counts one event; false once the member has no more.
fn on_event(ev: Option<Event<Bytes>>, stats: &Stats) -> bool {
    match ev {
        None => {
            stats.stopped.store(true, Ordering::Relaxed);
            false
        }
        Some(Event::Deliver { .. }) => {
            stats.delivered.fetch_add(1, Ordering::Relaxed);
            true
        }
        Some(Event::MembersChanged { deaths, .. }) => {
            let deaths = u64::try_from(deaths.len()).unwrap_or(0);
            stats.deaths_seen.fetch_add(deaths, Ordering::Relaxed);
            true
        }
        Some(Event::Stopped) => {
            stats.stopped.store(true, Ordering::Relaxed);
            true
        }
        Some(_) => true,
    }
}

/// Counts `first` and whatever else is ready (at most a batch); false once there is no more.
fn drain(h: &mut GmHandle, first: Option<Event<Bytes>>, stats: &Stats) -> bool {
    let mut open = on_event(first, stats);
    for _ in 0..1024 {
        if !open {
            break;
        }
        match h.try_event() {
            Some(ev) => open = on_event(Some(ev), stats),
            None => break,
        }
    }
    open
}

/// Owns the member's handle: drains its events all the time, runs jobs one at a time.
async fn member_task(
    mut h: GmHandle,
    mut jobs: mpsc::UnboundedReceiver<Job>,
    stats: Arc<Stats>,
    payload: Bytes,
) {
    let mut open = true;
    loop {
        tokio::select! {
            job = jobs.recv() => match job {
                Some(mut job) => {
                    let reply = job.reply.take();
                    let out = run_job(&mut h, &stats, &payload, job, &mut open).await;
                    if let Some(reply) = reply {
                        let _ = reply.send(out);
                    }
                }
                None => return,
            },
            ev = h.next_event(), if open => open = drain(&mut h, ev, &stats),
        }
    }
}

type Confirm = Pin<Box<dyn Future<Output = Result<(), GmError>> + Send>>;

async fn run_job(
    h: &mut GmHandle,
    stats: &Stats,
    payload: &Bytes,
    mut job: Job,
    open: &mut bool,
) -> JobOut {
    let mut deadline = tokio::time::Instant::now() + job.deadline;
    let mut stopping = false;
    let mut in_flight: VecDeque<(Instant, Confirm)> = VecDeque::with_capacity(job.window);
    let mut out = JobOut {
        issued: 0,
        hist: new_hist(),
        last_confirm: None,
        delivered_at: None,
        completions: Vec::new(),
        error: None,
    };
    loop {
        while !stopping && job.count.is_none_or(|c| out.issued < c) && in_flight.len() < job.window
        {
            in_flight.push_back((
                Instant::now(),
                Box::pin(h.confirmed_broadcast(payload.clone())),
            ));
            out.issued += 1;
        }
        if out.delivered_at.is_none()
            && job
                .deliver_target
                .is_some_and(|t| stats.delivered.load(Ordering::Relaxed) >= t)
        {
            out.delivered_at = Some(Instant::now());
        }
        let own_done =
            in_flight.is_empty() && (stopping || job.count.is_some_and(|c| out.issued >= c));
        if own_done && (job.deliver_target.is_none() || out.delivered_at.is_some()) {
            break;
        }
        if !*open {
            out.error = Some("the member stopped".into());
            break;
        }
        tokio::select! {
            r = async { in_flight.front_mut().expect("a confirm in flight").1.as_mut().await },
                if !in_flight.is_empty() =>
            {
                let now = Instant::now();
                let Some((issued_at, _)) = in_flight.pop_front() else { break };
                if let Err(e) = r {
                    out.error = Some(format!("confirmed broadcast failed: {e}"));
                    break;
                }
                out.hist.saturating_record(micros(now - issued_at));
                out.last_confirm = Some(now);
                stats.confirmed.fetch_add(1, Ordering::Relaxed);
                if job.keep_completions {
                    out.completions.push(now);
                }
            }
            ev = h.next_event(), if *open => *open = drain(h, ev, stats),
            _ = async { job.stop.as_mut().expect("a stop signal").changed().await },
                if job.stop.is_some() && !stopping =>
            {
                stopping = true;
                deadline = deadline.min(tokio::time::Instant::now() + DRAIN_BOUND);
            }
            () = tokio::time::sleep_until(deadline) => {
                out.error = Some(format!(
                    "not done in time: {} issued, {} still in flight, {} delivered (target {:?})",
                    out.issued,
                    in_flight.len(),
                    stats.delivered.load(Ordering::Relaxed),
                    job.deliver_target
                ));
                break;
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// Measurements
// ---------------------------------------------------------------------------------------

struct Throughput {
    wall: Duration,
    confirmed: u64,
    /// Per member: time until it had delivered every member's messages.
    delivered: Vec<(NodeId, Duration)>,
    per_member: u64,
    hist: Histogram<u64>,
}

/// Every member makes `count` confirmed broadcasts, `window` in flight.
async fn throughput(c: &Cluster, count: u64, window: usize) -> BenchResult<Throughput> {
    c.quiesce().await?;
    let n = u64::try_from(c.members().count()).unwrap_or(0);
    let limit = Duration::from_secs(120)
        + Duration::from_millis(2) * u32::try_from(n * count).unwrap_or(u32::MAX);
    let t0 = Instant::now();
    let mut receipts = Vec::new();
    for (id, m) in c.members() {
        let target = m.stats.delivered.load(Ordering::Relaxed) + n * count;
        let mut job = Job::counted(count, window, Some(target));
        job.deadline = limit;
        receipts.push((id, m.start(job)?));
    }
    let mut hist = new_hist();
    let mut last = t0;
    let mut delivered = Vec::new();
    for (id, rx) in receipts {
        let out = receive(rx, limit + Duration::from_secs(1)).await?;
        if let Some(e) = out.error {
            return Err(format!("throughput, member on node {id}: {e}"));
        }
        hist.add(&out.hist).map_err(|e| format!("histogram: {e}"))?;
        last = last.max(out.last_confirm.unwrap_or(t0));
        let at = out.delivered_at.ok_or("no delivery time")?;
        delivered.push((id, at - t0));
    }
    Ok(Throughput {
        wall: last - t0,
        confirmed: n * count,
        delivered,
        per_member: n * count,
        hist,
    })
}

struct Latency {
    name: String,
    hist: Histogram<u64>,
    /// Background confirms/s of the other members, if any.
    background: Option<f64>,
}

/// Member `id` makes `seq` confirmed broadcasts one at a time; with `bg_window`, every other
/// member broadcasts with that many in flight meanwhile.
async fn lap_latency(
    c: &Cluster,
    id: NodeId,
    seq: u64,
    bg_window: Option<usize>,
) -> BenchResult<Latency> {
    c.quiesce().await?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut background = Vec::new();
    if let Some(w) = bg_window {
        for (other, m) in c.members().filter(|(other, _)| *other != id) {
            background.push((other, m.start(Job::until(stop_rx.clone(), w))?));
        }
        // Let the background load settle before measuring.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let limit = STEP_BOUND + Duration::from_millis(50) * u32::try_from(seq).unwrap_or(u32::MAX);
    let t0 = Instant::now();
    let out = c.member(id)?.run(Job::counted(seq, 1, None), limit).await;
    let t1 = Instant::now();
    let _ = stop_tx.send(true);
    let mut bg_confirms = 0;
    for (other, rx) in background {
        let o = receive(rx, DRAIN_BOUND + Duration::from_secs(1)).await?;
        if let Some(e) = o.error {
            return Err(format!("background member on node {other}: {e}"));
        }
        bg_confirms += o.completions.iter().filter(|&&t| t >= t0 && t < t1).count();
    }
    let out = out?;
    if let Some(e) = out.error {
        return Err(format!("sequential broadcasts on node {id}: {e}"));
    }
    Ok(Latency {
        name: match bg_window {
            None => "idle (others quiet)".into(),
            Some(w) => format!("under load (others {w} in flight each)"),
        },
        hist: out.hist,
        background: bg_window.map(|_| bg_confirms as f64 / (t1 - t0).as_secs_f64().max(1e-9)),
    })
}

struct Survivor {
    id: NodeId,
    /// First confirm completed after the `NodeDown` proposal, relative to its commit (ms,
    /// signed) and to the kill.
    after_commit_ms: Option<f64>,
    after_kill: Option<Duration>,
    /// Confirms completed between the kill and the proposal (laps already past the victim).
    between: usize,
    longest_gap: Duration,
    rate_before: f64,
    rate_after: f64,
    deaths_seen: u64,
}

struct Death {
    victim: NodeId,
    leader: NodeId,
    shutdown: Duration,
    pause: Duration,
    commit: Duration,
    commit_attempts: u32,
    survivors: Vec<Survivor>,
}

/// The stretch before the kill over which the survivors' rates are taken.
fn before_window(opts: &Options) -> Duration {
    opts.steady_before.min(Duration::from_secs(1))
}

fn rate(completions: &[Instant], from: Instant, to: Instant) -> f64 {
    if to <= from {
        return 0.0;
    }
    let n = completions.iter().filter(|&&t| t >= from && t < to).count();
    n as f64 / (to - from).as_secs_f64()
}

/// Everyone broadcasts steadily; a node that does not lead Raft dies; `NodeDown` for it is
/// committed through the leader.
async fn member_death(c: &mut Cluster, opts: &Options) -> BenchResult<Death> {
    c.quiesce().await?;
    let leader = c.settled_leader().await?;
    let ids: Vec<NodeId> = c.nodes.keys().copied().collect();
    // A node in the middle of the ring, not the leader: the GM cost, not a Raft election.
    let victim = ids[1..]
        .iter()
        .chain(ids.iter())
        .copied()
        .find(|&id| id != leader)
        .ok_or("no node to kill")?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut receipts = Vec::new();
    for (id, m) in c.members() {
        if id != victim {
            receipts.push((id, m.start(Job::until(stop_rx.clone(), opts.bg_window))?));
        } else {
            // Its results die with it.
            drop(m.start(Job::until(stop_rx.clone(), opts.bg_window))?);
        }
    }
    tokio::time::sleep(opts.steady_before).await;

    let t_kill = Instant::now();
    c.kill(victim).await?;
    let shutdown = t_kill.elapsed();
    tokio::time::sleep(opts.pause).await;
    let t_propose = Instant::now();
    let pause = t_propose - t_kill - shutdown;
    let mut commit_attempts = 0;
    bounded("NodeDown", STEP_BOUND, async {
        loop {
            commit_attempts += 1;
            if c.nodes[&leader]
                .raft
                .propose(Command::NodeDown { id: victim })
                .await
                .is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await?;
    let t_commit = Instant::now();
    let commit = t_commit - t_propose;
    let base: Vec<(NodeId, u64)> = c
        .members()
        .map(|(id, m)| (id, m.stats.confirmed.load(Ordering::Relaxed)))
        .collect();
    // Laps complete again once every survivor confirms something new.
    let recovered = tokio::time::timeout(RECOVERY_BOUND, async {
        loop {
            if base.iter().all(|(id, b)| {
                c.member(*id)
                    .is_ok_and(|m| m.stats.confirmed.load(Ordering::Relaxed) > *b)
            }) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .is_ok();
    if !recovered {
        eprintln!("gm: laps did not complete again within {RECOVERY_BOUND:?} of NodeDown for node {victim}");
    }
    tokio::time::sleep(opts.steady_after).await;
    let t_stop = Instant::now();
    let _ = stop_tx.send(true);
    let mut survivors = Vec::new();
    for (id, rx) in receipts {
        let out = receive(rx, DRAIN_BOUND + Duration::from_secs(1)).await?;
        if let Some(e) = &out.error {
            eprintln!("gm: steady broadcaster on node {id}: {e}");
        }
        let done = &out.completions;
        let first = done.iter().copied().find(|&t| t >= t_propose);
        let longest_gap = done
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or_default();
        let before_from = t_kill.checked_sub(before_window(opts)).unwrap_or(t_kill);
        let after_from = first.map(|t| t + Duration::from_millis(250));
        survivors.push(Survivor {
            id,
            after_commit_ms: first.map(|t| {
                if t >= t_commit {
                    (t - t_commit).as_secs_f64() * 1e3
                } else {
                    -((t_commit - t).as_secs_f64() * 1e3)
                }
            }),
            after_kill: first.map(|t| t - t_kill),
            between: done
                .iter()
                .filter(|&&t| t >= t_kill && t < t_propose)
                .count(),
            longest_gap,
            rate_before: rate(done, before_from, t_kill),
            rate_after: after_from.map_or(0.0, |f| rate(done, f, t_stop)),
            deaths_seen: c
                .member(id)
                .map_or(0, |m| m.stats.deaths_seen.load(Ordering::Relaxed)),
        });
    }
    Ok(Death {
        victim,
        leader,
        shutdown,
        pause,
        commit,
        commit_attempts,
        survivors,
    })
}

struct SizeReport {
    n: u64,
    throughput: Throughput,
    latency: Vec<Latency>,
    death: Death,
}

async fn bench_size(
    opts: &Options,
    cc: &ClusterConfig,
    n: u64,
    seed: u64,
) -> BenchResult<SizeReport> {
    let mut c = Cluster::start(opts, cc, n, seed).await?;
    c.settled_leader().await?;
    c.join_all().await?;
    let throughput = throughput(&c, opts.count, opts.window).await?;
    let latency = vec![
        lap_latency(&c, 1, opts.seq, None).await?,
        lap_latency(&c, 1, opts.seq, Some(1)).await?,
        lap_latency(&c, 1, opts.seq, Some(opts.bg_window)).await?,
    ];
    let death = member_death(&mut c, opts).await?;
    drop(c);
    Ok(SizeReport {
        n,
        throughput,
        latency,
        death,
    })
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

fn ms_opt(d: Option<Duration>) -> String {
    d.map_or("never".into(), ms)
}

fn print_report(
    opts: &Options,
    cc: &ClusterConfig,
    reports: &[SizeReport],
    load_before: &str,
    load_after: &str,
    total: Duration,
) {
    let gm = gm_config(opts);
    let link = link_config(cc, 1);
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!("## gm: the GM ring over TCP loopback, 3 and 5 members\n");
    println!(
        "- runtimes: {}; {cores} CPUs; load average {load_before} before, {load_after} after",
        if opts.shared_rt {
            "all nodes on the driver's 2-worker runtime".to_string()
        } else {
            "one 2-worker runtime per node + a 2-worker driver".to_string()
        }
    );
    println!(
        "- GM host: {} messages per frame at most, call timeout {:?}, retry after {:?}; link heartbeat {:?}; Raft log in memory",
        gm.max_batch, gm.call_timeout, gm.retry_after, link.heartbeat_interval
    );
    println!(
        "- payload {PAYLOAD_BYTES} B; throughput: {} confirmed broadcasts per member, {} in flight each; latency: {} sequential; background and steady load: {} in flight per member{}",
        opts.count,
        opts.window,
        opts.seq,
        opts.bg_window,
        if opts.quick { " (quick)" } else { "" }
    );
    println!();
    println!("### Throughput (every member broadcasting)\n");
    println!("| members | confirmed broadcasts | wall s | confirmed broadcasts/s | delivered msg/s per member (min / max) | confirm p50 ms | p99 ms | max ms |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in reports {
        let t = &r.throughput;
        let rates: Vec<f64> = t
            .delivered
            .iter()
            .map(|(_, d)| per_sec(t.per_member, *d))
            .collect();
        let min = rates.iter().copied().fold(f64::INFINITY, f64::min);
        let max = rates.iter().copied().fold(0.0, f64::max);
        println!(
            "| {} | {} | {:.2} | {:.0} | {:.0} / {:.0} | {:.1} | {:.1} | {:.1} |",
            r.n,
            t.confirmed,
            t.wall.as_secs_f64(),
            per_sec(t.confirmed, t.wall),
            min,
            max,
            t.hist.value_at_quantile(0.50) as f64 / 1e3,
            t.hist.value_at_quantile(0.99) as f64 / 1e3,
            t.hist.max() as f64 / 1e3,
        );
    }
    println!("\n### Lap latency (node 1's member, one confirmed broadcast at a time)\n");
    println!("| members | others | samples | p50 µs | p90 µs | p99 µs | max µs | background confirms/s |");
    println!("|---:|---|---:|---:|---:|---:|---:|---:|");
    for r in reports {
        for l in &r.latency {
            println!(
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                r.n,
                l.name,
                l.hist.len(),
                l.hist.value_at_quantile(0.50),
                l.hist.value_at_quantile(0.90),
                l.hist.value_at_quantile(0.99),
                l.hist.max(),
                l.background.map_or("-".into(), |b| format!("{b:.0}"))
            );
        }
    }
    println!(
        "\n### A member death (every member broadcasting, {} in flight each)\n",
        opts.bg_window
    );
    println!(
        "Detection time excluded: the failure detector proposes `NodeDown` once a peer has been silent for `peer_timeout_ms` = {} ms (default), checked every {} ms; add that to the kill → laps figures for a real crash. Here `NodeDown` is proposed {} ms after the kill instead.\n",
        cc.peer_timeout_ms,
        DETECTOR_TICK.as_millis(),
        opts.pause.as_millis()
    );
    println!("| members | killed | Raft leader | kill (shutdown) ms | pause ms | NodeDown commit ms | survivor | confirms between kill and NodeDown | NodeDown commit → laps again ms | kill → laps again ms | longest confirm gap ms | confirms/s before | after | deaths seen |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in reports {
        let d = &r.death;
        for s in &d.survivors {
            println!(
                "| {} | {} | {} | {} | {} | {}{} | {} | {} | {} | {} | {} | {:.0} | {:.0} | {} |",
                r.n,
                d.victim,
                d.leader,
                ms(d.shutdown),
                ms(d.pause),
                ms(d.commit),
                if d.commit_attempts > 1 {
                    format!(" ({} attempts)", d.commit_attempts)
                } else {
                    String::new()
                },
                s.id,
                s.between,
                s.after_commit_ms
                    .map_or("never".into(), |v| format!("{v:.1}")),
                ms_opt(s.after_kill),
                ms(s.longest_gap),
                s.rate_before,
                s.rate_after,
                s.deaths_seen
            );
        }
    }
    println!(
        "\n\"kill → laps again\" includes the {} ms pause before `NodeDown`; confirms/s per survivor over the {} ms before the kill and from 250 ms to {} ms after the laps resumed.",
        opts.pause.as_millis(),
        before_window(opts).as_millis(),
        opts.steady_after.as_millis()
    );
    println!("\nTotal bench time {:.1} s.", total.as_secs_f64());
}
