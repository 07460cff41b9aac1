//! The master's lease and a restarted master's hand-over, as rules over the metadata
//! (`docs/mirroring.md`, *The master's lease*). The runtime (`runtime::mirror_host`) reads
//! the metadata (through a quorum read, for the lease) and carries out what these decide.
//!
//! - **The lease.** A master serves (delivers, answers gets) only until its lease runs out.
//!   A quorum read that shows the queue still homed on its node, under the incarnation it
//!   ships, with its GM member alive in the queue's group, renews it for `lease_ms` from
//!   when the read *began*: the read proves the metadata as of then at the latest, and the
//!   lease is shorter than the failure detector's timeout, so it runs out before any mirror
//!   can be promoted in its place.
//! - **A restarted master** (its node came back before the failure detector recorded it
//!   down: the group has no live member on it) cannot vouch for any mirror, so it hands
//!   the queue to the oldest synchronised mirror whose member is alive on a node seen
//!   running, as the reconciler would have after a `NodeDown`; with none, it serves from
//!   its own disk.

use std::collections::BTreeSet;

use crate::gm::{MemberId, Slot};
use crate::meta::state::MetaState;
use crate::meta::{NodeId, PromoteRule};
use crate::time::Instant;

use super::message::group_name;

/// What a master holds its lease by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    /// Its node.
    pub node: NodeId,
    /// The queue incarnation it ships rounds for.
    pub incarnation: u64,
    /// Its GM member in the queue's group.
    pub member: MemberId,
}

/// Until when the master behind `claim` may serve `vhost`/`queue` after a quorum read
/// that began at `read_began` showed `state`. `None`: the metadata no longer makes it the
/// master (another home, another incarnation, or its member dead or gone), and the lease
/// is not renewed.
pub fn renewal(
    state: &MetaState,
    vhost: &str,
    queue: &str,
    claim: &Claim,
    read_began: Instant,
    lease_ms: u64,
) -> Option<Instant> {
    let home = state
        .vhosts
        .get(vhost)
        .and_then(|v| v.queues.get(queue))
        .map(|d| d.home);
    let incarnation = state
        .mirror_sets
        .get(&(vhost.to_string(), queue.to_string()))
        .map_or(0, |s| s.incarnation);
    let alive = state
        .gm_groups
        .get(&group_name(vhost, queue, claim.incarnation))
        .is_some_and(|g| g.members.contains(&Slot::Alive(claim.member)));
    (home == Some(claim.node) && incarnation == claim.incarnation && alive)
        .then(|| read_began.plus_millis(lease_ms))
}

/// The mirror a master on `me`, restarted before it was recorded down, hands
/// `vhost`/`queue` to: the oldest synchronised one whose member is alive in the group, on a
/// node `running` says is up. `None`: the metadata shows a live member on `me` (not a
/// restart it knows of yet), the queue is not mirrored, or no such mirror exists.
pub fn hand_over_after_restart(
    state: &MetaState,
    vhost: &str,
    queue: &str,
    me: NodeId,
    running: impl Fn(NodeId) -> bool,
) -> Option<NodeId> {
    let set = state
        .mirror_sets
        .get(&(vhost.to_string(), queue.to_string()))?;
    let group = state
        .gm_groups
        .get(&group_name(vhost, queue, set.incarnation))?;
    if group.has_live_member_on(me) {
        return None;
    }
    let candidates: BTreeSet<NodeId> = set
        .mirrors
        .iter()
        .map(|m| m.node)
        .filter(|n| *n != me && running(*n) && group.has_live_member_on(*n))
        .collect();
    crate::meta::promotion(&set.mirrors, &candidates, PromoteRule::WhenSynced)
}

#[cfg(test)]
pub(super) mod tests;
#[cfg(test)]
mod two_masters;
