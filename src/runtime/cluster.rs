//! Cluster mode: the node's seat in the metadata Raft group, and the tasks that keep the
//! broker in step with it.
//!
//! - [`Cluster::start`] binds the node links, starts [`MetaRaft`] from `DATA/raft`, and on
//!   the very first boot of the lowest-numbered initial member initialises the group (a
//!   marker file makes sure that happens once).
//! - The follower task hands every applied metadata state to [`Broker::follow`], then
//!   publishes the applied index; [`RaftMeta`] waits for that index, so a client hears
//!   declare-ok only once its own node runs the new state. The same task makes every
//!   registered node a link peer.
//! - The failure detector runs on every node (node-link heartbeats, `peer_timeout_ms`) and
//!   tells the broker which nodes are down; the leader alone proposes `NodeDown`, once per
//!   outage, which removes the node's transient and exclusive queues as RabbitMQ does.
//! - The membership task (leader only) makes the Raft membership follow the nodes table:
//!   a registered node becomes a learner and, while there are fewer than five voters, a
//!   voter; a forgotten node leaves.
//! - [`RaftMeta`] is the [`MetaCommit`] of a clustered node: it places new queues
//!   (`queue-master-locator`) and proposes the command.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::clock::Clock;
use super::conn_task::{MetaCommit, MetaFuture};
use super::file_disk::FileDisk;
use super::gm_host::{GmHost, GmHostConfig};
use super::node_link::{NodeLinkConfig, TcpTransport};
use super::relay::Relay;
use crate::broker::Broker;
use crate::cluster::Detector;
use crate::config::{ClusterConfig, Config};
use crate::meta::state::{Applied, Removed};
use crate::meta::{Command, MetaError, MetaState, NodeRecord, QueueDef};
use crate::runtime::raft::{MetaRaft, MetaRaftConfig, NodeId};
use crate::time::Instant;

/// The most voters the group has; later nodes stay learners (they replicate, do not vote).
pub const MAX_VOTERS: usize = 5;

/// The file that says this node initialised the group (so it never does it twice).
const INIT_MARKER: &str = "initialized";

