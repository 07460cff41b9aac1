//! The metadata state machine: vhosts, users, permissions, limits, exchanges, bindings and
//! queues.
//!
//! Every change is a [`Command`] that [`MetaState::apply`] validates and applies; a rejected
//! command changes nothing. The broker reads immutable `Arc<MetaState>` snapshots, swapped
//! after each applied command. On one node the commands are applied directly; the cluster step
//! replicates the same commands through Raft, which is why they are plain serialisable data.

pub mod args;
pub mod command;
pub mod definitions;
pub mod equivalence;
pub mod error;
pub mod limits;
pub mod policy;
pub mod raft;
pub mod state;

pub use command::Command;
pub use error::MetaError;
pub use state::{
    owner_node, Binding, Destination, ExchangeDef, ExchangeKind, MetaState, NodeId, NodeRecord,
    Permission, QueueDef, User, Vhost,
};
