//! Mirrored queues: RabbitMQ's classic mirrored queues, on GM (`docs/mirroring.md`).
//!
//! The pure parts: [`reconcile`], the commands (`SetMirrors`, `PromoteMirror`) that bring
//! the metadata's mirror sets in line with the policies and the running nodes; [`ops`], the
//! wire form of the queue operations a master ships to its mirrors; [`message`], what a
//! mirrored queue's GM group carries; [`digest`], how a mirror's kept copy is compared with
//! its master's queue; [`role`], a mirror member's side of the sync protocol, and
//! [`master`], the master's side (which mirrors it syncs, when a sync is over, when it
//! vouches for one), both sans-IO; [`lease`], when a master may serve and whom a restarted
//! master hands its queue to; [`confirm`], whether a master's round may be confirmed (and
//! when one not shipped is refused); [`adoption`], the steps by which a promoted mirror's copy
//! becomes the queue. The policy and placement rules they follow are metadata
//! (`meta::ha_policy`, `meta::placement`), since the state machine applies them too. The
//! node runs them in `runtime::mirror_host` (master and mirror tasks, the storage tap, the
//! leader's reconciler).

pub mod adoption;
pub mod confirm;
pub mod digest;
pub mod lease;
pub mod master;
pub mod message;
pub mod ops;
pub mod reconcile;
pub mod role;

#[cfg(test)]
mod tests;
