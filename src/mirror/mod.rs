//! Mirrored queues (issue 6, in progress): RabbitMQ's classic mirrored queues, on GM.
//!
//! Built so far, all pure: [`policy`], the `ha-*` keys of a queue's effective policy read
//! into an [`HaPolicy`] (with Warren's safer promotion defaults); [`placement`], where a
//! queue's master and mirrors belong under that policy and which mirror a failed master
//! hands over to; [`reconcile`], the commands (`SetMirrors`, `PromoteMirror`) that bring
//! the metadata's mirror sets in line; [`ops`], the wire form of the queue operations a
//! master ships to its mirrors (the storage side: `runtime::storage::Storage::set_ops_tap`
//! on the master, `apply_mirrored` on a mirror). The master/mirror processes over GM, background sync,
//! running the reconciler on the leader and the operations are not built yet
//! (`docs/mirroring.md`).

pub mod message;
pub mod ops;
pub mod placement;
pub mod policy;
pub mod reconcile;

pub use placement::{promotion, suggested, MirrorRecord, Placement};
pub use policy::{HaMode, HaPolicy, PromoteRule, SyncMode};
