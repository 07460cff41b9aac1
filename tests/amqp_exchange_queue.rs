//! Exchanges, queues and bindings: declare semantics, equivalence checks, reserved names,
//! deletion rules, routing (direct, fanout, topic, headers, exchange-to-exchange, alternate
//! exchange).

mod common;

use std::time::Duration;

use amq_protocol::types::{AMQPValue, FieldTable};
use common::*;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ExchangeBindOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, ExchangeUnbindOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions, QueuePurgeOptions,
};
use lapin::{BasicProperties, Channel, ExchangeKind};

async fn declare_exchange(
    ch: &Channel,
    name: &str,
    kind: ExchangeKind,
    options: ExchangeDeclareOptions,
) {
    within(
        "exchange.declare",
        ch.exchange_declare(name.into(), kind, options, FieldTable::default()),
    )
    .await
    .unwrap_or_else(|e| panic!("exchange.declare {name}: {e}"));
}

async fn bind(ch: &Channel, queue: &str, exchange: &str, key: &str, args: FieldTable) {
    within(
        "queue.bind",
        ch.queue_bind(
            queue.into(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            args,
        ),
    )
    .await
    .unwrap_or_else(|e| panic!("queue.bind {queue} <- {exchange} ({key}): {e}"));
}

fn passive_ex() -> ExchangeDeclareOptions {
    ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    }
}

