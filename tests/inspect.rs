//! `warren inspect-queue` / `inspect-message`: a queue's index entries and a body by id,
//! read from a node's files.

mod common;

use common::*;
use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::BasicProperties;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_lists_index_entries_and_reads_bodies_by_id() {
    let node = TestNode::start().await;
    let (_conn, ch) = node.confirm_channel().await;
    within(
        "declare",
        ch.queue_declare(
            "iq".into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await
    .expect("declare");
    let big = vec![b'B'; 9000];
    for body in [b"small one".to_vec(), big.clone()] {
        let c = within(
            "publish",
            ch.basic_publish(
                "".into(),
                "iq".into(),
                BasicPublishOptions::default(),
                &body,
                BasicProperties::default().with_delivery_mode(2),
            ),
        )
        .await
        .expect("publish");
        assert!(within("confirm", c).await.expect("confirm").is_ack());
    }
    // The confirms mean both are on disk. Deliver the first without acking it.
    let _m = get_some(&ch, "iq", false).await;
    // The deliver record reaches the disk with the syncer's next round.
    let data = node.data_dir().to_path_buf();
    eventually("deliver record written", || {
        let data = data.clone();
        async move {
            warren::runtime::inspect::queue_entries(&data, "/", "iq")
                .map(|e| e.len() == 2 && e[0].delivered)
                .unwrap_or(false)
        }
    })
    .await;
    let entries = warren::runtime::inspect::queue_entries(&data, "/", "iq").expect("entries");
    assert!(
        entries[0].publish.embedded.is_some(),
        "small message embedded in the index"
    );
    assert!(
        entries[1].publish.embedded.is_none(),
        "large message in the store"
    );
    let listing = warren::runtime::inspect::format_queue(&entries, None);
    assert!(listing.starts_with("seq\tmsg_id\tdelivered"));
    assert_eq!(listing.lines().count(), 3);

    // The CLI reads the large body by the id the listing shows.
    let id = listing
        .lines()
        .nth(2)
        .unwrap()
        .split('\t')
        .nth(1)
        .unwrap()
        .to_string();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_warren"))
        .args(["inspect-message", "--id", &id, "--data-dir"])
        .arg(&data)
        .output()
        .expect("run inspect-message");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("routing_key\tiq"), "{text}");
    assert!(text.contains("body_bytes\t9000"), "{text}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_warren"))
        .args(["inspect-queue", "--queue", "iq", "--data-dir"])
        .arg(&data)
        .output()
        .expect("run inspect-queue");
    assert_eq!(String::from_utf8_lossy(&out.stdout), listing);
    // --bodies adds both bodies in hex: the embedded one and the one in the store.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_warren"))
        .args(["inspect-queue", "--queue", "iq", "--bodies", "--data-dir"])
        .arg(&data)
        .output()
        .expect("run inspect-queue --bodies");
    let text = String::from_utf8_lossy(&out.stdout);
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let rows: Vec<&str> = text.lines().collect();
    assert!(rows[0].ends_with("\tbody_hex"), "{text}");
    assert!(
        rows[1].ends_with(&format!("\t{}", hex(b"small one"))),
        "{text}"
    );
    assert!(rows[2].ends_with(&format!("\t{}", hex(&big))), "{text}");
    // A bad id is refused with a clear message and a non-zero exit.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_warren"))
        .args(["inspect-message", "--id", "xyz", "--data-dir"])
        .arg(&data)
        .output()
        .expect("run inspect-message");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("32 hex digits"));
    node.shutdown().await;
}
