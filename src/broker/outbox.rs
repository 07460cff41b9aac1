//! The hand-off from queues to a consumer's connection, and the credit that bounds it.
//!
//! Queues push deliveries into the consumer connection's [`Outbox`]; the connection drains it,
//! assigns delivery tags and encodes frames. An outbox holding more than `bytes_max` refuses
//! new deliveries: the queue keeps the messages and registers itself as stalled, and the
//! connection pokes stalled queues once its socket has drained. So a slow consumer costs
//! queue memory (bounded by the memory watermark), never unbounded socket buffers.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::message::Message;
use super::queue::QueueHandle;

/// A delivery on its way to a consumer.
#[derive(Debug)]
pub struct Delivery {
    /// Channel of the consumer.
    pub channel: u16,
    /// Consumer tag.
    pub consumer_tag: Arc<str>,
    /// The queue it comes from (acks go back there).
    pub queue: super::remote::QueueRef,
    /// The queue's sequence number for the message.
    pub seq: u64,
    /// The message.
    pub message: Arc<Message>,
    /// Whether it was delivered before.
    pub redelivered: bool,
    /// Whether the consumer acknowledges (false: settled on send).
    pub ack_required: bool,
}

/// Items a connection receives from queues.
#[derive(Debug)]
pub enum OutItem {
    /// A message for a consumer.
    Deliver(Delivery),
    /// A reply for the channel's direct reply-to consumer ([`super::direct_reply`]): no
    /// queue, no acknowledgement. The channel delivers it only while `key` is still its
    /// reply consumer's.
    Reply {
        /// Channel.
        channel: u16,
        /// The key of the reply name it was published to.
        key: super::direct_reply::ReplyKey,
        /// The message.
        message: Arc<Message>,
    },
    /// The broker cancelled a consumer (its queue was deleted).
    Cancel {
        /// Channel.
        channel: u16,
        /// Consumer tag.
        consumer_tag: Arc<str>,
    },
    /// A mirrored queue this channel consumes from failed over to a new master: the
    /// consumer attaches there (RabbitMQ keeps such consumers subscribed).
    Rehome {
        /// Channel.
        channel: u16,
        /// Consumer tag.
        consumer_tag: Arc<str>,
    },
    /// An operator closed the connection (the management API's `DELETE
    /// /api/connections/{name}`): it closes with 320 `CONNECTION_FORCED` and this text.
    Close {
        /// The reply text after `CONNECTION_FORCED - `.
        reason: String,
    },
}

#[derive(Default)]
struct Inner {
    items: VecDeque<OutItem>,
    bytes: usize,
    stalled: Vec<Weak<QueueHandle>>,
    closed: bool,
}

/// A connection's inbound queue of deliveries.
pub struct Outbox {
    inner: Mutex<Inner>,
    wake: Box<dyn Fn() + Send + Sync>,
    bytes_max: usize,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("bytes_max", &self.bytes_max)
            .finish()
    }
}

impl Outbox {
    /// An outbox that calls `wake` when it goes from empty to non-empty.
    pub fn new(bytes_max: usize, wake: Box<dyn Fn() + Send + Sync>) -> Outbox {
        Outbox {
            inner: Mutex::new(Inner::default()),
            wake,
            bytes_max,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding this lock cannot leave it inconsistent (plain pushes/pops).
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes the connection (e.g. its confirms became durable).
    pub fn wake(&self) {
        (self.wake)();
    }

    /// Whether a queue may push another delivery now.
    pub fn has_room(&self) -> bool {
        let g = self.lock();
        !g.closed && g.bytes < self.bytes_max
    }

    /// Records that `queue` stopped delivering here for lack of room.
    pub fn stall(&self, queue: &Arc<QueueHandle>) {
        let mut g = self.lock();
        if !g.stalled.iter().any(|w| w.as_ptr() == Arc::as_ptr(queue)) {
            g.stalled.push(Arc::downgrade(queue));
        }
    }

    /// Pushes an item; returns false (and drops nothing) when the outbox is closed.
    pub fn push(&self, item: OutItem) -> Result<(), OutItem> {
        let was_empty;
        {
            let mut g = self.lock();
            if g.closed {
                return Err(item);
            }
            // Replies count against the credit too, so queues wait behind a flood of them;
            // they are never refused for it (RabbitMQ drops no reply for a slow consumer).
            match &item {
                OutItem::Deliver(d) => g.bytes += d.message.size() as usize,
                OutItem::Reply { message, .. } => g.bytes += message.size() as usize,
                _ => {}
            }
            was_empty = g.items.is_empty();
            g.items.push_back(item);
        }
        if was_empty {
            (self.wake)();
        }
        Ok(())
    }

    /// Takes every pending item.
    pub fn drain(&self, into: &mut Vec<OutItem>) {
        let mut g = self.lock();
        into.extend(g.items.drain(..));
    }

    /// Returns credit for bytes written to the socket; gives back the queues to poke when
    /// the outbox has room again.
    pub fn release(&self, bytes: usize) -> Vec<Arc<QueueHandle>> {
        let mut g = self.lock();
        g.bytes = g.bytes.saturating_sub(bytes);
        if g.bytes < self.bytes_max / 2 && !g.stalled.is_empty() {
            return g.stalled.drain(..).filter_map(|w| w.upgrade()).collect();
        }
        Vec::new()
    }

    /// Closes the outbox and returns what was still in it (to be requeued).
    pub fn close(&self) -> Vec<OutItem> {
        let mut g = self.lock();
        g.closed = true;
        g.stalled.clear();
        g.items.drain(..).collect()
    }
}

/// What queues need to know about a consumer's channel.
#[derive(Debug)]
pub struct ChannelLink {
    /// Connection id.
    pub conn_id: u64,
    /// Channel number.
    pub channel: u16,
    /// The connection's outbox.
    pub outbox: Arc<Outbox>,
    /// `channel.flow` state (false: deliver nothing).
    pub flow_active: AtomicBool,
    /// `basic.qos global=true` limit shared by the channel's consumers (0: none).
    pub global_prefetch: AtomicU32,
    /// Unacknowledged deliveries counted against `global_prefetch`.
    pub global_in_flight: AtomicU32,
}

impl ChannelLink {
    /// A link for channel `channel` of connection `conn_id`.
    pub fn new(conn_id: u64, channel: u16, outbox: Arc<Outbox>) -> ChannelLink {
        ChannelLink {
            conn_id,
            channel,
            outbox,
            flow_active: AtomicBool::new(true),
            global_prefetch: AtomicU32::new(0),
            global_in_flight: AtomicU32::new(0),
        }
    }

    /// Takes one unit of channel-wide prefetch credit if there is any.
    pub fn try_acquire_global(&self) -> bool {
        let limit = self.global_prefetch.load(Ordering::Acquire);
        if limit == 0 {
            self.global_in_flight.fetch_add(1, Ordering::AcqRel);
            return true;
        }
        self.global_in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .is_ok()
    }

    /// Returns `n` units of channel-wide credit.
    pub fn release_global(&self, n: u32) {
        let _ = self
            .global_in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |x| {
                Some(x.saturating_sub(n))
            });
    }

    /// Whether the channel-wide limit currently allows another delivery.
    pub fn global_has_room(&self) -> bool {
        let limit = self.global_prefetch.load(Ordering::Acquire);
        limit == 0 || self.global_in_flight.load(Ordering::Acquire) < limit
    }
}
