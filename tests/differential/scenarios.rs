//! The scenarios: short scripts of client actions, most generated from tables (queue and
//! exchange arguments and their values, flags, error cases of every class). Each names its
//! queues and exchanges from a hash of its id, so ids, not positions, tie a scenario to its
//! recorded outcome.

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{
    basic, channel as chan, confirm, connection, exchange, queue, tx, AMQPClass, BasicProperties,
};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};

use super::runner::{Step, Then};

#[path = "policies.rs"]
mod policies;

pub struct Scenario {
    pub id: String,
    pub steps: Vec<Step>,
}

/// A short name prefix unique to a scenario id (FNV-1a).
fn prefix(id: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    format!("d{:08x}", h as u32)
}

fn sc(out: &mut Vec<Scenario>, id: impl Into<String>, f: impl FnOnce(&str) -> Vec<Step>) {
    let id = id.into();
    let p = prefix(&id);
    out.push(Scenario { steps: f(&p), id });
}

// ---- steps

fn call(ch: u16, m: AMQPClass) -> Step {
    Step::Call { conn: 0, ch, m }
}
fn call_on(conn: usize, ch: u16, m: AMQPClass) -> Step {
    Step::Call { conn, ch, m }
}
fn cast(ch: u16, m: AMQPClass) -> Step {
    Step::Cast {
        conn: 0,
        ch,
        m,
        then: Then::Barrier,
    }
}
/// An asynchronous method whose effect comes asynchronously: waits for `n` such frames.
fn cast_await(ch: u16, m: AMQPClass, n: usize) -> Step {
    Step::Cast {
        conn: 0,
        ch,
        m,
        then: Then::Await(n),
    }
}
fn wait(ch: u16, n: usize) -> Step {
    Step::Await { conn: 0, ch, n }
}
fn publish(ch: u16, x: &str, rk: &str, body: &str) -> Step {
    publish_with(ch, x, rk, false, BasicProperties::default(), body)
}
fn publish_with(
    ch: u16,
    x: &str,
    rk: &str,
    mandatory: bool,
    properties: BasicProperties,
    body: &str,
) -> Step {
    Step::Publish {
        conn: 0,
        ch,
        exchange: x.into(),
        routing_key: rk.into(),
        mandatory,
        properties: Box::new(properties),
        body: body.as_bytes().to_vec(),
        then: Then::Barrier,
    }
}
/// A publish whose answers (confirms, returns) are awaited rather than fenced.
fn publish_await(ch: u16, x: &str, rk: &str, mandatory: bool, n: usize) -> Step {
    Step::Publish {
        conn: 0,
        ch,
        exchange: x.into(),
        routing_key: rk.into(),
        mandatory,
        properties: Box::default(),
        body: b"m".to_vec(),
        then: Then::Await(n),
    }
}

// ---- methods

fn table(entries: Vec<(&str, AMQPValue)>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert(ShortString::from(k), v);
    }
    t
}
fn s(v: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(v))
}

#[derive(Clone, Copy, Default)]
struct QFlags {
    passive: bool,
    durable: bool,
    exclusive: bool,
    auto_delete: bool,
}

fn qdecl(name: &str, f: QFlags, args: FieldTable) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
        queue: name.into(),
        passive: f.passive,
        durable: f.durable,
        exclusive: f.exclusive,
        auto_delete: f.auto_delete,
        nowait: false,
        arguments: args,
    }))
}
fn q(name: &str) -> AMQPClass {
    qdecl(name, QFlags::default(), FieldTable::default())
}
fn qargs(name: &str, args: FieldTable) -> AMQPClass {
    qdecl(name, QFlags::default(), args)
}
fn qbind(name: &str, x: &str, rk: &str, args: FieldTable) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
        queue: name.into(),
        exchange: x.into(),
        routing_key: rk.into(),
        nowait: false,
        arguments: args,
    }))
}
fn qunbind(name: &str, x: &str, rk: &str) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::Unbind(queue::Unbind {
        queue: name.into(),
        exchange: x.into(),
        routing_key: rk.into(),
        arguments: FieldTable::default(),
    }))
}
fn qpurge(name: &str) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::Purge(queue::Purge {
        queue: name.into(),
        nowait: false,
    }))
}
fn qdelete(name: &str, if_unused: bool, if_empty: bool) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
        queue: name.into(),
        if_unused,
        if_empty,
        nowait: false,
    }))
}

#[derive(Clone, Copy, Default)]
struct XFlags {
    passive: bool,
    durable: bool,
    auto_delete: bool,
    internal: bool,
}

fn xdecl(name: &str, kind: &str, f: XFlags, args: FieldTable) -> AMQPClass {
    AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
        exchange: name.into(),
        kind: kind.into(),
        passive: f.passive,
        durable: f.durable,
        auto_delete: f.auto_delete,
        internal: f.internal,
        nowait: false,
        arguments: args,
    }))
}
fn x(name: &str, kind: &str) -> AMQPClass {
    xdecl(name, kind, XFlags::default(), FieldTable::default())
}
fn xdelete(name: &str, if_unused: bool) -> AMQPClass {
    AMQPClass::Exchange(exchange::AMQPMethod::Delete(exchange::Delete {
        exchange: name.into(),
        if_unused,
        nowait: false,
    }))
}
fn xbind(dst: &str, src: &str, rk: &str) -> AMQPClass {
    AMQPClass::Exchange(exchange::AMQPMethod::Bind(exchange::Bind {
        destination: dst.into(),
        source: src.into(),
        routing_key: rk.into(),
        nowait: false,
        arguments: FieldTable::default(),
    }))
}
fn xunbind(dst: &str, src: &str, rk: &str) -> AMQPClass {
    AMQPClass::Exchange(exchange::AMQPMethod::Unbind(exchange::Unbind {
        destination: dst.into(),
        source: src.into(),
        routing_key: rk.into(),
        nowait: false,
        arguments: FieldTable::default(),
    }))
}

fn get(name: &str, no_ack: bool) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
        queue: name.into(),
        no_ack,
    }))
}
fn ack(tag: u64, multiple: bool) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
        delivery_tag: tag,
        multiple,
    }))
}
fn nack(tag: u64, multiple: bool, requeue: bool) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
        delivery_tag: tag,
        multiple,
        requeue,
    }))
}
fn reject(tag: u64, requeue: bool) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
        delivery_tag: tag,
        requeue,
    }))
}
fn consume(name: &str, tag: &str, no_ack: bool, exclusive: bool, args: FieldTable) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
        queue: name.into(),
        consumer_tag: tag.into(),
        no_local: false,
        no_ack,
        exclusive,
        nowait: false,
        arguments: args,
    }))
}
fn cancel(tag: &str) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
        consumer_tag: tag.into(),
        nowait: false,
    }))
}
fn qos(count: u16, global: bool) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
        prefetch_count: count,
        global,
    }))
}

/// A method frame on channel 1 from its raw arguments (what the codec cannot express).
fn raw_method(class: u16, method: u16, args: &[u8]) -> Step {
    let mut payload = class.to_be_bytes().to_vec();
    payload.extend(method.to_be_bytes());
    payload.extend(args);
    let mut bytes = vec![1u8, 0, 1];
    bytes.extend((payload.len() as u32).to_be_bytes());
    bytes.extend(payload);
    bytes.push(0xCE);
    Step::Raw { conn: 0, bytes }
}
fn recover(requeue: bool) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Recover(basic::Recover { requeue }))
}
fn chan_open() -> AMQPClass {
    AMQPClass::Channel(chan::AMQPMethod::Open(chan::Open {}))
}
fn chan_close() -> AMQPClass {
    AMQPClass::Channel(chan::AMQPMethod::Close(chan::Close {
        reply_code: 200,
        reply_text: "bye".into(),
        class_id: 0,
        method_id: 0,
    }))
}
fn flow(active: bool) -> AMQPClass {
    AMQPClass::Channel(chan::AMQPMethod::Flow(chan::Flow { active }))
}
fn tx_select() -> AMQPClass {
    AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {}))
}
fn tx_commit() -> AMQPClass {
    AMQPClass::Tx(tx::AMQPMethod::Commit(tx::Commit {}))
}
fn tx_rollback() -> AMQPClass {
    AMQPClass::Tx(tx::AMQPMethod::Rollback(tx::Rollback {}))
}
fn confirm_select() -> AMQPClass {
    AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
        nowait: false,
    }))
}

/// Every scenario, in a stable order.
pub fn all() -> Vec<Scenario> {
    let mut out = Vec::new();
    queue_arguments(&mut out);
    queue_flags(&mut out);
    exchanges(&mut out);
    bindings(&mut out);
    basic_methods(&mut out);
    channels(&mut out);
    tx_and_confirms(&mut out);
    message_behaviour(&mut out);
    frames(&mut out);
    handshakes(&mut out);
    policies::policies(&mut out);
    out
}

