//! One queue: its messages in order, its consumers, and what is delivered but unacknowledged.
//!
//! Sans-IO: every operation takes `now` and returns what happened (dead letters for the broker
//! to republish, counts); deliveries go into consumers' outboxes. Each queue sits behind its
//! own mutex, taken by whichever connection publishes to, consumes from or acks on it: a busy
//! queue holds up exactly the channels that use it.
//!
//! Order: every message gets a sequence number on arrival. Requeued messages go back to their
//! place (RabbitMQ since 2.7): they wait in `returned`, keyed by (priority, sequence number),
//! and the next message is the better of `returned`'s first and the front of the highest
//! non-empty `ready` lane. A queue declared with `x-max-priority` has one lane per priority
//! (higher first, FIFO within a priority, as RabbitMQ); other queues have one lane.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use super::durability::Durability;
use super::message::Message;
use super::outbox::{ChannelLink, Delivery, OutItem};
use crate::amqp::reply_code::{access_refused, AmqpError};
use crate::meta::args::{Overflow, QueueArgs};
use crate::time::Instant;

mod figures;
mod paging;
pub use figures::QueueFigures;
pub use paging::{Delta, PageError, Pager, PagingConfig, KEEP_BYTES};

/// A queue and the lock around it.
#[derive(Debug)]
pub struct QueueHandle {
    /// Vhost.
    pub vhost: String,
    /// Name.
    pub name: String,
    /// When the handle was made, in [`next_generation`]'s order: storage tells a queue
    /// from a mirror copy of its name that is newer (a deposed master's handle) or older
    /// (a stale copy a new queue replaces) by it.
    pub generation: u64,
    state: Mutex<Queue>,
}

/// The process-wide order in which queue handles are made and mirror copies started.
static GENERATIONS: AtomicU64 = AtomicU64::new(1);

/// The next number in the order of queue handles and mirror copies (never 0).
pub fn next_generation() -> u64 {
    GENERATIONS.fetch_add(1, Ordering::Relaxed)
}

impl QueueHandle {
    /// Wraps a queue.
    pub fn new(vhost: &str, name: &str, queue: Queue) -> Arc<QueueHandle> {
        let mut queue = queue;
        Arc::new_cyclic(|me| {
            // The queue names itself when it joins the syncer's dirty list.
            queue.me = me.clone();
            QueueHandle {
                vhost: vhost.to_string(),
                name: name.to_string(),
                generation: next_generation(),
                state: Mutex::new(queue),
            }
        })
    }

    /// Locks the queue. A panic inside a queue operation is a bug; the state stays usable.
    pub fn lock(&self) -> MutexGuard<'_, Queue> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A message in the queue.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Arrival order.
    pub seq: u64,
    /// The message.
    pub message: Arc<Message>,
    /// Delivered before.
    pub redelivered: bool,
    /// Expiry in milliseconds on the broker clock (`u64::MAX`: never).
    pub expires_at_ms: u64,
    /// Priority lane (0 unless the queue has `x-max-priority`).
    pub priority: u8,
    /// Whether (and in which store) the queue index holds a record of it.
    pub on_disk: OnDisk,
    /// Beta: the message is not in RAM, only its id (and what the index knows); the value is
    /// the body bytes it stands for. It is read back from the store when it leaves the queue.
    pub beta: Option<u64>,
}

/// Where a message's queue-index record is: RabbitMQ's "is it on disk" flag of the variable
/// queue. A message with a record can leave RAM (become a delta message) and be read back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnDisk {
    /// Only in RAM.
    #[default]
    No,
    /// In the queue's persistent index: a persistent message of a durable queue (record
    /// and body survive a restart), or a transient message of a mirrored durable queue
    /// (recorded so that it reaches the mirrors; the record says transient, and the node's
    /// next start drops it).
    Persistent,
    /// Paged out under memory pressure (transient message, or any message of a non-durable
    /// queue): body in the transient store or embedded, dropped at restart.
    Transient,
}

impl Entry {
    /// Body bytes this entry stands for (in RAM or, for a beta, in the store).
    pub fn body_len(&self) -> u64 {
        self.beta.unwrap_or(self.message.body.len() as u64)
    }

    /// Past its expiry; `at_expiry`: also at it. Only strictly after while a publish tries
    /// its consumers, so a message with TTL 0 still goes to one that is ready now.
    fn expired(&self, now: Instant, at_expiry: bool) -> bool {
        now.as_millis() > self.expires_at_ms || (at_expiry && now.as_millis() == self.expires_at_ms)
    }
}

/// Why a message is dead-lettered (RabbitMQ's x-death reasons).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum DeathReason {
    /// basic.reject / basic.nack with requeue=false.
    Rejected,
    /// TTL passed.
    Expired,
    /// Dropped by a length limit.
    Maxlen,
}

impl DeathReason {
    /// The x-death reason string.
    pub fn as_str(self) -> &'static str {
        match self {
            DeathReason::Rejected => "rejected",
            DeathReason::Expired => "expired",
            DeathReason::Maxlen => "maxlen",
        }
    }
}

/// A message leaving the queue towards its dead-letter exchange.
#[derive(Debug)]
pub struct DeadLetter {
    /// The message.
    pub message: Arc<Message>,
    /// Why.
    pub reason: DeathReason,
    /// The index ack of a message the queue had on disk, withheld until the letter is
    /// where it goes ([`Queue::release_letter`]): a node that stops before then finds the
    /// message in this queue again at its next start, so a letter is kept at least once.
    pub held: Option<HeldAck>,
}

/// The index record that removes a dead-lettered message from its queue, not yet recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldAck {
    seq: u64,
    message_id: u128,
    size: usize,
    persistent: bool,
}

#[derive(Debug)]
struct Unacked {
    entry: Entry,
    /// The consumer's in-flight counter (None for basic.get).
    consumer_in_flight: Option<Arc<AtomicU32>>,
    /// The channel, when the delivery counts against its global prefetch.
    global: Option<Arc<ChannelLink>>,
}

/// A consumer attached to this queue.
#[derive(Debug)]
pub struct Consumer {
    /// Tag.
    pub tag: Arc<str>,
    /// Its channel.
    pub link: Arc<ChannelLink>,
    /// no-ack mode.
    pub no_ack: bool,
    /// Per-consumer prefetch (0: unlimited).
    pub prefetch: u32,
    /// `x-priority`.
    pub priority: i32,
    /// Exclusive consumer.
    pub exclusive: bool,
    /// Unacknowledged deliveries to this consumer.
    pub in_flight: Arc<AtomicU32>,
}

