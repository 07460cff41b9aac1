//! Sending to a node: drives the node's [`NodeOutbox`] (order, batches, the memory alarm's
//! count, one fate per item). One task hands its batches to the node link in order; a
//! second takes the replies, in the same order, to what waits for them.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, watch, Notify};

use super::wire::{encode, encode_one, RelayMsg, RelayReply, WireSettle};
use super::{lock, Inner, ProxyChannel, ABANDONED_GETS, RETRY_FOR, SEND_BATCH, SEND_BATCH_BYTES};
use crate::broker::remote::{NodeReply, QueueReply, RemoteGot};
use crate::broker::{ChannelKey, RemoteQueue};
use crate::cluster::NodeOutbox;
use crate::meta::NodeId;
use crate::runtime::node_link::wire::RemoteFailure;

/// A node's sender: its outbox, shared by whoever queues and the tasks that move it.
pub(super) struct NodeSender {
    outbox: std::sync::Mutex<NodeOutbox<Outgoing>>,
    /// Something was queued.
    wake: Notify,
    /// The node was declared down: the tasks stop.
    down: watch::Sender<bool>,
}

/// A message queued for another node, with what to do with its reply.
pub(super) struct Outgoing {
    pub(super) msg: RelayMsg,
    /// The publish outcome this answers (0: none).
    pub(super) outcome: u64,
    /// Outbox credit to return (and queues to poke) once a delivery batch is answered.
    pub(super) after: Option<Arc<ProxyChannel>>,
    pub(super) released: usize,
    /// A parked channel waiting for the answer.
    pub(super) reply_to: Option<oneshot::Sender<QueueReply>>,
    /// A node call waiting for the answer.
    pub(super) node_reply_to: Option<oneshot::Sender<NodeReply>>,
    /// The queue a call is about.
    pub(super) source: Option<Arc<RemoteQueue>>,
    /// A forwarded dead letter's sender, told whether the queue's node took it.
    pub(super) published: Option<oneshot::Sender<bool>>,
}

/// A batch's reply from the node link.
type ReplyRx = oneshot::Receiver<Result<Vec<u8>, RemoteFailure>>;

impl Inner {
    /// Queues `msg` for `node`, in order with everything else sent there.
    pub(super) fn send(&self, node: NodeId, msg: RelayMsg, outcome: u64) {
        self.send_raw(node, msg, outcome, None, 0);
    }

    pub(super) fn send_raw(
        &self,
        node: NodeId,
        msg: RelayMsg,
        outcome: u64,
        after: Option<Arc<ProxyChannel>>,
        released: usize,
    ) {
        let out = Outgoing {
            msg,
            outcome,
            after,
            released,
            reply_to: None,
            node_reply_to: None,
            source: None,
            published: None,
        };
        self.enqueue(node, out);
    }

    pub(super) fn enqueue(&self, node: NodeId, out: Outgoing) {
        if self.broker.node_is_down(node) {
            // Nothing sent to a node the failure detector gave up on would be answered
            // before it comes back (a frozen node holds its sockets open).
            self.failed(node, out);
            return;
        }
        let sender = lock(&self.senders)
            .entry(node)
            .or_insert_with(|| self.spawn_sender(node))
            .clone();
        let (size, held) = (out.msg.size(), out.msg.held_bytes().max(0) as usize);
        let queued = self.step(&sender, |o| o.handle_enqueue(out, size, held));
        match queued {
            Ok(()) => sender.wake.notify_one(),
            Err(out) => self.failed(node, out),
        }
    }

    /// Runs `f` on `sender`'s outbox and passes the change in held bytes to the memory
    /// alarm. What `f` returns is handled after the lock is let go (a failure can queue
    /// again).
    fn step<R>(&self, sender: &NodeSender, f: impl FnOnce(&mut NodeOutbox<Outgoing>) -> R) -> R {
        let (r, held) = {
            let mut outbox = lock(&sender.outbox);
            let r = f(&mut outbox);
            (r, outbox.take_held())
        };
        if held != 0 {
            self.broker.count_relayed(held);
        }
        r
    }