/// Each `x-*` queue argument with valid and invalid values: the declare, the same declare
/// again, and a declare without it (the equivalence check).
fn queue_arguments(out: &mut Vec<Scenario>) {
    let long = |v: i64| AMQPValue::LongLongInt(v);
    let int = |v: i32| AMQPValue::LongInt(v);
    let cases: Vec<(&str, Vec<(&str, AMQPValue)>)> = vec![
        (
            "x-message-ttl",
            vec![
                ("0", int(0)),
                ("1000", int(1000)),
                ("-1", int(-1)),
                ("long", long(60000)),
                ("huge", long(1 << 40)),
                ("string", s("1000")),
                ("float", AMQPValue::Double(1.5)),
            ],
        ),
        (
            "x-expires",
            vec![
                ("0", int(0)),
                ("1000", int(1000)),
                ("-1", int(-1)),
                ("string", s("1000")),
            ],
        ),
        (
            "x-max-length",
            vec![
                ("0", int(0)),
                ("10", int(10)),
                ("-1", int(-1)),
                ("string", s("10")),
            ],
        ),
        (
            "x-max-length-bytes",
            vec![
                ("0", int(0)),
                ("100", int(100)),
                ("-1", int(-1)),
                ("string", s("100")),
            ],
        ),
        (
            "x-overflow",
            vec![
                ("drop-head", s("drop-head")),
                ("reject-publish", s("reject-publish")),
                ("reject-publish-dlx", s("reject-publish-dlx")),
                ("bogus", s("bogus")),
                ("int", int(1)),
            ],
        ),
        (
            "x-dead-letter-exchange",
            vec![("empty", s("")), ("named", s("dlx")), ("int", int(1))],
        ),
        (
            "x-dead-letter-routing-key",
            vec![("named", s("k")), ("int", int(1))],
        ),
        (
            "x-max-priority",
            vec![
                ("0", int(0)),
                ("10", int(10)),
                ("255", int(255)),
                ("256", int(256)),
                ("-1", int(-1)),
                ("string", s("5")),
            ],
        ),
        (
            "x-queue-mode",
            vec![
                ("lazy", s("lazy")),
                ("default", s("default")),
                ("bogus", s("bogus")),
            ],
        ),
        (
            "x-queue-type",
            vec![
                ("classic", s("classic")),
                ("bogus", s("bogus")),
                ("int", int(1)),
            ],
        ),
        (
            "x-single-active-consumer",
            vec![("true", AMQPValue::Boolean(true)), ("string", s("yes"))],
        ),
        (
            "x-queue-master-locator",
            vec![
                ("min-masters", s("min-masters")),
                ("client-local", s("client-local")),
                ("bogus", s("bogus")),
            ],
        ),
        (
            "x-unknown-argument",
            vec![("int", int(1)), ("string", s("v"))],
        ),
    ];
    for (arg, values) in cases {
        for (label, value) in values {
            let with = table(vec![(arg, value.clone())]);
            sc(out, format!("queue-arg/{arg}={label}"), |p| {
                let name = format!("{p}.q");
                vec![
                    call(1, qargs(&name, with.clone())),
                    call(1, qargs(&name, with.clone())),
                    call(1, q(&name)),
                ]
            });
        }
    }
    // Equivalence on a value change, for the arguments RabbitMQ compares.
    let changes: Vec<(&str, AMQPValue, AMQPValue)> = vec![
        ("x-message-ttl", int(1000), int(2000)),
        ("x-message-ttl", int(1000), long(1000)),
        ("x-expires", int(1000), int(2000)),
        ("x-max-length", int(10), int(20)),
        ("x-max-length-bytes", int(100), int(200)),
        ("x-overflow", s("drop-head"), s("reject-publish")),
        ("x-dead-letter-exchange", s("a"), s("b")),
        ("x-dead-letter-routing-key", s("a"), s("b")),
        ("x-max-priority", int(5), int(6)),
        ("x-queue-mode", s("lazy"), s("default")),
        (
            "x-single-active-consumer",
            AMQPValue::Boolean(true),
            AMQPValue::Boolean(false),
        ),
        ("x-unknown-argument", int(1), int(2)),
    ];
    for (arg, a, b) in changes {
        sc(out, format!("queue-arg-change/{arg}/{a:?}->{b:?}"), |p| {
            let name = format!("{p}.q");
            vec![
                call(1, qargs(&name, table(vec![(arg, a.clone())]))),
                call(1, qargs(&name, table(vec![(arg, b.clone())]))),
            ]
        });
    }
}

/// Queue declare flags, redeclares with other flags, exclusivity across connections,
/// passive declares, server-named queues, reserved names.
fn queue_flags(out: &mut Vec<Scenario>) {
    let flags = [
        ("plain", QFlags::default()),
        (
            "durable",
            QFlags {
                durable: true,
                ..Default::default()
            },
        ),
        (
            "exclusive",
            QFlags {
                exclusive: true,
                ..Default::default()
            },
        ),
        (
            "auto-delete",
            QFlags {
                auto_delete: true,
                ..Default::default()
            },
        ),
    ];
    for (a, fa) in flags {
        for (b, fb) in flags {
            sc(out, format!("queue-redeclare/{a}->{b}"), |p| {
                let name = format!("{p}.q");
                vec![
                    call(1, qdecl(&name, fa, FieldTable::default())),
                    call(1, qdecl(&name, fb, FieldTable::default())),
                ]
            });
        }
    }
    sc(out, "queue/passive-missing", |p| {
        vec![call(
            1,
            qdecl(
                &format!("{p}.q"),
                QFlags {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            ),
        )]
    });
    sc(out, "queue/passive-existing-other-flags", |p| {
        let name = format!("{p}.q");
        vec![
            call(
                1,
                qdecl(
                    &name,
                    QFlags {
                        durable: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                ),
            ),
            call(
                1,
                qdecl(
                    &name,
                    QFlags {
                        passive: true,
                        auto_delete: true,
                        ..Default::default()
                    },
                    table(vec![("x-message-ttl", AMQPValue::LongInt(5))]),
                ),
            ),
        ]
    });
    sc(out, "queue/server-named", |_| vec![call(1, q(""))]);
    sc(out, "queue/server-named-passive", |_| {
        vec![call(
            1,
            qdecl(
                "",
                QFlags {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            ),
        )]
    });
    sc(out, "queue/reserved-amq-prefix", |p| {
        vec![call(1, q(&format!("amq.{p}")))]
    });
    sc(out, "queue/reserved-amq-prefix-passive", |p| {
        vec![call(
            1,
            qdecl(
                &format!("amq.{p}"),
                QFlags {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            ),
        )]
    });
    sc(out, "queue/exclusive-other-connection", |p| {
        let name = format!("{p}.q");
        let ex = QFlags {
            exclusive: true,
            ..Default::default()
        };
        vec![
            call(1, qdecl(&name, ex, FieldTable::default())),
            call_on(1, 1, q(&name)),
            call_on(
                2,
                1,
                qdecl(
                    &name,
                    QFlags {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                ),
            ),
            call_on(3, 1, qdelete(&name, false, false)),
            call_on(4, 1, qpurge(&name)),
            call_on(
                5,
                1,
                consume(&name, "", false, false, FieldTable::default()),
            ),
            call_on(6, 1, get(&name, true)),
        ]
    });
    for (label, if_unused, if_empty) in [
        ("plain", false, false),
        ("if-unused", true, false),
        ("if-empty", false, true),
        ("both", true, true),
    ] {
        sc(out, format!("queue-delete/missing/{label}"), |p| {
            vec![call(1, qdelete(&format!("{p}.q"), if_unused, if_empty))]
        });
        sc(out, format!("queue-delete/with-message/{label}"), |p| {
            let name = format!("{p}.q");
            vec![
                call(1, q(&name)),
                publish(1, "", &name, "m"),
                call(1, qdelete(&name, if_unused, if_empty)),
            ]
        });
        sc(out, format!("queue-delete/with-consumer/{label}"), |p| {
            let name = format!("{p}.q");
            vec![
                call(1, q(&name)),
                call(1, consume(&name, "c1", false, false, FieldTable::default())),
                call(1, qdelete(&name, if_unused, if_empty)),
            ]
        });
    }
    sc(out, "queue-purge/missing", |p| {
        vec![call(1, qpurge(&format!("{p}.q")))]
    });
    sc(out, "queue-purge/three", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            publish(1, "", &name, "a"),
            publish(1, "", &name, "b"),
            publish(1, "", &name, "c"),
            call(1, qpurge(&name)),
            call(1, get(&name, true)),
        ]
    });
    sc(out, "queue-purge/with-unacked", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            publish(1, "", &name, "a"),
            publish(1, "", &name, "b"),
            call(1, get(&name, false)),
            call(1, qpurge(&name)),
            cast(1, reject(1, true)),
            call(1, get(&name, true)),
        ]
    });
    sc(out, "queue-declare/counts", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            publish(1, "", &name, "a"),
            publish(1, "", &name, "b"),
            call(1, consume(&name, "c1", false, false, FieldTable::default())),
            wait(1, 2),
            call(1, q(&name)),
        ]
    });
}

