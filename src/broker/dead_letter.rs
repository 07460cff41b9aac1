//! Dead-lettering: the message rewrite RabbitMQ does (x-death, x-first-death-*, expiration),
//! and the hold that keeps a letter's source ack back until every queue it goes to took it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString};
use bytes::Bytes;

use super::message::Message;
use super::queue::{DeadLetter, HeldAck, QueueHandle};
use crate::amqp::frame::encode_properties;

fn lstr(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

fn field_str(t: &FieldTable, k: &str) -> Option<String> {
    t.inner().get(k).and_then(crate::meta::args::string)
}

/// A dead letter's source ack ([`HeldAck`]), shared by the remote queues the letter goes to:
/// recorded in the source queue once the last of them has [`taken`](LetterHold::taken) it.
/// Dropped without that (the node stops with the letter in flight), the ack is never
/// recorded, and the node's next start finds the message in its source queue again.
#[derive(Debug)]
pub struct LetterHold {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    queue: Weak<QueueHandle>,
    ack: Mutex<Option<HeldAck>>,
    /// Holds not yet taken.
    open: AtomicUsize,
}

impl LetterHold {
    /// A hold of `ack` for queue `queue` (nothing to record when `ack` is None).
    pub fn new(queue: &Arc<QueueHandle>, ack: Option<HeldAck>) -> LetterHold {
        LetterHold {
            shared: Arc::new(Shared {
                queue: Arc::downgrade(queue),
                ack: Mutex::new(ack),
                open: AtomicUsize::new(1),
            }),
        }
    }

    /// This part of the letter is where it goes (or has nowhere to go); the last part
    /// taken records the ack. Takes the source queue's lock: never call it under one.
    pub fn taken(self) {
        if self.shared.open.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let ack = self
            .shared
            .ack
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let (Some(ack), Some(queue)) = (ack, self.shared.queue.upgrade()) {
            queue.lock().release_letter(ack);
        }
    }
}

impl Clone for LetterHold {
    /// One more part that must be taken before the ack is recorded.
    fn clone(&self) -> LetterHold {
        self.shared.open.fetch_add(1, Ordering::AcqRel);
        LetterHold {
            shared: self.shared.clone(),
        }
    }
}

/// Builds the dead-lettered copy of a message leaving `queue` for `dlx`.
pub fn rewrite(
    letter: &DeadLetter,
    queue: &str,
    dlx: &str,
    dlrk: Option<&str>,
    wall_ms: u64,
    id: u128,
) -> Message {
    let original = &letter.message;
    let mut props = original.properties.clone();
    let mut headers = props.headers().clone().unwrap_or_default();
    let reason = letter.reason.as_str();

    // x-death: newest first; an existing entry for (queue, reason) is counted up and moved.
    let mut deaths: Vec<AMQPValue> = match headers.inner().get("x-death") {
        Some(AMQPValue::FieldArray(a)) => a.as_slice().to_vec(),
        _ => Vec::new(),
    };
    let mut count: i64 = 1;
    deaths.retain(|d| {
        if let AMQPValue::FieldTable(t) = d {
            if field_str(t, "queue").as_deref() == Some(queue)
                && field_str(t, "reason").as_deref() == Some(reason)
            {
                if let Some(AMQPValue::LongLongInt(c)) = t.inner().get("count") {
                    count = c + 1;
                }
                return false;
            }
        }
        true
    });
    let mut entry = FieldTable::default();
    entry.insert("count".into(), AMQPValue::LongLongInt(count));
    entry.insert("reason".into(), lstr(reason));
    entry.insert("queue".into(), lstr(queue));
    entry.insert("time".into(), AMQPValue::Timestamp(wall_ms / 1000));
    entry.insert("exchange".into(), lstr(&original.exchange));
    entry.insert(
        "routing-keys".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![lstr(&original.routing_key)])),
    );
    if let Some(exp) = props.expiration() {
        entry.insert("original-expiration".into(), lstr(exp.as_str()));
    }
    deaths.insert(0, AMQPValue::FieldTable(entry));
    headers.insert(
        "x-death".into(),
        AMQPValue::FieldArray(FieldArray::from(deaths)),
    );
    if !headers.contains_key("x-first-death-reason") {
        headers.insert("x-first-death-reason".into(), lstr(reason));
        headers.insert("x-first-death-queue".into(), lstr(queue));
        headers.insert("x-first-death-exchange".into(), lstr(&original.exchange));
    }
    if props.expiration().is_some() {
        // RabbitMQ drops the per-message TTL (kept in x-death) so the copy does not expire
        // again at once.
        props = clear_expiration(props);
    }
    props = props.with_headers(headers);
    let raw = encode_properties(&props);
    Message {
        id,
        exchange: dlx.to_string(),
        routing_key: dlrk.unwrap_or(&original.routing_key).to_string(),
        properties_raw: Bytes::from(raw),
        properties: props,
        body: original.body.clone(),
    }
}

