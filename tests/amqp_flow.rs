//! Memory flow control: connection.blocked / connection.unblocked.
//!
//! lapin records connection.blocked/unblocked in `Connection::status().blocked()` (and stops
//! writing to the socket while blocked), so the tests poll that flag.
//!
//! As in RabbitMQ, only connections that publish while the alarm is on are blocked: the
//! publisher below keeps publishing (2 MB of 50 kB messages, then a small message every
//! 50 ms) until it sees connection.blocked, so the test does not depend on how often the
//! broker samples memory.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use lapin::options::{BasicPublishOptions, QueuePurgeOptions};
use lapin::{BasicProperties, Channel, Connection};
use tokio::task::JoinHandle;

const WATERMARK: u64 = 1_000_000;
const MSG: usize = 50_000;
const BULK: usize = 2_000_000;

/// A 1 MB watermark and no storage: with storage, queues page a backlog this size to disk
/// before it reaches the watermark (that is tested in `tests/amqp_paging.rs`); here the
/// backlog must stay in memory so the alarm can be seen.
fn memory_alarm_config(c: &mut warren::config::Config) {
    c.limits.memory_high_watermark_bytes = WATERMARK;
    c.storage.enabled = false;
}

struct Publisher {
    handle: JoinHandle<()>,
    stop: Arc<AtomicBool>,
    confirmed_bytes: Arc<AtomicUsize>,
}

/// Publishes with confirms (each message confirmed before the next) until blocked or told
/// to stop.
fn start_publisher(conn: &Connection, ch: &Channel, q: &str) -> Publisher {
    let stop = Arc::new(AtomicBool::new(false));
    let confirmed_bytes = Arc::new(AtomicUsize::new(0));
    let handle = {
        let ch = ch.clone();
        let status = conn.status().clone();
        let stop = stop.clone();
        let confirmed_bytes = confirmed_bytes.clone();
        let q = q.to_string();
        tokio::spawn(async move {
            let big = vec![b'x'; MSG];
            let mut sent = 0;
            while !status.blocked() && !stop.load(Ordering::SeqCst) {
                let body: &[u8] = if sent < BULK {
                    &big
                } else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    b"tick"
                };
                sent += body.len();
                let c = ch
                    .basic_publish(
                        "".into(),
                        q.as_str().into(),
                        BasicPublishOptions::default(),
                        body,
                        BasicProperties::default(),
                    )
                    .await
                    .expect("publish");
                let conf = c.await.expect("confirm");
                assert!(conf.is_ack(), "publish nacked");
                confirmed_bytes.fetch_add(body.len(), Ordering::SeqCst);
            }
        })
    };
    Publisher {
        handle,
        stop,
        confirmed_bytes,
    }
}

async fn wait_blocked(conn: &Connection, what: &str) {
    eventually(what, || {
        let b = conn.status().blocked();
        async move { b }
    })
    .await;
}

