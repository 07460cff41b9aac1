//! Metadata commands: plain data, replicated through Raft and applied by [`super::state`].

use serde::{Deserialize, Serialize};

use super::limits::{LimitScope, Limits};
use super::policy::Policy;
use super::state::{
    Binding, ExchangeDef, MirrorRecord, MirrorSet, NodeId, NodeRecord, Permission, QueueDef, User,
    VhostMetadata,
};

/// One change to the metadata.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Command {
    /// Create a vhost with its standard exchanges (idempotent).
    AddVhost {
        /// Name.
        name: String,
    },
    /// Delete a vhost and everything in it.
    DeleteVhost {
        /// Name.
        name: String,
    },
    /// Create or replace a user.
    PutUser(User),
    /// Delete a user and their permissions.
    DeleteUser {
        /// Name.
        name: String,
    },
    /// Set a user's permissions on a vhost.
    SetPermissions(Permission),
    /// Declare an exchange; an existing one must be equivalent.
    DeclareExchange(ExchangeDef),
    /// Delete an exchange and every binding to or from it.
    DeleteExchange {
        /// Vhost.
        vhost: String,
        /// Name.
        name: String,
        /// Refuse when it is the source of a binding.
        if_unused: bool,
    },
    /// Declare a queue; an existing one must be equivalent.
    DeclareQueue(QueueDef),
    /// Delete a queue and its bindings (emptiness and use are checked by the queue itself).
    DeleteQueue {
        /// Vhost.
        vhost: String,
        /// Name.
        name: String,
    },
    /// Delete every exclusive queue of a connection (its owner went away).
    DeleteExclusiveQueues {
        /// The owning connection.
        owner: u64,
    },
    /// Set (create or replace) a policy or, with `operator`, an operator policy.
    SetPolicy {
        /// The policy.
        policy: Policy,
        /// Operator policy (limits only; the lower value wins).
        operator: bool,
    },
    /// Remove a policy.
    ClearPolicy {
        /// Vhost.
        vhost: String,
        /// Name.
        name: String,
        /// Operator policy.
        operator: bool,
    },
    /// A node announces itself (or its new addresses) to the cluster.
    RegisterNode(NodeRecord),
    /// `forget_cluster_node`: the node leaves for good, and every queue on it goes.
    ForgetNode {
        /// The node.
        id: NodeId,
    },
    /// The node went down or restarted: its connections' exclusive queues and its
    /// non-durable queues go.
    NodeDown {
        /// The node.
        id: NodeId,
    },
    /// Compare-and-set of a GM group record: applied only if the group is at
    /// `expected_version` (0: it does not exist yet); the version then goes up by one, so
    /// membership changes are totally ordered (GM's G8).
    GmGroup {
        /// Group name.
        name: String,
        /// The version the change was computed from.
        expected_version: u64,
        /// The new ring.
        members: Vec<crate::gm::Slot>,
    },
    /// Compare-and-set of a mirrored queue's mirrors: applied only if its mirror set is at
    /// `expected_version` (0: none yet). Mirrors must be registered nodes other than the
    /// queue's home; exclusive queues are never mirrored.
    SetMirrors {
        /// The vhost.
        vhost: String,
        /// The queue.
        queue: String,
        /// The version the change was computed from.
        expected_version: u64,
        /// The new mirrors (`since` is set by the state machine).
        mirrors: Vec<MirrorRecord>,
    },
    /// A mirror becomes the queue's master (its home) under the next epoch, if the queue is
    /// at `expected_epoch`.
    PromoteMirror {
        /// The vhost.
        vhost: String,
        /// The queue.
        queue: String,
        /// The epoch the decision was made at.
        expected_epoch: u64,
        /// The mirror's node.
        node: NodeId,
    },
    /// `warrenctl sync_queue` / `cancel_sync_queue`: asks the master of a mirrored queue to
    /// copy its backlog to its unsynchronised mirrors now (or to stop doing so).
    SyncQueue {
        /// The vhost.
        vhost: String,
        /// The queue.
        queue: String,
        /// Cancel rather than start.
        cancel: bool,
    },
    /// Removes a GM group record (its queue is gone).
    GmForget {
        /// Group name.
        name: String,
    },
    /// Add a binding (idempotent).
    Bind(Binding),
    /// Remove a binding (idempotent, as RabbitMQ).
    Unbind(Binding),
    /// [`Command::PromoteMirror`] of a mirror chosen because it was synchronised: refused
    /// if it is not synchronised when the command applies. Between the decision and the
    /// commit its node can restart (a new incarnation unsynchronises its mirrors, and the
    /// copy it held is gone), and promoting it then loses what the old master confirmed.
    /// (A variant of its own, last, so logs written before it still decode.)
    PromoteSyncedMirror {
        /// The vhost.
        vhost: String,
        /// The queue.
        queue: String,
        /// The epoch the decision was made at.
        expected_epoch: u64,
        /// The mirror's node.
        node: NodeId,
    },
    /// `clear_permissions`: removes a user's permissions on a vhost (idempotent). Last, so
    /// logs written before it still decode.
    ClearPermissions {
        /// The user.
        user: String,
        /// The vhost.
        vhost: String,
    },
    /// Sets a vhost's or a user's limits ([`super::limits`]): with `replace` the given set
    /// replaces the old one (`set_vhost_limits`), otherwise the given names are updated and
    /// the others kept (`set_user_limits`, the API's PUT of one limit). Last, so logs
    /// written before it still decode.
    SetLimits {
        /// Whose limits.
        scope: LimitScope,
        /// Limits by name.
        limits: Limits,
        /// Replace the whole set rather than update it.
        replace: bool,
    },
    /// Clears one limit (`name`) or all of a vhost's or user's limits (idempotent).
    ClearLimits {
        /// Whose limits.
        scope: LimitScope,
        /// The limit; `None`: all of them.
        name: Option<String>,
    },
    /// Several commands applied in order as one: all of them or, when one is refused, none
    /// (a definitions import: one log entry and one definitions write for many commands).
    Batch(Vec<Command>),
    /// Sets a vhost's description and tags (an empty one clears them). Last, so logs
    /// written before it still decode.
    SetVhostMetadata {
        /// The vhost.
        name: String,
        /// Its description and tags.
        metadata: VhostMetadata,
    },
    /// The master records a mirror synchronised: applied only while `member` (the mirror's
    /// GM member that acknowledged the sync) is alive in the queue's group of
    /// `incarnation`, and the queue is still at `epoch`. A mirror is synchronised only
    /// while that member lives: the state machine unsynchronises it when its node's live
    /// members in the group change (`docs/mirroring.md`). A proposal whose outcome its
    /// master never learnt can commit later, after the member died and its node joined
    /// again with a copy that holds nothing yet (bug 27). Last, so logs written before it
    /// still decode.
    MarkSynchronised {
        /// The vhost.
        vhost: String,
        /// The queue.
        queue: String,
        /// The queue's incarnation ([`super::state::MirrorSet::incarnation`]).
        incarnation: u64,
        /// The master's epoch.
        epoch: u64,
        /// The mirror's member.
        member: crate::gm::MemberId,
    },
}