/// Exchange declares by type and flags, redeclares, the built-in exchanges, deletes.
fn exchanges(out: &mut Vec<Scenario>) {
    for kind in [
        "direct",
        "fanout",
        "topic",
        "headers",
        "x-bogus",
        "bogus",
        "x-consistent-hash",
    ] {
        sc(out, format!("exchange-type/{kind}"), |p| {
            let name = format!("{p}.x");
            vec![call(1, x(&name, kind)), call(1, x(&name, kind))]
        });
    }
    let flags = [
        ("plain", XFlags::default()),
        (
            "durable",
            XFlags {
                durable: true,
                ..Default::default()
            },
        ),
        (
            "auto-delete",
            XFlags {
                auto_delete: true,
                ..Default::default()
            },
        ),
        (
            "internal",
            XFlags {
                internal: true,
                ..Default::default()
            },
        ),
    ];
    for (a, fa) in flags {
        for (b, fb) in flags {
            sc(out, format!("exchange-redeclare/{a}->{b}"), |p| {
                let name = format!("{p}.x");
                vec![
                    call(1, xdecl(&name, "direct", fa, FieldTable::default())),
                    call(1, xdecl(&name, "direct", fb, FieldTable::default())),
                ]
            });
        }
    }
    for (a, b) in [
        ("direct", "fanout"),
        ("topic", "headers"),
        ("fanout", "direct"),
    ] {
        sc(out, format!("exchange-redeclare-type/{a}->{b}"), |p| {
            let name = format!("{p}.x");
            vec![call(1, x(&name, a)), call(1, x(&name, b))]
        });
    }
    for (label, a, b) in [
        (
            "add-arg",
            FieldTable::default(),
            table(vec![("x-foo", s("1"))]),
        ),
        (
            "drop-arg",
            table(vec![("x-foo", s("1"))]),
            FieldTable::default(),
        ),
        (
            "change-arg",
            table(vec![("x-foo", s("1"))]),
            table(vec![("x-foo", s("2"))]),
        ),
        (
            "alternate-exchange",
            table(vec![("alternate-exchange", s("ae1"))]),
            table(vec![("alternate-exchange", s("ae2"))]),
        ),
    ] {
        sc(out, format!("exchange-redeclare-args/{label}"), |p| {
            let name = format!("{p}.x");
            vec![
                call(1, xdecl(&name, "direct", XFlags::default(), a.clone())),
                call(1, xdecl(&name, "direct", XFlags::default(), b.clone())),
            ]
        });
    }
    for (name, kind) in [
        ("amq.direct", "direct"),
        ("amq.fanout", "fanout"),
        ("amq.topic", "topic"),
        ("amq.headers", "headers"),
        ("amq.match", "headers"),
        ("amq.direct", "fanout"),
    ] {
        let durable = XFlags {
            durable: true,
            ..Default::default()
        };
        sc(
            out,
            format!("exchange-builtin/{name}/{kind}/durable"),
            |_| vec![call(1, xdecl(name, kind, durable, FieldTable::default()))],
        );
        sc(
            out,
            format!("exchange-builtin/{name}/{kind}/transient"),
            |_| vec![call(1, x(name, kind))],
        );
        sc(
            out,
            format!("exchange-builtin/{name}/{kind}/passive"),
            |_| {
                vec![call(
                    1,
                    xdecl(
                        name,
                        kind,
                        XFlags {
                            passive: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    ),
                )]
            },
        );
    }
    sc(out, "exchange/default-declare", |_| {
        vec![call(1, x("", "direct"))]
    });
    sc(out, "exchange/default-delete", |_| {
        vec![call(1, xdelete("", false))]
    });
    sc(out, "exchange/amq-prefix-new", |p| {
        vec![call(1, x(&format!("amq.{p}"), "direct"))]
    });
    sc(out, "exchange/amq-delete-builtin", |_| {
        vec![call(1, xdelete("amq.direct", false))]
    });
    sc(out, "exchange/passive-missing", |p| {
        vec![call(
            1,
            xdecl(
                &format!("{p}.x"),
                "direct",
                XFlags {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            ),
        )]
    });
    sc(out, "exchange/passive-other-type", |p| {
        let name = format!("{p}.x");
        vec![
            call(1, x(&name, "fanout")),
            call(
                1,
                xdecl(
                    &name,
                    "direct",
                    XFlags {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                ),
            ),
        ]
    });
    sc(out, "exchange-delete/missing", |p| {
        vec![call(1, xdelete(&format!("{p}.x"), false))]
    });
    sc(out, "exchange-delete/missing-if-unused", |p| {
        vec![call(1, xdelete(&format!("{p}.x"), true))]
    });
    sc(out, "exchange-delete/if-unused-bound", |p| {
        let (xn, qn) = (format!("{p}.x"), format!("{p}.q"));
        vec![
            call(1, x(&xn, "direct")),
            call(1, q(&qn)),
            call(1, qbind(&qn, &xn, "k", FieldTable::default())),
            call(1, xdelete(&xn, true)),
            call(1, xdelete(&xn, false)),
        ]
    });
    sc(out, "exchange-delete/if-unused-as-destination", |p| {
        let (a, b) = (format!("{p}.a"), format!("{p}.b"));
        vec![
            call(1, x(&a, "direct")),
            call(1, x(&b, "direct")),
            call(1, xbind(&b, &a, "k")),
            call(1, xdelete(&b, true)),
        ]
    });
    sc(out, "exchange/publish-to-internal", |p| {
        let name = format!("{p}.x");
        vec![
            call(
                1,
                xdecl(
                    &name,
                    "direct",
                    XFlags {
                        internal: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                ),
            ),
            publish(1, &name, "k", "m"),
        ]
    });
    sc(out, "exchange/auto-delete-after-unbind", |p| {
        let (xn, qn) = (format!("{p}.x"), format!("{p}.q"));
        let ad = XFlags {
            auto_delete: true,
            ..Default::default()
        };
        vec![
            call(1, xdecl(&xn, "direct", ad, FieldTable::default())),
            call(1, q(&qn)),
            call(1, qbind(&qn, &xn, "k", FieldTable::default())),
            call(1, qunbind(&qn, &xn, "k")),
            call(
                1,
                xdecl(
                    &xn,
                    "direct",
                    XFlags {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                ),
            ),
        ]
    });
}

/// Queue and exchange bindings: missing ends, idempotence, the default exchange, headers
/// arguments.
fn bindings(out: &mut Vec<Scenario>) {
    sc(out, "bind/missing-queue", |p| {
        vec![call(
            1,
            qbind(&format!("{p}.q"), "amq.direct", "k", FieldTable::default()),
        )]
    });
    sc(out, "bind/missing-exchange", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            call(
                1,
                qbind(&name, &format!("{p}.x"), "k", FieldTable::default()),
            ),
        ]
    });
    sc(out, "bind/twice", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            call(1, qbind(&name, "amq.direct", "k", FieldTable::default())),
            call(1, qbind(&name, "amq.direct", "k", FieldTable::default())),
        ]
    });
    sc(out, "bind/default-exchange", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            call(1, qbind(&name, "", "k", FieldTable::default())),
        ]
    });
    sc(out, "unbind/default-exchange", |p| {
        let name = format!("{p}.q");
        vec![call(1, q(&name)), call(1, qunbind(&name, "", &name))]
    });
    sc(out, "unbind/never-bound", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            call(1, qunbind(&name, "amq.direct", "k")),
        ]
    });
    sc(out, "unbind/missing-queue", |p| {
        vec![call(1, qunbind(&format!("{p}.q"), "amq.direct", "k"))]
    });
    sc(out, "unbind/missing-exchange", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            call(1, qunbind(&name, &format!("{p}.x"), "k")),
        ]
    });
    sc(out, "unbind/twice", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            call(1, qbind(&name, "amq.direct", "k", FieldTable::default())),
            call(1, qunbind(&name, "amq.direct", "k")),
            call(1, qunbind(&name, "amq.direct", "k")),
        ]
    });
    for (label, args) in [
        (
            "x-match-all",
            table(vec![("x-match", s("all")), ("a", s("1"))]),
        ),
        (
            "x-match-any",
            table(vec![("x-match", s("any")), ("a", s("1"))]),
        ),
        (
            "x-match-bogus",
            table(vec![("x-match", s("bogus")), ("a", s("1"))]),
        ),
        (
            "x-match-int",
            table(vec![("x-match", AMQPValue::LongInt(1))]),
        ),
        ("no-x-match", table(vec![("a", s("1"))])),
        (
            "x-match-all-with-x",
            table(vec![("x-match", s("all-with-x")), ("a", s("1"))]),
        ),
    ] {
        sc(out, format!("bind-headers/{label}"), |p| {
            let name = format!("{p}.q");
            vec![
                call(1, q(&name)),
                call(1, qbind(&name, "amq.headers", "", args.clone())),
            ]
        });
    }
    sc(out, "exchange-bind/missing-source", |p| {
        let d = format!("{p}.d");
        vec![
            call(1, x(&d, "fanout")),
            call(1, xbind(&d, &format!("{p}.s"), "k")),
        ]
    });
    sc(out, "exchange-bind/missing-destination", |p| {
        vec![call(1, xbind(&format!("{p}.d"), "amq.direct", "k"))]
    });
    sc(out, "exchange-unbind/never-bound", |p| {
        let d = format!("{p}.d");
        vec![
            call(1, x(&d, "fanout")),
            call(1, xunbind(&d, "amq.direct", "k")),
        ]
    });
    sc(out, "exchange-unbind/missing-both", |p| {
        vec![call(1, xunbind(&format!("{p}.d"), &format!("{p}.s"), "k"))]
    });
    sc(out, "exchange-bind/route-through", |p| {
        let (d, qn) = (format!("{p}.d"), format!("{p}.q"));
        vec![
            call(1, x(&d, "fanout")),
            call(1, q(&qn)),
            call(1, qbind(&qn, &d, "", FieldTable::default())),
            call(1, xbind(&d, "amq.direct", "k")),
            publish(1, "amq.direct", "k", "through"),
            call(1, get(&qn, true)),
        ]
    });
    sc(out, "bind/to-default-named-exchange", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            call(1, qbind(&name, "amq.default", "k", FieldTable::default())),
        ]
    });
}

