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
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::gm::{
    Batch, Event, GmFrame, GmMsg, GmReply, GroupRecord, Inbox, Member, MemberId, Outbox, PubNum,
    Slot,
};
use crate::meta::Command;
use crate::runtime::raft::{MetaRaft, MetaView, NodeId, ProposeError, TransportError};

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
    Leave(oneshot::Sender<Result<(), GmError>>),
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
            Cmd::Leave(_) => "Leave",
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
        let (tx, rx) = oneshot::channel();
        let sent = self.cmds.send(Cmd::Leave(tx)).is_ok();
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
        let (tx, rx) = oneshot::channel();
        self.cmds
            .send(Cmd::Leave(tx))
            .map_err(|_| GmError::Stopped)?;
        rx.await.unwrap_or(Err(GmError::Stopped))
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
                    let record = self.wait_for_version(group, me.since).await?;
                    return Ok(self.start_member(group, me, &record, durable_acks, route_rx));
                }
                Ok(_) => {}
                Err(e) if !e.outcome_unknown() => {
                    tracing::debug!(group, "gm join: {e}");
                }
                Err(e) => {
                    // It may have committed: the record tells.
                    tracing::debug!(group, "gm join, outcome unknown: {e}");
                    if let Ok(record) = self.wait_for_version(group, me.since).await {
                        if record.members.contains(&Slot::Alive(me)) {
                            return Ok(self.start_member(
                                group,
                                me,
                                &record,
                                durable_acks,
                                route_rx,
                            ));
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

/// One member's task: the state machine, its commands, its inbound messages, its views.
struct MemberTask<N> {
    host: GmHost<N>,
    group: String,
    me: MemberId,
    member: Member<Bytes>,
    senders: BTreeMap<MemberId, (mpsc::UnboundedSender<GmMsg<Bytes>>, JoinHandle<()>)>,
    /// Confirmed broadcasts whose lap is not over, with when they were taken.
    confirms: BTreeMap<u64, (oneshot::Sender<Result<(), GmError>>, tokio::time::Instant)>,
    next_token: u64,
    leaving: Option<oneshot::Sender<Result<(), GmError>>>,
    events: mpsc::UnboundedSender<Event<Bytes>>,
}

impl<N: GmNet + Clone> MemberTask<N> {
    async fn run(
        mut self,
        mut cmds: mpsc::UnboundedReceiver<Cmd>,
        mut inbound: mpsc::UnboundedReceiver<Vec<GmMsg<Bytes>>>,
        mut views: watch::Receiver<MetaView>,
    ) {
        // A view newer than the one it was built with may already be applied.
        self.on_view(&views.borrow_and_update());
        self.pump();
        let mut cmds_open = true;
        while !self.member.is_stopped() {
            tokio::select! {
                cmd = cmds.recv(), if cmds_open => match cmd {
                    Some(cmd) => {
                        let mut bytes = self.on_cmd(cmd);
                        // Everything else that is ready goes in the same flush, up to a
                        // count (so a steady stream still flushes); an activity that
                        // reached its byte size leaves at once (it must fit a frame).
                        let mut taken = 1;
                        while taken < FLUSH_AFTER {
                            if bytes >= self.host.inner.cfg.max_activity_bytes {
                                self.member.flush();
                                bytes = 0;
                            }
                            let Ok(cmd) = cmds.try_recv() else { break };
                            bytes += self.on_cmd(cmd);
                            taken += 1;
                        }
                        self.member.flush();
                    }
                    // The handle is gone: keep carrying the others' traffic until the
                    // metadata drops us.
                    None => cmds_open = false,
                },
                msgs = inbound.recv() => match msgs {
                    Some(msgs) => {
                        for msg in msgs {
                            self.member.handle_message(msg);
                        }
                        while let Ok(msgs) = inbound.try_recv() {
                            for msg in msgs {
                                self.member.handle_message(msg);
                            }
                        }
                    }
                    None => break,
                },
                changed = views.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    self.on_view(&views.borrow_and_update());
                }
            }
            self.pump();
            self.maybe_leave();
        }
        if self.member.is_orphaned() {
            // Still alive in the record: dead there, or it would hold the others up.
            tracing::info!("member orphaned (everyone who could catch it up died first): leaving");
            let record = record_dead(self.host.clone(), self.group.clone(), self.me);
            tokio::spawn(async move {
                if let Err(e) = record.await {
                    tracing::warn!(error = %e, "cannot record an orphaned member dead");
                }
            });
        }
        self.stop();
    }

    /// Takes a command; returns the bytes it broadcast (buffered until the next flush).
    fn on_cmd(&mut self, cmd: Cmd) -> usize {
        match cmd {
            Cmd::Broadcast(msg) => {
                let n = msg.len();
                self.member.broadcast(msg);
                n
            }
            Cmd::Confirmed(msg, tx) => {
                let n = msg.len();
                let token = self.next_token;
                self.next_token += 1;
                self.confirms
                    .insert(token, (tx, tokio::time::Instant::now()));
                // Flushed with the rest of the batch (see `run`).
                self.member.confirmed_broadcast_buffered(msg, token);
                n
            }
            Cmd::Release(origin, upto) => {
                self.member.release(origin, upto);
                0
            }
            Cmd::Leave(tx) => {
                self.leaving = Some(tx);
                0
            }
        }
    }

    fn on_view(&mut self, view: &MetaView) {
        match view.state.gm_groups.get(&self.group) {
            Some(record) => {
                self.member.handle_view(record);
                // Alive, or newer than this record (joined in a view not seen here yet).
                let alive = |id: MemberId| {
                    id.since > record.version || record.members.contains(&Slot::Alive(id))
                };
                lock(&self.host.inner.inbox).drop_parts_unless(&self.group, alive);
            }
            // The group was forgotten: as good as dropped from it.
            None => self.member.handle_view(&GroupRecord {
                version: u64::MAX,
                members: Vec::new(),
            }),
        }
    }

    /// Moves the member's output: messages to their streams, events to the owner.
    fn pump(&mut self) {
        while let Some((to, msg)) = self.member.poll_transmit() {
            self.sender(to).0.send(msg).ok();
        }
        while let Some(event) = self.member.poll_event() {
            match event {
                Event::Confirmed(token) => {
                    if let Some((tx, taken)) = self.confirms.remove(&token) {
                        if let Some(h) = &self.host.inner.cfg.lap_latency {
                            h.observe(taken.elapsed().as_secs_f64());
                        }
                        let _ = tx.send(Ok(()));
                    }
                }
                Event::EraseAliases(ids) => {
                    let host = self.host.clone();
                    let group = self.group.clone();
                    tokio::spawn(async move {
                        let gone = |r: &GroupRecord| {
                            !r.members
                                .iter()
                                .any(|s| matches!(s, Slot::Dead(id) if ids.contains(id)))
                        };
                        let erase = |r: &GroupRecord| {
                            r.members
                                .iter()
                                .copied()
                                .filter(|s| !matches!(s, Slot::Dead(id) if ids.contains(id)))
                                .collect()
                        };
                        if let Err(e) = host.change_record(&group, gone, erase).await {
                            tracing::warn!(%group, "cannot erase dead GM members: {e}");
                        }
                    });
                }
                other => {
                    let _ = self.events.send(other);
                }
            }
        }
        // A stream lives as long as its receiver: a member that was our right neighbour
        // and becomes it again must get the rest of the same numbered stream (a new one
        // would restart at 1 and be taken for a resend). Streams to dead members go.
        let view = self.member.view();
        self.senders.retain(|to, (_, task)| {
            let keep = view.is_alive(*to);
            if !keep {
                task.abort();
            }
            keep
        });
    }

    fn sender(&mut self, to: MemberId) -> &(mpsc::UnboundedSender<GmMsg<Bytes>>, JoinHandle<()>) {
        let host = self.host.clone();
        let group = self.group.clone();
        let me = self.me;
        self.senders.entry(to).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            let task = tokio::spawn(run_sender(host, group, me, to, rx));
            (tx, task)
        })
    }

    fn maybe_leave(&mut self) {
        if self.leaving.is_none() || !self.member.is_quiet() {
            return;
        }
        let Some(tx) = self.leaving.take() else {
            return;
        };
        let record = record_dead(self.host.clone(), self.group.clone(), self.me);
        tokio::spawn(async move {
            let _ = tx.send(record.await);
        });
    }

    fn stop(&mut self) {
        for (_, (_, task)) in std::mem::take(&mut self.senders) {
            task.abort();
        }
        for (_, (tx, _)) in std::mem::take(&mut self.confirms) {
            let _ = tx.send(Err(GmError::Stopped));
        }
        let inner = &self.host.inner;
        lock(&inner.routes).remove(&(self.group.clone(), self.me));
        lock(&inner.inbox).forget(&self.group, self.me);
        let _ = self.events.send(Event::Stopped);
    }
}

