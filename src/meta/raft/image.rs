//! The snapshot format: a serialisable mirror of [`MetaState`].
//!
//! `MetaState` and `Vhost` carry no serde derives (the broker shares vhosts through `Arc`), so
//! the snapshot copies them into plain structs. `into_state` builds `MetaState` and `Vhost`
//! with struct literals, so a field added to either stops this file compiling until the
//! mirror learns it.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::meta::policy::Policy;
use crate::meta::state::{Binding, ExchangeDef, NodeRecord, Permission, QueueDef, User, Vhost};
use crate::meta::MetaState;

/// The state machine's data in a snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Image {
    /// Chained checksum of every entry applied up to the snapshot (see the state machine).
    pub digest: u32,
    /// The metadata.
    pub state: StateImage,
}

/// Mirror of [`MetaState`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateImage {
    vhosts: Vec<VhostImage>,
    users: Vec<User>,
    permissions: Vec<Permission>,
    nodes: Vec<NodeRecord>,
    forgotten: Vec<u64>,
    gm_groups: Vec<(String, crate::gm::GroupRecord)>,
    mirror_sets: Vec<((String, String), crate::meta::state::MirrorSet)>,
    version: u64,
}

/// Mirror of [`Vhost`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct VhostImage {
    name: String,
    exchanges: Vec<ExchangeDef>,
    queues: Vec<QueueDef>,
    bindings: Vec<(String, Vec<Binding>)>,
    policies: Vec<Policy>,
    operator_policies: Vec<Policy>,
}

impl StateImage {
    /// Copies the state.
    pub fn of(state: &MetaState) -> StateImage {
        StateImage {
            vhosts: state
                .vhosts
                .values()
                .map(|v| VhostImage {
                    name: v.name.clone(),
                    exchanges: v.exchanges.values().cloned().collect(),
                    queues: v.queues.values().cloned().collect(),
                    bindings: v
                        .bindings
                        .iter()
                        .map(|(k, b)| (k.clone(), b.clone()))
                        .collect(),
                    policies: v.policies.values().cloned().collect(),
                    operator_policies: v.operator_policies.values().cloned().collect(),
                })
                .collect(),
            users: state.users.values().cloned().collect(),
            permissions: state.permissions.values().cloned().collect(),
            nodes: state.nodes.values().cloned().collect(),
            forgotten: state.forgotten.iter().copied().collect(),
            gm_groups: state
                .gm_groups
                .iter()
                .map(|(k, g)| (k.clone(), g.clone()))
                .collect(),
            mirror_sets: state
                .mirror_sets
                .iter()
                .map(|(k, m)| (k.clone(), m.clone()))
                .collect(),
            version: state.version,
        }
    }

    /// Rebuilds the state. Keys come from the values themselves, as the state builds them.
    pub fn into_state(self) -> MetaState {
        let vhosts = self
            .vhosts
            .into_iter()
            .map(|v| {
                let vhost = Vhost {
                    name: v.name.clone(),
                    exchanges: v
                        .exchanges
                        .into_iter()
                        .map(|e| (e.name.clone(), e))
                        .collect(),
                    queues: v.queues.into_iter().map(|q| (q.name.clone(), q)).collect(),
                    bindings: v.bindings.into_iter().collect(),
                    policies: v
                        .policies
                        .into_iter()
                        .map(|p| (p.name.clone(), p))
                        .collect(),
                    operator_policies: v
                        .operator_policies
                        .into_iter()
                        .map(|p| (p.name.clone(), p))
                        .collect(),
                };
                (v.name, Arc::new(vhost))
            })
            .collect();
        MetaState {
            vhosts,
            users: self
                .users
                .into_iter()
                .map(|u| (u.name.clone(), u))
                .collect(),
            permissions: self
                .permissions
                .into_iter()
                .map(|p| ((p.user.clone(), p.vhost.clone()), p))
                .collect::<BTreeMap<_, _>>(),
            nodes: self.nodes.into_iter().map(|n| (n.id, n)).collect(),
            forgotten: self.forgotten.into_iter().collect(),
            gm_groups: self.gm_groups.into_iter().collect(),
            mirror_sets: self.mirror_sets.into_iter().collect(),
            version: self.version,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::raft::persist;
    use crate::meta::state::{Destination, ExchangeKind};
    use crate::meta::Command;
    use amq_protocol::types::{AMQPValue, FieldTable};
    use std::path::Path;

    /// A state that uses every collection, with a non-empty field table.
    pub(crate) fn rich_state() -> MetaState {
        let mut s = MetaState::default();
        let mut args = FieldTable::default();
        args.insert("x-max-length".into(), AMQPValue::LongInt(10));
        let cmds = vec![
            Command::AddVhost { name: "/".into() },
            Command::AddVhost { name: "v2".into() },
            Command::RegisterNode(NodeRecord {
                id: 2,
                name: "n2".into(),
                amqp: "127.0.0.1:5673".into(),
                admin: "127.0.0.1:5680".into(),
                link: "127.0.0.1:25673".into(),
                incarnation: 0,
            }),
            Command::RegisterNode(NodeRecord {
                id: 3,
                name: "n3".into(),
                amqp: String::new(),
                admin: String::new(),
                link: String::new(),
                incarnation: 0,
            }),
            Command::ForgetNode { id: 3 },
            Command::GmGroup {
                name: "q".into(),
                expected_version: 0,
                members: vec![
                    crate::gm::Slot::Alive(crate::gm::MemberId { node: 2, since: 1 }),
                    crate::gm::Slot::Dead(crate::gm::MemberId { node: 1, since: 0 }),
                ],
            },
            Command::PutUser(User {
                name: "guest".into(),
                password: "guest".into(),
                tags: vec!["administrator".into()],
            }),
            Command::SetPermissions(Permission {
                user: "guest".into(),
                vhost: "/".into(),
                configure: ".*".into(),
                write: ".*".into(),
                read: ".*".into(),
            }),
            Command::DeclareExchange(ExchangeDef {
                vhost: "/".into(),
                name: "x".into(),
                kind: ExchangeKind::Topic,
                durable: true,
                auto_delete: false,
                internal: false,
                arguments: FieldTable::default(),
            }),
            Command::DeclareQueue(QueueDef {
                vhost: "/".into(),
                name: "q".into(),
                durable: true,
                exclusive_owner: Some(3),
                auto_delete: false,
                arguments: args.clone(),
                home: 0,
            }),
            Command::Bind(Binding {
                vhost: "/".into(),
                source: "x".into(),
                destination: Destination::Queue("q".into()),
                routing_key: "a.*".into(),
                arguments: args,
            }),
            Command::DeclareQueue(QueueDef {
                vhost: "/".into(),
                name: "m".into(),
                durable: true,
                exclusive_owner: None,
                auto_delete: false,
                arguments: FieldTable::default(),
                home: 0,
            }),
            Command::SetMirrors {
                vhost: "/".into(),
                queue: "m".into(),
                expected_version: 0,
                mirrors: vec![crate::meta::state::MirrorRecord {
                    node: 2,
                    since: 0,
                    synchronised: true,
                }],
            },
        ];
        for c in &cmds {
            s.apply(c).expect("valid command");
        }
        s
    }

    #[test]
    fn image_round_trips_through_bincode() {
        let state = rich_state();
        let image = Image {
            digest: 42,
            state: StateImage::of(&state),
        };
        let bytes = persist::encode("image", &image).expect("encodes");
        let back: Image = persist::decode("image", Path::new("mem"), &bytes).expect("decodes");
        assert_eq!(back.digest, 42);
        assert_eq!(back.state.into_state(), state);
    }
}
