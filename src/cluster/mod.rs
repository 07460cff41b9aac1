//! Cluster protocol cores, sans-IO: decisions the node's cluster runtime
//! (`runtime::cluster`) and the simulation take alike, with time passed in.
//!
//! - [`detector`]: the failure detector (which nodes are down; which the leader records).
//! - [`election`]: when a follower calls a Raft election early, because the leader's
//!   process is gone.
//! - [`read_fence`]: which nodes' read-index requests the leader refuses while it records
//!   them down.
//! - [`read_log`]: which nodes the leader served reads to lately, named with each commit so
//!   a routing change waits for exactly those that may route by what they had.
//! - [`routing_lease`]: when a node may route publishes (its metadata is recent), and how
//!   long a routing change waits for a node that has not followed it.
//! - [`node_outbox`]: what the relay has for one other node: order, batches, the memory
//!   alarm's count, and one fate (answered or failed) per item.

pub mod detector;
pub mod election;
pub mod node_outbox;
pub mod read_fence;
pub mod read_log;
pub mod routing_lease;

pub use detector::{Detector, Verdict};
pub use election::{Call, ElectionCaller};
pub use node_outbox::NodeOutbox;
pub use read_fence::ReadFence;
pub use read_log::{ReadLog, Readers};
pub use routing_lease::RoutingLease;
