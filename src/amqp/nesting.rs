//! How deep a client's field tables and arrays nest, measured without recursion before
//! anything parses them.
//!
//! amq-protocol parses field tables and arrays recursively, and so do the drop, clone and
//! formatting code that handle the values afterwards. Without a bound, a client could send
//! a content header of arrays nested 10,000 deep (50 KB, well under the default
//! `frame_max`) and overflow the 2 MiB stack of the tokio worker decoding it, which aborts
//! the whole node (found while fuzzing, issue 21). RabbitMQ's messages nest a few levels
//! (`x-death` is an array of tables); [`NESTING_MAX`] leaves room for far more.

/// The deepest nesting of field tables and arrays accepted; the outermost table is 1.
pub const NESTING_MAX: usize = 100;

/// The bytes a method's arguments take before its field table, for the methods that carry
/// one: `(class, method, layout)`, the layout being `s` for a short, `o` for an octet (bits
/// share one), `t` for a short string. RabbitMQ's `exchange.bind` and `exchange.unbind`
/// included; `connection.start` too, since a client may send any method.
const TABLE_METHODS: &[(u16, u16, &str)] = &[
    (10, 10, "oo"),    // connection.start: version-major, version-minor, server-properties
    (10, 11, ""),      // connection.start-ok: client-properties first
    (40, 10, "stto"),  // exchange.declare: ticket, exchange, type, bits, arguments
    (40, 30, "sttto"), // exchange.bind: ticket, destination, source, routing-key, no-wait
    (40, 40, "sttto"), // exchange.unbind
    (50, 10, "sto"),   // queue.declare: ticket, queue, bits, arguments
    (50, 20, "sttto"), // queue.bind: ticket, queue, exchange, routing-key, no-wait
    (50, 50, "sttt"),  // queue.unbind: ticket, queue, exchange, routing-key (no bits)
    (60, 20, "stto"),  // basic.consume: ticket, queue, consumer-tag, bits
];

/// Whether the field table of a method payload (class and method ids first) nests deeper
/// than [`NESTING_MAX`]. A payload too short or malformed to reach its table is not: the
/// parser refuses it without going deep.
pub fn method_too_deep(payload: &[u8]) -> bool {
    let (Some(class), Some(method)) = (u16_at(payload, 0), u16_at(payload, 2)) else {
        return false;
    };
    let Some((_, _, layout)) = TABLE_METHODS
        .iter()
        .find(|(c, m, _)| *c == class && *m == method)
    else {
        return false;
    };
    let mut pos = 4;
    for arg in layout.bytes() {
        pos += match arg {
            b's' => 2,
            b'o' => 1,
            // A short string: its length byte, then the bytes.
            _ => match payload.get(pos) {
                Some(&n) => 1 + n as usize,
                None => return false,
            },
        };
    }
    payload
        .get(pos..)
        .is_some_and(|t| table_too_deep(t, NESTING_MAX))
}

/// Whether the `headers` table of raw content-header properties (flags, then the values)
/// nests deeper than [`NESTING_MAX`].
pub fn properties_too_deep(raw: &[u8]) -> bool {
    let Some(flags) = u16_at(raw, 0) else {
        return false;
    };
    if flags & 0x2000 == 0 {
        return false;
    }
    let mut pos = 2;
    // content-type, then content-encoding (short strings) come before headers.
    for bit in [0x8000, 0x4000] {
        if flags & bit != 0 {
            match raw.get(pos) {
                Some(&n) => pos += 1 + n as usize,
                None => return false,
            }
        }
    }
    raw.get(pos..)
        .is_some_and(|t| table_too_deep(t, NESTING_MAX))
}

#[derive(Clone, Copy)]
enum Container {
    Table,
    Array,
}

