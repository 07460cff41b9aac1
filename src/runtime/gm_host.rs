//! The GM host: runs a node's GM members ([`crate::gm::Member`]) and carries their messages
//! over the node links.
//!
//! - **Views** come from the metadata: every member task follows the applied state
//!   ([`MetaRaft::subscribe`]) and hands each newer group record to its member. Joins,
//!   leaves and alias erasures are compare-and-set commands on the record's version
//!   ([`Command::GmGroup`]); deaths are recorded by the metadata itself when the failure
//!   detector's `NodeDown` (or a restarted node's new incarnation) is applied. A member cut
//!   off from the majority therefore keeps its old view, and its laps cannot complete.
//! - **Messages** go to the right neighbour through one sender task per (member, right
//!   neighbour) stream, numbered and resent until accepted ([`crate::gm::wire`]), so a lost
//!   frame or a dropped link costs a retry, not a message. The receiving host routes them to
//!   the member's task.
//! - **Flushing**: a member task takes every command that is ready, then flushes once, so
//!   under load a flush carries many broadcasts and when idle each goes at once.
//!
//! The network is a trait ([`GmNet`]): the node links in production, turmoil's simulated
//! TCP in the simulation, which runs this same code.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use crate::gm::{
    late_join, Event, GmMsg, GmReply, GroupRecord, Inbox, LateJoin, Member, MemberId, PubNum, Slot,
};
use crate::meta::Command;
use crate::runtime::raft::{MetaRaft, NodeId, ProposeError, TransportError};

mod member_task;

use member_task::MemberTask;

/// Carries a GM frame to another node's host and brings its reply back.
pub trait GmNet: Send + Sync + 'static {
    /// Sends `frame` to node `to` and returns the reply, within `deadline`.
    fn call(
        &self,
        to: NodeId,
        frame: Vec<u8>,
        deadline: Duration,
    ) -> impl Future<Output = Result<Vec<u8>, TransportError>> + Send;
}

/// Timings of a host.
#[derive(Clone, Debug)]
pub struct GmHostConfig {
    /// How long a sender waits for a frame's reply before resending.
    pub call_timeout: Duration,
    /// Pause after a failed or refused send.
    pub retry_after: Duration,
    /// Messages per frame at most.
    pub max_batch: usize,
    /// Payload bytes per frame at most, well under the node link's frame limit (at least
    /// 16 MiB): a message bigger than this goes alone, in parts of this size.
    pub max_batch_bytes: usize,
    /// Own broadcasts are flushed as one activity once they hold this many bytes (so a
    /// burst pipelines instead of travelling as one message sent in parts).
    pub max_activity_bytes: usize,
    /// Pause between compare-and-set attempts that lost a race.
    pub cas_retry: Duration,
    /// Attempts for a join, leave or erase before giving up.
    pub cas_attempts: usize,
    /// Where each confirmed broadcast's lap time goes (`warren_gm_lap_latency_seconds`).
    pub lap_latency: Option<Histogram>,
}

impl Default for GmHostConfig {
    fn default() -> Self {
        GmHostConfig {
            call_timeout: Duration::from_secs(2),
            retry_after: Duration::from_millis(50),
            max_batch: 256,
            max_batch_bytes: 8 << 20,
            max_activity_bytes: 4 << 20,
            cas_retry: Duration::from_millis(20),
            cas_attempts: 200,
            lap_latency: None,
        }
    }
}

/// Why a GM operation failed.
#[derive(Debug, thiserror::Error)]
pub enum GmError {
    /// The member is no longer in the group (declared dead, or left).
    #[error("the GM member has stopped")]
    Stopped,
    /// The metadata would not take the membership change.
    #[error("cannot change GM group '{group}': {reason}")]
    Membership {
        /// The group.
        group: String,
        /// Why.
        reason: String,
    },
}

type Route = mpsc::UnboundedSender<Vec<GmMsg<Bytes>>>;

/// Commands a member task takes before it flushes, at most (flush when idle or past this).
const FLUSH_AFTER: usize = 512;
/// How long a join tries to learn whether its proposal of unknown outcome committed.
const SETTLE_WITHIN: Duration = Duration::from_secs(30);
/// One quorum read's bound within that.
const SETTLE_ATTEMPT: Duration = Duration::from_secs(2);

