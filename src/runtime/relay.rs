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
//! - `Get`, `Counts`, `Purge`, `Figures`: basic.get (a message taken with acks is held by
//!   the proxy channel), declare-ok's counts, queue.purge, a management listing's figures. A get C gave up while it was under way
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
//! again until taken, and once C hears H again it cancels there the consumers it cancelled;
//! once H hears C again it cancels on C the consumers it dropped, so they attach again.
//! A consumer of a mirrored queue that H cancelled while still the queue's home (its
//! storage was recovering), that waited for a new master while H came back, or whose
//! consume was lost with its link, asks H again (`Orphan::retry_at`): nothing else would
//! wake it, and it would wait for deliveries that never come.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tokio::sync::{oneshot, watch};

use super::clock::Clock;
use super::conn_task::MetaCommit;
use super::node_link::BrokerLinks;
use crate::broker::remote::QueueReply;
use crate::broker::{Broker, ChannelKey, ChannelLink, OutItem, Outbox};
use crate::meta::NodeId;

mod dead_letter;
mod forward;
mod link;
mod proxies;
mod sender;
mod serve;
#[cfg(test)]
mod tests;
mod wire;

use sender::{NodeSender, Outgoing};
use serve::Service;
use wire::{Held, RelayMsg};

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

/// On the queue's node: the stand-in for one channel of a consumer on another node.
struct ProxyChannel {
    node: NodeId,
    key: ChannelKey,
    link: Arc<ChannelLink>,
    outbox: Arc<Outbox>,
    /// Consumers attached through it: (vhost, queue, tag).
    consumers: Mutex<Vec<(String, String, Arc<str>)>>,
    /// Deliveries sent and not settled.
    unacked: Mutex<BTreeSet<Held>>,
    /// The latest gets with acks it answered: (request, the message), for an abandonment
    /// to name.
    gets: Mutex<VecDeque<(u64, Held)>>,
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
    /// The master's node that went down, or that cancelled the consumer.
    node: NodeId,
    /// When it started waiting (the node's clock): a minute later it is cancelled.
    since: crate::time::Instant,
    /// When to ask `node` again if it is still the queue's home and up: set when `node`
    /// itself cancelled the consumer (its storage was still recovering the queue, or it
    /// was between two states), as nothing else would wake it; `None` after a failure,
    /// where the consumer waits for the new master.
    retry_at: Option<crate::time::Instant>,
}

/// How long a consumer cancelled by its queue's node waits before asking it again.
const ORPHAN_RETRY_MS: u64 = 1_000;
/// How long a consumer waits for its queue's new master before it is cancelled.
const ORPHAN_WAIT_MS: u64 = 60_000;

