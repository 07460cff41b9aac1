//! The metadata Raft group over real TCP node links ([`TcpTransport`]) on 127.0.0.1: a
//! three-node cluster converges, survives the loss of its leader, refuses foreign peers and
//! shrugs off garbage frames; proposals made on a follower are forwarded to the leader (also
//! while the leader dies) and are never applied twice.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use amq_protocol::types::FieldTable;
use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::Decoder;
use warren::meta::state::{queue_names, Binding, Destination};
use warren::meta::{Command, QueueDef};
use warren::runtime::node_link::wire::{self, Envelope, PROTOCOL_VERSION};
use warren::runtime::node_link::{NodeLinkConfig, TcpTransport};
use warren::runtime::raft::{
    MetaRaft, MetaRaftConfig, MetaResponse, NodeId, ProposeError, RaftTransport, TransportError,
};
use warren::store::{Disk, MemDisk};

const CLUSTER: &str = "test-cluster";
const MAX_FRAME: usize = 1 << 20;

/// Runs a test under a deadline, so a hang fails the test instead of stalling the suite.
async fn bounded<F: Future<Output = ()>>(test: F) {
    // Log lines (refusals, closed links) show with `--nocapture`; RUST_LOG overrides.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warren::runtime::node_link=info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
    tokio::time::timeout(Duration::from_secs(60), test)
        .await
        .expect("test finished in time");
}

fn raft_config() -> MetaRaftConfig {
    MetaRaftConfig {
        cluster_name: "test".into(),
        heartbeat: Duration::from_millis(50),
        election_timeout_min: Duration::from_millis(250),
        election_timeout_max: Duration::from_millis(500),
        propose_timeout: Duration::from_secs(2),
        ..MetaRaftConfig::default()
    }
}

fn link_config(id: NodeId) -> NodeLinkConfig {
    NodeLinkConfig {
        max_frame: MAX_FRAME,
        heartbeat_interval: Duration::from_millis(50),
        peer_timeout: Duration::from_millis(500),
        connect_timeout: Duration::from_millis(500),
        backoff_min: Duration::from_millis(20),
        backoff_max: Duration::from_millis(300),
        ..NodeLinkConfig::new(CLUSTER, id)
    }
}

