//! Frame splitting and encoding.
//!
//! A frame is `type:u8 channel:u16 size:u32 payload[size] 0xCE`. [`split`] checks the
//! announced size against `frame_max` before waiting for the payload (amq-protocol's parser
//! would wait forever for a 4 GiB frame), and returns the payload as a borrowed slice so
//! bodies are never copied twice.

use amq_protocol::protocol::{basic, AMQPClass};
use cookie_factory::WriteContext;

use super::reply_code::{AmqpError, ReplyCode};

/// Size of the frame header (type, channel, size).
pub const FRAME_HEADER_SIZE: usize = 7;
/// Bytes a frame adds around its payload (header plus end octet).
pub const FRAME_OVERHEAD: usize = FRAME_HEADER_SIZE + 1;
/// The frame-end octet.
pub const FRAME_END: u8 = 0xCE;
/// The smallest frame_max a peer may negotiate (spec: 4096).
pub const FRAME_MIN_SIZE: u32 = 4096;
/// The protocol header a 0-9-1 client sends first.
pub const PROTOCOL_HEADER: &[u8; 8] = b"AMQP\x00\x00\x09\x01";

/// The four frame types.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// A method frame.
    Method,
    /// A content header frame.
    Header,
    /// A content body frame.
    Body,
    /// A heartbeat frame.
    Heartbeat,
}

/// A frame whose payload borrows the read buffer.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Frame<'a> {
    /// The frame type.
    pub kind: FrameKind,
    /// The channel.
    pub channel: u16,
    /// The payload.
    pub payload: &'a [u8],
}

/// Why a byte stream is not a valid frame sequence; every case is a connection error.
/// Checked in RabbitMQ's order (`rabbit_reader`): the size as soon as the 7-octet header is
/// in, then the end octet, then the type.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The announced payload is larger than the negotiated frame_max allows.
    #[error("type {kind}, all octets = <<>>: {{frame_too_large,{size},{limit}}}")]
    TooLarge {
        /// The type octet.
        kind: u8,
        /// Announced payload size.
        size: u64,
        /// The largest payload allowed (frame_max less the frame's 8 octets).
        limit: u64,
    },
    /// The octet after the payload is not 0xCE.
    #[error(
        "type {kind}, all octets = {}: {{invalid_frame_end_marker,{end}}}",
        erlang_binary(payload)
    )]
    BadEnd {
        /// The type octet.
        kind: u8,
        /// The payload.
        payload: Vec<u8>,
        /// The octet found instead.
        end: u8,
    },
    /// The type octet is not one of the four frame types.
    #[error("type {kind}, all octets = {}: unknown_frame", erlang_binary(payload))]
    UnknownType {
        /// The type octet.
        kind: u8,
        /// The payload.
        payload: Vec<u8>,
    },
}

impl FrameError {
    /// The connection error a frame error closes the connection with (501, as RabbitMQ).
    pub fn to_amqp(&self) -> AmqpError {
        AmqpError::new(ReplyCode::FrameError, self.to_string())
    }
}

/// `bytes` as Erlang's `~p` prints a binary in RabbitMQ's frame errors: `<<"text">>` when
/// every octet is printable, else the octets (`<<0,50>>`).
pub fn erlang_binary(bytes: &[u8]) -> String {
    if !bytes.is_empty() && bytes.iter().all(|b| (32..127).contains(b)) {
        let text: String = bytes
            .iter()
            .flat_map(|&b| match b {
                b'"' | b'\\' => vec!['\\', b as char],
                _ => vec![b as char],
            })
            .collect();
        return format!("<<\"{text}\">>");
    }
    let octets: Vec<String> = bytes.iter().map(|b| b.to_string()).collect();
    format!("<<{}>>", octets.join(","))
}

