//! When to call a Raft election early: the leader's process is gone, so waiting for
//! openraft's own election timer only adds to the failover.
//!
//! A follower elects itself after its leader lease plus its election timeout of silence
//! (openraft 0.9: `election_timeout_max` plus a draw from `[min, max)`), and a voter refuses
//! every vote until its own lease on the leader has run out. When the failure detector
//! knows the leader's process has exited (its link address refused a connection:
//! [`super::detector`]), nothing is gained by the second wait. So one follower calls the
//! election as soon as the lease has run out at the voters, and the leader's node is
//! recorded down, and its mirrored queues promoted, about a lease after the kill instead of
//! up to two.
//!
//! Calling an election is always safe in Raft (votes decide; a call can only cost a term);
//! the rules keep it from disturbing a working group:
//! - only against a leader whose address refused a connection and that has not been heard
//!   from since;
//! - only from the lowest voter that is neither that leader nor down, so two followers do
//!   not split the vote;
//! - first when the lease has run out after the leader was last heard here, plus a slack
//!   (another voter may have heard it a little later); then again, at most
//!   [`MAX_CALLS`] times in all, while no new leader is known (a call refused by a voter
//!   whose lease ran a little longer); after that openraft's own timer goes on.

use std::collections::BTreeSet;

use crate::meta::state::NodeId;

/// Calls against one lost leader, at most.
pub const MAX_CALLS: u32 = 3;

/// What [`ElectionCaller::handle_tick`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// Nothing to do.
    None,
    /// Call an election now.
    Now,
    /// Look again at this time (ms): a call may be due then.
    At(u64),
}

/// A leader whose process is gone, and the calls made against it.
#[derive(Debug, Clone, Copy)]
struct Gone {
    leader: NodeId,
    calls: u32,
    last_call_ms: Option<u64>,
}

/// The early-election rule's state on one node.
#[derive(Debug, Clone)]
pub struct ElectionCaller {
    me: NodeId,
    lease_ms: u64,
    slack_ms: u64,
    retry_ms: u64,
    gone: Option<Gone>,
}

impl ElectionCaller {
    /// For node `me` in a group whose voters hold a lease of `lease_ms` (openraft's
    /// `election_timeout_max`) and whose leader sends heartbeats every `heartbeat_ms`.
    pub fn new(me: NodeId, lease_ms: u64, heartbeat_ms: u64) -> ElectionCaller {
        ElectionCaller {
            me,
            lease_ms,
            slack_ms: (heartbeat_ms / 2).max(1),
            retry_ms: (heartbeat_ms * 2).max(1),
            gone: None,
        }
    }

