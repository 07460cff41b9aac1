//! What crosses the link: the relay's messages and replies, and their encoding (bincode,
//! batched: one request carries several messages).

use serde::{Deserialize, Serialize};

use crate::broker::Message;
use crate::runtime::storage::decode_message;
use crate::store::message_codec::StoredMessage;

/// A message on the wire: its id and its stored form (raw properties, as published).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct WireMessage {
    pub(super) id: u128,
    // As bytes: serde copies the message at once, not byte by byte.
    #[serde(with = "serde_bytes")]
    pub(super) bytes: Vec<u8>,
}

impl WireMessage {
    pub(super) fn of(m: &Message) -> WireMessage {
        WireMessage {
            id: m.id,
            bytes: StoredMessage {
                exchange: m.exchange.clone(),
                routing_key: m.routing_key.clone(),
                properties_raw: m.properties_raw.clone(),
                body: m.body.clone(),
            }
            .encode(),
        }
    }

    pub(super) fn message(&self) -> Option<Message> {
        decode_message(&self.bytes, self.id)
    }
}

/// One delivery sent back to the consumer's node.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct WireDelivery {
    /// The message as the queue's node holds it until settled (its settle names it).
    pub(super) held: Held,
    pub(super) tag: String,
    pub(super) redelivered: bool,
    pub(super) ack_required: bool,
    pub(super) message: WireMessage,
}

/// A message a queue's node delivered to another node's channel and holds until it is
/// settled there.
///
/// Seqs start again at 0 in a queue declared again after a delete, so the name and the
/// seq alone could name a message of the new queue: a late ack of the old queue's
/// delivery would take a message nobody got (mirror simulation seed 833, bug 36). The
/// instance tells the queues apart: it is drawn per queue handle and per start of the
/// node (`Inner::instance`), and a settle of another instance is ignored.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub(super) struct Held {
    pub(super) vhost: String,
    pub(super) queue: String,
    pub(super) instance: u64,
    pub(super) seq: u64,
}

/// How a settle travels.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub(super) enum WireSettle {
    Ack,
    Requeue,
    Drop,
}

/// A message basic.get took from a queue of another node.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct WireGot {
    pub(super) seq: u64,
    /// The queue's instance ([`Held::instance`]).
    pub(super) instance: u64,
    pub(super) redelivered: bool,
    pub(super) message: WireMessage,
    /// Messages left in the queue.
    pub(super) remaining: u32,
}

/// What crosses the node link for the broker.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) enum RelayMsg {
    /// To the queues' node: enqueue.
    Publish {
        vhost: String,
        queues: Vec<String>,
        message: WireMessage,
    },
    /// To the queue's node: attach a consumer of channel `key` of the sender.
    Consume {
        vhost: String,
        queue: String,
        conn: u64,
        channel: u16,
        tag: String,
        no_ack: bool,
        prefetch: u32,
        global_prefetch: u32,
        priority: i32,
        exclusive: bool,
    },
    /// To the queue's node: detach a consumer.
    Cancel {
        vhost: String,
        queue: String,
        conn: u64,
        channel: u16,
        tag: String,
    },
    /// To the queue's node: ack, nack or requeue deliveries of channel `key` (from the
    /// queue's `instance`).
    Settle {
        vhost: String,
        queue: String,
        instance: u64,
        conn: u64,
        channel: u16,
        seqs: Vec<u64>,
        how: WireSettle,
    },
    /// To the queue's node: basic.get for channel `key` of the sender, numbered by the
    /// sender so that it can take it back ([`RelayMsg::GetAbandoned`]).
    Get {
        vhost: String,
        queue: String,
        conn: u64,
        channel: u16,
        no_ack: bool,
        request: u64,
    },
    /// To the queue's node: the answer to get `request` of channel `key` never reached the
    /// channel (the sender gave the node up while the request was under way): what it took
    /// goes back to the queue. If the get has not arrived yet, it finds the queue empty.
    GetAbandoned {
        conn: u64,
        channel: u16,
        request: u64,
    },
    /// To the queue's node: its ready message and consumer counts.
    Counts { vhost: String, queue: String },
    /// Answered once the receiver's broker has followed the metadata up to Raft `index`.
    Barrier { index: u64 },
    /// To the queue's node: queue.purge.
    Purge { vhost: String, queue: String },
    /// To the queue's node: its figures for the management listings.
    Figures { vhost: String, queue: String },
    /// To the consumer's node: deliveries and broker cancels for channel `key`.
    Deliver {
        conn: u64,
        channel: u16,
        deliveries: Vec<WireDelivery>,
        cancels: Vec<String>,
    },
    /// To any node: its connections (the management API's cluster-wide listings).
    Sessions,
    /// To a connection's node: close it with 320 (`DELETE /api/connections/{name}`).
    CloseConnection { id: u64, reason: String },
    /// To a reply consumer's node: a message published to its reply name (direct
    /// reply-to). Nothing waits for the answer. Last, so earlier variants keep their tags.
    DeliverReply { name: String, message: WireMessage },
    /// To any node: its figures (`GET /api/nodes`). After the rest, keeping their tags.
    Stats,
}

impl RelayMsg {
    /// Roughly the bytes it takes on the wire (message bodies and properties).
    pub(super) fn size(&self) -> usize {
        match self {
            RelayMsg::Publish { message, .. } | RelayMsg::DeliverReply { message, .. } => {
                message.bytes.len()
            }
            RelayMsg::Deliver { deliveries, .. } => {
                deliveries.iter().map(|d| d.message.bytes.len()).sum()
            }
            _ => 64,
        }
    }

    /// The message bytes it holds that no queue counts yet: a publish forwarded to the
    /// queue's node. While it waits in a node's send queue, the memory alarm counts it
    /// (deliveries and replies are bounded by prefetch and by what asked for them).
    pub(super) fn held_bytes(&self) -> i64 {
        match self {
            RelayMsg::Publish { message, .. } => message.bytes.len() as i64,
            _ => 0,
        }
    }
}

/// The answer to a [`RelayMsg`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) enum RelayReply {
    Done,
    /// A publish: whether every queue took it.
    Published(bool),
    /// A delivery batch: the deliveries the consumer's connection was gone for; the home
    /// node requeues them.
    Undelivered(Vec<Held>),
    /// basic.get: the message taken, or none.
    Got(Option<WireGot>),
    /// Ready messages, consumers, unacknowledged messages.
    Counts(u32, u32, u32),
    /// Messages purged.
    Purged(u32),
    /// A queue's figures.
    Figures(crate::broker::QueueFigures),
    /// The queue is not (or no longer) on this node.
    Missing(String),
    /// This node's connections.
    Sessions(Vec<crate::broker::registry::ConnectionView>),
    /// Whether the connection was there to close.
    Closed(bool),
    /// This node's figures.
    Stats(Box<crate::broker::node_stats::NodeStats>),
}

pub(super) fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    // Plain owned data into a Vec: cannot fail.
    bincode::serialize(v).unwrap_or_default()
}

/// One message as a request of its own: a batch of one, as [`Service::handle`] reads it
/// (an array would go without its length, as a tuple, and not decode).
pub(super) fn encode_one(msg: &RelayMsg) -> Vec<u8> {
    encode(&[msg].as_slice())
}
