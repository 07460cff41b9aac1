//! One seeded run: three metadata Raft nodes, a client streaming commands, a fault
//! schedule drawn from the seed, a liveness phase, and the checkers.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use amq_protocol::types::FieldTable;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use turmoil::net::TcpListener;
use warren::meta::state::{Binding, Destination, ExchangeDef, ExchangeKind, QueueDef};
use warren::meta::{Command, MetaState};
use warren::runtime::raft::{MetaRaft, MetaRaftConfig, MetaResponse, NodeId, ProposeError};
use warren::store::MemDisk;

use crate::cut::Cut;
use crate::lock;
use crate::trace::Trace;
use crate::transport::{serve, Handler, Kind, TurmoilTransport};

/// Number of Raft nodes.
pub const NODES: u64 = 3;
/// Port every node listens on (Raft RPCs and client proposals).
pub const PORT: u16 = 9000;
/// Commands the client proposes per run.
pub const COMMANDS: usize = 40;
/// Simulated time allowed for the client to get every command acknowledged.
const CLIENT_LIMIT_MS: u64 = 60_000;
/// Simulated time allowed, after the client and the faults are done, for convergence.
const CONVERGE_LIMIT_MS: u64 = 20_000;

/// The simulated host name of node `id`.
pub(crate) fn host(id: NodeId) -> String {
    format!("n{id}")
}

/// The address node `id` listens on (Raft, proposals, GM, probes).
pub(crate) fn addr(id: NodeId) -> String {
    format!("n{id}:{PORT}")
}

/// Raft timings for the simulation (simulated time, so they cost no wall time).
pub fn raft_config() -> MetaRaftConfig {
    MetaRaftConfig {
        cluster_name: "sim".into(),
        heartbeat: Duration::from_millis(50),
        election_timeout_min: Duration::from_millis(300),
        election_timeout_max: Duration::from_millis(600),
        // Small, so crashed nodes catch up by snapshot now and then.
        snapshot_after: 16,
        logs_kept_after_snapshot: 4,
        propose_timeout: Duration::from_secs(2),
        ..MetaRaftConfig::default()
    }
}

/// A client proposal's answer, as it crosses the simulated network.
#[derive(Debug, Serialize, Deserialize)]
enum ProposeReply {
    Applied(MetaResponse),
    NotLeader(Option<NodeId>),
    Timeout,
    Failed(String),
}

/// A command the client saw acknowledged.
#[derive(Clone, Debug)]
struct Acked {
    seq: usize,
    command: Command,
    response: MetaResponse,
}

/// State shared by the harness, the hosts and the client. The simulation runs on one
/// thread; the locks only satisfy `Send` bounds.
#[derive(Default)]
struct Shared {
    /// Running nodes' handles (removed on crash).
    nodes: Mutex<BTreeMap<NodeId, MetaRaft>>,
    /// Per node, every (applied index → digest) it published.
    history: Mutex<BTreeMap<NodeId, BTreeMap<u64, u32>>>,
    boots: Mutex<BTreeMap<NodeId, u64>>,
    acked: Mutex<Vec<Acked>>,
    failures: Mutex<Vec<String>>,
    client_done: AtomicBool,
}

impl Shared {
    fn fail(&self, trace: &Trace, why: String) {
        trace.log(format!("FAILURE {why}"));
        lock(&self.failures).push(why);
    }
}

/// The result of one run.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The seed.
    pub seed: u64,
    /// One line per event; identical for two runs of one seed.
    pub trace: Vec<String>,
    /// What the checkers found wrong (empty: pass).
    pub failures: Vec<String>,
}

