//! Shared helpers for the AMQP integration tests.
//!
//! - [`TestNode`] starts a Warren node on 127.0.0.1:0 with its data in a fresh folder under
//!   `std::env::temp_dir()`, and hands out lapin connections to it.
//! - [`within`] bounds every await (10 s); a hung broker fails the test instead of hanging it.
//! - [`Deliveries`] turns a lapin consumer into a channel of deliveries (lapin 4 only offers a
//!   `futures_core::Stream`, which the tests cannot name without another dependency, so the
//!   consumer delegate forwards into a tokio channel).
//! - [`watch_channel`] puts a sentinel consumer on a channel: lapin reports a channel close
//!   to every consumer of the channel, so the sentinel observes reply codes of asynchronous
//!   channel errors (publish, ack) without racing the next request. For a server-initiated
//!   connection close lapin may cancel consumers without the code ([`connection_end_code`]),
//!   so connection-level reply codes are asserted via a pending request or [`RawClient`].
//! - [`publish_confirmed`] / [`wait_count`]: publishes reach queues asynchronously (in
//!   RabbitMQ, and in any broker with queue tasks), so tests wait for a confirm or a count
//!   before looking at a queue.
//! - [`RawClient`] speaks AMQP frames over a plain `TcpStream` (encoded and decoded with
//!   `amq-protocol`), for what lapin cannot send or does not expose: bad headers, oversized
//!   frames, server properties, heartbeats, methods on unopened channels.
#![allow(dead_code)]

pub mod faults;
pub mod procs;
pub mod watchdog;
pub mod webdriver;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use amq_protocol::frame::{
    gen_frame, parse_frame, AMQPContentHeader, AMQPFrame, ProtocolVersion, WriteContext,
};
use amq_protocol::protocol::{basic, channel as chan, connection, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::message::{BasicGetMessage, Delivery, DeliveryResult};
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, Consumer, ErrorKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use warren::config::{Config, PermissionConfig, UserConfig, VhostConfig};
use warren::runtime::Node;

/// Upper bound for any single await in the tests.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// How long "nothing else arrives" checks wait.
pub const QUIET: Duration = Duration::from_millis(300);

/// Awaits `fut`, failing the test if it takes longer than [`TIMEOUT`].
pub async fn within<F: Future>(what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(TIMEOUT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {TIMEOUT:?}: {what}"),
    }
}

/// Closes a client connection (reply 200), failing the test if the broker's close-ok does
/// not come within [`TIMEOUT`]: a close that never completes is a broker bug, and an
/// unbounded await let one hang CI until its time ran out. An error (the socket already
/// gone) is fine.
pub async fn close_connection(conn: &Connection) {
    let _ = within("connection.close", conn.close(200, "bye".into())).await;
}

/// A name unique in this process and across processes (pid + counter + clock).
pub fn unique(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{prefix}-{}-{n}-{nanos}", std::process::id())
}

/// Percent-encodes a vhost for an amqp:// URI path.
pub fn encode_vhost(vhost: &str) -> String {
    let mut out = String::new();
    for b in vhost.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.' || b == b'~' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02x}"));
        }
    }
    out
}

/// A running node plus the folder holding its data.
pub struct TestNode {
    node: Option<Node>,
    pub addr: SocketAddr,
    data_dir: PathBuf,
}

impl TestNode {
    /// A node with `Config::for_tests`.
    pub async fn start() -> TestNode {
        Self::start_with(|_| {}).await
    }

    /// A node with `Config::for_tests` adjusted by `adjust`.
    pub async fn start_with(adjust: impl FnOnce(&mut Config)) -> TestNode {
        let data_dir = std::env::temp_dir().join(unique("warren-test"));
        std::fs::create_dir_all(&data_dir).expect("create test data dir");
        let mut config = Config::for_tests(&data_dir);
        adjust(&mut config);
        let node = within("Node::start", Node::start(config))
            .await
            .expect("node starts");
        let addr = node.amqp_addr();
        TestNode {
            node: Some(node),
            addr,
            data_dir,
        }
    }

    /// `amqp://guest:guest@addr/%2f`.
    pub fn uri(&self) -> String {
        self.uri_for("guest", "guest", "/")
    }

    pub fn uri_for(&self, user: &str, password: &str, vhost: &str) -> String {
        format!(
            "amqp://{user}:{password}@{}/{}",
            self.addr,
            encode_vhost(vhost)
        )
    }

