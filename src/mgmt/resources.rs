//! The endpoints: one function per resource, each checking the caller's tags and vhost
//! access as RabbitMQ 3.10 does. Listings go through the admin protocol's handler
//! ([`crate::admin::plan_with_counts`]), except the queues', written as JSON text from their
//! typed rows ([`crate::admin::queue_info::QueueInfo`], [`super::queue_object`]); simple
//! changes too (vhosts, permissions, policies), so their checks are `warrenctl`'s.

use serde_json::{json, Map, Value};

use super::bindings::{self, Filter};
use super::convert::{self, Kind};
use super::listeners::{contexts_json, listener_json};
use super::live;
use super::query::{write_shaped, ListQuery};
use super::queue_object::QueueObject;
use super::{Caller, Context, Handled, Method, Request, Response};
use crate::admin::queue_info::QueueInfo;
use crate::admin::{self, Request as AdminRequest, Response as AdminResponse};
use crate::broker::node_stats::{ClusterLink, ListenerInfo};
use crate::meta::limits::LimitScope;
use crate::meta::state::{
    ExchangeDef, ExchangeKind, Hashing, Permission, QueueDef, User, VhostMetadata,
};
use crate::meta::{Command, MetaState};
use crate::session::permissions::{Access, Permissions};

pub(super) fn reply(r: Response) -> Handled {
    Handled::Reply(r)
}

pub(super) fn commit(commands: Vec<Command>, ok: Response) -> Handled {
    Handled::Commit { commands, ok }
}

/// 201 when the PUT creates, 204 when it updates (RabbitMQ's codes).
fn put_status(existed: bool) -> Response {
    Response::empty(if existed { 204 } else { 201 })
}

fn method_not_allowed() -> Handled {
    reply(Response::empty(405))
}

/// Asks the admin handler for a listing; a refusal (an unknown vhost) is a 404.
pub(super) fn admin_table(
    ctx: &Context<'_>,
    request: &AdminRequest,
) -> Result<AdminResponse, Response> {
    let vhost = match request {
        AdminRequest::ListQueues { vhost, .. } => vhost.clone(),
        _ => String::new(),
    };
    let empty = admin::RemoteCounts::new();
    let counts = ctx.remote_counts.get(&vhost).unwrap_or(&empty);
    match admin::plan_with_counts(ctx.broker, ctx.node, request, counts) {
        admin::Handled::Reply(r) if r.ok => Ok(r),
        _ => Err(Response::not_found()),
    }
}

/// An admin change: committed as the admin handler plans it; its refusal is a 400.
fn admin_change(ctx: &Context<'_>, request: &AdminRequest, ok: Response) -> Handled {
    match admin_command(ctx, request) {
        Ok(command) => commit(vec![command], ok),
        Err(r) => reply(r),
    }
}

/// The command the admin handler plans for `request`; its refusal as a 400.
fn admin_command(ctx: &Context<'_>, request: &AdminRequest) -> Result<Command, Response> {
    match admin::plan(ctx.broker, ctx.node, request) {
        admin::Handled::Commit { command, .. } => Ok(command),
        admin::Handled::Reply(r) => Err(Response::bad_request(r.message)),
    }
}

pub(super) fn body_object(req: &Request) -> Result<Map<String, Value>, Response> {
    if req.body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(&req.body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(Response::bad_request("the body must be a JSON object")),
        Err(e) => Err(Response::bad_request(format!("invalid JSON: {e}"))),
    }
}

fn bool_field(body: &Map<String, Value>, key: &str, default: bool) -> Result<bool, Response> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(Value::String(s)) if s == "true" || s == "false" => Ok(s == "true"),
        Some(_) => Err(Response::bad_request(format!("{key} must be a boolean"))),
    }
}

pub(super) fn str_field(body: &Map<String, Value>, key: &str) -> Result<Option<String>, Response> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(Response::bad_request(format!("{key} must be a string"))),
    }
}

