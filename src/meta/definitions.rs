//! Durable definitions: the part of the metadata that survives a restart.
//!
//! Vhosts (with their descriptions and tags), users, permissions, vhost and user limits,
//! policies, durable exchanges, durable
//! non-exclusive queues, and bindings between durable ends, as RabbitMQ keeps them. Encoded with bincode inside a
//! checksummed record, so a torn write is detected instead of half-applied. A single node
//! applies its config file's vhosts, users and permissions at every start, then these: a
//! change made at run time (through AMQP, the management API or `warrenctl`) wins.

use serde::{Deserialize, Serialize};

use super::command::Command;
use super::limits::{LimitScope, Limits};
use super::policy::Policy;
use super::state::{
    Binding, Destination, ExchangeDef, MetaState, Permission, QueueDef, User, VhostMetadata,
};
use crate::store::record;

/// Format version written in front of the payload (6 added vhost metadata, 5 limits, 4
/// vhosts, users and permissions, 3 the queue's home node, 2 policies; 1 to 5 are still
/// read).
const VERSION: u32 = 6;

/// Why a definitions file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DefinitionsError {
    /// The file is empty, torn or fails its checksum.
    #[error("definitions record is damaged (no valid record found)")]
    Damaged,
    /// The payload does not decode.
    #[error("definitions do not decode: {0}")]
    Decode(String),
    /// Written by a newer format.
    #[error("definitions format version {0} is not supported")]
    Version(u32),
}

/// The durable part of the metadata.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Definitions {
    /// Durable exchanges (not the built-in ones).
    pub exchanges: Vec<ExchangeDef>,
    /// Durable, non-exclusive queues.
    pub queues: Vec<QueueDef>,
    /// Bindings whose source and destination are both durable.
    pub bindings: Vec<Binding>,
    /// Policies and operator policies (`true`), always durable.
    pub policies: Vec<(Policy, bool)>,
    /// Every vhost.
    pub vhosts: Vec<String>,
    /// Every user (passwords as stored).
    pub users: Vec<User>,
    /// Every permission.
    pub permissions: Vec<Permission>,
    /// Vhost limits by vhost (version 5 on).
    pub vhost_limits: Vec<(String, Limits)>,
    /// User limits by user (version 5 on).
    pub user_limits: Vec<(String, Limits)>,
    /// Vhost descriptions and tags by vhost (version 6 on).
    pub vhost_metadata: Vec<(String, VhostMetadata)>,
}

/// Version 5: before vhost metadata.
#[derive(Deserialize)]
struct DefinitionsV5 {
    exchanges: Vec<ExchangeDef>,
    queues: Vec<QueueDef>,
    bindings: Vec<Binding>,
    policies: Vec<(Policy, bool)>,
    vhosts: Vec<String>,
    users: Vec<User>,
    permissions: Vec<Permission>,
    vhost_limits: Vec<(String, Limits)>,
    user_limits: Vec<(String, Limits)>,
}

/// Version 4: before limits.
#[derive(Deserialize)]
struct DefinitionsV4 {
    exchanges: Vec<ExchangeDef>,
    queues: Vec<QueueDef>,
    bindings: Vec<Binding>,
    policies: Vec<(Policy, bool)>,
    vhosts: Vec<String>,
    users: Vec<User>,
    permissions: Vec<Permission>,
}

/// Version 3: before vhosts, users and permissions.
#[derive(Deserialize)]
struct DefinitionsV3 {
    exchanges: Vec<ExchangeDef>,
    queues: Vec<QueueDef>,
    bindings: Vec<Binding>,
    policies: Vec<(Policy, bool)>,
}

/// Version 1: before policies.
#[derive(Deserialize)]
struct DefinitionsV1 {
    exchanges: Vec<ExchangeDef>,
    queues: Vec<QueueDefV2>,
    bindings: Vec<Binding>,
}

/// Version 2: before queues had a home node.
#[derive(Deserialize)]
struct DefinitionsV2 {
    exchanges: Vec<ExchangeDef>,
    queues: Vec<QueueDefV2>,
    bindings: Vec<Binding>,
    policies: Vec<(Policy, bool)>,
}