    /// `node` was declared down: everything queued, being sent or awaiting its answer
    /// there fails now (publishes are nacked), and the sender's tasks stop.
    pub(super) fn sender_down(&self, node: NodeId) {
        let Some(sender) = lock(&self.senders).remove(&node) else {
            return;
        };
        let failed = self.step(&sender, |o| o.handle_down());
        let _ = sender.down.send(true);
        if !failed.is_empty() {
            tracing::info!(
                node,
                n = failed.len(),
                "relay: node down; failing what was queued for it"
            );
        }
        failed.into_iter().for_each(|o| self.failed(node, o));
    }

    /// The tasks that move `node`'s outbox: batches go to the link one at a time, in order
    /// (up to [`SEND_BATCH`] messages or [`SEND_BATCH_BYTES`]); their replies are taken in
    /// the same order.
    pub(super) fn spawn_sender(&self, node: NodeId) -> Arc<NodeSender> {
        let sender = Arc::new(NodeSender {
            outbox: std::sync::Mutex::new(NodeOutbox::new(SEND_BATCH, SEND_BATCH_BYTES)),
            wake: Notify::new(),
            down: watch::channel(false).0,
        });
        let Some(relay) = self.link.upgrade() else {
            // The relay is gone (the node stops): nothing would move this outbox, so what
            // is queued for the node fails at once.
            lock(&sender.outbox).handle_down();
            return sender;
        };
        let inner = relay.inner.clone();
        let (reply_tx, reply_rx) = mpsc::unbounded_channel::<(u64, ReplyRx)>();
        tokio::spawn(take_replies(inner.clone(), node, sender.clone(), reply_rx));
        tokio::spawn(send_batches(inner, node, sender.clone(), reply_tx));
        sender
    }

    pub(super) fn answered(&self, out: Outgoing, reply: Option<&RelayReply>) {
        if let Some(tx) = out.node_reply_to {
            let _ = tx.send(match reply {
                Some(RelayReply::Sessions(v)) => NodeReply::Sessions(v.clone()),
                Some(RelayReply::Closed(found)) => NodeReply::Closed(*found),
                Some(RelayReply::Stats(s)) => NodeReply::Stats(s.clone()),
                _ => NodeReply::Unavailable("unexpected answer from the node".into()),
            });
            return;
        }
        if let Some(tx) = out.reply_to {
            let answer = match reply {
                Some(RelayReply::Got(got)) => QueueReply::Got(got.as_ref().and_then(|g| {
                    Some(RemoteGot {
                        seq: g.seq,
                        redelivered: g.redelivered,
                        message: Arc::new(g.message.message()?),
                        remaining: g.remaining,
                        // Its settle names the queue's instance the message came from.
                        source: out
                            .source
                            .as_ref()
                            .map(|q| Arc::new(q.of_instance(g.instance))),
                    })
                })),
                Some(RelayReply::Counts(messages, consumers, unacked)) => QueueReply::Counts {
                    messages: *messages,
                    consumers: *consumers,
                    unacked: *unacked,
                },
                Some(RelayReply::Purged(n)) => QueueReply::Purged(*n),
                Some(RelayReply::Figures(f)) => QueueReply::Figures(f.clone()),
                Some(RelayReply::Missing(text)) => QueueReply::Unavailable(text.clone()),
                _ => QueueReply::Unavailable("unexpected answer from the queue's node".into()),
            };
            if let Err(QueueReply::Got(Some(got))) = tx.send(answer) {
                // The asking connection is gone: the message goes back to its queue.
                if let (Some(q), RelayMsg::Get { conn, channel, .. }) = (&got.source, &out.msg) {
                    let settle = RelayMsg::Settle {
                        vhost: q.vhost.clone(),
                        queue: q.name.clone(),
                        instance: q.instance,
                        conn: *conn,
                        channel: *channel,
                        seqs: vec![got.seq],
                        how: WireSettle::Requeue,
                    };
                    self.send(q.node, settle, 0);
                }
            }
            return;
        }
        if out.outcome != 0 {
            let taken = matches!(reply, Some(RelayReply::Published(true)));
            self.broker.remote_outcomes().resolve(out.outcome, taken);
        }
        if let Some(tx) = out.published {
            let _ = tx.send(matches!(reply, Some(RelayReply::Published(true))));
        }
        if let Some(proxy) = out.after {
            if let Some(RelayReply::Undelivered(list)) = reply {
                // The consumer's connection went away before they reached it.
                for held in list {
                    lock(&proxy.unacked).remove(held);
                    self.requeue_held(held);
                }
            }
            self.release(&proxy, out.released);
        }
    }

