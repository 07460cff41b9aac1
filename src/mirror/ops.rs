//! The wire form of a queue's operations, as a master ships them to its mirrors in a GM
//! broadcast: the `IndexOp`s the storage syncer writes (`docs/mirroring.md`), with each
//! published message in its stored form, so the mirror writes exactly what the master wrote.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::broker::queue::IndexOp;
use crate::broker::Message;

/// Why a batch of operations could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// The batch is not a bincode list of operations.
    #[error("undecodable operations: {0}")]
    Batch(String),
    /// A published message did not decode.
    #[error("undecodable message {id:032x} at seq {seq}")]
    Message {
        /// Its id.
        id: u128,
        /// Its sequence number.
        seq: u64,
    },
}

#[derive(Serialize, Deserialize)]
enum WireOp {
    Publish {
        seq: u64,
        id: u128,
        // As bytes: serde copies the message at once, not byte by byte.
        #[serde(with = "serde_bytes")]
        stored: Vec<u8>,
        expires_at_ms: u64,
        persistent: bool,
    },
    Deliver {
        seq: u64,
    },
    Ack {
        seq: u64,
        message_id: u128,
        size: usize,
        persistent: bool,
    },
    DeleteQueue,
}

/// Encodes a batch of operations.
pub fn encode(ops: &[IndexOp]) -> Vec<u8> {
    let wire: Vec<WireOp> = ops
        .iter()
        .map(|op| match op {
            IndexOp::Publish {
                seq,
                message,
                expires_at_ms,
                persistent,
            } => WireOp::Publish {
                seq: *seq,
                id: message.id,
                stored: message.to_stored(),
                expires_at_ms: *expires_at_ms,
                persistent: *persistent,
            },
            IndexOp::Deliver { seq } => WireOp::Deliver { seq: *seq },
            IndexOp::Ack {
                seq,
                message_id,
                size,
                persistent,
            } => WireOp::Ack {
                seq: *seq,
                message_id: *message_id,
                size: *size,
                persistent: *persistent,
            },
            IndexOp::DeleteQueue => WireOp::DeleteQueue,
        })
        .collect();
    // A Vec of plain enums always serialises.
    bincode::serialize(&wire).unwrap_or_default()
}

/// Decodes a batch [`encode`] made.
pub fn decode(bytes: &[u8]) -> Result<Vec<IndexOp>, OpsError> {
    let wire: Vec<WireOp> =
        bincode::deserialize(bytes).map_err(|e| OpsError::Batch(e.to_string()))?;
    wire.into_iter()
        .map(|op| {
            Ok(match op {
                WireOp::Publish {
                    seq,
                    id,
                    stored,
                    expires_at_ms,
                    persistent,
                } => IndexOp::Publish {
                    seq,
                    message: Arc::new(
                        Message::from_stored(&stored, id).ok_or(OpsError::Message { id, seq })?,
                    ),
                    expires_at_ms,
                    persistent,
                },
                WireOp::Deliver { seq } => IndexOp::Deliver { seq },
                WireOp::Ack {
                    seq,
                    message_id,
                    size,
                    persistent,
                } => IndexOp::Ack {
                    seq,
                    message_id,
                    size,
                    persistent,
                },
                WireOp::DeleteQueue => IndexOp::DeleteQueue,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::protocol::basic::gen_properties;
    use amq_protocol::protocol::basic::AMQPProperties;
    use bytes::Bytes;
    use cookie_factory::gen_simple;

    fn message(body: &[u8]) -> Message {
        let props = AMQPProperties::default()
            .with_delivery_mode(2)
            .with_content_type("text/plain".into());
        let raw = gen_simple(gen_properties(&props), Vec::new()).expect("encode properties");
        Message {
            id: 0xABCD,
            exchange: "x".into(),
            routing_key: "k".into(),
            properties_raw: Bytes::from(raw),
            properties: props,
            body: Bytes::copy_from_slice(body),
        }
    }

    #[test]
    fn a_batch_round_trips_with_its_messages() {
        let ops = vec![
            IndexOp::Publish {
                seq: 7,
                message: Arc::new(message(b"hello")),
                expires_at_ms: 99,
                persistent: true,
            },
            IndexOp::Deliver { seq: 7 },
            IndexOp::Ack {
                seq: 7,
                message_id: 0xABCD,
                size: 42,
                persistent: true,
            },
            IndexOp::DeleteQueue,
        ];
        let back = decode(&encode(&ops)).expect("decodes");
        assert_eq!(back.len(), 4);
        match &back[0] {
            IndexOp::Publish {
                seq,
                message,
                expires_at_ms,
                persistent,
            } => {
                assert_eq!((*seq, *expires_at_ms, *persistent), (7, 99, true));
                assert_eq!(message.id, 0xABCD);
                assert_eq!(&message.body[..], b"hello");
                assert_eq!(
                    (&message.exchange[..], &message.routing_key[..]),
                    ("x", "k")
                );
                assert!(message.persistent());
                assert_eq!(
                    message
                        .properties
                        .content_type()
                        .as_ref()
                        .map(|s| s.as_str()),
                    Some("text/plain")
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(back[1], IndexOp::Deliver { seq: 7 }));
        assert!(matches!(
            back[2],
            IndexOp::Ack {
                seq: 7,
                message_id: 0xABCD,
                size: 42,
                persistent: true
            }
        ));
        assert!(matches!(back[3], IndexOp::DeleteQueue));
        assert!(decode(b"not a batch").is_err());
    }
}
