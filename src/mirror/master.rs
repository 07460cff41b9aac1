//! The master role's side of the sync protocol, sans-IO: which mirror members a master syncs,
//! when each sync is over, and when the master may vouch for the mirror in the metadata
//! (`docs/mirroring.md`, *Sync*). The driver (`runtime::mirror_host::master`) feeds it the
//! group's membership, the mirrors' sync messages, the metadata's view of the queue's mirror
//! set, the outcome of each task it runs and a look at the queue at every tick; it carries
//! out the [`Action`]s in order, answering [`Action::StartSync`] with
//! [`MasterRole::handle_sync_started`] before polling on.
//!
//! Rules:
//! - **A member that joins** (not the master's own) gets a sync, if its node is in the
//!   queue's mirror set: active (the backlog copied) when the policy says automatic or
//!   `sync_queue` asked, passive (RabbitMQ's manual mode: the mirror follows from here and
//!   the backlog drains away) otherwise. A promoted master syncs every member in its group
//!   that the metadata does not hold synchronised.
//! - **A sync ends** when its active copy completed its lap, or, for a passive sync (and an
//!   active one whose copy failed), when the backlog below its start is gone and its closing
//!   `SyncEnd` then completed its lap.
//! - **The master vouches** ([`Action::Record`]) only for a sync that ended, whose mirror
//!   acknowledged that very sync (`SyncAck`), at a tick where the queue holds nothing
//!   outside the index (a sync copies the index: a message outside it is on no mirror).
//! - **A sync that ended unacknowledged** for [`SYNC_ACK_WAIT_MS`] (the mirror joined too
//!   late to get its start) starts over, in its mode.
//! - **The metadata** can take a mirror's synchronised record away while its member stays in
//!   the group (its node dropped from the set and added back): its sync starts over. A
//!   view older than the master's own record of that sync says nothing about it (the
//!   record is in a later entry): restarting on it would empty a copy the metadata vouches
//!   for.
//!   `sync_queue` restarts every unsynchronised mirror's sync that is not copying as an
//!   active one; `cancel_sync_queue` restarts every copying one as a passive one.
//! - **A member that leaves** takes its sync with it ([`Action::Abort`]).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::gm::MemberId;
use crate::meta::NodeId;
use crate::time::Instant;

use super::message::MirrorMsg;
use super::role::SyncId;

/// How long a sync's end may wait for its mirror's acknowledgement before the sync starts
/// over.
pub const SYNC_ACK_WAIT_MS: u64 = 3_000;

/// The metadata's view of the queue's mirrors, as the master needs it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SetView {
    /// Each mirror node of the queue's set, and whether it is recorded synchronised.
    pub mirrors: BTreeMap<NodeId, bool>,
    /// The policy's `ha-sync-mode` is automatic.
    pub automatic: bool,
    /// The queue's (`sync_queue`, `cancel_sync_queue`) request counters.
    pub requests: (u64, u64),
    /// The index of the last metadata entry the view reflects: a record the master made
    /// at a later index is not in it yet (its node's proposal returns once the leader
    /// applied it, before this node has).
    pub applied: u64,
}

impl SetView {
    fn synchronised(&self, node: NodeId) -> bool {
        self.mirrors.get(&node).copied().unwrap_or(false)
    }
}

/// The queue as the master finds it at a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Look {
    /// The lowest seq the queue still holds (`None`: empty).
    pub low_seq: Option<u64>,
    /// The queue holds a message outside its index (not yet written, or transient).
    pub unindexed: bool,
}

/// What the driver does, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Broadcast `SyncStart` to `target` at the current point of the queue's stream (ordered
    /// with the rounds), with a new sync number; answer with
    /// [`MasterRole::handle_sync_started`].
    StartSync {
        /// The mirror's member.
        target: MemberId,
        /// Copy the backlog (rather than let it drain away).
        active: bool,
    },
    /// Copy the backlog below `below` to `target` (summaries of its kept copy first), and
    /// report with [`MasterRole::handle_copy_done`].
    Copy {
        /// The mirror's member.
        target: MemberId,
        /// The sync.
        id: SyncId,
        /// The sync's start: the copy covers what is below it.
        below: u64,
    },
    /// Hand the running copy of sync `id` the mirror's answer.
    Answer {
        /// The mirror's member.
        target: MemberId,
        /// The sync.
        id: SyncId,
        /// The answer.
        answer: Answer,
    },
    /// Broadcast sync `id`'s `SyncEnd` confirmed (its lap completes only through every
    /// member), and report with [`MasterRole::handle_end_lap`].
    SendEnd {
        /// The mirror's member.
        target: MemberId,
        /// The sync.
        id: SyncId,
    },
    /// Record `target`'s node synchronised in the metadata, vouched for by that member;
    /// report with [`MasterRole::handle_recorded`].
    Record {
        /// The mirror's member.
        target: MemberId,
        /// The sync.
        id: SyncId,
    },
    /// Stop whatever runs for sync `id` (its copy, its end's lap).
    Abort {
        /// The mirror's member.
        target: MemberId,
        /// The sync.
        id: SyncId,
        /// Why it is dropped.
        why: Why,
    },
    /// Call [`MasterRole::handle_tick`] now rather than at the next period: a sync may be
    /// recordable.
    TickNow,
}

