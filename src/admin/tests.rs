//! The admin protocol's tests: listings, changes and their refusals, frames.

use super::*;
use crate::broker::registry::{ConnectionInfo, ConnectionState, ConsumerInfo};
use crate::broker::Broker;
use crate::broker::{ChannelLink, Consumer, Outbox};
use crate::config::Config;
use crate::meta::limits::LimitScope;
use crate::meta::{Command, QueueDef};
use crate::time::Instant;
use amq_protocol::types::{AMQPValue, FieldTable};
use listing::CONSUMER_DEFAULTS;
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
        connected_at: 0,
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
        Default::default(),
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
                    broker.snapshot().mirror_sets[&("/".to_string(), "m".to_string())].incarnation,
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
        Default::default(),
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
