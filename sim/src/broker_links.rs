//! [`SimBrokerLinks`]: the relay's node links ([`BrokerLinks`]) over turmoil's TCP, so the
//! node's own [`warren::runtime::relay::Relay`] carries publishes, deliveries and acks
//! between simulated nodes.
//!
//! A request is a [`Kind::Broker`] frame of [`crate::transport`]'s format whose body is
//! `[u64 sender][payload]`; the answer is `[1][reply]`, or `[0]` while the node serves no
//! relay yet ([`RemoteFailure::NotServing`]). One connection per peer carries this node's
//! requests, written in the order [`BrokerLinks::send_broker`] queued them; the peer
//! handles them on the connection's reader in arrival order, as a node link does.
//!
//! **When a link is given up.** A node link closes when its peer is silent longer than the
//! peer timeout (heartbeats), and everything waiting on it fails. turmoil's TCP does not
//! retransmit and has no heartbeats of its own, so a link here is closed when the failure
//! detector has not heard the peer for [`SILENT_MS`] (the input it keeps from every frame
//! and ping, `last_seen`), or when a request waited [`STALLED_MS`] while nothing at all
//! came back on the link (a segment dropped by a one-way cut leaves a hole no reply
//! crosses). The relay then sees its waits fail, as on a node link that closed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot};
use turmoil::net::TcpStream;
use warren::runtime::node_link::{
    BrokerAnswer, BrokerLinks, BrokerReply, BrokerService, RemoteFailure, SendBroker,
};
use warren::runtime::raft::{NodeId, TransportError};

use crate::scenario::addr;
use crate::trace::Trace;
use crate::transport::{read_frame, Kind};
use crate::{lock, now_ms};

/// A link whose peer the failure detector has not heard for this long is closed.
pub const SILENT_MS: u64 = 2_000;
/// A link on which a request waited this long with nothing read back is closed.
pub const STALLED_MS: u64 = 3_000;
/// The longest a dial may take (a dial into a partition hangs).
const DIAL_MS: u64 = 1_000;

/// One connection to a peer.
struct Link {
    peer: NodeId,
    out: mpsc::UnboundedSender<Vec<u8>>,
    /// Requests sent, by id: their reply's sender and when they were sent.
    pending: Mutex<BTreeMap<u64, (oneshot::Sender<BrokerAnswer>, u64)>>,
    next_id: AtomicU64,
    closed: AtomicBool,
    /// When something last came back on this link.
    last_read: AtomicU64,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Link {
    fn close(&self, trace: &Trace, me: NodeId, why: &str) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        trace.log(format!("n{me} relay link to n{} closed: {why}", self.peer));
        // Dropping the senders fails every wait on this link.
        lock(&self.pending).clear();
        for t in lock(&self.tasks).drain(..) {
            t.abort();
        }
    }
}

type Slot = Arc<tokio::sync::Mutex<Option<Arc<Link>>>>;

struct Inner {
    me: NodeId,
    trace: Trace,
    /// When this node's failure detector last heard each peer (simulated ms).
    last_seen: Arc<Mutex<BTreeMap<NodeId, u64>>>,
    service: Mutex<Option<Arc<dyn BrokerService>>>,
    links: Mutex<BTreeMap<NodeId, Slot>>,
}

/// One simulated node's relay links. Clones share them.
#[derive(Clone)]
pub struct SimBrokerLinks {
    inner: Arc<Inner>,
}

impl SimBrokerLinks {
    /// Links of node `me`, given up on a peer its failure detector stopped hearing
    /// (`last_seen`, simulated ms).
    pub fn new(
        me: NodeId,
        trace: Trace,
        last_seen: Arc<Mutex<BTreeMap<NodeId, u64>>>,
    ) -> SimBrokerLinks {
        let links = SimBrokerLinks {
            inner: Arc::new(Inner {
                me,
                trace,
                last_seen,
                service: Mutex::new(None),
                links: Mutex::new(BTreeMap::new()),
            }),
        };
        tokio::spawn(watch(Arc::downgrade(&links.inner)));
        links
    }

