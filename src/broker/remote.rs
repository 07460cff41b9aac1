//! Queues of other cluster nodes, as this node's sessions see them.
//!
//! A queue lives on one node (its *home*). A session on another node reaches it through a
//! [`RemoteLink`]: the runtime's relay, which carries publishes, consumers, acks and
//! cancels over the node link to the home node and brings deliveries back. Every call here
//! is non-blocking (it queues a message for the link, in order), so the sans-IO session
//! stays synchronous; what needs an answer comes back later:
//!
//! - a forwarded publish's outcome lands in [`RemoteOutcomes`], where the publisher's confirm
//!   waits for it (acked only once the home node took the message, and, for a persistent
//!   message in a durable queue, once it is on that node's disk);
//! - deliveries arrive in the consumer's outbox like local ones, carrying a
//!   [`QueueRef::Remote`] so acks, nacks and requeues go back to the home node.
//!
//! What crosses the link is in [`crate::runtime::cluster`]'s relay; this module holds only
//! the broker-side vocabulary.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use super::message::Message;
use super::outbox::Outbox;
use super::queue::QueueHandle;
use crate::time::Instant;

pub use crate::meta::NodeId;

/// Identifies a consumer's channel across the cluster: the connection (whose id names its
/// node, see [`crate::meta::owner_node`]) and the channel number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChannelKey {
    /// Connection id.
    pub conn: u64,
    /// Channel number.
    pub channel: u16,
}

/// A consumer a session attaches to a queue of another node.
#[derive(Clone, Debug)]
pub struct RemoteConsumer {
    /// Consumer tag.
    pub tag: Arc<str>,
    /// no-ack mode.
    pub no_ack: bool,
    /// Per-consumer prefetch (0: unlimited).
    pub prefetch: u32,
    /// Channel-wide prefetch (`basic.qos global`), applied on the home node per channel.
    pub global_prefetch: u32,
    /// `x-priority`.
    pub priority: i32,
    /// Exclusive consumer.
    pub exclusive: bool,
    /// `x-cancel-on-ha-failover`: cancelled (not moved) when a mirrored queue's master
    /// fails over.
    pub cancel_on_ha_failover: bool,
}

/// How unacknowledged messages are settled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settle {
    /// basic.ack.
    Ack,
    /// basic.nack / basic.reject / requeue on close.
    Nack {
        /// Back to the queue (true), or dropped / dead-lettered.
        requeue: bool,
    },
}

/// The runtime's side of remote queues. Calls only queue work for the link (they never
/// block); what they send to one node arrives there in call order.
pub trait RemoteLink: Send + Sync + std::fmt::Debug {
    /// Forwards `message`, routed to `queues` of `vhost` on `node`; the home node's answer
    /// resolves one part of `outcome` in [`RemoteOutcomes`] (0: nobody waits for it).
    fn publish(
        &self,
        node: NodeId,
        vhost: &str,
        queues: Vec<String>,
        message: Arc<Message>,
        outcome: u64,
    );
    /// Forwards a dead letter to queue `queue` of `vhost`, on whichever node is its home, and
    /// again (to its new home, after a failover) until a home node has taken it, then
    /// [`taken`](super::dead_letter::LetterHold::taken)s `hold`. Given up (and `hold` taken)
    /// only when the queue is deleted; a node that stops first drops `hold` untaken, so the
    /// letter's source keeps the message.
    fn dead_letter(
        &self,
        vhost: &str,
        queue: String,
        message: Arc<Message>,
        hold: super::dead_letter::LetterHold,
    );
    /// Dead letters this node's queues took, each in the group-commit round of its `ticket`:
    /// takes each letter's hold once its round is durable; a letter whose round was voided
    /// (a mirrored queue's master deposed before the lap) is forwarded as by
    /// [`RemoteLink::dead_letter`] instead, to wherever the queue lives by then.
    fn dead_letters_written(&self, letters: Vec<super::dead_letter::WrittenLetter>);
    /// Hands `message`, published to the default exchange with the reply name `name` among
    /// its routing keys, to `node`, which runs that name's reply consumer (direct reply-to:
    /// nobody waits for an answer, as RabbitMQ's `delegate:invoke_no_result`).
    fn deliver_reply(&self, node: NodeId, name: &str, message: Arc<Message>);
    /// Attaches `consumer` of channel `key` (whose deliveries go to `outbox`) to `queue`.
    fn consume(
        &self,
        queue: &RemoteQueue,
        key: ChannelKey,
        outbox: &Arc<Outbox>,
        consumer: RemoteConsumer,
    );
    /// Detaches consumer `tag` of channel `key` from `queue`.
    fn cancel(&self, queue: &RemoteQueue, key: ChannelKey, tag: &str);
    /// Settles deliveries `seqs` of `queue` made to channel `key`.
    fn settle(&self, queue: &RemoteQueue, key: ChannelKey, seqs: Vec<u64>, how: Settle);
    /// Asks the queue's node something whose answer a parked channel waits for; the future
    /// resolves to the answer (or [`QueueReply::Unavailable`]) and never fails otherwise.
    fn call(&self, call: QueueCall) -> CallFuture;
    /// Asks node `node` about itself: its sessions, figures, or a connection to close (the
    /// management API's cluster-wide views); resolves to [`NodeReply::Unavailable`] when
    /// the node cannot answer.
    fn node_call(&self, node: NodeId, call: NodeCall) -> NodeCallFuture;
}

