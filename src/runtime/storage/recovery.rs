//! Recovery: storage opened at the node's start ([`Storage::open_with`]: the message store,
//! every durable queue's index, kept mirror copies), a durable queue's index and the
//! store's reference counts read back (at start, or when a promoted mirror adopts its
//! copy), and the queue entries rebuilt from them.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};

use amq_protocol::protocol::basic::AMQPProperties;
use bytes::Bytes;

use super::{
    decode_message, index_config, queue_dir_name, RecoverySummary, State, Storage, StorageError,
};
use crate::broker::group_commit::GroupCommit;
use crate::broker::queue::{Delta, Entry, OnDisk};
use crate::broker::Durability;
use crate::broker::{Broker, Message, QueueHandle};
use crate::config::StorageConfig;
use crate::store::msg_store::{MsgId, MsgStore, MsgStoreConfig, MsgStoreError};
use crate::store::queue_index::{IndexConfig, IndexEntry, QueueIndex};
use crate::store::Disk;

/// The file in a mirror copy's index folder that names the queue incarnation it copies.
pub(super) const COPY_INCARNATION_FILE: &str = "copy.incarnation";

/// The file in a queue's index folder that says below which seq its messages may have
/// been delivered without a record of it (`Queue::mark_restored_suspect`): kept on disk,
/// so a clean restart after a crash or a promotion still flags them `redelivered`.
pub(super) const SUSPECT_FILE: &str = "suspect.below";

/// The seq below which the queue in `dir` holds suspect messages (`None`: none recorded).
fn read_suspect_below<D: Disk>(disk: &D, dir: &Path) -> Option<u64> {
    let bytes = disk.read(&dir.join(SUSPECT_FILE)).ok()?;
    std::str::from_utf8(&bytes).ok()?.trim().parse().ok()
}

/// The incarnation a mirror copy in `dir` is of (None: not a copy, or unreadable).
pub(super) fn read_copy_incarnation<D: Disk>(disk: &D, dir: &Path) -> Option<u64> {
    let bytes = disk.read(&dir.join(COPY_INCARNATION_FILE)).ok()?;
    std::str::from_utf8(&bytes).ok()?.trim().parse().ok()
}

/// Mirrored queues whose home is this node but which the broker does not run (yet):
/// promoted here while the node caught up, left to be adopted. (vhost, name, incarnation).
pub(super) fn moved_in(broker: &Broker) -> Vec<(String, String, u64)> {
    let state = broker.snapshot();
    let me = broker.node_id();
    let mut out = Vec::new();
    for ((vhost, name), set) in &state.mirror_sets {
        let homed_here = state
            .vhost(vhost)
            .and_then(|v| v.queues.get(name))
            .is_some_and(|d| d.home == me && d.durable && d.exclusive_owner.is_none());
        if homed_here && broker.queue(vhost, name).is_none() {
            out.push((vhost.clone(), name.clone(), set.incarnation));
        }
    }
    out
}

/// Mirrored queues of other nodes: a copy of the set's incarnation left on disk by the
/// last run is kept, whether or not the set lists this node now (a node down long enough
/// is dropped from an `ha-mode: all` set and added back once it runs again); one the
/// mirror host finds unused for a while is dropped then. (vhost, name, incarnation).
pub(super) fn kept_copies(broker: &Broker) -> Vec<(String, String, u64)> {
    let state = broker.snapshot();
    let me = broker.node_id();
    let mut out = Vec::new();
    for ((vhost, name), set) in &state.mirror_sets {
        let elsewhere = state
            .vhost(vhost)
            .and_then(|v| v.queues.get(name))
            .is_some_and(|d| d.home != me && d.exclusive_owner.is_none());
        if elsewhere {
            out.push((vhost.clone(), name.clone(), set.incarnation));
        }
    }
    out
}

pub(super) fn remove_index_dir<D: Disk>(disk: &D, dir: &Path) {
    if let Ok(names) = disk.list(dir) {
        for n in names {
            let _ = disk.remove(&dir.join(n));
        }
    }
    let _ = disk.remove_dir(dir);
}

/// References an index holds to message-store bodies: (message id, count).
type StoreRefs = Vec<([u8; 16], u32)>;