/// Splits one frame off the front of `buf`.
///
/// Returns `Ok(None)` when more bytes are needed, `Ok(Some((frame, consumed)))` otherwise.
/// `frame_max` of 0 means no limit.
pub fn split(buf: &[u8], frame_max: u32) -> Result<Option<(Frame<'_>, usize)>, FrameError> {
    if buf.len() < FRAME_HEADER_SIZE {
        return Ok(None);
    }
    let kind_octet = buf[0];
    let channel = u16::from_be_bytes([buf[1], buf[2]]);
    let size = u32::from_be_bytes([buf[3], buf[4], buf[5], buf[6]]) as u64;
    let limit = (frame_max as u64).saturating_sub(FRAME_OVERHEAD as u64);
    if frame_max != 0 && size > limit {
        return Err(FrameError::TooLarge {
            kind: kind_octet,
            size,
            limit,
        });
    }
    let total = (size + FRAME_OVERHEAD as u64) as usize;
    if buf.len() < total {
        return Ok(None);
    }
    let payload = &buf[FRAME_HEADER_SIZE..total - 1];
    if buf[total - 1] != FRAME_END {
        return Err(FrameError::BadEnd {
            kind: kind_octet,
            payload: payload.to_vec(),
            end: buf[total - 1],
        });
    }
    let kind = match kind_octet {
        1 => FrameKind::Method,
        2 => FrameKind::Header,
        3 => FrameKind::Body,
        8 => FrameKind::Heartbeat,
        t => {
            return Err(FrameError::UnknownType {
                kind: t,
                payload: payload.to_vec(),
            })
        }
    };
    Ok(Some((
        Frame {
            kind,
            channel,
            payload,
        },
        total,
    )))
}

/// Appends a method frame.
pub fn encode_method(out: &mut Vec<u8>, channel: u16, method: &AMQPClass) {
    // Generate into a scratch buffer first: a generator error must not lose `out`.
    let scratch = Vec::with_capacity(64);
    let payload = match amq_protocol::protocol::gen_class(method)(WriteContext::from(scratch)) {
        Ok(ctx) => ctx.into_inner().0,
        Err(e) => {
            // Only reachable through a bug in what we generate (all strings are validated).
            tracing::error!(error = ?e, ?method, "cannot encode method");
            return;
        }
    };
    push_frame(out, 1, channel, &payload);
}

/// Appends a heartbeat frame.
pub fn encode_heartbeat(out: &mut Vec<u8>) {
    out.extend_from_slice(&[8, 0, 0, 0, 0, 0, 0, FRAME_END]);
}

/// Appends a content header frame and the body split into frames of at most `frame_max`.
///
/// `properties` are the raw property flags and values exactly as the publisher sent them, so
/// a message is forwarded byte for byte.
pub fn encode_content(
    out: &mut Vec<u8>,
    channel: u16,
    properties: &[u8],
    body: &[u8],
    frame_max: u32,
) {
    let header_len = 12 + properties.len();
    push_frame_header(out, 2, channel, header_len as u32);
    out.extend_from_slice(&60u16.to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes());
    out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    out.extend_from_slice(properties);
    out.push(FRAME_END);
    let chunk = if frame_max == 0 {
        usize::MAX
    } else {
        frame_max as usize - FRAME_OVERHEAD
    };
    for part in body.chunks(chunk.max(1)) {
        push_frame(out, 3, channel, part);
    }
}

/// Appends basic.deliver by hand: it is the hottest method on the outbound path.
pub fn encode_deliver(
    out: &mut Vec<u8>,
    channel: u16,
    consumer_tag: &str,
    delivery_tag: u64,
    redelivered: bool,
    exchange: &str,
    routing_key: &str,
) {
    let len = 4 + 1 + consumer_tag.len() + 8 + 1 + 1 + exchange.len() + 1 + routing_key.len();
    push_frame_header(out, 1, channel, len as u32);
    out.extend_from_slice(&[0, 60, 0, 60]);
    push_short_str(out, consumer_tag);
    out.extend_from_slice(&delivery_tag.to_be_bytes());
    out.push(redelivered as u8);
    push_short_str(out, exchange);
    push_short_str(out, routing_key);
    out.push(FRAME_END);
}

/// Appends basic.ack (server to client, confirms) by hand.
pub fn encode_basic_ack(out: &mut Vec<u8>, channel: u16, delivery_tag: u64, multiple: bool) {
    encode_method(
        out,
        channel,
        &AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag,
            multiple,
        })),
    );
}

fn push_short_str(out: &mut Vec<u8>, s: &str) {
    // Callers pass names that were short strings on the wire or validated names.
    let bytes = &s.as_bytes()[..s.len().min(255)];
    out.push(bytes.len() as u8);
    out.extend_from_slice(bytes);
}

