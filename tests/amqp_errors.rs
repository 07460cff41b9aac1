//! Error scope (channel vs connection), channel-number errors, frame sequencing errors and
//! permissions.

mod common;

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{channel as chan, queue, AMQPClass};
use amq_protocol::types::FieldTable;
use common::*;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::{BasicProperties, ExchangeKind};

fn raw_declare(name: &str) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
        queue: name.into(),
        passive: false,
        durable: false,
        exclusive: false,
        auto_delete: false,
        nowait: false,
        arguments: FieldTable::default(),
    }))
}

// ----------------------------------------------------------------------------- scope

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_error_leaves_other_channels_and_connection_working() {
    let node = TestNode::start().await;
    let (conn, ch1) = node.channel().await;
    let ch2 = open_channel(&conn).await;
    let q = declare_queue(&ch2, "").await;
    let res = within(
        "passive declare",
        ch1.queue_declare(
            unique("missing").into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 404, "passive declare of a missing queue");
    // The failed channel is closed for good.
    assert!(within(
        "declare on closed channel",
        ch1.queue_declare("".into(), Default::default(), FieldTable::default())
    )
    .await
    .is_err());
    // Its sibling and the connection are fine.
    assert!(conn.status().connected());
    publish(&ch2, "", q.name().as_str(), b"alive").await;
    wait_count(&ch2, q.name().as_str(), 1).await;
    assert_eq!(
        get_some(&ch2, q.name().as_str(), true).await.delivery.data,
        b"alive"
    );
    // And new channels open.
    let ch3 = open_channel(&conn).await;
    declare_queue(&ch3, "").await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_to_missing_exchange_closes_channel_404() {
    let node = TestNode::start().await;
    let (conn, ch) = node.channel().await;
    let mut watch = watch_channel(&ch).await;
    publish(&ch, &unique("no-such-exchange"), "k", b"x").await;
    expect_closed_with(&mut watch, 404, "publish to a missing exchange").await;
    assert!(conn.status().connected());
    let other = open_channel(&conn).await;
    declare_queue(&other, "").await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_error_ends_every_channel_and_the_connection() {
    let node = TestNode::start().await;
    let (conn, ch1) = node.channel().await;
    let ch2 = open_channel(&conn).await;
    let mut watch2 = watch_channel(&ch2).await;
    let res = within(
        "exchange.declare",
        ch1.exchange_declare(
            unique("x").into(),
            ExchangeKind::Custom("bogus".into()),
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 503, "unknown exchange type");
    if let Some(code) = connection_end_code(&mut watch2).await {
        assert_eq!(code, 503, "sibling channel sees the connection close");
    }
    eventually("connection gone", || {
        let c = conn.status().connected();
        async move { !c }
    })
    .await;
    assert!(within("create_channel", conn.create_channel())
        .await
        .is_err());
    // The node still accepts new connections.
    let (_c2, ch) = node.channel().await;
    declare_queue(&ch, "").await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_consumer_tag_on_a_channel_closes_connection_530() {
    let node = TestNode::start().await;
    let (conn, ch) = node.channel().await;
    let q = declare_queue(&ch, "").await;
    let _c = consume_tagged(
        &ch,
        q.name().as_str(),
        "dup",
        BasicConsumeOptions::default(),
    )
    .await;
    let res = within(
        "basic.consume",
        ch.basic_consume(
            q.name().as_str().into(),
            "dup".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(
        res.map(|c| c.tag()),
        530,
        "reusing a consumer tag on the same channel",
    );
    eventually("connection gone", || {
        let c = conn.status().connected();
        async move { !c }
    })
    .await;
    node.shutdown().await;
}

// ----------------------------------------------------------------------------- channel numbers

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_on_unopened_channel_closes_connection_504() {
    let node = TestNode::start().await;
    let (mut raw, _s, _t) = RawClient::handshake(node.addr, &RawOpts::default()).await;
    raw.send_method(5, raw_declare(&unique("q"))).await;
    let close = raw.expect_connection_close().await;
    assert_eq!(close.reply_code, 504, "close: {close:?}");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_on_closed_channel_closes_connection_504() {
    let node = TestNode::start().await;
    let (mut raw, _s, _t) = RawClient::handshake(node.addr, &RawOpts::default()).await;
    raw.open_channel(1).await;
    raw.send_method(
        1,
        AMQPClass::Channel(chan::AMQPMethod::Close(chan::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    )
    .await;
    match raw.next_method().await {
        Some((1, AMQPClass::Channel(chan::AMQPMethod::CloseOk(_)))) => {}
        other => panic!("expected channel.close-ok, got {other:?}"),
    }
    raw.send_method(1, raw_declare(&unique("q"))).await;
    let close = raw.expect_connection_close().await;
    assert_eq!(close.reply_code, 504, "close: {close:?}");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_channel_open_on_an_open_channel_closes_connection_504() {
    let node = TestNode::start().await;
    let (mut raw, _s, _t) = RawClient::handshake(node.addr, &RawOpts::default()).await;
    raw.open_channel(1).await;
    raw.send_method(1, AMQPClass::Channel(chan::AMQPMethod::Open(chan::Open {})))
        .await;
    let close = raw.expect_connection_close().await;
    assert_eq!(close.reply_code, 504, "close: {close:?}");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_number_can_be_reused_after_close_ok() {
    let node = TestNode::start().await;
    let (mut raw, _s, _t) = RawClient::handshake(node.addr, &RawOpts::default()).await;
    raw.open_channel(1).await;
    raw.send_method(
        1,
        AMQPClass::Channel(chan::AMQPMethod::Close(chan::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    )
    .await;
    match raw.next_method().await {
        Some((1, AMQPClass::Channel(chan::AMQPMethod::CloseOk(_)))) => {}
        other => panic!("expected channel.close-ok, got {other:?}"),
    }
    raw.open_channel(1).await;
    raw.send_method(1, raw_declare(&unique("q"))).await;
    match raw.next_method().await {
        Some((1, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_)))) => {}
        other => panic!("expected queue.declare-ok, got {other:?}"),
    }
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_header_without_publish_closes_connection_505() {
    let node = TestNode::start().await;
    let (mut raw, _s, _t) = RawClient::handshake(node.addr, &RawOpts::default()).await;
    raw.open_channel(1).await;
    raw.send(AMQPFrame::Header(
        1,
        AMQPContentHeader {
            class_id: 60,
            body_size: 3,
            properties: BasicProperties::default(),
        },
    ))
    .await;
    let close = raw.expect_connection_close().await;
    assert_eq!(close.reply_code, 505, "close: {close:?}");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_in_the_middle_of_content_closes_connection_505() {
    let node = TestNode::start().await;
    let (mut raw, _s, _t) = RawClient::handshake(node.addr, &RawOpts::default()).await;
    raw.open_channel(1).await;
    // publish + header announcing 10 bytes, then a method instead of the body.
    let mut bytes = encode(&AMQPFrame::Method(
        1,
        AMQPClass::Basic(amq_protocol::protocol::basic::AMQPMethod::Publish(
            amq_protocol::protocol::basic::Publish {
                exchange: "".into(),
                routing_key: "x".into(),
                mandatory: false,
                immediate: false,
            },
        )),
    ));
    bytes.extend(encode(&AMQPFrame::Header(
        1,
        AMQPContentHeader {
            class_id: 60,
            body_size: 10,
            properties: BasicProperties::default(),
        },
    )));
    bytes.extend(encode(&AMQPFrame::Method(1, raw_declare(&unique("q")))));
    raw.write_bytes(&bytes).await;
    let close = raw.expect_connection_close().await;
    assert_eq!(close.reply_code, 505, "close: {close:?}");
    node.shutdown().await;
}

// ----------------------------------------------------------------------------- permissions

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_without_configure_permission_cannot_declare_but_can_publish_and_get() {
    let node = TestNode::start_with(|c| {
        add_user(c, "writer", "pw", Some(("/", "^$", ".*", ".*")));
    })
    .await;
    let q = unique("perm-q");
    let (_admin_conn, admin) = node.channel().await;
    declare_queue(&admin, &q).await;

    let conn = node.connect_uri(&node.uri_for("writer", "pw", "/")).await;
    let ch = open_channel(&conn).await;
    let res = within(
        "queue.declare",
        ch.queue_declare(
            unique("mine").into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 403, "queue.declare without configure permission");

    let ch = open_channel(&conn).await;
    let res = within(
        "exchange.declare",
        ch.exchange_declare(
            unique("ex").into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 403, "exchange.declare without configure permission");

    let ch = open_channel(&conn).await;
    let res = within(
        "queue.delete",
        ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default()),
    )
    .await;
    assert_code(res, 403, "queue.delete without configure permission");

    // Passive declare needs no configure permission.
    let ch = open_channel(&conn).await;
    assert_eq!(queue_counts(&ch, &q).await.0, 0);
    // Write allows publishing; read allows getting.
    publish(&ch, "", &q, b"allowed").await;
    wait_count(&ch, &q, 1).await;
    assert_eq!(get_some(&ch, &q, true).await.delivery.data, b"allowed");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_without_write_permission_cannot_publish_403() {
    let node = TestNode::start_with(|c| {
        add_user(c, "reader", "pw", Some(("/", ".*", "^$", ".*")));
    })
    .await;
    let q = unique("ro-q");
    let (_admin_conn, admin) = node.channel().await;
    declare_queue(&admin, &q).await;
    within(
        "queue.bind",
        admin.queue_bind(
            q.as_str().into(),
            "amq.direct".into(),
            q.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("bind");

    let conn = node.connect_uri(&node.uri_for("reader", "pw", "/")).await;
    let ch = open_channel(&conn).await;
    let mut watch = watch_channel_on(&ch, &q).await;
    publish(&ch, "amq.direct", &q, b"denied").await;
    expect_closed_with(&mut watch, 403, "publish without write permission").await;
    assert_eq!(
        queue_counts(&admin, &q).await.0,
        0,
        "a refused publish is not enqueued"
    );

    // queue.bind needs write on the queue too.
    let ch = open_channel(&conn).await;
    let res = within(
        "queue.bind",
        ch.queue_bind(
            q.as_str().into(),
            "amq.direct".into(),
            "k".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 403, "queue.bind without write permission on the queue");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_without_read_permission_cannot_get_or_consume_403() {
    let node = TestNode::start_with(|c| {
        add_user(c, "blind", "pw", Some(("/", ".*", ".*", "^$")));
    })
    .await;
    let q = unique("wo-q");
    let (_admin_conn, admin) = node.channel().await;
    declare_queue(&admin, &q).await;
    publish(&admin, "", &q, b"secret").await;

    let conn = node.connect_uri(&node.uri_for("blind", "pw", "/")).await;
    let ch = open_channel(&conn).await;
    let res = within(
        "basic.get",
        ch.basic_get(q.as_str().into(), Default::default()),
    )
    .await;
    assert_code(
        res.map(|m| m.is_some()),
        403,
        "basic.get without read permission",
    );
    let ch = open_channel(&conn).await;
    let res = within(
        "basic.consume",
        ch.basic_consume(
            q.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(
        res.map(|c| c.tag()),
        403,
        "basic.consume without read permission",
    );
    wait_count(&admin, &q, 1).await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configure_permission_regex_selects_resource_names() {
    let node = TestNode::start_with(|c| {
        add_user(c, "app", "pw", Some(("/", "^app-", ".*", ".*")));
    })
    .await;
    let conn = node.connect_uri(&node.uri_for("app", "pw", "/")).await;
    let ch = open_channel(&conn).await;
    let allowed = format!("app-{}", unique("q"));
    declare_queue(&ch, &allowed).await;
    let res = within(
        "queue.declare",
        ch.queue_declare(
            unique("other").into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 403, "queue name outside the configure regex");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_refused_by_its_checks_names_basic_publish_in_channel_close() {
    // RabbitMQ checks a publish while it handles basic.publish: its channel.close names
    // class 60, method 40, though the error shows once the content is complete.
    let node = TestNode::start().await;
    let (mut raw, _s, _t) = RawClient::handshake(node.addr, &RawOpts::default()).await;
    raw.open_channel(1).await;
    raw.publish(1, "no-such-exchange", "k", b"x", 10).await;
    match raw.next_method().await {
        Some((1, AMQPClass::Channel(chan::AMQPMethod::Close(c)))) => {
            assert_eq!(
                (c.reply_code, c.class_id, c.method_id),
                (404, 60, 40),
                "{c:?}"
            );
        }
        other => panic!("expected channel.close, got {other:?}"),
    }
    node.shutdown().await;
}