/// A question to another node about itself, not one of its queues.
#[derive(Clone, Debug)]
pub enum NodeCall {
    /// Its connections, with their channels and consumers.
    Sessions,
    /// Close its connection `id` with 320 `CONNECTION_FORCED - {reason}`.
    CloseConnection {
        /// The connection.
        id: u64,
        /// The reply text.
        reason: String,
    },
    /// Its figures for `GET /api/nodes`.
    Stats,
}

/// The answer to a [`NodeCall`].
#[derive(Clone, Debug)]
pub enum NodeReply {
    /// Its connections.
    Sessions(Vec<super::registry::ConnectionView>),
    /// Whether the connection was there to close.
    Closed(bool),
    /// Its figures.
    Stats(Box<super::node_stats::NodeStats>),
    /// The node could not be reached, or did not answer.
    Unavailable(String),
}

/// The answer to a [`NodeCall`], later.
pub type NodeCallFuture = std::pin::Pin<Box<dyn std::future::Future<Output = NodeReply> + Send>>;

/// The answer to a [`QueueCall`], later.
pub type CallFuture = std::pin::Pin<Box<dyn std::future::Future<Output = QueueReply> + Send>>;

/// A question to the node of a queue, asked by a parked channel.
#[derive(Clone, Debug)]
pub enum QueueCall {
    /// basic.get: the next message, kept unacknowledged for channel `key` unless `no_ack`.
    Get {
        /// The queue.
        queue: Arc<RemoteQueue>,
        /// The asking channel (its acks come back with this key).
        key: ChannelKey,
        /// no-ack mode.
        no_ack: bool,
    },
    /// The message and consumer counts (declare-ok, delete checks).
    Counts {
        /// The queue.
        queue: Arc<RemoteQueue>,
    },
    /// queue.purge.
    Purge {
        /// The queue.
        queue: Arc<RemoteQueue>,
    },
    /// The figures the management listings show ([`crate::broker::QueueFigures`]): a walk
    /// of the queue, so asked by listings only, never by declares.
    Figures {
        /// The queue.
        queue: Arc<RemoteQueue>,
    },
}

impl QueueCall {
    /// The queue asked about.
    pub fn queue(&self) -> &Arc<RemoteQueue> {
        match self {
            QueueCall::Get { queue, .. }
            | QueueCall::Counts { queue }
            | QueueCall::Purge { queue }
            | QueueCall::Figures { queue } => queue,
        }
    }
}

/// A message basic.get took from a queue of another node.
#[derive(Clone, Debug)]
pub struct RemoteGot {
    /// Its sequence number in the queue (acks name it).
    pub seq: u64,
    /// Delivered before.
    pub redelivered: bool,
    /// The message.
    pub message: Arc<Message>,
    /// Messages left in the queue.
    pub remaining: u32,
    /// The queue of another node it came from (`None` for a local queue): if the channel
    /// that asked is gone when it arrives, it goes back there.
    pub source: Option<Arc<RemoteQueue>>,
}

/// The answer to a [`QueueCall`].
#[derive(Clone, Debug)]
pub enum QueueReply {
    /// basic.get: the message, or `None` when the queue is empty.
    Got(Option<RemoteGot>),
    /// Ready messages and consumers.
    Counts {
        /// Ready messages.
        messages: u32,
        /// Consumers.
        consumers: u32,
        /// Delivered and not yet acknowledged.
        unacked: u32,
    },
    /// Messages purged.
    Purged(u32),
    /// The queue's figures.
    Figures(crate::broker::QueueFigures),
    /// The queue is gone there, or its node could not be reached: the text says which.
    Unavailable(String),
}