impl Consumer {
    fn can_take(&self) -> bool {
        if !self.link.flow_active.load(Ordering::Acquire) {
            return false;
        }
        if !self.no_ack {
            if self.prefetch != 0 && self.in_flight.load(Ordering::Acquire) >= self.prefetch {
                return false;
            }
            if !self.link.global_has_room() {
                return false;
            }
        }
        true
    }
}

/// What publish did with a message.
#[derive(Debug, Default)]
pub struct PublishResult {
    /// The group-commit ticket the publisher's confirm waits for (0: none).
    pub ticket: u64,
    /// False when the queue refused it (`x-overflow: reject-publish`, or deleted).
    pub accepted: bool,
    /// Messages to dead-letter as a consequence.
    pub dead: Vec<DeadLetter>,
}

/// The queue state machine.
#[derive(Debug)]
pub struct Queue {
    args: QueueArgs,
    exclusive_owner: Option<u64>,
    auto_delete: bool,
    /// One FIFO lane per priority, index = priority.
    ready: Vec<VecDeque<Entry>>,
    ready_len: usize,
    /// Requeued messages by (higher priority first, then arrival order).
    returned: BTreeMap<(Reverse<u8>, u64), Entry>,
    unacked: HashMap<u64, Unacked>,
    next_seq: u64,
    /// Messages below this seq may have gone out before this copy took over (recovered
    /// after an unclean stop, or promoted from a mirror): they leave flagged `redelivered`.
    suspect_below: u64,
    /// A mirrored queue's master hands out messages only until this instant: its lease,
    /// renewed while a Raft quorum read shows it is still the master (`None`: no lease is
    /// needed, no mirror could be promoted in its place).
    lease_until: Option<Instant>,
    consumers: Vec<Consumer>,
    next_consumer: usize,
    had_consumer: bool,
    ready_bytes: u64,
    memory: Arc<AtomicI64>,
    deleted: bool,
    last_used: Instant,
    persist: Option<Persist>,
    me: Weak<QueueHandle>,
    /// Messages published after `delta` (RabbitMQ's q1), in RAM until paged out.
    q1: VecDeque<Entry>,
    /// Messages only on disk, between the in-RAM head (`ready`) and `q1`.
    delta: Option<paging::Delta>,
    /// A page-out waiting for its index records to be written.
    page_out: Option<paging::PageOut>,
    /// The index was opened for this queue (so deletion must remove it).
    has_index: bool,
}

/// A change the queue index must record (persistent messages of durable queues, every
/// message of a mirrored durable queue, and page-outs).
#[derive(Debug, Clone)]
pub enum IndexOp {
    /// A message arrived.
    Publish {
        /// Its sequence number.
        seq: u64,
        /// The message.
        message: Arc<Message>,
        /// Expiry (`u64::MAX`: none).
        expires_at_ms: u64,
        /// In the persistent index (body in the persistent store; the record survives a
        /// restart if the message is persistent) or the transient page index.
        persistent: bool,
    },
    /// It was delivered (comes back with `redelivered` after a restart).
    Deliver {
        /// Sequence number.
        seq: u64,
    },
    /// It left the queue (ack, drop, expiry, purge).
    Ack {
        /// Sequence number.
        seq: u64,
        /// Message id (the store's reference goes).
        message_id: u128,
        /// Its size.
        size: usize,
        /// Which store holds its body (as in its publish record).
        persistent: bool,
    },
    /// The queue was deleted: remove its index.
    DeleteQueue,
}

struct Persist {
    durability: Arc<Durability>,
    /// Persistent messages survive restarts (a durable queue).
    durable: bool,
    pending: Vec<IndexOp>,
    /// The highest group-commit ticket among `pending`.
    pending_ticket: u64,
    dirty: bool,
    /// Reads paged-out messages back; None until storage is open.
    pager: Option<Arc<dyn Pager>>,
    /// When to page and how much of the head stays in RAM.
    paging: PagingConfig,
}

impl std::fmt::Debug for Persist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Persist")
            .field("durable", &self.durable)
            .field("pending", &self.pending.len())
            .field("paging", &self.paging)
            .finish_non_exhaustive()
    }
}

impl Queue {
    /// An empty queue. `memory` is the node-wide count of message bytes held by queues.
    pub fn new(
        args: QueueArgs,
        exclusive_owner: Option<u64>,
        auto_delete: bool,
        memory: Arc<AtomicI64>,
        now: Instant,
    ) -> Queue {
        let lanes = args.max_priority.map_or(1, |p| p as usize + 1);
        Queue {
            ready: (0..lanes).map(|_| VecDeque::new()).collect(),
            ready_len: 0,
            args,
            exclusive_owner,
            auto_delete,
            returned: BTreeMap::new(),
            unacked: HashMap::new(),
            next_seq: 0,
            suspect_below: 0,
            lease_until: None,
            consumers: Vec::new(),
            next_consumer: 0,
            had_consumer: false,
            ready_bytes: 0,
            memory,
            deleted: false,
            last_used: now,
            persist: None,
            me: Weak::new(),
            q1: VecDeque::new(),
            delta: None,
            page_out: None,
            has_index: false,
        }
    }

    /// Gives the queue a queue index through `durability`: persistent messages of a
    /// `durable` queue are recorded as they arrive; any message can be paged out once node
    /// memory passes the paging threshold (or at once in lazy mode) and a pager is set.
    pub fn with_persistence(
        mut self,
        durability: Arc<Durability>,
        durable: bool,
        paging: PagingConfig,
    ) -> Queue {
        self.persist = Some(Persist {
            durability,
            durable,
            pending: Vec::new(),
            pending_ticket: 0,
            dirty: false,
            pager: None,
            paging,
        });
        self
    }

    /// Sets what reads paged-out messages back (storage, once open).
    pub fn set_pager(&mut self, pager: Arc<dyn Pager>) {
        if let Some(p) = self.persist.as_mut() {
            p.pager = Some(pager);
        }
    }

    /// Replaces the arguments after a policy change. The priority lanes stay as declared
    /// (`x-max-priority` is not a policy key). As RabbitMQ's `init_max_length`, a queue
    /// over a new drop-head limit drops from its head at once (dead-lettered as `maxlen`);
    /// the reject modes refuse only later publishes.
    pub fn set_args(&mut self, mut args: QueueArgs, dead: &mut Vec<DeadLetter>) {
        args.max_priority = self.args.max_priority;
        self.args = args;
        if self.args.overflow == Overflow::DropHead {
            self.drop_over_limit(dead);
        }
    }

    /// The validated arguments.
    pub fn args(&self) -> &QueueArgs {
        &self.args
    }

