//! GM over real TCP node links on 127.0.0.1: members on three in-process nodes (each with
//! its metadata Raft member and a [`GmHost`]) join one group through Raft, broadcast, and
//! carry on when a node dies (recorded by `NodeDown`, as the failure detector does) or a
//! member leaves; with durable acks a confirm waits for every member's release.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use warren::gm::{Event, MemberId};
use warren::meta::Command;
use warren::runtime::gm_host::{GmHandle, GmHost, GmHostConfig};
use warren::runtime::node_link::{NodeLinkConfig, TcpTransport};
use warren::runtime::raft::{MetaRaft, MetaRaftConfig, NodeId};
use warren::store::{Disk, DiskError, MemDisk};

async fn bounded<F: Future<Output = ()>>(test: F) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
    tokio::time::timeout(Duration::from_secs(60), test)
        .await
        .expect("test finished in time");
}

struct Node {
    link: TcpTransport,
    raft: MetaRaft,
    host: GmHost<TcpTransport>,
}

async fn cluster(n: u64) -> BTreeMap<NodeId, Node> {
    cluster_with(n, None, GmHostConfig::default()).await
}

/// A cluster whose node links refuse frames over `max_frame` (when given).
async fn cluster_with(
    n: u64,
    max_frame: Option<usize>,
    host_cfg: GmHostConfig,
) -> BTreeMap<NodeId, Node> {
    cluster_on(n, max_frame, host_cfg, |_| Arc::new(MemDisk::new()), None).await
}

/// A cluster whose nodes keep their Raft logs on `disk_of(id)`; node `apart`, if any, runs
/// its link and Raft tasks on a runtime of its own, so that a call that blocks one of its
/// threads stalls that node alone, as it would a process.
async fn cluster_on(
    n: u64,
    max_frame: Option<usize>,
    host_cfg: GmHostConfig,
    disk_of: impl Fn(NodeId) -> Arc<dyn Disk>,
    apart: Option<NodeId>,
) -> BTreeMap<NodeId, Node> {
    let own: Option<&'static tokio::runtime::Runtime> = apart.map(|_| {
        // Leaked: the node's tasks may be blocked for good when the test ends, and dropping
        // a runtime inside another one's task panics.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        &*Box::leak(Box::new(rt))
    });
    let rt_of = |id: NodeId| own.filter(|_| apart == Some(id));
    let mut links = BTreeMap::new();
    let mut addrs = BTreeMap::new();
    for id in 1..=n {
        let mut cfg = NodeLinkConfig {
            heartbeat_interval: Duration::from_millis(50),
            peer_timeout: Duration::from_millis(500),
            connect_timeout: Duration::from_millis(500),
            backoff_min: Duration::from_millis(20),
            backoff_max: Duration::from_millis(200),
            ..NodeLinkConfig::new("gm-test", id)
        };
        if let Some(max) = max_frame {
            cfg.max_frame = max;
        }
        let link = on(rt_of(id), TcpTransport::bind("127.0.0.1:0", cfg))
            .await
            .expect("bind");
        addrs.insert(id, link.local_addr().to_string());
        links.insert(id, link);
    }
    let mut nodes = BTreeMap::new();
    for (id, link) in links {
        for (peer, addr) in &addrs {
            if *peer != id {
                link.set_peer(*peer, addr.clone());
            }
        }
        let disk = disk_of(id);
        let raft_link = link.clone();
        let raft = on(rt_of(id), async move {
            let cfg = MetaRaftConfig {
                cluster_name: "gm-test".into(),
                heartbeat: Duration::from_millis(50),
                election_timeout_min: Duration::from_millis(250),
                election_timeout_max: Duration::from_millis(500),
                propose_timeout: Duration::from_secs(3),
                ..MetaRaftConfig::default()
            };
            MetaRaft::start(id, raft_link, disk, Path::new("/raft"), &cfg, 7 + id).await
        })
        .await
        .expect("raft starts");
        link.serve(raft.rpc_server());
        let host = GmHost::new(id, link.clone(), raft.clone(), host_cfg.clone());
        let h = host.clone();
        link.serve_gm(Arc::new(move |frame: &bytes::Bytes| h.handle_frame(frame)));
        nodes.insert(id, Node { link, raft, host });
    }
    nodes[&1].raft.initialize(addrs).await.expect("initialise");
    nodes
}

