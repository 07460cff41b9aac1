//! The node's side of mirrored queues (`docs/mirroring.md`): for every queue whose
//! metadata lists mirrors, a task plays this node's part, master or mirror, in the queue's GM
//! group; on the Raft leader, a task keeps mirror sets in line with `ha-*` policies and
//! promotes a mirror when a master's node is recorded down.
//!
//! - **Master.** The storage syncer's tap ships every round of the queue's operations as one
//!   confirmed GM broadcast, and the round's confirms wait for its lap (with durable acks: a
//!   lap means every mirror wrote and fsynced the round). It starts each new mirror's sync
//!   and records it synchronised in the metadata once it holds the whole queue.
//! - **Mirror.** Writes each round into its own copy of the queue's index and message store
//!   (`Storage::apply_mirrored`), fsyncs, and only then releases it in GM.
//! - **Promotion.** A mirror whose node becomes the queue's home sends a flush through the
//!   group, and once its lap completes opens its copy as crash recovery does (deliveries
//!   never acked come back `redelivered`) and serves the queue. A controlled stop hands
//!   mastered queues over the same way ([`MirrorHost::hand_over`]).
//! - **Sync.** A new mirror's copy starts at a point of the stream; the master copies the
//!   backlog before it in batches while the queue serves (or waits for it to drain).
//!
//! Every message of a mirrored queue is mirrored, durable queue or not: a mirrored queue
//! records its transient messages (and a non-durable one all of its messages) in its index
//! too; they do not outlive a restart of the node that holds them, but a promoted mirror's
//! copy keeps them.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future as _;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use tokio::task::JoinHandle;

use super::clock::Clock;
use super::file_disk::FileDisk;
use super::gm_host::{GmHandle, GmHost, GmNet, GmSender};
use super::storage::{LapWait, Storage};
use crate::broker::queue::IndexOp;
use crate::broker::Broker;
use crate::gm::{Event, MemberId, Slot};
use crate::meta::state::{MirrorRecord, MirrorSet};
use crate::meta::{Command, MetaState};
use crate::meta::{HaPolicy, SyncMode};
use crate::mirror::message::{group_name, MirrorMsg};
use crate::mirror::ops;
use crate::runtime::raft::{MetaRaft, NodeId};

type Key = (String, String);

/// The disks a mirror host's storage may use (the node's files; the simulation's memory).
pub trait StorageDisk: crate::store::Disk + Clone + Send + Sync + 'static {}
impl<D: crate::store::Disk + Clone + Send + Sync + 'static> StorageDisk for D {}
use crate::store::Disk;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where the storage tap ships a mastered queue's rounds.
#[derive(Clone)]
struct Shipping {
    sender: GmSender,
    epoch: u64,
    /// The queue incarnation shipped for ([`MirrorSet::incarnation`]).
    incarnation: u64,
    /// The master's member (a handover waits for it to leave).
    member: MemberId,
    /// Set when a controlled stop starts handing the queue over: from then on no round is
    /// confirmed, not even one whose lap is under way. The target may die during the
    /// handover, and a lap completes without a dead member, so a confirm given then could
    /// be missing from the copy that becomes the queue.
    handing_over: Arc<std::sync::atomic::AtomicBool>,
}

impl Shipping {
    /// Shipping through `handle`'s member at `epoch` of queue incarnation `incarnation`.
    fn of(handle: &GmHandle, epoch: u64, incarnation: u64) -> Shipping {
        Shipping {
            sender: handle.sender(),
            epoch,
            incarnation,
            member: handle.id(),
            handing_over: Arc::default(),
        }
    }
}

/// The queues this node ships rounds for. Its lock is never held while another is taken:
/// the storage tap reads it under the storage lock, and a queue's lock and the broker's are
/// taken before the storage lock, so a queue or broker lock taken under this one closes a
/// cycle (bug 11 in `docs/reliability.md`: `keep_leases` held it while looking a queue up,
/// an adoption held the broker and waited for storage, and the syncer waited for this; the
/// node froze). Every method takes the lock for one map operation and returns owned values.
#[derive(Default)]
struct Shippers(Mutex<HashMap<Key, Shipping>>);

impl Shippers {
    fn get(&self, key: &Key) -> Option<Shipping> {
        lock(&self.0).get(key).cloned()
    }

    fn insert(&self, key: Key, shipping: Shipping) {
        lock(&self.0).insert(key, shipping);
    }

    fn remove(&self, key: &Key) {
        lock(&self.0).remove(key);
    }

    fn is_empty(&self) -> bool {
        lock(&self.0).is_empty()
    }

    fn all(&self) -> Vec<(Key, Shipping)> {
        lock(&self.0)
            .iter()
            .map(|(k, s)| (k.clone(), s.clone()))
            .collect()
    }

    fn drain(&self) -> Vec<Key> {
        lock(&self.0).drain().map(|(k, _)| k).collect()
    }
}

struct Inner<N, D: Disk + Clone> {
    node: NodeId,
    broker: Arc<Broker>,
    storage: Arc<Storage<D>>,
    gm: GmHost<N>,
    raft: MetaRaft,
    clock: Clock,
    /// Storage work runs on this task, not the blocking pool (the simulation: its disk is
    /// memory, and a thread would make the run depend on the OS scheduler).
    inline: bool,
    /// The queues this node ships rounds for.
    masters: Shippers,
    /// Queues whose master here lost its GM member (recorded dead: this node was recorded
    /// down, or restarted), with the (incarnation, epoch) it mastered. While the metadata
    /// still shows that epoch, nothing of the queue is confirmed here on local disk alone:
    /// a promotion decided while the member was dead may yet commit at that epoch, and the
    /// mirror it promotes lacks whatever this node confirmed meanwhile (simulation seed
    /// 857). Cleared when a master here ships again.
    fenced: Mutex<HashMap<Key, (u64, u64)>>,
    tasks: Mutex<HashMap<Key, JoinHandle<()>>>,
    /// Numbers the syncs this node's masters start.
    next_sync: std::sync::atomic::AtomicU64,
    /// Where syncing mirrors hold rounds that do not fit in memory.
    hold_dir: std::path::PathBuf,
    /// How long a master may hand out messages after a Raft quorum read showed it is the
    /// master: under the failure detector's timeout, so it stops before any mirror can be
    /// promoted (`docs/mirroring.md`, "The master's lease").
    lease: Duration,
    /// Wakes `keep_leases` at once: a new master is fenced until its first renewal, and
    /// waiting for the next period would stall its consumers (and a failover) for it.
    lease_wake: tokio::sync::Notify,
}

/// The default lease: half the failure detector's default timeout (`peer_timeout_ms`,
/// 5 s).
pub const DEFAULT_LEASE: Duration = Duration::from_millis(2_500);

/// The node's mirrored-queue runtime. Clones share it.
pub struct MirrorHost<N, D: Disk + Clone = Arc<FileDisk>> {
    inner: Arc<Inner<N, D>>,
}

impl<N, D: Disk + Clone> Clone for MirrorHost<N, D> {
    fn clone(&self) -> Self {
        MirrorHost {
            inner: Arc::clone(&self.inner),
        }
    }
}

/// This node's part in a queue's group, from the metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    None,
    /// The queue moved here (a promotion) and does not run yet.
    Adopt,
    Master,
    Mirror,
}

fn role_of(state: &MetaState, broker: &Broker, key: &Key, me: NodeId) -> Role {
    let Some(def) = state.vhosts.get(&key.0).and_then(|v| v.queues.get(&key.1)) else {
        return Role::None;
    };
    if def.exclusive_owner.is_some() {
        return Role::None;
    }
    let set = state.mirror_sets.get(key);
    if def.home == me {
        let applied_here = broker
            .snapshot()
            .vhosts
            .get(&key.0)
            .and_then(|v| v.queues.get(&key.1))
            .is_some_and(|d| d.home == me);
        if applied_here && broker.queue(&key.0, &key.1).is_none() {
            return Role::Adopt;
        }
        return if set.is_some_and(|s| !s.mirrors.is_empty()) {
            Role::Master
        } else {
            Role::None
        };
    }
    if set.is_some_and(|s| s.mirrors.iter().any(|m| m.node == me)) {
        Role::Mirror
    } else {
        Role::None
    }
}

/// How long a master waits for a mirror to acknowledge a sync whose end made its lap
/// before it starts the sync again.
const SYNC_ACK_WAIT: Duration = Duration::from_secs(3);

/// A mirror's state in its group.
enum Mode {
    /// Joined; waiting for the master's `SyncStart` (rounds before it are not ours).
    Waiting,
    /// Writing every round.
    Live,
    /// Taking the backlog of the sync `(epoch, sync)`; rounds are held (in order) until it
    /// is in.
    Syncing(Held, (u64, u64)),
}

/// Rounds a syncing mirror holds back, in order: in memory up to [`HOLD_IN_MEMORY`] bytes,
/// the rest in a file (a long sync under heavy publishing must not exhaust memory).
struct Held {
    memory: Vec<Vec<u8>>,
    bytes: usize,
    file: Option<(std::path::PathBuf, std::fs::File)>,
    spill_path: std::path::PathBuf,
    limit: usize,
}