/// Why cluster mode could not start.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The node-link listener could not bind.
    #[error("node link on {addr}: {source}")]
    Link {
        /// The address.
        addr: String,
        /// The cause.
        source: super::node_link::LinkError,
    },
    /// `[cluster.tls]` names an unusable file.
    #[error("{0}")]
    Tls(#[from] super::tls::TlsError),
    /// Raft could not start (its storage is unreadable, or the config is inconsistent).
    #[error("raft: {0}")]
    Raft(#[from] crate::runtime::raft::StartError),
    /// The data folder could not be written.
    #[error("cluster data folder: {0}")]
    Io(#[from] std::io::Error),
}

/// A clustered node's Raft member, node links and background tasks.
pub struct Cluster {
    node_id: NodeId,
    raft: MetaRaft,
    transport: TcpTransport,
    applied: watch::Receiver<u64>,
    broker: Arc<Broker>,
    commit_timeout: Duration,
    peer_timeout: Duration,
    initialised_here: bool,
    relay: Arc<std::sync::OnceLock<Arc<Relay>>>,
    gm: GmHost<TcpTransport>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

fn raft_config(cc: &ClusterConfig) -> MetaRaftConfig {
    MetaRaftConfig {
        cluster_name: cc.cluster_id.clone(),
        propose_timeout: Duration::from_millis(cc.commit_timeout_ms),
        ..MetaRaftConfig::default()
    }
}

/// The seed of the node's Raft runtime: from the config, so a simulated run replays.
fn raft_seed(cc: &ClusterConfig) -> u64 {
    cc.cluster_id
        .bytes()
        .fold(cc.node_id.wrapping_mul(0x9E37_79B9_7F4A_7C15), |h, b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01B3)
        })
}

impl Cluster {
    /// Binds the node links and starts Raft; initialises the group on the first boot of the
    /// lowest initial member; starts the follower task. The node is not ready for clients
    /// until [`Cluster::wait_ready`] returns.
    pub async fn start(
        config: &Config,
        cc: &ClusterConfig,
        broker: Arc<Broker>,
        clock: Clock,
    ) -> Result<Cluster, ClusterError> {
        let mut link = NodeLinkConfig::new(cc.cluster_id.clone(), cc.node_id);
        link.peers = cc
            .initial_members
            .iter()
            .filter(|m| m.id != cc.node_id)
            .map(|m| (m.id, m.link.clone()))
            .collect();
        link.heartbeat_interval = Duration::from_millis(cc.heartbeat_ms);
        link.peer_timeout = Duration::from_millis(cc.peer_timeout_ms);
        // A forwarded publish or delivery carries a whole message: room for the largest one
        // a client may publish, plus the envelope.
        link.max_frame = link
            .max_frame
            .max(config.amqp.max_message_size_bytes as usize + (1 << 20));
        // Read before binding: an unusable certificate stops the start with nothing bound.
        let tls = match &cc.tls {
            Some(t) => Some(super::tls::link::LinkTls::new(t)?),
            None => None,
        };
        let transport = TcpTransport::bind_with_tls(&cc.listen, link, tls)
            .await
            .map_err(|source| ClusterError::Link {
                addr: cc.listen.clone(),
                source,
            })?;
        let dir = config.node.data_dir.join("raft");
        std::fs::create_dir_all(&dir)?;
        let raft = MetaRaft::start(
            cc.node_id,
            transport.clone(),
            Arc::new(FileDisk::new()),
            &dir,
            &raft_config(cc),
            raft_seed(cc),
        )
        .await?;
        transport.serve(raft.rpc_server());
        // GM members (mirrored queues) of this node: views from the metadata, frames over
        // the node links.
        let gm = GmHost::new(
            cc.node_id,
            transport.clone(),
            raft.clone(),
            GmHostConfig {
                lap_latency: Some(broker.metrics().gm_lap_latency.clone()),
                ..GmHostConfig::default()
            },
        );
        let gm_frames = gm.clone();
        transport.serve_gm(Arc::new(move |frame: &[u8]| gm_frames.handle_frame(frame)));

        let lowest = cc.initial_members.iter().map(|m| m.id).min();
        let mut initialised_here = false;
        if lowest == Some(cc.node_id) && !dir.join(INIT_MARKER).exists() {
            let members: BTreeMap<NodeId, String> = cc
                .initial_members
                .iter()
                .map(|m| (m.id, m.link.clone()))
                .collect();
            match raft.initialize(members).await {
                Ok(()) => {
                    tracing::info!(members = cc.initial_members.len(), "cluster initialised");
                    initialised_here = true;
                }
                Err(crate::runtime::raft::InitError::AlreadyInitialized) => {}
                Err(e) => tracing::error!(error = %e, "cannot initialise the cluster"),
            }
            write_marker(&dir.join(INIT_MARKER))?;
        }

        let (applied_tx, applied) = watch::channel(0u64);
        let relay: Arc<std::sync::OnceLock<Arc<Relay>>> = Arc::default();
        let tasks = vec![tokio::spawn(follow(
            raft.clone(),
            broker.clone(),
            transport.clone(),
            applied_tx,
            clock,
            relay.clone(),
        ))];
        Ok(Cluster {
            node_id: cc.node_id,
            raft,
            transport,
            applied,
            broker,
            commit_timeout: Duration::from_millis(cc.commit_timeout_ms),
            peer_timeout: Duration::from_millis(cc.peer_timeout_ms),
            initialised_here,
            relay,
            gm,
            tasks,
        })
    }

    /// Waits until this node knows a leader and has applied an entry of its term, and its
    /// broker has followed: a first approximation of being caught up, which
    /// [`Cluster::join_metadata`] completes with a committed command. Only then may storage
    /// recover the queues homed here (an unknown queue's files would be pruned) and clients
    /// connect. Logs while it waits: a restarted cluster needs a majority of its nodes back.
    pub async fn wait_ready(&self) {
        let started = std::time::Instant::now();
        loop {
            if self.raft.wait_caught_up(Duration::from_secs(5)).await {
                break;
            }
            tracing::warn!(
                waited_s = started.elapsed().as_secs(),
                "waiting for a cluster leader (a majority of the nodes must be up)"
            );
        }
        let index = self.raft.view().applied_index.unwrap_or(0);
        let mut applied = self.applied.clone();
        let _ = applied.wait_for(|i| *i >= index).await;
    }

    /// Once ready: seeds the config's vhosts, users and permissions if this node created the
    /// cluster, clears what this node's previous run left (its exclusive and transient
    /// queues: `NodeDown` for itself) and registers its addresses.
    pub async fn join_metadata(&self, config: &Config, record: NodeRecord) {
        let meta = self.meta();
        let now = Instant::from_millis(0);
        if self.initialised_here {
            for c in crate::broker::config_commands(config) {
                if let Err(e) = meta.commit(c, now).await {
                    tracing::warn!(error = %e, "cannot seed a definition from the config");
                }
            }
        }
        // Committed and applied here before anything else happens: this is also the read
        // barrier that proves this node has applied every entry committed before it (a
        // restarted leader may see an entry of its own old term as "current" until it hears
        // from the new leader).
        loop {
            match meta
                .commit(Command::NodeDown { id: self.node_id }, now)
                .await
            {
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot clear the previous run's queues; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        if self.raft.snapshot().nodes.get(&self.node_id) != Some(&record) {
            if let Err(e) = meta.commit(Command::RegisterNode(record), now).await {
                tracing::warn!(error = %e, "cannot register this node");
            }
        }
    }

    /// Installs the relay that serves queues across nodes (before clients connect).
    pub fn install_relay(&self, meta: Arc<dyn MetaCommit>, clock: Clock) {
        let relay = Relay::install(
            self.broker.clone(),
            self.transport.clone(),
            meta,
            clock,
            self.applied.clone(),
        );
        let _ = self.relay.set(relay);
    }

    /// This node's queues serve other nodes from now on (storage has recovered them).
    pub fn serve_queues(&self) {
        if let Some(relay) = self.relay.get() {
            relay.serve();
        }
    }

    /// Starts the failure detector and the membership task (once ready).
    pub fn start_watchers(&mut self) {
        self.tasks.push(tokio::spawn(watch_nodes(
            self.raft.clone(),
            self.broker.clone(),
            self.transport.clone(),
            self.peer_timeout,
            self.relay.clone(),
        )));
        self.tasks
            .push(tokio::spawn(reconcile_membership(self.raft.clone())));
    }

    /// What the admin endpoint needs: status and `join_cluster` (which dials the seed's
    /// admin endpoint over TLS with `admin_tls`).
    pub fn control(
        &self,
        record: NodeRecord,
        admin_tls: Option<tokio_rustls::TlsConnector>,
    ) -> ClusterControl {
        ClusterControl {
            raft: self.raft.clone(),
            transport: self.transport.clone(),
            broker: self.broker.clone(),
            record,
            admin_tls,
        }
    }

    /// The [`MetaCommit`] that proposes through Raft.
    pub fn meta(&self) -> Arc<RaftMeta> {
        Arc::new(RaftMeta {
            raft: self.raft.clone(),
            broker: self.broker.clone(),
            relay: self.relay.clone(),
            applied: self.applied.clone(),
            commit_timeout: self.commit_timeout,
            rng: Mutex::new(StdRng::seed_from_u64(self.node_id)),
        })
    }

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.node_id
    }

    /// The Raft member (for status and admin commands).
    pub fn raft(&self) -> &MetaRaft {
        &self.raft
    }

    /// This node's GM host.
    pub fn gm(&self) -> &GmHost<TcpTransport> {
        &self.gm
    }

    /// The node links.
    pub fn transport(&self) -> &TcpTransport {
        &self.transport
    }

    /// Stops the tasks, Raft and the links.
    pub async fn shutdown(self) {
        for t in &self.tasks {
            t.abort();
        }
        if let Err(e) = self.raft.shutdown().await {
            tracing::warn!(error = %e, "raft did not stop cleanly");
        }
        self.transport.shutdown();
        self.transport.closed().await;
    }
}

fn write_marker(path: &Path) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    f.write_all(b"initialised\n")?;
    f.sync_all()?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// The follower task: every new applied state goes to the broker, then its index is
/// published; registered nodes become link peers.
async fn follow(
    raft: MetaRaft,
    broker: Arc<Broker>,
    transport: TcpTransport,
    applied: watch::Sender<u64>,
    clock: Clock,
    relay: Arc<std::sync::OnceLock<Arc<Relay>>>,
) {
    let mut views = raft.subscribe();
    let mut peers: BTreeMap<NodeId, String> = BTreeMap::new();
    let mut incarnations: BTreeMap<NodeId, u64> = BTreeMap::new();
    loop {
        let view = views.borrow_and_update().clone();
        // Until the group has applied a command, the broker keeps the config's users (so a
        // node waiting to join can still be administered: `join_cluster` needs a login).
        if view.state.version > 0 {
            broker.follow(view.state.clone(), clock.now());
        }
        for (id, n) in &view.state.nodes {
            if peers.get(id) != Some(&n.link) {
                transport.set_peer(*id, n.link.clone());
                peers.insert(*id, n.link.clone());
            }
            // A node that registered a new incarnation restarted: whatever it held for
            // this node's channels, and this node for its, is gone.
            if incarnations
                .insert(*id, n.incarnation)
                .is_some_and(|old| old != n.incarnation)
                && *id != raft.id()
            {
                if let Some(r) = relay.get() {
                    r.node_down(*id);
                }
            }
        }
        for id in &view.state.forgotten {
            if peers.remove(id).is_some() {
                transport.remove_peer(*id);
            }
        }
        // Consumers waiting for a mirrored queue's new master.
        if let Some(r) = relay.get() {
            r.rehome();
        }
        let _ = applied.send(view.applied_index.unwrap_or(0));
        if views.changed().await.is_err() {
            return;
        }
    }
}

/// Drives the failure detector (`cluster::detector`, whose rules these are): every node
/// tells its broker and relay which nodes are down; the leader proposes `NodeDown` once
/// per outage.
async fn watch_nodes(
    raft: MetaRaft,
    broker: Arc<Broker>,
    transport: TcpTransport,
    peer_timeout: Duration,
    relay: Arc<std::sync::OnceLock<Arc<Relay>>>,
) {
    // The detector's clock: milliseconds since this task started.
    let base = tokio::time::Instant::now();
    let ms = |t: tokio::time::Instant| t.saturating_duration_since(base).as_millis() as u64;
    let mut detector = Detector::new(raft.id(), peer_timeout.as_millis() as u64, 0);
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tick.tick().await;
        let state = raft.snapshot();
        let verdict = detector.handle_tick(
            ms(tokio::time::Instant::now()),
            raft.is_leader(),
            state.nodes.keys().copied(),
            |id| transport.last_seen(id).map(ms),
            |id| transport.peer_refused(id),
        );
        broker.set_down_nodes(verdict.down);
        if let Some(r) = relay.get() {
            for id in verdict.newly_down {
                r.node_down(id);
            }
            for id in verdict.newly_up {
                r.node_up(id);
            }
            // A promoted mirror serves once it adopted its copy, after the metadata moved.
            r.rehome();
        }
        for id in verdict.to_declare {
            // A leader cut off from the majority keeps believing it leads, and from there
            // every peer looks down: only a leadership a quorum confirms may decide (the
            // proposal would otherwise be forwarded to the real leader and commit).
            if raft.linearizable_snapshot().await.is_err() {
                break;
            }
            tracing::warn!(
                node = id,
                "node down: removing its transient and exclusive queues"
            );
            match raft.propose(Command::NodeDown { id }).await {
                Ok(_) => detector.handle_declared(id),
                Err(e) => tracing::warn!(node = id, error = %e, "cannot record a node as down"),
            }
        }
    }
}

