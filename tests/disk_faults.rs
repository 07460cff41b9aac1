//! A full disk under a real `warren` process: its data folder on a small tmpfs, filled by
//! the node's own confirmed publishes. The node must not confirm what it could not write,
//! must stop itself (exit status 74) rather than stay up unable to keep anything, and, once
//! there is room again and it is restarted (as a supervisor would), must hold every message
//! it confirmed.
//!
//! Needs root (mount). Skipped with a message without it, unless `WARREN_REQUIRE_FAULTS=1`
//! (set by `.ci/run`), where it fails.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};

use common::procs::warren_bin;

/// `warren`'s exit status when its storage failed (`runtime::EXIT_STORAGE_FAILED`), written
/// out here so the test checks the documented number, not whatever the code says.
const EXIT_STORAGE_FAILED: i32 = 74;

/// A tmpfs mounted at a folder while this lives.
struct Tmpfs {
    at: PathBuf,
}

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(at).expect("mount point");
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .status()
            .expect("run mount");
        assert!(ok.success(), "mount a tmpfs at {}", at.display());
        Tmpfs { at: at.into() }
    }

    fn resize(&self, size: &str) {
        let ok = Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.at)
            .status()
            .expect("run mount");
        assert!(ok.success(), "resize the tmpfs");
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazy: a node still holding a file must not leave the mount behind.
        let _ = Command::new("umount").arg("-l").arg(&self.at).status();
    }
}

/// The node process, killed when dropped (a failing test included).
struct Proc(Option<Child>);

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn can_mount() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    assert!(
        std::env::var("WARREN_REQUIRE_FAULTS").as_deref() != Ok("1"),
        "the disk fault test needs root, and WARREN_REQUIRE_FAULTS=1"
    );
    eprintln!("SKIPPED: the disk fault test needs root (mount)");
    false
}

fn start(config: &Path, log: &Path) -> Proc {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("log");
    let child = Command::new(warren_bin())
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .stdin(Stdio::null())
        .spawn()
        .expect("start warren");
    Proc(Some(child))
}

