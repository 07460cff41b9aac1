//! One seeded mirrored-queue run: three simulated nodes, each running the node code a
//! clustered warren node runs for a mirrored queue (a metadata Raft member, the failure
//! detector, the broker following the metadata, storage on a simulated disk driven by an
//! async syncer, the GM host and the [`MirrorHost`]), a durable queue with an `ha-mode: all`
//! policy, and a client host whose publishers (with confirms) and consumer (with acks)
//! follow the queue's master from node to node, under a fault schedule drawn from the seed;
//! then a drain and the checkers. Each node also runs its AMQP listener (the node's own
//! session driver), its relay and Raft-committed metadata, for the session clients
//! ([`session_clients`]: AMQP connections to random nodes, on a second mirrored queue).
//!
//! Faults: the master's node (or another) cut off from the others and healed, or crashed
//! (its disks keep only what was fsynced) and restarted; a policy change under load
//! (`ha-mode: exactly 2` and back to `all`, so a mirror leaves and a new one syncs).
//!
//! Checked, on what the client saw (design §1; `docs/mirroring.md`):
//! - **G1** every confirmed message is delivered at least once (the drain waits for them),
//!   except a transient one (publisher 1's odd numbers) confirmed before a restart of the
//!   master's node that no promotion followed: transient messages do not survive a
//!   restart, and that node served the queue again from its disk;
//! - **G2** a message delivered twice carries `redelivered` on every delivery after the
//!   first;
//! - **G3** each publisher's messages, first deliveries without `redelivered`, come in the
//!   order they were published;
//! - **G4** one master at a time: every confirm and delivery carries the node that served
//!   it and the queue's epoch there; no two nodes serve under one epoch, and what a node
//!   serves under an older epoch happens before anything served under a newer one (a
//!   delivery dated when the node took it from the queue, a confirm when the node took
//!   the publish; the
//!   prober publisher and the consumer's stray gets ask every node, so a deposed master
//!   still serving would be seen).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use amq_protocol::protocol::basic::AMQPProperties;
use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use turmoil::net::TcpListener;
use warren::amqp::frame::encode_properties;
use warren::broker::{Broker, Durability, Message, QueueHandle};
use warren::cluster::Detector;
use warren::config::Config;
use warren::meta::policy::{ApplyTo, Policy, PolicyValue};
use warren::meta::state::{NodeRecord, QueueDef};
use warren::meta::Command;
use warren::runtime::clock::Clock;
use warren::runtime::cluster::{follow_metadata, keep_routing_lease, record_down_nodes, RaftMeta};
use warren::runtime::conn_task::{self, ConnContext, MetaCommit};
use warren::runtime::gm_host::{GmHost, GmHostConfig};
use warren::runtime::mirror_host::MirrorHost;
use warren::runtime::node_stats::NodeFacts;
use warren::runtime::raft::{MetaRaft, NodeId};
use warren::runtime::relay::Relay;
use warren::runtime::storage::Storage;
use warren::store::MemDisk;

use crate::broker_links::SimBrokerLinks;
use crate::cut::Cut;
use crate::gm_scenario::SimGmNet;
use crate::scenario::{addr, host, PORT};
use crate::session_clients::{self, SessionRecords};
use crate::trace::Trace;
use crate::transport::{serve_hearing, Handler, Kind, TurmoilTransport};
use crate::{lock, now_ms};

/// Nodes (Raft voters; every one holds a copy of the queue under `ha-mode: all`).
pub const NODES: u64 = 3;
/// A node that joins some runs under load (a Raft learner; under `ha-mode: all` it gets a
/// mirror, which syncs while the queue serves).
const JOINER: NodeId = NODES + 1;
const VHOST: &str = "/";
/// The nodes' routing lease (the config's default), within the 5 s commit timeout.
const ROUTING_LEASE: Duration = Duration::from_millis(1500);
const QUEUE: &str = "ha.q";
/// Publishers, each with its own connection; a few publishes in flight each. The last one
/// is a prober: it sends each publish to the next node in turn, whatever they answer, so
/// a node that still serves when it should not is caught (G4).
const PUBLISHERS: u32 = 3;
const IN_FLIGHT: usize = 4;
/// Publishers through AMQP sessions ([`session_clients`]), besides one consumer there.
const SESSION_PUBLISHERS: u32 = 2;
/// This publisher's odd-numbered messages are transient (delivery mode 1): a mirrored queue
/// mirrors them too, and a promoted mirror keeps them; only a master restarting from its
/// own disk (no mirror could be promoted) loses them, as transient messages go with a
/// restart.
const TRANSIENT_PUBLISHER: u32 = 1;

fn transient(publisher: u32, n: u64) -> bool {
    publisher == TRANSIENT_PUBLISHER && n % 2 == 1
}
/// Publishing stops this long after the start (simulated ms).
const WORKLOAD_MS: u64 = 14_000;
/// After the faults and the workload: time allowed to drain every confirmed message.
const DRAIN_MS: u64 = 40_000;
/// The failure detector: a node not heard from for this long is down.
const PEER_TIMEOUT_MS: u64 = 1_000;

fn key() -> (String, String) {
    (VHOST.to_string(), QUEUE.to_string())
}

/// What the client asks a node (AMQP's basic.publish with confirms, basic.get, basic.ack,
/// reduced to what the checkers need).
#[derive(Debug, Serialize, Deserialize)]
enum Request {
    Publish { publisher: u32, n: u64 },
    Get,
    Ack { tag: u64 },
}

#[derive(Debug, Serialize, Deserialize)]
enum Reply {
    Confirmed {
        epoch: u64,
        /// The queue's incarnation the message went into (`None`: not mirrored yet).
        incarnation: Option<u64>,
        /// When the node took the publish (simulated ms): the earliest its round's lap
        /// can have completed. Its confirm may come much later, behind an earlier round
        /// of another queue (rounds complete in order), and its reply later still.
        at: u64,
    },
    Nacked,
    /// This node does not serve the queue (its view of the home, if it has one).
    NotMaster {
        home: Option<NodeId>,
    },
    Message {
        publisher: u32,
        n: u64,
        redelivered: bool,
        tag: u64,
        epoch: u64,
        incarnation: Option<u64>,
        /// When the node took it from the queue (simulated ms).
        at: u64,
    },
    Empty,
    Acked,
}

/// Something a node served, as the client saw it.
#[derive(Clone, Debug)]
struct Served {
    at: u64,
    node: NodeId,
    epoch: u64,
    /// The queue's incarnation (a delete and a declare make a new queue of the name;
    /// `None` until the new queue's mirror set exists).
    incarnation: Option<u64>,
    publisher: u32,
    n: u64,
    /// For deliveries.
    redelivered: bool,
    /// "confirm" or "delivery".
    kind: &'static str,
}

#[derive(Default)]
struct Shared {
    boots: Mutex<BTreeMap<NodeId, u64>>,
    rafts: Mutex<BTreeMap<NodeId, MetaRaft>>,
    confirms: Mutex<Vec<Served>>,
    deliveries: Mutex<Vec<Served>>,
    nacks: Mutex<u64>,
    failures: Mutex<Vec<String>>,
    /// Publishers stopped; the consumer drains.
    draining: AtomicBool,
    /// The consumer saw every confirmed message and then an empty queue.
    drained: AtomicBool,
    /// The joining node's host exists.
    joined: AtomicBool,
    /// Restarts of the queue's master's node after a crash: (when it restarted, node, the
    /// queue's epoch when it crashed).
    master_restarts: Mutex<Vec<(u64, NodeId, u64)>>,
    /// Nodes whose storage failed: each exits, as `warren` does, for its supervisor (the
    /// harness) to restart it.
    exits: Mutex<Vec<NodeId>>,
    /// When every node came back after the whole cluster crashed.
    cluster_restarts: Mutex<Vec<u64>>,
    /// The newest incarnation of the queue seen in any node's metadata.
    latest_incarnation: Mutex<Option<u64>>,
    /// When the operator saw the queue's delete commit.
    deleted: Mutex<Vec<u64>>,
    /// What the session clients saw (their own queue, [`session_clients::QUEUE`]).
    session: Arc<SessionRecords>,
}

impl Shared {
    fn fail(&self, trace: &Trace, why: String) {
        trace.log(format!("FAILURE {why}"));
        lock(&self.failures).push(why);
    }