    /// A lapin connection as guest to vhost `/`.
    pub async fn connect(&self) -> Connection {
        self.connect_uri(&self.uri()).await
    }

    pub async fn connect_uri(&self, uri: &str) -> Connection {
        within(
            "lapin connect",
            Connection::connect(uri, ConnectionProperties::default()),
        )
        .await
        .unwrap_or_else(|e| panic!("connect to {uri} failed: {e}"))
    }

    /// Tries a connection, returning lapin's result.
    pub async fn try_connect_uri(&self, uri: &str) -> lapin::Result<Connection> {
        within(
            "lapin connect",
            Connection::connect(uri, ConnectionProperties::default()),
        )
        .await
    }

    /// A connection and one open channel on it.
    pub async fn channel(&self) -> (Connection, Channel) {
        let conn = self.connect().await;
        let ch = open_channel(&conn).await;
        (conn, ch)
    }

    /// A connection and one open channel in publisher-confirm mode.
    pub async fn confirm_channel(&self) -> (Connection, Channel) {
        let conn = self.connect().await;
        let ch = confirm_channel(&conn).await;
        (conn, ch)
    }

    /// The node's broker, to apply metadata commands as `warrenctl` would.
    pub fn broker(&self) -> &std::sync::Arc<warren::broker::Broker> {
        self.node.as_ref().expect("node running").broker()
    }

    /// The node's admin endpoint (`warrenctl --node`).
    pub fn admin_addr(&self) -> SocketAddr {
        self.node.as_ref().expect("node running").admin_addr()
    }

    /// The node's Prometheus endpoint (`http://ADDR/metrics`).
    pub fn prometheus_addr(&self) -> SocketAddr {
        self.node
            .as_ref()
            .expect("node running")
            .prometheus_addr()
            .expect("prometheus listener on")
    }

    /// The node's management HTTP API (`http://ADDR/api/...`).
    pub fn mgmt_addr(&self) -> SocketAddr {
        self.node
            .as_ref()
            .expect("node running")
            .mgmt_addr()
            .expect("management listener on")
    }

    /// The node's AMQPS listener (`[amqp.tls]`).
    pub fn amqps_addr(&self) -> SocketAddr {
        self.node
            .as_ref()
            .expect("node running")
            .amqps_addr()
            .expect("AMQPS listener on")
    }

    /// The node's management API over HTTPS (`[management.tls]`).
    pub fn mgmt_tls_addr(&self) -> SocketAddr {
        self.node
            .as_ref()
            .expect("node running")
            .mgmt_tls_addr()
            .expect("management HTTPS listener on")
    }

    /// The node's data folder.
    pub fn data_dir(&self) -> &std::path::Path {
        &self.data_dir
    }

    /// Stops the node (bounded) and starts a new one on the same data folder.
    pub async fn restart(self) -> TestNode {
        self.restart_with(|_| {}).await
    }

    /// Like [`TestNode::restart`], with the new node's config adjusted by `adjust`.
    pub async fn restart_with(mut self, adjust: impl FnOnce(&mut Config)) -> TestNode {
        if let Some(node) = self.node.take() {
            within("node.shutdown", node.shutdown()).await;
        }
        let mut config = Config::for_tests(&self.data_dir);
        config.node.data_dir = self.data_dir.clone();
        adjust(&mut config);
        let node = within("Node::start", Node::start(config))
            .await
            .expect("node restarts");
        let addr = node.amqp_addr();
        let data_dir = std::mem::take(&mut self.data_dir);
        TestNode {
            node: Some(node),
            addr,
            data_dir,
        }
    }

    /// Stops the node (bounded) and removes its data folder.
    pub async fn shutdown(mut self) {
        if let Some(node) = self.node.take() {
            within("node.shutdown", node.shutdown()).await;
        }
        let _ = std::fs::remove_dir_all(&self.data_dir);
    }

    /// Takes the node out, for tests that drive `shutdown` concurrently with a client.
    pub fn take_node(&mut self) -> Node {
        self.node.take().expect("node still running")
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        // A test that panicked before `shutdown`: the runtime drops the node's tasks; the
        // folder is removed here so failed runs do not litter the temp dir.
        let _ = std::fs::remove_dir_all(&self.data_dir);
    }
}

