//! Direct reply-to on a channel: consuming the pseudo-queue `amq.rabbitmq.reply-to`, the
//! rewriting of `reply_to` on publish, declares of reply names, and delivering replies.
//!
//! The rules and texts are RabbitMQ 3.10's (`rabbit_channel`, checked against a 3.10.8
//! node): a reply consumer must be `no_ack` (406 "reply consumer cannot acknowledge"), a
//! channel has one at most (406 "reply consumer already set"), a publish whose `reply_to` is
//! the pseudo-queue needs one (406 "fast reply consumer does not exist"), and every declare
//! of a name starting with `amq.rabbitmq.reply-to` is passive: declare-ok with 0 messages and
//! 1 consumer when it names a live reply consumer, 404 otherwise. The names and the node's
//! table of reply consumers are [`crate::broker::direct_reply`]'s.

use std::sync::Arc;

use amq_protocol::protocol::basic::{self, AMQPProperties};
use amq_protocol::protocol::{queue as qm, AMQPClass};

use super::{ok_or_nowait, Channel};
use crate::amqp::frame;
use crate::amqp::reply_code::{not_allowed, not_found, precondition_failed, AmqpError};
use crate::amqp::short;
use crate::broker::direct_reply::{ReplyAddress, ReplyKey, ReplyRegistration, REPLY_QUEUE};
use crate::broker::remote::{QueueCall, RemoteQueue};
use crate::broker::Message;
use crate::session::connection::Connection;
use crate::session::meta::Then;

/// A channel's direct reply-to consumer.
#[derive(Debug)]
pub(super) struct ReplyConsumer {
    /// Its consumer tag.
    tag: String,
    /// Its entry in the node's table, and its reply name; dropped with the consumer.
    registration: ReplyRegistration,
}

