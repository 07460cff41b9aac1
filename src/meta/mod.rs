//! The metadata state machine: vhosts, users, permissions, limits, exchanges, bindings and
//! queues.
//!
//! Every change is a [`Command`] that [`MetaState::apply`] validates and applies; a rejected
//! command changes nothing. The broker reads immutable `Arc<MetaState>` snapshots, swapped
//! after each applied command. On one node the commands are applied directly; the cluster step
//! replicates the same commands through Raft (`runtime::raft`), which is why they are plain
//! serialisable data.
//!
//! Mirrored queues' metadata rules live here too, since applying a command decides them:
//! [`ha_policy`] reads the `ha-*` keys of an effective policy, [`placement`] says where a
//! queue's mirrors belong and which mirror takes over from a failed master.

pub mod args;
pub mod command;
pub mod definitions;
pub mod equivalence;
pub mod error;
pub mod ha_policy;
pub mod limits;
pub mod placement;
pub mod policy;
pub mod state;

pub use command::Command;
pub use error::MetaError;
pub use ha_policy::{HaMode, HaPolicy, PromoteRule, SyncMode};
pub use placement::{promotion, suggested, Placement};
pub use state::{
    owner_node, Binding, Destination, ExchangeDef, ExchangeKind, MetaState, NodeId, NodeRecord,
    Permission, QueueDef, User, Vhost,
};
