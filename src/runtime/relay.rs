//! The relay: queues of other nodes, reached over the node links ([`Service::Broker`]).
//!
//! A session on node C that publishes to, consumes from or acks a queue whose home is node H
//! calls this node's [`Relay`] through the broker's [`RemoteLink`]; the relay queues a
//! [`RelayMsg`] for H on a per-node sender task, so messages reach H in the order the
//! session made them. H's relay handles each request on the link's reader, in arrival order:
//!
//! - `Publish`: enqueued in the named queues at once; the reply (taken or not) waits for the
//!   group commit when the message is persistent in a durable queue, so C's publisher is
//!   confirmed only once H has the message on disk.
//! - `Consume`: H keeps one *proxy channel* per remote channel: a [`ChannelLink`] whose
//!   outbox is drained by a forwarder task that sends deliveries (and broker cancels) back
//!   to C in batches, and returns the outbox credit once C has taken them, so the queue's
//!   ordinary flow control (prefetch, outbox bytes) paces a remote consumer as a local one.
//! - `Settle` / `Cancel`: acks, nacks, requeues and cancels of a proxy channel; a cancel
//!   that leaves an auto-delete queue without consumers deletes it (through Raft).
//! - `Get`, `Counts`, `Purge`: basic.get (a message taken with acks is held by the proxy
//!   channel), declare-ok's counts, queue.purge. A get C gave up while it was under way
//!   is taken back with `GetAbandoned`.
//! - `DeliverReply`: a message published (on C) to a reply name of a channel of H (direct
//!   reply-to) goes to that channel's reply consumer, or nowhere; nothing is answered but
//!   `Done`, as RabbitMQ's cast to the channel. A declare of such a name on C asks H with
//!   `Counts`, which H answers for its reply consumers.
//!
//! On C, deliveries land in the consumer connection's outbox as [`QueueRef::Remote`]
//! deliveries, so its acks travel back. When H goes down, C cancels its consumers on H's
//! queues (consumer cancel notify, as RabbitMQ does); when C goes down, H requeues what C's
//! channels held and drops their consumers. Forwarded publishes whose link fails are nacked.
//! Either may give the other up alone (a one-way cut): settles C could not send are sent
//! again until taken, and once C hears H again it cancels there the consumers it cancelled.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, watch, Notify};

use super::clock::Clock;
use super::conn_task::MetaCommit;
use super::node_link::transport::{BrokerReply, BrokerService};
use super::node_link::TcpTransport;
use super::storage::decode_message;
use crate::broker::direct_reply::{is_reply_name, ReplyAddress};
use crate::broker::remote::{
    CallFuture, NodeCall, NodeCallFuture, NodeReply, QueueCall, QueueReply, RemoteGot,
};
use crate::broker::{
    Broker, ChannelKey, ChannelLink, Consumer, Delivery, Message, OutItem, Outbox, QueueRef,
    RemoteConsumer, RemoteLink, RemoteQueue, Settle,
};
use crate::meta::{Command, NodeId};
use crate::store::message_codec::StoredMessage;

/// Bytes a proxy channel's outbox holds before its queues wait (as a connection's).
const PROXY_OUTBOX_BYTES: usize = 4 << 20;
/// Deliveries sent to the consumer's node in one message, at most.
const BATCH: usize = 256;
/// Messages for one node sent as one request, at most...
const SEND_BATCH: usize = 128;
/// ...and message bytes (a single bigger message still goes alone).
const SEND_BATCH_BYTES: usize = 1 << 20;

/// How long a consumer following a promoted queue waits for it to start serving here.
const ADOPTION_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A message on the wire: its id and its stored form (raw properties, as published).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct WireMessage {
    id: u128,
    // As bytes: serde copies the message at once, not byte by byte.
    #[serde(with = "serde_bytes")]
    bytes: Vec<u8>,
}

impl WireMessage {
    fn of(m: &Message) -> WireMessage {
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

    fn message(&self) -> Option<Message> {
        decode_message(&self.bytes, self.id)
    }
}

/// One delivery sent back to the consumer's node.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct WireDelivery {
    vhost: String,
    queue: String,
    tag: String,
    seq: u64,
    redelivered: bool,
    ack_required: bool,
    message: WireMessage,
}

/// How a settle travels.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
enum WireSettle {
    Ack,
    Requeue,
    Drop,
}

