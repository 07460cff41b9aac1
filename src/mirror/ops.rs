//! The wire form of a queue's operations, as a master ships them to its mirrors in a GM
//! broadcast: the `IndexOp`s the storage syncer writes (`docs/mirroring.md`), with each
//! published message in its stored form, so the mirror writes exactly what the master wrote.

use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::message::MirrorMsg;
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
        // Serde bytes, decoded as a view of the batch (`crate::shared_bytes`).
        #[serde(with = "crate::shared_bytes")]
        stored: Bytes,
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
    let mut out = Vec::with_capacity(ops.iter().map(wire_size).sum());
    encode_into(&mut out, ops);
    out
}

/// `msg`, a [`MirrorMsg`] whose last field is an empty `ops`, encoded with `ops` as that
/// field: the batch is written in place, each body copied once, straight from the queue's
/// message (`encode` into a message would copy every body twice more).
pub fn encode_message(msg: &MirrorMsg, ops: &[IndexOp]) -> Vec<u8> {
    let mut out = msg.encode();
    debug_assert!(out.ends_with(&[0; 8]), "ops is the last field, and empty");
    out.truncate(out.len().saturating_sub(8));
    let at = out.len();
    out.extend_from_slice(&[0; 8]);
    out.reserve(ops.iter().map(wire_size).sum());
    encode_into(&mut out, ops);
    let len = (out.len() - at - 8) as u64;
    out[at..at + 8].copy_from_slice(&len.to_le_bytes());
    out
}

/// Appends `bincode::serialize(&Vec<WireOp>)` of `ops` to `out` without building the
/// `WireOp`s (and with it each message's stored form) first. bincode 1's default layout:
/// little-endian fixed-width integers, u64 lengths, u32 variant indexes, bools as a byte.
fn encode_into(out: &mut Vec<u8>, ops: &[IndexOp]) {
    out.extend_from_slice(&(ops.len() as u64).to_le_bytes());
    for op in ops {
        match op {
            IndexOp::Publish {
                seq,
                message,
                expires_at_ms,
                persistent,
            } => {
                out.extend_from_slice(&0u32.to_le_bytes());
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&message.id.to_le_bytes());
                out.extend_from_slice(&(message.stored_len() as u64).to_le_bytes());
                message.encode_stored_head(out);
                out.extend_from_slice(&message.body);
                out.extend_from_slice(&expires_at_ms.to_le_bytes());
                out.push(u8::from(*persistent));
            }
            IndexOp::Deliver { seq } => {
                out.extend_from_slice(&1u32.to_le_bytes());
                out.extend_from_slice(&seq.to_le_bytes());
            }
            IndexOp::Ack {
                seq,
                message_id,
                size,
                persistent,
            } => {
                out.extend_from_slice(&2u32.to_le_bytes());
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&message_id.to_le_bytes());
                out.extend_from_slice(&(*size as u64).to_le_bytes());
                out.push(u8::from(*persistent));
            }
            IndexOp::DeleteQueue => out.extend_from_slice(&3u32.to_le_bytes()),
        }
    }
}

