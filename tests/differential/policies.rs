//! Policy scenarios: every policy key Warren accepts, set over the management HTTP API with
//! valid and invalid values, and what each does to a queue or exchange declared after it,
//! alone and beside the `x-*` argument of the same meaning (RabbitMQ resolves some by the
//! lower value, some by the argument). Policies match only their scenario's names.

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::AMQPValue;
use serde_json::{json, Value};

use super::Step;
use super::*;

fn put(kind: &str, name: &str, body: Value) -> Step {
    Step::Http {
        method: "PUT",
        path: format!("/{kind}/%2F/{name}"),
        body: Some(body.to_string()),
    }
}

/// A policy named `p` matching the names that start with `p`.
fn policy(p: &str, apply_to: &str, definition: Value) -> Step {
    put(
        "policies",
        p,
        json!({"pattern": format!("^{p}"), "apply-to": apply_to, "definition": definition}),
    )
}

fn delete(kind: &str, name: &str) -> Step {
    Step::Http {
        method: "DELETE",
        path: format!("/{kind}/%2F/{name}"),
        body: None,
    }
}

pub(super) fn policies(out: &mut Vec<Scenario>) {
    validation(out);
    definitions(out);
    effects(out);
    resolution(out);
    changes(out);
}

/// Each key with values RabbitMQ takes and values it refuses.
fn validation(out: &mut Vec<Scenario>) {
    let cases: Vec<(&str, Value)> = vec![
        ("max-length", json!(0)),
        ("max-length", json!(10)),
        ("max-length", json!(-1)),
        ("max-length", json!("10")),
        ("max-length-bytes", json!(100)),
        ("max-length-bytes", json!(-1)),
        ("message-ttl", json!(0)),
        ("message-ttl", json!(60000)),
        ("message-ttl", json!(-1)),
        ("message-ttl", json!(1.5)),
        ("expires", json!(1)),
        ("expires", json!(0)),
        ("expires", json!(-5)),
        ("overflow", json!("drop-head")),
        ("overflow", json!("reject-publish")),
        ("overflow", json!("reject-publish-dlx")),
        ("overflow", json!("drop-tail")),
        ("queue-mode", json!("lazy")),
        ("queue-mode", json!("default")),
        ("queue-mode", json!("eager")),
        ("ha-sync-mode", json!("automatic")),
        ("ha-sync-mode", json!("manual")),
        ("ha-sync-mode", json!("sometimes")),
        ("ha-sync-batch-size", json!(10)),
        ("ha-sync-batch-size", json!(0)),
        ("ha-promote-on-shutdown", json!("always")),
        ("ha-promote-on-shutdown", json!("when-synced")),
        ("ha-promote-on-shutdown", json!("never")),
        ("ha-promote-on-failure", json!("always")),
        ("ha-promote-on-failure", json!("when-synced")),
        ("ha-promote-on-failure", json!("never")),
        ("queue-master-locator", json!("client-local")),
        ("queue-master-locator", json!("min-masters")),
        ("queue-master-locator", json!("random")),
        ("queue-master-locator", json!("nearest")),
        ("dead-letter-exchange", json!("dlx")),
        ("dead-letter-exchange", json!(5)),
        ("dead-letter-routing-key", json!("rk")),
        ("dead-letter-routing-key", json!(5)),
        ("alternate-exchange", json!("ae")),
        ("alternate-exchange", json!(5)),
        ("no-such-key", json!(1)),
    ];
    for key in [
        "ha-sync-mode",
        "ha-sync-batch-size",
        "ha-promote-on-shutdown",
        "ha-promote-on-failure",
    ] {
        let value = if key == "ha-sync-batch-size" {
            json!(10)
        } else if key == "ha-sync-mode" {
            json!("automatic")
        } else {
            json!("always")
        };
        sc(out, format!("policy/set/{key}-without-ha-mode"), |p| {
            let mut definition = serde_json::Map::new();
            definition.insert(key.to_string(), value);
            vec![policy(p, "all", Value::Object(definition))]
        });
    }
    for (key, value) in cases {
        let label = value.to_string();
        let mut definition = serde_json::Map::new();
        if key.starts_with("ha-") {
            // RabbitMQ checks the other HA keys only beside `ha-mode`.
            definition.insert("ha-mode".into(), json!("all"));
        }
        definition.insert(key.to_string(), value);
        sc(out, format!("policy/set/{key}={label}"), |p| {
            vec![
                policy(p, "all", Value::Object(definition)),
                delete("policies", p),
            ]
        });
    }
}

