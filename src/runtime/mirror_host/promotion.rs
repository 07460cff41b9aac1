//! Promotion: a mirror whose node became the queue's home flushes the group, waits for a
//! planned move's old master to leave, opens its copy as crash recovery does and serves the
//! queue, in the steps `mirror::adoption` decides; a master restarted with mirrors hands over
//! to a synchronised one; a controlled stop hands every queue mastered here to a mirror.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use tokio::sync::Notify;

use super::mirror::abandon_holding;
use super::{
    policy_of, promote_to, Followed, Inner, Key, Membership, MirrorHost, Shipping, StorageDisk,
};

use crate::gm::Slot;
use crate::meta::state::MirrorSet;
use crate::meta::MetaState;
use crate::meta::NodeId;
use crate::mirror::adoption::{Action, Adoption, Follower, Opened, Outcome};
use crate::mirror::message::group_name;
use crate::mirror::message::MirrorMsg;
use crate::runtime::gm_host::{GmError, GmNet};

/// A flush lap under way.
type Lap = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), GmError>> + Send>>;

impl<N: GmNet + Clone, D: StorageDisk> Inner<N, D> {
    /// Promotion ([`Adoption`]): flush lap, the old master's leave, then this node's copy
    /// becomes the queue. Returns the membership to go on as master with.
    pub(super) async fn adopt(
        &self,
        key: &Key,
        mut member: Option<Membership>,
    ) -> Option<Membership> {
        let follower = member.as_ref().map(|m| Follower {
            incarnation: m.incarnation,
            master: m.master,
            master_member: m.master_member,
        });
        let mut a = Adoption::start(
            &self.raft.snapshot(),
            &key.0,
            &key.1,
            self.node,
            follower,
            self.clock.now(),
        );
        let mut views = self.raft.subscribe();
        let mut lap: Option<Lap> = None;
        let mut broker_changed: Option<Arc<Notify>> = None;
        loop {
            while let Some(action) = a.poll_action() {
                match action {
                    Action::Flush { epoch } => {
                        lap = member.as_ref().map(|m| {
                            let msg = Bytes::from(MirrorMsg::Flush { epoch }.encode());
                            Box::pin(m.handle.sender().confirmed_broadcast(msg)) as Lap
                        });
                    }
                    Action::DropCopy { incarnation } => self.drop_copy(key, incarnation).await,
                    Action::Ship { epoch, incarnation } => {
                        if let Some(m) = &member {
                            self.masters
                                .insert(key.clone(), Shipping::of(&m.handle, epoch, incarnation));
                        }
                    }
                    Action::Open { incarnation } => {
                        // Registered before the attempt, so no change of the broker's is
                        // missed: woken by its next one, not polled.
                        let changed = Arc::new(Notify::new());
                        let wake = changed.clone();
                        self.broker
                            .on_next_change(Box::new(move || wake.notify_one()));
                        broker_changed = Some(changed);
                        let opened = self.open_copy(key, incarnation).await;
                        a.handle_open(opened, &self.raft.snapshot(), self.clock.now());
                    }
                    Action::Finish(outcome) => {
                        return match outcome {
                            Outcome::Serving { member: true } => member,
                            Outcome::Stale => {
                                tracing::info!(queue = %key.1, "the promoted mirror's copy is of a deleted queue");
                                if let Some(m) = member.as_mut() {
                                    abandon_holding(m).await;
                                }
                                None
                            }
                            Outcome::Moved => {
                                tracing::info!(queue = %key.1, "the promotion here was overtaken by the metadata");
                                None
                            }
                            Outcome::Serving { member: false } | Outcome::Failed => None,
                        };
                    }
                }
            }
            let wait = a.deadline().map(|d| d.millis_since(self.clock.now()));
            let following = a.following();
            tokio::select! {
                r = async { lap.as_mut().expect("guarded").await }, if lap.is_some() => {
                    lap = None;
                    if r.is_err() {
                        tracing::warn!(queue = %key.1, "the promoted mirror's flush did not complete; serving its copy as it is");
                        member = None;
                    }
                    a.handle_flushed(r.is_ok(), &self.raft.snapshot(), self.clock.now());
                }
                ev = async { member.as_mut().expect("guarded").handle.next_event().await },
                    if following && member.is_some() =>
                {
                    let Some(m) = member.as_mut() else { continue };
                    if self.follow_event(key, m, ev).await != Followed::Going {
                        lap = None;
                        member = None;
                        a.handle_member_stopped(self.clock.now());
                    } else if let Some(mm) = m.master_member {
                        a.set_master_member(mm);
                        a.handle_view(&self.raft.snapshot(), self.clock.now());
                    }
                }
                changed = views.changed() => {
                    if changed.is_err() {
                        return None;
                    }
                    a.handle_view(&self.raft.snapshot(), self.clock.now());
                }
                () = async { broker_changed.as_ref().expect("guarded").notified().await },
                    if broker_changed.is_some() =>
                {
                    broker_changed = None;
                    a.handle_broker_changed(&self.raft.snapshot(), self.clock.now());
                }
                () = tokio::time::sleep(Duration::from_millis(wait.unwrap_or(0).max(1))),
                    if wait.is_some() =>
                {
                    a.handle_tick(self.clock.now());
                }
            }
        }
    }

