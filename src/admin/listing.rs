//! The listings (`list_*`, `cluster_status`) with `rabbitmqctl`'s columns and defaults.
//! Definitions come from the metadata snapshot; what is live (connections, channels,
//! consumers) from the registry the sessions publish to, [`Broker::sessions`], so those
//! listings show the node the endpoint belongs to.

use std::collections::BTreeMap;

use amq_protocol::types::{AMQPValue, FieldTable};

use super::json;
use super::mirrors;
use super::queue_info::QueueInfo;
use super::requests::{NodeInfo, RemoteCounts, Request, Response};
use crate::broker::registry::{ChannelView, ConnectionView, ConsumerInfo};
use crate::broker::Broker;
use crate::meta::limits::{self, LimitScope};
use crate::meta::policy::ApplyTo;

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
    "messages_ready_ram",
    "messages_unacknowledged_ram",
    "messages_persistent",
    "messages_paged_out",
    "message_bytes",
    "message_bytes_ready",
    "message_bytes_unacknowledged",
    "message_bytes_ram",
    "message_bytes_persistent",
    "message_bytes_paged_out",
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
    "exclusive_consumer_tag",
    "single_active_consumer_tag",
    "head_message_timestamp",
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
    "connected_at",
    "recv_oct",
    "recv_cnt",
    "send_oct",
    "send_cnt",
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
pub(super) const CONSUMER_DEFAULTS: &[&str] = &[
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
        ("connected_at", i.connected_at.to_string()),
        ("recv_oct", c.socket.recv_oct.to_string()),
        ("recv_cnt", c.socket.recv_cnt.to_string()),
        ("send_oct", c.socket.send_oct.to_string()),
        ("send_cnt", c.socket.send_cnt.to_string()),
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
pub(super) fn missing_owner(meta: &crate::meta::MetaState, scope: &LimitScope) -> Option<Response> {
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

/// One queue's row of `list_queues`.
fn queue_row(info: &QueueInfo<'_>) -> BTreeMap<&'static str, String> {
    let f = &info.figures;
    let q = info.def;
    let eff = &info.policy;
    let m = mirrors::columns_of(info.mirrors.as_ref());
    BTreeMap::from([
        ("name", q.name.clone()),
        ("messages", f.messages().to_string()),
        ("messages_ready", f.ready.to_string()),
        ("messages_unacknowledged", f.unacked.to_string()),
        ("messages_ram", f.ram().to_string()),
        ("messages_ready_ram", f.ready_ram.to_string()),
        ("messages_unacknowledged_ram", f.unacked_ram.to_string()),
        ("messages_persistent", f.persistent.to_string()),
        ("messages_paged_out", f.paged_out.to_string()),
        ("message_bytes", f.bytes().to_string()),
        ("message_bytes_ready", f.ready_bytes.to_string()),
        ("message_bytes_unacknowledged", f.unacked_bytes.to_string()),
        ("message_bytes_ram", f.ram_bytes.to_string()),
        ("message_bytes_persistent", f.persistent_bytes.to_string()),
        ("message_bytes_paged_out", f.paged_out_bytes.to_string()),
        ("consumers", f.consumers.to_string()),
        // The node the queue runs on (RabbitMQ prints the queue process's pid,
        // whose node part this is).
        ("pid", info.node.to_string()),
        ("node", info.node.to_string()),
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
        // As rabbitmqctl: empty when there is none.
        (
            "exclusive_consumer_tag",
            f.exclusive_consumer_tag.clone().unwrap_or_default(),
        ),
        (
            "single_active_consumer_tag",
            f.single_active_consumer_tag.clone().unwrap_or_default(),
        ),
        (
            "head_message_timestamp",
            f.head_message_timestamp
                .map_or_else(String::new, |t| t.to_string()),
        ),
    ])
}

/// Answers a listing request (the planner sends only those here).
pub(super) fn answer(
    broker: &Broker,
    node: &NodeInfo,
    request: &Request,
    remote_counts: &RemoteCounts,
) -> Response {
    let meta = broker.snapshot();
    match request {
        Request::ListQueues { vhost, columns } => {
            let Some(v) = meta.vhost(vhost) else {
                return Response::refused(format!("no vhost '{vhost}'"));
            };
            let rows = QueueInfo::all_of(broker, node, &meta, v, remote_counts)
                .iter()
                .map(queue_row)
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
        Request::ClusterStatus => Response::table(
            cols(&["node", "running", "disc"]),
            vec![vec![node.name.clone(), "true".into(), "true".into()]],
        ),
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
        _ => Response::refused("not a listing"),
    }
}
