//! A link's life: dialling a peer (with backoff) or accepting one, the hello exchange, and
//! the reader, writer and heartbeat loops of an open link.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{lock, Backoff, BrokerReply, Link, Shared};
use crate::runtime::node_link::wire::{
    Envelope, FrameReader, FrameWriter, LinkRead, LinkWrite, RemoteFailure, Service,
};
use crate::runtime::node_link::LinkError;
use crate::runtime::raft::{NodeId, TransportError};
use crate::runtime::tls::link::LinkTls;

pub(super) fn kind(env: &Envelope) -> &'static str {
    match env {
        Envelope::Hello { .. } => "Hello",
        Envelope::Refused { .. } => "Refused",
        Envelope::Request { .. } => "Request",
        Envelope::Response { .. } => "Response",
        Envelope::Heartbeat { .. } => "Heartbeat",
    }
}

/// The open link to `peer`, dialling it if there is none (and its backoff allows).
pub(super) async fn link_to(
    shared: &Arc<Shared>,
    peer: NodeId,
    addr: Option<&str>,
) -> Result<Arc<Link>, TransportError> {
    if shared.stop.is_cancelled() {
        return Err(TransportError::Unreachable {
            node: peer,
            reason: "transport shut down".into(),
        });
    }
    if let Some(link) = shared.live_link(peer) {
        return Ok(link);
    }
    let addr = {
        let mut peers = lock(&shared.peers);
        match addr {
            // Raft's membership is authoritative for the addresses it calls.
            Some(a) if peer != shared.cfg.node_id => {
                peers.insert(peer, a.to_string());
                a.to_string()
            }
            _ => peers
                .get(&peer)
                .cloned()
                .ok_or(TransportError::Unreachable {
                    node: peer,
                    reason: "no address known".into(),
                })?,
        }
    };
    let dial = shared.dial_state(peer);
    let mut backoff = dial.lock().await;
    // Another caller may have connected (or the peer dialled us) while we waited.
    if let Some(link) = shared.live_link(peer) {
        return Ok(link);
    }
    if backoff.next_attempt.is_some_and(|t| Instant::now() < t) {
        return Err(TransportError::Unreachable {
            node: peer,
            reason: "backing off before redialling".into(),
        });
    }
    let attempt = tokio::time::timeout(shared.cfg.connect_timeout, dial_peer(shared, peer, &addr));
    let err = match attempt.await {
        Ok(Ok(link)) => {
            *backoff = Backoff::default();
            return Ok(link);
        }
        Ok(Err(e)) => e,
        Err(_) => LinkError::Timeout,
    };
    if matches!(&err, LinkError::Io(e) if e.kind() == std::io::ErrorKind::ConnectionRefused) {
        lock(&shared.refused)
            .entry(peer)
            .or_insert_with(Instant::now);
        shared.events.notify_one();
    }
    // Doubling from backoff_min, capped, so a dead peer costs a dial now and then.
    let exp = backoff.failures.min(16);
    let wait = shared
        .cfg
        .backoff_min
        .saturating_mul(1u32 << exp)
        .min(shared.cfg.backoff_max);
    backoff.failures = backoff.failures.saturating_add(1);
    backoff.next_attempt = Some(Instant::now() + wait);
    if backoff.failures == 1 {
        tracing::warn!(node = shared.cfg.node_id, peer, %addr, "cannot link to peer: {err}");
    } else {
        tracing::debug!(node = shared.cfg.node_id, peer, %addr, retry_in = ?wait, "cannot link to peer: {err}");
    }
    Err(TransportError::Unreachable {
        node: peer,
        reason: err.to_string(),
    })
}

/// Connects to `addr` from the link listener's own address when it names one (not
/// `0.0.0.0`): a node's links then come from the address it is known by, so a firewall
/// rule (or a fault test) can single out one node's traffic on a shared host.
pub(super) async fn connect_from(local: SocketAddr, addr: &str) -> std::io::Result<TcpStream> {
    if local.ip().is_unspecified() {
        return TcpStream::connect(addr).await;
    }
    let mut last = None;
    for target in tokio::net::lookup_host(addr).await? {
        if target.is_ipv4() != local.is_ipv4() {
            continue;
        }
        let socket = if target.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        socket.bind(SocketAddr::new(local.ip(), 0))?;
        match socket.connect(target).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    match last {
        Some(e) => Err(e),
        // No address of the listener's family: let the system choose.
        None => TcpStream::connect(addr).await,
    }
}

/// The boxed halves of a plaintext link (tokio's split without a lock).
pub(super) fn tcp_halves(stream: TcpStream) -> (LinkRead, LinkWrite) {
    let (rd, wr) = stream.into_split();
    (Box::new(rd), Box::new(wr))
}

/// The boxed halves of a TLS link: one session, so the halves share it through tokio's
/// split (a lock held only while a poll runs).
pub(super) fn tls_halves<S>(stream: S) -> (LinkRead, LinkWrite)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (rd, wr) = tokio::io::split(stream);
    (Box::new(rd), Box::new(wr))
}

