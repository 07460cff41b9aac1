//! The storage's file I/O, counted by the real disk driver
//! ([`crate::runtime::file_disk::FileDisk`]) under the names of RabbitMQ's I/O statistics:
//! the node object's `io_*`, `msg_store_*` and `queue_index_*` fields and the Prometheus
//! families `rabbitmq_io_*`, `rabbitmq_msg_store_*` and `rabbitmq_queue_index_*`.
//!
//! Counted per file operation, as RabbitMQ's file handle cache counts its calls: a
//! group-committed batch of messages written with one `write` is one write. The message
//! store's and the queue index's counts are the reads and writes of their files (`.rdq`;
//! `journal.jif` and `.idx`), not of messages.

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use serde::{Deserialize, Serialize};

/// A counter of seconds.
pub type Seconds = Counter<f64, AtomicU64>;

/// The node's file I/O so far. Clones share their values.
#[derive(Clone, Debug, Default)]
pub struct IoCounters {
    /// Reads (`read`, a whole file read or mapped).
    pub read_ops: Counter,
    /// Bytes read.
    pub read_bytes: Counter,
    /// Time in reads.
    pub read_seconds: Seconds,
    /// Writes (appends and whole-file writes).
    pub write_ops: Counter,
    /// Bytes written.
    pub write_bytes: Counter,
    /// Time in writes.
    pub write_seconds: Seconds,
    /// `fsync`s of files and folders.
    pub sync_ops: Counter,
    /// Time in them.
    pub sync_seconds: Seconds,
    /// Seeks (before a positioned read, and to an append handle's end).
    pub seek_ops: Counter,
    /// Time in them.
    pub seek_seconds: Seconds,
    /// Files opened again to read from them (append handles stay open; a read opens the
    /// file each time).
    pub reopen_ops: Counter,
    /// Reads of the message store's files.
    pub msg_store_reads: Counter,
    /// Writes to the message store's files.
    pub msg_store_writes: Counter,
    /// Reads of queue index files.
    pub queue_index_reads: Counter,
    /// Writes to queue index files.
    pub queue_index_writes: Counter,
}

/// Whose file a path is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    /// A message store file (`.rdq`).
    MsgStore,
    /// A queue index file (`journal.jif`, a `.idx` segment).
    QueueIndex,
    /// Anything else (Raft's log, definitions, saved state).
    Other,
}

impl FileKind {
    /// The kind of the file named `name`.
    pub fn of(name: &str) -> FileKind {
        if name.ends_with(".rdq") {
            FileKind::MsgStore
        } else if name == "journal.jif" || name.ends_with(".idx") {
            FileKind::QueueIndex
        } else {
            FileKind::Other
        }
    }
}

impl IoCounters {
    /// One read of `bytes` from a file of `kind` that took `seconds`.
    pub fn read(&self, kind: FileKind, bytes: u64, seconds: f64) {
        self.read_ops.inc();
        self.read_bytes.inc_by(bytes);
        self.read_seconds.inc_by(seconds);
        match kind {
            FileKind::MsgStore => self.msg_store_reads.inc(),
            FileKind::QueueIndex => self.queue_index_reads.inc(),
            FileKind::Other => return,
        };
    }

    /// One write of `bytes` to a file of `kind` that took `seconds`.
    pub fn write(&self, kind: FileKind, bytes: u64, seconds: f64) {
        self.write_ops.inc();
        self.write_bytes.inc_by(bytes);
        self.write_seconds.inc_by(seconds);
        match kind {
            FileKind::MsgStore => self.msg_store_writes.inc(),
            FileKind::QueueIndex => self.queue_index_writes.inc(),
            FileKind::Other => return,
        };
    }

    /// The counts now, for a node object.
    pub fn snapshot(&self) -> IoSnapshot {
        let ms = |s: &Seconds, n: &Counter| {
            let n = n.get();
            if n == 0 {
                0.0
            } else {
                s.get() * 1000.0 / n as f64
            }
        };
        IoSnapshot {
            read_count: self.read_ops.get(),
            read_bytes: self.read_bytes.get(),
            read_avg_ms: ms(&self.read_seconds, &self.read_ops),
            write_count: self.write_ops.get(),
            write_bytes: self.write_bytes.get(),
            write_avg_ms: ms(&self.write_seconds, &self.write_ops),
            sync_count: self.sync_ops.get(),
            sync_avg_ms: ms(&self.sync_seconds, &self.sync_ops),
            seek_count: self.seek_ops.get(),
            seek_avg_ms: ms(&self.seek_seconds, &self.seek_ops),
            reopen_count: self.reopen_ops.get(),
            msg_store_read_count: self.msg_store_reads.get(),
            msg_store_write_count: self.msg_store_writes.get(),
            queue_index_read_count: self.queue_index_reads.get(),
            queue_index_write_count: self.queue_index_writes.get(),
        }
    }
}

