//! The runtime layer: the only code that uses tokio, sockets, files and clocks.
//!
//! - [`transport`]: the `Transport` trait (bind / accept) and its tokio implementation; the
//!   simulation supplies a turmoil one.
//! - [`conn_task`]: drives one [`crate::session::Connection`] over a socket or a TLS session.
//! - [`tls`]: the AMQPS and HTTPS listeners (rustls).
//! - [`node`]: starts the listener and the periodic tasks, and shuts them down.
//! - [`node_link`]: the TCP link between nodes (handshake, RPC with deadlines, heartbeats as
//!   the failure detector); carries Raft today.
//! - [`cluster`]: cluster mode: the metadata Raft member, the broker following it, the
//!   failure detector, membership, and queue placement.
//! - [`relay`]: queues of other nodes: forwarded publishes, remote consumers, acks and
//!   deliveries over the node links.
//! - [`gm_host`]: a node's GM members, their views from the metadata, their messages over
//!   the node links (or any [`gm_host::GmNet`]).
//! - [`clock`]: turns the runtime's clock into [`crate::time::Instant`]s.
//! - [`mgmt`], [`prometheus`]: the management HTTP API and the metrics endpoint;
//!   [`direct`]: the API's publish, get and purge over an AMQP connection to the node.

pub mod admin;
pub mod clock;
pub mod cluster;
pub mod conn_task;
pub mod direct;
pub mod disk_free;
pub mod file_disk;
pub mod gm_host;
pub mod http;
pub mod inspect;
pub mod mgmt;
pub mod mirror_host;
pub mod node;
pub mod node_link;
pub mod node_stats;
pub mod prometheus;
pub mod raft;
pub mod relay;
pub mod storage;
pub mod tls;
pub mod transport;

pub use node::{Node, NodeError};

/// `warren`'s exit status when the node stops itself because it can no longer keep what it
/// confirms ([`Node::failed`]): EX_IOERR from sysexits.h. A supervisor restarts it
/// (systemd's `Restart=on-failure`), and recovery starts from the files.
pub const EXIT_STORAGE_FAILED: i32 = 74;
