//! Consumer: one connection, one channel, one basic.consume.
//!
//! A single task reads many frames per syscall, parses deliveries in place
//! (no per-message allocation), records end-to-end latency from the 8-byte
//! timestamp at the start of each body, and writes all acks produced by one
//! read batch with one write.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, channel, connection, AMQPClass};
use amq_protocol::uri::AMQPUri;
use anyhow::{anyhow, Result};
use bytes::Buf;
use tokio::time::Instant;

use super::amqp::{self, Conn, FRAME_BODY, FRAME_HEADER, FRAME_METHOD};
use super::stats::Stats;

const CH: u16 = 1;

#[derive(Clone)]
pub struct ConsumerCfg {
    pub queue: String,
    pub autoack: bool,
    /// basic.qos prefetch count; 0 = unlimited.
    pub prefetch: u16,
    /// Ack with multiple=true every N messages (1 = ack each message).
    pub multi_ack_every: u64,
    /// Whether body timestamps come from this process (false for --consume-only).
    pub measure_latency: bool,
}

pub async fn setup(uri: &AMQPUri, label: &str, cfg: &ConsumerCfg) -> Result<Conn> {
    let mut c = Conn::open(uri, label).await?;
    let r = async {
        c.channel_open(CH).await?;
        if cfg.prefetch > 0 && !cfg.autoack {
            c.qos(CH, cfg.prefetch).await?;
        }
        c.consume(CH, &cfg.queue, cfg.autoack).await?;
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

/// Where we are inside the delivery currently being received.
#[derive(Default)]
struct InFlight {
    active: bool,
    tag: u64,
    remaining: u64,
    ts: [u8; 8],
    ts_len: usize,
}

pub async fn run(conn: Conn, cfg: ConsumerCfg, stats: Arc<Stats>) {
    let label = conn.label.clone();
    if let Err(e) = consume_loop(conn, &cfg, &stats).await {
        stats.fail(format!("{label}: {e:#}"));
    }
}

async fn consume_loop(mut c: Conn, cfg: &ConsumerCfg, stats: &Stats) -> Result<()> {
    let mut stop = stats.stop_rx();
    let mut closing = false;
    let mut deadline = Instant::now() + Duration::from_secs(3600 * 24 * 365);
    let mut cur = InFlight::default();
    let mut unacked: u64 = 0;
    let mut last_tag: u64 = 0;
    let multi = cfg.multi_ack_every.max(1);
    let mut lats: Vec<u64> = Vec::with_capacity(4096);
    let mut channel_error: Option<anyhow::Error> = None;
    loop {
        if stats.stopping() && !closing {
            // channel.close: the broker requeues unacked messages; deliveries
            // still in flight are ignored until close-ok, the one being received
            // included (an ack after channel.close is a connection error).
            closing = true;
            cur.active = false;
            deadline = Instant::now() + Duration::from_secs(5);
            c.send(amqp::channel_close_frame(CH)).await?;
        }
        let mut pos = 0;
        let mut received: u64 = 0;
        let mut now = 0u64;
        while let Some((raw, len)) = amqp::split_frame(&c.rbuf[pos..])? {
            let p = raw.payload;
            match raw.kind {
                FRAME_METHOD => {
                    let (class, meth) = raw.method_id();
                    if class == 60 && meth == 60 {
                        // basic.deliver: consumer-tag(shortstr) delivery-tag(u64) ...
                        let l =
                            *p.get(4).ok_or_else(|| anyhow!("truncated basic.deliver"))? as usize;
                        let t = p
                            .get(5 + l..13 + l)
                            .ok_or_else(|| anyhow!("truncated basic.deliver"))?;
                        cur = InFlight {
                            active: !closing,
                            tag: u64::from_be_bytes(t.try_into().unwrap()),
                            ..Default::default()
                        };
                    } else {
                        let m = match amqp::decode(&c.rbuf[pos..pos + len])? {
                            AMQPFrame::Method(_, m) => m,
                            _ => unreachable!(),
                        };
                        match m {
                            AMQPClass::Connection(connection::AMQPMethod::Close(_)) => {
                                let close = amqp::server_close_of(&m).unwrap();
                                amqp::encode(&mut c.wbuf, &amqp::connection_close_ok_frame())?;
                                let _ = c.flush().await;
                                return Err(anyhow::Error::new(close));
                            }
                            AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => {
                                use tokio::io::AsyncWriteExt;
                                let _ = c.wr.shutdown().await;
                                return channel_error.map_or(Ok(()), Err);
                            }
                            AMQPClass::Channel(channel::AMQPMethod::Close(_)) => {
                                channel_error =
                                    Some(anyhow::Error::new(amqp::server_close_of(&m).unwrap()));
                                closing = true;
                                cur.active = false;
                                deadline = Instant::now() + Duration::from_secs(5);
                                amqp::encode(&mut c.wbuf, &amqp::channel_close_ok_frame(CH))?;
                                amqp::encode(&mut c.wbuf, &amqp::connection_close_frame())?;
                            }
                            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => {
                                amqp::encode(&mut c.wbuf, &amqp::connection_close_frame())?;
                            }
                            AMQPClass::Basic(basic::AMQPMethod::Cancel(_)) if !closing => {
                                channel_error = Some(anyhow!(
                                    "the broker cancelled the consumer (queue '{}' deleted?)",
                                    cfg.queue
                                ));
                                closing = true;
                                cur.active = false;
                                deadline = Instant::now() + Duration::from_secs(5);
                                amqp::encode(&mut c.wbuf, &amqp::channel_close_frame(CH))?;
                            }
                            AMQPClass::Channel(channel::AMQPMethod::Flow(f)) => {
                                let ok = channel::FlowOk { active: f.active };
                                let f = amqp::method(
                                    AMQPClass::Channel(channel::AMQPMethod::FlowOk(ok)),
                                    CH,
                                );
                                amqp::encode(&mut c.wbuf, &f)?;
                            }
                            _ => {}
                        }
                    }
                }
                FRAME_HEADER if cur.active => {
                    let size = p
                        .get(4..12)
                        .ok_or_else(|| anyhow!("truncated content header"))?;
                    cur.remaining = u64::from_be_bytes(size.try_into().unwrap());
                    if cur.remaining == 0 {
                        cur.active = false;
                        received += 1;
                        complete(
                            &mut cur,
                            cfg,
                            multi,
                            &mut unacked,
                            &mut last_tag,
                            &mut c.wbuf,
                        );
                    }
                }
                FRAME_BODY if cur.active => {
                    if cur.ts_len < 8 {
                        let k = (8 - cur.ts_len).min(p.len());
                        cur.ts[cur.ts_len..cur.ts_len + k].copy_from_slice(&p[..k]);
                        cur.ts_len += k;
                    }
                    cur.remaining = cur.remaining.saturating_sub(p.len() as u64);
                    if cur.remaining == 0 {
                        cur.active = false;
                        received += 1;
                        if cfg.measure_latency && cur.ts_len == 8 {
                            if now == 0 {
                                now = stats.now_ns();
                            }
                            let sent = u64::from_be_bytes(cur.ts);
                            if sent <= now {
                                lats.push(now - sent);
                            }
                        }
                        complete(
                            &mut cur,
                            cfg,
                            multi,
                            &mut unacked,
                            &mut last_tag,
                            &mut c.wbuf,
                        );
                    }
                }
                _ => {} // heartbeats, content of ignored deliveries
            }
            pos += len;
        }
        c.rbuf.advance(pos);
        if received > 0 {
            stats.received.fetch_add(received, Relaxed);
            stats
                .last_recv_ns
                .store(if now > 0 { now } else { stats.now_ns() }, Relaxed);
            stats.record_latencies(&lats);
            lats.clear();
        }
        c.flush().await?;

        tokio::select! {
            r = amqp::fill(&mut c.rd, &mut c.rbuf) => {
                if !r? {
                    return Err(channel_error.unwrap_or_else(|| {
                        anyhow!("the broker closed the TCP connection without connection.close")
                    }));
                }
            }
            _ = stop.changed(), if !closing => {}
            _ = tokio::time::sleep_until(deadline), if closing => {
                return Err(anyhow!("the broker did not complete the close handshake within 5 s"));
            }
        }
    }
}

/// A whole message has arrived: decide whether to ack.
fn complete(
    cur: &mut InFlight,
    cfg: &ConsumerCfg,
    multi: u64,
    unacked: &mut u64,
    last_tag: &mut u64,
    wbuf: &mut Vec<u8>,
) {
    if cfg.autoack {
        return;
    }
    *unacked += 1;
    *last_tag = cur.tag;
    // Ack every `multi` messages, and never let unacked messages exhaust
    // the prefetch window (that would stall the consumer).
    if *unacked >= multi || (cfg.prefetch > 0 && *unacked >= cfg.prefetch as u64) {
        amqp::push_ack(wbuf, CH, *last_tag, *unacked > 1);
        *unacked = 0;
    }
}