struct Inner<N> {
    node: NodeId,
    net: N,
    raft: MetaRaft,
    cfg: GmHostConfig,
    routes: Mutex<BTreeMap<(String, MemberId), Route>>,
    inbox: Mutex<Inbox>,
    /// Joins on this node one at a time: two at once into one group would predict the same
    /// member id, and the loser's cleanup would remove the winner's route.
    joining: tokio::sync::Mutex<()>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One node's GM members. Clones share them.
pub struct GmHost<N> {
    inner: Arc<Inner<N>>,
}

impl<N> Clone for GmHost<N> {
    fn clone(&self) -> Self {
        GmHost {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<N> std::fmt::Debug for GmHost<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GmHost")
            .field("node", &self.inner.node)
            .finish_non_exhaustive()
    }
}

enum Cmd {
    Broadcast(Bytes),
    Confirmed(Bytes, oneshot::Sender<Result<(), GmError>>),
    Release(MemberId, PubNum),
    /// Leave; `drain`: once nothing of this member is in flight.
    Leave {
        tx: oneshot::Sender<Result<(), GmError>>,
        drain: bool,
    },
}

/// The application's end of one member.
#[derive(Debug)]
pub struct GmHandle {
    id: MemberId,
    group: String,
    cmds: mpsc::UnboundedSender<Cmd>,
    events: mpsc::UnboundedReceiver<Event<Bytes>>,
}

impl std::fmt::Debug for Cmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Cmd::Broadcast(_) => "Broadcast",
            Cmd::Confirmed(..) => "Confirmed",
            Cmd::Release(..) => "Release",
            Cmd::Leave { .. } => "Leave",
        })
    }
}

/// A clonable sender for one member's broadcasts and releases (the application may send
/// from several places, e.g. the storage syncer, while one task reads the events).
#[derive(Debug, Clone)]
pub struct GmSender {
    cmds: mpsc::UnboundedSender<Cmd>,
}

impl GmSender {
    /// Broadcasts `msg`; see [`GmHandle::confirmed_broadcast`].
    pub fn confirmed_broadcast(
        &self,
        msg: Bytes,
    ) -> impl Future<Output = Result<(), GmError>> + Send + 'static {
        confirmed(&self.cmds, msg)
    }

    /// Broadcasts `msg` without waiting for its lap.
    pub fn broadcast(&self, msg: Bytes) -> Result<(), GmError> {
        self.cmds
            .send(Cmd::Broadcast(msg))
            .map_err(|_| GmError::Stopped)
    }

    /// Leaves the group; see [`GmHandle::leave`]. With durable acks the owner must go on
    /// releasing what is delivered meanwhile: the drain waits for it.
    pub fn leave(&self) -> impl Future<Output = Result<(), GmError>> + Send + 'static {
        self.leave_as(true)
    }

    /// Leaves the group now, as if this member had died: recorded dead at once, without
    /// waiting for what is in flight. For an owner that holds back a release on purpose
    /// (a mirror whose copy is not what the master thinks): a draining leave would wait
    /// for that release forever. Safe as a crash is: the ring repairs itself around a dead
    /// member, and the owner's copy must no longer be counted on (recorded first).
    pub fn abandon(&self) -> impl Future<Output = Result<(), GmError>> + Send + 'static {
        self.leave_as(false)
    }

    fn leave_as(&self, drain: bool) -> impl Future<Output = Result<(), GmError>> + Send + 'static {
        let (tx, rx) = oneshot::channel();
        let sent = self.cmds.send(Cmd::Leave { tx, drain }).is_ok();
        async move {
            if !sent {
                return Err(GmError::Stopped);
            }
            rx.await.unwrap_or(Err(GmError::Stopped))
        }
    }
}

fn confirmed(
    cmds: &mpsc::UnboundedSender<Cmd>,
    msg: Bytes,
) -> impl Future<Output = Result<(), GmError>> + Send + 'static {
    let (tx, rx) = oneshot::channel();
    let sent = cmds.send(Cmd::Confirmed(msg, tx)).is_ok();
    async move {
        if !sent {
            return Err(GmError::Stopped);
        }
        rx.await.unwrap_or(Err(GmError::Stopped))
    }
}

