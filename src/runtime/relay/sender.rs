//! Sending to a node: one ordered sender task per node batches what is queued for it into
//! requests; a second task matches the replies, in order, to what waits for them.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, watch};

use super::wire::{encode, encode_one, RelayMsg, RelayReply, WireSettle};
use super::{lock, Inner, ProxyChannel, ABANDONED_GETS, RETRY_FOR, SEND_BATCH, SEND_BATCH_BYTES};
use crate::broker::remote::{NodeReply, QueueReply, RemoteGot};
use crate::broker::{ChannelKey, RemoteQueue, Settle};
use crate::meta::NodeId;

/// A node's sender, and the signal that the node was declared down.
pub(super) type NodeSender = (mpsc::UnboundedSender<Outgoing>, watch::Sender<bool>);

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
        let mut senders = lock(&self.senders);
        let (tx, _) = senders
            .entry(node)
            .or_insert_with(|| self.spawn_sender(node));
        // Counted until its answer came (or it failed): a node link that stops draining
        // raises the memory alarm here, which blocks publishers, instead of what waits for
        // that node growing without bound.
        let held = out.msg.held_bytes();
        self.broker.count_relayed(held);
        if let Err(mpsc::error::SendError(out)) = tx.send(out) {
            // The sender task ended (shutdown): fail what needed an answer.
            self.broker.count_relayed(-held);
            self.failed(node, out);
        }
    }

    /// The sender task for `node`: takes what is queued (up to [`SEND_BATCH`] messages or
    /// 1 MiB at a time) as one request, in order; a second task handles the replies in the
    /// same order.
    pub(super) fn spawn_sender(&self, node: NodeId) -> NodeSender {
        let (tx, mut rx) = mpsc::unbounded_channel::<Outgoing>();
        let (down_tx, mut down) = watch::channel(false);
        let Some(relay) = self.link.upgrade() else {
            return (tx, down_tx);
        };
        let inner = relay.inner.clone();
        type Pending = (
            Vec<Outgoing>,
            tokio::sync::oneshot::Receiver<
                Result<Vec<u8>, crate::runtime::node_link::wire::RemoteFailure>,
            >,
        );
        let (reply_tx, mut reply_rx) = mpsc::unbounded_channel::<Pending>();
        let answers = inner.clone();
        let mut sender_down = down.clone();
        tokio::spawn(async move {
            while let Some((outs, reply)) = reply_rx.recv().await {
                let held: i64 = outs.iter().map(|o| o.msg.held_bytes()).sum();
                let answer = tokio::select! {
                    r = reply => Some(r),
                    _ = down.wait_for(|d| *d) => None,
                };
                answers.broker.count_relayed(-held);
                let replies: Option<Vec<RelayReply>> = match answer {
                    Some(Ok(Ok(bytes))) => bincode::deserialize(&bytes).ok(),
                    _ => None,
                };
                match replies {
                    Some(replies) => {
                        for (i, out) in outs.into_iter().enumerate() {
                            answers.answered(out, replies.get(i));
                        }
                    }
                    None => outs.into_iter().for_each(|o| answers.failed(node, o)),
                }
            }
        });
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut bytes = first.msg.size();
                let mut batch = vec![first];
                while batch.len() < SEND_BATCH && bytes < SEND_BATCH_BYTES {
                    match rx.try_recv() {
                        Ok(o) => {
                            bytes += o.msg.size();
                            batch.push(o);
                        }
                        Err(_) => break,
                    }
                }
                let held: i64 = batch.iter().map(|o| o.msg.held_bytes()).sum();
                let msgs: Vec<&RelayMsg> = batch.iter().map(|o| &o.msg).collect();
                let payload = encode(&msgs);
                // Under a partition the link stops draining and this send waits for room
                // without end; once the node is recorded down nothing queued here can be
                // answered before it returns, so all of it fails now (publishes are nacked)
                // and the channels behind it go on.
                let sent = tokio::select! {
                    sent = inner.transport.send_broker(node, payload) => Some(sent),
                    _ = sender_down.wait_for(|d| *d) => None,
                };
                let Some(sent) = sent else {
                    tracing::info!(node, "relay: node down; failing what was queued for it");
                    inner.broker.count_relayed(-held);
                    batch.into_iter().for_each(|o| inner.failed(node, o));
                    rx.close();
                    while let Some(o) = rx.recv().await {
                        inner.broker.count_relayed(-o.msg.held_bytes());
                        inner.failed(node, o);
                    }
                    return;
                };
                match sent {
                    // Held (and counted) until answered: the link's own queue, and its
                    // socket, can hold much more than the watermark when it stops draining.
                    Ok(reply) => {
                        if let Err(mpsc::error::SendError((outs, _))) =
                            reply_tx.send((batch, reply))
                        {
                            inner.broker.count_relayed(-held);
                            outs.into_iter().for_each(|o| inner.failed(node, o));
                        }
                    }
                    Err(e) => {
                        tracing::debug!(node, error = %e, "relay: cannot reach node");
                        inner.broker.count_relayed(-held);
                        batch.into_iter().for_each(|o| inner.failed(node, o));
                    }
                }
            }
        });
        (tx, down_tx)
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
                Some(RelayReply::Got(got)) => {
                    QueueReply::Got(got.as_ref().and_then(|(seq, redelivered, m, remaining)| {
                        Some(RemoteGot {
                            seq: *seq,
                            redelivered: *redelivered,
                            message: Arc::new(m.message()?),
                            remaining: *remaining,
                            source: out.source.clone(),
                        })
                    }))
                }
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
                for (vhost, queue, seq) in list {
                    lock(&proxy.unacked).remove(&(vhost.clone(), queue.clone(), *seq));
                    self.settle_local(vhost, queue, &[*seq], Settle::Nack { requeue: true });
                }
            }
            self.release(&proxy, out.released);
        }
    }

    /// `out` could not be sent to `node`, or its answer did not come (the node was given
    /// up): whoever waits hears so. What would leave a message unacknowledged there for
    /// good is sent again, outside the ordered sender, until the node has it: a settle (the
    /// node may not have given this one up, and keeps the delivery), and the abandonment of
    /// a get with acks (the get may have reached the node anyway).
    pub(super) fn failed(&self, node: NodeId, out: Outgoing) {
        match &out.msg {
            RelayMsg::Settle { .. } => self.send_until_taken(node, out.msg.clone()),
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
            let (_, vhost, queue, seq) = gets.remove(i)?;
            let held = lock(&p.unacked).remove(&(vhost.clone(), queue.clone(), seq));
            Some((vhost, queue, seq, held))
        });
        match found {
            Some((vhost, queue, seq, true)) => {
                tracing::debug!(node, queue = %queue, seq, "abandoned get: its message requeued");
                self.settle_local(&vhost, &queue, &[seq], Settle::Nack { requeue: true });
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
                    tracing::warn!(node, "relay: a settle could not be sent to the node");
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
        });
    }
}
