//! The resource monitor: the memory, disk, storage and remote alarms that block publishers,
//! and the `failed` signal for when the node can no longer keep what it confirms.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::broker::Broker;
use crate::config::Config;
use crate::runtime::raft::MetaRaft;

/// The memory high watermark in bytes: the configured bytes, else the configured fraction
/// of physical memory (4 GiB assumed when it cannot be read).
pub(super) fn memory_watermark(config: &Config) -> u64 {
    if config.limits.memory_high_watermark_bytes > 0 {
        config.limits.memory_high_watermark_bytes
    } else {
        let total = physical_memory_bytes().unwrap_or(4 << 30);
        (total as f64 * config.limits.memory_high_watermark_fraction) as u64
    }
}

/// Total physical memory from /proc/meminfo, if readable.
fn physical_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Spawns the monitor: flips `alarm` (which blocks publishers), and says on the returned
/// receiver why the node can no longer keep what it confirms (its storage or its Raft log
/// failed). Stops when `shutdown` flips.
pub(super) fn spawn(
    config: &Config,
    broker: Arc<Broker>,
    raft: Option<MetaRaft>,
    alarm: watch::Sender<bool>,
    mut shutdown: watch::Receiver<bool>,
) -> (JoinHandle<()>, watch::Receiver<Option<String>>) {
    let (failed_tx, failed_rx) = watch::channel(None::<String>);
    let disk_free_limit = config.limits.disk_free_limit_bytes;
    let data_dir = config.node.data_dir.clone();
    let task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        let mut disk_low = false;
        let mut ticks = 0u64;
        loop {
            tokio::select! {
                biased;
                _ = shutdown.changed() => break,
                _ = tick.tick() => {
                    // The disk alarm: free space is asked for every 500 ms.
                    if ticks.is_multiple_of(10) {
                        let free = crate::runtime::disk_free::available_bytes(&data_dir);
                        let low = free.is_some_and(|f| f < disk_free_limit);
                        let m = broker.metrics();
                        let bytes = free.map_or(-1, |f| i64::try_from(f).unwrap_or(i64::MAX));
                        m.disk_free_bytes.store(bytes, Ordering::Relaxed);
                        m.disk_alarm.store(i64::from(low), Ordering::Relaxed);
                        if low != disk_low {
                            if low {
                                tracing::warn!(free = ?free, limit = disk_free_limit, "disk alarm set: free space below disk_free_limit_bytes");
                            } else {
                                tracing::info!(free = ?free, "disk alarm cleared");
                            }
                            disk_low = low;
                        }
                    }
                    ticks += 1;
                    // A storage failure (full disk, failed fsync) blocks publishers too.
                    let memory = broker.memory_alarm();
                    let storage_failed = broker.durability().is_some_and(|d| d.has_failed());
                    // Another node's alarm blocks publishers here too, as in RabbitMQ.
                    let remote = broker.remote_alarm();
                    let on = memory || disk_low || storage_failed || remote;
                    if *alarm.borrow() != on {
                        if on {
                            tracing::warn!(memory, disk = disk_low, storage_failed, remote = ?broker.peer_alarms(), used = broker.memory_used(), "resource alarm set: blocking publishers");
                        } else {
                            tracing::info!(used = broker.memory_used(), "resource alarm cleared");
                        }
                        let _ = alarm.send(on);
                    }
                    if failed_tx.borrow().is_none() {
                        let why = if storage_failed {
                            Some("message storage failed".to_string())
                        } else {
                            raft.as_ref().and_then(|r| r.fatal()).map(|f| format!("the metadata Raft core stopped: {f}"))
                        };
                        if why.is_some() {
                            let _ = failed_tx.send(why);
                        }
                    }
                }
            }
        }
    });
    (task, failed_rx)
}