/// basic.* and their error cases.
fn basic_methods(out: &mut Vec<Scenario>) {
    sc(out, "get/empty", |p| {
        let name = format!("{p}.q");
        vec![call(1, q(&name)), call(1, get(&name, true))]
    });
    sc(out, "get/missing-queue", |p| {
        vec![call(1, get(&format!("{p}.q"), true))]
    });
    sc(out, "get/one-with-ack", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            publish(1, "", &name, "one"),
            publish(1, "", &name, "two"),
            call(1, get(&name, false)),
            cast(1, ack(1, false)),
            call(1, get(&name, false)),
        ]
    });
    for (label, settle) in [
        ("ack-unknown", ack(7, false)),
        ("ack-unknown-multiple", ack(7, true)),
        ("ack-zero-multiple", ack(0, true)),
        ("nack-unknown", nack(7, false, true)),
        ("reject-unknown", reject(7, true)),
    ] {
        sc(out, format!("settle/{label}"), |p| {
            let name = format!("{p}.q");
            vec![call(1, q(&name)), cast(1, settle.clone())]
        });
    }
    sc(out, "settle/ack-twice", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            publish(1, "", &name, "m"),
            call(1, get(&name, false)),
            cast(1, ack(1, false)),
            cast(1, ack(1, false)),
        ]
    });
    sc(out, "settle/ack-multiple-all", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            publish(1, "", &name, "a"),
            publish(1, "", &name, "b"),
            call(1, get(&name, false)),
            call(1, get(&name, false)),
            cast(1, ack(0, true)),
            call(1, q(&name)),
        ]
    });
    for (label, how) in [
        ("nack-requeue", nack(1, false, true)),
        ("nack-drop", nack(1, false, false)),
        ("reject-requeue", reject(1, true)),
        ("reject-drop", reject(1, false)),
        ("nack-multiple-requeue", nack(2, true, true)),
    ] {
        sc(out, format!("settle/{label}"), |p| {
            let name = format!("{p}.q");
            vec![
                call(1, q(&name)),
                publish(1, "", &name, "a"),
                publish(1, "", &name, "b"),
                call(1, get(&name, false)),
                call(1, get(&name, false)),
                cast(1, how.clone()),
                call(1, get(&name, true)),
                call(1, get(&name, true)),
            ]
        });
    }
    sc(out, "settle/no-ack-get-then-ack", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            publish(1, "", &name, "a"),
            call(1, get(&name, true)),
            cast(1, ack(1, false)),
        ]
    });
    for (label, count, global) in [
        ("count", 10, false),
        ("count-global", 10, true),
        ("zero", 0, false),
        ("max", 65535, false),
    ] {
        sc(out, format!("qos/{label}"), |_| {
            vec![call(1, qos(count, global))]
        });
    }
    // prefetch_size 1000, prefetch_count 0, global false.
    sc(out, "qos/size", |_| {
        vec![raw_method(60, 10, &[0, 0, 3, 0xE8, 0, 0, 0])]
    });
    sc(out, "qos/global-and-consumer", |p| {
        let name = format!("{p}.q");
        let mut steps = vec![
            call(1, q(&name)),
            call(1, qos(1, true)),
            call(1, qos(2, false)),
        ];
        for m in ["a", "b", "c", "d"] {
            steps.push(publish(1, "", &name, m));
        }
        steps.push(call(
            1,
            consume(&name, "c1", false, false, FieldTable::default()),
        ));
        steps.push(wait(1, 1));
        steps.push(call(1, q(&name)));
        steps
    });
    sc(out, "qos/prefetch-one", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            call(1, qos(1, false)),
            publish(1, "", &name, "a"),
            publish(1, "", &name, "b"),
            call(1, consume(&name, "c1", false, false, FieldTable::default())),
            wait(1, 1),
            call(1, q(&name)),
            cast_await(1, ack(1, false), 1),
        ]
    });
    sc(out, "consume/missing-queue", |p| {
        vec![call(
            1,
            consume(&format!("{p}.q"), "c1", false, false, FieldTable::default()),
        )]
    });
    sc(out, "consume/duplicate-tag", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            call(1, consume(&name, "c1", false, false, FieldTable::default())),
            call(1, consume(&name, "c1", false, false, FieldTable::default())),
        ]
    });
    sc(out, "consume/exclusive-then-other", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            call(1, consume(&name, "c1", false, true, FieldTable::default())),
            call_on(
                1,
                1,
                consume(&name, "c2", false, false, FieldTable::default()),
            ),
        ]
    });
    sc(out, "consume/other-then-exclusive", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            call(1, consume(&name, "c1", false, false, FieldTable::default())),
            call_on(
                1,
                1,
                consume(&name, "c2", false, true, FieldTable::default()),
            ),
        ]
    });
    sc(out, "consume/server-tag", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            call(1, consume(&name, "", true, false, FieldTable::default())),
        ]
    });
    for (label, args) in [
        (
            "priority",
            table(vec![("x-priority", AMQPValue::LongInt(5))]),
        ),
        ("priority-string", table(vec![("x-priority", s("5"))])),
        (
            "cancel-on-ha-failover",
            table(vec![("x-cancel-on-ha-failover", AMQPValue::Boolean(true))]),
        ),
        ("unknown-arg", table(vec![("x-foo", s("bar"))])),
    ] {
        sc(out, format!("consume-args/{label}"), |p| {
            let name = format!("{p}.q");
            vec![
                call(1, q(&name)),
                call(1, consume(&name, "c1", false, false, args.clone())),
            ]
        });
    }
    sc(out, "cancel/unknown-tag", |_| vec![call(1, cancel("nope"))]);
    sc(out, "cancel/then-deliveries-stop", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            call(1, consume(&name, "c1", true, false, FieldTable::default())),
            call(1, cancel("c1")),
            publish(1, "", &name, "after"),
            call(1, get(&name, true)),
        ]
    });
    sc(out, "consume/deliver-no-ack", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            publish(1, "", &name, "a"),
            call(1, consume(&name, "c1", true, false, FieldTable::default())),
            wait(1, 1),
        ]
    });
    sc(out, "consume/queue-deleted-cancels", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            call(1, consume(&name, "c1", true, false, FieldTable::default())),
            call_on(1, 1, qdelete(&name, false, false)),
            wait(1, 1),
        ]
    });
    for requeue in [true, false] {
        sc(out, format!("recover/requeue={requeue}"), |p| {
            let name = format!("{p}.q");
            vec![
                call(1, q(&name)),
                publish(1, "", &name, "a"),
                call(1, get(&name, false)),
                call(1, recover(requeue)),
                call(1, get(&name, true)),
            ]
        });
    }
    sc(out, "recover-async", |_| {
        vec![cast(
            1,
            AMQPClass::Basic(basic::AMQPMethod::RecoverAsync(basic::RecoverAsync {
                requeue: true,
            })),
        )]
    });
    sc(out, "publish/missing-exchange", |p| {
        vec![publish(1, &format!("{p}.x"), "k", "m")]
    });
    sc(out, "publish/unroutable", |p| {
        vec![publish(1, "amq.direct", p, "m")]
    });
    sc(out, "publish/mandatory-unroutable", |p| {
        vec![publish_with(
            1,
            "amq.direct",
            p,
            true,
            BasicProperties::default(),
            "m",
        )]
    });
    sc(out, "publish/mandatory-default-missing-queue", |p| {
        vec![publish_with(
            1,
            "",
            &format!("{p}.q"),
            true,
            BasicProperties::default(),
            "m",
        )]
    });
    sc(out, "publish/immediate", |p| {
        let name = format!("{p}.q");
        let frames = [
            AMQPFrame::Method(
                1,
                AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                    exchange: "".into(),
                    routing_key: name.as_str().into(),
                    mandatory: false,
                    immediate: true,
                })),
            ),
            AMQPFrame::Header(
                1,
                AMQPContentHeader {
                    class_id: 60,
                    body_size: 1,
                    properties: BasicProperties::default(),
                },
            ),
            AMQPFrame::Body(1, b"m".to_vec()),
        ];
        vec![
            call(1, q(&name)),
            Step::Raw {
                conn: 0,
                bytes: frames.iter().flat_map(super::common::encode).collect(),
            },
        ]
    });
    sc(out, "publish/user-id-matching", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            publish_with(
                1,
                "",
                &name,
                false,
                BasicProperties::default().with_user_id("guest".into()),
                "m",
            ),
            call(1, get(&name, true)),
        ]
    });
    sc(out, "publish/user-id-other", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            publish_with(
                1,
                "",
                &name,
                false,
                BasicProperties::default().with_user_id("someone".into()),
                "m",
            ),
        ]
    });
    for (label, exp) in [
        ("bogus", "abc"),
        ("negative", "-5"),
        ("zero", "0"),
        ("ok", "60000"),
    ] {
        sc(out, format!("publish/expiration-{label}"), |p| {
            let name = format!("{p}.q");
            vec![
                call(1, q(&name)),
                publish_with(
                    1,
                    "",
                    &name,
                    false,
                    BasicProperties::default().with_expiration(exp.into()),
                    "m",
                ),
                call(1, get(&name, true)),
            ]
        });
    }
    sc(out, "publish/cc-bcc", |p| {
        let (a, b, c) = (format!("{p}.a"), format!("{p}.b"), format!("{p}.c"));
        let mut headers = FieldTable::default();
        headers.insert("CC".into(), AMQPValue::FieldArray(vec![s(&b)].into()));
        headers.insert("BCC".into(), AMQPValue::FieldArray(vec![s(&c)].into()));
        vec![
            call(1, q(&a)),
            call(1, q(&b)),
            call(1, q(&c)),
            publish_with(
                1,
                "",
                &a,
                false,
                BasicProperties::default().with_headers(headers),
                "m",
            ),
            call(1, get(&a, true)),
            call(1, get(&b, true)),
            call(1, get(&c, true)),
        ]
    });
    sc(out, "publish/cc-not-array", |p| {
        let a = format!("{p}.a");
        let mut headers = FieldTable::default();
        headers.insert("CC".into(), s("x"));
        vec![
            call(1, q(&a)),
            publish_with(
                1,
                "",
                &a,
                false,
                BasicProperties::default().with_headers(headers),
                "m",
            ),
        ]
    });
}

