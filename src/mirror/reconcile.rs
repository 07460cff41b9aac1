//! What the Raft leader proposes so that every queue's mirrors follow its policy: pure, from
//! the metadata and the set of running nodes to a list of commands (each a compare-and-set,
//! so a plan computed from a stale state is refused, never misapplied).
//!
//! Per clustered, non-exclusive queue:
//! - no (usable) `ha-mode`: its mirrors are removed;
//! - its master's node is down: the mirror [`crate::meta::promotion`] picks under
//!   `ha-promote-on-failure` takes over (none: the queue waits for its node);
//! - `ha-mode: nodes` excluding the master, with a synchronised listed mirror: that mirror
//!   takes over (a planned move: only ever to a synchronised mirror);
//! - otherwise the mirrors become [`crate::meta::suggested`]'s, keeping each existing mirror's
//!   synchronised flag; new ones start unsynchronised.
//!
//! And the GM group of a deleted queue is forgotten once none of its members is alive.
//!
//! The Raft leader's reconciler in `runtime::mirror_host` runs it whenever the metadata or
//! the set of running nodes changes.

use std::collections::{BTreeMap, BTreeSet};

use crate::meta::state::MirrorRecord;
use crate::meta::{promotion, suggested, Command, HaPolicy, MetaState, NodeId};

