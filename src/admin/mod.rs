//! The admin protocol behind `warrenctl`, sans-IO: frames, requests and their handling.
//!
//! The wire is TCP carrying length-prefixed frames (a big-endian `u32` length, then a
//! bincode-encoded body). The client's first frame is an [`Auth`]; only users tagged
//! `administrator` pass, anyone else gets a refusal and the connection is closed. Every
//! later frame is a [`Request`], answered by one [`Response`].
//!
//! This module turns a request into a response from a [`Broker`] and the current time; the
//! socket side lives in [`crate::runtime::admin`]. Command names, arguments and columns follow
//! `rabbitmqctl`. Definitions are read from the metadata snapshot; what is live (connections,
//! channels, consumers) from the registry the sessions publish to, [`Broker::sessions`], so
//! those listings show the node the endpoint belongs to.
//!
//! - [`json`]: the small JSON reader (policy definitions) and writer (`--formatter json`).
//! - [`cli`]: parses a `rabbitmqctl`-style argument list into a [`Request`].
//! - [`mirrors`]: the mirror columns of `list_queues` and the `force_promote_mirror` choice.

pub mod cli;
pub mod json;
pub mod mirrors;

use std::collections::BTreeMap;

use amq_protocol::types::{AMQPValue, FieldTable};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::broker::registry::{ChannelView, ConnectionView, ConsumerInfo};
use crate::broker::Broker;
use crate::meta::limits::{self, LimitScope};
use crate::meta::policy::{ApplyTo, Policy};
use crate::meta::state::{Permission, User};
use crate::meta::Command;
use crate::time::Instant;

/// The largest frame body either side accepts.
pub const MAX_FRAME: usize = 16 << 20;

/// The tag a user needs to use the admin endpoint.
pub const ADMIN_TAG: &str = "administrator";

/// The client's first frame.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Auth {
    /// User name.
    pub user: String,
    /// Password.
    pub password: String,
}

/// One admin command. `vhost` fields default to `/` as in `rabbitmqctl`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// `list_queues [-p VHOST] [COLUMN...]`.
    ListQueues {
        /// Vhost.
        vhost: String,
        /// Requested columns (empty: the defaults).
        columns: Vec<String>,
    },
    /// `list_exchanges [-p VHOST] [COLUMN...]`.
    ListExchanges {
        /// Vhost.
        vhost: String,
        /// Requested columns.
        columns: Vec<String>,
    },
    /// `list_bindings [-p VHOST] [COLUMN...]`.
    ListBindings {
        /// Vhost.
        vhost: String,
        /// Requested columns.
        columns: Vec<String>,
    },
    /// `list_users`.
    ListUsers,
    /// `list_vhosts [COLUMN...]`.
    ListVhosts {
        /// Requested columns.
        columns: Vec<String>,
    },
    /// `list_permissions [-p VHOST]`.
    ListPermissions {
        /// Vhost.
        vhost: String,
    },
    /// `list_policies` / `list_operator_policies [-p VHOST]`.
    ListPolicies {
        /// Vhost.
        vhost: String,
        /// Operator policies.
        operator: bool,
    },
    /// `add_user NAME PASSWORD`.
    AddUser {
        /// Name.
        name: String,
        /// Password.
        password: String,
    },
    /// `delete_user NAME`.
    DeleteUser {
        /// Name.
        name: String,
    },
    /// `change_password NAME PASSWORD`.
    ChangePassword {
        /// Name.
        name: String,
        /// New password.
        password: String,
    },
    /// `set_user_tags NAME TAG...`.
    SetUserTags {
        /// Name.
        name: String,
        /// Tags (replace the current ones).
        tags: Vec<String>,
    },
    /// `set_permissions [-p VHOST] USER CONF WRITE READ`.
    SetPermissions {
        /// Vhost.
        vhost: String,
        /// User.
        user: String,
        /// Configure regex.
        configure: String,
        /// Write regex.
        write: String,
        /// Read regex.
        read: String,
    },
    /// `add_vhost NAME`.
    AddVhost {
        /// Name.
        name: String,
    },
    /// `delete_vhost NAME`.
    DeleteVhost {
        /// Name.
        name: String,
    },
    /// `set_policy` / `set_operator_policy`.
    SetPolicy {
        /// Vhost.
        vhost: String,
        /// Name.
        name: String,
        /// Regex over resource names.
        pattern: String,
        /// The definition as JSON text (parsed by the broker side).
        definition: String,
        /// Priority.
        priority: i64,
        /// `queues`, `exchanges` or `all`.
        apply_to: String,
        /// Operator policy.
        operator: bool,
    },
    /// `clear_policy` / `clear_operator_policy`.
    ClearPolicy {
        /// Vhost.
        vhost: String,
        /// Name.
        name: String,
        /// Operator policy.
        operator: bool,
    },
    /// `cluster_status`.
    ClusterStatus,
    /// `join_cluster SEED`: this node (started with a `[cluster]` section but not among
    /// the initial members) joins the cluster of the node whose admin endpoint is `SEED`.
    JoinCluster {
        /// The seed node's admin address (`host:port`).
        seed: String,
    },
    /// `forget_cluster_node NODE`: removes a node (name or id) from the cluster for good.
    ForgetClusterNode {
        /// Node name or id.
        node: String,
    },
    /// Sent by a joining node to a member's admin endpoint: register it.
    RegisterMember(crate::meta::NodeRecord),
    /// `list_connections [COLUMN...]`: this node's open AMQP connections.
    ListConnections {
        /// Requested columns.
        columns: Vec<String>,
    },
    /// `list_channels [COLUMN...]`: this node's open channels.
    ListChannels {
        /// Requested columns.
        columns: Vec<String>,
    },
    /// `list_consumers [-p VHOST] [COLUMN...]`: consumers on this node's channels.
    ListConsumers {
        /// Vhost.
        vhost: String,
        /// Requested columns.
        columns: Vec<String>,
    },
    // New variants go last: bincode numbers variants by position, and nodes of different
    // versions exchange requests (`RegisterMember`).
    /// `sync_queue` / `cancel_sync_queue [-p VHOST] QUEUE`: asks a mirrored queue's master
    /// to copy its backlog to its unsynchronised mirrors now (or to stop).
    SyncQueue {
        /// Vhost.
        vhost: String,
        /// Queue.
        queue: String,
        /// `cancel_sync_queue`.
        cancel: bool,
    },
    /// `force_promote_mirror [-p VHOST] QUEUE [NODE]` (Warren only): makes a mirror the
    /// master of a queue whose master's node is gone, even when no mirror is synchronised
    /// (the way out of `ha-promote-on-failure: when-synced`). See [`mirrors::force_promotion`].
    ForcePromoteMirror {
        /// Vhost.
        vhost: String,
        /// Queue.
        queue: String,
        /// The mirror's node (name or id); none: the default choice.
        node: Option<String>,
    },
    /// `export_definitions`: RabbitMQ's definitions JSON, in the answer's message
    /// (answered by the node's runtime with [`crate::mgmt::definitions`]).
    ExportDefinitions,
    /// `import_definitions`: imports RabbitMQ's definitions JSON (the runtime plans it with
    /// [`crate::mgmt::definitions::plan_json`] and commits every command).
    ImportDefinitions {
        /// The file's text.
        json: String,
    },
    /// `clear_permissions [-p VHOST] USER`.
    ClearPermissions {
        /// Vhost.
        vhost: String,
        /// User.
        user: String,
    },
    /// `set_vhost_limits [-p VHOST] JSON` (replaces the vhost's limits) or
    /// `set_user_limits USER JSON` (updates the named ones, keeps the others), as rabbitmqctl.
    SetLimits {
        /// Whose limits.
        scope: LimitScope,
        /// The JSON object of limits, as typed.
        json: String,
    },
    /// `clear_vhost_limits [-p VHOST]` (all of them) or `clear_user_limits USER NAME|all`.
    ClearLimits {
        /// Whose limits.
        scope: LimitScope,
        /// One limit; `None`: all.
        name: Option<String>,
    },
    /// `list_vhost_limits [-p VHOST] [--global]`, `list_user_limits [--user USER] [--global]`
    /// (as rabbitmqctl: without `--global`, the vhost `/` or the user `guest` by default).
    ListLimits {
        /// One vhost's or user's; `None`: every vhost's (`users` false) or user's.
        scope: Option<LimitScope>,
        /// User limits rather than vhost limits.
        users: bool,
    },
}