    /// The owning connection of an exclusive queue.
    pub fn exclusive_owner(&self) -> Option<u64> {
        self.exclusive_owner
    }

    /// Whether the queue was deleted (late publishers find it so).
    pub fn is_deleted(&self) -> bool {
        self.deleted
    }

    /// Ready messages (not counting unacknowledged ones), as queue.declare-ok reports.
    pub fn message_count(&self) -> u32 {
        let paged = self.delta.as_ref().map_or(0, |d| d.count);
        (self.ready_len as u64 + self.returned.len() as u64 + self.q1.len() as u64 + paged) as u32
    }

    /// Body bytes of the ready messages (in memory or paged out).
    pub fn ready_bytes(&self) -> u64 {
        self.ready_bytes + self.paged_bytes()
    }

    /// Delivered but unacknowledged messages.
    pub fn unacked_count(&self) -> u32 {
        self.unacked.len() as u32
    }

    /// Consumers attached.
    pub fn consumer_count(&self) -> u32 {
        self.consumers.len() as u32
    }

    /// Under `x-single-active-consumer`, the one consumer messages go to (the first attached,
    /// as `pick_consumer` chooses); `None` when the queue is not single-active-consumer (every
    /// consumer is active then) or has no consumer.
    pub fn single_active_consumer(&self) -> Option<&Consumer> {
        if self.args.single_active_consumer {
            self.consumers.first()
        } else {
            None
        }
    }

    /// When the queue was last used (for `x-expires`).
    pub fn last_used(&self) -> Instant {
        self.last_used
    }

    fn account(&self, delta: i64) {
        self.memory.fetch_add(delta, Ordering::Relaxed);
    }

    /// The highest non-empty ready lane.
    fn top_lane(&self) -> Option<usize> {
        if self.ready_len == 0 {
            return None;
        }
        (0..self.ready.len())
            .rev()
            .find(|&p| !self.ready[p].is_empty())
    }

    fn next_is_returned(&self) -> Option<bool> {
        let lane = self.top_lane();
        match (self.returned.keys().next(), lane) {
            (None, None) => None,
            (Some(_), None) => Some(true),
            (None, Some(_)) => Some(false),
            (Some((Reverse(rp), rseq)), Some(l)) => {
                let front = &self.ready[l][0];
                Some((*rp, Reverse(*rseq)) > (front.priority, Reverse(front.seq)))
            }
        }
    }

    fn peek_next(&self) -> Option<&Entry> {
        match self.next_is_returned()? {
            true => self.returned.values().next(),
            false => self.ready[self.top_lane()?].front(),
        }
    }

    /// The next message, leaving the queue; a beta is read back from its store first.
    fn pop_next(&mut self) -> Option<Entry> {
        loop {
            let mut e = self.pop_raw()?;
            if self.load_beta(&mut e) {
                e.redelivered |= e.seq < self.suspect_below;
                return Some(e);
            }
            // Its body is gone (reported by load_beta): it leaves the queue, like a message
            // whose body recovery could not read.
            self.drop_entry(&e);
        }
    }

    /// The next message, leaving the queue as it is (a beta stays one: for drops that need
    /// no body, such as purge).
    fn pop_raw(&mut self) -> Option<Entry> {
        self.fill_front();
        let e = match self.next_is_returned()? {
            true => self.returned.pop_first().map(|(_, e)| e)?,
            false => {
                let lane = self.top_lane()?;
                self.ready_len -= 1;
                self.ready[lane].pop_front()?
            }
        };
        self.ready_bytes -= e.body_len();
        Some(e)
    }

    fn drop_entry(&mut self, e: &Entry) {
        self.account(-(e.message.size() as i64));
        if e.on_disk != OnDisk::No {
            self.record(IndexOp::Ack {
                seq: e.seq,
                message_id: e.message.id,
                size: e.message.size() as usize,
                persistent: e.on_disk == OnDisk::Persistent,
            });
        }
    }

    /// Records an index operation for the syncer; returns its group-commit ticket (0 when
    /// the queue is not persistent).
    fn record(&mut self, op: IndexOp) -> u64 {
        let Some(p) = self.persist.as_mut() else {
            return 0;
        };
        let Some(me) = self.me.upgrade() else {
            return 0;
        };
        let newly_dirty = !p.dirty;
        p.dirty = true;
        let t = p.durability.ticket(&me, newly_dirty);
        p.pending.push(op);
        p.pending_ticket = t;
        self.has_index = true;
        t
    }

    /// Takes the operations waiting for the syncer, and the highest ticket among them (a
    /// round that fails must refuse every ticket it drained, including those issued after
    /// the round read the highest ticket issued).
    pub fn take_pending_ops(&mut self) -> (Vec<IndexOp>, u64) {
        match self.persist.as_mut() {
            Some(p) => {
                p.dirty = false;
                (std::mem::take(&mut p.pending), p.pending_ticket)
            }
            None => (Vec::new(), 0),
        }
    }

    /// Whether the queue holds in RAM a message that is not in its persistent index: a
    /// transient one published before the queue became mirrored. A mirror's sync copies
    /// the index, so no mirror is synchronised while one is left (those paged out, to the
    /// transient index, storage counts: `Storage::transient_len`). A walk over the queue's
    /// RAM: for a master with a sync to complete, not for hot paths.
    pub fn holds_unindexed(&self) -> bool {
        let unindexed = |e: &Entry| e.on_disk != OnDisk::Persistent;
        self.ready.iter().flatten().any(unindexed)
            || self.returned.values().any(unindexed)
            || self.q1.iter().any(unindexed)
            || self.unacked.values().any(|u| unindexed(&u.entry))
    }

    /// A mirrored queue (durable or not, never exclusive) records every message in its
    /// persistent index: that record is what its mirrors get. Transient messages (every
    /// message of a non-durable queue) are recorded as such, and dropped at a restart.
    fn records_every_message(&self) -> bool {
        self.args.mirrored && self.exclusive_owner.is_none() && self.persist.is_some()
    }

    /// Whether persistent messages of this queue go to disk and survive restarts.
    pub fn is_durable(&self) -> bool {
        self.persist.as_ref().is_some_and(|p| p.durable)
    }

    /// Sets (or with `None` lifts) the master's lease: past it, nothing is delivered or
    /// got until it is renewed. A master cut off from the quorum stops handing out
    /// messages before a mirror can be promoted, so two copies never serve at once.
    pub fn set_lease(&mut self, until: Option<Instant>) {
        self.lease_until = until;
    }

    fn leased(&self, now: Instant) -> bool {
        self.lease_until.is_none_or(|t| now < t)
    }