/// Connects to `peer` at `addr` and runs the `Hello` exchange (after the TLS handshake on a
/// TLS cluster).
pub(super) async fn dial_peer(
    shared: &Arc<Shared>,
    peer: NodeId,
    addr: &str,
) -> Result<Arc<Link>, LinkError> {
    let stream = connect_from(shared.local_addr, addr).await?;
    // Raft RPCs are small and latency-bound.
    stream.set_nodelay(true)?;
    let addrs = (stream.local_addr().ok(), stream.peer_addr().ok());
    let (rd, wr) = match &shared.tls {
        None => tcp_halves(stream),
        Some(tls) => tls_halves(tls.connect(addr, stream).await.map_err(LinkError::Tls)?),
    };
    let mut reader = FrameReader::new(rd, shared.cfg.max_frame);
    let mut writer = FrameWriter::new(wr, shared.cfg.max_frame);
    writer.send(&shared.hello()).await?;
    let answer = reader
        .next()
        .await?
        .ok_or_else(|| LinkError::Handshake("peer closed during the handshake".into()))?;
    if let Envelope::Refused { reason } = answer {
        return Err(LinkError::Refused(reason));
    }
    let got = shared.check_hello(&answer).map_err(LinkError::Handshake)?;
    if got != peer {
        return Err(LinkError::Handshake(format!(
            "{addr} is node {got}, expected node {peer}"
        )));
    }
    Ok(start_link(
        shared,
        peer,
        shared.cfg.node_id,
        addrs,
        reader,
        writer,
    ))
}

pub(super) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        let accepted = tokio::select! {
            _ = shared.stop.cancelled() => {
                drop(listener);
                shared.listener_closed.cancel();
                return;
            }
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, from)) => {
                tokio::spawn(accept_one(Arc::clone(&shared), stream, from));
            }
            Err(e) => {
                // Typically out of file descriptors: pause instead of spinning.
                tracing::warn!(node = shared.cfg.node_id, "accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

pub(super) async fn accept_one(shared: Arc<Shared>, stream: TcpStream, from: SocketAddr) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!("set_nodelay on a link from {from}: {e}");
    }
    let addrs = (stream.local_addr().ok(), Some(from));
    // The TLS peer's certificate, to bind the node id its `Hello` claims.
    let mut certificate = None;
    let (rd, wr) = match &shared.tls {
        None => tcp_halves(stream),
        Some(tls) => {
            match tokio::time::timeout(shared.cfg.connect_timeout, tls.accept(stream)).await {
                Ok(Ok(s)) => {
                    certificate = LinkTls::peer_certificate(&s);
                    tls_halves(s)
                }
                Ok(Err(e)) => {
                    // A peer without a certificate from the cluster's CA, or one that does not
                    // speak TLS: an operator should know someone tries to link.
                    tracing::warn!(node = shared.cfg.node_id, %from, "refusing link: TLS handshake failed: {e}");
                    return;
                }
                Err(_) => {
                    tracing::warn!(node = shared.cfg.node_id, %from, "refusing link: no TLS handshake in time");
                    return;
                }
            }
        }
    };
    let mut reader = FrameReader::new(rd, shared.cfg.max_frame);
    let mut writer = FrameWriter::new(wr, shared.cfg.max_frame);
    let first = match tokio::time::timeout(shared.cfg.connect_timeout, reader.next()).await {
        Ok(Ok(Some(env))) => env,
        Ok(Ok(None)) => return,
        Ok(Err(e)) => {
            tracing::warn!(node = shared.cfg.node_id, %from, "closing link before handshake: {e}");
            return;
        }
        Err(_) => {
            tracing::warn!(node = shared.cfg.node_id, %from, "no Hello in time; closing link");
            return;
        }
    };
    let checked = shared.check_hello(&first).and_then(|peer| {
        if shared.tls.is_some() {
            shared.check_certificate(peer, certificate.as_ref())?;
        }
        Ok(peer)
    });
    let peer = match checked {
        Ok(peer) => peer,
        Err(reason) => {
            tracing::warn!(node = shared.cfg.node_id, %from, "refusing link: {reason}");
            // Best effort: the dialer logs the reason if it gets it.
            let refusal = Envelope::Refused { reason };
            let _ = tokio::time::timeout(shared.cfg.connect_timeout, writer.send(&refusal)).await;
            return;
        }
    };
    if let Err(e) = writer.send(&shared.hello()).await {
        tracing::debug!(
            node = shared.cfg.node_id,
            peer,
            "handshake answer failed: {e}"
        );
        return;
    }
    start_link(&shared, peer, peer, addrs, reader, writer);
}

