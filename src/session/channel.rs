//! One channel: its methods, content assembly, delivery tags, confirms and transactions.
//!
//! The metadata methods (exchange.*, queue.*) live in `channel/metadata.rs`: they emit
//! commands and park the channel until the result comes back (see [`crate::session::meta`]).
//! Direct reply-to (the `amq.rabbitmq.reply-to` pseudo-queue) is `channel/direct_reply.rs`.

mod direct_reply;
mod metadata;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use amq_protocol::protocol::{access, basic, channel as chm, confirm, tx, AMQPClass};
use amq_protocol::types::AMQPValue;
use bytes::BytesMut;

use super::connection::Connection;
use super::meta::Then;
use super::permissions::Access;
use crate::amqp::frame::{self, ContentHeader, Frame, FrameKind};
use crate::amqp::reply_code::{
    access_refused, command_invalid, frame_error, not_allowed, not_found, not_implemented,
    precondition_failed, resource_locked, unexpected_frame, AmqpError,
};
use crate::amqp::{short, ReplyCode};
use crate::broker::registry::{ChannelHandle, ConsumerInfo};
use crate::broker::remote::{QueueCall, RemoteGot};
use crate::broker::{
    ChannelKey, ChannelLink, Consumer, Delivery, Durability, Message, Outbox, QueueHandle,
    QueueRef, RemoteConsumer, RemoteOutcomes, Settle,
};
use crate::meta::Command;
use crate::metrics::Metrics;
use crate::time::Instant;

/// basic.publish's class and method ids, named by the errors of a publish's checks.
const BASIC_CLASS: u16 = 60;
const BASIC_PUBLISH: u16 = 40;

#[derive(Debug)]
struct PendingPublish {
    exchange: String,
    routing_key: String,
    mandatory: bool,
    header: Option<ContentHeader>,
    body: BytesMut,
}

#[derive(Debug)]
struct UnackedRef {
    queue: QueueRef,
    seq: u64,
}

#[derive(Debug)]
struct ConsumerRef {
    queue: QueueRef,
    /// How to attach it again when the queue moves to another node (a failover, a planned
    /// move: [`Channel::handle_rehome`]).
    resume: Resume,
}

/// What re-attaching a consumer takes.
#[derive(Debug, Clone)]
struct Resume {
    queue: String,
    no_ack: bool,
    priority: i32,
    exclusive: bool,
    cancel_on_ha_failover: bool,
}

#[derive(Debug)]
enum TxAck {
    Ack {
        tag: u64,
        multiple: bool,
    },
    Nack {
        tag: u64,
        multiple: bool,
        requeue: bool,
    },
}

#[derive(Debug, Default)]
struct Tx {
    /// (exchange, message, mandatory, the keys of its removed `BCC` header).
    publishes: Vec<(String, Arc<Message>, bool, Vec<String>)>,
    acks: Vec<TxAck>,
}

/// Replies waiting to be sent, in order: sent at the end of a read batch (coalesced), or
/// once the disk has what they promise.
#[derive(Debug, Default)]
struct Confirms {
    pending: Vec<Waiting>,
    /// A tx.commit some of whose publishes were refused: the channel must fail the
    /// commit (RabbitMQ's 406 "partial tx completion"), never answer commit-ok.
    failed_commit: bool,
}

/// A reply that may have to wait for a group commit.
#[derive(Debug, Clone, Copy)]
enum Waiting {
    /// basic.ack / basic.nack for a publish.
    Confirm {
        /// Publish sequence number.
        seq: u64,
        /// When the publish came (for the confirm latency).
        at: Instant,
        /// Ack (true) or nack.
        ack: bool,
        /// Group-commit ticket (0: none).
        ticket: u64,
        /// Outcome of the part forwarded to other nodes (0: none).
        remote: u64,
    },
    /// tx.commit-ok.
    CommitOk {
        /// Every publish was taken by every queue it was routed to on this node (false:
        /// the commit fails, as a nack would for a confirm).
        taken: bool,
        /// Group-commit ticket (0: none).
        ticket: u64,
        /// Outcome of the parts forwarded to other nodes (0: none).
        remote: u64,
    },
}

/// RabbitMQ's answer to a method only a server sends (a client's `queue.declare-ok`,
/// `channel.close-ok` out of turn, ...): 503, the connection closed.
pub(super) fn unimplemented_method() -> AmqpError {
    command_invalid("unimplemented method")
}

/// Why a queue this node does not run cannot be used: it does not exist, or it lives on
/// another node of the cluster.
pub(super) fn unavailable_queue(c: &Connection, name: &str) -> AmqpError {
    let vhost = &c.vhost;
    let snapshot = c.broker.snapshot();
    let Some(def) = snapshot.vhost(vhost).and_then(|v| v.queues.get(name)) else {
        return not_found(format!("no queue '{name}' in vhost '{vhost}'"));
    };
    let node = snapshot
        .nodes
        .get(&def.home)
        .map_or_else(|| def.home.to_string(), |n| n.name.clone());
    if c.broker.node_is_down(def.home) {
        // RabbitMQ's answer for a classic queue whose node is down.
        return not_found(format!(
            "home node '{node}' of durable queue '{name}' in vhost '{vhost}' is down or inaccessible"
        ));
    }
    // Every method reaches a queue of another live node through the relay; this is left
    // for a queue this node cannot reach at the moment (its own, still recovering; or one
    // whose node the relay cannot serve yet).
    not_found(format!(
        "queue '{name}' in vhost '{vhost}' on node '{node}' cannot be reached from this node now"
    ))
}

/// 405 for a queue exclusive to another connection, in RabbitMQ's words.
pub(super) fn locked_queue(c: &Connection, name: &str) -> AmqpError {
    resource_locked(format!(
        "cannot obtain exclusive access to locked queue '{name}' in vhost '{}'. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration.",
        c.vhost
    ))
}

impl Waiting {
    fn ticket(&self) -> u64 {
        match self {
            Waiting::Confirm { ticket, .. } | Waiting::CommitOk { ticket, .. } => *ticket,
        }
    }

    fn remote(&self) -> u64 {
        match self {
            Waiting::Confirm { remote, .. } | Waiting::CommitOk { remote, .. } => *remote,
        }
    }
}