/// The answer to a request (and to [`Auth`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    /// Whether the command succeeded.
    pub ok: bool,
    /// Column names of a listing (empty otherwise).
    pub columns: Vec<String>,
    /// Rows of a listing, one value per column.
    pub rows: Vec<Vec<String>>,
    /// What was done, or why it was refused.
    pub message: String,
}

impl Response {
    /// A success with a message.
    pub fn done(message: impl Into<String>) -> Response {
        Response {
            ok: true,
            message: message.into(),
            ..Response::default()
        }
    }

    /// A refusal.
    pub fn refused(message: impl Into<String>) -> Response {
        Response {
            ok: false,
            message: message.into(),
            ..Response::default()
        }
    }

    /// A table.
    pub fn table(columns: Vec<String>, rows: Vec<Vec<String>>) -> Response {
        Response {
            ok: true,
            columns,
            rows,
            message: String::new(),
        }
    }
}

/// Why a frame could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The body is larger than [`MAX_FRAME`].
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
    /// The body is not a valid encoding.
    #[error("malformed frame: {0}")]
    Codec(#[from] bincode::Error),
}

/// Encodes `value` as a full frame (length prefix included).
pub fn encode_frame<T: Serialize>(value: &T) -> Result<Vec<u8>, FrameError> {
    let body = bincode::serialize(value)?;
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge(body.len()));
    }
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Checks a length prefix.
pub fn frame_len(prefix: [u8; 4]) -> Result<usize, FrameError> {
    let n = u32::from_be_bytes(prefix) as usize;
    if n > MAX_FRAME {
        return Err(FrameError::TooLarge(n));
    }
    Ok(n)
}

/// Decodes a frame body (without its prefix); trailing bytes are refused.
pub fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    use bincode::Options;
    Ok(bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_limit(MAX_FRAME as u64 * 4)
        .reject_trailing_bytes()
        .deserialize(body)?)
}

/// Checks credentials: the password must match and the user carry the `administrator` tag.
/// The refusal text does not say which of the two failed.
pub fn authenticate(broker: &Broker, auth: &Auth) -> Response {
    let meta = broker.snapshot();
    let ok = meta.users.get(&auth.user).is_some_and(|u| {
        u.password_matches(&auth.password) && u.tags.iter().any(|t| t == ADMIN_TAG)
    });
    if ok {
        Response::done(format!("authenticated as '{}'", auth.user))
    } else {
        Response::refused(format!(
            "authentication failed for user '{}' (bad credentials or not an administrator)",
            auth.user
        ))
    }
}

/// What the handler needs beyond the broker.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    /// The node's name (`pid` column, `cluster_status`).
    pub name: String,
}

fn table_value(v: &AMQPValue) -> String {
    match v {
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(x) => x.to_string(),
        AMQPValue::ShortShortUInt(x) => x.to_string(),
        AMQPValue::ShortInt(x) => x.to_string(),
        AMQPValue::ShortUInt(x) => x.to_string(),
        AMQPValue::LongInt(x) => x.to_string(),
        AMQPValue::LongUInt(x) => x.to_string(),
        AMQPValue::LongLongInt(x) => x.to_string(),
        AMQPValue::Timestamp(x) => x.to_string(),
        AMQPValue::Float(x) => x.to_string(),
        AMQPValue::Double(x) => x.to_string(),
        AMQPValue::LongString(_) | AMQPValue::ShortString(_) => {
            json::quote(&crate::meta::args::string(v).unwrap_or_default())
        }
        AMQPValue::FieldTable(t) => format_table(t),
        AMQPValue::FieldArray(a) => {
            let items: Vec<String> = a.as_slice().iter().map(table_value).collect();
            format!("[{}]", items.join(","))
        }
        AMQPValue::Void => "null".into(),
        other => json::quote(&format!("{other:?}")),
    }
}

/// Formats an argument table as a JSON-like object.
pub fn format_table(t: &FieldTable) -> String {
    let items: Vec<String> = t
        .inner()
        .iter()
        .map(|(k, v)| format!("{}:{}", json::quote(k.as_str()), table_value(v)))
        .collect();
    format!("{{{}}}", items.join(","))
}

/// Picks `requested` columns (or `defaults`) out of full rows keyed by column name.
fn select(
    all: &[&str],
    defaults: &[&str],
    requested: &[String],
    rows: Vec<BTreeMap<&'static str, String>>,
) -> Response {
    let cols: Vec<String> = if requested.is_empty() {
        defaults.iter().map(|s| s.to_string()).collect()
    } else {
        requested.to_vec()
    };
    if let Some(bad) = cols.iter().find(|c| !all.contains(&c.as_str())) {
        return Response::refused(format!(
            "Info key {bad} is not recognised (valid keys: {})",
            all.join(", ")
        ));
    }
    let rows = rows
        .into_iter()
        .map(|r| {
            cols.iter()
                .map(|c| r.get(c.as_str()).cloned().unwrap_or_default())
                .collect()
        })
        .collect();
    Response::table(cols, rows)
}

const QUEUE_COLUMNS: &[&str] = &[
    "name",
    "messages",
    "messages_ready",
    "messages_unacknowledged",
    "messages_ram",
    "messages_paged_out",
    "consumers",
    "pid",
    "node",
    "slave_pids",
    "synchronised_slave_pids",
    "mirror_pids",
    "synchronised_mirror_pids",
    "mirror_epoch",
    "mirrors",
    "policy",
    "operator_policy",
    "effective_policy_definition",
    "durable",
    "auto_delete",
    "exclusive",
    "arguments",
];
const EXCHANGE_COLUMNS: &[&str] = &[
    "name",
    "type",
    "durable",
    "auto_delete",
    "internal",
    "arguments",
    "policy",
];
const BINDING_COLUMNS: &[&str] = &[
    "source_name",
    "source_kind",
    "destination_name",
    "destination_kind",
    "routing_key",
    "arguments",
];

