//! RabbitMQ's health checks (`/api/health/checks/...`): 200 `{"status":"ok"}` when the
//! check passes, 503 `{"status":"failed","reason":...}` with the details when it does not,
//! as RabbitMQ 3.10 answers (shapes read off a live 3.10.8 node). Any management user may
//! call them.
//!
//! What they mean in Warren:
//! - `alarms` / `local-alarms`: this node's memory and free-disk alarms (a node knows only
//!   its own, so both answer for it; `docs/management.md`).
//! - `node-is-quorum-critical`: whether stopping this node would cost the metadata Raft
//!   group its majority (Warren has no quorum queues; its metadata is the Raft group).
//! - `node-is-mirror-sync-critical`: whether a mirrored queue mastered here has no
//!   synchronised mirror on a running node, so stopping this node would leave it without a
//!   master that holds its messages.
//! - `port-listener/{port}`, `protocol-listener/{protocol}`: this node's listeners.
//! - `virtual-hosts`: every vhost runs on every node in Warren: always ok.
//! - `certificate-expiration/{within}/{unit}`: whether a TLS listener's certificate expires
//!   within that time; this node has no TLS listener, so ok once the arguments are valid
//!   (RabbitMQ's 400s for a bad value or unit otherwise).

use serde_json::{json, Value};

use super::{Context, Response};
use crate::meta::MetaState;

/// One of the node's listeners: its protocol as RabbitMQ names it, and its bound address.
pub type Listener = crate::broker::node_stats::ListenerInfo;

/// A listener on loopback (tests).
#[cfg(test)]
pub fn loopback(protocol: &str, port: u16) -> Listener {
    Listener {
        protocol: protocol.to_string(),
        addr: crate::broker::node_stats::Endpoint {
            ip: "127.0.0.1".to_string(),
            port,
        },
    }
}

fn ok(extra: Value) -> Response {
    let mut body = json!({"status": "ok"});
    if let (Some(b), Value::Object(e)) = (body.as_object_mut(), extra) {
        b.extend(e);
    }
    Response::ok(body)
}

fn failed(reason: &str, extra: Value) -> Response {
    let mut body = json!({"status": "failed", "reason": reason});
    if let (Some(b), Value::Object(e)) = (body.as_object_mut(), extra) {
        b.extend(e);
    }
    Response {
        status: 503,
        ..Response::ok(body)
    }
}

/// Answers `/api/health/checks/{check...}`; `None` for a check that does not exist.
pub fn check(ctx: &Context<'_>, meta: &MetaState, check: &[&str]) -> Option<Response> {
    Some(match check {
        ["alarms"] => alarms(ctx, meta, true, "There are alarms in effect in the cluster"),
        ["local-alarms"] => alarms(ctx, meta, false, "There are alarms in effect on the node"),
        ["virtual-hosts"] => ok(json!({})),
        ["node-is-quorum-critical"] => quorum_critical(ctx, meta),
        ["node-is-mirror-sync-critical"] => mirror_sync_critical(ctx, meta),
        ["port-listener", port] => port_listener(ctx, port),
        ["protocol-listener", protocol] => protocol_listener(ctx, protocol),
        ["certificate-expiration", within, unit] => certificate_expiration(within, unit),
        _ => return None,
    })
}

/// The arguments checked as RabbitMQ checks them; no listener of this node has a
/// certificate to expire.
fn certificate_expiration(within: &str, unit: &str) -> Response {
    if within.parse::<u64>().is_err() {
        return Response::bad_request("Invalid expiration value.");
    }
    if !matches!(unit, "days" | "weeks" | "months" | "years") {
        return Response::bad_request(
            "Time unit not recognised. Supported units: days, weeks, months, years.",
        );
    }
    ok(json!({}))
}

