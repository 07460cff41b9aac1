//! Drives one client connection: socket reads and writes, timers, outbox wake-ups, the memory
//! alarm, shutdown and metadata commits, all fed to the sans-IO [`Connection`]. The driver
//! is generic over the stream: plaintext TCP and TLS sessions ([`super::tls`]) run the same
//! code.
//!
//! # Metadata commands
//! The session does not apply declares, deletes and bindings: it emits them
//! ([`Connection::poll_meta`]) and parks the channel that asked. The task starts each command
//! on a [`MetaCommit`], in emission order, keeps the commits in flight and feeds every result
//! back with [`Connection::handle_meta_result`]. [`LocalMeta`] (a single node) applies the
//! command to the broker inside `commit`, so its result is ready at once and reaches the
//! session in the same turn of the loop, before anything is written: the client sees the
//! bytes it saw when the session applied commands itself. A cluster implementation proposes
//! the command to the metadata Raft group and resolves once it is committed and applied; the
//! loop then waits for it in its `select!` while reads, writes, other channels and heartbeats
//! go on. Commands emitted by the teardown are committed even after the socket is gone.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{watch, Notify};
use tracing::Instrument;

use super::clock::Clock;
use crate::broker::registry::SocketCounters;
use crate::broker::remote::{CallFuture, QueueReply};
use crate::broker::{Broker, Outbox};
use crate::meta::Command;
use crate::session::{Connection, MetaResult, MetaToken, PeerInfo, SessionConfig, TlsPeer};
use crate::time::Instant;

#[cfg(test)]
mod tests;

/// What every connection task shares.
#[derive(Clone)]
pub struct ConnContext {
    /// The broker.
    pub broker: Arc<Broker>,
    /// Session settings.
    pub session: SessionConfig,
    /// The node clock.
    pub clock: Clock,
    /// Flips to true on shutdown.
    pub shutdown: watch::Receiver<bool>,
    /// The memory alarm.
    pub alarm: watch::Receiver<bool>,
    /// Outbox credit per connection.
    pub outbound_bytes_max: usize,
    /// The node's span: every connection span is its child.
    pub node_span: tracing::Span,
    /// Where the sessions' metadata commands are committed.
    pub meta: Arc<dyn MetaCommit>,
}

const READ_CHUNK: usize = 64 * 1024;
/// How long the end of a connection waits for its last write (TLS: close_notify).
const SHUTDOWN_WRITE: std::time::Duration = std::time::Duration::from_secs(5);

/// A metadata command being committed; resolves to what [`Broker::apply`] returns.
pub type MetaFuture = Pin<Box<dyn Future<Output = MetaResult> + Send>>;

/// Commits the metadata commands sessions emit.
pub trait MetaCommit: Send + Sync {
    /// Starts committing `command`. A connection calls this in the order its session emitted
    /// the commands (an exclusive queue's declare before its owner's `DeleteExclusiveQueues`),
    /// so an implementation must not reorder what it starts.
    fn commit(&self, command: Command, now: Instant) -> MetaFuture;
}

/// A single node: commands are applied to the local broker at once.
#[derive(Debug, Clone)]
pub struct LocalMeta {
    broker: Arc<Broker>,
}

impl LocalMeta {
    /// Commits to `broker`.
    pub fn new(broker: Arc<Broker>) -> LocalMeta {
        LocalMeta { broker }
    }
}

impl MetaCommit for LocalMeta {
    fn commit(&self, command: Command, now: Instant) -> MetaFuture {
        // Applied here rather than when first polled: the order of calls is the order applied.
        Box::pin(std::future::ready(self.broker.apply(&command, now)))
    }
}

/// One connection's commits and queue calls in flight, oldest first. Bounded by the
/// session: one per parked channel plus the teardown's.
#[derive(Default)]
struct InFlight {
    commits: Vec<(MetaToken, MetaFuture)>,
    calls: Vec<(MetaToken, CallFuture)>,
}

/// A finished commit or queue call.
enum Done {
    Commit(MetaResult),
    Call(QueueReply),
}

impl InFlight {
    fn is_empty(&self) -> bool {
        self.commits.is_empty() && self.calls.is_empty()
    }

    /// Starts the session's next command, once the previous one has finished: a
    /// connection's commands are committed one at a time, so they apply in the order the
    /// session emitted them even where each travels on its own (forwarded from a follower
    /// to the Raft leader, two proposals could otherwise overtake each other). Queue calls
    /// start at once: the relay keeps them in order per node.
    fn start(&mut self, session: &mut Connection, meta: &dyn MetaCommit, clock: &Clock) {
        while let Some((token, call)) = session.poll_queue_call() {
            let link = call.queue().link.clone();
            self.calls.push((token, link.call(call)));
        }
        if !self.commits.is_empty() {
            return;
        }
        if let Some((token, command)) = session.poll_meta() {
            self.commits
                .push((token, meta.commit(command, clock.now())));
        }
    }