/// The policy itself: HA keys together, the pattern, apply-to, an empty definition,
/// replacing and deleting, operator policies.
fn definitions(out: &mut Vec<Scenario>) {
    let ha: Vec<(&str, Value)> = vec![
        ("all", json!({"ha-mode": "all"})),
        ("all-with-params", json!({"ha-mode": "all", "ha-params": 2})),
        ("exactly-2", json!({"ha-mode": "exactly", "ha-params": 2})),
        ("exactly-0", json!({"ha-mode": "exactly", "ha-params": 0})),
        ("exactly-no-params", json!({"ha-mode": "exactly"})),
        (
            "exactly-string",
            json!({"ha-mode": "exactly", "ha-params": "2"}),
        ),
        (
            "nodes",
            json!({"ha-mode": "nodes", "ha-params": ["rabbit@a", "rabbit@b"]}),
        ),
        ("nodes-empty", json!({"ha-mode": "nodes", "ha-params": []})),
        (
            "nodes-not-list",
            json!({"ha-mode": "nodes", "ha-params": "rabbit@a"}),
        ),
        ("params-only", json!({"ha-params": 2})),
        ("unknown-mode", json!({"ha-mode": "some"})),
        (
            "all-automatic",
            json!({"ha-mode": "all", "ha-sync-mode": "automatic"}),
        ),
    ];
    for (label, definition) in ha {
        sc(out, format!("policy/ha/{label}"), |p| {
            vec![policy(p, "queues", definition), delete("policies", p)]
        });
    }
    sc(out, "policy/empty-definition", |p| {
        vec![policy(p, "all", json!({}))]
    });
    sc(out, "policy/bad-pattern", |p| {
        vec![put(
            "policies",
            p,
            json!({"pattern": "(", "definition": {"max-length": 1}}),
        )]
    });
    sc(out, "policy/no-pattern", |p| {
        vec![put("policies", p, json!({"definition": {"max-length": 1}}))]
    });
    sc(out, "policy/bad-apply-to", |p| {
        vec![policy(p, "bindings", json!({"max-length": 1}))]
    });
    sc(out, "policy/set-twice-then-delete-twice", |p| {
        vec![
            policy(p, "queues", json!({"max-length": 1})),
            policy(p, "queues", json!({"max-length": 2})),
            delete("policies", p),
            delete("policies", p),
        ]
    });
    sc(out, "operator-policy/limit", |p| {
        vec![
            put(
                "operator-policies",
                p,
                json!({"pattern": format!("^{p}"), "definition": {"max-length": 3}}),
            ),
            delete("operator-policies", p),
            delete("operator-policies", p),
        ]
    });
    sc(out, "operator-policy/ha-refused", |p| {
        vec![put(
            "operator-policies",
            p,
            json!({"pattern": format!("^{p}"), "definition": {"ha-mode": "all"}}),
        )]
    });
}

/// A policy on `apply_to`, then a queue declared, `bodies` published and `gets` basic.gets.
fn policy_then_queue(
    p: &str,
    apply_to: &str,
    definition: Value,
    bodies: &[&str],
    gets: usize,
) -> Vec<Step> {
    let name = format!("{p}.q");
    let mut steps = vec![policy(p, apply_to, definition), call(1, q(&name))];
    steps.extend(bodies.iter().map(|b| publish(1, "", &name, b)));
    steps.extend((0..gets).map(|_| call(1, get(&name, true))));
    steps
}