fn push_frame_header(out: &mut Vec<u8>, kind: u8, channel: u16, size: u32) {
    out.push(kind);
    out.extend_from_slice(&channel.to_be_bytes());
    out.extend_from_slice(&size.to_be_bytes());
}

fn push_frame(out: &mut Vec<u8>, kind: u8, channel: u16, payload: &[u8]) {
    push_frame_header(out, kind, channel, payload.len() as u32);
    out.extend_from_slice(payload);
    out.push(FRAME_END);
}

/// Reads the class and method ids at the front of a method payload.
pub fn method_ids(payload: &[u8]) -> Option<(u16, u16)> {
    if payload.len() < 4 {
        return None;
    }
    Some((
        u16::from_be_bytes([payload[0], payload[1]]),
        u16::from_be_bytes([payload[2], payload[3]]),
    ))
}

/// Whether `(class, method)` names a method of AMQP 0-9-1 with RabbitMQ's extensions.
pub fn is_known_method(class_id: u16, method_id: u16) -> bool {
    match class_id {
        10 => matches!(
            method_id,
            10 | 11 | 20 | 21 | 30 | 31 | 40 | 41 | 50 | 51 | 60 | 61 | 70 | 71
        ),
        20 => matches!(method_id, 10 | 11 | 20 | 21 | 40 | 41),
        30 => matches!(method_id, 10 | 11),
        40 => matches!(method_id, 10 | 11 | 20 | 21 | 30 | 31 | 40 | 51),
        50 => matches!(method_id, 10 | 11 | 20 | 21 | 30 | 31 | 40 | 41 | 50 | 51),
        60 => matches!(
            method_id,
            10 | 11
                | 20
                | 21
                | 30
                | 31
                | 40
                | 50
                | 60
                | 70
                | 71
                | 72
                | 80
                | 90
                | 100
                | 110
                | 111
                | 120
        ),
        85 => matches!(method_id, 10 | 11),
        90 => matches!(method_id, 10 | 11 | 20 | 21 | 30 | 31),
        _ => false,
    }
}

/// Decodes a method payload; unknown methods get 540, undecodable ones 501 as in RabbitMQ.
pub fn decode_method(payload: &[u8]) -> Result<AMQPClass, AmqpError> {
    if let Some(publish) = decode_basic_publish(payload) {
        return Ok(AMQPClass::Basic(basic::AMQPMethod::Publish(publish)));
    }
    decode_method_generic(payload)
}

/// `basic.publish`, the method of every message, decoded by hand: the generic parser
/// builds the two flags as named strings in a map, and with the rest of its work that
/// was an eighth of one node's CPU publishing small messages. Only a payload that is
/// exactly a well-formed `basic.publish` is taken here; anything else (a short or long
/// payload, a name that is not UTF-8) goes to the generic parser, so its answers and
/// errors stay as they were.
fn decode_basic_publish(payload: &[u8]) -> Option<basic::Publish> {
    // class 60, method 40, then the reserved ticket (short), read and ignored as the
    // generic parser does.
    let rest = payload.strip_prefix(&[0, 60, 0, 40])?.get(2..)?;
    let (exchange, rest) = short_str(rest)?;
    let (routing_key, rest) = short_str(rest)?;
    let [flags] = rest else {
        return None;
    };
    Some(basic::Publish {
        exchange: exchange.into(),
        routing_key: routing_key.into(),
        mandatory: flags & 1 != 0,
        immediate: flags & 2 != 0,
    })
}

/// A `shortstr` (a length octet, then that many bytes of UTF-8) and what follows it.
fn short_str(b: &[u8]) -> Option<(&str, &[u8])> {
    let (&len, rest) = b.split_first()?;
    let (s, rest) = rest.split_at_checked(usize::from(len))?;
    Some((std::str::from_utf8(s).ok()?, rest))
}

