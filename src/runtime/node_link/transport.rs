//! [`TcpTransport`]: a node's listener, its links to peers, dialling with backoff, and
//! heartbeats.
//!
//! **One link per pair.** Either node may dial (lazily, on the first call, or from the
//! heartbeat tick that redials dead links), and once the `Hello` exchange is done the link is
//! symmetric: both ends send requests and answer them on it. When both nodes dial at once,
//! each keeps the link dialled by the lower node id and closes the other, so the pair
//! converges on one connection; a request that was on the closed one fails and openraft
//! retries it.
//!
//! **TLS.** With a [`LinkTls`] (`[cluster.tls]`) every link, dialled or accepted, runs the
//! TLS handshake before the `Hello` exchange, and a connection that fails it is refused
//! (and logged); there is no plaintext fallback. An accepted peer's certificate must also
//! name the host of the node it claims to be in its `Hello`. After the handshake both kinds
//! of link share the framing and every task below.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::wire::{Envelope, RemoteFailure, Service, PROTOCOL_VERSION};
use super::{LinkError, NodeLinkConfig};
use crate::runtime::raft::{NodeId, RaftTransport, RpcServer, TransportError};
use crate::runtime::tls::link::LinkTls;

mod link_tasks;

use link_tasks::{accept_loop, heartbeat_loop, kind, link_to};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere while holding one of these maps leaves it consistent (every update
    // is a single insert or remove), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

type Reply = Result<Vec<u8>, RemoteFailure>;

/// What a [`BrokerService`] answers: now, or once something finishes (a publish waits for
/// its fsync before the publisher's node may confirm it).
pub enum BrokerReply {
    /// The reply frame.
    Now(Vec<u8>),
    /// The reply frame, later.
    Later(std::pin::Pin<Box<dyn std::future::Future<Output = Vec<u8>> + Send>>),
}

/// The handler of [`Service::Broker`] requests. Called on the link's reader, one request at
/// a time in arrival order, so what one node sends another is applied in the order sent
/// (a publish before the ack that follows it); it must not block.
pub trait BrokerService: Send + Sync {
    /// Handles `payload` from node `from`.
    fn handle(&self, from: NodeId, payload: Bytes) -> BrokerReply;
}

/// The handler of [`Service::Gm`] requests: takes a frame (whose payloads may stay views of
/// it), returns the reply at once.
pub type GmService = Arc<dyn Fn(&Bytes) -> Vec<u8> + Send + Sync>;

/// One established connection to a peer.
struct Link {
    peer: NodeId,
    /// Who dialled it: decides which link survives when both nodes dial at once.
    dialer: NodeId,
    /// The connection's local and remote addresses, where the socket told them.
    addrs: (Option<SocketAddr>, Option<SocketAddr>),
    /// Bytes written to and read from the connection so far (its writer and reader
    /// count them; these follow after every write and read).
    sent: AtomicU64,
    received: AtomicU64,
    out: mpsc::Sender<Envelope>,
    pending: Mutex<HashMap<u64, oneshot::Sender<Reply>>>,
    next_id: AtomicU64,
    closed: CancellationToken,
}

impl Link {
    fn close(&self) {
        self.closed.cancel();
        // Dropping the senders wakes every waiting caller with an error.
        lock(&self.pending).clear();
    }

    async fn request(&self, service: Service, payload: Vec<u8>) -> Result<Vec<u8>, TransportError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, tx);
        // Removes the entry if the caller's deadline drops this future first.
        let _guard = PendingGuard { link: self, id };
        if self.closed.is_cancelled() {
            return Err(TransportError::Io("link closed".into()));
        }
        let env = Envelope::Request {
            id,
            service,
            payload: Bytes::from(payload),
        };
        if self.out.send(env).await.is_err() {
            return Err(TransportError::Io("link closed".into()));
        }
        match rx.await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => Err(TransportError::Unreachable {
                node: self.peer,
                reason: e.to_string(),
            }),
            Err(_) => Err(TransportError::Io("link closed during the call".into())),
        }
    }
}

struct PendingGuard<'a> {
    link: &'a Link,
    id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        lock(&self.link.pending).remove(&self.id);
    }
}

/// Redial pacing for one peer.
#[derive(Default)]
struct Backoff {
    failures: u32,
    next_attempt: Option<Instant>,
}

/// One open link as [`TcpTransport::link_stats`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkStats {
    /// The node at the other end.
    pub peer: NodeId,
    /// This end's address.
    pub sock_addr: Option<SocketAddr>,
    /// The other end's.
    pub peer_addr: Option<SocketAddr>,
    /// Bytes sent on it.
    pub send_bytes: u64,
    /// Bytes received on it.
    pub recv_bytes: u64,
}

