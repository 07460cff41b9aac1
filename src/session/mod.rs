//! The sans-IO AMQP session: one [`Connection`] per client socket, holding its channels.
//!
//! The runtime feeds it bytes, timer expiries, outbox wake-ups, memory alarms and shutdown
//! (`handle_*`, with `now` passed in) and takes from it bytes to write, the next deadline and
//! whether it wants to read or is finished (`poll_*`). It calls into the shared, equally
//! sans-IO [`crate::broker::Broker`] for everything beyond the connection.

pub mod channel;
pub mod connection;
pub mod handshake;
pub mod permissions;

pub use connection::{Connection, PeerInfo, SessionConfig};