fn clear_expiration(
    props: amq_protocol::protocol::basic::AMQPProperties,
) -> amq_protocol::protocol::basic::AMQPProperties {
    // AMQPProperties has no "without" builder: rebuild it from every field but expiration.
    let mut p = amq_protocol::protocol::basic::AMQPProperties::default();
    macro_rules! copy {
        ($get:ident, $with:ident) => {
            if let Some(v) = props.$get().clone() {
                p = p.$with(v);
            }
        };
    }
    copy!(content_type, with_content_type);
    copy!(content_encoding, with_content_encoding);
    copy!(headers, with_headers);
    copy!(delivery_mode, with_delivery_mode);
    copy!(priority, with_priority);
    copy!(correlation_id, with_correlation_id);
    copy!(reply_to, with_reply_to);
    copy!(message_id, with_message_id);
    copy!(timestamp, with_timestamp);
    copy!(kind, with_type);
    copy!(user_id, with_user_id);
    copy!(app_id, with_app_id);
    copy!(cluster_id, with_cluster_id);
    p
}

/// Whether routing a dead letter to `target` would loop without a client in between: the
/// message already died in `target` and never by rejection (RabbitMQ's cycle rule).
pub fn is_cycle(message: &Arc<Message>, target: &str) -> bool {
    let Some(headers) = message.properties.headers() else {
        return false;
    };
    let Some(AMQPValue::FieldArray(deaths)) = headers.inner().get("x-death") else {
        return false;
    };
    let mut seen_target = false;
    for d in deaths.as_slice() {
        if let AMQPValue::FieldTable(t) = d {
            if field_str(t, "reason").as_deref() == Some("rejected") {
                return false;
            }
            if field_str(t, "queue").as_deref() == Some(target) {
                seen_target = true;
            }
        }
    }
    seen_target
}

#[cfg(test)]
mod tests {
    use super::super::queue::DeathReason;
    use super::*;
    use amq_protocol::protocol::basic::AMQPProperties;

    fn message() -> Arc<Message> {
        let props = AMQPProperties::default().with_expiration("100".into());
        Arc::new(Message {
            id: 1,
            exchange: "ex".into(),
            routing_key: "rk".into(),
            properties_raw: Bytes::from(encode_properties(&props)),
            properties: props,
            body: Bytes::from_static(b"hi"),
        })
    }

    #[test]
    fn rewrite_adds_x_death_and_drops_expiration() {
        let letter = DeadLetter {
            message: message(),
            reason: DeathReason::Expired,
            held: None,
        };
        let m = rewrite(&letter, "q1", "dlx", None, 5_000, 2);
        assert_eq!(m.exchange, "dlx");
        assert_eq!(m.routing_key, "rk");
        assert!(m.properties.expiration().is_none());
        let h = m.properties.headers().clone().unwrap();
        assert_eq!(
            field_str(&h, "x-first-death-reason").as_deref(),
            Some("expired")
        );
        let again = rewrite(
            &DeadLetter {
                message: Arc::new(m),
                reason: DeathReason::Expired,
                held: None,
            },
            "q1",
            "dlx",
            Some("other"),
            6_000,
            3,
        );
        assert_eq!(again.routing_key, "other");
        let Some(AMQPValue::FieldArray(d)) = again
            .properties
            .headers()
            .clone()
            .unwrap()
            .inner()
            .get("x-death")
            .cloned()
        else {
            panic!("no x-death")
        };
        assert_eq!(d.as_slice().len(), 1);
        let AMQPValue::FieldTable(t) = &d.as_slice()[0] else {
            panic!()
        };
        assert_eq!(t.inner().get("count"), Some(&AMQPValue::LongLongInt(2)));
        assert!(is_cycle(&Arc::new(again), "q1"));
    }
}

/// A dead letter one of this node's queues took in the group-commit round of `ticket`,
/// with its part of the source's hold ([`super::RemoteLink::dead_letters_written`]).
#[derive(Debug)]
pub struct WrittenLetter {
    /// The target queue's vhost.
    pub vhost: String,
    /// The target queue.
    pub queue: String,
    /// The letter, to send again if its round is voided.
    pub message: Arc<Message>,
    /// Its part of the source's hold.
    pub hold: LetterHold,
    /// The round that writes it (never 0).
    pub ticket: u64,
}
