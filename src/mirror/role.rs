//! The mirror role's sync protocol, sans-IO: what one mirror member does with each message
//! its queue's group delivers (`docs/mirroring.md`, *Sync*). The driver
//! (`runtime::mirror_host::mirror`) feeds it [`MirrorRole::handle_message`], carries out
//! its [`Action`]s in order, and answers each storage request with the matching `handle_*`
//! before polling on.
//!
//! Rules:
//! - **Waiting** (joined, no sync for this member yet): rounds are released unwritten; the
//!   copy is not the queue's, and the master counts no release of this member toward a
//!   confirm until a sync makes it so.
//! - **A sync's start** restarts the copy. A passive one (RabbitMQ's manual mode) makes it
//!   live at once: the mirror is the queue's from there on, and acknowledges the sync's
//!   end. An active one first resumes a copy kept from the last run (announced with
//!   `SyncHave`, then compared with the master's summaries) or asks for the whole backlog
//!   (`SyncWant` from 0), and holds rounds back until the backlog is in. Its backlog
//!   batches are written beside the loop, in order, each reported (`SyncWritten`) once
//!   written; the driver finishes them before anything else touches the copy.
//! - **A sync's end** (of the sync followed): uncompared kept messages go, the held rounds
//!   are written after the backlog, and only then is the sync acknowledged (`SyncAck`), so
//!   an acknowledged mirror holds the whole queue.
//! - **A sync message for this member while waiting** means it missed the start (GM gives a
//!   joiner only what follows its join): it leaves without releasing, so the master cannot
//!   count the sync complete (bug 22).
//! - **Any storage failure** leaves: the copy cannot be trusted.

use bytes::Bytes;
use std::collections::VecDeque;

use crate::gm::MemberId;

use super::digest::{RangeSummary, SummaryBuilder};
use super::message::MirrorMsg;

/// A sync: (master's epoch, sync number).
pub type SyncId = (u64, u64);

/// Where the member's copy stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// No sync for this member yet: its copy is not the queue's.
    Waiting,
    /// The copy follows the queue: rounds are written.
    Live,
    /// An active sync fills the copy: rounds are held until its end.
    Syncing(SyncId),
}

/// What the driver does, in order. The storage requests (`ResumeCopy`, `StartCopy`,
/// `Reconcile`) are answered before the next poll.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Write these operations to the copy (with an fsync); a failure leaves. The driver
    /// first finishes the backlog batches being written (as for every action that reads
    /// or writes the copy: all but `WriteBatch`, `Hold`, `BeginHold`, `DiscardHeld` and
    /// `Broadcast`).
    Write(Bytes),
    /// Write this backlog batch to the copy beside the loop, after the batches before
    /// it, then broadcast `then` (the master paces its batches by these reports). The
    /// message is released at once: nothing counts on a syncing copy until its
    /// `SyncAck`, which comes after every batch is written. A failure leaves.
    WriteBatch {
        /// The batch's operations.
        ops: Bytes,
        /// The report to send once it is written.
        then: MirrorMsg,
    },
    /// Keep these operations until the sync's end (`BeginHold` came first); a failure
    /// leaves.
    Hold(Bytes),
    /// Start holding rounds back.
    BeginHold,
    /// Write every held round, in order, and stop holding; a failure leaves.
    ApplyHeld,
    /// Drop the held rounds and stop holding: a new sync restarted the copy after them.
    DiscardHeld,
    /// Keep the copy from the last run if it fits an active sync from `from_seq`:
    /// answer with [`MirrorRole::handle_resumed`].
    ResumeCopy {
        /// The sync's start in the master's stream.
        from_seq: u64,
    },
    /// Start an empty copy: answer with [`MirrorRole::handle_copy_started`].
    StartCopy {
        /// A kept copy turned out not to match the master's queue (rather than a passive
        /// sync's start).
        kept_copy_differs: bool,
    },
    /// Compare the kept copy with this summary (and make it match): answer with
    /// [`MirrorRole::handle_reconciled`].
    Reconcile(RangeSummary),
    /// Send this to the group (not confirmed: a lost one makes the master fall back or
    /// start the sync again).
    Broadcast(MirrorMsg),
    /// Leave without releasing the message: the copy cannot be trusted.
    Leave(Why),
}

/// Why a mirror leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// A sync for this member whose start it never got.
    MissedSyncStart,
    /// Its copy could not be read or written.
    Storage,
}

