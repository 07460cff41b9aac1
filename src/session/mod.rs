//! The sans-IO AMQP session: one [`Connection`] per client socket, holding its channels.
//!
//! The runtime feeds it bytes, timer expiries, outbox wake-ups, memory alarms, shutdown and
//! the results of metadata commands (`handle_*`, with `now` passed in) and takes from it bytes
//! to write, metadata commands to commit, the next deadline and whether it wants to read or is
//! finished (`poll_*`). It calls into the shared, equally sans-IO [`crate::broker::Broker`] for
//! queues and routing, but never changes metadata itself: declares, deletes and bindings are
//! [`crate::meta::Command`]s the runtime commits (at once on a single node, through Raft in a
//! cluster) while the channel that asked waits, parked ([`meta`]).

pub mod channel;
pub mod connection;
pub mod external;
pub mod handshake;
pub mod meta;
pub mod permissions;

pub use connection::{Connection, PeerInfo, SessionConfig};

#[cfg(test)]
mod close_tests;
#[cfg(test)]
mod confirm_tests;
#[cfg(test)]
mod handshake_tests;
#[cfg(test)]
mod limits_tests;
pub use external::{PeerCert, TlsPeer};
pub use meta::{MetaResult, MetaToken};