/// How many commands one [`Command::Batch`] made by [`Command::batched`] holds at most: a
/// Raft entry of a few hundred KiB for a definitions import.
pub const BATCH_MAX: usize = 1000;

impl Command {
    /// `commands` in order as few commands as can carry them: [`BATCH_MAX`] at a time in a
    /// [`Command::Batch`] (one log entry and one definitions write each), a lone command as
    /// itself.
    pub fn batched(mut commands: Vec<Command>) -> Vec<Command> {
        let mut out = Vec::new();
        while !commands.is_empty() {
            let rest = commands.split_off(commands.len().min(BATCH_MAX));
            let mut batch = std::mem::replace(&mut commands, rest);
            out.push(if batch.len() == 1 {
                batch.remove(0)
            } else {
                Command::Batch(batch)
            });
        }
        out
    }

    /// The commands this one applies: a batch's, in order, or itself.
    pub fn parts(&self) -> &[Command] {
        match self {
            Command::Batch(commands) => commands,
            other => std::slice::from_ref(other),
        }
    }

    /// The command that promotes `node`'s mirror of `vhost`/`queue`, decided on `set`: one
    /// that re-checks at commit that the mirror is still synchronised if it was when
    /// decided (a deliberate promotion of an unsynchronised mirror, `ha-promote-on-*:
    /// always` or a forced one, stays as it was).
    pub fn promote(vhost: &str, queue: &str, set: &MirrorSet, node: NodeId) -> Command {
        let (vhost, queue, expected_epoch) = (vhost.to_string(), queue.to_string(), set.epoch);
        if set.mirrors.iter().any(|m| m.node == node && m.synchronised) {
            Command::PromoteSyncedMirror {
                vhost,
                queue,
                expected_epoch,
                node,
            }
        } else {
            Command::PromoteMirror {
                vhost,
                queue,
                expected_epoch,
                node,
            }
        }
    }
}