/// Routes `segments` (the decoded path after `/api/`).
pub fn route(
    ctx: &Context<'_>,
    meta: &MetaState,
    caller: &Caller,
    req: &Request,
    segments: &[&str],
) -> Handled {
    let m = req.method;
    let r = match segments {
        ["overview"] => only_get(m, || overview(ctx, meta, caller)),
        ["whoami"] => only_get(m, || whoami(caller)),
        ["nodes"] => only_get(m, || nodes(ctx, meta, caller, None)),
        ["nodes", name] => only_get(m, || nodes(ctx, meta, caller, Some(name))),
        ["vhosts"] => only_get(m, || vhosts(ctx, meta, caller, None)),
        ["vhosts", vhost] => return vhost_one(ctx, meta, caller, req, vhost),
        ["users"] => only_get(m, || users(meta, caller, None)),
        ["users", "without-permissions"] => only_get(m, || users_without_permissions(meta, caller)),
        ["users", name] => return user_one(ctx.broker.new_salt(), meta, caller, req, name),
        ["users", name, "permissions"] => only_get(m, || {
            permissions(ctx, meta, caller, None, Some(name), false)
        }),
        ["vhosts", vhost, "permissions"] => only_get(m, || {
            permissions(ctx, meta, caller, Some(vhost), None, false)
        }),
        // Warren has no topic permissions: none to list.
        ["topic-permissions"] => only_get(m, || admin_only(caller, || json!([]))),
        ["permissions"] => only_get(m, || permissions(ctx, meta, caller, None, None, false)),
        ["permissions", vhost, user] => return permission_one(ctx, meta, caller, req, vhost, user),
        ["exchanges"] => only_get(m, || exchanges(ctx, meta, caller, None, None)),
        ["exchanges", vhost] => only_get(m, || exchanges(ctx, meta, caller, Some(vhost), None)),
        ["exchanges", vhost, name] => {
            let name = if *name == "amq.default" { "" } else { name };
            return match m {
                Method::Get => reply(exchanges(ctx, meta, caller, Some(vhost), Some(name))),
                Method::Put | Method::Delete => exchange_change(meta, caller, req, vhost, name),
                _ => method_not_allowed(),
            };
        }
        ["queues"] => only_get(m, || queues(ctx, meta, caller, req, None, None)),
        ["queues", vhost] => only_get(m, || queues(ctx, meta, caller, req, Some(vhost), None)),
        ["queues", vhost, name] => {
            return match m {
                Method::Get => reply(queues(ctx, meta, caller, req, Some(vhost), Some(name))),
                Method::Put | Method::Delete => queue_change(meta, caller, req, vhost, name),
                _ => method_not_allowed(),
            }
        }
        ["queues", vhost, name, "get"] => {
            return match m {
                Method::Post => direct_on_queue(meta, caller, req, vhost, name, |q| {
                    super::direct::parse_get(q, &req.body)
                }),
                _ => method_not_allowed(),
            }
        }
        ["queues", vhost, name, "contents"] => {
            return match m {
                Method::Delete => direct_on_queue(meta, caller, req, vhost, name, |q| {
                    Ok(super::direct::DirectOp::Purge {
                        queue: q.to_string(),
                    })
                }),
                _ => method_not_allowed(),
            }
        }
        ["exchanges", vhost, name, "publish"] => {
            let name = if *name == "amq.default" { "" } else { name };
            return match m {
                Method::Post => {
                    let exists = meta
                        .vhost(vhost)
                        .is_some_and(|v| v.exchanges.contains_key(name));
                    direct(meta, caller, req, vhost, exists, || {
                        super::direct::parse_publish(name, &req.body)
                    })
                }
                _ => method_not_allowed(),
            };
        }
        ["aliveness-test", vhost] => {
            return match m {
                Method::Get => direct(meta, caller, req, vhost, true, || {
                    Ok(super::direct::DirectOp::Aliveness)
                }),
                _ => method_not_allowed(),
            }
        }
        ["queues", vhost, name, "actions"] => {
            return match m {
                Method::Post => queue_action(meta, caller, req, vhost, name),
                _ => method_not_allowed(),
            }
        }
        ["bindings"] => only_get(m, || bindings::list(ctx, meta, caller, None, Filter::All)),
        ["bindings", vhost] => only_get(m, || {
            bindings::list(ctx, meta, caller, Some(vhost), Filter::All)
        }),
        ["bindings", vhost, "e", src, kind @ ("q" | "e"), dst] => {
            let src = if *src == "amq.default" { "" } else { src };
            let dst = bindings::destination(kind, dst);
            return match m {
                Method::Get => reply(bindings::list(
                    ctx,
                    meta,
                    caller,
                    Some(vhost),
                    Filter::Between(src, &dst),
                )),
                Method::Post => bindings::add(meta, caller, req, vhost, src, &dst),
                _ => method_not_allowed(),
            };
        }
        ["bindings", vhost, "e", src, kind @ ("q" | "e"), dst, props] => {
            let src = if *src == "amq.default" { "" } else { src };
            let dst = bindings::destination(kind, dst);
            return bindings::one(meta, caller, m, vhost, src, &dst, props);
        }
        ["exchanges", vhost, name, "bindings", side @ ("source" | "destination")] => {
            let name = if *name == "amq.default" { "" } else { name };
            let filter = if *side == "source" {
                Filter::Source(name)
            } else {
                Filter::ToExchange(name)
            };
            only_get(m, || bindings::list(ctx, meta, caller, Some(vhost), filter))
        }
        ["queues", vhost, name, "bindings"] => only_get(m, || {
            bindings::list(ctx, meta, caller, Some(vhost), Filter::ToQueue(name))
        }),
        [kind @ ("policies" | "operator-policies"), rest @ ..] => {
            let operator = *kind == "operator-policies";
            return match rest {
                [] => reply(only_get(m, || {
                    policies(ctx, meta, caller, None, None, operator)
                })),
                [vhost] => reply(only_get(m, || {
                    policies(ctx, meta, caller, Some(vhost), None, operator)
                })),
                [vhost, name] => match m {
                    Method::Get => reply(policies(
                        ctx,
                        meta,
                        caller,
                        Some(vhost),
                        Some(name),
                        operator,
                    )),
                    Method::Put | Method::Delete => {
                        policy_change(ctx, meta, caller, req, vhost, name, operator)
                    }
                    _ => method_not_allowed(),
                },
                _ => reply(Response::not_found()),
            };
        }
        ["connections"] => only_get(m, || live::connections(ctx, caller, None, None)),
        ["connections", name] => {
            return match m {
                Method::Get => reply(live::connections(ctx, caller, None, Some(name))),
                Method::Delete => live::close(ctx, caller, req, name),
                _ => method_not_allowed(),
            }
        }
        ["connections", name, "channels"] => {
            only_get(m, || live::channels(ctx, caller, None, Some(name), None))
        }
        ["vhosts", vhost, "connections"] => only_get(m, || {
            in_vhost(meta, caller, vhost, || {
                live::connections(ctx, caller, Some(vhost), None)
            })
        }),
        ["channels"] => only_get(m, || live::channels(ctx, caller, None, None, None)),
        ["channels", name] => only_get(m, || live::channels(ctx, caller, None, None, Some(name))),
        ["vhosts", vhost, "channels"] => only_get(m, || {
            in_vhost(meta, caller, vhost, || {
                live::channels(ctx, caller, Some(vhost), None, None)
            })
        }),
        ["consumers"] => only_get(m, || live::consumers(ctx, meta, caller, None)),
        ["consumers", vhost] => only_get(m, || {
            in_vhost(meta, caller, vhost, || {
                live::consumers(ctx, meta, caller, Some(vhost))
            })
        }),
        ["health", "checks", check @ ..] => only_get(m, || {
            super::health::check(ctx, meta, check).unwrap_or_else(Response::not_found)
        }),
        ["definitions"] => {
            return match m {
                _ if !caller.tags.administrator => reply(not_administrator()),
                Method::Get => reply(Response::ok(super::definitions::export(meta))),
                Method::Post => super::definitions::import(ctx, req),
                _ => method_not_allowed(),
            }
        }
        ["definitions", vhost] => {
            return match m {
                _ if !caller.tags.administrator => reply(not_administrator()),
                Method::Get => reply(super::definitions::get_vhost(meta, vhost)),
                Method::Post => super::definitions::import_vhost(ctx, req, vhost),
                _ => method_not_allowed(),
            }
        }
        ["cluster-name"] => only_get(m, || Response::ok(json!({"name": ctx.node.name}))),
        // The console needs no plugin extensions.
        ["extensions"] => only_get(m, || Response::ok(json!([]))),
        ["parameters", rest @ ..] => only_get(m, || super::parameters::list(meta, caller, rest)),
        ["global-parameters"] => only_get(m, || super::parameters::global(caller)),
        ["vhost-limits"] => only_get(m, || super::parameters::vhost_limits(meta, caller, None)),
        ["vhost-limits", vhost] => only_get(m, || {
            super::parameters::vhost_limits(meta, caller, Some(vhost))
        }),
        ["vhost-limits", vhost, name] => {
            let scope = LimitScope::Vhost(vhost.to_string());
            return super::parameters::change(meta, caller, req, scope, name);
        }
        ["user-limits"] => only_get(m, || super::parameters::user_limits(meta, None)),
        ["user-limits", user] => only_get(m, || super::parameters::user_limits(meta, Some(user))),
        ["user-limits", user, name] => {
            let scope = LimitScope::User(user.to_string());
            return super::parameters::change(meta, caller, req, scope, name);
        }
        _ => Response::not_found(),
    };
    reply(r)
}

