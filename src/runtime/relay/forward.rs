//! The forwarder of a proxy channel: the deliveries (and broker cancels) a remote
//! consumer's proxy channel takes go back to the consumer's node, in order, in batches.

use std::sync::Arc;

use tokio::sync::Notify;

use super::wire::{RelayMsg, WireDelivery, WireMessage};
use super::{lock, Inner, ProxyChannel, BATCH, SEND_BATCH_BYTES};
use crate::broker::OutItem;

/// The forwarder of a proxy channel: drains its outbox and sends the deliveries (and
/// broker cancels) to the consumer's node, in order.
pub(super) async fn forward(inner: Arc<Inner>, proxy: Arc<ProxyChannel>, notify: Arc<Notify>) {
    let mut items = Vec::new();
    loop {
        notify.notified().await;
        let current = lock(&inner.proxies)
            .get(&(proxy.node, proxy.key))
            .is_some_and(|p| Arc::ptr_eq(p, &proxy));
        if !current {
            return;
        }
        proxy.outbox.drain(&mut items);
        while !items.is_empty() {
            // At most BATCH deliveries and about SEND_BATCH_BYTES per message.
            let mut take = 0;
            let mut size = 0;
            for item in &items {
                if take == BATCH || (take > 0 && size >= SEND_BATCH_BYTES) {
                    break;
                }
                if let OutItem::Deliver(d) = item {
                    size += d.message.size() as usize;
                }
                take += 1;
            }
            let mut deliveries = Vec::with_capacity(take);
            let mut cancels = Vec::new();
            let mut bytes = 0usize;
            for item in items.drain(..take) {
                match item {
                    OutItem::Deliver(d) => {
                        bytes += d.message.size() as usize;
                        let held = inner.held(&d);
                        if d.ack_required {
                            lock(&proxy.unacked).insert(held.clone());
                        }
                        deliveries.push(WireDelivery {
                            held,
                            tag: d.consumer_tag.to_string(),
                            redelivered: d.redelivered,
                            ack_required: d.ack_required,
                            message: WireMessage::of(&d.message),
                        });
                    }
                    // A queue that moved away: the consumer's own node hears a cancel from
                    // the master of a mirrored queue, and makes it follow the queue.
                    OutItem::Rehome { consumer_tag, .. } | OutItem::Cancel { consumer_tag, .. } => {
                        let mut c = lock(&proxy.consumers);
                        c.retain(|(_, _, t)| *t != consumer_tag);
                        cancels.push(consumer_tag.to_string());
                    }
                    // Only a connection's own outbox is closed by an operator, and only a
                    // channel's reply consumer gets replies.
                    OutItem::Close { .. } | OutItem::Reply { .. } => {}
                }
            }
            let msg = RelayMsg::Deliver {
                conn: proxy.key.conn,
                channel: proxy.key.channel,
                deliveries,
                cancels,
            };
            inner.send_raw(proxy.node, msg, 0, Some(proxy.clone()), bytes);
        }
    }
}
