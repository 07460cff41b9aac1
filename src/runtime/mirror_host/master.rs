//! The master role: ship each round to the mirrors and hold its confirms for the lap, keep
//! the lease, start each new mirror's sync (the backlog copied in batches while the queue
//! serves) and record it synchronised once the mirror acknowledged it.

use std::collections::BTreeMap;
use std::future::Future as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::mirror::leave;
use super::tasks::kick;
use super::{
    incarnation_of, is_synchronised, lock, policy_of, role_of, Inner, Key, Membership, Role,
    Shipping, StorageDisk, SYNC_ACK_WAIT,
};
use crate::broker::queue::IndexOp;
use crate::gm::Event;
use crate::gm::MemberId;
use crate::gm::Slot;
use crate::meta::state::MirrorRecord;
use crate::meta::Command;
use crate::meta::NodeId;
use crate::meta::SyncMode;
use crate::mirror::message::group_name;
use crate::mirror::message::MirrorMsg;
use crate::mirror::ops;
use crate::runtime::gm_host::GmNet;
use crate::runtime::gm_host::GmSender;
use crate::runtime::storage::Storage;
use tokio::task::JoinHandle;

impl<N: GmNet + Clone, D: StorageDisk> Inner<N, D> {
    /// Sets `node`'s synchronised flag (compare-and-set, retried). With `member`, only
    /// while that member is alive in the group (a mirror that restarted since is not the
    /// one that was synced).
    /// Records `node`'s mirror as (un)synchronised. `as_master`: the epoch this node masters
    /// the queue under; the change is made only while the metadata still says so (the
    /// compare-and-set on the set's version makes that hold when it commits), so a deposed
    /// master can neither vouch for a mirror nor unsync the new master's. `None`: a mirror
    /// giving up on its own copy (always allowed: it can only prevent a promotion).
    pub(super) async fn set_synchronised(
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

    /// The master's life in the group, until it is no longer the master.
    pub(super) async fn run_master(self: &Arc<Self>, key: &Key, member: Option<Membership>) {
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
                // A master starts no copy: no generation.
                let Some(mut m) = self.join(key, incarnation, 0).await else {
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
                        match MirrorMsg::decode(&msg) {
                            Some(MirrorMsg::SyncAck { epoch: e, sync }) => {
                                for run in syncs.values_mut() {
                                    if run.target == from && run.id == (e, sync) {
                                        run.acked = true;
                                        // Recorded at the next tick: now, not up to 200 ms on.
                                        tick.reset_immediately();
                                    }
                                }
                            }
                            Some(MirrorMsg::SyncWant { epoch: e, sync, from: seq }) => {
                                for run in syncs.values_mut() {
                                    if run.target == from && run.id == (e, sync) {
                                        if let Some(tx) = run.want.take() {
                                            let _ = tx.send(seq);
                                        }
                                    }
                                }
                            }
                            Some(MirrorMsg::SyncHave { epoch: e, sync, copy_next }) => {
                                for run in syncs.values_mut() {
                                    if run.target == from && run.id == (e, sync) {
                                        if let Some(tx) = run.have.take() {
                                            let _ = tx.send(copy_next);
                                        }
                                    }
                                }
                            }
                            _ => {}
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
    pub(super) async fn start_sync(
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
        let (want_tx, want_rx) = tokio::sync::oneshot::channel();
        let (have_tx, have_rx) = tokio::sync::oneshot::channel();
        let copier = active.then(|| {
            let inner = self.clone();
            let key = key.clone();
            tokio::spawn(async move {
                inner
                    .copy_backlog(
                        &key,
                        sender,
                        target,
                        (epoch, sync),
                        from_seq,
                        batch.max(1),
                        (have_rx, want_rx),
                    )
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
                want: active.then_some(want_tx),
                have: active.then_some(have_tx),
            },
        );
    }

    /// Active sync: summaries of what a mirror's kept copy holds (if it kept one), until
    /// the mirror says from where it needs the backlog, then the backlog from there in
    /// batches, each sent once the one before has made its lap (flow control), while the
    /// queue goes on serving.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn copy_backlog(
        &self,
        key: &Key,
        sender: GmSender,
        target: MemberId,
        (epoch, sync): (u64, u64),
        below: u64,
        batch: usize,
        answers: (
            tokio::sync::oneshot::Receiver<u64>,
            tokio::sync::oneshot::Receiver<u64>,
        ),
    ) -> bool {
        let Some(mut from) = self
            .send_summaries(key, &sender, target, (epoch, sync), below, answers)
            .await
        else {
            tracing::info!(queue = %key.1, "sync: the mirror never said what it needs");
            return false;
        };
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

impl<N: GmNet + Clone, D: StorageDisk> Inner<N, D> {
    /// The mirror's answer to the sync's start: [`MirrorMsg::SyncWant`] at once (nothing
    /// kept), or [`MirrorMsg::SyncHave`] (a copy kept below `copy_next`). Then summaries
    /// of `[0, copy_next)` (no ids, no bodies: `mirror::digest`) in batches with flow
    /// control, until its `SyncWant` says from which seq it needs the backlog. `None`: a
    /// summary could not be read or sent, or an answer did not come.
    async fn send_summaries(
        &self,
        key: &Key,
        sender: &GmSender,
        target: MemberId,
        (epoch, sync): (u64, u64),
        below: u64,
        (have, mut want): (
            tokio::sync::oneshot::Receiver<u64>,
            tokio::sync::oneshot::Receiver<u64>,
        ),
    ) -> Option<u64> {
        let copy_next = tokio::select! {
            from = &mut want => return from.ok(),
            next = have => next.ok()?,
            _ = tokio::time::sleep(SYNC_ACK_WAIT) => return None,
        };
        let end = copy_next.min(below);
        let (mut lo, mut read_time) = (0, std::time::Duration::ZERO);
        let started = std::time::Instant::now();
        let report = |read_time: std::time::Duration| {
            let (read_ms, took_ms) = (
                read_time.as_millis() as u64,
                started.elapsed().as_millis() as u64,
            );
            tracing::info!(queue = %key.1, copy_next, read_ms, took_ms, "mirror sync summarised the kept copy's range");
        };
        // Laps of the summaries out: a few at once, so the master reads the next range
        // while the mirror compares the last one.
        let mut laps = std::collections::VecDeque::new();
        while lo < end {
            if let Ok(from) = want.try_recv() {
                report(read_time);
                return Some(from);
            }
            let storage = self.storage.clone();
            let (vhost, name) = key.clone();
            let s = sender.clone();
            let step = self
                .offload(move || {
                    let read = std::time::Instant::now();
                    storage.sync_summary(&vhost, &name, lo, end, SUMMARY_SPAN, |summary, next| {
                        let took = read.elapsed();
                        let msg = MirrorMsg::SyncSummary {
                            epoch,
                            target,
                            sync,
                            summary,
                        };
                        (s.confirmed_broadcast(Bytes::from(msg.encode())), next, took)
                    })
                })
                .await;
            let Some(Ok((lap, next, took))) = step else {
                tracing::warn!(queue = %key.1, "sync stopped: the backlog's summary could not be read");
                return None;
            };
            read_time += took;
            laps.push_back(lap);
            while laps.len() >= SUMMARY_LAPS || (next.is_none() && !laps.is_empty()) {
                let Some(lap) = laps.pop_front() else { break };
                tokio::select! {
                    done = lap => if done.is_err() {
                        return None;
                    },
                    from = &mut want => {
                        report(read_time);
                        return from.ok();
                    }
                }
            }
            match next {
                Some(n) => lo = n,
                None => break,
            }
        }
        // The last summary made its lap, so the mirror compared it (before releasing it)
        // and sent its answer.
        let from = tokio::time::timeout(SYNC_ACK_WAIT, want).await.ok()?.ok();
        report(read_time);
        from
    }
}

/// Summaries out at once (each waits for its lap before the one this many after it).
const SUMMARY_LAPS: usize = 4;

/// Seqs one summary covers: four index segments of the default geometry, so the storage
/// lock is held for four segments' reads (bodies below 4 KiB are in the index), and the
/// message is about 16 KB (two bits a seq).
const SUMMARY_SPAN: u64 = 65_536;

/// A running backlog copy as the metrics show it; gone from them when dropped, however
/// the copy ends.
pub(super) struct SyncProgress {
    metrics: Arc<crate::metrics::Metrics>,
    key: Key,
}

impl SyncProgress {
    pub(super) fn at(&self, next: u64, below: u64) {
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
pub(super) struct SyncRun {
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
    /// Where the copier learns from which seq the mirror needs the backlog (its
    /// [`MirrorMsg::SyncWant`]); taken when it comes.
    want: Option<tokio::sync::oneshot::Sender<u64>>,
    /// Where the copier learns up to which seq the mirror kept a copy (its
    /// [`MirrorMsg::SyncHave`]); taken when it comes.
    have: Option<tokio::sync::oneshot::Sender<u64>>,
}

impl SyncRun {
    pub(super) fn active(&self) -> bool {
        self.copier.as_ref().is_some_and(|c| !c.is_finished())
    }

    pub(super) fn abort(&self) {
        for c in self.copier.iter().chain(self.confirm.iter()) {
            c.abort();
        }
    }

    /// How long its `SyncEnd` has waited for the mirror's acknowledgement (zero: not
    /// ended, or acknowledged).
    pub(super) fn unacknowledged_for(&self) -> Duration {
        match self.ended {
            Some(at) if !self.acked && !self.recorded => at.elapsed(),
            _ => Duration::ZERO,
        }
    }

    /// Whether the mirror holds everything: its `SyncEnd` completed its lap (after the
    /// active copy, or once the backlog before its start is gone in a natural sync) and
    /// the mirror acknowledged it.
    pub(super) fn complete<D: StorageDisk>(
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
    pub(super) fn lap_complete<D: StorageDisk>(
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
pub(super) fn finished_result(task: &mut JoinHandle<bool>) -> bool {
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    matches!(
        std::pin::Pin::new(task).poll(&mut cx),
        std::task::Poll::Ready(Ok(true))
    )
}