/// Work done over an AMQP channel in `vhost` as the caller: 404 for a missing vhost (or
/// object: `exists`), 401 without access to the vhost (`is_authorized_vhost`), 400 for a
/// bad body; permissions on the objects are the channel's to check.
fn direct(
    meta: &MetaState,
    caller: &Caller,
    req: &Request,
    vhost: &str,
    exists: bool,
    op: impl FnOnce() -> Result<super::direct::DirectOp, Response>,
) -> Handled {
    if meta.vhost(vhost).is_none() || !exists {
        return reply(Response::not_found());
    }
    if !caller.can_access(meta, vhost) {
        return reply(vhost_refused());
    }
    let Some((user, password)) = super::credentials(req) else {
        return reply(Response::not_authorised("Login failed"));
    };
    match op() {
        Ok(op) => Handled::Direct(Box::new(super::direct::Direct {
            vhost: vhost.to_string(),
            user,
            password,
            op,
        })),
        Err(r) => reply(r),
    }
}

fn direct_on_queue(
    meta: &MetaState,
    caller: &Caller,
    req: &Request,
    vhost: &str,
    queue: &str,
    op: impl FnOnce(&str) -> Result<super::direct::DirectOp, Response>,
) -> Handled {
    let exists = meta
        .vhost(vhost)
        .is_some_and(|v| v.queues.contains_key(queue));
    direct(meta, caller, req, vhost, exists, || op(queue))
}

/// `f`'s answer when `vhost` exists and `caller` may see it: 404 for a missing vhost,
/// 401 for one it may not see.
fn in_vhost(
    meta: &MetaState,
    caller: &Caller,
    vhost: &str,
    f: impl FnOnce() -> Response,
) -> Response {
    if meta.vhost(vhost).is_none() {
        return Response::not_found();
    }
    if !caller.sees_vhost(meta, vhost) {
        return vhost_refused();
    }
    f()
}

fn only_get(m: Method, f: impl FnOnce() -> Response) -> Response {
    if m == Method::Get {
        f()
    } else {
        Response::empty(405)
    }
}

/// `f`'s answer for administrators, 401 "Not administrator user" for others.
fn admin_only(caller: &Caller, f: impl FnOnce() -> Value) -> Response {
    if caller.tags.administrator {
        Response::ok(f())
    } else {
        not_administrator()
    }
}

fn not_administrator() -> Response {
    Response::not_authorised("Not administrator user")
}

pub(super) fn vhost_refused() -> Response {
    Response::not_authorised("User not authorised to access virtual host")
}

/// The vhosts a listing covers: `one` (404 when missing, 401 when not visible), or every
/// vhost the caller sees.
pub(super) fn listed_vhosts(
    meta: &MetaState,
    caller: &Caller,
    one: Option<&str>,
) -> Result<Vec<String>, Response> {
    match one {
        Some(v) if meta.vhost(v).is_none() => Err(Response::not_found()),
        Some(v) if !caller.sees_vhost(meta, v) => Err(vhost_refused()),
        Some(v) => Ok(vec![v.to_string()]),
        None => Ok(meta
            .vhosts
            .keys()
            .filter(|v| caller.sees_vhost(meta, v))
            .cloned()
            .collect()),
    }
}

/// A change in `vhost` needs the vhost (404) and access to it (401).
pub(super) fn writable_vhost(
    meta: &MetaState,
    caller: &Caller,
    vhost: &str,
) -> Result<(), Response> {
    if meta.vhost(vhost).is_none() {
        return Err(Response::not_found());
    }
    if !caller.can_access(meta, vhost) {
        return Err(vhost_refused());
    }
    Ok(())
}

pub(super) fn check_permission(
    meta: &MetaState,
    caller: &Caller,
    vhost: &str,
    access: Access,
    kind: &str,
    name: &str,
) -> Result<(), Response> {
    let p = meta
        .permissions
        .get(&(caller.user.name.clone(), vhost.to_string()));
    Permissions::new(&caller.user.name, vhost, p)
        .check(access, kind, name)
        .map_err(|e| Response::not_authorised(e.text))
}

fn one_or_list(items: Vec<Value>, single: bool) -> Response {
    if single {
        match items.into_iter().next() {
            Some(v) => Response::ok(v),
            None => Response::not_found(),
        }
    } else {
        Response::ok(Value::Array(items))
    }
}

fn overview(ctx: &Context<'_>, meta: &MetaState, caller: &Caller) -> Response {
    let vhosts: Vec<String> = match listed_vhosts(meta, caller, None) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let (mut queues, mut exchanges, mut ready, mut unacked, mut consumers) = (0, 0, 0, 0, 0);
    for v in &vhosts {
        let t = vhost_totals(ctx, v);
        queues += t.queues;
        ready += t.ready;
        unacked += t.unacked;
        consumers += t.consumers;
        exchanges += meta.vhost(v).map_or(0, |x| x.exchanges.len() as u64);
    }
    let conns = ctx.broker.sessions().connections();
    let channels: usize = conns.iter().map(|c| c.channels.len()).sum();
    // As RabbitMQ, every node's: this one's as it knows them, the others' as they answered.
    let mut by_node: Vec<(&str, &[ListenerInfo])> = vec![(&ctx.node.name, ctx.listeners)];
    for (name, stats) in ctx.node_stats {
        if *name != ctx.node.name {
            by_node.push((name, &stats.listeners));
        }
    }
    let mut listeners = Vec::new();
    let mut contexts = Vec::new();
    for (node, list) in by_node {
        listeners.extend(list.iter().map(|l| listener_json(node, l)));
        contexts.extend(contexts_json(node, list));
    }
    Response::ok(json!({
        "management_version": env!("CARGO_PKG_VERSION"),
        "rabbitmq_version": "3.10.8",
        "product_name": "Warren",
        "product_version": env!("CARGO_PKG_VERSION"),
        "cluster_name": ctx.node.name,
        "node": ctx.node.name,
        "object_totals": {
            "connections": conns.len(),
            "channels": channels,
            "exchanges": exchanges,
            "queues": queues,
            "consumers": consumers,
        },
        "queue_totals": {
            "messages": ready + unacked,
            "messages_ready": ready,
            "messages_unacknowledged": unacked,
        },
        "message_stats": message_stats(ctx.broker.metrics()),
        "exchange_types": exchange_types(),
        "listeners": listeners,
        "contexts": contexts,
        // No statistics database: no rates.
        "rates_mode": "none",
    }))
}