    /// Every message restored so far may have been delivered without a record of it (the
    /// copy was recovered after an unclean stop, or a mirror's copy is being promoted: a
    /// delivery is recorded in the round after it goes out). They will all leave flagged
    /// `redelivered`, so a consumer never gets a second copy of a message unflagged.
    pub fn mark_restored_suspect(&mut self) {
        self.suspect_below = self.next_seq;
    }

    /// Messages below seq `below` leave flagged `redelivered` (a bound storage kept from an
    /// earlier run, see [`mark_restored_suspect`](Self::mark_restored_suspect)).
    pub fn mark_suspect_below(&mut self, below: u64) {
        self.suspect_below = self.suspect_below.max(below);
    }

    /// Messages below this seq leave flagged `redelivered` (0: none).
    pub fn suspect_below(&self) -> u64 {
        self.suspect_below
    }

    /// Puts back messages recovered from disk (in sequence order), without recording them.
    /// `rest` are more recovered messages left on disk after these (read back as delta);
    /// `next_seq` is the index's next seq, which new messages must not go below.
    pub fn restore(&mut self, entries: Vec<Entry>, rest: Option<paging::Delta>, next_seq: u64) {
        self.next_seq = self.next_seq.max(next_seq);
        // Storage opened this queue's index: deleting the queue must remove it, even empty.
        self.has_index = true;
        if entries.is_empty() && rest.is_none() {
            return;
        }
        if let Some(d) = rest.filter(|d| d.count > 0) {
            self.next_seq = self.next_seq.max(d.end);
            self.delta = Some(d);
        }
        for e in entries {
            self.next_seq = self.next_seq.max(e.seq + 1);
            self.account(e.message.size() as i64);
            self.ready_bytes += e.body_len();
            self.ready_len += 1;
            let lane = (e.priority as usize).min(self.ready.len() - 1);
            self.ready[lane].push_back(e);
        }
    }

    /// Drops expired messages at the head (RabbitMQ expires from the head only).
    fn expire_head(&mut self, now: Instant, dead: &mut Vec<DeadLetter>) {
        self.expire_head_from(now, false, dead);
    }

    fn expire_head_from(&mut self, now: Instant, at_expiry: bool, dead: &mut Vec<DeadLetter>) {
        self.fill_front();
        while self.peek_next().is_some_and(|e| e.expired(now, at_expiry)) {
            if let Some(e) = self.pop_next() {
                self.dead_letter(e, DeathReason::Expired, dead);
            }
        }
    }

    /// Drops `e` from the queue towards the dead-letter exchange, if the queue has one;
    /// its index ack is then held by the letter, not recorded.
    fn dead_letter(&mut self, e: Entry, reason: DeathReason, dead: &mut Vec<DeadLetter>) {
        if self.args.dead_letter_exchange.is_none() {
            self.drop_entry(&e);
            return;
        }
        self.account(-(e.message.size() as i64));
        let held = (e.on_disk != OnDisk::No).then(|| HeldAck {
            seq: e.seq,
            message_id: e.message.id,
            size: e.message.size() as usize,
            persistent: e.on_disk == OnDisk::Persistent,
        });
        dead.push(DeadLetter {
            message: e.message,
            reason,
            held,
        });
    }

    /// Records the ack a dead letter held, now that the letter is where it goes (or has
    /// nowhere to go). A deleted queue's index is gone already.
    pub fn release_letter(&mut self, held: HeldAck) {
        if self.deleted {
            return;
        }
        self.record(IndexOp::Ack {
            seq: held.seq,
            message_id: held.message_id,
            size: held.size,
            persistent: held.persistent,
        });
    }