/// This node's alarms, and with `cluster` those of the other nodes that are up (their
/// heartbeats carry them), by node.
fn alarms(ctx: &Context<'_>, meta: &MetaState, cluster: bool, reason: &str) -> Response {
    let mut alarms = Vec::new();
    let mut by_node = vec![(ctx.node.name.clone(), ctx.broker.local_alarms())];
    if cluster {
        for (id, bits) in ctx.broker.peer_alarms() {
            let name = meta
                .nodes
                .get(&id)
                .map_or_else(|| format!("node {id}"), |n| n.name.clone());
            by_node.push((name, bits));
        }
    }
    for (node, bits) in by_node {
        for resource in crate::broker::alarm::resources(bits) {
            alarms.push(json!({"node": node, "resource": resource}));
        }
    }
    if alarms.is_empty() {
        ok(json!({}))
    } else {
        failed(reason, json!({ "alarms": alarms }))
    }
}

/// The registered nodes, and those running as this node sees them (itself included).
fn running(ctx: &Context<'_>, meta: &MetaState) -> (usize, usize) {
    let me = ctx.broker.node_id();
    let total = meta.nodes.len();
    let up = meta
        .nodes
        .keys()
        .filter(|id| **id == me || !ctx.broker.node_is_down(**id))
        .count();
    (total, up)
}

fn quorum_critical(ctx: &Context<'_>, meta: &MetaState) -> Response {
    let (total, up) = running(ctx, meta);
    if total <= 1 {
        return ok(json!({"reason": "single node cluster"}));
    }
    let majority = total / 2 + 1;
    if up.saturating_sub(1) < majority {
        failed(
            "The metadata Raft group would lose its majority if the target node is shut down",
            json!({"running_nodes": up, "cluster_nodes": total, "majority": majority}),
        )
    } else {
        ok(json!({}))
    }
}

fn mirror_sync_critical(ctx: &Context<'_>, meta: &MetaState) -> Response {
    let me = ctx.broker.node_id();
    if meta.nodes.len() <= 1 {
        return ok(json!({"reason": "single node cluster"}));
    }
    let mut queues = Vec::new();
    for (vname, v) in &meta.vhosts {
        for (name, def) in &v.queues {
            if def.home != me {
                continue;
            }
            let Some(set) = meta.mirror_sets.get(&(vname.clone(), name.clone())) else {
                continue;
            };
            if set.mirrors.is_empty() {
                continue;
            }
            let covered = set
                .mirrors
                .iter()
                .any(|m| m.synchronised && m.node != me && !ctx.broker.node_is_down(m.node));
            if !covered {
                queues.push(json!({"name": name, "vhost": vname}));
            }
        }
    }
    if queues.is_empty() {
        ok(json!({}))
    } else {
        failed(
            "There are classic mirrored queues without online synchronised mirrors",
            json!({ "queues": queues }),
        )
    }
}

fn port_listener(ctx: &Context<'_>, port: &str) -> Response {
    let ports: Vec<u16> = ctx.listeners.iter().map(|l| l.addr.port).collect();
    match port.parse::<u16>() {
        Ok(p) if ports.contains(&p) => ok(json!({"port": p})),
        Ok(p) => failed("No active listener", json!({"missing": p, "ports": ports})),
        Err(_) => Response::bad_request(format!("Invalid port: {port}")),
    }
}

