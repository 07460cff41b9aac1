//! Minimal AMQP 0-9-1 client plumbing on top of amq-protocol's frame codec.
//!
//! Only what a load generator needs: connection handshake (PLAIN auth),
//! one channel per connection, a few synchronous methods for setup, and raw
//! frame splitting so the hot paths (publish, deliver, ack, confirm) can work
//! on bytes in place without allocating per message.

use std::fmt;

use amq_protocol::frame::{gen_frame, parse_frame, AMQPContentHeader, AMQPFrame, WriteContext};
use amq_protocol::protocol::{basic, channel, confirm, connection, queue, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use amq_protocol::uri::AMQPUri;
use anyhow::{anyhow, bail, Context, Result};
use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::stream::{self, Rd, Wr};

pub const FRAME_METHOD: u8 = 1;
pub const FRAME_HEADER: u8 = 2;
pub const FRAME_BODY: u8 = 3;
pub const FRAME_END: u8 = 0xCE;
/// Sanity bound on an incoming frame (anything larger means a corrupt stream).
const MAX_INCOMING_FRAME: usize = 64 << 20;
/// Read buffer size: many frames are parsed per read syscall.
pub const READ_CHUNK: usize = 256 * 1024;
/// Frame size we ask for when the server does not impose one.
const DEFAULT_FRAME_MAX: u32 = 131_072;

/// The server closed the connection or the channel (connection.close / channel.close).
#[derive(Debug, Clone)]
pub struct ServerClose {
    pub connection: bool,
    pub code: u16,
    pub text: String,
    pub class_id: u16,
    pub method_id: u16,
}

impl fmt::Display for ServerClose {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scope = if self.connection {
            "connection"
        } else {
            "channel"
        };
        write!(
            f,
            "{scope} closed by the broker: {} {}",
            self.code, self.text
        )?;
        if self.class_id != 0 {
            write!(
                f,
                " (in reply to {})",
                method_name(self.class_id, self.method_id)
            )?;
        }
        Ok(())
    }
}

impl std::error::Error for ServerClose {}

fn method_name(class_id: u16, method_id: u16) -> String {
    let name = match (class_id, method_id) {
        (10, 11) => "connection.start-ok",
        (10, 31) => "connection.tune-ok",
        (10, 40) => "connection.open",
        (20, 10) => "channel.open",
        (50, 10) => "queue.declare",
        (50, 40) => "queue.delete",
        (60, 10) => "basic.qos",
        (60, 20) => "basic.consume",
        (60, 40) => "basic.publish",
        (60, 80) => "basic.ack",
        (60, 120) => "basic.nack",
        (85, 10) => "confirm.select",
        _ => "",
    };
    if name.is_empty() {
        format!("class {class_id} method {method_id}")
    } else {
        name.to_string()
    }
}

/// Build a ShortString without the panic `ShortString::from` has over 255 bytes.
pub fn short(s: &str, what: &str) -> Result<ShortString> {
    ShortString::try_new(s.to_string()).map_err(|_| {
        anyhow!(
            "{what} is {} bytes long; AMQP short strings hold at most 255",
            s.len()
        )
    })
}

/// Append the wire encoding of `frame` to `buf`.
pub fn encode(buf: &mut Vec<u8>, frame: &AMQPFrame) -> Result<()> {
    let ctx = WriteContext::from(std::mem::take(buf));
    match gen_frame(frame)(ctx) {
        Ok(ctx) => {
            *buf = ctx.into_inner().0;
            Ok(())
        }
        Err(e) => Err(anyhow!("cannot encode {frame}: {e:?}")),
    }
}

pub fn method(m: AMQPClass, ch: u16) -> AMQPFrame {
    AMQPFrame::Method(ch, m)
}

/// Encode a content header frame (class basic).
pub fn encode_header(
    buf: &mut Vec<u8>,
    ch: u16,
    body_size: u64,
    props: basic::AMQPProperties,
) -> Result<()> {
    encode(
        buf,
        &AMQPFrame::Header(
            ch,
            AMQPContentHeader {
                class_id: 60,
                body_size,
                properties: props,
            },
        ),
    )
}