    /// Enqueues a message and delivers what consumers can take.
    pub fn publish(
        &mut self,
        me: &Arc<QueueHandle>,
        message: Arc<Message>,
        now: Instant,
    ) -> PublishResult {
        let mut result = PublishResult::default();
        if self.deleted {
            return result;
        }
        self.expire_head(now, &mut result.dead);
        let len = self.message_count() as u64;
        let body = message.body.len() as u64;
        if self.over_limit(1, body) {
            match self.args.overflow {
                Overflow::RejectPublish | Overflow::RejectPublishDlx => {
                    if self.args.overflow == Overflow::RejectPublishDlx {
                        // Never enqueued: nothing on disk to hold.
                        result.dead.push(DeadLetter {
                            message,
                            reason: DeathReason::Maxlen,
                            held: None,
                        });
                    }
                    return result;
                }
                Overflow::DropHead => {
                    // Make room from the head; a zero limit means the message itself goes
                    // unless a consumer takes it right now.
                    while len > 0 && self.over_limit(1, body) {
                        let Some(e) = self.pop_next() else { break };
                        self.dead_letter(e, DeathReason::Maxlen, &mut result.dead);
                    }
                }
            }
        }
        let ttl = match (self.args.message_ttl_ms, message.expiration_ms()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let priority = self
            .args
            .max_priority
            .map_or(0, |max| message.priority().min(max));
        let mut entry = Entry {
            priority,
            seq: self.next_seq,
            expires_at_ms: ttl.map_or(u64::MAX, |t| now.as_millis().saturating_add(t)),
            message,
            redelivered: false,
            on_disk: OnDisk::No,
            beta: None,
        };
        self.next_seq += 1;
        self.account(entry.message.size() as i64);
        self.ready_bytes += body;
        if (self.is_durable() && entry.message.persistent()) || self.records_every_message() {
            entry.on_disk = OnDisk::Persistent;
            result.ticket = self.record(IndexOp::Publish {
                seq: entry.seq,
                message: entry.message.clone(),
                expires_at_ms: entry.expires_at_ms,
                persistent: true,
            });
        }
        if self.delta.is_some() {
            // Behind messages that are on disk: order is kept by waiting in q1.
            self.q1.push_back(entry);
        } else {
            self.ready_len += 1;
            self.ready[entry.priority as usize].push_back(entry);
        }
        result.accepted = true;
        self.deliver(me, now, &mut result.dead);
        // What no consumer took and expires now goes now, as RabbitMQ's
        // `drop_expired_msgs` after a publish drops a TTL 0 message (its clock is finer:
        // the same millisecond is already past). A basic.get must not find it.
        self.expire_head_from(now, true, &mut result.dead);
        // A message that still exceeds a zero-length limit after delivery is dropped.
        if self.args.overflow == Overflow::DropHead {
            self.drop_over_limit(&mut result.dead);
        }
        self.page();
        result
    }

    /// Whether `extra_len` more messages of `extra_bytes` would exceed a length limit.
    fn over_limit(&self, extra_len: u64, extra_bytes: u64) -> bool {
        self.args
            .max_length
            .is_some_and(|m| self.message_count() as u64 + extra_len > m)
            || self
                .args
                .max_length_bytes
                .is_some_and(|m| self.ready_bytes + self.paged_bytes() + extra_bytes > m)
    }

    /// Drops (and dead-letters) from the head while the queue exceeds its limits.
    fn drop_over_limit(&mut self, dead: &mut Vec<DeadLetter>) {
        while self.over_limit(0, 0) {
            let Some(e) = self.pop_next() else { break };
            self.dead_letter(e, DeathReason::Maxlen, dead);
        }
    }

    fn pick_consumer(&mut self) -> Option<usize> {
        let n = self.consumers.len();
        if n == 0 {
            return None;
        }
        if self.args.single_active_consumer {
            return self.consumers[0].can_take().then_some(0);
        }
        let mut best: Option<(usize, i32)> = None;
        for i in 0..n {
            let idx = (self.next_consumer + i) % n;
            let c = &self.consumers[idx];
            if best.is_some_and(|(_, p)| c.priority <= p) {
                continue;
            }
            if c.can_take() {
                best = Some((idx, c.priority));
            }
        }
        let (idx, _) = best?;
        self.next_consumer = (idx + 1) % n;
        Some(idx)
    }

    /// Delivers to consumers while messages and credit last.
    pub fn deliver(&mut self, me: &Arc<QueueHandle>, now: Instant, dead: &mut Vec<DeadLetter>) {
        if !self.leased(now) {
            return;
        }
        loop {
            self.expire_head(now, dead);
            if self.peek_next().is_none() {
                return;
            }
            let Some(idx) = self.pick_consumer() else {
                return;
            };
            let c = &self.consumers[idx];
            if !c.link.outbox.has_room() {
                c.link.outbox.stall(me);
                // Other consumers may still have room; try them before giving up.
                if !self
                    .consumers
                    .iter()
                    .any(|c| c.can_take() && c.link.outbox.has_room())
                {
                    return;
                }
                continue;
            }
            let counts_global = !c.no_ack && c.link.try_acquire_global();
            if !c.no_ack && !counts_global {
                return;
            }
            let Some(entry) = self.pop_next() else { return };
            let c = &self.consumers[idx];
            let delivery = Delivery {
                channel: c.link.channel,
                consumer_tag: c.tag.clone(),
                queue: super::remote::QueueRef::Local(me.clone()),
                seq: entry.seq,
                message: entry.message.clone(),
                redelivered: entry.redelivered,
                ack_required: !c.no_ack,
            };
            let no_ack = c.no_ack;
            if no_ack {
                self.drop_entry(&entry);
            } else {
                // Only persistent messages come back after a restart, redelivered.
                if entry.on_disk == OnDisk::Persistent {
                    self.record(IndexOp::Deliver { seq: entry.seq });
                }
                let c = &self.consumers[idx];
                c.in_flight.fetch_add(1, Ordering::AcqRel);
                self.unacked.insert(
                    entry.seq,
                    Unacked {
                        entry,
                        consumer_in_flight: Some(c.in_flight.clone()),
                        global: Some(c.link.clone()),
                    },
                );
            }
            self.last_used = now;
            let c = &self.consumers[idx];
            if let Err(OutItem::Deliver(d)) = c.link.outbox.push(OutItem::Deliver(delivery)) {
                // The connection closed under us: put the message back.
                self.settle(me, &[d.seq], true, now, dead);
            }
        }
    }

    /// basic.get: takes the next message. `ack_required` keeps it unacknowledged.
    pub fn get(
        &mut self,
        now: Instant,
        ack_required: bool,
        dead: &mut Vec<DeadLetter>,
    ) -> Option<(Entry, u32)> {
        self.last_used = now;
        if !self.leased(now) {
            return None;
        }
        self.expire_head(now, dead);
        let entry = self.pop_next()?;
        if ack_required {
            if entry.on_disk == OnDisk::Persistent {
                self.record(IndexOp::Deliver { seq: entry.seq });
            }
            self.unacked.insert(
                entry.seq,
                Unacked {
                    entry: entry.clone(),
                    consumer_in_flight: None,
                    global: None,
                },
            );
        } else {
            self.drop_entry(&entry);
        }
        Some((entry, self.message_count()))
    }

    fn release(&mut self, seq: u64) -> Option<Entry> {
        let u = self.unacked.remove(&seq)?;
        if let Some(c) = u.consumer_in_flight {
            let _ = c.fetch_update(Ordering::AcqRel, Ordering::Acquire, |x| {
                Some(x.saturating_sub(1))
            });
        }
        if let Some(link) = u.global {
            link.release_global(1);
        }
        Some(u.entry)
    }

    /// basic.ack: forgets the messages and delivers more (credit came back).
    pub fn ack(
        &mut self,
        me: &Arc<QueueHandle>,
        seqs: &[u64],
        now: Instant,
        dead: &mut Vec<DeadLetter>,
    ) {
        for &seq in seqs {
            if let Some(e) = self.release(seq) {
                self.drop_entry(&e);
            }
        }
        self.deliver(me, now, dead);
    }

    /// basic.nack / basic.reject / requeue on close: back to their place with
    /// `redelivered`, or dropped (dead-lettered when the queue has a DLX).
    pub fn settle(
        &mut self,
        me: &Arc<QueueHandle>,
        seqs: &[u64],
        requeue: bool,
        now: Instant,
        dead: &mut Vec<DeadLetter>,
    ) {
        for &seq in seqs {
            let Some(mut e) = self.release(seq) else {
                continue;
            };
            if requeue && !self.deleted {
                e.redelivered = true;
                self.ready_bytes += e.message.body.len() as u64;
                self.returned.insert((Reverse(e.priority), e.seq), e);
            } else {
                self.dead_letter(e, DeathReason::Rejected, dead);
            }
        }
        self.deliver(me, now, dead);
    }

    /// Whether a consumer (exclusive or not) may attach now: 403 when exclusivity forbids it.
    pub fn check_new_consumer(&self, me: &QueueHandle, exclusive: bool) -> Result<(), AmqpError> {
        if self.consumers.iter().any(|c| c.exclusive) || (exclusive && !self.consumers.is_empty()) {
            return Err(access_refused(format!(
                "queue '{}' in vhost '{}' in exclusive use",
                me.name, me.vhost
            )));
        }
        Ok(())
    }

    /// basic.consume: attaches a consumer (after [`Queue::check_new_consumer`]) and delivers.
    pub fn add_consumer(
        &mut self,
        me: &Arc<QueueHandle>,
        consumer: Consumer,
        now: Instant,
    ) -> Vec<DeadLetter> {
        self.consumers.push(consumer);
        self.had_consumer = true;
        self.last_used = now;
        let mut dead = Vec::new();
        self.deliver(me, now, &mut dead);
        dead
    }

    /// Removes consumers matching `pred`; returns whether the queue should now auto-delete.
    pub fn remove_consumers(
        &mut self,
        now: Instant,
        mut pred: impl FnMut(&Consumer) -> bool,
    ) -> bool {
        let before = self.consumers.len();
        self.consumers.retain(|c| !pred(c));
        if self.consumers.len() != before {
            self.next_consumer = 0;
            self.last_used = now;
        }
        self.auto_delete && self.had_consumer && self.consumers.is_empty() && !self.deleted
    }

    /// queue.purge: drops ready messages (not unacknowledged ones); returns how many.
    pub fn purge(&mut self) -> u32 {
        let n = self.message_count();
        while let Some(e) = self.pop_raw() {
            self.drop_entry(&e);
        }
        n
    }

    /// Marks the queue deleted, cancels its consumers; returns the ready count it had.
    pub fn delete(&mut self, me: &Arc<QueueHandle>) -> u32 {
        self.close(me, |channel, consumer_tag| OutItem::Cancel {
            channel,
            consumer_tag,
        })
    }

    /// The queue moved to another node (a mirror promoted, or a planned move): this node's
    /// copy goes as at a delete, but its consumers are told to follow the queue
    /// ([`OutItem::Rehome`]: their channel consumes again, through the relay, from the new
    /// master), as RabbitMQ's consumers stay subscribed across a failover.
    pub fn move_away(&mut self, me: &Arc<QueueHandle>) -> u32 {
        self.close(me, |channel, consumer_tag| OutItem::Rehome {
            channel,
            consumer_tag,
        })
    }

    fn close(&mut self, _me: &Arc<QueueHandle>, tell: impl Fn(u16, Arc<str>) -> OutItem) -> u32 {
        let n = self.message_count();
        // What is only on disk goes with the index, unread.
        self.delta = None;
        self.page_out = None;
        for e in std::mem::take(&mut self.q1) {
            self.ready_bytes -= e.body_len();
            self.account(-(e.message.size() as i64));
        }
        self.purge();
        // The index goes as a whole: the acks purge recorded are moot, only the deletion counts.
        if let Some(p) = self.persist.as_mut() {
            p.pending.retain(|op| !matches!(op, IndexOp::Ack { .. }));
        }
        if self.has_index {
            self.record(IndexOp::DeleteQueue);
        }
        for (_, u) in self.unacked.drain() {
            self.memory
                .fetch_sub(u.entry.message.size() as i64, Ordering::Relaxed);
            if let Some(link) = u.global {
                link.release_global(1);
            }
        }
        for c in self.consumers.drain(..) {
            let _ = c.link.outbox.push(tell(c.link.channel, c.tag.clone()));
        }
        self.deleted = true;
        n
    }

    /// Whether `x-expires` has passed with no consumers and no use.
    pub fn is_expired(&self, now: Instant) -> bool {
        match self.args.expires_ms {
            Some(ms) => self.consumers.is_empty() && now.millis_since(self.last_used) >= ms,
            None => false,
        }
    }

    /// Periodic work: finish or start paging, expire messages at the head, deliver.
    pub fn tick(&mut self, me: &Arc<QueueHandle>, now: Instant, dead: &mut Vec<DeadLetter>) {
        self.page();
        self.deliver(me, now, dead);
    }

    /// Marks a queue as used now (declare, get).
    pub fn touch(&mut self, now: Instant) {
        self.last_used = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::outbox::Outbox;
    use amq_protocol::protocol::basic::AMQPProperties;
    use bytes::Bytes;

    fn msg(body: &str) -> Arc<Message> {
        Arc::new(Message {
            id: 7,
            exchange: String::new(),
            routing_key: "q".into(),
            properties_raw: Bytes::from_static(&[0, 0]),
            properties: AMQPProperties::default(),
            body: Bytes::copy_from_slice(body.as_bytes()),
        })
    }

    fn queue(args: QueueArgs) -> (Arc<QueueHandle>, Arc<AtomicI64>) {
        let memory = Arc::new(AtomicI64::new(0));
        let q = Queue::new(args, None, false, memory.clone(), Instant::from_millis(0));
        (QueueHandle::new("/", "q", q), memory)
    }

    fn consumer(link: &Arc<ChannelLink>, tag: &str, prefetch: u32) -> Consumer {
        Consumer {
            tag: Arc::from(tag),
            link: link.clone(),
            no_ack: false,
            prefetch,
            priority: 0,
            exclusive: false,
            in_flight: Arc::new(AtomicU32::new(0)),
        }
    }

    fn drain(outbox: &Outbox) -> Vec<(String, String, bool, u64)> {
        let mut items = Vec::new();
        outbox.drain(&mut items);
        items
            .into_iter()
            .filter_map(|i| match i {
                OutItem::Deliver(d) => Some((
                    d.consumer_tag.to_string(),
                    String::from_utf8_lossy(&d.message.body).into_owned(),
                    d.redelivered,
                    d.seq,
                )),
                OutItem::Cancel { .. }
                | OutItem::Rehome { .. }
                | OutItem::Close { .. }
                | OutItem::Reply { .. } => None,
            })
            .collect()
    }

    fn now() -> Instant {
        Instant::from_millis(1)
    }

    #[test]
    fn a_master_past_its_lease_hands_out_nothing_until_it_is_renewed() {
        let (h, _) = queue(QueueArgs::default());
        let outbox = Arc::new(Outbox::new(1 << 20, Box::new(|| {})));
        let link = Arc::new(ChannelLink::new(1, 1, outbox.clone()));
        let at = Instant::from_millis;
        h.lock().set_lease(Some(at(100)));
        let mut dead = Vec::new();
        h.lock().publish(&h, msg("m1"), at(10));
        let (e, _) = h
            .lock()
            .get(at(99), true, &mut dead)
            .expect("within the lease");
        assert_eq!(&e.message.body[..], b"m1");
        h.lock().publish(&h, msg("m2"), at(100));
        assert!(
            h.lock().get(at(100), true, &mut dead).is_none(),
            "basic.get past the lease"
        );
        h.lock().add_consumer(&h, consumer(&link, "c", 0), at(150));
        h.lock().deliver(&h, at(150), &mut dead);
        assert!(drain(&outbox).is_empty(), "a delivery past the lease");
        h.lock().set_lease(Some(at(400)));
        h.lock().deliver(&h, at(200), &mut dead);
        assert_eq!(
            drain(&outbox).into_iter().map(|d| d.1).collect::<Vec<_>>(),
            ["m2"],
            "renewed: the waiting consumer gets it"
        );
        // Lifted (no mirror left): no lease needed.
        h.lock().set_lease(None);
        h.lock().publish(&h, msg("m3"), at(10_000));
        assert_eq!(drain(&outbox).len(), 1);
    }

    #[test]
    fn messages_restored_as_suspect_leave_flagged_redelivered() {
        let (h, _) = queue(QueueArgs::default());
        let mut dead = Vec::new();
        for b in ["m1", "m2"] {
            h.lock().publish(&h, msg(b), now());
        }
        // As storage does for a copy recovered after an unclean stop, or being promoted.
        h.lock().mark_restored_suspect();
        h.lock().publish(&h, msg("m3"), now());
        let flags: Vec<bool> = (0..3)
            .map(|_| {
                h.lock()
                    .get(now(), false, &mut dead)
                    .expect("a message")
                    .0
                    .redelivered
            })
            .collect();
        assert_eq!(flags, [true, true, false], "only what was there before");
    }

    #[test]
    fn requeued_message_returns_to_its_place_with_redelivered() {
        let (h, _) = queue(QueueArgs::default());
        for b in ["m1", "m2", "m3"] {
            h.lock().publish(&h, msg(b), now());
        }
        let mut dead = Vec::new();
        let (e1, left) = h.lock().get(now(), true, &mut dead).unwrap();
        assert_eq!((&e1.message.body[..], left), (&b"m1"[..], 2));
        h.lock().settle(&h, &[e1.seq], true, now(), &mut dead);
        let (again, _) = h.lock().get(now(), true, &mut dead).unwrap();
        assert_eq!(&again.message.body[..], b"m1");
        assert!(again.redelivered);
        let (next, _) = h.lock().get(now(), true, &mut dead).unwrap();
        assert_eq!(&next.message.body[..], b"m2");
        assert!(!next.redelivered);
    }

    #[test]
    fn round_robin_within_prefetch() {
        let (h, _) = queue(QueueArgs::default());
        let outbox = Arc::new(Outbox::new(1 << 20, Box::new(|| {})));
        let link = Arc::new(ChannelLink::new(1, 1, outbox.clone()));
        h.lock().add_consumer(&h, consumer(&link, "a", 2), now());
        h.lock().add_consumer(&h, consumer(&link, "b", 2), now());
        for i in 0..6 {
            h.lock().publish(&h, msg(&format!("m{i}")), now());
        }
        let got = drain(&outbox);
        let tags: Vec<&str> = got.iter().map(|g| g.0.as_str()).collect();
        assert_eq!(tags, ["a", "b", "a", "b"], "prefetch 2 each");
        assert_eq!(h.lock().message_count(), 2);
        let mut dead = Vec::new();
        h.lock().ack(&h, &[got[0].3], now(), &mut dead);
        let more = drain(&outbox);
        assert_eq!(more.len(), 1);
        assert_eq!(more[0].0, "a");
        assert_eq!(more[0].1, "m4");
    }

    #[test]
    fn global_prefetch_is_shared_by_the_channel() {
        let (h, _) = queue(QueueArgs::default());
        let outbox = Arc::new(Outbox::new(1 << 20, Box::new(|| {})));
        let link = Arc::new(ChannelLink::new(1, 1, outbox.clone()));
        link.global_prefetch.store(3, Ordering::Release);
        h.lock().add_consumer(&h, consumer(&link, "a", 0), now());
        h.lock().add_consumer(&h, consumer(&link, "b", 0), now());
        for i in 0..10 {
            h.lock().publish(&h, msg(&format!("m{i}")), now());
        }
        assert_eq!(drain(&outbox).len(), 3);
    }

    #[test]
    fn full_outbox_stalls_the_queue_until_released() {
        let (h, _) = queue(QueueArgs::default());
        let outbox = Arc::new(Outbox::new(200, Box::new(|| {})));
        let link = Arc::new(ChannelLink::new(1, 1, outbox.clone()));
        h.lock().add_consumer(&h, consumer(&link, "a", 0), now());
        for i in 0..10 {
            h.lock().publish(&h, msg(&format!("m{i}")), now());
        }
        let first = drain(&outbox);
        assert!(first.len() < 10 && !first.is_empty(), "{}", first.len());
        assert_eq!(h.lock().message_count() as usize, 10 - first.len());
        let stalled = outbox.release(10_000);
        assert_eq!(stalled.len(), 1, "the queue registered itself as stalled");
        let mut dead = Vec::new();
        stalled[0].lock().deliver(&stalled[0], now(), &mut dead);
        assert!(!drain(&outbox).is_empty());
    }

    #[test]
    fn max_length_drop_head_and_reject_publish() {
        let (h, _) = queue(QueueArgs {
            max_length: Some(2),
            ..QueueArgs::default()
        });
        for b in ["a", "b", "c"] {
            assert!(h.lock().publish(&h, msg(b), now()).accepted);
        }
        let mut dead = Vec::new();
        let (e, _) = h.lock().get(now(), false, &mut dead).unwrap();
        assert_eq!(&e.message.body[..], b"b", "the head was dropped");

        let (h, _) = queue(QueueArgs {
            max_length: Some(1),
            overflow: Overflow::RejectPublish,
            ..QueueArgs::default()
        });
        assert!(h.lock().publish(&h, msg("a"), now()).accepted);
        assert!(!h.lock().publish(&h, msg("b"), now()).accepted);
        assert_eq!(h.lock().message_count(), 1);
    }

    #[test]
    fn ttl_expires_from_the_head_and_dead_letters() {
        let (h, memory) = queue(QueueArgs {
            message_ttl_ms: Some(10),
            dead_letter_exchange: Some("dlx".into()),
            ..QueueArgs::default()
        });
        h.lock().publish(&h, msg("a"), Instant::from_millis(0));
        assert!(memory.load(Ordering::Relaxed) > 0);
        let mut dead = Vec::new();
        h.lock().tick(&h, Instant::from_millis(5), &mut dead);
        assert_eq!(h.lock().message_count(), 1);
        h.lock().tick(&h, Instant::from_millis(11), &mut dead);
        assert_eq!(h.lock().message_count(), 0);
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].reason, DeathReason::Expired);
        assert_eq!(
            memory.load(Ordering::Relaxed),
            0,
            "memory accounting returns to zero"
        );
    }