/// Adds a user with a password and (optionally) permissions on a vhost to a config.
pub fn add_user(
    config: &mut Config,
    name: &str,
    password: &str,
    perms: Option<(&str, &str, &str, &str)>,
) {
    config.users.push(UserConfig {
        name: name.into(),
        password: password.into(),
        tags: vec![],
    });
    if let Some((vhost, configure, write, read)) = perms {
        config.permissions.push(PermissionConfig {
            user: name.into(),
            vhost: vhost.into(),
            configure: configure.into(),
            write: write.into(),
            read: read.into(),
        });
    }
}

/// Adds a vhost to a config.
pub fn add_vhost(config: &mut Config, name: &str) {
    config.vhosts.push(VhostConfig { name: name.into() });
}

pub async fn open_channel(conn: &Connection) -> Channel {
    within("create_channel", conn.create_channel())
        .await
        .expect("create_channel")
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// The AMQP reply code carried by a lapin error, if it is a protocol error.
pub fn reply_code(err: &lapin::Error) -> Option<u16> {
    match err.kind() {
        ErrorKind::ProtocolError(e) => Some(e.get_id()),
        _ => None,
    }
}

/// The reply text (`NAME - text`) carried by a lapin error, if it is a protocol error.
pub fn reply_text(err: &lapin::Error) -> Option<String> {
    match err.kind() {
        ErrorKind::ProtocolError(e) => Some(e.get_message().to_string()),
        _ => None,
    }
}

/// Asserts that `res` failed with AMQP reply code `code`.
#[track_caller]
pub fn assert_code<T: std::fmt::Debug>(
    res: lapin::Result<T>,
    code: u16,
    what: &str,
) -> lapin::Error {
    match res {
        Ok(v) => panic!("{what}: expected reply code {code}, but it succeeded with {v:?}"),
        Err(e) => {
            assert_eq!(
                reply_code(&e),
                Some(code),
                "{what}: expected reply code {code}, got error {e} ({:?})",
                e.kind()
            );
            e
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Queues, publishing, getting
// ---------------------------------------------------------------------------------------------

pub async fn declare_queue(ch: &Channel, name: &str) -> lapin::Queue {
    declare_queue_with(
        ch,
        name,
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
}

pub async fn declare_queue_with(
    ch: &Channel,
    name: &str,
    options: QueueDeclareOptions,
    args: FieldTable,
) -> lapin::Queue {
    within(
        "queue.declare",
        ch.queue_declare(name.into(), options, args),
    )
    .await
    .unwrap_or_else(|e| panic!("queue.declare {name}: {e}"))
}

/// Passive declare; returns (message_count, consumer_count).
pub async fn queue_counts(ch: &Channel, name: &str) -> (u32, u32) {
    let q = within(
        "passive queue.declare",
        ch.queue_declare(
            name.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await
    .unwrap_or_else(|e| panic!("passive queue.declare {name}: {e}"));
    (q.message_count(), q.consumer_count())
}

/// Publishes without waiting for anything but the write.
pub async fn publish(ch: &Channel, exchange: &str, routing_key: &str, body: &[u8]) {
    publish_with(
        ch,
        exchange,
        routing_key,
        body,
        BasicPublishOptions::default(),
        BasicProperties::default(),
    )
    .await
}

pub async fn publish_with(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    options: BasicPublishOptions,
    props: BasicProperties,
) {
    within(
        "basic.publish",
        ch.basic_publish(exchange.into(), routing_key.into(), options, body, props),
    )
    .await
    .unwrap_or_else(|e| panic!("basic.publish to {exchange:?}/{routing_key:?}: {e}"));
}

/// Opens a channel in publisher-confirm mode.
pub async fn confirm_channel(conn: &Connection) -> Channel {
    let ch = open_channel(conn).await;
    within(
        "confirm.select",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
    ch
}

/// Publishes on a confirm-mode channel and waits for the broker's ack. Once acked, the
/// message is in every queue it routes to (or routed nowhere), so counts and gets that follow
/// are deterministic; plain publishes reach queues asynchronously in RabbitMQ.
pub async fn publish_confirmed(ch: &Channel, exchange: &str, routing_key: &str, body: &[u8]) {
    let confirmation = publish_confirmed_with(
        ch,
        exchange,
        routing_key,
        body,
        BasicPublishOptions::default(),
        BasicProperties::default(),
    )
    .await;
    assert!(
        confirmation.is_ack(),
        "publish to {exchange:?}/{routing_key:?} was nacked"
    );
}

/// Publishes on a confirm-mode channel and returns the broker's confirmation.
pub async fn publish_confirmed_with(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    options: BasicPublishOptions,
    props: BasicProperties,
) -> lapin::Confirmation {
    let confirm = within(
        "basic.publish",
        ch.basic_publish(exchange.into(), routing_key.into(), options, body, props),
    )
    .await
    .unwrap_or_else(|e| panic!("basic.publish to {exchange:?}/{routing_key:?}: {e}"));
    within("publisher confirm", confirm)
        .await
        .unwrap_or_else(|e| panic!("confirm of publish to {exchange:?}/{routing_key:?}: {e}"))
}

/// Waits until a queue's ready-message count (passive declare) equals `n`.
pub async fn wait_count(ch: &Channel, queue: &str, n: u32) {
    let start = Instant::now();
    loop {
        let (count, _) = queue_counts(ch, queue).await;
        if count == n {
            return;
        }
        if start.elapsed() > TIMEOUT {
            panic!("queue {queue} holds {count} messages, expected {n} (waited {TIMEOUT:?})");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub async fn get(ch: &Channel, queue: &str, no_ack: bool) -> Option<BasicGetMessage> {
    within(
        "basic.get",
        ch.basic_get(queue.into(), BasicGetOptions { no_ack }),
    )
    .await
    .unwrap_or_else(|e| panic!("basic.get {queue}: {e}"))
}

/// basic.get that must return a message.
pub async fn get_some(ch: &Channel, queue: &str, no_ack: bool) -> BasicGetMessage {
    get(ch, queue, no_ack)
        .await
        .unwrap_or_else(|| panic!("basic.get {queue}: expected a message, got get-empty"))
}

/// Polls `check` every 20 ms until it returns true, failing after [`TIMEOUT`].
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if check().await {
            return;
        }
        if start.elapsed() > TIMEOUT {
            panic!("condition never became true within {TIMEOUT:?}: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether a queue exists, checked with a passive declare on a fresh channel (a missing
/// queue closes that channel with 404; any other outcome is a test failure).
pub async fn queue_exists(conn: &Connection, name: &str) -> bool {
    let ch = open_channel(conn).await;
    let res = within(
        "passive queue.declare",
        ch.queue_declare(
            name.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await;
    match res {
        Ok(_) => {
            let _ = within("channel.close", ch.close(200, "bye".into())).await;
            true
        }
        Err(e) if reply_code(&e) == Some(404) => false,
        Err(e) => panic!("passive declare of {name}: unexpected error {e}"),
    }
}

/// Same as [`queue_exists`] for exchanges.
pub async fn exchange_exists(conn: &Connection, name: &str) -> bool {
    let ch = open_channel(conn).await;
    let res = within(
        "passive exchange.declare",
        ch.exchange_declare(
            name.into(),
            lapin::ExchangeKind::Direct,
            lapin::options::ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await;
    match res {
        Ok(_) => {
            let _ = within("channel.close", ch.close(200, "bye".into())).await;
            true
        }
        Err(e) if reply_code(&e) == Some(404) => false,
        Err(e) => panic!("passive declare of exchange {name}: unexpected error {e}"),
    }
}

pub fn table(entries: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert((*k).into(), v.clone());
    }
    t
}

pub fn lstr(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.into())
}

// ---------------------------------------------------------------------------------------------
// Consumers
// ---------------------------------------------------------------------------------------------

/// A consumer whose deliveries are forwarded into a tokio channel, in arrival order.
pub struct Deliveries {
    rx: mpsc::UnboundedReceiver<DeliveryResult>,
    consumer: Consumer,
}

impl Deliveries {
    pub fn tag(&self) -> String {
        self.consumer.tag().to_string()
    }

    /// The next event: `Ok(Some(d))` a delivery, `Ok(None)` a cancel, `Err(e)` an error.
    pub async fn next_event(&mut self) -> DeliveryResult {
        within("consumer event", self.rx.recv())
            .await
            .unwrap_or(Ok(None))
    }

    /// The next delivery; fails the test on a cancel, an error or a timeout.
    pub async fn next(&mut self) -> Delivery {
        match self.next_event().await {
            Ok(Some(d)) => d,
            Ok(None) => panic!(
                "consumer {} was cancelled while a delivery was expected",
                self.tag()
            ),
            Err(e) => panic!(
                "consumer {} got error {e} while a delivery was expected",
                self.tag()
            ),
        }
    }

    /// Asserts no event arrives within `d`.
    pub async fn expect_nothing(&mut self, d: Duration) {
        if let Ok(ev) = tokio::time::timeout(d, self.rx.recv()).await {
            match ev {
                Some(Ok(Some(del))) => panic!(
                    "unexpected delivery {:?} (tag {}) on consumer {}",
                    String::from_utf8_lossy(&del.data),
                    del.delivery_tag,
                    self.tag()
                ),
                Some(other) => panic!("unexpected consumer event {other:?}"),
                None => panic!("consumer channel closed unexpectedly"),
            }
        }
    }

    /// Waits for the consumer to be cancelled (by the server or the client).
    pub async fn expect_cancelled(&mut self) {
        match self.next_event().await {
            Ok(None) => {}
            Ok(Some(d)) => panic!(
                "expected cancel, got delivery {:?}",
                String::from_utf8_lossy(&d.data)
            ),
            Err(e) => panic!("expected a plain cancel, got error {e}"),
        }
    }

    /// Waits for the error that ended the consumer (channel or connection closed by the
    /// server) and returns its reply code.
    pub async fn expect_error_code(&mut self) -> u16 {
        loop {
            match self.next_event().await {
                Err(e) => {
                    return reply_code(&e)
                        .unwrap_or_else(|| panic!("channel ended with a non-AMQP error: {e}"))
                }
                Ok(None) => panic!(
                    "consumer {} ended without an error (channel closed without a reply code?)",
                    self.tag()
                ),
                Ok(Some(_)) => continue,
            }
        }
    }
}

pub async fn consume(ch: &Channel, queue: &str, options: BasicConsumeOptions) -> Deliveries {
    consume_tagged(ch, queue, "", options).await
}

pub async fn consume_tagged(
    ch: &Channel,
    queue: &str,
    tag: &str,
    options: BasicConsumeOptions,
) -> Deliveries {
    let consumer = within(
        "basic.consume",
        ch.basic_consume(queue.into(), tag.into(), options, FieldTable::default()),
    )
    .await
    .unwrap_or_else(|e| panic!("basic.consume {queue}: {e}"));
    attach(consumer)
}

pub async fn consume_with_args(
    ch: &Channel,
    queue: &str,
    options: BasicConsumeOptions,
    args: FieldTable,
) -> Deliveries {
    let consumer = within(
        "basic.consume",
        ch.basic_consume(queue.into(), "".into(), options, args),
    )
    .await
    .unwrap_or_else(|e| panic!("basic.consume {queue}: {e}"));
    attach(consumer)
}

/// Forwards a lapin consumer into a [`Deliveries`].
pub fn attach(consumer: Consumer) -> Deliveries {
    let (tx, rx) = mpsc::unbounded_channel();
    // The delegate runs synchronously when lapin dispatches, so order is preserved.
    consumer.set_delegate(move |d: DeliveryResult| {
        let _ = tx.send(d);
        std::future::ready(())
    });
    Deliveries { rx, consumer }
}

/// A sentinel consumer (on a fresh server-named exclusive queue) that reports how `ch` ends.
pub async fn watch_channel(ch: &Channel) -> Deliveries {
    let q = declare_queue_with(
        ch,
        "",
        QueueDeclareOptions {
            exclusive: true,
            auto_delete: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await;
    watch_channel_on(ch, q.name().as_str()).await
}

/// A sentinel consumer on an existing (empty) queue.
pub async fn watch_channel_on(ch: &Channel, queue: &str) -> Deliveries {
    consume(
        ch,
        queue,
        BasicConsumeOptions {
            no_ack: true,
            ..Default::default()
        },
    )
    .await
}

/// Waits until a sentinel sees its connection end. lapin reports a server-initiated
/// connection.close to consumers either as the close's error or as a plain cancel (its IO
/// loop may cancel consumers before it propagates the error), so this returns the reply code
/// when lapin passed one on, `None` otherwise. Tests that need the exact code of a
/// connection-level error use a pending request (rejected with the close) or [`RawClient`].
pub async fn connection_end_code(watch: &mut Deliveries) -> Option<u16> {
    loop {
        match watch.next_event().await {
            // An IO error (the server closed the socket right after close-ok) carries no code.
            Err(e) => return reply_code(&e),
            Ok(None) => return None,
            Ok(Some(_)) => continue,
        }
    }
}

/// Waits until the sentinel sees the channel closed by the server and asserts the reply
/// code (channel-level errors; see [`connection_end_code`] for connection-level ones).
pub async fn expect_closed_with(watch: &mut Deliveries, code: u16, what: &str) {
    let got = watch.expect_error_code().await;
    assert_eq!(
        got, code,
        "{what}: expected the server to close with {code}, got {got}"
    );
}

pub fn body(d: &Delivery) -> String {
    String::from_utf8_lossy(&d.data).into_owned()
}

// ---------------------------------------------------------------------------------------------
// Raw AMQP over TCP
// ---------------------------------------------------------------------------------------------

pub const PROTOCOL_HEADER: &[u8; 8] = b"AMQP\x00\x00\x09\x01";

/// Parameters of a hand-made handshake.
#[derive(Clone, Debug)]
pub struct RawOpts {
    pub user: String,
    pub password: String,
    pub vhost: String,
    /// None: echo the server's proposal in tune-ok.
    pub channel_max: Option<u16>,
    pub frame_max: Option<u32>,
    pub heartbeat: Option<u16>,
}

impl Default for RawOpts {
    fn default() -> Self {
        RawOpts {
            user: "guest".into(),
            password: "guest".into(),
            vhost: "/".into(),
            channel_max: None,
            frame_max: None,
            // Off unless a test asks: a raw client does not answer heartbeats by itself.
            heartbeat: Some(0),
        }
    }
}

/// A frame-level AMQP client on a plain socket.
pub struct RawClient {
    pub stream: TcpStream,
}

pub fn encode(frame: &AMQPFrame) -> Vec<u8> {
    let ctx = gen_frame(frame)(WriteContext::from(Vec::new()))
        .unwrap_or_else(|e| panic!("cannot encode {frame:?}: {e:?}"));
    ctx.write
}

pub fn client_properties() -> FieldTable {
    let caps = table(&[
        ("publisher_confirms", AMQPValue::Boolean(true)),
        ("exchange_exchange_bindings", AMQPValue::Boolean(true)),
        ("basic.nack", AMQPValue::Boolean(true)),
        ("consumer_cancel_notify", AMQPValue::Boolean(true)),
        ("connection.blocked", AMQPValue::Boolean(true)),
        ("authentication_failure_close", AMQPValue::Boolean(true)),
    ]);
    table(&[
        ("product", lstr("warren-tests")),
        ("capabilities", AMQPValue::FieldTable(caps)),
    ])
}

impl RawClient {
    pub async fn connect(addr: SocketAddr) -> RawClient {
        let stream = within("tcp connect", TcpStream::connect(addr))
            .await
            .expect("tcp connect");
        stream.set_nodelay(true).ok();
        RawClient { stream }
    }

    pub async fn write_bytes(&mut self, bytes: &[u8]) {
        within("socket write", self.stream.write_all(bytes))
            .await
            .expect("socket write");
    }

    /// Writes, returning the IO result instead of failing (for writes the server may cut
    /// short by closing the connection).
    pub async fn try_write_bytes(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        within("socket write", self.stream.write_all(bytes)).await
    }

    pub async fn send(&mut self, frame: AMQPFrame) {
        let bytes = encode(&frame);
        self.write_bytes(&bytes).await;
    }

    pub async fn send_method(&mut self, channel: u16, method: AMQPClass) {
        self.send(AMQPFrame::Method(channel, method)).await;
    }

    /// Reads one frame; `None` on EOF or reset. Fails after [`TIMEOUT`].
    pub async fn read_frame(&mut self) -> Option<AMQPFrame> {
        match tokio::time::timeout(TIMEOUT, self.read_frame_inner()).await {
            Ok(f) => f,
            Err(_) => panic!("no frame from the server within {TIMEOUT:?}"),
        }
    }

    /// Reads one frame, or `Err(())` if none starts within `d`.
    pub async fn read_frame_for(&mut self, d: Duration) -> Result<Option<AMQPFrame>, ()> {
        tokio::time::timeout(d, self.read_frame_inner())
            .await
            .map_err(|_| ())
    }

    /// Reads one frame, or the protocol header a server sends to refuse a client's header,
    /// or `Err(())` if nothing starts within `d`. `Ok(None)` on EOF or reset.
    pub async fn read_frame_or_header_for(
        &mut self,
        d: Duration,
    ) -> Result<Option<Result<AMQPFrame, [u8; 8]>>, ()> {
        tokio::time::timeout(d, self.read_item_inner())
            .await
            .map_err(|_| ())
    }

    async fn read_frame_inner(&mut self) -> Option<AMQPFrame> {
        match self.read_item_inner().await? {
            Ok(frame) => Some(frame),
            Err(header) => panic!("server sent a protocol header mid-connection: {header:?}"),
        }
    }

    async fn read_item_inner(&mut self) -> Option<Result<AMQPFrame, [u8; 8]>> {
        let mut head = [0u8; 7];
        if self.stream.read_exact(&mut head).await.is_err() {
            return None;
        }
        if &head[..4] == b"AMQP" {
            let mut header = [0u8; 8];
            header[..7].copy_from_slice(&head);
            self.stream.read_exact(&mut header[7..]).await.ok()?;
            return Some(Err(header));
        }
        let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
        let mut rest = vec![0u8; size + 1];
        if self.stream.read_exact(&mut rest).await.is_err() {
            return None;
        }
        let mut full = head.to_vec();
        full.extend_from_slice(&rest);
        match parse_frame(&full[..]) {
            Ok((_, frame)) => Some(Ok(frame)),
            Err(e) => panic!("cannot parse frame from server {full:?}: {e:?}"),
        }
    }

    /// The next method frame, skipping heartbeats (and content frames); `None` on EOF.
    pub async fn next_method(&mut self) -> Option<(u16, AMQPClass)> {
        loop {
            match self.read_frame().await? {
                AMQPFrame::Method(ch, m) => return Some((ch, m)),
                _ => continue,
            }
        }
    }

    /// Reads until the server sends connection.close; answers close-ok; returns the close.
    pub async fn expect_connection_close(&mut self) -> connection::Close {
        loop {
            match self.next_method().await {
                Some((0, AMQPClass::Connection(connection::AMQPMethod::Close(c)))) => {
                    // Best effort: the server may already have stopped reading.
                    let ok = encode(&AMQPFrame::Method(
                        0,
                        AMQPClass::Connection(connection::AMQPMethod::CloseOk(
                            connection::CloseOk {},
                        )),
                    ));
                    let _ = self.try_write_bytes(&ok).await;
                    return c;
                }
                Some(_) => continue,
                None => panic!("socket closed without connection.close"),
            }
        }
    }

    /// Reads (and discards) until EOF; returns how long that took. Fails after `limit`.
    pub async fn wait_eof(&mut self, limit: Duration) -> Duration {
        let start = Instant::now();
        let mut buf = [0u8; 4096];
        loop {
            let left = limit.checked_sub(start.elapsed()).unwrap_or_default();
            match tokio::time::timeout(left, self.stream.read(&mut buf)).await {
                Err(_) => panic!("socket still open after {limit:?}"),
                Ok(Ok(0)) | Ok(Err(_)) => return start.elapsed(),
                Ok(Ok(_)) => continue,
            }
        }
    }

    /// Full handshake; panics unless it reaches connection.open-ok.
    pub async fn handshake(
        addr: SocketAddr,
        opts: &RawOpts,
    ) -> (RawClient, connection::Start, connection::Tune) {
        let mut c = RawClient::connect(addr).await;
        let (start, tune, res) = c.try_handshake(opts).await;
        if let Err(close) = res {
            panic!("handshake refused: {close:?}");
        }
        (c, start, tune)
    }

    /// Handshake that may be refused: returns start, tune and either open-ok or the close.
    pub async fn try_handshake(
        &mut self,
        opts: &RawOpts,
    ) -> (
        connection::Start,
        connection::Tune,
        Result<(), connection::Close>,
    ) {
        self.write_bytes(PROTOCOL_HEADER).await;
        let start = match self.next_method().await {
            Some((0, AMQPClass::Connection(connection::AMQPMethod::Start(s)))) => s,
            other => panic!("expected connection.start, got {other:?}"),
        };
        let response = format!("\0{}\0{}", opts.user, opts.password);
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: client_properties(),
                mechanism: "PLAIN".into(),
                response: LongString::from(response.into_bytes()),
                locale: "en_US".into(),
            })),
        )
        .await;
        let tune = match self.next_method().await {
            Some((0, AMQPClass::Connection(connection::AMQPMethod::Tune(t)))) => t,
            Some((0, AMQPClass::Connection(connection::AMQPMethod::Close(c)))) => {
                return (start, connection::Tune::default(), Err(c))
            }
            other => panic!("expected connection.tune, got {other:?}"),
        };
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: opts.channel_max.unwrap_or(tune.channel_max),
                frame_max: opts.frame_max.unwrap_or(tune.frame_max),
                heartbeat: opts.heartbeat.unwrap_or(tune.heartbeat),
            })),
        )
        .await;
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: opts.vhost.as_str().into(),
            })),
        )
        .await;
        let res = match self.next_method().await {
            Some((0, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)))) => Ok(()),
            Some((0, AMQPClass::Connection(connection::AMQPMethod::Close(c)))) => Err(c),
            other => panic!("expected connection.open-ok, got {other:?}"),
        };
        (start, tune, res)
    }

    /// channel.open and wait for open-ok.
    pub async fn open_channel(&mut self, id: u16) {
        self.send_method(
            id,
            AMQPClass::Channel(chan::AMQPMethod::Open(chan::Open {})),
        )
        .await;
        match self.next_method().await {
            Some((c, AMQPClass::Channel(chan::AMQPMethod::OpenOk(_)))) if c == id => {}
            other => panic!("expected channel.open-ok on {id}, got {other:?}"),
        }
    }

    /// basic.publish + content header + body frames split at `chunk` bytes each.
    pub async fn publish(
        &mut self,
        ch: u16,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        chunk: usize,
    ) {
        let bytes = Self::publish_bytes(ch, exchange, routing_key, body, chunk);
        self.write_bytes(&bytes).await;
    }

    /// The frames of a publish, encoded.
    pub fn publish_bytes(
        ch: u16,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        chunk: usize,
    ) -> Vec<u8> {
        let mut bytes = encode(&AMQPFrame::Method(
            ch,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: exchange.into(),
                routing_key: routing_key.into(),
                mandatory: false,
                immediate: false,
            })),
        ));
        bytes.extend(encode(&AMQPFrame::Header(
            ch,
            AMQPContentHeader {
                class_id: 60,
                body_size: body.len() as u64,
                properties: BasicProperties::default(),
            },
        )));
        for part in body.chunks(chunk.max(1)) {
            bytes.extend(encode(&AMQPFrame::Body(ch, part.to_vec())));
        }
        bytes
    }
}

