//! The node's storage driver: opens the message store and the queue indexes, recovers the
//! messages of durable queues at start, and runs the syncer thread that writes what queues
//! recorded and fsyncs it in groups (one fsync per file per round, however many publishers).
//!
//! The syncer is a plain thread: every call it makes blocks on the disk, and no connection
//! task ever waits on it; they learn about durability through [`Durability`]. What a round
//! settles (which tickets become durable, which are refused, in which order pipelined
//! rounds complete) is decided by the sans-IO [`GroupCommit`]; this file writes, fsyncs
//! and carries out its effects.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use bytes::Bytes;

use super::file_disk::FileDisk;
use crate::broker::group_commit::{Effect, GroupCommit};
use crate::broker::queue::{Delta, Entry, IndexOp, OnDisk, PageError, Pager};
use crate::broker::{Broker, Durability, Message, QueueHandle};
use crate::config::StorageConfig;
use crate::store::msg_store::{MsgId, MsgStore, MsgStoreConfig, MsgStoreError};
use crate::store::queue_index::{IndexConfig, IndexEntry, Publish, QueueIndex, QueueIndexError};
use crate::store::{Disk, DiskError};

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
}

/// A tap on the operations a round writes, per queue: (vhost, queue) and the operations.
/// For a mirrored queue it ships them and returns the wait for their lap: the round's
/// confirms are held until it completes, and refused (nacked) if it fails.
pub type OpsTap = Arc<dyn Fn(&(String, String), &[IndexOp]) -> Option<LapWait> + Send + Sync>;

/// A sync batch, or one GM message of a shipped round, holds at most this many bytes of
/// messages (whatever `ha-sync-batch-size` says), or one message alone when that is
/// bigger. Each travels as one GM message; one under GM's batch budget (8 MiB) goes in
/// one frame and can share it, a bigger one goes in parts (`docs/gm.md`, *Frame size*).
pub const SYNC_BATCH_BYTES: usize = 4 << 20;

/// Resolves once a shipped batch completed its lap; `false` when it never will. A future,
/// not a blocking call: the syncer awaits it on the node's runtime, the simulation on its
/// own tasks.
pub type LapWait = std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send>>;

/// A round written and fsynced locally whose confirms wait for its mirrors' laps.
pub struct PendingLaps {
    round: u64,
    laps: Vec<LapWait>,
}

impl PendingLaps {
    /// Waits for every lap: the round's number, and whether all completed.
    pub async fn wait(self) -> (u64, bool) {
        let mut all = true;
        for lap in self.laps {
            all &= lap.await;
        }
        (self.round, all)
    }
}

/// How long a stopping syncer waits for the rounds out to complete.
const STOP_WAIT: Duration = Duration::from_secs(10);

