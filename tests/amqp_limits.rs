//! Vhost and user limits over real TCP with lapin: each limit's reply code and RabbitMQ's
//! exact text (`rabbit_reader`, `rabbit_channel`), a freed place being usable again, and
//! limits surviving a restart.

mod common;

use common::*;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use warren::meta::limits::LimitScope;
use warren::meta::Command;
use warren::time::Instant;

fn set(node: &TestNode, scope: LimitScope, name: &str, value: i64) {
    node.broker()
        .apply(
            &Command::SetLimits {
                scope,
                limits: [(name.to_string(), value)].into(),
                replace: false,
            },
            Instant::from_millis(0),
        )
        .expect("limit applies");
}

fn vhost() -> LimitScope {
    LimitScope::Vhost("/".into())
}

fn guest() -> LimitScope {
    LimitScope::User("guest".into())
}

#[track_caller]
fn assert_refused<T: std::fmt::Debug>(res: lapin::Result<T>, code: u16, text: &str) {
    let err = assert_code(res, code, text);
    assert_eq!(reply_text(&err).as_deref(), Some(text));
}

/// Waits until the node lists no connection (a closed one's place is free).
async fn no_connections_left(node: &TestNode) {
    let broker = node.broker().clone();
    eventually("the node lists no connection", || {
        let n = broker.sessions().len();
        async move { n == 0 }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vhost_max_connections_refuses_the_next_connection_with_530() {
    let node = TestNode::start().await;
    set(&node, vhost(), "max-connections", 1);
    let first = node.connect().await;
    assert_refused(
        node.try_connect_uri(&node.uri()).await,
        530,
        "NOT_ALLOWED - access to vhost '/' refused for user 'guest': connection limit (1) is reached",
    );
    within("close", first.close(200, "bye".into()))
        .await
        .expect("closes");
    no_connections_left(&node).await;
    let again = node.connect().await;
    assert!(again.status().connected(), "the freed place is usable");
    // A negative value is no limit.
    set(&node, vhost(), "max-connections", -1);
    let more = node.connect().await;
    assert!(more.status().connected());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vhost_max_connections_zero_refuses_every_connection() {
    let node = TestNode::start_with(|c| add_vhost(c, "closed")).await;
    node.broker()
        .apply(
            &Command::SetPermissions(warren::meta::Permission {
                user: "guest".into(),
                vhost: "closed".into(),
                configure: ".*".into(),
                write: ".*".into(),
                read: ".*".into(),
            }),
            Instant::from_millis(0),
        )
        .expect("permissions");
    set(
        &node,
        LimitScope::Vhost("closed".into()),
        "max-connections",
        0,
    );
    assert_refused(
        node.try_connect_uri(&node.uri_for("guest", "guest", "closed"))
            .await,
        530,
        "NOT_ALLOWED - access to vhost 'closed' refused for user 'guest': connection limit (0) is reached",
    );
    // Other vhosts are not limited.
    let open = node.connect().await;
    assert!(open.status().connected());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_max_connections_refuses_the_next_connection_with_530() {
    let node = TestNode::start().await;
    set(&node, guest(), "max-connections", 2);
    let _a = node.connect().await;
    let _b = node.connect().await;
    assert_refused(
        node.try_connect_uri(&node.uri()).await,
        530,
        "NOT_ALLOWED - Connection refused for user 'guest': user connection limit (2) is reached",
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_max_channels_counts_every_connection_and_closes_the_connection_with_530() {
    let node = TestNode::start().await;
    set(&node, guest(), "max-channels", 2);
    let a = node.connect().await;
    let b = node.connect().await;
    let _a1 = open_channel(&a).await;
    let _b1 = open_channel(&b).await;
    assert_refused(
        within("channel.open", b.create_channel()).await,
        530,
        "NOT_ALLOWED - number of channels opened for user 'guest' has reached the maximum allowed user limit of (2)",
    );
    // A connection error: the connection that asked is gone, the other one is not.
    assert!(!b.status().connected());
    assert!(a.status().connected());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vhost_max_queues_refuses_a_new_queue_with_406_but_not_a_redeclare() {
    let node = TestNode::start().await;
    set(&node, vhost(), "max-queues", 2);
    let (conn, ch) = node.channel().await;
    declare_queue(&ch, "lq1").await;
    declare_queue(&ch, "lq2").await;
    // Redeclaring an existing queue is no new queue.
    declare_queue(&ch, "lq1").await;
    let res = within(
        "queue.declare",
        ch.queue_declare(
            "lq3".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        ),
    )
    .await;
    assert_refused(
        res,
        406,
        "PRECONDITION_FAILED - cannot declare queue 'lq3': queue limit in vhost '/' (2) is reached",
    );
    // A channel error: the connection carries on.
    let ch2 = open_channel(&conn).await;
    let res = within(
        "server-named queue.declare",
        ch2.queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        ),
    )
    .await;
    assert_code(res, 406, "a server-named queue is a new queue too");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_survive_a_restart() {
    let node = TestNode::start().await;
    set(&node, vhost(), "max-queues", 0);
    set(&node, guest(), "max-channels", 0);
    let node = node.restart().await;
    let meta = node.broker().snapshot();
    assert_eq!(meta.vhost_limit("/", "max-queues"), Some(0));
    assert_eq!(meta.user_limit("guest", "max-channels"), Some(0));
    let conn = node.connect().await;
    assert_code(
        within("channel.open", conn.create_channel()).await,
        530,
        "max-channels 0 after a restart",
    );
    node.shutdown().await;
}