impl Outcome {
    /// Whether every checker passed.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// A fault, at a simulated time.
#[derive(Clone, Debug)]
enum Fault {
    /// Cut the current leader off from the other nodes.
    PartitionLeader,
    /// Restore every link.
    Heal,
    /// Kill a node (its disk keeps only fsynced bytes).
    Crash(NodeId),
    /// Restart a crashed node.
    Bounce(NodeId),
}

/// The fault schedule drawn from the seed: one or two leader partitions, maybe a crash.
fn plan(rng: &mut StdRng) -> Vec<(u64, Fault)> {
    let mut faults = Vec::new();
    let mut at = rng.gen_range(1_000..2_500);
    for round in 0..rng.gen_range(1..=2) {
        if round > 0 {
            at += rng.gen_range(500..2_000);
        }
        faults.push((at, Fault::PartitionLeader));
        at += rng.gen_range(600..3_000);
        faults.push((at, Fault::Heal));
    }
    if rng.gen_bool(0.5) {
        let node = rng.gen_range(1..=NODES);
        let crash_at = rng.gen_range(1_000..6_000);
        faults.push((crash_at, Fault::Crash(node)));
        faults.push((crash_at + rng.gen_range(200..2_500), Fault::Bounce(node)));
    }
    faults.sort_by_key(|(t, _)| *t);
    faults
}

fn queue(name: &str, durable: bool) -> Command {
    Command::DeclareQueue(QueueDef {
        vhost: "/".into(),
        name: name.into(),
        durable,
        exclusive_owner: None,
        auto_delete: false,
        arguments: FieldTable::default(),
        home: 0,
    })
}

fn exchange(name: &str, kind: ExchangeKind) -> Command {
    Command::DeclareExchange(ExchangeDef {
        vhost: "/".into(),
        name: name.into(),
        kind,
        durable: true,
        auto_delete: false,
        internal: false,
        arguments: FieldTable::default(),
    })
}

fn bind(source: &str, queue: &str, key: &str) -> Command {
    Command::Bind(Binding {
        vhost: "/".into(),
        source: source.into(),
        destination: Destination::Queue(queue.into()),
        routing_key: key.into(),
        arguments: FieldTable::default(),
    })
}

/// The client's command stream: declares and binds, with some commands the state machine
/// must refuse (an inequivalent redeclare, a bind from or to something missing).
fn commands(rng: &mut StdRng) -> Vec<Command> {
    let mut out = vec![Command::AddVhost { name: "/".into() }];
    let (mut queues, mut exchanges) = (0usize, 0usize);
    while out.len() < COMMANDS {
        let pick = rng.gen_range(0..10);
        let cmd = match pick {
            0..=3 => {
                queues += 1;
                queue(&format!("q{queues}"), true)
            }
            4..=5 => {
                exchanges += 1;
                let kind = [
                    ExchangeKind::Direct,
                    ExchangeKind::Topic,
                    ExchangeKind::Fanout,
                ][rng.gen_range(0..3)];
                exchange(&format!("x{exchanges}"), kind)
            }
            6..=7 if queues > 0 && exchanges > 0 => {
                let q = rng.gen_range(1..=queues);
                let x = rng.gen_range(1..=exchanges);
                bind(
                    &format!("x{x}"),
                    &format!("q{q}"),
                    &format!("k{}", rng.gen_range(0..4)),
                )
            }
            // Refused: 406, the queue exists with durable = true.
            8 if queues > 0 => queue(&format!("q{}", rng.gen_range(1..=queues)), false),
            // Refused: 404, no such exchange.
            9 if queues > 0 => bind("missing", &format!("q{}", rng.gen_range(1..=queues)), ""),
            _ => continue,
        };
        out.push(cmd);
    }
    out
}

fn describe(c: &Command) -> String {
    match c {
        Command::AddVhost { name } => format!("add-vhost {name}"),
        Command::DeclareQueue(q) => format!("declare-queue {} durable={}", q.name, q.durable),
        Command::DeclareExchange(x) => format!("declare-exchange {} {}", x.name, x.kind.name()),
        Command::Bind(b) => format!(
            "bind {} -> {} key={}",
            b.source,
            b.destination.name(),
            b.routing_key
        ),
        other => format!("{other:?}"),
    }
}

fn outcome_text(r: &MetaResponse) -> String {
    match &r.outcome {
        Ok(s) => format!("index={} ok created={}", r.index, s.created),
        Err(e) => format!("index={} refused {}", r.index, e.code),
    }
}

async fn handle_propose(node: &MetaRaft, body: &[u8]) -> Vec<u8> {
    let reply = match bincode::deserialize::<Command>(body) {
        Err(e) => ProposeReply::Failed(format!("bad command: {e}")),
        Ok(cmd) => match node.propose(cmd).await {
            Ok(r) => ProposeReply::Applied(r),
            Err(ProposeError::NotLeader { leader, .. }) => ProposeReply::NotLeader(leader),
            Err(ProposeError::Timeout(_)) => ProposeReply::Timeout,
            Err(e) => ProposeReply::Failed(e.to_string()),
        },
    };
    bincode::serialize(&reply).unwrap_or_default()
}

/// Counts a boot of node `id` in `boots` and returns its number (1 for the first).
pub(crate) fn next_boot(boots: &Mutex<BTreeMap<NodeId, u64>>, id: NodeId) -> u64 {
    let mut boots = lock(boots);
    let b = boots.entry(id).or_insert(0);
    *b += 1;
    *b
}

/// Starts node `id`'s Raft member for boot `boot` of the run `seed` (its RNG seed distinct
/// per node and boot, yet replayable); node 1's first boot initialises a cluster of nodes
/// `1..=nodes`, each at [`addr`].
pub(crate) async fn start_raft(
    id: NodeId,
    boot: u64,
    seed: u64,
    nodes: u64,
    transport: TurmoilTransport,
    disk: MemDisk,
    trace: &Trace,
) -> turmoil::Result<MetaRaft> {
    let node_seed = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(id * 1_000 + boot);
    let node = MetaRaft::start(
        id,
        transport,
        Arc::new(disk),
        Path::new("/raft"),
        &raft_config(),
        node_seed,
    )
    .await?;
    if id == 1 && boot == 1 {
        let members = (1..=nodes).map(|n| (n, addr(n))).collect();
        node.initialize(members).await?;
        trace.log("n1 initialised the cluster");
    }
    Ok(node)
}

/// Everything a node's host closure needs; cloned for every (re)boot.
#[derive(Clone)]
struct NodeEnv {
    id: NodeId,
    seed: u64,
    disk: MemDisk,
    shared: Arc<Shared>,
    trace: Trace,
}

async fn run_node(env: NodeEnv) -> turmoil::Result {
    let NodeEnv {
        id,
        seed,
        disk,
        shared,
        trace,
    } = env;
    let boot = next_boot(&shared.boots, id);
    trace.log(format!("n{id} boot {boot}"));
    let listener = TcpListener::bind(("0.0.0.0", PORT)).await?;
    let transport = TurmoilTransport::new(host(id), trace.clone());
    let node = start_raft(id, boot, seed, NODES, transport, disk, &trace).await?;
    lock(&shared.nodes).insert(id, node.clone());

    // Record every view the node publishes: the per-index digests the checkers compare.
    let mut views = node.subscribe();
    let (rec_shared, rec_trace) = (Arc::clone(&shared), trace.clone());
    tokio::task::spawn_local(async move {
        loop {
            let v = views.borrow_and_update().clone();
            if let Some(index) = v.applied_index {
                rec_trace.log(format!("n{id} applied {index} digest {:08x}", v.digest));
                let prev = lock(&rec_shared.history)
                    .entry(id)
                    .or_default()
                    .insert(index, v.digest);
                if prev.is_some_and(|p| p != v.digest) {
                    rec_shared.fail(
                        &rec_trace,
                        format!("n{id} re-applied index {index} with another digest"),
                    );
                }
            }
            if views.changed().await.is_err() {
                break;
            }
        }
    });

    // Log what the node believes about leadership whenever it changes.
    let (watch_node, watch_trace) = (node.clone(), trace.clone());
    tokio::task::spawn_local(async move {
        let mut last = None;
        loop {
            let now = (watch_node.leader(), watch_node.is_leader());
            if last != Some(now) {
                let who = now.0.map_or("none".into(), |l| format!("n{l}"));
                let role = if now.1 { " (self, leading)" } else { "" };
                watch_trace.log(format!("n{id} sees leader {who}{role}"));
                last = Some(now);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });

    let rpc = node.rpc_server();
    let handler: Handler = Arc::new(move |kind, body| {
        let (rpc, node) = (rpc.clone(), node.clone());
        Box::pin(async move {
            match kind {
                Kind::Raft => rpc.handle(&body).await,
                Kind::Propose => handle_propose(&node, &body).await,
                Kind::Gm | Kind::Ping | Kind::Client | Kind::Broker => Vec::new(),
            }
        })
    });
    serve(listener, handler).await;
    Ok(())
}

async fn run_client(
    cmds: Vec<Command>,
    seed: u64,
    shared: Arc<Shared>,
    trace: Trace,
) -> turmoil::Result {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x00C1_1E47);
    let transport = TurmoilTransport::new("client", trace.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut target: NodeId = 1;
    let start = tokio::time::Instant::now();
    'stream: for (seq, cmd) in cmds.into_iter().enumerate() {
        let body = bincode::serialize(&cmd)?;
        let what = describe(&cmd);
        loop {
            if start.elapsed() > Duration::from_millis(CLIENT_LIMIT_MS) {
                shared.fail(
                    &trace,
                    format!("client: #{seq} {what} not acknowledged within {CLIENT_LIMIT_MS}ms"),
                );
                break 'stream;
            }
            trace.log(format!("client #{seq} {what} -> n{target}"));
            let reply = transport
                .request(&addr(target), Kind::Propose, &body, Duration::from_secs(3))
                .await;
            let retry_elsewhere = match reply {
                Ok(bytes) => match bincode::deserialize::<ProposeReply>(&bytes) {
                    Ok(ProposeReply::Applied(response)) => {
                        trace.log(format!("client #{seq} acked {}", outcome_text(&response)));
                        lock(&shared.acked).push(Acked {
                            seq,
                            command: cmd,
                            response,
                        });
                        break;
                    }
                    Ok(ProposeReply::NotLeader(Some(l))) if l != target => {
                        trace.log(format!("client #{seq} n{target}: leader is n{l}"));
                        target = l;
                        false
                    }
                    Ok(other) => {
                        trace.log(format!("client #{seq} n{target}: {other:?}"));
                        true
                    }
                    Err(e) => {
                        trace.log(format!("client #{seq} n{target}: bad reply {e}"));
                        true
                    }
                },
                Err(e) => {
                    trace.log(format!("client #{seq} n{target}: {e}"));
                    true
                }
            };
            if retry_elsewhere {
                target = target % NODES + 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            } else {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(20..250))).await;
    }
    trace.log("client done");
    shared.client_done.store(true, Ordering::SeqCst);
    Ok(())
}

/// Runs the scenario for `seed` and checks it.
pub fn run_seed(seed: u64) -> Outcome {
    let trace = Trace::new();
    let shared = Arc::new(Shared::default());
    let mut rng = StdRng::seed_from_u64(seed);
    let faults = plan(&mut rng);
    let cmds = commands(&mut rng);
    // Drawn as each leader partition happens (which node it cuts is known only then).
    let mut cuts = Cut::stream(seed, 0);
    trace.log(format!("seed {seed}"));
    for (t, f) in &faults {
        trace.log(format!("plan {t}ms {f:?}"));
    }

    crate::task_ids::align();
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(Duration::from_secs(3_600))
        .tick_duration(Duration::from_millis(1))
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(Duration::from_millis(10))
        .build();

    // Disks live here, outside the hosts, so they survive crash and bounce.
    let disks: BTreeMap<NodeId, MemDisk> = (1..=NODES).map(|id| (id, MemDisk::new())).collect();
    for id in 1..=NODES {
        let env = NodeEnv {
            id,
            seed,
            disk: disks[&id].clone(),
            shared: Arc::clone(&shared),
            trace: trace.clone(),
        };
        sim.host(host(id), move || run_node(env.clone()));
    }
    sim.client(
        "client",
        run_client(cmds.clone(), seed, Arc::clone(&shared), trace.clone()),
    );

    let mut pending = faults.into_iter().peekable();
    let mut down: Vec<NodeId> = Vec::new();
    let mut partitioned: Option<NodeId> = None;
    let mut converge_deadline: Option<u64> = None;
    loop {
        let now = sim.elapsed().as_millis() as u64;
        trace.set_harness_time(now);
        while let Some((_, fault)) = pending.next_if(|(t, _)| *t <= now) {
            match fault {
                Fault::PartitionLeader => {
                    let leader = lock(&shared.nodes)
                        .iter()
                        .find(|(_, n)| n.is_leader())
                        .map(|(&id, _)| id);
                    match leader {
                        Some(l) => {
                            let cut = cuts();
                            let others: Vec<String> =
                                (1..=NODES).filter(|&o| o != l).map(host).collect();
                            cut.apply(&mut sim, &host(l), &others);
                            partitioned = Some(l);
                            trace.log(format!(
                                "fault: partition leader n{l} from the others ({cut:?})"
                            ));
                        }
                        None => trace.log("fault: partition skipped, no leader"),
                    }
                }
                Fault::Heal => {
                    if let Some(l) = partitioned.take() {
                        for other in (1..=NODES).filter(|&o| o != l) {
                            sim.repair(host(l), host(other));
                        }
                    }
                    trace.log("fault: heal");
                }
                Fault::Crash(id) => {
                    sim.crash(host(id));
                    lock(&shared.nodes).remove(&id);
                    disks[&id].crash();
                    down.push(id);
                    trace.log(format!("fault: crash n{id}"));
                }
                Fault::Bounce(id) => {
                    down.retain(|&d| d != id);
                    trace.log(format!("fault: restart n{id}"));
                    sim.bounce(host(id));
                }
            }
        }
        let quiet = pending.peek().is_none() && shared.client_done.load(Ordering::SeqCst);
        if quiet {
            let deadline = *converge_deadline.get_or_insert_with(|| {
                trace.log("liveness: faults healed, client done; waiting for convergence");
                now + CONVERGE_LIMIT_MS
            });
            if converged(&shared) {
                trace.log("liveness: converged");
                break;
            }
            if now > deadline {
                shared.fail(
                    &trace,
                    format!("liveness: no convergence within {CONVERGE_LIMIT_MS}ms"),
                );
                break;
            }
        } else if now > CLIENT_LIMIT_MS + 30_000 {
            shared.fail(&trace, "harness: the run did not finish".into());
            break;
        }
        if !lock(&shared.failures).is_empty() && !quiet {
            break;
        }
        if let Err(e) = sim.step() {
            shared.fail(&trace, format!("simulation error: {e}"));
            break;
        }
    }
    trace.set_harness_time(sim.elapsed().as_millis() as u64);
    check(&shared, &trace);
    let failures = lock(&shared.failures).clone();
    trace.log(if failures.is_empty() { "PASS" } else { "FAIL" });
    Outcome {
        seed,
        trace: trace.lines(),
        failures,
    }
}

/// Whether every node runs and shows the same applied index and digest.
fn converged(shared: &Shared) -> bool {
    let nodes = lock(&shared.nodes);
    if nodes.len() as u64 != NODES {
        return false;
    }
    let views: Vec<_> = nodes
        .values()
        .map(|n| {
            let v = n.view();
            (v.applied_index, v.digest)
        })
        .collect();
    views.windows(2).all(|w| w[0] == w[1])
}

/// The checkers; failures go to `shared.failures`.
fn check(shared: &Shared, trace: &Trace) {
    let nodes = lock(&shared.nodes).clone();
    // 1. Every node ends with the same applied index and digest.
    let finals: BTreeMap<NodeId, (Option<u64>, u32, Arc<MetaState>)> = nodes
        .iter()
        .map(|(&id, n)| {
            let v = n.view();
            (id, (v.applied_index, v.digest, v.state))
        })
        .collect();
    for (id, (index, digest, _)) in &finals {
        trace.log(format!(
            "final n{id} applied {} digest {digest:08x}",
            index.map_or("-".into(), |i| i.to_string())
        ));
    }
    let distinct: std::collections::BTreeSet<_> =
        finals.values().map(|(i, d, _)| (*i, *d)).collect();
    if distinct.len() > 1 || finals.len() as u64 != NODES {
        shared.fail(
            trace,
            format!(
                "final views differ or a node is down: {:?}",
                finals
                    .iter()
                    .map(|(id, (i, d, _))| (*id, *i, *d))
                    .collect::<Vec<_>>()
            ),
        );
    }

    // 2. No two nodes applied different entries at the same index.
    let history = lock(&shared.history).clone();
    let mut by_index: BTreeMap<u64, BTreeMap<u32, Vec<NodeId>>> = BTreeMap::new();
    for (&id, h) in &history {
        for (&i, &d) in h {
            by_index
                .entry(i)
                .or_default()
                .entry(d)
                .or_default()
                .push(id);
        }
    }
    let mut compared = 0;
    for (i, digests) in &by_index {
        if digests.len() > 1 {
            shared.fail(
                trace,
                format!("index {i}: nodes disagree on the digest: {digests:x?}"),
            );
        } else if digests.values().next().is_some_and(|n| n.len() > 1) {
            compared += 1;
        }
    }
    trace.log(format!(
        "check: {compared} indexes seen by several nodes agree"
    ));

    // 3. Every acknowledged command is in the final state, with the outcome the model
    // predicts. Commands go one at a time and are retried until acknowledged, and every
    // one is idempotent, so applying them in order to an empty state is the expected state.
    let acked = lock(&shared.acked).clone();
    let mut model = MetaState::default();
    for a in &acked {
        let expected = model.apply(&a.command);
        let got_ok = a.response.outcome.is_ok();
        if expected.is_ok() != got_ok {
            shared.fail(
                trace,
                format!(
                    "#{} {}: model says {}, cluster said {}",
                    a.seq,
                    describe(&a.command),
                    if expected.is_ok() { "ok" } else { "refused" },
                    outcome_text(&a.response)
                ),
            );
        }
    }
    let Some((_, _, state)) = finals.values().next() else {
        return;
    };
    for a in acked.iter().filter(|a| a.response.outcome.is_ok()) {
        if !present(state, &a.command) {
            shared.fail(
                trace,
                format!("acknowledged #{} {} is lost", a.seq, describe(&a.command)),
            );
        }
        if finals.values().any(|(i, _, _)| *i < Some(a.response.index)) {
            shared.fail(
                trace,
                format!(
                    "acknowledged #{} index {} not applied everywhere",
                    a.seq, a.response.index
                ),
            );
        }
    }
    if model.vhosts != state.vhosts {
        shared.fail(
            trace,
            "final state differs from the model of the acknowledged commands".into(),
        );
    }
    trace.log(format!(
        "check: {} acknowledged commands verified",
        acked.len()
    ));
}

/// Whether the effect of `cmd` is visible in `state`.
fn present(state: &MetaState, cmd: &Command) -> bool {
    let vhost = |name: &str| state.vhost(name);
    match cmd {
        Command::AddVhost { name } => vhost(name).is_some(),
        Command::DeclareQueue(q) => vhost(&q.vhost).is_some_and(|v| v.queues.contains_key(&q.name)),
        Command::DeclareExchange(x) => {
            vhost(&x.vhost).is_some_and(|v| v.exchanges.contains_key(&x.name))
        }
        Command::Bind(b) => vhost(&b.vhost).is_some_and(|v| {
            v.bindings_from(&b.source)
                .iter()
                .any(|have| have.destination == b.destination && have.routing_key == b.routing_key)
        }),
        _ => true,
    }
}
