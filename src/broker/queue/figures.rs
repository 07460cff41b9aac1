//! A queue's message figures as RabbitMQ's listings show them: counts and body bytes of
//! its ready and unacknowledged messages, how many are in RAM, persistent, or paged out.
//!
//! RabbitMQ's variable queue keeps these as running counters; here they come from one walk
//! over the entries in RAM (delta, the messages only on disk, keeps its own counts), so a
//! listing costs time in proportion to the messages in RAM. Nothing on the message path
//! reads them.

use serde::{Deserialize, Serialize};

use super::{Entry, OnDisk, Queue};

/// A queue's figures ([`Queue::figures`]); the names say which RabbitMQ field each is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
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
        let mut f = QueueFigures {
            consumers: self.consumers.len() as u64,
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
        for u in self.unacked.values() {
            f.add(&u.entry, false);
        }
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
    use std::sync::atomic::AtomicI64;
    use std::sync::Arc;

    use amq_protocol::protocol::basic::AMQPProperties;
    use bytes::Bytes;

    use super::super::{Delta, Entry, OnDisk, Queue, QueueHandle};
    use super::QueueFigures;
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
            }
        );
        // The walk agrees with the counters the queue keeps for itself.
        assert_eq!(f.ready, u64::from(q.message_count()));
        assert_eq!(f.unacked, u64::from(q.unacked_count()));
        assert_eq!(f.ready_bytes, q.ready_bytes());
        assert_eq!((f.messages(), f.bytes(), f.ram()), (6, 410, 2));
    }
}
