//! The master's side of a mirror's sync, as I/O: carries out the sync core's actions
//! (`mirror::master`): the start (ordered with the rounds), the summaries that tell which
//! part of its kept copy the mirror lacks, the backlog copied in batches while the queue
//! serves, the closing lap and the record; each task reports back to the core.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;

use super::{policy_of, Inner, Key, Membership, StorageDisk, SYNC_ACK_WAIT};
use crate::broker::queue::IndexOp;
use crate::gm::MemberId;
use crate::mirror::master::{Action, Answer, MasterRole, Why};
use crate::mirror::message::MirrorMsg;
use crate::mirror::ops;
use crate::mirror::role::SyncId;
use crate::runtime::gm_host::GmNet;
use crate::runtime::gm_host::GmSender;
use crate::runtime::storage::SyncCursor;
use tokio::task::JoinHandle;

impl<N: GmNet + Clone, D: StorageDisk> Inner<N, D> {
    /// Carries out the sync core's actions until it has none: the master's loop calls it
    /// after every input.
    pub(super) async fn drive_syncs(
        self: &Arc<Self>,
        key: &Key,
        m: &Membership,
        core: &mut MasterRole,
        tasks: &mut SyncTasks,
        incarnation: u64,
    ) {
        while let Some(action) = core.poll_action() {
            match action {
                Action::StartSync { target, active } => {
                    let (sync, from_seq) =
                        self.start_sync(key, m, target, active, core.epoch()).await;
                    core.handle_sync_started(target, sync, from_seq);
                }
                Action::Copy { target, id, below } => {
                    let (want_tx, want_rx) = tokio::sync::oneshot::channel();
                    let (have_tx, have_rx) = tokio::sync::oneshot::channel();
                    let (written_tx, written_rx) = tokio::sync::watch::channel(0);
                    let batch = policy_of(&self.raft.snapshot(), key)
                        .map_or(crate::meta::ha_policy::DEFAULT_SYNC_BATCH_SIZE, |p| {
                            p.sync_batch_size
                        }) as usize;
                    let inner = self.clone();
                    let key = key.clone();
                    let sender = m.handle.sender();
                    let done = tasks.done_tx.clone();
                    let copier = tokio::spawn(async move {
                        let ok = inner
                            .copy_backlog(
                                &key,
                                sender,
                                target,
                                id,
                                below,
                                batch.max(1),
                                (have_rx, want_rx, written_rx),
                            )
                            .await;
                        let _ = done.send(SyncDone::Copy(target, id, ok));
                    });
                    let run = tasks.runs.entry(target).or_default();
                    run.abort();
                    *run = RunTasks {
                        id,
                        copier: Some(copier),
                        end: None,
                        want: Some(want_tx),
                        have: Some(have_tx),
                        written: Some(written_tx),
                    };
                }
                Action::Answer { target, id, answer } => {
                    if let Some(run) = tasks.runs.get_mut(&target).filter(|r| r.id == id) {
                        let _ = match answer {
                            Answer::Have(next) => run.have.take().map(|tx| tx.send(next)),
                            Answer::Want(from) => run.want.take().map(|tx| tx.send(from)),
                            Answer::Written(n) => {
                                if let Some(tx) = &run.written {
                                    tx.send_if_modified(|w| {
                                        let more = n > *w;
                                        *w = (*w).max(n);
                                        more
                                    });
                                }
                                None
                            }
                        };
                    }
                }
                Action::SendEnd { target, id } => {
                    let (epoch, sync) = id;
                    let lap = m.handle.sender().confirmed_broadcast(Bytes::from(
                        MirrorMsg::SyncEnd {
                            epoch,
                            target,
                            sync,
                        }
                        .encode(),
                    ));
                    let done = tasks.done_tx.clone();
                    let end = tokio::spawn(async move {
                        let ok = lap.await.is_ok();
                        let _ = done.send(SyncDone::End(target, id, ok));
                    });
                    let run = tasks.runs.entry(target).or_default();
                    if run.id != id {
                        run.abort();
                        *run = RunTasks {
                            id,
                            ..RunTasks::default()
                        };
                    }
                    run.end = Some(end);
                }
                Action::Record { target, id } => {
                    let at = self
                        .set_synchronised(
                            key,
                            incarnation,
                            Some(target),
                            target.node,
                            true,
                            Some(id.0),
                        )
                        .await;
                    core.handle_recorded(target, id, at);
                }
                Action::Abort { target, id, why } => {
                    if why == Why::Unacknowledged {
                        tracing::warn!(queue = %key.1, node = target.node, "a sync's end made its lap but its mirror never acknowledged it: starting over");
                    }
                    if let Some(run) = tasks.runs.remove(&target) {
                        if run.id == id {
                            run.abort();
                        } else {
                            tasks.runs.insert(target, run);
                        }
                    }
                }
                Action::TickNow => tasks.tick_now = true,
            }
        }
    }

    /// Broadcasts `target`'s `SyncStart` at this point of the stream (under the storage
    /// lock, so it is ordered with the rounds): its sync number and where it starts.
    async fn start_sync(
        &self,
        key: &Key,
        m: &Membership,
        target: MemberId,
        active: bool,
        epoch: u64,
    ) -> (u64, u64) {
        let storage = self.storage.clone();
        let (vhost, name) = key.clone();
        let start_sender = m.handle.sender();
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
        (sync, from_seq)
    }

