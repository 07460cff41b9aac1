//! The node's storage driver: opens the message store and the queue indexes, recovers the
//! messages of durable queues at start, and runs the syncer thread that writes what queues
//! recorded and fsyncs it in groups (one fsync per file per round, however many publishers).
//!
//! The syncer is a plain thread: every call it makes blocks on the disk, and no connection
//! task ever waits on it; they learn about durability through [`Durability`]. What a round
//! settles (which tickets become durable, which are refused, in which order pipelined
//! rounds complete) is decided by the sans-IO [`GroupCommit`]; the syncer writes, fsyncs
//! and carries out its effects.
//!
//! This file opens storage, recovers it at start, applies a queue's operations to its index
//! and the message store, and reads paged messages back ([`Pager`]). The rest:
//! - `syncer`: the rounds ([`Storage::write_round`], [`Storage::run_syncer`]);
//! - `copies`: mirror copies (the master's rounds applied, adoption at promotion, sync
//!   batches);
//! - `recovery`: a queue's index read back into queue entries.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

use super::file_disk::FileDisk;
use crate::broker::group_commit::GroupCommit;
use crate::broker::queue::{Entry, IndexOp, OnDisk, PageError, Pager};
use crate::broker::{Broker, Durability, Message};
use crate::config::StorageConfig;
use crate::store::msg_store::{MsgId, MsgStore, MsgStoreConfig, MsgStoreError};
use crate::store::queue_index::{IndexConfig, Publish, QueueIndex, QueueIndexError};
use crate::store::{Disk, DiskError};

mod copies;
mod recovery;
mod syncer;