impl GmHandle {
    /// A clonable sender for this member's broadcasts.
    pub fn sender(&self) -> GmSender {
        GmSender {
            cmds: self.cmds.clone(),
        }
    }

    /// This member.
    pub fn id(&self) -> MemberId {
        self.id
    }

    /// Its group.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// Broadcasts `msg` (delivered here at once, as an event).
    pub fn broadcast(&self, msg: Bytes) -> Result<(), GmError> {
        self.cmds
            .send(Cmd::Broadcast(msg))
            .map_err(|_| GmError::Stopped)
    }

    /// Broadcasts `msg`; the future completes once it has made a full lap (with durable
    /// acks: once every member released it), or fails if the member stops first.
    pub fn confirmed_broadcast(
        &self,
        msg: Bytes,
    ) -> impl Future<Output = Result<(), GmError>> + Send + 'static {
        confirmed(&self.cmds, msg)
    }

    /// Durable acks: `origin`'s publishes up to `upto` are durable here.
    pub fn release(&self, origin: MemberId, upto: PubNum) {
        let _ = self.cmds.send(Cmd::Release(origin, upto));
    }

    /// The next event: `Joined` first, then deliveries (own broadcasts included) and
    /// membership changes; `Stopped` last. `None` once the member task is gone.
    pub async fn next_event(&mut self) -> Option<Event<Bytes>> {
        self.events.recv().await
    }

    /// The next event if one is ready.
    pub fn try_event(&mut self) -> Option<Event<Bytes>> {
        self.events.try_recv().ok()
    }

    /// Leaves the group: waits until nothing of this member is in flight (drain before
    /// stop), then records it dead, so the rest carry on without waiting for a timeout.
    pub async fn leave(&self) -> Result<(), GmError> {
        self.sender().leave().await
    }
}

impl<N: GmNet + Clone> GmHost<N> {
    /// A host for node `node`, following `raft`'s metadata and sending over `net`.
    pub fn new(node: NodeId, net: N, raft: MetaRaft, cfg: GmHostConfig) -> GmHost<N> {
        GmHost {
            inner: Arc::new(Inner {
                node,
                net,
                raft,
                cfg,
                routes: Mutex::new(BTreeMap::new()),
                inbox: Mutex::new(Inbox::new()),
                joining: tokio::sync::Mutex::new(()),
            }),
        }
    }

    /// The node.
    pub fn node(&self) -> NodeId {
        self.inner.node
    }

    /// Answers a frame from another node's host (the server side of [`GmNet::call`]).
    pub fn handle_frame(&self, payload: &[u8]) -> Vec<u8> {
        let reply = match crate::gm::wire::decode_frame(payload) {
            Err(e) => {
                tracing::warn!(node = self.inner.node, "undecodable GM frame: {e}");
                GmReply::NoMember
            }
            Ok(frame) => {
                let route = lock(&self.inner.routes)
                    .get(&(frame.group.clone(), frame.to))
                    .cloned();
                match route {
                    None => GmReply::NoMember,
                    Some(route) => {
                        let (msgs, reply) = lock(&self.inner.inbox).accept(frame);
                        if msgs.is_empty() || route.send(msgs).is_ok() {
                            reply
                        } else {
                            GmReply::NoMember
                        }
                    }
                }
            }
        };
        bincode::serialize(&reply).unwrap_or_default()
    }

