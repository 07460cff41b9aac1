//! One seeded GM run: four simulated nodes, each running the real node code for GM (a
//! metadata Raft member, a failure detector that records deaths through Raft, a
//! [`GmHost`]) and an application member that broadcasts a stream of confirmed messages,
//! under a fault schedule drawn from the seed; then a liveness phase and the checkers.
//!
//! Faults: a node cut off from all the others and healed (partition/repair), a link whose
//! messages are held and then released all at once (hold/release), a crash followed by a
//! restart (crash/bounce; the Raft disk keeps only what was fsynced), and slow links.
//!
//! Checked (guarantee numbers from the GM notes, `rabbitmq-mirroring.md` §1.9):
//! - G1–G3 and no duplicates: each member delivers each origin's messages in order, without
//!   gaps, each once;
//! - G5: a member delivers nothing from an origin it has not seen join;
//! - G6: a member is told only of deaths of members it saw born;
//! - G7: when an origin's confirmed broadcast completes, every member its view lists alive
//!   that had delivered an earlier message of that origin has delivered this one;
//! - G10: the records every node applies give each dead member exactly one inheritor, and
//!   no member delivers a message of a dead member after the record erased it;
//! - members that stay to the end deliver identical per-origin sequences (each a suffix of
//!   the longest one, all ending with the origin's last message);
//! - liveness: once the faults are over, every node's member completes a lap.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use turmoil::net::TcpListener;
use warren::cluster::Detector;
use warren::gm::{Event, GroupRecord, MemberId, Slot, View};
use warren::meta::state::NodeRecord;
use warren::meta::Command;
use warren::runtime::cluster::record_down_nodes;
use warren::runtime::gm_host::{GmHost, GmHostConfig, GmNet};
use warren::runtime::raft::{MetaRaft, NodeId, TransportError};
use warren::store::MemDisk;

use crate::cut::Cut;
use crate::scenario::{addr, host, PORT};
use crate::trace::Trace;
use crate::transport::{serve_hearing, Handler, Hearing, Kind, RequestError, TurmoilTransport};
use crate::{lock, now_ms};

/// Nodes (Raft voters, one GM member each).
pub const NODES: u64 = 4;
const GROUP: &str = "g";
/// Broadcasting stops this long after the start (simulated ms); faults happen before.
const WORKLOAD_MS: u64 = 9_000;
/// After the faults and the workload: time allowed for every node's final lap.
const LIVENESS_MS: u64 = 30_000;
/// The failure detector: a node not heard from for this long is recorded down.
const PEER_TIMEOUT_MS: u64 = 1_000;

/// GM frames over turmoil's TCP, addressed by node id.
#[derive(Clone)]
pub(crate) struct SimGmNet(pub(crate) TurmoilTransport);

impl GmNet for SimGmNet {
    async fn call(
        &self,
        to: NodeId,
        frame: Vec<u8>,
        deadline: Duration,
    ) -> Result<Vec<u8>, TransportError> {
        match self.0.request(&addr(to), Kind::Gm, &frame, deadline).await {
            Ok(r) => Ok(r),
            Err(RequestError::Timeout) => Err(TransportError::Timeout),
            Err(RequestError::Connect(e)) => Err(TransportError::Unreachable {
                node: to,
                reason: e.to_string(),
            }),
            Err(RequestError::Io(e)) => Err(TransportError::Io(e.to_string())),
        }
    }
}

/// A delivery as a member saw it.
#[derive(Clone, Debug)]
struct Delivery {
    at: u64,
    origin: MemberId,
    k: u64,
}

/// A completed confirmed broadcast.
#[derive(Clone, Debug)]
struct Confirm {
    at: u64,
    origin: MemberId,
    k: u64,
    /// Members alive in the origin node's record when it completed.
    alive: Vec<MemberId>,
}

/// One member's releases: (origin, k) → when.
type Releases = BTreeMap<(MemberId, u64), u64>;