struct Shared {
    cfg: NodeLinkConfig,
    local_addr: SocketAddr,
    /// Mutual TLS on every link when set; plaintext otherwise.
    tls: Option<LinkTls>,
    peers: Mutex<BTreeMap<NodeId, String>>,
    links: Mutex<BTreeMap<NodeId, Arc<Link>>>,
    /// Serialises dials to one peer (so concurrent callers share one attempt) and holds its
    /// backoff.
    dials: Mutex<BTreeMap<NodeId, Arc<tokio::sync::Mutex<Backoff>>>>,
    last_seen: Mutex<BTreeMap<NodeId, Instant>>,
    /// Peers whose address refused a connection since they were last heard from: nothing
    /// listens there, so the node is down (a killed process closes its port at once).
    refused: Mutex<BTreeMap<NodeId, Instant>>,
    /// Woken when a link ends or a peer's address refuses a connection, for the failure
    /// detector (its one waiter: see [`TcpTransport::peer_event`]).
    events: tokio::sync::Notify,
    /// This node's resource alarms, sent with every heartbeat.
    local_alarms: std::sync::atomic::AtomicU8,
    /// Each peer's resource alarms, as its last heartbeat said.
    peer_alarms: Mutex<BTreeMap<NodeId, u8>>,
    raft: Mutex<Option<RpcServer>>,
    broker: Mutex<Option<Arc<dyn BrokerService>>>,
    gm: Mutex<Option<GmService>>,
    stop: CancellationToken,
    /// Cancelled once the accept loop has dropped the listener, so the port is free again.
    listener_closed: CancellationToken,
}

/// One node's end of the cluster's TCP links. Clones share everything; pass one to
/// [`crate::runtime::raft::MetaRaft::start`] and keep another to [`serve`](Self::serve) its RPC
/// server, query liveness and [`shutdown`](Self::shutdown).
#[derive(Clone)]
pub struct TcpTransport {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("node", &self.shared.cfg.node_id)
            .field("local_addr", &self.shared.local_addr)
            .finish_non_exhaustive()
    }
}

impl TcpTransport {
    /// Listens on `listen` (`127.0.0.1:0` picks a port; see [`local_addr`](Self::local_addr))
    /// and starts the accept loop and the heartbeat tick.
    pub async fn bind(listen: &str, cfg: NodeLinkConfig) -> Result<TcpTransport, LinkError> {
        TcpTransport::bind_with_tls(listen, cfg, None).await
    }

