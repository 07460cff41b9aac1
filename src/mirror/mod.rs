//! Mirrored queues (issue 6, in progress): RabbitMQ's classic mirrored queues, on GM.
//!
//! Built so far: [`policy`], the `ha-*` keys of a queue's effective policy read into an
//! [`HaPolicy`] (with Warren's safer promotion defaults), and [`placement`], where a
//! queue's master and mirrors belong under that policy and which mirror a failed master
//! hands over to. Both are pure. The master/mirror processes over GM, background sync,
//! promotion through Raft and the operations are not built yet.

pub mod placement;
pub mod policy;

pub use placement::{promotion, suggested, MirrorRecord, Placement};
pub use policy::{HaMode, HaPolicy, PromoteRule, SyncMode};