async fn connect(uri: &str) -> Connection {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match Connection::connect(uri, ConnectionProperties::default()).await {
            Ok(c) => return c,
            Err(e) if Instant::now() > deadline => panic!("connect to {uri}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_disk_fills_stops_itself_and_keeps_every_message_it_confirmed() {
    // 8 KiB messages, 20 in flight: 12 MB cannot hold the 2,000 offered.
    fill_and_restart(Fill {
        name: "small",
        body: 8 << 10,
        in_flight: 20,
        offered: 2000,
        tmpfs: "12m",
        at_least: 100,
        subnet: 251,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_filled_by_large_messages_written_without_the_page_cache_loses_none_confirmed() {
    // 320 KiB messages: each round's append is large enough to go direct (`O_DIRECT`, see
    // `runtime::file_disk`), so the disk fills inside a direct write.
    fill_and_restart(Fill {
        name: "large",
        body: 320 << 10,
        in_flight: 4,
        offered: 400,
        tmpfs: "40m",
        at_least: 20,
        subnet: 247,
    })
    .await;
}

/// One disk-full run: publish `offered` persistent messages of `body` bytes with confirms,
/// `in_flight` at a time, onto a data folder on a tmpfs of `tmpfs`, until the broker refuses
/// or goes away; expect at least `at_least` confirmed, the node's exit with the storage
/// status, and every confirmed message back after a restart with room.
struct Fill {
    name: &'static str,
    body: usize,
    in_flight: u64,
    offered: u64,
    tmpfs: &'static str,
    at_least: usize,
    /// The third octet of the node's loopback address (distinct per test).
    subnet: u32,
}

async fn fill_and_restart(f: Fill) {
    if !can_mount() {
        return;
    }
    let pid = std::process::id();
    let dir = std::env::temp_dir().join(format!("warren-disk-full-{}-{pid}", f.name));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("test dir");
    let data = dir.join("data");
    let tmpfs = Tmpfs::mount(&data, f.tmpfs);
    let ip = format!("127.{}.{}.1", 210 + pid % 40, f.subnet + pid % 4);
    let config = dir.join("node.toml");
    // No disk alarm (limit 0): the writes themselves must meet the full disk.
    std::fs::write(
        &config,
        format!(
            "[node]\nname = \"warren@diskfull\"\ndata_dir = \"{}\"\n\n[amqp]\nlisten = \"{ip}:5672\"\n\n\
             [admin]\nlisten = \"{ip}:5679\"\n\n[management]\nlisten = \"{ip}:15672\"\n\n\
             [prometheus]\nlisten = \"{ip}:15692\"\n\n[limits]\ndisk_free_limit_bytes = 0\n",
            data.display()
        ),
    )
    .expect("config");
    let log = dir.join("node.log");
    let mut node = start(&config, &log);
    let uri = format!("amqp://guest:guest@{ip}:5672/%2f");

    let conn = connect(&uri).await;
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    ch.queue_declare(
        "filled".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("declare");
    let mut confirmed = BTreeSet::new();
    let mut refused = 0u64;
    'publishing: for window in 0..f.offered / f.in_flight {
        let mut pending = Vec::new();
        for k in 0..f.in_flight {
            let n = window * f.in_flight + k;
            let mut body = n.to_be_bytes().to_vec();
            body.resize(f.body, b'x');
            let sent = tokio::time::timeout(
                Duration::from_secs(10),
                ch.basic_publish(
                    "".into(),
                    "filled".into(),
                    BasicPublishOptions::default(),
                    &body,
                    BasicProperties::default().with_delivery_mode(2),
                ),
            )
            .await;
            match sent {
                Ok(Ok(c)) => pending.push((n, c)),
                _ => break 'publishing,
            }
        }
        for (n, c) in pending {
            match tokio::time::timeout(Duration::from_secs(10), c).await {
                Ok(Ok(c)) if c.is_ack() => {
                    confirmed.insert(n);
                }
                Ok(Ok(_)) => refused += 1,
                _ => break 'publishing,
            }
        }
        if refused > 0 {
            break;
        }
    }
    assert!(
        confirmed.len() >= f.at_least,
        "only {} confirmed before the disk filled: the tmpfs is too small for the test",
        confirmed.len()
    );
    assert!(
        (confirmed.len() as u64) < f.offered,
        "every publish was confirmed: the disk never filled"
    );

    // The node stops itself with the documented status.
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        let child = node.0.as_mut().expect("node");
        if let Some(status) = child.try_wait().expect("try_wait") {
            node.0 = None;
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the node is still running 30 s after its disk filled ({} confirmed, {refused} \
             nacked); log:\n{}",
            confirmed.len(),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        status.code(),
        Some(EXIT_STORAGE_FAILED),
        "exit status; log:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );

    // Room again, restarted: every confirmed message is there.
    tmpfs.resize("64m");
    let _node = start(&config, &log);
    let conn = connect(&uri).await;
    let ch = conn.create_channel().await.expect("channel");
    let mut got = BTreeSet::new();
    while let Some(m) = tokio::time::timeout(
        Duration::from_secs(10),
        ch.basic_get("filled".into(), BasicGetOptions::default()),
    )
    .await
    .expect("basic.get in time")
    .expect("basic.get")
    {
        let n = u64::from_be_bytes(m.delivery.data[..8].try_into().expect("8 bytes"));
        got.insert(n);
        m.delivery
            .ack(BasicAckOptions::default())
            .await
            .expect("ack");
    }
    let lost: Vec<&u64> = confirmed.difference(&got).collect();
    assert!(
        lost.is_empty(),
        "{} of {} confirmed messages lost after the restart, the first {:?}",
        lost.len(),
        confirmed.len(),
        &lost[..lost.len().min(10)]
    );
    drop(tmpfs);
    let _ = std::fs::remove_dir_all(&dir);
}
