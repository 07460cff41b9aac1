//! The openraft type configuration and the data carried in the replicated log.
//!
//! A log entry carries one [`MetaRequest`] (a metadata [`Command`]); applying it yields one
//! [`MetaResponse`]. A command that [`crate::meta::MetaState::apply`] refuses is still a
//! committed entry: its response carries the refusal and the state is unchanged, so every node
//! refuses it identically.

use std::io::Cursor;

use serde::{Deserialize, Serialize};

use crate::amqp::AmqpError;
use crate::meta::state::Applied;
use crate::meta::{Command, MetaError};

use super::rt::SeededRuntime;

/// A Raft node id is the metadata's node id: voters are the first nodes of the cluster,
/// ids are never reused.
pub use crate::meta::NodeId;

openraft::declare_raft_types!(
    /// The openraft type configuration of the metadata group.
    pub TypeConfig:
        D = MetaRequest,
        R = MetaResponse,
        NodeId = NodeId,
        Node = openraft::BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = SeededRuntime,
);

/// The application data of one log entry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MetaRequest {
    /// The metadata change.
    pub command: Command,
}

/// What applying one log entry produced.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaResponse {
    /// The log index of the entry.
    pub index: u64,
    /// The command's outcome; blank and membership entries are `Ok` with nothing created.
    pub outcome: Result<AppliedSummary, Rejected>,
}

/// The serialisable part of [`Applied`]: what a command created or removed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppliedSummary {
    /// Whether a declare created something new.
    pub created: bool,
    /// Queues deleted (cascades included), as (vhost, name).
    pub removed_queues: Vec<(String, String)>,
    /// Exchanges deleted (auto-delete cascades included).
    pub removed_exchanges: Vec<String>,
}

impl From<Applied> for AppliedSummary {
    fn from(a: Applied) -> AppliedSummary {
        AppliedSummary {
            created: a.created,
            removed_queues: a.removed.queues,
            removed_exchanges: a.removed.exchanges,
        }
    }
}

/// A command the state machine refused. It keeps the AMQP reply code next to the text
/// because the proposing channel must close with the code RabbitMQ would use (404, 405, 406…),
/// and `MetaError` itself is not serialisable.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code} {text}")]
pub struct Rejected {
    /// The AMQP reply code of the refusal.
    pub code: u16,
    /// RabbitMQ's text for it.
    pub text: String,
}

impl From<MetaError> for Rejected {
    fn from(e: MetaError) -> Rejected {
        let amqp = AmqpError::from(e);
        Rejected {
            code: amqp.code.code(),
            text: amqp.text,
        }
    }
}
