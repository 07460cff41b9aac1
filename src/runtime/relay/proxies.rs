//! The proxy channels that serve other nodes' consumers of queues here, and what follows a
//! consumer when its queue moves: retired tags (a late delivery from the old master is
//! dropped, not delivered out of order), abandoned proxies, settles of messages delivered
//! here, and the wait for a promoted queue's adoption.

use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::Notify;

use super::forward::forward;
use super::wire::{Held, RelayMsg};
use super::{lock, Inner, ProxyChannel, Retired, PROXY_OUTBOX_BYTES};
use crate::broker::queue::QueueHandle;
use crate::broker::{ChannelKey, ChannelLink, Delivery, OutItem, Outbox, QueueRef, Settle};
use crate::meta::{Command, NodeId};

impl Inner {
    /// Records that consumer `tag` of channel `key` no longer takes deliveries from `node`:
    /// a frame that node sent before (held in a socket buffer through a partition, say)
    /// can arrive after the consumer followed the queue to its new master, and its
    /// delivery would come behind the new master's, out of order.
    pub(super) fn retire(
        &self,
        key: ChannelKey,
        outbox: &Weak<Outbox>,
        tag: &Arc<str>,
        node: NodeId,
    ) {
        let mut retired = lock(&self.retired);
        retired.retain(|_, r| r.outbox.strong_count() > 0);
        let r = retired.entry(key).or_insert_with(|| Retired {
            outbox: outbox.clone(),
            tags: Vec::new(),
        });
        r.outbox = outbox.clone();
        if !r.tags.iter().any(|(t, n)| t == tag && *n == node) {
            r.tags.push((tag.clone(), node));
        }
    }

    /// Whether `node`'s deliveries to consumer `tag` of channel `key` are stale.
    pub(super) fn is_retired(&self, key: &ChannelKey, tag: &str, node: NodeId) -> bool {
        lock(&self.retired)
            .get(key)
            .is_some_and(|r| r.tags.iter().any(|(t, n)| &**t == tag && *n == node))
    }

    /// Deliveries to the consumer's node could not be sent (it is recorded down, or its link
    /// failed): the proxy is closed as `node_down` closes a node's proxies — its consumers
    /// detached, what it held requeued — and the node is told, best effort, that its
    /// consumers were cancelled, so they follow the queue again once it hears.
    ///
    /// Closing, not just requeueing the batch: the proxy can outlive the node's
    /// `node_down` (a frozen node that resumed attaches a consumer before this node hears
    /// it again), and its deliveries would then stay unacked here for good; requeued to a
    /// proxy still attached, they would come straight back to it, in a loop.
    pub(super) fn abandon_proxy(&self, proxy: &Arc<ProxyChannel>) {
        {
            let mut proxies = lock(&self.proxies);
            if proxies
                .get(&(proxy.node, proxy.key))
                .is_some_and(|p| Arc::ptr_eq(p, proxy))
            {
                proxies.remove(&(proxy.node, proxy.key));
            }
        }
        let tags: Vec<String> = lock(&proxy.consumers)
            .iter()
            .map(|(_, _, t)| t.to_string())
            .collect();
        let held = lock(&proxy.unacked).len();
        self.close_proxy(proxy);
        tracing::debug!(
            node = proxy.node,
            consumers = tags.len(),
            held,
            "deliveries not sent: proxy closed, its messages requeued"
        );
        if !tags.is_empty() {
            self.send_cancels(proxy.node, proxy.key, tags);
        }
    }

    /// Tells `node` that consumers `tags` of its channel `key` were cancelled here, without
    /// waiting for it and whether or not it is recorded down, sent again until it answers
    /// (a frozen node gets it when it resumes; a dead one never does, and its channels are
    /// gone anyway). `node` took those consumers as attached: a lost cancel left one waiting
    /// for good (simulation seed 376).
    pub(super) fn send_cancels(&self, node: NodeId, key: ChannelKey, tags: Vec<String>) {
        self.send_until_taken(
            node,
            RelayMsg::Deliver {
                conn: key.conn,
                channel: key.channel,
                deliveries: Vec::new(),
                cancels: tags,
            },
        );
    }

    /// Returns outbox credit of a proxy channel and pokes the queues that waited for it.
    pub(super) fn release(&self, proxy: &ProxyChannel, bytes: usize) {
        let now = self.clock.now();
        for q in proxy.outbox.release(bytes) {
            let mut dead = Vec::new();
            q.lock().deliver(&q, now, &mut dead);
            if !dead.is_empty() {
                self.broker.dead_letter(&q, dead, now);
            }
        }
    }

    /// The instance of queue `h` of this node ([`Held::instance`]): handles are numbered
    /// in the order they are made, and the salt tells this life of the node from the last.
    pub(super) fn instance(&self, h: &QueueHandle) -> u64 {
        self.instance_salt ^ h.generation
    }

    /// What delivery `d`, of a queue here, holds while it goes to another node's channel.
    pub(super) fn held(&self, d: &Delivery) -> Held {
        let (vhost, queue) = d.queue.name();
        let instance = match &d.queue {
            QueueRef::Local(h) => self.instance(h),
            QueueRef::Remote(q) => q.instance,
        };
        Held {
            vhost: vhost.to_string(),
            queue: queue.to_string(),
            instance,
            seq: d.seq,
        }
    }

