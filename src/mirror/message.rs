//! What a mirrored queue's GM group carries: the master's rounds of queue operations, the
//! flush a promoted master sends before it serves, and the background sync of a new
//! mirror (`docs/mirroring.md`). Every message names the epoch of the master that sent it.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::digest::RangeSummary;
use crate::gm::MemberId;

/// One GM message of a mirrored queue's group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MirrorMsg {
    /// A round's operations ([`super::ops::encode`]), in the order the master wrote them.
    Ops {
        /// The master's epoch.
        epoch: u64,
        /// The encoded operations (as bytes: serde copies them at once, not byte by byte).
        #[serde(with = "crate::shared_bytes")]
        ops: Bytes,
    },
    /// A promoted master's first message: once its lap completes, every member (the new
    /// master included) holds everything any member received from the old master.
    Flush {
        /// The new master's epoch.
        epoch: u64,
    },
    /// The target's copy restarts here, empty: it takes the rounds that follow (publishes
    /// from `from_seq` on). With `active`, the master then sends the backlog (`SyncBatch`
    /// up to `SyncEnd`) and the target holds the rounds back until the backlog is in;
    /// otherwise the target is synchronised once the master's queue holds nothing older
    /// than `from_seq` (RabbitMQ's manual mode).
    SyncStart {
        /// The master's epoch.
        epoch: u64,
        /// The mirror being synchronised.
        target: MemberId,
        /// The master's next seq at this point of the stream.
        from_seq: u64,
        /// Whether the backlog follows.
        active: bool,
        /// This sync among the master's (batches of an aborted one are ignored).
        sync: u64,
    },
    /// Part of the backlog (messages older than `from_seq`, in seq order) for `target`.
    SyncBatch {
        /// The master's epoch.
        epoch: u64,
        /// The mirror being synchronised.
        target: MemberId,
        /// Its sync (`SyncStart::sync`).
        sync: u64,
        /// The encoded operations (publishes, delivers).
        #[serde(with = "crate::shared_bytes")]
        ops: Bytes,
    },
    /// The backlog is complete. Its lap completing does not prove `target` got it (GM
    /// gives a joiner only what is sent after its left neighbour saw it join): the target
    /// answers with [`MirrorMsg::SyncAck`] once it holds the whole queue.
    SyncEnd {
        /// The master's epoch.
        epoch: u64,
        /// The mirror being synchronised.
        target: MemberId,
        /// Its sync (`SyncStart::sync`).
        sync: u64,
    },
    /// From a mirror: it got `SyncEnd` of sync `(epoch, sync)` as the one it follows (its
    /// backlog written, or, for a natural sync, following since that sync's `SyncStart`),
    /// so its copy is the whole queue. Only then may the master record it synchronised.
    SyncAck {
        /// The master's epoch.
        epoch: u64,
        /// The sync.
        sync: u64,
    },
    /// What the master's queue holds in `[lo, hi)`, without ids or bodies, for a mirror
    /// that kept its copy across a restart ([`MirrorMsg::SyncHave`]): it compares its
    /// copy with these (`docs/mirroring.md`, *Mirrors keep their data*) and then asks for
    /// what it lacks with [`MirrorMsg::SyncWant`]. The summaries cover `[0, copy_next)` in
    /// order; the one whose `hi` reaches it is the last.
    SyncSummary {
        /// The master's epoch.
        epoch: u64,
        /// The mirror being synchronised.
        target: MemberId,
        /// Its sync (`SyncStart::sync`).
        sync: u64,
        /// The range's live seqs, deliveries and the hash of its messages.
        summary: RangeSummary,
    },
    /// From the target of an active sync: send the backlog from seq `from` on (0: all of
    /// it; more: its kept copy holds, compared with the digest, everything below).
    SyncWant {
        /// The master's epoch.
        epoch: u64,
        /// The sync.
        sync: u64,
        /// The first seq the mirror needs.
        from: u64,
    },
    /// From the target of an active sync, at its start: it kept a copy from its last run
    /// holding seqs below `copy_next` only; the master summarises `[0, copy_next)` for it
    /// ([`MirrorMsg::SyncSummary`]). A target without one sends [`MirrorMsg::SyncWant`]
    /// (from 0) instead.
    SyncHave {
        /// The master's epoch.
        epoch: u64,
        /// The sync.
        sync: u64,
        /// The copy's next seq.
        copy_next: u64,
    },
    /// From the target of an active sync: it has written the first `batches` of the
    /// sync's `SyncBatch`es to its copy. A target releases each batch at once (so the
    /// rounds behind it wait on no disk write) and writes it beside its loop; the master
    /// keeps at most a few batches unwritten by these reports, not by GM's laps.
    SyncWritten {
        /// The master's epoch.
        epoch: u64,
        /// The sync.
        sync: u64,
        /// Batches written so far.
        batches: u64,
    },
}

impl MirrorMsg {
    /// Its bytes.
    pub fn encode(&self) -> Vec<u8> {
        // Plain data always serialises.
        bincode::serialize(self).unwrap_or_default()
    }

    /// Decodes what [`MirrorMsg::encode`] made (`None`: not a mirror message). The
    /// operations are a view of `bytes`, not a copy.
    pub fn decode(bytes: &Bytes) -> Option<MirrorMsg> {
        crate::shared_bytes::decode_in(bytes, |b| bincode::deserialize(b)).ok()
    }
}

pub use crate::meta::state::{
    mirror_group_name as group_name, MIRROR_GROUP_PREFIX as GROUP_PREFIX,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_round_trips_and_garbage_is_refused() {
        let target = MemberId { node: 2, since: 7 };
        for m in [
            MirrorMsg::Ops {
                epoch: 1,
                ops: Bytes::from_static(&[1, 2, 3]),
            },
            MirrorMsg::Flush { epoch: 2 },
            MirrorMsg::SyncStart {
                epoch: 1,
                target,
                from_seq: 40,
                active: true,
                sync: 3,
            },
            MirrorMsg::SyncBatch {
                epoch: 1,
                target,
                sync: 3,
                ops: Bytes::from_static(&[9]),
            },
            MirrorMsg::SyncAck { epoch: 3, sync: 9 },
            MirrorMsg::SyncSummary {
                epoch: 1,
                target,
                sync: 3,
                summary: {
                    let mut b = super::super::digest::SummaryBuilder::new(0, 9);
                    b.add(4, u128::MAX - 1, true);
                    b.finish()
                },
            },
            MirrorMsg::SyncHave {
                epoch: 1,
                sync: 3,
                copy_next: 7,
            },
            MirrorMsg::SyncWant {
                epoch: 1,
                sync: 3,
                from: 5,
            },
            MirrorMsg::SyncEnd {
                epoch: 1,
                target,
                sync: 3,
            },
            MirrorMsg::SyncWritten {
                epoch: 1,
                sync: 3,
                batches: 12,
            },
        ] {
            assert_eq!(MirrorMsg::decode(&Bytes::from(m.encode())), Some(m));
        }
        assert_eq!(
            MirrorMsg::decode(&Bytes::from_static(&[0xff, 0xff, 0xff, 0xff, 1])),
            None
        );
    }

    #[test]
    fn group_names_of_different_queues_differ() {
        assert_ne!(group_name("a:b", "c", 1), group_name("a", "b:c", 1));
        // A queue declared again under its old name is another group.
        assert_ne!(group_name("a", "q", 1), group_name("a", "q", 2));
    }
}