/// A vhost's queue counts (other nodes' queues as they answered).
#[derive(Default)]
struct Totals {
    queues: u64,
    ready: u64,
    unacked: u64,
    consumers: u64,
}

fn vhost_totals(ctx: &Context<'_>, vhost: &str) -> Totals {
    let mut totals = Totals::default();
    let request = AdminRequest::ListQueues {
        vhost: vhost.to_string(),
        columns: convert::columns(&[
            ("messages_ready", "", Kind::Int),
            ("messages_unacknowledged", "", Kind::Int),
            ("consumers", "", Kind::Int),
        ]),
    };
    if let Ok(t) = admin_table(ctx, &request) {
        for row in &t.rows {
            let n = |i: usize| row[i].parse::<u64>().unwrap_or(0);
            totals.queues += 1;
            totals.ready += n(0);
            totals.unacked += n(1);
            totals.consumers += n(2);
        }
    }
    totals
}

/// The exchange types Warren has, as RabbitMQ describes them (`/api/overview`).
fn exchange_types() -> Value {
    let kind = |name: &str, what: &str| json!({"name": name, "description": format!("AMQP {what} exchange, as per the AMQP specification"), "enabled": true});
    json!([
        kind("direct", "direct"),
        kind("fanout", "fanout"),
        kind("headers", "headers"),
        kind("topic", "topic"),
    ])
}

/// RabbitMQ's overview `message_stats` counts, from this node's counters (the Prometheus
/// endpoint's): no `*_details` rates, as there is no statistics database to sample them;
/// the console derives rates from successive answers.
fn message_stats(m: &crate::metrics::Metrics) -> Value {
    let deliver = m.delivered_consume_manual_ack.get();
    let deliver_no_ack = m.delivered_consume_auto_ack.get();
    let get = m.delivered_get_manual_ack.get();
    let get_no_ack = m.delivered_get_auto_ack.get();
    json!({
        "publish": m.received.get(),
        "confirm": m.confirmed.get(),
        "deliver": deliver,
        "deliver_no_ack": deliver_no_ack,
        "get": get,
        "get_no_ack": get_no_ack,
        "deliver_get": deliver + deliver_no_ack + get + get_no_ack,
        "get_empty": m.get_empty.get(),
        "redeliver": m.redelivered.get(),
        "ack": m.acknowledged.get(),
        "drop_unroutable": m.unroutable_dropped.get(),
        "return_unroutable": m.unroutable_returned.get(),
        "disk_reads": m.disk_reads.get(),
        "disk_writes": m.disk_writes.get(),
    })
}

fn whoami(caller: &Caller) -> Response {
    Response::ok(json!({"name": caller.user.name, "tags": caller.user.tags}))
}

fn nodes(ctx: &Context<'_>, meta: &MetaState, caller: &Caller, one: Option<&str>) -> Response {
    if !caller.tags.monitoring {
        return Response::not_authorised("Not monitor user");
    }
    let mut list: Vec<Value> = meta
        .nodes
        .values()
        .map(|n| {
            let running = n.id == ctx.broker.node_id() || !ctx.broker.node_is_down(n.id);
            node_json(ctx, &n.name, running)
        })
        .collect();
    if list.is_empty() {
        list.push(node_json(ctx, &ctx.node.name, true));
    }
    match one {
        None => Response::ok(Value::Array(list)),
        Some(name) => one_or_list(
            list.into_iter().filter(|n| n["name"] == *name).collect(),
            true,
        ),
    }
}

/// A node object as RabbitMQ 3.10 shows it: name, type and running, and the node's figures
/// when it answered ([`Context::node_stats`]); a node that did not (stopped, or cut off)
/// has the first three only, as a stopped node in RabbitMQ.
fn node_json(ctx: &Context<'_>, name: &str, running: bool) -> Value {
    let mut node = json!({"name": name, "type": "disc", "running": running});
    let Some(s) = ctx.node_stats.get(name) else {
        return node;
    };
    let exchange_types: Vec<Value> = ["headers", "direct", "topic", "fanout"]
        .iter()
        .map(|t| {
            json!({
                "name": t,
                "description": format!("AMQP {t} exchange, as per the AMQP specification"),
                "enabled": true,
            })
        })
        .collect();
    let amqps = s.listeners.iter().any(|l| l.protocol == "amqp/ssl");
    let figures = json!({
        "mem_used": s.mem_used,
        "mem_limit": s.mem_limit,
        "mem_alarm": s.mem_alarm,
        "disk_free": s.disk_free,
        "disk_free_limit": s.disk_free_limit,
        "disk_free_alarm": s.disk_free_alarm,
        "fd_used": s.fd_used,
        "fd_total": s.fd_total,
        "sockets_used": s.sockets_used,
        // Client sockets are bounded by descriptors alone (no share kept back as RabbitMQ's
        // file handle cache does).
        "sockets_total": s.fd_total,
        "uptime": s.uptime_ms,
        "os_pid": s.os_pid.to_string(),
        "processors": s.processors,
        // Raft keeps one metadata history: no partition leaves two to reconcile.
        "partitions": [],
        "exchange_types": exchange_types,
        "auth_mechanisms": [
            {"name": "PLAIN", "description": "SASL PLAIN authentication mechanism", "enabled": true},
            {"name": "AMQPLAIN", "description": "QPid AMQPLAIN mechanism", "enabled": true},
            {"name": "EXTERNAL", "description": "SSL authentication mechanism using SASL EXTERNAL", "enabled": amqps},
        ],
        // No statistics database: no rates (docs/management.md).
        "rates_mode": "none",
        "config_files": s.config_file.iter().collect::<Vec<_>>(),
        "db_dir": s.db_dir,
        "log_files": ["<stdout>"],
        "contexts": contexts_json(name, &s.listeners),
        // The storage's file I/O (`crate::metrics::IoCounters`), averages in ms.
        "io_read_count": s.io.read_count,
        "io_read_bytes": s.io.read_bytes,
        "io_read_avg_time": s.io.read_avg_ms,
        "io_write_count": s.io.write_count,
        "io_write_bytes": s.io.write_bytes,
        "io_write_avg_time": s.io.write_avg_ms,
        "io_sync_count": s.io.sync_count,
        "io_sync_avg_time": s.io.sync_avg_ms,
        "io_seek_count": s.io.seek_count,
        "io_seek_avg_time": s.io.seek_avg_ms,
        "io_reopen_count": s.io.reopen_count,
        "msg_store_read_count": s.io.msg_store_read_count,
        "msg_store_write_count": s.io.msg_store_write_count,
        "queue_index_read_count": s.io.queue_index_read_count,
        "queue_index_write_count": s.io.queue_index_write_count,
        "cluster_links": s.cluster_links.iter().map(cluster_link_json).collect::<Vec<_>>(),
    });
    if let (Value::Object(node), Value::Object(figures)) = (&mut node, figures) {
        node.extend(figures);
    }
    node
}

