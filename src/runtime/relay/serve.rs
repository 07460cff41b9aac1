//! Serving other nodes: each request's messages handled in order on the link's reader
//! (publishes, consumes through proxy channels, settles, gets, counts); the forwarder
//! that sends a proxy channel's deliveries back is in `forward.rs`.

use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use tokio::sync::Notify;

use super::wire::{encode, Held, RelayMsg, RelayReply, WireGot, WireMessage, WireSettle};
use super::{lock, Inner, Orphan, ADOPTION_WAIT, ORPHAN_RETRY_MS, PROXY_GETS};
use crate::broker::direct_reply::{is_reply_name, ReplyAddress};
use crate::broker::{
    ChannelKey, Consumer, Delivery, OutItem, Outbox, QueueRef, RemoteLink, RemoteQueue, Settle,
};
use crate::meta::NodeId;
use crate::runtime::node_link::transport::{BrokerReply, BrokerService};

impl Inner {
    /// Handles one message from `from`, on the link's reader: its reply, and the
    /// group-commit ticket that must be durable before the reply may say "taken" (0: none).
    pub(super) fn handle_one(&self, from: NodeId, msg: RelayMsg) -> (RelayReply, u64) {
        let now = self.clock.now();
        if !self.serving.load(std::sync::atomic::Ordering::Acquire) {
            if let Some(refused) = self.refuse_while_starting(from, &msg) {
                return (refused, 0);
            }
        }
        match msg {
            RelayMsg::Publish {
                vhost,
                queues,
                message,
            } => {
                let Some(message) = message.message() else {
                    return (RelayReply::Published(false), 0);
                };
                let (taken, ticket) =
                    self.broker
                        .publish_forwarded(&vhost, &queues, Arc::new(message), now);
                (RelayReply::Published(taken), ticket)
            }
            RelayMsg::Consume {
                ref vhost,
                ref queue,
                ..
            } if self.broker.queue(vhost, queue).is_none()
                && self.awaiting_adoption(vhost, queue) =>
            {
                // A mirrored queue promoted here, not serving yet (its flush lap): a consumer
                // following it from another node waits for it (`ADOPTION_WAIT` at most)
                // rather than being refused.
                if let Some(relay) = self.link.upgrade() {
                    let inner = relay.inner.clone();
                    let (vhost, queue) = (vhost.clone(), queue.clone());
                    tokio::spawn(async move {
                        // Woken by the broker when its queues or metadata change, not polled.
                        let deadline = tokio::time::Instant::now() + ADOPTION_WAIT;
                        loop {
                            let changed = Arc::new(tokio::sync::Notify::new());
                            let wake = changed.clone();
                            inner
                                .broker
                                .on_next_change(Box::new(move || wake.notify_one()));
                            if inner.broker.queue(&vhost, &queue).is_some()
                                || !inner.awaiting_adoption(&vhost, &queue)
                                || tokio::time::timeout_at(deadline, changed.notified())
                                    .await
                                    .is_err()
                            {
                                break;
                            }
                        }
                        match msg {
                            _ if inner.broker.queue(&vhost, &queue).is_some() => {
                                let _ = inner.handle_one(from, msg);
                            }
                            RelayMsg::Consume {
                                conn, channel, tag, ..
                            } => inner.send(
                                from,
                                RelayMsg::Deliver {
                                    conn,
                                    channel,
                                    deliveries: Vec::new(),
                                    cancels: vec![tag],
                                },
                                0,
                            ),
                            _ => {}
                        }
                    });
                }
                (RelayReply::Done, 0)
            }
            RelayMsg::Consume {
                vhost,
                queue,
                conn,
                channel,
                tag,
                no_ack,
                prefetch,
                global_prefetch,
                priority,
                exclusive,
            } => {
                let key = ChannelKey { conn, channel };
                self.forget_dropped(from, key, &tag);
                let tag: Arc<str> = Arc::from(tag.as_str());
                let refuse = |why: String| {
                    tracing::debug!(queue = %queue, error = %why, "remote consumer refused");
                    self.send(
                        from,
                        RelayMsg::Deliver {
                            conn,
                            channel,
                            deliveries: Vec::new(),
                            cancels: vec![tag.to_string()],
                        },
                        0,
                    );
                };
                let Some(h) = self.broker.queue(&vhost, &queue) else {
                    refuse(format!("no queue '{queue}' here"));
                    return (RelayReply::Done, 0);
                };
                if self.broker.node_is_down(from) {
                    // Nothing could be delivered to it until this node hears it again (a
                    // frozen node that resumed): its consumer is cancelled, and follows the
                    // queue again.
                    tracing::debug!(queue = %queue, node = from, "remote consumer of a node recorded down refused");
                    self.send_cancels(from, key, vec![tag.to_string()]);
                    return (RelayReply::Done, 0);
                }
                let proxy = self.proxy(from, key, global_prefetch);
                if lock(&proxy.consumers)
                    .iter()
                    .any(|(v, q, t)| *v == vhost && *q == queue && *t == tag)
                {
                    // Asked again after the first ask's link failed, which arrived anyway.
                    return (RelayReply::Done, 0);
                }
                let consumer = Consumer {
                    tag: tag.clone(),
                    link: proxy.link.clone(),
                    no_ack,
                    prefetch,
                    priority,
                    exclusive,
                    in_flight: Arc::new(AtomicU32::new(0)),
                };
                let dead = {
                    let mut q = h.lock();
                    match q.check_new_consumer(&h, exclusive) {
                        Err(e) => {
                            drop(q);
                            refuse(e.text);
                            return (RelayReply::Done, 0);
                        }
                        Ok(()) => {
                            lock(&proxy.consumers).push((vhost.clone(), queue.clone(), tag));
                            q.add_consumer(&h, consumer, now)
                        }
                    }
                };
                if !dead.is_empty() {
                    self.broker.dead_letter(&h, dead, now);
                }
                (RelayReply::Done, 0)
            }
            RelayMsg::Cancel {
                vhost,
                queue,
                conn,
                channel,
                tag,
            } => {
                let key = ChannelKey { conn, channel };
                let proxy = lock(&self.proxies).get(&(from, key)).cloned();
                if let Some(p) = proxy {
                    lock(&p.consumers)
                        .retain(|(v, q, t)| !(v == &vhost && q == &queue && **t == *tag));
                    self.detach(&p, &vhost, &queue, &tag, now);
                }
                (RelayReply::Done, 0)
            }
            RelayMsg::Settle {
                vhost,
                queue,
                instance,
                conn,
                channel,
                seqs,
                how,
            } => {
                let key = ChannelKey { conn, channel };
                if let Some(p) = lock(&self.proxies).get(&(from, key)).cloned() {
                    let mut u = lock(&p.unacked);
                    let mut held = Held {
                        vhost: vhost.clone(),
                        queue: queue.clone(),
                        instance,
                        seq: 0,
                    };
                    for s in &seqs {
                        held.seq = *s;
                        u.remove(&held);
                    }
                }
                let how = match how {
                    WireSettle::Ack => Settle::Ack,
                    WireSettle::Requeue => Settle::Nack { requeue: true },
                    WireSettle::Drop => Settle::Nack { requeue: false },
                };
                self.settle_local(&vhost, &queue, instance, &seqs, how);
                (RelayReply::Done, 0)
            }
            RelayMsg::Get {
                vhost,
                queue,
                conn,
                channel,
                no_ack,
                request,
            } => {
                let Some(h) = self.broker.queue(&vhost, &queue) else {
                    return (RelayReply::Missing(missing(&vhost, &queue)), 0);
                };
                {
                    let mut abandoned = lock(&self.abandoned_gets);
                    if let Some(i) = abandoned.iter().position(|a| *a == (from, request)) {
                        // Its asker gave it up already: nobody would take the message.
                        abandoned.remove(i);
                        return (RelayReply::Got(None), 0);
                    }
                }
                let mut dead = Vec::new();
                let got = h.lock().get(now, !no_ack, &mut dead);
                if !dead.is_empty() {
                    self.broker.dead_letter(&h, dead, now);
                }
                let instance = self.instance(&h);
                let got = got.map(|(entry, remaining)| {
                    if !no_ack {
                        // Its ack (or the channel's end) comes back through the proxy channel.
                        let proxy = self.proxy(from, ChannelKey { conn, channel }, 0);
                        let held = Held {
                            vhost: vhost.clone(),
                            queue: queue.clone(),
                            instance,
                            seq: entry.seq,
                        };
                        lock(&proxy.unacked).insert(held.clone());
                        let mut gets = lock(&proxy.gets);
                        if gets.len() == PROXY_GETS {
                            gets.pop_front();
                        }
                        gets.push_back((request, held));
                    }
                    WireGot {
                        seq: entry.seq,
                        instance,
                        redelivered: entry.redelivered,
                        message: WireMessage::of(&entry.message),
                        remaining,
                    }
                });
                (RelayReply::Got(got), 0)
            }
            RelayMsg::GetAbandoned {
                conn,
                channel,
                request,
            } => {
                self.abandon_get(from, ChannelKey { conn, channel }, request);
                (RelayReply::Done, 0)
            }
            // Handled with its batch in `handle` (it waits for the follower, not the disk).
            RelayMsg::Barrier { .. } => (RelayReply::Counts(0, 0, 0), 0),
            // A reply name of this node, declared on another (direct reply-to): it "exists"
            // while its consumer does, with RabbitMQ's 0 messages and 1 consumer.
            RelayMsg::Counts { vhost, queue } if is_reply_name(&queue) => {
                let live = ReplyAddress::parse(&queue)
                    .is_ok_and(|a| a.node == self.me && self.broker.direct_replies().contains(&a));
                match live {
                    true => (RelayReply::Counts(0, 1, 0), 0),
                    false => (RelayReply::Missing(missing(&vhost, &queue)), 0),
                }
            }
            RelayMsg::DeliverReply { name, message } => {
                if let Some(message) = message.message() {
                    self.broker
                        .deliver_forwarded_reply(&name, Arc::new(message));
                }
                (RelayReply::Done, 0)
            }
            RelayMsg::Counts { vhost, queue } => match self.broker.queue(&vhost, &queue) {
                Some(h) => {
                    let mut q = h.lock();
                    q.touch(now);
                    (
                        RelayReply::Counts(
                            q.message_count(),
                            q.consumer_count(),
                            q.unacked_count(),
                        ),
                        0,
                    )
                }
                None => (RelayReply::Missing(missing(&vhost, &queue)), 0),
            },
            RelayMsg::Figures { vhost, queue } => match self.broker.queue(&vhost, &queue) {
                Some(h) => (RelayReply::Figures(h.lock().figures()), 0),
                None => (RelayReply::Missing(missing(&vhost, &queue)), 0),
            },
            RelayMsg::Purge { vhost, queue } => match self.broker.queue(&vhost, &queue) {
                Some(h) => (RelayReply::Purged(h.lock().purge()), 0),
                None => (RelayReply::Missing(missing(&vhost, &queue)), 0),
            },
            RelayMsg::Sessions => (
                RelayReply::Sessions(self.broker.sessions().connections()),
                0,
            ),
            RelayMsg::CloseConnection { id, reason } => (
                RelayReply::Closed(self.broker.sessions().close(id, &reason)),
                0,
            ),
            RelayMsg::Stats => (
                RelayReply::Stats(Box::new(crate::runtime::node_stats::read(
                    &self.broker,
                    &self.facts,
                ))),
                0,
            ),
            RelayMsg::Deliver {
                conn,
                channel,
                deliveries,
                cancels,
            } => {
                let key = ChannelKey { conn, channel };
                let outbox = lock(&self.sinks).get(&key).and_then(|s| s.outbox.upgrade());
                let mut undelivered = Vec::new();
                let Some(outbox) = outbox else {
                    for d in deliveries.into_iter().filter(|d| d.ack_required) {
                        undelivered.push(d.held);
                    }
                    return (RelayReply::Undelivered(undelivered), 0);
                };
                let Some(relay) = self.link.upgrade() else {
                    return (RelayReply::Done, 0);
                };
                let link: Arc<dyn RemoteLink> = relay;
                for d in deliveries {
                    if self.is_retired(&key, &d.tag, from) {
                        // Sent before this node took the consumer away from `from`: the
                        // message is the queue's new master's to deliver now (a copy there
                        // comes flagged redelivered). Returned, so `from` requeues it if it
                        // still runs the queue.
                        tracing::debug!(node = from, tag = %d.tag, "stale delivery dropped");
                        if d.ack_required {
                            undelivered.push(d.held);
                        }
                        continue;
                    }
                    let Some(message) = d.message.message() else {
                        continue;
                    };
                    let queue = Arc::new(RemoteQueue {
                        node: from,
                        vhost: d.held.vhost.clone(),
                        name: d.held.queue.clone(),
                        instance: d.held.instance,
                        link: link.clone(),
                    });
                    let item = OutItem::Deliver(Delivery {
                        channel,
                        consumer_tag: Arc::from(d.tag.as_str()),
                        queue: QueueRef::Remote(queue),
                        seq: d.held.seq,
                        message: Arc::new(message),
                        redelivered: d.redelivered,
                        ack_required: d.ack_required,
                    });
                    if outbox.push(item).is_err() && d.ack_required {
                        undelivered.push(d.held);
                    }
                }
                let state = self.broker.snapshot();
                for tag in cancels {
                    let mut gone = None;
                    if let Some(s) = lock(&self.sinks).get_mut(&key) {
                        if let Some(i) =
                            s.tags.iter().position(|t| t.node == from && *t.tag == *tag)
                        {
                            gone = Some(s.tags.remove(i));
                        }
                    }
                    // A mirrored queue's master that cancels its consumers is handing the
                    // queue over (a controlled stop, a `nodes` policy), or deleting it: the
                    // consumer waits for the new master, as after a failure (`rehome`
                    // cancels it if the queue went), unless it asked to be cancelled.
                    let found = gone.is_some();
                    tracing::debug!(node = from, tag = %tag, found, "consumer cancelled by its queue's node");
                    if let Some(t) = gone.filter(|t| {
                        !t.cancel_on_ha_failover && state.mirror_sets.contains_key(&*t.queue)
                    }) {
                        self.retire(key, &Arc::downgrade(&outbox), &t.tag, from);
                        lock(&self.orphans).push(Orphan {
                            key,
                            outbox: Arc::downgrade(&outbox),
                            tag: t.tag,
                            queue: t.queue,
                            node: from,
                            since: now,
                            retry_at: Some(now.plus_millis(ORPHAN_RETRY_MS)),
                        });
                        continue;
                    }
                    if !found && self.is_retired(&key, &tag, from) {
                        // This channel already took the consumer away from `from` (it gave
                        // `from` up, or `from` cancelled it before): a late cancel of a
                        // consumer that waits for, or follows, its queue elsewhere now.
                        continue;
                    }
                    let _ = outbox.push(OutItem::Cancel {
                        channel,
                        consumer_tag: Arc::from(tag.as_str()),
                    });
                }
                (RelayReply::Undelivered(undelivered), 0)
            }
        }
    }

