//! The leader's read fence: from the moment the failure detector decides to record a node
//! down until that `NodeDown` is applied, the leader refuses that node's read-index
//! requests.
//!
//! Why: a master delivers only under a lease, renewed by a quorum read (`docs/mirroring.md`,
//! *Two masters never deliver at once*). The detector decides at one tick and the
//! `NodeDown` commits later (a quorum check, then the proposal). A read from the node that
//! reached the leader in between was served from a state without `NodeDown` and renewed
//! the node's lease past the commit, so a promoted mirror and the old master both
//! delivered (bug 21, simulation seeds 3452 and 4485). Refusing those reads makes the
//! decision and the commit one step as far as leases go.
//!
//! Rules:
//! - a node the detector offers to record down ([`ReadFence::handle_tick`]'s `deciding`)
//!   is fenced in the current term;
//! - once a `NodeDown` was proposed for it ([`ReadFence::handle_proposed`]), the fence
//!   holds until a `NodeDown` for it is applied here ([`ReadFence::handle_recorded`]),
//!   whatever the proposal's outcome: a timed-out proposal may still commit, and a read
//!   served before it did would renew a lease across it. In the term it was proposed in,
//!   the entry commits unless the leadership is lost;
//! - a fence never proposed for ends when the detector stops offering the node (heard
//!   again): nothing can commit from it;
//! - a new term ends every fence: a new leader's read index covers its first entry, so
//!   its reads include any `NodeDown` of an older term that ever commits.
//!
//! A read served once the `NodeDown` is applied has a read index at or past it, so the
//! node sees itself down and renews nothing.

use std::collections::BTreeMap;

use crate::meta::state::NodeId;

/// One fenced node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fence {
    /// The leader's term when it was fenced.
    term: u64,
    /// A `NodeDown` was proposed: the fence holds until one is applied.
    proposed: bool,
}

/// The fenced nodes on one (leader) node.
#[derive(Debug, Clone, Default)]
pub struct ReadFence {
    fenced: BTreeMap<NodeId, Fence>,
}

impl ReadFence {
    /// An empty fence.
    pub fn new() -> ReadFence {
        ReadFence::default()
    }

    /// One detector tick: `deciding` are the nodes the detector offers to record down now
    /// (empty off the leader), `term` the current term.
    pub fn handle_tick(&mut self, term: u64, deciding: &[NodeId]) {
        self.fenced
            .retain(|node, f| f.term == term && (f.proposed || deciding.contains(node)));
        for &node in deciding {
            self.fenced.entry(node).or_insert(Fence {
                term,
                proposed: false,
            });
        }
    }

    /// A `NodeDown` for `node` is about to be proposed. Ignored for a node not fenced.
    pub fn handle_proposed(&mut self, node: NodeId) {
        if let Some(f) = self.fenced.get_mut(&node) {
            f.proposed = true;
        }
    }

    /// A `NodeDown` for `node` was applied on this node.
    pub fn handle_recorded(&mut self, node: NodeId) {
        self.fenced.remove(&node);
    }

    /// Whether a read-index request from `origin` must be refused by a leader in `term`.
    pub fn refuses(&self, origin: NodeId, term: u64) -> bool {
        self.fenced.get(&origin).is_some_and(|f| f.term == term)
    }

    /// The fenced nodes, for logs and tests.
    pub fn fenced(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.fenced.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_node_offered_for_recording_is_refused_in_that_term_only() {
        let mut f = ReadFence::new();
        f.handle_tick(3, &[2]);
        assert!(f.refuses(2, 3));
        assert!(!f.refuses(1, 3));
        assert!(!f.refuses(2, 4), "another term's leader does not refuse");
    }

    #[test]
    fn a_fence_never_proposed_for_ends_when_the_node_is_no_longer_offered() {
        let mut f = ReadFence::new();
        f.handle_tick(3, &[2]);
        f.handle_tick(3, &[]);
        assert!(!f.refuses(2, 3));
    }

    #[test]
    fn a_proposed_fence_holds_until_the_node_down_is_applied() {
        let mut f = ReadFence::new();
        f.handle_tick(3, &[2]);
        f.handle_proposed(2);
        // The proposal timed out and the node was heard again: the entry may still commit.
        f.handle_tick(3, &[]);
        f.handle_tick(3, &[]);
        assert!(f.refuses(2, 3));
        f.handle_recorded(2);
        assert!(!f.refuses(2, 3));
    }

    #[test]
    fn a_new_term_ends_every_fence() {
        let mut f = ReadFence::new();
        f.handle_tick(3, &[2, 4]);
        f.handle_proposed(2);
        f.handle_tick(4, &[]);
        assert_eq!(f.fenced().count(), 0);
    }

    #[test]
    fn a_proposal_or_record_for_a_node_not_fenced_changes_nothing() {
        let mut f = ReadFence::new();
        f.handle_proposed(2);
        f.handle_recorded(5);
        assert!(!f.refuses(2, 3));
        assert_eq!(f.fenced().count(), 0);
    }

    #[derive(Debug, Clone)]
    enum Step {
        Tick { new_term: bool, offer: bool },
        Propose,
        Record,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (any::<bool>(), any::<bool>())
                .prop_map(|(new_term, offer)| Step::Tick { new_term, offer }),
            Just(Step::Propose),
            Just(Step::Record),
        ]
    }

    proptest! {
        /// The safety rule against a model: node 2 is refused in term `t` exactly while
        /// it is offered, or a `NodeDown` proposed for it in `t` has not been applied.
        #[test]
        fn refusals_follow_the_model(steps in proptest::collection::vec(step(), 1..80)) {
            let mut f = ReadFence::new();
            let mut term = 1u64;
            let (mut offered, mut pending) = (false, false);
            for s in steps {
                match s {
                    Step::Tick { new_term, offer } => {
                        if new_term {
                            term += 1;
                            pending = false;
                        }
                        offered = offer;
                        f.handle_tick(term, if offer { &[2] } else { &[] });
                    }
                    Step::Propose => {
                        if offered {
                            pending = true;
                        }
                        f.handle_proposed(2);
                    }
                    Step::Record => {
                        f.handle_recorded(2);
                        offered = false;
                        pending = false;
                    }
                }
                prop_assert_eq!(f.refuses(2, term), offered || pending);
                prop_assert!(!f.refuses(2, term + 1));
            }
        }
    }
}