/// One of a node's links to another node, as RabbitMQ shows a distribution link (byte
/// counts twice, as it does: at the top and under `stats`, where it adds rates).
fn cluster_link_json(l: &ClusterLink) -> Value {
    json!({
        "name": l.name,
        "peer_addr": l.peer.as_ref().map(|a| &a.ip),
        "peer_port": l.peer.as_ref().map(|a| a.port),
        "sock_addr": l.sock.as_ref().map(|a| &a.ip),
        "sock_port": l.sock.as_ref().map(|a| a.port),
        "send_bytes": l.send_bytes,
        "recv_bytes": l.recv_bytes,
        "stats": {"send_bytes": l.send_bytes, "recv_bytes": l.recv_bytes},
    })
}

/// Each node's state, by name (a vhost runs on every node): `cluster_state`.
fn cluster_state(ctx: &Context<'_>, meta: &MetaState) -> Value {
    let mut states = Map::new();
    for n in meta.nodes.values() {
        let running = n.id == ctx.broker.node_id() || !ctx.broker.node_is_down(n.id);
        states.insert(
            n.name.clone(),
            json!(if running { "running" } else { "stopped" }),
        );
    }
    if states.is_empty() {
        states.insert(ctx.node.name.clone(), json!("running"));
    }
    Value::Object(states)
}

/// A vhost as RabbitMQ 3.10 shows it. Warren keeps no default queue type (RabbitMQ's
/// `undefined`: classic).
fn vhost_json(ctx: &Context<'_>, meta: &MetaState, name: &str, cluster_state: &Value) -> Value {
    let t = vhost_totals(ctx, name);
    let empty = VhostMetadata::default();
    let m = meta.vhost_metadata.get(name).unwrap_or(&empty);
    json!({
        "name": name,
        "description": m.description,
        "tags": m.tags,
        "metadata": {"description": m.description, "tags": m.tags},
        "default_queue_type": "undefined",
        "tracing": false,
        "cluster_state": cluster_state,
        "messages": t.ready + t.unacked,
        "messages_ready": t.ready,
        "messages_unacknowledged": t.unacked,
    })
}

fn vhosts(ctx: &Context<'_>, meta: &MetaState, caller: &Caller, one: Option<&str>) -> Response {
    let names = match listed_vhosts(meta, caller, one) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let states = cluster_state(ctx, meta);
    one_or_list(
        names
            .iter()
            .map(|n| vhost_json(ctx, meta, n, &states))
            .collect(),
        one.is_some(),
    )
}

fn vhost_one(
    ctx: &Context<'_>,
    meta: &MetaState,
    caller: &Caller,
    req: &Request,
    vhost: &str,
) -> Handled {
    match req.method {
        Method::Get => reply(vhosts(ctx, meta, caller, Some(vhost))),
        Method::Put | Method::Delete if !caller.tags.administrator => reply(not_administrator()),
        Method::Put => {
            let existed = meta.vhost(vhost).is_some();
            let request = AdminRequest::AddVhost {
                name: vhost.to_string(),
            };
            let mut commands = match admin_command(ctx, &request) {
                Ok(c) => vec![c],
                Err(r) => return reply(r),
            };
            // The description and tags the body gives replace the vhost's; what it leaves
            // out is kept.
            let body = match body_object(req) {
                Ok(b) => b,
                Err(r) => return reply(r),
            };
            let description = match body.get("description") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(_) => return reply(Response::bad_request("description must be a string")),
            };
            let tags = match parse_tags(&body) {
                Ok(t) => t,
                Err(r) => return reply(r),
            };
            if description.is_some() || tags.is_some() {
                let old = meta.vhost_metadata.get(vhost).cloned().unwrap_or_default();
                let metadata = VhostMetadata {
                    description: description.unwrap_or(old.description),
                    tags: tags.unwrap_or(old.tags),
                };
                commands.push(Command::SetVhostMetadata {
                    name: vhost.to_string(),
                    metadata,
                });
            }
            // RabbitMQ grants the user who creates a vhost full permissions in it.
            if !existed {
                commands.push(Command::SetPermissions(Permission {
                    user: caller.user.name.clone(),
                    vhost: vhost.to_string(),
                    configure: ".*".into(),
                    write: ".*".into(),
                    read: ".*".into(),
                }));
            }
            commit(commands, put_status(existed))
        }
        Method::Delete if meta.vhost(vhost).is_none() => reply(Response::not_found()),
        Method::Delete => admin_change(
            ctx,
            &AdminRequest::DeleteVhost {
                name: vhost.to_string(),
            },
            Response::empty(204),
        ),
        _ => method_not_allowed(),
    }
}

fn user_json(meta: &MetaState, u: &User) -> Value {
    let (hash, algorithm) = u.password_hash();
    json!({
        "name": u.name,
        "password_hash": hash,
        "hashing_algorithm": algorithm.name(),
        "tags": u.tags,
        "limits": user_limits_json(meta, &u.name),
    })
}

/// A user's `limits` as RabbitMQ shows it on the user: an object, `{}` when none.
pub(super) fn user_limits_json(meta: &MetaState, user: &str) -> Value {
    meta.user_limits
        .get(user)
        .map_or_else(|| json!({}), crate::meta::limits::to_json)
}

/// A `password_hash` (with an optional `hashing_algorithm`) as the password to store.
pub fn stored_hash(body: &Map<String, Value>, hash: &str) -> Result<String, Response> {
    let algorithm = str_field(body, "hashing_algorithm")?;
    let hashing = match algorithm.as_deref() {
        None => Hashing::Sha256,
        Some(name) => Hashing::named(name).ok_or_else(|| {
            Response::bad_request(format!(
                "hashing_algorithm: {name} is not supported (rabbit_password_hashing_sha256 \
                 or rabbit_password_hashing_sha512)"
            ))
        })?,
    };
    User::stored_hash(hash, hashing).ok_or_else(|| {
        Response::bad_request(format!(
            "password_hash is not a base64 salted hash of {}",
            hashing.name()
        ))
    })
}

