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
//!
//! This file holds the host, its shared state and the storage tap; the roles and tasks are
//! in `master`, `mirror`, `promotion`, `tasks`, `sync`, `held` (a syncing mirror's
//! held-back rounds) and `batch_writer` (its backlog batches written beside its loop). The
//! sync protocol's decisions are in the sans-IO cores `mirror::role` and `mirror::master`,
//! the lease's and a restarted master's hand-over in `mirror::lease`; this code carries
//! them out.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use tokio::task::JoinHandle;

use super::clock::Clock;
use super::file_disk::FileDisk;
use super::gm_host::{GmHandle, GmHost, GmNet};
use super::storage::{LapWait, Storage};
use crate::broker::queue::IndexOp;
use crate::broker::Broker;
use crate::gm::MemberId;
use crate::meta::state::MirrorSet;
use crate::meta::HaPolicy;
use crate::meta::{Command, MetaState};
use crate::mirror::confirm;
use crate::mirror::message::{group_name, MirrorMsg};
use crate::mirror::ops;
use crate::mirror::role::MirrorRole;
use crate::runtime::raft::{MetaRaft, NodeId};

type Key = (String, String);

/// The disks a mirror host's storage may use (the node's files; the simulation's memory).
pub trait StorageDisk: crate::store::Disk + Clone + Send + Sync + 'static {}
impl<D: crate::store::Disk + Clone + Send + Sync + 'static> StorageDisk for D {}
use crate::store::Disk;

mod batch_writer;
mod held;
mod master;
mod mirror;
mod promotion;
mod shipping;
mod sync;
mod tasks;
#[cfg(test)]
mod tests;

use held::Held;
use shipping::{Shippers, Shipping};
use tasks::{keep_leases, reconcile, supervise};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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

/// How long a master waits for a mirror's answer to a sync's start (and, in the core, for
/// its acknowledgement of a sync whose end made its lap).
const SYNC_ACK_WAIT: Duration = Duration::from_millis(crate::mirror::master::SYNC_ACK_WAIT_MS);

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
    /// Its side of the sync protocol ([`MirrorRole`]).
    role: MirrorRole,
    /// The rounds an active sync holds back (the role's `BeginHold` to its `ApplyHeld`).
    held: Option<Held>,
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
    /// The generation the mirror took before it read the metadata that made it one: its
    /// copy's (`Storage::start_copy`).
    since: u64,
    /// Time spent comparing a kept copy with the master's summaries in the current sync.
    compare_time: Duration,
    /// The active sync's backlog batches being written beside the loop.
    writer: Option<batch_writer::BatchWriter>,
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
                    ops: Bytes::new(),
                };
                shipping
                    .sender
                    .confirmed_broadcast(Bytes::from(ops::encode_message(&msg, &chunk)))
            })
            .collect();
        let (raft, me, key, epoch) = (self.raft.clone(), self.node, key.clone(), shipping.epoch);
        Some(Box::pin(async move {
            let mut laps_done = true;
            for lap in laps {
                laps_done &= lap.await.is_ok();
            }
            let shipped = confirm::Shipped {
                node: me,
                epoch,
                laps_done,
                handing_over: handing_over.load(std::sync::atomic::Ordering::Acquire),
            };
            let confirmed = confirm::confirms(&raft.snapshot(), &key.0, &key.1, &shipped);
            if !confirmed {
                tracing::debug!(queue = %key.1, ?shipped, "a round is not confirmed");
            }
            confirmed
        }))
    }

    /// The tap's answer for a round of a queue this node does not ship for (yet, or any
    /// more): refused or confirmed on the node's own disk, as `mirror::confirm` rules.
    fn not_shipping(&self, key: &Key) -> Option<LapWait> {
        let state = self.raft.snapshot();
        let fenced = lock(&self.fenced).get(key).copied();
        let refuse = confirm::refuse_unshipped(&state, &key.0, &key.1, self.node, fenced);
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
