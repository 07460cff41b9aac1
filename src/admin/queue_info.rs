//! What a queue listing shows of one queue, typed: `warrenctl list_queues`' text row and the
//! management API's JSON object are both made from it, so neither has to parse the other's
//! text (10,000 queues turned into text and parsed back were most of a listing's time).

use super::mirrors::{self, Mirrors};
use super::requests::{NodeInfo, RemoteCounts};
use crate::broker::{Broker, QueueFigures};
use crate::meta::policy::Effective;
use crate::meta::state::{QueueDef, Vhost};
use crate::meta::MetaState;

/// One queue as the listings show it.
#[derive(Clone, Debug)]
pub struct QueueInfo<'a> {
    /// Its definition (name, flags, arguments).
    pub def: &'a QueueDef,
    /// Its figures: this node's own queue's now, or what its node answered (zero when its
    /// node did not answer).
    pub figures: QueueFigures,
    /// The node it runs on.
    pub node: &'a str,
    /// Its effective policy.
    pub policy: Effective,
    /// Its mirror set, when it is mirrored.
    pub mirrors: Option<Mirrors>,
}

impl<'a> QueueInfo<'a> {
    /// Queue `q` of vhost `v` in `meta`; `remote_counts` holds the figures of queues other
    /// nodes run.
    pub fn of(
        broker: &Broker,
        node: &'a NodeInfo,
        meta: &'a MetaState,
        v: &'a Vhost,
        q: &'a QueueDef,
        remote_counts: &RemoteCounts,
    ) -> QueueInfo<'a> {
        let figures = match broker.queue(&v.name, &q.name) {
            Some(h) => h.lock().figures(),
            // Another node's queue: the figures its node gave the caller, if any.
            None => remote_counts.get(&q.name).cloned().unwrap_or_default(),
        };
        QueueInfo {
            def: q,
            figures,
            node: meta
                .nodes
                .get(&q.home)
                .map_or(node.name.as_str(), |n| n.name.as_str()),
            policy: v.effective_policy(&q.name, true),
            mirrors: mirrors::mirrors(meta, &v.name, &q.name),
        }
    }

    /// Every queue of vhost `v`, in name order.
    pub fn all_of(
        broker: &Broker,
        node: &'a NodeInfo,
        meta: &'a MetaState,
        v: &'a Vhost,
        remote_counts: &RemoteCounts,
    ) -> Vec<QueueInfo<'a>> {
        v.queues
            .values()
            .map(|q| QueueInfo::of(broker, node, meta, v, q, remote_counts))
            .collect()
    }
}