/// The membership task, on the leader: the Raft membership follows the nodes table.
async fn reconcile_membership(raft: MetaRaft) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        if !raft.is_leader() {
            continue;
        }
        let state = raft.snapshot();
        let m = raft.membership();
        // Forgotten nodes leave first, so a vote is never waited on from a node gone for good.
        let gone_voters: Vec<NodeId> = m
            .voters
            .keys()
            .copied()
            .filter(|id| state.forgotten.contains(id))
            .collect();
        if !gone_voters.is_empty() {
            let voters: BTreeSet<NodeId> = m
                .voters
                .keys()
                .copied()
                .filter(|id| !state.forgotten.contains(id))
                .collect();
            if let Err(e) = raft.change_voters(voters, false).await {
                tracing::warn!(error = %e, "cannot remove forgotten voters");
            }
            continue;
        }
        let gone_learners: BTreeSet<NodeId> = m
            .learners
            .keys()
            .copied()
            .filter(|id| state.forgotten.contains(id))
            .collect();
        if !gone_learners.is_empty() {
            if let Err(e) = raft.remove_learners(gone_learners).await {
                tracing::warn!(error = %e, "cannot remove forgotten learners");
            }
            continue;
        }
        for (id, n) in &state.nodes {
            if m.voters.contains_key(id) || m.learners.contains_key(id) {
                continue;
            }
            tracing::info!(node = id, link = %n.link, "adding a node as a learner");
            if let Err(e) = raft.add_learner(*id, n.link.clone()).await {
                tracing::warn!(node = id, error = %e, "cannot add a learner");
            }
        }
        let m = raft.membership();
        if m.voters.len() < MAX_VOTERS {
            let promote: Vec<NodeId> = m
                .learners
                .keys()
                .copied()
                .filter(|id| state.nodes.contains_key(id))
                .take(MAX_VOTERS - m.voters.len())
                .collect();
            if !promote.is_empty() {
                let voters: BTreeSet<NodeId> = m
                    .voters
                    .keys()
                    .copied()
                    .chain(promote.iter().copied())
                    .collect();
                tracing::info!(nodes = ?promote, "promoting learners to voters");
                if let Err(e) = raft.change_voters(voters, true).await {
                    tracing::warn!(error = %e, "cannot promote learners");
                }
            }
        }
    }
}

