//! [`MetaRaft`]: one node of the metadata Raft group, behind an API with no openraft types.
//!
//! Any node accepts proposals: the leader commits them itself, any other node forwards them
//! to the leader over the Raft transport ([`super::forward`] describes the routing, the
//! deadline and why a proposal is never re-sent once a leader may have taken it).
//! [`ProposeError::outcome_unknown`] tells the caller whether a failed proposal may still
//! have been applied.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use openraft::error::{CheckIsLeaderError, InitializeError, RaftError};
use openraft::{BasicNode, Config, Raft, RaftMetrics, ServerState, SnapshotPolicy};
use tokio::sync::watch;

use super::errors::{InitError, ProposeError, StartError, StopError};
use super::forward::{Forwarder, SharedReads};
use super::log_store::LogStore;
use super::network::{DynTransport, NetworkFactory, RaftTransport, RpcServer};
use super::rt;
use super::state_machine::{MetaStateMachine, MetaView, SharedFence};
use super::types::{MetaRequest, MetaResponse, NodeId, TypeConfig};
use crate::cluster::read_log::Readers;
use crate::meta::{Command, MetaState};
use crate::store::Disk;

/// Timing and retention of the metadata Raft group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaRaftConfig {
    /// Name shared by every node of the cluster (it appears in openraft's logs).
    pub cluster_name: String,
    /// How often the leader sends heartbeats.
    pub heartbeat: Duration,
    /// Shortest election timeout; each node draws its own in `[min, max)` from its seed.
    pub election_timeout_min: Duration,
    /// Longest election timeout.
    pub election_timeout_max: Duration,
    /// Build a snapshot after this many entries since the last one.
    pub snapshot_after: u64,
    /// Entries kept in the log below a snapshot, so a slightly lagging follower catches up
    /// from the log instead of a whole snapshot.
    pub logs_kept_after_snapshot: u64,
    /// Size at which a log segment file rolls over.
    pub segment_bytes: u64,
    /// How long [`MetaRaft::propose`] waits for its command to be applied, forwarding to the
    /// leader and waiting for one included.
    pub propose_timeout: Duration,
}

impl Default for MetaRaftConfig {
    /// `[cluster] election_timeout_ms`'s default, 400 ms (see
    /// [`MetaRaftConfig::with_election_timeout`]).
    fn default() -> MetaRaftConfig {
        MetaRaftConfig::with_election_timeout(Duration::from_millis(400))
    }
}

impl MetaRaftConfig {
    /// Timings from the longest election timeout, which openraft 0.9 also takes as the
    /// leader lease (a voter that heard the leader this recently refuses to vote): the
    /// shortest is half of it and the heartbeat a sixth, so a follower elects itself after
    /// 1.5 to 2 times `max` of silence, which is 9 to 12 heartbeats.
    pub fn with_election_timeout(max: Duration) -> MetaRaftConfig {
        MetaRaftConfig {
            cluster_name: "warren".into(),
            heartbeat: max / 6,
            election_timeout_min: max / 2,
            election_timeout_max: max,
            snapshot_after: 5000,
            logs_kept_after_snapshot: 1000,
            segment_bytes: 8 << 20,
            propose_timeout: Duration::from_secs(10),
        }
    }

    fn to_openraft(&self) -> Result<Config, StartError> {
        let ms = |d: Duration| d.as_millis().try_into().unwrap_or(u64::MAX);
        Config {
            cluster_name: self.cluster_name.clone(),
            heartbeat_interval: ms(self.heartbeat),
            election_timeout_min: ms(self.election_timeout_min),
            election_timeout_max: ms(self.election_timeout_max),
            snapshot_policy: SnapshotPolicy::LogsSinceLast(self.snapshot_after),
            max_in_snapshot_log_to_keep: self.logs_kept_after_snapshot,
            ..Config::default()
        }
        .validate()
        .map_err(|e| StartError::Config(e.to_string()))
    }
}