pub fn protocol_header_frame() -> AMQPFrame {
    AMQPFrame::ProtocolHeader(ProtocolVersion::amqp_0_9_1())
}

/// Reads a boolean out of a field table.
pub fn table_bool(t: &FieldTable, key: &str) -> Option<bool> {
    match t.inner().get(key) {
        Some(AMQPValue::Boolean(b)) => Some(*b),
        _ => None,
    }
}

pub fn short(s: &str) -> ShortString {
    s.into()
}

/// A `warren` process started from its binary; killed (SIGKILL) when dropped.
pub struct NodeProcess {
    /// The child process.
    pub child: std::process::Child,
    /// Its AMQP URI.
    pub uri: String,
}

impl NodeProcess {
    /// Starts `warren --config <dir>/w.toml` with data under `dir/data` on `port`, and waits
    /// until it listens.
    pub fn start(dir: &std::path::Path, port: u16) -> NodeProcess {
        let cfg = dir.join("w.toml");
        std::fs::write(
            &cfg,
            format!(
                "[node]\ndata_dir = \"{}\"\n[amqp]\nlisten = \"127.0.0.1:{port}\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[management]\nlisten = \"127.0.0.1:0\"\n[prometheus]\nlisten = \"127.0.0.1:0\"\n",
                dir.join("data").display()
            ),
        )
        .expect("write node config");
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_warren"))
            .arg("--config")
            .arg(&cfg)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn warren");
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "node did not listen"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        NodeProcess {
            child,
            uri: format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
        }
    }

    /// `kill -9`, and wait for the process to be gone.
    pub fn kill9(&mut self) {
        self.child.kill().expect("kill -9");
        let _ = self.child.wait();
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free loopback port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind port 0")
        .local_addr()
        .expect("local addr")
        .port()
}
