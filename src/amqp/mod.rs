//! The AMQP 0-9-1 wire codec. Pure: no I/O.
//!
//! Frames are split here (so `frame_max` is enforced before a payload is buffered and bodies
//! stay zero-copy); method and content-header payloads are decoded and encoded with
//! `amq-protocol`'s generated code.

pub mod frame;
pub mod nesting;
pub mod reply_code;

pub use amq_protocol::protocol::{self as methods, AMQPClass};
pub use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
pub use frame::{Frame, FrameError, FrameKind};
pub use reply_code::{AmqpError, ReplyCode};

/// Builds a `ShortString`, cutting `s` to 255 bytes on a char boundary instead of panicking.
pub fn short(s: &str) -> ShortString {
    let mut end = s.len().min(255);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    ShortString::from(&s[..end])
}