/// A channel's state.
#[derive(Debug)]
pub struct Channel {
    id: u16,
    link: Arc<ChannelLink>,
    closing: bool,
    content: Option<PendingPublish>,
    next_delivery_tag: u64,
    unacked: BTreeMap<u64, UnackedRef>,
    consumers: BTreeMap<String, ConsumerRef>,
    /// The direct reply-to consumer, if any (not among `consumers`: it has no queue).
    reply_consumer: Option<direct_reply::ReplyConsumer>,
    prefetch: u16,
    confirm: bool,
    next_publish_seq: u64,
    confirms: Confirms,
    tx: Option<Tx>,
    last_queue: Option<String>,
    /// The exchange last published to: the metadata version it was looked up at, its
    /// name and whether it is internal. A publisher names the same exchange again and
    /// again, and the lookup was a tenth of one node's CPU with small messages; the
    /// version (not the snapshot) is kept, so an idle channel pins no old metadata.
    last_exchange: Option<(u64, String, bool)>,
    /// This channel's entry in the broker's session registry: updated when what it shows
    /// changes (counts with a relaxed store, no lock).
    listed: ChannelHandle,
    /// The node's Prometheus counters.
    metrics: Arc<Metrics>,
}

impl Drop for Channel {
    fn drop(&mut self) {
        // A channel is dropped once, when it is gone for good (closed, or its connection).
        self.metrics.channels_closed.inc();
    }
}

/// Counts a routed publish, or an unroutable one as returned or dropped.
fn count_routing(metrics: &Metrics, outcome: &crate::broker::PublishOutcome, mandatory: bool) {
    if outcome.routed > 0 {
        metrics.routed.inc();
    } else if outcome.rejected {
        // Not routed at all (the node's routing lease lapsed): neither returned nor dropped
        // as unroutable.
    } else if mandatory {
        metrics.unroutable_returned.inc();
    } else {
        metrics.unroutable_dropped.inc();
    }
}

fn ok_or_nowait(c: &mut Connection, ch: u16, nowait: bool, m: AMQPClass) {
    if !nowait {
        c.send_method(ch, m);
    }
}

impl Channel {
    /// A newly opened channel, shown in listings through `listed`.
    pub fn new(
        conn_id: u64,
        id: u16,
        outbox: Arc<Outbox>,
        listed: ChannelHandle,
        metrics: Arc<Metrics>,
    ) -> Channel {
        metrics.channels_opened.inc();
        Channel {
            id,
            link: Arc::new(ChannelLink::new(conn_id, id, outbox)),
            closing: false,
            content: None,
            next_delivery_tag: 1,
            unacked: BTreeMap::new(),
            consumers: BTreeMap::new(),
            reply_consumer: None,
            prefetch: 0,
            confirm: false,
            next_publish_seq: 1,
            confirms: Confirms::default(),
            tx: None,
            last_queue: None,
            last_exchange: None,
            listed,
            metrics,
        }
    }

    /// Whether we sent channel.close and wait for close-ok.
    pub fn is_closing(&self) -> bool {
        self.closing
    }

    /// Marks the channel as closing.
    pub fn set_closing(&mut self) {
        self.closing = true;
    }

    /// Handles a method for this channel.
    pub fn handle_method(
        &mut self,
        c: &mut Connection,
        method: AMQPClass,
        now: Instant,
    ) -> Result<(), AmqpError> {
        if let Some(pending) = &self.content {
            // RabbitMQ's texts, naming the publish whose content was interrupted.
            let text = if pending.header.is_none() {
                "expected content header for class 60, got non content header frame instead"
            } else {
                "expected content body, got non content body frame instead"
            };
            return Err(unexpected_frame(text).at(BASIC_CLASS, BASIC_PUBLISH));
        }
        let ch = self.id;
        match method {
            // RabbitMQ 3.10 does not implement stopping a channel's deliveries with
            // channel.flow: 540, the connection closed (prefetch is the way).
            AMQPClass::Channel(chm::AMQPMethod::Flow(f)) if !f.active => {
                Err(not_implemented("active=false"))
            }
            AMQPClass::Channel(chm::AMQPMethod::Flow(f)) => {
                self.link.flow_active.store(f.active, Ordering::Release);
                c.send_method(
                    ch,
                    AMQPClass::Channel(chm::AMQPMethod::FlowOk(chm::FlowOk { active: f.active })),
                );
                if f.active {
                    self.poke_consumed_queues(c, now);
                }
                Ok(())
            }
            // Neither Warren nor RabbitMQ sends channel.flow, so a flow-ok answers nothing.
            AMQPClass::Channel(chm::AMQPMethod::FlowOk(_)) => Err(unimplemented_method()),
            AMQPClass::Access(access::AMQPMethod::Request(_)) => {
                c.send_method(
                    ch,
                    AMQPClass::Access(access::AMQPMethod::RequestOk(access::RequestOk {})),
                );
                Ok(())
            }
            AMQPClass::Exchange(m) => self.handle_exchange(c, m),
            AMQPClass::Queue(m) => self.handle_queue(c, m),
            AMQPClass::Basic(m) => self.handle_basic(c, m, now),
            AMQPClass::Confirm(confirm::AMQPMethod::Select(s)) => {
                if self.tx.is_some() {
                    return Err(precondition_failed("cannot switch from tx to confirm mode"));
                }
                self.confirm = true;
                self.listed.set_confirm();
                ok_or_nowait(
                    c,
                    ch,
                    s.nowait,
                    AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
                );
                Ok(())
            }
            AMQPClass::Tx(m) => self.handle_tx(c, m, now),
            _ => Err(unimplemented_method()),
        }
    }

    // ---- queue.* ----

    fn resolve_queue_name(&self, name: &str, vhost: &str) -> Result<String, AmqpError> {
        if !name.is_empty() {
            return Ok(name.to_string());
        }
        self.last_queue
            .clone()
            // RabbitMQ looks the empty name up as it is.
            .ok_or_else(|| not_found(format!("no queue '' in vhost '{vhost}'")))
    }

