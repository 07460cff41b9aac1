//! What a node reports about itself in `GET /api/nodes`: memory, disk, descriptors,
//! sockets, uptime and where its files are. The runtime reads the figures (from `/proc`,
//! `statvfs` and its clock) and other nodes ask for them over the node links
//! ([`super::remote::NodeCall::Stats`]); the management core renders them as RabbitMQ's
//! node object, and the overview's listeners.

use serde::{Deserialize, Serialize};

/// One node's figures at the moment it was asked.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeStats {
    /// Resident memory of the node's process, in bytes (RabbitMQ's `rss` strategy).
    pub mem_used: u64,
    /// The memory high watermark, in bytes. The alarm is raised on message bytes held by
    /// queues, not on the process's resident memory (`docs/management.md`).
    pub mem_limit: u64,
    /// Whether the memory alarm is on.
    pub mem_alarm: bool,
    /// Free bytes on the file system of the data folder, as last measured (None before
    /// the first measurement or where it cannot be asked).
    pub disk_free: Option<u64>,
    /// `disk_free_limit_bytes`.
    pub disk_free_limit: u64,
    /// Whether the disk alarm is on.
    pub disk_free_alarm: bool,
    /// Open file descriptors, where the platform tells.
    pub fd_used: Option<u64>,
    /// The process's descriptor limit, where the platform tells.
    pub fd_total: Option<u64>,
    /// Client connections open on this node.
    pub sockets_used: u64,
    /// Milliseconds since the node started.
    pub uptime_ms: u64,
    /// The node's process id.
    pub os_pid: u32,
    /// Processors the node may run on.
    pub processors: u32,
    /// The configuration file it was started with, if any (the embedded default has none).
    pub config_file: Option<String>,
    /// The data folder.
    pub db_dir: String,
    /// Its listeners.
    pub listeners: Vec<ListenerInfo>,
    /// Its storage's file I/O so far.
    pub io: crate::metrics::IoSnapshot,
    /// Its open node links.
    pub cluster_links: Vec<ClusterLink>,
}

/// One of a node's open links to another node (`cluster_links`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterLink {
    /// The other node's name.
    pub name: String,
    /// This end's address.
    pub sock: Option<Endpoint>,
    /// The other end's.
    pub peer: Option<Endpoint>,
    /// Bytes sent on the link.
    pub send_bytes: u64,
    /// Bytes received on it.
    pub recv_bytes: u64,
}

/// One of a node's listeners.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListenerInfo {
    /// The protocol, as RabbitMQ names it (`amqp`, `amqp/ssl`, `http`, `https`,
    /// `http/prometheus`, `clustering`) or Warren's own (`warren/admin`).
    pub protocol: String,
    /// The address it is bound to.
    pub addr: Endpoint,
}

/// A socket's address, as listings show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    /// The IP address, as text (`127.0.0.1`, `::`).
    pub ip: String,
    /// The port.
    pub port: u16,
}
