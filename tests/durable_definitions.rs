//! Durable exchanges, queues and bindings survive a restart, a clean one and `kill -9`;
//! transient and exclusive ones do not.

mod common;

use common::*;
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::ExchangeKind;

async fn declare_durable_set(ch: &lapin::Channel) {
    within(
        "exchange.declare",
        ch.exchange_declare(
            "dur.x".into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await
    .expect("declare durable exchange");
    for (name, durable) in [("dur.q", true), ("trans.q", false)] {
        within(
            "queue.declare",
            ch.queue_declare(
                name.into(),
                QueueDeclareOptions {
                    durable,
                    ..Default::default()
                },
                table(&[("x-max-length", lapin::types::AMQPValue::LongInt(100))]),
            ),
        )
        .await
        .expect("declare queue");
    }
    within(
        "queue.bind",
        ch.queue_bind(
            "dur.q".into(),
            "dur.x".into(),
            "a.#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("bind");
}

async fn check_durable_set(node: &TestNode) {
    let conn = node.connect().await;
    assert!(
        exchange_exists(&conn, "dur.x").await,
        "durable exchange is back"
    );
    assert!(queue_exists(&conn, "dur.q").await, "durable queue is back");
    assert!(
        !queue_exists(&conn, "trans.q").await,
        "transient queue is gone"
    );
    let ch = confirm_channel(&conn).await;
    // The binding came back too: a message routed through it arrives.
    publish_confirmed(&ch, "dur.x", "a.b.c", b"routed").await;
    let m = get_some(&ch, "dur.q", true).await;
    assert_eq!(m.delivery.data, b"routed");
    // And the queue kept its arguments (redeclaring with others is refused).
    let err = ch
        .queue_declare(
            "dur.q".into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            table(&[("x-max-length", lapin::types::AMQPValue::LongInt(7))]),
        )
        .await
        .expect_err("inequivalent x-max-length");
    assert_eq!(reply_code(&err), Some(406));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_definitions_survive_a_clean_restart() {
    let node = TestNode::start().await;
    {
        let (conn, ch) = node.channel().await;
        declare_durable_set(&ch).await;
        // An exclusive durable queue belongs to its connection and is not restored.
        within(
            "exclusive declare",
            ch.queue_declare(
                "excl.q".into(),
                QueueDeclareOptions {
                    durable: true,
                    exclusive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            ),
        )
        .await
        .expect("exclusive declare");
        common::close_connection(&conn).await;
    }
    let node = node.restart().await;
    check_durable_set(&node).await;
    let conn = node.connect().await;
    assert!(!queue_exists(&conn, "excl.q").await);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_durable_queue_stays_deleted_after_restart() {
    let node = TestNode::start().await;
    {
        let (_conn, ch) = node.channel().await;
        declare_durable_set(&ch).await;
        within(
            "queue.delete",
            ch.queue_delete("dur.q".into(), Default::default()),
        )
        .await
        .expect("delete");
    }
    let node = node.restart().await;
    let conn = node.connect().await;
    assert!(!queue_exists(&conn, "dur.q").await);
    assert!(exchange_exists(&conn, "dur.x").await);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_definitions_survive_kill_9() {
    let dir = std::env::temp_dir().join(unique("warren-kill9"));
    std::fs::create_dir_all(&dir).unwrap();
    let port = free_port();
    let mut node = NodeProcess::start(&dir, port);
    let uri = node.uri.clone();
    {
        let conn = within(
            "connect",
            lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()),
        )
        .await
        .expect("connect");
        let ch = open_channel(&conn).await;
        declare_durable_set(&ch).await;
        // declare-ok and bind-ok have been received: the definitions are on disk now.
        node.kill9();
    }
    let restarted = NodeProcess::start(&dir, port);
    let conn = within(
        "connect",
        lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()),
    )
    .await
    .expect("reconnect");
    assert!(exchange_exists(&conn, "dur.x").await);
    assert!(queue_exists(&conn, "dur.q").await);
    assert!(!queue_exists(&conn, "trans.q").await);
    let ch = confirm_channel(&conn).await;
    publish_confirmed(&ch, "dur.x", "a.z", b"after kill").await;
    assert_eq!(
        get_some(&ch, "dur.q", true).await.delivery.data,
        b"after kill"
    );
    drop(restarted);
    let _ = std::fs::remove_dir_all(&dir);
}