    /// Confirmed messages never delivered, except transient ones a master restarting from
    /// its own disk may have lost: confirmed before a restart of the master's node after a
    /// crash, when that node then served under the epoch it crashed in (no mirror was
    /// promoted, so the queue came back from that node's disk, where transient messages do
    /// not survive a restart), or confirmed before the whole cluster restarted (no node
    /// kept them in memory). Before the restart, not the crash: a confirm given just
    /// before the crash may reach the client after it. And any message confirmed by an
    /// incarnation of the queue that was deleted since, or confirmed before a delete
    /// committed (its delete took it).
    fn missing(&self) -> Vec<Served> {
        let current = self.incarnation();
        let deleted = lock(&self.deleted).last().copied();
        let deliveries = lock(&self.deliveries).clone();
        let confirms = lock(&self.confirms).clone();
        let restarts = lock(&self.master_restarts).clone();
        let cluster_restarts = lock(&self.cluster_restarts).clone();
        let seen: BTreeSet<(u32, u64)> = deliveries.iter().map(|d| (d.publisher, d.n)).collect();
        let restarted_unreplaced = |at: u64| {
            cluster_restarts.iter().any(|tr| *tr > at)
                || restarts.iter().any(|(tr, node, epoch)| {
                    *tr > at
                        && confirms
                            .iter()
                            .chain(deliveries.iter())
                            .any(|s| s.at > *tr && s.node == *node && s.epoch == *epoch)
                })
        };
        confirms
            .iter()
            .filter(|c| !seen.contains(&(c.publisher, c.n)))
            .filter(|c| !(transient(c.publisher, c.n) && restarted_unreplaced(c.at)))
            .filter(|c| {
                !(deleted.is_some_and(|d| c.at < d)
                    || c.incarnation.zip(current).is_some_and(|(c, i)| c < i))
            })
            .cloned()
            .collect()
    }

    /// The queue's incarnation in the newest metadata (the latest only grows).
    fn incarnation(&self) -> Option<u64> {
        let latest = self
            .newest()
            .and_then(|s| s.mirror_sets.get(&key()).map(|m| m.incarnation));
        let mut seen = lock(&self.latest_incarnation);
        *seen = (*seen).max(latest);
        *seen
    }

    /// The newest metadata any running node applied.
    fn newest(&self) -> Option<Arc<warren::meta::MetaState>> {
        lock(&self.rafts)
            .values()
            .map(|r| r.snapshot())
            .max_by_key(|s| s.version)
    }

    /// The queue's mirrors, as the newest metadata has them.
    fn mirrors(&self) -> String {
        self.newest()
            .and_then(|s| s.mirror_sets.get(&key()).cloned())
            .map_or("no mirror set".into(), |set| {
                set.mirrors
                    .iter()
                    .map(|m| format!("n{}{}", m.node, if m.synchronised { "" } else { "?" }))
                    .collect::<Vec<_>>()
                    .join(" ")
                    + &format!(", epoch {}", set.epoch)
            })
    }

    /// The nodes (besides the master) that are not synchronised mirrors, if any.
    fn unsynchronised(&self) -> Option<String> {
        let s = self.newest()?;
        let home = s.vhosts.get(VHOST)?.queues.get(QUEUE)?.home;
        let synced: BTreeSet<NodeId> = s
            .mirror_sets
            .get(&key())
            .map(|set| {
                set.mirrors
                    .iter()
                    .filter(|m| m.synchronised)
                    .map(|m| m.node)
                    .collect()
            })
            .unwrap_or_default();
        let missing: Vec<String> = (1..=self.hosts())
            .filter(|n| *n != home && !synced.contains(n))
            .map(|n| format!("n{n}"))
            .collect();
        (!missing.is_empty()).then(|| missing.join(" "))
    }

    /// How many nodes exist (the joiner's host is created when it joins).
    fn hosts(&self) -> u64 {
        if self.joined.load(Ordering::SeqCst) {
            JOINER
        } else {
            NODES
        }
    }

    /// The node after `n`, for a client trying the others.
    /// The queue's epoch, if node `n` is its master now.
    fn epoch_if_master(&self, n: NodeId) -> Option<u64> {
        (self.home() == Some(n)).then(|| {
            self.newest()
                .and_then(|s| s.mirror_sets.get(&key()).map(|m| m.epoch))
                .unwrap_or(0)
        })
    }

    fn next_node(&self, n: NodeId) -> NodeId {
        n % self.hosts() + 1
    }

    /// The queue's home in the metadata of any running node (the newest version).
    fn home(&self) -> Option<NodeId> {
        let s = self.newest()?;
        s.vhosts.get(VHOST)?.queues.get(QUEUE).map(|q| q.home)
    }
}

/// A fault, at a simulated time. `Master` faults pick the queue's master when they happen.
#[derive(Clone, Debug)]
enum Fault {
    Partition(Target, Cut),
    Heal,
    Crash(Target),
    Restart,
    /// `ha-mode: exactly 2` (a mirror leaves), later back to `all` (it returns and syncs).
    Exactly2,
    All,
    /// A fourth node boots and joins the cluster (it gets a mirror and syncs under load).
    Join,
    /// A fault on the node's storage disk: its storage fails at the next write or fsync,
    /// and the node exits and is restarted half a second later.
    Disk(Target, DiskFault),
    /// The operator deletes the queue and declares it again (on the node its delete went
    /// through), while the clients go on: a new incarnation, with the policy's mirrors.
    Redeclare,
}

/// What goes wrong on a disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DiskFault {
    /// The next fsync fails (EIO).
    Fsync,
    /// The next append writes half its bytes (a torn write).
    Torn,
    /// The disk fills up 64 KiB past what it holds (ENOSPC), until the node restarts
    /// (an operator freed space).
    Full,
}

#[derive(Clone, Copy, Debug)]
enum Target {
    Master,
    Node(NodeId),
}

fn plan(rng: &mut StdRng) -> Vec<(u64, Fault)> {
    let mut faults = Vec::new();
    // One node away at a time (three nodes: a majority must remain), one to three rounds.
    let rounds = rng.gen_range(1..=3);
    let mut at = rng.gen_range(2_000..4_000);
    for _ in 0..rounds {
        let target = if rng.gen_bool(0.7) {
            Target::Master
        } else {
            Target::Node(rng.gen_range(1..=NODES))
        };
        let length = rng.gen_range(500..4_000);
        if rng.gen_bool(0.5) {
            faults.push((at, Fault::Partition(target, Cut::Both)));
            faults.push((at + length, Fault::Heal));
        } else {
            faults.push((at, Fault::Crash(target)));
            faults.push((at + length, Fault::Restart));
        }
        at += length + rng.gen_range(1_000..3_000);
    }
    if rng.gen_bool(0.4) {
        let t = rng.gen_range(1_500..8_000);
        faults.push((t, Fault::Exactly2));
        faults.push((t + rng.gen_range(500..4_000), Fault::All));
    }
    if rng.gen_bool(0.5) {
        faults.push((rng.gen_range(2_000..9_000), Fault::Join));
    }
    faults.sort_by_key(|(t, _)| *t);
    faults
}

#[derive(Clone)]
struct NodeEnv {
    id: NodeId,
    seed: u64,
    /// The node's clock rate (parts per million of the simulation's).
    clock_rate_ppm: u64,
    raft_disk: MemDisk,
    disk: MemDisk,
    shared: Arc<Shared>,
    trace: Trace,
}

/// What the client handler needs once the node runs.
struct Serving {
    id: NodeId,
    broker: Arc<Broker>,
    durability: Arc<Durability>,
    raft: MetaRaft,
    clock: Clock,
    unacked: Mutex<BTreeMap<u64, (Arc<QueueHandle>, u64)>>,
    next_tag: Mutex<u64>,
}

/// The queue, durable, declared on `home`.
fn queue_def(home: NodeId) -> QueueDef {
    QueueDef {
        vhost: VHOST.into(),
        name: QUEUE.into(),
        durable: true,
        exclusive_owner: None,
        auto_delete: false,
        arguments: Default::default(),
        home,
    }
}

fn ha_policy(mode: &str) -> Command {
    let mut definition = BTreeMap::new();
    definition.insert("ha-mode".to_string(), PolicyValue::Str(mode.into()));
    if mode == "exactly" {
        definition.insert("ha-params".to_string(), PolicyValue::Int(2));
    }
    definition.insert(
        "ha-sync-mode".to_string(),
        PolicyValue::Str("automatic".into()),
    );
    definition.insert("ha-sync-batch-size".to_string(), PolicyValue::Int(64));
    Command::SetPolicy {
        policy: Policy {
            vhost: VHOST.into(),
            name: "ha".into(),
            pattern: "^ha\\.".into(),
            compiled: Default::default(),
            apply_to: ApplyTo::Queues,
            priority: 0,
            definition,
        },
        operator: false,
    }
}