    /// Asks the broker to open this node's copy of `key` as the queue.
    async fn open_copy(&self, key: &Key, incarnation: u64) -> Opened {
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
                let epoch = self
                    .raft
                    .snapshot()
                    .mirror_sets
                    .get(key)
                    .map_or(0, |s| s.epoch);
                tracing::warn!(queue = %key.1, epoch, messages = len, "mirror promoted: this node is the queue's master");
                Opened::Yes
            }
            Some(Err(e)) => {
                // A full disk or an I/O error: this node cannot serve the queue, and while
                // the metadata names it the master no other node may. Storage fails as on
                // any write error, so the node exits for its supervisor
                // (`runtime::node::monitor`); restarted, it is a new incarnation whose
                // mirror is unsynchronised, and the queue goes to a synchronised mirror
                // elsewhere. Retrying here kept the queue down for good (bug 28).
                tracing::error!(queue = %key.1, error = %e, "cannot open the promoted mirror's copy: storage fails, the node exits");
                self.storage.fail_with(e);
                Opened::Failed
            }
            None => Opened::NotYet {
                exists: self.broker.queue(&key.0, &key.1).is_some(),
            },
        }
    }

    /// A master whose node restarted before it was recorded down: hands the queue to the
    /// oldest synchronised mirror whose member is still alive in the group on a node the
    /// failure detector sees running (its copy is the queue as the old master last shipped
    /// it), under a new epoch, as the reconciler would have after a `NodeDown`. Whether or
    /// not the promotion commits, this node's member is new, so no lap of the old one can
    /// complete. `false`: no such mirror, or the metadata moved on; serve from disk.
    pub(super) async fn hand_over_after_restart(
        &self,
        key: &Key,
        state: &MetaState,
        set: &MirrorSet,
    ) -> bool {
        let Some(node) =
            crate::mirror::lease::hand_over_after_restart(state, &key.0, &key.1, self.node, |n| {
                !self.broker.node_is_down(n)
            })
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
    pub(super) async fn unsync_all(&self, key: &Key, incarnation: u64, epoch: u64) {
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
}

impl<N: GmNet + Clone, D: StorageDisk> MirrorHost<N, D> {
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
        // One deadline for the proposals and the waits: with the other nodes stopping too
        // (a whole-cluster stop), every proposal would wait out its own timeout, one queue
        // after another, and the node would not stop for minutes.
        let deadline = tokio::time::Instant::now() + within;
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
            let proposal = inner.raft.propose(promote_to(&key, set, node));
            match tokio::time::timeout_at(deadline, proposal).await {
                Ok(Ok(r)) if r.outcome.is_ok() => {
                    tracing::info!(queue = %key.1, to = node, "handing the queue over");
                    moving.push((key, shipping.member, shipping.incarnation));
                }
                Ok(other) => {
                    tracing::warn!(queue = %key.1, outcome = ?other.map(|r| r.outcome), "cannot hand the queue over")
                }
                Err(_) => {
                    tracing::warn!(queue = %key.1, "cannot hand the queue over: out of time")
                }
            }
        }
        for (key, member, incarnation) in moving {
            let group = group_name(&key.0, &key.1, incarnation);
            // Woken by each metadata change, not polled.
            let mut views = inner.raft.subscribe();
            while inner
                .raft
                .snapshot()
                .gm_groups
                .get(&group)
                .is_some_and(|g| g.members.contains(&Slot::Alive(member)))
            {
                match tokio::time::timeout_at(deadline, views.changed()).await {
                    Ok(Ok(())) => {}
                    _ => break,
                }
            }
        }
    }
}
