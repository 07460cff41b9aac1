//! Test helpers: temporary folders, metadata commands, log entries, and an in-process
//! cluster on [`Router`] with one [`MemDisk`] per node.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use amq_protocol::types::FieldTable;
use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId};

use crate::meta::state::{Binding, Destination, QueueDef};
use crate::meta::Command;
use crate::runtime::file_disk::FileDisk;
use crate::runtime::raft::types::{MetaRequest, TypeConfig};
use crate::runtime::raft::{
    MetaRaft, MetaRaftConfig, MetaResponse, MetaView, NodeId, ProposeError, RaftTransport, Router,
    RouterTransport,
};
use crate::store::{Disk, MemDisk};

/// Runs a test under a deadline, so a lost wake-up fails the test instead of hanging it.
pub async fn bounded<F: Future<Output = ()>>(test: F) {
    tokio::time::timeout(Duration::from_secs(90), test)
        .await
        .expect("test finished in time");
}

/// A folder under the system's temporary folder, emptied and removed on drop.
pub struct TempDir {
    pub path: PathBuf,
}

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("warren-raft-{tag}-{}-{n}", std::process::id()));
        TempDir { path }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // Best effort: a leftover temporary folder is not worth failing a test over.
        let disk = FileDisk::new();
        for name in disk.list(&self.path).unwrap_or_default() {
            let _ = disk.remove(&self.path.join(name));
        }
        let _ = disk.remove_dir(&self.path);
    }
}

pub fn add_vhost() -> Command {
    Command::AddVhost { name: "/".into() }
}

pub fn declare_queue(name: &str) -> Command {
    Command::DeclareQueue(QueueDef {
        vhost: "/".into(),
        name: name.into(),
        durable: true,
        exclusive_owner: None,
        auto_delete: false,
        arguments: FieldTable::default(),
        home: 0,
    })
}

pub fn bind(queue: &str) -> Command {
    Command::Bind(Binding {
        vhost: "/".into(),
        source: "amq.fanout".into(),
        destination: Destination::Queue(queue.into()),
        routing_key: String::new(),
        arguments: FieldTable::default(),
    })
}

pub fn log_id(term: u64, index: u64) -> LogId<NodeId> {
    LogId::new(CommittedLeaderId::new(term, 1), index)
}

pub fn blank(term: u64, index: u64) -> Entry<TypeConfig> {
    Entry {
        log_id: log_id(term, index),
        payload: EntryPayload::Blank,
    }
}

pub fn normal(term: u64, index: u64, command: Command) -> Entry<TypeConfig> {
    Entry {
        log_id: log_id(term, index),
        payload: EntryPayload::Normal(MetaRequest { command }),
    }
}

/// Fast timings so elections take a fraction of a second.
pub fn fast_config() -> MetaRaftConfig {
    MetaRaftConfig {
        cluster_name: "test".into(),
        heartbeat: Duration::from_millis(50),
        election_timeout_min: Duration::from_millis(250),
        election_timeout_max: Duration::from_millis(500),
        propose_timeout: Duration::from_secs(2),
        ..MetaRaftConfig::default()
    }
}

pub const DIR: &str = "/raft";

/// An in-process cluster. Nodes are numbered from 1; each has its own disk, which outlives
/// the node so it can restart from it.
pub struct Cluster {
    pub router: Router,
    pub disks: BTreeMap<NodeId, MemDisk>,
    pub nodes: BTreeMap<NodeId, MetaRaft>,
    config: MetaRaftConfig,
}

impl Cluster {
    /// Starts `n` nodes and initialises them as one cluster.
    pub async fn new(n: u64, config: MetaRaftConfig) -> Cluster {
        Cluster::with_transports(n, config, |_, t| t).await
    }

    /// Like [`Cluster::new`], each node sending through `wrap(id, its router transport)`
    /// (restarts use the plain router transport).
    pub async fn with_transports<T: RaftTransport>(
        n: u64,
        config: MetaRaftConfig,
        wrap: impl Fn(NodeId, RouterTransport) -> T,
    ) -> Cluster {
        let mut c = Cluster {
            router: Router::new(),
            disks: (1..=n).map(|id| (id, MemDisk::new())).collect(),
            nodes: BTreeMap::new(),
            config,
        };
        for id in 1..=n {
            let transport = wrap(id, c.router.transport(id));
            c.start_with(id, transport).await;
        }
        let members = (1..=n).map(|id| (id, format!("node-{id}"))).collect();
        c.nodes[&1].initialize(members).await.expect("initialise");
        c
    }

    /// Starts (or restarts) node `id` from its disk.
    pub async fn start(&mut self, id: NodeId) {
        let transport = self.router.transport(id);
        self.start_with(id, transport).await;
    }

    /// Starts node `id` from its disk, sending through `transport`.
    pub async fn start_with<T: RaftTransport>(&mut self, id: NodeId, transport: T) {
        let disk: Arc<dyn Disk> = Arc::new(self.disks[&id].clone());
        let node = MetaRaft::start(id, transport, disk, Path::new(DIR), &self.config, 1000 + id)
            .await
            .expect("node starts");
        self.router.serve(id, node.rpc_server());
        self.nodes.insert(id, node);
    }

    /// Kills node `id` like `kill -9` followed by a power loss: its tasks stop and its disk
    /// keeps only what was fsynced.
    pub async fn kill(&mut self, id: NodeId) {
        self.router.remove(id);
        if let Some(node) = self.nodes.remove(&id) {
            node.shutdown().await.expect("raft task ends");
        }
        self.disks[&id].crash();
    }

    /// The leader as seen by the running nodes outside `skip`, once one of them leads.
    pub async fn leader(&self, skip: &[NodeId], timeout: Duration) -> NodeId {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let found = self
                .nodes
                .iter()
                .filter(|(id, _)| !skip.contains(id))
                .find(|(_, n)| n.is_leader());
            if let Some((&id, _)) = found {
                return id;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no leader within {timeout:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Proposes through whichever node outside `skip` leads, retrying across elections.
    /// Retrying after an unknown outcome may apply the command twice: fine for the
    /// idempotent declares these tests use.
    pub async fn propose(&self, command: Command, skip: &[NodeId]) -> MetaResponse {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            let leader = self.leader(skip, Duration::from_secs(10)).await;
            match self.nodes[&leader].propose(command.clone()).await {
                Ok(r) => return r,
                Err(e) if e.outcome_unknown() => {}
                Err(ProposeError::NoLeader { .. }) => {}
                Err(e) => panic!("proposal failed: {e}"),
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no proposal went through"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the nodes in `ids` have applied the same entries (same index and digest)
    /// and are at least at `index`; returns that common view.
    pub async fn converge(&self, ids: &[NodeId], index: u64) -> MetaView {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            let views: Vec<MetaView> = ids.iter().map(|id| self.nodes[id].view()).collect();
            let first = &views[0];
            let same = views
                .iter()
                .all(|v| v.applied_index == first.applied_index && v.digest == first.digest);
            if same && first.applied_index >= Some(index) {
                for (id, v) in ids.iter().zip(&views) {
                    assert_eq!(v.state, first.state, "node {id} has other metadata");
                }
                return first.clone();
            }
            let seen: Vec<_> = views.iter().map(|v| (v.applied_index, v.digest)).collect();
            assert!(
                tokio::time::Instant::now() < deadline,
                "nodes {ids:?} never converged: {seen:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn ids(&self) -> Vec<NodeId> {
        self.nodes.keys().copied().collect()
    }
}
