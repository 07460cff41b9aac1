//! Producer: one connection, one channel, publishing to the default exchange.
//!
//! The publishing loop owns the socket's write half (behind an async mutex)
//! and writes many pre-encoded messages per syscall; a reader task handles
//! confirms (basic.ack / basic.nack), returns and closes.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, channel, connection, AMQPClass};
use amq_protocol::uri::AMQPUri;
use anyhow::{anyhow, Context, Result};
use bytes::{Buf, BytesMut};
use tokio::io::AsyncWriteExt;
use tokio::sync::{Mutex as AsyncMutex, Semaphore};

use super::amqp::{self, Conn, FRAME_BODY, FRAME_END, FRAME_METHOD};
use super::stats::Stats;
use super::stream::{Rd, Wr};

const CH: u16 = 1;
/// Upper bounds for one write batch.
const BATCH_MSGS: usize = 512;
const BATCH_BYTES: usize = 128 * 1024;

#[derive(Clone)]
pub struct ProducerCfg {
    pub queue: String,
    pub size: usize,
    pub persistent: bool,
    /// Max outstanding unconfirmed messages; 0 = confirms off.
    pub confirm: usize,
    /// msg/s cap; 0 = unlimited.
    pub rate: u64,
    /// Messages to publish then stop; 0 = unlimited.
    pub count: u64,
}

/// Send timestamps of unconfirmed messages, indexed by delivery tag.
struct Pending {
    /// Delivery tag of `slots[0]`.
    base: u64,
    /// Send time (ns) or SETTLED.
    slots: VecDeque<u64>,
    outstanding: u64,
}

const SETTLED: u64 = u64::MAX;

impl Pending {
    /// Settle `tag` (and all before it if `multiple`). Returns how many
    /// messages were newly settled; pushes their latency into `lat` if given.
    fn settle(
        &mut self,
        tag: u64,
        multiple: bool,
        now: u64,
        mut lat: Option<&mut Vec<u64>>,
    ) -> u64 {
        if tag < self.base {
            return 0;
        }
        let idx = (tag - self.base) as usize;
        if idx >= self.slots.len() {
            return 0; // unknown tag
        }
        let from = if multiple { 0 } else { idx };
        let mut n = 0;
        for slot in self.slots.range_mut(from..=idx) {
            if *slot != SETTLED {
                if let Some(l) = lat.as_deref_mut() {
                    l.push(now.saturating_sub(*slot));
                }
                *slot = SETTLED;
                n += 1;
            }
        }
        while self.slots.front() == Some(&SETTLED) {
            self.slots.pop_front();
            self.base += 1;
        }
        self.outstanding -= n;
        n
    }
}

struct Shared {
    /// The channel or connection can no longer be used for publishing.
    dead: AtomicBool,
    pending: Mutex<Pending>,
    window: Option<Semaphore>,
}

impl Shared {
    fn kill(&self) {
        self.dead.store(true, Relaxed);
        if let Some(w) = &self.window {
            w.close();
        }
    }
}

/// Connect, open the channel and enable confirms if asked.
pub async fn setup(uri: &AMQPUri, label: &str, cfg: &ProducerCfg) -> Result<Conn> {
    let mut c = Conn::open(uri, label).await?;
    let r = async {
        c.channel_open(CH).await?;
        if cfg.confirm > 0 {
            c.confirm_select(CH).await?;
        }
        Ok(())
    }
    .await;
    match r {
        Ok(()) => Ok(c),
        Err(e) => {
            amqp::close_quietly(c).await;
            Err(e)
        }
    }
}

/// Run one producer until the stop signal (or its --count is done).
pub async fn run(conn: Conn, cfg: ProducerCfg, stats: Arc<Stats>) {
    let label = conn.label.clone();
    let frame_max = conn.frame_max as usize;
    let Conn { rd, wr, rbuf, .. } = conn;
    let wr = Arc::new(AsyncMutex::new(wr));
    let sh = Arc::new(Shared {
        dead: AtomicBool::new(false),
        pending: Mutex::new(Pending {
            base: 1,
            slots: VecDeque::new(),
            outstanding: 0,
        }),
        window: (cfg.confirm > 0).then(|| Semaphore::new(cfg.confirm)),
    });
    let reader = {
        let (wr, sh, stats, label) = (wr.clone(), sh.clone(), stats.clone(), label.clone());
        tokio::spawn(async move {
            let r = read_loop(rd, rbuf, &wr, &sh, &stats, &label).await;
            sh.kill();
            if let Err(e) = r {
                stats.fail(format!("{e:#}"));
            }
        })
    };

    if let Err(e) = publish_loop(&cfg, frame_max, &wr, &sh, &stats).await {
        if !sh.dead.load(Relaxed) {
            stats.fail(format!("{label}: {e:#}"));
        }
    }
    if cfg.count > 0 {
        stats.producers_done_ns.fetch_max(stats.now_ns(), Relaxed);
        stats.producers_done.fetch_add(1, Relaxed);
    }

    // Orderly close: channel.close; the reader answers close-ok with
    // connection.close and returns on connection.close-ok.
    {
        let mut w = wr.lock().await;
        if !sh.dead.load(Relaxed) {
            let mut buf = Vec::new();
            if amqp::encode(&mut buf, &amqp::channel_close_frame(CH)).is_ok() {
                let _ = amqp::write_all(&mut w, &buf).await;
            }
        }
    }
    let abort = reader.abort_handle();
    if tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .is_err()
    {
        abort.abort();
        eprintln!("warning: {label}: the broker did not complete the close handshake within 5 s");
    }
}

