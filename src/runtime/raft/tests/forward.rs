//! Proposals forwarded from a follower to the leader: the frame encoding of the new request
//! kind, malformed frames, and in-process clusters whose transport misroutes, refuses, loses
//! or garbles forwards, to pin down when a forward is retried and when it never is.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use openraft::Vote;
use rand::{Rng, SeedableRng};

use super::harness::{add_vhost, bind, bounded, declare_queue, fast_config, Cluster, DIR};
use crate::cluster::read_log::Readers;
use crate::runtime::raft::forward::{ForwardReply, ForwardRequest};
use crate::runtime::raft::network::{
    decode_reply, decode_request, encode_reply, encode_request, RpcReply, RpcRequest,
};
use crate::runtime::raft::types::{AppliedSummary, MetaRequest, Rejected};
use crate::runtime::raft::{
    MetaRaft, MetaRaftConfig, MetaResponse, NodeId, ProposeError, RaftTransport, Router,
    RouterTransport, TransportError,
};
use crate::store::{Disk, MemDisk};

fn forward_request() -> ForwardRequest {
    ForwardRequest {
        origin: 2,
        budget_ms: 1500,
        request: MetaRequest {
            command: declare_queue("forwarded"),
        },
        readers_window_ms: 3_850,
    }
}

fn forward_frame() -> Vec<u8> {
    encode_request(&RpcRequest::Forward(forward_request())).expect("encode")
}

/// The variant index bincode writes after the format byte.
fn tag(frame: &[u8]) -> u32 {
    u32::from_le_bytes(frame[1..5].try_into().expect("4 bytes"))
}

#[test]
fn a_forward_request_round_trips_behind_the_existing_rpc_kinds() {
    let frame = forward_frame();
    assert_eq!(frame[0], 1, "the format byte of every raft frame");
    assert_eq!(tag(&frame), 3, "appended after Append, Vote and Snapshot");
    match decode_request(&frame).expect("decode") {
        RpcRequest::Forward(r) => assert_eq!(r, forward_request()),
        other => panic!("decoded as {other:?}"),
    }
    // The existing kinds keep their indexes, so old frames still decode the same.
    let vote = encode_request(&RpcRequest::Vote(openraft::raft::VoteRequest::new(
        Vote::new(1, 2),
        None,
    )))
    .expect("encode");
    assert_eq!(tag(&vote), 1);
}

#[test]
fn every_forward_reply_round_trips() {
    let replies = [
        ForwardReply::Applied(
            MetaResponse {
                index: 7,
                outcome: Ok(AppliedSummary {
                    created: true,
                    ..AppliedSummary::default()
                }),
            },
            Readers::Known([1, 3].into()),
        ),
        ForwardReply::Applied(
            MetaResponse {
                index: 8,
                outcome: Err(Rejected {
                    code: 404,
                    text: "NOT_FOUND - no queue 'q' in vhost '/'".into(),
                }),
            },
            Readers::Unknown,
        ),
        ForwardReply::NotLeader {
            leader: Some(3),
            leader_addr: Some("10.0.0.3:25672".into()),
        },
        ForwardReply::NotLeader {
            leader: None,
            leader_addr: None,
        },
        ForwardReply::Timeout { budget_ms: 1900 },
        ForwardReply::Unknown {
            reason: "leadership lost".into(),
        },
        ForwardReply::Stopped {
            reason: "stopped".into(),
        },
    ];
    for reply in replies {
        let frame = encode_reply(&RpcReply::Forward(reply.clone())).expect("encode");
        assert_eq!(tag(&frame), 4, "appended after Malformed");
        match decode_reply(&frame).expect("decode") {
            RpcReply::Forward(r) => assert_eq!(r, reply),
            other => panic!("decoded as {other:?}"),
        }
    }
    let malformed = encode_reply(&RpcReply::Malformed("x".into())).expect("encode");
    assert_eq!(tag(&malformed), 3);
}

/// One node that is not part of any cluster: it leads nothing.
async fn lone_node() -> MetaRaft {
    let disk: Arc<dyn Disk> = Arc::new(MemDisk::new());
    let router = Router::new();
    MetaRaft::start(
        1,
        router.transport(1),
        disk,
        Path::new(DIR),
        &fast_config(),
        1,
    )
    .await
    .expect("start")
}

