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
//! - The routing lease task keeps the node's routing lease renewed with quorum reads: a
//!   node whose metadata may be behind routes no publish (`cluster::routing_lease`).
//! - [`RaftMeta`] is the [`MetaCommit`] of a clustered node: it places new queues
//!   (`queue-master-locator`) and proposes the command.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::clock::Clock;
use super::conn_task::MetaCommit;
use super::file_disk::FileDisk;
use super::gm_host::{GmHost, GmHostConfig};
use super::node_link::{NodeLinkConfig, TcpTransport};
use super::relay::Relay;
use crate::broker::Broker;
use crate::config::{ClusterConfig, Config};
use crate::meta::{Command, NodeRecord};
use crate::runtime::raft::{MetaRaft, MetaRaftConfig, NodeId};
use crate::time::Instant;

mod control;
mod raft_meta;
mod routing_lease;
mod tasks;
#[cfg(test)]
mod tests;

pub use control::ClusterControl;
pub use raft_meta::{Locator, RaftMeta};
pub use routing_lease::keep_routing_lease;
use tasks::{follow, reconcile_membership, watch_nodes};
pub use tasks::{follow_metadata, record_down_nodes};

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
    routing_lease: Duration,
    clock: Clock,
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
        ..MetaRaftConfig::with_election_timeout(Duration::from_millis(cc.election_timeout_ms))
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
        transport.serve_gm(Arc::new(move |frame: &bytes::Bytes| {
            gm_frames.handle_frame(frame)
        }));

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
        let routing_lease = Duration::from_millis(cc.routing_lease_ms);
        let tasks = vec![
            tokio::spawn(follow(
                raft.clone(),
                broker.clone(),
                transport.clone(),
                applied_tx,
                clock,
                relay.clone(),
            )),
            tokio::spawn(keep_routing_lease(
                raft.clone(),
                broker.clone(),
                applied.clone(),
                clock,
                routing_lease,
            )),
        ];
        Ok(Cluster {
            node_id: cc.node_id,
            raft,
            transport,
            applied,
            broker,
            commit_timeout: Duration::from_millis(cc.commit_timeout_ms),
            routing_lease,
            clock,
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

    /// Waits until the node first holds its routing lease (`cluster::routing_lease`), so
    /// that a client's first publish is routed rather than nacked; for at most the lease's
    /// length (a node waiting for `join_cluster` reads nothing until it joins). A poll: this
    /// runs once, at start, and the lease task renews within a read of the leader.
    pub async fn wait_routing(&self) {
        let started = std::time::Instant::now();
        while !self.broker.routes_at(self.clock.now()) {
            if started.elapsed() > self.routing_lease {
                tracing::warn!(
                    "no routing lease yet: publishes are nacked until a quorum read of the \
                     metadata succeeds"
                );
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
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
    pub fn install_relay(
        &self,
        meta: Arc<dyn MetaCommit>,
        clock: Clock,
        facts: Arc<super::node_stats::NodeFacts>,
    ) {
        let relay = Relay::install(
            self.broker.clone(),
            Arc::new(self.transport.clone()),
            meta,
            clock,
            self.applied.clone(),
            facts,
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
            self.clock,
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
        Arc::new(
            RaftMeta::new(
                self.raft.clone(),
                self.broker.clone(),
                self.relay.clone(),
                self.applied.clone(),
                self.commit_timeout,
                self.node_id,
            )
            .with_routing_lease(self.routing_lease, self.clock),
        )
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