/// A queue (or exchange) declared after its policy, then used.
fn effects(out: &mut Vec<Scenario>) {
    let cases: [(&str, &str, Value, &[&str], usize); 4] = [
        (
            "message-ttl-0",
            "queues",
            json!({"message-ttl": 0}),
            &["m"],
            1,
        ),
        (
            "max-length-1",
            "queues",
            json!({"max-length": 1}),
            &["a", "b"],
            2,
        ),
        (
            "max-length-bytes-4",
            "queues",
            json!({"max-length-bytes": 4}),
            &["aaa", "bbb"],
            2,
        ),
        (
            "apply-to-exchanges-skips-queues",
            "exchanges",
            json!({"max-length": 1}),
            &["a", "b"],
            2,
        ),
    ];
    for (label, apply_to, definition, bodies, gets) in cases {
        sc(out, format!("policy/effect/{label}"), |p| {
            policy_then_queue(p, apply_to, definition, bodies, gets)
        });
    }
    sc(out, "policy/effect/reject-publish", |p| {
        let name = format!("{p}.q");
        vec![
            policy(
                p,
                "queues",
                json!({"max-length": 1, "overflow": "reject-publish"}),
            ),
            call(1, q(&name)),
            call(1, confirm_select()),
            publish_await(1, "", &name, false, 1),
            publish_await(1, "", &name, false, 1),
            call(1, get(&name, true)),
            call(1, get(&name, true)),
        ]
    });
    sc(out, "policy/effect/reject-publish-dlx", |p| {
        let (name, dlq) = (format!("{p}.q"), format!("{p}.dlq"));
        vec![
            policy(
                p,
                "queues",
                json!({"max-length": 1, "overflow": "reject-publish-dlx",
                       "dead-letter-exchange": "", "dead-letter-routing-key": dlq}),
            ),
            call(1, q(&dlq)),
            call(1, q(&name)),
            publish(1, "", &name, "a"),
            publish(1, "", &name, "b"),
            call(1, get(&dlq, true)),
            call(1, get(&name, true)),
        ]
    });
    sc(out, "policy/effect/dead-letter-on-reject", |p| {
        let (name, dlq) = (format!("{p}.q"), format!("{p}.dlq"));
        vec![
            policy(
                p,
                "queues",
                json!({"dead-letter-exchange": "", "dead-letter-routing-key": dlq}),
            ),
            call(1, q(&dlq)),
            call(1, q(&name)),
            publish(1, "", &name, "m"),
            call(1, get(&name, false)),
            cast(1, reject(1, false)),
            call(1, get(&dlq, true)),
        ]
    });
    sc(out, "policy/effect/dead-letter-on-expiry", |p| {
        let (name, dlq) = (format!("{p}.q"), format!("{p}.dlq"));
        vec![
            policy(
                p,
                "queues",
                json!({"dead-letter-exchange": "", "dead-letter-routing-key": dlq,
                       "message-ttl": 0}),
            ),
            call(1, q(&dlq)),
            call(1, q(&name)),
            publish(1, "", &name, "m"),
            call(1, get(&name, true)),
            call(1, get(&dlq, true)),
        ]
    });
    sc(out, "policy/effect/dead-letter-exchange-missing", |p| {
        let name = format!("{p}.q");
        vec![
            policy(
                p,
                "queues",
                json!({"dead-letter-exchange": format!("{p}.none")}),
            ),
            call(1, q(&name)),
            publish(1, "", &name, "m"),
            call(1, get(&name, false)),
            cast(1, reject(1, false)),
            call(1, get(&name, true)),
        ]
    });
    sc(out, "policy/effect/alternate-exchange", |p| {
        let (xn, ae, aeq) = (format!("{p}.x"), format!("{p}.ae"), format!("{p}.aeq"));
        vec![
            policy(p, "exchanges", json!({"alternate-exchange": ae})),
            call(1, x(&ae, "fanout")),
            call(1, q(&aeq)),
            call(1, qbind(&aeq, &ae, "", FieldTable::default())),
            call(1, x(&xn, "direct")),
            publish_with(1, &xn, "nowhere", true, BasicProperties::default(), "m"),
            call(1, get(&aeq, true)),
        ]
    });
    sc(out, "policy/effect/alternate-exchange-missing", |p| {
        let xn = format!("{p}.x");
        vec![
            policy(
                p,
                "exchanges",
                json!({"alternate-exchange": format!("{p}.none")}),
            ),
            call(1, x(&xn, "direct")),
            publish_with(1, &xn, "nowhere", true, BasicProperties::default(), "m"),
        ]
    });
    sc(out, "policy/effect/apply-to-queues-skips-exchanges", |p| {
        let (xn, ae, aeq) = (format!("{p}.x"), format!("{p}.ae"), format!("{p}.aeq"));
        vec![
            policy(p, "queues", json!({"alternate-exchange": ae})),
            call(1, x(&ae, "fanout")),
            call(1, q(&aeq)),
            call(1, qbind(&aeq, &ae, "", FieldTable::default())),
            call(1, x(&xn, "direct")),
            publish_with(1, &xn, "nowhere", true, BasicProperties::default(), "m"),
            call(1, get(&aeq, true)),
        ]
    });
    for (label, definition) in [
        (
            "ha-all",
            json!({"ha-mode": "all", "ha-sync-mode": "automatic"}),
        ),
        ("lazy", json!({"queue-mode": "lazy"})),
        ("expires", json!({"expires": 60000})),
        (
            "master-locator",
            json!({"queue-master-locator": "min-masters"}),
        ),
    ] {
        sc(out, format!("policy/effect/{label}-queue-works"), |p| {
            let name = format!("{p}.q");
            vec![
                policy(p, "queues", definition),
                call(1, q(&name)),
                publish(1, "", &name, "m"),
                call(1, get(&name, true)),
                call(1, qdelete(&name, false, false)),
            ]
        });
    }
    sc(out, "policy/effect/exclusive-queue-limited", |p| {
        let name = format!("{p}.q");
        vec![
            policy(p, "queues", json!({"max-length": 1, "ha-mode": "all"})),
            call(
                1,
                qdecl(
                    &name,
                    QFlags {
                        exclusive: true,
                        ..QFlags::default()
                    },
                    FieldTable::default(),
                ),
            ),
            publish(1, "", &name, "a"),
            publish(1, "", &name, "b"),
            call(1, get(&name, true)),
        ]
    });
    sc(out, "policy/effect/redeclare-with-other-policy-args", |p| {
        let name = format!("{p}.q");
        vec![
            policy(p, "queues", json!({"max-length": 1})),
            call(
                1,
                qargs(&name, table(vec![("x-max-length", AMQPValue::LongInt(5))])),
            ),
            call(1, q(&name)),
        ]
    });
}