/// Why a sync is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// Its member left the group.
    Left,
    /// Its end made its lap but the mirror never acknowledged it: it starts over.
    Unacknowledged,
    /// The metadata holds the mirror unsynchronised after the sync was recorded: it starts
    /// over.
    Unsynchronised,
    /// `sync_queue` or `cancel_sync_queue` switched its mode: it starts over.
    Requested,
    /// A new start for the same member replaced it.
    Replaced,
}

/// A mirror's answer to an active sync's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// It kept a copy below this seq: summaries of it first.
    Have(u64),
    /// It needs the backlog from this seq.
    Want(u64),
    /// It has written this many of the sync's batches (handed on every time: the copier
    /// paces its batches by the latest).
    Written(u64),
}

/// How a run's task stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Task {
    None,
    Running,
    Done(bool),
}

/// One mirror's sync, as its master runs it.
#[derive(Debug, Clone)]
struct Run {
    id: SyncId,
    /// The sync's start: a passive sync ends once the queue holds nothing below it.
    from_seq: u64,
    /// Started active (what a restart of it asks for again).
    active: bool,
    copy: Task,
    /// The closing `SyncEnd`'s lap (passive sync, or a failed copy).
    end_lap: Task,
    /// When the sync's end completed its lap.
    ended: Option<Instant>,
    /// The mirror acknowledged this sync.
    acked: bool,
    /// Answers already handed to the copy (each once).
    had: bool,
    wanted: bool,
    /// The record is proposed / in the metadata at this index.
    recording: bool,
    recorded: Option<u64>,
}

impl Run {
    fn copying(&self) -> bool {
        self.copy == Task::Running
    }
}

/// A master's syncs of its mirrors, for one epoch of one mirrored queue.
#[derive(Debug)]
pub struct MasterRole {
    me: MemberId,
    epoch: u64,
    view: SetView,
    members: BTreeSet<MemberId>,
    runs: BTreeMap<MemberId, Run>,
    /// A `StartSync` not answered yet (with its mode).
    starting: Option<(MemberId, bool)>,
    /// Starts to issue once the one pending is answered.
    queued: VecDeque<(MemberId, bool)>,
    actions: VecDeque<Action>,
}

impl MasterRole {
    /// The master `me` at `epoch`, in a group of `members`, with the metadata's `view`.
    /// `promoted`: it took over a group, so every member the metadata does not hold
    /// synchronised is synced (a fresh master's mirrors start over as they join).
    pub fn new(
        me: MemberId,
        epoch: u64,
        members: BTreeSet<MemberId>,
        view: SetView,
        promoted: bool,
    ) -> MasterRole {
        let mut r = MasterRole {
            me,
            epoch,
            view,
            members: members.clone(),
            runs: BTreeMap::new(),
            starting: None,
            queued: VecDeque::new(),
            actions: VecDeque::new(),
        };
        if promoted {
            for mid in members {
                if mid != me && !r.view.synchronised(mid.node) {
                    r.start(mid, false);
                }
            }
        }
        r
    }

    /// The next thing to do.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// The epoch it masters the queue under.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether `target`'s sync is copying the backlog.
    pub fn copying(&self, target: MemberId) -> bool {
        self.runs.get(&target).is_some_and(Run::copying)
    }

    /// Whether some sync is not recorded yet (the tick's [`Look::unindexed`] matters).
    pub fn syncing(&self) -> bool {
        self.runs.values().any(|r| r.recorded.is_none())
    }

