//! A small AMQP 0-9-1 client over turmoil's TCP, for the mirror scenario's session clients:
//! the handshake (PLAIN, heartbeats negotiated), one channel, publishes with confirms, a
//! consumer with manual acks. Frames are amq-protocol's, as a real client's; the node
//! answers with its own `session::Connection` behind `runtime::conn_task`.
//!
//! Reading is split so a client can `select!` on it: [`AmqpConn::fill`] reads once (cancel
//! safe), [`AmqpConn::next_event`] takes what the bytes read so far hold.

use std::io;

use amq_protocol::frame::{gen_frame, parse_frame, AMQPContentHeader, AMQPFrame, WriteContext};
use amq_protocol::protocol::basic::{self, AMQPProperties};
use amq_protocol::protocol::{channel, confirm, connection, queue, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use turmoil::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use turmoil::net::TcpStream;

/// The channel every client here uses.
const CH: u16 = 1;
const FRAME_END: u8 = 0xCE;
const MAX_FRAME: usize = 1 << 20;

fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// Something the broker sent, as the clients here need it.
#[derive(Debug)]
pub enum Incoming {
    /// basic.ack of a publish.
    Ack { tag: u64, multiple: bool },
    /// basic.nack of a publish.
    Nack { tag: u64, multiple: bool },
    /// A whole delivery (method, header and body).
    Deliver {
        tag: u64,
        redelivered: bool,
        body: Vec<u8>,
    },
    /// A whole basic.return (a mandatory publish no queue took): the message's body.
    Returned { body: Vec<u8> },
    /// The broker cancelled the consumer (consumer cancel notify).
    Cancelled,
    /// The broker closed the channel or the connection: code and text.
    Closed(u16, String),
    /// Anything else (heartbeats, replies nobody waits for).
    Other,
}

/// An open connection with channel 1 open.
pub struct AmqpConn {
    rd: OwnedReadHalf,
    wr: OwnedWriteHalf,
    rbuf: BytesMut,
    /// A delivery or return whose header or body has not all arrived.
    partial: Option<Partial>,
}

/// A content-bearing method read so far.
struct Partial {
    /// `Some((tag, redelivered))` for a delivery, `None` for a return.
    delivery: Option<(u64, bool)>,
    size: u64,
    body: Vec<u8>,
}

impl Partial {
    fn into_incoming(self) -> Incoming {
        match self.delivery {
            Some((tag, redelivered)) => Incoming::Deliver {
                tag,
                redelivered,
                body: self.body,
            },
            None => Incoming::Returned { body: self.body },
        }
    }
}

fn encode(buf: &mut Vec<u8>, frame: &AMQPFrame) -> io::Result<()> {
    let ctx = WriteContext::from(std::mem::take(buf));
    let ctx = gen_frame(frame)(ctx).map_err(|e| bad(format!("cannot encode: {e:?}")))?;
    *buf = ctx.into_inner().0;
    Ok(())
}

/// What the client says of itself: it takes the broker's basic.cancel (as every
/// RabbitMQ client library does), so a consumer of a deleted queue hears of it.
fn client_properties() -> FieldTable {
    let mut caps = FieldTable::default();
    caps.insert("consumer_cancel_notify".into(), AMQPValue::Boolean(true));
    let mut props = FieldTable::default();
    props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
    props
}

impl AmqpConn {
    /// Connects to `addr`, logs in as guest, negotiates `heartbeat` seconds and opens
    /// channel 1.
    pub async fn open(addr: &str, heartbeat: u16) -> io::Result<AmqpConn> {
        let (rd, wr) = TcpStream::connect(addr).await?.into_split();
        let mut c = AmqpConn {
            rd,
            wr,
            rbuf: BytesMut::with_capacity(16 << 10),
            partial: None,
        };
        c.wr.write_all(b"AMQP\x00\x00\x09\x01").await?;
        match c.recv_method().await? {
            AMQPClass::Connection(connection::AMQPMethod::Start(_)) => {}
            other => return Err(bad(format!("expected connection.start: {other:?}"))),
        }
        c.send(&[AMQPFrame::Method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: client_properties(),
                mechanism: "PLAIN".into(),
                response: LongString::from(b"\0guest\0guest".to_vec()),
                locale: "en_US".into(),
            })),
        )])
        .await?;
        let tune = match c.recv_method().await? {
            AMQPClass::Connection(connection::AMQPMethod::Tune(t)) => t,
            other => return Err(bad(format!("expected connection.tune: {other:?}"))),
        };
        c.send(&[
            AMQPFrame::Method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                    channel_max: tune.channel_max,
                    frame_max: tune.frame_max,
                    heartbeat,
                })),
            ),
            AMQPFrame::Method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                    virtual_host: "/".into(),
                })),
            ),
        ])
        .await?;
        match c.recv_method().await? {
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)) => {}
            other => return Err(bad(format!("expected connection.open-ok: {other:?}"))),
        }
        match c
            .call(AMQPClass::Channel(channel::AMQPMethod::Open(
                channel::Open {},
            )))
            .await?
        {
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)) => Ok(c),
            other => Err(bad(format!("expected channel.open-ok: {other:?}"))),
        }
    }

    /// Puts channel 1 in confirm mode.
    pub async fn confirm_select(&mut self) -> io::Result<()> {
        match self
            .call(AMQPClass::Confirm(confirm::AMQPMethod::Select(
                confirm::Select { nowait: false },
            )))
            .await?
        {
            AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_)) => Ok(()),
            other => Err(bad(format!("expected confirm.select-ok: {other:?}"))),
        }
    }

    /// Declares the durable queue `name` (no arguments) and returns its message count.
    pub async fn declare_durable(&mut self, name: &str) -> io::Result<u32> {
        match self
            .call(AMQPClass::Queue(queue::AMQPMethod::Declare(
                queue::Declare {
                    queue: name.into(),
                    passive: false,
                    durable: true,
                    exclusive: false,
                    auto_delete: false,
                    nowait: false,
                    arguments: FieldTable::default(),
                },
            )))
            .await?
        {
            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => Ok(ok.message_count),
            other => Err(bad(format!("expected queue.declare-ok: {other:?}"))),
        }
    }

    /// Deletes the queue `name` (whatever it holds, consumers or not).
    pub async fn delete_queue(&mut self, name: &str) -> io::Result<u32> {
        match self
            .call(AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
                queue: name.into(),
                if_unused: false,
                if_empty: false,
                nowait: false,
            })))
            .await?
        {
            AMQPClass::Queue(queue::AMQPMethod::DeleteOk(ok)) => Ok(ok.message_count),
            other => Err(bad(format!("expected queue.delete-ok: {other:?}"))),
        }
    }

    /// Sets the channel's prefetch and consumes `queue` with manual acks.
    pub async fn consume(&mut self, queue: &str, prefetch: u16) -> io::Result<()> {
        match self
            .call(AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                prefetch_count: prefetch,
                global: false,
            })))
            .await?
        {
            AMQPClass::Basic(basic::AMQPMethod::QosOk(_)) => {}
            other => return Err(bad(format!("expected basic.qos-ok: {other:?}"))),
        }
        self.send(&[AMQPFrame::Method(
            CH,
            AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
                queue: queue.into(),
                consumer_tag: "".into(),
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        )])
        .await
    }

    /// Publishes `body` to `queue` through the default exchange, mandatory: a message no
    /// queue takes comes back as [`Incoming::Returned`] before its confirm.
    pub async fn publish(
        &mut self,
        queue: &str,
        body: Vec<u8>,
        persistent: bool,
    ) -> io::Result<()> {
        let properties =
            AMQPProperties::default().with_delivery_mode(if persistent { 2 } else { 1 });
        self.send(&[
            AMQPFrame::Method(
                CH,
                AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                    exchange: "".into(),
                    routing_key: queue.into(),
                    mandatory: true,
                    immediate: false,
                })),
            ),
            AMQPFrame::Header(
                CH,
                AMQPContentHeader {
                    class_id: 60,
                    body_size: body.len() as u64,
                    properties,
                },
            ),
            AMQPFrame::Body(CH, body),
        ])
        .await
    }

    /// Acknowledges delivery `tag`.
    pub async fn ack(&mut self, tag: u64) -> io::Result<()> {
        self.send(&[AMQPFrame::Method(
            CH,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: tag,
                multiple: false,
            })),
        )])
        .await
    }

    /// Sends a heartbeat.
    pub async fn heartbeat(&mut self) -> io::Result<()> {
        self.send(&[AMQPFrame::Heartbeat]).await
    }

    async fn send(&mut self, frames: &[AMQPFrame]) -> io::Result<()> {
        let mut buf = Vec::new();
        for f in frames {
            encode(&mut buf, f)?;
        }
        self.wr.write_all(&buf).await
    }

    /// Reads once into the buffer; false at the end of the stream. Cancel safe.
    pub async fn fill(&mut self) -> io::Result<bool> {
        Ok(self.rd.read_buf(&mut self.rbuf).await? > 0)
    }

    /// The next frame the buffer holds whole, if any.
    fn next_frame(&mut self) -> io::Result<Option<AMQPFrame>> {
        if self.rbuf.len() < 7 {
            return Ok(None);
        }
        if self.rbuf[0] == b'A' {
            return Err(bad("the broker refused the protocol header"));
        }
        let size =
            u32::from_be_bytes([self.rbuf[3], self.rbuf[4], self.rbuf[5], self.rbuf[6]]) as usize;
        if size > MAX_FRAME {
            return Err(bad(format!("frame of {size} bytes")));
        }
        if self.rbuf.len() < size + 8 {
            return Ok(None);
        }
        if self.rbuf[size + 7] != FRAME_END {
            return Err(bad("frame end missing"));
        }
        let frame = match parse_frame(&self.rbuf[..size + 8]) {
            Ok((_, f)) => f,
            Err(e) => return Err(bad(format!("cannot parse a frame: {e:?}"))),
        };
        self.rbuf.advance(size + 8);
        Ok(Some(frame))
    }

    /// The next event the bytes read so far hold, if any.
    pub fn next_event(&mut self) -> io::Result<Option<Incoming>> {
        while let Some(frame) = self.next_frame()? {
            let event = match frame {
                AMQPFrame::Method(_, AMQPClass::Basic(m)) => match m {
                    basic::AMQPMethod::Ack(a) => Incoming::Ack {
                        tag: a.delivery_tag,
                        multiple: a.multiple,
                    },
                    basic::AMQPMethod::Nack(n) => Incoming::Nack {
                        tag: n.delivery_tag,
                        multiple: n.multiple,
                    },
                    basic::AMQPMethod::Deliver(d) => {
                        self.partial = Some(Partial {
                            delivery: Some((d.delivery_tag, d.redelivered)),
                            size: 0,
                            body: Vec::new(),
                        });
                        continue;
                    }
                    basic::AMQPMethod::Return(_) => {
                        self.partial = Some(Partial {
                            delivery: None,
                            size: 0,
                            body: Vec::new(),
                        });
                        continue;
                    }
                    basic::AMQPMethod::Cancel(_) => Incoming::Cancelled,
                    _ => Incoming::Other,
                },
                AMQPFrame::Header(_, h) => {
                    if let Some(p) = self.partial.as_mut() {
                        p.size = h.body_size;
                        if h.body_size == 0 {
                            return Ok(self.partial.take().map(Partial::into_incoming));
                        }
                    }
                    continue;
                }
                AMQPFrame::Body(_, bytes) => {
                    let Some(p) = self.partial.as_mut() else {
                        continue;
                    };
                    p.body.extend_from_slice(&bytes);
                    if (p.body.len() as u64) < p.size {
                        continue;
                    }
                    let Some(p) = self.partial.take() else {
                        continue;
                    };
                    p.into_incoming()
                }
                AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Close(c))) => {
                    Incoming::Closed(c.reply_code, c.reply_text.to_string())
                }
                AMQPFrame::Method(_, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
                    Incoming::Closed(c.reply_code, c.reply_text.to_string())
                }
                _ => Incoming::Other,
            };
            return Ok(Some(event));
        }
        Ok(None)
    }

    /// The next method frame (setup only: nothing else is in flight).
    async fn recv_method(&mut self) -> io::Result<AMQPClass> {
        loop {
            while let Some(frame) = self.next_frame()? {
                if let AMQPFrame::Method(_, m) = frame {
                    return Ok(m);
                }
            }
            if !self.fill().await? {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
    }

    /// Sends `m` on channel 1 and returns the next method the broker sends.
    async fn call(&mut self, m: AMQPClass) -> io::Result<AMQPClass> {
        self.send(&[AMQPFrame::Method(CH, m)]).await?;
        let reply = self.recv_method().await?;
        match &reply {
            AMQPClass::Channel(channel::AMQPMethod::Close(c)) => Err(bad(format!(
                "channel closed: {} {}",
                c.reply_code, c.reply_text
            ))),
            AMQPClass::Connection(connection::AMQPMethod::Close(c)) => Err(bad(format!(
                "connection closed: {} {}",
                c.reply_code, c.reply_text
            ))),
            _ => Ok(reply),
        }
    }
}
