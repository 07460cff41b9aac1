//! The metadata methods of a channel: exchange.* and queue.*, and how they finish.
//!
//! Each method checks permissions and arguments at once, then either answers from what the
//! node already knows (passive declares, purge, deleting a missing queue) or emits a
//! [`Command`] and parks the channel with a [`Then`] (see [`crate::session::meta`]). When the
//! result arrives, [`Channel::resume`] finishes the method exactly as the synchronous code did:
//! same replies, same reply codes and texts.

use amq_protocol::protocol::{basic, exchange as exm, queue as qm, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable};

use super::{ok_or_nowait, perms, Channel};
use crate::amqp::reply_code::{
    access_refused, command_invalid, not_found, precondition_failed, resource_locked, AmqpError,
};
use crate::amqp::short;
use crate::broker::remote::{QueueCall, QueueReply, RemoteQueue};
use crate::broker::QueueRef;
use crate::meta::{Binding, Command, Destination, ExchangeDef, ExchangeKind, MetaError, QueueDef};
use crate::session::connection::Connection;
use crate::session::meta::{MetaResult, Then};
use crate::session::permissions::Access;
use crate::time::Instant;
use std::sync::Arc;

impl Channel {
    // ---- exchange.* ----

    pub(super) fn handle_exchange(
        &mut self,
        c: &mut Connection,
        m: exm::AMQPMethod,
    ) -> Result<(), AmqpError> {
        let ch = self.id;
        let vhost = c.vhost.clone();
        match m {
            exm::AMQPMethod::Declare(d) => {
                let name = d.exchange.as_str();
                let snapshot = c.snapshot();
                let v = snapshot
                    .vhost(&vhost)
                    .ok_or_else(|| not_found("vhost gone"))?;
                if name.is_empty() {
                    // RabbitMQ refuses every declare of the default exchange, passive included.
                    return Err(access_refused(
                        "operation not permitted on the default exchange",
                    ));
                }
                if d.passive {
                    if !v.exchanges.contains_key(name) {
                        return Err(not_found(format!(
                            "no exchange '{name}' in vhost '{vhost}'"
                        )));
                    }
                    ok_or_nowait(
                        c,
                        ch,
                        d.nowait,
                        AMQPClass::Exchange(exm::AMQPMethod::DeclareOk(exm::DeclareOk {})),
                    );
                    return Ok(());
                }
                let kind = ExchangeKind::parse(d.kind.as_str()).ok_or_else(|| {
                    command_invalid(format!("unknown exchange type '{}'", d.kind))
                })?;
                // An existing `amq.*` exchange is declared like any other (the equivalence
                // check answers); only a new one is refused, as in RabbitMQ.
                if name.starts_with("amq.") && !v.exchanges.contains_key(name) {
                    return Err(access_refused(format!(
                        "exchange name '{name}' contains reserved prefix 'amq.*'"
                    )));
                }
                perms(c)?.check(Access::Configure, "exchange", name)?;
                if let Some(AMQPValue::LongString(ae)) =
                    d.arguments.inner().get("alternate-exchange")
                {
                    let ae = String::from_utf8_lossy(ae.as_bytes()).into_owned();
                    perms(c)?.check(Access::Write, "exchange", &ae)?;
                }
                let def = ExchangeDef {
                    vhost: vhost.clone(),
                    name: name.to_string(),
                    kind,
                    durable: d.durable,
                    auto_delete: d.auto_delete,
                    internal: d.internal,
                    arguments: d.arguments,
                };
                c.park(
                    ch,
                    Command::DeclareExchange(def),
                    Then::ExchangeDeclare { nowait: d.nowait },
                );
                Ok(())
            }
            exm::AMQPMethod::Delete(d) => {
                let name = d.exchange.as_str();
                if name.is_empty() {
                    return Err(access_refused(
                        "operation not permitted on the default exchange",
                    ));
                }
                if name.starts_with("amq.") {
                    return Err(access_refused(format!(
                        "deletion of system exchange '{name}' in vhost '{vhost}' not allowed"
                    )));
                }
                perms(c)?.check(Access::Configure, "exchange", name)?;
                let command = Command::DeleteExchange {
                    vhost: vhost.clone(),
                    name: name.to_string(),
                    if_unused: d.if_unused,
                };
                c.park(ch, command, Then::ExchangeDelete { nowait: d.nowait });
                Ok(())
            }
            exm::AMQPMethod::Bind(b) => {
                let command = exchange_binding(
                    c,
                    true,
                    b.destination.as_str(),
                    b.source.as_str(),
                    b.routing_key.as_str(),
                    b.arguments,
                )?;
                c.park(ch, command, Then::ExchangeBind { nowait: b.nowait });
                Ok(())
            }
            exm::AMQPMethod::Unbind(b) => {
                let command = exchange_binding(
                    c,
                    false,
                    b.destination.as_str(),
                    b.source.as_str(),
                    b.routing_key.as_str(),
                    b.arguments,
                )?;
                c.park(ch, command, Then::ExchangeUnbind { nowait: b.nowait });
                Ok(())
            }
            _ => Err(super::unimplemented_method()),
        }
    }