/// Marks member `me` dead in `group`'s record (a leave, or an orphaned member's exit).
async fn record_dead<N: GmNet + Clone>(
    host: GmHost<N>,
    group: String,
    me: MemberId,
) -> Result<(), GmError> {
    let gone = |r: &GroupRecord| !r.members.contains(&Slot::Alive(me));
    let dead = |r: &GroupRecord| {
        r.members
            .iter()
            .map(|s| {
                if *s == Slot::Alive(me) {
                    Slot::Dead(me)
                } else {
                    *s
                }
            })
            .collect()
    };
    host.change_record(&group, gone, dead).await
}

/// One stream: sends `rx`'s messages to member `to`, one batch in flight, resending until
/// accepted.
async fn run_sender<N: GmNet + Clone>(
    host: GmHost<N>,
    group: String,
    from: MemberId,
    to: MemberId,
    mut rx: mpsc::UnboundedReceiver<GmMsg<Bytes>>,
) {
    let inner = &host.inner;
    let mut outbox = Outbox::new();
    // Halved after a failed send, so a batch too large for a frame gets through in parts.
    let mut max_batch = inner.cfg.max_batch;
    loop {
        if outbox.is_empty() {
            match rx.recv().await {
                Some(msg) => outbox.push(msg),
                None => return,
            }
        }
        while let Ok(msg) = rx.try_recv() {
            outbox.push(msg);
        }
        let Some(batch) = outbox.batch(max_batch, inner.cfg.max_batch_bytes) else {
            // Nothing to send (or an unencodable message, logged): wait for more.
            match rx.recv().await {
                Some(msg) => outbox.push(msg),
                None => return,
            }
            continue;
        };
        let (first_seq, msgs, part) = match batch {
            Batch::Msgs { first_seq, msgs } => (first_seq, msgs, None),
            Batch::Part { seq, part } => (seq, Vec::new(), Some(part)),
        };
        let frame = GmFrame {
            group: group.clone(),
            from,
            to,
            first_seq,
            msgs,
            part,
        };
        let Ok(bytes) = bincode::serialize(&frame) else {
            tracing::error!(%group, "cannot encode a GM frame");
            return;
        };
        // A member on this node (two members of one group on one node) needs no link.
        let sent = if to.node == inner.node {
            Ok(host.handle_frame(&bytes))
        } else {
            inner.net.call(to.node, bytes, inner.cfg.call_timeout).await
        };
        let reply = match sent {
            Ok(r) => bincode::deserialize::<GmReply>(&r).ok(),
            Err(e) => {
                tracing::debug!(%group, to = to.node, "gm send: {e}");
                None
            }
        };
        match reply {
            Some(GmReply::Accepted { upto }) => {
                outbox.accepted(upto);
                max_batch = inner.cfg.max_batch;
            }
            Some(GmReply::Partial { upto, have }) => outbox.partial(upto, have),
            Some(GmReply::NoMember) => tokio::time::sleep(inner.cfg.retry_after).await,
            None => {
                max_batch = (max_batch / 2).max(1);
                tokio::time::sleep(inner.cfg.retry_after).await;
            }
        }
    }
}