/// What crosses the node link for the broker.
#[derive(Clone, Debug, Serialize, Deserialize)]
enum RelayMsg {
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
    /// To the queue's node: ack, nack or requeue deliveries of channel `key`.
    Settle {
        vhost: String,
        queue: String,
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
}

impl RelayMsg {
    /// Roughly the bytes it takes on the wire (message bodies and properties).
    fn size(&self) -> usize {
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
}

/// The answer to a [`RelayMsg`].
#[derive(Clone, Debug, Serialize, Deserialize)]
enum RelayReply {
    Done,
    /// A publish: whether every queue took it.
    Published(bool),
    /// A delivery batch: the (queue, seq) of deliveries the consumer's connection was gone
    /// for; the home node requeues them.
    Undelivered(Vec<(String, String, u64)>),
    /// basic.get: (seq, redelivered, message, messages left), or empty.
    Got(Option<(u64, bool, WireMessage, u32)>),
    /// Ready messages, consumers, unacknowledged messages.
    Counts(u32, u32, u32),
    /// Messages purged.
    Purged(u32),
    /// The queue is not (or no longer) on this node.
    Missing(String),
    /// This node's connections.
    Sessions(Vec<crate::broker::registry::ConnectionView>),
    /// Whether the connection was there to close.
    Closed(bool),
}

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    // Plain owned data into a Vec: cannot fail.
    bincode::serialize(v).unwrap_or_default()
}

/// One message as a request of its own: a batch of one, as [`Service::handle`] reads it
/// (an array would go without its length, as a tuple, and not decode).
fn encode_one(msg: &RelayMsg) -> Vec<u8> {
    encode(&[msg].as_slice())
}

/// A message queued for another node, with what to do with its reply.
struct Outgoing {
    msg: RelayMsg,
    /// The publish outcome this answers (0: none).
    outcome: u64,
    /// Outbox credit to return (and queues to poke) once a delivery batch is answered.
    after: Option<Arc<ProxyChannel>>,
    released: usize,
    /// A parked channel waiting for the answer.
    reply_to: Option<oneshot::Sender<QueueReply>>,
    /// A node call waiting for the answer.
    node_reply_to: Option<oneshot::Sender<NodeReply>>,
    /// The queue a call is about.
    source: Option<Arc<RemoteQueue>>,
}

/// On the queue's node: the stand-in for one channel of a consumer on another node.
struct ProxyChannel {
    node: NodeId,
    key: ChannelKey,
    link: Arc<ChannelLink>,
    outbox: Arc<Outbox>,
    /// Consumers attached through it: (vhost, queue, tag).
    consumers: Mutex<Vec<(String, String, Arc<str>)>>,
    /// Deliveries sent and not settled: (vhost, queue, seq).
    unacked: Mutex<BTreeSet<(String, String, u64)>>,
    /// The latest gets with acks it answered: (request, vhost, queue, seq), for an
    /// abandonment to name.
    gets: Mutex<VecDeque<(u64, String, String, u64)>>,
}

/// Gets a proxy channel remembers for [`RelayMsg::GetAbandoned`] (a channel has one get
/// under way at a time; a few cover channel numbers reused after an error).
const PROXY_GETS: usize = 8;
/// Abandonments of gets not arrived yet that a node remembers.
const ABANDONED_GETS: usize = 1024;
/// How long a settle or the abandonment of a get is tried again: what it releases would
/// otherwise stay unacknowledged on the queue's node for good.
const RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(120);

/// On the consumer's node: where deliveries for a channel go.
struct ConsumerSink {
    outbox: Weak<Outbox>,
    /// Consumers of this channel on queues of other nodes.
    tags: Vec<SinkTag>,
}

/// A consumer on a queue of another node.
struct SinkTag {
    node: NodeId,
    tag: Arc<str>,
    /// (vhost, queue).
    queue: Arc<(String, String)>,
    cancel_on_ha_failover: bool,
}

/// A consumer whose mirrored queue's master node went down: it waits for the new master.
struct Orphan {
    key: ChannelKey,
    outbox: Weak<Outbox>,
    tag: Arc<str>,
    queue: Arc<(String, String)>,
    /// The master's node that went down.
    node: NodeId,
    since: std::time::Instant,
}

/// A node's sender, and the signal that the node was declared down.
type NodeSender = (mpsc::UnboundedSender<Outgoing>, watch::Sender<bool>);

struct Inner {
    broker: Arc<Broker>,
    transport: TcpTransport,
    meta: Arc<dyn MetaCommit>,
    clock: Clock,
    me: NodeId,
    /// The Raft index this node's broker has followed.
    applied: watch::Receiver<u64>,
    link: Weak<Relay>,
    /// Per node: its sender, and the signal that the node was declared down (what waits for
    /// its answers fails then: a frozen node keeps its sockets open and never answers).
    senders: Mutex<HashMap<NodeId, NodeSender>>,
    proxies: Mutex<HashMap<(NodeId, ChannelKey), Arc<ProxyChannel>>>,
    sinks: Mutex<HashMap<ChannelKey, ConsumerSink>>,
    /// Consumers waiting for their mirrored queue's new master.
    orphans: Mutex<Vec<Orphan>>,
    /// Whether this node's queues serve other nodes yet: not before storage has put their
    /// messages back (a forwarded publish would take a seq the queue's index already used).
    serving: std::sync::atomic::AtomicBool,
    /// Per channel, consumers this node took away from a queue's node (declared down, or it
    /// handed the queue over): (tag, that node). Deliveries it sent before are stale.
    retired: Mutex<HashMap<ChannelKey, Retired>>,
    /// The number of this node's next get ([`RelayMsg::Get`]'s `request`).
    next_get: std::sync::atomic::AtomicU64,
    /// Gets other nodes abandoned before they arrived here: (node, request).
    abandoned_gets: Mutex<VecDeque<(NodeId, u64)>>,
    /// Consumers this node cancelled on a node it gave up, to cancel there once it is heard
    /// again (it may never have given this node up, and would keep them).
    cancel_when_up: Mutex<Vec<GivenUp>>,
}

/// A consumer of channel `key` on `queue` of `node`, cancelled here when `node` was given up.
struct GivenUp {
    node: NodeId,
    key: ChannelKey,
    vhost: String,
    queue: String,
    tag: Arc<str>,
}

/// A channel's retired consumers (see `Inner::retired`); pruned once the channel is gone.
struct Retired {
    outbox: Weak<Outbox>,
    tags: Vec<(Arc<str>, NodeId)>,
}

/// This node's relay (both roles: sessions here using queues elsewhere, and queues here
/// used from elsewhere).
pub struct Relay {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("node", &self.inner.me)
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// A relay for `broker` over `transport`; it serves the link's broker requests and is
    /// the broker's [`RemoteLink`].
    pub fn install(
        broker: Arc<Broker>,
        transport: TcpTransport,
        meta: Arc<dyn MetaCommit>,
        clock: Clock,
        applied: watch::Receiver<u64>,
    ) -> Arc<Relay> {
        let me = broker.node_id();
        let relay = Arc::new_cyclic(|weak| Relay {
            inner: Arc::new(Inner {
                broker: broker.clone(),
                transport: transport.clone(),
                meta,
                clock,
                me,
                applied,
                link: weak.clone(),
                senders: Mutex::new(HashMap::new()),
                proxies: Mutex::new(HashMap::new()),
                sinks: Mutex::new(HashMap::new()),
                orphans: Mutex::new(Vec::new()),
                retired: Mutex::new(HashMap::new()),
                serving: std::sync::atomic::AtomicBool::new(false),
                // Not from 1: a restarted node must not reuse the numbers of its last life.
                next_get: std::sync::atomic::AtomicU64::new(rand::random::<u64>() >> 1),
                abandoned_gets: Mutex::new(VecDeque::new()),
                cancel_when_up: Mutex::new(Vec::new()),
            }),
        });
        transport.serve_broker(Arc::new(Service {
            inner: relay.inner.clone(),
        }));
        broker.set_remote_link(relay.clone());
        relay
    }

    /// This node's queues are ready (storage has recovered them): requests from other
    /// nodes for them are served from now on; before, they are refused.
    pub fn serve(&self) {
        self.inner
            .serving
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Waits until `node`'s broker has followed the metadata up to Raft index `index` (so a
    /// queue declared there by that entry exists there); false if it did not answer in time.
    pub async fn barrier(&self, node: NodeId, index: u64) -> bool {
        let (tx, rx) = oneshot::channel();
        self.inner.enqueue(
            node,
            Outgoing {
                msg: RelayMsg::Barrier { index },
                outcome: 0,
                after: None,
                released: 0,
                reply_to: Some(tx),
                node_reply_to: None,
                source: None,
            },
        );
        matches!(rx.await, Ok(QueueReply::Counts { .. }))
    }

    /// Consumers that waited for their mirrored queue's new master attach to it once it
    /// serves (the channel re-consumes: [`OutItem::Rehome`]); those of a queue that went, or
    /// that waited longer than a minute, are cancelled. Called on every metadata change and
    /// failure-detector tick.
    pub fn rehome(&self) {
        let mut orphans = lock(&self.inner.orphans);
        if orphans.is_empty() {
            return;
        }
        let broker = &self.inner.broker;
        let state = broker.snapshot();
        orphans.retain(|o| {
            let Some(outbox) = o.outbox.upgrade() else {
                return false;
            };
            let (vhost, queue) = &*o.queue;
            let home = state
                .vhost(vhost)
                .and_then(|v| v.queues.get(queue))
                .map(|d| d.home);
            let expired = o.since.elapsed() > std::time::Duration::from_secs(60);
            let cancel = || OutItem::Cancel {
                channel: o.key.channel,
                consumer_tag: o.tag.clone(),
            };
            let item = match home {
                // The queue went.
                None => Some(cancel()),
                // Not failed over yet.
                Some(h) if h == o.node => expired.then(cancel),
                // Serving here or on a running node.
                Some(_)
                    if broker.queue(vhost, queue).is_some()
                        || broker.remote_queue(vhost, queue).is_some() =>
                {
                    Some(OutItem::Rehome {
                        channel: o.key.channel,
                        consumer_tag: o.tag.clone(),
                    })
                }
                Some(_) => expired.then(cancel),
            };
            let Some(item) = item else {
                return true;
            };
            let _ = outbox.push(item);
            false
        });
    }

    /// `node` went down: consumers here on its queues are cancelled (those of a mirrored
    /// queue wait for its new master instead), and what its channels held here is
    /// requeued.
    pub fn node_down(&self, node: NodeId) {
        self.inner.drop_proxies_of(node);
        let state = self.inner.broker.snapshot();
        let mut sinks = lock(&self.inner.sinks);
        for (key, sink) in sinks.iter_mut() {
            let (gone, kept): (Vec<_>, Vec<_>) = sink.tags.drain(..).partition(|t| t.node == node);
            sink.tags = kept;
            for t in &gone {
                self.inner.retire(*key, &sink.outbox, &t.tag, node);
                let (vhost, queue) = &*t.queue;
                let mut given_up = lock(&self.inner.cancel_when_up);
                // Those of channels gone since need nothing more.
                given_up.retain(|g| self.inner.is_retired(&g.key, &g.tag, g.node));
                given_up.push(GivenUp {
                    node,
                    key: *key,
                    vhost: vhost.clone(),
                    queue: queue.clone(),
                    tag: t.tag.clone(),
                });
            }
            if let Some(outbox) = sink.outbox.upgrade() {
                for t in gone {
                    // A mirrored queue with a mirror that can take over: the consumer
                    // waits for the new master (unless it asked to be cancelled).
                    let mirrored = state
                        .mirror_sets
                        .get(&*t.queue)
                        .is_some_and(|s| s.mirrors.iter().any(|m| m.synchronised));
                    if mirrored && !t.cancel_on_ha_failover {
                        lock(&self.inner.orphans).push(Orphan {
                            key: *key,
                            outbox: sink.outbox.clone(),
                            tag: t.tag,
                            queue: t.queue,
                            node,
                            since: std::time::Instant::now(),
                        });
                        continue;
                    }
                    let _ = outbox.push(OutItem::Cancel {
                        channel: key.channel,
                        consumer_tag: t.tag,
                    });
                }
            }
        }
        sinks.retain(|_, s| !s.tags.is_empty() && s.outbox.strong_count() > 0);
        if let Some((_, down)) = lock(&self.inner.senders).remove(&node) {
            let _ = down.send(true);
        }
    }
}

impl Relay {
    /// `node` is heard again after it was given up: the consumers cancelled on it then are
    /// cancelled there too, in order before anything else sent to it (a consumer that
    /// followed its queue back there since is not: it is no longer retired).
    pub fn node_up(&self, node: NodeId) {
        let gone: Vec<_> = {
            let mut all = lock(&self.inner.cancel_when_up);
            let (here, rest) = std::mem::take(&mut *all)
                .into_iter()
                .partition(|c| c.node == node);
            *all = rest;
            here
        };
        for GivenUp {
            node,
            key,
            vhost,
            queue,
            tag,
        } in gone
        {
            if !self.inner.is_retired(&key, &tag, node) {
                continue;
            }
            let msg = RelayMsg::Cancel {
                vhost,
                queue,
                conn: key.conn,
                channel: key.channel,
                tag: tag.to_string(),
            };
            self.inner.send(node, msg, 0);
        }
    }
}

impl Inner {
    /// Records that consumer `tag` of channel `key` no longer takes deliveries from `node`:
    /// a frame that node sent before (held in a socket buffer through a partition, say)
    /// can arrive after the consumer followed the queue to its new master, and its
    /// delivery would come behind the new master's, out of order.
    fn retire(&self, key: ChannelKey, outbox: &Weak<Outbox>, tag: &Arc<str>, node: NodeId) {
        let mut retired = lock(&self.retired);
        retired.retain(|_, r| r.outbox.strong_count() > 0);
        let r = retired.entry(key).or_insert_with(|| Retired {
            outbox: outbox.clone(),
            tags: Vec::new(),
        });
        r.outbox = outbox.clone();
        if !r.tags.iter().any(|(t, n)| t == tag && *n == node) {
            r.tags.push((tag.clone(), node));
        }
    }

