//! Direct reply-to (RabbitMQ's "fast reply-to"): RPC replies delivered straight to the
//! requester's channel, with no queue in between.
//!
//! A client consumes the pseudo-queue [`REPLY_QUEUE`] (`amq.rabbitmq.reply-to`) with
//! `no_ack`, and publishes requests whose `reply_to` property is that name; its channel
//! rewrites `reply_to` to a name of its own, `amq.rabbitmq.reply-to.<suffix>`. A reply
//! published to the default exchange with that name as routing key, from any channel of any
//! connection on any node, goes to that consumer. The rules the channel applies (406s, the
//! declare answers) live in `session/channel/direct_reply.rs`; this module holds the names
//! and the node's table of reply consumers.
//!
//! # Names
//! The suffix is `<locator>.<key>`, each part standard base64 (RabbitMQ's shape: an encoded
//! channel pid, a dot, a random key). The locator holds the node id, the connection id and
//! the channel number, so any node can tell which node to send a reply to; the key is 16
//! bytes from the broker's RNG (seeded from OS randomness by the runtime), drawn anew at
//! every consume, so a name cannot be guessed from another and a name from before a
//! cancel reaches nothing afterwards. Clients must treat the name as opaque, as with
//! RabbitMQ.
//!
//! # Delivery
//! A reply is pushed into the consumer connection's [`Outbox`] as [`OutItem::Reply`],
//! carrying the key: the channel delivers it only if that key is still its reply
//! consumer's (a cancel that overtook the reply drops it, as RabbitMQ's channel does). A
//! reply whose consumer is gone, or whose name does not decode, is dropped silently: it was
//! never counted as routed (see [`crate::broker::Broker::deliver_replies`]).
//!
//! # Across nodes
//! A reply published on another node than its consumer's goes to that node through the
//! [`super::RemoteLink`] (`RelayMsg::DeliverReply` in the runtime's relay), in order with
//! what the publishing node sends there, and nobody waits for an answer; a declare of the
//! name on another node asks the consumer's node with a counts call, which it answers for
//! its reply consumers. A reply for a node the failure detector holds down is dropped.
//!
//! # Bounds
//! The table holds at most one entry per open channel of the node's connections (a channel
//! has one reply consumer at most), so it is bounded by the connections times their
//! negotiated `channel_max`; entries leave with their [`ReplyRegistration`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use base64::engine::general_purpose::STANDARD;
use base64::Engine;

use super::message::Message;
use super::outbox::{OutItem, Outbox};

/// The pseudo-queue a reply consumer consumes, and the `reply_to` value the channel rewrites.
pub const REPLY_QUEUE: &str = "amq.rabbitmq.reply-to";

/// What every reply name starts with (RabbitMQ's `virtual_reply_queue`).
pub const REPLY_PREFIX: &str = "amq.rabbitmq.reply-to.";

/// Bytes of the locator: node id, connection id (8 bytes each), channel number (2).
const LOCATOR_BYTES: usize = 18;

/// The random part of a reply name.
pub type ReplyKey = [u8; 16];

/// Whether `routing_key` is a reply name (published to the default exchange, it goes to a
/// reply consumer, never to a queue).
pub fn is_reply_name(routing_key: &str) -> bool {
    routing_key.starts_with(REPLY_PREFIX)
}

/// Why a name is not a usable reply name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplyNameError {
    /// It does not start with [`REPLY_PREFIX`].
    #[error("'{0}' does not start with '{REPLY_PREFIX}'")]
    NotReplyName(String),
    /// The suffix is not `<locator>.<key>` in base64 with the right lengths.
    #[error("malformed reply name suffix '{0}'")]
    Malformed(String),
}

/// Where a reply name points: the channel of a reply consumer, and its current key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyAddress {
    /// The consumer's node (0: not clustered).
    pub node: u64,
    /// The consumer's connection.
    pub conn: u64,
    /// The consumer's channel.
    pub channel: u16,
    /// The key drawn when the consumer was registered.
    pub key: ReplyKey,
}

