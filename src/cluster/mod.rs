//! Cluster protocol cores, sans-IO: decisions the node's cluster runtime
//! (`runtime::cluster`) and the simulation take alike, with time passed in.
//!
//! - [`detector`]: the failure detector (which nodes are down; which the leader records).

pub mod detector;

pub use detector::{Detector, Verdict};