const CONNECTION_COLUMNS: &[&str] = &[
    "pid",
    "name",
    "node",
    "user",
    "vhost",
    "peer_host",
    "peer_port",
    "host",
    "port",
    "state",
    "channels",
    "protocol",
    "timeout",
    "frame_max",
    "channel_max",
    "client_properties",
];
const CONNECTION_DEFAULTS: &[&str] = &["user", "peer_host", "peer_port", "state"];
const CHANNEL_COLUMNS: &[&str] = &[
    "pid",
    "connection",
    "name",
    "node",
    "number",
    "user",
    "vhost",
    "transactional",
    "confirm",
    "consumer_count",
    "messages_unacknowledged",
    "messages_unconfirmed",
    "prefetch_count",
    "global_prefetch_count",
];
const CHANNEL_DEFAULTS: &[&str] = &["pid", "user", "consumer_count", "messages_unacknowledged"];
const CONSUMER_COLUMNS: &[&str] = &[
    "queue_name",
    "channel_pid",
    "consumer_tag",
    "ack_required",
    "prefetch_count",
    "active",
    "activity_status",
    "exclusive",
    "arguments",
];
const CONSUMER_DEFAULTS: &[&str] = &[
    "queue_name",
    "channel_pid",
    "consumer_tag",
    "ack_required",
    "prefetch_count",
    "active",
    "arguments",
];

/// A connection's `pid`: `<NODE.CONNID>`, e.g. `<warren@localhost.3>`, NODE being the node's
/// name and CONNID the connection id (decimal; unique in the cluster, as the node id sits in
/// its high bits, see [`Broker::next_connection_id`]). RabbitMQ shows an Erlang process id
/// here; this names the same thing and stays stable for the connection's life.
pub fn connection_pid(node: &str, conn_id: u64) -> String {
    format!("<{node}.{conn_id}>")
}

/// A channel's `pid`: the connection's with the channel number added,
/// `<NODE.CONNID.CHANNEL>`, e.g. `<warren@localhost.3.1>`. `list_consumers` shows it as
/// `channel_pid`, so a consumer can be matched to its row of `list_channels`.
pub fn channel_pid(node: &str, conn_id: u64, channel: u16) -> String {
    format!("<{node}.{conn_id}.{channel}>")
}

fn connection_row(node: &NodeInfo, c: &ConnectionView) -> BTreeMap<&'static str, String> {
    let i = &c.info;
    BTreeMap::from([
        ("pid", connection_pid(&node.name, i.id)),
        ("name", i.name()),
        ("node", node.name.clone()),
        ("user", i.user.clone()),
        ("vhost", i.vhost.clone()),
        ("peer_host", i.peer_host.clone()),
        ("peer_port", i.peer_port.to_string()),
        ("host", i.host.clone()),
        ("port", i.port.to_string()),
        ("state", c.state.name().to_string()),
        ("channels", c.channels.len().to_string()),
        ("protocol", "AMQP 0-9-1".to_string()),
        ("timeout", i.timeout_s.to_string()),
        ("frame_max", i.frame_max.to_string()),
        ("channel_max", i.channel_max.to_string()),
        ("client_properties", format_table(&i.client_properties)),
    ])
}

fn channel_row(
    node: &NodeInfo,
    c: &ConnectionView,
    ch: &ChannelView,
) -> BTreeMap<&'static str, String> {
    let i = &c.info;
    BTreeMap::from([
        ("pid", channel_pid(&node.name, i.id, ch.number)),
        ("connection", connection_pid(&node.name, i.id)),
        ("name", format!("{} ({})", i.name(), ch.number)),
        ("node", node.name.clone()),
        ("number", ch.number.to_string()),
        ("user", i.user.clone()),
        ("vhost", i.vhost.clone()),
        ("transactional", ch.transactional.to_string()),
        ("confirm", ch.confirm.to_string()),
        ("consumer_count", ch.consumers.len().to_string()),
        ("messages_unacknowledged", ch.unacked.to_string()),
        ("messages_unconfirmed", ch.unconfirmed.to_string()),
        ("prefetch_count", ch.prefetch.to_string()),
        ("global_prefetch_count", ch.global_prefetch.to_string()),
    ])
}

/// Whether a consumer gets messages: always, unless its queue is single-active-consumer and
/// another consumer is the active one. Reads the queue (the registry lock is not held).
pub fn consumer_activity(
    broker: &Broker,
    vhost: &str,
    conn_id: u64,
    channel: u16,
    k: &ConsumerInfo,
) -> (bool, &'static str) {
    let Some(h) = broker.queue(vhost, &k.queue) else {
        return (true, "up");
    };
    let q = h.lock();
    match q.single_active_consumer() {
        None => (true, "up"),
        Some(a) => {
            let me = a.link.conn_id == conn_id && a.link.channel == channel && *a.tag == *k.tag;
            if me {
                (true, "single_active")
            } else {
                (false, "waiting")
            }
        }
    }
}

/// The refusal when the vhost or user whose limits a request names does not exist.
fn missing_owner(meta: &crate::meta::MetaState, scope: &LimitScope) -> Option<Response> {
    match scope {
        LimitScope::Vhost(v) if meta.vhost(v).is_none() => Some(Response::refused(format!(
            "Virtual host \"{v}\" does not exist"
        ))),
        LimitScope::User(u) if !meta.users.contains_key(u) => {
            Some(Response::refused(format!("User \"{u}\" does not exist")))
        }
        _ => None,
    }
}

