//! A promotion as seen by the promoted node: the steps by which its mirror's copy becomes
//! the queue (`docs/mirroring.md`, *Promotion*), sans-IO. The runtime
//! (`runtime::mirror_host::promotion`) carries out the [`Action`]s and reports back.
//!
//! 1. **Flush.** A mirror that followed the group sends a confirmed `Flush` lap: once it
//!    comes round, every round shipped before the promotion is in this copy. A flush that
//!    does not complete leaves the copy as it is, and the queue is served without a member.
//! 2. **The old master's leave.** After a planned move (`ha-promote-on-shutdown`, a restarted
//!    master's hand-over) the old master is alive and may still ship rounds until it sees
//!    the move; it leaves the group once they made their laps. The copy waits for that.
//! 3. **Open.** The broker opens the copy as crash recovery would, once it has applied the
//!    promotion itself (shortly after the metadata); given up after [`OPEN_WAIT_MS`].
//!
//! Throughout, the metadata may move on: another home, or the queue deleted (another
//! incarnation). The promotion then ends without serving. A member whose copy is of a
//! deleted incarnation is abandoned, not left: a draining leave releases unwritten what
//! comes round, and a master behind the delete would count those releases as copies
//! (simulation seed 8930).

use std::collections::VecDeque;

use crate::gm::{MemberId, Slot};
use crate::meta::{MetaState, NodeId};
use crate::time::Instant;

use super::message::group_name;

/// How long the promoted node waits for its broker to apply the promotion.
pub const OPEN_WAIT_MS: u64 = 5_000;

/// The promoted node's GM member of the queue's group, as its mirror left it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Follower {
    /// The queue incarnation the member's copy is of.
    pub incarnation: u64,
    /// The queue's master as the member last saw it.
    pub master: NodeId,
    /// The member on `master` whose messages it last delivered (the old master's, which may
    /// still ship rounds until it leaves), if it delivered any.
    pub master_member: Option<MemberId>,
}

/// What the runtime does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send a confirmed `Flush { epoch }` lap through the member; report with
    /// [`Adoption::handle_flushed`].
    Flush { epoch: u64 },
    /// Drop this node's copy of `incarnation`: its queue is gone.
    DropCopy { incarnation: u64 },
    /// Ship the queue's rounds through the member from now on (under `epoch`).
    Ship { epoch: u64, incarnation: u64 },
    /// Ask the broker to open the copy as the queue; report with [`Adoption::handle_open`].
    Open { incarnation: u64 },
    /// The promotion is over.
    Finish(Outcome),
}

/// How a promotion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The queue is served here; `member`: with the group member (else its master has none).
    Serving { member: bool },
    /// The member's copy is of a deleted queue: abandon the member (releasing nothing).
    Stale,
    /// The metadata moved on (another home, another incarnation) or the broker never
    /// applied the promotion: not served here; the member, if any, leaves.
    Moved,
    /// The copy could not be opened (storage failed).
    Failed,
}

/// What the broker said to [`Action::Open`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opened {
    /// The copy is the queue.
    Yes,
    /// Storage could not open it.
    Failed,
    /// The broker has not applied the promotion yet; `exists`: it serves the queue already
    /// (opened before).
    NotYet { exists: bool },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Flushing,
    AwaitingOldMaster,
    /// Waiting for the broker until `deadline`; `asked`: an `Open` is out.
    Opening {
        deadline: Instant,
        asked: bool,
    },
    Done,
}

/// One promotion of `vhost`/`queue` to node `me`.
#[derive(Debug)]
pub struct Adoption {
    vhost: String,
    queue: String,
    me: NodeId,
    incarnation: u64,
    epoch: u64,
    follower: Option<Follower>,
    stage: Stage,
    actions: VecDeque<Action>,
}

impl Adoption {
    /// Starts the promotion `state` shows (the queue homed on `me`), with the member
    /// `follower` if this node's mirror followed the group.
    pub fn start(
        state: &MetaState,
        vhost: &str,
        queue: &str,
        me: NodeId,
        follower: Option<Follower>,
        now: Instant,
    ) -> Adoption {
        let key = (vhost.to_string(), queue.to_string());
        let set = state.mirror_sets.get(&key);
        let mut a = Adoption {
            vhost: key.0,
            queue: key.1,
            me,
            incarnation: set.map_or(0, |s| s.incarnation),
            epoch: set.map_or(0, |s| s.epoch),
            follower,
            stage: Stage::Done,
            actions: VecDeque::new(),
        };
        match follower {
            Some(f) if f.incarnation != a.incarnation => {
                a.actions.push_back(Action::DropCopy {
                    incarnation: f.incarnation,
                });
                a.finish(Outcome::Stale);
            }
            Some(_) => {
                a.stage = Stage::Flushing;
                a.actions.push_back(Action::Flush { epoch: a.epoch });
            }
            None => a.open(now),
        }
        a
    }

    /// The `Flush` lap came round (`ok`), or cannot (the member stopped, the lap failed).
    pub fn handle_flushed(&mut self, ok: bool, state: &MetaState, now: Instant) {
        if self.stage != Stage::Flushing {
            return;
        }
        if !ok {
            // Served as the copy is, without a member.
            self.follower = None;
            self.open(now);
            return;
        }
        self.stage = Stage::AwaitingOldMaster;
        self.handle_view(state, now);
    }