#[derive(Default)]
struct Shared {
    rafts: Mutex<BTreeMap<NodeId, MetaRaft>>,
    boots: Mutex<BTreeMap<NodeId, u64>>,
    deliveries: Mutex<BTreeMap<MemberId, Vec<Delivery>>>,
    confirms: Mutex<Vec<Confirm>>,
    /// Members whose owner saw `Stopped` (or whose node went down).
    ended: Mutex<BTreeSet<MemberId>>,
    /// The member each node runs now.
    current: Mutex<BTreeMap<NodeId, MemberId>>,
    /// Per member, the last message it broadcast (k), and the final lap's k once done.
    finals: Mutex<BTreeMap<NodeId, (MemberId, u64)>>,
    /// First time any node applied a record without a member it had listed dead, and the
    /// members that record lists alive.
    erased_at: Mutex<BTreeMap<MemberId, (u64, BTreeSet<MemberId>)>>,
    /// Every (version → record) any node applied, to check they agree.
    records: Mutex<BTreeMap<u64, GroupRecord>>,
    failures: Mutex<Vec<String>>,
    finishing: AtomicBool,
    /// Durable acks: members release each delivery after a simulated write; per member,
    /// (origin, k) → when.
    durable: AtomicBool,
    released: Mutex<BTreeMap<MemberId, Releases>>,
}

impl Shared {
    fn fail(&self, trace: &Trace, why: String) {
        trace.log(format!("FAILURE {why}"));
        lock(&self.failures).push(why);
    }
}

/// A fault, at a simulated time.
#[derive(Clone, Debug)]
enum Fault {
    Partition(NodeId, Cut),
    Heal(NodeId),
    Hold(NodeId, NodeId),
    Release(NodeId, NodeId),
    Crash(NodeId),
    Bounce(NodeId),
    Slow(NodeId, NodeId, u64),
    Fast(NodeId, NodeId),
}