    /// Whether `node`'s deliveries to consumer `tag` of channel `key` are stale.
    fn is_retired(&self, key: &ChannelKey, tag: &str, node: NodeId) -> bool {
        lock(&self.retired)
            .get(key)
            .is_some_and(|r| r.tags.iter().any(|(t, n)| &**t == tag && *n == node))
    }

    /// Queues `msg` for `node`, in order with everything else sent there.
    fn send(&self, node: NodeId, msg: RelayMsg, outcome: u64) {
        self.send_raw(node, msg, outcome, None, 0);
    }

    fn send_raw(
        &self,
        node: NodeId,
        msg: RelayMsg,
        outcome: u64,
        after: Option<Arc<ProxyChannel>>,
        released: usize,
    ) {
        let out = Outgoing {
            msg,
            outcome,
            after,
            released,
            reply_to: None,
            node_reply_to: None,
            source: None,
        };
        self.enqueue(node, out);
    }

    fn enqueue(&self, node: NodeId, out: Outgoing) {
        if self.broker.node_is_down(node) {
            // Nothing sent to a node the failure detector gave up on would be answered
            // before it comes back (a frozen node holds its sockets open).
            self.failed(node, out);
            return;
        }
        let mut senders = lock(&self.senders);
        let (tx, _) = senders
            .entry(node)
            .or_insert_with(|| self.spawn_sender(node));
        if let Err(mpsc::error::SendError(out)) = tx.send(out) {
            // The sender task ended (shutdown): fail what needed an answer.
            self.failed(node, out);
        }
    }

