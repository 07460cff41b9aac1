//! Tests of the Raft module: openraft's storage conformance suite, crash recovery of the log
//! and the state machine, and in-process clusters with failures and partitions.

mod cluster;
mod harness;
mod storage;
mod suite;
