//! Mirrored queues as `warrenctl` shows and operates them: the mirror columns of
//! `list_queues`, and the decision behind `force_promote_mirror`. Pure: both read a
//! [`MetaState`] and nothing else.
//!
//! Columns (values are read from the metadata, so a mirror on a node that is down is still
//! listed until the reconciler removes it; it stops being synchronised as soon as its node is
//! recorded down):
//!
//! - `slave_pids` / `mirror_pids`: every mirror's node name, oldest mirror first (the order
//!   promotion considers them), bracketed and comma-separated as RabbitMQ prints pids:
//!   `[n2, n3]`; `[]` for an unmirrored queue.
//! - `synchronised_slave_pids` / `synchronised_mirror_pids`: the synchronised ones, same form.
//! - `mirror_epoch`: the mirror set's epoch (how many promotions the queue went through);
//!   0 for a queue that never had mirrors.
//! - `mirrors`: each mirror with its state, `[n2 synchronised, n3 unsynchronised]`.
//!
//! A node id the metadata no longer knows (a forgotten node) shows as `#ID`.

use crate::meta::state::{MirrorRecord, NodeId};
use crate::meta::MetaState;
use crate::mirror::message::group_name;

/// The mirror columns of one queue, in `list_queues` form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MirrorColumns {
    /// `slave_pids` (and `mirror_pids`).
    pub slave_pids: String,
    /// `synchronised_slave_pids` (and `synchronised_mirror_pids`).
    pub synchronised_slave_pids: String,
    /// `mirror_epoch`.
    pub mirror_epoch: String,
    /// `mirrors`.
    pub mirrors: String,
}

/// A node's name as the listings show it.
fn node_name(meta: &MetaState, id: NodeId) -> String {
    meta.nodes
        .get(&id)
        .map_or_else(|| format!("#{id}"), |n| n.name.clone())
}

/// The mirrors of `(vhost, queue)`, oldest first (ties by node id, as promotion breaks them).
fn mirrors_oldest_first(meta: &MetaState, vhost: &str, queue: &str) -> Vec<MirrorRecord> {
    meta.mirror_sets
        .get(&(vhost.to_string(), queue.to_string()))
        .map(|s| oldest_first(&s.mirrors))
        .unwrap_or_default()
}

fn oldest_first(mirrors: &[MirrorRecord]) -> Vec<MirrorRecord> {
    let mut list = mirrors.to_vec();
    list.sort_by_key(|m| (m.since, m.node));
    list
}

fn bracketed(items: impl Iterator<Item = String>) -> String {
    format!("[{}]", items.collect::<Vec<_>>().join(", "))
}

/// One mirror as the listings show it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MirrorMember {
    /// Its node's name (`#ID` for a node the metadata no longer knows).
    pub node: String,
    /// Whether it holds every message of its queue.
    pub synchronised: bool,
}

/// A mirrored queue's mirror set as the listings show it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mirrors {
    /// The set's epoch.
    pub epoch: u64,
    /// Its mirrors, oldest first.
    pub members: Vec<MirrorMember>,
}

/// The mirror set of `queue` in `vhost`; `None` when it is not mirrored.
pub fn mirrors(meta: &MetaState, vhost: &str, queue: &str) -> Option<Mirrors> {
    let set = meta
        .mirror_sets
        .get(&(vhost.to_string(), queue.to_string()))?;
    Some(Mirrors {
        epoch: set.epoch,
        members: oldest_first(&set.mirrors)
            .iter()
            .map(|m| MirrorMember {
                node: node_name(meta, m.node),
                synchronised: m.synchronised,
            })
            .collect(),
    })
}

/// The mirror columns of a queue whose mirror set is `m` (all `[]` and epoch 0 when it is
/// not mirrored).
pub fn columns_of(m: Option<&Mirrors>) -> MirrorColumns {
    let members = m.map_or(&[][..], |m| &m.members);
    MirrorColumns {
        slave_pids: bracketed(members.iter().map(|m| m.node.clone())),
        synchronised_slave_pids: bracketed(
            members
                .iter()
                .filter(|m| m.synchronised)
                .map(|m| m.node.clone()),
        ),
        mirror_epoch: m.map_or(0, |m| m.epoch).to_string(),
        mirrors: bracketed(members.iter().map(|m| {
            let state = if m.synchronised {
                "synchronised"
            } else {
                "unsynchronised"
            };
            format!("{} {state}", m.node)
        })),
    }
}

/// The mirror columns of `queue` in `vhost` (all `[]` and epoch 0 when it is not mirrored).
pub fn columns(meta: &MetaState, vhost: &str, queue: &str) -> MirrorColumns {
    columns_of(mirrors(meta, vhost, queue).as_ref())
}

