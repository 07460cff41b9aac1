//! The master's side of a mirror's sync: the start (ordered with the rounds), the summaries
//! that tell which part of its kept copy the mirror lacks, the backlog copied in batches
//! while the queue serves, and the run's bookkeeping until the mirror acknowledges it.

use std::collections::BTreeMap;
use std::future::Future as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::{policy_of, Inner, Key, Membership, StorageDisk, SYNC_ACK_WAIT};
use crate::broker::queue::IndexOp;
use crate::gm::MemberId;
use crate::meta::SyncMode;
use crate::mirror::message::MirrorMsg;
use crate::mirror::ops;
use crate::runtime::gm_host::GmNet;
use crate::runtime::gm_host::GmSender;
use crate::runtime::storage::Storage;
use tokio::task::JoinHandle;

impl<N: GmNet + Clone, D: StorageDisk> Inner<N, D> {
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
    pub(super) target: MemberId,
    /// (epoch, sync id) of this sync.
    pub(super) id: (u64, u64),
    /// Where the mirror's copy started.
    from_seq: u64,
    /// The backlog copier (active sync).
    copier: Option<JoinHandle<bool>>,
    /// A natural sync's closing `SyncEnd` lap: the mirror shows it follows (a mirror that
    /// missed its `SyncStart` leaves instead of releasing it).
    confirm: Option<JoinHandle<bool>>,
    /// Recorded synchronised in the metadata.
    pub(super) recorded: bool,
    /// Started as an active sync (what a restart of it asks for again).
    pub(super) was_active: bool,
    /// When its `SyncEnd` completed its lap (the copier's, or the natural sync's).
    ended: Option<std::time::Instant>,
    /// The mirror's [`MirrorMsg::SyncAck`] came.
    pub(super) acked: bool,
    /// Where the copier learns from which seq the mirror needs the backlog (its
    /// [`MirrorMsg::SyncWant`]); taken when it comes.
    pub(super) want: Option<tokio::sync::oneshot::Sender<u64>>,
    /// Where the copier learns up to which seq the mirror kept a copy (its
    /// [`MirrorMsg::SyncHave`]); taken when it comes.
    pub(super) have: Option<tokio::sync::oneshot::Sender<u64>>,
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