/// channel.* and methods on channels in the wrong state.
fn channels(out: &mut Vec<Scenario>) {
    sc(out, "channel/open-twice", |_| vec![call(1, chan_open())]);
    sc(out, "channel/open-second", |_| {
        vec![call(2, chan_open()), call(2, chan_close())]
    });
    sc(out, "channel/method-before-open", |p| {
        vec![call(3, q(&format!("{p}.q")))]
    });
    sc(out, "channel/close-then-use", |p| {
        vec![call(1, chan_close()), call(1, q(&format!("{p}.q")))]
    });
    sc(out, "channel/flow-active", |_| vec![call(1, flow(true))]);
    sc(out, "channel/flow-inactive", |_| vec![call(1, flow(false))]);
    sc(out, "channel/close-ok-unsolicited", |_| {
        vec![cast(
            1,
            AMQPClass::Channel(chan::AMQPMethod::CloseOk(chan::CloseOk {})),
        )]
    });
    sc(out, "channel/declare-ok-from-client", |p| {
        vec![cast(
            1,
            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                queue: format!("{p}.q").as_str().into(),
                message_count: 0,
                consumer_count: 0,
            })),
        )]
    });
    // Methods only a server sends, sent by the client (with no content for those that
    // carry one would: that is a frame-level scenario).
    let server_methods: Vec<(&str, AMQPClass)> = vec![
        (
            "channel.open-ok",
            AMQPClass::Channel(chan::AMQPMethod::OpenOk(chan::OpenOk {})),
        ),
        (
            "channel.flow-ok",
            AMQPClass::Channel(chan::AMQPMethod::FlowOk(chan::FlowOk { active: true })),
        ),
        (
            "exchange.declare-ok",
            AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})),
        ),
        (
            "exchange.delete-ok",
            AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {})),
        ),
        (
            "exchange.bind-ok",
            AMQPClass::Exchange(exchange::AMQPMethod::BindOk(exchange::BindOk {})),
        ),
        (
            "exchange.unbind-ok",
            AMQPClass::Exchange(exchange::AMQPMethod::UnbindOk(exchange::UnbindOk {})),
        ),
        (
            "queue.bind-ok",
            AMQPClass::Queue(queue::AMQPMethod::BindOk(queue::BindOk {})),
        ),
        (
            "queue.purge-ok",
            AMQPClass::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk {
                message_count: 0,
            })),
        ),
        (
            "queue.delete-ok",
            AMQPClass::Queue(queue::AMQPMethod::DeleteOk(queue::DeleteOk {
                message_count: 0,
            })),
        ),
        (
            "queue.unbind-ok",
            AMQPClass::Queue(queue::AMQPMethod::UnbindOk(queue::UnbindOk {})),
        ),
        (
            "basic.qos-ok",
            AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})),
        ),
        (
            "basic.consume-ok",
            AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                consumer_tag: "ctag".into(),
            })),
        ),
        (
            "basic.cancel-ok",
            AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                consumer_tag: "ctag".into(),
            })),
        ),
        (
            "basic.get-empty",
            AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
        ),
        (
            "basic.recover-ok",
            AMQPClass::Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {})),
        ),
        (
            "tx.select-ok",
            AMQPClass::Tx(tx::AMQPMethod::SelectOk(tx::SelectOk {})),
        ),
        (
            "tx.commit-ok",
            AMQPClass::Tx(tx::AMQPMethod::CommitOk(tx::CommitOk {})),
        ),
        (
            "tx.rollback-ok",
            AMQPClass::Tx(tx::AMQPMethod::RollbackOk(tx::RollbackOk {})),
        ),
        (
            "confirm.select-ok",
            AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
        ),
    ];
    for (name, m) in server_methods {
        sc(out, format!("channel/{name}-from-client"), |_| {
            vec![cast(1, m)]
        });
    }
    sc(out, "channel/id-zero", |p| {
        vec![call(0, q(&format!("{p}.q")))]
    });
    for (label, secret) in [("same", "guest"), ("wrong", "not-the-password")] {
        sc(out, format!("connection/update-secret-{label}"), |p| {
            vec![
                call(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::UpdateSecret(
                        connection::UpdateSecret {
                            new_secret: LongString::from(secret),
                            reason: "rotation".into(),
                        },
                    )),
                ),
                call(1, q(&format!("{p}.q"))),
            ]
        });
    }
}

/// tx.* and confirm.* alone and together.
fn tx_and_confirms(out: &mut Vec<Scenario>) {
    sc(out, "tx/commit-without-select", |_| {
        vec![call(1, tx_commit())]
    });
    sc(out, "tx/rollback-without-select", |_| {
        vec![call(1, tx_rollback())]
    });
    sc(out, "tx/select-twice", |_| {
        vec![call(1, tx_select()), call(1, tx_select())]
    });
    sc(out, "tx/then-confirm", |_| {
        vec![call(1, tx_select()), call(1, confirm_select())]
    });
    sc(out, "confirm/then-tx", |_| {
        vec![call(1, confirm_select()), call(1, tx_select())]
    });
    sc(out, "confirm/select-twice", |_| {
        vec![call(1, confirm_select()), call(1, confirm_select())]
    });
    sc(out, "tx/publish-commit-get", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            call(1, tx_select()),
            publish(1, "", &name, "a"),
            call(1, get(&name, true)),
            call(1, tx_commit()),
            call(1, get(&name, true)),
        ]
    });
    sc(out, "tx/publish-rollback", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            call(1, tx_select()),
            publish(1, "", &name, "a"),
            call(1, tx_rollback()),
            call(1, tx_commit()),
            call(1, get(&name, true)),
        ]
    });
    sc(out, "tx/ack-rollback", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            publish(1, "", &name, "a"),
            call(1, tx_select()),
            call(1, get(&name, false)),
            cast(1, ack(1, false)),
            call(1, tx_rollback()),
            call(1, q(&name)),
        ]
    });
    sc(out, "tx/ack-unknown-in-tx", |_| {
        vec![
            call(1, tx_select()),
            cast(1, ack(9, false)),
            call(1, tx_commit()),
        ]
    });
    sc(out, "tx/mandatory-unroutable", |p| {
        vec![
            call(1, tx_select()),
            publish_with(1, "amq.direct", p, true, BasicProperties::default(), "m"),
            call(1, tx_commit()),
        ]
    });
    sc(out, "tx/reject-publish-queue", |p| {
        let name = format!("{p}.q");
        vec![
            call(
                1,
                qargs(
                    &name,
                    table(vec![
                        ("x-max-length", AMQPValue::LongInt(0)),
                        ("x-overflow", s("reject-publish")),
                    ]),
                ),
            ),
            call(1, tx_select()),
            publish(1, "", &name, "m"),
            call(1, tx_commit()),
        ]
    });
    sc(out, "confirm/publish-routed", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            call(1, confirm_select()),
            publish_await(1, "", &name, false, 1),
        ]
    });
    sc(out, "confirm/publish-unroutable-mandatory", |p| {
        vec![
            call(1, confirm_select()),
            publish_await(1, "amq.direct", p, true, 2),
        ]
    });
    sc(out, "confirm/reject-publish-queue", |p| {
        let name = format!("{p}.q");
        vec![
            call(
                1,
                qargs(
                    &name,
                    table(vec![
                        ("x-max-length", AMQPValue::LongInt(1)),
                        ("x-overflow", s("reject-publish")),
                    ]),
                ),
            ),
            call(1, confirm_select()),
            publish_await(1, "", &name, false, 1),
            publish_await(1, "", &name, false, 1),
        ]
    });
}

