//! A queue's message figures as RabbitMQ's listings show them: counts and body bytes of
//! its ready and unacknowledged messages, how many are in RAM, persistent, or paged out.
//!
//! RabbitMQ's variable queue keeps these as running counters; here they come from one walk
//! over the entries in RAM (delta, the messages only on disk, keeps its own counts), so a
//! listing costs time in proportion to the messages in RAM. Nothing on the message path
//! reads them. Beside the counts: the head message's timestamp and the tag of the
//! consumer a queue gives every message to (exclusive or single active), which RabbitMQ's
//! queue listings also show.

use serde::{Deserialize, Serialize};

use super::{Entry, OnDisk, Queue};

/// A queue's figures ([`Queue::figures`]); the names say which RabbitMQ field each is.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueFigures {
    /// `messages_ready`.
    pub ready: u64,
    /// `messages_unacknowledged`.
    pub unacked: u64,
    /// `consumers`.
    pub consumers: u64,
    /// `message_bytes_ready`: body bytes of the ready messages.
    pub ready_bytes: u64,
    /// `message_bytes_unacknowledged`.
    pub unacked_bytes: u64,
    /// `messages_ready_ram`: ready messages whose body is in RAM.
    pub ready_ram: u64,
    /// `messages_unacknowledged_ram`.
    pub unacked_ram: u64,
    /// `message_bytes_ram`: body bytes in RAM, ready or unacknowledged.
    pub ram_bytes: u64,
    /// `messages_persistent`: persistent messages of a durable queue (they survive a
    /// restart), ready or unacknowledged.
    pub persistent: u64,
    /// `message_bytes_persistent`.
    pub persistent_bytes: u64,
    /// `messages_paged_out`: messages whose body is only on disk (delta and betas).
    pub paged_out: u64,
    /// `message_bytes_paged_out`.
    pub paged_out_bytes: u64,
    /// `head_message_timestamp`: as RabbitMQ's variable queue, the smallest `timestamp`
    /// property (seconds) of the next message out and the oldest unacknowledged one, of
    /// those in RAM; `None` when neither has one.
    pub head_message_timestamp: Option<u64>,
    /// `exclusive_consumer_tag`: the exclusive consumer's tag (not under single active
    /// consumer).
    pub exclusive_consumer_tag: Option<String>,
    /// `single_active_consumer_tag`: the active consumer's tag, under
    /// `x-single-active-consumer`.
    pub single_active_consumer_tag: Option<String>,
}

impl QueueFigures {
    /// `messages`: ready and unacknowledged.
    pub fn messages(&self) -> u64 {
        self.ready + self.unacked
    }

    /// `message_bytes`.
    pub fn bytes(&self) -> u64 {
        self.ready_bytes + self.unacked_bytes
    }

    /// `messages_ram`.
    pub fn ram(&self) -> u64 {
        self.ready_ram + self.unacked_ram
    }

    fn add(&mut self, e: &Entry, ready: bool) {
        let bytes = e.body_len();
        let in_ram = e.beta.is_none();
        if ready {
            self.ready += 1;
            self.ready_bytes += bytes;
            self.ready_ram += u64::from(in_ram);
        } else {
            self.unacked += 1;
            self.unacked_bytes += bytes;
            self.unacked_ram += u64::from(in_ram);
        }
        if in_ram {
            self.ram_bytes += bytes;
        } else {
            self.paged_out += 1;
            self.paged_out_bytes += bytes;
        }
        // Only a durable queue's persistent messages have a persistent index record (a
        // mirrored durable queue's transient ones have one too, which a restart drops).
        if e.on_disk == OnDisk::Persistent && e.message.persistent() {
            self.persistent += 1;
            self.persistent_bytes += bytes;
        }
    }
}

