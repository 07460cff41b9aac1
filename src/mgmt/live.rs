//! The live objects of this node: `/api/connections`, `/api/channels`, `/api/consumers`
//! (and their per-vhost and per-name forms), from the session registry, with RabbitMQ
//! 3.10's field names (read off a live 3.10.8 node) for the fields Warren has. A user sees
//! its own connections and their channels unless it is `monitoring` (or `administrator`),
//! as in RabbitMQ; consumers are listed per vhost for users with access to it.
//!
//! Any node answers for the whole cluster: the driver asks the other running nodes for their
//! sessions first ([`super::NodeSessions`]); a node that does not answer in time is left out.

use serde_json::{json, Value};

use super::convert::table_json;
use super::{Caller, Context, Handled, Request, Response};
use crate::admin::consumer_activity;
use crate::broker::registry::{ChannelView, ConnectionView, ConsumerInfo};
use crate::meta::{MetaState, NodeId};

/// A connection and the node it is on (`None`: this one).
struct Live<'a> {
    node: &'a str,
    node_id: Option<NodeId>,
    view: ConnectionView,
}

/// Every connection of the cluster: this node's, then the other nodes' as they answered.
fn cluster_connections<'a>(ctx: &Context<'a>) -> Vec<Live<'a>> {
    let mut all: Vec<Live<'a>> = ctx
        .broker
        .sessions()
        .connections()
        .into_iter()
        .map(|view| Live {
            node: &ctx.node.name,
            node_id: None,
            view,
        })
        .collect();
    for n in ctx.remote_sessions {
        all.extend(n.connections.iter().cloned().map(|view| Live {
            node: &n.name,
            node_id: Some(n.id),
            view,
        }));
    }
    all
}

/// The connections `caller` may see, of `vhost` when given.
fn visible<'a>(ctx: &Context<'a>, caller: &Caller, vhost: Option<&str>) -> Vec<Live<'a>> {
    cluster_connections(ctx)
        .into_iter()
        .filter(|c| caller.tags.monitoring || c.view.info.user == caller.user.name)
        .filter(|c| vhost.is_none_or(|v| c.view.info.vhost == v))
        .collect()
}

fn connection_json(node: &str, c: &ConnectionView) -> Value {
    let i = &c.info;
    let mut out = json!({
        "name": i.name(),
        "node": node,
        "user": i.user,
        "user_who_performed_action": i.user,
        "vhost": i.vhost,
        "peer_host": i.peer_host,
        "peer_port": i.peer_port,
        "host": i.host,
        "port": i.port,
        "state": c.state.name(),
        "channels": c.channels.len(),
        "protocol": "AMQP 0-9-1",
        "type": "network",
        "ssl": i.ssl.is_some(),
        "ssl_protocol": i.ssl.as_ref().map(|s| s.protocol.as_str()),
        "ssl_cipher": i.ssl.as_ref().map(|s| s.cipher.as_str()),
        "ssl_key_exchange": i.ssl.as_ref().map(|s| s.key_exchange.as_str()),
        "ssl_hash": i.ssl.as_ref().map(|s| s.hash.as_str()),
        "peer_cert_subject": i.ssl.as_ref().and_then(|s| s.peer_cert_subject.as_deref()),
        "peer_cert_issuer": i.ssl.as_ref().and_then(|s| s.peer_cert_issuer.as_deref()),
        "peer_cert_validity": i.ssl.as_ref().and_then(|s| s.peer_cert_validity.as_deref()),
        "auth_mechanism": i.auth_mechanism,
        "timeout": i.timeout_s,
        "frame_max": i.frame_max,
        "channel_max": i.channel_max,
        "client_properties": table_json(&i.client_properties),
        "connected_at": i.connected_at,
        "recv_oct": c.socket.recv_oct,
        "recv_cnt": c.socket.recv_cnt,
        "send_oct": c.socket.send_oct,
        "send_cnt": c.socket.send_cnt,
    });
    // The name the client gave itself, as RabbitMQ shows it.
    if let Some(name) = i.client_properties.inner().get("connection_name") {
        if let Some(name) = crate::meta::args::string(name) {
            out["user_provided_name"] = json!(name);
        }
    }
    out
}

fn channel_name(c: &ConnectionView, ch: &ChannelView) -> String {
    format!("{} ({})", c.info.name(), ch.number)
}

fn channel_json(node: &str, c: &ConnectionView, ch: &ChannelView) -> Value {
    let i = &c.info;
    json!({
        "name": channel_name(c, ch),
        "node": node,
        "number": ch.number,
        "user": i.user,
        "user_who_performed_action": i.user,
        "vhost": i.vhost,
        "state": "running",
        "connection_details": {
            "name": i.name(),
            "peer_host": i.peer_host,
            "peer_port": i.peer_port,
        },
        "consumer_count": ch.consumers.len(),
        "prefetch_count": ch.prefetch,
        "global_prefetch_count": ch.global_prefetch,
        "messages_unacknowledged": ch.unacked,
        "messages_unconfirmed": ch.unconfirmed,
        "messages_uncommitted": 0,
        "acks_uncommitted": 0,
        "transactional": ch.transactional,
        "confirm": ch.confirm,
    })
}

