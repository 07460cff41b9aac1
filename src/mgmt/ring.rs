//! Warren's extension of `GET /api/queues/{vhost}/{name}`: the queue's GM ring as the web
//! console draws it (`gm_ring`, `epoch`). RabbitMQ has no such fields; clients that do not
//! know them ignore them.
//!
//! The ring is read from the metadata and from what this node knows, never guessed:
//!
//! - members in the GM group record's ring order (a dead member stays until the GM group
//!   erases it), then the master and mirrors that have no member in the group yet;
//! - `role`: `master` (the queue's home node), `mirror` (in its mirror set) or `member` (a
//!   member that is neither any more: a dead old master, a mirror being removed);
//! - `state`: `down` when the member is dead or its node is recorded down by the failure
//!   detector, else `synchronised` (the master, and mirrors the metadata records
//!   synchronised), `syncing` (an unsynchronised mirror) or `leaving` (a `member`);
//! - `sync_remaining`: how far behind the member is, in sequence numbers (an upper bound
//!   on messages): 0 when synchronised; for a syncing mirror the running copy's figure,
//!   which only the master's node has (`warren_mirror_sync_sequence_remaining`), so `null`
//!   when another node answers or no copy runs; `null` when down or leaving;
//! - `sync_running` (on the queue): whether the master runs a sync copy now, `null` when
//!   another node than the master's answers (only the master's node knows).

use serde_json::{json, Value};

use crate::broker::Broker;
use crate::gm::Slot;
use crate::meta::state::NodeId;
use crate::meta::MetaState;
use crate::mirror::message::group_name;

/// A node's name as the API shows it (`#ID` for a node the metadata forgot).
fn node_name(meta: &MetaState, id: NodeId) -> String {
    meta.nodes
        .get(&id)
        .map_or_else(|| format!("#{id}"), |n| n.name.clone())
}

/// The fields `gm_ring`, `epoch` and `sync_running` for queue `name` in `vhost` (an
/// unmirrored queue: an empty ring, epoch 0, no sync).
pub fn fields(
    broker: &Broker,
    meta: &MetaState,
    vhost: &str,
    name: &str,
) -> [(&'static str, Value); 3] {
    let key = (vhost.to_string(), name.to_string());
    let set = meta.mirror_sets.get(&key);
    let home = meta
        .vhost(vhost)
        .and_then(|v| v.queues.get(name).map(|q| q.home));
    let group = set.and_then(|s| meta.gm_groups.get(&group_name(vhost, name, s.incarnation)));
    let mirrored = set.is_some_and(|s| !s.mirrors.is_empty());
    let (Some(home), Some(set), true) = (home, set, mirrored || group.is_some()) else {
        return [
            ("gm_ring", json!([])),
            ("epoch", json!(0)),
            ("sync_running", json!(false)),
        ];
    };
    let down = |node: NodeId| node != broker.node_id() && broker.node_is_down(node);
    // The running copy is the master's; only its node counts it.
    let master_here = home == broker.node_id();
    let remaining = master_here
        .then(|| broker.metrics().sync_remaining(vhost, name))
        .flatten();
    let slots = group.map(|g| g.members.as_slice()).unwrap_or_default();
    let alive_on = |node: NodeId| {
        slots
            .iter()
            .any(|s| matches!(s, Slot::Alive(id) if id.node == node))
    };
    let member = |node: NodeId, gm: Option<&Slot>| {
        let dead = matches!(gm, Some(Slot::Dead(_)));
        let mirror = set.mirrors.iter().find(|m| m.node == node);
        // A dead member of a node that rejoined is not the node's current master or mirror.
        let role = match (node == home, mirror) {
            _ if dead && alive_on(node) => "member",
            (true, _) => "master",
            (false, Some(_)) => "mirror",
            (false, None) => "member",
        };
        let (state, behind) = match (role, mirror) {
            _ if dead || down(node) => ("down", Value::Null),
            ("master", _) => ("synchronised", json!(0)),
            ("mirror", Some(m)) if m.synchronised => ("synchronised", json!(0)),
            ("mirror", _) => ("syncing", json!(remaining)),
            _ => ("leaving", Value::Null),
        };
        json!({
            "node": node_name(meta, node),
            "role": role,
            "state": state,
            "sync_remaining": behind,
            "gm_member": match gm {
                Some(Slot::Alive(_)) => json!("alive"),
                Some(Slot::Dead(_)) => json!("dead"),
                None => Value::Null,
            },
        })
    };
    let mut ring: Vec<Value> = slots.iter().map(|s| member(s.id().node, Some(s))).collect();
    let in_group = |node: NodeId| slots.iter().any(|s| s.id().node == node);
    let others = std::iter::once(home).chain(set.mirrors.iter().map(|m| m.node));
    for node in others.filter(|n| !in_group(*n)) {
        ring.push(member(node, None));
    }
    let running = master_here.then_some(remaining.is_some());
    [
        ("gm_ring", Value::Array(ring)),
        ("epoch", json!(set.epoch)),
        ("sync_running", json!(running)),
    ]
}