/// Registers a handshaken connection and starts its reader and writer tasks; returns the
/// link that serves `peer` afterwards (an existing one if it is preferred).
pub(super) fn start_link(
    shared: &Arc<Shared>,
    peer: NodeId,
    dialer: NodeId,
    addrs: (Option<SocketAddr>, Option<SocketAddr>),
    reader: FrameReader,
    writer: FrameWriter,
) -> Arc<Link> {
    shared.seen(peer);
    let (out, rx) = mpsc::channel(shared.cfg.queue_depth.max(1));
    let link = Arc::new(Link {
        peer,
        dialer,
        addrs,
        sent: AtomicU64::new(writer.bytes_written()),
        received: AtomicU64::new(reader.bytes_read()),
        out,
        pending: Mutex::new(HashMap::new()),
        next_id: AtomicU64::new(0),
        closed: shared.stop.child_token(),
    });
    let (serving, fresh) = shared.install(&link);
    if !fresh {
        // Dropping the halves closes the duplicate connection; the peer drops it too.
        tracing::debug!(node = shared.cfg.node_id, peer, "duplicate link closed");
        return serving;
    }
    let tls = shared.tls.is_some();
    tracing::info!(node = shared.cfg.node_id, peer, dialer, tls, "link up");
    tokio::spawn(write_loop(Arc::clone(&link), rx, writer));
    tokio::spawn(read_loop(Arc::clone(shared), Arc::clone(&link), reader));
    link
}

pub(super) async fn write_loop(
    link: Arc<Link>,
    mut rx: mpsc::Receiver<Envelope>,
    mut writer: FrameWriter,
) {
    loop {
        let env = tokio::select! {
            _ = link.closed.cancelled() => return,
            env = rx.recv() => match env {
                Some(env) => env,
                None => return,
            },
        };
        // What else is already queued goes out in the same write (up to WRITE_BATCH_BYTES):
        // nothing waits for more, so a lone frame leaves at once, as before.
        let mut result = writer.push(&env);
        while result.is_ok() && writer.pushed() < WRITE_BATCH_BYTES {
            match rx.try_recv() {
                Ok(env) => result = writer.push(&env),
                Err(_) => break,
            }
        }
        if let Err(e) = match result {
            Ok(()) => writer.write_pushed().await,
            Err(e) => Err(e),
        } {
            tracing::warn!(peer = link.peer, "link write failed, closing: {e}");
            link.close();
            return;
        }
        link.sent.store(writer.bytes_written(), Ordering::Relaxed);
    }
}

/// Bytes of queued envelopes a link writes at once, at most (a frame bigger than that goes
/// alone).
const WRITE_BATCH_BYTES: usize = 256 * 1024;

