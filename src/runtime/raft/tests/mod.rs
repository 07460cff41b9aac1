//! Tests of the Raft module: openraft's storage conformance suite, crash recovery of the log
//! and the state machine, in-process clusters with failures and partitions, and proposals
//! forwarded from followers (frame encoding, malformed frames, lost and refused forwards).

mod cluster;
mod forward;
pub(crate) mod harness;
mod storage;
mod suite;