    /// [`bind`](Self::bind), with every link over mutual TLS when `tls` is set: only
    /// accepts, and only dials, peers whose certificate chains to the cluster's CA.
    pub async fn bind_with_tls(
        listen: &str,
        cfg: NodeLinkConfig,
        tls: Option<LinkTls>,
    ) -> Result<TcpTransport, LinkError> {
        let listener = TcpListener::bind(listen).await?;
        let local_addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            peers: Mutex::new(cfg.peers.clone()),
            cfg,
            local_addr,
            tls,
            links: Mutex::new(BTreeMap::new()),
            dials: Mutex::new(BTreeMap::new()),
            last_seen: Mutex::new(BTreeMap::new()),
            refused: Mutex::new(BTreeMap::new()),
            events: tokio::sync::Notify::new(),
            local_alarms: std::sync::atomic::AtomicU8::new(0),
            peer_alarms: Mutex::new(BTreeMap::new()),
            raft: Mutex::new(None),
            broker: Mutex::new(None),
            gm: Mutex::new(None),
            stop: CancellationToken::new(),
            listener_closed: CancellationToken::new(),
        });
        tokio::spawn(accept_loop(Arc::clone(&shared), listener));
        tokio::spawn(heartbeat_loop(Arc::clone(&shared)));
        Ok(TcpTransport { shared })
    }

    /// The address the listener got.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local_addr
    }

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.shared.cfg.node_id
    }

    /// Adds or moves a peer: it may connect to us, and we keep a link to it.
    pub fn set_peer(&self, node: NodeId, addr: impl Into<String>) {
        if node != self.shared.cfg.node_id {
            lock(&self.shared.peers).insert(node, addr.into());
        }
    }

    /// Forgets a peer and closes its link.
    pub fn remove_peer(&self, node: NodeId) {
        lock(&self.shared.peers).remove(&node);
        if let Some(link) = lock(&self.shared.links).remove(&node) {
            link.close();
        }
    }

    /// Delivers incoming Raft requests to `server` (replacing a previous one).
    pub fn serve(&self, server: RpcServer) {
        *lock(&self.shared.raft) = Some(server);
    }

    /// Delivers incoming broker requests to `service`.
    pub fn serve_broker(&self, service: Arc<dyn BrokerService>) {
        *lock(&self.shared.broker) = Some(service);
    }

    /// Delivers incoming GM frames to `service` (a [`crate::runtime::gm_host::GmHost`]'s
    /// `handle_frame`).
    pub fn serve_gm(&self, service: GmService) {
        *lock(&self.shared.gm) = Some(service);
    }

    /// Queues a [`Service::Broker`] request for `node` (dialling it if needed) and returns
    /// the receiver of its reply. Requests queued by one caller reach the peer in the order
    /// queued; only the wait for room on the link is awaited here, not the reply.
    pub async fn send_broker(
        &self,
        node: NodeId,
        payload: Vec<u8>,
    ) -> Result<oneshot::Receiver<Reply>, TransportError> {
        if payload.len() + 64 > self.shared.cfg.max_frame {
            return Err(TransportError::Io(format!(
                "request of {} bytes exceeds the {}-byte frame limit",
                payload.len(),
                self.shared.cfg.max_frame
            )));
        }
        let link = link_to(&self.shared, node, None).await?;
        let id = link.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&link.pending).insert(id, tx);
        let env = Envelope::Request {
            id,
            service: Service::Broker,
            payload: Bytes::from(payload),
        };
        if link.closed.is_cancelled() || link.out.send(env).await.is_err() {
            lock(&link.pending).remove(&id);
            return Err(TransportError::Io("link closed".into()));
        }
        Ok(rx)
    }

    /// When a frame last arrived from `node`, if ever.
    pub fn last_seen(&self, node: NodeId) -> Option<Instant> {
        lock(&self.shared.last_seen).get(&node).copied()
    }

    /// The failure detector: whether `node` was heard from within the configured
    /// `peer_timeout`.
    pub fn peer_alive(&self, node: NodeId) -> bool {
        self.last_seen(node)
            .is_some_and(|t| t.elapsed() < self.shared.cfg.peer_timeout)
    }

    /// Returns when a link has ended or a peer's address refused a connection since the
    /// last call returned (at once if one did meanwhile). Meant for one waiter, the failure
    /// detector's task.
    pub async fn peer_event(&self) {
        self.shared.events.notified().await;
    }

    /// Whether `node`'s address refused a connection since it was last heard from (its
    /// process is gone: the failure detector need not wait for `peer_timeout`).
    pub fn peer_refused(&self, node: NodeId) -> bool {
        // Only a node heard from before: at start, peers not up yet refuse too.
        self.last_seen(node).is_some()
            && lock(&self.shared.refused).contains_key(&node)
            && self.shared.live_link(node).is_none()
    }

    /// Sets this node's resource alarms (`broker::alarm` bits), which every heartbeat
    /// from now on carries.
    pub fn set_local_alarms(&self, alarms: u8) {
        self.shared
            .local_alarms
            .store(alarms, std::sync::atomic::Ordering::Relaxed);
    }

    /// Each peer's resource alarms as its last heartbeat said (peers never heard from are
    /// missing; whether a peer is still up is the failure detector's call).
    pub fn peer_alarms(&self) -> BTreeMap<NodeId, u8> {
        lock(&self.shared.peer_alarms).clone()
    }

    /// The open links: each peer's addresses and the bytes sent and received.
    pub fn link_stats(&self) -> Vec<LinkStats> {
        lock(&self.shared.links)
            .iter()
            .filter(|(_, l)| !l.closed.is_cancelled())
            .map(|(&peer, l)| LinkStats {
                peer,
                sock_addr: l.addrs.0,
                peer_addr: l.addrs.1,
                send_bytes: l.sent.load(Ordering::Relaxed),
                recv_bytes: l.received.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// Peers with an open link right now.
    pub fn connected_peers(&self) -> Vec<NodeId> {
        lock(&self.shared.links)
            .iter()
            .filter(|(_, l)| !l.closed.is_cancelled())
            .map(|(&id, _)| id)
            .collect()
    }

    /// Stops listening, closes every link and stops redialling. Calls fail from now on.
    pub fn shutdown(&self) {
        self.shared.stop.cancel();
        let links = std::mem::take(&mut *lock(&self.shared.links));
        for link in links.values() {
            link.close();
        }
        *lock(&self.shared.raft) = None;
        *lock(&self.shared.broker) = None;
        *lock(&self.shared.gm) = None;
    }

    /// Waits until the listener is closed after [`shutdown`](Self::shutdown): the accept loop
    /// drops it on its next poll, and binding the same port before that fails.
    pub async fn closed(&self) {
        self.shared.listener_closed.cancelled().await;
    }
}

impl crate::runtime::gm_host::GmNet for TcpTransport {
    async fn call(
        &self,
        to: NodeId,
        frame: Vec<u8>,
        deadline: Duration,
    ) -> Result<Vec<u8>, TransportError> {
        // As for Raft: a frame the peer must refuse would cost the link.
        if frame.len() + 64 > self.shared.cfg.max_frame {
            return Err(TransportError::Io(format!(
                "GM frame of {} bytes exceeds the {}-byte frame limit",
                frame.len(),
                self.shared.cfg.max_frame
            )));
        }
        let work = async {
            let link = link_to(&self.shared, to, None).await?;
            link.request(Service::Gm, frame).await
        };
        tokio::time::timeout(deadline, work)
            .await
            .map_err(|_| TransportError::Timeout)?
    }
}

impl RaftTransport for TcpTransport {
    async fn call(
        &self,
        target: NodeId,
        addr: &str,
        frame: Vec<u8>,
        deadline: Duration,
    ) -> Result<Vec<u8>, TransportError> {
        let shared = &self.shared;
        // Leave room for the envelope around the payload; sending a frame the peer must
        // refuse would only cost us the link.
        if frame.len() + 64 > shared.cfg.max_frame {
            return Err(TransportError::Io(format!(
                "request of {} bytes exceeds the {}-byte frame limit",
                frame.len(),
                shared.cfg.max_frame
            )));
        }
        let work = async {
            let link = link_to(shared, target, Some(addr)).await?;
            link.request(Service::Raft, frame).await
        };
        tokio::time::timeout(deadline, work)
            .await
            .map_err(|_| TransportError::Timeout)?
    }
}

impl Shared {
    fn live_link(&self, peer: NodeId) -> Option<Arc<Link>> {
        lock(&self.links)
            .get(&peer)
            .filter(|l| !l.closed.is_cancelled())
            .cloned()
    }

    fn dial_state(&self, peer: NodeId) -> Arc<tokio::sync::Mutex<Backoff>> {
        Arc::clone(lock(&self.dials).entry(peer).or_default())
    }

    fn seen(&self, peer: NodeId) {
        lock(&self.last_seen).insert(peer, Instant::now());
        lock(&self.refused).remove(&peer);
    }

    fn alarms_of(&self, peer: NodeId, alarms: u8) {
        lock(&self.peer_alarms).insert(peer, alarms);
    }

    /// Why `hello` is not acceptable, if it is not.
    fn check_hello(&self, env: &Envelope) -> Result<NodeId, String> {
        match env {
            Envelope::Hello {
                cluster_id,
                node_id,
                version,
            } => {
                if *cluster_id != self.cfg.cluster_id {
                    Err(format!("wrong cluster id {cluster_id:?}"))
                } else if *version != PROTOCOL_VERSION {
                    Err(format!(
                        "protocol version {version}, we speak {PROTOCOL_VERSION}"
                    ))
                } else if *node_id == self.cfg.node_id {
                    Err(format!("node id {node_id} is our own"))
                } else if !lock(&self.peers).contains_key(node_id) {
                    Err(format!("unknown node {node_id}"))
                } else {
                    Ok(*node_id)
                }
            }
            other => Err(format!("expected Hello, got {}", kind(other))),
        }
    }

    /// Why a TLS peer claiming to be `peer` is not: its certificate must name the host of
    /// `peer`'s registered link address, as the dialler's check of the acceptor does.
    fn check_certificate(
        &self,
        peer: NodeId,
        certificate: Option<&rustls::pki_types::CertificateDer<'_>>,
    ) -> Result<(), String> {
        let certificate = certificate.ok_or("no peer certificate")?;
        let addr = lock(&self.peers)
            .get(&peer)
            .cloned()
            .ok_or_else(|| format!("unknown node {peer}"))?;
        LinkTls::check_names(certificate, &addr)
            .map_err(|e| format!("node {peer} is registered at {addr}, but {e}"))
    }

    fn hello(&self) -> Envelope {
        Envelope::Hello {
            cluster_id: self.cfg.cluster_id.clone(),
            node_id: self.cfg.node_id,
            version: PROTOCOL_VERSION,
        }
    }

    /// Installs `link` unless a preferable one to the same peer is open; returns the link
    /// that now serves the peer and whether it is the new one.
    fn install(&self, link: &Arc<Link>) -> (Arc<Link>, bool) {
        let preferred = self.cfg.node_id.min(link.peer);
        let mut links = lock(&self.links);
        if let Some(cur) = links.get(&link.peer) {
            let keep_current =
                !cur.closed.is_cancelled() && (cur.dialer == preferred || link.dialer != preferred);
            if keep_current {
                return (Arc::clone(cur), false);
            }
            cur.close();
        }
        links.insert(link.peer, Arc::clone(link));
        (Arc::clone(link), true)
    }

    fn remove_link(&self, link: &Arc<Link>) {
        let mut links = lock(&self.links);
        if links.get(&link.peer).is_some_and(|l| Arc::ptr_eq(l, link)) {
            links.remove(&link.peer);
        }
    }
}