/// `/api/connections`, `/api/vhosts/{vhost}/connections`, `/api/connections/{name}`.
pub fn connections(
    ctx: &Context<'_>,
    caller: &Caller,
    vhost: Option<&str>,
    one: Option<&str>,
) -> Response {
    let conns = visible(ctx, caller, vhost);
    match one {
        None => Response::ok(Value::Array(
            conns
                .iter()
                .map(|c| connection_json(c.node, &c.view))
                .collect(),
        )),
        Some(name) => conns
            .iter()
            .find(|c| c.view.info.name() == name)
            .map_or_else(Response::not_found, |c| {
                Response::ok(connection_json(c.node, &c.view))
            }),
    }
}

/// `DELETE /api/connections/{name}`: the connection's user or an administrator closes it
/// with 320 `CONNECTION_FORCED` and the `X-Reason` header's text (RabbitMQ's default:
/// "Closed via management plugin").
pub fn close(ctx: &Context<'_>, caller: &Caller, req: &Request, name: &str) -> Handled {
    let Some(c) = visible(ctx, caller, None)
        .into_iter()
        .find(|c| c.view.info.name() == name)
    else {
        return Handled::Reply(Response::not_found());
    };
    if !caller.tags.administrator && c.view.info.user != caller.user.name {
        return Handled::Reply(Response::not_authorised(
            "User not authorised to access object",
        ));
    }
    Handled::CloseConnection {
        node: c.node_id,
        id: c.view.info.id,
        reason: req
            .x_reason
            .clone()
            .unwrap_or_else(|| "Closed via management plugin".to_string()),
    }
}

/// `/api/channels`, `/api/vhosts/{vhost}/channels`, `/api/connections/{name}/channels`,
/// `/api/channels/{name}`.
pub fn channels(
    ctx: &Context<'_>,
    caller: &Caller,
    vhost: Option<&str>,
    connection: Option<&str>,
    one: Option<&str>,
) -> Response {
    let conns = visible(ctx, caller, vhost);
    if let Some(name) = connection {
        if !conns.iter().any(|c| c.view.info.name() == name) {
            return Response::not_found();
        }
    }
    let all: Vec<(&Live<'_>, &ChannelView)> = conns
        .iter()
        .filter(|c| connection.is_none_or(|n| c.view.info.name() == n))
        .flat_map(|c| c.view.channels.iter().map(move |ch| (c, ch)))
        .collect();
    match one {
        None => Response::ok(Value::Array(
            all.iter()
                .map(|(c, ch)| channel_json(c.node, &c.view, ch))
                .collect(),
        )),
        Some(name) => all
            .iter()
            .find(|(c, ch)| channel_name(&c.view, ch) == name)
            .map_or_else(Response::not_found, |(c, ch)| {
                // The channel's own object carries its consumers; listings do not.
                let mut one = channel_json(c.node, &c.view, ch);
                one["consumer_details"] = Value::Array(
                    ch.consumers
                        .iter()
                        .map(|k| consumer_json(ctx, c, ch, k))
                        .collect(),
                );
                Response::ok(one)
            }),
    }
}

/// `/api/consumers` and `/api/consumers/{vhost}`.
pub fn consumers(
    ctx: &Context<'_>,
    meta: &MetaState,
    caller: &Caller,
    vhost: Option<&str>,
) -> Response {
    let mut out = Vec::new();
    for live in cluster_connections(ctx) {
        let i = &live.view.info;
        if vhost.is_some_and(|v| v != i.vhost) || !caller.sees_vhost(meta, &i.vhost) {
            continue;
        }
        for ch in &live.view.channels {
            out.extend(
                ch.consumers
                    .iter()
                    .map(|k| consumer_json(ctx, &live, ch, k)),
            );
        }
    }
    Response::ok(Value::Array(out))
}

/// A queue's `consumer_details`, on `GET /api/queues/{vhost}/{name}`: its consumers on
/// every node that answered, each as `/api/consumers` shows it.
pub fn queue_consumers(ctx: &Context<'_>, vhost: &str, queue: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for live in cluster_connections(ctx) {
        if live.view.info.vhost != vhost {
            continue;
        }
        for ch in &live.view.channels {
            out.extend(
                ch.consumers
                    .iter()
                    .filter(|k| k.queue == queue)
                    .map(|k| consumer_json(ctx, &live, ch, k)),
            );
        }
    }
    out
}

/// One consumer as RabbitMQ 3.10 shows it in `/api/consumers` and in a channel's or a
/// queue's `consumer_details`.
fn consumer_json(ctx: &Context<'_>, live: &Live<'_>, ch: &ChannelView, k: &ConsumerInfo) -> Value {
    let c = &live.view;
    let i = &c.info;
    let (active, status) = consumer_activity(ctx.broker, &i.vhost, i.id, ch.number, k);
    json!({
        "consumer_tag": k.tag,
        "queue": {"name": k.queue, "vhost": i.vhost},
        "channel_details": {
            "connection_name": i.name(),
            "name": channel_name(c, ch),
            "node": live.node,
            "number": ch.number,
            "peer_host": i.peer_host,
            "peer_port": i.peer_port,
            "user": i.user,
        },
        "ack_required": k.ack_required,
        "prefetch_count": k.prefetch,
        "exclusive": k.exclusive,
        "arguments": table_json(&k.arguments),
        "active": active,
        "activity_status": status,
    })
}