/// A queue of another node.
#[derive(Debug)]
pub struct RemoteQueue {
    /// Its home node.
    pub node: NodeId,
    /// Vhost.
    pub vhost: String,
    /// Name.
    pub name: String,
    /// Which queue of that name, as its node tells them apart (a queue declared again
    /// after a delete numbers its messages from 0 again): set from the deliveries and
    /// gets it sends, which settles name; 0 for a queue looked up by name.
    pub instance: u64,
    /// The relay that reaches it.
    pub link: Arc<dyn RemoteLink>,
}

impl RemoteQueue {
    /// This queue as its `instance`.
    pub fn of_instance(&self, instance: u64) -> RemoteQueue {
        RemoteQueue {
            node: self.node,
            vhost: self.vhost.clone(),
            name: self.name.clone(),
            instance,
            link: self.link.clone(),
        }
    }
}

/// Where a delivery comes from, and where its ack goes.
#[derive(Clone, Debug)]
pub enum QueueRef {
    /// A queue of this node.
    Local(Arc<QueueHandle>),
    /// A queue of another node.
    Remote(Arc<RemoteQueue>),
}

impl QueueRef {
    /// Whether both name the same queue object.
    pub fn same(&self, other: &QueueRef) -> bool {
        match (self, other) {
            (QueueRef::Local(a), QueueRef::Local(b)) => Arc::ptr_eq(a, b),
            (QueueRef::Remote(a), QueueRef::Remote(b)) => {
                a.node == b.node && a.vhost == b.vhost && a.name == b.name
            }
            _ => false,
        }
    }

    /// Vhost and name.
    pub fn name(&self) -> (&str, &str) {
        match self {
            QueueRef::Local(h) => (&h.vhost, &h.name),
            QueueRef::Remote(r) => (&r.vhost, &r.name),
        }
    }

    /// Settles `seqs` delivered to channel `key`: locally at once (dead letters are
    /// returned for the caller to route), remotely by a message to the home node.
    pub fn settle(
        &self,
        key: ChannelKey,
        seqs: &[u64],
        how: Settle,
        now: Instant,
    ) -> Vec<super::queue::DeadLetter> {
        let mut dead = Vec::new();
        match self {
            QueueRef::Local(q) => {
                let mut g = q.lock();
                match how {
                    Settle::Ack => g.ack(q, seqs, now, &mut dead),
                    Settle::Nack { requeue } => g.settle(q, seqs, requeue, now, &mut dead),
                }
            }
            QueueRef::Remote(r) => r.link.settle(r, key, seqs.to_vec(), how),
        }
        dead
    }
}

/// The outcomes of forwarded publishes, by id: `None` while the home node has not answered,
/// then whether it took the message (`false` also when the link failed: a nack, never a
/// false ack). Connections whose confirms wait register their outbox to be woken.
#[derive(Default)]
pub struct RemoteOutcomes {
    inner: Mutex<OutcomesInner>,
}

#[derive(Default)]
struct OutcomesInner {
    next: u64,
    outcomes: HashMap<u64, Outcome>,
    /// Child outcome → the outcome it is a part of ([`RemoteOutcomes::join`]).
    parents: HashMap<u64, u64>,
    waiters: Vec<Weak<Outbox>>,
}

/// One publish's outcome: one part per home node it went to.
#[derive(Clone, Copy, Debug)]
struct Outcome {
    parts_left: u32,
    taken: bool,
}

impl std::fmt::Debug for RemoteOutcomes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteOutcomes").finish_non_exhaustive()
    }
}

impl RemoteOutcomes {
    fn lock(&self) -> std::sync::MutexGuard<'_, OutcomesInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new pending outcome made of `parts` answers (one per home node).
    pub fn issue(&self, parts: u32) -> u64 {
        let mut g = self.lock();
        g.next += 1;
        let id = g.next;
        g.outcomes.insert(
            id,
            Outcome {
                parts_left: parts,
                taken: true,
            },
        );
        id
    }