    /// The queue, checking existence (404) and exclusivity (405).
    fn queue_handle(&self, c: &Connection, name: &str) -> Result<Arc<QueueHandle>, AmqpError> {
        let h = c
            .broker
            .queue(&c.vhost, name)
            .ok_or_else(|| unavailable_queue(c, name))?;
        if h.lock().exclusive_owner().is_some_and(|o| o != c.id) {
            return Err(locked_queue(c, name));
        }
        Ok(h)
    }

    // ---- basic.* ----

    fn handle_basic(
        &mut self,
        c: &mut Connection,
        m: basic::AMQPMethod,
        now: Instant,
    ) -> Result<(), AmqpError> {
        let ch = self.id;
        match m {
            basic::AMQPMethod::Qos(q) => {
                if q.global {
                    self.link
                        .global_prefetch
                        .store(q.prefetch_count as u32, Ordering::Release);
                    self.listed.set_global_prefetch(q.prefetch_count as u32);
                    self.poke_consumed_queues(c, now);
                } else {
                    self.prefetch = q.prefetch_count;
                    self.listed.set_prefetch(q.prefetch_count as u32);
                }
                c.send_method(
                    ch,
                    AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})),
                );
                Ok(())
            }
            basic::AMQPMethod::Consume(m) => self.consume(c, m, now),
            basic::AMQPMethod::Cancel(m) => {
                let tag = m.consumer_tag.as_str().to_string();
                if self.cancel_reply(c, &tag, m.nowait) {
                    return Ok(());
                }
                let auto_delete = match self.consumers.remove(&tag) {
                    Some(cons) => {
                        self.listed.remove_consumer(&tag);
                        self.detach_consumer(c, &cons.queue, &tag, now)
                    }
                    None => None,
                };
                if let Some(command) = auto_delete {
                    // cancel-ok follows the queue's deletion, as it did when it was synchronous.
                    c.park(
                        ch,
                        command,
                        Then::BasicCancel {
                            consumer_tag: m.consumer_tag,
                            nowait: m.nowait,
                        },
                    );
                    return Ok(());
                }
                ok_or_nowait(
                    c,
                    ch,
                    m.nowait,
                    AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                        consumer_tag: m.consumer_tag,
                    })),
                );
                Ok(())
            }
            basic::AMQPMethod::Publish(p) => {
                if p.immediate {
                    return Err(not_implemented("immediate=true"));
                }
                self.content = Some(PendingPublish {
                    exchange: p.exchange.as_str().to_string(),
                    routing_key: p.routing_key.as_str().to_string(),
                    mandatory: p.mandatory,
                    header: None,
                    body: BytesMut::new(),
                });
                Ok(())
            }
            basic::AMQPMethod::Get(g) => self.get(c, g, now),
            basic::AMQPMethod::Ack(a) => {
                if self.tx.is_some() {
                    self.check_tags(a.delivery_tag, a.multiple)?;
                    self.tx_acks().push(TxAck::Ack {
                        tag: a.delivery_tag,
                        multiple: a.multiple,
                    });
                    return Ok(());
                }
                self.settle(c, a.delivery_tag, a.multiple, None, now)
            }
            basic::AMQPMethod::Nack(n) => {
                if self.tx.is_some() {
                    self.check_tags(n.delivery_tag, n.multiple)?;
                    self.tx_acks().push(TxAck::Nack {
                        tag: n.delivery_tag,
                        multiple: n.multiple,
                        requeue: n.requeue,
                    });
                    return Ok(());
                }
                self.settle(c, n.delivery_tag, n.multiple, Some(n.requeue), now)
            }
            basic::AMQPMethod::Reject(r) => {
                if self.tx.is_some() {
                    self.check_tags(r.delivery_tag, false)?;
                    self.tx_acks().push(TxAck::Nack {
                        tag: r.delivery_tag,
                        multiple: false,
                        requeue: r.requeue,
                    });
                    return Ok(());
                }
                self.settle(c, r.delivery_tag, false, Some(r.requeue), now)
            }
            basic::AMQPMethod::Recover(r) => {
                if !r.requeue {
                    return Err(not_implemented("requeue=false"));
                }
                self.requeue_all(c, now);
                c.send_method(
                    ch,
                    AMQPClass::Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {})),
                );
                Ok(())
            }
            basic::AMQPMethod::RecoverAsync(r) => {
                if !r.requeue {
                    return Err(not_implemented("requeue=false"));
                }
                self.requeue_all(c, now);
                Ok(())
            }
            _ => Err(unimplemented_method()),
        }
    }

    fn consume(
        &mut self,
        c: &mut Connection,
        m: basic::Consume,
        now: Instant,
    ) -> Result<(), AmqpError> {
        let name = self.resolve_queue_name(m.queue.as_str(), &c.vhost)?;
        if name == crate::broker::direct_reply::REPLY_QUEUE {
            return self.consume_reply(c, m);
        }
        perms(c)?.check(Access::Read, "queue", &name)?;
        let remote = match c.broker.queue(&c.vhost, &name) {
            Some(_) => None,
            None => c.broker.remote_queue(&c.vhost, &name),
        };
        let h = match &remote {
            Some(_) => None,
            None => Some(self.queue_handle(c, &name)?),
        };
        let tag = if m.consumer_tag.as_str().is_empty() {
            c.broker.generate_consumer_tag()
        } else {
            m.consumer_tag.as_str().to_string()
        };
        if self.consumers.contains_key(&tag) {
            return Err(not_allowed(format!(
                "attempt to reuse consumer tag '{tag}'"
            )));
        }
        let priority = match m.arguments.inner().get("x-priority") {
            None => 0,
            Some(v) => match v {
                AMQPValue::ShortShortInt(x) => *x as i32,
                AMQPValue::ShortShortUInt(x) => *x as i32,
                AMQPValue::ShortInt(x) => *x as i32,
                AMQPValue::ShortUInt(x) => *x as i32,
                AMQPValue::LongInt(x) => *x,
                AMQPValue::LongUInt(x) => *x as i32,
                AMQPValue::LongLongInt(x) => *x as i32,
                other => {
                    return Err(precondition_failed(format!(
                        "invalid arg 'x-priority' for queue '{name}' in vhost '{}': \"expected integer, got {}\"",
                        c.vhost,
                        crate::meta::equivalence::type_name(other)
                    )))
                }
            },
        };
        let cancel_on_ha_failover = matches!(
            m.arguments.inner().get("x-cancel-on-ha-failover"),
            Some(AMQPValue::Boolean(true))
        );
        if let Some(rq) = remote {
            // A queue of another node: its node attaches the consumer and checks
            // exclusivity; a refusal there comes back as a consumer cancel.
            if !m.nowait {
                c.send_method(
                    self.id,
                    AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                        consumer_tag: short(&tag),
                    })),
                );
            }
            let key = ChannelKey {
                conn: c.id,
                channel: self.id,
            };
            self.listed.add_consumer(ConsumerInfo {
                tag: tag.clone(),
                queue: name,
                ack_required: !m.no_ack,
                prefetch: self.prefetch as u32,
                exclusive: m.exclusive,
                arguments: m.arguments,
            });
            rq.link.consume(
                &rq,
                key,
                &c.outbox,
                RemoteConsumer {
                    tag: Arc::from(tag.as_str()),
                    no_ack: m.no_ack,
                    prefetch: self.prefetch as u32,
                    global_prefetch: self.link.global_prefetch.load(Ordering::Acquire),
                    priority,
                    exclusive: m.exclusive,
                    cancel_on_ha_failover,
                },
            );
            let resume = Resume {
                queue: rq.name.clone(),
                no_ack: m.no_ack,
                priority,
                exclusive: m.exclusive,
                cancel_on_ha_failover,
            };
            self.consumers.insert(
                tag,
                ConsumerRef {
                    queue: QueueRef::Remote(rq),
                    resume,
                },
            );
            return Ok(());
        }
        let Some(h) = h else {
            return Err(self.queue_handle(c, &name).err().unwrap_or_else(|| {
                not_found(format!("no queue '{name}' in vhost '{}'", c.vhost))
            }));
        };
        let consumer = Consumer {
            tag: Arc::from(tag.as_str()),
            link: self.link.clone(),
            no_ack: m.no_ack,
            prefetch: self.prefetch as u32,
            priority,
            exclusive: m.exclusive,
            in_flight: Arc::new(AtomicU32::new(0)),
        };
        // consume-ok must precede the first delivery: check, answer, then attach, all under
        // the queue's lock so no other consumer can slip in between.
        let dead = {
            let mut q = h.lock();
            q.check_new_consumer(&h, m.exclusive)?;
            if !m.nowait {
                c.send_method(
                    self.id,
                    AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                        consumer_tag: short(&tag),
                    })),
                );
            }
            q.add_consumer(&h, consumer, now)
        };
        if !dead.is_empty() {
            c.broker.dead_letter(&h, dead, now);
        }
        // What it takes to consume again elsewhere if the queue moves to another node (a
        // mirror promoted, a planned move): see `handle_rehome`.
        let resume = Resume {
            queue: name.clone(),
            no_ack: m.no_ack,
            priority,
            exclusive: m.exclusive,
            cancel_on_ha_failover,
        };
        self.listed.add_consumer(ConsumerInfo {
            tag: tag.clone(),
            queue: name,
            ack_required: !m.no_ack,
            prefetch: self.prefetch as u32,
            exclusive: m.exclusive,
            arguments: m.arguments,
        });
        self.consumers.insert(
            tag,
            ConsumerRef {
                queue: QueueRef::Local(h),
                resume,
            },
        );
        Ok(())
    }

    fn get(&mut self, c: &mut Connection, g: basic::Get, now: Instant) -> Result<(), AmqpError> {
        let name = self.resolve_queue_name(g.queue.as_str(), &c.vhost)?;
        perms(c)?.check(Access::Read, "queue", &name)?;
        if c.broker.queue(&c.vhost, &name).is_none() {
            if let Some(queue) = c.broker.remote_queue(&c.vhost, &name) {
                // Its node takes the message; the channel waits for it (get-ok or
                // get-empty come in order with the channel's other replies).
                let key = ChannelKey {
                    conn: c.id,
                    channel: self.id,
                };
                c.park_call(
                    self.id,
                    QueueCall::Get {
                        queue: queue.clone(),
                        key,
                        no_ack: g.no_ack,
                    },
                    Then::BasicGet {
                        queue,
                        no_ack: g.no_ack,
                    },
                );
                return Ok(());
            }
        }
        let h = self.queue_handle(c, &name)?;
        let mut dead = Vec::new();
        let got = h.lock().get(now, !g.no_ack, &mut dead);
        if !dead.is_empty() {
            c.broker.dead_letter(&h, dead, now);
        }
        let got = got.map(|(entry, remaining)| RemoteGot {
            seq: entry.seq,
            redelivered: entry.redelivered,
            message: entry.message.clone(),
            remaining,
            source: None,
        });
        self.send_get_reply(c, QueueRef::Local(h), got, g.no_ack);
        Ok(())
    }

    /// get-ok with the message (recorded as unacked unless `no_ack`), or get-empty.
    pub(super) fn send_get_reply(
        &mut self,
        c: &mut Connection,
        queue: QueueRef,
        got: Option<RemoteGot>,
        no_ack: bool,
    ) {
        let Some(got) = got else {
            self.metrics.get_empty.inc();
            c.send_method(
                self.id,
                AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
            );
            return;
        };
        if no_ack {
            self.metrics.delivered_get_auto_ack.inc();
        } else {
            self.metrics.delivered_get_manual_ack.inc();
        }
        if got.redelivered {
            self.metrics.redelivered.inc();
        }
        let tag = self.next_delivery_tag;
        self.next_delivery_tag += 1;
        if !no_ack {
            self.unacked.insert(
                tag,
                UnackedRef {
                    queue,
                    seq: got.seq,
                },
            );
            self.listed.set_unacked(self.unacked.len());
        }
        let msg = &got.message;
        c.send_method(
            self.id,
            AMQPClass::Basic(basic::AMQPMethod::GetOk(basic::GetOk {
                delivery_tag: tag,
                redelivered: got.redelivered,
                exchange: short(&msg.exchange),
                routing_key: short(&msg.routing_key),
                message_count: got.remaining,
            })),
        );
        frame::encode_content(
            &mut c.out,
            self.id,
            &msg.properties_raw,
            &msg.body,
            c.frame_max,
        );
    }

    fn tx_acks(&mut self) -> &mut Vec<TxAck> {
        &mut self.tx.get_or_insert_with(Tx::default).acks
    }

    /// Checks that `tag` (and with `multiple`, at least something up to it) is outstanding.
    fn check_tags(&self, tag: u64, multiple: bool) -> Result<(), AmqpError> {
        let ok = if multiple {
            tag == 0 || self.unacked.range(..=tag).next().is_some()
        } else {
            self.unacked.contains_key(&tag)
        };
        if ok {
            Ok(())
        } else {
            Err(precondition_failed(format!("unknown delivery tag {tag}")))
        }
    }

    fn take_tags(&mut self, tag: u64, multiple: bool) -> Result<Vec<UnackedRef>, AmqpError> {
        self.check_tags(tag, multiple)?;
        if multiple {
            let keys: Vec<u64> = if tag == 0 {
                self.unacked.keys().copied().collect()
            } else {
                self.unacked.range(..=tag).map(|(k, _)| *k).collect()
            };
            Ok(keys
                .into_iter()
                .filter_map(|k| self.unacked.remove(&k))
                .collect())
        } else {
            Ok(self.unacked.remove(&tag).into_iter().collect())
        }
    }

    /// ack (`requeue` None) or nack/reject (`Some(requeue)`).
    fn settle(
        &mut self,
        c: &mut Connection,
        tag: u64,
        multiple: bool,
        requeue: Option<bool>,
        now: Instant,
    ) -> Result<(), AmqpError> {
        let refs = self.take_tags(tag, multiple)?;
        if requeue.is_none() {
            self.metrics.acknowledged.inc_by(refs.len() as u64);
        }
        self.listed.set_unacked(self.unacked.len());
        settle_refs(c, self.id, refs, requeue, now);
        if self.link.global_prefetch.load(Ordering::Acquire) != 0 {
            // Channel-wide credit came back: other queues may be waiting on it.
            self.poke_consumed_queues(c, now);
        }
        Ok(())
    }

    fn requeue_all(&mut self, c: &mut Connection, now: Instant) {
        let refs: Vec<UnackedRef> = std::mem::take(&mut self.unacked).into_values().collect();
        self.listed.set_unacked(0);
        settle_refs(c, self.id, refs, Some(true), now);
    }

    fn poke_consumed_queues(&self, c: &Connection, now: Instant) {
        let mut seen: Vec<*const QueueHandle> = Vec::new();
        for cons in self.consumers.values() {
            // A queue of another node gets its credit back with the ack itself.
            let QueueRef::Local(q) = &cons.queue else {
                continue;
            };
            let p = Arc::as_ptr(q);
            if seen.contains(&p) {
                continue;
            }
            seen.push(p);
            let mut dead = Vec::new();
            q.lock().deliver(q, now, &mut dead);
            if !dead.is_empty() {
                c.broker.dead_letter(q, dead, now);
            }
        }
    }

    /// Removes a consumer from its queue; returns the command deleting the queue when it was
    /// the last consumer of an auto-delete queue.
    fn detach_consumer(
        &self,
        c: &Connection,
        queue: &QueueRef,
        tag: &str,
        now: Instant,
    ) -> Option<Command> {
        let queue = match queue {
            QueueRef::Local(q) => q,
            QueueRef::Remote(r) => {
                // Its node detaches it, and deletes the queue if it auto-deletes.
                let key = ChannelKey {
                    conn: c.id,
                    channel: self.id,
                };
                r.link.cancel(r, key, tag);
                return None;
            }
        };
        let link = &self.link;
        let auto_delete = queue
            .lock()
            .remove_consumers(now, |k| &*k.tag == tag && Arc::ptr_eq(&k.link, link));
        if !auto_delete {
            return None;
        }
        metadata::auto_delete(c, &queue.vhost, &queue.name)
    }

    // ---- content ----

    /// Handles a content header or body frame.
    pub fn handle_content(
        &mut self,
        c: &mut Connection,
        f: Frame<'_>,
        now: Instant,
    ) -> Result<(), AmqpError> {
        let Some(pending) = self.content.as_mut() else {
            return Err(unexpected_frame(
                "expected method frame, got non method frame instead",
            ));
        };
        match f.kind {
            FrameKind::Header => {
                if pending.header.is_some() {
                    return Err(unexpected_frame("second content header"));
                }
                let h = frame::decode_content_header(f.payload)?;
                if h.class_id != 60 {
                    return Err(unexpected_frame(format!(
                        "expected content header for class 60, got one for class {} instead",
                        h.class_id
                    ))
                    .at(BASIC_CLASS, BASIC_PUBLISH));
                }
                if h.body_size > c.cfg.max_message_size {
                    self.content = None;
                    return Err(precondition_failed(format!(
                        "message size {} is larger than configured max size {}",
                        h.body_size, c.cfg.max_message_size
                    ))
                    .at(BASIC_CLASS, BASIC_PUBLISH));
                }
                // Reserve what is announced only up to 1 MiB: the announcement is not the data.
                pending.body.reserve((h.body_size as usize).min(1 << 20));
                pending.header = Some(h);
            }
            FrameKind::Body => {
                let Some(h) = &pending.header else {
                    return Err(unexpected_frame("content body before header"));
                };
                if pending.body.len() + f.payload.len() > h.body_size as usize {
                    return Err(frame_error("content body exceeds the size in its header"));
                }
                pending.body.extend_from_slice(f.payload);
            }
            _ => return Err(unexpected_frame("not a content frame")),
        }
        let complete = pending
            .header
            .as_ref()
            .is_some_and(|h| pending.body.len() as u64 == h.body_size);
        if complete {
            let p = self.content.take().expect("checked above");
            // The checks of a complete publish fail basic.publish, which the close names
            // (RabbitMQ checks them while it handles the method).
            self.publish(c, p, now)
                .map_err(|e| e.at(BASIC_CLASS, BASIC_PUBLISH))?;
        }
        Ok(())
    }

    fn publish(
        &mut self,
        c: &mut Connection,
        p: PendingPublish,
        now: Instant,
    ) -> Result<(), AmqpError> {
        let header = p.header.expect("complete publish has a header");
        crate::broker::message::validate_expiration(&header.properties)
            .map_err(precondition_failed)?;
        crate::broker::message::validate_delivery_mode(&header.properties)
            .map_err(precondition_failed)?;
        let seq = if self.confirm {
            let s = self.next_publish_seq;
            self.next_publish_seq += 1;
            Some(s)
        } else {
            None
        };
        let snapshot = c.snapshot();
        let vhost = snapshot
            .vhost(&c.vhost)
            .ok_or_else(|| not_found(format!("vhost '{}' gone", c.vhost)))?;
        let internal = match &self.last_exchange {
            Some((version, name, internal))
                if *version == snapshot.version && *name == p.exchange =>
            {
                *internal
            }
            _ => {
                let exchange = vhost.exchanges.get(&p.exchange).ok_or_else(|| {
                    not_found(format!(
                        "no exchange '{}' in vhost '{}'",
                        p.exchange, c.vhost
                    ))
                })?;
                self.last_exchange =
                    Some((snapshot.version, p.exchange.clone(), exchange.internal));
                exchange.internal
            }
        };
        if internal {
            return Err(access_refused(format!(
                "cannot publish to internal exchange '{}' in vhost '{}'",
                p.exchange, c.vhost
            )));
        }
        perms(c)?.check(Access::Write, "exchange", &p.exchange)?;
        // Direct reply-to: at this point of the checks, as in RabbitMQ.
        let reply_to = self.rewritten_reply_to(&header.properties)?;
        if let Some(uid) = header.properties.user_id() {
            if uid.as_str() != c.user {
                return Err(precondition_failed(format!(
                    "user_id property set to '{}' but authenticated user was '{}'",
                    uid, c.user
                )));
            }
        }
        // Sender-selected distribution: CC and BCC must be arrays; BCC's keys route but the
        // header is not delivered.
        let headers = header.properties.headers().as_ref();
        if let Err((name, kind)) = crate::broker::exchange::sender_selected_keys(headers) {
            return Err(precondition_failed(format!(
                "invalid message: {{unacceptable_type_in_header,\"{name}\",{kind}}}"
            )));
        }
        let bcc = crate::broker::exchange::header_keys(headers, "BCC").unwrap_or_default();
        let strip_bcc = headers.is_some_and(|h| h.inner().contains_key("BCC"));
        // The properties are encoded again only when they change (as RabbitMQ clears the
        // encoded content then).
        let (properties_raw, properties) = if strip_bcc || reply_to.is_some() {
            let mut properties = header.properties.clone();
            if let Some(h) = headers.filter(|_| strip_bcc) {
                let mut kept = amq_protocol::types::FieldTable::default();
                for (k, v) in h.inner().iter().filter(|(k, _)| k.as_str() != "BCC") {
                    kept.insert(k.clone(), v.clone());
                }
                properties = properties.with_headers(kept);
            }
            if let Some(name) = reply_to {
                properties = properties.with_reply_to(name.into());
            }
            let raw = crate::amqp::frame::encode_properties(&properties);
            (bytes::Bytes::from(raw), properties)
        } else {
            (header.raw_properties, header.properties)
        };
        c.note_publish();
        self.metrics.received.inc();
        if self.confirm {
            self.metrics.received_confirm.inc();
        }
        let message = Arc::new(Message {
            id: c.broker.next_message_id(),
            exchange: p.exchange,
            routing_key: p.routing_key,
            properties_raw,
            properties,
            body: p.body.freeze(),
        });
        if let Some(tx) = &mut self.tx {
            tx.publishes
                .push((message.exchange.clone(), message, p.mandatory, bcc));
            return Ok(());
        }
        let outcome =
            c.broker
                .publish_with_bcc(vhost, &message.exchange, message.clone(), &bcc, now);
        count_routing(&self.metrics, &outcome, p.mandatory);
        if outcome.routed == 0 && !outcome.rejected && p.mandatory {
            self.send_return(c, &message);
        }
        if let Some(seq) = seq {
            self.confirms.pending.push(Waiting::Confirm {
                seq,
                at: now,
                ack: !outcome.rejected,
                ticket: outcome.ticket,
                remote: outcome.remote,
            });
        }
        Ok(())
    }

    fn send_return(&self, c: &mut Connection, message: &Message) {
        c.send_method(
            self.id,
            AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
                reply_code: ReplyCode::NoRoute.code(),
                reply_text: "NO_ROUTE".into(),
                exchange: short(&message.exchange),
                routing_key: short(&message.routing_key),
            })),
        );
        frame::encode_content(
            &mut c.out,
            self.id,
            &message.properties_raw,
            &message.body,
            c.frame_max,
        );
    }

    /// Emits what is ready, in order: confirms (a run of acks as one `multiple` ack) and
    /// tx.commit-ok, each once its group-commit ticket is durable. Returns whether something
    /// still waits for the disk (the caller registers to be woken).
    pub fn flush_confirms(
        &mut self,
        out: &mut Vec<u8>,
        durability: Option<&Durability>,
        remote: &RemoteOutcomes,
        now: Instant,
    ) -> bool {
        if self.confirms.pending.is_empty() {
            return false;
        }
        let failed = durability.is_some_and(|d| d.has_failed());
        let refused = |ticket: u64| durability.is_some_and(|d| d.is_refused(ticket));
        let ready = |w: &Waiting| {
            let ticket = w.ticket();
            (ticket == 0 || failed || durability.is_none_or(|d| d.is_durable(ticket)))
                && (w.remote() == 0 || remote.is_known(w.remote()))
        };
        let n_ready = self
            .confirms
            .pending
            .iter()
            .position(|w| !ready(w))
            .unwrap_or(self.confirms.pending.len());
        let mut emit: Vec<Waiting> = self.confirms.pending.drain(..n_ready).collect();
        // A part refused on another node (or lost with its link) makes the confirm a nack,
        // and a transaction's commit a failure.
        let mut refused_commit = vec![false; emit.len()];
        for (w, refused_commit) in emit.iter_mut().zip(&mut refused_commit) {
            if let Waiting::Confirm {
                ack, remote: id, ..
            } = w
            {
                if *id != 0 {
                    *ack &= remote.take(*id).unwrap_or(false);
                    *id = 0;
                }
            } else if let Waiting::CommitOk {
                taken,
                remote: id,
                ticket,
            } = w
            {
                let remote_taken = *id == 0 || remote.take(*id).unwrap_or(false);
                *refused_commit = !*taken || !remote_taken || refused(*ticket);
                *id = 0;
            }
        }
        if self.confirm {
            // Once per flush, not per publish: the count as of the end of the last read batch.
            self.listed.set_unconfirmed(self.confirms.pending.len());
        }
        // RabbitMQ's `coalesce_and_send` (3.10.8 `rabbit_channel`): of one batch, the nacks
        // below its first ack go as one `multiple` nack (even one alone), and the acks
        // below its first nack as one `multiple` ack (one alone: single); what follows
        // the other kind in the batch goes single. `requeue` keeps the record's default.
        let mut acked = false;
        let mut nacked = false;
        let nack = |w: &Waiting| matches!(w, Waiting::Confirm { ack, ticket, .. } if !*ack || refused(*ticket));
        let mut i = 0;
        while i < emit.len() {
            match emit[i] {
                Waiting::CommitOk { .. } if refused_commit[i] => {
                    // The client must not believe the transaction's messages safe. The
                    // channel closes (`take_failed_commit`): what follows is moot.
                    self.confirms.failed_commit = true;
                    break;
                }
                Waiting::CommitOk { .. } => {
                    frame::encode_method(
                        out,
                        self.id,
                        &AMQPClass::Tx(tx::AMQPMethod::CommitOk(tx::CommitOk {})),
                    );
                    i += 1;
                }
                Waiting::Confirm { .. } if nack(&emit[i]) => {
                    // Refused by a queue, storage failed before it was durable, or a
                    // mirrored queue's master was deposed before its mirrors had it: the
                    // publisher must not believe it safe.
                    let mut j = i;
                    while !acked && j + 1 < emit.len() && nack(&emit[j + 1]) {
                        j += 1;
                    }
                    let Waiting::Confirm { seq, .. } = emit[j] else {
                        unreachable!("matched above")
                    };
                    frame::encode_method(
                        out,
                        self.id,
                        &AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                            delivery_tag: seq,
                            multiple: !acked,
                            requeue: true,
                        })),
                    );
                    nacked = true;
                    i = j + 1;
                }
                Waiting::Confirm { .. } => {
                    let mut j = i;
                    while !nacked
                        && j + 1 < emit.len()
                        && matches!(emit[j + 1], Waiting::Confirm { .. })
                        && !nack(&emit[j + 1])
                    {
                        j += 1;
                    }
                    let Waiting::Confirm { seq, .. } = emit[j] else {
                        unreachable!("matched above")
                    };
                    self.metrics.confirmed.inc_by((j + 1 - i) as u64);
                    for w in &emit[i..=j] {
                        if let Waiting::Confirm { at, .. } = w {
                            let ms = now.millis_since(*at);
                            self.metrics.confirm_latency.observe(ms as f64 / 1000.0);
                        }
                    }
                    // Everything before `seq` is already confirmed, so `multiple` covers the run.
                    frame::encode_basic_ack(out, self.id, seq, j > i);
                    acked = true;
                    i = j + 1;
                }
            }
        }
        !self.confirms.pending.is_empty()
    }

    /// Whether a tx.commit failed since the last call (see [`Confirms::failed_commit`]):
    /// the connection then closes the channel with RabbitMQ's error.
    pub fn take_failed_commit(&mut self) -> bool {
        std::mem::take(&mut self.confirms.failed_commit)
    }

    // ---- tx.* ----

    fn handle_tx(
        &mut self,
        c: &mut Connection,
        m: tx::AMQPMethod,
        now: Instant,
    ) -> Result<(), AmqpError> {
        let ch = self.id;
        match m {
            tx::AMQPMethod::Select(_) => {
                if self.confirm {
                    return Err(precondition_failed("cannot switch from confirm to tx mode"));
                }
                if self.tx.is_none() {
                    self.tx = Some(Tx::default());
                    self.listed.set_transactional();
                }
                c.send_method(ch, AMQPClass::Tx(tx::AMQPMethod::SelectOk(tx::SelectOk {})));
                Ok(())
            }
            tx::AMQPMethod::Commit(_) => {
                let Some(t) = self.tx.take() else {
                    return Err(precondition_failed("channel is not transactional"));
                };
                self.tx = Some(Tx::default());
                let snapshot = c.snapshot();
                let mut ticket = 0;
                let mut taken = true;
                let mut remote = Vec::new();
                if let Some(vhost) = snapshot.vhost(&c.vhost) {
                    for (exchange, message, mandatory, bcc) in t.publishes {
                        let outcome =
                            c.broker
                                .publish_with_bcc(vhost, &exchange, message.clone(), &bcc, now);
                        ticket = ticket.max(outcome.ticket);
                        // A queue here refused it (its limit, or a mirrored queue between
                        // masters): RabbitMQ's "partial tx completion", never commit-ok.
                        taken &= !outcome.rejected;
                        if outcome.remote != 0 {
                            remote.push(outcome.remote);
                        }
                        count_routing(&self.metrics, &outcome, mandatory);
                        if outcome.routed == 0 && !outcome.rejected && mandatory {
                            self.send_return(c, &message);
                        }
                    }
                }
                for a in t.acks {
                    let r = match a {
                        TxAck::Ack { tag, multiple } => self.settle(c, tag, multiple, None, now),
                        TxAck::Nack {
                            tag,
                            multiple,
                            requeue,
                        } => self.settle(c, tag, multiple, Some(requeue), now),
                    };
                    // A tag acked twice inside one transaction is the client's error.
                    r?;
                }
                // commit-ok promises the persistent messages are on disk: it waits for them.
                let remote = match remote.len() {
                    0 => 0,
                    _ => c.broker.remote_outcomes().join(&remote),
                };
                self.confirms.pending.push(Waiting::CommitOk {
                    taken,
                    ticket,
                    remote,
                });
                Ok(())
            }
            tx::AMQPMethod::Rollback(_) => {
                if self.tx.is_none() {
                    return Err(precondition_failed("channel is not transactional"));
                }
                self.tx = Some(Tx::default());
                c.send_method(
                    ch,
                    AMQPClass::Tx(tx::AMQPMethod::RollbackOk(tx::RollbackOk {})),
                );
                Ok(())
            }
            _ => Err(unimplemented_method()),
        }
    }

    // ---- deliveries ----

    /// Encodes a delivery from the outbox, assigning its delivery tag.
    pub fn encode_delivery(&mut self, out: &mut Vec<u8>, frame_max: u32, d: Delivery) {
        if d.ack_required {
            self.metrics.delivered_consume_manual_ack.inc();
        } else {
            self.metrics.delivered_consume_auto_ack.inc();
        }
        if d.redelivered {
            self.metrics.redelivered.inc();
        }
        let tag = self.next_delivery_tag;
        self.next_delivery_tag += 1;
        frame::encode_deliver(
            out,
            self.id,
            &d.consumer_tag,
            tag,
            d.redelivered,
            &d.message.exchange,
            &d.message.routing_key,
        );
        frame::encode_content(
            out,
            self.id,
            &d.message.properties_raw,
            &d.message.body,
            frame_max,
        );
        if d.ack_required {
            self.unacked.insert(
                tag,
                UnackedRef {
                    queue: d.queue,
                    seq: d.seq,
                },
            );
            self.listed.set_unacked(self.unacked.len());
        }
    }

    /// The queue of consumer `tag` failed over to a new master (`OutItem::Rehome`): the
    /// consumer attaches there, here or on another node, without the client seeing it
    /// (messages it had not acked come again from the new master, `redelivered`). If the
    /// queue cannot be reached, it is cancelled.
    pub fn handle_rehome(&mut self, c: &mut Connection, tag: &str, now: Instant) {
        let Some(resume) = self.consumers.get(tag).map(|r| r.resume.clone()) else {
            return;
        };
        let notify = c.caps.consumer_cancel_notify;
        if resume.cancel_on_ha_failover {
            // It asked for a basic.cancel when its queue moves to another master.
            self.handle_broker_cancel(&mut c.out, tag, notify);
            return;
        }
        if let Some(h) = c.broker.queue(&c.vhost, &resume.queue) {
            let consumer = Consumer {
                tag: Arc::from(tag),
                link: self.link.clone(),
                no_ack: resume.no_ack,
                prefetch: self.prefetch as u32,
                priority: resume.priority,
                exclusive: resume.exclusive,
                in_flight: Arc::new(AtomicU32::new(0)),
            };
            let dead = {
                let mut q = h.lock();
                if q.check_new_consumer(&h, resume.exclusive).is_err() {
                    drop(q);
                    self.handle_broker_cancel(&mut c.out, tag, notify);
                    return;
                }
                q.add_consumer(&h, consumer, now)
            };
            if !dead.is_empty() {
                c.broker.dead_letter(&h, dead, now);
            }
            self.consumers.insert(
                tag.to_string(),
                ConsumerRef {
                    queue: QueueRef::Local(h),
                    resume,
                },
            );
        } else if let Some(rq) = c.broker.remote_queue(&c.vhost, &resume.queue) {
            let key = ChannelKey {
                conn: c.id,
                channel: self.id,
            };
            rq.link.consume(
                &rq,
                key,
                &c.outbox,
                RemoteConsumer {
                    tag: Arc::from(tag),
                    no_ack: resume.no_ack,
                    prefetch: self.prefetch as u32,
                    global_prefetch: self.link.global_prefetch.load(Ordering::Acquire),
                    priority: resume.priority,
                    exclusive: resume.exclusive,
                    cancel_on_ha_failover: resume.cancel_on_ha_failover,
                },
            );
            self.consumers.insert(
                tag.to_string(),
                ConsumerRef {
                    queue: QueueRef::Remote(rq),
                    resume,
                },
            );
        } else {
            self.handle_broker_cancel(&mut c.out, tag, notify);
        }
    }

    /// The broker cancelled a consumer (queue deleted).
    pub fn handle_broker_cancel(&mut self, out: &mut Vec<u8>, tag: &str, notify: bool) {
        if self.consumers.remove(tag).is_none() {
            return;
        }
        self.listed.remove_consumer(tag);
        if notify {
            frame::encode_method(
                out,
                self.id,
                &AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                    consumer_tag: short(tag),
                    nowait: true,
                })),
            );
        }
    }

    /// Releases what the channel holds: consumers detached, unacked messages requeued.
    pub fn teardown(&mut self, c: &mut Connection, now: Instant) {
        // Its reply name reaches nothing from here on.
        self.reply_consumer = None;
        let consumers = std::mem::take(&mut self.consumers);
        for (tag, cons) in consumers {
            // Nobody waits for these deletions: the channel is going away.
            if let Some(command) = self.detach_consumer(c, &cons.queue, &tag, now) {
                c.emit_detached(command);
            }
        }
        self.requeue_all(c, now);
        self.content = None;
        self.tx = None;
        for w in self.confirms.pending.drain(..) {
            if w.remote() != 0 {
                c.broker.remote_outcomes().forget(w.remote());
            }
        }
        self.link.flow_active.store(false, Ordering::Release);
        self.listed.deregister();
    }
}

fn perms(c: &Connection) -> Result<&super::permissions::Permissions, AmqpError> {
    c.permissions
        .as_ref()
        .ok_or_else(|| access_refused("no permissions in this vhost"))
}

/// Settles unacked references of channel `channel`, grouped by queue, in tag order.
fn settle_refs(
    c: &Connection,
    channel: u16,
    refs: Vec<UnackedRef>,
    requeue: Option<bool>,
    now: Instant,
) {
    let mut by_queue: Vec<(QueueRef, Vec<u64>)> = Vec::new();
    for r in refs {
        match by_queue.iter_mut().find(|(q, _)| q.same(&r.queue)) {
            Some((_, seqs)) => seqs.push(r.seq),
            None => by_queue.push((r.queue, vec![r.seq])),
        }
    }
    let how = match requeue {
        None => Settle::Ack,
        Some(requeue) => Settle::Nack { requeue },
    };
    let key = ChannelKey {
        conn: c.id,
        channel,
    };
    for (q, seqs) in by_queue {
        let dead = q.settle(key, &seqs, how, now);
        if let (QueueRef::Local(h), false) = (&q, dead.is_empty()) {
            c.broker.dead_letter(h, dead, now);
        }
    }
}