/// Why `force_promote_mirror` refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PromoteRefusal {
    /// No such vhost.
    #[error("no vhost '{0}'")]
    NoVhost(String),
    /// No such queue.
    #[error("no queue '{queue}' in vhost '{vhost}'")]
    NoQueue {
        /// Vhost.
        vhost: String,
        /// Queue.
        queue: String,
    },
    /// The queue has no mirrors.
    #[error("queue '{queue}' in vhost '{vhost}' is not mirrored")]
    NotMirrored {
        /// Vhost.
        vhost: String,
        /// Queue.
        queue: String,
    },
    /// The master still has a live member in the queue's GM group: it could still complete
    /// laps and confirm publishes, and a second master must never do so too.
    #[error(
        "the master of queue '{queue}' in vhost '{vhost}' on node {master} is alive \
         (a member of the queue's group); promoting a mirror would make two masters"
    )]
    MasterAlive {
        /// Vhost.
        vhost: String,
        /// Queue.
        queue: String,
        /// The master's node name.
        master: String,
    },
    /// The named node is not a cluster node.
    #[error("no cluster node '{0}'")]
    NoNode(String),
    /// The named node holds no mirror of the queue (the master's own node included).
    #[error("node {node} holds no mirror of queue '{queue}' in vhost '{vhost}'")]
    NoMirrorOn {
        /// Vhost.
        vhost: String,
        /// Queue.
        queue: String,
        /// The node's name.
        node: String,
    },
}

/// What `force_promote_mirror` commits: promote the mirror on `node` at `epoch`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Promotion {
    /// The mirror's node.
    pub node: NodeId,
    /// Its name (for the reply).
    pub name: String,
    /// The mirror set's epoch the decision was made at (the command's compare-and-set).
    pub epoch: u64,
}