    // ---- queue.* ----

    pub(super) fn handle_queue(
        &mut self,
        c: &mut Connection,
        m: qm::AMQPMethod,
    ) -> Result<(), AmqpError> {
        let ch = self.id;
        let vhost = c.vhost.clone();
        match m {
            qm::AMQPMethod::Declare(d) => {
                let mut name = d.queue.as_str().to_string();
                // Every declare of these names is passive, before any other check (RabbitMQ
                // matches them first); `""` is the last declared queue only when passive.
                let named = match (d.passive, name.is_empty()) {
                    (true, true) => self.last_queue.clone(),
                    _ => Some(name.clone()),
                };
                if let Some(reply) =
                    named.filter(|n| n.starts_with(crate::broker::direct_reply::REPLY_QUEUE))
                {
                    return self.declare_reply_queue(c, &reply, d.nowait);
                }
                if d.passive {
                    let name = self.resolve_queue_name(&name, &c.vhost)?;
                    // A queue another live node runs: that node tells its counts.
                    if let Some(queue) = remote_of(c, &name) {
                        c.park_call(
                            ch,
                            QueueCall::Counts { queue },
                            Then::QueueDeclareCounts {
                                name,
                                nowait: d.nowait,
                            },
                        );
                        return Ok(());
                    }
                    let (messages, consumers) = {
                        let h = self.queue_handle(c, &name)?;
                        let q = h.lock();
                        (q.message_count(), q.consumer_count())
                    };
                    self.last_queue = Some(name.clone());
                    self.metrics.queues_declared.inc();
                    ok_or_nowait(
                        c,
                        ch,
                        d.nowait,
                        AMQPClass::Queue(qm::AMQPMethod::DeclareOk(qm::DeclareOk {
                            queue: short(&name),
                            message_count: messages,
                            consumer_count: consumers,
                        })),
                    );
                    return Ok(());
                }
                if name.is_empty() {
                    name = c.broker.generate_queue_name();
                } else if name.starts_with("amq.") {
                    return Err(access_refused(format!(
                        "queue name '{name}' contains reserved prefix 'amq.*'"
                    )));
                }
                perms(c)?.check(Access::Configure, "queue", &name)?;
                if let Some(dlx) = d
                    .arguments
                    .inner()
                    .get("x-dead-letter-exchange")
                    .and_then(crate::meta::args::string)
                {
                    perms(c)?.check(Access::Write, "exchange", &dlx)?;
                }
                let def = QueueDef {
                    vhost: vhost.clone(),
                    name: name.clone(),
                    durable: d.durable,
                    exclusive_owner: d.exclusive.then_some(c.id),
                    auto_delete: d.auto_delete,
                    arguments: d.arguments,
                    // Placed by the runtime when it commits the declare (queue-master-locator).
                    home: 0,
                };
                c.park(
                    ch,
                    Command::DeclareQueue(def),
                    Then::QueueDeclare {
                        name,
                        nowait: d.nowait,
                    },
                );
                Ok(())
            }
            qm::AMQPMethod::Bind(b) => {
                let name = self.resolve_queue_name(b.queue.as_str(), &c.vhost)?;
                let command = self.queue_binding(
                    c,
                    true,
                    &name,
                    b.exchange.as_str(),
                    b.routing_key.as_str(),
                    b.arguments,
                )?;
                c.park(ch, command, Then::QueueBind { nowait: b.nowait });
                Ok(())
            }
            qm::AMQPMethod::Unbind(b) => {
                let name = self.resolve_queue_name(b.queue.as_str(), &c.vhost)?;
                let command = self.queue_binding(
                    c,
                    false,
                    &name,
                    b.exchange.as_str(),
                    b.routing_key.as_str(),
                    b.arguments,
                )?;
                c.park(ch, command, Then::QueueUnbind);
                Ok(())
            }
            qm::AMQPMethod::Purge(p) => {
                let name = self.resolve_queue_name(p.queue.as_str(), &c.vhost)?;
                perms(c)?.check(Access::Read, "queue", &name)?;
                if let Some(queue) = remote_of(c, &name) {
                    c.park_call(
                        ch,
                        QueueCall::Purge { queue },
                        Then::QueuePurge { nowait: p.nowait },
                    );
                    return Ok(());
                }
                let h = self.queue_handle(c, &name)?;
                let n = h.lock().purge();
                ok_or_nowait(
                    c,
                    ch,
                    p.nowait,
                    AMQPClass::Queue(qm::AMQPMethod::PurgeOk(qm::PurgeOk { message_count: n })),
                );
                Ok(())
            }
            qm::AMQPMethod::Delete(d) => {
                let name = self.resolve_queue_name(d.queue.as_str(), &c.vhost)?;
                perms(c)?.check(Access::Configure, "queue", &name)?;
                if let Some(queue) = remote_of(c, &name) {
                    // Its node tells the counts the checks and delete-ok need.
                    c.park_call(
                        ch,
                        QueueCall::Counts { queue },
                        Then::QueueDeleteChecked {
                            name,
                            if_unused: d.if_unused,
                            if_empty: d.if_empty,
                            nowait: d.nowait,
                        },
                    );
                    return Ok(());
                }
                let Some(message_count) =
                    check_queue_delete(c, &vhost, &name, d.if_unused, d.if_empty)?
                else {
                    // RabbitMQ 3.10 answers delete-ok with 0 for a missing queue.
                    ok_or_nowait(
                        c,
                        ch,
                        d.nowait,
                        AMQPClass::Queue(qm::AMQPMethod::DeleteOk(qm::DeleteOk {
                            message_count: 0,
                        })),
                    );
                    return Ok(());
                };
                c.park(
                    ch,
                    Command::DeleteQueue { vhost, name },
                    Then::QueueDelete {
                        message_count,
                        nowait: d.nowait,
                    },
                );
                Ok(())
            }
            _ => Err(super::unimplemented_method()),
        }
    }