/// basic.ack written by hand (hot path): 21 bytes.
pub fn push_ack(buf: &mut Vec<u8>, ch: u16, tag: u64, multiple: bool) {
    buf.push(FRAME_METHOD);
    buf.extend_from_slice(&ch.to_be_bytes());
    buf.extend_from_slice(&13u32.to_be_bytes());
    buf.extend_from_slice(&[0, 60, 0, 80]);
    buf.extend_from_slice(&tag.to_be_bytes());
    buf.push(multiple as u8);
    buf.push(FRAME_END);
}

pub fn channel_close_frame(ch: u16) -> AMQPFrame {
    method(
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "Goodbye".into(),
            class_id: 0,
            method_id: 0,
        })),
        ch,
    )
}

pub fn connection_close_frame() -> AMQPFrame {
    method(
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "Goodbye".into(),
            class_id: 0,
            method_id: 0,
        })),
        0,
    )
}

pub fn channel_close_ok_frame(ch: u16) -> AMQPFrame {
    method(
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
        ch,
    )
}

pub fn connection_close_ok_frame() -> AMQPFrame {
    method(
        AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
        0,
    )
}

/// One complete frame found in a byte buffer, borrowed in place.
pub struct Raw<'a> {
    pub kind: u8,
    pub channel: u16,
    pub payload: &'a [u8],
}

impl Raw<'_> {
    /// (class id, method id) of a method frame.
    pub fn method_id(&self) -> (u16, u16) {
        let p = self.payload;
        if p.len() < 4 {
            return (0, 0);
        }
        (
            u16::from_be_bytes([p[0], p[1]]),
            u16::from_be_bytes([p[2], p[3]]),
        )
    }
}

/// If `buf` starts with a complete frame, return it and its total length.
pub fn split_frame(buf: &[u8]) -> Result<Option<(Raw<'_>, usize)>> {
    if buf.len() < 7 {
        return Ok(None);
    }
    if buf[0] == b'A' {
        // The server answers an unsupported protocol header with its own.
        if buf.len() < 8 {
            return Ok(None);
        }
        bail!(
            "the broker rejected AMQP 0-9-1 and offered protocol {}-{}-{}-{}",
            buf[4],
            buf[5],
            buf[6],
            buf[7]
        );
    }
    let size = u32::from_be_bytes([buf[3], buf[4], buf[5], buf[6]]) as usize;
    if size > MAX_INCOMING_FRAME {
        bail!("incoming frame of {size} bytes is implausibly large (corrupt stream?)");
    }
    let total = size + 8;
    if buf.len() < total {
        return Ok(None);
    }
    if buf[total - 1] != FRAME_END {
        bail!("frame end marker missing (corrupt stream)");
    }
    let raw = Raw {
        kind: buf[0],
        channel: u16::from_be_bytes([buf[1], buf[2]]),
        payload: &buf[7..7 + size],
    };
    Ok(Some((raw, total)))
}

/// Full decode of one frame with amq-protocol (used off the hot path).
pub fn decode(frame: &[u8]) -> Result<AMQPFrame> {
    match parse_frame(frame) {
        Ok((_, f)) => Ok(f),
        Err(e) => Err(anyhow!("cannot parse a frame from the broker: {e:?}")),
    }
}

pub fn server_close_of(m: &AMQPClass) -> Option<ServerClose> {
    match m {
        AMQPClass::Connection(connection::AMQPMethod::Close(c)) => Some(ServerClose {
            connection: true,
            code: c.reply_code,
            text: c.reply_text.to_string(),
            class_id: c.class_id,
            method_id: c.method_id,
        }),
        AMQPClass::Channel(channel::AMQPMethod::Close(c)) => Some(ServerClose {
            connection: false,
            code: c.reply_code,
            text: c.reply_text.to_string(),
            class_id: c.class_id,
            method_id: c.method_id,
        }),
        _ => None,
    }
}