    /// Records one part of `id`'s outcome; when it was the last, wakes the waiting
    /// connections.
    pub fn resolve(&self, id: u64, taken: bool) {
        let waiters = {
            let mut g = self.lock();
            let mut id = id;
            let mut taken = taken;
            loop {
                let Some(o) = g.outcomes.get_mut(&id) else {
                    return;
                };
                o.taken &= taken;
                o.parts_left = o.parts_left.saturating_sub(1);
                if o.parts_left > 0 {
                    return;
                }
                // A finished part of a joined outcome resolves a part of its parent.
                let Some(parent) = g.parents.remove(&id) else {
                    break;
                };
                taken = g.outcomes.remove(&id).is_some_and(|o| o.taken);
                id = parent;
            }
            std::mem::take(&mut g.waiters)
        };
        for w in waiters.into_iter().filter_map(|w| w.upgrade()) {
            w.wake();
        }
    }

    /// The outcome of `id` once every part is known (taken only if every home node took
    /// it); it is forgotten when read.
    pub fn take(&self, id: u64) -> Option<bool> {
        let mut g = self.lock();
        match g.outcomes.get(&id) {
            Some(o) if o.parts_left == 0 => {
                let taken = o.taken;
                g.outcomes.remove(&id);
                Some(taken)
            }
            _ => None,
        }
    }

    /// One outcome for several (a transaction's publishes): known when all are, taken
    /// when all were. The parts are consumed by it.
    pub fn join(&self, ids: &[u64]) -> u64 {
        let parent = self.issue(ids.len() as u32);
        let mut done = Vec::new();
        {
            let mut g = self.lock();
            for &id in ids {
                match g.outcomes.get(&id) {
                    Some(o) if o.parts_left == 0 => {
                        done.push(o.taken);
                        g.outcomes.remove(&id);
                    }
                    Some(_) => {
                        g.parents.insert(id, parent);
                    }
                    None => done.push(false),
                }
            }
        }
        for taken in done {
            self.resolve(parent, taken);
        }
        parent
    }

    /// Whether `id`'s outcome is known (without forgetting it).
    pub fn is_known(&self, id: u64) -> bool {
        self.lock()
            .outcomes
            .get(&id)
            .is_some_and(|o| o.parts_left == 0)
    }

    /// Forgets `id` (its publisher went away).
    pub fn forget(&self, id: u64) {
        self.lock().outcomes.remove(&id);
    }

    /// Registers `outbox` to be woken at the next outcome.
    pub fn wait(&self, outbox: &Arc<Outbox>) {
        let mut g = self.lock();
        if !g.waiters.iter().any(|w| w.as_ptr() == Arc::as_ptr(outbox)) {
            g.waiters.push(Arc::downgrade(outbox));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn an_outcome_is_pending_until_resolved_and_wakes_its_waiters_once() {
        let outcomes = RemoteOutcomes::default();
        let woken = Arc::new(AtomicUsize::new(0));
        let w = woken.clone();
        let outbox = Arc::new(Outbox::new(
            1 << 20,
            Box::new(move || {
                w.fetch_add(1, Ordering::SeqCst);
            }),
        ));
        let a = outcomes.issue(1);
        let b = outcomes.issue(1);
        let two = outcomes.issue(2);
        outcomes.resolve(two, true);
        assert!(!outcomes.is_known(two), "one part of two");
        assert_ne!(a, b);
        outcomes.wait(&outbox);
        outcomes.wait(&outbox);
        assert_eq!(outcomes.take(a), None);
        outcomes.resolve(a, true);
        assert_eq!(
            woken.load(Ordering::SeqCst),
            1,
            "registered once, woken once"
        );
        outcomes.resolve(b, false);
        assert_eq!(
            woken.load(Ordering::SeqCst),
            1,
            "woken only while registered"
        );
        assert!(outcomes.is_known(b));
        assert_eq!(outcomes.take(a), Some(true));
        assert_eq!(outcomes.take(a), None, "read once");
        assert_eq!(outcomes.take(b), Some(false));
        outcomes.resolve(two, false);
        assert_eq!(
            outcomes.take(two),
            Some(false),
            "one refusal nacks the whole"
        );

        // A transaction's outcome joins its publishes', resolved before or after.
        let (p, q) = (outcomes.issue(1), outcomes.issue(2));
        outcomes.resolve(p, true);
        let tx = outcomes.join(&[p, q]);
        assert!(!outcomes.is_known(tx));
        outcomes.resolve(q, true);
        assert!(!outcomes.is_known(tx));
        outcomes.resolve(q, true);
        assert_eq!(outcomes.take(tx), Some(true));
        let bad = outcomes.issue(1);
        let tx = outcomes.join(&[bad]);
        outcomes.resolve(bad, false);
        assert_eq!(outcomes.take(tx), Some(false));
    }
}
