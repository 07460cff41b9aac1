//! The leader's read log: which nodes it served a read index to lately, so that a routing
//! change waits only for the nodes that may still route by what they had
//! (`docs/clustering.md`, *The routing lease*).
//!
//! Why: a node routes publishes under a routing lease renewed by quorum reads
//! ([`super::routing_lease`]). A routing change is answered once every node follows it, or
//! once a node that has not followed can hold no lease from before it. The committing node
//! used to judge the second from its own failure detector: a node it had given up more than
//! a lapse ago was not waited for. But a node given up there may still hear the leader and
//! renew its lease with reads through it; with its log a moment behind, it confirmed
//! publishes it could not route yet (test
//! `a_bind_through_a_node_that_gave_another_up_waits_while_that_node_may_route_by_what_it_had`:
//! 20 of 20 confirmed and lost). Only the leader knows whom it served, so it says so with
//! each commit.
//!
//! Rules:
//! - the leader records a read index request when it arrives, before it takes the index: a
//!   read under way when an entry commits may still answer an index below it, and its
//!   reader's lease runs from before the arrival;
//! - after an entry commits, the leader names the nodes whose reads arrived within the
//!   window (`routing_lease::lapse_after_ms`, on its own clock) before now: any other node's
//!   lease has lapsed, and a read it makes from now on returns an index at or past the
//!   entry;
//! - in the first window of its term the leader cannot know what earlier leaders served
//!   ([`Readers::Unknown`]): their reads were all served before it was elected, so once a
//!   window has passed since it first saw itself lead, their leases have lapsed too;
//! - a new term starts the log afresh; the runtime reports only what it saw while leading.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::meta::state::NodeId;
use crate::time::Instant;

/// The nodes that may still route by metadata from before a commit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Readers {
    /// Any node may: the leader could not tell (new in its term, not leading any more, or
    /// not asked).
    Unknown,
    /// Only these: every other node's lease from before the commit has lapsed.
    Known(BTreeSet<NodeId>),
}

impl Readers {
    /// Whether `node` may still hold a routing lease from before the commit.
    pub fn may_hold_lease(&self, node: NodeId) -> bool {
        match self {
            Readers::Unknown => true,
            Readers::Known(nodes) => nodes.contains(&node),
        }
    }
}

/// One leader's log of the read index requests it served.
#[derive(Debug, Clone, Default)]
pub struct ReadLog {
    /// The term the log is for, and when this node first saw itself lead in it.
    term: Option<(u64, Instant)>,
    /// When each node's latest read arrived, in that term.
    arrived: BTreeMap<NodeId, Instant>,
}

impl ReadLog {
    /// An empty log.
    pub fn new() -> ReadLog {
        ReadLog::default()
    }

    /// A read index request from `origin` arrived at `now` while this node leads in `term`.
    pub fn handle_read(&mut self, term: u64, origin: NodeId, now: Instant) {
        if self.enter(term, now).is_some() {
            let at = self.arrived.entry(origin).or_insert(now);
            *at = (*at).max(now);
        }
    }

    /// The nodes that may hold a routing lease from before an entry committed by this
    /// node, leading in `term`, at or before `now`, where a lease can last `window_ms` on
    /// this node's clock.
    pub fn readers(&mut self, term: u64, now: Instant, window_ms: u64) -> Readers {
        match self.enter(term, now) {
            Some(since) if now.millis_since(since) >= window_ms => {}
            _ => return Readers::Unknown,
        }
        Readers::Known(
            self.arrived
                .iter()
                .filter(|(_, at)| now.millis_since(**at) <= window_ms)
                .map(|(node, _)| *node)
                .collect(),
        )
    }

    /// Moves the log to `term` (a later one starts afresh) and says since when this node
    /// has seen itself lead in it; `None` for an earlier term, whose reports are stale.
    fn enter(&mut self, term: u64, now: Instant) -> Option<Instant> {
        match self.term {
            Some((t, since)) if t == term => Some(since),
            Some((t, _)) if t > term => None,
            _ => {
                self.term = Some((term, now));
                self.arrived.clear();
                Some(now)
            }
        }
    }
}

#[cfg(test)]
mod tests;