    /// The answer to `msg` while this node's storage is still recovering (None: harmless
    /// now, handled as usual). A publish is refused (nacked), a consumer is cancelled (one
    /// of a mirrored queue waits and tries again), questions get "unavailable".
    pub(super) fn refuse_while_starting(&self, from: NodeId, msg: &RelayMsg) -> Option<RelayReply> {
        let starting = || "the queue's node is starting".to_string();
        match msg {
            RelayMsg::Publish { .. } => Some(RelayReply::Published(false)),
            RelayMsg::Consume {
                conn, channel, tag, ..
            } => {
                self.send(
                    from,
                    RelayMsg::Deliver {
                        conn: *conn,
                        channel: *channel,
                        deliveries: Vec::new(),
                        cancels: vec![tag.clone()],
                    },
                    0,
                );
                Some(RelayReply::Done)
            }
            RelayMsg::Get { .. }
            | RelayMsg::Purge { .. }
            | RelayMsg::Counts { .. }
            | RelayMsg::Figures { .. } => Some(RelayReply::Missing(starting())),
            RelayMsg::Settle { .. }
            | RelayMsg::Cancel { .. }
            | RelayMsg::GetAbandoned { .. }
            | RelayMsg::Deliver { .. }
            | RelayMsg::Barrier { .. }
            | RelayMsg::Sessions
            | RelayMsg::Stats
            | RelayMsg::CloseConnection { .. }
            | RelayMsg::DeliverReply { .. } => None,
        }
    }