    /// Active sync: summaries of what a mirror's kept copy holds (if it kept one), until
    /// the mirror says from where it needs the backlog, then the backlog from there in
    /// batches, while the queue goes on serving. Flow control: at most
    /// [`COPY_BATCHES_OUT`] batches on their lap, and as many not yet reported written
    /// by the mirror (`SyncWritten`: it releases batches at once and writes them beside
    /// its loop).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn copy_backlog(
        &self,
        key: &Key,
        sender: GmSender,
        target: MemberId,
        (epoch, sync): (u64, u64),
        below: u64,
        batch: usize,
        (have, want, mut written): (
            tokio::sync::oneshot::Receiver<u64>,
            tokio::sync::oneshot::Receiver<u64>,
            tokio::sync::watch::Receiver<u64>,
        ),
    ) -> bool {
        let Some(mut from) = self
            .send_summaries(key, &sender, target, (epoch, sync), below, (have, want))
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
        // Batches out at once: the next batch is read (under the storage lock, which the
        // syncer's rounds wait on) while the mirror writes the last, so a batch costs the
        // longer of the two, not their sum. The laps (awaited in order) catch a failed
        // send; the mirror's `SyncWritten` reports set the pace (below).
        let mut out = std::collections::VecDeque::new();
        let mut sent = 0u64;
        // The segment being copied, read once for all its batches.
        let mut cursor = SyncCursor::default();
        loop {
            let storage = self.storage.clone();
            let (vhost, name) = key.clone();
            let s = sender.clone();
            let step = self
                .offload(move || {
                    let read = storage.sync_batch(&vhost, &name, (from, below), batch, &mut cursor);
                    let sent = read.map(|(ops, next)| {
                        // Encoded and sent after the storage lock is let go (it held the
                        // probe's rounds up for most of a sync): the rounds shipped
                        // meanwhile may go ahead of the batch, and the mirror holds them
                        // until the backlog is written either way (`docs/mirroring.md`,
                        // *Sync*).
                        let n = ops
                            .iter()
                            .filter(|o| matches!(o, IndexOp::Publish { .. }))
                            .count();
                        let lap = (!ops.is_empty()).then(|| {
                            let msg = MirrorMsg::SyncBatch {
                                epoch,
                                target,
                                sync,
                                ops: Bytes::new(),
                            };
                            s.confirmed_broadcast(Bytes::from(ops::encode_message(&msg, &ops)))
                        });
                        (lap, next, n)
                    });
                    (cursor, sent)
                })
                .await;
            let Some((kept, Ok((lap, next, n)))) = step else {
                tracing::warn!(queue = %key.1, "sync stopped: the backlog could not be read");
                return false;
            };
            cursor = kept;
            sent += u64::from(lap.is_some());
            out.push_back((lap, n, next));
            while out.len() >= COPY_BATCHES_OUT || (next.is_none() && !out.is_empty()) {
                let Some((lap, n, reached)) = out.pop_front() else {
                    break;
                };
                if let Some(lap) = lap {
                    if lap.await.is_err() {
                        return false;
                    }
                }
                copied += n;
                progress.at(reached.unwrap_or(below), below);
            }
            match next {
                Some(n) => from = n,
                None => break,
            }
            // The mirror's disk sets the pace: a batch is read once all but
            // `COPY_BATCHES_OUT - 1` of those sent are written.
            let pace = written.wait_for(|w| w + COPY_BATCHES_OUT as u64 > sent);
            if pace.await.is_err() {
                return false;
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

/// Backlog batches a sync keeps on their lap, and unreported as written by the mirror, at
/// once (each up to `SYNC_BATCH_BYTES`).
const COPY_BATCHES_OUT: usize = 2;

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

/// The tasks the master runs for its syncs, and where they report.
pub(super) struct SyncTasks {
    runs: BTreeMap<MemberId, RunTasks>,
    done_tx: tokio::sync::mpsc::UnboundedSender<SyncDone>,
    /// The core asked for a tick now ([`Action::TickNow`]).
    pub(super) tick_now: bool,
}

impl SyncTasks {
    /// No tasks yet; their reports come out of the receiver.
    pub(super) fn new() -> (SyncTasks, tokio::sync::mpsc::UnboundedReceiver<SyncDone>) {
        let (done_tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let tasks = SyncTasks {
            runs: BTreeMap::new(),
            done_tx,
            tick_now: false,
        };
        (tasks, rx)
    }
}

impl Drop for SyncTasks {
    fn drop(&mut self) {
        for run in self.runs.values() {
            run.abort();
        }
    }
}

/// What a sync task reports when it ends.
#[derive(Debug)]
pub(super) enum SyncDone {
    /// The backlog copy (`true`: its end made its lap).
    Copy(MemberId, SyncId, bool),
    /// The closing `SyncEnd` lap (`true`: it completed).
    End(MemberId, SyncId, bool),
}

impl SyncDone {
    /// Hands the report to the core.
    pub(super) fn report(self, core: &mut MasterRole) {
        match self {
            SyncDone::Copy(target, id, ok) => core.handle_copy_done(target, id, ok),
            SyncDone::End(target, id, ok) => core.handle_end_lap(target, id, ok),
        }
    }
}

/// One sync's tasks.
#[derive(Default)]
struct RunTasks {
    id: SyncId,
    /// The backlog copier (active sync).
    copier: Option<JoinHandle<()>>,
    /// The closing `SyncEnd`'s lap.
    end: Option<JoinHandle<()>>,
    /// Where the copier learns from which seq the mirror needs the backlog.
    want: Option<tokio::sync::oneshot::Sender<u64>>,
    /// Where the copier learns up to which seq the mirror kept a copy.
    have: Option<tokio::sync::oneshot::Sender<u64>>,
    /// Where the copier learns how many batches the mirror has written.
    written: Option<tokio::sync::watch::Sender<u64>>,
}

impl RunTasks {
    fn abort(&self) {
        for t in self.copier.iter().chain(self.end.iter()) {
            t.abort();
        }
    }
}