    /// Settles messages `seqs` of `vhost/queue` here, if the queue running under that name
    /// is `instance`: an earlier one's messages (deleted with it, or this node's last life)
    /// are not this one's, whatever their seqs.
    pub(super) fn settle_local(
        &self,
        vhost: &str,
        queue: &str,
        instance: u64,
        seqs: &[u64],
        how: Settle,
    ) {
        let Some(h) = self.broker.queue(vhost, queue) else {
            return;
        };
        if self.instance(&h) != instance {
            tracing::debug!(queue, "settle for an earlier queue of this name ignored");
            return;
        }
        let now = self.clock.now();
        let dead = QueueRef::Local(h.clone()).settle(
            ChannelKey {
                conn: 0,
                channel: 0,
            },
            seqs,
            how,
            now,
        );
        if !dead.is_empty() {
            self.broker.dead_letter(&h, dead, now);
        }
    }

    /// The proxy channel for `key` of `node`, created with its forwarder on first use.
    pub(super) fn proxy(
        &self,
        node: NodeId,
        key: ChannelKey,
        global_prefetch: u32,
    ) -> Arc<ProxyChannel> {
        let mut proxies = lock(&self.proxies);
        if let Some(p) = proxies.get(&(node, key)) {
            return p.clone();
        }
        let notify = Arc::new(Notify::new());
        let waker = notify.clone();
        let outbox = Arc::new(Outbox::new(
            PROXY_OUTBOX_BYTES,
            Box::new(move || waker.notify_one()),
        ));
        let link = Arc::new(ChannelLink::new(key.conn, key.channel, outbox.clone()));
        link.global_prefetch
            .store(global_prefetch, Ordering::Release);
        let proxy = Arc::new(ProxyChannel {
            node,
            key,
            link,
            outbox,
            consumers: Mutex::new(Vec::new()),
            unacked: Mutex::new(BTreeSet::new()),
            gets: Mutex::new(VecDeque::new()),
        });
        proxies.insert((node, key), proxy.clone());
        if let Some(relay) = self.link.upgrade() {
            tokio::spawn(forward(relay.inner.clone(), proxy.clone(), notify));
        }
        proxy
    }

    pub(super) fn drop_proxies_of(&self, node: NodeId) {
        let gone: Vec<Arc<ProxyChannel>> = {
            let mut proxies = lock(&self.proxies);
            let keys: Vec<_> = proxies
                .keys()
                .filter(|(n, _)| *n == node)
                .copied()
                .collect();
            keys.into_iter()
                .filter_map(|k| proxies.remove(&k))
                .collect()
        };
        for p in gone {
            let tags: Vec<String> = lock(&p.consumers)
                .iter()
                .map(|(_, _, t)| t.to_string())
                .collect();
            if !tags.is_empty() {
                lock(&self.dropped_consumers).push((node, p.key, tags));
            }
            self.close_proxy(&p);
        }
    }

    /// `node`'s channel `key` attached consumer `tag` here again: it needs no cancel for an
    /// earlier one of that tag dropped when `node` was given up.
    pub(super) fn forget_dropped(&self, node: NodeId, key: ChannelKey, tag: &str) {
        let mut dropped = lock(&self.dropped_consumers);
        for (n, k, tags) in dropped.iter_mut() {
            if *n == node && *k == key {
                tags.retain(|t| t != tag);
            }
        }
        dropped.retain(|(_, _, tags)| !tags.is_empty());
    }

    /// Detaches a proxy channel's consumers and requeues what it held.
    pub(super) fn close_proxy(&self, p: &Arc<ProxyChannel>) {
        let now = self.clock.now();
        let consumers = std::mem::take(&mut *lock(&p.consumers));
        for (vhost, queue, tag) in consumers {
            self.detach(p, &vhost, &queue, &tag, now);
        }
        // Deliveries still in the outbox were never sent.
        for item in p.outbox.close() {
            if let OutItem::Deliver(d) = item {
                if d.ack_required {
                    let held = self.held(&d);
                    lock(&p.unacked).remove(&held);
                    self.requeue_held(&held);
                }
            }
        }
        let unacked = std::mem::take(&mut *lock(&p.unacked));
        for held in unacked {
            self.requeue_held(&held);
        }
    }

    /// Puts a message held for another node's channel back in its queue.
    pub(super) fn requeue_held(&self, held: &Held) {
        let how = Settle::Nack { requeue: true };
        self.settle_local(&held.vhost, &held.queue, held.instance, &[held.seq], how);
    }

    pub(super) fn detach(
        &self,
        p: &ProxyChannel,
        vhost: &str,
        queue: &str,
        tag: &str,
        now: crate::time::Instant,
    ) {
        let Some(h) = self.broker.queue(vhost, queue) else {
            return;
        };
        let link = &p.link;
        let auto_delete = h
            .lock()
            .remove_consumers(now, |c| &*c.tag == tag && Arc::ptr_eq(&c.link, link));
        if auto_delete {
            let meta = self.meta.clone();
            let command = Command::DeleteQueue {
                vhost: vhost.to_string(),
                name: queue.to_string(),
            };
            tokio::spawn(async move {
                if let Err(e) = meta.commit(command, now).await {
                    tracing::debug!(error = %e, "auto-delete of a queue not committed");
                }
            });
        }
    }

    /// Whether `vhost/queue` may be about to serve here: a durable queue not running here
    /// whose home this node is (a promoted mirror adopting its copy), or whose mirror this
    /// node is (the promotion may not have reached this node's metadata yet, while the
    /// consumer's node already follows it).
    pub(super) fn awaiting_adoption(&self, vhost: &str, queue: &str) -> bool {
        let me = self.broker.node_id();
        let state = self.broker.snapshot();
        let key = (vhost.to_string(), queue.to_string());
        state
            .vhost(vhost)
            .and_then(|v| v.queues.get(queue))
            .is_some_and(|d| {
                d.durable
                    && (d.home == me
                        || state
                            .mirror_sets
                            .get(&key)
                            .is_some_and(|s| s.mirrors.iter().any(|m| m.node == me)))
            })
            && self.broker.durability().is_some()
            && self.broker.queue(vhost, queue).is_none()
    }
}