    /// Polls everything once: the finished ones (commits in order), or `Pending` when none
    /// finished (each unfinished one has registered the task's waker).
    fn poll_finished(&mut self, cx: &mut Context<'_>) -> Poll<Vec<(MetaToken, Done)>> {
        let mut finished = Vec::new();
        let mut i = 0;
        while i < self.commits.len() {
            match self.commits[i].1.as_mut().poll(cx) {
                Poll::Ready(result) => {
                    let (token, _) = self.commits.remove(i);
                    finished.push((token, Done::Commit(result)));
                }
                Poll::Pending => i += 1,
            }
        }
        let mut i = 0;
        while i < self.calls.len() {
            match self.calls[i].1.as_mut().poll(cx) {
                Poll::Ready(reply) => {
                    let (token, _) = self.calls.remove(i);
                    finished.push((token, Done::Call(reply)));
                }
                Poll::Pending => i += 1,
            }
        }
        if finished.is_empty() {
            Poll::Pending
        } else {
            Poll::Ready(finished)
        }
    }
}

/// Hands finished commits and calls back to the session.
fn feed(session: &mut Connection, finished: Vec<(MetaToken, Done)>, clock: &Clock) {
    for (token, done) in finished {
        match done {
            Done::Commit(result) => session.handle_meta_result(token, result, clock.now()),
            Done::Call(reply) => session.handle_queue_reply(token, reply, clock.now()),
        }
    }
}

/// Starts what the session emitted and feeds back every result that is ready, repeating while
/// results make the session emit more. Returns whether any result was fed.
async fn settle_meta(
    session: &mut Connection,
    in_flight: &mut InFlight,
    meta: &dyn MetaCommit,
    clock: &Clock,
) -> bool {
    let mut fed = false;
    loop {
        in_flight.start(session, meta, clock);
        if in_flight.is_empty() {
            return fed;
        }
        // One poll, without waiting: what is not finished is left to the select.
        let polled = std::future::poll_fn(|cx| Poll::Ready(in_flight.poll_finished(cx))).await;
        let Poll::Ready(finished) = polled else {
            return fed;
        };
        feed(session, finished, clock);
        fed = true;
    }
}

/// Commits everything still emitted or in flight (the teardown's deletions) to the end.
async fn drain_meta(
    session: &mut Connection,
    in_flight: &mut InFlight,
    meta: &dyn MetaCommit,
    clock: &Clock,
) {
    loop {
        settle_meta(session, in_flight, meta, clock).await;
        if in_flight.is_empty() {
            return;
        }
        let finished = std::future::poll_fn(|cx| in_flight.poll_finished(cx)).await;
        feed(session, finished, clock);
    }
}

/// Runs a connection to completion, committing metadata through the node's `MetaCommit`.
/// `stream` is a TCP socket or a TLS session over one (`tls` then describes it to the
/// session); the same driver serves both.
pub async fn run<S>(
    stream: S,
    peer: SocketAddr,
    local: SocketAddr,
    tls: Option<TlsPeer>,
    ctx: ConnContext,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let meta = ctx.meta.clone();
    run_with_meta(stream, peer, local, tls, ctx, meta).await
}