/// Opens one durable queue's index (as crash recovery does) and puts what it holds back
/// into the queue: the head in RAM, the rest left on disk as delta. Returns the index and
/// the message-store references it holds. Used at start, and when a mirror's copy becomes
/// the queue (promotion).
#[allow(clippy::too_many_arguments)]
pub(super) fn recover_queue<D: Disk + Clone>(
    disk: &D,
    dir: &Path,
    handle: &QueueHandle,
    icfg: &IndexConfig,
    head: usize,
    msg_store: &MsgStore<D>,
    epoch_unix_ms: u64,
    suspect: bool,
    summary: &mut RecoverySummary,
) -> Result<(QueueIndex<D>, StoreRefs), StorageError> {
    let label = format!("{}/{}", handle.vhost, handle.name);
    let max_priority = handle.lock().args().max_priority;
    let mut qcfg = icfg.clone();
    if max_priority.is_none() {
        // Only the head comes back into RAM; the rest stays on disk as delta and is
        // read back a segment at a time (priority queues do not page: all of it).
        qcfg.recover_head_entries = head;
    }
    let (index, recovered) =
        QueueIndex::open(disk.clone(), dir, qcfg).map_err(|source| StorageError::Index {
            queue: label.clone(),
            source,
        })?;
    disk.write_file(&dir.join("queue.name"), label.as_bytes())?;
    if !recovered.damage.is_empty() {
        tracing::error!(queue = %label, damage = ?recovered.damage, "queue index damaged; intact entries recovered");
    }
    summary.clean &= recovered.clean;
    let store_refs: StoreRefs = recovered
        .store_refs
        .iter()
        .map(|(id, n)| (*id, *n))
        .collect();
    let rest = recovered.live - recovered.entries.len() as u64;
    let mut entries = Vec::with_capacity(recovered.entries.len());
    for e in recovered.entries {
        let p = &e.publish;
        let id = MsgId(p.msg_id);
        if p.embedded.is_none() && max_priority.is_none() {
            // A paging queue takes a stored body back as a beta: read when it is
            // delivered, not at start (a head segment of large messages would not fit
            // in RAM). A body the store does not have is reported now.
            if !msg_store.contains(id) {
                summary.lost += 1;
                tracing::error!(queue = %label, seq = p.seq, "message body missing; skipped");
                continue;
            }
            entries.push(beta_entry(&e, epoch_unix_ms, OnDisk::Persistent));
            continue;
        }
        let bytes = match &p.embedded {
            Some(b) => Some(b.clone()),
            None => {
                // A bit-rotted body is reported and skipped, never fatal for the node.
                match msg_store.read(id) {
                    Ok(b) => b,
                    Err(MsgStoreError::Corrupt { path, offset }) => {
                        tracing::error!(path = %path.display(), offset, "corrupt message body");
                        None
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        };
        let Some(message) = bytes.and_then(|b| decode_message(&b, u128::from_be_bytes(p.msg_id)))
        else {
            summary.lost += 1;
            tracing::error!(queue = %label, seq = p.seq, "message body missing or unreadable; skipped");
            continue;
        };
        let priority = max_priority.map_or(0, |max| message.priority().min(max));
        entries.push(queue_entry(
            &e,
            message,
            priority,
            epoch_unix_ms,
            OnDisk::Persistent,
        ));
    }
    let holds = !entries.is_empty() || rest > 0;
    summary.messages += entries.len() + rest as usize;
    summary.queues += 1;
    let next_seq = index.bounds().1;
    let rest = (rest > 0).then_some(Delta {
        start: recovered.rest_from,
        end: next_seq,
        count: rest,
        bytes: recovered.rest_bytes,
        // Recovery keeps persistent messages only, but for a mirror's copy adopted here
        // (`keep_transient`): its transient tail counts as persistent until read back.
        persistent: rest,
        persistent_bytes: recovered.rest_bytes,
    });
    let kept = read_suspect_below(disk, dir);
    // A mirror's copy recovered as the node's own queue for the first time (promoted here
    // while the node was stopping or down) is suspect as any promoted copy is, clean stop
    // or not.
    let copy = kept.is_none() && disk.read(&dir.join(COPY_INCARNATION_FILE)).is_ok();
    // An empty queue has nothing suspect, and its index may number from 0 again.
    let below = if !holds {
        0
    } else if suspect || !recovered.clean || copy {
        next_seq
    } else {
        kept.unwrap_or(0).min(next_seq)
    };
    if kept != Some(below) && (below > 0 || kept.is_some() || copy) {
        let path = dir.join(SUSPECT_FILE);
        disk.write_file(&path, below.to_string().as_bytes())?;
        disk.sync(&path)?;
    }
    let mut queue = handle.lock();
    queue.restore(entries, rest, next_seq);
    queue.mark_suspect_below(below);
    drop(queue);
    Ok((index, store_refs))
}

/// A queue entry for a message read back from an index (recovery or paging); `on_disk`
/// says which (a record's own persistent flag does not: a mirrored queue's transient
/// messages are in its persistent index).
pub(super) fn queue_entry(
    e: &IndexEntry,
    message: Message,
    priority: u8,
    epoch_unix_ms: u64,
    on_disk: OnDisk,
) -> Entry {
    let p = &e.publish;
    Entry {
        seq: p.seq,
        message: Arc::new(message),
        redelivered: e.delivered,
        // Stored as wall-clock time; back to this run's monotonic clock (an expiry already
        // past becomes 0: the message expires at the first check).
        expires_at_ms: p
            .expires_at_ms
            .map_or(u64::MAX, |t| t.saturating_sub(epoch_unix_ms)),
        priority,
        on_disk,
        beta: None,
    }
}

/// A beta for a message whose body is in a store: a placeholder message with its id (the
/// queue reads the real one when it leaves), standing for its stored size.
pub(super) fn beta_entry(e: &IndexEntry, epoch_unix_ms: u64, on_disk: OnDisk) -> Entry {
    // Until its body is read back, the record's persistence is all the queue knows of the
    // message's properties (the listings count persistent messages).
    let mut properties = AMQPProperties::default();
    if e.publish.persistent {
        properties = properties.with_delivery_mode(2);
    }
    let placeholder = Message {
        id: u128::from_be_bytes(e.publish.msg_id),
        exchange: String::new(),
        routing_key: String::new(),
        properties_raw: Bytes::new(),
        properties,
        body: Bytes::new(),
    };
    let mut entry = queue_entry(e, placeholder, 0, epoch_unix_ms, on_disk);
    entry.beta = Some(u64::from(e.publish.size));
    entry
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
}