async fn wait_unblocked(conn: &Connection, what: &str) {
    eventually(what, || {
        let b = conn.status().blocked();
        async move { !b }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_is_blocked_above_memory_watermark_and_unblocked_after_purge() {
    let node = TestNode::start_with(memory_alarm_config).await;
    let q = unique("flow-q");
    let (admin_conn, admin) = node.channel().await;
    declare_queue(&admin, &q).await;

    let pub_conn = node.connect().await;
    let pub_ch = confirm_channel(&pub_conn).await;
    assert!(!pub_conn.status().blocked());
    let publisher = start_publisher(&pub_conn, &pub_ch, &q);

    wait_blocked(
        &pub_conn,
        "publishing connection receives connection.blocked",
    )
    .await;
    publisher.stop.store(true, Ordering::SeqCst);
    let at_block = publisher.confirmed_bytes.load(Ordering::SeqCst);
    assert!(
        at_block >= (WATERMARK as usize) * 3 / 4,
        "blocked after only {at_block} bytes were enqueued, watermark {WATERMARK}"
    );
    assert!(
        !admin_conn.status().blocked(),
        "a connection that never published must not be blocked"
    );

    // Free the memory from the other connection.
    let purged = within(
        "queue.purge",
        admin.queue_purge(q.as_str().into(), QueuePurgeOptions::default()),
    )
    .await
    .expect("purge");
    assert!(purged > 0, "purged {purged}");
    wait_unblocked(&pub_conn, "connection.unblocked after the queue is purged").await;
    within("publisher finishes", publisher.handle)
        .await
        .expect("publisher task");

    // Publishing works again end to end.
    publish_confirmed(&pub_ch, "", &q, b"after").await;
    assert!(!pub_conn.status().blocked());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consuming_the_backlog_unblocks_the_publisher() {
    let node = TestNode::start_with(memory_alarm_config).await;
    let q = unique("flow-consume-q");
    let (_admin_conn, admin) = node.channel().await;
    declare_queue(&admin, &q).await;
    // The consumer's connection exists before the alarm, as in a running system.
    let consumer_conn = node.connect().await;
    let cch = open_channel(&consumer_conn).await;

    let pub_conn = node.connect().await;
    let pub_ch = confirm_channel(&pub_conn).await;
    let publisher = start_publisher(&pub_conn, &pub_ch, &q);
    wait_blocked(&pub_conn, "blocked").await;
    publisher.stop.store(true, Ordering::SeqCst);

    // Drain with basic.get (no-ack) until the publisher is unblocked.
    let mut drained = 0;
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while pub_conn.status().blocked() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "still blocked after draining {drained} messages"
        );
        match get(&cch, &q, true).await {
            Some(_) => drained += 1,
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    assert!(
        drained > 0,
        "unblocked without any message leaving the queue"
    );
    assert!(
        !consumer_conn.status().blocked(),
        "the consumer never published"
    );
    within("publisher finishes", publisher.handle)
        .await
        .expect("publisher task");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_opened_during_alarm_can_still_consume() {
    let node = TestNode::start_with(memory_alarm_config).await;
    let q = unique("flow-late-q");
    let (_admin_conn, admin) = node.channel().await;
    declare_queue(&admin, &q).await;
    let pub_conn = node.connect().await;
    let pub_ch = confirm_channel(&pub_conn).await;
    let publisher = start_publisher(&pub_conn, &pub_ch, &q);
    wait_blocked(&pub_conn, "blocked").await;
    publisher.stop.store(true, Ordering::SeqCst);

    // RabbitMQ blocks a connection only when it publishes during the alarm; a new
    // connection that only consumes works normally (and is how the backlog gets drained).
    let late = node.connect().await;
    let ch = open_channel(&late).await;
    let m = get_some(&ch, &q, true).await;
    assert_eq!(m.delivery.data.len(), MSG);
    assert!(
        !late.status().blocked(),
        "a consuming connection must not be blocked"
    );
    within(
        "queue.purge",
        ch.queue_purge(q.as_str().into(), QueuePurgeOptions::default()),
    )
    .await
    .expect("purge");
    wait_unblocked(&pub_conn, "unblocked after purge").await;
    within("publisher finishes", publisher.handle)
        .await
        .expect("publisher task");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_disk_alarm_blocks_publishers_and_lets_consumers_drain() {
    // A limit no file system meets: the disk alarm is on from the start, as it would be on
    // a nearly full disk. Nothing is in memory, so only the disk alarm can block.
    let node = TestNode::start_with(|c| c.limits.disk_free_limit_bytes = u64::MAX).await;
    let q = unique("disk-alarm-q");
    let (consumer_conn, cch) = node.channel().await;
    declare_queue(&cch, &q).await;
    let pub_conn = node.connect().await;
    let pub_ch = confirm_channel(&pub_conn).await;
    let publisher = start_publisher(&pub_conn, &pub_ch, &q);
    wait_blocked(&pub_conn, "publisher blocked by the disk alarm").await;
    publisher.stop.store(true, Ordering::SeqCst);
    // What got in before the block can be consumed by a connection that never published.
    while get(&cch, &q, true).await.is_some() {}
    assert!(!consumer_conn.status().blocked());
    assert!(pub_conn.status().blocked(), "the disk alarm stays on");
    node.shutdown().await;
}