/// A node's I/O counts at one moment, as its node object shows them (averages in
/// milliseconds, as RabbitMQ's `io_*_avg_time`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct IoSnapshot {
    pub read_count: u64,
    pub read_bytes: u64,
    pub read_avg_ms: f64,
    pub write_count: u64,
    pub write_bytes: u64,
    pub write_avg_ms: f64,
    pub sync_count: u64,
    pub sync_avg_ms: f64,
    pub seek_count: u64,
    pub seek_avg_ms: f64,
    pub reopen_count: u64,
    pub msg_store_read_count: u64,
    pub msg_store_write_count: u64,
    pub queue_index_read_count: u64,
    pub queue_index_write_count: u64,
}

/// The `rabbitmq_io_*`, `rabbitmq_msg_store_*` and `rabbitmq_queue_index_*` families,
/// under RabbitMQ's names.
pub(super) fn io_metrics(b: &mut super::Builder, io: &IoCounters) {
    let counters: [(&str, &str, &Counter); 11] = [
        ("rabbitmq_io_read_ops", "File reads", &io.read_ops),
        (
            "rabbitmq_io_read_bytes",
            "Bytes read from files",
            &io.read_bytes,
        ),
        ("rabbitmq_io_write_ops", "File writes", &io.write_ops),
        (
            "rabbitmq_io_write_bytes",
            "Bytes written to files",
            &io.write_bytes,
        ),
        ("rabbitmq_io_sync_ops", "File fsyncs", &io.sync_ops),
        ("rabbitmq_io_seek_ops", "File seeks", &io.seek_ops),
        (
            "rabbitmq_io_reopen_ops",
            "Files opened again to read them",
            &io.reopen_ops,
        ),
        (
            "rabbitmq_msg_store_read",
            "Reads of message store files",
            &io.msg_store_reads,
        ),
        (
            "rabbitmq_msg_store_write",
            "Writes to message store files",
            &io.msg_store_writes,
        ),
        (
            "rabbitmq_queue_index_read_ops",
            "Reads of queue index files",
            &io.queue_index_reads,
        ),
        (
            "rabbitmq_queue_index_write_ops",
            "Writes to queue index files",
            &io.queue_index_writes,
        ),
    ];
    for (name, help, c) in counters {
        b.counter(name, help, c);
    }
    let seconds: [(&str, &str, &Seconds); 4] = [
        (
            "rabbitmq_io_read_time_seconds",
            "Time in file reads",
            &io.read_seconds,
        ),
        (
            "rabbitmq_io_write_time_seconds",
            "Time in file writes",
            &io.write_seconds,
        ),
        (
            "rabbitmq_io_sync_time_seconds",
            "Time in file fsyncs",
            &io.sync_seconds,
        ),
        (
            "rabbitmq_io_seek_time_seconds",
            "Time in file seeks",
            &io.seek_seconds,
        ),
    ];
    for (name, help, c) in seconds {
        b.counter_f64(name, help, c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_told_apart_and_averages_are_in_milliseconds() {
        assert_eq!(FileKind::of("00000000000000000003.rdq"), FileKind::MsgStore);
        assert_eq!(FileKind::of("journal.jif"), FileKind::QueueIndex);
        assert_eq!(FileKind::of("7.idx"), FileKind::QueueIndex);
        assert_eq!(FileKind::of("definitions.dat"), FileKind::Other);
        let io = IoCounters::default();
        assert_eq!(io.snapshot(), IoSnapshot::default(), "no division by zero");
        io.write(FileKind::MsgStore, 100, 0.002);
        io.write(FileKind::QueueIndex, 50, 0.004);
        io.read(FileKind::Other, 10, 0.001);
        let s = io.snapshot();
        assert_eq!((s.write_count, s.write_bytes), (2, 150));
        assert!((s.write_avg_ms - 3.0).abs() < 1e-9, "{}", s.write_avg_ms);
        assert_eq!((s.read_count, s.read_bytes), (1, 10));
        assert_eq!(
            (
                s.msg_store_write_count,
                s.queue_index_write_count,
                s.msg_store_read_count,
                s.queue_index_read_count
            ),
            (1, 1, 0, 0)
        );
        // A clone counts into the same values (the driver holds one, the scrape another).
        io.clone().read(FileKind::MsgStore, 1, 0.0);
        assert_eq!(io.snapshot().msg_store_read_count, 1);
    }
}
