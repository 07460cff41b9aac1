//! The failure detector: from when each peer was last heard and whether its link address
//! refused a connection, which registered nodes are down now, which just went down, and
//! which the Raft leader should record down (`Command::NodeDown`, once per outage).
//!
//! One implementation for the node (`runtime::cluster::watch_nodes`) and every simulation
//! scenario: they differ only in where "last heard" comes from (the node links' frames, the
//! simulated transport's). Proposing, and checking first that a quorum still confirms the
//! leadership (a leader cut off from the others believes it leads and sees everyone
//! silent), is the driver's part.
//!
//! Rules (`docs/clustering.md`, *Node down*; the lease argument in `docs/mirroring.md`
//! depends on them):
//! - a peer not heard from for `peer_timeout` is down, but only once this node has watched
//!   for a full timeout (links need that long to come up) — counted again from when it
//!   becomes leader, so a new leader never records a node down on silence it did not
//!   watch for a whole timeout;
//! - a peer heard from before whose link address refused a connection (its process is
//!   gone) is down at once: `refused` says so, and the driver answers it only for peers
//!   heard from before and with no live link.

use std::collections::BTreeSet;

use crate::meta::state::NodeId;

/// The detector's state on one node.
#[derive(Debug, Clone)]
pub struct Detector {
    me: NodeId,
    peer_timeout_ms: u64,
    /// Since when silence counts (this node's start, or its leadership's).
    watching_since_ms: u64,
    leader: bool,
    down: BTreeSet<NodeId>,
    /// Nodes reported newly down and not yet newly up. A node can leave `down` without
    /// being heard (a new leadership starts the watch again); it is reported up only once
    /// it is heard, so every `newly_down` is followed by one `newly_up` when it comes back.
    told_down: BTreeSet<NodeId>,
    /// Nodes the leader recorded down in this outage.
    declared: BTreeSet<NodeId>,
}

/// What one tick decided.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Every node down now (the broker answers for their queues accordingly).
    pub down: BTreeSet<NodeId>,
    /// Nodes down now that were not reported down since they were last up (the relay fails
    /// what it queued for them, their consumers are cancelled or wait for a new master).
    pub newly_down: Vec<NodeId>,
    /// Nodes reported down that are heard again (the relay tells them what it gave up
    /// there meanwhile); each newly-down node is reported up once, when it is heard.
    pub newly_up: Vec<NodeId>,
    /// On the leader: nodes to record down, in order; the driver reports each that
    /// committed with [`Detector::handle_declared`].
    pub to_declare: Vec<NodeId>,
}

impl Detector {
    /// A detector for node `me`, started at `now_ms`.
    pub fn new(me: NodeId, peer_timeout_ms: u64, now_ms: u64) -> Detector {
        Detector {
            me,
            peer_timeout_ms,
            watching_since_ms: now_ms,
            leader: false,
            down: BTreeSet::new(),
            told_down: BTreeSet::new(),
            declared: BTreeSet::new(),
        }
    }

    /// One look at the peers: `nodes` are the registered nodes, `last_heard(n)` when a
    /// frame from `n` last arrived (ms, same clock as `now_ms`; `None`: never), `refused(n)`
    /// whether its address refused a connection since.
    pub fn handle_tick(
        &mut self,
        now_ms: u64,
        leader: bool,
        nodes: impl IntoIterator<Item = NodeId>,
        last_heard: impl Fn(NodeId) -> Option<u64>,
        refused: impl Fn(NodeId) -> bool,
    ) -> Verdict {
        if leader && !self.leader {
            self.watching_since_ms = now_ms;
        }
        self.leader = leader;
        let settled = now_ms.saturating_sub(self.watching_since_ms) >= self.peer_timeout_ms;
        let timeout = self.peer_timeout_ms;
        let alive = |n: NodeId| last_heard(n).is_some_and(|t| now_ms.saturating_sub(t) < timeout);
        let down: BTreeSet<NodeId> = nodes
            .into_iter()
            .filter(|&n| n != self.me && ((settled && !alive(n)) || refused(n)))
            .collect();
        let newly_down: Vec<NodeId> = down.difference(&self.told_down).copied().collect();
        let newly_up: Vec<NodeId> = self
            .told_down
            .difference(&down)
            .copied()
            .filter(|&n| alive(n))
            .collect();
        self.told_down.extend(newly_down.iter().copied());
        for n in &newly_up {
            self.told_down.remove(n);
        }
        self.declared.retain(|n| down.contains(n));
        let to_declare = if leader {
            down.difference(&self.declared).copied().collect()
        } else {
            Vec::new()
        };
        self.down = down.clone();
        Verdict {
            down,
            newly_down,
            newly_up,
            to_declare,
        }
    }