/// The commands that bring every queue's mirrors in line with its policy, given the nodes
/// that are `running`.
pub fn plan(state: &MetaState, running: &BTreeSet<NodeId>) -> Vec<Command> {
    let names: BTreeMap<NodeId, String> = state
        .nodes
        .values()
        .map(|n| (n.id, n.name.clone()))
        .collect();
    let mut out = Vec::new();
    for (vhost_name, vhost) in &state.vhosts {
        for (name, def) in vhost.queues.iter() {
            if def.home == 0 {
                continue;
            }
            let key = (vhost_name.clone(), name.clone());
            let current = state.mirror_sets.get(&key).cloned().unwrap_or_default();
            let set = |mirrors: Vec<MirrorRecord>| Command::SetMirrors {
                vhost: vhost_name.clone(),
                queue: name.clone(),
                expected_version: current.version,
                mirrors,
            };
            let promote = |node: NodeId| Command::promote(vhost_name, name, &current, node);
            // Exclusive queues are never mirrored. A non-durable mirrored queue is promoted by
            // the `NodeDown` of its master's node itself (see `MetaState`), or deleted.
            let policy = HaPolicy::of(
                &vhost.effective_policy(name, true),
                def.exclusive_owner.is_some(),
            );
            let Some(policy) = policy else {
                if !current.mirrors.is_empty() {
                    out.push(set(Vec::new()));
                }
                continue;
            };
            if !running.contains(&def.home) {
                if let Some(node) = promotion(&current.mirrors, running, policy.promote_on_failure)
                {
                    out.push(promote(node));
                }
                continue;
            }
            let placement = suggested(&policy.mode, def.home, &current.mirrors, &names, running);
            if placement.master != def.home {
                out.push(promote(placement.master));
                continue;
            }
            let mirrors: Vec<MirrorRecord> = placement
                .mirrors
                .iter()
                .map(|node| {
                    current
                        .mirrors
                        .iter()
                        .find(|m| m.node == *node)
                        .copied()
                        .unwrap_or(MirrorRecord {
                            node: *node,
                            since: 0,
                            synchronised: false,
                        })
                })
                .collect();
            let same = mirrors.len() == current.mirrors.len()
                && mirrors.iter().all(|m| current.mirrors.contains(m));
            if !same {
                out.push(set(mirrors));
            }
        }
    }
    // The GM groups of deleted queues, once nobody in them is alive.
    let kept: BTreeSet<String> = state
        .mirror_sets
        .iter()
        .map(|((v, q), set)| super::message::group_name(v, q, set.incarnation))
        .collect();
    for (name, record) in &state.gm_groups {
        if name.starts_with(super::message::GROUP_PREFIX)
            && !kept.contains(name)
            && record
                .members
                .iter()
                .all(|s| matches!(s, crate::gm::Slot::Dead(_)))
        {
            out.push(Command::GmForget { name: name.clone() });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::policy::{ApplyTo, Policy, PolicyValue};
    use crate::meta::state::{NodeRecord, QueueDef};
    use amq_protocol::types::FieldTable;

    fn state() -> MetaState {
        let mut s = MetaState::default();
        s.apply(&Command::AddVhost { name: "/".into() }).unwrap();
        for id in 1..=3 {
            s.apply(&Command::RegisterNode(NodeRecord {
                id,
                name: format!("n{id}"),
                amqp: String::new(),
                admin: String::new(),
                link: String::new(),
                incarnation: 0,
            }))
            .unwrap();
        }
        for (name, exclusive, durable) in [
            ("ha.q", false, true),
            ("ha.x", true, false),
            ("ha.t", false, false),
            ("plain", false, true),
        ] {
            s.apply(&Command::DeclareQueue(QueueDef {
                vhost: "/".into(),
                name: name.into(),
                durable,
                exclusive_owner: exclusive.then_some((1u64 << 40) | 1),
                auto_delete: false,
                arguments: FieldTable::default(),
                home: 1,
            }))
            .unwrap();
        }
        s
    }

    fn policy(defs: &[(&str, PolicyValue)]) -> Command {
        Command::SetPolicy {
            policy: Policy {
                vhost: "/".into(),
                name: "ha".into(),
                pattern: "^ha\\.".into(),
                compiled: Default::default(),
                apply_to: ApplyTo::Queues,
                priority: 0,
                definition: defs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.clone()))
                    .collect(),
            },
            operator: false,
        }
    }

    fn s(v: &str) -> PolicyValue {
        PolicyValue::Str(v.into())
    }

    fn up(ids: &[NodeId]) -> BTreeSet<NodeId> {
        ids.iter().copied().collect()
    }

    /// Applies the plan until it is empty (every command must apply); returns the rounds.
    fn settle(st: &mut MetaState, running: &BTreeSet<NodeId>) -> usize {
        for round in 0..5 {
            let cmds = plan(st, running);
            if cmds.is_empty() {
                return round;
            }
            for c in cmds {
                st.apply(&c).unwrap_or_else(|e| panic!("{c:?}: {e}"));
            }
        }
        panic!("the plan does not settle");
    }

    fn mirrors(st: &MetaState) -> Vec<(NodeId, bool)> {
        st.mirror_sets
            .get(&("/".to_string(), "ha.q".to_string()))
            .map(|m| m.mirrors.iter().map(|r| (r.node, r.synchronised)).collect())
            .unwrap_or_default()
    }

    fn home(st: &MetaState) -> NodeId {
        st.vhost("/").unwrap().queues["ha.q"].home
    }

    fn mark_synchronised(st: &mut MetaState, node: NodeId) {
        let key = ("/".to_string(), "ha.q".to_string());
        let set = st.mirror_sets[&key].clone();
        let mirrors = set
            .mirrors
            .iter()
            .map(|m| MirrorRecord {
                synchronised: m.synchronised || m.node == node,
                ..*m
            })
            .collect();
        st.apply(&Command::SetMirrors {
            vhost: "/".into(),
            queue: "ha.q".into(),
            expected_version: set.version,
            mirrors,
        })
        .unwrap();
    }

    #[test]
    fn a_non_durable_mirrored_queue_moves_with_its_masters_node_down_or_goes() {
        let mut st = state();
        st.apply(&Command::DeclareQueue(QueueDef {
            vhost: "/".into(),
            name: "ha.t2".into(),
            durable: false,
            exclusive_owner: None,
            auto_delete: false,
            arguments: FieldTable::default(),
            home: 1,
        }))
        .unwrap();
        let all = up(&[1, 2, 3]);
        st.apply(&policy(&[("ha-mode", s("all"))])).unwrap();
        settle(&mut st, &all);
        // ha.t's mirror on node 3 is synchronised; ha.t2 has none synchronised.
        let key = ("/".to_string(), "ha.t".to_string());
        let set = st.mirror_sets[&key].clone();
        st.apply(&Command::SetMirrors {
            vhost: "/".into(),
            queue: "ha.t".into(),
            expected_version: set.version,
            mirrors: set
                .mirrors
                .iter()
                .map(|m| MirrorRecord {
                    synchronised: m.node == 3,
                    ..*m
                })
                .collect(),
        })
        .unwrap();
        mark_synchronised(&mut st, 2);
        st.apply(&Command::NodeDown { id: 1 }).unwrap();
        let queues = &st.vhost("/").unwrap().queues;
        assert_eq!(queues["ha.t"].home, 3, "promoted by the NodeDown itself");
        assert_eq!(st.mirror_sets[&key].epoch, 1);
        assert!(
            !queues.contains_key("ha.t2"),
            "no mirror to promote: deleted, as an unmirrored one"
        );
        assert_eq!(
            home(&st),
            1,
            "a durable queue waits for the reconciler (or its node)"
        );
        settle(&mut st, &up(&[2, 3]));
        assert_eq!(home(&st), 2);
        // With `ha-promote-on-failure: always`, an unsynchronised mirror is taken.
        st.apply(&policy(&[
            ("ha-mode", s("all")),
            ("ha-promote-on-failure", s("always")),
        ]))
        .unwrap();
        settle(&mut st, &up(&[2, 3]));
        let set = &st.mirror_sets[&key];
        assert!(set.mirrors.iter().all(|m| !m.synchronised && m.node == 2));
        st.apply(&Command::NodeDown { id: 3 }).unwrap();
        assert_eq!(st.vhost("/").unwrap().queues["ha.t"].home, 2);
    }

    #[test]
    fn a_policy_adds_mirrors_a_down_node_loses_its_own_and_clearing_removes_them() {
        let mut st = state();
        let all = up(&[1, 2, 3]);
        assert!(plan(&st, &all).is_empty(), "no policy, nothing to do");
        st.apply(&policy(&[("ha-mode", s("all"))])).unwrap();
        assert_eq!(settle(&mut st, &all), 1);
        assert_eq!(mirrors(&st), [(2, false), (3, false)]);
        assert!(
            !st.mirror_sets
                .contains_key(&("/".to_string(), "ha.x".to_string())),
            "exclusive queues are never mirrored"
        );
        assert_eq!(
            st.mirror_sets[&("/".to_string(), "ha.t".to_string())]
                .mirrors
                .len(),
            2,
            "non-durable queues are mirrored too"
        );
        assert!(
            !st.mirror_sets
                .contains_key(&("/".to_string(), "plain".to_string())),
            "queues the policy does not match are not"
        );
        mark_synchronised(&mut st, 2);
        settle(&mut st, &up(&[1, 2]));
        assert_eq!(mirrors(&st), [(2, true)], "3 is down: its mirror is gone");
        settle(&mut st, &all);
        assert_eq!(
            mirrors(&st),
            [(2, true), (3, false)],
            "3 is back: a new, unsynchronised mirror"
        );
        st.apply(&Command::ClearPolicy {
            vhost: "/".into(),
            name: "ha".into(),
            operator: false,
        })
        .unwrap();
        settle(&mut st, &all);
        assert_eq!(mirrors(&st), []);
    }

    #[test]
    fn a_failed_master_hands_over_to_a_synchronised_mirror_only_unless_always() {
        let mut st = state();
        st.apply(&policy(&[("ha-mode", s("all"))])).unwrap();
        settle(&mut st, &up(&[1, 2, 3]));
        // Node 1 (the master) fails; no mirror is synchronised: when-synced waits.
        assert!(plan(&st, &up(&[2, 3])).is_empty());
        assert_eq!(home(&st), 1);
        mark_synchronised(&mut st, 3);
        settle(&mut st, &up(&[2, 3]));
        assert_eq!(home(&st), 3, "the synchronised mirror took over");
        assert_eq!(mirrors(&st), [(2, false)]);
        let epoch = st.mirror_sets[&("/".to_string(), "ha.q".to_string())].epoch;
        assert_eq!(epoch, 1);
        // With `always`, an unsynchronised mirror may take over when the master fails.
        st.apply(&policy(&[
            ("ha-mode", s("all")),
            ("ha-promote-on-failure", s("always")),
        ]))
        .unwrap();
        settle(&mut st, &up(&[1, 2]));
        assert_eq!(home(&st), 2);
    }

    #[test]
    fn a_nodes_policy_moves_the_master_once_a_listed_mirror_is_synchronised() {
        let mut st = state();
        st.apply(&policy(&[
            ("ha-mode", s("nodes")),
            ("ha-params", PolicyValue::List(vec![s("n2"), s("n3")])),
        ]))
        .unwrap();
        let all = up(&[1, 2, 3]);
        settle(&mut st, &all);
        assert_eq!(home(&st), 1, "not before a listed mirror is synchronised");
        assert_eq!(mirrors(&st), [(2, false), (3, false)]);
        mark_synchronised(&mut st, 3);
        settle(&mut st, &all);
        assert_eq!(home(&st), 3);
        assert_eq!(mirrors(&st), [(2, false)]);
    }

    #[test]
    fn a_deleted_queues_group_is_forgotten_once_nobody_in_it_is_alive() {
        use crate::gm::{MemberId, Slot};
        use crate::mirror::message::group_name;
        let mut st = state();
        let all = up(&[1, 2, 3]);
        st.apply(&policy(&[("ha-mode", s("all"))])).unwrap();
        settle(&mut st, &all);
        let group = |name: &str, members: Vec<Slot>| Command::GmGroup {
            name: name.into(),
            expected_version: 0,
            members,
        };
        let m = |node| MemberId { node, since: 1 };
        let incarnation = st.mirror_sets[&("/".to_string(), "ha.q".to_string())].incarnation;
        let name = group_name("/", "ha.q", incarnation);
        st.apply(&group(&name, vec![Slot::Dead(m(1))])).unwrap();
        st.apply(&group("another-use", vec![])).unwrap();
        assert!(plan(&st, &all).is_empty(), "its queue still exists");
        st.apply(&Command::DeleteQueue {
            vhost: "/".into(),
            name: "ha.q".into(),
        })
        .unwrap();
        assert_eq!(
            plan(&st, &all),
            [Command::GmForget { name: name.clone() }],
            "gone, and nobody alive in it; a group that is not a queue's is left alone"
        );
        st.apply(&Command::GmGroup {
            name,
            expected_version: 1,
            members: vec![Slot::Dead(m(1)), Slot::Alive(m(2))],
        })
        .unwrap();
        assert!(plan(&st, &all).is_empty(), "a member still alive (leaving)");
    }
}