    /// `out` could not be sent to `node`, or its answer did not come (the node was given
    /// up): whoever waits hears so. What would leave a message unacknowledged there for
    /// good is sent again, outside the ordered sender, until the node has it: a settle (the
    /// node may not have given this one up, and keeps the delivery), and the abandonment of
    /// a get with acks (the get may have reached the node anyway). A consume that failed
    /// is taken back as the node's cancel would take it.
    pub(super) fn failed(&self, node: NodeId, out: Outgoing) {
        match &out.msg {
            RelayMsg::Settle { .. } => self.send_until_taken(node, out.msg.clone()),
            // Consumers cancelled here that `node` still takes as attached: told until it
            // hears (a cancel lost with its link left a consumer waiting for good,
            // simulation seed 376). The deliveries beside them are requeued below.
            RelayMsg::Deliver {
                conn,
                channel,
                cancels,
                ..
            } if !cancels.is_empty() => self.send_cancels(
                node,
                ChannelKey {
                    conn: *conn,
                    channel: *channel,
                },
                cancels.clone(),
            ),
            RelayMsg::Consume {
                conn, channel, tag, ..
            } => {
                // It may never have reached the node: the consumer is taken back here as if
                // the node had cancelled it (one of a mirrored queue asks again, anything
                // else is cancelled), not left waiting for deliveries that may never come.
                // If it did arrive, asking again finds it attached there.
                let cancel = RelayMsg::Deliver {
                    conn: *conn,
                    channel: *channel,
                    deliveries: Vec::new(),
                    cancels: vec![tag.clone()],
                };
                let _ = self.handle_one(node, cancel);
            }
            RelayMsg::Get {
                conn,
                channel,
                no_ack: false,
                request,
                ..
            } => self.send_until_taken(
                node,
                RelayMsg::GetAbandoned {
                    conn: *conn,
                    channel: *channel,
                    request: *request,
                },
            ),
            _ => {}
        }
        if let Some(tx) = out.reply_to {
            let _ = tx.send(QueueReply::Unavailable(
                "the queue's node could not be reached".into(),
            ));
            return;
        }
        if out.outcome != 0 {
            self.broker.remote_outcomes().resolve(out.outcome, false);
        }
        if let Some(tx) = out.published {
            let _ = tx.send(false);
        }
        if let Some(proxy) = out.after {
            if matches!(out.msg, RelayMsg::Deliver { .. }) {
                self.abandon_proxy(&proxy);
            }
            self.release(&proxy, out.released);
        }
    }

    /// Get `request` of `node`'s channel `key` never reached the channel: what it took goes
    /// back to its queue. One not arrived yet is remembered, so that it takes nothing.
    pub(super) fn abandon_get(&self, node: NodeId, key: ChannelKey, request: u64) {
        let proxy = lock(&self.proxies).get(&(node, key)).cloned();
        let found = proxy.and_then(|p| {
            let mut gets = lock(&p.gets);
            let i = gets.iter().position(|g| g.0 == request)?;
            let (_, held) = gets.remove(i)?;
            let unsettled = lock(&p.unacked).remove(&held);
            Some((held, unsettled))
        });
        match found {
            Some((held, true)) => {
                tracing::debug!(node, queue = %held.queue, seq = held.seq, "abandoned get: its message requeued");
                self.requeue_held(&held);
            }
            // Settled already, or requeued with its proxy channel.
            Some(_) => {}
            None => {
                let mut abandoned = lock(&self.abandoned_gets);
                if abandoned.len() == ABANDONED_GETS {
                    abandoned.pop_front();
                }
                abandoned.push_back((node, request));
            }
        }
    }

