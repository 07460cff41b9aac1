//! The broker's side: [`RemoteLink`] calls of sessions on this node, for queues of other
//! nodes, turned into relay messages.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::oneshot;

use super::sender::Outgoing;
use super::wire::{RelayMsg, WireMessage, WireSettle};
use super::{lock, ConsumerSink, Relay, SinkTag};
use crate::broker::dead_letter::{LetterHold, WrittenLetter};
use crate::broker::remote::{
    CallFuture, NodeCall, NodeCallFuture, NodeReply, QueueCall, QueueReply,
};
use crate::broker::{ChannelKey, Message, Outbox, RemoteConsumer, RemoteLink, RemoteQueue, Settle};
use crate::meta::NodeId;

impl RemoteLink for Relay {
    fn publish(
        &self,
        node: NodeId,
        vhost: &str,
        queues: Vec<String>,
        message: Arc<Message>,
        outcome: u64,
    ) {
        let msg = RelayMsg::Publish {
            vhost: vhost.to_string(),
            queues,
            message: WireMessage::of(&message),
        };
        self.inner.send(node, msg, outcome);
    }

    fn dead_letter(&self, vhost: &str, queue: String, message: Arc<Message>, hold: LetterHold) {
        super::dead_letter::forward(self.inner.clone(), vhost.to_string(), queue, message, hold);
    }

    fn dead_letters_written(&self, letters: Vec<WrittenLetter>) {
        super::dead_letter::when_written(self.inner.clone(), letters);
    }

    fn deliver_reply(&self, node: NodeId, name: &str, message: Arc<Message>) {
        let msg = RelayMsg::DeliverReply {
            name: name.to_string(),
            message: WireMessage::of(&message),
        };
        self.inner.send(node, msg, 0);
    }

    fn consume(
        &self,
        queue: &RemoteQueue,
        key: ChannelKey,
        outbox: &Arc<Outbox>,
        consumer: RemoteConsumer,
    ) {
        {
            let mut sinks = lock(&self.inner.sinks);
            let sink = sinks.entry(key).or_insert_with(|| ConsumerSink {
                outbox: Arc::downgrade(outbox),
                tags: Vec::new(),
            });
            sink.outbox = Arc::downgrade(outbox);
            if let Some(r) = lock(&self.inner.retired).get_mut(&key) {
                r.tags
                    .retain(|(t, n)| !(*n == queue.node && **t == *consumer.tag));
            }
            sink.tags.push(SinkTag {
                node: queue.node,
                tag: consumer.tag.clone(),
                queue: Arc::new((queue.vhost.clone(), queue.name.clone())),
                cancel_on_ha_failover: consumer.cancel_on_ha_failover,
            });
        }
        let msg = RelayMsg::Consume {
            vhost: queue.vhost.clone(),
            queue: queue.name.clone(),
            conn: key.conn,
            channel: key.channel,
            tag: consumer.tag.to_string(),
            no_ack: consumer.no_ack,
            prefetch: consumer.prefetch,
            global_prefetch: consumer.global_prefetch,
            priority: consumer.priority,
            exclusive: consumer.exclusive,
        };
        self.inner.send(queue.node, msg, 0);
    }

    fn cancel(&self, queue: &RemoteQueue, key: ChannelKey, tag: &str) {
        {
            let mut sinks = lock(&self.inner.sinks);
            if let Some(s) = sinks.get_mut(&key) {
                s.tags.retain(|t| !(t.node == queue.node && &*t.tag == tag));
                if s.tags.is_empty() {
                    sinks.remove(&key);
                }
            }
        }
        let msg = RelayMsg::Cancel {
            vhost: queue.vhost.clone(),
            queue: queue.name.clone(),
            conn: key.conn,
            channel: key.channel,
            tag: tag.to_string(),
        };
        self.inner.send(queue.node, msg, 0);
    }

    fn call(&self, call: QueueCall) -> CallFuture {
        let q = call.queue().clone();
        let msg = match call {
            QueueCall::Get { key, no_ack, .. } => RelayMsg::Get {
                vhost: q.vhost.clone(),
                queue: q.name.clone(),
                conn: key.conn,
                channel: key.channel,
                no_ack,
                request: self.inner.next_get.fetch_add(1, Ordering::Relaxed),
            },
            QueueCall::Counts { .. } => RelayMsg::Counts {
                vhost: q.vhost.clone(),
                queue: q.name.clone(),
            },
            QueueCall::Purge { .. } => RelayMsg::Purge {
                vhost: q.vhost.clone(),
                queue: q.name.clone(),
            },
            QueueCall::Figures { .. } => RelayMsg::Figures {
                vhost: q.vhost.clone(),
                queue: q.name.clone(),
            },
        };
        let (tx, rx) = oneshot::channel();
        self.inner.enqueue(
            q.node,
            Outgoing {
                msg,
                outcome: 0,
                after: None,
                released: 0,
                reply_to: Some(tx),
                node_reply_to: None,
                source: Some(q.clone()),
                published: None,
            },
        );
        Box::pin(async move {
            rx.await.unwrap_or_else(|_| {
                QueueReply::Unavailable("the queue's node could not be reached".into())
            })
        })
    }

    fn node_call(&self, node: NodeId, call: NodeCall) -> NodeCallFuture {
        let msg = match call {
            NodeCall::Sessions => RelayMsg::Sessions,
            NodeCall::Stats => RelayMsg::Stats,
            NodeCall::CloseConnection { id, reason } => RelayMsg::CloseConnection { id, reason },
        };
        let (tx, rx) = oneshot::channel();
        self.inner.enqueue(
            node,
            Outgoing {
                msg,
                outcome: 0,
                after: None,
                released: 0,
                reply_to: None,
                node_reply_to: Some(tx),
                source: None,
                published: None,
            },
        );
        Box::pin(async move {
            rx.await
                .unwrap_or_else(|_| NodeReply::Unavailable("the node could not be reached".into()))
        })
    }

    fn settle(&self, queue: &RemoteQueue, key: ChannelKey, seqs: Vec<u64>, how: Settle) {
        let how = match how {
            Settle::Ack => WireSettle::Ack,
            Settle::Nack { requeue: true } => WireSettle::Requeue,
            Settle::Nack { requeue: false } => WireSettle::Drop,
        };
        let msg = RelayMsg::Settle {
            vhost: queue.vhost.clone(),
            queue: queue.name.clone(),
            instance: queue.instance,
            conn: key.conn,
            channel: key.channel,
            seqs,
            how,
        };
        self.inner.send(queue.node, msg, 0);
    }
}
