//! Why the metadata Raft node could not start, initialise, answer a proposal or stop
//! cleanly: the errors of [`super::MetaRaft`]'s API, with no openraft types in them.

use std::time::Duration;

use super::persist::PersistError;
use super::types::NodeId;

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The log or the snapshot could not be read.
    #[error("raft storage: {0}")]
    Storage(#[from] PersistError),
    /// The configuration is inconsistent.
    #[error("raft config: {0}")]
    Config(String),
    /// openraft refused to start (its storage checks failed).
    #[error("raft start: {0}")]
    Raft(String),
}

/// Why a cluster could not be initialised.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InitError {
    /// This node already has a log or a vote: the cluster exists.
    #[error("the cluster is already initialised")]
    AlreadyInitialized,
    /// The member list must include this node.
    #[error("this node is not among the initial members")]
    NotInMembers,
    /// The node has stopped.
    #[error("raft node stopped: {0}")]
    Stopped(String),
}

/// Why a proposal has no outcome. [`ProposeError::outcome_unknown`] separates the errors
/// after which the command may still be applied from those after which it certainly is not.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProposeError {
    /// Only the leader serves this; this is who that is, if known. Returned by
    /// [`MetaRaft::linearizable_snapshot`]; proposals are forwarded instead.
    #[error("not the leader (leader: {leader:?})")]
    NotLeader {
        /// The leader's id.
        leader: Option<NodeId>,
        /// The leader's cluster address.
        leader_addr: Option<String>,
    },
    /// No leader could be reached before the deadline (none elected, or the one this node
    /// knew was unreachable or had stepped down). No leader took the command: it is not
    /// applied, and proposing it again is safe.
    #[error("no leader reachable within {waited:?} ({reason}); the command was not proposed")]
    NoLeader {
        /// How long the proposal waited.
        waited: Duration,
        /// What the last attempt ran into.
        reason: String,
    },
    /// The command went to a leader (this node, or the one it was forwarded to) and no
    /// outcome came back in time; the command may still commit.
    #[error("no outcome within {0:?}; the command may still commit")]
    Timeout(Duration),
    /// A leader took the command and its outcome was lost: the link broke, the leader
    /// stopped, or it lost its leadership with the command in flight. The command may or may
    /// not be applied; it was not re-sent (see [`super::forward`]).
    #[error("outcome unknown (leader {leader}): {reason}; the command may or may not commit")]
    Unknown {
        /// The leader the command was forwarded to (this node's id if it led itself).
        leader: NodeId,
        /// What went wrong.
        reason: String,
    },
    /// The leader could not read the forwarded command (a node speaking another version) or
    /// it could not be encoded; nothing was proposed.
    #[error("node {leader} could not take the forwarded command: {reason}")]
    ForwardFailed {
        /// The leader.
        leader: NodeId,
        /// Why.
        reason: String,
    },
    /// The leader could not reach a majority to confirm it still leads.
    #[error("no quorum: {0}")]
    NoQuorum(String),
    /// This node has stopped. If it stopped while leading with the command in flight, the
    /// command may still commit on the others.
    #[error("raft node stopped: {0}")]
    Stopped(String),
}

impl ProposeError {
    /// Whether the command may have been applied, or may still be, despite the error: the
    /// caller must then not assume either way (re-proposing it may apply it twice; reading
    /// the metadata tells). False means it is certainly not applied.
    pub fn outcome_unknown(&self) -> bool {
        matches!(
            self,
            ProposeError::Timeout(_) | ProposeError::Unknown { .. } | ProposeError::Stopped(_)
        )
    }
}

/// The Raft task ended with a panic or was cancelled.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("raft task ended abnormally: {0}")]
pub struct StopError(pub(super) String);
