//! The node's storage driver: opens the message store and the queue indexes, recovers the
//! messages of durable queues at start, and runs the syncer thread that writes what queues
//! recorded and fsyncs it in groups (one fsync per file per round, however many publishers).
//!
//! The syncer is a plain thread: every call it makes blocks on the disk, and no connection
//! task ever waits on it; they learn about durability through [`Durability`]. What a round
//! settles (which tickets become durable, which are refused, in which order pipelined
//! rounds complete) is decided by the sans-IO [`crate::broker::group_commit::GroupCommit`];
//! the syncer writes, fsyncs and carries out its effects.
//!
//! This file holds the storage's state and applies a queue's operations to its index and
//! the message store. The rest:
//! - `recovery`: opening storage at start ([`Storage::open_with`]) and a queue's index read
//!   back into queue entries;
//! - `syncer`: the rounds ([`Storage::write_round`], [`Storage::run_syncer`]);
//! - `copies`: mirror copies (the master's rounds applied, adoption at promotion, sync
//!   batches);
//! - `pager`: paged-out messages read back ([`crate::broker::queue::Pager`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

use super::file_disk::FileDisk;
use crate::broker::group_commit::GroupCommit;
use crate::broker::queue::IndexOp;
use crate::broker::{Broker, Durability};
use crate::config::StorageConfig;
use crate::store::msg_store::{MsgId, MsgStore, MsgStoreError};
use crate::store::queue_index::{IndexConfig, Publish, QueueIndex, QueueIndexError};
use crate::store::{Disk, DiskError};

mod backlog;
mod copies;
mod pager;
mod recovery;
mod syncer;

pub use backlog::SyncCursor;
pub use copies::{OpsTap, SYNC_BATCH_BYTES};
pub(crate) use pager::decode_message;
use recovery::remove_index_dir;
pub use syncer::{LapWait, PendingLaps};