/// Held rounds kept in memory before they go to the hold file.
const HOLD_IN_MEMORY: usize = 64 << 20;

impl Held {
    fn new(spill_path: std::path::PathBuf) -> Held {
        Held::with_limit(spill_path, HOLD_IN_MEMORY)
    }

    fn with_limit(spill_path: std::path::PathBuf, limit: usize) -> Held {
        Held {
            memory: Vec::new(),
            bytes: 0,
            file: None,
            spill_path,
            limit,
        }
    }

    fn push(&mut self, batch: Vec<u8>) -> std::io::Result<()> {
        use std::io::Write;
        if self.file.is_none() && self.bytes + batch.len() <= self.limit {
            self.bytes += batch.len();
            self.memory.push(batch);
            return Ok(());
        }
        if self.file.is_none() {
            if let Some(dir) = self.spill_path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let f = std::fs::OpenOptions::new()
                .create(true)
                .truncate(true)
                .read(true)
                .write(true)
                .open(&self.spill_path)?;
            self.file = Some((self.spill_path.clone(), f));
        }
        if let Some((_, f)) = &mut self.file {
            f.write_all(&(batch.len() as u64).to_be_bytes())?;
            f.write_all(&batch)?;
        }
        Ok(())
    }

    /// Every held round, in order (the file's are read back once, at the end of the sync).
    fn drain(self) -> std::io::Result<Vec<Vec<u8>>> {
        use std::io::{Read, Seek};
        let mut all = self.memory;
        if let Some((path, mut f)) = self.file {
            f.seek(std::io::SeekFrom::Start(0))?;
            let mut r = std::io::BufReader::new(f);
            let mut len = [0u8; 8];
            while r.read_exact(&mut len).is_ok() {
                let mut batch = vec![0u8; u64::from_be_bytes(len) as usize];
                r.read_exact(&mut batch)?;
                all.push(batch);
            }
            let _ = std::fs::remove_file(path);
        }
        Ok(all)
    }
}

/// What a mirror's event left it as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Followed {
    Going,
    Stopped,
    WriteFailed,
}

/// A member of a queue's group and what it knows.
struct Membership {
    handle: GmHandle,
    members: BTreeSet<MemberId>,
    mode: Mode,
    /// The queue's master as this member last saw it.
    master: NodeId,
    /// The member on `master` whose messages it last delivered: after a promotion, the
    /// old master's member, which may still ship rounds until it leaves (not the member
    /// that node may have joined with since, as a mirror).
    master_member: Option<MemberId>,
    /// The queue incarnation whose group this is ([`MirrorSet::incarnation`]): when the
    /// metadata names another (the queue was deleted and declared again), this member
    /// belongs to a queue that is gone.
    incarnation: u64,
    /// The sync `(epoch, sync)` whose start made this mirror's copy the queue's (a natural
    /// sync's `SyncStart`, an active one's `SyncEnd`): its `SyncEnd` is acknowledged.
    synced_by: Option<(u64, u64)>,
}

/// The incarnation of `key`'s mirror set (0: not mirrored).
fn incarnation_of(state: &MetaState, key: &Key) -> u64 {
    state.mirror_sets.get(key).map_or(0, |s| s.incarnation)
}

/// `key`'s GM group as the metadata has it now (its current incarnation's).
fn group_of(state: &MetaState, key: &Key) -> String {
    group_name(&key.0, &key.1, incarnation_of(state, key))
}

impl<N: GmNet + Clone, D: StorageDisk> MirrorHost<N, D> {
    /// A host for this node; [`MirrorHost::start`] installs the tap and starts the tasks.
    pub fn new(
        broker: Arc<Broker>,
        storage: Arc<Storage<D>>,
        gm: GmHost<N>,
        raft: MetaRaft,
        clock: Clock,
        hold_dir: std::path::PathBuf,
    ) -> MirrorHost<N, D> {
        MirrorHost {
            inner: Arc::new(Inner {
                node: gm.node(),
                broker,
                storage,
                gm,
                raft,
                clock,
                inline: false,
                masters: Shippers::default(),
                fenced: Mutex::new(HashMap::new()),
                tasks: Mutex::new(HashMap::new()),
                next_sync: std::sync::atomic::AtomicU64::new(1),
                hold_dir,
                lease: DEFAULT_LEASE,
                lease_wake: tokio::sync::Notify::new(),
            }),
        }
    }

