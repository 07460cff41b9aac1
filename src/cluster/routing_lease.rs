//! The routing lease: a node of a cluster routes publishes only while it knows its metadata
//! is recent (`docs/clustering.md`, *The routing lease*).
//!
//! Why: a routing change (a queue deleted and declared again, a binding) is answered once
//! every live node follows it, or once the commit timeout ends. A node whose log stayed
//! behind past that (cut off one way, caught in an election) routed by what it had: into a
//! deleted queue it mastered alone, whose confirms it gave on its own disk and whose
//! messages went with the delete once it caught up. A client that learned of the re-declare
//! elsewhere lost confirmed messages that way.
//!
//! Rules:
//! - the node renews its lease with a quorum read: the leader's read index, then this
//!   node's broker following that far. A read that began at `b` and succeeded makes the
//!   lease run to `b + lease_ms`: the read covers every entry committed before it began;
//! - a node with no lease, or a lapsed one, routes nothing (its publishes are nacked);
//! - a routing change is answered once every live node follows it or [`lapse_after_ms`]
//!   has passed since it committed: by then a node that has not followed holds no lease
//!   from before the change, and any later read would have made it follow first.
//!
//! Only clock rates matter, not agreement between clocks: each node measures its own lease
//! and the committing node its own wait, on clocks whose rates may differ by a factor of
//! 2.5 (the simulation runs nodes' clocks at 0.6 to 1.4 times its own, up to 2.34 apart;
//! real clocks differ by parts per million).

use crate::time::Instant;

/// How soon a read that failed is tried again.
pub const RETRY_MS: u64 = 100;

/// How much older than the moment it is routed a publish's `now` may be (the connection
/// reads the clock once per read of its socket, or per turn of its loop).
pub const ROUTE_SLACK_MS: u64 = 100;

/// How long after a routing change committed a node that has not followed it may still
/// route by what it had, on the committing node's clock: the lease on a clock up to 2.5
/// times slower, and [`ROUTE_SLACK_MS`].
pub const fn lapse_after_ms(lease_ms: u64) -> u64 {
    lease_ms * 5 / 2 + ROUTE_SLACK_MS
}

/// What the runtime does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// A quorum read that began at `began`: report its outcome with
    /// [`RoutingLease::handle_read`]; give up after `within_ms` (a later success renews
    /// nothing it could use).
    Read {
        /// When it began.
        began: Instant,
        /// How long it may take.
        within_ms: u64,
    },
}

/// One node's routing lease.
#[derive(Debug, Clone)]
pub struct RoutingLease {
    lease_ms: u64,
    renew_ms: u64,
    until: Option<Instant>,
    reading: Option<Instant>,
    next_read: Instant,
}

impl RoutingLease {
    /// A node with no lease yet, which renews every sixth of `lease_ms`: five renewals may
    /// fail (an election) before it lapses.
    pub fn new(lease_ms: u64) -> RoutingLease {
        RoutingLease {
            lease_ms,
            renew_ms: (lease_ms / 6).max(1),
            until: None,
            reading: None,
            next_read: Instant::from_millis(0),
        }
    }

    /// The next read, when one is due and none is under way.
    pub fn poll_action(&mut self, now: Instant) -> Option<Action> {
        if self.reading.is_some() || now < self.next_read {
            return None;
        }
        self.reading = Some(now);
        self.next_read = now.plus_millis(self.renew_ms);
        Some(Action::Read {
            began: now,
            within_ms: self.lease_ms,
        })
    }

    /// The read that began at `began` ended at `now`: `followed` when the leader answered
    /// and this node's broker followed to its index. Another read's report is ignored.
    pub fn handle_read(&mut self, now: Instant, began: Instant, followed: bool) {
        if self.reading != Some(began) {
            return;
        }
        self.reading = None;
        if followed {
            let until = began.plus_millis(self.lease_ms);
            self.until = Some(self.until.map_or(until, |u| u.max(until)));
        } else {
            self.next_read = self.next_read.min(now.plus_millis(RETRY_MS));
        }
    }

    /// Until when the node may route (exclusive); `None` before its first renewal.
    pub fn valid_until(&self) -> Option<Instant> {
        self.until
    }

    /// Whether the node may route at `now`.
    pub fn routes(&self, now: Instant) -> bool {
        self.until.is_some_and(|u| now < u)
    }

    /// When to call [`RoutingLease::poll_action`] again; `None` while a read is under way.
    pub fn deadline(&self) -> Option<Instant> {
        self.reading.is_none().then_some(self.next_read)
    }
}

#[cfg(test)]
mod tests;