    /// The sender task for `node`: takes what is queued (up to [`SEND_BATCH`] messages or
    /// 1 MiB at a time) as one request, in order; a second task handles the replies in the
    /// same order.
    fn spawn_sender(&self, node: NodeId) -> NodeSender {
        let (tx, mut rx) = mpsc::unbounded_channel::<Outgoing>();
        let (down_tx, mut down) = watch::channel(false);
        let Some(relay) = self.link.upgrade() else {
            return (tx, down_tx);
        };
        let inner = relay.inner.clone();
        type Pending = (
            Vec<Outgoing>,
            tokio::sync::oneshot::Receiver<
                Result<Vec<u8>, crate::runtime::node_link::wire::RemoteFailure>,
            >,
        );
        let (reply_tx, mut reply_rx) = mpsc::unbounded_channel::<Pending>();
        let answers = inner.clone();
        let mut sender_down = down.clone();
        tokio::spawn(async move {
            while let Some((outs, reply)) = reply_rx.recv().await {
                let answer = tokio::select! {
                    r = reply => Some(r),
                    _ = down.wait_for(|d| *d) => None,
                };
                let replies: Option<Vec<RelayReply>> = match answer {
                    Some(Ok(Ok(bytes))) => bincode::deserialize(&bytes).ok(),
                    _ => None,
                };
                match replies {
                    Some(replies) => {
                        for (i, out) in outs.into_iter().enumerate() {
                            answers.answered(out, replies.get(i));
                        }
                    }
                    None => outs.into_iter().for_each(|o| answers.failed(node, o)),
                }
            }
        });
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut bytes = first.msg.size();
                let mut batch = vec![first];
                while batch.len() < SEND_BATCH && bytes < SEND_BATCH_BYTES {
                    match rx.try_recv() {
                        Ok(o) => {
                            bytes += o.msg.size();
                            batch.push(o);
                        }
                        Err(_) => break,
                    }
                }
                let msgs: Vec<&RelayMsg> = batch.iter().map(|o| &o.msg).collect();
                let payload = encode(&msgs);
                // Under a partition the link stops draining and this send waits for room
                // without end; once the node is recorded down nothing queued here can be
                // answered before it returns, so all of it fails now (publishes are nacked)
                // and the channels behind it go on.
                let sent = tokio::select! {
                    sent = inner.transport.send_broker(node, payload) => Some(sent),
                    _ = sender_down.wait_for(|d| *d) => None,
                };
                let Some(sent) = sent else {
                    tracing::info!(node, "relay: node down; failing what was queued for it");
                    batch.into_iter().for_each(|o| inner.failed(node, o));
                    rx.close();
                    while let Some(o) = rx.recv().await {
                        inner.failed(node, o);
                    }
                    return;
                };
                match sent {
                    Ok(reply) => {
                        if let Err(mpsc::error::SendError((outs, _))) =
                            reply_tx.send((batch, reply))
                        {
                            outs.into_iter().for_each(|o| inner.failed(node, o));
                        }
                    }
                    Err(e) => {
                        tracing::debug!(node, error = %e, "relay: cannot reach node");
                        batch.into_iter().for_each(|o| inner.failed(node, o));
                    }
                }
            }
        });
        (tx, down_tx)
    }

    fn answered(&self, out: Outgoing, reply: Option<&RelayReply>) {
        if let Some(tx) = out.node_reply_to {
            let _ = tx.send(match reply {
                Some(RelayReply::Sessions(v)) => NodeReply::Sessions(v.clone()),
                Some(RelayReply::Closed(found)) => NodeReply::Closed(*found),
                _ => NodeReply::Unavailable("unexpected answer from the node".into()),
            });
            return;
        }
        if let Some(tx) = out.reply_to {
            let answer = match reply {
                Some(RelayReply::Got(got)) => {
                    QueueReply::Got(got.as_ref().and_then(|(seq, redelivered, m, remaining)| {
                        Some(RemoteGot {
                            seq: *seq,
                            redelivered: *redelivered,
                            message: Arc::new(m.message()?),
                            remaining: *remaining,
                            source: out.source.clone(),
                        })
                    }))
                }
                Some(RelayReply::Counts(messages, consumers, unacked)) => QueueReply::Counts {
                    messages: *messages,
                    consumers: *consumers,
                    unacked: *unacked,
                },
                Some(RelayReply::Purged(n)) => QueueReply::Purged(*n),
                Some(RelayReply::Missing(text)) => QueueReply::Unavailable(text.clone()),
                _ => QueueReply::Unavailable("unexpected answer from the queue's node".into()),
            };
            if let Err(QueueReply::Got(Some(got))) = tx.send(answer) {
                // The asking connection is gone: the message goes back to its queue.
                if let (Some(q), RelayMsg::Get { conn, channel, .. }) = (&got.source, &out.msg) {
                    let settle = RelayMsg::Settle {
                        vhost: q.vhost.clone(),
                        queue: q.name.clone(),
                        conn: *conn,
                        channel: *channel,
                        seqs: vec![got.seq],
                        how: WireSettle::Requeue,
                    };
                    self.send(q.node, settle, 0);
                }
            }
            return;
        }
        if out.outcome != 0 {
            let taken = matches!(reply, Some(RelayReply::Published(true)));
            self.broker.remote_outcomes().resolve(out.outcome, taken);
        }
        if let Some(proxy) = out.after {
            if let Some(RelayReply::Undelivered(list)) = reply {
                // The consumer's connection went away before they reached it.
                for (vhost, queue, seq) in list {
                    lock(&proxy.unacked).remove(&(vhost.clone(), queue.clone(), *seq));
                    self.settle_local(vhost, queue, &[*seq], Settle::Nack { requeue: true });
                }
            }
            self.release(&proxy, out.released);
        }
    }

    /// `out` could not be sent to `node`, or its answer did not come (the node was given
    /// up): whoever waits hears so. What would leave a message unacknowledged there for
    /// good is sent again, outside the ordered sender, until the node has it: a settle (the
    /// node may not have given this one up, and keeps the delivery), and the abandonment of
    /// a get with acks (the get may have reached the node anyway).
    fn failed(&self, node: NodeId, out: Outgoing) {
        match &out.msg {
            RelayMsg::Settle { .. } => self.send_until_taken(node, out.msg.clone()),
            RelayMsg::Get {
                conn,
                channel,
                no_ack: false,
                request,
                ..
            } => self.send_until_taken(
                node,
                RelayMsg::GetAbandoned {
                    conn: *conn,
                    channel: *channel,
                    request: *request,
                },
            ),
            _ => {}
        }
        if let Some(tx) = out.reply_to {
            let _ = tx.send(QueueReply::Unavailable(
                "the queue's node could not be reached".into(),
            ));
            return;
        }
        if out.outcome != 0 {
            self.broker.remote_outcomes().resolve(out.outcome, false);
        }
        if let Some(proxy) = out.after {
            if matches!(out.msg, RelayMsg::Deliver { .. }) {
                self.abandon_proxy(&proxy);
            }
            self.release(&proxy, out.released);
        }
    }

    /// Get `request` of `node`'s channel `key` never reached the channel: what it took goes
    /// back to its queue. One not arrived yet is remembered, so that it takes nothing.
    fn abandon_get(&self, node: NodeId, key: ChannelKey, request: u64) {
        let proxy = lock(&self.proxies).get(&(node, key)).cloned();
        let found = proxy.and_then(|p| {
            let mut gets = lock(&p.gets);
            let i = gets.iter().position(|g| g.0 == request)?;
            let (_, vhost, queue, seq) = gets.remove(i)?;
            let held = lock(&p.unacked).remove(&(vhost.clone(), queue.clone(), seq));
            Some((vhost, queue, seq, held))
        });
        match found {
            Some((vhost, queue, seq, true)) => {
                tracing::debug!(node, queue = %queue, seq, "abandoned get: its message requeued");
                self.settle_local(&vhost, &queue, &[seq], Settle::Nack { requeue: true });
            }
            // Settled already, or requeued with its proxy channel.
            Some(_) => {}
            None => {
                let mut abandoned = lock(&self.abandoned_gets);
                if abandoned.len() == ABANDONED_GETS {
                    abandoned.pop_front();
                }
                abandoned.push_back((node, request));
            }
        }
    }

    /// Sends `msg` to `node` outside its ordered sender, again and again for [`RETRY_FOR`]
    /// until the node has handled it.
    fn send_until_taken(&self, node: NodeId, msg: RelayMsg) {
        let payload = encode_one(&msg);
        let transport = self.transport.clone();
        tokio::spawn(async move {
            let until = tokio::time::Instant::now() + RETRY_FOR;
            loop {
                let attempt = async {
                    let reply = transport.send_broker(node, payload.clone()).await.ok()?;
                    reply.await.ok()?.ok()
                };
                let timeout = std::time::Duration::from_secs(5);
                if let Ok(Some(_)) = tokio::time::timeout(timeout, attempt).await {
                    return;
                }
                if tokio::time::Instant::now() >= until {
                    tracing::warn!(node, "relay: a settle could not be sent to the node");
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
        });
    }

    /// Deliveries to the consumer's node could not be sent (it is recorded down, or its link
    /// failed): the proxy is closed as `node_down` closes a node's proxies — its consumers
    /// detached, what it held requeued — and the node is told, best effort, that its
    /// consumers were cancelled, so they follow the queue again once it hears.
    ///
    /// Closing, not just requeueing the batch: the proxy can outlive the node's
    /// `node_down` (a frozen node that resumed attaches a consumer before this node hears
    /// it again), and its deliveries would then stay unacked here for good; requeued to a
    /// proxy still attached, they would come straight back to it, in a loop.
    fn abandon_proxy(&self, proxy: &Arc<ProxyChannel>) {
        {
            let mut proxies = lock(&self.proxies);
            if proxies
                .get(&(proxy.node, proxy.key))
                .is_some_and(|p| Arc::ptr_eq(p, proxy))
            {
                proxies.remove(&(proxy.node, proxy.key));
            }
        }
        let tags: Vec<String> = lock(&proxy.consumers)
            .iter()
            .map(|(_, _, t)| t.to_string())
            .collect();
        let held = lock(&proxy.unacked).len();
        self.close_proxy(proxy);
        tracing::debug!(
            node = proxy.node,
            consumers = tags.len(),
            held,
            "deliveries not sent: proxy closed, its messages requeued"
        );
        if !tags.is_empty() {
            self.cancel_best_effort(proxy.node, proxy.key, tags);
        }
    }

    /// Tells `node` that consumers `tags` of its channel `key` were cancelled here, without
    /// waiting for it and whether or not it is recorded down (a frozen node gets it when it
    /// resumes; a dead one never does, and its channels are gone anyway).
    fn cancel_best_effort(&self, node: NodeId, key: ChannelKey, tags: Vec<String>) {
        let msg = RelayMsg::Deliver {
            conn: key.conn,
            channel: key.channel,
            deliveries: Vec::new(),
            cancels: tags,
        };
        let payload = encode_one(&msg);
        let transport = self.transport.clone();
        tokio::spawn(async move {
            let send = transport.send_broker(node, payload);
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), send).await;
        });
    }

    /// Returns outbox credit of a proxy channel and pokes the queues that waited for it.
    fn release(&self, proxy: &ProxyChannel, bytes: usize) {
        let now = self.clock.now();
        for q in proxy.outbox.release(bytes) {
            let mut dead = Vec::new();
            q.lock().deliver(&q, now, &mut dead);
            if !dead.is_empty() {
                self.broker.dead_letter(&q, dead, now);
            }
        }
    }

    fn settle_local(&self, vhost: &str, queue: &str, seqs: &[u64], how: Settle) {
        let Some(h) = self.broker.queue(vhost, queue) else {
            return;
        };
        let now = self.clock.now();
        let dead = QueueRef::Local(h.clone()).settle(
            ChannelKey {
                conn: 0,
                channel: 0,
            },
            seqs,
            how,
            now,
        );
        if !dead.is_empty() {
            self.broker.dead_letter(&h, dead, now);
        }
    }

    /// The proxy channel for `key` of `node`, created with its forwarder on first use.
    fn proxy(&self, node: NodeId, key: ChannelKey, global_prefetch: u32) -> Arc<ProxyChannel> {
        let mut proxies = lock(&self.proxies);
        if let Some(p) = proxies.get(&(node, key)) {
            return p.clone();
        }
        let notify = Arc::new(Notify::new());
        let waker = notify.clone();
        let outbox = Arc::new(Outbox::new(
            PROXY_OUTBOX_BYTES,
            Box::new(move || waker.notify_one()),
        ));
        let link = Arc::new(ChannelLink::new(key.conn, key.channel, outbox.clone()));
        link.global_prefetch
            .store(global_prefetch, Ordering::Release);
        let proxy = Arc::new(ProxyChannel {
            node,
            key,
            link,
            outbox,
            consumers: Mutex::new(Vec::new()),
            unacked: Mutex::new(BTreeSet::new()),
            gets: Mutex::new(VecDeque::new()),
        });
        proxies.insert((node, key), proxy.clone());
        if let Some(relay) = self.link.upgrade() {
            tokio::spawn(forward(relay.inner.clone(), proxy.clone(), notify));
        }
        proxy
    }

    fn drop_proxies_of(&self, node: NodeId) {
        let gone: Vec<Arc<ProxyChannel>> = {
            let mut proxies = lock(&self.proxies);
            let keys: Vec<_> = proxies
                .keys()
                .filter(|(n, _)| *n == node)
                .copied()
                .collect();
            keys.into_iter()
                .filter_map(|k| proxies.remove(&k))
                .collect()
        };
        for p in gone {
            self.close_proxy(&p);
        }
    }

    /// Detaches a proxy channel's consumers and requeues what it held.
    fn close_proxy(&self, p: &Arc<ProxyChannel>) {
        let now = self.clock.now();
        let consumers = std::mem::take(&mut *lock(&p.consumers));
        for (vhost, queue, tag) in consumers {
            self.detach(p, &vhost, &queue, &tag, now);
        }
        // Deliveries still in the outbox were never sent.
        for item in p.outbox.close() {
            if let OutItem::Deliver(d) = item {
                if d.ack_required {
                    let (vhost, queue) = d.queue.name();
                    let (vhost, queue) = (vhost.to_string(), queue.to_string());
                    lock(&p.unacked).remove(&(vhost.clone(), queue.clone(), d.seq));
                    self.settle_local(&vhost, &queue, &[d.seq], Settle::Nack { requeue: true });
                }
            }
        }
        let unacked = std::mem::take(&mut *lock(&p.unacked));
        for (vhost, queue, seq) in unacked {
            self.settle_local(&vhost, &queue, &[seq], Settle::Nack { requeue: true });
        }
    }

    fn detach(
        &self,
        p: &ProxyChannel,
        vhost: &str,
        queue: &str,
        tag: &str,
        now: crate::time::Instant,
    ) {
        let Some(h) = self.broker.queue(vhost, queue) else {
            return;
        };
        let link = &p.link;
        let auto_delete = h
            .lock()
            .remove_consumers(now, |c| &*c.tag == tag && Arc::ptr_eq(&c.link, link));
        if auto_delete {
            let meta = self.meta.clone();
            let command = Command::DeleteQueue {
                vhost: vhost.to_string(),
                name: queue.to_string(),
            };
            tokio::spawn(async move {
                if let Err(e) = meta.commit(command, now).await {
                    tracing::debug!(error = %e, "auto-delete of a queue not committed");
                }
            });
        }
    }

    /// Whether `vhost/queue` may be about to serve here: a durable queue not running here
    /// whose home this node is (a promoted mirror adopting its copy), or whose mirror this
    /// node is (the promotion may not have reached this node's metadata yet, while the
    /// consumer's node already follows it).
    fn awaiting_adoption(&self, vhost: &str, queue: &str) -> bool {
        let me = self.broker.node_id();
        let state = self.broker.snapshot();
        let key = (vhost.to_string(), queue.to_string());
        state
            .vhost(vhost)
            .and_then(|v| v.queues.get(queue))
            .is_some_and(|d| {
                d.durable
                    && (d.home == me
                        || state
                            .mirror_sets
                            .get(&key)
                            .is_some_and(|s| s.mirrors.iter().any(|m| m.node == me)))
            })
            && self.broker.durability().is_some()
            && self.broker.queue(vhost, queue).is_none()
    }

    /// Handles one message from `from`, on the link's reader: its reply, and the
    /// group-commit ticket that must be durable before the reply may say "taken" (0: none).
    fn handle_one(&self, from: NodeId, msg: RelayMsg) -> (RelayReply, u64) {
        let now = self.clock.now();
        if !self.serving.load(std::sync::atomic::Ordering::Acquire) {
            if let Some(refused) = self.refuse_while_starting(from, &msg) {
                return (refused, 0);
            }
        }
        match msg {
            RelayMsg::Publish {
                vhost,
                queues,
                message,
            } => {
                let Some(message) = message.message() else {
                    return (RelayReply::Published(false), 0);
                };
                let (taken, ticket) =
                    self.broker
                        .publish_forwarded(&vhost, &queues, Arc::new(message), now);
                (RelayReply::Published(taken), ticket)
            }
            RelayMsg::Consume {
                ref vhost,
                ref queue,
                ..
            } if self.broker.queue(vhost, queue).is_none()
                && self.awaiting_adoption(vhost, queue) =>
            {
                // A mirrored queue promoted here, not serving yet (its flush lap): a consumer
                // following it from another node waits for it (`ADOPTION_WAIT` at most)
                // rather than being refused.
                if let Some(relay) = self.link.upgrade() {
                    let inner = relay.inner.clone();
                    let (vhost, queue) = (vhost.clone(), queue.clone());
                    tokio::spawn(async move {
                        // Woken by the broker when its queues or metadata change, not polled.
                        let deadline = tokio::time::Instant::now() + ADOPTION_WAIT;
                        loop {
                            let changed = Arc::new(tokio::sync::Notify::new());
                            let wake = changed.clone();
                            inner
                                .broker
                                .on_next_change(Box::new(move || wake.notify_one()));
                            if inner.broker.queue(&vhost, &queue).is_some()
                                || !inner.awaiting_adoption(&vhost, &queue)
                                || tokio::time::timeout_at(deadline, changed.notified())
                                    .await
                                    .is_err()
                            {
                                break;
                            }
                        }
                        match msg {
                            _ if inner.broker.queue(&vhost, &queue).is_some() => {
                                let _ = inner.handle_one(from, msg);
                            }
                            RelayMsg::Consume {
                                conn, channel, tag, ..
                            } => inner.send(
                                from,
                                RelayMsg::Deliver {
                                    conn,
                                    channel,
                                    deliveries: Vec::new(),
                                    cancels: vec![tag],
                                },
                                0,
                            ),
                            _ => {}
                        }
                    });
                }
                (RelayReply::Done, 0)
            }
            RelayMsg::Consume {
                vhost,
                queue,
                conn,
                channel,
                tag,
                no_ack,
                prefetch,
                global_prefetch,
                priority,
                exclusive,
            } => {
                let key = ChannelKey { conn, channel };
                let tag: Arc<str> = Arc::from(tag.as_str());
                let refuse = |why: String| {
                    tracing::debug!(queue = %queue, error = %why, "remote consumer refused");
                    self.send(
                        from,
                        RelayMsg::Deliver {
                            conn,
                            channel,
                            deliveries: Vec::new(),
                            cancels: vec![tag.to_string()],
                        },
                        0,
                    );
                };
                let Some(h) = self.broker.queue(&vhost, &queue) else {
                    refuse(format!("no queue '{queue}' here"));
                    return (RelayReply::Done, 0);
                };
                if self.broker.node_is_down(from) {
                    // Nothing could be delivered to it until this node hears it again (a
                    // frozen node that resumed): its consumer is cancelled, and follows the
                    // queue again.
                    tracing::debug!(queue = %queue, node = from, "remote consumer of a node recorded down refused");
                    self.cancel_best_effort(from, key, vec![tag.to_string()]);
                    return (RelayReply::Done, 0);
                }
                let proxy = self.proxy(from, key, global_prefetch);
                let consumer = Consumer {
                    tag: tag.clone(),
                    link: proxy.link.clone(),
                    no_ack,
                    prefetch,
                    priority,
                    exclusive,
                    in_flight: Arc::new(AtomicU32::new(0)),
                };
                let dead = {
                    let mut q = h.lock();
                    match q.check_new_consumer(&h, exclusive) {
                        Err(e) => {
                            drop(q);
                            refuse(e.text);
                            return (RelayReply::Done, 0);
                        }
                        Ok(()) => {
                            lock(&proxy.consumers).push((vhost.clone(), queue.clone(), tag));
                            q.add_consumer(&h, consumer, now)
                        }
                    }
                };
                if !dead.is_empty() {
                    self.broker.dead_letter(&h, dead, now);
                }
                (RelayReply::Done, 0)
            }
            RelayMsg::Cancel {
                vhost,
                queue,
                conn,
                channel,
                tag,
            } => {
                let key = ChannelKey { conn, channel };
                let proxy = lock(&self.proxies).get(&(from, key)).cloned();
                if let Some(p) = proxy {
                    lock(&p.consumers)
                        .retain(|(v, q, t)| !(v == &vhost && q == &queue && **t == *tag));
                    self.detach(&p, &vhost, &queue, &tag, now);
                }
                (RelayReply::Done, 0)
            }
            RelayMsg::Settle {
                vhost,
                queue,
                conn,
                channel,
                seqs,
                how,
            } => {
                let key = ChannelKey { conn, channel };
                if let Some(p) = lock(&self.proxies).get(&(from, key)).cloned() {
                    let mut u = lock(&p.unacked);
                    for s in &seqs {
                        u.remove(&(vhost.clone(), queue.clone(), *s));
                    }
                }
                let how = match how {
                    WireSettle::Ack => Settle::Ack,
                    WireSettle::Requeue => Settle::Nack { requeue: true },
                    WireSettle::Drop => Settle::Nack { requeue: false },
                };
                self.settle_local(&vhost, &queue, &seqs, how);
                (RelayReply::Done, 0)
            }
            RelayMsg::Get {
                vhost,
                queue,
                conn,
                channel,
                no_ack,
                request,
            } => {
                let Some(h) = self.broker.queue(&vhost, &queue) else {
                    return (RelayReply::Missing(missing(&vhost, &queue)), 0);
                };
                {
                    let mut abandoned = lock(&self.abandoned_gets);
                    if let Some(i) = abandoned.iter().position(|a| *a == (from, request)) {
                        // Its asker gave it up already: nobody would take the message.
                        abandoned.remove(i);
                        return (RelayReply::Got(None), 0);
                    }
                }
                let mut dead = Vec::new();
                let got = h.lock().get(now, !no_ack, &mut dead);
                if !dead.is_empty() {
                    self.broker.dead_letter(&h, dead, now);
                }
                let got = got.map(|(entry, remaining)| {
                    if !no_ack {
                        // Its ack (or the channel's end) comes back through the proxy channel.
                        let proxy = self.proxy(from, ChannelKey { conn, channel }, 0);
                        lock(&proxy.unacked).insert((vhost.clone(), queue.clone(), entry.seq));
                        let mut gets = lock(&proxy.gets);
                        if gets.len() == PROXY_GETS {
                            gets.pop_front();
                        }
                        gets.push_back((request, vhost.clone(), queue.clone(), entry.seq));
                    }
                    (
                        entry.seq,
                        entry.redelivered,
                        WireMessage::of(&entry.message),
                        remaining,
                    )
                });
                (RelayReply::Got(got), 0)
            }
            RelayMsg::GetAbandoned {
                conn,
                channel,
                request,
            } => {
                self.abandon_get(from, ChannelKey { conn, channel }, request);
                (RelayReply::Done, 0)
            }
            // Handled with its batch in `handle` (it waits for the follower, not the disk).
            RelayMsg::Barrier { .. } => (RelayReply::Counts(0, 0, 0), 0),
            // A reply name of this node, declared on another (direct reply-to): it "exists"
            // while its consumer does, with RabbitMQ's 0 messages and 1 consumer.
            RelayMsg::Counts { vhost, queue } if is_reply_name(&queue) => {
                let live = ReplyAddress::parse(&queue)
                    .is_ok_and(|a| a.node == self.me && self.broker.direct_replies().contains(&a));
                match live {
                    true => (RelayReply::Counts(0, 1, 0), 0),
                    false => (RelayReply::Missing(missing(&vhost, &queue)), 0),
                }
            }
            RelayMsg::DeliverReply { name, message } => {
                if let Some(message) = message.message() {
                    self.broker
                        .deliver_forwarded_reply(&name, Arc::new(message));
                }
                (RelayReply::Done, 0)
            }
            RelayMsg::Counts { vhost, queue } => match self.broker.queue(&vhost, &queue) {
                Some(h) => {
                    let mut q = h.lock();
                    q.touch(now);
                    (
                        RelayReply::Counts(
                            q.message_count(),
                            q.consumer_count(),
                            q.unacked_count(),
                        ),
                        0,
                    )
                }
                None => (RelayReply::Missing(missing(&vhost, &queue)), 0),
            },
            RelayMsg::Purge { vhost, queue } => match self.broker.queue(&vhost, &queue) {
                Some(h) => (RelayReply::Purged(h.lock().purge()), 0),
                None => (RelayReply::Missing(missing(&vhost, &queue)), 0),
            },
            RelayMsg::Sessions => (
                RelayReply::Sessions(self.broker.sessions().connections()),
                0,
            ),
            RelayMsg::CloseConnection { id, reason } => (
                RelayReply::Closed(self.broker.sessions().close(id, &reason)),
                0,
            ),
            RelayMsg::Deliver {
                conn,
                channel,
                deliveries,
                cancels,
            } => {
                let key = ChannelKey { conn, channel };
                let outbox = lock(&self.sinks).get(&key).and_then(|s| s.outbox.upgrade());
                let mut undelivered = Vec::new();
                let Some(outbox) = outbox else {
                    for d in deliveries.into_iter().filter(|d| d.ack_required) {
                        undelivered.push((d.vhost, d.queue, d.seq));
                    }
                    return (RelayReply::Undelivered(undelivered), 0);
                };
                let Some(relay) = self.link.upgrade() else {
                    return (RelayReply::Done, 0);
                };
                let link: Arc<dyn RemoteLink> = relay;
                for d in deliveries {
                    if self.is_retired(&key, &d.tag, from) {
                        // Sent before this node took the consumer away from `from`: the
                        // message is the queue's new master's to deliver now (a copy there
                        // comes flagged redelivered). Returned, so `from` requeues it if it
                        // still runs the queue.
                        tracing::debug!(node = from, tag = %d.tag, "stale delivery dropped");
                        if d.ack_required {
                            undelivered.push((d.vhost, d.queue, d.seq));
                        }
                        continue;
                    }
                    let Some(message) = d.message.message() else {
                        continue;
                    };
                    let queue = Arc::new(RemoteQueue {
                        node: from,
                        vhost: d.vhost.clone(),
                        name: d.queue.clone(),
                        link: link.clone(),
                    });
                    let item = OutItem::Deliver(Delivery {
                        channel,
                        consumer_tag: Arc::from(d.tag.as_str()),
                        queue: QueueRef::Remote(queue),
                        seq: d.seq,
                        message: Arc::new(message),
                        redelivered: d.redelivered,
                        ack_required: d.ack_required,
                    });
                    if outbox.push(item).is_err() && d.ack_required {
                        undelivered.push((d.vhost, d.queue, d.seq));
                    }
                }
                let state = self.broker.snapshot();
                for tag in cancels {
                    let mut gone = None;
                    if let Some(s) = lock(&self.sinks).get_mut(&key) {
                        if let Some(i) =
                            s.tags.iter().position(|t| t.node == from && *t.tag == *tag)
                        {
                            gone = Some(s.tags.remove(i));
                        }
                    }
                    // A mirrored queue's master that cancels its consumers is handing the
                    // queue over (a controlled stop, a `nodes` policy), or deleting it: the
                    // consumer waits for the new master, as after a failure (`rehome`
                    // cancels it if the queue went), unless it asked to be cancelled.
                    if let Some(t) = gone.filter(|t| {
                        !t.cancel_on_ha_failover && state.mirror_sets.contains_key(&*t.queue)
                    }) {
                        self.retire(key, &Arc::downgrade(&outbox), &t.tag, from);
                        lock(&self.orphans).push(Orphan {
                            key,
                            outbox: Arc::downgrade(&outbox),
                            tag: t.tag,
                            queue: t.queue,
                            node: from,
                            since: std::time::Instant::now(),
                        });
                        continue;
                    }
                    let _ = outbox.push(OutItem::Cancel {
                        channel,
                        consumer_tag: Arc::from(tag.as_str()),
                    });
                }
                (RelayReply::Undelivered(undelivered), 0)
            }
        }
    }

    /// The answer to `msg` while this node's storage is still recovering (None: harmless
    /// now, handled as usual). A publish is refused (nacked), a consumer is cancelled (one
    /// of a mirrored queue waits and tries again), questions get "unavailable".
    fn refuse_while_starting(&self, from: NodeId, msg: &RelayMsg) -> Option<RelayReply> {
        let starting = || "the queue's node is starting".to_string();
        match msg {
            RelayMsg::Publish { .. } => Some(RelayReply::Published(false)),
            RelayMsg::Consume {
                conn, channel, tag, ..
            } => {
                self.send(
                    from,
                    RelayMsg::Deliver {
                        conn: *conn,
                        channel: *channel,
                        deliveries: Vec::new(),
                        cancels: vec![tag.clone()],
                    },
                    0,
                );
                Some(RelayReply::Done)
            }
            RelayMsg::Get { .. } | RelayMsg::Purge { .. } | RelayMsg::Counts { .. } => {
                Some(RelayReply::Missing(starting()))
            }
            RelayMsg::Settle { .. }
            | RelayMsg::Cancel { .. }
            | RelayMsg::GetAbandoned { .. }
            | RelayMsg::Deliver { .. }
            | RelayMsg::Barrier { .. }
            | RelayMsg::Sessions
            | RelayMsg::CloseConnection { .. }
            | RelayMsg::DeliverReply { .. } => None,
        }
    }

    /// Handles a batch of messages from `from`, in order; the replies, in order, once every
    /// forwarded publish among them is durable.
    fn handle(&self, from: NodeId, batch: Vec<RelayMsg>) -> BrokerReply {
        let mut ticket = 0;
        let mut first_ticket = u64::MAX;
        let mut index = 0;
        let replies: Vec<RelayReply> = batch
            .into_iter()
            .map(|m| {
                if let RelayMsg::Barrier { index: i } = m {
                    // A `Counts` of 0s is the "followed" answer: the asker needs no other.
                    index = index.max(i);
                    return RelayReply::Counts(0, 0, 0);
                }
                let (r, t) = self.handle_one(from, m);
                ticket = ticket.max(t);
                if t != 0 {
                    first_ticket = first_ticket.min(t);
                }
                r
            })
            .collect();
        let behind = *self.applied.borrow() < index;
        let durability = self.broker.durability().cloned();
        let unsynced = durability
            .as_ref()
            .is_some_and(|d| ticket != 0 && !d.is_durable(ticket));
        match durability {
            _ if behind || unsynced => {
                let mut applied = self.applied.clone();
                BrokerReply::Later(Box::pin(async move {
                    if behind {
                        let wait = applied.wait_for(|i| *i >= index);
                        let _ =
                            tokio::time::timeout(std::time::Duration::from_secs(10), wait).await;
                    }
                    // One wait for the batch: tickets are marked durable in order.
                    let ok = match (&durability, unsynced) {
                        (Some(d), true) => {
                            wait_durable(d, ticket).await && !d.any_void(first_ticket, ticket)
                        }
                        _ => true,
                    };
                    let replies: Vec<RelayReply> = replies
                        .into_iter()
                        .map(|r| match r {
                            RelayReply::Published(taken) => RelayReply::Published(taken && ok),
                            other => other,
                        })
                        .collect();
                    encode(&replies)
                }))
            }
            Some(d) if ticket != 0 && d.any_void(first_ticket, ticket) => {
                let replies: Vec<RelayReply> = replies
                    .into_iter()
                    .map(|r| match r {
                        RelayReply::Published(_) => RelayReply::Published(false),
                        other => other,
                    })
                    .collect();
                BrokerReply::Now(encode(&replies))
            }
            _ => BrokerReply::Now(encode(&replies)),
        }
    }
}