impl ReplyAddress {
    /// The reply name: [`REPLY_PREFIX`] and the suffix.
    pub fn name(&self) -> String {
        let mut locator = [0u8; LOCATOR_BYTES];
        locator[..8].copy_from_slice(&self.node.to_be_bytes());
        locator[8..16].copy_from_slice(&self.conn.to_be_bytes());
        locator[16..].copy_from_slice(&self.channel.to_be_bytes());
        format!(
            "{REPLY_PREFIX}{}.{}",
            STANDARD.encode(locator),
            STANDARD.encode(self.key)
        )
    }

    /// Decodes a reply name made by [`ReplyAddress::name`].
    pub fn parse(name: &str) -> Result<ReplyAddress, ReplyNameError> {
        let suffix = name
            .strip_prefix(REPLY_PREFIX)
            .ok_or_else(|| ReplyNameError::NotReplyName(name.to_string()))?;
        let malformed = || ReplyNameError::Malformed(suffix.to_string());
        let (locator, key) = suffix.split_once('.').ok_or_else(malformed)?;
        let locator: [u8; LOCATOR_BYTES] = STANDARD
            .decode(locator)
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or_else(malformed)?;
        let key: ReplyKey = STANDARD
            .decode(key)
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or_else(malformed)?;
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&locator[i..i + 8]);
            u64::from_be_bytes(b)
        };
        Ok(ReplyAddress {
            node: u64_at(0),
            conn: u64_at(8),
            channel: u16::from_be_bytes([locator[16], locator[17]]),
            key,
        })
    }
}

/// A registered reply consumer: the channel whose outbox takes its replies.
#[derive(Debug)]
struct Target {
    conn: u64,
    channel: u16,
    outbox: Weak<Outbox>,
}

/// The reply consumers of this node's channels, by key.
#[derive(Debug, Default)]
pub struct DirectReplies {
    targets: Mutex<HashMap<ReplyKey, Target>>,
}

impl DirectReplies {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ReplyKey, Target>> {
        // Plain inserts and removals: a panic elsewhere cannot leave the map inconsistent.
        self.targets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers the reply consumer at `address`, whose replies go to `outbox`; `None` when
    /// its key is already taken (the caller draws another).
    pub fn register(
        self: &Arc<Self>,
        address: ReplyAddress,
        outbox: &Arc<Outbox>,
    ) -> Option<ReplyRegistration> {
        let mut targets = self.lock();
        if targets.contains_key(&address.key) {
            return None;
        }
        targets.insert(
            address.key,
            Target {
                conn: address.conn,
                channel: address.channel,
                outbox: Arc::downgrade(outbox),
            },
        );
        Some(ReplyRegistration {
            replies: self.clone(),
            name: address.name(),
            address,
        })
    }

    /// Whether `address` names a registered reply consumer of this node.
    pub fn contains(&self, address: &ReplyAddress) -> bool {
        self.lock()
            .get(&address.key)
            .is_some_and(|t| t.conn == address.conn && t.channel == address.channel)
    }

    /// Hands `message` to the reply consumer at `address`; false when there is none (or its
    /// connection is closing), and the message is dropped.
    pub fn deliver(&self, address: &ReplyAddress, message: Arc<Message>) -> bool {
        let outbox = {
            let targets = self.lock();
            match targets.get(&address.key) {
                Some(t) if t.conn == address.conn && t.channel == address.channel => {
                    t.outbox.upgrade()
                }
                _ => None,
            }
        };
        let Some(outbox) = outbox else {
            return false;
        };
        outbox
            .push(OutItem::Reply {
                channel: address.channel,
                key: address.key,
                message,
            })
            .is_ok()
    }

    /// Registered reply consumers.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A channel's reply consumer in the node's table; dropping it removes the entry.
#[derive(Debug)]
pub struct ReplyRegistration {
    replies: Arc<DirectReplies>,
    address: ReplyAddress,
    name: String,
}

impl ReplyRegistration {
    /// Where it is.
    pub fn address(&self) -> &ReplyAddress {
        &self.address
    }