/// Why storage could not start.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The message store failed.
    #[error("message store: {0}")]
    MsgStore(#[from] MsgStoreError),
    /// A queue index failed.
    #[error("queue index {queue}: {source}")]
    Index {
        /// The queue.
        queue: String,
        /// The error.
        source: QueueIndexError,
    },
    /// A folder could not be created or listed.
    #[error("{0}")]
    Disk(#[from] DiskError),
    /// A mirror wrote to a copy that is not (or no longer) its own: the name now holds
    /// another incarnation's copy or a queue of this node.
    #[error("queue {queue}: this node holds no copy of incarnation {incarnation}")]
    NotOurCopy {
        /// The queue.
        queue: String,
        /// The incarnation the mirror writes for.
        incarnation: u64,
    },
}

/// What recovery found, for the log.
#[derive(Debug, Default, Clone)]
pub struct RecoverySummary {
    /// Durable queues recovered.
    pub queues: usize,
    /// Messages put back.
    pub messages: usize,
    /// Messages whose body was missing or unreadable (reported, skipped).
    pub lost: usize,
    /// Whether every file was closed cleanly last time.
    pub clean: bool,
}

struct State<D: Disk + Clone> {
    msg_store: MsgStore<D>,
    /// Bodies of paged-out transient messages (emptied at every start, never fsynced).
    transient_store: MsgStore<D>,
    indexes: HashMap<(String, String), QueueIndex<D>>,
    /// Indexes of paged-out transient messages (emptied at every start).
    transient_indexes: HashMap<(String, String), QueueIndex<D>>,
    /// Names whose index is a mirror's copy, and of which queue incarnation
    /// ([`MirrorSet::incarnation`](crate::meta::state::MirrorSet::incarnation)). Every
    /// other index is a queue of this node. A copy and a queue share a name's folder, so
    /// the two are kept apart here: a mirror writes only to its own incarnation's copy,
    /// and a queue of this node that finds a copy under its name (it was declared again
    /// while a mirror of the old one still ran here) drops that copy before its first
    /// write.
    copies: HashMap<(String, String), u64>,
    /// When each copy this run started was started, in the order of queue handles
    /// ([`next_generation`](crate::broker::queue::next_generation)); none for a copy
    /// found on disk, older than any handle. A handle older than its name's copy is a
    /// deposed master's, which must not write over it (`Storage::write_round`).
    started: HashMap<(String, String), u64>,
    /// Copies this run found on disk from an earlier one (a subset of `copies`), kept for
    /// the mirror's first active sync to compare with the master's queue instead of
    /// copying it whole (`docs/mirroring.md`, *Mirrors keep their data*).
    kept: HashMap<(String, String), u64>,
}

/// Storage for one node, over any [`Disk`] (the node uses `Arc<FileDisk>`; tests `MemDisk`).
pub struct Storage<D: Disk + Clone = Arc<FileDisk>> {
    disk: D,
    queues_dir: PathBuf,
    transient_queues_dir: PathBuf,
    index_config: IndexConfig,
    state: Mutex<Option<State<D>>>,
    durability: Arc<Durability>,
    wake: Arc<(Mutex<bool>, Condvar)>,
    fsync_interval_ms: u64,
    /// Wall-clock ms at the broker's Instant 0: expiry is stored as wall-clock time.
    epoch_unix_ms: u64,
    /// Sees every queue's operations as a round writes them (mirrored queues ship them to
    /// their mirrors: `docs/mirroring.md`).
    tap: Mutex<Option<OpsTap>>,
    /// Messages a recovered (or adopted) queue takes back into RAM.
    head_entries: usize,
    /// Group commit's bookkeeping: rounds out, their order, what each settles.
    commit: Mutex<GroupCommit>,
    /// Messages written to disk and read back from it (the overview's `disk_writes` and
    /// `disk_reads`): clones of the broker's counters.
    disk_writes: prometheus_client::metrics::counter::Counter,
    disk_reads: prometheus_client::metrics::counter::Counter,
}

/// A stable folder name for a queue's index: FNV-1a 64 of `vhost \0 name`, in hex. The full
/// name is written inside (`queue.name`) so the folder can be told apart and inspected.
pub fn queue_dir_name(vhost: &str, name: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in vhost.bytes().chain(std::iter::once(0)).chain(name.bytes()) {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn msg_id(id: u128) -> MsgId {
    MsgId(id.to_be_bytes())
}

fn index_config(c: &StorageConfig) -> IndexConfig {
    IndexConfig {
        segment_entry_count: c.queue_index_segment_entry_count,
        journal_max_entries: c.queue_index_journal_max_entries,
        embed_below: c.queue_index_embed_msgs_below,
        ..IndexConfig::default()
    }
}

impl Storage<Arc<FileDisk>> {
    /// Opens storage on the real file system (see [`Storage::open_with`]).
    pub fn open(
        broker: &Broker,
        durability: Arc<Durability>,
        data_dir: &Path,
        config: &StorageConfig,
        now: crate::time::Instant,
    ) -> Result<(Arc<Self>, RecoverySummary), StorageError> {
        let metrics = broker.metrics();
        let disk = FileDisk::measured(metrics.fsync_latency.clone(), metrics.io.clone());
        Self::open_with(Arc::new(disk), broker, durability, data_dir, config, now)
    }
}

impl<D: Disk + Clone> Storage<D> {
    /// Applies one queue's operations; returns whether its persistent index was written.
    /// A mirror's (`mirrored`) skips what does not fit its copy: a publish older than the
    /// copy's start (a mirror joins mid-stream) and a deliver or ack of a message it does
    /// not hold (published before it joined, not synced). A mirror gets only operations of
    /// the persistent index (a mirrored queue records its transient messages there too).
    ///
    /// A queue has up to two indexes: the persistent one (durable queues: persistent
    /// messages, recorded as they arrive) and a transient one (messages paged out under
    /// memory pressure that would not survive a restart anyway; emptied at every start).
    /// Two, because each index takes publishes in seq order, and a page-out records older
    /// messages than the persistent ones already written.
    fn apply(
        &self,
        state: &mut State<D>,
        key: &(String, String),
        ops: Vec<IndexOp>,
        mirrored: bool,
    ) -> Result<bool, StorageError> {
        let key = key.clone();
        let label = || format!("{}/{}", key.0, key.1);
        let mut touched = false;
        for op in ops {
            let transient = match &op {
                IndexOp::Publish { persistent, .. } | IndexOp::Ack { persistent, .. } => {
                    !persistent
                }
                IndexOp::Deliver { .. } => false,
                IndexOp::DeleteQueue => {
                    // The index goes as a whole, opened or not, and with it the queue's
                    // references to bodies in the message stores (a segment at a time).
                    let name = queue_dir_name(&key.0, &key.1);
                    let wrap = |source| StorageError::Index {
                        queue: label(),
                        source,
                    };
                    for (map, dir) in [
                        (&mut state.indexes, &self.queues_dir),
                        (&mut state.transient_indexes, &self.transient_queues_dir),
                    ] {
                        if let Some(index) = map.remove(&key) {
                            for n in index.segments() {
                                for e in index.read_segment(n).map_err(wrap)? {
                                    if e.publish.embedded.is_some() {
                                        continue;
                                    }
                                    let store = if e.publish.persistent {
                                        &mut state.msg_store
                                    } else {
                                        &mut state.transient_store
                                    };
                                    let id = MsgId(e.publish.msg_id);
                                    if store.contains(id) {
                                        store.remove(id)?;
                                    }
                                }
                            }
                            index.delete_all().map_err(wrap)?;
                        }
                        remove_index_dir(&self.disk, &dir.join(&name));
                    }
                    return Ok(false);
                }
            };
            if mirrored && transient {
                continue;
            }
            let opened = if transient {
                state.transient_indexes.contains_key(&key)
            } else {
                state.indexes.contains_key(&key)
            };
            if !opened {
                let index = self.open_index(&key, transient)?;
                let map = if transient {
                    &mut state.transient_indexes
                } else {
                    &mut state.indexes
                };
                map.insert(key.clone(), index);
            }
            let (index, store) = if transient {
                (
                    state.transient_indexes.get_mut(&key),
                    &mut state.transient_store,
                )
            } else {
                (state.indexes.get_mut(&key), &mut state.msg_store)
            };
            let Some(index) = index else {
                continue;
            };
            if mirrored {
                let fits = match &op {
                    IndexOp::Publish { seq, .. } => *seq >= index.bounds().1,
                    IndexOp::Deliver { seq } | IndexOp::Ack { seq, .. } => index.holds(*seq),
                    IndexOp::DeleteQueue => true,
                };
                if !fits {
                    continue;
                }
            }
            touched |= !transient;
            let wrap = |source| StorageError::Index {
                queue: label(),
                source,
            };
            match op {
                IndexOp::Publish {
                    seq,
                    message,
                    expires_at_ms,
                    persistent,
                } => {
                    let id = msg_id(message.id);
                    let stored_len = message.stored_len();
                    let size = stored_len as u32;
                    let embedded = if self.index_config.embeds(stored_len) {
                        Some(message.to_stored())
                    } else {
                        // The body goes to the store as the queue holds it, not copied
                        // into a stored form first.
                        let head = bytes::Bytes::from(message.stored_head());
                        store.write_pieces(id, head, message.body.clone())?;
                        None
                    };
                    index
                        .publish(Publish {
                            seq,
                            msg_id: id.0,
                            // A transient message in the persistent index (a mirrored
                            // queue's) is recorded as transient: a restart drops it.
                            persistent: persistent && message.persistent(),
                            expires_at_ms: (expires_at_ms != u64::MAX)
                                .then(|| expires_at_ms.saturating_add(self.epoch_unix_ms)),
                            size,
                            embedded,
                        })
                        .map_err(wrap)?;
                    self.disk_writes.inc();
                }
                IndexOp::Deliver { seq } => index.deliver(seq).map_err(wrap)?,
                IndexOp::Ack {
                    seq, message_id, ..
                } => {
                    index.ack(&[seq]).map_err(wrap)?;
                    let id = msg_id(message_id);
                    if store.contains(id) {
                        store.remove(id)?;
                    }
                }
                IndexOp::DeleteQueue => {}
            }
        }
        Ok(touched)
    }

    /// Clean shutdown: every index and the store write their clean markers.
    pub fn close(&self) {
        let Some(state) = self.state.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return;
        };
        for ((vhost, name), index) in state.indexes {
            if let Err(e) = index.close() {
                tracing::warn!(queue = %format!("{vhost}/{name}"), error = %e, "queue index did not close cleanly");
            }
        }
        if let Err(e) = state.msg_store.close() {
            tracing::warn!(error = %e, "message store did not close cleanly");
        }
    }

    /// Wakes the syncer (used at shutdown).
    pub fn wake(&self) {
        let (m, cv) = &*self.wake;
        *m.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_one();
    }
}

#[cfg(test)]
mod model_tests;

#[cfg(test)]
mod tests;