    /// A durable queue with a dead-letter exchange, recording its index operations.
    fn durable_queue(args: QueueArgs) -> Arc<QueueHandle> {
        let q = Queue::new(
            args,
            None,
            false,
            Arc::new(AtomicI64::new(0)),
            Instant::from_millis(0),
        )
        .with_persistence(
            Arc::new(crate::broker::Durability::default()),
            true,
            PagingConfig {
                threshold: u64::MAX,
                keep_entries: 2048,
                embed_below: 4096,
            },
        );
        QueueHandle::new("/", "q", q)
    }

    fn persistent(body: &str) -> Arc<Message> {
        let mut m = (*msg(body)).clone();
        m.properties = m.properties.with_delivery_mode(2);
        Arc::new(m)
    }

    fn acks(ops: &[IndexOp]) -> Vec<u64> {
        ops.iter()
            .filter_map(|op| match op {
                IndexOp::Ack { seq, .. } => Some(*seq),
                _ => None,
            })
            .collect()
    }

    /// A dead letter holds its message's index ack until it is released: a node that
    /// stops first finds the message in the queue again (at least once).
    #[test]
    fn a_dead_letter_holds_its_index_ack_until_released() {
        let h = durable_queue(QueueArgs {
            dead_letter_exchange: Some("dlx".into()),
            ..QueueArgs::default()
        });
        h.lock().publish(&h, persistent("a"), now());
        let mut dead = Vec::new();
        let (e, _) = h.lock().get(now(), true, &mut dead).expect("a");
        h.lock().settle(&h, &[e.seq], false, now(), &mut dead);
        assert_eq!(dead.len(), 1);
        let held = dead[0].held.clone().expect("on disk: its ack is held");
        let (ops, _) = h.lock().take_pending_ops();
        assert_eq!(
            acks(&ops),
            Vec::<u64>::new(),
            "no ack while the letter is out"
        );
        assert_eq!(h.lock().message_count(), 0);
        h.lock().release_letter(held.clone());
        let (ops, _) = h.lock().take_pending_ops();
        assert_eq!(acks(&ops), vec![e.seq], "released: acked");

        // A deleted queue's index is gone: nothing to record.
        h.lock().delete(&h);
        let _ = h.lock().take_pending_ops();
        h.lock().release_letter(held);
        let (ops, _) = h.lock().take_pending_ops();
        assert!(ops.is_empty(), "{ops:?}");
    }

