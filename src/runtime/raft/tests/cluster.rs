//! Three-node clusters in one process: leader loss, partitions, restarts from disk,
//! snapshot catch-up and refused commands. Every test runs under a deadline.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::harness::{add_vhost, bind, bounded, declare_queue, fast_config, Cluster, TempDir, DIR};
use crate::runtime::file_disk::FileDisk;
use crate::runtime::raft::{MetaRaft, MetaRaftConfig, ProposeError, Router};
use crate::store::Disk;

fn queue_count(c: &Cluster, id: u64) -> usize {
    c.nodes[&id]
        .snapshot()
        .vhost("/")
        .map_or(0, |v| v.queues.len())
}

#[tokio::test]
async fn leader_loss_elects_a_new_leader_and_the_old_one_catches_up_from_disk() {
    bounded(async {
        let mut c = Cluster::new(3, fast_config()).await;
        let old = c.leader(&[], Duration::from_secs(5)).await;
        c.propose(add_vhost(), &[]).await;
        for i in 0..10 {
            let r = c.propose(declare_queue(&format!("a{i}")), &[]).await;
            assert!(r.outcome.is_ok(), "{r:?}");
        }

        c.kill(old).await;
        let started = tokio::time::Instant::now();
        let new = c.leader(&[], Duration::from_secs(5)).await;
        assert_ne!(new, old);
        assert!(started.elapsed() < Duration::from_secs(5));
        let mut last = 0;
        for i in 0..10 {
            last = c.propose(declare_queue(&format!("b{i}")), &[]).await.index;
        }
        let survivors = c.ids();
        c.converge(&survivors, last).await;

        c.start(old).await;
        let all = c.ids();
        let view = c.converge(&all, last).await;
        assert_eq!(view.state.vhost("/").map(|v| v.queues.len()), Some(20));
    })
    .await;
}

#[tokio::test]
async fn an_isolated_leader_commits_nothing_and_the_majority_moves_on() {
    bounded(async {
        let c = Cluster::new(3, fast_config()).await;
        let old = c.leader(&[], Duration::from_secs(5)).await;
        c.propose(add_vhost(), &[]).await;
        for i in 0..5 {
            c.propose(declare_queue(&format!("a{i}")), &[]).await;
        }

        c.router.isolate(old);
        let stranded = c.nodes[&old].clone();
        let lost = tokio::spawn(async move { stranded.propose(declare_queue("lost")).await });
        let new = c.leader(&[old], Duration::from_secs(5)).await;
        assert_ne!(new, old);
        let mut last = 0;
        for i in 0..5 {
            last = c
                .propose(declare_queue(&format!("b{i}")), &[old])
                .await
                .index;
            // Commands keep flowing while the old leader is still cut off.
        }
        // Reads that decide safety refuse on the stranded leader and succeed on the new one.
        let stale = c.nodes[&old].linearizable_snapshot().await;
        assert!(
            stale.is_err(),
            "a minority leader cannot serve a linearizable read"
        );
        let fresh = c.nodes[&new].linearizable_snapshot().await.expect("read");
        assert!(fresh
            .vhost("/")
            .is_some_and(|v| v.queues.contains_key("b4")));
        let follower = c
            .ids()
            .into_iter()
            .find(|&id| id != old && id != new)
            .expect("follower");
        assert!(matches!(
            c.nodes[&follower].linearizable_snapshot().await,
            Err(ProposeError::NotLeader { leader: Some(l), .. }) if l == new
        ));
        let outcome = lost.await.expect("proposal task");
        assert!(
            matches!(
                outcome,
                Err(ProposeError::Timeout(_) | ProposeError::NotLeader { .. })
            ),
            "a minority leader must not commit: {outcome:?}"
        );

        c.router.heal();
        let all = c.ids();
        let view = c.converge(&all, last).await;
        let queues = &view.state.vhost("/").expect("vhost").queues;
        assert_eq!(queues.len(), 10);
        assert!(!queues.contains_key("lost"));
        for id in all {
            assert_eq!(queue_count(&c, id), 10);
        }
    })
    .await;
}