impl Queue {
    /// The queue's figures now (a walk over the entries in RAM: for listings).
    pub fn figures(&self) -> QueueFigures {
        let single_active = self.single_active_consumer();
        let exclusive = self.consumers.iter().find(|c| c.exclusive);
        let mut f = QueueFigures {
            consumers: self.consumers.len() as u64,
            single_active_consumer_tag: single_active.map(|c| c.tag.to_string()),
            exclusive_consumer_tag: exclusive
                .filter(|_| !self.args.single_active_consumer)
                .map(|c| c.tag.to_string()),
            ..QueueFigures::default()
        };
        let ready = self
            .ready
            .iter()
            .flatten()
            .chain(self.returned.values())
            .chain(self.q1.iter());
        for e in ready {
            f.add(e, true);
        }
        let mut oldest_unacked: Option<&Entry> = None;
        for u in self.unacked.values() {
            f.add(&u.entry, false);
            if oldest_unacked.is_none_or(|o| u.entry.seq < o.seq) {
                oldest_unacked = Some(&u.entry);
            }
        }
        f.head_message_timestamp = [self.peek_next(), oldest_unacked]
            .into_iter()
            .flatten()
            .filter(|e| e.beta.is_none())
            .filter_map(|e| *e.message.properties.timestamp())
            .min();
        if let Some(d) = &self.delta {
            f.ready += d.count;
            f.ready_bytes += d.bytes;
            f.paged_out += d.count;
            f.paged_out_bytes += d.bytes;
            f.persistent += d.persistent;
            f.persistent_bytes += d.persistent_bytes;
        }
        f
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicI64, AtomicU32};
    use std::sync::Arc;

    use amq_protocol::protocol::basic::AMQPProperties;
    use bytes::Bytes;

    use super::super::{Consumer, Delta, Entry, OnDisk, Queue, QueueHandle};
    use super::QueueFigures;
    use crate::broker::outbox::{ChannelLink, Outbox};
    use crate::broker::Message;
    use crate::meta::args::QueueArgs;
    use crate::time::Instant;

    fn message(body: &str, persistent: bool) -> Arc<Message> {
        let mut properties = AMQPProperties::default();
        if persistent {
            properties = properties.with_delivery_mode(2);
        }
        Arc::new(Message {
            id: 1,
            exchange: String::new(),
            routing_key: "q".into(),
            properties_raw: Bytes::from_static(&[0, 0]),
            properties,
            body: Bytes::copy_from_slice(body.as_bytes()),
        })
    }

    fn entry(seq: u64, m: Arc<Message>, beta: Option<u64>) -> Entry {
        Entry {
            seq,
            message: m,
            redelivered: false,
            expires_at_ms: u64::MAX,
            priority: 0,
            on_disk: OnDisk::Persistent,
            beta,
        }
    }

    #[test]
    fn figures_count_ready_unacked_ram_persistent_and_paged_messages() {
        let q = Queue::new(
            QueueArgs::default(),
            None,
            false,
            Arc::new(AtomicI64::new(0)),
            Instant::from_millis(0),
        );
        let h = QueueHandle::new("/", "q", q);
        let now = Instant::from_millis(1);
        // As after a restart: a persistent message in RAM (7 bytes), one whose 100-byte
        // body is only in the store (a beta), and 3 persistent messages only on disk.
        h.lock().restore(
            vec![
                entry(0, message("persist", true), None),
                entry(1, message("", true), Some(100)),
            ],
            Some(Delta {
                start: 2,
                end: 5,
                count: 3,
                bytes: 300,
                persistent: 3,
                persistent_bytes: 300,
            }),
            5,
        );
        // A transient message arrives (in RAM, behind delta), and the head goes out
        // unacknowledged.
        h.lock().publish(&h, message("abc", false), now);
        let mut dead = Vec::new();
        let (got, _) = h.lock().get(now, true, &mut dead).expect("the head");
        assert_eq!(&got.message.body[..], b"persist");
        let q = h.lock();
        let f = q.figures();
        assert_eq!(
            f,
            QueueFigures {
                ready: 5,
                unacked: 1,
                consumers: 0,
                ready_bytes: 100 + 300 + 3,
                unacked_bytes: 7,
                ready_ram: 1,
                unacked_ram: 1,
                ram_bytes: 3 + 7,
                persistent: 5,
                persistent_bytes: 7 + 100 + 300,
                paged_out: 4,
                paged_out_bytes: 400,
                head_message_timestamp: None,
                exclusive_consumer_tag: None,
                single_active_consumer_tag: None,
            }
        );
        // The walk agrees with the counters the queue keeps for itself.
        assert_eq!(f.ready, u64::from(q.message_count()));
        assert_eq!(f.unacked, u64::from(q.unacked_count()));
        assert_eq!(f.ready_bytes, q.ready_bytes());
        assert_eq!((f.messages(), f.bytes(), f.ram()), (6, 410, 2));
    }