/// A kept copy being compared with the master's summaries, in active sync `id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Delta {
    id: SyncId,
    /// The copy's next seq at the sync's start: the summaries cover `[0, copy_next)`.
    copy_next: u64,
    /// Compared up to here.
    covered: u64,
}

/// The storage request the role waits on, and what its answer continues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    /// An active sync's start: the kept copy resumed (or not).
    Resume(SyncId),
    /// A passive sync's start: the empty copy.
    Passive(SyncId),
    /// An active sync's copy restarted empty (the kept one did not match).
    Restart(SyncId),
    /// A summary up to `hi` compared.
    Compare(SyncId, u64),
    /// At the sync's end, the uncompared rest of the kept copy dropped.
    EndCompare(SyncId),
}

/// One mirror member's sync state.
#[derive(Debug)]
pub struct MirrorRole {
    me: MemberId,
    mode: Mode,
    /// The sync whose start made the copy the queue's: its end is acknowledged.
    synced_by: Option<SyncId>,
    delta: Option<Delta>,
    waiting: Option<Waiting>,
    actions: VecDeque<Action>,
    left: bool,
    /// Backlog batches of the sync followed handed to be written.
    batches: u64,
}

impl MirrorRole {
    /// A member `me` that just joined.
    pub fn new(me: MemberId) -> MirrorRole {
        MirrorRole {
            me,
            mode: Mode::Waiting,
            synced_by: None,
            delta: None,
            waiting: None,
            actions: VecDeque::new(),
            left: false,
            batches: 0,
        }
    }

    /// Where the copy stands.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The next thing to do for the message being handled.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Whether the role is waiting for a storage answer.
    pub fn is_waiting(&self) -> bool {
        self.waiting.is_some()
    }

    /// One message the group delivered (in order; the previous one's actions done).
    pub fn handle_message(&mut self, msg: MirrorMsg) {
        if self.left {
            return;
        }
        let me = self.me;
        match msg {
            MirrorMsg::Ops { ops, .. } => match self.mode {
                Mode::Waiting => {}
                Mode::Live => self.push(Action::Write(ops)),
                Mode::Syncing(_) => self.push(Action::Hold(ops)),
            },
            MirrorMsg::SyncStart {
                epoch,
                target,
                active,
                from_seq,
                sync,
            } if target == me => {
                self.delta = None;
                if active {
                    self.ask(
                        Waiting::Resume((epoch, sync)),
                        Action::ResumeCopy { from_seq },
                    );
                } else {
                    self.ask(
                        Waiting::Passive((epoch, sync)),
                        Action::StartCopy {
                            kept_copy_differs: false,
                        },
                    );
                }
            }
            MirrorMsg::SyncBatch { target, .. }
            | MirrorMsg::SyncEnd { target, .. }
            | MirrorMsg::SyncSummary { target, .. }
                if target == me && self.mode == Mode::Waiting =>
            {
                self.leave(Why::MissedSyncStart);
            }
            // Batches of the sync followed (an aborted one's are not this copy's).
            MirrorMsg::SyncBatch {
                epoch,
                target,
                sync,
                ops,
            } if target == me && self.mode == Mode::Syncing((epoch, sync)) => {
                self.batches += 1;
                let then = MirrorMsg::SyncWritten {
                    epoch,
                    sync,
                    batches: self.batches,
                };
                self.push(Action::WriteBatch { ops, then });
            }
            MirrorMsg::SyncSummary {
                epoch,
                target,
                sync,
                summary,
            } if target == me => {
                let Some(d) = self.delta.filter(|d| d.id == (epoch, sync)) else {
                    return;
                };
                let hi = summary.hi;
                if summary.lo != d.covered || hi > d.copy_next || hi <= summary.lo {
                    // Not the range that follows: the comparison cannot go on.
                    self.restart(d.id);
                } else {
                    self.ask(Waiting::Compare(d.id, hi), Action::Reconcile(summary));
                }
            }
            MirrorMsg::SyncEnd {
                epoch,
                target,
                sync,
            } if target == me && self.mode == Mode::Syncing((epoch, sync)) => {
                // A sync that ended before the summaries were all compared (the master
                // fell back to waiting for the old messages to go): what the kept copy
                // still holds uncompared is gone from the queue.
                match self.delta.take().filter(|d| d.covered < d.copy_next) {
                    Some(d) => {
                        let gone = SummaryBuilder::new(d.covered, d.copy_next).finish();
                        self.ask(Waiting::EndCompare(d.id), Action::Reconcile(gone));
                    }
                    None => self.end_sync((epoch, sync)),
                }
            }
            // A natural sync's end, for the sync followed since its start.
            MirrorMsg::SyncEnd {
                epoch,
                target,
                sync,
            } if target == me
                && self.mode == Mode::Live
                && self.synced_by == Some((epoch, sync)) =>
            {
                self.ack(epoch, sync);
            }
            _ => {}
        }
    }