/// Whether the field table at the start of `buf` (a `u32` length, then its fields) nests
/// deeper than `max`. Walks the encoding with an explicit stack, as amq-protocol's parser
/// would descend; stops (not too deep) where the encoding is malformed.
pub fn table_too_deep(buf: &[u8], max: usize) -> bool {
    let Some(len) = u32_at(buf, 0) else {
        return false;
    };
    let mut pos = 4;
    let mut open = vec![(Container::Table, pos + len as usize)];
    if open[0].1 > buf.len() {
        return false;
    }
    while let Some(&(container, end)) = open.last() {
        if pos == end {
            open.pop();
            continue;
        }
        if let Container::Table = container {
            // The field's name, a short string.
            let Some(&n) = buf.get(pos) else {
                return false;
            };
            pos += 1 + n as usize;
        }
        let Some(&kind) = buf.get(pos) else {
            return false;
        };
        pos += 1;
        let size = match kind {
            b't' | b'b' | b'B' => 1,
            b's' | b'U' | b'u' => 2,
            b'I' | b'i' | b'f' => 4,
            b'D' => 5,
            b'L' | b'l' | b'd' | b'T' => 8,
            b'V' => 0,
            b'S' | b'x' => match u32_at(buf, pos) {
                Some(n) => 4 + n as usize,
                None => return false,
            },
            b'A' | b'F' => {
                let Some(n) = u32_at(buf, pos) else {
                    return false;
                };
                pos += 4;
                let inner_end = pos + n as usize;
                if inner_end > end {
                    return false;
                }
                if open.len() >= max {
                    return true;
                }
                let inner = if kind == b'A' {
                    Container::Array
                } else {
                    Container::Table
                };
                open.push((inner, inner_end));
                continue;
            }
            _ => return false,
        };
        pos += size;
        if pos > end {
            return false;
        }
    }
    false
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::protocol::{queue, AMQPClass};
    use amq_protocol::types::{AMQPValue, FieldArray, FieldTable};

    /// A table whose field `a` holds arrays nested `depth` deep (the table is level 1).
    fn nested_table(depth: usize) -> Vec<u8> {
        let mut v = vec![b'V'];
        for _ in 1..depth {
            let mut n = vec![b'A'];
            n.extend_from_slice(&(v.len() as u32).to_be_bytes());
            n.extend_from_slice(&v);
            v = n;
        }
        let mut fields = vec![1u8, b'a'];
        fields.extend_from_slice(&v);
        let mut t = (fields.len() as u32).to_be_bytes().to_vec();
        t.extend_from_slice(&fields);
        t
    }

    #[test]
    fn counts_the_levels_of_tables_and_arrays() {
        assert!(!table_too_deep(&nested_table(100), 100));
        assert!(table_too_deep(&nested_table(101), 100));
        assert!(table_too_deep(&nested_table(10_000), 100));
    }

    #[test]
    fn real_tables_are_not_too_deep() {
        let mut inner = FieldTable::default();
        inner.insert("queue".into(), AMQPValue::LongString("q".into()));
        inner.insert("count".into(), AMQPValue::LongLongInt(2));
        let mut args = FieldTable::default();
        args.insert("x-int".into(), AMQPValue::LongInt(7));
        args.insert("x-str".into(), AMQPValue::LongString("v".into()));
        args.insert("x-bytes".into(), AMQPValue::ByteArray(vec![1, 2].into()));
        args.insert("x-dec".into(), AMQPValue::Double(1.5));
        args.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(inner)])),
        );
        let mut payload = Vec::new();
        crate::amqp::frame::encode_method(
            &mut payload,
            1,
            &AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: "q".into(),
                passive: false,
                durable: true,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: args,
            })),
        );
        // The frame's 7-byte header and end octet around the payload.
        let payload = &payload[7..payload.len() - 1];
        assert!(!method_too_deep(payload));
    }

    /// Regression (issue 21): 10,000 levels overflowed a 2 MiB stack inside amq-protocol.
    #[test]
    fn deep_headers_and_arguments_are_refused_before_parsing() {
        let table = nested_table(10_000);
        let mut header = vec![0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 0x20, 0x00];
        header.extend_from_slice(&table);
        let e = crate::amqp::frame::decode_content_header(&header).expect_err("too deep");
        assert_eq!(e.code, crate::amqp::ReplyCode::FrameError);
        // queue.declare: ticket, queue "q", bits, then the arguments.
        let mut declare = vec![0, 50, 0, 10, 0, 0, 1, b'q', 0];
        declare.extend_from_slice(&table);
        let e = crate::amqp::frame::decode_method(&declare).expect_err("too deep");
        assert_eq!(e.code, crate::amqp::ReplyCode::FrameError);
        let mut ok = vec![0, 50, 0, 10, 0, 0, 1, b'q', 0];
        ok.extend_from_slice(&nested_table(NESTING_MAX));
        assert!(crate::amqp::frame::decode_method(&ok).is_ok());
    }

    #[test]
    fn malformed_tables_stop_the_walk() {
        assert!(!table_too_deep(&[0, 0, 0, 9, 1], 100));
        assert!(!table_too_deep(&[0, 0, 0, 3, 0, b'?', 0], 100));
        assert!(!method_too_deep(&[0, 50, 0, 10, 0]));
        assert!(!properties_too_deep(&[0x20]));
    }
}