    /// The bind or unbind command for a queue, after the checks RabbitMQ makes first.
    #[allow(clippy::too_many_arguments)]
    fn queue_binding(
        &self,
        c: &mut Connection,
        bind: bool,
        queue: &str,
        exchange: &str,
        routing_key: &str,
        arguments: FieldTable,
    ) -> Result<Command, AmqpError> {
        perms(c)?.check(Access::Write, "queue", queue)?;
        perms(c)?.check(Access::Read, "exchange", exchange)?;
        if bind {
            check_headers_binding(c, exchange, &arguments)?;
        }
        // Existence and exclusivity of the queue first, as RabbitMQ reports them, whichever
        // node runs it; an unbind of a queue that is gone is a no-op there (the metadata's
        // answer), not 404.
        let usable = match remote_of(c, queue) {
            Some(_) => remote_exclusive_check(c, queue),
            None => self.queue_handle(c, queue).map(|_| ()),
        };
        match usable {
            Err(e) if !bind && e.code == crate::amqp::ReplyCode::NotFound => {}
            other => other?,
        }
        let b = Binding {
            vhost: c.vhost.clone(),
            source: exchange.to_string(),
            destination: Destination::Queue(queue.to_string()),
            routing_key: routing_key.to_string(),
            arguments,
        };
        Ok(if bind {
            Command::Bind(b)
        } else {
            Command::Unbind(b)
        })
    }

    // ---- results ----