async fn propose_until_done(raft: &MetaRaft, cmd: Command, id: NodeId, trace: &Trace) {
    loop {
        match raft.propose(cmd.clone()).await {
            Ok(_) => return,
            Err(e) => {
                trace.log(format!("n{id} propose: {e}"));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

async fn run_node(env: NodeEnv) -> turmoil::Result {
    let NodeEnv {
        id,
        seed,
        clock_rate_ppm,
        raft_disk,
        disk,
        shared,
        trace,
    } = env;
    let boot = crate::scenario::next_boot(&shared.boots, id);
    trace.log(format!("n{id} boot {boot}"));
    let listener = TcpListener::bind(("0.0.0.0", PORT)).await?;
    let transport = TurmoilTransport::new(host(id), trace.clone());
    let raft =
        crate::scenario::start_raft(id, boot, seed, NODES, transport.clone(), raft_disk, &trace)
            .await?;
    let gm_cfg = GmHostConfig {
        call_timeout: Duration::from_millis(500),
        retry_after: Duration::from_millis(50),
        // Odd seeds send every GM message of over 512 bytes (most rounds, catch-ups and
        // sync batches) in parts, so parts meet the faults too.
        max_batch_bytes: if seed % 2 == 1 {
            512
        } else {
            GmHostConfig::default().max_batch_bytes
        },
        ..GmHostConfig::default()
    };
    let gm = GmHost::new(id, SimGmNet(transport.clone()), raft.clone(), gm_cfg);
    let serving: Arc<OnceLock<Arc<Serving>>> = Arc::default();
    let rpc = raft.rpc_server();
    let frames = gm.clone();
    let client_side = serving.clone();
    let last_seen: Arc<Mutex<BTreeMap<NodeId, u64>>> = Arc::default();
    // The relay's links: its requests are handled here, on the connection's reader, in
    // arrival order (the node's own relay, [`Relay`], serves them once installed).
    let links = SimBrokerLinks::new(id, trace.clone(), last_seen.clone());
    let relay_side = links.clone();
    let handler: Handler = Arc::new(move |kind, body| {
        if kind == Kind::Broker {
            return relay_side.serve_request(body);
        }
        let (rpc, frames, client_side) = (rpc.clone(), frames.clone(), client_side.clone());
        Box::pin(async move {
            match kind {
                Kind::Raft => rpc.handle(&body).await,
                Kind::Gm => frames.handle_frame(&body.into()),
                Kind::Client => {
                    let reply = match (client_side.get(), bincode::deserialize::<Request>(&body)) {
                        (Some(s), Ok(req)) => s.clone().handle(req).await,
                        _ => Reply::NotMaster { home: None },
                    };
                    bincode::serialize(&reply).unwrap_or_default()
                }
                Kind::Propose => {
                    // An operator's metadata change (a policy), forwarded to the leader.
                    let ok = match (client_side.get(), bincode::deserialize::<Command>(&body)) {
                        (Some(s), Ok(cmd)) => s.raft.propose(cmd).await.is_ok(),
                        _ => false,
                    };
                    vec![u8::from(ok)]
                }
                Kind::Ping | Kind::Broker => Vec::new(),
            }
        })
    });
    let heard = crate::gm_scenario::hearing(last_seen.clone());
    tokio::task::spawn_local(serve_hearing(listener, handler, heard));

    // The session clients are not on loopback: guest may log in from anywhere here.
    let mut config = Config::default();
    config.amqp.loopback_users.clear();
    let durability = Arc::new(Durability::default());
    let broker = Arc::new(
        Broker::new(&config, seed ^ (id << 40) ^ (boot << 48), 1 << 30, 0)
            .with_node_id(id)
            .with_durability(durability.clone()),
    );
    let clock = Clock::start_at_rate(clock_rate_ppm);
    let down: Arc<Mutex<BTreeSet<NodeId>>> = Arc::default();
    // The relay and what it needs, as `runtime::cluster` installs them: metadata commits
    // through Raft (`RaftMeta`), answered once the follower applied them.
    let relay_cell: Arc<OnceLock<Arc<Relay>>> = Arc::default();
    let (applied_tx, applied) = tokio::sync::watch::channel(0u64);
    let meta: Arc<dyn MetaCommit> = Arc::new(
        RaftMeta::new(
            raft.clone(),
            broker.clone(),
            relay_cell.clone(),
            applied.clone(),
            Duration::from_secs(5),
            seed ^ id,
        )
        .with_routing_lease(ROUTING_LEASE, clock),
    );
    let facts = Arc::new(NodeFacts {
        started: std::time::Instant::now(),
        disk_free_limit: 0,
        config_file: None,
        data_dir: "/data".into(),
        listeners: OnceLock::new(),
        links: OnceLock::new(),
    });
    let relay = Relay::install(
        broker.clone(),
        Arc::new(links),
        meta.clone(),
        clock,
        applied.clone(),
        facts,
    );
    let _ = relay_cell.set(relay.clone());
    // The failure detector's input (the joiner's host may not exist yet: its probes fail).
    tokio::task::spawn_local(crate::gm_scenario::ping_peers(
        id,
        JOINER,
        transport.clone(),
        last_seen.clone(),
    ));
    tokio::task::spawn_local(detect_failures(
        id,
        raft.clone(),
        (broker.clone(), clock),
        (last_seen, down),
        relay.clone(),
        shared.session.clone(),
        trace.clone(),
    ));
    let record = NodeRecord {
        id,
        name: host(id),
        amqp: String::new(),
        admin: String::new(),
        link: addr(id),
        incarnation: boot,
    };
    if id <= NODES {
        propose_until_done(&raft, Command::RegisterNode(record), id, &trace).await;
        tokio::task::spawn_local(add_learners(raft.clone()));
    } else {
        // A joining node knows no leader yet: a member proposes its record (as
        // `warrenctl join_cluster` has a seed node do), then the leader adds it as a
        // learner and it catches up.
        let mut through = 1;
        propose_through_members(&transport, &Command::RegisterNode(record), &mut through).await;
        trace.log(format!("n{id} registered through n{through}"));
    }
    if id == 1 && boot == 1 {
        propose_until_done(&raft, Command::AddVhost { name: VHOST.into() }, id, &trace).await;
        for c in warren::broker::config_commands(&config) {
            propose_until_done(&raft, c, id, &trace).await;
        }
        propose_until_done(&raft, Command::DeclareQueue(queue_def(1)), id, &trace).await;
        let mut session_queue = queue_def(2);
        session_queue.name = session_clients::QUEUE.into();
        propose_until_done(&raft, Command::DeclareQueue(session_queue), id, &trace).await;
        propose_until_done(&raft, ha_policy("all"), id, &trace).await;
        trace.log("n1 declared the queue and its ha policy");
    }
    // As a node does before storage opens: the metadata caught up (this boot's record is
    // applied here, so is everything before it), and the broker runs it.
    loop {
        let s = raft.snapshot();
        if s.nodes.get(&id).is_some_and(|n| n.incarnation == boot) {
            broker.follow(s, clock.now());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (storage, summary) = match Storage::open_with(
        disk,
        &broker,
        durability.clone(),
        Path::new("/data"),
        &config.storage,
        clock.now(),
    ) {
        Ok(opened) => opened,
        Err(e) => {
            // As `warren` does: a node whose storage cannot open exits.
            trace.log(format!("n{id} storage cannot open ({e}): the node exits"));
            lock(&shared.exits).push(id);
            return std::future::pending().await;
        }
    };
    broker.set_pager(storage.clone());
    trace.log(format!(
        "n{id} storage open: {} queues, {} messages",
        summary.queues, summary.messages
    ));
    lock(&shared.rafts).insert(id, raft.clone());
    // The broker follows the metadata: `runtime::cluster`'s follower task (the links here
    // know every node's address already).
    tokio::task::spawn_local(follow_metadata(
        raft.clone(),
        broker.clone(),
        applied_tx,
        clock,
        relay_cell.clone(),
        |_, _| {},
    ));
    // Its routing lease, as `runtime::cluster` keeps it: publishes are routed only while
    // the node's metadata is recent.
    tokio::task::spawn_local(keep_routing_lease(
        raft.clone(),
        broker.clone(),
        applied.clone(),
        clock,
        ROUTING_LEASE,
    ));
    // Its queues serve other nodes from now on, as once a node's storage recovered.
    relay.serve();
    // The syncer, as an async task on the simulated clock, pipelined as the node's syncer
    // thread is: it writes rounds (`Storage::write_round`, the node's own round), and each
    // round's laps are awaited by a task of their own that reports them
    // (`Storage::laps_done`); the group-commit core keeps the confirms in order.
    let syncer = storage.clone();
    tokio::task::spawn_local(async move {
        loop {
            let idle = match syncer.write_round() {
                Ok(Some(laps)) => {
                    let completer = syncer.clone();
                    tokio::task::spawn_local(async move {
                        let (round, ok) = laps.wait().await;
                        completer.laps_done(round, ok);
                    });
                    false
                }
                Ok(None) => true,
                Err(e) => {
                    syncer.fail_with(e);
                    return;
                }
            };
            if !syncer.has_work()
                || (idle && syncer.rounds_in_flight() > 0)
                || syncer.pipeline_full()
            {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    });
    let mirrors = MirrorHost::new(
        broker.clone(),
        storage,
        gm,
        raft.clone(),
        clock,
        std::env::temp_dir().join(format!("warren-sim-hold-n{id}")),
    )
    .with_inline_storage()
    .with_lease(Duration::from_millis(PEER_TIMEOUT_MS / 2));
    let _tasks = mirrors.start(Duration::from_millis(500));
    // The AMQP listener: every connection runs the node's own session driver.
    // The node never shuts down here (a crash ends it) and has no memory alarm; the
    // senders live as long as the listener (a closed shutdown watch means shutdown).
    let (shutdown_tx, shutdown) = tokio::sync::watch::channel(false);
    let (alarm_tx, alarm) = tokio::sync::watch::channel(false);
    let ctx = ConnContext {
        broker: broker.clone(),
        session: warren::session::SessionConfig::from_config(&config),
        clock,
        shutdown,
        alarm,
        outbound_bytes_max: config.limits.connection_outbound_bytes_max,
        node_span: tracing::Span::none(),
        meta,
    };
    tokio::task::spawn_local(async move {
        let _senders = (shutdown_tx, alarm_tx);
        accept_amqp(ctx).await
    });
    let _ = serving.set(Arc::new(Serving {
        id,
        broker,
        durability: durability.clone(),
        raft,
        clock,
        unacked: Mutex::default(),
        next_tag: Mutex::new(0),
    }));
    trace.log(format!("n{id} serving"));
    // As the node's monitor (`runtime::node::monitor`): a storage failure ends the process.
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        if durability.has_failed() {
            trace.log(format!("n{id} storage failed: the node exits"));
            lock(&shared.exits).push(id);
            std::future::pending::<()>().await;
        }
    }
}

impl Serving {
    fn not_master(&self) -> Reply {
        Reply::NotMaster {
            home: self
                .broker
                .snapshot()
                .vhosts
                .get(VHOST)
                .and_then(|v| v.queues.get(QUEUE))
                .map(|q| q.home),
        }
    }

    /// The queue if this node serves it, and its epoch here.
    fn serving(&self) -> Option<(Arc<QueueHandle>, u64)> {
        let handle = self.broker.queue(VHOST, QUEUE)?;
        let state = self.raft.snapshot();
        let home = state.vhosts.get(VHOST)?.queues.get(QUEUE)?.home;
        if home != self.id {
            return None;
        }
        let epoch = state.mirror_sets.get(&key()).map_or(0, |s| s.epoch);
        Some((handle, epoch))
    }

    async fn handle(self: Arc<Self>, req: Request) -> Reply {
        let Some((handle, epoch)) = self.serving() else {
            return self.not_master();
        };
        // The incarnation of the queue the broker routes to now (its own metadata, which
        // its queues follow).
        let incarnation = self
            .broker
            .snapshot()
            .mirror_sets
            .get(&key())
            .map(|m| m.incarnation);
        let now = self.clock.now();
        match req {
            Request::Publish { publisher, n } => {
                let mode = if transient(publisher, n) { 1 } else { 2 };
                let props = AMQPProperties::default().with_delivery_mode(mode);
                let mut body = publisher.to_be_bytes().to_vec();
                body.extend_from_slice(&n.to_be_bytes());
                let message = Arc::new(Message {
                    id: self.broker.next_message_id(),
                    exchange: String::new(),
                    routing_key: QUEUE.into(),
                    properties_raw: Bytes::from(encode_properties(&props)),
                    properties: props,
                    body: Bytes::from(body),
                });
                let snap = self.broker.snapshot();
                let Some(vhost) = snap.vhosts.get(VHOST) else {
                    return self.not_master();
                };
                let taken_at = now_ms();
                let outcome = self.broker.publish(vhost, "", message, now);
                if outcome.rejected || outcome.routed == 0 {
                    return Reply::Nacked;
                }
                let t = outcome.ticket;
                // As a channel in confirm mode waits for its ticket.
                loop {
                    let d = &self.durability;
                    if d.is_refused(t) {
                        return Reply::Nacked;
                    }
                    if d.is_durable(t) {
                        return Reply::Confirmed {
                            epoch,
                            incarnation,
                            at: taken_at,
                        };
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            Request::Get => {
                let mut dead = Vec::new();
                let got = handle.lock().get(now, true, &mut dead);
                let Some((entry, _)) = got else {
                    return Reply::Empty;
                };
                let b = &entry.message.body;
                if b.len() != 12 {
                    return Reply::Empty;
                }
                let publisher = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
                let mut nb = [0u8; 8];
                nb.copy_from_slice(&b[4..12]);
                let tag = {
                    let mut t = lock(&self.next_tag);
                    *t += 1;
                    *t
                };
                lock(&self.unacked).insert(tag, (handle.clone(), entry.seq));
                Reply::Message {
                    publisher,
                    n: u64::from_be_bytes(nb),
                    redelivered: entry.redelivered,
                    tag,
                    epoch,
                    incarnation,
                    at: now_ms(),
                }
            }
            Request::Ack { tag } => {
                if let Some((h, seq)) = lock(&self.unacked).remove(&tag) {
                    let mut dead = Vec::new();
                    h.lock().ack(&h, &[seq], now, &mut dead);
                }
                Reply::Acked
            }
        }
    }
}

/// The failure detector (`warren::cluster::Detector`, the node's own) driven as
/// `runtime::cluster::watch_nodes` drives it: every node tells its broker which nodes are
/// down; the leader, from a leadership a quorum confirmed, records `NodeDown` once per
/// outage. The simulated transport has no refused connections.
async fn accept_amqp(ctx: ConnContext) {
    let Ok(listener) = TcpListener::bind(("0.0.0.0", session_clients::AMQP_PORT)).await else {
        return;
    };
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        let local = listener
            .local_addr()
            .unwrap_or_else(|_| std::net::SocketAddr::from(([0, 0, 0, 0], 0)));
        tokio::spawn(conn_task::run(stream, peer, local, None, ctx.clone()));
    }
}

/// When this node last heard each peer (simulated ms).
type LastSeen = Arc<Mutex<BTreeMap<NodeId, u64>>>;
/// The peers this node's failure detector holds down now.
type DownNow = Arc<Mutex<BTreeSet<NodeId>>>;

async fn detect_failures(
    id: NodeId,
    raft: MetaRaft,
    (broker, clock): (Arc<Broker>, Clock),
    (seen, down_now): (LastSeen, DownNow),
    relay: Arc<Relay>,
    session: Arc<SessionRecords>,
    trace: Trace,
) {
    let mut detector = Detector::new(id, PEER_TIMEOUT_MS, now_ms());
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = now_ms();
        let state = raft.snapshot();
        // A node just registered counts as heard from when first seen here.
        {
            let mut seen = lock(&seen);
            for p in state.nodes.keys() {
                seen.entry(*p).or_insert(now);
            }
        }
        let verdict = detector.handle_tick(
            now,
            raft.is_leader(),
            state.nodes.keys().copied(),
            |p| lock(&seen).get(&p).copied(),
            |_| false,
        );
        raft.fence_reads(&verdict.to_declare);
        let down = verdict.down;
        if *lock(&down_now) != down {
            trace.log(format!("n{id} sees down: {down:?}"));
        }
        broker.set_down_nodes(down.clone(), clock.now());
        *lock(&down_now) = down;
        // As `runtime::cluster::watch_nodes` tells the relay.
        for n in verdict.newly_down {
            session.held_down(now, id, n, true);
            relay.node_down(n);
        }
        for n in verdict.newly_up {
            session.held_down(now, id, n, false);
            relay.node_up(n);
        }
        relay.rehome();
        record_down_nodes(&raft, &mut detector, verdict.to_declare, |peer| {
            trace.log(format!("n{id} (leader) records n{peer} down"))
        })
        .await;
    }
}

/// Proposes `cmd` through the members, starting at `*node` and moving on after each
/// failure, until one applied it (any member forwards it to the leader); `*node` is left at
/// the member that did.
async fn propose_through_members(t: &TurmoilTransport, cmd: &Command, node: &mut NodeId) {
    let Ok(body) = bincode::serialize(cmd) else {
        return;
    };
    loop {
        let r = t
            .request(&addr(*node), Kind::Propose, &body, Duration::from_secs(3))
            .await;
        if matches!(r.as_deref(), Ok([1])) {
            return;
        }
        *node = *node % NODES + 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The membership task (`runtime::cluster`'s, reduced): the leader adds every registered
/// node that is not in the Raft membership as a learner.
async fn add_learners(raft: MetaRaft) {
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if !raft.is_leader() {
            continue;
        }
        let m = raft.membership();
        for id in raft.snapshot().nodes.keys() {
            if !m.voters.contains_key(id) && !m.learners.contains_key(id) {
                let _ = raft.add_learner(*id, addr(*id)).await;
            }
        }
    }
}

async fn call(t: &TurmoilTransport, node: NodeId, req: &Request, deadline: u64) -> Option<Reply> {
    let body = bincode::serialize(req).ok()?;
    let bytes = t
        .request(
            &addr(node),
            Kind::Client,
            &body,
            Duration::from_millis(deadline),
        )
        .await
        .ok()?;
    bincode::deserialize(&bytes).ok()
}

/// A publisher: up to [`IN_FLIGHT`] publishes at once to the node it believes masters the
/// queue; every attempt is a new message (a nacked or unanswered one is not resent).
async fn run_publisher(p: u32, seed: u64, shared: Arc<Shared>, trace: Trace) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x9B ^ ((p as u64) << 32));
    let t = TurmoilTransport::new(format!("client-p{p}"), trace.clone());
    let mut target: NodeId = 1;
    let mut n = 0u64;
    let mut inflight = tokio::task::JoinSet::new();
    let mut next_send = 0;
    loop {
        let now = now_ms();
        if now >= WORKLOAD_MS && inflight.is_empty() {
            break;
        }
        if now < WORKLOAD_MS && now >= next_send && inflight.len() < IN_FLIGHT {
            n += 1;
            let (t, req) = (t.clone(), Request::Publish { publisher: p, n });
            let this = n;
            let to = if p == PUBLISHERS - 1 {
                n % shared.hosts() + 1
            } else {
                target
            };
            inflight.spawn_local(async move { (this, to, call(&t, to, &req, 5_000).await) });
            next_send = now + rng.gen_range(5..40);
        }
        let Some(Ok((m, node, reply))) = (tokio::select! {
            r = inflight.join_next(), if !inflight.is_empty() => r,
            _ = tokio::time::sleep(Duration::from_millis(next_send.saturating_sub(now).max(1))) => None,
        }) else {
            continue;
        };
        match reply {
            Some(Reply::Confirmed {
                epoch,
                incarnation,
                at,
            }) => lock(&shared.confirms).push(Served {
                at,
                node,
                epoch,
                incarnation,
                publisher: p,
                n: m,
                redelivered: false,
                kind: "confirm",
            }),
            Some(Reply::Nacked) => {
                trace.log(format!("p{p} #{m} nacked by n{node}"));
                *lock(&shared.nacks) += 1;
            }
            Some(Reply::NotMaster { home }) => {
                let next = home
                    .filter(|h| *h != node)
                    .unwrap_or(shared.next_node(node));
                if target == node {
                    trace.log(format!("p{p} n{node} is not the master: trying n{next}"));
                    target = next;
                    next_send = now_ms() + 50;
                }
            }
            other => {
                trace.log(format!("p{p} #{m} n{node}: {other:?}"));
                if target == node {
                    target = shared.next_node(node);
                }
            }
        }
    }
    trace.log(format!("p{p} done after {n} publishes"));
}

/// The consumer: basic.get with acks from the node it believes masters the queue, slowly
/// while publishers run (a backlog builds up for syncs to copy), then draining.
async fn run_consumer(seed: u64, shared: Arc<Shared>, trace: Trace) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xC0);
    let t = TurmoilTransport::new("client-c", trace.clone());
    let mut target: NodeId = 1;
    loop {
        let draining = shared.draining.load(Ordering::SeqCst);
        // One get in ten goes to any node: one still serving when it should not is caught.
        let node = if rng.gen_bool(0.1) {
            rng.gen_range(1..=shared.hosts())
        } else {
            target
        };
        match call(&t, node, &Request::Get, 2_000).await {
            Some(Reply::Message {
                publisher,
                n,
                redelivered,
                tag,
                epoch,
                incarnation,
                at,
            }) => {
                lock(&shared.deliveries).push(Served {
                    at,
                    node,
                    epoch,
                    incarnation,
                    publisher,
                    n,
                    redelivered,
                    kind: "delivery",
                });
                if redelivered {
                    trace.log(format!("c got p{publisher} #{n} redelivered from n{node}"));
                }
                // Now and then an ack is late (it may cross a failover).
                if rng.gen_bool(0.05) {
                    tokio::time::sleep(Duration::from_millis(rng.gen_range(50..500))).await;
                }
                let _ = call(&t, node, &Request::Ack { tag }, 2_000).await;
            }
            Some(Reply::Empty) => {
                if draining && every_confirm_seen(&shared) {
                    trace.log("c drained: every confirmed message seen, the queue empty");
                    shared.drained.store(true, Ordering::SeqCst);
                    return;
                }
                tokio::time::sleep(Duration::from_millis(rng.gen_range(10..50))).await;
            }
            Some(Reply::NotMaster { .. }) if node != target => {}
            Some(Reply::NotMaster { home }) => {
                let next = home
                    .filter(|h| *h != target)
                    .unwrap_or(shared.next_node(target));
                trace.log(format!("c n{target} is not the master: trying n{next}"));
                target = next;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => {
                trace.log(format!("c n{node}: {other:?}"));
                if node == target {
                    target = shared.next_node(target);
                }
            }
        }
        if !draining {
            tokio::time::sleep(Duration::from_millis(rng.gen_range(5..25))).await;
        }
    }
}

fn every_confirm_seen(shared: &Shared) -> bool {
    shared.missing().is_empty()
}

/// The result of one run.
pub use crate::scenario::Outcome;

/// Runs the mirrored-queue scenario for `seed` and checks it: the whole fault mix.
pub fn run_seed(seed: u64) -> Outcome {
    run(seed, true, None)
}

/// A seed with the given nodes' clock rates (parts per million; the others at the
/// simulation's rate) instead of the ones the seed draws: for tests that a clock slower
/// than the lease argument allows is caught.
pub fn run_seed_with_clock_rates(seed: u64, rates: &[(NodeId, u64)]) -> Outcome {
    run(seed, true, Some(rates.iter().copied().collect()))
}

/// The same without the faults session 34 added (the whole cluster's crash, the queue's
/// delete and declare): each seed's plan as it was before, so the seeds that found the
/// bugs before them replay what they found.
pub fn run_seed_old_mix(seed: u64) -> Outcome {
    run(seed, false, None)
}

fn run(seed: u64, new_faults: bool, forced_rates: Option<BTreeMap<NodeId, u64>>) -> Outcome {
    let trace = Trace::new();
    let shared = Arc::new(Shared::default());
    let mut rng = StdRng::seed_from_u64(seed ^ 0x3177);
    let mut faults = plan(&mut rng);
    // A third of the partitions cut one way only, and a third of the runs get a disk
    // fault. Drawn from a stream of their own, so the rest of each seed's plan is what it
    // was before these existed.
    let mut cuts = Cut::stream(seed, 0x3177);
    for (_, f) in faults.iter_mut() {
        if let Fault::Partition(_, cut) = f {
            *cut = cuts();
        }
    }
    let mut more = StdRng::seed_from_u64(seed ^ 0xd15c);
    if more.gen_bool(0.33) {
        let target = if more.gen_bool(0.5) {
            Target::Master
        } else {
            Target::Node(more.gen_range(1..=NODES))
        };
        let what = [DiskFault::Fsync, DiskFault::Torn, DiskFault::Full][more.gen_range(0..3)];
        // At a time no node is away (one away at a time), with a second to spare.
        let away: Vec<(u64, u64)> = faults
            .iter()
            .enumerate()
            .filter(|(_, (_, f))| matches!(f, Fault::Partition(..) | Fault::Crash(_)))
            .map(|(i, (from, _))| {
                let back = faults[i..]
                    .iter()
                    .find(|(_, f)| matches!(f, Fault::Heal | Fault::Restart))
                    .map_or(u64::MAX, |(t, _)| *t);
                (*from, back.saturating_add(1_000))
            })
            .collect();
        let at = (0..10)
            .map(|_| more.gen_range(1_500..9_000u64))
            .find(|t| away.iter().all(|(from, to)| t + 1_000 < *from || t > to));
        if let Some(at) = at {
            faults.push((at, Fault::Disk(target, what)));
            faults.sort_by_key(|(t, _)| *t);
        }
    }
    // Three in ten runs delete and declare the queue again, at a time of their own. A
    // third end their faults with a crash of the whole cluster (every node and its disks
    // at once) and a restart of every node, after the rest of the plan. Each from a
    // stream of its own.
    let mut redeclare = StdRng::seed_from_u64(seed ^ 0xde1e);
    if redeclare.gen_bool(0.3) && new_faults {
        faults.push((redeclare.gen_range(2_500..12_000), Fault::Redeclare));
        faults.sort_by_key(|(t, _)| *t);
    }
    let mut whole = StdRng::seed_from_u64(seed ^ 0xa11c);
    let whole_crash = (whole.gen_bool(0.33) && new_faults).then(|| {
        let after = faults.last().map_or(0, |(t, _)| *t);
        let at = after.max(2_000) + whole.gen_range(1_000..4_000);
        (at, whole.gen_range(200..3_000))
    });
    // Half the runs skew the nodes' clocks: each node's clock (its leases, expiries and
    // the timers set from them) runs at 0.6-1.4 times the simulation's rate. The failure
    // detectors keep the simulation's time, so a node's rate is its drift against every
    // leader's; the lease argument (`docs/mirroring.md`) holds above half. From a stream
    // of its own.
    let mut skew = StdRng::seed_from_u64(seed ^ 0xc10c);
    let skewed = skew.gen_bool(0.5) && new_faults;
    let rates: BTreeMap<NodeId, u64> = (1..=JOINER)
        .map(|id| {
            let drawn = if skewed {
                skew.gen_range(600_000..=1_400_000)
            } else {
                1_000_000
            };
            let forced = forced_rates.as_ref().and_then(|f| f.get(&id).copied());
            (
                id,
                forced.unwrap_or(if forced_rates.is_some() {
                    1_000_000
                } else {
                    drawn
                }),
            )
        })
        .collect();
    trace.log(format!("mirror seed {seed}"));
    for (t, f) in &faults {
        trace.log(format!("plan {t}ms {f:?}"));
    }
    for (id, rate) in rates.iter().filter(|(_, r)| **r != 1_000_000) {
        trace.log(format!("plan n{id}'s clock runs at {rate} ppm"));
    }
    if let Some((at, down)) = whole_crash {
        trace.log(format!(
            "plan {at}ms crash of every node, down for {down}ms"
        ));
    }
    crate::task_ids::align();
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(Duration::from_secs(3_600))
        .tick_duration(Duration::from_millis(1))
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(Duration::from_millis(5))
        .build();
    let disks: BTreeMap<NodeId, (MemDisk, MemDisk)> = (1..=JOINER)
        .map(|id| (id, (MemDisk::new(), MemDisk::new())))
        .collect();
    let env = |id: NodeId| NodeEnv {
        id,
        seed,
        clock_rate_ppm: rates[&id],
        raft_disk: disks[&id].0.clone(),
        disk: disks[&id].1.clone(),
        shared: Arc::clone(&shared),
        trace: trace.clone(),
    };
    for id in 1..=NODES {
        let env = env(id);
        sim.host(host(id), move || {
            // Every log line of the node's code names its node.
            let span = tracing::info_span!("n", id);
            tracing::Instrument::instrument(run_node(env.clone()), span)
        });
    }
    {
        let (shared, trace) = (shared.clone(), trace.clone());
        sim.client("client", async move {
            // The cluster forms and the queue is declared first.
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            let mut tasks = tokio::task::JoinSet::new();
            for p in 0..PUBLISHERS {
                let (shared, trace) = (shared.clone(), trace.clone());
                tasks.spawn_local(run_publisher(p, seed, shared, trace));
            }
            tasks.spawn_local(run_consumer(seed, shared.clone(), trace.clone()));
            // The session clients: AMQP through the nodes' own sessions and relay.
            let hosts: Rc<dyn Fn() -> u64> = {
                let shared = shared.clone();
                Rc::new(move || shared.hosts())
            };
            let draining: Rc<dyn Fn() -> bool> = {
                let shared = shared.clone();
                Rc::new(move || shared.draining.load(Ordering::SeqCst))
            };
            for p in 0..SESSION_PUBLISHERS {
                tasks.spawn_local(session_clients::run_publisher(
                    p,
                    seed,
                    WORKLOAD_MS,
                    hosts.clone(),
                    shared.session.clone(),
                    trace.clone(),
                ));
            }
            if session_clients::redeclares(seed) {
                tasks.spawn_local(session_clients::run_redeclarer(
                    seed,
                    WORKLOAD_MS,
                    hosts.clone(),
                    shared.session.clone(),
                    trace.clone(),
                ));
            }
            tasks.spawn_local(session_clients::run_consumer(
                seed,
                hosts,
                draining,
                shared.session.clone(),
                trace.clone(),
            ));
            while tasks.join_next().await.is_some() {}
            Ok(())
        });
    }
    // An operator (warrenctl set_policy, delete_queue, declare_queue) makes the planned
    // changes one after the other, each through any node (which forwards it to the
    // leader).
    let changes: Vec<(u64, Fault)> = faults
        .iter()
        .filter(|(_, f)| matches!(f, Fault::Exactly2 | Fault::All | Fault::Redeclare))
        .cloned()
        .collect();
    {
        let (shared, trace) = (shared.clone(), trace.clone());
        sim.client("ctl", async move {
            let t = TurmoilTransport::new("ctl", trace.clone());
            let mut node = 1;
            for (at, change) in changes {
                tokio::time::sleep(Duration::from_millis(at.saturating_sub(now_ms()))).await;
                match change {
                    Fault::Redeclare => {
                        let delete = Command::DeleteQueue {
                            vhost: VHOST.into(),
                            name: QUEUE.into(),
                        };
                        propose_through_members(&t, &delete, &mut node).await;
                        lock(&shared.deleted).push(now_ms());
                        trace.log(format!("ctl: queue deleted through n{node}"));
                        let declare = Command::DeclareQueue(queue_def(node));
                        propose_through_members(&t, &declare, &mut node).await;
                        trace.log(format!("ctl: queue declared through n{node}"));
                    }
                    Fault::Exactly2 => {
                        propose_through_members(&t, &ha_policy("exactly"), &mut node).await;
                        trace.log(format!("ctl: policy applied through n{node}"));
                    }
                    _ => {
                        propose_through_members(&t, &ha_policy("all"), &mut node).await;
                        trace.log(format!("ctl: policy applied through n{node}"));
                    }
                }
            }
            Ok(())
        });
    }
    let faults_end = faults
        .last()
        .map(|(t, _)| *t)
        .into_iter()
        .chain(whole_crash.map(|(at, down)| at + down))
        .max()
        .unwrap_or(0);
    let mut pending = faults.into_iter().peekable();
    let drain_from = WORKLOAD_MS.max(faults_end) + 500;
    let deadline = drain_from + DRAIN_MS;
    // The node a partition or crash took away (one at a time).
    let mut away: Option<NodeId> = None;
    // The queue's epoch, if the node away crashed while it was the master.
    let mut crashed_master: Option<u64> = None;
    // A node whose storage failed and that exited: when its supervisor restarts it, and
    // the queue's epoch if it was the master.
    let mut exited: Option<(NodeId, u64, Option<u64>)> = None;
    // The whole cluster's crash: when it is due (once no node is away), then when every
    // node restarts.
    let mut whole_crash = whole_crash;
    let mut all_down_until: Option<u64> = None;
    let mut shown = (0, 0);
    let mut shown_session = String::new();
    loop {
        let now = sim.elapsed().as_millis() as u64;
        trace.set_harness_time(now);
        // The queue's home, mirrors and GM group as the newest metadata has them, on change.
        if let Some(s) = shared.newest() {
            let incarnation = s.mirror_sets.get(&key()).map_or(0, |m| m.incarnation);
            let group = s.gm_groups.get(&warren::mirror::message::group_name(
                VHOST,
                QUEUE,
                incarnation,
            ));
            let versions = (
                s.mirror_sets.get(&key()).map_or(0, |m| m.version),
                group.map_or(0, |g| g.version),
            );
            if versions != shown {
                shown = versions;
                let home = s
                    .vhosts
                    .get(VHOST)
                    .and_then(|v| v.queues.get(QUEUE))
                    .map_or(0, |q| q.home);
                let members = group.map_or(String::new(), |g| {
                    g.members
                        .iter()
                        .map(|m| match m {
                            warren::gm::Slot::Alive(m) => format!("+{}.{}", m.node, m.since),
                            warren::gm::Slot::Dead(m) => format!("-{}.{}", m.node, m.since),
                        })
                        .collect::<Vec<_>>()
                        .join(" ")
                });
                trace.log(format!(
                    "metadata: home n{home}, mirrors {}; group {members}",
                    shared.mirrors()
                ));
            }
        }
        // The session clients' queue too.
        if let Some(s) = shared.newest() {
            let k = (VHOST.to_string(), session_clients::QUEUE.to_string());
            let line = s.mirror_sets.get(&k).map(|set| {
                let home = s
                    .vhosts
                    .get(VHOST)
                    .and_then(|v| v.queues.get(session_clients::QUEUE))
                    .map_or(0, |q| q.home);
                format!(
                    "metadata: {} home n{home}, mirrors {}, epoch {}, incarnation {}",
                    session_clients::QUEUE,
                    set.mirrors
                        .iter()
                        .map(|m| format!("n{}{}", m.node, if m.synchronised { "" } else { "?" }))
                        .collect::<Vec<_>>()
                        .join(" "),
                    set.epoch,
                    set.incarnation
                )
            });
            if let Some(line) = line.filter(|l| *l != shown_session) {
                trace.log(line.clone());
                shown_session = line;
            }
        }
        // A node whose storage failed exits (its process ends: what it wrote stays in the
        // page cache, so its disk does not crash), and comes back half a second later.
        let exit = if exited.is_none() {
            lock(&shared.exits).pop()
        } else {
            None
        };
        if let Some(n) = exit {
            trace.log(format!("fault: n{n} exits (storage failed)"));
            let was_master = shared.epoch_if_master(n);
            sim.crash(host(n));
            lock(&shared.rafts).remove(&n);
            exited = Some((n, now + 500, was_master));
        }
        if let Some((n, _, was_master)) = exited.filter(|(_, at, _)| *at <= now) {
            trace.log(format!("fault: n{n} restarts after its exit"));
            if let Some(epoch) = was_master {
                lock(&shared.master_restarts).push((now, n, epoch));
            }
            disks[&n].1.set_capacity(None);
            sim.bounce(host(n));
            exited = None;
        }
        if let Some((at, down)) = whole_crash.filter(|(at, _)| *at <= now) {
            if away.is_none() && exited.is_none() {
                trace.log(format!("fault: crash of every node (planned at {at}ms)"));
                for n in 1..=shared.hosts() {
                    sim.crash(host(n));
                    lock(&shared.rafts).remove(&n);
                    disks[&n].0.crash();
                    disks[&n].1.crash();
                }
                all_down_until = Some(now + down);
                whole_crash = None;
            }
        }
        if all_down_until.is_some_and(|t| t <= now) {
            trace.log("fault: every node restarts");
            lock(&shared.cluster_restarts).push(now);
            for n in 1..=shared.hosts() {
                disks[&n].1.set_capacity(None);
                sim.bounce(host(n));
            }
            all_down_until = None;
        }
        while let Some((_, fault)) = pending.next_if(|(t, _)| *t <= now) {
            let pick = |t: Target| match t {
                Target::Master => shared.home().unwrap_or(1),
                Target::Node(n) => n,
            };
            match fault {
                Fault::Partition(..) | Fault::Crash(_) if exited.is_some() => {
                    // One node away at a time: its heal or restart finds none away.
                    trace.log(format!("fault: {fault:?} skipped (a node is restarting)"));
                }
                Fault::Disk(t, what) => {
                    let n = pick(t);
                    if away.is_some() || exited.is_some() {
                        trace.log(format!(
                            "fault: disk {what:?} on n{n} skipped (a node is away)"
                        ));
                        continue;
                    }
                    trace.log(format!("fault: disk {what:?} on n{n} ({t:?})"));
                    let disk = &disks[&n].1;
                    match what {
                        DiskFault::Fsync => disk.fail_next_sync(),
                        DiskFault::Torn => disk.short_next_write(),
                        DiskFault::Full => disk.set_capacity(Some(disk.used_bytes() + (64 << 10))),
                    }
                }
                Fault::Partition(t, cut) => {
                    let n = pick(t);
                    trace.log(format!("fault: partition n{n} ({t:?}, {cut:?})"));
                    let others: Vec<String> =
                        (1..=shared.hosts()).filter(|o| *o != n).map(host).collect();
                    cut.apply(&mut sim, &host(n), &others);
                    away = Some(n);
                }
                Fault::Heal => {
                    if let Some(n) = away.take() {
                        trace.log(format!("fault: heal n{n}"));
                        for o in (1..=shared.hosts()).filter(|o| *o != n) {
                            sim.repair(host(n), host(o));
                        }
                    }
                }
                Fault::Crash(t) => {
                    let n = pick(t);
                    trace.log(format!("fault: crash n{n} ({t:?})"));
                    crashed_master = shared.epoch_if_master(n);
                    sim.crash(host(n));
                    lock(&shared.rafts).remove(&n);
                    disks[&n].0.crash();
                    disks[&n].1.crash();
                    away = Some(n);
                }
                Fault::Restart => {
                    if let Some(n) = away.take() {
                        trace.log(format!("fault: restart n{n}"));
                        if let Some(epoch) = crashed_master.take() {
                            lock(&shared.master_restarts).push((now, n, epoch));
                        }
                        sim.bounce(host(n));
                    }
                }
                Fault::Join => {
                    trace.log(format!("fault: n{JOINER} joins"));
                    let env = env(JOINER);
                    sim.host(host(JOINER), move || run_node(env.clone()));
                    shared.joined.store(true, Ordering::SeqCst);
                }
                Fault::Exactly2 | Fault::All => {
                    // Applied by the operator's client (`ctl`), in plan order.
                    trace.log(format!("fault: policy {fault:?}"));
                }
                Fault::Redeclare => {
                    // Made by the operator's client too.
                    trace.log("fault: the operator deletes the queue and declares it again");
                }
            }
        }
        if now >= drain_from && !shared.draining.swap(true, Ordering::SeqCst) {
            trace.log("drain: faults over, publishers done; the consumer drains the queue");
        }
        if shared.drained.load(Ordering::SeqCst) && shared.session.drained.load(Ordering::SeqCst) {
            // Every node holds a synchronised copy (`ha-mode: all`, every node back): the
            // syncs under load, of restarted and joined nodes, completed.
            match shared.unsynchronised() {
                None => {
                    trace.log(format!(
                        "liveness: every mirror synchronised ({})",
                        shared.mirrors()
                    ));
                    break;
                }
                Some(_) if now <= deadline => {}
                Some(missing) => {
                    if let Some(s) = shared.newest() {
                        let all: BTreeSet<NodeId> = s.nodes.keys().copied().collect();
                        trace.log(format!(
                            "reconcile plan with every node running: {:?}",
                            warren::mirror::reconcile::plan(&s, &all)
                        ));
                    }
                    shared.fail(
                        &trace,
                        format!(
                            "liveness: not synchronised within {DRAIN_MS}ms: {missing} ({})",
                            shared.mirrors()
                        ),
                    );
                    break;
                }
            }
        } else if now > deadline {
            let missing: Vec<String> = shared
                .missing()
                .iter()
                .map(|c| format!("p{}#{} (n{} e{})", c.publisher, c.n, c.node, c.epoch))
                .collect();
            let session = shared.session.missing();
            shared.fail(
                &trace,
                format!(
                    "G1/S1/liveness: not drained within {DRAIN_MS}ms; confirmed and never delivered: {} {:?}; session clients' {} {:?}",
                    missing.len(),
                    &missing[..missing.len().min(20)],
                    session.len(),
                    &session[..session.len().min(20)]
                ),
            );
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

fn check(shared: &Shared, trace: &Trace) {
    trace.log(shared.session.summary());
    for f in shared.session.check() {
        shared.fail(trace, f);
    }
    let confirms = lock(&shared.confirms).clone();
    let deliveries = lock(&shared.deliveries).clone();
    // G1 (the drain's condition, checked again here for runs that stopped otherwise).
    let seen: BTreeSet<(u32, u64)> = deliveries.iter().map(|d| (d.publisher, d.n)).collect();
    let unseen = confirms
        .iter()
        .filter(|c| !seen.contains(&(c.publisher, c.n)))
        .count();
    let lost = shared.missing().len();
    if unseen > lost {
        trace.log(format!(
            "G1: {} confirmed messages excused: transient ones gone with a master's (or the cluster's) restart from disk, or any in a queue deleted since",
            unseen - lost
        ));
    }
    if lost > 0 && shared.drained.load(Ordering::SeqCst) {
        shared.fail(
            trace,
            format!("G1: {lost} confirmed messages never delivered"),
        );
    }
    // G2: after the first delivery of a message, every one is flagged redelivered.
    let mut first: BTreeSet<(u32, u64)> = BTreeSet::new();
    for d in &deliveries {
        if !first.insert((d.publisher, d.n)) && !d.redelivered {
            shared.fail(
                trace,
                format!(
                    "G2: p{}#{} delivered again at {}ms by n{} (epoch {}) without redelivered",
                    d.publisher, d.n, d.at, d.node, d.epoch
                ),
            );
        }
    }
    // G3: first deliveries (not redelivered) of each publisher's messages in order, in
    // each incarnation of the queue.
    let mut last: BTreeMap<(u32, Option<u64>), u64> = BTreeMap::new();
    for d in deliveries.iter().filter(|d| !d.redelivered) {
        let prev = last.entry((d.publisher, d.incarnation)).or_insert(0);
        if d.n < *prev {
            shared.fail(
                trace,
                format!(
                    "G3: p{}#{} delivered at {}ms after #{}",
                    d.publisher, d.n, d.at, prev
                ),
            );
        }
        *prev = (*prev).max(d.n);
    }
    // G4 (see `g4`).
    let spans = g4(shared, trace, &confirms, &deliveries);
    let redelivered = deliveries.iter().filter(|d| d.redelivered).count();
    trace.log(format!(
        "check: {} confirms, {} nacks, {} deliveries ({} redelivered), epochs {:?}",
        confirms.len(),
        lock(&shared.nacks),
        deliveries.len(),
        redelivered,
        spans
            .iter()
            .map(
                |((i, e), (n, a, b))| if spans.iter().all(|s| s.0 .0 == *i) {
                    format!("e{e}:n{n}@{a}-{b}")
                } else {
                    format!(
                        "i{}e{e}:n{n}@{a}-{b}",
                        i.map_or("-".into(), |i| i.to_string())
                    )
                }
            )
            .collect::<Vec<_>>()
    ));
}

/// Epoch spans: (incarnation, epoch) → (node, first, last served).
type Spans = Vec<((Option<u64>, u64), (NodeId, u64, u64))>;

/// G4: one node per epoch, and epochs served in order, for confirms and deliveries
/// together (a deposed master's laps fail, so it cannot confirm what it takes once a
/// mirror is promoted; its lease runs out before that, so it stops delivering). A confirm
/// is dated when its node took the publish: its lap completed after that, and it may be
/// sent long after its lap, behind an earlier round still on its lap (seeds 87, 1487: a
/// round of the other queue stuck by a cut until the promotion voided it).
fn g4(shared: &Shared, trace: &Trace, confirms: &[Served], deliveries: &[Served]) -> Spans {
    let spans = |served: Vec<&Served>, report: &mut dyn FnMut(String)| -> Spans {
        let mut served = served;
        served.sort_by_key(|s| (s.at, s.incarnation, s.epoch, s.node));
        let mut by_epoch: BTreeMap<(Option<u64>, u64), (NodeId, u64, u64)> = BTreeMap::new();
        let mut last_of: BTreeMap<(Option<u64>, u64), &Served> = BTreeMap::new();
        for s in &served {
            last_of.insert((s.incarnation, s.epoch), s);
            let e = by_epoch
                .entry((s.incarnation, s.epoch))
                .or_insert((s.node, s.at, s.at));
            if e.0 != s.node {
                report(format!(
                    "G4: epoch {} served by n{} and n{} (at {}ms)",
                    s.epoch, e.0, s.node, s.at
                ));
            }
            e.2 = s.at;
        }
        let spans: Spans = by_epoch.into_iter().collect();
        for w in spans.windows(2) {
            let ((e1, (n1, _, last1)), (e2, (n2, first2, _))) = (w[0], w[1]);
            // Another incarnation is another queue: the deleted one's master may serve on
            // until it applies the delete.
            if e1.0 == e2.0 && n1 != n2 && last1 > first2 {
                let s = last_of[&e1];
                report(format!(
                    "G4: n{n1} served epoch {} until {last1}ms (a {}, p{}#{}), after n{n2} began epoch {} at {first2}ms (incarnation {})",
                    e1.1, s.kind, s.publisher, s.n, e2.1, e1.0.unwrap_or(0)
                ));
            }
        }
        spans
    };
    spans(
        confirms.iter().chain(deliveries.iter()).collect(),
        &mut |why| shared.fail(trace, why),
    )
}

/// Runs the checkers on a made-up client history (for the checkers' own tests): confirms
/// as (publisher, n, node, epoch), deliveries as (publisher, n, node, epoch, redelivered),
/// one millisecond apart in the order given, after a completed drain. Returns the
/// failures.
#[doc(hidden)]
pub fn check_served_for_test(
    confirms: &[(u32, u64, NodeId, u64)],
    deliveries: &[(u32, u64, NodeId, u64, bool)],
) -> Vec<String> {
    check_served_with_restarts_for_test(confirms, deliveries, &[])
}

/// [`check_served_for_test`] with restarts of the master's node after a crash: (when it
/// restarted, node, the epoch it crashed in), when counted in steps of 10 from the first
/// confirm (the confirms and then the deliveries are at 10, 20, 30...).
pub fn check_served_with_restarts_for_test(
    confirms: &[(u32, u64, NodeId, u64)],
    deliveries: &[(u32, u64, NodeId, u64, bool)],
    restarts: &[(u64, NodeId, u64)],
) -> Vec<String> {
    check_served_with_cluster_restarts_for_test(confirms, deliveries, restarts, &[])
}

/// [`check_served_with_restarts_for_test`] with restarts of the whole cluster too: when
/// every node came back, in the same steps.
pub fn check_served_with_cluster_restarts_for_test(
    confirms: &[(u32, u64, NodeId, u64)],
    deliveries: &[(u32, u64, NodeId, u64, bool)],
    restarts: &[(u64, NodeId, u64)],
    cluster_restarts: &[u64],
) -> Vec<String> {
    let shared = Shared::default();
    lock(&shared.master_restarts).extend_from_slice(restarts);
    lock(&shared.cluster_restarts).extend_from_slice(cluster_restarts);
    let confirms: Vec<_> = confirms
        .iter()
        .map(|&(p, n, node, epoch)| (p, n, node, epoch, None))
        .collect();
    check_history(shared, &confirms, deliveries, None)
}

/// The checkers on a history where the queue was deleted at `deleted_at` (in the steps of
/// [`check_served_with_restarts_for_test`]) and declared again as incarnation `current`:
/// confirms as (publisher, n, node, epoch, incarnation), deliveries of the new queue.
#[doc(hidden)]
pub fn check_served_with_delete_for_test(
    confirms: &[(u32, u64, NodeId, u64, Option<u64>)],
    deliveries: &[(u32, u64, NodeId, u64, bool)],
    deleted_at: u64,
    current: u64,
) -> Vec<String> {
    let shared = Shared::default();
    lock(&shared.deleted).push(deleted_at);
    *lock(&shared.latest_incarnation) = Some(current);
    check_history(shared, confirms, deliveries, Some(current))
}

/// Runs the checkers on `shared` with these confirms and deliveries (10 apart, confirms
/// first), the deliveries all of `delivered_incarnation`, after a completed drain.
fn check_history(
    shared: Shared,
    confirms: &[(u32, u64, NodeId, u64, Option<u64>)],
    deliveries: &[(u32, u64, NodeId, u64, bool)],
    delivered_incarnation: Option<u64>,
) -> Vec<String> {
    let trace = Trace::new();
    let mut at = 0;
    for &(publisher, n, node, epoch, incarnation) in confirms {
        at += 10;
        lock(&shared.confirms).push(Served {
            at,
            node,
            epoch,
            incarnation,
            publisher,
            n,
            redelivered: false,
            kind: "confirm",
        });
    }
    for &(publisher, n, node, epoch, redelivered) in deliveries {
        at += 10;
        lock(&shared.deliveries).push(Served {
            at,
            node,
            epoch,
            incarnation: delivered_incarnation,
            publisher,
            n,
            redelivered,
            kind: "delivery",
        });
    }
    shared.drained.store(true, Ordering::SeqCst);
    check(&shared, &trace);
    let failures = lock(&shared.failures).clone();
    failures
}