    /// Its reply name, what `reply_to` is rewritten to.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for ReplyRegistration {
    fn drop(&mut self) {
        self.replies.lock().remove(&self.address.key);
    }
}

/// Direct reply-to, as the broker offers it to sessions and to the relay.
impl super::Broker {
    /// The reply consumers of this node's channels.
    pub fn direct_replies(&self) -> &Arc<DirectReplies> {
        &self.direct_replies
    }

    /// Registers a reply consumer for channel `channel` of connection `conn`, with a fresh
    /// key; its replies go to `outbox`.
    pub fn register_reply_consumer(
        &self,
        conn: u64,
        channel: u16,
        outbox: &Arc<Outbox>,
    ) -> ReplyRegistration {
        loop {
            let key: ReplyKey = {
                let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
                rand::Rng::gen(&mut *rng)
            };
            let address = ReplyAddress {
                node: self.node_id,
                conn,
                channel,
                key,
            };
            // A repeated 128-bit key is not expected; drawing again costs nothing.
            if let Some(r) = self.direct_replies.register(address, outbox) {
                return r;
            }
        }
    }

    /// Delivers a message published to the default exchange to every reply consumer its
    /// routing keys name: the routing key, the `CC` and `BCC` headers' keys and `bcc` (the
    /// removed `BCC` header's), each once, as RabbitMQ's `rabbit_exchange:route` does for
    /// the default exchange. As there, these deliveries never count as routed: a mandatory
    /// publish to a reply name comes back with basic.return even when it was delivered, and
    /// a confirm is an ack whether or not the consumer still exists.
    pub(crate) fn deliver_replies(&self, message: &Arc<Message>, bcc: &[String]) {
        let headers = message.properties.headers().as_ref();
        // The hot path of every default-exchange publish: two lookups, no allocation.
        let has_cc = headers.is_some_and(|h| {
            super::exchange::SENDER_SELECTED
                .iter()
                .any(|k| h.inner().contains_key(*k))
        });
        if !is_reply_name(&message.routing_key) && !has_cc && bcc.is_empty() {
            return;
        }
        let mut names = std::collections::BTreeSet::new();
        if is_reply_name(&message.routing_key) {
            names.insert(message.routing_key.clone());
        }
        let extra = super::exchange::sender_selected_keys(headers).unwrap_or_default();
        names.extend(
            extra
                .into_iter()
                .chain(bcc.iter().cloned())
                .filter(|k| is_reply_name(k)),
        );
        for name in names {
            self.deliver_reply(&name, message.clone());
        }
    }

    /// Delivers `message` to the reply consumer named `name`, here or through the relay on
    /// its node. A name that does not decode, or whose node is unknown or down, is dropped,
    /// as RabbitMQ drops what it cannot decode.
    fn deliver_reply(&self, name: &str, message: Arc<Message>) {
        let Ok(address) = ReplyAddress::parse(name) else {
            tracing::debug!(name, "reply to an undecodable name dropped");
            return;
        };
        if address.node == self.node_id {
            self.direct_replies.deliver(&address, message);
            return;
        }
        match self.remote.get() {
            Some(link) if !self.node_is_down(address.node) => {
                link.deliver_reply(address.node, name, message)
            }
            _ => tracing::debug!(
                name,
                node = address.node,
                "reply for an unreachable node dropped"
            ),
        }
    }