/// The members of the group.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Membership {
    /// Voting members, id → address.
    pub voters: BTreeMap<NodeId, String>,
    /// Learners (replicated to, no vote), id → address.
    pub learners: BTreeMap<NodeId, String>,
}

/// Who leads and whether this node does: what [`LeaderWatch`] compares.
fn leadership(m: &RaftMetrics<NodeId, BasicNode>) -> (Option<NodeId>, ServerState) {
    (m.current_leader, m.state)
}

/// See [`MetaRaft::leader_watch`].
pub struct LeaderWatch {
    metrics: watch::Receiver<RaftMetrics<NodeId, BasicNode>>,
    seen: (Option<NodeId>, ServerState),
}

impl LeaderWatch {
    /// Returns once the leader or this node's role differs from when last returned (or the
    /// watch began); never, once the node has stopped.
    pub async fn changed(&mut self) {
        loop {
            if self.metrics.changed().await.is_err() {
                return std::future::pending().await;
            }
            let now = leadership(&self.metrics.borrow_and_update());
            if now != self.seen {
                self.seen = now;
                return;
            }
        }
    }
}

/// One running node of the metadata group.
#[derive(Clone)]
pub struct MetaRaft {
    id: NodeId,
    raft: Raft<TypeConfig>,
    view: watch::Receiver<MetaView>,
    propose_timeout: Duration,
    /// The voters' leader lease (`election_timeout_max`) and the leader's heartbeat.
    lease: Duration,
    heartbeat: Duration,
    forwarder: Forwarder,
    /// Readers the leader refuses while it records them down (`cluster::read_fence`).
    fence: SharedFence,
    /// The reads this node served as leader (`cluster::read_log`).
    reads: SharedReads,
}