/// Runs a future to completion on this thread (tests step rounds by hand; a lap future is
/// woken from whatever completes it).
#[cfg(test)]
fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let std::task::Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
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
        let disk = FileDisk::timing_fsyncs(broker.metrics().fsync_latency.clone());
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
                copies: HashMap::new(),
            })),
            durability,
            wake: Arc::new((Mutex::new(false), Condvar::new())),
            fsync_interval_ms: config.fsync_interval_ms,
            epoch_unix_ms: broker.epoch_unix_ms(),
            tap: Mutex::new(None),
            head_entries: config.queue_paging_head_messages.max(1),
            commit: Mutex::new(GroupCommit::new(config.fsync_interval_ms > 0)),
        });
        let wake = storage.wake.clone();
        storage.durability.set_syncer_waker(Box::new(move || {
            let (m, cv) = &*wake;
            *m.lock().unwrap_or_else(|e| e.into_inner()) = true;
            cv.notify_one();
        }));
        Ok((storage, summary))
    }

    /// Runs the syncer until `stop` is set; then completes the rounds out, writes what is
    /// left and closes cleanly.
    ///
    /// Pipelined: a round whose confirms wait for mirrors' laps is awaited by a task on
    /// `rt` (the laps are woken by the GM host's tasks there), and the next round is
    /// written meanwhile, up to [`crate::broker::group_commit::PIPELINE_DEPTH`] rounds out,
    /// so a mirrored queue's throughput is not one round per lap. [`GroupCommit`] keeps
    /// their confirms in order.
    pub fn run_syncer(self: Arc<Self>, stop: Arc<AtomicBool>, rt: tokio::runtime::Handle) {
        loop {
            let stopping = stop.load(Ordering::Acquire);
            self.wait_for_work(stopping);
            let idle = match self.write_round() {
                Ok(Some(laps)) => {
                    self.await_laps(laps, &rt);
                    false
                }
                Ok(None) => true,
                Err(e) => return self.fail_with(e),
            };
            // Tickets issued during that round: go again at once rather than after the idle
            // wait, so their confirms (or page-outs) are not held back; but not while only
            // rounds out hold them (their completion wakes the syncer).
            if self.durability.outstanding() && !(idle && self.rounds_in_flight() > 0) {
                self.wake();
            }
            if stopping {
                // What the rounds out left (tickets drained early), written in order.
                self.wait_rounds_out(STOP_WAIT);
                match self.write_round() {
                    Ok(Some(laps)) => {
                        self.await_laps(laps, &rt);
                        self.wait_rounds_out(STOP_WAIT);
                    }
                    Ok(None) => {}
                    Err(e) => return self.fail_with(e),
                }
                self.close();
                return;
            }
        }
    }

    /// Awaits `laps` on `rt`, then completes their round.
    fn await_laps(self: &Arc<Self>, laps: PendingLaps, rt: &tokio::runtime::Handle) {
        let me = self.clone();
        rt.spawn(async move {
            let (round, ok) = laps.wait().await;
            me.laps_done(round, ok);
        });
    }

    /// Blocks until the syncer is woken (or its interval passes), unless `stopping`; and
    /// while the pipeline is full, until a round completes.
    fn wait_for_work(&self, stopping: bool) {
        let (m, cv) = &*self.wake;
        let mut pending = m.lock().unwrap_or_else(|e| e.into_inner());
        if !*pending && !stopping {
            let wait = Duration::from_millis(if self.fsync_interval_ms > 0 {
                self.fsync_interval_ms
            } else {
                100
            });
            pending = cv
                .wait_timeout(pending, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *pending = false;
        while self.pipeline_full() && !stopping {
            pending = cv
                .wait_timeout(pending, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Blocks until no round is out, for at most `limit` (at shutdown: a lap that never
    /// ends leaves its round's confirms unsent, which promises nothing).
    fn wait_rounds_out(&self, limit: Duration) {
        let (m, cv) = &*self.wake;
        let deadline = std::time::Instant::now() + limit;
        let mut guard = m.lock().unwrap_or_else(|e| e.into_inner());
        while self.rounds_in_flight() > 0 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    rounds = self.rounds_in_flight(),
                    "storage stops with mirrored rounds out: their confirms are not sent"
                );
                return;
            }
            guard = cv
                .wait_timeout(guard, left.min(Duration::from_millis(100)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// One round, its laps waited for on this thread; on failure storage stops for good:
    /// waiting persistent confirms become nacks and the node's alarm blocks publishers.
    /// Returns whether storage still works. For tests, which step storage by hand.
    #[cfg(test)]
    pub fn step(&self) -> bool {
        match self.round() {
            Ok(()) => true,
            Err(e) => {
                self.fail_with(e);
                false
            }
        }
    }

    /// One group commit: drain every dirty queue, write, fsync, wait for mirrored queues'
    /// laps on this thread, mark durable. For tests.
    #[cfg(test)]
    pub fn round(&self) -> Result<(), StorageError> {
        if let Some(laps) = self.write_round()? {
            let (round, ok) = block_on(laps.wait());
            self.laps_done(round, ok);
        }
        Ok(())
    }

    /// Whether work is waiting for a round (the syncer goes again at once if so).
    pub fn has_work(&self) -> bool {
        self.durability.outstanding()
    }

    /// Rounds written and not completed yet.
    pub fn rounds_in_flight(&self) -> usize {
        self.commit().in_flight()
    }

    /// Whether a driver must wait for a round to complete before it writes the next.
    pub fn pipeline_full(&self) -> bool {
        self.commit().pipeline_full()
    }

    /// Fails storage for good: persistent publishes are refused from now on.
    pub fn fail_with(&self, e: StorageError) {
        tracing::error!(error = %e, "storage failed: persistent publishes are refused from now on");
        self.durability.fail();
    }

    fn commit(&self) -> std::sync::MutexGuard<'_, GroupCommit> {
        self.commit.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies what the group-commit core decided, in order (under its lock, so effects
    /// from the syncer and from lap completions never interleave out of order).
    fn settle(&self, commit: &mut GroupCommit) {
        while let Some(effect) = commit.poll_effect() {
            match effect {
                Effect::Void { after, upto } => {
                    tracing::warn!(
                        "a mirrored queue's batch did not complete its lap (its master was deposed): the round's confirms are nacks"
                    );
                    self.durability.void(after, upto);
                }
                Effect::Durable(ticket) => self.durability.mark_durable(ticket),
            }
        }
    }

    /// Round `round`'s laps are over (`ok`: all completed): completes it and any rounds
    /// after it that waited only for it, and wakes the syncer for what they left.
    pub fn laps_done(&self, round: u64, ok: bool) {
        {
            let mut commit = self.commit();
            commit.handle_laps(round, ok);
            self.settle(&mut commit);
        }
        self.wake();
    }

    /// A round, the only way storage writes what queues recorded: drains every dirty
    /// queue, writes, fsyncs, and settles the tickets it can. A round whose confirms wait
    /// for mirrors' laps returns them: the driver awaits them ([`PendingLaps::wait`]) and
    /// reports with [`Storage::laps_done`]. The syncer thread drives it; so does the
    /// simulation, on its own tasks.
    pub fn write_round(&self) -> Result<Option<PendingLaps>, StorageError> {
        let (ticket, dirty) = self.durability.take_dirty();
        if dirty.is_empty() {
            let mut commit = self.commit();
            commit.handle_idle(ticket);
            self.settle(&mut commit);
            return Ok(None);
        }
        // Queue locks are taken before, never while, the storage lock is held: a queue
        // reading paged messages holds its lock and then takes the storage lock. The syncer
        // is the only taker of operations, so rounds still apply them in order.
        let mut drained = ticket;
        let batches: Vec<(Arc<QueueHandle>, Vec<IndexOp>)> = dirty
            .into_iter()
            .map(|h| {
                let (ops, t) = h.lock().take_pending_ops();
                drained = drained.max(t);
                (h, ops)
            })
            .filter(|(_, ops)| !ops.is_empty())
            .collect();
        let round = self.commit().handle_start(ticket);
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(state) = guard.as_mut() else {
            return Ok(None);
        };
        let mut touched = Vec::new();
        let tap = self.tap.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut laps = Vec::new();
        for (handle, ops) in batches {
            let key = (handle.vhost.clone(), handle.name.clone());
            // Shipped before the local write, so the mirrors' writes overlap this one;
            // under the storage lock, so the mirrors see rounds in the order written here.
            if let Some(wait) = tap.as_ref().and_then(|tap| tap(&key, &ops)) {
                laps.push(wait);
            }
            if state.copies.contains_key(&key) {
                // A stale mirror copy under this queue's name (see `State::copies`).
                tracing::info!(queue = %key.1, "a new queue replaces a mirror copy of its name");
                self.remove_copy(state, &key)?;
            }
            if self.apply(state, &key, ops, false)? {
                touched.push(key);
            }
        }
        state.msg_store.flush()?;
        state.transient_store.flush()?;
        {
            let mut commit = self.commit();
            commit.handle_flushed(&round, !laps.is_empty());
            self.settle(&mut commit);
        }
        state.msg_store.sync()?;
        for key in &touched {
            if let Some(index) = state.indexes.get_mut(key) {
                index.sync().map_err(|source| StorageError::Index {
                    queue: format!("{}/{}", key.0, key.1),
                    source,
                })?;
            }
        }
        if laps.is_empty() && state.msg_store.compaction_due() {
            let report = state.msg_store.compact()?;
            tracing::debug!(?report, "message store compacted");
        }
        // The laps are waited for without the storage lock: a mirror on this node (of
        // another queue) writes under it, and two masters waiting on each other's mirrors
        // would otherwise deadlock.
        drop(guard);
        let id = round.id;
        let mut commit = self.commit();
        commit.handle_written(round, drained, !laps.is_empty());
        self.settle(&mut commit);
        Ok((!laps.is_empty()).then_some(PendingLaps { round: id, laps }))
    }

    /// Installs (or removes) the tap on the operations each round writes.
    pub fn set_ops_tap(&self, tap: Option<OpsTap>) {
        *self.tap.lock().unwrap_or_else(|e| e.into_inner()) = tap;
    }

    /// A mirror's write: applies operations another node's queue recorded (in its order)
    /// to this node's copy of that queue's index and message store, and fsyncs them, so
    /// that opening the copy (as crash recovery does) gives the master's queue.
    ///
    /// Only to the copy of `incarnation` that [`Storage::start_copy`] began: anything else
    /// under the name is refused ([`StorageError::NotOurCopy`]).
    pub fn apply_mirrored(
        &self,
        vhost: &str,
        queue: &str,
        incarnation: u64,
        ops: Vec<IndexOp>,
    ) -> Result<(), StorageError> {
        let key = (vhost.to_string(), queue.to_string());
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(state) = guard.as_mut() else {
            return Ok(());
        };
        if state.copies.get(&key) != Some(&incarnation) {
            return Err(StorageError::NotOurCopy {
                queue: format!("{vhost}/{queue}"),
                incarnation,
            });
        }
        let touched = self.apply(state, &key, ops, true)?;
        state.msg_store.flush()?;
        state.transient_store.flush()?;
        state.msg_store.sync()?;
        if touched {
            if let Some(index) = state.indexes.get_mut(&key) {
                index.sync().map_err(|source| StorageError::Index {
                    queue: format!("{vhost}/{queue}"),
                    source,
                })?;
            }
        }
        Ok(())
    }

    /// Opens (creating) a queue's persistent or transient index.
    fn open_index(
        &self,
        key: &(String, String),
        transient: bool,
    ) -> Result<QueueIndex<D>, StorageError> {
        let label = format!("{}/{}", key.0, key.1);
        let base = if transient {
            &self.transient_queues_dir
        } else {
            &self.queues_dir
        };
        let dir = base.join(queue_dir_name(&key.0, &key.1));
        if transient {
            // Whatever an earlier run left there is void.
            remove_index_dir(&self.disk, &dir);
        }
        let (index, _) = QueueIndex::open(self.disk.clone(), &dir, self.index_config.clone())
            .map_err(|source| StorageError::Index {
                queue: label.clone(),
                source,
            })?;
        self.disk
            .write_file(&dir.join("queue.name"), label.as_bytes())?;
        Ok(index)
    }

    /// Starts an empty copy of incarnation `incarnation` of a queue this node mirrors:
    /// whatever the node held under that name goes first (an earlier copy, one left by an
    /// earlier run, or the local queue of a deposed master, which no longer serves).
    pub fn start_copy(
        &self,
        vhost: &str,
        queue: &str,
        incarnation: u64,
    ) -> Result<(), StorageError> {
        let key = (vhost.to_string(), queue.to_string());
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(state) = guard.as_mut() else {
            return Ok(());
        };
        self.remove_copy(state, &key)?;
        // Which incarnation the folder's copy is of, durable before the copy's first write:
        // a node that restarts with the copy and finds itself its queue's master by then
        // recovers it only if it is a copy of the same queue (`open_with`).
        let dir = self.queues_dir.join(queue_dir_name(vhost, queue));
        self.disk.create_dir_all(&dir)?;
        let marker = dir.join(COPY_INCARNATION_FILE);
        self.disk
            .write_file(&marker, incarnation.to_string().as_bytes())?;
        self.disk.sync(&marker)?;
        self.disk.sync_dir(&dir)?;
        state.copies.insert(key, incarnation);
        Ok(())
    }

    /// Drops this node's copy of incarnation `incarnation` of a queue it mirrored (index
    /// and bodies); anything else under the name (a newer incarnation's copy, or a queue
    /// of this node) stays.
    pub fn drop_copy(
        &self,
        vhost: &str,
        queue: &str,
        incarnation: u64,
    ) -> Result<(), StorageError> {
        let key = (vhost.to_string(), queue.to_string());
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(state) = guard.as_mut() else {
            return Ok(());
        };
        if state.copies.get(&key) == Some(&incarnation) {
            self.remove_copy(state, &key)?;
        }
        Ok(())
    }

    /// Removes whatever index the name has, its folder (a copy never opened in this run,
    /// left by an earlier one, goes too) and its record as a copy.
    fn remove_copy(
        &self,
        state: &mut State<D>,
        key: &(String, String),
    ) -> Result<(), StorageError> {
        state.copies.remove(key);
        self.apply(state, key, vec![IndexOp::DeleteQueue], true)?;
        remove_index_dir(
            &self.disk,
            &self.queues_dir.join(queue_dir_name(&key.0, &key.1)),
        );
        state.msg_store.flush()?;
        state.msg_store.sync()?;
        Ok(())
    }

    /// Promotion: this node's mirror copy becomes the queue `handle` (just created, not yet
    /// serving). The copy's index is closed and opened again exactly as crash recovery
    /// opens it, so deliveries never acked come back `redelivered`.
    ///
    /// Never a copy of another incarnation than `incarnation` (the promoted queue's); a
    /// copy this run has no record of (left by an earlier run) is taken as it is.
    pub fn adopt(
        &self,
        handle: &QueueHandle,
        incarnation: u64,
    ) -> Result<RecoverySummary, StorageError> {
        let key = (handle.vhost.clone(), handle.name.clone());
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(state) = guard.as_mut() else {
            return Ok(RecoverySummary::default());
        };
        if state.copies.remove(&key).is_some_and(|c| c != incarnation) {
            return Err(StorageError::NotOurCopy {
                queue: format!("{}/{}", key.0, key.1),
                incarnation,
            });
        }
        if let Some(index) = state.indexes.remove(&key) {
            index.close().map_err(|source| StorageError::Index {
                queue: format!("{}/{}", key.0, key.1),
                source,
            })?;
        }
        let mut summary = RecoverySummary {
            clean: true,
            ..RecoverySummary::default()
        };
        let dir = self.queues_dir.join(queue_dir_name(&key.0, &key.1));
        // The queue lives on: so do its transient messages (a mirrored queue records them).
        let config = IndexConfig {
            keep_transient: true,
            ..self.index_config.clone()
        };
        let (index, _) = recover_queue(
            &self.disk,
            &dir,
            handle,
            &config,
            self.head_entries,
            &state.msg_store,
            self.epoch_unix_ms,
            // A mirror's copy becoming the queue: the old master's last deliveries may
            // not have reached it.
            true,
            &mut summary,
        )?;
        state.indexes.insert(key, index);
        Ok(summary)
    }

    /// Runs `f` with the next seq of the queue's persistent index (0 when it has none),
    /// under the storage lock: what `f` broadcasts is ordered after every round already
    /// shipped and before every later one (a mirror's sync starts there).
    pub fn at_next_seq<T>(&self, vhost: &str, queue: &str, f: impl FnOnce(u64) -> T) -> T {
        let key = (vhost.to_string(), queue.to_string());
        let guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let next = guard
            .as_ref()
            .and_then(|s| s.indexes.get(&key))
            .map_or(0, |i| i.bounds().1);
        f(next)
    }

    /// Live messages of the queue's transient page index (paged-out messages that are not
    /// in its persistent index).
    pub fn transient_len(&self, vhost: &str, queue: &str) -> u64 {
        let key = (vhost.to_string(), queue.to_string());
        let guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        guard
            .as_ref()
            .and_then(|s| s.transient_indexes.get(&key))
            .map_or(0, |i| i.len())
    }

    /// The lowest live seq of the queue's persistent index (`None`: empty or none).
    pub fn low_seq(&self, vhost: &str, queue: &str) -> Option<u64> {
        let key = (vhost.to_string(), queue.to_string());
        let guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let index = guard.as_ref()?.indexes.get(&key)?;
        (!index.is_empty()).then(|| index.bounds().0)
    }

    /// A sync batch: up to `max` live messages of the queue's persistent index (persistent
    /// ones, and the transient ones a mirrored queue records) with seq in
    /// `[from, below)`, in seq order, as operations (a publish, and a deliver for a message
    /// delivered and not acked). `f` gets them and the seq to continue from (`None`: the
    /// backlog is done) under the storage lock, so what it broadcasts is ordered with the
    /// rounds: an ack shipped before is reflected here, one shipped after comes after.
    pub fn sync_batch<T>(
        &self,
        vhost: &str,
        queue: &str,
        from: u64,
        below: u64,
        max: usize,
        f: impl FnOnce(Vec<IndexOp>, Option<u64>) -> T,
    ) -> Result<T, StorageError> {
        let key = (vhost.to_string(), queue.to_string());
        let guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(index) = guard.as_ref().and_then(|s| s.indexes.get(&key)) else {
            return Ok(f(Vec::new(), None));
        };
        let state = guard.as_ref().expect("checked above");
        let wrap = |source| StorageError::Index {
            queue: format!("{vhost}/{queue}"),
            source,
        };
        let mut ops = Vec::new();
        let mut taken = 0;
        let mut bytes = 0usize;
        let mut next = None;
        let per_segment = index.config().segment_entry_count.max(1);
        // Segments wholly before `from` are skipped unread: a backlog of a million
        // messages is read once, not once per batch (and under the storage lock).
        let segments = index
            .segments()
            .into_iter()
            .filter(|n| (n + 1) * per_segment > from);
        'segments: for n in segments {
            for e in index.read_segment(n).map_err(wrap)? {
                let p = &e.publish;
                if p.seq < from {
                    continue;
                }
                if p.seq >= below {
                    break 'segments;
                }
                // Stop before the message that would take the batch past the byte
                // limit (a message bigger than it goes alone).
                if taken == max || (taken > 0 && bytes + p.size as usize > SYNC_BATCH_BYTES) {
                    next = Some(p.seq);
                    break 'segments;
                }
                bytes += p.size as usize;
                let bytes = match &p.embedded {
                    Some(b) => Some(b.clone()),
                    None => state.msg_store.read(MsgId(p.msg_id))?,
                };
                let Some(message) =
                    bytes.and_then(|b| decode_message(&b, u128::from_be_bytes(p.msg_id)))
                else {
                    tracing::error!(queue = %queue, seq = p.seq, "message body missing; not synced");
                    continue;
                };
                ops.push(IndexOp::Publish {
                    seq: p.seq,
                    message: Arc::new(message),
                    expires_at_ms: p
                        .expires_at_ms
                        .map_or(u64::MAX, |t| t.saturating_sub(self.epoch_unix_ms)),
                    // The persistent index (the record's own flag follows the message).
                    persistent: true,
                });
                if e.delivered {
                    ops.push(IndexOp::Deliver { seq: p.seq });
                }
                taken += 1;
            }
        }
        Ok(f(ops, next))
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
        Ok(bytes.and_then(|b| decode_message(&b, id)))
    }
}

/// The file in a mirror copy's index folder that names the queue incarnation it copies.
const COPY_INCARNATION_FILE: &str = "copy.incarnation";

/// The incarnation a mirror copy in `dir` is of (None: not a copy, or unreadable).
fn read_copy_incarnation<D: Disk>(disk: &D, dir: &Path) -> Option<u64> {
    let bytes = disk.read(&dir.join(COPY_INCARNATION_FILE)).ok()?;
    std::str::from_utf8(&bytes).ok()?.trim().parse().ok()
}

/// Mirrored queues whose home is this node but which the broker does not run (yet):
/// promoted here while the node caught up, left to be adopted. (vhost, name, incarnation).
fn moved_in(broker: &Broker) -> Vec<(String, String, u64)> {
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

fn remove_index_dir<D: Disk>(disk: &D, dir: &Path) {
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
fn recover_queue<D: Disk + Clone>(
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
    summary.messages += entries.len() + rest as usize;
    summary.queues += 1;
    let next_seq = index.bounds().1;
    let rest = (rest > 0).then_some(Delta {
        start: recovered.rest_from,
        end: next_seq,
        count: rest,
        bytes: recovered.rest_bytes,
    });
    let mut queue = handle.lock();
    queue.restore(entries, rest, next_seq);
    if suspect || !recovered.clean {
        queue.mark_restored_suspect();
    }
    drop(queue);
    Ok((index, store_refs))
}

/// A queue entry for a message read back from an index (recovery or paging); `on_disk`
/// says which (a record's own persistent flag does not: a mirrored queue's transient
/// messages are in its persistent index).
fn queue_entry(
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
fn beta_entry(e: &IndexEntry, epoch_unix_ms: u64, on_disk: OnDisk) -> Entry {
    let placeholder = Message {
        id: u128::from_be_bytes(e.publish.msg_id),
        exchange: String::new(),
        routing_key: String::new(),
        properties_raw: Bytes::new(),
        properties: Default::default(),
        body: Bytes::new(),
    };
    let mut entry = queue_entry(e, placeholder, 0, epoch_unix_ms, on_disk);
    entry.beta = Some(u64::from(e.publish.size));
    entry
}

pub(crate) fn decode_message(bytes: &[u8], id: u128) -> Option<Message> {
    Message::from_stored(bytes, id)
}

#[cfg(test)]
mod model_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::frame::encode_properties;
    use crate::broker::PublishOutcome;
    use crate::config::Config;
    use crate::meta::args::QueueArgs;
    use crate::meta::{Command, QueueDef};
    use crate::store::MemDisk;
    use crate::time::Instant;
    use amq_protocol::protocol::basic::AMQPProperties;

    fn data() -> PathBuf {
        PathBuf::from("/data")
    }

    fn broker(d: &Arc<Durability>) -> Broker {
        broker_at(d, 0)
    }

    fn broker_at(d: &Arc<Durability>, epoch_unix_ms: u64) -> Broker {
        let broker =
            Broker::new(&Config::default(), 1, 1 << 30, epoch_unix_ms).with_durability(d.clone());
        declare(&broker, "q");
        broker
    }

    /// Declares the durable queue `name`.
    fn declare(broker: &Broker, name: &str) {
        broker
            .apply(
                &Command::DeclareQueue(QueueDef {
                    vhost: "/".into(),
                    name: name.into(),
                    durable: true,
                    exclusive_owner: None,
                    auto_delete: false,
                    arguments: Default::default(),
                    home: 0,
                }),
                Instant::default(),
            )
            .expect("declare");
    }

    fn publish(broker: &Broker, body: &[u8]) -> PublishOutcome {
        publish_as(broker, body, 2)
    }

    fn publish_as(broker: &Broker, body: &[u8], delivery_mode: u8) -> PublishOutcome {
        publish_to(broker, "q", body, delivery_mode)
    }

    fn publish_to(broker: &Broker, queue: &str, body: &[u8], delivery_mode: u8) -> PublishOutcome {
        let props = AMQPProperties::default().with_delivery_mode(delivery_mode);
        let m = Arc::new(Message {
            id: broker.next_message_id(),
            exchange: String::new(),
            routing_key: queue.into(),
            properties_raw: Bytes::from(encode_properties(&props)),
            properties: props,
            body: Bytes::copy_from_slice(body),
        });
        let snap = broker.snapshot();
        broker.publish(snap.vhost("/").expect("vhost"), "", m, Instant::default())
    }

    fn open(
        disk: &MemDisk,
    ) -> (
        Broker,
        Arc<Durability>,
        Arc<Storage<MemDisk>>,
        RecoverySummary,
    ) {
        let d = Arc::new(Durability::default());
        let b = broker(&d);
        let (s, summary) = Storage::open_with(
            disk.clone(),
            &b,
            d.clone(),
            &data(),
            &StorageConfig::default(),
            crate::time::Instant::default(),
        )
        .expect("open storage");
        // As the node does: queues read paged messages and stored bodies through storage.
        b.set_pager(s.clone());
        (b, d, s, summary)
    }

    fn bodies(b: &Broker) -> Vec<Vec<u8>> {
        contents(b).into_iter().map(|(body, _)| body).collect()
    }

    /// The queue's messages as a new master would serve them: body and redelivered flag.
    fn contents(b: &Broker) -> Vec<(Vec<u8>, bool)> {
        let q = b.queue("/", "q").expect("queue");
        let mut out = Vec::new();
        let mut dead = Vec::new();
        while let Some((e, _)) = q.lock().get(Instant::default(), false, &mut dead) {
            out.push((e.message.body.to_vec(), e.redelivered));
        }
        out
    }

    #[test]
    fn a_sync_reads_the_live_backlog_below_its_start_in_batches() {
        let disk = MemDisk::new();
        let d = Arc::new(Durability::default());
        let b = broker(&d);
        let config = StorageConfig {
            queue_index_segment_entry_count: 8,
            ..StorageConfig::default()
        };
        let (s, _) = Storage::open_with(
            disk,
            &b,
            d,
            &data(),
            &config,
            crate::time::Instant::default(),
        )
        .expect("open");
        b.set_pager(s.clone());
        for i in 0..50u32 {
            publish(&b, &i.to_be_bytes());
        }
        assert!(s.step());
        // Ten delivered, the first five of them acked.
        let q = b.queue("/", "q").expect("queue");
        let mut dead = Vec::new();
        let mut delivered = Vec::new();
        for _ in 0..10 {
            let (e, _) = q
                .lock()
                .get(Instant::default(), true, &mut dead)
                .expect("a message");
            delivered.push(e.seq);
        }
        q.lock()
            .ack(&q, &delivered[..5], Instant::default(), &mut dead);
        assert!(s.step());
        let start = s.at_next_seq("/", "q", |next| next);
        assert_eq!(start, 50);
        // Later publishes are not the backlog.
        publish(&b, b"later");
        assert!(s.step());
        let (mut from, mut batches, mut got) = (0, 0, Vec::new());
        loop {
            let (ops, next) = s
                .sync_batch("/", "q", from, start, 7, |ops, next| (ops, next))
                .expect("a batch");
            batches += 1;
            for op in ops {
                match op {
                    IndexOp::Publish { seq, message, .. } => {
                        got.push((seq, message.body.to_vec(), false))
                    }
                    IndexOp::Deliver { seq } => {
                        let last = got.last_mut().expect("a deliver follows its publish");
                        assert_eq!(last.0, seq);
                        last.2 = true;
                    }
                    other => panic!("not a sync operation: {other:?}"),
                }
            }
            match next {
                Some(n) => from = n,
                None => break,
            }
        }
        let expected: Vec<(u64, Vec<u8>, bool)> = (5..50u32)
            .map(|i| (i as u64, i.to_be_bytes().to_vec(), i < 10))
            .collect();
        assert_eq!(
            got, expected,
            "the live backlog, in order, delivered ones marked"
        );
        assert_eq!(batches, 45usize.div_ceil(7), "batches of at most 7");
    }

    #[test]
    fn a_sync_batch_stops_before_the_message_that_would_pass_its_byte_limit() {
        let disk = MemDisk::new();
        let d = Arc::new(Durability::default());
        let b = broker(&d);
        let (s, _) = Storage::open_with(
            disk,
            &b,
            d,
            &data(),
            &StorageConfig::default(),
            crate::time::Instant::default(),
        )
        .expect("open");
        b.set_pager(s.clone());
        // 1.5 MiB, 5 MiB (bigger than a batch: alone), then more of 1.5 MiB and 1 KiB.
        let sizes = [
            1536 << 10,
            1536 << 10,
            5 << 20,
            1536 << 10,
            1 << 10,
            1536 << 10,
        ];
        for (i, n) in sizes.iter().enumerate() {
            publish(&b, &vec![i as u8; *n]);
        }
        assert!(s.step());
        let (mut from, mut got) = (0, Vec::new());
        loop {
            let (ops, next) = s
                .sync_batch("/", "q", from, 100, 1000, |ops, next| (ops, next))
                .expect("a batch");
            let bodies: Vec<usize> = ops
                .iter()
                .map(|op| match op {
                    IndexOp::Publish { message, .. } => message.body.len(),
                    other => panic!("not a sync publish: {other:?}"),
                })
                .collect();
            got.push(bodies);
            match next {
                Some(n) => from = n,
                None => break,
            }
        }
        for batch in &got {
            assert!(
                batch.len() == 1 || batch.iter().sum::<usize>() <= SYNC_BATCH_BYTES,
                "a batch over {SYNC_BATCH_BYTES} bytes holds one message: {got:?}"
            );
        }
        let all: Vec<usize> = got.concat();
        assert_eq!(all, sizes, "every message once, in order");
        assert_eq!(
            got.len(),
            3,
            "[1.5, 1.5], [5], [1.5, 0.001, 1.5] MiB: {got:?}"
        );
    }

    #[test]
    fn a_mirror_fed_the_masters_operations_recovers_the_masters_queue() {
        let (master_disk, mirror_disk) = (MemDisk::new(), MemDisk::new());
        let (b, _, s, _) = open(&master_disk);
        let (_, _, mirror, _) = open(&mirror_disk);
        // What the master ships: each round's operations, on the wire (as a GM broadcast
        // would carry them).
        type Shipped = Vec<(String, String, Vec<u8>)>;
        let shipped: Arc<Mutex<Shipped>> = Arc::default();
        let tap = shipped.clone();
        s.set_ops_tap(Some(Arc::new(move |(vhost, queue), ops| {
            tap.lock().unwrap_or_else(|e| e.into_inner()).push((
                vhost.clone(),
                queue.clone(),
                crate::mirror::ops::encode(ops),
            ));
            None
        })));
        let big = vec![9u8; 10_000];
        for body in [b"a".to_vec(), big.clone(), b"c".to_vec(), b"d".to_vec()] {
            publish(&b, &body);
        }
        assert!(s.step());
        // Two deliveries awaiting acks; the first is acked.
        let q = b.queue("/", "q").expect("queue");
        let mut dead = Vec::new();
        let (first, _) = q
            .lock()
            .get(Instant::default(), true, &mut dead)
            .expect("a");
        q.lock()
            .get(Instant::default(), true, &mut dead)
            .expect("big");
        q.lock()
            .ack(&q, &[first.seq], Instant::default(), &mut dead);
        publish(&b, b"e");
        assert!(s.step());
        let batches = std::mem::take(&mut *shipped.lock().unwrap_or_else(|e| e.into_inner()));
        assert!(
            batches.len() >= 2,
            "one batch per round that wrote the queue"
        );
        let mut started = std::collections::BTreeSet::new();
        for (vhost, queue, bytes) in batches {
            if started.insert((vhost.clone(), queue.clone())) {
                mirror.start_copy(&vhost, &queue, 1).expect("a copy starts");
            }
            let ops = crate::mirror::ops::decode(&bytes).expect("a batch decodes");
            mirror
                .apply_mirrored(&vhost, &queue, 1, ops)
                .expect("the mirror writes");
        }
        // Both nodes lose power; each reopens what it fsynced.
        master_disk.crash();
        mirror_disk.crash();
        let (master_again, _, _, _) = open(&master_disk);
        let (promoted, _, _, summary) = open(&mirror_disk);
        // After an unclean stop any message may have gone out unrecorded: all of them
        // come back `redelivered` (the delivered, unacked one would anyway).
        let expected = vec![
            (big, true),
            (b"c".to_vec(), true),
            (b"d".to_vec(), true),
            (b"e".to_vec(), true),
        ];
        assert_eq!(
            contents(&master_again),
            expected,
            "the master's own recovery"
        );
        assert_eq!(contents(&promoted), expected, "the mirror's copy");
        assert_eq!((summary.messages, summary.lost), (4, 0));
    }

    /// Pipelined rounds complete in the order written: a round with no laps of its own
    /// waits for an earlier round's, and an earlier round's failed lap refuses its own
    /// confirms only.
    #[test]
    fn pipelined_rounds_complete_in_order_and_a_failed_lap_refuses_only_its_round() {
        let disk = MemDisk::new();
        let (b, d, s, _) = open(&disk);
        declare(&b, "plain");
        // Queue "q" is mirrored: its rounds wait for a lap the test completes.
        type Laps = Vec<tokio::sync::oneshot::Sender<bool>>;
        let laps: Arc<Mutex<Laps>> = Arc::default();
        let senders = laps.clone();
        s.set_ops_tap(Some(Arc::new(move |(_, queue), _| {
            if queue != "q" {
                return None;
            }
            let (tx, rx) = tokio::sync::oneshot::channel();
            senders.lock().unwrap_or_else(|e| e.into_inner()).push(tx);
            Some(Box::pin(async move { rx.await.unwrap_or(false) }) as LapWait)
        })));
        let mirrored = publish_to(&b, "q", b"m1", 2).ticket;
        let first = s.write_round().expect("write").expect("waits for its lap");
        let plain = publish_to(&b, "plain", b"p1", 2).ticket;
        assert!(
            s.write_round().expect("write").is_none(),
            "no laps of its own"
        );
        assert_eq!(s.rounds_in_flight(), 2, "but it waits for the first round");
        assert!(!d.is_durable(plain), "not before the earlier round");
        let mirrored_again = publish_to(&b, "q", b"m2", 2).ticket;
        let third = s.write_round().expect("write").expect("waits for its lap");
        // The first round's lap fails (its master was deposed).
        let lap = laps.lock().unwrap_or_else(|e| e.into_inner()).remove(0);
        let _ = lap.send(false);
        let (round, ok) = block_on(first.wait());
        assert!(!ok);
        s.laps_done(round, ok);
        assert!(d.is_refused(mirrored), "its confirm is a nack");
        assert!(
            d.is_durable(plain) && !d.is_refused(plain),
            "the round after it waited only for it: confirmed"
        );
        assert!(!d.is_durable(mirrored_again), "its own lap is still out");
        let lap = laps.lock().unwrap_or_else(|e| e.into_inner()).remove(0);
        let _ = lap.send(true);
        let (round, ok) = block_on(third.wait());
        s.laps_done(round, ok);
        assert!(d.is_durable(mirrored_again) && !d.is_refused(mirrored_again));
        assert_eq!(s.rounds_in_flight(), 0);
        // With nothing out, a lap-less round is durable at once.
        let again = publish_to(&b, "plain", b"p2", 2).ticket;
        assert!(s.write_round().expect("write").is_none());
        assert!(d.is_durable(again));
    }

    /// Keeps every round `s` writes, encoded as shipped, instead of shipping it.
    fn capture_rounds(s: &Storage<MemDisk>) -> Arc<Mutex<Vec<Vec<u8>>>> {
        let shipped: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
        let tap = shipped.clone();
        s.set_ops_tap(Some(Arc::new(move |_, ops| {
            let mut t = tap.lock().unwrap_or_else(|e| e.into_inner());
            t.push(crate::mirror::ops::encode(ops));
            None
        })));
        shipped
    }

    /// A broker on node 1 following metadata in which `q` (durable, home node 2) is mirrored
    /// on node 1, synchronised; with `promoted`, node 1's mirror was then promoted (the
    /// broker leaves the queue to be adopted). The set's incarnation too.
    fn mirror_broker(d: &Arc<Durability>, promoted: bool) -> (Broker, u64) {
        let broker = Broker::new(&Config::default(), 1, 1 << 30, 0)
            .with_node_id(1)
            .with_durability(d.clone());
        let mut state = (*broker.snapshot()).clone();
        let node = |id| {
            Command::RegisterNode(crate::meta::NodeRecord {
                id,
                name: format!("n{id}"),
                amqp: String::new(),
                admin: String::new(),
                link: String::new(),
                incarnation: 0,
            })
        };
        for c in [
            node(1),
            node(2),
            Command::DeclareQueue(QueueDef {
                vhost: "/".into(),
                name: "q".into(),
                durable: true,
                exclusive_owner: None,
                auto_delete: false,
                arguments: Default::default(),
                home: 2,
            }),
            Command::SetMirrors {
                vhost: "/".into(),
                queue: "q".into(),
                expected_version: 0,
                mirrors: vec![crate::meta::state::MirrorRecord {
                    node: 1,
                    since: 0,
                    synchronised: true,
                }],
            },
        ] {
            state.apply(&c).expect("metadata");
        }
        broker.follow(Arc::new(state.clone()), Instant::default());
        if promoted {
            state
                .apply(&Command::PromoteMirror {
                    vhost: "/".into(),
                    queue: "q".into(),
                    expected_epoch: 0,
                    node: 1,
                })
                .expect("promote");
            broker.follow(Arc::new(state.clone()), Instant::default());
        }
        assert!(broker.queue("/", "q").is_none(), "no queue of its own here");
        let key = ("/".to_string(), "q".to_string());
        (broker, state.mirror_sets[&key].incarnation)
    }

    /// A mirror promoted while its node was down or catching up (the promotion commits
    /// before the node's restart re-registers it) finds itself the queue's master at start:
    /// storage recovers its copy as the queue, bodies included, if the copy is of the
    /// queue's present incarnation; a stale copy of the name is dropped. Before, every
    /// copy was pruned at start and the promoted queue came up empty (a whole-cluster
    /// SIGTERM lost every confirmed message, `tests/mirroring.rs`).
    #[test]
    fn a_copy_promoted_while_its_node_was_starting_is_recovered_as_the_queue() {
        for stale in [false, true] {
            let (master_disk, mirror_disk) = (MemDisk::new(), MemDisk::new());
            let (b, _, s, _) = open(&master_disk);
            let shipped = capture_rounds(&s);
            let big = vec![7u8; 10_000];
            for body in [b"a".to_vec(), big.clone()] {
                publish(&b, &body);
            }
            assert!(s.step());
            let d = Arc::new(Durability::default());
            let (mirror_b, incarnation) = mirror_broker(&d, false);
            let (mirror, _) = Storage::open_with(
                mirror_disk.clone(),
                &mirror_b,
                d,
                &data(),
                &StorageConfig::default(),
                Instant::default(),
            )
            .expect("open");
            let copy_of = if stale { incarnation + 1 } else { incarnation };
            mirror.start_copy("/", "q", copy_of).expect("a copy starts");
            for round in shipped.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                let ops = crate::mirror::ops::decode(round).expect("a batch decodes");
                mirror
                    .apply_mirrored("/", "q", copy_of, ops)
                    .expect("the mirror writes");
            }
            mirror_disk.crash();
            let d = Arc::new(Durability::default());
            let (promoted, _) = mirror_broker(&d, true);
            let (storage, summary) = Storage::open_with(
                mirror_disk.clone(),
                &promoted,
                d,
                &data(),
                &StorageConfig::default(),
                Instant::default(),
            )
            .expect("reopen");
            if stale {
                assert!(
                    promoted.queue("/", "q").is_none(),
                    "a stale copy is not the queue"
                );
                assert_eq!(summary.messages, 0);
                continue;
            }
            promoted.set_pager(storage);
            assert_eq!(summary.messages, 2);
            let got: Vec<(usize, u8, bool)> = contents(&promoted)
                .into_iter()
                .map(|(body, redelivered)| (body.len(), body[0], redelivered))
                .collect();
            assert_eq!(
                got,
                [(1, b'a', true), (big.len(), 7, true)],
                "the copy is the queue, stored bodies too; its messages may have gone out \
                 unrecorded"
            );
        }
    }

    /// A copy belongs to one incarnation of its queue (issue 16): another incarnation's
    /// mirror can neither write to it nor drop it, and a queue of this node declared under
    /// the same name drops a stale copy before its first write, after which the stale
    /// mirror can touch neither.
    #[test]
    fn a_copy_is_its_incarnations_and_a_new_queue_of_its_name_replaces_it() {
        let (master_disk, mirror_disk) = (MemDisk::new(), MemDisk::new());
        let (b, _, s, _) = open(&master_disk);
        let (mirror_b, _, mirror, _) = open(&mirror_disk);
        let shipped = capture_rounds(&s);
        publish(&b, b"old");
        assert!(s.step());
        let rounds = std::mem::take(&mut *shipped.lock().unwrap_or_else(|e| e.into_inner()));
        let ops = || crate::mirror::ops::decode(&rounds[0]).expect("a batch decodes");
        let write = |incarnation| mirror.apply_mirrored("/", "q", incarnation, ops());
        assert!(
            matches!(write(1), Err(StorageError::NotOurCopy { .. })),
            "no copy started"
        );
        mirror.start_copy("/", "q", 1).expect("a copy starts");
        write(1).expect("the copy's own incarnation writes");
        assert!(matches!(write(2), Err(StorageError::NotOurCopy { .. })));
        mirror.drop_copy("/", "q", 2).expect("drop");
        write(1).expect("another incarnation's drop left the copy alone");
        // This node's own queue `q` (declared again here) writes: the stale copy goes.
        publish(&mirror_b, b"new");
        assert!(mirror.step());
        assert!(
            matches!(write(1), Err(StorageError::NotOurCopy { .. })),
            "the stale mirror cannot write into the new queue"
        );
        mirror.drop_copy("/", "q", 1).expect("drop");
        mirror_disk.crash();
        let (again, _, _, _) = open(&mirror_disk);
        assert_eq!(
            bodies(&again),
            [b"new".to_vec()],
            "the new queue holds its own message, none of the old copy's"
        );
    }

    #[test]
    fn a_mirrored_queues_transient_messages_reach_its_mirror_and_a_promoted_copy_keeps_them() {
        let (master_disk, mirror_disk) = (MemDisk::new(), MemDisk::new());
        let (b, _, s, _) = open(&master_disk);
        let (mirror_b, _, mirror, _) = open(&mirror_disk);
        let shipped = capture_rounds(&s);
        let q = b.queue("/", "q").expect("queue");
        // Not mirrored: a transient message has no record, so its confirm waits for nothing.
        assert_eq!(publish_as(&b, b"before", 1).ticket, 0);
        let mut dead = Vec::new();
        q.lock().get(Instant::default(), false, &mut dead);
        // An `ha-mode` policy applies: every message is recorded.
        let args = QueueArgs {
            mirrored: true,
            ..q.lock().args().clone()
        };
        q.lock().set_args(args);
        let big = vec![7u8; 10_000];
        assert_ne!(
            publish_as(&b, b"t1", 1).ticket,
            0,
            "a transient confirm waits"
        );
        publish_as(&b, b"p1", 2);
        publish_as(&b, &big, 1);
        assert!(s.step());
        let (t1, _) = q
            .lock()
            .get(Instant::default(), true, &mut dead)
            .expect("t1");
        assert_eq!(&t1.message.body[..], b"t1");
        q.lock().ack(&q, &[t1.seq], Instant::default(), &mut dead);
        publish_as(&b, b"t2", 1);
        assert!(!q.lock().holds_unindexed());
        assert!(s.step());
        mirror.start_copy("/", "q", 1).expect("a copy starts");
        for bytes in std::mem::take(&mut *shipped.lock().unwrap_or_else(|e| e.into_inner())) {
            let ops = crate::mirror::ops::decode(&bytes).expect("a batch decodes");
            mirror
                .apply_mirrored("/", "q", 1, ops)
                .expect("the mirror writes");
        }
        // The mirror's copy becomes the queue: transient messages and all.
        let h = mirror_b.queue("/", "q").expect("queue");
        mirror.adopt(&h, 1).expect("adopt");
        let expected = vec![
            (b"p1".to_vec(), true),
            (big.clone(), true),
            (b"t2".to_vec(), true),
        ];
        assert_eq!(contents(&mirror_b), expected, "the promoted copy");
        // The master's node restarting drops its transient messages, as RabbitMQ's does.
        master_disk.crash();
        let (again, _, _, _) = open(&master_disk);
        assert_eq!(contents(&again), vec![(b"p1".to_vec(), true)]);
    }

    #[test]
    fn confirmed_writes_survive_power_loss_in_order() {
        let disk = MemDisk::new();
        let (b, d, s, _) = open(&disk);
        let big = vec![7u8; 10_000];
        let tickets: Vec<u64> = [b"one".to_vec(), big.clone(), b"three".to_vec()]
            .iter()
            .map(|body| publish(&b, body).ticket)
            .collect();
        assert!(tickets.iter().all(|t| *t > 0 && !d.is_durable(*t)));
        assert!(s.step());
        assert!(
            tickets.iter().all(|t| d.is_durable(*t)),
            "one round makes them durable"
        );
        disk.crash();
        let (b2, _, _, summary) = open(&disk);
        assert_eq!((summary.messages, summary.lost), (3, 0));
        assert_eq!(bodies(&b2), vec![b"one".to_vec(), big, b"three".to_vec()]);
    }

    #[test]
    fn writes_not_yet_synced_are_lost_but_were_never_confirmed() {
        let disk = MemDisk::new();
        let (b, d, s, _) = open(&disk);
        let t = publish(&b, b"kept").ticket;
        assert!(s.step() && d.is_durable(t));
        let t2 = publish(&b, b"in flight").ticket;
        assert!(
            !d.is_durable(t2),
            "no round ran: its confirm is still held back"
        );
        disk.crash();
        let (b2, _, _, _) = open(&disk);
        assert_eq!(bodies(&b2), vec![b"kept".to_vec()]);
    }

    #[test]
    fn acked_messages_do_not_come_back() {
        let disk = MemDisk::new();
        let (b, _, s, _) = open(&disk);
        for body in [b"a", b"b", b"c"] {
            publish(&b, body);
        }
        let q = b.queue("/", "q").expect("queue");
        let mut dead = Vec::new();
        let (first, _) = q
            .lock()
            .get(Instant::default(), true, &mut dead)
            .expect("a");
        q.lock()
            .ack(&q, &[first.seq], Instant::default(), &mut dead);
        assert!(s.step());
        s.close();
        let (b2, _, _, summary) = open(&disk);
        assert!(summary.clean, "a clean close is recognised");
        assert_eq!(bodies(&b2), vec![b"b".to_vec(), b"c".to_vec()]);
    }

    #[test]
    fn a_queue_emptied_before_a_restart_takes_new_persistent_messages() {
        let disk = MemDisk::new();
        let (b, _, s, _) = open(&disk);
        publish(&b, b"gone");
        let q = b.queue("/", "q").expect("queue");
        let mut dead = Vec::new();
        q.lock().get(Instant::default(), false, &mut dead);
        assert!(s.step());
        s.close();
        // The index remembers seq 0; the recovered queue must not hand it out again.
        let (b2, d2, s2, _) = open(&disk);
        let t = publish(&b2, b"new").ticket;
        assert!(s2.step(), "storage accepts the new message");
        assert!(d2.is_durable(t));
        s2.close();
        let (b3, _, _, _) = open(&disk);
        assert_eq!(bodies(&b3), vec![b"new".to_vec()]);
    }

    #[test]
    fn deleting_a_queue_releases_its_stored_bodies_at_once() {
        let disk = MemDisk::new();
        let (b, _, s, _) = open(&disk);
        for _ in 0..3 {
            publish(&b, &vec![5u8; 20_000]);
        }
        assert!(s.step());
        let stored = |s: &Storage<MemDisk>| {
            let g = s.state.lock().expect("state");
            g.as_ref().map(|st| st.msg_store.len()).expect("open")
        };
        assert_eq!(stored(&s), 3, "large bodies live in the message store");
        b.apply(
            &Command::DeleteQueue {
                vhost: "/".into(),
                name: "q".into(),
            },
            Instant::default(),
        )
        .expect("delete");
        assert!(s.step());
        assert_eq!(stored(&s), 0, "no body outlives its queue until a restart");
    }

    #[test]
    fn a_full_disk_stops_storage_and_nothing_is_confirmed() {
        let disk = MemDisk::new();
        let (b, d, s, _) = open(&disk);
        assert!(s.step());
        disk.set_capacity(Some(disk_used(&disk) + 100));
        let t = publish(&b, &vec![1u8; 50_000]).ticket;
        assert!(!s.step(), "the write does not fit");
        assert!(d.has_failed(), "storage reports the failure (alarm, nacks)");
        assert!(!d.is_durable(t), "the failed write is never marked durable");
    }

    #[test]
    fn a_failed_fsync_is_fatal() {
        let disk = MemDisk::new();
        let (b, d, s, _) = open(&disk);
        publish(&b, &vec![2u8; 9000]);
        disk.fail_next_sync();
        assert!(!s.step());
        assert!(d.has_failed());
    }

    #[test]
    fn expiry_survives_a_restart_as_wall_clock_time() {
        let disk = MemDisk::new();
        let d = Arc::new(Durability::default());
        let b = broker_at(&d, 1_000_000);
        let (s, _) = Storage::open_with(
            disk.clone(),
            &b,
            d.clone(),
            &data(),
            &StorageConfig::default(),
            crate::time::Instant::default(),
        )
        .expect("open");
        let props = AMQPProperties::default()
            .with_delivery_mode(2)
            .with_expiration("60000".into());
        let m = Arc::new(Message {
            id: b.next_message_id(),
            exchange: String::new(),
            routing_key: "q".into(),
            properties_raw: Bytes::from(encode_properties(&props)),
            properties: props,
            body: Bytes::from_static(b"ttl"),
        });
        let snap = b.snapshot();
        b.publish(
            snap.vhost("/").expect("vhost"),
            "",
            m,
            Instant::from_millis(0),
        );
        assert!(s.step());
        s.close();
        // The next start is 50 s later on the wall clock: 10 s of the TTL are left.
        let d2 = Arc::new(Durability::default());
        let b2 = broker_at(&d2, 1_050_000);
        Storage::open_with(
            disk.clone(),
            &b2,
            d2,
            &data(),
            &StorageConfig::default(),
            crate::time::Instant::default(),
        )
        .expect("reopen");
        let q = b2.queue("/", "q").expect("queue");
        let mut dead = Vec::new();
        let (e, _) = q
            .lock()
            .get(Instant::from_millis(0), false, &mut dead)
            .expect("message");
        assert_eq!(e.expires_at_ms, 10_000);
    }

    fn disk_used(disk: &MemDisk) -> u64 {
        let mut total = 0;
        let mut dirs = vec![data()];
        dirs.push(data().join("msg_store_persistent"));
        dirs.push(data().join("queues").join(queue_dir_name("/", "q")));
        for dir in dirs {
            for n in disk.list(&dir).unwrap_or_default() {
                total += disk.len(&dir.join(n)).ok().flatten().unwrap_or(0);
            }
        }
        total
    }
}