    /// Delivers a reply another node forwarded to a reply consumer of this node; false when
    /// the name is not one of this node's live consumers (the reply is dropped).
    pub fn deliver_forwarded_reply(&self, name: &str, message: Arc<Message>) -> bool {
        match ReplyAddress::parse(name) {
            Ok(address) if address.node == self.node_id => {
                self.direct_replies.deliver(&address, message)
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::protocol::basic::AMQPProperties;

    fn address(key: u8) -> ReplyAddress {
        ReplyAddress {
            node: 3,
            conn: (3 << 40) | 17,
            channel: 65535,
            key: [key; 16],
        }
    }

    fn message(body: &'static [u8]) -> Arc<Message> {
        Arc::new(Message {
            id: 1,
            exchange: String::new(),
            routing_key: "k".into(),
            properties_raw: bytes::Bytes::from_static(&[0, 0]),
            properties: AMQPProperties::default(),
            body: bytes::Bytes::from_static(body),
        })
    }

    fn outbox() -> Arc<Outbox> {
        Arc::new(Outbox::new(1 << 20, Box::new(|| {})))
    }

    fn replies_in(outbox: &Outbox) -> Vec<(u16, ReplyKey, bytes::Bytes)> {
        let mut items = Vec::new();
        outbox.drain(&mut items);
        items
            .into_iter()
            .map(|i| match i {
                OutItem::Reply {
                    channel,
                    key,
                    message,
                } => (channel, key, message.body.clone()),
                other => panic!("not a reply: {other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_reply_name_decodes_to_the_address_it_was_made_from() {
        let a = address(0xab);
        let name = a.name();
        assert!(is_reply_name(&name), "{name}");
        assert_eq!(ReplyAddress::parse(&name), Ok(a));
        // The same shape as RabbitMQ's: two base64 parts after the prefix.
        let suffix = name.strip_prefix(REPLY_PREFIX).unwrap();
        assert_eq!(suffix.split('.').count(), 2, "{suffix}");
        assert!(name.len() <= 255, "fits a short string");
    }

    #[test]
    fn names_that_are_not_reply_names_are_refused_with_why() {
        assert_eq!(
            ReplyAddress::parse(REPLY_QUEUE),
            Err(ReplyNameError::NotReplyName(REPLY_QUEUE.into()))
        );
        let name = address(1).name();
        let (locator, key) = name
            .strip_prefix(REPLY_PREFIX)
            .unwrap()
            .split_once('.')
            .unwrap();
        for bad in [
            String::new(),
            "abc.def".to_string(),
            locator.to_string(),
            format!("{locator}.{key}.x"),
            format!("{locator}.{}", &key[..8]),
            format!("{}.{key}", &locator[..20]),
            format!("{locator}.!{}", &key[1..]),
        ] {
            let err = ReplyAddress::parse(&format!("{REPLY_PREFIX}{bad}")).unwrap_err();
            assert_eq!(err, ReplyNameError::Malformed(bad.clone()), "{bad}");
        }
    }

    #[test]
    fn a_registered_consumer_gets_replies_until_its_registration_is_dropped() {
        let replies = Arc::new(DirectReplies::default());
        let out = outbox();
        let a = address(7);
        let reg = replies.register(a, &out).expect("a fresh key");
        assert_eq!(reg.name(), a.name());
        assert!(replies.contains(&a));
        assert!(replies.deliver(&a, message(b"one")));
        assert_eq!(replies_in(&out), vec![(65535, [7; 16], "one".into())]);
        drop(reg);
        assert!(!replies.contains(&a));
        assert!(!replies.deliver(&a, message(b"two")), "dropped, not queued");
        assert!(replies_in(&out).is_empty());
        assert!(replies.is_empty());
    }

    #[test]
    fn a_key_with_another_channel_or_connection_reaches_nothing() {
        let replies = Arc::new(DirectReplies::default());
        let out = outbox();
        let a = address(9);
        let _reg = replies.register(a, &out).unwrap();
        assert!(
            replies.register(a, &out).is_none(),
            "a key is registered once"
        );
        for forged in [
            ReplyAddress { channel: 1, ..a },
            ReplyAddress { conn: 5, ..a },
            ReplyAddress { key: [8; 16], ..a },
        ] {
            assert!(!replies.contains(&forged));
            assert!(!replies.deliver(&forged, message(b"x")));
        }
        assert!(replies_in(&out).is_empty());
    }

    #[test]
    fn a_reply_to_a_closed_connection_is_dropped() {
        let replies = Arc::new(DirectReplies::default());
        let out = outbox();
        let a = address(4);
        let _reg = replies.register(a, &out).unwrap();
        out.close();
        assert!(!replies.deliver(&a, message(b"late")));
        let gone = outbox();
        let b = address(5);
        let _reg_b = replies.register(b, &gone).unwrap();
        drop(gone);
        assert!(!replies.deliver(&b, message(b"later")));
    }
}