    /// Whether `mid`'s node is synchronised as far as the master knows: the view says so,
    /// or its sync's record is later than the view (a view that predates the record says
    /// nothing about it: bug 29, where such a view restarted a synchronised mirror's sync,
    /// which emptied its copy while the metadata still vouched for it).
    fn synchronised(&self, mid: MemberId) -> bool {
        self.view.synchronised(mid.node)
            || self
                .runs
                .get(&mid)
                .and_then(|r| r.recorded)
                .is_some_and(|at| at > self.view.applied)
    }

    /// The group's live members now.
    pub fn handle_members(&mut self, members: &BTreeSet<MemberId>) {
        let joined: Vec<MemberId> = members.difference(&self.members).copied().collect();
        self.members = members.clone();
        for mid in joined {
            if mid != self.me {
                self.start(mid, false);
            }
        }
        let gone: Vec<MemberId> = self
            .runs
            .keys()
            .filter(|m| !self.members.contains(m))
            .copied()
            .collect();
        for mid in gone {
            self.abort(mid, Why::Left);
        }
        self.queued.retain(|(m, _)| members.contains(m));
    }

    /// A message `from` a member.
    pub fn handle_message(&mut self, from: MemberId, msg: &MirrorMsg) {
        let (id, what) = match *msg {
            MirrorMsg::SyncAck { epoch, sync } => ((epoch, sync), None),
            MirrorMsg::SyncHave {
                epoch,
                sync,
                copy_next,
            } => ((epoch, sync), Some(Answer::Have(copy_next))),
            MirrorMsg::SyncWant { epoch, sync, from } => ((epoch, sync), Some(Answer::Want(from))),
            MirrorMsg::SyncWritten {
                epoch,
                sync,
                batches,
            } => ((epoch, sync), Some(Answer::Written(batches))),
            _ => return,
        };
        let Some(run) = self.runs.get_mut(&from).filter(|r| r.id == id) else {
            return;
        };
        match what {
            None => {
                if !run.acked {
                    run.acked = true;
                    // Recorded at a tick: now, not a period on.
                    self.actions.push_back(Action::TickNow);
                }
            }
            Some(answer) => {
                let mut every = false;
                let once = match answer {
                    Answer::Have(_) => &mut run.had,
                    Answer::Want(_) => &mut run.wanted,
                    Answer::Written(_) => &mut every,
                };
                if run.copy == Task::Running && !*once {
                    *once = true;
                    self.actions.push_back(Action::Answer {
                        target: from,
                        id,
                        answer,
                    });
                }
            }
        }
    }

    /// The `StartSync` asked for went out as sync number `sync`, at `from_seq` of the
    /// queue's stream.
    pub fn handle_sync_started(&mut self, target: MemberId, sync: u64, from_seq: u64) {
        let Some((mid, active)) = self.starting.take() else {
            return;
        };
        if mid == target && self.members.contains(&target) {
            let id = (self.epoch, sync);
            self.abort(target, Why::Replaced);
            self.runs.insert(
                target,
                Run {
                    id,
                    from_seq,
                    active,
                    copy: if active { Task::Running } else { Task::None },
                    end_lap: Task::None,
                    ended: None,
                    acked: false,
                    had: false,
                    wanted: false,
                    recording: false,
                    recorded: None,
                },
            );
            if active {
                self.actions.push_back(Action::Copy {
                    target,
                    id,
                    below: from_seq,
                });
            }
        }
        self.next_start();
    }

    /// Sync `id`'s copy finished (`ok`: its end made its lap).
    pub fn handle_copy_done(&mut self, target: MemberId, id: SyncId, ok: bool) {
        if let Some(run) = self.run_mut(target, id) {
            if run.copy == Task::Running {
                run.copy = Task::Done(ok);
                self.actions.push_back(Action::TickNow);
            }
        }
    }

    /// Sync `id`'s closing `SyncEnd` lap finished (`ok`: it completed).
    pub fn handle_end_lap(&mut self, target: MemberId, id: SyncId, ok: bool) {
        if let Some(run) = self.run_mut(target, id) {
            if run.end_lap == Task::Running {
                run.end_lap = Task::Done(ok);
                self.actions.push_back(Action::TickNow);
            }
        }
    }

    /// The record of sync `id` is in the metadata at log index `at` (`Some`), or did not
    /// commit (`None`: tried again at a tick).
    pub fn handle_recorded(&mut self, target: MemberId, id: SyncId, at: Option<u64>) {
        if let Some(run) = self.run_mut(target, id) {
            run.recording = false;
            run.recorded = at;
        }
    }