/// What happens to messages: TTL, dead-lettering, length limits, priorities, properties.
fn message_behaviour(out: &mut Vec<Scenario>) {
    sc(out, "ttl/queue-zero-get", |p| {
        let name = format!("{p}.q");
        vec![
            call(
                1,
                qargs(&name, table(vec![("x-message-ttl", AMQPValue::LongInt(0))])),
            ),
            publish(1, "", &name, "m"),
            call(1, get(&name, true)),
        ]
    });
    sc(out, "ttl/per-message-zero-get", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            publish_with(
                1,
                "",
                &name,
                false,
                BasicProperties::default().with_expiration("0".into()),
                "m",
            ),
            call(1, get(&name, true)),
        ]
    });
    for (label, overflow) in [
        ("drop-head", "drop-head"),
        ("reject-publish", "reject-publish"),
    ] {
        sc(out, format!("max-length/{label}"), |p| {
            let name = format!("{p}.q");
            vec![
                call(
                    1,
                    qargs(
                        &name,
                        table(vec![
                            ("x-max-length", AMQPValue::LongInt(2)),
                            ("x-overflow", s(overflow)),
                        ]),
                    ),
                ),
                publish(1, "", &name, "a"),
                publish(1, "", &name, "b"),
                publish(1, "", &name, "c"),
                call(1, get(&name, true)),
                call(1, get(&name, true)),
                call(1, get(&name, true)),
            ]
        });
    }
    sc(out, "max-length-bytes/drop-head", |p| {
        let name = format!("{p}.q");
        vec![
            call(
                1,
                qargs(
                    &name,
                    table(vec![("x-max-length-bytes", AMQPValue::LongInt(5))]),
                ),
            ),
            publish(1, "", &name, "aaa"),
            publish(1, "", &name, "bbb"),
            call(1, get(&name, true)),
            call(1, get(&name, true)),
        ]
    });
    sc(out, "dead-letter/reject", |p| {
        let (name, dlq) = (format!("{p}.q"), format!("{p}.dlq"));
        vec![
            call(1, q(&dlq)),
            call(
                1,
                qargs(
                    &name,
                    table(vec![
                        ("x-dead-letter-exchange", s("")),
                        ("x-dead-letter-routing-key", s(&dlq)),
                    ]),
                ),
            ),
            publish(1, "", &name, "m"),
            call(1, get(&name, false)),
            cast(1, reject(1, false)),
            call(1, get(&dlq, true)),
        ]
    });
    sc(out, "dead-letter/expired", |p| {
        let (name, dlq) = (format!("{p}.q"), format!("{p}.dlq"));
        vec![
            call(1, q(&dlq)),
            call(
                1,
                qargs(
                    &name,
                    table(vec![
                        ("x-dead-letter-exchange", s("")),
                        ("x-dead-letter-routing-key", s(&dlq)),
                        ("x-message-ttl", AMQPValue::LongInt(0)),
                    ]),
                ),
            ),
            publish(1, "", &name, "m"),
            call(1, get(&name, true)),
            call(1, get(&dlq, true)),
        ]
    });
    sc(out, "dead-letter/max-length", |p| {
        let (name, dlq) = (format!("{p}.q"), format!("{p}.dlq"));
        vec![
            call(1, q(&dlq)),
            call(
                1,
                qargs(
                    &name,
                    table(vec![
                        ("x-dead-letter-exchange", s("")),
                        ("x-dead-letter-routing-key", s(&dlq)),
                        ("x-max-length", AMQPValue::LongInt(1)),
                    ]),
                ),
            ),
            publish(1, "", &name, "first"),
            publish(1, "", &name, "second"),
            call(1, get(&dlq, true)),
        ]
    });
    sc(out, "dead-letter/missing-exchange", |p| {
        let name = format!("{p}.q");
        vec![
            call(
                1,
                qargs(
                    &name,
                    table(vec![("x-dead-letter-exchange", s(&format!("{p}.none")))]),
                ),
            ),
            publish(1, "", &name, "m"),
            call(1, get(&name, false)),
            cast(1, reject(1, false)),
            call(1, q(&name)),
        ]
    });
    sc(out, "priority/order", |p| {
        let name = format!("{p}.q");
        let mut steps = vec![call(
            1,
            qargs(
                &name,
                table(vec![("x-max-priority", AMQPValue::LongInt(5))]),
            ),
        )];
        for (body, prio) in [
            ("low", 1u8),
            ("high", 5),
            ("mid", 3),
            ("over", 9),
            ("none", 0),
        ] {
            steps.push(publish_with(
                1,
                "",
                &name,
                false,
                BasicProperties::default().with_priority(prio),
                body,
            ));
        }
        for _ in 0..5 {
            steps.push(call(1, get(&name, true)));
        }
        steps
    });
    sc(out, "properties/round-trip", |p| {
        let name = format!("{p}.q");
        let mut headers = FieldTable::default();
        headers.insert("h-str".into(), s("v"));
        headers.insert("h-int".into(), AMQPValue::LongInt(-3));
        headers.insert("h-bool".into(), AMQPValue::Boolean(true));
        headers.insert(
            "h-table".into(),
            AMQPValue::FieldTable(table(vec![("in", AMQPValue::ShortShortInt(1))])),
        );
        let props = BasicProperties::default()
            .with_content_type("text/plain".into())
            .with_content_encoding("utf-8".into())
            .with_headers(headers)
            .with_delivery_mode(2)
            .with_priority(4)
            .with_correlation_id("corr".into())
            .with_reply_to("rt".into())
            .with_expiration("100000".into())
            .with_message_id("mid".into())
            .with_timestamp(1_700_000_000)
            .with_type("kind".into())
            .with_app_id("app".into());
        vec![
            call(1, q(&name)),
            publish_with(1, "", &name, false, props, "body"),
            call(1, get(&name, true)),
        ]
    });
    let singles: Vec<(&str, BasicProperties)> = vec![
        (
            "content-type",
            BasicProperties::default().with_content_type("a/b".into()),
        ),
        (
            "content-encoding",
            BasicProperties::default().with_content_encoding("gzip".into()),
        ),
        (
            "delivery-mode-1",
            BasicProperties::default().with_delivery_mode(1),
        ),
        (
            "delivery-mode-2",
            BasicProperties::default().with_delivery_mode(2),
        ),
        (
            "delivery-mode-3",
            BasicProperties::default().with_delivery_mode(3),
        ),
        ("priority", BasicProperties::default().with_priority(7)),
        (
            "correlation-id",
            BasicProperties::default().with_correlation_id("c".into()),
        ),
        (
            "reply-to",
            BasicProperties::default().with_reply_to("r".into()),
        ),
        (
            "message-id",
            BasicProperties::default().with_message_id("m".into()),
        ),
        ("timestamp", BasicProperties::default().with_timestamp(1)),
        ("type", BasicProperties::default().with_type("t".into())),
        ("app-id", BasicProperties::default().with_app_id("a".into())),
        (
            "cluster-id",
            BasicProperties::default().with_cluster_id("x".into()),
        ),
        (
            "headers-empty",
            BasicProperties::default().with_headers(FieldTable::default()),
        ),
    ];
    for (label, props) in singles {
        sc(out, format!("properties/{label}"), |p| {
            let name = format!("{p}.q");
            vec![
                call(1, q(&name)),
                publish_with(1, "", &name, false, props.clone(), "b"),
                call(1, get(&name, true)),
            ]
        });
    }
    for pattern in ["*", "#", "a.*", "a.#", "#.c", "*.b.*", "a.#.c", "a"] {
        for key in ["a", "a.b", "a.b.c", ""] {
            sc(out, format!("topic/{pattern}/{key}"), |p| {
                let (xn, qn) = (format!("{p}.x"), format!("{p}.q"));
                vec![
                    call(1, x(&xn, "topic")),
                    call(1, q(&qn)),
                    call(1, qbind(&qn, &xn, pattern, FieldTable::default())),
                    publish(1, &xn, key, "m"),
                    call(1, q(&qn)),
                ]
            });
        }
    }
    sc(out, "redelivered/flag-after-requeue", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            publish(1, "", &name, "m"),
            call(1, get(&name, false)),
            cast(1, nack(1, false, true)),
            call(1, get(&name, true)),
        ]
    });
    sc(out, "routing/topic-patterns", |p| {
        let (xn, qa, qb, qc) = (
            format!("{p}.x"),
            format!("{p}.a"),
            format!("{p}.b"),
            format!("{p}.c"),
        );
        vec![
            call(1, x(&xn, "topic")),
            call(1, q(&qa)),
            call(1, q(&qb)),
            call(1, q(&qc)),
            call(1, qbind(&qa, &xn, "a.*", FieldTable::default())),
            call(1, qbind(&qb, &xn, "a.#", FieldTable::default())),
            call(1, qbind(&qc, &xn, "#", FieldTable::default())),
            publish(1, &xn, "a.b.c", "m1"),
            publish(1, &xn, "a.b", "m2"),
            publish(1, &xn, "a", "m3"),
            call(1, q(&qa)),
            call(1, q(&qb)),
            call(1, q(&qc)),
        ]
    });
    sc(out, "routing/headers-any-all", |p| {
        let (xn, qa, qb) = (format!("{p}.x"), format!("{p}.any"), format!("{p}.all"));
        let mut headers = FieldTable::default();
        headers.insert("a".into(), s("1"));
        vec![
            call(1, x(&xn, "headers")),
            call(1, q(&qa)),
            call(1, q(&qb)),
            call(
                1,
                qbind(
                    &qa,
                    &xn,
                    "",
                    table(vec![("x-match", s("any")), ("a", s("1")), ("b", s("2"))]),
                ),
            ),
            call(
                1,
                qbind(
                    &qb,
                    &xn,
                    "",
                    table(vec![("x-match", s("all")), ("a", s("1")), ("b", s("2"))]),
                ),
            ),
            publish_with(
                1,
                &xn,
                "",
                false,
                BasicProperties::default().with_headers(headers),
                "m",
            ),
            call(1, q(&qa)),
            call(1, q(&qb)),
        ]
    });
    sc(out, "routing/alternate-exchange", |p| {
        let (xn, ae, qn) = (format!("{p}.x"), format!("{p}.ae"), format!("{p}.q"));
        vec![
            call(1, x(&ae, "fanout")),
            call(1, q(&qn)),
            call(1, qbind(&qn, &ae, "", FieldTable::default())),
            call(
                1,
                xdecl(
                    &xn,
                    "direct",
                    XFlags::default(),
                    table(vec![("alternate-exchange", s(&ae))]),
                ),
            ),
            publish_with(1, &xn, "nowhere", true, BasicProperties::default(), "m"),
            call(1, get(&qn, true)),
        ]
    });
}

