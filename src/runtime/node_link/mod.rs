//! Node links: the TCP connections between the nodes of a cluster, plaintext or mutual TLS
//! (`[cluster.tls]`, [`crate::runtime::tls::link`]).
//!
//! One connection per pair of nodes carries every request between them (today the metadata
//! Raft RPCs; later GM activity, forwarded publishes and deliveries) as length-delimited
//! frames of bincode-encoded [`wire::Envelope`]s. A link starts with a `Hello` exchange that
//! refuses other clusters and unknown nodes; requests are matched to responses by id and
//! bounded by the caller's deadline; a dropped link is redialled with capped exponential
//! backoff; every frame counts as a heartbeat, and [`TcpTransport::peer_alive`] is the failure
//! detector the layers above use.
//!
//! - [`wire`]: the envelope and the framing.
//! - [`transport`]: [`TcpTransport`], the listener, links, dialling and heartbeats; it
//!   implements [`crate::runtime::raft::RaftTransport`].

pub mod transport;
pub mod wire;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::runtime::raft::{NodeId, TransportError};

pub use transport::{BrokerReply, BrokerService, GmService, LinkStats, TcpTransport};
pub use wire::RemoteFailure;

/// A peer's answer to a [`BrokerLinks::send_broker`] request.
pub type BrokerAnswer = Result<Vec<u8>, RemoteFailure>;

/// What [`BrokerLinks::send_broker`] returns once the request is queued on the link.
pub type SendBroker<'a> = Pin<
    Box<dyn Future<Output = Result<oneshot::Receiver<BrokerAnswer>, TransportError>> + Send + 'a>,
>;

/// What the relay needs of the node links: ordered broker requests to a peer, and a
/// handler for the peer's. [`TcpTransport`] in a node; the simulation has its own over
/// turmoil's sockets, so the same relay runs there.
pub trait BrokerLinks: Send + Sync + 'static {
    /// Queues a broker request for `node` and returns the receiver of its reply. Requests
    /// one caller queues reach the peer, and are handled there, in the order queued; only
    /// the wait for room on the link is awaited here.
    fn send_broker(&self, node: NodeId, payload: Vec<u8>) -> SendBroker<'_>;
    /// Hands every broker request from a peer to `service`, on the link's reader, in
    /// arrival order.
    fn serve_broker(&self, service: Arc<dyn BrokerService>);
}

impl BrokerLinks for TcpTransport {
    fn send_broker(&self, node: NodeId, payload: Vec<u8>) -> SendBroker<'_> {
        Box::pin(TcpTransport::send_broker(self, node, payload))
    }

    fn serve_broker(&self, service: Arc<dyn BrokerService>) {
        TcpTransport::serve_broker(self, service)
    }
}

/// Settings of one node's links.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeLinkConfig {
    /// Shared by every node of the cluster; a peer with another id is refused.
    pub cluster_id: String,
    /// This node.
    pub node_id: NodeId,
    /// Known peers (id → `host:port`). Only these may connect; addresses may be added later
    /// with [`TcpTransport::set_peer`] (a Raft call also teaches the address it targets).
    pub peers: BTreeMap<NodeId, String>,
    /// Largest frame body accepted or sent; a bigger one closes the link.
    pub max_frame: usize,
    /// How often a heartbeat goes out on each link (and dead links are redialled).
    pub heartbeat_interval: Duration,
    /// A peer not heard from for this long is considered down.
    pub peer_timeout: Duration,
    /// Longest wait for a TCP connect plus the `Hello` exchange.
    pub connect_timeout: Duration,
    /// Wait before the first redial of a failed peer; doubles on each failure...
    pub backoff_min: Duration,
    /// ...up to this.
    pub backoff_max: Duration,
    /// Envelopes queued for a link's writer before senders wait.
    pub queue_depth: usize,
}

impl NodeLinkConfig {
    /// Defaults for node `node_id` of cluster `cluster_id`, with no peers yet.
    pub fn new(cluster_id: impl Into<String>, node_id: NodeId) -> NodeLinkConfig {
        NodeLinkConfig {
            cluster_id: cluster_id.into(),
            node_id,
            peers: BTreeMap::new(),
            // Room for openraft's 3 MiB snapshot chunks and big append batches.
            max_frame: 16 << 20,
            heartbeat_interval: Duration::from_millis(200),
            peer_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(2),
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_secs(5),
            queue_depth: 1024,
        }
    }
}

/// Why a link failed or could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The socket failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The framing is broken (oversized length prefix, truncated frame).
    #[error("bad frame: {0}")]
    Frame(String),
    /// A frame body is not a valid envelope.
    #[error("undecodable frame: {0}")]
    Decode(bincode::Error),
    /// An envelope could not be encoded (too big for `max_frame`).
    #[error("cannot encode frame: {0}")]
    Encode(bincode::Error),
    /// The `Hello` exchange failed or the peer was refused.
    #[error("handshake: {0}")]
    Handshake(String),
    /// The TLS handshake failed (no certificate, one from another CA, a name that does not
    /// match, or a peer that does not speak TLS).
    #[error("TLS handshake: {0}")]
    Tls(std::io::Error),
    /// The peer refused us, with its reason.
    #[error("refused by peer: {0}")]
    Refused(String),
    /// No answer in time.
    #[error("timed out")]
    Timeout,
}
