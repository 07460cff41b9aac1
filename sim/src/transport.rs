//! [`TurmoilTransport`]: a [`RaftTransport`] over turmoil's simulated TCP.
//!
//! Wire format, both directions: `[u32 length][u64 id][body]`, where a request body starts
//! with a one-byte [`Kind`]. One connection per (caller, target address) carries every call;
//! replies are matched to calls by id. Each call has a deadline.
//!
//! turmoil's TCP does not retransmit: a segment dropped by a partition leaves a hole in the
//! stream, so a connection that saw a timeout or an error is thrown away and the next call
//! dials again. A dial into a partition hangs until the caller's deadline.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use turmoil::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use turmoil::net::{TcpListener, TcpStream};
use warren::runtime::raft::{NodeId, RaftTransport, TransportError};

use crate::lock;
use crate::trace::Trace;

/// Largest frame body accepted.
const MAX_FRAME: usize = 16 << 20;

/// What a request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A Raft RPC frame for the node's [`warren::runtime::raft::RpcServer`].
    Raft = 0,
    /// A client proposal (see [`crate::scenario`]).
    Propose = 1,
    /// A GM frame for the host's [`warren::runtime::gm_host::GmHost`].
    Gm = 2,
    /// A liveness probe for the failure detector (answered empty).
    Ping = 3,
    /// A client's request to a node's broker (see [`crate::mirror_scenario`]).
    Client = 4,
    /// A relay request for the node's [`warren::runtime::node_link::BrokerService`] (see
    /// [`crate::broker_links`]); handled on the connection's reader, in arrival order.
    Broker = 5,
}

/// One open connection to a peer address.
struct Conn {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pending: Mutex<BTreeMap<u64, oneshot::Sender<Vec<u8>>>>,
    next_id: AtomicU64,
    closed: AtomicBool,
    reader: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Conn {
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        // Dropping the senders wakes every waiting caller with an error.
        lock(&self.pending).clear();
        if let Some(h) = lock(&self.reader).take() {
            h.abort();
        }
    }
}

/// The connection to one address, behind an async lock so concurrent callers share a dial.
type Slot = Arc<tokio::sync::Mutex<Option<Arc<Conn>>>>;

struct Inner {
    name: String,
    trace: Trace,
    /// Per target address: the current connection.
    conns: Mutex<BTreeMap<String, Slot>>,
}

/// One simulated host's client side. Clones share connections.
#[derive(Clone)]
pub struct TurmoilTransport {
    inner: Arc<Inner>,
}

impl TurmoilTransport {
    /// A transport for host `name` (used in trace lines), logging connection events to
    /// `trace`.
    pub fn new(name: impl Into<String>, trace: Trace) -> TurmoilTransport {
        TurmoilTransport {
            inner: Arc::new(Inner {
                name: name.into(),
                trace,
                conns: Mutex::new(BTreeMap::new()),
            }),
        }
    }

    fn slot(&self, addr: &str) -> Slot {
        Arc::clone(lock(&self.inner.conns).entry(addr.to_string()).or_default())
    }

    async fn conn(&self, addr: &str) -> std::io::Result<Arc<Conn>> {
        let slot = self.slot(addr);
        let mut cur = slot.lock().await;
        if let Some(c) = cur.as_ref().filter(|c| !c.closed.load(Ordering::SeqCst)) {
            return Ok(Arc::clone(c));
        }
        let stream = TcpStream::connect(addr).await?;
        self.inner
            .trace
            .log(format!("{} connected to {addr}", self.inner.name));
        let (read, write) = stream.into_split();
        let conn = Arc::new(Conn {
            writer: tokio::sync::Mutex::new(write),
            pending: Mutex::new(BTreeMap::new()),
            next_id: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            reader: Mutex::new(None),
        });
        let h = tokio::spawn(read_replies(read, Arc::clone(&conn)));
        *lock(&conn.reader) = Some(h);
        *cur = Some(Arc::clone(&conn));
        Ok(conn)
    }

    /// Drops the connection to `addr` if it is still `conn`.
    async fn discard(&self, addr: &str, conn: &Arc<Conn>, why: &str) {
        conn.close();
        let slot = self.slot(addr);
        let mut cur = slot.lock().await;
        if cur.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
            *cur = None;
            self.inner
                .trace
                .log(format!("{} dropped link to {addr}: {why}", self.inner.name));
        }
    }

    /// Sends a `kind` request to `addr` and waits for the reply, at most `deadline`.
    pub async fn request(
        &self,
        addr: &str,
        kind: Kind,
        body: &[u8],
        deadline: Duration,
    ) -> Result<Vec<u8>, RequestError> {
        let mut used: Option<Arc<Conn>> = None;
        let work = async {
            let conn = self.conn(addr).await.map_err(RequestError::Connect)?;
            used = Some(Arc::clone(&conn));
            let id = conn.next_id.fetch_add(1, Ordering::SeqCst);
            let (tx, rx) = oneshot::channel();
            lock(&conn.pending).insert(id, tx);
            let mut frame = Vec::with_capacity(body.len() + 13);
            frame.extend_from_slice(&((body.len() + 9) as u32).to_be_bytes());
            frame.extend_from_slice(&id.to_be_bytes());
            frame.push(kind as u8);
            frame.extend_from_slice(body);
            conn.writer
                .lock()
                .await
                .write_all(&frame)
                .await
                .map_err(RequestError::Io)?;
            rx.await.map_err(|_| {
                RequestError::Io(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "connection closed during the call",
                ))
            })
        };
        let result = match tokio::time::timeout(deadline, work).await {
            Ok(r) => r,
            Err(_) => Err(RequestError::Timeout),
        };
        if let Err(e) = &result {
            // No retransmission in turmoil: a connection that lost anything is useless.
            if let Some(c) = &used {
                self.discard(addr, c, &e.to_string()).await;
            }
        }
        result
    }
}