async fn publish_loop(
    cfg: &ProducerCfg,
    frame_max: usize,
    wr: &AsyncMutex<Wr>,
    sh: &Shared,
    stats: &Stats,
) -> Result<()> {
    // Method + header frames are identical for every message: encode once.
    let mut prefix = Vec::new();
    amqp::encode(
        &mut prefix,
        &AMQPFrame::Method(
            CH,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "".into(),
                routing_key: amqp::short(&cfg.queue, "the queue name")?,
                mandatory: false,
                immediate: false,
            })),
        ),
    )?;
    let props =
        basic::AMQPProperties::default().with_delivery_mode(if cfg.persistent { 2 } else { 1 });
    amqp::encode_header(&mut prefix, CH, cfg.size as u64, props)?;
    let body = vec![0u8; cfg.size];
    let chunk = frame_max.saturating_sub(8).max(4096 - 8);
    let per_msg = prefix.len() + cfg.size + 8 * cfg.size.div_ceil(chunk);
    let batch_max = (BATCH_BYTES / per_msg).clamp(1, BATCH_MSGS) as u64;

    let mut stop = stats.stop_rx();
    let mut wbuf: Vec<u8> = Vec::with_capacity(BATCH_BYTES + per_msg);
    let t0 = Instant::now();
    let mut published: u64 = 0;
    loop {
        if stats.stopping() || sh.dead.load(Relaxed) {
            break;
        }
        let mut n = batch_max;
        if cfg.count > 0 {
            if published >= cfg.count {
                break;
            }
            n = n.min(cfg.count - published);
        }
        if cfg.rate > 0 {
            let due = (cfg.rate as f64 * t0.elapsed().as_secs_f64()) as u64 + 1;
            if due <= published {
                let next = t0 + Duration::from_secs_f64((published) as f64 / cfg.rate as f64);
                tokio::select! {
                    _ = tokio::time::sleep_until(next.into()) => {}
                    _ = stop.changed() => {}
                }
                continue;
            }
            n = n.min(due - published);
        }
        if let Some(w) = &sh.window {
            let mut got = 0;
            while got < n {
                match w.try_acquire() {
                    Ok(p) => {
                        p.forget();
                        got += 1;
                    }
                    Err(_) => break,
                }
            }
            if got == 0 {
                tokio::select! {
                    p = w.acquire() => match p {
                        Ok(p) => { p.forget(); got = 1; }
                        Err(_) => break, // closed: connection is gone
                    },
                    _ = stop.changed() => continue,
                }
            }
            n = got;
        }

        let now = stats.now_ns();
        if sh.window.is_some() {
            let mut p = sh.pending.lock().unwrap();
            for _ in 0..n {
                p.slots.push_back(now);
            }
            p.outstanding += n;
        }
        let ts = now.to_be_bytes();
        for _ in 0..n {
            wbuf.extend_from_slice(&prefix);
            let mut off = 0;
            while off < body.len() {
                let len = chunk.min(body.len() - off);
                wbuf.push(FRAME_BODY);
                wbuf.extend_from_slice(&CH.to_be_bytes());
                wbuf.extend_from_slice(&(len as u32).to_be_bytes());
                let at = wbuf.len();
                wbuf.extend_from_slice(&body[off..off + len]);
                if off == 0 {
                    let k = len.min(8);
                    wbuf[at..at + k].copy_from_slice(&ts[..k]);
                }
                wbuf.push(FRAME_END);
                off += len;
            }
        }
        {
            let mut w = wr.lock().await;
            if sh.dead.load(Relaxed) {
                break;
            }
            amqp::write_all(&mut w, &wbuf)
                .await
                .context("write to the broker failed")?;
        }
        wbuf.clear();
        published += n;
        stats.sent.fetch_add(n, Relaxed);
        tokio::task::yield_now().await;
    }

    // With --count, wait for the last confirms before reporting done.
    if cfg.count > 0 && sh.window.is_some() {
        while !stats.stopping()
            && !sh.dead.load(Relaxed)
            && sh.pending.lock().unwrap().outstanding > 0
        {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(5)) => {}
                _ = stop.changed() => {}
            }
        }
    }
    Ok(())
}

