//! The metadata commands replicated with Raft (openraft 0.9.25, storage v2).
//!
//! Every openraft type stays inside this module, so moving to openraft 0.10 touches nothing
//! else. The rest of the broker uses [`MetaRaft`] (start, initialise, propose on any node,
//! read the applied [`crate::meta::MetaState`]) and plugs a [`RaftTransport`] in.
//!
//! - [`types`]: the openraft `TypeConfig`; log entries carry a metadata `Command`.
//! - [`log_store`]: the log, vote and purge point on the `Disk` trait, fsynced before
//!   openraft counts an entry as stored.
//! - [`state_machine`]: applies commands to `MetaState`, publishes each new state, builds,
//!   stores and installs snapshots ([`image`] is their format).
//! - [`network`]: Raft RPCs as opaque frames over a [`RaftTransport`]; [`router`] is the
//!   in-process transport with partitions used by tests.
//! - [`forward`]: a proposal made on a node that does not lead travels to the leader as one
//!   more request kind on that transport; it is never re-sent once a leader may have taken
//!   it, so a command is applied at most once per proposal.
//! - [`rt`]: the tokio runtime with a per-node seeded RNG, so a simulation replays.
//! - [`node`]: the [`MetaRaft`] façade.
//!
//! This module runs on tokio and reaches files through `Disk`: it is a driver of the pure
//! `meta` core, not part of it.

pub mod errors;
pub mod forward;
pub mod image;
pub mod log_store;
pub mod network;
pub mod node;
pub mod persist;
pub mod router;
pub mod rt;
pub mod state_machine;
pub mod types;

#[cfg(test)]
pub(crate) mod tests;

pub use errors::{InitError, ProposeError, StartError, StopError};
pub use network::{RaftTransport, RpcServer, TransportError};
pub use node::{Membership, MetaRaft, MetaRaftConfig};
pub use persist::PersistError;
pub use router::{Router, RouterTransport};
pub use state_machine::MetaView;
pub use types::{AppliedSummary, MetaRequest, MetaResponse, NodeId, Rejected, TypeConfig};
