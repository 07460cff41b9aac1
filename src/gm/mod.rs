//! GM, RabbitMQ's guaranteed-multicast ring, as a pure state machine.
//!
//! Members form a ring in the group record's order; a publish travels one lap with its body
//! and one lap as an ack, every member holding it until its ack passes; when a member dies
//! the nearest live member downstream inherits its messages, and the member upstream of the
//! dead one sends its new right neighbour a catch-up from which it computes what it missed.
//! `../shared/reference/rabbitmq-mirroring.md` §1 describes the protocol this follows.
//!
//! - [`view`]: the group record (kept in the metadata: a Raft compare-and-set on its version
//!   for every change) and the view a member derives from it.
//! - [`member`]: one member: broadcast, confirmed broadcast, activity, catch-up, views, and
//!   durable acks (a message is released only once every member has stored it).
//! - [`wire`]: the batches members exchange, and a member's inbox and outbox.
//!
//! The metadata state machine keeps the group records (`meta::state`); `runtime::gm_host`
//! runs a node's members over the node links, and `sim/` runs the same members under turmoil.

pub mod member;
pub mod view;
pub mod wire;

#[cfg(test)]
mod tests;

pub use member::{Event, GmMsg, Item, Member, Pending, PubNum};
pub use view::{late_join, GroupRecord, LateJoin, MemberId, Slot, View};
pub use wire::{Batch, GmFrame, GmReply, Inbox, Outbox, Part};