    /// Storage work runs on the host's tasks instead of the blocking pool: for a runtime
    /// that must stay deterministic (the simulation, whose disk is memory). Call before
    /// [`MirrorHost::start`].
    pub fn with_inline_storage(mut self) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.inline = true;
        }
        self
    }

    /// The master's lease (see [`DEFAULT_LEASE`]); it must stay under the failure
    /// detector's timeout. Call before [`MirrorHost::start`].
    pub fn with_lease(mut self, lease: Duration) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.lease = lease;
        }
        self
    }

    /// Installs the storage tap and starts the supervisor and the leader's reconciler.
    pub fn start(&self, reconcile_every: Duration) -> Vec<JoinHandle<()>> {
        let inner = self.inner.clone();
        self.inner
            .storage
            .set_ops_tap(Some(Arc::new(move |key: &Key, ops: &[IndexOp]| {
                inner.ship(key, ops)
            })));
        vec![
            tokio::spawn(supervise(self.inner.clone())),
            tokio::spawn(reconcile(self.inner.clone(), reconcile_every)),
            tokio::spawn(keep_leases(self.inner.clone())),
        ]
    }

    /// A controlled stop (`ha-promote-on-shutdown`): every queue mastered here with a mirror
    /// the rule allows (a synchronised one; any with `always`) moves to it, as a planned
    /// move: this node's master leaves the group once its in-flight rounds made their laps,
    /// and the mirror takes over without waiting for the failure detector. Waits up to
    /// `within` for the moves; queues without such a mirror wait for this node to return.
    pub async fn hand_over(&self, within: Duration) {
        let inner = &self.inner;
        let state = inner.raft.snapshot();
        let masters = inner.masters.all();
        let running: BTreeSet<NodeId> = state
            .nodes
            .keys()
            .copied()
            .filter(|id| *id != inner.node && !inner.broker.node_is_down(*id))
            .collect();
        let mut moving = Vec::new();
        for (key, shipping) in masters {
            let Some(set) = state.mirror_sets.get(&key) else {
                continue;
            };
            let rule = policy_of(&state, &key).map_or(crate::meta::PromoteRule::WhenSynced, |p| {
                p.promote_on_shutdown
            });
            let Some(node) = crate::meta::promotion(&set.mirrors, &running, rule) else {
                tracing::warn!(queue = %key.1, "no mirror to hand over to: the queue waits for this node");
                continue;
            };
            // Fenced before the proposal: a round whose lap ends after it commits could lack
            // the target (if its member died meanwhile) and still be confirmed. Never
            // lifted: the node is stopping, and a proposal that timed out may yet commit.
            shipping
                .handing_over
                .store(true, std::sync::atomic::Ordering::Release);
            match inner.raft.propose(promote_to(&key, set, node)).await {
                Ok(r) if r.outcome.is_ok() => {
                    tracing::info!(queue = %key.1, to = node, "handing the queue over");
                    moving.push((key, shipping.member, shipping.incarnation));
                }
                other => {
                    tracing::warn!(queue = %key.1, outcome = ?other.map(|r| r.outcome), "cannot hand the queue over")
                }
            }
        }
        let deadline = tokio::time::Instant::now() + within;
        for (key, member, incarnation) in moving {
            let group = group_name(&key.0, &key.1, incarnation);
            while tokio::time::Instant::now() < deadline
                && inner
                    .raft
                    .snapshot()
                    .gm_groups
                    .get(&group)
                    .is_some_and(|g| g.members.contains(&Slot::Alive(member)))
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    /// Stops the queue tasks (the node is stopping). The queues this node still masters
    /// stop delivering now, lease or not: the node links close next, and a peer whose
    /// connection to this node is refused records it down at once, without waiting out
    /// the lease (`docs/mirroring.md`, *The master's lease*).
    pub fn stop(&self) {
        self.inner.storage.set_ops_tap(None);
        for (_, t) in lock(&self.inner.tasks).drain() {
            t.abort();
        }
        let stopped = self.inner.masters.drain();
        for key in stopped {
            if let Some(h) = self.inner.broker.queue(&key.0, &key.1) {
                h.lock()
                    .set_lease(Some(crate::time::Instant::from_millis(0)));
            }
        }
    }
}

impl<N: GmNet + Clone, D: StorageDisk> Inner<N, D> {
    /// The storage tap: ships a mastered queue's round (the operations of its persistent
    /// index, which holds every message of a mirrored queue; page-outs stay local).
    fn ship(&self, key: &Key, round: &[IndexOp]) -> Option<LapWait> {
        let Some(shipping) = self.masters.get(key) else {
            return self.not_shipping(key);
        };
        if shipping.incarnation != incarnation_of(&self.raft.snapshot(), key) {
            // A master of the queue's previous incarnation that has not stopped yet: this
            // round is the new queue's, which it does not ship for.
            return self.not_shipping(key);
        }
        let kept: Vec<IndexOp> = round
            .iter()
            .filter(|op| match op {
                IndexOp::Publish { persistent, .. } | IndexOp::Ack { persistent, .. } => {
                    *persistent
                }
                IndexOp::Deliver { .. } => true,
                // A queue's copies go with its metadata, never with a master's delete (a
                // deposed master deletes its own copy only).
                IndexOp::DeleteQueue => false,
            })
            .cloned()
            .collect();
        if kept.is_empty() {
            return None;
        }
        let handing_over = shipping.handing_over.clone();
        if handing_over.load(std::sync::atomic::Ordering::Acquire) {
            return Some(Box::pin(std::future::ready(false)));
        }
        // One GM message per 4 MiB of operations (or per bigger message): rounds pipeline,
        // and most GM messages go in one frame rather than in parts.
        let laps: Vec<_> = ops::split_round(kept, super::storage::SYNC_BATCH_BYTES)
            .into_iter()
            .map(|chunk| {
                let msg = MirrorMsg::Ops {
                    epoch: shipping.epoch,
                    ops: ops::encode(&chunk),
                };
                shipping
                    .sender
                    .confirmed_broadcast(Bytes::from(msg.encode()))
            })
            .collect();
        let (raft, me, key, epoch) = (self.raft.clone(), self.node, key.clone(), shipping.epoch);
        Some(Box::pin(async move {
            let mut all = true;
            for lap in laps {
                all &= lap.await.is_ok();
            }
            // A lap completes without a member that died meanwhile: if a promotion committed
            // while it ran (the new master may be the one that died), the round is not
            // confirmed, since the copy that now is the queue may lack it.
            let state = raft.snapshot();
            let still_master = state
                .mirror_sets
                .get(&key)
                .is_some_and(|s| s.epoch == epoch)
                && state
                    .vhosts
                    .get(&key.0)
                    .and_then(|v| v.queues.get(&key.1))
                    .is_some_and(|d| d.home == me);
            let handing = handing_over.load(std::sync::atomic::Ordering::Acquire);
            if !(all && still_master) || handing {
                tracing::debug!(queue = %key.1, laps_done = all, still_master, handing_over = handing, "a round is not confirmed");
            }
            all && still_master && !handing
        }))
    }

    /// The tap's answer for a round of a queue this node does not ship for (yet, or any
    /// more): while the metadata counts a mirror as synchronised it could be promoted, so
    /// nothing is confirmed that it does not have; and a node the queue moved away from (a
    /// deposed master whose broker has not dropped the queue yet) confirms nothing at all.
    fn not_shipping(&self, key: &Key) -> Option<LapWait> {
        let state = self.raft.snapshot();
        let fenced = lock(&self.fenced).get(key).copied();
        let refuse = state.mirror_sets.get(key).is_some_and(|s| {
            s.mirrors.iter().any(|m| m.synchronised)
                || self.home_of(&state, key) != Some(self.node)
                || fenced == Some((s.incarnation, s.epoch))
        });
        if refuse {
            tracing::debug!(queue = %key.1, "not shipping for the queue: its round is refused");
        }
        refuse.then(|| Box::pin(std::future::ready(false)) as LapWait)
    }

    /// Runs blocking storage work on the blocking pool, or on this task when `inline`;
    /// `None` if the work panicked.
    async fn offload<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        if self.inline {
            Some(f())
        } else {
            tokio::task::spawn_blocking(f).await.ok()
        }
    }

    /// Where a syncing mirror of `key` holds rounds that do not fit in memory.
    fn hold_path(&self, key: &Key) -> std::path::PathBuf {
        self.hold_dir.join(format!(
            "{}.hold",
            super::storage::queue_dir_name(&key.0, &key.1)
        ))
    }

    /// Whether the queue holds a message that is not in its persistent index (so is not
    /// mirrored): a transient message published before the queue became mirrored, in RAM
    /// or paged out to the transient index.
    fn holds_unindexed(&self, key: &Key) -> bool {
        self.broker
            .queue(&key.0, &key.1)
            .is_some_and(|h| h.lock().holds_unindexed())
            || self.storage.transient_len(&key.0, &key.1) > 0
    }

    fn home_of(&self, state: &MetaState, key: &Key) -> Option<NodeId> {
        state
            .vhosts
            .get(&key.0)
            .and_then(|v| v.queues.get(&key.1))
            .map(|d| d.home)
    }

    async fn apply(&self, key: &Key, incarnation: u64, batch: &[u8]) -> bool {
        self.apply_all(key, incarnation, &[batch]).await
    }

    /// Writes several rounds (in order) with one fsync.
    async fn apply_all(&self, key: &Key, incarnation: u64, batches: &[&[u8]]) -> bool {
        let mut ops = Vec::new();
        for batch in batches {
            match ops::decode(batch) {
                Ok(o) => ops.extend(o),
                Err(e) => {
                    tracing::error!(queue = %key.1, error = %e, "undecodable mirrored batch");
                    return false;
                }
            }
        }
        let storage = self.storage.clone();
        let (vhost, name) = key.clone();
        match self
            .offload(move || storage.apply_mirrored(&vhost, &name, incarnation, ops))
            .await
        {
            Some(Ok(())) => true,
            Some(Err(e)) => {
                tracing::error!(queue = %key.1, error = %e, "cannot write a mirrored batch");
                false
            }
            None => false,
        }
    }

    /// Drops this node's copy of incarnation `incarnation` (nothing else of the name).
    async fn drop_copy(&self, key: &Key, incarnation: u64) {
        let storage = self.storage.clone();
        let (vhost, name) = key.clone();
        if let Some(Err(e)) = self
            .offload(move || storage.drop_copy(&vhost, &name, incarnation))
            .await
        {
            tracing::error!(queue = %key.1, error = %e, "cannot drop a mirror copy");
        }
    }

    /// Starts an empty copy of incarnation `incarnation`; `false` if it cannot.
    async fn start_copy(&self, key: &Key, incarnation: u64) -> bool {
        let storage = self.storage.clone();
        let (vhost, name) = key.clone();
        match self
            .offload(move || storage.start_copy(&vhost, &name, incarnation))
            .await
        {
            Some(Ok(())) => true,
            Some(Err(e)) => {
                tracing::error!(queue = %key.1, error = %e, "cannot start a mirror copy");
                false
            }
            None => false,
        }
    }

    /// A mirror's handling of one delivered message; `false`: its copy cannot be trusted
    /// any more (it must leave and start again).
    async fn on_message(&self, key: &Key, m: &mut Membership, msg: &[u8]) -> bool {
        let me = m.handle.id();
        match MirrorMsg::decode(msg) {
            Some(MirrorMsg::Ops { ops, .. }) => match &mut m.mode {
                Mode::Waiting => true,
                Mode::Live => self.apply(key, m.incarnation, &ops).await,
                Mode::Syncing(held, _) => match held.push(ops) {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::error!(queue = %key.1, error = %e, "cannot hold a round during sync");
                        false
                    }
                },
            },
            Some(MirrorMsg::SyncStart {
                epoch,
                target,
                active,
                from_seq,
                sync,
            }) if target == me => {
                tracing::info!(queue = %key.1, from_seq, active, "mirror sync starts");
                if !self.start_copy(key, m.incarnation).await {
                    return false;
                }
                m.mode = if active {
                    Mode::Syncing(Held::new(self.hold_path(key)), (epoch, sync))
                } else {
                    Mode::Live
                };
                m.synced_by = (!active).then_some((epoch, sync));
                true
            }
            // A sync for this member whose start it never got (GM gives a joiner only what
            // is sent after its left neighbour saw it join): its copy is not what the master
            // thinks. It leaves without releasing this message, so the master cannot count
            // the sync complete, and starts over with a new member (and a new sync).
            Some(MirrorMsg::SyncBatch { target, .. } | MirrorMsg::SyncEnd { target, .. })
                if target == me && matches!(m.mode, Mode::Waiting) =>
            {
                tracing::warn!(queue = %key.1, "a sync for this mirror whose start it missed: starting over");
                false
            }
            // Batches of a sync this mirror is in; those of an aborted one are not.
            Some(MirrorMsg::SyncBatch {
                epoch,
                target,
                sync,
                ops,
            }) if target == me => match &m.mode {
                Mode::Syncing(_, current) if *current == (epoch, sync) => {
                    self.apply(key, m.incarnation, &ops).await
                }
                _ => true,
            },
            Some(MirrorMsg::SyncEnd {
                epoch,
                target,
                sync,
            }) if target == me
                && matches!(&m.mode, Mode::Syncing(_, current) if *current == (epoch, sync)) =>
            {
                if let Mode::Syncing(held, _) = std::mem::replace(&mut m.mode, Mode::Live) {
                    let held = match held.drain() {
                        Ok(h) => h,
                        Err(e) => {
                            tracing::error!(queue = %key.1, error = %e, "cannot read the held rounds back");
                            return false;
                        }
                    };
                    for batch in held {
                        if !self.apply(key, m.incarnation, &batch).await {
                            return false;
                        }
                    }
                    tracing::info!(queue = %key.1, "mirror holds the backlog");
                }
                m.synced_by = Some((epoch, sync));
                ack_sync(m, epoch, sync);
                true
            }
            // A natural sync's end, for the sync this mirror has followed since its start.
            Some(MirrorMsg::SyncEnd {
                epoch,
                target,
                sync,
            }) if target == me
                && matches!(m.mode, Mode::Live)
                && m.synced_by == Some((epoch, sync)) =>
            {
                ack_sync(m, epoch, sync);
                true
            }
            Some(_) => true,
            None => {
                tracing::warn!(queue = %key.1, "not a mirror message; ignored");
                true
            }
        }
    }

    /// A mirror's handling of one event: a delivered message is written, then released
    /// (never released when it could not be written).
    async fn follow_event(
        &self,
        key: &Key,
        m: &mut Membership,
        event: Option<Event<Bytes>>,
    ) -> Followed {
        match event {
            None | Some(Event::Stopped) => Followed::Stopped,
            Some(Event::Deliver { from, num, msg }) => {
                if from.node == m.master {
                    m.master_member = Some(from);
                }
                if !self.on_message(key, m, &msg).await {
                    return Followed::WriteFailed;
                }
                m.handle.release(from, num);
                Followed::Going
            }
            Some(ev) => {
                Self::track(m, &ev);
                Followed::Going
            }
        }
    }

    /// [`Self::follow_event`] for `first` and the events already waiting behind it: a run
    /// of rounds a live mirror writes is written with one fsync, then released (a mirror
    /// that falls behind catches up in fewer, larger writes instead of one fsync a round).
    async fn follow_events(
        &self,
        key: &Key,
        m: &mut Membership,
        first: Option<Event<Bytes>>,
    ) -> Followed {
        if first.is_none() {
            return Followed::Stopped;
        }
        let mut next = first;
        loop {
            // (origin, publish number, the round's operations)
            let mut run: Vec<(MemberId, crate::gm::PubNum, Vec<u8>)> = Vec::new();
            while matches!(m.mode, Mode::Live) {
                let (from, num, msg) = match next.take() {
                    Some(Event::Deliver { from, num, msg }) => (from, num, msg),
                    other => {
                        // Not a round (or nothing): handled below, in order.
                        next = other;
                        break;
                    }
                };
                match MirrorMsg::decode(&msg) {
                    Some(MirrorMsg::Ops { ops, .. }) => run.push((from, num, ops)),
                    _ => {
                        next = Some(Event::Deliver { from, num, msg });
                        break;
                    }
                }
                if run.len() >= 64 {
                    break;
                }
                next = m.handle.try_event();
            }
            if !run.is_empty() {
                let batches: Vec<&[u8]> = run.iter().map(|(_, _, ops)| ops.as_slice()).collect();
                if !self.apply_all(key, m.incarnation, &batches).await {
                    return Followed::WriteFailed;
                }
                for (from, num, _) in run {
                    if from.node == m.master {
                        m.master_member = Some(from);
                    }
                    m.handle.release(from, num);
                }
                if next.is_none() {
                    return Followed::Going;
                }
            }
            let Some(ev) = next.take() else {
                return Followed::Going;
            };
            match self.follow_event(key, m, Some(ev)).await {
                Followed::Going => {}
                other => return other,
            }
            next = m.handle.try_event();
            if next.is_none() {
                return Followed::Going;
            }
        }
    }

    fn track(m: &mut Membership, event: &Event<Bytes>) {
        match event {
            Event::Joined { members } => m.members = members.iter().copied().collect(),
            Event::MembersChanged { births, deaths } => {
                m.members.extend(births.iter().copied());
                for d in deaths {
                    m.members.remove(d);
                }
            }
            _ => {}
        }
    }

    async fn join(&self, key: &Key, incarnation: u64) -> Option<Membership> {
        match self
            .gm
            .join(&group_name(&key.0, &key.1, incarnation), true)
            .await
        {
            Ok(handle) => Some(Membership {
                handle,
                members: BTreeSet::new(),
                mode: Mode::Waiting,
                master: 0,
                master_member: None,
                incarnation,
                synced_by: None,
            }),
            Err(e) => {
                tracing::warn!(queue = %key.1, error = %e, "cannot join the queue's GM group");
                None
            }
        }
    }

    /// The mirror's life: a fresh, empty copy; every round written before it is released.
    /// Returns the membership when this node became the queue's home (a promotion).
    async fn run_mirror(&self, key: &Key) -> Option<Membership> {
        let state = self.raft.snapshot();
        let incarnation = incarnation_of(&state, key);
        // The copy starts empty, and a member releases what it cannot write yet (before
        // its sync starts): while the metadata still counts this mirror synchronised (a
        // write failed and recording that did not get through), its releases would let
        // confirms count on a copy that does not hold them, and it could be promoted.
        // So that is recorded first, however long it takes.
        while is_synchronised(&self.raft.snapshot(), key, self.node) {
            let now = self.raft.snapshot();
            if incarnation_of(&now, key) != incarnation
                || role_of(&now, &self.broker, key, self.node) != Role::Mirror
            {
                return None;
            }
            if self
                .set_synchronised(key, incarnation, None, self.node, false, None)
                .await
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if !self.start_copy(key, incarnation).await {
            return None;
        }
        let Some(mut m) = self.join(key, incarnation).await else {
            self.drop_copy(key, incarnation).await;
            return None;
        };
        tracing::debug!(queue = %key.1, member = ?m.handle.id(), "mirror joined the queue's group");
        let mut views = self.raft.subscribe();
        m.master = self.home_of(&state, key).unwrap_or(0);
        loop {
            tokio::select! {
                ev = m.handle.next_event() => match self.follow_events(key, &mut m, ev).await {
                    Followed::Going => {}
                    Followed::Stopped => {
                        tracing::info!(queue = %key.1, "mirror's GM member stopped");
                        return None;
                    }
                    Followed::WriteFailed => {
                        self.set_synchronised(key, m.incarnation, None, self.node, false, None)
                            .await;
                        leave(&mut m).await;
                        return None;
                    }
                },
                changed = views.changed() => {
                    if changed.is_err() {
                        return None;
                    }
                    let state = self.raft.snapshot();
                    if incarnation_of(&state, key) != m.incarnation {
                        // The queue was deleted (and maybe declared again): this copy is
                        // of a queue that is gone.
                        leave(&mut m).await;
                        self.drop_copy(key, m.incarnation).await;
                        return None;
                    }
                    let home = self.home_of(&state, key);
                    if home == Some(self.node) {
                        return Some(m);
                    }
                    if let Some(h) = home {
                        m.master = h;
                    }
                    if role_of(&state, &self.broker, key, self.node) != Role::Mirror {
                        leave(&mut m).await;
                        self.drop_copy(key, m.incarnation).await;
                        return None;
                    }
                }
            }
        }
    }

    /// Promotion: flush lap, then this node's copy becomes the queue. Returns the
    /// membership to go on as master with.
    async fn adopt(&self, key: &Key, mut member: Option<Membership>) -> Option<Membership> {
        let state = self.raft.snapshot();
        let epoch = state.mirror_sets.get(key).map_or(0, |s| s.epoch);
        let incarnation = incarnation_of(&state, key);
        if let Some(m) = member.as_ref().filter(|m| m.incarnation != incarnation) {
            // This node's copy is of a queue that is gone.
            self.drop_copy(key, m.incarnation).await;
            return member;
        }
        if let Some(m) = member.as_mut() {
            let lap = m
                .handle
                .sender()
                .confirmed_broadcast(Bytes::from(MirrorMsg::Flush { epoch }.encode()));
            tokio::pin!(lap);
            let flushed = loop {
                tokio::select! {
                    r = &mut lap => break r.is_ok(),
                    ev = m.handle.next_event() => {
                        if self.follow_event(key, m, ev).await != Followed::Going {
                            break false;
                        }
                    }
                }
            };
            if !flushed {
                tracing::warn!(queue = %key.1, "the promoted mirror's flush did not complete; serving its copy as it is");
                member = None;
            }
        }
        if let Some(m) = member.as_mut() {
            // A planned move: the old master is alive and may still ship rounds until it
            // sees the move. It leaves the group once they have all made their laps (so
            // this copy holds them): wait for that before the copy becomes the queue.
            let group = group_name(&key.0, &key.1, incarnation);
            let old = m.master;
            let mut views = self.raft.subscribe();
            loop {
                let state = self.raft.snapshot();
                if self.home_of(&state, key) != Some(self.node)
                    || incarnation_of(&state, key) != incarnation
                {
                    return None;
                }
                let old_alive = old != self.node
                    && state.gm_groups.get(&group).is_some_and(|g| {
                        match m.master_member.filter(|mm| mm.node == old) {
                            Some(mm) => g.members.contains(&Slot::Alive(mm)),
                            None => g.has_live_member_on(old),
                        }
                    });
                if !old_alive {
                    break;
                }
                tokio::select! {
                    changed = views.changed() => if changed.is_err() { return None },
                    ev = m.handle.next_event() => {
                        if self.follow_event(key, m, ev).await != Followed::Going {
                            return None;
                        }
                    }
                }
            }
        }
        // Rounds are shipped from the queue's first one on: the queue does not serve before
        // `adopt_queue`.
        if let Some(m) = &member {
            self.masters
                .insert(key.clone(), Shipping::of(&m.handle, epoch, incarnation));
        }
        // The broker applies the promotion shortly after the metadata does.
        for _ in 0..200 {
            let storage = self.storage.clone();
            let broker = self.broker.clone();
            let (vhost, name) = key.clone();
            let now = self.clock.now();
            let adopted = self
                .offload(move || {
                    broker.adopt_queue(&vhost, &name, now, |h| {
                        storage.adopt(h, incarnation).map(|_| ())
                    })
                })
                .await
                .flatten();
            match adopted {
                Some(Ok(h)) => {
                    let len = h.lock().message_count();
                    tracing::warn!(queue = %key.1, epoch, messages = len, "mirror promoted: this node is the queue's master");
                    return member;
                }
                Some(Err(e)) => {
                    tracing::error!(queue = %key.1, error = %e, "cannot open the promoted mirror's copy");
                    return None;
                }
                None if self.broker.queue(&key.0, &key.1).is_some() => return member,
                None => tokio::time::sleep(Duration::from_millis(25)).await,
            }
            if self
                .raft
                .snapshot()
                .vhosts
                .get(&key.0)
                .and_then(|v| v.queues.get(&key.1))
                .is_none_or(|d| d.home != self.node)
            {
                return None;
            }
        }
        None
    }

    /// Sets `node`'s synchronised flag (compare-and-set, retried). With `member`, only
    /// while that member is alive in the group (a mirror that restarted since is not the
    /// one that was synced).
    /// Records `node`'s mirror as (un)synchronised. `as_master`: the epoch this node masters
    /// the queue under; the change is made only while the metadata still says so (the
    /// compare-and-set on the set's version makes that hold when it commits), so a deposed
    /// master can neither vouch for a mirror nor unsync the new master's. `None`: a mirror
    /// giving up on its own copy (always allowed: it can only prevent a promotion).
    async fn set_synchronised(
        &self,
        key: &Key,
        incarnation: u64,
        member: Option<MemberId>,
        node: NodeId,
        synchronised: bool,
        as_master: Option<u64>,
    ) -> bool {
        for _ in 0..10 {
            let state = self.raft.snapshot();
            let Some(set) = state.mirror_sets.get(key) else {
                return false;
            };
            if set.incarnation != incarnation {
                // The queue is another one now: nothing about the old one's mirrors
                // applies to it.
                return false;
            }
            if let Some(epoch) = as_master {
                if self.home_of(&state, key) != Some(self.node) || set.epoch != epoch {
                    return false;
                }
            } else if node != self.node {
                return false;
            }
            if let Some(mid) = member {
                let alive = state
                    .gm_groups
                    .get(&group_name(&key.0, &key.1, incarnation))
                    .is_some_and(|g| g.members.contains(&Slot::Alive(mid)));
                if !alive {
                    return false;
                }
            }
            if !set.mirrors.iter().any(|m| m.node == node) {
                return false;
            }
            if set
                .mirrors
                .iter()
                .all(|m| m.node != node || m.synchronised == synchronised)
            {
                return true;
            }
            let mirrors: Vec<MirrorRecord> = set
                .mirrors
                .iter()
                .map(|m| MirrorRecord {
                    synchronised: if m.node == node {
                        synchronised
                    } else {
                        m.synchronised
                    },
                    ..*m
                })
                .collect();
            let cmd = Command::SetMirrors {
                vhost: key.0.clone(),
                queue: key.1.clone(),
                expected_version: set.version,
                mirrors,
            };
            match self.raft.propose(cmd).await {
                Ok(r) if r.outcome.is_ok() => {
                    tracing::info!(queue = %key.1, node, synchronised, "mirror state recorded");
                    return true;
                }
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        false
    }

    /// A master whose node restarted before it was recorded down: hands the queue to the
    /// oldest synchronised mirror whose member is still alive in the group on a node the
    /// failure detector sees running (its copy is the queue as the old master last shipped
    /// it), under a new epoch, as the reconciler would have after a `NodeDown`. Whether or
    /// not the promotion commits, this node's member is new, so no lap of the old one can
    /// complete. `false`: no such mirror, or the metadata moved on; serve from disk.
    async fn hand_over_after_restart(&self, key: &Key, state: &MetaState, set: &MirrorSet) -> bool {
        let Some(group) = state
            .gm_groups
            .get(&group_name(&key.0, &key.1, set.incarnation))
        else {
            return false;
        };
        if group.has_live_member_on(self.node) {
            // Not a restart the metadata knows of yet.
            return false;
        }
        let running: BTreeSet<NodeId> = set
            .mirrors
            .iter()
            .map(|m| m.node)
            .filter(|n| {
                *n != self.node && !self.broker.node_is_down(*n) && group.has_live_member_on(*n)
            })
            .collect();
        let Some(node) =
            crate::meta::promotion(&set.mirrors, &running, crate::meta::PromoteRule::WhenSynced)
        else {
            return false;
        };
        match self.raft.propose(promote_to(key, set, node)).await {
            Ok(r) if r.outcome.is_ok() => {
                tracing::warn!(
                    queue = %key.1,
                    to = node,
                    epoch = set.epoch + 1,
                    "restarted master hands its mirrored queue to a synchronised mirror"
                );
                true
            }
            _ => false,
        }
    }

    /// A master that joins its group afresh (not by promotion) cannot vouch for any
    /// mirror's copy: they all sync again.
    async fn unsync_all(&self, key: &Key, incarnation: u64, epoch: u64) {
        let nodes: Vec<NodeId> = self
            .raft
            .snapshot()
            .mirror_sets
            .get(key)
            .map(|s| s.mirrors.iter().map(|m| m.node).collect())
            .unwrap_or_default();
        for node in nodes {
            self.set_synchronised(key, incarnation, None, node, false, Some(epoch))
                .await;
        }
    }

    /// The master's life in the group, until it is no longer the master.
    async fn run_master(self: &Arc<Self>, key: &Key, member: Option<Membership>) {
        let fresh = member.is_none();
        let state = self.raft.snapshot();
        let Some(set) = state.mirror_sets.get(key).cloned() else {
            return;
        };
        let epoch = set.epoch;
        let incarnation = set.incarnation;
        if fresh && role_of(&state, &self.broker, key, self.node) != Role::Master {
            // The metadata moved on since the caller looked.
            return;
        }
        let mut m = match member {
            Some(mut m) if m.incarnation != incarnation => {
                // Promoted in a queue that is gone since.
                leave(&mut m).await;
                return;
            }
            Some(m) => m,
            None => {
                // A fresh master (its node restarted): its old member is gone. A mirror
                // that was synchronised with it holds everything it confirmed, transient
                // messages too, which its own disk does not: that mirror takes over, as it
                // would have had the node been recorded down first.
                if self.hand_over_after_restart(key, &state, &set).await {
                    return;
                }
                // Otherwise it serves from its disk, and what the mirrors were
                // synchronised with is gone.
                self.unsync_all(key, incarnation, epoch).await;
                let Some(mut m) = self.join(key, incarnation).await else {
                    return;
                };
                // The join committed after everything before it, and this node has applied
                // that far: if the queue moved on meanwhile (a deposed master restarting
                // its task from metadata that still named it home, before it applied the
                // promotion), this fresh member must not ship. Its laps would complete
                // through the group, and it would confirm what the new master never holds
                // (simulation seed 857: a confirmed message lost). After the join the
                // usual fence holds: no promotion while its member lives.
                let now = self.raft.snapshot();
                let still = self.home_of(&now, key) == Some(self.node)
                    && now
                        .mirror_sets
                        .get(key)
                        .is_some_and(|s| s.epoch == epoch && s.incarnation == incarnation);
                if !still {
                    tracing::info!(queue = %key.1, epoch, "the queue moved on while this node rejoined as its master: leaving");
                    leave(&mut m).await;
                    return;
                }
                m
            }
        };
        // Nothing goes out until a quorum read confirmed this master (`keep_leases`, woken
        // below for it, renews only queues it finds shipping).
        if let Some(h) = self.broker.queue(&key.0, &key.1) {
            h.lock()
                .set_lease(Some(crate::time::Instant::from_millis(0)));
        }
        // Shipping before unfenced: the tap never finds the queue neither shipped nor fenced.
        self.masters
            .insert(key.clone(), Shipping::of(&m.handle, epoch, incarnation));
        lock(&self.fenced).remove(key);
        self.lease_wake.notify_one();
        tracing::info!(queue = %key.1, epoch, "master of a mirrored queue");
        let mut syncs: BTreeMap<MemberId, SyncRun> = BTreeMap::new();
        let mut requests = (set.sync_requests, set.cancel_requests);
        let mut views = self.raft.subscribe();
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        let me = m.handle.id();
        // A promoted master knows its group already: unsynchronised mirrors start over.
        if !fresh {
            for mid in m.members.clone() {
                if mid != me && !is_synchronised(&state, key, mid.node) {
                    self.start_sync(key, &m, mid, epoch, &mut syncs, false)
                        .await;
                }
            }
        }
        loop {
            tokio::select! {
                ev = m.handle.next_event() => match ev {
                    None | Some(Event::Stopped) => {
                        // The member is gone (dead in the group record, or the host
                        // stopping): this epoch's confirms are over here.
                        lock(&self.fenced).insert(key.clone(), (incarnation, epoch));
                        break;
                    }
                    Some(Event::Deliver { from, num, msg }) => {
                        if let Some(MirrorMsg::SyncAck { epoch: e, sync }) = MirrorMsg::decode(&msg) {
                            for run in syncs.values_mut() {
                                if run.target == from && run.id == (e, sync) {
                                    run.acked = true;
                                }
                            }
                        }
                        m.handle.release(from, num)
                    }
                    Some(ev) => {
                        let before = m.members.clone();
                        Self::track(&mut m, &ev);
                        for mid in m.members.difference(&before).copied().collect::<Vec<_>>() {
                            if mid != me {
                                self.start_sync(key, &m, mid, epoch, &mut syncs, false).await;
                            }
                        }
                        syncs.retain(|mid, run| {
                            let keep = m.members.contains(mid);
                            if !keep {
                                run.abort();
                            }
                            keep
                        });
                    }
                },
                _ = tick.tick() => {
                    let sender = m.handle.sender();
                    // Syncs copy the index: while the queue holds a message that is not in
                    // it, no mirror holds everything.
                    let waiting = syncs.values().any(|r| !r.recorded);
                    let unindexed = waiting && self.holds_unindexed(key);
                    let done: Vec<MemberId> = syncs
                        .iter_mut()
                        .filter_map(|(mid, run)| {
                            (!run.recorded
                                && !unindexed
                                && run.complete(&self.storage, key, &sender))
                                .then_some(*mid)
                        })
                        .collect();
                    // A sync whose end made its lap but that its mirror never acknowledged:
                    // the mirror joined too late to get its start or its end (it would hold
                    // nothing). Started again: the member is in the ring now.
                    let unacked: Vec<(MemberId, bool)> = syncs
                        .iter()
                        .filter(|(_, run)| run.unacknowledged_for() > SYNC_ACK_WAIT)
                        .map(|(mid, run)| (*mid, run.was_active))
                        .collect();
                    for (mid, was_active) in unacked {
                        tracing::warn!(queue = %key.1, node = mid.node, "a sync's end made its lap but its mirror never acknowledged it: starting over");
                        if let Some(run) = syncs.remove(&mid) {
                            run.abort();
                        }
                        self.start_sync(key, &m, mid, epoch, &mut syncs, was_active).await;
                    }
                    for mid in done {
                        if self
                            .set_synchronised(key, incarnation, Some(mid), mid.node, true, Some(epoch))
                            .await
                        {
                            if let Some(run) = syncs.get_mut(&mid) {
                                run.recorded = true;
                            }
                        }
                    }
                }
                changed = views.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    let state = self.raft.snapshot();
                    if role_of(&state, &self.broker, key, self.node) != Role::Master
                        || incarnation_of(&state, key) != incarnation
                    {
                        break;
                    }
                    let Some(set) = state.mirror_sets.get(key) else { break };
                    // A mirror recorded unsynchronised again while its member stayed in the
                    // group (its node was dropped from the set and added back while cut off,
                    // so it never left): nothing else would start its sync.
                    let reset: Vec<MemberId> = m
                        .members
                        .iter()
                        .copied()
                        .filter(|mid| {
                            *mid != me
                                && set.mirrors.iter().any(|r| r.node == mid.node && !r.synchronised)
                                && syncs.get(mid).is_none_or(|run| run.recorded)
                        })
                        .collect();
                    for mid in reset {
                        if let Some(run) = syncs.remove(&mid) {
                            run.abort();
                        }
                        self.start_sync(key, &m, mid, epoch, &mut syncs, false).await;
                    }
                    if (set.sync_requests, set.cancel_requests) != requests {
                        let cancel = set.cancel_requests != requests.1;
                        requests = (set.sync_requests, set.cancel_requests);
                        // sync_queue restarts every unsynchronised mirror's sync as an active
                        // one; cancel_sync_queue stops active ones (they fall back to waiting
                        // for the old messages to go).
                        let targets: Vec<MemberId> = m
                            .members
                            .iter()
                            .copied()
                            .filter(|mid| *mid != me && !is_synchronised(&state, key, mid.node))
                            .filter(|mid| cancel == syncs.get(mid).is_some_and(|r| r.active()))
                            .collect();
                        for mid in targets {
                            if let Some(run) = syncs.remove(&mid) {
                                run.abort();
                            }
                            self.start_sync(key, &m, mid, epoch, &mut syncs, !cancel).await;
                        }
                    }
                }
            }
        }
        {
            // Removed first: `keep_leases` renews only a queue still shipping (checked under
            // the queue's lock), so the lease set here stands.
            self.masters.remove(key);
            if let Some(h) = self.broker.queue(&key.0, &key.1) {
                // Still the queue's node with no mirror left (a policy cleared): no one
                // can be promoted, so no lease is needed. Otherwise it stops serving now.
                let state = self.raft.snapshot();
                let unmirrored = self.home_of(&state, key) == Some(self.node)
                    && role_of(&state, &self.broker, key, self.node) == Role::None;
                h.lock()
                    .set_lease((!unmirrored).then_some(crate::time::Instant::from_millis(0)));
                if unmirrored {
                    kick(&self.broker, &h, self.clock.now());
                }
            }
        }
        for (_, run) in syncs {
            run.abort();
        }
        // Leave in good order (in-flight rounds first), so the others go on without a
        // timeout, and a promoted mirror knows no more rounds come from here. A deposed
        // master's member is dead already: that fails at once.
        leave(&mut m).await;
        tracing::info!(queue = %key.1, "no longer the master");
    }

    /// Starts `target`'s sync at this point of the stream (under the storage lock, so it is
    /// ordered with the rounds). Active when the policy says automatic or `sync_queue` asked.
    async fn start_sync(
        self: &Arc<Self>,
        key: &Key,
        m: &Membership,
        target: MemberId,
        epoch: u64,
        syncs: &mut BTreeMap<MemberId, SyncRun>,
        requested: bool,
    ) {
        let state = self.raft.snapshot();
        if !state
            .mirror_sets
            .get(key)
            .is_some_and(|s| s.mirrors.iter().any(|r| r.node == target.node))
        {
            return;
        }
        let policy = policy_of(&state, key);
        let active = requested
            || policy
                .as_ref()
                .is_some_and(|p| p.sync_mode == SyncMode::Automatic);
        let batch = policy.map_or(crate::meta::ha_policy::DEFAULT_SYNC_BATCH_SIZE, |p| {
            p.sync_batch_size
        }) as usize;
        let sender = m.handle.sender();
        let storage = self.storage.clone();
        let (vhost, name) = key.clone();
        let start_sender = sender.clone();
        let sync = self
            .next_sync
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let from_seq = self
            .offload(move || {
                storage.at_next_seq(&vhost, &name, |from_seq| {
                    let msg = MirrorMsg::SyncStart {
                        epoch,
                        target,
                        from_seq,
                        active,
                        sync,
                    };
                    let _ = start_sender.broadcast(Bytes::from(msg.encode()));
                    from_seq
                })
            })
            .await
            .unwrap_or(0);
        let copier = active.then(|| {
            let inner = self.clone();
            let key = key.clone();
            tokio::spawn(async move {
                inner
                    .copy_backlog(&key, sender, target, (epoch, sync), from_seq, batch.max(1))
                    .await
            })
        });
        syncs.insert(
            target,
            SyncRun {
                target,
                id: (epoch, sync),
                from_seq,
                copier,
                confirm: None,
                recorded: false,
                was_active: active,
                ended: None,
                acked: false,
            },
        );
    }

    /// Active sync: the backlog in batches, each sent once the one before has made its lap
    /// (flow control), while the queue goes on serving.
    async fn copy_backlog(
        &self,
        key: &Key,
        sender: GmSender,
        target: MemberId,
        (epoch, sync): (u64, u64),
        below: u64,
        batch: usize,
    ) -> bool {
        let mut from = 0;
        let started = std::time::Instant::now();
        let mut copied = 0usize;
        let progress = SyncProgress {
            metrics: self.broker.metrics().clone(),
            key: key.clone(),
        };
        progress.at(0, below);
        loop {
            let storage = self.storage.clone();
            let (vhost, name) = key.clone();
            let s = sender.clone();
            let step = self
                .offload(move || {
                    storage.sync_batch(&vhost, &name, from, below, batch, |ops, next| {
                        let n = ops
                            .iter()
                            .filter(|o| matches!(o, IndexOp::Publish { .. }))
                            .count();
                        let lap = (!ops.is_empty()).then(|| {
                            s.confirmed_broadcast(Bytes::from(
                                MirrorMsg::SyncBatch {
                                    epoch,
                                    target,
                                    sync,
                                    ops: ops::encode(&ops),
                                }
                                .encode(),
                            ))
                        });
                        (lap, next, n)
                    })
                })
                .await;
            let Some(Ok((lap, next, n))) = step else {
                tracing::warn!(queue = %key.1, "sync stopped: the backlog could not be read");
                return false;
            };
            if let Some(lap) = lap {
                if lap.await.is_err() {
                    return false;
                }
            }
            copied += n;
            match next {
                Some(n) => {
                    from = n;
                    progress.at(n, below);
                }
                None => break,
            }
        }
        let end = sender.confirmed_broadcast(Bytes::from(
            MirrorMsg::SyncEnd {
                epoch,
                target,
                sync,
            }
            .encode(),
        ));
        let ok = end.await.is_ok();
        tracing::info!(queue = %key.1, copied, took_ms = started.elapsed().as_millis() as u64, ok, "mirror sync copied the backlog");
        ok
    }
}

/// Tells the master this mirror holds the whole queue as of sync `(epoch, sync)`. Not
/// confirmed: a lost acknowledgement only makes the master start the sync again.
fn ack_sync(m: &Membership, epoch: u64, sync: u64) {
    let ack = MirrorMsg::SyncAck { epoch, sync }.encode();
    if let Err(e) = m.handle.sender().broadcast(Bytes::from(ack)) {
        tracing::debug!(error = %e, "cannot acknowledge a sync");
    }
}

/// Leaves the group, releasing what is delivered meanwhile (the drain waits for the
/// releases of a member with durable acks; nothing is written any more).
async fn leave(m: &mut Membership) {
    let done = m.handle.sender().leave();
    tokio::pin!(done);
    loop {
        tokio::select! {
            _ = &mut done => return,
            ev = m.handle.next_event() => match ev {
                None | Some(Event::Stopped) => return,
                Some(Event::Deliver { from, num, .. }) => m.handle.release(from, num),
                Some(_) => {}
            }
        }
    }
}

/// A running backlog copy as the metrics show it; gone from them when dropped, however
/// the copy ends.
struct SyncProgress {
    metrics: Arc<crate::metrics::Metrics>,
    key: Key,
}

impl SyncProgress {
    fn at(&self, next: u64, below: u64) {
        self.metrics
            .sync_progress(&self.key.0, &self.key.1, next, below);
    }
}

impl Drop for SyncProgress {
    fn drop(&mut self) {
        self.metrics.sync_ended(&self.key.0, &self.key.1);
    }
}

/// One mirror's sync, as its master runs it.
struct SyncRun {
    /// The mirror's member.
    target: MemberId,
    /// (epoch, sync id) of this sync.
    id: (u64, u64),
    /// Where the mirror's copy started.
    from_seq: u64,
    /// The backlog copier (active sync).
    copier: Option<JoinHandle<bool>>,
    /// A natural sync's closing `SyncEnd` lap: the mirror shows it follows (a mirror that
    /// missed its `SyncStart` leaves instead of releasing it).
    confirm: Option<JoinHandle<bool>>,
    /// Recorded synchronised in the metadata.
    recorded: bool,
    /// Started as an active sync (what a restart of it asks for again).
    was_active: bool,
    /// When its `SyncEnd` completed its lap (the copier's, or the natural sync's).
    ended: Option<std::time::Instant>,
    /// The mirror's [`MirrorMsg::SyncAck`] came.
    acked: bool,
}

impl SyncRun {
    fn active(&self) -> bool {
        self.copier.as_ref().is_some_and(|c| !c.is_finished())
    }

    fn abort(&self) {
        for c in self.copier.iter().chain(self.confirm.iter()) {
            c.abort();
        }
    }

    /// How long its `SyncEnd` has waited for the mirror's acknowledgement (zero: not
    /// ended, or acknowledged).
    fn unacknowledged_for(&self) -> Duration {
        match self.ended {
            Some(at) if !self.acked && !self.recorded => at.elapsed(),
            _ => Duration::ZERO,
        }
    }

    /// Whether the mirror holds everything: its `SyncEnd` completed its lap (after the
    /// active copy, or once the backlog before its start is gone in a natural sync) and
    /// the mirror acknowledged it.
    fn complete<D: StorageDisk>(
        &mut self,
        storage: &Storage<D>,
        key: &Key,
        sender: &GmSender,
    ) -> bool {
        if self.ended.is_none() && self.lap_complete(storage, key, sender) {
            self.ended = Some(std::time::Instant::now());
        }
        self.ended.is_some() && self.acked
    }

    /// Whether the sync's `SyncEnd` completed its lap (sending a natural sync's once its
    /// backlog is gone).
    fn lap_complete<D: StorageDisk>(
        &mut self,
        storage: &Storage<D>,
        key: &Key,
        sender: &GmSender,
    ) -> bool {
        if let Some(c) = &mut self.copier {
            if !c.is_finished() {
                return false;
            }
            // A finished copier: its result, once.
            let ok = finished_result(c);
            self.copier = None;
            if ok {
                return true;
            }
        }
        if let Some(c) = &mut self.confirm {
            if !c.is_finished() {
                return false;
            }
            let ok = finished_result(c);
            self.confirm = None;
            // Not confirmed: sent again at the next look.
            return ok;
        }
        let drained = storage
            .low_seq(&key.0, &key.1)
            .is_none_or(|low| low >= self.from_seq);
        if drained {
            let (epoch, sync) = self.id;
            let lap = sender.confirmed_broadcast(Bytes::from(
                MirrorMsg::SyncEnd {
                    epoch,
                    target: self.target,
                    sync,
                }
                .encode(),
            ));
            self.confirm = Some(tokio::spawn(async move { lap.await.is_ok() }));
        }
        false
    }
}

/// The result of a finished task (`false` when it failed or was aborted).
fn finished_result(task: &mut JoinHandle<bool>) -> bool {
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    matches!(
        std::pin::Pin::new(task).poll(&mut cx),
        std::task::Poll::Ready(Ok(true))
    )
}

/// The queue's `ha-*` policy, if it has one.
fn policy_of(state: &MetaState, key: &Key) -> Option<HaPolicy> {
    let v = state.vhosts.get(&key.0)?;
    let def = v.queues.get(&key.1)?;
    HaPolicy::of(
        &v.effective_policy(&key.1, true),
        def.exclusive_owner.is_some(),
    )
}

/// The command that makes `node`'s mirror the master of `key`, under the next epoch of `set`.
fn promote_to(key: &Key, set: &MirrorSet, node: NodeId) -> Command {
    Command::promote(&key.0, &key.1, set, node)
}

fn is_synchronised(state: &MetaState, key: &Key, node: NodeId) -> bool {
    state
        .mirror_sets
        .get(key)
        .is_some_and(|s| s.mirrors.iter().any(|m| m.node == node && m.synchronised))
}

/// One task per queue this node has a part in.
async fn queue_task<N: GmNet + Clone, D: StorageDisk>(inner: Arc<Inner<N, D>>, key: Key) {
    loop {
        let state = inner.raft.snapshot();
        match role_of(&state, &inner.broker, &key, inner.node) {
            Role::None => return,
            Role::Adopt => {
                if let Some(m) = inner.adopt(&key, None).await {
                    drop(m);
                }
                if inner.broker.queue(&key.0, &key.1).is_none() {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            Role::Master => inner.run_master(&key, None).await,
            Role::Mirror => {
                if let Some(m) = inner.run_mirror(&key).await {
                    let member = inner.adopt(&key, Some(m)).await;
                    let state = inner.raft.snapshot();
                    match (member, role_of(&state, &inner.broker, &key, inner.node)) {
                        (Some(m), Role::Master) => inner.run_master(&key, Some(m)).await,
                        (Some(mut m), _) => {
                            inner.masters.remove(&key);
                            leave(&mut m).await;
                        }
                        (None, _) => {
                            inner.masters.remove(&key);
                        }
                    }
                } else {
                    // Left, stopped or failed: look again shortly (a restart rejoins).
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}

/// Starts a queue task for every queue this node has a part in.
async fn supervise<N: GmNet + Clone, D: StorageDisk>(inner: Arc<Inner<N, D>>) {
    let mut views = inner.raft.subscribe();
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        let state = inner.raft.snapshot();
        {
            let mut tasks = lock(&inner.tasks);
            tasks.retain(|_, t| !t.is_finished());
            for key in state.mirror_sets.keys() {
                if tasks.contains_key(key) {
                    continue;
                }
                if role_of(&state, &inner.broker, key, inner.node) != Role::None {
                    let span = tracing::info_span!("mirror", node = inner.node, vhost = %key.0, queue = %key.1);
                    let task = tokio::spawn(tracing::Instrument::instrument(
                        queue_task(inner.clone(), key.clone()),
                        span,
                    ));
                    tasks.insert(key.clone(), task);
                }
            }
        }
        tokio::select! {
            r = views.changed() => if r.is_err() { return },
            _ = tick.tick() => {}
        }
    }
}

/// Delivers what consumers can take now (after a lease was renewed or lifted).
fn kick(broker: &Broker, h: &Arc<crate::broker::QueueHandle>, now: crate::time::Instant) {
    let mut dead = Vec::new();
    h.lock().deliver(h, now, &mut dead);
    if !dead.is_empty() {
        broker.dead_letter(h, dead, now);
    }
}

/// Renews the leases of the queues this node masters. A quorum read started at `t0`
/// (`MetaRaft::quorum_snapshot`: the leader confirms its leadership with heartbeats sent
/// after the request reached it) that still shows this node as the queue's home and its
/// member alive in the group means no promotion had committed at `t0`. One needs the node
/// recorded down first, which a leader does only after the failure detector's timeout
/// without hearing from it (the read request was heard at or after `t0`), and a new leader
/// only after leading that long. So the master may serve until `t0 + lease`, the lease
/// being under that timeout.
async fn keep_leases<N: GmNet + Clone, D: StorageDisk>(inner: Arc<Inner<N, D>>) {
    let lease_ms = inner.lease.as_millis() as u64;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(inner.lease / 3) => {}
            _ = inner.lease_wake.notified() => {}
        }
        if inner.masters.is_empty() {
            continue;
        }
        let t0 = inner.clock.now();
        let Ok(state) = inner.raft.quorum_snapshot(inner.lease).await else {
            continue;
        };
        let shipping = inner.masters.all();
        let mut renewed = Vec::new();
        for (key, shipping) in shipping {
            let still = inner.home_of(&state, &key) == Some(inner.node)
                && incarnation_of(&state, &key) == shipping.incarnation
                && state
                    .gm_groups
                    .get(&group_name(&key.0, &key.1, shipping.incarnation))
                    .is_some_and(|g| g.members.contains(&Slot::Alive(shipping.member)));
            if !still {
                continue;
            }
            if let Some(h) = inner.broker.queue(&key.0, &key.1) {
                let mut q = h.lock();
                // Checked under the queue's lock: a master that stopped meanwhile (and
                // fenced the queue after leaving the map) is not renewed.
                let current = inner
                    .masters
                    .get(&key)
                    .is_some_and(|s| s.member == shipping.member && s.epoch == shipping.epoch);
                if current {
                    q.set_lease(Some(t0.plus_millis(lease_ms)));
                    drop(q);
                    renewed.push(h);
                }
            }
        }
        // Consumers that waited while the lease ran out get their messages now.
        let now = inner.clock.now();
        for h in renewed {
            kick(&inner.broker, &h, now);
        }
    }
}

/// On the leader: mirror sets follow policies and running nodes; a master recorded down
/// hands over to a mirror (`mirror::reconcile::plan`).
async fn reconcile<N: GmNet + Clone, D: StorageDisk>(inner: Arc<Inner<N, D>>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    let mut views = inner.raft.subscribe();
    loop {
        // On every metadata change (a node recorded down: promote now) and on the tick
        // (the failure detector's view of running nodes is not in the metadata).
        tokio::select! {
            _ = tick.tick() => {}
            changed = views.changed() => if changed.is_err() { return },
        }
        if !inner.raft.is_leader() {
            continue;
        }
        let running = |state: &MetaState| -> BTreeSet<NodeId> {
            state
                .nodes
                .keys()
                .copied()
                .filter(|id| *id == inner.node || !inner.broker.node_is_down(*id))
                .collect()
        };
        if crate::mirror::reconcile::plan(&inner.raft.snapshot(), &running(&inner.raft.snapshot()))
            .is_empty()
        {
            continue;
        }
        // Decisions are taken from state a quorum confirmed this node leads.
        let Ok(state) = inner.raft.linearizable_snapshot().await else {
            continue;
        };
        let running = running(&state);
        for cmd in crate::mirror::reconcile::plan(&state, &running) {
            if let Command::PromoteMirror { vhost, queue, .. }
            | Command::PromoteSyncedMirror { vhost, queue, .. } = &cmd
            {
                // Only once the old master's member is dead in the group (its node recorded
                // down or restarted): a master that still counts as a member could still
                // complete laps, and two masters must never both confirm.
                let old = state
                    .vhosts
                    .get(vhost)
                    .and_then(|v| v.queues.get(queue))
                    .map_or(0, |d| d.home);
                let key = (vhost.clone(), queue.clone());
                let still_member = !running.contains(&old)
                    && state
                        .gm_groups
                        .get(&group_of(&state, &key))
                        .is_some_and(|g| g.has_live_member_on(old));
                if still_member {
                    continue;
                }
                tracing::warn!(vhost = %vhost, queue = %queue, command = ?cmd, "promoting a mirror");
            }
            if let Command::SetMirrors { queue, mirrors, .. } = &cmd {
                tracing::debug!(queue = %queue, mirrors = ?mirrors.iter().map(|m| m.node).collect::<Vec<_>>(), "setting a queue's mirrors");
            }
            if let Err(e) = inner.raft.propose(cmd).await {
                tracing::debug!(error = %e, "mirror reconciliation step not applied");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_rounds_come_back_in_order_from_memory_then_the_file() {
        let dir = std::env::temp_dir().join(format!("warren-held-{}", std::process::id()));
        let path = dir.join("q.hold");
        let mut held = Held::with_limit(path.clone(), 10);
        let batches: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i; (i as usize) % 7]).collect();
        for b in &batches {
            held.push(b.clone()).expect("held");
        }
        assert!(path.exists(), "past the limit, rounds go to the file");
        assert_eq!(held.drain().expect("read back"), batches);
        assert!(!path.exists(), "the file goes once read back");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_master_with_mirrors_masters_and_a_listed_node_mirrors() {
        use crate::config::Config;
        use crate::meta::state::{MirrorRecord, NodeRecord, QueueDef};
        let broker = Broker::new(&Config::default(), 1, 1 << 30, 0).with_node_id(1);
        let mut state = MetaState::default();
        state
            .apply(&Command::AddVhost { name: "/".into() })
            .unwrap();
        for id in 1..=3 {
            state
                .apply(&Command::RegisterNode(NodeRecord {
                    id,
                    name: format!("n{id}"),
                    amqp: String::new(),
                    admin: String::new(),
                    link: String::new(),
                    incarnation: 0,
                }))
                .unwrap();
        }
        for (name, exclusive) in [("d", None), ("x", Some(1 << 40))] {
            state
                .apply(&Command::DeclareQueue(QueueDef {
                    vhost: "/".into(),
                    name: name.into(),
                    durable: false,
                    exclusive_owner: exclusive,
                    auto_delete: false,
                    arguments: Default::default(),
                    home: 1,
                }))
                .unwrap();
        }
        let key = ("/".to_string(), "d".to_string());
        assert_eq!(
            role_of(&state, &broker, &key, 1),
            Role::None,
            "no mirrors yet"
        );
        state
            .apply(&Command::SetMirrors {
                vhost: "/".into(),
                queue: "d".into(),
                expected_version: 0,
                mirrors: vec![MirrorRecord {
                    node: 2,
                    since: 0,
                    synchronised: false,
                }],
            })
            .unwrap();
        broker.follow(
            std::sync::Arc::new(state.clone()),
            crate::time::Instant::default(),
        );
        assert_eq!(role_of(&state, &broker, &key, 1), Role::Master);
        assert_eq!(role_of(&state, &broker, &key, 2), Role::Mirror);
        assert_eq!(role_of(&state, &broker, &key, 3), Role::None);
        let x = ("/".to_string(), "x".to_string());
        assert_eq!(role_of(&state, &broker, &x, 1), Role::None, "exclusive");
        // Promoted to node 2, whose broker does not run the queue: it adopts its copy.
        let other = Broker::new(&Config::default(), 1, 1 << 30, 0)
            .with_durability(std::sync::Arc::new(crate::broker::Durability::default()))
            .with_node_id(2);
        let mut before = state.clone();
        before
            .apply(&Command::PromoteMirror {
                vhost: "/".into(),
                queue: "d".into(),
                expected_epoch: 0,
                node: 2,
            })
            .unwrap();
        other.follow(
            std::sync::Arc::new(state.clone()),
            crate::time::Instant::default(),
        );
        other.follow(
            std::sync::Arc::new(before.clone()),
            crate::time::Instant::default(),
        );
        assert!(
            other.queue("/", "d").is_none(),
            "a queue that moved in is not created empty"
        );
        assert_eq!(role_of(&before, &other, &key, 2), Role::Adopt);
    }
}
