//! The syncer: group commit's rounds. [`Storage::write_round`] is the one round (drain,
//! write, fsync, settle); the node's syncer thread ([`Storage::run_syncer`]) and the
//! simulation drive it, and report mirrored rounds' laps with [`Storage::laps_done`]. What a
//! round settles is the sans-IO [`GroupCommit`]'s decision.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{Storage, StorageError};
use crate::broker::group_commit::{Effect, GroupCommit};
use crate::broker::queue::IndexOp;
use crate::broker::QueueHandle;
use crate::store::Disk;

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
pub(super) fn block_on<F: std::future::Future>(fut: F) -> F::Output {
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

impl<D: Disk + Clone> Storage<D> {
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
        let mut laps: Vec<LapWait> = Vec::new();
        for (handle, ops) in batches {
            let key = (handle.vhost.clone(), handle.name.clone());
            if state.copies.contains_key(&key) {
                if state
                    .started
                    .get(&key)
                    .is_some_and(|&copy| copy > handle.generation)
                {
                    // The copy was started after this handle was made: the handle is a
                    // deposed master's (or a deleted queue's), whose index the copy's
                    // start removed, and these are its last operations. They must not
                    // touch the copy, nor go to the queue's mirrors; the publishes among
                    // them are refused, never confirmed (the queue lives elsewhere now).
                    tracing::info!(queue = %key.1, ops = ops.len(), "a deposed master's last operations are dropped: a newer mirror copy holds its name");
                    if ops.iter().any(|op| matches!(op, IndexOp::Publish { .. })) {
                        laps.push(Box::pin(std::future::ready(false)));
                    }
                    continue;
                }
                // A stale mirror copy under this queue's name (see `State::copies`).
                tracing::info!(queue = %key.1, "a new queue replaces a mirror copy of its name");
                self.remove_copy(state, &key)?;
            }
            // Shipped before the local write, so the mirrors' writes overlap this one;
            // under the storage lock, so the mirrors see rounds in the order written here.
            if let Some(wait) = tap.as_ref().and_then(|tap| tap(&key, &ops)) {
                laps.push(wait);
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
}