/// Why a request got no reply.
#[derive(Debug)]
pub enum RequestError {
    /// Could not connect (refused: host down or not listening yet).
    Connect(std::io::Error),
    /// The connection broke.
    Io(std::io::Error),
    /// The deadline passed (a partition drops segments silently).
    Timeout,
}

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RequestError::Connect(e) => write!(f, "connect: {e}"),
            RequestError::Io(e) => write!(f, "io: {e}"),
            RequestError::Timeout => write!(f, "timed out"),
        }
    }
}

pub(crate) async fn read_frame(read: &mut OwnedReadHalf) -> std::io::Result<(u64, Vec<u8>)> {
    let len = read.read_u32().await? as usize;
    if !(8..=MAX_FRAME).contains(&len) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("bad frame length {len}"),
        ));
    }
    let id = read.read_u64().await?;
    let mut body = vec![0; len - 8];
    read.read_exact(&mut body).await?;
    Ok((id, body))
}

async fn read_replies(mut read: OwnedReadHalf, conn: Arc<Conn>) {
    while let Ok((id, body)) = read_frame(&mut read).await {
        if let Some(tx) = lock(&conn.pending).remove(&id) {
            let _ = tx.send(body);
        }
    }
    conn.closed.store(true, Ordering::SeqCst);
    lock(&conn.pending).clear();
}

impl RaftTransport for TurmoilTransport {
    async fn call(
        &self,
        target: NodeId,
        addr: &str,
        frame: Vec<u8>,
        deadline: Duration,
    ) -> Result<Vec<u8>, TransportError> {
        match self.request(addr, Kind::Raft, &frame, deadline).await {
            Ok(reply) => Ok(reply),
            Err(RequestError::Timeout) => Err(TransportError::Timeout),
            Err(RequestError::Connect(e)) => Err(TransportError::Unreachable {
                node: target,
                reason: e.to_string(),
            }),
            Err(RequestError::Io(e)) => Err(TransportError::Io(e.to_string())),
        }
    }
}

/// A request handler: gets the kind and body, returns the reply body. It is called on the
/// connection's reader, in arrival order, and what it does before returning its future
/// happens in that order too (a [`Kind::Broker`] request is handled there).
pub type Handler = Arc<dyn Fn(Kind, Vec<u8>) -> Pin<Box<dyn Future<Output = Vec<u8>>>>>;

/// Told the caller's address of every request frame received (before it is handled).
pub type Hearing = Arc<dyn Fn(IpAddr)>;

/// Accepts connections on `listener` forever and answers every request with `handler`.
/// Runs on the host's (single-threaded) runtime, so nothing here needs to be `Send`.
pub async fn serve(listener: TcpListener, handler: Handler) {
    serve_hearing(listener, handler, Arc::new(|_| {})).await
}

/// [`serve`], telling `heard` of each request frame's sender first, as the node links tell
/// the failure detector of every frame (`runtime::node_link`).
pub async fn serve_hearing(listener: TcpListener, handler: Handler, heard: Hearing) {
    loop {
        let Ok((stream, from)) = listener.accept().await else {
            continue;
        };
        let conn = serve_conn(stream, Arc::clone(&handler), Arc::clone(&heard), from.ip());
        tokio::task::spawn_local(conn);
    }
}

async fn serve_conn(stream: TcpStream, handler: Handler, heard: Hearing, from: IpAddr) {
    let (mut read, mut write) = stream.into_split();
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let writer = tokio::task::spawn_local(async move {
        while let Some(frame) = rx.recv().await {
            if write.write_all(&frame).await.is_err() {
                break;
            }
        }
    });
    while let Ok((id, mut body)) = read_frame(&mut read).await {
        if body.is_empty() {
            break;
        }
        heard(from);
        let kind = match body.remove(0) {
            0 => Kind::Raft,
            1 => Kind::Propose,
            2 => Kind::Gm,
            3 => Kind::Ping,
            4 => Kind::Client,
            5 => Kind::Broker,
            _ => break,
        };
        let reply = handler(kind, body);
        let tx = tx.clone();
        tokio::task::spawn_local(async move {
            let reply = reply.await;
            let mut frame = Vec::with_capacity(reply.len() + 12);
            frame.extend_from_slice(&((reply.len() + 8) as u32).to_be_bytes());
            frame.extend_from_slice(&id.to_be_bytes());
            frame.extend_from_slice(&reply);
            let _ = tx.send(frame);
        });
    }
    drop(tx);
    writer.abort();
}