    fn stamped(body: &str, timestamp: u64) -> Arc<Message> {
        let mut m = (*message(body, false)).clone();
        m.properties = m.properties.with_timestamp(timestamp);
        Arc::new(m)
    }

    fn empty_queue(args: QueueArgs) -> Arc<QueueHandle> {
        let q = Queue::new(
            args,
            None,
            false,
            Arc::new(AtomicI64::new(0)),
            Instant::from_millis(0),
        );
        QueueHandle::new("/", "q", q)
    }

    #[test]
    fn the_head_timestamp_is_the_smaller_of_the_next_out_and_the_oldest_unacked() {
        let h = empty_queue(QueueArgs::default());
        let now = Instant::from_millis(1);
        assert_eq!(h.lock().figures().head_message_timestamp, None);
        h.lock().publish(&h, stamped("a", 300), now);
        h.lock().publish(&h, stamped("b", 100), now);
        h.lock().publish(&h, message("c", false), now);
        assert_eq!(h.lock().figures().head_message_timestamp, Some(300));
        let mut dead = Vec::new();
        // "a" (300) out unacknowledged: the next out is "b" (100).
        h.lock().get(now, true, &mut dead).expect("a");
        assert_eq!(h.lock().figures().head_message_timestamp, Some(100));
        // "b" out too: the oldest unacked is still "a"; the next out has no timestamp.
        h.lock().get(now, true, &mut dead).expect("b");
        assert_eq!(h.lock().figures().head_message_timestamp, Some(300));

        // A head only on disk (a beta) is not read for it, as RabbitMQ's variable queue.
        let h = empty_queue(QueueArgs::default());
        h.lock()
            .restore(vec![entry(0, stamped("x", 5), Some(1))], None, 1);
        assert_eq!(h.lock().figures().head_message_timestamp, None);
    }

    #[test]
    fn the_exclusive_or_single_active_consumer_is_named() {
        let outbox = Arc::new(Outbox::new(1 << 20, Box::new(|| {})));
        let link = Arc::new(ChannelLink::new(1, 1, outbox));
        let consumer = |tag: &str, exclusive: bool| Consumer {
            tag: Arc::from(tag),
            link: link.clone(),
            no_ack: false,
            prefetch: 0,
            priority: 0,
            exclusive,
            in_flight: Arc::new(AtomicU32::new(0)),
        };
        let now = Instant::from_millis(1);
        let h = empty_queue(QueueArgs::default());
        h.lock().add_consumer(&h, consumer("plain", false), now);
        let f = h.lock().figures();
        assert_eq!(
            (f.exclusive_consumer_tag, f.single_active_consumer_tag),
            (None, None)
        );
        let h = empty_queue(QueueArgs::default());
        h.lock().add_consumer(&h, consumer("only", true), now);
        let f = h.lock().figures();
        assert_eq!(f.exclusive_consumer_tag.as_deref(), Some("only"));
        assert_eq!(f.single_active_consumer_tag, None);
        let h = empty_queue(QueueArgs {
            single_active_consumer: true,
            ..QueueArgs::default()
        });
        h.lock().add_consumer(&h, consumer("first", false), now);
        h.lock().add_consumer(&h, consumer("second", false), now);
        let f = h.lock().figures();
        assert_eq!(f.single_active_consumer_tag.as_deref(), Some("first"));
        assert_eq!(f.exclusive_consumer_tag, None);
        h.lock().remove_consumers(now, |c| &*c.tag == "first");
        let f = h.lock().figures();
        assert_eq!(f.single_active_consumer_tag.as_deref(), Some("second"));
    }
}