#[tokio::test]
async fn malformed_forward_frames_get_a_malformed_reply_and_nothing_panics() {
    bounded(async {
        let node = lone_node().await;
        let server = node.rpc_server();
        let good = forward_frame();
        let mut bad: Vec<Vec<u8>> = vec![
            Vec::new(),
            vec![9, 3, 0, 0, 0],
            vec![1, 99, 0, 0, 0],
            [good.as_slice(), &[0]].concat(),
        ];
        // Every truncation of a valid forward.
        bad.extend((0..good.len()).map(|n| good[..n].to_vec()));
        // A forward whose command tag is out of range.
        let mut wrong_command = good.clone();
        wrong_command[5 + 16..5 + 20].copy_from_slice(&u32::MAX.to_le_bytes());
        bad.push(wrong_command);
        for frame in &bad {
            match decode_reply(&server.handle(frame).await) {
                Ok(RpcReply::Malformed(why)) => assert!(!why.is_empty()),
                other => panic!("{frame:?} answered with {other:?}"),
            }
        }
        // Random bodies behind the forward tag: always a decodable answer, never a panic.
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..300 {
            let len = rng.gen_range(0..96);
            let mut frame = vec![1, 3, 0, 0, 0];
            frame.extend((0..len).map(|_| rng.gen::<u8>()));
            let reply = decode_reply(&server.handle(&frame).await).expect("a reply frame");
            assert!(
                matches!(
                    reply,
                    RpcReply::Malformed(_) | RpcReply::Forward(ForwardReply::NotLeader { .. })
                ),
                "{reply:?}"
            );
        }
        node.shutdown().await.expect("shutdown");
    })
    .await;
}