/// A queue as versions 1 and 2 wrote it.
#[derive(Deserialize)]
struct QueueDefV2 {
    vhost: String,
    name: String,
    durable: bool,
    exclusive_owner: Option<u64>,
    auto_delete: bool,
    arguments: amq_protocol::types::FieldTable,
}

impl From<QueueDefV2> for QueueDef {
    fn from(q: QueueDefV2) -> QueueDef {
        QueueDef {
            vhost: q.vhost,
            name: q.name,
            durable: q.durable,
            exclusive_owner: q.exclusive_owner,
            auto_delete: q.auto_delete,
            arguments: q.arguments,
            home: 0,
        }
    }
}

fn builtin(name: &str) -> bool {
    name.is_empty() || name.starts_with("amq.")
}

impl Definitions {
    /// Extracts the durable definitions, in a fixed order.
    pub fn from_state(state: &MetaState) -> Definitions {
        let mut d = Definitions {
            vhosts: state.vhosts.keys().cloned().collect(),
            users: state.users.values().cloned().collect(),
            permissions: state.permissions.values().cloned().collect(),
            vhost_limits: state.vhost_limits.clone().into_iter().collect(),
            user_limits: state.user_limits.clone().into_iter().collect(),
            vhost_metadata: state.vhost_metadata.clone().into_iter().collect(),
            ..Definitions::default()
        };
        for v in state.vhosts.values() {
            for e in v.exchanges.values() {
                if e.durable && !builtin(&e.name) {
                    d.exchanges.push(e.clone());
                }
            }
            for q in v.queues.values() {
                if q.durable && q.exclusive_owner.is_none() {
                    d.queues.push(q.clone());
                }
            }
            d.policies
                .extend(v.policies.values().map(|p| (p.clone(), false)));
            d.policies
                .extend(v.operator_policies.values().map(|p| (p.clone(), true)));
            for b in v.bindings.values().flatten() {
                let source_durable = v.exchanges.get(&b.source).is_some_and(|e| e.durable);
                let dest_durable = match &b.destination {
                    Destination::Queue(q) => v
                        .queues
                        .get(q)
                        .is_some_and(|q| q.durable && q.exclusive_owner.is_none()),
                    Destination::Exchange(e) => v.exchanges.get(e).is_some_and(|e| e.durable),
                };
                if source_durable && dest_durable {
                    d.bindings.push(b.clone());
                }
            }
        }
        d
    }

    /// The commands that recreate these definitions.
    pub fn commands(&self) -> Vec<Command> {
        let mut c: Vec<Command> = self
            .vhosts
            .iter()
            .map(|name| Command::AddVhost { name: name.clone() })
            .collect();
        c.extend(
            self.vhost_metadata
                .iter()
                .map(|(name, metadata)| Command::SetVhostMetadata {
                    name: name.clone(),
                    metadata: metadata.clone(),
                }),
        );
        c.extend(self.users.iter().cloned().map(Command::PutUser));
        c.extend(
            self.permissions
                .iter()
                .cloned()
                .map(Command::SetPermissions),
        );
        // Policies before queues, so queues are created with their effective arguments.
        c.extend(
            self.policies
                .iter()
                .map(|(p, operator)| Command::SetPolicy {
                    policy: p.clone(),
                    operator: *operator,
                }),
        );
        c.extend(self.exchanges.iter().cloned().map(Command::DeclareExchange));
        c.extend(self.queues.iter().cloned().map(Command::DeclareQueue));
        c.extend(self.bindings.iter().cloned().map(Command::Bind));
        // Limits last: a vhost may hold more queues than a max-queues set later allows, and
        // its queues must still come back.
        let limits = |scope: fn(String) -> LimitScope, list: &[(String, Limits)]| {
            list.iter()
                .map(move |(name, limits)| Command::SetLimits {
                    scope: scope(name.clone()),
                    limits: limits.clone(),
                    replace: true,
                })
                .collect::<Vec<_>>()
        };
        c.extend(limits(LimitScope::Vhost, &self.vhost_limits));
        c.extend(limits(LimitScope::User, &self.user_limits));
        c
    }