    /// Without a dead-letter exchange a dropped message is acked at once; a message
    /// rejected at the limit (`reject-publish-dlx`) never had a record, so holds none.
    #[test]
    fn only_dead_letters_of_recorded_messages_hold_an_ack() {
        let h = durable_queue(QueueArgs {
            max_length: Some(1),
            ..QueueArgs::default()
        });
        h.lock().publish(&h, persistent("a"), now());
        h.lock().publish(&h, persistent("b"), now());
        let (ops, _) = h.lock().take_pending_ops();
        assert_eq!(acks(&ops), vec![0], "the head dropped with no DLX: acked");

        let h = durable_queue(QueueArgs {
            max_length: Some(1),
            overflow: Overflow::RejectPublishDlx,
            dead_letter_exchange: Some("dlx".into()),
            ..QueueArgs::default()
        });
        h.lock().publish(&h, persistent("a"), now());
        let r = h.lock().publish(&h, persistent("b"), now());
        assert!(!r.accepted);
        assert_eq!(r.dead.len(), 1);
        assert_eq!(r.dead[0].held, None);
    }

    /// RabbitMQ drops a TTL 0 message no consumer took at its publish: a basic.get in the
    /// same millisecond must not find it.
    #[test]
    fn a_ttl_zero_message_no_consumer_takes_is_gone_at_once() {
        let (h, _) = queue(QueueArgs {
            message_ttl_ms: Some(0),
            dead_letter_exchange: Some("dlx".into()),
            ..QueueArgs::default()
        });
        let now = Instant::from_millis(7);
        let r = h.lock().publish(&h, msg("a"), now);
        assert!(r.accepted);
        assert_eq!(r.dead.len(), 1, "dead-lettered as expired");
        let mut dead = Vec::new();
        assert!(h.lock().get(now, true, &mut dead).is_none());
        assert_eq!(h.lock().message_count(), 0);
    }