impl MetaRaft {
    /// Starts node `id` from its folder `dir` on `disk` (empty for a new node). `transport`
    /// reaches the peers; `seed` drives every random choice the node makes (its election
    /// timeout), so a simulation replays.
    pub async fn start<T: RaftTransport>(
        id: NodeId,
        transport: T,
        disk: Arc<dyn Disk>,
        dir: &Path,
        config: &MetaRaftConfig,
        seed: u64,
    ) -> Result<MetaRaft, StartError> {
        let raft_config = Arc::new(config.to_openraft()?);
        let log = LogStore::open(Arc::clone(&disk), dir, config.segment_bytes)?;
        let (sm, view) = MetaStateMachine::open(disk, dir)?;
        let fence = sm.fence();
        let transport = Arc::new(transport);
        let network = NetworkFactory::new(id, Arc::clone(&transport));
        let raft = rt::with_seed(seed, Raft::new(id, raft_config, network, log, sm))
            .await
            .map_err(|e| StartError::Raft(e.to_string()))?;
        let transport: Arc<dyn DynTransport> = transport;
        let reads = SharedReads::default();
        let forwarder = Forwarder::new(
            id,
            raft.clone(),
            transport,
            config.propose_timeout,
            reads.clone(),
        );
        Ok(MetaRaft {
            id,
            raft,
            view,
            propose_timeout: config.propose_timeout,
            lease: config.election_timeout_max,
            heartbeat: config.heartbeat,
            forwarder,
            fence,
            reads,
        })
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// How long a voter that heard the leader refuses to vote for another (openraft 0.9's
    /// leader lease: the longest election timeout).
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// How often the leader sends heartbeats.
    pub fn heartbeat(&self) -> Duration {
        self.heartbeat
    }

    /// Creates the cluster with `members` (id → cluster address) as its voters. Call it once,
    /// on one node; calling it on several with the same members is harmless.
    pub async fn initialize(&self, members: BTreeMap<NodeId, String>) -> Result<(), InitError> {
        let nodes: BTreeMap<NodeId, BasicNode> = members
            .into_iter()
            .map(|(id, addr)| (id, BasicNode { addr }))
            .collect();
        match self.raft.initialize(nodes).await {
            Ok(()) => Ok(()),
            Err(RaftError::APIError(InitializeError::NotAllowed(_))) => {
                Err(InitError::AlreadyInitialized)
            }
            Err(RaftError::APIError(InitializeError::NotInMembers(_))) => {
                Err(InitError::NotInMembers)
            }
            Err(RaftError::Fatal(f)) => Err(InitError::Stopped(f.to_string())),
        }
    }

    /// Replicates `command` and returns its outcome once it is applied: on this node when it
    /// leads, otherwise on the leader it was forwarded to (this node applies it shortly
    /// after; [`MetaRaft::wait_applied`] waits for that). A command the state machine refuses
    /// is still committed: the refusal is in the response, identical wherever it was
    /// proposed, and the metadata is unchanged on every node.
    ///
    /// Everything, waiting for a leader included, happens within the configured
    /// `propose_timeout`. On error, [`ProposeError::outcome_unknown`] says whether the
    /// command may still be applied.
    pub async fn propose(&self, command: Command) -> Result<MetaResponse, ProposeError> {
        let proposed = self.forwarder.propose(MetaRequest { command }, 0).await;
        proposed.map(|(response, _)| response)
    }

    /// [`MetaRaft::propose`], with the nodes the leader served reads to within `window`
    /// before the commit: the only ones that may still route by metadata from before it
    /// (`cluster::read_log`), where a routing lease lasts at most `window` on the leader's
    /// clock.
    pub async fn propose_routing(
        &self,
        command: Command,
        window: Duration,
    ) -> Result<(MetaResponse, Readers), ProposeError> {
        let window_ms = window.as_millis().try_into().unwrap_or(u64::MAX).max(1);
        self.forwarder
            .propose(MetaRequest { command }, window_ms)
            .await
    }

    /// The metadata as this node has applied it.
    pub fn snapshot(&self) -> Arc<MetaState> {
        Arc::clone(&self.view.borrow().state)
    }

    /// The metadata with every command committed before the call applied: for reads that
    /// decide safety. Only the leader answers (it confirms its leadership with a quorum
    /// first); others return [`ProposeError::NotLeader`].
    pub async fn linearizable_snapshot(&self) -> Result<Arc<MetaState>, ProposeError> {
        let read = self.raft.ensure_linearizable();
        match tokio::time::timeout(self.propose_timeout, read).await {
            Err(_) => Err(ProposeError::Timeout(self.propose_timeout)),
            // openraft has waited for the state machine, which publishes before it reports.
            Ok(Ok(_)) => Ok(self.snapshot()),
            Ok(Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(f)))) => {
                Err(ProposeError::NotLeader {
                    leader: f.leader_id,
                    leader_addr: f.leader_node.map(|n| n.addr),
                })
            }
            Ok(Err(RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(e)))) => {
                Err(ProposeError::NoQuorum(e.to_string()))
            }
            Ok(Err(RaftError::Fatal(f))) => Err(ProposeError::Stopped(f.to_string())),
        }
    }

    /// The metadata with every command committed before the call applied, on any node:
    /// Raft's read index from the leader (which confirms its leadership with a quorum
    /// first), then this node's state once it has applied that far. Within `within`.
    pub async fn quorum_snapshot(&self, within: Duration) -> Result<Arc<MetaState>, ProposeError> {
        let deadline = tokio::time::Instant::now() + within;
        let index = self.forwarder.read_index(within).await?;
        let mut view = self.view.clone();
        let caught_up = async {
            loop {
                if view.borrow_and_update().applied_index.unwrap_or(0) >= index {
                    return true;
                }
                if view.changed().await.is_err() {
                    return false;
                }
            }
        };
        match tokio::time::timeout_at(deadline, caught_up).await {
            Ok(true) => Ok(self.snapshot()),
            Ok(false) => Err(ProposeError::Stopped("raft node shut down".into())),
            Err(_) => Err(ProposeError::Timeout(within)),
        }
    }

    /// Raft's read index from the leader (which confirms its leadership with a quorum
    /// first): every command committed before the call is at or below it. Within `within`.
    pub async fn read_index(&self, within: Duration) -> Result<u64, ProposeError> {
        self.forwarder.read_index(within).await
    }

    /// The metadata with its applied index and digest.
    pub fn view(&self) -> MetaView {
        self.view.borrow().clone()
    }

    /// A receiver that sees every new view (for tasks that react to metadata changes).
    pub fn subscribe(&self) -> watch::Receiver<MetaView> {
        self.view.clone()
    }

    /// The leader as this node knows it.
    pub fn leader(&self) -> Option<NodeId> {
        self.raft.metrics().borrow().current_leader
    }

    /// Term, indexes and leader as this node sees them (for the metrics endpoint).
    pub fn progress(&self) -> crate::metrics::RaftSample {
        let m = self.raft.metrics().borrow().clone();
        crate::metrics::RaftSample {
            node_id: self.id,
            term: m.current_term,
            applied_index: m.last_applied.map_or(0, |l| l.index),
            last_log_index: m.last_log_index.unwrap_or(0),
            leader: m.current_leader,
        }
    }

    /// A watch of who leads, as this node knows it: [`LeaderWatch::changed`] returns when
    /// the leader, or this node's Raft role, changed.
    pub fn leader_watch(&self) -> LeaderWatch {
        let metrics = self.raft.metrics();
        let seen = leadership(&metrics.borrow());
        LeaderWatch { metrics, seen }
    }

    /// Starts an election with this node as the candidate now, without waiting for its
    /// election timeout (a leader ignores it). Voters still refuse while their lease on
    /// the old leader runs.
    pub async fn call_election(&self) -> Result<(), StopError> {
        self.raft
            .trigger()
            .elect()
            .await
            .map_err(|e| StopError(e.to_string()))
    }

    /// Whether this node believes it leads (an isolated old leader may, until it hears of
    /// a newer term).
    pub fn is_leader(&self) -> bool {
        self.raft.metrics().borrow().state == ServerState::Leader
    }

    /// Waits until this node knows a leader that `accept` approves of.
    pub async fn wait_for_leader(
        &self,
        timeout: Duration,
        accept: impl Fn(NodeId) -> bool,
    ) -> Option<NodeId> {
        let m = self
            .wait_metrics(timeout, |m| m.current_leader.is_some_and(&accept))
            .await?;
        m.current_leader
    }

    /// Waits until this node knows a leader and has applied an entry of that leader's term:
    /// then everything committed before the term began is applied here too (a read
    /// barrier without a round trip). False on timeout.
    pub async fn wait_caught_up(&self, timeout: Duration) -> bool {
        self.wait_metrics(timeout, |m| {
            m.current_leader.is_some()
                && m.last_applied
                    .is_some_and(|l| l.leader_id.term == m.current_term)
        })
        .await
        .is_some()
    }

    /// Waits until this node has applied the entry at `index`; false on timeout.
    pub async fn wait_applied(&self, index: u64, timeout: Duration) -> bool {
        self.wait_metrics(timeout, |m| {
            m.last_applied.is_some_and(|l| l.index >= index)
        })
        .await
        .is_some()
    }

    async fn wait_metrics(
        &self,
        timeout: Duration,
        pred: impl Fn(&RaftMetrics<NodeId, BasicNode>) -> bool,
    ) -> Option<RaftMetrics<NodeId, BasicNode>> {
        let mut rx = self.raft.metrics();
        let wait = async {
            loop {
                let m = rx.borrow_and_update().clone();
                if pred(&m) {
                    return Some(m);
                }
                if rx.changed().await.is_err() {
                    return None;
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.ok().flatten()
    }

    /// The voters and learners of the current membership (id → address), as this node
    /// knows it.
    pub fn membership(&self) -> Membership {
        let m = self.raft.metrics().borrow().membership_config.clone();
        let config = m.membership();
        let voters: BTreeSet<NodeId> = config.voter_ids().collect();
        let mut members = Membership::default();
        for (id, node) in config.nodes() {
            if voters.contains(id) {
                members.voters.insert(*id, node.addr.clone());
            } else {
                members.learners.insert(*id, node.addr.clone());
            }
        }
        members
    }

    /// Adds node `id` (reachable at `addr`) as a learner and waits until it has caught up;
    /// leader only. Adding a node that is already a member only updates nothing.
    pub async fn add_learner(&self, id: NodeId, addr: String) -> Result<(), ProposeError> {
        self.raft
            .add_learner(id, BasicNode { addr }, true)
            .await
            .map(|_| ())
            .map_err(|e| self.membership_error(e))
    }

    /// Makes `voters` the voting members (every one must already be a member); a voter
    /// left out stays as a learner when `retain`, or leaves. Leader only.
    pub async fn change_voters(
        &self,
        voters: BTreeSet<NodeId>,
        retain: bool,
    ) -> Result<(), ProposeError> {
        self.raft
            .change_membership(voters, retain)
            .await
            .map(|_| ())
            .map_err(|e| self.membership_error(e))
    }

    /// Removes learners `ids` from the membership. Leader only.
    pub async fn remove_learners(&self, ids: BTreeSet<NodeId>) -> Result<(), ProposeError> {
        self.raft
            .change_membership(openraft::ChangeMembers::RemoveNodes(ids), false)
            .await
            .map(|_| ())
            .map_err(|e| self.membership_error(e))
    }

    fn membership_error(
        &self,
        e: RaftError<NodeId, openraft::error::ClientWriteError<NodeId, BasicNode>>,
    ) -> ProposeError {
        use openraft::error::ClientWriteError;
        match e {
            RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => ProposeError::NotLeader {
                leader: f.leader_id,
                leader_addr: f.leader_node.map(|n| n.addr),
            },
            RaftError::APIError(ClientWriteError::ChangeMembershipError(c)) => {
                ProposeError::Unknown {
                    leader: self.id,
                    reason: c.to_string(),
                }
            }
            RaftError::Fatal(f) => ProposeError::Stopped(f.to_string()),
        }
    }

    /// Builds a snapshot now (and lets openraft purge the log below it).
    pub async fn trigger_snapshot(&self) -> Result<(), StopError> {
        self.raft
            .trigger()
            .snapshot()
            .await
            .map_err(|e| StopError(e.to_string()))
    }

    /// Why this node's Raft core stopped for good (a log or state write failed), if it did.
    /// The core then answers nothing, so the node is of no use to the group until restarted.
    pub fn fatal(&self) -> Option<String> {
        match &self.raft.metrics().borrow().running_state {
            Ok(()) => None,
            Err(fatal) => Some(fatal.to_string()),
        }
    }

    /// The handler a transport feeds this node's incoming Raft requests to.
    pub fn rpc_server(&self) -> RpcServer {
        RpcServer::new(
            self.raft.clone(),
            self.propose_timeout,
            self.fence.clone(),
            self.reads.clone(),
        )
    }

    /// The failure detector's tick (`cluster::read_fence`): `deciding` are the nodes it
    /// offers to record down now (empty off the leader). From now until their `NodeDown`
    /// is applied, or the term ends, their read-index requests are refused here.
    pub fn fence_reads(&self, deciding: &[NodeId]) {
        let term = self.raft.metrics().borrow().current_term;
        self.fence.lock().handle_tick(term, deciding);
    }

    /// Records `node` down (`Command::NodeDown`), only if this node leads: never forwarded,
    /// since the decision rests on this leadership's watch (a new leader's reads would not
    /// be fenced). Call [`MetaRaft::fence_reads`] with `node` first: the fence then holds
    /// until the record is applied, whatever this call returns.
    pub async fn record_down(&self, node: NodeId) -> Result<MetaResponse, ProposeError> {
        self.fence.lock().handle_proposed(node);
        let request = MetaRequest {
            command: Command::NodeDown { id: node },
        };
        self.forwarder.propose_here(request).await
    }

    /// Stops the node's tasks. Its storage stays as it is, ready for a restart.
    pub async fn shutdown(&self) -> Result<(), StopError> {
        self.raft
            .shutdown()
            .await
            .map_err(|e| StopError(e.to_string()))
    }
}