fn users(meta: &MetaState, caller: &Caller, one: Option<&str>) -> Response {
    if !caller.tags.administrator {
        return not_administrator();
    }
    let list = meta
        .users
        .values()
        .filter(|u| one.is_none_or(|n| u.name == n))
        .map(|u| user_json(meta, u))
        .collect();
    one_or_list(list, one.is_some())
}

/// `tags` as RabbitMQ takes it: a comma-separated string or a list.
fn parse_tags(body: &Map<String, Value>) -> Result<Option<Vec<String>>, Response> {
    match body.get("tags") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(
            s.split(',')
                .map(str::trim)
                .filter(|t| !t.is_empty())
                .map(String::from)
                .collect(),
        )),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| t.as_str().map(String::from))
            .collect::<Option<Vec<_>>>()
            .map(Some)
            .ok_or_else(|| Response::bad_request("tags must be strings")),
        Some(_) => Err(Response::bad_request("tags must be a string or a list")),
    }
}

/// `salt`: for a new password's hash.
fn user_one(
    salt: [u8; 4],
    meta: &MetaState,
    caller: &Caller,
    req: &Request,
    name: &str,
) -> Handled {
    if !caller.tags.administrator {
        return reply(not_administrator());
    }
    let existing = meta.users.get(name);
    match req.method {
        Method::Get => reply(users(meta, caller, Some(name))),
        Method::Delete => match existing {
            None => reply(Response::not_found()),
            Some(_) => commit(
                vec![Command::DeleteUser {
                    name: name.to_string(),
                }],
                Response::empty(204),
            ),
        },
        Method::Put => {
            let body = match body_object(req) {
                Ok(b) => b,
                Err(r) => return reply(r),
            };
            // As RabbitMQ 3.10: `tags` is required; without `password` or `password_hash`
            // the user has no password (an existing one loses it) and cannot log in with one.
            let tags = match parse_tags(&body) {
                Ok(Some(t)) => t,
                Ok(None) => return reply(Response::bad_request("tags_not_present")),
                Err(r) => return reply(r),
            };
            let password = match (str_field(&body, "password"), body.get("password_hash")) {
                (Err(r), _) => return reply(r),
                (Ok(Some(p)), _) => User::hash_password(&p, salt),
                (Ok(None), Some(Value::String(h))) if h.is_empty() => User::no_password(),
                (Ok(None), Some(Value::String(h))) => match stored_hash(&body, h) {
                    Ok(p) => p,
                    Err(r) => return reply(r),
                },
                (Ok(None), Some(_)) => {
                    return reply(Response::bad_request("password_hash must be a string"))
                }
                (Ok(None), None) => User::no_password(),
            };
            let user = User {
                name: name.to_string(),
                password,
                tags,
            };
            commit(vec![Command::PutUser(user)], put_status(existing.is_some()))
        }
        _ => method_not_allowed(),
    }
}

/// Permissions, of one vhost and/or one user (administrators only): `/api/permissions`,
/// `/api/vhosts/{vhost}/permissions` and `/api/users/{user}/permissions` (404 for a missing
/// vhost or user), and the single `/api/permissions/{vhost}/{user}` (`single`).
fn permissions(
    ctx: &Context<'_>,
    meta: &MetaState,
    caller: &Caller,
    vhost: Option<&str>,
    user: Option<&str>,
    single: bool,
) -> Response {
    if !caller.tags.administrator {
        return not_administrator();
    }
    if vhost.is_some_and(|v| meta.vhost(v).is_none())
        || user.is_some_and(|u| !meta.users.contains_key(u))
    {
        return Response::not_found();
    }
    let fields = [
        ("user", "user", Kind::Str),
        ("configure", "configure", Kind::Str),
        ("write", "write", Kind::Str),
        ("read", "read", Kind::Str),
    ];
    let mut list = Vec::new();
    for v in meta.vhosts.keys() {
        if vhost.is_some_and(|vh| vh != v) {
            continue;
        }
        let Ok(t) = admin_table(ctx, &AdminRequest::ListPermissions { vhost: v.clone() }) else {
            continue;
        };
        list.extend(
            convert::objects(&t, &fields, &[("vhost", json!(v))])
                .into_iter()
                .filter(|p| user.is_none_or(|u| p["user"] == *u)),
        );
    }
    one_or_list(list, single)
}

/// `/api/users/without-permissions`: the users with no permissions in any vhost.
fn users_without_permissions(meta: &MetaState, caller: &Caller) -> Response {
    if !caller.tags.administrator {
        return not_administrator();
    }
    let list = meta
        .users
        .values()
        .filter(|u| !meta.permissions.keys().any(|(name, _)| *name == u.name))
        .map(|u| user_json(meta, u))
        .collect();
    Response::ok(Value::Array(list))
}

fn permission_one(
    ctx: &Context<'_>,
    meta: &MetaState,
    caller: &Caller,
    req: &Request,
    vhost: &str,
    user: &str,
) -> Handled {
    if !caller.tags.administrator {
        return reply(not_administrator());
    }
    let known = meta.vhost(vhost).is_some() && meta.users.contains_key(user);
    let key = (user.to_string(), vhost.to_string());
    match req.method {
        Method::Get if !known => reply(Response::not_found()),
        Method::Get => reply(permissions(
            ctx,
            meta,
            caller,
            Some(vhost),
            Some(user),
            true,
        )),
        // RabbitMQ's answer to a PUT for a missing vhost or user.
        Method::Put if !known => reply(Response::bad_request("vhost_or_user_not_found")),
        Method::Put => {
            let body = match body_object(req) {
                Ok(b) => b,
                Err(r) => return reply(r),
            };
            let mut regexes = Vec::new();
            for k in ["configure", "write", "read"] {
                match str_field(&body, k) {
                    Ok(Some(s)) => regexes.push(s),
                    Ok(None) => return reply(Response::bad_request(format!("{k} is required"))),
                    Err(r) => return reply(r),
                }
            }
            let [configure, write, read] = <[String; 3]>::try_from(regexes).expect("three");
            let request = AdminRequest::SetPermissions {
                vhost: vhost.to_string(),
                user: user.to_string(),
                configure,
                write,
                read,
            };
            admin_change(
                ctx,
                &request,
                put_status(meta.permissions.contains_key(&key)),
            )
        }
        Method::Delete if !meta.permissions.contains_key(&key) => reply(Response::not_found()),
        Method::Delete => admin_change(
            ctx,
            &AdminRequest::ClearPermissions {
                vhost: vhost.to_string(),
                user: user.to_string(),
            },
            Response::empty(204),
        ),
        _ => method_not_allowed(),
    }
}