/// The admin endpoint's view of the cluster: `cluster_status` and `join_cluster`.
#[derive(Clone)]
pub struct ClusterControl {
    raft: MetaRaft,
    transport: TcpTransport,
    broker: Arc<Broker>,
    record: NodeRecord,
    /// How `join_cluster` reaches the seed's admin endpoint: TLS when this node's
    /// `[admin.tls]` names a `cacertfile` (the seed's endpoint is then expected to speak
    /// TLS too), plaintext otherwise.
    admin_tls: Option<tokio_rustls::TlsConnector>,
}

impl std::fmt::Debug for ClusterControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterControl")
            .field("node", &self.record.id)
            .finish_non_exhaustive()
    }
}

impl ClusterControl {
    /// `cluster_status`: every registered node, whether it runs (as the failure detector
    /// sees it from here), its Raft role and addresses; then members not registered yet.
    pub fn status(&self) -> crate::admin::Response {
        let state = self.raft.snapshot();
        let m = self.raft.membership();
        let leader = self.raft.leader();
        let role = |id: NodeId| {
            if leader == Some(id) {
                "leader"
            } else if m.voters.contains_key(&id) {
                "voter"
            } else if m.learners.contains_key(&id) {
                "learner"
            } else {
                "joining"
            }
        };
        let me = self.record.id;
        let mut rows: Vec<Vec<String>> = state
            .nodes
            .values()
            .map(|n| {
                let running = n.id == me || !self.broker.node_is_down(n.id);
                vec![
                    n.name.clone(),
                    n.id.to_string(),
                    running.to_string(),
                    role(n.id).into(),
                    n.amqp.clone(),
                    n.link.clone(),
                ]
            })
            .collect();
        for (id, link) in m.voters.iter().chain(m.learners.iter()) {
            if !state.nodes.contains_key(id) {
                rows.push(vec![
                    String::new(),
                    id.to_string(),
                    self.transport.peer_alive(*id).to_string(),
                    role(*id).into(),
                    String::new(),
                    link.clone(),
                ]);
            }
        }
        crate::admin::Response::table(
            ["node", "id", "running", "raft", "amqp", "link"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            rows,
        )
    }

    /// `join_cluster SEED`: registers this node with the cluster `seed` (an admin address)
    /// belongs to, using the caller's credentials, and learns its members' link addresses.
    /// The leader then adds this node as a learner (a voter while there are fewer than
    /// five); this node serves clients once it has caught up.
    pub async fn join(&self, seed: &str, auth: &crate::admin::Auth) -> crate::admin::Response {
        use crate::admin::{Request, Response};
        let members = self.raft.membership();
        if !members.voters.is_empty() || self.raft.leader().is_some() {
            return Response::refused(
                "this node already belongs to a cluster (forget it there and start afresh)",
            );
        }
        let requests = [
            Request::RegisterMember(self.record.clone()),
            Request::ClusterStatus,
        ];
        let tls = self.admin_tls.as_ref();
        let replies = match super::admin::call(seed, auth, &requests, tls).await {
            Ok(r) => r,
            Err(e) => return Response::refused(format!("cannot reach {seed}: {e}")),
        };
        if let Some(refusal) = replies.iter().find(|r| !r.ok) {
            return Response::refused(format!("{seed} refused: {}", refusal.message));
        }
        let status = &replies[1];
        let id_col = status.columns.iter().position(|c| c == "id");
        let link_col = status.columns.iter().position(|c| c == "link");
        if let (Some(i), Some(l)) = (id_col, link_col) {
            for row in &status.rows {
                if let Ok(id) = row[i].parse::<NodeId>() {
                    if id != self.record.id && !row[l].is_empty() {
                        self.transport.set_peer(id, row[l].clone());
                    }
                }
            }
        }
        Response::done(format!(
            "node {} registered with the cluster of {seed}; it serves clients once it has caught up",
            self.record.id
        ))
    }
}

/// A clustered node's [`MetaCommit`]: places new queues, proposes through Raft (a follower
/// forwards to the leader), and resolves once this node's broker has followed the entry.
pub struct RaftMeta {
    raft: MetaRaft,
    broker: Arc<Broker>,
    relay: Arc<std::sync::OnceLock<Arc<Relay>>>,
    applied: watch::Receiver<u64>,
    commit_timeout: Duration,
    rng: Mutex<StdRng>,
}

impl std::fmt::Debug for RaftMeta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftMeta").finish_non_exhaustive()
    }
}

