//! Queue paging seen by a client: a backlog larger than the memory watermark is paged to
//! disk instead of blocking publishers, lazy queues keep their messages on disk, and what
//! was paged comes back in order, across a restart for persistent messages.
//!
//! The watermark is set to 2 MiB and every test publishes several times that: without
//! paging, the memory alarm would block the publishing connection and its confirms would
//! never arrive (the test would time out).

mod common;

use common::*;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::BasicProperties;
use warren::config::Config;

const MESSAGES: usize = 6000;
const SIZE: usize = 1024;

fn small_memory(c: &mut Config) {
    c.limits.memory_high_watermark_bytes = 2 << 20;
    c.storage.queue_paging_head_messages = 256;
    c.storage.queue_index_segment_entry_count = 1024;
}

fn body(i: usize, size: usize) -> Vec<u8> {
    let mut b = format!("{i:08}").into_bytes();
    b.resize(size, b'.');
    b
}

fn number(data: &[u8]) -> usize {
    std::str::from_utf8(&data[..8])
        .expect("utf8")
        .parse()
        .expect("number")
}

/// Publishes `MESSAGES` bodies in confirmed batches of 500; `persistent(i)` picks the
/// delivery mode of message `i`.
async fn publish_all(
    ch: &lapin::Channel,
    queue: &str,
    size: usize,
    persistent: impl Fn(usize) -> bool,
) {
    for batch in 0..MESSAGES / 500 {
        let mut confirms = Vec::new();
        for i in batch * 500..(batch + 1) * 500 {
            let props =
                BasicProperties::default().with_delivery_mode(if persistent(i) { 2 } else { 1 });
            let c = within(
                "basic.publish",
                ch.basic_publish(
                    "".into(),
                    queue.into(),
                    Default::default(),
                    &body(i, size),
                    props,
                ),
            )
            .await
            .expect("publish");
            confirms.push(c);
        }
        for c in confirms {
            let conf = within("publisher confirm (blocked by the memory alarm?)", c)
                .await
                .expect("confirm");
            assert!(conf.is_ack(), "nacked");
        }
    }
}

async fn declare_durable(ch: &lapin::Channel, q: &str, args: FieldTable) {
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    declare_queue_with(ch, q, durable, args).await;
}

/// Consumes everything with manual acks and checks the order.
async fn consume_all(ch: &lapin::Channel, queue: &str, size: usize) {
    within("basic.qos", ch.basic_qos(200, BasicQosOptions::default()))
        .await
        .expect("qos");
    let mut consumer = consume(ch, queue, BasicConsumeOptions::default()).await;
    for i in 0..MESSAGES {
        let d = consumer.next().await;
        assert_eq!(number(&d.data), i, "messages come back in order");
        assert_eq!(d.data.len(), size);
        assert!(!d.redelivered);
        d.ack(BasicAckOptions::default()).await.expect("ack");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_backlog_beyond_the_watermark_pages_instead_of_blocking() {
    let node = TestNode::start_with(small_memory).await;
    let (_c, ch) = node.confirm_channel().await;
    let q = unique("paged");
    declare_queue(&ch, &q).await;
    publish_all(&ch, &q, SIZE, |_| false).await;
    let (count, _) = queue_counts(&ch, &q).await;
    assert_eq!(count as usize, MESSAGES);
    consume_all(&ch, &q, SIZE).await;
    wait_count(&ch, &q, 0).await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_durable_queue_pages_and_comes_back_after_a_restart() {
    let node = TestNode::start_with(small_memory).await;
    let q = unique("lazy");
    {
        let (_c, ch) = node.confirm_channel().await;
        declare_durable(&ch, &q, table(&[("x-queue-mode", lstr("lazy"))])).await;
        publish_all(&ch, &q, SIZE, |_| true).await;
    }
    // warrenctl shows where the messages are: nearly all on disk.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_warrenctl"))
        .arg("--node")
        .arg(node.admin_addr().to_string())
        .args(["-u", "guest", "--password", "guest"])
        .args([
            "list_queues",
            "name",
            "messages",
            "messages_ram",
            "messages_paged_out",
        ])
        .output()
        .expect("run warrenctl");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let row: Vec<u64> = text
        .lines()
        .find(|l| l.starts_with(&format!("{q}\t")))
        .unwrap_or_else(|| panic!("queue listed: {text}"))
        .split('\t')
        .skip(1)
        .map(|c| c.parse().expect("number"))
        .collect();
    assert_eq!(row[0] as usize, MESSAGES);
    assert_eq!(row[1] + row[2], row[0], "in RAM + paged out = all: {text}");
    assert!(
        row[2] as usize > MESSAGES / 2,
        "most of a lazy queue is on disk: {text}"
    );
    let node = node.restart_with(small_memory).await;
    let (_c, ch) = node.channel().await;
    let (count, _) = queue_counts(&ch, &q).await;
    assert_eq!(count as usize, MESSAGES, "every confirmed message is back");
    consume_all(&ch, &q, SIZE).await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paged_messages_of_a_durable_queue_mix_persistent_and_transient() {
    // Transient messages in a durable queue page to the transient store; after a restart
    // only the persistent ones are back, still in order.
    let node = TestNode::start_with(small_memory).await;
    let q = unique("mixed");
    {
        let (_c, ch) = node.confirm_channel().await;
        declare_durable(&ch, &q, FieldTable::default()).await;
        publish_all(&ch, &q, SIZE, |i| i % 2 == 0).await;
        let (count, _) = queue_counts(&ch, &q).await;
        assert_eq!(count as usize, MESSAGES);
    }
    let node = node.restart_with(small_memory).await;
    let (_c, ch) = node.channel().await;
    let (count, _) = queue_counts(&ch, &q).await;
    assert_eq!(
        count as usize,
        MESSAGES / 2,
        "only persistent messages survive"
    );
    for i in (0..MESSAGES).step_by(2) {
        let m = get_some(&ch, &q, true).await;
        assert_eq!(number(&m.delivery.data), i);
    }
    assert!(get(&ch, &q, true).await.is_none());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_page_their_bodies_and_come_back_after_a_restart() {
    // 8 KiB bodies live in the message store, not in the index: under memory pressure they
    // become betas (bodies dropped, entries kept), then delta; each is read back when
    // delivered, across a restart too.
    const LARGE: usize = 8192;
    let node = TestNode::start_with(small_memory).await;
    let q = unique("large");
    {
        let (_c, ch) = node.confirm_channel().await;
        declare_durable(&ch, &q, FieldTable::default()).await;
        publish_all(&ch, &q, LARGE, |_| true).await;
        consume_all_but_restart_check(&ch, &q).await;
    }
    let node = node.restart_with(small_memory).await;
    let (_c, ch) = node.channel().await;
    let (count, _) = queue_counts(&ch, &q).await;
    assert_eq!(count as usize, MESSAGES);
    consume_all(&ch, &q, LARGE).await;
    node.shutdown().await;
}

/// Before the restart: the whole backlog is counted although most of it is not in RAM.
async fn consume_all_but_restart_check(ch: &lapin::Channel, q: &str) {
    let (count, _) = queue_counts(ch, q).await;
    assert_eq!(count as usize, MESSAGES);
}