#[tokio::test]
async fn a_forward_to_a_node_that_does_not_lead_is_refused_without_proposing() {
    bounded(async {
        let node = lone_node().await;
        let reply = node.rpc_server().handle(&forward_frame()).await;
        match decode_reply(&reply).expect("decode") {
            RpcReply::Forward(ForwardReply::NotLeader {
                leader: None,
                leader_addr: None,
            }) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(node.view().applied_index, None, "nothing was applied");
        node.shutdown().await.expect("shutdown");
    })
    .await;
}

/// What a [`FaultyTransport`] does to forward frames (Raft RPCs always pass untouched).
#[derive(Default)]
struct Faults {
    /// Answer this many forwards with *unreachable*, without delivering them.
    refuse: u32,
    /// Deliver the next forward to this node instead of its target.
    misroute_to: Option<NodeId>,
    /// Deliver forwards, then report the link as failed.
    lose_replies: bool,
    /// Deliver forwards, then hand back garbage instead of the reply.
    garble_replies: bool,
    /// Forwards handed to a node's server.
    delivered: u32,
    /// Forward calls made.
    calls: u32,
}

#[derive(Clone)]
struct FaultyTransport {
    inner: RouterTransport,
    faults: Arc<Mutex<Faults>>,
}

impl FaultyTransport {
    fn faults(&self) -> MutexGuard<'_, Faults> {
        self.faults.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl RaftTransport for FaultyTransport {
    async fn call(
        &self,
        target: NodeId,
        addr: &str,
        frame: Vec<u8>,
        deadline: Duration,
    ) -> Result<Vec<u8>, TransportError> {
        if !matches!(decode_request(&frame), Ok(RpcRequest::Forward(_))) {
            return self.inner.call(target, addr, frame, deadline).await;
        }
        let (target, lose, garble) = {
            let mut f = self.faults();
            f.calls += 1;
            if f.refuse > 0 {
                f.refuse -= 1;
                return Err(TransportError::Unreachable {
                    node: target,
                    reason: "refused by the test".into(),
                });
            }
            f.delivered += 1;
            let to = f.misroute_to.take().unwrap_or(target);
            (to, f.lose_replies, f.garble_replies)
        };
        let reply = self.inner.call(target, addr, frame, deadline).await?;
        if lose {
            return Err(TransportError::Io("connection reset by the test".into()));
        }
        if garble {
            return Ok(vec![0xEE; 12]);
        }
        Ok(reply)
    }
}

/// A settled three-node cluster whose follower `f` forwards through `faults`; returns the
/// cluster, the leader and the follower.
async fn cluster_with_faulty_follower(
    config: MetaRaftConfig,
    faults: &Arc<Mutex<Faults>>,
) -> (Cluster, NodeId, NodeId) {
    let shared = Arc::clone(faults);
    let c = Cluster::with_transports(3, config, move |_, inner| FaultyTransport {
        inner,
        faults: Arc::clone(&shared),
    })
    .await;
    c.propose(add_vhost(), &[]).await;
    let leader = c.leader(&[], Duration::from_secs(5)).await;
    let follower = c
        .ids()
        .into_iter()
        .find(|&id| id != leader)
        .expect("follower");
    let ids = c.ids();
    let index = c.nodes[&leader].view().applied_index.expect("applied");
    c.converge(&ids, index).await;
    assert!(c.nodes[&follower]
        .wait_for_leader(Duration::from_secs(5), |l| l == leader)
        .await
        .is_some());
    (c, leader, follower)
}

/// The leader's applied index, and then the index a marker command lands at: their
/// difference counts the entries committed in between.
async fn entries_since(c: &Cluster, before: u64, marker: &str) -> u64 {
    let r = c.propose(declare_queue(marker), &[]).await;
    r.index - before - 1
}

fn has_queue(c: &Cluster, id: NodeId, name: &str) -> bool {
    c.nodes[&id]
        .snapshot()
        .vhost("/")
        .is_some_and(|v| v.queues.contains_key(name))
}

#[tokio::test]
async fn a_follower_forwards_to_the_leader_and_gets_its_response_and_refusal() {
    bounded(async {
        let faults = Arc::new(Mutex::new(Faults::default()));
        let (c, leader, follower) = cluster_with_faulty_follower(fast_config(), &faults).await;
        let r = c.nodes[&follower]
            .propose(declare_queue("q"))
            .await
            .expect("forwarded");
        assert!(r.outcome.as_ref().is_ok_and(|s| s.created), "{r:?}");
        // The follower applies it too, at the index the leader reported.
        assert!(
            c.nodes[&follower]
                .wait_applied(r.index, Duration::from_secs(5))
                .await
        );
        assert!(has_queue(&c, follower, "q"));

        let on_follower = c.nodes[&follower]
            .propose(bind("missing"))
            .await
            .expect("ok");
        let on_leader = c.nodes[&leader].propose(bind("missing")).await.expect("ok");
        assert_eq!(on_follower.outcome, on_leader.outcome);
        assert_eq!(on_follower.outcome.expect_err("refused").code, 404);
        assert_eq!(faults.lock().expect("faults").delivered, 2);
    })
    .await;
}

/// A routing change proposed on a follower comes back with the nodes the leader served
/// reads to within the window (`cluster::read_log`): none known for sure in the leader's
/// first window, then exactly the recent readers.
#[tokio::test]
async fn a_routing_proposal_names_the_nodes_the_leader_served_reads_to_within_the_window() {
    bounded(async {
        let c = Cluster::new(3, fast_config()).await;
        let leader = c.leader(&[], Duration::from_secs(10)).await;
        let mut others = c.ids().into_iter().filter(|&n| n != leader);
        let (proposer, reader) = (others.next().expect("one"), others.next().expect("two"));
        let window = Duration::from_millis(300);
        let routing = |name: &str| {
            let (node, command) = (c.nodes[&proposer].clone(), declare_queue(name));
            async move {
                node.propose_routing(command, window)
                    .await
                    .expect("committed")
            }
        };
        c.nodes[&reader]
            .read_index(Duration::from_secs(2))
            .await
            .expect("read index");
        let (_, readers) = routing("first").await;
        assert_eq!(readers, Readers::Unknown, "the leader's first window");

        // A window later: the reader read again just before, the proposer never did.
        tokio::time::sleep(window + Duration::from_millis(50)).await;
        c.nodes[&reader]
            .read_index(Duration::from_secs(2))
            .await
            .expect("read index");
        let (_, readers) = routing("second").await;
        assert_eq!(readers, Readers::Known([reader].into()));

        tokio::time::sleep(window + Duration::from_millis(50)).await;
        let (_, readers) = routing("third").await;
        assert_eq!(
            readers,
            Readers::Known([].into()),
            "no read within the window"
        );
    })
    .await;
}

#[tokio::test]
async fn a_forward_that_never_reached_a_leader_is_retried_and_applied_once() {
    bounded(async {
        let faults = Arc::new(Mutex::new(Faults::default()));
        let (c, leader, follower) = cluster_with_faulty_follower(fast_config(), &faults).await;
        let before = c.nodes[&leader].view().applied_index.expect("applied");
        faults.lock().expect("faults").refuse = 3;
        let r = c.nodes[&follower]
            .propose(declare_queue("retried"))
            .await
            .expect("applied after the refusals");
        assert!(r.outcome.as_ref().is_ok_and(|s| s.created), "{r:?}");
        let counts = {
            let f = faults.lock().expect("faults");
            (f.calls, f.delivered)
        };
        assert_eq!(counts, (4, 1));
        assert_eq!(entries_since(&c, before, "marker").await, 1, "applied once");
    })
    .await;
}

#[tokio::test]
async fn a_forward_sent_to_a_follower_follows_its_hint_to_the_leader() {
    bounded(async {
        let faults = Arc::new(Mutex::new(Faults::default()));
        let (c, leader, follower) = cluster_with_faulty_follower(fast_config(), &faults).await;
        let other = c
            .ids()
            .into_iter()
            .find(|&id| id != leader && id != follower)
            .expect("the other follower");
        let before = c.nodes[&leader].view().applied_index.expect("applied");
        faults.lock().expect("faults").misroute_to = Some(other);
        let r = c.nodes[&follower]
            .propose(declare_queue("hinted"))
            .await
            .expect("applied at the hinted leader");
        assert!(r.outcome.is_ok(), "{r:?}");
        // The other follower refused without proposing or forwarding further.
        assert_eq!(faults.lock().expect("faults").delivered, 2);
        assert_eq!(entries_since(&c, before, "marker").await, 1, "applied once");
    })
    .await;
}

#[tokio::test]
async fn a_forward_whose_reply_is_lost_is_reported_unknown_and_never_resent() {
    bounded(async {
        let faults = Arc::new(Mutex::new(Faults::default()));
        let (c, leader, follower) = cluster_with_faulty_follower(fast_config(), &faults).await;
        for (lose, garble, name) in [(true, false, "lost"), (false, true, "garbled")] {
            let before = c.nodes[&leader].view().applied_index.expect("applied");
            {
                let mut f = faults.lock().expect("faults");
                (f.lose_replies, f.garble_replies, f.delivered) = (lose, garble, 0);
            }
            let e = c.nodes[&follower]
                .propose(declare_queue(name))
                .await
                .expect_err("the reply never arrives");
            assert!(
                matches!(&e, ProposeError::Unknown { leader: l, .. } if *l == leader),
                "{e:?}"
            );
            assert!(e.outcome_unknown());
            let delivered = {
                let mut f = faults.lock().expect("faults");
                (f.lose_replies, f.garble_replies) = (false, false);
                f.delivered
            };
            assert_eq!(delivered, 1, "sent once, not retried");
            // The leader did commit it: exactly one entry, visible everywhere.
            assert_eq!(
                entries_since(&c, before, &format!("{name}-marker")).await,
                1
            );
            let ids = c.ids();
            let index = c.nodes[&leader].view().applied_index.expect("applied");
            c.converge(&ids, index).await;
            assert!(ids.iter().all(|&id| has_queue(&c, id, name)));
        }
    })
    .await;
}

#[tokio::test]
async fn an_isolated_follower_reports_no_leader_within_its_deadline() {
    bounded(async {
        let config = MetaRaftConfig {
            propose_timeout: Duration::from_millis(1200),
            ..fast_config()
        };
        let c = Cluster::new(3, config).await;
        c.propose(add_vhost(), &[]).await;
        let leader = c.leader(&[], Duration::from_secs(5)).await;
        let follower = c
            .ids()
            .into_iter()
            .find(|&id| id != leader)
            .expect("follower");
        c.router.isolate(follower);
        let started = tokio::time::Instant::now();
        let e = c.nodes[&follower]
            .propose(declare_queue("stranded"))
            .await
            .expect_err("no leader reachable");
        let took = started.elapsed();
        assert!(matches!(e, ProposeError::NoLeader { .. }), "{e:?}");
        assert!(!e.outcome_unknown());
        assert!(
            took >= Duration::from_millis(1100) && took < Duration::from_millis(1700),
            "gave up after {took:?}"
        );

        c.router.heal();
        let r = c.propose(declare_queue("after"), &[]).await;
        let ids = c.ids();
        c.converge(&ids, r.index).await;
        for id in ids {
            assert!(!has_queue(&c, id, "stranded"), "node {id}");
            assert!(has_queue(&c, id, "after"), "node {id}");
        }
    })
    .await;
}
