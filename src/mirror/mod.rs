//! Mirrored queues: RabbitMQ's classic mirrored queues, on GM (`docs/mirroring.md`).
//!
//! The pure parts: [`policy`], the `ha-*` keys of a queue's effective policy read into an
//! [`HaPolicy`] (with Warren's safer promotion defaults); [`placement`], where a queue's
//! master and mirrors belong under that policy and which mirror a failed master hands over
//! to; [`reconcile`], the commands (`SetMirrors`, `PromoteMirror`) that bring the metadata's
//! mirror sets in line; [`ops`], the wire form of the queue operations a master ships to its
//! mirrors; [`message`], what a mirrored queue's GM group carries. The node runs them in
//! `runtime::mirror_host` (master and mirror tasks, the storage tap, the leader's
//! reconciler).

pub mod message;
pub mod ops;
pub mod placement;
pub mod policy;
pub mod reconcile;

pub use placement::{promotion, suggested, MirrorRecord, Placement};
pub use policy::{HaMode, HaPolicy, PromoteRule, SyncMode};