    /// Handles a [`Kind::Broker`] request body now, on the connection's reader, and returns
    /// the future of its answer.
    pub fn serve_request(
        &self,
        body: Vec<u8>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Vec<u8>>>> {
        let service = lock(&self.inner.service).clone();
        let (Some(service), Some(from)) = (service, body.get(..8)) else {
            return Box::pin(std::future::ready(vec![0]));
        };
        let mut id = [0u8; 8];
        id.copy_from_slice(from);
        let from = u64::from_be_bytes(id);
        let payload = Bytes::from(body).slice(8..);
        match service.handle(from, payload) {
            BrokerReply::Now(reply) => Box::pin(std::future::ready(answer(reply))),
            BrokerReply::Later(later) => Box::pin(async move { answer(later.await) }),
        }
    }

    fn slot(&self, node: NodeId) -> Slot {
        Arc::clone(lock(&self.inner.links).entry(node).or_default())
    }

    async fn link(&self, node: NodeId) -> Result<Arc<Link>, TransportError> {
        let slot = self.slot(node);
        let mut cur = slot.lock().await;
        if let Some(l) = cur.as_ref().filter(|l| !l.closed.load(Ordering::SeqCst)) {
            return Ok(Arc::clone(l));
        }
        let unreachable = |reason: String| TransportError::Unreachable { node, reason };
        let stream = match tokio::time::timeout(
            Duration::from_millis(DIAL_MS),
            TcpStream::connect(addr(node)),
        )
        .await
        {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(unreachable(e.to_string())),
            Err(_) => return Err(unreachable("dial timed out".into())),
        };
        let (mut read, mut write) = stream.into_split();
        let (out, mut frames) = mpsc::unbounded_channel::<Vec<u8>>();
        let link = Arc::new(Link {
            peer: node,
            out,
            pending: Mutex::new(BTreeMap::new()),
            next_id: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            last_read: AtomicU64::new(now_ms()),
            tasks: Mutex::new(Vec::new()),
        });
        let (me, trace) = (self.inner.me, self.inner.trace.clone());
        let reader = {
            let (link, trace) = (Arc::clone(&link), trace.clone());
            tokio::spawn(async move {
                let why = loop {
                    let (id, body) = match read_frame(&mut read).await {
                        Ok(f) => f,
                        Err(e) => break e.to_string(),
                    };
                    link.last_read.store(now_ms(), Ordering::SeqCst);
                    let Some((tx, _)) = lock(&link.pending).remove(&id) else {
                        continue;
                    };
                    let answer = match body.split_first() {
                        Some((1, reply)) => Ok(reply.to_vec()),
                        _ => Err(RemoteFailure::NotServing),
                    };
                    let _ = tx.send(answer);
                };
                link.close(&trace, me, &why);
            })
        };
        let writer = {
            let (link, trace) = (Arc::clone(&link), trace.clone());
            tokio::spawn(async move {
                while let Some(frame) = frames.recv().await {
                    if let Err(e) = write.write_all(&frame).await {
                        link.close(&trace, me, &e.to_string());
                        return;
                    }
                }
            })
        };
        lock(&link.tasks).extend([reader, writer]);
        trace.log(format!("n{me} relay link to n{node} open"));
        *cur = Some(Arc::clone(&link));
        Ok(link)
    }

    async fn send(
        &self,
        node: NodeId,
        payload: Vec<u8>,
    ) -> Result<oneshot::Receiver<BrokerAnswer>, TransportError> {
        let link = self.link(node).await?;
        let id = link.next_id.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = oneshot::channel();
        let now = now_ms();
        {
            let mut pending = lock(&link.pending);
            if pending.is_empty() {
                // The stall clock starts with the first request outstanding.
                link.last_read.store(now, Ordering::SeqCst);
            }
            pending.insert(id, (tx, now));
        }
        let mut frame = Vec::with_capacity(payload.len() + 21);
        frame.extend_from_slice(&((payload.len() + 17) as u32).to_be_bytes());
        frame.extend_from_slice(&id.to_be_bytes());
        frame.push(Kind::Broker as u8);
        frame.extend_from_slice(&self.inner.me.to_be_bytes());
        frame.extend_from_slice(&payload);
        if link.closed.load(Ordering::SeqCst) || link.out.send(frame).is_err() {
            lock(&link.pending).remove(&id);
            return Err(TransportError::Io("link closed".into()));
        }
        Ok(rx)
    }
}

fn answer(reply: Vec<u8>) -> Vec<u8> {
    let mut a = Vec::with_capacity(reply.len() + 1);
    a.push(1);
    a.extend_from_slice(&reply);
    a
}

/// Closes links to silent peers and stalled links, every 100 ms, while the links exist.
async fn watch(inner: std::sync::Weak<Inner>) {
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let now = now_ms();
        let slots: Vec<(NodeId, Slot)> = lock(&inner.links)
            .iter()
            .map(|(n, s)| (*n, Arc::clone(s)))
            .collect();
        for (node, slot) in slots {
            let Ok(cur) = slot.try_lock() else {
                continue;
            };
            let Some(link) = cur.as_ref().filter(|l| !l.closed.load(Ordering::SeqCst)) else {
                continue;
            };
            let heard = lock(&inner.last_seen).get(&node).copied();
            if heard.is_some_and(|h| now.saturating_sub(h) > SILENT_MS) {
                link.close(&inner.trace, inner.me, "peer silent");
                continue;
            }
            let oldest = lock(&link.pending).values().map(|(_, at)| *at).min();
            let last_read = link.last_read.load(Ordering::SeqCst);
            if oldest.is_some_and(|at| now.saturating_sub(at.max(last_read)) > STALLED_MS) {
                link.close(&inner.trace, inner.me, "stalled");
            }
        }
    }
}

impl BrokerLinks for SimBrokerLinks {
    fn send_broker(&self, node: NodeId, payload: Vec<u8>) -> SendBroker<'_> {
        Box::pin(self.send(node, payload))
    }

    fn serve_broker(&self, service: Arc<dyn BrokerService>) {
        *lock(&self.inner.service) = Some(service);
    }
}