/// The `WireOp`s of `ops`, as `decode` reads them (the tests' oracle for `encode_into`).
#[cfg(test)]
fn wire_ops(ops: &[IndexOp]) -> Vec<WireOp> {
    ops.iter()
        .map(|op| match op {
            IndexOp::Publish {
                seq,
                message,
                expires_at_ms,
                persistent,
            } => WireOp::Publish {
                seq: *seq,
                id: message.id,
                stored: Bytes::from(message.to_stored()),
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
        .collect()
}

/// About how many bytes `op` takes in an [`encode`]d batch (a little more, never less).
fn wire_size(op: &IndexOp) -> usize {
    match op {
        IndexOp::Publish { message, .. } => {
            message.body.len()
                + message.properties_raw.len()
                + message.exchange.len()
                + message.routing_key.len()
                + 96
        }
        IndexOp::Deliver { .. } | IndexOp::Ack { .. } | IndexOp::DeleteQueue => 48,
    }
}

/// Splits a round's operations, in order, into batches of at most `max_bytes` encoded
/// (an operation bigger than that alone): each batch travels as one GM message, which a
/// node-link frame must hold.
pub fn split_round(ops: Vec<IndexOp>, max_bytes: usize) -> Vec<Vec<IndexOp>> {
    let mut batches = Vec::new();
    let mut batch = Vec::new();
    let mut bytes = 0usize;
    for op in ops {
        let size = wire_size(&op);
        if !batch.is_empty() && bytes + size > max_bytes {
            batches.push(std::mem::take(&mut batch));
            bytes = 0;
        }
        bytes += size;
        batch.push(op);
    }
    if !batch.is_empty() {
        batches.push(batch);
    }
    batches
}

/// Decodes a batch [`encode`] made; the messages' properties and bodies are views of
/// `bytes`, not copies.
pub fn decode(bytes: &Bytes) -> Result<Vec<IndexOp>, OpsError> {
    let wire: Vec<WireOp> = crate::shared_bytes::decode_in(bytes, |b| bincode::deserialize(b))
        .map_err(|e| OpsError::Batch(e.to_string()))?;
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
                        Message::from_stored_shared(&stored, id)
                            .ok_or(OpsError::Message { id, seq })?,
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
    use proptest::prelude::*;

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
        let back = decode(&Bytes::from(encode(&ops))).expect("decodes");
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
        assert!(decode(&Bytes::from_static(b"not a batch")).is_err());
    }

    fn arb_op() -> impl Strategy<Value = IndexOp> {
        prop_oneof![
            (
                any::<u64>(),
                prop::collection::vec(any::<u8>(), 0..2000),
                "[a-z.]{0,300}",
                any::<u64>(),
                any::<bool>()
            )
                .prop_map(|(seq, body, rk, expires_at_ms, persistent)| {
                    let mut m = message(&body);
                    m.id = u128::from(seq) << 64 | 0x5a5a;
                    m.routing_key = rk;
                    IndexOp::Publish {
                        seq,
                        message: Arc::new(m),
                        expires_at_ms,
                        persistent,
                    }
                }),
            any::<u64>().prop_map(|seq| IndexOp::Deliver { seq }),
            (any::<u64>(), any::<u128>(), any::<u32>(), any::<bool>()).prop_map(
                |(seq, message_id, size, persistent)| IndexOp::Ack {
                    seq,
                    message_id,
                    size: size as usize,
                    persistent,
                }
            ),
            Just(IndexOp::DeleteQueue),
        ]
    }

    proptest! {
        /// The hand-written encoder writes exactly what bincode writes for the `WireOp`s
        /// (which `decode` reads, and older nodes wrote), alone and inside a message.
        #[test]
        fn encode_writes_what_bincode_writes(ops in prop::collection::vec(arb_op(), 0..6), epoch in any::<u64>()) {
            let oracle = bincode::serialize(&wire_ops(&ops)).expect("encodes");
            prop_assert_eq!(&encode(&ops), &oracle);
            let msg = MirrorMsg::Ops { epoch, ops: Bytes::from(oracle.clone()) }.encode();
            prop_assert_eq!(encode_message(&MirrorMsg::Ops { epoch, ops: Bytes::new() }, &ops), msg);
            let target = crate::gm::MemberId { node: 3, since: epoch };
            let batch = MirrorMsg::SyncBatch { epoch, target, sync: 9, ops: Bytes::from(oracle) }.encode();
            let empty = MirrorMsg::SyncBatch { epoch, target, sync: 9, ops: Bytes::new() };
            prop_assert_eq!(encode_message(&empty, &ops), batch);
        }
    }

    /// The point of `crate::shared_bytes`: a mirror's copy of a published body is the node
    /// link frame's bytes, through the GM frame, the mirror message and the batch.
    #[test]
    fn a_body_decodes_as_a_view_of_the_gm_frame_through_every_layer() {
        use crate::gm::{GmFrame, GmMsg, Item, MemberId};
        use crate::mirror::message::MirrorMsg;
        let body = vec![7u8; 100_000];
        let ops = vec![IndexOp::Publish {
            seq: 1,
            message: Arc::new(message(&body)),
            expires_at_ms: u64::MAX,
            persistent: true,
        }];
        let msg = MirrorMsg::Ops {
            epoch: 3,
            ops: Bytes::from(encode(&ops)),
        };
        let (a, b) = (
            MemberId { node: 1, since: 1 },
            MemberId { node: 2, since: 1 },
        );
        let frame = GmFrame {
            group: "g".into(),
            from: a,
            to: b,
            first_seq: 1,
            msgs: vec![GmMsg::Activity {
                version: 1,
                from: a,
                items: vec![Item {
                    id: a,
                    pubs: vec![(1, Bytes::from(msg.encode()))],
                    acks: Vec::new(),
                }],
            }],
            part: None,
        };
        let wire = Bytes::from(bincode::serialize(&frame).expect("encodes"));
        let got = crate::gm::wire::decode_frame(&wire).expect("decodes");
        assert_eq!(got, frame);
        let GmMsg::Activity { items, .. } = &got.msgs[0] else {
            panic!("{got:?}");
        };
        let Some(MirrorMsg::Ops { ops, .. }) = MirrorMsg::decode(&items[0].pubs[0].1) else {
            panic!("not an ops message");
        };
        let back = decode(&ops).expect("decodes");
        let IndexOp::Publish { message, .. } = &back[0] else {
            panic!("{back:?}");
        };
        assert_eq!(message.body, body);
        let frame_bytes = wire.as_ptr() as usize..wire.as_ptr() as usize + wire.len();
        assert!(frame_bytes.contains(&(message.body.as_ptr() as usize)));
        assert!(frame_bytes.contains(&(message.body.as_ptr() as usize + body.len() - 1)));
    }

    fn seq_of(op: &IndexOp) -> u64 {
        match op {
            IndexOp::Publish { seq, .. } | IndexOp::Deliver { seq } | IndexOp::Ack { seq, .. } => {
                *seq
            }
            IndexOp::DeleteQueue => u64::MAX,
        }
    }

    #[test]
    fn a_round_splits_in_order_into_batches_that_encode_within_the_limit() {
        const LIMIT: usize = 16 << 10;
        let mut ops = Vec::new();
        for seq in 0..40u64 {
            // Mostly 3 KiB, one of 40 KiB (over the limit: alone), a run of deliveries
            // and acks of the kind a busy consumer adds.
            let body = vec![seq as u8; if seq == 17 { 40 << 10 } else { 3 << 10 }];
            ops.push(IndexOp::Publish {
                seq,
                message: Arc::new(message(&body)),
                expires_at_ms: u64::MAX,
                persistent: true,
            });
            ops.push(IndexOp::Deliver { seq });
            if seq % 3 == 0 {
                ops.push(IndexOp::Ack {
                    seq,
                    message_id: 0xABCD,
                    size: 3 << 10,
                    persistent: true,
                });
            }
        }
        let whole: Vec<u64> = ops.iter().map(seq_of).collect();
        let batches = split_round(ops, LIMIT);
        assert!(batches.len() > 1, "split");
        let mut seen = Vec::new();
        for batch in &batches {
            let encoded = encode(batch).len();
            assert!(
                encoded <= LIMIT || batch.len() == 1,
                "a batch of {} ops encodes to {encoded} bytes",
                batch.len()
            );
            seen.extend(batch.iter().map(seq_of));
        }
        assert_eq!(seen, whole, "every operation once, in order");
        assert!(
            batches
                .iter()
                .any(|b| b.len() == 1 && matches!(b[0], IndexOp::Publish { seq: 17, .. })),
            "the big message goes alone"
        );
        assert!(split_round(Vec::new(), LIMIT).is_empty());
    }
}