    /// The metadata moved: the queue's mirror set as it stands now. A view older than the
    /// last one is ignored.
    pub fn handle_view(&mut self, view: SetView) {
        if view.applied < self.view.applied {
            return;
        }
        let old = std::mem::replace(&mut self.view, view);
        let others: Vec<MemberId> = self
            .members
            .iter()
            .copied()
            .filter(|m| *m != self.me)
            .collect();
        // A mirror recorded unsynchronised while its member stayed (and its sync was over,
        // or never started): nothing else would sync it again.
        for &mid in &others {
            let unsynced =
                self.view.mirrors.get(&mid.node) == Some(&false) && !self.synchronised(mid);
            if unsynced && self.runs.get(&mid).is_none_or(|r| r.recorded.is_some()) {
                self.restart(mid, false, Why::Unsynchronised);
            }
        }
        if self.view.requests != old.requests {
            let cancel = self.view.requests.1 != old.requests.1;
            for &mid in &others {
                if !self.synchronised(mid) && cancel == self.copying(mid) {
                    self.restart(mid, !cancel, Why::Requested);
                }
            }
        }
    }

    /// A period passed (or [`Action::TickNow`]): ends the syncs whose end is due, restarts
    /// the ones their mirror never acknowledged, and records the complete ones.
    pub fn handle_tick(&mut self, now: Instant, look: Look) {
        // A sync copies the index: while the queue holds a message outside it, no mirror
        // holds everything.
        let unindexed = self.syncing() && look.unindexed;
        let mut unacked = Vec::new();
        for (&target, run) in self.runs.iter_mut() {
            if run.recorded.is_some() {
                continue;
            }
            if !unindexed {
                if run.ended.is_none() && Self::end_completed(target, run, look, &mut self.actions)
                {
                    run.ended = Some(now);
                }
                if run.ended.is_some() && run.acked && !run.recording {
                    run.recording = true;
                    self.actions
                        .push_back(Action::Record { target, id: run.id });
                }
            }
            if let Some(ended) = run.ended {
                if !run.acked && now.millis_since(ended) > SYNC_ACK_WAIT_MS {
                    unacked.push((target, run.active));
                }
            }
        }
        // The mirror joined too late to get its sync's start or end (it would hold
        // nothing): started again, now that the member is in the ring.
        for (mid, active) in unacked {
            self.restart(mid, active, Why::Unacknowledged);
        }
    }

    /// Whether `run`'s end completed its lap: its copy's, or its closing `SyncEnd`'s, sent
    /// once the backlog below its start is gone (passive sync, or a copy that failed).
    fn end_completed(
        target: MemberId,
        run: &mut Run,
        look: Look,
        actions: &mut VecDeque<Action>,
    ) -> bool {
        match run.copy {
            Task::Running => return false,
            Task::Done(true) => return true,
            Task::Done(false) | Task::None => {}
        }
        match run.end_lap {
            Task::Running => false,
            Task::Done(true) => true,
            Task::Done(false) | Task::None => {
                // Not confirmed: sent again once the backlog is gone.
                run.end_lap = Task::None;
                if look.low_seq.is_none_or(|low| low >= run.from_seq) {
                    run.end_lap = Task::Running;
                    actions.push_back(Action::SendEnd { target, id: run.id });
                }
                false
            }
        }
    }

    fn run_mut(&mut self, target: MemberId, id: SyncId) -> Option<&mut Run> {
        self.runs.get_mut(&target).filter(|r| r.id == id)
    }

    fn abort(&mut self, target: MemberId, why: Why) {
        if let Some(run) = self.runs.remove(&target) {
            self.actions.push_back(Action::Abort {
                target,
                id: run.id,
                why,
            });
        }
    }

    fn restart(&mut self, target: MemberId, active: bool, why: Why) {
        self.abort(target, why);
        self.start(target, active);
    }

    /// Starts `target`'s sync (if its node is a mirror of the set), one `StartSync` out at
    /// a time.
    fn start(&mut self, target: MemberId, requested: bool) {
        if !self.view.mirrors.contains_key(&target.node) {
            return;
        }
        let active = requested || self.view.automatic;
        self.queued.retain(|(m, _)| *m != target);
        self.queued.push_back((target, active));
        if self.starting.is_none() {
            self.next_start();
        }
    }

    fn next_start(&mut self) {
        if let Some((target, active)) = self.queued.pop_front() {
            // Its sync is over from here: a member never has two at once (a restart asked
            // for while the last start was out follows it at once).
            self.abort(target, Why::Replaced);
            self.starting = Some((target, active));
            self.actions.push_back(Action::StartSync { target, active });
        }
    }
}

#[cfg(test)]
mod tests;