impl Channel {
    /// basic.consume of `amq.rabbitmq.reply-to` (after the `""` shortcut was resolved, as
    /// RabbitMQ expands it before it looks at the name). No permission is checked: the
    /// pseudo-queue is no resource of the vhost, as in RabbitMQ.
    pub(super) fn consume_reply(
        &mut self,
        c: &mut Connection,
        m: basic::Consume,
    ) -> Result<(), AmqpError> {
        let given = m.consumer_tag.as_str();
        // Only the channel's queue consumers count for reuse (RabbitMQ's consumer_mapping).
        if self.consumers.contains_key(given) {
            return Err(not_allowed(format!(
                "attempt to reuse consumer tag '{given}'"
            )));
        }
        if !m.no_ack {
            return Err(precondition_failed("reply consumer cannot acknowledge"));
        }
        if self.reply_consumer.is_some() {
            return Err(precondition_failed("reply consumer already set"));
        }
        let tag = if given.is_empty() {
            c.broker.generate_consumer_tag()
        } else {
            given.to_string()
        };
        let registration = c
            .broker
            .register_reply_consumer(c.id, self.id, &self.link.outbox);
        if !m.nowait {
            c.send_method(
                self.id,
                AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                    consumer_tag: short(&tag),
                })),
            );
        }
        self.reply_consumer = Some(ReplyConsumer { tag, registration });
        Ok(())
    }

    /// basic.cancel of the reply consumer; false when `tag` is not its tag (the caller
    /// looks among the queue consumers). RabbitMQ checks the reply consumer first too.
    pub(super) fn cancel_reply(&mut self, c: &mut Connection, tag: &str, nowait: bool) -> bool {
        if self.reply_consumer.as_ref().is_none_or(|r| r.tag != tag) {
            return false;
        }
        self.reply_consumer = None;
        ok_or_nowait(
            c,
            self.id,
            nowait,
            AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                consumer_tag: short(tag),
            })),
        );
        true
    }

    /// The `reply_to` a publish must carry instead of its own: the channel's reply name when
    /// it is the pseudo-queue (`None`: leave it as it is).
    pub(super) fn rewritten_reply_to(
        &self,
        properties: &AMQPProperties,
    ) -> Result<Option<String>, AmqpError> {
        if properties.reply_to().as_ref().map(|r| r.as_str()) != Some(REPLY_QUEUE) {
            return Ok(None);
        }
        match &self.reply_consumer {
            Some(r) => Ok(Some(r.registration.name().to_string())),
            None => Err(precondition_failed("fast reply consumer does not exist")),
        }
    }

    /// queue.declare of a name starting with `amq.rabbitmq.reply-to`, passive or not: the
    /// pseudo-queue itself always exists; a reply name exists while its consumer does (asked
    /// of its node when that is another); anything else is 404.
    ///
    /// Two answers differ from RabbitMQ 3.10, which fails them with 541 INTERNAL_ERROR and
    /// closes the connection: a name whose suffix does not decode is 404, and the channel's
    /// own reply name is declare-ok (RabbitMQ's channel calls itself and times out).
    pub(super) fn declare_reply_queue(
        &mut self,
        c: &mut Connection,
        name: &str,
        nowait: bool,
    ) -> Result<(), AmqpError> {
        // RabbitMQ strips CR and LF from these names only.
        let name: String = name
            .chars()
            .filter(|ch| !matches!(ch, '\r' | '\n'))
            .collect();
        let exists = if name == REPLY_QUEUE {
            true
        } else {
            match ReplyAddress::parse(&name) {
                Ok(a) if a.node == c.broker.node_id() => c.broker.direct_replies().contains(&a),
                Ok(a) => {
                    let link = c.broker.remote_link().cloned();
                    match link.filter(|_| !c.broker.node_is_down(a.node)) {
                        Some(link) => {
                            // Its node answers as for a queue's counts: 0 and 1, or 404.
                            let queue = Arc::new(RemoteQueue {
                                node: a.node,
                                vhost: c.vhost.clone(),
                                name: name.clone(),
                                instance: 0,
                                link,
                            });
                            c.park_call(
                                self.id,
                                QueueCall::Counts { queue },
                                Then::QueueDeclareCounts { name, nowait },
                            );
                            return Ok(());
                        }
                        None => false,
                    }
                }
                Err(_) => false,
            }
        };
        if !exists {
            return Err(not_found(format!(
                "no queue '{name}' in vhost '{}'",
                c.vhost
            )));
        }
        ok_or_nowait(
            c,
            self.id,
            nowait,
            AMQPClass::Queue(qm::AMQPMethod::DeclareOk(qm::DeclareOk {
                queue: short(&name),
                message_count: 0,
                consumer_count: 1,
            })),
        );
        self.last_queue = Some(name);
        Ok(())
    }

    /// Encodes a reply from the outbox for the reply consumer, if `key` is still its key (a
    /// reply that a cancel, or a new consume, overtook is dropped, as in RabbitMQ).
    ///
    /// Unlike RabbitMQ 3.10, which sends every reply with the channel's next delivery tag
    /// without advancing it, each reply takes a tag of its own, so tags stay unique on the
    /// channel; replies are never acknowledged, so no client depends on either.
    pub(crate) fn encode_reply(
        &mut self,
        out: &mut Vec<u8>,
        frame_max: u32,
        key: ReplyKey,
        message: &Message,
    ) {
        let Some(r) = &self.reply_consumer else {
            return;
        };
        if r.registration.address().key != key {
            return;
        }
        let tag = self.next_delivery_tag;
        self.next_delivery_tag += 1;
        frame::encode_deliver(
            out,
            self.id,
            &r.tag,
            tag,
            false,
            &message.exchange,
            &message.routing_key,
        );
        frame::encode_content(
            out,
            self.id,
            &message.properties_raw,
            &message.body,
            frame_max,
        );
    }
}

#[cfg(test)]
#[path = "direct_reply_tests.rs"]
mod tests;