struct Inner {
    broker: Arc<Broker>,
    transport: Arc<dyn BrokerLinks>,
    meta: Arc<dyn MetaCommit>,
    clock: Clock,
    me: NodeId,
    /// The Raft index this node's broker has followed.
    applied: watch::Receiver<u64>,
    /// What this node knows of itself, for [`RelayMsg::Stats`].
    facts: Arc<super::node_stats::NodeFacts>,
    link: Weak<Relay>,
    // Ordered maps, not hashed: what is iterated (a node's proxies closed, a channel's
    // consumers orphaned) happens in the same order on every run, so a simulated seed
    // replays exactly.
    /// Per node: its sender, and the signal that the node was declared down (what waits for
    /// its answers fails then: a frozen node keeps its sockets open and never answers).
    senders: Mutex<BTreeMap<NodeId, Arc<NodeSender>>>,
    proxies: Mutex<BTreeMap<(NodeId, ChannelKey), Arc<ProxyChannel>>>,
    sinks: Mutex<BTreeMap<ChannelKey, ConsumerSink>>,
    /// Consumers waiting for their mirrored queue's new master.
    orphans: Mutex<Vec<Orphan>>,
    /// Whether this node's queues serve other nodes yet: not before storage has put their
    /// messages back (a forwarded publish would take a seq the queue's index already used).
    serving: std::sync::atomic::AtomicBool,
    /// Per channel, consumers this node took away from a queue's node (declared down, or it
    /// handed the queue over): (tag, that node). Deliveries it sent before are stale.
    retired: Mutex<BTreeMap<ChannelKey, Retired>>,
    /// Drawn at each start and mixed into the instance of every queue this node runs
    /// ([`Held::instance`]): a settle sent to this node's last life names none of them.
    instance_salt: u64,
    /// The number of this node's next get ([`RelayMsg::Get`]'s `request`).
    next_get: std::sync::atomic::AtomicU64,
    /// Gets other nodes abandoned before they arrived here: (node, request).
    abandoned_gets: Mutex<VecDeque<(NodeId, u64)>>,
    /// Consumers this node cancelled on a node it gave up, to cancel there once it is heard
    /// again (it may never have given this node up, and would keep them).
    cancel_when_up: Mutex<Vec<GivenUp>>,
    /// Consumers of other nodes' channels this node dropped when it gave their node up: (the
    /// node, its channel, the consumer tags), to cancel there once it is heard again. It
    /// may never have given this node up (a one-way cut, a pause), and would otherwise wait
    /// for deliveries that never come.
    dropped_consumers: Mutex<Vec<(NodeId, ChannelKey, Vec<String>)>>,
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
        transport: Arc<dyn BrokerLinks>,
        meta: Arc<dyn MetaCommit>,
        clock: Clock,
        applied: watch::Receiver<u64>,
        facts: Arc<super::node_stats::NodeFacts>,
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
                facts,
                link: weak.clone(),
                senders: Mutex::new(BTreeMap::new()),
                proxies: Mutex::new(BTreeMap::new()),
                sinks: Mutex::new(BTreeMap::new()),
                orphans: Mutex::new(Vec::new()),
                retired: Mutex::new(BTreeMap::new()),
                serving: std::sync::atomic::AtomicBool::new(false),
                instance_salt: rand::random(),
                // Not from 1: a restarted node must not reuse the numbers of its last life.
                next_get: std::sync::atomic::AtomicU64::new(rand::random::<u64>() >> 1),
                abandoned_gets: Mutex::new(VecDeque::new()),
                cancel_when_up: Mutex::new(Vec::new()),
                dropped_consumers: Mutex::new(Vec::new()),
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
    /// queue declared there by that entry exists there); false if it could not be asked,
    /// did not answer, or was still behind when its wait (10 s) ended.
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
                published: None,
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
        let now = self.inner.clock.now();
        orphans.retain(|o| {
            let Some(outbox) = o.outbox.upgrade() else {
                return false;
            };
            let (vhost, queue) = &*o.queue;
            let home = state
                .vhost(vhost)
                .and_then(|v| v.queues.get(queue))
                .map(|d| d.home);
            let expired = now.millis_since(o.since) > ORPHAN_WAIT_MS;
            let cancel = || OutItem::Cancel {
                channel: o.key.channel,
                consumer_tag: o.tag.clone(),
            };
            let item = match home {
                // The queue went.
                None => Some(cancel()),
                // The node that cancelled it is still the home and up: ask it again (it
                // answers with another cancel while it cannot take the consumer).
                Some(h)
                    if h == o.node
                        && o.retry_at.is_some_and(|t| now >= t)
                        && !broker.node_is_down(h)
                        && broker.remote_queue(vhost, queue).is_some() =>
                {
                    Some(OutItem::Rehome {
                        channel: o.key.channel,
                        consumer_tag: o.tag.clone(),
                    })
                }
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
                            since: self.inner.clock.now(),
                            retry_at: None,
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
        // Let go first: failing what was queued requeues and nacks, which must not run
        // under this relay's locks.
        drop(sinks);
        self.inner.sender_down(node);
    }
}

impl Relay {
    /// `node` is heard again after it was given up: the consumers cancelled on it then are
    /// cancelled there too, in order before anything else sent to it (a consumer that
    /// followed its queue back there since is not: it is no longer retired); those still
    /// waiting for a new master of its queues ask it again at the next [`Relay::rehome`];
    /// and the consumers of its channels this node dropped when it gave it up are cancelled
    /// there.
    pub fn node_up(&self, node: NodeId) {
        // Consumers that waited for a new master of `node`'s queues ask `node` again: if it
        // is still their queue's home (it came back before any failover), nothing else
        // would wake them. The cancels below go first, on the same ordered sender.
        let now = self.inner.clock.now();
        for o in lock(&self.inner.orphans).iter_mut() {
            if o.node == node {
                o.retry_at = Some(now);
            }
        }
        let gone = take_where(&self.inner.cancel_when_up, |c| c.node == node);
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
        // And the consumers of its channels this node dropped: cancelled there, so they
        // follow their queue again (a mirrored queue's consumer attaches here anew).
        let dropped = take_where(&self.inner.dropped_consumers, |(n, _, _)| *n == node);
        for (_, key, tags) in dropped {
            tracing::debug!(
                node,
                ?tags,
                "cancelling there the consumers dropped when it was given up"
            );
            let msg = RelayMsg::Deliver {
                conn: key.conn,
                channel: key.channel,
                deliveries: Vec::new(),
                cancels: tags,
            };
            self.inner.send(node, msg, 0);
        }
    }
}

/// Takes the entries of `list` that `here` picks, leaving the rest in order.
fn take_where<T>(list: &Mutex<Vec<T>>, here: impl Fn(&T) -> bool) -> Vec<T> {
    let mut all = lock(list);
    let (taken, rest) = std::mem::take(&mut *all).into_iter().partition(|t| here(t));
    *all = rest;
    taken
}