/// Every method through amq-protocol's parser.
fn decode_method_generic(payload: &[u8]) -> Result<AMQPClass, AmqpError> {
    let Some((class_id, method_id)) = method_ids(payload) else {
        return Err(AmqpError::new(
            ReplyCode::FrameError,
            "method frame too short",
        ));
    };
    if !is_known_method(class_id, method_id) {
        return Err(AmqpError::new(
            ReplyCode::NotImplemented,
            format!("unknown method class {class_id} method {method_id}"),
        ));
    }
    // Before the recursive parser runs (`nesting`: a deep table overflows the stack).
    if super::nesting::method_too_deep(payload) {
        return Err(AmqpError::new(
            ReplyCode::FrameError,
            format!(
                "field table nested deeper than {} levels",
                super::nesting::NESTING_MAX
            ),
        )
        .at(class_id, method_id));
    }
    match amq_protocol::protocol::parse_class(payload) {
        Ok(([], method)) => Ok(method),
        Ok(_) => Err(
            AmqpError::new(ReplyCode::FrameError, "trailing bytes in method frame")
                .at(class_id, method_id),
        ),
        // RabbitMQ names the arguments it could not decode.
        Err(_) => Err(AmqpError::new(
            ReplyCode::FrameError,
            format!("cannot decode {}", erlang_binary(&payload[4..])),
        )
        .at(class_id, method_id)),
    }
}

/// A decoded content header: body size plus the raw and parsed properties.
#[derive(Clone, Debug)]
pub struct ContentHeader {
    /// The class (must be 60, basic).
    pub class_id: u16,
    /// Total body size announced.
    pub body_size: u64,
    /// Raw property flags and values, forwarded unchanged.
    pub raw_properties: bytes::Bytes,
    /// Parsed properties, for routing decisions (headers, expiration, delivery mode).
    pub properties: basic::AMQPProperties,
}

/// Decodes a content header payload.
pub fn decode_content_header(payload: &[u8]) -> Result<ContentHeader, AmqpError> {
    if payload.len() < 14 {
        return Err(AmqpError::new(
            ReplyCode::FrameError,
            "content header too short",
        ));
    }
    let class_id = u16::from_be_bytes([payload[0], payload[1]]);
    let body_size = u64::from_be_bytes(payload[4..12].try_into().unwrap_or([0; 8]));
    let raw = &payload[12..];
    if super::nesting::properties_too_deep(raw) {
        return Err(AmqpError::new(
            ReplyCode::FrameError,
            format!(
                "headers nested deeper than {} levels",
                super::nesting::NESTING_MAX
            ),
        ));
    }
    match basic::parse_properties(raw) {
        Ok(([], properties)) => Ok(ContentHeader {
            class_id,
            body_size,
            raw_properties: bytes::Bytes::copy_from_slice(raw),
            properties,
        }),
        _ => Err(AmqpError::new(
            ReplyCode::FrameError,
            "cannot decode content header",
        )),
    }
}