    /// Joins `group` (creating it when it does not exist) as a new member at the end of the
    /// ring, and starts the member. With `durable_acks`, the owner must
    /// [`release`](GmHandle::release) what it delivers (see [`Member::with_durable_acks`]).
    pub async fn join(&self, group: &str, durable_acks: bool) -> Result<GmHandle, GmError> {
        let inner = &self.inner;
        let _one_at_a_time = inner.joining.lock().await;
        for _ in 0..inner.cfg.cas_attempts {
            let current = inner
                .raft
                .snapshot()
                .gm_groups
                .get(group)
                .cloned()
                .unwrap_or_default();
            let me = MemberId {
                node: inner.node,
                since: current.version + 1,
            };
            let mut members = current.members.clone();
            members.push(Slot::Alive(me));
            // The route exists before the record names us: the left neighbour's catch-up
            // may arrive before the member task starts, and waits in the channel.
            let (route_tx, route_rx) = mpsc::unbounded_channel();
            lock(&inner.routes).insert((group.to_string(), me), route_tx);
            let cmd = Command::GmGroup {
                name: group.to_string(),
                expected_version: current.version,
                members,
            };
            match inner.raft.propose(cmd).await {
                Ok(resp) if resp.outcome.is_ok() => {
                    match self.wait_for_version(group, me.since).await {
                        Ok(record) => {
                            return Ok(self.start_member(
                                group,
                                me,
                                &record,
                                durable_acks,
                                route_rx,
                            ))
                        }
                        Err(e) => {
                            lock(&inner.routes).remove(&(group.to_string(), me));
                            self.bury_late_join(group, me);
                            return Err(e);
                        }
                    }
                }
                Ok(_) => {}
                Err(e) if !e.outcome_unknown() => {
                    tracing::debug!(group, "gm join: {e}");
                }
                Err(e) => {
                    // It may have committed, or may yet: a quorum read settles which. Waiting
                    // for our version instead waited for ever when the entry died with its
                    // leader (bug 20).
                    tracing::debug!(group, "gm join, outcome unknown: {e}");
                    match self.settled_record(group).await {
                        Ok(record) if record.members.contains(&Slot::Alive(me)) => {
                            return Ok(self.start_member(
                                group,
                                me,
                                &record,
                                durable_acks,
                                route_rx,
                            ));
                        }
                        // Not committed when read, but it may commit yet (bug 26).
                        Ok(_) => self.bury_late_join(group, me),
                        Err(e) => {
                            lock(&inner.routes).remove(&(group.to_string(), me));
                            self.bury_late_join(group, me);
                            return Err(e);
                        }
                    }
                }
            }
            lock(&inner.routes).remove(&(group.to_string(), me));
            tokio::time::sleep(inner.cfg.cas_retry).await;
        }
        Err(GmError::Membership {
            group: group.to_string(),
            reason: "too many lost compare-and-set races".into(),
        })
    }