async fn write_frame(wr: &AsyncMutex<Wr>, f: AMQPFrame) -> Result<()> {
    let mut buf = Vec::new();
    amqp::encode(&mut buf, &f)?;
    amqp::write_all(&mut *wr.lock().await, &buf).await?;
    Ok(())
}

/// Handle everything the broker sends on a producer connection.
async fn read_loop(
    mut rd: Rd,
    mut rbuf: BytesMut,
    wr: &AsyncMutex<Wr>,
    sh: &Shared,
    stats: &Stats,
    label: &str,
) -> Result<()> {
    let mut lat: Vec<u64> = Vec::with_capacity(1024);
    let mut channel_error: Option<anyhow::Error> = None;
    loop {
        // Frames already buffered (e.g. left over from the handshake) first.
        let mut pos = 0;
        let (mut acked, mut nacked) = (0u64, 0u64);
        while let Some((raw, len)) = amqp::split_frame(&rbuf[pos..])? {
            if raw.kind == FRAME_METHOD {
                let (class, meth) = raw.method_id();
                let p = raw.payload;
                if class == 60 && (meth == 80 || meth == 120) && p.len() >= 13 {
                    let tag = u64::from_be_bytes(p[4..12].try_into().unwrap());
                    let multiple = p[12] & 1 != 0;
                    let now = stats.now_ns();
                    let mut pend = sh.pending.lock().unwrap();
                    if meth == 80 {
                        acked += pend.settle(tag, multiple, now, Some(&mut lat));
                    } else {
                        nacked += pend.settle(tag, multiple, now, None);
                    }
                } else {
                    let m = match amqp::decode(&rbuf[pos..pos + len])? {
                        AMQPFrame::Method(_, m) => m,
                        _ => unreachable!(),
                    };
                    match m {
                        AMQPClass::Connection(connection::AMQPMethod::Close(_)) => {
                            let close = amqp::server_close_of(&m).unwrap();
                            sh.kill();
                            let _ = write_frame(wr, amqp::connection_close_ok_frame()).await;
                            return Err(anyhow::Error::new(close).context(label.to_string()));
                        }
                        AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => {
                            let _ = wr.lock().await.shutdown().await;
                            return match channel_error {
                                Some(e) => Err(e),
                                None => Ok(()),
                            };
                        }
                        AMQPClass::Channel(channel::AMQPMethod::Close(_)) => {
                            let close = amqp::server_close_of(&m).unwrap();
                            {
                                let _guard = wr.lock().await; // no publish may be in flight
                                sh.kill();
                            }
                            write_frame(wr, amqp::channel_close_ok_frame(raw.channel)).await?;
                            write_frame(wr, amqp::connection_close_frame()).await?;
                            channel_error =
                                Some(anyhow::Error::new(close).context(label.to_string()));
                        }
                        AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => {
                            sh.kill();
                            write_frame(wr, amqp::connection_close_frame()).await?;
                        }
                        AMQPClass::Channel(channel::AMQPMethod::Flow(f)) => {
                            let ok = channel::FlowOk { active: f.active };
                            let f = amqp::method(
                                AMQPClass::Channel(channel::AMQPMethod::FlowOk(ok)),
                                raw.channel,
                            );
                            write_frame(wr, f).await?;
                        }
                        AMQPClass::Connection(connection::AMQPMethod::Blocked(b)) => {
                            eprintln!(
                                "warning: {label}: connection blocked by the broker: {}",
                                b.reason
                            );
                        }
                        AMQPClass::Connection(connection::AMQPMethod::Unblocked(_)) => {
                            eprintln!("warning: {label}: connection unblocked");
                        }
                        AMQPClass::Basic(basic::AMQPMethod::Return(_)) => {
                            stats.returned.fetch_add(1, Relaxed);
                        }
                        _ => {}
                    }
                }
            }
            // Heartbeats and returned message content are ignored.
            pos += len;
        }
        rbuf.advance(pos);
        if acked + nacked > 0 {
            stats.confirmed.fetch_add(acked, Relaxed);
            stats.nacked.fetch_add(nacked, Relaxed);
            if let Some(w) = &sh.window {
                w.add_permits((acked + nacked) as usize);
            }
            stats.record_confirm_latencies(&lat);
            lat.clear();
        }
        if !amqp::fill(&mut rd, &mut rbuf).await? {
            return Err(anyhow!(
                "{label}: the broker closed the TCP connection without connection.close"
            ));
        }
    }
}