    /// The answer to `ResumeCopy`: `None` the copy could not be read or started,
    /// `Some(Some(next))` the kept copy stays (it holds seqs below `next` only),
    /// `Some(None)` it starts empty.
    pub fn handle_resumed(&mut self, resumed: Option<Option<u64>>) {
        let Some(Waiting::Resume((epoch, sync))) = self.waiting.take() else {
            return;
        };
        match resumed {
            None => return self.leave(Why::Storage),
            Some(Some(copy_next)) if copy_next > 0 => {
                self.delta = Some(Delta {
                    id: (epoch, sync),
                    copy_next,
                    covered: 0,
                });
                self.push(Action::Broadcast(MirrorMsg::SyncHave {
                    epoch,
                    sync,
                    copy_next,
                }));
            }
            Some(_) => self.want(epoch, sync, 0),
        }
        self.mode = Mode::Syncing((epoch, sync));
        self.synced_by = None;
        self.batches = 0;
        self.push(Action::BeginHold);
    }

    /// The answer to `StartCopy`: whether the empty copy was started.
    pub fn handle_copy_started(&mut self, started: bool) {
        let waited = self.waiting.take();
        if !started {
            return self.leave(Why::Storage);
        }
        match waited {
            Some(Waiting::Passive(id)) => {
                if matches!(self.mode, Mode::Syncing(_)) {
                    self.push(Action::DiscardHeld);
                }
                self.mode = Mode::Live;
                self.synced_by = Some(id);
            }
            Some(Waiting::Restart((epoch, sync))) => self.want(epoch, sync, 0),
            _ => {}
        }
    }

    /// The answer to `Reconcile`: `Some(true)` the range matched (and was made to match),
    /// `Some(false)` the copy cannot hold it, `None` the copy could not be read or written.
    pub fn handle_reconciled(&mut self, matched: Option<bool>) {
        let waited = self.waiting.take();
        match (waited, matched) {
            (Some(_), None) | (Some(Waiting::EndCompare(_)), Some(false)) => {
                self.leave(Why::Storage)
            }
            (Some(Waiting::Compare(id, _)), Some(false)) => self.restart(id),
            (Some(Waiting::Compare((epoch, sync), hi)), Some(true)) => {
                let Some(d) = self.delta.as_mut() else { return };
                d.covered = hi;
                if hi >= d.copy_next {
                    let from = d.copy_next;
                    self.want(epoch, sync, from);
                }
            }
            (Some(Waiting::EndCompare(id)), Some(true)) => self.end_sync(id),
            _ => {}
        }
    }

    /// The kept copy cannot be caught up after all: it starts empty, and the whole backlog
    /// is asked for.
    fn restart(&mut self, id: SyncId) {
        self.delta = None;
        self.ask(
            Waiting::Restart(id),
            Action::StartCopy {
                kept_copy_differs: true,
            },
        );
    }

    /// The active sync `id` ends: the held rounds are written after the backlog, then the
    /// sync is acknowledged.
    fn end_sync(&mut self, (epoch, sync): SyncId) {
        self.mode = Mode::Live;
        self.push(Action::ApplyHeld);
        self.synced_by = Some((epoch, sync));
        self.ack(epoch, sync);
    }

    fn ack(&mut self, epoch: u64, sync: u64) {
        self.push(Action::Broadcast(MirrorMsg::SyncAck { epoch, sync }));
    }

    fn want(&mut self, epoch: u64, sync: u64, from: u64) {
        self.push(Action::Broadcast(MirrorMsg::SyncWant { epoch, sync, from }));
    }

    fn ask(&mut self, waiting: Waiting, request: Action) {
        self.waiting = Some(waiting);
        self.push(request);
    }

    fn leave(&mut self, why: Why) {
        self.actions.clear();
        self.waiting = None;
        self.left = true;
        self.actions.push_back(Action::Leave(why));
    }

    fn push(&mut self, action: Action) {
        if !self.left {
            self.actions.push_back(action);
        }
    }
}

#[cfg(test)]
mod tests;