    /// Handles a batch of messages from `from`, in order; the replies, in order, once every
    /// forwarded publish among them is durable.
    pub(super) fn handle(&self, from: NodeId, batch: Vec<RelayMsg>) -> BrokerReply {
        let mut ticket = 0;
        let mut first_ticket = u64::MAX;
        let mut index = 0;
        let mut barriers = Vec::new();
        let replies: Vec<RelayReply> = batch
            .into_iter()
            .enumerate()
            .map(|(at, m)| {
                if let RelayMsg::Barrier { index: i } = m {
                    // A `Counts` of 0s is the "followed" answer: the asker needs no other.
                    index = index.max(i);
                    barriers.push(at);
                    return RelayReply::Counts(0, 0, 0);
                }
                let (r, t) = self.handle_one(from, m);
                ticket = ticket.max(t);
                if t != 0 {
                    first_ticket = first_ticket.min(t);
                }
                r
            })
            .collect();
        let behind = *self.applied.borrow() < index;
        let durability = self.broker.durability().cloned();
        let unsynced = durability
            .as_ref()
            .is_some_and(|d| ticket != 0 && !d.is_durable(ticket));
        match durability {
            _ if behind || unsynced => {
                let mut applied = self.applied.clone();
                BrokerReply::Later(Box::pin(async move {
                    let mut replies = replies;
                    if behind {
                        let wait = applied.wait_for(|i| *i >= index);
                        let _ =
                            tokio::time::timeout(std::time::Duration::from_secs(10), wait).await;
                        if *applied.borrow() < index {
                            // Still behind: not "followed", so the asker asks again (or
                            // answers its client without this node once it gives up).
                            for &at in &barriers {
                                replies[at] = RelayReply::Done;
                            }
                        }
                    }
                    // One wait for the batch: tickets are marked durable in order.
                    let ok = match (&durability, unsynced) {
                        (Some(d), true) => {
                            wait_durable(d, ticket).await && !d.any_void(first_ticket, ticket)
                        }
                        _ => true,
                    };
                    let replies: Vec<RelayReply> = replies
                        .into_iter()
                        .map(|r| match r {
                            RelayReply::Published(taken) => RelayReply::Published(taken && ok),
                            other => other,
                        })
                        .collect();
                    encode(&replies)
                }))
            }
            Some(d) if ticket != 0 && d.any_void(first_ticket, ticket) => {
                let replies: Vec<RelayReply> = replies
                    .into_iter()
                    .map(|r| match r {
                        RelayReply::Published(_) => RelayReply::Published(false),
                        other => other,
                    })
                    .collect();
                BrokerReply::Now(encode(&replies))
            }
            _ => BrokerReply::Now(encode(&replies)),
        }
    }
}