    /// The metadata changed (or the member delivered: the old master's member may be
    /// known now, [`Adoption::set_master_member`]).
    pub fn handle_view(&mut self, state: &MetaState, now: Instant) {
        if self.stage != Stage::AwaitingOldMaster {
            return;
        }
        if self.moved(state) {
            self.finish(Outcome::Moved);
            return;
        }
        if !self.old_master_alive(state) {
            self.open(now);
        }
    }

    /// The member delivered from `member`, the old master's.
    pub fn set_master_member(&mut self, member: MemberId) {
        if let Some(f) = self.follower.as_mut().filter(|f| f.master == member.node) {
            f.master_member = Some(member);
        }
    }

    /// The member stopped (before the copy was opened): served as the copy is, without it.
    pub fn handle_member_stopped(&mut self, now: Instant) {
        match self.stage {
            Stage::Flushing => {
                self.follower = None;
                self.open(now);
            }
            Stage::AwaitingOldMaster => self.finish(Outcome::Moved),
            Stage::Opening { .. } | Stage::Done => {}
        }
    }

    /// The broker's answer to [`Action::Open`].
    pub fn handle_open(&mut self, opened: Opened, state: &MetaState, now: Instant) {
        let Stage::Opening { deadline, .. } = self.stage else {
            return;
        };
        match opened {
            Opened::Yes | Opened::NotYet { exists: true } => self.finish(Outcome::Serving {
                member: self.follower.is_some(),
            }),
            Opened::Failed => self.finish(Outcome::Failed),
            Opened::NotYet { exists: false } => {
                self.stage = Stage::Opening {
                    deadline,
                    asked: false,
                };
                self.retry(state, now);
            }
        }
    }

    /// The broker applied a metadata change: ask it again if it has not opened the copy.
    pub fn handle_broker_changed(&mut self, state: &MetaState, now: Instant) {
        if matches!(self.stage, Stage::Opening { asked: false, .. }) {
            self.ask(state, now);
        }
    }

    /// Time passed: the wait for the broker ends at its deadline.
    pub fn handle_tick(&mut self, now: Instant) {
        if let Stage::Opening { deadline, .. } = self.stage {
            if now >= deadline {
                self.finish(Outcome::Moved);
            }
        }
    }

    /// When [`Adoption::handle_tick`] must be called next, if ever.
    pub fn deadline(&self) -> Option<Instant> {
        match self.stage {
            Stage::Opening { deadline, .. } => Some(deadline),
            _ => None,
        }
    }

    /// The next action, oldest first.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Whether the member's events are to be followed (its flush lap or the old master's
    /// leave is awaited): the runtime writes what it delivers, as a mirror does.
    pub fn following(&self) -> bool {
        matches!(self.stage, Stage::Flushing | Stage::AwaitingOldMaster)
    }

    /// Whether the promotion is over (its `Finish` polled or not).
    pub fn is_done(&self) -> bool {
        self.stage == Stage::Done
    }

    fn open(&mut self, now: Instant) {
        // Rounds are shipped from the queue's first one on: it is not served before the
        // broker opens it.
        if self.follower.is_some() {
            self.actions.push_back(Action::Ship {
                epoch: self.epoch,
                incarnation: self.incarnation,
            });
        }
        self.stage = Stage::Opening {
            deadline: now.plus_millis(OPEN_WAIT_MS),
            asked: true,
        };
        self.actions.push_back(Action::Open {
            incarnation: self.incarnation,
        });
    }

    /// After a `NotYet`: asked again on the broker's next change, unless the metadata no
    /// longer homes the queue here.
    fn retry(&mut self, state: &MetaState, now: Instant) {
        if self.home(state) != Some(self.me) {
            self.finish(Outcome::Moved);
        } else {
            self.handle_tick(now);
        }
    }

    fn ask(&mut self, state: &MetaState, now: Instant) {
        let Stage::Opening { deadline, .. } = self.stage else {
            return;
        };
        if self.home(state) != Some(self.me) {
            self.finish(Outcome::Moved);
            return;
        }
        self.stage = Stage::Opening {
            deadline,
            asked: true,
        };
        self.actions.push_back(Action::Open {
            incarnation: self.incarnation,
        });
        self.handle_tick(now);
    }

    fn finish(&mut self, outcome: Outcome) {
        self.stage = Stage::Done;
        self.actions.push_back(Action::Finish(outcome));
    }

    fn home(&self, state: &MetaState) -> Option<NodeId> {
        state
            .vhosts
            .get(&self.vhost)
            .and_then(|v| v.queues.get(&self.queue))
            .map(|d| d.home)
    }

    fn moved(&self, state: &MetaState) -> bool {
        let key = (self.vhost.clone(), self.queue.clone());
        self.home(state) != Some(self.me)
            || state.mirror_sets.get(&key).map_or(0, |s| s.incarnation) != self.incarnation
    }

    /// Whether the old master's member is still alive in the group (a planned move whose
    /// old master has not left yet).
    fn old_master_alive(&self, state: &MetaState) -> bool {
        let Some(f) = self.follower else {
            return false;
        };
        if f.master == self.me {
            return false;
        }
        let group = group_name(&self.vhost, &self.queue, self.incarnation);
        state.gm_groups.get(&group).is_some_and(|g| {
            match f.master_member.filter(|mm| mm.node == f.master) {
                Some(mm) => g.members.contains(&Slot::Alive(mm)),
                None => g.has_live_member_on(f.master),
            }
        })
    }
}

#[cfg(test)]
mod tests;