#[tokio::test]
async fn a_node_behind_a_purged_log_catches_up_from_a_snapshot() {
    bounded(async {
        let config = MetaRaftConfig {
            snapshot_after: 5,
            logs_kept_after_snapshot: 0,
            // A few entries per segment, so purging removes files.
            segment_bytes: 512,
            ..fast_config()
        };
        let mut c = Cluster::new(3, config).await;
        let leader = c.leader(&[], Duration::from_secs(5)).await;
        c.propose(add_vhost(), &[]).await;
        let lagging = c
            .ids()
            .into_iter()
            .find(|&id| id != leader)
            .expect("a follower");
        c.kill(lagging).await;

        let mut last = 0;
        for i in 0..30 {
            c.propose(declare_queue(&format!("q{i}")), &[]).await;
            last = c.propose(bind(&format!("q{i}")), &[]).await.index;
        }
        let survivors = c.ids();
        c.converge(&survivors, last).await;
        // The leader purges once no replication reads the old entries: the stream to the dead
        // node holds them until its next failed attempt, after a backoff.
        let leader = c.leader(&[], Duration::from_secs(5)).await;
        let files = || c.disks[&leader].list(Path::new(DIR)).expect("list");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while files().contains(&"log-00000000000000000000".to_string()) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "never purged: {:?}",
                files()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(files().contains(&"snapshot".to_string()), "{:?}", files());

        c.start(lagging).await;
        let all = c.ids();
        let view = c.converge(&all, last).await;
        assert_eq!(view.state.vhost("/").map(|v| v.queues.len()), Some(30));
        let names = c.disks[&lagging].list(Path::new(DIR)).expect("list");
        assert!(
            names.contains(&"snapshot".to_string()),
            "installed and stored: {names:?}"
        );
    })
    .await;
}

#[tokio::test]
async fn a_refused_command_is_committed_everywhere_and_changes_nothing() {
    bounded(async {
        let c = Cluster::new(3, fast_config()).await;
        c.propose(add_vhost(), &[]).await;
        let index = c.propose(declare_queue("q"), &[]).await.index;
        let all = c.ids();
        let before = c.converge(&all, index).await;

        let r = c.propose(bind("missing"), &[]).await;
        let refusal = r
            .outcome
            .expect_err("binding to a missing queue is refused");
        assert_eq!(refusal.code, 404, "{refusal}");
        let after = c.converge(&all, r.index).await;
        assert_eq!(after.state, before.state);
        assert_ne!(after.digest, before.digest);
    })
    .await;
}

#[tokio::test]
async fn the_whole_cluster_restarts_from_disk_after_a_power_loss() {
    bounded(async {
        // Snapshots and purges happen along the way, so recovery starts from a snapshot plus
        // the log after it.
        let config = MetaRaftConfig {
            snapshot_after: 4,
            logs_kept_after_snapshot: 1,
            segment_bytes: 256,
            ..fast_config()
        };
        let mut c = Cluster::new(3, config).await;
        c.propose(add_vhost(), &[]).await;
        let mut last = 0;
        for i in 0..12 {
            last = c.propose(declare_queue(&format!("q{i}")), &[]).await.index;
        }
        for id in c.ids() {
            c.kill(id).await;
        }
        for id in 1..=3 {
            c.start(id).await;
        }
        let next = c.propose(declare_queue("after"), &[]).await.index;
        assert!(next > last);
        let all = c.ids();
        let view = c.converge(&all, next).await;
        assert_eq!(view.state.vhost("/").map(|v| v.queues.len()), Some(13));
    })
    .await;
}

#[tokio::test]
async fn file_disk_nodes_restart_with_their_state() {
    bounded(async {
        let dirs: Vec<TempDir> = (0..3).map(|_| TempDir::new("node")).collect();
        let router = Router::new();
        let config = fast_config();
        let start = |id: u64| {
            let disk: Arc<dyn Disk> = Arc::new(FileDisk::new());
            let dir = dirs[id as usize - 1].path.clone();
            let (router, config) = (router.clone(), config.clone());
            async move {
                let node = MetaRaft::start(id, router.transport(id), disk, &dir, &config, id)
                    .await
                    .expect("start");
                router.serve(id, node.rpc_server());
                node
            }
        };
        let mut nodes = Vec::new();
        for id in 1..=3 {
            nodes.push(start(id).await);
        }
        let members = (1..=3).map(|id| (id, format!("node-{id}"))).collect();
        nodes[0].initialize(members).await.expect("init");
        let leader = nodes[0]
            .wait_for_leader(Duration::from_secs(5), |_| true)
            .await
            .expect("leader");
        let leader = &nodes[leader as usize - 1];
        leader.propose(add_vhost()).await.expect("propose");
        let r = leader
            .propose(declare_queue("kept"))
            .await
            .expect("propose");
        for n in &nodes {
            assert!(n.wait_applied(r.index, Duration::from_secs(5)).await);
            n.shutdown().await.expect("shutdown");
            router.remove(n.id());
        }
        drop(nodes);

        // Restarted nodes re-apply their committed log before any election.
        for id in 1..=3 {
            let node = start(id).await;
            assert!(node.wait_applied(r.index, Duration::from_secs(5)).await);
            assert!(node
                .snapshot()
                .vhost("/")
                .is_some_and(|v| v.queues.contains_key("kept")));
        }
    })
    .await;
}