    /// `node`'s `NodeDown` committed: not proposed again until it has been up again.
    pub fn handle_declared(&mut self, node: NodeId) {
        self.declared.insert(node);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T: u64 = 1000;

    fn tick(
        d: &mut Detector,
        now: u64,
        leader: bool,
        heard: &[(NodeId, u64)],
        refused: &[NodeId],
    ) -> Verdict {
        d.handle_tick(
            now,
            leader,
            [1, 2, 3],
            |n| heard.iter().find(|(m, _)| *m == n).map(|(_, t)| *t),
            |n| refused.contains(&n),
        )
    }

    #[test]
    fn a_node_heard_again_is_newly_up_once() {
        let mut d = Detector::new(1, T, 0);
        let v = tick(&mut d, 1000, false, &[(2, 900)], &[]);
        assert_eq!(v.newly_down, [3]);
        assert!(v.newly_up.is_empty());
        let v = tick(&mut d, 1500, false, &[(2, 1400), (3, 1450)], &[]);
        assert!(v.down.is_empty());
        assert_eq!(v.newly_up, [3]);
        let v = tick(&mut d, 1700, false, &[(2, 1600), (3, 1650)], &[]);
        assert!(v.newly_up.is_empty(), "up already");
    }

    #[test]
    fn a_node_dropped_from_down_by_a_new_leadership_is_reported_up_when_heard_and_only_then() {
        // Node 2 goes silent; this node reports it down, then becomes leader: the watch
        // starts again and 2 leaves `down` unheard. It must not be reported up until it is
        // heard, and then once; nor reported down again meanwhile (seed 192 of the mirror
        // simulation: the relay heard of the outage and never of its end).
        let mut d = Detector::new(1, T, 0);
        let v = tick(&mut d, 2000, false, &[(2, 500), (3, 1900)], &[]);
        assert_eq!(v.newly_down, [2]);
        let v = tick(&mut d, 2100, true, &[(2, 500), (3, 2000)], &[]);
        assert!(v.down.is_empty(), "the new leader's watch has not settled");
        assert!(v.newly_up.is_empty(), "2 was not heard");
        let v = tick(&mut d, 3100, true, &[(2, 500), (3, 3000)], &[]);
        assert_eq!(v.down, BTreeSet::from([2]));
        assert!(v.newly_down.is_empty(), "reported down already");
        let v = tick(&mut d, 3200, true, &[(2, 3150), (3, 3100)], &[]);
        assert_eq!(v.newly_up, [2]);
        let v = tick(&mut d, 3300, true, &[(2, 3250), (3, 3200)], &[]);
        assert!(v.newly_up.is_empty(), "up already");
    }

    #[test]
    fn a_node_heard_while_a_new_leaderships_watch_settles_is_reported_up() {
        let mut d = Detector::new(1, T, 0);
        let v = tick(&mut d, 2000, false, &[(2, 500), (3, 1900)], &[]);
        assert_eq!(v.newly_down, [2]);
        let v = tick(&mut d, 2100, true, &[(2, 500), (3, 2000)], &[]);
        assert!(v.down.is_empty() && v.newly_up.is_empty());
        let v = tick(&mut d, 2200, true, &[(2, 2150), (3, 2100)], &[]);
        assert_eq!(v.newly_up, [2], "the relay must hear the outage ended");
    }

    #[test]
    fn silence_counts_only_after_a_full_timeout_of_watching() {
        let mut d = Detector::new(1, T, 0);
        // Never heard from node 3, but nobody has watched for a timeout yet.
        let v = tick(&mut d, 500, false, &[(2, 400)], &[]);
        assert!(v.down.is_empty());
        let v = tick(&mut d, 1000, false, &[(2, 900)], &[]);
        assert_eq!(v.down, BTreeSet::from([3]));
        assert_eq!(v.newly_down, [3]);
        assert!(v.newly_up.is_empty());
        assert!(v.to_declare.is_empty(), "only the leader records");
        let v = tick(&mut d, 1200, false, &[(2, 900)], &[]);
        assert!(v.newly_down.is_empty(), "down already");
        // Node 2 last heard at 900: down at 1900, not before.
        assert!(!tick(&mut d, 1899, false, &[(2, 900)], &[])
            .down
            .contains(&2));
        assert!(tick(&mut d, 1900, false, &[(2, 900)], &[])
            .down
            .contains(&2));
    }

    #[test]
    fn a_refused_connection_is_down_at_once_even_before_the_watch_settles() {
        let mut d = Detector::new(1, T, 0);
        let v = tick(&mut d, 100, true, &[(2, 90), (3, 90)], &[3]);
        assert_eq!(v.down, BTreeSet::from([3]));
        assert_eq!(v.to_declare, [3]);
    }

    #[test]
    fn a_new_leader_records_silence_only_after_watching_a_full_timeout_as_leader() {
        let mut d = Detector::new(1, T, 0);
        let heard = [(2, 100), (3, 5500)];
        let v = tick(&mut d, 5000, false, &heard, &[]);
        assert_eq!(v.down, BTreeSet::from([2]));
        // Leader from 5000: the watch starts again.
        let v = tick(&mut d, 5000, true, &heard, &[]);
        assert!(v.down.is_empty() && v.to_declare.is_empty());
        let v = tick(&mut d, 5999, true, &heard, &[]);
        assert!(v.to_declare.is_empty());
        let v = tick(&mut d, 6000, true, &heard, &[]);
        assert_eq!(v.to_declare, [2]);
    }

    #[test]
    fn the_leader_records_each_outage_once() {
        let mut d = Detector::new(1, T, 0);
        assert_eq!(
            tick(&mut d, 2000, true, &[(2, 0), (3, 1999)], &[]).to_declare,
            Vec::<u64>::new()
        );
        assert_eq!(
            tick(&mut d, 3000, true, &[(2, 0), (3, 2999)], &[]).to_declare,
            [2]
        );
        d.handle_declared(2);
        assert!(tick(&mut d, 3100, true, &[(2, 0), (3, 3100)], &[])
            .to_declare
            .is_empty());
        // Node 2 is back, then silent again: a new outage, recorded again.
        assert!(tick(&mut d, 3200, true, &[(2, 3150), (3, 3150)], &[])
            .down
            .is_empty());
        assert_eq!(
            tick(&mut d, 4200, true, &[(2, 3150), (3, 4150)], &[]).to_declare,
            [2]
        );
        // A proposal that did not commit is tried again at the next tick.
        assert_eq!(
            tick(&mut d, 4300, true, &[(2, 3150), (3, 4250)], &[]).to_declare,
            [2]
        );
    }

    proptest! {
        /// Whatever the history: this node is never down; a node heard from within the
        /// timeout and not refused is never down; only the leader records; nothing is
        /// recorded that is not down; silence is never held against anyone before a full
        /// timeout of watching (since the start or the last leadership).
        #[test]
        fn verdicts_keep_the_rules(
            steps in prop::collection::vec((0u64..700, any::<bool>(), 0u64..3000, 0u64..3000, any::<bool>()), 1..60),
        ) {
            let mut d = Detector::new(1, T, 0);
            let mut now = 0;
            let mut since = 0;
            let mut was_leader = false;
            for (dt, leader, age2, age3, refuse3) in steps {
                now += dt;
                if leader && !was_leader {
                    since = now;
                }
                was_leader = leader;
                let heard = [(2, now.saturating_sub(age2)), (3, now.saturating_sub(age3))];
                let refused: &[NodeId] = if refuse3 { &[3] } else { &[] };
                let v = tick(&mut d, now, leader, &heard, refused);
                prop_assert!(!v.down.contains(&1));
                prop_assert!(age2 >= T || !v.down.contains(&2));
                prop_assert!(age3 >= T || refuse3 || !v.down.contains(&3));
                if now - since < T {
                    prop_assert!(!v.down.contains(&2), "silence before a full watch");
                }
                prop_assert!(leader || v.to_declare.is_empty());
                prop_assert!(v.to_declare.iter().all(|n| v.down.contains(n)));
            }
        }
    }
}