    /// Sends `msg` to `node` outside its ordered sender, again and again for [`RETRY_FOR`]
    /// until the node has handled it.
    pub(super) fn send_until_taken(&self, node: NodeId, msg: RelayMsg) {
        let payload = encode_one(&msg);
        let transport = self.transport.clone();
        tokio::spawn(async move {
            let until = tokio::time::Instant::now() + RETRY_FOR;
            loop {
                let attempt = async {
                    let reply = transport.send_broker(node, payload.clone()).await.ok()?;
                    reply.await.ok()?.ok()
                };
                let timeout = std::time::Duration::from_secs(5);
                if let Ok(Some(_)) = tokio::time::timeout(timeout, attempt).await {
                    return;
                }
                if tokio::time::Instant::now() >= until {
                    tracing::warn!(
                        node,
                        "relay: a settle, cancel or abandoned get could not be sent to the node"
                    );
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
        });
    }
}

/// Hands `sender`'s batches to the node link, one at a time, in order.
async fn send_batches(
    inner: Arc<Inner>,
    node: NodeId,
    sender: Arc<NodeSender>,
    replies: mpsc::UnboundedSender<(u64, ReplyRx)>,
) {
    let mut down = sender.down.subscribe();
    loop {
        let next = {
            let mut outbox = lock(&sender.outbox);
            outbox
                .poll_batch()
                .map(|(id, outs)| (id, encode(&outs.iter().map(|o| &o.msg).collect::<Vec<_>>())))
        };
        let Some((id, payload)) = next else {
            tokio::select! {
                _ = sender.wake.notified() => continue,
                _ = down.wait_for(|d| *d) => return,
            }
        };
        // Under a partition the link stops draining and this waits for room without end;
        // once the node is declared down, `sender_down` failed it with the rest.
        let sent = tokio::select! {
            sent = inner.transport.send_broker(node, payload) => sent,
            _ = down.wait_for(|d| *d) => return,
        };
        match sent {
            Ok(reply) => {
                inner.step(&sender, |o| o.handle_handed(id));
                if let Err(mpsc::error::SendError((id, _))) = replies.send((id, reply)) {
                    let failed = inner.step(&sender, |o| o.handle_unanswered(id));
                    failed.into_iter().for_each(|o| inner.failed(node, o));
                }
            }
            Err(e) => {
                tracing::debug!(node, error = %e, "relay: cannot reach node");
                let failed = inner.step(&sender, |o| o.handle_refused(id));
                failed.into_iter().for_each(|o| inner.failed(node, o));
            }
        }
    }
}

/// Takes the replies of `sender`'s batches, in order, to what waits for them.
async fn take_replies(
    inner: Arc<Inner>,
    node: NodeId,
    sender: Arc<NodeSender>,
    mut replies: mpsc::UnboundedReceiver<(u64, ReplyRx)>,
) {
    let mut down = sender.down.subscribe();
    while let Some((id, reply)) = replies.recv().await {
        let answer = tokio::select! {
            r = reply => r,
            _ = down.wait_for(|d| *d) => return,
        };
        let answers: Option<Vec<RelayReply>> = match answer {
            Ok(Ok(bytes)) => bincode::deserialize(&bytes).ok(),
            _ => None,
        };
        let (outs, failed) = inner.step(&sender, |o| match answers {
            Some(_) => o.handle_answered(id),
            None => (Vec::new(), o.handle_unanswered(id)),
        });
        failed.into_iter().for_each(|o| inner.failed(node, o));
        let answers = answers.unwrap_or_default();
        for (i, out) in outs.into_iter().enumerate() {
            inner.answered(out, answers.get(i));
        }
    }
}