/// Which mirror of `queue` in `vhost` `force_promote_mirror` makes the master: the one on
/// `requested` (a node name or id), or by default the oldest synchronised mirror and, with
/// none synchronised (the `ha-promote-on-failure: when-synced` dead end), the oldest one.
///
/// Refused while the master's node has a live member in the queue's GM group: that member
/// is only marked dead when the node is recorded down or restarts, and until then the old
/// master may still complete laps, so promoting would make two masters confirming publishes.
pub fn force_promotion(
    meta: &MetaState,
    vhost: &str,
    queue: &str,
    requested: Option<&str>,
) -> Result<Promotion, PromoteRefusal> {
    let v = meta
        .vhost(vhost)
        .ok_or_else(|| PromoteRefusal::NoVhost(vhost.to_string()))?;
    let def = v.queues.get(queue).ok_or_else(|| PromoteRefusal::NoQueue {
        vhost: vhost.to_string(),
        queue: queue.to_string(),
    })?;
    let set = meta
        .mirror_sets
        .get(&(vhost.to_string(), queue.to_string()))
        .filter(|s| !s.mirrors.is_empty())
        .ok_or_else(|| PromoteRefusal::NotMirrored {
            vhost: vhost.to_string(),
            queue: queue.to_string(),
        })?;
    let master_alive = meta
        .gm_groups
        .get(&group_name(vhost, queue, set.incarnation))
        .is_some_and(|g| g.has_live_member_on(def.home));
    if master_alive {
        return Err(PromoteRefusal::MasterAlive {
            vhost: vhost.to_string(),
            queue: queue.to_string(),
            master: node_name(meta, def.home),
        });
    }
    let node = match requested {
        Some(wanted) => {
            let n = meta
                .nodes
                .values()
                .find(|n| n.name == wanted || n.id.to_string() == wanted)
                .ok_or_else(|| PromoteRefusal::NoNode(wanted.to_string()))?;
            if !set.mirrors.iter().any(|m| m.node == n.id) {
                return Err(PromoteRefusal::NoMirrorOn {
                    vhost: vhost.to_string(),
                    queue: queue.to_string(),
                    node: n.name.clone(),
                });
            }
            n.id
        }
        None => {
            // A synchronised mirror holds everything the master confirmed: taking an older
            // unsynchronised one instead would drop messages for nothing.
            let list = mirrors_oldest_first(meta, vhost, queue);
            let pick = list.iter().find(|m| m.synchronised).or(list.first());
            match pick {
                Some(m) => m.node,
                // Unreachable: the set was checked non-empty above; refuse rather than panic.
                None => {
                    return Err(PromoteRefusal::NotMirrored {
                        vhost: vhost.to_string(),
                        queue: queue.to_string(),
                    })
                }
            }
        }
    };
    Ok(Promotion {
        node,
        name: node_name(meta, node),
        epoch: set.epoch,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gm::MemberId;
    use crate::gm::Slot;
    use crate::meta::state::{NodeRecord, QueueDef};
    use crate::meta::Command;
    use amq_protocol::types::FieldTable;

    fn node(id: NodeId, name: &str) -> NodeRecord {
        NodeRecord {
            id,
            name: name.into(),
            amqp: String::new(),
            admin: String::new(),
            link: String::new(),
            incarnation: 0,
        }
    }

    fn queue(name: &str, home: NodeId) -> QueueDef {
        QueueDef {
            vhost: "/".into(),
            name: name.into(),
            durable: true,
            exclusive_owner: None,
            auto_delete: false,
            arguments: FieldTable::default(),
            home,
        }
    }

    fn mirror(node: NodeId, synchronised: bool) -> MirrorRecord {
        MirrorRecord {
            node,
            since: 0,
            synchronised,
        }
    }

    fn apply(s: &mut MetaState, c: Command) {
        s.apply(&c).unwrap_or_else(|e| panic!("{c:?}: {e}"));
    }

    fn set_mirrors(s: &mut MetaState, queue: &str, mirrors: Vec<MirrorRecord>) {
        let expected_version = s
            .mirror_sets
            .get(&("/".to_string(), queue.to_string()))
            .map_or(0, |m| m.version);
        apply(
            s,
            Command::SetMirrors {
                vhost: "/".into(),
                queue: queue.into(),
                expected_version,
                mirrors,
            },
        );
    }

    /// Nodes 1..=4 named `rabbit@a`..`rabbit@d`; queue `m` homed on node 1 with mirrors
    /// added one change at a time, so their ages are: node 3 oldest, then node 2, then
    /// node 4 (node 3 and 4 synchronised); queue `plain` unmirrored.
    fn state() -> MetaState {
        let mut s = MetaState::default();
        apply(&mut s, Command::AddVhost { name: "/".into() });
        for (id, name) in [
            (1, "rabbit@a"),
            (2, "rabbit@b"),
            (3, "rabbit@c"),
            (4, "rabbit@d"),
        ] {
            apply(&mut s, Command::RegisterNode(node(id, name)));
        }
        apply(&mut s, Command::DeclareQueue(queue("m", 1)));
        apply(&mut s, Command::DeclareQueue(queue("plain", 1)));
        set_mirrors(&mut s, "m", vec![mirror(3, false)]);
        set_mirrors(&mut s, "m", vec![mirror(3, false), mirror(2, false)]);
        // Listed out of age order on purpose: the columns sort by age, not by list order.
        set_mirrors(
            &mut s,
            "m",
            vec![mirror(4, true), mirror(2, false), mirror(3, true)],
        );
        s
    }

    fn gm(s: &mut MetaState, queue: &str, members: Vec<Slot>) {
        let incarnation = s
            .mirror_sets
            .get(&("/".to_string(), queue.to_string()))
            .map_or(0, |set| set.incarnation);
        let name = group_name("/", queue, incarnation);
        let expected_version = s.gm_groups.get(&name).map_or(0, |g| g.version);
        apply(
            s,
            Command::GmGroup {
                name,
                expected_version,
                members,
            },
        );
    }

    fn alive(node: u64) -> Slot {
        Slot::Alive(MemberId { node, since: node })
    }

    #[test]
    fn columns_name_mirrors_oldest_first_with_their_state() {
        let s = state();
        assert_eq!(
            columns(&s, "/", "m"),
            MirrorColumns {
                slave_pids: "[rabbit@c, rabbit@b, rabbit@d]".into(),
                synchronised_slave_pids: "[rabbit@c, rabbit@d]".into(),
                mirror_epoch: "0".into(),
                mirrors: "[rabbit@c synchronised, rabbit@b unsynchronised, rabbit@d synchronised]"
                    .into(),
            }
        );
        let empty = MirrorColumns {
            slave_pids: "[]".into(),
            synchronised_slave_pids: "[]".into(),
            mirror_epoch: "0".into(),
            mirrors: "[]".into(),
        };
        assert_eq!(columns(&s, "/", "plain"), empty);
        assert_eq!(columns(&s, "/", "no-such-queue"), empty);
    }

    #[test]
    fn columns_follow_a_promotion_and_a_forgotten_node() {
        let mut s = state();
        apply(
            &mut s,
            Command::PromoteMirror {
                vhost: "/".into(),
                queue: "m".into(),
                expected_epoch: 0,
                node: 3,
            },
        );
        // Node 4 goes down: its mirror is no longer synchronised.
        apply(&mut s, Command::NodeDown { id: 4 });
        let c = columns(&s, "/", "m");
        assert_eq!(c.mirror_epoch, "1");
        assert_eq!(c.slave_pids, "[rabbit@b, rabbit@d]");
        assert_eq!(c.synchronised_slave_pids, "[]", "node 4 went down");
        // Forgetting a node that still holds a mirror: shown by id.
        apply(&mut s, Command::ForgetNode { id: 2 });
        assert_eq!(columns(&s, "/", "m").slave_pids, "[#2, rabbit@d]");
    }

    #[test]
    fn force_promotion_picks_the_named_or_the_oldest_synchronised_then_oldest_mirror() {
        let mut s = state();
        let pick = |s: &MetaState, node: Option<&str>| force_promotion(s, "/", "m", node);
        // No GM group recorded: the master has no live member.
        let p = pick(&s, None).unwrap();
        assert_eq!((p.node, p.name.as_str(), p.epoch), (3, "rabbit@c", 0));
        // Oldest synchronised wins over an older unsynchronised one.
        set_mirrors(
            &mut s,
            "m",
            vec![mirror(3, false), mirror(2, false), mirror(4, true)],
        );
        assert_eq!(pick(&s, None).unwrap().node, 4);
        // None synchronised (the when-synced dead end): the oldest.
        set_mirrors(
            &mut s,
            "m",
            vec![mirror(3, false), mirror(2, false), mirror(4, false)],
        );
        assert_eq!(pick(&s, None).unwrap().node, 3);
        // A named mirror, by name or by id, whatever its state.
        assert_eq!(pick(&s, Some("rabbit@b")).unwrap().node, 2);
        assert_eq!(pick(&s, Some("4")).unwrap().node, 4);
        // The master's member dead, mirrors' alive: allowed, at the current epoch.
        gm(
            &mut s,
            "m",
            vec![
                Slot::Dead(MemberId { node: 1, since: 1 }),
                alive(2),
                alive(3),
            ],
        );
        apply(
            &mut s,
            Command::PromoteMirror {
                vhost: "/".into(),
                queue: "m".into(),
                expected_epoch: 0,
                node: 2,
            },
        );
        // Node 2 is now the master and has a live member: refused.
        assert_eq!(
            pick(&s, None),
            Err(PromoteRefusal::MasterAlive {
                vhost: "/".into(),
                queue: "m".into(),
                master: "rabbit@b".into()
            })
        );
        apply(&mut s, Command::NodeDown { id: 2 });
        let p = pick(&s, None).unwrap();
        assert_eq!(
            (p.node, p.epoch),
            (3, 1),
            "at the epoch after the promotion"
        );
    }

    #[test]
    fn force_promotion_refusals() {
        let mut s = state();
        gm(&mut s, "m", vec![alive(1), alive(3)]);
        let refused = |s: &MetaState, vhost: &str, queue: &str, node: Option<&str>| {
            force_promotion(s, vhost, queue, node)
                .expect_err("refused")
                .to_string()
        };
        assert_eq!(
            refused(&s, "/", "m", None),
            "the master of queue 'm' in vhost '/' on node rabbit@a is alive (a member of the \
             queue's group); promoting a mirror would make two masters"
        );
        // Named mirrors are refused too while the master lives.
        assert!(matches!(
            force_promotion(&s, "/", "m", Some("rabbit@c")),
            Err(PromoteRefusal::MasterAlive { .. })
        ));
        assert_eq!(refused(&s, "nope", "m", None), "no vhost 'nope'");
        assert_eq!(
            refused(&s, "/", "nope", None),
            "no queue 'nope' in vhost '/'"
        );
        assert_eq!(
            refused(&s, "/", "plain", None),
            "queue 'plain' in vhost '/' is not mirrored"
        );
        // The master's node goes down: its member dies. Now only node questions remain.
        apply(&mut s, Command::NodeDown { id: 1 });
        assert_eq!(
            refused(&s, "/", "m", Some("rabbit@z")),
            "no cluster node 'rabbit@z'"
        );
        assert_eq!(
            refused(&s, "/", "m", Some("rabbit@a")),
            "node rabbit@a holds no mirror of queue 'm' in vhost '/'"
        );
        // A set emptied of mirrors is not mirrored any more.
        set_mirrors(&mut s, "m", vec![]);
        assert_eq!(
            refused(&s, "/", "m", None),
            "queue 'm' in vhost '/' is not mirrored"
        );
    }
}
