//! The cluster's background tasks: the follower (every applied state to the broker, then
//! the applied index), the failure detector's watch, and the leader's membership task.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::MAX_VOTERS;
use crate::broker::Broker;
use crate::cluster::{Call, Detector, ElectionCaller};
use crate::runtime::clock::Clock;
use crate::runtime::node_link::TcpTransport;
use crate::runtime::raft::{MetaRaft, NodeId};
use crate::runtime::relay::Relay;

/// The follower task: every new applied state goes to the broker, then its index is
/// published; registered nodes become link peers.
pub(super) async fn follow(
    raft: MetaRaft,
    broker: Arc<Broker>,
    transport: TcpTransport,
    applied: watch::Sender<u64>,
    clock: Clock,
    relay: Arc<std::sync::OnceLock<Arc<Relay>>>,
) {
    follow_metadata(raft, broker, applied, clock, relay, |id, link| match link {
        Some(addr) => transport.set_peer(id, addr.to_string()),
        None => transport.remove_peer(id),
    })
    .await
}

/// The follower, whatever the links: every new applied state goes to the broker, nodes
/// that restarted (a new incarnation) or went are told to the relay, consumers waiting for
/// a new master are rehomed, then the applied index is published. `links` hears of every
/// node's new link address (`Some`) and of forgotten nodes (`None`). The node and the
/// simulation run this one.
pub async fn follow_metadata(
    raft: MetaRaft,
    broker: Arc<Broker>,
    applied: watch::Sender<u64>,
    clock: Clock,
    relay: Arc<std::sync::OnceLock<Arc<Relay>>>,
    mut links: impl FnMut(NodeId, Option<&str>) + Send,
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
                links(*id, Some(&n.link));
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
                links(*id, None);
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
/// per outage; a follower calls an election early when the leader's process is gone
/// (`cluster::election`). It looks every 200 ms, and at once when a link ends, a peer
/// refuses a connection or the leadership changes.
pub(super) async fn watch_nodes(
    raft: MetaRaft,
    broker: Arc<Broker>,
    transport: TcpTransport,
    peer_timeout: Duration,
    relay: Arc<std::sync::OnceLock<Arc<Relay>>>,
    clock: Clock,
) {
    // The detector's clock: milliseconds since this task started.
    let base = tokio::time::Instant::now();
    let ms = |t: tokio::time::Instant| t.saturating_duration_since(base).as_millis() as u64;
    let mut detector = Detector::new(raft.id(), peer_timeout.as_millis() as u64, 0);
    let mut caller = ElectionCaller::new(
        raft.id(),
        raft.lease().as_millis() as u64,
        raft.heartbeat().as_millis() as u64,
    );
    let mut leadership = raft.leader_watch();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let mut call_at: Option<tokio::time::Instant> = None;
    loop {
        let call_due = async {
            match call_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tick.tick() => {}
            _ = transport.peer_event() => {}
            _ = leadership.changed() => {}
            _ = call_due => {}
        }
        let state = raft.snapshot();
        let now = ms(tokio::time::Instant::now());
        let last_heard = |id| transport.last_seen(id).map(ms);
        let refused = |id| transport.peer_refused(id);
        let verdict = detector.handle_tick(
            now,
            raft.is_leader(),
            state.nodes.keys().copied(),
            last_heard,
            refused,
        );
        // From the decision on (no await in between), the nodes to record are refused
        // lease renewals here until their record is applied (`cluster::read_fence`).
        raft.fence_reads(&verdict.to_declare);
        let voters: BTreeSet<NodeId> = raft.membership().voters.keys().copied().collect();
        let leader = raft.leader();
        let mut call = caller.handle_tick(now, leader, &voters, &verdict.down, last_heard, refused);
        if call == Call::Now {
            tracing::warn!(
                ?leader,
                "calling an election: the leader's process is gone and its lease has run out"
            );
            if let Err(e) = raft.call_election().await {
                tracing::warn!(error = %e, "cannot call an election");
            }
            // The core says when to look again, should no leader come of it.
            call = caller.handle_tick(now, leader, &voters, &verdict.down, last_heard, refused);
        }
        call_at = match call {
            Call::At(t) => Some(base + Duration::from_millis(t)),
            Call::None | Call::Now => None,
        };
        broker.set_down_nodes(verdict.down, clock.now());
        // Resource alarms are cluster-wide: ours go out with the heartbeats, theirs come in.
        transport.set_local_alarms(broker.local_alarms());
        broker.set_peer_alarms(transport.peer_alarms());
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
        record_down_nodes(&raft, &mut detector, verdict.to_declare, |_| {}).await;
    }
}

/// The leader's part of a detector tick, as the node and the simulation drive it: records
/// each node of `to_declare` down, in order, and tells `detector` of each record applied;
/// `recording` hears of each just before its proposal. The caller fenced their reads
/// ([`MetaRaft::fence_reads`]) when the detector decided, before any await.
pub async fn record_down_nodes(
    raft: &MetaRaft,
    detector: &mut Detector,
    to_declare: Vec<NodeId>,
    mut recording: impl FnMut(NodeId),
) {
    for id in to_declare {
        // A leader cut off from the majority keeps believing it leads, and from there
        // every peer looks down: only a leadership a quorum confirms may decide.
        if raft.linearizable_snapshot().await.is_err() {
            return;
        }
        tracing::warn!(
            node = id,
            "node down: removing its transient and exclusive queues"
        );
        recording(id);
        match raft.record_down(id).await {
            Ok(_) => detector.handle_declared(id),
            Err(e) => tracing::warn!(node = id, error = %e, "cannot record a node as down"),
        }
    }
}

/// The membership task, on the leader: the Raft membership follows the nodes table.
pub(super) async fn reconcile_membership(raft: MetaRaft) {
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
