//! What a scrape reads of the node at that moment (the counters live in
//! [`super::Metrics`]).

/// The node's state for one scrape.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    /// The node's name (`rabbitmq_node`).
    pub node: String,
    /// The cluster's name (`rabbitmq_cluster`): the cluster id, or the node's name alone.
    pub cluster: String,
    /// Warren's version.
    pub version: &'static str,
    /// The RabbitMQ version whose interface Warren keeps (as the management API reports it).
    pub rabbitmq_version: &'static str,
    /// AMQP connections open on this node.
    pub connections: u64,
    /// Their channels.
    pub channels: u64,
    /// Their consumers.
    pub consumers: u64,
    /// The queues this node is master of.
    pub queues: Vec<QueueSample>,
    /// Resident memory of the process (0 when unknown).
    pub resident_memory_bytes: u64,
    /// The memory high watermark.
    pub memory_limit_bytes: u64,
    /// Whether the memory alarm is set.
    pub memory_alarm: bool,
    /// Open file descriptors, when the platform tells.
    pub open_fds: Option<u64>,
    /// The file descriptor limit, when the platform tells.
    pub max_fds: Option<u64>,
    /// `disk_free_limit_bytes`.
    pub disk_free_limit_bytes: u64,
    /// Seconds since the node started.
    pub uptime_seconds: f64,
    /// The metadata Raft group as this node sees it (cluster mode).
    pub raft: Option<RaftSample>,
}

/// One queue this node is master of.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueSample {
    /// Its vhost.
    pub vhost: String,
    /// Its name.
    pub name: String,
    /// Messages ready.
    pub ready: u64,
    /// Messages delivered and not yet acknowledged.
    pub unacked: u64,
    /// Consumers.
    pub consumers: u64,
    /// Body bytes of its ready messages.
    pub ready_bytes: u64,
    /// Mirrors besides the master.
    pub mirrors: u64,
    /// Of those, the ones recorded synchronised.
    pub synchronised_mirrors: u64,
}

/// The metadata Raft group, from this node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RaftSample {
    /// This node's id.
    pub node_id: u64,
    /// The current term.
    pub term: u64,
    /// The highest index applied here (committed).
    pub applied_index: u64,
    /// The highest index in this node's log.
    pub last_log_index: u64,
    /// The leader this node knows.
    pub leader: Option<u64>,
}
