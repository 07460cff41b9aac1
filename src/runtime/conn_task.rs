//! Drives one client connection: socket reads and writes, timers, outbox wake-ups, the memory
//! alarm and shutdown, all fed to the sans-IO [`Connection`].

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{watch, Notify};
use tracing::Instrument;

use super::clock::Clock;
use crate::broker::{Broker, Outbox};
use crate::session::{Connection, PeerInfo, SessionConfig};

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
}

const READ_CHUNK: usize = 64 * 1024;

/// Runs a connection to completion.
pub async fn run<S>(stream: S, peer: SocketAddr, mut ctx: ConnContext)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let notify = Arc::new(Notify::new());
    let waker = notify.clone();
    let outbox = Arc::new(Outbox::new(
        ctx.outbound_bytes_max,
        Box::new(move || waker.notify_one()),
    ));
    let clock = ctx.clock;
    let info = PeerInfo {
        addr: peer.to_string(),
        is_loopback: peer.ip().is_loopback(),
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
        let mut eof = false;
        // A watch whose sender is gone answers `changed()` at once forever: stop polling it.
        let mut shutdown_open = true;
        let mut alarm_open = true;
        if *ctx.alarm.borrow() {
            session.handle_alarm(true, clock.now());
        }
        loop {
            let now = clock.now();
            // Bytes left over from a read that stopped early (alarm) are parsed once allowed.
            if !rbuf.is_empty() && session.wants_read() {
                let used = session.handle_bytes(&rbuf, now);
                rbuf.advance(used);
            }
            session.handle_outbox(now);
            if wpos == wbuf.len() {
                wbuf.clear();
                wpos = 0;
            }
            session.poll_transmit_into(&mut wbuf, now);
            let finished = session.is_finished() || eof;
            if finished && wpos == wbuf.len() {
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
                r = wr.write(&wbuf[wpos..]), if wpos < wbuf.len() => {
                    match r {
                        Ok(0) | Err(_) => { eof = true; wbuf.clear(); wpos = 0; }
                        Ok(n) => wpos += n,
                    }
                }
                r = rd.read_buf(&mut rbuf), if can_read => {
                    match r {
                        Ok(0) | Err(_) => eof = true,
                        Ok(_) => {
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
        let _ = wr.shutdown().await;
        tracing::debug!("connection task done");
    }
    .instrument(span)
    .await
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