fn protocol_listener(ctx: &Context<'_>, protocol: &str) -> Response {
    let protocols: Vec<&str> = ctx.listeners.iter().map(|l| l.protocol.as_str()).collect();
    if protocols.contains(&protocol) {
        ok(json!({ "protocol": protocol }))
    } else {
        failed(
            "No active listener",
            json!({"missing": protocol, "protocols": protocols}),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use amq_protocol::types::FieldTable;

    use super::*;
    use crate::admin::NodeInfo;
    use crate::broker::Broker;
    use crate::config::Config;
    use crate::meta::state::{MirrorRecord, NodeRecord, QueueDef};
    use crate::meta::Command;
    use crate::mgmt::RemoteCountsByVhost;

    fn listeners() -> Vec<Listener> {
        vec![
            loopback("amqp", 5672),
            loopback("http", 15672),
            loopback("clustering", 25672),
        ]
    }

    fn record(id: u64) -> NodeRecord {
        NodeRecord {
            id,
            name: format!("n{id}"),
            amqp: String::new(),
            admin: String::new(),
            link: String::new(),
            incarnation: 0,
        }
    }

    /// Nodes 1..=`nodes` registered; queue `m` homed on node 1 with mirrors on 2 and 3
    /// (`synced` says which are synchronised).
    fn meta(nodes: u64, synced: &[u64]) -> MetaState {
        let mut s = MetaState::default();
        let mut apply = |c: Command| s.apply(&c).unwrap_or_else(|e| panic!("{e}"));
        apply(Command::AddVhost { name: "/".into() });
        for id in 1..=nodes {
            apply(Command::RegisterNode(record(id)));
        }
        apply(Command::DeclareQueue(QueueDef {
            vhost: "/".into(),
            name: "m".into(),
            durable: true,
            exclusive_owner: None,
            auto_delete: false,
            arguments: FieldTable::default(),
            home: 1,
        }));
        let mirrors = [2, 3]
            .iter()
            .filter(|n| **n <= nodes)
            .map(|n| MirrorRecord {
                node: *n,
                since: 0,
                synchronised: synced.contains(n),
            })
            .collect();
        apply(Command::SetMirrors {
            vhost: "/".into(),
            queue: "m".into(),
            expected_version: 0,
            mirrors,
        });
        s
    }

    fn run(broker: &Broker, meta: &MetaState, path: &[&str]) -> Response {
        let counts = RemoteCountsByVhost::new();
        let listeners = listeners();
        let ctx = Context {
            broker,
            node: &NodeInfo { name: "n1".into() },
            loopback_users: &[],
            remote_counts: &counts,
            listeners: &listeners,
            remote_sessions: &[],
            node_stats: &Default::default(),
        };
        check(&ctx, meta, path).expect("a known check")
    }

    fn node1(down: &[u64]) -> Broker {
        let b = Broker::new(&Config::default(), 1, 1 << 30, 0).with_node_id(1);
        b.set_down_nodes(
            down.iter().copied().collect::<BTreeSet<_>>(),
            crate::time::Instant::default(),
        );
        b
    }

    #[test]
    fn alarms_name_the_node_and_resource_and_answer_503() {
        let b = node1(&[]);
        let m = meta(3, &[2, 3]);
        assert_eq!(
            run(&b, &m, &["alarms"]),
            Response::ok(json!({"status": "ok"}))
        );
        b.metrics()
            .disk_alarm
            .store(1, std::sync::atomic::Ordering::Relaxed);
        for (check, reason) in [
            ("alarms", "There are alarms in effect in the cluster"),
            ("local-alarms", "There are alarms in effect on the node"),
        ] {
            let r = run(&b, &m, &[check]);
            assert_eq!(r.status, 503);
            assert_eq!(
                r.body,
                Some(json!({
                    "status": "failed",
                    "reason": reason,
                    "alarms": [{"node": "n1", "resource": "disk space"}],
                }))
            );
        }
    }

    #[test]
    fn alarms_names_the_alarms_of_other_nodes_that_are_up_and_local_alarms_does_not() {
        use crate::broker::alarm::{DISK, MEMORY};
        let b = node1(&[]);
        let m = meta(3, &[2, 3]);
        b.set_peer_alarms(std::collections::BTreeMap::from([
            (2, MEMORY | DISK),
            (3, 0),
        ]));
        let r = run(&b, &m, &["alarms"]);
        assert_eq!(r.status, 503);
        assert_eq!(
            r.body,
            Some(json!({
                "status": "failed",
                "reason": "There are alarms in effect in the cluster",
                "alarms": [
                    {"node": "n2", "resource": "memory"},
                    {"node": "n2", "resource": "disk space"},
                ],
            }))
        );
        assert!(b.remote_alarm());
        assert_eq!(
            run(&b, &m, &["local-alarms"]),
            Response::ok(json!({"status": "ok"}))
        );
        // A node recorded down no longer counts.
        b.set_down_nodes(BTreeSet::from([2]), crate::time::Instant::default());
        assert!(!b.remote_alarm());
        assert_eq!(
            run(&b, &m, &["alarms"]),
            Response::ok(json!({"status": "ok"}))
        );
    }

    #[test]
    fn certificate_expiration_checks_its_arguments_as_rabbitmq() {
        let (b, m) = (node1(&[]), meta(1, &[]));
        let path = |within, unit| ["certificate-expiration", within, unit];
        assert_eq!(
            run(&b, &m, &path("1", "months")),
            Response::ok(json!({"status": "ok"}))
        );
        assert_eq!(
            run(&b, &m, &path("x", "months")),
            Response::bad_request("Invalid expiration value.")
        );
        let r = run(&b, &m, &path("2", "fortnights"));
        assert_eq!(r.status, 400);
        assert_eq!(
            r.body.unwrap()["reason"],
            "Time unit not recognised. Supported units: days, weeks, months, years."
        );
    }

    #[test]
    fn quorum_critical_when_stopping_this_node_leaves_no_majority() {
        let m = meta(3, &[2, 3]);
        assert_eq!(
            run(&node1(&[]), &m, &["node-is-quorum-critical"]).status,
            200
        );
        let r = run(&node1(&[2]), &m, &["node-is-quorum-critical"]);
        assert_eq!(r.status, 503, "{r:?}");
        assert_eq!(r.body.as_ref().unwrap()["majority"], 2);
        let single = meta(1, &[]);
        assert_eq!(
            run(&node1(&[]), &single, &["node-is-quorum-critical"]).body,
            Some(json!({"status": "ok", "reason": "single node cluster"}))
        );
    }

    #[test]
    fn mirror_sync_critical_when_no_running_mirror_is_synchronised() {
        // One synchronised mirror on a running node: fine.
        assert_eq!(
            run(
                &node1(&[]),
                &meta(3, &[3]),
                &["node-is-mirror-sync-critical"]
            )
            .status,
            200
        );
        // Its node is down: critical, and the queue is named.
        let r = run(
            &node1(&[3]),
            &meta(3, &[3]),
            &["node-is-mirror-sync-critical"],
        );
        assert_eq!(r.status, 503);
        assert_eq!(
            r.body.as_ref().unwrap()["queues"],
            json!([{"name": "m", "vhost": "/"}])
        );
        // No synchronised mirror at all: critical.
        let r = run(
            &node1(&[]),
            &meta(3, &[]),
            &["node-is-mirror-sync-critical"],
        );
        assert_eq!(r.status, 503);
        // Queues mastered elsewhere are not this node's concern.
        let other = Broker::new(&Config::default(), 1, 1 << 30, 0).with_node_id(2);
        assert_eq!(
            run(&other, &meta(3, &[]), &["node-is-mirror-sync-critical"]).status,
            200
        );
    }

    #[test]
    fn listener_checks_list_what_is_open() {
        let b = node1(&[]);
        let m = meta(3, &[]);
        assert_eq!(
            run(&b, &m, &["port-listener", "15672"]).body,
            Some(json!({"status": "ok", "port": 15672}))
        );
        let r = run(&b, &m, &["port-listener", "1"]);
        assert_eq!(r.status, 503);
        assert_eq!(
            r.body,
            Some(json!({
                "status": "failed",
                "reason": "No active listener",
                "missing": 1,
                "ports": [5672, 15672, 25672],
            }))
        );
        assert_eq!(run(&b, &m, &["port-listener", "x"]).status, 400);
        assert_eq!(
            run(&b, &m, &["protocol-listener", "amqp"]).body,
            Some(json!({"status": "ok", "protocol": "amqp"}))
        );
        let r = run(&b, &m, &["protocol-listener", "mqtt"]);
        assert_eq!(r.status, 503);
        assert_eq!(
            r.body.as_ref().unwrap()["protocols"],
            json!(["amqp", "http", "clustering"])
        );
    }
}
