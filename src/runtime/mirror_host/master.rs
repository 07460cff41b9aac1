//! The master role: ship each round to the mirrors and hold its confirms for the lap, keep
//! the lease, and feed the sync core (`mirror::master`, carried out by `sync.rs`) the
//! group's members, the mirrors' sync messages, the metadata and a look at the queue.

use std::sync::Arc;
use std::time::Duration;

use super::mirror::leave;
use super::sync::SyncTasks;
use super::tasks::kick;
use super::{
    incarnation_of, lock, policy_of, role_of, Inner, Key, Membership, Role, Shipping, StorageDisk,
};
use crate::gm::Event;
use crate::gm::MemberId;
use crate::gm::Slot;
use crate::meta::state::MirrorRecord;
use crate::meta::Command;
use crate::meta::NodeId;
use crate::meta::SyncMode;
use crate::mirror::master::{Look, MasterRole, SetView};
use crate::mirror::message::group_name;
use crate::mirror::message::MirrorMsg;
use crate::runtime::gm_host::GmNet;
use crate::runtime::raft::MetaView;

impl<N: GmNet + Clone, D: StorageDisk> Inner<N, D> {
    /// Records `node`'s mirror as (un)synchronised. `as_master`: the epoch this node masters
    /// the queue under; the change is made only while the metadata still says so (the
    /// compare-and-set on the set's version makes that hold when it commits), so a deposed
    /// master can neither vouch for a mirror nor unsync the new master's. `None`: a mirror
    /// giving up on its own copy (always allowed: it can only prevent a promotion). The
    /// master vouches for a mirror with `member`, the member that acknowledged its sync
    /// ([`Command::MarkSynchronised`], applied only while that member lives). `Some`: the
    /// metadata holds the state at that log index (a later one than this node may have
    /// applied yet).
    pub(super) async fn set_synchronised(
        &self,
        key: &Key,
        incarnation: u64,
        member: Option<MemberId>,
        node: NodeId,
        synchronised: bool,
        as_master: Option<u64>,
    ) -> Option<u64> {
        for _ in 0..10 {
            let view = self.raft.view();
            let state = view.state;
            let set = state.mirror_sets.get(key)?;
            if set.incarnation != incarnation {
                // The queue is another one now: nothing about the old one's mirrors
                // applies to it.
                return None;
            }
            if let Some(epoch) = as_master {
                if self.home_of(&state, key) != Some(self.node) || set.epoch != epoch {
                    return None;
                }
            } else if node != self.node {
                return None;
            }
            if let Some(mid) = member {
                let alive = state
                    .gm_groups
                    .get(&group_name(&key.0, &key.1, incarnation))
                    .is_some_and(|g| g.members.contains(&Slot::Alive(mid)));
                if !alive {
                    return None;
                }
            }
            if !set.mirrors.iter().any(|m| m.node == node) {
                return None;
            }
            if set
                .mirrors
                .iter()
                .all(|m| m.node != node || m.synchronised == synchronised)
            {
                return Some(view.applied_index.unwrap_or(0));
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
            let cmd = match (synchronised, member, as_master) {
                // Applied only while that member lives (bug 27): a proposal of unknown
                // outcome can commit after it died and its node joined again.
                (true, Some(member), Some(epoch)) => Command::MarkSynchronised {
                    vhost: key.0.clone(),
                    queue: key.1.clone(),
                    incarnation,
                    epoch,
                    member,
                },
                _ => Command::SetMirrors {
                    vhost: key.0.clone(),
                    queue: key.1.clone(),
                    expected_version: set.version,
                    mirrors,
                },
            };
            match self.raft.propose(cmd).await {
                Ok(r) if r.outcome.is_ok() => {
                    tracing::info!(queue = %key.1, node, synchronised, "mirror state recorded");
                    return Some(r.index);
                }
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        None
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
        let me = m.handle.id();
        // The syncs: decided by the core (`mirror::master`), carried out by `drive_syncs`.
        let mut core = MasterRole::new(
            me,
            epoch,
            m.members.clone(),
            set_view(&self.raft.view(), key),
            !fresh,
        );
        let (mut tasks, mut done) = SyncTasks::new();
        let mut views = self.raft.subscribe();
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        // Not held through the master's life (see `tasks::queue_task`).
        drop(state);
        loop {
            self.drive_syncs(key, &m, &mut core, &mut tasks, incarnation)
                .await;
            if std::mem::take(&mut tasks.tick_now) {
                tick.reset_immediately();
            }
            tokio::select! {
                ev = m.handle.next_event() => match ev {
                    None | Some(Event::Stopped) => {
                        // The member is gone (dead in the group record, or the host
                        // stopping): this epoch's confirms are over here.
                        lock(&self.fenced).insert(key.clone(), (incarnation, epoch));
                        break;
                    }
                    Some(Event::Deliver { from, num, msg }) => {
                        if let Some(msg) = MirrorMsg::decode(&msg) {
                            core.handle_message(from, &msg);
                        }
                        m.handle.release(from, num)
                    }
                    Some(ev) => {
                        Self::track(&mut m, &ev);
                        // The set as it stands now: a member joins a node the view may
                        // not show as a mirror yet.
                        core.handle_view(set_view(&self.raft.view(), key));
                        core.handle_members(&m.members);
                    }
                },
                Some(report) = done.recv() => report.report(&mut core),
                _ = tick.tick() => {
                    let look = if core.syncing() {
                        Look {
                            low_seq: self.storage.low_seq(&key.0, &key.1),
                            unindexed: self.holds_unindexed(key),
                        }
                    } else {
                        Look { low_seq: None, unindexed: false }
                    };
                    core.handle_tick(self.clock.now(), look);
                }
                changed = views.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    let view = self.raft.view();
                    if role_of(&view.state, &self.broker, key, self.node) != Role::Master
                        || incarnation_of(&view.state, key) != incarnation
                    {
                        break;
                    }
                    core.handle_view(set_view(&view, key));
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
        // Its syncs' tasks stop with it.
        drop(tasks);
        // Leave in good order (in-flight rounds first), so the others go on without a
        // timeout, and a promoted mirror knows no more rounds come from here. A deposed
        // master's member is dead already: that fails at once.
        leave(&mut m).await;
        tracing::info!(queue = %key.1, "no longer the master");
    }
}

/// The metadata's view of `key`'s mirror set, as the sync core needs it.
fn set_view(view: &MetaView, key: &Key) -> SetView {
    let state = &view.state;
    let set = state.mirror_sets.get(key);
    SetView {
        mirrors: set
            .map(|s| s.mirrors.iter().map(|m| (m.node, m.synchronised)).collect())
            .unwrap_or_default(),
        automatic: policy_of(state, key).is_some_and(|p| p.sync_mode == SyncMode::Automatic),
        requests: set.map_or((0, 0), |s| (s.sync_requests, s.cancel_requests)),
        applied: view.applied_index.unwrap_or(0),
    }
}
