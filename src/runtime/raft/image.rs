//! The snapshot format: a serialisable mirror of [`MetaState`].
//!
//! `MetaState` and `Vhost` carry no serde derives (the broker shares vhosts through `Arc`), so
//! the snapshot copies them into plain structs. `into_state` builds `MetaState` and `Vhost`
//! with struct literals, so a field added to either stops this file compiling until the
//! mirror learns it.
//!
//! bincode is not self-describing: a field added to [`StateImage`] would make every stored
//! snapshot unreadable. So a layout change gets a new format byte in front of the payload
//! ([`persist::encode_as`]) and the old layout stays readable: format 1 is the image without
//! limits ([`ImageV1`]), format 2 adds them ([`LimitsImage`] after the state, [`ImageV2`]),
//! format 3 adds the vhosts' descriptions and tags after those. A snapshot from before
//! limits or metadata existed therefore loads without them (see the fixture tests).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::persist::{self, PersistError};
use crate::meta::limits::Limits;
use crate::meta::policy::Policy;
use crate::meta::state::{
    Binding, ExchangeDef, NodeRecord, Permission, QueueDef, User, Vhost, VhostMetadata,
};
use crate::meta::MetaState;

/// The format byte of images with limits (format 1, [`persist::FORMAT`], had none).
const FORMAT_LIMITS: u8 = 2;
/// The format byte of images with vhost metadata too.
const FORMAT_VHOST_METADATA: u8 = 3;

/// The state machine's data in a snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Image {
    /// Chained checksum of every entry applied up to the snapshot (see the state machine).
    pub digest: u32,
    /// The metadata.
    pub state: StateImage,
    /// Vhost and user limits (format 2 on).
    pub limits: LimitsImage,
    /// Vhost descriptions and tags (format 3 on).
    pub vhost_metadata: Vec<(String, VhostMetadata)>,
}

/// An image as format 2 wrote it, before vhost metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageV2 {
    /// As [`Image::digest`].
    pub digest: u32,
    /// As [`Image::state`].
    pub state: StateImage,
    /// As [`Image::limits`].
    pub limits: LimitsImage,
}

/// An image as format 1 wrote it, before limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageV1 {
    /// As [`Image::digest`].
    pub digest: u32,
    /// As [`Image::state`].
    pub state: StateImage,
}

/// The limits of [`MetaState`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LimitsImage {
    vhosts: Vec<(String, Limits)>,
    users: Vec<(String, Limits)>,
}

impl Image {
    /// The image of `state` with `digest`.
    pub fn of(state: &MetaState, digest: u32) -> Image {
        Image {
            digest,
            state: StateImage::of(state),
            limits: LimitsImage {
                vhosts: state.vhost_limits.clone().into_iter().collect(),
                users: state.user_limits.clone().into_iter().collect(),
            },
            vhost_metadata: state.vhost_metadata.clone().into_iter().collect(),
        }
    }

    /// Rebuilds the state.
    pub fn into_state(self) -> MetaState {
        let mut state = self.state.into_state();
        state.vhost_limits = self.limits.vhosts.into_iter().collect();
        state.user_limits = self.limits.users.into_iter().collect();
        state.vhost_metadata = self.vhost_metadata.into_iter().collect();
        state
    }

    /// The snapshot payload (format 3).
    pub fn encode(&self) -> Result<Vec<u8>, PersistError> {
        persist::encode_as(FORMAT_VHOST_METADATA, "snapshot image", self)
    }

    /// Reads a snapshot payload of any format; `path` only names the source in errors.
    pub fn decode(payload: &[u8], path: &Path) -> Result<Image, PersistError> {
        if payload.first() == Some(&persist::FORMAT) {
            let v1: ImageV1 = persist::decode("snapshot image", path, payload)?;
            return Ok(Image {
                digest: v1.digest,
                state: v1.state,
                limits: LimitsImage::default(),
                vhost_metadata: Vec::new(),
            });
        }
        if payload.first() == Some(&FORMAT_LIMITS) {
            let v2: ImageV2 = persist::decode_as(FORMAT_LIMITS, "snapshot image", path, payload)?;
            return Ok(Image {
                digest: v2.digest,
                state: v2.state,
                limits: v2.limits,
                vhost_metadata: Vec::new(),
            });
        }
        persist::decode_as(FORMAT_VHOST_METADATA, "snapshot image", path, payload)
    }
}