pub(super) async fn read_loop(shared: Arc<Shared>, link: Arc<Link>, mut reader: FrameReader) {
    let me = shared.cfg.node_id;
    let peer = link.peer;
    // Whether the link ended from the other side (or its bytes), not by a close here.
    let mut ended_there = true;
    loop {
        let next = tokio::select! {
            _ = link.closed.cancelled() => {
                ended_there = false;
                break;
            }
            n = reader.next() => n,
        };
        link.received.store(reader.bytes_read(), Ordering::Relaxed);
        let env = match next {
            Ok(Some(env)) => env,
            Ok(None) => {
                tracing::info!(node = me, peer, "link closed by peer");
                break;
            }
            Err(e) => {
                tracing::warn!(node = me, peer, "closing link: {e}");
                break;
            }
        };
        shared.seen(peer);
        match env {
            Envelope::Heartbeat { alarms } => shared.alarms_of(peer, alarms),
            Envelope::Request {
                id,
                service: Service::Raft,
                payload,
            } => {
                let server = lock(&shared.raft).clone();
                let out = link.out.clone();
                // Each request runs on its own task so a slow append never delays a vote.
                tokio::spawn(async move {
                    let result = match server {
                        Some(s) => Ok(s.handle(&payload).await),
                        None => Err(RemoteFailure::NotServing),
                    };
                    // The link may have closed meanwhile; the caller then sees that.
                    let _ = out.send(Envelope::Response { id, result }).await;
                });
            }
            Envelope::Request {
                id,
                service: Service::Gm,
                payload,
            } => {
                let service = lock(&shared.gm).clone();
                let result = match service {
                    Some(s) => Ok(s(&payload)),
                    None => Err(RemoteFailure::NotServing),
                };
                let env = Envelope::Response { id, result };
                let out = link.out.clone();
                // As for broker replies: never wait on our own writer from the reader.
                if let Err(mpsc::error::TrySendError::Full(env)) = out.try_send(env) {
                    tokio::spawn(async move {
                        let _ = out.send(env).await;
                    });
                }
            }
            Envelope::Request {
                id,
                service: Service::Broker,
                payload,
            } => {
                let service = lock(&shared.broker).clone();
                let reply = match service {
                    Some(s) => s.handle(peer, payload),
                    None => BrokerReply::Now(Vec::new()),
                };
                let out = link.out.clone();
                match reply {
                    BrokerReply::Now(frame) => {
                        let env = Envelope::Response {
                            id,
                            result: Ok(frame),
                        };
                        // Never wait on our own writer here: if both nodes' readers waited
                        // for their writers while each peer's reader waited too, the link
                        // would deadlock. Replies are matched by id, so order is free.
                        if let Err(mpsc::error::TrySendError::Full(env)) = out.try_send(env) {
                            tokio::spawn(async move {
                                let _ = out.send(env).await;
                            });
                        }
                    }
                    BrokerReply::Later(fut) => {
                        tokio::spawn(async move {
                            let frame = fut.await;
                            let _ = out
                                .send(Envelope::Response {
                                    id,
                                    result: Ok(frame),
                                })
                                .await;
                        });
                    }
                }
            }
            Envelope::Response { id, result } => {
                if let Some(tx) = lock(&link.pending).remove(&id) {
                    // The caller may have given up (deadline); its answer is then dropped.
                    let _ = tx.send(result);
                }
            }
            other @ (Envelope::Hello { .. } | Envelope::Refused { .. }) => {
                tracing::warn!(node = me, peer, "closing link: unexpected {}", kind(&other));
                break;
            }
        }
    }
    link.close();
    shared.remove_link(&link);
    shared.events.notify_one();
    // The peer's process may have exited: dial it again now, so that a refused connection
    // reaches the failure detector at once, not at the next heartbeat tick.
    if ended_there && !shared.stop.is_cancelled() && shared.live_link(peer).is_none() {
        let dial = shared.dial_state(peer);
        if dial.try_lock().is_ok() {
            tokio::spawn(async move {
                let _ = link_to(&shared, peer, None).await;
            });
        }
    }
}

pub(super) async fn heartbeat_loop(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(shared.cfg.heartbeat_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shared.stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let peers: Vec<NodeId> = lock(&shared.peers).keys().copied().collect();
        let alarms = shared
            .local_alarms
            .load(std::sync::atomic::Ordering::Relaxed);
        for peer in peers {
            match shared.live_link(peer) {
                // A full queue means frames are flowing anyway; skipping is fine (the
                // alarms go with a later heartbeat).
                Some(link) => {
                    let _ = link.out.try_send(Envelope::Heartbeat { alarms });
                }
                None => {
                    // Redial in the background (the backoff paces it) so a slow connect to
                    // one dead peer does not delay heartbeats to the others. Skip if a dial
                    // is already under way.
                    let dial = shared.dial_state(peer);
                    if dial.try_lock().is_ok() {
                        let shared = Arc::clone(&shared);
                        tokio::spawn(async move {
                            let _ = link_to(&shared, peer, None).await;
                        });
                    }
                }
            }
        }
    }
}