/// RabbitMQ's 404 text for a queue that is not there.
fn missing(vhost: &str, queue: &str) -> String {
    format!("no queue '{queue}' in vhost '{vhost}'")
}

/// Waits until group-commit `ticket` is durable (false if storage failed).
async fn wait_durable(d: &Arc<crate::broker::Durability>, ticket: u64) -> bool {
    let notify = Arc::new(Notify::new());
    let waker = notify.clone();
    let outbox = Arc::new(Outbox::new(0, Box::new(move || waker.notify_one())));
    loop {
        if d.has_failed() {
            return false;
        }
        if d.is_durable(ticket) {
            return true;
        }
        d.wait(&outbox);
        // Checked again after registering: the mark may have moved in between.
        if d.is_durable(ticket) {
            return true;
        }
        let _ =
            tokio::time::timeout(std::time::Duration::from_millis(100), notify.notified()).await;
    }
}

/// The forwarder of a proxy channel: drains its outbox and sends the deliveries (and
/// broker cancels) to the consumer's node, in order.
async fn forward(inner: Arc<Inner>, proxy: Arc<ProxyChannel>, notify: Arc<Notify>) {
    let mut items = Vec::new();
    loop {
        notify.notified().await;
        let current = lock(&inner.proxies)
            .get(&(proxy.node, proxy.key))
            .is_some_and(|p| Arc::ptr_eq(p, &proxy));
        if !current {
            return;
        }
        proxy.outbox.drain(&mut items);
        while !items.is_empty() {
            // At most BATCH deliveries and about SEND_BATCH_BYTES per message.
            let mut take = 0;
            let mut size = 0;
            for item in &items {
                if take == BATCH || (take > 0 && size >= SEND_BATCH_BYTES) {
                    break;
                }
                if let OutItem::Deliver(d) = item {
                    size += d.message.size() as usize;
                }
                take += 1;
            }
            let mut deliveries = Vec::with_capacity(take);
            let mut cancels = Vec::new();
            let mut bytes = 0usize;
            for item in items.drain(..take) {
                match item {
                    OutItem::Deliver(d) => {
                        bytes += d.message.size() as usize;
                        let (vhost, queue) = d.queue.name();
                        if d.ack_required {
                            lock(&proxy.unacked).insert((
                                vhost.to_string(),
                                queue.to_string(),
                                d.seq,
                            ));
                        }
                        deliveries.push(WireDelivery {
                            vhost: vhost.to_string(),
                            queue: queue.to_string(),
                            tag: d.consumer_tag.to_string(),
                            seq: d.seq,
                            redelivered: d.redelivered,
                            ack_required: d.ack_required,
                            message: WireMessage::of(&d.message),
                        });
                    }
                    // A queue that moved away: the consumer's own node hears a cancel from
                    // the master of a mirrored queue, and makes it follow the queue.
                    OutItem::Rehome { consumer_tag, .. } | OutItem::Cancel { consumer_tag, .. } => {
                        let mut c = lock(&proxy.consumers);
                        c.retain(|(_, _, t)| *t != consumer_tag);
                        cancels.push(consumer_tag.to_string());
                    }
                    // Only a connection's own outbox is closed by an operator, and only a
                    // channel's reply consumer gets replies.
                    OutItem::Close { .. } | OutItem::Reply { .. } => {}
                }
            }
            let msg = RelayMsg::Deliver {
                conn: proxy.key.conn,
                channel: proxy.key.channel,
                deliveries,
                cancels,
            };
            inner.send_raw(proxy.node, msg, 0, Some(proxy.clone()), bytes);
        }
    }
}