    /// Serialises into one checksummed record.
    pub fn encode(&self) -> Vec<u8> {
        let mut payload = VERSION.to_le_bytes().to_vec();
        // Serialising plain owned data into a Vec cannot fail.
        payload.extend(bincode::serialize(self).unwrap_or_default());
        let mut out = Vec::with_capacity(payload.len() + record::RECORD_OVERHEAD);
        record::encode(&mut out, &payload);
        out
    }

    /// Reads what [`Definitions::encode`] wrote.
    pub fn decode(bytes: &[u8]) -> Result<Definitions, DefinitionsError> {
        let (found, _) = record::scan(bytes);
        let payload = found.first().ok_or(DefinitionsError::Damaged)?.payload;
        if payload.len() < 4 {
            return Err(DefinitionsError::Damaged);
        }
        let version = u32::from_le_bytes(payload[..4].try_into().expect("4 bytes"));
        let decode_err = |e: bincode::Error| DefinitionsError::Decode(e.to_string());
        match version {
            1 => {
                let v1: DefinitionsV1 = bincode::deserialize(&payload[4..]).map_err(decode_err)?;
                Ok(Definitions {
                    exchanges: v1.exchanges,
                    queues: v1.queues.into_iter().map(QueueDef::from).collect(),
                    bindings: v1.bindings,
                    ..Definitions::default()
                })
            }
            2 => {
                let v2: DefinitionsV2 = bincode::deserialize(&payload[4..]).map_err(decode_err)?;
                Ok(Definitions {
                    exchanges: v2.exchanges,
                    queues: v2.queues.into_iter().map(QueueDef::from).collect(),
                    bindings: v2.bindings,
                    policies: v2.policies,
                    ..Definitions::default()
                })
            }
            3 => {
                let v3: DefinitionsV3 = bincode::deserialize(&payload[4..]).map_err(decode_err)?;
                Ok(Definitions {
                    exchanges: v3.exchanges,
                    queues: v3.queues,
                    bindings: v3.bindings,
                    policies: v3.policies,
                    ..Definitions::default()
                })
            }
            4 => {
                let v4: DefinitionsV4 = bincode::deserialize(&payload[4..]).map_err(decode_err)?;
                Ok(Definitions {
                    exchanges: v4.exchanges,
                    queues: v4.queues,
                    bindings: v4.bindings,
                    policies: v4.policies,
                    vhosts: v4.vhosts,
                    users: v4.users,
                    permissions: v4.permissions,
                    ..Definitions::default()
                })
            }
            5 => {
                let v5: DefinitionsV5 = bincode::deserialize(&payload[4..]).map_err(decode_err)?;
                Ok(Definitions {
                    exchanges: v5.exchanges,
                    queues: v5.queues,
                    bindings: v5.bindings,
                    policies: v5.policies,
                    vhosts: v5.vhosts,
                    users: v5.users,
                    permissions: v5.permissions,
                    vhost_limits: v5.vhost_limits,
                    user_limits: v5.user_limits,
                    ..Definitions::default()
                })
            }
            VERSION => bincode::deserialize(&payload[4..]).map_err(decode_err),
            other => Err(DefinitionsError::Version(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::ExchangeKind;
    use amq_protocol::types::{AMQPValue, FieldTable};

    /// A definitions record as format `version` wrote it: `fields` in its layout's order
    /// (bincode writes a struct as its fields in order, as it writes a tuple).
    fn old_file(version: u32, fields: impl Serialize) -> Vec<u8> {
        let mut payload = version.to_le_bytes().to_vec();
        payload.extend(bincode::serialize(&fields).unwrap());
        let mut file = Vec::new();
        record::encode(&mut file, &payload);
        file
    }

    fn state() -> MetaState {
        let mut s = MetaState::default();
        s.apply(&Command::AddVhost { name: "/".into() }).unwrap();
        let mut args = FieldTable::default();
        args.insert("x-max-length".into(), AMQPValue::LongInt(5));
        for (name, durable, owner) in [
            ("dq", true, None),
            ("tq", false, None),
            ("xq", true, Some(7)),
        ] {
            s.apply(&Command::DeclareQueue(QueueDef {
                vhost: "/".into(),
                name: name.into(),
                durable,
                exclusive_owner: owner,
                auto_delete: false,
                arguments: args.clone(),
                home: 0,
            }))
            .unwrap();
        }
        s.apply(&Command::DeclareExchange(ExchangeDef {
            vhost: "/".into(),
            name: "dx".into(),
            kind: ExchangeKind::Topic,
            durable: true,
            auto_delete: false,
            internal: false,
            arguments: FieldTable::default(),
        }))
        .unwrap();
        for q in ["dq", "tq"] {
            s.apply(&Command::Bind(Binding {
                vhost: "/".into(),
                source: "dx".into(),
                destination: Destination::Queue(q.into()),
                routing_key: "a.#".into(),
                arguments: FieldTable::default(),
            }))
            .unwrap();
        }
        s
    }

    #[test]
    fn a_version_2_file_is_still_read() {
        // Version 2 as it was written: queues without a home node.
        type QueueV2 = (String, String, bool, Option<u64>, bool, FieldTable);
        let d = Definitions::from_state(&state());
        let queues: Vec<QueueV2> = d
            .queues
            .iter()
            .map(|q| {
                let q = q.clone();
                (
                    q.vhost,
                    q.name,
                    q.durable,
                    q.exclusive_owner,
                    q.auto_delete,
                    q.arguments,
                )
            })
            .collect();
        let file = old_file(2, (&d.exchanges, &queues, &d.bindings, &d.policies));
        assert_eq!(Definitions::decode(&file).unwrap(), durable_only(d));
    }

    /// What versions 1 to 3 held: no vhosts, users or permissions.
    fn durable_only(d: Definitions) -> Definitions {
        Definitions {
            vhosts: Vec::new(),
            users: Vec::new(),
            permissions: Vec::new(),
            ..d
        }
    }

    #[test]
    fn a_version_3_file_is_still_read() {
        let d = Definitions::from_state(&state());
        let file = old_file(3, (&d.exchanges, &d.queues, &d.bindings, &d.policies));
        assert_eq!(Definitions::decode(&file).unwrap(), durable_only(d));
    }

    #[test]
    fn vhosts_users_and_permissions_are_kept_and_replayed() {
        let mut s = state();
        for c in [
            Command::AddVhost { name: "v2".into() },
            Command::PutUser(User {
                name: "alice".into(),
                password: "pw".into(),
                tags: vec!["administrator".into()],
            }),
            Command::SetPermissions(Permission {
                user: "alice".into(),
                vhost: "v2".into(),
                configure: ".*".into(),
                write: "^w".into(),
                read: "".into(),
            }),
        ] {
            s.apply(&c).unwrap();
        }
        let d = Definitions::from_state(&s);
        assert_eq!(d.vhosts, ["/", "v2"]);
        let mut fresh = MetaState::default();
        for c in Definitions::decode(&d.encode()).unwrap().commands() {
            fresh.apply(&c).unwrap();
        }
        assert_eq!(fresh.users, s.users);
        assert_eq!(fresh.permissions, s.permissions);
        assert!(fresh.vhosts.contains_key("v2"));
        assert_eq!(Definitions::from_state(&fresh), d);
    }

    #[test]
    fn a_version_4_file_is_still_read() {
        let d = Definitions::from_state(&state());
        let file = old_file(
            4,
            (
                &d.exchanges,
                &d.queues,
                &d.bindings,
                &d.policies,
                &d.vhosts,
                &d.users,
                &d.permissions,
            ),
        );
        assert_eq!(Definitions::decode(&file).unwrap(), d);
    }

    #[test]
    fn a_version_5_file_is_still_read() {
        let mut s = state();
        s.apply(&Command::SetLimits {
            scope: LimitScope::Vhost("/".into()),
            limits: [("max-queues".to_string(), 9)].into(),
            replace: true,
        })
        .unwrap();
        let d = Definitions::from_state(&s);
        let file = old_file(
            5,
            (
                &d.exchanges,
                &d.queues,
                &d.bindings,
                &d.policies,
                &d.vhosts,
                &d.users,
                &d.permissions,
                &d.vhost_limits,
                &d.user_limits,
            ),
        );
        let back = Definitions::decode(&file).unwrap();
        assert!(back.vhost_metadata.is_empty());
        assert_eq!(back.vhost_limits, d.vhost_limits);
        assert_eq!(back, d);
    }

    #[test]
    fn vhost_metadata_is_kept_and_replayed_and_goes_with_its_vhost() {
        let mut s = state();
        let metadata = VhostMetadata {
            description: "the default".into(),
            tags: vec!["prod".into(), "eu".into()],
        };
        s.apply(&Command::SetVhostMetadata {
            name: "/".into(),
            metadata: metadata.clone(),
        })
        .unwrap();
        assert!(matches!(
            s.apply(&Command::SetVhostMetadata {
                name: "nope".into(),
                metadata: metadata.clone(),
            }),
            Err(crate::meta::MetaError::NoVhost(_))
        ));
        let d = Definitions::decode(&Definitions::from_state(&s).encode()).unwrap();
        let mut fresh = MetaState::default();
        for c in d.commands() {
            fresh.apply(&c).unwrap();
        }
        assert_eq!(fresh.vhost_metadata.get("/"), Some(&metadata));
        // Cleared by an empty one; gone with the vhost.
        s.apply(&Command::SetVhostMetadata {
            name: "/".into(),
            metadata: VhostMetadata::default(),
        })
        .unwrap();
        assert!(s.vhost_metadata.is_empty());
        fresh
            .apply(&Command::DeleteVhost { name: "/".into() })
            .unwrap();
        assert!(fresh.vhost_metadata.is_empty());
    }

    #[test]
    fn limits_are_kept_and_replayed_after_the_queues_they_would_refuse() {
        let mut s = state();
        s.apply(&Command::PutUser(User {
            name: "alice".into(),
            password: "pw".into(),
            tags: vec![],
        }))
        .unwrap();
        for scope in [
            LimitScope::Vhost("/".into()),
            LimitScope::User("alice".into()),
        ] {
            let name = if matches!(scope, LimitScope::Vhost(_)) {
                "max-queues"
            } else {
                "max-channels"
            };
            s.apply(&Command::SetLimits {
                scope,
                limits: [(name.to_string(), 0)].into(),
                replace: true,
            })
            .unwrap();
        }
        let d = Definitions::decode(&Definitions::from_state(&s).encode()).unwrap();
        let mut fresh = MetaState::default();
        for c in d.commands() {
            fresh.apply(&c).unwrap();
        }
        assert_eq!(fresh.vhost_limits, s.vhost_limits);
        assert_eq!(fresh.user_limits, s.user_limits);
        assert!(fresh.vhost("/").unwrap().queues.contains_key("dq"));
    }

    #[test]
    fn only_durable_definitions_are_kept() {
        let d = Definitions::from_state(&state());
        let names: Vec<&str> = d.queues.iter().map(|q| q.name.as_str()).collect();
        assert_eq!(names, ["dq"]);
        assert_eq!(d.exchanges.len(), 1);
        assert_eq!(
            d.bindings.len(),
            1,
            "the binding to the transient queue is not durable"
        );
    }

    #[test]
    fn round_trip_and_replay_rebuild_the_durable_state() {
        let d = Definitions::from_state(&state());
        let back = Definitions::decode(&d.encode()).unwrap();
        assert_eq!(back, d);
        let mut fresh = MetaState::default();
        fresh
            .apply(&Command::AddVhost { name: "/".into() })
            .unwrap();
        for c in back.commands() {
            fresh.apply(&c).unwrap();
        }
        assert_eq!(Definitions::from_state(&fresh), d);
    }

    #[test]
    fn version_1_files_are_still_read() {
        let d = Definitions::from_state(&state());
        let bytes = old_file(1, (&d.exchanges, &d.queues, &d.bindings));
        let back = Definitions::decode(&bytes).unwrap();
        assert_eq!((back.queues, back.policies.len()), (d.queues, 0));
    }

    #[test]
    fn damage_is_detected() {
        let mut bytes = Definitions::from_state(&state()).encode();
        let n = bytes.len();
        bytes[n - 2] ^= 0x40;
        assert!(matches!(
            Definitions::decode(&bytes),
            Err(DefinitionsError::Damaged)
        ));
        assert!(Definitions::decode(&[]).is_err());
    }
}