/// RabbitMQ's 404 text for a queue that is not there.
pub(super) fn missing(vhost: &str, queue: &str) -> String {
    format!("no queue '{queue}' in vhost '{vhost}'")
}

/// Waits until group-commit `ticket` is durable (false if storage failed).
pub(super) async fn wait_durable(d: &Arc<crate::broker::Durability>, ticket: u64) -> bool {
    let notify = Arc::new(Notify::new());
    let waker = notify.clone();
    let outbox = Arc::new(Outbox::new(0, Box::new(move || waker.notify_one())));
    loop {
        if d.has_failed() {
            return false;
        }
        if d.is_durable(ticket) {
            return true;
        }
        d.wait(&outbox);
        // Checked again after registering: the mark may have moved in between.
        if d.is_durable(ticket) {
            return true;
        }
        let _ =
            tokio::time::timeout(std::time::Duration::from_millis(100), notify.notified()).await;
    }
}

/// The link's broker requests, handed to the relay.
pub(super) struct Service {
    pub(super) inner: Arc<Inner>,
}

impl BrokerService for Service {
    fn handle(&self, from: NodeId, payload: bytes::Bytes) -> BrokerReply {
        match bincode::deserialize::<Vec<RelayMsg>>(&payload) {
            Ok(batch) => self.inner.handle(from, batch),
            Err(e) => {
                tracing::warn!(node = from, error = %e, "relay: undecodable request");
                BrokerReply::Now(Vec::new())
            }
        }
    }
}