const EXCHANGE_FIELDS: &[(&str, &str, Kind)] = &[
    ("name", "name", Kind::Str),
    ("type", "type", Kind::Str),
    ("durable", "durable", Kind::Bool),
    ("auto_delete", "auto_delete", Kind::Bool),
    ("internal", "internal", Kind::Bool),
    ("arguments", "arguments", Kind::Json),
    ("policy", "policy", Kind::OptStr),
];

fn exchanges(
    ctx: &Context<'_>,
    meta: &MetaState,
    caller: &Caller,
    vhost: Option<&str>,
    one: Option<&str>,
) -> Response {
    let vhosts = match listed_vhosts(meta, caller, vhost) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let mut list = Vec::new();
    for v in vhosts {
        let request = AdminRequest::ListExchanges {
            vhost: v.clone(),
            columns: convert::columns(EXCHANGE_FIELDS),
        };
        if let Ok(t) = admin_table(ctx, &request) {
            let extra = [
                ("vhost", json!(v)),
                ("user_who_performed_action", json!("")),
            ];
            list.extend(
                convert::objects(&t, EXCHANGE_FIELDS, &extra)
                    .into_iter()
                    .filter(|x| one.is_none_or(|n| x["name"] == *n))
                    .map(|mut x| {
                        // RabbitMQ names a policy only when one applies.
                        if let Some(o) = x.as_object_mut() {
                            if o.get("policy").is_some_and(Value::is_null) {
                                o.remove("policy");
                            }
                        }
                        x
                    }),
            );
        }
    }
    one_or_list(list, one.is_some())
}

fn exchange_change(
    meta: &MetaState,
    caller: &Caller,
    req: &Request,
    vhost: &str,
    name: &str,
) -> Handled {
    if let Err(r) = writable_vhost(meta, caller, vhost)
        .and_then(|()| check_permission(meta, caller, vhost, Access::Configure, "exchange", name))
    {
        return reply(r);
    }
    let existed = meta
        .vhost(vhost)
        .is_some_and(|v| v.exchanges.contains_key(name));
    if req.method == Method::Delete {
        if !existed {
            return reply(Response::not_found());
        }
        let if_unused = req.query_value("if-unused").is_some_and(|v| v == "true");
        return commit(
            vec![Command::DeleteExchange {
                vhost: vhost.to_string(),
                name: name.to_string(),
                if_unused,
            }],
            Response::empty(204),
        );
    }
    let def = match exchange_def(req, vhost, name) {
        Ok(d) => d,
        Err(r) => return reply(r),
    };
    commit(vec![Command::DeclareExchange(def)], put_status(existed))
}

fn exchange_def(req: &Request, vhost: &str, name: &str) -> Result<ExchangeDef, Response> {
    let body = body_object(req)?;
    // RabbitMQ declares a direct exchange when the body names no type.
    let kind = str_field(&body, "type")?.unwrap_or_else(|| "direct".into());
    let kind = ExchangeKind::parse(&kind)
        .ok_or_else(|| Response::bad_request(format!("unknown exchange type '{kind}'")))?;
    Ok(ExchangeDef {
        vhost: vhost.to_string(),
        name: name.to_string(),
        kind,
        durable: bool_field(&body, "durable", true)?,
        auto_delete: bool_field(&body, "auto_delete", false)?,
        internal: bool_field(&body, "internal", false)?,
        arguments: convert::arguments(&body).map_err(Response::bad_request)?,
    })
}

/// `GET /api/queues[/{vhost}[/{name}]]`. A listing is written as JSON text with the
/// listing parameters applied here ([`QueueObject::write`]); one queue's page is a value.
fn queues(
    ctx: &Context<'_>,
    meta: &MetaState,
    caller: &Caller,
    req: &Request,
    vhost: Option<&str>,
    one: Option<&str>,
) -> Response {
    let vhosts = match listed_vhosts(meta, caller, vhost) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let empty = admin::RemoteCounts::new();
    let counts = |v: &str| ctx.remote_counts.get(v).unwrap_or(&empty);
    if let (Some(name), Some(vhost)) = (one, vhost) {
        let Some(v) = meta.vhost(vhost) else {
            return Response::not_found();
        };
        let Some(q) = v.queues.get(name) else {
            return Response::not_found();
        };
        let info = QueueInfo::of(ctx.broker, ctx.node, meta, v, q, counts(vhost));
        let mut object = QueueObject::new(vhost, info).to_value();
        if let Value::Object(o) = &mut object {
            // Warren's extension, on the single-queue answer only: listings stay
            // RabbitMQ's size.
            for (k, v) in super::ring::fields(ctx.broker, meta, vhost, name) {
                o.insert(k.to_string(), v);
            }
            // As RabbitMQ: the queue's own object lists its consumers.
            o.insert(
                "consumer_details".to_string(),
                Value::Array(super::live::queue_consumers(ctx, vhost, name)),
            );
        }
        return Response::ok(object);
    }
    let query = match ListQuery::parse(req) {
        Ok(q) => q,
        Err(r) => return r,
    };
    let mut objects = Vec::new();
    for name in &vhosts {
        if let Some(v) = meta.vhost(name) {
            let infos = QueueInfo::all_of(ctx.broker, ctx.node, meta, v, counts(name));
            objects.extend(infos.into_iter().map(|i| QueueObject::new(&v.name, i)));
        }
    }
    let shaped = match query.shape(objects) {
        Ok(s) => s,
        Err(r) => return r,
    };
    let mut out = Vec::with_capacity(shaped.items.len() * 768 + 64);
    write_shaped(&shaped, &mut out, |q, out| q.write(query.columns(), out));
    Response::ok_raw(out)
}

fn queue_change(
    meta: &MetaState,
    caller: &Caller,
    req: &Request,
    vhost: &str,
    name: &str,
) -> Handled {
    if let Err(r) = writable_vhost(meta, caller, vhost)
        .and_then(|()| check_permission(meta, caller, vhost, Access::Configure, "queue", name))
    {
        return reply(r);
    }
    let existed = meta
        .vhost(vhost)
        .is_some_and(|v| v.queues.contains_key(name));
    if req.method == Method::Delete {
        if !existed {
            return reply(Response::not_found());
        }
        return commit(
            vec![Command::DeleteQueue {
                vhost: vhost.to_string(),
                name: name.to_string(),
            }],
            Response::empty(204),
        );
    }
    if name.is_empty() {
        return reply(Response::bad_request("a queue needs a name"));
    }
    match queue_def(req, vhost, name) {
        Ok(d) => commit(vec![Command::DeclareQueue(d)], put_status(existed)),
        Err(r) => reply(r),
    }
}