#[tokio::test]
async fn a_quorum_read_on_a_follower_sees_every_earlier_commit_and_an_isolated_node_gets_none() {
    bounded(async {
        let c = Cluster::new(3, fast_config()).await;
        let leader = c.leader(&[], Duration::from_secs(5)).await;
        c.propose(add_vhost(), &[]).await;
        let followers: Vec<u64> = c.ids().into_iter().filter(|&id| id != leader).collect();
        let (f, cut) = (followers[0], followers[1]);
        for i in 0..20 {
            // Committed on the leader; the follower may not have applied it yet.
            c.propose(declare_queue(&format!("q{i}")), &[]).await;
            let read = c.nodes[&f]
                .quorum_snapshot(Duration::from_secs(2))
                .await
                .expect("a follower's quorum read");
            assert!(
                read.vhost("/")
                    .is_some_and(|v| v.queues.contains_key(&format!("q{i}"))),
                "the read after q{i} was committed does not show it"
            );
        }
        // On the leader itself too.
        let read = c.nodes[&leader]
            .quorum_snapshot(Duration::from_secs(2))
            .await
            .expect("the leader's quorum read");
        assert_eq!(read.vhost("/").map(|v| v.queues.len()), Some(20));
        // A node cut off from the others gets no quorum read (a master there must stop).
        c.router.isolate(cut);
        let stranded = c.nodes[&cut]
            .quorum_snapshot(Duration::from_millis(500))
            .await;
        assert!(stranded.is_err(), "an isolated node read {stranded:?}");
        c.router.heal();
    })
    .await;
}

#[tokio::test]
async fn a_node_being_recorded_down_gets_no_quorum_read_until_its_record_is_applied() {
    bounded(async {
        let c = Cluster::new(3, fast_config()).await;
        let leader = c.leader(&[], Duration::from_secs(5)).await;
        c.propose(add_vhost(), &[]).await;
        let followers: Vec<u64> = c.ids().into_iter().filter(|&id| id != leader).collect();
        let (down, other) = (followers[0], followers[1]);
        let read = |id: u64| c.nodes[&id].quorum_snapshot(Duration::from_secs(2));

        // The detector offers `down` for recording: its lease renewals are refused from
        // then on, the others' are not.
        c.nodes[&leader].fence_reads(&[down]);
        match read(down).await {
            Err(ProposeError::NoQuorum(reason)) => {
                assert!(reason.contains("recorded down"), "{reason}")
            }
            other => panic!("a fenced node's read: {other:?}"),
        }
        assert!(read(other).await.is_ok());
        // Heard again before any proposal: the fence ends.
        c.nodes[&leader].fence_reads(&[]);
        assert!(read(down).await.is_ok());

        // Offered again and proposed: the fence holds after the detector stops offering
        // it, until the record is applied (here, at once: it committed).
        c.nodes[&leader].fence_reads(&[down]);
        assert!(
            matches!(
                c.nodes[&other].record_down(down).await,
                Err(ProposeError::NotLeader { .. })
            ),
            "a follower must not forward a record a leader's watch did not decide"
        );
        assert!(read(down).await.is_err());
        let recorded = c.nodes[&leader].record_down(down).await.expect("recorded");
        c.nodes[&leader].fence_reads(&[]);
        read(down).await.expect("a read after the record");
        assert!(
            c.nodes[&down].view().applied_index >= Some(recorded.index),
            "the read after the record does not include it"
        );
    })
    .await;
}
