//! Connection level: handshake, authentication, vhost access, tune negotiation, protocol
//! header and frame-size errors, handshake timeout, graceful shutdown.

mod common;

use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, channel as chan, connection, queue, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable};
use common::*;
use lapin::options::BasicConsumeOptions;

const CAPABILITIES: &[&str] = &[
    "publisher_confirms",
    "exchange_exchange_bindings",
    "basic.nack",
    "consumer_cancel_notify",
    "connection.blocked",
    "authentication_failure_close",
    "per_consumer_qos",
    "consumer_priorities",
    "direct_reply_to",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_opens_channel_and_closes_cleanly() {
    let node = TestNode::start().await;
    let conn = node.connect().await;
    assert!(conn.status().connected());
    let ch = open_channel(&conn).await;
    assert!(ch.status().connected());
    let q = declare_queue(&ch, "").await;
    assert!(q.name().as_str().starts_with("amq.gen-"));

    within("connection.close", conn.close(200, "bye".into()))
        .await
        .expect("connection.close gets close-ok");
    // Closed, or Error when the server drops the socket right after close-ok and lapin sees
    // the EOF first (server_leaves_socket_close_to_client_after_close_ok pins that down).
    eventually("lapin leaves the closing state", || {
        let closing = conn.status().closing();
        async move { !closing }
    })
    .await;
    assert!(!conn.status().connected(), "{:?}", conn.status());
    assert!(
        within("create_channel", conn.create_channel())
            .await
            .is_err(),
        "a closed connection must not open channels"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_leaves_socket_close_to_client_after_close_ok() {
    let node = TestNode::start().await;
    let (mut raw, _start, _tune) = RawClient::handshake(node.addr, &RawOpts::default()).await;
    raw.send_method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    )
    .await;
    match raw.next_method().await {
        Some((0, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)))) => {}
        other => panic!("expected connection.close-ok, got {other:?}"),
    }
    // close-ok tells the client it may close the socket; RabbitMQ waits for the client to do
    // so (closing itself only after a timeout). Dropping the socket at once races clients
    // such as lapin, which then report an IO error for a clean close.
    match raw.read_frame_for(Duration::from_millis(300)).await {
        Err(()) => {}
        Ok(None) => panic!("server closed the socket right after close-ok"),
        Ok(Some(f)) => panic!("unexpected frame after close-ok: {f:?}"),
    }
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_properties_advertise_rabbitmq_capabilities() {
    let node = TestNode::start().await;
    let (raw, start, _tune) = RawClient::handshake(node.addr, &RawOpts::default()).await;
    assert_eq!((start.version_major, start.version_minor), (0, 9));
    let mechanisms = String::from_utf8_lossy(start.mechanisms.as_bytes()).to_string();
    assert!(
        mechanisms.split_whitespace().any(|m| m == "PLAIN"),
        "mechanisms {mechanisms:?} lack PLAIN"
    );
    let locales = String::from_utf8_lossy(start.locales.as_bytes()).to_string();
    assert!(
        locales.split_whitespace().any(|l| l == "en_US"),
        "locales {locales:?} lack en_US"
    );
    let caps = match start.server_properties.inner().get("capabilities") {
        Some(AMQPValue::FieldTable(t)) => t.clone(),
        other => panic!("server_properties.capabilities missing or not a table: {other:?}"),
    };
    for cap in CAPABILITIES {
        assert_eq!(
            table_bool(&caps, cap),
            Some(true),
            "capability {cap} must be advertised as true; capabilities = {caps:?}"
        );
    }
    drop(raw);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_properties_carry_product_and_cluster_name() {
    let node = TestNode::start().await;
    let (_raw, start, _tune) = RawClient::handshake(node.addr, &RawOpts::default()).await;
    let props = start.server_properties.inner();
    assert!(
        matches!(props.get("product"), Some(AMQPValue::LongString(_))),
        "server_properties.product missing: {props:?}"
    );
    assert!(
        matches!(props.get("version"), Some(AMQPValue::LongString(_))),
        "server_properties.version missing: {props:?}"
    );
    match props.get("cluster_name") {
        Some(AMQPValue::LongString(s)) => {
            assert_eq!(String::from_utf8_lossy(s.as_bytes()), "warren@localhost")
        }
        other => panic!("server_properties.cluster_name should be the node name, got {other:?}"),
    }
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password_is_refused_with_access_refused_403() {
    let node = TestNode::start().await;
    let res = node
        .try_connect_uri(&node.uri_for("guest", "not-the-password", "/"))
        .await;
    assert_code(res, 403, "login with a wrong password");
    // The node still serves correct logins afterwards.
    let conn = node.connect().await;
    assert!(conn.status().connected());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_user_is_refused_with_access_refused_403() {
    let node = TestNode::start().await;
    let res = node
        .try_connect_uri(&node.uri_for("nobody-here", "pw", "/"))
        .await;
    assert_code(res, 403, "login with an unknown user");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password_raw_gets_connection_close_403_not_tune() {
    let node = TestNode::start().await;
    let mut raw = RawClient::connect(node.addr).await;
    let opts = RawOpts {
        password: "wrong".into(),
        ..RawOpts::default()
    };
    let (_start, _tune, res) = raw.try_handshake(&opts).await;
    let close = res.expect_err("a wrong password must not reach connection.open-ok");
    assert_eq!(close.reply_code, 403, "close: {close:?}");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_vhost_is_refused_with_not_allowed_530() {
    let node = TestNode::start().await;
    let res = node
        .try_connect_uri(&node.uri_for("guest", "guest", "no-such-vhost"))
        .await;
    assert_code(res, 530, "connection.open to a missing vhost");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_without_permission_on_vhost_is_refused_with_not_allowed_530() {
    let node = TestNode::start_with(|c| {
        add_user(c, "noperms", "pw", None);
        add_vhost(c, "other");
    })
    .await;
    // A user with no permission entry at all.
    let res = node
        .try_connect_uri(&node.uri_for("noperms", "pw", "/"))
        .await;
    assert_code(res, 530, "user without permissions opening /");
    // guest has permissions on / only.
    let res = node
        .try_connect_uri(&node.uri_for("guest", "guest", "other"))
        .await;
    assert_code(res, 530, "guest opening a vhost it has no permissions on");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vhosts_are_isolated_namespaces() {
    let node = TestNode::start_with(|c| {
        add_vhost(c, "v2");
        add_user(c, "alice", "pw", Some(("v2", ".*", ".*", ".*")));
    })
    .await;
    let q = unique("vhost-q");
    let conn2 = node.connect_uri(&node.uri_for("alice", "pw", "v2")).await;
    let ch2 = open_channel(&conn2).await;
    declare_queue(&ch2, &q).await;
    publish(&ch2, "", &q, b"in-v2").await;
    wait_count(&ch2, &q, 1).await;

    let conn1 = node.connect().await;
    assert!(
        !queue_exists(&conn1, &q).await,
        "a queue declared in vhost v2 must not exist in vhost /"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tune_proposes_configured_limits() {
    let node = TestNode::start_with(|c| {
        c.amqp.heartbeat_s = 7;
        c.amqp.frame_max_bytes = 65536;
        c.amqp.channel_max = 100;
    })
    .await;
    let (_raw, _start, tune) = RawClient::handshake(node.addr, &RawOpts::default()).await;
    assert_eq!(tune.heartbeat, 7, "tune: {tune:?}");
    assert_eq!(tune.frame_max, 65536, "tune: {tune:?}");
    assert_eq!(tune.channel_max, 100, "tune: {tune:?}");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lapin_negotiates_smaller_client_limits_and_large_messages_still_flow() {
    let node = TestNode::start().await;
    let conn = node
        .connect_uri(&format!(
            "{}?frame_max=8192&channel_max=10&heartbeat=5",
            node.uri()
        ))
        .await;
    assert_eq!(conn.configuration().frame_max(), 8192);
    assert_eq!(conn.configuration().channel_max(), 10);
    assert_eq!(conn.configuration().heartbeat(), 5);
    let ch = open_channel(&conn).await;
    let q = declare_queue(&ch, "").await;
    let payload: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
    publish(&ch, "", q.name().as_str(), &payload).await;
    wait_count(&ch, q.name().as_str(), 1).await;
    let got = get_some(&ch, q.name().as_str(), true).await;
    assert_eq!(got.delivery.data.len(), payload.len());
    assert!(got.delivery.data == payload, "multi-frame body corrupted");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_frame_max_caps_a_client_that_asks_for_no_limit() {
    let node = TestNode::start_with(|c| c.amqp.frame_max_bytes = 16384).await;
    let conn = node.connect().await;
    assert_eq!(conn.configuration().frame_max(), 16384);
    let ch = open_channel(&conn).await;
    let q = declare_queue(&ch, "").await;
    let payload = vec![7u8; 100_000];
    publish(&ch, "", q.name().as_str(), &payload).await;
    wait_count(&ch, q.name().as_str(), 1).await;
    let got = get_some(&ch, q.name().as_str(), true).await;
    assert!(got.delivery.data == payload);
    node.shutdown().await;
}

fn declare_passive(name: &str) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
        queue: name.into(),
        passive: true,
        durable: false,
        exclusive: false,
        auto_delete: false,
        nowait: false,
        arguments: FieldTable::default(),
    }))
}

fn declare_plain(name: &str) -> AMQPClass {
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

async fn expect_declare_ok(raw: &mut RawClient, ch: u16) -> queue::DeclareOk {
    match raw.next_method().await {
        Some((c, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)))) if c == ch => ok,
        other => panic!("expected queue.declare-ok on {ch}, got {other:?}"),
    }
}

/// Polls a passive queue.declare on a raw channel until the queue holds `n` messages.
async fn raw_wait_count(raw: &mut RawClient, ch: u16, q: &str, n: u32) {
    let start = std::time::Instant::now();
    loop {
        raw.send_method(ch, declare_passive(q)).await;
        let ok = expect_declare_ok(raw, ch).await;
        if ok.message_count == n {
            return;
        }
        assert!(
            start.elapsed() < TIMEOUT,
            "queue {q} holds {} messages, expected {n}",
            ok.message_count
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smaller_client_frame_max_is_enforced_with_frame_error_501() {
    let node = TestNode::start().await;
    let opts = RawOpts {
        frame_max: Some(4096),
        ..RawOpts::default()
    };
    let (mut raw, _start, tune) = RawClient::handshake(node.addr, &opts).await;
    assert!(
        tune.frame_max > 4096,
        "server proposes more than the client takes"
    );
    raw.open_channel(1).await;
    let q = unique("fm-q");
    raw.send_method(1, declare_plain(&q)).await;
    expect_declare_ok(&mut raw, 1).await;

    // 4000 payload bytes + 8 overhead fit in 4096: accepted.
    raw.publish(1, "", &q, &vec![1u8; 4000], 4000).await;
    raw_wait_count(&mut raw, 1, &q, 1).await;

    // 5000 payload bytes in one frame exceed the negotiated 4096 (but not the server's
    // proposal): the server must hold the client to the smaller value.
    raw.publish(1, "", &q, &vec![2u8; 5000], 5000).await;
    let close = raw.expect_connection_close().await;
    assert_eq!(close.reply_code, 501, "close: {close:?}");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_are_split_at_the_negotiated_frame_max() {
    let node = TestNode::start().await;
    let opts = RawOpts {
        frame_max: Some(4096),
        ..RawOpts::default()
    };
    let (mut raw, _start, _tune) = RawClient::handshake(node.addr, &opts).await;
    raw.open_channel(1).await;
    let q = unique("split-q");
    raw.send_method(1, declare_plain(&q)).await;
    expect_declare_ok(&mut raw, 1).await;
    let payload: Vec<u8> = (0..10_000u32).map(|i| (i % 199) as u8).collect();
    raw.publish(1, "", &q, &payload, 4000).await;
    raw.send_method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: q.as_str().into(),
            no_ack: true,
        })),
    )
    .await;
    match raw.next_method().await {
        Some((1, AMQPClass::Basic(basic::AMQPMethod::GetOk(_)))) => {}
        other => panic!("expected basic.get-ok, got {other:?}"),
    }
    let mut received = Vec::new();
    let mut header_size = None;
    while received.len() < payload.len() {
        match raw.read_frame().await.expect("socket open") {
            AMQPFrame::Header(1, h) => header_size = Some(h.body_size),
            AMQPFrame::Body(1, b) => {
                assert!(
                    b.len() + 8 <= 4096,
                    "body frame of {} payload bytes exceeds negotiated frame_max 4096",
                    b.len()
                );
                received.extend(b);
            }
            AMQPFrame::Heartbeat => {}
            other => panic!("unexpected frame while reading content: {other:?}"),
        }
    }
    assert_eq!(header_size, Some(payload.len() as u64));
    assert!(
        received == payload,
        "content reassembled from frames differs"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_frame_closes_connection_with_frame_error_501() {
    let node = TestNode::start().await;
    let (mut raw, _start, tune) = RawClient::handshake(node.addr, &RawOpts::default()).await;
    assert_eq!(tune.frame_max, 131_072);
    raw.open_channel(1).await;
    let q = unique("big-frame-q");
    raw.send_method(1, declare_plain(&q)).await;
    expect_declare_ok(&mut raw, 1).await;
    let body = vec![0u8; 131_072 + 100];
    // The server may stop reading once it has seen the frame header; the rest of the write
    // can then fail, which is fine: what matters is the connection.close it sends.
    let _ = raw
        .try_write_bytes(&RawClient::publish_bytes(1, "", &q, &body, body.len()))
        .await;
    let close = raw.expect_connection_close().await;
    assert_eq!(close.reply_code, 501, "close: {close:?}");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_channel_max_limits_open_channels_with_530() {
    let node = TestNode::start().await;
    let opts = RawOpts {
        channel_max: Some(2),
        ..RawOpts::default()
    };
    let (mut raw, _start, _tune) = RawClient::handshake(node.addr, &opts).await;
    raw.open_channel(1).await;
    raw.open_channel(2).await;
    raw.send_method(3, AMQPClass::Channel(chan::AMQPMethod::Open(chan::Open {})))
        .await;
    let close = raw.expect_connection_close().await;
    assert_eq!(
        close.reply_code, 530,
        "opening a 3rd channel with channel_max 2: {close:?}"
    );
    node.shutdown().await;
}

async fn assert_header_refused(bytes: &[u8]) {
    let node = TestNode::start().await;
    let mut raw = RawClient::connect(node.addr).await;
    raw.write_bytes(bytes).await;
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    use tokio::io::AsyncReadExt;
    loop {
        match within("read until close", raw.stream.read(&mut buf)).await {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
        assert!(got.len() <= 64, "server keeps talking: {got:?}");
    }
    assert_eq!(
        got,
        PROTOCOL_HEADER.to_vec(),
        "after header {bytes:?} the server must answer exactly AMQP 0-9-1's header, then close"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_amqp_bytes_get_the_protocol_header_and_close() {
    assert_header_refused(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_amqp_version_gets_the_protocol_header_and_close() {
    // AMQP 0-10.
    assert_header_refused(b"AMQP\x01\x01\x00\x0a").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_1_0_header_gets_the_0_9_1_header_and_close() {
    assert_header_refused(b"AMQP\x00\x01\x00\x00").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_handshake_is_closed_after_handshake_timeout() {
    let node = TestNode::start_with(|c| c.amqp.handshake_timeout_ms = 500).await;
    // Sends the header, receives connection.start, then stalls.
    let mut raw = RawClient::connect(node.addr).await;
    raw.write_bytes(PROTOCOL_HEADER).await;
    match raw.next_method().await {
        Some((0, AMQPClass::Connection(connection::AMQPMethod::Start(_)))) => {}
        other => panic!("expected connection.start, got {other:?}"),
    }
    let took = raw.wait_eof(Duration::from_secs(5)).await;
    assert!(
        took >= Duration::from_millis(300),
        "closed after {took:?}, before the handshake timeout"
    );

    // A client that never even sends the header.
    let mut silent = RawClient::connect(node.addr).await;
    let took = silent.wait_eof(Duration::from_secs(5)).await;
    assert!(took >= Duration::from_millis(300), "closed after {took:?}");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_raw_client_with_connection_forced_320() {
    let mut node = TestNode::start().await;
    let (mut raw, _start, _tune) = RawClient::handshake(node.addr, &RawOpts::default()).await;
    raw.open_channel(1).await;
    let inner = node.take_node();
    let (_, close) = tokio::join!(
        within("node.shutdown", inner.shutdown()),
        raw.expect_connection_close()
    );
    assert_eq!(close.reply_code, 320, "close: {close:?}");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_lapin_connection_and_consumers() {
    let mut node = TestNode::start().await;
    let (conn, ch) = node.channel().await;
    let q = declare_queue(&ch, "").await;
    let mut watch = consume(
        &ch,
        q.name().as_str(),
        BasicConsumeOptions {
            no_ack: true,
            ..Default::default()
        },
    )
    .await;
    let inner = node.take_node();
    let (_, code) = tokio::join!(
        within("node.shutdown", inner.shutdown()),
        connection_end_code(&mut watch)
    );
    // lapin may or may not pass the reply code on to consumers (see connection_end_code);
    // the raw-client test pins the code exactly.
    if let Some(code) = code {
        assert_eq!(code, 320);
    }
    eventually("lapin sees the connection gone", || {
        let connected = conn.status().connected();
        async move { !connected }
    })
    .await;
    node.shutdown().await;
}