/// A frame from raw parts: type, channel, payload, and the end octet.
fn raw_frame(kind: u8, channel: u16, payload: &[u8], end: u8) -> Vec<u8> {
    let mut bytes = vec![kind];
    bytes.extend(channel.to_be_bytes());
    bytes.extend((payload.len() as u32).to_be_bytes());
    bytes.extend(payload);
    bytes.push(end);
    bytes
}

fn raw(bytes: Vec<u8>) -> Step {
    Step::Raw { conn: 0, bytes }
}

/// Frame-level violations after the handshake (what no client library sends): RabbitMQ's
/// choice among 501, 502, 503, 504, 505 and 540, or a socket closed without a method.
fn frames(out: &mut Vec<Scenario>) {
    // queue.declare of "" on channel 1, as the codec writes it.
    let declare = super::common::encode(&AMQPFrame::Method(1, q("")));
    let declare_payload = declare[7..declare.len() - 1].to_vec();
    let publish = super::common::encode(&AMQPFrame::Method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: "nowhere".into(),
            mandatory: false,
            immediate: false,
        })),
    ));
    let header = |class: u16, size: u64| {
        let mut p = class.to_be_bytes().to_vec();
        p.extend([0, 0]);
        p.extend(size.to_be_bytes());
        p.extend([0, 0]);
        raw_frame(2, 1, &p, 0xCE)
    };
    sc(out, "frame/bad-end-octet", |_| {
        vec![raw(raw_frame(1, 1, &declare_payload, 0x00))]
    });
    sc(out, "frame/unknown-type", |_| {
        vec![raw(raw_frame(9, 1, b"x", 0xCE))]
    });
    sc(out, "frame/body-without-method", |_| {
        vec![raw(raw_frame(3, 1, b"stray", 0xCE))]
    });
    sc(out, "frame/header-without-method", |_| {
        vec![raw(header(60, 1))]
    });
    sc(out, "frame/heartbeat-on-a-channel", |_| {
        vec![raw(raw_frame(8, 1, b"", 0xCE))]
    });
    sc(out, "frame/method-on-closed-channel-9", |_| {
        vec![raw(raw_frame(1, 9, &declare_payload, 0xCE))]
    });
    sc(out, "frame/larger-than-frame-max", |_| {
        vec![raw(raw_frame(3, 1, &vec![b'x'; 200_000], 0xCE))]
    });
    sc(out, "frame/truncated-method", |_| {
        vec![raw(raw_frame(1, 1, &declare_payload[..6], 0xCE))]
    });
    sc(out, "frame/unknown-class", |_| {
        vec![raw(raw_frame(1, 1, &[0, 99, 0, 10], 0xCE))]
    });
    sc(out, "frame/unknown-method", |_| {
        vec![raw(raw_frame(1, 1, &[0, 50, 0, 99], 0xCE))]
    });
    sc(out, "frame/header-of-another-class", |_| {
        let mut b = publish.clone();
        b.extend(header(50, 1));
        vec![raw(b)]
    });
    sc(out, "frame/body-longer-than-header", |_| {
        let mut b = publish.clone();
        b.extend(header(60, 2));
        b.extend(raw_frame(3, 1, b"abcd", 0xCE));
        vec![raw(b)]
    });
    sc(out, "frame/method-inside-content", |_| {
        let mut b = publish.clone();
        b.extend(header(60, 4));
        b.extend(declare.clone());
        vec![raw(b)]
    });
    sc(out, "frame/empty-body-frame", |p| {
        let name = format!("{p}.q");
        let mut b = super::common::encode(&AMQPFrame::Method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "".into(),
                routing_key: name.as_str().into(),
                mandatory: false,
                immediate: false,
            })),
        ));
        b.extend(header(60, 2));
        b.extend(raw_frame(3, 1, b"", 0xCE));
        b.extend(raw_frame(3, 1, b"ab", 0xCE));
        vec![call(1, q(&name)), raw(b), call(1, get(&name, true))]
    });
    sc(out, "frame/protocol-header-mid-connection", |_| {
        vec![raw(b"AMQP\x00\x00\x09\x01".to_vec())]
    });
}

fn hello(bytes: Vec<u8>) -> Step {
    Step::Hello { conn: 0, bytes }
}

fn method0(m: connection::AMQPMethod) -> Vec<u8> {
    super::common::encode(&AMQPFrame::Method(0, AMQPClass::Connection(m)))
}

/// start-ok with `mechanism` and `response`; `close_on_refusal` sets the client capability
/// `authentication_failure_close`.
fn start_ok(mechanism: &str, response: &[u8], close_on_refusal: bool) -> Vec<u8> {
    let caps = table(vec![(
        "authentication_failure_close",
        AMQPValue::Boolean(close_on_refusal),
    )]);
    method0(connection::AMQPMethod::StartOk(connection::StartOk {
        client_properties: table(vec![
            ("product", s("warren-differential")),
            ("capabilities", AMQPValue::FieldTable(caps)),
        ]),
        mechanism: mechanism.into(),
        response: LongString::from(response.to_vec()),
        locale: "en_US".into(),
    }))
}

fn plain(user: &str, password: &str) -> Vec<u8> {
    start_ok("PLAIN", format!("\0{user}\0{password}").as_bytes(), true)
}

fn tune_ok(channel_max: u16, frame_max: u32, heartbeat: u16) -> Vec<u8> {
    method0(connection::AMQPMethod::TuneOk(connection::TuneOk {
        channel_max,
        frame_max,
        heartbeat,
    }))
}

fn open_vhost(vhost: &str) -> Vec<u8> {
    method0(connection::AMQPMethod::Open(connection::Open {
        virtual_host: vhost.into(),
    }))
}

/// The server's defaults, as RabbitMQ's and Warren's tune propose them.
const CHANNEL_MAX: u16 = 2047;
const FRAME_MAX: u32 = 131_072;