// ----------------------------------------------------------------------------- exchanges

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declare_each_exchange_type_then_passive_declare_finds_it() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    for kind in [
        ExchangeKind::Direct,
        ExchangeKind::Fanout,
        ExchangeKind::Topic,
        ExchangeKind::Headers,
    ] {
        let name = unique(&format!("ex-{kind:?}"));
        declare_exchange(&ch, &name, kind.clone(), ExchangeDeclareOptions::default()).await;
        // Redeclaring with identical properties is a no-op.
        declare_exchange(&ch, &name, kind.clone(), ExchangeDeclareOptions::default()).await;
        // Passive declare ignores the type and finds it.
        declare_exchange(&ch, &name, ExchangeKind::Direct, passive_ex()).await;
    }
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_exchanges_exist() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    for name in [
        "amq.direct",
        "amq.fanout",
        "amq.topic",
        "amq.headers",
        "amq.match",
    ] {
        let res = within(
            "passive exchange.declare",
            ch.exchange_declare(
                name.into(),
                ExchangeKind::Direct,
                passive_ex(),
                FieldTable::default(),
            ),
        )
        .await;
        assert!(res.is_ok(), "standard exchange {name:?} missing: {res:?}");
    }
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_exchange_routes_by_queue_name() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let q = unique("default-ex-q");
    declare_queue(&ch, &q).await;
    publish_confirmed(&ch, "", &q, b"hello").await;
    publish_confirmed(&ch, "", &unique("nobody"), b"dropped").await;
    let m = get_some(&ch, &q, true).await;
    assert_eq!(m.delivery.data, b"hello");
    assert_eq!(m.delivery.routing_key.as_str(), q);
    assert_eq!(m.delivery.exchange.as_str(), "");
    assert!(get(&ch, &q, true).await.is_none());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passive_declare_of_missing_exchange_closes_channel_404() {
    let node = TestNode::start().await;
    let (conn, ch) = node.confirm_channel().await;
    let res = within(
        "passive exchange.declare",
        ch.exchange_declare(
            unique("missing-ex").into(),
            ExchangeKind::Direct,
            passive_ex(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 404, "passive declare of a missing exchange");
    assert!(
        conn.status().connected(),
        "404 is a channel error; the connection stays"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redeclare_exchange_with_different_type_closes_channel_406() {
    let node = TestNode::start().await;
    let (conn, ch) = node.confirm_channel().await;
    let name = unique("retype-ex");
    declare_exchange(
        &ch,
        &name,
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
    )
    .await;
    let res = within(
        "exchange.declare",
        ch.exchange_declare(
            name.as_str().into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 406, "redeclare direct as fanout");
    assert!(conn.status().connected());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redeclare_exchange_with_different_durability_closes_channel_406() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let name = unique("redur-ex");
    declare_exchange(
        &ch,
        &name,
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
    )
    .await;
    let res = within(
        "exchange.declare",
        ch.exchange_declare(
            name.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 406, "redeclare transient exchange as durable");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_exchange_type_closes_connection_503() {
    let node = TestNode::start().await;
    let (conn, ch) = node.confirm_channel().await;
    let res = within(
        "exchange.declare",
        ch.exchange_declare(
            unique("weird-ex").into(),
            ExchangeKind::Custom("no-such-type".into()),
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    let err = assert_code(res, 503, "declare with an unknown exchange type");
    assert!(
        err.is_amqp_hard_error(),
        "503 COMMAND_INVALID is a connection error"
    );
    eventually("connection closed", || {
        let c = conn.status().connected();
        async move { !c }
    })
    .await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declaring_new_amq_prefixed_exchange_is_refused_403() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let res = within(
        "exchange.declare",
        ch.exchange_declare(
            unique("amq.custom").into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 403, "declare amq.* exchange");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declaring_the_default_exchange_is_refused_403() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let res = within(
        "exchange.declare",
        ch.exchange_declare(
            "".into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 403, "non-passive declare of the default exchange");
    // RabbitMQ refuses any exchange.declare naming the default exchange, passive included.
    let ch = open_channel(&_conn).await;
    let res = within(
        "exchange.declare",
        ch.exchange_declare(
            "".into(),
            ExchangeKind::Direct,
            passive_ex(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 403, "passive declare of the default exchange");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binding_a_queue_to_the_default_exchange_is_refused_403() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let q = unique("bind-default-q");
    declare_queue(&ch, &q).await;
    let res = within(
        "queue.bind",
        ch.queue_bind(
            q.as_str().into(),
            "".into(),
            "k".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 403, "bind to the default exchange");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_standard_exchange_is_refused_403() {
    let node = TestNode::start().await;
    let (conn, ch) = node.confirm_channel().await;
    let res = within(
        "exchange.delete",
        ch.exchange_delete("amq.direct".into(), ExchangeDeleteOptions::default()),
    )
    .await;
    assert_code(res, 403, "delete amq.direct");
    assert!(exchange_exists(&conn, "amq.direct").await);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_to_internal_exchange_closes_channel_403_but_exchange_bindings_reach_it() {
    let node = TestNode::start().await;
    let (conn, ch) = node.confirm_channel().await;
    let internal = unique("internal-ex");
    let front = unique("front-ex");
    let q = unique("internal-q");
    declare_exchange(
        &ch,
        &internal,
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            internal: true,
            ..Default::default()
        },
    )
    .await;
    declare_exchange(
        &ch,
        &front,
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
    )
    .await;
    declare_queue(&ch, &q).await;
    bind(&ch, &q, &internal, "", FieldTable::default()).await;
    within(
        "exchange.bind",
        ch.exchange_bind(
            internal.as_str().into(),
            front.as_str().into(),
            "".into(),
            ExchangeBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("exchange.bind");

    // Reachable through another exchange.
    publish_confirmed(&ch, &front, "", b"via-front").await;
    assert_eq!(queue_counts(&ch, &q).await.0, 1);

    // Not directly.
    let pub_ch = open_channel(&conn).await;
    let mut watch = watch_channel(&pub_ch).await;
    publish(&pub_ch, &internal, "", b"direct").await;
    expect_closed_with(&mut watch, 403, "publish to an internal exchange").await;
    assert_eq!(
        queue_counts(&ch, &q).await.0,
        1,
        "the refused message must not be routed"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_exchange_if_unused_with_bindings_closes_channel_406() {
    let node = TestNode::start().await;
    let (conn, ch) = node.confirm_channel().await;
    let ex = unique("used-ex");
    let q = unique("used-ex-q");
    declare_exchange(
        &ch,
        &ex,
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
    )
    .await;
    declare_queue(&ch, &q).await;
    bind(&ch, &q, &ex, "k", FieldTable::default()).await;
    let res = within(
        "exchange.delete",
        ch.exchange_delete(
            ex.as_str().into(),
            ExchangeDeleteOptions {
                if_unused: true,
                ..Default::default()
            },
        ),
    )
    .await;
    assert_code(res, 406, "delete if-unused of a bound exchange");
    assert!(
        exchange_exists(&conn, &ex).await,
        "the exchange must survive"
    );

    // Without bindings, if-unused deletes it.
    let ch2 = open_channel(&conn).await;
    within(
        "queue.unbind",
        ch2.queue_unbind(
            q.as_str().into(),
            ex.as_str().into(),
            "k".into(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("unbind");
    within(
        "exchange.delete",
        ch2.exchange_delete(
            ex.as_str().into(),
            ExchangeDeleteOptions {
                if_unused: true,
                ..Default::default()
            },
        ),
    )
    .await
    .expect("delete if-unused of an unbound exchange");
    assert!(!exchange_exists(&conn, &ex).await);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_an_exchange_removes_its_bindings() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let ex = unique("del-ex");
    let q = unique("del-ex-q");
    declare_exchange(
        &ch,
        &ex,
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
    )
    .await;
    declare_queue(&ch, &q).await;
    bind(&ch, &q, &ex, "", FieldTable::default()).await;
    within(
        "exchange.delete",
        ch.exchange_delete(ex.as_str().into(), ExchangeDeleteOptions::default()),
    )
    .await
    .expect("delete");
    // Recreate: the old binding must not come back.
    declare_exchange(
        &ch,
        &ex,
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
    )
    .await;
    publish_confirmed(&ch, &ex, "", b"x").await;
    assert_eq!(queue_counts(&ch, &q).await.0, 0);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_delete_exchange_is_deleted_when_its_last_binding_goes() {
    let node = TestNode::start().await;
    let (conn, ch) = node.confirm_channel().await;
    let ex = unique("autodel-ex");
    let q = unique("autodel-ex-q");
    declare_exchange(
        &ch,
        &ex,
        ExchangeKind::Direct,
        ExchangeDeclareOptions {
            auto_delete: true,
            ..Default::default()
        },
    )
    .await;
    declare_queue(&ch, &q).await;
    bind(&ch, &q, &ex, "a", FieldTable::default()).await;
    bind(&ch, &q, &ex, "b", FieldTable::default()).await;
    within(
        "queue.unbind",
        ch.queue_unbind(
            q.as_str().into(),
            ex.as_str().into(),
            "a".into(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("unbind a");
    assert!(
        exchange_exists(&conn, &ex).await,
        "one binding left: still there"
    );
    within(
        "queue.unbind",
        ch.queue_unbind(
            q.as_str().into(),
            ex.as_str().into(),
            "b".into(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("unbind b");
    eventually("auto-delete exchange deleted", || {
        exchange_exists_not(&conn, &ex)
    })
    .await;
    node.shutdown().await;
}

async fn exchange_exists_not(conn: &lapin::Connection, name: &str) -> bool {
    !exchange_exists(conn, name).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_exchange_and_queue_declare_and_report_as_such() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let ex = unique("durable-ex");
    let q = unique("durable-q");
    declare_exchange(
        &ch,
        &ex,
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
    )
    .await;
    declare_queue_with(
        &ch,
        &q,
        QueueDeclareOptions::durable(),
        FieldTable::default(),
    )
    .await;
    bind(&ch, &q, &ex, "#", FieldTable::default()).await;
    publish_confirmed(&ch, &ex, "a.b", b"m").await;
    assert_eq!(queue_counts(&ch, &q).await.0, 1);
    // Equivalent redeclare of both is fine.
    declare_exchange(
        &ch,
        &ex,
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
    )
    .await;
    let again = declare_queue_with(
        &ch,
        &q,
        QueueDeclareOptions::durable(),
        FieldTable::default(),
    )
    .await;
    assert_eq!(again.message_count(), 1);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exchange_to_exchange_binding_routes_and_unbind_stops_it() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let src = unique("e2e-src");
    let dst = unique("e2e-dst");
    let q = unique("e2e-q");
    declare_exchange(
        &ch,
        &src,
        ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
    )
    .await;
    declare_exchange(
        &ch,
        &dst,
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
    )
    .await;
    declare_queue(&ch, &q).await;
    bind(&ch, &q, &dst, "orders.new", FieldTable::default()).await;
    within(
        "exchange.bind",
        ch.exchange_bind(
            dst.as_str().into(),
            src.as_str().into(),
            "orders.*".into(),
            ExchangeBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("exchange.bind");

    publish_confirmed(&ch, &src, "orders.new", b"1").await; // src matches, dst matches -> q
    publish_confirmed(&ch, &src, "orders.old", b"2").await; // src matches, dst does not
    publish_confirmed(&ch, &src, "other.new", b"3").await; // src does not match
    publish_confirmed(&ch, &src, "orders.new", b"4").await;
    assert_eq!(get_some(&ch, &q, true).await.delivery.data, b"1");
    assert_eq!(get_some(&ch, &q, true).await.delivery.data, b"4");
    assert!(get(&ch, &q, true).await.is_none());

    within(
        "exchange.unbind",
        ch.exchange_unbind(
            dst.as_str().into(),
            src.as_str().into(),
            "orders.*".into(),
            ExchangeUnbindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("exchange.unbind");
    publish_confirmed(&ch, &src, "orders.new", b"5").await;
    assert!(
        get(&ch, &q, true).await.is_none(),
        "routing must stop after exchange.unbind"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exchange_bind_cycle_delivers_each_message_once() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let a = unique("cyc-a");
    let b = unique("cyc-b");
    let q = unique("cyc-q");
    declare_exchange(
        &ch,
        &a,
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
    )
    .await;
    declare_exchange(
        &ch,
        &b,
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
    )
    .await;
    declare_queue(&ch, &q).await;
    for (dst, src) in [(&a, &b), (&b, &a)] {
        within(
            "exchange.bind",
            ch.exchange_bind(
                dst.as_str().into(),
                src.as_str().into(),
                "".into(),
                ExchangeBindOptions::default(),
                FieldTable::default(),
            ),
        )
        .await
        .expect("exchange.bind");
    }
    bind(&ch, &q, &a, "", FieldTable::default()).await;
    bind(&ch, &q, &b, "", FieldTable::default()).await;
    publish_confirmed(&ch, &a, "", b"once").await;
    assert_eq!(
        queue_counts(&ch, &q).await.0,
        1,
        "a queue gets a message at most once per publish"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alternate_exchange_receives_unroutable_messages() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let ae = unique("ae");
    let main = unique("ae-main");
    let routed_q = unique("ae-routed-q");
    let ae_q = unique("ae-q");
    declare_exchange(
        &ch,
        &ae,
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
    )
    .await;
    within(
        "exchange.declare",
        ch.exchange_declare(
            main.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            table(&[("alternate-exchange", lstr(&ae))]),
        ),
    )
    .await
    .expect("declare with alternate-exchange");
    declare_queue(&ch, &routed_q).await;
    declare_queue(&ch, &ae_q).await;
    bind(&ch, &routed_q, &main, "known", FieldTable::default()).await;
    bind(&ch, &ae_q, &ae, "", FieldTable::default()).await;

    let c1 = within(
        "publish",
        ch.basic_publish(
            main.as_str().into(),
            "known".into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"routed",
            BasicProperties::default(),
        ),
    )
    .await
    .expect("publish");
    let c2 = within(
        "publish",
        ch.basic_publish(
            main.as_str().into(),
            "unknown".into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"to-ae",
            BasicProperties::default(),
        ),
    )
    .await
    .expect("publish");
    let c1 = within("confirm", c1).await.expect("confirm");
    let c2 = within("confirm", c2).await.expect("confirm");
    assert!(c1.is_ack() && c2.is_ack());
    assert!(
        c2.take_message().is_none(),
        "routed via the alternate exchange: a mandatory message is not returned"
    );
    assert_eq!(
        get_some(&ch, &routed_q, true).await.delivery.data,
        b"routed"
    );
    let m = get_some(&ch, &ae_q, true).await;
    assert_eq!(m.delivery.data, b"to-ae");
    assert_eq!(
        m.delivery.routing_key.as_str(),
        "unknown",
        "routing key is preserved"
    );
    assert!(get(&ch, &ae_q, true).await.is_none());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fanout_delivers_to_every_bound_queue_ignoring_key() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let ex = unique("fan");
    declare_exchange(
        &ch,
        &ex,
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
    )
    .await;
    let qs: Vec<String> = (0..3).map(|i| unique(&format!("fan-q{i}"))).collect();
    for (i, q) in qs.iter().enumerate() {
        declare_queue(&ch, q).await;
        bind(&ch, q, &ex, &format!("key{i}"), FieldTable::default()).await;
    }
    publish_confirmed(&ch, &ex, "whatever", b"m").await;
    for q in &qs {
        assert_eq!(queue_counts(&ch, q).await.0, 1, "queue {q}");
    }
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_exchange_routes_on_exact_key_and_duplicate_binds_are_idempotent() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let ex = unique("direct");
    let q = unique("direct-q");
    declare_exchange(
        &ch,
        &ex,
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
    )
    .await;
    declare_queue(&ch, &q).await;
    bind(&ch, &q, &ex, "red", FieldTable::default()).await;
    bind(&ch, &q, &ex, "red", FieldTable::default()).await;
    bind(&ch, &q, &ex, "blue", FieldTable::default()).await;
    publish_confirmed(&ch, &ex, "red", b"r").await;
    publish_confirmed(&ch, &ex, "blue", b"b").await;
    publish_confirmed(&ch, &ex, "green", b"g").await;
    publish_confirmed(&ch, &ex, "Red", b"R").await;
    assert_eq!(
        queue_counts(&ch, &q).await.0,
        2,
        "one copy per publish, exact-match keys only"
    );
    assert_eq!(get_some(&ch, &q, true).await.delivery.data, b"r");
    assert_eq!(get_some(&ch, &q, true).await.delivery.data, b"b");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_patterns_match_star_and_hash() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let ex = unique("topic");
    declare_exchange(
        &ch,
        &ex,
        ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
    )
    .await;
    let cases: &[(&str, &[&str])] = &[
        ("a.*", &["a.b"]),
        ("a.#", &["a", "a.b", "a.b.c"]),
        ("#", &["a", "a.b", "a.b.c", "x.y", ""]),
        ("*.b.*", &["a.b.c"]),
        ("#.c", &["a.b.c"]),
        ("a.*.#", &["a.b", "a.b.c"]),
        // RabbitMQ: "*" needs exactly one word, and "" has none.
        ("*", &["a"]),
    ];
    let keys = ["a", "a.b", "a.b.c", "x.y", ""];
    let mut queues = Vec::new();
    for (pattern, _) in cases {
        let q = unique("topic-q");
        declare_queue(&ch, &q).await;
        bind(&ch, &q, &ex, pattern, FieldTable::default()).await;
        queues.push(q);
    }
    for key in keys {
        publish_confirmed(&ch, &ex, key, key.as_bytes()).await;
    }
    for ((pattern, expected), q) in cases.iter().zip(&queues) {
        let mut got = Vec::new();
        while let Some(m) = get(&ch, q, true).await {
            got.push(String::from_utf8(m.delivery.data).unwrap());
        }
        let expected: Vec<String> = expected.iter().map(|s| s.to_string()).collect();
        assert_eq!(got, expected, "pattern {pattern:?}");
    }
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_unbind_stops_topic_routing() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let q = unique("unbind-q");
    declare_queue(&ch, &q).await;
    bind(&ch, &q, "amq.topic", "stock.#", FieldTable::default()).await;
    publish_confirmed(&ch, "amq.topic", "stock.nyse.ibm", b"1").await;
    assert_eq!(queue_counts(&ch, &q).await.0, 1);
    within(
        "queue.unbind",
        ch.queue_unbind(
            q.as_str().into(),
            "amq.topic".into(),
            "stock.#".into(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("unbind");
    publish_confirmed(&ch, "amq.topic", "stock.nyse.ibm", b"2").await;
    assert_eq!(queue_counts(&ch, &q).await.0, 1);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_exchange_matches_all_and_any() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let ex = unique("headers");
    declare_exchange(
        &ch,
        &ex,
        ExchangeKind::Headers,
        ExchangeDeclareOptions::default(),
    )
    .await;
    let all_q = unique("hdr-all");
    let any_q = unique("hdr-any");
    let default_q = unique("hdr-default");
    declare_queue(&ch, &all_q).await;
    declare_queue(&ch, &any_q).await;
    declare_queue(&ch, &default_q).await;
    bind(
        &ch,
        &all_q,
        &ex,
        "",
        table(&[
            ("x-match", lstr("all")),
            ("format", lstr("pdf")),
            ("type", lstr("report")),
        ]),
    )
    .await;
    bind(
        &ch,
        &any_q,
        &ex,
        "",
        table(&[
            ("x-match", lstr("any")),
            ("format", lstr("pdf")),
            ("type", lstr("report")),
        ]),
    )
    .await;
    // x-match defaults to all.
    bind(
        &ch,
        &default_q,
        &ex,
        "",
        table(&[("format", lstr("pdf")), ("type", lstr("report"))]),
    )
    .await;

    let send = |hdrs: FieldTable, body: &'static [u8]| {
        let ch = ch.clone();
        let ex = ex.clone();
        async move {
            let c = publish_confirmed_with(
                &ch,
                &ex,
                "ignored",
                body,
                BasicPublishOptions::default(),
                BasicProperties::default().with_headers(hdrs),
            )
            .await;
            assert!(c.is_ack());
        }
    };
    send(
        table(&[("format", lstr("pdf")), ("type", lstr("report"))]),
        b"both",
    )
    .await;
    send(
        table(&[("format", lstr("pdf")), ("type", lstr("log"))]),
        b"format-only",
    )
    .await;
    send(
        table(&[("format", lstr("zip")), ("type", lstr("log"))]),
        b"neither",
    )
    .await;
    send(
        table(&[
            ("format", lstr("pdf")),
            ("type", lstr("report")),
            ("extra", AMQPValue::LongInt(1)),
        ]),
        b"both-plus-extra",
    )
    .await;
    send(FieldTable::default(), b"no-headers").await;

    async fn drain(ch: &Channel, q: &str) -> Vec<String> {
        let mut v = Vec::new();
        while let Some(m) = get(ch, q, true).await {
            v.push(String::from_utf8(m.delivery.data).unwrap());
        }
        v
    }
    assert_eq!(drain(&ch, &all_q).await, vec!["both", "both-plus-extra"]);
    assert_eq!(
        drain(&ch, &default_q).await,
        vec!["both", "both-plus-extra"]
    );
    assert_eq!(
        drain(&ch, &any_q).await,
        vec!["both", "format-only", "both-plus-extra"]
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_to_missing_exchange_or_queue_closes_channel_404() {
    let node = TestNode::start().await;
    let conn = node.connect().await;
    let ch = open_channel(&conn).await;
    let q = unique("bind404-q");
    declare_queue(&ch, &q).await;
    let res = within(
        "queue.bind",
        ch.queue_bind(
            q.as_str().into(),
            unique("no-ex").into(),
            "k".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 404, "bind to a missing exchange");

    let ch = open_channel(&conn).await;
    let res = within(
        "queue.bind",
        ch.queue_bind(
            unique("no-q").into(),
            "amq.direct".into(),
            "k".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 404, "bind a missing queue");
    node.shutdown().await;
}

// ----------------------------------------------------------------------------- queues

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_named_queue_gets_unique_amq_gen_name() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let a = declare_queue(&ch, "").await;
    let b = declare_queue(&ch, "").await;
    assert!(a.name().as_str().starts_with("amq.gen-"), "{}", a.name());
    assert!(b.name().as_str().starts_with("amq.gen-"), "{}", b.name());
    assert_ne!(a.name(), b.name());
    // The name routes through the default exchange like any other.
    publish_confirmed(&ch, "", a.name().as_str(), b"x").await;
    assert_eq!(
        get_some(&ch, a.name().as_str(), true).await.delivery.data,
        b"x"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_declare_reports_message_and_consumer_counts() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let q = unique("counts-q");
    let first = declare_queue(&ch, &q).await;
    assert_eq!((first.message_count(), first.consumer_count()), (0, 0));
    for i in 0..3 {
        publish_confirmed(&ch, "", &q, format!("m{i}").as_bytes()).await;
    }
    assert_eq!(queue_counts(&ch, &q).await, (3, 0));
    let other = open_channel(&_conn).await;
    let counted = unique("counted-q");
    declare_queue(&ch, &counted).await;
    let _c2 = consume(&other, &counted, BasicConsumeOptions::default()).await;
    assert_eq!(queue_counts(&ch, &counted).await, (0, 1));
    let again = declare_queue(&ch, &q).await;
    assert_eq!(
        again.message_count(),
        3,
        "non-passive redeclare reports counts too"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passive_declare_of_missing_queue_closes_channel_404() {
    let node = TestNode::start().await;
    let (conn, ch) = node.confirm_channel().await;
    let res = within(
        "passive queue.declare",
        ch.queue_declare(
            unique("missing-q").into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 404, "passive declare of a missing queue");
    assert!(conn.status().connected());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusive_queue_is_locked_to_its_connection_405() {
    let node = TestNode::start().await;
    let (_conn1, ch1) = node.confirm_channel().await;
    let q = unique("excl-q");
    declare_queue_with(
        &ch1,
        &q,
        QueueDeclareOptions::exclusive(),
        FieldTable::default(),
    )
    .await;
    // Another channel of the same connection may use it.
    let ch1b = confirm_channel(&_conn1).await;
    publish_confirmed(&ch1b, "", &q, b"mine").await;
    assert_eq!(get_some(&ch1b, &q, true).await.delivery.data, b"mine");

    let conn2 = node.connect().await;
    let ch2 = open_channel(&conn2).await;
    let res = within(
        "queue.declare",
        ch2.queue_declare(
            q.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 405, "declare of another connection's exclusive queue");
    let ch2 = open_channel(&conn2).await;
    let res = within(
        "basic.consume",
        ch2.basic_consume(
            q.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(
        res,
        405,
        "consume from another connection's exclusive queue",
    );
    let ch2 = open_channel(&conn2).await;
    let res = within(
        "basic.get",
        ch2.basic_get(
            q.as_str().into(),
            lapin::options::BasicGetOptions::default(),
        ),
    )
    .await;
    assert_code(
        res,
        405,
        "basic.get from another connection's exclusive queue",
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusive_queue_is_deleted_when_its_connection_closes() {
    let node = TestNode::start().await;
    let (conn1, ch1) = node.confirm_channel().await;
    let q = unique("excl-gone-q");
    declare_queue_with(
        &ch1,
        &q,
        QueueDeclareOptions::exclusive(),
        FieldTable::default(),
    )
    .await;
    publish(&ch1, "", &q, b"x").await;
    let observer = node.connect().await;
    // While the owner lives, the queue exists (a passive declare from elsewhere gets 405).
    let ch = open_channel(&observer).await;
    let res = within(
        "passive declare",
        ch.queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(
        res,
        405,
        "passive declare of another connection's exclusive queue",
    );

    within("connection.close", conn1.close(200, "bye".into()))
        .await
        .expect("close");
    eventually("exclusive queue deleted", || {
        let observer = &observer;
        let q = q.clone();
        async move { !queue_exists(observer, &q).await }
    })
    .await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_delete_queue_is_deleted_when_last_consumer_cancels() {
    let node = TestNode::start().await;
    let (conn, ch) = node.confirm_channel().await;
    let q = unique("autodel-q");
    declare_queue_with(
        &ch,
        &q,
        QueueDeclareOptions::default().auto_delete(),
        FieldTable::default(),
    )
    .await;
    let c1 = consume(&ch, &q, BasicConsumeOptions::default()).await;
    let c2 = consume(&ch, &q, BasicConsumeOptions::default()).await;
    within(
        "basic.cancel",
        ch.basic_cancel(c1.tag().as_str().into(), Default::default()),
    )
    .await
    .expect("cancel c1");
    assert!(
        queue_exists(&conn, &q).await,
        "one consumer left: queue stays"
    );
    within(
        "basic.cancel",
        ch.basic_cancel(c2.tag().as_str().into(), Default::default()),
    )
    .await
    .expect("cancel c2");
    eventually("auto-delete queue deleted", || {
        let conn = &conn;
        let q = q.clone();
        async move { !queue_exists(conn, &q).await }
    })
    .await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_delete_queue_without_consumers_ever_is_kept() {
    let node = TestNode::start().await;
    let (conn, ch) = node.confirm_channel().await;
    let q = unique("autodel-never-q");
    declare_queue_with(
        &ch,
        &q,
        QueueDeclareOptions::default().auto_delete(),
        FieldTable::default(),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(queue_exists(&conn, &q).await);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_returns_number_of_ready_messages_removed() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let q = unique("purge-q");
    declare_queue(&ch, &q).await;
    for i in 0..5 {
        publish_confirmed(&ch, "", &q, format!("{i}").as_bytes()).await;
    }
    // One of them unacked: purge does not touch it.
    let held = get_some(&ch, &q, false).await;
    let n = within(
        "queue.purge",
        ch.queue_purge(q.as_str().into(), QueuePurgeOptions::default()),
    )
    .await
    .expect("purge");
    assert_eq!(n, 4);
    assert_eq!(queue_counts(&ch, &q).await.0, 0);
    let n = within(
        "queue.purge",
        ch.queue_purge(q.as_str().into(), QueuePurgeOptions::default()),
    )
    .await
    .expect("purge");
    assert_eq!(n, 0);
    drop(held);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_queue_returns_message_count_and_removes_it() {
    let node = TestNode::start().await;
    let (conn, ch) = node.confirm_channel().await;
    let q = unique("del-q");
    declare_queue(&ch, &q).await;
    for _ in 0..3 {
        publish_confirmed(&ch, "", &q, b"m").await;
    }
    let n = within(
        "queue.delete",
        ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default()),
    )
    .await
    .expect("delete");
    assert_eq!(n, 3);
    assert!(!queue_exists(&conn, &q).await);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_queue_if_unused_with_consumer_closes_channel_406() {
    let node = TestNode::start().await;
    let (conn, ch) = node.confirm_channel().await;
    let q = unique("del-unused-q");
    declare_queue(&ch, &q).await;
    let _c = consume(&ch, &q, BasicConsumeOptions::default()).await;
    let ch2 = open_channel(&conn).await;
    let res = within(
        "queue.delete",
        ch2.queue_delete(
            q.as_str().into(),
            QueueDeleteOptions {
                if_unused: true,
                ..Default::default()
            },
        ),
    )
    .await;
    assert_code(res, 406, "delete if-unused of a consumed queue");
    assert!(queue_exists(&conn, &q).await);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_queue_if_empty_with_messages_closes_channel_406() {
    let node = TestNode::start().await;
    let (conn, ch) = node.confirm_channel().await;
    let q = unique("del-empty-q");
    declare_queue(&ch, &q).await;
    publish_confirmed(&ch, "", &q, b"m").await;
    let res = within(
        "queue.delete",
        ch.queue_delete(
            q.as_str().into(),
            QueueDeleteOptions {
                if_empty: true,
                ..Default::default()
            },
        ),
    )
    .await;
    assert_code(res, 406, "delete if-empty of a non-empty queue");
    let ch2 = open_channel(&conn).await;
    assert_eq!(queue_counts(&ch2, &q).await.0, 1);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redeclare_queue_with_different_durability_closes_channel_406() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let q = unique("redur-q");
    declare_queue(&ch, &q).await;
    let res = within(
        "queue.declare",
        ch.queue_declare(
            q.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 406, "redeclare transient queue as durable");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redeclare_queue_with_different_arguments_closes_channel_406() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let q = unique("reargs-q");
    declare_queue_with(
        &ch,
        &q,
        QueueDeclareOptions::default(),
        table(&[("x-max-length", AMQPValue::LongInt(10))]),
    )
    .await;
    let res = within(
        "queue.declare",
        ch.queue_declare(
            q.as_str().into(),
            QueueDeclareOptions::default(),
            table(&[("x-max-length", AMQPValue::LongInt(20))]),
        ),
    )
    .await;
    assert_code(res, 406, "redeclare with a different x-max-length");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_queue_argument_closes_channel_406() {
    let node = TestNode::start().await;
    let (conn, ch) = node.confirm_channel().await;
    let q = unique("badarg-q");
    let res = within(
        "queue.declare",
        ch.queue_declare(
            q.as_str().into(),
            QueueDeclareOptions::default(),
            table(&[("x-max-length", lstr("abc"))]),
        ),
    )
    .await;
    assert_code(res, 406, "x-max-length = \"abc\"");
    assert!(
        !queue_exists(&conn, &q).await,
        "the invalid declare must not create the queue"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declaring_amq_prefixed_queue_is_refused_403() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let res = within(
        "queue.declare",
        ch.queue_declare(
            unique("amq.myqueue").into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 403, "declare amq.* queue");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_length_argument_drops_oldest_messages() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let q = unique("maxlen-q");
    declare_queue_with(
        &ch,
        &q,
        QueueDeclareOptions::default(),
        table(&[("x-max-length", AMQPValue::LongInt(2))]),
    )
    .await;
    for i in 1..=4 {
        publish_confirmed(&ch, "", &q, format!("m{i}").as_bytes()).await;
    }
    assert_eq!(queue_counts(&ch, &q).await.0, 2);
    assert_eq!(get_some(&ch, &q, true).await.delivery.data, b"m3");
    assert_eq!(get_some(&ch, &q, true).await.delivery.data, b"m4");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_message_is_dead_lettered_with_x_death() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let dlq = unique("dlq");
    let q = unique("dl-src-q");
    declare_queue(&ch, &dlq).await;
    declare_queue_with(
        &ch,
        &q,
        QueueDeclareOptions::default(),
        table(&[
            ("x-dead-letter-exchange", lstr("")),
            ("x-dead-letter-routing-key", lstr(&dlq)),
        ]),
    )
    .await;
    publish_confirmed(&ch, "", &q, b"doomed").await;
    let m = get_some(&ch, &q, false).await;
    within(
        "basic.reject",
        ch.basic_reject(
            m.delivery.delivery_tag,
            lapin::options::BasicRejectOptions { requeue: false },
        ),
    )
    .await
    .expect("reject");
    wait_count(&ch, &dlq, 1).await;
    let dead = get_some(&ch, &dlq, true).await;
    assert_eq!(dead.delivery.data, b"doomed");
    let headers = dead
        .delivery
        .properties
        .headers()
        .clone()
        .expect("dead-lettered message carries headers");
    match headers.inner().get("x-death") {
        Some(AMQPValue::FieldArray(a)) => {
            assert_eq!(a.as_slice().len(), 1);
            match &a.as_slice()[0] {
                AMQPValue::FieldTable(t) => {
                    assert!(
                        matches!(t.inner().get("reason"), Some(AMQPValue::LongString(r)) if r.as_bytes() == b"rejected"),
                        "x-death entry: {t:?}"
                    );
                    assert!(
                        matches!(t.inner().get("queue"), Some(AMQPValue::LongString(r)) if r.as_bytes() == q.as_bytes()),
                        "x-death entry: {t:?}"
                    );
                }
                other => panic!("x-death entry is not a table: {other:?}"),
            }
        }
        other => panic!("missing x-death array: {other:?}"),
    }
    assert_eq!(queue_counts(&ch, &q).await.0, 0);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_message_is_dropped_or_dead_lettered_after_message_ttl() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let dlq = unique("ttl-dlq");
    let q = unique("ttl-q");
    let plain = unique("ttl-plain-q");
    declare_queue(&ch, &dlq).await;
    declare_queue_with(
        &ch,
        &q,
        QueueDeclareOptions::default(),
        table(&[
            ("x-message-ttl", AMQPValue::LongInt(100)),
            ("x-dead-letter-exchange", lstr("")),
            ("x-dead-letter-routing-key", lstr(&dlq)),
        ]),
    )
    .await;
    declare_queue_with(
        &ch,
        &plain,
        QueueDeclareOptions::default(),
        table(&[("x-message-ttl", AMQPValue::LongInt(100))]),
    )
    .await;
    publish_confirmed(&ch, "", &q, b"short-lived").await;
    publish_confirmed(&ch, "", &plain, b"short-lived").await;
    // Expiry happens without anyone touching the queue.
    wait_count(&ch, &dlq, 1).await;
    assert_eq!(queue_counts(&ch, &q).await.0, 0);
    wait_count(&ch, &plain, 0).await;
    assert!(get(&ch, &plain, true).await.is_none());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_message_expiration_property_expires_it() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    let q = unique("expiration-q");
    declare_queue(&ch, &q).await;
    let c = publish_confirmed_with(
        &ch,
        "",
        &q,
        b"brief",
        BasicPublishOptions::default(),
        BasicProperties::default().with_expiration("50".into()),
    )
    .await;
    assert!(c.is_ack());
    publish_confirmed(&ch, "", &q, b"lasting").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let m = get_some(&ch, &q, true).await;
    assert_eq!(
        m.delivery.data, b"lasting",
        "the expired message is never delivered"
    );
    assert!(get(&ch, &q, true).await.is_none());
    node.shutdown().await;
}

// ------------------------------------------------------------- sender-selected distribution

fn keys(names: &[&str]) -> AMQPValue {
    let mut a = amq_protocol::types::FieldArray::default();
    for n in names {
        a.push(lstr(n));
    }
    AMQPValue::FieldArray(a)
}

/// The message `queue` holds (taken with no-ack), or a panic.
async fn get_one(ch: &Channel, queue: &str) -> lapin::message::BasicGetMessage {
    within(
        "basic.get",
        ch.basic_get(
            queue.into(),
            lapin::options::BasicGetOptions { no_ack: true },
        ),
    )
    .await
    .unwrap_or_else(|e| panic!("basic.get {queue}: {e}"))
    .unwrap_or_else(|| panic!("{queue} is empty"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cc_and_bcc_headers_add_routing_keys_and_bcc_is_not_delivered() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    within(
        "confirm.select",
        ch.confirm_select(lapin::options::ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
    declare_exchange(&ch, "ssd", ExchangeKind::Direct, Default::default()).await;
    for q in ["ssd.a", "ssd.b", "ssd.c", "ssd.d"] {
        declare_queue(&ch, q).await;
        bind(&ch, q, "ssd", &q[4..], FieldTable::default()).await;
    }
    let headers = table(&[
        ("CC", keys(&["b"])),
        ("BCC", keys(&["c"])),
        ("other", lstr("kept")),
    ]);
    publish_confirmed_with(
        &ch,
        "ssd",
        "a",
        b"m",
        Default::default(),
        BasicProperties::default().with_headers(headers),
    )
    .await;
    for q in ["ssd.a", "ssd.b", "ssd.c"] {
        let m = get_one(&ch, q).await;
        let h = m.delivery.properties.headers().clone().expect("headers");
        assert_eq!(h.inner().get("CC"), Some(&keys(&["b"])), "{q}");
        assert!(
            !h.contains_key("BCC"),
            "{q}: BCC is removed before delivery"
        );
        assert_eq!(h.inner().get("other"), Some(&lstr("kept")), "{q}");
        assert_eq!(m.delivery.routing_key.as_str(), "a");
    }
    let (d, _) = queue_counts(&ch, "ssd.d").await;
    assert_eq!(d, 0, "a key nobody named routes nowhere");
    // The default exchange: CC names a second queue.
    publish_confirmed_with(
        &ch,
        "",
        "ssd.a",
        b"m2",
        Default::default(),
        BasicProperties::default().with_headers(table(&[("CC", keys(&["ssd.d"]))])),
    )
    .await;
    assert_eq!(get_one(&ch, "ssd.d").await.delivery.data, b"m2");
    assert_eq!(get_one(&ch, "ssd.a").await.delivery.data, b"m2");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cc_header_that_is_not_an_array_closes_the_channel_406() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    let mut watch = watch_channel(&ch).await;
    let _ = ch
        .basic_publish(
            "".into(),
            "nowhere".into(),
            Default::default(),
            b"m",
            BasicProperties::default().with_headers(table(&[("CC", lstr("b"))])),
        )
        .await;
    expect_closed_with(&mut watch, 406, "CC as a long string").await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unbinding_what_is_gone_is_ok_as_in_rabbitmq() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.channel().await;
    declare_queue(&ch, "ub.q").await;
    // A queue that auto-delete (or anyone) already removed, a missing exchange, a binding
    // that never existed: teardown code unbinds them all, and RabbitMQ 3.10 says ok.
    for (queue, exchange) in [
        ("no-such-q", "amq.direct"),
        ("ub.q", "no-such-x"),
        ("ub.q", "amq.direct"),
    ] {
        within(
            "queue.unbind",
            ch.queue_unbind(
                queue.into(),
                exchange.into(),
                "k".into(),
                FieldTable::default(),
            ),
        )
        .await
        .unwrap_or_else(|e| panic!("unbind {queue} from {exchange}: {e}"));
    }
    within(
        "exchange.unbind",
        ch.exchange_unbind(
            "no-such-d".into(),
            "amq.direct".into(),
            "k".into(),
            Default::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("exchange.unbind of a missing destination");
    // Binding a missing queue is still 404.
    let e = within(
        "queue.bind",
        ch.queue_bind(
            "no-such-q".into(),
            "amq.direct".into(),
            "k".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect_err("bind of a missing queue");
    assert_eq!(reply_code(&e), Some(404));
    node.shutdown().await;
}