/// Runs a connection to completion, committing metadata through `meta`.
pub async fn run_with_meta<S>(
    stream: S,
    peer: SocketAddr,
    local: SocketAddr,
    tls: Option<TlsPeer>,
    mut ctx: ConnContext,
    meta: Arc<dyn MetaCommit>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let notify = Arc::new(Notify::new());
    let waker = notify.clone();
    let outbox = Arc::new(Outbox::new(
        ctx.outbound_bytes_max,
        Box::new(move || waker.notify_one()),
    ));
    let clock = ctx.clock;
    let socket = Arc::new(SocketCounters::default());
    let info = PeerInfo {
        addr: peer.to_string(),
        is_loopback: peer.ip().is_loopback(),
        host: peer.ip().to_string(),
        port: peer.port(),
        local_host: local.ip().to_string(),
        local_port: local.port(),
        tls,
        connected_at: unix_millis(),
        socket: socket.clone(),
    };
    let mut session = Connection::new(
        ctx.broker.clone(),
        ctx.session.clone(),
        info,
        outbox,
        clock.now(),
    );
    let span = tracing::info_span!(parent: &ctx.node_span, "conn", id = session.id(), peer = %peer);
    async move {
        let (mut rd, mut wr) = tokio::io::split(stream);
        let mut rbuf = BytesMut::with_capacity(READ_CHUNK);
        let mut wbuf: Vec<u8> = Vec::with_capacity(READ_CHUNK);
        let mut wpos = 0usize;
        // A TLS stream may keep encrypted bytes after `write` returned (the socket was
        // full): they leave with a flush. TCP flushes at once.
        let mut unflushed = false;
        let mut eof = false;
        let mut in_flight = InFlight::default();
        // A watch whose sender is gone answers `changed()` at once forever: stop polling it.
        let mut shutdown_open = true;
        let mut alarm_open = true;
        if *ctx.alarm.borrow() {
            session.handle_alarm(true, clock.now());
        }
        loop {
            let now = clock.now();
            loop {
                // Bytes left over from a read that stopped early (alarm, parked channels full)
                // are parsed once allowed.
                if !rbuf.is_empty() && session.wants_read() {
                    let used = session.handle_bytes(&rbuf, now);
                    rbuf.advance(used);
                }
                // Metadata results come back before anything is written; one may unpark a
                // channel and let the session take more of the buffer.
                let fed = settle_meta(&mut session, &mut in_flight, meta.as_ref(), &clock).await;
                if !fed || rbuf.is_empty() || !session.wants_read() {
                    break;
                }
            }
            session.handle_outbox(now);
            if wpos == wbuf.len() {
                wbuf.clear();
                wpos = 0;
            }
            session.poll_transmit_into(&mut wbuf, now);
            let finished = session.is_finished() || eof;
            if finished && wpos == wbuf.len() && !unflushed {
                break;
            }
            let deadline = session.poll_timeout().map(|t| clock.to_tokio(t));
            let can_read = !finished && session.wants_read();
            tokio::select! {
                biased;
                r = ctx.shutdown.changed(), if shutdown_open => {
                    if r.is_err() {
                        shutdown_open = false;
                        session.handle_shutdown(clock.now());
                    } else if *ctx.shutdown.borrow_and_update() {
                        session.handle_shutdown(clock.now());
                    }
                }
                r = ctx.alarm.changed(), if alarm_open => {
                    match r {
                        Ok(()) => {
                            let on = *ctx.alarm.borrow_and_update();
                            session.handle_alarm(on, clock.now());
                        }
                        Err(_) => alarm_open = false,
                    }
                }
                done = std::future::poll_fn(|cx| in_flight.poll_finished(cx)),
                    if !in_flight.is_empty() =>
                {
                    feed(&mut session, done, &clock);
                }
                r = write_or_flush(&mut wr, &wbuf[wpos..]), if wpos < wbuf.len() || unflushed => {
                    match r {
                        Written::Bytes(Ok(0) | Err(_)) => { eof = true; wbuf.clear(); wpos = 0; }
                        Written::Bytes(Ok(n)) => {
                            socket.sent(n);
                            wpos += n;
                            if wpos == wbuf.len() {
                                // One try without waiting; what is left waits for the
                                // next turn's flush.
                                match try_flush(&mut wr).await {
                                    Poll::Ready(Ok(())) => unflushed = false,
                                    Poll::Ready(Err(_)) => eof = true,
                                    Poll::Pending => unflushed = true,
                                }
                            }
                        }
                        Written::Flushed(r) => {
                            unflushed = false;
                            if r.is_err() {
                                eof = true;
                            }
                        }
                    }
                }
                r = rd.read_buf(&mut rbuf), if can_read => {
                    match r {
                        Ok(0) | Err(_) => eof = true,
                        Ok(n) => {
                            socket.received(n);
                            let used = session.handle_bytes(&rbuf, clock.now());
                            rbuf.advance(used);
                            if rbuf.capacity() - rbuf.len() < 4096 {
                                rbuf.reserve(READ_CHUNK);
                            }
                        }
                    }
                }
                _ = notify.notified() => {}
                _ = sleep_until(deadline), if deadline.is_some() => {
                    session.handle_timeout(clock.now());
                }
            }
            if eof && !session.is_finished() {
                session.handle_disconnect(clock.now());
            }
        }
        session.handle_disconnect(clock.now());
        // The teardown's deletions (exclusive and auto-delete queues) are committed although
        // the client is gone; their results reach a finished session, which drops them.
        drain_meta(&mut session, &mut in_flight, meta.as_ref(), &clock).await;
        // TLS sends close_notify here, which a client that stopped reading never takes.
        let _ = tokio::time::timeout(SHUTDOWN_WRITE, wr.shutdown()).await;
        tracing::debug!("connection task done");
    }
    .instrument(span)
    .await
}

/// What [`write_or_flush`] did.
enum Written {
    /// Wrote some of the bytes.
    Bytes(std::io::Result<usize>),
    /// Had nothing to write and flushed.
    Flushed(std::io::Result<()>),
}

/// Writes `buf`, or flushes when it is empty (bytes a TLS stream kept back).
async fn write_or_flush<W: AsyncWrite + Unpin>(wr: &mut W, buf: &[u8]) -> Written {
    if buf.is_empty() {
        Written::Flushed(wr.flush().await)
    } else {
        Written::Bytes(wr.write(buf).await)
    }
}

/// Polls `wr`'s flush once: `Pending` leaves the task's waker registered.
async fn try_flush<W: AsyncWrite + Unpin>(wr: &mut W) -> Poll<std::io::Result<()>> {
    std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *wr).poll_flush(cx))).await
}

/// Wall-clock time in milliseconds since the Unix epoch (0 for a clock set before 1970).
fn unix_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