/// Mirror of [`MetaState`] (without the limits, which format 1 did not have).
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

    /// Rebuilds the state (without limits). Keys come from the values themselves, as the
    /// state builds them.
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
            vhost_limits: BTreeMap::new(),
            user_limits: BTreeMap::new(),
            vhost_metadata: BTreeMap::new(),
            version: self.version,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::state::{Destination, ExchangeKind};
    use crate::meta::Command;
    use crate::runtime::raft::persist;
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
        let mut state = rich_state();
        for c in limit_commands() {
            state.apply(&c).expect("valid command");
        }
        state
            .apply(&Command::SetVhostMetadata {
                name: "v2".into(),
                metadata: VhostMetadata {
                    description: "the second".into(),
                    tags: vec!["b".into(), "a".into()],
                },
            })
            .expect("valid command");
        let image = Image::of(&state, 42);
        let bytes = image.encode().expect("encodes");
        let back = Image::decode(&bytes, Path::new("mem")).expect("decodes");
        assert_eq!(back.digest, 42);
        let back = back.into_state();
        assert_eq!(back.vhost_metadata["v2"].tags, ["b", "a"]);
        assert_eq!(back.vhost_limit("v2", "max-queues"), Some(3));
        assert_eq!(back.user_limit("guest", "max-channels"), Some(0));
        assert_eq!(back, state);
    }

    fn limit_commands() -> Vec<Command> {
        use crate::meta::limits::LimitScope;
        vec![
            Command::SetLimits {
                scope: LimitScope::Vhost("v2".into()),
                limits: [("max-queues".to_string(), 3)].into(),
                replace: true,
            },
            Command::SetLimits {
                scope: LimitScope::User("guest".into()),
                limits: [("max-channels".to_string(), 0)].into(),
                replace: false,
            },
        ]
    }

    /// The payload of `rich_state()`'s image (digest 42) as the code before limits wrote it,
    /// committed: a node upgraded with a snapshot on disk must still load it.
    const IMAGE_V1: &[u8] = include_bytes!("testdata/snapshot-image-v1.bin");

    /// `Command::ClearPermissions { user: "guest", vhost: "/" }` as a log entry's command was
    /// encoded before limits: the new variants come last, so old log entries still decode.
    const COMMAND_V1: &[u8] = include_bytes!("testdata/command-clear-permissions-v1.bin");

    #[test]
    fn a_snapshot_written_before_limits_still_loads() {
        let image = Image::decode(IMAGE_V1, Path::new("fixture")).expect("format 1 decodes");
        assert_eq!(image.digest, 42);
        let state = image.into_state();
        assert!(state.vhost_limits.is_empty() && state.user_limits.is_empty());
        assert_eq!(state, rich_state());
        // And what is written now is format 3, which the format 1 reader refuses rather
        // than misreads.
        let now = Image::of(&state, 42).encode().expect("encodes");
        assert_eq!(now[0], FORMAT_VHOST_METADATA);
        assert!(persist::decode::<ImageV1>("image", Path::new("mem"), &now).is_err());
    }

    /// The payload of `rich_state()` with a `max-queues` limit of 3 on `v2` (digest 42) as
    /// the code before vhost metadata wrote it (format 2), committed.
    const IMAGE_V2: &[u8] = include_bytes!("testdata/snapshot-image-v2.bin");

    #[test]
    fn a_snapshot_written_before_vhost_metadata_still_loads() {
        let image = Image::decode(IMAGE_V2, Path::new("fixture")).expect("format 2 decodes");
        assert_eq!(image.digest, 42);
        let state = image.into_state();
        assert!(state.vhost_metadata.is_empty());
        let mut expected = rich_state();
        expected.apply(&limit_commands()[0]).expect("valid command");
        assert_eq!(state, expected);
        let now = Image::of(&state, 42).encode().expect("encodes");
        assert!(
            persist::decode_as::<ImageV2>(FORMAT_LIMITS, "image", Path::new("mem"), &now).is_err()
        );
    }

    #[test]
    fn a_log_entry_written_before_limits_still_decodes() {
        let cmd: Command = persist::decode("command", Path::new("fixture"), COMMAND_V1)
            .expect("old command decodes");
        assert_eq!(
            cmd,
            Command::ClearPermissions {
                user: "guest".into(),
                vhost: "/".into()
            }
        );
    }
}