/// The link's broker requests, handed to the relay.
struct Service {
    inner: Arc<Inner>,
}

impl BrokerService for Service {
    fn handle(&self, from: NodeId, payload: Vec<u8>) -> BrokerReply {
        match bincode::deserialize::<Vec<RelayMsg>>(&payload) {
            Ok(batch) => self.inner.handle(from, batch),
            Err(e) => {
                tracing::warn!(node = from, error = %e, "relay: undecodable request");
                BrokerReply::Now(Vec::new())
            }
        }
    }
}

impl RemoteLink for Relay {
    fn publish(
        &self,
        node: NodeId,
        vhost: &str,
        queues: Vec<String>,
        message: Arc<Message>,
        outcome: u64,
    ) {
        let msg = RelayMsg::Publish {
            vhost: vhost.to_string(),
            queues,
            message: WireMessage::of(&message),
        };
        self.inner.send(node, msg, outcome);
    }

    fn deliver_reply(&self, node: NodeId, name: &str, message: Arc<Message>) {
        let msg = RelayMsg::DeliverReply {
            name: name.to_string(),
            message: WireMessage::of(&message),
        };
        self.inner.send(node, msg, 0);
    }

    fn consume(
        &self,
        queue: &RemoteQueue,
        key: ChannelKey,
        outbox: &Arc<Outbox>,
        consumer: RemoteConsumer,
    ) {
        {
            let mut sinks = lock(&self.inner.sinks);
            let sink = sinks.entry(key).or_insert_with(|| ConsumerSink {
                outbox: Arc::downgrade(outbox),
                tags: Vec::new(),
            });
            sink.outbox = Arc::downgrade(outbox);
            if let Some(r) = lock(&self.inner.retired).get_mut(&key) {
                r.tags
                    .retain(|(t, n)| !(*n == queue.node && **t == *consumer.tag));
            }
            sink.tags.push(SinkTag {
                node: queue.node,
                tag: consumer.tag.clone(),
                queue: Arc::new((queue.vhost.clone(), queue.name.clone())),
                cancel_on_ha_failover: consumer.cancel_on_ha_failover,
            });
        }
        let msg = RelayMsg::Consume {
            vhost: queue.vhost.clone(),
            queue: queue.name.clone(),
            conn: key.conn,
            channel: key.channel,
            tag: consumer.tag.to_string(),
            no_ack: consumer.no_ack,
            prefetch: consumer.prefetch,
            global_prefetch: consumer.global_prefetch,
            priority: consumer.priority,
            exclusive: consumer.exclusive,
        };
        self.inner.send(queue.node, msg, 0);
    }