    fn msg_with_priority(body: &str, p: u8) -> Arc<Message> {
        let props = AMQPProperties::default().with_priority(p);
        Arc::new(Message {
            id: 7,
            exchange: String::new(),
            routing_key: "q".into(),
            properties_raw: Bytes::from(crate::amqp::frame::encode_properties(&props)),
            properties: props,
            body: Bytes::copy_from_slice(body.as_bytes()),
        })
    }

    #[test]
    fn priority_queue_serves_higher_priorities_first_and_fifo_within() {
        let (h, _) = queue(QueueArgs {
            max_priority: Some(5),
            ..QueueArgs::default()
        });
        for (b, p) in [("a0", 0), ("b3", 3), ("c9", 9), ("d3", 3), ("e1", 1)] {
            h.lock().publish(&h, msg_with_priority(b, p), now());
        }
        let mut dead = Vec::new();
        let mut order = Vec::new();
        let mut first = None;
        while let Some((e, _)) = h.lock().get(now(), true, &mut dead) {
            order.push(String::from_utf8_lossy(&e.message.body).into_owned());
            first.get_or_insert(e.seq);
        }
        // 9 is capped at the queue's maximum (5): still the highest.
        assert_eq!(order, ["c9", "b3", "d3", "e1", "a0"]);
        // A requeued top-priority message comes back before lower ones.
        h.lock().publish(&h, msg_with_priority("f0", 0), now());
        h.lock()
            .settle(&h, &[first.unwrap()], true, now(), &mut dead);
        let (e, _) = h.lock().get(now(), true, &mut dead).unwrap();
        assert_eq!(&e.message.body[..], b"c9");
        assert!(e.redelivered);
    }

    #[test]
    fn exclusive_consumer_refuses_others() {
        let (h, _) = queue(QueueArgs::default());
        let outbox = Arc::new(Outbox::new(1 << 20, Box::new(|| {})));
        let link = Arc::new(ChannelLink::new(1, 1, outbox));
        let mut c = consumer(&link, "a", 0);
        c.exclusive = true;
        h.lock().check_new_consumer(&h, true).unwrap();
        h.lock().add_consumer(&h, c, now());
        let err = h.lock().check_new_consumer(&h, false).unwrap_err();
        assert_eq!(err.code, crate::amqp::ReplyCode::AccessRefused);
    }
}