fn unexpected(label: &str, wanted: &str, got: &AMQPClass) -> anyhow::Error {
    anyhow!("{label}: expected {wanted}, the broker sent {got:?}")
}

fn client_properties(label: &str) -> FieldTable {
    let mut caps = FieldTable::default();
    for c in [
        "publisher_confirms",
        "basic.nack",
        "consumer_cancel_notify",
        "connection.blocked",
        "authentication_failure_close",
        "per_consumer_qos",
    ] {
        caps.insert(c.into(), AMQPValue::Boolean(true));
    }
    let mut t = FieldTable::default();
    t.insert(
        "product".into(),
        AMQPValue::LongString("warren-perf".into()),
    );
    t.insert(
        "version".into(),
        AMQPValue::LongString(env!("CARGO_PKG_VERSION").into()),
    );
    t.insert("platform".into(), AMQPValue::LongString("Rust".into()));
    t.insert(
        "connection_name".into(),
        AMQPValue::LongString(label.into()),
    );
    t.insert("capabilities".into(), AMQPValue::FieldTable(caps));
    t
}

/// An open AMQP connection (socket halves plus buffers).
pub struct Conn {
    pub rd: Rd,
    pub wr: Wr,
    pub rbuf: BytesMut,
    pub wbuf: Vec<u8>,
    pub frame_max: u32,
    pub label: String,
}