/// Encodes properties into the raw form (for messages the broker itself builds).
pub fn encode_properties(properties: &basic::AMQPProperties) -> Vec<u8> {
    match basic::gen_properties(properties)(WriteContext::from(Vec::new())) {
        Ok(ctx) => ctx.into_inner().0,
        Err(_) => vec![0, 0],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::protocol::queue;
    use proptest::prelude::*;

    /// A `basic.publish` payload from its parts; `flags` are the bytes after the two names
    /// (one in a well-formed payload).
    fn publish_payload(ticket: u16, exchange: &[u8], key: &[u8], flags: &[u8]) -> Vec<u8> {
        let mut p = vec![0, 60, 0, 40];
        p.extend_from_slice(&ticket.to_be_bytes());
        for s in [exchange, key] {
            p.push(s.len() as u8);
            p.extend_from_slice(s);
        }
        p.extend_from_slice(flags);
        p
    }

    proptest! {
        /// The hand decoder of `basic.publish` answers exactly as the generic parser does:
        /// the same method for a well-formed payload, the same error for any other (a
        /// short or long one, names that are not UTF-8, a truncated name).
        #[test]
        fn basic_publish_decodes_as_the_generic_parser_does(
            ticket in any::<u16>(),
            exchange in prop::collection::vec(prop_oneof![97u8..123, any::<u8>()], 0..12),
            key in prop::collection::vec(prop_oneof![97u8..123, any::<u8>()], 0..12),
            flags in prop::collection::vec(any::<u8>(), 0..3),
            cut in 0usize..40,
        ) {
            let mut p = publish_payload(ticket, &exchange, &key, &flags);
            let whole = p.clone();
            p.truncate(p.len().saturating_sub(cut % 4));
            for payload in [&whole, &p] {
                let fast = decode_method(payload);
                let generic = decode_method_generic(payload);
                prop_assert_eq!(format!("{fast:?}"), format!("{generic:?}"));
            }
        }
    }

    #[test]
    fn a_well_formed_publish_takes_the_hand_decoder() {
        let p = publish_payload(0, b"amq.direct", b"k", &[0b11]);
        let publish = decode_basic_publish(&p).expect("taken by hand");
        assert_eq!(
            (publish.exchange.as_str(), publish.routing_key.as_str()),
            ("amq.direct", "k")
        );
        assert!(publish.mandatory && publish.immediate);
        // Not UTF-8, or a byte too many: the generic parser's.
        assert!(decode_basic_publish(&publish_payload(0, b"\xff", b"k", &[0])).is_none());
        assert!(decode_basic_publish(&publish_payload(0, b"x", b"k", &[0, 0])).is_none());
        assert!(decode_basic_publish(&publish_payload(0, b"x", b"k", &[])).is_none());
    }

    #[test]
    fn split_waits_for_a_whole_frame_and_checks_the_end() {
        let mut out = Vec::new();
        encode_heartbeat(&mut out);
        for n in 0..out.len() {
            assert_eq!(split(&out[..n], 4096).unwrap(), None, "prefix {n}");
        }
        let (f, used) = split(&out, 4096).unwrap().unwrap();
        assert_eq!((f.kind, f.channel, used), (FrameKind::Heartbeat, 0, 8));
        out[7] = 0;
        assert_eq!(
            split(&out, 4096),
            Err(FrameError::BadEnd {
                kind: 8,
                payload: Vec::new(),
                end: 0
            })
        );
    }

    #[test]
    fn split_refuses_oversized_frames_before_buffering_them() {
        let header = [3u8, 0, 1, 0x7f, 0xff, 0xff, 0xff];
        assert!(matches!(
            split(&header, 131072),
            Err(FrameError::TooLarge { .. })
        ));
        let unknown = [9u8, 0, 1, 0, 0, 0, 1, b'x', FRAME_END];
        let e = split(&unknown, 4096).unwrap_err();
        assert_eq!(
            e.to_string(),
            "type 9, all octets = <<\"x\">>: unknown_frame"
        );
        assert_eq!(
            split(&[3, 0, 1, 0, 3, 13, 64], 131072)
                .unwrap_err()
                .to_string(),
            "type 3, all octets = <<>>: {frame_too_large,200000,131064}"
        );
    }

    #[test]
    fn method_round_trips_through_the_codec() {
        let m = AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
            queue: "q".into(),
            message_count: 7,
            consumer_count: 1,
        }));
        let mut out = Vec::new();
        encode_method(&mut out, 3, &m);
        let (f, _) = split(&out, 0).unwrap().unwrap();
        assert_eq!(f.channel, 3);
        assert_eq!(decode_method(f.payload).unwrap(), m);
    }

    #[test]
    fn hand_encoded_deliver_matches_the_generated_one() {
        let mut ours = Vec::new();
        encode_deliver(&mut ours, 5, "ctag", 42, true, "ex", "rk");
        let mut theirs = Vec::new();
        encode_method(
            &mut theirs,
            5,
            &AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                consumer_tag: "ctag".into(),
                delivery_tag: 42,
                redelivered: true,
                exchange: "ex".into(),
                routing_key: "rk".into(),
            })),
        );
        assert_eq!(ours, theirs);
    }

    #[test]
    fn content_is_split_at_frame_max() {
        let mut out = Vec::new();
        let body = vec![7u8; 10_000];
        encode_content(&mut out, 1, &[0, 0], &body, 4096);
        let mut rest = &out[..];
        let mut bodies = 0;
        let mut total = 0;
        while let Some((f, used)) = split(rest, 4096).unwrap() {
            if f.kind == FrameKind::Body {
                bodies += 1;
                total += f.payload.len();
            }
            rest = &rest[used..];
        }
        assert_eq!((bodies, total), (3, 10_000));
    }

    #[test]
    fn unknown_method_is_540_and_garbage_is_501() {
        assert_eq!(
            decode_method(&[0, 99, 0, 1]).unwrap_err().code,
            ReplyCode::NotImplemented
        );
        assert_eq!(
            decode_method(&[0, 50, 0, 10, 0]).unwrap_err().code,
            ReplyCode::FrameError
        );
    }
}