    /// Finishes the method this channel was parked on, with its command's result.
    pub(crate) fn resume(
        &mut self,
        c: &mut Connection,
        then: Then,
        result: MetaResult,
        now: Instant,
    ) -> Result<(), AmqpError> {
        let ch = self.id;
        let reply = match then {
            Then::ExchangeDeclare { nowait } => {
                result?;
                (!nowait).then_some(AMQPClass::Exchange(exm::AMQPMethod::DeclareOk(
                    exm::DeclareOk {},
                )))
            }
            Then::ExchangeDelete { nowait } => {
                match result {
                    // RabbitMQ 3.10: deleting a missing exchange is not an error.
                    Ok(_) | Err(MetaError::NotFound { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
                (!nowait).then_some(AMQPClass::Exchange(exm::AMQPMethod::DeleteOk(
                    exm::DeleteOk {},
                )))
            }
            Then::ExchangeBind { nowait } => {
                result?;
                (!nowait).then_some(AMQPClass::Exchange(exm::AMQPMethod::BindOk(exm::BindOk {})))
            }
            Then::ExchangeUnbind { nowait } => {
                result?;
                (!nowait).then_some(AMQPClass::Exchange(exm::AMQPMethod::UnbindOk(
                    exm::UnbindOk {},
                )))
            }
            Then::QueueDeclare { name, nowait } => {
                let created = result?.created;
                self.queue_declared(c, name, created, nowait, now)?
            }
            Then::QueueBind { nowait } => {
                result?;
                (!nowait).then_some(AMQPClass::Queue(qm::AMQPMethod::BindOk(qm::BindOk {})))
            }
            Then::QueueUnbind => {
                result?;
                Some(AMQPClass::Queue(qm::AMQPMethod::UnbindOk(qm::UnbindOk {})))
            }
            Then::QueueDelete {
                message_count,
                nowait,
            } => {
                match result {
                    Ok(_) | Err(MetaError::NotFound { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
                (!nowait).then_some(AMQPClass::Queue(qm::AMQPMethod::DeleteOk(qm::DeleteOk {
                    message_count,
                })))
            }
            Then::BasicCancel {
                consumer_tag,
                nowait,
            } => {
                // The auto-delete is the broker's business: its failure is not the client's.
                if let Err(e) = result {
                    tracing::debug!(channel = ch, error = %e, "auto-delete refused");
                }
                (!nowait).then_some(AMQPClass::Basic(basic::AMQPMethod::CancelOk(
                    basic::CancelOk { consumer_tag },
                )))
            }
            Then::BasicGet { .. }
            | Then::QueueDeclareCounts { .. }
            | Then::QueuePurge { .. }
            | Then::QueueDeleteChecked { .. } => {
                // These wait for a queue call, never for a command (see `resume_call`).
                tracing::error!(channel = ch, "a metadata result for a queue call's method");
                return Err(AmqpError::new(
                    crate::amqp::ReplyCode::InternalError,
                    "metadata result for a queue call",
                ));
            }
        };
        if let Some(m) = reply {
            c.send_method(ch, m);
        }
        Ok(())
    }

    /// Finishes a method that waited for the node of a queue of another node.
    pub(crate) fn resume_call(
        &mut self,
        c: &mut Connection,
        then: Then,
        reply: QueueReply,
        _now: Instant,
    ) -> Result<(), AmqpError> {
        let ch = self.id;
        match (then, reply) {
            (_, QueueReply::Unavailable(text)) => Err(not_found(text)),
            (Then::BasicGet { queue, no_ack }, QueueReply::Got(got)) => {
                // The queue as the reply named it: its settle must name the same instance.
                let queue = got.as_ref().and_then(|g| g.source.clone()).unwrap_or(queue);
                self.send_get_reply(c, QueueRef::Remote(queue), got, no_ack);
                Ok(())
            }
            (
                Then::QueueDeclareCounts { name, nowait },
                QueueReply::Counts {
                    messages,
                    consumers,
                    ..
                },
            ) => {
                self.metrics.queues_declared.inc();
                ok_or_nowait(
                    c,
                    ch,
                    nowait,
                    AMQPClass::Queue(qm::AMQPMethod::DeclareOk(qm::DeclareOk {
                        queue: short(&name),
                        message_count: messages,
                        consumer_count: consumers,
                    })),
                );
                self.last_queue = Some(name);
                Ok(())
            }
            (Then::QueuePurge { nowait }, QueueReply::Purged(n)) => {
                ok_or_nowait(
                    c,
                    ch,
                    nowait,
                    AMQPClass::Queue(qm::AMQPMethod::PurgeOk(qm::PurgeOk { message_count: n })),
                );
                Ok(())
            }
            (
                Then::QueueDeleteChecked {
                    name,
                    if_unused,
                    if_empty,
                    nowait,
                },
                QueueReply::Counts {
                    messages,
                    consumers,
                    ..
                },
            ) => {
                let vhost = c.vhost.clone();
                if if_unused && consumers > 0 {
                    return Err(precondition_failed(format!(
                        "queue '{name}' in vhost '{vhost}' in use"
                    )));
                }
                if if_empty && messages > 0 {
                    return Err(precondition_failed(format!(
                        "queue '{name}' in vhost '{vhost}' not empty"
                    )));
                }
                c.park(
                    ch,
                    Command::DeleteQueue { vhost, name },
                    Then::QueueDelete {
                        message_count: messages,
                        nowait,
                    },
                );
                Ok(())
            }
            (then, reply) => {
                tracing::error!(?then, ?reply, "queue reply does not fit its method");
                Err(AmqpError::new(
                    crate::amqp::ReplyCode::InternalError,
                    "queue reply does not fit its method",
                ))
            }
        }
    }

    /// queue.declare after its command: the queue must be ours to use; declare-ok.
    fn queue_declared(
        &mut self,
        c: &mut Connection,
        name: String,
        created: bool,
        nowait: bool,
        now: Instant,
    ) -> Result<Option<AMQPClass>, AmqpError> {
        let vhost = &c.vhost;
        let Some(h) = c.broker.queue(vhost, &name) else {
            // A queue another (live) node runs: the declare itself is committed; its counts
            // are that node's to tell, so the channel waits for them.
            let Some(queue) = remote_of(c, &name) else {
                return Err(super::unavailable_queue(c, &name));
            };
            c.park_call(
                self.id,
                QueueCall::Counts { queue },
                Then::QueueDeclareCounts { name, nowait },
            );
            return Ok(None);
        };
        let (messages, consumers) = {
            let mut q = h.lock();
            if !created && q.exclusive_owner().is_some_and(|o| o != c.id) {
                return Err(resource_locked(format!(
                    "cannot obtain exclusive access to locked queue '{name}' in vhost '{vhost}'. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration."
                )));
            }
            q.touch(now);
            (q.message_count(), q.consumer_count())
        };
        self.metrics.queues_declared.inc();
        let reply = (!nowait).then(|| {
            AMQPClass::Queue(qm::AMQPMethod::DeclareOk(qm::DeclareOk {
                queue: short(&name),
                message_count: messages,
                consumer_count: consumers,
            }))
        });
        self.last_queue = Some(name);
        Ok(reply)
    }
}

/// The queue `name` of this vhost when another live node of the cluster runs it.
fn remote_of(c: &Connection, name: &str) -> Option<Arc<RemoteQueue>> {
    if c.broker.queue(&c.vhost, name).is_some() {
        return None;
    }
    c.broker.remote_queue(&c.vhost, name)
}

/// A queue another live node runs is usable by this connection unless it is exclusive to
/// another one (405, as for a local queue).
fn remote_exclusive_check(c: &Connection, name: &str) -> Result<(), AmqpError> {
    let snapshot = c.broker.snapshot();
    let owner = snapshot
        .vhost(&c.vhost)
        .and_then(|v| v.queues.get(name))
        .and_then(|q| q.exclusive_owner);
    match owner {
        Some(o) if o != c.id => Err(super::locked_queue(c, name)),
        _ => Ok(()),
    }
}

/// The bind or unbind command between exchanges, after the permission checks.
fn exchange_binding(
    c: &Connection,
    bind: bool,
    destination: &str,
    source: &str,
    routing_key: &str,
    arguments: FieldTable,
) -> Result<Command, AmqpError> {
    perms(c)?.check(Access::Write, "exchange", destination)?;
    perms(c)?.check(Access::Read, "exchange", source)?;
    if bind {
        check_headers_binding(c, source, &arguments)?;
    }
    let b = Binding {
        vhost: c.vhost.clone(),
        source: source.to_string(),
        destination: Destination::Exchange(destination.to_string()),
        routing_key: routing_key.to_string(),
        arguments,
    };
    Ok(if bind {
        Command::Bind(b)
    } else {
        Command::Unbind(b)
    })
}

/// A binding to a headers exchange: its `x-match` must be one of RabbitMQ's four values
/// (`rabbit_exchange_type_headers:validate_binding`). A missing exchange is left to the
/// metadata's 404.
fn check_headers_binding(
    c: &Connection,
    exchange: &str,
    args: &FieldTable,
) -> Result<(), AmqpError> {
    let snapshot = c.broker.snapshot();
    let headers = snapshot
        .vhost(&c.vhost)
        .and_then(|v| v.exchanges.get(exchange))
        .is_some_and(|x| x.kind == crate::meta::state::ExchangeKind::Headers);
    let Some(value) = args.inner().get("x-match").filter(|_| headers) else {
        return Ok(());
    };
    match crate::meta::args::string(value) {
        Some(m) if ["all", "any", "all-with-x", "any-with-x"].contains(&m.as_str()) => Ok(()),
        Some(m) => Err(precondition_failed(format!(
            "Invalid x-match field value <<\"{m}\">>; expected all, any, all-with-x, or any-with-x"
        ))),
        None => Err(precondition_failed(format!(
            "Invalid x-match field type {} (value {}); expected longstr",
            crate::meta::equivalence::type_name(value),
            crate::meta::equivalence::plain(value)
        ))),
    }
}

/// queue.delete's checks, made before its command as `Broker::delete_queue` makes them:
/// the message count to report, or `None` when the queue does not exist.
fn check_queue_delete(
    c: &Connection,
    vhost: &str,
    name: &str,
    if_unused: bool,
    if_empty: bool,
) -> Result<Option<u32>, AmqpError> {
    let Some(handle) = c.broker.queue(vhost, name) else {
        let snapshot = c.broker.snapshot();
        let Some(def) = snapshot.vhost(vhost).and_then(|v| v.queues.get(name)) else {
            return Ok(None);
        };
        if c.broker.node_is_down(def.home) {
            return Err(super::unavailable_queue(c, name));
        }
        // A queue of another live node was asked for its counts before this (`remote_of`);
        // what is left is one no node can count now (this node's own, not open yet): the
        // deletion is committed like any other, its count reported 0.
        return Ok(Some(0));
    };
    let q = handle.lock();
    if q.exclusive_owner().is_some_and(|o| o != c.id) {
        return Err(resource_locked(format!(
            "cannot obtain exclusive access to locked queue '{name}' in vhost '{vhost}'. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration."
        )));
    }
    if if_unused && q.consumer_count() > 0 {
        return Err(precondition_failed(format!(
            "queue '{name}' in vhost '{vhost}' in use"
        )));
    }
    if if_empty && q.message_count() > 0 {
        return Err(precondition_failed(format!(
            "queue '{name}' in vhost '{vhost}' not empty"
        )));
    }
    Ok(Some(q.message_count()))
}

/// The command that deletes an auto-delete queue whose last consumer left, unless the queue
/// is gone or another connection holds it exclusively (as `Broker::delete_queue` decided).
pub(super) fn auto_delete(c: &Connection, vhost: &str, name: &str) -> Option<Command> {
    let handle = c.broker.queue(vhost, name)?;
    if handle.lock().exclusive_owner().is_some_and(|o| o != c.id) {
        return None;
    }
    Some(Command::DeleteQueue {
        vhost: vhost.to_string(),
        name: name.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_continuation_names_its_method() {
        // Errors from a result carry the class and method ids of the method being finished.
        let ids: Vec<(u16, u16)> = [
            Then::ExchangeDeclare { nowait: false },
            Then::ExchangeDelete { nowait: false },
            Then::ExchangeBind { nowait: false },
            Then::ExchangeUnbind { nowait: false },
            Then::QueueDeclare {
                name: String::new(),
                nowait: false,
            },
            Then::QueueBind { nowait: false },
            Then::QueueUnbind,
            Then::QueueDelete {
                message_count: 0,
                nowait: false,
            },
            Then::BasicCancel {
                consumer_tag: "".into(),
                nowait: false,
            },
        ]
        .iter()
        .map(Then::method_ids)
        .collect();
        assert_eq!(
            ids,
            vec![
                (40, 10),
                (40, 20),
                (40, 30),
                (40, 40),
                (50, 10),
                (50, 20),
                (50, 50),
                (50, 40),
                (60, 30)
            ]
        );
    }
}