/// Runs `fut` on `rt` when given (a node's own runtime), else here.
async fn on<T: Send + 'static>(
    rt: Option<&'static tokio::runtime::Runtime>,
    fut: impl Future<Output = T> + Send + 'static,
) -> T {
    match rt {
        Some(rt) => rt.spawn(fut).await.expect("the node's runtime ran it"),
        None => fut.await,
    }
}

async fn kill(nodes: &mut BTreeMap<NodeId, Node>, id: NodeId) {
    if let Some(node) = nodes.remove(&id) {
        let _ = node.raft.shutdown().await;
        node.link.shutdown();
    }
}

/// Collects events until `want` deliveries came (or the member stopped).
async fn deliveries(h: &mut GmHandle, want: usize) -> Vec<(MemberId, String)> {
    let mut got = Vec::new();
    while got.len() < want {
        match h.next_event().await {
            Some(Event::Deliver { from, msg, .. }) => {
                got.push((from, String::from_utf8_lossy(&msg).into_owned()))
            }
            Some(Event::Stopped) | None => break,
            Some(_) => {}
        }
    }
    got
}

fn from(got: &[(MemberId, String)], origin: MemberId) -> Vec<String> {
    got.iter()
        .filter(|(o, _)| *o == origin)
        .map(|(_, s)| s.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_deliver_every_broadcast_in_per_origin_order() {
    bounded(async {
        let nodes = cluster(3).await;
        let mut handles = Vec::new();
        for id in 1..=3 {
            handles.push(nodes[&id].host.join("g", false).await.expect("join"));
        }
        let ids: Vec<MemberId> = handles.iter().map(|h| h.id()).collect();
        assert_eq!(ids.iter().map(|m| m.node).collect::<Vec<_>>(), [1, 2, 3]);
        assert!(ids.windows(2).all(|w| w[0].since < w[1].since));
        // Let every member get its state (the joiners' catch-ups) before broadcasting, so
        // each of them is in the group before the first message.
        for h in &handles {
            h.confirmed_broadcast(Bytes::from(format!("hello-{}", h.id().node)))
                .await
                .expect("a lap completes");
        }
        let mut confirms = Vec::new();
        for h in &handles {
            for k in 0..100 {
                confirms.push(h.confirmed_broadcast(Bytes::from(format!("{}-{k}", h.id().node))));
            }
        }
        for c in confirms {
            c.await.expect("confirmed");
        }
        for h in &mut handles {
            let got = deliveries(h, 303).await;
            for origin in &ids {
                let mut expect = vec![format!("hello-{}", origin.node)];
                expect.extend((0..100).map(|k| format!("{}-{k}", origin.node)));
                assert_eq!(from(&got, *origin), expect, "{:?} from {origin:?}", h.id());
            }
        }
    })
    .await;
}

// One thread: the burst is queued whole before the member task takes any of it.
#[tokio::test(flavor = "current_thread")]
async fn a_burst_bigger_than_a_frame_goes_round_in_activities_that_fit() {
    bounded(async {
        // Frames of 256 KiB at most; a burst of 64 broadcasts of 20 KiB (1.25 MiB) queued
        // at once. As one activity it would never fit a frame (and be retried forever).
        // Nothing goes in parts here (no byte budget per batch): only the activity size
        // keeps each message within a frame (parts: the catch-up test below).
        let host_cfg = GmHostConfig {
            max_activity_bytes: 64 << 10,
            max_batch_bytes: usize::MAX,
            ..GmHostConfig::default()
        };
        let nodes = cluster_with(3, Some(256 << 10), host_cfg).await;
        let mut handles = Vec::new();
        for id in 1..=3 {
            handles.push(nodes[&id].host.join("g", false).await.expect("join"));
        }
        for h in &handles {
            h.confirmed_broadcast(Bytes::from_static(b"hello"))
                .await
                .expect("a lap completes");
        }
        let body = |k: usize| {
            let mut b = format!("{k:04}").into_bytes();
            b.resize(20 << 10, b'.');
            Bytes::from(b)
        };
        let confirms: Vec<_> = (0..64)
            .map(|k| handles[0].confirmed_broadcast(body(k)))
            .collect();
        for c in confirms {
            tokio::time::timeout(Duration::from_secs(20), c)
                .await
                .expect("confirmed in time (an activity over the frame limit stalls)")
                .expect("confirmed");
        }
        let origin = handles[0].id();
        for h in &mut handles {
            let got = deliveries(h, 3 + 64).await;
            let want: Vec<String> = std::iter::once("hello".to_string())
                .chain((0..64).map(|k| String::from_utf8_lossy(&body(k)).into_owned()))
                .collect();
            assert_eq!(
                from(&got, origin),
                want,
                "{:?}: every broadcast, in order",
                h.id()
            );
        }
    })
    .await;
}

/// Waits for `h`'s next delivery of its own broadcast and releases it (durable at once).
async fn release_own_next(h: &mut GmHandle) {
    loop {
        match h.next_event().await {
            Some(Event::Deliver { from, num, .. }) if from == h.id() => {
                h.release(from, num);
                return;
            }
            Some(_) => {}
            None => panic!("member {:?} stopped", h.id()),
        }
    }
}

/// Waits until `h` delivers `body`; its origin and number (not released).
async fn delivered(h: &mut GmHandle, body: &str) -> (MemberId, warren::gm::PubNum) {
    loop {
        match h.next_event().await {
            Some(Event::Deliver { from, num, msg }) if msg == body => return (from, num),
            Some(_) => {}
            None => panic!("member {:?} stopped", h.id()),
        }
    }
}

/// Releases everything `h` delivers, and reports each delivery's body on `seen`.
fn release_all(mut h: GmHandle, seen: tokio::sync::mpsc::UnboundedSender<Bytes>) {
    tokio::spawn(async move {
        while let Some(ev) = h.next_event().await {
            if let Event::Deliver { from, num, msg } = ev {
                h.release(from, num);
                let _ = seen.send(msg);
            }
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catch_up_bigger_than_a_frame_reaches_a_joiner_in_parts() {
    bounded(async {
        // Frames of 256 KiB at most, batches of 64 KiB. Member 2 holds back its releases,
        // so 8 publishes of 60 KiB (480 KiB) stay pending when member 3 joins behind it:
        // member 2's catch-up to 3 carries them all, and only in parts can it arrive.
        let host_cfg = GmHostConfig {
            max_activity_bytes: 64 << 10,
            max_batch_bytes: 64 << 10,
            ..GmHostConfig::default()
        };
        let nodes = cluster_with(3, Some(256 << 10), host_cfg).await;
        let a = nodes[&1].host.join("c", true).await.expect("join 1");
        let mut b = nodes[&2].host.join("c", true).await.expect("join 2");
        let (a_seen, mut a_rx) = tokio::sync::mpsc::unbounded_channel();
        let sender = a.sender();
        let origin = a.id();
        release_all(a, a_seen);
        let big = |k: u8| Bytes::from(vec![k; 60 << 10]);
        let confirms: Vec<_> = (0..8).map(|k| sender.confirmed_broadcast(big(k))).collect();
        let mut held = Vec::new();
        while held.len() < 8 {
            match b.next_event().await {
                Some(Event::Deliver { from, num, msg }) => {
                    assert_eq!(from, origin);
                    assert_eq!(msg, big(held.len() as u8), "in order");
                    held.push(num);
                }
                Some(_) => {}
                None => panic!("member 2 stopped"),
            }
        }
        let c = nodes[&3].host.join("c", true).await.expect("join 3");
        let (c_seen, mut c_rx) = tokio::sync::mpsc::unbounded_channel();
        release_all(c, c_seen);
        for num in held {
            b.release(origin, num);
        }
        let b_task = tokio::spawn(async move {
            while let Some(ev) = b.next_event().await {
                if let Event::Deliver { from, num, .. } = ev {
                    b.release(from, num);
                }
            }
        });
        for c in confirms {
            tokio::time::timeout(Duration::from_secs(20), c)
                .await
                .expect("confirmed in time (the acks pass member 3 after the catch-up)")
                .expect("confirmed");
        }
        // The ring goes on through the joiner.
        tokio::time::timeout(
            Duration::from_secs(20),
            sender.confirmed_broadcast(Bytes::from_static(b"after")),
        )
        .await
        .expect("confirmed in time")
        .expect("confirmed");
        let mut at_c = Vec::new();
        while let Some(msg) = c_rx.recv().await {
            at_c.push(msg.clone());
            if msg == "after" {
                break;
            }
        }
        assert_eq!(at_c.last().map(|m| &m[..]), Some(&b"after"[..]));
        assert!(a_rx.try_recv().is_ok(), "member 1 delivered its own");
        b_task.abort();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_node_is_recorded_through_raft_and_the_ring_closes_around_it() {
    bounded(async {
        let mut nodes = cluster(3).await;
        let mut handles = BTreeMap::new();
        for id in 1..=3 {
            let h = nodes[&id].host.join("g", false).await.expect("join");
            h.confirmed_broadcast(Bytes::from_static(b"warm-up"))
                .await
                .expect("lap");
            handles.insert(id, h);
        }
        // Node 2 dies with a confirm of node 1 in flight; it cannot complete while node 2 is
        // in the view and unreachable.
        kill(&mut nodes, 2).await;
        let pending = handles[&1].confirmed_broadcast(Bytes::from_static(b"during"));
        tokio::time::sleep(Duration::from_millis(300)).await;
        // What the leader's failure detector does: record the death through Raft.
        let survivor = &nodes[&1].raft;
        let mut recorded = false;
        for _ in 0..50 {
            if survivor.propose(Command::NodeDown { id: 2 }).await.is_ok() {
                recorded = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(recorded, "NodeDown committed by the two survivors");
        pending
            .await
            .expect("the lap completes around the dead member");
        handles[&3]
            .confirmed_broadcast(Bytes::from_static(b"after"))
            .await
            .expect("node 3's laps complete too");
        let h3 = handles.get_mut(&3).expect("member on 3");
        let mut changed = false;
        let mut got = Vec::new();
        while let Some(ev) = h3.try_event() {
            match ev {
                Event::MembersChanged { deaths, .. } => {
                    changed |= deaths.iter().any(|d| d.node == 2)
                }
                Event::Deliver { msg, .. } => got.push(msg),
                _ => {}
            }
        }
        assert!(changed, "node 3 was told of node 2's death");
        assert!(got.contains(&Bytes::from_static(b"during")));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_acks_hold_the_confirm_until_every_member_released() {
    bounded(async {
        let nodes = cluster(3).await;
        let mut handles = Vec::new();
        for id in 1..=3 {
            handles.push(nodes[&id].host.join("d", true).await.expect("join"));
        }
        // Members 2 and 3 release everything they deliver, except that 3 holds "x" back.
        let (mut a, mut rest) = (handles.remove(0), handles);
        let mut c = rest.pop().expect("3");
        let b = rest.pop().expect("2");
        let b_task = tokio::spawn(async move {
            let mut b = b;
            while let Some(ev) = b.next_event().await {
                if let Event::Deliver { from, num, .. } = ev {
                    b.release(from, num);
                }
            }
        });
        let confirm = a.confirmed_broadcast(Bytes::from_static(b"x"));
        // The origin's own copy is durable at once here.
        release_own_next(&mut a).await;
        let (held_from, held_num) = delivered(&mut c, "x").await;
        let confirm = tokio::spawn(confirm);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !confirm.is_finished(),
            "no confirm while member 3 holds it back"
        );
        c.release(held_from, held_num);
        confirm
            .await
            .expect("task")
            .expect("confirmed once 3 released");
        b_task.abort();
    })
    .await;
}

/// Bug 22: a mirror that holds back a release on purpose (a round it cannot write, a sync
/// whose start it missed) must still get out of the group, or it never joins again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_holding_back_a_release_cannot_drain_but_abandons_at_once() {
    bounded(async {
        let nodes = cluster(3).await;
        let mut handles = Vec::new();
        for id in 1..=3 {
            handles.push(nodes[&id].host.join("a", true).await.expect("join"));
        }
        let mut c = handles.pop().expect("3");
        let b = handles.pop().expect("2");
        let mut a = handles.pop().expect("1");
        let (seen, _seen) = tokio::sync::mpsc::unbounded_channel();
        release_all(b, seen);
        let confirm = tokio::spawn(a.confirmed_broadcast(Bytes::from_static(b"x")));
        release_own_next(&mut a).await;
        delivered(&mut c, "x").await;
        // 3 never releases "x": a draining leave waits for it.
        let drained = tokio::time::timeout(Duration::from_millis(500), c.leave()).await;
        assert!(drained.is_err(), "a draining leave finished: {drained:?}");
        c.sender().abandon().await.expect("abandoned");
        // Recorded dead, then maybe erased (node 1 applies it shortly after the leader).
        let mut views = nodes[&1].raft.subscribe();
        while views.borrow_and_update().state.gm_groups["a"]
            .members
            .contains(&warren::gm::Slot::Alive(c.id()))
        {
            views.changed().await.expect("node 1 runs");
        }
        confirm
            .await
            .expect("task")
            .expect("the two that stay confirm without the abandoned member");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_leaves_drains_first_and_the_rest_carry_on() {
    bounded(async {
        let nodes = cluster(3).await;
        let mut handles = Vec::new();
        for id in 1..=3 {
            handles.push(nodes[&id].host.join("l", false).await.expect("join"));
        }
        for h in &handles {
            h.confirmed_broadcast(Bytes::from_static(b"warm-up"))
                .await
                .expect("lap");
        }
        let leaver = handles.remove(1);
        let last = leaver.confirmed_broadcast(Bytes::from_static(b"bye"));
        leaver.leave().await.expect("left");
        last.await
            .expect("its last broadcast completed before it left");
        let record = nodes[&1].raft.snapshot().gm_groups["l"].clone();
        assert!(!record
            .members
            .contains(&warren::gm::Slot::Alive(leaver.id())));
        handles[0]
            .confirmed_broadcast(Bytes::from_static(b"after"))
            .await
            .expect("the two that stay complete laps");
        let mut leaver = leaver;
        let mut stopped = false;
        while let Some(ev) = tokio::time::timeout(Duration::from_secs(5), leaver.next_event())
            .await
            .ok()
            .flatten()
        {
            if ev == Event::Stopped {
                stopped = true;
                break;
            }
        }
        assert!(stopped, "the leaver stops once the record drops it");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_joining_at_once_on_one_node_each_get_their_own_id_and_route() {
    bounded(async {
        let nodes = cluster(3).await;
        let host = nodes[&2].host.clone();
        let (a, b) = tokio::join!(host.join("c", false), host.join("c", false));
        let (a, b) = (a.expect("join a"), b.expect("join b"));
        assert_ne!(a.id(), b.id());
        let c = nodes[&1].host.join("c", false).await.expect("join c");
        for h in [&a, &b, &c] {
            h.confirmed_broadcast(Bytes::from_static(b"x"))
                .await
                .expect("every member's lap completes (each one's route exists)");
        }
    })
    .await;
}

/// A [`MemDisk`] whose writes (`append`) block their caller while the gate is shut: a leader
/// whose disk stalls as it writes an entry, before the entry can be replicated.
struct StallDisk {
    inner: MemDisk,
    shut: std::sync::Mutex<bool>,
    /// Callers that have waited at the gate (never decremented: the test asks whether any did).
    held: std::sync::atomic::AtomicUsize,
    opened: std::sync::Condvar,
}

impl StallDisk {
    fn set_shut(&self, shut: bool) {
        *self.shut.lock().expect("gate") = shut;
        self.opened.notify_all();
    }

    fn wait_open(&self) {
        let mut shut = self.shut.lock().expect("gate");
        if *shut {
            self.held.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            while *shut {
                shut = self.opened.wait(shut).expect("gate");
            }
        }
    }
}

impl Disk for StallDisk {
    fn create_dir_all(&self, dir: &Path) -> Result<(), DiskError> {
        self.inner.create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> Result<Vec<String>, DiskError> {
        self.inner.list(dir)
    }
    fn read(&self, path: &Path) -> Result<Vec<u8>, DiskError> {
        self.inner.read(path)
    }
    fn read_at(&self, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>, DiskError> {
        self.inner.read_at(path, offset, len)
    }
    fn append(&self, path: &Path, data: &[u8]) -> Result<u64, DiskError> {
        self.wait_open();
        self.inner.append(path, data)
    }
    fn write_file(&self, path: &Path, data: &[u8]) -> Result<(), DiskError> {
        self.inner.write_file(path, data)
    }
    fn truncate(&self, path: &Path, len: u64) -> Result<(), DiskError> {
        self.inner.truncate(path, len)
    }
    fn rename(&self, from: &Path, to: &Path) -> Result<(), DiskError> {
        self.inner.rename(from, to)
    }
    fn remove(&self, path: &Path) -> Result<(), DiskError> {
        self.inner.remove(path)
    }
    fn sync(&self, path: &Path) -> Result<(), DiskError> {
        self.inner.sync(path)
    }
    fn sync_dir(&self, dir: &Path) -> Result<(), DiskError> {
        self.inner.sync_dir(dir)
    }
    fn len(&self, path: &Path) -> Result<Option<u64>, DiskError> {
        self.inner.len(path)
    }
    fn remove_dir(&self, dir: &Path) -> Result<(), DiskError> {
        self.inner.remove_dir(dir)
    }
}

/// Bug 20 (`docs/reliability.md`): a member's join proposal reaches the leader, whose log
/// fsync stalls, and the leader dies before anything is replicated; the joiner is told
/// "outcome unknown" and the other two elect a leader. The join must settle the outcome with
/// a quorum read and go on under the new leader, not wait for a record version that can no
/// longer come (it waited 30 s, holding every other join on its node behind it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_whose_proposal_died_with_the_leader_settles_it_and_joins_under_the_next() {
    bounded(async {
        let stall = Arc::new(StallDisk {
            inner: MemDisk::new(),
            shut: std::sync::Mutex::new(false),
            held: std::sync::atomic::AtomicUsize::new(0),
            opened: std::sync::Condvar::new(),
        });
        let on_1 = Arc::clone(&stall);
        let disk_of = move |id| {
            if id == 1 {
                Arc::clone(&on_1) as Arc<dyn Disk>
            } else {
                Arc::new(MemDisk::new()) as Arc<dyn Disk>
            }
        };
        let mut nodes = cluster_on(3, None, GmHostConfig::default(), disk_of, Some(1)).await;
        let first = nodes[&1].host.join("g", false).await.expect("join on 1");
        first
            .confirmed_broadcast(Bytes::from_static(b"warm-up"))
            .await
            .expect("lap");
        assert_eq!(
            nodes[&1].raft.leader(),
            Some(1),
            "node 1 initialised and leads"
        );

        // Node 1's next log write (the join's entry) stalls; then node 1 vanishes.
        stall.set_shut(true);
        let host2 = nodes[&2].host.clone();
        let joining = tokio::spawn(async move { host2.join("g", false).await });
        let mut polls = 0;
        while stall.held.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            polls += 1;
            assert!(polls < 1000, "the join's entry reached node 1's log");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let dead = nodes.remove(&1).expect("node 1");
        dead.link.shutdown();

        let outcome = tokio::time::timeout(Duration::from_secs(10), joining).await;
        // Let node 1's stalled tasks go before any assertion can fail.
        stall.set_shut(false);
        let joined = outcome
            .expect("the join ends well before the 30 s wait for a version that cannot come")
            .expect("join task")
            .expect("joined");
        let leader = nodes[&2].raft.leader();
        assert!(matches!(leader, Some(2 | 3)), "a new leader: {leader:?}");
        let record = nodes[&2].raft.snapshot().gm_groups["g"].clone();
        assert!(
            record
                .members
                .contains(&warren::gm::Slot::Alive(joined.id())),
            "the record names the member that runs: {record:?}"
        );
        drop(first);
        let _ = dead.raft.shutdown().await;
    })
    .await;
}