    fn cancel(&self, queue: &RemoteQueue, key: ChannelKey, tag: &str) {
        {
            let mut sinks = lock(&self.inner.sinks);
            if let Some(s) = sinks.get_mut(&key) {
                s.tags.retain(|t| !(t.node == queue.node && &*t.tag == tag));
                if s.tags.is_empty() {
                    sinks.remove(&key);
                }
            }
        }
        let msg = RelayMsg::Cancel {
            vhost: queue.vhost.clone(),
            queue: queue.name.clone(),
            conn: key.conn,
            channel: key.channel,
            tag: tag.to_string(),
        };
        self.inner.send(queue.node, msg, 0);
    }

    fn call(&self, call: QueueCall) -> CallFuture {
        let q = call.queue().clone();
        let msg = match call {
            QueueCall::Get { key, no_ack, .. } => RelayMsg::Get {
                vhost: q.vhost.clone(),
                queue: q.name.clone(),
                conn: key.conn,
                channel: key.channel,
                no_ack,
                request: self.inner.next_get.fetch_add(1, Ordering::Relaxed),
            },
            QueueCall::Counts { .. } => RelayMsg::Counts {
                vhost: q.vhost.clone(),
                queue: q.name.clone(),
            },
            QueueCall::Purge { .. } => RelayMsg::Purge {
                vhost: q.vhost.clone(),
                queue: q.name.clone(),
            },
        };
        let (tx, rx) = oneshot::channel();
        self.inner.enqueue(
            q.node,
            Outgoing {
                msg,
                outcome: 0,
                after: None,
                released: 0,
                reply_to: Some(tx),
                node_reply_to: None,
                source: Some(q.clone()),
            },
        );
        Box::pin(async move {
            rx.await.unwrap_or_else(|_| {
                QueueReply::Unavailable("the queue's node could not be reached".into())
            })
        })
    }