    /// One look: `leader` as this node's Raft member knows it (`None` during an
    /// election), the group's `voters`, the nodes the detector holds `down`, and, as for
    /// [`super::Detector::handle_tick`], when each node was last heard and whether its
    /// address refused a connection since.
    pub fn handle_tick(
        &mut self,
        now_ms: u64,
        leader: Option<NodeId>,
        voters: &BTreeSet<NodeId>,
        down: &BTreeSet<NodeId>,
        last_heard: impl Fn(NodeId) -> Option<u64>,
        refused: impl Fn(NodeId) -> bool,
    ) -> Call {
        match leader {
            Some(l) if l == self.me || !refused(l) => {
                self.gone = None;
                return Call::None;
            }
            Some(l) if self.gone.map(|g| g.leader) != Some(l) => {
                self.gone = Some(Gone {
                    leader: l,
                    calls: 0,
                    last_call_ms: None,
                });
            }
            _ => {}
        }
        let Some(gone) = self.gone.as_mut() else {
            return Call::None;
        };
        if !refused(gone.leader) {
            // Heard again: it restarted, or it was never gone.
            self.gone = None;
            return Call::None;
        }
        if gone.calls >= MAX_CALLS {
            return Call::None;
        }
        let caller = voters
            .iter()
            .copied()
            .filter(|&v| v != gone.leader && !down.contains(&v))
            .min();
        if caller != Some(self.me) {
            return Call::None;
        }
        let due = match gone.last_call_ms {
            None => last_heard(gone.leader).unwrap_or(now_ms) + self.lease_ms + self.slack_ms,
            Some(t) => t + self.retry_ms,
        };
        if now_ms < due {
            return Call::At(due);
        }
        gone.calls += 1;
        gone.last_call_ms = Some(now_ms);
        Call::Now
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LEASE: u64 = 300;
    const HEARTBEAT: u64 = 50;

    fn voters() -> BTreeSet<NodeId> {
        BTreeSet::from([1, 2, 3])
    }

    /// Node `me` looks at `now` with leader `leader`, node 1 last heard at 1000 and
    /// refused when `refused1`; nothing else down but node 1 when refused.
    fn look(c: &mut ElectionCaller, now: u64, leader: Option<NodeId>, refused1: bool) -> Call {
        let down = if refused1 {
            BTreeSet::from([1])
        } else {
            BTreeSet::new()
        };
        c.handle_tick(
            now,
            leader,
            &voters(),
            &down,
            |n| (n == 1).then_some(1000),
            |n| n == 1 && refused1,
        )
    }

    #[test]
    fn the_lowest_follower_calls_once_the_lease_has_run_out() {
        let mut c = ElectionCaller::new(2, LEASE, HEARTBEAT);
        // Killed at about 1000: due at 1000 + 300 + 25.
        assert_eq!(look(&mut c, 1010, Some(1), true), Call::At(1325));
        assert_eq!(look(&mut c, 1324, Some(1), true), Call::At(1325));
        assert_eq!(look(&mut c, 1325, Some(1), true), Call::Now);
        // Our election is under way: no leader known. Called again only after a retry.
        assert_eq!(look(&mut c, 1330, None, true), Call::At(1425));
        assert_eq!(look(&mut c, 1425, None, true), Call::Now);
        assert_eq!(look(&mut c, 1525, None, true), Call::Now);
        // Three calls in all; openraft's timer goes on from there.
        assert_eq!(look(&mut c, 1700, None, true), Call::None);
        // A new leader ends it.
        assert_eq!(look(&mut c, 1800, Some(2), true), Call::None);
        assert_eq!(look(&mut c, 1900, None, true), Call::None);
    }

    #[test]
    fn another_follower_leaves_the_call_to_the_lowest() {
        let mut c = ElectionCaller::new(3, LEASE, HEARTBEAT);
        assert_eq!(look(&mut c, 1400, Some(1), true), Call::None);
        // Unless the lowest is down too.
        let down = BTreeSet::from([1, 2]);
        let call = c.handle_tick(1400, Some(1), &voters(), &down, |_| Some(1000), |n| n == 1);
        assert_eq!(call, Call::Now);
    }

    #[test]
    fn a_leader_that_answers_is_never_called_against() {
        let mut c = ElectionCaller::new(2, LEASE, HEARTBEAT);
        assert_eq!(look(&mut c, 5000, Some(1), false), Call::None);
        // Refused, then heard again (a quick restart) before the call was due.
        assert_eq!(look(&mut c, 1100, Some(1), true), Call::At(1325));
        assert_eq!(look(&mut c, 1200, Some(1), false), Call::None);
        assert_eq!(look(&mut c, 1400, None, false), Call::None);
        // The leader itself never calls.
        let mut c = ElectionCaller::new(1, LEASE, HEARTBEAT);
        assert_eq!(look(&mut c, 5000, Some(1), true), Call::None);
    }

    #[test]
    fn a_learner_never_calls() {
        let mut c = ElectionCaller::new(4, LEASE, HEARTBEAT);
        let down = BTreeSet::from([1, 2, 3]);
        let call = c.handle_tick(5000, Some(1), &voters(), &down, |_| Some(0), |n| n == 1);
        assert_eq!(call, Call::None);
    }

    #[test]
    fn no_call_without_a_lost_leader_seen_first() {
        // An election this node did not start (no leader known, nothing refused).
        let mut c = ElectionCaller::new(2, LEASE, HEARTBEAT);
        assert_eq!(look(&mut c, 5000, None, true), Call::None);
    }

    proptest! {
        /// Whatever the history: a call is made only by a voter other than the leader, only
        /// while the lost leader's address refuses, never before its lease has run out
        /// here, never more than MAX_CALLS times per lost leader, and never by two nodes
        /// that agree on who is down.
        #[test]
        fn calls_keep_the_rules(
            steps in prop::collection::vec((1u64..200, 0u8..4, any::<bool>(), 0u64..600), 1..80),
        ) {
            let mut callers: Vec<ElectionCaller> =
                (1..=3).map(|me| ElectionCaller::new(me, LEASE, HEARTBEAT)).collect();
            let mut now = 1000;
            let mut calls_since_leader = 0u32;
            let mut last_leader = None;
            for (dt, leader, refused, age) in steps {
                now += dt;
                let leader = (leader > 0).then_some(NodeId::from(leader));
                // A new leader, or the lost one heard again, ends an outage.
                if (leader.is_some() && leader != last_leader) || !refused {
                    calls_since_leader = 0;
                }
                if leader.is_some() {
                    last_leader = leader;
                }
                let heard = now.saturating_sub(age);
                let refused_node = last_leader.filter(|_| refused);
                let down: BTreeSet<NodeId> = refused_node.into_iter().collect();
                let mut callers_now = 0;
                for c in callers.iter_mut() {
                    let me = c.me;
                    let call = c.handle_tick(
                        now,
                        leader,
                        &voters(),
                        &down,
                        |_| Some(heard),
                        |n| Some(n) == refused_node,
                    );
                    if call == Call::Now {
                        callers_now += 1;
                        calls_since_leader += 1;
                        prop_assert!(refused_node.is_some());
                        prop_assert_ne!(Some(me), refused_node);
                        if calls_since_leader == 1 {
                            prop_assert!(now >= heard + LEASE);
                        }
                    }
                }
                prop_assert!(callers_now <= 1, "two callers at once");
                prop_assert!(calls_since_leader <= MAX_CALLS);
            }
        }
    }
}