fn plan(rng: &mut StdRng) -> Vec<(u64, Fault)> {
    let mut faults = Vec::new();
    let node = |rng: &mut StdRng| rng.gen_range(1..=NODES);
    let pair = |rng: &mut StdRng| {
        let a = rng.gen_range(1..=NODES);
        let b = (a + rng.gen_range(1..NODES) - 1) % NODES + 1;
        (a, b)
    };
    // One fault that takes a node away (partition or crash), sometimes a second one later,
    // plus link trouble (held or slow messages) that heals by itself.
    let rounds = rng.gen_range(1..=2);
    let mut at = rng.gen_range(1_500..3_000);
    for _ in 0..rounds {
        let n = node(rng);
        let length = rng.gen_range(300..3_000);
        if rng.gen_bool(0.5) {
            faults.push((at, Fault::Partition(n, Cut::Both)));
            faults.push((at + length, Fault::Heal(n)));
        } else {
            faults.push((at, Fault::Crash(n)));
            faults.push((at + length, Fault::Bounce(n)));
        }
        at += length + rng.gen_range(500..2_000);
    }
    if rng.gen_bool(0.5) {
        let (a, b) = pair(rng);
        let t = rng.gen_range(1_000..7_000);
        faults.push((t, Fault::Hold(a, b)));
        faults.push((t + rng.gen_range(50..800), Fault::Release(a, b)));
    }
    if rng.gen_bool(0.5) {
        let (a, b) = pair(rng);
        let t = rng.gen_range(1_000..7_000);
        faults.push((t, Fault::Slow(a, b, rng.gen_range(20..200))));
        faults.push((t + rng.gen_range(500..3_000), Fault::Fast(a, b)));
    }
    faults.sort_by_key(|(t, _)| *t);
    faults
}

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
    let boot = crate::scenario::next_boot(&shared.boots, id);
    trace.log(format!("n{id} boot {boot}"));
    let listener = TcpListener::bind(("0.0.0.0", PORT)).await?;
    let transport = TurmoilTransport::new(host(id), trace.clone());
    let raft =
        crate::scenario::start_raft(id, boot, seed, NODES, transport.clone(), disk, &trace).await?;
    lock(&shared.rafts).insert(id, raft.clone());
    let host_cfg = GmHostConfig {
        call_timeout: Duration::from_millis(500),
        retry_after: Duration::from_millis(50),
        // Odd seeds send every message of over 256 bytes (most catch-ups, busy
        // activities) in parts, so parts meet the faults too.
        max_batch_bytes: if seed % 2 == 1 {
            256
        } else {
            GmHostConfig::default().max_batch_bytes
        },
        ..GmHostConfig::default()
    };
    let gm = GmHost::new(id, SimGmNet(transport.clone()), raft.clone(), host_cfg);

    let rpc = raft.rpc_server();
    let frames = gm.clone();
    let handler: Handler = Arc::new(move |kind, body| {
        let (rpc, frames) = (rpc.clone(), frames.clone());
        Box::pin(async move {
            match kind {
                Kind::Raft => rpc.handle(&body).await,
                Kind::Gm => frames.handle_frame(&body.into()),
                Kind::Ping | Kind::Propose | Kind::Client | Kind::Broker => Vec::new(),
            }
        })
    });
    let last_seen: Arc<Mutex<BTreeMap<NodeId, u64>>> = Arc::default();
    tokio::task::spawn_local(serve_hearing(listener, handler, hearing(last_seen.clone())));

    tokio::task::spawn_local(watch_records(
        id,
        raft.clone(),
        shared.clone(),
        trace.clone(),
    ));
    tokio::task::spawn_local(ping_peers(id, NODES, transport.clone(), last_seen.clone()));
    tokio::task::spawn_local(detect_failures(id, raft.clone(), last_seen, trace.clone()));

    // Register this incarnation: a restarted node's old members are dead from here on.
    let record = NodeRecord {
        id,
        name: host(id),
        amqp: String::new(),
        admin: String::new(),
        link: addr(id),
        incarnation: boot,
    };
    loop {
        match raft.propose(Command::RegisterNode(record.clone())).await {
            Ok(_) => break,
            Err(e) => {
                trace.log(format!("n{id} register: {e}"));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    trace.log(format!("n{id} registered incarnation {boot}"));
    run_app(id, boot, seed, gm, raft, shared, trace).await;
    // Keep serving after the app is done.
    std::future::pending::<()>().await;
    Ok(())
}

/// The failure detector's other input: every request a node's host receives counts as
/// hearing from its sender, as every frame on a node link does (`runtime::node_link`).
/// Clients' hosts are not nodes and are ignored.
pub(crate) fn hearing(seen: Arc<Mutex<BTreeMap<NodeId, u64>>>) -> Hearing {
    Arc::new(move |ip| {
        let node = turmoil::reverse_lookup(ip).and_then(|name| {
            name.strip_prefix('n')
                .and_then(|n| n.parse::<NodeId>().ok())
        });
        if let Some(node) = node {
            lock(&seen).insert(node, now_ms());
        }
    })
}

/// The failure detector's input: probes every peer, notes when each last answered.
pub(crate) async fn ping_peers(
    id: NodeId,
    last: NodeId,
    transport: TurmoilTransport,
    seen: Arc<Mutex<BTreeMap<NodeId, u64>>>,
) {
    loop {
        for peer in (1..=last).filter(|p| *p != id) {
            let (t, seen) = (transport.clone(), seen.clone());
            tokio::task::spawn_local(async move {
                if t.request(&addr(peer), Kind::Ping, &[], Duration::from_millis(300))
                    .await
                    .is_ok()
                {
                    lock(&seen).insert(peer, now_ms());
                }
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The failure detector (`warren::cluster::Detector`, the node's own), as the cluster
/// drives it (`runtime::cluster::watch_nodes`): the leader records `NodeDown` once per
/// outage for a registered node not heard from for [`PEER_TIMEOUT_MS`], counting from
/// when it became leader.
async fn detect_failures(
    id: NodeId,
    raft: MetaRaft,
    seen: Arc<Mutex<BTreeMap<NodeId, u64>>>,
    trace: Trace,
) {
    let mut detector = Detector::new(id, PEER_TIMEOUT_MS, now_ms());
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = now_ms();
        let state = raft.snapshot();
        let verdict = detector.handle_tick(
            now,
            raft.is_leader(),
            state.nodes.keys().copied(),
            |p| Some(lock(&seen).get(&p).copied().unwrap_or(0)),
            |_| false,
        );
        raft.fence_reads(&verdict.to_declare);
        record_down_nodes(&raft, &mut detector, verdict.to_declare, |peer| {
            trace.log(format!("n{id} (leader) records n{peer} down"))
        })
        .await;
    }
}

/// Records every group record this node applies (agreement, erasures, inheritors).
async fn watch_records(id: NodeId, raft: MetaRaft, shared: Arc<Shared>, trace: Trace) {
    let mut views = raft.subscribe();
    let mut last: Option<GroupRecord> = None;
    loop {
        let record = views
            .borrow_and_update()
            .state
            .gm_groups
            .get(GROUP)
            .cloned();
        if let Some(record) = record {
            if last.as_ref().is_none_or(|l| l.version < record.version) {
                trace.log(format!(
                    "n{id} applied gm record v{} {}",
                    record.version,
                    describe(&record)
                ));
                check_record(&record, &shared, &trace);
                if let Some(prev) = &last {
                    for slot in &prev.members {
                        if let Slot::Dead(dead) = slot {
                            if !record.members.iter().any(|s| s.id() == *dead) {
                                let alive = View::of(&record).ring.into_iter().collect();
                                lock(&shared.erased_at)
                                    .entry(*dead)
                                    .or_insert((now_ms(), alive));
                            }
                        }
                    }
                }
                last = Some(record);
            }
        }
        if views.changed().await.is_err() {
            return;
        }
    }
}

fn describe(record: &GroupRecord) -> String {
    record
        .members
        .iter()
        .map(|s| match s {
            Slot::Alive(m) => format!("+{}.{}", m.node, m.since),
            Slot::Dead(m) => format!("-{}.{}", m.node, m.since),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn name(m: MemberId) -> String {
    format!("{}.{}", m.node, m.since)
}

/// G8 and G10 on one record: nodes agree on each version, and every dead member has
/// exactly one inheritor while a live member exists.
fn check_record(record: &GroupRecord, shared: &Shared, trace: &Trace) {
    let mut records = lock(&shared.records);
    match records.get(&record.version) {
        Some(seen) if seen != record => shared.fail(
            trace,
            format!(
                "two nodes applied different records at version {}",
                record.version
            ),
        ),
        Some(_) => {}
        None => {
            records.insert(record.version, record.clone());
        }
    }
    drop(records);
    let view = View::of(record);
    if view.ring.is_empty() {
        return;
    }
    for slot in &record.members {
        if let Slot::Dead(dead) = slot {
            if view.owner(*dead).is_none() {
                shared.fail(
                    trace,
                    format!(
                        "G10: {} has no inheritor at v{}",
                        name(*dead),
                        record.version
                    ),
                );
            }
        }
    }
}

/// The application: joins the group (again after each stop), broadcasts confirmed messages
/// until the workload ends, records everything it sees, then makes a final lap.
async fn run_app(
    id: NodeId,
    boot: u64,
    seed: u64,
    gm: GmHost<SimGmNet>,
    raft: MetaRaft,
    shared: Arc<Shared>,
    trace: Trace,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ (id << 32) ^ (boot << 48) ^ 0xA99);
    let durable = shared.durable.load(Ordering::SeqCst);
    loop {
        let mut handle = match gm.join(GROUP, durable).await {
            Ok(h) => h,
            Err(e) => {
                trace.log(format!("n{id} join failed: {e}"));
                tokio::time::sleep(Duration::from_millis(300)).await;
                continue;
            }
        };
        let me = handle.id();
        trace.log(format!("n{id} member {} joined", name(me)));
        lock(&shared.current).insert(id, me);
        // G5: a member knows the members it saw join (`Joined`, births) and those the group
        // had before it, dead ones included (what they had in flight may still reach it).
        let mut known: BTreeSet<MemberId> = raft
            .snapshot()
            .gm_groups
            .get(GROUP)
            .map(|r| {
                r.members
                    .iter()
                    .map(|s| s.id())
                    .filter(|m| m.since < me.since)
                    .collect()
            })
            .unwrap_or_default();
        let mut k = 0u64;
        let mut inflight = tokio::task::JoinSet::new();
        let mut next_send = now_ms() + rng.gen_range(10..100);
        // Durable acks: deliveries waiting for their simulated write, released in order.
        let mut writes: std::collections::VecDeque<(u64, MemberId, u64)> = Default::default();
        let mut final_k: Option<u64> = None;
        // The members this member had seen join when it sent its final message: a member
        // that joins later is owed a new final one (GM gives a joiner only what is sent
        // after its left neighbour saw it join).
        let mut final_covers: Option<BTreeSet<MemberId>> = None;
        let stopped = loop {
            let finishing = shared.finishing.load(Ordering::SeqCst);
            let current: BTreeSet<MemberId> = lock(&shared.current).values().copied().collect();
            let stale_final = final_covers
                .as_ref()
                .is_none_or(|c| !current.iter().all(|m| c.contains(m)));
            let all_seen = current.iter().all(|m| *m == me || known.contains(m));
            if finishing && stale_final && all_seen && inflight.is_empty() {
                // The final lap: everything before it has completed.
                let fk = k;
                k += 1;
                trace.log(format!("n{id} {} final lap {fk}", name(me)));
                let fut = handle.confirmed_broadcast(Bytes::copy_from_slice(&fk.to_be_bytes()));
                inflight.spawn_local(async move { (fk, fut.await.is_ok()) });
                final_k = Some(fk);
                final_covers = Some(known.iter().copied().chain([me]).collect());
                lock(&shared.finals).remove(&id);
            }
            let send_now =
                !finishing && now_ms() >= next_send && now_ms() < WORKLOAD_MS && inflight.len() < 8;
            if send_now {
                let this = k;
                k += 1;
                let fut = handle.confirmed_broadcast(Bytes::copy_from_slice(&this.to_be_bytes()));
                inflight.spawn_local(async move { (this, fut.await.is_ok()) });
                next_send = now_ms() + rng.gen_range(10..150);
            }
            tokio::select! {
                ev = handle.next_event() => match ev {
                    None | Some(Event::Stopped) => break true,
                    Some(ev) => {
                        if let (true, Event::Deliver { from, num, .. }) = (durable, &ev) {
                            let due = writes.back().map_or(0, |w| w.0).max(now_ms() + rng.gen_range(0..20));
                            writes.push_back((due, *from, *num));
                        }
                        on_event(id, me, ev, &mut known, &shared, &trace)
                    }
                },
                done = inflight.join_next(), if !inflight.is_empty() => {
                    if let Some(Ok((ck, true))) = done {
                        let alive = raft
                            .snapshot()
                            .gm_groups
                            .get(GROUP)
                            .map(|r| View::of(r).ring)
                            .unwrap_or_default();
                        lock(&shared.confirms).push(Confirm { at: now_ms(), origin: me, k: ck, alive });
                        if Some(ck) == final_k {
                            trace.log(format!("n{id} {} final lap {ck} confirmed", name(me)));
                            lock(&shared.finals).insert(id, (me, ck));
                        }
                    }
                },
                _ = tokio::time::sleep(Duration::from_millis(10)) => {}
            }
            while writes.front().is_some_and(|w| w.0 <= now_ms()) {
                if let Some((_, from, num)) = writes.pop_front() {
                    handle.release(from, num);
                    lock(&shared.released)
                        .entry(me)
                        .or_default()
                        .insert((from, num), now_ms());
                }
            }
        };
        if stopped {
            trace.log(format!("n{id} member {} stopped", name(me)));
            lock(&shared.ended).insert(me);
            lock(&shared.current).remove(&id);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

fn on_event(
    id: NodeId,
    me: MemberId,
    ev: Event<Bytes>,
    known: &mut BTreeSet<MemberId>,
    shared: &Shared,
    trace: &Trace,
) {
    match ev {
        Event::Joined { members } => known.extend(members),
        Event::MembersChanged { births, deaths } => {
            for d in &deaths {
                if !known.contains(d) {
                    shared.fail(
                        trace,
                        format!(
                            "G6: n{id} {} told of the death of unseen {}",
                            name(me),
                            name(*d)
                        ),
                    );
                }
            }
            known.extend(births);
        }
        Event::Deliver { from, msg, .. } => {
            let Ok(bytes) = <[u8; 8]>::try_from(&msg[..]) else {
                shared.fail(trace, format!("n{id}: a delivery of {} bytes", msg.len()));
                return;
            };
            if from != me && !known.contains(&from) {
                shared.fail(
                    trace,
                    format!(
                        "G5: {} delivered from {} before seeing it join",
                        name(me),
                        name(from)
                    ),
                );
            }
            lock(&shared.deliveries)
                .entry(me)
                .or_default()
                .push(Delivery {
                    at: now_ms(),
                    origin: from,
                    k: u64::from_be_bytes(bytes),
                });
        }
        _ => {}
    }
}

/// The result of one run.
pub use crate::scenario::Outcome;

/// Runs the GM scenario for `seed` and checks it.
pub fn run_seed(seed: u64) -> Outcome {
    let trace = Trace::new();
    let shared = Arc::new(Shared::default());
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6A);
    let mut faults = plan(&mut rng);
    let mut cuts = Cut::stream(seed, 0x6A);
    for (_, f) in faults.iter_mut() {
        if let Fault::Partition(_, cut) = f {
            *cut = cuts();
        }
    }
    let durable = rng.gen_bool(0.5);
    shared.durable.store(durable, Ordering::SeqCst);
    trace.log(format!("gm seed {seed}, durable acks {durable}"));
    for (t, f) in &faults {
        trace.log(format!("plan {t}ms {f:?}"));
    }
    crate::task_ids::align();
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(Duration::from_secs(3_600))
        .tick_duration(Duration::from_millis(1))
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(Duration::from_millis(5))
        .build();
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
    let faults_end = faults.last().map_or(0, |(t, _)| *t);
    let mut pending = faults.into_iter().peekable();
    let finish_at = WORKLOAD_MS.max(faults_end) + 500;
    let deadline = finish_at + LIVENESS_MS;
    loop {
        let now = sim.elapsed().as_millis() as u64;
        trace.set_harness_time(now);
        while let Some((_, fault)) = pending.next_if(|(t, _)| *t <= now) {
            trace.log(format!("fault: {fault:?}"));
            match fault {
                Fault::Partition(n, cut) => {
                    let others: Vec<String> = (1..=NODES).filter(|o| *o != n).map(host).collect();
                    cut.apply(&mut sim, &host(n), &others);
                }
                Fault::Heal(n) => {
                    for o in (1..=NODES).filter(|o| *o != n) {
                        sim.repair(host(n), host(o));
                    }
                }
                Fault::Hold(a, b) => sim.hold(host(a), host(b)),
                Fault::Release(a, b) => sim.release(host(a), host(b)),
                Fault::Crash(n) => {
                    sim.crash(host(n));
                    lock(&shared.rafts).remove(&n);
                    if let Some(m) = lock(&shared.current).remove(&n) {
                        lock(&shared.ended).insert(m);
                    }
                    disks[&n].crash();
                }
                Fault::Bounce(n) => sim.bounce(host(n)),
                Fault::Slow(a, b, ms) => {
                    sim.set_link_latency(host(a), host(b), Duration::from_millis(ms))
                }
                Fault::Fast(a, b) => {
                    sim.set_link_latency(host(a), host(b), Duration::from_millis(2))
                }
            }
        }
        if now >= finish_at && !shared.finishing.swap(true, Ordering::SeqCst) {
            trace
                .log("liveness: faults over, workload done; every node's member makes a final lap");
        }
        if shared.finishing.load(Ordering::SeqCst) {
            let finals = lock(&shared.finals).clone();
            let current = lock(&shared.current).clone();
            let done = current.len() as u64 == NODES
                && current
                    .iter()
                    .all(|(n, m)| finals.get(n).is_some_and(|(fm, _)| fm == m));
            if done && settled(&shared, &current, &finals) {
                trace.log(
                    "liveness: every member's final lap completed and was delivered everywhere",
                );
                break;
            }
            if now > deadline {
                let missing: Vec<String> = {
                    let deliveries = lock(&shared.deliveries);
                    current
                        .values()
                        .flat_map(|m| {
                            let got = deliveries.get(m).cloned().unwrap_or_default();
                            finals
                                .values()
                                .filter(move |(o, k)| {
                                    !got.iter().any(|d| d.origin == *o && d.k == *k)
                                })
                                .map(move |(o, k)| format!("{} lacks {}#{k}", name(*m), name(*o)))
                        })
                        .collect()
                };
                shared.fail(
                    &trace,
                    format!("liveness: missing final deliveries: {missing:?}"),
                );
                shared.fail(&trace, format!("liveness: final laps not all done within {LIVENESS_MS}ms: finals {:?}, current {:?}", finals.iter().map(|(n, (m, k))| format!("n{n}:{}#{k}", name(*m))).collect::<Vec<_>>(), current.iter().map(|(n, m)| format!("n{n}:{}", name(*m))).collect::<Vec<_>>()));
                break;
            }
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

/// Whether every current member delivered every other current member's final message.
fn settled(
    shared: &Shared,
    current: &BTreeMap<NodeId, MemberId>,
    finals: &BTreeMap<NodeId, (MemberId, u64)>,
) -> bool {
    let deliveries = lock(&shared.deliveries);
    current.values().all(|m| {
        let got = deliveries.get(m);
        finals.values().all(|(origin, k)| {
            got.is_some_and(|d| d.iter().any(|x| x.origin == *origin && x.k == *k))
        })
    })
}

fn check(shared: &Shared, trace: &Trace) {
    let deliveries = lock(&shared.deliveries).clone();
    let confirms = lock(&shared.confirms).clone();
    let current: BTreeSet<MemberId> = lock(&shared.current).values().copied().collect();
    let erased = lock(&shared.erased_at).clone();
    let mut total = 0usize;
    // G1–G3, no duplicates: per member and origin, consecutive numbers.
    let mut seqs: BTreeMap<(MemberId, MemberId), Vec<u64>> = BTreeMap::new();
    for (member, ds) in &deliveries {
        for d in ds {
            seqs.entry((*member, d.origin)).or_default().push(d.k);
            total += 1;
            // G10: nothing of an erased member reaches a member alive in the erasing record
            // after its erasure (a member already recorded dead may still be catching up,
            // unaware, as may a member cut off delivering its own broadcasts, G4).
            if let Some((t, alive)) = erased.get(&d.origin) {
                if d.at > *t && d.origin != *member && alive.contains(member) {
                    shared.fail(
                        trace,
                        format!(
                            "G10: {} delivered {}#{} at {}ms, after its erasure at {t}ms",
                            name(*member),
                            name(d.origin),
                            d.k,
                            d.at
                        ),
                    );
                }
            }
        }
    }
    for ((member, origin), ks) in &seqs {
        if ks.windows(2).any(|w| w[1] != w[0] + 1) {
            shared.fail(
                trace,
                format!(
                    "G2/G3: {} got {}'s messages out of order, with gaps or twice: {:?}",
                    name(*member),
                    name(*origin),
                    ks
                ),
            );
        }
    }
    // G7: a completed lap reached every member alive in the origin's view that had an
    // earlier message of that origin.
    let mut g7 = 0;
    for c in &confirms {
        for m in &c.alive {
            let Some(ds) = deliveries.get(m) else {
                continue;
            };
            let had_earlier = ds
                .iter()
                .any(|d| d.origin == c.origin && d.k < c.k && d.at <= c.at);
            if !had_earlier || *m == c.origin {
                continue;
            }
            g7 += 1;
            if !ds
                .iter()
                .any(|d| d.origin == c.origin && d.k == c.k && d.at <= c.at)
            {
                shared.fail(
                    trace,
                    format!(
                        "G7: {}#{} confirmed at {}ms, not delivered by then at {}",
                        name(c.origin),
                        c.k,
                        c.at,
                        name(*m)
                    ),
                );
            }
        }
    }
    // With durable acks, G7 also means written: every such member (and the origin) had
    // released the message when its confirm came.
    if shared.durable.load(Ordering::SeqCst) {
        let released = lock(&shared.released).clone();
        for c in &confirms {
            for m in c.alive.iter() {
                let had_earlier = *m == c.origin
                    || deliveries.get(m).is_some_and(|ds| {
                        ds.iter()
                            .any(|d| d.origin == c.origin && d.k < c.k && d.at <= c.at)
                    });
                if !had_earlier {
                    continue;
                }
                let at = released.get(m).and_then(|r| r.get(&(c.origin, c.k)));
                if at.is_none_or(|t| *t > c.at) {
                    shared.fail(
                        trace,
                        format!(
                            "G7 (durable): {}#{} confirmed at {}ms before {} released it ({at:?})",
                            name(c.origin),
                            c.k,
                            c.at,
                            name(*m)
                        ),
                    );
                }
            }
        }
    }
    // Members that stay to the end: identical per-origin sequences up to where they
    // start (a later member gets a suffix), all ending at the same message.
    let origins: BTreeSet<MemberId> = seqs.keys().map(|(_, o)| *o).collect();
    for origin in &origins {
        // (A member that joined after the origin's last message has none of them.)
        let ends: BTreeSet<u64> = current
            .iter()
            .filter_map(|m| seqs.get(&(*m, *origin)).and_then(|v| v.last().copied()))
            .collect();
        if ends.len() > 1 {
            shared.fail(
                trace,
                format!(
                    "members that stayed end {}'s sequence differently: {:?}",
                    name(*origin),
                    current
                        .iter()
                        .map(|m| (
                            name(*m),
                            seqs.get(&(*m, *origin))
                                .map(|v| (v.first().copied(), v.last().copied()))
                        ))
                        .collect::<Vec<_>>()
                ),
            );
        }
    }
    trace.log(format!(
        "check: {total} deliveries, {} confirms, {g7} G7 pairs, {} members ended, {} erased",
        confirms.len(),
        lock(&shared.ended).len(),
        erased.len()
    ));
}