/// A policy and an argument (or an operator policy, or a second policy) that both speak.
fn resolution(out: &mut Vec<Scenario>) {
    let int = |v: i32| AMQPValue::LongInt(v);
    for (label, definition, arg, value) in [
        (
            "max-length-policy-lower",
            json!({"max-length": 1}),
            "x-max-length",
            int(3),
        ),
        (
            "max-length-argument-lower",
            json!({"max-length": 3}),
            "x-max-length",
            int(1),
        ),
        (
            "ttl-policy-lower",
            json!({"message-ttl": 0}),
            "x-message-ttl",
            int(60000),
        ),
        (
            "ttl-argument-lower",
            json!({"message-ttl": 60000}),
            "x-message-ttl",
            int(0),
        ),
        (
            "overflow-argument-drop-head",
            json!({"max-length": 1, "overflow": "reject-publish"}),
            "x-overflow",
            s("drop-head"),
        ),
        (
            "overflow-argument-reject",
            json!({"max-length": 1, "overflow": "drop-head"}),
            "x-overflow",
            s("reject-publish"),
        ),
    ] {
        sc(out, format!("policy/resolve/{label}"), |p| {
            let name = format!("{p}.q");
            vec![
                policy(p, "queues", definition),
                call(1, qargs(&name, table(vec![(arg, value)]))),
                publish(1, "", &name, "a"),
                publish(1, "", &name, "b"),
                publish(1, "", &name, "c"),
                call(1, get(&name, true)),
                call(1, get(&name, true)),
                call(1, get(&name, true)),
            ]
        });
    }
    sc(out, "policy/resolve/dead-letter-argument-wins", |p| {
        let (name, dlq_policy, dlq_arg) =
            (format!("{p}.q"), format!("{p}.dlq1"), format!("{p}.dlq2"));
        vec![
            policy(
                p,
                "queues",
                json!({"dead-letter-exchange": "", "dead-letter-routing-key": dlq_policy}),
            ),
            call(1, q(&dlq_policy)),
            call(1, q(&dlq_arg)),
            call(
                1,
                qargs(
                    &name,
                    table(vec![
                        ("x-dead-letter-exchange", s("")),
                        ("x-dead-letter-routing-key", s(&dlq_arg)),
                    ]),
                ),
            ),
            publish(1, "", &name, "m"),
            call(1, get(&name, false)),
            cast(1, reject(1, false)),
            call(1, get(&dlq_policy, true)),
            call(1, get(&dlq_arg, true)),
        ]
    });
    sc(
        out,
        "policy/resolve/alternate-exchange-argument-wins",
        |p| {
            let (xn, ae1, ae2) = (format!("{p}.x"), format!("{p}.ae1"), format!("{p}.ae2"));
            let (q1, q2) = (format!("{p}.q1"), format!("{p}.q2"));
            vec![
                policy(p, "exchanges", json!({"alternate-exchange": ae1})),
                call(1, x(&ae1, "fanout")),
                call(1, x(&ae2, "fanout")),
                call(1, q(&q1)),
                call(1, q(&q2)),
                call(1, qbind(&q1, &ae1, "", FieldTable::default())),
                call(1, qbind(&q2, &ae2, "", FieldTable::default())),
                call(
                    1,
                    xdecl(
                        &xn,
                        "direct",
                        XFlags::default(),
                        table(vec![("alternate-exchange", s(&ae2))]),
                    ),
                ),
                publish(1, &xn, "nowhere", "m"),
                call(1, get(&q1, true)),
                call(1, get(&q2, true)),
            ]
        },
    );
    sc(out, "policy/resolve/higher-priority-wins-alone", |p| {
        let name = format!("{p}.q");
        vec![
            put(
                "policies",
                &format!("{p}-low"),
                json!({"pattern": format!("^{p}"), "priority": 0,
                       "definition": {"max-length": 1}}),
            ),
            put(
                "policies",
                &format!("{p}-high"),
                json!({"pattern": format!("^{p}"), "priority": 5,
                       "definition": {"queue-mode": "lazy"}}),
            ),
            call(1, q(&name)),
            publish(1, "", &name, "a"),
            publish(1, "", &name, "b"),
            call(1, get(&name, true)),
            call(1, get(&name, true)),
        ]
    });
    for (label, policy_limit, operator_limit) in [("lower", 3, 1), ("higher", 1, 3)] {
        sc(
            out,
            format!("policy/resolve/operator-policy-{label}"),
            |p| {
                let name = format!("{p}.q");
                vec![
                    policy(p, "queues", json!({ "max-length": policy_limit })),
                    put(
                        "operator-policies",
                        p,
                        json!({"pattern": format!("^{p}"), "definition": {"max-length": operator_limit}}),
                    ),
                    call(1, q(&name)),
                    publish(1, "", &name, "a"),
                    publish(1, "", &name, "b"),
                    call(1, get(&name, true)),
                    call(1, get(&name, true)),
                    delete("operator-policies", p),
                ]
            },
        );
    }
}

/// A policy set, changed or deleted while its queue exists.
fn changes(out: &mut Vec<Scenario>) {
    sc(out, "policy/change/set-after-declare", |p| {
        let name = format!("{p}.q");
        vec![
            call(1, q(&name)),
            publish(1, "", &name, "a"),
            publish(1, "", &name, "b"),
            publish(1, "", &name, "c"),
            policy(p, "queues", json!({"max-length": 1})),
            call(1, get(&name, true)),
            call(1, get(&name, true)),
        ]
    });
    sc(out, "policy/change/delete-lifts-limit", |p| {
        let name = format!("{p}.q");
        vec![
            policy(p, "queues", json!({"max-length": 1})),
            call(1, q(&name)),
            delete("policies", p),
            publish(1, "", &name, "a"),
            publish(1, "", &name, "b"),
            call(1, get(&name, true)),
            call(1, get(&name, true)),
        ]
    });
    sc(out, "policy/change/replace-definition", |p| {
        let name = format!("{p}.q");
        vec![
            policy(p, "queues", json!({"max-length": 1})),
            call(1, q(&name)),
            policy(p, "queues", json!({"message-ttl": 0})),
            publish(1, "", &name, "a"),
            call(1, get(&name, true)),
        ]
    });
}