/// Where `queue-master-locator` puts new queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Locator {
    /// The node the declaring client is connected to (RabbitMQ's default).
    ClientLocal,
    /// The live node running the fewest queues.
    MinMasters,
    /// A live node at random.
    Random,
}

impl Locator {
    /// The locator for `def`: its `x-queue-master-locator` argument, else its effective
    /// policy's `queue-master-locator`, else client-local. Exclusive queues are always local.
    pub fn of(def: &QueueDef, state: &MetaState) -> Locator {
        if def.exclusive_owner.is_some() {
            return Locator::ClientLocal;
        }
        let arg = def
            .arguments
            .inner()
            .get("x-queue-master-locator")
            .and_then(crate::meta::args::string);
        let policy = || {
            let v = state.vhost(&def.vhost)?;
            match v
                .effective_policy(&def.name, true)
                .definition
                .get("queue-master-locator")
            {
                Some(crate::meta::policy::PolicyValue::Str(s)) => Some(s.clone()),
                _ => None,
            }
        };
        match arg.or_else(policy).as_deref() {
            Some("min-masters") => Locator::MinMasters,
            Some("random") => Locator::Random,
            _ => Locator::ClientLocal,
        }
    }

    /// The home for a new queue: `local` for client-local; otherwise among `live` nodes
    /// (which include `local`), by queue count or at random.
    pub fn place(
        self,
        local: NodeId,
        live: &[NodeId],
        state: &MetaState,
        rng: &mut impl Rng,
    ) -> NodeId {
        if live.is_empty() {
            return local;
        }
        match self {
            Locator::ClientLocal => local,
            Locator::Random => live[rng.gen_range(0..live.len())],
            Locator::MinMasters => {
                let mut counts: BTreeMap<NodeId, usize> = live.iter().map(|&n| (n, 0)).collect();
                for v in state.vhosts.values() {
                    for q in v.queues.values() {
                        if let Some(c) = counts.get_mut(&q.home) {
                            *c += 1;
                        }
                    }
                }
                counts
                    .into_iter()
                    .min_by_key(|&(n, c)| (c, n))
                    .map_or(local, |(n, _)| n)
            }
        }
    }
}