impl Conn {
    /// TCP (and TLS for amqps://) connect and run the connection handshake
    /// (start/tune/open).
    pub async fn open(uri: &AMQPUri, label: &str) -> Result<Conn> {
        let (rd, wr) = stream::connect(uri, label).await?;
        let mut c = Conn {
            rd,
            wr,
            rbuf: BytesMut::with_capacity(READ_CHUNK),
            wbuf: Vec::with_capacity(64 * 1024),
            frame_max: DEFAULT_FRAME_MAX,
            label: label.to_string(),
        };
        c.wbuf.extend_from_slice(b"AMQP\x00\x00\x09\x01");
        c.flush().await?;

        let start = match c.recv_method().await? {
            AMQPClass::Connection(connection::AMQPMethod::Start(s)) => s,
            other => return Err(unexpected(label, "connection.start", &other)),
        };
        let mechs = String::from_utf8_lossy(start.mechanisms.as_bytes()).to_string();
        if !mechs.split_whitespace().any(|m| m == "PLAIN") {
            bail!("{label}: the broker does not offer PLAIN authentication (offers: {mechs})");
        }
        let user = &uri.authority.userinfo.username;
        let pass = &uri.authority.userinfo.password;
        let mut resp = Vec::with_capacity(user.len() + pass.len() + 2);
        resp.push(0);
        resp.extend_from_slice(user.as_bytes());
        resp.push(0);
        resp.extend_from_slice(pass.as_bytes());
        c.send(method(
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: client_properties(label),
                mechanism: "PLAIN".into(),
                response: LongString::from(resp),
                locale: "en_US".into(),
            })),
            0,
        ))
        .await?;

        let tune = match c.recv_method().await {
            Ok(AMQPClass::Connection(connection::AMQPMethod::Tune(t))) => t,
            Ok(other) => return Err(unexpected(label, "connection.tune", &other)),
            Err(e) if e.downcast_ref::<ServerClose>().is_none() => {
                return Err(e.context(format!(
                    "{label}: handshake failed after authentication (wrong user/password for '{user}'?)"
                )))
            }
            Err(e) => return Err(e),
        };
        let mut frame_max = if tune.frame_max == 0 {
            DEFAULT_FRAME_MAX
        } else {
            tune.frame_max
        };
        if let Some(fm) = uri.query.frame_max {
            if fm >= 4096 {
                frame_max = frame_max.min(fm);
            }
        }
        c.frame_max = frame_max;
        let channel_max = if tune.channel_max == 0 {
            2047
        } else {
            tune.channel_max.min(2047)
        };
        // Heartbeats are disabled (0): runs are short and the client never idles.
        c.send_no_flush(method(
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max,
                frame_max,
                heartbeat: 0,
            })),
            0,
        ))?;
        c.send(method(
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: short(&uri.vhost, "the vhost name")?,
            })),
            0,
        ))
        .await?;
        match c.recv_method().await? {
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)) => {}
            other => return Err(unexpected(label, "connection.open-ok", &other)),
        }
        Ok(c)
    }

    pub fn send_no_flush(&mut self, f: AMQPFrame) -> Result<()> {
        encode(&mut self.wbuf, &f)
    }

    pub async fn send(&mut self, f: AMQPFrame) -> Result<()> {
        encode(&mut self.wbuf, &f)?;
        self.flush().await
    }

    pub async fn flush(&mut self) -> Result<()> {
        if !self.wbuf.is_empty() {
            write_all(&mut self.wr, &self.wbuf)
                .await
                .with_context(|| format!("{}: write to the broker failed", self.label))?;
            self.wbuf.clear();
        }
        Ok(())
    }

    /// Make room in the read buffer and read once; Ok(false) on EOF.
    pub async fn fill(&mut self) -> Result<bool> {
        fill(&mut self.rd, &mut self.rbuf).await
    }

    /// Next frame, fully decoded (setup path only).
    pub async fn recv_frame(&mut self) -> Result<AMQPFrame> {
        loop {
            if let Some((_, n)) = split_frame(&self.rbuf)? {
                let f = decode(&self.rbuf[..n])?;
                self.rbuf.advance(n);
                return Ok(f);
            }
            if !self.fill().await? {
                bail!("{}: the broker closed the TCP connection", self.label);
            }
        }
    }

    /// Next method frame. A close from the broker is acknowledged and
    /// returned as a `ServerClose` error.
    pub async fn recv_method(&mut self) -> Result<AMQPClass> {
        loop {
            let (ch, m) = match self.recv_frame().await? {
                AMQPFrame::Method(ch, m) => (ch, m),
                _ => continue, // heartbeats; no content is expected during setup
            };
            if let Some(close) = server_close_of(&m) {
                let ok = if close.connection {
                    connection_close_ok_frame()
                } else {
                    channel_close_ok_frame(ch)
                };
                let _ = self.send(ok).await;
                return Err(anyhow::Error::new(close).context(self.label.clone()));
            }
            return Ok(m);
        }
    }

    pub async fn call(&mut self, ch: u16, m: AMQPClass) -> Result<AMQPClass> {
        self.send(method(m, ch)).await?;
        self.recv_method().await
    }

    pub async fn channel_open(&mut self, ch: u16) -> Result<()> {
        match self
            .call(
                ch,
                AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            )
            .await?
        {
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)) => Ok(()),
            other => Err(unexpected(&self.label, "channel.open-ok", &other)),
        }
    }

    pub async fn confirm_select(&mut self, ch: u16) -> Result<()> {
        let m = AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        }));
        match self.call(ch, m).await? {
            AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_)) => Ok(()),
            other => Err(unexpected(&self.label, "confirm.select-ok", &other)),
        }
    }

    pub async fn qos(&mut self, ch: u16, prefetch: u16) -> Result<()> {
        let m = AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: prefetch,
            global: false,
        }));
        match self.call(ch, m).await? {
            AMQPClass::Basic(basic::AMQPMethod::QosOk(_)) => Ok(()),
            other => Err(unexpected(&self.label, "basic.qos-ok", &other)),
        }
    }

    pub async fn consume(&mut self, ch: u16, queue: &str, no_ack: bool) -> Result<String> {
        let m = AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: short(queue, "the queue name")?,
            consumer_tag: "".into(),
            no_local: false,
            no_ack,
            exclusive: false,
            nowait: false,
            arguments: FieldTable::default(),
        }));
        match self.call(ch, m).await? {
            AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(ok)) => Ok(ok.consumer_tag.to_string()),
            other => Err(unexpected(&self.label, "basic.consume-ok", &other)),
        }
    }

    /// queue.declare; returns (name, message count, consumer count).
    #[allow(clippy::too_many_arguments)]
    pub async fn queue_declare(
        &mut self,
        ch: u16,
        name: &str,
        passive: bool,
        durable: bool,
        auto_delete: bool,
        arguments: FieldTable,
    ) -> Result<(String, u32, u32)> {
        let m = AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: short(name, "the queue name")?,
            passive,
            durable,
            exclusive: false,
            auto_delete,
            nowait: false,
            arguments,
        }));
        match self.call(ch, m).await? {
            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => {
                Ok((ok.queue.to_string(), ok.message_count, ok.consumer_count))
            }
            other => Err(unexpected(&self.label, "queue.declare-ok", &other)),
        }
    }

    pub async fn queue_delete(&mut self, ch: u16, name: &str) -> Result<u32> {
        let m = AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
            queue: short(name, "the queue name")?,
            if_unused: false,
            if_empty: false,
            nowait: false,
        }));
        match self.call(ch, m).await? {
            AMQPClass::Queue(queue::AMQPMethod::DeleteOk(ok)) => Ok(ok.message_count),
            other => Err(unexpected(&self.label, "queue.delete-ok", &other)),
        }
    }

    /// Orderly close: channel.close (if `ch` is open) then connection.close,
    /// each waiting for its -ok, ignoring anything else in flight.
    pub async fn close(mut self, ch: Option<u16>) -> Result<()> {
        if let Some(ch) = ch {
            self.send(channel_close_frame(ch)).await?;
            loop {
                match self.recv_frame().await? {
                    AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))) => {
                        break
                    }
                    AMQPFrame::Method(
                        _,
                        m @ AMQPClass::Connection(connection::AMQPMethod::Close(_)),
                    ) => {
                        let _ = self.send(connection_close_ok_frame()).await;
                        return Err(anyhow::Error::new(server_close_of(&m).unwrap())
                            .context(self.label.clone()));
                    }
                    _ => {}
                }
            }
        }
        self.send(connection_close_frame()).await?;
        loop {
            match self.recv_frame().await? {
                AMQPFrame::Method(_, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))) => {
                    break
                }
                AMQPFrame::Method(_, AMQPClass::Connection(connection::AMQPMethod::Close(_))) => {
                    let _ = self.send(connection_close_ok_frame()).await;
                    break;
                }
                _ => {}
            }
        }
        let _ = self.wr.shutdown().await;
        Ok(())
    }
}