pub use copies::{OpsTap, SYNC_BATCH_BYTES};
use recovery::{
    beta_entry, kept_copies, moved_in, queue_entry, read_copy_incarnation, recover_queue,
    remove_index_dir,
};
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
    /// Opens storage under `data_dir` and puts recovered messages back into the broker's
    /// durable queues (whose definitions were replayed before).
    pub fn open_with(
        disk: D,
        broker: &Broker,
        durability: Arc<Durability>,
        data_dir: &Path,
        config: &StorageConfig,
        now: crate::time::Instant,
    ) -> Result<(Arc<Self>, RecoverySummary), StorageError> {
        let store_dir = data_dir.join("msg_store_persistent");
        let transient_dir = data_dir.join("msg_store_transient");
        let queues_dir = data_dir.join("queues");
        let transient_queues_dir = data_dir.join("queues_transient");
        disk.create_dir_all(&queues_dir)?;
        // Transient messages do not outlive the node: their store and indexes start empty.
        remove_index_dir(&disk, &transient_dir);
        for name in disk.list_dirs(&transient_queues_dir).unwrap_or_default() {
            remove_index_dir(&disk, &transient_queues_dir.join(name));
        }
        disk.create_dir_all(&transient_queues_dir)?;
        let (transient_store, _) = MsgStore::open(
            disk.clone(),
            &transient_dir,
            MsgStoreConfig {
                file_size_limit: config.msg_store_file_size_limit_bytes,
                ..MsgStoreConfig::default()
            },
        )?;
        let (mut msg_store, report) = MsgStore::open(
            disk.clone(),
            &store_dir,
            MsgStoreConfig {
                file_size_limit: config.msg_store_file_size_limit_bytes,
                ..MsgStoreConfig::default()
            },
        )?;
        let mut summary = RecoverySummary {
            clean: report.clean,
            ..RecoverySummary::default()
        };
        if !report.damaged.is_empty() {
            tracing::error!(damaged = ?report.damaged, "message store files were damaged; intact messages recovered");
        }
        let icfg = index_config(config);
        let mut indexes = HashMap::new();
        let mut refs: BTreeMap<MsgId, u32> = BTreeMap::new();
        let mut known_dirs = std::collections::BTreeSet::new();
        for handle in broker.all_queues() {
            if !handle.lock().is_durable() {
                continue;
            }
            let dir_name = queue_dir_name(&handle.vhost, &handle.name);
            known_dirs.insert(dir_name.clone());
            let head = config.queue_paging_head_messages.max(1);
            let (index, store_refs) = recover_queue(
                &disk,
                &queues_dir.join(&dir_name),
                &handle,
                &icfg,
                head,
                &msg_store,
                broker.epoch_unix_ms(),
                // The node did not stop cleanly: deliveries may have gone unrecorded.
                !report.clean,
                &mut summary,
            )?;
            for (id, n) in store_refs {
                *refs.entry(MsgId(id)).or_default() += n;
            }
            indexes.insert((handle.vhost.clone(), handle.name.clone()), index);
        }
        // A mirrored queue promoted to this node while it caught up: the broker leaves it to
        // the mirror runtime to adopt this node's copy, and the copy on disk is the queue.
        // It is recovered here (its bodies counted before unreferenced ones go) if it is a
        // copy of the queue's present incarnation; any other folder of the name is stale.
        for (vhost, name, incarnation) in moved_in(broker) {
            let dir_name = queue_dir_name(&vhost, &name);
            let dir = queues_dir.join(&dir_name);
            if read_copy_incarnation(&disk, &dir) != Some(incarnation) {
                continue;
            }
            let icfg = IndexConfig {
                keep_transient: true,
                ..icfg.clone()
            };
            let head = config.queue_paging_head_messages.max(1);
            let mut recovered = None;
            let adopted = broker.adopt_queue(&vhost, &name, now, |handle| {
                recovered = Some(recover_queue(
                    &disk,
                    &dir,
                    handle,
                    &icfg,
                    head,
                    &msg_store,
                    broker.epoch_unix_ms(),
                    // As for any promoted copy: the old master's last deliveries may not
                    // have reached it.
                    true,
                    &mut summary,
                )?);
                Ok::<(), StorageError>(())
            });
            match adopted {
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e),
                None => continue,
            }
            let Some((index, store_refs)) = recovered else {
                continue;
            };
            tracing::info!(vhost = %vhost, queue = %name, "recovered a mirrored queue promoted to this node while it was starting");
            known_dirs.insert(dir_name);
            for (id, n) in store_refs {
                *refs.entry(MsgId(id)).or_default() += n;
            }
            indexes.insert((vhost, name), index);
        }
        // Copies of queues this node mirrors, left by the run before: kept (their bodies
        // counted) for the mirror's next sync to catch up only what it missed.
        let mut copies = HashMap::new();
        let mut kept = HashMap::new();
        for (vhost, name, incarnation) in kept_copies(broker) {
            let dir_name = queue_dir_name(&vhost, &name);
            let dir = queues_dir.join(&dir_name);
            if known_dirs.contains(&dir_name)
                || read_copy_incarnation(&disk, &dir) != Some(incarnation)
            {
                continue;
            }
            let kcfg = IndexConfig {
                keep_transient: true,
                recover_head_entries: 0,
                ..icfg.clone()
            };
            let (index, recovered) = match QueueIndex::open(disk.clone(), &dir, kcfg) {
                Ok(opened) => opened,
                Err(e) => {
                    // A copy that cannot be read is only a copy: the sync brings it all.
                    tracing::warn!(vhost = %vhost, queue = %name, error = %e, "a mirror copy left by the last run cannot be opened; dropped");
                    continue;
                }
            };
            for (id, n) in &recovered.store_refs {
                *refs.entry(MsgId(*id)).or_default() += n;
            }
            tracing::info!(vhost = %vhost, queue = %name, messages = recovered.live, "kept a mirror copy from the last run");
            known_dirs.insert(dir_name);
            let key = (vhost, name);
            indexes.insert(key.clone(), index);
            copies.insert(key.clone(), incarnation);
            kept.insert(key, incarnation);
        }
        // Bodies no queue refers to any more (acked before a crash cut the store's own
        // bookkeeping) go, as RabbitMQ's walker does.
        msg_store.set_ref_counts(refs)?;
        // Index folders of queues that no longer exist.
        for name in disk.list_dirs(&queues_dir).unwrap_or_default() {
            if !known_dirs.contains(&name) {
                remove_index_dir(&disk, &queues_dir.join(&name));
            }
        }
        let storage = Arc::new(Storage {
            disk,
            queues_dir,
            transient_queues_dir,
            index_config: icfg,
            state: Mutex::new(Some(State {
                msg_store,
                transient_store,
                indexes,
                transient_indexes: HashMap::new(),
                copies,
                started: HashMap::new(),
                kept,
            })),
            durability,
            wake: Arc::new((Mutex::new(false), Condvar::new())),
            fsync_interval_ms: config.fsync_interval_ms,
            epoch_unix_ms: broker.epoch_unix_ms(),
            tap: Mutex::new(None),
            head_entries: config.queue_paging_head_messages.max(1),
            commit: Mutex::new(GroupCommit::new(config.fsync_interval_ms > 0)),
            disk_writes: broker.metrics().disk_writes.clone(),
            disk_reads: broker.metrics().disk_reads.clone(),
        });
        let wake = storage.wake.clone();
        storage.durability.set_syncer_waker(Box::new(move || {
            let (m, cv) = &*wake;
            *m.lock().unwrap_or_else(|e| e.into_inner()) = true;
            cv.notify_one();
        }));
        Ok((storage, summary))
    }

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
                    let stored = message.to_stored();
                    let id = msg_id(message.id);
                    let size = stored.len() as u32;
                    let embedded = if self.index_config.embeds(stored.len()) {
                        Some(stored)
                    } else {
                        store.write(id, &stored)?;
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

impl<D: Disk + Clone + Send + Sync> Pager for Storage<D> {
    fn page_in(
        &self,
        vhost: &str,
        name: &str,
        from: u64,
        to: u64,
    ) -> Result<(Vec<Entry>, u64), PageError> {
        let guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let state = guard
            .as_ref()
            .ok_or_else(|| PageError("storage is closed".into()))?;
        let key = (vhost.to_string(), name.to_string());
        // Both indexes, each read a segment at a time, up to the nearer segment end.
        let indexes: Vec<(&QueueIndex<D>, OnDisk)> = [
            state.indexes.get(&key).map(|i| (i, OnDisk::Persistent)),
            state
                .transient_indexes
                .get(&key)
                .map(|i| (i, OnDisk::Transient)),
        ]
        .into_iter()
        .flatten()
        .collect();
        if indexes.is_empty() {
            return Err(PageError(format!("no queue index for {vhost}/{name}")));
        }
        let next = indexes
            .iter()
            .map(|(i, _)| {
                (from / i.config().segment_entry_count + 1) * i.config().segment_entry_count
            })
            .min()
            .unwrap_or(to);
        let mut found = Vec::new();
        for (index, on_disk) in indexes {
            let segment = from / index.config().segment_entry_count;
            found.extend(
                index
                    .read_segment(segment)
                    .map_err(|e| PageError(e.to_string()))?
                    .into_iter()
                    .filter(|e| e.publish.seq >= from && e.publish.seq < to.min(next))
                    .map(|e| (e, on_disk)),
            );
        }
        found.sort_by_key(|(e, _)| e.publish.seq);
        let mut entries = Vec::with_capacity(found.len());
        for (e, on_disk) in found {
            let p = &e.publish;
            let id = u128::from_be_bytes(p.msg_id);
            let Some(embedded) = &p.embedded else {
                // Body in a store: a beta, read when it leaves the queue (a segment of
                // large messages would not fit in RAM).
                entries.push(beta_entry(&e, self.epoch_unix_ms, on_disk));
                continue;
            };
            let Some(message) = decode_message(embedded, id) else {
                tracing::error!(queue = %format!("{vhost}/{name}"), seq = p.seq, "paged message unreadable; skipped");
                continue;
            };
            self.disk_reads.inc();
            entries.push(queue_entry(&e, message, 0, self.epoch_unix_ms, on_disk));
        }
        Ok((entries, next))
    }

    fn read_message(&self, id: u128, persistent: bool) -> Result<Option<Message>, PageError> {
        let guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let state = guard
            .as_ref()
            .ok_or_else(|| PageError("storage is closed".into()))?;
        let store = if persistent {
            &state.msg_store
        } else {
            &state.transient_store
        };
        let bytes = store
            .read(msg_id(id))
            .map_err(|e| PageError(e.to_string()))?;
        let message = bytes.and_then(|b| decode_message(&b, id));
        if message.is_some() {
            self.disk_reads.inc();
        }
        Ok(message)
    }
}

pub(crate) fn decode_message(bytes: &[u8], id: u128) -> Option<Message> {
    Message::from_stored(bytes, id)
}

#[cfg(test)]
mod model_tests;

#[cfg(test)]
mod tests;