impl RaftMeta {
    fn place(&self, def: &QueueDef) -> NodeId {
        let me = self.broker.node_id();
        let state = self.raft.snapshot();
        if let Some(existing) = state
            .vhost(&def.vhost)
            .and_then(|v| v.queues.get(&def.name))
        {
            return existing.home;
        }
        let live: Vec<NodeId> = state
            .nodes
            .keys()
            .copied()
            .filter(|&n| n == me || !self.broker.node_is_down(n))
            .collect();
        let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        Locator::of(def, &state).place(me, &live, &state, &mut *rng)
    }
}

impl MetaCommit for RaftMeta {
    fn commit(&self, mut command: Command, _now: Instant) -> MetaFuture {
        if let Command::DeclareQueue(def) = &mut command {
            if def.home == 0 {
                def.home = self.place(def);
            }
        }
        // A queue created on another node must exist there before declare-ok: the client
        // may publish to it or consume from it at once.
        let remote_home = match &command {
            Command::DeclareQueue(def) if def.home != self.broker.node_id() => Some(def.home),
            _ => None,
        };
        let relay = self.relay.get().cloned();
        let raft = self.raft.clone();
        let mut applied = self.applied.clone();
        let timeout = self.commit_timeout;
        Box::pin(async move {
            let response = raft
                .propose(command)
                .await
                .map_err(|e| MetaError::Unavailable {
                    maybe_applied: e.outcome_unknown(),
                    reason: e.to_string(),
                })?;
            // This node's broker follows the entry before the session reads it (declare-ok
            // counts, the consumer a basic.consume adds to the new queue).
            let _ = tokio::time::timeout(timeout, applied.wait_for(|i| *i >= response.index)).await;
            if let (Some(home), Some(relay), true) = (remote_home, relay, response.outcome.is_ok())
            {
                if !relay.barrier(home, response.index).await {
                    tracing::warn!(node = home, "the queue's node did not confirm the declare");
                }
            }
            match response.outcome {
                Ok(s) => Ok(Applied {
                    created: s.created,
                    removed: Removed {
                        queues: s.removed_queues,
                        exchanges: s.removed_exchanges,
                    },
                }),
                Err(r) => Err(MetaError::Replicated {
                    code: r.code,
                    text: r.text,
                }),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::types::{AMQPValue, FieldTable};

    fn state_with(nodes: &[NodeId], queues: &[(&str, NodeId)]) -> MetaState {
        let mut s = MetaState::default();
        s.apply(&Command::AddVhost { name: "/".into() }).unwrap();
        for &id in nodes {
            s.apply(&Command::RegisterNode(NodeRecord {
                id,
                name: format!("n{id}"),
                amqp: String::new(),
                admin: String::new(),
                link: String::new(),
                incarnation: 0,
            }))
            .unwrap();
        }
        for (name, home) in queues {
            s.apply(&Command::DeclareQueue(def(
                name,
                FieldTable::default(),
                *home,
            )))
            .unwrap();
        }
        s
    }

    fn def(name: &str, arguments: FieldTable, home: NodeId) -> QueueDef {
        QueueDef {
            vhost: "/".into(),
            name: name.into(),
            durable: true,
            exclusive_owner: None,
            auto_delete: false,
            arguments,
            home,
        }
    }

    fn locator_arg(value: &str) -> FieldTable {
        let mut t = FieldTable::default();
        t.insert(
            "x-queue-master-locator".into(),
            AMQPValue::LongString(value.into()),
        );
        t
    }

    #[test]
    fn the_locator_comes_from_the_argument_then_the_policy() {
        let mut s = state_with(&[1, 2], &[]);
        assert_eq!(
            Locator::of(&def("q", FieldTable::default(), 0), &s),
            Locator::ClientLocal
        );
        assert_eq!(
            Locator::of(&def("q", locator_arg("min-masters"), 0), &s),
            Locator::MinMasters
        );
        s.apply(&Command::SetPolicy {
            policy: crate::meta::policy::Policy {
                vhost: "/".into(),
                name: "spread".into(),
                pattern: "^spread".into(),
                apply_to: crate::meta::policy::ApplyTo::Queues,
                priority: 0,
                definition: [(
                    "queue-master-locator".to_string(),
                    crate::meta::policy::PolicyValue::Str("random".into()),
                )]
                .into(),
            },
            operator: false,
        })
        .unwrap();
        assert_eq!(
            Locator::of(&def("spread.1", FieldTable::default(), 0), &s),
            Locator::Random
        );
        assert_eq!(
            Locator::of(&def("spread.1", locator_arg("client-local"), 0), &s),
            Locator::ClientLocal,
            "the argument wins over the policy"
        );
        let mut exclusive = def("spread.2", locator_arg("min-masters"), 0);
        exclusive.exclusive_owner = Some(1);
        assert_eq!(Locator::of(&exclusive, &s), Locator::ClientLocal);
    }

    #[test]
    fn min_masters_picks_the_live_node_with_the_fewest_queues() {
        let s = state_with(
            &[1, 2, 3],
            &[("a", 1), ("b", 1), ("c", 2), ("d", 3), ("e", 3)],
        );
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(Locator::MinMasters.place(1, &[1, 2, 3], &s, &mut rng), 2);
        assert_eq!(
            Locator::MinMasters.place(1, &[1, 3], &s, &mut rng),
            1,
            "a down node is not a candidate; ties go to the lowest id"
        );
        assert_eq!(Locator::ClientLocal.place(3, &[1, 2, 3], &s, &mut rng), 3);
        let picks: BTreeSet<NodeId> = (0..64)
            .map(|_| Locator::Random.place(1, &[1, 2, 3], &s, &mut rng))
            .collect();
        assert_eq!(picks, BTreeSet::from([1, 2, 3]));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn registered_nodes_become_voters_up_to_five_then_learners() {
        use crate::runtime::raft::tests::harness::{self, fast_config};
        harness::bounded(async {
            let mut c = harness::Cluster::new(3, fast_config()).await;
            for id in 4..=6 {
                c.disks.insert(id, crate::store::MemDisk::new());
                c.start(id).await;
            }
            let leader = c.leader(&[], Duration::from_secs(10)).await;
            c.propose(Command::AddVhost { name: "/".into() }, &[]).await;
            for id in 1..=6 {
                let r = c
                    .propose(
                        Command::RegisterNode(NodeRecord {
                            id,
                            name: format!("n{id}"),
                            amqp: String::new(),
                            admin: String::new(),
                            link: format!("node-{id}"),
                            incarnation: 0,
                        }),
                        &[],
                    )
                    .await;
                assert!(r.outcome.is_ok());
            }
            let tasks: Vec<_> = c
                .nodes
                .values()
                .map(|n| tokio::spawn(reconcile_membership(n.clone())))
                .collect();
            let node = c.nodes[&leader].clone();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            loop {
                let m = node.membership();
                if m.voters.len() == MAX_VOTERS && m.learners.len() == 1 {
                    break;
                }
                assert!(tokio::time::Instant::now() < deadline, "{m:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // Forgetting a voter promotes the learner in its place.
            let forgotten = *node
                .membership()
                .voters
                .keys()
                .find(|&&id| id != leader)
                .expect("a voter");
            c.propose(Command::ForgetNode { id: forgotten }, &[]).await;
            loop {
                let m = node.membership();
                if m.voters.len() == MAX_VOTERS
                    && m.learners.is_empty()
                    && !m.voters.contains_key(&forgotten)
                {
                    break;
                }
                assert!(tokio::time::Instant::now() < deadline, "{m:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            for t in tasks {
                t.abort();
            }
        })
        .await;
    }
}