fn declare_queue(name: &str) -> Command {
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

struct Cluster {
    links: BTreeMap<NodeId, TcpTransport>,
    nodes: BTreeMap<NodeId, MetaRaft>,
    disks: BTreeMap<NodeId, MemDisk>,
    addrs: BTreeMap<NodeId, String>,
}

impl Cluster {
    /// Three nodes on ephemeral ports, initialised as one cluster. `extra` peers are allowed
    /// to connect to node 1 (for raw-socket tests).
    async fn new(extra: &[(NodeId, &str)]) -> Cluster {
        let mut c = Cluster {
            links: BTreeMap::new(),
            nodes: BTreeMap::new(),
            disks: (1..=3).map(|id| (id, MemDisk::new())).collect(),
            addrs: BTreeMap::new(),
        };
        for id in 1..=3 {
            let link = TcpTransport::bind("127.0.0.1:0", link_config(id))
                .await
                .expect("bind");
            c.addrs.insert(id, link.local_addr().to_string());
            c.links.insert(id, link);
        }
        for (id, link) in &c.links {
            for (peer, addr) in &c.addrs {
                if peer != id {
                    link.set_peer(*peer, addr.clone());
                }
            }
        }
        for (peer, addr) in extra {
            c.links[&1].set_peer(*peer, *addr);
        }
        for id in 1..=3 {
            c.start_raft(id).await;
        }
        c.nodes[&1]
            .initialize(c.addrs.clone())
            .await
            .expect("initialise");
        c
    }

    async fn start_raft(&mut self, id: NodeId) {
        let disk: Arc<dyn Disk> = Arc::new(self.disks[&id].clone());
        let node = MetaRaft::start(
            id,
            self.links[&id].clone(),
            disk,
            Path::new("/raft"),
            &raft_config(),
            1000 + id,
        )
        .await
        .expect("node starts");
        self.links[&id].serve(node.rpc_server());
        self.nodes.insert(id, node);
    }

    /// Stops node `id`'s Raft and closes its listener and links, like a crashed process.
    async fn kill(&mut self, id: NodeId) {
        if let Some(node) = self.nodes.remove(&id) {
            node.shutdown().await.expect("raft stops");
        }
        if let Some(link) = self.links.remove(&id) {
            link.shutdown();
            link.closed().await;
        }
    }

    /// Restarts node `id` on its old address and disk.
    async fn restart(&mut self, id: NodeId) {
        let link = TcpTransport::bind(&self.addrs[&id], link_config(id))
            .await
            .expect("rebind the old port");
        for (peer, addr) in &self.addrs {
            if *peer != id {
                link.set_peer(*peer, addr.clone());
            }
        }
        self.links.insert(id, link);
        self.start_raft(id).await;
    }

    async fn leader(&self) -> NodeId {
        loop {
            if let Some((&id, _)) = self.nodes.iter().find(|(_, n)| n.is_leader()) {
                return id;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Proposes through whichever running node leads, retrying across elections (after an
    /// unknown outcome too: the declares used here are idempotent).
    async fn propose(&self, command: Command) {
        loop {
            let leader = self.leader().await;
            match self.nodes[&leader].propose(command.clone()).await {
                Ok(_) => return,
                Err(e) if e.outcome_unknown() => {}
                Err(ProposeError::NoLeader { .. }) => {}
                Err(e) => panic!("proposal failed: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until every running node has applied the same entries and holds `queues`.
    async fn converge(&self, queues: &[&str]) {
        loop {
            let views: Vec<_> = self.nodes.values().map(|n| n.view()).collect();
            let same = views
                .windows(2)
                .all(|w| w[0].digest == w[1].digest && w[0].applied_index == w[1].applied_index);
            let complete = views.iter().all(|v| {
                let names = queue_names(&v.state);
                queues
                    .iter()
                    .all(|q| names.contains(&("/".to_string(), q.to_string())))
            });
            if same && complete {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops every node.
    async fn stop(&mut self) {
        for id in self.nodes.keys().copied().collect::<Vec<_>>() {
            self.kill(id).await;
        }
    }

    /// A running node other than the leader, once every running node knows the leader.
    async fn follower(&self) -> (NodeId, NodeId) {
        let leader = self.leader().await;
        for node in self.nodes.values() {
            let known = node
                .wait_for_leader(Duration::from_secs(10), |l| l == leader)
                .await;
            assert_eq!(known, Some(leader), "node {} learns the leader", node.id());
        }
        let follower = *self
            .nodes
            .keys()
            .find(|&&id| id != leader)
            .expect("a follower");
        (leader, follower)
    }

    /// The queue names in "/" on node `id`.
    fn queues(&self, id: NodeId) -> BTreeSet<String> {
        queue_names(&self.nodes[&id].snapshot())
            .into_iter()
            .filter(|(vhost, _)| vhost == "/")
            .map(|(_, name)| name)
            .collect()
    }
}

/// Reads one frame from a raw socket; `None` once the peer has closed.
async fn read_frame(stream: &mut TcpStream, buf: &mut BytesMut) -> Option<Envelope> {
    let mut codec = wire::codec(MAX_FRAME);
    loop {
        if let Some(body) = codec.decode(buf).expect("well-framed") {
            return Some(wire::decode_body(&body.freeze(), MAX_FRAME).expect("decodable"));
        }
        match stream.read_buf(buf).await {
            Ok(0) | Err(_) => return None,
            Ok(_) => {}
        }
    }
}

/// Waits until the peer closes the socket, skipping whatever it sends first.
async fn expect_closed(stream: &mut TcpStream) {
    let mut sink = [0u8; 4096];
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .expect("the node closed the link");
}

fn hello(cluster_id: &str, node_id: NodeId) -> Envelope {
    Envelope::Hello {
        cluster_id: cluster_id.into(),
        node_id,
        version: PROTOCOL_VERSION,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_converge_and_survive_leader_loss() {
    bounded(async {
        let mut c = Cluster::new(&[]).await;
        c.propose(Command::AddVhost { name: "/".into() }).await;
        c.propose(declare_queue("q1")).await;
        c.propose(declare_queue("q2")).await;
        c.converge(&["q1", "q2"]).await;

        // Heartbeats flow both ways on every link.
        for (id, link) in &c.links {
            for peer in c.links.keys().filter(|p| *p != id) {
                assert!(link.peer_alive(*peer), "{id} sees {peer} alive");
            }
            assert!(
                link.connected_peers().len() == 2,
                "{id} has one link per peer"
            );
        }

        let old = c.leader().await;
        c.kill(old).await;
        let new = c.leader().await;
        assert_ne!(new, old);
        c.propose(declare_queue("q3")).await;
        c.converge(&["q1", "q2", "q3"]).await;

        // The failure detector notices the dead node within its timeout.
        tokio::time::sleep(Duration::from_millis(700)).await;
        for link in c.links.values() {
            assert!(!link.peer_alive(old), "{old} is reported down");
        }

        // The old leader comes back on the same port: the others redial it and it catches up.
        c.restart(old).await;
        c.propose(declare_queue("q4")).await;
        c.converge(&["q1", "q2", "q3", "q4"]).await;
        let back = &c.links[&old];
        loop {
            if c.links
                .keys()
                .filter(|p| **p != old)
                .all(|p| back.peer_alive(*p))
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for id in c.nodes.keys().copied().collect::<Vec<_>>() {
            c.kill(id).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_cluster_and_unknown_node_are_refused() {
    bounded(async {
        let c = Cluster::new(&[]).await;
        let target = &c.addrs[&1];
        for bad in [hello("other-cluster", 2), hello(CLUSTER, 42)] {
            let mut s = TcpStream::connect(target).await.expect("connect");
            let frame = wire::encode_frame(&bad, MAX_FRAME).expect("encode");
            s.write_all(&frame).await.expect("write hello");
            let mut buf = BytesMut::new();
            match read_frame(&mut s, &mut buf).await {
                Some(Envelope::Refused { reason }) => assert!(!reason.is_empty()),
                other => panic!("expected a refusal, got {other:?}"),
            }
            assert_eq!(read_frame(&mut s, &mut buf).await, None, "then closed");
        }

        // A whole transport of another cluster, even with a valid node id, cannot call in.
        let mut cfg = link_config(2);
        cfg.cluster_id = "other-cluster".into();
        let stranger = TcpTransport::bind("127.0.0.1:0", cfg).await.expect("bind");
        let r = stranger
            .call(1, target, vec![1, 2, 3], Duration::from_secs(2))
            .await;
        assert!(
            matches!(r, Err(TransportError::Unreachable { .. })),
            "refused: {r:?}"
        );
        stranger.shutdown();

        c.propose(Command::AddVhost { name: "/".into() }).await;
        c.propose(declare_queue("after-refusals")).await;
        c.converge(&["after-refusals"]).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_oversized_frames_close_the_link_only() {
    bounded(async {
        // Node 99 is a known peer of node 1 with nothing listening where it "lives", so the
        // raw socket below may complete a handshake as 99.
        let c = Cluster::new(&[(99, "127.0.0.1:1")]).await;
        c.propose(Command::AddVhost { name: "/".into() }).await;
        let target = c.addrs[&1].clone();

        // An oversized length prefix before any handshake.
        let mut s = TcpStream::connect(&target).await.expect("connect");
        s.write_all(&u32::MAX.to_be_bytes()).await.expect("write");
        s.write_all(&[0u8; 64]).await.expect("write");
        expect_closed(&mut s).await;

        // A well-framed body that is not an envelope.
        let mut s = TcpStream::connect(&target).await.expect("connect");
        let mut junk = 16u32.to_be_bytes().to_vec();
        junk.extend_from_slice(&[0xFF; 16]);
        s.write_all(&junk).await.expect("write");
        expect_closed(&mut s).await;

        // A handshaken link that then sends an oversized frame, then one sending garbage.
        for bad in [
            {
                let mut b = ((MAX_FRAME as u32) + 1).to_be_bytes().to_vec();
                b.extend_from_slice(&[0u8; 64]);
                b
            },
            {
                let mut b = 8u32.to_be_bytes().to_vec();
                b.extend_from_slice(&[0xEE; 8]);
                b
            },
        ] {
            let mut s = TcpStream::connect(&target).await.expect("connect");
            let frame = wire::encode_frame(&hello(CLUSTER, 99), MAX_FRAME).expect("encode");
            s.write_all(&frame).await.expect("write hello");
            let mut buf = BytesMut::new();
            match read_frame(&mut s, &mut buf).await {
                Some(Envelope::Hello { node_id: 1, .. }) => {}
                other => panic!("expected node 1's Hello, got {other:?}"),
            }
            s.write_all(&bad).await.expect("write bad frame");
            expect_closed(&mut s).await;
        }

        // The node kept serving its real peers throughout.
        c.propose(declare_queue("after-garbage")).await;
        c.converge(&["after-garbage"]).await;
        assert!(c.links[&1].peer_alive(2) && c.links[&1].peer_alive(3));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_times_out_instead_of_hanging() {
    bounded(async {
        // A fake node 2 that completes the handshake and then never answers.
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let fake = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            let mut buf = BytesMut::new();
            let first = read_frame(&mut s, &mut buf).await;
            assert!(matches!(first, Some(Envelope::Hello { node_id: 1, .. })));
            let frame = wire::encode_frame(&hello(CLUSTER, 2), MAX_FRAME).expect("encode");
            s.write_all(&frame).await.expect("write hello");
            // Swallow requests (and heartbeats) without replying.
            while read_frame(&mut s, &mut buf).await.is_some() {}
        });
        let mut cfg = link_config(1);
        cfg.peers.insert(2, addr.clone());
        let me = TcpTransport::bind("127.0.0.1:0", cfg).await.expect("bind");
        let started = tokio::time::Instant::now();
        let r = me
            .call(2, &addr, vec![0; 10], Duration::from_millis(300))
            .await;
        assert_eq!(r, Err(TransportError::Timeout));
        assert!(started.elapsed() < Duration::from_secs(2));
        // An oversized request is refused locally and leaves the link up.
        let r = me
            .call(2, &addr, vec![0; MAX_FRAME], Duration::from_millis(300))
            .await;
        assert!(matches!(r, Err(TransportError::Io(_))), "{r:?}");
        assert_eq!(me.connected_peers(), vec![2]);
        me.shutdown();
        let _ = tokio::time::timeout(Duration::from_secs(5), fake).await;
    })
    .await;
}

fn bind_to_missing_queue() -> Command {
    Command::Bind(Binding {
        vhost: "/".into(),
        source: "amq.direct".into(),
        destination: Destination::Queue("missing".into()),
        routing_key: "k".into(),
        arguments: FieldTable::default(),
    })
}

/// `declare_queue(name)` with `durable = false`: refused (406) once the durable one exists.
fn declare_transient(name: &str) -> Command {
    Command::DeclareQueue(QueueDef {
        vhost: "/".into(),
        name: name.into(),
        durable: false,
        exclusive_owner: None,
        auto_delete: false,
        arguments: FieldTable::default(),
        home: 0,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proposal_on_a_follower_is_forwarded_and_applied_on_all_three_nodes() {
    bounded(async {
        let mut c = Cluster::new(&[]).await;
        c.propose(Command::AddVhost { name: "/".into() }).await;
        let (_, follower) = c.follower().await;
        let r = c.nodes[&follower]
            .propose(declare_queue("via-follower"))
            .await
            .expect("forwarded to the leader");
        assert!(r.outcome.as_ref().is_ok_and(|s| s.created), "{r:?}");
        for (id, node) in &c.nodes {
            assert!(node.wait_applied(r.index, Duration::from_secs(5)).await);
            assert!(c.queues(*id).contains("via-follower"), "node {id}");
        }
        c.converge(&["via-follower"]).await;
        c.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_command_on_a_follower_returns_the_leaders_refusal_and_changes_nothing() {
    bounded(async {
        let mut c = Cluster::new(&[]).await;
        c.propose(Command::AddVhost { name: "/".into() }).await;
        c.propose(declare_queue("q")).await;
        c.converge(&["q"]).await;
        let (leader, follower) = c.follower().await;
        let before: BTreeMap<NodeId, _> = c.nodes.iter().map(|(&id, n)| (id, n.view())).collect();

        for command in [declare_transient("q"), bind_to_missing_queue()] {
            let on_follower = c.nodes[&follower]
                .propose(command.clone())
                .await
                .expect("an answer from the leader");
            let on_leader = c.nodes[&leader].propose(command).await.expect("an answer");
            let refusal = on_follower.outcome.clone().expect_err("refused");
            assert_eq!(on_follower.outcome, on_leader.outcome, "the same refusal");
            assert!([404, 406].contains(&refusal.code), "{refusal}");
        }
        c.converge(&["q"]).await;
        for (id, node) in &c.nodes {
            let after = node.view();
            assert_eq!(after.state, before[id].state, "node {id} changed nothing");
            // Four refusals were committed: the chained digest moved on.
            assert_ne!(after.digest, before[id].digest, "node {id}");
        }
        c.stop().await;
    })
    .await;
}

/// What one proposal on the follower came to.
struct Attempted {
    name: String,
    outcome: Result<MetaResponse, ProposeError>,
    took: Duration,
    after_kill: bool,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_proposals_while_the_leader_dies_succeed_or_fail_clearly_and_never_twice() {
    bounded(async {
        let mut c = Cluster::new(&[]).await;
        c.propose(Command::AddVhost { name: "/".into() }).await;
        let (leader, follower) = c.follower().await;
        let deadline = raft_config().propose_timeout;

        // Three proposers on the follower, each a stream of distinct queue names.
        let killed = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let mut workers = Vec::new();
        for w in 0..3 {
            let node = c.nodes[&follower].clone();
            let (killed, stop) = (Arc::clone(&killed), Arc::clone(&stop));
            workers.push(tokio::spawn(async move {
                let mut out = Vec::new();
                let mut wins_after_kill = 0;
                for i in 0.. {
                    if stop.load(Ordering::SeqCst) || wins_after_kill >= 5 {
                        break;
                    }
                    let name = format!("w{w}-{i}");
                    let after_kill = killed.load(Ordering::SeqCst);
                    let started = tokio::time::Instant::now();
                    let outcome = node.propose(declare_queue(&name)).await;
                    if after_kill && outcome.is_ok() {
                        wins_after_kill += 1;
                    }
                    out.push(Attempted {
                        name,
                        outcome,
                        took: started.elapsed(),
                        after_kill,
                    });
                }
                out
            }));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        c.kill(leader).await;
        killed.store(true, Ordering::SeqCst);
        let stopper = {
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(15)).await;
                stop.store(true, Ordering::SeqCst);
            })
        };
        let mut attempts = Vec::new();
        for w in workers {
            attempts.extend(w.await.expect("proposer task"));
        }
        stopper.abort();

        let mut applied = BTreeSet::new();
        let mut not_applied = BTreeSet::new();
        let mut indexes = BTreeSet::new();
        let (mut unknown, mut wins_after_kill) = (0, 0);
        for a in &attempts {
            assert!(
                a.took <= deadline + Duration::from_millis(500),
                "{} took {:?}",
                a.name,
                a.took
            );
            match &a.outcome {
                Ok(r) => {
                    // A proposal applied twice would answer `created: false` the second time.
                    assert!(
                        r.outcome.as_ref().is_ok_and(|s| s.created),
                        "{}: {r:?}",
                        a.name
                    );
                    assert!(indexes.insert(r.index), "index {} reported twice", r.index);
                    applied.insert(a.name.clone());
                    wins_after_kill += usize::from(a.after_kill);
                }
                Err(e @ ProposeError::NoLeader { .. }) => {
                    eprintln!("{}: {e}", a.name);
                    not_applied.insert(a.name.clone());
                }
                Err(e) if e.outcome_unknown() => {
                    eprintln!("{}: {e}", a.name);
                    unknown += 1;
                }
                Err(e) => panic!("{}: unexpected error {e:?}", a.name),
            }
        }
        eprintln!(
            "{} proposals on node {follower}: {} applied ({wins_after_kill} after killing {leader}), \
             {} not applied, {unknown} unknown",
            attempts.len(),
            applied.len(),
            not_applied.len()
        );
        assert!(wins_after_kill > 0, "the new leader took forwarded proposals");

        // The survivors agree (same applied index and chained digest); then the old leader
        // comes back and catches up, and all three hold the same queues.
        let names: Vec<&str> = applied.iter().map(String::as_str).collect();
        c.converge(&names).await;
        c.restart(leader).await;
        c.propose(declare_queue("after-restart")).await;
        let mut all = names.clone();
        all.push("after-restart");
        c.converge(&all).await;
        let reference = c.queues(follower);
        for id in c.nodes.keys() {
            let queues = c.queues(*id);
            assert_eq!(queues, reference, "node {id}");
            assert!(not_applied.iter().all(|n| !queues.contains(n)), "node {id}");
        }
        c.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_whose_process_exits_is_seen_refusing_at_once_not_at_the_next_heartbeat() {
    bounded(async {
        // A fake node 2: completes the handshake, sends a heartbeat, then exits (its
        // connection and its listener close, so its port refuses).
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let (exit_tx, exit_rx) = tokio::sync::oneshot::channel::<()>();
        let fake = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            let mut buf = BytesMut::new();
            let first = read_frame(&mut s, &mut buf).await;
            assert!(matches!(first, Some(Envelope::Hello { node_id: 1, .. })));
            for env in [hello(CLUSTER, 2), Envelope::Heartbeat { alarms: 0 }] {
                let frame = wire::encode_frame(&env, MAX_FRAME).expect("encode");
                s.write_all(&frame).await.expect("write");
            }
            let _ = exit_rx.await;
            // The listener first, as a dying process's lower descriptor is closed first:
            // closing the link first let the redial land in the listener's backlog and be
            // reset (not refused) when the listener went, and with heartbeats an hour
            // apart nothing dialled again (CI at 962d038).
            drop(listener);
            drop(s);
        });
        let mut cfg = link_config(1);
        cfg.peers.insert(2, addr.clone());
        // No heartbeat tick during the test: only the redial on the link's end can find
        // the refusal.
        cfg.heartbeat_interval = Duration::from_secs(3600);
        let me = TcpTransport::bind("127.0.0.1:0", cfg).await.expect("bind");
        let _ = me
            .call(2, &addr, vec![0; 10], Duration::from_millis(200))
            .await;
        // The handshake and the heartbeat arrived (the call itself gets no answer).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while me.last_seen(2).is_none() {
            assert!(tokio::time::Instant::now() < deadline, "node 2 never heard");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!me.peer_refused(2), "up and linked");
        let _ = exit_tx.send(());
        fake.await.expect("fake node");
        // The link's end, then the refusal, each wake the detector's waiter.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !me.peer_refused(2) {
            assert!(
                tokio::time::timeout_at(deadline, me.peer_event())
                    .await
                    .is_ok(),
                "the exit was not seen refusing within 5 s (heartbeats every hour)"
            );
        }
        me.shutdown();
    })
    .await;
}
