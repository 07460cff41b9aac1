//! Persistent messages in durable queues survive a restart and `kill -9`: confirmed messages
//! come back in order, delivered-but-unacked ones with `redelivered`, acked and transient
//! ones do not.

mod common;

use std::time::{Duration, Instant};

use common::*;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::BasicProperties;

fn persistent() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2)
}

async fn declare_durable(ch: &lapin::Channel, name: &str) {
    within(
        "queue.declare",
        ch.queue_declare(
            name.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await
    .expect("declare durable queue");
}

async fn publish_props(ch: &lapin::Channel, queue: &str, body: &[u8], props: BasicProperties) {
    let confirm = within(
        "publish",
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            props,
        ),
    )
    .await
    .expect("publish");
    let c = within("confirm", confirm).await.expect("confirm");
    assert!(c.is_ack(), "publish was not acked: {c:?}");
}

fn body(i: usize) -> Vec<u8> {
    // Every fourth message is large enough to go to the message store, the rest are embedded
    // in the queue index.
    let mut b = format!("m{i}").into_bytes();
    if i % 4 == 3 {
        b.resize(10_000, b'x');
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistent_messages_survive_a_clean_restart_with_their_state() {
    let node = TestNode::start().await;
    {
        let (conn, ch) = node.confirm_channel().await;
        declare_durable(&ch, "pq").await;
        for i in 0..12 {
            publish_props(&ch, "pq", &body(i), persistent()).await;
            if i == 5 {
                publish_props(&ch, "pq", b"transient", BasicProperties::default()).await;
            }
        }
        // m0: delivered, never acked; m1: acked.
        let m0 = get_some(&ch, "pq", false).await;
        assert_eq!(m0.delivery.data, body(0));
        let m1 = get_some(&ch, "pq", false).await;
        within("ack", m1.delivery.acker.ack(Default::default()))
            .await
            .expect("ack m1");
        common::close_connection(&conn).await;
    }
    let node = node.restart().await;
    let (_conn, ch) = node.channel().await;
    let (ready, _) = queue_counts(&ch, "pq").await;
    assert_eq!(
        ready, 11,
        "m0 and m2..m11 are back; m1 was acked, the transient one is gone"
    );
    let first = get_some(&ch, "pq", true).await;
    assert_eq!(first.delivery.data, body(0));
    assert!(
        first.delivery.redelivered,
        "m0 was delivered before the restart"
    );
    for i in 2..12 {
        let m = get_some(&ch, "pq", true).await;
        assert_eq!(m.delivery.data, body(i), "message {i} in order");
        assert!(!m.delivery.redelivered);
        assert_eq!(m.delivery.properties.delivery_mode(), &Some(2));
    }
    assert!(get(&ch, "pq", true).await.is_none());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acked_and_purged_messages_stay_gone_after_restart() {
    let node = TestNode::start().await;
    {
        let (_conn, ch) = node.confirm_channel().await;
        declare_durable(&ch, "gone").await;
        for i in 0..6 {
            publish_props(&ch, "gone", &body(i), persistent()).await;
        }
        within("purge", ch.queue_purge("gone".into(), Default::default()))
            .await
            .expect("purge");
        publish_props(&ch, "gone", b"after purge", persistent()).await;
    }
    let node = node.restart().await;
    let (_conn, ch) = node.channel().await;
    assert_eq!(
        get_some(&ch, "gone", true).await.delivery.data,
        b"after purge"
    );
    assert!(get(&ch, "gone", true).await.is_none());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_confirmed_message_survives_kill_9_in_order() {
    let dir = std::env::temp_dir().join(unique("warren-crash"));
    std::fs::create_dir_all(&dir).unwrap();
    let port = free_port();
    let mut node = NodeProcess::start(&dir, port);
    let uri = node.uri.clone();
    let conn = within(
        "connect",
        lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()),
    )
    .await
    .expect("connect");
    let ch = open_channel(&conn).await;
    declare_durable(&ch, "crash").await;
    within(
        "confirm.select",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm mode");
    // Publish in windows of 50 unconfirmed messages; remember what was confirmed.
    let mut confirmed: Vec<usize> = Vec::new();
    let mut next = 0usize;
    let deadline = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < deadline {
        let mut pending = Vec::new();
        for _ in 0..50 {
            let p = ch
                .basic_publish(
                    "".into(),
                    "crash".into(),
                    BasicPublishOptions::default(),
                    &body(next),
                    persistent(),
                )
                .await
                .expect("publish");
            pending.push((next, p));
            next += 1;
        }
        for (i, p) in pending {
            if let Ok(Ok(c)) = tokio::time::timeout(Duration::from_secs(10), p).await {
                if c.is_ack() {
                    confirmed.push(i);
                }
            }
        }
    }
    // Keep publishing without waiting, then kill mid-stream.
    for _ in 0..200 {
        let _ = ch
            .basic_publish(
                "".into(),
                "crash".into(),
                BasicPublishOptions::default(),
                &body(next),
                persistent(),
            )
            .await;
        next += 1;
    }
    node.kill9();
    drop(conn);
    assert!(confirmed.len() > 100, "only {} confirmed", confirmed.len());

    let restarted = NodeProcess::start(&dir, port);
    let conn = within(
        "reconnect",
        lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()),
    )
    .await
    .expect("reconnect");
    let ch = open_channel(&conn).await;
    let mut seen = Vec::new();
    while let Some(m) = get(&ch, "crash", true).await {
        let text = String::from_utf8_lossy(&m.delivery.data);
        let n: usize = text
            .trim_end_matches('x')
            .trim_start_matches('m')
            .parse()
            .expect("a message body");
        seen.push(n);
    }
    let mut sorted = seen.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), seen.len(), "no message came back twice");
    assert_eq!(sorted, seen, "messages come back in publish order");
    for c in &confirmed {
        assert!(
            seen.binary_search(c).is_ok(),
            "confirmed message {c} was lost"
        );
    }
    drop(restarted);
    let _ = std::fs::remove_dir_all(&dir);
}
