//! Whether a mirrored queue's round of index operations may be confirmed, as rules over
//! the metadata (`docs/mirroring.md`, *The data path*, 5). The storage tap
//! (`runtime::mirror_host`) ships a master's round around the queue's GM group and asks
//! these once the laps are done; for a round of a queue it does not ship for, it asks
//! [`refuse_unshipped`] at once. A refused round's publishes are nacked.
//!
//! - **A shipped round** is confirmed only if every lap completed, the node still masters
//!   the queue under the epoch it shipped in (a lap completes without a member that died
//!   meanwhile: if a promotion committed while it ran, the copy that now is the queue may
//!   lack the round), and the master is not handing the queue over (its successor may have
//!   been chosen from a copy taken before the round).
//! - **A round of a mirrored queue not shipped** (no master task yet, or no longer) is
//!   refused while the metadata counts any mirror as synchronised (it could be promoted
//!   without the round), when the queue's home is another node (a deposed master whose
//!   broker has not dropped the queue yet confirms nothing), or while the master is fenced
//!   at the current incarnation and epoch (a new master before its first lease renewal).
//!   A queue that is not mirrored confirms on its own disk.

use crate::meta::state::MetaState;
use crate::meta::NodeId;

/// A round a master shipped, as its laps ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shipped {
    /// The master's node.
    pub node: NodeId,
    /// The queue's epoch the master shipped it in.
    pub epoch: u64,
    /// Every lap of the round completed.
    pub laps_done: bool,
    /// The master began handing the queue over (a controlled stop or a move).
    pub handing_over: bool,
}

/// Whether the round `shipped` of `vhost`/`queue` is confirmed, by the metadata in `state`.
pub fn confirms(state: &MetaState, vhost: &str, queue: &str, shipped: &Shipped) -> bool {
    let same_epoch = state
        .mirror_sets
        .get(&(vhost.to_string(), queue.to_string()))
        .is_some_and(|s| s.epoch == shipped.epoch);
    shipped.laps_done
        && !shipped.handing_over
        && same_epoch
        && home(state, vhost, queue) == Some(shipped.node)
}

/// Whether a round of `vhost`/`queue` on node `me`, which no master task ships, is refused.
/// `fenced`: the (incarnation, epoch) at which this node's master of the queue waits for
/// its first lease renewal, if it does.
pub fn refuse_unshipped(
    state: &MetaState,
    vhost: &str,
    queue: &str,
    me: NodeId,
    fenced: Option<(u64, u64)>,
) -> bool {
    state
        .mirror_sets
        .get(&(vhost.to_string(), queue.to_string()))
        .is_some_and(|s| {
            s.mirrors.iter().any(|m| m.synchronised)
                || home(state, vhost, queue) != Some(me)
                || fenced == Some((s.incarnation, s.epoch))
        })
}

/// The node the metadata homes `vhost`/`queue` on.
fn home(state: &MetaState, vhost: &str, queue: &str) -> Option<NodeId> {
    state
        .vhosts
        .get(vhost)
        .and_then(|v| v.queues.get(queue))
        .map(|d| d.home)
}

#[cfg(test)]
mod tests;