    fn node_call(&self, node: NodeId, call: NodeCall) -> NodeCallFuture {
        let msg = match call {
            NodeCall::Sessions => RelayMsg::Sessions,
            NodeCall::CloseConnection { id, reason } => RelayMsg::CloseConnection { id, reason },
        };
        let (tx, rx) = oneshot::channel();
        self.inner.enqueue(
            node,
            Outgoing {
                msg,
                outcome: 0,
                after: None,
                released: 0,
                reply_to: None,
                node_reply_to: Some(tx),
                source: None,
            },
        );
        Box::pin(async move {
            rx.await
                .unwrap_or_else(|_| NodeReply::Unavailable("the node could not be reached".into()))
        })
    }

    fn settle(&self, queue: &RemoteQueue, key: ChannelKey, seqs: Vec<u64>, how: Settle) {
        let how = match how {
            Settle::Ack => WireSettle::Ack,
            Settle::Nack { requeue: true } => WireSettle::Requeue,
            Settle::Nack { requeue: false } => WireSettle::Drop,
        };
        let msg = RelayMsg::Settle {
            vhost: queue.vhost.clone(),
            queue: queue.name.clone(),
            conn: key.conn,
            channel: key.channel,
            seqs,
            how,
        };
        self.inner.send(queue.node, msg, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Messages sent alone (a broker cancel, a settle sent again, an abandoned get) decode
    /// as the batch the receiver expects.
    #[test]
    fn a_message_sent_alone_decodes_as_a_batch_of_one() {
        let msg = RelayMsg::GetAbandoned {
            conn: 7,
            channel: 3,
            request: 512,
        };
        let batch: Vec<RelayMsg> = bincode::deserialize(&encode_one(&msg)).expect("a batch of one");
        assert!(matches!(
            batch.as_slice(),
            [RelayMsg::GetAbandoned {
                conn: 7,
                channel: 3,
                request: 512
            }]
        ));
        // What the two senders did before: not a batch.
        assert!(bincode::deserialize::<Vec<RelayMsg>>(&encode(&[&msg])).is_err());
    }
}