/// The connection handshake (what clients get wrong, or old and other protocols send):
/// protocol headers, mechanisms and credentials, tune-ok values, methods out of order.
/// RabbitMQ answers some with connection.close and closes others without a method.
fn handshakes(out: &mut Vec<Scenario>) {
    let header = || b"AMQP\x00\x00\x09\x01".to_vec();
    let headers: Vec<(&str, &[u8])> = vec![
        ("0-9-1", b"AMQP\x00\x00\x09\x01"),
        ("0-9", b"AMQP\x01\x01\x00\x09"),
        ("0-8", b"AMQP\x01\x01\x08\x00"),
        ("0-8-as-published", b"AMQP\x01\x01\x09\x01"),
        ("0-10", b"AMQP\x01\x01\x00\x0a"),
        ("1-0", b"AMQP\x00\x01\x00\x00"),
        ("1-0-sasl", b"AMQP\x03\x01\x00\x00"),
        ("0-9-2", b"AMQP\x00\x00\x09\x02"),
        ("http", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("lowercase", b"amqp\x00\x00\x09\x01"),
    ];
    for (name, bytes) in headers {
        sc(out, format!("handshake/header-{name}"), |_| {
            vec![hello(bytes.to_vec())]
        });
    }
    sc(out, "handshake/method-before-header", |_| {
        vec![hello(plain("guest", "guest"))]
    });

    // Complete handshakes, then a channel to show the connection works.
    let works = || call(1, AMQPClass::Channel(chan::AMQPMethod::Open(chan::Open {})));
    sc(out, "handshake/plain", |_| {
        vec![
            hello(header()),
            hello(plain("guest", "guest")),
            hello([tune_ok(CHANNEL_MAX, FRAME_MAX, 0), open_vhost("/")].concat()),
            works(),
        ]
    });
    sc(out, "handshake/amqplain", |_| {
        // AMQPLAIN's response is a field table without its length.
        let t = table(vec![("LOGIN", s("guest")), ("PASSWORD", s("guest"))]);
        let encoded = amq_protocol::types::generation::gen_field_table(&t)(
            amq_protocol::frame::WriteContext::from(Vec::new()),
        )
        .expect("encode a table")
        .write;
        vec![
            hello(header()),
            hello(start_ok("AMQPLAIN", &encoded[4..], true)),
            hello([tune_ok(CHANNEL_MAX, FRAME_MAX, 0), open_vhost("/")].concat()),
            works(),
        ]
    });
    // Tune-ok values: 0 means "no limit", which the server's own limit refuses.
    let tunes: Vec<(&str, u16, u32, u16)> = vec![
        ("as-proposed", CHANNEL_MAX, FRAME_MAX, 60),
        ("smaller", 10, 8192, 5),
        ("frame-max-minimum", CHANNEL_MAX, 4096, 0),
        ("frame-max-below-minimum", CHANNEL_MAX, 4095, 0),
        ("frame-max-above-server", CHANNEL_MAX, FRAME_MAX + 1, 0),
        ("frame-max-zero", CHANNEL_MAX, 0, 0),
        ("channel-max-above-server", CHANNEL_MAX + 1, FRAME_MAX, 0),
        ("channel-max-zero", 0, FRAME_MAX, 0),
        ("channel-max-one", 1, FRAME_MAX, 0),
        ("heartbeat-largest", CHANNEL_MAX, FRAME_MAX, u16::MAX),
    ];
    for (name, channel_max, frame_max, heartbeat) in tunes {
        sc(out, format!("handshake/tune-{name}"), |_| {
            vec![
                hello(header()),
                hello(plain("guest", "guest")),
                hello([tune_ok(channel_max, frame_max, heartbeat), open_vhost("/")].concat()),
                works(),
            ]
        });
    }
    // Mechanisms and credentials.
    let logins: Vec<(&str, Vec<u8>)> = vec![
        (
            "unknown-mechanism",
            start_ok("FOO", b"\0guest\0guest", true),
        ),
        (
            "mechanism-lowercase",
            start_ok("plain", b"\0guest\0guest", true),
        ),
        ("external-without-tls", start_ok("EXTERNAL", b"", true)),
        ("wrong-password", plain("guest", "nope")),
        ("unknown-user", plain("nobody", "guest")),
        (
            "wrong-password-no-close-capability",
            start_ok("PLAIN", b"\0guest\0nope", false),
        ),
        ("plain-malformed", start_ok("PLAIN", b"guest", true)),
        ("plain-empty", start_ok("PLAIN", b"", true)),
        (
            "amqplain-malformed",
            start_ok("AMQPLAIN", b"\x05LOGIN", true),
        ),
    ];
    for (name, bytes) in logins {
        sc(out, format!("handshake/login-{name}"), |_| {
            vec![hello(header()), hello(bytes)]
        });
    }
    sc(out, "handshake/open-unknown-vhost", |_| {
        vec![
            hello(header()),
            hello(plain("guest", "guest")),
            hello([tune_ok(CHANNEL_MAX, FRAME_MAX, 0), open_vhost("nope")].concat()),
        ]
    });
    // Methods out of order, and frames a handshake does not expect.
    sc(out, "handshake/tune-ok-before-start-ok", |_| {
        vec![hello(header()), hello(tune_ok(CHANNEL_MAX, FRAME_MAX, 0))]
    });
    sc(out, "handshake/open-before-start-ok", |_| {
        vec![hello(header()), hello(open_vhost("/"))]
    });
    sc(out, "handshake/open-before-tune-ok", |_| {
        vec![
            hello(header()),
            hello(plain("guest", "guest")),
            hello(open_vhost("/")),
        ]
    });
    sc(out, "handshake/start-ok-twice", |_| {
        vec![
            hello(header()),
            hello(plain("guest", "guest")),
            hello(plain("guest", "guest")),
        ]
    });
    sc(out, "handshake/open-twice", |_| {
        vec![
            hello(header()),
            hello(plain("guest", "guest")),
            hello([tune_ok(CHANNEL_MAX, FRAME_MAX, 0), open_vhost("/")].concat()),
            hello(open_vhost("/")),
        ]
    });
    sc(out, "handshake/tune-ok-twice", |_| {
        let tune = tune_ok(CHANNEL_MAX, FRAME_MAX, 0);
        vec![
            hello(header()),
            hello(plain("guest", "guest")),
            hello([tune.clone(), tune].concat()),
        ]
    });
    sc(out, "handshake/close-while-opening", |_| {
        let close = method0(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        }));
        vec![
            hello(header()),
            hello(plain("guest", "guest")),
            hello([tune_ok(CHANNEL_MAX, FRAME_MAX, 0), close].concat()),
        ]
    });
    // Handshake methods, and methods only a server sends, on an open connection.
    let late: Vec<(&str, Vec<u8>)> = vec![
        ("start-ok", plain("guest", "guest")),
        ("tune-ok", tune_ok(CHANNEL_MAX, FRAME_MAX, 0)),
        (
            "secure-ok",
            method0(connection::AMQPMethod::SecureOk(connection::SecureOk {
                response: LongString::from(b"x".to_vec()),
            })),
        ),
        (
            "blocked",
            method0(connection::AMQPMethod::Blocked(connection::Blocked {
                reason: "client".into(),
            })),
        ),
        (
            "unblocked",
            method0(connection::AMQPMethod::Unblocked(connection::Unblocked {})),
        ),
        (
            "close-ok-unasked",
            method0(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
        ),
    ];
    for (name, bytes) in late {
        sc(out, format!("handshake/{name}-when-open"), |_| {
            vec![
                hello(header()),
                hello(plain("guest", "guest")),
                hello([tune_ok(CHANNEL_MAX, FRAME_MAX, 0), open_vhost("/")].concat()),
                hello(bytes),
            ]
        });
    }
    sc(out, "handshake/close-before-open", |_| {
        let close = method0(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        }));
        vec![
            hello(header()),
            hello(plain("guest", "guest")),
            hello(close),
        ]
    });
    sc(out, "handshake/channel-open-before-open", |_| {
        let open = super::common::encode(&AMQPFrame::Method(
            1,
            AMQPClass::Channel(chan::AMQPMethod::Open(chan::Open {})),
        ));
        vec![
            hello(header()),
            hello(plain("guest", "guest")),
            hello([tune_ok(CHANNEL_MAX, FRAME_MAX, 0), open].concat()),
        ]
    });
    sc(out, "handshake/channel-open-before-start-ok", |_| {
        let open = super::common::encode(&AMQPFrame::Method(
            1,
            AMQPClass::Channel(chan::AMQPMethod::Open(chan::Open {})),
        ));
        vec![hello(header()), hello(open)]
    });
    sc(out, "handshake/heartbeat-before-start-ok", |_| {
        vec![
            hello(header()),
            hello([raw_frame(8, 0, b"", 0xCE), plain("guest", "guest")].concat()),
        ]
    });
    sc(out, "handshake/update-secret-before-open", |_| {
        let update = method0(connection::AMQPMethod::UpdateSecret(
            connection::UpdateSecret {
                new_secret: LongString::from(b"guest".to_vec()),
                reason: "rotation".into(),
            },
        ));
        vec![
            hello(header()),
            hello(plain("guest", "guest")),
            hello(update),
        ]
    });
    sc(out, "handshake/bad-end-octet-before-start-ok", |_| {
        let ok = plain("guest", "guest");
        let mut bad = ok.clone();
        *bad.last_mut().expect("a frame") = 0;
        vec![hello(header()), hello(bad)]
    });
    sc(out, "handshake/body-frame-before-open", |_| {
        vec![
            hello(header()),
            hello(plain("guest", "guest")),
            hello(
                [
                    tune_ok(CHANNEL_MAX, FRAME_MAX, 0),
                    raw_frame(3, 1, b"x", 0xCE),
                ]
                .concat(),
            ),
        ]
    });
}