/// `POST /api/queues/{vhost}/{name}/actions` with `{"action":"sync"}` or
/// `{"action":"cancel_sync"}` (administrators): `warrenctl sync_queue` /
/// `cancel_sync_queue`. 204 once committed; an unmirrored queue has nothing to sync and
/// answers 204 at once, as in RabbitMQ.
fn queue_action(
    meta: &MetaState,
    caller: &Caller,
    req: &Request,
    vhost: &str,
    name: &str,
) -> Handled {
    if !caller.tags.administrator {
        return reply(not_administrator());
    }
    let Some(v) = meta.vhost(vhost) else {
        return reply(Response::not_found());
    };
    if !v.queues.contains_key(name) {
        return reply(Response::not_found());
    }
    let body = match body_object(req) {
        Ok(b) => b,
        Err(r) => return reply(r),
    };
    let cancel = match body.get("action").and_then(Value::as_str) {
        Some("sync") => false,
        Some("cancel_sync") => true,
        other => {
            // RabbitMQ's reason is the Erlang term `{unknown, Action}`, printed as a list.
            let action = other.unwrap_or("undefined");
            return reply(
                Response::error(400, "bad_request", "").with_reason(json!(["unknown", action])),
            );
        }
    };
    let mirrored = meta
        .mirror_sets
        .get(&(vhost.to_string(), name.to_string()))
        .is_some_and(|s| !s.mirrors.is_empty());
    if !mirrored {
        return reply(Response::empty(204));
    }
    commit(
        vec![Command::SyncQueue {
            vhost: vhost.to_string(),
            queue: name.to_string(),
            cancel,
        }],
        Response::empty(204),
    )
}

fn queue_def(req: &Request, vhost: &str, name: &str) -> Result<QueueDef, Response> {
    let body = body_object(req)?;
    Ok(QueueDef {
        vhost: vhost.to_string(),
        name: name.to_string(),
        durable: bool_field(&body, "durable", true)?,
        exclusive_owner: None,
        auto_delete: bool_field(&body, "auto_delete", false)?,
        arguments: convert::arguments(&body).map_err(Response::bad_request)?,
        // Placed by the node's MetaCommit (`queue-master-locator`), as for a client.
        home: 0,
    })
}

const POLICY_FIELDS: &[(&str, &str, Kind)] = &[
    ("vhost", "vhost", Kind::Str),
    ("name", "name", Kind::Str),
    ("pattern", "pattern", Kind::Str),
    ("apply-to", "apply-to", Kind::Str),
    ("definition", "definition", Kind::Json),
    ("priority", "priority", Kind::Int),
];

/// Who may read one policy and change policies: policymakers, and only administrators for
/// operator policies (RabbitMQ's `is_authorized_policies` / `is_authorized_admin`). The
/// listings need only access to the vhost, as in RabbitMQ 3.10.
fn policy_refused(caller: &Caller, operator: bool) -> Option<Response> {
    if operator && !caller.tags.administrator {
        Some(not_administrator())
    } else if !caller.tags.policymaker {
        Some(not_authorised_object())
    } else {
        None
    }
}

/// RabbitMQ's 401 for an object the user's tags do not reach.
pub(super) fn not_authorised_object() -> Response {
    Response::not_authorised("User not authorised to access object")
}

fn policies(
    ctx: &Context<'_>,
    meta: &MetaState,
    caller: &Caller,
    vhost: Option<&str>,
    one: Option<&str>,
    operator: bool,
) -> Response {
    if let Some(r) = one.and_then(|_| policy_refused(caller, operator)) {
        return r;
    }
    let vhosts: Vec<String> = match vhost {
        Some(v) if meta.vhost(v).is_none() => return Response::not_found(),
        Some(v) if !caller.tags.administrator && !caller.can_access(meta, v) => {
            return vhost_refused()
        }
        Some(v) => vec![v.to_string()],
        None => meta
            .vhosts
            .keys()
            .filter(|v| caller.tags.administrator || caller.can_access(meta, v))
            .cloned()
            .collect(),
    };
    let mut list = Vec::new();
    for v in vhosts {
        let request = AdminRequest::ListPolicies { vhost: v, operator };
        if let Ok(t) = admin_table(ctx, &request) {
            list.extend(
                convert::objects(&t, POLICY_FIELDS, &[])
                    .into_iter()
                    .filter(|p| one.is_none_or(|n| p["name"] == *n)),
            );
        }
    }
    one_or_list(list, one.is_some())
}

fn policy_change(
    ctx: &Context<'_>,
    meta: &MetaState,
    caller: &Caller,
    req: &Request,
    vhost: &str,
    name: &str,
    operator: bool,
) -> Handled {
    if let Some(r) = policy_refused(caller, operator) {
        return reply(r);
    }
    if let Err(r) = writable_vhost(meta, caller, vhost) {
        return reply(r);
    }
    let existed = meta.vhost(vhost).is_some_and(|v| {
        if operator {
            v.operator_policies.contains_key(name)
        } else {
            v.policies.contains_key(name)
        }
    });
    if req.method == Method::Delete {
        if !existed {
            return reply(Response::not_found());
        }
        let request = AdminRequest::ClearPolicy {
            vhost: vhost.to_string(),
            name: name.to_string(),
            operator,
        };
        return admin_change(ctx, &request, Response::empty(204));
    }
    let body = match body_object(req) {
        Ok(b) => b,
        Err(r) => return reply(r),
    };
    let pattern = match str_field(&body, "pattern") {
        Ok(Some(p)) => p,
        Ok(None) => return reply(Response::bad_request("pattern is required")),
        Err(r) => return reply(r),
    };
    let definition = match body.get("definition") {
        Some(d @ Value::Object(_)) => d.to_string(),
        _ => return reply(Response::bad_request("definition must be a JSON object")),
    };
    let priority = match body.get("priority") {
        None | Some(Value::Null) => 0,
        Some(p) => match p.as_i64() {
            Some(n) => n,
            None => return reply(Response::bad_request("priority must be an integer")),
        },
    };
    let apply_to = match str_field(&body, "apply-to") {
        Ok(a) => a.unwrap_or_else(|| "all".into()),
        Err(r) => return reply(r),
    };
    let request = AdminRequest::SetPolicy {
        vhost: vhost.to_string(),
        name: name.to_string(),
        pattern,
        definition,
        priority,
        apply_to,
        operator,
    };
    admin_change(ctx, &request, put_status(existed))
}