/// Best-effort connection.close (used when giving up during setup).
pub async fn close_quietly(c: Conn) {
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), c.close(None)).await;
}

/// Make room in `rbuf` (reusing consumed space) and read once; Ok(false) on EOF.
pub async fn fill(rd: &mut Rd, rbuf: &mut BytesMut) -> Result<bool> {
    if rbuf.capacity() - rbuf.len() < READ_CHUNK / 4 {
        rbuf.reserve(READ_CHUNK);
    }
    let n = rd.read_buf(rbuf).await?;
    Ok(n > 0)
}

/// Writes `buf` and flushes: a TLS stream may hold encrypted bytes back until flushed
/// (for TCP the flush is free).
pub async fn write_all(wr: &mut Wr, buf: &[u8]) -> std::io::Result<()> {
    wr.write_all(buf).await?;
    wr.flush().await
}

/// Parse `x-queue-mode=lazy,x-max-length=1000` style queue arguments.
/// Integers become long-long ints, true/false booleans, anything else a string.
pub fn parse_queue_args(items: &[String]) -> Result<FieldTable> {
    let mut t = FieldTable::default();
    for item in items.iter().flat_map(|s| s.split(',')) {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        let (k, v) = item
            .split_once('=')
            .ok_or_else(|| anyhow!("queue argument '{item}' is not KEY=VALUE"))?;
        let value = if let Ok(i) = v.parse::<i64>() {
            AMQPValue::LongLongInt(i)
        } else if v == "true" || v == "false" {
            AMQPValue::Boolean(v == "true")
        } else {
            AMQPValue::LongString(v.into())
        };
        t.insert(short(k, "a queue argument name")?, value);
    }
    Ok(t)
}