fn cols(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// What a request needs: an answer now, or a metadata command to commit first.
#[derive(Debug)]
pub enum Handled {
    /// The answer.
    Reply(Response),
    /// Commit `command` (through the node's `MetaCommit`); on success answer `ok`, on
    /// refusal the error's text.
    Commit {
        /// The change.
        command: Command,
        /// The success message.
        ok: String,
    },
}

/// Handles one request on a single node: commands are applied to `broker` at once.
pub fn handle(broker: &Broker, node: &NodeInfo, request: &Request, now: Instant) -> Response {
    match plan(broker, node, request) {
        Handled::Reply(r) => r,
        Handled::Commit { command, ok } => match broker.apply(&command, now) {
            Ok(_) => Response::done(ok),
            Err(e) => Response::refused(e.to_string()),
        },
    }
}

/// Handles one request up to the metadata change it makes, if any: listings are answered
/// from `broker`; a change is checked and returned as the command to commit.
pub fn plan(broker: &Broker, node: &NodeInfo, request: &Request) -> Handled {
    plan_with_counts(broker, node, request, &RemoteCounts::new())
}

/// Ready, unacknowledged and consumer counts of queues other nodes run, by name (what their
/// nodes answered), for `list_queues` on a clustered node.
pub type RemoteCounts = std::collections::HashMap<String, (u32, u32, u32)>;

/// [`plan`], with the counts of queues of other nodes that the caller fetched.
pub fn plan_with_counts(
    broker: &Broker,
    node: &NodeInfo,
    request: &Request,
    remote_counts: &RemoteCounts,
) -> Handled {
    let mut commit = None;
    let reply = plan_inner(broker, node, request, &mut commit, remote_counts);
    match commit {
        Some((command, ok)) if reply.ok => Handled::Commit { command, ok },
        _ => Handled::Reply(reply),
    }
}

fn plan_inner(
    broker: &Broker,
    node: &NodeInfo,
    request: &Request,
    commit: &mut Option<(Command, String)>,
    remote_counts: &RemoteCounts,
) -> Response {
    let meta = broker.snapshot();
    let mut apply = |cmd: Command, ok: String| {
        *commit = Some((cmd, ok.clone()));
        Response::done(ok)
    };
    match request {
        Request::ListQueues { vhost, columns } => {
            let Some(v) = meta.vhost(vhost) else {
                return Response::refused(format!("no vhost '{vhost}'"));
            };
            let rows = v
                .queues
                .values()
                .map(|q| {
                    let (ready, unacked, consumers, paged) = match broker.queue(vhost, &q.name) {
                        Some(h) => {
                            let g = h.lock();
                            (
                                g.message_count(),
                                g.unacked_count(),
                                g.consumer_count(),
                                g.paged_count() + g.beta_count(),
                            )
                        }
                        // Another node's queue: the counts its node gave the caller, if any.
                        None => match remote_counts.get(&q.name) {
                            Some(&(ready, unacked, consumers)) => (ready, unacked, consumers, 0),
                            None => (0, 0, 0, 0),
                        },
                    };
                    let total = ready as u64 + unacked as u64;
                    let home = meta
                        .nodes
                        .get(&q.home)
                        .map_or_else(|| node.name.clone(), |n| n.name.clone());
                    let eff = v.effective_policy(&q.name, true);
                    let m = mirrors::columns(&meta, vhost, &q.name);
                    BTreeMap::from([
                        ("name", q.name.clone()),
                        ("messages", total.to_string()),
                        ("messages_ready", ready.to_string()),
                        ("messages_unacknowledged", unacked.to_string()),
                        ("messages_ram", total.saturating_sub(paged).to_string()),
                        ("messages_paged_out", paged.to_string()),
                        ("consumers", consumers.to_string()),
                        // The node the queue runs on (RabbitMQ prints the queue process's pid,
                        // whose node part this is).
                        ("pid", home.clone()),
                        ("node", home),
                        // RabbitMQ 3.x names, and the aliases it introduced for them.
                        ("slave_pids", m.slave_pids.clone()),
                        ("mirror_pids", m.slave_pids),
                        ("synchronised_slave_pids", m.synchronised_slave_pids.clone()),
                        ("synchronised_mirror_pids", m.synchronised_slave_pids),
                        ("mirror_epoch", m.mirror_epoch),
                        ("mirrors", m.mirrors),
                        ("policy", eff.policy.clone().unwrap_or_default()),
                        (
                            "operator_policy",
                            eff.operator_policy.clone().unwrap_or_default(),
                        ),
                        (
                            "effective_policy_definition",
                            json::write_definition(&eff.definition),
                        ),
                        ("durable", q.durable.to_string()),
                        ("auto_delete", q.auto_delete.to_string()),
                        ("exclusive", q.exclusive_owner.is_some().to_string()),
                        ("arguments", format_table(&q.arguments)),
                    ])
                })
                .collect();
            select(QUEUE_COLUMNS, &["name", "messages"], columns, rows)
        }
        Request::ListExchanges { vhost, columns } => {
            let Some(v) = meta.vhost(vhost) else {
                return Response::refused(format!("no vhost '{vhost}'"));
            };
            let rows = v
                .exchanges
                .values()
                .map(|x| {
                    BTreeMap::from([
                        ("name", x.name.clone()),
                        ("type", x.kind.name().to_string()),
                        ("durable", x.durable.to_string()),
                        ("auto_delete", x.auto_delete.to_string()),
                        ("internal", x.internal.to_string()),
                        ("arguments", format_table(&x.arguments)),
                        (
                            "policy",
                            v.effective_policy(&x.name, false)
                                .policy
                                .unwrap_or_default(),
                        ),
                    ])
                })
                .collect();
            select(EXCHANGE_COLUMNS, &["name", "type"], columns, rows)
        }
        Request::ListBindings { vhost, columns } => {
            let Some(v) = meta.vhost(vhost) else {
                return Response::refused(format!("no vhost '{vhost}'"));
            };
            let rows = v
                .bindings
                .values()
                .flatten()
                .map(|b| {
                    BTreeMap::from([
                        ("source_name", b.source.clone()),
                        ("source_kind", "exchange".to_string()),
                        ("destination_name", b.destination.name().to_string()),
                        ("destination_kind", b.destination.kind().to_string()),
                        ("routing_key", b.routing_key.clone()),
                        ("arguments", format_table(&b.arguments)),
                    ])
                })
                .collect();
            select(BINDING_COLUMNS, BINDING_COLUMNS, columns, rows)
        }
        Request::ListUsers => Response::table(
            cols(&["user", "tags"]),
            meta.users
                .values()
                .map(|u| vec![u.name.clone(), format!("[{}]", u.tags.join(", "))])
                .collect(),
        ),
        Request::ListVhosts { columns } => {
            let rows = meta
                .vhosts
                .keys()
                .map(|n| BTreeMap::from([("name", n.clone())]))
                .collect();
            select(&["name"], &["name"], columns, rows)
        }
        Request::ListPermissions { vhost } => {
            if meta.vhost(vhost).is_none() {
                return Response::refused(format!("no vhost '{vhost}'"));
            }
            Response::table(
                cols(&["user", "configure", "write", "read"]),
                meta.permissions
                    .values()
                    .filter(|p| &p.vhost == vhost)
                    .map(|p| {
                        vec![
                            p.user.clone(),
                            p.configure.clone(),
                            p.write.clone(),
                            p.read.clone(),
                        ]
                    })
                    .collect(),
            )
        }
        Request::ListPolicies { vhost, operator } => {
            let Some(v) = meta.vhost(vhost) else {
                return Response::refused(format!("no vhost '{vhost}'"));
            };
            let map = if *operator {
                &v.operator_policies
            } else {
                &v.policies
            };
            Response::table(
                cols(&[
                    "vhost",
                    "name",
                    "pattern",
                    "apply-to",
                    "definition",
                    "priority",
                ]),
                map.values()
                    .map(|p| {
                        vec![
                            p.vhost.clone(),
                            p.name.clone(),
                            p.pattern.clone(),
                            match p.apply_to {
                                ApplyTo::Queues => "queues",
                                ApplyTo::Exchanges => "exchanges",
                                ApplyTo::All => "all",
                            }
                            .to_string(),
                            json::write_definition(&p.definition),
                            p.priority.to_string(),
                        ]
                    })
                    .collect(),
            )
        }
        Request::AddUser { name, password } => {
            if name.is_empty() {
                return Response::refused("the user name must not be empty");
            }
            if meta.users.contains_key(name) {
                return Response::refused(format!("user '{name}' already exists"));
            }
            apply(
                Command::PutUser(User {
                    name: name.clone(),
                    password: User::hash_password(password, broker.new_salt()),
                    tags: Vec::new(),
                }),
                format!("Adding user \"{name}\" ..."),
            )
        }
        Request::DeleteUser { name } => apply(
            Command::DeleteUser { name: name.clone() },
            format!("Deleting user \"{name}\" ..."),
        ),
        Request::ChangePassword { name, password } => {
            let Some(u) = meta.users.get(name) else {
                return Response::refused(format!("no user '{name}'"));
            };
            apply(
                Command::PutUser(User {
                    password: User::hash_password(password, broker.new_salt()),
                    ..u.clone()
                }),
                format!("Changing password for user \"{name}\" ..."),
            )
        }
        Request::SetUserTags { name, tags } => {
            let Some(u) = meta.users.get(name) else {
                return Response::refused(format!("no user '{name}'"));
            };
            apply(
                Command::PutUser(User {
                    tags: tags.clone(),
                    ..u.clone()
                }),
                format!(
                    "Setting tags for user \"{name}\" to [{}] ...",
                    tags.join(", ")
                ),
            )
        }
        Request::SetPermissions {
            vhost,
            user,
            configure,
            write,
            read,
        } => {
            for (what, re) in [("configure", configure), ("write", write), ("read", read)] {
                if let Err(e) = regex::Regex::new(re) {
                    return Response::refused(format!("invalid {what} regex '{re}': {e}"));
                }
            }
            apply(
                Command::SetPermissions(Permission {
                    user: user.clone(),
                    vhost: vhost.clone(),
                    configure: configure.clone(),
                    write: write.clone(),
                    read: read.clone(),
                }),
                format!("Setting permissions for user \"{user}\" in vhost \"{vhost}\" ..."),
            )
        }
        Request::ClearPermissions { vhost, user } => {
            if !meta.users.contains_key(user) {
                return Response::refused(format!("User \"{user}\" does not exist"));
            }
            if meta.vhost(vhost).is_none() {
                return Response::refused(format!("Virtual host \"{vhost}\" does not exist"));
            }
            apply(
                Command::ClearPermissions {
                    user: user.clone(),
                    vhost: vhost.clone(),
                },
                format!("Clearing permissions for user \"{user}\" in vhost \"{vhost}\" ..."),
            )
        }
        Request::SetLimits { scope, json } => {
            if let Some(refusal) = missing_owner(&meta, scope) {
                return refusal;
            }
            let limits = match serde_json::from_str(json)
                .map_err(|e| format!("JSON decoding error. Reason: {e}"))
                .and_then(|v| limits::parse_json(&v))
            {
                Ok(l) => l,
                Err(e) => return Response::refused(e),
            };
            if let Err(e) = scope.validate(&limits) {
                return Response::refused(e.to_string());
            }
            let (replace, ok) = match scope {
                LimitScope::Vhost(v) => (
                    true,
                    format!("Setting vhost limits to \"{json}\" for vhost \"{v}\" ..."),
                ),
                LimitScope::User(u) => (
                    false,
                    format!("Setting user limits to \"{json}\" for user \"{u}\" ..."),
                ),
            };
            apply(
                Command::SetLimits {
                    scope: scope.clone(),
                    limits,
                    replace,
                },
                ok,
            )
        }
        Request::ClearLimits { scope, name } => {
            if let Some(refusal) = missing_owner(&meta, scope) {
                return refusal;
            }
            let ok = match (scope, name) {
                (LimitScope::Vhost(v), _) => format!("Clearing vhost \"{v}\" limits ..."),
                (LimitScope::User(u), None) => {
                    format!("Clearing all limits for user \"{u}\" ...")
                }
                (LimitScope::User(u), Some(n)) => {
                    format!("Clearing \"{n}\" limit for user \"{u}\" ...")
                }
            };
            apply(
                Command::ClearLimits {
                    scope: scope.clone(),
                    name: name.clone(),
                },
                ok,
            )
        }
        Request::ListLimits { scope, users } => {
            if let Some(refusal) = scope.as_ref().and_then(|s| missing_owner(&meta, s)) {
                return refusal;
            }
            let (all, column) = if *users {
                (&meta.user_limits, "user")
            } else {
                (&meta.vhost_limits, "vhost")
            };
            let wanted = |name: &str| match scope {
                Some(LimitScope::Vhost(k) | LimitScope::User(k)) => k == name,
                None => true,
            };
            Response::table(
                cols(&[column, "limits"]),
                all.iter()
                    .filter(|(name, _)| wanted(name))
                    .map(|(name, l)| vec![name.clone(), limits::to_json(l).to_string()])
                    .collect(),
            )
        }
        Request::AddVhost { name } => {
            if name.is_empty() {
                return Response::refused("the vhost name must not be empty");
            }
            apply(
                Command::AddVhost { name: name.clone() },
                format!("Adding vhost \"{name}\" ..."),
            )
        }
        Request::DeleteVhost { name } => apply(
            Command::DeleteVhost { name: name.clone() },
            format!("Deleting vhost \"{name}\" ..."),
        ),
        Request::SetPolicy {
            vhost,
            name,
            pattern,
            definition,
            priority,
            apply_to,
            operator,
        } => {
            let definition = match json::parse_definition(definition) {
                Ok(d) => d,
                Err(e) => return Response::refused(format!("Could not parse JSON document: {e}")),
            };
            let Some(apply_to) = ApplyTo::parse(apply_to) else {
                return Response::refused(format!(
                    "invalid --apply-to '{apply_to}' (one of queues, exchanges, all)"
                ));
            };
            let policy = Policy {
                vhost: vhost.clone(),
                name: name.clone(),
                pattern: pattern.clone(),
                apply_to,
                priority: *priority,
                definition,
            };
            if let Err(e) = policy.validate(*operator) {
                return Response::refused(e.to_string());
            }
            let kind = if *operator {
                "operator policy"
            } else {
                "policy"
            };
            apply(
                Command::SetPolicy {
                    policy,
                    operator: *operator,
                },
                format!(
                    "Setting {kind} \"{name}\" for pattern \"{pattern}\" in vhost \"{vhost}\" ..."
                ),
            )
        }
        Request::ClearPolicy {
            vhost,
            name,
            operator,
        } => {
            let exists = meta.vhost(vhost).is_some_and(|v| {
                if *operator {
                    v.operator_policies.contains_key(name)
                } else {
                    v.policies.contains_key(name)
                }
            });
            if !exists {
                return Response::refused(format!(
                    "Parameter does not exist: no policy '{name}' in vhost '{vhost}'"
                ));
            }
            let kind = if *operator {
                "operator policy"
            } else {
                "policy"
            };
            apply(
                Command::ClearPolicy {
                    vhost: vhost.clone(),
                    name: name.clone(),
                    operator: *operator,
                },
                format!("Clearing {kind} \"{name}\" on vhost \"{vhost}\" ..."),
            )
        }
        Request::ClusterStatus => Response::table(
            cols(&["node", "running", "disc"]),
            vec![vec![node.name.clone(), "true".into(), "true".into()]],
        ),
        Request::JoinCluster { .. } => {
            Response::refused("this node is not clustered: start it with a [cluster] section")
        }
        Request::ForgetClusterNode { node } => {
            let found = meta
                .nodes
                .values()
                .find(|n| n.name == *node || n.id.to_string() == *node);
            match found {
                None => Response::refused(format!("no cluster node '{node}'")),
                Some(n) if n.id == broker.node_id() => {
                    Response::refused("a node cannot forget itself; run this on another node")
                }
                Some(n) => apply(
                    Command::ForgetNode { id: n.id },
                    format!("forgot node {} ({})", n.name, n.id),
                ),
            }
        }
        Request::RegisterMember(record) => {
            if broker.node_id() == 0 {
                return Response::refused("this node is not clustered");
            }
            apply(
                Command::RegisterNode(record.clone()),
                format!("registered node {} ({})", record.name, record.id),
            )
        }
        Request::ListConnections { columns } => {
            let rows = broker
                .sessions()
                .connections()
                .iter()
                .map(|c| connection_row(node, c))
                .collect();
            select(CONNECTION_COLUMNS, CONNECTION_DEFAULTS, columns, rows)
        }
        Request::ListChannels { columns } => {
            let conns = broker.sessions().connections();
            let rows = conns
                .iter()
                .flat_map(|c| c.channels.iter().map(move |ch| channel_row(node, c, ch)))
                .collect();
            select(CHANNEL_COLUMNS, CHANNEL_DEFAULTS, columns, rows)
        }
        Request::ListConsumers { vhost, columns } => {
            if meta.vhost(vhost).is_none() {
                return Response::refused(format!("no vhost '{vhost}'"));
            }
            let conns = broker.sessions().connections();
            let mut rows = Vec::new();
            for c in conns.iter().filter(|c| &c.info.vhost == vhost) {
                for ch in &c.channels {
                    for k in &ch.consumers {
                        let (active, status) =
                            consumer_activity(broker, vhost, c.info.id, ch.number, k);
                        rows.push(BTreeMap::from([
                            ("queue_name", k.queue.clone()),
                            ("channel_pid", channel_pid(&node.name, c.info.id, ch.number)),
                            ("consumer_tag", k.tag.clone()),
                            ("ack_required", k.ack_required.to_string()),
                            ("prefetch_count", k.prefetch.to_string()),
                            ("active", active.to_string()),
                            ("activity_status", status.to_string()),
                            ("exclusive", k.exclusive.to_string()),
                            ("arguments", format_table(&k.arguments)),
                        ]));
                    }
                }
            }
            select(CONSUMER_COLUMNS, CONSUMER_DEFAULTS, columns, rows)
        }
        Request::SyncQueue {
            vhost,
            queue,
            cancel,
        } => {
            let Some(v) = meta.vhost(vhost) else {
                return Response::refused(format!("no vhost '{vhost}'"));
            };
            if !v.queues.contains_key(queue) {
                return Response::refused(format!("no queue '{queue}' in vhost '{vhost}'"));
            }
            // Whether it is mirrored is the state machine's call (it refuses with "not
            // mirrored"): it sees the set as of the commit, not as of this snapshot.
            let ok = if *cancel {
                format!("Stopping synchronising queue '{queue}' in vhost '{vhost}' ...")
            } else {
                format!("Synchronising queue '{queue}' in vhost '{vhost}' ...")
            };
            apply(
                Command::SyncQueue {
                    vhost: vhost.clone(),
                    queue: queue.clone(),
                    cancel: *cancel,
                },
                ok,
            )
        }
        Request::ForcePromoteMirror { vhost, queue, node } => {
            match mirrors::force_promotion(&meta, vhost, queue, node.as_deref()) {
                Err(e) => Response::refused(e.to_string()),
                // At the epoch the choice was made at: if a promotion happened since, the
                // compare-and-set refuses this one rather than promote twice.
                Ok(p) => apply(
                    Command::PromoteMirror {
                        vhost: vhost.clone(),
                        queue: queue.clone(),
                        expected_epoch: p.epoch,
                        node: p.node,
                    },
                    format!(
                        "Promoting the mirror on node {} to master of queue '{queue}' in vhost '{vhost}' (epoch {}) ...",
                        p.name,
                        p.epoch + 1
                    ),
                ),
            }
        }
        // The definitions format is the management API's, which builds on this module.
        Request::ExportDefinitions | Request::ImportDefinitions { .. } => {
            Response::refused("definitions are exported and imported by the node's runtime")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::registry::{ConnectionInfo, ConnectionState};
    use crate::broker::{ChannelLink, Consumer, Outbox};
    use crate::config::Config;
    use crate::meta::QueueDef;
    use amq_protocol::types::FieldTable;
    use std::sync::atomic::AtomicU32;
    use std::sync::Arc;

    fn node() -> NodeInfo {
        NodeInfo {
            name: "warren@test".into(),
        }
    }

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    fn conn_info(id: u64, port: u16) -> ConnectionInfo {
        ConnectionInfo {
            id,
            user: "guest".into(),
            vhost: "/".into(),
            peer_host: "127.0.0.1".into(),
            peer_port: port,
            host: "127.0.0.1".into(),
            port: 5672,
            timeout_s: 60,
            frame_max: 131_072,
            channel_max: 2047,
            client_properties: FieldTable::default(),
            auth_mechanism: "PLAIN".into(),
            ssl: None,
        }
    }

    fn consumer_info(tag: &str, queue: &str) -> ConsumerInfo {
        ConsumerInfo {
            tag: tag.into(),
            queue: queue.into(),
            ack_required: true,
            prefetch: 10,
            exclusive: false,
            arguments: FieldTable::default(),
        }
    }

    fn reply(broker: &Broker, r: Request) -> Response {
        handle(broker, &node(), &r, Instant::from_millis(0))
    }

    #[test]
    fn clear_permissions_removes_them_and_refuses_unknown_names() {
        let broker = Broker::new(&Config::default(), 1, 1 << 30, 0);
        let (add, set) = (
            Request::AddUser {
                name: "alice".into(),
                password: "pw".into(),
            },
            Request::SetPermissions {
                vhost: "/".into(),
                user: "alice".into(),
                configure: ".*".into(),
                write: ".*".into(),
                read: ".*".into(),
            },
        );
        assert!(reply(&broker, add).ok);
        assert!(reply(&broker, set).ok);
        assert!(broker.snapshot().permission("alice", "/").is_some());
        let r = reply(
            &broker,
            Request::ClearPermissions {
                vhost: "/".into(),
                user: "alice".into(),
            },
        );
        assert!(r.ok, "{}", r.message);
        assert_eq!(
            r.message,
            "Clearing permissions for user \"alice\" in vhost \"/\" ..."
        );
        assert!(broker.snapshot().permission("alice", "/").is_none());
        for (vhost, user) in [("/", "nobody"), ("nowhere", "alice")] {
            let r = reply(
                &broker,
                Request::ClearPermissions {
                    vhost: vhost.into(),
                    user: user.into(),
                },
            );
            assert!(!r.ok, "{vhost} {user}");
            assert!(r.message.contains("does not exist"), "{}", r.message);
        }
    }

    #[test]
    fn limits_are_set_listed_and_cleared_like_rabbitmqctl() {
        let broker = Broker::new(&Config::default(), 1, 1 << 30, 0);
        let r = reply(
            &broker,
            Request::SetLimits {
                scope: LimitScope::Vhost("/".into()),
                json: r#"{"max-connections": 10, "max-queues": -1}"#.into(),
            },
        );
        assert!(r.ok, "{}", r.message);
        assert_eq!(
            broker.snapshot().vhost_limit("/", "max-connections"),
            Some(10)
        );
        assert_eq!(
            broker.snapshot().vhost_limit("/", "max-queues"),
            None,
            "negative"
        );
        let listed = reply(
            &broker,
            Request::ListLimits {
                scope: None,
                users: false,
            },
        );
        assert_eq!(listed.columns, ["vhost", "limits"]);
        assert_eq!(
            listed.rows,
            [["/", r#"{"max-connections":10,"max-queues":-1}"#]]
        );
        for (json, why) in [
            (r#"{"max-channels": 1}"#, "Unrecognised terms"),
            (r#"{"max-queues": "x"}"#, "should be a number"),
            ("{", "JSON decoding error"),
        ] {
            let r = reply(
                &broker,
                Request::SetLimits {
                    scope: LimitScope::Vhost("/".into()),
                    json: json.into(),
                },
            );
            assert!(!r.ok && r.message.contains(why), "{json}: {}", r.message);
        }
        let user = || LimitScope::User("guest".into());
        for json in [r#"{"max-channels": 5}"#, r#"{"max-connections": 2}"#] {
            let r = reply(
                &broker,
                Request::SetLimits {
                    scope: user(),
                    json: json.into(),
                },
            );
            assert!(r.ok, "{}", r.message);
        }
        assert_eq!(
            broker.snapshot().user_limits["guest"].len(),
            2,
            "user limits merge"
        );
        let r = reply(
            &broker,
            Request::ClearLimits {
                scope: user(),
                name: Some("max-channels".into()),
            },
        );
        assert_eq!(
            r.message,
            "Clearing \"max-channels\" limit for user \"guest\" ..."
        );
        assert_eq!(broker.snapshot().user_limit("guest", "max-channels"), None);
        let r = reply(
            &broker,
            Request::ClearLimits {
                scope: LimitScope::Vhost("/".into()),
                name: None,
            },
        );
        assert!(r.ok);
        assert!(broker.snapshot().vhost_limits.is_empty());
        let r = reply(
            &broker,
            Request::SetLimits {
                scope: LimitScope::User("nobody".into()),
                json: "{}".into(),
            },
        );
        assert_eq!(r.message, "User \"nobody\" does not exist");
    }

    #[test]
    fn live_listings_show_what_sessions_registered() {
        let broker = Broker::new(&Config::default(), 1, 1 << 30, 0);
        broker
            .apply(
                &Command::AddVhost {
                    name: "other".into(),
                },
                Instant::from_millis(0),
            )
            .unwrap();
        let conn = broker.sessions().register(
            conn_info(5, 40001),
            ConnectionState::Running,
            std::sync::Weak::new(),
        );
        let ch = conn.open_channel(1);
        ch.set_prefetch(10);
        ch.set_unacked(2);
        ch.add_consumer(consumer_info("ctag", "q"));

        let r = reply(&broker, Request::ListConnections { columns: vec![] });
        assert!(r.ok, "{}", r.message);
        assert_eq!(r.columns, s(&["user", "peer_host", "peer_port", "state"]));
        assert_eq!(r.rows, vec![s(&["guest", "127.0.0.1", "40001", "running"])]);
        let r = reply(
            &broker,
            Request::ListConnections {
                columns: s(&["pid", "name", "channels", "protocol"]),
            },
        );
        assert_eq!(
            r.rows,
            vec![s(&[
                "<warren@test.5>",
                "127.0.0.1:40001 -> 127.0.0.1:5672",
                "1",
                "AMQP 0-9-1"
            ])]
        );

        let r = reply(&broker, Request::ListChannels { columns: vec![] });
        assert_eq!(
            r.columns,
            s(&["pid", "user", "consumer_count", "messages_unacknowledged"])
        );
        assert_eq!(r.rows, vec![s(&["<warren@test.5.1>", "guest", "1", "2"])]);
        let r = reply(
            &broker,
            Request::ListChannels {
                columns: s(&["connection", "number", "prefetch_count", "confirm"]),
            },
        );
        assert_eq!(r.rows, vec![s(&["<warren@test.5>", "1", "10", "false"])]);

        let r = reply(
            &broker,
            Request::ListConsumers {
                vhost: "/".into(),
                columns: vec![],
            },
        );
        assert_eq!(r.columns, s(CONSUMER_DEFAULTS));
        assert_eq!(
            r.rows,
            vec![s(&[
                "q",
                "<warren@test.5.1>",
                "ctag",
                "true",
                "10",
                "true",
                "{}"
            ])]
        );
        // Another vhost has none; an unknown one is refused; so is an unknown column.
        let r = reply(
            &broker,
            Request::ListConsumers {
                vhost: "other".into(),
                columns: vec![],
            },
        );
        assert!(r.ok && r.rows.is_empty());
        let r = reply(
            &broker,
            Request::ListConsumers {
                vhost: "nope".into(),
                columns: vec![],
            },
        );
        assert!(!r.ok && r.message.contains("nope"), "{}", r.message);
        for bad in [
            Request::ListConnections {
                columns: s(&["user", "bogus"]),
            },
            Request::ListChannels {
                columns: s(&["bogus"]),
            },
            Request::ListConsumers {
                vhost: "/".into(),
                columns: s(&["bogus"]),
            },
        ] {
            let r = reply(&broker, bad);
            assert!(!r.ok && r.message.contains("bogus"), "{}", r.message);
        }

        // Gone with their handles.
        drop(ch);
        let r = reply(&broker, Request::ListChannels { columns: vec![] });
        assert!(r.ok && r.rows.is_empty());
        drop(conn);
        let r = reply(&broker, Request::ListConnections { columns: vec![] });
        assert!(r.ok && r.rows.is_empty());
    }

    /// A broker of node 1 in a three-node metadata: queue `m` homed on node 2 with mirrors on
    /// nodes 3 (synchronised, older) and 1; queue `plain` unmirrored.
    fn mirrored_broker() -> Broker {
        let broker = Broker::new(&Config::default(), 1, 1 << 30, 0).with_node_id(1);
        let now = Instant::from_millis(0);
        let apply = |c: Command| {
            broker
                .apply(&c, now)
                .unwrap_or_else(|e| panic!("{c:?}: {e}"))
        };
        for (id, name) in [(1, "rabbit@n1"), (2, "rabbit@n2"), (3, "rabbit@n3")] {
            apply(Command::RegisterNode(crate::meta::NodeRecord {
                id,
                name: name.into(),
                amqp: String::new(),
                admin: String::new(),
                link: String::new(),
                incarnation: 0,
            }));
        }
        for name in ["m", "plain"] {
            apply(Command::DeclareQueue(QueueDef {
                vhost: "/".into(),
                name: name.into(),
                durable: true,
                exclusive_owner: None,
                auto_delete: false,
                arguments: FieldTable::default(),
                home: 2,
            }));
        }
        let mirror = |node, synchronised| crate::meta::state::MirrorRecord {
            node,
            since: 0,
            synchronised,
        };
        for (version, mirrors) in [
            (0, vec![mirror(3, false)]),
            (1, vec![mirror(1, false), mirror(3, true)]),
        ] {
            apply(Command::SetMirrors {
                vhost: "/".into(),
                queue: "m".into(),
                expected_version: version,
                mirrors,
            });
        }
        broker
    }

    #[test]
    fn list_queues_shows_master_and_mirrors_by_node_name() {
        let broker = mirrored_broker();
        let r = reply(
            &broker,
            Request::ListQueues {
                vhost: "/".into(),
                columns: s(&[
                    "name",
                    "pid",
                    "slave_pids",
                    "synchronised_slave_pids",
                    "mirror_pids",
                    "synchronised_mirror_pids",
                    "mirror_epoch",
                    "mirrors",
                ]),
            },
        );
        assert!(r.ok, "{}", r.message);
        assert_eq!(
            r.rows,
            vec![
                s(&[
                    "m",
                    "rabbit@n2",
                    "[rabbit@n3, rabbit@n1]",
                    "[rabbit@n3]",
                    "[rabbit@n3, rabbit@n1]",
                    "[rabbit@n3]",
                    "0",
                    "[rabbit@n3 synchronised, rabbit@n1 unsynchronised]",
                ]),
                s(&["plain", "rabbit@n2", "[]", "[]", "[]", "[]", "0", "[]"]),
            ]
        );
    }

    #[test]
    fn sync_queue_commits_only_for_a_mirrored_queue() {
        let broker = mirrored_broker();
        let requests = |b: &Broker| {
            let set = &b.snapshot().mirror_sets[&("/".to_string(), "m".to_string())];
            (set.sync_requests, set.cancel_requests)
        };
        let sync = |queue: &str, cancel| Request::SyncQueue {
            vhost: "/".into(),
            queue: queue.into(),
            cancel,
        };
        let r = reply(&broker, sync("m", false));
        assert!(r.ok, "{}", r.message);
        assert_eq!(requests(&broker), (1, 0));
        let r = reply(&broker, sync("m", true));
        assert!(r.ok, "{}", r.message);
        assert_eq!(requests(&broker), (1, 1));
        let version = broker.snapshot().version;
        for (q, why) in [
            ("plain", "queue 'plain' in vhost '/' is not mirrored"),
            ("nope", "no queue 'nope' in vhost '/'"),
        ] {
            let r = reply(&broker, sync(q, false));
            assert_eq!((r.ok, r.message.as_str()), (false, why));
        }
        assert_eq!(broker.snapshot().version, version, "nothing committed");
    }

    #[test]
    fn force_promote_mirror_commits_at_the_current_epoch_unless_the_master_lives() {
        use crate::gm::{MemberId, Slot};
        let broker = mirrored_broker();
        let promote = |node: Option<&str>| Request::ForcePromoteMirror {
            vhost: "/".into(),
            queue: "m".into(),
            node: node.map(str::to_string),
        };
        let member = |node| MemberId { node, since: 1 };
        broker
            .apply(
                &Command::GmGroup {
                    name: crate::mirror::message::group_name(
                        "/",
                        "m",
                        broker.snapshot().mirror_sets[&("/".to_string(), "m".to_string())]
                            .incarnation,
                    ),
                    expected_version: 0,
                    members: vec![Slot::Alive(member(2)), Slot::Alive(member(3))],
                },
                Instant::from_millis(0),
            )
            .unwrap();
        let version = broker.snapshot().version;
        let r = reply(&broker, promote(None));
        assert!(!r.ok && r.message.contains("two masters"), "{}", r.message);
        assert_eq!(broker.snapshot().version, version, "nothing committed");
        // Node 2 is recorded down: its member dies; its durable queues stay.
        broker
            .apply(&Command::NodeDown { id: 2 }, Instant::from_millis(0))
            .unwrap();
        let r = reply(&broker, promote(Some("rabbit@n2")));
        assert!(
            !r.ok && r.message.contains("holds no mirror"),
            "{}",
            r.message
        );
        let r = reply(&broker, promote(Some("rabbit@n3")));
        assert!(r.ok, "{}", r.message);
        let snap = broker.snapshot();
        assert_eq!(snap.vhost("/").unwrap().queues["m"].home, 3);
        let set = &snap.mirror_sets[&("/".to_string(), "m".to_string())];
        assert_eq!(set.epoch, 1);
        assert_eq!(set.mirrors.iter().map(|m| m.node).collect::<Vec<_>>(), [1]);
    }

    #[test]
    fn only_the_single_active_consumer_is_active() {
        let broker = Broker::new(&Config::default(), 1, 1 << 30, 0);
        let mut args = FieldTable::default();
        args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        broker
            .apply(
                &Command::DeclareQueue(QueueDef {
                    vhost: "/".into(),
                    name: "sac".into(),
                    durable: false,
                    exclusive_owner: None,
                    auto_delete: false,
                    arguments: args,
                    home: 0,
                }),
                Instant::from_millis(0),
            )
            .unwrap();
        let h = broker.queue("/", "sac").unwrap();
        let conn = broker.sessions().register(
            conn_info(9, 40002),
            ConnectionState::Running,
            std::sync::Weak::new(),
        );
        let mut chans = Vec::new();
        for (number, tag) in [(1u16, "first"), (2, "second")] {
            let outbox = Arc::new(Outbox::new(1 << 20, Box::new(|| {})));
            let consumer = Consumer {
                tag: Arc::from(tag),
                link: Arc::new(ChannelLink::new(9, number, outbox)),
                no_ack: false,
                prefetch: 0,
                priority: 0,
                exclusive: false,
                in_flight: Arc::new(AtomicU32::new(0)),
            };
            h.lock().add_consumer(&h, consumer, Instant::from_millis(0));
            let ch = conn.open_channel(number);
            ch.add_consumer(consumer_info(tag, "sac"));
            chans.push(ch);
        }
        let r = reply(
            &broker,
            Request::ListConsumers {
                vhost: "/".into(),
                columns: s(&["consumer_tag", "active", "activity_status"]),
            },
        );
        assert_eq!(
            r.rows,
            vec![
                s(&["first", "true", "single_active"]),
                s(&["second", "false", "waiting"])
            ]
        );
    }
}