    /// `group`'s record as of a read index from a leader, applied here: it shows a join
    /// that committed. One it does not show can still commit: a proposal forwarded to the
    /// leader may reach its log after the read (bug 26), which
    /// [`GmHost::bury_late_join`] answers. Retried while no leader answers, for as long as
    /// [`GmHost::wait_for_version`] would wait.
    async fn settled_record(&self, group: &str) -> Result<GroupRecord, GmError> {
        let inner = &self.inner;
        let deadline = tokio::time::Instant::now() + SETTLE_WITHIN;
        loop {
            match inner.raft.quorum_snapshot(SETTLE_ATTEMPT).await {
                Ok(state) => return Ok(state.gm_groups.get(group).cloned().unwrap_or_default()),
                Err(ProposeError::Stopped(reason)) => {
                    return Err(GmError::Membership {
                        group: group.to_string(),
                        reason,
                    })
                }
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(GmError::Membership {
                        group: group.to_string(),
                        reason: format!("could not learn whether a join committed: {e}"),
                    })
                }
                Err(e) => {
                    tracing::debug!(group, "gm join, settling an unknown outcome: {e}");
                    tokio::time::sleep(inner.cfg.cas_retry).await;
                }
            }
        }
    }

    /// Follows `group`'s record until the join of `me` this host gave up on is settled
    /// ([`late_join`]), and records `me` dead if it committed: no task runs behind it, and
    /// a live member that nobody runs stalls every lap of the ring (bug 26).
    fn bury_late_join(&self, group: &str, me: MemberId) {
        let host = self.clone();
        let group = group.to_string();
        let mut views = self.inner.raft.subscribe();
        tokio::spawn(async move {
            loop {
                let record = views
                    .borrow_and_update()
                    .state
                    .gm_groups
                    .get(&group)
                    .cloned();
                match late_join(record.as_ref(), me) {
                    LateJoin::Never => return,
                    LateJoin::Named => break,
                    LateJoin::Pending => {
                        if views.changed().await.is_err() {
                            return;
                        }
                    }
                }
            }
            {
                // A later attempt made while the record had not moved proposes the same id,
                // and owns it if it committed. Joins hold this lock until they are done.
                let _joins = host.inner.joining.lock().await;
                if lock(&host.inner.routes).contains_key(&(group.clone(), me)) {
                    return;
                }
            }
            tracing::info!(%group, since = me.since, "a join given up on committed late: recording it dead");
            if let Err(e) = member_task::record_dead(host, group.clone(), me).await {
                tracing::warn!(%group, "cannot record a late join dead: {e}");
            }
        });
    }

    /// Waits until the local metadata has `group` at `version` or later (bounded).
    async fn wait_for_version(&self, group: &str, version: u64) -> Result<GroupRecord, GmError> {
        let mut views = self.inner.raft.subscribe();
        let wait = async {
            loop {
                if let Some(r) = views.borrow_and_update().state.gm_groups.get(group) {
                    if r.version >= version {
                        return Some(r.clone());
                    }
                }
                if views.changed().await.is_err() {
                    return None;
                }
            }
        };
        match tokio::time::timeout(Duration::from_secs(30), wait).await {
            Ok(Some(r)) => Ok(r),
            _ => Err(GmError::Membership {
                group: group.to_string(),
                reason: "the metadata did not reach the new record".into(),
            }),
        }
    }

    fn start_member(
        &self,
        group: &str,
        me: MemberId,
        record: &GroupRecord,
        durable_acks: bool,
        route_rx: mpsc::UnboundedReceiver<Vec<GmMsg<Bytes>>>,
    ) -> GmHandle {
        let member = Member::new(me, record);
        let member = if durable_acks {
            member.with_durable_acks()
        } else {
            member
        };
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let (ev_tx, ev_rx) = mpsc::unbounded_channel();
        let task = MemberTask {
            host: self.clone(),
            group: group.to_string(),
            me,
            member,
            senders: BTreeMap::new(),
            confirms: BTreeMap::new(),
            next_token: 0,
            leaving: None,
            drain: true,
            events: ev_tx,
        };
        // The span is the task's (`instrument`), not entered across its awaits: an entered
        // guard would stay on the worker thread and label other tasks' logs with it.
        let span = tracing::info_span!("gm", node = me.node, group = %group, since = me.since);
        tokio::spawn(
            task.run(cmd_rx, route_rx, self.inner.raft.subscribe())
                .instrument(span),
        );
        GmHandle {
            id: me,
            group: group.to_string(),
            cmds: cmd_tx,
            events: ev_rx,
        }
    }

    /// Commits `change` to `group`'s record by compare-and-set, retrying on lost races,
    /// until `done` says the record no longer needs it.
    async fn change_record(
        &self,
        group: &str,
        done: impl Fn(&GroupRecord) -> bool,
        change: impl Fn(&GroupRecord) -> Vec<Slot>,
    ) -> Result<(), GmError> {
        let inner = &self.inner;
        let mut last = String::new();
        for _ in 0..inner.cfg.cas_attempts {
            let Some(current) = inner.raft.snapshot().gm_groups.get(group).cloned() else {
                return Ok(());
            };
            if done(&current) {
                return Ok(());
            }
            let cmd = Command::GmGroup {
                name: group.to_string(),
                expected_version: current.version,
                members: change(&current),
            };
            match inner.raft.propose(cmd).await {
                Ok(resp) => {
                    if let Err(r) = resp.outcome {
                        last = format!("{r:?}");
                    }
                }
                Err(ProposeError::Stopped(e)) => {
                    return Err(GmError::Membership {
                        group: group.to_string(),
                        reason: e,
                    })
                }
                Err(e) => last = e.to_string(),
            }
            // Let the local metadata catch up with whatever won.
            tokio::time::sleep(inner.cfg.cas_retry).await;
        }
        Err(GmError::Membership {
            group: group.to_string(),
            reason: last,
        })
    }
}
